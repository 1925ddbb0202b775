"""tq_chunked inside a running vLLM engine: the crash, the answers, the time per step.

vLLM's offline ``LLM`` engine on the H200 machine, a model of Llama-3-8B's shape with
random weights, a TurboQuant KV cache, prefix caching and chunked prefill on, run with
the plugin off (``TQ_CHUNKED_DISABLE=1``) and on, and with a BF16 cache for reference.
Each configuration runs in a process of its own (a fresh engine, a fresh GPU); this
script is the parent, ``--child`` the engine.

Workloads (token ids from a seeded generator, new ones for every repeat so that each
repeat meets the cache in the same state):

* ``shared-prefix``: a system prompt of 8192 tokens, cached once, then 16 requests that
  each add 1024 tokens of their own: 16 prefix-cache hits in one batch.
* ``long-prompt``: one prompt of 60000 tokens, far longer than one step's 16384 tokens:
  chunked prefill, every chunk after the first a continuation over the cache (the shape
  of vLLM issue 41565's crash).
* ``mixed-46460``: four 2048-token prefixes cached, then one batch of a new 4096-token
  request (the batch's longest, its first chunk) beside four hits of 512 new tokens over
  those prefixes: the shape of vLLM issue 46460 (upstream attends the hits without their
  prefixes). The same four hits are also run alone as the reference for their answers.
* ``short-hits``: 64 prefixes of 1K-8K tokens cached, then one batch of 64 hits of 16
  new tokens each (decode-like continuations: the batch's attention is mostly reading
  the cache; the serving grid's "64 hits q16 1K-8K").
* ``hits-q200``: 32 prefixes of 1K-4K cached, then 32 hits of 200 new tokens each (the
  serving grid's "32 hits q200 1K-4K").

Measured per configuration: time to first token of each workload's batch (wall time of
``generate`` with one output token; median of the repeats after the first, which waits
for one-time work such as Triton's compilation), prefill throughput (new prompt tokens /
that time), decode time per step (shared prefix, 64 tokens, reported apart: decode is
upstream's), the KV-cache blocks the engine got, vLLM's workspace (its size, and whether
it is locked), peak GPU memory above the steady state during the workloads and what they
left allocated, the first token's top-20 logprobs of every request (the answers), the
plugin's log lines and any error. With ``--profile``, one more repeat of each
workload's batch runs under the PyTorch profiler: the GPU kernels' own time in that
batch, in all and in attention and KV-cache kernels (``ATTENTION_KERNELS``), its
largest kernels, the GPU's busy time against the batch's span (first kernel's start to
last kernel's end: the difference is time the GPU waited for the host) and the CUDA
runtime calls that wait or allocate (``RUNTIME_CALLS``). With ``--host-profile``, one
more under cProfile: the batch's Python time by area (tq_chunked, vLLM's scheduler and
KV-cache manager, its model runner, ...: ``HOST_AREAS``), for host time the GPU's span
does not show.

    python3 benchmarks/engine.py --out $OUT/engine.json            # the default grid
    python3 benchmarks/engine.py --configs off:turboquant_3bit_nc,on:turboquant_3bit_nc
    # vLLM's FA2 for a TurboQuant model's own layers, kept and undone (0.4.6's default)
    python3 benchmarks/engine.py --profile --workloads long-prompt \
        --configs bf16:auto,on-keep-fa2:turboquant_3bit_nc,on:turboquant_3bit_nc
    # vLLM 0.21-0.23's locked-workspace crash: max_num_seqs bounds the decode batches
    # vLLM warms up, and so the workspace it locks (4.09 MiB at 8 on this model)
    python3 benchmarks/engine.py --workloads shared-prefix,long-prompt \
        --configs off:turboquant_3bit_nc,on:turboquant_3bit_nc \
        --long-tokens 32768 --max-num-seqs 8

Weights: vLLM's dummy loader draws them from U(-1e-3, 1e-3), which makes every logit
almost equal and any comparison of answers vacuous; after loading they are redrawn from
N(0, 0.02) with a fixed seed (norm weights 1), the scale of a trained model's
initialisation, so that attention and the next-token distribution depend on the context.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

LLAMA3_8B = {  # Llama-3.1-8B's config.json, fewer layers (see --layers)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "vocab_size": 128256,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
PRESETS = (
    "turboquant_k8v4",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_3bit_nc",
)
TOPK = 20
BATCH_TOKENS = 16384  # vLLM's max_num_batched_tokens for the offline LLM on an H200


# ------------------------------------------------------------- child: one engine
def _tokens(rng, n):
    return rng.integers(1000, 120000, size=n).tolist()


def _answers(outputs):
    """First generated token's top-k logprobs per request: [{token_id: logprob}]."""
    res = []
    for o in outputs:
        lp = o.outputs[0].logprobs
        first = lp[0] if lp else {}
        res.append({int(t): float(v.logprob) for t, v in first.items()})
    return res


