"""Where the window fill's time goes (GPU): each case timed whole, without the
un-rotation, and its values alone (the value programs of the split launch:
``values_alone``), with the compiled kernel's registers, spills and shared memory (the
whole fill's); ``--ncu`` launches each case once for a profiler, nothing timed.

    python benchmarks/fill_probe.py [OUT_DIR]
    ncu --clock-control none --kernel-name regex:_fill_kernel \
        python benchmarks/fill_probe.py --ncu

Cases: Hk 8, block size 16, vLLM 0.20's layout; one request's window of 65536 cached
tokens, and the first batch window of 24 hits of 1000-3000 cached + 384 new tokens
(fill_configs.py's two windows). Bytes are counted as there (slots read, K/V rows
written; new rows as written only). Writes fill-probe.json.
"""

import dataclasses
import functools
import json
import os
import sys

import torch
import triton.testing
from fill_bandwidth import copy_rate
from fill_configs import case_inputs

import tq_chunked.runtime.dequant as dq
from tq_chunked.runtime.dequant import FILL, fill_window, launch_fill

CASES = [
    ("turboquant_3bit_nc", 128),
    ("turboquant_4bit_nc", 128),
    ("turboquant_k8v4", 128),
    ("turboquant_3bit_nc", 64),
    ("turboquant_3bit_nc", 256),
]


def values_alone(fn, d, rotate):
    """A function that fills the values alone: ``fn``'s fill launched with values and
    keys in programs of their own (the split launch), recorded, then issued on the
    first column of its grid only (programs (i, 0) write tile i's values; the key
    programs are not launched). The runtime's own kernel, nothing compiled for the
    probe."""
    seen = {}
    saved = dq.launch_fill
    dq.launch_fill = lambda grid, *args, **options: seen.update(
        grid=grid, args=args, options=options
    )
    try:
        split = dataclasses.replace(
            FILL[(triton.next_power_of_2(d), rotate)], split=True
        )
        fn(config=split)
    finally:
        dq.launch_fill = saved
    grid = (seen["grid"][0], 1)
    return lambda: launch_fill(grid, *seen["args"], **seen["options"])


def main():
    ncu = "--ncu" in sys.argv
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out_dir = args[0] if args else "."
    dev = torch.device("cuda")
    rate = None if ncu else copy_rate()
    rows = []
    if not ncu:
        print(f"copy rate {rate:.2f} TB/s")
        print(
            "| preset | D | window | ms | of copy | ms, no un-rotation | values alone "
            "| regs | spills | smem |\n"
            "|---|---|---|---|---|---|---|---|---|---|",
            flush=True,
        )
    for preset, d in CASES:
        cfg, cache, cent, rot, parts, k, v, windows = case_inputs(
            preset, d, dev, "hadamard"
        )
        for label, w, bt, kk, vv, nbytes in windows:
            fn = functools.partial(
                fill_window, cache, bt, cfg, cent, rot, kk, vv, w, 0, k, v, parts=parts
            )
            if ncu:
                fn()
                torch.cuda.synchronize()
                continue
            ms = triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")
            kern = list(launch_fill.compiled.values())[-1]  # compiled for fn just now
            meta = dict(
                regs=kern.n_regs, spills=kern.n_spills, smem=kern.metadata.shared
            )
            ms_values = triton.testing.do_bench(
                values_alone(fn, d, not cfg.key_fp8),
                warmup=5,
                rep=40,
                return_mode="median",
            )
            ms_plain = None
            if not cfg.key_fp8:
                # the same tile as the fill's, so that the difference is the
                # un-rotation's (FILL's entry without it is the fp8 keys' tile)
                tile = FILL[(triton.next_power_of_2(d), True)]
                plain = functools.partial(fn, unrotate=False, config=tile)
                ms_plain = triton.testing.do_bench(
                    plain, warmup=5, rep=40, return_mode="median"
                )
            rows.append(
                dict(
                    preset=preset,
                    head_dim=d,
                    window=label,
                    ms=ms,
                    of_copy=nbytes / ms / 1e9 / rate,
                    ms_no_unrotation=ms_plain,
                    ms_values_alone=ms_values,
                    **meta,
                )
            )
            shown = ["-" if x is None else f"{x:.3f}" for x in (ms_plain, ms_values)]
            print(
                f"| {preset} | {d} | {label} | {ms:.3f} | {rows[-1]['of_copy']:.0%} | "
                f"{' | '.join(shown)} | {meta['regs']} | {meta['spills']} | "
                f"{meta['smem']} |",
                flush=True,
            )
    if not ncu:
        with open(os.path.join(out_dir, "fill-probe.json"), "w") as f:
            json.dump({"copy_tb_s": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
