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
import os

import pytest
import torch
import triton

from tq_chunked.runtime import dequant, merge
from tq_chunked.runtime._utils import (
    Launcher,
    check_mma_sync,
    layout,
    mma_switch_read,
    mma_sync_only,
)

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


class _Compiled:
    """A compiled kernel's stand-in: records its direct runs."""

    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *a):
        self.runs.append(a)


class _Driver:
    def __init__(self):
        self.device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return f"stream of {device}"


@pytest.fixture
def direct(monkeypatch):
    """Launcher's direct path on this CPU: a driver stand-in, no launch hooks."""
    from tq_chunked.runtime import _utils

    driver = _Driver()
    monkeypatch.setattr(triton.runtime.driver, "_active", driver)
    monkeypatch.setattr(Launcher, "direct", True)
    monkeypatch.setattr(_utils, "_hooks_set", lambda: False)
    return driver


@pytest.mark.parametrize("grid", [(5,), (5, 2)])
def test_a_bound_launch_runs_the_kept_kernel_with_the_tensors_swapped(
    grid, direct, monkeypatch
):
    """BoundLaunch: the first launch goes through the launcher, which returns the
    kernel it compiled; later ones run that kernel directly with the arguments bound
    and the given tensors in their slots (as Launcher.__call__ runs it), until the
    device changes (through the launcher again) or a hook is set."""
    from tq_chunked.runtime import _utils
    from tq_chunked.runtime._utils import BoundLaunch

    compiled = _Compiled()
    calls = []

    class Recording(Launcher):
        def __call__(self, grid, *args, **options):
            calls.append((grid, args, options))
            return compiled

    launcher = Recording(dequant._fill_kernel)
    a, b, c = (torch.zeros(4) for _ in range(3))
    bound = BoundLaunch(
        launcher, grid, (a, 7, b, "x"), {"num_warps": 4}, ((0, 0), (2, 1))
    )
    assert bound.args == [None, 7, None, "x"]  # no layer's tensor kept
    bound((a, b))
    assert calls == [(grid, (a, 7, b, "x"), {"num_warps": 4})]
    bound((c, a))
    g = grid + (1,) * (3 - len(grid))
    head = (*g, "stream of 0", "function", "metadata", None, None, None)
    assert len(compiled.runs) == 1 and len(calls) == 1
    run = compiled.runs[0]
    assert run[:9] == head and run[9] is c and run[10] == 7 and run[11] is a
    direct.device = 1  # another device: through the launcher, kept for it
    bound((b, c))
    assert len(calls) == 2 and calls[1][1][0] is b and bound.device == 1
    bound((b, c))
    assert len(compiled.runs) == 2 and compiled.runs[1][3] == "stream of 1"
    monkeypatch.setattr(_utils, "_hooks_set", lambda: True)  # a profiler's hook
    bound((a, b))
    assert len(calls) == 3 and len(compiled.runs) == 2


def test_a_bound_launch_without_a_kept_kernel_always_takes_the_launcher(direct):
    """Triton's own path (the launcher returns no kernel: interpreter, CPU tensors):
    every launch goes through it, with the bound arguments."""
    from tq_chunked.runtime._utils import BoundLaunch

    calls = []
    a, b = torch.zeros(2), torch.ones(2)
    bound = BoundLaunch(
        lambda grid, *args, **o: calls.append(args), (1,), (a, 3), {}, ((0, 0),)
    )
    for t in (a, b, a):
        bound((t,))
    assert [args[0] for args in calls] == [a, b, a] and bound.compiled is None


def test_layout_tells_apart_dtype_shape_strides_and_alignment():
    base = torch.zeros(64, dtype=torch.float16)
    t = base[:32].view(4, 8)
    same = {layout(x) for x in (t, base[16:48].view(4, 8), t.clone())}
    assert len(same) == 1
    others = [
        t.float(),
        base[:32].view(8, 4),
        base[:32].view(8, 4).t(),
        base[1:33].view(4, 8),  # 2 bytes off the alignment class
    ]
    assert len({layout(x) for x in [t, *others]}) == 5


class _Asm:
    """A compiled kernel's stand-in with its PTX."""

    def __init__(self, ptx):
        self.asm = {"ptx": ptx}


class _CudaArg:
    """A first argument that says it is on CUDA (not a tensor: Triton's own path)."""

    is_cuda = True


class _Kernel:
    """A kernel's stand-in: ``warmup`` compiles (to ``ptx``), a launch runs; each
    records the switch as it saw it."""

    def __init__(self, ptx="mma.sync.aligned.m16n8k16"):
        self.compiled = _Asm(ptx)
        self.seen = []

    def warmup(self, *args, grid, **options):
        self.seen.append(("compile", os.environ.get("DISABLE_MMA_V3")))
        return self.compiled

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.seen.append(("launch", os.environ.get("DISABLE_MMA_V3")))
            return self.compiled

        return launch


@pytest.mark.parametrize("before", [None, "0", "1"])
def test_a_mma_sync_launcher_compiles_under_tritons_switch_alone(before, monkeypatch):
    """Launcher(mma_sync=True) on CUDA arguments compiles the kernel alone under
    DISABLE_MMA_V3=1 before launching it, and leaves the environment as it found it;
    without mma_sync, or on other arguments, it launches as Triton does (NOTES.md §63).
    """
    if before is None:
        monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    else:
        monkeypatch.setenv("DISABLE_MMA_V3", before)
    kernel = _Kernel()
    Launcher(kernel, mma_sync=True)((1,), _CudaArg(), 3)
    assert kernel.seen == [("compile", "1"), ("launch", "1")]
    assert os.environ.get("DISABLE_MMA_V3") == before
    kernel.seen.clear()
    Launcher(kernel)((1,), _CudaArg(), 3)
    Launcher(kernel, mma_sync=True)((1,), torch.zeros(2), 3)  # CPU: the interpreter's
    assert kernel.seen == [("launch", before)] * 2


def test_a_kernel_compiled_to_wgmma_is_refused_by_name_before_it_runs(monkeypatch):
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    check_mma_sync(_Asm("mma.sync.aligned.m16n8k16.row.col"), "_paged_kernel")
    check_mma_sync(object(), "_paged_kernel")  # no PTX to read
    with pytest.raises(RuntimeError, match="_paged_kernel compiled to Hopper's wgmma"):
        check_mma_sync(_Asm("wgmma.mma_async.sync.aligned.m64n64k16"), "_paged_kernel")
    kernel = _Kernel("wgmma.mma_async.sync.aligned.m64n64k16")
    with pytest.raises(RuntimeError, match="wgmma"):
        Launcher(kernel, mma_sync=True)((1,), _CudaArg(), 3)
    assert kernel.seen == [("compile", "1")]  # never launched
    assert "DISABLE_MMA_V3" not in os.environ


def test_tritons_cache_key_holds_the_switch(monkeypatch):
    """This Triton reads DISABLE_MMA_V3 (``mma_switch_read``): set, it enters the
    compiled kernels' on-disk cache key, so that a kernel compiled under it is kept
    apart from one compiled without (the in-memory cache keys on the arguments
    alone)."""
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    with mma_sync_only():
        assert native.get_cache_invalidating_env_vars().get("DISABLE_MMA_V3")
    assert "DISABLE_MMA_V3" not in native.get_cache_invalidating_env_vars()
    assert mma_switch_read()
