"""The host-side schedule of a batched continuation prefill: which cached tokens each
window holds, and the sequence lengths each attention call needs.

All requests' cached prefixes are laid end to end on one *virtual* token axis
(request r owns ``[cached_start[r], cached_start[r + 1])``; a request with no query
tokens owns nothing, since nothing attends to it). Windows of ``window`` tokens stream
over that axis, so the number of windows, and of kernel launches, depends on the total
cached length, not on the number of requests:

    virtual axis  | r0 cached ........ | r1 cached .. | r2 cached ............... |
    windows       [ window 0        ][ window 1        ][ window 2             ]

Each window is one attention call without a mask over the requests it touches (every
query of a request sees all of its cached keys). The chunk's own keys are one more
call, causal, over all requests on the raw K/V: ``cu_q = cu_k = query_start_loc``,
exactly a first-chunk prefill.

A plan depends only on host integers (the lengths and the window), so one plan serves
every layer of a forward step; ``plan_windows`` memoizes the last few. Its device
tensors are uploaded in one asynchronous copy and never written again.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WindowCall:
    """One attention call over a window: query rows [q0, q1) of requests [r0, r1)."""

    start: int  # first virtual cached token of the window
    length: int  # cached tokens dequantized for it
    r0: int
    r1: int
    q0: int
    q1: int
    cu_q: torch.Tensor  # int32 (r1 - r0 + 1,) on the device, relative to q0
    cu_k: torch.Tensor  # int32 (r1 - r0 + 1,) on the device
    cu_q_host: tuple[int, ...]
    cu_k_host: tuple[int, ...]
    max_q: int
    max_k: int
    causal: bool  # True for the chunk's own keys


@dataclass(frozen=True)
class WindowPlan:
    num_reqs: int
    num_tokens: int  # N, query rows
    window: int  # cached tokens per window (the effective one: at most the total cached)
    total_cached: int
    cached_start: torch.Tensor  # int32 (B + 1,) device: virtual offsets of the cached prefixes
    search_steps: int  # binary-search iterations over B + 1 offsets
    windows: tuple[WindowCall, ...]  # over the cached tokens, in order; none if nothing is cached
    chunk: WindowCall  # the chunk's own keys: causal, all requests
    cached_start_host: tuple[int, ...]  # host copy, for the PyTorch path


def plan_windows(query_start: tuple[int, ...], seq_lens: tuple[int, ...], window: int, device: torch.device,
                 stream=None) -> WindowPlan:
    """The window schedule for these lengths (host ints, already validated). Memoized per
    CUDA stream: a forward step's layers share one plan and its device tensors
    (read-only), uploaded on that stream and read only there, so no other stream can
    still be reading them when the cache lets a plan go."""
    return _plan(tuple(query_start), tuple(seq_lens), window, device, stream)


@functools.lru_cache(maxsize=32)
def _plan(qsl, seq_lens, window, device, stream):
    b = len(seq_lens)
    n_tok = qsl[-1]
    q_lens = [qsl[r + 1] - qsl[r] for r in range(b)]
    cached = [seq_lens[r] - q_lens[r] if q_lens[r] > 0 else 0 for r in range(b)]
    vstart = [0]
    for c in cached:
        vstart.append(vstart[-1] + c)
    total = vstart[-1]
    window = max(1, min(window, total))  # never larger than what the call reads

    packed: list[int] = []  # every device int32 array of the plan, uploaded in one copy
    spans = []

    def put(values):
        spans.append((len(packed), len(values)))
        packed.extend(values)
        return len(spans) - 1

    calls = []
    for s in range(0, total, window):
        e = min(s + window, total)
        r0 = bisect.bisect_right(vstart, s) - 1  # the request owning virtual token s (never an empty one)
        r1 = bisect.bisect_left(vstart, e, lo=r0 + 1)  # requests [r0, r1) intersect [s, e)
        keys = [max(0, min(vstart[r + 1], e) - max(vstart[r], s)) for r in range(r0, r1)]
        cu_k = [0]
        for k in keys:
            cu_k.append(cu_k[-1] + k)
        cu_q = [qsl[r] - qsl[r0] for r in range(r0, r1 + 1)]
        calls.append(dict(start=s, length=e - s, r0=r0, r1=r1, q0=qsl[r0], q1=qsl[r1], cu_q=put(cu_q),
                          cu_k=put(cu_k), cu_q_host=tuple(cu_q), cu_k_host=tuple(cu_k),
                          max_q=max(q_lens[r0:r1]), max_k=max(keys), causal=False))
    i_qsl = put(list(qsl))
    max_q = max(q_lens, default=0)
    chunk = dict(start=0, length=0, r0=0, r1=b, q0=0, q1=n_tok, cu_q=i_qsl, cu_k=i_qsl, cu_q_host=tuple(qsl),
                 cu_k_host=tuple(qsl), max_q=max_q, max_k=max_q, causal=True)
    i_vstart = put(vstart)

    host = torch.tensor(packed, dtype=torch.int32)
    if device.type == "cuda":  # pinned, so the copy is asynchronous: no host-device sync
        with torch.cuda.stream(stream or torch.cuda.current_stream(device)):
            dev = host.pin_memory().to(device, non_blocking=True)
    else:
        dev = host.to(device)
    view = lambda i: dev[spans[i][0]:spans[i][0] + spans[i][1]]
    call = lambda c: WindowCall(**{**c, "cu_q": view(c["cu_q"]), "cu_k": view(c["cu_k"])})
    return WindowPlan(num_reqs=b, num_tokens=n_tok, window=window, total_cached=total, cached_start=view(i_vstart),
                      search_steps=max(1, b.bit_length()),
                      windows=tuple(call(c) for c in calls), chunk=call(chunk),
                      cached_start_host=tuple(vstart))
