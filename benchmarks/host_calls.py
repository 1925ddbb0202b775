"""Host time of each layer's call in the bench's engine mode, one call at a time (GPU).

    python benchmarks/host_calls.py OUT_DIR [--workloads "decode 64 x 1K-8K,..."]
        [--methods floor,tq_chunked] [--freeze]

``tq-chunked bench`` reports the mean host time per call over a step's layers; one
slow call (layer 0's, which also plans the step) moves that mean. Here each layer's
call of a workload of ``testing.memory_bound_workloads`` (default: the first decode) is
timed alone behind a spin kernel, as ``bench_engine.measure`` does, for 2 rounds at a
head start of 2 ms and 2 at 10 ms; printed per round: layer 0's host time, the other
layers' median and largest, the mean, the garbage collector's passes that fell in
the round (``gc.callbacks``: generation and ms), and what the round's calls asked of
the allocators (``ALLOCATOR_COUNTS``: new device segments, retries, pinned host
allocations and their us). Then four more rounds with layer 0's call under cProfile
(its time then holds the profiler's): where it takes over 10 ms its twelve slowest
functions by cumulative time and by own time are printed, so that a slow plan names
its cause. Then
the CUDA runtime calls of layers 0 and 1 (profiler) and any synchronization torch's
sync debug mode warns of. With --freeze, the rounds run again after ``gc.collect();
gc.freeze()`` (what vLLM's engine does once it has started), to tell the collector's
share (benchmarks/NOTES.md §50). JSON: host-calls.json in OUT_DIR ("rounds": each
round's per-layer ms and allocator counts).
"""

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import time
import warnings

import torch

from tq_chunked.tools import bench_engine as be
from tq_chunked.tools.testing import SHAPES, memory_bound_workloads
from tq_chunked.tools.vllm_harness import build_vllm_tq

METHODS = {"floor": be.method_floor, "tq_chunked": be.method_tq_chunked}
# What a call can ask of the allocators that takes milliseconds: (stats function, key).
# A device segment is a cudaMalloc (a retry frees the cache first, which synchronizes);
# a pinned host allocation is a cudaHostAlloc (the plan's upload pins its ints). A
# torch without host_memory_stats (before 2.7) reports 0 for the host's.
host_stats = getattr(torch.cuda, "host_memory_stats", dict)
ALLOCATOR_COUNTS = {
    "device segments": (torch.cuda.memory_stats, "num_device_alloc"),
    "device retries": (torch.cuda.memory_stats, "num_alloc_retries"),
    "host allocs": (host_stats, "num_host_alloc"),
    "host alloc us": (host_stats, "host_alloc_time.total"),
}
SLOW_MS = 10.0


def allocator_counts() -> dict:
    return {
        name: stats().get(key, 0) for name, (stats, key) in ALLOCATOR_COUNTS.items()
    }


class GCPauses:
    """The collector's passes while recording: (generation, ms)."""

    def __init__(self):
        self.pauses, self._t0 = [], 0.0
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._t0) * 1e3
            self.pauses.append((info["generation"], round(ms, 2)))


def rounds(fs, cycles, collector, label, out, profile=False):
    """Four rounds of the layers' calls, each behind a spin kernel; with ``profile``,
    layer 0's call under cProfile (its time then holds the profiler's)."""
    for head in (2.0, 2.0, 10.0, 10.0):
        collector.pauses.clear()
        host, before = [], allocator_counts()
        prof = cProfile.Profile()
        for i, f in enumerate(fs):
            torch.cuda._sleep(int(head * cycles))
            t0 = time.perf_counter()
            if i == 0 and profile:
                prof.runcall(f)
            else:
                f()
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        after = allocator_counts()
        asked = {k: round(after[k] - before[k], 3) for k in after}
        print(
            f"{label}, head start {head:g} ms: layer 0 {host[0]:.3f} ms, others "
            f"median {statistics.median(host[1:]):.3f} max {max(host[1:]):.3f}, mean "
            f"{statistics.mean(host):.3f}; gc passes {collector.pauses}; allocators "
            f"{asked}",
            flush=True,
        )
        if profile and host[0] > SLOW_MS:
            text = io.StringIO()
            # the path down (cumulative), then where the time is spent (own time)
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("cumulative").print_stats(12)
            stats.sort_stats("tottime").print_stats(12)
            print(text.getvalue().strip(), flush=True)
        out.append(dict(label=label, head_ms=head, host_ms=host,
                        gc=list(collector.pauses), allocators=asked))  # fmt: skip


def runtime_calls(fs, cycles):
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        torch.cuda._sleep(int(5 * cycles))
        fs[0]()
        fs[1]()
        torch.cuda.synchronize()
    calls = sorted({e.name for e in prof.events() if e.name.startswith("cu")})
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fs[0]()
        fs[1]()
    torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message)[:160] for w in seen if "ynchroniz" in str(w.message)]
    return calls, syncs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--workloads", default="decode 64 x 1K-8K")
    ap.add_argument("--methods", default="floor,tq_chunked")
    ap.add_argument("--freeze", action="store_true")
    a = ap.parse_args()
    grid = {w.name: w for w in memory_bound_workloads()}
    names = a.workloads.split(",")
    unknown = [n for n in names if n not in grid] + [
        m for m in a.methods.split(",") if m not in METHODS
    ]
    if unknown:
        ap.error(f"unknown workloads or methods: {unknown}")
    collector, results = GCPauses(), []
    cycles = be._spin_cycles_per_ms()
    for name in names:
        w = grid[name]
        hq, hk, d = SHAPES[w.shape]
        layers = be.Layers(w, be.LAYERS, build_vllm_tq(w.preset, hq, hk, d), "cuda")
        for method in a.methods.split(","):
            fs = METHODS[method](layers)
            for f in fs:  # compiles, plans
                f()
            torch.cuda.synchronize()
            label = f"{name}, {method}"
            rounds(fs, cycles, collector, label, results)
            rounds(fs, cycles, collector, label + ", layer 0 profiled", results, True)
            calls, syncs = runtime_calls(fs, cycles)
            print(f"{label}: CUDA calls of layers 0-1 {calls}; sync warnings {syncs}")
            if a.freeze:
                gc.collect()
                gc.freeze()
                rounds(fs, cycles, collector, label + ", gc frozen", results)
                gc.unfreeze()
        del layers
        torch.cuda.empty_cache()
    with open(f"{a.out}/host-calls.json", "w") as f:
        json.dump({"rounds": results}, f)


if __name__ == "__main__":
    main()
