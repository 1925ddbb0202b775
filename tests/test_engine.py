"""The plugin inside a running vLLM engine (the H200 machine, ``-m gpu``).

The engine test is marked gpu; the workload generator's check runs everywhere.

Starts vLLM's offline engine three times through ``benchmarks/engine.py`` (a 6-layer
model of Llama-3-8B's shape with random weights, ``turboquant_3bit_nc``, prefix caching
on, no CUDA graphs to keep it short): plugin on, plugin off, and a BF16 cache; each runs
16 prefix-cache hits of 1024 tokens over a cached 8192-token system prompt. The plugin's
answers must match plugin off's to the resolution of the model's bf16 logits: one step
of a logprob, far below what a dropped prefix (vLLM issue 46460) does to an answer.
Where plugin off crashes (vLLM 0.21-0.23's locked workspace) the plugin must still
answer.

Skipped where no engine can start: no GPU, or a vLLM without its engine's dependencies
(benchmarks/engine_setup.sh puts a complete one on PYTHONPATH on the H200 machine).
"""

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ENGINE = Path(__file__).resolve().parents[1] / "benchmarks" / "engine.py"
OLD_WORKLOADS_SHA256 = (
    "6f79a746d08da526d39cde14061b279f6b60799a57aa5eda94bf12f6c0ab6ef4"
)
MAX_DLOGPROB = 0.07  # about one bf16 step of a logprob near -10; see the test


def _engine_importable() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm.entrypoints.llm"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"vLLM's engine cannot be imported here: {last}"
    return None


def _load_benchmark(name="engine"):
    """benchmarks/<name>.py as a module (benchmarks/ is not a package)."""
    path = ENGINE.parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"tq_{name}_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.gpu
