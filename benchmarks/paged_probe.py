"""The memory-bound path (tq_chunked/runtime/paged.py) on the H200: exactness
first, then its GPU time beside the window path, the floor and vLLM's own decode kernel,
on a memory-bound grid (GPU).

    python benchmarks/paged_probe.py [OUT_DIR] [--workloads "decode,64 hits"]
        [--skip-exactness] [--no-configs]
    python benchmarks/paged_probe.py --ncu [--workloads ...] [--ncu-launches
        default,0.6.3,no-prefetch,transposed]

With --ncu, only one launch of the cached part per workload and launch, for Nsight
Compute (``bash benchmarks/run_on_device.sh ncu-paged``).

1. Exactness (fails loudly, exit status 1, after the timings): for every preset, fp16
   and bf16, a batch of 8 requests (q 1, 4 and 16 over 300-3000 cached, Hq/Hk 32/8, D
   128, the project's encoder): each request's error against the float64 oracle
   within 1.1x the full path's (FlashAttention-3; 1.6x for 1-3 query tokens) + 1e-4;
   the same with the cache in vLLM 0.33's head-major layout; the 3- and 4-bit centroids
   (and 3-bit values) by byte permutes bit for bit as the gather (the arithmetic);
   the output with the dots' operands behind ``paged._operand`` within 1e-3 of
   Triton's own fragments' (``fence=False``; equal bits and that path's error
   reported); the default register cap's bits against Triton's own count's
   (reported); one request of 32K positions in one split (the tensor cores'
   truncating accumulation, NOTES.md §27); and, reported, the error without the
   query's fp16 remainder and with it (``q_split=False``, ``True``: the default
   takes it for fp16 queries alone, ``paged.q_split_by_default``).
2. Timings, per workload (GPU kernel time per call: torch.profiler, every kernel's
   time summed over 10 calls): the floor (one FlashAttention-3 varlen call over fp16
   K/V of the same lengths), the window path (``continuation_prefill_varlen`` as the
   plugin calls it), the memory-bound path (``paged_attention`` from a plan made and
   uploaded once, after the chunk's causal call: what a step's run does), its cached
   part alone at a few launches (block_n, programs per SM, warps; 0.6.3's (16, 64,
   4); the slots prefetched at the other two of 0, 1 and 2 tiles ahead; without the
   register cap; with
   Triton's own MMA fragments), and for decode (q 1) vLLM's
   ``triton_turboquant_decode_attention``. Bytes: the quantized slots read and fp16
   K/V, each over 4.3 TB/s, and the rate the memory-bound path reads its slots at.
3. JSON (paged-probe.json, after each workload) and a table, last.
"""

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback

import torch
from breakdown import floor_of, profile_ms

from tq_chunked import (
    ContinuationPrefill,
    continuation_prefill_varlen,
    default_window,
    workspace_bytes,
)
from tq_chunked.runtime.attention import make_call, resolve_backend, varlen_attention
from tq_chunked.runtime.format import PRESETS, TQConfig
from tq_chunked.runtime.paged import (
    paged_attention,
    paged_continuation_prefill_varlen,
    plan_paged,
)
from tq_chunked.tools.reference import (
    full_buffer_continuation_prefill,
    oracle_continuation_prefill,
)
from tq_chunked.tools.testing import (
    SHAPES,
    build_batch,
    memory_bound_workloads,
    rel_err,
)

K = 1024
COPY_RATE = 4.3e12  # bytes per second, the H200's measured copy rate


def grid():
    """(name, shape, requests, preset, dtype) of the memory-bound grid
    (``testing.memory_bound_workloads``, as ``tq-chunked bench --memory-bound``
    runs it)."""
    return [
        (w.name, w.shape, w.requests, w.preset, w.dtype)
        for w in memory_bound_workloads()
    ]


def kernel_ms(call):
    """GPU kernel time per call: every kernel's time, summed (host gaps excluded)."""
    return sum(profile_ms(call).values())


