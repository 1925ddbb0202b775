"""Variable-length partial attention with its log-sum-exp, so that results over
disjoint key sets can be merged exactly. One call covers many sequences (requests):

    q: (Nq, Hq, D)  k, v: (Nk, Hk, D)  token-major, unit stride over D
    sequence b: queries cu_q[b]:cu_q[b+1] attend to keys cu_k[b]:cu_k[b+1]
    Hq = G * Hk, query head h uses kv head h // G
    -> out (Nq, Hq, D) in q's dtype (written in place),
       lse (Hq, Nq) float32, natural log

``causal=True`` masks bottom-right aligned per sequence: query i sees keys
j <= i + Lk - Lq. A query that sees no key gets out = 0 and lse = -inf; a query whose
softmax sum is not a number (a NaN or +inf score) gets a NaN row and lse NaN (the
"triton" and "torch" back ends). FlashAttention marks both with lse = +inf or -inf (by
release) and writes a zero or a NaN row: merge.py tells them apart by the row.
FlashAttention-3 runs with ``num_splits=1``: its split-KV combine gives a split whose
sum is not a number the weight 0 (flash_fwd_combine_kernel.h), which would turn a NaN
answer into a finite, wrong one.

Back ends (``resolve_backend`` picks the first available for "auto"):
  "flash"  vLLM's flash_attn_varlen_func (FlashAttention-3 on Hopper, FA2 elsewhere;
           also inside an engine with a TurboQuant cache, where vLLM picks FA2 for its
           own layers: _windows_fa_version)
  "triton" the kernel in this file (also runs on CPU under TRITON_INTERPRET=1)
  "torch"  float32 PyTorch, one sequence at a time: the CPU reference
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._utils import (
    cdiv,
    interpreter_rounds_bf16,
    next_power_of_2,
    round_bf16,
    use_triton,
)

BACKENDS = ("flash", "triton", "torch")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Call:
    """The sequences of one varlen call (a plan.Window is one too)."""

    cu_q: torch.Tensor  # int32 (B + 1,) on the device
    cu_k: torch.Tensor
    cu_q_host: tuple[int, ...]
    cu_k_host: tuple[int, ...]
    max_q: int
    max_k: int
    causal: bool


def make_call(q_lens, k_lens, causal, device) -> Call:
    """A Call for sequences of these query and key lengths, packed in order."""
    cu = lambda lens: tuple(sum(lens[:i]) for i in range(len(lens) + 1))
    cq, ck = cu(list(q_lens)), cu(list(k_lens))
    t = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    return Call(
        t(cq), t(ck), cq, ck, max(q_lens, default=0), max(k_lens, default=0), causal
    )


# ---------------------------------------------------------------------------
# Triton varlen flash attention with LSE
# ---------------------------------------------------------------------------


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    cu_q_ptr,
    cu_k_ptr,
    s_q_tok,
    s_q_head,
    s_k_tok,
    s_k_head,
    s_v_tok,
    s_v_head,
    s_o_tok,
    s_o_head,
    s_lse_head,
    qk_scale,  # softmax scale * log2(e)
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    # float32 dot operands (the CPU interpreter's bf16 dot is wrong)
    DOT_F32: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # see _utils.round_bf16
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    kv_head = head // GROUP
    q_start = tl.load(cu_q_ptr + seq)
    lq = tl.load(cu_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_k_ptr + seq)
    lk = tl.load(cu_k_ptr + seq + 1) - k_start
    if m_block * BLOCK_M < lq:
        # (BLOCK_M,) query within the sequence
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < lq
        d_mask = offs_d < D
        q_rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + q_rows[:, None] * s_q_tok + head * s_q_head + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        shift = lk - lq  # causal: query i sees keys j <= i + shift
        k_end = lk
        if CAUSAL:
            k_end = tl.maximum(0, tl.minimum(lk, (m_block + 1) * BLOCK_M + shift))
        k_base = k_ptr + kv_head * s_k_head
        v_base = v_ptr + kv_head * s_v_head
        for n0 in range(0, k_end, BLOCK_N):
            n = n0 + offs_n
            n_mask = n < lk
            k_rows = (k_start + n).to(tl.int64)
            k = tl.load(
                k_base + k_rows[None, :] * s_k_tok + offs_d[:, None],
                mask=n_mask[None, :] & d_mask[:, None],
                other=0.0,
            )  # (BLOCK_D, BLOCK_N)
            if DOT_F32:
                k = k.to(tl.float32)
            s = tl.dot(q, k) * qk_scale  # (BLOCK_M, BLOCK_N)
            valid = n_mask[None, :]
            if CAUSAL:
                valid = valid & (n[None, :] <= offs_m[:, None] + shift)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # rows with no key yet
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_base + k_rows[:, None] * s_v_tok + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
            if DOT_F32:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        empty = l_i == 0  # no key (a sum that is not a number stays NaN: out and lse)
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(
            empty,
            float("-inf"),
            (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453,
        )
        out = round_bf16(out, ROUND_BF16).to(o_ptr.dtype.element_ty)
        tl.store(
            o_ptr + q_rows[:, None] * s_o_tok + head * s_o_head + offs_d[None, :],
            out,
            mask=m_mask[:, None] & d_mask[None, :],
        )
        tl.store(lse_ptr + head * s_lse_head + q_start + offs_m, lse, mask=m_mask)


def _triton_attention(call, q, k, v, scale, out):
    # as FlashAttention does
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    nq, hq, d = q.shape
    hk = k.shape[1]
    lse = torch.empty(hq, nq, dtype=torch.float32, device=q.device)
    block_d = next_power_of_2(d)
    if not q.is_cuda:  # the interpreter: small blocks, less work on masked rows
        block_m, block_n, warps, stages = 32, 32, 4, 1
    elif block_d <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    grid = (cdiv(max(call.max_q, 1), block_m), len(call.cu_q_host) - 1, hq)
    _attention_kernel[grid](
        q,
        k,
        v,
        out,
        lse,
        call.cu_q,
        call.cu_k,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        scale * math.log2(math.e),
        GROUP=hq // hk,
        CAUSAL=call.causal,
        D=d,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_F32=not q.is_cuda,
        ROUND_BF16=interpreter_rounds_bf16(out.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return lse


# ---------------------------------------------------------------------------
# Other back ends
# ---------------------------------------------------------------------------


def _torch_attention(call, q, k, v, scale, out):
    nq, hq, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    lse = torch.full((hq, nq), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(len(call.cu_q_host) - 1):
        q0, q1 = call.cu_q_host[b], call.cu_q_host[b + 1]
        k0, k1 = call.cu_k_host[b], call.cu_k_host[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        qq = q[q0:q1].float().transpose(0, 1)  # (Hq, lq, D)
        kk = k[k0:k1].float().transpose(0, 1).repeat_interleave(g, 0)  # (Hq, lk, D)
        vv = v[k0:k1].float().transpose(0, 1).repeat_interleave(g, 0)
        s = qq @ kk.transpose(1, 2) * scale  # (Hq, lq, lk)
        if call.causal:
            i = torch.arange(lq, device=q.device)[:, None]
            j = torch.arange(lk, device=q.device)[None, :]
            s = s.masked_fill(j > i + (lk - lq), float("-inf"))
        # -inf where no key; +inf or NaN where the sum is not a number
        lse_b = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(lse_b == float("-inf"), 0.0, lse_b)[..., None])
        out[q0:q1] = (p @ vv).transpose(0, 1)
        lse[:, q0:q1] = torch.where(lse_b == float("inf"), float("nan"), lse_b)
    return lse


@functools.cache
def vllm_flash(head_dim: int):
    """(vLLM's flash_attn_varlen_func, its FA version for this head size), or None
    with the reason logged. Only vLLM's own FlashAttention 2 or 3 is taken: the merge
    relies on its ``return_softmax_lse``/``out`` arguments and its empty-row lse
    (measured on FA3); ROCm's upstream flash_attn and FA4 have other interfaces. A
    missing module means "unavailable"; any other error is a broken install and is
    raised."""
    try:
        from vllm.v1.attention.backends import fa_utils
    except ImportError as e:
        log.debug(
            "tq_chunked: back end 'flash' unavailable: vLLM is not importable (%s)", e
        )
        return None
    if not fa_utils.is_flash_attn_varlen_func_available():
        log.debug(
            "tq_chunked: back end 'flash' unavailable: vLLM reports no "
            "flash_attn_varlen_func"
        )
        return None
    fn = fa_utils.flash_attn_varlen_func
    if not getattr(fn, "__module__", "").startswith("vllm.vllm_flash_attn"):
        log.debug(
            "tq_chunked: back end 'flash' unavailable: vLLM's flash_attn_varlen_func "
            "is %s's, not vllm.vllm_flash_attn's",
            getattr(fn, "__module__", "?"),
        )
        return None
    try:
        version = fa_utils.get_flash_attn_version(head_size=head_dim)
    except TypeError:  # releases without the head_size argument
        version = fa_utils.get_flash_attn_version()
    version = _windows_fa_version(version, fa_utils)
    if version not in (2, 3):
        log.debug(
            "tq_chunked: back end 'flash' unavailable: vLLM picks FlashAttention %s "
            "for head size %d",
            version,
            head_dim,
        )
        return None
    return fn, version


FA_VERSION_ENV = "TQ_CHUNKED_FA_VERSION"


def _windows_fa_version(version, fa_utils) -> int | None:
    """The FlashAttention version the windows use, from vLLM's pick ``version``: FA3
    on Hopper where vLLM's build has it, else vLLM's pick. vLLM pins FA2 for TurboQuant
    caches for its own layers, and only where its config is current, so that its answer
    depends on where it is first asked (benchmarks/NOTES.md §28, §29).
    ``TQ_CHUNKED_FA_VERSION=2`` (or 3) names the version instead; another value, or one
    vLLM's build cannot run, is an error.
    """
    env = os.environ.get(FA_VERSION_ENV, "").strip()
    supported = getattr(fa_utils, "is_fa_version_supported", None)
    if supported is None:  # releases whose fa_utils imports it inside functions only
        try:
            from vllm.vllm_flash_attn.flash_attn_interface import (
                is_fa_version_supported as supported,
            )
        except ImportError:
            log.debug("tq_chunked: vLLM tells no FlashAttention version's support")
    if env:
        if env not in ("2", "3"):
            raise ValueError(f"{FA_VERSION_ENV}: expected 2 or 3, got {env!r}")
        if supported is not None and not supported(int(env)):
            raise ValueError(
                f"{FA_VERSION_ENV}={env}: vLLM's FlashAttention {env} does not run on "
                "this GPU (or was not built)"
            )
        return int(env)
    if (
        version == 2
        and supported is not None
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] == 9
        and supported(3)
    ):
        return 3
    return version


def _flash_attention(call, q, k, v, scale, out, splits=1):
    fn, version = vllm_flash(q.shape[2])
    _, lse = fn(
        q=q,
        k=k,
        v=v,
        cu_seqlens_q=call.cu_q,
        cu_seqlens_k=call.cu_k,
        max_seqlen_q=call.max_q,
        max_seqlen_k=call.max_k,
        softmax_scale=scale,
        causal=call.causal,
        return_softmax_lse=True,
        out=out,
        fa_version=version,
        num_splits=splits if version == 3 else 0,
    )
    return lse


_IMPLS = {
    "flash": _flash_attention,
    "triton": _triton_attention,
    "torch": _torch_attention,
}


def backend_available(
    name: str, device: torch.device, head_dim: int
) -> tuple[bool, str]:
    """(available, reason if not) for back end ``name`` on this device and head size."""
    if name == "torch":
        return True, ""
    if name == "triton":
        ok = use_triton(torch.empty(0, device=device))
        return (
            ok,
            "" if ok else "Triton needs a CUDA device (or TRITON_INTERPRET=1 on a CPU)",
        )
    if name == "flash":
        if device.type != "cuda":
            return False, "FlashAttention needs a CUDA device"
        if head_dim > 256:
            return (
                False,
                f"FlashAttention supports head sizes up to 256, not {head_dim}",
            )
        if vllm_flash(head_dim) is None:
            return (
                False,
                (
                    "vLLM's own FlashAttention 2 or 3 is not available for this head "
                    "size (see the debug log)"
                ),
            )
        return True, ""
    raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {name!r}")


@functools.cache
def resolve_backend(backend: str, device: torch.device, head_dim: int) -> str:
    """'auto' -> the fastest available back end (logged once, with why others were
    skipped); a named one is checked and never replaced."""
    if backend == "auto":
        order = ("flash", "triton") if device.type == "cuda" else ("torch",)
        skipped: list[tuple[str, str]] = []
        for b in order:
            ok, why = backend_available(b, device, head_dim)
            if ok:
                log.debug(
                    "tq_chunked: backend 'auto' -> %r on %s, head_dim %d%s",
                    b,
                    device,
                    head_dim,
                    "".join(f"; skipped {s!r}: {w}" for s, w in skipped),
                )
                return b
            skipped.append((b, why))
        raise AssertionError(
            "unreachable: 'torch' and 'triton' are always available on their devices"
        )
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {BACKENDS} or 'auto', got {backend!r}"
        )
    ok, why = backend_available(backend, device, head_dim)
    if not ok:
        raise ValueError(f"backend {backend!r} is not available: {why}")
    return backend


def varlen_attention(
    call,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    backend: str,
    flash_splits: int = 1,
) -> torch.Tensor:
    """Attention of the sequences of ``call`` (a ``Call`` or a ``plan.Window``; see the
    module docstring for shapes); writes ``out`` and returns lse (Hq, Nq). ``backend``
    must be resolved (``resolve_backend``). flash_splits: FlashAttention-3's num_splits
    (0: its own choice, as vLLM calls it; the full-buffer reference path does)."""
    if backend == "flash":
        return _flash_attention(call, q, k, v, scale, out, flash_splits)
    return _IMPLS[backend](call, q, k, v, scale, out)
