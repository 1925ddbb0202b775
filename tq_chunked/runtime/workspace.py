"""The workspace of a continuation prefill: where each region of a step's layout lies
in one caller-owned buffer.

All scratch memory lives in one flat uint8 buffer, carved into regions (each start
aligned to 256 bytes). A window holds ``C`` key rows (``capacity``: the window, or
more than the batch's N query tokens when that is larger; plan.py says why). Every
layout starts with the rotation's parts and flags (``dequant.split_rotation``), written
once per call and read by every window's fill:

        rot_parts     (3, D, D)       fp16         the rotation: two parts, its signs
        rot_flags     (ceil(D*D/1024) + 1,) int32  whether it has one magnitude and the
                                           Sylvester signs: the fill's un-rotation

    a paged run (the memory-bound path; paged.PagedPlan.regions), after those two:
        query, table, part_out, part_lse                    its scratch
        chunk_q, chunk_k, chunk_v     fp16         bf16 queries only: the run's own
                                           tokens in fp16, for the chunk's call

    batch windows (requests that fit a window; the answer is written to ``out``):
        k_buf, v_buf  (C, Hk, D)      query dtype  the window's keys and values

    a spread batch window (plan.spread_pieces) that fills R key rows (its pieces,
    own keys and gaps), answers Q query rows and whose pieces hold M query rows,
    within a batch window's bytes (the pieces' log-sum-exp is the attention call's
    own tensor):
        k_buf, v_buf  (R, Hk, D)      fp16         its keys and values
        piece_q       (M, Hq, D)      fp16         each piece's copy of its query rows
        piece_out     (M, Hq, D)      fp16         each piece's partial
        q16           (Q, Hq, D)      fp16         bf16 queries only: the query in fp16

    a long request of R query rows, Hk_g kv heads at a time with their Hq_g query heads:
        k_buf, v_buf  (C, Hk_g, D)    fp16         the window's keys and values
        state_out     (R, Hq_g, D)    float32      merged output of the windows so far
        state_lse     (Hq_g, R)       float32      its log-sum-exp
        q16           (R, Hq_g, D)    fp16         bf16 queries only: the query in fp16

A long request's and a spread window's partial results are fp16 whatever the query
dtype, so that each is rounded once to fp16, not to bf16, before the float32 merge
(benchmarks/NOTES.md §3, §67); the partial of the last window (a long request's) or
of the own keys (a spread window's) waits in ``out``'s own bytes for the final merge.

How big the windows are within a budget (default 128 MiB), and so how many bytes a
step needs, is the planner's decision (plan.py: ``fit_window``, ``long_window``,
``workspace_bytes``); this module only says where each region lies (``layout``) and
makes the views (``carve``). Nothing here depends on the cached lengths or the number
of requests.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import MappingProxyType

import torch

from .dequant import split_flags

ALIGN = 256
# K + V of a batch window's rows by default: the whole budget less the rotation's parts
# (384 KiB at D 256); measured against smaller windows in benchmarks/NOTES.md §12, §21.
DEFAULT_WINDOW_BYTES = 127 << 20
DEFAULT_WORKSPACE_BYTES = 128 << 20  # the budget: windows and a long request's state


def _aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


# a plan asks for each window's layout several times (its fit, its bytes, its views)
@functools.lru_cache(maxsize=256)
def layout(kind, rows, group_q_heads, group_kv_heads, head_dim, cap, dtype, q_rows=0):
    """{region: (byte offset, shape, dtype)} and the total bytes (with room to align
    the first region in any buffer), for a "batch", "spread" or "long" step (see the
    module docstring; ``q_rows``: a spread window's query rows, Q). Cached, so the
    mapping is read-only."""
    kv_dtype = dtype if kind == "batch" else torch.float16
    regions = {
        # first in every layout, so that one split per call serves all its steps
        "rot_parts": ((3, head_dim, head_dim), torch.float16),
        "rot_flags": ((split_flags(head_dim) + 1,), torch.int32),
        "k_buf": ((cap, group_kv_heads, head_dim), kv_dtype),
        "v_buf": ((cap, group_kv_heads, head_dim), kv_dtype),
    }
    if kind == "spread":
        regions["piece_q"] = ((rows, group_q_heads, head_dim), torch.float16)
        regions["piece_out"] = ((rows, group_q_heads, head_dim), torch.float16)
        if dtype == torch.bfloat16:
            regions["q16"] = ((q_rows, group_q_heads, head_dim), torch.float16)
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
    return MappingProxyType(offsets), end + ALIGN


def rotation_bytes(head_dim):
    """The bytes of the regions every layout starts with (the rotation's parts and
    flags): a paged run's scratch (paged.PagedPlan.regions) lies after them, so that
    a layer's windows after a paged run find the parts as its first fill wrote them."""
    parts = _aligned(3 * head_dim * head_dim * 2)
    return parts + _aligned((split_flags(head_dim) + 1) * 4)


def layout_bytes(*key):
    """The bytes of layout ``key`` (``layout``'s arguments), with room to align."""
    return layout(*key)[1]


@dataclass
class Buffers:
    rot_parts: torch.Tensor | None = None
    rot_flags: torch.Tensor | None = None
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None
    state_out: torch.Tensor | None = None
    state_lse: torch.Tensor | None = None
    q16: torch.Tensor | None = None
    piece_q: torch.Tensor | None = None
    piece_out: torch.Tensor | None = None


def carve(buffer: torch.Tensor, key: tuple) -> Buffers:
    """Views of the regions of layout ``key`` (``layout``'s arguments) inside
    ``buffer`` (uint8, contiguous, at least ``layout_bytes(*key)`` bytes), from its
    first aligned byte."""
    buf = buffer[(-buffer.data_ptr()) % ALIGN :]
    typed: dict[torch.dtype, torch.Tensor] = {}  # the buffer as each dtype
    views = {}
    for name, t, shape, strides, at in _regions(key):
        base = typed.get(t)
        if base is None:
            base = typed[t] = buf[: buf.numel() // t.itemsize * t.itemsize].view(t)
        views[name] = base.as_strided(shape, strides, base.storage_offset() + at)
    return Buffers(**views)


@functools.lru_cache(maxsize=256)
def _regions(key: tuple) -> tuple:
    """Each region of layout ``key``: (name, dtype, shape, contiguous strides, offset
    in elements of its dtype)."""
    return tuple(
        (name, t, shape, tuple(math.prod(shape[i + 1 :]) for i in range(len(shape))),
         off // t.itemsize)
        for name, (off, shape, t) in layout(*key)[0].items()
    )  # fmt: skip
