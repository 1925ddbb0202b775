"""A spread batch window (plan.spread_pieces): which windows the plan spreads and into
how many pieces, and their answers against the float64 oracle and the one call,
non-finite values and the log-sum-exp included (docs/design.md, "What the call
promises")."""

import dataclasses
import itertools

import pytest
import torch
from conftest import TRITON_OK
from test_promises import NONFINITE_CASES, check_against_oracle, poison

from tq_chunked import ContinuationPrefill, workspace_bytes
from tq_chunked.runtime.plan import (
    GAP,
    batch_layout,
    default_window,
    make_plan,
    spread_for_step,
    spread_layout,
    spread_pieces,
)
from tq_chunked.runtime.workspace import layout, layout_bytes
from tq_chunked.tools.reference import (
    full_buffer_continuation_prefill,
    oracle_continuation_prefill,
)
from tq_chunked.tools.testing import (
    build_batch,
    make_batch,
    rel_err,
    serving_workloads,
)

BACKEND = "triton" if TRITON_OK else "torch"
# three requests in one batch window (window 4096): a long prefix, a short one and a
# first chunk without cached keys
REQUESTS = [(220, 12), (30, 6), (0, 5)]
MiB = 1 << 20


def _run(batch, spread, return_lse=False, backend=BACKEND, pieces=None):
    """The batch through one batch window of ``pieces`` pieces (default: spread)."""
    n, hq, d = batch.query.shape
    prefill = ContinuationPrefill(
        hq, batch.key.shape[1], d, preset=batch.kwargs["preset"],
        dtype=batch.query.dtype, block_size=batch.kv_cache.shape[1], window=32768,
        path="window", backend=backend, spread=spread,
    )  # fmt: skip
    step = prefill.plan(
        batch.block_table,
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
    )
    (window,) = step.plan.units
    assert window.pieces == (pieces or spread), f"seed {batch.seed}"
    tables = {k: v for k, v in batch.kwargs.items() if k != "preset"}
    out = torch.full_like(batch.query, float("nan"))  # every row must be written
    res = step.run(batch.query, batch.key, batch.value, batch.kv_cache, **tables,
                   out=out, return_lse=return_lse)  # fmt: skip
    return res


def test_the_plan_spreads_windows_that_leave_most_sms_idle():
    """With "auto", 24-56 blocks spread into about two blocks an SM's worth of pieces
    of at least 1K keys; 64 blocks or more, or no cached keys, stay one call; fewer
    pieces where the layout would not fit."""
    big = 1 << 40
    # two requests of "8 hits q64-128": (3 + 4) x 8 = 56 blocks -> ceil(264 / 56)
    reqs = [(85, 12048), (106, 4624)]
    assert spread_pieces(reqs, 32, 8, 128, torch.float16, big, 132, "auto") == 5
    # one request of 4K: its pieces no shorter than 1K keys
    assert spread_pieces([(85, 4096)], 32, 8, 128, torch.float16, big, 132, "auto") == 4
    # beside one of 3 cached keys: no piece empty
    assert spread_pieces([(85, 4096), (10, 3)], 32, 8, 128, torch.float16, big, 132,
                         "auto") == 3  # fmt: skip
    # "16 x q128 8K": three requests of 4 tiles, 96 blocks
    assert spread_pieces([(128, 8192)] * 3, 32, 8, 128, torch.float16, big, 132,
                         "auto") == 1  # fmt: skip
    # "16 x q64 4K-16K 8/1 bf16": 16 requests of 4 tiles at one kv head, 64 blocks
    assert spread_pieces([(64, 8192)] * 16, 8, 1, 128, torch.bfloat16, big, 132,
                         "auto") == 1  # fmt: skip
    assert spread_pieces([(85, 0)], 32, 8, 128, torch.float16, big, 132, 4) == 1
    assert spread_pieces(reqs, 32, 8, 128, torch.float16, big, 132, 1) == 1
    # the layout of 5 pieces against a limit one byte short of it: 4 pieces
    rows = sum(q + c for q, c in reqs) + GAP * (6 * 2 - 1)
    five = layout_bytes(*spread_layout(32, 8, 128, rows, 5 * 191, 191, torch.float16))
    assert spread_pieces(reqs, 32, 8, 128, torch.float16, five, 132, "auto") == 5
    assert spread_pieces(reqs, 32, 8, 128, torch.float16, five - 1, 132, "auto") == 4
    assert spread_pieces(reqs, 32, 8, 128, torch.float16, 1 << 20, 132, "auto") == 1


