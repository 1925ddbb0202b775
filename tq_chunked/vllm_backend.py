"""What vLLM's TurboQuant backend runs in place of its own prefill attention, written
once for both ways tq_chunked reaches vLLM:

* the runtime plugin (``vllm_plugin.py``) patches vLLM's classes in memory so that
  their methods call a ``ChunkedPrefill``;
* the vendored change (``python -m tq_chunked.vendor``, docs/vendoring.md) copies this
  module, with the modules it needs, into vLLM as ``vllm.v1.attention.ops.tq_chunked``
  and edits vLLM's ``turboquant_attn.py`` so that its own methods call one.

So a fix here reaches both. This module imports vLLM only inside functions that run in
a vLLM process (the plugin imports it before it knows whether vLLM is installed), and
imports the rest of this package relatively only (the vendor tool copies it under
another name).
"""

from __future__ import annotations

import os
import weakref

import torch

from .chunked import continuation_prefill, continuation_prefill_varlen
from .workspace import default_window, workspace_bytes

# The signatures of the vLLM methods whose work this module does: the plugin and the
# vendor tool both refuse a vLLM whose methods take anything else.
CONTINUATION_PARAMS = [
    "self",
    "layer",
    "query",
    "key_chunk",
    "val_chunk",
    "kv_cache",
    "block_table",
    "cached_len",
    "seq_len",
    "Pi",
    "centroids",
]
PREFILL_PARAMS = [
    "self",
    "query",
    "key",
    "value",
    "kv_cache",
    "attn_metadata",
    "Pi",
    "centroids",
    "PiT",
    "layer",
]