def _generate(llm, prompts, max_tokens=1):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, logprobs=TOPK, detokenize=False
    )
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, outs


def _redraw_weights(model):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
    return sum(p.numel() for p in model.parameters())


def warm_median(times):
    """The median of the repeats after the first: the first requests after a start
    wait for one-time work (Triton compiling vLLM's kernels and the plugin's among it;
    up to about 100 s on a fresh machine), which is not what a step costs."""
    return statistics.median(times[1:] or times)


def _workspace_state():
    """The size in MiB of the WorkspaceManager of vLLM in this process, and whether
    it is locked (0.21+ lock it after capturing CUDA graphs); None where none is."""
    try:
        from vllm.v1.worker import workspace as ws
    except ImportError:
        return None
    if not ws.is_workspace_manager_initialized():
        return None
    mgr = ws.current_workspace_manager()
    sizes = [mgr._workspace_size_bytes(w) for w in mgr._current_workspaces]
    return {"mib": max(sizes) / 2**20, "locked": mgr.is_locked()}


def workloads(repeats, long_tokens=60000):
    """{name: [repeat: {"warm": [prompts], "batch": [prompts], "new_tokens": n,
    "alone": [prompts] or None}]} from a seeded generator: identical in every child."""
    import numpy as np

    rng = np.random.default_rng(46460)
    system = _tokens(rng, 8192)
    out = {"shared-prefix": [], "long-prompt": [], "mixed-46460": []}
    for _ in range(repeats):
        out["shared-prefix"].append(
            {
                "warm": [system + _tokens(rng, 16)],
                "batch": [system + _tokens(rng, 1024) for _ in range(16)],
                "new_tokens": 16 * 1024,
            }
        )
        out["long-prompt"].append(
            {
                "warm": [],
                "batch": [_tokens(rng, long_tokens)],
                "new_tokens": long_tokens,
            }
        )
        prefixes = [_tokens(rng, 2048) for _ in range(4)]
        hits = [p + _tokens(rng, 512) for p in prefixes]
        out["mixed-46460"].append(
            {
                "warm": [p + _tokens(rng, 16) for p in prefixes],
                "batch": [_tokens(rng, 4096), *hits],
                "new_tokens": 4096 + 4 * 512,
                "alone": hits,
            }
        )
    # Their own generator, so that the workloads above keep the prompts of earlier runs.
    rng = np.random.default_rng(16)
    out["short-hits"], out["hits-q200"] = [], []
    for _ in range(repeats):
        for name, n, lo, hi, q in (
            ("short-hits", 64, 1024, 8192, 16),
            ("hits-q200", 32, 1024, 4096, 200),
        ):
            # prefixes of whole 16-token blocks, so that each hit finds all of it cached
            lens = 16 * rng.integers(lo // 16, hi // 16 + 1, size=n)
            prefixes = [_tokens(rng, int(m)) for m in lens]
            out[name].append(
                {
                    "warm": [p + _tokens(rng, 16) for p in prefixes],
                    "batch": [p + _tokens(rng, q) for p in prefixes],
                    "new_tokens": n * q,
                }
            )
    return out


# GPU kernels counted as attention and KV cache in --profile: FlashAttention's (FA2,
# FA3, vLLM's cache store for a BF16 cache), every kernel of this project's runtime
# (the windows' fill, rotation split and merge; the memory-bound path's rotation,
# attention and combine: tests/test_engine.py checks the list), upstream TurboQuant's
# Triton kernels (store, dequantization, decode).
ATTENTION_KERNELS = re.compile(
    r"flash|fmha|attn|attention|merge|turboquant|_tq_|tq_|dequant|decode|"
    r"reshape_and_cache|_fill_kernel|_split_kernel|_paged_kernel|_rotate_kernel|"
    r"_combine_kernel|_piece_query_kernel",
    re.IGNORECASE,
)


def kernel_summary(kernels, top=8):
    """{"total_ms", "attention_ms", "top": [[name, ms, count]]} from a profile's
    (name, total ms, count) per kernel; attention: names ``ATTENTION_KERNELS`` finds."""
    kernels = sorted(kernels, key=lambda k: -k[1])
    return {
        "total_ms": sum(k[1] for k in kernels),
        "attention_ms": sum(k[1] for k in kernels if ATTENTION_KERNELS.search(k[0])),
        "top": [[name[:120], ms, n] for name, ms, n in kernels[:top]],
    }


# CUDA runtime calls that wait for the GPU or allocate, counted in a profiled batch
# (exact names: cudaMemcpy is the synchronous copy, not cudaMemcpyAsync)
RUNTIME_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cudaMalloc",
    "cudaHostAlloc",
    "cudaFree",
)


