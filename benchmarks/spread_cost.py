"""What a spread window costs against its one call, on the GPU and on the host (GPU;
NOTES.md §67, §71): one request of 512 query rows over 8K, 16K, 32K and 128K cached
tokens at one kv head (the 70B shard at tensor parallel 8, 32 FlashAttention-3
blocks), fp16 and bf16, through ``ContinuationPrefill`` with ``spread=1`` and with
8-9 pieces.

    python benchmarks/spread_cost.py OUT [--profile]

For each case: the pieces "auto" chooses, and against one call the window in the pieces
``spread_pieces`` gives it: GPU ms and host us of one layer's ``run``
(30 runs enqueued while a spin kernel holds the GPU, so the host never waits: the host
time is the enqueue's, the GPU time the runs' own), a layer's ms as an engine runs
them (32 layers back to back from the first enqueue to the GPU's end: ``stack``, the
runs alone; ``step``, each between the GEMMs of a layer of the 70B shard's weights,
``bench_engine.Step``), and the two answers' relative difference. ``--profile``:
torch.profiler's CPU ops of both at 32K, the nine with the most self time. The table
is printed last; JSON under OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tq_chunked import ContinuationPrefill
from tq_chunked.tools import bench_engine
from tq_chunked.tools.bench_engine import Step
from tq_chunked.tools.testing import build_batch

K = 1024
PRESET = "turboquant_3bit_nc"


def layer_run(b, dtype, spread):
    """(pieces, run, out): one layer's ``run`` of a step planned once."""
    p = ContinuationPrefill(
        8, 1, 128, preset=PRESET, dtype=dtype, block_size=16, backend="flash",
        spread=spread, check_block_table=False,
    )  # fmt: skip
    ws = torch.empty(p.workspace_bytes(512), dtype=torch.uint8, device="cuda")
    step = p.plan(
        b["block_table"],
        query_start_loc_cpu=torch.tensor(b["query_start_loc"], dtype=torch.int32),
        seq_lens_cpu=torch.tensor(b["seq_lens"], dtype=torch.int32),
        workspace=ws,
    )
    pieces = max(getattr(u, "pieces", 1) for u in step.plan.units)
    kw = {k: v for k, v in b["kwargs"].items() if k != "preset"}
    out = torch.empty_like(b["query"])

    def run():
        step.run(b["query"], b["key"], b["value"], b["kv_cache"], **kw, out=out)

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    return pieces, run, out


def timed(run, rounds=7, calls=30):
    """(GPU ms, host us) a run, medians of ``rounds``, the GPU held by a spin kernel
    while ``calls`` runs are enqueued."""
    gpu, host = [], []
    for _ in range(rounds):
        torch.cuda._sleep(int(1e8))
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        t1 = time.perf_counter()
        e.record()
        e.synchronize()
        gpu.append(s.elapsed_time(e) / calls)
        host.append((t1 - t0) / calls * 1e6)
    return statistics.median(gpu), statistics.median(host)


def back_to_back(run, gemms, rounds=7, layers=32):
    """(stack, step): ms a layer of ``layers`` runs back to back, from the first
    enqueue to the GPU's end, medians of ``rounds``: the runs alone, and each between
    ``gemms``' (a bench_engine.Step) GEMMs."""

    def wall(f):
        return statistics.median(
            bench_engine.wall_ms([f] * layers) / layers for _ in range(rounds)
        )

    return wall(run), wall(gemms.around(run))


def profiled(run, calls=30):
    """The nine CPU ops of most self time in ``calls`` runs: (name, calls a run, self
    us a run)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda._sleep(int(1e8))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            run()
    torch.cuda.synchronize()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:9]
    return [(e.key, e.count // calls, e.self_cpu_time_total / calls) for e in ops]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for the JSON")
    ap.add_argument("--profile", action="store_true", help="CPU ops at 32K")
    a = ap.parse_args()
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        gemms = Step("70b-tp8", 512, dtype, torch.device("cuda"))
        gemms.around(lambda: None)()  # cuBLAS's first calls
        for cached in (8 * K, 16 * K, 32 * K, 128 * K):
            b = build_batch(PRESET, [(cached, 512)], 8, 1, 128, 16, dtype, "cuda", 1)
            row = {"dtype": str(dtype)[6:], "cached": cached}
            outs = {}
            # "auto"'s choice (plan.spread_for_step), then the window in one call and
            # in the pieces spread_pieces gives it (§71: 8 at 8K, 9 above)
            row["auto_pieces"] = layer_run(b, dtype, "auto")[0]
            for spread in (1, 8 if cached == 8 * K else 9):
                pieces, run, out = layer_run(b, dtype, spread)
                tag = "one" if spread == 1 else "spread"
                row[f"{tag}_gpu_ms"], row[f"{tag}_host_us"] = timed(run)
                row[f"{tag}_stack_ms"], row[f"{tag}_step_ms"] = back_to_back(run, gemms)
                if spread != 1:
                    row["pieces"] = pieces
                if a.profile and cached == 32 * K:
                    row[f"{tag}_ops"] = profiled(run)
                outs[tag] = out.float()
            one = outs["one"]
            row["rel_diff"] = ((outs["spread"] - one).norm() / one.norm()).item()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if "ops" not in k}))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "spread-cost.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for r in rows:
        for tag in ("one", "spread"):
            for name, n, us in r.get(f"{tag}_ops", []):
                print(f"{r['dtype']} {tag}: {name[:48]:48s} {n:3d}/run {us:7.1f} us")
    print(
        "\n| dtype | cached | pieces | auto | GPU ms one call | GPU ms spread | "
        "ratio | host us one | host us spread | stack ms one | stack ms spread | "
        "ratio | step ms one | step ms spread | ratio | rel diff |"
    )
    print("|---" * 16 + "|")
    for r in rows:
        print(
            f"| {r['dtype']} | {r['cached'] // K}K | {r['pieces']} | "
            f"{r['auto_pieces']} | "
            f"{r['one_gpu_ms']:.3f} | {r['spread_gpu_ms']:.3f} | "
            f"{r['spread_gpu_ms'] / r['one_gpu_ms']:.2f} | {r['one_host_us']:.0f} | "
            f"{r['spread_host_us']:.0f} | {r['one_stack_ms']:.3f} | "
            f"{r['spread_stack_ms']:.3f} | "
            f"{r['spread_stack_ms'] / r['one_stack_ms']:.2f} | "
            f"{r['one_step_ms']:.3f} | {r['spread_step_ms']:.3f} | "
            f"{r['spread_step_ms'] / r['one_step_ms']:.2f} | {r['rel_diff']:.1e} |"
        )


if __name__ == "__main__":
    main()
