"""continuation_prefill_varlen on a real model's activations: every request of a batch
within the stated bound of its full-buffer path against the float64 oracle (relative:
‖out − oracle‖ ≤ 1.1·‖full − oracle‖ + 1e-4; 1.6 for 1-3 query tokens), with windows cut
right after attention sinks and outlier keys.

The data (tests/data/real_activations.pt; tests/data/README.md says how it was made) is
SmolLM2-135M's post-RoPE query, key and value on the first tokens of Alice's Adventures
in Wonderland at layers 3, 18 and 29: 9 query heads over 3 kv heads, head size 64. K and
V of its first 1024 positions are written once into a paged TurboQuant cache by this
project's encoder (vLLM's Hadamard rotation), in blocks scattered among blocks of random
bytes; every request of the batch is a prefix of that token stream whose block table
points at the same blocks, as prefix caching shares them: a first chunk, three hits
whose last window starts right after a marked key (the layer's strongest sink, the
largest |k| of its strongest outlier channel, and a second sink or the next outlier
channel's largest |k|), and a hit that fits one batch window. The query rows are the
model's own at those positions.

In fp16 a request cut into windows measures 1.1-1.45x the full path's error with
turboquant_k8v4 (0.99-1.19x with the other presets): each window's partial result is
rounded to fp16 before the merge, one more rounding of the output (about 2e-4, relative;
exact partials rounded so give the same 2.7-3.0e-4) where the full path's whole error is
2.2-3.1e-4. The bound's 1e-4 holds it."""

from pathlib import Path

import pytest
import torch
from conftest import DEVICE, TRITON_OK

from tq_chunked import (
    PRESETS,
    TQConfig,
    continuation_prefill_varlen,
    default_window,
    hadamard,
    lloyd_max_centroids,
    workspace_bytes,
)
from tq_chunked.runtime.format import encode_reference
from tq_chunked.runtime.plan import LongRequest, make_plan
from tq_chunked.tools.reference import (
    full_buffer_continuation_prefill,
    oracle_continuation_prefill,
)
from tq_chunked.tools.testing import rel_err

DATA = torch.load(Path(__file__).parent / "data" / "real_activations.pt")
LAYERS = sorted(DATA["layers"])
WINDOW = DATA["meta"]["window"]  # the window the query chunks were placed for
BACKEND = "triton" if TRITON_OK else "torch"
BLOCK_SIZE = 16
SPARE_BLOCKS = 5  # blocks of random bytes among the prefix's
SEED = 36  # places the blocks in the cache; reported by every assertion
# as tests/test_varlen.py: the bound for requests of 1-3 query tokens, where the two
# paths' independent fp16 roundings of the same keys spread widely
SHORT_REQUEST_FACTOR = 1.6


