"""The crossover of the plan's dispatch (plan.PAGED_MAX_ROWS) on the H200: GPU kernel
time and host time per call of the windows (``path="window"``) and of the memory-bound
path (``path="paged"``), over query rows per kv head x cached tokens per request, with
the floor beside them (GPU).

    python benchmarks/dispatch_sweep.py [OUT_DIR] [--long-band | --short-runs |
        --short-band | --d64-band | --low-edge | --d64-low-edge | --mixed]

Batches of B requests of q_len query tokens over ``cached`` tokens each (Hq/Hk/D
32/8/128, turboquant_3bit_nc, fp16, and Hq/Hk/D 16/16/64, 4bit_nc, bf16; with
--long-band, the rule's second band, plan.PAGED_MAX_ROWS_LONG, for the other presets
and dtypes at head size 128: 32-64 rows over 8K-64K, NOTES.md §41; with --short-runs,
the rule's run minimum, plan.PAGED_MIN_CACHED: 4-32 rows over 1K-8K at head size 128,
the four presets; with --short-band, the second band over short prefixes: 42-64 rows
over 1K-8K, 64 requests a batch, as the serving grid's "64 hits q16 1K-8K", at Hq / Hk
28 / 4, 32 / 8 and 64 / 8, NOTES.md §57; with --d64-band, the band's head size 64
side, where the rule sends 33-64 rows to the windows: 40 and 64 rows over 4K-64K at
Hq / Hk 16 / 16, NOTES.md §58; with --low-edge and --d64-low-edge, where the second
band starts, plan.PAGED_LONG_CACHED: 48 and 64 rows over 64-1K cached tokens at head
size 128, 40 and 64 rows over 1K-2K at head size 64, NOTES.md §64), each path
through ``continuation_prefill_varlen`` with a workspace of workspace_bytes(N) as the
plugin calls it. Writes dispatch-sweep.json (after each point) and prints a table of
paged / windows per point, last.

With --mixed, batches that mix decodes with 33-64-row requests (the decodes first, as
vLLM orders a step) at head sizes 64 and 128, each through "auto" under three rules:
0.6.13's (the band at head size 128 alone; a run's requests share the tile of its
largest), "joined" (the band at both head sizes, one tile a run) and "split" (this
version's: the two sides of PAGED_MAX_ROWS in runs of their own), beside the windows
and the floor (NOTES.md §59). Writes dispatch-mixed.json; prints each rule / windows.
"""

import contextlib
import functools
import json
import os
import sys
import time

import torch
from breakdown import floor_of, profile_ms
from tqdm import tqdm

from tq_chunked import continuation_prefill_varlen, default_window, workspace_bytes
from tq_chunked.runtime import plan
from tq_chunked.tools.bench import tokens
from tq_chunked.tools.testing import build_batch

K = 1024
# (shape name, Hq, Hk, D, preset, dtype, requests per batch)
SHAPES = [
    ("llama3-8b 3bit fp16", 32, 8, 128, "turboquant_3bit_nc", torch.float16, 16),
    ("mha-d64 4bit bf16", 16, 16, 64, "turboquant_4bit_nc", torch.bfloat16, 16),
]
ROWS = [8, 16, 32, 48, 64, 128]  # query rows per kv head
CACHED = [1 * K, 4 * K, 16 * K, 64 * K]
LONG_BAND = (
    [
        ("llama3-8b 4bit fp16", 32, 8, 128, "turboquant_4bit_nc", torch.float16, 16),
        ("llama3-8b k3v4 bf16", 32, 8, 128, "turboquant_k3v4_nc", torch.bfloat16, 16),
        ("70b-tp1 3bit bf16", 64, 8, 128, "turboquant_3bit_nc", torch.bfloat16, 16),
    ],
    [32, 48, 64],
    [8 * K, 16 * K, 64 * K],
)
# --short-runs: the rule's run minimum (plan.PAGED_MIN_CACHED, 256K) at head size 128,
# where 0.6.0's sweep already had the path winning from 16 x 1K-4K (NOTES.md §35, §42)
SHORT_RUNS = (
    [
        ("llama3-8b 3bit fp16", 32, 8, 128, "turboquant_3bit_nc", torch.float16, 16),
        ("llama3-8b 4bit fp16", 32, 8, 128, "turboquant_4bit_nc", torch.float16, 16),
        ("llama3-8b k3v4 bf16", 32, 8, 128, "turboquant_k3v4_nc", torch.bfloat16, 16),
        ("llama3-8b k8v4 fp16", 32, 8, 128, "turboquant_k8v4", torch.float16, 16),
    ],
    [4, 16, 32],
    [1 * K, 2 * K, 4 * K, 8 * K],
)

