"""Under TRITON_INTERPRET=1: every address a Triton kernel loads, stores or updates
atomically, checked against the tensors it was given.

    with reads_within_arguments() as seen:
        kernel[grid](...)
    assert "kernel" in seen.kernels

Each access (one ``tl.load``, ``tl.store`` or atomic of a block of addresses) must lie,
for every address its mask lets through, inside one tensor argument's span (its first
to its last element as its strides lay them out), and each address must be a multiple
of the element size. Otherwise ``OutOfBounds`` is raised at that access, naming the
kernel and the address (Triton's interpreter wraps it in an ``InterpreterError``). On a
GPU such an access is silent where it lands in memory the caching allocator holds for
another tensor, and an illegal- or misaligned-address fault otherwise.

What it cannot see: an access that lies wholly inside another argument than the one
its pointer came from (neighbouring views of one buffer, e.g. the workspace's
carvings); an access that straddles two of them is caught. Arguments that are not
plain tensors (tensor descriptors, ``triton.reinterpret`` wrappers) have no span here:
a kernel that reads them fails the check.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch


class OutOfBounds(AssertionError):
    pass


@dataclass
class Seen:
    loads: int = 0
    stores: int = 0
    atomics: int = 0
    spans: list = field(default_factory=list)  # (start, end, name) per tensor
    kernel: str = ""
    kernels: set = field(default_factory=set)  # every kernel checked


def _span(t: torch.Tensor, name: str):
    """(start, end, name): the bytes [start, end) that ``t``'s elements occupy."""
    if t.numel() == 0:
        return None
    lo = t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st > 0)
    first = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st < 0)
    return lo + first * t.element_size(), lo + (last + 1) * t.element_size(), name


@contextlib.contextmanager
def reads_within_arguments():
    """Checks every interpreted access in the block (module docstring)."""
    import triton
    from triton.runtime import interpreter as itp

    hooks = {
        (itp.GridExecutor, "_init_args_hst"),
        (itp.InterpreterBuilder, "create_masked_load"),
        (itp.InterpreterBuilder, "create_masked_store"),
        (itp.InterpreterBuilder, "create_atomic_rmw"),
        (itp.InterpreterBuilder, "create_atomic_cas"),
    }
    missing = sorted(f"{c.__name__}.{n}" for c, n in hooks if not hasattr(c, n))
    missing += [] if hasattr(itp, "_get_np_dtype") else ["_get_np_dtype"]
    if missing:  # an interpreter this check does not know
        raise RuntimeError(
            f"tests/bounds.py needs Triton's interpreter hooks {missing}, which "
            f"Triton {triton.__version__} does not have"
        )
    seen = Seen()
    saved = {(c, n): getattr(c, n) for c, n in hooks}

    def original(cls, name):
        return saved[(cls, name)]

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = original(itp.GridExecutor, "_init_args_hst")(
            self, args_dev, kwargs
        )
        seen.kernel = getattr(self.fn, "__name__", "kernel")
        seen.kernels.add(seen.kernel)
        seen.spans = []
        for name, a in [*zip(self.arg_names, args_hst), *kwargs_hst.items()]:
            if isinstance(a, torch.Tensor):
                span = _span(a, name)
                if span is not None:
                    seen.spans.append(span)
        return args_hst, kwargs_hst

    def check(ptrs, mask, what):
        size = np.dtype(itp._get_np_dtype(ptrs.get_element_ty())).itemsize
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        if mask is None:
            a = addr.ravel()
        else:
            a = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)]
        if a.size == 0:
            return
        lo, hi = int(a.min()), int(a.max()) + size
        if not any(s <= lo and hi <= e for s, e, _ in seen.spans):
            spans = ", ".join(f"{n} [{s:#x}, {e:#x})" for s, e, n in seen.spans)
            raise OutOfBounds(
                f"{seen.kernel}: {what} of {size}-byte elements over [{lo:#x}, {hi:#x})"
                f" is not inside one of its arguments: {spans}"
            )
        if (a % size).any():
            raise OutOfBounds(
                f"{seen.kernel}: {what} of {size}-byte elements at "
                f"{int(a[(a % size) != 0][0]):#x}, not a multiple of {size}"
            )

    def checked_load(self, ptrs, mask, other, *a, **k):
        check(ptrs, mask, "a load")
        seen.loads += 1
        return original(itp.InterpreterBuilder, "create_masked_load")(
            self, ptrs, mask, other, *a, **k
        )

    def checked_store(self, ptrs, value, mask, *a, **k):
        check(ptrs, mask, "a store")
        seen.stores += 1
        return original(itp.InterpreterBuilder, "create_masked_store")(
            self, ptrs, value, mask, *a, **k
        )

    def checked_rmw(self, op, ptr, val, mask, *a, **k):
        check(ptr, mask, "an atomic")
        seen.atomics += 1
        return original(itp.InterpreterBuilder, "create_atomic_rmw")(
            self, op, ptr, val, mask, *a, **k
        )

    def checked_cas(self, ptr, cmp, val, *a, **k):
        check(ptr, None, "an atomic compare-and-swap")
        seen.atomics += 1
        return original(itp.InterpreterBuilder, "create_atomic_cas")(
            self, ptr, cmp, val, *a, **k
        )

    patched = {
        (itp.GridExecutor, "_init_args_hst"): init_args,
        (itp.InterpreterBuilder, "create_masked_load"): checked_load,
        (itp.InterpreterBuilder, "create_masked_store"): checked_store,
        (itp.InterpreterBuilder, "create_atomic_rmw"): checked_rmw,
        (itp.InterpreterBuilder, "create_atomic_cas"): checked_cas,
    }
    try:
        for (cls, name), fn in patched.items():
            setattr(cls, name, fn)
        yield seen
    finally:
        for (cls, name), fn in saved.items():
            setattr(cls, name, fn)
