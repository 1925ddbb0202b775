"""A batch window's attention spread over more of the GPU (GPU; NOTES.md §65): the one
causal FlashAttention-3 call the window path makes today, against the same keys cut
into pieces that run side by side, on fp16 K/V of the window's lengths (random values;
no fill, no cache).

    python benchmarks/spread_probe.py OUT [--workloads "8 hits q64-128,16 x q128 8K"]
                                          [--pieces 2,4,8,16]

For each window of each workload (the plan's batch windows, as ``path="window"``
makes them) and each piece count P:

* **one call**: the window as it runs now (``num_splits=1``);
* **FA3 splits**: the same call with FlashAttention-3's own split-KV (``num_splits=0``,
  its choice), for reference only: its combine drops a split whose sum is not a
  number (docs/design.md, "What the call promises");
* **spread**: each request's cached keys cut into P pieces, each followed by ``GAP``
  zero rows, its own keys after them; one non-causal call over the pieces (each with
  its own copy of the request's query rows, gathered by one ``index_select``), one
  causal call over the own keys, then the P + 1 partials merged (``merge_pieces``, one
  launch). Timed as the copy and the two calls, and apart from them the merge: the
  runtime's spread window (prefill.py) less its fill.

Every variant runs in a CUDA graph, so the times are the GPU's (not the launches').
The spread's answer is checked against the one call's (‖a − b‖ / ‖b‖, both fp16), and
the time table is printed last; JSON under OUT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch

from tq_chunked.runtime.attention import _flash_attention, make_call
from tq_chunked.runtime.merge import merge_pieces
from tq_chunked.runtime.plan import (
    GAP,
    LongRequest,
    PagedRun,
    default_window,
    make_plan,
)
from tq_chunked.runtime.workspace import DEFAULT_WORKSPACE_BYTES
from tq_chunked.tools.testing import SHAPES, memory_bound_workloads, serving_workloads

DEFAULT_WORKLOADS = (
    "8 hits q64-128 4K-32K,16 x q128 8K,16 x q64 4K-16K 8/1,32 hits q128 1K-8K,"
    "16 hits q256 1K-8K"
)


def gpu_ms(fn, reps=30):
    """Median GPU ms of ``fn`` replayed from a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm up outside the capture (compiles, allocates)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def requests_of(window):
    """(query rows, cached keys, first key row) of each request of a batch window."""
    out = []
    for b in range(len(window.cu_q_host) - 1):
        q = window.cu_q_host[b + 1] - window.cu_q_host[b]
        if q:  # a gap has no queries
            k0, k1 = window.cu_k_host[b], window.cu_k_host[b + 1]
            out.append((q, k1 - k0 - q, k0))
    return out


