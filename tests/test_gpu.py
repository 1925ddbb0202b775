"""GPU suite (``pytest -m gpu``): long contexts, flat memory, and real vLLM kernels.

Runs on the H200 device; CI (no GPU) skips it. The vLLM tests need vLLM importable
(on the device: ``source .gpu-carry/setup.sh``, see benchmarks/run_on_device.sh).
"""

import pytest
import torch

from tq_chunked import PRESETS, continuation_prefill, default_window, workspace_bytes
from tq_chunked.attention import BACKENDS, backend_available
from tq_chunked.demo import build_case
from tq_chunked.format import TQConfig, encode_reference, unpack_bits
from tq_chunked.reference import full_buffer_continuation_prefill, oracle_continuation_prefill
from tq_chunked.vllm_harness import build_vllm_tq, vllm_available, vllm_continuation_prefill, vllm_store

from conftest import rel_err

pytestmark = pytest.mark.gpu
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vLLM is not importable")


def _backends():
    dev = torch.device("cuda")
    return [b for b in BACKENDS if b != "torch" and backend_available(b, dev, torch.float16, 128)]


@pytest.mark.parametrize("cached_len", [8192, 32768, 131072])
@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k8v4"])
def test_long_context_matches_full_buffer(preset, cached_len):
    args, kwargs = build_case(preset, cached_len, 512, 32, 8, 128, 16, torch.float16, "cuda", seed=cached_len)
    oracle = oracle_continuation_prefill(*args, **kwargs)
    e_full = rel_err(full_buffer_continuation_prefill(*args, **kwargs), oracle)
    for backend in _backends():
        out = continuation_prefill(*args, **kwargs, backend=backend)
        e = rel_err(out, oracle)
        print(f"{preset} cached {cached_len} {backend}: chunked {e:.3e}, full {e_full:.3e}")
        assert e <= 1.1 * e_full + 1e-4, (backend, e, e_full)


def test_peak_memory_is_flat_from_8k_to_128k():
    peaks = {}
    for cached_len in (8192, 131072):
        args, kwargs = build_case("turboquant_3bit_nc", cached_len, 2048, 32, 8, 128, 16, torch.float16, "cuda")
        continuation_prefill(*args, **kwargs)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = continuation_prefill(*args, **kwargs)
        torch.cuda.synchronize()
        peaks[cached_len] = torch.cuda.max_memory_allocated() - base
        del out, args
    window = default_window(8, 128, 16)
    print({k: f"{v / 2**20:.1f} MiB" for k, v in peaks.items()},
          f"workspace {workspace_bytes(2048, 32, 8, 128, window, torch.float16) / 2**20:.1f} MiB")
    assert peaks[131072] - peaks[8192] < 8 * 2**20


