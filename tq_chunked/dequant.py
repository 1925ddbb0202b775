"""Window fill: the key/value rows one attention call reads, written into the
workspace.

A window holds segments, one per request (plan.py): a segment's first rows are cached
tokens, dequantized from the paged TurboQuant cache, and its last rows, if any, are
the chunk's own new tokens, copied from ``key``/``value``. Row ``t`` of the window
belongs to segment ``s`` with ``seg_start[s] <= t < seg_start[s + 1]`` (found by
binary search). One launch fills every segment of a window, ``cdiv(rows, BLOCK_T)``
programs per kv head, element by element; a gap between segments (plan.GAP) is
written as zeros.

MSE keys are cached in the rotated space ``k_rot = k @ rotation^T``. With ``unrotate``
a second launch turns each cached key back in place, ``k = fp16(k_rot) @ rotation``,
on the tensor cores: the rotation is split into an fp16 part and an fp16 remainder
scaled by 2^12, so every product is exact and sums in float32 (22 significant bits of
the rotation, against the one fp16 rounding that follows), as vLLM's own path
computes it (``k_rot.float() @ Pi``, then ``.half()``). The query and the chunk's
keys then stay as they are: one attention call over [cached | new] keys is exactly the
full-buffer computation. Values, and keys of fp8 presets, are not rotated. (The
un-rotation fused into the first kernel ran 15-20% slower on the H200 machine:
benchmarks/NOTES.md §12.)

Rounding: a cached element is rounded to fp16 (as vLLM's dequant writes it), then to
the window dtype (bf16 windows: a second rounding, as vLLM's ``.to(query.dtype)``).
Without unrotate the rows equal ``format.dequantize_reference(...).half()`` bit for bit
(fused multiply-add off, correctly rounded square root and division).

Never reads outside its tensors: a block id outside ``[0, num_blocks)`` is not read;
its token decodes to NaN (so the request's answer is visibly invalid, never finite and
wrong), and with ``err`` its (request, column) is recorded for the caller (chunked.py).
Head sizes that are not a power of two are padded with masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import (
    Launcher,
    interpreter_rounds_bf16,
    interpreting,
    round_bf16,
    use_triton,
)
from .format import TQConfig, dequantize_reference

# Per segment, in plan.Window.segs: start (cumulative), request, first cached position,
# cached rows, first chunk row in key/value (GAP_ROW: a gap of zero rows, plan.GAP).
SEG_FIELDS = 5
GAP_ROW = -(1 << 30)


def fp8_e4b15_for(device: torch.device) -> bool:
    """Whether vLLM writes fp8 keys as e4b15 here: on GPUs below SM 8.9 (e4m3
    elsewhere)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