def spread(window, k, v, pieces, device):
    """The spread layout of ``window``'s keys: its key buffers, the two calls, the
    query rows each piece copies and where each request's pieces lie."""
    reqs = requests_of(window)
    rows = []  # source rows of the new buffer, -1 for a gap row
    head_q, head_k, tail_q, tail_k = [], [], [], []
    copy = []  # the query row each row of the pieces' query copies
    where = []  # per request: (its first query row, rows, first piece row or -1)
    q_at = 0
    for q, c, k0 in reqs:
        cuts = [c * i // pieces for i in range(pieces + 1)]
        where.append((q_at, q, len(copy) if c else -1))
        for i in range(pieces if c else 0):  # a first chunk has no pieces
            n = cuts[i + 1] - cuts[i]
            rows += list(range(k0 + cuts[i], k0 + cuts[i + 1])) + [-1] * GAP
            head_q += [q, 0]
            head_k += [n, GAP]
            tail_q += [0, 0]
            tail_k += [n, GAP]
            copy += range(q_at, q_at + q)
        rows += list(range(k0 + c, k0 + c + q)) + [-1] * GAP
        head_q += [0, 0]
        head_k += [q, GAP]
        tail_q += [q, 0]
        tail_k += [q, GAP]
        q_at += q
    # as the plan lays it out: no gap after the last request
    rows, head_q, head_k, tail_q, tail_k = (
        rows[:-GAP],
        head_q[:-1],
        head_k[:-1],
        tail_q[:-1],
        tail_k[:-1],
    )
    src = torch.tensor(rows, device=device)
    ks = torch.where((src >= 0)[:, None, None], k[src.clamp(min=0)], 0)
    vs = torch.where((src >= 0)[:, None, None], v[src.clamp(min=0)], 0)
    heads = make_call(head_q, head_k, False, device)
    tail = make_call(tail_q, tail_k, True, device)
    return ks, vs, heads, tail, torch.tensor(copy, device=device), where


def probe(window, hq, hk, d, pieces_list, device, gen):
    g = hq // hk
    nq = window.q1 - window.q0
    k = torch.randn(window.rows, hk, d, generator=gen, device=device).half()
    v = torch.randn(window.rows, hk, d, generator=gen, device=device).half()
    q = torch.randn(nq, hq, d, generator=gen, device=device).half()
    scale = d**-0.5
    out = torch.empty_like(q)
    row = {
        "blocks": sum(math.ceil(r[0] * g / 128) * hk for r in requests_of(window)),
        "one": gpu_ms(lambda: _flash_attention(window, q, k, v, scale, out, 1)),
        "fa3_splits": gpu_ms(lambda: _flash_attention(window, q, k, v, scale, out, 0)),
    }
    _flash_attention(window, q, k, v, scale, out, 1)
    want = out.float().clone()
    for pieces in pieces_list:
        calls_ms, merges_ms, got = time_spread(window, q, k, v, scale, pieces, device)
        row[f"spread{pieces}"] = calls_ms
        row[f"merges{pieces}"] = merges_ms
        row[f"err{pieces}"] = ((got.float() - want).norm() / want.norm()).item()
    return row


def time_spread(window, q, k, v, scale, pieces, device):
    """(ms of the copy and the two calls, ms of the merge, the merged answer)."""
    ks, vs, heads, tail, copy, where = spread(window, k, v, pieces, device)
    qh = torch.empty(len(copy), *q.shape[1:], dtype=q.dtype, device=device)
    oh = torch.empty_like(qh)
    got = torch.full_like(q, float("nan"))
    lse = {}

    def calls():
        torch.index_select(q, 0, copy, out=qh)
        lse["heads"] = _flash_attention(heads, qh, ks, vs, scale, oh, 1)
        lse["tail"] = _flash_attention(tail, q, ks, vs, scale, got, 1)

    first = torch.tensor(
        [p0 + t if p0 >= 0 else -1 for _, n, p0 in where for t in range(n)],
        dtype=torch.int32, device=device,
    )  # fmt: skip
    step = torch.tensor(
        [n if p0 >= 0 else 0 for _, n, p0 in where for _ in range(n)],
        dtype=torch.int32, device=device,
    )  # fmt: skip

    def merges():
        merge_pieces(got, None, got, lse["tail"], oh, lse["heads"], first, step, pieces)

    calls_ms, merges_ms = gpu_ms(calls), gpu_ms(merges)
    calls()
    merges()
    return calls_ms, merges_ms, got


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for the JSON")
    ap.add_argument(
        "--workloads",
        default=DEFAULT_WORKLOADS,
        help="comma-separated name prefixes (serving and memory-bound grids)",
    )
    ap.add_argument("--pieces", default="2,4,8,16", help="piece counts P")
    a = ap.parse_args()
    device = torch.device("cuda")
    pieces_list = [int(x) for x in a.pieces.split(",")]
    grid = serving_workloads() + memory_bound_workloads()
    gen = torch.Generator(device).manual_seed(0)
    results = []
    for prefix in [x for x in a.workloads.split(",") if x]:
        w = next(w for w in grid if w.name.startswith(prefix))
        hq, hk, d = SHAPES[w.shape]
        qsl = [0]
        for _, q in w.requests:
            qsl.append(qsl[-1] + q)
        lens = tuple(c + q for c, q in w.requests)
        plan = make_plan(
            tuple(qsl), lens, window=default_window(hk, d, 16), num_q_heads=hq,
            num_kv_heads=hk, head_dim=d, dtype=torch.float16,
            budget=DEFAULT_WORKSPACE_BYTES, device=device, path="window", spread=1,
        )  # fmt: skip
        batch = [u for u in plan.units if not isinstance(u, (LongRequest, PagedRun))]
        rows = [probe(x, hq, hk, d, pieces_list, device, gen) for x in batch]
        total = {key: sum(r[key] for r in rows) for key in rows[0] if key != "blocks"}
        worst = {key: max(r[key] for r in rows) for key in rows[0] if "err" in key}
        results.append({"workload": w.name, "windows": rows, "total": total | worst})
        print(w.name, {key: round(val, 4) for key, val in total.items()}, flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "spread-probe.json"), "w") as f:
        json.dump(results, f, indent=1)
    head = " | ".join(f"P {p}: calls + merges (err)" for p in pieces_list)
    print(f"\n| workload | blocks a window | one call | FA3 splits | {head} |")
    print("|---" * (4 + len(pieces_list)) + "|")
    for r in results:
        t = r["total"]
        blocks = "/".join(str(x["blocks"]) for x in r["windows"])
        cells = " | ".join(
            f"{t[f'spread{p}']:.3f} + {t[f'merges{p}']:.3f} ({t[f'err{p}']:.1e})"
            for p in pieces_list
        )
        print(
            f"| {r['workload']} | {blocks} | {t['one']:.3f} | {t['fa3_splits']:.3f} "
            f"| {cells} |"
        )


if __name__ == "__main__":
    main()