# "8 hits q64-128 4K-32K"'s five windows (Hk 8), whose pieces under the default
# workspace spread_pieces gives as [5, 5, 6, 8, 3]
EIGHT_HITS = [
    [(85, 12048), (106, 4624)],
    [(118, 28064)],
    [(71, 12976), (76, 7920)],
    [(82, 27200)],
    [(92, 11312), (69, 16272)],
]


@pytest.mark.parametrize(
    "windows, counts, hk, chosen",
    [
        # one request of 512 rows at one kv head: over 8K a layer is bound by its host
        # (its one call's GPU time under the host's), and spread more so: one call
        ([[(512, 8192)]], [8], 1, [1]),
        # over 128K bound by its GPU: spread
        ([[(512, 131072)]], [9], 1, [9]),
        # five windows bound by their GPU: the three that save the most, until the
        # host's time outgrows the GPU's (NOTES.md §71)
        (EIGHT_HITS, [5, 5, 6, 8, 3], 8, [1, 5, 6, 8, 1]),
        # a window saving nothing stays one call however long the step's GPU time
        ([[(512, 131072)], [(64, 2000)]], [9, 2], 1, [9, 1]),
        # explicit counts of 1 are kept
        ([[(512, 131072)]], [1], 1, [1]),
    ],
    ids=["host-bound", "gpu-bound", "8-hits", "no-saving", "one"],
)
def test_auto_spreads_a_steps_windows_only_while_its_estimated_layer_shortens(
    windows, counts, hk, chosen
):
    """``spread_for_step``: a window's spreading saves GPU time and costs host time;
    "auto" takes the windows that save the most while a layer's estimate, the longer
    of its host's time and its GPU's, falls."""
    units = len(windows)
    assert spread_for_step(windows, counts, hk, units) == chosen


def test_the_plan_spreads_by_the_steps_estimate_and_a_count_spreads_every_window():
    """make_plan with "auto" takes spread_for_step's windows (the 8K request alone:
    none; at 128K: it; of "8 hits q64-128 4K-32K"'s five windows the second to the
    fourth, each with its pieces), and a count spreads every window it fits in."""
    w = {x.name: x for x in serving_workloads()}["8 hits q64-128 4K-32K"]
    qsl = (0, *itertools.accumulate(q for _, q in w.requests))
    lens = tuple(c + q for c, q in w.requests)
    window = default_window(8, 128, 16)
    plan = make_plan(
        qsl, lens, window=window, num_q_heads=32, num_kv_heads=8, head_dim=128,
        dtype=torch.float16, budget=workspace_bytes(qsl[-1], 32, 8, 128, window),
        device=torch.device("cpu"), sms=132, spread="auto",
    )  # fmt: skip
    assert [u.pieces for u in plan.units] == [1, 5, 6, 8, 1]
    assert [u.requests for u in plan.units] == [(0, 1), (2,), (3, 4), (5,), (6, 7)]
    kw = dict(num_q_heads=8, num_kv_heads=1, head_dim=128, dtype=torch.bfloat16,
              budget=256 * MiB, device=torch.device("cpu"), window=1 << 18)  # fmt: skip
    for cached, auto in ((8192, 1), (131072, 9)):
        qsl, lens = (0, 512), (cached + 512,)
        (w,) = make_plan(qsl, lens, spread="auto", sms=132, **kw).units
        assert w.pieces == auto, cached
        (w,) = make_plan(qsl, lens, spread=8, sms=132, **kw).units
        assert w.pieces == 8, cached


