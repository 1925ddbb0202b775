"""Exact merge of two partial attention results over disjoint key sets.

    lse = m + log(exp(lse_a - m) + exp(lse_b - m)),  m = max(lse_a, lse_b)
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

A side with lse = -inf (no keys) contributes nothing and its output is not read, so an
unwritten state may hold anything; two empty sides give out = 0, lse = -inf, never NaN.
FlashAttention marks a query that saw no key with lse = +inf (and a zero output): side
b, the fresh partial result, is read as empty then too (side a, the running state,
never holds +inf). One function, a Triton kernel and a PyTorch fallback behind it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dequant import interpreter_rounds_bf16, round_bf16, use_triton


@triton.jit(do_not_specialize=["rows", "row0"])
def _merge_kernel(
    a_ptr, la_ptr, b_ptr, lb_ptr, out_ptr, lo_ptr, rows, row0,
    s_a_tok, s_a_head, s_la_head, s_b_tok, s_b_head, s_lb_head, s_o_tok, s_o_head, s_lo_head,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, WRITE_LSE: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # see dequant.round_bf16
):
    head = tl.program_id(1).to(tl.int64)
    l = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)  # (BLOCK_L,) row of side b
    mask = l < rows
    la_rows = la_ptr + head * s_la_head + row0 + l  # sides a and out are offset by row0
    la = tl.load(la_rows, mask=mask, other=float("-inf"))
    lb = tl.load(lb_ptr + head * s_lb_head + l, mask=mask, other=float("-inf"))
    lb = tl.where(lb == float("inf"), float("-inf"), lb)  # FlashAttention: no keys
    m = tl.maximum(la, lb)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)  # 0 for an empty side
    wb = tl.exp(lb - m_safe)
    total = wa + wb
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    d = tl.arange(0, BLOCK_D)[None, :]
    dm = d < D
    arow = (row0 + l).to(tl.int64)[:, None]
    brow = l.to(tl.int64)[:, None]
    oa = tl.load(a_ptr + arow * s_a_tok + head * s_a_head + d, mask=(mask & (wa > 0))[:, None] & dm, other=0.0)
    ob = tl.load(b_ptr + brow * s_b_tok + head * s_b_head + d, mask=(mask & (wb > 0))[:, None] & dm, other=0.0)
    o = oa.to(tl.float32) * (wa * inv)[:, None] + ob.to(tl.float32) * (wb * inv)[:, None]
    o = round_bf16(o, ROUND_BF16).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + arow * s_o_tok + head * s_o_head + d, o, mask=mask[:, None] & dm)
    if WRITE_LSE:
        lse = tl.where(total > 0, m_safe + tl.log(total), float("-inf"))
        tl.store(lo_ptr + head * s_lo_head + row0 + l, lse, mask=mask)


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                      out: torch.Tensor, lse_out: torch.Tensor | None = None, *, row0: int = 0,
                      impl: str | None = None) -> None:
    """out[row0 + i], lse_out[:, row0 + i] <- merge of (out_a[row0 + i], lse_a[:, row0 + i])
    and (out_b[i], lse_b[:, i]) for the rows i of out_b.

    out_a, out: (N, H, D), out_b: (rows, H, D): token-major, any dtypes, unit stride over D.
    lse_a, lse_out: (H, N), lse_b: (H, rows): float32, unit stride over rows. out may alias
    out_a, or share memory with out_b in another dtype (each element is read before it is
    written); lse_out may alias lse_a; lse_out=None skips writing it.
    impl: "triton" or "torch"; default: Triton where it runs (see ``use_triton``).
    """
    rows, h, d = out_b.shape
    if impl is None:
        impl = "triton" if use_triton(out) else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")
    if rows == 0:
        return
    if impl == "torch":
        _merge_torch(out_a, lse_a, out_b, lse_b, out, lse_out, row0)
        return
    block_d = triton.next_power_of_2(d)
    block_l = 16 if block_d <= 128 else 8
    lo = lse_a if lse_out is None else lse_out
    _merge_kernel[(triton.cdiv(rows, block_l), h)](
        out_a, lse_a, out_b, lse_b, out, lo, rows, row0,
        out_a.stride(0), out_a.stride(1), lse_a.stride(0), out_b.stride(0), out_b.stride(1), lse_b.stride(0),
        out.stride(0), out.stride(1), lo.stride(0),
        D=d, BLOCK_D=block_d, BLOCK_L=block_l, WRITE_LSE=lse_out is not None,
        ROUND_BF16=interpreter_rounds_bf16(out.dtype), num_warps=4,
    )


def _merge_torch(out_a, lse_a, out_b, lse_b, out, lse_out, row0):
    rows = out_b.shape[0]
    la = lse_a[:, row0:row0 + rows].T  # (rows, H)
    lb = lse_b.T
    lb = torch.where(lb == float("inf"), float("-inf"), lb)
    m = torch.maximum(la, lb)
    m_safe = torch.where(m == float("-inf"), 0.0, m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)
    total = wa + wb
    inv = torch.where(total > 0, 1.0 / total, 0.0)
    oa = torch.where((wa > 0)[..., None], out_a[row0:row0 + rows].float(), 0.0)
    ob = torch.where((wb > 0)[..., None], out_b.float(), 0.0)
    o = oa * (wa * inv)[..., None] + ob * (wb * inv)[..., None]
    if lse_out is not None:
        lse_out[:, row0:row0 + rows] = torch.where(total > 0, m_safe + torch.log(total), float("-inf")).T
    out[row0:row0 + rows] = o
