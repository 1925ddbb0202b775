"""Launch configurations of the window fill, against the copy rate (GPU).

    python benchmarks/fill_configs.py [OUT_DIR] [--rotation hadamard|random]
                                      [--sweep joint|split] [--presets P,...]

A configuration is a ``FillLaunch`` (cache slots per program, output columns per dot,
warps, split, sylvester): a program fills slots / Hk window rows of all Hk kv heads
(with split, two programs do: one the values, one the keys; with sylvester, vLLM's
Hadamard is un-rotated in groups of 16 columns). Two windows per case, Hk 8, block size
16: one request's 65536 cached tokens (one segment), and a batch window of 24 requests
of 1000-3000 cached tokens with 384 new ones each (48 segments with the gaps between
them, the shape of a serving step). The rotation is vLLM's Hadamard (one magnitude: the
one-dot un-rotation), or random (the two-dot one). ``--sweep joint`` (the default) tries
tiles and warps for one program per tile, ``split`` the programs of their own (NOTES.md
§20). Bytes counted as in fill_bandwidth.py (the new rows counted as written only).
Prints a row as each configuration ends and writes fill-configs.json.
"""

import argparse
import functools
import json
import os
import random

import torch
import triton.testing
from fill_bandwidth import HK, TOKENS, copy_rate

from tq_chunked.runtime.dequant import FILL, FillLaunch, fill_window, split_rotation
from tq_chunked.runtime.format import TQConfig, hadamard, lloyd_max_centroids
from tq_chunked.runtime.plan import windows
from tq_chunked.tools.reference import cached_window

CASES = [
    ("turboquant_3bit_nc", 128),
    ("turboquant_4bit_nc", 128),
    ("turboquant_k8v4", 128),
    ("turboquant_3bit_nc", 64),
    ("turboquant_k3v4_nc", 256),
]
F = FillLaunch
# One program per tile, for values and keys. Registers and shared memory per program on
# sm_90 (benchmarks/sass_report.py) set the resident warps per SM: D 128 (64, 64, 4) 132
# / 48 KB -> 12, (128, 64, 8) 114 / 64 KB -> 16, (128, 32, 8) 102 / 48 KB -> 16, (64,
# 32, 4) 104 / 32 KB -> 16; D 64 (128, 64, 8) 79 / 32 KB -> 24; D 256 (64, 64, 4) 218 /
# 96 KB -> 8 (255 with the Sylvester path), (64, 32, 4) 160 / 64 KB -> 12; k8v4 (128,
# 128, 8) 78 / 8 KB -> 24
JOINT = {
    (64, True): [F(64, 64, 4), F(128, 64, 8), F(128, 32, 8), F(64, 32, 4)],
    (128, True): [
        F(64, 64, 4),
        F(128, 64, 8),
        F(128, 32, 8),
        F(64, 32, 4),
        F(64, 64, 8),
    ],
    (128, False): [F(64, 128, 4), F(128, 128, 8), F(128, 128, 4), F(32, 128, 4)],
    (256, True): [
        FILL[(256, True)],
        F(64, 64, 4),
        F(64, 32, 4),
        F(128, 64, 8),
        F(32, 64, 4),
    ],
}
# Values and keys in programs of their own (split) beside the default.
SPLIT = {
    (64, True): [
        F(64, 64, 4),
        F(64, 64, 4, split=True),
        F(128, 64, 4, split=True),
        F(128, 64, 8, split=True),
        F(32, 64, 4, split=True),
    ],
    (128, True): [
        F(64, 64, 4),
        F(64, 64, 4, split=True),
        F(32, 64, 4, split=True),
        F(64, 32, 4, split=True),
        F(64, 128, 4, split=True),
        F(64, 64, 8, split=True),
        F(128, 64, 8, split=True),
    ],
    (128, False): [
        F(64, 128, 4),
        F(64, 128, 4, split=True),
        F(128, 128, 4, split=True),
        F(128, 128, 8, split=True),
        F(256, 128, 8, split=True),
    ],
    (256, True): [
        F(64, 64, 4),
        F(64, 64, 4, split=True),
        F(32, 64, 4, split=True),
        F(64, 64, 8, split=True),
        F(64, 128, 8, split=True),
    ],
}


def short(c: FillLaunch) -> str:
    """(slots, columns, warps[, split][, sylvester]), as the notes write a launch."""
    flags = [n for n in ("split", "sylvester") if getattr(c, n)]
    return "(" + ", ".join([str(c.slots), str(c.block_n), str(c.warps), *flags]) + ")"


def serving_window(device):
    """The first batch window of 24 hits of 1000-3000 cached + 384 new tokens."""
    rng = random.Random(0)
    reqs = [(rng.randrange(1000, 3001), 384) for _ in range(24)]
    qsl = [0]
    for _, q in reqs:
        qsl.append(qsl[-1] + q)
    w = windows(tuple(qsl), tuple(c + q for c, q in reqs), 65536, device)[0]
    return reqs, qsl, w


