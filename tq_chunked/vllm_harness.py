"""Real vLLM TurboQuant objects outside an engine, for the GPU tests and the benchmark.

Builds vLLM's own ``TurboQuantAttentionImpl`` and a layer carrying the buffers vLLM
derives (centroids, Pi), fills a paged cache with vLLM's own store kernel, and exposes
vLLM's ``_continuation_prefill`` (as installed) and the latest release's (through
``.gpu-carry/latest/vllm_latest.py`` when it is on the path).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def vllm_available() -> bool:
    try:
        import vllm.v1.attention.backends.turboquant_attn  # noqa: F401

        return True
    except Exception:
        return False


@dataclass
class VllmTQ:
    impl: object
    layer: torch.nn.Module

    @property
    def rotation(self):
        return self.layer._tq_Pi

    @property
    def centroids(self):
        return self.layer._tq_centroids


def build_vllm_tq(
    preset: str, num_q_heads: int, num_kv_heads: int, head_dim: int, device="cuda"
) -> VllmTQ:
    """VLLM's impl for ``preset`` inside a default VllmConfig, and its layer."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl

    with set_current_vllm_config(VllmConfig()):
        impl = TurboQuantAttentionImpl(
            num_heads=num_q_heads,
            head_size=head_dim,
            scale=head_dim**-0.5,
            num_kv_heads=num_kv_heads,
            kv_cache_dtype=preset,
        )
    layer = torch.nn.Module()
    layer._tq_centroids = get_centroids(head_dim, impl.tq_config.centroid_bits).to(
        device
    )
    impl._ensure_on_device(layer, torch.device(device))
    return VllmTQ(impl, layer)


def vllm_store(tq: VllmTQ, key, value, kv_cache, slot_mapping) -> None:
    """Write key/value (N, Hk, D) into kv_cache with vLLM's own store kernel."""
    tq.impl.do_kv_cache_update(tq.layer, key, value, kv_cache, slot_mapping)


def vllm_continuation_prefill(
    tq: VllmTQ, query, key_chunk, val_chunk, kv_cache, block_table, cached_len
):
    """The installed vLLM's own ``_continuation_prefill``."""
    return tq.impl._continuation_prefill(
        tq.layer,
        query,
        key_chunk,
        val_chunk,
        kv_cache,
        block_table.reshape(1, -1),
        cached_len,
        cached_len + query.shape[0],
        tq.rotation,
        tq.centroids,
    )


def latest_available() -> bool:
    try:
        import vllm_latest  # noqa: F401  (.gpu-carry/latest on PYTHONPATH)

        return True
    except Exception:
        return False


def prepare_latest(tq: VllmTQ, device, fresh_workspace=False) -> None:
    """Give the impl/layer what the latest method reads (once); fresh_workspace also starts
    from an empty WorkspaceManager, so the next call allocates (and counts) its buffer."""
    import vllm_latest
    from vllm.v1.worker import workspace

    if fresh_workspace:
        workspace.reset_workspace_manager()
    if fresh_workspace or not getattr(tq.layer, "_tq_latest_prepared", False):
        vllm_latest.prepare(tq.impl, tq.layer, device)
        tq.layer._tq_latest_prepared = True


def latest_continuation_prefill(
    tq: VllmTQ, query, key_chunk, val_chunk, kv_cache, block_table, cached_len
):
    """The latest vLLM release's ``_continuation_prefill``, run in the installed runtime."""
    import vllm_latest

    prepare_latest(tq, query.device)
    return vllm_latest.latest_continuation_prefill(
        tq.impl,
        tq.layer,
        query,
        key_chunk,
        val_chunk,
        kv_cache,
        block_table.reshape(1, -1),
        cached_len,
        cached_len + query.shape[0],
        tq.rotation,
        tq.centroids,
    )
