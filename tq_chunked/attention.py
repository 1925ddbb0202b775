"""Partial attention back ends: softmax(q k^T * scale) v over one key set, with its
log-sum-exp, so that partial results over disjoint key sets can be merged exactly.

Every back end takes head-major views and returns head-major results:

    q: (Hq, Lq, D)   k, v: (Hk, Lk, D)   Hq = G * Hk, query head h uses kv head h // G
    -> out: (Hq, Lq, D) in q's dtype, any strides;  lse: (Hq, Lq) float32, natural log

``causal=True`` masks bottom-right aligned: query i sees keys j <= i + Lk - Lq.
A query that sees no key gets out = 0 and lse = -inf.

Back ends (``resolve_backend`` picks the first that is available for the inputs):
  "flash"  vLLM's flash_attn_varlen_func (FlashAttention-3 on Hopper, FA2 elsewhere)
  "cudnn"  PyTorch's cuDNN attention; GQA folded into the query axis when not causal
  "triton" the kernel in this file (also runs on CPU under TRITON_INTERPRET=1)
  "torch"  float32 PyTorch, the CPU reference
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from einops import rearrange

BACKENDS = ("flash", "cudnn", "triton", "torch")


# ---------------------------------------------------------------------------
# Triton flash attention with LSE
# ---------------------------------------------------------------------------

@triton.jit(do_not_specialize=["Lq", "Lk"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    s_qh, s_ql, s_kh, s_kl, s_vh, s_vl, s_oh, s_ol, s_lh,
    Lq, Lk, qk_scale,  # qk_scale = softmax scale * log2(e)
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # merge into the (out, lse) already in o_ptr/lse_ptr
    DOT_F32: tl.constexpr,  # float32 dot operands (the CPU interpreter's bf16 dot is wrong)
):
    m_block = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) query index
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m_mask = offs_m < Lq
    q = tl.load(q_ptr + head * s_qh + offs_m[:, None] * s_ql + offs_d[None, :], mask=m_mask[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    shift = Lk - Lq  # causal: query i sees keys j <= i + shift
    k_end = Lk
    if CAUSAL:
        k_end = tl.minimum(Lk, (m_block + 1) * BLOCK_M + shift)
    k_base = k_ptr + kv_head * s_kh
    v_base = v_ptr + kv_head * s_vh
    for n0 in range(0, k_end, BLOCK_N):
        n = n0 + offs_n
        n_mask = n < Lk
        k = tl.load(k_base + n[None, :] * s_kl + offs_d[:, None], mask=n_mask[None, :], other=0.0)  # (D, BLOCK_N)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, k) * qk_scale  # (BLOCK_M, BLOCK_N)
        valid = n_mask[None, :]
        if CAUSAL:
            valid = valid & (n[None, :] <= offs_m[:, None] + shift)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n[:, None] * s_vl + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    o_rows = o_ptr + head * s_oh + offs_m[:, None] * s_ol + offs_d[None, :]
    lse_rows = lse_ptr + head * s_lh + offs_m
    if ACCUMULATE:  # the merge of merge.py, fused: no partial output leaves the chip
        lse_prev = tl.load(lse_rows, mask=m_mask, other=float("-inf"))
        o_prev = tl.load(o_rows, mask=m_mask[:, None], other=0.0).to(tl.float32)
        m = tl.maximum(lse_prev, lse)
        m = tl.where(m == float("-inf"), 0.0, m)
        w_prev = tl.exp(lse_prev - m)
        w_new = tl.exp(lse - m)
        total = w_prev + w_new
        inv = tl.where(total > 0, 1.0 / total, 0.0)
        out = o_prev * (w_prev * inv)[:, None] + out * (w_new * inv)[:, None]
        lse = tl.where(total > 0, m + tl.log(total), float("-inf"))
    tl.store(o_rows, out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None])
    tl.store(lse_rows, lse, mask=m_mask)


def _triton_attention(q, k, v, scale, causal, out, lse=None, accumulate=False):
    hq, lq, d = q.shape
    hk, lk, _ = k.shape
    if out is None:
        out = torch.empty(hq, lq, d, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(hq, lq, dtype=torch.float32, device=q.device)
    if not q.is_cuda:  # the interpreter: small blocks, less work on masked rows
        block_m, block_n, warps, stages = 64, 64, 4, 1
    elif d <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    grid = (triton.cdiv(lq, block_m), hq)
    _attention_kernel[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0),
        lq, lk, scale * math.log2(math.e),
        GROUP=hq // hk, CAUSAL=causal, D=d, BLOCK_M=block_m, BLOCK_N=block_n,
        ACCUMULATE=accumulate, DOT_F32=not q.is_cuda, num_warps=warps, num_stages=stages,
    )
    return out, lse


# ---------------------------------------------------------------------------
# Other back ends
# ---------------------------------------------------------------------------

def _torch_attention(q, k, v, scale, causal, out):
    hq, lq, d = q.shape
    hk, lk, _ = k.shape
    qf = rearrange(q.float(), "(hk g) l d -> hk (g l) d", hk=hk)  # a kv head's query group, stacked
    s = rearrange(torch.matmul(qf, k.float().transpose(1, 2)), "hk (g l) n -> (hk g) l n", l=lq) * scale
    if causal:
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (lk - lq), float("-inf"))
    lse = torch.logsumexp(s, -1)  # (Hq, Lq), -inf where no key
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    o = torch.matmul(rearrange(p, "(hk g) l n -> hk (g l) n", hk=hk), v.float())
    o = rearrange(o, "hk (g l) d -> (hk g) l d", l=lq)  # (Hq, Lq, D)
    if out is None:
        return o, lse
    out.copy_(o)
    return out, lse


@functools.cache
def _vllm_flash():
    """vLLM's flash_attn_varlen_func and the FA version it picks, or None."""
    try:
        from vllm.v1.attention.backends.fa_utils import (get_flash_attn_version,
                                                          is_flash_attn_varlen_func_available)
        if not is_flash_attn_varlen_func_available():
            return None
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func
        return flash_attn_varlen_func, get_flash_attn_version()
    except Exception:
        return None


