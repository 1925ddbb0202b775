"""Exact merge of two partial attention results over disjoint key sets.

    lse = m + log(exp(lse_a - m) + exp(lse_b - m)),  m = max(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

A side with lse = -inf (no keys) contributes nothing; two empty sides give out = 0,
lse = -inf, never NaN. One function, a Triton kernel and a PyTorch fallback behind it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dequant import use_triton


@triton.jit(do_not_specialize=["L"])
def _merge_kernel(
    oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lse_out_ptr,
    s_oa_h, s_oa_l, s_la_h, s_ob_h, s_ob_l, s_lb_h, s_out_h, s_out_l, s_lo_h,
    L, D: tl.constexpr, BLOCK_L: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    head = tl.program_id(1).to(tl.int64)
    l = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)  # (BLOCK_L,) token
    mask = l < L
    d = tl.arange(0, D)[None, :]
    la = tl.load(la_ptr + head * s_la_h + l, mask=mask, other=float("-inf"))
    lb = tl.load(lb_ptr + head * s_lb_h + l, mask=mask, other=float("-inf"))
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)  # 0 for an empty side
    wb = tl.exp(lb - m_safe)
    total = wa + wb
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    oa = tl.load(oa_ptr + head * s_oa_h + l[:, None] * s_oa_l + d, mask=mask[:, None], other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + head * s_ob_h + l[:, None] * s_ob_l + d, mask=mask[:, None], other=0.0).to(tl.float32)
    o = oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None]
    tl.store(out_ptr + head * s_out_h + l[:, None] * s_out_l + d, o.to(out_ptr.dtype.element_ty), mask=mask[:, None])
    if WRITE_LSE:
        lse = tl.where(total > 0, m_safe + tl.log(total), float("-inf"))
        tl.store(lse_out_ptr + head * s_lo_h + l, lse, mask=mask)


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                      out: torch.Tensor, lse_out: torch.Tensor | None = None) -> None:
    """out, lse_out <- merge of (out_a, lse_a) and (out_b, lse_b).

    out_a, out_b, out: (H, L, D), any dtypes, unit stride over D, any other strides.
    lse_a, lse_b, lse_out: (H, L) float32, unit stride over L. out may alias out_a and
    lse_out may alias lse_a (in-place accumulation); lse_out=None skips writing it.
    """
    h, l, d = out.shape
    if not use_triton(out):
        ma = torch.maximum(lse_a, lse_b)
        m_safe = torch.where(torch.isinf(ma) & (ma < 0), 0.0, ma)
        wa, wb = torch.exp(lse_a - m_safe), torch.exp(lse_b - m_safe)
        total = wa + wb
        inv = torch.where(total > 0, 1.0 / total, 0.0)
        o = out_a.float() * (wa * inv)[..., None] + out_b.float() * (wb * inv)[..., None]
        if lse_out is not None:
            lse_out.copy_(torch.where(total > 0, m_safe + torch.log(total), float("-inf")))
        out.copy_(o)
        return
    block_l = 16 if d <= 128 else 8
    grid = (triton.cdiv(l, block_l), h)
    lo = lse_a if lse_out is None else lse_out
    _merge_kernel[grid](
        out_a, lse_a, out_b, lse_b, out, lo,
        out_a.stride(0), out_a.stride(1), lse_a.stride(0), out_b.stride(0), out_b.stride(1), lse_b.stride(0),
        out.stride(0), out.stride(1), lo.stride(0),
        l, D=d, BLOCK_L=block_l, WRITE_LSE=lse_out is not None, num_warps=4,
    )
