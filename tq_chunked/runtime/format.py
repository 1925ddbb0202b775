"""The TurboQuant KV-cache format: presets, slot layout, rotation, centroids,
and plain-PyTorch reference encode/decode.

A cache is a uint8 tensor of shape (num_blocks, block_size, Hk, slot_bytes), any
strides. Each (block, position, kv head) slot holds ``[key | value | pad to even]``:

* key, MSE presets: ``ceil(D * key_bits / 8)`` bytes of Lloyd-Max centroid indices
  packed little-endian as one bit stream (index d starts at bit ``d * key_bits``),
  then the key's L2 norm as fp16. The indices quantize the *rotated* unit key
  ``(k / |k|) @ rotation^T``; ``rotation`` is a normalized Sylvester Hadamard matrix.
* key, FP8 preset (k8v4): D bytes of float8 e4m3 (e4b15 on GPUs below SM 8.9), not
  rotated.
* value: ``ceil(D * value_bits / 8)`` bytes of uniform indices packed the same way,
  then fp16 scale and fp16 zero; ``value = index * scale + zero``.

Decoding, MSE key: ``c = centroids[index]``; with ``norm_correction`` the centroid
vector is rescaled to unit length first; ``key_rotated = norm * c``. The encoder and
decoder here are the reference the Triton kernel (``dequant.py``) must match bit for
bit, and the format matches vLLM's ``turboquant_*`` cache byte for byte.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

# Head sizes vLLM's TurboQuant serves: its store kernel packs values in groups of 8
# dimensions, FlashAttention takes up to 256, and MSE keys need a Sylvester Hadamard
# rotation, which exists at powers of two only (fp8 keys are not rotated: 80, 96,
# 112, ...).
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256

PRESETS: dict[str, tuple[int, int, bool]] = {
    # name: (key_bits, value_bits, norm_correction); key_bits 8 means fp8 keys.
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}


@dataclass(frozen=True)
class TQConfig:
    """One TurboQuant cache format at one head size."""

    head_dim: int
    key_bits: int  # 3 or 4: Lloyd-Max indices; 8: fp8 keys
    value_bits: int  # 3 or 4
    norm_correction: bool

    def __post_init__(self):
        if self.key_bits not in (3, 4, 8):
            raise ValueError(f"key_bits must be 3, 4 or 8, got {self.key_bits}")
        if self.value_bits not in (3, 4):
            raise ValueError(f"value_bits must be 3 or 4, got {self.value_bits}")
        if not (MIN_HEAD_DIM <= self.head_dim <= MAX_HEAD_DIM) or self.head_dim % 8:
            raise ValueError(
                f"head_dim must be a multiple of 8 in "
                f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {self.head_dim}"
            )
        if not self.key_fp8 and self.head_dim & (self.head_dim - 1):
            raise ValueError(
                f"head_dim must be a power of two for MSE keys (vLLM's Hadamard "
                f"rotation), got {self.head_dim}"
            )

    @classmethod
    def from_preset(cls, preset: str, head_dim: int) -> TQConfig:
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
        key_bits, value_bits, norm_correction = PRESETS[preset]
        return cls(head_dim, key_bits, value_bits, norm_correction)

    @property
    def key_fp8(self) -> bool:
        return self.key_bits == 8

    @property
    def centroid_bits(self) -> int:
        """Bits of the centroid table vLLM builds (value bits for fp8-key presets)."""
        return self.value_bits if self.key_fp8 else self.key_bits

    # the byte counts: cached (a frozen config), since each layer's launches read them
    @functools.cached_property
    def key_index_bytes(self) -> int:
        return (
            self.head_dim
            if self.key_fp8
            else math.ceil(self.head_dim * self.key_bits / 8)
        )

    @functools.cached_property
    def key_bytes(self) -> int:
        return self.key_index_bytes + (0 if self.key_fp8 else 2)

    @functools.cached_property
    def value_index_bytes(self) -> int:
        return math.ceil(self.head_dim * self.value_bits / 8)

    @functools.cached_property
    def value_bytes(self) -> int:
        return self.value_index_bytes + 4

    @functools.cached_property
    def slot_bytes(self) -> int:
        s = self.key_bytes + self.value_bytes
        return s + (s % 2)


def resolve_config(preset: str | TQConfig, head_dim: int) -> TQConfig:
    if isinstance(preset, TQConfig):
        if preset.head_dim != head_dim:
            raise ValueError(
                f"preset.head_dim is {preset.head_dim} but the query has D={head_dim}"
            )
        return preset
    if not isinstance(preset, str):
        raise ValueError(
            f"preset must be one of {sorted(PRESETS)} or a TQConfig, got {preset!r}"
        )
    return _preset_config(preset, head_dim)


@functools.lru_cache(maxsize=64)
def _preset_config(preset: str, head_dim: int) -> TQConfig:
    return TQConfig.from_preset(preset, head_dim)


def hadamard(d: int) -> torch.Tensor:
    """(d, d) float32 normalized Sylvester Hadamard matrix: orthonormal and
    symmetric. A new tensor each call (a caller may write into it)."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"d must be a power of two, got {d}")
    return _hadamard(d).clone()


