"""The memory-bound kernel's cached part at chosen launches, beside the plan's default,
over batches of 17-64 query rows per kv head, decodes, and bf16 queries (GPU).

    python benchmarks/launch_sweep.py [OUT_DIR] [--batches "d64,d128"]
        [--launches "64/16/4,64/8/4,128/8/4/p0"]

Each launch is block_n/programs per SM/num_warps, then optionally /p0, /p1 or /p2 for
the slots prefetched that many tiles ahead (default: the plan's choice for that launch),
/m16, /m32 or /m64 for the tile's query rows (default: the plan's; /m32 puts a
64-row batch at head size 128 in two tiles of 32 where the plan takes one of 64), /rREGS
for the kernel's registers a thread (32-255; r0: Triton's own count; default
``paged.register_cap``'s) and /l0 or /l1 for the values' bytes loaded where used or
with the keys' (``PagedPlan.loads_first``; default the plan's), in any order. Each
batch's answer at every launch is compared with the default's (the same plan but its
launch: within 1e-3 relative, else the row says "differs"). GPU kernel time per call
of ``paged_attention``'s cached part (the probe's ``Paged.cached``: torch.profiler,
every kernel summed over 10 calls). Writes launch-sweep.json after each batch and
prints launch / default per batch, last (NOTES.md §57); the default is written as the
launches are, its programs an SM as planned (the work's programs over the SMs).
"""

import argparse
import json
import math
import os
import sys

import torch
from paged_probe import Paged, kernel_ms
from tqdm import tqdm

from tq_chunked.tools.testing import SHAPES, build_batch, rel_err, seeded_hits

K = 1024
# (name, shape, requests, preset, dtype): 17-64 rows a kv head at each head size
BATCHES = {
    "d64": [
        ("24 x q32 16K-32K d64 4bit bf16", "mha-d64",
         seeded_hits(10, 24, 32, 16 * K, 32 * K), "turboquant_4bit_nc", "bfloat16"),
        ("64 x q32 1K-8K d64 3bit", "mha-d64", seeded_hits(20, 64, 32, K, 8 * K),
         "turboquant_3bit_nc", "float16"),
        ("16 x q24 8K-32K d64 k3v4 bf16", "mha-d64",
         seeded_hits(21, 16, 24, 8 * K, 32 * K), "turboquant_k3v4_nc", "bfloat16"),
        ("128 x q20 2K-4K d64 k8v4", "mha-d64", seeded_hits(22, 128, 20, 2 * K, 4 * K),
         "turboquant_k8v4", "float16"),
        ("16 x q32 64K d64 4bit", "mha-d64", [(64 * K, 32)] * 16,
         "turboquant_4bit_nc", "float16"),
        ("16 x q64 8K-16K d64 3bit", "mha-d64", seeded_hits(23, 16, 64, 8 * K, 16 * K),
         "turboquant_3bit_nc", "float16"),
    ],
    # 33-64 rows at D 64: one 64-row tile (TILE64_D64_LAUNCH) or two of 32 (NOTES.md
    # §58)
    "d64-wide": [
        ("16 x q40 8K-16K d64 4bit bf16", "mha-d64",
         seeded_hits(26, 16, 40, 8 * K, 16 * K), "turboquant_4bit_nc", "bfloat16"),
        ("16 x q48 16K-32K d64 k3v4 bf16", "mha-d64",
         seeded_hits(27, 16, 48, 16 * K, 32 * K), "turboquant_k3v4_nc", "bfloat16"),
        ("16 x q64 8K-16K d64 3bit", "mha-d64", seeded_hits(23, 16, 64, 8 * K, 16 * K),
         "turboquant_3bit_nc", "float16"),
    ],
    "d128": [
        ("16 x q4 8K-32K 64/8 k3v4 bf16", "70b-tp1",
         seeded_hits(6, 16, 4, 8 * K, 32 * K), "turboquant_k3v4_nc", "bfloat16"),
        ("32 x q8 1K-16K 28/4 4bit", "qwen2-7b", seeded_hits(7, 32, 8, K, 16 * K),
         "turboquant_4bit_nc", "float16"),
        ("16 x q16 64K", "llama3-8b", [(64 * K, 16)] * 16, "turboquant_3bit_nc",
         "float16"),
        ("64 x q6 1K-8K 3bit", "llama3-8b", seeded_hits(24, 64, 6, K, 8 * K),
         "turboquant_3bit_nc", "float16"),
        # the engine's short-hits batch (benchmarks/engine.py): one 64-row tile
        ("64 x q16 1K-8K 3bit", "llama3-8b", seeded_hits(28, 64, 16, K, 8 * K),
         "turboquant_3bit_nc", "float16"),
    ],
    # decodes at head size 128: the 16-row tile's one-warp launch (NOTES.md §62)
    "d128-decode": [
        ("decode 64 x 1K-8K", "llama3-8b", seeded_hits(29, 64, 1, K, 8 * K),
         "turboquant_3bit_nc", "float16"),
        ("decode 256 x 2K-12K", "llama3-8b", seeded_hits(30, 256, 1, 2 * K, 12 * K),
         "turboquant_3bit_nc", "float16"),
        ("decode 128 x 8K-32K 4bit", "llama3-8b",
         seeded_hits(31, 128, 1, 8 * K, 32 * K), "turboquant_4bit_nc", "float16"),
        ("decode 256 x 2K-12K bf16", "llama3-8b",
         seeded_hits(30, 256, 1, 2 * K, 12 * K), "turboquant_3bit_nc", "bfloat16"),
    ],
    # bf16 queries at 64 rows, the engine's dtype: one key dot by default (NOTES.md §63)
    "d128-bf16": [
        ("64 x q16 1K-8K 3bit bf16", "llama3-8b", seeded_hits(28, 64, 16, K, 8 * K),
         "turboquant_3bit_nc", "bfloat16"),
        ("16 x q16 64K bf16", "llama3-8b", [(64 * K, 16)] * 16, "turboquant_3bit_nc",
         "bfloat16"),
    ],
    "d256": [
        ("16 x q8 4K-16K d256 bf16", "d256", seeded_hits(25, 16, 8, 4 * K, 16 * K),
         "turboquant_3bit_nc", "bfloat16"),
    ],
}  # fmt: skip
# 0.6.11's 32-row launches first (D 64 and 256: 64/4/4; D 128: 128/4/4, prefetch 1)
LAUNCHES = "64/4/4,128/4/4,64/8/4,64/16/4,64/16/2,64/32/2,128/8/4/p0,128/12/4"


