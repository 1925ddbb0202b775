"""What vLLM's TurboQuant backend runs in place of its own prefill attention, written
once for both ways tq_chunked reaches vLLM:

* the runtime plugin (``vllm_plugin.py``) patches vLLM's classes in memory so that
  their methods call a ``ChunkedPrefill``;
* the vendored change (``python -m tq_chunked.vendor``, docs/vendoring.md) copies this
  module, with the modules it needs, into vLLM as ``vllm.v1.attention.ops.tq_chunked``
  and edits vLLM's ``turboquant_attn.py`` so that its own methods call one.

So a fix here reaches both. Where vLLM's metadata builder makes a step's metadata
(``build``), ``ChunkedPrefill.plan_step`` plans the step's prefill part once and
attaches it to the metadata; each layer's ``_prefill_attention`` only runs it:

    builder.build(...)                  once per step
      -> ChunkedPrefill.plan_step       ContinuationPrefill.plan: windows, device
         metadata.tq_chunked_step       index tensors, workspace views
    impl._prefill_attention(...)        once per layer
      -> ChunkedPrefill.prefill_attention -> step.run(query, key, value, kv_cache, ...)

This module imports vLLM only inside functions that run in a vLLM process (the plugin
imports it before it knows whether vLLM is installed), and imports the rest of this
package relatively only (the vendor tool copies it under another name).
"""

from __future__ import annotations

import importlib
import os
import weakref

import torch

from .plan import PATHS, default_window, workspace_bytes
from .prefill import ContinuationPrefill, Step, continuation_prefill

# The metadata attribute that holds the step planned in the builder's build.
STEP_ATTR = "tq_chunked_step"

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


def path_from_env() -> str:
    """TQ_CHUNKED_PATH: which requests take the memory-bound path
    (``ContinuationPrefill``'s ``path``): "auto" where unset."""
    raw = os.environ.get("TQ_CHUNKED_PATH", "").strip()
    if not raw:
        return "auto"
    if raw not in PATHS:
        raise ValueError(
            f"TQ_CHUNKED_PATH must be one of {', '.join(PATHS)}, got {raw!r}"
        )
    return raw


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
        if self.hooks is None:
            return None
        module = importlib.import_module(self.hooks)
        initialized = getattr(module, "is_workspace_manager_initialized", None)
        if initialized is None:  # a backend module that imports only the manager
            from vllm.v1.worker import workspace

            initialized = workspace.is_workspace_manager_initialized
        return module.current_workspace_manager() if initialized() else None

    def reserve(self, nbytes: int) -> None:
        """When the metadata builder is created, before vLLM locks the manager: grow it
        to hold the workspace, as vLLM's own reservations do. Without a manager,
        nothing to do."""
        manager = self._manager()
        if manager is not None:
            self.reserved[manager] = max(self.reserved.get(manager, 0), nbytes)
            manager.get_simultaneous(((self.reserved[manager],), torch.uint8))

    def budget(self) -> int | None:
        """The bytes reserved in the current WorkspaceManager, which each layer then
        gets (``get``): the budget a step is planned within before any buffer is
        taken. None without a manager, or before a reservation."""
        manager = self._manager()
        return None if manager is None else self.reserved.get(manager)

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


def builder_shape(builder) -> dict:
    """The shape of the layers of vLLM's metadata ``builder``: heads, head size, block
    size and the model's dtype."""
    cfg = builder.vllm_config
    spec = builder.kv_cache_spec
    return dict(
        num_q_heads=cfg.model_config.get_num_attention_heads(cfg.parallel_config),
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
        block_size=spec.block_size,
        dtype=cfg.model_config.dtype,
    )


def builder_workspace_bytes(builder, window) -> tuple[int, int]:
    """(window, workspace bytes) for the largest prefill a builder's engine can
    schedule: max_num_batched_tokens query tokens."""
    shape = builder_shape(builder)
    w = _window(window, shape["num_kv_heads"], shape["head_dim"], shape["block_size"])
    q_tokens = builder.vllm_config.scheduler_config.max_num_batched_tokens
    return w, workspace_bytes(
        q_tokens,
        shape["num_q_heads"],
        shape["num_kv_heads"],
        shape["head_dim"],
        w,
        shape["dtype"],
    )


def _ints(x) -> list[int]:
    """A host copy of lengths (a CPU tensor, a numpy array or a sequence) as ints."""
    return x.tolist() if hasattr(x, "tolist") else [int(v) for v in x]


def _shape_of(prefill: ContinuationPrefill) -> dict:
    """The layer shape a ContinuationPrefill was made for (``_step_for``'s keys)."""
    return dict(
        num_q_heads=prefill.num_q_heads,
        num_kv_heads=prefill.num_kv_heads,
        head_dim=prefill.head_dim,
        block_size=prefill.block_size,
        dtype=prefill.dtype,
        preset=prefill.preset_name,
    )


