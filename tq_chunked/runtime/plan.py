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
  merge). First chunks are copied in like any other request.
* A **long request** (``L_r > capacity``) runs alone: its first cached tokens in
  **part windows** (one attention call each, not causal, every query sees every key),
  then a **last window** with the rest of its cached tokens and all its new ones
  (causal); the partial results are merged exactly (merge.py). Its windows hold
  ``long_capacity[r]`` rows (its own, sized from what its state leaves of the
  workspace: workspace.long_window), more than its ``q_r`` so that the new tokens and
  at least one cached token always fit the last window; ``capacity > N`` (the batch's
  query tokens), so a first chunk always fits a batch window.

    requests   A: 900 + 40 | B: 300 + 20 | C: 30000 cached + 600 new | D: 0 + 64
    windows    [ batch: A, B ][ part: C ][ part: C ][ last: C ...+ new ][ batch: D ]

A plan depends only on host integers (the lengths and the capacities), so one plan
serves every layer of a forward step; ``plan`` memoizes the last few. Its device
integers are uploaded in one asynchronous copy and never written again.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .attention import Call
from .dequant import GAP_ROW, SEG_FIELDS

# Zero key rows between two requests of a batch window, as a sequence of no queries. A
# FlashAttention-3 tile reads past the end of its sequence (up to its key-tile size, at
# most 256 rows) and weighs those keys by 0, and 0 * inf or 0 * NaN is NaN: without the
# gap a non-finite value of one request would reach its neighbour's answer (seen on the
# H200 machine; benchmarks/NOTES.md). Past a window's last row the buffer handed to
# attention ends, and the tile reads zeros.
GAP = 256


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
    steps: int  # binary-search iterations over nseg segments
    # int32 device: nseg + 1 starts, then SEG_FIELDS - 1 arrays of nseg (dequant.py)
    segs: torch.Tensor
    segs_host: tuple[int, ...]
    has_chunk: bool  # some rows are the chunk's new tokens
    requests: tuple[int, ...]  # the requests whose queries it answers, in order

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
    request: int
    q0: int
    q1: int
    capacity: int  # key rows per window
    windows: tuple[Window, ...]  # parts, then the last


@dataclass(frozen=True)
class Plan:
    num_tokens: int  # N, query rows
    capacity: int  # key rows per batch window
    steps: tuple  # Window (batch) or LongRequest, in order of their query rows
    max_window_rows: int  # the most rows any window fills


def plan(
    query_start: tuple[int, ...],
    seq_lens: tuple[int, ...],
    capacity: int,
    device: torch.device,
    stream=None,
    long_capacity: tuple[int, ...] | None = None,
) -> Plan:
    """The windows for these lengths (host ints, already validated): batch windows of
    ``capacity`` key rows (> the batch's query tokens), and for each request longer
    than that, windows of ``long_capacity[r]`` rows (> its query tokens, at most
    ``capacity``; default ``capacity``). Memoized per CUDA stream: a forward step's
    layers share one plan and its device tensors (read-only), uploaded on that stream
    and read only there, so no other stream can still be reading them when the cache
    lets a plan go."""
    return _plan(
        tuple(query_start), tuple(seq_lens), capacity, long_capacity, device, stream
    )


@functools.lru_cache(maxsize=32)
def _plan(qsl, seq_lens, capacity, long_capacity, device, stream):
    b = len(seq_lens)
    n_tok = qsl[-1]
    if capacity <= n_tok:
        raise AssertionError(
            "capacity must exceed the query tokens (workspace.capacity)"
        )
    packed: list[int] = []  # every device int32 array of the plan, uploaded in one copy
    # (kind, segments [(req, pos0, cached, qrow, new rows, query rows)], causal) before
    # upload
    windows = []

    def window(kind, segs, causal):
        windows.append((kind, segs, causal))
        return len(windows) - 1

    steps, batch, batch_rows = [], [], 0

    def flush():
        nonlocal batch, batch_rows
        if batch:
            # the last request's gap is not needed
            steps.append(window("batch", batch[:-1], True))
        batch, batch_rows = [], 0

    for r in range(b):
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
        steps.append((r, qsl[r], qsl[r + 1], cap, ids))
    flush()

    spans = []
    for kind, segs, causal in windows:
        starts = [0]
        for _, _, c, _, new, _ in segs:
            starts.append(starts[-1] + c + new)
        cu_q = [0]
        for *_, q in segs:
            cu_q.append(cu_q[-1] + q)
        fields = (
            starts
            + [s[0] for s in segs]
            + [s[1] for s in segs]
            + [s[2] for s in segs]
            + [s[3] for s in segs]
        )
        assert len(fields) == SEG_FIELDS * len(segs) + 1
        spans.append((len(packed), len(fields), len(packed) + len(fields), len(cu_q)))
        packed.extend(fields)
        packed.extend(cu_q)

    host = torch.tensor(packed, dtype=torch.int32)
    if device.type == "cuda":
        # pinned, so the copy is asynchronous: no host-device sync
        with torch.cuda.stream(stream or torch.cuda.current_stream(device)):
            dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)

    made = []
    for (kind, segs, causal), (s0, ns, c0, nc) in zip(windows, spans):
        nseg = len(segs)
        segs_host = tuple(packed[s0 : s0 + ns])
        starts = segs_host[: nseg + 1]
        cu_q_host = tuple(packed[c0 : c0 + nc])
        made.append(
            Window(
                kind=kind,
                q0=segs[0][3],
                q1=segs[0][3] + cu_q_host[-1],
                rows=starts[-1],
                nseg=nseg,
                steps=max(1, nseg.bit_length()),
                segs=dev[s0 : s0 + ns],
                segs_host=segs_host,
                cu_q=dev[c0 : c0 + nc],
                cu_k=dev[s0 : s0 + nseg + 1],
                cu_q_host=cu_q_host,
                cu_k_host=starts,
                max_q=max(seg[5] for seg in segs),
                max_k=max(seg[2] + seg[4] for seg in segs),
                causal=causal,
                has_chunk=any(seg[4] > 0 for seg in segs),
                requests=tuple(seg[0] for seg in segs if seg[5]),
            )
        )
    out = []
    for s in steps:
        if isinstance(s, int):
            out.append(made[s])
        else:
            r, q0, q1, cap, ids = s
            out.append(LongRequest(r, q0, q1, cap, tuple(made[i] for i in ids)))
    return Plan(
        num_tokens=n_tok,
        capacity=capacity,
        steps=tuple(out),
        max_window_rows=max((w.rows for w in made), default=0),
    )


def cached_window(
    request: int, start: int, length: int, device: torch.device
) -> Window:
    """A window of one request's cached tokens [start, start + length) and nothing else
    (the full-buffer reference path dequantizes a whole prefix with it)."""
    segs = (0, length, request, start, length, 0)
    dev = torch.tensor(segs, dtype=torch.int32, device=device)
    return Window(
        kind="part",
        q0=0,
        q1=0,
        rows=length,
        nseg=1,
        steps=1,
        segs=dev,
        segs_host=segs,
        cu_q=dev[:2],
        cu_k=dev[:2],
        cu_q_host=(0, 0),
        cu_k_host=(0, length),
        max_q=0,
        max_k=length,
        causal=False,
        has_chunk=False,
        requests=(request,),
    )
