"""The workspace of a continuation prefill, its exact size, and how a long request's
kv heads are grouped to stay within a budget.

All scratch memory lives in one flat uint8 buffer, carved into regions (each start
aligned to 256 bytes). A window holds ``C`` key rows (``capacity``: the window, or
more than the batch's N query tokens when that is larger; plan.py says why). Every
layout starts with the rotation's parts and flags (``dequant.split_rotation``), written
once per call and read by every window's fill:

        rot_parts     (3, D, D)       fp16         the rotation: two parts, its signs
        rot_flags     (ceil(D*D/1024) + 1,) int32  whether it has one magnitude and the
                                           Sylvester signs: the fill's un-rotation

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
in ``out``'s own bytes for the final merge.

Within a budget (``max_bytes``, default 128 MiB) the batch window is shortened where its
K/V would not fit (``fit_window``), and a long request takes a window of its own from
the bytes its state leaves (``long_window``): the kv-head group (all heads, or a divisor
of them, each group dequantizing only its own heads) whose window holds the most K/V.
Nothing here depends on the cached lengths or the number of requests:
``workspace_bytes`` is the largest layout a call of N query tokens can pick, given that
many bytes as its workspace.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ._utils import as_int
from .dequant import split_flags

ALIGN = 256
# K + V of a batch window's rows: the whole budget less the rotation's parts (384 KiB
# at D 256). Measured against 96 MiB: 0.84-0.96x the GPU time on four batches of
# requests that fit a window (fewer windows, fewer partly idle waves at the end of the
# attention calls; benchmarks/NOTES.md §20-21); 48 MiB took 1.08-1.34x of 96 (§12). A
# long request's window is sized from what its state leaves (long_window).
DEFAULT_WINDOW_BYTES = 127 << 20
DEFAULT_WORKSPACE_BYTES = 128 << 20  # the budget: windows and a long request's state
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


def _most_rows(need, least: int, most: int, budget: int) -> int:
    """The most rows in [least, most] whose ``need(rows)`` bytes fit ``budget`` (need
    grows with rows, and need(least) fits): ``most`` itself where it fits, else the
    most on the FIT_ROWS grid, or ``least`` where the grid has none above it."""
    if need(most) <= budget:
        return most
    lo, hi = least, most  # need(lo) fits, need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return max(least, lo // FIT_ROWS * FIT_ROWS)


@functools.lru_cache(maxsize=256)
def long_window(
    rows: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int,
    dtype: torch.dtype,
    target: int,
) -> tuple[int, int]:
    """(kv heads at once, key rows per window) of a long request of ``rows`` query rows
    whose layout must fit ``target`` bytes (its float32 state and its window share
    them). Each kv-head group (a divisor of num_kv_heads) takes the most rows that fit,
    at most ``window`` (the batch windows' capacity; on the FIT_ROWS grid where that
    keeps more than ``rows``); of the groups whose window holds more than ``rows``
    rows, the one whose window holds the most K/V (rows x kv heads: the fewest windows
    for the request's cached tokens) runs, the most kv heads among equals. Where none
    fits: one kv head, rows + 1 rows (the layout is then larger than target)."""
    g = num_q_heads // num_kv_heads
    lo = rows + 1  # the last window holds the new tokens and a cached one
    best = (0, 1, lo)
    for hk_g in range(num_kv_heads, 0, -1):
        if num_kv_heads % hk_g:
            continue

        def need(cap, hk_g=hk_g):
            return layout_bytes("long", rows, g * hk_g, hk_g, head_dim, cap, dtype)

        if need(lo) > target:
            continue
        cap = _most_rows(need, lo, max(window, lo), target)
        if hk_g * cap > best[0]:
            best = (hk_g * cap, hk_g, cap)
    return best[1], best[2]


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
    lengths: the larger of the batch layout (its window shortened by ``fit_window``
    where it would not fit ``max_bytes``, default 128 MiB) and what a long request takes
    (``long_window`` within ``max_bytes``): the layout of one request of all q_tokens
    rows (``largest_layout``). A uint8 buffer of at least this many bytes on the
    query's device may be passed as ``workspace=``; pass the same budget to the call
    (``max_workspace_bytes``). A call takes the smaller of its budget and the
    workspace given as its budget, and sizes each long request's window within it
    (from its own query rows, not from the rest of the batch): a call of at most
    q_tokens query tokens fits this many bytes. A call without a workspace allocates
    what its own steps take, at most its budget.
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
    budget = DEFAULT_WORKSPACE_BYTES if max_bytes is None else max_bytes
    return largest_layout(
        q_tokens, num_q_heads, num_kv_heads, head_dim, window, dtype, budget
    )


@functools.lru_cache(maxsize=64)  # an engine asks once per layer with the same numbers
def largest_layout(
    q_tokens, num_q_heads, num_kv_heads, head_dim, window, dtype, budget
):
    """The larger of the batch layout at the fitted window and the layout of one long
    request of all q_tokens rows (``long_window`` within ``budget``). A call of at most
    q_tokens query tokens given that many bytes takes them as its budget, and each of
    its long requests fits them (one of fewer rows has a smaller state)."""
    window = fit_window(
        window, q_tokens, num_q_heads, num_kv_heads, head_dim, dtype, budget
    )
    g = num_q_heads // num_kv_heads
    cap = capacity(window, q_tokens)
    batch = layout_bytes("batch", 0, num_q_heads, num_kv_heads, head_dim, cap, dtype)
    hk_g, long_cap = long_window(
        q_tokens, num_q_heads, num_kv_heads, head_dim, cap, dtype, budget
    )
    long = layout_bytes("long", q_tokens, g * hk_g, hk_g, head_dim, long_cap, dtype)
    return max(batch, long)


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
    """The batch window a call of q_tokens query tokens uses: ``window``, or where its
    K/V would not fit ``max_bytes`` (default DEFAULT_WORKSPACE_BYTES), the most rows
    that do (on the FIT_ROWS grid), and never fewer than q_tokens + 1 (``capacity``;
    the layout is then larger than max_bytes). A long request's window is its own
    (``long_window``)."""
    budget = DEFAULT_WORKSPACE_BYTES if max_bytes is None else max_bytes

    def need(w):
        return layout_bytes("batch", 0, num_q_heads, num_kv_heads, head_dim, w, dtype)

    least = q_tokens + 1
    if window <= least:
        return window
    if need(least) > budget:
        return least
    return _most_rows(need, least, window, budget)


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
