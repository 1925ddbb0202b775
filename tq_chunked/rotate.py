"""Query preparation: q (Lq, Hq, D) -> q @ rotation^T as fp16, head-major (Hq, Lq, D).

MSE keys are cached in the rotated space k_rot = k @ rotation^T (vLLM's Pi). Since
the rotation is orthonormal, q . k = (q @ rotation^T) . k_rot: rotating the Lq queries once replaces
un-rotating every cached key. Fp8-key presets are not rotated (rotation=None): the
query is only converted and transposed. Computed in float32 (3xTF32 on tensor cores,
about float32-accurate), rounded once to fp16, the dtype of the dequantized window.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dequant import use_triton


@triton.jit(do_not_specialize=["L"])
def _rotate_query_kernel(q_ptr, r_ptr, out_ptr, s_ql, s_qh, s_oh, s_ol, L,
                         D: tl.constexpr, ROTATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    head = tl.program_id(1).to(tl.int64)
    l = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query
    mask = l[:, None] < L
    d = tl.arange(0, D)
    q = tl.load(q_ptr + l[:, None] * s_ql + head * s_qh + d[None, :], mask=mask, other=0.0).to(tl.float32)
    out_rows = out_ptr + head * s_oh + l[:, None] * s_ol
    if ROTATE:
        for n0 in tl.static_range(0, D, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            r = tl.load(r_ptr + cols[None, :] * D + d[:, None])  # (D, BLOCK_N) = rotation^T[:, cols]
            y = tl.dot(q, r, input_precision="tf32x3")
            tl.store(out_rows + cols[None, :], y.to(tl.float16), mask=mask)
    else:
        tl.store(out_rows + d[None, :], q.to(tl.float16), mask=mask)


def rotate_query(query: torch.Tensor, rotation: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out (Hq, Lq, D) fp16 <- query (Lq, Hq, D) @ rotation^T (rotation (D, D)), or a plain copy."""
    lq, hq, d = query.shape
    if not use_triton(query):
        q = query.transpose(0, 1).float()
        out.copy_(q @ rotation.float().T if rotation is not None else q)
        return out
    block_m = 64
    block_n = min(d, 64)
    r = rotation.float().contiguous() if rotation is not None else query  # unused when not rotating
    _rotate_query_kernel[(triton.cdiv(lq, block_m), hq)](
        query, r, out, query.stride(0), query.stride(1), out.stride(0), out.stride(1), lq,
        D=d, ROTATE=rotation is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)
    return out
