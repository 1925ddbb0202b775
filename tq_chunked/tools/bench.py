"""Time and memory of continuation prefill, side by side with vLLM, in one run.

Methods (each where available): baseline (vLLM's own _continuation_prefill with its
FlashAttention: the installed release's, or with --baseline-source another release's,
run in the installed one by tq_chunked/tools/baseline.py), vllm-<version> (the installed
release's, beside a --baseline-source baseline), full (this project's full-buffer
path), and chunked-<backend> per attention back end (-w<W>: another window). vLLM's
methods run on a GPU, with vLLM installed.

Per case: median time (on a GPU CUDA events with L2 flushed between runs; on a CPU
the median of 3 calls), the workspace bytes, the time ratio to the baseline (to full
without vLLM), and on a GPU only: effective TFLOP/s (4*q_len*Hq*D*(cached_len +
q_len/2)), its share of the bf16 matmul ceiling measured in the same run, and peak
extra memory. Writes JSON, a Markdown table and PNG plots into --out; --render
writes the table and plots of a result file (of any mode and version) again, beside it,
and leaves the file as it is.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from .. import PRESETS, continuation_prefill, workspace_bytes
from ..runtime.attention import backend_available
from ..runtime.plan import default_window
from .reference import full_buffer_continuation_prefill
from .testing import SHAPE_NOTES, SHAPES, WORKLOADS, build_case

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
    # On a CPU the default window holds the whole context; a 512-token window shows
    # several windows.
    "cpu": dict(
        presets=["turboquant_3bit_nc"],
        shapes=["70b-tp8"],
        q_lens=[256],
        cached_lens=[1 * K, 4 * K],
        memory_lens=[],
        windows=[512],
    ),
}
# Relative to the current directory; benchmarks/results/ holds the committed runs.
DEFAULT_OUT = "tq-chunked-results"
BASELINE = "baseline"  # the name of vLLM's method the ratios are against
# The modules of the bench extra (pyproject.toml): the progress bar and the plots. Both
# are imported where they are used, so that the command can say which extra is missing.
BENCH_EXTRA = ("tqdm", "matplotlib")
TAG_BYTES = 100  # at most, so that the file names a tag is part of stay under 255 bytes


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
    """One cache of max(cached_lens) + q_len tokens; smaller cached_lens read its
    prefix. With a baseline, vLLM's own store kernel writes the cache, and two vLLM
    impls share its layer: ``tq.impl`` as installed, ``base`` running the baseline."""

    def __init__(self, preset, shape, q_len, max_cached, device, baseline):
        hq, hk, d = SHAPES[shape]
        self.preset, self.shape, self.q_len, self.device = preset, shape, q_len, device
        self.tq = self.base = None
        if baseline is not None:
            from .vllm_harness import build_vllm_tq

            self.tq = build_vllm_tq(preset, hq, hk, d)
            self.base = build_vllm_tq(preset, hq, hk, d).impl
            baseline.attach(self.base, self.tq.layer, device)
        (self.q, self.kc, self.vc, self.cache, self.bt, _), self.kwargs = build_case(
            preset,
            max_cached,
            q_len,
            hq,
            hk,
            d,
            BLOCK_SIZE,
            torch.float16,
            device,
            vllm_tq=self.tq,
        )

    def args(self, cached_len):
        return (self.q, self.kc, self.vc, self.cache, self.bt, cached_len)


def methods_for(device, windows, baseline):
    """Name -> (callable(case, cached_len), memory reset hook(case) or None, window or
    None). ``baseline``: a tq_chunked.tools.baseline.Baseline, or None for no vLLM
    methods."""
    ms = {}
    if baseline is not None:
        from .baseline import continuation_prefill as vllm_call

        def reset(c):  # before the memory call, so that the call's buffers count
            baseline.reset(c.tq.layer, c.device)

        ms[BASELINE] = (
            lambda c, n: vllm_call(c.base, c.tq.layer, *c.args(n)),
            reset,
            None,
        )
        if baseline.source is not None:  # the installed release's too
            ms[f"vllm-{baseline.vllm_version}"] = (
                lambda c, n: vllm_call(c.tq.impl, c.tq.layer, *c.args(n)),
                reset,
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


def grid_device(args):
    """The grid's device: the GPU unless --cpu or there is none."""
    return torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")