def window_from_env() -> int | None:
    """TQ_CHUNKED_WINDOW as a positive int, or None for the default window."""
    raw = os.environ.get("TQ_CHUNKED_WINDOW", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(
            f"TQ_CHUNKED_WINDOW must be a positive number of tokens, got {raw!r}"
        )
    return int(raw)


class Workspaces:
    """Where the window workspace comes from. With vLLM's WorkspaceManager (0.21 on), the
    manager's buffer, of the size reserved when the metadata builder was created (the
    call fits itself into it); without (0.20.x), one growable buffer per device, shared
    by all layers.

    ``workspace_manager``: vLLM's ``current_workspace_manager`` where the backend takes
    its buffers from a WorkspaceManager, None where it keeps its own (0.20.x).
    """

    def __init__(self, workspace_manager=None):
        self._current_manager = workspace_manager
        self.uses_manager = workspace_manager is not None
        # Bytes reserved per manager (not per device): a manager that vLLM resets and
        # creates again starts without a reservation, as its buffer does.
        self.reserved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def _manager(self):
        """VLLM's WorkspaceManager, or None: this vLLM has none for the backend (0.20.x),
        or none is initialized (outside an engine)."""
        if not self.uses_manager:
            return None
        from vllm.v1.worker.workspace import is_workspace_manager_initialized

        return self._current_manager() if is_workspace_manager_initialized() else None

    def reserve(self, nbytes: int) -> None:
        """Before the manager is locked (when the metadata builder is created): grow it to
        hold the workspace. Without a manager, or once it is locked, nothing to do."""
        manager = self._manager()
        if manager is not None and not manager.is_locked():
            self.reserved[manager] = max(self.reserved.get(manager, 0), nbytes)
            manager.get_simultaneous(((self.reserved[manager],), torch.uint8))

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        manager = self._manager()
        if manager is not None:
            # Exactly what was reserved, never more (a locked manager cannot grow): the call
            # fits itself into any workspace that holds its smallest layout, and says so
            # if one does not.
            nbytes = self.reserved.get(manager) or nbytes
            return manager.get_simultaneous(((nbytes,), torch.uint8))[0]
        buf = self.buffers.get(
            device
        )  # no manager (0.20.x), or none initialized (outside an engine)
        if buf is None or buf.numel() < nbytes:
            self.buffers.pop(device, None)  # free the old one first
            buf = self.buffers[device] = torch.empty(
                nbytes, dtype=torch.uint8, device=device
            )
        return buf


def _window(window, num_kv_heads, head_dim, block_size):
    return (
        window
        if window is not None
        else default_window(num_kv_heads, head_dim, block_size)
    )


def _host_lengths(meta):
    """(query_start_loc, seq_lens) host copies from vLLM's metadata, or (None, None): then
    the call reads the device tensors once (as vLLM 0.20's own method does)."""
    return getattr(meta, "query_start_loc_cpu", None), getattr(
        meta, "seq_lens_cpu", None
    )


def _check_layout(impl):
    if getattr(impl, "_soa_store", False):
        raise NotImplementedError(
            "tq_chunked reads vLLM's default (array-of-structs) TurboQuant cache layout, not "
            "the struct-of-arrays one this impl stores (impl._soa_store): vLLM's own method "
            "serves that layout"
        )


def builder_workspace_bytes(builder, window) -> tuple[int, int]:
    """(window, workspace bytes) for the largest prefill a builder's engine can schedule:
    max_num_batched_tokens query tokens."""
    cfg = builder.vllm_config
    spec = builder.kv_cache_spec
    hq = cfg.model_config.get_num_attention_heads(cfg.parallel_config)
    w = _window(window, spec.num_kv_heads, spec.head_size, spec.block_size)
    q_tokens = cfg.scheduler_config.max_num_batched_tokens
    return w, workspace_bytes(
        q_tokens, hq, spec.num_kv_heads, spec.head_size, w, cfg.model_config.dtype
    )


def attach_host_lengths(meta, common_attn_metadata, vllm_config=None) -> None:
    """For a vLLM whose TurboQuantMetadata has no host copies of the lengths (0.20.x):
    attach vLLM's own (``query_start_loc_cpu``, ``seq_lens_cpu``) to the metadata its
    builder made, so that prefill reads no device tensor back. Where the common metadata
    has none, nothing is attached (prefill then reads the device tensors once).

    vLLM's ``seq_lens_cpu_upper_bound`` is exact for prefill rows but optimistic for the
    rows of speculative decoding, which TurboQuant sends to prefill (q_len 1 + drafts):
    with a speculative config (``vllm_config``) only an exact copy is attached."""
    cam = common_attn_metadata
    seq_lens_cpu = getattr(
        cam, "_seq_lens_cpu", None
    )  # exact; not the property: it would synchronize
    speculative = getattr(vllm_config, "speculative_config", None) is not None
    if seq_lens_cpu is None and not speculative:
        seq_lens_cpu = getattr(cam, "seq_lens_cpu_upper_bound", None)
    if (
        getattr(cam, "query_start_loc_cpu", None) is not None
        and seq_lens_cpu is not None
    ):
        meta.query_start_loc_cpu, meta.seq_lens_cpu = (
            cam.query_start_loc_cpu,
            seq_lens_cpu,
        )


class ChunkedPrefill:
    """The bodies of vLLM's ``TurboQuantAttentionImpl._prefill_attention`` and
    ``_continuation_prefill`` and the workspace reservation of its metadata builder, with
    the state they share: the window (tokens of the cached prefix per window; None: the
    default, ``workspace.default_window``) and the workspace. One per process, shared by
    every layer and builder.

    ``workspace_manager``: vLLM's ``current_workspace_manager`` where the backend takes
    its buffers from a WorkspaceManager (0.21 on), None where it keeps its own (0.20.x).
    """

    def __init__(self, workspace_manager=None, window: int | None = None):
        self.workspaces = Workspaces(workspace_manager)
        self.window = window

    def prefill_attention(
        self, impl, query, key, value, kv_cache, attn_metadata, Pi, centroids
    ):
        """``_prefill_attention``: every request of the prefill part of the batch (first
        chunks, short and long prefix-cache hits) in one ``continuation_prefill_varlen``
        call. ``impl`` is vLLM's TurboQuantAttentionImpl (its preset and scale)."""
        _check_layout(impl)
        n, hq, d = query.shape
        hk = key.shape[1]
        w = _window(self.window, hk, d, kv_cache.shape[1])
        qsl_cpu, seq_lens_cpu = _host_lengths(attn_metadata)
        ws = self.workspaces.get(
            workspace_bytes(n, hq, hk, d, w, query.dtype), query.device
        )
        return continuation_prefill_varlen(
            query,
            key,
            value,
            kv_cache,
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            preset=impl.kv_cache_dtype,
            centroids=centroids,
            rotation=Pi,
            scale=impl.scale,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            window=w,
            workspace=ws,
            check_block_table=False,
        )  # vLLM's block tables index its own cache

    def continuation_prefill(
        self,
        impl,
        query,
        key_chunk,
        val_chunk,
        kv_cache,
        block_table,
        cached_len,
        seq_len,
        Pi,
        centroids,
    ):
        """``_continuation_prefill``: one request, same answer, O(window) memory."""
        _check_layout(impl)
        q_len, hq, d = query.shape
        if seq_len != cached_len + q_len:
            raise ValueError(
                f"seq_len ({seq_len}) must equal cached_len ({cached_len}) + q_len ({q_len})"
            )
        hk = key_chunk.shape[1]
        w = _window(self.window, hk, d, kv_cache.shape[1])
        ws = self.workspaces.get(
            workspace_bytes(q_len, hq, hk, d, w, query.dtype), query.device
        )
        return continuation_prefill(
            query,
            key_chunk,
            val_chunk,
            kv_cache,
            block_table,
            cached_len,
            preset=impl.kv_cache_dtype,
            centroids=centroids,
            rotation=Pi,
            scale=impl.scale,
            window=w,
            workspace=ws,
            check_block_table=False,
        )

    def reserve(self, builder) -> tuple[int, int]:
        """When vLLM's TurboQuantMetadataBuilder is created, before vLLM locks its
        WorkspaceManager: reserve the workspace of the largest prefill the engine can
        schedule (``max_num_batched_tokens`` query tokens). Returns (window, bytes)."""
        w, nbytes = builder_workspace_bytes(builder, self.window)
        self.workspaces.reserve(nbytes)
        return w, nbytes
