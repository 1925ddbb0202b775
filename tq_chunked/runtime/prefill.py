"""A batched continuation prefill that streams the cached prefixes through fixed-size
windows instead of dequantizing them whole: planned once per step, run per layer.

    prefill = ContinuationPrefill(Hq, Hk, D, preset=..., dtype=..., block_size=...)
    step = prefill.plan(block_table, query_start_loc_cpu=..., seq_lens_cpu=...,
                        workspace=ws)            # once per step: validation, windows,
                                                 # device index tensors, workspace views
    out = step.run(query, key, value, kv_cache,  # per layer: that layer's tensors only
                   centroids=..., rotation=..., scale=...)

What ``Step.run`` does with the step's units (plan.py draws them):

    for each batch window (requests that fit one):          all kv heads
        fill it: cached keys dequantized and un-rotated,    k_buf, v_buf (rows, Hk, D)
            then the chunk's own keys after them (dequant.py)
        one causal varlen attention call                    -> out rows, final
        (spread, plan.spread_pieces and spread_for_step:     fp16 partials,
        the cached keys in pieces, attended side by side,   merged -> out rows)
        then the own keys)
    for each long request, for each group of its kv heads:
        for each part window: fill, attend (not causal)     a partial, merged into
                                                            the state
        last window (the rest, and the chunk): fill,        a partial in out's bytes
            attend causal, merge the state into it          -> out rows, final
    for each paged run (few query rows per kv head):         paged.py, no fp16 K/V
        one causal varlen call over its own tokens          a partial in out's bytes
        its cached positions read from the cache, split     float32 partials
            over the SMs; the splits and the partial merged -> out rows, final

Memory is the workspace: independent of the cached lengths and of the batch size.
``continuation_prefill_varlen`` and ``continuation_prefill`` are the same engine as
one call (plan, then run). What a call promises for bad input, non-finite values and
overlapping tensors: docs/design.md, "What the call promises".
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from . import paged
from ._utils import (
    BoundLaunches,
    as_int,
    byte_span,
    check_overlaps,
    check_tensor,
    extent,
    interpreting,
    layer_key,
    layout,
    layout_at,
    place,
    self_overlapping,
    use_triton,
)
from .attention import resolve_backend, varlen_attention, vllm_flash
from .dequant import fill_launch, fill_window, split_launch
from .format import TQConfig, resolve_config
from .merge import (
    check_merge_pieces,
    check_piece_query,
    merge_attn_states,
    merge_launch,
    merge_pieces,
    merge_pieces_launch,
    piece_query,
    piece_query_launch,
)
from .paged import DEFAULT_SMS, PagedPlan, paged_launches
from .plan import PATHS, LongRequest, PagedRun, Plan, default_window, make_plan
from .workspace import ALIGN, DEFAULT_WORKSPACE_BYTES, carve, rotation_bytes

QUERY_DTYPES = (torch.float16, torch.bfloat16)
# Step.run's checked layout keys a ContinuationPrefill keeps (one for each step shape
# and layer layout, a few hundred bytes each)
CHECKED_LAYOUTS = 256
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
                f"{name} must be on {device} (block_table's device), got {src.device}"
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
    if values and (min(values) < 0 or max(values) > INT32_MAX):
        i, v = next((i, v) for i, v in enumerate(values) if not 0 <= v <= INT32_MAX)
        raise ValueError(f"{shown}[{i}] must be in [0, 2**31), got {v}")
    return tuple(values)


def _check_device_lengths(name, t, entries, device):
    """The device copy of a length array when its host copy is given: not read, but its
    form is checked, so that an engine's bookkeeping error does not pass unseen."""
    if t is None:
        return
    check_tensor(name, t, 1, (torch.int32,), device, device_of="block_table")
    if t.shape[0] != entries:
        raise ValueError(
            f"{name} must have {entries} entries (as {name}_cpu), got {t.shape[0]}"
        )


