"""Continuation prefill timed as an engine runs it, side by side with the latest vLLM.

    tq-chunked bench --stack       single requests: head shapes x q_len x cached_len
    tq-chunked bench --serving     serving-shaped batches: prefix-cache hits, first chunks
    tq-chunked bench --crossover   one short continuation (q_len <= 128): vLLM's decode
                                   replay against the windowed path

vLLM runs attention eagerly between its compiled pieces, so what a step costs is the
layers called back to back, host work included. Per workload and method, interleaved
over repeats (median reported):

  stack ms       L layers (each with its own cache) called back to back, from the first
                 enqueue to the end of the GPU work
  host ms/call   CPU time until a call returns, with the GPU kept busy by a spin kernel
                 (so the host never waits for it)
  GPU ms/call    GPU time of the same calls (CUDA events; the host ran ahead)

Methods: ``latest``: the latest vLLM release's ``_prefill_attention`` with its own
``_continuation_prefill`` (run in the installed runtime through .gpu-carry/latest/
vllm_latest.py), the strongest baseline; ``tq_chunked``: one ``continuation_prefill_varlen``
call per layer with the host copies of the lengths and a preallocated workspace;
``vllm-<version>``: the installed release's real ``forward``, unpatched; ``patched``: the
same ``forward`` with the plugin's replacements. Needs a CUDA GPU.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from . import continuation_prefill_varlen, workspace_bytes
from .demo import build_batch
from .workspace import default_window

K = 1024
LAYERS = 32


@dataclass
class Workload:
    name: str
    shape: str  # a key of bench.SHAPES
    requests: list  # [(cached_len, q_len)]
    preset: str = "turboquant_3bit_nc"


def _hits(rng, n, q_len, lo, hi):
    """n prefix-cache hits of q_len new tokens over lo..hi cached tokens (multiples of 16)."""
    return [(rng.randrange(lo // 16, hi // 16 + 1) * 16, q_len) for _ in range(n)]


def stack_workloads():
    return [Workload(f"{shape} q{q} {c // K}K", shape, [(c, q)]) for shape in ("llama3-8b", "70b-tp8", "70b-tp1")
            for q in (512, 2048) for c in (8 * K, 32 * K, 128 * K)]


def serving_workloads():
    rng = random.Random(0)
    return [
        Workload("1 hit q512 8K", "llama3-8b", [(8 * K, 512)]),
        Workload("16 hits q512 2K-16K", "llama3-8b", _hits(rng, 16, 512, 2 * K, 16 * K)),
        Workload("16 hits q256 1K-8K", "llama3-8b", _hits(rng, 16, 256, 1 * K, 8 * K)),
        Workload("4 chunks q2048 16K-64K", "llama3-8b", _hits(rng, 4, 2048, 16 * K, 64 * K)),
        Workload("32 hits q200 1K-4K", "llama3-8b", _hits(rng, 32, 200, 1 * K, 4 * K)),
        Workload("32 hits q16 1K-8K", "llama3-8b", _hits(rng, 32, 16, 1 * K, 8 * K)),
        Workload("8 hits q64-128 4K-32K", "llama3-8b",
                 [(c, rng.randrange(64, 129)) for c, _ in _hits(rng, 8, 0, 4 * K, 32 * K)]),
        Workload("2 first chunks q2048 + 8 hits q256 2K-16K", "llama3-8b",
                 [(0, 2048), (0, 2048)] + _hits(rng, 8, 256, 2 * K, 16 * K)),
        Workload("8 hits q1024 4K-32K", "70b-tp8", _hits(rng, 8, 1024, 4 * K, 32 * K)),
        Workload("32 hits q128 1K-8K", "70b-tp8", _hits(rng, 32, 128, 1 * K, 8 * K)),
        Workload("16 hits q512 2K-16K", "70b-tp1", _hits(rng, 16, 512, 2 * K, 16 * K)),
        Workload("4 chunks q2048 16K-64K", "70b-tp1", _hits(rng, 4, 2048, 16 * K, 64 * K)),
    ]


def crossover_workloads():
    return [Workload(f"1 hit q{q} {c // K}K", "llama3-8b", [(c, q)]) for q in (8, 32, 128)
            for c in (1 * K, 8 * K, 64 * K)]


# ---------------------------------------------------------------------------
# The layers of one workload, and the methods that run them
# ---------------------------------------------------------------------------

class Layers:
    """L layers' inputs for one workload: one cache written by vLLM's store, cloned per
    layer (no layer finds another's cache in L2), and per-layer Q/K/V."""

    def __init__(self, workload, layers, tq, device):
        from .bench import SHAPES
        hq, hk, d = SHAPES[workload.shape]
        self.hq, self.hk, self.d, self.tq = hq, hk, d, tq
        b = build_batch(workload.preset, workload.requests, hq, hk, d, 16, torch.float16, device, vllm_tq=tq)
        self.kwargs = b["kwargs"]
        self.block_table = b["block_table"]
        self.qsl, self.seq_lens = b["query_start_loc"], b["seq_lens"]
        self.qsl_cpu = torch.tensor(self.qsl, dtype=torch.int32)
        self.seq_lens_cpu = torch.tensor(self.seq_lens, dtype=torch.int32)
        self.qsl_dev = self.qsl_cpu.to(device)
        self.seq_lens_dev = self.seq_lens_cpu.to(device)
        gen = torch.Generator(device).manual_seed(1)
        self.caches = [b["kv_cache"]] + [b["kv_cache"].clone() for _ in range(layers - 1)]
        self.qkv = [(b["query"], b["key"], b["value"])] + [
            tuple(torch.randn(t.shape, generator=gen, device=device, dtype=t.dtype) for t in
                  (b["query"], b["key"], b["value"])) for _ in range(layers - 1)]

    def metadata(self):
        """vLLM's TurboQuantMetadata for this batch (all prefills, no decodes), with the
        host copies the latest release keeps."""
        from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadata
        n = self.qsl[-1]
        q_lens = [self.qsl[i + 1] - self.qsl[i] for i in range(len(self.seq_lens))]
        meta = TurboQuantMetadata(
            seq_lens=self.seq_lens_dev, slot_mapping=torch.zeros(n, dtype=torch.int64, device=self.qsl_dev.device),
            block_table=self.block_table, query_start_loc=self.qsl_dev, num_actual_tokens=n,
            max_query_len=max(q_lens), max_seq_len=max(self.seq_lens), is_prefill=True, num_decodes=0,
            num_decode_tokens=0)
        meta.query_start_loc_cpu, meta.seq_lens_cpu = self.qsl_cpu, self.seq_lens_cpu  # fields of 0.21+
        return meta


def method_tq_chunked(layers: Layers):
    n = layers.qsl[-1]
    window = default_window(layers.hk, layers.d, 16)
    ws = torch.empty(workspace_bytes(n, layers.hq, layers.hk, layers.d, window), dtype=torch.uint8,
                     device=layers.block_table.device)

    def layer_call(i):
        q, k, v = layers.qkv[i]
        return lambda: continuation_prefill_varlen(
            q, k, v, layers.caches[i], layers.block_table, layers.qsl_dev, layers.seq_lens_dev, **layers.kwargs,
            query_start_loc_cpu=layers.qsl_cpu, seq_lens_cpu=layers.seq_lens_cpu, window=window, workspace=ws,
            check_block_table=False)
    return [layer_call(i) for i in range(len(layers.caches))]


def method_latest(layers: Layers):
    """The latest release's _prefill_attention and _continuation_prefill, on an impl of
    their own (the installed release's forward keeps its own methods)."""
    import vllm_latest
    from .vllm_harness import VllmTQ, build_vllm_tq, prepare_latest
    tq = VllmTQ(build_vllm_tq(layers.tq.impl.kv_cache_dtype, layers.hq, layers.hk, layers.d).impl, layers.tq.layer)
    prepare_latest(tq, layers.block_table.device)
    vllm_latest.bind_latest(tq.impl, "_continuation_prefill")
    prefill = vllm_latest.latest_method("_prefill_attention")
    meta = layers.metadata()

    def layer_call(i):
        q, k, v = layers.qkv[i]
        return lambda: prefill(tq.impl, q, k, v, layers.caches[i], meta, tq.layer._tq_Pi, tq.layer._tq_centroids,
                               tq.layer._tq_PiT, tq.layer)
    return [layer_call(i) for i in range(len(layers.caches))]


def _forward_calls(layers: Layers, impl):
    """vLLM's real forward() of ``impl`` per layer (all-prefill batch: it runs
    _prefill_attention), into a preallocated output, as the engine calls it."""
    tq = layers.tq
    meta = layers.metadata()
    n = layers.qsl[-1]

    def layer_call(i):
        q, k, v = layers.qkv[i]
        out = torch.empty(n, layers.hq * layers.d, dtype=q.dtype, device=q.device)
        args = (tq.layer, q.view(n, -1), k.reshape(n, -1), v.reshape(n, -1), layers.caches[i], meta)
        return lambda: impl.forward(*args, output=out).view(n, layers.hq, layers.d)
    return [layer_call(i) for i in range(len(layers.caches))]


def method_vllm(layers: Layers):
    """The installed vLLM release's forward, unpatched."""
    return _forward_calls(layers, layers.tq.impl)


def method_patched(layers: Layers):
    """The installed vLLM release's forward with the plugin's replacements (bound to a
    second impl, so the unpatched one stays as it is)."""
    import types
    import vllm.v1.attention.backends.turboquant_attn as tqa
    from .vllm_harness import build_vllm_tq
    from .vllm_plugin import plan_patches
    impl = build_vllm_tq(layers.tq.impl.kv_cache_dtype, layers.hq, layers.hk, layers.d).impl
    for owner, name, value in plan_patches(tqa, None):
        if owner is tqa.TurboQuantAttentionImpl:
            setattr(impl, name, types.MethodType(value, impl))
    return _forward_calls(layers, impl)


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------

def _spin_cycles_per_ms():
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    s.record()
    torch.cuda._sleep(20_000_000)
    e.record()
    e.synchronize()
    return 20_000_000 / s.elapsed_time(e)


def measure(calls, cycles_per_ms, head_start_ms):
    """(stack ms, host ms per call, GPU ms per call, whether the host stayed ahead).

    Host and GPU time are taken one call at a time: a spin kernel keeps the GPU busy
    while the host enqueues the call, so the host never waits, and the queue is empty
    before each call (a whole stack would fill CUDA's launch queue and make the host
    wait for the GPU)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in calls:
        f()
    torch.cuda.synchronize()
    stack = (time.perf_counter() - t0) * 1e3
    host, events = [], []
    for f in calls:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(head_start_ms * cycles_per_ms))
        t0 = time.perf_counter()
        s.record()
        f()
        host.append((time.perf_counter() - t0) * 1e3)
        e.record()
        e.synchronize()
        events.append((s, e))
    gpu = [s.elapsed_time(e) for s, e in events]
    return stack, statistics.mean(host), statistics.mean(gpu), max(host) < head_start_ms


def run_workloads(workloads, methods, layers=LAYERS, repeats=5, progress=True):
    from .vllm_harness import build_vllm_tq
    from .bench import SHAPES
    cycles = _spin_cycles_per_ms()
    rows = []
    for w in tqdm(workloads, desc="workloads", unit="workload", disable=not progress):
        hq, hk, d = SHAPES[w.shape]
        tq = build_vllm_tq(w.preset, hq, hk, d)
        inputs = Layers(w, layers, tq, torch.device("cuda"))
        calls = {name: make(inputs) for name, make in methods.items()}
        outs = {}
        for name, fs in calls.items():  # warm-up (compilation), and layer 0's answer
            outs[name] = fs[0]().float()
            for f in fs:
                f()
        torch.cuda.synchronize()
        ref = outs.get("latest")
        head_start = {name: 2.0 for name in calls}
        samples = {name: [] for name in calls}
        for _ in range(repeats):  # interleaved: the machine's drift hits every method alike
            for name, fs in calls.items():
                sample = measure(fs, cycles, head_start[name])
                head_start[name] = max(head_start[name], 3 * sample[1])
                samples[name].append(sample)
        for name, ss in samples.items():
            med = lambda i: statistics.median(s[i] for s in ss)
            rows.append(dict(workload=w.name, shape=w.shape, preset=w.preset, requests=len(w.requests),
                             q_tokens=sum(q for _, q in w.requests), cached_tokens=sum(c for c, _ in w.requests),
                             method=name, stack_ms=med(0), stack_ms_all=[s[0] for s in ss],
                             host_ms_per_call=med(1), gpu_ms_per_call=med(2),
                             host_ahead=all(s[3] for s in ss),
                             diff_to_latest=None if ref is None or name == "latest" else
                             ((outs[name] - ref).norm() / ref.norm()).item()))
        mine = rows[-len(samples):]
        base = next((r for r in mine if r["method"] == "latest"), None)
        for r in mine:
            r["ratio"] = r["stack_ms"] / base["stack_ms"] if base else None
        del inputs, calls, outs, tq
        torch.cuda.empty_cache()
    return rows


def methods_available():
    from .vllm_harness import latest_available, vllm_available
    ms = {}
    if latest_available():
        ms["latest"] = method_latest
    ms["tq_chunked"] = method_tq_chunked
    if vllm_available():
        import vllm
        ms[f"vllm-{vllm.__version__}"] = method_vllm
        ms["patched"] = method_patched
    return ms


def markdown(result) -> str:
    lines = [f"# {result['mode']}: continuation prefill as an engine runs it, {result['device']}, {result['date']}",
             "", f"{result['layers']} layers back to back, median of {result['repeats']} interleaved repeats. "
             "stack: first enqueue to end of GPU work; host: CPU time per call with the GPU kept busy; "
             "GPU: GPU time per call. ratio: stack time / latest stack time (lower is better).", "",
             "| workload | shape | B | q tokens | cached | method | stack ms | host ms/call | GPU ms/call | ratio |"
             " vs latest |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, p: "" if x is None else f"{x:.{p}f}"
    e = lambda x: "" if x is None else f"{x:.1e}"
    for r in result["rows"]:
        lines.append(f"| {r['workload']} | {r['shape']} | {r['requests']} | {r['q_tokens']} | "
                     f"{r['cached_tokens'] / K:.0f}K | {r['method']} | {f(r['stack_ms'], 1)} | "
                     f"{f(r['host_ms_per_call'], 3)} | {f(r['gpu_ms_per_call'], 3)} | {f(r.get('ratio'), 2)} | "
                     f"{e(r['diff_to_latest'])} |")
    return "\n".join(lines) + "\n"


def plot(result, path):
    """Stack-time ratio to the latest vLLM per workload and method (bars, log scale)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] if r["method"] != "latest" and r.get("ratio")]
    if not rows:
        return None
    names = list(dict.fromkeys(f"{r['workload']} ({r['shape']})" for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) * len(methods) + 1.5))
    height = 0.8 / len(methods)
    for j, m in enumerate(methods):
        ys, xs = [], []
        for i, n in enumerate(names):
            r = next((r for r in rows if f"{r['workload']} ({r['shape']})" == n and r["method"] == m), None)
            if r:
                ys.append(i + j * height)
                xs.append(r["ratio"])
        ax.barh(ys, xs, height=height, label=m)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(names))], names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel(f"stack time / latest vLLM stack time ({result['layers']} layers; lower is faster)")
    ax.set_title(f"{result['mode']}: {result['device']}")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
