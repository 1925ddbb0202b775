"""The workspace of a continuation prefill, its exact size, and how a long request's
kv heads are grouped to stay within a budget.

All scratch memory lives in one flat uint8 buffer, carved into regions (each start
aligned to 256 bytes). A window holds ``C`` key rows (``capacity``: the window, or
more than the batch's N query tokens when that is larger; plan.py says why). Every
layout starts with the rotation's parts and flags (``dequant.split_rotation``), written
once per call and read by every window's fill:

        rot_parts     (3, D, D)       fp16         the rotation: two parts, its signs
        rot_flags     (ceil(D*D/1024) + 1,) int32  whether it has one magnitude, which

    batch windows (requests that fit a window; the answer is written to ``out``):
        k_buf, v_buf  (C, Hk, D)      query dtype  the window's keys and values

    a long request of R query rows, Hk_g kv heads at a time with their Hq_g query heads:
        k_buf, v_buf  (C, Hk_g, D)    fp16         the window's keys and values
        state_out     (R, Hq_g, D)    float32      merged output of the windows so far
        state_lse     (Hq_g, R)       float32      its log-sum-exp
        q16           (R, Hq_g, D)    fp16         bf16 queries only: the query in fp16

A long request's partial results are fp16 whatever the query dtype, so that each is
rounded once to fp16, not to bf16, before the float32 merge (bf16 partials cost
1.08-1.25x the full path's error: benchmarks/NOTES.md); its last window's partial waits
in ``out``'s own bytes for the final merge. Within a budget (``max_bytes``, default 128
MiB) a long request runs its kv heads in groups (``kv_head_group``), each group
dequantizing only its own heads, and where one kv head at a time does not fit either,
the window is shortened until it does (``fit_window``). Nothing here depends on the
cached lengths or the number of requests: ``workspace_bytes`` is the largest layout a
call of N query tokens can pick.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ._utils import as_int
from .dequant import split_flags

ALIGN = 256
# K + V of a window's rows; chosen by measurement (benchmarks/NOTES.md §12: 48 MiB took
# 1.08-1.34x as long). 127 MiB, the whole budget, took 0.84-0.96x the GPU time of this
# on four batches of requests that fit a window, but would leave a long request's state
# under 1 MiB of the budget, so long requests would split their kv heads (NOTES.md
# §20): not the default until long requests take a window of their own
DEFAULT_WINDOW_BYTES = 96 << 20
DEFAULT_WORKSPACE_BYTES = 128 << 20  # the budget that groups a long request's kv heads
FIT_ROWS = 256  # a window fitted to the budget is a multiple of this (fit_window)


def default_window(num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Key rows per window such that their K + V (2 bytes each, all kv heads) take
    DEFAULT_WINDOW_BYTES, rounded down to a multiple of block_size (at least one
    block)."""
    tokens = DEFAULT_WINDOW_BYTES // (2 * 2 * num_kv_heads * head_dim)
    return max(block_size, tokens // block_size * block_size)


def capacity(window: int, q_tokens: int) -> int:
    """Key rows a window holds: ``window``, or q_tokens + 1 if that is more (a long
    request's last window holds all its new tokens and at least one cached one)."""
    return max(window, q_tokens + 1)


def _aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


@functools.lru_cache(maxsize=64)
def layout(kind, rows, group_q_heads, group_kv_heads, head_dim, cap, dtype):
    """{region: (byte offset, shape, dtype)} and the total bytes (with room to align
    the first region in any buffer), for a "batch" or a "long" step (see the module
    docstring)."""
    kv_dtype = dtype if kind == "batch" else torch.float16
    regions = {
        # first in every layout, so that one split per call serves all its steps
        "rot_parts": ((3, head_dim, head_dim), torch.float16),
        "rot_flags": ((split_flags(head_dim) + 1,), torch.int32),
        "k_buf": ((cap, group_kv_heads, head_dim), kv_dtype),
        "v_buf": ((cap, group_kv_heads, head_dim), kv_dtype),
    }
    if kind == "long":
        regions["state_out"] = ((rows, group_q_heads, head_dim), torch.float32)
        regions["state_lse"] = ((group_q_heads, rows), torch.float32)
        if dtype == torch.bfloat16:
            regions["q16"] = ((rows, group_q_heads, head_dim), torch.float16)
    offsets, end = {}, 0
    for name, (shape, t) in regions.items():
        offsets[name] = (end, shape, t)
        n = t.itemsize
        for s in shape:
            n *= s
        end += _aligned(n)
    return offsets, end + ALIGN


def layout_bytes(kind, rows, group_q_heads, group_kv_heads, head_dim, cap, dtype):
    return layout(kind, rows, group_q_heads, group_kv_heads, head_dim, cap, dtype)[1]


def kv_head_group(
    rows: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cap: int,
    dtype: torch.dtype = torch.float16,
    max_bytes: int | None = None,
) -> int:
    """The kv heads a long request of ``rows`` query rows runs at once: the largest
    divisor of num_kv_heads whose layout fits max_bytes (default
    DEFAULT_WORKSPACE_BYTES), or 1."""
    max_bytes = DEFAULT_WORKSPACE_BYTES if max_bytes is None else max_bytes
    g = num_q_heads // num_kv_heads
    for hk_g in range(num_kv_heads, 0, -1):
        if (
            num_kv_heads % hk_g == 0
            and layout_bytes("long", rows, g * hk_g, hk_g, head_dim, cap, dtype)
            <= max_bytes
        ):
            return hk_g
    return 1


def workspace_bytes(
    q_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int,
    dtype: torch.dtype = torch.float16,
    *,
    max_bytes: int | None = None,
) -> int:
    """Exact bytes of workspace that suffice for a continuation prefill of q_tokens
    query tokens (all requests of a batch together) in ``dtype`` (the query's) with
    this window, however those tokens are split into requests and whatever the cached
    lengths: the larger of the batch layout and the layout of one long request of all
    q_tokens rows (its kv heads grouped within ``max_bytes``), at the window
    ``fit_window`` gives (shorter where one kv head at a time does not fit). A uint8
    buffer of at least this many bytes on the query's device may be passed as
    ``workspace=``; pass the same budget to the call (``max_workspace_bytes``). A
    call of fewer query tokens fits itself into a workspace of this size too (it
    takes the smaller of its budget and the workspace as its budget, then groups kv
    heads and shortens the window as that requires).
    """
    q_tokens = as_int("q_tokens", q_tokens, 0)
    num_q_heads = as_int("num_q_heads", num_q_heads, 1)
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, 1)
    head_dim = as_int("head_dim", head_dim, 1)
    window = as_int("window", window, 1)
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads})"
        )
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"dtype must be torch.float16 or torch.bfloat16 (the query's), got {dtype}"
        )
    if max_bytes is not None:
        max_bytes = as_int("max_bytes", max_bytes, 1)
    return _workspace_bytes(
        q_tokens, num_q_heads, num_kv_heads, head_dim, window, dtype, max_bytes
    )


