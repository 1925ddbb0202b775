"""Helpers shared by the kernel and argument modules: where Triton runs, bf16
rounding under the interpreter, argument checks that raise ValueError naming the
argument, byte ranges of tensors and the checks that written tensors share no memory,
and a launcher that calls a compiled Triton kernel without the per-call work of
Triton's own launch path.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import os
import threading
from itertools import repeat

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------
# Where Triton runs
# ---------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host ints. triton.cdiv is a constexpr function, whose call costs
    about 5 us on the host: a few of them on every window (benchmarks/NOTES.md §38)."""
    return -(-operator.index(a) // operator.index(b))


def next_power_of_2(n: int) -> int:
    """The smallest power of two at or above the host int n (0 for 0), as
    triton.next_power_of_2 gives it, without its call's cost (cdiv)."""
    n = operator.index(n)
    return 1 << (n - 1).bit_length() if n > 1 else max(n, 0)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU under TRITON_INTERPRET=1."""
    return t.is_cuda or interpreting()


def interpreter_rounds_bf16(dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter (3.9) converts float32 to bf16 by truncation; kernels
    that store bf16 round to nearest even themselves there (``round_bf16``)."""
    return dtype == torch.bfloat16 and interpreting()


@triton.jit
def round_bf16(x, ROUND: tl.constexpr):
    """The float32 x, rounded to the nearest bf16 (ties to even) when ROUND, so that
    a truncating conversion to bf16 afterwards is exact. NaN and inf pass unchanged."""
    if ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(
            tl.float32, bitcast=True
        )
        x = tl.where((x == x) & (tl.abs(x) < float("inf")), rounded, x)
    return x


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def as_int(name, value, minimum=None, maximum=None):
    """operator.index(value) (Python and numpy ints, 0-d integer tensors on the
    CPU), or a ValueError naming the argument."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        raise ValueError(
            f"{name} must be a host integer (a {value.device} tensor would need a "
            f"synchronization), got {value!r}"
        )
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an int, got {type(value).__name__} {value!r}"
        ) from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_tensor(
    name, t, ndim, dtypes=None, device=None, unit_last=False, device_of="the query"
):
    """A ValueError naming the argument unless ``t`` is a tensor of that rank, dtype
    and device (``device_of``'s: what fixed it, for the message), and, with unit_last,
    unit stride over its last dimension."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(
            f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}"
        )
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(
            f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}"
        )
    if device is not None and t.device != device:
        raise ValueError(
            f"{name} must be on {device} ({device_of}'s device), got {t.device}"
        )
    if unit_last and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride over its last dimension, got strides "
            f"{t.stride()}"
        )


