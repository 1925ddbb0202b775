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
behind it; ``merge_pieces`` folds a row's several partial results by the same rules in
one launch (a spread window's pieces, plan.py). Such a window's pieces attend with
copies of their requests' query rows: ``piece_query`` writes them, in fp16, in one
launch, as this module's other op for spread windows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import (
    Launcher,
    byte_span,
    cdiv,
    check_overlaps,
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


@triton.jit
def _side(o, lse):
    """A partial result's lse as the merge reads it: FlashAttention's +-inf mark told
    apart by its row (a NaN row: a sum that is not a number, NaN; else no keys)."""
    nan_row = tl.max(tl.where(o != o, 1, 0), axis=1) > 0
    mark = (lse == float("inf")) | (lse == float("-inf"))
    return tl.where(mark, tl.where(nan_row, float("nan"), float("-inf")), lse)


@triton.jit
def _fold(o_p, l_p, o_s, l_s):
    """(out, lse) of the prefix (o_p, l_p) merged with the suffix (o_s, l_s), both
    float32 and read as the module docstring says (an empty prefix's row is 0)."""
    nan = (l_p != l_p) | (l_s != l_s)
    m = tl.maximum(l_p, l_s)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_p = tl.exp(l_p - m)  # 0 for an empty side
    w_s = tl.exp(l_s - m)
    total = w_p + w_s
    inv = tl.where(total > 0, 1.0 / total, 0.0)
    o = (_term(w_p[:, None], o_p) + _term(w_s[:, None], o_s)) * inv[:, None]
    o = tl.where(nan[:, None], float("nan"), o)
    lse = tl.where(total > 0, m + tl.log(total), float("-inf"))
    return o, tl.where(nan, float("nan"), lse)


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
    s_lp_row,
    s_s_tok,
    s_s_head,
    s_ls_head,
    s_ls_row,
    s_lo_head,
    s_lo_row,
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
    l_s = tl.load(
        ls_ptr + head * s_ls_head + r * s_ls_row, mask=mask, other=float("-inf")
    )
    l_s = _side(o_s, l_s)
    if HAS_PREFIX:
        l_p = tl.load(
            lp_ptr + head * s_lp_head + r * s_lp_row, mask=mask, other=float("-inf")
        )
        read_p = mask & (l_p != float("-inf"))  # an empty prefix is never read
        o_p = tl.load(
            p_ptr + r64 * s_p_tok + head * s_p_head + d,
            mask=read_p[:, None] & (d < D),
            other=0.0,
        ).to(tl.float32)
    else:
        l_p = tl.full([BLOCK_L], float("-inf"), tl.float32)
        o_p = tl.zeros([BLOCK_L, BLOCK_D], tl.float32)
    o, lse = _fold(o_p, l_p, o_s, l_s)
    o = round_bf16(o, ROUND_BF16).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64 * s_o_tok + head * s_o_head + d, o, mask=dm)
    if WRITE_LSE:
        tl.store(lo_ptr + head * s_lo_head + r * s_lo_row, lse, mask=mask)


launch_merge = Launcher(_merge_kernel)


