"""GPU suite (``pytest -m gpu``): long contexts, batches with FlashAttention, flat
memory, no host-device synchronization, and real vLLM kernels.

Runs on the H200 machine; CI (no GPU) skips it. The vLLM tests need vLLM importable
(there: ``source .gpu-carry/setup.sh``, see benchmarks/run_on_device.sh).
"""

import pytest
import torch
from test_promises import (
    INF,
    NONFINITE_CASES,
    REQUESTS,
    WINDOW,
    check_a_row_of_minus_inf_scores,
    check_against_oracle,
    poison,
)

from tq_chunked import (
    PRESETS,
    ContinuationPrefill,
    continuation_prefill,
    continuation_prefill_varlen,
    default_window,
    workspace_bytes,
)
from tq_chunked.runtime.attention import BACKENDS, backend_available
from tq_chunked.runtime.format import TQConfig, encode_reference, unpack_bits
from tq_chunked.tools.reference import (
    full_buffer_continuation_prefill,
    oracle_continuation_prefill,
)
from tq_chunked.tools.testing import build_batch, build_case, make_batch, rel_err
from tq_chunked.tools.vllm_harness import (
    build_vllm_tq,
    vllm_available,
    vllm_continuation_prefill,
    vllm_store,
)

pytestmark = pytest.mark.gpu
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not importable")


def _backends(d=128):
    dev = torch.device("cuda")
    return [b for b in BACKENDS if b != "torch" and backend_available(b, dev, d)[0]]


@pytest.mark.parametrize("cached_len", [8192, 32768, 131072])
@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k8v4"])
def test_long_context_matches_full_buffer(preset, cached_len):
    args, kwargs = build_case(
        preset, cached_len, 512, 32, 8, 128, 16, torch.float16, "cuda", seed=cached_len
    )
    oracle = oracle_continuation_prefill(*args, **kwargs)
    e_full = rel_err(full_buffer_continuation_prefill(*args, **kwargs), oracle)
    for backend in _backends():
        out = continuation_prefill(*args, **kwargs, backend=backend)
        e = rel_err(out, oracle)
        print(
            f"{preset} cached {cached_len} {backend}: chunked {e:.3e}, "
            f"full {e_full:.3e}"
        )
        assert e <= 1.1 * e_full + 1e-4, (backend, e, e_full)


BATCH = [
    (3000, 700),
    (0, 512),
    (5000, 16),
    (0, 0),
    (12000, 1),
    (700, 3),
    (20000, 300),
    (100, 0),
]


def _request_errors(b, out, backend, min_q_len):
    """(request, cached, q_len, error of out, error of the full-buffer path), both
    against the float64 oracle, for each request of BATCH with at least min_q_len query
    tokens."""
    qsl = b["query_start_loc"]
    for r, (cached, q_len) in enumerate(BATCH):
        if q_len < min_q_len:
            continue
        rows = slice(qsl[r], qsl[r + 1])
        args = (
            b["query"][rows],
            b["key"][rows],
            b["value"][rows],
            b["kv_cache"],
            b["block_table"][r],
            cached,
        )
        oracle = oracle_continuation_prefill(*args, **b["kwargs"])
        e_full = rel_err(
            full_buffer_continuation_prefill(*args, **b["kwargs"], backend=backend),
            oracle,
        )
        yield r, cached, q_len, rel_err(out[rows], oracle), e_full


