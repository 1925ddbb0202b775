"""The log-sum-exp merge against float64, in place and across dtypes, and its rules
for empty and non-finite sides (merge.py's docstring); the merge of a row's pieces
against the two-way merges it folds; a spread window's query copies for its pieces;
each implementation named explicitly."""

import pytest
import torch
from conftest import DEVICE, TRITON_OK

from tq_chunked.runtime.merge import merge_attn_states, merge_pieces, piece_query
from tq_chunked.tools.testing import rel_err

IMPLS = ["torch"] + (["triton"] if TRITON_OK else [])
INF, NAN = float("inf"), float("nan")


def _ref(op, lp, os, ls):
    """float64 merge of finite or empty (-inf) sides."""
    lp, ls = lp.double(), ls.double()
    lse = torch.logaddexp(lp, ls)
    wp = torch.where(torch.isinf(lp), 0.0, torch.exp(lp - lse))
    ws = torch.where(torch.isinf(ls), 0.0, torch.exp(ls - lse))
    out = wp.T[..., None] * op.double().nan_to_num() + ws.T[..., None] * os.double()
    return out, lse


def _sides(seed, n=24, h=3, d=64):
    gen = torch.Generator().manual_seed(seed)
    op = torch.randn(n, h, d, generator=gen).to(DEVICE)  # float32 state
    lp = (torch.randn(h, n, generator=gen) * 5).to(DEVICE)
    os = torch.randn(n, h, d, generator=gen).to(DEVICE, torch.float16)
    ls = (torch.randn(h, n, generator=gen) * 5).to(DEVICE)
    return op, lp, os, ls


def _merge(impl, op, lp, os, ls, out_dtype=torch.float32):
    out = torch.full(os.shape, NAN, dtype=out_dtype, device=DEVICE)
    lse = torch.full(ls.shape, NAN, device=DEVICE)
    merge_attn_states(out, op, lp, os, ls, lse, impl=impl)
    return out, lse


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_merge_matches_float64(impl, d):
    op, lp, os, ls = _sides(d, d=d)
    # a token stride that is not H * D
    os = os.transpose(0, 1).contiguous().transpose(0, 1)
    out, lse = _merge(impl, op, lp, os, ls)
    o_ref, l_ref = _ref(op, lp, os, ls)
    assert rel_err(out, o_ref) < 1e-6, f"seed {d}"
    assert rel_err(lse, l_ref) < 1e-6, f"seed {d}"


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_sides_contribute_nothing(impl):
    op, lp, os, ls = _sides(1)
    # head 0: no prefix keys; its state was never written (NaN) and is not read
    lp[0] = -INF
    op[:, 0] = NAN
    # head 1, rows 0-4: no suffix keys (a zero row, as attention writes it)
    ls[1, :5] = -INF
    os[:5, 1] = 0
    # head 2, rows 0-2: FlashAttention's +inf with a zero row: no keys too
    ls[2, :3] = INF
    os[:3, 2] = 0
    lp[2, :2] = -INF  # head 2, rows 0-1: both sides empty
    out, lse = _merge(impl, op, lp, os, ls)
    assert torch.equal(out[:, 0], os[:, 0].float()) and torch.equal(lse[0], ls[0])
    assert torch.equal(out[:5, 1], op[:5, 1]) and torch.equal(lse[1, :5], lp[1, :5])
    assert torch.equal(out[2:3, 2], op[2:3, 2])
    assert (out[:2, 2] == 0).all() and torch.isneginf(lse[2, :2]).all()
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_side_whose_sum_is_not_a_number_makes_the_row_nan(impl):
    op, lp, os, ls = _sides(2)
    lp[0, 3] = NAN  # the state: a NaN lse
    ls[1, 4] = NAN  # our kernels' mark
    ls[2, 5] = INF  # FlashAttention's mark, told from "no keys" by its NaN row
    os[5, 2] = NAN
    ls[2, 6] = -INF  # a later release's mark for the same
    os[6, 2] = NAN
    out, lse = _merge(impl, op, lp, os, ls)
    for h, r in [(0, 3), (1, 4), (2, 5), (2, 6)]:
        assert out[r, h].isnan().all() and lse[h, r].isnan(), (h, r)
    bad = torch.zeros_like(lse, dtype=torch.bool)
    bad[0, 3] = bad[1, 4] = bad[2, 5] = bad[2, 6] = True
    # every other row finite
    assert torch.isfinite(out[~bad.T]).all() and torch.isfinite(lse[~bad]).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_non_finite_output_elements_propagate_even_with_a_vanishing_weight(impl):
    op, lp, os, ls = _sides(3)
    os[0, 0, 7] = INF  # weight about 1
    ls[1, 1] = lp[1, 1] - 200  # the suffix's weight underflows to 0 in float32...
    os[1, 1, 9] = -INF  # ...but a tiny positive weight times -inf is -inf
    os[1, 1, 10] = NAN
    op[2, 2, 11] = INF
    out, lse = _merge(impl, op, lp, os, ls)
    assert (
        out[0, 0, 7] == INF
        and out[1, 1, 9] == -INF
        and out[1, 1, 10].isnan()
        and out[2, 2, 11] == INF
    )
    assert torch.isfinite(lse).all()
    nonfinite = ~torch.isfinite(out)
    assert nonfinite.sum() == 4  # nothing else spread


