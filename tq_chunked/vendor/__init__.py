"""``python -m tq_chunked.vendor VLLM_SOURCE_DIR [--check]``: writes tq_chunked into a
vLLM source tree as a change vLLM's maintainers can review and merge
(docs/vendoring.md).

VLLM_SOURCE_DIR holds the ``vllm/`` package (a vLLM git checkout, or a site-packages
directory). The tool

1. copies the runtime, the directory ``tq_chunked/runtime/`` (whatever modules it
   holds), to ``vllm/v1/attention/ops/tq_chunked/``, its imports of Triton taken from
   ``vllm.triton_utils`` as vLLM's pre-commit asks (``package``);
2. edits ``vllm/v1/attention/backends/turboquant_attn.py`` so that vLLM's own methods
   call ``vllm_backend.ChunkedPrefill`` (the object the runtime plugin calls too), and
   nothing else in the file (``edits``: one function per edit site, found with
   ``ast``; ``source``: the helpers they share);
3. in a checkout, edits vLLM's TurboQuant tests where they assert the reservation the
   change replaces, adds a test of the change, and a Buildkite job that runs it
   (``vllm_tests``).

A file of any other shape (or one that does not parse, or a tree without
``vllm/v1/attention/ops/``) is refused with the list of what was not found, and
nothing is written; ``--check`` refuses the same trees. The unified diffs are printed,
then the files added. ``--check`` prints the same and writes nothing. A tree this tool
has already vendored with the same tq_chunked is reported as such (exit 0); one
vendored with another is refused (``cli``).
"""

from .cli import main, vendor
from .edits import is_vendored, plan_edits, vendored_text
from .package import (
    check_imports,
    package_files,
    rewrite_imports,
    rewrite_triton_imports,
)
from .paths import (
    CI_JOBS,
    CI_KEY,
    LINE,
    NEW_TEST,
    STATE,
    TARGET,
    VENDORED,
    VENDORED_DIR,
    VLLM_TEST,
    VendorError,
)
from .vllm_tests import edited_ci_jobs, edited_vllm_test, has_ci_job, new_test_text

__all__ = [
    "CI_JOBS",
    "CI_KEY",
    "LINE",
    "NEW_TEST",
    "STATE",
    "TARGET",
    "VENDORED",
    "VENDORED_DIR",
    "VLLM_TEST",
    "VendorError",
    "check_imports",
    "edited_ci_jobs",
    "edited_vllm_test",
    "has_ci_job",
    "is_vendored",
    "main",
    "new_test_text",
    "package_files",
    "plan_edits",
    "rewrite_imports",
    "rewrite_triton_imports",
    "vendor",
    "vendored_text",
]