def kernels_ms(call, calls=10):
    """GPU time per call of each kernel, by name (the first 60 characters)."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return {
        e.key[:60]: round(e.self_device_time_total / 1e3 / calls, 4)
        for e in prof.key_averages()
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0
    }


class Paged:
    """The memory-bound path as a step runs it: planned and uploaded once, then per
    call the chunk's causal attention and ``paged_attention``."""

    def __init__(self, b, hq, hk, d, dtype, **launch):
        qsl, lens = b["query_start_loc"], b["seq_lens"]
        self.cfg = TQConfig.from_preset(b["kwargs"]["preset"], d)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.plan = plan_paged(qsl, lens, hq, hk, d, self.cfg, sms=sms, **launch)
        self.work, self.tokens = self.plan.upload("cuda")
        buf = torch.empty(self.plan.scratch_bytes, dtype=torch.uint8, device="cuda")
        self.scratch = self.plan.carve(buf)
        q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
        self.call = make_call(q_lens, q_lens, True, "cuda")
        self.b = b
        self.out = torch.empty_like(b["query"])
        self.new = torch.empty_like(b["query"])
        self.backend = resolve_backend("auto", b["query"].device, d)
        self.kw = {k: v for k, v in b["kwargs"].items() if k != "preset"}

    def cached(self, new=None, new_lse=None, **kw):
        """The cached part, merged with ``new`` where given; with the plan's
        own_keys, the chunk's own keys too (the combine reads them)."""
        b = self.b
        own = dict(key=b["key"], value=b["value"]) if self.plan.own_keys else {}
        paged_attention(
            b["query"], b["kv_cache"], b["block_table"], self.plan, self.work,
            self.tokens, self.scratch, self.out, cfg=self.cfg, new=new,
            new_lse=new_lse, **own, **self.kw, **kw,
        )  # fmt: skip
        return self.out

    def __call__(self, **kw):
        if self.plan.own_keys:
            return self.cached(**kw)
        b = self.b
        new_lse = varlen_attention(
            self.call, b["query"], b["key"], b["value"], b["kwargs"]["scale"],
            self.new, self.backend,
        )  # fmt: skip
        return self.cached(self.new, new_lse, **kw)


def vllm_decode(b, hq, hk, d):
    """The vLLM TurboQuant decode kernel on a q 1 batch, as its backend calls it
    (``vllm_harness.vllm_decode``; the cache written by this project's encoder: the
    same bytes, its centroids and rotation passed)."""
    from tq_chunked.tools.vllm_harness import build_vllm_tq
    from tq_chunked.tools.vllm_harness import vllm_decode as decode

    kw = b["kwargs"]
    call = decode(build_vllm_tq(kw["preset"], hq, hk, d), kw["rotation"],
                  kw["centroids"], kw["scale"], d, "cuda")  # fmt: skip
    seq = torch.tensor(b["seq_lens"], dtype=torch.int32, device="cuda")
    return functools.partial(call, b["query"], b["kv_cache"], b["block_table"], seq)


# --- exactness ------------------------------------------------------------------------


def worst_ratio(b, out, cached, label, failures, factor_short=1.6):
    """The largest per-request error / the full path's; a request over the bound is
    a failure."""
    qsl = b["query_start_loc"]
    worst = 0.0
    for r in range(len(cached)):
        q0, q1 = qsl[r], qsl[r + 1]
        if q1 == q0:
            continue
        args = (
            b["query"][q0:q1], b["key"][q0:q1], b["value"][q0:q1], b["kv_cache"],
            b["block_table"][r], cached[r],
        )  # fmt: skip
        oracle = oracle_continuation_prefill(*args, **b["kwargs"])
        full = full_buffer_continuation_prefill(*args, **b["kwargs"], backend="auto")
        e, e_full = rel_err(out[q0:q1], oracle), rel_err(full, oracle)
        factor = 1.1 if q1 - q0 >= 4 else factor_short
        if not e <= factor * e_full + 1e-4:
            failures.append(f"{label}, request {r}: {e:.3e} > {factor} x {e_full:.3e}")
        worst = max(worst, e / e_full)
    return worst


