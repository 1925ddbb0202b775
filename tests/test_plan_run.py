"""Plan once per step, run per layer: ``ContinuationPrefill`` against the one-call
form bit for bit over several layers, what ``Step.run`` refuses, and vLLM's path
(``ChunkedPrefill``): the step planned in the builder's build, found again by the
metadata vLLM's forward makes for the prefill part of a mixed batch."""

import itertools
import types

import numpy as np
import pytest
import torch
import triton
from conftest import TRITON_OK
from hypothesis import given, settings
from hypothesis import strategies as st

from tq_chunked import ContinuationPrefill, continuation_prefill_varlen
from tq_chunked.runtime import vllm_backend
from tq_chunked.runtime._utils import cdiv, interpreting, next_power_of_2
from tq_chunked.runtime.plan import LongRequest
from tq_chunked.tools.reference import oracle_continuation_prefill
from tq_chunked.tools.testing import make_batch, rel_err

BACKEND = "triton" if TRITON_OK else "torch"
REQUESTS = [(150, 24), (0, 20), (40, 8), (300, 1)]


def _prefill(batch, **kw):
    n, hq, d = batch.query.shape
    return ContinuationPrefill(
        hq,
        batch.key.shape[1],
        d,
        preset=batch.kwargs["preset"],
        dtype=batch.query.dtype,
        block_size=batch.kv_cache.shape[1],
        backend=BACKEND,
        **kw,
    )


@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_plan_runs_every_layer_as_the_one_call_does(preset, dtype):
    """Three layers through one plan (one block table and lengths; each layer its own
    tensors: another cache layout, another query): each answer equals the one call's
    bit for bit, with every row written."""
    first = make_batch(REQUESTS, preset, dtype, seed=1)
    head_major = make_batch(REQUESTS, preset, dtype, layout="v033", seed=1)
    assert torch.equal(head_major.block_table, first.block_table)
    layers = [
        (first.query, first.kv_cache),
        (head_major.query, head_major.kv_cache),
        (first.query * 0.5, first.kv_cache),
    ]
    prefill = _prefill(first, window=128)
    step = prefill.plan(
        first.block_table,
        query_start_loc_cpu=first.query_start_loc,
        seq_lens_cpu=first.seq_lens,
    )
    assert len(step.plan.units) > 1  # several windows: the plan is worth sharing
    for i, (query, cache) in enumerate(layers):
        out = torch.full_like(query, float("nan"))
        res = step.run(query, first.key, first.value, cache, **_tensors(first), out=out)
        assert res is out and not out.isnan().any(), (i, first.seed)
        one = continuation_prefill_varlen(
            query,
            first.key,
            first.value,
            cache,
            first.block_table,
            None,
            None,
            **first.kwargs,
            query_start_loc_cpu=first.query_start_loc,
            seq_lens_cpu=first.seq_lens,
            window=128,
            backend=BACKEND,
        )
        assert torch.equal(out, one), (preset, dtype, i, first.seed)


def test_long_requests_layers_launch_bound_as_each_alone():
    """Long requests (several windows a kv-head group, two groups) through one plan:
    layers of distinct tensors and values (the keys and values scaled, the rotation
    negated), the step's fills and split launched bound, and a new workspace
    halfway (its views carved again, the launches bound again): each answer and lse
    the one call's bit for bit."""
    b = make_batch([(150, 6), (20, 3), (25, 4)], head_dim=32, num_q_heads=8,
                   num_kv_heads=4, seed=3)  # fmt: skip
    kw = dict(window=48, path="window", max_workspace_bytes=14000)
    prefill = _prefill(b, **kw)
    step = prefill.plan(
        b.block_table, query_start_loc_cpu=b.query_start_loc, seq_lens_cpu=b.seq_lens
    )
    long = [u for u in step.plan.units if isinstance(u, LongRequest)]
    assert long and all(u.kv_heads < 4 and len(u.windows) > 1 for u in long)
    layers = [
        (b.query * (1 + i), b.key * (1 - 0.3 * i), b.value * (1 + 0.5 * i),
         b.kv_cache.clone(), b.kwargs["rotation"] * (-1) ** i)
        for i in range(3)
    ]  # fmt: skip
    other = torch.empty(step.plan.workspace_bytes + 512, dtype=torch.uint8,
                        device=b.query.device)  # fmt: skip
    for i, (q, k, v, cache, rotation) in enumerate(layers + layers[::-1]):
        tables = dict(centroids=b.kwargs["centroids"], rotation=rotation)
        workspace = other if i >= 3 else None
        out, lse = step.run(q, k, v, cache, **tables, scale=b.kwargs["scale"],
                            return_lse=True, workspace=workspace)  # fmt: skip
        one, one_lse = continuation_prefill_varlen(
            q, k, v, cache, b.block_table, None, None, **{**b.kwargs, **tables},
            query_start_loc_cpu=b.query_start_loc, seq_lens_cpu=b.seq_lens,
            return_lse=True, backend=BACKEND, **kw,
        )  # fmt: skip
        assert torch.equal(out, one) and torch.equal(lse, one_lse), (i, b.seed)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
