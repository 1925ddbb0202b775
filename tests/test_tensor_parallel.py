"""Tensor parallelism on the CPU: tq_chunked in each worker of a TP engine, with the
worker's share of the heads.

With tensor parallelism each vLLM worker holds Hq/TP query heads and Hk/TP kv heads.
What a CPU can show of that (the two-GPU engine run has not happened):

* the plugin's registration path as a vLLM worker runs it. An engine front end (a
  fresh process, this file run as a script: ``_front_end``) builds the engine config
  with vLLM's ``EngineArgs.create_engine_config`` (which loads vLLM's plugins there:
  the FlashAttention-version change happens in that process), then starts one worker
  per TP rank as vLLM's ``MultiprocExecutor`` does: ``get_mp_context()`` with
  ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` (the method vLLM forces once CUDA is
  initialized), a ``Process`` named ``VllmWorker-<rank>`` given the pickled
  ``VllmConfig``. Each worker (``_worker``) is a fresh interpreter whose vLLM is
  unpatched until vLLM's ``WorkerWrapperBase.init_worker`` (what ``WorkerProc``
  calls first) runs ``load_general_plugins()``; then vLLM's
  ``init_worker_distributed_environment`` joins the ranks into a real TP group (gloo);
* the per-worker reservation. In each worker, vLLM's own ``LlamaAttention`` (the model
  code, which divides the heads by the TP group's size) is built for Llama-3-8B's
  shape (32 query heads, 8 kv heads, head size 128; a config.json, no download, dummy
  weights never loaded), its attention layer gives the KV-cache spec, and vLLM's
  ``TurboQuantMetadataBuilder`` is created from it, as the model runner does: the
  plugin's hook sees ``builder_shape`` and sizes its reservation (and its log line) by
  ``builder_workspace_bytes`` (reserved in vLLM's WorkspaceManager where the release
  has one; 0.20.x has none, and its shared buffer grows to what a step needs).

What a CPU cannot give is stood in for, and only that: vLLM's platform is its
``CpuPlatform`` (detection finds none here without a GPU); the workers run vLLM's GPU
worker class (``vllm.v1.worker.gpu_worker.Worker``, what a CUDA engine names; the CPU
worker needs compiled ``_C`` ops this install lacks), constructed by ``init_worker``
and never asked to ``init_device``; and the CPU platform picks its own attention
backend for every layer (0.34 refuses a TurboQuant cache there), so its choice is
replaced by the backend a CUDA platform selects for TurboQuant, from which vLLM's
``Attention`` builds ``TurboQuantAttentionImpl`` itself. From 0.34 a worker first
applies the engine's logging configuration, as ``WorkerProc.worker_main`` does. Run
from an environment without vLLM, this file re-runs itself inside each ``.vllm-envs/``
install, as tests/test_vllm_plugin.py does.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest

from tq_chunked.tools.vllm_harness import cpu_test_env, vllm_envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENVS = list(vllm_envs(ROOT).values())
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed in this environment"
)

# Llama-3-8B's attention shape; the rest is what vLLM's config and model code read.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128256,
    "num_hidden_layers": 32,
    "torch_dtype": "bfloat16",
}
MAX_TOKENS = 8192  # max_num_batched_tokens of the engine
BLOCK_SIZE = 16
# A layer TurboQuant quantizes: it leaves the first two and the last two as they are.
LAYER = "model.layers.2.self_attn"
SEED = 0
FRONT_END_TIMEOUT = 600
RESULT = "TP_RESULT "  # the front end's line of results


# --- from an environment without vLLM: run this file in each vLLM environment ---------


@pytest.mark.skipif(
    HAS_VLLM, reason="this environment has vLLM: its tests run directly"
)
@pytest.mark.parametrize(
    "python", ENVS or [None], ids=lambda p: p and p.split(os.sep)[-3]
)
def test_tensor_parallel_in_each_vllm_install(python):
    """This file's tests pass inside each real vLLM install (``.vllm-envs/``)."""
    if python is None:
        pytest.skip(
            "no .vllm-envs/: run tests/install_vllm_cpu.sh to test against real vLLM"
        )
    r = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-p", "no:randomly", os.path.abspath(__file__)],
        cwd=ROOT,
        env=cpu_test_env(ROOT),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0, f"tensor-parallel tests failed under {python}"