def busy_ms(intervals):
    """(busy, span) in ms of (start us, end us) kernel intervals: the time at least one
    kernel runs, and first start to last end. span - busy is the GPU's idle time in the
    batch: where the host, not the GPU, sets the pace."""
    busy, end, first = 0.0, float("-inf"), None
    for a, b in sorted(intervals):
        first = a if first is None else first
        if a > end:
            busy += b - a
        elif b > end:
            busy += b - end
        end = max(end, b)
    return busy / 1e3, (end - first) / 1e3 if first is not None else 0.0


def _profiled(llm, prompts):
    """One batch under the PyTorch profiler: kernel_summary of its GPU kernels, the
    GPU's busy time and span, and the CUDA runtime calls of RUNTIME_CALLS by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _generate(llm, prompts)
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:  # torch before 2.4 named it for CUDA
            us = e.self_cuda_time_total
        if us > 0:
            kernels.append((e.key, us / 1e3, e.count))
    summary = kernel_summary(kernels)
    spans, calls, runtime = [], dict.fromkeys(RUNTIME_CALLS, 0), 0
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            if not getattr(e, "is_user_annotation", False):  # kernels, copies, sets
                spans.append((e.time_range.start, e.time_range.end))
        elif e.name.startswith("cuda"):
            runtime += 1
            if e.name in calls:
                calls[e.name] += 1
    summary["gpu_busy_ms"], summary["gpu_span_ms"] = busy_ms(spans)
    summary["runtime_calls"] = calls
    summary["runtime_events"] = runtime  # 0: the profiler recorded no runtime call
    return summary


# Where a profiled batch's Python time is spent, by the file its functions are in:
# the first pattern found in a function's file names its area.
HOST_AREAS = (
    ("tq_chunked", "tq_chunked"),
    ("/vllm/v1/core/", "vLLM scheduler, KV-cache manager"),
    ("/vllm/v1/worker/", "vLLM model runner"),
    ("/vllm/v1/attention/", "vLLM attention backends"),
    ("/vllm/v1/engine/", "vLLM engine"),
    ("/vllm/", "vLLM, other"),
    ("/triton/", "Triton"),
    ("/torch/", "torch (Python)"),
    ("~", "built-ins and C calls"),
)


def host_summary(stats, top=15):
    """{"total_s", "by_area": {area: s}, "top": [[function, own s, with callees s,
    calls]]} from a ``pstats.Stats``: each function's own time, summed by HOST_AREAS."""
    by_area, rows, total = {}, [], 0.0
    for (file, line, func), (_, calls, own, cum, _) in stats.stats.items():
        total += own
        area = next((a for pat, a in HOST_AREAS if pat in file), "other")
        by_area[area] = by_area.get(area, 0.0) + own
        where = func if file == "~" else f"{file.rsplit('/', 2)[-1]}:{line}({func})"
        rows.append([where[:120], own, cum, calls])
    rows.sort(key=lambda r: -r[1])
    return {
        "total_s": total,
        "by_area": dict(sorted(by_area.items(), key=lambda kv: -kv[1])),
        "top": rows[:top],
    }


