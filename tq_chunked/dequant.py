"""Window dequantization: tokens [start, start + length) of a paged TurboQuant cache
-> fp16 K and V of shape (Hk, length, D), written into caller-owned buffers.

One Triton program decodes BLOCK_T tokens of one kv head, so a window of W tokens
costs one launch of cdiv(W, BLOCK_T) * Hk programs. ``start`` and ``length`` are
runtime arguments (no recompilation per window). MSE keys stay rotated: the caller
rotates the query instead. The result is bit-identical to
``format.dequantize_reference(...).half()``: fused multiply-add is disabled and the
norm-correction square root and division are the round-to-nearest ones.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .format import TQConfig, dequantize_reference


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels run on CUDA tensors, and on CPU under TRITON_INTERPRET=1."""
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def fp8_e4b15_for(device: torch.device) -> bool:
    """vLLM writes fp8 keys as e4b15 on GPUs below SM 8.9, e4m3 elsewhere."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


@triton.jit
def _fp16_at(ptr):
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _indices_at(ptr, d, BITS: tl.constexpr):
    """Indices d (a tensor of positions) of a little-endian BITS-wide stream at ptr."""
    bit = d * BITS
    lo = tl.load(ptr + bit // 8).to(tl.int32)
    hi = tl.load(ptr + bit // 8 + 1).to(tl.int32)  # stays inside the slot: a norm/scale follows
    return ((lo | (hi << 8)) >> (bit % 8)) & ((1 << BITS) - 1)


@triton.jit(do_not_specialize=["start", "length"])
def _dequant_window_kernel(
    cache_ptr, block_table_ptr, centroids_ptr, k_out_ptr, v_out_ptr,
    start, length,
    s_cache_block, s_cache_pos, s_cache_head,
    s_k_head, s_k_tok, s_v_head, s_v_tok,
    D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KEY_BITS: tl.constexpr, KEY_INDEX_BYTES: tl.constexpr, KEY_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr, VALUE_INDEX_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr, FP8_E4B15: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) window-relative token
    t_mask = t < length
    pos = start + t
    block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    slot = block * s_cache_block + (pos % BLOCK_SIZE).to(tl.int64) * s_cache_pos + head * s_cache_head
    slot = tl.where(t_mask, slot, 0)[:, None]  # (BLOCK_T, 1) byte offset of each slot
    d = tl.arange(0, D)[None, :]  # (1, D)
    mask = t_mask[:, None]

    # Keys
    if KEY_BITS == 8:
        raw = tl.load(cache_ptr + slot + d, mask=mask, other=0)
        if FP8_E4B15:
            k = raw.to(tl.float8e4b15, bitcast=True).to(tl.float32)
        else:
            k = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        idx = _indices_at(cache_ptr + slot, d, KEY_BITS)
        c = tl.load(centroids_ptr + idx)  # (BLOCK_T, D) float32
        if NORM_CORRECTION:
            c64 = c.to(tl.float64)
            sumsq = tl.sum(c64 * c64, axis=1).to(tl.float32)
            inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(sumsq + 1e-16))
            c = c * inv[:, None]
        norm = _fp16_at(cache_ptr + slot + KEY_INDEX_BYTES)  # (BLOCK_T, 1)
        k = norm * c
    k_ptr = k_out_ptr + head * s_k_head + t[:, None].to(tl.int64) * s_k_tok + d
    tl.store(k_ptr, k.to(tl.float16), mask=mask)

    # Values
    vslot = cache_ptr + slot + KEY_BYTES
    vidx = _indices_at(vslot, d, VALUE_BITS).to(tl.float32)
    scale = _fp16_at(vslot + VALUE_INDEX_BYTES)
    zero = _fp16_at(vslot + VALUE_INDEX_BYTES + 2)
    v = vidx * scale + zero
    v_ptr = v_out_ptr + head * s_v_head + t[:, None].to(tl.int64) * s_v_tok + d
    tl.store(v_ptr, v.to(tl.float16), mask=mask)


def dequantize_window(kv_cache: torch.Tensor, block_table: torch.Tensor, start: int, length: int,
                      cfg: TQConfig, centroids: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """Decode cached tokens [start, start + length) into k_out[:, :length], v_out[:, :length].

    kv_cache: uint8 (num_blocks, block_size, Hk, slot_bytes), any strides.
    block_table: int32, contiguous, (max_blocks,) or (1, max_blocks).
    centroids: float32 (2**cfg.centroid_bits,), on the cache's device.
    k_out, v_out: fp16 (Hk, >= length, D), unit stride over D.
    Arguments are trusted: ``continuation_prefill`` validates them.
    """
    if length <= 0:
        return
    fp8_e4b15 = cfg.key_fp8 and fp8_e4b15_for(kv_cache.device)
    if not use_triton(kv_cache):
        k, v = dequantize_reference(kv_cache, block_table, start, length, cfg, centroids, fp8_e4b15)
        k_out[:, :length] = k.half()
        v_out[:, :length] = v.half()
        return
    hk = kv_cache.shape[2]
    # One warp, 128 elements per thread (4-bit keys: 32): fastest in a sweep on the H200
    # (benchmarks/NOTES.md): 0.36 ms for 128K tokens x 8 heads (3bit_nc) against 0.93 ms
    # with 4 warps.
    block_t = max(1, (1024 if cfg.key_bits == 4 else 4096) // cfg.head_dim)
    num_warps = 1
    grid = (triton.cdiv(length, block_t), hk)
    _dequant_window_kernel[grid](
        kv_cache, block_table, centroids, k_out, v_out, start, length,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
        D=cfg.head_dim, BLOCK_SIZE=kv_cache.shape[1],
        KEY_BITS=cfg.key_bits, KEY_INDEX_BYTES=cfg.key_index_bytes, KEY_BYTES=cfg.key_bytes,
        VALUE_BITS=cfg.value_bits, VALUE_INDEX_BYTES=cfg.value_index_bytes,
        NORM_CORRECTION=cfg.norm_correction, FP8_E4B15=fp8_e4b15,
        BLOCK_T=block_t, num_warps=num_warps, enable_fp_fusion=False,
    )
