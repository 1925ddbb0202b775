"""Time and memory of continuation prefill, side by side with vLLM, in one run.

Methods (each where available): vllm-<installed version> (vLLM's own
_continuation_prefill with its FlashAttention), vllm-latest (the latest release's
method, through .gpu-carry/latest), full (this project's full-buffer path), and
chunked-<backend> per attention back end (-w<W>: another window). vLLM's methods run
on a GPU only.

Per case: median time (on a GPU CUDA events with L2 flushed between runs; on a CPU
the median of 3 calls), the workspace bytes, the time ratio to the strongest vLLM
baseline (to full without vLLM), and on a GPU only: effective TFLOP/s
(4*q_len*Hq*D*(cached_len + q_len/2)), its share of the bf16 matmul ceiling measured
in the same run, and peak extra memory. Writes JSON, a Markdown table and PNG plots
into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from . import PRESETS, continuation_prefill, workspace_bytes
from .attention import backend_available
from .demo import build_case
from .reference import full_buffer_continuation_prefill
from .workspace import default_window

SHAPES = {  # per-GPU-shard head shapes of real models: (Hq, Hk, D)
    "llama3-8b": (32, 8, 128),
    "70b-tp1": (64, 8, 128),
    "70b-tp8": (8, 1, 128),
    "70b-tp4": (16, 2, 128),
    "qwen2-7b": (28, 4, 128),
    "mha-d64": (16, 16, 64),
    "d256": (16, 4, 256),
}
SHAPE_NOTES = {  # what each shape stands for, for --help and docs/benchmarks.md
    "llama3-8b": "Llama-3-8B on one GPU",
    "70b-tp1": "a 70B model (Llama-3-70B) on one GPU",
    "70b-tp8": "the same 70B model's per-GPU shard at tensor parallel 8",
    "70b-tp4": "the same 70B model's per-GPU shard at tensor parallel 4",
    "qwen2-7b": "Qwen2-7B on one GPU (28 query heads, 4 kv heads)",
    "mha-d64": "multi-head attention at head size 64 (16 heads, no grouping)",
    "d256": "a head size 256 shape",
}
LAYER_GEMMS = {  # (hidden, MLP intermediate) per GPU shard: the weights of one layer, for the model-shaped step
    "llama3-8b": (4096, 14336),
    "70b-tp1": (8192, 28672),
    "70b-tp8": (8192, 3584),
    "70b-tp4": (8192, 7168),
    "qwen2-7b": (3584, 18944),
    "mha-d64": (1024, 4096),
    "d256": (4096, 14336),
}
K = 1024
BLOCK_SIZE = 16  # cache block size of every case (vLLM's default)
# Default sizes of the three modes. Each applies only to the options not given.
SIZES = {
    "full": dict(
        presets=[
            "turboquant_3bit_nc",
            "turboquant_k8v4",
            "turboquant_4bit_nc",
            "turboquant_k3v4_nc",
        ],
        shapes=["llama3-8b", "70b-tp1", "70b-tp8", "d256"],
        q_lens=[512, 2048, 8192],
        cached_lens=[8 * K, 16 * K, 32 * K, 64 * K, 128 * K],
        memory_lens=[256 * K, 512 * K, 1024 * K],
        windows=[],
    ),
    "quick": dict(
        presets=["turboquant_3bit_nc"],
        shapes=["llama3-8b"],
        q_lens=[2048],
        cached_lens=[8 * K, 32 * K, 128 * K],
        memory_lens=[],
        windows=[],
    ),
    # On a CPU the default window holds the whole context; a 512-token window shows several windows.
    "cpu": dict(
        presets=["turboquant_3bit_nc"],
        shapes=["70b-tp8"],
        q_lens=[256],
        cached_lens=[1 * K, 4 * K],
        memory_lens=[],
        windows=[512],
    ),
}
DEFAULT_OUT = "tq-chunked-results"  # relative to the current directory; benchmarks/results/ holds committed runs


@dataclass
class Row:
    method: str
    preset: str
    shape: str
    q_len: int
    cached_len: int
    time_ms: float | None = None
    tflops: float | None = None
    ceiling_share: float | None = None
    peak_mib: float | None = None
    workspace_mib: float | None = None
    ratio_to_vllm: float | None = None
    error: str | None = None


def attention_flop(q_len, hq, d, cached_len):
    return 4 * q_len * hq * d * (cached_len + q_len / 2)


def time_ms(fn, device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[1] * 1e3


def peak_extra_mib(fn, device, before=None) -> float | None:
    """Peak allocated bytes above the starting point during one call, in MiB."""
    if device.type != "cuda":
        return None
    if before:
        before()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak / 2**20


def matmul_ceiling_tflops(device) -> float | None:
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192**3 / (time_ms(lambda: a @ b, device) * 1e-3) / 1e12


class CaseData:
    """One cache of max(cached_lens) + q_len tokens; smaller cached_lens read its prefix."""

    def __init__(self, preset, shape, q_len, max_cached, device, use_vllm):
        hq, hk, d = SHAPES[shape]
        self.preset, self.shape, self.q_len, self.device = preset, shape, q_len, device
        self.tq = None
        if use_vllm:  # vLLM's own store kernel writes the cache
            from .vllm_harness import build_vllm_tq

            self.tq = build_vllm_tq(preset, hq, hk, d)
        (self.q, self.kc, self.vc, self.cache, self.bt, _), self.kwargs = build_case(
            preset,
            max_cached,
            q_len,
            hq,
            hk,
            d,
            16,
            torch.float16,
            device,
            vllm_tq=self.tq,
        )

    def args(self, cached_len):
        return (self.q, self.kc, self.vc, self.cache, self.bt, cached_len)


def methods_for(device, windows, use_vllm, latest):
    """Name -> (callable(case, cached_len), memory reset hook or None, window or None)."""
    ms = {}
    if use_vllm:
        import vllm

        from .vllm_harness import (
            latest_continuation_prefill,
            prepare_latest,
            vllm_continuation_prefill,
        )

        def drop_layer_buffers(case):
            for a in ("_tq_k_dequant_buf", "_tq_v_dequant_buf"):
                if hasattr(case.tq.layer, a):
                    delattr(case.tq.layer, a)

        ms[f"vllm-{vllm.__version__}"] = (
            lambda c, n: vllm_continuation_prefill(c.tq, *c.args(n)),
            drop_layer_buffers,
            None,
        )
        if latest:  # reset before the memory call, so the latest method's workspace counts in its peak
            ms["vllm-latest"] = (
                lambda c, n: latest_continuation_prefill(c.tq, *c.args(n)),
                lambda c: prepare_latest(c.tq, c.device, fresh_workspace=True),
                None,
            )
    ms["full"] = (
        lambda c, n: full_buffer_continuation_prefill(*c.args(n), **c.kwargs),
        None,
        None,
    )
    backends = [
        b
        for b in ("flash", "triton", "torch")
        if backend_available(b, device, 128)[0]
        and (b != "torch" or device.type == "cpu")
    ]
    for b in backends:
        ms[f"chunked-{b}"] = (
            lambda c, n, b=b: continuation_prefill(*c.args(n), **c.kwargs, backend=b),
            None,
            None,
        )
        for w in windows:
            ms[f"chunked-{b}-w{w}"] = (
                lambda c, n, b=b, w=w: continuation_prefill(
                    *c.args(n), **c.kwargs, backend=b, window=w
                ),
                None,
                w,
            )
    return ms


def run(args) -> dict:
    device = torch.device(
        "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    )
    from .vllm_harness import latest_available, vllm_available

    use_vllm = device.type == "cuda" and vllm_available() and not args.no_vllm
    latest = use_vllm and latest_available()
    ceiling = matmul_ceiling_tflops(device)
    methods = methods_for(device, args.windows, use_vllm, latest)
    if args.methods:
        methods = {
            k: v
            for k, v in methods.items()
            if any(k.startswith(p) for p in args.methods)
        }
    # (preset, shape, q_len) groups; time for time_lens, memory only for mem_lens.
    groups = [(p, s, q) for p in args.presets for s in args.shapes for q in args.q_lens]
    jobs = [(g, n, "time") for g in groups for n in args.cached_lens]
    jobs += [(g, n, "memory") for g in groups[:1] for n in args.memory_lens]
    rows, case, case_key = [], None, None
    baseline = (
        "vllm-latest"
        if latest
        else next((m for m in methods if m.startswith("vllm-")), "full")
    )
    for (preset, shape, q_len), cached_len, kind in tqdm(
        jobs, desc="bench", unit="case"
    ):
        max_len = max(
            args.cached_lens
            + (args.memory_lens if (preset, shape, q_len) == groups[0] else [])
        )
        if case_key != (preset, shape, q_len):
            case, case_key = (
                None,
                (preset, shape, q_len),
            )  # free the last group's cache first
            if device.type == "cuda":
                torch.cuda.empty_cache()
            case = CaseData(preset, shape, q_len, max_len, device, use_vllm)
        hq, hk, d = SHAPES[shape]
        flop = attention_flop(q_len, hq, d, cached_len)
        group_rows = []
        for name, (fn, reset, window) in methods.items():
            if kind == "memory" and not (
                name.startswith("chunked") or name.startswith("vllm")
            ):
                continue
            w = window or default_window(hk, d, 16)
            row = Row(name, preset, shape, q_len, cached_len)
            if name.startswith("chunked"):
                row.workspace_mib = workspace_bytes(q_len, hq, hk, d, w) / 2**20
            try:
                call = lambda: fn(case, cached_len)
                if kind == "time":
                    row.time_ms = time_ms(call, device)
                    row.tflops = flop / (row.time_ms * 1e-3) / 1e12
                    row.ceiling_share = row.tflops / ceiling if ceiling else None
                row.peak_mib = peak_extra_mib(
                    call, device, (lambda: reset(case)) if reset else None
                )
            except Exception as e:  # one failing method must not end the sweep
                row.error = f"{type(e).__name__}: {str(e)[:200]}"
            group_rows.append(row)
        base = next((r for r in group_rows if r.method == baseline and r.time_ms), None)
        for r in group_rows:
            if base and r.time_ms:
                r.ratio_to_vllm = r.time_ms / base.time_ms
        rows += group_rows
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "matmul_ceiling_tflops": ceiling,
        "baseline": baseline,
        "rows": [asdict(r) for r in rows],
    }


def markdown(result) -> str:
    """The result as a Markdown table. Columns a run could not measure are left out: TFLOP/s
    and % ceiling without a GPU matmul ceiling, peak MiB where no row has a peak."""
    ceiling = result["matmul_ceiling_tflops"]
    rows = result["rows"]
    f = lambda x, p: "" if x is None else f"{x:.{p}f}"
    columns = [  # (header, cell of a row)
        ("preset", lambda r: r["preset"]),
        ("shape", lambda r: r["shape"]),
        ("q_len", lambda r: str(r["q_len"])),
        ("cached", lambda r: f"{r['cached_len'] // K}K"),
        ("method", lambda r: r["method"]),
        ("time ms", lambda r: f(r["time_ms"], 2)),
    ]
    if ceiling:
        columns += [
            ("TFLOP/s", lambda r: f(r["tflops"], 0)),
            (
                "% ceiling",
                lambda r: f(r["ceiling_share"] and 100 * r["ceiling_share"], 0),
            ),
        ]
    if any(r["peak_mib"] is not None for r in rows):
        columns += [("peak MiB", lambda r: f(r["peak_mib"], 0))]
    columns += [
        ("workspace MiB", lambda r: f(r["workspace_mib"], 1)),
        ("ratio", lambda r: f(r["ratio_to_vllm"], 2)),
    ]
    if ceiling:
        measured = f"bf16 matmul ceiling measured in this run: {ceiling:.0f} TFLOP/s. "
    else:
        measured = "No GPU: time and workspace only (TFLOP/s, the matmul ceiling and peak memory need one). "
    lines = [
        f"# Continuation prefill on {result['device']}, {result['date']}",
        "",
        measured + f"Ratios are time / {result['baseline']} time (lower is better).",
        "",
        "| " + " | ".join(h for h, _ in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(cell(r) for _, cell in columns)
            + " |"
            + (f" {r['error']}" if r["error"] else "")
        )
    return "\n".join(lines) + "\n"


def plot(result, out_dir, stem):
    """time.png: time against cached_len per preset (first shape and q_len); memory.png
    (when memory-only lengths ran): peak extra memory against cached_len, log-log;
    ratio.png (when several shapes or q_lens ran): time ratio to vLLM per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not r["error"]]
    if not rows:
        return []
    first = rows[0]
    sel = [
        r for r in rows if r["shape"] == first["shape"] and r["q_len"] == first["q_len"]
    ]
    presets = sorted({r["preset"] for r in sel})
    paths = []

    def save(fig, name):
        fig.tight_layout()
        paths.append(os.path.join(out_dir, f"{stem}-{name}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    fig, axes = plt.subplots(
        1, len(presets), figsize=(4.5 * len(presets), 4), squeeze=False
    )
    for ax, preset in zip(axes[0], presets):
        for m in sorted({r["method"] for r in sel}):
            pts = sorted(
                (r["cached_len"], r["time_ms"])
                for r in sel
                if r["preset"] == preset and r["method"] == m and r["time_ms"]
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="cached tokens",
            ylabel="time (ms)",
            title=preset,
        )
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{result['device']}: {first['shape']}, q_len {first['q_len']}")
    save(fig, "time")

    if any(r["time_ms"] is None and r["peak_mib"] is not None for r in sel):
        fig, ax = plt.subplots(figsize=(6, 4.5))
        mem = [
            r
            for r in sel
            if r["preset"] == first["preset"] and r["peak_mib"] is not None
        ]
        for m in sorted({r["method"] for r in mem}):
            pts = sorted(
                {(r["cached_len"], r["peak_mib"]) for r in mem if r["method"] == m}
            )
            ax.plot(
                [p[0] for p in pts], [max(p[1], 0.1) for p in pts], marker="o", label=m
            )
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="cached tokens",
            ylabel="peak extra memory (MiB)",
            title=f"{first['preset']}, {first['shape']}, q_len {first['q_len']}",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "memory")

    groups = sorted({(r["shape"], r["q_len"]) for r in rows})
    chunked = [
        r
        for r in rows
        if r["method"].startswith("chunked")
        and "-w" not in r["method"]
        and r["ratio_to_vllm"]
    ]
    if len(groups) > 1 and chunked:
        method = sorted({r["method"] for r in chunked})[0]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        shapes = sorted({g[0] for g in groups})
        q_lens = sorted({g[1] for g in groups})
        colors = plt.get_cmap("tab10")
        styles = ["-", "--", ":", "-."]
        for shape, q_len in groups:  # color: shape; line style and marker: q_len
            pts = sorted(
                (r["cached_len"], r["ratio_to_vllm"])
                for r in chunked
                if r["method"] == method
                and r["shape"] == shape
                and r["q_len"] == q_len
                and r["preset"] == first["preset"]
            )
            if pts:
                k = q_lens.index(q_len)
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=colors(shapes.index(shape)),
                    linestyle=styles[k % 4],
                    marker="os^Dv"[k % 5],
                    label=f"{shape}, q_len {q_len}",
                )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set(
            xscale="log",
            xlabel="cached tokens",
            ylabel=f"time / {result['baseline']} time",
            title=f"{method}, {first['preset']}: lower is faster",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        save(fig, "ratio")
    return paths


def _sizes_options(sizes):
    """The sizes as the options that give them: ["--presets a,b", "--q-lens 256", ...]."""
    join = lambda xs: ",".join(map(str, xs)) or '""'
    return [f"--{name.replace('_', '-')} {join(sizes[name])}" for name in SIZES["full"]]


def _epilog():
    lines = ["shapes (per-GPU head shapes of real models):"]
    for name, (hq, hk, d) in SHAPES.items():
        lines.append(f"  {name:10} {SHAPE_NOTES[name]}: Hq {hq}, Hk {hk}, D {d}")
    lines += ["", "default sizes of each mode, for the options not given:"]
    for mode, sizes in SIZES.items():
        rows, row = [], []  # options wrapped at 80 characters, never inside one
        for option in _sizes_options(sizes):
            if row and len(" ".join(row + [option])) > 80:
                rows.append(" ".join(row))
                row = []
            row.append(option)
        rows.append(" ".join(row))
        lines.append(f"  {mode + ':':7}{rows[0]}")
        lines += [" " * 9 + r for r in rows[1:]]
    return "\n".join(lines)


def _ints(text):
    """Argparse type: comma-separated positive integers."""
    values = text.split(",")
    for x in values:
        if not x.strip().isdigit() or int(x) <= 0:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated positive integers, got {x!r}"
            )
    return [int(x) for x in values]


