"""One launch that readies a head group's workspace before its windows:

    q_buf[j, h]       <- query[j, q_head0 + h] @ rotation^T   (fp16)
    state_lse[h, j]   <- -inf                                 (nothing merged yet; optional)
    q16, k16, v16     <- the chunk's query, key, value as fp16 (bf16 inputs only; optional)

MSE keys are cached in the rotated space k_rot = k @ rotation^T (vLLM's Pi). The rotation
is orthonormal, so q . k = (q @ rotation^T) . k_rot: rotating the N queries once replaces
un-rotating every cached key. Fp8-key presets are not rotated, only converted. Products
are float32-accurate (3xTF32 on tensor cores), rounded once to fp16, the dtype of the
dequantized window. The query and the rotation are read through their strides.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dequant import use_triton


@triton.jit(do_not_specialize=["n_tok", "num_q", "num_kv", "q_head0", "kv_head0"])
def _prepare_kernel(
    q_ptr, k_ptr, v_ptr, r_ptr, qb_ptr, lse_ptr, q16_ptr, k16_ptr, v16_ptr, n_tok, num_q, num_kv, q_head0, kv_head0,
    s_q_tok, s_q_head, s_q_d, s_k_tok, s_k_head, s_k_d, s_v_tok, s_v_head, s_v_d, s_r0, s_r1,
    s_qb_tok, s_qb_head, s_lse_head, s_q16_tok, s_q16_head, s_k16_tok, s_k16_head, s_v16_tok, s_v16_head,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROTATE: tl.constexpr, INIT_LSE: tl.constexpr, CHUNK16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    slot = tl.program_id(1)  # [0, num_q): query heads; with CHUNK16 then num_kv key heads, num_kv value heads
    j = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query token
    j_mask = j < n_tok
    j64 = j.to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = j_mask[:, None] & (d < D)
    if slot < num_q:
        head = slot.to(tl.int64)
        x = tl.load(q_ptr + j64 * s_q_tok + (q_head0 + head) * s_q_head + d * s_q_d, mask=mask, other=0.0)
        dst = qb_ptr + j64 * s_qb_tok + head * s_qb_head
        xf = x.to(tl.float32)  # (BLOCK_M, BLOCK_D)
        if ROTATE:
            dd = tl.arange(0, BLOCK_D)[:, None]
            for n0 in tl.static_range(0, BLOCK_D, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)[None, :]
                rt = tl.load(r_ptr + cols * s_r0 + dd * s_r1, mask=(cols < D) & (dd < D), other=0.0)  # rotation^T
                y = tl.dot(xf, rt.to(tl.float32), input_precision="tf32x3")
                tl.store(dst + cols, y.to(tl.float16), mask=j_mask[:, None] & (cols < D))
        else:
            tl.store(dst + d, x.to(tl.float16), mask=mask)
        if INIT_LSE:
            tl.store(lse_ptr + head * s_lse_head + j, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=j_mask)
        if CHUNK16:
            tl.store(q16_ptr + j64 * s_q16_tok + head * s_q16_head + d, x.to(tl.float16), mask=mask)
    elif slot < num_q + num_kv:
        head = (slot - num_q).to(tl.int64)
        x = tl.load(k_ptr + j64 * s_k_tok + (kv_head0 + head) * s_k_head + d * s_k_d, mask=mask, other=0.0)
        tl.store(k16_ptr + j64 * s_k16_tok + head * s_k16_head + d, x.to(tl.float16), mask=mask)
    else:
        head = (slot - num_q - num_kv).to(tl.int64)
        x = tl.load(v_ptr + j64 * s_v_tok + (kv_head0 + head) * s_v_head + d * s_v_d, mask=mask, other=0.0)
        tl.store(v16_ptr + j64 * s_v16_tok + head * s_v16_head + d, x.to(tl.float16), mask=mask)


def prepare(query, key, value, rotation, q_head0: int, kv_head0: int, bufs, init_lse: bool, chunk16: bool) -> None:
    """Fill, for query heads [q_head0, +Hq_g) and kv heads [kv_head0, +Hk_g):
    bufs.q_buf <- query @ rotation^T; bufs.state_lse <- -inf if init_lse; bufs.q16,
    k16, v16 <- the chunk's query/key/value as fp16 if chunk16.

    query: (N, Hq, D), key/value: (N, Hk, D), any strides; rotation: (D, D), any float
    dtype and strides, or None (fp8 keys: no rotation).
    """
    n, hq_g, d = bufs.q_buf.shape
    hk_g = bufs.k_buf.shape[1]
    if n == 0:
        return
    if not use_triton(query):
        q = query[:, q_head0:q_head0 + hq_g]
        bufs.q_buf.copy_(q.float() @ rotation.float().T if rotation is not None else q)
        if init_lse:
            bufs.state_lse.fill_(float("-inf"))
        if chunk16:
            bufs.q16.copy_(q)
            bufs.k16.copy_(key[:, kv_head0:kv_head0 + hk_g])
            bufs.v16.copy_(value[:, kv_head0:kv_head0 + hk_g])
        return
    block_d = triton.next_power_of_2(d)
    r = rotation if rotation is not None else query  # not read without rotation
    q16, k16, v16 = (bufs.q16, bufs.k16, bufs.v16) if chunk16 else (bufs.q_buf,) * 3  # not written without
    lse = bufs.state_lse if init_lse else bufs.q_buf  # not written without
    block_m = 64
    grid = (triton.cdiv(n, block_m), hq_g + (2 * hk_g if chunk16 else 0))
    _prepare_kernel[grid](
        query, key, value, r, bufs.q_buf, lse, q16, k16, v16, n, hq_g, hk_g, q_head0, kv_head0,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), r.stride(0), r.stride(1),
        bufs.q_buf.stride(0), bufs.q_buf.stride(1), lse.stride(0), q16.stride(0), q16.stride(1),
        k16.stride(0), k16.stride(1), v16.stride(0), v16.stride(1),
        D=d, BLOCK_D=block_d, ROTATE=rotation is not None, INIT_LSE=init_lse, CHUNK16=chunk16,
        BLOCK_M=block_m, BLOCK_N=min(block_d, 64), num_warps=4)
