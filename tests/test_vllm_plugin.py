"""The vLLM plugin, against real vLLM installs on the CPU.

``tests/install_vllm_cpu.sh`` builds one virtual environment per vLLM release under
``.vllm-envs/`` (0.20.2, whose continuation prefill keeps per-layer buffers; 0.23.0,
whose buffers come from a WorkspaceManager that nothing reserves for them, the release
line that crashes; 0.34.0, whose builder reserves a max_model_len-sized pair). Run from
an environment without vLLM, this file re-runs itself inside each of them; there, the
tests below use vLLM's real classes (impl, metadata, builder, WorkspaceManager, plugin
loader). What a CPU cannot give is stood in for and said so at each place: vLLM's Triton
kernels do not run in Triton's interpreter (its store kernel crashes there), so caches
are written by this project's encoder (byte-for-byte vLLM's format; shown against
vLLM's own store kernel by the GPU suite); ``VllmConfig()`` cannot infer a device, so
the few config values a class reads are given as plain values; FlashAttention does not
run on a CPU, so where vLLM's own method needs it a float32 PyTorch attention with the
same arguments stands in. The runs set ``CUDA_VISIBLE_DEVICES`` empty
(``vllm_harness.cpu_test_env``): vLLM then hands its modules the real Triton, not its
placeholder, under which UltraQuant's module (0.32 on) cannot be imported.

Two modes. By default the plugin patches vLLM (``register()``). With
``TQ_CHUNKED_VENDORED=DIR`` (set by ``tests/test_vendor.py``, which runs this file with
``DIR``, a copy of vLLM that ``python -m tq_chunked.vendor`` has written into, first on
``PYTHONPATH`` and the plugin off) the same tests use vLLM's own, vendored, classes as
they are. What runs in which mode is said at each test; in short: in vendored mode
vLLM's original methods are not there to compare with, so the checks that need them
(the unpatched answer of issue 46460, the unpatched method on a locked workspace,
vLLM's own reservation; and the plugin's loading, off there) run with the plugin only,
and every check of the answers, of the locked workspace and of the reservation runs in
both.
"""

import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from tq_chunked.tools.vllm_harness import cpu_test_env, half_built_vllm_envs, vllm_envs
from tq_chunked.vllm_plugin import UnsupportedVllm, plan_patches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# The vLLM tree tests/test_vendor.py vendored tq_chunked into; None: the plugin's run.
VENDORED = os.environ.get("TQ_CHUNKED_VENDORED") or None
ENVS = list(vllm_envs(ROOT).values())
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed in this environment"
)
WINDOW = 64  # TQ_CHUNKED_WINDOW for these tests: many windows at small sizes
HQ, HK, D, BS = 4, 2, 64, 16


# --- from an environment without vLLM: run this file in each vLLM environment ---------


@pytest.mark.skipif(
    HAS_VLLM, reason="this environment has vLLM: its tests run directly"
)
@pytest.mark.parametrize(
    "python", ENVS or [None], ids=lambda p: p and p.split(os.sep)[-3]
)
def test_plugin_in_each_vllm_install(python):
    if python is None:
        pytest.skip(
            "no .vllm-envs/: run tests/install_vllm_cpu.sh to test against real vLLM"
        )
    env = cpu_test_env(ROOT)
    r = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            os.path.abspath(__file__),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0, f"plugin tests failed under {python}"


@pytest.mark.skipif(
    HAS_VLLM, reason="this environment has vLLM: its tests run directly"
)
def test_a_half_built_vllm_env_is_left_out(tmp_path):
    """An environment tests/install_vllm_cpu.sh did not complete (killed before it
    could remove it: a Python, no src/) is not among the ones the tests run in; this
    checkout's are named if it has any."""
    for name, files in {
        "vllm-0.34.0": ["bin/python", "src/pyproject.toml"],
        "vllm-9.9.9": ["bin/python", "lib/python3.11/site-packages/x.py"],
        "vllm-0.20.2": ["src/pyproject.toml"],  # --sources-only
    }.items():
        for f in files:
            (tmp_path / ".vllm-envs" / name / f).parent.mkdir(
                parents=True, exist_ok=True
            )
            (tmp_path / ".vllm-envs" / name / f).touch()
    assert list(vllm_envs(tmp_path)) == ["vllm-0.34.0"]
    assert half_built_vllm_envs(tmp_path) == ["vllm-9.9.9"]
    half = half_built_vllm_envs(ROOT)
    if half:
        pytest.skip(
            f"left out, half built: {', '.join(half)} in .vllm-envs/ (rerun "
            "tests/install_vllm_cpu.sh, which removes and rebuilds them)"
        )


def test_unknown_backend_shape_is_refused_whole():
    class Impl:
        def _continuation_prefill(self, layer, query, kv_cache):  # another signature
            pass

        def _prefill_attention(
            self,
            query,
            key,
            value,
            kv_cache,
            attn_metadata,
            Pi,
            centroids,
            PiT=None,
            layer=None,
        ):
            pass

    fake = types.SimpleNamespace(
        TurboQuantAttentionImpl=Impl,
        TurboQuantMetadataBuilder=object,
        TurboQuantMetadata=object,
    )
    with pytest.raises(UnsupportedVllm, match="_continuation_prefill"):
        plan_patches(fake, None)
    with pytest.raises(UnsupportedVllm, match="no TurboQuantAttentionImpl"):
        plan_patches(types.SimpleNamespace(), None)


