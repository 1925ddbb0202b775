"""The explicit workspace of a chunked continuation prefill, and its exact size.

All scratch memory of ``continuation_prefill`` lives in one flat uint8 buffer, carved
into these regions (each start aligned to 256 bytes):

    k_win, v_win  (Hk, W, D)   fp16     one dequantized window
    q_win         (Hq, Lq, D)  fp16     the (rotated) query, head-major
    state_out     (Hq, Lq, D)  float32  running merged output
    state_lse     (Hq, Lq)     float32  running log-sum-exp

Partial outputs of the FlashAttention back end go into the call's output tensor, used
as scratch until the final merge. None of this depends on cached_len: memory is
O(W * Hk * D + Lq * Hq * D).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 256
DEFAULT_WINDOW_BYTES = 48 << 20  # K + V of one window; chosen by measurement: benchmarks/NOTES.md


def default_window(num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Tokens per window such that K + V of a window take DEFAULT_WINDOW_BYTES (fp16),
    rounded down to a multiple of block_size (at least one block)."""
    tokens = DEFAULT_WINDOW_BYTES // (2 * 2 * num_kv_heads * head_dim)
    return max(block_size, tokens // block_size * block_size)


def _regions(q_len, num_q_heads, num_kv_heads, head_dim, window):
    # name: (shape, dtype)
    return {
        "k_win": ((num_kv_heads, window, head_dim), torch.float16),
        "v_win": ((num_kv_heads, window, head_dim), torch.float16),
        "q_win": ((num_q_heads, q_len, head_dim), torch.float16),
        "state_out": ((num_q_heads, q_len, head_dim), torch.float32),
        "state_lse": ((num_q_heads, q_len), torch.float32),
    }


def _nbytes(shape, dtype):
    n = torch.finfo(dtype).bits // 8
    for s in shape:
        n *= s
    return n


def _aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def workspace_bytes(q_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int, window: int,
                    dtype: torch.dtype = torch.float16) -> int:
    """Exact bytes of workspace ``continuation_prefill`` needs; independent of cached_len.

    dtype is the query's (fp16 or bf16). A buffer of at least this many bytes, uint8,
    on the query's device, may be passed as ``workspace=``.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    for name, value in (("q_len", q_len), ("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("window", window)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    return sum(_aligned(_nbytes(s, t)) for s, t in _regions(q_len, num_q_heads, num_kv_heads, head_dim,
                                                               window).values()) + ALIGN


@dataclass
class WindowBuffers:
    k_win: torch.Tensor
    v_win: torch.Tensor
    q_win: torch.Tensor
    state_out: torch.Tensor
    state_lse: torch.Tensor


def carve(buffer: torch.Tensor, q_len, num_q_heads, num_kv_heads, head_dim, window) -> WindowBuffers:
    """Views of the regions inside ``buffer`` (uint8, >= workspace_bytes(...) bytes)."""
    base = (-buffer.data_ptr()) % ALIGN  # first aligned byte
    views = {}
    for name, (shape, t) in _regions(q_len, num_q_heads, num_kv_heads, head_dim, window).items():
        n = _nbytes(shape, t)
        views[name] = buffer[base:base + n].view(t).view(shape)
        base += _aligned(n)
    return WindowBuffers(**views)
