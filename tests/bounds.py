"""Under TRITON_INTERPRET=1: every address a Triton kernel loads or stores, checked
against the tensors it was given.

    with reads_within_arguments() as seen:
        kernel[grid](...)
    assert seen.loads > 0

A masked-in address outside every tensor argument's span (its first to its last
element, as its strides lay them out) raises ``OutOfBounds`` naming the kernel and the
offending address. On a GPU such an access is silent when it lands in memory the
caching allocator holds for another tensor, and an illegal-address fault otherwise;
here it is caught at the load or store that makes it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np


class OutOfBounds(AssertionError):
    pass


@dataclass
class Seen:
    loads: int = 0
    stores: int = 0
    spans: list = field(default_factory=list)  # (start, end, name) per tensor
    kernel: str = ""
    kernels: set = field(default_factory=set)  # every kernel checked


def _span(t, name):
    """Bytes [start, end) that tensor ``t``'s elements occupy."""
    if t.numel() == 0:
        return None
    lo = t.data_ptr()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st > 0)
    first = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if st < 0)
    return lo + first * t.element_size(), lo + (last + 1) * t.element_size(), name


@contextlib.contextmanager
def reads_within_arguments():
    """Checks every interpreted load and store in the block (module docstring)."""
    from triton.runtime import interpreter as itp

    seen = Seen()
    init = itp.GridExecutor._init_args_hst
    load = itp.InterpreterBuilder.create_masked_load
    store = itp.InterpreterBuilder.create_masked_store

    def init_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        names = list(self.arg_names)
        seen.kernel = getattr(self.fn, "__name__", "kernel")
        seen.kernels.add(seen.kernel)
        seen.spans = []
        for name, a in list(zip(names, args_hst)) + list(kwargs_hst.items()):
            if hasattr(a, "data_ptr") and hasattr(a, "stride"):
                span = _span(a, name)
                if span is not None:
                    seen.spans.append(span)
        return args_hst, kwargs_hst

    def check(ptrs, mask, size, what):
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        a = addr[m]
        if a.size == 0:
            return
        inside = np.zeros(a.shape, dtype=bool)
        for lo, hi, _ in seen.spans:
            inside |= (a >= lo) & (a + size <= hi)
        if not inside.all():
            bad = int(a[~inside][0])
            spans = ", ".join(f"{n} [{lo:#x}, {hi:#x})" for lo, hi, n in seen.spans)
            raise OutOfBounds(
                f"{seen.kernel}: {what} of {size} bytes at {bad:#x} "
                f"({int((~inside).sum())} addresses) outside its arguments: {spans}"
            )

    def checked_load(self, ptrs, mask, other, *a, **k):
        size = np.dtype(itp._get_np_dtype(ptrs.get_element_ty())).itemsize
        check(ptrs, mask, size, "a load")
        seen.loads += 1
        return load(self, ptrs, mask, other, *a, **k)

    def checked_store(self, ptrs, value, mask, *a, **k):
        size = np.dtype(itp._get_np_dtype(ptrs.get_element_ty())).itemsize
        check(ptrs, mask, size, "a store")
        seen.stores += 1
        return store(self, ptrs, value, mask, *a, **k)

    itp.GridExecutor._init_args_hst = init_args
    itp.InterpreterBuilder.create_masked_load = checked_load
    itp.InterpreterBuilder.create_masked_store = checked_store
    try:
        yield seen
    finally:
        itp.GridExecutor._init_args_hst = init
        itp.InterpreterBuilder.create_masked_load = load
        itp.InterpreterBuilder.create_masked_store = store