# --short-band: the second band's prefix minimum (plan.PAGED_LONG_CACHED, 16K before
# §57) with 0.6.4's 32-row tiles (NOTES.md §46), in batches of 64 requests (64K-512K
# cached tokens: both sides of the run minimum); Hq / Hk 28 / 4 first (G 7: 42, 56 and
# 63 rows), the grid's one dispatch miss (NOTES.md §56, §57)
SHORT_BAND = (
    [
        ("qwen2-7b 4bit fp16", 28, 4, 128, "turboquant_4bit_nc", torch.float16, 64),
        ("llama3-8b 3bit fp16", 32, 8, 128, "turboquant_3bit_nc", torch.float16, 64),
        ("llama3-8b 4bit fp16", 32, 8, 128, "turboquant_4bit_nc", torch.float16, 64),
        ("llama3-8b k3v4 bf16", 32, 8, 128, "turboquant_k3v4_nc", torch.bfloat16, 64),
        ("70b-tp1 3bit bf16", 64, 8, 128, "turboquant_3bit_nc", torch.bfloat16, 64),
    ],
    [48, 56, 64],
    [1 * K, 2 * K, 4 * K, 8 * K],
)

# --d64-band: 33-64 rows a kv head at head size 64, which the second band leaves to the
# windows (plan.PAGED_MAX_ROWS_LONG is for head size 128), now that 0.6.12's 32-row
# launch at D 64 took 0.57-0.82x 0.6.11's (NOTES.md §57, §58)
D64_BAND = (
    [
        ("mha-d64 4bit bf16", 16, 16, 64, "turboquant_4bit_nc", torch.bfloat16, 16),
        ("mha-d64 3bit fp16", 16, 16, 64, "turboquant_3bit_nc", torch.float16, 16),
    ],
    [40, 64],
    [4 * K, 16 * K, 64 * K],
)

# --low-edge, --d64-low-edge: the second band's lower edge (plan.PAGED_LONG_CACHED)
# once the 64-row tile ran at head size 128 (NOTES.md §63, §64): the band's shapes
# above under 0.6.17's edges (1K cached tokens at head size 128, 4K at head size 64)
LOW_EDGE = (SHORT_BAND[0][1:4], [48, 64], [64, 128, 256, 512, 1 * K])
D64_LOW_EDGE = (D64_BAND[0], [40, 64], [1 * K, 2 * K])


# --mixed: (shape, [(requests, cached, query tokens), ...]) batches, decodes first
MIXED_SHAPES = [
    ("mha-d64 4bit bf16", 16, 16, 64, "turboquant_4bit_nc", torch.bfloat16),
    ("mha-d64 3bit fp16", 16, 16, 64, "turboquant_3bit_nc", torch.float16),
    ("llama3-8b 3bit fp16", 32, 8, 128, "turboquant_3bit_nc", torch.float16),
]
# query tokens at G 1 (head size 64; a quarter of them at G 4): decodes beside a few
# 64-row requests, beside as many 40-row ones, short decodes beside 64-row ones, and
# the two in turn
MIXES = [
    ("64 x 4K + 4 x q64 16K", [(64, 4 * K, 1), (4, 16 * K, 64)]),
    ("32 x 8K + 16 x q40 8K", [(32, 8 * K, 1), (16, 8 * K, 40)]),
    ("128 x 2K + 8 x q64 4K", [(128, 2 * K, 1), (8, 4 * K, 64)]),
    # decodes and 40-row requests in turn: one run under the rule (parts under
    # plan.PAGED_MIN_PART join), the last wide request to the windows
    ("24 x (8K + q40 8K)", [(1, 8 * K, 1), (1, 8 * K, 40)] * 24),
]
RULES = ("0.6.13", "joined", "split")


