"""How far a rounding-size change in a key moves what a TurboQuant cache stores (CPU,
seconds): the real activations of tests/data (SmolLM2-135M on real text, layers 3, 18,
29), each key scaled elementwise by (1 + eps r), r standard normal, and encoded again.

    python benchmarks/quantizer_sensitivity.py [OUT.md]

Per layer, key bits (3, 4) and eps (2^-11: one fp16 rounding; 2^-8): the share of
stored indices that change, changes per token, and ||dK^|| / ||K^|| (the stored keys'
relative change, K^ = centroids x norm, rotated back) beside ||dK|| / ||K||. A BF16
cache stores such a change rounded to bf16 (at most one bf16 step of it); a quantized
cache moves a flipped index by a whole centroid gap (benchmarks/NOTES.md §36: likely why
greedy continuations on a TurboQuant cache part earlier than on a BF16 one under the
same rounding change).
"""

import sys
from pathlib import Path

import torch

from tq_chunked.runtime.format import hadamard, lloyd_max_centroids

DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "real_activations.pt"
SEED = 0


def stored(k, centroids, mids, rotation):
    """The indices and the keys a TurboQuant cache gives back for keys (N, Hk, D)."""
    x = k.reshape(-1, k.shape[-1])
    norm = x.norm(dim=1, keepdim=True)
    idx = torch.bucketize((x / norm) @ rotation.T, mids, right=True)
    return idx, (centroids[idx] @ rotation) * norm


def main():
    data = torch.load(DATA)
    gen = torch.Generator().manual_seed(SEED)
    head = "| layer | key bits | eps | indices changed | per token (all kv heads) |"
    rows = [head + " dK / K | stored dK / K | amplification |", "|---" * 8 + "|"]
    for layer, d in data["layers"].items():
        k = d["k"].double()
        dim = k.shape[-1]
        rotation = hadamard(dim).double()
        for bits in (3, 4):
            c = lloyd_max_centroids(dim, bits).double().sort().values
            mids = (c[:-1] + c[1:]) / 2
            i0, k0 = stored(k, c, mids, rotation)
            for log_eps in (-11, -8):
                kp = k * (1 + 2.0**log_eps * torch.randn(k.shape, generator=gen,
                                                           dtype=k.dtype))  # fmt: skip
                i1, k1 = stored(kp, c, mids, rotation)
                share = (i0 != i1).double().mean().item()
                rel_in = ((kp - k).norm() / k.norm()).item()
                rel_out = ((k1 - k0).norm() / k0.norm()).item()
                rows.append(
                    f"| {layer} | {bits} | 2^{log_eps} | {share:.2e} "
                    f"| {share * k.shape[1] * dim:.2f} | {rel_in:.2e} | {rel_out:.2e} "
                    f"| {rel_out / rel_in:.1f}x |"
                )
    text = "\n".join(rows) + "\n"
    print(text)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(
            "# A rounding-size change in the keys, stored by a TurboQuant cache\n\n"
            f"`python benchmarks/quantizer_sensitivity.py` (seed {SEED}; CPU)\n\n"
            + text
        )


if __name__ == "__main__":
    main()
