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

import importlib
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
# The two methods of vLLM's TurboQuantAttentionImpl whose work ChunkedPrefill does.
PREFILL_METHODS = ("_prefill_attention", "_continuation_prefill")


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
    """Where the window workspace comes from. With vLLM's WorkspaceManager (0.21 on),
    the manager's buffer, of the size reserved when the metadata builder was created
    (the call fits itself into it); without (0.20.x), one growable buffer per device,
    shared by all layers.

    ``hooks``: the name of vLLM's backend module (``turboquant_attn``) where it takes
    its buffers from a WorkspaceManager, None where it keeps its own (0.20.x). The
    module's ``current_workspace_manager`` and ``is_workspace_manager_initialized``
    are looked up there at each call, so that whatever replaces them in that module
    (vLLM's tests patch them there) is what runs.
    """

    def __init__(self, hooks: str | None = None):
        self.hooks = hooks
        self.uses_manager = hooks is not None
        # Bytes reserved per manager (not per device): a manager that vLLM resets and
        # creates again starts without a reservation, as its buffer does.
        self.reserved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.buffers: dict[torch.device, torch.Tensor] = {}

    def _manager(self):
        """The WorkspaceManager of vLLM, or None: this vLLM has none for the backend
        (0.20.x), or none is initialized (outside an engine)."""
        if not self.uses_manager:
            return None
        module = importlib.import_module(self.hooks)
        initialized = getattr(module, "is_workspace_manager_initialized", None)
        if initialized is None:  # a backend module that imports only the manager
            from vllm.v1.worker.workspace import (
                is_workspace_manager_initialized as initialized,
            )
        return module.current_workspace_manager() if initialized() else None

    def reserve(self, nbytes: int) -> None:
        """When the metadata builder is created, before vLLM locks the manager: grow it
        to hold the workspace, as vLLM's own reservations do. Without a manager,
        nothing to do."""
        manager = self._manager()
        if manager is not None:
            self.reserved[manager] = max(self.reserved.get(manager, 0), nbytes)
            manager.get_simultaneous(((self.reserved[manager],), torch.uint8))

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        manager = self._manager()
        if manager is not None:
            # Exactly what was reserved, never more (a locked manager cannot grow): the
            # call fits itself into any workspace that holds its smallest layout, and
            # says so if one does not.
            nbytes = self.reserved.get(manager) or nbytes
            return manager.get_simultaneous(((nbytes,), torch.uint8))[0]
        # No manager (0.20.x), or none initialized (outside an engine).
        buf = self.buffers.get(device)
        if buf is None or buf.numel() < nbytes:
            self.buffers.pop(device, None)  # free the old one first
            buf = self.buffers[device] = torch.empty(
                nbytes, dtype=torch.uint8, device=device
            )
        return buf


def _window(window, num_kv_heads, head_dim, block_size):
    if window is not None:
        return window
    return default_window(num_kv_heads, head_dim, block_size)


def _host_lengths(meta):
    """(query_start_loc, seq_lens) host copies from vLLM's metadata, or (None, None):
    then the call reads the device tensors once (as vLLM 0.20's own method does)."""
    qsl = getattr(meta, "query_start_loc_cpu", None)
    return qsl, getattr(meta, "seq_lens_cpu", None)


def _check_layout(impl):
    if getattr(impl, "_soa_store", False):
        raise NotImplementedError(
            "tq_chunked reads vLLM's default (array-of-structs) TurboQuant cache "
            "layout, not the struct-of-arrays one this impl stores (impl._soa_store): "
            "vLLM's own method serves that layout"
        )


def builder_workspace_bytes(builder, window) -> tuple[int, int]:
    """(window, workspace bytes) for the largest prefill a builder's engine can
    schedule: max_num_batched_tokens query tokens."""
    cfg = builder.vllm_config
    spec = builder.kv_cache_spec
    hq = cfg.model_config.get_num_attention_heads(cfg.parallel_config)
    w = _window(window, spec.num_kv_heads, spec.head_size, spec.block_size)
    q_tokens = cfg.scheduler_config.max_num_batched_tokens
    return w, workspace_bytes(
        q_tokens, hq, spec.num_kv_heads, spec.head_size, w, cfg.model_config.dtype
    )


def runs_windowed(impl, impl_cls) -> bool:
    """Whether vLLM's attention impl ``impl`` has its prefill computed here: an instance
    of ``impl_cls`` (vLLM's TurboQuantAttentionImpl, whose two prefill methods call a
    ChunkedPrefill) that inherits both methods and stores the default cache layout. A
    subclass with a prefill or continuation method of its own (UltraQuant's
    ``_prefill_attention`` and its dequantized K/V pair) keeps what vLLM reserves for
    it."""
    cls = type(impl)
    return (
        isinstance(impl, impl_cls)
        and not getattr(impl, "_soa_store", False)
        and all(getattr(cls, m) is getattr(impl_cls, m) for m in PREFILL_METHODS)
    )


