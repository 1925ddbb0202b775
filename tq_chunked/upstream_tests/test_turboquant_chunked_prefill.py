# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""TurboQuant prefill attention in windows (vllm/v1/attention/ops/tq_chunked).

Run: pytest tests/quantization/test_turboquant_chunked_prefill.py -v

TurboQuantAttentionImpl computes the prefill part of a batch in one call that reads
every request's cached prefix in windows of one workspace. Its answers are compared
with float64 attention over the cached prefix decoded whole and the chunk's own K/V:

* a continuation chunk whose cached prefix spans several windows;
* a batch whose longest request is a first chunk, beside shorter prefix-cache hits
  (#46460: the first-chunk fast path attended the hits to their new tokens only).

And the metadata builder's reservation: the windowed workspace for layers whose impl
inherits TurboQuantAttentionImpl's prefill, vLLM's (1, Hk, max_model_len, D) K/V pair
for a subclass with a prefill of its own.

On a GPU the cache is written by vLLM's store kernel. On a CPU the windowed kernels
run in Triton's interpreter (TRITON_INTERPRET=1), where vLLM's store kernel does not
run: the cache is written by the vendored package's PyTorch encoder (the same bytes).
"""

import os
from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.quantization.turboquant.centroids import (
    get_centroids,
)
from vllm.platforms import current_platform

GPU = current_platform.is_cuda_alike()
DEVICE = current_platform.device_type if GPU else "cpu"
needs_triton = pytest.mark.skipif(
    not GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU, or Triton's interpreter (TRITON_INTERPRET=1) on a CPU",
)

PRESETS = [
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
]
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 64, 16
# Key rows per window: small, so that the prefixes below span several windows.
WINDOW = 64
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def turboquant_attn(monkeypatch):
    """VLLM's TurboQuant backend module, with the config values its impl reads given
    as plain values (as the workspace reservation tests do) and a window of WINDOW
    key rows."""
    from vllm.v1.attention.backends import turboquant_attn

    config = SimpleNamespace(
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=32),
        model_config=SimpleNamespace(max_model_len=4096),
    )
    monkeypatch.setattr(turboquant_attn, "get_current_vllm_config", lambda: config)
    if not GPU:
        monkeypatch.setattr(
            turboquant_attn, "get_flash_attn_version", lambda *args, **kwargs: None
        )
    monkeypatch.setattr(turboquant_attn._tq_chunked_prefill, "window", WINDOW)
    return turboquant_attn


def _impl_and_layer(turboquant_attn, preset, impl_cls=None):
    impl_cls = impl_cls or turboquant_attn.TurboQuantAttentionImpl
    impl = impl_cls(
        num_heads=NUM_HEADS,
        head_size=HEAD_SIZE,
        scale=HEAD_SIZE**-0.5,
        num_kv_heads=NUM_KV_HEADS,
        kv_cache_dtype=preset,
    )
    layer = torch.nn.Module()
    layer._tq_centroids = get_centroids(HEAD_SIZE, impl.tq_config.centroid_bits).to(
        DEVICE
    )
    impl._ensure_on_device(layer, torch.device(DEVICE))
    return impl, layer


def _write_cache(impl, layer, key, value, kv_cache, slot_mapping):
    if GPU:
        impl._store_kv(key, value, kv_cache, slot_mapping, layer)
        return
    from vllm.v1.attention.ops.tq_chunked.format import TQConfig, encode_reference

    cfg = TQConfig.from_preset(impl.kv_cache_dtype, HEAD_SIZE)
    encode_reference(
        key, value, kv_cache, slot_mapping, cfg, layer._tq_centroids, layer._tq_Pi
    )


def _batch(impl, layer, requests, dtype):
    """Requests of (cached tokens, new tokens) in one paged cache, every token stored
    (as before attention); the new tokens' query, key and value, packed."""
    blocks = [-(-(cached + new) // BLOCK_SIZE) for cached, new in requests]
    block_table = torch.zeros(len(requests), max(blocks), dtype=torch.int32)
    ids = torch.randperm(sum(blocks) + 3)  # scattered blocks, some unused
    kv_cache = torch.zeros(
        sum(blocks) + 3,
        BLOCK_SIZE,
        NUM_KV_HEADS,
        impl.tq_config.slot_size_aligned,
        dtype=torch.uint8,
        device=DEVICE,
    )
    queries, keys, values, start = [], [], [], 0
    for i, ((cached, new), n) in enumerate(zip(requests, blocks)):
        block_table[i, :n] = ids[start : start + n]
        start += n
        key = torch.randn(cached + new, NUM_KV_HEADS, HEAD_SIZE, device=DEVICE)
        value = torch.randn(cached + new, NUM_KV_HEADS, HEAD_SIZE, device=DEVICE)
        pos = torch.arange(cached + new)
        slots = block_table[i].long()[pos // BLOCK_SIZE] * BLOCK_SIZE
        slots += pos % BLOCK_SIZE
        _write_cache(
            impl, layer, key.to(dtype), value.to(dtype), kv_cache, slots.to(DEVICE)
        )
        queries.append(torch.randn(new, NUM_HEADS, HEAD_SIZE, device=DEVICE))
        keys.append(key[cached:])
        values.append(value[cached:])
    query, key, value = (torch.cat(x).to(dtype) for x in (queries, keys, values))
    return query, key, value, kv_cache, block_table.to(DEVICE)


def _reference(impl, layer, query, key, value, kv_cache, block_table, cached_len):
    """Float64 attention of one request's new tokens over its cached prefix, decoded
    from the cache, and its own new keys (causal, bottom-right)."""
    from vllm.v1.attention.ops.tq_chunked.format import TQConfig, dequantize_reference
    from vllm.v1.attention.ops.triton_turboquant_decode import _use_fp8_e4b15

    cfg = TQConfig.from_preset(impl.kv_cache_dtype, HEAD_SIZE)
    fp8_e4b15 = GPU and bool(_use_fp8_e4b15(torch.device(DEVICE).index or 0))
    k, v = dequantize_reference(
        kv_cache, block_table, 0, cached_len, cfg, layer._tq_centroids, fp8_e4b15
    )
    k, v = k.double(), v.double()
    if not cfg.key_fp8:  # cached keys are stored rotated
        k = k @ layer._tq_Pi.double()
    k = torch.cat([k, key.transpose(0, 1).double()], 1)
    v = torch.cat([v, value.transpose(0, 1).double()], 1)
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    q = query.transpose(0, 1).double()
    q_len, kv_len = q.shape[1], k.shape[1]
    rows = torch.arange(q_len, device=q.device)[:, None]
    visible = torch.arange(kv_len, device=q.device)[None, :] <= rows + cached_len
    scores = (q @ k.transpose(1, 2) * impl.scale).masked_fill(~visible, -torch.inf)
    return (scores.softmax(-1) @ v).transpose(0, 1)


def _assert_close(out, ref, dtype):
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def _metadata(turboquant_attn, requests, block_table):
    q_lens = [new for _, new in requests]
    seq_lens = [cached + new for cached, new in requests]
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0)
    query_start_loc = query_start_loc.to(torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    host_copies = {}
    if "query_start_loc_cpu" in {
        f.name for f in fields(turboquant_attn.TurboQuantMetadata)
    }:
        host_copies = dict(query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens_t)
    num_tokens = sum(q_lens)
    return turboquant_attn.TurboQuantMetadata(
        seq_lens=seq_lens_t.to(DEVICE),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
        block_table=block_table,
        query_start_loc=query_start_loc.to(DEVICE),
        num_actual_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        is_prefill=True,
        num_decodes=0,
        num_decode_tokens=0,
        **host_copies,
    )


@needs_triton
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("cached_len, q_len", [(300, 40), (203, 129)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", [0])
def test_continuation_prefill_in_windows(
    turboquant_attn, preset, cached_len, q_len, dtype, seed
):
    torch.manual_seed(seed)
    impl, layer = _impl_and_layer(turboquant_attn, preset)
    query, key, value, kv_cache, block_table = _batch(
        impl, layer, [(cached_len, q_len)], dtype
    )

    out = impl._continuation_prefill(
        layer,
        query,
        key,
        value,
        kv_cache,
        block_table,
        cached_len,
        cached_len + q_len,
        layer._tq_Pi,
        layer._tq_centroids,
    )

    ref = _reference(impl, layer, query, key, value, kv_cache, block_table, cached_len)
    _assert_close(out, ref, dtype)


# The first chunk (200 tokens, nothing cached) is the longest request of the batch:
# max_query_len == max_seq_len, the fast path that attended the prefix-cache hits
# beside it to their new tokens only (#46460).
MIXED_BATCH = [(0, 200), (150, 16), (100, 60), (0, 40)]


@needs_triton
@pytest.mark.parametrize("preset", ["turboquant_k8v4", "turboquant_3bit_nc"])
@pytest.mark.parametrize("seed", [0])
def test_prefix_hits_beside_a_longer_first_chunk(turboquant_attn, preset, seed):
    torch.manual_seed(seed)
    dtype = torch.float16
    impl, layer = _impl_and_layer(turboquant_attn, preset)
    query, key, value, kv_cache, block_table = _batch(impl, layer, MIXED_BATCH, dtype)
    metadata = _metadata(turboquant_attn, MIXED_BATCH, block_table)
    assert metadata.max_query_len == metadata.max_seq_len

    out = impl._prefill_attention(
        query,
        key,
        value,
        kv_cache,
        metadata,
        layer._tq_Pi,
        layer._tq_centroids,
        layer._tq_PiT,
        layer,
    )

    start = 0
    for i, (cached_len, q_len) in enumerate(MIXED_BATCH):
        rows = slice(start, start + q_len)
        start += q_len
        ref = _reference(
            impl,
            layer,
            query[rows],
            key[rows],
            value[rows],
            kv_cache,
            block_table[i],
            cached_len,
        )
        _assert_close(out[rows], ref, dtype)


class _AttentionLayer(AttentionLayerBase):
    """The part of an attention layer the metadata builder looks up: its impl."""

    def __init__(self, impl):
        self.impl = impl

    def get_attn_backend(self):
        raise NotImplementedError

    def get_kv_cache_spec(self, vllm_config):
        raise NotImplementedError


@pytest.mark.parametrize("own_prefill", [False, True], ids=["inherited", "own"])
def test_builder_reserves_the_pair_only_for_a_prefill_of_its_own(
    turboquant_attn, monkeypatch, own_prefill
):
    if not hasattr(turboquant_attn, "current_workspace_manager"):
        pytest.skip("this release takes no buffers from a WorkspaceManager")
    from vllm.v1.attention.ops.tq_chunked import workspace_bytes
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    calls = []

    class FakeWorkspaceManager:
        def get_simultaneous(self, *shapes_and_dtypes):
            calls.append(shapes_and_dtypes)

    monkeypatch.setattr(
        turboquant_attn, "current_workspace_manager", lambda: FakeWorkspaceManager()
    )
    monkeypatch.setattr(
        turboquant_attn, "is_workspace_manager_initialized", lambda: True
    )

    # The class the fixture's module holds, imported by name so that it can be a base.
    from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionImpl

    class OwnPrefill(TurboQuantAttentionImpl):
        """A subclass with a prefill of its own (as UltraQuant's), which may take
        vLLM's continuation buffers."""

        def _prefill_attention(self, *args, **kwargs):
            raise NotImplementedError

    impl_cls = OwnPrefill if own_prefill else TurboQuantAttentionImpl
    impl, _ = _impl_and_layer(turboquant_attn, "turboquant_3bit_nc", impl_cls)
    layer_names = ["layers.0.self_attn.attn", "layers.1.self_attn.attn"]
    max_model_len, max_num_batched_tokens = 8192, 4096
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=16,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=True,
        ),
        model_config=SimpleNamespace(
            max_model_len=max_model_len,
            dtype=torch.float16,
            get_num_attention_heads=lambda parallel_config: 8,
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, decode_context_parallel_size=1
        ),
        attention_config=SimpleNamespace(tq_max_kv_splits_for_cuda_graph=4),
        speculative_config=None,
        compilation_config=SimpleNamespace(
            static_forward_context={n: _AttentionLayer(impl) for n in layer_names}
        ),
    )
    spec = FullAttentionSpec(
        block_size=32,
        num_kv_heads=4,
        head_size=128,
        dtype=torch.uint8,
    )

    turboquant_attn.TurboQuantMetadataBuilder(
        kv_cache_spec=spec,
        layer_names=layer_names,
        vllm_config=vllm_config,
        device=torch.device(DEVICE),
    )

    prefill_workspace = workspace_bytes(
        max_num_batched_tokens, 8, 4, 128, WINDOW, torch.float16
    )
    pair = ((1, 4, max_model_len, 128), torch.float16)
    reserved = [shape for call in calls for shape in call]
    if own_prefill:
        assert ((prefill_workspace,), torch.uint8) not in reserved
        if hasattr(turboquant_attn.TurboQuantMetadataBuilder, "_reserve_workspace"):
            assert reserved.count(pair) == 2
    else:
        assert ((prefill_workspace,), torch.uint8) in reserved
        assert pair not in reserved