def exactness(rows_out):
    failures = []
    for preset in PRESETS:
        for dtype in (torch.float16, torch.bfloat16):
            seed = 11 + len(preset) + (dtype == torch.bfloat16)
            g = torch.Generator().manual_seed(seed)
            reqs = [
                (int(c), q)
                for c, q in zip(
                    torch.randint(300, 3000, (8,), generator=g), [1, 4, 16, 1] * 2
                )
            ]
            b = build_batch(preset, reqs, 32, 8, 128, 16, dtype, "cuda", seed=seed)
            cached = [c for c, _ in reqs]
            run = functools.partial(
                paged_continuation_prefill_varlen,
                b["query"], b["key"], b["value"], b["kv_cache"], b["block_table"],
                None, None, **b["kwargs"], query_start_loc_cpu=b["query_start_loc"],
                seq_lens_cpu=b["seq_lens"],
            )  # fmt: skip
            label = f"{preset} {dtype}"
            out = run()
            row = dict(preset=preset, dtype=str(dtype))
            row["ratio"] = worst_ratio(b, out, cached, label, failures)
            row["ratio_no_q_split"] = worst_ratio(
                b, run(q_split=False), cached, label + " no q split", []
            )
            row["ratio_q_split"] = worst_ratio(
                b, run(q_split=True), cached, label + " q split", []
            )
            # the operands behind _operand against Triton's own fragments: the same
            # products, summed by the tensor cores in another grouping (equal bits
            # not required: a fragment in the wrong place is off by the answer's size)
            plain = run(fence=False)
            row["fence_equals_plain"] = bool(torch.equal(out, plain))
            row["fence_vs_plain"] = rel_err(out, plain.double())
            row["ratio_no_fence"] = worst_ratio(b, plain, cached, label + " plain", [])
            # the default register cap (paged.register_cap) against Triton's count:
            # the same instructions, allocated apart (reported)
            row["cap_equals_uncapped"] = bool(torch.equal(out, run(max_registers=0)))
            # the 16-row tiles of one warp (paged.DECODE_LAUNCH, what a decode batch
            # gets at D 128; this batch's 64-row request makes the default 32-row tiles
            # of 4 warps): every request within the bound (NOTES.md §44)
            row["ratio_one_warp"] = worst_ratio(
                b, run(block_m=16, block_n=32, num_warps=1), cached,
                label + " one warp", failures,
            )  # fmt: skip
            # the transposed 8-row tiles (paged.TRANSPOSED_LAUNCH; the default of
            # decode batches at D 64, NOTES.md §49), every request in tiles of 8 rows
            # (NOTES.md §47)
            row["ratio_transposed"] = worst_ratio(
                b, run(block_m=8), cached, label + " transposed", failures
            )
            if not row["fence_vs_plain"] <= 1e-3:
                failures.append(
                    f"{label}: fenced operands off the plain path by "
                    f"{row['fence_vs_plain']:.3e}"
                )
            if TQConfig.from_preset(preset, 128).key_bits in (3, 4):
                gather = run(lookup=False)
                row["lookup_equals_gather"] = bool(torch.equal(out, gather))
                if not row["lookup_equals_gather"]:
                    failures.append(f"{label}: byte-permute lookup != gather")
            b["kv_cache"] = b["kv_cache"].transpose(1, 2).contiguous().transpose(1, 2)
            row["ratio_v033"] = worst_ratio(b, run(), cached, label + " v033", failures)
            rows_out.append(row)
            print(f"exactness {label}: {row}", flush=True)
    # one split of 32K positions: the value dot's sum stays the answer's size; with 8
    # query tokens (32-row tiles), with decode's one (paged.DECODE_LAUNCH) and in a
    # transposed 8-row tile (paged.TRANSPOSED_LAUNCH)
    for q, tiles in ((8, [None]), (1, [None, 8])):
        b = build_batch(
            "turboquant_3bit_nc", [(32 * K, q)], 32, 8, 128, 16, torch.float16, "cuda"
        )
        for tile in tiles:
            out = paged_continuation_prefill_varlen(
                b["query"], b["key"], b["value"], b["kv_cache"], b["block_table"],
                None, None, **b["kwargs"], query_start_loc_cpu=b["query_start_loc"],
                seq_lens_cpu=b["seq_lens"], split_len=32 * K, block_m=tile,
            )  # fmt: skip
            label = f"3bit_nc one 32K split, q {q}" + (" transposed" if tile else "")
            r = worst_ratio(b, out, [32 * K], label, failures)
            rows_out.append(
                dict(preset="turboquant_3bit_nc", long_split=32 * K, q=q,
                     block_m=tile, ratio=r)
            )  # fmt: skip
            print(f"exactness {label}: ratio {r:.3f}", flush=True)
    return failures


