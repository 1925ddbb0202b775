"""The public entry point: a continuation prefill that streams the cached prefix in
fixed-size windows instead of dequantizing all of it.

    rotate the query once                            q_win  (Hq, Lq, D) fp16
    for each window [s, s + W) of the cached prefix:
        dequantize it into the workspace             k_win, v_win  (Hk, W, D) fp16
        attend (no mask) -> (out, lse)               partial output, its lse
        merge into the running (out, lse) state      state_out fp32, state_lse
    attend causally to the chunk's own K/V, merge,  -> out (Lq, Hq, D), query dtype
    and write the result

Memory is the workspace (see workspace.py): independent of cached_len.
"""

from __future__ import annotations

import torch

from .attention import attention_accumulate, partial_attention, resolve_backend
from .dequant import dequantize_window
from .format import TQConfig, resolve_config
from .merge import merge_attn_states
from .rotate import rotate_query
from .workspace import carve, default_window, workspace_bytes


def _check_tensor(name, t, ndim=None, dtypes=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim not in ((ndim,) if isinstance(ndim, int) else ndim):
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the query's device), got {t.device}")


def _validate(query, key_chunk, val_chunk, kv_cache, block_table, cached_len, cfg, centroids, rotation,
              scale, window):
    dev = query.device
    lq, hq, d = query.shape
    for name, t in (("key_chunk", key_chunk), ("val_chunk", val_chunk)):
        _check_tensor(name, t, 3, (query.dtype,), dev)
        if t.shape[0] != lq or t.shape[2] != d:
            raise ValueError(f"{name} must have shape ({lq}, Hk, {d}) to match query, got {tuple(t.shape)}")
    if val_chunk.shape != key_chunk.shape:
        raise ValueError(f"val_chunk must have key_chunk's shape {tuple(key_chunk.shape)}, got {tuple(val_chunk.shape)}")
    hk = key_chunk.shape[1]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key_chunk heads ({hk})")
    _check_tensor("kv_cache", kv_cache, 4, (torch.uint8,), dev)
    if kv_cache.shape[2] != hk or kv_cache.shape[3] != cfg.slot_bytes:
        raise ValueError(f"kv_cache must have shape (num_blocks, block_size, {hk}, {cfg.slot_bytes}) for this "
                         f"preset at D={d}, got {tuple(kv_cache.shape)}")
    if kv_cache.stride(3) != 1:
        raise ValueError("kv_cache must have unit stride over its slot bytes (last dimension)")
    _check_tensor("block_table", block_table, (1, 2), (torch.int32,), dev)
    if block_table.ndim == 2 and block_table.shape[0] != 1:
        raise ValueError(f"block_table must be (max_blocks,) or (1, max_blocks), got {tuple(block_table.shape)}")
    if not block_table.is_contiguous():
        raise ValueError("block_table must be contiguous")
    if isinstance(cached_len, bool) or not isinstance(cached_len, int) or cached_len < 0:
        raise ValueError(f"cached_len must be a non-negative int, got {cached_len!r}")
    block_size = kv_cache.shape[1]
    covered = block_table.shape[-1] * block_size
    if cached_len > covered:
        raise ValueError(f"cached_len ({cached_len}) exceeds what block_table covers "
                         f"({block_table.shape[-1]} blocks x {block_size} = {covered} tokens)")
    if not cfg.key_fp8:
        _check_tensor("centroids", centroids, 1, (torch.float32,), dev)
        if centroids.shape[0] != 2**cfg.key_bits:
            raise ValueError(f"centroids must have {2**cfg.key_bits} entries, got {centroids.shape[0]}")
        _check_tensor("rotation", rotation, 2, (torch.float32, torch.float16, torch.bfloat16), dev)
        if tuple(rotation.shape) != (d, d):
            raise ValueError(f"rotation must have shape ({d}, {d}), got {tuple(rotation.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0
                               or window % block_size):
        raise ValueError(f"window must be a positive multiple of block_size ({block_size}), got {window!r}")


def continuation_prefill(query: torch.Tensor, key_chunk: torch.Tensor, val_chunk: torch.Tensor,
                         kv_cache: torch.Tensor, block_table: torch.Tensor, cached_len: int, *,
                         preset: str | TQConfig, centroids: torch.Tensor | None, rotation: torch.Tensor | None,
                         scale: float, window: int | None = None, workspace: torch.Tensor | None = None,
                         backend: str = "auto", return_lse: bool = False):
    """Attention of a prefill chunk over its cached prefix and itself, in windows.

    Args:
        query: (q_len, Hq, D), fp16 or bf16. Query i sits at position cached_len + i.
        key_chunk, val_chunk: (q_len, Hk, D), the query's dtype: the chunk's own K/V.
        kv_cache: uint8 (num_blocks, block_size, Hk, slot_bytes), any strides with a unit
            last stride (vLLM 0.20's layout, or 0.33's head-major one seen through
            ``.transpose(1, 2)``). Tokens [0, cached_len) are read; never written.
        block_table: int32 (max_blocks,) or (1, max_blocks), contiguous: the request's blocks.
        cached_len: tokens already in the cache before this chunk.
        preset: a ``turboquant_*`` name or a ``TQConfig``.
        centroids: float32 (2**key_bits,), the centroids the cache was written with
            (unused, may be None, for fp8-key presets).
        rotation: (D, D) orthonormal matrix the keys were rotated by (vLLM's Pi); unused
            for fp8-key presets.
        scale: softmax scale.
        window: tokens per window, a multiple of block_size; default ``default_window``.
        workspace: optional uint8 buffer of >= ``workspace_bytes(...)`` bytes on the
            query's device; allocated per call when None.
        backend: "auto", "flash", "cudnn", "triton" or "torch" (see attention.py). A named
            back end that is unavailable raises; it is never silently replaced.
        return_lse: also return the (Hq, q_len) float32 log-sum-exp.

    Returns:
        (q_len, Hq, D) in the query's dtype; with return_lse, (out, lse).
    """
    _check_tensor("query", query, 3, (torch.float16, torch.bfloat16))
    lq, hq, d = query.shape
    cfg = resolve_config(preset, d)
    _validate(query, key_chunk, val_chunk, kv_cache, block_table, cached_len, cfg, centroids, rotation,
              scale, window)
    hk = key_chunk.shape[1]
    window = window if window is not None else default_window(hk, d, kv_cache.shape[1])
    need = workspace_bytes(lq, hq, hk, d, window, query.dtype)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=query.device)
    else:
        _check_tensor("workspace", workspace, 1, (torch.uint8,), query.device)
        if workspace.numel() < need:
            raise ValueError(f"workspace must hold at least workspace_bytes(...) = {need} bytes, "
                             f"got {workspace.numel()}")
    backend = resolve_backend(backend, query.device, query.dtype, d)
    buf = carve(workspace, lq, hq, hk, d, window)
    block_table = block_table.reshape(-1)

    rotate_query(query, None if cfg.key_fp8 else rotation, buf.q_win)
    out = torch.empty_like(query)  # (Lq, Hq, D); also scratch for partial outputs until the end
    lse_out = torch.empty(hq, lq, dtype=torch.float32, device=query.device) if return_lse else None
    step = _Accumulator(buf, out.transpose(0, 1), scale, backend)
    for start in range(0, cached_len, window):
        n = min(window, cached_len - start)
        dequantize_window(kv_cache, block_table, start, n, cfg, centroids, buf.k_win, buf.v_win)
        step.attend(buf.q_win, buf.k_win[:, :n], buf.v_win[:, :n], causal=False)
    # The chunk's own keys, last: causal, unrotated, in the query's dtype.
    step.attend(query.transpose(0, 1), key_chunk.transpose(0, 1), val_chunk.transpose(0, 1), causal=True,
                final_lse=lse_out)
    return (out, lse_out) if return_lse else out


