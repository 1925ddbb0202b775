"""continuation_prefill: exact against the full-buffer path, flat memory, clear errors."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from tq_chunked import PRESETS, continuation_prefill, workspace_bytes
from tq_chunked.reference import full_buffer_continuation_prefill, oracle_continuation_prefill

from conftest import DEVICE, TRITON_OK, make_case, rel_err

BACKEND = "triton" if TRITON_OK else "torch"


def check_exact(case, window, backend=BACKEND):
    """‖chunked − oracle‖ ≤ 1.1 ‖full − oracle‖ + 1e-4, relative; the cache is untouched."""
    cache_before = case.kv_cache.clone()
    nbytes = workspace_bytes(case.query.shape[0], case.query.shape[1], case.key_chunk.shape[1],
                             case.query.shape[2], window, case.query.dtype)
    workspace = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=case.query.device)  # NaN everywhere
    out = continuation_prefill(*case.args, **case.kwargs, window=window, workspace=workspace, backend=backend)
    full = full_buffer_continuation_prefill(*case.args, **case.kwargs, backend="torch")
    oracle = oracle_continuation_prefill(*case.args, **case.kwargs)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    e_chunked, e_full = rel_err(out, oracle), rel_err(full, oracle)
    assert e_chunked <= 1.1 * e_full + 1e-4, (e_chunked, e_full)
    assert torch.equal(case.kv_cache, cache_before)
    return e_chunked, e_full


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_preset_and_dtype(preset, dtype):
    check_exact(make_case(preset, dtype, cached_len=300, q_len=129), window=64)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa_groups(group):
    check_exact(make_case(num_q_heads=2 * group, num_kv_heads=2, cached_len=200, q_len=130), window=96)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims(head_dim):
    check_exact(make_case("turboquant_k3v4_nc", head_dim=head_dim, num_q_heads=2, num_kv_heads=1, cached_len=150,
                          q_len=129), window=64)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_block_sizes_and_both_layouts(block_size):
    for layout in ("v020", "v033"):
        check_exact(make_case("turboquant_4bit_nc", block_size=block_size, layout=layout, cached_len=333,
                              q_len=129), window=block_size * 2)


@pytest.mark.parametrize("cached_len,q_len,window", [
    (250, 129, 16),   # window of one block; cached_len not a multiple of block_size nor of window
    (100, 129, 4096),  # window larger than cached_len
    (300, 200, 128),  # q_len longer than the window
    (0, 129, 64),     # nothing cached: the chunk alone
])
def test_window_edges(cached_len, q_len, window):
    check_exact(make_case("turboquant_k8v4", cached_len=cached_len, q_len=q_len), window=window)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(preset=st.sampled_from(list(PRESETS)), dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       group=st.sampled_from([1, 2, 4, 8]), head_dim=st.sampled_from([64, 128]),
       block_size=st.sampled_from([16, 32, 64, 128]), layout=st.sampled_from(["v020", "v033"]),
       cached_len=st.integers(1, 400), q_len=st.integers(129, 160), blocks_per_window=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1))
def test_hypothesis_over_all_axes(preset, dtype, group, head_dim, block_size, layout, cached_len, q_len,
                                  blocks_per_window, seed):
    case = make_case(preset, dtype, head_dim=head_dim, num_q_heads=group, num_kv_heads=1, block_size=block_size,
                     cached_len=cached_len, q_len=q_len, layout=layout, seed=seed)
    check_exact(case, window=block_size * blocks_per_window)


def test_return_lse_matches_float64():
    case = make_case(cached_len=200, q_len=129)
    out, lse = continuation_prefill(*case.args, **case.kwargs, window=64, backend=BACKEND, return_lse=True)
    q = case.query.double()
    from tq_chunked.format import TQConfig, dequantize_reference
    k, _ = dequantize_reference(case.kv_cache, case.block_table, 0, 200, TQConfig.from_preset(case.kwargs["preset"], 64),
                                case.kwargs["centroids"])
    k = torch.cat([k.double() @ case.kwargs["rotation"].double(), case.key_chunk.transpose(0, 1).double()], 1)
    s = torch.einsum("lhd,hkd->hlk", q, k.repeat_interleave(2, 0)) * case.kwargs["scale"]
    s = s.masked_fill(torch.arange(329, device=s.device)[None, None] > torch.arange(129, device=s.device)[None, :, None] + 200,
                      float("-inf"))
    assert lse.shape == (4, 129) and rel_err(lse, torch.logsumexp(s, -1)) < 1e-3


# --- memory contract -------------------------------------------------------------------

def test_workspace_bytes_is_independent_of_cached_len_and_exact():
    assert workspace_bytes(2048, 32, 8, 128, 8192, torch.float16) == workspace_bytes(2048, 32, 8, 128, 8192,
                                                                                      torch.bfloat16)
    case_small = make_case(cached_len=64, q_len=129)
    case_large = make_case(cached_len=640, q_len=129)
    need = workspace_bytes(129, 4, 2, 64, 64, torch.float16)
    for case in (case_small, case_large):  # exactly `need` bytes suffice at any cached_len
        ws = torch.empty(need, dtype=torch.uint8, device=DEVICE)
        continuation_prefill(*case.args, **case.kwargs, window=64, workspace=ws, backend=BACKEND)
    with pytest.raises(ValueError, match="workspace"):
        continuation_prefill(*case_large.args, **case_large.kwargs, window=64,
                             workspace=torch.empty(need - 1, dtype=torch.uint8, device=DEVICE), backend=BACKEND)


# --- bad input -------------------------------------------------------------------------

def _bad(case, match, **override):
    args = dict(zip(["query", "key_chunk", "val_chunk", "kv_cache", "block_table", "cached_len"], case.args))
    kwargs = dict(case.kwargs, backend=BACKEND, window=64)
    for k, v in override.items():
        (args if k in args else kwargs)[k] = v
    before = case.kv_cache.clone()
    with pytest.raises(ValueError, match=match):
        continuation_prefill(*args.values(), **kwargs)
    assert torch.equal(case.kv_cache, before)


def test_bad_inputs_raise_value_errors_naming_the_argument():
    case = make_case(cached_len=100, q_len=129)
    _bad(case, "query.*dtype", query=case.query.float())
    _bad(case, "key_chunk.*dtype", key_chunk=case.key_chunk.float())
    _bad(case, "key_chunk.*shape", key_chunk=case.key_chunk[:, :, :32])
    _bad(case, "val_chunk", val_chunk=case.val_chunk[:-1])
    _bad(case, "multiple of key_chunk heads", query=case.query[:, :3])
    _bad(case, "kv_cache must have shape", kv_cache=case.kv_cache[..., :-2])
    _bad(case, "kv_cache.*dtype", kv_cache=case.kv_cache.view(torch.int8))
    _bad(case, "block_table.*dtype", block_table=case.block_table.long())
    _bad(case, "cached_len.*exceeds", cached_len=case.block_table.shape[-1] * 16 + 1)
    _bad(case, "cached_len", cached_len=-1)
    _bad(case, "window.*multiple of block_size", window=24)
    _bad(case, "centroids", centroids=case.kwargs["centroids"][:4])
    _bad(case, "rotation", rotation=case.kwargs["rotation"][:32])
    _bad(case, "scale", scale=0.0)
    _bad(case, "preset", preset="turboquant_2bit")
    _bad(case, "backend", backend="flashinfer")
    _bad(case, "workspace must hold", workspace=torch.empty(10, dtype=torch.uint8, device=DEVICE))


def test_head_dim_not_a_power_of_two_is_refused_for_mse_presets():
    case = make_case("turboquant_k8v4", head_dim=64, cached_len=100, q_len=129)
    q96 = torch.randn(129, 4, 96, device=DEVICE).half()
    with pytest.raises(ValueError, match="head_dim"):
        continuation_prefill(q96, q96[:, :2], q96[:, :2], case.kv_cache, case.block_table, 100,
                             preset="turboquant_3bit_nc", centroids=None, rotation=None, scale=0.1)
