"""Partial attention back ends against float64: outputs and log-sum-exp."""

import pytest
import torch

from tq_chunked.attention import BACKENDS, attention_accumulate, backend_available, partial_attention

from conftest import DEVICE, rel_err

AVAILABLE = [b for b in BACKENDS if backend_available(b, torch.device(DEVICE), torch.float16, 128)]


def _ref(q, k, v, scale, causal):
    hq, lq, d = q.shape
    hk, lk, _ = k.shape
    kk = k.double().repeat_interleave(hq // hk, 0)
    vv = v.double().repeat_interleave(hq // hk, 0)
    s = q.double() @ kk.transpose(1, 2) * scale
    if causal:
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        s = s.masked_fill((j > i + lk - lq).to(s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ vv, lse


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group,d,lq,lk,causal", [(1, 64, 70, 50, False), (4, 128, 33, 129, False),
                                                   (2, 64, 65, 65, True), (8, 256, 40, 40, True)])
def test_backend_matches_float64(backend, dtype, group, d, lq, lk, causal):
    if backend == "cudnn" and d > 128:
        pytest.skip("cudnn back end is limited to D <= 128")
    hk = 2
    q = (torch.randn(lq, hk * group, d, device=DEVICE) * 1.5).to(dtype).transpose(0, 1)  # strided head-major
    k = torch.randn(hk, lk, d, device=DEVICE).to(dtype)
    v = torch.randn(hk, lk, d, device=DEVICE).to(dtype)
    out, lse = partial_attention(q, k, v, d**-0.5, causal=causal, backend=backend)
    o_ref, l_ref = _ref(q, k, v, d**-0.5, causal)
    tol = 4e-3 if dtype == torch.float16 else 2e-2
    assert rel_err(out, o_ref) < tol
    assert rel_err(lse, l_ref) < 1e-3


@pytest.mark.skipif("triton" not in AVAILABLE, reason="Triton needs a GPU or TRITON_INTERPRET=1")
def test_triton_accumulate_equals_merge_of_two_halves():
    hq, hk, lq, d = 4, 2, 50, 64
    q = torch.randn(hq, lq, d, device=DEVICE).half()
    k = torch.randn(hk, 90, d, device=DEVICE).half()
    v = torch.randn(hk, 90, d, device=DEVICE).half()
    state = torch.full((hq, lq, d), float("nan"), device=DEVICE)
    lse = torch.full((hq, lq), float("nan"), device=DEVICE)
    attention_accumulate(q, k[:, :40], v[:, :40], 0.125, causal=False, state_out=state, state_lse=lse, first=True)
    attention_accumulate(q, k[:, 40:], v[:, 40:], 0.125, causal=False, state_out=state, state_lse=lse, first=False)
    o_ref, l_ref = _ref(q, k, v, 0.125, False)
    assert rel_err(state, o_ref) < 2e-3
    assert rel_err(lse, l_ref) < 1e-4


@pytest.mark.parametrize("backend", AVAILABLE)
def test_no_keys_gives_zero_output_and_minus_inf_lse(backend):
    q = torch.randn(2, 8, 64, device=DEVICE).half()
    k = torch.randn(1, 0, 64, device=DEVICE).half()
    out, lse = partial_attention(q, k, k, 0.125, backend=backend)
    assert torch.isneginf(lse).all() and not out.isnan().any() and (out == 0).all()