# the memory-bound path on the CPU: Triton's interpreter (a GPU machine runs without)
INTERPRETED = pytest.mark.skipif(
    not interpreting(), reason="Triton runs on the CPU under TRITON_INTERPRET=1"
)


@pytest.mark.parametrize(
    "device",
    [
        pytest.param("cpu", marks=INTERPRETED),
        pytest.param("cuda", marks=[pytest.mark.gpu, GPU]),
    ],
)
@pytest.mark.parametrize("path", ["window", "paged"])
def test_the_plan_joins_its_ints_without_torchs_thread_pool(path, device, monkeypatch):
    """NOTES.md §56: torch's copies of a work list's size spread over its thread pool
    (milliseconds on a busy host); the plan joins its ints with numpy (into pinned
    memory on a GPU) with torch.cat and Tensor.pin_memory refused, and every unit's
    device ints are its host ones: a window's segments and starts, a paged run's work
    list and tokens."""
    batch = make_batch(REQUESTS, "turboquant_3bit_nc", torch.float16, seed=3,
                       device=device)  # fmt: skip

    def refused(*args, **kw):
        raise AssertionError("the plan used torch's threads")

    monkeypatch.setattr(torch, "cat", refused)
    monkeypatch.setattr(torch.Tensor, "pin_memory", refused)
    step = _prefill(batch, path=path).plan(
        batch.block_table,
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
    )
    monkeypatch.undo()
    ints = step.plan.ints
    assert ints.dtype == torch.int32 and ints.device == batch.block_table.device
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    units = [u for unit in step.plan.units for u in getattr(unit, "windows", (unit,))]
    for u in units:
        if hasattr(u, "segs_host"):  # a window
            assert torch.equal(u.segs.cpu(), i32(u.segs_host))
            assert torch.equal(u.cu_q.cpu(), i32(u.cu_q_host))
            assert torch.equal(u.cu_k.cpu(), i32(u.cu_k_host))
        else:
            assert torch.equal(u.work.cpu().view(-1), u.paged.work)
            assert torch.equal(u.tokens.cpu().view(-1), u.paged.tokens)
    assert {type(u).__name__ for u in units} >= {
        "window": {"Window"},
        "paged": {"PagedRun"},
    }[path]


def _tensors(b):
    kw = dict(b.kwargs)
    kw.pop("preset")
    return kw


def test_run_refuses_tensors_the_plan_was_not_made_for():
    b = make_batch(REQUESTS, seed=4)
    step = _prefill(b, window=128).plan(
        b.block_table, query_start_loc_cpu=b.query_start_loc, seq_lens_cpu=b.seq_lens
    )
    layer = dict(_tensors(b))
    n = b.query.shape[0]
    with pytest.raises(ValueError, match=rf"query must have shape \({n}, 4, 64\)"):
        step.run(b.query[:-1], b.key, b.value, b.kv_cache, **layer)
    with pytest.raises(ValueError, match="query must have shape .* and dtype"):
        step.run(b.query.bfloat16(), b.key, b.value, b.kv_cache, **layer)
    with pytest.raises(ValueError, match=rf"value must have shape \({n}, 2, 64\)"):
        step.run(b.query, b.key, b.value[:, :1], b.kv_cache, **layer)
    wrong_blocks = b.kv_cache.reshape(-1, 8, *b.kv_cache.shape[2:])
    with pytest.raises(ValueError, match=r"kv_cache must have shape \(num_blocks, 16"):
        step.run(b.query, b.key, b.value, wrong_blocks, **layer)


