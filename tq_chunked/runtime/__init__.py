"""tq_chunked's runtime: windowed continuation prefill over a TurboQuant-compressed
paged KV cache. This directory is what vLLM vendors (``python -m tq_chunked.vendor``)
as ``vllm.v1.attention.ops.tq_chunked``; it imports only itself, the standard library,
numpy, torch, triton and (inside functions) vllm."""

from .format import PRESETS, TQConfig, hadamard, lloyd_max_centroids
from .plan import default_window, workspace_bytes
from .prefill import (
    ContinuationPrefill,
    Step,
    check_block_tables,
    continuation_prefill,
    continuation_prefill_varlen,
)

__all__ = [
    "ContinuationPrefill",
    "Step",
    "continuation_prefill",
    "continuation_prefill_varlen",
    "check_block_tables",
    "workspace_bytes",
    "default_window",
    "TQConfig",
    "PRESETS",
    "hadamard",
    "lloyd_max_centroids",
]