def self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory (a stride-0 or interleaved layout):
    true unless, dimension by dimension in order of stride, each stride clears the span
    of the smaller ones."""
    dims = sorted((abs(s), n) for n, s in zip(t.shape, t.stride()) if n > 1)
    reach = 0  # elements spanned by the dimensions so far, minus one
    for s, n in dims:
        if s <= reach:
            return True
        reach += (n - 1) * s
    return False


def place(t: torch.Tensor | None) -> tuple | None:
    """All that a tensor argument's checks read of it (None for None): type, address,
    dtype, shape, strides, device. Raises (AttributeError, RuntimeError: a sparse
    tensor's address) where there is none."""
    if t is None:
        return None
    return (type(t), t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)


def span(at: tuple | None) -> tuple[int, int] | None:
    """[first, last + 1) bytes the elements of a tensor occupy, from its ``place``
    ``at``; None when it has none (torch strides are never negative)."""
    if at is None:
        return None
    _, start, dtype, shape, strides, _ = at
    last = 0  # the last element's offset
    for n, s in zip(shape, strides):
        if n == 0:
            return None
        last += (n - 1) * s
    return start, start + (last + 1) * dtype.itemsize


def extent(at: tuple | None) -> int | None:
    """The bytes a tensor's elements span from its first (``span``'s length), from its
    ``place`` ``at``; None when it has none. It depends on the layout alone, so a
    layer's checks keep it with their layout key (prefill.Step.run)."""
    bounds = span(at)
    return None if bounds is None else bounds[1] - bounds[0]


def byte_span(t: torch.Tensor | None) -> tuple[int, int] | None:
    """``span`` of a tensor (None for None)."""
    return span(place(t))


def check_overlaps(written, read) -> None:
    """A ValueError naming both tensors if a written one shares bytes with another one.
    ``written`` and ``read`` are lists of (name, ``span`` or None)."""
    spans = written + read
    for i, (name, w) in enumerate(written):
        if w is None:
            continue
        for other, o in spans[i + 1 :]:
            if o is not None and w[0] < o[1] and o[0] < w[1]:
                raise ValueError(
                    f"{name} must not share memory with {other}: the call writes "
                    f"{name} while it reads {other}"
                )


# ---------------------------------------------------------------------------
# Launching Triton kernels
# ---------------------------------------------------------------------------


# Triton's switch that keeps tl.dot off Hopper's wgmma (MMA v3) while a kernel
# compiles. Read from the environment during compilation; part of the on-disk cache
# key, not of the in-memory one, so a kernel compiled under it launches later
# without it.
_MMA_V3_SWITCH = "DISABLE_MMA_V3"
_switch_lock = threading.RLock()


@contextlib.contextmanager
def mma_sync_only():
    """Inside, Triton compiles ``tl.dot`` to mma.sync, never to Hopper's wgmma
    (Triton's ``DISABLE_MMA_V3``, set for the duration alone, under a lock). The
    environment is the process's: a kernel another thread compiles meanwhile gets
    mma.sync too (slower at most, never wrong), and may be kept in Triton's on-disk
    cache under the key of one compiled without the switch."""
    with _switch_lock:
        before = os.environ.get(_MMA_V3_SWITCH)
        os.environ[_MMA_V3_SWITCH] = "1"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(_MMA_V3_SWITCH, None)
            else:
                os.environ[_MMA_V3_SWITCH] = before


@functools.cache
def mma_switch_read() -> bool:
    """Whether this Triton reads ``DISABLE_MMA_V3`` (``mma_sync_only``): it names it
    among the variables of its compiled kernels' cache key when it is set."""
    # through the module Triton's own import loads (no import of a private module)
    native = getattr(getattr(triton, "_C", None), "libtriton", None)
    listed = getattr(native, "get_cache_invalidating_env_vars", None)
    if listed is None:
        return False
    with mma_sync_only():
        return _MMA_V3_SWITCH in listed()


def check_mma_sync(compiled, name: str) -> None:
    """A RuntimeError if the compiled kernel ``compiled`` (Triton's CompiledKernel)
    holds a wgmma: a Triton that no longer reads ``DISABLE_MMA_V3`` (``mma_sync_only``),
    or the kernel compiled elsewhere first without it."""
    ptx = (getattr(compiled, "asm", None) or {}).get("ptx", "")
    if "wgmma" in ptx:
        raise RuntimeError(
            f"{name} compiled to Hopper's wgmma although Triton {triton.__version__} "
            f"was asked for mma.sync ({_MMA_V3_SWITCH}=1 while it compiled): its "
            "64-row tiles gave wrong answers there (benchmarks/NOTES.md §33); plan "
            "with block_m=32 on this Triton"
        )


def _passes_constexprs() -> bool | None:
    """Whether this Triton's CompiledKernel.run takes the constexpr arguments too (3.3
    on) or only the others (earlier); None if the launch path has another shape."""
    try:
        src = inspect.getsource(triton.runtime.jit.JITFunction.run)
    except (OSError, TypeError, AttributeError):
        return None
    if "kernel.run(" not in src:
        return None
    if "non_constexpr_vals" in src:
        return False
    return True if "bound_args.values()" in src else None


def _hooks_set() -> bool:
    """Whether a launch hook (a profiler's) is installed: Triton's own path calls it."""
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "launch_enter_hook"):
        return True  # unknown: take Triton's own path
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        # a hook, or a HookChain with some
        if hook is not None and (not hasattr(hook, "calls") or hook.calls):
            return True
    return False


