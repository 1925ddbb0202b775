"""The direct launcher's cache key (CPU): two argument lists share a kept kernel only if
Triton specializes them alike.

The reference is Triton's own specialization of each parameter
(``native_specialize_impl``, what ``JITFunction.run`` keys its compiled kernels on:
tensor dtype and 16-byte alignment, an int's width and whether it is 1 or a multiple
of 16, unless the parameter says not to, constexprs by value). For every parameter of
the fill and merge kernels and every pair of values from a pool that covers each of
those classes' edges, with the other arguments fixed: where Triton tells the two
apart, so must the key. (A finer key only keeps a second copy of a compiled kernel.)
"""

import itertools

import pytest
import torch
import triton

from tq_chunked.runtime import dequant, merge
from tq_chunked.runtime._utils import Launcher

native = pytest.importorskip(
    "triton._C.libtriton",
    reason="Triton's native_specialize_impl is the reference",
)
if not hasattr(native, "native_specialize_impl"):
    pytest.skip(
        f"Triton {triton.__version__} has no native_specialize_impl, the reference",
        allow_module_level=True,
    )
from triton.backends.compiler import BaseBackend  # noqa: E402

KERNELS = {"fill": dequant._fill_kernel, "merge": merge._merge_kernel}

_BASE = torch.zeros(4096, dtype=torch.uint8)
TENSORS = [
    _BASE[16:48],
    _BASE[24:64],  # 8 bytes off 16-byte alignment
    _BASE[32:96].view(torch.float16),
    _BASE[64:128].view(torch.int32),
    _BASE[128:256].view(torch.bfloat16),
]
INTS = [0, 1, 2, 8, 15, 16, 17, 24, 32, 2**31 - 1, 2**31, 2**31 + 1, 2**32, 2**63]
INTS += [-1, -16, -(2**31), -(2**31) - 1]
PLAIN = TENSORS + INTS + [True, False, None, 0.5, 2.0]
CONSTEXPRS = [1, 16, 64, True, False, 0.5, None]
OPTIONS = (("num_warps", 4),)


def _launcher(kernel):
    """A Launcher of the kernel as it is compiled for a GPU: under the interpreter
    ``@triton.jit`` gives a function without the parameters' specialization, which is
    rebuilt from the decorator's arguments."""
    if not hasattr(kernel, "params"):
        options = {
            k: v
            for k, v in kernel.kwargs.items()
            if k in ("do_not_specialize", "do_not_specialize_on_alignment") and v
        }
        kernel = triton.runtime.jit.JITFunction(kernel.fn, **options)
    launcher = Launcher(kernel)
    assert launcher._kinds is not None
    return launcher


def triton_classes(args, params):
    return tuple(
        ("constexpr", a)
        if p.is_constexpr
        else native.native_specialize_impl(
            BaseBackend,
            a,
            p.is_const,
            not p.do_not_specialize,
            not p.do_not_specialize_on_alignment,
        )
        for a, p in zip(args, params)
    )


def _show(x):
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor at byte {x.data_ptr() - _BASE.data_ptr()}"
    return repr(x)


def test_the_kernels_have_parameters_of_every_kind():
    """The fill and the merge have do-not-specialize ints, specialized ints, tensors
    and constexprs: the pool below meets each kind."""
    kinds = {k for kernel in KERNELS.values() for k in _launcher(kernel)._kinds}
    assert {"constexpr", "int+align", "free+align"} <= kinds


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_key_tells_apart_what_triton_does(name):
    launcher = _launcher(KERNELS[name])
    params = launcher.kernel.params
    base = [True if p.is_constexpr else 17 for p in params]
    missed = []
    for i, p in enumerate(params):
        pool = CONSTEXPRS if p.is_constexpr else PLAIN
        for x, y in itertools.combinations(pool, 2):
            a, b = list(base), list(base)
            a[i], b[i] = x, y
            key_a = launcher._key(a, OPTIONS, 0)
            assert key_a == launcher._key(list(a), OPTIONS, 0)  # the same, the same key
            if key_a == launcher._key(b, OPTIONS, 0) and triton_classes(
                a, params
            ) != triton_classes(b, params):
                missed.append(f"{p.name}: {_show(x)} and {_show(y)}")
    assert not missed, f"{name}: one key where Triton has two: {missed[:8]}"


def test_the_device_and_the_options_are_in_the_key():
    launcher = _launcher(KERNELS["merge"])
    args = [True if p.is_constexpr else 17 for p in launcher.kernel.params]
    keys = {
        launcher._key(args, OPTIONS, 0),
        launcher._key(args, OPTIONS, 1),
        launcher._key(args, (("num_warps", 8),), 0),
    }
    assert len(keys) == 3
