"""No kernel reads or writes outside the tensors it was given (CPU, Triton's
interpreter; tests/bounds.py checks every address): the window path's kernels (the
fill, the rotation's split, the Triton attention, the merge) and the fused prototype,
at shapes that exercise every mask: a head size that is not a power of two, requests
cut into windows, an empty request, a block id outside the cache, a strided query, a
cache at an odd address."""

import pytest
import torch
import triton
import triton.language as tl
from bounds import OutOfBounds, reads_within_arguments
from conftest import TRITON_OK

from tq_chunked import continuation_prefill_varlen
from tq_chunked.fused import fused_continuation_prefill_varlen
from tq_chunked.testing import build_batch

pytestmark = pytest.mark.skipif(
    not TRITON_OK or torch.cuda.is_available(),
    reason="addresses are checked in Triton's interpreter (TRITON_INTERPRET=1)",
)
REQUESTS = [(70, 5), (0, 9), (33, 0), (50, 3)]  # request 3 gets a bad block id


@triton.jit
def _reads_one_past(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i <= n), mask=i < n)


def test_the_check_catches_a_read_one_element_past_the_end():
    x, y = torch.arange(8.0), torch.empty(8)
    with reads_within_arguments() as seen:
        _reads_one_past[(1,)](x, y, 7, BLOCK=16)  # reads 0..7: inside
    assert seen.loads == 1 and seen.stores == 1
    with (
        pytest.raises(Exception, match="outside its arguments"),
        reads_within_arguments(),
    ):
        _reads_one_past[(1,)](x, y, 8, BLOCK=16)  # reads x[8]
    assert issubclass(OutOfBounds, AssertionError)


def batch_with_a_bad_block(preset, d, dtype, odd_cache):
    b = build_batch(preset, REQUESTS, 4, 2, d, 16, dtype, "cpu", seed=d)
    b["block_table"][3, 1] = b["kv_cache"].shape[0] + 5  # never read: request 3 NaN
    if odd_cache:  # the byte-by-byte reads
        cache = b["kv_cache"]
        buf = torch.empty(cache.numel() + 1, dtype=torch.uint8)
        b["kv_cache"] = buf[1:].view(cache.shape)
        b["kv_cache"].copy_(cache)
    # token stride Hq * D, heads strided
    b["query"] = b["query"].transpose(0, 1).contiguous().transpose(0, 1)
    return b


@pytest.mark.parametrize(
    "preset, d, dtype, odd_cache",
    [
        ("turboquant_3bit_nc", 128, torch.float16, False),
        ("turboquant_k8v4", 80, torch.bfloat16, True),
        ("turboquant_4bit_nc", 64, torch.bfloat16, False),
    ],
)
def test_the_window_path_stays_inside_its_tensors(preset, d, dtype, odd_cache):
    b = batch_with_a_bad_block(preset, d, dtype, odd_cache)
    with reads_within_arguments() as seen:
        out = continuation_prefill_varlen(
            b["query"],
            b["key"],
            b["value"],
            b["kv_cache"],
            b["block_table"],
            None,
            None,
            **b["kwargs"],
            query_start_loc_cpu=b["query_start_loc"],
            seq_lens_cpu=b["seq_lens"],
            window=40,  # requests 0 and 3 in several windows
            backend="triton",
            check_block_table=False,
        )
    kernels = {"_split_kernel", "_fill_kernel", "_attention_kernel", "_merge_kernel"}
    assert seen.kernels >= kernels - (
        {"_split_kernel"} if preset.endswith("k8v4") else set()
    )
    q = b["query_start_loc"]
    assert out[q[3] : q[4]].isnan().all(), f"seed {d}"
    assert torch.isfinite(out[: q[3]]).all(), f"seed {d}"


@pytest.mark.parametrize("odd_cache", [False, True])
def test_the_fused_prototype_stays_inside_its_tensors(odd_cache):
    b = batch_with_a_bad_block("turboquant_3bit_nc", 32, torch.float16, odd_cache)
    qsl, lens = b["query_start_loc"], b["seq_lens"]
    with reads_within_arguments() as seen:
        out = fused_continuation_prefill_varlen(
            b["query"],
            b["key"],
            b["value"],
            b["kv_cache"],
            b["block_table"],
            qsl,
            lens,
            **b["kwargs"],
            splits=3,
            backend="torch",
        )
    assert seen.kernels == {"_cached_attention_kernel", "_merge_kernel"}
    assert out[qsl[3] : qsl[4]].isnan().all(), "seed 32"
    assert torch.isfinite(out[: qsl[3]]).all(), "seed 32"
