"""The public entry points: a batched continuation prefill that streams the cached
prefixes through fixed-size windows instead of dequantizing them whole, and its
one-request form.

    schedule from the host lengths (plan.py, workspace.py)  once per step, memoized
    for each batch window (requests that fit one):          all kv heads
        fill it: cached keys dequantized and un-rotated,    k_buf, v_buf (rows, Hk, D)
            then the chunk's own keys after them (dequant.py)
        one causal varlen attention call                    -> out rows, final
    for each long request, for each group of its kv heads:
        for each part window: fill, attend (not causal)     a partial, merged into
                                                            the state
        last window (the rest, and the chunk): fill,        a partial in out's bytes
            attend causal, merge the state into it          -> out rows, final

Memory is the workspace: independent of the cached lengths and of the batch size.
What the call promises for bad input, non-finite values and overlapping tensors:
docs/design.md, "What the call promises".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from ._utils import (
    as_int,
    check_overlaps,
    check_tensor,
    self_overlapping,
    use_triton,
)
from .attention import resolve_backend, varlen_attention
from .dequant import fill_window, split_rotation
from .format import TQConfig, resolve_config
from .merge import merge_attn_states
from .plan import GAP, LongRequest, plan
from .workspace import (
    DEFAULT_WORKSPACE_BYTES,
    capacity,
    carve,
    default_window,
    fit_window,
    layout_bytes,
    long_window,
)

QUERY_DTYPES = (torch.float16, torch.bfloat16)
INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------
# Validation at the boundary
# ---------------------------------------------------------------------------


def _as_scale(scale):
    if isinstance(scale, torch.Tensor) and scale.device.type != "cpu":
        raise ValueError(
            f"scale must be a host number (a {scale.device} tensor would need a "
            f"synchronization), got {scale!r}"
        )
    if isinstance(scale, (bool, str, bytes)):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    try:
        value = float(scale)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(
            f"scale must be a finite positive float, got {type(scale).__name__} "
            f"{scale!r}"
        ) from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    return value


def _host_ints(name, cpu, device_tensor, device):
    """A tuple of host ints from the *_cpu argument, else (one synchronization) from
    the device tensor; each entry in [0, 2**31)."""
    src = cpu if cpu is not None else device_tensor
    shown = name + ("_cpu" if cpu is not None else "")
    if src is None:
        raise ValueError(f"{name} or {name}_cpu must be given")
    if isinstance(src, torch.Tensor):
        if cpu is not None and src.device.type != "cpu":
            raise ValueError(
                f"{shown} must be on the CPU (a host copy); a {src.device} tensor "
                f"would need a synchronization: pass it as {name} instead"
            )
        if cpu is None and src.device != device:
            raise ValueError(
                f"{name} must be on {device} (the query's device), got {src.device}"
            )
        if (
            src.ndim != 1
            or src.dtype.is_floating_point
            or src.dtype.is_complex
            or src.dtype == torch.bool
        ):
            raise ValueError(
                f"{shown} must be a 1-D integer tensor, got {src.dtype} of shape "
                f"{tuple(src.shape)}"
            )
        try:
            values = src.tolist()
        except (RuntimeError, NotImplementedError) as e:
            raise ValueError(
                f"{shown} cannot be read on the host ({src.device}): {e}"
            ) from None
    elif type(src).__module__ == "numpy" and hasattr(src, "ndim"):
        # a numpy array, as vLLM's host copies
        if src.ndim != 1 or src.dtype.kind not in "iu":
            raise ValueError(
                f"{shown} must be a 1-D integer array, got {src.dtype} of shape "
                f"{src.shape}"
            )
        values = [int(v) for v in src]
    elif isinstance(src, Sequence) and not isinstance(src, (str, bytes)):
        values = [as_int(f"{shown}[{i}]", v) for i, v in enumerate(src)]
    else:
        raise ValueError(
            f"{shown} must be a tensor, a numpy array or a sequence of ints, got "
            f"{type(src).__name__}"
        )
    for i, v in enumerate(values):
        if not 0 <= v <= INT32_MAX:
            raise ValueError(f"{shown}[{i}] must be in [0, 2**31), got {v}")
    return tuple(values)


def _check_device_lengths(name, t, entries, device):
    """The device copy of a length array when its host copy is given: not read, but its
    form is checked, so that an engine's bookkeeping error does not pass unseen."""
    if t is None:
        return
    check_tensor(name, t, 1, (torch.int32,), device)
    if t.shape[0] != entries:
        raise ValueError(
            f"{name} must have {entries} entries (as {name}_cpu), got {t.shape[0]}"
        )


