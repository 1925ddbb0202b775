"""Window dequantization: the cached tokens of one window, for every request of a batch,
from a paged TurboQuant cache into fp16 K and V rows of the workspace.

The window is ``[start, start + length)`` of the plan's virtual axis (plan.py): token
``v`` belongs to request ``r`` with ``cached_start[r] <= v < cached_start[r + 1]``
(found by binary search) at cache position ``v - cached_start[r]``, and lands in row
``v - start`` of the window buffer. One launch covers all requests:
``cdiv(length, BLOCK_T)`` programs per kv head; ``start`` and ``length`` are runtime
arguments (no recompilation per window).

MSE keys stay rotated: the caller rotates the query instead. The result equals
``format.dequantize_reference(...).half()`` bit for bit: fused multiply-add is off and
the norm-correction square root and division are the correctly rounded ones.

Never reads outside its tensors: block ids outside ``[0, num_blocks)`` and block-table
columns past its width are masked (those tokens decode to zeros: a wrong answer for
that request, never a fault), and head sizes that are not a power of two are padded to
one with masks.
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


def interpreter_rounds_bf16(dtype: torch.dtype) -> bool:
    """Triton's CPU interpreter (3.9) converts float32 to bf16 by truncation; kernels that
    store bf16 round to nearest even themselves there (``round_bf16``)."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def round_bf16(x, ROUND: tl.constexpr):
    """x (float32), rounded to the nearest bf16 (ties to even) when ROUND, so that a
    truncating conversion to bf16 afterwards is exact."""
    if ROUND:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def find_request(offsets_ptr, x, num_reqs, steps):
    """For each x, the largest r < num_reqs with offsets[r] <= x (offsets non-decreasing,
    offsets[0] <= x < offsets[num_reqs]): a binary search of ``steps`` iterations."""
    lo = tl.zeros_like(x)
    hi = tl.zeros_like(x) + num_reqs
    for _ in range(steps):
        mid = (lo + hi) // 2
        right = tl.load(offsets_ptr + mid) <= x
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _fp16_at(ptr, mask):
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _indices_at(ptr, d, mask, BITS: tl.constexpr):
    """Indices d (a tensor of positions) of a little-endian BITS-wide stream at ptr."""
    bit = d * BITS
    lo = tl.load(ptr + bit // 8, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + bit // 8 + 1, mask=mask, other=0).to(tl.int32)  # inside the slot: a norm/scale follows
    return ((lo | (hi << 8)) >> (bit % 8)) & ((1 << BITS) - 1)


@triton.jit(do_not_specialize=["start", "length", "num_reqs", "steps", "head0"])
def _dequant_window_kernel(
    cache_ptr, block_table_ptr, centroids_ptr, cached_start_ptr, k_out_ptr, v_out_ptr,
    start, length, num_reqs, steps, head0, num_blocks, max_blocks,
    s_cache_block, s_cache_pos, s_cache_head, s_bt_req, s_bt_col, s_centroid,
    s_k_tok, s_k_head, s_v_tok, s_v_head,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KEY_BITS: tl.constexpr, KEY_INDEX_BYTES: tl.constexpr, KEY_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr, VALUE_INDEX_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr, FP8_E4B15: tl.constexpr, BLOCK_T: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)  # kv head within the group
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) window-relative token
    t_mask = t < length
    v = start + tl.where(t_mask, t, 0)
    req = find_request(cached_start_ptr, v, num_reqs, steps)
    pos = v - tl.load(cached_start_ptr + req)
    col = pos // BLOCK_SIZE
    block = tl.load(block_table_ptr + req.to(tl.int64) * s_bt_req + col * s_bt_col,
                    mask=t_mask & (col < max_blocks), other=-1).to(tl.int64)
    ok = t_mask & (block >= 0) & (block < num_blocks)  # anything else reads nothing
    slot = block * s_cache_block + (pos % BLOCK_SIZE).to(tl.int64) * s_cache_pos + (head0 + head) * s_cache_head
    slot = tl.where(ok, slot, 0)[:, None]  # (BLOCK_T, 1) byte offset of each slot
    row = t.to(tl.int64)[:, None]  # (BLOCK_T, 1) workspace row
    d = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D)
    mask = ok[:, None] & (d < D)
    out_mask = t_mask[:, None] & (d < D)

    # Keys
    if KEY_BITS == 8:
        raw = tl.load(cache_ptr + slot + d, mask=mask, other=0)
        if FP8_E4B15:
            k = raw.to(tl.float8e4b15, bitcast=True).to(tl.float32)
        else:
            k = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        idx = _indices_at(cache_ptr + slot, d, mask, KEY_BITS)
        c = tl.load(centroids_ptr + idx * s_centroid, mask=mask, other=0.0)  # (BLOCK_T, BLOCK_D) float32
        if NORM_CORRECTION:
            c64 = c.to(tl.float64)
            sumsq = tl.sum(c64 * c64, axis=1).to(tl.float32)
            inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(sumsq + 1e-16))
            c = c * inv[:, None]
        norm = _fp16_at(cache_ptr + slot + KEY_INDEX_BYTES, ok[:, None])  # (BLOCK_T, 1)
        k = norm * c
    tl.store(k_out_ptr + row * s_k_tok + head * s_k_head + d, k.to(tl.float16), mask=out_mask)

    # Values
    vslot = cache_ptr + slot + KEY_BYTES
    vidx = _indices_at(vslot, d, mask, VALUE_BITS).to(tl.float32)
    scale = _fp16_at(vslot + VALUE_INDEX_BYTES, ok[:, None])
    zero = _fp16_at(vslot + VALUE_INDEX_BYTES + 2, ok[:, None])
    val = vidx * scale + zero
    tl.store(v_out_ptr + row * s_v_tok + head * s_v_head + d, val.to(tl.float16), mask=out_mask)


