"""continuation_prefill, the one-request form: exact against the full-buffer path at
every served head size and block size, both cache layouts, window edges; clear
errors."""

import pytest
import torch
from conftest import DEVICE, TRITON_OK

from tq_chunked import PRESETS, continuation_prefill, workspace_bytes
from tq_chunked.runtime.format import MAX_HEAD_DIM
from tq_chunked.tools.reference import (
    full_buffer_continuation_prefill,
    oracle_continuation_prefill,
)
from tq_chunked.tools.testing import make_case, rel_err

BACKEND = "triton" if TRITON_OK else "torch"


def check_exact(case, window, backend=BACKEND):
    """‖chunked − oracle‖ ≤ 1.1 ‖full − oracle‖ + 1e-4, relative; the cache
    untouched."""
    cache_before = case.kv_cache.clone()
    lq, hq, d = case.query.shape
    hk = case.key_chunk.shape[1]
    nbytes = workspace_bytes(lq, hq, hk, d, window, case.query.dtype)
    # NaN everywhere
    ws = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=case.query.device)
    out = continuation_prefill(
        *case.args, **case.kwargs, window=window, workspace=ws, backend=backend
    )
    full = full_buffer_continuation_prefill(*case.args, **case.kwargs, backend="torch")
    oracle = oracle_continuation_prefill(*case.args, **case.kwargs)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    e_chunked, e_full = rel_err(out, oracle), rel_err(full, oracle)
    assert e_chunked <= 1.1 * e_full + 1e-4, (e_chunked, e_full)
    assert torch.equal(case.kv_cache, cache_before)


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_preset_and_dtype(preset, dtype):
    check_exact(make_case(preset, dtype, cached_len=300, q_len=129, seed=1), window=64)


# Every head size vLLM's TurboQuant serves: MSE keys at powers of two, fp8 keys at any
# multiple of 8 (format.py), up to FlashAttention's 256.
SERVED = [
    (p, d)
    for p in PRESETS
    for d in (64, 80, 96, 112, 128, 192, 256)
    if PRESETS[p][0] == 8 or d & (d - 1) == 0
]


@pytest.mark.parametrize("preset,head_dim", SERVED)
def test_every_served_head_size(preset, head_dim):
    check_exact(
        make_case(
            preset,
            head_dim=head_dim,
            num_q_heads=2,
            num_kv_heads=1,
            cached_len=150,
            q_len=40,
            seed=head_dim,
        ),
        window=64,
    )


@pytest.mark.parametrize(
    "preset,head_dim",
    [
        ("turboquant_3bit_nc", 96),
        ("turboquant_4bit_nc", 80),
        ("turboquant_k8v4", 100),
        ("turboquant_k8v4", 8),
        ("turboquant_k8v4", MAX_HEAD_DIM + 8),
    ],
)
def test_unserved_head_sizes_are_refused(preset, head_dim):
    case = make_case("turboquant_k8v4", head_dim=64, cached_len=100, q_len=20, seed=2)
    q = (
        torch.randn(20, 4, head_dim, generator=torch.Generator().manual_seed(3))
        .half()
        .to(DEVICE)
    )
    with pytest.raises(ValueError, match="head_dim"):
        continuation_prefill(
            q,
            q[:, :2],
            q[:, :2],
            case.kv_cache,
            case.block_table,
            100,
            preset=preset,
            centroids=None,
            rotation=None,
            scale=0.1,
        )


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("layout", ["v020", "v033"])
def test_block_sizes_and_both_layouts(block_size, layout):
    check_exact(
        make_case(
            "turboquant_4bit_nc",
            block_size=block_size,
            layout=layout,
            cached_len=333,
            q_len=40,
            seed=block_size,
        ),
        window=block_size * 2,
    )


@pytest.mark.parametrize(
    "cached_len,q_len,window",
    [
        # window of one block; cached_len not a multiple of block_size nor of window
        (250, 40, 16),
        (100, 40, 4096),  # window larger than cached_len
        (300, 129, 128),  # q_len longer than the window
        (0, 40, 64),  # nothing cached: the chunk alone
        (37, 40, 1),  # one token per window
    ],
)
def test_window_edges(cached_len, q_len, window):
    check_exact(
        make_case("turboquant_k8v4", cached_len=cached_len, q_len=q_len, seed=4),
        window=window,
    )


def test_bad_one_request_arguments_are_named():
    case = make_case(cached_len=100, q_len=20, seed=5)
    q, k, v, cache, bt, cached = case.args
    for kwargs, match in [
        (dict(cached_len=-1), "cached_len must be >= 0"),
        (dict(cached_len=1.5), "cached_len must be an int"),
        (dict(cached_len=bt.shape[-1] * 16 + 1), "block_table has columns"),
        (dict(block_table=bt.repeat(2, 1)), "block_table must be a"),
        (dict(key_chunk=k[:, :, :32]), "key_chunk must have shape"),
        (dict(val_chunk=v[:-1]), "val_chunk"),
    ]:
        args = dict(
            query=q,
            key_chunk=k,
            val_chunk=v,
            kv_cache=cache,
            block_table=bt,
            cached_len=cached,
        )
        args.update(kwargs)
        with pytest.raises(ValueError, match=match):
            continuation_prefill(*args.values(), **case.kwargs, backend=BACKEND)