# --- the worker process and the engine front end (run as a script) --------------------


class _Records(logging.Handler):
    """The lines tq_chunked logs through vLLM's logger in this process."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        if record.name.startswith("vllm.tq_chunked"):
            self.lines.append(record.getMessage())


def _cpu_platform():
    """VLLM's CpuPlatform: without a GPU, vLLM detects no platform here."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()


def _worker(rank, config, init_method, lock, results):
    """A TP worker of vLLM, from its start as a spawned process to its metadata
    builder; puts what it saw on ``results``."""
    _cpu_platform()
    import torch
    import vllm.v1.attention.backends.turboquant_attn as tqa

    from tq_chunked.runtime.vllm_backend import (
        builder_shape,
        builder_workspace_bytes,
        window_from_env,
    )
    from tq_chunked.vllm_plugin import is_patched

    # What WorkerProc.worker_main does first from 0.34 on: the engine's logging
    # configuration applied in the worker (before it, vLLM's loggers are at WARNING)
    logging_config = getattr(config, "logging_config", None)
    if logging_config is not None:
        from vllm.logger import configure_logging

        configure_logging(logging_config)
    records = _Records()
    logging.getLogger("vllm").addHandler(records)
    patched_at_start = is_patched(tqa)

    # What WorkerProc.__init__ does first: the wrapper loads vLLM's general plugins.
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    world = config.parallel_config.world_size
    kwargs = [{} for _ in range(world)]
    kwargs[rank] = dict(
        vllm_config=config,
        local_rank=rank,
        rank=rank,
        distributed_init_method=init_method,
        is_driver_worker=rank == 0,
        shared_worker_lock=lock,
    )
    WorkerWrapperBase(rpc_rank=rank, global_rank=rank).init_worker(kwargs)
    patched_by_vllm = is_patched(tqa)

    # The TP group, as the worker's init_device makes it (gloo: the CPU's backend).
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from vllm.model_executor.models.llama import LlamaAttention
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    torch.manual_seed(SEED)
    hf = config.model_config.hf_config
    try:
        with set_current_vllm_config(config):
            init_worker_distributed_environment(config, rank, init_method, rank, "gloo")
            torch.set_default_dtype(config.model_config.dtype)
            # The backend a CUDA platform selects for a TurboQuant cache: the CPU
            # platform picks its own (0.34 refuses TurboQuant there), so vLLM's
            # Attention builds TurboQuant's impl from the layer's own heads.
            current_platform.get_attn_backend_cls = lambda *args, **kwargs: (
                AttentionBackendEnum.TURBOQUANT.get_path()
            )
            # vLLM's model code: heads divided by the TP group's size.
            attn = LlamaAttention(
                config=hf,
                hidden_size=hf.hidden_size,
                num_heads=hf.num_attention_heads,
                num_kv_heads=hf.num_key_value_heads,
                max_position_embeddings=hf.max_position_embeddings,
                cache_config=config.cache_config,
                prefix=LAYER,
            ).attn
            assert isinstance(attn.impl, tqa.TurboQuantAttentionImpl), type(attn.impl)
            spec = attn.get_kv_cache_spec(config)
            builder = tqa.TurboQuantMetadataBuilder(
                spec, [attn.layer_name], config, torch.device("cpu")
            )
        # The window the plugin read when vLLM loaded it (None: the default).
        window, nbytes = builder_workspace_bytes(builder, window_from_env())
        shape = builder_shape(builder)
        results.put(
            dict(
                rank=rank,
                pid=os.getpid(),
                tp_rank=get_tensor_model_parallel_rank(),
                tp_size=get_tensor_model_parallel_world_size(),
                patched_at_start=patched_at_start,
                patched_by_vllm=patched_by_vllm,
                layer_heads=[attn.num_heads, attn.num_kv_heads],
                kv_cache_dtype=attn.kv_cache_dtype,
                spec=type(spec).__name__,
                num_q_heads=shape["num_q_heads"],
                num_kv_heads=shape["num_kv_heads"],
                head_dim=shape["head_dim"],
                block_size=shape["block_size"],
                dtype=str(shape["dtype"]),
                max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                window=window,
                workspace_bytes=nbytes,
                logged=records.lines,
            )
        )
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()


