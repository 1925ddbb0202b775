"""Launch configurations of the window fill's un-rotation pass, against the element-wise
fill alone and the copy rate (GPU).

    python benchmarks/fill_configs.py [OUT_DIR]

One window of 65536 tokens x 8 kv heads, block size 16; bytes counted as in
fill_bandwidth.py. Prints a table and writes fill-configs.json.
"""

import functools
import json
import os
import sys

import torch
import triton.testing
from fill_bandwidth import HK, TOKENS, copy_rate

from tq_chunked.dequant import fill_window
from tq_chunked.format import TQConfig, lloyd_max_centroids
from tq_chunked.plan import cached_window

CASES = [
    ("turboquant_3bit_nc", 128),
    ("turboquant_4bit_nc", 128),
    ("turboquant_3bit_nc", 64),
    ("turboquant_k3v4_nc", 256),
]
CONFIGS = {
    64: [(16, 64, 1), (32, 64, 2), (64, 64, 4), (128, 64, 4), (128, 64, 8)],
    128: [
        (16, 128, 1),
        (16, 64, 1),
        (32, 64, 2),
        (32, 128, 4),
        (64, 64, 4),
        (64, 32, 4),
        (64, 128, 8),
        (128, 64, 8),
        (128, 128, 8),
    ],
    256: [
        (16, 64, 1),
        (32, 64, 2),
        (64, 64, 4),
        (64, 32, 4),
        (64, 64, 8),
        (128, 64, 8),
    ],
}


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    rate = copy_rate()
    print(f"copy rate {rate:.2f} TB/s")
    print(
        "| preset | D | variant | ms | TB/s | of copy |\n|---|---|---|---|---|---|",
        flush=True,
    )
    rows = []
    for preset, d in CASES:
        cfg = TQConfig.from_preset(preset, d)
        nb = TOKENS // 16
        cache = torch.randint(
            0, 256, (nb, 16, HK, cfg.slot_bytes), dtype=torch.uint8, device="cuda"
        )
        bt = torch.randperm(nb, device="cuda", dtype=torch.int64).int()[None]
        w = cached_window(0, 0, TOKENS, torch.device("cuda"))
        k = torch.empty(TOKENS, HK, d, dtype=torch.float16, device="cuda")
        v = torch.empty_like(k)
        cent = lloyd_max_centroids(d, cfg.centroid_bits).cuda()
        rot = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0].float().cuda()
        nbytes = TOKENS * HK * (cfg.slot_bytes + 4 * d)
        variants = [("element-wise only", dict(unrotate=False))]
        variants += [(f"with the un-rotation {c}", dict(config=c)) for c in CONFIGS[d]]
        for name, kw in variants:
            try:
                fn = functools.partial(
                    fill_window,
                    cache,
                    bt,
                    cfg,
                    cent,
                    rot,
                    k[:1],
                    v[:1],
                    w,
                    0,
                    k,
                    v,
                    **kw,
                )
                ms = triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median")
            # a configuration that does not compile (out of resources)
            except Exception as e:  # noqa: BLE001
                print(preset, d, name, "failed:", type(e).__name__, str(e)[:100])
                continue
            rows.append(
                dict(
                    preset=preset,
                    head_dim=d,
                    variant=name,
                    ms=ms,
                    tb_s=nbytes / ms / 1e9,
                    of_copy=nbytes / ms / 1e9 / rate,
                )
            )
            r = rows[-1]
            print(
                f"| {preset} | {d} | {name} | {ms:.3f} | {r['tb_s']:.2f} | "
                f"{r['of_copy']:.0%} |",
                flush=True,
            )
    with open(os.path.join(out_dir, "fill-configs.json"), "w") as f:
        json.dump({"copy_tb_s": rate, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