def _host_profiled(llm, prompts):
    """One batch under cProfile (every Python function of the engine, which runs in
    this process): host_summary of it. cProfile slows Python code down, so the
    shares, not the seconds, are the figure."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        _generate(llm, prompts)
    finally:
        prof.disable()
    return host_summary(pstats.Stats(prof))


def child(args):
    import torch

    result = {"config": args.config, "errors": []}
    mode, kv = args.config.split("@")[0].split(":")
    if mode not in ("on", "on-fa2", "on-keep-fa2", "off", "bf16"):
        raise SystemExit(
            "--config: expected on:<preset>, on-fa2:<preset>, on-keep-fa2:<preset>, "
            f"off:<preset> or bf16:auto, got {args.config}"
        )
    model_dir = tempfile.mkdtemp(prefix="tq-engine-model-")
    cfg = dict(LLAMA3_8B, num_hidden_layers=args.layers)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    import vllm
    from vllm import LLM

    result["vllm"] = vllm.__version__
    kwargs = dict(
        model=model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        kv_cache_dtype=kv,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=BATCH_TOKENS,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=0.85,
        seed=0,
        enforce_eager=args.eager,
    )
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    result["startup_s"] = time.perf_counter() - t0
    cache = llm.llm_engine.vllm_config.cache_config
    result["num_gpu_blocks"] = cache.num_gpu_blocks
    result["block_size"] = cache.block_size
    result["cudagraphs"] = not args.eager
    result["max_num_seqs"] = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    # vLLM sets 2 for a TurboQuant cache; the plugin gives back what was asked (None)
    result["flash_attn_version"] = getattr(
        llm.llm_engine.vllm_config.attention_config, "flash_attn_version", "?"
    )
    result["workspace"] = _workspace_state()
    result["params"] = llm.apply_model(_redraw_weights)[0]
    try:
        import tq_chunked.vllm_plugin as plug

        result["plugin_patched"] = bool(plug.is_patched())
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        result["plugin_patched"] = f"{type(e).__name__}: {e}"
    # --profile, --host-profile: one more repeat of each workload each, under the
    # PyTorch profiler, then under cProfile
    wl = workloads(args.repeats + args.profile + args.host_profile, args.long_tokens)
    names = args.workloads.split(",")
    result["workloads"] = {}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for name in names:
        rec = {"ttft_s": [], "warm_s": [], "answers": [], "alone_answers": []}
        result["workloads"][name] = rec
        try:
            for rep in wl[name][: args.repeats]:
                if rep["warm"]:
                    rec["warm_s"].append(_generate(llm, rep["warm"])[0])
                dt, outs = _generate(llm, rep["batch"])
                rec["ttft_s"].append(dt)
                rec["answers"].append(_answers(outs))
                if rep.get("alone"):
                    # The batch cached the hits' new tokens (wrong ones, where the bug
                    # dropped their prefixes): forget them, cache the prefixes again and
                    # run the hits alone.
                    llm.reset_prefix_cache()
                    _generate(llm, rep["warm"])
                    _, outs = _generate(llm, rep["alone"])
                    rec["alone_answers"].append(_answers(outs))
            rec["ttft_median_s"] = warm_median(rec["ttft_s"])
            rec["prefill_tok_s"] = wl[name][0]["new_tokens"] / rec["ttft_median_s"]
            if name == "shared-prefix":
                rep = wl[name][-1]
                new = [p[:-1024] + p[-1024:][::-1] for p in rep["batch"]]
                dt, _ = _generate(llm, new, max_tokens=65)
                rec["decode_ms_per_step"] = 1e3 * (dt - rec["ttft_median_s"]) / 64
            extra = iter(wl[name][args.repeats :])
            for on, key, run in (
                (args.profile, "profile", _profiled),
                (args.host_profile, "host_profile", _host_profiled),
            ):
                if not on:
                    continue
                rep = next(extra)
                if rep["warm"]:
                    _generate(llm, rep["warm"])
                try:
                    rec[key] = run(llm, rep["batch"])
                except Exception as e:  # noqa: BLE001 - reported beside the times
                    rec[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(
                f"[{args.config}] {name}: ttft {rec['ttft_median_s'] * 1e3:.1f} ms",
                flush=True,
            )
        except Exception as e:  # the crash is a result: record it, stop this engine
            rec["error"] = f"{type(e).__name__}: {e}"
            rec["traceback"] = traceback.format_exc()[-4000:]
            result["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:500]}")
            print(f"[{args.config}] {name}: {type(e).__name__}: {e}", flush=True)
            break
    torch.cuda.synchronize()
    result["workspace_after"] = _workspace_state()
    result["peak_above_steady_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    # what the workloads left allocated (vLLM 0.20's per-layer continuation buffers)
    result["held_after_mib"] = (torch.cuda.memory_allocated() - base) / 2**20
    result["steady_mib"] = base / 2**20
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------ parent: the grid
def _compare(a, b):
    """Top-1 agreement and max |logprob difference| over the tokens in both top-k sets,
    per request, between two answer lists."""
    top1, dmax = [], []
    for x, y in zip(a, b):
        if not x or not y:
            continue
        top1.append(max(x, key=x.get) == max(y, key=y.get))
        common = set(x) & set(y)
        dmax.append(max(abs(x[t] - y[t]) for t in common) if common else float("inf"))
    if not top1:
        return None
    return {
        "requests": len(top1),
        "top1_agree": sum(top1) / len(top1),
        "max_abs_dlogprob_median": statistics.median(dmax),
        "max_abs_dlogprob_max": max(dmax),
    }


def _flat(rec, key="answers"):
    return [r for rep in rec.get(key, []) for r in rep]


def agreement(results):
    """Answers of every configuration against the others on the same prompts, and the
    46460 hits against the same hits run alone (the bug's signature)."""
    out = {}
    by = {r["config"]: r for r in results if "workloads" in r}
    names = sorted({n for r in by.values() for n in r["workloads"]})
    for n in names:
        for i, ca in enumerate(by):
            for cb in list(by)[i + 1 :]:
                ra, rb = by[ca]["workloads"].get(n, {}), by[cb]["workloads"].get(n, {})
                c = _compare(_flat(ra), _flat(rb))
                if c:
                    out[f"{n}: {ca} vs {cb}"] = c
        for c, r in by.items():
            rec = r["workloads"].get(n, {})
            if rec.get("alone_answers"):
                hits = [rep[1:] for rep in rec["answers"]]
                cmp = _compare(
                    [h for rep in hits for h in rep], _flat(rec, "alone_answers")
                )
                if cmp:
                    out[f"{n}: {c} hits in the batch vs alone"] = cmp
    return out


def parent(args):
    configs = args.configs.split(",")
    results = []
    env_base = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",
        VLLM_USE_FLASHINFER_SAMPLER="0",  # FlashInfer is not carried; greedy sampling
        VLLM_USE_DEEP_GEMM="0",  # nor DeepGEMM (FP8 GEMMs; this model is bf16)
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",  # the model is a local config.json; nothing is fetched
        TRANSFORMERS_OFFLINE="1",
    )
    env_base.setdefault("VLLM_CACHE_ROOT", "/tmp/tq-engine/vllm-cache")
    print(
        f"{'config':34s} {'start s':>7s} {'blocks':>7s} "
        + " ".join(f"{w[:13]:>13s}" for w in args.workloads.split(",")),
        flush=True,
    )
    for cfg in configs:
        env = dict(env_base)
        env.pop("TQ_CHUNKED_FA_VERSION", None)
        if cfg.startswith("off:"):
            env["TQ_CHUNKED_DISABLE"] = "1"
        else:
            env.pop("TQ_CHUNKED_DISABLE", None)
        env.pop("TQ_CHUNKED_KEEP_FA2", None)
        if cfg.startswith("on-fa2:"):  # windows on FA2, vLLM's pick for TurboQuant
            env["TQ_CHUNKED_FA_VERSION"] = "2"
        if cfg.startswith("on-keep-fa2:"):  # vLLM's own layers kept on FA2 (0.4.5)
            env["TQ_CHUNKED_KEEP_FA2"] = "1"
        # on:<preset>@<workload>[+<workload>]: that configuration on those workloads
        only = cfg.split("@")[1].replace("+", ",") if "@" in cfg else args.workloads
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "--config",
            cfg,
            "--layers",
            str(args.layers),
            "--repeats",
            str(args.repeats),
            "--max-model-len",
            str(args.max_model_len),
            "--long-tokens",
            str(args.long_tokens),
            "--workloads",
            only,
            "--max-num-seqs",
            str(args.max_num_seqs),
        ]
        if args.eager:
            cmd.append("--eager")
        if args.profile:
            cmd.append("--profile")
        if args.host_profile:
            cmd.append("--host-profile")
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
            log = p.stdout + p.stderr
            rc = p.returncode
        except subprocess.TimeoutExpired as e:
            log = (e.stdout or "") + (e.stderr or "")
            log = log.decode() if isinstance(log, bytes) else log
            rc = "timeout"
        lines = log.splitlines()
        res = next((json.loads(x[7:]) for x in lines if x.startswith("RESULT ")), None)
        lines = [x for x in lines if not x.startswith("RESULT ")]
        if res is None:
            res = {"config": cfg, "errors": [f"engine did not finish (rc {rc})"]}
        res["rc"] = rc
        res["wall_s"] = time.perf_counter() - t0
        res["plugin_log"] = [x[-600:] for x in lines if "tq_chunked" in x][:20]
        errs = [x for x in lines if "Error" in x or "error" in x]
        res["log_errors"] = [x[-300:] for x in errs[-15:]]
        res["log_tail"] = [x[-300:] for x in lines[-40:]]
        results.append(res)
        cells = []
        for w in args.workloads.split(","):
            rec = res.get("workloads", {}).get(w, {})
            cells.append(
                "crash"
                if "error" in rec
                else f"{rec['ttft_median_s'] * 1e3:9.1f} ms"
                if "ttft_median_s" in rec
                else "-"
            )
        print(
            f"{cfg:34s} {res.get('startup_s', float('nan')):7.1f} "
            f"{res.get('num_gpu_blocks', '-')!s:>7s} "
            + " ".join(f"{c:>13s}" for c in cells),
            flush=True,
        )
        for e in res["errors"]:
            print(f"    error: {e[:300]}", flush=True)
        for w, rec in res.get("workloads", {}).items():
            prof = rec.get("profile", {})
            if "total_ms" in prof:
                print(
                    f"    {w}: GPU kernels {prof['total_ms']:.1f} ms, attention + "
                    f"KV cache {prof['attention_ms']:.1f} ms",
                    flush=True,
                )
            elif prof:
                print(f"    {w}: profile {prof['error'][:200]}", flush=True)
            host = rec.get("host_profile", {})
            if host:
                print(f"    {w}: host {_host_cell(host)}", flush=True)
        with open(
            args.out, "w"
        ) as f:  # after every configuration: a timeout keeps the rest
            json.dump(
                {"results": results, "agreement": agreement(results)}, f, indent=1
            )
    agr = agreement(results)
    with open(args.out, "w") as f:
        json.dump(
            {"args": vars(args), "results": results, "agreement": agr}, f, indent=1
        )
    print(
        "\nagreement (first token's top-20 logprobs; top-1 agreement, "
        "max |dlogprob| median/max)"
    )
    for k, v in agr.items():
        print(
            f"  {k:70s} {v['top1_agree']:5.2f} {v['max_abs_dlogprob_median']:.3g}/"
            f"{v['max_abs_dlogprob_max']:.3g} (n={v['requests']})"
        )


