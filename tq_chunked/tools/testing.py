"""Inputs shared by the tests, the demo and the benchmarks.

Random TurboQuant caches written the way vLLM fills them, in two builders:

* :func:`make_batch` (and :func:`make_case`, its one-request form): for exactness
  tests. Drawn on the host from a seeded generator, so a seed gives the same data on
  every device; keys with per-channel offsets, values with a per-token spread; unused
  cache blocks hold random bytes and unused block-table columns ``-1``; either vLLM
  cache layout; a random (orthonormal, non-symmetric) or Hadamard rotation.
* :func:`build_batch` (and :func:`build_case`): for the demo, the benchmarks and the
  GPU tests' long contexts. Drawn on the device itself (fast at a million tokens),
  Hadamard rotation, and written by this project's encoder or, given ``vllm_tq``, by
  vLLM's own store kernel with vLLM's centroids and rotation.

Both leave every token, cached or new, in the cache (as vLLM's store does before
attention) and return the new tokens' K/V raw as well. Also here: the comparison
helpers of the tests (:func:`rel_err`, :func:`strided`), the model head shapes the
benchmarks run (:data:`SHAPES`) and the engine benchmark's workloads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..runtime.format import TQConfig, encode_reference, hadamard, lloyd_max_centroids

# The device the test builders default to: the GPU where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K = 1024

# ---------------------------------------------------------------------------
# Comparisons
# ---------------------------------------------------------------------------


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """|x - ref| / |ref| (Frobenius norms, float64); x must be finite."""
    x = x.double()
    assert torch.isfinite(x).all(), "non-finite output"
    return ((x - ref).norm() / ref.norm()).item()


def strided(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The same values with stride 2 along ``dim`` (every other element of a tensor
    twice as wide, whose other elements are NaN, or -7 for integer tensors)."""
    shape = list(t.shape)
    shape[dim] *= 2
    fill = float("nan") if t.is_floating_point() else -7
    wide = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    idx = [slice(None)] * t.ndim
    idx[dim] = slice(0, None, 2)
    wide[tuple(idx)] = t
    return wide[tuple(idx)]


def random_rotation(d: int, gen: torch.Generator) -> torch.Tensor:
    """A random orthonormal, non-symmetric (D, D) matrix: catches a transposed
    rotation."""
    q = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64, generator=gen))[0]
    return q.float()