@functools.lru_cache(maxsize=64)  # an engine asks once per layer with the same numbers
def _workspace_bytes(
    q_tokens, num_q_heads, num_kv_heads, head_dim, window, dtype, max_bytes
):
    window = fit_window(
        window, q_tokens, num_q_heads, num_kv_heads, head_dim, dtype, max_bytes
    )
    return _largest_layout(
        q_tokens,
        num_q_heads,
        num_kv_heads,
        head_dim,
        capacity(window, q_tokens),
        dtype,
        max_bytes,
    )


def _largest_layout(q_tokens, num_q_heads, num_kv_heads, head_dim, cap, dtype, budget):
    """Bytes of the larger of the batch layout and a long request of q_tokens rows (its
    kv heads grouped within ``budget``) at ``cap`` rows per window."""
    g = num_q_heads // num_kv_heads
    batch = layout_bytes("batch", 0, num_q_heads, num_kv_heads, head_dim, cap, dtype)
    hk_g = kv_head_group(
        q_tokens, num_q_heads, num_kv_heads, head_dim, cap, dtype, budget
    )
    return max(
        batch, layout_bytes("long", q_tokens, g * hk_g, hk_g, head_dim, cap, dtype)
    )


@functools.lru_cache(maxsize=64)
def fit_window(
    window: int,
    q_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    max_bytes: int | None = None,
) -> int:
    """The window a call of q_tokens query tokens uses: ``window``, or fewer rows where
    the largest layout would not fit ``max_bytes`` (default DEFAULT_WORKSPACE_BYTES)
    even one kv head at a time: then the most rows with which it fits. That happens
    where a shard has one or two kv heads, whose default window is long (196608 rows
    at Hk 1, D 128) while a long request's state grows with q_tokens; e.g. Hq 8, Hk 1,
    D 128, 8192 bf16 query tokens: 144.3 MiB at the default window, 128 MiB here
    (163072 rows: rounded down to a multiple of FIT_ROWS).
    Where no window fits (the state alone is larger), ``window`` is kept and the
    layout is larger than max_bytes, as workspace_bytes says."""
    budget = DEFAULT_WORKSPACE_BYTES if max_bytes is None else max_bytes

    def need(w):
        cap = capacity(w, q_tokens)
        return _largest_layout(
            q_tokens, num_q_heads, num_kv_heads, head_dim, cap, dtype, budget
        )

    lo = q_tokens + 1  # a window never holds fewer rows (capacity)
    if window <= lo or need(window) <= budget or need(lo) > budget:
        return window
    hi = window  # need(lo) fits, need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(mid) <= budget:
            lo = mid
        else:
            hi = mid
    # whole tiles of 256 rows where that keeps more than q_tokens
    return max(q_tokens + 1, lo // FIT_ROWS * FIT_ROWS)


@dataclass
class Buffers:
    rot_parts: torch.Tensor | None = None
    rot_flags: torch.Tensor | None = None
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None
    state_out: torch.Tensor | None = None
    state_lse: torch.Tensor | None = None
    q16: torch.Tensor | None = None


# device -> (buffer key, {layout key: Buffers}): the views of the last caller-owned
# buffer
_carved: dict = {}


def carve(
    buffer: torch.Tensor,
    kind,
    rows,
    group_q_heads,
    group_kv_heads,
    head_dim,
    cap,
    dtype,
    reuse: bool = False,
) -> Buffers:
    """Views of a layout's regions inside ``buffer`` (uint8, contiguous, large enough).

    reuse: the buffer is the caller's and lives on (an engine passes the same one to
    every layer): keep its views for the next call with the same layout, which saves
    the host the views' creation (about 20-60 us). One buffer per device is held so; a
    call with another buffer lets the old views, and the old buffer, go.
    """
    key = (kind, rows, group_q_heads, group_kv_heads, head_dim, cap, dtype)
    if not reuse:
        return _carve(buffer, layout(*key)[0])
    buffer_key = (buffer.data_ptr(), buffer.numel())
    held = _carved.get(buffer.device)
    if held is None or held[0] != buffer_key:
        held = _carved[buffer.device] = (buffer_key, {})
    views = held[1]
    if key not in views:
        if len(views) >= 8:
            # the layouts of a few steps; more would be one step's odd batch
            views.clear()
        views[key] = _carve(buffer, layout(*key)[0])
    return views[key]


def _carve(buffer, offsets):
    buf = buffer[(-buffer.data_ptr()) % ALIGN :]  # from the first aligned byte
    typed = {}
    views = {}
    for name, (off, shape, t) in offsets.items():
        if t not in typed:
            typed[t] = buf[: buf.numel() // t.itemsize * t.itemsize].view(t)
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        views[name] = typed[t].as_strided(
            shape, strides, typed[t].storage_offset() + off // t.itemsize
        )
    return Buffers(**views)
