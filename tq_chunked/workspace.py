"""The workspace of a continuation prefill, its exact size, and the kv-head groups that
keep it within a budget.

All scratch memory lives in one flat uint8 buffer, carved into these regions (each
start aligned to 256 bytes), for one group of ``Hk_g`` kv heads and their
``Hq_g = Hq / Hk * Hk_g`` query heads, N query tokens and a window of W cached tokens:

    k_buf, v_buf  (W, Hk_g, D)   fp16     one window's dequantized K/V
    q_buf         (N, Hq_g, D)   fp16     the (rotated) query
    state_out     (N, Hq_g, D)   float32  running merged output over the windows
    state_lse     (Hq_g, N)      float32  its log-sum-exp
    part          (N, Hq_g, D)   fp16     a window's partial output, when there is one
                                          window: the first half of state_out's bytes
    q16, k16, v16 (N, Hq_g | Hk_g, D) fp16  bf16 queries only: the chunk's own Q/K/V, so
                                          that its partial output is not rounded to bf16
                                          before the merge (fp16 queries use theirs)

Groups run one after another in the same buffer. The group is the largest divisor of Hk
whose regions fit ``max_bytes`` (one kv head if none does), so the workspace is bounded
in N as well as in the cached length; each group dequantizes only its own heads, so
grouping adds no dequant work. With several windows, each window's partial output goes
into the call's output tensor, used as scratch until the chunk's own attention writes it.
Nothing here depends on the cached lengths or the number of requests.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

ALIGN = 256
DEFAULT_WINDOW_BYTES = 48 << 20  # K + V of a window's cached tokens; chosen by measurement: benchmarks/NOTES.md
DEFAULT_WORKSPACE_BYTES = 128 << 20  # the budget that sets the kv-head group (see module docstring)


def default_window(num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Cached tokens per window such that their K + V (fp16, all kv heads) take
    DEFAULT_WINDOW_BYTES, rounded down to a multiple of block_size (at least one block)."""
    tokens = DEFAULT_WINDOW_BYTES // (2 * 2 * num_kv_heads * head_dim)
    return max(block_size, tokens // block_size * block_size)


def _regions(q_tokens, group_q_heads, group_kv_heads, head_dim, window, dtype):
    # name: (shape, dtype)
    n16 = q_tokens if dtype == torch.bfloat16 else 0
    return {
        "k_buf": ((window, group_kv_heads, head_dim), torch.float16),
        "v_buf": ((window, group_kv_heads, head_dim), torch.float16),
        "q_buf": ((q_tokens, group_q_heads, head_dim), torch.float16),
        "state_out": ((q_tokens, group_q_heads, head_dim), torch.float32),
        "state_lse": ((group_q_heads, q_tokens), torch.float32),
        "q16": ((n16, group_q_heads, head_dim), torch.float16),
        "k16": ((n16, group_kv_heads, head_dim), torch.float16),
        "v16": ((n16, group_kv_heads, head_dim), torch.float16),
    }


def _bytes(q_tokens, group_q_heads, group_kv_heads, head_dim, window, dtype):
    total = ALIGN  # room to align the first region in any buffer
    for shape, t in _regions(q_tokens, group_q_heads, group_kv_heads, head_dim, window, dtype).values():
        n = t.itemsize
        for s in shape:
            n *= s
        total += _aligned(n)
    return total


def _aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _count(name, value, minimum):
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def kv_head_group(q_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, window: int,
                  dtype: torch.dtype = torch.float16, max_bytes: int | None = None) -> int:
    """kv heads per group: the largest divisor of num_kv_heads whose workspace fits
    max_bytes (default DEFAULT_WORKSPACE_BYTES), or 1."""
    max_bytes = DEFAULT_WORKSPACE_BYTES if max_bytes is None else max_bytes
    g = num_q_heads // num_kv_heads
    for hk_g in range(num_kv_heads, 0, -1):
        if num_kv_heads % hk_g == 0 and _bytes(q_tokens, g * hk_g, hk_g, head_dim, window, dtype) <= max_bytes:
            return hk_g
    return 1


def workspace_bytes(q_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, window: int,
                    dtype: torch.dtype = torch.float16, *, max_bytes: int | None = None) -> int:
    """Exact bytes of workspace a continuation prefill of q_tokens query tokens (all
    requests of a batch together) in ``dtype`` (the query's: bf16 needs fp16 copies of
    the chunk) uses with this window; independent of the cached lengths and the number of
    requests. A call whose cached tokens total less than the window uses at most this.
    A uint8 buffer of at least this many bytes on the query's device may be passed as
    ``workspace=``; pass the same ``max_bytes`` to the call (``max_workspace_bytes``).
    """
    q_tokens = _count("q_tokens", q_tokens, 0)
    num_q_heads = _count("num_q_heads", num_q_heads, 1)
    num_kv_heads = _count("num_kv_heads", num_kv_heads, 1)
    head_dim = _count("head_dim", head_dim, 1)
    window = _count("window", window, 1)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16 (the query's), got {dtype}")
    if max_bytes is not None:
        max_bytes = _count("max_bytes", max_bytes, 1)
    hk_g = kv_head_group(q_tokens, num_q_heads, num_kv_heads, head_dim, window, dtype, max_bytes)
    return _bytes(q_tokens, num_q_heads // num_kv_heads * hk_g, hk_g, head_dim, window, dtype)


@dataclass
class Buffers:
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    q_buf: torch.Tensor
    state_out: torch.Tensor
    state_lse: torch.Tensor
    q16: torch.Tensor
    k16: torch.Tensor
    v16: torch.Tensor
    part: torch.Tensor  # aliases state_out's bytes


def carve(buffer: torch.Tensor, q_tokens, group_q_heads, group_kv_heads, head_dim, window, dtype) -> Buffers:
    """Views of the regions inside ``buffer`` (uint8, contiguous, large enough)."""
    base = (-buffer.data_ptr()) % ALIGN  # first aligned byte
    views = {}
    for name, (shape, t) in _regions(q_tokens, group_q_heads, group_kv_heads, head_dim, window, dtype).items():
        n = t.itemsize
        for s in shape:
            n *= s
        views[name] = buffer[base:base + n].view(t).view(shape)
        base += _aligned(n)
    views["part"] = views["state_out"].view(-1).view(torch.float16)[:views["state_out"].numel()].view(
        views["state_out"].shape)
    return Buffers(**views)