@pytest.mark.parametrize(
    "preset,head_dim",
    [
        ("turboquant_3bit_nc", 128),
        ("turboquant_4bit_nc", 64),
        ("turboquant_k8v4", 96),
        ("turboquant_k3v4_nc", 256),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batch_matches_each_requests_full_buffer(preset, head_dim, dtype):
    """First chunks, short and long continuations in one call, windows across
    requests."""
    b = build_batch(preset, BATCH, 16, 4, head_dim, 16, dtype, "cuda", seed=head_dim)
    qsl, lens = b["query_start_loc"], b["seq_lens"]
    for backend in _backends(head_dim):
        out = continuation_prefill_varlen(
            b["query"],
            b["key"],
            b["value"],
            b["kv_cache"],
            b["block_table"],
            None,
            None,
            **b["kwargs"],
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
            window=4096,
            backend=backend,
        )
        for r, cached, q_len, e, e_full in _request_errors(
            b, out, backend, min_q_len=1
        ):
            factor = 1.1 if q_len >= 4 else 1.6  # see tests/test_varlen.py
            print(
                f"{preset} D{head_dim} {dtype} {backend} request {r} "
                f"({cached}, {q_len}): {e:.3e} full {e_full:.3e}"
            )
            assert e <= factor * e_full + 1e-4, (backend, r, e, e_full)


@pytest.mark.parametrize("budget", ["all heads", "groups"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_requests_and_kv_head_groups_with_flash_attention(budget, dtype):
    """Requests longer than a window (part windows, the last one with the chunk,
    merged), all kv heads at once or one at a time (head-sliced, non-contiguous inputs
    to FA)."""
    b = build_batch("turboquant_4bit_nc", BATCH, 16, 4, 128, 16, dtype, "cuda", seed=41)
    max_bytes = None if budget == "all heads" else 1
    for backend in _backends():
        out, lse = continuation_prefill_varlen(
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
            window=4096,
            backend=backend,
            max_workspace_bytes=max_bytes,
            return_lse=True,
        )
        for r, _, _, e, e_full in _request_errors(b, out, backend, min_q_len=4):
            assert e <= 1.1 * e_full + 1e-4, (budget, dtype, backend, r, e, e_full)
        assert torch.isfinite(lse).all()


@pytest.mark.parametrize("check", [True, False])
def test_no_host_device_synchronization(check):
    """With the host copies of the lengths, a call (which plans its step, then runs
    it), the block-id check included, never synchronizes (torch's sync debug mode), and
    in steady state calls no CUDA runtime function that synchronizes or allocates
    (profiler)."""
    b = build_batch(
        "turboquant_3bit_nc",
        [(20000, 300), (0, 64), (9000, 16), (500, 40)],
        32,
        8,
        128,
        16,
        torch.float16,
        "cuda",
        seed=3,
    )
    args = (
        b["query"],
        b["key"],
        b["value"],
        b["kv_cache"],
        b["block_table"],
        None,
        None,
    )
    ws = torch.empty(
        workspace_bytes(420, 32, 8, 128, 8192), dtype=torch.uint8, device="cuda"
    )
    call = lambda lens: continuation_prefill_varlen(
        *args,
        **b["kwargs"],
        query_start_loc_cpu=b["query_start_loc"],
        seq_lens_cpu=lens,
        window=8192,
        workspace=ws,
        check_block_table=check,
    )
    ref = call(b["seq_lens"])  # compiles the kernels
    call(b["seq_lens"])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(b["seq_lens"])
        # other lengths: one more cached token each
        out = call([s + 1 if s > 64 else s for s in b["seq_lens"]])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all() and not torch.equal(out, ref)
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[
            torch.profiler.ProfilerActivity.CPU,
            torch.profiler.ProfilerActivity.CUDA,
        ]
    ) as prof:
        for _ in range(3):
            call(b["seq_lens"])
        torch.cuda.synchronize()
    runtime = [
        e.name
        for e in prof.events()
        if e.name.startswith("cuda") and e.name != "cudaDeviceSynchronize"
    ]
    print(check, sorted(set(runtime)))
    forbidden = [
        n
        for n in runtime
        if "Synchronize" in n or "Malloc" in n or n in ("cudaMemcpy", "cudaFree")
    ]
    assert not forbidden, forbidden


def _runtime_calls(fn, times):
    """The CUDA runtime functions ``fn`` calls over ``times`` calls (profiler)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[
            torch.profiler.ProfilerActivity.CPU,
            torch.profiler.ProfilerActivity.CUDA,
        ]
    ) as prof:
        for _ in range(times):
            fn()
        torch.cuda.synchronize()
    return [
        e.name
        for e in prof.events()
        if e.name.startswith("cuda") and e.name != "cudaDeviceSynchronize"
    ]


# (cached, q_len) at Hq / Hk = 32 / 8: windows (a long request, a first chunk, 80 and
# 160 rows a kv head: above the second band's 64), and the memory-bound path (4-32 rows
# a kv head) with a first chunk in a window between its two paged runs
@pytest.fixture
def any_cached_length(monkeypatch):
    """Small batches on the memory-bound path: "auto" takes it for runs of any cached
    length (its threshold is tested in test_dispatch.py)."""
    from tq_chunked.runtime import plan

    monkeypatch.setattr(plan, "PAGED_MIN_CACHED", 1)


STEPS = {
    "windows": [(20000, 300), (0, 64), (9000, 20), (500, 40)],
    "memory-bound": [(9000, 1), (20000, 4), (0, 6), (500, 2), (3000, 8)],
    # 48-64 rows a kv head: the 64-row tile (paged.TILE64_LAUNCH, NOTES.md §63)
    # (two parts of PAGED_MIN_PART cached tokens or more, so "auto" keeps them paged)
    "memory-bound-64": [(30000, 16), (20000, 12), (0, 6), (40000, 16)],
    # 48 blocks over 28K cached keys: spread (plan.spread_pieces, spread_for_step),
    # its copy and merge in the run
    "spread": [(28000, 96), (4000, 70)],
}
# each step's window: the spread one's holds both requests and room for its pieces
SIZES = {"spread": dict(window=65536, max_workspace_bytes=256 << 20)}


@pytest.mark.parametrize("requests", list(STEPS))
@pytest.mark.parametrize("check", [True, False])
def test_a_step_is_planned_without_a_sync_and_run_per_layer_without_sync_or_malloc(
    check, requests, any_cached_length
):
    """The engine's path: ``ContinuationPrefill.plan`` once per step never
    synchronizes (sync debug mode), ``Step.run`` per layer neither synchronizes nor
    allocates device memory (profiler: no cudaMalloc, no synchronizing call, and the
    allocator's reserved bytes unchanged), and every layer's answer is the one call's
    (``continuation_prefill_varlen``) bit for bit; on both paths."""
    from tq_chunked.runtime.plan import PagedRun

    b = build_batch(
        "turboquant_3bit_nc",
        STEPS[requests],
        32,
        8,
        128,
        16,
        torch.float16,
        "cuda",
        seed=3,
    )
    kw = b["kwargs"]
    prefill = ContinuationPrefill(
        32,
        8,
        128,
        preset="turboquant_3bit_nc",
        block_size=16,
        **SIZES.get(requests, dict(window=8192)),
        check_block_table=check,
    )
    n = b["query"].shape[0]
    ws = torch.empty(prefill.workspace_bytes(n), dtype=torch.uint8, device="cuda")
    layer = (b["query"], b["key"], b["value"], b["kv_cache"])
    out = torch.empty_like(b["query"])
    plan = lambda lens: prefill.plan(
        b["block_table"],
        query_start_loc_cpu=b["query_start_loc"],
        seq_lens_cpu=lens,
        workspace=ws,
    )
    run = lambda step: step.run(
        *layer,
        centroids=kw["centroids"],
        rotation=kw["rotation"],
        scale=kw["scale"],
        out=out,
    )
    run(plan(b["seq_lens"]))  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = plan(b["seq_lens"])
        run(step)
        other = plan([s + 1 if s > 64 else s for s in b["seq_lens"]])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    runs = [u for u in step.plan.units if isinstance(u, PagedRun)]
    assert bool(runs) == requests.startswith("memory-bound")
    if requests == "memory-bound-64":
        assert {u.paged.block_m for u in runs} == {64}
    # "auto" spreads with FlashAttention-3 only (prefill.ContinuationPrefill._spread)
    spread = [u for u in step.plan.units if getattr(u, "pieces", 1) > 1]
    assert bool(spread) == (requests == "spread" and step.backend == "flash")
    ref = continuation_prefill_varlen(
        *layer,
        b["block_table"],
        None,
        None,
        **kw,
        query_start_loc_cpu=b["query_start_loc"],
        seq_lens_cpu=b["seq_lens"],
        **SIZES.get(requests, dict(window=8192)),
        workspace=torch.empty_like(ws),
        check_block_table=check,
    )
    run(step)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    reserved = torch.cuda.memory_reserved()
    runtime = _runtime_calls(lambda: run(step), 4)
    assert torch.cuda.memory_reserved() == reserved
    print(check, sorted(set(runtime)))
    forbidden = [
        n
        for n in runtime
        if "Synchronize" in n or "Malloc" in n or n in ("cudaMemcpy", "cudaFree")
    ]
    assert not forbidden, forbidden
    run(other)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and not torch.equal(out, ref)


@pytest.mark.parametrize("requests", [[(9000, 20), (500, 40)], [(9000, 1), (500, 4)]])
def test_a_step_run_on_another_stream_waits_for_its_plan(requests, any_cached_length):
    """A step planned on one stream and run on another gives the same bits: the run's
    stream waits for the plan's upload (the integers are not yet there when the plan's
    stream is kept busy); windows, then the memory-bound path."""
    b = build_batch(
        "turboquant_3bit_nc", requests, 32, 8, 128, 16, torch.float16, "cuda", seed=5,
    )  # fmt: skip
    kw = b["kwargs"]
    prefill = ContinuationPrefill(
        32, 8, 128, preset="turboquant_3bit_nc", block_size=16, window=4096
    )
    layer = (b["query"], b["key"], b["value"], b["kv_cache"])
    tensors = dict(
        centroids=kw["centroids"], rotation=kw["rotation"], scale=kw["scale"]
    )
    plan = lambda: prefill.plan(
        b["block_table"],
        query_start_loc_cpu=b["query_start_loc"],
        seq_lens_cpu=b["seq_lens"],
    )
    from tq_chunked.runtime.plan import PagedRun

    ref = plan().run(*layer, **tensors)
    paged = any(isinstance(u, PagedRun) for u in plan().plan.units)
    assert paged == (requests[0][1] == 1)  # the second case: the memory-bound path
    side = torch.cuda.Stream()
    torch.cuda._sleep(50_000_000)  # the plan's stream busy: its upload waits behind
    step = plan()
    with torch.cuda.stream(side):
        out = step.run(*layer, **tensors)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("q_lens", [(64, 32), (2, 1)], ids=["windows", "memory-bound"])
def test_a_bad_block_id_is_reported_at_the_next_call_and_its_request_is_nan(
    q_lens, any_cached_length
):
    from tq_chunked import check_block_tables

    b = build_batch(
        "turboquant_3bit_nc",
        [(3000, q_lens[0]), (2000, q_lens[1])],
        16,
        4,
        128,
        16,
        torch.float16,
        "cuda",
        seed=5,
    )
    bt = b["block_table"].clone()
    bt[1, 7] = 10**6
    call = lambda table: continuation_prefill_varlen(
        b["query"],
        b["key"],
        b["value"],
        b["kv_cache"],
        table,
        None,
        None,
        **b["kwargs"],
        query_start_loc_cpu=b["query_start_loc"],
        seq_lens_cpu=b["seq_lens"],
    )
    from tq_chunked.runtime.plan import PagedRun

    step = ContinuationPrefill(
        16, 4, 128, preset="turboquant_3bit_nc", block_size=16
    ).plan(bt, query_start_loc_cpu=b["query_start_loc"], seq_lens_cpu=b["seq_lens"])
    paged = any(isinstance(u, PagedRun) for u in step.plan.units)
    assert paged == (q_lens == (2, 1))
    out = call(bt)
    q0 = q_lens[0]
    assert out[q0:].isnan().all() and torch.isfinite(out[:q0]).all()
    with pytest.raises(ValueError, match=r"block_table\[1, 7\]"):
        check_block_tables()
    call(b["block_table"])
    check_block_tables()  # reported once, then clear


def test_a_step_refuses_to_run_inside_cuda_graph_capture(any_cached_length):
    """Its windows and splits are drawn on the host from each step's lengths: a
    captured run would replay another step's, so run() refuses capture by name."""
    b = build_batch(
        "turboquant_3bit_nc", [(3000, 2), (500, 40)], 32, 8, 128, 16, torch.float16,
        "cuda", seed=9,
    )  # fmt: skip
    kw = b["kwargs"]
    step = ContinuationPrefill(
        32, 8, 128, preset="turboquant_3bit_nc", block_size=16
    ).plan(
        b["block_table"],
        query_start_loc_cpu=b["query_start_loc"],
        seq_lens_cpu=b["seq_lens"],
    )
    layer = (b["query"], b["key"], b["value"], b["kv_cache"])
    tensors = dict(
        centroids=kw["centroids"], rotation=kw["rotation"], scale=kw["scale"]
    )
    out = torch.empty_like(b["query"])
    step.run(*layer, **tensors, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(ValueError, match="cannot run inside CUDA graph capture"),
        torch.cuda.graph(graph),
    ):
        step.run(*layer, **tensors, out=out)


def test_peak_memory_is_output_plus_workspace():
    """Beyond the output and the workspace (workspace_bytes), a call allocates at most
    8 MiB (FlashAttention's log-sum-exp and scheduler metadata), over batches of
    several kinds; and the workspace is flat in the cached length and the batch size."""
    batches = {
        "1 x 32K q2048": [(32768, 2048)],
        "1 x 128K q2048": [(131072, 2048)],
        "16 x 8K q128": [(8192, 128)] * 16,
        "24 hits q384": [(512 + 240 * i, 384) for i in range(24)],
        "first chunks + hits": [(0, 2048), (0, 1024)] + [(4096, 256)] * 8,
        "32 hits q16": [(1024 + 200 * i, 16) for i in range(32)],
    }
    extra = {}
    for name, requests in batches.items():
        b = build_batch(
            "turboquant_3bit_nc", requests, 32, 8, 128, 16, torch.float16, "cuda"
        )
        n = b["query"].shape[0]
        ws = torch.empty(
            workspace_bytes(n, 32, 8, 128, default_window(8, 128, 16)),
            dtype=torch.uint8,
            device="cuda",
        )

        def call(b=b, ws=ws):
            return continuation_prefill_varlen(
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
                workspace=ws,
            )

        call()  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = call()
        torch.cuda.synchronize()
        extra[name] = (
            torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
        ) / 2**20
        del out, b, ws, call
    print({k: f"{v:.2f} MiB" for k, v in extra.items()})
    assert all(v <= 8 for v in extra.values()), extra


def test_one_million_cached_tokens():
    """One request of 64 query tokens over 1M cached (k8v4): within the full path's
    error, in the workspace ``workspace_bytes`` gives the call (the default budget of
    128 MiB, flat in the cached length: the long request's window fills it, NOTES.md
    §21), the output, and up to 8 MiB besides (FlashAttention's log-sum-exp and
    scheduler metadata, the step's device integers: 0.9 MiB on the H200 machine)."""
    args, kwargs = build_case(
        "turboquant_k8v4", 1 << 20, 64, 32, 8, 128, 16, torch.float16, "cuda", seed=9
    )
    ws = workspace_bytes(64, 32, 8, 128, default_window(8, 128, 16)) / 2**20
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = continuation_prefill(*args, **kwargs)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    beyond = peak - ws - out.numel() * out.element_size() / 2**20
    oracle = oracle_continuation_prefill(*args, **kwargs)
    e_full = rel_err(full_buffer_continuation_prefill(*args, **kwargs), oracle)
    e = rel_err(out, oracle)
    print(
        f"1M cached, q 64: chunked {e:.3e}, full {e_full:.3e}, peak extra {peak:.1f} "
        f"MiB (workspace {ws:.1f}, beyond it and the output {beyond:.2f})"
    )
    assert e <= 1.1 * e_full + 1e-4
    assert ws <= 128 and beyond <= 8


@pytest.mark.parametrize("where,value,token", NONFINITE_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_non_finite_values_propagate_with_flash_attention(where, value, token, dtype):
    """tests/test_promises.py's cases with FlashAttention (num_splits=1, its NaN
    marks)."""
    if "flash" not in _backends(64):
        pytest.skip("FlashAttention is not available")
    seed = 31 + len(where) + token
    batch = make_batch(
        REQUESTS,
        "turboquant_3bit_nc",
        dtype,
        num_q_heads=4,
        num_kv_heads=2,
        seed=seed,
        device="cuda",
    )
    batch.query.mul_(0.2)
    allowed = poison(batch, where, value, token)
    q, k, v, cache, bt, qsl, lens = batch.args
    out = continuation_prefill_varlen(
        q,
        k,
        v,
        cache,
        bt,
        qsl,
        lens,
        **batch.kwargs,
        window=WINDOW,
        backend="flash",
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
    )
    check_against_oracle(batch, out, allowed)


@pytest.mark.parametrize("path", ["window", "paged"])
def test_a_row_of_minus_inf_scores_with_flash_attention(path):
    """tests/test_promises.py's row whose every score is -inf, with FlashAttention (the
    window path's causal call; the paged path's kernels, its own keys in the
    combine): a zero row, as docs/design.md's third exception says; lse -inf, or on
    the window path FlashAttention's own mark, +inf or -inf by release (attention.py),
    which the call returns as FlashAttention wrote it."""
    if "flash" not in _backends(64):
        pytest.skip("FlashAttention is not available")
    marks = (-INF, INF) if path == "window" else (-INF,)
    check_a_row_of_minus_inf_scores(path, "flash", "cuda", marks)


@pytest.mark.parametrize(
    "preset,head_dim",
    [
        ("turboquant_3bit_nc", 64),
        ("turboquant_4bit_nc", 128),
        ("turboquant_k3v4_nc", 256),
        ("turboquant_3bit_nc", 128),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rotation", ["random", "hadamard"])
def test_unrotation_on_tensor_cores_is_within_half_an_fp16_ulp(
    preset, head_dim, dtype, rotation
):
    """tests/test_dequant.py's bound, on the H200's tensor cores (fp16 MMA, float32
    sums): two dots for a random rotation, one with the signs for vLLM's Hadamard."""
    from test_dequant import check

    batch = make_batch(
        [(700, 1), (0, 3), (550, 2), (400, 1)],
        preset,
        dtype,
        head_dim=head_dim,
        num_q_heads=2,
        num_kv_heads=2,
        seed=head_dim,
        device="cuda",
        rotation=rotation,
    )
    check(batch, 480, unrotate=True, dtype=dtype, tag=f"seed {head_dim}")


def test_kernels_launch_through_the_direct_launcher():
    """After the first launch of a specialization, the compiled kernel is called
    directly."""
    from tq_chunked.runtime._utils import Launcher
    from tq_chunked.runtime.dequant import launch_fill
    from tq_chunked.runtime.merge import launch_merge

    b = build_batch(
        "turboquant_3bit_nc",
        [(30000, 300), (2000, 40)],
        32,
        8,
        128,
        16,
        torch.float16,
        "cuda",
        seed=7,
    )
    call = lambda: continuation_prefill_varlen(
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
        window=8192,
    )
    first = call()
    second = call()
    assert Launcher.direct is not None
    assert launch_fill.compiled and launch_merge.compiled
    assert torch.equal(first, second)


def _vllm_cache(tq, preset, total, layout, block_size=16, hk=8, d=128, seed=0):
    """A cache written by vLLM's own store kernel. vLLM 0.20's store needs its own
    contiguous layout; for 0.33's head-major layout the bytes are then copied into a
    (num_blocks, Hk, block_size, slot) buffer and its transpose(1, 2) view returned."""
    gen = torch.Generator("cuda").manual_seed(seed)
    cfg = TQConfig.from_preset(preset, d)
    nb = -(-total // block_size) + 2
    cache = torch.zeros(
        nb, block_size, hk, cfg.slot_bytes, dtype=torch.uint8, device="cuda"
    )
    bt = torch.randperm(nb, generator=gen, device="cuda").int()[None]
    pos = torch.arange(total, device="cuda")
    slots = bt[0].long()[pos // block_size] * block_size + pos % block_size
    key = (
        torch.randn(total, hk, d, generator=gen, device="cuda", dtype=torch.float16)
        * 1.5
    )
    val = torch.randn(total, hk, d, generator=gen, device="cuda", dtype=torch.float16)
    vllm_store(tq, key, val, cache, slots)
    if layout == "v033":
        cache = cache.transpose(1, 2).contiguous().transpose(1, 2)
    return cache, bt, slots, key, val


@needs_vllm
@pytest.mark.parametrize("preset", list(PRESETS))
def test_encoder_agrees_with_vllm_store(preset):
    """Keys (indices, norms, fp8 bytes) and value scale/zero are byte-exact. Value
    indices may differ by one where (v - min) / scale + 0.5 lies on a rounding boundary:
    vLLM's Triton store divides with an approximate fp32 division, this encoder with an
    exact one. Such an index is off by one step either way; the test checks that every
    difference is exactly such a boundary case."""
    cfg = TQConfig.from_preset(preset, 128)
    tq = build_vllm_tq(preset, 32, 8, 128)
    cache, bt, slots, key, val = _vllm_cache(tq, preset, 8192, "v020")
    ours = torch.zeros_like(cache)
    encode_reference(key, val, ours, slots, cfg, tq.centroids, tq.rotation)
    blk, pos = slots // 16, slots % 16
    theirs_s, ours_s = cache[blk, pos], ours[blk, pos]  # (N, Hk, slot)
    kb, vi = cfg.key_bytes, cfg.key_bytes + cfg.value_index_bytes
    assert torch.equal(theirs_s[..., :kb], ours_s[..., :kb]), "key bytes differ"
    assert torch.equal(theirs_s[..., vi:], ours_s[..., vi:]), (
        "value scale/zero bytes differ"
    )
    ia = unpack_bits(theirs_s[..., kb:vi], cfg.value_bits, 128)
    ib = unpack_bits(ours_s[..., kb:vi], cfg.value_bits, 128)
    differ = ia != ib
    v = val.float()
    vmin, vmax = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    x = (v - vmin) / ((vmax - vmin) / (2**cfg.value_bits - 1)).clamp(min=1e-8) + 0.5
    boundary = (x - x.round()).abs() < 1e-5 * x.abs().clamp(min=1)
    print(
        f"{preset}: {differ.sum().item()} of {differ.numel()} value indices differ, "
        f"all by one at a boundary"
    )
    assert ((ia - ib).abs() <= 1).all() and (boundary | ~differ).all()
    assert differ.float().mean().item() < 1e-4


@needs_vllm
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("layout", ["v020", "v033"])
def test_answer_agrees_with_vllm_continuation_prefill(preset, layout):
    tq = build_vllm_tq(preset, 32, 8, 128)
    cached, q_len = 8192, 1024
    cache, bt, _, key, val = _vllm_cache(tq, preset, cached + q_len, layout, seed=1)
    q = torch.randn(q_len, 32, 128, device="cuda", dtype=torch.float16) * 1.5
    args = (q, key[cached:], val[cached:], cache, bt, cached)
    kwargs = dict(
        preset=preset, centroids=tq.centroids, rotation=tq.rotation, scale=128**-0.5
    )
    theirs = vllm_continuation_prefill(tq, *args)
    oracle = oracle_continuation_prefill(*args, **kwargs)
    e_vllm = rel_err(theirs, oracle)
    for backend in _backends():
        ours = continuation_prefill(*args, **kwargs, backend=backend)
        e = rel_err(ours, oracle)
        apart = rel_err(ours, theirs.double())
        print(
            f"{preset} {layout} {backend}: chunked {e:.3e}, vLLM {e_vllm:.3e}, "
            f"apart {apart:.3e}"
        )
        assert e <= 1.1 * e_vllm + 1e-4, (backend, e, e_vllm)


def _forward_script():
    import importlib.util
    import os

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "benchmarks",
        "vllm_forward.py",
    )
    spec = importlib.util.spec_from_file_location("vllm_forward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_vllm
def test_vllm_forward_with_the_plugin_keeps_every_prefix_hit_exact():
    """The real vLLM forward on a batch where a first chunk is the longest request
    (vllm-project/vllm issue 46460): unpatched, the prefix hits lose their cached
    prefix; patched, every request is within the criterion; decodes are vLLM's own
    rows."""
    result = {}
    _forward_script().scenario_46460(result)
    r = result["issue_46460"]
    for u, p in zip(r["unpatched"], r["patched"]):
        print(
            f"request {u['request']} (cached {u['cached']}, q {u['q_len']}): "
            f"unpatched {u['error']:.2e}, patched {p['error']:.2e}, "
            f"full {p['full_error']:.2e}"
        )
        if p["request"] < 2:
            # the two decodes: vLLM's own kernel, the same rows patched or not
            assert p["error"] == u["error"]
        else:
            assert p["error"] <= 1.1 * p["full_error"] + 1e-4
    # the prefix hits lost their prefix
    assert all(u["error"] > 0.1 for u in r["unpatched"][3:])