def test_layouts_are_checked_once_per_layout_and_overlaps_at_every_layer(monkeypatch):
    """Step.run checks a layer's layouts once per layout (NOTES.md §53) and its
    overlaps at every layer: a layer of a layout checked before is not checked again,
    yet a written tensor over a read one (the query, the step's block table, its
    workspace) is refused; a tensor at the same address with another dtype, shape or
    strides, or a step of another token count (in a workspace of the same size), is
    checked again and refused as on a first run. (The device is in the key too; one
    device here.)"""
    from tq_chunked.runtime.prefill import Step

    checks = []
    check = Step._check_layouts
    monkeypatch.setattr(
        Step, "_check_layouts", lambda self, *a: (checks.append(a), check(self, *a))[1]
    )
    b = make_batch(REQUESTS, seed=6)
    # a budget at which one token fewer needs the same workspace (91904 bytes)
    prefill = _prefill(b, window=128, max_workspace_bytes=100_000)
    layer = dict(_tensors(b))
    step = prefill.plan(
        b.block_table,
        query_start_loc_cpu=b.query_start_loc,
        seq_lens_cpu=b.seq_lens,
        workspace=(ws0 := torch.empty(prefill.workspace_bytes(len(b.query)),
                                      dtype=torch.uint8)),
    )  # fmt: skip
    out = torch.full_like(b.query, float("nan"))
    first = step.run(b.query, b.key, b.value, b.kv_cache, **layer, out=out).clone()
    assert not first.isnan().any() and len(checks) == 1, b.seed
    out.fill_(float("nan"))
    step.run(b.query, b.key, b.value, b.kv_cache, **layer, out=out)
    assert torch.equal(out, first) and len(checks) == 1, b.seed  # the same layouts
    with pytest.raises(ValueError, match="out must not share memory with query"):
        step.run(b.query, b.key, b.value, b.kv_cache, **layer, out=b.query)
    assert len(checks) == 1  # out's layout: the overlap checked all the same
    rows = torch.stack([b.query, b.query], dim=1).flatten(0, 1)  # each row twice
    with pytest.raises(ValueError, match="out must not share memory with query"):
        step.run(rows[::2], b.key, b.value, b.kv_cache, **layer, out=rows[1::2])
    with pytest.raises(ValueError, match="out must have dtype"):
        step.run(b.query, b.key, b.value, b.kv_cache, **layer, out=out.float())
    # out's address, each with another dtype, shape, strides
    with pytest.raises(ValueError, match="out must have dtype"):
        step.run(b.query, b.key, b.value, b.kv_cache, **layer,
                 out=out.view(torch.int16))  # fmt: skip
    with pytest.raises(ValueError, match="out must have the query's shape"):
        step.run(b.query, b.key, b.value, b.kv_cache, **layer, out=out[:-1])
    with pytest.raises(ValueError, match="out must not have elements that share"):
        step.run(b.query, b.key, b.value, b.kv_cache, **layer,
                 out=out.as_strided(out.shape, (0, *out.stride()[1:])))  # fmt: skip
    assert len(checks) == 6
    # another step of the same object over the same block table, in the same
    # workspace: one token fewer, the first step's query refused
    fewer = prefill.plan(
        b.block_table,
        query_start_loc_cpu=[0] + [q - 1 for q in b.query_start_loc[1:]],
        seq_lens_cpu=[b.seq_lens[0] - 1, *b.seq_lens[1:]],
        workspace=ws0,
    )
    assert fewer.plan.workspace_bytes == step.plan.workspace_bytes
    with pytest.raises(ValueError, match="query must have shape"):
        fewer.run(b.query, b.key, b.value, b.kv_cache, **layer, out=out)
    # a step of the same lengths (layouts checked) whose block table lies in an out
    # found apart before
    spare = torch.empty_like(out)
    step.run(b.query, b.key, b.value, b.kv_cache, **layer, out=spare)
    table = spare.view(torch.int32).flatten()[: b.block_table.numel()]
    table = table.view(b.block_table.shape).copy_(b.block_table)
    again = prefill.plan(
        table,
        query_start_loc_cpu=b.query_start_loc,
        seq_lens_cpu=b.seq_lens,
        workspace=ws0,
    )
    with pytest.raises(ValueError, match="out must not share memory with block_table"):
        again.run(b.query, b.key, b.value, b.kv_cache, **layer, out=spare)
    # another workspace, and the runs after it without one: checked against it
    big = torch.empty(ws0.numel() + out.numel() * out.element_size(), dtype=torch.uint8)
    inside = big[ws0.numel() :].view(out.dtype).view(out.shape)
    step.run(b.query, b.key, b.value, b.kv_cache, **layer, out=inside)  # apart
    step.run(b.query, b.key, b.value, b.kv_cache, **layer, out=out, workspace=big)
    with pytest.raises(ValueError, match="out must not share memory with workspace"):
        step.run(b.query, b.key, b.value, b.kv_cache, **layer, out=inside)
    step.run(b.query, b.key, b.value, b.kv_cache, **layer, out=out)
    assert len(checks) == 8 and torch.equal(out, first), b.seed


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_span_is_the_bytes_the_elements_lie_in(data):
    """_utils.span, which the overlap check compares: [first, last + 1) bytes of the
    elements, against every element's offset; None for no elements."""
    from tq_chunked.runtime._utils import place, span

    rank = data.draw(st.integers(0, 4))
    shape = data.draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank))
    strides = data.draw(st.lists(st.integers(0, 7), min_size=rank, max_size=rank))
    dtype = data.draw(st.sampled_from([torch.uint8, torch.float16, torch.int64]))
    t = torch.empty(128, dtype=dtype).as_strided(
        shape, strides, data.draw(st.integers(0, 3))
    )
    offsets = [
        sum(i * s for i, s in zip(index, strides))
        for index in itertools.product(*map(range, shape))
    ]
    size = t.element_size()
    want = (
        (t.data_ptr() + min(offsets) * size, t.data_ptr() + (max(offsets) + 1) * size)
        if offsets
        else None
    )
    assert span(place(t)) == want, (shape, strides, dtype)