def dequantize_window(kv_cache: torch.Tensor, block_table: torch.Tensor, cfg: TQConfig, centroids: torch.Tensor,
                      plan, call, head0: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    """Decode the cached tokens of ``call`` (a ``plan.WindowCall``), kv heads
    [head0, head0 + k_out.shape[1]), into rows of k_out, v_out.

    kv_cache: uint8 (num_blocks, block_size, Hk, slot_bytes), unit stride over slot bytes.
    block_table: int32 (B, max_blocks), any strides.
    centroids: float32 (2**cfg.centroid_bits,), any stride (unused for fp8 keys).
    k_out, v_out: fp16 (>= call.length, Hk_group, D), unit stride over D.
    Arguments are trusted: ``continuation_prefill_varlen`` validates them.
    """
    if call.length <= 0:
        return
    fp8_e4b15 = cfg.key_fp8 and fp8_e4b15_for(kv_cache.device)
    if not use_triton(kv_cache):
        _dequantize_torch(kv_cache, block_table, cfg, centroids, plan, call, head0, k_out, v_out, fp8_e4b15)
        return
    # One warp, 128 elements per thread (4-bit keys: 32): fastest in a sweep on the H200
    # (benchmarks/NOTES.md): 0.36 ms for 128K tokens x 8 heads (3bit_nc) against 0.93 ms
    # with 4 warps.
    block_d = triton.next_power_of_2(cfg.head_dim)
    block_t = max(1, (1024 if cfg.key_bits == 4 else 4096) // block_d)
    grid = (triton.cdiv(call.length, block_t), k_out.shape[1])
    _dequant_window_kernel[grid](
        kv_cache, block_table, centroids, plan.cached_start, k_out, v_out,
        call.start, call.length, plan.num_reqs, plan.search_steps, head0,
        kv_cache.shape[0], block_table.shape[1],
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), block_table.stride(0), block_table.stride(1),
        centroids.stride(0), k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
        D=cfg.head_dim, BLOCK_D=block_d, BLOCK_SIZE=kv_cache.shape[1],
        KEY_BITS=cfg.key_bits, KEY_INDEX_BYTES=cfg.key_index_bytes, KEY_BYTES=cfg.key_bytes,
        VALUE_BITS=cfg.value_bits, VALUE_INDEX_BYTES=cfg.value_index_bytes,
        NORM_CORRECTION=cfg.norm_correction, FP8_E4B15=fp8_e4b15,
        BLOCK_T=block_t, num_warps=1, enable_fp_fusion=False,
    )


def _dequantize_torch(kv_cache, block_table, cfg, centroids, plan, call, head0, k_out, v_out, fp8_e4b15):
    """The same rows through the reference decoder, one request segment at a time (CPU)."""
    starts = plan.cached_start_host
    hk = k_out.shape[1]
    end = call.start + call.length
    for r in range(plan.num_reqs):
        s, e = max(starts[r], call.start), min(starts[r + 1], end)
        if s >= e:
            continue
        k, v = dequantize_reference(kv_cache[:, :, head0:head0 + hk], block_table[r], s - starts[r], e - s, cfg,
                                    centroids, fp8_e4b15)  # (Hk, n, D) float32
        row = s - call.start
        k_out[row:row + e - s] = k.transpose(0, 1).half()
        v_out[row:row + e - s] = v.transpose(0, 1).half()