def _cu_seqlens(length, device, cache):
    """[0, length] int32 on the device (one sequence), memoized in ``cache`` if given."""
    t = None if cache is None else cache.get(length)
    if t is None:
        t = torch.arange(2, dtype=torch.int32, device=device) * length  # no host-to-device copy
        if cache is not None:
            cache[length] = t
    return t


def _flash_attention(q, k, v, scale, causal, out, seqlens=None):
    fn, version = _vllm_flash()
    hq, lq, d = q.shape
    lk = k.shape[1]
    cu_q, cu_k = _cu_seqlens(lq, q.device, seqlens), _cu_seqlens(lk, q.device, seqlens)
    kwargs = {} if version is None else {"fa_version": version}
    o, lse = fn(q=q.transpose(0, 1), k=k.transpose(0, 1), v=v.transpose(0, 1),  # token-major views
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=lq, max_seqlen_k=lk,
                softmax_scale=scale, causal=causal, return_softmax_lse=True,
                out=None if out is None else out.transpose(0, 1), **kwargs)
    return o.transpose(0, 1), lse  # (Hq, Lq, D), (Hq, Lq)


def _cudnn_attention(q, k, v, scale, causal, out):
    hq, lq, d = q.shape
    hk, lk, _ = k.shape
    g = hq // hk
    if causal:
        if lq != lk:
            raise ValueError("backend 'cudnn' masks top-left: causal needs Lq == Lk")
        if g > 1:  # the chunk's own block: expand its O(q_len) K/V to all query heads
            k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        qq, kk, vv = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    else:  # GQA folded: the g query heads of a kv head become one sequence of g * Lq
        qq = rearrange(q, "(hk g) l d -> 1 hk (g l) d", hk=hk)
        kk, vv = k.unsqueeze(0), v.unsqueeze(0)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(qq, kk, vv, None, True, 0.0, causal, False,
                                                             scale=scale)
    o = res[0].reshape(hq, lq, d)
    lse = res[1].reshape(hq, lq).float()
    if out is not None:
        out.copy_(o)
        o = out
    return o, lse


_IMPLS = {"flash": _flash_attention, "cudnn": _cudnn_attention, "triton": _triton_attention,
          "torch": _torch_attention}


def backend_available(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    if name == "torch":
        return True
    if name == "triton":
        from .dequant import use_triton
        return use_triton(torch.empty(0, device=device))
    if device.type != "cuda":
        return False
    if name == "flash":
        return _vllm_flash() is not None and head_dim <= 256
    if name == "cudnn":
        return torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device) >= (8, 0) \
            and head_dim <= 128
    raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {name!r}")


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """'auto' -> the fastest available back end; a named one is checked, never replaced."""
    if backend == "auto":
        order = ("flash", "cudnn", "triton") if device.type == "cuda" else ("torch",)
        return next(b for b in order if backend_available(b, device, dtype, head_dim))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or 'auto', got {backend!r}")
    if not backend_available(backend, device, dtype, head_dim):
        raise ValueError(f"backend {backend!r} is not available for {device.type} tensors, "
                         f"dtype {dtype}, head_dim {head_dim}")
    return backend


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                      causal: bool = False, backend: str = "torch", out: torch.Tensor | None = None,
                      seqlens: dict | None = None):
    """Attention of q (Hq, Lq, D) over k, v (Hk, Lk, D); returns (out (Hq, Lq, D), lse (Hq, Lq)).

    ``backend`` must already be resolved (see ``resolve_backend``). ``out``, if given,
    is a (Hq, Lq, D) tensor of q's dtype that the result is written into; otherwise
    the "torch" back end returns float32 and the others q's dtype. ``seqlens``: a dict
    the "flash" back end keeps its sequence-length tensors in across calls.
    """
    if k.shape[1] == 0:  # no keys: FlashAttention would report lse = +inf
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device) if out is None else out.zero_()
        return out, torch.full(q.shape[:2], float("-inf"), device=q.device)
    if backend == "flash":
        return _flash_attention(q, k, v, scale, causal, out, seqlens)
    return _IMPLS[backend](q, k, v, scale, causal, out)


def attention_accumulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, causal: bool,
                         state_out: torch.Tensor, state_lse: torch.Tensor, first: bool) -> None:
    """Triton back end only: attend and merge into a running (state_out, state_lse)
    in one kernel (``first``: overwrite instead). state_out (Hq, Lq, D) float32,
    state_lse (Hq, Lq) float32. Saves the partial output's round trip and rounding."""
    _triton_attention(q, k, v, scale, causal, state_out, state_lse, accumulate=not first)
