"""The window fill kernel against the H200's copy rate, per preset, head size, block
size and cache layout (issue 18's roofline target: >= 70 % of the measured copy rate).

    python benchmarks/fill_bandwidth.py [OUT_DIR] [--quick]

Bytes counted: the cache slots read (tokens x Hk x slot bytes; the block table and
centroids are noise) plus the K/V rows written (tokens x Hk x D x 2 x 2), over one
window of 65536 tokens x 8 kv heads; the copy rate is a device-to-device copy of 2 GiB
in the same run (bytes read + written). The rotation is split once before the timing, as
a call splits it once for all its windows (until 2026-12-01's last runs the script split
it in every timed call). --quick: block size 16 and vLLM 0.20's layout only.
Writes fill-bandwidth.json and prints a table, a row as each case ends.
"""

import functools
import json
import os
import sys

import torch
import triton.testing

from tq_chunked.runtime.dequant import fill_window, split_rotation
from tq_chunked.runtime.format import PRESETS, TQConfig, hadamard, lloyd_max_centroids
from tq_chunked.tools.reference import cached_window

TOKENS, HK = 65536, 8


def copy_rate():
    a = torch.empty(1 << 30, dtype=torch.float16, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(
        lambda: b.copy_(a), warmup=5, rep=50, return_mode="median"
    )
    return 2 * a.numel() * 2 / ms / 1e9  # TB/s (bytes read + written)


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    quick = "--quick" in sys.argv
    out_dir = args[0] if args else "."
    rate = copy_rate()
    print(f"copy rate {rate:.2f} TB/s (read + written)")
    print(
        "| preset | D | block | layout | ms | TB/s | of copy |\n"
        "|---|---|---|---|---|---|---|",
        flush=True,
    )
    rows = []
    for preset in PRESETS:
        for d in (64, 128, 256):
            cfg = TQConfig.from_preset(preset, d)
            for block_size in (16,) if quick else (16, 128):
                for layout in ("v020",) if quick else ("v020", "v033"):
                    nb = TOKENS // block_size
                    shape = (
                        (nb, block_size, HK, cfg.slot_bytes)
                        if layout == "v020"
                        else (nb, HK, block_size, cfg.slot_bytes)
                    )
                    cache = torch.randint(
                        0, 256, shape, dtype=torch.uint8, device="cuda"
                    )
                    if layout != "v020":
                        cache = cache.transpose(1, 2)
                    bt = torch.randperm(nb, device="cuda", dtype=torch.int64).int()[
                        None
                    ]
                    w = cached_window(0, 0, TOKENS, torch.device("cuda"))
                    k = torch.empty(TOKENS, HK, d, dtype=torch.float16, device="cuda")
                    v = torch.empty_like(k)
                    cent = lloyd_max_centroids(d, cfg.centroid_bits).cuda()
                    rot = hadamard(d).cuda()
                    # the rotation split once, as a call does (not timed)
                    parts = None if cfg.key_fp8 else split_rotation(rot)
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
                        parts=parts,
                    )
                    ms = triton.testing.do_bench(
                        fn, warmup=5, rep=40, return_mode="median"
                    )
                    nbytes = TOKENS * HK * (cfg.slot_bytes + 4 * d)
                    tbs = nbytes / ms / 1e9
                    rows.append(
                        dict(
                            preset=preset,
                            head_dim=d,
                            block_size=block_size,
                            layout=layout,
                            ms=ms,
                            tb_s=tbs,
                            of_copy=tbs / rate,
                        )
                    )
                    print(
                        f"| {preset} | {d} | {block_size} | {layout} | {ms:.3f} | "
                        f"{tbs:.2f} | {tbs / rate:.0%} |",
                        flush=True,
                    )
    with open(os.path.join(out_dir, "fill-bandwidth.json"), "w") as f:
        json.dump(
            {"copy_tb_s": rate, "tokens": TOKENS, "kv_heads": HK, "rows": rows},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
