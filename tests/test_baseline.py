"""tq_chunked.tools.baseline: vLLM's prefill as installed, or another release's
compiled into the installed runtime (``tq-chunked bench --baseline-source``).

Two parts. Without vLLM: the compiler on a small stand-in source and a stand-in
installed module (which methods are taken, where each name comes from, what is
refused). Inside each vLLM install of ``.vllm-envs/`` (tests/install_vllm_cpu.sh; this
file re-runs itself there, as tests/test_vllm_plugin.py does): the newest installed
release's own turboquant_attn.py (0.34.0 in CI) loaded into every installed release, and
its ``_prefill_attention`` run on first chunks, the part of it a CPU can run (its
continuation path needs vLLM's Triton kernels, which vLLM disables without a GPU
driver; the GPU runs of ``tq-chunked bench`` run it whole).
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import math
import os
import subprocess
import types

import pytest
import torch

from tq_chunked.tools import baseline
from tq_chunked.tools.baseline import BaselineError
from tq_chunked.tools.vllm_harness import vllm_envs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_VLLM = importlib.util.find_spec("vllm") is not None
ENVS = list(vllm_envs(ROOT).values())
# The newest installed release's turboquant_attn.py: the source compiled into every
# installed release (the benchmarks' "latest" baseline is such a source).
NEWEST = list(vllm_envs(ROOT))[-1:]
SOURCE_NEWEST = [
    p
    for name in NEWEST
    for p in glob.glob(
        os.path.join(
            ROOT,
            ".vllm-envs",
            name,
            "lib",
            "python*",
            "site-packages",
            "vllm",
            "v1",
            "attention",
            "backends",
            "turboquant_attn.py",
        )
    )
]
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed in this environment"
)

# --- the compiler, on stand-ins -------------------------------------------------------

SOURCE = """
import math
from os.path import join as pjoin, no_such_name
from not_a_module import gone
if FLAG:
    from not_a_module import optional
THRESHOLD = 3

def helper(x):
    return x * THRESHOLD + SCALE

SCALE = math.sqrt(4)

class TurboQuantAttentionImpl(Base):
    def _prefill_attention(self, q: Missing, layer=None) -> Missing:
        return self._continuation_prefill(q) + helper(1)

    def _continuation_prefill(self, q):
        return q + self._new_helper() + (optional if FLAG else 0)

    def _new_helper(self):
        return THRESHOLD

    def forward(self):
        return gone

    def uses_gone(self):
        return gone
"""


class Installed:
    """The installed class the stand-in source is compiled against."""

    def _prefill_attention(self, q, layer=None):
        return "installed"

    def _continuation_prefill(self, q):
        return "installed"

    def forward(self):
        return "installed"


def stand_in_layer():
    return types.SimpleNamespace(_tq_Pi=torch.eye(2))


def compile_stand_in(source=SOURCE):
    namespace = {"__name__": "installed_module", "math": math}
    namespace.update(THRESHOLD=100, FLAG=False, Base=object)
    return baseline._compile_methods(
        ast.parse(source), "stand_in.py", namespace, Installed
    )


def test_entry_methods_and_what_they_call_on_self_are_taken():
    methods, unbound = compile_stand_in()
    assert sorted(methods) == [
        "_continuation_prefill",
        "_new_helper",
        "_prefill_attention",
    ]  # forward and uses_gone are not reached from the entry methods
    assert unbound == ("optional",)  # only under `if FLAG:`, and FLAG is False here
    impl = Installed()
    baseline.Baseline("0.0", "stand_in.py", "0" * 64, methods).attach(
        impl, stand_in_layer(), "cpu"
    )
    # the source's THRESHOLD (3, not the installed 100), its helper and SCALE
    assert impl._prefill_attention(10) == 10 + 3 + (1 * 3 + 2.0)
    assert Installed()._prefill_attention(10) == "installed"  # the class is untouched


def test_an_unconditional_name_that_does_not_resolve_is_named():
    source = SOURCE.replace("return q + self._new_helper()", "return gone + q")
    with pytest.raises(BaselineError, match=r"gone \(line 4: ModuleNotFoundError"):
        compile_stand_in(source)


def test_an_import_resolves_name_by_name():
    """`from os.path import join as pjoin, no_such_name`: pjoin resolves though the
    statement's other name does not exist."""
    source = SOURCE.replace("return THRESHOLD", "return len(pjoin('a', 'b'))")
    methods, _ = compile_stand_in(source)
    impl = Installed()
    baseline.Baseline("0.0", "s", "0" * 64, methods).attach(
        impl, stand_in_layer(), "cpu"
    )
    assert impl._continuation_prefill(0) == 3


@pytest.mark.parametrize(
    "change, match",
    [
        (
            ("_continuation_prefill(self, q)", "_continuation_prefill(self, x)"),
            (
                r"_continuation_prefill takes \(self, x\), the installed vLLM's takes "
                r"\(self, q\)"
            ),
        ),
        (
            ("return THRESHOLD", "return super().x"),
            r"_new_helper calls super\(\)",
        ),
        (("class TurboQuantAttentionImpl", "class Other"), "no class"),
        (("def _continuation_prefill", "def _renamed"), "has no _continuation_prefill"),
    ],
    ids=["signature", "super", "no class", "no method"],
)
def test_sources_that_cannot_run_the_installed_way_are_refused(change, match):
    with pytest.raises(BaselineError, match=match):
        compile_stand_in(SOURCE.replace(*change))