class _Accumulator:
    """Runs partial attentions and folds each into the workspace's (state_out, state_lse);
    the last one (``attend(..., causal=True)``) writes the result into ``out``."""

    def __init__(self, buf, out, scale, backend):
        self.buf, self.out, self.scale, self.backend, self.first = buf, out, scale, backend, True
        self.seqlens = {}  # FlashAttention's [0, L] device tensors, built once per length

    def attend(self, q, k, v, *, causal, final_lse=None):
        buf, final = self.buf, causal
        if self.backend == "triton":  # attention and merge in one kernel, float32 state
            attention_accumulate(q, k, v, self.scale, causal=causal, state_out=buf.state_out,
                                 state_lse=buf.state_lse, first=self.first)
            if final:
                self.out.copy_(buf.state_out)
                if final_lse is not None:
                    final_lse.copy_(buf.state_lse)
        else:
            part_out = None
            if self.backend == "flash":  # FlashAttention writes its partial into the output tensor
                part_out = self.out.view(q.dtype)  # (Hq, Lq, D); fp16 windows in a bf16 output's bytes
            part, lse = partial_attention(q, k, v, self.scale, causal=causal, backend=self.backend,
                                          out=part_out, seqlens=self.seqlens)
            if final and self.first:  # nothing cached: the chunk alone
                self.out.copy_(part)
                if final_lse is not None:
                    final_lse.copy_(lse)
            elif final:  # in place when part is self.out: each element is read before written
                merge_attn_states(buf.state_out, buf.state_lse, part, lse, self.out, final_lse)
            elif self.first:
                buf.state_out.copy_(part)
                buf.state_lse.copy_(lse)
            else:
                merge_attn_states(buf.state_out, buf.state_lse, part, lse, buf.state_out, buf.state_lse)
        self.first = False
