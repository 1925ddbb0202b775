"""The memory-bound path's query rotation (``paged._rotate_kernel``) alone on a GPU: its
kernel time at the runtime's launch and at others, in three tf32 tensor-core dots
("tf32x3", the runtime's from sm_80: ``paged.rotation_precision``) and in float32 FMA
dots ("ieee", 0.6.14's), over a row-major rotation (vLLM's) and a column-major one, with
the query laid out as vLLM's attention layer passes it (a view of the fused QKV
projection) (benchmarks/NOTES.md §61).

    python benchmarks/rotate_probe.py OUT_DIR

First a step's run over the grid's "64 hits q16 1K-8K" (each kernel's time), and the
rotation launched directly at the runtime's launch with that step's tensors and with
others (query random, rotation column-major); the same again after the variants, so
that an order effect shows. Each variant's error against ``q.double() @
rotation.double().T`` (‖out - ref‖ / ‖ref‖) is recorded beside its time. Rows: served
tokens x query heads (1024 x 32: the engine's short-hits batch, 64 hits of 16 tokens;
64 x 32: a decode batch). GPU kernel time per launch: the profiler's, over 50 launches
(20 in the step). Writes OUT_DIR/rotate-probe.json and prints a table.
"""

import argparse
import functools
import json
from pathlib import Path

import torch
from triton import cdiv

import tq_chunked.runtime.paged as pg

D, HQ, HK = 128, 32, 8
VARIANTS = [  # (precision, rows a program, warps)
    ("tf32x3", 32, 4),  # the runtime's launch on sm_80 on (paged_launches)
    ("tf32x3", 16, 4),
    ("tf32x3", 16, 2),
    ("ieee", 16, 4),  # 0.6.14's launch
    ("ieee", 32, 4),
    ("ieee", 16, 2),
    ("ieee", 64, 8),
]


def served_tokens(n_tok):
    """The plan's token fields for ``n_tok`` served tokens, each its own query token
    (the only field the rotation reads)."""
    tokens = torch.zeros(n_tok, pg.TOKEN_FIELDS, dtype=torch.int32, device="cuda")
    tokens[:, 0] = torch.arange(n_tok, device="cuda")
    return tokens.view(-1)


def launch(precision, q, rotation, centroids, tokens, out, table, block_r, warps):
    n_tok = tokens.numel() // pg.TOKEN_FIELDS
    grid = (cdiv(n_tok * HQ, block_r),)
    pg._rotate_kernel[grid](
        q, rotation, centroids, tokens, out, table, n_tok * HQ, centroids.numel(),
        q.stride(0), q.stride(1), q.stride(2), rotation.stride(0), rotation.stride(1),
        centroids.stride(0), HQ, D, D, block_r, min(D, 32), pg.TOKEN_FIELDS, precision,
        num_warps=warps,
    )  # fmt: skip


def in_step(workload="64 hits q16 1K-8K"):
    """{kernel: us per layer} of a step's run over a grid workload (its own
    launches), then the same rotation launched here with the step's tensors."""
    from host_profile import layer_call, planner

    from tq_chunked.tools.testing import memory_bound_workloads

    w = {w.name: w for w in memory_bound_workloads()}[workload]
    b, plan = planner(w.requests, preset=w.preset, dtype=w.dtype)
    step = plan()
    out = torch.full_like(b["query"], float("nan"))
    run = layer_call(step, b, out)
    got = kernels_us(run)
    n_tok = b["query"].shape[0]
    tokens = served_tokens(n_tok)
    mine = torch.empty(n_tok * HQ, D, device="cuda")
    table = torch.empty(16, dtype=torch.float16, device="cuda")
    kw = b["kwargs"]
    precision, block_r, warps = VARIANTS[0]  # the runtime's launch
    g = torch.Generator(device="cuda").manual_seed(1)
    qr = torch.linalg.qr(torch.randn(D, D, device="cuda", generator=g))[0]
    queries = {"step's": b["query"], "randn": torch.randn_like(b["query"])}
    for qname, q in queries.items():
        for rname, r in (("step's", kw["rotation"]), ("column-major", qr)):
            direct = functools.partial(
                launch, precision, q, r, kw["centroids"], tokens, mine, table,
                block_r, warps,
            )  # fmt: skip
            key = f"direct, query {qname}, rotation {rname}"
            got[key] = kernels_us(direct)["_rotate_kernel"]
    return {"workload": workload, "kernels_us": got}


def kernels_us(call, n=20):
    """GPU time per call of each kernel, us, by name (paged_probe's profile)."""
    from paged_probe import kernels_ms  # benchmarks/, this script's folder

    return {name: round(ms * 1e3, 2) for name, ms in kernels_ms(call, n).items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    step = in_step()
    print(json.dumps(step), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n_tok in (1024, 64):
        qkv = torch.randn(n_tok, (HQ + 2 * HK) * D, device="cuda", generator=g)
        q = qkv.half()[:, : HQ * D].view(n_tok, HQ, D)  # vLLM's layer: a view of QKV
        # row-major, as vLLM's rotation is (QR's own result is column-major)
        rot = torch.linalg.qr(torch.randn(D, D, device="cuda", generator=g))[0]
        rot = rot.contiguous()
        centroids = torch.randn(8, device="cuda", generator=g)
        tokens = served_tokens(n_tok)
        table = torch.empty(16, dtype=torch.float16, device="cuda")
        for layout, r in (("row-major", rot), ("column-major", rot.T.contiguous().T)):
            ref = (q.double() @ r.double().T).reshape(n_tok * HQ, D)
            for precision, block_r, warps in VARIANTS:
                out = torch.full((n_tok * HQ, D), float("nan"), device="cuda")

                call = functools.partial(
                    launch, precision, q, r, centroids, tokens, out, table,
                    block_r, warps,
                )  # fmt: skip
                call()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                us = sum(kernels_us(call, n=50).values())
                row = dict(tokens=n_tok, rows=n_tok * HQ, rotation=layout,
                           precision=precision, block_r=block_r, warps=warps,
                           us=round(us, 2), rel_err=err)  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    after = in_step()  # the same again, after the variants: an order effect shows
    print(json.dumps(after), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "device": torch.cuda.get_device_name(),
        "in_step": [step, after],
        "rows": rows,
    }
    (args.out / "rotate-probe.json").write_text(json.dumps(doc, indent=1))
    base = {(r["tokens"], r["rotation"]): r["us"] for r in rows
            if (r["precision"], r["block_r"], r["warps"]) == VARIANTS[0]}  # fmt: skip
    print(
        "| rows | rotation | precision | rows a program | warps | us | / runtime's "
        "| rel. error |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['rows']} | {r['rotation']} | {r['precision']} | {r['block_r']} | "
            f"{r['warps']} | {r['us']:.1f} | "
            f"{r['us'] / base[(r['tokens'], r['rotation'])]:.2f} | "
            f"{r['rel_err']:.1e} |"
        )


if __name__ == "__main__":
    main()