def _check_lengths(qsl, seq_lens, block_size, max_blocks, names):
    """The host lengths against each other and the block table's columns. ``names``:
    what the caller calls query_start_loc and seq_lens (messages name them)."""
    q_name, s_name = names
    if qsl[0] != 0:
        raise ValueError(f"{q_name} must start at 0, got {qsl[0]}")
    # every request at once by C-level maps; the loop below, which names the first bad
    # request, only where one may be (a request without query tokens is not held to
    # the block table: the loop tells)
    q_lens = list(map(operator.sub, qsl[1:], qsl[:-1]))
    if (
        min(q_lens, default=0) >= 0
        and not any(map(operator.lt, seq_lens, q_lens))
        and max(map(operator.sub, seq_lens, q_lens), default=0)
        <= max_blocks * block_size
    ):
        return
    for r, s in enumerate(seq_lens):
        q_len = qsl[r + 1] - qsl[r]
        if q_len < 0:
            raise ValueError(
                f"{q_name} must be non-decreasing, got {qsl[r]} then {qsl[r + 1]} at "
                f"request {r}"
            )
        if s < q_len:
            raise ValueError(
                f"{s_name.format(r=r)} ({s}) must be at least the request's query "
                f"tokens ({q_len}): it counts cached + new tokens"
            )
        if q_len and -(-(s - q_len) // block_size) > max_blocks:
            raise ValueError(
                f"{s_name.format(r=r)} ({s}) needs more cached blocks than block_table "
                f"has columns ({max_blocks} x block_size {block_size})"
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


def _check_workspace_size(workspace, need):
    if workspace.numel() < need:
        raise ValueError(
            f"workspace must hold at least workspace_bytes(...) = {need} bytes for "
            f"this step, got {workspace.numel()}"
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
# device -> [device int64 (1,), pinned host int64 (1,), event or None]: one record per
# device for the life of the process (beside each plan's index tensor, the only device
# allocation outside the workspace)
_block_errors: dict = {}


def _block_error_slot(device):
    slot = _block_errors.get(device)
    if slot is None:
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
        torch.device("cuda", torch.accelerator.current_device_index())
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
# Plan once per step, run per layer
# ---------------------------------------------------------------------------


class ContinuationPrefill:
    """The continuation prefill of one model's attention layers: made once with what
    does not change between steps, then ``plan`` once per step and ``Step.run`` per
    layer.

    Args:
        num_q_heads, num_kv_heads, head_dim: Hq, Hk (Hq a multiple of Hk) and D.
        preset: a ``turboquant_*`` name or a ``TQConfig``: the cache's format.
        dtype: the query's dtype, torch.float16 or torch.bfloat16.
        block_size: tokens per cache block.
        window: key rows per batch window; default ``default_window(Hk, D,
            block_size)`` (127 MiB of K+V). Fewer where the K/V would not fit the
            budget; a long request's windows hold what its state leaves of it
            (plan.py).
        max_workspace_bytes: the budget of the workspace (default 128 MiB).
        backend: "auto", "flash", "triton" or "torch" (attention.py); a named back end
            that is unavailable raises, and is never silently replaced.
        path: which requests take the memory-bound path (paged.py) instead of windows:
            "auto" (runs of requests with cached tokens and few query rows per kv
            head, ``plan.paged_eligible``, that hold ``plan.PAGED_MIN_CACHED``
            cached tokens, where Triton runs: on a GPU or under the interpreter),
            "window" (none) or "paged" (every request with cached tokens, for
            measurements; a run whose query rows need more scratch than a batch
            window of the step raises: plan.py).
        spread: which batch windows run their cached keys in pieces side by side
            (plan.spread_pieces): "auto" (those whose attention call would leave most
            SMs idle, with FlashAttention-3 and head size 128, while the GPU time they
            save outweighs the host's: plan.spread_for_step), or a count of pieces
            for every batch window with cached keys where it fits (1: none; for
            measurements and tests).
        check_block_table: record block ids outside [0, num_blocks) among those read
            and raise a ValueError naming the first one at the next call on the device
            (or at ``check_block_tables()``), without synchronizing (on a CPU: before
            anything runs). Checked or not, such an id is never read: its request's
            rows come out NaN.

    """

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        preset: str | TQConfig,
        dtype: torch.dtype = torch.float16,
        block_size: int,
        window: int | None = None,
        max_workspace_bytes: int | None = None,
        backend: str = "auto",
        path: str = "auto",
        spread: str | int = "auto",
        check_block_table: bool = True,
    ):
        self.num_q_heads = as_int("num_q_heads", num_q_heads, 1)
        self.num_kv_heads = as_int("num_kv_heads", num_kv_heads, 1)
        self.head_dim = as_int("head_dim", head_dim, 1)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        if not isinstance(preset, (str, TQConfig)):
            raise ValueError(
                f"preset must be a turboquant_* name or a TQConfig, got "
                f"{type(preset).__name__}"
            )
        self.cfg = resolve_config(preset, self.head_dim)
        self.preset_name = preset if isinstance(preset, str) else "the given TQConfig"
        if dtype not in QUERY_DTYPES:
            raise ValueError(
                f"dtype must be torch.float16 or torch.bfloat16, got {dtype}"
            )
        self.dtype = dtype
        self.block_size = as_int("block_size", block_size, 1)
        self.window = (
            default_window(self.num_kv_heads, self.head_dim, self.block_size)
            if window is None
            else as_int("window", window, 1)
        )
        self.budget = (
            DEFAULT_WORKSPACE_BYTES
            if max_workspace_bytes is None
            else as_int("max_workspace_bytes", max_workspace_bytes, 1)
        )
        if not isinstance(backend, str):
            raise ValueError(
                f"backend must be one of 'auto', 'flash', 'triton', 'torch', got "
                f"{backend!r}"
            )
        self.backend = backend
        if path not in PATHS:
            raise ValueError(
                f"path must be one of {', '.join(map(repr, PATHS))}, got {path!r}"
            )
        self.path = path
        if spread != "auto" and (
            isinstance(spread, bool) or not isinstance(spread, int) or spread < 1
        ):
            raise ValueError(f"spread must be 'auto' or an int >= 1, got {spread!r}")
        self.spread = spread
        if not isinstance(check_block_table, bool):
            raise ValueError(
                f"check_block_table must be a bool, got {check_block_table!r}"
            )
        self.check_block_table = check_block_table
        # Step.run's layout keys (a layer's tensors' places but their addresses, which
        # only their 16-byte alignment class; its step's token count, workspace size
        # and device) whose checks passed, the last CHECKED_LAYOUTS of them, each with
        # its tensors' extents and launch layouts (NOTES.md §53, §68)
        self._fits: dict = {}

    def plan(
        self,
        block_table: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        *,
        query_start_loc_cpu=None,
        seq_lens_cpu=None,
        workspace: torch.Tensor | None = None,
    ) -> Step:
        """The step's plan, on ``block_table``'s device: the lengths checked, the
        windows drawn within the budget, their device integers uploaded (one
        asynchronous copy on the current stream; a run on another stream waits for it).

        Args:
            block_table: int32 (B, max_blocks), any strides: each request's blocks.
            query_start_loc: int32 (B + 1,) on the device; read only without
                ``query_start_loc_cpu`` (then once, with a synchronization).
            seq_lens: int32 (B,) on the device, cached + new tokens per request; read
                only without ``seq_lens_cpu``.
            query_start_loc_cpu: the host copy of ``query_start_loc`` (a CPU tensor,
                a numpy array or an int sequence, as vLLM keeps it).
            seq_lens_cpu: the host copy of ``seq_lens``, in the same forms. The host
                copies are what the step computes with: the device copies, when both
                are given, are never read (only their shapes are checked), so the two
                must agree.
            workspace: the buffer the layers run in unless ``run`` is given one: a
                contiguous uint8 buffer on the device, of at least
                ``workspace_bytes(N, Hq, Hk, D, window, dtype, max_bytes=budget)``
                bytes for N query tokens; its bytes (if fewer than the budget) are the
                budget, and its views are carved here. Without one the step takes the
                one ``run`` is given, or allocates what it needs at its first run.

        """
        check_tensor("block_table", block_table, 2, (torch.int32,))
        device = block_table.device
        qsl = _host_ints(
            "query_start_loc", query_start_loc_cpu, query_start_loc, device
        )
        if len(qsl) < 1:
            raise ValueError("query_start_loc must have B + 1 >= 1 entries, got none")
        b = len(qsl) - 1
        lens = _host_ints("seq_lens", seq_lens_cpu, seq_lens, device)
        if len(lens) != b:
            raise ValueError(
                f"seq_lens must have one entry per request (len(query_start_loc) - 1 = "
                f"{b}), got {len(lens)}"
            )
        if block_table.shape[0] != b:
            raise ValueError(
                f"block_table must have one row per request ({b}, as query_start_loc "
                f"and seq_lens), got {block_table.shape[0]}"
            )
        if query_start_loc_cpu is not None:
            _check_device_lengths("query_start_loc", query_start_loc, b + 1, device)
        if seq_lens_cpu is not None:
            _check_device_lengths("seq_lens", seq_lens, b, device)
        _check_lengths(
            qsl, lens, self.block_size, block_table.shape[1],
            ("query_start_loc", "seq_lens[{r}]"),
        )  # fmt: skip
        budget = self.budget
        if workspace is not None:
            check_tensor(
                "workspace",
                workspace,
                1,
                (torch.uint8,),
                device,
                device_of="block_table",
            )
            if not workspace.is_contiguous():
                raise ValueError("workspace must be contiguous")
            budget = min(budget, workspace.numel())
        backend = resolve_backend(self.backend, device, self.head_dim)
        if self.path == "paged" and device.type != "cuda" and not interpreting():
            raise ValueError(
                "path='paged' needs Triton: a CUDA device, or TRITON_INTERPRET=1 on "
                "the CPU (path='auto' takes the windows there)"
            )
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "a continuation prefill cannot be planned inside CUDA graph capture: "
                "it draws its windows on the host from the lengths of each step"
            )
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else DEFAULT_SMS
        )
        plan = make_plan(
            qsl,
            lens,
            window=self.window,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            budget=budget,
            device=device,
            stream=stream,
            cfg=self.cfg,
            path=self.path,
            sms=sms,
            spread=self._spread(backend),
        )
        if workspace is not None:
            _check_workspace_size(workspace, plan.workspace_bytes)
        uploaded = None
        if stream is not None:  # for a run on another stream to wait for
            uploaded = torch.cuda.Event()
            uploaded.record(stream)
        lengths = (("query_start_loc", query_start_loc), ("seq_lens", seq_lens))
        return Step(
            self, plan, block_table, qsl, lens, workspace, backend, lengths,
            stream, uploaded,
        )  # fmt: skip

    def _spread(self, backend):
        """``spread`` as the plan takes it: "auto" spreads only where it was measured
        to gain, FlashAttention-3 at head size 128 (benchmarks/NOTES.md §65, §67)."""
        if self.spread != "auto":
            return self.spread
        fa3 = backend == "flash" and vllm_flash(self.head_dim)[1] == 3
        return "auto" if fa3 and self.head_dim == 128 else 1

    def workspace_bytes(self, max_query_tokens: int) -> int:
        """The bytes of workspace that serve every step of up to ``max_query_tokens``
        query tokens (``plan.workspace_bytes`` with this object's window and budget)."""
        from .plan import workspace_bytes

        return workspace_bytes(
            max_query_tokens,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.window,
            self.dtype,
            max_bytes=self.budget,
        )