def _joined(paged_runs):
    """``plan.paged_runs`` with each run whole again: its parts on either side of
    PAGED_MAX_ROWS joined (0.6.13's runs, one tile a run)."""

    def runs(qsl, seq_lens, group, path, device, cfg):
        out = []
        for part in paged_runs(qsl, seq_lens, group, path, device, cfg):
            between = range(out[-1][-1] + 1, part[0]) if out else ()
            if out and not any(qsl[r + 1] > qsl[r] for r in between):
                out[-1] = out[-1] + part
            else:
                out.append(part)
        return out

    return runs


@contextlib.contextmanager
def rule(name):
    """The plan's rule ``name`` of RULES while the block runs."""
    runs, least = plan.paged_runs, dict(plan.PAGED_LONG_CACHED)
    try:
        if name != "split":
            plan.paged_runs = _joined(runs)
        if name == "0.6.13":
            plan.PAGED_LONG_CACHED.pop(64, None)
        yield
    finally:
        plan.paged_runs = runs
        plan.PAGED_LONG_CACHED.clear()
        plan.PAGED_LONG_CACHED.update(least)


def kernel_ms(call):
    return sum(profile_ms(call).values())


def host_ms(call, calls=20):
    """Host time per call with the GPU kept busy (the enqueue cost alone)."""
    call()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    t = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return t


def batch_call(b, hq, hk, d, dtype):
    """``continuation_prefill_varlen`` over ``build_batch``'s batch ``b``, as the plugin
    calls it (a workspace of workspace_bytes(N)); the path is the caller's."""
    qsl = torch.tensor(b["query_start_loc"], dtype=torch.int32)
    lens = torch.tensor(b["seq_lens"], dtype=torch.int32)
    n = b["query"].shape[0]
    w = default_window(hk, d, 16)
    ws = torch.empty(
        workspace_bytes(n, hq, hk, d, w, dtype), dtype=torch.uint8, device="cuda"
    )
    call = functools.partial(
        continuation_prefill_varlen,
        b["query"], b["key"], b["value"], b["kv_cache"], b["block_table"],
        qsl.cuda(), lens.cuda(), **b["kwargs"], query_start_loc_cpu=qsl,
        seq_lens_cpu=lens, window=w, workspace=ws, check_block_table=False,
    )  # fmt: skip
    return call


