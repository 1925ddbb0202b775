"""The memory-bound path: attention of each request's query rows over its cached
positions ``[0, c_r)``, read straight from the paged TurboQuant cache, with no fp16 K/V
written anywhere. For requests whose query rows per kv head (``q_len x Hq / Hk``) are
few (decode up to about 64-128), where attention is bound by the cache's bytes: a
TurboQuant slot holds 3.5-5x fewer bytes than fp16 K/V (benchmarks/NOTES.md §32).

The work, in three launches (two for fp8-key presets):

1. ``_rotate_kernel``: the query of every token served, rotated once into the keys'
   space (``q . k = (q @ rotation^T) . k_rot``: cached keys are never un-rotated),
   float32, into the scratch; and the centroid table as fp16 (the key dot's operand).
2. ``_paged_kernel``: one program per work item (a request, a kv head, a tile of up to
   BLOCK_M query rows of that kv head's group, a range of cached positions: a split).
   The rows of all query heads that share a kv head form one tile (token-major), so
   each decoded slot serves all of them; each request's positions are split over
   enough programs that every SM streams (flash-decoding). A program reads each slot
   once, keeps an online softmax over its split and writes a partial (out, lse).
3. ``_combine_kernel``: per token and query head, the splits' partials merged by
   log-sum-exp with the chunk's own causal attention, into ``out`` in its dtype. Where
   every request of the plan has at most OWN_KEYS_MAX query tokens
   (``PagedPlan.own_keys``: decode, speculative verification), the combine attends to
   the chunk's keys itself (float32 scores and sums, over the key and value tensors);
   otherwise it merges the partial a causal FlashAttention call returned.

Exactness. A key is ``a_n c_n``: ``c_n`` its centroids as the fp16 table holds them (the
dot's operand as loaded), ``a_n = norm / |c_n|`` applied to the scores; the sum of
squares is one more dot (the squares in fp16 against a tile of ones: exact products,
float32 sums). The rotated query is scaled per row by a power of two and split into an
fp16 part and an fp16 remainder, so each score is two dots of exact products (22
significant bits of the query); bf16 queries by default take the fp16 part alone, one
dot, since their full path rounds K and V to bf16 (``q_split_by_default``). fp8 keys are
exact in the query's dtype: one dot with the query as it is. A value is ``i s + z``:
``p . v = (p s) . (i - h) + p . (z + h s)``, h the middle of the index range, so the
centred indices ``2i - (2^bits - 1)`` (odd integers, exact in fp16; the middle, not
2^(bits-1), so that the dot's sum is about the answer's size, which the tensor cores'
truncating accumulation needs: NOTES.md §27) are the dot's operand, ``p s`` is rounded
once to fp16 (where FlashAttention rounds p and the value), in units of a power of two
at the largest scale seen (fp16's normal range), and the zero term is float32.

Non-finite values as in one softmax over the keys (docs/design.md): a NaN or inf key
norm makes its score NaN (a key of infinities meets a query of mixed signs); a value
field that is not finite switches that tile to the uncentred float32 form ``i s + z``,
whose NaN and inf elements are the oracle's. A block id outside ``[0, num_blocks)`` is
never read; its positions' scores are NaN, so its request's rows are NaN.

Host side, pure functions of host ints: ``plan_paged`` (the splits, the work list, the
scratch's bytes), ``PagedPlan.carve`` (the scratch's views of a workspace buffer) and
``PagedPlan.upload`` (the work arrays on the device); ``paged_attention`` runs the
three launches from those (``paged_launches`` builds them, which a step binds once
for its layers: ``_utils.BoundLaunches``);
``paged_continuation_prefill_varlen`` is the allocating
convenience form with ``continuation_prefill_varlen``'s arguments, for tests and
benchmarks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch
import triton
import triton.language as tl

from ._utils import (
    Launcher,
    cdiv,
    interpreter_rounds_bf16,
    interpreting,
    mma_switch_read,
    next_power_of_2,
    round_bf16,
)
from .dequant import _fp16_at, _unpack, fp8_e4b15_for, halves_ok
from .format import TQConfig, resolve_config
from .merge import _term

# Per work item (one program of _paged_kernel), int32: the request (its block-table
# row), the kv head, the request's first query token, its first row in the served
# tokens' numbering (the rotated query's row), its query rows of the kv head (q_len x
# GROUP), the tile's first row, the split's first and end position, the split's first
# partial row.
WORK_FIELDS = 9
# Per served token (one row of the combine), int32: the token, its first partial row,
# its request's number of splits, the stride between its splits' rows (q_len), its
# request's first query token (its first own key).
TOKEN_FIELDS = 5
# The most query tokens a request may have for the combine to attend to the chunk's own
# keys (PagedPlan.own_keys): each combine program loops over that many keys, and the
# causal FlashAttention call and its launch are saved (NOTES.md §50).
OWN_KEYS_MAX = 16
# Positions a split holds at least: below this the partial's write and the program's
# prologue weigh against its reads.
MIN_SPLIT = 256
# Programs of 4 warps the planner aims at per SM: enough for two resident programs and
# the last wave's imbalance; programs of 2 warps, twice as many. One-warp programs: 32,
# twice the warps (NOTES.md §46). 16-row tiles of 4 warps above head size 128: 8, since
# at D 256 two of them fill an SM's shared memory and 4 left two waves (§49, §55). The
# 32- and 64-row tiles: TILE32_PROGRAMS_PER_SM.
PROGRAMS_PER_SM = 4
ONE_WARP_PROGRAMS_PER_SM = 32
WIDE_HEAD_PROGRAMS_PER_SM = 8
DEFAULT_SMS = 132  # the H200's
DEFAULT_SCRATCH_BYTES = 128 << 20
_ALIGN = 256  # bytes: each scratch region starts on this


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# ---------------------------------------------------------------------------
# The plan: host ints in, work list and scratch size out
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)  # hashed by identity: its work list is a tensor
class PagedPlan:
    """What ``paged_attention`` runs for one step: the launch, the work list, the
    scratch. Made by ``plan_paged`` from host lengths; the same for every layer."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rotated: bool  # MSE keys: the query rotated into the scratch first
    block_m: int  # query rows per tile (8: a transposed tile, ``transposed``)
    block_n: int  # positions per loop iteration
    num_warps: int
    split_len: int  # positions per split (a multiple of block_n)
    work: torch.Tensor  # (programs x WORK_FIELDS,) int32, on the host
    tokens: torch.Tensor  # (served tokens x TOKEN_FIELDS,) int32, on the host
    part_rows: int  # rows of the split partials
    max_splits: int  # the most splits of a served request
    max_q_len: int  # the most query tokens of a served request
    # bf16 queries: the chunk's own call on fp16 copies of its query, key and value,
    # so that its partial is rounded once in fp16 before the combine, as a long
    # request's windows are (benchmarks/NOTES.md §3, §39); never with own_keys
    half_chunk: bool = False
    # the combine attends to the chunk's own keys (no causal call before it, no
    # partial to merge): every request has at most OWN_KEYS_MAX query tokens
    own_keys: bool = False
    # the attention kernel's registers per thread (Triton's maxnreg); 0: Triton's
    # own count (register_cap)
    max_registers: int = 0
    # the slots this many tiles ahead asked of L2 while a tile is read and decoded
    # (_split_attention's PREFETCH; loads thrown away under the interpreter); 0: none
    # (plan_paged's default: 1 at PREFETCH_LAUNCHES but fp8 keys' DECODE_LAUNCH)
    prefetch: int = 0
    # each tile's value bytes loaded with its keys', before the keys are decoded
    # (_split_attention's LOADS_FIRST; plan_paged's default: at LOADS_FIRST_LAUNCHES)
    loads_first: bool = False

    @property
    def programs(self) -> int:
        return len(self.work) // WORK_FIELDS

    @property
    def transposed(self) -> bool:
        """Whether the tiles are (positions, rows) (``_per_row``): fewer rows than
        the tensor cores' 16."""
        return self.block_m < 16

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_FIELDS

    def regions(self) -> Mapping[str, tuple[int, tuple[int, ...], torch.dtype]]:
        """Each scratch region's name -> (byte offset, shape, dtype), read only."""
        return MappingProxyType(self._regions)

    @functools.cached_property
    def _regions(self) -> dict[str, tuple[int, tuple[int, ...], torch.dtype]]:
        # once a plan: sizing, carving and the workspace's bound each read it
        hq, hk, d, n = self.num_q_heads, self.num_kv_heads, self.head_dim, 0
        out, at = {}, 0
        if self.half_chunk:
            n = self.num_tokens
        shapes = [
            ("query", (self.num_tokens if self.rotated else 0, hq, d), torch.float32),
            ("table", (16 if self.rotated else 0,), torch.float16),
            ("part_out", (self.part_rows, hq, d), torch.float32),
            ("part_lse", (self.part_rows, hq), torch.float32),
            ("chunk_q", (n, hq, d), torch.float16),
            ("chunk_k", (n, hk, d), torch.float16),
            ("chunk_v", (n, hk, d), torch.float16),
        ]
        for name, shape, dtype in shapes:
            out[name] = (at, shape, dtype)
            at += _aligned(math.prod(shape) * dtype.itemsize)
        return out

    @functools.cached_property
    def scratch_bytes(self) -> int:
        """Bytes of the scratch (each region aligned to 256 bytes)."""
        return sum(
            _aligned(math.prod(shape) * dtype.itemsize)
            for _, shape, dtype in self.regions().values()
        )

    def carve(self, buffer: torch.Tensor) -> PagedScratch:
        """The scratch's views of ``buffer`` (uint8, contiguous, at least
        ``scratch_bytes``, 256-byte aligned as the caching allocator gives)."""
        if (
            not isinstance(buffer, torch.Tensor)
            or buffer.dtype != torch.uint8
            or not buffer.is_contiguous()
        ):
            raise ValueError("buffer must be a contiguous uint8 tensor")
        if buffer.numel() < self.scratch_bytes:
            raise ValueError(
                f"buffer must hold {self.scratch_bytes} bytes, got {buffer.numel()}"
            )
        if buffer.data_ptr() % 16:
            raise ValueError("buffer must start on a 16-byte boundary")
        views = {}
        for name, (at, shape, dtype) in self.regions().items():
            n = math.prod(shape) * dtype.itemsize
            views[name] = buffer[at : at + n].view(dtype).view(shape)
        return PagedScratch(**views)

    def upload(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(work (programs, WORK_FIELDS), tokens (served tokens, TOKEN_FIELDS)) int32
        on ``device`` (one copy each; a caller that pins and copies them
        asynchronously may build them from ``work`` and ``tokens`` itself)."""
        t = lambda x, k: x.view(-1, k).to(device)
        return t(self.work, WORK_FIELDS), t(self.tokens, TOKEN_FIELDS)


@dataclass(frozen=True)
class PagedScratch:
    query: torch.Tensor  # (served tokens, Hq, D) float32: the rotated query
    table: torch.Tensor  # (16,) fp16: the centroids as the key dot reads them
    part_out: torch.Tensor  # (part_rows, Hq, D) float32
    part_lse: torch.Tensor  # (part_rows, Hq) float32, natural log
    # (served tokens, Hq or Hk, D) fp16, the chunk's copies (half_chunk); else 0 rows
    chunk_q: torch.Tensor
    chunk_k: torch.Tensor
    chunk_v: torch.Tensor


# The largest tile a GPU launch takes by default at head sizes other than 64 and 128
# (at 256 a 64-row tile's accumulator alone is 128 registers a thread on 4 warps), and
# the largest of a launch given in part. The attention kernel compiles its dots to
# mma.sync everywhere (``launch_paged``: Triton's wgmma gave wrong answers and an
# illegal address in this kernel's 64-row tiles under Triton 3.6 on the H200 machine,
# NOTES.md §33, as the fused prototype's did in §26).
MAX_GPU_TILE = 32


# The 16-row tile's launch on a GPU: one warp, 32 positions an iteration. A program's
# warps otherwise share the tile's positions, so that the softmax's row max and sums,
# the value scales' max and the probabilities (into the value dot's layout) cross warps
# through shared memory: more barriers and instructions a slot-row, and slower at head
# sizes 64 and 128, where this is the default (NOTES.md §44, §46). Head size 256 keeps
# 4 warps: one spills there.
DECODE_LAUNCH = (16, 32, 1)
# The 32-row tile's launch at head size 128: 4 warps (2 spill) and 128 positions an
# iteration, the fastest timed (NOTES.md §46, §57).
TILE32_LAUNCH = (32, 128, 4)
# At head size 64: 2 warps, each its own 16 rows (no softmax rows traded between
# warps), 64 positions an iteration. Head size 256 keeps (32, 64, 4), the fastest
# launch tried there (NOTES.md §57).
TILE32_D64_LAUNCH = (32, 64, 2)
# 33-64 rows at head size 64: one 64-row tile on 2 warps (32 rows each), decoding each
# slot once where two 32-row tiles decode it twice; 64 positions an iteration (NOTES.md
# §58).
TILE64_D64_LAUNCH = (64, 64, 2)
# 33-64 rows at head size 128: one 64-row tile on 4 warps (16 rows each, mma.sync),
# decoding each slot once where two 32-row tiles decode it twice: 107 warp
# instructions a position against 2 x 62.4 (NOTES.md §63).
TILE64_LAUNCH = (64, 64, 4)
# The programs an SM the split aims at for these launches at these head sizes, the
# fastest counts timed (NOTES.md §57, §58); other launches take the rule's
# (plan_paged).
TILE32_PROGRAMS_PER_SM = {
    (TILE32_LAUNCH, 128): 8,
    (TILE32_D64_LAUNCH, 64): 32,
    (TILE64_D64_LAUNCH, 64): 16,
    (TILE64_LAUNCH, 128): 8,
}
# The 8-row tile's launch: a transposed tile (``_per_row``: the positions on the
# tensor cores' 16-row side, the rows on the 8-row side), one warp, 32 positions an
# iteration: half the MMAs and half the accumulator of the 16-row tile (NOTES.md §47).
# The default where ``transposed_by_default`` says, else taken where asked
# (``block_m=8``).
TRANSPOSED_LAUNCH = (8, 32, 1)
# The launches that ask L2 for the next tile's slots by default (PagedPlan.prefetch):
# DECODE_LAUNCH and TILE32_LAUNCH, where it was timed faster or even, and
# TRANSPOSED_LAUNCH, one warp as DECODE_LAUNCH; not (32, 64, 4), where it cost time,
# nor the two head-size-64 tiles, where it was not timed (NOTES.md §46). Never for fp8
# keys at DECODE_LAUNCH, where it cost time (§49, §55).
PREFETCH_LAUNCHES = (DECODE_LAUNCH, TILE32_LAUNCH, TRANSPOSED_LAUNCH)
# The launches whose tiles load their values' bytes with their keys' by default
# (PagedPlan.loads_first): TILE32_LAUNCH and TILE64_LAUNCH, whose loads' waits then
# overlap; not the one-warp DECODE_LAUNCH, where the registers they hold cost more
# (NOTES.md §62, §63). Other launches not timed either way.
LOADS_FIRST_LAUNCHES = (TILE32_LAUNCH, TILE64_LAUNCH)


def transposed_by_default(rows: int, head_dim: int) -> bool:
    """Whether a GPU batch whose largest request has at most 8 query rows per kv head
    takes the transposed 8-row tile (TRANSPOSED_LAUNCH) rather than the 16-row one
    (DECODE_LAUNCH): at head size 64, where it was the faster (timed for k3v4_nc, the
    other presets by their SASS counts). Not at 128, where 3- and 4-bit keys need all
    255 registers (8 warps an SM against 9; capped they spill) and it was not faster
    (NOTES.md §47, §49)."""
    return rows <= 8 and head_dim == 64


def default_launch(
    rows: int, interpret: bool, head_dim: int = 128, block_m: int | None = None
) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps) for a batch whose largest request has ``rows``
    query rows per kv head: one tile of all of them up to MAX_GPU_TILE, 64 at head
    sizes 64 and 128 (each slot decoded once per request and kv head; at 128 where
    Triton reads ``DISABLE_MMA_V3``, ``_utils.mma_switch_read``), 16 at least
    (the tensor cores' smallest tile), or the tile ``block_m`` where given; on a GPU,
    16-row tiles at DECODE_LAUNCH at head sizes 64 and 128, 32-row tiles at
    TILE32_LAUNCH at head size 128 and TILE32_D64_LAUNCH at 64, 64-row tiles at
    TILE64_LAUNCH at 128 and TILE64_D64_LAUNCH at 64, other tiles 64 positions an
    iteration on 4 warps; 8-row
    tiles (``plan_paged``'s choice by ``transposed_by_default``, or asked
    for) at TRANSPOSED_LAUNCH up to head size 128, on 2 warps above (one spills 247
    instructions an iteration at D 256, two 50). Under the interpreter 16 positions an
    iteration, on 4 warps (one for 8-row tiles)."""
    if block_m == 8:
        # never 4 warps: the transposed tile was built and timed on one and two (§47)
        if interpret:
            return 8, 16, 1
        return TRANSPOSED_LAUNCH if head_dim <= 128 else (8, 32, 2)
    if interpret:
        return block_m or 16, 16, 4
    if block_m is None:
        # at 128 the 64-row tile's 4 warps need Triton's switch to mma.sync (a Triton
        # that does not read it keeps two 32-row tiles); at 64 its 2 warps are mma.sync
        wide = head_dim == 64 or (head_dim == 128 and mma_switch_read())
        widest = 64 if wide else MAX_GPU_TILE
        block_m = min(max(next_power_of_2(max(rows, 1)), 16), widest)
    if block_m == 64 and head_dim == 64:
        return TILE64_D64_LAUNCH
    if block_m == 64 and head_dim == 128:
        return TILE64_LAUNCH
    if block_m == 16 and head_dim in (64, 128):
        return DECODE_LAUNCH
    if block_m == 32 and head_dim == 128:
        return TILE32_LAUNCH
    if block_m == 32 and head_dim == 64:
        return TILE32_D64_LAUNCH
    return block_m, 64, 4


def register_cap(
    block_m: int, block_n: int, num_warps: int, head_dim: int, interpret: bool
) -> int:
    """The attention kernel's registers per thread on a GPU (0: Triton's count).

    A cap lets one more program (or warp) share an SM, where that was timed to pay for
    the few spill instructions it costs (benchmarks/sass_report.py counts them):
    - (16, 64, 4): 128 at D 64, 168 at D 128 (Triton counts 128-191; NOTES.md §42).
    - DECODE_LAUNCH, whose one warp holds the whole (16, D) float32 accumulator and
      both query operands (Triton counts 248-255): 144 at D 64 (14 warps an SM), 216
      at D 128 (NOTES.md §44, §46; §62: on an H100 it holds no more warps an SM than
      Triton's 255, which was not slower: to be timed again).
    - TRANSPOSED_LAUNCH: 144 at D 64. D 128 keeps Triton's 255 at MSE keys, where a
      cap for 9 warps spilled 23-41 instructions an iteration and was slower (NOTES.md
      §47, §49).
    Other launches and head sizes: Triton's count."""
    if interpret:
        return 0
    caps = {
        (16, 64, 4): {64: 128, 128: 168},
        DECODE_LAUNCH: {64: 144, 128: 216},
        TRANSPOSED_LAUNCH: {64: 144},
    }.get((block_m, block_n, num_warps), {})
    return caps.get(head_dim, 0)


def q_split_by_default(dtype: torch.dtype) -> bool:
    """Whether the rotated query of MSE keys goes to the key dot as fp16 hi + lo (two
    dots) by default: for fp16 queries, whose answer without the remainder came to
    1.04x the full path's error on a CPU batch, too near 1.1 (NOTES.md §32); not for
    bf16, where the full path rounds K and V to bf16 and the remainder bought nothing
    (0.53 against 0.54 of its error on the H200 machine, §33; §63)."""
    return dtype != torch.bfloat16


def _host_array(name: str, ints) -> np.ndarray:
    """``ints`` (a sequence of ints or a CPU integer tensor) as an int64 array, or a
    ValueError naming the argument (a device tensor would need a synchronization)."""
    if isinstance(ints, torch.Tensor) and ints.device.type != "cpu":
        raise ValueError(
            f"{name} must be host ints (a list, tuple or CPU tensor), got a tensor on "
            f"{ints.device}: reading it back would synchronize"
        )
    a = np.asarray(ints)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(
            f"{name} must be a 1-D sequence of ints, got {a.dtype} of shape {a.shape}"
        )
    return a.astype(np.int64, copy=False)


def plan_paged(
    query_start_loc,
    seq_lens,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    preset: str | TQConfig,
    *,
    requests=None,
    sms: int = DEFAULT_SMS,
    programs_per_sm: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    split_len: int | None = None,
    max_scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
    interpret: bool | None = None,
    half_chunk: bool = False,
    max_registers: int | None = None,
    prefetch: int | None = None,
    own_keys: bool | None = None,
    loads_first: bool | None = None,
) -> PagedPlan:
    """The plan of the memory-bound path for the requests ``requests`` (default: all)
    of a batch, from host ints alone.

    query_start_loc: B + 1 host ints; seq_lens: B host ints (cached + new tokens).
    Request r's cached positions ``[0, seq_lens[r] - q_len_r)`` are split into ranges of
    ``split_len`` positions (default: the batch's work over ``sms x programs_per_sm``
    programs, at least MIN_SPLIT, a multiple of block_n; default programs_per_sm:
    TILE32_PROGRAMS_PER_SM's at its launches and head sizes, ONE_WARP_PROGRAMS_PER_SM at
    one warp, WIDE_HEAD_PROGRAMS_PER_SM for 16-row tiles of 4 warps above head size
    128, else PROGRAMS_PER_SM x 4 / num_warps), each a program
    per kv head and tile of ``block_m`` query rows (default: 8 on a GPU where
    ``transposed_by_default``, else ``default_launch``'s, which a launch given in part
    always takes; 8: a transposed tile, ``PagedPlan.transposed``). Splits double until
    the scratch fits ``max_scratch_bytes`` (a ValueError if one split per request does
    not). A request with nothing cached has tokens (the combine writes them) and no
    work; one without query tokens has neither. own_keys: the combine attends to the
    chunk's own keys (PagedPlan.own_keys; default: where every served request has at
    most OWN_KEYS_MAX query tokens). half_chunk: the scratch holds fp16 copies of the
    served tokens' query, key and value for the chunk's own call (bf16 queries:
    PagedPlan.half_chunk; not with own_keys). max_registers: the attention kernel's
    registers per thread, 0 for Triton's own count (default ``register_cap``).
    loads_first: PagedPlan.loads_first (default: at LOADS_FIRST_LAUNCHES).
    prefetch: PagedPlan.prefetch (default 1 at the PREFETCH_LAUNCHES but fp8 keys'
    DECODE_LAUNCH, else 0).
    """
    cfg = resolve_config(preset, head_dim)
    hq, hk = num_q_heads, num_kv_heads
    if hk < 1 or hq % hk:
        raise ValueError(
            f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({hk})"
        )
    group = hq // hk
    starts = _host_array("query_start_loc", query_start_loc)
    lens = _host_array("seq_lens", seq_lens)
    b = len(lens)
    if len(starts) != b + 1:
        raise ValueError(
            f"query_start_loc must hold B + 1 = {b + 1} ints, got {len(starts)}"
        )
    # the served requests' ints as int64 arrays, one entry a request (numpy: its ops
    # on arrays this small cost a fraction of torch's, NOTES.md §51)
    served = (
        np.arange(b, dtype=np.int64)
        if requests is None
        else np.fromiter(requests, np.int64)
    )
    q0 = starts[served]
    q_len = starts[served + 1] - q0
    cached = lens[served] - q_len
    if (q_len < 0).any() or (cached < 0).any():
        raise ValueError("seq_lens[r] must be at least request r's query tokens")
    rows = q_len * group
    longest_q = int(q_len.max(initial=0))
    if own_keys is None:
        own_keys = longest_q <= OWN_KEYS_MAX
    elif own_keys and longest_q > OWN_KEYS_MAX:
        raise ValueError(
            f"own_keys takes requests of at most OWN_KEYS_MAX = {OWN_KEYS_MAX} query "
            f"tokens, got {longest_q}"
        )
    half_chunk = half_chunk and not own_keys
    busy = (cached > 0) & (q_len > 0)
    interpret = interpreting() if interpret is None else interpret
    most = int(rows[busy].max(initial=1))
    if block_n is None and num_warps is None:
        # the tile's own launch (an explicit block_m chooses the tile)
        choose_tile = block_m is None and not interpret
        if choose_tile and transposed_by_default(most, head_dim):
            block_m = 8
        block_m, block_n, num_warps = default_launch(most, interpret, head_dim, block_m)
    else:
        # a launch given in part: the tuned launches are whole choices, so the rest is
        # 64 positions an iteration on 4 warps (0.6.3's, NOTES.md §46), on one warp
        # for a transposed tile (never 4: default_launch); a launch that comes out as
        # a tuned one takes its prefetch and programs an SM below (at most
        # MAX_GPU_TILE rows, as 0.6.3's: 64-row tiles on other launches not timed)
        block_m = block_m or min(
            default_launch(most, interpret, head_dim)[0], MAX_GPU_TILE
        )
        block_n = block_n or (16 if interpret else 64)
        num_warps = num_warps or (1 if block_m == 8 else 4)
    if block_m not in (8, 16, 32, 64, 128):
        raise ValueError(f"block_m must be 8, 16, 32, 64 or 128, got {block_m}")
    if block_m == 8 and num_warps > 2:
        raise ValueError(
            f"block_m 8 (a transposed tile) takes num_warps 1 or 2, got {num_warps}"
        )
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    tiles = np.where(busy, -(-rows // block_m), 0)
    longest = int(cached[busy].max(initial=0))
    if programs_per_sm is None:
        tile32 = TILE32_PROGRAMS_PER_SM.get(((block_m, block_n, num_warps), head_dim))
        if tile32:
            programs_per_sm = tile32
        elif num_warps == 1:
            programs_per_sm = ONE_WARP_PROGRAMS_PER_SM
        elif (block_m, num_warps) == (16, 4) and head_dim > 128:
            programs_per_sm = WIDE_HEAD_PROGRAMS_PER_SM
        else:
            programs_per_sm = PROGRAMS_PER_SM * max(4 // num_warps, 1)
    if prefetch is None:
        launch = (block_m, block_n, num_warps)
        fp8_decode = cfg.key_fp8 and launch == DECODE_LAUNCH
        prefetch = int(launch in PREFETCH_LAUNCHES and not fp8_decode)
    if loads_first is None:
        loads_first = (block_m, block_n, num_warps) in LOADS_FIRST_LAUNCHES
    if split_len is None:
        work = int((tiles * cached).sum()) * hk
        split_len = max(MIN_SPLIT, cdiv(work, max(sms * programs_per_sm, 1)))
    split_len = cdiv(max(min(split_len, longest), 1), block_n) * block_n
    if max_registers is None:
        max_registers = register_cap(block_m, block_n, num_warps, head_dim, interpret)
    fields = dict(
        half_chunk=half_chunk,
        max_registers=max_registers,
        prefetch=prefetch,
        own_keys=own_keys,
        loads_first=bool(loads_first),
    )
    while True:
        plan = _build(
            cfg, hq, hk, served, q0, q_len, cached, rows, tiles,
            block_m, block_n, num_warps, split_len, fields,
        )  # fmt: skip
        if plan.scratch_bytes <= max_scratch_bytes:
            return plan
        if split_len >= longest:
            raise ValueError(
                f"the memory-bound path needs {plan.scratch_bytes} bytes of scratch "
                f"for these requests, more than max_scratch_bytes "
                f"({max_scratch_bytes})"
            )
        split_len = min(2 * split_len, cdiv(longest, block_n) * block_n)


def _build(
    cfg, hq, hk, served, q0, q_len, cached, rows, tiles,
    block_m, block_n, num_warps, split_len, fields,
) -> PagedPlan:  # fmt: skip
    """The work list and the tokens' fields, built by array ops on the host from the
    served requests' int64 arrays (thousands of programs per step: a Python loop took
    milliseconds, benchmarks/NOTES.md §38). Request i's programs, in order: tile, kv
    head, split; its tokens: its query tokens in order. ``fields``: PagedPlan's
    half_chunk, max_registers, prefetch, own_keys and loads_first."""
    n = len(served)
    splits = np.where(tiles > 0, -(-cached // split_len), 0)
    part0 = np.cumsum(splits * q_len) - splits * q_len  # the request's first row
    crow0 = np.cumsum(q_len) - q_len  # its first served token

    # each field into its int32 column
    i = np.repeat(np.arange(n), q_len)  # each served token's request
    t = np.arange(i.size) - crow0[i]
    tokens = np.empty((i.size, TOKEN_FIELDS), np.int32)
    tokens[:, 0] = q0[i] + t
    tokens[:, 1] = part0[i] + t
    tokens[:, 2] = splits[i]
    tokens[:, 3] = q_len[i]
    tokens[:, 4] = q0[i]

    count = tiles * hk * splits
    i = np.repeat(np.arange(n), count)  # each program's request
    k = np.arange(i.size) - (np.cumsum(count) - count)[i]  # its index
    s = splits[i]  # > 0 for every program
    j = k % s
    p0 = j * split_len
    work = np.empty((i.size, WORK_FIELDS), np.int32)
    work[:, 0] = served[i]
    work[:, 1] = (k // s) % hk  # kv head
    work[:, 2] = q0[i]
    work[:, 3] = crow0[i]
    work[:, 4] = rows[i]
    work[:, 5] = k // (s * hk) * block_m  # the tile's first row
    work[:, 6] = p0
    work[:, 7] = np.minimum(cached[i], p0 + split_len)
    work[:, 8] = part0[i] + j * q_len[i]
    return PagedPlan(
        hq,
        hk,
        cfg.head_dim,
        not cfg.key_fp8,
        block_m,
        block_n,
        num_warps,
        split_len,
        torch.from_numpy(work.reshape(-1)),
        torch.from_numpy(tokens.reshape(-1)),
        int((splits * q_len).sum()),
        int(splits.max(initial=0)),
        int(q_len.max(initial=0)),
        **fields,
    )


# ---------------------------------------------------------------------------
# The query's rotation
# ---------------------------------------------------------------------------


@triton.jit
def _rotate_kernel(
    q_ptr,
    rot_ptr,
    centroids_ptr,
    tokens_ptr,
    out_ptr,  # (served tokens, HQ, D) float32
    table_ptr,  # (16,) fp16
    n_rows,  # served tokens x HQ
    n_centroids,
    s_q_tok,
    s_q_head,
    s_q_d,
    s_rot0,
    s_rot1,
    s_centroid,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TOKEN_FIELDS: tl.constexpr,
    PRECISION: tl.constexpr,  # the dot's input precision: rotation_precision()
):
    """Rows (served token, head) of ``q @ rotation^T`` in float32 (``q.float() @
    rotation.float().T`` to an error of float32's order); program 0 also writes the
    centroid table as fp16."""
    i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = i < n_rows
    tok = tl.load(tokens_ptr + (i // HQ) * TOKEN_FIELDS, mask=live, other=0)
    tok = tok.to(tl.int64)
    head = (i % HQ).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for k0 in tl.static_range(0, BLOCK_D, BLOCK_K):
        e = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(
            q_ptr + tok[:, None] * s_q_tok + head[:, None] * s_q_head + e * s_q_d,
            mask=live[:, None] & (e < D)[None, :],
            other=0.0,
        ).to(tl.float32)
        # rotation[d, e] as a (d, e) tile, transposed for the dot
        r = tl.load(
            rot_ptr + d[:, None] * s_rot0 + e[None, :] * s_rot1,
            mask=(d < D)[:, None] & (e < D)[None, :],
            other=0.0,
        ).to(tl.float32)  # any float dtype the caller passes
        acc = tl.dot(q, tl.trans(r), acc, input_precision=PRECISION)
    tl.store(
        out_ptr + i.to(tl.int64)[:, None] * D + d[None, :],
        acc,
        mask=live[:, None] & (d < D)[None, :],
    )
    if tl.program_id(0) == 0:
        c = tl.arange(0, 16)
        table = tl.load(centroids_ptr + c * s_centroid, mask=c < n_centroids, other=0)
        tl.store(table_ptr + c, table.to(tl.float16))


@functools.cache
def rotation_precision(device: torch.device | None) -> str:
    """The query rotation's dot precision on ``device`` (None: the CPU interpreter).

    "tf32x3" on NVIDIA GPUs from sm_80: three tf32 products on the tensor cores (each
    operand a tf32 head and its remainder; the remainders' product dropped) summed in
    float32, an error of float32's order; float32 FMA dots ("ieee") took 5.6x its time
    over a row-major rotation, vLLM's (NOTES.md §61). "ieee" elsewhere: older GPUs have
    no tf32, ROCm's Triton takes only "ieee", and the interpreter computes in float32
    whatever is asked."""
    if device is None or device.type != "cuda" or torch.version.hip is not None:
        return "ieee"
    return "tf32x3" if torch.cuda.get_device_capability(device) >= (8, 0) else "ieee"


# ---------------------------------------------------------------------------
# The slot decode
# ---------------------------------------------------------------------------


def _release() -> tuple[int, int]:
    return tuple(int(x) for x in triton.__version__.split(".")[:2])  # type: ignore


# Whether a slot's index groups are laid out (G, N) (groups outer) or (N, G): the
# decoded tiles reach shared memory in 128-bit stores only when Triton lays a warp's
# lanes along the groups, which 3.6 (the H200 machine's) does for (G, N) and 3.9 for
# (N, G); the other way, 16-bit stores and up to 11 more instructions per slot-row
# (measured on 3.6 and 3.9 only; NOTES.md §40).
GROUPS_OUTER = tl.constexpr(_release() < (3, 9))


@triton.jit
def _group_ptrs(ptr, ok, STEP: tl.constexpr, BLOCK_D: tl.constexpr,
                OUTER: tl.constexpr):  # fmt: skip
    """(halfword pointers, ``ok``, first element) of each group of 16 elements of the
    streams at byte pointers ``ptr`` (N,), STEP halfwords a group: (G, N) tensors if
    OUTER, else (N, G)."""
    G: tl.constexpr = BLOCK_D // 16
    g = tl.arange(0, G)
    p16 = ptr.to(tl.pointer_type(tl.uint16))
    if OUTER:
        return p16[None, :] + g[:, None] * STEP, ok[None, :], g[:, None] * 16
    else:
        return p16[:, None] + g[None, :] * STEP, ok[:, None], g[None, :] * 16


@triton.jit
def _interleave(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """(A, B, 16) of sixteen (A, B) tensors, x_j at [..., j], the new axis in each
    thread's registers (``tl.join`` keeps its axis there): each thread then holds the
    16 indices of a group, decoded with shifts known at compile time."""
    a = tl.join(tl.join(tl.join(x0, x8), tl.join(x4, x12)), tl.join(
        tl.join(x2, x10), tl.join(x6, x14)))  # fmt: skip
    b = tl.join(tl.join(tl.join(x1, x9), tl.join(x5, x13)), tl.join(
        tl.join(x3, x11), tl.join(x7, x15)))  # fmt: skip
    # joined axes, outer to inner: bits 3, 2, 1, 0 of j
    y = tl.join(a, b)
    return tl.reshape(y, [x0.shape[0], x0.shape[1], 16])


@triton.jit
def _halfwords(ptr, ok, D: tl.constexpr, BITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The BITS-wide (3 or 4) index streams at byte pointers ``ptr`` (N,), as their
    halfwords, int32: for each group of 16 indices (``_group_ptrs``' layout) the BITS
    halfwords from halfword g * BITS (the fourth is the third's at 3 bits, unused);
    rows outside ``ok`` and groups past D read nothing (0). Loaded apart from their
    decode (``_indices_of``, ``_keys3``, ``_keys4``) so that a tile's loads all go
    out before the first of them is waited for (NOTES.md §62)."""
    base, m, e = _group_ptrs(ptr, ok, BITS, BLOCK_D, GROUPS_OUTER)
    m = m & (e < D)
    h0 = tl.load(base, mask=m, other=0).to(tl.int32)
    h1 = tl.load(base + 1, mask=m, other=0).to(tl.int32)
    h2 = tl.load(base + 2, mask=m, other=0).to(tl.int32)
    if BITS == 4:  # noqa: SIM108 - a constexpr: one branch is compiled
        h3 = tl.load(base + 3, mask=m, other=0).to(tl.int32)
    else:
        h3 = h2
    return h0, h1, h2, h3


@triton.jit
def _indices_of(h0, h1, h2, h3, N: tl.constexpr, BITS: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    """(N, BLOCK_D) int32: the indices of ``_halfwords``' groups; columns past D
    unspecified. Two 32-bit words of a group's halfwords hold every index of it whole
    (halfwords 0-1 and, at 3 bits, 1-2; at 4 bits, 2-3), so each index is one shift
    and one mask (a 64-bit word would take two of each)."""
    K: tl.constexpr = (1 << BITS) - 1
    if BITS == 4:
        lo = h0 | (h1 << 16)  # indices 0-7
        hi = h2 | (h3 << 16)  # indices 8-15
        y = _interleave(
            lo & K, (lo >> 4) & K, (lo >> 8) & K, (lo >> 12) & K,
            (lo >> 16) & K, (lo >> 20) & K, (lo >> 24) & K, (lo >> 28) & K,
            hi & K, (hi >> 4) & K, (hi >> 8) & K, (hi >> 12) & K,
            (hi >> 16) & K, (hi >> 20) & K, (hi >> 24) & K, (hi >> 28) & K,
        )  # fmt: skip
    else:
        lo = h0 | (h1 << 16)  # indices 0-9 whole (bits 0-29)
        hi = h1 | (h2 << 16)  # indices 6-15 whole (bits 16-47)
        y = _interleave(
            lo & K, (lo >> 3) & K, (lo >> 6) & K, (lo >> 9) & K,
            (lo >> 12) & K, (lo >> 15) & K, (lo >> 18) & K, (lo >> 21) & K,
            (lo >> 24) & K, (lo >> 27) & K, (hi >> 14) & K, (hi >> 17) & K,
            (hi >> 20) & K, (hi >> 23) & K, (hi >> 26) & K, (hi >> 29) & K,
        )  # fmt: skip
    if GROUPS_OUTER:
        y = tl.permute(y, (1, 0, 2))
    return tl.reshape(y, [N, BLOCK_D])


@triton.jit
def _fp16_field(ptr, ok, HALVES: tl.constexpr):
    """float32 of the fp16 at byte pointers ``ptr`` where ``ok`` (0 elsewhere)."""
    if HALVES:
        x = tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=ok, other=0)
        return x.to(tl.float32)
    else:
        return _fp16_at(ptr, ok)


@triton.jit
def _centred(idx, BITS: tl.constexpr):
    """fp16 ``2 idx - (2^BITS - 1)`` (odd integers, exact) without the conversion
    pipe: the bits ``(2 idx + 1) | 0x6400`` are the fp16 1025 + 2 idx, less 1024 +
    2^BITS (exact: fp16 counts by 1 in [1024, 2048))."""
    bits = ((idx << 1) | 0x6401).to(tl.int16)
    return bits.to(tl.float16, bitcast=True) - (1024.0 + (1 << BITS))


@triton.jit
def _table_bytes(table_ptr):
    """The 8-entry fp16 table as four int32 words for ``_lookup8``: the low bytes of
    entries 0-3 and 4-7, the high bytes of entries 0-3 and 4-7."""
    c = tl.arange(0, 4)
    h = tl.load(table_ptr.to(tl.pointer_type(tl.uint16)) + c).to(tl.int32)
    h4 = tl.load(table_ptr.to(tl.pointer_type(tl.uint16)) + 4 + c).to(tl.int32)
    shift = 8 * c
    return (
        tl.sum((h & 0xFF) << shift, 0),
        tl.sum((h4 & 0xFF) << shift, 0),
        tl.sum((h >> 8) << shift, 0),
        tl.sum((h4 >> 8) << shift, 0),
    )


@triton.jit
def _lookup8(idx, lo0, lo1, hi0, hi1):
    """fp16 ``table[idx]`` of 3-bit indices (int32) without a load: four indices make
    one byte-permute selector (nibbles), two permutes pick their entries' low and high
    bytes from the table's words (``_table_bytes``), two more interleave them into
    fp16 pairs: 7 instructions per 4 elements, in the indices' own layout (a gather
    through ``tl.load`` is laid out one element per thread and converted back through
    shared memory, NOTES.md §32). GPU only (inline PTX)."""
    z = tl.zeros_like(idx)
    # operands: $0-$1 the four fp16 out; $2-$5 the indices; each table word packed
    # four times ($6, $10, $14, $18 the first copies)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 s, l, h;
        mad.lo.u32 s, $3, 16, $2;
        mad.lo.u32 s, $4, 256, s;
        mad.lo.u32 s, $5, 4096, s;
        prmt.b32 l, $6, $10, s;
        prmt.b32 h, $14, $18, s;
        prmt.b32 $0, l, h, 0x5140;
        prmt.b32 $1, l, h, 0x7362;
        }""",
        constraints=(  # two fp16 pairs out; four indices and the table's words in
            "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r"
        ),
        args=[idx, z + lo0, z + lo1, z + hi0, z + hi1],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _lookup8w(w, lo0, lo1, hi0, hi1):
    """Four int32 tensors, each two fp16 ``table[i]``: the entries of the eight 3-bit
    indices in bits 0-23 of ``w`` (int32; bits above ignored), in pairs (0, 1) .. (6,
    7). ``_lookup8`` on a whole word: the fields are spread to nibbles in place (three
    shift-and-merge steps for all eight, where extracting each index took two
    instructions), then the same byte permutes. GPU only (inline PTX)."""
    z = tl.zeros_like(w)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 x, t, s, l, h;
        shl.b32 t, $4, 4;
        and.b32 t, t, 0x0FFF0000;
        and.b32 x, $4, 0x00000FFF;
        or.b32 x, x, t;
        shl.b32 t, x, 2;
        and.b32 t, t, 0x3F003F00;
        and.b32 x, x, 0x003F003F;
        or.b32 x, x, t;
        shl.b32 t, x, 1;
        and.b32 t, t, 0x70707070;
        and.b32 x, x, 0x07070707;
        or.b32 x, x, t;
        prmt.b32 l, $5, $6, x;
        prmt.b32 h, $7, $8, x;
        prmt.b32 $0, l, h, 0x5140;
        prmt.b32 $1, l, h, 0x7362;
        shr.b32 s, x, 16;
        prmt.b32 l, $5, $6, s;
        prmt.b32 h, $7, $8, s;
        prmt.b32 $2, l, h, 0x5140;
        prmt.b32 $3, l, h, 0x7362;
        }""",
        # four fp16 pairs out; the word and the table's four words in. The steps:
        # fields 4-7 up 4 bits, then 2-3 and 6-7 up 2, then the odd ones up 1: field
        # k in bits 4k .. 4k + 2, bit 4k + 3 clear (a plain byte select)
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[w, z + lo0, z + lo1, z + hi0, z + hi1],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _lookup16w(w, lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3):
    """Four int32 tensors, each two fp16 ``table[i]``: the entries of the eight 4-bit
    indices (nibbles) of ``w``, in pairs (0, 1) .. (6, 7). Each byte half of an entry
    is picked from entries 0-7 and from 8-15 by the index's low 3 bits (two byte
    permutes over ``_table_bytes`` of each half of the table), then one of the two by
    its bit 3 (a byte mask, itself a permute of 0 and -1): 23 instructions per word of
    8 where a gather took an address, a load and a conversion per entry. GPU only
    (inline PTX)."""
    z = tl.zeros_like(w)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, u, s, v, m, l, l1, h, h1, z, f;
        mov.b32 z, 0;
        mov.b32 f, -1;
        and.b32 t, $4, 0x77777777;
        shr.b32 u, $4, 1;
        and.b32 u, u, 0x44444444;
        prmt.b32 m, z, f, u;
        prmt.b32 l, $5, $6, t;
        prmt.b32 l1, $7, $8, t;
        lop3.b32 l, l, l1, m, 0xD8;
        prmt.b32 h, $9, $10, t;
        prmt.b32 h1, $11, $12, t;
        lop3.b32 h, h, h1, m, 0xD8;
        prmt.b32 $0, l, h, 0x5140;
        prmt.b32 $1, l, h, 0x7362;
        shr.b32 s, t, 16;
        shr.b32 v, u, 16;
        prmt.b32 m, z, f, v;
        prmt.b32 l, $5, $6, s;
        prmt.b32 l1, $7, $8, s;
        lop3.b32 l, l, l1, m, 0xD8;
        prmt.b32 h, $9, $10, s;
        prmt.b32 h1, $11, $12, s;
        lop3.b32 h, h, h1, m, 0xD8;
        prmt.b32 $2, l, h, 0x5140;
        prmt.b32 $3, l, h, 0x7362;
        }""",
        # t: each index's low 3 bits (a plain byte select); u: 4 in the nibbles of
        # indices >= 8, so that m's bytes are 0xFF there; lop3 0xD8: m ? l1 : l
        constraints="=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
        args=[w] + [z + x for x in (lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3)],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _halves(x):
    """(..., 2) fp16 of int32 ``x``: its low and high 16 bits."""
    lo = (x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _group_tile(p0, p1, p2, p3, p4, p5, p6, p7, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """(N, BLOCK_D) fp16 of each group's 16 entries, given as eight int32 tensors of
    fp16 pairs (0, 1) .. (14, 15) in the index groups' layout (GROUPS_OUTER)."""
    # pair q = 4a + 2b + c over axes (a, b, c), then its two halves: element 2q + h
    y = _halves(
        tl.join(
            tl.join(tl.join(p0, p4), tl.join(p2, p6)),
            tl.join(tl.join(p1, p5), tl.join(p3, p7)),
        )
    )
    if GROUPS_OUTER:
        y = tl.permute(y, (1, 0, 2, 3, 4, 5))
    return tl.reshape(y, [N, BLOCK_D])


@triton.jit
def _keys3(h0, h1, h2, N: tl.constexpr, BLOCK_D: tl.constexpr, lo0, lo1, hi0, hi1):
    """(N, BLOCK_D) fp16 table entries of the 3-bit indices of ``_halfwords``' groups
    (columns past D unspecified): each word of 8 looked up whole by ``_lookup8w``.
    GPU only."""
    p0, p1, p2, p3 = _lookup8w(h0 | (h1 << 16), lo0, lo1, hi0, hi1)  # indices 0-7
    # stream bits 24-47: indices 8-15
    p4, p5, p6, p7 = _lookup8w((h1 >> 8) | (h2 << 8), lo0, lo1, hi0, hi1)
    return _group_tile(p0, p1, p2, p3, p4, p5, p6, p7, N, BLOCK_D)


@triton.jit
def _keys4(h0, h1, h2, h3, N: tl.constexpr, BLOCK_D: tl.constexpr, lo0, lo1, lo2, lo3,
           hi0, hi1, hi2, hi3):  # fmt: skip
    """(N, BLOCK_D) fp16 table entries of the 4-bit indices of ``_halfwords``' groups
    (columns past D unspecified), each word of 8 looked up whole by ``_lookup16w``.
    GPU only."""
    p0, p1, p2, p3 = _lookup16w(
        h0 | (h1 << 16), lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3
    )  # indices 0-7
    p4, p5, p6, p7 = _lookup16w(
        h2 | (h3 << 16), lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3
    )  # indices 8-15
    return _group_tile(p0, p1, p2, p3, p4, p5, p6, p7, N, BLOCK_D)


# The 3-bit centred values 2i - 7 (fp16 odd integers, low bytes 0) as _table_bytes'
# words, signed: _centred3's table
_C3 = tl.constexpr((0, 0, 0xBCC2C5C7 - (1 << 32), 0x4745423C))


@triton.jit
def _centred3(h0, h1, h2, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """(N, BLOCK_D) fp16: ``_centred`` of the 3-bit value indices of ``_halfwords``'
    groups (columns past D unspecified), looked up in a table of the centred values by
    ``_keys3``'s byte permutes, in fewer instructions than shifting, masking, packing
    and offsetting them in pairs (about 0.45 fewer an index; 4-bit indices take more
    by lookup than by arithmetic). GPU only."""
    return _keys3(h0, h1, h2, N, BLOCK_D, _C3[0], _C3[1], _C3[2], _C3[3])


@triton.jit
def _fp8_keys(cache_ptr, slot, ok, D: tl.constexpr, BLOCK_D: tl.constexpr,
              FP8_E4B15: tl.constexpr, HALVES: tl.constexpr):  # fmt: skip
    """(N, BLOCK_D) fp16 of the fp8 keys at ``slot`` (exact; 0 outside ``ok`` and past
    D), read in 16-bit loads with HALVES."""
    N: tl.constexpr = slot.shape[0]
    ok2 = ok[:, None]
    if HALVES:
        # eight loads of a group of 16 keys from one address (one per thread and
        # group, not one per halfword), laid out as _halfwords' groups (NOTES.md §40)
        base, m, e = _group_ptrs(cache_ptr + slot, ok, 8, BLOCK_D, GROUPS_OUTER)
        h0 = tl.load(base, mask=m & (e < D), other=0)
        h1 = tl.load(base + 1, mask=m & (e + 2 < D), other=0)
        h2 = tl.load(base + 2, mask=m & (e + 4 < D), other=0)
        h3 = tl.load(base + 3, mask=m & (e + 6 < D), other=0)
        h4 = tl.load(base + 4, mask=m & (e + 8 < D), other=0)
        h5 = tl.load(base + 5, mask=m & (e + 10 < D), other=0)
        h6 = tl.load(base + 6, mask=m & (e + 12 < D), other=0)
        h7 = tl.load(base + 7, mask=m & (e + 14 < D), other=0)
        y = tl.join(
            tl.join(tl.join(h0, h4), tl.join(h2, h6)),
            tl.join(tl.join(h1, h5), tl.join(h3, h7)),
        )  # (G, N) or (N, G), then halfword j at [.., j >> 2, j >> 1 & 1, j & 1]
        if GROUPS_OUTER:
            y = tl.permute(y, (1, 0, 2, 3, 4))
        y = tl.reshape(y, [N, BLOCK_D // 2])
        raw = tl.reshape(
            tl.join((y & 0xFF).to(tl.uint8), (y >> 8).to(tl.uint8)), [N, BLOCK_D]
        )
    else:
        d = tl.arange(0, BLOCK_D)[None, :]
        raw = tl.load(cache_ptr + slot[:, None] + d, mask=ok2 & (d < D), other=0)
    if FP8_E4B15:
        return raw.to(tl.float8e4b15, bitcast=True).to(tl.float16)
    else:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _pow2_floor(x):
    """The power of two at or below each positive normal float32 ``x``; 0 for 0 and
    subnormals."""
    return (x.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _operand(x, FENCE: tl.constexpr):
    """``x`` (fp16 or bf16) as it is; with FENCE through an opaque move: Triton sizes a
    tensor core operand's register fragments (kWidth) by the narrowest load or join
    that it finds behind both operands, and the decode's joins halve it, so that the
    other operand (the query, the probabilities) is loaded 64 bits at a time and
    moved into place before every MMA; behind an instruction with side effects it
    finds neither, and the fragments are loaded by ldmatrix where the MMA wants them.
    GPU only (inline PTX)."""
    if not FENCE:
        return x
    else:
        return tl.inline_asm_elementwise(
            asm="mov.b32 $0, $1;",
            constraints="=r,r",
            args=[x],
            dtype=x.dtype,
            is_pure=False,
            pack=2,
        )


@triton.jit
def _prefetch_l2(ptr, ok, INTERP: tl.constexpr):
    """Asks L2 for the cache line holding each byte ``ptr`` where ``ok``
    (``prefetch.global.L2``: a hint, nothing is read into registers and nothing waits
    for it). Returns a dummy int32 (an instruction with side effects is kept unused).
    Under the interpreter (INTERP), a masked load of the same bytes, thrown away: the
    addresses go through the tests' bounds checks (tests/bounds.py)."""
    if INTERP:
        return tl.load(ptr, mask=ok, other=0).to(tl.int32)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.ne.b32 p, $2, 0;
        @p prefetch.global.L2 [$1];
        mov.b32 $0, 0;
        }""",
        constraints="=r,l,r",
        args=[ptr, ok.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _pow2_inverse_half(x):
    """0.5 / x for a power of two x = 2^e, e in [-126, 125] (one integer subtraction
    of the exponent fields; outside that range not the quotient)."""
    bits = (253 << 23) - x.to(tl.int32, bitcast=True)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    """The dot a @ b plus acc, on the tensor cores; in float32 under the interpreter
    (its fp16 and bf16 dots are not the GPU's)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc, out_dtype=tl.float32)


# ---------------------------------------------------------------------------
# The attention over the cached positions
# ---------------------------------------------------------------------------


# The tile's orientation. The tensor cores' MMA takes 16 rows on its M side and 8 on
# its N side, so a tile of fewer than 16 query rows (decode: the group's G rows) holds
# them on the N side and the positions on the M side (TRANSPOSED): the score tile is
# (positions, rows), the value dot's accumulator (D, rows). An 8-row tile then takes
# half the MMAs and half the accumulator of a 16-row one (NOTES.md §47).
@triton.jit
def _per_row(x, TRANSPOSED: tl.constexpr):
    """The (rows,) vector ``x`` broadcast over the tile's positions."""
    if TRANSPOSED:
        return x[None, :]
    else:
        return x[:, None]


@triton.jit
def _per_position(x, TRANSPOSED: tl.constexpr):
    """The (positions,) vector ``x`` broadcast over the tile's rows."""
    if TRANSPOSED:
        return x[:, None]
    else:
        return x[None, :]


@triton.jit
def _score_tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    """A float32 score tile of zeros: (rows, positions), or (positions, rows)
    TRANSPOSED."""
    if TRANSPOSED:
        return tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        return tl.zeros([BLOCK_M, BLOCK_N], tl.float32)


@triton.jit
def _key_operand(k, TRANSPOSED: tl.constexpr):
    """The decoded keys (positions, D) as ``_scores`` takes them: (D, positions), or
    as they are TRANSPOSED."""
    if TRANSPOSED:
        return k
    else:
        return tl.trans(k)


@triton.jit
def _scores(q, k, acc, TRANSPOSED: tl.constexpr, DOT_F32: tl.constexpr):
    """The scores of the rows' operand ``q`` (rows, D) against the keys ``k``
    (``_key_operand``), plus ``acc``: (rows, positions); TRANSPOSED, ``q`` (D, rows)
    (transposed once per split) and (positions, rows)."""
    if TRANSPOSED:
        return _dot(k, q, acc, DOT_F32)
    else:
        return _dot(q, k, acc, DOT_F32)


@triton.jit
def _block_ids(bt_row, n0, max_blocks, s_bt_col, BLOCK_N: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, WHOLE: tl.constexpr):  # fmt: skip
    """(BLOCK_N,) int32: the block ids of positions n0 .. n0 + BLOCK_N - 1 of the
    request (its block-table row ``bt_row``), -1 past its ``max_blocks`` columns
    (positions past the split's end read their column where there is one: the id
    goes unused). WHOLE: tiles cover whole blocks (n0 a multiple of BLOCK_N, BLOCK_N
    of BLOCK_SIZE)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    if WHOLE:
        col = n0 // BLOCK_SIZE + tl.arange(0, BLOCK_N) // BLOCK_SIZE
    else:
        col = pos // BLOCK_SIZE
    return tl.load(bt_row + col * s_bt_col, mask=col < max_blocks, other=-1)


@triton.jit
def _split_attention(
    q_hi,
    q_lo,
    row_scale,
    cache_ptr,
    bt_row,
    table_ptr,
    head_off,
    start,
    end,
    num_blocks,
    max_blocks,
    s_cache_block,
    s_cache_pos,
    s_bt_col,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KEY_BITS: tl.constexpr,
    KEY_INDEX_BYTES: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    VALUE_INDEX_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    Q_BF16: tl.constexpr,
    HALVES: tl.constexpr,
    Q_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    EXACT: tl.constexpr,
    LOOKUP: tl.constexpr,
    FENCE: tl.constexpr,
    PREFETCH: tl.constexpr,
    LOADS_FIRST: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """The online softmax of the rows (q_hi, q_lo: the query's dot operands; row_scale
    their scores' factor, log2 units) over positions [start, end) of one kv head.
    Returns (m, l, z, acc, unit, seen): the running max and sum, the zero term, the
    value dot's sum in units of ``unit``, and whether a value scale or zero was not
    finite. EXACT: every tile's values in the uncentred float32 form ``i s + z``,
    whose NaN and inf elements are one softmax's; otherwise the centred fp16 form, and
    such a tile only sets ``seen`` (the caller runs the split again, EXACT). PREFETCH:
    the slots of the tile that many ahead are asked of L2 while this one is read and
    decoded (``_prefetch_l2``), so that their loads wait for L2 instead of DRAM.
    LOADS_FIRST: a tile's value bytes are loaded with its keys', before the keys are
    decoded, so that their waits overlap (more registers held across the key step);
    otherwise where they are used.
    TRANSPOSED: the tiles (positions, rows), the accumulator (D, rows) until the
    end (``_per_row``)."""
    BLOCK_M: tl.constexpr = q_hi.shape[0]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)
    z_i = tl.zeros([BLOCK_M], tl.float32)  # sum of p x the value's (centred) zero
    POS: tl.constexpr = 0 if TRANSPOSED else 1  # the tile's axis of positions
    if TRANSPOSED:
        acc = tl.zeros([BLOCK_D, BLOCK_M], tl.float32)  # in units of `unit`
        q_hi = tl.trans(q_hi)
        q_lo = tl.trans(q_lo)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # in units of `unit`
    # the power of two at or below the largest value scale seen (NOTES.md §27); the
    # exact form's at least 2^-60, so that no finite value over it overflows
    unit = tl.full([], 2.0**-60 if EXACT else 2.0**-126, tl.float32)
    seen = tl.zeros([], tl.int32)
    if NORM_CORRECTION:
        ones = tl.full(q_hi.shape, 1.0, tl.float16)  # the query's operand's shape
    if LOOKUP:
        lo0, lo1, hi0, hi1 = _table_bytes(table_ptr)
        if KEY_BITS == 4:
            lo2, lo3, hi2, hi3 = _table_bytes(table_ptr + 8)
    # Each position's offset within its block (and the kv head's): the same every
    # tile where tiles cover whole blocks (n0 is a multiple of BLOCK_N, splits
    # are), so computed once; in the loop only the block id and its product.
    WHOLE: tl.constexpr = BLOCK_N >= BLOCK_SIZE and (BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0
    if WHOLE:
        within = (tl.arange(0, BLOCK_N) % BLOCK_SIZE).to(tl.int64) * s_cache_pos
        within = within + head_off
    # the slot's bytes, prefetched at 32-byte steps (L2's sectors) and at its last
    # byte: every sector it touches, whether a prefetch fills a sector or a line, by
    # addresses inside the slot alone
    SLOT: tl.constexpr = KEY_BYTES + VALUE_INDEX_BYTES + 4
    for n0 in range(start, end, BLOCK_N):
        # -- where each position's slot is ---------------------------------------------
        pos = n0 + tl.arange(0, BLOCK_N)
        in_c = pos < end
        if WHOLE:
            inner = within
        else:
            inner = (pos % BLOCK_SIZE).to(tl.int64) * s_cache_pos + head_off
        blk = _block_ids(bt_row, n0, max_blocks, s_bt_col, BLOCK_N, BLOCK_SIZE, WHOLE)
        if PREFETCH > 0:
            # the slots PREFETCH tiles ahead asked of L2 while this one is read and
            # decoded: their loads then wait for L2, not DRAM
            n1 = n0 + PREFETCH * BLOCK_N
            p1 = n1 + tl.arange(0, BLOCK_N)
            blk1 = _block_ids(bt_row, n1, max_blocks, s_bt_col, BLOCK_N, BLOCK_SIZE,
                              WHOLE)  # fmt: skip
            if WHOLE:
                inner1 = within
            else:
                inner1 = (p1 % BLOCK_SIZE).to(tl.int64) * s_cache_pos + head_off
            ok1 = (p1 < end) & (
                blk1.to(tl.uint32, bitcast=True) < num_blocks.to(tl.uint32)
            )
            wide1 = blk1.to(tl.uint32, bitcast=True).to(tl.uint64)
            off1 = (wide1 * s_cache_block.to(tl.uint64)).to(tl.int64, bitcast=True)
            off1 = off1 + inner1
            if DOT_F32:
                off1 = tl.where(ok1, off1, 0)  # the interpreter: as ``slot`` below
            at1 = cache_ptr + off1
            for b in tl.static_range(0, SLOT - 1, 32):
                _prefetch_l2(at1 + b, ok1, DOT_F32)
            _prefetch_l2(at1 + (SLOT - 1), ok1, DOT_F32)
        # in [0, num_blocks) in one unsigned comparison (num_blocks >= 0)
        good = blk.to(tl.uint32, bitcast=True) < num_blocks.to(tl.uint32)
        ok = in_c & good  # only these are read
        bad = in_c & (~good)  # a block id outside the cache: NaN
        # unsigned: a good id and the stride are >= 0, so the 64-bit product is one
        # wide multiply (a bad id's offset is never used)
        wide = blk.to(tl.uint32, bitcast=True).to(tl.uint64)
        slot = (wide * s_cache_block.to(tl.uint64)).to(tl.int64, bitcast=True) + inner
        if DOT_F32:
            # the interpreter: no offset of a bad block id formed, even unread (on a
            # GPU the masked lanes' addresses are never used)
            slot = tl.where(ok, slot, 0)
        # -- the slots' bytes: the keys', and with LOADS_FIRST the rest ---------------
        kslot = cache_ptr + slot
        vslot = kslot + KEY_BYTES
        if HALVES and KEY_BITS != 8:
            k0, k1, k2, k3 = _halfwords(kslot, ok, D, KEY_BITS, BLOCK_D)
        if LOADS_FIRST:
            if KEY_BITS != 8:
                a = _fp16_field(kslot + KEY_INDEX_BYTES, ok, HALVES)
            if HALVES:
                v0, v1, v2, v3 = _halfwords(vslot, ok, D, VALUE_BITS, BLOCK_D)
            vs = _fp16_field(vslot + VALUE_INDEX_BYTES, ok, HALVES)
            vz = _fp16_field(vslot + VALUE_INDEX_BYTES + 2, ok, HALVES)
        # -- scores: q . (a_n c_n), a_n applied to the score tile ---------------------
        if KEY_BITS == 8:
            k = _fp8_keys(cache_ptr, slot, ok, D, BLOCK_D, FP8_E4B15, HALVES)
            if Q_BF16:
                k = k.to(tl.bfloat16)  # exact: fp8 fits bf16
            k = _key_operand(_operand(k, FENCE), TRANSPOSED)
            s = _scores(
                q_hi, k, _score_tile(BLOCK_M, BLOCK_N, TRANSPOSED), TRANSPOSED, DOT_F32
            )
            a = tl.where(bad, float("nan"), 1.0)
        else:
            if LOOKUP and HALVES and KEY_BITS == 3:
                kc = _keys3(k0, k1, k2, BLOCK_N, BLOCK_D, lo0, lo1, hi0, hi1)
            elif LOOKUP and HALVES:
                kc = _keys4(k0, k1, k2, k3, BLOCK_N, BLOCK_D, lo0, lo1, lo2, lo3,
                            hi0, hi1, hi2, hi3)  # fmt: skip
            else:
                if HALVES:
                    idx = _indices_of(k0, k1, k2, k3, BLOCK_N, KEY_BITS, BLOCK_D)
                else:
                    idx = _unpack(kslot[:, None], ok[:, None], D, KEY_BITS, BLOCK_D)
                if LOOKUP and KEY_BITS == 3:
                    kc = _lookup8(idx, lo0, lo1, hi0, hi1)
                else:
                    # indices are in range whatever the bytes: the table read unmasked
                    kc = tl.load(table_ptr + idx)
            kt = _key_operand(_operand(kc, FENCE), TRANSPOSED)
            s = _scores(
                q_hi, kt, _score_tile(BLOCK_M, BLOCK_N, TRANSPOSED), TRANSPOSED, DOT_F32
            )
            if Q_SPLIT:
                s = _scores(q_lo, kt, s, TRANSPOSED, DOT_F32)
            if not LOADS_FIRST:
                a = _fp16_field(kslot + KEY_INDEX_BYTES, ok, HALVES)
            # a norm that is not finite: NaN (its key's infinities meet the query's
            # mixed signs in one softmax)
            a = tl.where((tl.abs(a) < float("inf")) & (~bad), a, float("nan"))
            if NORM_CORRECTION:
                # |c_n|^2: the squares rounded to fp16, exact products, float32 sums
                zero = _score_tile(BLOCK_M, BLOCK_N, TRANSPOSED)
                s = s * tl.math.rsqrt(
                    _scores(ones, kt * kt, zero, TRANSPOSED, DOT_F32) + 1e-16
                )
        t = tl.where(
            _per_position(in_c, TRANSPOSED),
            s * _per_position(a, TRANSPOSED),
            float("-inf"),
        )
        m_new = tl.maximum(m_i, tl.max(t, POS) * row_scale)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(t * _per_row(row_scale, TRANSPOSED) - _per_row(m_safe, TRANSPOSED))
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, POS)
        m_i = m_new
        # -- values: p . (i s + z) = (p s) . (i - h) + p . (z + h s) ------------------
        if not LOADS_FIRST:
            if HALVES:
                v0, v1, v2, v3 = _halfwords(vslot, ok, D, VALUE_BITS, BLOCK_D)
            vs = _fp16_field(vslot + VALUE_INDEX_BYTES, ok, HALVES)
            vz = _fp16_field(vslot + VALUE_INDEX_BYTES + 2, ok, HALVES)
        BY_LOOKUP: tl.constexpr = LOOKUP and HALVES and VALUE_BITS == 3
        if EXACT or not BY_LOOKUP:
            if HALVES:
                vidx = _indices_of(v0, v1, v2, v3, BLOCK_N, VALUE_BITS, BLOCK_D)
            else:
                vidx = _unpack(vslot[:, None], ok[:, None], D, VALUE_BITS, BLOCK_D)
        finite = tl.abs(vs) + tl.abs(vz) < float("inf")  # NaN: not
        if EXACT:
            top = tl.max(tl.where(finite, tl.abs(vs), 0.0), 0)
            new_unit = tl.maximum(unit, _pow2_floor(top))
            vf = vidx.to(tl.float32) * (vs / new_unit)[:, None]
            z_i = z_i * alpha + tl.sum(p * _per_position(vz, TRANSPOSED), POS)
            acc = acc * _per_row(alpha * (unit / new_unit), TRANSPOSED)
            if TRANSPOSED:  # noqa: SIM108 - a constexpr: one branch is compiled
                acc = tl.dot(tl.trans(vf), p, acc)
            else:
                acc = tl.dot(p, vf, acc)
        else:
            # the largest |scale|; inf where a scale or zero is not finite
            top = tl.max(tl.where(finite, tl.abs(vs), float("inf")), 0)
            seen = tl.maximum(seen, (top == float("inf")).to(tl.int32))
            new_unit = tl.maximum(unit, _pow2_floor(top))
            # halved: the centred indices are doubled (exact: unit is a power of
            # two). 0.5 / new_unit from its exponent (new_unit = 2^e, e in [-126, 15]
            # while every field is finite), exact without a division's range checks;
            # not the quotient only in a tile that sets seen, whose split runs again
            half = _pow2_inverse_half(new_unit)
            pv = p * _per_position(vs * half, TRANSPOSED)
            zc = vz + ((1 << (VALUE_BITS - 1)) - 0.5) * vs
            z_i = z_i * alpha + tl.sum(p * _per_position(zc, TRANSPOSED), POS)
            # unit / new_unit = 2 unit (0.5 / new_unit), exact (at least 2^-142: a
            # float32 subnormal, and the multiplications keep subnormals)
            acc = acc * _per_row(alpha * ((unit * half) * 2.0), TRANSPOSED)
            if BY_LOOKUP:
                vc = _centred3(v0, v1, v2, BLOCK_N, BLOCK_D)
            else:
                vc = _centred(vidx, VALUE_BITS)
            if TRANSPOSED:
                vt = _operand(tl.trans(vc), FENCE)
                acc = _dot(vt, pv.to(tl.float16), acc, DOT_F32)
            else:
                vc = _operand(vc, FENCE)
                acc = _dot(pv.to(tl.float16), vc, acc, DOT_F32)
        unit = new_unit
    if TRANSPOSED:
        acc = tl.trans(acc)
    return m_i, l_i, z_i, acc, unit, seen


@triton.jit(do_not_specialize=["num_blocks", "max_blocks"])
def _paged_kernel(
    q_ptr,  # MSE keys: the rotated query (served tokens, Hq, D) float32; fp8: query
    cache_ptr,
    block_table_ptr,
    table_ptr,  # (16,) fp16 centroids (MSE keys)
    work_ptr,  # (programs, WORK_FIELDS) int32
    o_ptr,  # (part_rows, Hq, D) float32
    lse_ptr,  # (part_rows, Hq) float32
    err_ptr,  # int64 (1,): the smallest (request << 32) + column with a bad id (CHECK)
    num_blocks,
    max_blocks,
    s_q_tok,
    s_q_head,
    s_q_d,
    s_cache_block,
    s_cache_pos,
    s_cache_head,
    s_bt_req,
    s_bt_col,
    qk_scale,  # softmax scale x log2(e)
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's positions per block
    KEY_BITS: tl.constexpr,
    KEY_INDEX_BYTES: tl.constexpr,
    KEY_BYTES: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    VALUE_INDEX_BYTES: tl.constexpr,
    NORM_CORRECTION: tl.constexpr,
    FP8_E4B15: tl.constexpr,
    Q_BF16: tl.constexpr,  # fp8 keys: the dot in bf16 (the query's dtype)
    HALVES: tl.constexpr,  # the cache read in 16-bit loads (dequant.halves_ok)
    Q_SPLIT: tl.constexpr,  # MSE keys: the rotated query as fp16 hi + lo
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,  # the interpreter: dots in float32
    LOOKUP: tl.constexpr,  # 3- and 4-bit keys, 3-bit values: byte permutes (GPU)
    FENCE: tl.constexpr,  # the dots' decoded operands behind _operand (GPU)
    PREFETCH: tl.constexpr,  # the slots this many tiles ahead into L2 (0: none)
    LOADS_FIRST: tl.constexpr,  # values' bytes loaded with the keys' (PagedPlan)
    TRANSPOSED: tl.constexpr,  # tiles of (positions, rows) (PagedPlan.transposed)
    CHECK: tl.constexpr,  # record bad block ids at err_ptr
):
    """One work item (WORK_FIELDS): BLOCK_M query rows (token-major, the group's heads
    inner) of one kv head against one split of the request's cached positions; writes
    the split's partial (out, lse) for those rows."""
    w = work_ptr + tl.program_id(0) * 9
    req = tl.load(w).to(tl.int64)
    kvh = tl.load(w + 1).to(tl.int64)
    tok0 = tl.load(w + 2)
    crow0 = tl.load(w + 3)
    n_rows = tl.load(w + 4)
    u = tl.load(w + 5) + tl.arange(0, BLOCK_M)  # the tile's rows
    start = tl.load(w + 6)
    end = tl.load(w + 7)
    part0 = tl.load(w + 8)
    row_ok = u < n_rows
    head = kvh * GROUP + u % GROUP
    d = tl.arange(0, BLOCK_D)
    qmask = row_ok[:, None] & (d < D)[None, :]
    if KEY_BITS == 8:
        tok = (tok0 + u // GROUP).to(tl.int64)
        q_hi = tl.load(
            q_ptr + tok[:, None] * s_q_tok + head[:, None] * s_q_head + d * s_q_d,
            mask=qmask,
            other=0.0,
        )
        q_lo = q_hi
        row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale
    else:
        crow = (crow0 + u // GROUP).to(tl.int64)
        q = tl.load(
            q_ptr + crow[:, None] * s_q_tok + head[:, None] * s_q_head + d[None, :],
            mask=qmask,
            other=0.0,
        )
        # each row scaled by the power of two at or below its largest |element|
        # (exact), so that hi + lo fits fp16 whatever the query's range; the scale
        # goes into the scores' one multiplication
        pw = _pow2_floor(tl.max(tl.abs(q), 1))
        pw = tl.where(pw == 0, 1.0, pw)  # zeros or subnormals: as they are
        q = q / pw[:, None]
        row_scale = pw * qk_scale
        q_hi = q.to(tl.float16)
        q_lo = (q - q_hi.to(tl.float32)).to(tl.float16)
    bt_row = block_table_ptr + req * s_bt_req
    head_off = kvh * s_cache_head
    if CHECK:  # noqa: SIM102 - CHECK is a constexpr: the branch is compiled out
        if (kvh == 0) & (tl.load(w + 5) == 0):
            # one program per split: the block ids it reads, the smallest (request,
            # column) outside [0, num_blocks) for the caller's report (prefill.py)
            cols = tl.cdiv(end, BLOCK_SIZE)
            for c0 in range(start // BLOCK_SIZE, cols, 64):
                col = c0 + tl.arange(0, 64)
                in_c = (col < cols) & (col < max_blocks)
                blk = tl.load(bt_row + col * s_bt_col, mask=in_c, other=0)
                bad = in_c & ((blk < 0) | (blk >= num_blocks))
                tl.atomic_min(err_ptr + tl.zeros_like(col).to(tl.int64),
                              (req << 32) + col.to(tl.int64), mask=bad)  # fmt: skip
    m_i, l_i, z_i, acc, unit, seen = _split_attention(
        q_hi, q_lo, row_scale, cache_ptr, bt_row, table_ptr, head_off, start, end,
        num_blocks, max_blocks, s_cache_block, s_cache_pos, s_bt_col, D, BLOCK_D,
        BLOCK_SIZE, KEY_BITS, KEY_INDEX_BYTES, KEY_BYTES, VALUE_BITS,
        VALUE_INDEX_BYTES, NORM_CORRECTION, FP8_E4B15, Q_BF16, HALVES, Q_SPLIT,
        BLOCK_N, DOT_F32, False, LOOKUP, FENCE, PREFETCH, LOADS_FIRST, TRANSPOSED,
    )  # fmt: skip
    if seen > 0:  # a value field that is not finite: the split again, exactly
        m_i, l_i, z_i, acc, unit, seen = _split_attention(
            q_hi, q_lo, row_scale, cache_ptr, bt_row, table_ptr, head_off, start,
            end, num_blocks, max_blocks, s_cache_block, s_cache_pos, s_bt_col, D,
            BLOCK_D, BLOCK_SIZE, KEY_BITS, KEY_INDEX_BYTES, KEY_BYTES, VALUE_BITS,
            VALUE_INDEX_BYTES, NORM_CORRECTION, FP8_E4B15, Q_BF16, HALVES, Q_SPLIT,
            BLOCK_N, DOT_F32, True, LOOKUP, FENCE, PREFETCH, LOADS_FIRST, TRANSPOSED,
        )  # fmt: skip
    acc = acc * unit + z_i[:, None]
    empty = l_i == 0  # no key in the split (a NaN sum stays NaN: out and lse)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(
        empty,
        float("-inf"),
        (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453,
    )
    prow = (part0 + u // GROUP).to(tl.int64)
    tl.store(
        o_ptr + (prow[:, None] * HQ + head[:, None]) * D + d[None, :], out, mask=qmask
    )
    tl.store(lse_ptr + prow * HQ + head, lse, mask=row_ok)


# ---------------------------------------------------------------------------
# The combine of the splits (and the chunk's own partial)
# ---------------------------------------------------------------------------


@triton.jit
def _own_keys(
    q_ptr,
    k_ptr,
    v_ptr,
    tok,
    q0,
    live,
    head,
    n_own,
    s_q_tok,
    s_q_head,
    s_q_d,
    s_k_tok,
    s_k_head,
    s_k_d,
    s_v_tok,
    s_v_head,
    s_v_d,
    scale,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """The chunk's own causal attention of BLOCK_T tokens for one query head: token
    ``tok`` over its request's keys ``q0 .. tok`` (at most ``n_own``), scores and
    sums in float32 (natural log). Returns (m, total, acc, nan): the largest score,
    the sum of exp(score - m), the unnormalized sum of exp(score - m) x value, and
    whether a score was NaN or +inf (the row is NaN, as one softmax gives). A key
    past the token is never read; a -inf score weighs 0 (times a value's inf: NaN,
    as a matmul gives)."""
    d = tl.arange(0, BLOCK_D)[None, :]
    dm = live[:, None] & (d < D)
    kv_head = head // GROUP
    q = tl.load(q_ptr + tok[:, None] * s_q_tok + head * s_q_head + d * s_q_d,
                mask=dm, other=0.0).to(tl.float32)  # fmt: skip
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    nan = tl.zeros([BLOCK_T], tl.int1)
    for j in range(0, n_own):
        key = q0 + j
        see = live & (key <= tok)
        sm = see[:, None] & (d < D)
        k = tl.load(k_ptr + key[:, None] * s_k_tok + kv_head * s_k_head + d * s_k_d,
                    mask=sm, other=0.0).to(tl.float32)  # fmt: skip
        s = tl.sum(q * k, axis=1) * scale
        bad = (s != s) | (s == float("inf"))
        nan = nan | (see & bad)
        s = tl.where(see & ~bad, s, float("-inf"))
        m_new = tl.maximum(m, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe)
        v = tl.load(v_ptr + key[:, None] * s_v_tok + kv_head * s_v_head + d * s_v_d,
                    mask=sm, other=0.0).to(tl.float32)  # fmt: skip
        total = total * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v  # p = 0, v = 0 past the token
        m = m_new
    return m, total, acc, nan


@triton.jit(do_not_specialize=["n_tokens", "max_splits", "new_lse_row0", "n_own"])
def _combine_kernel(
    po_ptr,  # (part_rows, HQ, D) float32
    plse_ptr,  # (part_rows, HQ) float32
    tokens_ptr,  # (served tokens, TOKEN_FIELDS) int32
    new_ptr,  # the chunk's partial (N, HQ, D), any float dtype (HAS_NEW)
    new_lse_ptr,  # (HQ, N') float32, FlashAttention's conventions (HAS_NEW)
    q_ptr,  # (N, HQ, D) the query (OWN_KEYS)
    k_ptr,  # (N, HK, D) the chunk's keys (OWN_KEYS)
    v_ptr,  # (N, HK, D) the chunk's values (OWN_KEYS)
    out_ptr,  # (N, HQ, D)
    lse_out_ptr,  # (HQ, N) float32 (WRITE_LSE)
    n_tokens,
    max_splits,
    n_own,  # the most query tokens of a served request (OWN_KEYS)
    s_new_tok,
    s_new_head,
    s_new_lse_head,
    new_lse_row0,  # the token whose chunk lse is new_lse's first column
    s_q_tok,
    s_q_head,
    s_q_d,
    s_k_tok,
    s_k_head,
    s_k_d,
    s_v_tok,
    s_v_head,
    s_v_d,
    scale,  # the softmax scale (OWN_KEYS)
    s_out_tok,
    s_out_head,
    s_lse_head,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HAS_NEW: tl.constexpr,
    OWN_KEYS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # see _utils.round_bf16
    TOKEN_FIELDS: tl.constexpr,
):
    """The out (and lse) of BLOCK_T served tokens for one head: the log-sum-exp merge of
    their splits' partials and the chunk's own attention (OWN_KEYS: computed here;
    HAS_NEW: the partial given), with merge.py's rules (a side without keys weighs
    nothing and is never read; a NaN sum makes the row NaN)."""
    head = tl.program_id(1).to(tl.int64)  # int64 addresses: head x a head's stride
    c = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # served token rows
    live = c < n_tokens
    fields = tokens_ptr + c * TOKEN_FIELDS
    tok = tl.load(fields, mask=live, other=0).to(tl.int64)
    first = tl.load(fields + 1, mask=live, other=0)
    n_splits = tl.load(fields + 2, mask=live, other=0)
    stride = tl.load(fields + 3, mask=live, other=0)
    d = tl.arange(0, BLOCK_D)[None, :]
    dm = live[:, None] & (d < D)
    # first the largest log-sum-exp and whether any is NaN
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_T], tl.int1)
    for j in range(0, max_splits):
        row = (first + j * stride).to(tl.int64)
        lj = tl.load(plse_ptr + row * HQ + head, mask=live & (j < n_splits),
                     other=float("-inf"))  # fmt: skip
        nan = nan | (lj != lj)
        m = tl.maximum(m, lj)
    if OWN_KEYS:
        q0 = tl.load(fields + 4, mask=live, other=0).to(tl.int64)
        m_o, l_o, acc_o, nan_o = _own_keys(
            q_ptr, k_ptr, v_ptr, tok, q0, live, head, n_own,
            s_q_tok, s_q_head, s_q_d, s_k_tok, s_k_head, s_k_d, s_v_tok, s_v_head,
            s_v_d, scale, GROUP, D, BLOCK_D, BLOCK_T,
        )  # fmt: skip
        nan = nan | nan_o
        m = tl.maximum(m, m_o)
    if HAS_NEW:
        o_s = tl.load(
            new_ptr + tok[:, None] * s_new_tok + head * s_new_head + d, mask=dm, other=0
        ).to(tl.float32)
        l_s = tl.load(new_lse_ptr + head * s_new_lse_head + (tok - new_lse_row0),
                      mask=live, other=float("-inf"))  # fmt: skip
        # FlashAttention's +-inf: no keys (a zero row) or a sum that is not a number
        # (a NaN row)
        s_nan_row = tl.max(tl.where(o_s != o_s, 1, 0), axis=1) > 0
        s_inf = (l_s == float("inf")) | (l_s == float("-inf"))
        l_s = tl.where(s_inf, tl.where(s_nan_row, float("nan"), float("-inf")), l_s)
        nan = nan | (l_s != l_s)
        m = tl.maximum(m, l_s)
    m = tl.where((m == float("-inf")) | (m != m), 0.0, m)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_T], tl.float32)
    for j in range(0, max_splits):
        row = (first + j * stride).to(tl.int64)
        lj = tl.load(plse_ptr + row * HQ + head, mask=live & (j < n_splits),
                     other=float("-inf"))  # fmt: skip
        read = live & (lj != float("-inf"))  # a split without keys is never read
        o = tl.load(
            po_ptr + (row[:, None] * HQ + head) * D + d,
            mask=read[:, None] & (d < D),
            other=0.0,
        )
        wj = tl.exp(lj - m)
        acc += _term(wj[:, None], o)
        total += wj
    if OWN_KEYS:
        # the own keys' sums, taken from their largest score to the merge's
        w_o = tl.exp(m_o - m)
        acc += _term(w_o[:, None], acc_o)
        total += w_o * l_o
    if HAS_NEW:
        w_s = tl.exp(l_s - m)
        acc += _term(w_s[:, None], o_s)
        total += w_s
    o = acc * tl.where(total > 0, 1.0 / total, 0.0)[:, None]
    o = tl.where(nan[:, None], float("nan"), o)
    o = round_bf16(o, ROUND_BF16).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tok[:, None] * s_out_tok + head * s_out_head + d, o, mask=dm)
    if WRITE_LSE:
        lse = tl.where(total > 0, m + tl.log(total), float("-inf"))
        tl.store(
            lse_out_ptr + head * s_lse_head + tok,
            tl.where(nan, float("nan"), lse),
            mask=live,
        )


launch_rotate = Launcher(_rotate_kernel)
# mma.sync for every tile (MAX_GPU_TILE; NOTES.md §33, §63)
launch_paged = Launcher(_paged_kernel, mma_sync=True)
launch_combine = Launcher(_combine_kernel)


# ---------------------------------------------------------------------------
# Running a plan
# ---------------------------------------------------------------------------


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: PagedPlan,
    work: torch.Tensor,
    tokens: torch.Tensor,
    scratch: PagedScratch,
    out: torch.Tensor,
    **kwargs,
) -> None:
    """The memory-bound path for ``plan``'s tokens: ``paged_launches``' kernels,
    launched (the arguments as it says)."""
    for launch, grid, args, options in paged_launches(
        query, kv_cache, block_table, plan, work, tokens, scratch, out, **kwargs
    ):
        launch(grid, *args, **options)


def paged_launches(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    plan: PagedPlan,
    work: torch.Tensor,
    tokens: torch.Tensor,
    scratch: PagedScratch,
    out: torch.Tensor,
    *,
    cfg: TQConfig,
    centroids: torch.Tensor | None,
    rotation: torch.Tensor | None,
    scale: float,
    lse: torch.Tensor | None = None,
    new: torch.Tensor | None = None,
    new_lse: torch.Tensor | None = None,
    new_lse_row0: int = 0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    err: torch.Tensor | None = None,
    q_split: bool | None = None,
    lookup: bool = True,
    fence: bool = True,
) -> list[tuple[Launcher, tuple, tuple, dict]]:
    """The launches of the memory-bound path for ``plan``'s tokens, as (launcher,
    grid, arguments, options), in order; none where it serves no token. They write
    ``out`` rows (and ``lse``) of each
    served token, over its request's cached positions and its chunk's own keys: with
    ``plan.own_keys`` from ``key`` and ``value`` (required), else, given ``new`` and
    ``new_lse``, merged with that partial (the chunk's own causal attention, as
    ``attention.varlen_attention`` writes and returns it; without them, the cached
    positions alone).

    query: (N, Hq, D) fp16/bf16, any strides. kv_cache: uint8 (num_blocks,
    block_size, Hk, slot_bytes), unit stride over the slot. block_table: int32 (B,
    max_blocks). work, tokens: ``plan.upload``'s int32 arrays. scratch:
    ``plan.carve`` of a buffer of ``plan.scratch_bytes``. out: (N, Hq, D), unit
    stride over D, any float dtype: only the served tokens' rows are written. lse:
    (Hq, N) float32, unit stride over N, or None. new: (N, Hq, D), unit stride over D
    (may be ``out`` itself: each element is read before it is written); new_lse: (Hq,
    N') float32, unit stride over N', column ``t - new_lse_row0`` token t's. key,
    value: (N, Hk, D) of the query's dtype, any strides (own_keys). err: int64
    (1,) on the device, or None: the smallest ``(request << 32) + column`` of a block id
    outside ``[0, num_blocks)`` among those read, by ``atomic_min``. q_split: the
    rotated query as fp16 hi + lo (two key dots); off, its fp16 part alone (one);
    default ``q_split_by_default``. lookup: 3- and 4-bit
    centroids and 3-bit values by byte permutes on a GPU (off: a gather and the
    arithmetic, as in the interpreter; the same bits). fence: on a GPU, the decoded
    operands of the tensor core dots behind ``_operand`` (off: Triton's own
    fragments, the same products summed in another grouping).
    Tensors are trusted (the caller's plan validated the lengths).
    """
    n, hq, d = query.shape
    hk = kv_cache.shape[2]
    if (hq, hk, d) != (plan.num_q_heads, plan.num_kv_heads, plan.head_dim):
        raise ValueError(
            f"the plan is for (Hq, Hk, D) = {(plan.num_q_heads, plan.num_kv_heads, plan.head_dim)}"  # noqa: E501
            f", got query and kv_cache of {(hq, hk, d)}"
        )
    if kv_cache.dtype != torch.uint8 or kv_cache.ndim != 4 or kv_cache.stride(3) != 1:
        raise ValueError(
            "kv_cache must be a uint8 (num_blocks, block_size, Hk, slot_bytes) tensor "
            "with unit stride over the slot"
        )
    if plan.rotated and (centroids is None or centroids.numel() < 2**cfg.key_bits):
        raise ValueError(
            f"centroids must hold {2**cfg.key_bits} entries for {cfg.key_bits}-bit "
            f"keys, got {None if centroids is None else centroids.numel()}"
        )
    if plan.rotated and (rotation is None or rotation.shape != (d, d)):
        raise ValueError(f"rotation must be ({d}, {d}) for MSE keys")
    if plan.own_keys:
        for name, t in (("key", key), ("value", value)):
            if t is None or t.shape != (n, hk, d) or t.dtype != query.dtype:
                raise ValueError(
                    f"{name} must be a {query.dtype} ({n}, {hk}, {d}) tensor for a "
                    f"plan whose combine attends to the chunk's own keys, got "
                    f"{None if t is None else (t.dtype, tuple(t.shape))}"
                )
        if new is not None:
            raise ValueError("new: a plan with own_keys takes key and value, not new")
    interp = interpreting() or not query.is_cuda
    if q_split is None:
        q_split = q_split_by_default(query.dtype)
    block_d = next_power_of_2(d)
    tokens_n, programs = plan.num_tokens, plan.programs  # len() of tensors: read once
    if tokens_n == 0:
        return []
    launches: list[tuple[Launcher, tuple, tuple, dict]] = []
    if plan.rotated and programs:
        assert centroids is not None and rotation is not None  # checked above
        block_r = 32  # rows a program on 4 warps (tf32x3: mma.sync tiles; NOTES.md §61)
        rotate_args = (
            query,
            rotation,
            centroids,
            tokens,
            scratch.query,
            scratch.table,
            tokens_n * hq,
            centroids.numel(),
            query.stride(0),
            query.stride(1),
            query.stride(2),
            rotation.stride(0),
            rotation.stride(1),
            centroids.stride(0),
            hq,
            d,
            block_d,
            block_r,
            min(block_d, 32),
            TOKEN_FIELDS,
            rotation_precision(None if interp else query.device),
        )
        rotate_grid = (cdiv(tokens_n * hq, block_r),)
        launches.append((launch_rotate, rotate_grid, rotate_args, {"num_warps": 4}))
        q = scratch.query
        s_q = (q.stride(0), q.stride(1), 1)
    else:
        q = query
        s_q = query.stride()
    if programs:
        paged_args = (
            q,
            kv_cache,
            block_table,
            scratch.table,
            work,
            scratch.part_out,
            scratch.part_lse,
            err if err is not None else scratch.part_lse,
            kv_cache.shape[0],
            block_table.shape[1],
            *s_q,
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            block_table.stride(0),
            block_table.stride(1),
            scale * math.log2(math.e),
            hq,
            hq // hk,
            d,
            block_d,
            kv_cache.shape[1],
            cfg.key_bits,
            cfg.key_index_bytes,
            cfg.key_bytes,
            cfg.value_bits,
            cfg.value_index_bytes,
            cfg.norm_correction,
            cfg.key_fp8 and fp8_e4b15_for(query.device),
            query.dtype == torch.bfloat16,
            halves_ok(kv_cache, cfg),
            q_split,
            plan.block_m,
            plan.block_n,
            interp,
            lookup and cfg.key_bits in (3, 4) and not interp,
            fence and not interp,
            plan.prefetch,
            plan.loads_first,
            plan.transposed,
            err is not None,
        )
        options = {
            "num_warps": plan.num_warps,
            "num_stages": 1,
            "maxnreg": plan.max_registers or None,
        }
        launches.append((launch_paged, (programs,), paged_args, options))
    block_t = 16 if block_d <= 128 else 8
    own = plan.own_keys
    has_new = new is not None and not own
    new_strides = (0, 0, 0)
    if new is not None and new_lse is not None and not own:
        new_strides = (new.stride(0), new.stride(1), new_lse.stride(0))
    k, v = query, query  # not read without own keys
    if own:
        assert key is not None and value is not None  # checked above
        k, v = key, value
    combine_args = (
        scratch.part_out,
        scratch.part_lse,
        tokens,
        new if has_new else out,
        new_lse if has_new else scratch.part_lse,
        query,
        k,
        v,
        out,
        lse if lse is not None else scratch.part_lse,
        tokens_n,
        plan.max_splits,
        plan.max_q_len if own else 0,
        *new_strides,
        new_lse_row0,
        *query.stride(),
        *k.stride(),
        *v.stride(),
        scale,
        out.stride(0),
        out.stride(1),
        lse.stride(0) if lse is not None else 0,
        hq,
        hq // hk,
        d,
        block_d,
        block_t,
        has_new,
        own,
        lse is not None,
        interpreter_rounds_bf16(out.dtype),
        TOKEN_FIELDS,
    )
    combine_grid = (cdiv(tokens_n, block_t), hq)
    launches.append((launch_combine, combine_grid, combine_args, {"num_warps": 4}))
    return launches


def scratch_tensors(scratch: PagedScratch) -> tuple[torch.Tensor, ...]:
    """The scratch's views (what a step's bound launches may take besides a layer's
    tensors)."""
    return tuple(getattr(scratch, f.name) for f in dataclasses.fields(scratch))


def paged_continuation_prefill_varlen(
    query,
    key,
    value,
    kv_cache,
    block_table,
    query_start_loc,
    seq_lens,
    *,
    preset,
    centroids,
    rotation,
    scale,
    query_start_loc_cpu=None,
    seq_lens_cpu=None,
    backend="auto",
    out=None,
    return_lse=False,
    lse=None,
    q_split=None,
    lookup=True,
    fence=True,
    info=None,
    **launch,
):
    """What ``continuation_prefill_varlen`` computes, through the memory-bound path
    for every request: the cached positions by ``paged_attention``, the chunk's own
    tokens in its combine (``PagedPlan.own_keys``) or by one causal varlen call merged
    there. Allocates its scratch and work arrays (a convenience for tests and
    benchmarks; ``plan_paged``, ``PagedPlan.carve`` and ``paged_attention`` are the
    allocation-free form).
    ``launch``: ``plan_paged``'s keywords (block_m, block_n, num_warps, split_len,
    sms, programs_per_sm, own_keys); q_split, lookup, fence: ``paged_attention``'s.
    info: a dict given here receives the plan."""
    from .attention import make_call, resolve_backend, varlen_attention

    as_list = lambda x: [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]
    qsl = as_list(
        query_start_loc if query_start_loc_cpu is None else query_start_loc_cpu
    )
    lens = as_list(seq_lens if seq_lens_cpu is None else seq_lens_cpu)
    n, hq, d = query.shape
    hk = kv_cache.shape[2]
    cfg = resolve_config(preset, d)
    if not launch.get("sms") and query.is_cuda:
        launch["sms"] = torch.cuda.get_device_properties(
            query.device
        ).multi_processor_count
    plan = plan_paged(qsl, lens, hq, hk, d, cfg, **launch)
    if info is not None:
        info["plan"] = plan
    work, tokens = plan.upload(query.device)
    buffer = torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=query.device)
    scratch = plan.carve(buffer)
    out = torch.empty_like(query) if out is None else out
    if return_lse and lse is None:
        lse = torch.empty(hq, n, dtype=torch.float32, device=query.device)
    new = new_lse = None
    if not plan.own_keys:
        b = len(lens)
        q_lens = [qsl[i + 1] - qsl[i] for i in range(b)]
        backend = resolve_backend(backend, query.device, d)
        call = make_call(q_lens, q_lens, True, query.device)
        # the chunk's partial in fp16 for bf16 queries too, as a step's paged run
        # makes it (prefill._Layer.paged_run; NOTES.md §39)
        q, k, v = (x.to(torch.float16) for x in (query, key, value))
        new = torch.empty_like(q)
        new_lse = varlen_attention(call, q, k, v, scale, new, backend)
    paged_attention(
        query,
        kv_cache,
        block_table,
        plan,
        work,
        tokens,
        scratch,
        out,
        cfg=cfg,
        centroids=centroids,
        rotation=rotation,
        scale=scale,
        lse=lse,
        new=new,
        new_lse=new_lse,
        key=key,
        value=value,
        q_split=q_split,
        lookup=lookup,
        fence=fence,
    )
    return (out, lse) if return_lse else out
