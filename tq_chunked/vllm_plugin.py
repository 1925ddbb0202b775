"""vLLM plugin: replaces ``TurboQuantAttentionImpl._continuation_prefill`` with the
windowed path, in every process vLLM starts (entry point group ``vllm.general_plugins``).

What it changes, detected by feature, never by version string:

* ``TurboQuantAttentionImpl._continuation_prefill`` -> ``continuation_prefill`` (same
  signature, same answer, O(window) memory).
* Where the method took its buffers from vLLM's ``WorkspaceManager`` (0.21 onwards),
  the window workspace comes from there too, reserved when the metadata builder is
  created (before the manager is locked), for ``max_num_batched_tokens`` queries.
  Where ``TurboQuantMetadataBuilder._reserve_workspace`` also reserved a
  max_model_len-sized continuation buffer, that reservation is dropped (its decode
  reservation is kept as is).
* Where the method kept per-layer buffers (0.20.x), one shared workspace per device,
  owned by the plugin, replaces them.

A vLLM whose classes have another shape is left untouched, with one warning: the
plugin patches everything or nothing. ``TQ_CHUNKED_DISABLE=1`` turns it off;
``TQ_CHUNKED_WINDOW=N`` sets the window (tokens, a multiple of the cache block size).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

import torch

from . import __version__
from .chunked import continuation_prefill
from .workspace import default_window, workspace_bytes

EXPECTED_PARAMS = ["self", "layer", "query", "key_chunk", "val_chunk", "kv_cache", "block_table", "cached_len",
                   "seq_len", "Pi", "centroids"]
PATCH_MARK = "__tq_chunked__"


def _logger():
    try:
        from vllm.logger import init_logger
        return init_logger("tq_chunked")
    except Exception:
        return logging.getLogger("tq_chunked")


class UnsupportedVllm(Exception):
    """The installed vLLM's TurboQuant classes do not have a shape this plugin knows."""


def window_from_env() -> int | None:
    """TQ_CHUNKED_WINDOW as a positive int, or None for the default window."""
    raw = os.environ.get("TQ_CHUNKED_WINDOW", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"TQ_CHUNKED_WINDOW must be a positive number of tokens, got {raw!r}")
    return int(raw)


class SharedWorkspace:
    """One growable uint8 workspace per device, shared by all layers (vLLM 0.20.x)."""

    def __init__(self):
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < nbytes:
            self.buffers.pop(device, None)  # free the old one first
            buf = self.buffers[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]


def _window_for(window, num_kv_heads, head_dim, block_size):
    w = window if window is not None else default_window(num_kv_heads, head_dim, block_size)
    if w % block_size:
        raise ValueError(f"TQ_CHUNKED_WINDOW ({w}) must be a multiple of the KV-cache block size ({block_size})")
    return w


def make_continuation_prefill(original, workspace_source, window):
    """The replacement method. workspace_source(nbytes, device) -> uint8 tensor."""

    @functools.wraps(original)
    def _continuation_prefill(self, layer, query, key_chunk, val_chunk, kv_cache, block_table, cached_len,
                              seq_len, Pi, centroids):
        if getattr(self, "_soa_store", False):  # AMD's struct-of-arrays cache: another format
            return original(self, layer, query, key_chunk, val_chunk, kv_cache, block_table, cached_len,
                            seq_len, Pi, centroids)
        q_len, hq, d = query.shape
        if seq_len != cached_len + q_len:
            raise ValueError(f"seq_len ({seq_len}) must equal cached_len ({cached_len}) + q_len ({q_len})")
        hk = key_chunk.shape[1]
        w = _window_for(window, hk, d, kv_cache.shape[1])
        nbytes = workspace_bytes(q_len, hq, hk, d, w, query.dtype)
        return continuation_prefill(query, key_chunk, val_chunk, kv_cache, block_table, cached_len,
                                    preset=self.kv_cache_dtype, centroids=centroids, rotation=Pi, scale=self.scale,
                                    window=w, workspace=workspace_source(nbytes, query.device))

    setattr(_continuation_prefill, PATCH_MARK, True)
    return _continuation_prefill


def builder_workspace_bytes(builder, window) -> tuple[int, int]:
    """(window, workspace bytes) for the largest continuation a builder's engine can
    schedule: max_num_batched_tokens queries."""
    cfg = builder.vllm_config
    spec = builder.kv_cache_spec
    hq = cfg.model_config.get_num_attention_heads(cfg.parallel_config)
    w = _window_for(window, spec.num_kv_heads, spec.head_size, spec.block_size)
    q_len = cfg.scheduler_config.max_num_batched_tokens
    return w, workspace_bytes(q_len, hq, spec.num_kv_heads, spec.head_size, w, cfg.model_config.dtype)


