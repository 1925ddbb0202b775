"""Where the host time of one continuation_prefill_varlen call goes (GPU).

    python benchmarks/host_profile.py [--run | --paged | --plan]

For a single request (Hq 32, Hk 8, q 512, 8K cached: one window), a long one (q 2048,
128K: 6 windows) and a batch of 16 prefix-cache hits: the host time per call with the
GPU kept busy (so the host never waits), per window, each piece of the call timed alone
the same way (a Triton launch through Triton's own path and through the project's
launcher), and a cProfile of 30 calls (top functions by own time).

With --run: the per-layer ``Step.run`` of a plan made once (issue 34's target), for 16
prefix-cache hits (q 64 over 1K-2K cached) in 1 and in 8 windows: its host time per
layer with the GPU kept busy, and a cProfile of 32 layers x 10 (top functions by own
time, then by cumulative time).

With --plan: where the host time of a step's plan goes (``ContinuationPrefill.plan``
on the memory-bound path): --paged's decodes and 32 decodes beside 16 requests of 40
rows a kv head (two paged runs, NOTES.md §59), its host time with the GPU kept busy and
a cProfile of 200 plans (top functions by own time, then by cumulative time).

With --paged: the same for three decode batches of the memory-bound grid
(``testing.memory_bound_workloads``: 64 x 1K-8K, 256 x 1K-4K k8v4 bf16, 128 x 4K-8K
d64), each planned onto the memory-bound path, and the host time of the step's plan
(``ContinuationPrefill.plan``) beside the run's (benchmarks/NOTES.md §49); and the run's
host time with the chunk's own keys in the combine (``PagedPlan.own_keys``) against a
causal call for them, alternating in one process (NOTES.md §50).
"""

import cProfile
import functools
import inspect
import pstats
import statistics
import sys
import time

import torch

from tq_chunked import ContinuationPrefill, continuation_prefill_varlen, workspace_bytes
from tq_chunked.runtime import dequant, paged
from tq_chunked.runtime._utils import byte_span, check_overlaps
from tq_chunked.runtime.attention import varlen_attention
from tq_chunked.runtime.dequant import fill_window, split_rotation
from tq_chunked.runtime.format import TQConfig
from tq_chunked.runtime.plan import LongRequest, PagedRun, default_window, make_plan
from tq_chunked.runtime.workspace import carve
from tq_chunked.tools.testing import SHAPES, build_batch, memory_bound_workloads


