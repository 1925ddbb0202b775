"""The prepare launch against float64: the query rotated and rounded once to fp16, the
state reset, the chunk's fp16 copies, for a head group inside strided inputs; every element
it owns written (outputs poisoned with NaN first)."""

import pytest
import torch

from tq_chunked.format import hadamard
from tq_chunked.prepare import prepare
from tq_chunked.workspace import Buffers

from conftest import DEVICE, TRITON_OK, random_rotation, strided

pytestmark = pytest.mark.skipif(not TRITON_OK, reason="the Triton kernel needs a GPU or TRITON_INTERPRET=1")

N, HQ, HK = 70, 8, 4  # a group of 4 query heads from 2 and 2 kv heads from 1: offsets are read


def _half_ulp_fp16(x: torch.Tensor) -> torch.Tensor:
    """Half the fp16 spacing at |x| (float64): the error of one rounding to nearest."""
    exponent = torch.frexp(x)[1].clamp(min=-13)  # fp16 subnormals: spacing 2^-24
    return torch.ldexp(torch.full_like(x, 0.5), exponent - 11)


def _random(shape, dtype, gen):
    """Random values (seeded) with stride 2 along D: read through their strides."""
    return strided((torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(DEVICE, dtype))


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rotation_kind", ["hadamard", "random-float32", "random-bfloat16"])
def test_rotated_query_is_the_float64_product_rounded_once(dtype, d, rotation_kind):
    seed = d + 7 * (dtype == torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    query, key, value = (_random((N, h, d), dtype, gen) for h in (HQ, HK, HK))
    if rotation_kind == "hadamard":
        rotation = hadamard(d)
    else:
        rotation = random_rotation(d, gen).to(getattr(torch, rotation_kind.split("-")[1]))
    rotation = rotation.to(DEVICE).T.contiguous().T  # column-major: read through its strides
    q0, kv0, hq_g, hk_g = 2, 1, 4, 2
    chunk16 = dtype == torch.bfloat16
    bufs = Buffers(k_buf=_poisoned((1, hk_g, d), torch.float16),  # sets the kv head group only
                   q_buf=_poisoned((N, hq_g, d), torch.float16), state_lse=_poisoned((hq_g, N), torch.float32),
                   q16=_poisoned((N, hq_g, d), torch.float16), k16=_poisoned((N, hk_g, d), torch.float16),
                   v16=_poisoned((N, hk_g, d), torch.float16))

    prepare(query, key, value, rotation, q0, kv0, bufs, init_lse=True, chunk16=chunk16)

    q = query[:, q0:q0 + hq_g].double()
    ref = q @ rotation.double().T
    terms = q.abs() @ rotation.double().abs().T  # the scale of the sum's rounding errors
    err = (bufs.q_buf.double() - ref).abs().cpu()
    # One rounding to fp16 after a float32-accurate sum of D <= 256 products (its error well
    # under 2^-18 of the terms' magnitude); a rotation rounded to fp16 is off by about 2^-12.
    bound = (_half_ulp_fp16(ref) + terms * 2.0**-18).cpu()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"seed {seed}: q_buf off the float64 product by {worst:.3f} x (half an fp16 ulp + 2^-18)"
    assert torch.isneginf(bufs.state_lse).all()
    if chunk16:
        assert torch.equal(bufs.q16, query[:, q0:q0 + hq_g].half())
        assert torch.equal(bufs.k16, key[:, kv0:kv0 + hk_g].half())
        assert torch.equal(bufs.v16, value[:, kv0:kv0 + hk_g].half())
    else:
        assert bufs.q16.isnan().all() and bufs.k16.isnan().all()  # not asked for: not written


def test_without_rotation_the_query_is_converted_only():
    gen = torch.Generator().manual_seed(3)
    query, key, value = (_random((N, h, 128), torch.bfloat16, gen) for h in (HQ, HK, HK))
    bufs = Buffers(k_buf=_poisoned((1, HK, 128), torch.float16), q_buf=_poisoned((N, HQ, 128), torch.float16),
                   state_lse=_poisoned((HQ, N), torch.float32))
    prepare(query, key, value, None, 0, 0, bufs, init_lse=False, chunk16=False)
    assert torch.equal(bufs.q_buf, query.half())
    assert bufs.state_lse.isnan().all()  # init_lse=False: the state is not touched