# --- timings --------------------------------------------------------------------------


def measure(name, shape, reqs, preset, dtype_name, configs):
    hq, hk, d = SHAPES[shape]
    dtype = getattr(torch, dtype_name)
    t0 = time.time()
    b = build_batch(preset, reqs, hq, hk, d, 16, dtype, "cuda")
    cfg = TQConfig.from_preset(preset, d)
    qsl, lens = b["query_start_loc"], b["seq_lens"]
    cached = [lens[r] - (qsl[r + 1] - qsl[r]) for r in range(len(lens))]
    row = dict(
        workload=name, shape=shape, heads=[hq, hk, d], preset=preset,
        dtype=dtype_name, requests=len(reqs),
        q_rows_per_kv_head=max(q for _, q in reqs) * hq // hk,
        cached_tokens=sum(cached), build_s=round(time.time() - t0, 1),
    )  # fmt: skip
    row["quantized_bytes"] = sum(cached) * hk * cfg.slot_bytes
    row["fp16_bytes"] = sum(lens) * hk * d * 2 * 2
    row["quantized_ms_at_copy_rate"] = row["quantized_bytes"] / COPY_RATE * 1e3
    row["fp16_ms_at_copy_rate"] = row["fp16_bytes"] / COPY_RATE * 1e3
    row["floor_ms"] = kernel_ms(floor_of(b, hk, d, dtype))
    qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
    lens_cpu = torch.tensor(lens, dtype=torch.int32)
    n = b["query"].shape[0]
    w = default_window(hk, d, 16)
    ws = torch.empty(
        workspace_bytes(n, hq, hk, d, w, dtype), dtype=torch.uint8, device="cuda"
    )
    window = functools.partial(
        continuation_prefill_varlen,
        b["query"], b["key"], b["value"], b["kv_cache"], b["block_table"],
        qsl_cpu.cuda(), lens_cpu.cuda(), **b["kwargs"], query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=lens_cpu, window=w, workspace=ws, check_block_table=False,
    )  # fmt: skip
    row["window_ms"] = kernel_ms(functools.partial(window, path="window"))
    # what the plugin runs: each request on the path its plan picks (plan.py)
    prefill = ContinuationPrefill(hq, hk, d, preset=preset, dtype=dtype,
                                  block_size=16, window=w)  # fmt: skip
    auto = prefill.plan(
        b["block_table"], query_start_loc_cpu=qsl_cpu, seq_lens_cpu=lens_cpu
    )
    row["auto_units"] = sorted({type(u).__name__ for u in auto.plan.units})
    row["auto_ms"] = kernel_ms(window)
    row["auto_over_floor"] = row["auto_ms"] / row["floor_ms"]
    row["auto_over_window"] = row["auto_ms"] / row["window_ms"]
    del ws
    paged = Paged(b, hq, hk, d, dtype)
    row["plan"] = dict(
        block_m=paged.plan.block_m, block_n=paged.plan.block_n,
        num_warps=paged.plan.num_warps,
        max_registers=paged.plan.max_registers, prefetch=paged.plan.prefetch,
        split_len=paged.plan.split_len, programs=paged.plan.programs,
        scratch_mib=round(paged.plan.scratch_bytes / 2**20, 2),
    )  # fmt: skip
    row["paged_ms"] = kernel_ms(paged)
    row["paged_kernels_ms"] = kernels_ms(paged)
    row["own_keys"] = paged.plan.own_keys
    if paged.plan.own_keys:
        # the chunk's own keys through a causal FlashAttention call and the merge,
        # as before 0.6.7, against the combine's own loop over them (NOTES.md §50)
        alt = Paged(b, hq, hk, d, dtype, own_keys=False)
        row["paged_chunk_call_ms"] = kernel_ms(alt)
        row["paged_chunk_call_kernels_ms"] = kernels_ms(alt)
        del alt
    row["paged_cached_ms"] = kernel_ms(paged.cached)
    tried = {"default": row["paged_cached_ms"]}
    if configs:
        # (block_n, programs per SM, warps); the one-warp launch of 16-row tiles
        # (paged.DECODE_LAUNCH) against 0.6.3's (16, 64, 4) first (NOTES.md §44)
        one_warp = paged.plan.num_warps == 1
        alts = [(64, 4, 4), (16, 16, 1), (32, 8, 1), (32, 16, 1)] if one_warp else []
        # (64, 4 and 8 per SM, 4): D 256's launch at 0.6.10's split and 0.6.11's
        # (paged.WIDE_HEAD_PROGRAMS_PER_SM, NOTES.md §55)
        alts += [(32, 4, 4), (64, 2, 4), (64, 4, 4), (64, 8, 4), (64, 16, 4)]
        alts += [(128, 4, 4)]
        if paged.plan.block_m == 32:
            # 32-row tiles of 2 warps, each its own 16 rows: 63.0 warp instructions
            # per slot-row against 76.2 at 4 warps, 28 barriers an iteration against
            # 16, 7 spill instructions (3bit_nc D 128; NOTES.md §44)
            alts += [(64, 8, 2), (64, 4, 4)]  # and 0.6.3's launch of 32 rows
        alts = [
            (f"block_n {block_n}, {per_sm} per SM, {warps} warps",
             dict(block_n=block_n, programs_per_sm=per_sm, num_warps=warps))
            for block_n, per_sm, warps in dict.fromkeys(alts)  # each launch once
        ]  # fmt: skip
        if paged.plan.transposed:
            # the default's transposed 8-row tile against the 16-row tile of one warp
            # (paged.DECODE_LAUNCH), which it replaced here (NOTES.md §49)
            alts += [("16-row, one warp", dict(block_m=16))]
        elif one_warp and row["q_rows_per_kv_head"] <= 8:
            # the transposed 8-row tile (paged.TRANSPOSED_LAUNCH, not the default
            # here) at its register cap (D 128: Triton's 255, 8 warps an SM), at 216
            # (9 warps, 29 spill instructions an iteration), and without the L2
            # prefetch (its default at every preset: fp8 keys' DECODE_LAUNCH alone
            # goes without it; the "prefetch" rows below are the default tile's)
            # (NOTES.md §47, §49, §55)
            alts += [
                ("transposed 8-row", dict(block_m=8)),
                ("transposed 8-row, 216 registers", dict(block_m=8, max_registers=216)),
                ("transposed 8-row, prefetch 0", dict(block_m=8, prefetch=0)),
            ]
        for name, launch in alts:
            try:
                alt = Paged(b, hq, hk, d, dtype, **launch)
                tried[name] = kernel_ms(alt.cached)
                del alt
            except Exception as e:  # noqa: BLE001 - a launch may not compile
                tried[name] = f"failed: {e}"
    # the slots into L2 ahead of their loads (PagedPlan.prefetch: 1 tile at
    # paged.PREFETCH_LAUNCHES but fp8 keys' DECODE_LAUNCH, else none) against the
    # other two of none, 1 and 2 tiles (NOTES.md §44, §46, §55)
    for ahead in sorted({0, 1, 2} - {paged.plan.prefetch}):
        alt = Paged(b, hq, hk, d, dtype, prefetch=ahead)
        tried[f"prefetch {ahead}"] = kernel_ms(alt.cached)
        del alt
    # the two GPU-only choices against their alternatives: Triton's own register
    # count (no paged.register_cap), Triton's own MMA fragments (fence=False)
    if paged.plan.max_registers:
        alt = Paged(b, hq, hk, d, dtype, max_registers=0)
        tried["no register cap"] = kernel_ms(alt.cached)
        del alt
    tried["plain fragments"] = kernel_ms(functools.partial(paged.cached, fence=False))
    row["paged_cached_configs_ms"] = tried
    row["achieved_tb_s"] = row["quantized_bytes"] / (row["paged_cached_ms"] * 1e9)
    if all(q == 1 for _, q in reqs):
        try:
            row["vllm_decode_ms"] = kernel_ms(vllm_decode(b, hq, hk, d))
        except Exception as e:  # noqa: BLE001 - reported, the rest runs
            row["vllm_decode_ms"] = f"failed: {type(e).__name__}: {e}"
    row["paged_over_floor"] = row["paged_ms"] / row["floor_ms"]
    row["paged_over_window"] = row["paged_ms"] / row["window_ms"]
    del b, paged
    torch.cuda.empty_cache()
    return row