def _param_kind(p) -> str:
    """How a kernel parameter enters the key: "constexpr", or "int" / "free" (whether
    Triton specializes on the value), plus "+align" where it specializes on 16-byte
    alignment."""
    if p.is_constexpr:
        return "constexpr"
    kind = "free" if p.do_not_specialize else "int"
    if not getattr(p, "do_not_specialize_on_alignment", False):
        kind += "+align"
    return kind


def _pick(positions):
    """A function of the arguments returning the tuple of those at ``positions``."""
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


def _width(x: int) -> int:
    """Triton's width class of an int: 0 for int32, 1 for int64, 2 for uint64 (and
    beyond); a few classes, so that the kept kernels stay a few whatever the values."""
    return 0 if -(2**31) <= x < 2**31 else (1 if -(2**63) <= x < 2**63 else 2)


_dtype = operator.attrgetter("dtype")
_data_ptr = operator.methodcaller("data_ptr")


class _Keyer:
    """The key of one kernel's arguments of fixed types (which positions hold
    tensors, ints and other values). It is at least as fine as Triton's
    specialization, and as cheap as C-level maps make it: each tensor's dtype, and its
    address mod 16 where Triton specializes on 16-byte alignment; each specialized
    int's value mod 16 and min(value, 2) (1 and multiples of 16 are Triton's
    classes); each int's width (int32, int64, uint64); every other value itself
    (constexprs, bools, None). Floats enter through their type, as in Triton. A finer
    key than Triton's only costs a second kept kernel, never a wrong one."""

    def __init__(self, types, kinds):
        tensor = [issubclass(t, torch.Tensor) for t in types]
        plain = [k != "constexpr" for k in kinds]
        ints = [i for i, t in enumerate(types) if t is int and plain[i]]
        spec = [i for i in ints if kinds[i].startswith("int")]
        self.tensors = _pick([i for i, t in enumerate(tensor) if t])
        self.aligned = _pick(
            [i for i, k in enumerate(kinds) if tensor[i] and k.endswith("+align")]
        )
        self.ints, self.spec = _pick(ints), _pick(spec)
        self.values = _pick(
            [
                i
                for i, t in enumerate(types)
                if not tensor[i] and i not in ints and not (t is float and plain[i])
            ]
        )

    def __call__(self, args, options, device, types):
        spec = self.spec(args)
        return (
            device,
            options,
            types,
            tuple(map(_dtype, self.tensors(args))),
            tuple(map(operator.and_, map(_data_ptr, self.aligned(args)), repeat(15))),
            tuple(map(operator.and_, spec, repeat(15))),
            tuple(map(min, spec, repeat(2))),
            tuple(map(_width, self.ints(args))),
            self.values(args),
        )