def test_a_query_of_another_head_size_is_blamed_on_the_key_not_the_cache():
    """Issue 35's case: query at D 32, key and value at D 64, the cache at 64."""
    b = make_batch(REQUESTS, seed=5)
    with pytest.raises(ValueError, match=r"^key must have shape \(\d+, 2, 32\)"):
        continuation_prefill_varlen(
            b.query[..., :32].contiguous(),
            *b.args[1:],
            **b.kwargs,
            query_start_loc_cpu=b.query_start_loc,
            seq_lens_cpu=b.seq_lens,
        )


def test_one_request_names_cached_len_when_the_block_table_is_short():
    """Issue 35's case: continuation_prefill has no seq_lens to name."""
    from tq_chunked import continuation_prefill

    b = make_batch([(100, 8)], seed=6)
    q, k, v, cache, row, _ = b.request(0)
    with pytest.raises(ValueError, match=r"^cached_len \(5000\) needs more blocks"):
        continuation_prefill(q, k, v, cache, row, 5000, **b.kwargs)


# --- vLLM's path: planned in build, run per layer -----------------------------------


def _builder(batch, preset):
    ns = types.SimpleNamespace
    n, hq, d = batch.query.shape
    return ns(
        vllm_config=ns(
            model_config=ns(
                dtype=batch.query.dtype, get_num_attention_heads=lambda _: hq
            ),
            parallel_config=None,
            cache_config=ns(cache_dtype=preset),
            compilation_config=None,
        ),
        kv_cache_spec=ns(
            num_kv_heads=batch.key.shape[1],
            head_size=d,
            block_size=batch.kv_cache.shape[1],
        ),
        _tq_chunked_plans=True,
    )