def host_us(fn, n=200):
    """Median host microseconds of fn() with the GPU busy (a spin kernel ahead of
    it)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        torch.cuda._sleep(4_000_000)  # ~2 ms of GPU work ahead of the call
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def profiled(fn, calls, rounds, spin_cycles):
    """The profile (cProfile) of ``rounds`` x ``calls`` calls of fn, each round behind
    a spin kernel of ``spin_cycles`` (so that the host never waits for the GPU)."""
    prof = cProfile.Profile()
    for _ in range(rounds):
        torch.cuda._sleep(spin_cycles)
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
    return pstats.Stats(prof)


CASES = [
    ("1 hit q512 8K", [(8192, 512)]),
    ("1 hit q2048 128K", [(131072, 2048)]),
    ("16 hits q256 1K-8K", [(1024 + 448 * i, 256) for i in range(16)]),
]


# --paged's batches, by name in testing.memory_bound_workloads()
PAGED_CASES = (
    "decode 64 x 1K-8K",
    "decode 256 x 1K-4K k8v4 bf16",
    "decode 128 x 4K-8K d64 k3v4",
)


# --plan's batch beside --paged's: decodes, then 40-row requests (two paged runs)
MIXED_CASE = ("32 decodes + 16 x q10 8K", [(8192, 1)] * 32 + [(8192, 10)] * 16)


def main():
    if "--plan" in sys.argv[1:]:
        grid = {w.name: w for w in memory_bound_workloads()}
        for name in PAGED_CASES:
            w = grid[name]
            profile_plan(name, w.requests, w.preset, SHAPES[w.shape], w.dtype)
        profile_plan(*MIXED_CASE)
        return
    if "--paged" in sys.argv[1:]:
        grid = {w.name: w for w in memory_bound_workloads()}
        for name in PAGED_CASES:
            w = grid[name]
            hq, hk, d = SHAPES[w.shape]
            profile_run(name, w.requests, None, w.preset, (hq, hk, d), w.dtype)
        return
    if "--run" in sys.argv[1:]:
        reqs = [(1024 + 64 * i, 64) for i in range(16)]
        need = sum(c + q for c, q in reqs) + 256 * 15
        for parts in (1, 8):
            profile_run(f"16 hits q64 1-2K, {parts} windows", reqs,
                        -(-need // parts) // 16 * 16 + 16)  # fmt: skip
        return
    for name, requests in CASES:
        profile_case(name, requests)


def layer_call(step, b, out):
    """One layer's run of ``step`` over batch ``b`` (build_batch's), into ``out``: a
    call of no arguments."""
    kw = b["kwargs"]
    return functools.partial(
        step.run, b["query"], b["key"], b["value"], b["kv_cache"],
        centroids=kw["centroids"], rotation=kw["rotation"], scale=kw["scale"], out=out,
    )  # fmt: skip


def planner(requests, window=None, preset="turboquant_3bit_nc", heads=(32, 8, 128),
            dtype="float16"):  # fmt: skip
    """(batch, plan): ``build_batch``'s batch of these requests on the GPU and a call
    of no arguments that plans a step over it (host lengths, a workspace of the
    step's bytes)."""
    hq, hk, d = heads
    b = build_batch(preset, requests, hq, hk, d, 16, getattr(torch, dtype), "cuda")
    prefill = ContinuationPrefill(
        hq, hk, d, preset=preset, dtype=getattr(torch, dtype), block_size=16,
        window=window, check_block_table=False,
    )  # fmt: skip
    n = b["query"].shape[0]
    ws = torch.empty(prefill.workspace_bytes(n), dtype=torch.uint8, device="cuda")
    lengths = dict(
        query_start_loc_cpu=torch.tensor(b["query_start_loc"], dtype=torch.int32),
        seq_lens_cpu=torch.tensor(b["seq_lens"], dtype=torch.int32),
    )
    return b, functools.partial(prefill.plan, b["block_table"], **lengths, workspace=ws)


def profile_run(name, requests, window, preset="turboquant_3bit_nc",
                heads=(32, 8, 128), dtype="float16"):  # fmt: skip
    """Print the host-time profile of Step.run per layer (see the module's doc); and
    the plan's host time, where the step runs on the memory-bound path."""
    b, plan = planner(requests, window, preset, heads, dtype)
    step = plan()
    if any(isinstance(u, PagedRun) for u in step.plan.units):
        print(f"== {name}: plan() {host_us(plan):.0f} us")
    out = torch.empty_like(b["query"])
    layer = layer_call(step, b, out)
    print(f"== {name}: {len(step.plan.units)} units, run() {host_us(layer):.0f} us")
    own = [u.paged.own_keys for u in step.plan.units if isinstance(u, PagedRun)]
    if any(own):
        # the same step with the chunk's own keys through a causal call and the merge
        # (paged.OWN_KEYS_MAX 0: as before 0.6.7), alternating with this one
        with_limit = paged.OWN_KEYS_MAX
        paged.OWN_KEYS_MAX = 0
        try:
            before = plan()
        finally:
            paged.OWN_KEYS_MAX = with_limit
        layer_before = layer_call(before, b, out)
        ab = {"own keys": [], "chunk call": []}
        for _ in range(5):
            ab["own keys"].append(host_us(layer, n=60))
            ab["chunk call"].append(host_us(layer_before, n=60))
        print(
            f"== {name}: run() own keys {statistics.median(ab['own keys']):.0f} us, "
            f"chunk call {statistics.median(ab['chunk call']):.0f} us (A/B medians)"
        )
    # 10 steps of 32 layers, ~30 ms of GPU work ahead of each
    stats = profiled(layer, calls=32, rounds=10, spin_cycles=60_000_000)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


def profile_plan(name, requests, preset="turboquant_3bit_nc", heads=(32, 8, 128),
                 dtype="float16"):  # fmt: skip
    """Print the plan's host time and its profile (see the module's doc)."""
    _, plan = planner(requests, None, preset, heads, dtype)
    runs = sum(isinstance(u, PagedRun) for u in plan().plan.units)
    print(f"== {name}: {runs} paged runs, plan() {host_us(plan):.0f} us")
    stats = profiled(plan, calls=20, rounds=10, spin_cycles=60_000_000)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


def plugin_call(requests):
    """A batch of these (cached, new) requests (3bit_nc, Hq 32, Hk 8, D 128, fp16) and
    a call over it as the plugin makes it: host copies of the lengths, a caller-owned
    workspace, no block-id check. Returns (batch, workspace, window, call)."""
    b = build_batch(
        "turboquant_3bit_nc", requests, 32, 8, 128, 16, torch.float16, "cuda"
    )
    n = b["query"].shape[0]
    window = default_window(8, 128, 16)
    ws = torch.empty(
        workspace_bytes(n, 32, 8, 128, window), dtype=torch.uint8, device="cuda"
    )
    qsl_cpu = torch.tensor(b["query_start_loc"], dtype=torch.int32)
    lens_cpu = torch.tensor(b["seq_lens"], dtype=torch.int32)
    args = (
        b["query"],
        b["key"],
        b["value"],
        b["kv_cache"],
        b["block_table"],
        qsl_cpu.cuda(),
        lens_cpu.cuda(),
    )

    def call():
        return continuation_prefill_varlen(
            *args,
            **b["kwargs"],
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=lens_cpu,
            window=window,
            workspace=ws,
            check_block_table=False,
        )

    return b, ws, window, call


def profile_case(name, requests):
    """Print the host-time profile of one case (see the module's doc)."""
    launcher = dequant.launch_fill
    b, ws, window, call = plugin_call(requests)
    p = make_plan(
        tuple(b["query_start_loc"]),
        tuple(b["seq_lens"]),
        window=window,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.float16,
        budget=128 << 20,
        device=torch.device("cuda"),
        stream=torch.cuda.current_stream(),
    )
    steps = p.units
    cap = p.capacity
    windows = [
        w for s in steps for w in (s.windows if isinstance(s, LongRequest) else (s,))
    ]
    whole = host_us(call)
    print(
        f"== {name}: whole call {whole:.0f} us host, {len(windows)} windows, "
        f"{whole / len(windows):.0f} us per window"
    )
    cfg = TQConfig.from_preset("turboquant_3bit_nc", 128)
    w = windows[0]
    bufs = carve(ws, ("batch", 0, 32, 8, 128, cap, torch.float16))
    out = torch.empty_like(b["query"])
    q, o = b["query"][w.q0 : w.q1], out[w.q0 : w.q1]
    parts = split_rotation(b["kwargs"]["rotation"], bufs.rot_parts, bufs.rot_flags)
    fill = lambda: fill_window(  # as a call fills a window: the rotation split already
        b["kv_cache"],
        b["block_table"],
        cfg,
        b["kwargs"]["centroids"],
        b["kwargs"]["rotation"],
        b["key"],
        b["value"],
        w,
        0,
        bufs.k_buf,
        bufs.v_buf,
        parts=parts,
    )
    fill()
    # the fill's launch arguments, to launch them through Triton's own path too
    seen = {}
    dequant.launch_fill = lambda grid, *a, **k: seen.update(grid=grid, args=a, opts=k)
    try:
        fill()
    finally:
        dequant.launch_fill = launcher
    pieces = {
        "plan (once per step)": lambda: make_plan(
            tuple(b["query_start_loc"]),
            tuple(b["seq_lens"]),
            window=window,
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=128,
            dtype=torch.float16,
            budget=128 << 20,
            device=torch.device("cuda"),
        ),
        "overlap checks (byte ranges and pairs)": lambda: check_overlaps(
            [("out", byte_span(out)), ("lse", None), ("workspace", byte_span(ws))],
            [
                ("query", byte_span(b["query"])),
                ("key", byte_span(b["key"])),
                ("value", byte_span(b["value"])),
                ("kv_cache", byte_span(b["kv_cache"])),
                ("block_table", byte_span(b["block_table"])),
                ("rotation", byte_span(b["kwargs"]["rotation"])),
                ("centroids", byte_span(b["kwargs"]["centroids"])),
            ],
        ),
        "carve (once per step)": lambda: carve(
            ws, ("batch", 0, 32, 8, 128, cap, torch.float16)
        ),
        "torch.empty_like(query)": lambda: torch.empty_like(b["query"]),
        "fill_window (launcher)": fill,
        "fill kernel (Triton's launch path)": lambda: launcher.kernel[seen["grid"]](
            *seen["args"], **seen["opts"]
        ),
        "the launcher's key (fill)": lambda: _fill_key(launcher, seen),
        "FlashAttention, a window": lambda: varlen_attention(
            w, q, bufs.k_buf, bufs.v_buf, 0.1, o, "flash"
        ),
    }
    for piece, fn in pieces.items():
        print(f"   {piece:36} {host_us(fn):7.1f} us")
    # ~200 ms of GPU work ahead of the 30 calls
    profiled(call, calls=30, rounds=1, spin_cycles=400_000_000).sort_stats(
        "tottime"
    ).print_stats(18)


def _fill_key(launcher, seen):
    """The launcher's cache key of the fill's arguments (0.4.0's key took no device)."""
    options = tuple(sorted(seen["opts"].items()))
    if "device" in inspect.signature(launcher._key).parameters:
        return launcher._key(seen["args"], options, torch.cuda.current_device())
    return launcher._key(seen["args"], options)


if __name__ == "__main__":
    main()