def _vllm_cache(tq, preset, total, layout, block_size=16, hk=8, d=128, seed=0):
    """A cache written by vLLM's own store kernel. vLLM 0.20's store needs its own
    contiguous layout; for 0.33's head-major layout the bytes are then copied into a
    (num_blocks, Hk, block_size, slot) buffer and its transpose(1, 2) view returned."""
    gen = torch.Generator("cuda").manual_seed(seed)
    cfg = TQConfig.from_preset(preset, d)
    nb = -(-total // block_size) + 2
    cache = torch.zeros(nb, block_size, hk, cfg.slot_bytes, dtype=torch.uint8, device="cuda")
    bt = torch.randperm(nb, generator=gen, device="cuda").int()[None]
    pos = torch.arange(total, device="cuda")
    slots = bt[0].long()[pos // block_size] * block_size + pos % block_size
    key = torch.randn(total, hk, d, generator=gen, device="cuda", dtype=torch.float16) * 1.5
    val = torch.randn(total, hk, d, generator=gen, device="cuda", dtype=torch.float16)
    vllm_store(tq, key, val, cache, slots)
    if layout == "v033":
        cache = cache.transpose(1, 2).contiguous().transpose(1, 2)
    return cache, bt, slots, key, val


@needs_vllm
@pytest.mark.parametrize("preset", list(PRESETS))
def test_encoder_agrees_with_vllm_store(preset):
    """Keys (indices, norms, fp8 bytes) and value scale/zero are byte-exact. Value
    indices may differ by one where (v - min) / scale + 0.5 lies on a rounding boundary:
    vLLM's Triton store divides with an approximate fp32 division, this encoder with an
    exact one. Such an index is off by one step either way; the test checks that every
    difference is exactly such a boundary case."""
    cfg = TQConfig.from_preset(preset, 128)
    tq = build_vllm_tq(preset, 32, 8, 128)
    cache, bt, slots, key, val = _vllm_cache(tq, preset, 8192, "v020")
    ours = torch.zeros_like(cache)
    encode_reference(key, val, ours, slots, cfg, tq.centroids, tq.rotation)
    blk, pos = slots // 16, slots % 16
    theirs_s, ours_s = cache[blk, pos], ours[blk, pos]  # (N, Hk, slot)
    kb, vi = cfg.key_bytes, cfg.key_bytes + cfg.value_index_bytes
    assert torch.equal(theirs_s[..., :kb], ours_s[..., :kb]), "key bytes differ"
    assert torch.equal(theirs_s[..., vi:], ours_s[..., vi:]), "value scale/zero bytes differ"
    ia = unpack_bits(theirs_s[..., kb:vi], cfg.value_bits, 128)
    ib = unpack_bits(ours_s[..., kb:vi], cfg.value_bits, 128)
    differ = ia != ib
    v = val.float()
    vmin, vmax = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    x = (v - vmin) / ((vmax - vmin) / (2**cfg.value_bits - 1)).clamp(min=1e-8) + 0.5
    boundary = (x - x.round()).abs() < 1e-5 * x.abs().clamp(min=1)
    print(f"{preset}: {differ.sum().item()} of {differ.numel()} value indices differ, all by one at a boundary")
    assert ((ia - ib).abs() <= 1).all() and (boundary | ~differ).all()
    assert differ.float().mean().item() < 1e-4


@needs_vllm
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("layout", ["v020", "v033"])
def test_answer_agrees_with_vllm_continuation_prefill(preset, layout):
    tq = build_vllm_tq(preset, 32, 8, 128)
    cached, q_len = 8192, 1024
    cache, bt, _, key, val = _vllm_cache(tq, preset, cached + q_len, layout, seed=1)
    q = torch.randn(q_len, 32, 128, device="cuda", dtype=torch.float16) * 1.5
    args = (q, key[cached:], val[cached:], cache, bt, cached)
    kwargs = dict(preset=preset, centroids=tq.centroids, rotation=tq.rotation, scale=128**-0.5)
    theirs = vllm_continuation_prefill(tq, *args)
    oracle = oracle_continuation_prefill(*args, **kwargs)
    e_vllm = rel_err(theirs, oracle)
    for backend in _backends():
        ours = continuation_prefill(*args, **kwargs, backend=backend)
        e = rel_err(ours, oracle)
        print(f"{preset} {layout} {backend}: chunked {e:.3e}, vLLM {e_vllm:.3e}, apart {rel_err(ours, theirs.double()):.3e}")
        assert e <= 1.1 * e_vllm + 1e-4, (backend, e, e_vllm)


def _mixed_batch(tq, preset, long_cached, seed=0):
    """A batch as vLLM's scheduler orders it: two decodes, a short continuation
    (64 <= 128 tokens: vLLM's decode-kernel path), a long continuation (1024 tokens over
    long_cached), a first-chunk prefill. Every token is already in the cache, as
    do_kv_cache_update leaves it before forward."""
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadata
    gen = torch.Generator("cuda").manual_seed(seed)
    hk, d, hq, bs = 8, 128, 32, 16
    reqs = [(1000, 1), (3000, 1), (2000, 64), (long_cached, 1024), (0, 512)]  # (cached, q_len)
    cfg = TQConfig.from_preset(preset, d)
    blocks_per_req = [-(-(c + q) // bs) for c, q in reqs]
    nb = sum(blocks_per_req) + 4
    cache = torch.zeros(nb, bs, hk, cfg.slot_bytes, dtype=torch.uint8, device="cuda")
    perm = torch.randperm(nb, generator=gen, device="cuda").int()
    max_blocks = max(blocks_per_req)
    block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32, device="cuda")
    qs, ks, vs, slot_maps, req_kv = [], [], [], [], []
    used = 0
    for i, ((cached, q_len), nblk) in enumerate(zip(reqs, blocks_per_req)):
        block_table[i, :nblk] = perm[used:used + nblk]
        used += nblk
        total = cached + q_len
        key = torch.randn(total, hk, d, generator=gen, device="cuda", dtype=torch.float16)
        val = torch.randn(total, hk, d, generator=gen, device="cuda", dtype=torch.float16)
        pos = torch.arange(total, device="cuda")
        slots = block_table[i].long()[pos // bs] * bs + pos % bs
        vllm_store(tq, key, val, cache, slots)
        qs.append(torch.randn(q_len, hq, d, generator=gen, device="cuda", dtype=torch.float16))
        ks.append(key[cached:])
        vs.append(val[cached:])
        slot_maps.append(slots[cached:])
        req_kv.append((key, val))
    q_lens = [q for _, q in reqs]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device="cuda")
    n = sum(q_lens)
    meta = TurboQuantMetadata(
        seq_lens=torch.tensor([c + q for c, q in reqs], dtype=torch.int32, device="cuda"),
        slot_mapping=torch.cat(slot_maps), block_table=block_table, query_start_loc=qsl, num_actual_tokens=n,
        max_query_len=max(q_lens), max_seq_len=max(c + q for c, q in reqs), is_prefill=True, num_decodes=2,
        num_decode_tokens=2)
    q = torch.cat(qs).reshape(n, hq * d)
    k = torch.cat(ks).reshape(n, hk * d)
    v = torch.cat(vs).reshape(n, hk * d)
    return q, k, v, cache, meta, reqs, block_table


@needs_vllm
@pytest.mark.parametrize("preset", list(PRESETS))
def test_vllm_forward_on_a_mixed_batch_with_and_without_the_plugin(preset, monkeypatch):
    import vllm.v1.attention.backends.turboquant_attn as tqa
    from tq_chunked.vllm_plugin import plan_patches
    tq = build_vllm_tq(preset, 32, 8, 128)
    q, k, v, cache, meta, reqs, bt = _mixed_batch(tq, preset, long_cached=8192)
    forward = lambda: tq.impl.forward(tq.layer, q, k, v, cache, meta,
                                      output=torch.full((q.shape[0], 32 * 128), float("nan"), dtype=q.dtype,
                                                        device="cuda"))
    theirs = forward()
    for owner, name, value in plan_patches(tqa, None):  # the plugin, undone by monkeypatch afterwards
        monkeypatch.setattr(owner, name, value)
    ours = forward()
    assert torch.isfinite(ours).all()
    starts = meta.query_start_loc.tolist()
    for i, (cached, q_len) in enumerate(reqs):
        rows = slice(starts[i], starts[i + 1])
        if cached > 0 and q_len > 128:  # the long continuation: the windowed path
            long_q = q[rows].view(q_len, 32, 128)
            kc, vc = k[rows].view(q_len, 8, 128), v[rows].view(q_len, 8, 128)
            kwargs = dict(preset=preset, centroids=tq.centroids, rotation=tq.rotation, scale=128**-0.5)
            oracle = oracle_continuation_prefill(long_q, kc, vc, cache, bt[i], cached, **kwargs)
            e_ours = rel_err(ours[rows].view(q_len, 32, 128), oracle)
            e_theirs = rel_err(theirs[rows].view(q_len, 32, 128), oracle)
            print(f"{preset} forward, long continuation: plugin {e_ours:.3e}, vLLM {e_theirs:.3e}")
            assert e_ours <= 1.1 * e_theirs + 1e-4
        else:  # decodes, the short continuation, the first chunk: vLLM's own paths, untouched
            assert torch.equal(ours[rows], theirs[rows])


@needs_vllm
def test_vllm_forward_peak_memory_with_the_plugin_is_flat(monkeypatch):
    import vllm.v1.attention.backends.turboquant_attn as tqa
    from tq_chunked.vllm_plugin import plan_patches
    for owner, name, value in plan_patches(tqa, None):
        monkeypatch.setattr(owner, name, value)
    peaks = {}
    for long_cached in (8192, 131072):
        tq = build_vllm_tq("turboquant_3bit_nc", 32, 8, 128)
        q, k, v, cache, meta, reqs, bt = _mixed_batch(tq, "turboquant_3bit_nc", long_cached)
        out = torch.empty(q.shape[0], 32 * 128, dtype=q.dtype, device="cuda")
        tq.impl.forward(tq.layer, q, k, v, cache, meta, output=out)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        tq.impl.forward(tq.layer, q, k, v, cache, meta, output=out)
        torch.cuda.synchronize()
        peaks[long_cached] = (torch.cuda.max_memory_allocated() - base) / 2**20
        del q, k, v, cache, meta, tq
    print(f"patched forward peak extra: {peaks[8192]:.1f} MiB at 8K, {peaks[131072]:.1f} MiB at 128K")
    assert peaks[131072] - peaks[8192] < 64