class Step:
    """One step's plan (``ContinuationPrefill.plan``): ``run`` it once per layer. Its
    device integers were uploaded on the stream current at ``plan``; a run on another
    stream first makes that stream wait for the upload, and marks the integers as used
    there (so that the allocator does not hand their memory out while it reads them).

    Attributes: ``prefill`` (what it was planned by), ``plan`` (plan.Plan: the units,
    windows and paged runs, in order of their query rows), ``block_table``,
    ``query_start_loc`` and ``seq_lens`` (host ints), ``workspace``, ``buffers``
    (each unit's views of it) and ``filled`` (each unit's filled rows of them:
    ``_filled``), ``backend`` (the resolved attention back end),
    ``device``."""

    def __init__(
        self,
        prefill: ContinuationPrefill,
        plan: Plan,
        block_table: torch.Tensor,
        qsl: tuple[int, ...],
        seq_lens: tuple[int, ...],
        workspace: torch.Tensor | None,
        backend: str,
        lengths: tuple,
        stream=None,
        uploaded=None,
    ):
        self.prefill, self.plan, self.block_table = prefill, plan, block_table
        self._stream, self._uploaded = stream, uploaded
        self.query_start_loc, self.seq_lens = qsl, seq_lens
        self.backend = backend
        self.device = block_table.device
        self._lengths = lengths  # the device length tensors: checked apart from outputs
        # what a layer's layout checks read of the step; the byte ranges of its own
        # tensors, which the layers' outputs may not overlap
        self._fit = (plan.num_tokens, plan.workspace_bytes, self.device)
        self._own_spans = [
            (name, byte_span(t)) for name, t in (("block_table", block_table), *lengths)
        ]
        # The buffer the layers run in and each unit's views of it (every layer of
        # the step uses the same regions for the same units): the plan's, or the
        # last one run was given (a micro-batch's own, in vLLM), carved once.
        self.workspace: torch.Tensor | None = None
        self.buffers: tuple = ()
        self.filled: tuple = ()  # each unit's filled keys and values (``_filled``)
        self._place: tuple | None = None  # the workspace's (address, bytes)
        self._workspace_span: tuple[int, int] | None = None  # its byte range
        # a layer's key for its fills, paged runs, merges or query copies (_fill_key,
        # _paged_key, _Layer._merge, _merge_pieces, _piece_query) -> {a paged run's
        # id; a window's id and first kv head (its fill; "split": the rotation's); a
        # window's id, first kv head and partial lse's layout (its merge); a spread
        # window's id and its two calls' lse layouts (its pieces' merge); a spread
        # window's id (its query copies): BoundLaunches}: the launches as
        # the step's first layer of that key built them (the plan holds its units and
        # windows)
        self._bound: dict = {}
        if workspace is not None:
            self._take(workspace)

    def _take(self, workspace: torch.Tensor) -> None:
        """Run in ``workspace`` from now on (checked by the caller); its views are
        carved only where it is another buffer (an engine hands each layer a new view
        of the same bytes)."""
        at = (workspace.data_ptr(), workspace.numel())
        if at != self._place:
            views = {key: _carve(workspace, key) for key in set(self.plan.unit_layouts)}
            self.buffers = tuple(views[key] for key in self.plan.unit_layouts)
            self.filled = tuple(map(_filled, self.plan.units, self.buffers))
            self._place = at
            self._workspace_span = (at[0], at[0] + at[1]) if at[1] else None
            self._bound.clear()  # their launches take the old views
        self.workspace = workspace

    def bound(self, key: tuple) -> dict:
        """The units' launches bound for a layer of ``key`` (``_fill_key``,
        ``_paged_key``, a merge's, a spread window's merge's or query copies'): a
        dict the layer fills at the first layer of that key. Up to 32 keys are kept,
        the oldest dropped first (a model whose layers alternate layouts binds each
        once)."""
        bound = self._bound.get(key)
        if bound is None:
            if len(self._bound) >= 32:
                del self._bound[next(iter(self._bound))]
            bound = self._bound[key] = {}
        return bound

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    def run(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        centroids: torch.Tensor | None,
        rotation: torch.Tensor | None,
        scale: float,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        workspace: torch.Tensor | None = None,
        _names=("key", "value"),
    ):
        """Attention of the step's prefill chunks, each over its cached prefix and
        itself, for one layer.

        Args:
            query: (N, Hq, D) in the plan's dtype, any strides: every request's new
                tokens, packed by request.
            key: (N, Hk, D), the query's dtype, any strides: their own K.
            value: (N, Hk, D), the query's dtype, any strides: their own V.
            kv_cache: uint8 (num_blocks, block_size, Hk, slot_bytes), any strides with
                a unit last stride (vLLM 0.20's layout, or 0.33's head-major one seen
                through ``.transpose(1, 2)``). Each request's tokens [0, cached_r) are
                read; never written.
            centroids: float32 (2**key_bits,), the centroids the cache was written
                with (vLLM: ``layer._tq_centroids``); unused, may be None, for fp8-key
                presets.
            rotation: (D, D), the orthonormal matrix the keys were rotated by (vLLM:
                ``layer._tq_Pi``); unused for fp8-key presets.
            scale: softmax scale, finite and positive.
            out: optional (N, Hq, D) tensor of the query's dtype, unit stride over D.
            lse: optional (Hq, N) float32 tensor, unit stride over N: the log-sum-exp
                (natural log), returned with ``return_lse``.
            return_lse: also return the log-sum-exp (allocated where ``lse`` is
                None).
            workspace: the buffer to run in, instead of the plan's (a contiguous uint8
                buffer on the device of at least ``plan.workspace_bytes`` bytes; an
                engine's micro-batch passes its own); without one and without the
                plan's, the step allocates what it needs at its first run and keeps
                it.

        Returns:
            (N, Hq, D) in the query's dtype; with return_lse, (out, lse).

        """
        p, n = self.prefill, self.plan.num_tokens
        scale = _as_scale(scale)
        # the step's own device type (torch.cuda.is_available() reads the environment
        # at each call, NOTES.md §56)
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "a continuation prefill cannot run inside CUDA graph capture: its "
                "windows are drawn on the host from the lengths of each step"
            )
        layer = (query, key, value, kv_cache, centroids, rotation, out, lse, workspace)
        try:
            places = tuple(map(place, layer))
        except (AttributeError, RuntimeError, TypeError):  # no place: not a tensor,
            places = None  # or a sparse one (the checks say which)
        # The layouts (the places but their addresses, which only their 16-byte
        # alignment class) are checked once per layout: every layer of a step after
        # its first passes its first's (NOTES.md §53). What a layout says of each
        # tensor is kept with it: the bytes it spans (``extent``) and what a launch
        # reads of it (``layout_at``), NOTES.md §68.
        fit = places and (
            tuple(at and (at[0], at[1] & 15, *at[2:]) for at in places),
            self._fit,
        )
        known = None if fit is None else p._fits.get(fit)
        if known is None:
            self._check_layouts(*layer, _names)
            if places is None:  # the checks passed: each is a tensor or None
                places = tuple(map(place, layer))
            known = (
                tuple(map(extent, places)),
                tuple(at and layout_at(at) for at in places),
            )
            if fit is not None:
                if len(p._fits) >= CHECKED_LAYOUTS:
                    del p._fits[next(iter(p._fits))]  # the oldest
                p._fits[fit] = known
        extents, layouts = known
        # the overlaps at every layer, from the places' byte ranges
        spans = _spans(places, extents)
        written = spans[8] if workspace is not None else self._workspace_span
        check_overlaps(
            [("out", spans[6]), ("lse", spans[7]), ("workspace", written)],
            [("query", spans[0]), (_names[0], spans[1]), (_names[1], spans[2]),
             ("kv_cache", spans[3]), self._own_spans[0], ("rotation", spans[5]),
             ("centroids", spans[4]), *self._own_spans[1:]],
        )  # fmt: skip
        at_out, at_lse = layouts[6:8]
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
            at_out = layout(out)
        if lse is None and return_lse:
            lse = torch.empty(p.num_q_heads, n, dtype=torch.float32, device=self.device)
            at_lse = layout(lse)
        need = self.plan.workspace_bytes
        if workspace is None and self.workspace is None and need:
            workspace = torch.empty(need, dtype=torch.uint8, device=self.device)
        if workspace is not None:
            self._take(workspace)
        if n:
            # the layer's key for the step's bound launches, from the layouts the
            # checks keep (an fp8 preset's launches take no rotation)
            rotation = None if p.cfg.key_fp8 else rotation
            at_rotation = None if rotation is None else layouts[5]
            shapes = layer_key(
                (query, key, value, kv_cache, centroids, rotation, out, lse),
                (*layouts[:5], at_rotation, at_out, at_lse),
            )
            _Layer(self, query, key, value, kv_cache, centroids, rotation, scale, out,
                   lse, shapes).run()  # fmt: skip
        return (out, lse) if return_lse else out

    def _check_layouts(
        self, query, key, value, kv_cache, centroids, rotation, out, lse, workspace,
        names,
    ):  # fmt: skip
        """A ValueError naming the first of a layer's tensors (``run``'s arguments;
        out, lse and workspace None where not passed) whose type, dtype, shape,
        strides or device do not fit the step."""
        p = self.prefill
        cfg, n = p.cfg, self.plan.num_tokens
        shape = (n, p.num_q_heads, p.head_dim)
        check_tensor("query", query, 3, QUERY_DTYPES, self.device, device_of="the plan")
        if tuple(query.shape) != shape or query.dtype != p.dtype:
            raise ValueError(
                f"query must have shape {shape} and dtype {p.dtype} (the plan's "
                f"tokens, heads, head size and dtype), got {tuple(query.shape)} "
                f"{query.dtype}"
            )
        kv_shape = (n, p.num_kv_heads, p.head_dim)
        for name, t in zip(names, (key, value)):
            check_tensor(name, t, 3, (p.dtype,), self.device)
            if tuple(t.shape) != kv_shape:
                raise ValueError(
                    f"{name} must have shape {kv_shape}: the query's tokens and head "
                    f"size, kv_cache's {p.num_kv_heads} kv heads; got {tuple(t.shape)}"
                )
        check_tensor(
            "kv_cache", kv_cache, 4, (torch.uint8,), self.device, unit_last=True
        )
        slot = (p.block_size, p.num_kv_heads, cfg.slot_bytes)
        if tuple(kv_cache.shape[1:]) != slot:
            raise ValueError(
                f"kv_cache must have shape (num_blocks, {', '.join(map(str, slot))}) "
                f"(block_size, kv heads, slot bytes of {p.preset_name} at "
                f"D={p.head_dim}), got {tuple(kv_cache.shape)}"
            )
        if not cfg.key_fp8:
            self._check_tables(centroids, rotation)
        if out is not None:
            check_tensor("out", out, 3, (p.dtype,), self.device, unit_last=True)
            if tuple(out.shape) != shape:
                raise ValueError(
                    f"out must have the query's shape {shape}, got {tuple(out.shape)}"
                )
            _check_written("out", out)
        if lse is not None:
            check_tensor("lse", lse, 2, (torch.float32,), self.device, unit_last=True)
            if tuple(lse.shape) != (p.num_q_heads, n):
                raise ValueError(
                    f"lse must have shape ({p.num_q_heads}, {n}) (heads, tokens), got "
                    f"{tuple(lse.shape)}"
                )
            _check_written("lse", lse)
        if workspace is not None:
            check_tensor(
                "workspace", workspace, 1, (torch.uint8,), self.device,
                device_of="the plan",
            )  # fmt: skip
            if not workspace.is_contiguous():
                raise ValueError("workspace must be contiguous")
            _check_workspace_size(workspace, self.plan.workspace_bytes)

    def _check_tables(self, centroids, rotation):
        """The centroid table and the rotation an MSE preset's keys need."""
        p = self.prefill
        need = (
            f"is required for preset {p.preset_name}, whose keys are centroid indices"
        )
        if centroids is None:
            raise ValueError(
                f"centroids {need}: pass the centroid table the cache was written with "
                f"(vLLM: layer._tq_centroids)"
            )
        if rotation is None:
            raise ValueError(
                f"rotation {need}: pass the rotation the keys were written with (vLLM: "
                f"layer._tq_Pi)"
            )
        check_tensor("centroids", centroids, 1, (torch.float32,), self.device)
        if centroids.shape[0] != 2**p.cfg.key_bits:
            raise ValueError(
                f"centroids must have {2**p.cfg.key_bits} entries for preset "
                f"{p.preset_name}, got {centroids.shape[0]}"
            )
        check_tensor(
            "rotation", rotation, 2, (torch.float32, torch.float16, torch.bfloat16),
            self.device,
        )  # fmt: skip
        if tuple(rotation.shape) != (p.head_dim, p.head_dim):
            raise ValueError(
                f"rotation must have shape ({p.head_dim}, {p.head_dim}), got "
                f"{tuple(rotation.shape)}"
            )