def reaches_here(impl, impl_cls) -> bool:
    """Whether vLLM's attention impl ``impl`` runs the batched prefill computed here:
    an instance of ``impl_cls`` in the default cache layout that inherits its
    ``_prefill_attention``. A subclass that overrides only ``_continuation_prefill``
    still does, so it needs the workspace although it keeps vLLM's pair; one with a
    prefill of its own (UltraQuant's) does not."""
    return (
        isinstance(impl, impl_cls)
        and not getattr(impl, "_soa_store", False)
        and type(impl)._prefill_attention is impl_cls._prefill_attention
    )


def builder_impls(builder) -> list | None:
    """The attention impls of the layers a metadata builder serves, looked up the way
    vLLM looked them up to pick the builder (its static forward context); None where
    the builder's config has no layers (a config made for a unit test)."""
    cfg = builder.vllm_config
    compilation = getattr(cfg, "compilation_config", None)
    if getattr(compilation, "static_forward_context", None) is None:
        return None
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(cfg, AttentionLayerBase, builder.layer_names)
    impls = [getattr(layers.get(name), "impl", None) for name in builder.layer_names]
    # Only a config where none of the layers is found is a unit test's; a layer that
    # is missing from a real one is not served (it keeps what vLLM reserves).
    return None if all(i is None for i in impls) else impls


def attach_host_lengths(meta, common_attn_metadata, vllm_config=None) -> None:
    """For a vLLM whose TurboQuantMetadata has no host copies of the lengths (0.20.x):
    attach vLLM's own (``query_start_loc_cpu``, ``seq_lens_cpu``) to the metadata its
    builder made, so that prefill reads no device tensor back. Where the common metadata
    has none, nothing is attached (prefill then reads the device tensors once).

    vLLM's ``seq_lens_cpu_upper_bound`` is exact for prefill rows but optimistic for the
    rows of speculative decoding, which TurboQuant sends to prefill (q_len 1 + drafts):
    with a speculative config (``vllm_config``) only an exact copy is attached."""
    cam = common_attn_metadata
    # Exact; not the property of that name: it would synchronize.
    seq_lens_cpu = getattr(cam, "_seq_lens_cpu", None)
    speculative = getattr(vllm_config, "speculative_config", None) is not None
    if seq_lens_cpu is None and not speculative:
        seq_lens_cpu = getattr(cam, "seq_lens_cpu_upper_bound", None)
    qsl_cpu = getattr(cam, "query_start_loc_cpu", None)
    if qsl_cpu is not None and seq_lens_cpu is not None:
        meta.query_start_loc_cpu, meta.seq_lens_cpu = qsl_cpu, seq_lens_cpu


class ChunkedPrefill:
    """The bodies of vLLM's ``TurboQuantAttentionImpl._prefill_attention`` and
    ``_continuation_prefill`` and the workspace reservation of its metadata builder,
    with the state they share: the window (tokens of the cached prefix per window;
    None: the default, ``workspace.default_window``) and the workspace. One per
    process, shared by every layer and builder.

    ``hooks``: the name of vLLM's backend module where it takes its buffers from a
    WorkspaceManager (0.21 on: ``Workspaces``), None where it keeps its own (0.20.x).
    """

    def __init__(self, hooks: str | None = None, window: int | None = None):
        self.workspaces = Workspaces(hooks)
        self.window = window

    def served(self, builder, impl_cls, rule=runs_windowed) -> list[bool]:
        """Per layer of vLLM's metadata ``builder``: whether its impl's prefill runs
        here (``rule``: ``runs_windowed``, or ``reaches_here`` for "can run here"). A
        builder none of whose layers can be looked up (a unit test's config) is taken
        to serve ``impl_cls`` itself, as vLLM would build it now: in the default cache
        layout unless the backend module's ``is_flydsl_available()`` selects the
        struct-of-arrays one."""
        impls = builder_impls(builder)
        if impls is not None:
            return [rule(impl, impl_cls) for impl in impls]
        hooks = self.workspaces.hooks
        module = importlib.import_module(hooks) if hooks else None
        return [not getattr(module, "is_flydsl_available", lambda: False)()]

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
            check_block_table=False,  # vLLM's block tables index its own cache
        )

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
                f"seq_len ({seq_len}) must equal cached_len ({cached_len}) + q_len "
                f"({q_len})"
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

    def reserve(self, builder, impl_cls) -> bool:
        """When vLLM's metadata builder is created, before vLLM locks its
        WorkspaceManager: where any of the builder's layers can run the prefill
        computed here (``reaches_here``), reserve the workspace of the largest prefill
        the engine can schedule (``max_num_batched_tokens`` query tokens). Returns
        whether all of them have both prefill methods computed here
        (``runs_windowed``): then vLLM's own continuation buffers, a (1, Hk,
        max_model_len, D) K/V pair, are used by none of them."""
        if any(self.served(builder, impl_cls, reaches_here)):
            _, nbytes = builder_workspace_bytes(builder, self.window)
            self.workspaces.reserve(nbytes)
        return all(self.served(builder, impl_cls))
