"""Where the GPU time of one continuation prefill goes, stage by stage, beside the
floor (GPU).

    python benchmarks/breakdown.py [--workloads "24 hits,16 hits q256,1 long hit"]
                                   [--windows 12288,24576]

For serving workloads of ``tq-chunked bench --serving`` (by name prefix), profiles 10
calls of ``continuation_prefill_varlen`` (called as the plugin calls it: host copies of
the lengths, no block-table check) with torch.profiler and sums the GPU time of each
kernel by stage: the window fills (dequant, un-rotation, the chunk's copy), the
attention calls, the merges of long requests, anything else (FlashAttention's own small
kernels). The floor (one FlashAttention call over K/V of the query's dtype with the
same lengths) is profiled the same way. Times are ms per call.
"""

import argparse
import functools
import itertools
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from tq_chunked import continuation_prefill_varlen, default_window, workspace_bytes
from tq_chunked.runtime.plan import LongRequest, make_plan
from tq_chunked.tools.bench_engine import _spin_cycles_per_ms, measure
from tq_chunked.tools.testing import (
    SHAPES,
    build_batch,
    serving_workloads,
    stack_workloads,
)

STAGES = [
    ("fill", "_fill_kernel"),
    ("fill", "_split_kernel"),  # the rotation's parts, once per call
    ("fill", "_unrotate_kernel"),  # version 0.3's second fill pass
    ("fill", "_prepare_kernel"),  # version 0.2's query rotation
    ("merge", "_merge_kernel"),
    ("attention", "flash"),
    ("attention", "fmha"),
    ("attention", "_attention_kernel"),
]
NAMES = ["fill", "attention", "merge", "other"]


def stage_of(kernel_name: str) -> str:
    low = kernel_name.lower()
    return next((stage for stage, key in STAGES if key.lower() in low), "other")


def profile_ms(call, calls=10):
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    ms = defaultdict(float)
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            ms[stage_of(e.key)] += e.self_device_time_total / 1e3 / calls
    return ms


def floor_of(b, hk, d, dtype):
    """The floor of ``build_batch``'s batch ``b``: one FlashAttention-3 call over random
    K/V of the query's dtype with the same lengths (what a BF16 cache costs)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    lens = b["seq_lens"]
    k_full = torch.randn(sum(lens), hk, d, device="cuda", dtype=dtype)
    cu_k = torch.tensor(
        [0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda"
    )
    qsl = b["query_start_loc"]
    return functools.partial(
        flash_attn_varlen_func,
        b["query"],
        k_full,
        torch.randn_like(k_full),
        max(qsl[i + 1] - qsl[i] for i in range(len(lens))),
        torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        max(lens),
        cu_k,
        softmax_scale=d**-0.5,
        causal=True,
        fa_version=3,
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workloads",
        default="24 hits,16 hits q256 1K-8K,1 long hit,1 hit q2048 8K,"
        "16 hits q512 2K-16K",
        help="comma-separated name prefixes of the serving (and stack) workloads",
    )
    p.add_argument(
        "--windows",
        default="",
        help='comma-separated key rows per window; "" for the default only',
    )
    a = p.parse_args()
    prefixes = [x for x in a.workloads.split(",") if x]
    chosen = [
        w
        for w in serving_workloads() + stack_workloads()
        if any(w.name.startswith(x) for x in prefixes)
    ]
    print(
        "| workload | shape | W | windows | long | "
        + " | ".join(NAMES)
        + " | sum | floor | sum / floor | GPU span | floor span | span / floor |"
    )
    print("|---|---|---|---|---|" + "---|" * (len(NAMES) + 6))
    cycles = _spin_cycles_per_ms()

    def span_ms(call):
        """GPU time per call, first kernel to last (events, the host kept ahead by a
        spin kernel): what overlapping kernels take together."""
        return measure([call] * 10, cycles, 5.0)[2]

    for wl in chosen:
        hq, hk, d = SHAPES[wl.shape]
        dtype = getattr(torch, wl.dtype)
        b = build_batch(wl.preset, wl.requests, hq, hk, d, 16, dtype, "cuda")
        n = b["query"].shape[0]
        qsl_cpu = torch.tensor(b["query_start_loc"], dtype=torch.int32)
        lens_cpu = torch.tensor(b["seq_lens"], dtype=torch.int32)
        floor_call = floor_of(b, hk, d, dtype)
        floor_ms = sum(profile_ms(floor_call).values())
        floor_span = span_ms(floor_call)
        for w in [int(x) for x in a.windows.split(",") if x] or [
            default_window(hk, d, 16)
        ]:
            ws = torch.empty(
                workspace_bytes(n, hq, hk, d, w, dtype),
                dtype=torch.uint8,
                device="cuda",
            )
            args = (
                b["query"],
                b["key"],
                b["value"],
                b["kv_cache"],
                b["block_table"],
                qsl_cpu.cuda(),
                lens_cpu.cuda(),
            )
            call = functools.partial(
                continuation_prefill_varlen,
                *args,
                **b["kwargs"],
                query_start_loc_cpu=qsl_cpu,
                seq_lens_cpu=lens_cpu,
                window=w,
                workspace=ws,
                check_block_table=False,
            )
            p = make_plan(
                tuple(b["query_start_loc"]),
                tuple(b["seq_lens"]),
                window=w,
                num_q_heads=hq,
                num_kv_heads=hk,
                head_dim=d,
                dtype=dtype,
                budget=128 << 20,
                device=torch.device("cuda"),
                stream=torch.cuda.current_stream(),
            )
            steps = p.units
            count = sum(
                len(s.windows) if isinstance(s, LongRequest) else 1 for s in steps
            )
            longs = sum(isinstance(s, LongRequest) for s in steps)
            ms = profile_ms(call)
            total_ms = sum(ms.values())
            span = span_ms(call)
            print(
                f"| {wl.name} | {wl.shape} | {w} | {count} | {longs} | "
                + " | ".join(f"{ms[x]:.3f}" for x in NAMES)
                + f" | {total_ms:.3f} | {floor_ms:.3f} | {total_ms / floor_ms:.2f} | "
                f"{span:.3f} | {floor_span:.3f} | {span / floor_span:.2f} |",
                flush=True,
            )
        del b, floor_call


if __name__ == "__main__":
    main()
