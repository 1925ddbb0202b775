"""vLLM's real ``forward`` on mixed batches, unpatched and with the plugin, on the H200
machine, for whichever vLLM release is importable (run once per release carry):

    (source .gpu-carry-0.21.0/setup.sh && python3 benchmarks/vllm_forward.py OUT_DIR)

1. Issue 46460: two decodes, a first chunk that is the longest request (1000 tokens), a
   prefix-cache hit of 200 tokens over 300 cached and a short one of 16 over 200: the
   unpatched batch takes vLLM's raw-K/V fast path; each request's rows are measured
   against the float64 oracle of its own attention.
2. A long hit (1024 tokens over 8K, 32K, 128K cached) beside two decodes, a first chunk
   and a short hit (64 over 3000), the way an engine runs it: the metadata builder
   created (the plugin's hook reserves its workspace), then, where the release has a
   WorkspaceManager, the manager locked after a short (256-token) profile. Unpatched:
   the crash (0.21-0.23), the max_model_len reservation (0.24 on) or per-layer buffers
   (0.20); patched: each request's error against the oracle and peak memory per forward.

Writes OUT_DIR/forward-<release>.json and prints a table.
"""

import contextlib
import gc
import json
import os
import sys
import traceback
import types

import torch
import vllm
import vllm.v1.attention.backends.turboquant_attn as tqa

from tq_chunked.runtime.format import TQConfig
from tq_chunked.tools.reference import (
    full_buffer_continuation_prefill,
    oracle_continuation_prefill,
)
from tq_chunked.vllm_plugin import plan_patches

HQ, HK, D, BS = 32, 8, 128, 16
PRESET = "turboquant_3bit_nc"
MAX_MODEL_LEN = 131072 + 4096


def plain_config(max_num_batched_tokens):
    """The config values vLLM's TurboQuant classes read (VllmConfig() has no model
    here)."""
    ns = types.SimpleNamespace
    return ns(
        attention_config=ns(tq_max_kv_splits_for_cuda_graph=32),
        model_config=ns(
            max_model_len=MAX_MODEL_LEN,
            dtype=torch.float16,
            get_num_attention_heads=lambda parallel_config: HQ,
        ),
        compilation_config=ns(cudagraph_capture_sizes=[]),
        speculative_config=None,
        parallel_config=ns(decode_context_parallel_size=1),
        scheduler_config=ns(
            max_num_seqs=8,
            enable_chunked_prefill=True,
            max_num_batched_tokens=max_num_batched_tokens,
        ),
    )


@contextlib.contextmanager
def config(max_num_batched_tokens=8192):
    real = tqa.get_current_vllm_config
    tqa.get_current_vllm_config = lambda: plain_config(max_num_batched_tokens)
    try:
        yield
    finally:
        tqa.get_current_vllm_config = real


def build_impl():
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )

    with config():
        impl = tqa.TurboQuantAttentionImpl(
            num_heads=HQ,
            head_size=D,
            scale=D**-0.5,
            num_kv_heads=HK,
            kv_cache_dtype=PRESET,
        )
    layer = torch.nn.Module()
    layer._tq_centroids = get_centroids(D, impl.tq_config.centroid_bits).to("cuda")
    impl._ensure_on_device(layer, torch.device("cuda"))
    return impl, layer


def head_major():
    import inspect

    return "kv_cache.transpose(1, 2)" in inspect.getsource(
        tqa.TurboQuantAttentionImpl.forward
    )