class Launcher:
    """Calls a ``@triton.jit`` kernel as ``kernel[grid](*args, **options)`` does,
    keeping the compiled kernel of each specialization and launching it directly next
    time.

    Triton's launch path binds and specializes every argument, builds a cache key
    string and checks globals on each call, which costs more host time than the launch
    itself (benchmarks/NOTES.md §4, §14, §18). The key here (``_Keyer``) is at least as
    fine as Triton's specialization (each tensor's dtype and 16-byte alignment, each
    specialized int's value class, the constexprs and options), so a kept kernel is the
    one Triton would pick. Used on CUDA only, with Triton's launch hooks unset and a
    launch path of the known shape; otherwise every call goes through
    ``kernel[grid]``. ``args`` are all of the kernel's parameters, in order, constexprs
    included. A call returns the compiled kernel it launched or kept (None where
    Triton's own path ran), for ``BoundLaunch``. mma_sync: on CUDA the kernel compiles
    under ``mma_sync_only`` and a compiled kernel holding a wgmma is refused
    (``check_mma_sync``).
    """

    direct = None  # decided on first use: _passes_constexprs(), None if unusable

    def __init__(self, kernel, mma_sync: bool = False):
        self.kernel = kernel
        # compiled under mma_sync_only and checked by check_mma_sync before it runs
        self.mma_sync = mma_sync
        self.compiled: dict = {}
        self._checked: dict = {}  # id -> the compiled kernels checked (kept alive)
        self._keyers: dict = {}  # argument types -> _Keyer
        params = getattr(kernel, "params", None)
        self._kinds = None
        if params is not None and all(hasattr(p, "do_not_specialize") for p in params):
            self._kinds = tuple(_param_kind(p) for p in params)
            self._constexpr = tuple(
                i for i, k in enumerate(self._kinds) if k == "constexpr"
            )

    def _key(self, args, options, device):
        """The kept kernel's key: the argument types (fixing which positions hold
        tensors, ints and other values), then per position what Triton specializes
        on, each group read with one itemgetter (not a loop over all parameters with
        isinstance checks: benchmarks/NOTES.md §18)."""
        types = tuple(map(type, args))
        keyer = self._keyers.get(types)
        if keyer is None:
            keyer = self._keyers[types] = _Keyer(types, self._kinds)
        return keyer(args, options, device, types)

    def __call__(self, grid, *args, **options):
        if Launcher.direct is None:
            Launcher.direct = _passes_constexprs() if self._kinds is not None else None
        if (
            not args
            or not isinstance(args[0], torch.Tensor)
            or not args[0].is_cuda
            or self._kinds is None
            or Launcher.direct is None
            or _hooks_set()
        ):
            if self.mma_sync and args and getattr(args[0], "is_cuda", False):
                self._launch(grid, args, options)
            else:
                self.kernel[grid](*args, **options)
            return None
        driver = triton.runtime.driver.active
        device = driver.get_current_device()
        key = self._key(args, tuple(sorted(options.items())), device)
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.compiled[key] = self._launch(grid, args, options)
            return compiled
        if not Launcher.direct:
            args = tuple(a for i, a in enumerate(args) if i not in self._constexpr)
        _run(compiled, tuple(grid) + (1,) * (3 - len(grid)), driver, device, args)
        return compiled

    def _launch(self, grid, args, options):
        """Triton's own launch (compiling on a first call); with ``mma_sync`` under
        ``mma_sync_only``, the kernel first compiled alone (``warmup``) and checked
        (``check_mma_sync``), so that a wgmma kernel never runs."""
        if not self.mma_sync:
            return self.kernel[grid](*args, **options)
        with mma_sync_only():
            self._check(self.kernel.warmup(*args, grid=grid, **options))
            launched = self.kernel[grid](*args, **options)
        self._check(launched)  # the one checked, from Triton's in-memory cache
        return launched

    def _check(self, compiled) -> None:
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        if compiled is not None and id(compiled) not in self._checked:
            check_mma_sync(compiled, self._name())
            self._checked[id(compiled)] = compiled

    def _name(self) -> str:
        return getattr(self.kernel, "__name__", None) or repr(self.kernel)


def _run(compiled, grid3, driver, device, args) -> None:
    """Launch a kept compiled kernel directly, on the device's current stream, as
    Triton's own launch path does once it has one (no launch hooks: the callers
    checked)."""
    compiled.run(
        *grid3,
        driver.get_current_stream(device),
        compiled.function,
        compiled.packed_metadata,
        None,
        None,
        None,
        *args,
    )


def layout_at(at: tuple) -> tuple:
    """What a launch reads of a tensor argument besides its address, from its
    ``place`` ``at``: dtype, shape, strides, and the address's 16-byte alignment class
    (Triton's specialization; ints derived from the shape and strides): two tensors of
    one layout launch alike."""
    _, address, dtype, shape, strides, _ = at
    return (dtype, shape, strides, address & 15)


def layout(t: torch.Tensor) -> tuple:
    """``layout_at`` of a tensor."""
    at = place(t)
    assert at is not None
    return layout_at(at)


