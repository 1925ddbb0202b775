"""The full-buffer path, and the float64 oracle the tests measure both paths against.

``full_buffer_continuation_prefill`` is the upstream algorithm, written here from
scratch: dequantize the whole cached prefix, un-rotate every key (a D x D GEMM),
concatenate with the chunk's K/V and run one causal attention. Its scratch memory is
O(cached_len). It is the baseline of the exactness tests and of the benchmarks.
"""

from __future__ import annotations

import torch
from einops import rearrange

from .attention import partial_attention, resolve_backend
from .chunked import _check_tensor, _validate
from .dequant import dequantize_window
from .format import dequantize_reference, resolve_config


def full_buffer_continuation_prefill(query, key_chunk, val_chunk, kv_cache, block_table, cached_len, *,
                                     preset, centroids, rotation, scale, backend="auto"):
    """Same arguments and result as ``continuation_prefill`` (no window, no workspace).

    Uses the window dequant kernel once over [0, cached_len) into fp16 buffers, rotates
    keys back in float32 and rounds them to fp16 (as vLLM does), then attends causally
    over (cached_len + q_len) keys with the chosen back end ("flash", "triton", "torch";
    "cudnn" cannot mask bottom-right and is refused).
    """
    _check_tensor("query", query, 3, (torch.float16, torch.bfloat16))
    lq, hq, d = query.shape
    cfg = resolve_config(preset, d)
    _validate(query, key_chunk, val_chunk, kv_cache, block_table, cached_len, cfg, centroids, rotation, scale,
              None)
    if backend == "auto":
        backend = "flash" if resolve_backend("auto", query.device, query.dtype, d) == "flash" else (
            "triton" if query.is_cuda else "torch")
    backend = resolve_backend(backend, query.device, query.dtype, d)
    if backend == "cudnn":
        raise ValueError("backend 'cudnn' cannot mask bottom-right; use 'flash', 'triton' or 'torch'")
    hk = key_chunk.shape[1]
    k = torch.empty(hk, cached_len, d, dtype=torch.float16, device=query.device)  # O(cached_len)
    v = torch.empty_like(k)
    dequantize_window(kv_cache, block_table.reshape(-1), 0, cached_len, cfg, centroids, k, v)
    if not cfg.key_fp8:
        k = (k.float() @ rotation.float()).half()  # k = k_rot @ rotation: back to the original space
    k_full = torch.cat([k.to(query.dtype), key_chunk.transpose(0, 1)], 1)  # (Hk, cached_len + q_len, D)
    v_full = torch.cat([v.to(query.dtype), val_chunk.transpose(0, 1)], 1)
    out, _ = partial_attention(query.transpose(0, 1), k_full, v_full, scale, causal=True, backend=backend)
    return out.transpose(0, 1).to(query.dtype).contiguous()


def oracle_continuation_prefill(query, key_chunk, val_chunk, kv_cache, block_table, cached_len, *,
                                preset, centroids, rotation, scale, fp8_e4b15=False):
    """Float64 attention over the exactly decoded cache: what both paths approximate.

    Returns (q_len, Hq, D) float64.
    """
    lq, hq, d = query.shape
    cfg = resolve_config(preset, d)
    k, v = dequantize_reference(kv_cache, block_table, 0, cached_len, cfg, centroids, fp8_e4b15)
    k, v = k.double(), v.double()  # (Hk, cached_len, D)
    if not cfg.key_fp8:
        k = k @ rotation.double()
    k = torch.cat([k, key_chunk.transpose(0, 1).double()], 1)
    v = torch.cat([v, val_chunk.transpose(0, 1).double()], 1)
    hk, lk = k.shape[0], k.shape[1]
    g = hq // hk
    i = torch.arange(lq, device=k.device)[:, None]
    j = torch.arange(lk, device=k.device)[None, :]
    hidden = j > i + cached_len  # (Lq, Lk) causal mask of the chunk
    out = torch.empty(lq, hq, d, dtype=torch.float64, device=k.device)
    for h in range(hk):  # one kv head at a time: bounded memory at long context
        q = rearrange(query[:, h * g:(h + 1) * g].double(), "l g d -> g l d")
        s = (q @ k[h].T * scale).masked_fill(hidden, float("-inf"))  # (G, Lq, Lk)
        out[:, h * g:(h + 1) * g] = rearrange(torch.softmax(s, -1) @ v[h], "g l d -> l g d")
    return out
