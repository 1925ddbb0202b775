"""The fused prototype (tq_chunked/experimental/fused.py) beside the window path and
the floor, on the serving grid's decode-like batches (GPU).

    python benchmarks/fused_probe.py [OUT_DIR] [--workloads "64 hits,8 hits q64"]
    ncu --kernel-name regex:_cached_attention python benchmarks/fused_probe.py --ncu

Per workload (name prefixes of ``tq-chunked bench --serving``'s and --crossover's
workloads; 3bit_nc unless the workload says otherwise, this project's encoder): the
GPU kernel time per call (torch.profiler, summed) of the floor (one FlashAttention-3
call over K/V of the query's dtype), of ``continuation_prefill_varlen`` as the plugin
calls it, and of ``fused_continuation_prefill_varlen`` at each (BLOCK_M, BLOCK_N,
splits) tried, with the fused path's cached part alone; then each path's largest
per-request error against the float64 oracle (requests of 4 query tokens or more) and
their ratio, the exactness target's "within 1.1x". Prints a row per workload and
writes fused-probe.json; NOTES.md §25 has the prediction.
"""

import argparse
import functools
import json
import os

import torch
from breakdown import floor_of, profile_ms
from tqdm import tqdm

from tq_chunked import continuation_prefill_varlen, default_window, workspace_bytes
from tq_chunked.experimental.fused import (
    cached_attention,
    fused_continuation_prefill_varlen,
)
from tq_chunked.tools.reference import oracle_continuation_prefill
from tq_chunked.tools.testing import (
    SHAPES,
    build_batch,
    crossover_workloads,
    rel_err,
    serving_workloads,
)

WORKLOADS = (
    "64 hits q16,8 hits q64-128,32 hits q128,32 hits q200,16 hits q256 1K-8K,"
    "1 hit q8 ,1 hit q32 ,1 hit q128 ,24 hits"
)
# (BLOCK_M, BLOCK_N, warps): 64 rows compile to wgmma (a program decodes each slot
# once for up to 64 rows: 16 query tokens of a group of 4); NOTES.md §26-27. Each at
# the default splits (two programs per SM), then the fastest at SPLITS.
CONFIGS = [(32, 64, 4), (32, 32, 4), (64, 32, 4), (64, 64, 4), (16, 64, 4)]
SPLITS = [1, 4, 16, 64]


def kernel_ms(call):
    """GPU kernel time per call: every kernel's time, summed (host gaps excluded)."""
    return sum(profile_ms(call).values())


