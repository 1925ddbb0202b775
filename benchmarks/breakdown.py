"""Where the GPU time of one continuation prefill goes, stage by stage (GPU).

    python benchmarks/breakdown.py [--shape llama3-8b] [--cached-lens 8192,131072] [--q-len 2048]
                                   [--windows 8192,16384] [--budgets-mib 128]

Profiles 10 calls of ``continuation_prefill_varlen`` (one request of a bench shape, called
as the plugin calls it: host copies of the lengths, no block-table check) with torch.profiler
and sums the GPU time of each kernel by stage: the dequant of the cached windows, the prepare
(the query rotated to fp16, the merge state's start, fp16 copies of a bf16 chunk), the
attention calls (windows and the chunk's own causal call), the merges. The whole call is
timed beside it (median of CUDA events, L2 flushed); stage times add up to a little under it,
the rest being gaps between kernels or, where the call is short, the host. "groups" is the
number of kv-head groups the workspace budget splits the call into.

The tables in benchmarks/NOTES.md for versions 1-4 came from earlier versions of this script
(one stage timed alone at a time); they are in the repository's history.
"""

import argparse
from collections import defaultdict

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from tq_chunked import continuation_prefill_varlen, default_window, workspace_bytes
from tq_chunked.bench import SHAPES
from tq_chunked.demo import build_batch
from tq_chunked.workspace import kv_head_group

STAGES = [("dequant", "_dequant_window_kernel"), ("prepare", "_prepare_kernel"), ("merge", "_merge_kernel"),
          ("attention", "flash"), ("attention", "fmha"), ("attention", "_attention_kernel")]


def stage_of(kernel_name: str) -> str:
    low = kernel_name.lower()
    return next((stage for stage, key in STAGES if key.lower() in low), "other")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--cached-lens", default="8192,131072")
    p.add_argument("--q-len", type=int, default=2048)
    p.add_argument("--windows", default="8192,16384", help='comma-separated; "" for the default window')
    p.add_argument("--presets", default="turboquant_3bit_nc,turboquant_k8v4")
    p.add_argument("--budgets-mib", default="128", help="workspace budgets (max_workspace_bytes) in MiB")
    a = p.parse_args()
    hq, hk, d = SHAPES[a.shape]
    calls = 10
    windows = [int(w) for w in a.windows.split(",") if w] or [default_window(hk, d, 16)]
    names = ["dequant", "prepare", "attention", "merge", "other"]
    print(f"{a.shape} (Hq {hq}, Hk {hk}, D {d}), q {a.q_len}")
    print("| preset | cached | W | budget MiB | groups | " + " | ".join(names) + " | sum | whole call (ms) |")
    print("|---|---|---|---|---|" + "---|" * (len(names) + 2))
    for preset in a.presets.split(","):
        for cached in map(int, a.cached_lens.split(",")):
            b = build_batch(preset, [(cached, a.q_len)], hq, hk, d, 16, torch.float16, "cuda")
            qsl_cpu = torch.tensor(b["query_start_loc"], dtype=torch.int32)
            lens_cpu = torch.tensor(b["seq_lens"], dtype=torch.int32)
            args = (b["query"], b["key"], b["value"], b["kv_cache"], b["block_table"], qsl_cpu.cuda(),
                    lens_cpu.cuda())
            for w in windows:
                for budget in (int(m) << 20 for m in a.budgets_mib.split(",")):
                    w_call = min(w, cached)
                    groups = hk // kv_head_group(a.q_len, hq, hk, d, w_call, max_bytes=budget,
                                                 single=cached <= w)
                    ws = torch.empty(workspace_bytes(a.q_len, hq, hk, d, w, max_bytes=budget), dtype=torch.uint8,
                                     device="cuda")
                    call = lambda: continuation_prefill_varlen(*args, **b["kwargs"], query_start_loc_cpu=qsl_cpu,
                                                               seq_lens_cpu=lens_cpu, window=w, workspace=ws,
                                                               check_block_table=False, max_workspace_bytes=budget)
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
                    print(f"| {preset} | {cached} | {w} | {budget >> 20} | {groups} | "
                          + " | ".join(f"{ms[n]:.3f}" for n in names) + f" | {sum(ms.values()):.3f} | {whole:.3f} |",
                          flush=True)


if __name__ == "__main__":
    main()