def point(shape, rows, cached):
    name, hq, hk, d, preset, dtype, b_n = shape
    q_len = max(1, rows * hk // hq)
    b = build_batch(preset, [(cached, q_len)] * b_n, hq, hk, d, 16, dtype, "cuda")
    call = batch_call(b, hq, hk, d, dtype)
    # rows: the batch's own (q_len x Hq / Hk: 42 where 48 are asked at G 7)
    row = dict(shape=name, rows_asked=rows, rows=q_len * hq // hk, q_len=q_len,
               cached=cached, requests=b_n)  # fmt: skip
    row["floor_ms"] = kernel_ms(floor_of(b, hk, d, dtype))
    for path in ("window", "paged"):
        c = functools.partial(call, path=path)
        row[f"{path}_ms"] = kernel_ms(c)
        row[f"{path}_host_ms"] = host_ms(c)
    row["paged_over_window"] = row["paged_ms"] / row["window_ms"]
    del b, call
    torch.cuda.empty_cache()
    return row


def mixed_point(shape, mix):
    name, hq, hk, d, preset, dtype = shape
    g = hq // hk
    reqs = [(c, max(1, q // g)) for n, c, q in mix[1] for _ in range(n)]
    b = build_batch(preset, reqs, hq, hk, d, 16, dtype, "cuda")
    call = batch_call(b, hq, hk, d, dtype)
    row = dict(shape=name, mix=mix[0], requests=len(reqs),
               rows=sorted({q * g for _, q in reqs}))  # fmt: skip
    row["floor_ms"] = kernel_ms(floor_of(b, hk, d, dtype))
    row["window_ms"] = kernel_ms(functools.partial(call, path="window"))
    qsl, lens = tuple(b["query_start_loc"]), tuple(b["seq_lens"])
    cfg = plan.TQConfig.from_preset(preset, d)
    for rule_name in RULES:
        with rule(rule_name):
            runs = plan.paged_runs(qsl, lens, g, "auto", torch.device("cuda"), cfg)
            row[f"{rule_name}_runs"] = [len(r) for r in runs]
            c = functools.partial(call, path="auto")
            row[f"{rule_name}_ms"] = kernel_ms(c)
            row[f"{rule_name}_host_ms"] = host_ms(c)
    del b, call
    torch.cuda.empty_cache()
    return row


def mixed(out_dir):
    rows = []
    points = [(s, m) for s in MIXED_SHAPES for m in MIXES]
    for shape, mix in tqdm(points, desc="points", file=sys.stdout):
        rows.append(mixed_point(shape, mix))
        with open(os.path.join(out_dir, "dispatch-mixed.json"), "w") as fh:
            json.dump(
                dict(device=torch.cuda.get_device_name(), rows=rows), fh, indent=1
            )
    print("\nGPU kernel time per call: each rule / the windows (floor / windows)")
    print("| shape | batch | " + " | ".join(RULES) + " | floor |")
    print("|---" * (len(RULES) + 3) + "|")
    for x in rows:
        cells = [f"{x[f'{r}_ms'] / x['window_ms']:.2f}" for r in RULES + ("floor",)]
        print(f"| {x['shape']} | {x['mix']} | " + " | ".join(cells) + " |")


def main():
    bands = {
        "--long-band": LONG_BAND,
        "--short-runs": SHORT_RUNS,
        "--short-band": SHORT_BAND,
        "--d64-band": D64_BAND,
        "--low-edge": LOW_EDGE,
        "--d64-low-edge": D64_LOW_EDGE,
    }
    args = [a for a in sys.argv[1:] if a not in bands and a != "--mixed"]
    usage = __doc__.split("\n\n")[1]
    if args in (["-h"], ["--help"]):
        print(usage)
        return
    if args[1:] or any(a.startswith("-") for a in args):
        sys.exit(usage)
    if "--mixed" in sys.argv[1:]:
        out_dir = args[0] if args else os.environ.get("OUT", ".")
        os.makedirs(out_dir, exist_ok=True)
        return mixed(out_dir)
    chosen = [bands[a] for a in sys.argv[1:] if a in bands]
    if len(chosen) > 1:
        sys.exit("dispatch_sweep.py: choose one of " + ", ".join(bands))
    shapes, rows_per_kvh, cached = chosen[0] if chosen else (SHAPES, ROWS, CACHED)
    out_dir = args[0] if args else os.environ.get("OUT", ".")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    points = [(s, r, c) for s in shapes for r in rows_per_kvh for c in cached]
    for shape, r, c in tqdm(points, desc="points", file=sys.stdout):
        rows.append(point(shape, r, c))
        with open(os.path.join(out_dir, "dispatch-sweep.json"), "w") as fh:
            json.dump(
                dict(device=torch.cuda.get_device_name(), rows=rows), fh, indent=1
            )
    for shape in shapes:
        print(f"\n{shape[0]}, B {shape[6]}: paged / windows, GPU kernel time per call")
        print("| rows/kv head | " + " | ".join(map(tokens, cached)) + " |")
        print("|---" * (len(cached) + 1) + "|")
        for r in rows_per_kvh:
            mine = [x for x in rows if x["shape"] == shape[0] and x["rows_asked"] == r]
            cells = [f"{x['paged_over_window']:.2f}" for x in mine]
            if mine:
                print(f"| {mine[0]['rows']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
