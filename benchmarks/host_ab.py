"""Plan once per step, run per layer (0.5) against 0.4.6's one call per layer, in one
process, alternating (H200 machine; issue 34's host targets).

    mkdir -p .bench-old/v046
    git archive 423bfaf tq_chunked | tar x -C .bench-old/v046
    mv .bench-old/v046/tq_chunked .bench-old/v046/tq_chunked_046
    source .gpu-carry/setup.sh && python benchmarks/host_ab.py OUT_DIR [--quick]

(``.bench-old`` is git-ignored through .git/info/exclude and carried.) 0.4.6's package
is imported as ``tq_chunked_046`` (its modules import each other relatively).

Per case, layers back to back as an engine runs them (LAYERS calls, the GPU kept busy
by a spin kernel first so that the host never waits for it):
* host time per layer: 0.4.6's ``continuation_prefill_varlen`` (its schedule memoized
  from the second layer on, the caller's workspace) against 0.5's ``Step.run``; the
  plan's host time (``ContinuationPrefill.plan``, once per step), reported apart;
* GPU kernel time per layer (CUDA events around the LAYERS calls, host time hidden by
  the spin kernel);
* both answers bit for bit (the kernels are the same).
Cases: the serving grid's workloads (tq_chunked.tools.testing.serving_workloads; with
--quick a subset) and one batch cut into 1, 2, 4 and 8 windows, for the host time per
extra window (least squares over those). Writes OUT_DIR/host-ab.json and prints a
table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".bench-old", "v046"))

import tq_chunked_046  # noqa: E402

from tq_chunked import ContinuationPrefill  # noqa: E402
from tq_chunked.runtime.plan import LongRequest  # noqa: E402
from tq_chunked.tools.testing import (  # noqa: E402
    SHAPES,
    build_batch,
    serving_workloads,
)

LAYERS = 32
REPS = 15
SPIN_CYCLES = 60_000_000  # ~30 ms of GPU work ahead of the host


def windows_of(step) -> int:
    """Fills and attention calls per layer (a long request's windows once per group of
    its kv heads)."""
    hk = step.prefill.num_kv_heads
    return sum(
        len(s.windows) * (hk // s.kv_heads) if isinstance(s, LongRequest) else 1
        for s in step.plan.units
    )


def case(name, shape, requests, preset, dtype, window=None):
    hq, hk, d = SHAPES[shape]
    b = build_batch(preset, requests, hq, hk, d, 16, dtype, "cuda")
    kw = b["kwargs"]
    n = b["query"].shape[0]
    qsl, lens = b["query_start_loc"], b["seq_lens"]
    prefill = ContinuationPrefill(
        hq,
        hk,
        d,
        preset=preset,
        dtype=dtype,
        block_size=16,
        window=window,
        check_block_table=False,
    )
    ws = torch.empty(prefill.workspace_bytes(n), dtype=torch.uint8, device="cuda")
    args = (b["query"], b["key"], b["value"], b["kv_cache"])
    out_old, out_new = torch.empty_like(b["query"]), torch.empty_like(b["query"])

    def plan():
        return prefill.plan(
            b["block_table"], query_start_loc_cpu=qsl, seq_lens_cpu=lens, workspace=ws
        )

    step = plan()

    def new():
        step.run(
            *args,
            centroids=kw["centroids"],
            rotation=kw["rotation"],
            scale=kw["scale"],
            out=out_new,
        )

    def old():
        tq_chunked_046.continuation_prefill_varlen(
            *args,
            b["block_table"],
            None,
            None,
            **kw,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=lens,
            window=prefill.window,
            workspace=ws,
            out=out_old,
            check_block_table=False,
        )

    for f in (old, new, old, new):  # compile, warm the memos
        f()
    torch.cuda.synchronize()
    same = torch.equal(out_old, out_new)
    host = {"old": [], "new": []}
    gpu = {"old": [], "new": []}
    plans = []
    for _ in range(REPS):
        for tag, f in (("old", old), ("new", new)):
            torch.cuda.synchronize()
            torch.cuda._sleep(SPIN_CYCLES)
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(LAYERS):
                f()
            end.record()
            t1 = time.perf_counter()
            end.synchronize()
            host[tag].append((t1 - t0) / LAYERS * 1e6)
            gpu[tag].append(start.elapsed_time(end) / LAYERS)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plan()
        plans.append((time.perf_counter() - t0) * 1e6)
    med = statistics.median
    row = dict(
        name=name,
        shape=shape,
        preset=preset,
        dtype=str(dtype).removeprefix("torch."),
        requests=len(requests),
        query_tokens=n,
        windows=windows_of(step),
        same_bits=same,
        host_us_old=med(host["old"]),
        host_us_new=med(host["new"]),
        plan_us=med(plans),
        gpu_ms_old=med(gpu["old"]),
        gpu_ms_new=med(gpu["new"]),
    )
    row["host_ratio"] = row["host_us_new"] / row["host_us_old"]
    row["gpu_ratio"] = row["gpu_ms_new"] / row["gpu_ms_old"]
    return row


def fit(rows):
    """Least squares host_us = a + b * windows over rows."""
    xs, ys = [r["windows"] for r in rows], [r["host_us_new"] for r in rows]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--quick", action="store_true", help="a few serving workloads")
    a = ap.parse_args(argv)
    os.makedirs(a.out_dir, exist_ok=True)
    rows, window_rows = [], []
    grid = serving_workloads()
    if a.quick:
        grid = [
            w
            for w in grid
            if w.name
            in (
                "16 hits q256 1K-8K",
                "64 hits q16 1K-8K",
                "1 long hit q2048 128K",
                "24 hits q384 0.5K-6K",
            )
        ]
    for w in grid:
        try:
            rows.append(
                case(w.name, w.shape, w.requests, w.preset, getattr(torch, w.dtype))
            )
        except Exception as e:  # report and go on
            rows.append(dict(name=w.name, shape=w.shape, error=repr(e)))
        print(rows[-1], flush=True)
    # one batch of 16 hits (1K-2K cached, q 64) cut into 1, 2, 4, 8 windows
    reqs = [(1024 + 64 * i, 64) for i in range(16)]
    rows_needed = sum(c + q for c, q in reqs) + 256 * 15
    for parts in (1, 2, 4, 8):
        window = -(-rows_needed // parts) // 16 * 16 + 16
        r = case(
            f"16 hits q64 1-2K, {parts} windows",
            "llama3-8b",
            reqs,
            "turboquant_3bit_nc",
            torch.float16,
            window,
        )
        window_rows.append(r)
        print(r, flush=True)
    a0, b0 = fit(window_rows)
    result = dict(
        layers=LAYERS,
        reps=REPS,
        grid=rows,
        windows=window_rows,
        host_fit_us=dict(per_call=a0, per_window=b0),
        device=torch.cuda.get_device_name(),
    )
    with open(os.path.join(a.out_dir, "host-ab.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(
        "\n| case | windows | same bits | host us/layer 0.4.6 | 0.5 run | ratio | "
        "plan us/step | GPU ms/layer 0.4.6 | 0.5 | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows + window_rows:
        if "error" in r:
            print(f"| {r['name']} ({r['shape']}) | error: {r['error'][:80]} |")
            continue
        print(
            f"| {r['name']} ({r['shape']}) | {r['windows']} | {r['same_bits']} | "
            f"{r['host_us_old']:.0f} | {r['host_us_new']:.0f} | {r['host_ratio']:.2f} "
            f"| {r['plan_us']:.0f} | {r['gpu_ms_old']:.3f} | {r['gpu_ms_new']:.3f} | "
            f"{r['gpu_ratio']:.3f} |"
        )
    print(
        f"\nrun() host: {a0:.1f} us + {b0:.1f} us per window (least squares, "
        f"{len(window_rows)} cases)"
    )


if __name__ == "__main__":
    main()