class BoundLaunch:
    """One launch of a ``Launcher``'s kernel with its arguments built once, for
    launches that differ only in some tensors' addresses (a step's run, launched once
    per layer: benchmarks/NOTES.md §52). ``slots`` pairs each argument position that
    changes with an index into the tensors given to each launch. The caller launches
    it only with tensors of the layouts it was bound with (``layout``; else it binds
    again), so the arguments and the specialization are the ones the full path would
    build: the kept compiled kernel is launched as ``Launcher.__call__`` launches it,
    without the arguments or the key built again. Without a kept kernel (Triton's own
    path: the interpreter, a CPU tensor, a launch hook, another device) the launch
    goes through the launcher, with the same arguments."""

    __slots__ = ("launcher", "grid", "args", "options", "slots", "compiled", "device",
                 "_grid3")  # fmt: skip

    def __init__(self, launcher, grid, args, options, slots):
        self.launcher, self.grid, self.options = launcher, grid, options
        self.slots = slots
        # the template: the changing positions emptied (no layer's tensor kept alive)
        self.args = list(args)
        for pos, _ in slots:
            self.args[pos] = None
        self.compiled = None  # the launcher's compiled kernel, once it returned one
        self.device = None  # the device it was compiled for
        self._grid3 = tuple(grid) + (1,) * (3 - len(grid))

    def arguments(self, tensors) -> list:
        """The full argument list with ``tensors`` in their slots."""
        args = self.args.copy()
        for pos, i in self.slots:
            args[pos] = tensors[i]
        return args

    def __call__(self, tensors) -> None:
        args = self.arguments(tensors)
        compiled = self.compiled
        if compiled is not None and Launcher.direct is True and not _hooks_set():
            driver = triton.runtime.driver.active
            device = driver.get_current_device()
            if device == self.device:
                _run(compiled, self._grid3, driver, device, args)
                return
        compiled = self.launcher(self.grid, *args, **self.options)
        if compiled is not None and isinstance(self.launcher, Launcher):
            self.compiled = compiled
            self.device = triton.runtime.driver.active.get_current_device()


def layer_key(layer: tuple, layouts: tuple) -> tuple:
    """What launches read of a layer's tensors (each or None) but for their addresses:
    ``layouts``, each one's ``layout_at`` (None for None), and which of them are one
    tensor (each position's first of the same object). Two layers of one key, their
    tensors on the same device, get the same launches but for the addresses; each
    unit's key is built from it (prefill._fill_key, _paged_key, a merge's, a spread
    window's query copies')."""
    ids = [id(t) for t in layer]
    return layouts, tuple(map(ids.index, ids))


class BoundLaunches:
    """Launches (a list of (launcher, grid, arguments, options)) made with one layer's
    tensors ``layer``, kept for a step's other layers of the same key: each
    launch's arguments built once, each layer's tensors put where the first's were;
    the kept compiled kernels then launch as ``Launcher`` launches them, without the
    arguments or the launcher's key built again (benchmarks/NOTES.md §52). ``owned``:
    the step's tensors the launches take (block table, plan integers, workspace
    views), the same for every layer."""

    __slots__ = ("launches",)

    def __init__(self, launches, layer: tuple, owned: tuple):
        self.launches = tuple(
            BoundLaunch(launcher, grid, args, options, _slots(args, layer, owned))
            for launcher, grid, args, options in launches
        )

    def __call__(self, layer: tuple) -> None:
        """Launch with ``layer``'s tensors, of the key they were bound for."""
        for launch in self.launches:
            launch(layer)


def _slots(args, layer: tuple, owned: tuple) -> tuple[tuple[int, int], ...]:
    """(argument position, index in ``layer``) of each argument that is one of the
    layer's tensors. Every other tensor argument must be one of ``owned``: an argument
    made from a layer's tensor (a view) would be launched stale."""
    slots = []
    for pos, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            continue
        i = next((i for i, t in enumerate(layer) if t is a), None)
        if i is not None:
            slots.append((pos, i))
        elif not any(a is t for t in owned):
            raise AssertionError(
                f"argument {pos} is neither a layer's tensor nor the step's"
            )
    return tuple(slots)
