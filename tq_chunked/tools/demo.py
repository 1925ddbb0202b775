"""One long continuation prefill computed two ways on whatever device is here: in
windows (tq_chunked) and through full-size buffers (the algorithm vLLM ships), with
each path's time, memory, and how far apart the two answers are.

On a GPU, memory is each call's measured peak. A CPU has no peak-memory counter, so
there it is computed: the chunked path's workspace against the full-buffer path's
K/V buffers, which grow with the context.

The answers: both paths round the cached keys to fp16, each in its own place, so they
differ by about fp16's rounding (a few 1e-4, relative). What decides whether the
windowed path is right is its error against a float64 oracle (exact attention over the
decoded cache), compared with the full-buffer path's: the demo checks the bound the
test suite holds it to, chunked <= 1.1 x full-buffer + 1e-4, and exits with status 1
if it fails.

CPU times do not represent a GPU: on a CPU each window's steps (dequantizing,
attention, merging) run one after another at the CPU's speed, and the windowed path is
often slower there than one pass over full-size buffers. `tq-chunked bench` on a GPU
and docs/benchmarks.md give the GPU figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from .. import continuation_prefill, workspace_bytes
from ..runtime.format import PRESETS, TQConfig
from ..runtime.plan import LongRequest, default_window, make_plan
from .reference import full_buffer_continuation_prefill, oracle_continuation_prefill
from .testing import build_case, rel_err

BLOCK_SIZE = 16  # tokens per cache block, vLLM's default
# On a CPU the default window (K + V of 127 MiB: 130048 tokens at Hk 2, D 128) would
# hold the whole demo context in one window; a quarter of the context shows the
# windowing.
CPU_WINDOWS = 4
# Sequence lengths are int32, as vLLM keeps them: cached + new tokens at most this.
MAX_TOKENS = 2**31 - 1
# What the demo holds per token of the context (cached + new), measured on a CPU at 4K
# and 32K cached tokens (586 and 1628 MiB at Hq 8, Hk 2, D 128, q 256), rounded up: per
# (kv head x D) element, the cache, the encoder's float32 K/V, the full-buffer path's
# fp16 buffers, the float64 oracle's K/V; per (query head x query token), the oracle's
# float64 scores and their softmax. Plus what torch and the process take at start.
BYTES_PER_KV_ELEMENT, BYTES_PER_SCORE, BASE_BYTES = 64, 16, 512 << 20
# The bound the tests hold the windowed path to (tests/test_chunked.py, test_varlen.py):
# its error against the float64 oracle at most FACTOR x the full-buffer path's + SLACK.
FACTOR, SLACK = 1.1, 1e-4
CPU_NOTE = (
    "CPU times do not represent a GPU: here each window's steps run one after another "
    "at the CPU's speed, and the windowed path is often the slower one; on a GPU run "
    "`tq-chunked bench` (docs/benchmarks.md has the H200's figures)."
)


def measure(fn, device, repeats=5):
    """(result, seconds of each repeat, peak bytes allocated above the starting point;
    NaN where the device cannot measure it)."""
    fn()  # warm-up: compilation, autotuning
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times, out = [], None
    for _ in range(repeats):
        out = None  # the last result is not held while the next call runs
        t = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = (
        torch.cuda.max_memory_allocated() - base
        if device.type == "cuda"
        else float("nan")
    )
    return out, times, peak


def demo_window(cached_len, hk, d, device):
    """The window the demo uses when none is given: the library's default on a GPU, a
    1/CPU_WINDOWS of the context on a CPU (a multiple of BLOCK_SIZE, at least one
    block)."""
    if device.type == "cuda":
        return default_window(hk, d, BLOCK_SIZE)
    return max(BLOCK_SIZE, cached_len // CPU_WINDOWS // BLOCK_SIZE * BLOCK_SIZE)


def full_buffer_bytes(cached_len, q_len, hk, d, dtype):
    """Bytes of the full-buffer path's K/V buffers: the dequantized prefix (two fp16
    (Hk, cached_len, D) tensors) and the concatenated K/V (two (Hk, cached_len + q_len,
    D) tensors of the query's dtype). A lower bound of its scratch memory:
    O(cached_len)."""
    elem = torch.finfo(dtype).bits // 8
    return 2 * hk * cached_len * d * 2 + 2 * hk * (cached_len + q_len) * d * elem


def demo_bytes(cached_len, q_len, hq, hk, d):
    """About how much memory the demo takes at these sizes (BYTES_PER_KV_ELEMENT's
    measurement): it grows with the context, as the full-buffer path and the oracle
    do."""
    tokens = cached_len + q_len
    return BASE_BYTES + tokens * (
        hk * d * BYTES_PER_KV_ELEMENT + hq * q_len * BYTES_PER_SCORE
    )


def available_bytes(device):
    """Memory free for the demo on ``device``: the GPU's free memory, or the host's
    available memory (Linux's MemAvailable); None where the system does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def size_error(cached_len, q_len, hq, hk, d, available):
    """Why these sizes cannot run here (one line), or None: the context must fit
    int32 lengths, and the demo's memory (``demo_bytes``) the ``available`` bytes
    (None: not checked)."""
    tokens = cached_len + q_len
    if tokens > MAX_TOKENS:
        return (
            f"argument --cached-len: cached + new tokens must be at most {MAX_TOKENS} "
            f"(int32 sequence lengths, as vLLM keeps them), got {cached_len} + {q_len}"
        )
    need = demo_bytes(cached_len, q_len, hq, hk, d)
    if available is not None and need > available:
        gib = 2**30
        fits = (available - BASE_BYTES) // (
            hk * d * BYTES_PER_KV_ELEMENT + hq * q_len * BYTES_PER_SCORE
        )
        return (
            f"argument --cached-len: {cached_len} cached + {q_len} new tokens at Hq "
            f"{hq}, Hk {hk}, D {d} need about {need / gib:.1f} GiB (the cache, the "
            f"full-buffer path's K/V and the float64 oracle grow with the context); "
            f"{available / gib:.1f} GiB is available here: at most about "
            f"{max(0, fits - q_len)} cached tokens fit"
        )
    return None


def accuracy_lines(chunked, full, oracle):
    """(lines to print, whether the bound holds): the two answers' difference, and each
    one's error against the float64 oracle with the bound the tests use."""
    diff = rel_err(chunked, full.double())
    e_chunked, e_full = rel_err(chunked, oracle), rel_err(full, oracle)
    bound = FACTOR * e_full + SLACK
    ok = e_chunked <= bound
    lines = [
        (
            f"Difference between the answers: |chunked - full| / |full| = {diff:.2e} "
            "(expected: about fp16's rounding, a few 1e-4; each path rounds the cached "
            "keys to fp16 in its own place)."
        ),
        f"Error against a float64 oracle (exact attention over the decoded cache): "
        f"chunked {e_chunked:.2e}, full-buffer {e_full:.2e}. Bound (the tests'): "
        f"chunked <= {FACTOR} x full-buffer + {SLACK:.0e} = {bound:.2e}: "
        + ("passed." if ok else "FAILED."),
    ]
    return lines, ok


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _heads(text):
    parts = text.split(",")
    if len(parts) != 2 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
        raise argparse.ArgumentTypeError(
            f"expected Hq,Hk: two positive integers such as 8,2, got {text!r}"
        )
    hq, hk = int(parts[0]), int(parts[1])
    if hq % hk:
        raise argparse.ArgumentTypeError(
            f"query heads must be a multiple of KV heads, got {text!r}"
        )
    return hq, hk


def make_parser(prog="tq-chunked demo", cuda=None):
    """The demo's options; their defaults are sized for a GPU when ``cuda`` (default:
    whether one is here)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset",
        default="turboquant_3bit_nc",
        choices=sorted(PRESETS),
        metavar="NAME",
        help=f"TurboQuant cache format: {', '.join(sorted(PRESETS))} "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--cached-len",
        type=_positive_int,
        default=32768 if cuda else 4096,
        help="tokens already in the cache (default here: %(default)s)",
    )
    p.add_argument(
        "--q-len",
        type=_positive_int,
        default=2048 if cuda else 256,
        help="tokens in the new prefill chunk (default here: %(default)s)",
    )
    p.add_argument(
        "--heads",
        type=_heads,
        default=(32, 8) if cuda else (8, 2),
        metavar="HQ,HK",
        help="query heads and KV heads (default here: %s)"
        % ("32,8" if cuda else "8,2"),
    )
    p.add_argument(
        "--head-dim",
        type=_positive_int,
        default=128,
        help="head size D (default: %(default)s)",
    )
    p.add_argument(
        "--window",
        type=_positive_int,
        default=None,
        help=f"tokens per window, a multiple of {BLOCK_SIZE} (default: the library's "
        f"default on a GPU; 1/{CPU_WINDOWS} of --cached-len on a CPU, so that it runs "
        "in several windows)",
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=5,
        help="timed calls per path, after one warm-up call (default: %(default)s)",
    )
    return p


def main(argv=None, prog="tq-chunked demo"):
    """Runs the demo; returns 0, or 1 when the windowed answer fails the bound."""
    p = make_parser(prog)
    a = p.parse_args(argv)
    try:
        TQConfig.from_preset(a.preset, a.head_dim)
    except ValueError as e:
        p.error(f"argument --head-dim: {e}")
    if a.window is not None and a.window % BLOCK_SIZE:
        p.error(
            f"argument --window: must be a multiple of the block size {BLOCK_SIZE}, "
            f"got {a.window}"
        )
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    hq, hk = a.heads
    d, dtype = a.head_dim, torch.float16
    error = size_error(a.cached_len, a.q_len, hq, hk, d, available_bytes(device))
    if error is not None:  # one line, before anything is allocated
        p.exit(2, f"{p.prog}: error: {error}\n")
    window = a.window or demo_window(a.cached_len, hk, d, device)
    plan = make_plan(
        (0, a.q_len),
        (a.cached_len + a.q_len,),
        window=window,
        num_q_heads=hq,
        num_kv_heads=hk,
        head_dim=d,
        dtype=dtype,
        budget=128 << 20,
        device=device,
    )
    rows = plan.capacity
    windows = sum(
        len(s.windows) if isinstance(s, LongRequest) else 1 for s in plan.units
    )

    print(
        f"tq_chunked demo on {torch.cuda.get_device_name() if cuda else 'cpu'}: "
        f"{a.preset}, Hq {hq}, Hk {hk}, D {d}, fp16; building a cache of "
        f"{a.cached_len + a.q_len} tokens ..."
    )
    args, kwargs = build_case(
        a.preset, a.cached_len, a.q_len, hq, hk, d, BLOCK_SIZE, dtype, device
    )
    chunked, t_c, m_c = measure(
        lambda: continuation_prefill(*args, **kwargs, window=window), device, a.repeats
    )
    full, t_f, m_f = measure(
        lambda: full_buffer_continuation_prefill(*args, **kwargs), device, a.repeats
    )

    ws = workspace_bytes(a.q_len, hq, hk, d, window)

    def mib(b):
        return f"{b / 2**20:.1f} MiB"

    # The workspace is set by the window, not by the context: the default window's is
    # the library's 128 MiB budget at any cached_len; the CPU demo's smaller window (a
    # quarter of its context unless --window says) makes it small there.
    if cuda:
        mem_c = f"peak {mib(m_c)} (workspace {mib(ws)}, set by the window)"
        mem_f = f"peak {mib(m_f)}, grows with cached_len"
        mem_title = "peak extra memory (measured)"
    else:
        mem_c = f"workspace {mib(ws)}, set by the window, not by cached_len"
        buffers = full_buffer_bytes(a.cached_len, a.q_len, hk, d, dtype)
        mem_f = f"K/V buffers {mib(buffers)}, grows with cached_len"
        mem_title = "memory (computed: a CPU has no peak counter)"

    def median_ms(ts):
        return f"{statistics.median(ts) * 1e3:10.1f}"

    def range_ms(ts):
        return f"{min(ts) * 1e3:.1f}–{max(ts) * 1e3:.1f}"

    repeats = f"min–max of {a.repeats}"
    print(f"{'path':12} {'median ms':>10} {repeats:>16}   {mem_title}")
    print(f"{'chunked':12} {median_ms(t_c)} {range_ms(t_c):>16}   {mem_c}")
    print(f"{'full-buffer':12} {median_ms(t_f)} {range_ms(t_f):>16}   {mem_f}")
    print(
        f"Computed: attention of {a.q_len} queries over {a.cached_len} cached + "
        f"{a.q_len} new tokens, in {windows} window{'s' if windows > 1 else ''} of up "
        f"to {rows} keys (chunked) and in one pass over full-size buffers "
        "(full-buffer)."
    )
    lines, ok = accuracy_lines(
        chunked, full, oracle_continuation_prefill(*args, **kwargs)
    )
    print("\n".join(lines))
    if not cuda:
        print(CPU_NOTE)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(prog="python -m tq_chunked.tools.demo"))
