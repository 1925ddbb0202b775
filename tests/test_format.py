"""The cache format: slot sizes, bit streams, centroids, and the encode/decode round
trip."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_chunked.runtime.format import (
    PRESETS,
    TQConfig,
    dequantize_reference,
    encode_reference,
    hadamard,
    lloyd_max_centroids,
    pack_bits,
    unpack_bits,
)


@pytest.mark.parametrize(
    "preset,slot",
    [
        ("turboquant_k8v4", 196),
        ("turboquant_4bit_nc", 134),
        ("turboquant_k3v4_nc", 118),
        ("turboquant_3bit_nc", 102),
    ],
)
def test_slot_bytes_at_d128_match_vllm(preset, slot):
    assert TQConfig.from_preset(preset, 128).slot_bytes == slot


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    bits=st.sampled_from([3, 4]),
    d=st.sampled_from([8, 16, 64, 128, 256]),
    seed=st.integers(0, 2**31),
)
def test_pack_unpack_round_trip(bits, d, seed):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 2**bits, (5, d), generator=gen)
    packed = pack_bits(idx, bits)
    assert packed.shape == (5, math.ceil(d * bits / 8))
    assert torch.equal(unpack_bits(packed, bits, d), idx)


def test_pack_is_little_endian_bit_stream():
    # indices 1..8 at 3 bits: bit stream 100 010 110 001 101 011 111 000 (LSB first)
    packed = pack_bits(torch.tensor([1, 2, 3, 4, 5, 6, 7, 0]), 3)
    value = int.from_bytes(bytes(packed.tolist()), "little")
    assert [(value >> (3 * i)) & 7 for i in range(8)] == [1, 2, 3, 4, 5, 6, 7, 0]


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("d", [64, 128])
def test_lloyd_max_centroids_satisfy_the_optimality_conditions(bits, d):
    c = lloyd_max_centroids(d, bits).double()
    assert torch.all(c[1:] > c[:-1]) and torch.allclose(c, -c.flip(0), atol=1e-7)
    # Each centroid is the mean of N(0, 1/d) over its cell (fine quadrature, independent
    # of the solver's closed form).
    sigma = 1 / math.sqrt(d)
    x = torch.linspace(-9 * sigma, 9 * sigma, 2_000_001, dtype=torch.float64)
    w = torch.exp(-0.5 * (x / sigma) ** 2)
    cell = torch.bucketize(x, (c[1:] + c[:-1]) / 2)
    means = torch.stack(
        [(x * w)[cell == i].sum() / w[cell == i].sum() for i in range(2**bits)]
    )
    assert torch.allclose(means, c, rtol=0, atol=1e-5 * sigma)


def test_hadamard_is_orthonormal_and_symmetric():
    h = hadamard(128).double()
    assert torch.allclose(h @ h.T, torch.eye(128, dtype=torch.float64), atol=1e-6)
    assert torch.equal(h, h.T)


def test_a_caller_writing_into_the_rotation_or_centroids_changes_no_later_call():
    h, c = hadamard(64), lloyd_max_centroids(64, 3)
    h_first, c_first = h.clone(), c.clone()
    h.fill_(7.0)
    c.fill_(7.0)
    assert torch.equal(hadamard(64), h_first)
    assert torch.equal(lloyd_max_centroids(64, 3), c_first)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_round_trip_error_is_that_of_the_quantizer(preset):
    cfg = TQConfig.from_preset(preset, 128)
    centroids = lloyd_max_centroids(128, cfg.centroid_bits)
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(64, 2, 128, generator=gen)
    val = torch.randn(64, 2, 128, generator=gen)
    cache = torch.randint(
        0, 256, (4, 16, 2, cfg.slot_bytes), dtype=torch.uint8, generator=gen
    )
    encode_reference(key, val, cache, torch.arange(64), cfg, centroids, hadamard(128))
    k, v = dequantize_reference(
        cache, torch.arange(4, dtype=torch.int32), 0, 64, cfg, centroids
    )
    assert k.shape == (2, 64, 128) and v.shape == (2, 64, 128)
    # un-rotate
    k = k.transpose(0, 1) if cfg.key_fp8 else (k @ hadamard(128)).transpose(0, 1)
    key_bound = {8: 0.05, 4: 0.12, 3: 0.22}[cfg.key_bits]
    value_bound = {4: 0.12, 3: 0.25}[cfg.value_bits]
    assert ((k - key).norm() / key.norm()).item() < key_bound
    assert ((v.transpose(0, 1) - val).norm() / val.norm()).item() < value_bound


@pytest.mark.parametrize(
    "preset,head_dim",
    [
        ("turboquant_3bit_nc", 96),
        ("turboquant_k8v4", 100),
        ("turboquant_k8v4", 8),
        ("turboquant_4bit_nc", 512),
    ],
)
def test_config_refuses_head_sizes_vllm_does_not_serve(preset, head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        TQConfig.from_preset(preset, head_dim)


def test_fp8_keys_take_any_multiple_of_8():
    assert TQConfig.from_preset("turboquant_k8v4", 96).slot_bytes == 96 + 48 + 4