def grid_methods(args, baseline, prog="tq-chunked bench"):
    """The grid's methods that --methods keeps (see methods_for); exits with one line
    when a prefix of --methods begins no method this run has."""
    methods = methods_for(grid_device(args), args.windows, baseline)
    note = (
        f" ({BASELINE} and vllm-<version> run on a GPU with vLLM)"
        if baseline is None
        else ""
    )
    keep = select(list(methods), args.methods, "--methods", "method", prog, note)
    return {name: methods[name] for name in keep}


def run(args, baseline=None, methods=None) -> dict:
    """The grid's result (JSON-ready). ``baseline``: a
    tq_chunked.tools.baseline.Baseline (on a GPU with vLLM), or None: this project's
    paths only. ``methods``: grid_methods's (default: computed here)."""
    from tqdm import tqdm

    device = grid_device(args)
    if methods is None:
        methods = grid_methods(args, baseline)
    ceiling = matmul_ceiling_tflops(device)
    # (preset, shape, q_len) groups; time for time_lens, memory only for mem_lens.
    groups = [(p, s, q) for p in args.presets for s in args.shapes for q in args.q_lens]
    jobs = [(g, n, "time") for g in groups for n in args.cached_lens]
    jobs += [(g, n, "memory") for g in groups[:1] for n in args.memory_lens]
    rows, case, case_key = [], None, None
    base_name = BASELINE if BASELINE in methods else "full"
    for (preset, shape, q_len), cached_len, kind in tqdm(
        jobs, desc="bench", unit="case"
    ):
        if case_key != (preset, shape, q_len):
            extra = args.memory_lens if (preset, shape, q_len) == groups[0] else []
            case, case_key = None, (preset, shape, q_len)  # free the last cache first
            if device.type == "cuda":
                torch.cuda.empty_cache()
            max_len = max(args.cached_lens + extra)
            case = CaseData(preset, shape, q_len, max_len, device, baseline)
        hq, hk, d = SHAPES[shape]
        flop = attention_flop(q_len, hq, d, cached_len)
        group_rows = []
        for name, (fn, reset, window) in methods.items():
            if kind == "memory" and not name.startswith(("chunked", BASELINE, "vllm")):
                continue
            w = window or default_window(hk, d, BLOCK_SIZE)
            row = Row(name, preset, shape, q_len, cached_len)
            if name.startswith("chunked"):
                row.workspace_mib = workspace_bytes(q_len, hq, hk, d, w) / 2**20
            call = functools.partial(fn, case, cached_len)
            before = functools.partial(reset, case) if reset else None
            try:
                if kind == "time":
                    row.time_ms = time_ms(call, device)
                    row.tflops = flop / (row.time_ms * 1e-3) / 1e12
                    row.ceiling_share = row.tflops / ceiling if ceiling else None
                row.peak_mib = peak_extra_mib(call, device, before)
            except Exception as e:  # one failing method must not end the sweep
                row.error = f"{type(e).__name__}: {str(e)[:200]}"
            group_rows.append(row)
        base = next(
            (r for r in group_rows if r.method == base_name and r.time_ms), None
        )
        for r in group_rows:
            if base and r.time_ms:
                r.ratio_to_vllm = r.time_ms / base.time_ms
        rows += group_rows
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "matmul_ceiling_tflops": ceiling,
        "baseline": base_name,
        "baseline_source": baseline.describe() if baseline is not None else None,
        "rows": [asdict(r) for r in rows],
    }


def tokens(n) -> str:
    """A token count for a table: whole thousands as "4K", any other count as it is
    ("512", "1536")."""
    return f"{n // K}K" if n >= K and n % K == 0 else str(n)