def _validate(
    query, key, value, kv_cache, block_table, cfg, centroids, rotation, names, preset
):
    dev = query.device
    n, hq, d = query.shape
    key_name, value_name = names
    if hq == 0:
        raise ValueError(
            "query must have at least one head, got shape " + str(tuple(query.shape))
        )
    if n > INT32_MAX:
        raise ValueError(f"query must have fewer than 2**31 tokens, got {n}")
    check_tensor("kv_cache", kv_cache, 4, (torch.uint8,), dev, unit_last=True)
    hk = kv_cache.shape[2]
    if hk == 0 or kv_cache.shape[3] != cfg.slot_bytes or kv_cache.shape[1] == 0:
        raise ValueError(
            f"kv_cache must have shape (num_blocks, block_size, Hk, {cfg.slot_bytes}) "
            f"with block_size, Hk >= 1 for preset {preset} at D={d}, got "
            f"{tuple(kv_cache.shape)}"
        )
    for name, t in ((key_name, key), (value_name, value)):
        check_tensor(name, t, 3, (query.dtype,), dev)
        if tuple(t.shape) != (n, hk, d):
            raise ValueError(
                f"{name} must have shape ({n}, {hk}, {d}): the query's tokens and head "
                f"size, kv_cache's {hk} kv heads; got {tuple(t.shape)}"
            )
    if hq % hk:
        raise ValueError(
            f"query heads ({hq}) must be a multiple of kv_cache's kv heads ({hk})"
        )
    check_tensor("block_table", block_table, 2, (torch.int32,), dev)
    if cfg.key_fp8:
        return
    for name, t, what in (
        (
            "centroids",
            centroids,
            "the centroid table the cache was written with (vLLM: layer._tq_centroids)",
        ),
        (
            "rotation",
            rotation,
            "the rotation the keys were written with (vLLM: layer._tq_Pi)",
        ),
    ):
        if t is None:
            raise ValueError(
                f"{name} is required for preset {preset}, whose keys are centroid "
                f"indices: pass {what}"
            )
    check_tensor("centroids", centroids, 1, (torch.float32,), dev)
    if centroids.shape[0] != 2**cfg.key_bits:
        raise ValueError(
            f"centroids must have {2**cfg.key_bits} entries for preset {preset}, got "
            f"{centroids.shape[0]}"
        )
    check_tensor(
        "rotation", rotation, 2, (torch.float32, torch.float16, torch.bfloat16), dev
    )
    if tuple(rotation.shape) != (d, d):
        raise ValueError(
            f"rotation must have shape ({d}, {d}), got {tuple(rotation.shape)}"
        )


