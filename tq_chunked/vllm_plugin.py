"""vLLM plugin: routes TurboQuant prefill attention through tq_chunked, in every process
vLLM starts (entry point group ``vllm.general_plugins``).

What it changes, detected by feature, never by version string:

* ``TurboQuantMetadataBuilder.build`` plans the step's prefill part once
  (``ContinuationPrefill.plan``) and attaches it to the metadata;
  ``TurboQuantAttentionImpl._prefill_attention`` runs it, one call per layer for the
  whole prefill part of the batch: first chunks, short and long prefix-cache hits
  together (vLLM loops over requests in Python, replays its decode
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
  max_model_len, D) continuation pair, exactly that pair is no longer reserved, for a
  builder whose layers all have their prefill computed by tq_chunked
  (``vllm_backend.runs_windowed``); a builder with a layer that keeps vLLM's own
  continuation (UltraQuant, which shares the builder and brings its own prefill; the
  struct-of-arrays cache layout) reserves what vLLM reserves.
* Where the methods kept per-layer buffers (0.20.x), one shared workspace per device,
  owned by the plugin, replaces them; and where the metadata has no host copies of the
  lengths (0.20.x), the builder attaches vLLM's own, so that prefill reads no device
  tensor back.

A vLLM whose classes have another shape is left untouched, with one warning: the
plugin patches everything or nothing. ``TQ_CHUNKED_DISABLE=1`` turns it off (1, true,
yes or on; 0, false, no, off or unset leave it on; anything else is refused by name);
``TQ_CHUNKED_WINDOW=N`` sets the window (key rows per window); ``TQ_CHUNKED_PATH``
which requests read their cache through the memory-bound path (auto, window, paged).

With the backend patched, one more change, in the process that builds vLLM's engine
config (``EngineArgs.create_engine_config``): vLLM sets ``flash_attn_version = 2`` for
every ``turboquant_*`` cache, so the model's unquantized layers (TurboQuant leaves the
first two and the last two as they are) run FlashAttention 2. The failure that setting
avoided (FA3's metadata builder asserting that every layer is a ``FlashAttentionImpl``)
is gone in every release the plugin patches (vLLM PR 40092: FA3's builder skips other
backends' layers). On Hopper the plugin gives the config back the version that was
asked for (vLLM's default, FA3, unless the user named one), and logs it;
``TQ_CHUNKED_KEEP_FA2=1`` keeps vLLM's FA2. Measured in vLLM 0.21.0's engine, FA2 there
cost 13 % of a 60000-token prompt's time to first token (benchmarks/NOTES.md §28).

What the replaced methods and the reservation do is ``vllm_backend.py``'s
``ChunkedPrefill``, which the vendored change (``python -m tq_chunked.vendor``) calls
from vLLM's own code: this module only decides what to patch and wraps it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

import torch

from . import __version__
from .runtime.attention import resolve_backend, vllm_flash
from .runtime.vllm_backend import (
    CONTINUATION_PARAMS,
    PREFILL_PARAMS,
    ChunkedPrefill,
    attach_host_lengths,
    builder_workspace_bytes,
    path_from_env,
    reaches_here,
    window_from_env,
)

PATCH_MARK = "__tq_chunked__"
# vLLM configures only its "vllm" logger: under it, vLLM's handler, format and
# VLLM_LOGGING_LEVEL apply; a top-level "tq_chunked" logger's INFO lines are dropped.
LOGGER_NAME = "vllm.tq_chunked"


def _logger():
    try:
        from vllm.logger import init_logger

        return init_logger(LOGGER_NAME)
    except Exception:  # vLLM's logger is a nicety: the standard one says the same
        return logging.getLogger(LOGGER_NAME)


class UnsupportedVllm(Exception):
    """The installed vLLM's TurboQuant classes do not have a shape this plugin knows."""


def make_prefill_attention(original, prefill: ChunkedPrefill):
    """The replacement ``_prefill_attention``: every request of the prefill part in
    one call."""

    @functools.wraps(original)
    def _prefill_attention(
        self,
        query,
        key,
        value,
        kv_cache,
        attn_metadata,
        Pi,
        centroids,
        PiT=None,
        layer=None,
    ):
        if getattr(self, "_soa_store", False):  # AMD's struct-of-arrays layout
            return original(
                self,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                Pi,
                centroids,
                PiT,
                layer,
            )
        return prefill.prefill_attention(
            self, query, key, value, kv_cache, attn_metadata, Pi, centroids
        )

    setattr(_prefill_attention, PATCH_MARK, True)
    return _prefill_attention


