"""No kernel reads or writes outside the tensors it was given (CPU, Triton's
interpreter; tests/bounds.py checks every address): the window path's kernels (the
fill, the rotation's split, the Triton attention, the merges, a spread window's) and
the fused prototype, at shapes that exercise every mask: a head size that is not a
power of two, requests cut into windows, an empty request, a block id outside the
cache, a strided query, a cache at an odd address."""

import pytest
import torch
import triton
import triton.language as tl
from bounds import OutOfBounds, reads_within_arguments
from conftest import TRITON_OK
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tq_chunked import ContinuationPrefill, continuation_prefill_varlen
from tq_chunked.experimental.fused import fused_continuation_prefill_varlen
from tq_chunked.runtime.dequant import fill_window
from tq_chunked.runtime.format import PRESETS, TQConfig
from tq_chunked.runtime.plan import windows
from tq_chunked.tools.testing import build_batch, make_batch

pytestmark = pytest.mark.skipif(
    not TRITON_OK or torch.cuda.is_available(),
    reason="addresses are checked in Triton's interpreter (TRITON_INTERPRET=1, on a "
    "machine without CUDA: with one, the kernels would run on the GPU)",
)
REQUESTS = [(70, 5), (0, 9), (33, 0), (50, 3)]  # request 3 gets a bad block id


@triton.jit
def _copy(x_ptr, y_ptr, x_off, y_off, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + y_off + i, tl.load(x_ptr + x_off + i, mask=i < n), mask=i < n)


