"""Would the fill hide behind the attention? A probe (GPU), not the engine: the
windows of a serving batch filled and attended one after the other on one stream, as
``continuation_prefill_varlen`` does, against a two-buffer pipeline where window i+1
is filled on a second stream while window i is attended (events order the buffers'
reuse). Two workspaces, so this ignores the workspace bound: it measures whether the
fill and FlashAttention-3 run side by side at all, and what the pipeline would save at
a window size that two halves of today's workspace would hold.

    python benchmarks/overlap_probe.py OUT_DIR

Prints, per workload and window size, the GPU span (ms per call, median of 20, CUDA
events, the host's enqueueing kept out of it) of the fills alone, the attention alone,
both in sequence and pipelined; writes OUT_DIR/overlap-probe.json.
"""

import json
import statistics
import sys

import torch

from tq_chunked.runtime.attention import varlen_attention
from tq_chunked.runtime.dequant import fill_window, split_rotation
from tq_chunked.runtime.format import TQConfig
from tq_chunked.runtime.plan import LongRequest, make_plan
from tq_chunked.runtime.workspace import carve
from tq_chunked.tools.testing import SHAPES, build_batch, serving_workloads

NAMES = [
    "16 hits q256 1K-8K",
    "2 first chunks q2048 + 8 hits q256 2K-16K",
    "24 hits q384 0.5K-6K",
    "16 hits q512 2K-16K",
]
WINDOWS = (12288, 24576)


def span_ms(fn, reps=20):
    """GPU milliseconds from fn's first kernel to its last: a spin kernel ahead of it
    keeps the GPU busy until the host has enqueued all of it (host time excluded)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
        torch.cuda._sleep(20_000_000)  # ~10 ms
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def probe(w, window):
    hq, hk, d = SHAPES[w.shape]
    dtype = getattr(torch, w.dtype)
    b = build_batch(w.preset, w.requests, hq, hk, d, 16, dtype, "cuda")
    cfg = TQConfig.from_preset(w.preset, d)
    p = make_plan(
        tuple(b["query_start_loc"]),
        tuple(b["seq_lens"]),
        window=window,
        num_q_heads=hq,
        num_kv_heads=hk,
        head_dim=d,
        dtype=dtype,
        budget=1 << 40,
        device=torch.device("cuda"),
        stream=torch.cuda.current_stream(),
    )
    steps = p.units
    cap = p.capacity
    need = p.workspace_bytes
    if any(isinstance(s, LongRequest) for s in steps):
        return None
    bufs = [
        carve(
            torch.empty(need, dtype=torch.uint8, device="cuda"),
            ("batch", 0, hq, hk, d, cap, dtype),
        )
        for _ in range(2)
    ]
    rot = b["kwargs"]["rotation"]
    parts = [
        split_rotation(rot, x.rot_parts, x.rot_flags) if rot is not None else None
        for x in bufs
    ]
    out = torch.empty_like(b["query"])
    q, scale = b["query"], b["kwargs"]["scale"]

    def fill(i, j):
        fill_window(
            b["kv_cache"],
            b["block_table"],
            cfg,
            b["kwargs"]["centroids"],
            rot,
            b["key"],
            b["value"],
            steps[i],
            0,
            bufs[j].k_buf,
            bufs[j].v_buf,
            parts=parts[j],
        )

    def attend(i, j):
        s = steps[i]
        rows = slice(s.q0, s.q1)
        varlen_attention(
            s,
            q[rows],
            bufs[j].k_buf[: s.rows],
            bufs[j].v_buf[: s.rows],
            scale,
            out[rows],
            "flash",
        )

    n = len(steps)
    side = torch.cuda.Stream()

    def fills():
        for i in range(n):
            fill(i, 0)

    def attends():
        for i in range(n):
            attend(i, 0)

    def sequence():
        for i in range(n):
            fill(i, 0)
            attend(i, 0)

    def pipeline():
        main = torch.cuda.current_stream()
        filled = [torch.cuda.Event() for _ in range(n)]
        attended = [torch.cuda.Event() for _ in range(n)]
        fill(0, 0)
        filled[0].record(main)
        side.wait_stream(main)
        for i in range(n):
            if i + 1 < n:
                with torch.cuda.stream(side):
                    if i >= 1:
                        side.wait_event(attended[i - 1])  # its buffer is free
                    fill(i + 1, (i + 1) % 2)
                    filled[i + 1].record(side)
            main.wait_event(filled[i])
            attend(i, i % 2)
            attended[i].record(main)
        main.wait_stream(side)

    sequence()
    ref = out.clone()
    out.fill_(float("nan"))
    pipeline()
    torch.cuda.synchronize()
    assert torch.equal(out, ref), f"{w.name}: the pipeline's answer differs"
    return {
        "workload": w.name,
        "shape": w.shape,
        "window": window,
        "windows": n,
        "fill ms": span_ms(fills),
        "attention ms": span_ms(attends),
        "sequence ms": span_ms(sequence),
        "pipeline ms": span_ms(pipeline),
    }


def main(out_dir):
    chosen = [w for w in serving_workloads() if w.name in NAMES]
    rows = []
    print(
        "| workload | shape | W | windows | fill | attention | sequence | pipeline |"
        " pipeline / sequence |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for w in chosen:
        for window in WINDOWS:
            r = probe(w, window)
            if r is None:
                continue
            rows.append(r)
            print(
                f"| {r['workload']} | {r['shape']} | {window} | {r['windows']} | "
                f"{r['fill ms']:.3f} | {r['attention ms']:.3f} | "
                f"{r['sequence ms']:.3f} | {r['pipeline ms']:.3f} | "
                f"{r['pipeline ms'] / r['sequence ms']:.2f} |",
                flush=True,
            )
    with open(f"{out_dir}/overlap-probe.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