def markdown(result) -> str:
    """The result as a Markdown table. Columns a run could not measure are left out:
    TFLOP/s and % ceiling without a GPU matmul ceiling, peak MiB where no row has a
    peak."""
    ceiling = result["matmul_ceiling_tflops"]
    rows = result["rows"]
    f = lambda x, p: "" if x is None else f"{x:.{p}f}"
    columns = [  # (header, cell of a row)
        ("preset", lambda r: r["preset"]),
        ("shape", lambda r: r["shape"]),
        ("q_len", lambda r: str(r["q_len"])),
        ("cached", lambda r: tokens(r["cached_len"])),
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
        measured = (
            "No GPU: time and workspace only (TFLOP/s, the matmul ceiling and peak "
            "memory need one). "
        )
    source = result.get("baseline_source")
    lines = [
        f"# Continuation prefill on {result['device']}, {result['date']}",
        "",
        measured
        + f"Ratios are time / {result['baseline']} time (lower is better)."
        + (f" {result['baseline']}: {source}." if source else ""),
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
    """The sizes as the options that give them: ["--presets a,b", "--q-lens 256",
    ...]."""
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


def _positive_int(text):
    """Argparse type: one positive integer."""
    if not text.strip().isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _tag(text):
    """Argparse type: a tag, which goes into the output file names; it must keep
    each of them one file name (no path separator, nothing unprintable) short enough
    for a file system."""
    bad = sorted({c for c in text if c in "/\\" or not c.isprintable()})
    if bad:
        raise argparse.ArgumentTypeError(
            "expected a part of a file name, without "
            f"{' or '.join(map(repr, bad))}, got {text!r}"
        )
    if len(text.encode()) > TAG_BYTES:
        raise argparse.ArgumentTypeError(
            f"expected at most {TAG_BYTES} bytes (it goes into file names), got "
            f"{len(text.encode())}"
        )
    return text


def refuse(prog, message):
    """Exit with status 2 and one line on stderr, as argparse's errors do (without the
    usage, which --help gives)."""
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: the bench's usage is ten lines of
    options, which would bury the one that is wrong."""

    def error(self, message):
        refuse(self.prog, message)


def select(names, prefixes, option, what, prog, note=""):
    """The names that begin with one of the prefixes (all of them without prefixes),
    in order. A prefix that begins none is refused with one line that lists the names:
    it would otherwise select nothing, or silently less than was asked for."""
    unknown = [x for x in prefixes if not any(n.startswith(x) for n in names)]
    if unknown:
        refuse(
            prog,
            f"argument {option}: no {what} of this run begins with "
            f"{' or '.join(map(repr, unknown))}; its {what}s: "
            f"{', '.join(dict.fromkeys(names))}{note}",
        )
    return [n for n in names if not prefixes or any(n.startswith(x) for x in prefixes)]


def make_parser(prog="tq-chunked bench"):
    p = _Parser(
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
        help="on a GPU, the quick sizes below (about a minute); on a CPU, the cpu "
        "sizes as without it",
    )
    p.add_argument(
        "--cpu",
        action="store_true",
        help="run on the CPU (the default without a GPU) with the cpu sizes below; "
        "time and workspace only",
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
        help="cached lengths measured for peak memory only (first preset, shape and "
        'q_len; GPU only); "" for none',
    )
    p.add_argument(
        "--windows",
        type=_windows,
        metavar="W,...",
        help="extra windows to time besides the default window, multiples of "
        f'{BLOCK_SIZE}; "" for none',
    )
    p.add_argument(
        "--methods",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        metavar="PREFIXES",
        help="keep only the methods whose name starts with one of these, e.g. "
        "full,chunked-torch (the engine modes': baseline, floor, tq_chunked, "
        "tq_chunked-windows, tq_chunked-one-call, tq_chunked-default, vllm-<version>, "
        "patched; --memory-bound's also tq_chunked-paged, vllm-decode); a prefix that "
        "begins none is an error",
    )
    p.add_argument(
        "--no-vllm",
        action="store_true",
        help="leave out vLLM's methods (which run on a GPU only)",
    )
    p.add_argument(
        "--baseline-source",
        metavar="PATH",
        help="the baseline is vLLM's own prefill: by default the installed release's; "
        "with this, another release's, from its "
        "vllm/v1/attention/backends/turboquant_attn.py at PATH, run in the installed "
        "vLLM (needs a GPU and vLLM; see tq_chunked/tools/baseline.py)",
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help="directory for the JSON, Markdown and PNG files, created if missing "
        "and checked to be writable before anything runs (default: ./%(default)s)",
    )
    p.add_argument(
        "--tag",
        type=_tag,
        default="",
        help="appended to the output file names (part of a file name: no slash)",
    )
    p.add_argument(
        "--render",
        metavar="JSON",
        help="run nothing: write the Markdown table and plots of a result file (of "
        "any mode and version) beside it, from its rows (for X.json: X.md and "
        "X-*.png, an engine mode's X.png), and say which; X.json is left as it is",
    )
    engine = p.add_argument_group(
        "engine-shaped modes (a GPU with vLLM; see bench_engine.py): layers back to "
        "back, host and GPU time per call, against the baseline's _prefill_attention"
    )
    mode = engine.add_mutually_exclusive_group()
    mode.add_argument(
        "--stack",
        action="store_true",
        help="single requests: 3 head shapes x q_len 512, 2048 x cached 8K, 32K, "
        "128K, and D 256 and q_len 8192 points",
    )
    mode.add_argument(
        "--serving",
        action="store_true",
        help="serving-shaped batches: 1-64 prefix-cache hits of q_len 16-8192 over "
        "0.5K-128K cached tokens, with and without first chunks, every head shape, "
        "fp16 and bf16, every preset",
    )
    mode.add_argument(
        "--crossover",
        action="store_true",
        help="one short continuation (q_len 8, 32, 128 over 1K, 8K, 64K cached): "
        "vLLM's decode replay against the windowed path",
    )
    mode.add_argument(
        "--memory-bound",
        action="store_true",
        help="many short continuations and decodes (B 8-256, q 1-128 over 1K-64K "
        "cached), every head shape and preset, fp16 and bf16: also the memory-bound "
        "path alone (tq_chunked-paged), vLLM's decode kernel on decode batches "
        "(vllm-decode), and the bytes each method reads and at what rate",
    )
    engine.add_argument(
        "--layers",
        type=_positive_int,
        default=32,
        metavar="L",
        help="layers called back to back (default 32)",
    )
    engine.add_argument(
        "--repeats",
        type=_positive_int,
        default=5,
        metavar="R",
        help="interleaved repeats, the median reported (default 5)",
    )
    engine.add_argument(
        "--oracle",
        action="store_true",
        help="also hold layer 0's answer of every method but the floor to the float64 "
        "oracle, request by request (slow at 128K: one float64 attention per request)",
    )
    engine.add_argument(
        "--workloads",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        metavar="NAMES",
        help="keep only the workloads whose name starts with one of these; a prefix "
        "that begins none is an error",
    )
    return p


def parse(argv=None, prog="tq-chunked bench"):
    """Parsed arguments, with the mode's default sizes filled in for the options not
    given."""
    p = make_parser(prog)
    a = p.parse_args(argv)
    if a.cpu or not torch.cuda.is_available():
        a.cpu = True
        if a.memory_lens:
            p.error(
                "argument --memory-lens: peak memory is measured on a GPU only; leave "
                "it out on the CPU"
            )
    engine_modes = [m for m in WORKLOADS if getattr(a, m.replace("-", "_"))]
    a.engine_mode = engine_modes[0] if engine_modes else None
    if a.workloads and not a.engine_mode and not a.render:
        p.error(
            "argument --workloads: selects among the workloads of --stack, --serving, "
            "--crossover or --memory-bound; give one of them"
        )
    if a.engine_mode:  # the workloads are fixed per mode: checked before anything runs
        names = [w.name for w in WORKLOADS[a.engine_mode]()]
        select(names, a.workloads, "--workloads", "workload", prog)
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


def load_baseline(args, prog):
    """The baseline the run compares with (tq_chunked.tools.baseline.Baseline), or None
    when vLLM's methods cannot or should not run here. Exits with an error naming
    --baseline-source when it was given and cannot be used."""
    from .vllm_harness import vllm_available

    why = None
    if args.cpu:
        why = "vLLM's methods run on a GPU only, and this run is on the CPU"
    elif args.no_vllm:
        why = "--no-vllm leaves vLLM's methods out"
    elif not vllm_available():
        why = "vLLM is not installed here (its TurboQuant backend does not import)"
    if why is not None:
        if args.baseline_source is not None:
            raise SystemExit(f"{prog}: error: argument --baseline-source: {why}")
        return None
    from .baseline import BaselineError, load

    try:
        return load(args.baseline_source)
    except BaselineError as e:
        raise SystemExit(f"{prog}: error: argument --baseline-source: {e}") from None


def prepare_out(path, prog="tq-chunked bench"):
    """Create --out if missing and write a probe file into it, so that a run cannot
    end unable to save what it measured; exits with one line when it cannot."""
    if not path:
        refuse(prog, "argument --out: expected a directory, got ''")
    if os.path.exists(path) and not os.path.isdir(path):
        refuse(
            prog,
            f"argument --out: {path} exists and is not a directory; expected a "
            "directory (created if missing)",
        )
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tq-chunked-probe-"):
            pass  # deleted on closing
    except OSError as e:
        refuse(prog, f"argument --out: cannot write into {path}: {e.strerror or e}")


def missing_extra(prog="tq-chunked bench"):
    """None, or the one-line error for a module of the bench extra that does not
    import here."""
    for name in BENCH_EXTRA:
        try:
            importlib.import_module(name)
        except ImportError:
            return (
                f"{prog}: error: the benchmarks need the bench extra ({name} is not "
                'installed): pip install "tq-chunked[bench]", or pip install -e '
                '".[bench]" in a checkout'
            )
    return None


def run_engine(args, prog="tq-chunked bench"):
    """--stack, --serving, --crossover or --memory-bound: bench_engine's workloads,
    written like the grid."""
    from . import bench_engine as be

    if not torch.cuda.is_available():
        raise SystemExit(f"{prog}: error: --{args.engine_mode} needs a CUDA GPU")
    baseline = load_baseline(args, prog)
    if baseline is None:
        raise SystemExit(
            f"{prog}: error: --{args.engine_mode} needs vLLM installed (its "
            "TurboQuant backend does not import here)"
        )
    workloads = WORKLOADS[args.engine_mode]()
    names = [w.name for w in workloads]
    keep = select(names, args.workloads, "--workloads", "workload", prog)
    workloads = [w for w in workloads if w.name in keep]
    methods = be.methods_available(baseline, args.engine_mode)
    keep = select(list(methods), args.methods, "--methods", "method", prog)
    methods = {name: methods[name] for name in keep}
    prepare_out(args.out, prog)
    print(
        f"{prog} --{args.engine_mode}: {len(workloads)} workloads, methods "
        f"{', '.join(methods)}, {args.layers} layers, {args.repeats} repeats; "
        f"baseline: {baseline.describe()}; results into {args.out}"
    )
    rows = be.run_workloads(
        workloads, methods, args.layers, args.repeats, oracle=args.oracle
    )
    result = {
        "mode": args.engine_mode,
        "device": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "layers": args.layers,
        "repeats": args.repeats,
        "methods": list(methods),
        "baseline": be.BASELINE,
        "baseline_source": baseline.describe(),
        "rows": rows,
    }
    stem = os.path.join(args.out, output_stem(result, args) + f"-{args.engine_mode}")
    save(result, stem)


# What --render needs of a result file: the top-level keys and each row's keys, per
# kind (grid: the default, --quick and --cpu; engine: --stack, --serving, --crossover,
# --memory-bound).
RESULT_KEYS = {
    "grid": (
        ("device", "date", "matmul_ceiling_tflops", "baseline", "rows"),
        ("method", "preset", "shape", "q_len", "cached_len", "time_ms", "tflops")
        + ("ceiling_share", "peak_mib", "workspace_mib", "ratio_to_vllm", "error"),
    ),
    "engine": (
        ("mode", "device", "date", "layers", "repeats", "rows"),
        ("workload", "shape", "preset", "requests", "q_tokens", "cached_tokens")
        + ("method", "stack_ms", "host_ms_per_call", "gpu_ms_per_call"),
    ),
}


class ResultError(ValueError):
    """A file --render cannot read as a result of tq-chunked bench."""


def read_result(path):
    """(result, kind) of a results JSON written by tq-chunked bench, of any version;
    kind is "grid" or "engine". Raises ResultError with a one-line reason."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ResultError(f"cannot read {path}: {e.strerror}") from None
    try:
        result = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResultError(
            f"{path} is not JSON (line {e.lineno}, column {e.colno}: {e.msg})"
        ) from None
    expected = (
        "expected a result of tq-chunked bench (keys "
        + "; ".join(f"{k}: {', '.join(top)}" for k, (top, _) in RESULT_KEYS.items())
        + ")"
    )
    if not isinstance(result, dict):
        raise ResultError(f"{path} holds a JSON {type(result).__name__}; {expected}")
    kind = "engine" if "mode" in result else "grid"
    top, row_keys = RESULT_KEYS[kind]
    missing = [k for k in top if k not in result]
    if missing:
        raise ResultError(f"{path} has no {', '.join(missing)}; {expected}")
    rows = result["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ResultError(f"{path}: rows is not a list of objects; {expected}")
    for i, r in enumerate(rows):
        missing = [k for k in row_keys if k not in r]
        if missing:
            raise ResultError(
                f"{path}: row {i} has no {', '.join(missing)} (a {kind} result's rows "
                f"have {', '.join(row_keys)})"
            )
    return result, kind


def write_report(result, stem):
    """Write STEM.md and the plots of a result beside STEM; returns the Markdown and
    the paths written."""
    from . import bench_engine as be

    if "mode" in result:  # an engine result
        md = be.markdown(result) + "\n" + be.summary(result)
        png = be.plot(result, stem + ".png")
        paths = [png] if png else []
    else:
        md = markdown(result)
        paths = plot(result, os.path.dirname(stem) or ".", os.path.basename(stem))
    with open(stem + ".md", "w") as f:
        f.write(md)
    return md, [stem + ".md"] + paths


def save(result, stem):
    """A run's end: STEM.json, the Markdown and the plots, and what was written."""
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    md, paths = write_report(result, stem)
    print(md + "\nwrote " + ", ".join([stem + ".json"] + paths))


def render(path, prog="tq-chunked bench"):
    """--render: write the Markdown and plots of a result file beside it (STEM.md and
    the plots for STEM.json), and say which; the result file is only read."""
    stem, ext = os.path.splitext(path)
    if ext.lower() in (".md", ".png"):  # what would be written: the file itself
        raise SystemExit(
            f"{prog}: error: argument --render: {path} would be overwritten by its "
            "own table or plot; expected the result's .json"
        )
    try:
        result, _ = read_result(path)
    except ResultError as e:
        raise SystemExit(f"{prog}: error: argument --render: {e}") from None
    md, paths = write_report(result, stem)
    print(md + f"\nwrote {', '.join(paths)} from {path}, which is left as it is")


def main(argv=None, prog="tq-chunked bench"):
    # Everything that can be refused is, before any benchmark work: the options
    # (parse), the extra, then per mode the machine, the baseline, --methods and --out.
    args = parse(argv, prog)
    error = missing_extra(prog)
    if error:
        raise SystemExit(error)
    if args.render:
        return render(args.render, prog)
    if args.engine_mode:
        return run_engine(args, prog)
    baseline = load_baseline(args, prog)
    methods = grid_methods(args, baseline, prog)
    prepare_out(args.out, prog)
    print(
        f"{prog} on the {'CPU' if args.cpu else 'GPU'}, {args.mode} mode (its sizes "
        f"for the options not given): {' '.join(_sizes_options(vars(args)))}; "
        + (f"baseline: {baseline.describe()}; " if baseline else "")
        + f"results into {args.out}"
    )
    result = run(args, baseline, methods)
    save(result, os.path.join(args.out, output_stem(result, args)))


if __name__ == "__main__":
    main(prog="python -m tq_chunked.tools.bench")