# --ncu's launches of each workload's cached part: the plan's default, 0.6.3's 16-row
# launch (16, 64, 4), capped at its 168 / 128 registers (NOTES.md §42, §44), no L2
# prefetch, the transposed 8-row tile
NCU_LAUNCHES = {
    "default": {},
    "0.6.3": dict(block_n=64, num_warps=4),
    "no-prefetch": dict(prefetch=0),
    "transposed": dict(block_m=8),  # paged.TRANSPOSED_LAUNCH (NOTES.md §47)
}


def ncu_runs(chosen, launches):
    """One launch of ``_paged_kernel`` per workload and launch name, in order, for
    Nsight Compute (benchmarks/run_on_device.sh ncu-paged): each printed first, so
    that the profiler's results can be matched to them (its kernels appear in this
    order)."""
    n = 0
    for name, shape, reqs, preset, dtype_name in chosen:
        hq, hk, d = SHAPES[shape]
        dtype = getattr(torch, dtype_name)
        b = build_batch(preset, reqs, hq, hk, d, 16, dtype, "cuda")
        for label in launches:
            paged = Paged(b, hq, hk, d, dtype, **NCU_LAUNCHES[label])
            p = paged.plan
            print(
                f"ncu launch {n}: {name} ({preset}, {dtype_name}, D {d}), {label}: "
                f"(block_m, block_n, warps) ({p.block_m}, {p.block_n}, "
                f"{p.num_warps}), {p.max_registers or 'no'} register cap, prefetch "
                f"{p.prefetch}, split_len {p.split_len}, {p.programs} programs",
                flush=True,
            )
            paged.cached()
            torch.cuda.synchronize()
            n += 1
            del paged
        del b
        torch.cuda.empty_cache()


