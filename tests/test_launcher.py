"""The direct launcher's cache key (CPU): two argument lists share a kept kernel only if
Triton would specialize them the same way.

``triton_class`` below is the plain definition of what Triton specializes a kernel on
(each tensor's dtype and 16-byte alignment, a specialized int's 1 / multiple of 16 /
other and its 32- or 64-bit width, a do-not-specialize int's width, constexprs and
other values as they are, floats by type); the launcher's key must be at least as fine.
"""

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_chunked import dequant, merge
from tq_chunked._utils import Launcher

KERNELS = {"fill": dequant._fill_kernel, "merge": merge._merge_kernel}


def _launcher(kernel):
    """A Launcher of the kernel as compiled for a GPU (under the interpreter
    ``@triton.jit`` gives a function without the parameters' specialization)."""
    fn = getattr(kernel, "fn", kernel)
    return Launcher(triton.runtime.jit.JITFunction(fn))


def triton_class(args, kinds):
    out = []
    for a, kind in zip(args, kinds):
        if isinstance(a, torch.Tensor):
            aligned = a.data_ptr() % 16 == 0 if kind.endswith("+align") else None
            out.append(("tensor", a.dtype, aligned))
        elif isinstance(a, bool) or kind == "constexpr" or a is None:
            out.append(("value", type(a), a))
        elif isinstance(a, int):
            wide = not -(2**31) <= a < 2**31
            out.append(
                ("int", wide)
                if kind.startswith("free")
                else ("int", wide, a == 1, a % 16 == 0)
            )
        elif isinstance(a, float):
            out.append(("float",))
        else:
            out.append(("value", type(a), a))
    return tuple(out)


_BASE = torch.zeros(4096, dtype=torch.uint8)
_TENSORS = [
    _BASE[16:48],
    _BASE[24:64],  # 8 bytes off 16-byte alignment
    _BASE[32:96].view(torch.float16),
    _BASE[64:128].view(torch.int32),
    _BASE[128:256].view(torch.bfloat16),
]
_INTS = [
    0,
    1,
    2,
    15,
    16,
    17,
    32,
    48,
    1000,
    1024,
    2**31 - 1,
    2**31,
    2**32,
    -1,
    -16,
    -(2**31) - 1,
]


def _argument(kind):
    if kind == "constexpr":
        return st.sampled_from([1, 16, 64, True, False, 0.5])
    return st.one_of(
        st.sampled_from(_TENSORS),
        st.sampled_from(_INTS),
        st.booleans(),
        st.none(),
        st.floats(allow_nan=False, width=32),
    )


@pytest.mark.parametrize("name", sorted(KERNELS))
@settings(max_examples=100, deadline=None, derandomize=True)
@given(data=st.data())
def test_the_key_is_at_least_as_fine_as_triton_s_specialization(name, data):
    launcher = _launcher(KERNELS[name])
    kinds = launcher._kinds
    assert kinds is not None and len(kinds) == len(launcher.kernel.arg_names)
    a = [data.draw(_argument(k)) for k in kinds]
    # b: a, with some positions redrawn (so that equal keys are likely to be tried)
    b = [
        data.draw(_argument(k)) if data.draw(st.booleans()) else x
        for x, k in zip(a, kinds)
    ]
    options = (("num_warps", 4),)
    key_a, key_b = (launcher._key(x, options, 0) for x in (a, b))
    assert key_a == launcher._key(
        list(a), options, 0
    )  # the same arguments, the same key
    if key_a == key_b:
        assert triton_class(a, kinds) == triton_class(b, kinds)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_key_tells_apart_what_triton_does(name):
    """One position at a time, each of Triton's distinctions changes the key."""
    launcher = _launcher(KERNELS[name])
    kinds = launcher._kinds
    base = [True if k == "constexpr" else 17 for k in kinds]
    pairs = {
        "constexpr": [(True, False), (16, 64)],
        "int+align": [(17, 16), (17, 1), (17, 2**31), (_TENSORS[0], _TENSORS[1])],
        "free+align": [(17, 2**31), (_TENSORS[0], _TENSORS[1])],
        "int": [(17, 16), (17, 1), (17, 2**31)],
        "free": [(17, 2**31)],
    }
    options = (("num_warps", 4),)
    for i, kind in enumerate(kinds):
        for x, y in pairs[kind] + [(_TENSORS[0], _TENSORS[2])] * (kind != "constexpr"):
            a, b = list(base), list(base)
            a[i], b[i] = x, y
            assert launcher._key(a, options, 0) != launcher._key(b, options, 0), (
                f"{name}: parameter {i} ({kind}), {_show(x)} against {_show(y)}"
            )


def _show(x):
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor at byte {x.data_ptr() - _BASE.data_ptr()}"
    return repr(x)
