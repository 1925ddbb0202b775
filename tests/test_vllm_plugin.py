"""The vLLM plugin, against real vLLM installs on the CPU.

``tests/install_vllm_cpu.sh`` builds one virtual environment per vLLM release under
``.vllm-envs/`` (0.20.2, whose continuation prefill keeps per-layer buffers, and the
latest release, 0.33.0, whose buffers come from a WorkspaceManager reserved for
max_model_len). Run from an environment without vLLM, this file re-runs itself inside
each of them; there, the tests below use vLLM's real classes, WorkspaceManager and plugin
loader. What a CPU cannot give is built by hand and said so at each place: vLLM's Triton
kernels are disabled without a GPU driver, so the cache is written by this project's
encoder (byte-for-byte vLLM's format; shown against vLLM's own store kernel by the GPU
suite), and ``VllmConfig()`` cannot infer a device, so the few config values a class
reads are given as plain values.
"""

import glob
import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch

from tq_chunked.vllm_plugin import UnsupportedVllm, plan_patches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENVS = sorted(glob.glob(os.path.join(ROOT, ".vllm-envs", "*", "bin", "python")))
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed in this environment")
WINDOW = 64  # TQ_CHUNKED_WINDOW for these tests: many windows at small sizes


# --- from an environment without vLLM: run this file in each vLLM environment -------------

@pytest.mark.skipif(HAS_VLLM, reason="this environment has vLLM: its tests run directly")
@pytest.mark.parametrize("python", ENVS or [None], ids=lambda p: p and p.split(os.sep)[-3])
def test_plugin_in_each_vllm_install(python):
    if python is None:
        pytest.skip("no .vllm-envs/: run tests/install_vllm_cpu.sh to test against real vLLM")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    env.pop("TQ_CHUNKED_DISABLE", None)
    r = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                        os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0, f"plugin tests failed under {python}"


def test_unknown_backend_shape_is_refused_whole():
    class Impl:
        def _continuation_prefill(self, layer, query, kv_cache):  # another signature
            pass

    fake = types.SimpleNamespace(TurboQuantAttentionImpl=Impl, TurboQuantMetadataBuilder=object)
    with pytest.raises(UnsupportedVllm, match="_continuation_prefill"):
        plan_patches(fake, None)
    with pytest.raises(UnsupportedVllm, match="no TurboQuantAttentionImpl"):
        plan_patches(types.SimpleNamespace(), None)


# --- inside a vLLM environment ------------------------------------------------------------

def _plain_config(max_model_len=1 << 20, max_num_batched_tokens=8192, num_heads=4):
    """The config values vLLM's TurboQuant classes read, as plain data (a CPU-only
    VllmConfig() cannot infer its device)."""
    ns = types.SimpleNamespace
    return ns(attention_config=ns(tq_max_kv_splits_for_cuda_graph=32),
              model_config=ns(max_model_len=max_model_len, dtype=torch.float16,
                              get_num_attention_heads=lambda parallel_config: num_heads),
              parallel_config=None,
              scheduler_config=ns(max_num_seqs=4, enable_chunked_prefill=True,
                                  max_num_batched_tokens=max_num_batched_tokens))


def _patched_vllm(monkeypatch):
    # vLLM 0.33's WorkspaceManager releases cached memory before it grows a buffer,
    # through torch.accelerator.empty_cache(), which raises on a torch without any
    # accelerator; on a CPU there is nothing to release.
    if hasattr(torch, "accelerator") and not torch.accelerator.is_available():
        monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    import vllm.v1.attention.backends.turboquant_attn as tqa
    from tq_chunked.vllm_plugin import register
    monkeypatch.delenv("TQ_CHUNKED_DISABLE", raising=False)
    monkeypatch.setenv("TQ_CHUNKED_WINDOW", str(WINDOW))  # read once, when the plugin patches
    assert register()
    return tqa