def _metadata(batch, num_decodes, num_decode_tokens, **extra):
    """A TurboQuantMetadata-shaped object over the whole batch (decodes first)."""
    dev = batch.query.device
    return types.SimpleNamespace(
        block_table=batch.block_table,
        query_start_loc=torch.tensor(
            batch.query_start_loc, dtype=torch.int32, device=dev
        ),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev),
        query_start_loc_cpu=torch.tensor(batch.query_start_loc, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(batch.seq_lens, dtype=torch.int32),
        is_prefill=True,
        num_decodes=num_decodes,
        num_decode_tokens=num_decode_tokens,
        **extra,
    )


def _prefill_part(meta, nd, ndt):
    """What vLLM's forward hands _prefill_attention for a mixed batch: a metadata of
    its own over the requests after the decodes (views of the built one's tensors)."""
    return types.SimpleNamespace(
        block_table=meta.block_table[nd:],
        query_start_loc=meta.query_start_loc[nd:] - ndt,
        seq_lens=meta.seq_lens[nd:],
        query_start_loc_cpu=meta.query_start_loc_cpu[nd:] - ndt,
        seq_lens_cpu=meta.seq_lens_cpu[nd:],
        max_seq_len=int(meta.seq_lens_cpu[nd:].max()),
    )


@pytest.mark.parametrize("mixed", [False, True])
def test_vllm_plans_in_build_and_every_layer_runs_that_plan(mixed, monkeypatch):
    """The builder's build plans once (plan_step); two layers' _prefill_attention run
    that step without planning again, whether forward hands them the built metadata
    (a prefill-only batch) or one of its own for the prefill part (a mixed batch, two
    decodes first); each request as exact as the oracle allows."""
    preset = "turboquant_3bit_nc"
    requests = [(60, 1), (90, 1), *REQUESTS] if mixed else REQUESTS
    b = make_batch(requests, preset, seed=8)
    nd, ndt = (2, 2) if mixed else (0, 0)
    chunked = vllm_backend.ChunkedPrefill(window=128)
    plans = []
    real_plan = vllm_backend.ContinuationPrefill.plan
    monkeypatch.setattr(
        vllm_backend.ContinuationPrefill,
        "plan",
        lambda *a, **k: plans.append(a) or real_plan(*a, **k),
    )
    meta = _metadata(b, nd, ndt)
    chunked.plan_step(_builder(b, preset), meta, None)
    assert len(plans) == 1 and meta.tq_chunked_step.num_tokens == b.query.shape[0] - ndt
    impl = types.SimpleNamespace(kv_cache_dtype=preset, scale=b.kwargs["scale"])
    q, k, v = (t[ndt:] for t in (b.query, b.key, b.value))
    for _layer in range(2):
        layer_meta = _prefill_part(meta, nd, ndt) if mixed else meta
        out = chunked.prefill_attention(
            impl,
            q,
            k,
            v,
            b.kv_cache,
            layer_meta,
            b.kwargs["rotation"],
            b.kwargs["centroids"],
        )
    assert len(plans) == 1, "a layer planned again"
    oracle = oracle_continuation_prefill  # per request, against float64
    for r in range(nd, len(requests)):
        q0, q1 = b.query_start_loc[r] - ndt, b.query_start_loc[r + 1] - ndt
        if q1 == q0:
            continue
        ref = oracle(*b.request(r), **b.kwargs)
        assert rel_err(out[q0:q1], ref) < 2e-3, (r, b.seed)


