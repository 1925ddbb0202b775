"""Attention over the cached prefix, read straight from the paged TurboQuant cache:
no window, no fp16 K/V written (experimental, not dispatched). On the H200 machine
(benchmarks/NOTES.md §25-27; 3bit_nc, fp16, llama3-8b's heads, seven workloads) it
takes 0.45-0.81x the window path's time where a request's rows per kv head are few
(32-128) and its cache long (64K), 1.04x on 64 hits of q16, 1.2-2.6x elsewhere, 4-10x
the floor, with 0.55-0.60x the window path's error against the float64 oracle. An
earlier form of it (before the values' centring and scale unit; 16 workloads) took up
to 7.2x the window path's time on batches of 256-1536 rows per kv head. No path calls
it yet (no dispatch, per-call allocations).

Why: where a request's query rows per kv head (q_len x Hq / Hk) are few, attention is
bound by the bytes of K/V. The window path writes the fp16 K/V of every cached token and
reads them back, twice the bytes the floor (one FlashAttention call over a BF16 cache)
reads; with the quantized slots it reads first, at least 2.2x the floor at 3 bits. This
kernel reads each slot once and dequantizes it in registers (about a fifth of the
floor's bytes at 3 bits).

What it computes, for each request r with cached_len c_r and its query rows: attention
over keys and values [0, c_r) of the cache (no causal mask: every cached token precedes
every query token), as (out, lse) partial results over ``splits`` ranges of positions,
combined into one (out, lse) per query row and head.
``fused_continuation_prefill_varlen`` adds the chunk's own causal attention
(``attention.varlen_attention``) and merges the two (``merge.merge_attn_states``): what
``continuation_prefill_varlen`` computes, rounded differently (below).

Exactness: MSE keys are cached rotated, ``k_rot = k @ rotation^T``, so ``q . k = (q @
rotation^T) . k_rot``. The query is rotated once in float32, each row scaled by a power
of two into fp16's range, then split into an fp16 part and an fp16 remainder (22 bits
relative to the row's largest element). A key is ``a_n c_n``: ``c_n`` its centroids
(the fp16 table: the dot's operand as loaded, rounded once, where vLLM rounds ``a_n
c_n``), ``a_n`` its norm over the centroids' norm (the sum of squares one more dot, of
ones against the squares rounded to fp16, then the GPU's approximate reciprocal square
root), applied to the scores; each score is two dots of exact products: the un-rotated
key is never rounded (the full path's second rounding).
A value is ``i s + z``; ``p . v = (p s) . (i - h) + p . (z + h s)``, h the middle of
the index range: the centred indices are exact in fp16 (doubled: odd integers), ``p s``
(in units of a power of two at the largest scale seen, to stay in fp16's normal range)
is rounded once where FlashAttention rounds p and the value, and the zero term is
float32. With bf16 queries the full path also rounds K and V to bf16, and this kernel
does not: its answer is not the full path's bit for bit, and its error against the
float64 oracle is smaller (tests/test_fused.py). A block id outside ``[0,
num_blocks)`` is not read; its request's rows are NaN.

Layouts and dtypes as ``continuation_prefill_varlen``; what this prototype does not do
yet: the float32 query rotation, the slot offsets, the split results and their combine
are allocated per call (PyTorch), not carved from the workspace; lengths are host
lists, uploaded per call. MSE keys' indices, value indices and the fp16 fields are read
in 16-bit loads where ``halves_ok``, byte by byte otherwise; fp8 keys byte by byte
(the fill reads them in 16-bit loads: not measured here, the probe runs 3bit_nc).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..runtime._utils import interpreting
from ..runtime.attention import make_call, resolve_backend, varlen_attention
from ..runtime.dequant import _fp16_at, _unpack, fp8_e4b15_for, halves_ok
from ..runtime.format import resolve_config
from ..runtime.merge import merge_attn_states


@triton.jit
def _unpack16(hp, ok2, D: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(N, BLOCK_D) int32: the BITS-wide (3 or 4) little-endian indices of each row's
    stream, read as halfwords at ``hp`` (N, 1), uint16 pointers; rows outside ``ok2``
    read nothing. Indices 16g .. 16g + 15 are the BITS halfwords from halfword g * BITS:
    two 32-bit words (halfwords 0-1 and, for 3 bits, 1-2; for 4 bits, 2-3) hold every
    index of the group whole, so each index is one shift and one mask of a 32-bit word
    chosen by its place in the group (dequant._unpack_halves shifts 64-bit words)."""
    N: tl.constexpr = hp.shape[0]
    G: tl.constexpr = BLOCK_D // 16
    g = tl.arange(0, G)[None, :]
    m = ok2 & (g * 16 < D)
    base = hp + g * BITS
    h0 = tl.load(base, mask=m, other=0).to(tl.int32)
    h1 = tl.load(base + 1, mask=m, other=0).to(tl.int32)
    h2 = tl.load(base + 2, mask=m, other=0).to(tl.int32)
    j = tl.arange(0, 16)[None, None, :]
    if BITS == 4:
        h3 = tl.load(base + 3, mask=m, other=0).to(tl.int32)
        lo = h0 | (h1 << 16)  # indices 0-7
        hi = h2 | (h3 << 16)  # indices 8-15
        first_hi: tl.constexpr = 8
        hi_bit: tl.constexpr = 32
    else:
        lo = h0 | (h1 << 16)  # indices 0-9 whole (bits 0-29)
        hi = h1 | (h2 << 16)  # indices 6-15 whole (bits 16-47)
        first_hi: tl.constexpr = 10
        hi_bit: tl.constexpr = 16
    in_lo = j < first_hi
    w = tl.where(in_lo, lo[:, :, None], hi[:, :, None])
    sh = tl.where(in_lo, j * BITS, j * BITS - hi_bit)
    idx = (w >> sh) & ((1 << BITS) - 1)
    return tl.reshape(idx, [N, BLOCK_D])


