"""The host time of a step's plan and of its run per layer, this tree against an earlier
one, in one process on a GPU (issue 34's A/B; benchmarks/NOTES.md §56).

    python benchmarks/run_ab.py OUT_DIR EARLIER_ROOT [--rounds 5] [--calls 100]

EARLIER_ROOT: the root of an earlier checkout (a ``git worktree``, or ``git archive REV
tq_chunked`` unpacked), whose ``tq_chunked/runtime`` is loaded beside this tree's as a
package of another name (the runtime imports only itself, the standard library, numpy,
torch, triton and vllm). On the H100 machine one case's host time moved by up to 2x
between processes of one version, so the two versions alternate call by call in one
process, each call with the GPU kept busy (``launcher_ab.alternate``), and their order
swaps every round.

Cases: ``host_profile.py --paged``'s three decodes (the memory-bound path) and its
``--run`` batch, 16 prefix-cache hits of 64 tokens over 1-2K, in 1 and in 8 windows;
one hit of 64 tokens over 16K in 8 windows (a long request: its windows merged); 32
decodes beside 16 requests of 40 rows a kv head over 8K (two paged runs from 0.6.14);
the serving grid's "8 hits q64-128 4K-32K" (five spread windows from 0.6.19, three
from 0.6.24's step rule: NOTES.md §71); the
memory-bound grid's "16 x q64 4K-16K 8/1 bf16" (64 blocks: spread only at 0.6.21's first
limit, NOTES.md §67).
Per case and version: ``ContinuationPrefill.plan`` and ``Step.run`` (one layer), the
median of ``--rounds`` medians of ``--calls`` calls; new / old; and whether the two
versions' outputs are the same bits. Writes OUT_DIR/run-ab.json and prints a table.
"""

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
from host_profile import (  # benchmarks/, this script's folder
    MIXED_CASE,
    PAGED_CASES,
    layer_call,
)
from launcher_ab import alternate

import tq_chunked.runtime as this_runtime
from tq_chunked.tools.testing import (
    SHAPES,
    build_batch,
    memory_bound_workloads,
    serving_workloads,
)

WINDOW_REQUESTS = [(1024 + 64 * i, 64) for i in range(16)]  # host_profile's --run


def load_runtime(root: Path, name: str = "earlier_runtime"):
    """``root``/tq_chunked/runtime as the package ``name`` (its relative imports
    resolve inside it), or a SystemExit naming what is missing."""
    init = Path(root) / "tq_chunked" / "runtime" / "__init__.py"
    if not init.is_file():
        raise SystemExit(
            f"EARLIER_ROOT must hold tq_chunked/runtime/, not found: {init}"
        )
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(init.parent)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # the package's submodules import it by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]  # no half-loaded package left behind
        raise
    return module


