"""How many thread blocks each window's FlashAttention-3 call runs, per workload of the
serving grid, from the plan alone (host integers; no device time).

    python benchmarks/occupancy.py [--sms 132] [--tile 128]

A call's blocks, as FlashAttention-3 forms them for grouped-query attention with the
group packed into the query tile: for each kv head and each sequence with queries,
ceil(q_len x G / tile) tiles of ``--tile`` rows (128 at D 128). With
``num_splits=1`` (attention.py: FA3's split-KV combine would turn a NaN answer into a
finite one) a call whose blocks are fewer than the GPU's SMs (132 on the H200) leaves
the rest idle for its whole length. The table gives per workload the attention calls,
their blocks (fewest, median) and how many are below one block per SM
(benchmarks/NOTES.md §31).
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from tq_chunked.runtime.plan import LongRequest, default_window, make_plan
from tq_chunked.runtime.workspace import DEFAULT_WORKSPACE_BYTES
from tq_chunked.tools.testing import SHAPES, serving_workloads

BLOCK_SIZE = 16  # the serving grid's cache block size


def call_blocks(workload, tile=128) -> list[int]:
    """Blocks of each attention call of ``workload`` (a ``testing.Workload``), in the
    order the call makes them."""
    hq, hk, d = SHAPES[workload.shape]
    g = hq // hk
    qsl = [0]
    for _, q in workload.requests:
        qsl.append(qsl[-1] + q)
    lens = tuple(c + q for c, q in workload.requests)
    dtype = torch.bfloat16 if workload.dtype == "bfloat16" else torch.float16
    p = make_plan(
        tuple(qsl),
        lens,
        window=default_window(hk, d, BLOCK_SIZE),
        num_q_heads=hq,
        num_kv_heads=hk,
        head_dim=d,
        dtype=dtype,
        budget=DEFAULT_WORKSPACE_BYTES,
        device=torch.device("cpu"),
    )
    steps = p.units
    groups = tuple(s.kv_heads if isinstance(s, LongRequest) else hk for s in p.units)
    blocks = []
    for step, hk_g in zip(steps, groups):
        # a long request runs its windows once per group of hk_g kv heads
        windows = (
            step.windows * (hk // hk_g) if isinstance(step, LongRequest) else (step,)
        )
        for w in windows:
            q_lens = [b - a for a, b in zip(w.cu_q_host, w.cu_q_host[1:])]
            blocks.append(hk_g * sum(math.ceil(q * g / tile) for q in q_lens if q))
    return blocks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sms", type=int, default=132, help="the GPU's SMs (H200: 132)")
    ap.add_argument("--tile", type=int, default=128, help="query rows per block")
    args = ap.parse_args(argv)
    print(
        f"| workload | shape | attention calls | blocks: fewest | median "
        f"| calls below {args.sms} |"
    )
    print("|---|---|---|---|---|---|")
    for w in serving_workloads():
        b = call_blocks(w, args.tile)
        under = sum(x < args.sms for x in b)
        print(
            f"| {w.name} | {w.shape} | {len(b)} | {min(b)} | "
            f"{statistics.median(b):g} | {under} |"
        )


if __name__ == "__main__":
    main()