def _workspace_cell(ws) -> str:
    if not ws:
        return "-"
    return f"{ws['mib']:.1f}" + (" (locked)" if ws.get("locked") else "")


def _ttft(r, w):
    rec = r.get("workloads", {}).get(w, {})
    if "error" in rec or not rec.get("ttft_s"):
        return None
    return warm_median(rec["ttft_s"])


def _ratio_rows(res, names):
    """TTFT of each configuration over the BF16 cache's, where one ran."""
    bf16 = next((r for r in res if r["config"].startswith("bf16")), None)
    if bf16 is None:
        return []
    rows = ["", "| TTFT / BF16 cache's | " + " | ".join(names) + " |"]
    rows.append("|" + "---|" * (len(names) + 1))
    for r in res:
        if r is bf16:
            continue
        cells = []
        for w in names:
            a, b = _ttft(r, w), _ttft(bf16, w)
            cells.append(f"{a / b:.2f}" if a and b else "-")
        rows.append(f"| {r['config']} | " + " | ".join(cells) + " |")
    return rows


def _per_batch(res, names, key):
    """(configuration, workload, record[key]) for each batch whose record has one."""
    return [
        (r["config"], w, rec[key])
        for r in res
        for w in names
        if (rec := r.get("workloads", {}).get(w, {})).get(key)
    ]