def _ints_or_none(text):
    """Argparse type: like _ints, and "" for an empty list."""
    return _ints(text) if text else []


def _windows(text):
    """Argparse type: comma-separated windows, multiples of BLOCK_SIZE; "" for none."""
    values = _ints_or_none(text)
    for w in values:
        if w % BLOCK_SIZE:
            raise argparse.ArgumentTypeError(
                f"{w} is not a multiple of the block size {BLOCK_SIZE}"
            )
    return values


def _name_list(known, what):
    """Argparse type: comma-separated names, each one of known (a list of whats)."""

    def parse_list(text):
        names = text.split(",")
        for name in names:
            if name not in known:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {name!r}; known: {', '.join(known)}"
                )
        return names

    return parse_list


def make_parser(prog="tq-chunked bench"):
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # The size options (presets ... windows) default to None: the mode (full, --quick or
    # --cpu) fills in only those not given, so an explicit option is never replaced.
    p.add_argument(
        "--quick",
        action="store_true",
        help="on a GPU, the quick sizes below (about a minute); on a CPU, the cpu sizes as without it",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="run on the CPU (the default without a GPU) with the cpu sizes below; time and "
        "workspace only",
    )
    p.add_argument(
        "--presets",
        type=_name_list(list(PRESETS), "preset"),
        metavar="NAMES",
        help="comma-separated presets: " + ", ".join(PRESETS),
    )
    p.add_argument(
        "--shapes",
        type=_name_list(list(SHAPES), "shape"),
        metavar="NAMES",
        help="comma-separated head shapes (below): " + ", ".join(SHAPES),
    )
    p.add_argument(
        "--q-lens", type=_ints, metavar="N,...", help="tokens in the prefill chunk"
    )
    p.add_argument(
        "--cached-lens",
        type=_ints,
        metavar="N,...",
        help="tokens already in the cache, timed",
    )
    p.add_argument(
        "--memory-lens",
        type=_ints_or_none,
        metavar="N,...",
        help="cached lengths measured for peak memory only (first preset, shape and q_len; GPU only); "
        '"" for none',
    )
    p.add_argument(
        "--windows",
        type=_windows,
        metavar="W,...",
        help=f'extra windows to time besides the default window, multiples of {BLOCK_SIZE}; "" for none',
    )
    p.add_argument(
        "--methods",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        metavar="PREFIXES",
        help="keep only the methods whose name starts with one of these, e.g. full,chunked-torch",
    )
    p.add_argument(
        "--no-vllm",
        action="store_true",
        help="leave out vLLM's methods (which run on a GPU only)",
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help="directory for the JSON, Markdown and PNG files, created if missing (default: "
        "./%(default)s)",
    )
    p.add_argument("--tag", default="", help="appended to the output file names")
    p.add_argument(
        "--render",
        metavar="JSON",
        help="only rewrite the Markdown table and plots of a result file, next to it",
    )
    engine = p.add_argument_group(
        "engine-shaped modes (GPU with vLLM; see bench_engine.py): layers back to back, "
        "host and GPU time per call, against the latest vLLM's _prefill_attention"
    )
    mode = engine.add_mutually_exclusive_group()
    mode.add_argument(
        "--stack",
        action="store_true",
        help="single requests: 3 head shapes x q_len 512, 2048 x cached 8K, 32K, 128K",
    )
    mode.add_argument(
        "--serving",
        action="store_true",
        help="serving-shaped batches: 1-32 prefix-cache hits of q_len 16-2048 over 1K-64K cached "
        "tokens, with and without first chunks, three head shapes",
    )
    mode.add_argument(
        "--crossover",
        action="store_true",
        help="one short continuation (q_len 8, 32, 128 over 1K, 8K, 64K cached): vLLM's decode "
        "replay against the windowed path",
    )
    engine.add_argument(
        "--layers",
        type=int,
        default=32,
        metavar="L",
        help="layers called back to back (default 32)",
    )
    engine.add_argument(
        "--repeats",
        type=int,
        default=5,
        metavar="R",
        help="interleaved repeats, the median reported (default 5)",
    )
    engine.add_argument(
        "--workloads",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        metavar="NAMES",
        help="keep only the workloads whose name starts with one of these",
    )
    return p