def _impl_and_layer(tqa, monkeypatch, preset, hq=4, hk=2, d=64):
    """vLLM's real TurboQuantAttentionImpl.__init__ and _ensure_on_device. The two
    module-level lookups __init__ makes that need a GPU (the current VllmConfig and the
    FlashAttention version) return plain values here."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    monkeypatch.setattr(tqa, "get_current_vllm_config", lambda: _plain_config(num_heads=hq))
    monkeypatch.setattr(tqa, "get_flash_attn_version", lambda *a, **k: None)
    impl = tqa.TurboQuantAttentionImpl(num_heads=hq, head_size=d, scale=d**-0.5, num_kv_heads=hk,
                                       kv_cache_dtype=preset)
    layer = torch.nn.Module()
    layer._tq_centroids = get_centroids(d, impl.tq_config.centroid_bits)  # what vLLM's layer holds
    impl._ensure_on_device(layer, torch.device("cpu"))
    return impl, layer


def _case(layer, preset, cached_len, q_len, layout):
    """A cache written with vLLM's own centroids and rotation (the layer's)."""
    from conftest import make_case
    return make_case(preset, torch.float16, head_dim=64, num_q_heads=4, num_kv_heads=2, cached_len=cached_len,
                     q_len=q_len, layout=layout, device="cpu", rotation=layer._tq_Pi, centroids=layer._tq_centroids, seed=0)


def _check_answer(out, case):
    from conftest import rel_err
    from tq_chunked.reference import full_buffer_continuation_prefill, oracle_continuation_prefill
    oracle = oracle_continuation_prefill(*case.args, **case.kwargs)
    full = full_buffer_continuation_prefill(*case.args, **case.kwargs, backend="torch")
    assert rel_err(out, oracle) <= 1.1 * rel_err(full, oracle) + 1e-4


def _layout(tqa):
    return "v033" if hasattr(tqa.TurboQuantMetadataBuilder, "_reserve_workspace") else "v020"


def _entry_point_registered():
    from importlib.metadata import entry_points
    return any(ep.value.startswith("tq_chunked.") for ep in entry_points(group="vllm.general_plugins"))


@needs_vllm
def test_load_general_plugins_applies_the_patch_and_the_switch_turns_it_off():
    if not _entry_point_registered():
        pytest.skip("tq_chunked is not pip-installed here: its vllm.general_plugins entry point is not registered")
    code = ("import vllm.plugins as p; p.load_general_plugins(); "
            "from tq_chunked.vllm_plugin import is_patched; print('PATCHED' if is_patched() else 'UNPATCHED')")
    for disable, expect in ((None, "PATCHED"), ("1", "UNPATCHED")):
        env = dict(os.environ)
        env.pop("TQ_CHUNKED_DISABLE", None)
        if disable:
            env["TQ_CHUNKED_DISABLE"] = disable
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert r.stdout.strip().splitlines()[-1] == expect, r.stderr[-2000:]


@needs_vllm
@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k8v4"])
def test_patched_method_answers_beyond_a_locked_workspace(preset, monkeypatch):
    tqa = _patched_vllm(monkeypatch)
    impl, layer = _impl_and_layer(tqa, monkeypatch, preset)
    original = tqa.TurboQuantAttentionImpl._continuation_prefill.__wrapped__
    profile_len, q_len = 256, 129
    cached_len = 16 * profile_len
    case = _case(layer, preset, cached_len, q_len, _layout(tqa))
    call_args = (layer, case.query, case.key_chunk, case.val_chunk, case.kv_cache, case.block_table, cached_len,
                 cached_len + q_len, layer._tq_Pi, layer._tq_centroids)
    if not hasattr(tqa, "current_workspace_manager"):  # 0.20.x: per-layer buffers, replaced by a shared one
        out = impl._continuation_prefill(*call_args)
        assert not hasattr(layer, "_tq_k_dequant_buf") and not hasattr(layer, "_tq_v_dequant_buf")
        _check_answer(out, case)
        return
    from vllm.v1.worker import workspace
    from tq_chunked import workspace_bytes
    workspace.init_workspace_manager(torch.device("cpu"))
    manager = workspace.current_workspace_manager()
    # What an engine's start leaves: the K/V pair a short (256-token) profile would
    # have asked of the unpatched method, and the plugin's window workspace, which its
    # builder hook reserves for max_num_batched_tokens queries (here: q_len).
    manager.get_simultaneous(((1, 2, profile_len, 64), torch.float16), ((1, 2, profile_len, 64), torch.float16))
    manager.get_simultaneous(((workspace_bytes(q_len, 4, 2, 64, WINDOW, torch.float16),), torch.uint8))
    workspace.lock_workspace()
    # Without a GPU driver vLLM hands its modules a Triton placeholder; the unpatched
    # method computes triton.next_power_of_2 before it asks the manager for buffers.
    import triton
    monkeypatch.setattr(tqa, "triton", triton)
    try:
        with pytest.raises(AssertionError, match="Workspace is locked but allocation"):
            original(impl, *call_args)
        out = impl._continuation_prefill(*call_args)  # 16x the context the locked workspace could hold
    finally:
        workspace.reset_workspace_manager()
    _check_answer(out, case)


@needs_vllm
def test_reservation_keeps_decode_buffers_and_drops_the_max_model_len_pair(monkeypatch):
    tqa = _patched_vllm(monkeypatch)
    builder_cls = tqa.TurboQuantMetadataBuilder
    if not hasattr(builder_cls, "_reserve_workspace"):
        pytest.skip("this vLLM reserves no continuation workspace")
    from vllm.v1.worker import workspace
    from tq_chunked.vllm_plugin import builder_workspace_bytes
    # A builder's state as its real __init__ leaves it (plain config values, see above).
    fake_builder = types.SimpleNamespace(vllm_config=_plain_config(max_model_len=1 << 20, num_heads=32),
                                         kv_cache_spec=types.SimpleNamespace(num_kv_heads=8, head_size=128,
                                                                             block_size=16))
    sizes = {}
    for name, method in (("vllm", builder_cls._reserve_workspace.__wrapped__),
                         ("plugin", builder_cls._reserve_workspace)):
        workspace.init_workspace_manager(torch.device("cpu"))
        method(fake_builder)
        sizes[name] = workspace.current_workspace_manager()._workspace_size_bytes(
            workspace.current_workspace_manager()._current_workspaces[0])
        workspace.reset_workspace_manager()
    pair = 2 * 8 * (1 << 20) * 128 * 2  # two (1, Hk, max_model_len, D) fp16 buffers: 4 GiB
    assert sizes["vllm"] >= pair
    assert 0 < sizes["plugin"] < 16 << 20  # the decode scratch alone
    window, nbytes = builder_workspace_bytes(fake_builder, None)  # the default window
    assert nbytes < 256 << 20 and window % 16 == 0