def _profile_rows(res, names):
    """--profile: each batch's GPU kernel time, and its largest kernels."""
    found = _per_batch(res, names, "profile")
    if not found:
        return []
    rows = [
        "",
        (
            "| configuration | workload | GPU kernels ms (one batch, profiler) "
            "| attention + KV cache ms | GPU busy / span ms | syncs, "
            "allocations | largest kernels (ms) |"
        ),
        "|---|---|---|---|---|---|---|",
    ]
    for config, w, prof in found:
        if "error" in prof:
            rows.append(f"| {config} | {w} | - | - | - | - | {prof['error'][:120]} |")
            continue
        top = "; ".join(f"{n[:48]} {ms:.1f}" for n, ms, _ in prof["top"][:4])
        busy = (
            f"{prof['gpu_busy_ms']:.1f} / {prof['gpu_span_ms']:.1f}"
            if "gpu_busy_ms" in prof
            else "-"
        )
        calls = prof.get("runtime_calls", {})
        # files before runtime_events: cudaLaunchKernel was the witness
        recorded = prof.get("runtime_events", calls.get("cudaLaunchKernel"))
        waits = (
            ", ".join(
                f"{n} {c}" for n, c in calls.items() if c and n != "cudaLaunchKernel"
            )
            or "none"
            if recorded
            else "not recorded"
        )
        rows.append(
            f"| {config} | {w} | {prof['total_ms']:.1f} "
            f"| {prof['attention_ms']:.1f} | {busy} | {waits} | {top} |"
        )
    return rows