# --- inside a vLLM environment --------------------------------------------------------


def _plain_config(
    max_model_len=1 << 20,
    max_num_batched_tokens=8192,
    num_heads=HQ,
    preset="turboquant_3bit_nc",
):
    """The config values vLLM's TurboQuant classes read, as plain data (a CPU-only
    VllmConfig() cannot infer its device)."""
    ns = types.SimpleNamespace
    return ns(
        attention_config=ns(tq_max_kv_splits_for_cuda_graph=32),
        model_config=ns(
            max_model_len=max_model_len,
            dtype=torch.float16,
            get_num_attention_heads=lambda parallel_config: num_heads,
        ),
        parallel_config=ns(decode_context_parallel_size=1),
        cache_config=ns(cache_dtype=preset),
        speculative_config=None,
        scheduler_config=ns(
            max_num_seqs=4,
            enable_chunked_prefill=True,
            max_num_batched_tokens=max_num_batched_tokens,
        ),
    )


def _check_vendored(tqa):
    """The vendored run tests what the vendor tool wrote: vLLM's module from the
    vendored tree, calling the vendored package (not this checkout's), unpatched by the
    plugin, and reading the window this file's tests are sized for."""
    from tq_chunked.vllm_plugin import is_patched

    assert os.path.abspath(tqa.__file__) == os.path.join(
        os.path.abspath(VENDORED),
        "vllm",
        "v1",
        "attention",
        "backends",
        "turboquant_attn.py",
    )
    assert (
        type(tqa._tq_chunked_prefill).__module__
        == "vllm.v1.attention.ops.tq_chunked.vllm_backend"
    )
    assert not is_patched(tqa)
    assert tqa._tq_chunked_prefill.window == WINDOW, (
        "set TQ_CHUNKED_WINDOW before vLLM is imported"
    )


def _patched_vllm(monkeypatch):
    """The TurboQuant module of vLLM running tq_chunked: patched by the plugin, or,
    in the vendored run, as the vendor tool wrote it."""
    # vLLM 0.33's WorkspaceManager releases cached memory before it grows a buffer,
    # through torch.accelerator.empty_cache(), which raises on a torch without any
    # accelerator; on a CPU there is nothing to release.
    if hasattr(torch, "accelerator") and not torch.accelerator.is_available():
        monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    import vllm.v1.attention.backends.turboquant_attn as tqa

    if VENDORED:
        monkeypatch.setattr(tqa, "get_current_vllm_config", lambda: _plain_config())
        monkeypatch.setattr(tqa, "get_flash_attn_version", lambda *a, **k: None)
        _check_vendored(tqa)
        return tqa
    from tq_chunked.vllm_plugin import register

    monkeypatch.delenv("TQ_CHUNKED_DISABLE", raising=False)
    # Read once, when the plugin patches.
    monkeypatch.setenv("TQ_CHUNKED_WINDOW", str(WINDOW))
    # The patched attributes, undone after the test.
    for name in ("_prefill_attention", "_continuation_prefill"):
        monkeypatch.setattr(
            tqa.TurboQuantAttentionImpl,
            name,
            getattr(tqa.TurboQuantAttentionImpl, name),
        )
    for name in ("__init__", "build", "_reserve_workspace"):
        if name in vars(tqa.TurboQuantMetadataBuilder):
            monkeypatch.setattr(
                tqa.TurboQuantMetadataBuilder,
                name,
                vars(tqa.TurboQuantMetadataBuilder)[name],
            )
    monkeypatch.setattr(tqa, "get_current_vllm_config", lambda: _plain_config())
    monkeypatch.setattr(tqa, "get_flash_attn_version", lambda *a, **k: None)
    assert register()
    return tqa