# ---------------------------------------------------------------------------
# make_batch, make_case: the exactness tests' inputs
# ---------------------------------------------------------------------------


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
    kwargs: dict  # preset, centroids, rotation, scale
    seed: int  # reported in every assertion message of the tests' checks

    @property
    def args(self):
        """The positional arguments of ``continuation_prefill_varlen``."""
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
        """(query, key_chunk, val_chunk, kv_cache, block_table row, cached_len) of
        request r."""
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
    centroids=None,
) -> Batch:
    """requests: [(cached_len, q_len), ...]. The blocks of all requests are shuffled
    across one cache (plus 3 spare blocks of random bytes).

    layout "v020": the physical cache is (num_blocks, block_size, Hk, slot); "v033":
    (num_blocks, Hk, block_size, slot), passed as its transpose(1, 2) view. rotation:
    "random" (orthonormal, not symmetric), "hadamard", or a (D, D) tensor; centroids:
    the table to write with (default: this project's Lloyd-Max solver).
    """
    if layout not in ("v020", "v033"):
        raise ValueError(f'layout must be "v020" or "v033", got {layout!r}')
    gen = torch.Generator().manual_seed(seed)
    cfg = TQConfig.from_preset(preset, head_dim)
    need = [-(-(c + q) // block_size) for c, q in requests]
    num_blocks = sum(need) + 3
    if layout == "v020":
        shape = (num_blocks, block_size, num_kv_heads, cfg.slot_bytes)
    else:
        shape = (num_blocks, num_kv_heads, block_size, cfg.slot_bytes)
    kv_cache = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if layout == "v033":
        kv_cache = kv_cache.transpose(1, 2)
    kv_cache = kv_cache.to(device)
    if centroids is None:
        centroids = lloyd_max_centroids(head_dim, cfg.centroid_bits)
    centroids = centroids.float().to(device)
    if isinstance(rotation, torch.Tensor):
        rot = rotation
    elif rotation == "random":
        rot = random_rotation(head_dim, gen)
    elif rotation == "hadamard":
        rot = hadamard(head_dim)
    else:
        raise ValueError(
            f'rotation must be "random", "hadamard" or a tensor, got {rotation!r}'
        )
    rot = rot.float().to(device)
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(max(need, default=1), 1) + 1  # at least one -1 column
    block_table = torch.full((len(requests), width), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(need):
        block_table[r, :n] = perm[used : used + n].int()
        used += n
    block_table = block_table.to(device)
    qs, ks, vs, qsl, lens = [], [], [], [0], []
    for r, (cached, q_len) in enumerate(requests):
        total = cached + q_len
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
        slots = block_table[r].long()[pos // block_size] * block_size + pos % block_size
        encode_reference(key, value, kv_cache, slots, cfg, centroids, rot)
        query = torch.randn(q_len, num_q_heads, head_dim, generator=gen) * 1.5
        qs.append(query.to(device, dtype))
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


@dataclass
class Case:
    """One request as ``continuation_prefill`` takes it."""

    query: torch.Tensor
    key_chunk: torch.Tensor
    val_chunk: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor  # (1, max_blocks)
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
    """The one-request :func:`make_batch`: a cache holding cached_len + q_len tokens,
    the chunk's raw K/V and its query."""
    b = make_batch(
        [(cached_len, q_len)],
        preset,
        dtype,
        head_dim,
        num_q_heads,
        num_kv_heads,
        block_size,
        layout,
        seed=seed,
        device=device,
        rotation=rotation,
        centroids=centroids,
    )
    return Case(
        b.query, b.key, b.value, b.kv_cache, b.block_table, cached_len, b.kwargs
    )


# ---------------------------------------------------------------------------
# build_batch, build_case: the demo's, the benchmarks' and the long GPU tests' inputs
# ---------------------------------------------------------------------------

ENCODE_SLICE = 16384  # tokens encoded at a time: bounded scratch memory at any context


def build_batch(
    preset, requests, hq, hk, d, block_size, dtype, device, seed=0, vllm_tq=None
):
    """A paged TurboQuant cache holding several requests' tokens, their blocks shuffled.

    requests: [(cached_len, q_len), ...]. Written by this project's encoder (Hadamard
    rotation, Lloyd-Max centroids), or, given ``vllm_tq``
    (``vllm_harness.build_vllm_tq``), by vLLM's own store kernel with vLLM's centroids
    and rotation. Returns a dict: query (N, Hq, D), key, value (N, Hk, D), kv_cache,
    block_table (B, max_blocks) int32, query_start_loc and seq_lens (host lists),
    kwargs (preset, centroids, rotation, scale).
    """
    gen = torch.Generator(device).manual_seed(seed)
    cfg = TQConfig.from_preset(preset, d)
    need = [-(-(c + q) // block_size) for c, q in requests]
    kv_cache = torch.zeros(
        sum(need), block_size, hk, cfg.slot_bytes, dtype=torch.uint8, device=device
    )
    perm = torch.randperm(sum(need), generator=gen, device=device).int()
    block_table = torch.zeros(
        len(requests), max(need, default=1), dtype=torch.int32, device=device
    )
    if vllm_tq is None:
        centroids = lloyd_max_centroids(d, cfg.centroid_bits).to(device)
        # fp8 keys are not rotated
        rotation = None if cfg.key_fp8 else hadamard(d).to(device)

        def store(k, v, slots):
            encode_reference(k, v, kv_cache, slots, cfg, centroids, rotation)

    else:
        from .vllm_harness import vllm_store

        centroids, rotation = vllm_tq.centroids, vllm_tq.rotation

        def store(k, v, slots):
            vllm_store(vllm_tq, k, v, kv_cache, slots)

    keys, values, qsl, used = [], [], [0], 0
    for r, (cached, q_len) in enumerate(requests):
        block_table[r, : need[r]] = perm[used : used + need[r]]
        used += need[r]
        total = cached + q_len
        for s in range(0, total, ENCODE_SLICE):
            n = min(ENCODE_SLICE, total - s)
            pos = torch.arange(s, s + n, device=device)
            key = torch.randn(n, hk, d, generator=gen, device=device, dtype=dtype)
            val = torch.randn(n, hk, d, generator=gen, device=device, dtype=dtype)
            blocks = block_table[r].long()[pos // block_size]
            store(key, val, blocks * block_size + pos % block_size)
            new = slice(max(0, cached - s), n)  # this slice's new tokens
            keys.append(key[new])
            values.append(val[new])
        qsl.append(qsl[-1] + q_len)
    query = torch.randn(qsl[-1], hq, d, generator=gen, device=device, dtype=dtype)
    empty = torch.empty(0, hk, d, device=device, dtype=dtype)
    return dict(
        query=query,
        key=torch.cat(keys + [empty]),
        value=torch.cat(values + [empty]),
        kv_cache=kv_cache,
        block_table=block_table,
        query_start_loc=qsl,
        seq_lens=[c + q for c, q in requests],
        kwargs=dict(
            preset=preset, centroids=centroids, rotation=rotation, scale=d**-0.5
        ),
    )


def build_case(
    preset,
    cached_len,
    q_len,
    hq,
    hk,
    d,
    block_size,
    dtype,
    device,
    seed=0,
    vllm_tq=None,
):
    """One request of :func:`build_batch`, as continuation_prefill takes it:
    ((query, key_chunk, val_chunk, kv_cache, block_table (1, max_blocks), cached_len),
    kwargs)."""
    b = build_batch(
        preset,
        [(cached_len, q_len)],
        hq,
        hk,
        d,
        block_size,
        dtype,
        device,
        seed,
        vllm_tq,
    )
    args = (b["query"], b["key"], b["value"], b["kv_cache"], b["block_table"])
    return (*args, cached_len), b["kwargs"]


# ---------------------------------------------------------------------------
# Model shapes and the engine benchmark's workloads
# ---------------------------------------------------------------------------

SHAPES = {  # per-GPU-shard head shapes of real models: (Hq, Hk, D)
    "llama3-8b": (32, 8, 128),
    "70b-tp1": (64, 8, 128),
    "70b-tp8": (8, 1, 128),
    "70b-tp4": (16, 2, 128),
    "qwen2-7b": (28, 4, 128),
    "mha-d64": (16, 16, 64),
    "d256": (16, 4, 256),
}
SHAPE_NOTES = {  # what each shape stands for, for --help and docs/benchmarks.md
    "llama3-8b": "Llama-3-8B on one GPU",
    "70b-tp1": "a 70B model (Llama-3-70B) on one GPU",
    "70b-tp8": "the same 70B model's per-GPU shard at tensor parallel 8",
    "70b-tp4": "the same 70B model's per-GPU shard at tensor parallel 4",
    "qwen2-7b": "Qwen2-7B on one GPU (28 query heads, 4 kv heads)",
    "mha-d64": "multi-head attention at head size 64 (16 heads, no grouping)",
    "d256": "a head size 256 shape",
}
# (hidden, MLP intermediate) per GPU shard: one layer's weights, for the model-shaped
# step of the engine benchmark.
LAYER_GEMMS = {
    "llama3-8b": (4096, 14336),
    "70b-tp1": (8192, 28672),
    "70b-tp8": (8192, 3584),
    "70b-tp4": (8192, 7168),
    "qwen2-7b": (3584, 18944),
    "mha-d64": (1024, 4096),
    "d256": (4096, 14336),
}


@dataclass
class Workload:
    """One batch of the engine benchmark (``tq-chunked bench --stack`` etc.)."""

    name: str
    shape: str  # a key of SHAPES
    requests: list  # [(cached_len, q_len)]
    preset: str = "turboquant_3bit_nc"
    dtype: str = "float16"


def _hits(rng, n, q_len, lo, hi):
    """N prefix-cache hits of q_len new tokens over lo..hi cached tokens (multiples of
    16)."""
    return [(rng.randrange(lo // 16, hi // 16 + 1) * 16, q_len) for _ in range(n)]


def stack_workloads():
    """Single requests: head shapes x q_len x cached_len."""
    return (
        [
            Workload(f"{shape} q{q} {c // K}K", shape, [(c, q)])
            for shape in ("llama3-8b", "70b-tp8", "70b-tp1")
            for q in (512, 2048)
            for c in (8 * K, 32 * K, 128 * K)
        ]
        + [
            Workload(f"d256 q{q} {c // K}K", "d256", [(c, q)])
            for q in (2048, 8192)
            for c in (8 * K, 128 * K)
        ]
        + [
            Workload(f"llama3-8b q8192 {c // K}K", "llama3-8b", [(c, 8192)])
            for c in (16 * K, 128 * K)
        ]
    )


def serving_workloads():
    """The serving grid: B 1-64, q 16-8192, cached 0-128K mixed, the head shapes of
    SHAPES, fp16 and bf16, every preset."""
    rng = random.Random(0)
    W = Workload
    return [
        W("1 hit q512 8K", "llama3-8b", [(8 * K, 512)]),
        W("16 hits q512 2K-16K", "llama3-8b", _hits(rng, 16, 512, 2 * K, 16 * K)),
        W("16 hits q256 1K-8K", "llama3-8b", _hits(rng, 16, 256, 1 * K, 8 * K)),
        W("24 hits q384 0.5K-6K", "llama3-8b", _hits(rng, 24, 384, K // 2, 6 * K)),
        W("4 chunks q2048 16K-64K", "llama3-8b", _hits(rng, 4, 2048, 16 * K, 64 * K)),
        W("32 hits q200 1K-4K", "llama3-8b", _hits(rng, 32, 200, 1 * K, 4 * K)),
        W("64 hits q16 1K-8K", "llama3-8b", _hits(rng, 64, 16, 1 * K, 8 * K)),
        W(
            "8 hits q64-128 4K-32K",
            "llama3-8b",
            [(c, rng.randrange(64, 129)) for c, _ in _hits(rng, 8, 0, 4 * K, 32 * K)],
        ),
        W(
            "2 first chunks q2048 + 8 hits q256 2K-16K",
            "llama3-8b",
            [(0, 2048), (0, 2048)] + _hits(rng, 8, 256, 2 * K, 16 * K),
        ),
        W(
            "first chunk q4096 + 4 hits q1024 (bf16)",
            "llama3-8b",
            [(0, 4096)] + _hits(rng, 4, 1024, 4 * K, 32 * K),
            dtype="bfloat16",
        ),
        W(
            "16 hits q512 2K-16K (bf16, k8v4)",
            "llama3-8b",
            _hits(rng, 16, 512, 2 * K, 16 * K),
            "turboquant_k8v4",
            "bfloat16",
        ),
        W(
            "16 hits q512 2K-16K (4bit_nc)",
            "llama3-8b",
            _hits(rng, 16, 512, 2 * K, 16 * K),
            "turboquant_4bit_nc",
        ),
        W(
            "16 hits q512 2K-16K (k3v4_nc)",
            "llama3-8b",
            _hits(rng, 16, 512, 2 * K, 16 * K),
            "turboquant_k3v4_nc",
        ),
        W("1 long hit q2048 128K", "llama3-8b", [(128 * K, 2048)]),
        W(
            "2 long hits q1024 64K-128K + 8 hits q128",
            "llama3-8b",
            _hits(rng, 2, 1024, 64 * K, 128 * K) + _hits(rng, 8, 128, 1 * K, 8 * K),
        ),
        W("8 hits q1024 4K-32K", "70b-tp8", _hits(rng, 8, 1024, 4 * K, 32 * K)),
        W("32 hits q128 1K-8K", "70b-tp8", _hits(rng, 32, 128, 1 * K, 8 * K)),
        W("16 hits q512 2K-16K", "70b-tp4", _hits(rng, 16, 512, 2 * K, 16 * K)),
        W("16 hits q512 2K-16K", "70b-tp1", _hits(rng, 16, 512, 2 * K, 16 * K)),
        W("16 hits q512 2K-16K", "qwen2-7b", _hits(rng, 16, 512, 2 * K, 16 * K)),
        W("16 hits q256 1K-8K", "mha-d64", _hits(rng, 16, 256, 1 * K, 8 * K)),
        W("1 hit q2048 8K", "d256", [(8 * K, 2048)]),
        W("1 hit q8192 16K", "llama3-8b", [(16 * K, 8192)]),
    ]


def crossover_workloads():
    """One short continuation (q_len 8, 32, 128 over 1K, 8K, 64K cached)."""
    return [
        Workload(f"1 hit q{q} {c // K}K", "llama3-8b", [(c, q)])
        for q in (8, 32, 128)
        for c in (1 * K, 8 * K, 64 * K)
    ]


def seeded_hits(seed, n, q_len, lo, hi):
    """N requests of q_len query tokens over lo..hi cached tokens (multiples of 16),
    drawn by torch's generator from ``seed`` (the memory-bound grid's; the serving
    grid's come from one Python generator in order, ``_hits``)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (int(c) * 16, q_len)
        for c in torch.randint(lo // 16, hi // 16 + 1, (n,), generator=g)
    ]


def memory_bound_workloads():
    """The memory-bound grid: many short continuations and decodes over cached
    prefixes (B 8-256, q 1-128, cached 1K-64K), every head shape of SHAPES, every
    preset, fp16 and bf16; the serving grid's two decode-like batches first."""
    serving = {w.name: w for w in serving_workloads()}
    W, h = Workload, seeded_hits
    return [serving["64 hits q16 1K-8K"], serving["8 hits q64-128 4K-32K"]] + [
        W("decode 64 x 1K-8K", "llama3-8b", h(1, 64, 1, K, 8 * K)),
        W("decode 256 x 2K-12K", "llama3-8b", h(2, 256, 1, 2 * K, 12 * K)),
        W("decode 128 x 8K-32K 4bit", "llama3-8b", h(3, 128, 1, 8 * K, 32 * K),
          "turboquant_4bit_nc"),
        W("decode 256 x 1K-4K k8v4 bf16", "70b-tp8", h(4, 256, 1, K, 4 * K),
          "turboquant_k8v4", "bfloat16"),
        W("decode 128 x 4K-8K d64 k3v4", "mha-d64", h(5, 128, 1, 4 * K, 8 * K),
          "turboquant_k3v4_nc"),
        W("16 x q4 8K-32K 64/8 k3v4 bf16", "70b-tp1", h(6, 16, 4, 8 * K, 32 * K),
          "turboquant_k3v4_nc", "bfloat16"),
        W("32 x q8 1K-16K 28/4 4bit", "qwen2-7b", h(7, 32, 8, K, 16 * K),
          "turboquant_4bit_nc"),
        W("16 x q64 4K-16K 8/1 bf16", "70b-tp8", h(8, 16, 64, 4 * K, 16 * K),
          dtype="bfloat16"),
        W("16 x q16 64K", "llama3-8b", [(64 * K, 16)] * 16),
        W("128 x q4 2K-8K k8v4", "llama3-8b", h(9, 128, 4, 2 * K, 8 * K),
          "turboquant_k8v4"),
        W("24 x q32 16K-32K d64 4bit bf16", "mha-d64", h(10, 24, 32, 16 * K, 32 * K),
          "turboquant_4bit_nc", "bfloat16"),
        W("16 x q128 8K (512 rows a kv head)", "llama3-8b", [(8 * K, 128)] * 16),
        W("64 x q2 2K-16K 16/2 k8v4", "70b-tp4", h(11, 64, 2, 2 * K, 16 * K),
          "turboquant_k8v4"),
        W("decode 64 x 4K-16K d256 bf16", "d256", h(12, 64, 1, 4 * K, 16 * K),
          dtype="bfloat16"),
    ]  # fmt: skip


# The engine benchmark's modes (tq-chunked bench --stack, --serving, --crossover,
# --memory-bound) -> their workloads. Here rather than in bench_engine so that the bench
# can check --workloads without importing what the run needs.
WORKLOADS = {
    "stack": stack_workloads,
    "serving": serving_workloads,
    "crossover": crossover_workloads,
    "memory-bound": memory_bound_workloads,
}
