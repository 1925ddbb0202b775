"""Varlen partial attention back ends against float64: outputs and log-sum-exp, with
empty query and key segments, causal and not."""

import types

import pytest
import torch
from conftest import DEVICE

from tq_chunked.runtime.attention import (
    BACKENDS,
    backend_available,
    make_call,
    resolve_backend,
    varlen_attention,
)
from tq_chunked.tools.testing import rel_err

AVAILABLE = [b for b in BACKENDS if backend_available(b, torch.device(DEVICE), 128)[0]]


def reference(call, q, k, v, scale):
    """float64, one sequence at a time: (out (Nq, Hq, D), lse (Hq, Nq)); no key: 0
    and -inf."""
    nq, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(nq, hq, d, dtype=torch.float64, device=q.device)
    lse = torch.full((hq, nq), float("-inf"), dtype=torch.float64, device=q.device)
    for b in range(len(call.cu_q_host) - 1):
        q0, q1 = call.cu_q_host[b], call.cu_q_host[b + 1]
        k0, k1 = call.cu_k_host[b], call.cu_k_host[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        qq = q[q0:q1].double().transpose(0, 1)
        kk = k[k0:k1].double().transpose(0, 1).repeat_interleave(g, 0)
        vv = v[k0:k1].double().transpose(0, 1).repeat_interleave(g, 0)
        s = qq @ kk.transpose(1, 2) * scale
        if call.causal:
            i = torch.arange(q1 - q0, device=q.device)[:, None]
            j = torch.arange(k1 - k0, device=q.device)[None, :]
            s = s.masked_fill(j > i + (k1 - k0) - (q1 - q0), float("-inf"))
        lse[:, q0:q1] = torch.logsumexp(s, -1)
        out[q0:q1] = (torch.softmax(s, -1) @ vv).transpose(0, 1)
    return out, lse


CASES = {  # name: (q_lens, k_lens, causal, group, D)
    "one-seq": ([70], [50], False, 1, 64),
    "gqa-4": ([33, 20], [129, 7], False, 4, 128),
    "empty-q-and-k-segments": ([20, 0, 15, 9], [40, 30, 0, 25], False, 2, 64),
    "causal-first-chunks": ([65, 17], [65, 17], True, 2, 64),
    "causal-longer-keys": ([40, 5], [90, 5], True, 8, 256),
    "d80": ([30], [45], False, 2, 80),
}


@pytest.mark.parametrize("backend", AVAILABLE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_backend_matches_float64(backend, dtype, case):
    q_lens, k_lens, causal, group, d = CASES[case]
    if not backend_available(backend, torch.device(DEVICE), d)[0]:
        pytest.skip(f"{backend} does not take D {d}")
    gen = torch.Generator().manual_seed(len(case) * 7 + d)
    hk = 2
    call = make_call(q_lens, k_lens, causal, DEVICE)
    q = (torch.randn(sum(q_lens), hk * group, d, generator=gen) * 1.5).to(DEVICE, dtype)
    k = torch.randn(sum(k_lens), hk, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(sum(k_lens), hk, d, generator=gen).to(DEVICE, dtype)
    out = torch.full_like(q, float("nan"))
    lse = varlen_attention(call, q, k, v, d**-0.5, out, backend)
    o_ref, l_ref = reference(call, q, k, v, d**-0.5)
    seen = torch.isfinite(l_ref)  # rows that saw a key
    tol = 4e-3 if dtype == torch.float16 else 2e-2
    assert rel_err(out[seen.T], o_ref[seen.T]) < tol
    assert rel_err(lse[seen], l_ref[seen]) < 1e-3
    # A row that saw no key: zero output, lse -inf (FlashAttention: +inf; merge.py
    # reads both as empty).
    assert (out[~seen.T] == 0).all() and torch.isinf(lse[~seen]).all()
    if backend != "flash":
        assert (lse[~seen] < 0).all()


def test_auto_never_picks_an_unavailable_back_end_and_named_ones_are_checked():
    dev = torch.device(DEVICE)
    assert resolve_backend("auto", dev, 128) in AVAILABLE
    for name in BACKENDS:
        if name not in AVAILABLE:
            with pytest.raises(ValueError, match=f"backend {name!r} is not available"):
                resolve_backend(name, dev, 128)
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cudnn", dev, 128)


def test_windows_fa_version_env_names_it(monkeypatch):
    """TQ_CHUNKED_FA_VERSION overrides the FlashAttention version the windows use; any
    value but 2 or 3 is refused by name. Without it, a pick other than 2 stands."""
    from tq_chunked.runtime.attention import _windows_fa_version

    monkeypatch.setenv("TQ_CHUNKED_FA_VERSION", "2")
    assert _windows_fa_version(3, None) == 2
    monkeypatch.setenv("TQ_CHUNKED_FA_VERSION", " 2\n")  # as the other variables
    assert _windows_fa_version(3, None) == 2
    monkeypatch.setenv("TQ_CHUNKED_FA_VERSION", "4")
    with pytest.raises(ValueError, match="TQ_CHUNKED_FA_VERSION: expected 2 or 3"):
        _windows_fa_version(3, None)
    monkeypatch.delenv("TQ_CHUNKED_FA_VERSION")
    assert _windows_fa_version(3, None) == 3
    # a version vLLM's build cannot run is refused by name, not tried
    no_fa3 = types.SimpleNamespace(is_fa_version_supported=lambda v: v == 2)
    monkeypatch.setenv("TQ_CHUNKED_FA_VERSION", "3")
    with pytest.raises(ValueError, match="TQ_CHUNKED_FA_VERSION=3: vLLM's"):
        _windows_fa_version(2, no_fa3)


@pytest.mark.parametrize(
    "capability, fa3_built, expected",
    [
        ((9, 0), True, 3),  # Hopper: FA2 (vLLM's TurboQuant setting) becomes FA3
        ((9, 0), False, 2),  # no FA3 in vLLM's build
        ((8, 0), True, 2),  # Ampere: FA2 stands
        ((10, 0), True, 2),  # Blackwell: FA2 stands (FA3 does not run there)
    ],
)
def test_windows_fa_version_on_hopper_only(
    monkeypatch, capability, fa3_built, expected
):
    """The upgrade from vLLM's FA2 setting happens on Hopper where vLLM's build has FA3,
    and nowhere else. The device is described to the function (this machine may have
    none): what vLLM's fa_utils answers, what torch.cuda reports."""
    from tq_chunked.runtime.attention import _windows_fa_version

    monkeypatch.delenv("TQ_CHUNKED_FA_VERSION", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    fa = types.SimpleNamespace(is_fa_version_supported=lambda v: v == 2 or fa3_built)
    assert _windows_fa_version(2, fa) == expected
    assert _windows_fa_version(3, fa) == 3  # a pick other than 2 stands
