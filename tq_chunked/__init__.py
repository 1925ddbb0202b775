"""tq_chunked: windowed continuation prefill over a TurboQuant-compressed paged KV
cache.

    tq_chunked/runtime/   what vLLM runs (and vendors): the public API below
    tq_chunked/vllm_plugin.py   the vLLM plugin that patches it in
    tq_chunked/vendor/    python -m tq_chunked.vendor: the same change into vLLM's tree
    tq_chunked/tools/     demo, bench, baselines, the reference paths, test inputs
"""

from .runtime import (
    PRESETS,
    ContinuationPrefill,
    Step,
    TQConfig,
    check_block_tables,
    continuation_prefill,
    continuation_prefill_varlen,
    default_window,
    hadamard,
    lloyd_max_centroids,
    workspace_bytes,
)

__version__ = "0.6.24"
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
    "__version__",
]