def test_a_spread_windows_calls_share_its_keys_and_copy_its_query_rows():
    """The plan's two calls over one spread window: the pieces (each with its
    request's query rows, not causal) and the own keys (causal), with the same key
    starts; each piece's row copies its request's rows; a gap after every piece; the
    layout within a batch window's bytes."""
    qsl, lens = (0, 12, 18, 23), (232, 36, 5)
    plan = make_plan(
        qsl, lens, window=4096, num_q_heads=4, num_kv_heads=2, head_dim=64,
        dtype=torch.float16, budget=128 * MiB, device=torch.device("cpu"), spread=3,
    )  # fmt: skip
    (w,) = plan.units
    assert w.pieces == 3 and w.causal and not w.pieces_call.causal
    assert w.pieces_call.cu_k_host == w.cu_k_host
    q_lens = [b - a for a, b in zip(w.cu_q_host, w.cu_q_host[1:])]
    pieces_q = [
        b - a for a, b in zip(w.pieces_call.cu_q_host, w.pieces_call.cu_q_host[1:])
    ]
    k_lens = [b - a for a, b in zip(w.cu_k_host, w.cu_k_host[1:])]
    # request 0: pieces of 73, 73, 74 keys, each with a gap; its own 12 keys; a gap ...
    assert k_lens[:8] == [73, GAP, 73, GAP, 74, GAP, 12, GAP]
    assert pieces_q[:8] == [12, 0, 12, 0, 12, 0, 0, 0]
    assert q_lens[:8] == [0, 0, 0, 0, 0, 0, 12, 0]
    # the first chunk has no pieces: its own keys alone, after request 1's gap
    assert k_lens[-2:] == [GAP, 5] and q_lens[-1] == pieces_q[-1] + 5 == 5
    assert sum(q_lens) == 23 and sum(pieces_q) == 3 * 18
    copy = w.copy.tolist()
    assert copy == list(range(12)) * 3 + list(range(12, 18)) * 3
    first, step = w.piece_first.tolist(), w.piece_step.tolist()
    assert all(copy[first[j] + i * step[j]] == j for j in range(18) for i in range(3))
    assert first[18:] == [-1] * 5 and step[18:] == [0] * 5  # the merge's empty sides
    # more than the step's shortened batch window, within what workspace_bytes gives
    assert plan.workspace_bytes > layout_bytes(
        *batch_layout(4, 2, 64, plan.capacity, torch.float16)
    )
    assert plan.workspace_bytes <= workspace_bytes(23, 4, 2, 64, 4096)
    assert plan.unit_layouts[0][0] == "spread"


def test_a_bf16_spread_window_holds_its_keys_partials_and_query_in_fp16():
    """bf16 queries: every float region of the spread layout is fp16 (each partial
    rounded once to fp16, as a long request's; workspace.py), the query's fp16 copy
    of the window's rows among them, within what workspace_bytes gives."""
    qsl, lens = (0, 12, 18, 23), (232, 36, 5)
    plan = make_plan(
        qsl, lens, window=4096, num_q_heads=4, num_kv_heads=2, head_dim=64,
        dtype=torch.bfloat16, budget=128 * MiB, device=torch.device("cpu"), spread=3,
    )  # fmt: skip
    regions = layout(*plan.unit_layouts[0])[0]
    assert regions["q16"][1] == (23, 4, 64)
    assert {t for _, _, t in regions.values()} == {torch.float16, torch.int32}
    assert plan.workspace_bytes <= workspace_bytes(23, 4, 2, 64, 4096, torch.bfloat16)


