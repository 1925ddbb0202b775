"""Where the host time of one continuation_prefill_varlen call goes (GPU).

    python benchmarks/host_profile.py

For a single request (Hq 32, Hk 8, q 512, 8K cached) and a batch of 16 prefix-cache
hits: the host time per call with the GPU kept busy (so the host never waits), each
piece of the call timed alone the same way, and a cProfile of 30 calls (top functions
by own time).
"""

import cProfile
import pstats
import statistics
import time

import torch

from tq_chunked import continuation_prefill_varlen, workspace_bytes
from tq_chunked.attention import varlen_attention
from tq_chunked.chunked import schedule
from tq_chunked.demo import build_batch
from tq_chunked.dequant import dequantize_window
from tq_chunked.format import TQConfig
from tq_chunked.merge import merge_attn_states
from tq_chunked.prepare import prepare
from tq_chunked.workspace import carve, default_window


def host_us(fn, n=200):
    """Median host microseconds of fn() with the GPU busy (a spin kernel ahead of it)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        torch.cuda._sleep(2_000_000)  # ~1 ms of GPU work ahead of the call
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main():
    for name, requests in [("1 hit q512 8K", [(8192, 512)]), ("16 hits q256 1K-8K", [(1024 + 448 * i, 256)
                                                                                  for i in range(16)])]:
        b = build_batch("turboquant_3bit_nc", requests, 32, 8, 128, 16, torch.float16, "cuda")
        n = b["query"].shape[0]
        window = default_window(8, 128, 16)
        ws = torch.empty(workspace_bytes(n, 32, 8, 128, window), dtype=torch.uint8, device="cuda")
        qsl_cpu = torch.tensor(b["query_start_loc"], dtype=torch.int32)
        lens_cpu = torch.tensor(b["seq_lens"], dtype=torch.int32)
        args = (b["query"], b["key"], b["value"], b["kv_cache"], b["block_table"], qsl_cpu.cuda(), lens_cpu.cuda())
        call = lambda: continuation_prefill_varlen(*args, **b["kwargs"], query_start_loc_cpu=qsl_cpu,
                                                   seq_lens_cpu=lens_cpu, window=window, workspace=ws,
                                                   check_block_table=False)
        print(f"== {name}: whole call {host_us(call):.0f} us host")
        tiles, _ = schedule(tuple(b["query_start_loc"]), tuple(b["seq_lens"]), window, 32, 8, 128,
                            torch.float16, 128 << 20, torch.device("cuda"))
        plan = tiles[0].plan  # the first tile's pieces
        n, g = plan.num_tokens, tiles[0].kv_group
        cfg = TQConfig.from_preset("turboquant_3bit_nc", 128)
        single = len(plan.windows) == 1
        regions = ("k_buf", "v_buf", "q_buf") + (("part",) if single else ("state_out", "state_lse"))
        bufs = carve(ws, regions, n, 4 * g, g, 128, plan.window, torch.float16, single=single)
        out = torch.empty_like(b["query"][:n])
        call0 = plan.windows[0]
        part = (bufs.part if single else out)[call0.q0:call0.q1]
        lse = varlen_attention(call0, bufs.q_buf[call0.q0:call0.q1], bufs.k_buf, bufs.v_buf, 0.1, part, "flash")
        pieces = {
            "schedule (cached)": lambda: schedule(tuple(b["query_start_loc"]), tuple(b["seq_lens"]), window, 32, 8, 128,
                                                  torch.float16, 128 << 20, torch.device("cuda"),
                                                  torch.cuda.current_stream()),
            "carve": lambda: carve(ws, regions, n, 4 * g, g, 128, plan.window, torch.float16, single=single),
            "torch.empty_like(query)": lambda: torch.empty_like(b["query"]),
            "slice": lambda: bufs.q_buf[call0.q0:call0.q1],
            "prepare (Triton)": lambda: prepare(b["query"], b["key"], b["value"], b["kwargs"]["rotation"], 0, 0, bufs,
                                                init_lse=not single, chunk16=False),
            "dequantize_window (Triton)": lambda: dequantize_window(b["kv_cache"], b["block_table"], cfg,
                                                                    b["kwargs"]["centroids"], plan, call0, 0,
                                                                    bufs.k_buf, bufs.v_buf),
            "FlashAttention, a window": lambda: varlen_attention(call0, bufs.q_buf[call0.q0:call0.q1], bufs.k_buf,
                                                                 bufs.v_buf, 0.1, part, "flash"),
            "FlashAttention, the chunk": lambda: varlen_attention(plan.chunk, b["query"][:n], b["key"][:n],
                                                                  b["value"][:n], 0.1, out, "flash"),
            "merge (Triton)": lambda: merge_attn_states(out, lse, part, lse, out, None, row0=call0.q0),
        }
        print(f"   {len(plan.windows)} windows, {len(tiles)} tiles")
        for piece, fn in pieces.items():
            print(f"   {piece:32} {host_us(fn):7.1f} us")
        prof = cProfile.Profile()
        torch.cuda._sleep(400_000_000)  # ~200 ms of GPU work: the host never waits
        prof.enable()
        for _ in range(30):
            call()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
