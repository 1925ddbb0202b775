"""The full-buffer path, and the float64 oracle the tests measure both paths against.

``full_buffer_continuation_prefill`` is the upstream algorithm, written here from
scratch: dequantize the whole cached prefix, un-rotate every key (a D x D GEMM),
concatenate with the chunk's K/V and run one causal attention. Its scratch memory is
O(cached_len). It is the baseline of the exactness tests and of the benchmarks.
"""

from __future__ import annotations

import torch
from einops import rearrange

from ..runtime._utils import as_int, check_tensor
from ..runtime.attention import make_call, resolve_backend, varlen_attention
from ..runtime.dequant import fill_window
from ..runtime.format import dequantize_reference, resolve_config
from ..runtime.plan import Window


def full_buffer_continuation_prefill(
    query,
    key_chunk,
    val_chunk,
    kv_cache,
    block_table,
    cached_len,
    *,
    preset,
    centroids,
    rotation,
    scale,
    backend="auto",
):
    """Same arguments and result as ``continuation_prefill`` (no window, no workspace).

    Dequantizes [0, cached_len) with the window kernel into fp16 buffers (keys in the
    rotated space), rotates keys back in float32 and rounds them to fp16 (as vLLM does),
    then attends causally over (cached_len + q_len) keys in the query's dtype with the
    chosen back end.
    """
    check_tensor("query", query, 3, (torch.float16, torch.bfloat16))
    lq, hq, d = query.shape
    cfg = resolve_config(preset, d)
    cached_len = as_int("cached_len", cached_len, 0)
    backend = resolve_backend(backend, query.device, d)
    hk = key_chunk.shape[1]
    bt = block_table.reshape(1, -1)
    # O(cached_len)
    k = torch.empty(cached_len, hk, d, dtype=torch.float16, device=query.device)
    v = torch.empty_like(k)
    fill_window(
        kv_cache,
        bt,
        cfg,
        centroids,
        rotation,
        key_chunk,
        val_chunk,
        cached_window(0, 0, cached_len, query.device),
        0,
        k,
        v,
        unrotate=False,
    )
    if not cfg.key_fp8:
        # k = k_rot @ rotation: back to the original space
        k = (k.float() @ rotation.float()).half()
    k_full = torch.cat([k.to(query.dtype), key_chunk], 0)  # (cached_len + q_len, Hk, D)
    v_full = torch.cat([v.to(query.dtype), val_chunk], 0)
    out = torch.empty_like(query)
    call = make_call([lq], [cached_len + lq], True, query.device)
    varlen_attention(  # as vLLM
        call, query.contiguous(), k_full, v_full, scale, out, backend, flash_splits=0
    )
    return out


def oracle_continuation_prefill(
    query,
    key_chunk,
    val_chunk,
    kv_cache,
    block_table,
    cached_len,
    *,
    preset,
    centroids,
    rotation,
    scale,
    fp8_e4b15=False,
):
    """Float64 attention over the exactly decoded cache: what both paths approximate.

    Returns (q_len, Hq, D) float64.
    """
    lq, hq, d = query.shape
    cfg = resolve_config(preset, d)
    k, v = dequantize_reference(
        kv_cache, block_table, 0, cached_len, cfg, centroids, fp8_e4b15
    )
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
        q = rearrange(query[:, h * g : (h + 1) * g].double(), "l g d -> g l d")
        s = (q @ k[h].T * scale).masked_fill(hidden, float("-inf"))  # (G, Lq, Lk)
        p = torch.softmax(s, -1)
        new = v[h][cached_len:]
        if torch.isfinite(new).all():
            o = p @ v[h]
        else:
            # a key a query does not see adds nothing, even an inf or NaN value (a
            # matmul would add 0 * it)
            o = p[..., :cached_len] @ v[h][:cached_len] + torch.where(
                ~hidden[:, cached_len:, None], p[..., cached_len:, None] * new, 0.0
            ).sum(-2)
        out[:, h * g : (h + 1) * g] = rearrange(o, "g l d -> l g d")
    return out


def cached_window(
    request: int, start: int, length: int, device: torch.device
) -> Window:
    """A window of one request's cached tokens [start, start + length) and nothing else,
    for the fill alone (the full-buffer path dequantizes a whole prefix with it; the
    benchmarks time the fill with it). It answers no query rows."""
    segs = (0, length, request, start, length, 0)
    dev = torch.tensor(segs, dtype=torch.int32, device=device)
    no_queries = torch.zeros(2, dtype=torch.int32, device=device)
    return Window(
        kind="part",
        q0=0,
        q1=0,
        rows=length,
        nseg=1,
        search_steps=1,
        segs=dev,
        segs_host=segs,
        cu_q=no_queries,
        cu_k=dev[:2],
        cu_q_host=(0, 0),
        cu_k_host=(0, length),
        max_q=0,
        max_k=length,
        causal=False,
        has_chunk=False,
        requests=(request,),
    )
