"""The log-sum-exp merge against float64, empty sides, and in-place use."""

import pytest
import torch

from tq_chunked.merge import merge_attn_states

from conftest import TRITON_OK, rel_err

DEVICES = ["cpu-torch"] + (["triton"] if TRITON_OK else [])


def _ref(oa, la, ob, lb):
    la, lb = la.double(), lb.double()
    lse = torch.logaddexp(la, lb)
    return (torch.exp(la - lse)[..., None] * oa.double() + torch.exp(lb - lse)[..., None] * ob.double()), lse


@pytest.mark.parametrize("impl", DEVICES)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_merge_matches_float64(impl, d, monkeypatch):
    if impl == "cpu-torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h, l = 3, 37
    oa = torch.randn(h, l, d, device=dev)
    ob = torch.randn(l, h, d, device=dev, dtype=torch.float16).transpose(0, 1)  # strided, other dtype
    la = torch.randn(h, l, device=dev) * 5
    lb = torch.randn(h, l, device=dev) * 5
    out = torch.full((h, l, d), float("nan"), device=dev)
    lse = torch.full((h, l), float("nan"), device=dev)
    merge_attn_states(oa, la, ob, lb, out, lse)
    o_ref, l_ref = _ref(oa, la, ob, lb)
    assert rel_err(out, o_ref) < 1e-6
    assert rel_err(lse, l_ref) < 1e-6


@pytest.mark.parametrize("impl", DEVICES)
def test_empty_sides_contribute_nothing_and_never_nan(impl, monkeypatch):
    if impl == "cpu-torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h, l, d = 2, 20, 64
    oa, ob = torch.randn(h, l, d, device=dev), torch.randn(h, l, d, device=dev)
    la, lb = torch.randn(h, l, device=dev), torch.randn(h, l, device=dev)
    la[0] = float("-inf")  # head 0: side a empty
    lb[1, :5] = float("-inf")  # head 1, tokens 0-4: side b empty
    la[1, :2] = float("-inf")  # head 1, tokens 0-1: both empty
    oa_in = oa.clone()
    merge_attn_states(oa, la, ob, lb, oa, la)  # in place
    assert not oa.isnan().any() and not la.isnan().any()
    assert torch.equal(oa[0], ob[0])
    assert torch.allclose(oa[1, 2:5], oa_in[1, 2:5])
    assert torch.equal(oa[1, :2], torch.zeros_like(oa[1, :2])) and torch.isneginf(la[1, :2]).all()
