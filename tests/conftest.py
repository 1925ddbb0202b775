"""Shared helpers: build a random TurboQuant cache the way vLLM fills one, and compare.

Every random input comes from a seeded generator; the seed is part of each test's id
(or of hypothesis's reported example), so a failure repeats exactly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from tq_chunked.format import TQConfig, encode_reference, hadamard, lloyd_max_centroids

# CPU runs execute the Triton kernels in the interpreter; GPU runs on the device.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_OK = DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (run with -m gpu on the device)"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def random_rotation(d: int, gen: torch.Generator) -> torch.Tensor:
    """A random orthonormal, non-symmetric matrix: catches a transposed rotation."""
    return torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=gen))[
        0
    ].float()


@dataclass
class Case:
    query: torch.Tensor
    key_chunk: torch.Tensor
    val_chunk: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    cached_len: int
    kwargs: dict

    @property
    def args(self):
        return (
            self.query,
            self.key_chunk,
            self.val_chunk,
            self.kv_cache,
            self.block_table,
            self.cached_len,
        )


def make_case(
    preset="turboquant_3bit_nc",
    dtype=torch.float16,
    head_dim=64,
    num_q_heads=4,
    num_kv_heads=2,
    block_size=16,
    cached_len=300,
    q_len=129,
    layout="v020",
    *,
    seed,
    device=DEVICE,
    rotation="random",
    centroids=None,
) -> Case:
    """A cache holding cached_len + q_len random tokens (as vLLM's store leaves it), a
    shuffled block table with spare blocks, and the chunk's raw K/V and query.

    layout "v020": physical (num_blocks, block_size, Hk, slot); "v033": physical
    (num_blocks, Hk, block_size, slot), passed as its transpose(1, 2) view.
    rotation: "random" (orthonormal, not symmetric), "hadamard", or a (D, D) tensor;
    centroids: the table to write with (default: this project's Lloyd-Max solver).
    """
    gen = torch.Generator().manual_seed(seed)
    cfg = TQConfig.from_preset(preset, head_dim)
    total = cached_len + q_len
    num_blocks = -(-total // block_size) + 3
    if layout == "v020":
        kv_cache = torch.randint(
            0,
            256,
            (num_blocks, block_size, num_kv_heads, cfg.slot_bytes),
            dtype=torch.uint8,
            generator=gen,
        )
    else:
        kv_cache = torch.randint(
            0,
            256,
            (num_blocks, num_kv_heads, block_size, cfg.slot_bytes),
            dtype=torch.uint8,
            generator=gen,
        ).transpose(1, 2)
    kv_cache = kv_cache.to(device)
    if centroids is None:
        centroids = lloyd_max_centroids(head_dim, cfg.centroid_bits)
    centroids = centroids.float().to(device)
    if isinstance(rotation, str):
        rotation = (
            random_rotation(head_dim, gen)
            if rotation == "random"
            else hadamard(head_dim)
        )
    rot = rotation.float().to(device)
    block_table = (
        torch.randperm(num_blocks, generator=gen).int().to(device)[None, :]
    )  # (1, max_blocks)
    # Keys with per-channel offsets and outliers, values with a per-token spread.
    key = (
        torch.randn(total, num_kv_heads, head_dim, generator=gen) * 1.5
        + torch.randn(1, num_kv_heads, head_dim, generator=gen)
    ).to(device)
    value = (
        torch.randn(total, num_kv_heads, head_dim, generator=gen)
        * torch.rand(total, num_kv_heads, 1, generator=gen)
        * 2
    ).to(device)
    pos = torch.arange(total, device=device)
    slots = block_table[0].long()[pos // block_size] * block_size + pos % block_size
    encode_reference(key, value, kv_cache, slots, cfg, centroids, rot)
    query = (torch.randn(q_len, num_q_heads, head_dim, generator=gen) * 1.5).to(
        device, dtype
    )
    kwargs = dict(
        preset=preset, centroids=centroids, rotation=rot, scale=head_dim**-0.5
    )
    return Case(
        query,
        key[cached_len:].to(dtype),
        value[cached_len:].to(dtype),
        kv_cache,
        block_table,
        cached_len,
        kwargs,
    )


def strided(t, dim=-1):
    """The same values, with stride 2 along ``dim`` (every other element of a wider tensor)."""
    shape = list(t.shape)
    shape[dim] *= 2
    wide = (
        torch.full(shape, float("nan"), dtype=t.dtype, device=t.device)
        if t.is_floating_point()
        else torch.full(shape, -7, dtype=t.dtype, device=t.device)
    )
    idx = [slice(None)] * t.ndim
    idx[dim] = slice(0, None, 2)
    wide[tuple(idx)] = t
    return wide[tuple(idx)]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x = x.double()
    assert torch.isfinite(x).all(), "non-finite output"
    return ((x - ref).norm() / ref.norm()).item()


@dataclass
class Batch:
    """Several requests packed as vLLM packs them, over one shared paged cache."""

    query: torch.Tensor  # (N, Hq, D)
    key: torch.Tensor  # (N, Hk, D)
    value: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor  # (B, max_blocks) int32, unused columns -1
    query_start_loc: list
    seq_lens: list
    kwargs: dict
    seed: int  # reported in every assertion message of check_batch

    @property
    def args(self):
        dev = self.query.device
        return (
            self.query,
            self.key,
            self.value,
            self.kv_cache,
            self.block_table,
            torch.tensor(self.query_start_loc, dtype=torch.int32, device=dev),
            torch.tensor(self.seq_lens, dtype=torch.int32, device=dev),
        )

    def request(self, r):
        """(query, key_chunk, val_chunk, kv_cache, block_table row, cached_len) of request r."""
        q0, q1 = self.query_start_loc[r], self.query_start_loc[r + 1]
        return (
            self.query[q0:q1],
            self.key[q0:q1],
            self.value[q0:q1],
            self.kv_cache,
            self.block_table[r],
            self.seq_lens[r] - (q1 - q0),
        )


def make_batch(
    requests,
    preset="turboquant_3bit_nc",
    dtype=torch.float16,
    head_dim=64,
    num_q_heads=4,
    num_kv_heads=2,
    block_size=16,
    layout="v020",
    *,
    seed,
    device=DEVICE,
    rotation="random",
) -> Batch:
    """requests: [(cached_len, q_len), ...]. Blocks of all requests are shuffled across
    one cache (plus spare blocks); every token, cached or new, is in the cache, as
    vLLM's store leaves it before attention."""
    gen = torch.Generator().manual_seed(seed)
    cfg = TQConfig.from_preset(preset, head_dim)
    need = [-(-(c + q) // block_size) for c, q in requests]
    num_blocks = sum(need) + 3
    shape = (
        (num_blocks, block_size, num_kv_heads, cfg.slot_bytes)
        if layout == "v020"
        else (num_blocks, num_kv_heads, block_size, cfg.slot_bytes)
    )
    kv_cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if layout != "v020":
        kv_cache = kv_cache.transpose(1, 2)
    kv_cache = kv_cache.to(device)
    centroids = lloyd_max_centroids(head_dim, cfg.centroid_bits).float().to(device)
    rot = (
        random_rotation(head_dim, gen) if rotation == "random" else hadamard(head_dim)
    ).to(device)
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full(
        (len(requests), max(max(need, default=1), 1) + 1), -1, dtype=torch.int32
    )
    used = 0
    for r, n in enumerate(need):
        block_table[r, :n] = perm[used : used + n].int()
        used += n
    block_table = block_table.to(device)
    qs, ks, vs, qsl, lens = [], [], [], [0], []
    for r, (cached, q_len) in enumerate(requests):
        total = cached + q_len
        key = (
            torch.randn(total, num_kv_heads, head_dim, generator=gen) * 1.5
            + torch.randn(1, num_kv_heads, head_dim, generator=gen)
        ).to(device)
        value = (
            torch.randn(total, num_kv_heads, head_dim, generator=gen)
            * torch.rand(total, num_kv_heads, 1, generator=gen)
            * 2
        ).to(device)
        pos = torch.arange(total, device=device)
        slots = block_table[r].long()[pos // block_size] * block_size + pos % block_size
        encode_reference(key, value, kv_cache, slots, cfg, centroids, rot)
        qs.append(
            (torch.randn(q_len, num_q_heads, head_dim, generator=gen) * 1.5).to(
                device, dtype
            )
        )
        ks.append(key[cached:].to(dtype))
        vs.append(value[cached:].to(dtype))
        qsl.append(qsl[-1] + q_len)
        lens.append(total)
    kwargs = dict(
        preset=preset, centroids=centroids, rotation=rot, scale=head_dim**-0.5
    )
    return Batch(
        torch.cat(qs),
        torch.cat(ks),
        torch.cat(vs),
        kv_cache,
        block_table,
        qsl,
        lens,
        kwargs,
        seed,
    )
