"""Demo: one long continuation prefill, windowed and full-buffer, on whatever device is here.

    python -m tq_chunked.demo [--cached-len N] [--q-len N] [--preset NAME]

Prints each path's time and peak extra memory, and their relative difference.
"""

from __future__ import annotations

import argparse
import time

import torch

from . import continuation_prefill, hadamard, lloyd_max_centroids, workspace_bytes
from .format import TQConfig, encode_reference
from .reference import full_buffer_continuation_prefill


def build_case(preset, cached_len, q_len, hq, hk, d, block_size, dtype, device, seed=0, vllm_tq=None):
    """A paged TurboQuant cache holding cached_len + q_len random tokens, shuffled blocks.

    Written by this project's encoder, or, given ``vllm_tq`` (``vllm_harness.build_vllm_tq``),
    by vLLM's own store kernel with vLLM's centroids and rotation.
    Returns (query, key_chunk, val_chunk, kv_cache, block_table, cached_len), kwargs.
    """
    gen = torch.Generator(device).manual_seed(seed)
    cfg = TQConfig.from_preset(preset, d)
    total = cached_len + q_len
    num_blocks = -(-total // block_size)
    kv_cache = torch.zeros(num_blocks, block_size, hk, cfg.slot_bytes, dtype=torch.uint8, device=device)
    block_table = torch.randperm(num_blocks, generator=gen, device=device).int()[None]  # (1, num_blocks)
    if vllm_tq is None:
        centroids = lloyd_max_centroids(d, cfg.centroid_bits).to(device)
        rotation = hadamard(d).to(device)
        store = lambda k, v, slots: encode_reference(k, v, kv_cache, slots, cfg, centroids, rotation)
    else:
        from .vllm_harness import vllm_store
        centroids, rotation = vllm_tq.centroids, vllm_tq.rotation
        store = lambda k, v, slots: vllm_store(vllm_tq, k, v, kv_cache, slots)
    for s in range(0, total, 16384):  # encode in slices: bounded scratch memory
        n = min(16384, total - s)
        pos = torch.arange(s, s + n, device=device)
        key = torch.randn(n, hk, d, generator=gen, device=device, dtype=dtype)
        val = torch.randn(n, hk, d, generator=gen, device=device, dtype=dtype)
        slots = block_table[0].long()[pos // block_size] * block_size + pos % block_size
        store(key, val, slots)
    query = torch.randn(q_len, hq, d, generator=gen, device=device, dtype=dtype)
    key_chunk = torch.randn(q_len, hk, d, generator=gen, device=device, dtype=dtype)
    val_chunk = torch.randn(q_len, hk, d, generator=gen, device=device, dtype=dtype)
    kwargs = dict(preset=preset, centroids=centroids, rotation=rotation, scale=d**-0.5)
    return (query, key_chunk, val_chunk, kv_cache, block_table, cached_len), kwargs


def measure(fn, device, repeats=5):
    """(result, median seconds, peak bytes allocated above the starting point)."""
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
    peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else float("nan")
    return out, sorted(times)[len(times) // 2], peak


def main(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="turboquant_3bit_nc")
    p.add_argument("--cached-len", type=int, default=32768 if cuda else 4096)
    p.add_argument("--q-len", type=int, default=2048 if cuda else 256)
    p.add_argument("--heads", default="32,8" if cuda else "8,2", help="Hq,Hk")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda" if cuda else "cpu")
    hq, hk = map(int, a.heads.split(","))
    args, kwargs = build_case(a.preset, a.cached_len, a.q_len, hq, hk, a.head_dim, 16, torch.float16, device)
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}; {a.preset}, cached_len {a.cached_len}, "
          f"q_len {a.q_len}, Hq {hq}, Hk {hk}, D {a.head_dim}")
    chunked, t_c, m_c = measure(lambda: continuation_prefill(*args, **kwargs, window=a.window), device)
    full, t_f, m_f = measure(lambda: full_buffer_continuation_prefill(*args, **kwargs), device)
    diff = ((chunked.double() - full.double()).norm() / full.double().norm()).item()
    mib = lambda b: f"{b / 2**20:8.1f} MiB" if b == b else "     n/a"
    print(f"{'path':12} {'time':>10} {'peak extra':>12}")
    print(f"{'chunked':12} {t_c * 1e3:8.2f} ms {mib(m_c)}")
    print(f"{'full-buffer':12} {t_f * 1e3:8.2f} ms {mib(m_f)}")
    from .workspace import default_window
    window = a.window or default_window(hk, a.head_dim, 16)
    ws = workspace_bytes(a.q_len, hq, hk, a.head_dim, window, torch.float16)
    print(f"chunked workspace (window {window}): {ws / 2**20:.1f} MiB, independent of cached_len")
    print(f"relative difference |chunked - full| / |full| = {diff:.2e}")


if __name__ == "__main__":
    main()