@triton.jit
def _bump(x_ptr, off, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.atomic_add(x_ptr + off + i, 1.0, mask=i < n)


@triton.jit
def _read_words(x_ptr, byte_off, out_ptr):
    w = tl.load((x_ptr + byte_off).to(tl.pointer_type(tl.int32)) + tl.arange(0, 2))
    tl.store(out_ptr + tl.arange(0, 2), w)


def raises_out_of_bounds(launch, match):
    with pytest.raises(Exception) as e, reads_within_arguments():
        launch()
    cause = e.value if isinstance(e.value, OutOfBounds) else e.value.__cause__
    assert isinstance(cause, OutOfBounds), repr(e.value)
    assert match in str(cause), str(cause)


def test_accesses_inside_their_tensors_pass():
    x, y = torch.arange(8.0), torch.empty(8)
    with reads_within_arguments() as seen:
        _copy[(1,)](x, y, 0, 0, 8, BLOCK=16)  # elements 0..7 of each
        _bump[(1,)](y, 0, 8, BLOCK=16)
    assert (seen.loads, seen.stores, seen.atomics) == (1, 1, 1)
    assert seen.kernels == {"_copy", "_bump"}


@pytest.mark.parametrize(
    "x_off, y_off, match",
    [(1, 0, "a load"), (-1, 0, "a load"), (0, 1, "a store")],
    ids=["a read past the end", "a read before the start", "a write past the end"],
)
def test_an_access_one_element_outside_is_caught(x_off, y_off, match):
    x, y = torch.arange(8.0), torch.empty(8)
    raises_out_of_bounds(lambda: _copy[(1,)](x, y, x_off, y_off, 8, BLOCK=16), match)


def test_an_atomic_past_the_end_is_caught():
    x = torch.zeros(8)
    raises_out_of_bounds(lambda: _bump[(1,)](x, 1, 8, BLOCK=16), "an atomic")


def test_a_read_straddling_two_views_of_one_buffer_is_caught():
    buf = torch.arange(16.0)
    x, y = buf[:8], buf[8:]  # neighbours: x's elements 4..11 run into y
    raises_out_of_bounds(lambda: _copy[(1,)](x, y, 4, 0, 8, BLOCK=16), "a load")


def test_a_misaligned_word_is_caught():
    x, out = torch.zeros(16, dtype=torch.uint8), torch.empty(2, dtype=torch.int32)
    with reads_within_arguments():
        _read_words[(1,)](x, 4, out)  # bytes 4..11: aligned
    raises_out_of_bounds(lambda: _read_words[(1,)](x, 2, out), "not a multiple of 4")


def at_odd_address(cache):
    """The cache's bytes copied to an odd address (the byte-by-byte reads)."""
    buf = torch.empty(cache.numel() + 1, dtype=torch.uint8)
    return buf[1:].view(cache.shape).copy_(cache)


def batch_with_a_bad_block(preset, d, dtype, odd_cache):
    b = build_batch(preset, REQUESTS, 4, 2, d, 16, dtype, "cpu", seed=d)
    b["block_table"][3, 1] = b["kv_cache"].shape[0] + 5  # never read: request 3 NaN
    if odd_cache:
        b["kv_cache"] = at_odd_address(b["kv_cache"])
    # head-major storage: token stride D, head stride N * D
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
            path="window",
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


@pytest.mark.parametrize(
    "preset, d, dtype, odd_cache",
    [
        ("turboquant_3bit_nc", 128, torch.float16, False),
        ("turboquant_k8v4", 80, torch.bfloat16, True),
    ],
)
def test_a_spread_window_stays_inside_its_tensors(preset, d, dtype, odd_cache):
    """Every request in one window of 3 pieces (plan.spread_pieces): the pieces' and
    the own keys' calls, and the merge of the pieces, whose rows for the request
    without cached keys lie outside the pieces (never read)."""
    b = batch_with_a_bad_block(preset, d, dtype, odd_cache)
    n, hq, _ = b["query"].shape
    prefill = ContinuationPrefill(
        hq, b["key"].shape[1], d, preset=preset, dtype=dtype, block_size=16,
        path="window", backend="triton", spread=3, check_block_table=False,
    )  # fmt: skip
    step = prefill.plan(
        b["block_table"],
        query_start_loc_cpu=b["query_start_loc"],
        seq_lens_cpu=b["seq_lens"],
    )
    assert [u.pieces for u in step.plan.units] == [3]
    kw = {k: v for k, v in b["kwargs"].items() if k != "preset"}
    with reads_within_arguments() as seen:
        out = step.run(b["query"], b["key"], b["value"], b["kv_cache"], **kw)
    assert seen.kernels >= {"_fill_kernel", "_attention_kernel", "_merge_pieces_kernel",
                            "_piece_query_kernel"}  # fmt: skip
    q = b["query_start_loc"]
    assert out[q[3] : q[4]].isnan().all(), f"seed {d}"
    assert torch.isfinite(out[: q[3]]).all(), f"seed {d}"


@pytest.mark.parametrize(
    "preset, d, dtype, odd_cache",
    [
        ("turboquant_3bit_nc", 128, torch.float16, False),
        ("turboquant_k8v4", 80, torch.bfloat16, True),
    ],
)
def test_the_memory_bound_path_stays_inside_its_tensors(preset, d, dtype, odd_cache):
    """Every request with cached tokens through the memory-bound path (its four
    launches: the chunk's call, the rotation, the splits, the combine reading ``out``)
    and the bad-id record, as the plan runs them."""
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
            path="paged",
            backend="triton",
            check_block_table=False,
        )
    kernels = {"_paged_kernel", "_combine_kernel", "_attention_kernel"}
    assert seen.kernels >= kernels | (
        set() if preset.endswith("k8v4") else {"_rotate_kernel"}
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


def test_the_fills_record_of_a_bad_block_id_stays_inside_its_tensors():
    """The fill's atomic record of a bad id (what the GPU path reports), checked too."""
    batch = make_batch([(64, 1), (48, 1)], "turboquant_3bit_nc", seed=7)
    batch.block_table[1, 1] = -3
    cfg = TQConfig.from_preset("turboquant_3bit_nc", 64)
    w = windows((0, 1, 2), (65, 49), 400, torch.device("cpu"))[0]
    k = torch.full((w.rows, 2, 64), float("nan"), dtype=torch.float16)
    v = torch.full_like(k, float("nan"))
    err = torch.full((1,), 2**63 - 1, dtype=torch.int64)
    with reads_within_arguments() as seen:
        fill_window(
            batch.kv_cache,
            batch.block_table,
            cfg,
            batch.kwargs["centroids"],
            batch.kwargs["rotation"],
            batch.key,
            batch.value,
            w,
            0,
            k,
            v,
            err,
        )
    assert seen.atomics > 0 and int(err[0]) == (1 << 32) + 1, "seed 7"


def trimmed(batch):
    """The batch with its cache cut after the last block the table names: a read past
    the blocks in use is a read past the tensor."""
    last = int(batch.block_table.max())
    batch.kv_cache = batch.kv_cache[: last + 1]
    return batch


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 120), st.integers(0, 12)), min_size=1, max_size=4
    ),
    preset=st.sampled_from(list(PRESETS)),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    head_dim=st.sampled_from([32, 64, 48]),
    group=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from([16, 32]),
    layout=st.sampled_from(["v020", "v033"]),
    window=st.integers(1, 200),
    bad=st.integers(0, 2**31 - 1),
    odd_cache=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_batches_stay_inside_their_tensors(
    requests,
    preset,
    dtype,
    head_dim,
    group,
    block_size,
    layout,
    window,
    bad,
    odd_cache,
    seed,
):
    """The window path and the fused prototype, whatever the lengths, window, layout,
    block size, head size and dtype, on a cache that ends at its last block in use,
    with a block id outside the cache (past its end or negative) in one request's
    cached part when any has one."""
    if head_dim == 48 and preset != "turboquant_k8v4":
        head_dim = 64  # MSE keys: powers of two (vLLM's Hadamard)
    batch = trimmed(
        make_batch(
            requests,
            preset,
            dtype,
            head_dim=head_dim,
            num_q_heads=2 * group,
            num_kv_heads=2,
            block_size=block_size,
            layout=layout,
            seed=seed,
        )
    )
    hit = [r for r, (c, _) in enumerate(requests) if c > 0]
    victim = hit[bad % len(hit)] if hit else None
    if victim is not None:  # one of its cached blocks, never read: its rows NaN
        col = (bad // 7) % -(-requests[victim][0] // block_size)
        past = batch.kv_cache.shape[0] + bad % 1000
        batch.block_table[victim, col] = past if bad % 2 else -1 - bad % 5
    if odd_cache:
        batch.kv_cache = at_odd_address(batch.kv_cache)
    q, k, v, cache, bt, qsl, lens = batch.args
    with reads_within_arguments():
        window_out = continuation_prefill_varlen(
            q,
            k,
            v,
            cache,
            bt,
            qsl,
            lens,
            **batch.kwargs,
            window=window,
            backend="triton",
            query_start_loc_cpu=batch.query_start_loc,
            seq_lens_cpu=batch.seq_lens,
            check_block_table=False,
        )
        fused_out = fused_continuation_prefill_varlen(
            q,
            k,
            v,
            cache,
            bt,
            batch.query_start_loc,
            batch.seq_lens,
            **batch.kwargs,
            splits=1 + bad % 3,
            backend="torch",
        )
    for out in (window_out, fused_out):
        for r in range(len(requests)):
            rows = out[batch.query_start_loc[r] : batch.query_start_loc[r + 1]]
            if r == victim:
                assert rows.isnan().all(), f"seed {seed}, request {r}"
            else:
                assert torch.isfinite(rows).all(), f"seed {seed}, request {r}"