@functools.cache
def _hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).float()


def lloyd_max_centroids(d: int, bits: int, iters: int = 500) -> torch.Tensor:
    """Sorted float32 Lloyd-Max centroids of N(0, 1/d) with 2**bits levels, a new
    tensor each call (a caller may write into it).

    Uses the Gaussian's closed-form cell means, E[X | a < X < b] =
    sigma^2 (pdf(a) - pdf(b)) / (cdf(b) - cdf(a)). A cache written by vLLM must be
    read with the centroids it was written with (vLLM integrates numerically and
    lands about 1e-3 away from these): pass those, not these.
    """
    return torch.tensor(_lloyd_max(d, bits, iters), dtype=torch.float32)


@functools.cache
def _lloyd_max(d: int, bits: int, iters: int) -> tuple[float, ...]:
    sigma = 1.0 / math.sqrt(d)
    n = 2**bits
    pdf = lambda x: math.exp(-0.5 * (x / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))
    cdf = lambda x: 0.5 * (1.0 + math.erf(x / (sigma * math.sqrt(2.0))))
    c = [sigma * (-3.0 + 6.0 * (i + 0.5) / n) for i in range(n)]
    for _ in range(iters):
        edges = [-math.inf] + [(c[i] + c[i + 1]) / 2 for i in range(n - 1)] + [math.inf]
        pd = [0.0 if math.isinf(e) else pdf(e) for e in edges]
        c = [
            sigma**2 * (pd[i] - pd[i + 1]) / (cdf(edges[i + 1]) - cdf(edges[i]))
            for i in range(n)
        ]
    return tuple(c)


# ---------------------------------------------------------------------------
# Bit streams
# ---------------------------------------------------------------------------


def pack_bits(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., D) integer indices < 2**bits -> (..., ceil(D*bits/8)) uint8,
    little-endian stream."""
    d = idx.shape[-1]
    nbytes = math.ceil(d * bits / 8)
    weights = 2 ** torch.arange(bits, device=idx.device)  # (bits,)
    # (..., D*bits), bit 0 first
    stream = ((idx.long().unsqueeze(-1) // weights) % 2).flatten(-2)
    stream = torch.nn.functional.pad(stream, (0, nbytes * 8 - d * bits))
    byte_weights = 2 ** torch.arange(8, device=idx.device)
    return (stream.unflatten(-1, (nbytes, 8)) * byte_weights).sum(-1).to(torch.uint8)


def unpack_bits(data: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """(..., nbytes) uint8 -> (..., d) int64 indices; inverse of pack_bits."""
    start = torch.arange(d, device=data.device) * bits  # (d,) first bit of each index
    byte, shift = start // 8, start % 8
    lo = data[..., byte].long()
    hi = data[..., (byte + 1).clamp(max=data.shape[-1] - 1)].long()
    return ((lo | (hi << 8)) >> shift) & (2**bits - 1)


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _bytes_fp16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def decode_fp8_e4b15(b: torch.Tensor) -> torch.Tensor:
    """uint8 -> float32 for Triton's float8e4b15 (bias 15, no inf/nan)."""
    b = b.long()
    sign = 1.0 - 2.0 * ((b >> 7) & 1).float()
    exp = (b >> 3) & 0xF
    man = (b & 7).float()
    normal = (1.0 + man / 8) * torch.exp2(exp.float() - 15)
    subnormal = (man / 8) * 2.0**-14
    return sign * torch.where(exp == 0, subnormal, normal)


# ---------------------------------------------------------------------------
# Reference encoder (the cache writer) and decoder
# ---------------------------------------------------------------------------