def make_continuation_prefill(original, prefill: ChunkedPrefill):
    """The replacement ``_continuation_prefill``: one request, same answer, O(window)
    memory."""

    @functools.wraps(original)
    def _continuation_prefill(
        self,
        layer,
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
        if getattr(self, "_soa_store", False):  # AMD's struct-of-arrays layout
            return original(
                self,
                layer,
                query,
                key_chunk,
                val_chunk,
                kv_cache,
                block_table,
                cached_len,
                seq_len,
                Pi,
                centroids,
            )
        return prefill.continuation_prefill(
            self,
            query,
            key_chunk,
            val_chunk,
            kv_cache,
            block_table,
            cached_len,
            seq_len,
            Pi,
            centroids,
        )

    setattr(_continuation_prefill, PATCH_MARK, True)
    return _continuation_prefill


def continuation_reservation(builder):
    """The (shape, dtype) of each of the two buffers vLLM's ``_reserve_workspace`` asks
    for its continuation prefill: (1, Hk, round_up(max_model_len - 1, block_size), D)
    fp16."""
    spec = builder.kv_cache_spec
    cached = max(0, builder.vllm_config.model_config.max_model_len - 1)
    length = -(-cached // spec.block_size) * spec.block_size
    return (1, spec.num_kv_heads, length, spec.head_size), torch.float16


class _WithoutContinuationReservation:
    """A WorkspaceManager seen through a filter that drops exactly the continuation
    pair (two buffers of ``pair``'s shape and dtype); every other request goes
    through."""

    def __init__(self, manager, pair):
        self._manager, self._pair = manager, pair

    def __getattr__(self, name):
        return getattr(self._manager, name)

    def get_simultaneous(self, *shapes_and_dtypes):
        if len(shapes_and_dtypes) == 2 and all(
            (tuple(s), dt) == self._pair for s, dt in shapes_and_dtypes
        ):
            return [None, None]
        return self._manager.get_simultaneous(*shapes_and_dtypes)


def _check_signature(cls, name, expected):
    method = getattr(cls, name, None)
    if method is None:
        raise UnsupportedVllm(f"TurboQuantAttentionImpl has no {name}")
    params = list(inspect.signature(method).parameters)
    if params != expected:
        raise UnsupportedVllm(
            f"{name}{tuple(params)} is not the expected {tuple(expected)}"
        )
    return method


def plan_patches(tqa, window):
    """[(owner, attribute name, new value)], or UnsupportedVllm with the reason."""
    impl_cls = getattr(tqa, "TurboQuantAttentionImpl", None)
    builder_cls = getattr(tqa, "TurboQuantMetadataBuilder", None)
    meta_cls = getattr(tqa, "TurboQuantMetadata", None)
    if impl_cls is None or builder_cls is None or meta_cls is None:
        raise UnsupportedVllm(
            "turboquant_attn has no TurboQuantAttentionImpl, TurboQuantMetadataBuilder "
            "or TurboQuantMetadata"
        )
    continuation = _check_signature(
        impl_cls, "_continuation_prefill", CONTINUATION_PARAMS
    )
    prefill = _check_signature(impl_cls, "_prefill_attention", PREFILL_PARAMS)
    if getattr(prefill, PATCH_MARK, False):
        return []  # already patched in this process
    log = _logger()
    # The same object the vendored change creates in turboquant_attn.py: the workspace
    # from vLLM's manager where the module takes its buffers from one, found through the
    # module at each call (where vLLM's tests patch it).
    uses_manager = hasattr(tqa, "current_workspace_manager")
    chunked = ChunkedPrefill(tqa.__name__ if uses_manager else None, window)
    plan = [
        (impl_cls, "_prefill_attention", make_prefill_attention(prefill, chunked)),
        (
            impl_cls,
            "_continuation_prefill",
            make_continuation_prefill(continuation, chunked),
        ),
    ]

    original_init = builder_cls.__init__

    @functools.wraps(original_init)
    def builder_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        chunked.reserve(self, impl_cls)  # before vLLM locks its manager
        if any(chunked.served(self, impl_cls, reaches_here)):
            _log_active(
                log,
                *builder_workspace_bytes(self, chunked.window),
                _attention_name(self.kv_cache_spec.head_size),
            )

    plan.append((builder_cls, "__init__", builder_init))

    # build: vLLM's host copies of the lengths where its metadata has none (0.20.x),
    # then the step's prefill planned once, for every layer to run
    host_copies = "query_start_loc_cpu" in getattr(meta_cls, "__dataclass_fields__", {})
    original_build = builder_cls.build

    @functools.wraps(original_build)
    def build(self, common_prefix_len, common_attn_metadata, *args, **kwargs):
        meta = original_build(
            self, common_prefix_len, common_attn_metadata, *args, **kwargs
        )
        if not host_copies:
            attach_host_lengths(meta, common_attn_metadata, self.vllm_config)
        chunked.plan_step(self, meta, impl_cls)
        return meta

    plan.append((builder_cls, "build", build))

    original_reserve = getattr(builder_cls, "_reserve_workspace", None)
    if chunked.workspaces.uses_manager and original_reserve is not None:

        @functools.wraps(original_reserve)
        def reserve_workspace(self):
            if not all(chunked.served(self, impl_cls)):
                # A layer keeps vLLM's own continuation (UltraQuant; the
                # struct-of-arrays layout): so does the reservation.
                return original_reserve(self)
            real = tqa.current_workspace_manager
            pair = continuation_reservation(self)
            tqa.current_workspace_manager = lambda: _WithoutContinuationReservation(
                real(), pair
            )
            try:
                original_reserve(self)
            finally:
                tqa.current_workspace_manager = real

        plan.append((builder_cls, "_reserve_workspace", reserve_workspace))
    return plan


def _attention_name(head_size) -> str:
    """What the windows attend with on this GPU: the log names it, because inside an
    engine with a TurboQuant cache it is not what vLLM's own layers use (FA2)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    device = torch.device("cuda", torch.cuda.current_device())
    if resolve_backend("auto", device, head_size) == "flash":
        return f"FlashAttention {vllm_flash(head_size)[1]}"
    return "the project's Triton kernel (no FlashAttention from vLLM at this head size)"


@functools.cache
def _log_active(log, window, nbytes, attention):
    log.info(
        "tq_chunked %s active: prefill attention batched and windowed "
        "(windows of %d tokens, %s), workspace %.1f MiB per ubatch",
        __version__,
        window,
        attention,
        nbytes / 2**20,
    )


KEEP_FA2_ENV = "TQ_CHUNKED_KEEP_FA2"
DISABLE_ENV = "TQ_CHUNKED_DISABLE"
# The spellings of an on/off variable, case-insensitive (unset or empty: off).
ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(name: str) -> bool:
    """The on/off environment variable ``name``: 1, true, yes or on; 0, false, no,
    off, empty or unset (case-insensitive, surrounding whitespace ignored). Anything
    else is refused by name (ValueError), never read as either."""
    raw = os.environ.get(name, "").strip()
    if raw.lower() in ON:
        return True
    if raw.lower() in OFF + ("",):
        return False
    raise ValueError(
        f"{name}: expected one of {', '.join(ON)} (on) or {', '.join(OFF)} (off), "
        f"got {raw!r}"
    )


def _keep_fa2() -> bool:
    """TQ_CHUNKED_KEEP_FA2: on keeps vLLM's FA2 setting (``switch``)."""
    return switch(KEEP_FA2_ENV)


def _is_hopper() -> bool:
    """Whether vLLM's platform is an sm 9.x NVIDIA GPU. Asked through vLLM's platform,
    which reads it without initializing CUDA in this process (the engine's front end,
    before it starts its workers)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda():
            return False
        capability = current_platform.get_device_capability()
    except Exception:  # no driver, no GPU: not a Hopper GPU
        return False
    return capability is not None and capability.major == 9


def restore_flash_attn_version(engine_args, config, is_hopper) -> str | None:
    """Undo vLLM's ``flash_attn_version = 2`` for a ``turboquant_*`` cache in the
    engine ``config`` that ``engine_args.create_engine_config()`` returned: on Hopper
    (``is_hopper()``, asked last, only for such a config) the config gets back the
    version the arguments asked for (None: vLLM's default, FA3 where its build has it).
    Returns what was done, for the log, or None where vLLM's setting is not that
    override (another cache, UltraQuant's included, or FA2 asked for).

    vLLM's per-model adjustments made while it built the config saw 2 and are not run
    again (0.33's for Gemma 4's mixed head sizes, which picks FA4 for an unset
    version)."""
    cache_dtype = str(getattr(config.cache_config, "cache_dtype", ""))
    attention = getattr(config, "attention_config", None)
    if not cache_dtype.startswith("turboquant_") or attention is None:
        return None
    asked = getattr(
        getattr(engine_args, "attention_config", None), "flash_attn_version", None
    )
    if attention.flash_attn_version != 2 or asked == 2:
        return None
    if _keep_fa2():
        return f"kept at 2 ({KEEP_FA2_ENV}={os.environ[KEEP_FA2_ENV].strip()})"
    if not is_hopper():
        return "kept at 2 (not a Hopper GPU, where this is untested)"
    attention.flash_attn_version = asked
    restored = (
        "unset again (vLLM's default: FA3 where its build has it)"
        if asked is None
        else f"{asked} again, as asked"
    )
    return (
        f"undone for the model's unquantized layers: the version is {restored}; "
        f"{KEEP_FA2_ENV}=1 keeps FA2"
    )


def plan_engine_patch(arg_utils) -> list:
    """[(EngineArgs, "create_engine_config", wrapper)], or [] where vLLM's EngineArgs
    has no such method or is patched already."""
    cls = getattr(arg_utils, "EngineArgs", None)
    original = getattr(cls, "create_engine_config", None)
    if original is None or getattr(original, PATCH_MARK, False):
        return []
    log = _logger()

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        done = restore_flash_attn_version(self, config, _is_hopper)
        if done is not None:
            log.info(
                "tq_chunked %s: vLLM's flash_attn_version=2 for TurboQuant caches %s",
                __version__,
                done,
            )
        return config

    setattr(create_engine_config, PATCH_MARK, True)
    return [(cls, "create_engine_config", create_engine_config)]


def register() -> bool:
    """The ``vllm.general_plugins`` entry point. Returns whether vLLM is patched."""
    log = _logger()
    if switch(DISABLE_ENV):
        log.info(
            "tq_chunked %s: disabled by %s=%s",
            __version__,
            DISABLE_ENV,
            os.environ[DISABLE_ENV].strip(),
        )
        return False
    path_from_env()  # read again by each ChunkedPrefill; a bad value is refused here
    try:
        import vllm.v1.attention.backends.turboquant_attn as tqa
    except ImportError as e:
        log.debug(
            "tq_chunked: vLLM has no TurboQuant backend (%s); nothing to patch", e
        )
        return False
    window = window_from_env()
    _keep_fa2()  # a bad value is refused here, before anything is patched
    try:
        plan = plan_patches(tqa, window)
    except UnsupportedVllm as e:
        log.warning(
            "tq_chunked %s: unsupported vLLM TurboQuant backend (%s); "
            "vLLM left unpatched",
            __version__,
            e,
        )
        return False
    try:
        from vllm.engine import arg_utils
    except ImportError as e:  # not where an engine config is built
        log.debug("tq_chunked: vLLM's EngineArgs not importable (%s)", e)
    else:
        plan += plan_engine_patch(arg_utils)
    for owner, name, value in plan:  # all checks passed: apply everything
        setattr(owner, name, value)
    return is_patched(tqa)


def is_patched(tqa=None) -> bool:
    """Whether this process's vLLM runs tq_chunked's prefill attention."""
    if tqa is None:
        import vllm.v1.attention.backends.turboquant_attn as tqa
    impl = tqa.TurboQuantAttentionImpl
    return getattr(impl._prefill_attention, PATCH_MARK, False) and getattr(
        impl._continuation_prefill, PATCH_MARK, False
    )