def _impl_and_layer(tqa, preset):
    """The real TurboQuantAttentionImpl.__init__ of vLLM and _ensure_on_device (the two
    module-level lookups __init__ makes that need a GPU return plain values, see
    _patched_vllm)."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import (
        get_centroids,
    )

    impl = tqa.TurboQuantAttentionImpl(
        num_heads=HQ, head_size=D, scale=D**-0.5, num_kv_heads=HK, kv_cache_dtype=preset
    )
    layer = torch.nn.Module()
    # What vLLM's layer holds.
    layer._tq_centroids = get_centroids(D, impl.tq_config.centroid_bits)
    impl._ensure_on_device(layer, torch.device("cpu"))
    return impl, layer


def _head_major(tqa):
    """Whether forward() takes the cache head-major, (num_blocks, Hk, block_size,
    slot)."""
    return "kv_cache.transpose(1, 2)" in inspect.getsource(
        tqa.TurboQuantAttentionImpl.forward
    )


def _batch(layer, preset, requests, seed):
    """A batch written with vLLM's own centroids and rotation (the layer's)."""
    from tq_chunked.tools.testing import make_batch

    b = make_batch(
        requests,
        preset,
        head_dim=D,
        num_q_heads=HQ,
        num_kv_heads=HK,
        block_size=BS,
        device="cpu",
        seed=seed,
    )
    # make_batch draws a random rotation and this project's centroids: rewrite the cache
    # with the layer's, as vLLM's store would.
    from tq_chunked.runtime.format import TQConfig, encode_reference

    cfg = TQConfig.from_preset(preset, D)
    gen = torch.Generator().manual_seed(seed + 1)
    for r, (cached, q_len) in enumerate(requests):
        total = cached + q_len
        pos = torch.arange(total)
        slots = b.block_table[r].long()[pos // BS] * BS + pos % BS
        key = torch.randn(total, HK, D, generator=gen) * 1.5
        value = torch.randn(total, HK, D, generator=gen)
        encode_reference(
            key, value, b.kv_cache, slots, cfg, layer._tq_centroids, layer._tq_Pi
        )
        q0, q1 = b.query_start_loc[r], b.query_start_loc[r + 1]
        b.key[q0:q1], b.value[q0:q1] = key[cached:].half(), value[cached:].half()
    b.kwargs.update(centroids=layer._tq_centroids, rotation=layer._tq_Pi)
    return b


def _metadata(tqa, b):
    """The TurboQuantMetadata vLLM builds for an all-prefill batch, with host copies
    where the release has those fields."""
    n = b.query_start_loc[-1]
    q_lens = [
        b.query_start_loc[i + 1] - b.query_start_loc[i] for i in range(len(b.seq_lens))
    ]
    extra = {}
    if "query_start_loc_cpu" in tqa.TurboQuantMetadata.__dataclass_fields__:
        extra = dict(
            query_start_loc_cpu=torch.tensor(b.query_start_loc, dtype=torch.int32),
            seq_lens_cpu=torch.tensor(b.seq_lens, dtype=torch.int32),
        )
    return tqa.TurboQuantMetadata(
        seq_lens=torch.tensor(b.seq_lens, dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        block_table=b.block_table,
        query_start_loc=torch.tensor(b.query_start_loc, dtype=torch.int32),
        num_actual_tokens=n,
        max_query_len=max(q_lens),
        max_seq_len=max(b.seq_lens),
        is_prefill=True,
        num_decodes=0,
        num_decode_tokens=0,
        **extra,
    )


def _errors(out, b, only=None):
    """Per request with query tokens (or request ``only`` alone): (error of out, error
    of the full-buffer path), both relative to the float64 oracle."""
    from tq_chunked.tools.reference import (
        full_buffer_continuation_prefill,
        oracle_continuation_prefill,
    )
    from tq_chunked.tools.testing import rel_err

    res = []
    for r in range(len(b.seq_lens)):
        q0, q1 = b.query_start_loc[r], b.query_start_loc[r + 1]
        if q1 > q0 and only in (None, r):
            args = b.request(r)
            oracle = oracle_continuation_prefill(*args, **b.kwargs)
            full = full_buffer_continuation_prefill(*args, **b.kwargs, backend="torch")
            res.append((rel_err(out[q0:q1], oracle), rel_err(full, oracle)))
    return res


def _continuation(impl, layer, b, r):
    """VLLM's (patched or vendored) _continuation_prefill on request r of b alone."""
    query, key_chunk, val_chunk, kv_cache, _, cached_len = b.request(r)
    return impl._continuation_prefill(
        layer,
        query,
        key_chunk,
        val_chunk,
        kv_cache,
        b.block_table[r : r + 1],
        cached_len,
        cached_len + query.shape[0],
        layer._tq_Pi,
        layer._tq_centroids,
    )