def test_a_step_built_for_other_lengths_is_not_run(monkeypatch):
    """A metadata vLLM's forward made whose lengths differ from the built step's (the
    same block table place): planned anew, never the stale plan."""
    preset = "turboquant_3bit_nc"
    b = make_batch([(60, 1), *REQUESTS], preset, seed=9)
    chunked = vllm_backend.ChunkedPrefill(window=128)
    meta = _metadata(b, 1, 1)
    chunked.plan_step(_builder(b, preset), meta, None)
    built = meta.tq_chunked_step
    part = _prefill_part(meta, 1, 1)
    part.seq_lens_cpu = part.seq_lens_cpu.clone()
    part.seq_lens_cpu[0] -= 1  # one cached token fewer
    impl = types.SimpleNamespace(kv_cache_dtype=preset, scale=b.kwargs["scale"])
    step = chunked._step_for(impl, b.query[1:], b.key[1:], b.kv_cache, part)
    assert step is not built and step.seq_lens == tuple(part.seq_lens_cpu.tolist())
    same = _prefill_part(meta, 1, 1)
    assert chunked._step_for(impl, b.query[1:], b.key[1:], b.kv_cache, same) is built


def test_a_build_that_plans_nothing_leaves_no_older_step_to_run():
    """VLLM 0.20's forward gives a mixed batch's prefill metadata no host copies: it is
    matched to the built step by its block table's place, token count and longest
    request alone. A later build for the same block table that plans nothing (here:
    its metadata without host copies) drops the older step, so that a forward whose
    lengths differ is planned anew from its own lengths, never run on the old plan."""
    preset = "turboquant_3bit_nc"
    b = make_batch([(60, 1), (1000, 16), (500, 16)], preset, seed=10)
    chunked = vllm_backend.ChunkedPrefill(window=128)
    builder = _builder(b, preset)
    meta = _metadata(b, 1, 1)
    chunked.plan_step(builder, meta, None)
    built = meta.tq_chunked_step
    part = _prefill_part(meta, 1, 1)
    part.query_start_loc_cpu = part.seq_lens_cpu = None  # as 0.20's forward makes it
    impl = types.SimpleNamespace(kv_cache_dtype=preset, scale=b.kwargs["scale"])
    layer = (impl, b.query[1:], b.key[1:], b.kv_cache)
    assert chunked._step_for(*layer, part) is built
    # the next step: the same block table, the second request 200 tokens shorter
    b.seq_lens[2] -= 200
    later = _metadata(b, 1, 1)
    later.query_start_loc_cpu = later.seq_lens_cpu = None
    chunked.plan_step(builder, later, None)
    part = _prefill_part(meta, 1, 1)
    part.seq_lens = later.seq_lens[1:]
    part.query_start_loc_cpu = part.seq_lens_cpu = None
    part.max_seq_len = max(built.seq_lens)  # what would have matched the old step
    step = chunked._step_for(*layer, part)
    assert step is not built and step.seq_lens == tuple(b.seq_lens[1:])


def test_a_layer_of_another_shape_than_the_built_step_plans_its_own():
    """The step is planned in build from vLLM's config; a layer whose heads or preset
    differ (another kv-cache group's, a config that disagrees) is planned at the
    layer for its own shape, not run on a step made for another."""
    preset = "turboquant_3bit_nc"
    b = make_batch(REQUESTS, preset, seed=11)
    chunked = vllm_backend.ChunkedPrefill(window=128)
    builder = _builder(b, "turboquant_k3v4_nc")  # the config names another preset
    meta = _metadata(b, 0, 0)
    chunked.plan_step(builder, meta, None)
    impl = types.SimpleNamespace(kv_cache_dtype=preset, scale=b.kwargs["scale"])
    step = chunked._step_for(impl, b.query, b.key, b.kv_cache, meta)
    assert step is not meta.tq_chunked_step and step.prefill.preset_name == preset


@pytest.mark.parametrize(
    "n", [0, 1, 2, 3, 15, 16, 17, 63, 64, 65, 1000, 4097, 2**31 - 1]
)
@pytest.mark.parametrize("d", [1, 3, 16, 64, 1024])
def test_host_cdiv_and_next_power_of_2_are_tritons(n, d):
    """The runtime's host helpers give what triton.cdiv and triton.next_power_of_2
    give (those are constexpr functions, slow to call on the host), numpy ints too."""
    assert cdiv(n, d) == triton.cdiv(n, d)
    assert next_power_of_2(n) == triton.next_power_of_2(n)
    assert next_power_of_2(np.int64(n)) == next_power_of_2(n)
    assert cdiv(np.int32(n), np.int64(d)) == cdiv(n, d)