@triton.jit(do_not_specialize=["rows", "piece_rows", "pieces"])
def _merge_pieces_kernel(
    out_ptr,
    lo_ptr,
    t_ptr,
    lt_ptr,
    p_ptr,
    lp_ptr,
    first_ptr,
    step_ptr,
    rows,
    piece_rows,
    pieces,
    s_o_tok,
    s_o_head,
    s_lo_head,
    s_lo_row,
    s_t_tok,
    s_t_head,
    s_lt_head,
    s_lt_row,
    s_p_tok,
    s_p_head,
    s_lp_head,
    s_lp_row,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # see _utils.round_bf16
):
    head = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)  # (BLOCK_L,) row
    mask = r < rows
    d = tl.arange(0, BLOCK_D)[None, :]
    first = tl.load(first_ptr + r, mask=mask, other=0).to(tl.int64)
    step = tl.load(step_ptr + r, mask=mask, other=0).to(tl.int64)
    o = tl.zeros([BLOCK_L, BLOCK_D], tl.float32)  # the state: empty
    lse = tl.full([BLOCK_L], float("-inf"), tl.float32)
    for i in range(pieces):
        at = first + i * step
        read = mask & (at >= 0) & (at < piece_rows)  # else an empty side
        o_s = tl.load(
            p_ptr + at[:, None] * s_p_tok + head * s_p_head + d,
            mask=read[:, None] & (d < D),
            other=0.0,
        ).to(tl.float32)
        l_s = tl.load(
            lp_ptr + head * s_lp_head + at * s_lp_row, mask=read, other=float("-inf")
        )
        o, lse = _fold(o, lse, o_s, _side(o_s, l_s))
    r64 = r.to(tl.int64)[:, None]
    dm = mask[:, None] & (d < D)
    o_t = tl.load(t_ptr + r64 * s_t_tok + head * s_t_head + d, mask=dm, other=0.0)
    o_t = o_t.to(tl.float32)
    l_t = tl.load(
        lt_ptr + head * s_lt_head + r * s_lt_row, mask=mask, other=float("-inf")
    )
    o, lse = _fold(o, lse, o_t, _side(o_t, l_t))
    o = round_bf16(o, ROUND_BF16).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64 * s_o_tok + head * s_o_head + d, o, mask=dm)
    if WRITE_LSE:
        tl.store(lo_ptr + head * s_lo_head + r * s_lo_row, lse, mask=mask)


launch_merge_pieces = Launcher(_merge_pieces_kernel)