def table(rows):
    f = lambda x: f"{x:.3f}" if isinstance(x, float) else str(x)
    lines = [
        (
            "| workload | preset | dtype | rows/kvh | floor ms | window ms | "
            "default ms | paged ms | paged, chunk call ms | vLLM decode ms | "
            "default / floor | "
            "default / window | quantized bytes at 4.3 TB/s ms | achieved TB/s | "
            "plan (M, N, split, progs) |"
        ),
        "|---" * 15 + "|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | failed: {r['error'][:80]} |")
            continue
        p = r["plan"]
        lines.append(
            "| " + " | ".join(
                [r["workload"], r["preset"].replace("turboquant_", ""), r["dtype"],
                 str(r["q_rows_per_kv_head"]), f(r["floor_ms"]), f(r["window_ms"]),
                 f(r["auto_ms"]), f(r["paged_ms"]),
                 f(r.get("paged_chunk_call_ms", "-")),
                 f(r.get("vllm_decode_ms", "-")), f"{r['auto_over_floor']:.2f}",
                 f"{r['auto_over_window']:.2f}",
                 f(r["quantized_ms_at_copy_rate"]), f"{r['achieved_tb_s']:.2f}",
                 (f"({p['block_m']}, {p['block_n']}, {p['split_len']}, "
                  f"{p['programs']})")]
            ) + " |"
        )  # fmt: skip
    ok = [r for r in rows if "error" not in r]
    if ok:
        gm = lambda k: math.exp(sum(math.log(r[k]) for r in ok) / len(ok))
        lines.append(
            f"\ngeomean default / floor {gm('auto_over_floor'):.2f} (max "
            f"{max(r['auto_over_floor'] for r in ok):.2f}), default / window "
            f"{gm('auto_over_window'):.2f}, paged / floor {gm('paged_over_floor'):.2f} "
            f"over {len(ok)} workloads (default: the plan's path per request)"
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", nargs="?", default=os.environ.get("OUT", "."))
    p.add_argument("--workloads", default="", help="comma-separated name prefixes")
    p.add_argument("--skip-exactness", action="store_true")
    p.add_argument("--no-configs", action="store_true", help="the default launch only")
    p.add_argument(
        "--ncu",
        action="store_true",
        help="one launch of the cached part per workload and --ncu-launches, nothing "
        "else (for Nsight Compute)",
    )
    p.add_argument(
        "--ncu-launches",
        default="default,0.6.3",
        help=f"--ncu: comma-separated, of {', '.join(NCU_LAUNCHES)}",
    )
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    prefixes = [x for x in a.workloads.split(",") if x]
    chosen = [w for w in grid() if not prefixes or any(w[0].startswith(x)
              for x in prefixes)]  # fmt: skip
    if a.ncu:
        return ncu_runs(chosen, [x for x in a.ncu_launches.split(",") if x])
    result = dict(probe="paged", device=torch.cuda.get_device_name(), exactness=[],
                  rows=[])  # fmt: skip
    path = os.path.join(a.out_dir, "paged-probe.json")

    def save():
        with open(path, "w") as fh:
            json.dump(result, fh, indent=1)

    failures = []
    if not a.skip_exactness:
        try:
            failures = exactness(result["exactness"])
        except Exception:  # noqa: BLE001 - reported as a failure, timings still run
            failures = ["exactness raised:\n" + traceback.format_exc()]
        result["exactness_failures"] = failures
        save()
    for name, shape, reqs, preset, dtype in chosen:
        t0 = time.time()
        try:
            row = measure(name, shape, reqs, preset, dtype, not a.no_configs)
        except Exception as e:  # noqa: BLE001 - one workload's failure is reported
            traceback.print_exc()
            row = dict(workload=name, error=f"{type(e).__name__}: {e}")
            torch.cuda.empty_cache()
        row["seconds"] = round(time.time() - t0, 1)
        result["rows"].append(row)
        save()
        print(f"{name}: {json.dumps(row)[:600]}", flush=True)
    print(table(result["rows"]))
    if failures:
        print("EXACTNESS FAILURES:\n" + "\n".join(failures))
        sys.exit(1)
    print("exactness: every check passed" if not a.skip_exactness else "")


if __name__ == "__main__":
    main()
