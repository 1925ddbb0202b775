"""Host time of the memory-bound path's plan per step and of its run's Python per layer,
on the CPU, this tree against another (benchmarks/NOTES.md §51).

    TRITON_INTERPRET=1 python benchmarks/plan_host.py OUT_DIR [--against DIR]
        [--rounds 3]

For the decodes of ``testing.memory_bound_workloads`` that ``host_profile.py --paged``
profiles on a GPU, plus 256 x 2K-12K: ``ContinuationPrefill.plan`` (medians of 100
calls), and ``Step.run`` per layer with its three kernel launches replaced by no-ops
(medians of 400 calls; its cached lengths cut to 64 tokens, which the run's Python does
not depend on), each tree in its own process, the trees in turn for ``--rounds``
rounds; each figure is the median of its rounds. ``--against``: the root of another
checkout (a ``git worktree`` of an earlier commit). ``TRITON_INTERPRET=1`` makes the
CPU plan the memory-bound path as a GPU does. Writes plan-host.json and plan-host.md
to OUT_DIR.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = (
    "decode 64 x 1K-8K",
    "decode 256 x 2K-12K",
    "decode 256 x 1K-4K k8v4 bf16",
    "decode 128 x 4K-8K d64 k3v4",
)


def median_us(fn, calls):
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def measure() -> dict:
    """One round in this process, on the tq_chunked that PYTHONPATH names."""
    import torch
    from host_profile import PAGED_CASES  # the run's workloads: host_profile's --paged

    from tq_chunked import ContinuationPrefill
    from tq_chunked.runtime import paged
    from tq_chunked.tools.testing import SHAPES, build_batch, memory_bound_workloads

    grid = {w.name: w for w in memory_bound_workloads()}
    result = {"plan_us": {}, "run_python_us": {}}
    for name in WORKLOADS:
        w = grid[name]
        hq, hk, d = SHAPES[w.shape]
        qsl, lens = [0], []
        for cached, q in w.requests:
            qsl.append(qsl[-1] + q)
            lens.append(cached + q)
        gen = torch.Generator().manual_seed(0)
        blocks = max(-(-n // 16) for n in lens)
        table = torch.randint(0, 1 << 20, (len(lens), blocks), dtype=torch.int32,
                              generator=gen)  # fmt: skip
        prefill = ContinuationPrefill(
            hq, hk, d, preset=w.preset, dtype=getattr(torch, w.dtype), block_size=16,
            check_block_table=False,
        )  # fmt: skip
        ws = torch.empty(prefill.workspace_bytes(qsl[-1]), dtype=torch.uint8)
        qc = torch.tensor(qsl, dtype=torch.int32)
        lc = torch.tensor(lens, dtype=torch.int32)

        def plan(prefill=prefill, table=table, qc=qc, lc=lc, ws=ws):
            return prefill.plan(
                table, qc, lc, query_start_loc_cpu=qc, seq_lens_cpu=lc, workspace=ws
            )

        kinds = {type(u).__name__ for u in plan().plan.units}
        if kinds != {"PagedRun"}:
            raise SystemExit(f"{name}: planned {kinds}, not a paged run: set "
                             "TRITON_INTERPRET=1")  # fmt: skip
        result["plan_us"][name] = median_us(plan, 100)

    launches = ("launch_rotate", "launch_paged", "launch_combine")
    for n in launches:
        setattr(paged, n, lambda *args, **options: None)
    for name in PAGED_CASES:
        w = grid[name]
        hq, hk, d = SHAPES[w.shape]
        dtype = getattr(torch, w.dtype)
        reqs = [(64, q) for _, q in w.requests]
        b = build_batch(w.preset, reqs, hq, hk, d, 16, dtype, "cpu")
        kw = b["kwargs"]
        prefill = ContinuationPrefill(
            hq, hk, d, preset=w.preset, dtype=dtype, block_size=16,
            check_block_table=False, path="paged",
        )  # fmt: skip
        n = b["query"].shape[0]
        ws = torch.empty(prefill.workspace_bytes(n), dtype=torch.uint8)
        step = prefill.plan(
            b["block_table"],
            query_start_loc_cpu=torch.tensor(b["query_start_loc"], dtype=torch.int32),
            seq_lens_cpu=torch.tensor(b["seq_lens"], dtype=torch.int32),
            workspace=ws,
        )
        out = torch.empty_like(b["query"])

        def layer(step=step, b=b, kw=kw, out=out):
            step.run(
                b["query"], b["key"], b["value"], b["kv_cache"],
                centroids=kw["centroids"], rotation=kw["rotation"],
                scale=kw["scale"], out=out,
            )  # fmt: skip

        result["run_python_us"][name] = median_us(layer, 400)
    return result


def tree_label(tree: Path) -> str:
    """The tree's version and commit (+ where it has uncommitted changes)."""
    version = re.search(
        r'__version__ = "([^"]+)"', (tree / "tq_chunked" / "__init__.py").read_text()
    )

    def git(*args):
        r = subprocess.run(["git", "-C", str(tree), *args], text=True,
                           capture_output=True, check=False)  # fmt: skip
        return r.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "?"
    dirty = "+" if git("status", "--porcelain", "--", "tq_chunked") else ""
    return f"{version.group(1) if version else '?'} {head}{dirty}"


def round_in(tree: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, __file__, "--measure"],
        cwd=tree, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if r.returncode:
        raise SystemExit(f"{tree}: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    if sys.argv[1:] == ["--measure"]:
        print(json.dumps(measure()))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--against", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    trees = [ROOT]
    if a.against is not None:
        if not (a.against / "tq_chunked" / "__init__.py").is_file():
            ap.error(f"--against {a.against}: not a checkout of tq_chunked")
        trees = [a.against.resolve(), ROOT]
    trees = {tree_label(tree): tree for tree in trees}
    rounds: dict[str, list[dict]] = {t: [] for t in trees}
    for i in range(a.rounds):
        for label, tree in trees.items():
            rounds[label].append(round_in(tree))
            print(f"round {i + 1}/{a.rounds}: {label} done", file=sys.stderr)
    summary = {
        label: {
            kind: {w: statistics.median(r[kind][w] for r in rs) for w in rs[0][kind]}
            for kind in ("plan_us", "run_python_us")
        }
        for label, rs in rounds.items()
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan-host.json").write_text(
        json.dumps({"rounds": rounds, "median": summary}, indent=1)
    )
    labels = list(trees)
    lines = [
        "| workload | " + " | ".join(f"plan, {t}" for t in labels)
        + " | " + " | ".join(f"run's Python, {t}" for t in labels) + " |",
        "|---" * (1 + 2 * len(labels)) + "|",
    ]  # fmt: skip
    for w in WORKLOADS:
        plan = [f"{summary[t]['plan_us'][w] / 1e3:.3f} ms" for t in labels]
        run = [
            f"{summary[t]['run_python_us'][w]:.1f} us"
            if w in summary[t]["run_python_us"]
            else "-"
            for t in labels
        ]
        lines.append(f"| {w} | " + " | ".join(plan + run) + " |")
    (out / "plan-host.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