@triton.jit(do_not_specialize=["row0", "rows", "piece_rows"])
def _piece_query_kernel(
    q_ptr,
    index_ptr,
    pq_ptr,
    q16_ptr,
    row0,
    rows,
    piece_rows,
    heads,
    s_q_tok,
    s_q_head,
    s_pq_tok,
    s_pq_head,
    s_q16_tok,
    s_q16_head,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # programs [0, piece_rows): a piece's row from its window row; after them (bf16
    # queries only): the window's rows in fp16, in order
    r = tl.program_id(0)
    h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    hd = (h < heads) & (d < D)
    if r < piece_rows:
        src = tl.load(index_ptr + r).to(tl.int64) + h * 0  # (BLOCK_H, 1)
        ok = (src >= 0) & (src < rows)  # else a zero row, nothing read
        at = row0 + src
        x = tl.load(q_ptr + at * s_q_tok + h * s_q_head + d, mask=hd & ok, other=0.0)
        dst = pq_ptr + r.to(tl.int64) * s_pq_tok + h * s_pq_head + d
    else:
        i = (r - piece_rows).to(tl.int64)
        x = tl.load(q_ptr + (row0 + i) * s_q_tok + h * s_q_head + d, mask=hd)
        dst = q16_ptr + i * s_q16_tok + h * s_q16_head + d
    tl.store(dst, x.to(tl.float16), mask=hd)


launch_piece_query = Launcher(_piece_query_kernel)


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

    output, prefix_output, suffix_output: (N, H, D), unit stride over D, any float
    dtypes (the merge runs in float32). prefix_lse, suffix_lse, output_lse: (H, N)
    float32, any strides. prefix_output/prefix_lse None: no prefix (the
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
    # the suffix's shape first, which the others are held to
    _check_outputs([("suffix_output", suffix_output)], (None, None, None))
    outputs = [("output", output)]
    lses = [("suffix_lse", suffix_lse)]
    if prefix_output is not None:
        outputs.append(("prefix_output", prefix_output))
        lses.append(("prefix_lse", prefix_lse))
    if output_lse is not None:
        lses.append(("output_lse", output_lse))
    _check_outputs(outputs, suffix_output.shape)
    _check_lses(lses, suffix_output.shape[1], suffix_output.shape[0])
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
    ``merge_attn_states``'s checks: the arguments' shapes, at least one row, the
    prefix's output and lse given together."""
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
        lp.stride(1),
        suffix_output.stride(0),
        suffix_output.stride(1),
        suffix_lse.stride(0),
        suffix_lse.stride(1),
        lo.stride(0),
        lo.stride(1),
        d,
        block_d,
        block_l,
        prefix_output is not None,
        output_lse is not None,
        interpreter_rounds_bf16(output.dtype),
    )
    return launch_merge, (cdiv(rows, block_l), h), args, {"num_warps": 4}


def merge_pieces(
    output: torch.Tensor,
    output_lse: torch.Tensor | None,
    tail_output: torch.Tensor,
    tail_lse: torch.Tensor,
    piece_output: torch.Tensor,
    piece_lse: torch.Tensor,
    piece_first: torch.Tensor,
    piece_step: torch.Tensor,
    pieces: int,
    *,
    impl: str | None = None,
) -> None:
    """output, output_lse <- for each row j, its ``pieces`` partial results (rows
    ``piece_first[j] + i * piece_step[j]`` of piece_output and piece_lse, i in
    [0, pieces)) merged in order, then its tail's (row j of tail_output and tail_lse).

    The same arithmetic as ``pieces`` + 1 two-way merges into a float32 state (each
    side read as the module docstring says; a state that is empty or not a number
    stays so), in one launch: the pieces of a spread window (plan.py). A piece row
    outside ``[0, len(piece_output))`` is an empty side, never read.

    output, tail_output: (N, H, D); piece_output (M, H, D); unit stride over D, any
    float dtypes (the merge runs in float32); tail_output may be output itself, or
    share its memory in another dtype of the same size (each element is read before
    it is written).
    tail_lse (H, N), piece_lse (H, M), output_lse (H, N) or None (not written):
    float32, any strides. piece_first, piece_step: (N,) int32 on
    output's device. pieces >= 1. impl: "triton" or "torch"; default: Triton where
    it runs.
    """
    if impl is None:
        impl = "triton" if use_triton(output) else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")
    check_merge_pieces(
        output, output_lse, tail_output, tail_lse, piece_output, piece_lse,
        piece_first, piece_step, pieces,
    )  # fmt: skip
    if output.shape[0] == 0:
        return
    if impl == "torch":
        _merge_pieces_torch(
            output, output_lse, tail_output, tail_lse, piece_output, piece_lse,
            piece_first, piece_step, pieces,
        )  # fmt: skip
        return
    launcher, grid, args, options = merge_pieces_launch(
        output, output_lse, tail_output, tail_lse, piece_output, piece_lse,
        piece_first, piece_step, pieces,
    )  # fmt: skip
    launcher(grid, *args, **options)


def check_merge_pieces(
    output, output_lse, tail_output, tail_lse, piece_output, piece_lse, piece_first,
    piece_step, pieces,
) -> None:  # fmt: skip
    """``merge_pieces``'s checks of its arguments (ValueError naming the first that
    is not as its docstring says), for launches bound once per step."""
    if isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1:
        raise ValueError(f"pieces must be an int >= 1, got {pieces!r}")
    _check_outputs([("output", output)], (None, None, None))  # the others' shape
    _check_outputs([("tail_output", tail_output)], output.shape)
    _check_outputs([("piece_output", piece_output)], (None, *output.shape[1:]))
    n, h = output.shape[:2]
    _check_lses([("tail_lse", tail_lse)], h, n)
    _check_lses([("piece_lse", piece_lse)], h, piece_output.shape[0])
    if output_lse is not None:
        _check_lses([("output_lse", output_lse)], h, n)
    for name, t in (("piece_first", piece_first), ("piece_step", piece_step)):
        if t.dtype != torch.int32 or t.shape != (n,) or t.device != output.device:
            raise ValueError(
                f"{name} must be int32 of shape ({n},) on {output.device}, got "
                f"{t.dtype} {tuple(t.shape)} on {t.device}"
            )


def merge_pieces_launch(
    output, output_lse, tail_output, tail_lse, piece_output, piece_lse, piece_first,
    piece_step, pieces,
):  # fmt: skip
    """``merge_pieces``'s Triton launch, as (launcher, grid, arguments, options); the
    caller has done its checks (at least one row)."""
    rows, h, d = output.shape
    block_d = next_power_of_2(d)
    block_l = 16 if block_d <= 128 else 8
    lo = output_lse if output_lse is not None else tail_lse  # not written without
    args = (
        output, lo, tail_output, tail_lse, piece_output, piece_lse, piece_first,
        piece_step, rows, piece_output.shape[0], pieces, output.stride(0),
        output.stride(1), lo.stride(0), lo.stride(1), tail_output.stride(0),
        tail_output.stride(1), tail_lse.stride(0), tail_lse.stride(1),
        piece_output.stride(0), piece_output.stride(1), piece_lse.stride(0),
        piece_lse.stride(1), d, block_d, block_l,
        output_lse is not None, interpreter_rounds_bf16(output.dtype),
    )  # fmt: skip
    return launch_merge_pieces, (cdiv(rows, block_l), h), args, {"num_warps": 4}


def piece_query(
    query: torch.Tensor,
    row0: int,
    rows: int,
    index: torch.Tensor,
    out: torch.Tensor,
    query16: torch.Tensor | None = None,
    *,
    impl: str | None = None,
) -> None:
    """A spread window's query rows for its pieces' call (plan.py), in fp16:
    out[j] <- query[row0 + index[j]]; with query16, also query16[i] <-
    query[row0 + i] for i in [0, rows) (a bf16 window's own keys' call runs on that
    copy, workspace.py). One launch, whatever the query's dtype.

    query: (N, H, D) fp16 or bf16, H, D >= 1, unit stride over D, any other strides;
    rows [row0, row0 + rows) are the window's. index: (M,) int32 on query's device,
    unit stride; an entry outside [0, rows) gives a zero row, reading nothing. out:
    (M, H, D) fp16; query16: (rows, H, D) fp16 or None; both unit stride over D, and
    neither shares memory with query or the other. impl: "triton" or "torch";
    default: Triton where it runs. Checks its arguments (``check_piece_query``)."""
    if impl is None:
        impl = "triton" if use_triton(query) else "torch"
    if impl not in ("triton", "torch"):
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")
    check_piece_query(query, row0, rows, index, out, query16)
    if impl == "torch":
        window = query[row0 : row0 + rows]
        if query16 is not None:
            query16.copy_(window)
        if rows == 0:  # every entry outside the window
            out.zero_()
            return
        ok = (index >= 0) & (index < rows)
        picked = window.index_select(0, torch.where(ok, index, 0))
        out.copy_(picked.masked_fill(~ok[:, None, None], 0))
        return
    launcher, grid, args, options = piece_query_launch(
        query, row0, rows, index, out, query16
    )
    if grid[0]:
        launcher(grid, *args, **options)


def check_piece_query(query, row0, rows, index, out, query16) -> None:
    """``piece_query``'s checks of its arguments (ValueError naming the first that is
    not as its docstring says), for launches bound once per step."""
    if query.dim() != 3 or query.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"query must be (N, H, D) fp16 or bf16, got {query.dtype} "
            f"{tuple(query.shape)}"
        )
    _check_outputs([("query", query)], (None, None, None))
    if 0 in query.shape[1:]:
        raise ValueError(
            f"query must have heads and head size, got {tuple(query.shape)}"
        )
    for name, n in (("row0", row0), ("rows", rows)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if row0 + rows > query.shape[0]:
        raise ValueError(
            f"rows [row0, row0 + rows) = [{row0}, {row0 + rows}) must lie in query's "
            f"{query.shape[0]} tokens"
        )
    if (
        index.dim() != 1
        or index.dtype != torch.int32
        or index.device != query.device
        or (index.shape[0] > 1 and index.stride(0) != 1)
    ):
        raise ValueError(
            f"index must be int32 (M,) of unit stride on {query.device}, got "
            f"{index.dtype} {tuple(index.shape)} strides {index.stride()} on "
            f"{index.device}"
        )
    outs = [("out", out, index.shape[0])]
    if query16 is not None:
        outs.append(("query16", query16, rows))
    for name, t, n in outs:
        if t.dtype != torch.float16 or t.device != query.device:
            raise ValueError(
                f"{name} must be fp16 on {query.device}, got {t.dtype} on {t.device}"
            )
        _check_outputs([(name, t)], (n, *query.shape[1:]))
    spans = [(name, byte_span(t)) for name, t, _ in outs]
    check_overlaps(spans, [("query", byte_span(query))])


def piece_query_launch(query, row0, rows, index, out, query16):
    """``piece_query``'s Triton launch, as (launcher, grid, arguments, options); the
    caller has done its checks."""
    h, d = query.shape[1:]
    block_d = next_power_of_2(d)
    block_h = min(next_power_of_2(h), max(1, 4096 // block_d))
    q16 = out if query16 is None else query16  # not written without
    programs = index.shape[0] + (0 if query16 is None else rows)
    args = (
        query, index, out, q16, row0, rows, index.shape[0], h, query.stride(0),
        query.stride(1), out.stride(0), out.stride(1), q16.stride(0), q16.stride(1),
        d, block_d, block_h,
    )  # fmt: skip
    return launch_piece_query, (programs, cdiv(h, block_h)), args, {"num_warps": 4}


def _check_outputs(named, shape):
    """Each (name, tensor) is 3-D, of ``shape`` (None: any size there) and of unit
    stride over D."""
    for name, t in named:
        if (
            t.dim() != 3
            or any(want not in (None, got) for want, got in zip(shape, t.shape))
            or t.stride(2) != 1
        ):
            want = ", ".join(w if x is None else str(x) for w, x in zip("NHD", shape))
            raise ValueError(
                f"{name} must be ({want}) with unit stride over D, got shape "
                f"{tuple(t.shape)} strides {t.stride()}"
            )


def _check_lses(named, h, rows):
    """Each (name, tensor) is a float32 (h, rows) log-sum-exp, any strides."""
    for name, t in named:
        if t.dtype != torch.float32 or t.shape != (h, rows):
            raise ValueError(
                f"{name} must be float32 of shape ({h}, {rows}), got {t.dtype} "
                f"{tuple(t.shape)}"
            )


def _merge_pieces_torch(
    output, output_lse, tail_output, tail_lse, piece_output, piece_lse, piece_first,
    piece_step, pieces,
):  # fmt: skip
    m = piece_output.shape[0]
    o = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
    lse = torch.full(o.shape[:2], float("-inf"), device=output.device)
    for i in range(pieces):
        at = piece_first.long() + i * piece_step.long()
        read = (at >= 0) & (at < m)
        at = torch.where(read, at, 0)
        o_s = torch.where(read[:, None, None], piece_output[at].float(), 0.0)
        l_s = torch.where(read[:, None], piece_lse[:, at].T, float("-inf"))
        o, lse = _fold_torch(o, lse, o_s, _side_torch(o_s, l_s))
    o_t = tail_output.float()
    o, lse = _fold_torch(o, lse, o_t, _side_torch(o_t, tail_lse.T))
    if output_lse is not None:
        output_lse.copy_(lse.T)
    output.copy_(o)


def _weighted(w, o):
    finite = torch.isfinite(o)
    return torch.where(w[..., None] == 0, torch.where(finite, 0.0, o), w[..., None] * o)


def _side_torch(o, lse):
    """``_side``: o (rows, H, D) float32, lse (rows, H)."""
    nan_row = o.isnan().any(-1)
    mark = torch.where(nan_row, float("nan"), float("-inf"))
    return torch.where(lse.isinf(), mark, lse)


def _fold_torch(o_p, l_p, o_s, l_s):
    """``_fold``: o (rows, H, D) float32, lse (rows, H)."""
    nan = l_p.isnan() | l_s.isnan()
    m = torch.maximum(l_p, l_s)
    m = torch.where(m == float("-inf"), 0.0, m)
    w_p, w_s = torch.exp(l_p - m), torch.exp(l_s - m)
    total = w_p + w_s
    inv = torch.where(total > 0, 1.0 / total, 0.0)
    o = (_weighted(w_p, o_p) + _weighted(w_s, o_s)) * inv[..., None]
    o = torch.where(nan[..., None], float("nan"), o)
    lse = torch.where(total > 0, m + torch.log(total), float("-inf"))
    return o, torch.where(nan, float("nan"), lse)


def _merge_torch(
    output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse
):
    o_s = suffix_output.float()
    l_s = _side_torch(o_s, suffix_lse.T)  # (rows, H)
    if prefix_output is None:
        l_p = torch.full_like(l_s, float("-inf"))
        o_p = torch.zeros_like(o_s)
    else:
        l_p = prefix_lse.T
        o_p = torch.where((l_p == float("-inf"))[..., None], 0.0, prefix_output.float())
    o, lse = _fold_torch(o_p, l_p, o_s, l_s)
    if output_lse is not None:
        output_lse.copy_(lse.T)
    output.copy_(o)