@triton.jit
def _segment_of(start_ptr, t, nseg, steps):
    """For each row t, the largest s < nseg with start[s] <= t (start non-decreasing,
    start[0] <= t): a binary search of ``steps`` iterations."""
    lo = tl.zeros_like(t)
    hi = tl.zeros_like(t) + nseg
    for _ in range(steps):
        mid = (lo + hi) // 2
        right = tl.load(start_ptr + mid) <= t
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
    # inside the slot: a norm/scale follows
    hi = tl.load(ptr + bit // 8 + 1, mask=mask, other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> (bit % 8)) & ((1 << BITS) - 1)


@triton.jit
def _to_window(x, OUT_BF16: tl.constexpr, ROUND_BF16: tl.constexpr):
    """A float32 cached element -> the window dtype: fp16, then bf16 for bf16
    windows."""
    x = x.to(tl.float16)
    if OUT_BF16:
        x = round_bf16(x.to(tl.float32), ROUND_BF16).to(tl.bfloat16)
    return x


@triton.jit(do_not_specialize=["n_rows", "nseg", "steps", "head0"])
def _fill_kernel(
    cache_ptr,
    block_table_ptr,
    centroids_ptr,
    key_ptr,
    value_ptr,
    seg_ptr,
    k_out_ptr,
    v_out_ptr,
    err_ptr,
    n_rows,
    nseg,
    steps,
    head0,
    num_blocks,
    max_blocks,
    s_cache_block,
    s_cache_pos,
    s_cache_head,
    s_bt_req,
    s_bt_col,
    s_centroid,
    s_key_tok,
    s_key_head,
    s_key_d,
    s_val_tok,
    s_val_head,
    s_val_d,
    s_k_tok,
    s_k_head,
    s_v_tok,
    s_v_head,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEY_BITS: tl.constexpr,
    KEY_INDEX_BYTES: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    VALUE_INDEX_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    CHECK: tl.constexpr,
    K_BF16: tl.constexpr,
    V_BF16: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """The first pass of the fill (module docstring): every row of the window decoded
    element by element, MSE keys still in the rotated space; the new tokens copied."""
    head = tl.program_id(1).to(tl.int64)  # kv head within the group
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,) window row
    t_mask = t < n_rows
    tt = tl.where(t_mask, t, 0)
    seg = _segment_of(seg_ptr, tt, nseg, steps)
    # the per-segment arrays follow the nseg + 1 starts
    fields = seg_ptr + nseg + 1 + seg
    off = tt - tl.load(seg_ptr + seg)
    cached = tl.load(fields + 2 * nseg)
    in_cache = t_mask & (off < cached)
    req = tl.load(fields).to(tl.int64)
    pos = tl.load(fields + nseg) + off  # cache position of a cached row
    col = pos // BLOCK_SIZE
    block = tl.load(
        block_table_ptr + req * s_bt_req + col * s_bt_col,
        mask=in_cache & (col < max_blocks),
        other=-1,
    ).to(tl.int64)
    ok = in_cache & (block >= 0) & (block < num_blocks)  # anything else reads nothing
    bad = in_cache & ((block < 0) | (block >= num_blocks))
    if CHECK:  # the smallest (request, column) with a bad id, for the caller's report
        tl.atomic_min(
            err_ptr + tl.zeros_like(t), (req << 32) + col.to(tl.int64), mask=bad
        )
    slot = (
        block * s_cache_block
        + (pos % BLOCK_SIZE).to(tl.int64) * s_cache_pos
        + (head0 + head) * s_cache_head
    )
    slot = tl.where(ok, slot, 0)[:, None]  # (BLOCK_T, 1) byte offset of each slot
    row = t.to(tl.int64)[:, None]  # (BLOCK_T, 1) window row
    d = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D)
    mask = ok[:, None] & (d < D)
    out_mask = t_mask[:, None] & (d < D)
    nan = float("nan")
    if HAS_CHUNK:
        # row of key/value; < 0 in a gap
        crow = (tl.load(fields + 3 * nseg) + off - cached).to(tl.int64)
        chunk = t_mask & (off >= cached)
        cmask = (chunk & (crow >= 0))[:, None] & (d < D)
        crow = crow[:, None]

    # Keys
    if KEY_BITS == 8:
        raw = tl.load(cache_ptr + slot + d, mask=mask, other=0)
        if FP8_E4B15:
            k = raw.to(tl.float8e4b15, bitcast=True).to(tl.float32)
        else:
            k = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        idx = _indices_at(cache_ptr + slot, d, mask, KEY_BITS)
        # (BLOCK_T, BLOCK_D) float32
        c = tl.load(centroids_ptr + idx * s_centroid, mask=mask, other=0.0)
        if NORM_CORRECTION:
            c64 = c.to(tl.float64)
            sumsq = tl.sum(c64 * c64, axis=1).to(tl.float32)
            inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(sumsq + 1e-16))
            c = c * inv[:, None]
        norm = _fp16_at(cache_ptr + slot + KEY_INDEX_BYTES, ok[:, None])  # (BLOCK_T, 1)
        k = norm * c
    k = tl.where(bad[:, None], nan, k)
    kw = _to_window(k, K_BF16, ROUND_BF16)
    if HAS_CHUNK:
        kc = tl.load(
            key_ptr + crow * s_key_tok + (head0 + head) * s_key_head + d * s_key_d,
            mask=cmask,
            other=0.0,
        )
        kw = tl.where(chunk[:, None], kc.to(kw.dtype), kw)
    tl.store(k_out_ptr + row * s_k_tok + head * s_k_head + d, kw, mask=out_mask)

    # Values
    vslot = cache_ptr + slot + KEY_BYTES
    vidx = _indices_at(vslot, d, mask, VALUE_BITS).to(tl.float32)
    scale = _fp16_at(vslot + VALUE_INDEX_BYTES, ok[:, None])
    zero = _fp16_at(vslot + VALUE_INDEX_BYTES + 2, ok[:, None])
    val = tl.where(bad[:, None], nan, vidx * scale + zero)
    vw = _to_window(val, V_BF16, ROUND_BF16)
    if HAS_CHUNK:
        vc = tl.load(
            value_ptr + crow * s_val_tok + (head0 + head) * s_val_head + d * s_val_d,
            mask=cmask,
            other=0.0,
        )
        vw = tl.where(chunk[:, None], vc.to(vw.dtype), vw)
    tl.store(v_out_ptr + row * s_v_tok + head * s_v_head + d, vw, mask=out_mask)


