"""Which layers get tq_chunked's workspace and which keep vLLM's continuation pair
(``vllm_backend.reaches_here`` / ``runs_windowed``), on plain classes standing for
TurboQuantAttentionImpl and its subclasses; the real classes are in
test_vllm_plugin.py (UltraQuant) and in vLLM's own tests (test_vllm_upstream.py)."""

import pytest

from tq_chunked.runtime.vllm_backend import PREFILL_METHODS, reaches_here, runs_windowed


class Impl:  # stands for vLLM's TurboQuantAttentionImpl, as patched or vendored
    def _prefill_attention(self):
        return "windowed"

    def _continuation_prefill(self):
        return "windowed"


class OwnPrefill(Impl):  # UltraQuant's shape: a prefill of its own, no workspace
    def _prefill_attention(self):
        return "own"


class OwnContinuation(Impl):  # inherits the batched prefill: needs the workspace
    def _continuation_prefill(self):
        return "own"


class StructOfArrays(Impl):  # AMD's layout: vLLM's own path serves it
    _soa_store = True


class Other:
    pass


@pytest.mark.parametrize(
    ("cls", "reaches", "windowed"),
    [
        (Impl, True, True),
        (OwnPrefill, False, False),
        (OwnContinuation, True, False),
        (StructOfArrays, False, False),
        (Other, False, False),
    ],
)
def test_workspace_wherever_the_windowed_prefill_can_run(cls, reaches, windowed):
    assert set(PREFILL_METHODS) == {"_prefill_attention", "_continuation_prefill"}
    impl = cls()
    assert reaches_here(impl, Impl) is reaches
    assert runs_windowed(impl, Impl) is windowed
    # Never the pair dropped where the workspace is not reserved.
    assert not (windowed and not reaches)


def test_a_missing_layer_is_not_served():
    assert reaches_here(None, Impl) is False
    assert runs_windowed(None, Impl) is False
