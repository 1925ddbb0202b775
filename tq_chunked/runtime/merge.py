"""Exact merge of two partial attention results over disjoint key sets (vLLM's
``merge_attn_states``, in its argument order):

    lse = m + log(exp(lse_p - m) + exp(lse_s - m)),  m = max(lse_p, lse_s)
    out = exp(lse_p - lse) * out_p + exp(lse_s - lse) * out_s

p is the prefix (the running state), s the suffix (a fresh partial result).

What each side's log-sum-exp means, and so what the merge does with it:

* ``-inf``: no keys. The side contributes nothing. An empty prefix is not read at all
  (an unwritten state may hold anything). Two empty sides give out = 0, lse = -inf.
* NaN: the side's softmax sum was not a number (a NaN or +inf score: NaN or inf in a
  query or a key). The merged row is NaN, lse NaN: what one softmax over both key sets
  gives.
* ``+inf`` or ``-inf`` on the suffix: FlashAttention's mark for "no key, or a sum
  that is not a number" (its release in vLLM 0.20 writes +inf where later ones write
  -inf). The suffix row, always read, tells which: attention writes a zero row for no
  keys and a NaN row for a sum that is not a number.
* finite: weighted as above. A weight that underflows to 0 still carries an inf or NaN
  output element through (a tiny positive weight times inf is inf, as float64 gives).

So non-finite values propagate as in one softmax over all keys, and "no keys" is never
confused with "not a number". One function, a Triton kernel and a PyTorch fallback
behind it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import (
    Launcher,
    cdiv,
    interpreter_rounds_bf16,
    next_power_of_2,
    round_bf16,
    use_triton,
)


@triton.jit
def _term(w, o):
    """The product w * o, where a zero weight still carries o's inf and NaN
    elements."""
    finite = (o == o) & (tl.abs(o) < float("inf"))
    return tl.where(w == 0.0, tl.where(finite, 0.0, o), w * o)


@triton.jit(do_not_specialize=["rows"])
def _merge_kernel(
    out_ptr,
    p_ptr,
    lp_ptr,
    s_ptr,
    ls_ptr,
    lo_ptr,
    rows,
    s_o_tok,
    s_o_head,
    s_p_tok,
    s_p_head,
    s_lp_head,
    s_s_tok,
    s_s_head,
    s_ls_head,
    s_lo_head,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # see _utils.round_bf16
):
    head = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)  # (BLOCK_L,) row
    mask = r < rows
    r64 = r.to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dm = mask[:, None] & (d < D)
    o_s = tl.load(s_ptr + r64 * s_s_tok + head * s_s_head + d, mask=dm, other=0.0)
    o_s = o_s.to(tl.float32)
    l_s = tl.load(ls_ptr + head * s_ls_head + r, mask=mask, other=float("-inf"))
    s_nan_row = tl.max(tl.where(o_s != o_s, 1, 0), axis=1) > 0
    s_inf = (l_s == float("inf")) | (l_s == float("-inf"))
    l_s = tl.where(s_inf, tl.where(s_nan_row, float("nan"), float("-inf")), l_s)
    if HAS_PREFIX:
        l_p = tl.load(lp_ptr + head * s_lp_head + r, mask=mask, other=float("-inf"))
        read_p = mask & (l_p != float("-inf"))  # an empty prefix is never read
        o_p = tl.load(
            p_ptr + r64 * s_p_tok + head * s_p_head + d,
            mask=read_p[:, None] & (d < D),
            other=0.0,
        ).to(tl.float32)
    else:
        l_p = tl.full([BLOCK_L], float("-inf"), tl.float32)
        o_p = tl.zeros([BLOCK_L, BLOCK_D], tl.float32)
    nan = (l_p != l_p) | (l_s != l_s)
    m = tl.maximum(l_p, l_s)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_p = tl.exp(l_p - m)  # 0 for an empty side
    w_s = tl.exp(l_s - m)
    total = w_p + w_s
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    o = (_term(w_p[:, None], o_p) + _term(w_s[:, None], o_s)) * inv[:, None]
    o = tl.where(nan[:, None], float("nan"), o)
    o = round_bf16(o, ROUND_BF16).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64 * s_o_tok + head * s_o_head + d, o, mask=dm)
    if WRITE_LSE:
        lse = tl.where(total > 0, m + tl.log(total), float("-inf"))
        tl.store(
            lo_ptr + head * s_lo_head + r, tl.where(nan, float("nan"), lse), mask=mask
        )


launch_merge = Launcher(_merge_kernel)


def merge_attn_states(
    output: torch.Tensor,
    prefix_output: torch.Tensor | None,
    prefix_lse: torch.Tensor | None,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output_lse: torch.Tensor | None = None,
    *,
    impl: str | None = None,
) -> None:
    """output, output_lse <- the merge of (prefix_output, prefix_lse) and
    (suffix_output, suffix_lse), row by row (see the module docstring for non-finite
    and empty sides).

    output, prefix_output, suffix_output: (N, H, D), token-major, unit stride over D,
    any float dtypes (the merge runs in float32). prefix_lse, suffix_lse, output_lse:
    (H, N) float32, unit stride over N. prefix_output/prefix_lse None: no prefix (the
    suffix is copied, converted, with its lse). output may alias prefix_output, or
    share memory with suffix_output in another dtype of the same size (each element is
    read before it is written); output_lse may alias prefix_lse; output_lse None: not
    written. impl: "triton" or "torch"; default: Triton where it runs (see
    ``_utils.use_triton``).
    """
    if impl is None:
        impl = "triton" if use_triton(output) else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")
    if (prefix_output is None) != (prefix_lse is None):
        raise ValueError(
            "prefix_output and prefix_lse must be given together (or both None: no "
            "prefix)"
        )
    if suffix_output.shape[0] == 0:
        return
    if impl == "torch":
        _merge_torch(
            output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse
        )
        return
    launcher, grid, args, options = merge_launch(
        output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse
    )
    launcher(grid, *args, **options)


def merge_launch(
    output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=None
):
    """``merge_attn_states``'s Triton launch, as (launcher, grid, arguments, options),
    for launches bound once per step (_utils.BoundLaunches). The caller has done
    ``merge_attn_states``'s checks: at least one row, the prefix's output and lse
    given together."""
    rows, h, d = suffix_output.shape
    block_d = next_power_of_2(d)
    block_l = 16 if block_d <= 128 else 8
    # not read without a prefix
    p = prefix_output if prefix_output is not None else suffix_output
    lp = prefix_lse if prefix_lse is not None else suffix_lse
    lo = output_lse if output_lse is not None else suffix_lse  # not written without
    args = (
        output,
        p,
        lp,
        suffix_output,
        suffix_lse,
        lo,
        rows,
        output.stride(0),
        output.stride(1),
        p.stride(0),
        p.stride(1),
        lp.stride(0),
        suffix_output.stride(0),
        suffix_output.stride(1),
        suffix_lse.stride(0),
        lo.stride(0),
        d,
        block_d,
        block_l,
        prefix_output is not None,
        output_lse is not None,
        interpreter_rounds_bf16(output.dtype),
    )
    return launch_merge, (cdiv(rows, block_l), h), args, {"num_warps": 4}


def _weighted(w, o):
    finite = torch.isfinite(o)
    return torch.where(w[..., None] == 0, torch.where(finite, 0.0, o), w[..., None] * o)


def _merge_torch(
    output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse
):
    o_s = suffix_output.float()
    l_s = suffix_lse.T  # (rows, H)
    s_nan_row = o_s.isnan().any(-1)
    l_s = torch.where(
        l_s.isinf(), torch.where(s_nan_row, float("nan"), float("-inf")), l_s
    )
    if prefix_output is None:
        l_p = torch.full_like(l_s, float("-inf"))
        o_p = torch.zeros_like(o_s)
    else:
        l_p = prefix_lse.T
        o_p = torch.where((l_p == float("-inf"))[..., None], 0.0, prefix_output.float())
    nan = l_p.isnan() | l_s.isnan()
    m = torch.maximum(l_p, l_s)
    m = torch.where(m == float("-inf"), 0.0, m)
    w_p, w_s = torch.exp(l_p - m), torch.exp(l_s - m)
    total = w_p + w_s
    inv = torch.where(total > 0, 1.0 / total, 0.0)
    o = (_weighted(w_p, o_p) + _weighted(w_s, o_s)) * inv[..., None]
    o = torch.where(nan[..., None], float("nan"), o)
    if output_lse is not None:
        lse = torch.where(total > 0, m + torch.log(total), float("-inf"))
        output_lse.copy_(torch.where(nan, float("nan"), lse).T)
    output.copy_(o)