def _carve(workspace, key):
    """A unit's views of the workspace: a window layout's, or a paged run's scratch
    (after the rotation's parts: workspace.rotation_bytes)."""
    if isinstance(key, PagedPlan):
        at = (-workspace.data_ptr()) % ALIGN + rotation_bytes(key.head_dim)
        return key.carve(workspace[at:])
    return carve(workspace, key)


def _spans(places, extents):
    """Each tensor's byte range (``span``) from its place's address and its layout's
    ``extent``; None where it has none."""
    return [e and (at[1], at[1] + e) for at, e in zip(places, extents)]


def _filled(unit, bufs):
    """The rows of the workspace's keys and values a unit's windows fill, each window's
    (k, v) (attention reads zeros past them: plan.GAP): for a batch window one pair,
    for a long request one per window, for a paged run None. Views once per step, not
    per layer (NOTES.md §68)."""
    if isinstance(unit, PagedRun):
        return None
    rows = lambda w: (bufs.k_buf[: w.rows], bufs.v_buf[: w.rows])
    if isinstance(unit, LongRequest):
        return tuple(map(rows, unit.windows))
    return rows(unit)


def _fill_key(shapes: tuple, err) -> tuple:
    """The key of a layer's fills (kv_cache, centroids, rotation, key, value, err):
    the layouts and aliasing of ``shapes`` (``_Layer.shapes``) at those tensors,
    whether the bad-id record is read (one tensor a device: its layout never
    changes)."""
    layouts, alias = shapes
    return "fill", layouts[1:6], alias[1:6], err is None