def time_part(cached_part, tried, compiled, bm, bn, warps, splits):
    """tried[(bm, bn, warps, splits)] <- the cached part's kernel ms at that launch;
    compiled[(bm, bn, warps)] <- its registers and spills."""
    info = {}
    part = functools.partial(
        cached_part, block_m=bm, block_n=bn, num_warps=warps, splits=splits, info=info
    )
    tried[(bm, bn, warps, splits)] = kernel_ms(part)
    compiled[(bm, bn, warps)] = info


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", default=".")
    p.add_argument("--workloads", default=WORKLOADS)
    p.add_argument(
        "--ncu",
        action="store_true",
        help="each workload's cached part twice at the launch the H200 run found "
        "best, (32, 64, 8 warps), for Nsight Compute; nothing timed",
    )
    a = p.parse_args()
    prefixes = [x for x in a.workloads.split(",") if x]
    chosen = [
        w
        for w in serving_workloads() + crossover_workloads()
        if any(w.name.startswith(x) for x in prefixes)
    ]
    rows = []
    print(
        "| workload | shape | q x G | floor ms | window path | fused (best) | best "
        "config | cached part | regs / spills | window / floor | fused / floor | error "
        "fused / window |\n|---|---|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    for wl in tqdm(chosen, desc="workloads", unit="workload"):
        hq, hk, d = SHAPES[wl.shape]
        dtype = getattr(torch, wl.dtype)
        b = build_batch(wl.preset, wl.requests, hq, hk, d, 16, dtype, "cuda")
        qsl, lens = b["query_start_loc"], b["seq_lens"]
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        lens_cpu = torch.tensor(lens, dtype=torch.int32)
        floor = floor_of(b, hk, d, dtype)
        n = b["query"].shape[0]
        w = default_window(hk, d, 16)
        ws = torch.empty(
            workspace_bytes(n, hq, hk, d, w, dtype), dtype=torch.uint8, device="cuda"
        )
        args = (b["query"], b["key"], b["value"], b["kv_cache"], b["block_table"])
        window_path = functools.partial(
            continuation_prefill_varlen,
            *args,
            qsl_cpu.cuda(),
            lens_cpu.cuda(),
            **b["kwargs"],
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=lens_cpu,
            window=w,
            workspace=ws,
            check_block_table=False,
        )
        cached = [lens[r] - (qsl[r + 1] - qsl[r]) for r in range(len(lens))]
        cached_part = functools.partial(
            cached_attention,
            b["query"],
            b["kv_cache"],
            b["block_table"],
            qsl,
            cached,
            **b["kwargs"],
        )
        fused = functools.partial(
            fused_continuation_prefill_varlen, *args, qsl, lens, **b["kwargs"]
        )
        if a.ncu:
            for _ in range(2):
                cached_part(block_m=32, block_n=64, num_warps=8)
            torch.cuda.synchronize()
            continue
        floor_ms = kernel_ms(floor)
        window_ms = kernel_ms(window_path)
        tried, compiled = {}, {}
        for bm, bn, w in CONFIGS:  # at the default splits
            time_part(cached_part, tried, compiled, bm, bn, w, None)
        bm, bn, w, _ = min(tried, key=tried.get)
        for s in SPLITS:  # the fastest at each of SPLITS
            time_part(cached_part, tried, compiled, bm, bn, w, s)
        best = min(tried, key=tried.get)
        # the whole fused call at the default configuration and the cached part's
        # best; what the best would make of the whole is fused - cached + best
        fused_ms = kernel_ms(fused)
        default_part = tried[(*CONFIGS[0], None)]
        fused_best = fused_ms - default_part + tried[best]
        info = compiled[best[:3]]
        # exactness against the float64 oracle, per request of 4 query tokens or more
        out_w, out_f = window_path(), fused()
        worst = {"window": 0.0, "fused": 0.0}
        for r in range(len(lens)):
            q0, q1 = qsl[r], qsl[r + 1]
            if q1 - q0 < 4:
                continue
            ref = oracle_continuation_prefill(
                b["query"][q0:q1],
                b["key"][q0:q1],
                b["value"][q0:q1],
                b["kv_cache"],
                b["block_table"][r],
                cached[r],
                **b["kwargs"],
            )
            worst["window"] = max(worst["window"], rel_err(out_w[q0:q1], ref))
            worst["fused"] = max(worst["fused"], rel_err(out_f[q0:q1], ref))
        ratio = worst["fused"] / worst["window"] if worst["window"] else None
        q_rows = max(q for _, q in wl.requests) * hq // hk
        row = dict(
            workload=wl.name,
            shape=wl.shape,
            preset=wl.preset,
            dtype=wl.dtype,
            query_rows_per_kv_head=q_rows,
            floor_ms=floor_ms,
            window_ms=window_ms,
            fused_ms=fused_ms,
            fused_best_ms=fused_best,
            best_config=list(best),
            cached_part_ms={str(k): v for k, v in tried.items()},
            compiled={str(k): v for k, v in compiled.items()},
            worst_error=worst,
        )
        rows.append(row)
        with open(os.path.join(a.out_dir, "fused-probe.json"), "w") as f:
            # after each workload: a timeout keeps them
            json.dump({"probe": "fused", "rows": rows}, f, indent=1)
        ratio_s = f"{ratio:.2f}" if ratio is not None else "-"
        tqdm.write(
            f"| {wl.name} | {wl.shape} | {q_rows} | {floor_ms:.3f} | {window_ms:.3f} | "
            f"{fused_best:.3f} | {best} | {tried[best]:.3f} | "
            f"{info.get('regs', '?')} / {info.get('spills', '?')} | "
            f"{window_ms / floor_ms:.2f} | {fused_best / floor_ms:.2f} | {ratio_s} |"
        )
        del b, floor, ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