def _place(t: torch.Tensor) -> tuple:
    """Where a tensor's elements are: two views with the same place are one tensor."""
    return t.data_ptr(), tuple(t.shape), t.stride()


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

    layers = get_layers_from_vllm_config(
        cfg,
        AttentionLayerBase,  # type: ignore[type-abstract]
        builder.layer_names,
    )
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
    None: the default, ``plan.default_window``) and the workspace. One per
    process, shared by every layer and builder.

    ``hooks``: the name of vLLM's backend module where it takes its buffers from a
    WorkspaceManager (0.21 on: ``Workspaces``), None where it keeps its own (0.20.x).
    """

    def __init__(
        self,
        hooks: str | None = None,
        window: int | None = None,
        path: str | None = None,
    ):
        self.workspaces = Workspaces(hooks)
        self.window = window
        self.path = path_from_env() if path is None else path  # TQ_CHUNKED_PATH
        # one ContinuationPrefill per model shape (heads, head size, dtype, preset,
        # block size) and budget: what does not change between steps
        self._prefills: dict[tuple, ContinuationPrefill] = {}
        # The step the latest build planned for each block table, by the place of the
        # block table of its prefill part: vLLM's forward hands _prefill_attention a
        # metadata of its own for the prefill part of a mixed batch (made per layer,
        # without the attribute), whose block table is a view of the built one. Each
        # build replaces its block table's entry (or drops it, where it plans
        # nothing): one entry per ubatch and kv-cache group of the step being run.
        self._built: dict[tuple, Step] = {}

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

    def _prefill(self, budget=None, **shape) -> ContinuationPrefill:
        key = (budget, *sorted(shape.items(), key=lambda kv: kv[0]))
        prefill = self._prefills.get(key)
        if prefill is None:
            prefill = self._prefills[key] = ContinuationPrefill(
                **shape,
                window=self.window,
                max_workspace_bytes=budget,
                path=self.path,
                check_block_table=False,  # vLLM's block tables index its own cache
            )
        return prefill

    def plan_step(self, builder, metadata, impl_cls) -> None:
        """In the builder's ``build``: plan the prefill part of the step (the requests
        after its ``num_decodes`` decodes) and attach it to ``metadata``
        (``tq_chunked_step``), so that every layer only runs it. Nothing is planned
        for a builder none of whose layers runs the prefill here (``reaches_here``,
        asked once per builder), nor inside CUDA graph capture; nor, to be planned by
        the first layer instead (the same plan), for a step without prefill requests
        or without host copies of the lengths, or where vLLM's config does not name
        the cache's preset (``cache_config.cache_dtype``: a unit test's config)."""
        plans = builder.__dict__.get("_tq_chunked_plans")
        if plans is None:
            plans = builder._tq_chunked_plans = any(
                self.served(builder, impl_cls, reaches_here)
            )
        nd = getattr(metadata, "num_decodes", 0)
        ndt = getattr(metadata, "num_decode_tokens", 0)
        block_table = metadata.block_table[nd:]
        place = _place(block_table)
        self._built.pop(place, None)  # no layer of this step runs an older plan
        qsl_cpu, seq_lens_cpu = _host_lengths(metadata)
        cache = getattr(builder.vllm_config, "cache_config", None)
        preset = getattr(cache, "cache_dtype", None)
        if (
            not plans
            or preset is None
            or not getattr(metadata, "is_prefill", True)
            or qsl_cpu is None
            or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        ):
            return
        qsl = [q - ndt for q in _ints(qsl_cpu)[nd:]]
        lens = _ints(seq_lens_cpu)[nd:]
        # Planned within what each layer will be given (the reservation), but no
        # buffer is taken here: vLLM builds every micro-batch's metadata in one thread,
        # and each micro-batch runs in its own buffer, which its layers take.
        prefill = self._prefill(
            self.workspaces.budget(), **builder_shape(builder), preset=str(preset)
        )
        step = prefill.plan(block_table, query_start_loc_cpu=qsl, seq_lens_cpu=lens)
        setattr(metadata, STEP_ATTR, step)
        self._built[place] = step
        while len(self._built) > 8:
            self._built.pop(next(iter(self._built)))

    def _step_for(self, impl, query, key, kv_cache, meta):
        """The step ``meta`` was planned with in build, if it was planned for this
        layer's shape, or one planned now. A metadata vLLM's forward made for the
        prefill part of a mixed batch is matched to the built step by its block table
        and host lengths (0.20's forward gives it none: by its token count and longest
        request); a metadata no build planned (a test's) is planned here."""
        n, hq, d = query.shape
        shape = dict(
            num_q_heads=hq,
            num_kv_heads=key.shape[1],
            head_dim=d,
            block_size=kv_cache.shape[1],
            dtype=query.dtype,
            preset=impl.kv_cache_dtype,
        )
        qsl_cpu, seq_lens_cpu = _host_lengths(meta)
        step = getattr(meta, STEP_ATTR, None)
        if step is None:
            step = self._built.get(_place(meta.block_table))
            if step is not None and not (
                step.num_tokens == n
                and (
                    max(step.seq_lens, default=0) == getattr(meta, "max_seq_len", -1)
                    if qsl_cpu is None
                    else tuple(_ints(qsl_cpu)) == step.query_start_loc
                    and tuple(_ints(seq_lens_cpu)) == step.seq_lens
                )
            ):
                step = None
        if step is not None and _shape_of(step.prefill) == shape:
            return step
        prefill = self._prefill(self.workspaces.budget(), **shape)
        return prefill.plan(
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )

    def prefill_attention(
        self, impl, query, key, value, kv_cache, attn_metadata, Pi, centroids
    ):
        """``_prefill_attention``: every request of the prefill part of the batch (first
        chunks, short and long prefix-cache hits) through the step planned in build.
        ``impl`` is vLLM's TurboQuantAttentionImpl (its preset and scale)."""
        _check_layout(impl)
        step = self._step_for(impl, query, key, kv_cache, attn_metadata)
        # this micro-batch's buffer, taken by the layer (vLLM keeps one per ubatch)
        ws = self.workspaces.get(step.plan.workspace_bytes, query.device)
        return step.run(
            query,
            key,
            value,
            kv_cache,
            centroids=centroids,
            rotation=Pi,
            scale=impl.scale,
            workspace=ws,
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