@triton.jit
def _fp16_field(ptr, ok, HALVES: tl.constexpr):
    """float32 of the fp16 at byte pointers ``ptr`` where ``ok`` (0 elsewhere): one
    16-bit load where the cache's fields are even (HALVES), two bytes otherwise."""
    if HALVES:
        x = tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=ok, other=0)
        return x.to(tl.float32)
    else:
        return _fp16_at(ptr, ok)


@triton.jit
def _pow2_floor(x):
    """The power of two at or below each positive normal float32 ``x`` (its exponent
    bits); 0 for 0."""
    return (x.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _key_operand(
    cache_ptr,
    slot,
    ok,
    centroids_ptr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KEY_BITS: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    HALVES: tl.constexpr,
):
    """(N, BLOCK_D) fp16 of the slots at ``slot`` (N,) where ``ok``: MSE keys'
    centroids (``centroids_ptr``: the fp16 table, unit stride), not yet scaled by the
    norm (rows outside ``ok`` read index 0: their norm is 0 and their score masked);
    fp8 keys as they are (exact in fp16; 0 outside ``ok`` and past D)."""
    ok2 = ok[:, None]
    if KEY_BITS == 8:
        d = tl.arange(0, BLOCK_D)[None, :]
        raw = tl.load(cache_ptr + slot[:, None] + d, mask=ok2 & (d < D), other=0)
        if FP8_E4B15:
            return raw.to(tl.float8e4b15, bitcast=True).to(tl.float16)
        else:
            return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        if HALVES:
            hp = (cache_ptr + slot[:, None]).to(tl.pointer_type(tl.uint16))
            idx = _unpack16(hp, ok2, D, KEY_BITS, BLOCK_D)
        else:
            idx = _unpack(cache_ptr + slot[:, None], ok2, D, KEY_BITS, BLOCK_D)
        # indices are in range whatever the bytes: the table is read unmasked
        return tl.load(centroids_ptr + idx)


@triton.jit
def _value_indices(
    cache_ptr,
    slot,
    ok,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    HALVES: tl.constexpr,
):
    """(N, BLOCK_D) fp16: twice the value indices less the middle of their range
    (exact: -7, -5 .. 7 at 3 bits) of the slots at ``slot`` (N,) where ``ok`` (minus
    twice the middle elsewhere); columns past D unspecified. Centred, so that the
    value dot's sum is about as large as the answer: the zero and the middle go into
    the float32 zero term. Uncentred (from 0), that sum and the zero term cancelled:
    k8v4's error was 1.17x the full path's on the CPU. Centred at 2^(bits-1), the
    indices' mean -0.5 left a sum 10-40x the answer on long splits, and the tensor
    cores' accumulation, which truncates, gave 2.1x the window path's error at
    22K-32K positions a split on the H200 (benchmarks/NOTES.md §27)."""
    ok2 = ok[:, None]
    vslot = slot + KEY_BYTES
    if HALVES:
        hp = (cache_ptr + vslot[:, None]).to(tl.pointer_type(tl.uint16))
        idx = _unpack16(hp, ok2, D, VALUE_BITS, BLOCK_D)
    else:
        idx = _unpack(cache_ptr + vslot[:, None], ok2, D, VALUE_BITS, BLOCK_D)
    return (2 * idx - ((1 << VALUE_BITS) - 1)).to(tl.float16)


@triton.jit
def _cached_attention_kernel(
    q_ptr,  # (N, Hq, D) float32, rotated
    cache_ptr,
    offsets_ptr,  # (B, L) int64: each cached position's slot offset, -1 if bad
    centroids_ptr,
    qsl_ptr,  # (B + 1,) int32
    cached_ptr,  # (B,) int32
    o_ptr,  # (S, N, Hq, D) float32
    lse_ptr,  # (S, Hq, N) float32
    n_splits,
    split_len,  # positions per split, a multiple of BLOCK_N
    s_q_tok,
    s_q_head,
    s_cache_head,
    s_off_req,
    s_o_split,
    s_o_tok,
    s_o_head,
    s_lse_split,
    s_lse_head,
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KEY_BITS: tl.constexpr,
    KEY_INDEX_BYTES: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    VALUE_INDEX_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    # the cache read in 16-bit loads (dequant.halves_ok)
    HALVES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    # float32 dot operands (the interpreter: numpy's fp16 products)
    DOT_F32: tl.constexpr,
):
    """Program (r, tile, kv head x split): BLOCK_M rows (query token, head of the kv
    head's group) of request r against the split's range of its cached positions."""
    r = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = (tl.program_id(2) // n_splits).to(tl.int64)
    split = tl.program_id(2) % n_splits
    q0 = tl.load(qsl_ptr + r)
    n_rows = (tl.load(qsl_ptr + r + 1) - q0) * GROUP
    cached = tl.load(cached_ptr + r)
    if tile * BLOCK_M < n_rows:
        u = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = u < n_rows
        tok = (q0 + u // GROUP).to(tl.int64)  # (BLOCK_M,) query row
        head = kvh * GROUP + (u % GROUP)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(
            q_ptr + tok[:, None] * s_q_tok + head[:, None] * s_q_head + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        # each row scaled by the power of two at or below its largest |element| (bits
        # of the float32: exact), so that hi + lo below fits fp16 whatever the query's
        # range; the scale goes back into the score's one multiplication
        amax = tl.max(tl.abs(q), 1)
        pw = (amax.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        pw = tl.where(pw == 0, 1.0, pw)  # a row of zeros or subnormals: as it is
        q = tl.math.div_rn(q, pw[:, None])
        row_scale = pw * qk_scale
        # q = hi + lo to 22 bits relative to the row's largest element: two dots of
        # exact fp16 products
        q_hi = q.to(tl.float16)
        q_lo = (q - q_hi.to(tl.float32)).to(tl.float16)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2
        l_i = tl.zeros([BLOCK_M], tl.float32)
        z_i = tl.zeros([BLOCK_M], tl.float32)  # sum of p * the value's zero
        # acc is kept in units of v_unit, the power of two at or below the largest value
        # scale seen so far, so that p * scale / v_unit (< 2) stays in fp16's normal
        # range as FlashAttention's p does (unscaled, small p * scale would fall to
        # fp16's subnormals, where an index's rounding error is up to 35x the one p's
        # rounding makes on the same term; NOTES.md §27)
        v_unit = 2.0**-126
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if NORM_CORRECTION:
            ones = tl.full([BLOCK_M, BLOCK_D], 1.0, tl.float16)
        start = split * split_len
        end = tl.minimum(cached, start + split_len)
        row = offsets_ptr + r.to(tl.int64) * s_off_req  # B x L may pass 2^31
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            in_c = pos < end
            # each position's slot offset, looked up once per call (slot_offsets)
            off = tl.load(row + pos, mask=in_c, other=-1)
            ok = off >= 0  # else nothing is read
            bad = in_c & (off < 0)
            slot = tl.where(ok, off + kvh * s_cache_head, 0)
            # scores: q . (a_n * c_n), c_n the key's centroids (fp16) or fp8 key, a_n
            # its norm over the centroids' norm (MSE), applied to the (M, N) scores
            kc = _key_operand(
                cache_ptr,
                slot,
                ok,
                centroids_ptr,
                D,
                BLOCK_D,
                KEY_BITS,
                FP8_E4B15,
                HALVES,
            )
            kt = tl.trans(kc)  # (BLOCK_D, BLOCK_N)
            if DOT_F32:
                kt32 = kt.to(tl.float32)
                s = tl.dot(q_lo.to(tl.float32), kt32)
                s = tl.dot(q_hi.to(tl.float32), kt32, s)
            else:
                s = tl.dot(q_lo, kt, out_dtype=tl.float32)
                s = tl.dot(q_hi, kt, s, out_dtype=tl.float32)
            scale_n = row_scale[:, None]
            if KEY_BITS != 8:
                norm = _fp16_field(cache_ptr + slot + KEY_INDEX_BYTES, ok, HALVES)
                scale_n = scale_n * norm[None, :]
                if NORM_CORRECTION:
                    # each row: the sum of the centroids' squares of each position
                    # (the squares rounded to fp16, exact products, float32 sums)
                    kt2 = kt * kt
                    if DOT_F32:
                        sq = tl.dot(ones.to(tl.float32), kt2.to(tl.float32))
                    else:
                        sq = tl.dot(ones, kt2, out_dtype=tl.float32)
                    scale_n = scale_n * tl.math.rsqrt(sq + 1e-16)
            s = tl.where(bad[None, :], float("nan"), s * scale_n)
            s = tl.where(in_c[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            # values: p . (index * scale + zero) = (p * scale) . (index - h) + p .
            # (zero + h * scale), h the middle of the indices' range (3.5 at 3 bits);
            # the centred indices are exact in fp16, p * scale is rounded once
            # (FlashAttention rounds p and the value), the zero term is float32
            vidx = _value_indices(
                cache_ptr, slot, ok, D, BLOCK_D, KEY_BYTES, VALUE_BITS, HALVES
            )
            sz = cache_ptr + slot + KEY_BYTES + VALUE_INDEX_BYTES
            vscale = _fp16_field(sz, ok, HALVES)
            vzero = _fp16_field(sz + 2, ok, HALVES)
            vzero = vzero + ((1 << (VALUE_BITS - 1)) - 0.5) * vscale  # centred
            top = _pow2_floor(tl.max(tl.abs(vscale), 0))  # (0 where not ok)
            unit = tl.maximum(v_unit, top)
            vscale = tl.where(bad, float("nan"), vscale)
            # halved: the indices are doubled (exact: unit is a power of two)
            pv = p * (vscale * 0.5 / unit)[None, :]
            z_i = z_i * alpha + tl.sum(p * vzero[None, :], 1)
            acc = acc * (alpha * (v_unit / unit))[:, None]
            v_unit = unit
            if DOT_F32:
                acc = tl.dot(pv.to(tl.float16).to(tl.float32), vidx.to(tl.float32), acc)
            else:
                acc = tl.dot(pv.to(tl.float16), vidx, acc, out_dtype=tl.float32)
            m_i = m_new
        acc = acc * v_unit + z_i[:, None]
        empty = l_i == 0  # no key in the split (a NaN sum stays NaN: out and lse)
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(
            empty,
            float("-inf"),
            (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453,
        )
        tl.store(
            o_ptr
            + split.to(tl.int64) * s_o_split
            + tok[:, None] * s_o_tok
            + head[:, None] * s_o_head
            + d[None, :],
            out,
            mask=row_ok[:, None] & d_ok[None, :],
        )
        tl.store(
            lse_ptr + split.to(tl.int64) * s_lse_split + head * s_lse_head + tok,
            lse,
            mask=row_ok,
        )


def slot_offsets(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int):
    """(B, max(length, 1)) int64: the byte offset in ``kv_cache`` of position p's slot
    of kv head 0 for each request (block_table[r, p // block_size] * the block stride +
    p % block_size * the position stride), -1 where that block id is outside [0,
    num_blocks) or p is past the table. A prototype's layout: B x the longest cached
    length, whatever the others (a ragged one would bound it by the batch's tokens)."""
    num_blocks, block_size = kv_cache.shape[:2]
    pos = torch.arange(max(length, 1), device=block_table.device)
    if block_table.shape[1] == 0:
        return torch.full((block_table.shape[0], pos.numel()), -1, device=pos.device)
    col = pos // block_size
    blk = block_table[:, col.clamp(max=block_table.shape[1] - 1)].long()
    ok = (blk >= 0) & (blk < num_blocks) & (col < block_table.shape[1])
    off = blk * kv_cache.stride(0) + (pos % block_size) * kv_cache.stride(1)
    return torch.where(ok, off, -1)


def combine_splits(o: torch.Tensor, lse: torch.Tensor):
    """(out (N, Hq, D) float32, lse (Hq, N) float32) of split results o (S, N, Hq, D)
    and lse (S, Hq, N) over disjoint key ranges; a split without keys (lse -inf) weighs
    nothing, no keys at all gives out 0 and lse -inf, a NaN anywhere NaN."""
    m = lse.amax(0)  # (Hq, N)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse - m_safe)  # (S, Hq, N); 0 where -inf
    den = w.sum(0)
    out = torch.einsum("shn,snhd->nhd", w, o) / den.clamp_min(1e-30).T[..., None]
    out = torch.where((den == 0).T[..., None], torch.zeros_like(out), out)
    total = torch.where(den == 0, float("-inf"), m_safe + torch.log(den))
    nan = torch.isnan(m)
    out = torch.where(nan.T[..., None], float("nan"), out).contiguous()
    return out, torch.where(nan, float("nan"), total)


def cached_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: list[int],
    cached_lens: list[int],
    *,
    preset,
    centroids: torch.Tensor | None,
    rotation: torch.Tensor | None,
    scale: float,
    splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    info: dict | None = None,
):
    """(out (N, Hq, D) float32, lse (Hq, N) float32): each request's query rows against
    its cached keys and values [0, cached_lens[r]) read from the paged cache.

    query: (N, Hq, D) fp16/bf16 (un-rotated). kv_cache: uint8 (num_blocks, block_size,
    Hk, slot_bytes), unit stride over slot bytes. block_table: int32 (B, max_blocks).
    query_start_loc: B + 1 host ints; cached_lens: B host ints. splits: ranges of
    positions per (request, kv head), each its own program (default: enough programs
    for two per SM). block_m (query rows x heads of a group), block_n (positions),
    num_warps: the launch (default 32, 64, 4 on a GPU; 16, 16 in the interpreter).
    block_m is 16, 32 or 64: Triton compiles a 64-row tile's dots to wgmma on sm_90;
    with Triton 3.6 on the H200 machine the earlier form of this kernel gave NaN and an
    illegal address there (NOTES.md §26), the present one passes its GPU tests and is
    fastest there (§27). num_stages: Triton's software pipelining (default 1: off; on,
    the offsets' load cost 533 instructions a loop). info: a dict given here receives
    the compiled kernel's registers, spills and whether its dots are wgmma.
    Tensors and lengths are trusted (the prototype's callers validate them), but for
    the centroid table, which the kernel reads at every index a slot can hold.
    """
    if block_m is not None and block_m not in (16, 32, 64):
        raise ValueError(f"block_m must be 16, 32 or 64, got {block_m}")
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    n, hq, d = query.shape
    cfg = resolve_config(preset, d)
    if not cfg.key_fp8 and (centroids is None or centroids.numel() < 2**cfg.key_bits):
        raise ValueError(
            f"centroids must hold {2**cfg.key_bits} entries for {cfg.key_bits}-bit "
            f"keys, got {None if centroids is None else centroids.numel()}"
        )
    hk = kv_cache.shape[2]
    group = hq // hk
    b = len(cached_lens)
    dev = query.device
    q = query.float()
    if not cfg.key_fp8:
        # float32 (TF32 would round the query to 10 bits: torch's default is off, and
        # a caller that turns it on for matmuls turns it on here too)
        q = q @ rotation.float().T
    interp = interpreting() or not query.is_cuda
    block_n = block_n or (16 if interp else 64)
    block_m = block_m or (16 if interp else 32)
    longest = max(cached_lens, default=0)
    if splits is None:  # two programs per SM, counting the row tiles
        sms = (
            132
            if interp
            else torch.cuda.get_device_properties(dev).multi_processor_count
        )
        tiles = hk * sum(
            triton.cdiv((query_start_loc[i + 1] - query_start_loc[i]) * group, block_m)
            for i in range(b)
        )
        splits = min(triton.cdiv(2 * sms, max(tiles, 1)), triton.cdiv(longest, block_n))
        splits = max(1, splits)
    split_len = triton.cdiv(triton.cdiv(max(longest, 1), splits), block_n) * block_n
    if n == 0 or b == 0:
        return torch.zeros(n, hq, d, device=dev), torch.full(
            (hq, n), float("-inf"), device=dev
        )
    o = torch.empty(splits, n, hq, d, dtype=torch.float32, device=dev)
    lse = torch.empty(splits, hq, n, dtype=torch.float32, device=dev)
    max_rows = max(query_start_loc[i + 1] - query_start_loc[i] for i in range(b))
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)
    # the fp16 table: the dot's operand, as vLLM's dequant rounds each key (after
    # scaling, here before: the same rounding error, of the other factor)
    table = (
        torch.zeros(1, dtype=torch.float16, device=dev)
        if centroids is None
        else centroids.to(device=dev, dtype=torch.float16).contiguous()
    )
    offsets = slot_offsets(kv_cache, block_table, longest)
    grid = (b, triton.cdiv(max_rows * group, block_m), hk * splits)
    compiled = _cached_attention_kernel[grid](
        q,
        kv_cache,
        offsets,
        table,
        t(list(query_start_loc)),
        t(list(cached_lens)),
        o,
        lse,
        splits,
        split_len,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(2),
        offsets.stride(0),
        o.stride(0),
        o.stride(1),
        o.stride(2),
        lse.stride(0),
        lse.stride(1),
        scale * math.log2(math.e),
        GROUP=group,
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        KEY_BITS=cfg.key_bits,
        KEY_INDEX_BYTES=cfg.key_index_bytes,
        KEY_BYTES=cfg.key_bytes,
        VALUE_BITS=cfg.value_bits,
        VALUE_INDEX_BYTES=cfg.value_index_bytes,
        NORM_CORRECTION=cfg.norm_correction,
        FP8_E4B15=cfg.key_fp8 and fp8_e4b15_for(dev),
        HALVES=halves_ok(kv_cache, cfg),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_F32=interp,
        num_warps=num_warps or 4,
        num_stages=num_stages or 1,
    )
    if info is not None and compiled is not None:  # (the interpreter compiles nothing)
        ptx = compiled.asm.get("ptx", "")
        info.update(
            regs=compiled.n_regs, spills=compiled.n_spills, wgmma="wgmma" in ptx
        )
    return combine_splits(o, lse)


def fused_continuation_prefill_varlen(
    query,
    key,
    value,
    kv_cache,
    block_table,
    query_start_loc: list[int],
    seq_lens: list[int],
    *,
    preset,
    centroids,
    rotation,
    scale,
    splits=None,
    backend="auto",
    out=None,
    **launch,
):
    """What ``continuation_prefill_varlen`` computes (rounded differently: the module
    docstring), (N, Hq, D) in the query's dtype: the cached prefix through
    ``cached_attention``, the chunk's own tokens (key, value: (N, Hk, D)) through one
    causal varlen call, merged. Host lengths; ``launch``: ``cached_attention``'s
    block_m, block_n, num_warps, num_stages."""
    b = len(seq_lens)
    q_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(b)]
    cached = [seq_lens[i] - q_lens[i] for i in range(b)]
    o_c, lse_c = cached_attention(
        query,
        kv_cache,
        block_table,
        query_start_loc,
        cached,
        preset=preset,
        centroids=centroids,
        rotation=rotation,
        scale=scale,
        splits=splits,
        **launch,
    )
    out = torch.empty_like(query) if out is None else out
    new = torch.empty_like(query)
    backend = resolve_backend(backend, query.device, query.shape[2])
    call = make_call(q_lens, q_lens, True, query.device)
    lse_n = varlen_attention(call, query, key, value, scale, new, backend)
    merge_attn_states(out, o_c, lse_c, new, lse_n)
    return out