class _WithoutContinuationReservation:
    """A WorkspaceManager seen through a filter that drops the request for the
    (1, Hk, max_model_len, D) fp16 K/V pair; every other request goes through."""

    def __init__(self, manager):
        self._manager = manager

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def get_simultaneous(self, *shapes_and_dtypes):
        if len(shapes_and_dtypes) == 2 and all(dt == torch.float16 and len(s) == 4 and s[0] == 1
                                               for s, dt in shapes_and_dtypes):
            return [None, None]
        return self._manager.get_simultaneous(*shapes_and_dtypes)


def plan_patches(tqa, window):
    """[(owner, attribute name, new value)], or UnsupportedVllm with the reason."""
    impl_cls = getattr(tqa, "TurboQuantAttentionImpl", None)
    builder_cls = getattr(tqa, "TurboQuantMetadataBuilder", None)
    if impl_cls is None or builder_cls is None:
        raise UnsupportedVllm("turboquant_attn has no TurboQuantAttentionImpl or TurboQuantMetadataBuilder")
    original = getattr(impl_cls, "_continuation_prefill", None)
    if original is None:
        raise UnsupportedVllm("TurboQuantAttentionImpl has no _continuation_prefill")
    if getattr(original, PATCH_MARK, False):
        return []  # already patched in this process
    params = list(inspect.signature(original).parameters)
    if params != EXPECTED_PARAMS:
        raise UnsupportedVllm(f"_continuation_prefill{tuple(params)} is not the expected {tuple(EXPECTED_PARAMS)}")
    log = _logger()
    uses_manager = hasattr(tqa, "current_workspace_manager")
    if uses_manager:
        def workspace_source(nbytes, device):
            return tqa.current_workspace_manager().get_simultaneous(((nbytes,), torch.uint8))[0]
    else:
        workspace_source = SharedWorkspace().get
    plan = [(impl_cls, "_continuation_prefill", make_continuation_prefill(original, workspace_source, window))]

    original_init = builder_cls.__init__

    @functools.wraps(original_init)
    def builder_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        w, nbytes = builder_workspace_bytes(self, window)
        if uses_manager:  # reserve before vLLM locks the manager
            from vllm.v1.worker import workspace as vllm_workspace
            if vllm_workspace.is_workspace_manager_initialized() and not tqa.current_workspace_manager().is_locked():
                tqa.current_workspace_manager().get_simultaneous(((nbytes,), torch.uint8))
        _log_active(log, w, nbytes)
    plan.append((builder_cls, "__init__", builder_init))

    original_reserve = getattr(builder_cls, "_reserve_workspace", None)
    if uses_manager and original_reserve is not None:
        @functools.wraps(original_reserve)
        def reserve_workspace(self):
            if getattr(tqa, "is_flydsl_available", lambda: False)():
                return original_reserve(self)  # the SoA path keeps vLLM's own method and buffers
            real = tqa.current_workspace_manager
            tqa.current_workspace_manager = lambda: _WithoutContinuationReservation(real())
            try:
                original_reserve(self)
            finally:
                tqa.current_workspace_manager = real
        plan.append((builder_cls, "_reserve_workspace", reserve_workspace))
    return plan


@functools.cache
def _log_active(log, window, nbytes):
    log.info("tq_chunked %s active: continuation prefill in windows of %d tokens, workspace %.1f MiB per ubatch",
             __version__, window, nbytes / 2**20)


def register() -> bool:
    """The ``vllm.general_plugins`` entry point. Returns whether vLLM is patched."""
    log = _logger()
    if os.environ.get("TQ_CHUNKED_DISABLE", "") == "1":
        log.info("tq_chunked %s: disabled by TQ_CHUNKED_DISABLE=1", __version__)
        return False
    try:
        import vllm.v1.attention.backends.turboquant_attn as tqa
    except ImportError as e:
        log.debug("tq_chunked: vLLM has no TurboQuant backend (%s); nothing to patch", e)
        return False
    window = window_from_env()
    try:
        plan = plan_patches(tqa, window)
    except UnsupportedVllm as e:
        log.warning("tq_chunked %s: unsupported vLLM TurboQuant backend (%s); vLLM left unpatched", __version__, e)
        return False
    for owner, name, value in plan:  # all checks passed: apply everything
        setattr(owner, name, value)
    return is_patched(tqa)


def is_patched(tqa=None) -> bool:
    """Whether this process's vLLM runs the windowed continuation prefill."""
    if tqa is None:
        import vllm.v1.attention.backends.turboquant_attn as tqa
    return getattr(tqa.TurboQuantAttentionImpl._continuation_prefill, PATCH_MARK, False)
