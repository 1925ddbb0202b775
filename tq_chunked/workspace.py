"""The workspace of a continuation prefill, its exact size, and how a batch is cut so that
it stays within a budget.

All scratch memory lives in one flat uint8 buffer, carved into these regions (each
start aligned to 256 bytes), for R query rows (a tile of requests), a group of ``Hk_g``
kv heads with their ``Hq_g = Hq / Hk * Hk_g`` query heads, and a window of W tokens:

    k_buf, v_buf  (W, Hk_g, D)   fp16     one window's dequantized K/V
    q_buf         (R, Hq_g, D)   fp16     the (rotated) query
    state_out     (R, Hq_g, D)   float32  running merged output over the windows
    state_lse     (Hq_g, R)      float32  its log-sum-exp
    part          (R, Hq_g, D)   fp16     with a single window and fp16 queries, its partial
                                          output, in place of the state (a smaller layout)
    q16, k16, v16 (R, Hq_g | Hk_g, D) fp16  bf16 queries only: the chunk's own Q/K/V, so
                                          that its partial output is not rounded to bf16
                                          before the merge (fp16 queries use theirs)

Within a budget (``max_bytes``, default 128 MiB), a batch is cut into tiles of whole
requests whose query rows fit with all heads at once (``tile_rows``): each request's
cached tokens are still dequantized once, and every attention call keeps all heads. A
request too long for any tile runs alone, its kv heads in groups (``kv_head_group``),
each group dequantizing only its own heads. With several windows, each window's partial
output goes into the call's output tensor, used as scratch until the chunk's own
attention writes there. Nothing here depends on the cached lengths or the number of
requests.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import torch

ALIGN = 256
DEFAULT_WINDOW_BYTES = 48 << 20  # K + V of a window's cached tokens; chosen by measurement: benchmarks/NOTES.md
DEFAULT_WORKSPACE_BYTES = 128 << 20  # the budget that cuts a batch into tiles and head groups


def default_window(num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Cached tokens per window such that their K + V (fp16, all kv heads) take
    DEFAULT_WINDOW_BYTES, rounded down to a multiple of block_size (at least one block)."""
    tokens = DEFAULT_WINDOW_BYTES // (2 * 2 * num_kv_heads * head_dim)
    return max(block_size, tokens // block_size * block_size)


def _aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


@functools.lru_cache(maxsize=64)
def layout(rows, group_q_heads, group_kv_heads, head_dim, window, dtype, single=False):
    """{region: (byte offset, shape, dtype)} and the total bytes (with room to align the
    first region in any buffer). ``single``: the layout of a call with one window and fp16
    queries, which keeps no state: its partial output has a region of its own."""
    n16 = rows if dtype == torch.bfloat16 else 0
    regions = {
        "k_buf": ((window, group_kv_heads, head_dim), torch.float16),
        "v_buf": ((window, group_kv_heads, head_dim), torch.float16),
        "q_buf": ((rows, group_q_heads, head_dim), torch.float16),
    }
    if single:
        regions["part"] = ((rows, group_q_heads, head_dim), torch.float16)
    else:
        regions.update({
            "state_out": ((rows, group_q_heads, head_dim), torch.float32),
            "state_lse": ((group_q_heads, rows), torch.float32),
            "q16": ((n16, group_q_heads, head_dim), torch.float16),
            "k16": ((n16, group_kv_heads, head_dim), torch.float16),
            "v16": ((n16, group_kv_heads, head_dim), torch.float16),
        })
    offsets, end = {}, 0
    for name, (shape, t) in regions.items():
        offsets[name] = (end, shape, t)
        n = t.itemsize
        for s in shape:
            n *= s
        end += _aligned(n)
    return offsets, end + ALIGN


def _bytes(rows, group_q_heads, group_kv_heads, head_dim, window, dtype, single=False):
    return layout(rows, group_q_heads, group_kv_heads, head_dim, window, dtype, single)[1]


def kv_head_group(rows: int, num_q_heads: int, num_kv_heads: int, head_dim: int, window: int,
                  dtype: torch.dtype = torch.float16, max_bytes: int | None = None, single: bool = False) -> int:
    """kv heads run at once for ``rows`` query rows: the largest divisor of num_kv_heads
    whose regions (``layout``) fit max_bytes (default DEFAULT_WORKSPACE_BYTES), or 1."""
    max_bytes = DEFAULT_WORKSPACE_BYTES if max_bytes is None else max_bytes
    g = num_q_heads // num_kv_heads
    for hk_g in range(num_kv_heads, 0, -1):
        if num_kv_heads % hk_g == 0 and _bytes(rows, g * hk_g, hk_g, head_dim, window, dtype, single) <= max_bytes:
            return hk_g
    return 1


def tile_rows(q_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, window: int,
              dtype: torch.dtype = torch.float16, max_bytes: int | None = None, single: bool = False) -> int:
    """Query rows a tile of requests may hold with all heads at once: q_tokens if they
    fit max_bytes, else the most that do (0 if not even one row does)."""
    max_bytes = DEFAULT_WORKSPACE_BYTES if max_bytes is None else max_bytes
    fits = lambda r: _bytes(r, num_q_heads, num_kv_heads, head_dim, window, dtype, single) <= max_bytes
    if fits(q_tokens):
        return q_tokens
    lo, hi = 0, q_tokens  # fits(lo) or lo == 0; not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo if fits(lo) else 0


def as_int(name, value, minimum=None):
    """operator.index(value) (Python and numpy ints, 0-d integer tensors on the CPU), or a
    ValueError naming the argument."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        raise ValueError(f"{name} must be a host integer (a CUDA tensor would need a synchronization), got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def workspace_bytes(q_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, window: int,
                    dtype: torch.dtype = torch.float16, *, max_bytes: int | None = None) -> int:
    """Exact bytes of workspace that suffice for a continuation prefill of q_tokens query
    tokens (all requests of a batch together) in ``dtype`` (the query's; bf16 needs fp16
    copies of the chunk) with this window, however those tokens are split into requests
    and whatever the cached lengths: the largest of the layouts the call can pick (tiles
    of requests with all heads, or one request of all q_tokens in kv-head groups). A uint8
    buffer of at least this many bytes on the query's device may be passed as
    ``workspace=``; pass the same budget to the call (``max_workspace_bytes``).
    """
    q_tokens = as_int("q_tokens", q_tokens, 0)
    num_q_heads = as_int("num_q_heads", num_q_heads, 1)
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, 1)
    head_dim = as_int("head_dim", head_dim, 1)
    window = as_int("window", window, 1)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16 (the query's), got {dtype}")
    if max_bytes is not None:
        max_bytes = as_int("max_bytes", max_bytes, 1)
    return _workspace_bytes(q_tokens, num_q_heads, num_kv_heads, head_dim, window, dtype, max_bytes)


@functools.lru_cache(maxsize=64)  # an engine asks once per layer with the same numbers
def _workspace_bytes(q_tokens, num_q_heads, num_kv_heads, head_dim, window, dtype, max_bytes):
    rows = tile_rows(q_tokens, num_q_heads, num_kv_heads, head_dim, window, dtype, max_bytes)
    if rows == q_tokens:
        return _bytes(q_tokens, num_q_heads, num_kv_heads, head_dim, window, dtype)
    hk_g = kv_head_group(q_tokens, num_q_heads, num_kv_heads, head_dim, window, dtype, max_bytes)
    alone = _bytes(q_tokens, num_q_heads // num_kv_heads * hk_g, hk_g, head_dim, window, dtype)
    return max(alone, _bytes(rows, num_q_heads, num_kv_heads, head_dim, window, dtype) if rows else 0)


@dataclass
class Buffers:
    k_buf: torch.Tensor | None = None
    v_buf: torch.Tensor | None = None
    q_buf: torch.Tensor | None = None
    state_out: torch.Tensor | None = None
    state_lse: torch.Tensor | None = None
    part: torch.Tensor | None = None
    q16: torch.Tensor | None = None
    k16: torch.Tensor | None = None
    v16: torch.Tensor | None = None


_carved: dict = {}  # device -> (buffer key, {layout key: Buffers}): the views of the last caller-owned buffer


def carve(buffer: torch.Tensor, regions, rows, group_q_heads, group_kv_heads, head_dim, window, dtype,
          single: bool = False, reuse: bool = False) -> Buffers:
    """Views of the named regions inside ``buffer`` (uint8, contiguous, large enough).

    reuse: the buffer is the caller's and lives on (an engine passes the same one to
    every layer): keep its views for the next call with the same layout, which saves
    the host the views' creation (about 20-60 us). One buffer per device is held so; a
    call with another buffer lets the old views, and the old buffer, go.
    """
    layout_key = (regions, rows, group_q_heads, group_kv_heads, head_dim, window, dtype, single)
    offsets = layout(rows, group_q_heads, group_kv_heads, head_dim, window, dtype, single)[0]
    if not reuse:
        return _carve(buffer, regions, offsets)
    buffer_key = (buffer.data_ptr(), buffer.numel())
    held = _carved.get(buffer.device)
    if held is None or held[0] != buffer_key:
        held = _carved[buffer.device] = (buffer_key, {})
    views = held[1]
    if layout_key not in views:
        if len(views) >= 8:  # the layouts of a few tiles; more would be one step's odd batch
            views.clear()
        views[layout_key] = _carve(buffer, regions, offsets)
    return views[layout_key]


def _carve(buffer, regions, offsets):
    buf = buffer[(-buffer.data_ptr()) % ALIGN:]  # from the first aligned byte
    typed = {}
    views = {}
    for name in regions:
        off, shape, t = offsets[name]
        if t not in typed:
            typed[t] = buf[:buf.numel() // t.itemsize * t.itemsize].view(t)
        strides = (shape[1] * shape[2], shape[2], 1) if len(shape) == 3 else (shape[1], 1)
        views[name] = typed[t].as_strided(shape, strides, typed[t].storage_offset() + off // t.itemsize)
    return Buffers(**views)
