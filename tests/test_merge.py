"""The log-sum-exp merge against float64, empty sides (-inf, and FlashAttention's +inf),
row offsets, and in-place use; each implementation named explicitly."""

import pytest
import torch

from tq_chunked.merge import merge_attn_states

from conftest import DEVICE, TRITON_OK, rel_err

IMPLS = ["torch"] + (["triton"] if TRITON_OK else [])


def _ref(oa, la, ob, lb):
    la, lb = la.double(), lb.double()
    lb = torch.where(lb == float("inf"), float("-inf"), lb)
    lse = torch.logaddexp(la, lb)
    wa = torch.where(torch.isinf(la), 0.0, torch.exp(la - lse))
    wb = torch.where(torch.isinf(lb), 0.0, torch.exp(lb - lse))
    return wa.T[..., None] * oa.double() + wb.T[..., None] * ob.double(), lse


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_merge_matches_float64(impl, d):
    gen = torch.Generator().manual_seed(d)
    n, h, row0, rows = 40, 3, 5, 30
    oa = torch.randn(n, h, d, generator=gen).to(DEVICE)  # float32 state
    la = (torch.randn(h, n, generator=gen) * 5).to(DEVICE)
    ob = torch.randn(rows, h, d, generator=gen).to(DEVICE, torch.float16).transpose(0, 1).contiguous().transpose(0, 1)
    lb = (torch.randn(h, rows, generator=gen) * 5).to(DEVICE)
    out = torch.full((n, h, d), float("nan"), device=DEVICE)
    lse = torch.full((h, n), float("nan"), device=DEVICE)
    merge_attn_states(oa, la, ob, lb, out, lse, row0=row0, impl=impl)
    o_ref, l_ref = _ref(oa[row0:row0 + rows], la[:, row0:row0 + rows], ob, lb)
    assert rel_err(out[row0:row0 + rows], o_ref) < 1e-6
    assert rel_err(lse[:, row0:row0 + rows], l_ref) < 1e-6
    assert out[:row0].isnan().all() and out[row0 + rows:].isnan().all()  # only its rows


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_sides_contribute_nothing_and_never_nan(impl):
    gen = torch.Generator().manual_seed(1)
    n, h, d = 20, 3, 64
    oa = torch.randn(n, h, d, generator=gen).to(DEVICE)
    ob = torch.randn(n, h, d, generator=gen).to(DEVICE)
    la, lb = torch.randn(h, n, generator=gen).to(DEVICE), torch.randn(h, n, generator=gen).to(DEVICE)
    la[0] = float("-inf")  # head 0: side a empty, and its output unwritten (NaN)
    oa[:, 0] = float("nan")
    lb[1, :5] = float("inf")  # head 1, tokens 0-4: side b saw no key (FlashAttention's mark)
    la[1, :2] = float("-inf")  # head 1, tokens 0-1: both empty
    oa[:2, 1] = float("nan")
    before = oa.clone()
    merge_attn_states(oa, la, ob, lb, oa, la, impl=impl)  # in place
    assert not oa.isnan().any() and not la.isnan().any()
    assert torch.equal(oa[:, 0], ob[:, 0])
    assert torch.allclose(oa[2:5, 1], before[2:5, 1])
    assert (oa[:2, 1] == 0).all() and torch.isneginf(la[1, :2]).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_in_place_over_a_partial_kept_in_the_outputs_bytes(impl, dtype):
    """The final merge reads a fp16 partial from the output's own bytes and writes the
    result there in the output's dtype."""
    gen = torch.Generator().manual_seed(2)
    n, h, d = 16, 2, 64
    out = torch.empty(n, h, d, dtype=dtype, device=DEVICE)
    part = out.view(torch.float16)
    part.copy_(torch.randn(n, h, d, generator=gen))
    part_copy = part.clone()
    state = torch.randn(n, h, d, generator=gen).to(DEVICE)
    ls, lp = torch.randn(h, n, generator=gen).to(DEVICE), torch.randn(h, n, generator=gen).to(DEVICE)
    merge_attn_states(state, ls, part, lp, out, impl=impl)
    o_ref, _ = _ref(state, ls, part_copy, lp)
    assert rel_err(out, o_ref) < (1e-3 if dtype == torch.float16 else 8e-3)


def test_unknown_impl_is_refused():
    x = torch.zeros(1, 1, 64, device=DEVICE)
    l = torch.zeros(1, 1, device=DEVICE)
    with pytest.raises(ValueError, match="impl"):
        merge_attn_states(x, l, x, l, x, impl="cuda")