@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pieces", [2, 5])
def test_a_spread_window_answers_as_the_one_call_does(preset, dtype, pieces):
    """Every row written, within the bound of the oracle and of the one call's error
    (1.1x + 1e-4), request by request. The lse within float32 rounding of the one
    call's (fp16); bf16 runs its window in fp16 (workspace.py): its lse that of the
    same batch in fp16, bit for bit."""
    # and a request of fewer cached tokens than pieces: a piece of no keys
    requests = REQUESTS + [(3, 4)]
    batch = make_batch(requests, preset, dtype, seed=pieces)
    out, lse = _run(batch, pieces, return_lse=True)
    assert not out.isnan().any(), f"seed {batch.seed}"
    check_against_oracle(batch, out)
    one, one_lse = _run(batch, 1, return_lse=True)
    if dtype == torch.float16:
        torch.testing.assert_close(lse, one_lse, rtol=1e-5, atol=1e-5)
    else:
        half = [t.half() for t in (batch.query, batch.key, batch.value)]
        half = dataclasses.replace(batch, **dict(zip(("query", "key", "value"), half)))
        assert torch.equal(lse, _run(half, pieces, return_lse=True)[1]), batch.seed
    for r in range(len(requests)):
        q0, q1 = batch.query_start_loc[r], batch.query_start_loc[r + 1]
        oracle = oracle_continuation_prefill(*batch.request(r), **batch.kwargs)
        err = [(o[q0:q1].double() - oracle).norm() / oracle.norm() for o in (out, one)]
        assert err[0] <= 1.1 * err[1] + 1e-4, (batch.seed, r, err)  # the bound


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_steps_layers_merge_their_pieces_bound_as_each_alone(dtype):
    """One plan of a spread window run for layers of distinct tensors and of other out
    and lse layouts (strided out, padded lse, no lse): the pieces' merge bound once a
    layout (at the step's first layer of it; _utils.BoundLaunches), each answer and
    lse those of a plan made for that layer alone, bit for bit (bf16: the own keys'
    partial in each layer's own out)."""
    batch = make_batch(REQUESTS, "turboquant_3bit_nc", dtype, seed=41)
    n, hq, d = batch.query.shape
    prefill = ContinuationPrefill(
        hq, batch.key.shape[1], d, preset="turboquant_3bit_nc", dtype=dtype,
        block_size=batch.kv_cache.shape[1], window=32768, path="window",
        backend=BACKEND, spread=3,
    )  # fmt: skip
    lengths = dict(
        query_start_loc_cpu=batch.query_start_loc, seq_lens_cpu=batch.seq_lens
    )
    step = prefill.plan(batch.block_table, **lengths)
    tables = {k: v for k, v in batch.kwargs.items() if k != "preset"}
    wide = torch.full((n, hq, 2 * d), float("nan"), dtype=dtype)[..., :d]
    padded = torch.full((hq, n + 8), float("nan"))[:, :n]
    layers = [  # (query scale, out, lse, return_lse)
        (1.0, None, None, True),
        (0.5, None, None, True),
        (2.0, wide, None, True),
        (1.5, None, padded, True),
        (1.0, None, None, False),
    ]
    bound = []
    for scale, out, lse, return_lse in layers:
        q = batch.query * scale
        got = step.run(q, batch.key, batch.value, batch.kv_cache, **tables, out=out,
                       lse=lse, return_lse=return_lse)  # fmt: skip
        alone = prefill.plan(batch.block_table, **lengths).run(
            q, batch.key, batch.value, batch.kv_cache, **tables, return_lse=True
        )
        got = got if return_lse else (got, None)
        assert torch.equal(got[0], alone[0]), (scale, batch.seed)
        assert got[1] is None or torch.equal(got[1], alone[1]), (scale, batch.seed)
        bound.append(sum(len(v) for k, v in step._bound.items() if k[0] == "pieces"))
    if BACKEND == "triton":  # the fallback binds nothing
        assert bound == [1, 1, 2, 3, 4], bound