@pytest.mark.parametrize("impl", IMPLS)
def test_without_a_prefix_the_suffix_is_converted(impl):
    _, _, os, ls = _sides(4)
    os[2, 1, 3] = NAN
    out = torch.full(os.shape, NAN, device=DEVICE)
    lse = torch.full(ls.shape, NAN, device=DEVICE)
    merge_attn_states(out, None, None, os, ls, lse, impl=impl)
    assert (
        torch.equal(out.nan_to_num(7.0), os.float().nan_to_num(7.0))
        and out[2, 1, 3].isnan()
    )
    assert torch.allclose(lse, ls)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_in_place_over_a_partial_kept_in_the_outputs_bytes(impl, dtype):
    """The final merge reads an fp16 partial from the output's own bytes and writes the
    result there in the output's dtype; the state is merged in place."""
    op, lp, _, ls = _sides(5, n=16, h=2)
    out = torch.empty(16, 2, 64, dtype=dtype, device=DEVICE)
    part = out.view(torch.float16)
    part.copy_(torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(6)))
    part_copy = part.clone()
    merge_attn_states(out, op, lp, part, ls, impl=impl)
    o_ref, _ = _ref(op, lp, part_copy, ls)
    assert rel_err(out, o_ref) < (1e-3 if dtype == torch.float16 else 8e-3)
    state, state_lse = op.clone(), lp.clone()
    merge_attn_states(state, state, state_lse, part_copy, ls, state_lse, impl=impl)
    assert rel_err(state, o_ref) < 1e-6


def test_unknown_impl_and_half_a_prefix_are_refused():
    x = torch.zeros(1, 1, 64, device=DEVICE)
    lse = torch.zeros(1, 1, device=DEVICE)
    with pytest.raises(ValueError, match="impl"):
        merge_attn_states(x, x, lse, x, lse, impl="cuda")
    with pytest.raises(ValueError, match="prefix_output and prefix_lse"):
        merge_attn_states(x, x, None, x, lse)