launch_fill = Launcher(_fill_kernel)


@triton.jit(do_not_specialize=["n_rows", "nseg", "steps", "head0"])
def _unrotate_kernel(
    k16_ptr,
    k_out_ptr,
    rot_ptr,
    key_ptr,
    seg_ptr,
    n_rows,
    nseg,
    steps,
    head0,
    s_k_tok,
    s_k_head,
    s_rot0,
    s_rot1,
    s_key_tok,
    s_key_head,
    s_key_d,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    K_BF16: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The second pass of a two-pass fill: the window's cached keys, written by the
    first pass as fp16 in the rotated space, turned back in place (``k16_ptr`` and
    ``k_out_ptr`` are the same bytes); the chunk's new keys copied from key."""
    head = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < n_rows
    tt = tl.where(t_mask, t, 0)
    seg = _segment_of(seg_ptr, tt, nseg, steps)
    fields = seg_ptr + nseg + 1 + seg
    off = tt - tl.load(seg_ptr + seg)
    cached = tl.load(fields + 2 * nseg)
    in_cache = t_mask & (off < cached)
    row = t.to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    a = tl.load(
        k16_ptr + row * s_k_tok + head * s_k_head + d,
        mask=in_cache[:, None] & (d < D),
        other=0.0,
    )
    if DOT_F32:
        a = a.to(tl.float32)
    if HAS_CHUNK:
        chunk = t_mask & (off >= cached)
        crow = (tl.load(fields + 3 * nseg) + off - cached).to(tl.int64)
        crow = crow[:, None]  # < 0 in a gap
    dr = tl.arange(0, BLOCK_D)[:, None]
    for n0 in tl.static_range(0, BLOCK_D, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)[None, :]
        r = tl.load(
            rot_ptr + dr * s_rot0 + n * s_rot1, mask=(dr < D) & (n < D), other=0.0
        ).to(tl.float32)
        hi = r.to(tl.float16)
        lo = ((r - hi.to(tl.float32)) * 4096.0).to(tl.float16)
        if DOT_F32:
            hi = hi.to(tl.float32)
            lo = lo.to(tl.float32)
        acc = tl.dot(a, lo, out_dtype=tl.float32) * (1.0 / 4096.0)
        acc = tl.dot(a, hi, acc, out_dtype=tl.float32)
        kn = _to_window(acc, K_BF16, ROUND_BF16)
        if HAS_CHUNK:
            kc = tl.load(
                key_ptr + crow * s_key_tok + (head0 + head) * s_key_head + n * s_key_d,
                mask=(chunk[:, None] & (crow >= 0)) & (n < D),
                other=0.0,
            )
            kn = tl.where(chunk[:, None], kc.to(kn.dtype), kn)
        tl.store(
            k_out_ptr + row * s_k_tok + head * s_k_head + n,
            kn,
            mask=t_mask[:, None] & (n < D),
        )


launch_unrotate = Launcher(_unrotate_kernel)

# The un-rotation's launch configuration, (rows per program, output columns per dot,
# warps), by padded head size. Not tuned yet: benchmarks/fill_configs.py sweeps them
# (NOTES.md §12).
UNROTATE = {
    16: (64, 16, 4),
    32: (64, 32, 4),
    64: (64, 64, 4),
    128: (64, 64, 4),
    256: (64, 64, 4),
}


def fill_window(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cfg: TQConfig,
    centroids: torch.Tensor | None,
    rotation: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    window,
    head0: int,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    err: torch.Tensor | None = None,
    unrotate: bool = True,
    config: tuple | None = None,
) -> None:
    """Write the rows of ``window`` (a ``plan.Window``), kv heads [head0, head0 +
    k_out.shape[1]), into k_out and v_out.

    kv_cache: uint8 (num_blocks, block_size, Hk, slot_bytes), unit stride over slot
    bytes. block_table: int32 (B, max_blocks), any strides. centroids: float32
    (2**key_bits,), any stride (unused for fp8 keys). rotation: (D, D), any float dtype
    and strides (unused for fp8 keys, or without ``unrotate``). key, value: (N, Hk, D)
    fp16/bf16, any strides: the chunk's own tokens (read for the window's new rows).
    k_out, v_out: fp16 or bf16 (>= window.rows, Hk_group, D), unit stride over D.
    err: int64 (1,) on the device, or None: lowered to ``request << 32 | column`` of a
    bad block id read. unrotate: False writes MSE keys in the rotated space.
    config: the un-rotation's launch configuration (rows, columns, warps); default:
    UNROTATE. Arguments are trusted: ``continuation_prefill_varlen`` validates them.
    """
    if window.rows <= 0:
        return
    rotate = unrotate and not cfg.key_fp8
    fp8_e4b15 = cfg.key_fp8 and fp8_e4b15_for(kv_cache.device)
    if not use_triton(kv_cache):
        _fill_torch(
            kv_cache,
            block_table,
            cfg,
            centroids,
            rotation if rotate else None,
            key,
            value,
            window,
            head0,
            k_out,
            v_out,
            fp8_e4b15,
        )
        return
    block_d = triton.next_power_of_2(cfg.head_dim)
    # Element-wise: one warp, 4096 elements per program (4-bit keys: 1024), measured
    # (NOTES.md).
    elements = 1024 if cfg.key_bits == 4 else 4096
    block_t = 16 if interpreting() else max(1, elements // block_d)
    centroids = centroids if centroids is not None else kv_cache  # fp8 keys: not read
    k_bf16 = k_out.dtype == torch.bfloat16
    # rotated fp16 keys, where the second pass reads them
    k_first = k_out.view(torch.float16) if rotate else k_out
    launch_fill(
        (triton.cdiv(window.rows, block_t), k_out.shape[1]),
        kv_cache,
        block_table,
        centroids,
        key,
        value,
        window.segs,
        k_first,
        v_out,
        err if err is not None else window.segs,
        window.rows,
        window.nseg,
        window.steps,
        head0,
        kv_cache.shape[0],
        block_table.shape[1],
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        block_table.stride(1),
        centroids.stride(0),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        k_out.stride(0),
        k_out.stride(1),
        v_out.stride(0),
        v_out.stride(1),
        cfg.head_dim,
        block_d,
        kv_cache.shape[1],
        cfg.key_bits,
        cfg.key_index_bytes,
        cfg.key_bytes,
        cfg.value_bits,
        cfg.value_index_bytes,
        cfg.norm_correction,
        fp8_e4b15,
        window.has_chunk,
        err is not None,
        k_bf16 and not rotate,
        k_bf16,
        interpreter_rounds_bf16(k_out.dtype),
        block_t,
        num_warps=1,
        enable_fp_fusion=False,
    )
    if rotate:
        block_t, block_n, warps = config if config is not None else UNROTATE[block_d]
        if interpreting():
            block_t = 16
        launch_unrotate(
            (triton.cdiv(window.rows, block_t), k_out.shape[1]),
            k_first,
            k_out,
            rotation,
            key,
            window.segs,
            window.rows,
            window.nseg,
            window.steps,
            head0,
            k_out.stride(0),
            k_out.stride(1),
            rotation.stride(0),
            rotation.stride(1),
            key.stride(0),
            key.stride(1),
            key.stride(2),
            cfg.head_dim,
            block_d,
            window.has_chunk,
            k_bf16,
            interpreter_rounds_bf16(k_out.dtype),
            not kv_cache.is_cuda,
            block_t,
            block_n,
            num_warps=warps,
        )


def _fill_torch(
    kv_cache,
    block_table,
    cfg,
    centroids,
    rotation,
    key,
    value,
    window,
    head0,
    k_out,
    v_out,
    fp8_e4b15,
):
    """The same rows through the reference decoder, one segment at a time (CPU)."""
    hk = k_out.shape[1]
    heads = slice(head0, head0 + hk)
    for s in range(window.nseg):
        start, req, pos0, cached, qrow = window.segment(s)
        if cached:
            k, v = dequantize_reference(  # (Hk, n, D) float32
                kv_cache[:, :, heads],
                block_table[req],
                pos0,
                cached,
                cfg,
                centroids,
                fp8_e4b15,
            )
            k = k.transpose(0, 1).half()
            if rotation is not None:
                k = (k.float() @ rotation.float()).half()
            k_out[start : start + cached] = k
            v_out[start : start + cached] = v.transpose(0, 1).half()
        end = window.segment_end(s)
        if end > start + cached and qrow == GAP_ROW:
            k_out[start + cached : end] = 0
            v_out[start + cached : end] = 0
        elif end > start + cached:
            n = end - start - cached
            k_out[start + cached : end] = key[qrow : qrow + n, heads]
            v_out[start + cached : end] = value[qrow : qrow + n, heads]
