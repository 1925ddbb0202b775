"""One long continuation prefill computed two ways on whatever device is here: in
windows (tq_chunked) and through full-size buffers (the algorithm vLLM ships), with
each path's time, memory, and the difference between the two answers.

On a GPU, memory is each call's measured peak. A CPU has no peak-memory counter, so
there it is computed: the chunked path's workspace against the full-buffer path's
K/V buffers, which grow with the context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from . import continuation_prefill, hadamard, lloyd_max_centroids, workspace_bytes
from .chunked import schedule
from .format import PRESETS, TQConfig, encode_reference
from .plan import LongRequest
from .reference import full_buffer_continuation_prefill
from .workspace import default_window

BLOCK_SIZE = 16  # tokens per cache block, vLLM's default
# On a CPU the default window (K + V of 48 MiB: 49152 tokens at Hk 2, D 128) would hold
# the whole demo context in one window; a quarter of the context shows the windowing.
CPU_WINDOWS = 4


def build_batch(
    preset, requests, hq, hk, d, block_size, dtype, device, seed=0, vllm_tq=None
):
    """A paged TurboQuant cache holding several requests' tokens, their blocks shuffled.

    requests: [(cached_len, q_len), ...]. Every token, cached or new, is in the cache (as
    vLLM's store leaves it before attention); the new tokens' K/V are also returned raw.
    Written by this project's encoder, or, given ``vllm_tq`` (``vllm_harness.build_vllm_tq``),
    by vLLM's own store kernel with vLLM's centroids and rotation.
    Returns a dict: query (N, Hq, D), key, value (N, Hk, D), kv_cache, block_table
    (B, max_blocks) int32, query_start_loc and seq_lens (host lists), kwargs.
    """
    gen = torch.Generator(device).manual_seed(seed)
    cfg = TQConfig.from_preset(preset, d)
    need = [-(-(c + q) // block_size) for c, q in requests]
    kv_cache = torch.zeros(
        sum(need), block_size, hk, cfg.slot_bytes, dtype=torch.uint8, device=device
    )
    perm = torch.randperm(sum(need), generator=gen, device=device).int()
    block_table = torch.zeros(
        len(requests), max(need, default=1), dtype=torch.int32, device=device
    )
    if vllm_tq is None:
        centroids = lloyd_max_centroids(d, cfg.centroid_bits).to(device)
        rotation = (
            None if cfg.key_fp8 else hadamard(d).to(device)
        )  # fp8 keys are not rotated
        store = lambda k, v, slots: encode_reference(
            k, v, kv_cache, slots, cfg, centroids, rotation
        )
    else:
        from .vllm_harness import vllm_store

        centroids, rotation = vllm_tq.centroids, vllm_tq.rotation
        store = lambda k, v, slots: vllm_store(vllm_tq, k, v, kv_cache, slots)
    keys, values, qsl, used = [], [], [0], 0
    for r, (cached, q_len) in enumerate(requests):
        block_table[r, : need[r]] = perm[used : used + need[r]]
        used += need[r]
        total = cached + q_len
        for s in range(0, total, 16384):  # encode in slices: bounded scratch memory
            n = min(16384, total - s)
            pos = torch.arange(s, s + n, device=device)
            key = torch.randn(n, hk, d, generator=gen, device=device, dtype=dtype)
            val = torch.randn(n, hk, d, generator=gen, device=device, dtype=dtype)
            store(
                key,
                val,
                block_table[r].long()[pos // block_size] * block_size
                + pos % block_size,
            )
            new = slice(max(0, cached - s), n)  # this slice's new tokens
            keys.append(key[new])
            values.append(val[new])
        qsl.append(qsl[-1] + q_len)
    query = torch.randn(qsl[-1], hq, d, generator=gen, device=device, dtype=dtype)
    empty = torch.empty(0, hk, d, device=device, dtype=dtype)
    return dict(
        query=query,
        key=torch.cat(keys + [empty]),
        value=torch.cat(values + [empty]),
        kv_cache=kv_cache,
        block_table=block_table,
        query_start_loc=qsl,
        seq_lens=[c + q for c, q in requests],
        kwargs=dict(
            preset=preset, centroids=centroids, rotation=rotation, scale=d**-0.5
        ),
    )


def build_case(
    preset,
    cached_len,
    q_len,
    hq,
    hk,
    d,
    block_size,
    dtype,
    device,
    seed=0,
    vllm_tq=None,
):
    """One request of ``build_batch``, as continuation_prefill takes it:
    (query, key_chunk, val_chunk, kv_cache, block_table (1, max_blocks), cached_len), kwargs."""
    b = build_batch(
        preset,
        [(cached_len, q_len)],
        hq,
        hk,
        d,
        block_size,
        dtype,
        device,
        seed,
        vllm_tq,
    )
    return (
        b["query"],
        b["key"],
        b["value"],
        b["kv_cache"],
        b["block_table"],
        cached_len,
    ), b["kwargs"]


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
    1/CPU_WINDOWS of the context on a CPU (a multiple of BLOCK_SIZE, at least one block)."""
    if device.type == "cuda":
        return default_window(hk, d, BLOCK_SIZE)
    return max(BLOCK_SIZE, cached_len // CPU_WINDOWS // BLOCK_SIZE * BLOCK_SIZE)


def full_buffer_bytes(cached_len, q_len, hk, d, dtype):
    """Bytes of the full-buffer path's K/V buffers: the dequantized prefix (two fp16
    (Hk, cached_len, D) tensors) and the concatenated K/V (two (Hk, cached_len + q_len, D)
    tensors of the query's dtype). A lower bound of its scratch memory: O(cached_len)."""
    elem = torch.finfo(dtype).bits // 8
    return 2 * hk * cached_len * d * 2 + 2 * hk * (cached_len + q_len) * d * elem


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
    """The demo's options; their defaults are sized for a GPU when ``cuda`` (default: one is here)."""
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
        help="TurboQuant cache format: %s (default: %%(default)s)"
        % ", ".join(sorted(PRESETS)),
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
        help=f"tokens per window, a multiple of {BLOCK_SIZE} (default: the library's default on a "
        f"GPU; 1/{CPU_WINDOWS} of --cached-len on a CPU, so that it runs in several windows)",
    )
    p.add_argument(
        "--repeats",
        type=_positive_int,
        default=5,
        help="timed calls per path, after one warm-up call (default: %(default)s)",
    )
    return p


def main(argv=None, prog="tq-chunked demo"):
    p = make_parser(prog)
    a = p.parse_args(argv)
    try:
        TQConfig.from_preset(a.preset, a.head_dim)
    except ValueError as e:
        p.error(f"argument --head-dim: {e}")
    if a.window is not None and a.window % BLOCK_SIZE:
        p.error(
            f"argument --window: must be a multiple of the block size {BLOCK_SIZE}, got {a.window}"
        )
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    hq, hk = a.heads
    d, dtype = a.head_dim, torch.float16
    window = a.window or demo_window(a.cached_len, hk, d, device)
    steps, _, rows, _ = schedule(
        (0, a.q_len),
        (a.cached_len + a.q_len,),
        window,
        hq,
        hk,
        d,
        dtype,
        128 << 20,
        device,
    )
    windows = sum(len(s.windows) if isinstance(s, LongRequest) else 1 for s in steps)

    print(
        f"tq_chunked demo on {torch.cuda.get_device_name() if cuda else 'cpu'}: {a.preset}, "
        f"Hq {hq}, Hk {hk}, D {d}, fp16; building a cache of {a.cached_len + a.q_len} tokens ..."
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
    diff = ((chunked.double() - full.double()).norm() / full.double().norm()).item()

    ws = workspace_bytes(a.q_len, hq, hk, d, window)
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    if cuda:
        mem_c = f"peak {mib(m_c)} (workspace {mib(ws)}), independent of cached_len"
        mem_f = f"peak {mib(m_f)}, grows with cached_len"
        mem_title = "peak extra memory (measured)"
    else:
        mem_c = f"workspace {mib(ws)}, independent of cached_len"
        mem_f = f"K/V buffers {mib(full_buffer_bytes(a.cached_len, a.q_len, hk, d, dtype))}, grows with cached_len"
        mem_title = "memory (computed: a CPU has no peak counter)"
    median_ms = lambda ts: f"{statistics.median(ts) * 1e3:10.1f}"
    range_ms = lambda ts: f"{min(ts) * 1e3:.1f}–{max(ts) * 1e3:.1f}"
    print(
        f"{'path':12} {'median ms':>10} {f'min–max of {a.repeats}':>16}   {mem_title}"
    )
    print(f"{'chunked':12} {median_ms(t_c)} {range_ms(t_c):>16}   {mem_c}")
    print(f"{'full-buffer':12} {median_ms(t_f)} {range_ms(t_f):>16}   {mem_f}")
    print(
        f"Computed: attention of {a.q_len} queries over {a.cached_len} cached + {a.q_len} new tokens, "
        f"in {windows} window{'s' if windows > 1 else ''} of up to {rows} keys (chunked) and in one pass over "
        f"full-size buffers (full-buffer); relative difference |chunked - full| / |full| = {diff:.2e}"
    )


if __name__ == "__main__":
    main(prog="python -m tq_chunked.demo")