@pytest.mark.parametrize("where,value,token", NONFINITE_CASES, ids=lambda x: str(x))
def test_non_finite_values_in_a_spread_window(where, value, token):
    """As in one softmax over all keys (test_promises.py's cases, the requests in
    one spread window instead of part windows)."""
    seed = 31 + len(where) + token
    batch = make_batch(REQUESTS[:2], "turboquant_3bit_nc", torch.float16, seed=seed)
    batch.query.mul_(0.2)
    allowed = poison(batch, where, value, token)
    out = _run(batch, 3)
    assert not torch.isfinite(out).all(), f"seed {seed}: the non-finite value vanished"
    check_against_oracle(batch, out, allowed)


def test_spread_is_auto_or_a_count():
    for bad in (0, -1, True, 2.5, "all"):
        with pytest.raises(ValueError, match="spread must be 'auto' or an int >= 1"):
            ContinuationPrefill(
                4, 2, 64, preset="turboquant_3bit_nc", block_size=16, spread=bad
            )


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("where,value,token", NONFINITE_CASES, ids=lambda x: str(x))
def test_non_finite_values_in_a_spread_window_with_flash_attention(where, value, token):
    """The same cases with FlashAttention-3 on the GPU, whose tiles read past a
    sequence's end (the gaps after the pieces keep a cached inf value from turning
    into NaN in the piece before it)."""
    seed = 31 + len(where) + token
    batch = make_batch(
        REQUESTS[:2], "turboquant_3bit_nc", torch.float16, seed=seed, device="cuda"
    )
    batch.query.mul_(0.2)
    allowed = poison(batch, where, value, token)
    out = _run(batch, 3, backend="flash")
    assert not torch.isfinite(out).all(), f"seed {seed}: the non-finite value vanished"
    check_against_oracle(batch, out, allowed)


# two requests in one window: (3 + 3) x 8 = 48 blocks over 28K cached keys, whose
# saving outweighs the spread's host time (plan.spread_for_step); the window of 64K
# rows leaves its pieces room (the default's 32K would hold no more than 1 piece)
SPREAD_BATCH = [(28000, 96), (4000, 70)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_auto_spreads_a_window_of_few_blocks_within_the_bound(preset, dtype):
    """With "auto" and FlashAttention-3 the window is spread (6 pieces on 132 SMs),
    for fp16 and bf16 queries; each request within 1.1x the full-buffer path's error
    + 1e-4; the lse finite."""
    b = build_batch(preset, SPREAD_BATCH, 32, 8, 128, 16, dtype, "cuda", seed=48)
    prefill = ContinuationPrefill(
        32, 8, 128, preset=preset, dtype=dtype, block_size=16, backend="flash",
        path="window", window=65536, max_workspace_bytes=256 << 20,
    )  # fmt: skip
    step = prefill.plan(
        b["block_table"],
        query_start_loc_cpu=b["query_start_loc"],
        seq_lens_cpu=b["seq_lens"],
    )
    (window,) = step.plan.units
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert window.pieces == min(-(-2 * sms // 48), 28000 // 1024)
    kw = {k: v for k, v in b["kwargs"].items() if k != "preset"}
    out, lse = step.run(b["query"], b["key"], b["value"], b["kv_cache"], **kw,
                        return_lse=True)  # fmt: skip
    assert torch.isfinite(lse).all()
    qsl = b["query_start_loc"]
    for r, (cached, _) in enumerate(SPREAD_BATCH):
        rows = slice(qsl[r], qsl[r + 1])
        args = (b["query"][rows], b["key"][rows], b["value"][rows], b["kv_cache"],
                b["block_table"][r], cached)  # fmt: skip
        oracle = oracle_continuation_prefill(*args, **b["kwargs"])
        e_full = rel_err(
            full_buffer_continuation_prefill(*args, **b["kwargs"], backend="flash"),
            oracle,
        )
        e = rel_err(out[rows], oracle)
        print(f"{preset} {dtype} request {r}: spread {e:.3e}, full {e_full:.3e}")
        assert e <= 1.1 * e_full + 1e-4, (preset, dtype, r, e, e_full)