def mixed_batch(impl, layer, reqs, num_decodes, seed=0):
    """reqs: [(cached, q_len)], decodes first; every token already in the cache (written
    by vLLM's store), as do_kv_cache_update leaves it before forward."""
    gen = torch.Generator("cuda").manual_seed(seed)
    cfg = TQConfig.from_preset(PRESET, D)
    blocks = [-(-(c + q) // BS) for c, q in reqs]
    nb = sum(blocks) + 4
    cache = torch.zeros(nb, BS, HK, cfg.slot_bytes, dtype=torch.uint8, device="cuda")
    perm = torch.randperm(nb, generator=gen, device="cuda").int()
    bt = torch.zeros(len(reqs), max(blocks), dtype=torch.int32, device="cuda")
    qs, ks, vs, slot_maps, used = [], [], [], [], 0
    for i, ((cached, q_len), nblk) in enumerate(zip(reqs, blocks)):
        bt[i, :nblk] = perm[used : used + nblk]
        used += nblk
        total = cached + q_len
        for s in range(0, total, 16384):
            n = min(16384, total - s)
            key = torch.randn(
                n, HK, D, generator=gen, device="cuda", dtype=torch.float16
            )
            val = torch.randn(
                n, HK, D, generator=gen, device="cuda", dtype=torch.float16
            )
            pos = torch.arange(s, s + n, device="cuda")
            slots = bt[i].long()[pos // BS] * BS + pos % BS
            impl._store_kv(
                key, val, cache, slots, layer
            )  # vLLM's store, on the (blocks, pos, Hk, slot) view
            new = slice(max(0, cached - s), n)
            ks.append(key[new])
            vs.append(val[new])
            slot_maps.append(slots[new])
        qs.append(
            torch.randn(q_len, HQ, D, generator=gen, device="cuda", dtype=torch.float16)
        )
    q_lens = [q for _, q in reqs]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    n = qsl[-1]
    extra = {}
    if "query_start_loc_cpu" in tqa.TurboQuantMetadata.__dataclass_fields__:
        extra = dict(
            query_start_loc_cpu=torch.tensor(qsl, dtype=torch.int32),
            seq_lens_cpu=torch.tensor([c + q for c, q in reqs], dtype=torch.int32),
        )
    meta = tqa.TurboQuantMetadata(
        seq_lens=torch.tensor(
            [c + q for c, q in reqs], dtype=torch.int32, device="cuda"
        ),
        slot_mapping=torch.cat(slot_maps),
        block_table=bt,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        num_actual_tokens=n,
        max_query_len=max(q_lens),
        max_seq_len=max(c + q for c, q in reqs),
        is_prefill=True,
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        **extra,
    )
    # forward() takes the cache as the engine allocates it
    cache_in = cache.transpose(1, 2).contiguous() if head_major() else cache
    return torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, cache_in, meta, qsl


def forward(impl, layer, q, k, v, cache_in, meta):
    n = q.shape[0]
    out = torch.full((n, HQ * D), float("nan"), dtype=q.dtype, device="cuda")
    return impl.forward(
        layer,
        q.reshape(n, -1),
        k.reshape(n, -1),
        v.reshape(n, -1),
        cache_in,
        meta,
        output=out,
    ).view(n, HQ, D)


def errors(out, q, k, v, cache, meta, qsl, reqs, layer):
    """Per request: (error vs the float64 oracle, the full-buffer path's error)."""
    kw = dict(
        preset=PRESET,
        centroids=layer._tq_centroids,
        rotation=layer._tq_Pi,
        scale=D**-0.5,
    )
    res = []
    for r, (cached, q_len) in enumerate(reqs):
        rows = slice(qsl[r], qsl[r + 1])
        args = (q[rows], k[rows], v[rows], cache, meta.block_table[r], cached)
        oracle = oracle_continuation_prefill(*args, **kw)
        full = full_buffer_continuation_prefill(*args, **kw)

        def rel(x, oracle=oracle):
            return ((x.double() - oracle).norm() / oracle.norm()).item()

        res.append(
            dict(
                request=r,
                cached=cached,
                q_len=q_len,
                error=rel(out[rows]),
                full_error=rel(full),
            )
        )
    return res


def patch(impl, monkey):
    for owner, name, value in plan_patches(tqa, None):
        monkey.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)


def unpatch(monkey):
    for owner, name, value in reversed(monkey):
        setattr(owner, name, value)
    monkey.clear()


def scenario_46460(result):
    impl, layer = build_impl()
    reqs = [(1000, 1), (3000, 1), (0, 1000), (300, 200), (200, 16)]
    q, k, v, cache, cache_in, meta, qsl = mixed_batch(
        impl, layer, reqs, num_decodes=2, seed=1
    )
    unpatched = errors(
        forward(impl, layer, q, k, v, cache_in, meta),
        q,
        k,
        v,
        cache,
        meta,
        qsl,
        reqs,
        layer,
    )
    monkey = []
    patch(impl, monkey)
    try:
        patched = errors(
            forward(impl, layer, q, k, v, cache_in, meta),
            q,
            k,
            v,
            cache,
            meta,
            qsl,
            reqs,
            layer,
        )
    finally:
        unpatch(monkey)
    result["issue_46460"] = dict(requests=reqs, unpatched=unpatched, patched=patched)


def manager_bytes():
    """Bytes of vLLM's WorkspaceManager's buffers (0.21 onwards; its private list, read
    only)."""
    from vllm.v1.worker import workspace as ws_mod

    manager = ws_mod.current_workspace_manager()
    return sum(
        w.numel() * w.element_size()
        for w in manager._current_workspaces
        if w is not None
    )


def scenario_long(result, long_cached):
    has_manager = hasattr(tqa, "current_workspace_manager")
    if has_manager:
        from vllm.v1.worker import workspace as ws_mod
    reqs = [(1000, 1), (3000, 1), (0, 512), (3000, 64), (long_cached, 1024)]
    row = dict(long_cached=long_cached)
    for mode in ("unpatched", "patched"):
        monkey = []
        if mode == "patched":
            patch(None, monkey)
        try:
            # the previous mode's manager, impl and buffers gone before counting
            gc.collect()
            torch.cuda.empty_cache()
            if has_manager:
                if ws_mod.is_workspace_manager_initialized():
                    ws_mod.reset_workspace_manager()
                ws_mod.init_workspace_manager(torch.device("cuda"))
            impl, layer = build_impl()
            spec = types.SimpleNamespace(num_kv_heads=HK, head_size=D, block_size=BS)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            # the builder as vLLM creates it (the plugin's hook, if patched, reserves)
            with config():
                tqa.TurboQuantMetadataBuilder(
                    spec, ["layers.0"], plain_config(8192), torch.device("cuda")
                )
            torch.cuda.synchronize()
            # What the builder reserved: the manager's buffers where there is one (a
            # difference of allocated memory would count the release of a buffer an
            # earlier object still held), else what the builder allocated.
            row[f"{mode}_reserved_mib"] = (
                manager_bytes()
                if has_manager
                else torch.cuda.memory_allocated() - before
            ) / 2**20
            # a short profile (decode scratch for 8 sequences, a 256-token
            # continuation), the lock
            if has_manager:
                manager = ws_mod.current_workspace_manager()
                manager.get_simultaneous(
                    ((8, HQ, 32, D + 1), torch.float32),
                    ((8, HQ, D), torch.float16),
                    ((8, HQ), torch.float32),
                )
                manager.get_simultaneous(
                    ((1, HK, 256, D), torch.float16), ((1, HK, 256, D), torch.float16)
                )
                ws_mod.lock_workspace()
            torch.cuda.synchronize()
            q, k, v, cache, cache_in, meta, qsl = mixed_batch(
                impl, layer, reqs, num_decodes=2, seed=2
            )
            forward(
                impl, layer, q, k, v, cache_in, meta
            )  # warm-up (fails the same way if it fails)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = forward(impl, layer, q, k, v, cache_in, meta)
            torch.cuda.synchronize()
            row[f"{mode}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            row[f"{mode}_errors"] = errors(out, q, k, v, cache, meta, qsl, reqs, layer)
            del q, k, v, cache, cache_in, meta, out, impl, layer
        except Exception as e:  # the crash this project exists for, on 0.21-0.23
            row[f"{mode}_raised"] = f"{type(e).__name__}: {str(e)[:240]}"
        finally:
            unpatch(monkey)
            if has_manager and ws_mod.is_workspace_manager_initialized():
                ws_mod.reset_workspace_manager()
            torch.cuda.empty_cache()
    result.setdefault("long", []).append(row)


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    result = dict(vllm=vllm.__version__, preset=PRESET, shape=[HQ, HK, D])
    for name, fn in [("46460", lambda: scenario_46460(result))] + [
        (f"long {n}", lambda n=n: scenario_long(result, n))
        for n in (8192, 32768, 131072)
    ]:
        try:
            fn()
        except Exception:
            result.setdefault("failures", []).append(
                f"{name}: {traceback.format_exc()[-1500:]}"
            )
            traceback.print_exc()
    path = os.path.join(out_dir, f"forward-{vllm.__version__}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"== vLLM {vllm.__version__}: forward on mixed batches, {PRESET}, Hq {HQ} "
        f"Hk {HK} D {D}"
    )
    if "issue_46460" in result:
        r = result["issue_46460"]
        for u, p in zip(r["unpatched"], r["patched"]):
            print(
                f"  46460 batch request {u['request']} (cached {u['cached']}, "
                f"q {u['q_len']}): unpatched {u['error']:.2e}, patched "
                f"{p['error']:.2e}, full path {p['full_error']:.2e}"
            )
    for row in result.get("long", []):
        nan = float("nan")
        print(
            f"  long hit over {row['long_cached'] // 1024}K: reserved unpatched "
            f"{row.get('unpatched_reserved_mib', nan):.1f} / patched "
            f"{row.get('patched_reserved_mib', 0):.1f} MiB; peak per forward unpatched "
            f"{row.get('unpatched_peak_mib', nan):.1f} / patched "
            f"{row.get('patched_peak_mib', nan):.1f} MiB; unpatched raised: "
            f"{row.get('unpatched_raised', '-')}"
        )
        for e in row.get("patched_errors", []):
            u = next(
                (
                    x
                    for x in row.get("unpatched_errors", [])
                    if x["request"] == e["request"]
                ),
                None,
            )
            print(
                f"    request {e['request']} (cached {e['cached']}, q {e['q_len']}): "
                f"patched {e['error']:.2e}, full {e['full_error']:.2e}"
                + (f", unpatched {u['error']:.2e}" if u else "")
            )
        if "patched_raised" in row:
            print("    PATCHED RAISED:", row["patched_raised"])
    for f in result.get("failures", []):
        print("FAILURE", f[-600:])


if __name__ == "__main__":
    main()
