"""Continuation prefill timed as an engine runs it, side by side with vLLM's own
prefill and with the floor, in one run.

    tq-chunked bench --stack       single requests: head shapes x q_len x cached_len
    tq-chunked bench --serving     serving-shaped batches: prefix-cache hits, first
                                   chunks, head shapes, dtypes and presets
    tq-chunked bench --crossover   one short continuation (q_len <= 128): vLLM's
                                   decode replay against the windowed path
    tq-chunked bench --memory-bound  many short continuations and decodes over cached
                                   prefixes, where attention is bound by the cache's
                                   bytes: each path, and the bandwidth it reads at

vLLM runs attention eagerly between its compiled pieces, so what a step costs is the
layers called back to back, host work included. Per workload and method, interleaved
over repeats (median reported):

  stack ms       L layers (each with its own cache, up to MAX_CACHE_BYTES of copies)
                 called back to back, from the first enqueue to the end of the GPU
                 work
  host ms/call   CPU time until a call returns, with the GPU kept busy by a spin
                 kernel (so the host never waits for it)
  GPU ms/call    GPU time of the same calls (CUDA events; the host ran ahead)
  kernel ms/call the sum of the GPU kernels' own durations over a stack (profiler),
                 per call: what the call costs the GPU, host gaps excluded
  step ms        a model-shaped step: per layer the attention call between GEMMs of
                 that layer's weights (QKV, output, MLP; testing.LAYER_GEMMS), L layers

Methods: ``baseline``: vLLM's ``_prefill_attention`` with its own
``_continuation_prefill``, the installed release's or, with ``--baseline-source``,
another release's (tq_chunked/tools/baseline.py), the ratios' reference; ``floor``: one
FlashAttention varlen call per layer over fp16/bf16 K/V of the same lengths (causal, no
dequantization): what a BF16 cache costs; ``tq_chunked``: the plugin's flow, one
``ContinuationPrefill.plan`` a step (in layer 0's call) with the host copies of the
lengths and a preallocated workspace, and its ``run`` per layer (each request on the
path its plan picks); ``tq_chunked-windows``: the same with every request through
windows (``path="window"``); ``tq_chunked-one-call``: ``tq_chunked`` with no batch
window spread (``spread=1``: each in one FlashAttention call, NOTES.md §71);
``tq_chunked-default``: one ``continuation_prefill_varlen`` call per layer with every
default (a plan each call, its own workspace, the block-id check on);
``vllm-<version>``: the installed release's real ``forward``, unpatched; ``patched``:
the same ``forward`` with the plugin's replacements. --memory-bound adds
``tq_chunked-paged``: ``tq_chunked`` with every request with cached tokens on the
memory-bound path (``path="paged"``), and on batches of one query token per request
``vllm-decode``: the installed release's
TurboQuant decode kernel as its ``_decode_attention`` calls it. On those batches vLLM
decodes: ``vllm-<version>`` and ``patched`` run ``forward`` on the metadata vLLM's
builder makes for decodes, and the baseline (a continuation prefill's method) sits them
out, as every method does a workload it does not apply to (``applies``). Needs a CUDA
GPU and vLLM. Results written before the baseline was chosen here name it ``latest``
(vLLM 0.33.0's methods in vLLM 0.20.0's runtime); :func:`baseline_name` reads both.

Each row also holds its workload's bytes: the quantized slots of the cached tokens
(``quantized_bytes``) and fp16/bf16 K/V of every token (``fp16_bytes``); the table of
--memory-bound sets them against COPY_RATE and against each method's kernel time (the
rate it reads the cache at: queries, outputs and the new tokens' K/V are not counted).
A method that fails on a workload gets a row with its error and no times; the others
run on.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
import types

import torch
from tqdm import tqdm

from .. import ContinuationPrefill, continuation_prefill_varlen
from ..runtime.plan import default_window
from .testing import (
    LAYER_GEMMS,
    SHAPES,
    build_batch,
)

K = 1024
LAYERS = 32
BASELINE = "baseline"  # the baseline method's name in new results
COPY_RATE = 4.3e12  # bytes per second: the H200's measured copy rate (device to device)
# The layers' caches in all: each layer its own copy up to this, then reused in turn
# (far more than the L2 holds either way; the memory-bound grid's largest cache is 2.8
# GB a layer)
MAX_CACHE_BYTES = 16 << 30


def baseline_name(result) -> str:
    """The name of the method a result's ratios are against: ``baseline``, or
    ``latest`` in results written before it was named so."""
    return result.get("baseline", "latest")


def diff_to_baseline(row):
    """A row's relative difference to the baseline's answer (key of old results:
    diff_to_latest), or None."""
    return row.get("diff_to_baseline", row.get("diff_to_latest"))


# ---------------------------------------------------------------------------
# The layers of one workload, and the methods that run them
# ---------------------------------------------------------------------------


class Layers:
    """L layers' inputs for one workload: one cache written by vLLM's store, cloned per
    layer up to MAX_CACHE_BYTES in all, then reused in turn (no layer finds another's
    cache in L2), and per-layer Q/K/V."""

    def __init__(self, workload, layers, tq, device):
        hq, hk, d = SHAPES[workload.shape]
        self.hq, self.hk, self.d, self.tq = hq, hk, d, tq
        self.workload = workload
        self.dtype = getattr(torch, workload.dtype)
        b = build_batch(
            workload.preset,
            workload.requests,
            hq,
            hk,
            d,
            16,
            self.dtype,
            device,
            vllm_tq=tq,
        )
        self.kwargs = b["kwargs"]
        self.block_table = b["block_table"]
        self.qsl, self.seq_lens = b["query_start_loc"], b["seq_lens"]
        self.q_lens = [self.qsl[i + 1] - self.qsl[i] for i in range(len(self.seq_lens))]
        self.qsl_cpu = torch.tensor(self.qsl, dtype=torch.int32)
        self.seq_lens_cpu = torch.tensor(self.seq_lens, dtype=torch.int32)
        self.qsl_dev = self.qsl_cpu.to(device)
        self.seq_lens_dev = self.seq_lens_cpu.to(device)
        gen = torch.Generator(device).manual_seed(1)
        cache = b["kv_cache"]
        count = max(1, min(layers, MAX_CACHE_BYTES // max(cache.nbytes, 1)))
        copies = [cache] + [cache.clone() for _ in range(count - 1)]
        self.caches = [copies[i % count] for i in range(layers)]
        cached = sum(self.seq_lens) - sum(self.q_lens)
        self.quantized_bytes = cached * hk * cache.shape[-1]
        self.fp16_bytes = sum(self.seq_lens) * hk * d * 2 * self.dtype.itemsize
        self.qkv = [(b["query"], b["key"], b["value"])] + [
            tuple(
                torch.randn(t.shape, generator=gen, device=device, dtype=t.dtype)
                for t in (b["query"], b["key"], b["value"])
            )
            for _ in range(layers - 1)
        ]

    def metadata(self):
        """The TurboQuantMetadata vLLM's builder makes for this batch: all prefills,
        or all decodes where every request has one query token (its
        reorder_batch_threshold is 1); with the host copies of the lengths that
        releases from 0.21 keep."""
        from vllm.v1.attention.backends.turboquant_attn import TurboQuantMetadata

        n = self.qsl[-1]
        decode = _decodes(self.workload)
        decodes = len(self.q_lens) if decode else 0
        meta = TurboQuantMetadata(
            seq_lens=self.seq_lens_dev,
            slot_mapping=torch.zeros(n, dtype=torch.int64, device=self.qsl_dev.device),
            block_table=self.block_table,
            query_start_loc=self.qsl_dev,
            num_actual_tokens=n,
            max_query_len=max(self.q_lens),
            max_seq_len=max(self.seq_lens),
            is_prefill=not decode,
            num_decodes=decodes,
            num_decode_tokens=decodes,
        )
        meta.query_start_loc_cpu, meta.seq_lens_cpu = (
            self.qsl_cpu,
            self.seq_lens_cpu,
        )  # fields of 0.21+
        return meta


def _decodes(workload) -> bool:
    """Whether every request of the workload has one query token: a batch vLLM
    decodes."""
    return all(q == 1 for _, q in workload.requests)


# A method (a function of Layers returning the per-layer calls) applies to every
# workload but where its ``applies`` attribute, a function of the workload, says not.


def method_floor(layers: Layers, max_bytes=8 << 30):
    """One FlashAttention varlen call per layer over K/V of the query's dtype with the
    same lengths (cached + new per request, causal): prefill over a BF16/FP16 cache.
    Layers share K/V buffers cyclically beyond max_bytes (far more than the L2
    holds)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from ..runtime.attention import vllm_flash

    version = vllm_flash(layers.d)[1]
    dev = layers.block_table.device
    total = sum(layers.seq_lens)
    one = 2 * total * layers.hk * layers.d * layers.dtype.itemsize
    count = max(1, min(len(layers.caches), max_bytes // max(one, 1)))
    gen = torch.Generator(dev).manual_seed(2)
    kv = [
        tuple(
            torch.randn(
                total,
                layers.hk,
                layers.d,
                generator=gen,
                device=dev,
                dtype=layers.dtype,
            )
            for _ in range(2)
        )
        for _ in range(count)
    ]
    cu_k = torch.tensor(
        [0] + list(itertools.accumulate(layers.seq_lens)), dtype=torch.int32, device=dev
    )
    max_q = max(layers.q_lens)

    def layer_call(i):
        q = layers.qkv[i][0]
        k, v = kv[i % count]
        return lambda: flash_attn_varlen_func(
            q,
            k,
            v,
            max_q,
            layers.qsl_dev,
            max(layers.seq_lens),
            cu_k,
            softmax_scale=layers.d**-0.5,
            causal=True,
            fa_version=version,
        )

    return [layer_call(i) for i in range(len(layers.caches))]


def method_tq_chunked_default(layers: Layers):
    """continuation_prefill_varlen with every default: a workspace of its own per call,
    the block-id check on."""

    def layer_call(i):
        q, k, v = layers.qkv[i]
        return lambda: continuation_prefill_varlen(
            q,
            k,
            v,
            layers.caches[i],
            layers.block_table,
            layers.qsl_dev,
            layers.seq_lens_dev,
            **layers.kwargs,
            query_start_loc_cpu=layers.qsl_cpu,
            seq_lens_cpu=layers.seq_lens_cpu,
        )

    return [layer_call(i) for i in range(len(layers.caches))]


def method_tq_chunked(layers: Layers, path="auto", spread="auto"):
    """The plugin's flow: one ``ContinuationPrefill`` with a workspace of
    its workspace_bytes(N); its ``plan`` once a step (in layer 0's call, as vLLM's
    builder makes it once a step before the layers run) and ``run`` per layer, each
    request on the path the plan picks (``path="window"``: every request through
    windows; ``"paged"``: every request with cached tokens on the memory-bound path;
    ``spread=1``: no batch window spread, each in one FlashAttention call).
    Host time per call is the plan's share (over the layers) plus a run's."""
    kw = dict(layers.kwargs)
    prefill = ContinuationPrefill(
        layers.hq,
        layers.hk,
        layers.d,
        preset=kw.pop("preset"),
        dtype=layers.dtype,
        block_size=16,
        window=default_window(layers.hk, layers.d, 16),
        path=path,
        spread=spread,
        check_block_table=False,
    )
    ws = torch.empty(
        prefill.workspace_bytes(layers.qsl[-1]),
        dtype=torch.uint8,
        device=layers.block_table.device,
    )
    step: list = [None]

    def plan():
        step[0] = prefill.plan(
            layers.block_table,
            layers.qsl_dev,
            layers.seq_lens_dev,
            query_start_loc_cpu=layers.qsl_cpu,
            seq_lens_cpu=layers.seq_lens_cpu,
            workspace=ws,
        )

    def layer_call(i):
        q, k, v = layers.qkv[i]

        def call():
            if i == 0 or step[0] is None:
                plan()
            return step[0].run(q, k, v, layers.caches[i], **kw)

        return call

    return [layer_call(i) for i in range(len(layers.caches))]


def method_tq_chunked_windows(layers: Layers):
    return method_tq_chunked(layers, path="window")


def method_tq_chunked_paged(layers: Layers):
    return method_tq_chunked(layers, path="paged")


def method_tq_chunked_one_call(layers: Layers):
    return method_tq_chunked(layers, spread=1)


def method_vllm_decode(layers: Layers):
    """The installed vLLM release's TurboQuant decode kernel per layer, as its
    ``_decode_attention`` calls it (``vllm_harness.vllm_decode``)."""
    from .vllm_harness import vllm_decode

    kw = layers.kwargs
    decode = vllm_decode(layers.tq, kw["rotation"], kw["centroids"], kw["scale"],
                         layers.d, layers.block_table.device)  # fmt: skip

    def layer_call(i):
        q, cache = layers.qkv[i][0], layers.caches[i]
        return lambda: decode(q, cache, layers.block_table, layers.seq_lens_dev)

    return [layer_call(i) for i in range(len(layers.caches))]


method_vllm_decode.applies = _decodes  # a decode kernel


def method_baseline(baseline):
    """The baseline's ``_prefill_attention`` (its per-request loop, calling its own
    ``_continuation_prefill``), on an impl of its own: the installed release's forward
    keeps its own methods. ``baseline``: a tq_chunked.tools.baseline.Baseline."""

    def make(layers: Layers):
        from .vllm_harness import build_vllm_tq

        impl = build_vllm_tq(
            layers.tq.impl.kv_cache_dtype, layers.hq, layers.hk, layers.d
        ).impl
        layer = layers.tq.layer
        baseline.attach(impl, layer, layers.block_table.device)
        meta = layers.metadata()

        def layer_call(i):
            q, k, v = layers.qkv[i]
            cache = layers.caches[i]
            return lambda: impl._prefill_attention(
                q,
                k,
                v,
                cache,
                meta,
                layer._tq_Pi,
                layer._tq_centroids,
                layer._tq_PiT,
                layer,
            )

        return [layer_call(i) for i in range(len(layers.caches))]

    make.applies = lambda w: not _decodes(w)  # a continuation prefill's method
    return make


def _forward_calls(layers: Layers, impl):
    """The real vLLM forward() of ``impl`` per layer (all-prefill batch: it runs
    _prefill_attention), into a preallocated output, as the engine calls it."""
    tq = layers.tq
    meta = layers.metadata()
    n = layers.qsl[-1]

    def layer_call(i):
        q, k, v = layers.qkv[i]
        out = torch.empty(n, layers.hq * layers.d, dtype=q.dtype, device=q.device)
        args = (
            tq.layer,
            q.view(n, -1),
            k.reshape(n, -1),
            v.reshape(n, -1),
            layers.caches[i],
            meta,
        )
        return lambda: impl.forward(*args, output=out).view(n, layers.hq, layers.d)

    return [layer_call(i) for i in range(len(layers.caches))]


def method_vllm(layers: Layers):
    """The installed vLLM release's forward, unpatched."""
    return _forward_calls(layers, layers.tq.impl)


def method_patched(layers: Layers):
    """The installed vLLM release's forward with the plugin's replacements (bound to a
    second impl, so the unpatched one stays as it is)."""
    import vllm.v1.attention.backends.turboquant_attn as tqa

    from ..vllm_plugin import plan_patches
    from .vllm_harness import build_vllm_tq

    impl = build_vllm_tq(
        layers.tq.impl.kv_cache_dtype, layers.hq, layers.hk, layers.d
    ).impl
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


def kernel_ms_per_call(calls):
    """The GPU kernels' own time per call over the stack (profiler), host gaps
    excluded."""
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for f in calls:
            f()
        torch.cuda.synchronize()
    total_us = sum(
        e.self_device_time_total
        for e in prof.key_averages()
        if e.device_type.name == "CUDA"
    )
    return total_us / 1e3 / len(calls)


class Step:
    """A model-shaped step's GEMMs around each layer's attention: QKV projection, output
    projection and the MLP (gate+up, down) of one layer's weights (LAYER_GEMMS), on
    N tokens; the weights are shared by the layers (they are far larger than the L2)."""

    def __init__(self, shape, n, dtype, device):
        hq, hk, d = SHAPES[shape]
        hidden, inter = LAYER_GEMMS[shape]
        gen = torch.Generator(device).manual_seed(3)
        r = lambda *s: torch.randn(*s, generator=gen, device=device, dtype=dtype) * 0.02
        self.x, self.attn = r(n, hidden), r(n, hq * d)
        self.w_qkv, self.w_o = r(hidden, (hq + 2 * hk) * d), r(hq * d, hidden)
        self.w_gu, self.w_d = r(hidden, 2 * inter), r(inter, hidden)

    def around(self, attention):
        def layer():
            self.x @ self.w_qkv
            attention()
            h = self.attn @ self.w_o
            gu = h @ self.w_gu
            gu[:, : self.w_d.shape[0]] @ self.w_d

        return layer


def wall_ms(calls) -> float:
    """Milliseconds from the first of ``calls``' enqueue to the GPU's end, the calls
    run back to back as an engine runs its layers (the queue empty before)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for f in calls:
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def measure(calls, cycles_per_ms, head_start_ms, step=None):
    """(stack ms, host ms per call, GPU ms per call, whether the host stayed ahead,
    model step ms or None, the longest call's host ms).

    Host and GPU time are taken one call at a time: a spin kernel keeps the GPU busy
    while the host enqueues the call, so the host never waits, and the queue is empty
    before each call (a whole stack would fill CUDA's launch queue and make the host
    wait for the GPU)."""
    stack = wall_ms(calls)
    step_ms = wall_ms([step.around(f) for f in calls]) if step is not None else None
    host, events = [], []
    for f in calls:
        s, e = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        torch.cuda._sleep(int(head_start_ms * cycles_per_ms))
        t0 = time.perf_counter()
        s.record()
        f()
        host.append((time.perf_counter() - t0) * 1e3)
        e.record()
        e.synchronize()
        events.append((s, e))
    gpu = [s.elapsed_time(e) for s, e in events]
    return (
        stack,
        statistics.mean(host),
        statistics.mean(gpu),
        max(host) < head_start_ms,
        step_ms,
        max(host),
    )


def run_workloads(
    workloads, methods, layers=LAYERS, repeats=5, progress=True, oracle=False
):
    """Rows of the results: per workload and method, the times (median of the
    interleaved repeats), the ratios to the baseline and the floor, and the relative
    difference of layer 0's answer to the baseline's; with ``oracle``, also each
    request's relative error of layer 0's answer against the float64 oracle
    (``oracle_errors``: requests of 4 query tokens or more, in order; not for the
    floor, whose K/V are random)."""
    from .baseline import ensure_workspace
    from .vllm_harness import build_vllm_tq

    device = torch.device("cuda")
    ensure_workspace(device)  # the installed forward of releases from 0.21 needs it
    cycles = _spin_cycles_per_ms()
    rows = []
    bar = tqdm(workloads, desc="workloads", unit="workload", disable=not progress)
    for w in bar:
        applied = {
            name: make
            for name, make in methods.items()
            if getattr(make, "applies", lambda w: True)(w)
        }
        if not applied:
            bar.write(f"{w.name} ({w.shape}): none of the methods applies; skipped")
            continue
        hq, hk, d = SHAPES[w.shape]
        tq = build_vllm_tq(w.preset, hq, hk, d)
        inputs = Layers(w, layers, tq, device)
        step = Step(w.shape, inputs.qsl[-1], inputs.dtype, device)
        calls, outs, failed = {}, {}, {}
        for name, make in applied.items():
            # warm-up (compilation), and layer 0's answer; a method that fails here
            # is reported in its row and the others run on
            try:
                fs = make(inputs)
                outs[name] = fs[0]().float()
                for f in fs:
                    f()
                calls[name] = fs
            except Exception as e:  # noqa: BLE001 - reported in the results
                failed[name] = f"{type(e).__name__}: {e}"[:300]
                bar.write(f"{w.name} ({w.shape}), {name} failed: {failed[name]}")
                torch.cuda.synchronize()
        # the step's GEMMs too: in a run without vLLM's method (whose warm-up calls
        # cuBLAS) cuBLAS's first calls fell in the first step timed, the floor's: 119
        # ms, against 54 where vLLM's method ran first (a median of 2 keeps half)
        step.around(lambda: None)()
        torch.cuda.synchronize()
        errors = _oracle_errors(inputs, outs) if oracle else {}
        ref = outs.get(BASELINE)
        kernel = {name: kernel_ms_per_call(fs) for name, fs in calls.items()}
        head_start = {name: 2.0 for name in calls}
        samples = {name: [] for name in calls}
        for _ in range(repeats):  # interleaved: the machine's drift hits all alike
            for name, fs in calls.items():
                sample = measure(fs, cycles, head_start[name], step)
                # from the longest call: layer 0's also plans the step (tq_chunked)
                head_start[name] = max(head_start[name], 3 * sample[5])
                samples[name].append(sample)
        first = len(rows)
        workload = dict(
            workload=w.name,
            shape=w.shape,
            preset=w.preset,
            dtype=w.dtype,
            requests=len(w.requests),
            q_tokens=sum(q for _, q in w.requests),
            cached_tokens=sum(c for c, _ in w.requests),
            quantized_bytes=inputs.quantized_bytes,
            fp16_bytes=inputs.fp16_bytes,
        )
        for name, ss in samples.items():
            med = [statistics.median(s[i] for s in ss) for i in range(5)]
            diff = None
            if ref is not None and name != BASELINE:
                diff = ((outs[name] - ref).norm() / ref.norm()).item()
            rows.append(
                dict(
                    workload,
                    method=name,
                    stack_ms=med[0],
                    stack_ms_all=[s[0] for s in ss],
                    host_ms_per_call=med[1],
                    gpu_ms_per_call=med[2],
                    kernel_ms_per_call=kernel[name],
                    step_ms=med[4],
                    host_ahead=all(s[3] for s in ss),
                    diff_to_baseline=diff,
                    **({"oracle_errors": errors[name]} if name in errors else {}),
                )
            )
        mine = rows[first:]
        base = next((r for r in mine if r["method"] == BASELINE), None)
        floor = next((r for r in mine if r["method"] == "floor"), None)
        for r in mine:
            r["ratio"] = r["stack_ms"] / base["stack_ms"] if base else None
            r["kernel_to_floor"] = (
                r["kernel_ms_per_call"] / floor["kernel_ms_per_call"] if floor else None
            )
            r["step_to_floor"] = r["step_ms"] / floor["step_ms"] if floor else None
        for name, error in failed.items():
            none = dict.fromkeys(("stack_ms", "host_ms_per_call", "gpu_ms_per_call"))
            rows.append(dict(workload, method=name, error=error, **none))
        del inputs, calls, outs, tq, step
        torch.cuda.empty_cache()
    return rows


def _oracle_errors(inputs: Layers, outs):
    """{method: [relative error of layer 0's answer against the float64 oracle, per
    request of 4 query tokens or more]} for every method but the floor."""
    from .reference import oracle_continuation_prefill
    from .testing import rel_err

    names = [name for name in outs if name != "floor"]
    errors = {name: [] for name in names}
    q, k, v = inputs.qkv[0]
    for r, total in enumerate(inputs.seq_lens):
        q0, q1 = inputs.qsl[r], inputs.qsl[r + 1]
        if q1 - q0 < 4:
            continue
        ref = oracle_continuation_prefill(
            q[q0:q1],
            k[q0:q1],
            v[q0:q1],
            inputs.caches[0],
            inputs.block_table[r],
            total - (q1 - q0),
            **inputs.kwargs,
        )
        for name in names:
            out = outs[name].reshape(-1, inputs.hq, inputs.d)[q0:q1]
            errors[name].append(rel_err(out, ref))
        del ref
    return errors


def methods_available(baseline, mode=None):
    """Name -> method (a function of Layers returning the per-layer calls; its
    ``applies``, where it has one, says which workloads it runs) of what can run
    here; ``baseline``: a tq_chunked.tools.baseline.Baseline; ``mode``: the engine
    mode (--memory-bound adds the memory-bound path alone and vLLM's decode kernel)."""
    import vllm

    from ..runtime.attention import backend_available

    ms = {BASELINE: method_baseline(baseline)}
    if backend_available("flash", torch.device("cuda"), 128)[0]:
        ms["floor"] = method_floor
    ms["tq_chunked"] = method_tq_chunked
    ms["tq_chunked-windows"] = method_tq_chunked_windows
    ms["tq_chunked-one-call"] = method_tq_chunked_one_call
    if mode == "memory-bound":
        ms["tq_chunked-paged"] = method_tq_chunked_paged
        ms["vllm-decode"] = method_vllm_decode
    ms["tq_chunked-default"] = method_tq_chunked_default
    ms[f"vllm-{vllm.__version__}"] = method_vllm
    ms["patched"] = method_patched
    return ms


def _f(x, digits):
    return "" if x is None else f"{x:.{digits}f}"


def markdown(result) -> str:
    """The result as a Markdown table (results of any version: see baseline_name)."""
    base = baseline_name(result)
    source = result.get("baseline_source")
    lines = [
        (
            f"# {result['mode']}: continuation prefill as an engine runs it, "
            f"{result['device']}, {result['date']}"
        ),
        "",
        f"{result['layers']} layers back to back, median of {result['repeats']} "
        "interleaved repeats. stack: first enqueue to end of GPU work; host: CPU time "
        "per call with the GPU kept busy; GPU: GPU time per call; kernel: the GPU "
        "kernels' own time per call (profiler); step: the layers with GEMMs of their "
        f"weights around each attention call. vs {base}: stack time / {base}'s; vs "
        "floor: kernel time and step time / the floor's (FlashAttention over K/V of "
        "the query's dtype, what a BF16 cache costs). Lower is better."
        + (f" {base}: {source}." if source else ""),
        "",
        (
            "| workload | shape | dtype | preset | B | q tokens | cached | method | "
            "stack ms | host ms/call | GPU ms/call | kernel ms/call | step ms | "
            f"vs {base} | kernel vs floor | step vs floor | diff to {base} |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        diff = diff_to_baseline(r)
        cells = [
            r["workload"],
            r["shape"],
            r.get("dtype", "float16"),
            r["preset"].replace("turboquant_", ""),
            str(r["requests"]),
            str(r["q_tokens"]),
            f"{r['cached_tokens'] / K:.0f}K",
            r["method"],
            _f(r["stack_ms"], 1),
            _f(r["host_ms_per_call"], 3),
            _f(r["gpu_ms_per_call"], 3),
            _f(r.get("kernel_ms_per_call"), 3),
            _f(r.get("step_ms"), 1),
            _f(r.get("ratio"), 2),
            _f(r.get("kernel_to_floor"), 2),
            _f(r.get("step_to_floor"), 2),
            "" if diff is None else f"{diff:.1e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if result["mode"] == "memory-bound":
        lines += ["", *_bytes_table(result["rows"])]
    failed = [r for r in result["rows"] if r.get("error")]
    if failed:
        lines += ["", "Failed (no times):", ""]
        lines += [
            f"- {r['workload']} ({r['shape']}), {r['method']}: {r['error']}"
            for r in failed
        ]
    checked = [r for r in result["rows"] if r.get("oracle_errors")]
    if checked:
        lines += [
            "",
            (
                "Layer 0's answer against the float64 oracle (relative error, per "
                "request of 4 query tokens or more, in order):"
            ),
            "",
            "| workload | shape | method | max | per request |",
            "|---|---|---|---|---|",
        ]
        for r in checked:
            errs = r["oracle_errors"]
            lines.append(
                f"| {r['workload']} | {r['shape']} | {r['method']} | "
                f"{max(errs):.2e} | {' '.join(f'{e:.1e}' for e in errs)} |"
            )
    return "\n".join(lines) + "\n"


def _bytes_table(rows):
    """--memory-bound's bytes, a row per workload: the quantized slots of its cached
    tokens and fp16 K/V of its tokens, each in ms at COPY_RATE; per method, the rate
    its kernel time reads the cache at (the floor fp16 K/V, the others the quantized
    slots; queries, outputs and the new tokens' K/V not counted)."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = [
        (
            "Bytes: the quantized slots of the cached tokens and fp16 K/V of every "
            f"token, each in ms at {COPY_RATE / 1e12:.1f} TB/s; per method, the rate "
            "its GPU kernel time reads the cache at, TB/s (the floor fp16 K/V, the "
            "others the quantized slots; queries, outputs and the new tokens' K/V "
            "not counted)."
        ),
        "",
        "| workload | shape | dtype | preset | quantized MB | ms at copy rate | "
        "fp16 MB | ms at copy rate | " + " | ".join(methods) + " |",
        "|---" * (8 + len(methods)) + "|",
    ]
    by_workload = {}
    for r in rows:
        if "quantized_bytes" in r:
            by_workload.setdefault((r["workload"], r["shape"]), []).append(r)
    for (name, shape), rs in by_workload.items():
        q, f = rs[0]["quantized_bytes"], rs[0]["fp16_bytes"]
        rate = {}
        for r in rs:
            kernel = r.get("kernel_ms_per_call")
            read = f if r["method"] == "floor" else q
            rate[r["method"]] = read / (kernel * 1e9) if kernel else None
        cells = [
            name, shape, rs[0].get("dtype", "float16"),
            rs[0]["preset"].replace("turboquant_", ""),
            f"{q / 1e6:.1f}", f"{q / COPY_RATE * 1e3:.3f}",
            f"{f / 1e6:.1f}", f"{f / COPY_RATE * 1e3:.3f}",
        ] + [_f(rate.get(m), 2) for m in methods]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def summary(result) -> str:
    """Geometric means and worst cases of the ratios, per method, over the workloads
    it ran (their count said: a method that applies to some workloads alone, as
    vllm-decode, is not compared over the same set)."""
    base = baseline_name(result)
    out = []
    for m in dict.fromkeys(r["method"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["method"] == m and not r.get("error")]
        parts = [f"{m} ({len(rows)} workloads)"]
        for key, name in (
            ("ratio", f"stack/{base}"),
            ("kernel_to_floor", "kernel/floor"),
            ("step_to_floor", "step/floor"),
        ):
            xs = [r[key] for r in rows if r.get(key)]
            if xs:
                g = math.exp(sum(math.log(x) for x in xs) / len(xs))
                worst = max(rows, key=lambda r, key=key: r.get(key) or 0)
                parts.append(
                    f"{name} geomean {g:.2f}, max {worst[key]:.2f} "
                    f"({worst['workload']}, {worst['shape']})"
                )
        out.append("; ".join(parts))
    return "\n".join(out) + "\n"


def plot(result, path):
    """Per workload and method, the stack-time ratio to the baseline and the
    kernel-time ratio to the floor (bars, log scale, one panel each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = baseline_name(result)
    panels = [
        (key, label)
        for key, label in (
            ("ratio", f"stack time / {base}"),
            ("kernel_to_floor", "GPU kernel time / floor"),
        )
        if any(r.get(key) for r in result["rows"])
    ]
    if not panels:
        return None

    def label(r):
        return f"{r['workload']} ({r['shape']})"

    names = list(dict.fromkeys(label(r) for r in result["rows"]))
    methods = [
        m
        for m in dict.fromkeys(r["method"] for r in result["rows"])
        if m not in (base, "floor")
    ]
    rows = {(label(r), r["method"]): r for r in result["rows"]}
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(7 * len(panels), 0.3 * len(names) * len(methods) + 1.5),
        sharey=True,
        squeeze=False,
    )
    height = 0.8 / max(len(methods), 1)
    for ax, (key, text) in zip(axes[0], panels):
        for j, m in enumerate(methods):
            ys, xs = [], []
            for i, n in enumerate(names):
                r = rows.get((n, m))
                if r and r.get(key):
                    ys.append(i + j * height)
                    xs.append(r[key])
            ax.barh(ys, xs, height=height, label=m)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"{text} ({result['layers']} layers; lower is faster)")
        ax.grid(True, axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_yticks(
        [i + 0.4 - height / 2 for i in range(len(names))], names, fontsize=7
    )
    axes[0][0].invert_yaxis()
    fig.suptitle(f"{result['mode']}: {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