def _front_end(model_dir: str, tp: int) -> None:
    """The engine front end: the config, then one spawned worker per TP rank, as vLLM's
    MultiprocExecutor starts them; prints the workers' results (RESULT)."""
    import time

    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    _cpu_platform()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.network_utils import (
        get_distributed_init_method,
        get_loopback_ip,
        get_open_port,
    )
    from vllm.utils.system_utils import get_mp_context

    config = EngineArgs(
        model=model_dir,
        kv_cache_dtype="turboquant_3bit_nc",
        load_format="dummy",
        skip_tokenizer_init=True,
        tensor_parallel_size=tp,
        max_num_batched_tokens=MAX_TOKENS,
        block_size=BLOCK_SIZE,
    ).create_engine_config()
    # The worker class a CUDA engine names (the CPU worker needs compiled _C ops).
    config.parallel_config.worker_cls = "vllm.v1.worker.gpu_worker.Worker"
    context = get_mp_context()
    assert context.get_start_method() == "spawn", context.get_start_method()
    results, lock = context.Queue(), context.Lock()
    init_method = get_distributed_init_method(get_loopback_ip(), get_open_port())
    workers = [
        context.Process(
            target=_worker,
            args=(rank, config, init_method, lock, results),
            name=f"VllmWorker-{rank}",
            daemon=True,
        )
        for rank in range(config.parallel_config.world_size)
    ]
    for w in workers:
        w.start()
    got, deadline = [], time.monotonic() + FRONT_END_TIMEOUT - 60
    while len(got) < len(workers) and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=2))
        except Exception:  # queue.Empty: a worker that died puts nothing
            if not any(w.is_alive() for w in workers) and results.empty():
                break
    for w in workers:
        w.join(60)
    print(
        RESULT
        + json.dumps(
            dict(
                workers=sorted(got, key=lambda r: r["rank"]),
                exitcodes=[w.exitcode for w in workers],
                front_end_pid=os.getpid(),
            )
        ),
        flush=True,
    )


# --- inside a vLLM environment --------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3-8b-shape")
    (path / "config.json").write_text(json.dumps(LLAMA3_8B))
    return str(path)


@functools.cache
def _engine(model_dir: str, tp: int, window: int | None) -> dict:
    """One engine start (front end and TP workers) in a fresh process, once per
    (tp, window): the workers' results."""
    extra = {} if window is None else {"TQ_CHUNKED_WINDOW": str(window)}
    r = subprocess.run(
        [sys.executable, os.path.abspath(__file__), model_dir, str(tp)],
        cwd=ROOT,
        env=cpu_test_env(ROOT, **extra),
        capture_output=True,
        text=True,
        timeout=FRONT_END_TIMEOUT,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith(RESULT)]
    assert r.returncode == 0 and lines, (
        f"the engine start (tp {tp}) failed: rc {r.returncode}\n"
        f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    )
    out = json.loads(lines[-1][len(RESULT) :])
    out["front_end_log"] = r.stdout + r.stderr
    return out


TPS = [1, 2]


@needs_vllm
@pytest.mark.parametrize("tp", TPS, ids=lambda tp: f"tp{tp}")
def test_each_spawned_worker_is_patched_by_vllms_plugin_loading(model_dir, tp):
    """A worker process started as vLLM's MultiprocExecutor starts it (spawn, the
    pickled config) begins with vLLM unpatched; vLLM's own ``init_worker`` (its
    ``load_general_plugins()``) applies tq_chunked's patch; the worker's metadata
    builder logs the active line through vLLM's logger exactly once, and nothing else
    of tq_chunked (the FlashAttention-version line belongs to the front end, where the
    engine config was built, and is not repeated in a worker). With TP 2: two such
    processes, distinct, ranks 0 and 1 of one TP group of 2."""
    from tq_chunked import __version__

    out = _engine(model_dir, tp, None)
    workers = out["workers"]
    assert out["exitcodes"] == [0] * tp and len(workers) == tp, (
        f"expected {tp} workers to finish, got exit codes {out['exitcodes']} and "
        f"{len(workers)} results"
    )
    pids = {w["pid"] for w in workers}
    assert len(pids) == tp and out["front_end_pid"] not in pids, (
        f"workers must be {tp} processes other than the front end: {pids}"
    )
    assert [(w["rank"], w["tp_rank"], w["tp_size"]) for w in workers] == [
        (r, r, tp) for r in range(tp)
    ], "each worker must be its own rank of one TP group of size tp"
    for w in workers:
        assert not w["patched_at_start"], (
            f"worker {w['rank']}: vLLM was patched before its plugins were loaded: "
            "the process did not start fresh (spawn)"
        )
        assert w["patched_by_vllm"], (
            f"worker {w['rank']}: init_worker's load_general_plugins() did not patch"
        )
        active = f"tq_chunked {__version__} active: prefill attention batched"
        assert len(w["logged"]) == 1 and w["logged"][0].startswith(active), (
            f"worker {w['rank']}: expected the active line once, logged {w['logged']}"
        )
    # The front end built the config: its process logged the FA-version decision.
    assert "flash_attn_version=2 for TurboQuant caches" in out["front_end_log"], (
        "the front end did not log the plugin's FlashAttention-version decision"
    )