def encode_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cfg: TQConfig,
    centroids: torch.Tensor,
    rotation: torch.Tensor | None = None,
) -> None:
    """Quantize key/value (N, Hk, D) and write them into kv_cache at slot_mapping (N,).

    slot = block * block_size + position; negative slots are skipped. Plain PyTorch.
    """
    n, hk, d = key.shape
    block_size = kv_cache.shape[1]
    keep = slot_mapping >= 0
    key, value, slots = key[keep], value[keep], slot_mapping[keep].long()
    if cfg.key_fp8:
        key_bytes = key.to(torch.float8_e4m3fn).view(torch.uint8)  # (N, Hk, D)
    else:
        rotation = hadamard(d).to(key.device) if rotation is None else rotation
        k = key.float().reshape(-1, d)
        norms = k.norm(dim=1, keepdim=True)
        # rotated unit keys (as vLLM: x @ PiT)
        y = (k / (norms + 1e-8)) @ rotation.float().T.contiguous()
        c = centroids.float().sort().values.to(key.device)
        midpoints = (c[:-1] + c[1:]) / 2
        idx = torch.bucketize(y, midpoints, right=True)  # count of midpoints <= y
        key_bytes = torch.cat(
            [pack_bits(idx, cfg.key_bits), _fp16_bytes(norms.squeeze(-1))], -1
        )
        key_bytes = key_bytes.reshape(-1, hk, cfg.key_bytes)
    v = value.float()
    vmin, vmax = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    levels = 2**cfg.value_bits - 1
    vscale = ((vmax - vmin) / levels).clamp(min=1e-8)
    vidx = ((v - vmin) / vscale + 0.5).to(torch.int32).clamp(0, levels)
    val_bytes = torch.cat(
        [
            pack_bits(vidx, cfg.value_bits),
            _fp16_bytes(vscale.squeeze(-1)),
            _fp16_bytes(vmin.squeeze(-1)),
        ],
        -1,
    )
    slot = torch.cat([key_bytes, val_bytes], -1)  # (N, Hk, key_bytes + value_bytes)
    kv_cache[slots // block_size, slots % block_size, :, : slot.shape[-1]] = slot


def gather_slots(
    kv_cache: torch.Tensor, block_table: torch.Tensor, start: int, length: int
):
    """Raw slots of tokens [start, start + length): (length, Hk, slot_bytes) uint8,
    and which positions have a block (length,) bool.

    A position whose block id is outside [0, num_blocks), or whose block-table column
    is past the table, reads as zero bytes and has no block: nothing outside the cache
    is read."""
    block_size, num_blocks = kv_cache.shape[1], kv_cache.shape[0]
    table = block_table.reshape(-1).long()
    col = torch.arange(start, start + length, device=kv_cache.device) // block_size
    blocks = torch.where(
        col < table.shape[0], table[col.clamp(max=max(table.shape[0] - 1, 0))], -1
    )
    ok = (blocks >= 0) & (blocks < num_blocks)
    slots = kv_cache[
        blocks.clamp(0, num_blocks - 1),
        torch.arange(start, start + length, device=kv_cache.device) % block_size,
    ]
    zero = torch.zeros((), dtype=slots.dtype, device=slots.device)
    return torch.where(ok[:, None, None], slots, zero), ok


def dequantize_reference(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    length: int,
    cfg: TQConfig,
    centroids: torch.Tensor,
    fp8_e4b15: bool = False,
):
    """Decode tokens [start, start + length) to float32 K and V, (Hk, length, D).

    MSE keys stay in the rotated space. Every operation is exactly rounded, in the
    order the Triton kernel uses, so ``.half()`` of the result is bit-identical to it.
    A token without a block (an id outside [0, num_blocks)) decodes to NaN, as in the
    kernel.
    """
    d = cfg.head_dim
    slots, ok = gather_slots(kv_cache, block_table, start, length)
    slots = slots.transpose(0, 1)  # (Hk, n, slot)
    kb = slots[..., : cfg.key_bytes]
    if cfg.key_fp8:
        raw = kb[..., :d]
        k = (
            decode_fp8_e4b15(raw)
            if fp8_e4b15
            else raw.contiguous().view(torch.float8_e4m3fn).float()
        )
    else:
        c = centroids.float().to(kv_cache.device)[
            unpack_bits(kb[..., : cfg.key_index_bytes], cfg.key_bits, d)
        ]
        # (Hk, n, 1)
        norm = _bytes_fp16(kb[..., cfg.key_index_bytes : cfg.key_bytes].unsqueeze(-2))
        if cfg.norm_correction:
            sumsq = (c.double() * c.double()).sum(-1, keepdim=True).float()
            # The kernel's sqrt_rn is the correctly rounded float32 square root.
            # torch's float32 sqrt on a CPU is not (one ulp off for 14% of inputs in
            # [0.5, 2)); a float64 square root rounded to float32 is, since
            # 53 >= 2 * 24 + 2 bits make the double rounding innocuous.
            root = torch.sqrt((sumsq + 1e-16).double()).float()
            c = c * (1.0 / root)
        k = norm * c
    vb = slots[..., cfg.key_bytes : cfg.key_bytes + cfg.value_bytes]
    vidx = unpack_bits(vb[..., : cfg.value_index_bytes], cfg.value_bits, d).float()
    vscale = _bytes_fp16(
        vb[..., cfg.value_index_bytes : cfg.value_index_bytes + 2].unsqueeze(-2)
    )
    vzero = _bytes_fp16(
        vb[..., cfg.value_index_bytes + 2 : cfg.value_index_bytes + 4].unsqueeze(-2)
    )
    v = vidx * vscale + vzero
    missing = ~ok[None, :, None]
    return k.masked_fill(missing, float("nan")), v.masked_fill(missing, float("nan"))