def _cpu_flash_attn_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    **unused,
):
    """FlashAttention's varlen call as float32 PyTorch (bottom-right causal mask), for
    the CPU: only where vLLM's unpatched method needs it."""
    out = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1, k0, k1 = (
            int(x)
            for x in (
                cu_seqlens_q[b],
                cu_seqlens_q[b + 1],
                cu_seqlens_k[b],
                cu_seqlens_k[b + 1],
            )
        )
        qq, kk, vv = (x.float().transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        mask = None
        if causal:
            mask = torch.arange(k1 - k0)[None, :] <= torch.arange(q1 - q0)[:, None] + (
                k1 - k0
            ) - (q1 - q0)
        o = torch.nn.functional.scaled_dot_product_attention(
            qq,
            kk,
            vv,
            attn_mask=mask,
            scale=softmax_scale,
            enable_gqa=kk.shape[0] != qq.shape[0],
        )
        out[q0:q1] = o.transpose(0, 1).to(q.dtype)
    return out


def _plugin_on_env():
    """This process's environment for a child that loads vLLM's plugins, the plugin's
    off switch left out."""
    env = dict(os.environ)
    env.pop("TQ_CHUNKED_DISABLE", None)
    return env


def _entry_point_registered():
    from importlib.metadata import entry_points

    return any(
        ep.value.startswith("tq_chunked.")
        for ep in entry_points(group="vllm.general_plugins")
    )


@needs_vllm
def test_load_general_plugins_applies_the_patch_and_the_switch_turns_it_off():
    """Plugin run: loaded by vLLM, it patches; TQ_CHUNKED_DISABLE=1 (or True) turns it
    off.
    Vendored run: only the switch (the vendored tests run with the plugin off, and this
    shows it is off there)."""
    if not _entry_point_registered():
        pytest.skip(
            "tq_chunked is not pip-installed here: its vllm.general_plugins entry "
            "point is not registered"
        )
    code = (
        "import vllm.plugins as p; p.load_general_plugins(); "
        "from tq_chunked.vllm_plugin import is_patched; "
        "print('PATCHED' if is_patched() else 'UNPATCHED')"
    )
    cases = (
        (("1", "UNPATCHED"),)
        if VENDORED
        else ((None, "PATCHED"), ("1", "UNPATCHED"), ("True", "UNPATCHED"))
    )
    for disable, expect in cases:
        env = _plugin_on_env()
        if disable:
            env["TQ_CHUNKED_DISABLE"] = disable
        r = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.stdout.strip().splitlines()[-1] == expect, r.stderr[-2000:]


@needs_vllm
def test_the_docs_is_patched_snippet_runs_as_written():
    """The ``is_patched`` snippet of docs/integration.md ("Is it active?"), run as
    written in a fresh process: it loads vLLM's plugins as a vLLM process does and
    prints that tq_chunked is active. Plugin run only (the vendored run has the
    plugin off)."""
    if VENDORED:
        pytest.skip("the plugin is off in the vendored run")
    if not _entry_point_registered():
        pytest.skip("tq_chunked is not pip-installed here: no entry point to load")
    with open(os.path.join(ROOT, "docs", "integration.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    [code] = [b for b in blocks if "is_patched" in b]
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=_plugin_on_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "tq_chunked active: True"


@needs_vllm
def test_the_active_line_goes_through_vllms_logger():
    """The start-up line (docs/integration.md, "Is it active?") is logged under vLLM's
    "vllm" logger, the one vLLM gives its handler and level: a logger outside it has its
    INFO lines dropped in a vLLM process."""
    import logging

    from tq_chunked import __version__, vllm_plugin

    # Imports vllm.logger, which (0.20) configures vLLM's logging.
    log = vllm_plugin._logger()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    # what the windows attend with: FlashAttention 3 on Hopper, also inside an engine
    # with a TurboQuant cache (tq_chunked.runtime.attention._windows_fa_version)
    attention = vllm_plugin._attention_name(128)
    if not torch.cuda.is_available():
        assert attention == "no CUDA device"
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.INFO)  # vLLM's default level
    try:
        vllm_plugin._log_active.__wrapped__(log, 12288, 128 << 20, attention)
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)
    assert [r.getMessage() for r in records] == [
        (
            f"tq_chunked {__version__} active: prefill attention batched and windowed "
            f"(windows of 12288 tokens, {attention}), workspace 128.0 MiB per ubatch"
        )
    ]


# vLLM's real EngineArgs.create_engine_config, run in a fresh process (EngineArgs loads
# vLLM's plugins, which would patch this process for the tests after) on vLLM's own CPU
# platform: a CPU-only machine cannot infer a device otherwise. The GPU's capability is
# the one thing given: _is_hopper's answer.
_ENGINE_CONFIG_CASES = r"""
import json, os, sys
import vllm.platforms as platforms
from vllm.platforms.cpu import CpuPlatform
platforms._current_platform = CpuPlatform()
from tq_chunked import vllm_plugin
vllm_plugin._is_hopper = lambda: {hopper}
assert vllm_plugin.register()
from vllm.engine.arg_utils import EngineArgs
out = []
for cache, asked, keep in {cases}:
    os.environ["TQ_CHUNKED_KEEP_FA2"] = keep
    kwargs = dict(model=sys.argv[1], kv_cache_dtype=cache, load_format="dummy",
                  skip_tokenizer_init=True)
    if asked is not None:
        kwargs["attention_config"] = {{"flash_attn_version": asked}}
    config = EngineArgs(**kwargs).create_engine_config()
    out.append(config.attention_config.flash_attn_version)
print("VERSIONS " + json.dumps(out))
"""
_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "vocab_size": 1024,
    "num_hidden_layers": 6,
    "torch_dtype": "bfloat16",
}


