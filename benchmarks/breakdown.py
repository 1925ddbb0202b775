"""Where the GPU time of one continuation prefill goes, stage by stage (GPU).

    python benchmarks/breakdown.py [--cached-lens 8192,131072] [--q-len 2048] [--windows 8192,16384]

Profiles 10 calls of ``continuation_prefill_varlen`` (one request, Hq 32, Hk 8, D 128, called
as the plugin calls it: host copies of the lengths, no block-table check) with torch.profiler
and sums the GPU time of each kernel by stage: the dequant of the cached windows, the prepare
(the query rotated to fp16, the merge state's start, fp16 copies of a bf16 chunk), the
attention calls (windows and the chunk's own causal call), the merges. The whole call is
timed beside it (median of CUDA events, L2 flushed); stage times add up to a little under it,
the rest being gaps between kernels or, where the call is short, the host.

The tables in benchmarks/NOTES.md for versions 1-4 came from earlier versions of this script
(one stage timed alone at a time); they are in the repository's history.
"""

import argparse
from collections import defaultdict

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from tq_chunked import continuation_prefill_varlen, workspace_bytes
from tq_chunked.demo import build_batch

STAGES = [("dequant", "_dequant_window_kernel"), ("prepare", "_prepare_kernel"), ("merge", "_merge_kernel"),
          ("attention", "flash"), ("attention", "fmha"), ("attention", "_attention_kernel")]


def stage_of(kernel_name: str) -> str:
    low = kernel_name.lower()
    return next((stage for stage, key in STAGES if key.lower() in low), "other")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cached-lens", default="8192,131072")
    p.add_argument("--q-len", type=int, default=2048)
    p.add_argument("--windows", default="8192,16384")
    p.add_argument("--presets", default="turboquant_3bit_nc,turboquant_k8v4")
    a = p.parse_args()
    hq, hk, d, calls = 32, 8, 128, 10
    names = ["dequant", "prepare", "attention", "merge", "other"]
    print("| preset | cached | W | " + " | ".join(names) + " | sum | whole call (ms) |")
    print("|---|---|---|" + "---|" * (len(names) + 2))
    for preset in a.presets.split(","):
        for cached in map(int, a.cached_lens.split(",")):
            b = build_batch(preset, [(cached, a.q_len)], hq, hk, d, 16, torch.float16, "cuda")
            qsl_cpu = torch.tensor(b["query_start_loc"], dtype=torch.int32)
            lens_cpu = torch.tensor(b["seq_lens"], dtype=torch.int32)
            args = (b["query"], b["key"], b["value"], b["kv_cache"], b["block_table"], qsl_cpu.cuda(),
                    lens_cpu.cuda())
            for w in map(int, a.windows.split(",")):
                ws = torch.empty(workspace_bytes(a.q_len, hq, hk, d, w), dtype=torch.uint8, device="cuda")
                call = lambda: continuation_prefill_varlen(*args, **b["kwargs"], query_start_loc_cpu=qsl_cpu,
                                                           seq_lens_cpu=lens_cpu, window=w, workspace=ws,
                                                           check_block_table=False)
                whole = triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(calls):
                        call()
                    torch.cuda.synchronize()
                ms = defaultdict(float)
                for e in prof.key_averages():
                    if e.device_time_total > 0 and e.device_type.name == "CUDA":
                        ms[stage_of(e.key)] += e.self_device_time_total / 1e3 / calls
                print(f"| {preset} | {cached} | {w} | " + " | ".join(f"{ms[n]:.3f}" for n in names)
                      + f" | {sum(ms.values()):.3f} | {whole:.3f} |")


if __name__ == "__main__":
    main()