def _paged_key(shapes: tuple, scale: float, new_lse, err) -> tuple:
    """The key of a layer's paged runs: the whole layer's ``shapes`` (a run reads
    each of its tensors), the scale, the layout of the causal call's lse (the call's
    own tensor; its partial ``new`` is out, or out's bytes as fp16, as the run
    says)."""
    return "paged", shapes, scale, new_lse is not None and layout(new_lse), err is None


class _Layer:
    """One layer's run of a step: its tensors, and the three kinds of unit (see the
    module docstring)."""

    def __init__(
        self, step, query, key, value, kv_cache, centroids, rotation, scale, out, lse,
        shapes,
    ):  # fmt: skip
        self.step, self.cfg = step, step.prefill.cfg
        self.query, self.key, self.value, self.kv_cache = query, key, value, kv_cache
        self.centroids, self.rotation = centroids, rotation  # None: fp8 keys
        self.scale, self.out, self.lse = scale, out, lse
        # _utils.layer_key of (query, key, value, kv_cache, centroids, rotation, out,
        # lse): the units' keys for the step's bound launches are parts of it
        self.shapes = shapes
        self.split = False  # the rotation's parts written into the workspace
        self.fills = None  # the step's bound fills for this layer's layouts
        self.merges = None  # and its long requests' bound merges
        self.pieces = None  # and its spread windows' bound merges
        self.copies = None  # and their bound query copies

    def run(self):
        step = self.step
        device = step.device
        if step._stream is not None:
            current = torch.cuda.current_stream(device.index)  # an int: no parsing
            if current != step._stream:
                current.wait_event(step._uploaded)
                step.plan.ints.record_stream(current)  # every unit's integers
        err = None
        if step.prefill.check_block_table:
            if device.type == "cuda":
                _report_earlier_block_errors(device)
                err = _block_error_slot(device)
            else:
                _check_block_ids_on_host(
                    step.block_table,
                    step.query_start_loc,
                    step.seq_lens,
                    step.prefill.block_size,
                    self.kv_cache.shape[0],
                )
        self.err = err[0] if err is not None else None
        for unit, bufs, kv in zip(step.plan.units, step.buffers, step.filled):
            if isinstance(unit, LongRequest):
                self.long_request(unit, bufs, kv)
            elif isinstance(unit, PagedRun):
                self.paged_run(unit, bufs)
            else:
                self.batch_window(unit, bufs, kv)
        if err is not None:
            # the bad-id record, copied back for the next call to read (no sync)
            err[1].copy_(err[0], non_blocking=True)
            if err[2] is None:
                err[2] = torch.cuda.Event()
            err[2].record(torch.cuda.current_stream(device))

    def _fill_call(self, fill, window, head0, bufs, **options):
        """``fill`` (fill_window or fill_launch) for a window of this layer."""
        return fill(self.kv_cache, self.step.block_table, self.cfg, self.centroids,
                    self.rotation, self.key, self.value, window, head0, bufs.k_buf,
                    bufs.v_buf, self.err, **options)  # fmt: skip

    def _fill(self, window, head0, bufs):
        if not use_triton(self.kv_cache):
            self._fill_call(fill_window, window, head0, bufs)
            return
        # as a paged run's launches (paged_run): the rotation's split and each
        # window's fill built at the step's first layer of the layer's layouts, then
        # launched bound (NOTES §52)
        if self.fills is None:  # the layer's first fill
            self.fill_layer = (self.kv_cache, self.centroids, self.rotation,
                               self.key, self.value, self.err)  # fmt: skip
            self.fills = self.step.bound(_fill_key(self.shapes, self.err))
        if self.rotation is not None and not self.split:
            # once per layer: every layout holds the parts at the same place
            bound = self.fills.get("split")
            if bound is None:
                parts = (bufs.rot_parts, bufs.rot_flags)
                launch = split_launch(self.rotation, *parts)
                bound = BoundLaunches([launch], self.fill_layer, parts)
                self.fills["split"] = bound
            bound(self.fill_layer)
            self.split = True
        bound = self.fills.get((id(window), head0))
        if bound is None:
            launch = self._fill_call(
                fill_launch, window, head0, bufs, parts=(bufs.rot_parts, bufs.rot_flags)
            )
            owned = (self.step.block_table, window.segs, bufs.k_buf, bufs.v_buf,
                     bufs.rot_parts, bufs.rot_flags)  # fmt: skip
            bound = BoundLaunches([launch] if launch else [], self.fill_layer, owned)
            self.fills[(id(window), head0)] = bound
        bound(self.fill_layer)

    def batch_window(self, w, bufs, kv):
        """Requests that fit one window: one causal call, the answer written to out.
        Spread (w.pieces > 1): the pieces' call over copies of the query rows, the
        own keys' causal call into out's bytes, then both merged into out (plan.py);
        every partial in fp16, as a long request's are (workspace.py). ``kv``: the
        window's filled keys and values (``_filled``)."""
        rows = slice(w.q0, w.q1)
        self._fill(w, 0, bufs)
        k, v = kv
        q, out, backend = self.query, self.out, self.step.backend
        if w.q1 - w.q0 != q.shape[0]:  # not the step's only window: its rows
            q, out = q[rows], out[rows]
        if w.pieces > 1:
            own = out
            self._piece_query(w, bufs)
            if bufs.q16 is not None:  # bf16: the own keys' partial waits in out's bytes
                q, own = bufs.q16, out.view(torch.float16)
            piece_lse = varlen_attention(
                w.pieces_call, bufs.piece_q, k, v, self.scale, bufs.piece_out, backend
            )
            lse = varlen_attention(w, q, k, v, self.scale, own, backend)
            self._merge_pieces(w, bufs, out, own, lse, piece_lse)
            return
        lse = varlen_attention(w, q, k, v, self.scale, out, backend)
        if self.lse is not None:
            self.lse[:, rows].copy_(lse)

    def _piece_query(self, w, bufs):
        """A spread window's query rows copied for its pieces, in fp16 (and to q16 for
        bf16 queries), one launch bound as the fills are at the step's first layer of
        the query's layout (NOTES.md §68)."""
        args = (self.query, w.q0, w.q1 - w.q0, w.copy, bufs.piece_q, bufs.q16)
        if not use_triton(self.query):
            piece_query(*args)
            return
        if self.copies is None:  # the layer's first spread window
            self.copies = self.step.bound(("piece query", self.shapes[0][0]))
        bound = self.copies.get(id(w))
        if bound is None:
            check_piece_query(*args)
            owned = (w.copy, bufs.piece_q, bufs.q16)
            bound = BoundLaunches([piece_query_launch(*args)], (self.query,), owned)
            self.copies[id(w)] = bound
        bound((self.query,))

    def _merge_pieces(self, w, bufs, out, own, lse, piece_lse):
        """A spread window's pieces and own keys (``own``: out, or out's bytes as
        fp16) merged into out (and lse), bound as the fills are at the step's first
        layer of the layer's out and lse layouts (NOTES.md §52); merge_pieces's checks
        run once, where it is bound."""
        lse_out = None if self.lse is None else self.lse[:, w.q0 : w.q1]
        args = (out, lse_out, own, lse, bufs.piece_out, piece_lse, w.piece_first,
                w.piece_step, w.pieces)  # fmt: skip
        if not use_triton(self.out):
            merge_pieces(*args)
            return
        if self.pieces is None:  # the layer's first spread window
            layouts = self.shapes[0]
            self.pieces = self.step.bound(("pieces", layouts[6], layouts[7]))
        # the attention calls' own lse tensors: their layouts are part of the key
        at = (id(w), layout(lse), layout(piece_lse))
        layer = (out, lse_out, own, lse, piece_lse)
        bound = self.pieces.get(at)
        if bound is None:
            check_merge_pieces(*args)
            owned = (bufs.piece_out, w.piece_first, w.piece_step)
            bound = BoundLaunches([merge_pieces_launch(*args)], layer, owned)
            self.pieces[at] = bound
        bound(layer)

    def paged_run(self, run, scratch):
        """Requests through the memory-bound path: their cached positions read from
        the cache (paged.py) and their own tokens' causal attention, merged into out.
        A run whose requests have at most paged.OWN_KEYS_MAX tokens each
        (``run.paged.own_keys``): the combine attends to their own keys itself.
        Otherwise a causal call first, its partial into out's bytes (fp16 for fp16 and
        bf16 queries alike), which the combine merges."""
        rows = slice(run.q0, run.q1)
        new = new_lse = None
        if not run.paged.own_keys:
            q, k, v = self.query[rows], self.key[rows], self.value[rows]
            new = self.out
            if run.paged.half_chunk:
                # bf16: the partial computed and rounded in fp16, as a long request's
                # windows are (NOTES.md §3, §39); it waits in out's own bytes
                scratch.chunk_q.copy_(q)
                scratch.chunk_k.copy_(k)
                scratch.chunk_v.copy_(v)
                q, k, v = scratch.chunk_q, scratch.chunk_k, scratch.chunk_v
                new = self.out.view(torch.float16)
            new_lse = varlen_attention(
                run.chunk, q, k, v, self.scale, new[rows], self.step.backend
            )
        # every layer of a step launches the same kernels with the same arguments
        # but for its tensors' addresses: built at the first layer of each layout,
        # then launched bound (NOTES.md §52)
        layer = (self.query, self.kv_cache, self.centroids, self.rotation, self.key,
                 self.value, self.out, self.lse, new, new_lse, self.err)  # fmt: skip
        runs = self.step.bound(_paged_key(self.shapes, self.scale, new_lse, self.err))
        bound = runs.get(id(run))
        if bound is None:
            launches = paged_launches(
                self.query,
                self.kv_cache,
                self.step.block_table,
                run.paged,
                run.work,
                run.tokens,
                scratch,
                self.out,
                cfg=self.cfg,
                centroids=self.centroids,
                rotation=self.rotation,
                scale=self.scale,
                lse=self.lse,
                new=new,
                new_lse=new_lse,
                new_lse_row0=run.q0,
                key=self.key,
                value=self.value,
                err=self.err,
            )
            owned = (self.step.block_table, run.work, run.tokens,
                     *paged.scratch_tensors(scratch))  # fmt: skip
            bound = runs[id(run)] = BoundLaunches(launches, layer, owned)
        bound(layer)

    def long_request(self, req, bufs, filled):
        """A request longer than a window, req.kv_heads kv heads at a time: part
        windows merged into a float32 state, then the last window (its new tokens
        too), merged into out."""
        hk, hk_g = self.key.shape[1], req.kv_heads
        g = self.query.shape[1] // hk
        rows = slice(req.q0, req.q1)
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
            for i, (w, (k, v)) in enumerate(zip(req.windows, filled)):
                self._fill(w, kv0, bufs)
                part_lse = varlen_attention(
                    w, q, k, v, self.scale, part, self.step.backend
                )
                self._merge(w, kv0, i == 0, (o, part, part_lse, lse_out), bufs)

    def _merge(self, w, kv0, first, layer, bufs):
        """Window ``w``'s partial (``layer``: the request's rows of out and lse, the
        partial and its lse) merged: a part window's into the float32 state (the first
        copied there), the last's with the state into out and lse."""
        o, part, part_lse, lse_out = layer
        if w.kind == "part":
            args = (
                bufs.state_out,
                None if first else bufs.state_out,
                None if first else bufs.state_lse,
                part,
                part_lse,
                bufs.state_lse,
            )
        else:
            args = (o, bufs.state_out, bufs.state_lse, part, part_lse, lse_out)
        if not use_triton(self.out):
            merge_attn_states(*args)
            return
        # bound as the fills are, by the layouts of out and lse and the partial's lse
        # (the attention call's own tensor), NOTES.md §58; merge_attn_states's checks
        # hold by construction (a long request has rows; a prefix comes whole)
        if self.merges is None:  # the layer's first merge
            layouts = self.shapes[0]
            self.merges = self.step.bound(("merge", layouts[6], layouts[7]))
        at = (id(w), kv0, layout(part_lse))
        bound = self.merges.get(at)
        if bound is None:
            owned = (bufs.state_out, bufs.state_lse)
            bound = BoundLaunches([merge_launch(*args)], layer, owned)
            self.merges[at] = bound
        bound(layer)


