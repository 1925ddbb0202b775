"""The public entry points: a batched continuation prefill that streams all requests'
cached prefixes in fixed-size windows instead of dequantizing them whole, and its
one-request form.

    schedule from the host lengths (plan.py, workspace.py)   once per step, memoized:
        the windows, and tiles of whole requests (kv-head groups for one too long)
    for each tile, for each group of kv heads:
        rotate the queries into the workspace (prepare.py)    q_buf (N, Hq_g, D) fp16
        for each window of the cached tokens, all requests at once:
            dequantize it                                     k_buf, v_buf (W, Hk_g, D) fp16
            varlen attention, no mask -> (out, lse)           a partial output
            merge into the running state                      state_out fp32, state_lse
        the chunk's own keys, raw, causal, all requests       -> out (N, Hq, D), query dtype
        merge the state into it                               -> out

With one window, its partial is merged straight into the chunk's result (no state).
Requests with nothing cached take no window: the chunk's attention is their answer.

Memory is the workspace: independent of the cached lengths and of the batch size.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import resolve_backend, varlen_attention
from .dequant import dequantize_window
from .format import TQConfig, resolve_config
from .merge import merge_attn_states
from .plan import WindowPlan, plan_windows
from .prepare import prepare
from .workspace import DEFAULT_WORKSPACE_BYTES, _bytes, as_int, carve, default_window, kv_head_group, tile_rows

_QUERY_DTYPES = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------
# Validation at the boundary
# ---------------------------------------------------------------------------

def _check_tensor(name, t, ndim, dtypes=None, device=None, unit_last=False):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the query's device), got {t.device}")
    if unit_last and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride over its last dimension, got strides {t.stride()}")


def _as_scale(scale):
    if isinstance(scale, torch.Tensor) and scale.device.type != "cpu":
        raise ValueError(f"scale must be a host number (a CUDA tensor would need a synchronization), got {scale!r}")
    if isinstance(scale, (bool, str, bytes)):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise ValueError(f"scale must be a finite positive float, got {type(scale).__name__} {scale!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    return value


def _host_ints(name, cpu, device_tensor, length):
    """A tuple of host ints from the *_cpu argument, else (one synchronization) from the
    device tensor."""
    src = cpu if cpu is not None else device_tensor
    shown = name + ("_cpu" if cpu is not None else "")
    if src is None:
        raise ValueError(f"{name} or {name}_cpu must be given")
    if isinstance(src, torch.Tensor):
        if cpu is not None and src.device.type != "cpu":
            raise ValueError(f"{shown} must be on the CPU (a host copy); a {src.device} tensor would need a "
                             f"synchronization: pass it as {name} instead")
        if src.ndim != 1 or src.dtype.is_floating_point or src.dtype == torch.bool:
            raise ValueError(f"{shown} must be a 1-D integer tensor, got {src.dtype} of shape {tuple(src.shape)}")
        values = src.tolist()
    elif isinstance(src, Sequence):
        values = [as_int(shown, v) for v in src]
    else:
        raise ValueError(f"{shown} must be a tensor or a sequence of ints, got {type(src).__name__}")
    if len(values) != length:
        raise ValueError(f"{shown} must have {length} entries, got {len(values)}")
    return tuple(values)


def _validate(query, key, value, kv_cache, block_table, cfg, centroids, rotation, names):
    dev = query.device
    n, hq, d = query.shape
    if hq == 0:
        raise ValueError("query must have at least one head, got shape " + str(tuple(query.shape)))
    key_name, value_name = names
    for name, t in ((key_name, key), (value_name, value)):
        _check_tensor(name, t, 3, (query.dtype,), dev)
        if t.shape[0] != n or t.shape[2] != d or t.shape[1] == 0:
            raise ValueError(f"{name} must have shape ({n}, Hk, {d}) with Hk >= 1 to match query, got {tuple(t.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"{value_name} must have {key_name}'s shape {tuple(key.shape)}, got {tuple(value.shape)}")
    hk = key.shape[1]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of {key_name} heads ({hk})")
    _check_tensor("kv_cache", kv_cache, 4, (torch.uint8,), dev, unit_last=True)
    if kv_cache.shape[2] != hk or kv_cache.shape[3] != cfg.slot_bytes or kv_cache.shape[1] == 0:
        raise ValueError(f"kv_cache must have shape (num_blocks, block_size, {hk}, {cfg.slot_bytes}) for this "
                         f"preset at D={d}, got {tuple(kv_cache.shape)}")
    _check_tensor("block_table", block_table, 2, (torch.int32,), dev)
    if not cfg.key_fp8:
        _check_tensor("centroids", centroids, 1, (torch.float32,), dev)
        if centroids.shape[0] != 2**cfg.key_bits:
            raise ValueError(f"centroids must have {2**cfg.key_bits} entries, got {centroids.shape[0]}")
        _check_tensor("rotation", rotation, 2, (torch.float32, torch.float16, torch.bfloat16), dev)
        if tuple(rotation.shape) != (d, d):
            raise ValueError(f"rotation must have shape ({d}, {d}), got {tuple(rotation.shape)}")


@functools.lru_cache(maxsize=32)  # every layer of a step passes the same lengths: checked once
def _validate_lengths(qsl, seq_lens, n, block_size, max_blocks):
    if qsl[0] != 0 or qsl[-1] != n:
        raise ValueError(f"query_start_loc must start at 0 and end at the number of query tokens ({n}), "
                         f"got {qsl[0]} ... {qsl[-1]}")
    for r, s in enumerate(seq_lens):
        q_len = qsl[r + 1] - qsl[r]
        if q_len < 0:
            raise ValueError(f"query_start_loc must be non-decreasing, got {qsl[r]} then {qsl[r + 1]} at request {r}")
        if s < q_len:
            raise ValueError(f"seq_lens[{r}] ({s}) must be at least the request's query tokens ({q_len}): "
                             f"seq_lens counts cached + new tokens")
        if q_len and -(-(s - q_len) // block_size) > max_blocks:
            raise ValueError(f"seq_lens[{r}] ({s}) needs more cached blocks than block_table has columns "
                             f"({max_blocks} x block_size {block_size})")


def _check_block_ids(block_table, qsl, lens, block_size, num_blocks):
    """Refuse block ids outside [0, num_blocks) among the columns the call reads (one
    device reduction and one synchronization, before anything runs)."""
    reads = [-(-(s - (qsl[r + 1] - qsl[r])) // block_size) if qsl[r + 1] > qsl[r] else 0 for r, s in enumerate(lens)]
    width = max(reads, default=0)
    if width == 0:
        return
    cols = torch.arange(width, device=block_table.device)
    reads = torch.tensor(reads, device=block_table.device)
    used = block_table[:, :width]
    bad = ((used < 0) | (used >= num_blocks)) & (cols[None, :] < reads[:, None])
    if bool(bad.any()):
        r, c = bad.nonzero()[0].tolist()
        raise ValueError(f"block_table[{r}, {c}] = {block_table[r, c].item()} is not a block of kv_cache "
                         f"(num_blocks {num_blocks}); pass check_block_table=False only if your tables are trusted")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' byte ranges intersect (same storage only)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    span = lambda t: (t.data_ptr(), t.data_ptr() + t.element_size() * (1 + sum((n - 1) * st for n, st in
                                                                              zip(t.shape, t.stride()))))
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


# ---------------------------------------------------------------------------
# The batched call
# ---------------------------------------------------------------------------

def continuation_prefill_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                                block_table: torch.Tensor, query_start_loc: torch.Tensor | None,
                                seq_lens: torch.Tensor | None, *, preset: str | TQConfig,
                                centroids: torch.Tensor | None, rotation: torch.Tensor | None, scale: float,
                                query_start_loc_cpu=None, seq_lens_cpu=None, window: int | None = None,
                                workspace: torch.Tensor | None = None, backend: str = "auto",
                                return_lse: bool = False, out: torch.Tensor | None = None,
                                check_block_table: bool = True, max_workspace_bytes: int | None = None):
    """Attention of a batch of prefill chunks, each over its own cached prefix and itself.

    Requests are packed in vLLM's terms. Request r has ``q_len_r = query_start_loc[r+1]
    - query_start_loc[r]`` new tokens at positions ``cached_r .. seq_lens[r] - 1``, where
    ``cached_r = seq_lens[r] - q_len_r`` tokens are already in the cache. A request
    with nothing cached (a first chunk) or with no new tokens is allowed.

    Args:
        query: (N, Hq, D), fp16 or bf16, any strides: all requests' new tokens.
        key, value: (N, Hk, D), the query's dtype, any strides: their own K/V.
        kv_cache: uint8 (num_blocks, block_size, Hk, slot_bytes), any strides with a unit
            last stride (vLLM 0.20's layout, or 0.33's head-major one seen through
            ``.transpose(1, 2)``). Each request's tokens [0, cached_r) are read; never written.
        block_table: int32 (B, max_blocks), any strides: each request's blocks.
        query_start_loc: int32 (B + 1,) on the device; read only without ``query_start_loc_cpu``.
        seq_lens: int32 (B,) on the device (cached + new tokens); read only without ``seq_lens_cpu``.
        preset: a ``turboquant_*`` name or a ``TQConfig``.
        centroids: float32 (2**key_bits,), the centroids the cache was written with
            (vLLM: ``layer._tq_centroids``); unused, may be None, for fp8-key presets.
        rotation: (D, D) orthonormal matrix the keys were rotated by (vLLM: ``layer._tq_Pi``);
            unused for fp8-key presets.
        scale: softmax scale, finite and positive.
        query_start_loc_cpu, seq_lens_cpu: host copies of the two (CPU tensors or int
            sequences, as vLLM keeps them). Given, the call never synchronizes with the
            GPU (with ``check_block_table=False``); absent, it reads the device tensors once.
        window: cached tokens per window; default ``default_window(Hk, D, block_size)``.
        workspace: optional contiguous uint8 buffer of at least ``workspace_bytes(N, Hq,
            Hk, D, window, query.dtype, max_bytes=max_workspace_bytes)`` bytes on the
            query's device; allocated per call when None.
        backend: "auto", "flash", "triton" or "torch" (see attention.py). A named back end
            that is unavailable raises; it is never silently replaced.
        return_lse: also return the (Hq, N) float32 log-sum-exp.
        out: optional (N, Hq, D) tensor of the query's dtype, unit stride over D, to write into.
        check_block_table: refuse block ids outside [0, num_blocks) among those read (one
            synchronization). Off, the kernels still never read outside kv_cache: a bad id
            reads as zeros, a wrong answer for that request only.
        max_workspace_bytes: the budget that sets how many kv heads run at once
            (``workspace.kv_head_group``); default 128 MiB.

    Returns:
        (N, Hq, D) in the query's dtype; with return_lse, (out, lse).
    """
    _check_tensor("query", query, 3, _QUERY_DTYPES)
    _check_tensor("block_table", block_table, 2, (torch.int32,), query.device)
    b = block_table.shape[0]
    qsl = _host_ints("query_start_loc", query_start_loc_cpu, query_start_loc, b + 1)
    lens = _host_ints("seq_lens", seq_lens_cpu, seq_lens, b)
    return _run(query, key, value, kv_cache, block_table, qsl, lens, preset=preset, centroids=centroids,
                rotation=rotation, scale=scale, window=window, workspace=workspace, backend=backend,
                return_lse=return_lse, out=out, check_block_table=check_block_table,
                max_workspace_bytes=max_workspace_bytes)


def continuation_prefill(query: torch.Tensor, key_chunk: torch.Tensor, val_chunk: torch.Tensor,
                         kv_cache: torch.Tensor, block_table: torch.Tensor, cached_len: int, *,
                         preset: str | TQConfig, centroids: torch.Tensor | None, rotation: torch.Tensor | None,
                         scale: float, window: int | None = None, workspace: torch.Tensor | None = None,
                         backend: str = "auto", return_lse: bool = False, out: torch.Tensor | None = None,
                         check_block_table: bool = True, max_workspace_bytes: int | None = None):
    """One request's chunk over its cached prefix and itself: ``continuation_prefill_varlen``
    with a batch of one (same engine, same arguments but these):

        query: (q_len, Hq, D); key_chunk, val_chunk: (q_len, Hk, D): the chunk.
        block_table: int32 (max_blocks,) or (1, max_blocks): the request's blocks.
        cached_len: tokens already in the cache before this chunk (a host integer).
    """
    _check_tensor("query", query, 3, _QUERY_DTYPES)
    if not isinstance(block_table, torch.Tensor) or block_table.ndim not in (1, 2) or \
            (block_table.ndim == 2 and block_table.shape[0] != 1):
        raise ValueError(f"block_table must be a (max_blocks,) or (1, max_blocks) tensor, got "
                         f"{getattr(block_table, 'shape', type(block_table).__name__)}")
    cached_len = as_int("cached_len", cached_len, 0)
    q_len = query.shape[0]
    return _run(query, key_chunk, val_chunk, kv_cache, block_table.reshape(1, -1), (0, q_len), (cached_len + q_len,),
                preset=preset, centroids=centroids, rotation=rotation, scale=scale, window=window,
                workspace=workspace, backend=backend, return_lse=return_lse, out=out,
                check_block_table=check_block_table, max_workspace_bytes=max_workspace_bytes,
                names=("key_chunk", "val_chunk"))


def _run(query, key, value, kv_cache, block_table, qsl, lens, *, preset, centroids, rotation, scale, window, workspace,
         backend, return_lse, out, check_block_table, max_workspace_bytes, names=("key", "value")):
    n, hq, d = query.shape
    cfg = resolve_config(preset, d)
    _validate(query, key, value, kv_cache, block_table, cfg, centroids, rotation, names)
    scale = _as_scale(scale)
    num_blocks, block_size, hk = kv_cache.shape[0], kv_cache.shape[1], key.shape[1]
    _validate_lengths(qsl, lens, n, block_size, block_table.shape[1])
    window = default_window(hk, d, block_size) if window is None else as_int("window", window, 1)
    if max_workspace_bytes is not None:
        max_workspace_bytes = as_int("max_workspace_bytes", max_workspace_bytes, 1)
    backend = resolve_backend(backend, query.device, d)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    else:
        _check_tensor("out", out, 3, (query.dtype,), query.device, unit_last=True)
        if out.shape != query.shape:
            raise ValueError(f"out must have the query's shape {tuple(query.shape)}, got {tuple(out.shape)}")
        for name, t in ((names[0], key), (names[1], value), ("query", query), ("workspace", workspace)):
            if t is not None and _overlaps(out, t):  # out holds partial results before they are read
                raise ValueError(f"out must not share memory with {name}")
    lse = torch.empty(hq, n, dtype=torch.float32, device=query.device) if return_lse else None
    if n == 0:
        return (out, lse) if return_lse else out

    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError("continuation_prefill_varlen cannot run inside CUDA graph capture: it plans its windows "
                         "on the host from the lengths of each batch")
    if check_block_table:
        _check_block_ids(block_table, qsl, lens, block_size, num_blocks)
    budget = DEFAULT_WORKSPACE_BYTES if max_workspace_bytes is None else max_workspace_bytes
    if workspace is not None:
        _check_tensor("workspace", workspace, 1, (torch.uint8,), query.device)
        if not workspace.is_contiguous():
            raise ValueError("workspace must be contiguous")
        budget = min(budget, workspace.numel())
    stream = torch.cuda.current_stream(query.device) if query.is_cuda else None
    tiles, need = schedule(qsl, lens, window, hq, hk, d, query.dtype, budget, query.device, stream)
    reuse = workspace is not None  # the caller's: its views can be kept for the next call
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=query.device)
    elif workspace.numel() < need:
        raise ValueError(f"workspace must hold at least workspace_bytes(...) = {need} bytes for this call, "
                         f"got {workspace.numel()}")
    for tile in tiles:
        if len(tiles) == 1:
            rows = (query, key, value, block_table, out, lse)
        else:
            q0, q1 = qsl[tile.r0], qsl[tile.r1]
            rows = (query[q0:q1], key[q0:q1], value[q0:q1], block_table[tile.r0:tile.r1], out[q0:q1],
                    None if lse is None else lse[:, q0:q1])
        _attend(*rows, kv_cache, tile.plan, tile.kv_group, cfg, centroids, rotation, scale, backend, workspace, reuse)
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class Tile:
    r0: int  # requests [r0, r1)
    r1: int
    plan: WindowPlan
    kv_group: int  # kv heads at once


@functools.lru_cache(maxsize=32)
def schedule(qsl, lens, window, hq, hk, d, dtype, budget, device, stream=None):
    """Tiles of whole requests whose query rows fit the budget with all heads (a request
    too long for one runs alone, its kv heads in groups), their plans, and the workspace
    bytes the largest needs (workspace.py). Memoized per stream, like the plans: one per
    step, and a plan's device tensors are only ever read on the stream that wrote them."""
    b, g = len(lens), hq // hk
    cached = sum(s - (qsl[r + 1] - qsl[r]) for r, s in enumerate(lens) if qsl[r + 1] > qsl[r])
    w_eff = max(1, min(window, cached))  # no tile reads a longer window than this
    one_window = cached <= window and dtype == torch.float16  # then no tile keeps a state: a smaller layout
    # Nothing cached: no window, no workspace, one tile.
    rows = tile_rows(qsl[-1], hq, hk, d, w_eff, dtype, budget, one_window) if cached else qsl[-1]
    cuts, r0 = [], 0
    for r in range(b + 1):  # close a tile before the request that would overflow it, and at the end
        if r == b or (r > r0 and qsl[r + 1] - qsl[r0] > rows):
            cuts.append((r0, r))
            r0 = r
    tiles, need = [], 0
    for r0, r1 in cuts:
        base = qsl[r0]
        if qsl[r1] == base:
            continue  # no query rows: nothing to compute for these requests
        plan = plan_windows(tuple(q - base for q in qsl[r0:r1 + 1]), lens[r0:r1], window, device, stream)
        if not plan.windows:  # first chunks only: the chunk's attention, all heads, no workspace
            tiles.append(Tile(r0, r1, plan, hk))
            continue
        single = len(plan.windows) == 1 and dtype == torch.float16  # no state: a smaller layout
        hk_g = kv_head_group(plan.num_tokens, hq, hk, d, plan.window, dtype, budget, single)
        tiles.append(Tile(r0, r1, plan, hk_g))
        need = max(need, _bytes(plan.num_tokens, g * hk_g, hk_g, d, plan.window, dtype, single))
    return tuple(tiles), need


