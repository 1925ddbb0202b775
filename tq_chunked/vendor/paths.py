"""Where the vendored change goes in a vLLM tree, and the error the tool reports."""

from __future__ import annotations

from pathlib import Path

PACKAGE = "tq_chunked"
# The vendored package's import name, and its directory in the tree.
VENDORED = "vllm.v1.attention.ops.tq_chunked"
VENDORED_DIR = Path(*VENDORED.split("."))
# The file whose methods are rewired.
TARGET = Path("vllm/v1/attention/backends/turboquant_attn.py")
BACKEND_MODULE = "vllm_backend"
# vLLM's own TurboQuant tests (edited where they assert the old reservation), and the
# test the change adds beside them.
VLLM_TEST = Path("tests/quantization/test_turboquant.py")
NEW_TEST = Path("tests/quantization/test_turboquant_chunked_prefill.py")
# The Buildkite pipeline of vLLM's quantization tests, where the new test gets a job
# (vLLM's pre-commit refuses a test file that no job runs), and that job's key.
CI_JOBS = Path(".buildkite/test_areas/quantization.yaml")
CI_KEY = "turboquant-chunked-prefill"
# The module-level ChunkedPrefill in turboquant_attn.py.
STATE = "_tq_chunked_prefill"
# vLLM's line length (ruff): the generated lines are formatted to fit it.
LINE = 88


class VendorError(Exception):
    """The vLLM tree, or tq_chunked itself, is not in a shape this tool can vendor."""