def _pieces(seed, q_lens=(3, 5, 2), pieces=3, h=3, d=64):
    """A spread window's partials (plan.py): requests of ``q_lens`` rows, each with
    ``pieces`` pieces laid out request-major (piece i of request r's row t at
    pieces * start_r + i * q_r + t), and the tail's partial. Some piece rows are
    marked as FlashAttention marks them: no keys (a zero row, lse -inf) and a sum
    that is not a number (a NaN row, lse +inf)."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(q_lens)
    m = n * pieces
    po = torch.randn(m, h, d, generator=gen).half()
    pl = torch.randn(h, m, generator=gen) * 5
    po[4, 1], pl[1, 4] = 0.0, -INF  # no keys
    po[7, 2, 5], pl[2, 7] = NAN, INF  # not a number
    to = torch.randn(n, h, d, generator=gen).half()
    tl_ = torch.randn(h, n, generator=gen) * 5
    first, step, start = [], [], 0
    for q in q_lens:
        first += [pieces * start + t for t in range(q)]
        step += [q] * q
        start += q
    ints = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (first, step)]
    return [x.to(DEVICE) for x in (po, pl, to, tl_)] + ints


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pieces", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merge_pieces_is_its_two_way_merges_in_a_float32_state(impl, pieces, dtype):
    """Bit for bit: the pieces folded in order into a float32 state, then the tail
    (read from the output's own bytes in fp16, as a spread window keeps it)."""
    po, pl, to, tl_, first, step = _pieces(pieces, pieces=pieces)
    n, h, d = to.shape
    out = torch.empty(n, h, d, dtype=dtype, device=DEVICE)
    own = out.view(torch.float16)  # out itself where out is fp16
    own.copy_(to)
    tail = own.clone()
    # the lse tensors read and written through their strides
    lse = torch.full((n, h), NAN, device=DEVICE).T
    merge_pieces(out, lse, own, tl_, po, pl.T.contiguous().T, first, step, pieces,
                 impl=impl)  # fmt: skip

    state = torch.full((n, h, d), NAN, device=DEVICE)
    state_lse = torch.full((h, n), NAN, device=DEVICE)
    for i in range(pieces):
        at = (first + i * step).long()
        prefix = (None, None) if i == 0 else (state, state_lse)
        merge_attn_states(state, *prefix, po[at], pl[:, at], state_lse, impl=impl)
    want = torch.empty_like(out)
    want_lse = torch.empty(h, n, device=DEVICE)
    merge_attn_states(want, state, state_lse, tail, tl_, want_lse, impl=impl)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0, equal_nan=True)
    # the one piece whose sum is not a number makes its row NaN, and only it
    nan_rows = out.isnan().all(-1)
    assert nan_rows[:, 2].sum() == 1 and nan_rows.sum() == 1, f"seed {pieces}"


@pytest.mark.parametrize("impl", IMPLS)
def test_merge_pieces_matches_float64(impl):
    po, pl, to, tl_, first, step = _pieces(7, q_lens=(4, 9), pieces=4)
    po, pl = po.float().normal_(), pl.clamp(-6, 6)  # finite sides only
    n, h, d = to.shape
    out = torch.full((n, h, d), NAN, device=DEVICE)
    lse = torch.full((h, n), NAN, device=DEVICE)
    merge_pieces(out, lse, to, tl_, po, pl, first, step, 4, impl=impl)
    o_ref, l_ref = to.double(), tl_.double()
    for i in range(4):
        at = (first + i * step).long()
        o_ref, l_ref = _ref(o_ref, l_ref, po[at], pl[:, at])
    assert rel_err(out, o_ref) < 1e-6, "seed 7"
    assert rel_err(lse, l_ref) < 1e-6, "seed 7"


@pytest.mark.parametrize("impl", IMPLS)
def test_a_piece_row_outside_the_pieces_is_an_empty_side(impl):
    po, pl, to, tl_, first, step = _pieces(3, q_lens=(4,), pieces=2)
    n = to.shape[0]
    out, lse = torch.empty_like(to), torch.empty(tl_.shape, device=DEVICE)
    merge_pieces(out, lse, to, tl_, po, pl, first, step, 2, impl=impl)
    # a third piece past the end of the pieces (and one before their start) adds
    # nothing, and is not read
    far = torch.full((n,), -5, dtype=torch.int32, device=DEVICE)
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    merge_pieces(out2, lse2, to, tl_, po, pl, first, step, 3, impl=impl)
    merge_pieces(out, lse, to, tl_, po, pl, far, step, 1, impl=impl)
    torch.testing.assert_close(out, to, rtol=0, atol=0)
    out3 = torch.empty_like(out)
    merge_pieces(out3, None, to, tl_, po, pl, first, step, 2, impl=impl)
    torch.testing.assert_close(out2, out3, rtol=0, atol=0, equal_nan=True)


