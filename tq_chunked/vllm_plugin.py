"""vLLM plugin: routes TurboQuant prefill attention through tq_chunked, in every process
vLLM starts (entry point group ``vllm.general_plugins``).

What it changes, detected by feature, never by version string:

* ``TurboQuantAttentionImpl._prefill_attention`` -> one ``continuation_prefill_varlen``
  call per layer for the whole prefill part of the batch: first chunks, short and long
  prefix-cache hits together (vLLM loops over requests in Python, replays its decode
  kernel once per query token for continuations of up to 128 tokens, and, when the
  longest request is a first chunk, attends every request to its raw K/V only, which
  drops a shorter request's cached prefix: vllm-project/vllm issue 46460). Decodes are
  vLLM's own kernel, untouched.
* ``TurboQuantAttentionImpl._continuation_prefill`` -> ``continuation_prefill`` (same
  signature, same answer, O(window) memory), for any caller left.
* Where the methods take buffers from vLLM's ``WorkspaceManager`` (0.21 onwards), the
  workspace comes from there too, reserved when the metadata builder is created (before
  the manager is locked), for ``max_num_batched_tokens`` query tokens. Where
  ``TurboQuantMetadataBuilder._reserve_workspace`` also reserves the (1, Hk,
  max_model_len, D) continuation pair, exactly that pair is no longer reserved.
* Where the methods kept per-layer buffers (0.20.x), one shared workspace per device,
  owned by the plugin, replaces them; and where the metadata has no host copies of the
  lengths (0.20.x), the builder attaches vLLM's own, so that prefill reads no device
  tensor back.

A vLLM whose classes have another shape is left untouched, with one warning: the
plugin patches everything or nothing. ``TQ_CHUNKED_DISABLE=1`` turns it off;
``TQ_CHUNKED_WINDOW=N`` sets the window (cached tokens per window).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

import torch

from . import __version__
from .chunked import continuation_prefill, continuation_prefill_varlen
from .workspace import default_window, workspace_bytes

CONTINUATION_PARAMS = ["self", "layer", "query", "key_chunk", "val_chunk", "kv_cache", "block_table", "cached_len",
                       "seq_len", "Pi", "centroids"]
PREFILL_PARAMS = ["self", "query", "key", "value", "kv_cache", "attn_metadata", "Pi", "centroids", "PiT", "layer"]
PATCH_MARK = "__tq_chunked__"


def _logger():
    try:
        from vllm.logger import init_logger
        return init_logger("tq_chunked")
    except Exception:  # vLLM's logger is a nicety: the standard one says the same
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


class Workspaces:
    """Where the window workspace comes from. With vLLM's WorkspaceManager (0.21 on), the
    manager's buffer, of the size the builder reserved (the call fits itself into it);
    without (0.20.x), one growable buffer per device, shared by all layers."""

    def __init__(self, tqa):
        self.tqa = tqa
        self.uses_manager = hasattr(tqa, "current_workspace_manager")
        self.reserved: dict[torch.device, int] = {}  # bytes reserved per device, by the builder hook
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def _manager_ready(self) -> bool:
        from vllm.v1.worker import workspace as vllm_workspace
        return vllm_workspace.is_workspace_manager_initialized()

    def reserve(self, nbytes: int, device: torch.device) -> None:
        """Before the manager is locked (the builder hook): grow it to hold the workspace."""
        if self.uses_manager and self._manager_ready() and not self.tqa.current_workspace_manager().is_locked():
            self.reserved[device] = max(self.reserved.get(device, 0), nbytes)
            self.tqa.current_workspace_manager().get_simultaneous(((self.reserved[device],), torch.uint8))

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        nbytes = max(nbytes, self.reserved.get(device, 0))
        if self.uses_manager and self._manager_ready():
            return self.tqa.current_workspace_manager().get_simultaneous(((nbytes,), torch.uint8))[0]
        buf = self.buffers.get(device)  # no manager (0.20.x), or none initialized (outside an engine)
        if buf is None or buf.numel() < nbytes:
            self.buffers.pop(device, None)  # free the old one first
            buf = self.buffers[device] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf


def _window(window, num_kv_heads, head_dim, block_size):
    return window if window is not None else default_window(num_kv_heads, head_dim, block_size)


def _host_lengths(meta):
    """(query_start_loc, seq_lens) host copies from vLLM's metadata, or (None, None): then
    the call reads the device tensors once (as vLLM 0.20's own method does)."""
    return getattr(meta, "query_start_loc_cpu", None), getattr(meta, "seq_lens_cpu", None)


def make_prefill_attention(original, workspaces, window):
    """The replacement ``_prefill_attention``: every request of the prefill part in one call."""

    @functools.wraps(original)
    def _prefill_attention(self, query, key, value, kv_cache, attn_metadata, Pi, centroids, PiT=None, layer=None):
        if getattr(self, "_soa_store", False):  # AMD's struct-of-arrays cache: another format
            return original(self, query, key, value, kv_cache, attn_metadata, Pi, centroids, PiT, layer)
        n, hq, d = query.shape
        hk = key.shape[1]
        w = _window(window, hk, d, kv_cache.shape[1])
        qsl_cpu, seq_lens_cpu = _host_lengths(attn_metadata)
        ws = workspaces.get(workspace_bytes(n, hq, hk, d, w, query.dtype), query.device)
        return continuation_prefill_varlen(
            query, key, value, kv_cache, attn_metadata.block_table, attn_metadata.query_start_loc,
            attn_metadata.seq_lens, preset=self.kv_cache_dtype, centroids=centroids, rotation=Pi, scale=self.scale,
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu, window=w, workspace=ws,
            check_block_table=False)  # vLLM's block tables index its own cache

    setattr(_prefill_attention, PATCH_MARK, True)
    return _prefill_attention


def make_continuation_prefill(original, workspaces, window):
    """The replacement ``_continuation_prefill``: one request, same answer, O(window) memory."""

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
        w = _window(window, hk, d, kv_cache.shape[1])
        ws = workspaces.get(workspace_bytes(q_len, hq, hk, d, w, query.dtype), query.device)
        return continuation_prefill(query, key_chunk, val_chunk, kv_cache, block_table, cached_len,
                                    preset=self.kv_cache_dtype, centroids=centroids, rotation=Pi, scale=self.scale,
                                    window=w, workspace=ws, check_block_table=False)

    setattr(_continuation_prefill, PATCH_MARK, True)
    return _continuation_prefill


def builder_workspace_bytes(builder, window) -> tuple[int, int]:
    """(window, workspace bytes) for the largest prefill a builder's engine can schedule:
    max_num_batched_tokens query tokens."""
    cfg = builder.vllm_config
    spec = builder.kv_cache_spec
    hq = cfg.model_config.get_num_attention_heads(cfg.parallel_config)
    w = _window(window, spec.num_kv_heads, spec.head_size, spec.block_size)
    q_tokens = cfg.scheduler_config.max_num_batched_tokens
    return w, workspace_bytes(q_tokens, hq, spec.num_kv_heads, spec.head_size, w, cfg.model_config.dtype)


def continuation_reservation(builder):
    """The (shape, dtype) of each of the two buffers vLLM's ``_reserve_workspace`` asks for
    its continuation prefill: (1, Hk, round_up(max_model_len - 1, block_size), D) fp16."""
    spec = builder.kv_cache_spec
    cached = max(0, builder.vllm_config.model_config.max_model_len - 1)
    length = -(-cached // spec.block_size) * spec.block_size
    return (1, spec.num_kv_heads, length, spec.head_size), torch.float16


class _WithoutContinuationReservation:
    """A WorkspaceManager seen through a filter that drops exactly the continuation pair
    (two buffers of ``pair``'s shape and dtype); every other request goes through."""

    def __init__(self, manager, pair):
        self._manager, self._pair = manager, pair

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def get_simultaneous(self, *shapes_and_dtypes):
        if len(shapes_and_dtypes) == 2 and all((tuple(s), dt) == self._pair for s, dt in shapes_and_dtypes):
            return [None, None]
        return self._manager.get_simultaneous(*shapes_and_dtypes)


def _check_signature(cls, name, expected):
    method = getattr(cls, name, None)
    if method is None:
        raise UnsupportedVllm(f"TurboQuantAttentionImpl has no {name}")
    params = list(inspect.signature(method).parameters)
    if params != expected:
        raise UnsupportedVllm(f"{name}{tuple(params)} is not the expected {tuple(expected)}")
    return method


def plan_patches(tqa, window):
    """[(owner, attribute name, new value)], or UnsupportedVllm with the reason."""
    impl_cls = getattr(tqa, "TurboQuantAttentionImpl", None)
    builder_cls = getattr(tqa, "TurboQuantMetadataBuilder", None)
    meta_cls = getattr(tqa, "TurboQuantMetadata", None)
    if impl_cls is None or builder_cls is None or meta_cls is None:
        raise UnsupportedVllm("turboquant_attn has no TurboQuantAttentionImpl, TurboQuantMetadataBuilder or "
                              "TurboQuantMetadata")
    continuation = _check_signature(impl_cls, "_continuation_prefill", CONTINUATION_PARAMS)
    prefill = _check_signature(impl_cls, "_prefill_attention", PREFILL_PARAMS)
    if getattr(prefill, PATCH_MARK, False):
        return []  # already patched in this process
    log = _logger()
    workspaces = Workspaces(tqa)
    plan = [(impl_cls, "_prefill_attention", make_prefill_attention(prefill, workspaces, window)),
            (impl_cls, "_continuation_prefill", make_continuation_prefill(continuation, workspaces, window))]

    original_init = builder_cls.__init__

    @functools.wraps(original_init)
    def builder_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        w, nbytes = builder_workspace_bytes(self, window)
        workspaces.reserve(nbytes, self.device)  # before vLLM locks its manager
        _log_active(log, w, nbytes)
    plan.append((builder_cls, "__init__", builder_init))

    if "query_start_loc_cpu" not in getattr(meta_cls, "__dataclass_fields__", {}):  # 0.20.x: no host copies
        original_build = builder_cls.build

        @functools.wraps(original_build)
        def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
            meta = original_build(self, common_prefix_len, common_attn_metadata, *args, **kwargs)
            cam = common_attn_metadata
            seq_lens_cpu = getattr(cam, "seq_lens_cpu_upper_bound", None)  # exact for prefill rows
            if seq_lens_cpu is None:
                seq_lens_cpu = getattr(cam, "_seq_lens_cpu", None)  # not the property: it would synchronize
            if getattr(cam, "query_start_loc_cpu", None) is not None and seq_lens_cpu is not None:
                meta.query_start_loc_cpu, meta.seq_lens_cpu = cam.query_start_loc_cpu, seq_lens_cpu
            return meta
        plan.append((builder_cls, "build", build))

    original_reserve = getattr(builder_cls, "_reserve_workspace", None)
    if workspaces.uses_manager and original_reserve is not None:
        @functools.wraps(original_reserve)
        def reserve_workspace(self):
            if getattr(tqa, "is_flydsl_available", lambda: False)():
                return original_reserve(self)  # the SoA path keeps vLLM's own methods and buffers
            real = tqa.current_workspace_manager
            pair = continuation_reservation(self)
            tqa.current_workspace_manager = lambda: _WithoutContinuationReservation(real(), pair)
            try:
                original_reserve(self)
            finally:
                tqa.current_workspace_manager = real
        plan.append((builder_cls, "_reserve_workspace", reserve_workspace))
    return plan


@functools.cache
def _log_active(log, window, nbytes):
    log.info("tq_chunked %s active: prefill attention batched and windowed (windows of %d tokens), "
             "workspace %.1f MiB per ubatch", __version__, window, nbytes / 2**20)


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
    """Whether this process's vLLM runs tq_chunked's prefill attention."""
    if tqa is None:
        import vllm.v1.attention.backends.turboquant_attn as tqa
    impl = tqa.TurboQuantAttentionImpl
    return getattr(impl._prefill_attention, PATCH_MARK, False) and getattr(impl._continuation_prefill, PATCH_MARK,
                                                                            False)
