"""Which path each request takes (plan.py: the windows, or the memory-bound path of
paged.py for few query rows per kv head over a cached prefix) and that every path gives
the answer within the full path's error: a batch whose units alternate between the
two paths, every preset, fp16 and bf16, both cache layouts, on the CPU interpreter and
on a GPU alike. Also non-finite values on the memory-bound path, the workspace bound
with paged runs, and what ``path`` refuses."""

import dataclasses

import pytest
import torch
from conftest import DEVICE, TRITON_OK
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_paged import check_within_full_paths_error
from test_promises import NONFINITE_CASES, check_against_oracle, poison
from test_promises import REQUESTS as PROMISED

from tq_chunked import ContinuationPrefill, continuation_prefill_varlen
from tq_chunked.runtime import plan
from tq_chunked.runtime.format import PRESETS
from tq_chunked.runtime.plan import PAGED_MAX_ROWS, LongRequest, PagedRun, Window
from tq_chunked.runtime.workspace import rotation_bytes
from tq_chunked.tools.testing import make_batch

pytestmark = pytest.mark.skipif(
    not TRITON_OK, reason="the memory-bound path is Triton: a GPU or TRITON_INTERPRET=1"
)
BACKEND = "triton" if DEVICE == "cuda" else "torch"
# Hq / Hk = 2 (make_batch's 4 / 2): (cached, q_len) and the unit "auto" gives each.
# Requests 0 and 4-5 are on the memory-bound path (2-32 rows a kv head), 1 a first
# chunk and 3 over PAGED_MAX_ROWS in windows, 2 without query tokens in neither:
# paged, window, paged, window, so that a window's fill follows a paged run.
REQUESTS = [(90, 3), (0, 5), (33, 0), (130, 17), (45, 16), (200, 1), (70, 20)]
UNITS = ["paged 0", "window 1 3", "paged 4 5", "window 6"]
# path="paged": 3 and 6 (34 and 40 rows a kv head) in runs of their own (paged_runs)
PAGED_UNITS = ["paged 0", "window 1", "paged 3", "paged 4 5", "paged 6"]


@pytest.fixture(autouse=True)
def any_cached_length(monkeypatch):
    """Batches small enough for the interpreter: "auto" takes the memory-bound path
    for runs of any cached length, and cuts them into parts of any (the rule's
    thresholds have their own tests)."""
    monkeypatch.setattr(plan, "PAGED_MIN_CACHED", 1)
    monkeypatch.setattr(plan, "PAGED_MIN_PART", 1)


def _units(step):
    names = []
    for u in step.plan.units:
        if isinstance(u, PagedRun):
            names.append("paged " + " ".join(map(str, u.requests)))
        elif isinstance(u, LongRequest):
            names.append(f"long {u.request}")
        else:
            names.append("window " + " ".join(map(str, u.requests)))
    return names


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


def _plan(batch, **kw):
    return _prefill(batch, **kw).plan(
        batch.block_table,
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
    )


def _call(batch, path, **kw):
    return continuation_prefill_varlen(
        *batch.args[:5],
        None,
        None,
        **batch.kwargs,
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
        backend=BACKEND,
        path=path,
        **kw,
    )