def test_merge_pieces_refuses_bad_counts_and_rows():
    po, pl, to, tl_, first, step = _pieces(0)
    out = torch.empty_like(to)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="pieces must be an int >= 1"):
            merge_pieces(out, None, to, tl_, po, pl, first, step, bad)
    with pytest.raises(ValueError, match="piece_first must be int32 of shape"):
        merge_pieces(out, None, to, tl_, po, pl, first.long(), step, 1)
    with pytest.raises(ValueError, match="piece_step must be int32 of shape"):
        merge_pieces(out, None, to, tl_, po, pl, first, step[1:], 1)
    with pytest.raises(ValueError, match="piece_output must be .* unit stride over D"):
        merge_pieces(out, None, to, tl_, po.transpose(1, 2), pl, first, step, 1)
    with pytest.raises(ValueError, match="tail_output must be"):
        merge_pieces(out, None, to[:, :2], tl_, po, pl, first, step, 1)
    with pytest.raises(ValueError, match="piece_lse must be float32 of shape"):
        merge_pieces(out, None, to, tl_, po, pl[:, 1:], first, step, 1)
    with pytest.raises(ValueError, match="output_lse must be float32 of shape"):
        merge_pieces(out, tl_.double(), to, tl_, po, pl, first, step, 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_merge_reads_and_writes_the_lse_through_its_strides(impl):
    """The log-sum-exp tensors, (H, N), read and written through any strides: (N, H)
    storage transposed, and every other column of a wider tensor."""
    op, lp, os, ls = _sides(11)
    h, n = ls.shape
    o_ref, l_ref = _ref(op, lp, os, ls)
    wide = torch.full((h, 2 * n), NAN, device=DEVICE)
    out = torch.full(os.shape, NAN, device=DEVICE)
    lse = wide[:, ::2]
    merge_attn_states(
        out, op, lp.T.contiguous().T, os, ls.T.contiguous().T, lse, impl=impl
    )
    assert rel_err(out, o_ref) < 1e-6, "seed 11"
    assert rel_err(lse, l_ref) < 1e-6, "seed 11"
    assert wide[:, 1::2].isnan().all()  # only its own elements written


def test_merge_refuses_bad_shapes():
    op, lp, os, ls = _sides(12, n=4, h=2)
    out = torch.empty_like(op)
    with pytest.raises(ValueError, match=r"^output must be \(4, 2, 64\) with unit"):
        merge_attn_states(out[:3], op, lp, os, ls)
    # the suffix named where it is the odd one, not the output held to its shape
    with pytest.raises(ValueError, match=r"^suffix_output must be \(N, H, D\)"):
        merge_attn_states(out, op, lp, os.flatten(1), ls)
    with pytest.raises(ValueError, match="prefix_output must be"):
        merge_attn_states(out, op.transpose(1, 2), lp, os, ls)
    with pytest.raises(ValueError, match=r"suffix_lse must be float32 of shape \(2, 4"):
        merge_attn_states(out, op, lp, os, ls.T)
    with pytest.raises(ValueError, match="prefix_lse must be float32"):
        merge_attn_states(out, op, lp.double(), os, ls)
    with pytest.raises(ValueError, match="output_lse must be float32"):
        merge_attn_states(out, op, lp, os, ls, lp[:, :3])


def _window_query(seed, dtype, n=20, h=6, d=80):
    """A query of n tokens whose rows are strided (every other token of a larger
    tensor, heads padded), and a piece index over window rows [3, 3 + 12) with an
    entry before and after the window."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(2 * n, h + 1, d + 16, generator=gen)
    # values whose fp16 conversion rounds, overflows or is not a number (in window
    # rows 1 and 5, which the index reads)
    special = torch.tensor([65536.0, -65536.0, 65280.0, 65519.0, 3e-8, -3e-8, 1e-9,
                            INF, -INF, NAN, -0.0, 1.0 + 2**-9])  # fmt: skip
    big[8, 0, : special.numel()] = special
    big[16, 2, : special.numel()] = -special
    big = big.to(DEVICE, dtype)
    query = big[::2, :h, :d]
    index = torch.tensor([0, 11, 5, 5, -1, 12, 7, 2], dtype=torch.int32, device=DEVICE)
    return query, 3, 12, index


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_piece_query_copies_the_window_rows_to_fp16(impl, dtype):
    """Each piece row is its window row in fp16, bit for bit as torch converts it; an
    index outside the window gives a zero row; with query16, the window's rows in
    fp16 in order; nothing else is written (poisoned outputs)."""
    query, row0, rows, index = _window_query(4, dtype)
    h, d = query.shape[1:]
    window = query[row0 : row0 + rows].to(torch.float16)
    out = torch.full(
        (index.shape[0], h, d + 8), NAN, dtype=torch.float16, device=DEVICE
    )
    q16 = torch.full((rows + 2, h, d), NAN, dtype=torch.float16, device=DEVICE)
    piece_query(query, row0, rows, index, out[..., :d], q16[:rows], impl=impl)
    ok = (index >= 0) & (index < rows)
    want = window[index.clamp(0, rows - 1).long()].masked_fill(~ok[:, None, None], 0)
    same = lambda a, b: torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert same(out[..., :d], want), "seed 4"  # every bit, NaNs and -0.0 too
    assert out[..., d:].isnan().all() and q16[rows:].isnan().all(), "seed 4"
    assert same(q16[:rows], window), "seed 4"
    # without query16 only the pieces' rows are written
    again = torch.full_like(out[..., :d], NAN)
    piece_query(query, row0, rows, index, again, impl=impl)
    assert same(again, want), "seed 4"
    # a window of no rows: every piece row is a zero row
    none = torch.full_like(again, NAN)
    piece_query(query, row0, 0, index, none, q16[:0], impl=impl)
    assert torch.equal(none, torch.zeros_like(none)), "seed 4"


def test_piece_query_refuses_what_it_cannot_copy():
    query, row0, rows, index = _window_query(5, torch.float16)
    h, d = query.shape[1:]
    out = torch.empty(index.shape[0], h, d, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=r"rows \[row0, row0 \+ rows\) = \[3, 30\)"):
        piece_query(query, row0, 27, index, out)
    with pytest.raises(ValueError, match="row0 must be an int >= 0"):
        piece_query(query, -1, rows, index, out)
    with pytest.raises(ValueError, match="index must be int32"):
        piece_query(query, row0, rows, index.long(), out)
    with pytest.raises(ValueError, match="index must be int32 .* of unit stride"):
        piece_query(query, row0, rows, index.repeat(2)[::2], out)
    with pytest.raises(ValueError, match="index must be int32 .* of unit stride"):
        piece_query(query, row0, rows, index[:1].expand(8), out)
    m = index.shape[0]
    with pytest.raises(ValueError, match="out must not share memory with query"):
        piece_query(query, row0, rows, index, query[:m])
    both = torch.empty(m + rows, h, d, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="out must not share memory with query16"):
        piece_query(query, row0, rows, index, both[:m], both[m - 1 : m - 1 + rows])
    with pytest.raises(ValueError, match="query must have heads and head size"):
        piece_query(query[:, :0], row0, rows, index, out[:, :0])
    with pytest.raises(ValueError, match="out must be fp16"):
        piece_query(query, row0, rows, index, out.bfloat16())
    with pytest.raises(ValueError, match="out must be"):
        piece_query(query, row0, rows, index, out[1:])
    with pytest.raises(ValueError, match="query16 must be"):
        piece_query(query, row0, rows, index, out, out[:rows].transpose(1, 2))
    with pytest.raises(ValueError, match="query must be"):
        piece_query(query.float(), row0, rows, index, out)
    with pytest.raises(ValueError, match="impl must be"):
        piece_query(query, row0, rows, index, out, impl="cuda")