def parse(argv=None, prog="tq-chunked bench"):
    """Parsed arguments, with the mode's default sizes filled in for the options not given."""
    p = make_parser(prog)
    a = p.parse_args(argv)
    if a.cpu or not torch.cuda.is_available():
        a.cpu = True
        if a.memory_lens:
            p.error(
                "argument --memory-lens: peak memory is measured on a GPU only; leave it out on the CPU"
            )
    a.engine_mode = (
        "stack"
        if a.stack
        else "serving"
        if a.serving
        else "crossover"
        if a.crossover
        else None
    )
    a.mode = "cpu" if a.cpu else "quick" if a.quick else "full"
    for name, value in SIZES[a.mode].items():
        if getattr(a, name) is None:
            setattr(a, name, list(value))
    return a


def output_stem(result, args):
    """File name stem: device, date, "-quick" for the quick GPU sizes, the tag."""
    dev = result["device"].replace(" ", "-").lower()
    return (
        f"{dev}-{result['date']}"
        + ("-quick" if args.mode == "quick" else "")
        + (f"-{args.tag}" if args.tag else "")
    )


def run_engine(args):
    """--stack, --serving or --crossover: bench_engine's workloads, written like the grid."""
    from . import bench_engine as be

    if not torch.cuda.is_available():
        raise SystemExit(f"tq-chunked bench: --{args.engine_mode} needs a CUDA GPU")
    workloads = {
        "stack": be.stack_workloads,
        "serving": be.serving_workloads,
        "crossover": be.crossover_workloads,
    }[args.engine_mode]()
    if args.workloads:
        workloads = [
            w for w in workloads if any(w.name.startswith(p) for p in args.workloads)
        ]
    methods = be.methods_available()
    if args.methods:
        methods = {
            k: v
            for k, v in methods.items()
            if any(k.startswith(p) for p in args.methods)
        }
    print(
        f"tq-chunked bench --{args.engine_mode}: {len(workloads)} workloads, methods {', '.join(methods)}, "
        f"{args.layers} layers, {args.repeats} repeats; results into {args.out}"
    )
    rows = be.run_workloads(workloads, methods, args.layers, args.repeats)
    result = {
        "mode": args.engine_mode,
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "layers": args.layers,
        "repeats": args.repeats,
        "methods": list(methods),
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    stem = output_stem(result, args) + f"-{args.engine_mode}"
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    md = be.markdown(result) + "\n" + be.summary(result)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(md)
    png = be.plot(result, os.path.join(args.out, stem + ".png"))
    print(md)
    print(
        "wrote",
        ", ".join(
            [os.path.join(args.out, stem + e) for e in (".json", ".md")]
            + ([png] if png else [])
        ),
    )


def main(argv=None, prog="tq-chunked bench"):
    args = parse(argv, prog)
    if args.engine_mode:
        return run_engine(args)
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        stem = os.path.splitext(args.render)[0]
        with open(stem + ".md", "w") as f:
            f.write(markdown(result))
        print(
            "wrote",
            ", ".join(
                [stem + ".md"]
                + plot(result, os.path.dirname(stem) or ".", os.path.basename(stem))
            ),
        )
        return
    print(
        f"tq-chunked bench on the {'CPU' if args.cpu else 'GPU'}, {args.mode} mode (its sizes for the options "
        f"not given): {' '.join(_sizes_options(vars(args)))}; results into {args.out}"
    )
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    stem = output_stem(result, args)
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write(md)
    paths = plot(result, args.out, stem)
    print(md)
    print(
        "wrote",
        ", ".join([os.path.join(args.out, stem + e) for e in (".json", ".md")] + paths),
    )


if __name__ == "__main__":
    main(prog="python -m tq_chunked.bench")