# every layer of a step passes the same lengths: checked once
@functools.lru_cache(maxsize=32)
def _validate_lengths(qsl, seq_lens, n, block_size, max_blocks):
    if qsl[0] != 0 or qsl[-1] != n:
        raise ValueError(
            f"query_start_loc must start at 0 and end at the number of query tokens "
            f"({n}), got {qsl[0]} ... {qsl[-1]}"
        )
    for r, s in enumerate(seq_lens):
        q_len = qsl[r + 1] - qsl[r]
        if q_len < 0:
            raise ValueError(
                f"query_start_loc must be non-decreasing, got {qsl[r]} then "
                f"{qsl[r + 1]} at request {r}"
            )
        if s < q_len:
            raise ValueError(
                f"seq_lens[{r}] ({s}) must be at least the request's query tokens "
                f"({q_len}): seq_lens counts cached + new tokens"
            )
        if q_len and -(-(s - q_len) // block_size) > max_blocks:
            raise ValueError(
                f"seq_lens[{r}] ({s}) needs more cached blocks than block_table has "
                f"columns ({max_blocks} x block_size {block_size})"
            )


def _check_block_ids_on_host(block_table, qsl, lens, block_size, num_blocks):
    """CPU tensors: the block ids the call reads, checked before anything runs."""
    for r, s in enumerate(lens):
        q_len = qsl[r + 1] - qsl[r]
        cols = -(-(s - q_len) // block_size) if q_len else 0
        if cols:
            ids = block_table[r, :cols]
            bad = ((ids < 0) | (ids >= num_blocks)).nonzero()
            if bad.numel():
                c = int(bad[0, 0])
                raise ValueError(
                    f"block_table[{r}, {c}] = {int(ids[c])} is not a block of kv_cache "
                    f"(num_blocks {num_blocks}); pass check_block_table=False only if "
                    f"your tables are trusted"
                )


def _check_written(name, t):
    if self_overlapping(t):
        raise ValueError(
            f"{name} must not have elements that share memory (a stride-0 or "
            f"overlapping layout), got shape {tuple(t.shape)} with strides {t.stride()}"
        )


# ---------------------------------------------------------------------------
# Bad block ids on the device: recorded by the fill kernel, reported without a sync
# ---------------------------------------------------------------------------

_NO_ERROR = 2**63 - 1
# device -> [device int64 (1,), pinned host int64 (1,), event or None]
_block_errors: dict = {}


def _block_error_slot(device):
    slot = _block_errors.get(device)
    if slot is None:  # once per device: the only allocation outside the workspace
        slot = _block_errors[device] = [
            torch.full((1,), _NO_ERROR, dtype=torch.int64, device=device),
            torch.full((1,), _NO_ERROR, dtype=torch.int64).pin_memory(),
            None,
        ]
    return slot


def _raise_block_error(slot):
    code = int(slot[1][0])
    if code == _NO_ERROR:
        return
    slot[0].fill_(_NO_ERROR)
    slot[1][0] = _NO_ERROR
    r, c = code >> 32, code & 0xFFFFFFFF
    raise ValueError(
        f"block_table[{r}, {c}] read by an earlier call on this device is not a block "
        f"of its kv_cache (outside [0, num_blocks)): nothing outside kv_cache was "
        f"read, and that call's output rows for request {r} are NaN. Checked on the "
        f"device and reported at the next call (tq_chunked.check_block_tables() waits "
        f"for it)"
    )


def check_block_tables(device=None) -> None:
    """Wait for the block-id checks of the calls made so far on ``device`` (default:
    the current CUDA device) and raise the ValueError of the first bad id found, if
    any. Calls with ``check_block_table=True`` record bad ids on the device and report
    them at the next call without synchronizing; this synchronizes."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device is None
        else torch.device(device)
    )
    slot = _block_errors.get(device)
    if slot is None or slot[2] is None:
        return
    slot[2].synchronize()
    _raise_block_error(slot)


def _report_earlier_block_errors(device):
    slot = _block_errors.get(device)
    if slot is not None and slot[2] is not None and slot[2].query():
        _raise_block_error(slot)


# ---------------------------------------------------------------------------
# The batched call
# ---------------------------------------------------------------------------


def continuation_prefill_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    seq_lens: torch.Tensor | None,
    *,
    preset: str | TQConfig,
    centroids: torch.Tensor | None,
    rotation: torch.Tensor | None,
    scale: float,
    query_start_loc_cpu=None,
    seq_lens_cpu=None,
    window: int | None = None,
    workspace: torch.Tensor | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check_block_table: bool = True,
    max_workspace_bytes: int | None = None,
):
    """Attention of a batch of prefill chunks, each over its cached prefix and itself.

    Requests are packed in vLLM's terms. Request r has
    ``q_len_r = query_start_loc[r+1] - query_start_loc[r]`` new tokens at positions
    ``cached_r .. seq_lens[r] - 1``, where ``cached_r = seq_lens[r] - q_len_r`` tokens
    are already in the cache. A request with nothing cached (a first chunk) or with no
    new tokens is allowed.

    Args:
        query: (N, Hq, D), fp16 or bf16, any strides: all requests' new tokens.
        key: (N, Hk, D), the query's dtype, any strides: their own K.
        value: (N, Hk, D), the query's dtype, any strides: their own V.
        kv_cache: uint8 (num_blocks, block_size, Hk, slot_bytes), any strides with a
            unit last stride (vLLM 0.20's layout, or 0.33's head-major one seen
            through ``.transpose(1, 2)``). Each request's tokens [0, cached_r) are
            read; never written.
        block_table: int32 (B, max_blocks), any strides: each request's blocks.
        query_start_loc: int32 (B + 1,) on the device; read only without
            ``query_start_loc_cpu``.
        seq_lens: int32 (B,) on the device (cached + new tokens); read only without
            ``seq_lens_cpu``.
        preset: a ``turboquant_*`` name or a ``TQConfig``.
        centroids: float32 (2**key_bits,), the centroids the cache was written with
            (vLLM: ``layer._tq_centroids``); unused, may be None, for fp8-key presets.
        rotation: (D, D) orthonormal matrix the keys were rotated by (vLLM:
            ``layer._tq_Pi``); unused for fp8-key presets.
        scale: softmax scale, finite and positive.
        query_start_loc_cpu: host copy of ``query_start_loc`` (a CPU tensor, a numpy
            array or an int sequence, as vLLM keeps it).
        seq_lens_cpu: host copy of ``seq_lens``, in the same forms. With both host
            copies given, the call never synchronizes with the GPU; without one, it
            reads that device tensor once.
        window: key rows per window (at least N + 1 are used); default
            ``default_window(Hk, D, block_size)``: 127 MiB of K+V. Fewer where the
            K/V would not fit the budget (``workspace.fit_window``); a long request's
            windows hold what its state leaves of the workspace
            (``workspace.long_window``).
        workspace: optional contiguous uint8 buffer of at least ``workspace_bytes(N,
            Hq, Hk, D, window, query.dtype, max_bytes=max_workspace_bytes)`` bytes on
            the query's device; allocated per call when None.
        backend: "auto", "flash", "triton" or "torch" (see attention.py). A named
            back end that is unavailable raises; it is never silently replaced.
        return_lse: also return the (Hq, N) float32 log-sum-exp (natural log).
        out: optional (N, Hq, D) tensor of the query's dtype, unit stride over D, to
            write into.
        lse: optional (Hq, N) float32 tensor, unit stride over N, to write the
            log-sum-exp into (returned with ``return_lse``).
        check_block_table: record block ids outside [0, num_blocks) among those read,
            and raise a ValueError naming the first one at the next call on the device
            (or at ``check_block_tables()``), without synchronizing (on a CPU: before
            anything runs). Checked or not, such an id is never read: its request's
            rows come out NaN.
        max_workspace_bytes: the budget of the workspace (window, and a long
            request's state with its window and kv-head group); default 128 MiB.

    Returns:
        (N, Hq, D) in the query's dtype; with return_lse, (out, lse).

    """
    check_tensor("query", query, 3, QUERY_DTYPES)
    check_tensor("block_table", block_table, 2, (torch.int32,), query.device)
    qsl = _host_ints(
        "query_start_loc", query_start_loc_cpu, query_start_loc, query.device
    )
    if len(qsl) < 1:
        raise ValueError("query_start_loc must have B + 1 >= 1 entries, got none")
    b = len(qsl) - 1
    lens = _host_ints("seq_lens", seq_lens_cpu, seq_lens, query.device)
    if len(lens) != b:
        raise ValueError(
            f"seq_lens must have one entry per request (len(query_start_loc) - 1 = "
            f"{b}), got {len(lens)}"
        )
    if block_table.shape[0] != b:
        raise ValueError(
            f"block_table must have one row per request ({b}, as query_start_loc and "
            f"seq_lens), got {block_table.shape[0]}"
        )
    if query_start_loc_cpu is not None:
        _check_device_lengths("query_start_loc", query_start_loc, b + 1, query.device)
    if seq_lens_cpu is not None:
        _check_device_lengths("seq_lens", seq_lens, b, query.device)
    return _run(
        query,
        key,
        value,
        kv_cache,
        block_table,
        qsl,
        lens,
        preset=preset,
        centroids=centroids,
        rotation=rotation,
        scale=scale,
        window=window,
        workspace=workspace,
        backend=backend,
        return_lse=return_lse,
        out=out,
        lse=lse,
        check_block_table=check_block_table,
        max_workspace_bytes=max_workspace_bytes,
        lengths_read=(("query_start_loc", query_start_loc), ("seq_lens", seq_lens)),
    )


def continuation_prefill(
    query: torch.Tensor,
    key_chunk: torch.Tensor,
    val_chunk: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cached_len: int,
    *,
    preset: str | TQConfig,
    centroids: torch.Tensor | None,
    rotation: torch.Tensor | None,
    scale: float,
    window: int | None = None,
    workspace: torch.Tensor | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    check_block_table: bool = True,
    max_workspace_bytes: int | None = None,
):
    """One request's chunk over its cached prefix and itself:
    ``continuation_prefill_varlen`` with a batch of one (same engine, same arguments
    but these):

        query: (q_len, Hq, D); key_chunk, val_chunk: (q_len, Hk, D): the chunk.
        block_table: int32 (max_blocks,) or (1, max_blocks): the request's blocks.
        cached_len: tokens already in the cache before this chunk (a host integer).
    """
    check_tensor("query", query, 3, QUERY_DTYPES)
    if (
        not isinstance(block_table, torch.Tensor)
        or block_table.ndim not in (1, 2)
        or (block_table.ndim == 2 and block_table.shape[0] != 1)
    ):
        raise ValueError(
            f"block_table must be a (max_blocks,) or (1, max_blocks) tensor, got "
            f"{getattr(block_table, 'shape', type(block_table).__name__)}"
        )
    q_len = query.shape[0]
    cached_len = as_int("cached_len", cached_len, 0, INT32_MAX - q_len)
    return _run(
        query,
        key_chunk,
        val_chunk,
        kv_cache,
        block_table.reshape(1, -1),
        (0, q_len),
        (cached_len + q_len,),
        preset=preset,
        centroids=centroids,
        rotation=rotation,
        scale=scale,
        window=window,
        workspace=workspace,
        backend=backend,
        return_lse=return_lse,
        out=out,
        lse=lse,
        check_block_table=check_block_table,
        max_workspace_bytes=max_workspace_bytes,
        names=("key_chunk", "val_chunk"),
    )


def _run(
    query,
    key,
    value,
    kv_cache,
    block_table,
    qsl,
    lens,
    *,
    preset,
    centroids,
    rotation,
    scale,
    window,
    workspace,
    backend,
    return_lse,
    out,
    lse,
    check_block_table,
    max_workspace_bytes,
    names=("key", "value"),
    lengths_read=(),
):
    n, hq, d = query.shape
    if not isinstance(preset, (str, TQConfig)):
        raise ValueError(
            f"preset must be a turboquant_* name or a TQConfig, got "
            f"{type(preset).__name__}"
        )
    cfg = resolve_config(preset, d)
    shown = preset if isinstance(preset, str) else "the given TQConfig"
    _validate(
        query, key, value, kv_cache, block_table, cfg, centroids, rotation, names, shown
    )
    scale = _as_scale(scale)
    num_blocks, block_size, hk = kv_cache.shape[0], kv_cache.shape[1], kv_cache.shape[2]
    _validate_lengths(qsl, lens, n, block_size, block_table.shape[1])
    window = (
        default_window(hk, d, block_size)
        if window is None
        else as_int("window", window, 1)
    )
    if max_workspace_bytes is not None:
        max_workspace_bytes = as_int("max_workspace_bytes", max_workspace_bytes, 1)
    if not isinstance(backend, str):
        raise ValueError(
            f"backend must be one of 'auto', 'flash', 'triton', 'torch', got "
            f"{backend!r}"
        )
    backend = resolve_backend(backend, query.device, d)
    if not isinstance(check_block_table, bool):
        raise ValueError(f"check_block_table must be a bool, got {check_block_table!r}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    else:
        check_tensor("out", out, 3, (query.dtype,), query.device, unit_last=True)
        if out.shape != query.shape:
            raise ValueError(
                f"out must have the query's shape {tuple(query.shape)}, got "
                f"{tuple(out.shape)}"
            )
        _check_written("out", out)
    if lse is not None:
        check_tensor("lse", lse, 2, (torch.float32,), query.device, unit_last=True)
        if tuple(lse.shape) != (hq, n):
            raise ValueError(
                f"lse must have shape ({hq}, {n}) (heads, tokens), got "
                f"{tuple(lse.shape)}"
            )
        _check_written("lse", lse)
    elif return_lse:
        lse = torch.empty(hq, n, dtype=torch.float32, device=query.device)
    budget = (
        DEFAULT_WORKSPACE_BYTES if max_workspace_bytes is None else max_workspace_bytes
    )
    if workspace is not None:
        check_tensor("workspace", workspace, 1, (torch.uint8,), query.device)
        if not workspace.is_contiguous():
            raise ValueError("workspace must be contiguous")
        budget = min(budget, workspace.numel())
    check_overlaps(
        [("out", out), ("lse", lse), ("workspace", workspace)],
        [
            ("query", query),
            (names[0], key),
            (names[1], value),
            ("kv_cache", kv_cache),
            ("block_table", block_table),
            ("rotation", rotation),
            ("centroids", centroids),
            *lengths_read,
        ],
    )
    if n == 0:
        return (out, lse) if return_lse else out
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            "continuation_prefill_varlen cannot run inside CUDA graph capture: it "
            "plans its windows on the host from the lengths of each batch"
        )
    err = None
    if check_block_table:
        if query.is_cuda:
            _report_earlier_block_errors(query.device)
            err = _block_error_slot(query.device)
        else:
            _check_block_ids_on_host(block_table, qsl, lens, block_size, num_blocks)
    stream = torch.cuda.current_stream(query.device) if query.is_cuda else None
    steps, groups, cap, need = schedule(
        qsl, lens, window, hq, hk, d, query.dtype, budget, query.device, stream
    )
    # the caller's: its views can be kept for the next call
    reuse = workspace is not None
    if need and workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=query.device)
    elif need and workspace.numel() < need:
        raise ValueError(
            f"workspace must hold at least workspace_bytes(...) = {need} bytes for "
            f"this call, got {workspace.numel()}"
        )
    run = _Call(
        query,
        key,
        value,
        kv_cache,
        block_table,
        out,
        lse,
        cfg,
        centroids,
        rotation,
        scale,
        backend,
        workspace,
        reuse,
        cap,
        err[0] if err is not None else None,
    )
    for step, hk_g in zip(steps, groups):
        if isinstance(step, LongRequest):
            run.long_request(step, hk_g)
        else:
            run.batch_window(step)
    if err is not None:
        # the bad-id record, copied back for the next call to read (no sync)
        err[1].copy_(err[0], non_blocking=True)
        if err[2] is None:
            err[2] = torch.cuda.Event()
        err[2].record(stream)
    return (out, lse) if return_lse else out


@functools.lru_cache(maxsize=32)
def schedule(qsl, lens, window, hq, hk, d, dtype, budget, device, stream=None):
    """(plan steps, kv heads at once per step, batch window capacity, workspace bytes
    needed). Memoized per stream, like the plans: one per step, and a plan's device
    tensors are only ever read on the stream that wrote them."""
    n = qsl[-1]
    window = fit_window(window, n, hq, hk, d, dtype, budget)
    reads = [s for r, s in enumerate(lens) if qsl[r + 1] > qsl[r]]
    rows = sum(reads) + GAP * max(len(reads) - 1, 0)  # the most rows the call fills
    # batch windows; with a long request (> cap rows) this is capacity(window, n)
    cap = capacity(min(window, max(rows, 1)), n)
    # a long request's state and window share the budget (with a workspace of
    # workspace_bytes(N) bytes, those bytes): its window depends on its own query rows
    # and the budget, not on the rest of the batch
    longs = {}
    for r, s in enumerate(lens):
        q = qsl[r + 1] - qsl[r]
        if q and s > cap:
            longs[r] = long_window(q, hq, hk, d, cap, dtype, budget)
    p = plan(
        qsl,
        lens,
        cap,
        device,
        stream,
        tuple(longs[r][1] if r in longs else 0 for r in range(len(lens)))
        if longs
        else None,
    )
    g = hq // hk
    groups, need = [], 0
    for step in p.steps:
        if isinstance(step, LongRequest):
            q_rows = step.q1 - step.q0
            hk_g = longs[step.request][0]
            need = max(
                need,
                layout_bytes("long", q_rows, g * hk_g, hk_g, d, step.capacity, dtype),
            )
        else:
            hk_g = hk
            need = max(need, layout_bytes("batch", 0, hq, hk, d, cap, dtype))
        groups.append(hk_g)
    return p.steps, tuple(groups), cap, need


class _Call:
    """One call's tensors, and the two kinds of step (see the module docstring)."""

    def __init__(
        self,
        query,
        key,
        value,
        kv_cache,
        block_table,
        out,
        lse,
        cfg,
        centroids,
        rotation,
        scale,
        backend,
        workspace,
        reuse,
        cap,
        err,
    ):
        self.query, self.key, self.value = query, key, value
        self.kv_cache, self.block_table = kv_cache, block_table
        self.out, self.lse, self.cfg = out, lse, cfg
        self.scale, self.backend = scale, backend
        self.centroids, self.rotation = centroids, None if cfg.key_fp8 else rotation
        self.workspace, self.reuse, self.cap, self.err = workspace, reuse, cap, err
        self.split = False  # the rotation's parts written into the workspace

    def _fill(self, window, head0, bufs):
        if self.rotation is not None and not self.split and use_triton(self.kv_cache):
            # once per call: every layout holds the parts at the same place
            split_rotation(self.rotation, bufs.rot_parts, bufs.rot_flags)
            self.split = True
        fill_window(
            self.kv_cache,
            self.block_table,
            self.cfg,
            self.centroids,
            self.rotation,
            self.key,
            self.value,
            window,
            head0,
            bufs.k_buf,
            bufs.v_buf,
            self.err,
            parts=(bufs.rot_parts, bufs.rot_flags),
        )

    def batch_window(self, w):
        """Requests that fit one window: one causal call, the answer written to out."""
        rows = slice(w.q0, w.q1)
        n, hq, d = self.query.shape
        bufs = carve(
            self.workspace,
            "batch",
            0,
            hq,
            self.key.shape[1],
            d,
            self.cap,
            self.query.dtype,
            self.reuse,
        )
        self._fill(w, 0, bufs)
        # the filled rows only: attention reads zeros past them (plan.GAP)
        k, v = bufs.k_buf[: w.rows], bufs.v_buf[: w.rows]
        lse = varlen_attention(
            w, self.query[rows], k, v, self.scale, self.out[rows], self.backend
        )
        if self.lse is not None:
            self.lse[:, rows].copy_(lse)

    def long_request(self, step, hk_g):
        """A request longer than a window, hk_g kv heads at a time: part windows merged
        into a float32 state, then the last window (its new tokens too), merged into
        out."""
        n, hq, d = self.query.shape
        hk = self.key.shape[1]
        g = hq // hk
        rows = slice(step.q0, step.q1)
        bufs = carve(
            self.workspace,
            "long",
            step.q1 - step.q0,
            g * hk_g,
            hk_g,
            d,
            step.capacity,
            self.query.dtype,
            self.reuse,
        )
        scratch = (
            self.out
            if self.out.dtype == torch.float16
            else self.out.view(torch.float16)
        )
        for kv0 in range(0, hk, hk_g):
            heads = slice(kv0 * g, (kv0 + hk_g) * g)
            whole = hk_g == hk
            q = self.query[rows] if whole else self.query[rows, heads]
            if bufs.q16 is not None:  # bf16: every partial computed and rounded in fp16
                bufs.q16.copy_(q)
                q = bufs.q16
            part = scratch[rows] if whole else scratch[rows, heads]
            o = self.out[rows] if whole else self.out[rows, heads]
            lse_out = (
                None
                if self.lse is None
                else (self.lse[:, rows] if whole else self.lse[heads, rows])
            )
            for i, w in enumerate(step.windows):
                self._fill(w, kv0, bufs)
                part_lse = varlen_attention(
                    w,
                    q,
                    bufs.k_buf[: w.rows],
                    bufs.v_buf[: w.rows],
                    self.scale,
                    part,
                    self.backend,
                )
                first = i == 0
                if w.kind == "part":
                    merge_attn_states(
                        bufs.state_out,
                        None if first else bufs.state_out,
                        None if first else bufs.state_lse,
                        part,
                        part_lse,
                        bufs.state_lse,
                    )
                else:
                    merge_attn_states(
                        o, bufs.state_out, bufs.state_lse, part, part_lse, lse_out
                    )
