"""``python -m tq_chunked.vendor VLLM_SOURCE_DIR [--check]``: writes tq_chunked into a
vLLM source tree as a change vLLM's maintainers can review and merge
(docs/vendoring.md).

VLLM_SOURCE_DIR holds the ``vllm/`` package (a vLLM git checkout, or a site-packages
directory). The tool

1. copies the runtime, the directory ``tq_chunked/runtime/``, to
   ``vllm/v1/attention/ops/tq_chunked/`` (``package``);
2. edits ``vllm/v1/attention/backends/turboquant_attn.py`` so that vLLM's own methods
   call ``vllm_backend.ChunkedPrefill`` (the object the runtime plugin calls too), and
   nothing else in the file (``edits``: one function per edit site, found with
   ``ast``; ``source``: the helpers they share);
3. in a checkout, edits vLLM's TurboQuant tests where they assert the reservation the
   change replaces, and adds a test of the change (``vllm_tests``).

A file of any other shape is refused with the list of what was not found, and nothing
is written. The unified diffs are printed, then the files added. ``--check`` prints
the same and writes nothing. A tree this tool has already vendored with the same
tq_chunked is reported as such (exit 0); one vendored with another is refused
(``cli``).
"""

from .cli import main, vendor
from .edits import is_vendored, plan_edits, vendored_text
from .package import check_imports, package_files, rewrite_imports
from .paths import (
    LINE,
    NEW_TEST,
    STATE,
    TARGET,
    VENDORED,
    VENDORED_DIR,
    VLLM_TEST,
    VendorError,
)
from .vllm_tests import edited_vllm_test, new_test_text

__all__ = [
    "LINE",
    "NEW_TEST",
    "STATE",
    "TARGET",
    "VENDORED",
    "VENDORED_DIR",
    "VLLM_TEST",
    "VendorError",
    "check_imports",
    "edited_vllm_test",
    "is_vendored",
    "main",
    "new_test_text",
    "package_files",
    "plan_edits",
    "rewrite_imports",
    "vendor",
    "vendored_text",
]
