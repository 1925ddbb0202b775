"""Pytest settings of the suite: the device it runs on, whether Triton kernels can run,
the gpu marker. The inputs the tests build (random caches and batches, comparisons)
are in tq_chunked/tools/testing.py, shared with the demo and the benchmarks.

Every random input comes from a seeded generator; the seed is part of each test's id
(or of hypothesis's reported example), so a failure repeats exactly.
"""

from __future__ import annotations

import os

import pytest
import torch

from tq_chunked.tools import testing

# CPU runs execute the Triton kernels in the interpreter; GPU runs on the device.
DEVICE = testing.DEVICE
TRITON_OK = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (run with -m gpu on the device)"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