@needs_vllm
@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "other-gpu"])
def test_vllms_fa2_setting_for_turboquant_is_undone_on_hopper(tmp_path, hopper):
    """A turboquant_* cache makes vLLM set flash_attn_version = 2. With the plugin, on
    Hopper, the engine config gets back what was asked (None: vLLM's default; 3), unless
    TQ_CHUNKED_KEEP_FA2=1; FA2 asked for stays FA2, another cache is untouched, and
    elsewhere vLLM's setting stands. Plugin run only (the vendored change does not
    touch vLLM's argument parsing)."""
    if VENDORED:
        pytest.skip("the plugin is off in the vendored run")
    import json

    (tmp_path / "config.json").write_text(json.dumps(_TINY_LLAMA))
    tq = "turboquant_3bit_nc"
    cases = [  # (cache, asked, TQ_CHUNKED_KEEP_FA2) -> expected on Hopper, elsewhere
        ((tq, None, ""), (None, 2)),
        ((tq, 3, "0"), (3, 2)),
        ((tq, None, "1"), (2, 2)),
        ((tq, 2, ""), (2, 2)),
        (("auto", None, ""), (None, None)),
        (("turboquant_k8v4", None, ""), (None, 2)),
    ]
    code = _ENGINE_CONFIG_CASES.format(hopper=hopper, cases=[c for c, _ in cases])
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=_plugin_on_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("VERSIONS ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    got = json.loads(lines[-1].split(" ", 1)[1])
    assert got == [e[0 if hopper else 1] for _, e in cases]
    # the log says what was done, each time
    said = "undone for the model's" if hopper else "kept at 2 (not a Hopper GPU"
    assert said in r.stdout + r.stderr


@pytest.mark.parametrize("value", ["2", "enable", "y"])
def test_a_bad_keep_fa2_value_is_refused_by_name(monkeypatch, value):
    from tq_chunked import vllm_plugin

    monkeypatch.setenv("TQ_CHUNKED_KEEP_FA2", value)
    with pytest.raises(
        ValueError,
        match=f"TQ_CHUNKED_KEEP_FA2: expected one of 1, true, yes, on .* got '{value}'",
    ):
        vllm_plugin._keep_fa2()


@pytest.mark.parametrize("name", ["TQ_CHUNKED_DISABLE", "TQ_CHUNKED_KEEP_FA2"])
def test_the_switches_take_the_usual_spellings(monkeypatch, name):
    """1/true/yes/on and 0/false/no/off, in any case and with surrounding spaces;
    unset or empty is off."""
    from tq_chunked.vllm_plugin import switch

    for raw, on in [
        ("1", True),
        ("true", True),
        ("YES", True),
        (" On ", True),
        ("0", False),
        ("False", False),
        ("no", False),
        ("OFF", False),
        ("", False),
    ]:
        monkeypatch.setenv(name, raw)
        assert switch(name) is on, raw
    monkeypatch.delenv(name)
    assert switch(name) is False


@pytest.mark.parametrize("value", ["2", "disable", "tru"])
def test_a_bad_off_switch_is_refused_by_name_before_anything_is_patched(
    monkeypatch, value
):
    """TQ_CHUNKED_DISABLE=disable (or any value not on or off) stops the plugin's
    registration with the variable's name, before it looks at vLLM, as a bad
    TQ_CHUNKED_WINDOW does: never read as on or off."""
    from tq_chunked import vllm_plugin

    monkeypatch.setenv("TQ_CHUNKED_DISABLE", value)
    monkeypatch.setattr(
        vllm_plugin, "plan_patches", lambda *a: pytest.fail("patched anyway")
    )
    with pytest.raises(ValueError, match=f"^TQ_CHUNKED_DISABLE: expected .*'{value}'"):
        vllm_plugin.register()


def test_a_bad_path_is_refused_by_name_before_anything_is_patched(monkeypatch):
    """TQ_CHUNKED_PATH names the path the plan may pick (auto, window, paged); any
    other value stops the registration with the variable's name, and a good one
    reaches every ContinuationPrefill the plugin makes."""
    from tq_chunked import vllm_plugin
    from tq_chunked.runtime.vllm_backend import ChunkedPrefill

    monkeypatch.delenv("TQ_CHUNKED_DISABLE", raising=False)  # the vendored run's is on
    monkeypatch.setenv("TQ_CHUNKED_PATH", "fast")
    monkeypatch.setattr(
        vllm_plugin, "plan_patches", lambda *a: pytest.fail("patched anyway")
    )
    with pytest.raises(ValueError, match="^TQ_CHUNKED_PATH must be one of .*'fast'"):
        vllm_plugin.register()
    monkeypatch.setenv("TQ_CHUNKED_PATH", "window")
    prefill = ChunkedPrefill()._prefill(
        None, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16,
        preset="turboquant_3bit_nc", block_size=16,
    )  # fmt: skip
    assert prefill.path == "window"
    monkeypatch.delenv("TQ_CHUNKED_PATH")
    assert ChunkedPrefill().path == "auto"


class _Platform:
    """What _is_hopper asks of vLLM's platform: stands in for a GPU this machine has
    not got."""

    def __init__(self, cuda, capability):
        self.cuda, self.capability = cuda, capability

    def is_cuda(self):
        return self.cuda

    def get_device_capability(self):
        if isinstance(self.capability, Exception):
            raise self.capability
        return self.capability


@needs_vllm
@pytest.mark.parametrize(
    "cuda, capability, hopper",
    [
        (True, (9, 0), True),
        (True, (8, 0), False),
        (True, (10, 0), False),
        (True, None, False),  # vLLM could not tell
        (True, RuntimeError("NVML: driver not loaded"), False),
        (False, (9, 0), False),  # ROCm, XPU, CPU
    ],
)
def test_is_hopper_asks_vllms_platform(monkeypatch, cuda, capability, hopper):
    import vllm.platforms as platforms
    from vllm.platforms.interface import DeviceCapability

    from tq_chunked import vllm_plugin

    if isinstance(capability, tuple):
        capability = DeviceCapability(*capability)
    monkeypatch.setattr(platforms, "_current_platform", _Platform(cuda, capability))
    assert vllm_plugin._is_hopper() is hopper


# A prefix-cache hit shorter than a first chunk in the same batch: the first chunk (400
# tokens) is the longest request, so vLLM's max_query_len == max_seq_len fast path runs
# and attends every request to its raw K/V only (vllm-project/vllm issue 46460).
ISSUE_46460 = [(0, 400), (300, 16), (200, 150), (0, 90)]


@needs_vllm
@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k8v4"])
def test_prefix_hits_beside_a_longer_first_chunk_keep_their_prefix(preset, monkeypatch):
    """Plugin run: vLLM's forward unpatched (the hits lose their prefix), then patched
    (every request as exact as the full-buffer path). Vendored run: vLLM's own forward
    is the vendored one, so only the second half: every request, the hits included
    (whose errors exceed 0.1 unpatched), as exact as the full-buffer path."""
    import vllm.v1.attention.backends.turboquant_attn as tqa

    monkeypatch.setattr(tqa, "get_current_vllm_config", lambda: _plain_config())
    monkeypatch.setattr(tqa, "get_flash_attn_version", lambda *a, **k: None)
    monkeypatch.setattr(tqa, "_HAS_FLASH_ATTN", True)
    monkeypatch.setattr(
        tqa, "flash_attn_varlen_func", _cpu_flash_attn_varlen, raising=False
    )
    impl, layer = _impl_and_layer(tqa, preset)
    b = _batch(layer, preset, ISSUE_46460, seed=46460)
    meta = _metadata(tqa, b)
    # As the engine hands it over.
    cache = b.kv_cache.transpose(1, 2) if _head_major(tqa) else b.kv_cache
    n = b.query.shape[0]
    forward = lambda: impl.forward(
        layer,
        b.query.reshape(n, -1),
        b.key.reshape(n, -1),
        b.value.reshape(n, -1),
        cache,
        meta,
        output=torch.full((n, HQ * D), float("nan"), dtype=torch.float16),
    )
    if not VENDORED:  # vLLM's own method, before the plugin patches it
        unpatched = _errors(forward().view(n, HQ, D), b)
        (first, _), (short_hit, _), (long_hit, _), (other, _) = unpatched
        print(f"{preset}: unpatched errors {[f'{e:.2e}' for e, _ in unpatched]}")
        assert short_hit > 0.1 and long_hit > 0.1  # the hits lost their cached prefix
        assert first < 1e-3 and other < 1e-3  # first chunks are right either way
    _patched_vllm(monkeypatch)
    patched = _errors(forward().view(n, HQ, D), b)
    mode = "vendored" if VENDORED else "patched"
    print(f"{preset}: {mode} errors {[f'{e:.2e}' for e, _ in patched]}")
    assert len(patched) == len(ISSUE_46460)
    for e, e_full in patched:
        assert e <= 1.1 * e_full + 1e-4


@needs_vllm
@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k8v4"])
def test_a_locked_workspace_holds_the_patched_prefill_through_the_builder_hook(
    preset, monkeypatch
):
    """An engine's start on a real WorkspaceManager: the builder reserves (the
    plugin's hook, or the vendored reservation), a short profile, the lock; then a
    16-times longer context. Plugin run: vLLM's own continuation method raises on the
    locked manager. Both runs: the (patched or vendored) prefill and continuation
    answer within it, as exact as the full-buffer path (0.20.x: without per-layer
    buffers)."""
    tqa = _patched_vllm(monkeypatch)
    impl, layer = _impl_and_layer(tqa, preset)
    profile_len = 256
    # 16x the context the locked profile saw.
    requests = [(16 * profile_len, 129), (300, 40), (0, 30)]
    b = _batch(layer, preset, requests, seed=7)
    meta = _metadata(tqa, b)
    max_tokens = b.query.shape[0]
    spec = types.SimpleNamespace(num_kv_heads=HK, head_size=D, block_size=BS)
    config = _plain_config(max_model_len=1 << 14, max_num_batched_tokens=max_tokens)
    if not hasattr(tqa, "current_workspace_manager"):
        # 0.20.x: per-layer buffers, replaced by a shared one.
        tqa.TurboQuantMetadataBuilder(spec, ["layer.0"], config, torch.device("cpu"))
        out = impl._prefill_attention(
            b.query,
            b.key,
            b.value,
            b.kv_cache,
            meta,
            layer._tq_Pi,
            layer._tq_centroids,
            layer._tq_PiT,
            layer,
        )
        cont = _continuation(impl, layer, b, 1)
        assert not hasattr(layer, "_tq_k_dequant_buf") and not hasattr(
            layer, "_tq_v_dequant_buf"
        )
    else:
        from vllm.v1.worker import workspace

        workspace.init_workspace_manager(torch.device("cpu"))
        try:
            # An engine's start: the builders are created (the plugin's hook reserves
            # the window workspace), a short profile runs, the manager is locked.
            tqa.TurboQuantMetadataBuilder(
                spec, ["layer.0"], config, torch.device("cpu")
            )
            workspace.current_workspace_manager().get_simultaneous(
                ((1, HK, profile_len, D), torch.float16),
                ((1, HK, profile_len, D), torch.float16),
            )
            workspace.lock_workspace()
            # vLLM's own method is there only under the plugin's wrapper.
            if not VENDORED:
                # Where vLLM hands its modules its Triton placeholder, the unpatched
                # method's triton.next_power_of_2 (before it asks the manager for
                # buffers) needs the real one.
                import triton

                monkeypatch.setattr(tqa, "triton", triton)
                original = tqa.TurboQuantAttentionImpl._continuation_prefill.__wrapped__
                with pytest.raises(
                    AssertionError, match="Workspace is locked but allocation"
                ):
                    original(
                        impl,
                        layer,
                        *b.request(0)[:4],
                        b.block_table[0:1],
                        16 * profile_len,
                        16 * profile_len + 129,
                        layer._tq_Pi,
                        layer._tq_centroids,
                    )
            out = impl._prefill_attention(
                b.query,
                b.key,
                b.value,
                b.kv_cache,
                meta,
                layer._tq_Pi,
                layer._tq_centroids,
                layer._tq_PiT,
                layer,
            )
            cont = _continuation(impl, layer, b, 1)
        finally:
            workspace.reset_workspace_manager()
    errors = _errors(out, b)
    assert len(errors) == len(requests)
    for e, e_full in errors:
        assert e <= 1.1 * e_full + 1e-4
    # _continuation_prefill (no caller left in vLLM's forward once _prefill_attention is
    # replaced; still rewired): request 1 alone, the same bound.
    out_1 = torch.full_like(out, float("nan"))
    out_1[b.query_start_loc[1] : b.query_start_loc[2]] = cont
    [(e, e_full)] = _errors(out_1, b, only=1)
    assert e <= 1.1 * e_full + 1e-4


@needs_vllm
@pytest.mark.parametrize("layers", ["unlisted", "listed"])
def test_the_reservation_drops_exactly_the_continuation_pair(monkeypatch, layers):
    """VLLM's _reserve_workspace for a 1M-token model, for a builder whose layers are
    TurboQuantAttentionImpl's: looked up in the config's static forward context, as in
    an engine ("listed"), or not there, as in vLLM's unit tests ("unlisted": taken to be
    TurboQuantAttentionImpl's). Plugin run: vLLM's own reserves the 4 GiB (1, Hk,
    max_model_len, D) pair; the plugin's, the decode scratch alone (its builder hook
    reserves the window workspace), and its filter keeps any other fp16 pair. Vendored
    run (vLLM's own is not in the tree): the vendored one reserves the decode scratch
    and the tq_chunked workspace, and not the pair."""
    tqa = _patched_vllm(monkeypatch)
    builder_cls = tqa.TurboQuantMetadataBuilder
    if not hasattr(builder_cls, "_reserve_workspace"):
        pytest.skip("this vLLM reserves no continuation workspace")
    from vllm.v1.worker import workspace

    from tq_chunked.vllm_plugin import (
        _WithoutContinuationReservation,
        builder_workspace_bytes,
        continuation_reservation,
    )

    # A builder's state as its real __init__ leaves it (plain config values, see above).
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    builder = types.SimpleNamespace(
        vllm_config=_plain_config(max_model_len=1 << 20, num_heads=32),
        kv_cache_spec=types.SimpleNamespace(
            num_kv_heads=8, head_size=128, block_size=16
        ),
        layer_names=names,
    )
    if layers == "listed":
        impl, _ = _impl_and_layer(tqa, "turboquant_3bit_nc")
        builder.vllm_config.compilation_config = types.SimpleNamespace(
            static_forward_context=_attention_layers(impl, names)
        )
    assert continuation_reservation(builder) == ((1, 8, 1 << 20, 128), torch.float16)
    pair = 2 * 8 * (1 << 20) * 128 * 2  # two (1, Hk, max_model_len, D) fp16: 4 GiB
    window, nbytes = builder_workspace_bytes(builder, None)  # the default window
    assert nbytes <= 128 << 20
    if VENDORED:
        methods = {"vendored": builder_cls._reserve_workspace}
    else:
        methods = {
            "vllm": builder_cls._reserve_workspace.__wrapped__,
            "plugin": builder_cls._reserve_workspace,
        }
    sizes = {}
    for name, method in methods.items():
        workspace.init_workspace_manager(torch.device("cpu"))
        try:
            method(builder)
            manager = workspace.current_workspace_manager()
            sizes[name] = manager._workspace_size_bytes(manager._current_workspaces[0])
            if name == "plugin":
                # A same-rank fp16 pair of another shape is not the continuation
                # pair: kept.
                other = ((1, 8, 17, 128), torch.float16)
                kept = _WithoutContinuationReservation(
                    manager, continuation_reservation(builder)
                ).get_simultaneous(other, other)
                assert all(
                    isinstance(t, torch.Tensor) and t.shape == (1, 8, 17, 128)
                    for t in kept
                )
        finally:
            workspace.reset_workspace_manager()
    if VENDORED:
        # The window the vendored module runs with.
        _, reserved = builder_workspace_bytes(builder, WINDOW)
        # One buffer, grown to the larger of the decode scratch (< 16 MiB) and the
        # workspace.
        assert reserved <= sizes["vendored"] <= max(reserved, 16 << 20)
        assert sizes["vendored"] < pair
    else:
        assert sizes["vllm"] >= pair
        assert 0 < sizes["plugin"] < 16 << 20  # the decode scratch alone


def _attention_layers(impl, names):
    """{name: layer} as vLLM's static forward context holds a model's attention layers,
    each with ``impl``: the metadata builder looks its layers up there to tell which
    impl it serves (nothing else of a layer is read)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    class Layer(AttentionLayerBase):
        def __init__(self, impl):
            self.impl = impl

        def get_attn_backend(self):
            raise NotImplementedError

        def get_kv_cache_spec(self, vllm_config):
            raise NotImplementedError

    return {name: Layer(impl) for name in names}


# UltraQuant (vLLM 0.32 on) pins bf16, D 256 (its FlyDSL decode) and 64-token blocks;
# one head: without FlashAttention its continuation prefill has no GQA.
UQ_HEADS, UQ_D, UQ_BS = 1, 256, 64
# A context of 640 cached + 129 new tokens (over its decode threshold of 128): its
# K/V pair (640 KiB) is more than a workspace reserved for 129 query tokens.
UQ_CACHED, UQ_NEW, UQ_MAX_MODEL_LEN = 640, 129, 1024


def _ultraquant_prefill_on_a_locked_manager(tqa, uqa):
    """An engine's start on vLLM's real WorkspaceManager with UltraQuant layers: the
    builder (TurboQuant's: UltraQuant's backend uses it) reserves, the manager is
    locked; then UltraQuant's own prefill of a continuation chunk. Returns its output.
    The cache is zeros: what is tested is the buffers it asks for."""
    from vllm.v1.attention.ops.ultraquant.format import slot_size
    from vllm.v1.worker import workspace

    config = _plain_config(
        max_model_len=UQ_MAX_MODEL_LEN, max_num_batched_tokens=UQ_NEW, num_heads=1
    )
    config.model_config.dtype = torch.bfloat16
    impl = uqa.UltraQuantAttentionImpl(
        num_heads=UQ_HEADS,
        head_size=UQ_D,
        scale=UQ_D**-0.5,
        num_kv_heads=UQ_HEADS,
        kv_cache_dtype="ultraquant_4bit",
    )
    layer = torch.nn.Module()
    impl._ensure_on_device(layer, torch.device("cpu"))
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    config.compilation_config = types.SimpleNamespace(
        static_forward_context=_attention_layers(impl, names)
    )
    spec = types.SimpleNamespace(
        num_kv_heads=UQ_HEADS, head_size=UQ_D, block_size=UQ_BS
    )
    seq_len = UQ_CACHED + UQ_NEW
    blocks = -(-seq_len // UQ_BS)
    kv_cache = torch.zeros(blocks, UQ_BS, UQ_HEADS, slot_size(UQ_D), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(16)
    query, key, value = (
        torch.randn(UQ_NEW, UQ_HEADS, UQ_D, generator=gen).bfloat16() for _ in range(3)
    )
    qsl = torch.tensor([0, UQ_NEW], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32)
    meta = tqa.TurboQuantMetadata(
        seq_lens=seq_lens,
        slot_mapping=torch.zeros(UQ_NEW, dtype=torch.int64),
        block_table=torch.arange(blocks, dtype=torch.int32)[None],
        query_start_loc=qsl,
        num_actual_tokens=UQ_NEW,
        max_query_len=UQ_NEW,
        max_seq_len=seq_len,
        is_prefill=True,
        num_decodes=0,
        num_decode_tokens=0,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    workspace.init_workspace_manager(torch.device("cpu"))
    try:
        tqa.TurboQuantMetadataBuilder(spec, names, config, torch.device("cpu"))
        workspace.lock_workspace()
        return impl._prefill_attention(
            query,
            key,
            value,
            kv_cache,
            meta,
            layer._tq_Pi,
            layer._tq_centroids,
            layer._tq_PiT,
            layer,
        )
    finally:
        workspace.reset_workspace_manager()


@needs_vllm
def test_ultraquant_keeps_its_continuation_buffers(monkeypatch):
    """UltraQuant shares TurboQuant's metadata builder and brings its own prefill,
    whose continuation takes a (1, Hk, alloc_len, D) K/V pair from the WorkspaceManager;
    tq_chunked computes none of its prefill, so its builder must reserve what vLLM's
    reserves. On vLLM's real manager, locked after the builder reserved: UltraQuant's
    prefill of a continuation chunk. Plugin run: on vLLM as it is, then with the
    plugin, the same answer bit for bit (with the pair filtered out for UltraQuant's
    layers it raised vLLM's "Workspace is locked but allocation ... requires ...").
    Vendored run: the vendored tree answers."""
    if hasattr(torch, "accelerator") and not torch.accelerator.is_available():
        monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    try:
        import vllm.v1.attention.backends.ultraquant_attn as uqa
    except ImportError:
        pytest.skip("this vLLM has no UltraQuant (0.32 on)")
    except AttributeError:  # tl.float16 of vLLM's Triton placeholder
        pytest.skip(
            "vLLM hands its modules its Triton placeholder here: run with "
            "CUDA_VISIBLE_DEVICES= (as test_plugin_in_each_vllm_install does)"
        )
    import vllm.v1.attention.backends.turboquant_attn as tqa

    assert (
        uqa.UltraQuantAttentionBackend.get_builder_cls()
        is tqa.TurboQuantMetadataBuilder
    )
    assert "_prefill_attention" in vars(uqa.UltraQuantAttentionImpl)
    monkeypatch.setattr(uqa, "get_current_vllm_config", lambda: _plain_config())
    monkeypatch.setattr(uqa, "get_flash_attn_version", lambda *a, **k: None)
    expected = None
    if not VENDORED:  # vLLM as it is
        expected = _ultraquant_prefill_on_a_locked_manager(tqa, uqa)
    _patched_vllm(monkeypatch)
    out = _ultraquant_prefill_on_a_locked_manager(tqa, uqa)
    assert out.shape == (UQ_NEW, UQ_HEADS, UQ_D) and out.isfinite().all()
    if expected is not None:
        assert torch.equal(out, expected)
