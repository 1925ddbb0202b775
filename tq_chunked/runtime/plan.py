"""The host-side schedule of a batched continuation prefill: which keys each window
holds, and the attention calls that read them.

Request r has ``q_r`` new tokens over ``c_r`` cached ones: its keys are
``[c_r cached | q_r new]``, ``L_r = c_r + q_r`` of them, and its query i (position
``c_r + i``) sees keys ``j <= c_r + i``: bottom-right causal attention over ``L_r``
keys, exactly FlashAttention's ``causal=True`` with ``seqlen_k > seqlen_q``. A window
holds at most ``capacity`` key rows, filled by one launch (dequant.py): cached tokens
dequantized, new tokens copied after them.

* A request that fits a window (``L_r <= capacity``) is one segment of a **batch
  window**: consecutive such requests share windows (``GAP`` zero rows apart), and each
  batch window is one causal attention call whose answer is final (no log-sum-exp, no
  merge). First chunks are copied in like any other request. A batch window whose call
  would leave most SMs idle is **spread** (``spread_pieces``) where the step's estimated
  layer shortens (``spread_for_step``): each request's cached keys in pieces, ``GAP``
  rows after each, attended side by side in a second call and merged with the causal
  call's answer over the own keys.
* A **long request** (``L_r > capacity``) runs alone: its first cached tokens in
  **part windows** (one attention call each, not causal, every query sees every key),
  then a **last window** with the rest of its cached tokens and all its new ones
  (causal); the partial results are merged exactly (merge.py). Its windows hold
  ``long_capacity[r]`` rows (its own, sized from what its state leaves of the
  workspace: long_window), more than its ``q_r`` so that the new tokens and
  at least one cached token always fit the last window; ``capacity > N`` (the batch's
  query tokens), so a first chunk always fits a batch window.

* A request with few query rows per kv head (``q_r x Hq / Hk <= PAGED_MAX_ROWS``, or
  up to PAGED_MAX_ROWS_LONG over a long prefix: ``paged_eligible``) over a cached
  prefix is bound by the bytes of its cache: it takes the **memory-bound path**
  (paged.py) instead of windows, where consecutive such requests hold
  PAGED_MIN_CACHED cached tokens together. They form a
  **paged run** (cut where their widths cross PAGED_MAX_ROWS rows, into parts of at
  least PAGED_MIN_PART cached tokens: a run's tile follows its largest request;
  ``_by_width``): one causal attention call over
  their own tokens, then their cached positions read straight from the paged cache
  (split over the SMs, no fp16 K/V anywhere), merged with that call's partial.

    requests   A: 900 + 40 | B: 300 + 20 | C: 30000 cached + 600 new | D: 0 + 64
               | E: 200000 + 1 | F: 90000 + 4     (Hq / Hk = 4: E 4 rows, F 16)
    units      [ batch: A, B ][ part: C ][ part: C ][ last: C ...+ new ][ batch: D ]
               [ paged: E, F ]

Which path a request takes (``path``): "auto" (the rule above, where Triton runs: on a
GPU or under the interpreter), "window" (every request through windows) or "paged"
(every request with cached tokens through the memory-bound path, for measurements: a
run whose query rows need more scratch than a batch window of the step takes raises).
Either path keeps the exactness bound for every preset and dtype (a paged run's chunk
partial is fp16 for bf16 queries, as a long request's windows' are). The crossover and
the errors: benchmarks/NOTES.md §35, §37, §39.

A plan depends only on host integers (the lengths, the heads, the window and the
budget), so one plan serves every layer of a forward step (``prefill.ContinuationPrefill
.plan`` makes it once per step). Its device integers are uploaded in one asynchronous
copy and never written again.

This module is the only one that plans: the path of each request, the window sizes
within the workspace budget (``fit_window``, ``long_window``, ``workspace_bytes``), the
windows, each long request's kv-head group, the memory-bound path's splits
(``paged.plan_paged``, within the bytes of the step's batch window) and the bytes of
workspace the step needs (``workspace.layout`` and ``PagedPlan.regions`` say where each
region lies).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import numpy as np
import torch

from ._utils import as_int, interpreting
from .attention import Call
from .dequant import GAP_ROW, SEG_FIELDS
from .format import TQConfig
from .paged import DEFAULT_SMS, TOKEN_FIELDS, WORK_FIELDS, PagedPlan, plan_paged
from .workspace import (
    ALIGN,
    DEFAULT_WINDOW_BYTES,
    DEFAULT_WORKSPACE_BYTES,
    layout_bytes,
    rotation_bytes,
)

# Zero key rows between two requests of a batch window, as a sequence of no queries. A
# FlashAttention-3 tile reads past the end of its sequence (up to its key-tile size, at
# most 256 rows) and weighs those keys by 0, and 0 * inf or 0 * NaN is NaN: without the
# gap a non-finite value of one request would reach its neighbour's answer (seen on the
# H200 machine; benchmarks/NOTES.md §13). Past a window's last row the buffer handed to
# attention ends, and the tile reads zeros.
GAP = 256
FIT_ROWS = 256  # a window fitted to the budget is a multiple of this (fit_window)
# "auto" sends a request to the memory-bound path where it has cached tokens and at
# most PAGED_MAX_ROWS query rows per kv head (q_r x Hq / Hk: one 32-row tile of the
# paged kernel, paged.MAX_GPU_TILE) and the consecutive such requests hold at least
# PAGED_MIN_CACHED cached tokens together: where it measured faster than the windows
# for every head shape, preset and dtype tried. Below that the launches'
# fixed cost weighs against it (benchmarks/NOTES.md §35, §37, §39).
PAGED_MAX_ROWS = 32
PAGED_MIN_CACHED = 256 * 1024
# Up to PAGED_MAX_ROWS_LONG rows where the request itself holds PAGED_LONG_CACHED[head
# size] cached tokens, over MSE keys: the least prefix where the memory-bound path
# measured faster than the windows at both 48 and 64 rows a kv head (Hq / Hk 32 / 8 at
# head size 128, 16 / 16 at 64; benchmarks/NOTES.md §41, §57, §64), so that such a
# request does not break its run below PAGED_MIN_CACHED. Head size 256 and fp8 keys
# not measured.
PAGED_MAX_ROWS_LONG = 64
PAGED_LONG_CACHED = {128: 256, 64: 2048}
# A run's tile follows its largest request (paged.default_launch), so a run is cut into
# parts where its requests cross PAGED_MAX_ROWS rows a kv head, each part a run of its
# own; a part needs PAGED_MIN_PART cached tokens to stand alone (one more plan a step
# and three launches a layer), the least measured to gain (benchmarks/NOTES.md §59).
PAGED_MIN_PART = 32 * 1024
PATHS = ("auto", "window", "paged")
# A batch window whose attention call would form at most SPREAD_MAX_BLOCKS thread
# blocks (FlashAttention-3's at head size 128: ceil(q_r x G / SPREAD_TILE) query tiles
# a kv head and request) leaves most SMs idle for its whole length: with
# spread="auto" (FlashAttention-3, head size 128: where it was measured)
# its cached keys run in pieces side by side (``spread_pieces``), about SPREAD_WAVES
# blocks an SM, the longest request's pieces of at least SPREAD_MIN_PIECE keys.
# Measured: 24-56 blocks gained, 96 and more did not; at 64 one window lost and one
# gained less GPU time than its pieces cost the host (benchmarks/NOTES.md §65, §67).
SPREAD_MAX_BLOCKS = 56
SPREAD_TILE = 128
SPREAD_WAVES = 2
SPREAD_MIN_PIECE = 1024
# A spread window saves GPU time and costs host time: a second attention call, the
# query's copies and the merge, about as much as another window (benchmarks/NOTES.md
# §70, §71). A layer takes about the longer of its host's time and its GPU's, so "auto"
# spreads only while that falls (``spread_for_step``): a window whose saving only adds
# host time to a step bound by its host stays one call. The estimates, microseconds a
# layer, measured on the H100 machine with FlashAttention-3 at head size 128 (§71):
# - host: SPREAD_RUN_US a run, SPREAD_UNIT_US a unit (a window's fill and call),
#   SPREAD_EXTRA_US more a spread window;
# - one call of a window of few blocks: each block's chain runs its request's keys,
#   SPREAD_KEY_NS a key of the longest request, and the fill SPREAD_FILL_NS a key and kv
#   head, after SPREAD_CALL_US;
# - a spread window: its pieces' chains, a 1/pieces share, plus what spreading adds
#   (the own keys' call, the copies, the merge): SPREAD_ADD_US, and SPREAD_ADD_NS a key
#   of its request of the most cached keys.
SPREAD_RUN_US = 100.0
SPREAD_UNIT_US = 120.0
SPREAD_EXTRA_US = 120.0
SPREAD_KEY_NS = 10.7
SPREAD_FILL_NS = 0.2
SPREAD_CALL_US = 20.0
SPREAD_ADD_US = 50.0
SPREAD_ADD_NS = 2.8


@dataclass(frozen=True)
class Window(Call):
    """One fill and one attention call: query rows [q0, q1) against the window's keys.

    Attention reads it as a varlen call (``attention.Call``): sequence b has queries
    cu_q[b]:cu_q[b+1] (relative to q0) and keys cu_k[b]:cu_k[b+1] of the window, one
    sequence per segment (nseg + 1 entries each)."""

    kind: str  # "batch", "part" or "last"
    q0: int
    q1: int
    rows: int  # key rows filled
    nseg: int
    search_steps: int  # the fill's binary-search iterations over nseg segments
    # int32 device: nseg + 1 starts, then SEG_FIELDS - 1 arrays of nseg (dequant.py)
    segs: torch.Tensor
    segs_host: tuple[int, ...]
    has_chunk: bool  # some rows are the chunk's new tokens
    requests: tuple[int, ...]  # the requests whose queries it answers, in order
    # a spread window (``spread_pieces``): each request's cached keys in ``pieces``
    # pieces, each followed by GAP rows, then its own keys; this call attends to the
    # own keys (causal) and ``pieces_call`` to the pieces (not causal), each piece
    # with a copy of its request's query rows: piece row k copies query row
    # ``copy[k]``, and query row j's pieces are rows piece_first[j] + i *
    # piece_step[j] (int32 device)
    pieces: int = 1
    pieces_call: Call | None = None
    copy: torch.Tensor | None = None
    piece_first: torch.Tensor | None = None
    piece_step: torch.Tensor | None = None

    def segment(self, s):
        """(start row, request, first cached position, cached rows, first new row in
        key/value; GAP_ROW for a gap)."""
        n = self.nseg
        h = self.segs_host
        return h[s], h[n + 1 + s], h[2 * n + 1 + s], h[3 * n + 1 + s], h[4 * n + 1 + s]

    def segment_end(self, s):
        return self.segs_host[s + 1]


@dataclass(frozen=True)
class LongRequest:
    """A request longer than a batch window: ``kv_heads`` kv heads at a time, each
    group through ``windows`` (parts, then the last) of ``capacity`` rows."""

    request: int
    q0: int
    q1: int
    capacity: int  # key rows per window
    windows: tuple[Window, ...]  # parts, then the last
    kv_heads: int = 0  # kv heads per group (set by make_plan)


@dataclass(frozen=True)
class PagedRun:
    """Consecutive requests through the memory-bound path: ``paged.paged_attention``
    over their cached positions and their own tokens: in its combine where each has at
    most paged.OWN_KEYS_MAX (``paged.own_keys``), else after one causal call over
    their own tokens (``chunk``: query rows [q0, q1) against the same rows of
    key/value), merged with it."""

    q0: int
    q1: int
    requests: tuple[int, ...]
    chunk: Call | None  # None with paged.own_keys
    paged: PagedPlan  # the splits and the scratch
    work: torch.Tensor  # int32 (programs, WORK_FIELDS) on the device
    tokens: torch.Tensor  # int32 (served tokens, TOKEN_FIELDS) on the device


@dataclass(frozen=True)
class Plan:
    """Everything a step's layers share: the units in order of their query rows, and
    the workspace they need."""

    num_tokens: int  # N, query rows
    capacity: int  # key rows per batch window (a spread one's gaps may take more)
    # the units of work, in order of their query rows: a Window (a batch window), a
    # LongRequest (its windows, once per group of its kv heads) or a PagedRun
    units: tuple
    workspace_bytes: int  # the most bytes any unit's layout takes (0: none)
    # each unit's layout: a workspace.layout key, or a PagedPlan (its regions)
    unit_layouts: tuple
    ints: torch.Tensor | None = None  # every unit's device integers, one tensor


def unit_bytes(key) -> int:
    """The bytes of workspace a unit of layout ``key`` needs (with room to align)."""
    if isinstance(key, PagedPlan):
        return rotation_bytes(key.head_dim) + key.scratch_bytes + ALIGN
    return layout_bytes(*key)


# ---------------------------------------------------------------------------
# Window sizes within the workspace budget
# ---------------------------------------------------------------------------


def default_window(num_kv_heads: int, head_dim: int, block_size: int) -> int:
    """Key rows per window such that their K + V (2 bytes each, all kv heads) take
    DEFAULT_WINDOW_BYTES, rounded down to a multiple of block_size (at least one
    block)."""
    tokens = DEFAULT_WINDOW_BYTES // (2 * 2 * num_kv_heads * head_dim)
    return max(block_size, tokens // block_size * block_size)


def capacity(window: int, q_tokens: int) -> int:
    """Key rows a window holds: ``window``, or q_tokens + 1 if that is more (a long
    request's last window holds all its new tokens and at least one cached one)."""
    return max(window, q_tokens + 1)


def batch_layout(num_q_heads, num_kv_heads, head_dim, cap, dtype):
    """The workspace.layout key of a batch window of ``cap`` rows."""
    return ("batch", 0, num_q_heads, num_kv_heads, head_dim, cap, dtype)


def long_layout(rows, num_q_heads, num_kv_heads, kv_heads, head_dim, cap, dtype):
    """The workspace.layout key of a long request of ``rows`` query rows, ``kv_heads``
    kv heads at a time, in windows of ``cap`` rows."""
    g = num_q_heads // num_kv_heads
    return ("long", rows, g * kv_heads, kv_heads, head_dim, cap, dtype)


def spread_layout(
    num_q_heads, num_kv_heads, head_dim, rows, piece_rows, q_rows, dtype
):  # fmt: skip
    """The workspace.layout key of a spread window of ``rows`` key rows and ``q_rows``
    query rows whose pieces hold ``piece_rows`` query rows (the query rows count only
    for bf16 queries, whose fp16 copy the layout holds)."""
    q_rows = q_rows if dtype == torch.bfloat16 else 0
    return (
        "spread", piece_rows, num_q_heads, num_kv_heads, head_dim, rows, dtype, q_rows
    )  # fmt: skip


def spread_rows(reqs, pieces: int) -> tuple[int, int, int]:
    """(key rows, pieces' query rows, query rows) of a spread window of these requests
    ((query rows, cached keys) each): their keys, a GAP after each piece and after
    each request's own keys but the last; a request without cached keys has no
    pieces."""
    cached = [q for q, c in reqs if c]
    gaps = pieces * len(cached) + len(reqs) - 1
    keys = sum(q + c for q, c in reqs) + GAP * gaps
    return keys, pieces * sum(cached), sum(q for q, _ in reqs)


def spread_pieces(
    reqs, num_q_heads, num_kv_heads, head_dim, dtype, limit: int, sms: int, spread
) -> int:
    """How many pieces a batch window of these requests ((query rows, cached keys)
    each) cuts each request's cached keys into: 1 (one call, not spread) or at least
    2. ``spread``: "auto" (where its call would form at most SPREAD_MAX_BLOCKS blocks:
    about SPREAD_WAVES blocks an SM over ``sms`` SMs, the longest request's pieces of
    at least SPREAD_MIN_PIECE keys, and no request's piece empty) or a count (1:
    never; a request of fewer cached keys than pieces then has pieces of none). Fewer
    where its layout would take more than ``limit`` bytes (a batch window's); 1 where
    even 2 pieces would, or where no request has cached keys."""
    if spread == 1 or not any(c for _, c in reqs):
        return 1
    if spread == "auto":
        g = num_q_heads // num_kv_heads
        blocks = sum(-(-q * g // SPREAD_TILE) for q, _ in reqs) * num_kv_heads
        if blocks > SPREAD_MAX_BLOCKS:
            return 1
        cached = [c for _, c in reqs if c]
        spread = min(
            -(-SPREAD_WAVES * sms // blocks),
            max(cached) // SPREAD_MIN_PIECE,
            min(cached),
        )
    for pieces in range(spread, 1, -1):
        rows = spread_rows(reqs, pieces)
        key = spread_layout(num_q_heads, num_kv_heads, head_dim, *rows, dtype)
        if layout_bytes(*key) <= limit:
            return pieces
    return 1


def spread_for_step(windows, counts, num_kv_heads: int, units: int) -> list[int]:
    """Which of a step's batch windows "auto" spreads: ``counts`` (each window's
    ``spread_pieces``) where spreading shortens the step's estimated layer, else 1.
    ``windows``: each batch window's requests ((query rows, cached keys) each, at
    least one); ``units``: the step's units (every window and paged run: the host's
    share; a long request's windows counted once, though they run once per group of
    its kv heads).

    A layer is estimated at max(host, GPU) (the SPREAD_* constants): the host's run
    and units, the GPU's one call of every batch window (other units' GPU time is not
    counted: fewer windows spread; a long request's host time per group is not counted
    either: more). The windows that save the most go first, each taken while it
    shortens the estimate."""
    if len(windows) != len(counts):
        raise AssertionError("a count for each window")
    host = SPREAD_RUN_US + SPREAD_UNIT_US * units
    gpu = 0.0
    saves = []
    for i, (reqs, pieces) in enumerate(zip(windows, counts)):
        longest = max(q + c for q, c in reqs)
        keys = sum(q + c for q, c in reqs)
        gpu += (
            SPREAD_CALL_US
            + SPREAD_KEY_NS * longest / 1e3
            + SPREAD_FILL_NS * keys * num_kv_heads / 1e3
        )
        if pieces > 1:
            cached = max(c for _, c in reqs)
            share = SPREAD_KEY_NS * (1 - 1 / pieces) - SPREAD_ADD_NS
            saves.append((cached * share / 1e3 - SPREAD_ADD_US, i))
    chosen = [1] * len(windows)
    for saved, i in sorted(saves, key=lambda t: (-t[0], t[1])):
        if max(host + SPREAD_EXTRA_US, gpu - saved) >= max(host, gpu):
            break  # the next saves less for the same host time
        host, gpu = host + SPREAD_EXTRA_US, gpu - saved
        chosen[i] = counts[i]
    return chosen


def _spread_segments(segs, pieces: int):
    """A batch window's segments (its requests, each followed by a gap) spread: each
    request's cached keys in ``pieces`` pieces, each followed by a gap, then its own
    keys and a gap (but the last); and the query rows each segment has in the pieces'
    call."""
    out, pieces_q = [], []
    for r, _, c, new0, new, q in segs:
        if q == 0:
            continue  # a gap: made again below
        cuts = [c * i // pieces for i in range(pieces + 1)]
        for i in range(pieces if c else 0):
            out += [
                (r, cuts[i], cuts[i + 1] - cuts[i], new0, 0, 0),
                (r, 0, 0, GAP_ROW, GAP, 0),
            ]
            pieces_q += [q, 0]
        out += [(r, c, 0, new0, new, q), (r, 0, 0, GAP_ROW, GAP, 0)]
        pieces_q += [0, 0]
    return out[:-1], pieces_q[:-1]


def _most_rows(need, least: int, most: int, budget: int) -> int:
    """The most rows in [least, most] whose ``need(rows)`` bytes fit ``budget`` (need
    grows with rows, and need(least) fits): ``most`` itself where it fits, else the
    most on the FIT_ROWS grid, or ``least`` where the grid has none above it."""
    if need(most) <= budget:
        return most
    lo, hi = least, most  # need(lo) fits, need(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if need(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return max(least, lo // FIT_ROWS * FIT_ROWS)


def fit_window(
    window: int,
    q_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    budget: int,
) -> int:
    """The batch window a step of q_tokens query tokens uses: ``window``, or where its
    K/V would not fit ``budget`` bytes, the most rows that do (on the FIT_ROWS grid),
    and never fewer than q_tokens + 1 (``capacity``; the layout is then larger than
    the budget). A long request's window is its own (``long_window``)."""

    def need(w):
        return layout_bytes(
            *batch_layout(num_q_heads, num_kv_heads, head_dim, w, dtype)
        )

    least = q_tokens + 1
    if window <= least:
        return window
    if need(least) > budget:
        return least
    return _most_rows(need, least, window, budget)


def long_window(
    rows: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int,
    dtype: torch.dtype,
    budget: int,
) -> tuple[int, int]:
    """(kv heads at once, key rows per window) of a long request of ``rows`` query rows
    whose layout must fit ``budget`` bytes (its float32 state and its window share
    them). Each kv-head group (a divisor of num_kv_heads) takes the most rows that fit,
    at most ``window`` (the batch windows' capacity; on the FIT_ROWS grid where that
    keeps more than ``rows``); of the groups whose window holds more than ``rows``
    rows, the one whose window holds the most K/V (rows x kv heads: the fewest windows
    for the request's cached tokens) runs, the most kv heads among equals. Where none
    fits: one kv head, rows + 1 rows (the layout is then larger than the budget)."""
    lo = rows + 1  # the last window holds the new tokens and a cached one
    best = (0, 1, lo)
    for hk_g in range(num_kv_heads, 0, -1):
        if num_kv_heads % hk_g:
            continue

        def need(cap, hk_g=hk_g):
            return layout_bytes(
                *long_layout(
                    rows, num_q_heads, num_kv_heads, hk_g, head_dim, cap, dtype
                )
            )

        if need(lo) > budget:
            continue
        cap = _most_rows(need, lo, max(window, lo), budget)
        if hk_g * cap > best[0]:
            best = (hk_g * cap, hk_g, cap)
    return best[1], best[2]


def workspace_bytes(
    q_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int,
    dtype: torch.dtype = torch.float16,
    *,
    max_bytes: int | None = None,
) -> int:
    """Exact bytes of workspace that suffice for a continuation prefill of q_tokens
    query tokens (all requests of a batch together) in ``dtype`` (the query's) with
    this window, however those tokens are split into requests and whatever the cached
    lengths: the larger of the batch layout (its window shortened by ``fit_window``
    where it would not fit ``max_bytes``, default 128 MiB) and what a long request takes
    (``long_window`` within ``max_bytes``): the layout of one request of all q_tokens
    rows. A uint8 buffer of at least this many bytes on the query's device may be
    passed as ``workspace=``; pass the same budget to the call
    (``max_workspace_bytes``). A call takes the smaller of its budget and the
    workspace given as its budget, and sizes each long request's window within it
    (from its own query rows, not from the rest of the batch): a call of at most
    q_tokens query tokens fits this many bytes. A call without a workspace allocates
    what its own steps take, at most its budget.
    """
    q_tokens = as_int("q_tokens", q_tokens, 0)
    num_q_heads = as_int("num_q_heads", num_q_heads, 1)
    num_kv_heads = as_int("num_kv_heads", num_kv_heads, 1)
    head_dim = as_int("head_dim", head_dim, 1)
    window = as_int("window", window, 1)
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
            f"({num_kv_heads})"
        )
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"dtype must be torch.float16 or torch.bfloat16 (the query's), got {dtype}"
        )
    budget = (
        DEFAULT_WORKSPACE_BYTES
        if max_bytes is None
        else as_int("max_bytes", max_bytes, 1)
    )
    window = fit_window(
        window, q_tokens, num_q_heads, num_kv_heads, head_dim, dtype, budget
    )
    cap = capacity(window, q_tokens)
    batch = layout_bytes(*batch_layout(num_q_heads, num_kv_heads, head_dim, cap, dtype))
    hk_g, long_cap = long_window(
        q_tokens, num_q_heads, num_kv_heads, head_dim, cap, dtype, budget
    )
    long = layout_bytes(
        *long_layout(
            q_tokens, num_q_heads, num_kv_heads, hk_g, head_dim, long_cap, dtype
        )
    )
    return max(batch, long)


# ---------------------------------------------------------------------------
# The plan of a step
# ---------------------------------------------------------------------------


def make_plan(
    qsl: tuple[int, ...],
    seq_lens: tuple[int, ...],
    *,
    window: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    budget: int,
    device: torch.device,
    stream=None,
    cfg: TQConfig | None = None,
    path: str = "window",
    sms: int = DEFAULT_SMS,
    spread="auto",
) -> Plan:
    """The plan of a step from its host lengths (validated): each request's path
    (``paths``), the batch window fitted to the budget and shortened to the rows the
    step fills, each long request's window and kv-head group from what its state
    leaves of the budget (its own query rows and the budget, never the rest of the
    batch), each paged run's splits within the bytes of a batch window of the step's
    tokens (so that ``workspace_bytes`` still bounds the step), the windows
    (``windows``) and the bytes of workspace their layouts take. ``cfg`` (the cache's
    format) is needed where a request may take the memory-bound path; ``sms``: the
    device's multiprocessors, which its splits and spread windows are spread over;
    ``spread``: which batch windows run their cached keys in pieces (``spread_pieces``:
    "auto", then only those ``spread_for_step`` takes, or a count, 1 for none), each
    within a batch window's bytes."""
    n = qsl[-1]
    window = fit_window(window, n, num_q_heads, num_kv_heads, head_dim, dtype, budget)
    runs: list[tuple[tuple[int, ...], PagedPlan]] = []
    if path != "window":
        if cfg is None:
            raise AssertionError("the memory-bound path needs the cache's format")
        limit = layout_bytes(
            *batch_layout(
                num_q_heads, num_kv_heads, head_dim, capacity(window, n), dtype
            )
        ) - (ALIGN + rotation_bytes(head_dim))
        group = num_q_heads // num_kv_heads
        for run in paged_runs(qsl, seq_lens, group, path, device, cfg):
            try:
                plan = plan_paged(
                    qsl, seq_lens, num_q_heads, num_kv_heads, head_dim, cfg,
                    requests=run, sms=sms, max_scratch_bytes=limit,
                    half_chunk=dtype == torch.bfloat16,
                )  # fmt: skip
            except ValueError:
                if path == "paged":
                    who = f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}"
                    raise ValueError(
                        f"path='paged': request(s) {who} need more scratch on the "
                        f"memory-bound path than a batch window of this step takes "
                        f"({limit} bytes, from window and max_workspace_bytes): use "
                        f"path='auto', or a larger window"
                    ) from None
                continue  # the windows serve them (NOTES.md §35)
            runs.append((run, plan))
    # the requests the windows serve: with query tokens, outside the paged runs (each
    # a span of consecutive requests, whose others have no query tokens)
    on_windows = [True] * len(seq_lens)
    for run, _ in runs:
        on_windows[run[0] : run[-1] + 1] = [False] * (run[-1] + 1 - run[0])
    served = [r for r in itertools.compress(range(len(seq_lens)), on_windows)
              if qsl[r + 1] > qsl[r]]  # fmt: skip
    reads = [seq_lens[r] for r in served]
    rows = sum(reads) + GAP * max(len(reads) - 1, 0)  # the most rows the step fills
    # batch windows; with a long request (> cap rows) this is capacity(window, n)
    cap = capacity(min(window, max(rows, 1)), n)
    longs = {}
    for r in served:
        if seq_lens[r] > cap:
            longs[r] = long_window(
                qsl[r + 1] - qsl[r], num_q_heads, num_kv_heads, head_dim, cap, dtype,
                budget,
            )  # fmt: skip
    batch_key = batch_layout(num_q_heads, num_kv_heads, head_dim, cap, dtype)
    # a spread window's pieces and gaps take at most a batch window's bytes before it
    # is shortened to the step's rows: what workspace_bytes promises
    spread_limit = layout_bytes(
        *batch_layout(num_q_heads, num_kv_heads, head_dim, capacity(window, n), dtype)
    )

    def pieces_of(windows, units):
        counts = [
            spread_pieces(reqs, num_q_heads, num_kv_heads, head_dim, dtype,
                          spread_limit, sms, spread)
            for reqs in windows
        ]  # fmt: skip
        if spread != "auto":
            return counts
        return spread_for_step(windows, counts, num_kv_heads, units)

    units, ints = _units(
        qsl,
        seq_lens,
        cap,
        device,
        stream,
        tuple(longs[r][1] if r in longs else 0 for r in range(len(seq_lens)))
        if longs
        else None,
        runs,
        None if spread == 1 else pieces_of,
    )
    out, keys = [], []
    for unit in units:
        key: tuple | PagedPlan
        if isinstance(unit, LongRequest):
            hk_g = longs[unit.request][0]
            unit = LongRequest(
                unit.request, unit.q0, unit.q1, unit.capacity, unit.windows, hk_g
            )
            key = long_layout(
                unit.q1 - unit.q0,
                num_q_heads,
                num_kv_heads,
                hk_g,
                head_dim,
                unit.capacity,
                dtype,
            )
        elif isinstance(unit, PagedRun):
            key = unit.paged
        elif unit.pieces > 1:
            piece_rows = unit.pieces_call.cu_q_host[-1]  # the pieces' query rows
            key = spread_layout(
                num_q_heads, num_kv_heads, head_dim, unit.rows, piece_rows,
                unit.q1 - unit.q0, dtype,
            )  # fmt: skip
        else:
            key = batch_key
        out.append(unit)
        keys.append(key)
    return Plan(
        num_tokens=n,
        capacity=cap,
        units=tuple(out),
        workspace_bytes=max((unit_bytes(k) for k in keys), default=0),
        unit_layouts=tuple(keys),
        ints=ints,
    )


def paged_eligible(rows: int, cached: int, cfg: TQConfig) -> bool:
    """Whether "auto" may send a request of ``rows`` query rows per kv head over
    ``cached`` cached tokens (at least one) to the memory-bound path: at most
    PAGED_MAX_ROWS rows, or at most PAGED_MAX_ROWS_LONG over PAGED_LONG_CACHED[head
    size] cached tokens or more (head sizes 64 and 128) over MSE keys (``paged_runs``
    tests the first inline)."""
    if rows <= PAGED_MAX_ROWS:
        return True
    least = PAGED_LONG_CACHED.get(cfg.head_dim)
    return (
        rows <= PAGED_MAX_ROWS_LONG
        and least is not None
        and cached >= least
        and not cfg.key_fp8
    )


def paged_runs(
    qsl: tuple[int, ...],
    seq_lens: tuple[int, ...],
    group: int,
    path: str,
    device: torch.device,
    cfg: TQConfig,
) -> list[tuple[int, ...]]:
    """The requests the memory-bound path serves, as runs of consecutive ones (requests
    without query tokens neither join nor break a run): with path "paged" every
    request with query and cached tokens; with "auto" those with cached tokens that
    ``paged_eligible`` admits (``group`` = Hq / Hk), where consecutive ones hold at
    least PAGED_MIN_CACHED cached tokens together, and where Triton runs (on a GPU, or
    under the interpreter). Each such span is then cut by width (``_by_width``)."""
    triton_runs = device.type == "cuda" or interpreting()
    if path == "window" or (path == "auto" and not triton_runs):
        return []
    spans: list[list[tuple[list[int], bool, int]]] = []  # each span's parts (_by_width)
    span: list[tuple[list[int], bool, int]] = []
    held = 0  # the span's cached tokens
    every = path == "paged"
    least = 0 if every else PAGED_MIN_CACHED
    for r, (s, q) in enumerate(zip(seq_lens, map(operator.sub, qsl[1:], qsl[:-1]))):
        if not q:
            continue
        # paged_eligible's first test inline: its call cost more than the rest (§51)
        rows = q * group
        wide = rows > PAGED_MAX_ROWS
        if s > q and (every or not wide or paged_eligible(rows, s - q, cfg)):
            if span and span[-1][1] == wide:
                part, _, n = span[-1]
                part.append(r)
                span[-1] = (part, wide, n + s - q)
            else:
                span.append(([r], wide, s - q))
            held += s - q
        elif span:
            if held >= least:
                spans.append(span)
            span, held = [], 0
    if span and held >= least:
        spans.append(span)
    return [run for span in spans for run in _by_width(span, every)]


def _by_width(
    parts: list[tuple[list[int], bool, int]], every: bool
) -> list[tuple[int, ...]]:
    """The runs of one span of consecutive requests, from its parts (requests, whether
    each has more than PAGED_MAX_ROWS rows a kv head, cached tokens), which alternate in
    width. A part of PAGED_MIN_PART cached tokens or more is a run; a smaller one joins
    the part before it (the first, the part after it), so that the tile of the larger
    width serves both. With "auto" (not ``every``) a small wide part at either end of
    the span goes to the windows instead, so that a span of decodes with a few wide
    requests after them keeps the decodes' own tile (NOTES.md §59)."""
    if not every:
        while parts and parts[0][1] and parts[0][2] < PAGED_MIN_PART:
            parts = parts[1:]
        while parts and parts[-1][1] and parts[-1][2] < PAGED_MIN_PART:
            parts = parts[:-1]
    runs: list[list[int]] = []
    small: list[int] = []  # small parts waiting for a large one after them
    for requests, _, cached in parts:
        if cached >= PAGED_MIN_PART:
            runs.append(small + requests)
            small = []
        elif runs:
            runs[-1] += requests
        else:
            small += requests
    if small:
        runs.append(small)  # no part of the span is large
    return [tuple(run) for run in runs]


def windows(
    qsl: tuple[int, ...],
    seq_lens: tuple[int, ...],
    capacity: int,
    device: torch.device,
    stream=None,
    long_capacity: tuple[int, ...] | None = None,
) -> tuple:
    """The windows of these lengths, every request through them (``_units`` without
    paged runs)."""
    return _units(qsl, seq_lens, capacity, device, stream, long_capacity, [])[0]


def _spread_ints(reqs, pieces: int) -> np.ndarray:
    """A spread window's ``copy``, ``piece_first`` and ``piece_step`` (``Window``), one
    int32 array. The pieces' rows follow their requests: piece i of a request of q
    query rows whose pieces start at row p holds rows p + i * q + [0, q), copies of
    the request's query rows. A request without cached keys has none: its rows'
    pieces lie outside the pieces' rows (first -1, step 0), which the merge leaves
    empty. ``reqs``: the window's requests, (query rows, cached keys) each. Built by
    numpy: a window's pieces hold thousands of rows (NOTES.md §67)."""
    q, c = np.array(reqs, dtype=np.int64).T
    has = c > 0  # whether each request has pieces
    o = np.cumsum(q) - q  # each request's first query row
    span = q * has * pieces  # each request's piece rows
    p = np.cumsum(span) - span  # where they start
    row = np.repeat(np.arange(len(q)), q)  # each query row's request
    first = np.where(has[row], p[row] + np.arange(len(row)) - o[row], -1)
    step = np.where(has[row], q[row], 0)
    piece = np.repeat(np.arange(len(q)), span)  # each piece row's request
    copy = o[piece] + (np.arange(len(piece)) - p[piece]) % q[piece]
    return np.concatenate([copy, first, step]).astype(np.int32)


def _units(
    qsl: tuple[int, ...],
    seq_lens: tuple[int, ...],
    capacity: int,
    device: torch.device,
    stream,
    long_capacity: tuple[int, ...] | None,
    runs: list[tuple[tuple[int, ...], PagedPlan]],
    pieces_of=None,
) -> tuple[tuple, torch.Tensor]:
    """The units for these lengths (host ints, already validated), in order of their
    query rows, and the one device tensor of their integers: a ``Window`` per batch
    window of ``capacity`` key rows (more than the batch's query tokens), for each
    request longer than that a ``LongRequest`` whose windows hold ``long_capacity[r]``
    rows (more than its query tokens, at most ``capacity``; default ``capacity``), and
    a ``PagedRun`` per ``runs`` entry (its requests, their ``PagedPlan``); a batch
    window is spread where ``pieces_of`` (every batch window's requests, (query rows,
    cached keys) each, and the step's units -> each window's pieces) gives it 2 pieces
    or more. Their device
    integers go up in one asynchronous copy on ``stream`` (default: the current one),
    the stream that reads them."""
    b = len(seq_lens)
    n_tok = qsl[-1]
    if capacity <= n_tok:
        raise AssertionError("capacity must exceed the query tokens (capacity())")
    packed: list[int] = []  # every device int32 array of the plan, uploaded in one copy
    # each window before the upload: (kind, segments, causal, pieces, the query rows
    # of each segment in the pieces' call and ``_spread_ints``, or None and None), a
    # segment being (request, first cached position, cached rows, first new row, new
    # rows, query rows)
    specs: list[tuple[str, list, bool, int, list | None, np.ndarray | None]] = []

    def window(kind, segs, causal, pieces=1, pieces_q=None, ints=None):
        specs.append((kind, segs, causal, pieces, pieces_q, ints))
        return len(specs) - 1

    # each run's first request -> (the run's index, the request after its last): a run
    # is consecutive requests (between them only requests without query tokens), which
    # the loop below passes over
    paged_at = {run[0]: (i, run[-1] + 1) for i, (run, _) in enumerate(runs)}
    units: list = []  # a window's index, a long request's fields or ("paged", i)
    batch: list[tuple[int, ...]] = []
    batch_rows = 0

    batches: list[tuple[int, list, list]] = []  # each batch window: (spec, segs, reqs)

    def flush():
        nonlocal batch, batch_rows
        if batch:
            segs = batch[:-1]  # the last request's gap is not needed
            reqs = [(s[5], s[2]) for s in segs if s[5]]  # (query rows, cached keys)
            units.append(window("batch", segs, True))  # spread below, if at all
            batches.append((units[-1], segs, reqs))
        batch, batch_rows = [], 0

    past_run = 0  # the request after the last paged run met
    for r in range(b):
        if r < past_run:
            continue  # in a paged run
        if r in paged_at:
            flush()
            i, past_run = paged_at[r]
            units.append(("paged", i))
            continue
        q = qsl[r + 1] - qsl[r]
        if q == 0:
            continue  # nothing to compute, and no rows: batch windows stay contiguous
        c = seq_lens[r] - q
        if c + q <= capacity:
            if batch and batch_rows + c + q > capacity:
                flush()
            batch += [(r, 0, c, qsl[r], q, q), (r, 0, 0, GAP_ROW, GAP, 0)]
            batch_rows += c + q + GAP
            continue
        flush()
        cap = capacity if long_capacity is None else long_capacity[r]
        if not q < cap <= capacity:
            raise AssertionError("a long request's windows hold more than its q_r rows")
        # tail: cached tokens in the last window (>= 1: cap > q);
        # head: cached tokens before it (> 0: c + q > capacity >= cap)
        tail = cap - q
        head = c - tail
        parts = -(-head // cap)
        bounds = [head * i // parts for i in range(parts + 1)]  # balanced
        ids = [
            window(
                "part", [(r, bounds[i], bounds[i + 1] - bounds[i], qsl[r], 0, q)], False
            )
            for i in range(parts)
        ]
        ids.append(window("last", [(r, head, tail, qsl[r], q, q)], True))
        units.append((r, qsl[r], qsl[r + 1], cap, ids))
    flush()
    if pieces_of is not None and batches:
        counts = pieces_of([reqs for _, _, reqs in batches], len(specs) + len(runs))
        for (at, segs, reqs), pieces in zip(batches, counts):
            if pieces > 1:
                spread, pieces_q = _spread_segments(segs, pieces)
                ints = _spread_ints(reqs, pieces)
                specs[at] = ("batch", spread, True, pieces, pieces_q, ints)

    spans = []
    # each window's segments as columns (six tuples: the segments' fields) and each
    # segment's key rows (cached + new)
    columns = []
    for _, segs, _, _, pieces_q, _ in specs:
        cols = tuple(zip(*segs))
        rows = tuple(map(operator.add, cols[2], cols[4]))
        columns.append((cols, rows))
        starts = [0, *itertools.accumulate(rows)]
        cu_q = [0, *itertools.accumulate(cols[5])]
        fields = starts + [*cols[0], *cols[1], *cols[2], *cols[3]]
        assert len(fields) == SEG_FIELDS * len(segs) + 1
        spans.append((len(packed), len(fields), len(packed) + len(fields), len(cu_q)))
        packed += fields
        packed += cu_q
        if pieces_q is not None:  # the pieces' call's query starts
            packed += [0, *itertools.accumulate(pieces_q)]
    # the spread windows' copies and the paged runs' ints after the windows' (they
    # run to thousands of rows and programs: joined as arrays, not as Python ints)
    pieces = [np.asarray(packed, dtype=np.int32)]
    end = len(packed)
    spread_at = []  # each spread window's copy, first and step: where they start
    for *_, ints in specs:
        if ints is not None:
            spread_at.append(end)
            pieces.append(ints)
            end += len(ints)
    paged_spans: list[tuple[int, int, int, int, tuple[int, ...]]] = []
    for run, plan in runs:
        run_cu = [0, *itertools.accumulate(qsl[r + 1] - qsl[r] for r in run)]
        if run_cu[-1] != qsl[run[-1] + 1] - qsl[run[0]]:
            # the loop above passed over the run's span: nothing else may have tokens
            raise AssertionError("a paged run's span holds another request's tokens")
        pieces += [np.asarray(run_cu, np.int32), plan.work.numpy(), plan.tokens.numpy()]
        nw, nt = len(plan.work), len(plan.tokens)
        paged_spans.append((end, len(run_cu), nw, nt, tuple(run_cu)))
        end += len(run_cu) + nw + nt

    # joined by numpy, on this thread: torch's copies of a work list's size (above its
    # grain of 32768 elements) wake its thread pool, milliseconds on a busy host
    # (NOTES.md §56)
    if device.type == "cuda":
        # into pinned memory (the caching host allocator's block, reused once its copy
        # is done), so the copy is asynchronous: no host-device sync
        pinned = torch.empty(end, dtype=torch.int32, pin_memory=True)
        np.concatenate(pieces, out=pinned.numpy())
        with torch.cuda.stream(stream or torch.cuda.current_stream(device)):
            dev = pinned.to(device, non_blocking=True)
    else:
        dev = torch.from_numpy(np.concatenate(pieces)).to(device)

    made = []
    spread_next = iter(spread_at)
    for spec, (s0, ns, c0, nc), (cols, rows) in zip(specs, spans, columns):
        kind, segs, causal, npieces, pieces_q, _ = spec
        nseg = len(segs)
        segs_host = tuple(packed[s0 : s0 + ns])
        cu_k_host = segs_host[: nseg + 1]
        cu_q_host = tuple(packed[c0 : c0 + nc])
        spread = {}
        if pieces_q is not None:
            # after cu_q: the pieces' call's query starts; copy, first and step apart
            h0 = c0 + nc
            n = cu_q_host[-1]
            starts = packed[h0 : h0 + nc]
            m = starts[-1]  # the pieces' query rows
            m0 = next(spread_next)
            spread = dict(
                pieces=npieces,
                pieces_call=Call(
                    dev[h0 : h0 + nc],
                    dev[s0 : s0 + nseg + 1],  # the window's key starts
                    tuple(starts),
                    cu_k_host,
                    max(pieces_q),
                    max(cols[2]),  # the longest piece
                    False,
                ),
                copy=dev[m0 : m0 + m],
                piece_first=dev[m0 + m : m0 + m + n],
                piece_step=dev[m0 + m + n : m0 + m + 2 * n],
            )
        made.append(
            Window(
                kind=kind,
                q0=segs[0][3],
                q1=segs[0][3] + cu_q_host[-1],
                rows=cu_k_host[-1],
                nseg=nseg,
                search_steps=max(1, nseg.bit_length()),
                segs=dev[s0 : s0 + ns],
                segs_host=segs_host,
                cu_q=dev[c0 : c0 + nc],
                cu_k=dev[s0 : s0 + nseg + 1],
                cu_q_host=cu_q_host,
                cu_k_host=cu_k_host,
                max_q=max(cols[5]),
                max_k=max(rows),
                causal=causal,
                has_chunk=any(cols[4]),
                requests=tuple(itertools.compress(cols[0], cols[5])),
                **spread,
            )
        )
    out: list[Window | LongRequest | PagedRun] = []
    for s in units:
        if isinstance(s, int):
            out.append(made[s])
        elif s[0] == "paged":
            run, plan = runs[s[1]]
            at, nc, nw, nt, cu = paged_spans[s[1]]
            w0, t0 = at + nc, at + nc + nw
            chunk = None
            if not plan.own_keys:  # the combine attends to the own keys itself
                most = plan.max_q_len  # the run's longest request
                chunk = Call(dev[at : at + nc], dev[at : at + nc], cu, cu,
                             most, most, True)  # fmt: skip
            out.append(
                PagedRun(
                    q0=qsl[run[0]],
                    q1=qsl[run[0]] + cu[-1],
                    requests=run,
                    chunk=chunk,
                    paged=plan,
                    work=dev[w0 : w0 + nw].view(-1, WORK_FIELDS),
                    tokens=dev[t0 : t0 + nt].view(-1, TOKEN_FIELDS),
                )
            )
        else:
            r, q0, q1, cap, ids = s
            out.append(LongRequest(r, q0, q1, cap, tuple(made[i] for i in ids)))
    return tuple(out), dev