@needs_vllm
@pytest.mark.parametrize("window", [None, 4096], ids=["default-window", "window4096"])
@pytest.mark.parametrize("tp", TPS, ids=lambda tp: f"tp{tp}")
def test_each_worker_reserves_for_its_share_of_the_heads(model_dir, tp, window):
    """Llama-3-8B's shape (32 query heads, 8 kv heads, D 128) under TP ``tp``: the
    layer vLLM's model code builds in each worker holds 32/tp and 8/tp heads; the
    builder created from its KV-cache spec and the real ``VllmConfig`` (its
    ``parallel_config.tensor_parallel_size`` = tp) shows the plugin exactly those
    (``builder_shape``), and the workspace it sizes its reservation at, and logs, is
    exactly
    ``workspace_bytes(max_num_batched_tokens, 32/tp, 8/tp, 128, window, bf16)``, the
    window being TQ_CHUNKED_WINDOW or the default for 8/tp kv heads."""
    import torch

    from tq_chunked.runtime.plan import default_window, workspace_bytes

    out = _engine(model_dir, tp, window)
    hq, hk, d = 32 // tp, 8 // tp, 128
    w_expected = default_window(hk, d, BLOCK_SIZE) if window is None else window
    expected = workspace_bytes(MAX_TOKENS, hq, hk, d, w_expected, torch.bfloat16)
    assert len(out["workers"]) == tp, f"expected {tp} workers: {out['exitcodes']}"
    for w in out["workers"]:
        where = f"worker {w['rank']} of tp {tp}"
        # TurboQuant's spec: its own class up to 0.33, the full-attention one from 0.34
        # (which any full-attention layer has: the cache dtype says it is TurboQuant)
        assert w["kv_cache_dtype"] == "turboquant_3bit_nc" and w["spec"] in (
            "TQFullAttentionSpec",
            "FullAttentionSpec",
        ), f"{where}: {LAYER} is not a TurboQuant layer ({w})"
        assert w["layer_heads"] == [hq, hk], (
            f"{where}: vLLM's model code built {w['layer_heads']} heads, not {hq, hk}"
        )
        seen = (w["num_q_heads"], w["num_kv_heads"], w["head_dim"])
        assert seen == (hq, hk, d), (
            f"{where}: builder_shape saw (Hq, Hk, D) {seen}, the worker holds "
            f"{(hq, hk, d)}"
        )
        assert (w["block_size"], w["dtype"], w["max_num_batched_tokens"]) == (
            BLOCK_SIZE,
            "torch.bfloat16",
            MAX_TOKENS,
        ), f"{where}: the engine config is not the one asked for ({w})"
        assert (w["window"], w["workspace_bytes"]) == (w_expected, expected), (
            f"{where}: reserved {w['workspace_bytes']} bytes for window {w['window']}"
            f", expected {expected} for window {w_expected}"
        )
        logged = f"(windows of {w_expected} tokens, "
        mib = f"workspace {expected / 2**20:.1f} MiB per ubatch"
        assert logged in w["logged"][0] and mib in w["logged"][0], (
            f"{where}: the active line does not say what was reserved: "
            f"{w['logged'][0]!r}"
        )


if __name__ == "__main__":  # the engine front end, started by _engine
    _front_end(sys.argv[1], int(sys.argv[2]))
