"""The single-request target grid of the batched engine's issue, as an engine runs it (GPU, vLLM).

    python benchmarks/stack_grid.py OUT_DIR [--repeats 3]

`tq-chunked bench --stack` times 3 shapes x q 512, 2048 x 8K-128K with one preset. This
adds the rest of the grid the issue sets its target on (q 128/512/2048/8192 x the four
bench shapes x 8K-128K x all presets), in three parts that fit the H200 machine's
10-minute limit together:
  q     q 128 (8K, 32K) and q 8192 (8K, 32K, 128K), every shape, 3bit_nc;
  d256  q 512 and 2048 at D 256, 3bit_nc;
  presets  the other three presets, every shape, q 2048, 8K and 128K.
q 128 stops at 32K: the latest answers it by replaying its decode kernel per query token
(2 s per 32-layer stack at 64K; NOTES.md section 7). Each part is written as soon as it
ends (`<device>-<date>-grid-<part>.json/.md/.png`), with a progress bar per part.
"""

import argparse
import datetime
import json
import os

import torch

from tq_chunked import bench_engine as be

K = 1024
SHAPES = ("llama3-8b", "70b-tp1", "70b-tp8", "d256")
OTHER_PRESETS = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc")


def parts():
    W = be.Workload
    return {
        "q": [W(f"{s} q{q} {c // K}K", s, [(c, q)]) for s in SHAPES
              for q, cs in ((128, (8 * K, 32 * K)), (8192, (8 * K, 32 * K, 128 * K))) for c in cs],
        "d256": [W(f"d256 q{q} {c // K}K", "d256", [(c, q)]) for q in (512, 2048) for c in (8 * K, 32 * K, 128 * K)],
        "presets": [W(f"{s} q2048 {c // K}K {p.removeprefix('turboquant_')}", s, [(c, 2048)], preset=p)
                    for p in OTHER_PRESETS for s in SHAPES for c in (8 * K, 128 * K)],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parts", default="q,d256,presets")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    methods = {k: v for k, v in be.methods_available().items() if k in ("latest", "tq_chunked")}
    grid = parts()
    for part in a.parts.split(","):
        rows = be.run_workloads(grid[part], methods, repeats=a.repeats)
        result = {"mode": f"grid-{part}", "device": torch.cuda.get_device_name(),
                  "date": datetime.date.today().isoformat(), "torch": torch.__version__, "layers": be.LAYERS,
                  "repeats": a.repeats, "methods": list(methods), "rows": rows}
        stem = os.path.join(a.out, f"{result['device'].replace(' ', '-').lower()}-{result['date']}-grid-{part}")
        with open(stem + ".json", "w") as f:
            json.dump(result, f, indent=1)
        md = be.markdown(result)
        with open(stem + ".md", "w") as f:
            f.write(md)
        be.plot(result, stem + ".png")
        ratios = [r["ratio"] for r in rows if r["method"] == "tq_chunked"]
        print(f"grid-{part}: {len(ratios)} workloads, tq_chunked / latest {min(ratios):.2f}-{max(ratios):.2f}; "
              f"above 1.0: {', '.join(r['workload'] for r in rows if r['method'] == 'tq_chunked' and r['ratio'] > 1)}",
              flush=True)


if __name__ == "__main__":
    main()
