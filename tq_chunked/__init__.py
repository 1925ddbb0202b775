"""tq_chunked: windowed continuation prefill over a TurboQuant-compressed paged KV
cache."""

from .chunked import (
    check_block_tables,
    continuation_prefill,
    continuation_prefill_varlen,
)
from .format import PRESETS, TQConfig, hadamard, lloyd_max_centroids
from .workspace import default_window, workspace_bytes

__version__ = "0.4.6"
__all__ = [
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