def cases():
    """(name, requests, window, preset, (Hq, Hk, D), dtype name) of each case."""
    grid = {w.name: w for w in memory_bound_workloads()}
    out = []
    for n in PAGED_CASES:
        w = grid[n]
        out.append((n, w.requests, None, w.preset, SHAPES[w.shape], w.dtype))
    need = sum(c + q for c, q in WINDOW_REQUESTS) + 256 * 15
    for parts in (1, 8):
        window = -(-need // parts) // 16 * 16 + 16
        out.append((f"16 hits q64 1-2K, {parts} windows", WINDOW_REQUESTS, window,
                    "turboquant_3bit_nc", (32, 8, 128), "float16"))  # fmt: skip
    # a long request: 8 windows over one prefix, each merged into its state
    out.append(("1 hit q64 16K, 8 windows", [(16 * 1024, 64)], 2064,
                "turboquant_3bit_nc", (32, 8, 128), "float16"))  # fmt: skip
    # decodes beside 40-row requests: one paged run until 0.6.13, two from 0.6.14
    # (NOTES.md §59; other tiles, so not the same bits)
    out.append((*MIXED_CASE, None, "turboquant_3bit_nc", (32, 8, 128), "float16"))
    # spread windows (from 0.6.19 with FlashAttention-3, NOTES.md §65: five; from 0.6.24
    # three, §71)
    w = next(w for w in serving_workloads() if w.name == "8 hits q64-128 4K-32K")
    out.append((w.name, w.requests, None, w.preset, SHAPES[w.shape], w.dtype))
    # 64 blocks: one spread window at 0.6.21's first limit of 64, one call before and
    # since the limit moved to 56 (§67; spread, not the same bits)
    w = grid["16 x q64 4K-16K 8/1 bf16"]
    out.append((w.name, w.requests, None, w.preset, SHAPES[w.shape], w.dtype))
    return out


def calls_of(runtime, b, heads, preset, dtype, window, device):
    """(plan, layer) of one version over batch ``b``: a step's plan, and one layer's
    run of a step planned once; the layer writes its own output (returned too)."""
    hq, hk, d = heads
    prefill = runtime.ContinuationPrefill(
        hq, hk, d, preset=preset, dtype=dtype, block_size=16, window=window,
        check_block_table=False,
    )  # fmt: skip
    n = b["query"].shape[0]
    ws = torch.empty(prefill.workspace_bytes(n), dtype=torch.uint8, device=device)
    lengths = dict(
        query_start_loc_cpu=torch.tensor(b["query_start_loc"], dtype=torch.int32),
        seq_lens_cpu=torch.tensor(b["seq_lens"], dtype=torch.int32),
    )

    def plan():
        return prefill.plan(b["block_table"], **lengths, workspace=ws)

    out = torch.full_like(b["query"], float("nan"))
    return plan, layer_call(plan(), b, out), out


def measure(versions, rounds, calls, device="cuda"):
    """{case: {"plan_us": {version: us}, "run_us": {...}, "same_answer": bool}}."""
    result = {}
    for name, requests, window, preset, heads, dtype_name in cases():
        dtype = getattr(torch, dtype_name)
        b = build_batch(preset, requests, *heads, 16, dtype, device)
        made = {
            v: calls_of(rt, b, heads, preset, dtype, window, device)
            for v, rt in versions.items()
        }
        outs = []
        for _, layer, out in made.values():
            layer()
            outs.append(out)
        same = all(  # the same bits, NaN where NaN
            torch.equal(o.nan_to_num(), outs[0].nan_to_num())
            and torch.equal(o.isnan(), outs[0].isnan())
            for o in outs
        )
        row = {"same_answer": same}
        for kind, at in (("plan_us", 0), ("run_us", 1)):
            per_round = {v: [] for v in versions}
            for r in range(rounds):
                order = list(versions)[:: 1 if r % 2 == 0 else -1]
                got = alternate({v: made[v][at] for v in order}, n=calls)
                for v, us in got.items():
                    per_round[v].append(us)
            row[kind] = {
                v: round(statistics.median(t), 1) for v, t in per_round.items()
            }
            row[kind + "_rounds"] = per_round
        result[name] = row
        print(f"{name}: {json.dumps({k: row[k] for k in ('plan_us', 'run_us')})}",
              flush=True)  # fmt: skip
    return result


def table(result, old="old", new="new") -> str:
    head = (
        f"| case | plan {old} us | plan {new} us | new / old | run {old} us | "
        f"run {new} us | new / old | same answer |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for name, row in result.items():
        p, r = row["plan_us"], row["run_us"]
        lines.append(
            f"| {name} | {p[old]:.0f} | {p[new]:.0f} | {p[new] / p[old]:.2f} | "
            f"{r[old]:.0f} | {r[new]:.0f} | {r[new] / r[old]:.2f} | "
            f"{'yes' if row['same_answer'] else 'NO'} |"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory for run-ab.json")
    ap.add_argument("earlier", type=Path, help="an earlier checkout's root")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (medians of)")
    ap.add_argument("--calls", type=int, default=100, help="calls a round per version")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("run_ab.py times launches on a GPU; none is available")
    versions = {"old": load_runtime(args.earlier), "new": this_runtime}
    result = measure(versions, args.rounds, args.calls)
    args.out.mkdir(parents=True, exist_ok=True)
    doc = {
        "device": torch.cuda.get_device_name(),
        "earlier": str(args.earlier),
        "rounds": args.rounds,
        "calls": args.calls,
        "cases": result,
    }
    (args.out / "run-ab.json").write_text(json.dumps(doc, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