def test_auto_sends_few_rows_per_kv_head_over_a_cache_to_the_memory_bound_path():
    """fp16 over 3-bit MSE keys (the threshold of cached tokens lowered: fixture)."""
    batch = make_batch(REQUESTS, seed=1, device=DEVICE)
    assert _units(_plan(batch)) == UNITS
    assert _units(_plan(batch, path="window")) == ["window 0 1 3 4 5 6"]
    # "paged": every request with cached tokens (the first chunk 1 in a window)
    assert _units(_plan(batch, path="paged")) == PAGED_UNITS
    # the rule's edge: PAGED_MAX_ROWS rows a kv head, and one more
    group = 2
    edge = [(64, PAGED_MAX_ROWS // group), (64, PAGED_MAX_ROWS // group + 1)]
    assert _units(_plan(make_batch(edge, seed=2, device=DEVICE))) == [
        "paged 0",
        "window 1",
    ]


def test_auto_needs_enough_cached_tokens_in_a_run(monkeypatch):
    monkeypatch.undo()
    half = plan.PAGED_MIN_CACHED // 2
    reqs = [(half, 1), (0, 30), (half, 2), (half - 16, 4)]
    qsl, lens = [0, 1, 31, 33, 37], [c + q for c, q in reqs]
    table = torch.zeros(4, half // 16 + 1, dtype=torch.int32, device=DEVICE)

    def paged(dtype, preset="turboquant_3bit_nc"):
        prefill = ContinuationPrefill(
            8, 2, 64, preset=preset, dtype=dtype, block_size=16
        )
        step = prefill.plan(table, query_start_loc_cpu=qsl, seq_lens_cpu=lens)
        return [u for u in _units(step) if u.startswith("paged")]

    # request 0 alone holds half the threshold; 2 and 3 together just under it
    assert paged(torch.float16) == []
    lens[3] += 16
    assert paged(torch.float16) == ["paged 2 3"]
    assert paged(torch.bfloat16) == ["paged 2 3"]
    assert paged(torch.float16, "turboquant_k8v4") == ["paged 2 3"]
    assert paged(torch.bfloat16, "turboquant_k8v4") == ["paged 2 3"]


LONG = plan.PAGED_LONG_CACHED[128]
MIN_PART = plan.PAGED_MIN_PART  # as the plan has it (the fixture patches it)
LONG64 = plan.PAGED_LONG_CACHED[64]


@pytest.mark.parametrize(
    "rows, cached, preset, head_dim, takes",
    [
        (PAGED_MAX_ROWS, 1, "turboquant_k8v4", 64, True),  # few rows: any cache
        (PAGED_MAX_ROWS + 1, LONG, "turboquant_3bit_nc", 128, True),
        (plan.PAGED_MAX_ROWS_LONG, LONG, "turboquant_4bit_nc", 128, True),
        (plan.PAGED_MAX_ROWS_LONG, LONG, "turboquant_4bit_nc", 256, False),
        (plan.PAGED_MAX_ROWS_LONG, LONG, "turboquant_k3v4_nc", 128, True),
        (plan.PAGED_MAX_ROWS_LONG + 1, LONG, "turboquant_3bit_nc", 128, False),
        (plan.PAGED_MAX_ROWS_LONG, LONG - 1, "turboquant_3bit_nc", 128, False),
        (plan.PAGED_MAX_ROWS_LONG, LONG, "turboquant_3bit_nc", 64, False),
        (plan.PAGED_MAX_ROWS_LONG, LONG64, "turboquant_3bit_nc", 64, True),  # §64
        (plan.PAGED_MAX_ROWS_LONG, LONG64 - 1, "turboquant_4bit_nc", 64, False),
        (PAGED_MAX_ROWS + 1, LONG64, "turboquant_k3v4_nc", 64, True),
        (plan.PAGED_MAX_ROWS_LONG, LONG64, "turboquant_k8v4", 64, False),
        (plan.PAGED_MAX_ROWS_LONG, LONG, "turboquant_k8v4", 128, False),
        (plan.PAGED_MAX_ROWS_LONG, 256, "turboquant_3bit_nc", 128, True),  # §64's bar
        (plan.PAGED_MAX_ROWS_LONG, 255, "turboquant_3bit_nc", 128, False),
        (plan.PAGED_MAX_ROWS_LONG, 2048, "turboquant_4bit_nc", 64, True),  # §64's bar
        (plan.PAGED_MAX_ROWS_LONG, 2047, "turboquant_4bit_nc", 64, False),
    ],
)
def test_more_rows_take_the_memory_bound_path_only_over_a_long_prefix(
    rows, cached, preset, head_dim, takes
):
    """The rule's second band (NOTES.md §41, §57, §59, §64): 33-64 rows a kv head
    where the request holds 256 cached tokens or more at head size 128, 2K or more at
    64 (the head sizes measured), over MSE keys."""
    cfg = plan.TQConfig.from_preset(preset, head_dim)
    assert plan.paged_eligible(rows, cached, cfg) is takes


def test_the_grids_56_row_batch_over_1k_16k_is_one_memory_bound_run():
    """NOTES.md §57: the memory-bound grid's "32 x q8 1K-16K 28/4 4bit" (56 rows a kv
    head; 3 of its 32 requests under 2K cached tokens) is one run of the memory-bound
    path; with the band at 2K or above, its runs would fall under PAGED_MIN_CACHED."""
    from tq_chunked.tools.testing import SHAPES, memory_bound_workloads

    (w,) = [w for w in memory_bound_workloads() if w.name.startswith("32 x q8 1K-16K")]
    hq, hk, d = SHAPES[w.shape]
    qsl, lens = [0], []
    for cached, q in w.requests:
        qsl.append(qsl[-1] + q)
        lens.append(cached + q)
    assert min(c for c, _ in w.requests) >= LONG
    table = torch.zeros(len(lens), max(lens) // 16 + 1, dtype=torch.int32)
    prefill = ContinuationPrefill(hq, hk, d, preset=w.preset, block_size=16)
    step = prefill.plan(table.to(DEVICE), query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    assert _units(step) == ["paged " + " ".join(map(str, range(len(lens))))]


def test_a_run_of_long_prefixes_with_64_rows_takes_the_memory_bound_path(monkeypatch):
    """Speculative verification's shape: 16 tokens of Hq / Hk = 4 over long prefixes;
    the same requests at head size 64 stay in windows (under its bar of 2K)."""
    monkeypatch.undo()
    cached = LONG64 // 2  # over head size 128's bar, under 64's
    assert LONG <= cached < LONG64
    reqs = [(cached, 16)] * (plan.PAGED_MIN_CACHED // cached)
    qsl = [16 * i for i in range(len(reqs) + 1)]
    lens = [c + q for c, q in reqs]
    table = torch.zeros(len(reqs), cached // 16 + 2, dtype=torch.int32, device=DEVICE)

    def units(head_dim):
        prefill = ContinuationPrefill(
            16, 4, head_dim, preset="turboquant_3bit_nc", block_size=16
        )
        return _units(prefill.plan(table, query_start_loc_cpu=qsl, seq_lens_cpu=lens))

    assert units(128) == ["paged " + " ".join(map(str, range(len(reqs))))]
    assert not any(u.startswith("paged") for u in units(64))


def _runs(reqs, path="auto", head_dim=128, group=4):
    """plan.paged_runs of (cached, q_len) requests over 3-bit MSE keys."""
    cfg = plan.TQConfig.from_preset("turboquant_3bit_nc", head_dim)
    qsl = [0]
    for _, q in reqs:
        qsl.append(qsl[-1] + q)
    lens = tuple(c + q for c, q in reqs)
    return plan.paged_runs(tuple(qsl), lens, group, path, torch.device(DEVICE), cfg)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("path", ["auto", "paged"])
def test_requests_either_side_of_32_rows_never_share_a_run(path, head_dim):
    """A run's tile follows its largest request, so decodes and 33-64-row requests
    form runs of their own (NOTES.md §59): Hq / Hk = 4, decodes (4 rows), then 10 and
    16 tokens (40 and 64 rows), a decode, a request without query tokens (in neither),
    and 8 tokens (32 rows), over 2K each (the fixture's PAGED_MIN_PART: any part
    stands alone); a first chunk ends the span."""
    c = LONG64
    reqs = [(c, 1), (c, 1), (c, 10), (c, 16), (c, 1), (c, 0), (c, 8), (0, 9), (c, 1)]
    assert _runs(reqs, path, head_dim) == [(0, 1), (2, 3), (4, 6), (8,)]


@pytest.mark.parametrize("path", ["auto", "paged"])
def test_a_small_part_joins_its_neighbour_or_a_small_wide_end_goes_to_windows(
    path, monkeypatch
):
    """Parts under PAGED_MIN_PART cached tokens (NOTES.md §59): decodes with one wide
    request after them keep their own tile ("auto": the wide request to the windows;
    "paged": it joins them); interleaved decodes and wide requests are one run, not one
    each; a small part joins the large one before it (any run length: the fixture's
    PAGED_MIN_CACHED)."""
    monkeypatch.setattr(plan, "PAGED_MIN_PART", MIN_PART)
    small, large = 4096, MIN_PART
    decodes = [(large // 8, 1)] * 8  # one large part
    wide = (small, 16)  # 64 rows a kv head
    one_wide = _runs([*decodes, wide], path)
    assert one_wide == ([tuple(range(8))] if path == "auto" else [tuple(range(9))])
    interleaved = [(small, 1), wide] * 6 + [(small, 1)]
    assert _runs(interleaved, path) == [tuple(range(13))]
    # a large wide part, then a small decode: the decode joins it
    assert _runs([(large, 16), (large, 16), (small, 1)], path) == [(0, 1, 2)]


def test_the_run_minimum_counts_a_span_before_it_is_cut(monkeypatch):
    """PAGED_MIN_CACHED holds for a span of consecutive requests, not each of its
    runs: decodes under the minimum and wide requests that bring the span to it are
    both served, each in its run."""
    monkeypatch.undo()
    least = plan.PAGED_MIN_CACHED
    decodes = [(least // 16, 1)] * 12  # three quarters of the minimum
    wide = [(least // 8, 16)] * 2  # the rest
    assert _runs(decodes) == []
    assert _runs(decodes + wide) == [tuple(range(12)), (12, 13)]


@pytest.mark.parametrize("path", ["auto", "paged", "window"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_path_is_within_the_full_paths_error(preset, dtype, path):
    """Every request within 1.1x the full path's error against float64 (1.6x for 1-3
    query tokens), every row written (the output poisoned first), and the log-sum-exp
    the windows' within 1e-2 (they round each key to the query's dtype, which moves a
    score by up to 2^-8 of its size in bf16)."""
    batch = make_batch(REQUESTS, preset, dtype, seed=3, device=DEVICE)
    out = torch.full_like(batch.query, float("nan"))
    res, lse = _call(batch, path, out=out, return_lse=True)
    assert res is out and not out.isnan().any(), f"seed {batch.seed}"
    check_within_full_paths_error(batch, out)
    _, lse_window = _call(batch, "window", return_lse=True)
    torch.testing.assert_close(lse, lse_window, rtol=0, atol=1e-2)


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_the_head_major_cache_and_one_layer_after_another(preset):
    """VLLM 0.33's head-major cache layout on the memory-bound path, and one plan run
    for two layers: each the one call's answer bit for bit."""
    batch = make_batch(REQUESTS, preset, layout="v033", seed=4, device=DEVICE)
    step = _plan(batch, path="paged")
    assert _units(step) == PAGED_UNITS
    kw = dict(
        centroids=batch.kwargs["centroids"],
        rotation=batch.kwargs["rotation"],
        scale=batch.kwargs["scale"],
    )
    for query in (batch.query, batch.query * 0.5):
        out = step.run(query, batch.key, batch.value, batch.kv_cache, **kw)
        one = continuation_prefill_varlen(
            query,
            *batch.args[1:5],
            None,
            None,
            **batch.kwargs,
            query_start_loc_cpu=batch.query_start_loc,
            seq_lens_cpu=batch.seq_lens,
            backend=BACKEND,
            path="paged",
        )
        assert torch.equal(out, one)
    check_within_full_paths_error(batch, step.run(*batch.args[:4], **kw))


def _layers(batch):
    """(name, arguments of Step.run) of one step's layers, in order: the batch's; new
    tensors of the same layouts (the tables too); value the key itself; apart again;
    another scale; a query of other strides; the cache at another alignment class; the
    rotation in 16 bits (another dtype, which an fp8 preset's launches never read)."""
    new = lambda t: None if t is None else t.clone()  # same layout, other address
    wide = torch.empty_like(batch.query.repeat(1, 1, 2))
    wide[..., ::2] = batch.query  # the same values, strides (., ., 2)
    moved = torch.empty(
        batch.kv_cache.numel() + 2, dtype=torch.uint8, device=batch.kv_cache.device
    )
    shifted = moved[2:].view(batch.kv_cache.shape)
    shifted.copy_(batch.kv_cache)
    q, k, v, c = batch.query, batch.key, batch.value, batch.kv_cache
    kw = batch.kwargs
    tables = {"centroids": kw["centroids"], "rotation": kw["rotation"]}
    others = {name: new(t) for name, t in tables.items()}
    rotation16 = dict(tables, rotation=tables["rotation"].to(q.dtype))
    scale = kw["scale"]
    layers = [
        ("the batch's", (q, k, v, c), tables, scale),
        ("new tensors", (new(q) * 0.5, new(k), new(v), new(c)), others, scale),
        ("value is key", (q, k, k, c), tables, scale),
        ("apart again", (new(q), new(v), new(k), c), others, scale),
        ("another scale", (q, k, v, c), tables, scale * 0.5),
        ("strided query", (wide[..., ::2], k, v, c), tables, scale),
        ("shifted cache", (q, k, v, shifted), tables, scale),
        ("16-bit rotation", (q, k, v, c), rotation16, scale),
    ]
    return [(name, args, dict(t, scale=s)) for name, args, t, s in layers]


def _paths(path):
    """The plan's keywords for a test's path: "long" is windows of 64 tokens."""
    return dict(path="window", window=64) if path == "long" else dict(path=path)


def _bound_counts(step):
    """The step's bound launches by unit kind (fill, paged, merge, pieces), the
    rotation's split (one per layout) not counted."""
    counts = {"fill": 0, "paged": 0, "merge": 0, "pieces": 0}
    for key, launches in step._bound.items():
        counts[key[0]] += sum(k != "split" for k in launches)
    return counts


@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_k8v4"])
@pytest.mark.parametrize("path", ["paged", "window", "long"])
def test_a_steps_layers_launch_bound_as_each_alone(preset, path):
    """Every layer of a step after the first of its layouts launches its paged runs,
    its fills and its long requests' merges from the arguments the first built
    (_utils.BoundLaunches), its own tensors put in: each layer's answer and lse are
    the one call's bit for bit, through layers of the same layouts, a value that is
    the key, another scale, other strides, another alignment class and another
    rotation dtype. "long": windows of 64 tokens, four long requests of 2-4."""
    batch = make_batch(REQUESTS, preset, seed=6, device=DEVICE)
    paths = _paths(path)
    step = _plan(batch, **paths)
    if path == "paged":  # runs with own keys, runs with the call, one window
        assert _units(step) == PAGED_UNITS
    if path == "long":
        assert [u for u in _units(step) if u.startswith("long")] == [
            "long 0",
            "long 3",
            "long 5",
            "long 6",
        ]
    bound, merges = [], []
    for name, args, kw in _layers(batch):
        out, lse = step.run(*args, **kw, return_lse=True)
        one, one_lse = continuation_prefill_varlen(
            *args, batch.block_table, None, None, **{**batch.kwargs, **kw},
            query_start_loc_cpu=batch.query_start_loc, seq_lens_cpu=batch.seq_lens,
            backend=BACKEND, return_lse=True, **paths,
        )  # fmt: skip
        assert torch.equal(out, one), (name, batch.seed)
        assert torch.equal(lse, one_lse), (name, batch.seed)
        # the units' bound launches, the merges apart
        counts = _bound_counts(step)
        merges.append(counts.pop("merge"))
        bound.append(sum(counts.values()))
    # bound at the first layer, again where the layouts, the aliasing or (paged
    # runs) the scale changed, and not where only the addresses did; a fill reads
    # neither the query nor the scale; an fp8 preset's launches not the rotation; a
    # merge reads out, lse and the partials alone, of the same layouts in each layer
    mse = PRESETS[preset][0] != 8
    if path == "paged":  # four runs (r) and a window's fill (f)
        r, f = 4, 1
        assert bound == [
            r + f,
            r + f,
            2 * (r + f),
            2 * (r + f),
            2 * (r + f) + r,  # another scale: the runs alone
            2 * (r + f) + 2 * r,  # a strided query: the runs alone
            3 * (r + f) + 2 * r,
            (3 + mse) * (r + f) + 2 * r,
        ]
    else:
        n = bound[0]
        assert n and bound == [n, n, 2 * n, 2 * n, 2 * n, 2 * n, 3 * n, (3 + mse) * n]
    # one merge a window of each long request's kv-head group: 11 windows here
    assert merges == [11 * (path == "long")] * len(merges)


@pytest.mark.parametrize("path", ["paged", "long"])
def test_layers_of_other_out_and_lse_layouts_bind_again(path):
    """A layer whose out or lse differs in layout from the layers before it (other
    strides, another alignment class, lse not asked for) binds its paged runs or its
    long requests' merges again, and answers as one call; the fills, which read
    neither, stay bound."""
    batch = make_batch(REQUESTS, "turboquant_3bit_nc", seed=9, device=DEVICE)
    paths = _paths(path)
    step = _plan(batch, **paths)
    n, hq, d = batch.query.shape
    q = batch.query
    wide = torch.empty(n, hq, 2 * d, dtype=q.dtype, device=q.device)[..., :d]
    shifted = torch.empty(n * hq * d + 1, dtype=q.dtype, device=q.device)[1:]
    padded = torch.empty(hq, n + 8, device=q.device)[:, :n]  # lse rows of n + 8
    layouts = [
        ("allocated", None, None, True),
        ("strided out", wide, None, True),
        ("shifted out", shifted.view(n, hq, d), None, True),
        ("padded lse", None, padded, True),
        ("no lse", None, None, False),
    ]
    one, one_lse = continuation_prefill_varlen(
        *batch.args[:4], batch.block_table, None, None, **batch.kwargs,
        query_start_loc_cpu=batch.query_start_loc, seq_lens_cpu=batch.seq_lens,
        backend=BACKEND, return_lse=True, **paths,
    )  # fmt: skip
    kw = {k: batch.kwargs[k] for k in ("centroids", "rotation", "scale")}
    counts = []
    for name, out, lse, return_lse in layouts:
        got = step.run(*batch.args[:4], **kw, out=out, lse=lse, return_lse=return_lse)
        out, lse = got if return_lse else (got, None)
        assert torch.equal(out, one), (name, batch.seed)
        assert lse is None or torch.equal(lse, one_lse), (name, batch.seed)
        counts.append(_bound_counts(step))
    unit = "paged" if path == "paged" else "merge"
    first = counts[0][unit]  # 4 paged runs; 11 windows' merges
    assert first == (4 if path == "paged" else 11)
    assert [c[unit] for c in counts] == [first * (i + 1) for i in range(len(counts))]
    assert len({c["fill"] for c in counts}) == 1


def _without(field, layer_key, paged_key):
    """The key builders of prefill.py with one field of the key dropped."""

    def shapes(layer, places):
        layouts, alias = layer_key(layer, places)
        if field == "strides":  # (dtype, shape, strides, alignment class)
            layouts = tuple(x and (x[0], x[1], None, x[3]) for x in layouts)
        if field == "aliasing":
            alias = tuple(range(len(alias)))
        return layouts, alias

    def paged(shapes, scale, new_lse, err):
        return paged_key(shapes, None if field == "scale" else scale, new_lse, err)

    return shapes, paged


# each field of a layer's key and the first layer that a key without it launches with
# another layer's arguments ("value is key" first, so that "the batch's" follows it)
KEY_FIELDS = {
    "strides": "strided query",
    "aliasing": "the batch's",
    "scale": "another scale",
}


@pytest.mark.parametrize("field", list(KEY_FIELDS))
def test_a_key_without_each_of_its_fields_launches_stale_arguments(field, monkeypatch):
    """The key of a step's bound launches needs its strides, its aliasing and its
    scale: without one of them, the first layer that differs from the one before it
    in that field alone answers otherwise than one call (so
    test_a_steps_layers_launch_bound_as_each_alone covers these three fields through
    the query, key and value; out's and lse's layouts have the test above)."""
    from tq_chunked.runtime import prefill

    shapes, paged = _without(field, prefill.layer_key, prefill._paged_key)
    monkeypatch.setattr(prefill, "layer_key", shapes)
    monkeypatch.setattr(prefill, "_paged_key", paged)
    batch = make_batch(REQUESTS, "turboquant_3bit_nc", seed=8, device=DEVICE)
    step = _plan(batch, path="paged")
    layers = sorted(_layers(batch), key=lambda x: x[0] != "value is key")
    stale = None
    for name, args, kw in layers:
        out = step.run(*args, **kw)
        one = continuation_prefill_varlen(
            *args, batch.block_table, None, None, **{**batch.kwargs, **kw},
            query_start_loc_cpu=batch.query_start_loc, seq_lens_cpu=batch.seq_lens,
            backend=BACKEND, path="paged",
        )  # fmt: skip
        if not torch.equal(out, one):
            stale = name
            break
    assert stale == KEY_FIELDS[field], (field, batch.seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_bound_launches_are_what_paged_launches_and_fill_launch_build(
    dtype, monkeypatch
):
    """The arguments bound launches give each launcher are those ``paged_launches``
    and ``fill_launch`` build for that layer's tensors: the same bytes in the same
    layout where they are tensors (the same objects, or views such as bf16's out as
    fp16), equal values elsewhere; a run with own keys, one after a causal call, and
    a window's fill."""
    from tq_chunked.runtime import dequant, paged, prefill
    from tq_chunked.runtime._utils import layout

    seen = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, *args, **options):
            seen.append((self.name, grid, args, options))

    for name in ("launch_rotate", "launch_paged", "launch_combine"):
        monkeypatch.setattr(paged, name, Recorder(name))
    for name in ("launch_fill", "launch_split"):
        monkeypatch.setattr(dequant, name, Recorder(name))
    built = []
    real_launches, real_call = paged.paged_launches, prefill.varlen_attention

    def launches(*args, **kwargs):
        built.append(1)
        return real_launches(*args, **kwargs)

    partials = {}  # the causal call's lse, one tensor per layer for both runs

    def call(*args):
        lse = real_call(*args)
        return partials.setdefault((layer, lse.shape), lse.clone()).copy_(lse)

    monkeypatch.setattr(prefill, "paged_launches", launches)
    monkeypatch.setattr(prefill, "varlen_attention", call)
    batch = make_batch(REQUESTS, "turboquant_3bit_nc", dtype, seed=7, device=DEVICE)
    step = _plan(batch, path="paged")
    binds = []
    for layer, args, kw in _layers(batch):
        out = torch.empty_like(args[0], memory_format=torch.contiguous_format)
        lse = torch.empty(batch.query.shape[1], len(out), device=out.device)
        seen.clear()
        before = len(built)
        step.run(*args, **kw, out=out, lse=lse)
        binds.append(len(built) - before)
        with monkeypatch.context() as m:  # what paged_launches builds for them
            m.setattr(step, "_bound", {})
            step.run(*args, **kw, out=out, lse=lse)
        launches, fresh = seen[: len(seen) // 2], seen[len(seen) // 2 :]
        # rotate, paged, combine for each of the four runs; the window's split and
        # fill
        assert len(launches) == len(fresh) == 14
        for a, b in zip(launches, fresh):
            assert a[:2] == b[:2] and a[3] == b[3] and len(a[2]) == len(b[2])
            for x, y in zip(a[2], b[2]):
                if isinstance(y, torch.Tensor):
                    same = x.data_ptr() == y.data_ptr() and layout(x) == layout(y)
                    assert x is y or same, (layer, a[0])
                else:
                    assert x == y, (layer, a[0])
    # built where the layouts, the aliasing or the scale changed
    assert binds == [4, 0, 4, 0, 4, 4, 4, 4]


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    reqs=st.lists(
        st.tuples(st.integers(0, 5000), st.integers(0, 40)), min_size=1, max_size=12
    ),
    window=st.sampled_from([None, 512, 4096]),
    hk=st.sampled_from([1, 2, 8]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
)
def test_a_step_needs_at_most_workspace_bytes(reqs, window, hk, dtype):
    """With paged runs among the units, a step of N query tokens still fits
    ``workspace_bytes(N, ...)`` (the paged scratch is planned within a batch window of
    N tokens), and no region of the paged scratch (bf16: the chunk's fp16 copies too)
    overlaps the rotation's parts."""
    prefill = ContinuationPrefill(
        8 * hk, hk, 64, preset="turboquant_3bit_nc", dtype=dtype, block_size=16,
        window=window,
    )  # fmt: skip
    qsl = [0]
    for _, q in reqs:
        qsl.append(qsl[-1] + q)
    lens = [c + q for c, q in reqs]
    table = torch.zeros(len(reqs), 5000 // 16 + 4, dtype=torch.int32, device=DEVICE)
    step = prefill.plan(table, query_start_loc_cpu=qsl, seq_lens_cpu=lens)
    need = step.plan.workspace_bytes
    assert need <= prefill.workspace_bytes(qsl[-1])
    # a workspace of exactly the plan's bytes, starting off the allocator's alignment
    ws = torch.empty(need + 1, dtype=torch.uint8, device=DEVICE)[1:]
    step._take(ws)
    start, end = ws.data_ptr(), ws.data_ptr() + ws.numel()
    rot_end = None
    for unit, bufs in zip(step.plan.units, step.buffers):
        if not isinstance(unit, PagedRun):
            f = bufs.rot_flags
            rot_end = f.data_ptr() + f.numel() * f.element_size()
    for unit, bufs in zip(step.plan.units, step.buffers):
        if isinstance(unit, PagedRun):
            # bf16's fp16 copies for a causal call; none with the combine's own keys
            half = dtype == torch.bfloat16 and not unit.paged.own_keys
            assert (bufs.chunk_q.numel() > 0) == half
            for f in dataclasses.fields(bufs):
                t = getattr(bufs, f.name)
                if not t.numel():
                    continue
                lo = t.data_ptr()
                assert start + rotation_bytes(64) <= lo
                assert lo + t.numel() * t.element_size() <= end
                assert rot_end is None or lo >= rot_end


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_rotation_on_the_memory_bound_path(dtype):
    """The rotation in any float dtype the call accepts (the query's rotation kernel
    reads it as float32): the answer of the float32 rotation's 16-bit rounding."""
    batch = make_batch(REQUESTS, seed=8, device=DEVICE)
    batch.kwargs["rotation"] = batch.kwargs["rotation"].to(dtype)
    out = _call(batch, "paged")
    batch.kwargs["rotation"] = batch.kwargs["rotation"].float()
    ref = _call(batch, "paged")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_path_names_what_it_takes():
    with pytest.raises(
        ValueError, match="path must be one of 'auto', 'window', 'paged'"
    ):
        ContinuationPrefill(4, 2, 64, preset="turboquant_3bit_nc", block_size=16,
                            path="fast")  # fmt: skip
    batch = make_batch([(5000, 40)], seed=5, device=DEVICE)
    with pytest.raises(ValueError, match=r"path='paged': request\(s\) 0 need more"):
        _call(batch, "paged", max_workspace_bytes=1 << 16)
    # auto: the windows serve what does not fit the memory-bound path's scratch
    batch = make_batch([(5000, 8)], seed=6, device=DEVICE)
    prefill = _prefill(batch, max_workspace_bytes=1 << 16)
    step = prefill.plan(
        batch.block_table,
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
    )
    assert isinstance(step.plan.units[0], (Window, LongRequest))


@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU always runs Triton")
def test_without_triton_auto_takes_the_windows_and_paged_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    batch = make_batch(REQUESTS, seed=7, device=DEVICE)
    assert _units(_plan(batch)) == ["window 0 1 3 4 5 6"]
    with pytest.raises(ValueError, match="path='paged' needs Triton"):
        _plan(batch, path="paged")


@pytest.mark.parametrize("where,value,token", NONFINITE_CASES, ids=lambda x: str(x))
def test_non_finite_values_on_the_memory_bound_path(where, value, token):
    """A NaN or inf in the cache, the query or the chunk comes out where one softmax
    over all keys puts it, with every request on the memory-bound path (the combine
    reads the chunk's partial from ``out`` itself)."""
    seed = 31 + len(where) + token
    batch = make_batch(
        PROMISED, "turboquant_3bit_nc", num_q_heads=4, num_kv_heads=2, seed=seed,
        device=DEVICE,
    )  # fmt: skip
    batch.query.mul_(0.2)  # every softmax weight far from underflow (test_promises.py)
    allowed = poison(batch, where, value, token)
    out = _call(batch, "paged")
    assert not torch.isfinite(out).all(), f"seed {seed}: the non-finite value vanished"
    check_against_oracle(batch, out, allowed)