def build(layer, preset, dtype):
    """The batch of the module docstring: (call arguments, host lengths, kwargs,
    chunks)."""
    d = {
        name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t
        for name, t in DATA["layers"][layer].items()
    }
    positions, hk, dim = d["k"].shape  # k, v: (positions, Hk, D) float16
    cfg = TQConfig.from_preset(preset, dim)
    gen = torch.Generator().manual_seed(SEED)
    blocks = -(-positions // BLOCK_SIZE)
    kv_cache = torch.randint(
        0,
        256,
        (blocks + SPARE_BLOCKS, BLOCK_SIZE, hk, cfg.slot_bytes),
        dtype=torch.uint8,
        generator=gen,
    ).to(DEVICE)
    ids = torch.randperm(blocks + SPARE_BLOCKS, generator=gen)[:blocks].to(DEVICE)
    pos = torch.arange(positions, device=DEVICE)
    slots = ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    centroids = lloyd_max_centroids(dim, cfg.centroid_bits).to(DEVICE)
    # vLLM's rotation; fp8 keys are not rotated
    rotation = None if cfg.key_fp8 else hadamard(dim).to(DEVICE)
    encode_reference(
        d["k"].float(), d["v"].float(), kv_cache, slots, cfg, centroids, rotation
    )

    chunks = d["chunks"]  # [start, new tokens, key cut after, purpose]
    seq_lens = [a + n for a, n, *_ in chunks]
    width = -(-max(seq_lens) // BLOCK_SIZE) + 1  # unused columns -1
    block_table = torch.full((len(chunks), width), -1, dtype=torch.int32, device=DEVICE)
    qsl, keys, values = [0], [], []
    for r, (a, n, *_) in enumerate(chunks):
        used = -(-(a + n) // BLOCK_SIZE)
        block_table[r, :used] = ids[:used].int()
        keys.append(d["k"][a : a + n])
        values.append(d["v"][a : a + n])
        qsl.append(qsl[-1] + n)
    args = (
        d["q"].to(dtype),  # the chunks' query rows, in order
        torch.cat(keys).to(dtype),
        torch.cat(values).to(dtype),
        kv_cache,
        block_table,
    )
    kwargs = dict(
        preset=preset, centroids=centroids, rotation=rotation, scale=dim**-0.5
    )
    return args, qsl, seq_lens, kwargs, chunks


def check(layer, preset, dtype, path="window"):
    """Run the batch on ``path``; assert the windows (path "window") and the bound per
    request. Returns [(purpose, error, full path's error)] (relative, against the
    oracle)."""
    (query, key, value, kv_cache, block_table), qsl, seq_lens, kwargs, chunks = build(
        layer, preset, dtype
    )
    n, hq, dim = query.shape
    hk = key.shape[1]
    where = f"layer {layer}, {preset}, {dtype}, seed {SEED}"
    # NaN output and 0xFF workspace: a row or byte left unwritten shows
    out = torch.full_like(query, float("nan"))
    # the memory-bound path's splits are planned within a batch window's bytes
    window = WINDOW if path == "window" else default_window(hk, dim, BLOCK_SIZE)
    ws = torch.full(
        (workspace_bytes(n, hq, hk, dim, window, dtype),),
        0xFF,
        dtype=torch.uint8,
        device=DEVICE,
    )
    before = kv_cache.clone()
    res = continuation_prefill_varlen(
        query,
        key,
        value,
        kv_cache,
        block_table,
        torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        **kwargs,
        window=window,
        workspace=ws,
        backend=BACKEND,
        out=out,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        path=path,
    )
    assert res is out
    assert torch.equal(kv_cache, before), f"{where}: the cache was written"

    # The windows cut where the data says: each marked request runs in windows of its
    # own, the last starting right after the marked key; the others in batch windows.
    steps = make_plan(
        tuple(qsl),
        tuple(seq_lens),
        window=WINDOW,
        num_q_heads=hq,
        num_kv_heads=hk,
        head_dim=dim,
        dtype=dtype,
        budget=ws.numel(),
        device=torch.device(DEVICE),
    ).units
    if path != "window":
        steps = ()
    last_start = {
        s.request: s.windows[-1].segment(0)[2]
        for s in steps
        if isinstance(s, LongRequest)
    }
    for r, (_, _, cut, why) in enumerate(chunks):
        if path != "window":
            break
        if cut >= 0:
            assert last_start.get(r) == cut + 1, f"{where}: request {r} ({why})"
        else:
            assert r not in last_start, f"{where}: request {r} ({why})"

    errors = []
    for r, (a, q_len, _, why) in enumerate(chunks):
        q0, q1 = qsl[r], qsl[r + 1]
        request = (
            query[q0:q1],
            key[q0:q1],
            value[q0:q1],
            kv_cache,
            block_table[r],
            a,
        )
        oracle = oracle_continuation_prefill(*request, **kwargs)
        full = full_buffer_continuation_prefill(*request, **kwargs, backend="torch")
        e_full = rel_err(full, oracle)
        e = rel_err(out[q0:q1], oracle)
        factor = 1.1 if q_len >= 4 else SHORT_REQUEST_FACTOR
        assert e <= factor * e_full + 1e-4, (
            f"{where}, request {r} ({why}): error {e:.3e}, full path {e_full:.3e}"
        )
        errors.append((why, e, e_full))
    return errors


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("layer", LAYERS, ids=[f"layer{n}" for n in LAYERS])
def test_real_activations_within_the_full_paths_error(layer, preset, dtype):
    check(layer, preset, dtype)


@pytest.mark.skipif(not TRITON_OK, reason="the memory-bound path is Triton")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("layer", LAYERS, ids=[f"layer{n}" for n in LAYERS])
def test_real_activations_on_the_memory_bound_path(layer, preset, dtype):
    """Every request through the memory-bound path."""
    check(layer, preset, dtype, path="paged")


@pytest.mark.parametrize("layer", LAYERS)
def test_the_data_has_its_sinks_and_outlier_channels(layer):
    """What the cuts are for is in the data: the marked sink takes a large share of the
    attention of the stored queries that see it, and the outlier channel's largest |k|
    is several times its head's median channel's."""
    d = DATA["layers"][layer]
    q, k = d["q"].float(), d["k"].float()
    sink, _ = d["sinks"][0]
    group = q.shape[1] // k.shape[1]
    shares, row = [], 0
    for a, n, *_ in d["chunks"]:
        for i in range(a, a + n):
            if i > sink:  # a query that sees the sink and more
                keys = k[: i + 1].repeat_interleave(group, 1)  # (i + 1, Hq, D)
                s = torch.einsum("hd,khd->hk", q[row], keys) * k.shape[-1] ** -0.5
                shares.append(s.softmax(-1)[:, sink].mean())
            row += 1
    assert row == q.shape[0]
    assert torch.stack(shares).mean() > 0.1, f"layer {layer}: sink {sink}"
    head, channel, _, ratio = d["outlier_channels"][0]
    peak = k[:, head].abs().amax(0)
    assert ratio >= 3 and peak[channel] >= 3 * peak.median(), f"layer {layer}"