def test_prefix_hit_in_engine_matches_plugin_off(tmp_path):
    reason = _engine_importable()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "engine.json"
    configs = "on:turboquant_3bit_nc,off:turboquant_3bit_nc,bf16:auto"
    cmd = [
        sys.executable,
        str(ENGINE),
        "--configs",
        configs,
        "--workloads",
        "shared-prefix",
        "--layers",
        "6",
        "--repeats",
        "1",
        "--max-model-len",
        "16384",
        "--eager",
        "--timeout",
        "240",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(out.read_text())
    by = {r["config"]: r for r in data["results"]}
    on = by["on:turboquant_3bit_nc"]
    assert not on["errors"], on["errors"]
    assert on["plugin_patched"] is True, on["plugin_log"]
    assert any("tq_chunked" in line for line in on["plugin_log"]), on["log_tail"]
    agr = data["agreement"]
    quant = agr["shared-prefix: on:turboquant_3bit_nc vs bf16:auto"]
    off = by["off:turboquant_3bit_nc"]
    if off["errors"]:
        assert any("Workspace is locked" in e for e in off["errors"]), off["errors"]
        assert quant["requests"] == 16
        return
    same = agr["shared-prefix: on:turboquant_3bit_nc vs off:turboquant_3bit_nc"]
    assert same["requests"] == 16
    # Logits come out of the model in bf16, so a logprob moves in steps of 1/32-1/16
    # at these magnitudes: two exact computations differ by a step at most. Measured on
    # the H200 (vLLM 0.21.0, this shape): max 0.031, top-1 16/16. In the 16-layer
    # benchmark the 46460 bug moved its victims' logprobs by 0.59 (median), 1.0 at most.
    assert same["max_abs_dlogprob_max"] <= MAX_DLOGPROB, same
    assert same["top1_agree"] >= 15 / 16, same


def test_engine_counts_every_runtime_kernel_as_attention():
    """The profile's attention share names each Triton kernel the runtime launches,
    and not the model's own GEMMs and elementwise kernels."""
    import importlib
    import pkgutil

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import tq_chunked.runtime as runtime

    mod = _load_benchmark()
    kernels = [
        name
        for info in pkgutil.iter_modules(runtime.__path__)
        for name, f in vars(
            importlib.import_module(f"tq_chunked.runtime.{info.name}")
        ).items()
        if isinstance(f, (JITFunction, InterpretedFunction))
        and name.endswith("_kernel")
    ]
    assert "_paged_kernel" in kernels and "_fill_kernel" in kernels, kernels
    missed = [k for k in kernels if not mod.ATTENTION_KERNELS.search(k)]
    assert not missed, missed
    others = [  # from the engine runs' profiles (benchmarks/results/*-engine-*.md)
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT",
        "triton_poi_fused_mul_silu_slice_1",
        "triton_red_fused_fused_add_rms_norm_2",
    ]
    assert not [k for k in others if mod.ATTENTION_KERNELS.search(k)]


def test_engine_workloads_are_reproducible():
    """The prompts every engine sees come from one seeded generator (CPU, no engine)."""
    pytest.importorskip("numpy")
    mod = _load_benchmark()
    a, b = mod.workloads(2), mod.workloads(2)
    assert a == b
    assert [len(p) for p in a["mixed-46460"][0]["batch"]] == [4096] + [2560] * 4


def test_engine_new_workloads_hit_whole_blocks():
    """short-hits and hits-q200: every prefix is whole 16-token blocks (so the hit finds
    all of it cached), the batch adds the stated new tokens, and adding them left the
    older workloads' prompts as they were (their own generator)."""
    pytest.importorskip("numpy")
    mod = _load_benchmark()
    wl = mod.workloads(2)
    for name, n, lo, hi, q in (
        ("short-hits", 64, 1024, 8192, 16),
        ("hits-q200", 32, 1024, 4096, 200),
    ):
        for rep in wl[name]:
            assert len(rep["batch"]) == len(rep["warm"]) == n
            assert rep["new_tokens"] == n * q
            for warm, hit in zip(rep["warm"], rep["batch"]):
                prefix = len(hit) - q
                assert prefix % 16 == 0 and lo <= prefix <= hi
                assert hit[:prefix] == warm[:prefix] and len(warm) == prefix + 16
    # a repeat more (--profile) leaves the first ones unchanged
    assert mod.workloads(3)["short-hits"][:2] == wl["short-hits"]
    assert mod.workloads(3)["shared-prefix"][:2] == wl["shared-prefix"]
    # the older workloads' prompts are those of the 2026-12-01 runs (engine.py at
    # 978a956 gives this digest for workloads(2))
    old = {k: wl[k] for k in sorted(("shared-prefix", "long-prompt", "mixed-46460"))}
    digest = hashlib.sha256(json.dumps(old, sort_keys=True).encode()).hexdigest()
    assert digest == OLD_WORKLOADS_SHA256


@pytest.mark.parametrize(
    "name, attention",
    [
        ("void flash::FlashAttnFwdSm90<...>", True),  # FA3
        ("flash_fwd_splitkv_kernel", True),  # FA2
        ("_fill_kernel", True),  # this project's fill
        ("_merge_kernel", True),
        ("_tq_full_dequant_kv", True),  # upstream TurboQuant
        ("void vllm::reshape_and_cache_flash_kernel<...>", True),  # BF16 cache store
        ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", False),  # a GEMM
        ("void vllm::rms_norm_kernel<c10::BFloat16>", False),
        ("void vllm::act_and_mul_kernel<...>", False),
    ],
)
def test_kernel_summary_counts_attention_by_name(name, attention):
    mod = _load_benchmark()
    s = mod.kernel_summary([(name, 2.0, 3), ("other_gemm", 5.0, 1)])
    assert s["total_ms"] == 7.0
    assert s["attention_ms"] == (2.0 if attention else 0.0)
    assert s["top"][0] == ["other_gemm", 5.0, 1]


@pytest.mark.parametrize(
    "intervals, busy, span",
    [
        ([], 0.0, 0.0),
        ([(0, 1000)], 1.0, 1.0),
        ([(0, 1000), (3000, 4000)], 2.0, 4.0),  # a 2 ms gap: the GPU waits
        ([(0, 2000), (500, 1500), (1000, 3000)], 3.0, 3.0),  # overlapping streams
        ([(3000, 4000), (0, 1000), (900, 1200)], 2.2, 4.0),  # any order
    ],
)
def test_busy_ms_is_the_union_of_kernel_intervals(intervals, busy, span):
    mod = _load_benchmark()
    got = mod.busy_ms(intervals)
    assert got == pytest.approx((busy, span))


@pytest.mark.parametrize(
    "requests, shape, blocks",
    [
        # one window: 8 kv heads x ceil(512 x 4 / 128) query tiles
        ([(8192, 512)], "llama3-8b", [128]),
        # 70b-tp8: 1 kv head, a group of 8: ceil(128 x 8 / 128) = 8 tiles a request
        ([(1024, 128)] * 3, "70b-tp8", [24]),
        # a first chunk and a hit share a window: tiles per sequence, not per row
        ([(0, 100), (2048, 30)], "llama3-8b", [8 * (4 + 1)]),
    ],
)
def test_occupancy_counts_query_tiles_per_kv_head(requests, shape, blocks):
    from tq_chunked.tools.testing import Workload

    mod = _load_benchmark("occupancy")
    assert mod.call_blocks(Workload("w", shape, requests)) == blocks


def test_occupancy_finds_the_decode_like_batches_below_one_block_per_sm():
    """benchmarks/NOTES.md §31: every attention call of the serving grid's two
    decode-like batches runs fewer blocks than the H200 has SMs."""
    mod = _load_benchmark("occupancy")
    grid = {(w.name, w.shape): w for w in mod.serving_workloads()}
    short = mod.call_blocks(grid[("64 hits q16 1K-8K", "llama3-8b")])
    mid = mod.call_blocks(grid[("8 hits q64-128 4K-32K", "llama3-8b")])
    assert len(short) == 11 and max(short) < 132
    assert len(mid) == 5 and max(mid) < 132


def test_host_summary_sums_each_functions_own_time_by_area():
    """A real cProfile of this project's plan (tq_chunked) beside a built-in: the
    areas' times add up to the total, and tq_chunked's own functions are found."""
    import cProfile
    import pstats

    from tq_chunked.runtime.plan import windows

    mod = _load_benchmark()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(20):
        windows((0, 16, 48), (1000 + i, 2000 + i), 4096, torch.device("cpu"))
    sorted(range(10000), key=lambda x: -x)
    prof.disable()
    s = mod.host_summary(pstats.Stats(prof), top=5)
    assert s["total_s"] > 0
    assert sum(s["by_area"].values()) == pytest.approx(s["total_s"])
    assert s["by_area"].get("tq_chunked", 0) > 0
    assert len(s["top"]) == 5
    assert [r[1] for r in s["top"]] == sorted((r[1] for r in s["top"]), reverse=True)
    cell = mod._host_cell(s)
    assert cell.startswith(f"{s['total_s'] * 1e3:.0f} ms under cProfile: ")