def _host_cell(host) -> str:
    """A host_summary in one line: total, then each area's share (over 3 %)."""
    if "error" in host:
        return host["error"][:120]
    total = host["total_s"] or 1.0
    shares = ", ".join(
        f"{a} {s / total:.0%}" for a, s in host["by_area"].items() if s / total > 0.03
    )
    return f"{host['total_s'] * 1e3:.0f} ms under cProfile: {shares}"


def _host_rows(res, names):
    """--host-profile: each batch's Python time by area."""
    found = _per_batch(res, names, "host_profile")
    if not found:
        return []
    return [
        "",
        (
            "| configuration | workload | Python time of one batch, by area "
            "(cProfile; shares, not seconds, are the figure) |"
        ),
        "|---|---|---|",
    ] + [f"| {config} | {w} | {_host_cell(host)} |" for config, w, host in found]


def markdown(data) -> str:
    """The results of one run as Markdown: a row per configuration, then the answers."""
    res = data["results"]
    names = list(dict.fromkeys(w for r in res for w in r.get("workloads", {})))
    head = ["vLLM", "configuration", "CUDA graphs", "max_num_seqs", "workspace MiB"]
    head += ["KV blocks"] + [f"{w} TTFT ms (tok/s)" for w in names]
    head += ["decode ms/step", "peak above steady MiB", "held after MiB", "error"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res:
        cells = [
            str(r.get("vllm", "?")),
            r["config"],
            {True: "yes", False: "no"}.get(r.get("cudagraphs"), "?"),
            str(r.get("max_num_seqs", "-")),
            _workspace_cell(r.get("workspace")),
            str(r.get("num_gpu_blocks", "-")),
        ]
        decode = "-"
        for w in names:
            rec = r.get("workloads", {}).get(w)
            if rec is None:
                cells.append("-")
            elif "error" in rec:
                cells.append("crashed")
            else:
                t = _ttft(r, w)
                n = rec["prefill_tok_s"] * rec["ttft_median_s"]  # new tokens
                cells.append(f"{t * 1e3:.1f} ({n / t:.0f})")
                if "decode_ms_per_step" in rec:
                    # decode = (time of 65 tokens - TTFT) / 64, with the TTFT above
                    # (files written before warm_median used every repeat's median)
                    shift = (rec["ttft_median_s"] - t) * 1e3 / 64
                    decode = f"{rec['decode_ms_per_step'] + shift:.1f}"
        peak = r.get("peak_above_steady_mib")
        err = "; ".join(e[:160] for e in r.get("errors", [])) or "-"
        held = r.get("held_after_mib")
        cells += [decode, f"{peak:.0f}" if peak is not None else "-"]
        cells += [f"{held:.0f}" if held is not None else "-", err]
        rows.append("| " + " | ".join(cells) + " |")
    rows += _ratio_rows(res, names) + _profile_rows(res, names)
    rows += _host_rows(res, names)
    rows += [
        "",
        (
            "| answers compared (first token, top-20 logprobs) | requests "
            "| top-1 agree | max abs dlogprob: median | max |"
        ),
        "|---|---|---|---|---|",
    ]
    for k, v in data.get("agreement", {}).items():
        rows.append(
            f"| {k} | {v['requests']} | {v['top1_agree']:.2f} "
            f"| {v['max_abs_dlogprob_median']:.3f} | {v['max_abs_dlogprob_max']:.3f} |"
        )
    return "\n".join(rows) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--configs",
        default=",".join(
            [
                f"{m}:{p}"
                for p in ("turboquant_3bit_nc", "turboquant_k8v4")
                for m in ("off", "on")
            ]
            + ["bf16:auto"]
        ),
        help="comma-separated on:<preset>, off:<preset>, bf16:auto; on-fa2:<preset> is "
        "the plugin with its windows on FlashAttention 2 (TQ_CHUNKED_FA_VERSION=2); "
        "on-keep-fa2:<preset> the plugin with vLLM's FA2 setting for a TurboQuant "
        "model's own layers kept (TQ_CHUNKED_KEEP_FA2=1, as 0.4.5 ran); the other "
        "configurations run without those two variables, whatever this shell exports",
    )
    ap.add_argument("--workloads", default="mixed-46460,shared-prefix,long-prompt")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--long-tokens", type=int, default=60000, help="long-prompt length")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=0,
        help="the engine's max_num_seqs (0: vLLM's default); it bounds the decode "
        "batches vLLM warms up, and so the workspace vLLM 0.21-0.23 lock",
    )
    ap.add_argument(
        "--eager",
        action="store_true",
        help="enforce_eager (no CUDA graphs, no compile)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="one more repeat of each workload's batch under the PyTorch profiler: "
        "its GPU kernel time, in all and in attention and KV-cache kernels",
    )
    ap.add_argument(
        "--host-profile",
        action="store_true",
        help="one more repeat of each workload's batch under cProfile: its Python "
        "time by area (tq_chunked, vLLM's scheduler, model runner, ...) and its "
        "largest functions",
    )
    ap.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per configuration"
    )
    ap.add_argument("--out", default="engine.json")
    ap.add_argument(
        "--render", metavar="JSON", help="print a results file as Markdown and exit"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            print(markdown(json.load(f)), end="")
    elif args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