def case_inputs(preset, d, dev, rotation):
    """One (preset, head size)'s fill inputs, seeded: (cfg, centroids, rotation, its
    split parts, k_out, v_out, windows), the windows as (label, window, block table,
    new keys, new values, bytes counted) for one request's 65536 cached tokens and for
    the 24 hits of serving_window; rotation "random" (two dots) or "hadamard" (vLLM's,
    one dot)."""
    cfg = TQConfig.from_preset(preset, d)
    nb = TOKENS // 16 + 8
    g = torch.Generator(device=dev).manual_seed(0)
    cache = torch.randint(
        0, 256, (nb, 16, HK, cfg.slot_bytes), dtype=torch.uint8, device=dev, generator=g
    )
    cent = lloyd_max_centroids(d, cfg.centroid_bits).to(dev)
    if rotation == "hadamard":
        rot = hadamard(d).to(dev)
    else:
        q = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0]
        rot = q.float().to(dev)
    parts = None if cfg.key_fp8 else split_rotation(rot)
    k = torch.empty(TOKENS + 8192, HK, d, dtype=torch.float16, device=dev)
    v = torch.empty_like(k)
    bt_long = torch.randperm(nb - 8, device=dev, generator=g).int()[None]
    # serving: each request's own blocks, shuffled over the same cache
    reqs, qsl, serving = serving_window(dev)
    need = [-(-(c + q) // 16) for c, q in reqs]
    perm = torch.randperm(nb, device=dev, generator=g).int()
    bt_serving = torch.zeros(len(reqs), max(need), dtype=torch.int32, device=dev)
    used = 0
    for r, n in enumerate(need):
        bt_serving[r, :n] = perm[used : used + n]
        used += n
    new_k = torch.randn(qsl[-1], HK, d, dtype=torch.float16, device=dev, generator=g)
    new_v = torch.randn(qsl[-1], HK, d, dtype=torch.float16, device=dev, generator=g)
    cached = sum(c for c, _ in reqs)
    windows = [
        (
            "one request",
            cached_window(0, 0, TOKENS, dev),
            bt_long,
            k[:1],
            v[:1],
            TOKENS * HK * (cfg.slot_bytes + 4 * d),
        ),
        (
            "24 hits",
            serving,
            bt_serving,
            new_k,
            new_v,
            (cached * (cfg.slot_bytes + 4 * d) + qsl[-1] * 4 * d) * HK,
        ),
    ]
    return cfg, cache, cent, rot, parts, k, v, windows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "out_dir", nargs="?", default=".", help="where fill-configs.json goes"
    )
    p.add_argument(
        "--rotation",
        choices=["hadamard", "random"],
        default="hadamard",
        help="vLLM's Hadamard (one dot; default) or a random rotation (two dots)",
    )
    p.add_argument(
        "--sweep",
        choices=["joint", "split"],
        default="joint",
        help="one program per tile (default), or values and keys apart",
    )
    p.add_argument(
        "--presets",
        default=None,
        help="comma-separated presets to sweep (default: every case's)",
    )
    a = p.parse_args()
    out_dir = a.out_dir
    configs = JOINT if a.sweep == "joint" else SPLIT
    dev = torch.device("cuda")
    rate = copy_rate()
    print(
        f"copy rate {rate:.2f} TB/s (read + written); rotation {a.rotation}, "
        f"{a.sweep} configurations"
    )
    print(
        "| preset | D | window | slots, columns, warps | ms | TB/s | of copy |\n"
        "|---|---|---|---|---|---|---|",
        flush=True,
    )
    rows = []
    for preset, d in CASES:
        if a.presets and preset not in a.presets.split(","):
            continue
        cfg, cache, cent, rot, parts, k, v, windows = case_inputs(
            preset, d, dev, a.rotation
        )
        for label, w, bt, kk, vv, nbytes in windows:
            for c in configs[(d, not cfg.key_fp8)]:
                fn = functools.partial(
                    fill_window,
                    cache,
                    bt,
                    cfg,
                    cent,
                    rot,
                    kk,
                    vv,
                    w,
                    0,
                    k,
                    v,
                    config=c,
                    parts=parts,
                )
                try:
                    ms = triton.testing.do_bench(
                        fn, warmup=5, rep=30, return_mode="median"
                    )
                # a configuration that does not compile (out of resources)
                except Exception as e:  # noqa: BLE001
                    print(
                        preset,
                        d,
                        label,
                        short(c),
                        "failed:",
                        type(e).__name__,
                        str(e)[:100],
                    )
                    continue
                tbs = nbytes / ms / 1e9
                rows.append(
                    dict(
                        preset=preset,
                        head_dim=d,
                        window=label,
                        config=short(c),
                        default=c == FILL[(d, not cfg.key_fp8)],
                        ms=ms,
                        tb_s=tbs,
                        of_copy=tbs / rate,
                    )
                )
                mark = " (default)" if rows[-1]["default"] else ""
                print(
                    f"| {preset} | {d} | {label} | {short(c)}{mark} | {ms:.3f} | "
                    f"{tbs:.2f} | "
                    f"{tbs / rate:.0%} |",
                    flush=True,
                )
    with open(os.path.join(out_dir, "fill-configs.json"), "w") as f:
        json.dump(
            {"copy_tb_s": rate, "rotation": a.rotation, "sweep": a.sweep, "rows": rows},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