def _attend(query, key, value, block_table, out, lse, kv_cache, plan, hk_g, cfg, centroids, rotation, scale, backend,
            workspace, reuse):
    """One tile: the window loop for each group of kv heads (see the module docstring)."""
    n, hq, d = query.shape
    hk = key.shape[1]
    hq_g = hq // hk * hk_g
    windows = plan.windows
    # bf16 queries: the chunk's attention runs on fp16 copies, so that its partial output is
    # rounded once to fp16, not to bf16 before the merge (that cost 1.1-1.25x the full
    # path's error where the chunk dominates: tests/test_varlen.py, benchmarks/NOTES.md).
    chunk16 = bool(windows) and query.dtype == torch.bfloat16
    single = len(windows) == 1 and not chunk16  # its partial merges straight into the chunk's result
    regions = ("k_buf", "v_buf", "q_buf") + (("part",) if single else ("state_out", "state_lse")) + \
        (("q16", "k16", "v16") if chunk16 else ())
    bufs = carve(workspace, regions if windows else (), n, hq_g, hk_g, d, plan.window, query.dtype, single=single,
                 reuse=reuse)
    scratch = out.view(torch.float16)  # partial outputs in out's bytes, until the final merge
    rotation = None if cfg.key_fp8 else rotation
    centroids = centroids if centroids is not None else kv_cache  # fp8 keys: not read
    for kv0 in range(0, hk, hk_g):
        q0 = kv0 * (hq // hk)
        whole = hk_g == hk  # all heads at once: no head slices
        heads, kv_heads = slice(q0, q0 + hq_g), slice(kv0, kv0 + hk_g)
        group_out = out if whole else out[:, heads]
        group_lse = lse if whole or lse is None else lse[heads]
        group_scratch = scratch if whole else scratch[:, heads]
        if windows:
            prepare(query, key, value, rotation, q0, kv0, bufs, init_lse=not single, chunk16=chunk16)
        for call in windows:
            dequantize_window(kv_cache, block_table, cfg, centroids, plan, call, kv0, bufs.k_buf, bufs.v_buf)
            part = (bufs.part if single else group_scratch)[call.q0:call.q1]
            part_lse = varlen_attention(call, bufs.q_buf[call.q0:call.q1], bufs.k_buf, bufs.v_buf, scale, part,
                                        backend)
            if not single:
                merge_attn_states(bufs.state_out, bufs.state_lse, part, part_lse, bufs.state_out, bufs.state_lse,
                                  row0=call.q0)
        # The chunk's own keys, causal, all requests: a first-chunk prefill on the raw Q/K/V.
        if chunk16:
            chunk_out = group_scratch
            chunk_lse = varlen_attention(plan.chunk, bufs.q16, bufs.k16, bufs.v16, scale, chunk_out, backend)
        else:
            chunk_out = group_out
            q, k, v = (query, key, value) if whole else (query[:, heads], key[:, kv_heads], value[:, kv_heads])
            chunk_lse = varlen_attention(plan.chunk, q, k, v, scale, chunk_out, backend)
        if group_lse is not None:
            chunk_lse = group_lse.copy_(chunk_lse)  # merged in place below
        if single:  # the one window's partial (its requests' rows) into the chunk's result
            merge_attn_states(chunk_out, chunk_lse, part, part_lse, group_out, group_lse, row0=windows[0].q0)
        elif windows:
            merge_attn_states(bufs.state_out, bufs.state_lse, chunk_out, chunk_lse, group_out, group_lse)
