"""Host time of the memory-bound path's plan per step and of its run per layer, on the
CPU, this tree against another (benchmarks/NOTES.md §51, §52, §53).

    python benchmarks/plan_host.py OUT_DIR [--against DIR] [--rounds 3]

For the decodes of ``testing.memory_bound_workloads`` that ``host_profile.py --paged``
profiles on a GPU, plus 256 x 2K-12K, and for SPREAD_PLANS (two of its batches on the
window path, as one call per window and spread): ``ContinuationPrefill.plan`` (medians
of 100 calls); for the decodes ``Step.run`` per layer with its three kernel launches
replaced by no-ops (the run's Python); and ``Step.run`` per layer down to each launch's
compiled kernel, for those decodes and for WINDOW_CASES on the window path, whose
FlashAttention call is left out (the run to the launches: the launchers' own Python too,
Triton's compilation replaced by a compiled kernel that does nothing, a driver stand-in
and CPU tensors that say they are on CUDA, so that the launchers take the path they take
on a GPU; what is left out is that kernel's ``run``, the same in every tree), and the
same with 0.6.9's record of places found apart emptied before each layer (places new: a
step whose shape does not repeat an earlier one's, NOTES.md §53). The runs: medians of
400 calls over LAYERS layers of distinct tensors of one layout, in turn, the decodes'
cached lengths cut to 64 tokens (which the host does not depend on). Each tree in its
own processes, the trees in turn for ``--rounds`` rounds; each figure is the median of
its rounds. ``--against``: the root of another checkout (a ``git worktree`` of an
earlier commit). The plan and the run's Python run under ``TRITON_INTERPRET=1``, so that
the CPU plans the memory-bound path as a GPU does. Writes plan-host.json and
plan-host.md to OUT_DIR.
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
LAYERS = 8  # the run's layers: distinct tensors of one layout, in turn
# The window path's runs (§45's batch): name -> (requests (cached, q), shape, preset,
# dtype, window)
WINDOW_CASES = {
    "16 x q64 over 448, 1 window": (((448, 64),) * 16, "llama3-8b",
                                     "turboquant_3bit_nc", "float16", None),
    "16 x q64 over 448, 16 windows": (((448, 64),) * 16, "llama3-8b",
                                      "turboquant_3bit_nc", "float16", 1024),
}  # fmt: skip
# window cases run as one spread window of this many pieces (NOTES.md §65, §68)
SPREAD_CASES = {"8 x q64 over 4K, 1 window in 4 pieces": 4}
WINDOW_CASES["8 x q64 over 4K, 1 window in 4 pieces"] = (
    ((4096, 64),) * 8,
    "llama3-8b",
    "turboquant_3bit_nc",
    "float16",
    None,
)
# plans of the memory-bound grid's batches on the window path, as one call per window
# and spread (name -> (workload, pieces): NOTES.md §67, §69)
SPREAD_PLANS = {
    "plan: 8/1 bf16 batch, 1 window": ("16 x q64 4K-16K 8/1 bf16", 1),
    "plan: 8/1 bf16 batch, 1 window in 5 pieces": ("16 x q64 4K-16K 8/1 bf16", 5),
    "plan: 8 hits q64-128, 5 windows": ("8 hits q64-128 4K-32K", 1),
    "plan: 8 hits q64-128, 5 windows in 3-5 pieces": ("8 hits q64-128 4K-32K", 5),
}


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
    spread = {name: (grid[w], pieces) for name, (w, pieces) in SPREAD_PLANS.items()}
    for name in (*WORKLOADS, *spread):
        w, pieces = spread.get(name, (grid.get(name), None))
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
            **({} if pieces is None else {"path": "window", "spread": pieces}),
        )  # fmt: skip
        ws = torch.empty(prefill.workspace_bytes(qsl[-1]), dtype=torch.uint8)
        qc = torch.tensor(qsl, dtype=torch.int32)
        lc = torch.tensor(lens, dtype=torch.int32)

        def plan(prefill=prefill, table=table, qc=qc, lc=lc, ws=ws):
            return prefill.plan(
                table, qc, lc, query_start_loc_cpu=qc, seq_lens_cpu=lc, workspace=ws
            )

        units = plan().plan.units
        kinds = {type(u).__name__ for u in units}
        if pieces is not None:
            if kinds != {"Window"} or max(u.pieces for u in units) != pieces:
                raise SystemExit(f"{name}: planned {kinds}, not windows of {pieces}")
        elif kinds != {"PagedRun"}:
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


def measure_launches() -> dict:
    """One round of the run per layer down to each launch's compiled kernel (its
    ``run``), in this process, on the tq_chunked that PYTHONPATH names: Triton's real
    kernels (this process runs without TRITON_INTERPRET), whose compilation is replaced
    by a compiled kernel that does nothing, a driver stand-in, and CPU tensors that say
    they are on CUDA, so that the launchers take the path they take on a GPU."""
    import dataclasses

    import torch
    import triton
    from host_profile import PAGED_CASES

    from tq_chunked import ContinuationPrefill
    from tq_chunked.runtime import _utils, dequant, merge, paged
    from tq_chunked.runtime import prefill as prefill_module
    from tq_chunked.tools.testing import SHAPES, build_batch, memory_bound_workloads

    class Cuda(torch.Tensor):
        """A CPU tensor that says it is on CUDA."""

        __torch_function__ = torch._C._disabled_torch_function_impl

        @property
        def is_cuda(self):
            return True

    class Compiled:
        function = packed_metadata = None

        def run(self, *args):
            pass

    class Kernel:
        """A launcher's kernel whose compilation gives a Compiled (its params kept)."""

        def __init__(self, kernel):
            self.params = kernel.params

        def __getitem__(self, grid):
            return lambda *args, **options: Compiled()

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

    triton.runtime.driver.set_active(Driver())
    _utils.Launcher.direct = True
    _utils._hooks_set = lambda: False
    launchers = [(paged, "launch_rotate"), (paged, "launch_paged"),
                 (paged, "launch_combine"), (dequant, "launch_fill"),
                 (dequant, "launch_split"), (merge, "launch_merge"),
                 (merge, "launch_merge_pieces"),
                 (merge, "launch_piece_query")]  # fmt: skip
    for module, name in launchers:
        launcher = getattr(module, name, None)
        if launcher is None:  # a tree from before that kernel
            continue
        launcher.kernel = Kernel(launcher.kernel)
        launcher.compiled.clear()
        # nothing is compiled, so there is no wgmma to refuse (the launcher's
        # mma_sync check compiles the kernel alone first, which the stand-in cannot)
        launcher.mma_sync = False
    # FlashAttention's call, which a window's run makes, left out (the same in both)
    prefill_module.varlen_attention = lambda w, q, *args: torch.empty(
        q.shape[1], q.shape[0]
    )
    cuda = lambda t: None if t is None else t.as_subclass(Cuda)
    grid = {w.name: w for w in memory_bound_workloads()}
    cases = [
        (name, "paged", [(64, q) for _, q in w.requests], w.shape, w.preset, w.dtype,
         None)
        for name, w in ((name, grid[name]) for name in PAGED_CASES)
    ]  # fmt: skip
    cases += [(name, "window", *params) for name, params in WINDOW_CASES.items()]
    result: dict[str, dict] = {"run_us": {}, "run_new_us": {}}
    for name, path, requests, shape, preset, dtype, window in cases:
        hq, hk, d = SHAPES[shape]
        dtype = getattr(torch, dtype)
        b = build_batch(preset, requests, hq, hk, d, 16, dtype, "cpu")
        kw = b["kwargs"]
        prefill = ContinuationPrefill(
            hq, hk, d, preset=preset, dtype=dtype, block_size=16,
            check_block_table=False, path=path, window=window,
            **({"spread": SPREAD_CASES[name]} if name in SPREAD_CASES else {}),
        )  # fmt: skip
        n = b["query"].shape[0]
        ws = torch.empty(prefill.workspace_bytes(n), dtype=torch.uint8)
        os.environ["TRITON_INTERPRET"] = "1"  # the plan a GPU makes
        step = prefill.plan(
            b["block_table"],
            query_start_loc_cpu=torch.tensor(b["query_start_loc"], dtype=torch.int32),
            seq_lens_cpu=torch.tensor(b["seq_lens"], dtype=torch.int32),
            workspace=ws,
        )
        del os.environ["TRITON_INTERPRET"]
        if path == "paged":  # the scratch's views "on CUDA" too (a fill's first
            # argument is the layer's cache)
            step.buffers = tuple(
                dataclasses.replace(s, **{f.name: cuda(getattr(s, f.name))
                                          for f in dataclasses.fields(s)})
                for s in step.buffers
            )  # fmt: skip
        names = ("query", "key", "value", "kv_cache")
        layers = [
            tuple(cuda(b[k].clone()) for k in names) for _ in range(LAYERS)
        ]  # fmt: skip
        tables = {k: cuda(kw[k]) for k in ("centroids", "rotation")}
        out = cuda(torch.empty_like(b["query"]))
        turn = iter(range(1 << 40))

        def layer(step=step, layers=layers, tables=tables, out=out, kw=kw, turn=turn):
            step.run(*layers[next(turn) % LAYERS], **tables, scale=kw["scale"],
                     out=out)  # fmt: skip

        result["run_us"][name] = median_us(layer, 400)

        def new_places(layer=layer, prefill=prefill):
            # 0.6.9's record of the places its overlap check found apart, emptied:
            # every layer's places are new to it, as where a step's shape does not
            # repeat (0.6.10 keeps no record of places: the same run)
            getattr(prefill, "_apart", {}).clear()
            layer()

        result["run_new_us"][name] = median_us(new_places, 400)
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
    """A round of each measurement in its own process: the plan and the run's Python
    under the interpreter, the run down to the launches without it."""
    result = {}
    for mode, interpret in (("--measure", {"TRITON_INTERPRET": "1"}),
                            ("--measure-launches", {})):  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(PYTHONPATH=str(tree), **interpret)
        r = subprocess.run(
            [sys.executable, __file__, mode],
            cwd=tree, env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        if r.returncode:
            raise SystemExit(f"{tree}: {r.stderr.strip()[-2000:]}")
        result.update(json.loads(r.stdout.strip().splitlines()[-1]))
    return result


def main():
    if sys.argv[1:] == ["--measure"]:
        print(json.dumps(measure()))
        return
    if sys.argv[1:] == ["--measure-launches"]:
        print(json.dumps(measure_launches()))
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
            for kind in ("plan_us", "run_python_us", "run_us", "run_new_us")
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
        + " | " + " | ".join(f"run's Python, {t}" for t in labels)
        + " | " + " | ".join(f"run to the launches, {t}" for t in labels)
        + " | " + " | ".join(f"the same, places new, {t}" for t in labels) + " |",
        "|---" * (1 + 4 * len(labels)) + "|",
    ]  # fmt: skip
    for w in (*WORKLOADS, *SPREAD_PLANS, *WINDOW_CASES):
        plan = [
            f"{summary[t]['plan_us'][w] / 1e3:.3f} ms"
            if w in summary[t]["plan_us"]
            else "-"
            for t in labels
        ]
        run = [
            f"{summary[t][kind][w]:.1f} us" if w in summary[t][kind] else "-"
            for kind in ("run_python_us", "run_us", "run_new_us")
            for t in labels
        ]
        lines.append(f"| {w} | " + " | ".join(plan + run) + " |")
    (out / "plan-host.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
