"""Where the time of one chunked continuation prefill goes, stage by stage (GPU).

    python benchmarks/breakdown.py [--cached-len 131072] [--windows 8192,16384]

Times each stage of the window loop on its own (all windows' dequant, all windows'
attention, the merges, the query rotation, the chunk's causal block) next to the
whole call, with the same inputs. Stage times add up to about the whole call.
"""

import argparse

import torch
import triton.testing

from tq_chunked import continuation_prefill, workspace_bytes
from tq_chunked.attention import partial_attention, resolve_backend
from tq_chunked.demo import build_case
from tq_chunked.dequant import dequantize_window
from tq_chunked.format import TQConfig
from tq_chunked.merge import merge_attn_states
from tq_chunked.rotate import rotate_query
from tq_chunked.workspace import carve


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cached-len", type=int, default=131072)
    p.add_argument("--q-len", type=int, default=2048)
    p.add_argument("--windows", default="8192,16384")
    p.add_argument("--presets", default="turboquant_3bit_nc,turboquant_k8v4")
    a = p.parse_args()
    hq, hk, d = 32, 8, 128
    print(f"{'preset':20} {'W':>6} {'dequant':>8} {'attn':>8} {'merge':>8} {'rotate':>7} {'chunk':>7} "
          f"{'sum':>8} {'whole':>8}  (ms)")
    for preset in a.presets.split(","):
        args, kw = build_case(preset, a.cached_len, a.q_len, hq, hk, d, 16, torch.float16, "cuda")
        q, kc, vc, cache, bt, n_cached = args
        cfg = TQConfig.from_preset(preset, d)
        backend = resolve_backend("auto", q.device, q.dtype, d)
        for w in map(int, a.windows.split(",")):
            ws = torch.empty(workspace_bytes(a.q_len, hq, hk, d, w, q.dtype), dtype=torch.uint8, device="cuda")
            buf = carve(ws, a.q_len, hq, hk, d, w)
            starts = range(0, n_cached, w)
            out = torch.empty_like(q).transpose(0, 1)
            rotate_query(q, None if cfg.key_fp8 else kw["rotation"], buf.q_win)
            t_deq = bench(lambda: [dequantize_window(cache, bt[0], s, min(w, n_cached - s), cfg, kw["centroids"],
                                                     buf.k_win, buf.v_win) for s in starts])
            part, lse = partial_attention(buf.q_win, buf.k_win, buf.v_win, kw["scale"], backend=backend, out=out)
            t_attn = bench(lambda: [partial_attention(buf.q_win, buf.k_win, buf.v_win, kw["scale"], backend=backend,
                                                      out=out) for s in starts])
            buf.state_out.copy_(part)
            buf.state_lse.copy_(lse)
            t_merge = bench(lambda: [merge_attn_states(buf.state_out, buf.state_lse, part, lse, buf.state_out,
                                                       buf.state_lse) for s in starts[1:]])
            t_rot = bench(lambda: rotate_query(q, None if cfg.key_fp8 else kw["rotation"], buf.q_win))
            t_chunk = bench(lambda: partial_attention(q.transpose(0, 1), kc.transpose(0, 1), vc.transpose(0, 1),
                                                      kw["scale"], causal=True, backend=backend, out=out))
            t_all = bench(lambda: continuation_prefill(*args, **kw, window=w, workspace=ws))
            parts = [t_deq, t_attn, t_merge, t_rot, t_chunk]
            print(f"{preset:20} {w:6d} " + " ".join(f"{t:8.3f}" for t in parts[:3]) +
                  f" {t_rot:7.3f} {t_chunk:7.3f} {sum(parts):8.3f} {t_all:8.3f}")


def sweep_dequant(cached_len=131072, window=16384):
    """Time the dequant of cached_len tokens (8 kv heads, D 128) in windows, per kernel
    configuration and format, to pick BLOCK_T/num_warps and see what norm correction costs."""
    from tq_chunked.dequant import _dequant_window_kernel
    import triton
    hk, d = 8, 128
    print(f"dequant of {cached_len} tokens x {hk} heads in windows of {window} (ms)")
    for name, cfg in [("3bit_nc", TQConfig(d, 3, 3, True)), ("3bit_no_nc", TQConfig(d, 3, 3, False)),
                      ("4bit_nc", TQConfig(d, 4, 4, True)), ("k8v4", TQConfig(d, 8, 4, False))]:
        nb = cached_len // 16
        cache = torch.randint(0, 256, (nb, 16, hk, cfg.slot_bytes), dtype=torch.uint8, device="cuda")
        bt = torch.randperm(nb, device="cuda").int()
        cent = torch.randn(2**cfg.centroid_bits, device="cuda")
        k = torch.empty(hk, window, d, dtype=torch.float16, device="cuda")
        v = torch.empty_like(k)
        row = []
        for bt_ in (8, 16, 32, 64):
            for nw in (1, 2, 4, 8):
                def run():
                    for s in range(0, cached_len, window):
                        _dequant_window_kernel[(triton.cdiv(window, bt_), hk)](
                            cache, bt, cent, k, v, s, window, cache.stride(0), cache.stride(1), cache.stride(2),
                            k.stride(0), k.stride(1), v.stride(0), v.stride(1), D=d, BLOCK_SIZE=16,
                            KEY_BITS=cfg.key_bits, KEY_INDEX_BYTES=cfg.key_index_bytes, KEY_BYTES=cfg.key_bytes,
                            VALUE_BITS=cfg.value_bits, VALUE_INDEX_BYTES=cfg.value_index_bytes,
                            NORM_CORRECTION=cfg.norm_correction, FP8_E4B15=False, BLOCK_T=bt_, num_warps=nw,
                            enable_fp_fusion=False)
                row.append((bench(run), bt_, nw))
        best = min(row)
        moved = cached_len * hk * (cfg.slot_bytes + 4 * d) / 1e9  # GB read + written
        print(f"{name:11} best {best[0]:.3f} ms (BLOCK_T {best[1]}, warps {best[2]}, {moved / best[0]:.2f} TB/s); "
              + " ".join(f"{t:.2f}/{b}/{w}" for t, b, w in row))


def profile_calls():
    """Kernel-level profile of whole calls at short contexts (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    for preset, cached in [("turboquant_3bit_nc", 8192), ("turboquant_k8v4", 8192)]:
        args, kw = build_case(preset, cached, 2048, 32, 8, 128, 16, torch.float16, "cuda")
        for _ in range(3):
            continuation_prefill(*args, **kw)
        torch.cuda.synchronize()
        t = bench(lambda: continuation_prefill(*args, **kw))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                continuation_prefill(*args, **kw)
            torch.cuda.synchronize()
        print(f"== {preset} cached {cached}: {t:.3f} ms per call (do_bench); profile of 10 calls:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=50))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
        tiny, tkw = build_case(preset, 16, 16, 32, 8, 128, 16, torch.float16, "cuda")
        print(f"   call overhead (cached 16, q_len 16): {bench(lambda: continuation_prefill(*tiny, **tkw)):.3f} ms")


if __name__ == "__main__":
    mode = __import__("os").environ.get("MODE", "")
    {"sweep": sweep_dequant, "profile": profile_calls}.get(mode, main)()
