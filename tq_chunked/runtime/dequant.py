"""Window fill: the key/value rows one attention call reads, written into the
workspace.

A window holds segments, one per request (plan.py): a segment's first rows are cached
tokens, dequantized from the paged TurboQuant cache, and its last rows, if any, are
the chunk's own new tokens, copied from ``key``/``value``. Row ``t`` of the window
belongs to segment ``s`` with ``seg_start[s] <= t < seg_start[s + 1]`` (found by
binary search). One launch fills every segment of a window: a program takes a tile of
``BLOCK_T`` rows with all kv heads of the group (``BLOCK_T x HEADS`` cache slots, one
tensor-core tile), so that it reads whole slots and writes contiguous rows; a gap
between segments (plan.GAP) is written as zeros, and a tile without new or gap rows
skips the copy's instructions (benchmarks/NOTES.md §23). The cache is read in 16-bit
loads (every field of a slot starts on an even byte; a cache at an odd address or with
odd strides is read byte by byte instead) and bit-packed indices are unpacked sixteen
at a time: indices ``16g .. 16g + 15`` of a ``BITS``-wide stream are the ``BITS``
halfwords from halfword ``g * BITS``, one 64-bit word (byte by byte: eight at a time,
the ``BITS`` bytes from byte ``g * BITS``). (16-bit loads and the unpacking:
benchmarks/NOTES.md §20.)

MSE keys are cached in the rotated space ``k_rot = k @ rotation^T``. With ``unrotate``
the same program turns each cached key back, ``k = fp16(k_rot) @ rotation``, on the
tensor cores, from the rotation's parts (``split_rotation``, once per call): a rotation
whose entries have one magnitude ``s`` (vLLM's normalized Hadamard) is ``s`` times its
signs, one dot of exact products (at D 256 vLLM's, a Sylvester Hadamard, in groups of
16 columns: FILL); any other is an fp16 part plus an fp16 remainder scaled by 2^12, two
dots of exact products (22 significant bits of the rotation); the sums are float32,
ahead of the one fp16 rounding, as vLLM's own path computes it (``k_rot.float() @
Pi``, then ``.half()``).
The query and the chunk's keys then stay as they are: one attention call over [cached
| new] keys is exactly the full-buffer computation. Values, and keys of fp8 presets,
are not rotated.

Rounding: a cached element is rounded to fp16 (as vLLM's dequant writes it), then to
the window dtype (bf16 windows: a second rounding, as vLLM's ``.to(query.dtype)``).
Without unrotate the rows equal ``format.dequantize_reference(...).half()`` bit for bit
(fused multiply-add off, correctly rounded square root and division).

Never reads outside its tensors (a last group of sixteen 4-bit values, at a head size
of 8 mod 16, reads the slot's scale and zero after the indices, in the same slot): a
block id outside ``[0, num_blocks)`` is not read;
its token decodes to NaN (so the request's answer is visibly invalid, never finite and
wrong), and with ``err`` its (request, column) is recorded for the caller (prefill.py).
Head sizes that are not a power of two are padded with masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._utils import (
    Launcher,
    cdiv,
    interpreter_rounds_bf16,
    interpreting,
    next_power_of_2,
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
def _unpack(ptr, mask, D: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(M, BLOCK_D) int32: indices 0 .. D - 1 of a little-endian BITS-wide stream
    (BITS <= 4) at each row's ``ptr`` (M, 1); rows outside ``mask`` (M, 1) and
    columns past D read nothing and give 0. Eight indices at a time: indices 8g ..
    8g + 7 are the BITS bytes from byte g * BITS, one 32-bit word (int32: a set top
    bit is masked off after the shift)."""
    M: tl.constexpr = ptr.shape[0]
    G: tl.constexpr = BLOCK_D // 8
    g = tl.arange(0, G)[None, :]
    m = mask & (g < D // 8)
    w = tl.zeros([M, G], dtype=tl.int32)
    for j in tl.static_range(BITS):
        b = tl.load(ptr + g * BITS + j, mask=m, other=0).to(tl.int32)
        w = w | (b << (8 * j))
    shift = (tl.arange(0, 8) * BITS)[None, None, :]
    idx = (w[:, :, None] >> shift) & ((1 << BITS) - 1)
    return tl.reshape(idx, [M, BLOCK_D])


@triton.jit
def _unpack_halves(
    ptr, mask, D: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """``_unpack`` from 16-bit loads: ``ptr`` (M, 1) uint16 pointers to each row's
    stream (2-byte aligned). Sixteen indices at a time: indices 16g .. 16g + 15 are
    the BITS halfwords from halfword g * BITS, one 64-bit word (half the loads of
    ``_unpack``). Columns past D are unspecified (their
    group is read whole: for 4-bit values at a head size of 8 mod 16, the 4 bytes
    after the indices, the slot's scale and zero)."""
    M: tl.constexpr = ptr.shape[0]
    G: tl.constexpr = BLOCK_D // 16
    g = tl.arange(0, G)[None, :]
    m = mask & (g * 16 < D)
    w = tl.zeros([M, G], dtype=tl.int64)
    for j in tl.static_range(BITS):
        h = tl.load(ptr + g * BITS + j, mask=m, other=0).to(tl.int64)
        w = w | (h << (16 * j))
    shift = (tl.arange(0, 16) * BITS).to(tl.int64)[None, None, :]
    idx = ((w[:, :, None] >> shift) & ((1 << BITS) - 1)).to(tl.int32)
    return tl.reshape(idx, [M, BLOCK_D])


@triton.jit
def _to_window(x, OUT_BF16: tl.constexpr, ROUND_BF16: tl.constexpr):
    """A float32 cached element -> the window dtype: fp16, then bf16 for bf16
    windows."""
    x = x.to(tl.float16)
    if OUT_BF16:
        x = round_bf16(x.to(tl.float32), ROUND_BF16).to(tl.bfloat16)
    return x


@triton.jit
def _slot_values(
    cache_ptr,
    slot,
    ok,
    bad,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    VALUE_INDEX_BYTES: tl.constexpr,
    HALVES: tl.constexpr,
):
    """(M, BLOCK_D) float32 values of the slots whose first bytes are at ``slot`` (M,)
    where ``ok`` (nothing read elsewhere): index * scale + zero; NaN rows where ``bad``
    (through the scale). With HALVES, columns past D are unspecified
    (_unpack_halves)."""
    M: tl.constexpr = slot.shape[0]
    ok2 = ok[:, None]
    vslot = slot + KEY_BYTES
    if HALVES:
        vidx = _unpack_halves(
            (cache_ptr + vslot[:, None]).to(tl.pointer_type(tl.uint16)),
            ok2,
            D,
            VALUE_BITS,
            BLOCK_D,
        )
        sz = (cache_ptr + vslot + VALUE_INDEX_BYTES).to(tl.pointer_type(tl.float16))
        scale = tl.load(sz, mask=ok, other=0).to(tl.float32)
        zero = tl.load(sz + 1, mask=ok, other=0).to(tl.float32)
    else:
        vptr = cache_ptr + vslot[:, None]
        vidx = _unpack(vptr, ok2, D, VALUE_BITS, BLOCK_D)
        scale = _fp16_at(vptr + VALUE_INDEX_BYTES, ok2)
        zero = _fp16_at(vptr + VALUE_INDEX_BYTES + 2, ok2)
        scale, zero = tl.reshape(scale, [M]), tl.reshape(zero, [M])
    scale = tl.where(bad, float("nan"), scale)
    return vidx.to(tl.float32) * scale[:, None] + zero[:, None]


@triton.jit
def _slot_keys(
    cache_ptr,
    slot,
    ok,
    bad,
    centroids_ptr,
    s_centroid,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KEY_BITS: tl.constexpr,
    KEY_INDEX_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    HALVES: tl.constexpr,
):
    """(M, BLOCK_D) float32 keys of the slots at ``slot`` (M,) where ``ok``, as cached
    (MSE keys rotated): fp8 bytes, or norm * centroid (with NORM_CORRECTION, the
    centroids' row scaled to unit norm first); NaN rows where ``bad`` (through the
    norm; fp8 keys: set). Columns past D are 0."""
    M: tl.constexpr = slot.shape[0]
    ok2 = ok[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    if KEY_BITS == 8:
        if HALVES:
            dh = tl.arange(0, BLOCK_D // 2)[None, :]
            h = tl.load(
                (cache_ptr + slot[:, None]).to(tl.pointer_type(tl.uint16)) + dh,
                mask=ok2 & (2 * dh < D),
                other=0,
            )
            raw = tl.reshape(
                tl.join((h & 0xFF).to(tl.uint8), (h >> 8).to(tl.uint8)),
                [M, BLOCK_D],
            )
        else:
            raw = tl.load(cache_ptr + slot[:, None] + d, mask=ok2 & (d < D), other=0)
        if FP8_E4B15:
            k = raw.to(tl.float8e4b15, bitcast=True).to(tl.float32)
        else:
            k = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        k = tl.where(bad[:, None], float("nan"), k)
    else:
        if HALVES:
            idx = _unpack_halves(
                (cache_ptr + slot[:, None]).to(tl.pointer_type(tl.uint16)),
                ok2,
                D,
                KEY_BITS,
                BLOCK_D,
            )
            norm = tl.load(
                (cache_ptr + slot + KEY_INDEX_BYTES).to(tl.pointer_type(tl.float16)),
                mask=ok,
                other=0,
            ).to(tl.float32)
        else:
            idx = _unpack(cache_ptr + slot[:, None], ok2, D, KEY_BITS, BLOCK_D)
            norm = tl.reshape(
                _fp16_at(cache_ptr + slot[:, None] + KEY_INDEX_BYTES, ok2), [M]
            )
        # indices are in range whatever the bytes: the table is read unmasked
        c = tl.load(centroids_ptr + idx * s_centroid)
        if NORM_CORRECTION:
            c64 = c.to(tl.float64)
            sumsq = tl.sum(c64 * c64, axis=1).to(tl.float32)
            inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(sumsq + 1e-16))
            c = c * inv[:, None]
        k = tl.where(bad, float("nan"), norm)[:, None] * c
    return k


@triton.jit
def _tile(
    seg_ptr,
    block_table_ptr,
    err_ptr,
    n_rows,
    nseg,
    steps,
    head0,
    n_heads,
    num_blocks,
    max_blocks,
    s_cache_block,
    s_cache_pos,
    s_cache_head,
    s_bt_req,
    s_bt_col,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CHECK: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """What each of a program's M = BLOCK_T x HEADS slots is (row-major: window row,
    then kv head of the group): its window ``row`` and kv head ``h2`` (M, 1), the
    columns ``d`` (1, BLOCK_D), and, each (M,), whether it is ``live`` (a row of the
    window, a head of the group) and for a cached row the first byte of its cache
    ``slot`` where ``ok`` (0 elsewhere), or ``bad`` where its block id is outside the
    cache (nothing read; with CHECK, program part 0 records the smallest (request,
    column) in ``err``). For new tokens, each (M, 1): the row of key/value ``crow`` (<
    0 in a gap), whether the slot is a new or gap row ``chunk``, whether it is read
    from key/value ``cmask``; and ``new_rows``, 1 where the tile has any such row, else
    0. These are unused, and compiled out, in a window without new tokens."""
    M: tl.constexpr = BLOCK_T * HEADS
    part = tl.program_id(1)  # 0 without SPLIT
    m = tl.arange(0, M)
    t = tl.program_id(0) * BLOCK_T + m // HEADS  # (M,) window row
    head = (m % HEADS).to(tl.int64)  # (M,) kv head within the group
    in_rows = t < n_rows
    live = in_rows & (head < n_heads)
    tt = tl.where(in_rows, t, 0)
    seg = _segment_of(seg_ptr, tt, nseg, steps)
    # the per-segment arrays follow the nseg + 1 starts
    fields = seg_ptr + nseg + 1 + seg
    off = tt - tl.load(seg_ptr + seg)
    cached = tl.load(fields + 2 * nseg)
    in_cache = live & (off < cached)
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
    # the smallest (request, column) with a bad id, for the caller's report (once)
    if CHECK and (part == 0):
        tl.atomic_min(
            err_ptr + tl.zeros_like(m), (req << 32) + col.to(tl.int64), mask=bad
        )
    slot = tl.where(
        ok,
        block * s_cache_block
        + (pos % BLOCK_SIZE).to(tl.int64) * s_cache_pos
        + (head0 + head) * s_cache_head,
        0,
    )
    row = t.to(tl.int64)[:, None]
    h2 = head[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    crow = (tl.load(fields + 3 * nseg) + off - cached).to(tl.int64)
    chunk = (live & (off >= cached))[:, None]
    cmask = chunk & (crow >= 0)[:, None]
    crow = crow[:, None]
    new_rows = tl.max(chunk.to(tl.int32))
    return row, h2, d, live, slot, ok, bad, crow, chunk, cmask, new_rows


@triton.jit
def _with_new_rows(x, ptr, mask, chunk):
    """``x`` with the rows of new tokens (``chunk``) read at ``ptr`` (the chunk's key
    or value; ``mask`` off reads nothing and gives 0: a gap's zeros)."""
    return tl.where(chunk, tl.load(ptr, mask=mask, other=0.0).to(x.dtype), x)


@triton.jit
def _window_rows(
    x,
    cols,
    src_ptr,
    s_src_tok,
    s_src_head,
    s_src_d,
    h2,
    head0,
    crow,
    chunk,
    cmask,
    any_new,
    D: tl.constexpr,
    WHOLE: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """What the fill stores at columns ``cols`` (1, C) of the tile's rows (``_tile``):
    float32 ``x`` (M, C) in the window dtype, with the rows of new tokens copied from
    the chunk's key or value (``src_ptr``, kv heads ``head0 + h2``) and a gap's as
    zeros, in a tile that has any (``any_new``). WHOLE: ``cols`` are a whole row's,
    read up to D; else a block of columns of a row without padding (D == BLOCK_D)."""
    x = _to_window(x, OUT_BF16, ROUND_BF16)
    if HAS_CHUNK:  # noqa: SIM102 (any_new is a tensor only then)
        if any_new:
            src = src_ptr + crow * s_src_tok + (head0 + h2) * s_src_head
            src = src + cols * s_src_d
            new_mask = cmask
            if WHOLE:
                new_mask = cmask & (cols < D)
            x = _with_new_rows(x, src, new_mask, chunk)
    return x


@triton.jit
def _sylvester_unrotate(a, s16, BLOCK_D: tl.constexpr, DOT_F64: tl.constexpr):
    """(M, BLOCK_D) fp16 keys times ``H kron S``: S the (16, 16) signs ``s16`` (fp16),
    H the Sylvester signs of BLOCK_D / 16 (vLLM's normalized Hadamard of BLOCK_D is
    its magnitude times ``H kron H16``). Each group of 16 columns is multiplied by S on
    the tensor cores (exact products, float32 sums), then the groups are combined by a
    Walsh-Hadamard transform (log2(BLOCK_D / 16) stages of sums and differences in
    float32): 1/8 of the tensor-core work of the (BLOCK_D, BLOCK_D) dot at D 128, and a
    (16, 16) operand instead of (BLOCK_D, BLOCK_D). Returns (M, BLOCK_D) float32."""
    M: tl.constexpr = a.shape[0]
    NB: tl.constexpr = BLOCK_D // 16
    L: tl.constexpr = M * 16
    # rows of the dot: group-major, so that group g's products are rows g*M .. g*M+M-1
    x = tl.reshape(tl.permute(tl.reshape(a, [M, NB, 16]), [1, 0, 2]), [NB * M, 16])
    if DOT_F64:
        p = tl.dot(x.to(tl.float64), s16.to(tl.float64), out_dtype=tl.float64)
        p = p.to(tl.float32)
    else:
        p = tl.dot(x, s16, out_dtype=tl.float32)
    p = tl.reshape(p, [NB, L])
    for stage in tl.static_range(8):  # log2(NB) stages (BLOCK_D up to 4096)
        if (2 << stage) <= NB:
            # groups g and g + 2^stage -> their sum and their difference
            p = tl.reshape(p, [NB // (2 << stage), 2, (1 << stage) * L])
            p = tl.permute(p, [0, 2, 1])
            u, v = tl.split(p)
            p = tl.permute(tl.join(u + v, u - v), [0, 2, 1])
            p = tl.reshape(p, [NB, L])
    return tl.reshape(tl.permute(tl.reshape(p, [NB, M, 16]), [1, 0, 2]), [M, BLOCK_D])


@triton.jit(do_not_specialize=["n_rows", "nseg", "steps", "head0", "n_heads", "nflags"])
def _fill_kernel(
    cache_ptr,
    block_table_ptr,
    centroids_ptr,
    parts_ptr,
    flags_ptr,
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
    n_heads,
    nflags,
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
    ROTATE: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    CHECK: tl.constexpr,
    OUT_BF16: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    # the interpreter: products and sums in float64 (numpy's float32 matmul sums a
    # row in an order that depends on its place in the tile)
    DOT_F64: tl.constexpr,
    # the cache read in 16-bit loads (its address and byte strides even, as vLLM's)
    HALVES: tl.constexpr,
    # values and keys in programs of their own (grid axis 1: 0 values, 1 keys)
    SPLIT: tl.constexpr,
    # the Sylvester un-rotation compiled (taken where the rotation's flags are 3)
    SYLVESTER: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NFLAGS: tl.constexpr,
):
    """The fill (module docstring): BLOCK_T window rows x HEADS kv heads (n_heads of
    them real) per program (``_tile``); its values, then its keys, un-rotated with
    ROTATE, each stored with the chunk's new rows copied in (``_window_rows``); with
    SPLIT, program (i, 0) writes tile i's values and (i, 1) its keys. The stores and
    the un-rotation in column blocks are written here rather than in helpers: a
    helper's inlined scope adds debug labels to the PTX, where ptxas schedules
    differently (benchmarks/NOTES.md §34)."""
    row, h2, d, live, slot, ok, bad, crow, chunk, cmask, new_rows = _tile(
        seg_ptr,
        block_table_ptr,
        err_ptr,
        n_rows,
        nseg,
        steps,
        head0,
        n_heads,
        num_blocks,
        max_blocks,
        s_cache_block,
        s_cache_pos,
        s_cache_head,
        s_bt_req,
        s_bt_col,
        BLOCK_D,
        BLOCK_SIZE,
        CHECK,
        HEADS,
        BLOCK_T,
    )
    # whether any row of the tile is a new token or a gap: most tiles of a batch window
    # hold cached rows alone and skip the copy (unused, and compiled out, in a window
    # without new tokens)
    any_new = new_rows > 0
    part = tl.program_id(1)  # 0 without SPLIT

    # Values: index * scale + zero; a bad block id gives NaN through its scale
    if (part == 0) | (not SPLIT):
        v = _slot_values(
            cache_ptr,
            slot,
            ok,
            bad,
            D,
            BLOCK_D,
            KEY_BYTES,
            VALUE_BITS,
            VALUE_INDEX_BYTES,
            HALVES,
        )
        vw = _window_rows(
            v,
            d,
            value_ptr,
            s_val_tok,
            s_val_head,
            s_val_d,
            h2,
            head0,
            crow,
            chunk,
            cmask,
            any_new,
            D,
            True,
            HAS_CHUNK,
            OUT_BF16,
            ROUND_BF16,
        )
        tl.store(
            v_out_ptr + row * s_v_tok + h2 * s_v_head + d,
            vw,
            mask=live[:, None] & (d < D),
        )

    # Keys; a bad block id gives NaN through its norm (fp8 keys: set)
    if (part == 1) | (not SPLIT):
        k = _slot_keys(
            cache_ptr,
            slot,
            ok,
            bad,
            centroids_ptr,
            s_centroid,
            D,
            BLOCK_D,
            KEY_BITS,
            KEY_INDEX_BYTES,
            NORM_CORRECTION,
            FP8_E4B15,
            HALVES,
        )
        whole = True  # stored whole: not rotated, or un-rotated in groups of 16
        if ROTATE:
            # k = fp16(k_rot) @ rotation: vLLM's normalized Sylvester Hadamard in
            # groups of 16 columns (compiled with SYLVESTER, taken where the flags
            # say so), any other rotation in blocks of BLOCK_N columns, each stored
            # as it is made
            flags = tl.load(
                flags_ptr + tl.arange(0, NFLAGS),
                mask=tl.arange(0, NFLAGS) < nflags,
                other=3,
            )
            uniform = tl.min(flags & 1, 0) == 1
            mag = tl.load(flags_ptr + nflags).to(tl.float32, bitcast=True)
            a = k.to(tl.float16)
            sylvester = False
            if SYLVESTER:
                sylvester = tl.min(flags, 0) == 3
                if sylvester:
                    c16 = tl.arange(0, 16)
                    signs = parts_ptr + 2 * BLOCK_D * BLOCK_D
                    s16 = tl.load(signs + c16[:, None] * BLOCK_D + c16[None, :])
                    k = _sylvester_unrotate(a, s16, BLOCK_D, DOT_F64) * mag
            if not sylvester:
                # in blocks of BLOCK_N columns, from the parts in the workspace: s *
                # signs where the rotation has one magnitude s (one dot), else the
                # fp16 part plus the remainder scaled by 2^12 (two dots); each block
                # stored as it is made
                if DOT_F64:
                    a = a.to(tl.float64)
                ACC: tl.constexpr = tl.float64 if DOT_F64 else tl.float32
                dr = tl.arange(0, BLOCK_D)[:, None]
                for n0 in tl.static_range(0, BLOCK_D, BLOCK_N):
                    n = n0 + tl.arange(0, BLOCK_N)[None, :]
                    if uniform:
                        sg = tl.load(
                            parts_ptr + 2 * BLOCK_D * BLOCK_D + dr * BLOCK_D + n
                        ).to(a.dtype)
                        acc = tl.dot(a, sg, out_dtype=ACC).to(tl.float32) * mag
                    else:
                        hi = tl.load(parts_ptr + dr * BLOCK_D + n).to(a.dtype)
                        lo = tl.load(
                            parts_ptr + BLOCK_D * BLOCK_D + dr * BLOCK_D + n
                        ).to(a.dtype)
                        acc = tl.dot(a, lo, out_dtype=ACC) * (1.0 / 4096.0)
                        acc = tl.dot(a, hi, acc, out_dtype=ACC).to(tl.float32)
                    kn = _window_rows(
                        acc,
                        n,
                        key_ptr,
                        s_key_tok,
                        s_key_head,
                        s_key_d,
                        h2,
                        head0,
                        crow,
                        chunk,
                        cmask,
                        any_new,
                        D,
                        False,
                        HAS_CHUNK,
                        OUT_BF16,
                        ROUND_BF16,
                    )
                    tl.store(
                        k_out_ptr + row * s_k_tok + h2 * s_k_head + n,
                        kn,
                        mask=live[:, None],
                    )
            whole = sylvester
        if whole:
            kw = _window_rows(
                k,
                d,
                key_ptr,
                s_key_tok,
                s_key_head,
                s_key_d,
                h2,
                head0,
                crow,
                chunk,
                cmask,
                any_new,
                D,
                True,
                HAS_CHUNK,
                OUT_BF16,
                ROUND_BF16,
            )
            tl.store(
                k_out_ptr + row * s_k_tok + h2 * s_k_head + d,
                kw,
                mask=live[:, None] & (d < D),
            )


launch_fill = Launcher(_fill_kernel)


def halves_ok(kv_cache: torch.Tensor, cfg: TQConfig) -> bool:
    """Whether the fill may read the cache in 16-bit loads: its address and byte
    strides even, so that every slot starts on an even byte, and so does each field
    of the slot (as in every preset at every served head size)."""
    return (
        kv_cache.data_ptr() % 2 == 0
        and all(s % 2 == 0 for s in kv_cache.stride()[:3])
        and cfg.key_bytes % 2 == 0
        and cfg.key_index_bytes % 2 == 0
        and cfg.value_index_bytes % 2 == 0
    )


# split_rotation's blocks of rotation entries, each with its "one magnitude" flag
SPLIT_BLOCK = 1024


def split_flags(head_dim: int) -> int:
    """How many "one magnitude" flags split_rotation writes for this head size."""
    return cdiv(head_dim * head_dim, SPLIT_BLOCK)


@triton.jit
def _split_kernel(
    rot_ptr, parts_ptr, flags_ptr, s_rot0, s_rot1, D: tl.constexpr, BLOCK: tl.constexpr
):
    """split_rotation on the device: parts[0] = fp16(r), parts[1] = fp16((r -
    parts[0]) * 2^12), parts[2] = -1 where r < 0, else +1 (+-0 and NaN: +1), and per
    block (flags[block]) 1 where every entry has the magnitude of r[0, 0], that
    magnitude positive and finite, 3 where moreover every entry has the sign of the
    Sylvester Hadamard's (-1 where the bits of row and column share an odd count),
    else 0; program 0 writes the magnitude (flags[-1], float32 bits)."""
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    mask = i < D * D
    r = tl.load(
        rot_ptr + (i // D) * s_rot0 + (i % D) * s_rot1, mask=mask, other=0.0
    ).to(tl.float32)
    mag = tl.abs(tl.load(rot_ptr).to(tl.float32))
    hi = r.to(tl.float16)
    lo = ((r - hi.to(tl.float32)) * 4096.0).to(tl.float16)
    tl.store(parts_ptr + i, hi, mask=mask)
    tl.store(parts_ptr + D * D + i, lo, mask=mask)
    tl.store(parts_ptr + 2 * D * D + i, tl.where(r < 0, -1.0, 1.0), mask=mask)
    # mag is finite and positive (0 == 0 and inf == inf must not pass)
    usable = ((mag > 0) & (mag < float("inf"))).to(tl.int32)
    same = tl.where(mask, (tl.abs(r) == mag).to(tl.int32), 1) * usable
    odd = (i // D) & (i % D)  # the parity of its bits: the Sylvester sign
    for sh in tl.static_range(5):
        odd = odd ^ (odd >> (1 << (4 - sh)))
    sylvester = tl.where(mask, (r < 0) == ((odd & 1) == 1), True).to(tl.int32)
    tl.store(flags_ptr + pid, tl.min(same * (1 + 2 * sylvester), 0))
    if pid == 0:
        tl.store(flags_ptr + tl.num_programs(0), mag.to(tl.int32, bitcast=True))


launch_split = Launcher(_split_kernel)


def split_rotation(
    rotation: torch.Tensor,
    parts: torch.Tensor | None = None,
    flags: torch.Tensor | None = None,
):
    """The rotation, prepared for the fill's un-rotation on the tensor cores (no
    host-device synchronization):

    * ``parts[0]``, ``parts[1]``: its fp16 rounding and the remainder scaled by 2^12
      (``rotation ~= parts[0] + parts[1] / 4096`` to 22 significant bits);
    * ``parts[2]``: its signs (-1 where an entry is negative, else +1), and in ``flags``
      whether every entry has one magnitude ``s``, positive and finite, with ``s``:
      then ``rotation = s * parts[2]`` exactly and the fill makes one fp16 dot with the
      signs (exact products, float32 sums, one scaling) instead of two; and whether
      the signs are moreover the Sylvester Hadamard's (vLLM's normalized Hadamard,
      ``+-1/sqrt(D)``): then the fill multiplies groups of 16 columns by the signs'
      (16, 16) corner and combines the groups by a Walsh-Hadamard transform.

    rotation: (D, D), float32, fp16 or bf16, any strides. parts: fp16 (3, D, D),
    contiguous; flags: int32 (split_flags(D) + 1,): per block of SPLIT_BLOCK entries
    1 where every entry has the magnitude of rotation[0, 0] and that magnitude is
    positive and finite, 3 where moreover each entry's sign is the Sylvester
    Hadamard's (negative where the bits of its row and column indices share an odd
    count), else 0; then the magnitude's float32 bits (workspace regions); allocated
    when None. Returns (parts, flags).
    """
    d = rotation.shape[0]
    nflags = split_flags(d)
    if parts is None:
        parts = torch.empty(3, d, d, dtype=torch.float16, device=rotation.device)
    if flags is None:
        flags = torch.empty(nflags + 1, dtype=torch.int32, device=rotation.device)
    if not use_triton(rotation):
        r = rotation.float()
        mag = r[0, 0].abs()
        parts[0] = r.half()
        parts[1] = ((r - parts[0].float()) * 4096.0).half()
        parts[2] = torch.where(r < 0, -1.0, 1.0)
        same = (r.abs() == mag) & (mag > 0) & torch.isfinite(mag)
        idx = torch.arange(d, device=r.device)
        odd = torch.tensor([bin(x).count("1") % 2 for x in range(d)], device=r.device)[
            idx[:, None] & idx[None, :]
        ]
        sylvester = same & ((r < 0) == (odd == 1))

        def blocks(x):
            pad = (0, nflags * SPLIT_BLOCK - d * d)
            x = torch.nn.functional.pad(x.flatten(), pad, value=True)
            return x.view(nflags, SPLIT_BLOCK).all(1).int()

        flags[:nflags] = blocks(same) + 2 * blocks(sylvester)
        flags[nflags] = mag.view(torch.int32)
        return parts, flags
    launcher, grid, args, options = split_launch(rotation, parts, flags)
    launcher(grid, *args, **options)
    return parts, flags


def split_launch(rotation: torch.Tensor, parts: torch.Tensor, flags: torch.Tensor):
    """``split_rotation``'s Triton launch into ``parts`` and ``flags``, as (launcher,
    grid, arguments, options)."""
    d = rotation.shape[0]
    args = (
        rotation,
        parts,
        flags,
        rotation.stride(0),
        rotation.stride(1),
        d,
        SPLIT_BLOCK,
    )
    return launch_split, (split_flags(d),), args, {}


@dataclass(frozen=True)
class FillLaunch:
    """How the fill is launched: ``slots`` cache slots per program (window rows x the
    kv heads of the group), ``block_n`` output columns per dot of the un-rotation in
    column blocks, ``warps`` per program; ``split``: values and keys in programs of
    their own; ``sylvester``: the un-rotation of vLLM's Hadamard in groups of 16
    columns compiled beside the column blocks (taken where split_rotation's flags say
    so)."""

    slots: int
    block_n: int
    warps: int
    split: bool = False
    sylvester: bool = False


# The fill's launch by padded head size and whether keys are un-rotated (fp8 keys, and
# MSE keys left rotated as reference.py reads them, are not), from
# benchmarks/fill_configs.py's sweeps on the H200: 64 slots and 4 warps for MSE keys,
# the fastest or within 4 % (NOTES.md §16, §22; D 16 and 32 take D 64's tile); 32
# slots for fp8 keys at D 128 (§23); values and keys in one program (§20); the
# Sylvester un-rotation at D 256 only, where its smaller operand saves more than its
# registers cost (§24).
FILL = {
    (16, True): FillLaunch(64, 16, 4),
    (32, True): FillLaunch(64, 32, 4),
    (64, True): FillLaunch(64, 64, 4),
    (128, True): FillLaunch(64, 64, 4),
    (256, True): FillLaunch(64, 64, 4, sylvester=True),
    (16, False): FillLaunch(64, 16, 4),
    (32, False): FillLaunch(64, 32, 4),
    (64, False): FillLaunch(64, 64, 4),
    (128, False): FillLaunch(32, 128, 4),
    (256, False): FillLaunch(64, 256, 4),
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
    config: FillLaunch | None = None,
    parts: tuple | None = None,
) -> None:
    """Write the rows of ``window`` (a ``plan.Window``), kv heads [head0, head0 +
    k_out.shape[1]), into k_out and v_out.

    kv_cache: uint8 (num_blocks, block_size, Hk, slot_bytes), unit stride over slot
    bytes. block_table: int32 (B, max_blocks), any strides. centroids: float32
    (2**key_bits,), any stride (unused for fp8 keys). rotation: (D, D), any float dtype
    and strides (unused for fp8 keys, or without ``unrotate``). key, value: (N, Hk, D)
    fp16/bf16, any strides: the chunk's own tokens (read for the window's new rows).
    k_out, v_out: fp16 or bf16, both the same (>= window.rows, Hk_group, D), unit
    stride over D. err: int64 (1,) on the device, or None: lowered to ``request << 32
    | column`` of a bad block id read. unrotate: False writes MSE keys in the rotated
    space. config: the launch (``FillLaunch``); default: FILL's for the head size.
    parts: ``split_rotation(rotation)``'s (parts, flags) (a caller that fills several
    windows splits once); made here when None. Arguments are trusted:
    ``continuation_prefill_varlen`` validates them.
    """
    if window.rows <= 0:
        return
    if not use_triton(kv_cache):
        rotate = unrotate and not cfg.key_fp8
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
            cfg.key_fp8 and fp8_e4b15_for(kv_cache.device),
        )
        return
    launch = fill_launch(
        kv_cache, block_table, cfg, centroids, rotation, key, value, window, head0,
        k_out, v_out, err, unrotate, config, parts,
    )  # fmt: skip
    if launch is not None:
        launcher, grid, args, options = launch
        launcher(grid, *args, **options)


def fill_launch(
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
    config: FillLaunch | None = None,
    parts: tuple | None = None,
) -> tuple | None:
    """``fill_window``'s Triton launch, as (launcher, grid, arguments, options), with
    its arguments; None for a window without rows."""
    if window.rows <= 0:
        return None
    rotate = unrotate and not cfg.key_fp8
    block_d = next_power_of_2(cfg.head_dim)
    launch = config if config is not None else FILL[(block_d, rotate)]
    fp8_e4b15 = cfg.key_fp8 and fp8_e4b15_for(kv_cache.device)
    assert k_out.dtype == v_out.dtype, "k_out and v_out: one window dtype"
    if not rotate:
        rot_parts, flags = kv_cache, kv_cache  # not read unrotated
    else:
        rot_parts, flags = parts if parts is not None else split_rotation(rotation)
    nflags = split_flags(cfg.head_dim) if rotate else 1
    n_heads = k_out.shape[1]
    heads = next_power_of_2(n_heads)
    # A program's slots are the same number whatever the kv-head group (rows x heads;
    # past 64 heads, one row of all of them), so that each row's un-rotation is the
    # same dot, and the same bits, however a call groups its kv heads. The
    # interpreter: small tiles of 32 slots.
    block_t = max(1, (32 if interpreting() else launch.slots) // heads)
    centroids = centroids if centroids is not None else kv_cache  # fp8 keys: not read
    grid = (cdiv(window.rows, block_t), 2 if launch.split else 1)
    args = (
        kv_cache,
        block_table,
        centroids,
        rot_parts,
        flags,
        key,
        value,
        window.segs,
        k_out,
        v_out,
        err if err is not None else window.segs,
        window.rows,
        window.nseg,
        window.search_steps,
        head0,
        n_heads,
        nflags,
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
        rotate,
        window.has_chunk,
        err is not None,
        k_out.dtype == torch.bfloat16,
        interpreter_rounds_bf16(k_out.dtype),
        not kv_cache.is_cuda,
        halves_ok(kv_cache, cfg),
        launch.split,
        launch.sylvester and rotate,
        heads,
        block_t,
        min(launch.block_n, block_d),
        next_power_of_2(nflags),
    )
    options = {"num_warps": launch.warps, "enable_fp_fusion": False}
    return launch_fill, grid, args, options


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
    heads = slice(head0, head0 + k_out.shape[1])
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
        for o, src in ((k_out, key), (v_out, value)):
            if end > start + cached and qrow == GAP_ROW:
                o[start + cached : end] = 0
            elif end > start + cached:
                n = end - start - cached
                o[start + cached : end] = src[qrow : qrow + n, heads]