@pytest.mark.parametrize(
    "text, match",
    [(None, "cannot read it"), ("def f(:\n", "not Python"), ("x = 1\n", "no class")],
    ids=["missing", "not python", "not vllm's file"],
)
def test_a_bad_source_file_is_named_before_vllm_is_imported(tmp_path, text, match):
    path = tmp_path / "turboquant_attn.py"
    if text is not None:
        path.write_text(text)
    with pytest.raises(BaselineError, match=f"baseline source {path}: {match}"):
        baseline.load(path)


# --- from an environment without vLLM: run this file in each vLLM environment ---------


@pytest.mark.skipif(
    HAS_VLLM, reason="this environment has vLLM: its tests run directly"
)
@pytest.mark.parametrize(
    "python", ENVS or [None], ids=lambda p: p and p.split(os.sep)[-3]
)
def test_baseline_in_each_vllm_install(python):
    if python is None:
        pytest.skip(
            "no .vllm-envs/: run tests/install_vllm_cpu.sh to test against real vLLM"
        )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    r = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0, f"baseline tests failed under {python}"


# --- inside a vLLM environment --------------------------------------------------------


@needs_vllm
def test_the_default_baseline_is_the_installed_release():
    import vllm

    b = baseline.load()
    assert b.methods == {} and b.source is None
    assert b.describe() == f"vLLM {vllm.__version__}'s own methods, as installed"


def _source_newest():
    if not SOURCE_NEWEST:
        pytest.skip("no .vllm-envs/: the newest one's turboquant_attn.py is the source")
    return SOURCE_NEWEST[0]


@needs_vllm
def test_a_release_source_resolves_in_the_installed_runtime():
    import vllm.v1.attention.backends.turboquant_attn as tqa
    from vllm.v1.worker import workspace

    source = _source_newest()
    b = baseline.load(source)
    assert set(baseline.ENTRY_METHODS) <= set(b.methods)
    for name, function in b.methods.items():
        assert function.__code__.co_filename == source
        assert getattr(tqa.TurboQuantAttentionImpl, name, None) is not function
    g = b.methods["_continuation_prefill"].__globals__
    assert g["current_workspace_manager"] is workspace.current_workspace_manager
    assert g["__name__"] == tqa.__name__  # the installed module's imports
    # FlashAttention is not importable on a CPU: unbound, as in vLLM's own module here
    assert b.unbound == ("flash_attn_varlen_func",)
    assert "unbound here" in b.describe() and source in b.describe()


@needs_vllm
def test_a_release_source_answers_first_chunks_in_the_installed_runtime(monkeypatch):
    """The newest release's _prefill_attention on a batch of first chunks (its
    per-request loop, PyTorch attention without FlashAttention) against the float64
    oracle."""
    import vllm.v1.attention.backends.turboquant_attn as tqa
    from test_vllm_plugin import _impl_and_layer, _metadata, _plain_config
    from vllm.v1.worker import workspace

    from tq_chunked.tools.reference import oracle_continuation_prefill
    from tq_chunked.tools.testing import make_batch, rel_err

    monkeypatch.setattr(tqa, "get_current_vllm_config", lambda: _plain_config())
    monkeypatch.setattr(tqa, "get_flash_attn_version", lambda *a, **k: None)
    b = baseline.load(_source_newest())
    impl, layer = _impl_and_layer(tqa, "turboquant_k8v4")
    hq, hk, d = impl.num_heads, impl.num_kv_heads, impl.head_size
    batch = make_batch(
        [(0, 24), (0, 40)],
        "turboquant_k8v4",
        head_dim=d,
        num_q_heads=hq,
        num_kv_heads=hk,
        device="cpu",
        seed=31,
    )
    meta = _metadata(tqa, batch)
    # Host copies of the lengths, which releases from 0.21 keep and the newest method
    # reads (bench_engine.Layers.metadata sets them the same way on 0.20).
    meta.query_start_loc_cpu = torch.tensor(batch.query_start_loc, dtype=torch.int32)
    meta.seq_lens_cpu = torch.tensor(batch.seq_lens, dtype=torch.int32)
    try:
        b.attach(impl, layer, "cpu")
        assert impl._soa_store is False and layer._tq_Pi_half.dtype == torch.float16
        out = impl._prefill_attention(
            batch.query,
            batch.key,
            batch.value,
            batch.kv_cache,
            meta,
            layer._tq_Pi,
            layer._tq_centroids,
            layer._tq_PiT,
            layer,
        )
    finally:
        workspace.reset_workspace_manager()
    for r in range(2):
        q0, q1 = batch.query_start_loc[r], batch.query_start_loc[r + 1]
        oracle = oracle_continuation_prefill(*batch.request(r), **batch.kwargs)
        assert rel_err(out[q0:q1], oracle) < 2e-3