# ---------------------------------------------------------------------------
# One call: plan, then run
# ---------------------------------------------------------------------------


def _prefill_for(
    query,
    key,
    kv_cache,
    preset,
    window,
    max_workspace_bytes,
    backend,
    check_block_table,
    key_name,
    path,
):
    """The ContinuationPrefill a single call of these tensors plans with."""
    check_tensor("query", query, 3, QUERY_DTYPES)
    check_tensor(key_name, key, 3)
    check_tensor("kv_cache", kv_cache, 4, (torch.uint8,), query.device, unit_last=True)
    if query.shape[1] == 0:
        raise ValueError(
            f"query must have at least one head, got shape {tuple(query.shape)}"
        )
    if query.shape[0] > INT32_MAX:
        raise ValueError(
            f"query must have fewer than 2**31 tokens, got {query.shape[0]}"
        )
    _, block_size, hk, _ = kv_cache.shape
    if hk == 0 or block_size == 0:
        raise ValueError(
            f"kv_cache must have shape (num_blocks, block_size, Hk, slot_bytes) with "
            f"block_size, Hk >= 1, got {tuple(kv_cache.shape)}"
        )
    if query.shape[1] % hk:
        raise ValueError(
            f"query heads ({query.shape[1]}) must be a multiple of kv_cache's kv heads "
            f"({hk})"
        )
    return ContinuationPrefill(
        query.shape[1],
        hk,
        query.shape[2],
        preset=preset,
        dtype=query.dtype,
        block_size=block_size,
        window=window,
        max_workspace_bytes=max_workspace_bytes,
        backend=backend,
        path=path,
        check_block_table=check_block_table,
    )


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
    path: str = "auto",
):
    """Attention of a batch of prefill chunks, each over its cached prefix and itself:
    ``ContinuationPrefill(...).plan(...).run(...)`` as one call (an engine that runs
    several layers per step plans once and runs each layer).

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
            copies given, the call never synchronizes with the GPU, and the host
            copies are what it computes with: the device tensors are not read (their
            shapes are checked), so the two must agree.
        window: key rows per window (at least N + 1 are used); default
            ``default_window(Hk, D, block_size)``: 127 MiB of K+V. Fewer where the
            K/V would not fit the budget (``plan.fit_window``); a long request's
            windows hold what its state leaves of the workspace
            (``plan.long_window``).
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
        path: "auto", "window" or "paged": which requests read their cache through
            the memory-bound path (``ContinuationPrefill``).

    Returns:
        (N, Hq, D) in the query's dtype; with return_lse, (out, lse).

    """
    prefill = _prefill_for(
        query,
        key,
        kv_cache,
        preset,
        window,
        max_workspace_bytes,
        backend,
        check_block_table,
        "key",
        path,
    )
    check_tensor("block_table", block_table, 2, (torch.int32,), query.device)
    step = prefill.plan(
        block_table,
        query_start_loc,
        seq_lens,
        query_start_loc_cpu=query_start_loc_cpu,
        seq_lens_cpu=seq_lens_cpu,
        workspace=workspace,
    )
    if step.num_tokens != query.shape[0]:
        raise ValueError(
            f"query_start_loc must end at the number of query tokens "
            f"({query.shape[0]}), got {step.query_start_loc[-1]}"
        )
    return step.run(
        query,
        key,
        value,
        kv_cache,
        centroids=centroids,
        rotation=rotation,
        scale=scale,
        out=out,
        lse=lse,
        return_lse=return_lse,
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
    path: str = "auto",
):
    """One request's chunk over its cached prefix and itself:
    ``continuation_prefill_varlen`` with a batch of one (same engine, same arguments
    but these):

        query: (q_len, Hq, D); key_chunk, val_chunk: (q_len, Hk, D): the chunk.
        block_table: int32 (max_blocks,) or (1, max_blocks): the request's blocks.
        cached_len: tokens already in the cache before this chunk (a host integer).
    """
    prefill = _prefill_for(
        query,
        key_chunk,
        kv_cache,
        preset,
        window,
        max_workspace_bytes,
        backend,
        check_block_table,
        "key_chunk",
        path,
    )
    if (
        not isinstance(block_table, torch.Tensor)
        or block_table.ndim not in (1, 2)
        or (block_table.ndim == 2 and block_table.shape[0] != 1)
    ):
        raise ValueError(
            f"block_table must be a (max_blocks,) or (1, max_blocks) tensor, got "
            f"{getattr(block_table, 'shape', type(block_table).__name__)}"
        )
    check_tensor(
        "block_table", block_table, block_table.ndim, (torch.int32,), query.device
    )
    q_len = query.shape[0]
    cached_len = as_int("cached_len", cached_len, 0, INT32_MAX - q_len)
    columns = block_table.shape[-1]
    if q_len and -(-cached_len // prefill.block_size) > columns:
        raise ValueError(
            f"cached_len ({cached_len}) needs more blocks than block_table has columns "
            f"({columns} x block_size {prefill.block_size})"
        )
    step = prefill.plan(
        block_table.reshape(1, -1),
        query_start_loc_cpu=(0, q_len),
        seq_lens_cpu=(cached_len + q_len,),
        workspace=workspace,
    )
    return step.run(
        query,
        key_chunk,
        val_chunk,
        kv_cache,
        centroids=centroids,
        rotation=rotation,
        scale=scale,
        out=out,
        lse=lse,
        return_lse=return_lse,
        _names=("key_chunk", "val_chunk"),
    )