def parse_launch(text):
    """The launch "64/16/4/p1/m64/r168/l1" as plan_paged's keywords: block_n 64,
    programs_per_sm 16, num_warps 4, prefetch 1, block_m 64, max_registers 168,
    loads_first True (the last four optional, in any order)."""
    parts = text.split("/")
    extra = dict((x[:1], x[1:]) for x in parts[3:])
    regs = extra.get("r", "0")
    if (
        len(parts) < 3
        or not all(p.isdigit() and int(p) > 0 for p in parts[:3])
        or len(extra) != len(parts) - 3
        or not set(extra) <= {"p", "m", "r", "l"}
        or extra.get("p", "0") not in ("0", "1", "2")
        or extra.get("m", "16") not in ("16", "32", "64")
        or extra.get("l", "0") not in ("0", "1")
        or not (regs.isdigit() and (regs == "0" or 32 <= int(regs) <= 255))
    ):
        sys.exit(
            f"launch_sweep.py: --launches: {text!r} is not "
            "N/PER_SM/WARPS[/pK][/mROWS][/rREGS][/l0|/l1]"
        )
    launch = dict(zip(("block_n", "programs_per_sm", "num_warps"), map(int, parts)))
    if "p" in extra:
        launch["prefetch"] = int(extra["p"])
    if "m" in extra:
        launch["block_m"] = int(extra["m"])
    if "r" in extra:
        launch["max_registers"] = int(regs)
    if "l" in extra:
        launch["loads_first"] = extra["l"] == "1"
    return launch


def sweep(batch, launches):
    name, shape, reqs, preset, dtype_name = batch
    hq, hk, d = SHAPES[shape]
    dtype = getattr(torch, dtype_name)
    b = build_batch(preset, reqs, hq, hk, d, 16, dtype, "cuda")
    default = Paged(b, hq, hk, d, dtype)
    p = default.plan
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # the default as the launches are written: block_n/programs an SM/warps/prefetch/
    # registers/loads first
    # (programs an SM as planned: the work's programs over the SMs, rounded)
    row = dict(batch=name, rows=max(q for _, q in reqs) * hq // hk,
               default=f"{p.block_m} rows, {p.block_n}/{p.programs / sms:.0f}/"
               f"{p.num_warps}/p{p.prefetch}/r{p.max_registers}/l{int(p.loads_first)}",
               default_ms=kernel_ms(default.cached),
               ms={})  # fmt: skip
    want = default.cached().clone()
    for text in launches:
        try:
            launch = dict(block_m=p.block_m) | parse_launch(text)
            alt = Paged(b, hq, hk, d, dtype, **launch)
            err = rel_err(alt.cached(), want)
            row["ms"][text] = kernel_ms(alt.cached) if err < 1e-3 else "differs"
            del alt
        except Exception as e:  # noqa: BLE001 - a launch may not compile
            row["ms"][text] = f"failed: {type(e).__name__}: {e}"[:200]
    del b, default
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--batches", default=",".join(BATCHES), help="of " + ",".join(BATCHES)
    )
    ap.add_argument("--launches", default=LAUNCHES)
    a = ap.parse_args()
    unknown = set(a.batches.split(",")) - set(BATCHES)
    if unknown:
        sys.exit(f"launch_sweep.py: --batches: unknown {sorted(unknown)}")
    launches = list(dict.fromkeys(x for x in a.launches.split(",") if x))
    for text in launches:
        parse_launch(text)
    os.makedirs(a.out_dir, exist_ok=True)
    batches = [x for k in a.batches.split(",") for x in BATCHES[k]]
    rows = []
    for batch in tqdm(batches, desc="batches", file=sys.stderr):
        rows.append(sweep(batch, launches))
        with open(os.path.join(a.out_dir, "launch-sweep.json"), "w") as fh:
            json.dump(
                dict(device=torch.cuda.get_device_name(), rows=rows), fh, indent=1
            )
    print("\n| batch | rows | default | ms | " + " | ".join(launches) + " |")
    print("|---" * (len(launches) + 4) + "|")
    for r in rows:
        # a launch that failed or answered otherwise: "failed" or "differs" (the
        # reason in the JSON)
        cells = [
            f"{v / r['default_ms']:.2f}" if isinstance(v, float) else v.split(":")[0]
            for v in r["ms"].values()
        ]
        head = f"| {r['batch']} | {r['rows']} | {r['default']} | {r['default_ms']:.3f}"
        print(head + " | " + " | ".join(cells) + " |")
    ratios = {
        t: [r["ms"][t] / r["default_ms"] for r in rows if isinstance(r["ms"][t], float)]
        for t in launches
    }
    print("geomean launch / default: " + ", ".join(
        f"{t} {math.exp(sum(map(math.log, v)) / len(v)):.2f}"
        for t, v in ratios.items() if v))  # fmt: skip


if __name__ == "__main__":
    main()
