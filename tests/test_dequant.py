"""The window dequant kernel is bit-identical to the reference decoder."""

import pytest
import torch

from tq_chunked.dequant import dequantize_window
from tq_chunked.format import PRESETS, TQConfig, dequantize_reference

from conftest import TRITON_OK, make_case

pytestmark = pytest.mark.skipif(not TRITON_OK, reason="Triton needs a GPU or TRITON_INTERPRET=1")


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("head_dim,block_size,layout", [(64, 16, "v020"), (128, 32, "v033"), (256, 64, "v020"),
                                                         (64, 128, "v033")])
def test_window_dequant_is_bit_identical_to_reference(preset, head_dim, block_size, layout):
    case = make_case(preset, head_dim=head_dim, block_size=block_size, cached_len=200, q_len=1, layout=layout)
    cfg = TQConfig.from_preset(preset, head_dim)
    bt = case.block_table.reshape(-1)
    start, length, hk = 37, 150, case.kv_cache.shape[2]  # not block-aligned
    k_out = torch.full((hk, 160, head_dim), float("nan"), dtype=torch.float16, device=case.query.device)
    v_out = torch.full_like(k_out, float("nan"))
    cache_before = case.kv_cache.clone()
    dequantize_window(case.kv_cache, bt, start, length, cfg, case.kwargs["centroids"], k_out, v_out)
    k_ref, v_ref = dequantize_reference(case.kv_cache, bt, start, length, cfg, case.kwargs["centroids"])
    assert torch.equal(k_out[:, :length], k_ref.half())
    assert torch.equal(v_out[:, :length], v_ref.half())
    assert k_out[:, length:].isnan().all() and v_out[:, length:].isnan().all()  # nothing past the window
    assert torch.equal(case.kv_cache, cache_before)
