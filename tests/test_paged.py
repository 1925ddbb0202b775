"""The memory-bound path (tq_chunked/runtime/paged.py) against the float64 oracle
and the full path: every request within the full path's error (every preset, fp16 and
bf16, both cache layouts, block sizes 16 and 32, GQA 1/4/7/8, D 64 and 128, decode and
short continuations, splits that cut through blocks), every served row written,
non-finite values and bad block ids as docs/design.md promises, the plan's work list and
scratch, and no access outside the kernels' tensors."""

import inspect

import pytest
import torch
import triton.language as tl
from bounds import reads_within_arguments
from conftest import DEVICE, TRITON_OK
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_promises import NONFINITE_CASES, check_against_oracle, poison

from tq_chunked.runtime import paged
from tq_chunked.runtime.format import PRESETS, TQConfig
from tq_chunked.runtime.paged import (
    MAX_GPU_TILE,
    MIN_SPLIT,
    TOKEN_FIELDS,
    WORK_FIELDS,
    paged_attention,
    paged_continuation_prefill_varlen,
    plan_paged,
)
from tq_chunked.tools.reference import (
    full_buffer_continuation_prefill,
    oracle_continuation_prefill,
)
from tq_chunked.tools.testing import make_batch, rel_err

pytestmark = pytest.mark.skipif(
    not TRITON_OK, reason="the paged kernels are Triton: a GPU or TRITON_INTERPRET=1"
)
BACKEND = "triton" if torch.cuda.is_available() else "torch"
# (cached, q_len): short continuations, a first chunk, a request without query tokens,
# decode
REQUESTS = [(70, 4), (0, 5), (33, 0), (130, 1), (45, 6)]
# Both paths round each cached key to fp16 once; over a request of 1-3 query tokens
# the ratio of two such independent errors spreads widely (tests/test_varlen.py).
SHORT_REQUEST_FACTOR = 1.6

# 64-row tiles on the CPU; on a GPU the largest tile it takes at every head size
# (paged.MAX_GPU_TILE; 64 at head sizes 64 and 128: TILE64_D64_LAUNCH and
# TILE64_LAUNCH, in test_the_gpu_launches)
BIG_TILE = 64 if DEVICE == "cpu" else MAX_GPU_TILE


def run(batch, out=None, **kw):
    """paged_continuation_prefill_varlen on the batch, host lengths given."""
    return paged_continuation_prefill_varlen(
        *batch.args[:5],
        None,
        None,
        **batch.kwargs,
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
        backend=BACKEND,
        out=out,
        **kw,
    )


def check_within_full_paths_error(batch, out):
    """Per request with query tokens: ‖out − oracle‖ ≤ 1.1 ‖full − oracle‖ + 1e-4
    (relative; 1.6 for 1-3 query tokens). Returns the ratios."""
    ratios = []
    for r in range(len(batch.seq_lens)):
        q0, q1 = batch.query_start_loc[r], batch.query_start_loc[r + 1]
        if q1 == q0:
            continue
        args = batch.request(r)
        oracle = oracle_continuation_prefill(*args, **batch.kwargs)
        full = full_buffer_continuation_prefill(*args, **batch.kwargs, backend="torch")
        e, e_full = rel_err(out[q0:q1], oracle), rel_err(full, oracle)
        factor = 1.1 if q1 - q0 >= 4 else SHORT_REQUEST_FACTOR
        assert e <= factor * e_full + 1e-4, (
            f"seed {batch.seed}, request {r}: error {e:.3e}, full path {e_full:.3e}"
        )
        ratios.append(e / e_full)
    return ratios


def out_device(batch):
    return batch.query.device


def poisoned(batch):
    return torch.full_like(batch.query, float("nan"))


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["v020", "v033"])
def test_every_preset_dtype_and_layout_is_within_the_full_paths_error(
    preset, dtype, layout
):
    seed = 100 + sorted(PRESETS).index(preset) * 4 + 2 * (layout == "v033")
    seed += dtype == torch.bfloat16
    batch = make_batch(
        REQUESTS, preset, dtype, num_q_heads=8, num_kv_heads=2, layout=layout, seed=seed
    )
    out = run(batch, poisoned(batch), split_len=32)  # splits of 2 blocks of 16
    assert not out.isnan().any(), f"seed {seed}: a row was not written"
    check_within_full_paths_error(batch, out)


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_combines_own_keys_and_the_chunks_causal_call_agree(preset, dtype):
    """PagedPlan.own_keys (the combine attends to the chunk's own keys, float32)
    against a causal call over them merged in the combine: both within the full
    path's error, and within the call's fp16 rounding of each other."""
    seed = 140 + sorted(PRESETS).index(preset) * 2 + (dtype == torch.bfloat16)
    batch = make_batch(
        REQUESTS + [(90, paged.OWN_KEYS_MAX)],  # the longest own-keys request
        preset,
        dtype,
        num_q_heads=8,
        num_kv_heads=2,
        seed=seed,
    )
    outs = {}
    for own in (True, False):
        info = {}
        outs[own] = run(batch, poisoned(batch), split_len=32, own_keys=own, info=info)
        assert info["plan"].own_keys == own
        assert not outs[own].isnan().any(), f"seed {seed}: a row was not written"
        check_within_full_paths_error(batch, outs[own])
    assert rel_err(outs[True], outs[False].double()) < 2e-3, f"seed {seed}"


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["v020", "v033"])
def test_the_transposed_8_row_tile_is_within_the_full_paths_error(
    preset, dtype, layout
):
    """block_m 8: tiles of (positions, rows) (paged.TRANSPOSED_LAUNCH on a GPU), on
    requests of 2, 8 and 12 rows a kv head (the last in two tiles)."""
    seed = 160 + sorted(PRESETS).index(preset) * 4 + 2 * (layout == "v033")
    seed += dtype == torch.bfloat16
    batch = make_batch(
        REQUESTS, preset, dtype, num_q_heads=4, num_kv_heads=2, layout=layout, seed=seed
    )
    info = {}
    launch = dict(zip(("block_m", "block_n", "num_warps"), paged.TRANSPOSED_LAUNCH))
    if DEVICE == "cpu":
        launch["block_n"] = 16  # splits of 2 iterations
    out = run(batch, poisoned(batch), split_len=32, info=info, **launch)
    assert info["plan"].transposed
    assert not out.isnan().any(), f"seed {seed}: a row was not written"
    check_within_full_paths_error(batch, out)


@pytest.mark.parametrize("preset", ["turboquant_3bit_nc", "turboquant_4bit_nc"])
def test_one_key_dot_gives_the_same_scores_in_both_orientations(preset):
    """q_split=False (the rotated query's fp16 part alone, one key dot): the
    transposed 8-row tile's answer is the 16-row tile's, to float32 rounding (the
    same products; reported, not bounded, against the oracle by paged_probe.py)."""
    batch = make_batch(REQUESTS, preset, num_q_heads=4, num_kv_heads=2, seed=170)
    one = run(batch, poisoned(batch), split_len=32, q_split=False)
    out = run(batch, poisoned(batch), split_len=32, q_split=False, block_m=8)
    assert not out.isnan().any(), "seed 170: a row was not written"
    assert rel_err(out, one.double()) < 1e-3, "seed 170"


@pytest.mark.skipif(DEVICE != "cpu", reason="a GPU compiles one orientation a release")
@pytest.mark.parametrize("outer", [True, False], ids=["groups-outer", "groups-inner"])
@pytest.mark.parametrize(
    "preset", ["turboquant_3bit_nc", "turboquant_4bit_nc", "turboquant_k8v4"]
)
def test_both_orientations_of_the_index_groups(preset, outer, monkeypatch):
    """paged.GROUPS_OUTER picks the index groups' layout by Triton release ((G, N)
    below 3.9, (N, G) from it); the interpreter runs whichever it is given, so both
    are checked on every machine (the byte-permute lookups are GPU-only)."""
    monkeypatch.setattr(paged, "GROUPS_OUTER", tl.constexpr(outer))
    seed = 150 + sorted(PRESETS).index(preset)
    batch = make_batch(
        REQUESTS, preset, torch.float16, num_q_heads=8, num_kv_heads=2, seed=seed
    )
    out = run(batch, poisoned(batch), split_len=32)
    assert not out.isnan().any(), f"seed {seed}: a row was not written"
    check_within_full_paths_error(batch, out)


@pytest.mark.parametrize(
    "preset, group, head_dim, block_size, block_n, split_len",
    [
        ("turboquant_3bit_nc", 1, 64, 32, 16, 48),  # MHA; splits cut blocks of 32
        ("turboquant_k3v4_nc", 4, 128, 16, 32, 32),  # two blocks per iteration
        ("turboquant_4bit_nc", 8, 64, 32, 16, 16),  # 16-position splits
        ("turboquant_k8v4", 7, 64, 16, 32, 64),  # a 28/4-like group, 7 rows a token
        ("turboquant_3bit_nc", 7, 128, 32, 32, 96),  # three iterations a split
    ],
)
def test_groups_head_sizes_block_sizes_and_splits(
    preset, group, head_dim, block_size, block_n, split_len
):
    seed = 200 + group + head_dim + block_size + split_len
    batch = make_batch(
        [(100, 2), (0, 3), (61, 1), (77, 3)],
        preset,
        head_dim=head_dim,
        num_q_heads=2 * group,
        num_kv_heads=2,
        block_size=block_size,
        seed=seed,
    )
    out = run(batch, poisoned(batch), block_n=block_n, split_len=split_len)
    assert not out.isnan().any(), f"seed {seed}: a row was not written"
    check_within_full_paths_error(batch, out)


GPU_LAUNCHES = [
    paged.DECODE_LAUNCH,
    paged.TILE32_LAUNCH,
    paged.TILE32_D64_LAUNCH,
    paged.TILE64_D64_LAUNCH,
    paged.TILE64_LAUNCH,
    paged.TRANSPOSED_LAUNCH,
]


@pytest.mark.parametrize("launch", GPU_LAUNCHES)
def test_the_gpu_launches(launch):
    """The GPU's tuned launches at head size 64 (on a GPU; under the interpreter
    their tiles and positions an iteration, warps having no meaning there), with the
    prefetch, splits that end inside an iteration and blocks of 16."""
    block_m, block_n, num_warps = launch
    seed = 330 + block_m
    batch = make_batch(
        [(300, 8), (0, 2), (517, 1), (130, 16)],  # up to 64 rows a kv head
        "turboquant_3bit_nc",
        num_q_heads=8,
        num_kv_heads=2,
        seed=seed,
    )
    out = run(batch, poisoned(batch), block_m=block_m, block_n=block_n,
              num_warps=num_warps, split_len=block_n * 2, prefetch=1)  # fmt: skip
    assert not out.isnan().any(), f"seed {seed}: a row was not written"
    check_within_full_paths_error(batch, out)


@pytest.mark.parametrize("launch", GPU_LAUNCHES)
def test_the_prefetch_changes_no_bit(launch):
    """Asking L2 for the slots 1 or 2 tiles ahead (a hint on a GPU; a load thrown away
    under the interpreter) leaves every bit of the answer, a bad block id's NaN
    request included, as without it."""
    block_m, block_n, num_warps = launch
    batch = make_batch([(300, 8), (517, 1), (130, 8)], "turboquant_3bit_nc",
                       num_q_heads=8, num_kv_heads=2, seed=340)  # fmt: skip
    batch.block_table[1, 3] = -2  # request 1's positions 48-63 (blocks of 16)
    outs = [
        run(batch, poisoned(batch), block_m=block_m, block_n=block_n,
            num_warps=num_warps, split_len=2 * block_n, prefetch=ahead)
        for ahead in (0, 1, 2)
    ]  # fmt: skip
    q = batch.query_start_loc
    assert outs[0][q[1] : q[2]].isnan().all(), "seed 340"
    for ahead, out in ((1, outs[1]), (2, outs[2])):
        assert torch.equal(out.nan_to_num(), outs[0].nan_to_num()), f"prefetch {ahead}"
        assert torch.equal(out.isnan(), outs[0].isnan()), f"prefetch {ahead}"


@pytest.mark.parametrize(
    "preset", ["turboquant_3bit_nc", "turboquant_k3v4_nc", "turboquant_k8v4"]
)
@pytest.mark.parametrize(
    "launch", [paged.TILE32_LAUNCH, paged.TILE64_LAUNCH, paged.DECODE_LAUNCH]
)
def test_loading_the_values_first_changes_no_bit(launch, preset):
    """PagedPlan.loads_first (a tile's value bytes loaded with its keys', NOTES.md
    §62) moves loads, not arithmetic: every bit of the answer, a bad block id's NaN
    request included, is the same either way, with 3- and 4-bit values and fp8 keys,
    and those loads stay inside their tensors."""
    block_m, block_n, num_warps = launch
    seed = 350 + sorted(PRESETS).index(preset)
    batch = make_batch([(300, 8), (517, 1), (130, 8)], preset, num_q_heads=8,
                       num_kv_heads=2, seed=seed)  # fmt: skip
    batch.block_table[1, 3] = -2  # request 1's positions 48-63 (blocks of 16)
    outs = []
    for first in (False, True):
        with reads_within_arguments():
            outs.append(run(batch, poisoned(batch), block_m=block_m, block_n=block_n,
                            num_warps=num_warps, split_len=2 * block_n,
                            loads_first=first))  # fmt: skip
    q = batch.query_start_loc
    assert outs[0][q[1] : q[2]].isnan().all(), f"seed {seed}"
    assert torch.equal(outs[1].nan_to_num(), outs[0].nan_to_num()), f"seed {seed}"
    assert torch.equal(outs[1].isnan(), outs[0].isnan()), f"seed {seed}"


@pytest.mark.parametrize("q_len", [1, 2, 16])
def test_decode_and_short_continuations_in_one_tile(q_len):
    # rows per kv head 4 x q_len: one tile of up to 64 rows decodes each slot once
    seed = 300 + q_len
    batch = make_batch(
        [(150, q_len), (90, q_len), (20, q_len)],
        "turboquant_3bit_nc",
        num_q_heads=8,
        num_kv_heads=2,
        seed=seed,
    )
    info = {}
    out = run(batch, poisoned(batch), block_m=BIG_TILE if q_len == 16 else None,
              info=info)  # fmt: skip
    assert info["plan"].block_m >= min(4 * q_len, BIG_TILE)
    assert not out.isnan().any(), f"seed {seed}: a row was not written"
    check_within_full_paths_error(batch, out)


def test_the_own_keys_are_read_through_their_strides():
    """Key and value head-major and every second element over D (the gaps NaN, so a
    misread shows): the same bits as contiguous ones under the interpreter; on a GPU,
    whose kernel compiled for these strides may group its sums otherwise (as a cache
    at an odd address did, NOTES.md §26), the same answer to its fp16 rounding."""
    batch = make_batch(REQUESTS, num_q_heads=8, num_kv_heads=2, seed=38)
    want = run(batch, split_len=32)
    for name in ("key", "value"):
        t = getattr(batch, name)
        wide = torch.full((t.shape[1], t.shape[0], 2 * t.shape[2]), float("nan"),
                          dtype=t.dtype, device=t.device)  # fmt: skip
        wide[..., ::2] = t.transpose(0, 1)
        setattr(batch, name, wide.transpose(0, 1)[..., ::2])
    info = {}
    out = run(batch, split_len=32, info=info)
    assert info["plan"].own_keys and batch.key.stride(2) == 2
    if DEVICE == "cpu":
        assert torch.equal(out, want), "seed 38"
    else:
        err = rel_err(out, want.double())
        assert not out.isnan().any() and err < 1e-3, f"seed 38: {err}"


def test_a_later_tokens_infinite_value_never_reaches_earlier_rows():
    """With the combine's own keys a token never reads a later one (stricter than a
    causal call's tile, docs/design.md's first exception)."""
    batch = make_batch([(100, 6), (40, 3)], num_q_heads=4, num_kv_heads=2, seed=39)
    batch.value[5, 1, 3] = float("inf")  # request 0's last token, kv head 1
    info = {}
    out = run(batch, split_len=32, info=info)
    assert info["plan"].own_keys
    assert torch.isfinite(out[:5]).all() and torch.isfinite(out[6:]).all(), "seed 39"
    assert not torch.isfinite(out[5, 2:]).all(), "seed 39: the inf value vanished"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_64_row_tile_at_head_size_128(dtype):
    """16 query tokens over 4 query heads a kv head at head size 128: one 64-row tile
    (on a GPU TILE64_LAUNCH by default, its dots compiled to mma.sync: no kept kernel
    holds a wgmma, NOTES.md §33, §63; one key dot for bf16, ``q_split_by_default``),
    every row written, within the full path's error."""
    seed = 360 + (dtype == torch.bfloat16)
    batch = make_batch([(300, 16), (130, 12), (517, 1)], "turboquant_3bit_nc",
                       dtype, head_dim=128, num_q_heads=8, num_kv_heads=2,
                       seed=seed)  # fmt: skip
    info = {}
    out = run(batch, poisoned(batch), info=info,
              block_m=64 if DEVICE == "cpu" else None)  # fmt: skip
    plan = info["plan"]
    if DEVICE == "cuda":
        assert (plan.block_m, plan.block_n, plan.num_warps) == paged.TILE64_LAUNCH
        kept = list(paged.launch_paged.compiled.values())
        assert kept and not any("wgmma" in k.asm["ptx"] for k in kept)
    assert plan.block_m == 64
    assert not out.isnan().any(), f"seed {seed}: a row was not written"
    check_within_full_paths_error(batch, out)


@pytest.mark.parametrize("split_len", [16, 48, 400])
def test_the_answer_does_not_depend_on_the_splits_beyond_rounding(split_len):
    batch = make_batch(REQUESTS, head_dim=32, seed=31)
    out = run(batch, split_len=split_len)
    one = run(batch, split_len=4096)  # one split per request
    assert rel_err(out, one.double()) < 1e-3, "seed 31"  # the answer's fp16 rounding
    check_within_full_paths_error(batch, out)


def test_rows_of_a_request_with_many_tiles():
    # 2 x 4 x 12 = 96 rows per kv head: several tiles, each decoding the slots
    batch = make_batch([(80, 12), (40, 3)], num_q_heads=8, num_kv_heads=2, seed=33)
    out = run(batch, poisoned(batch), block_m=BIG_TILE, split_len=32)
    check_within_full_paths_error(batch, out)


@pytest.mark.parametrize(
    "own_keys, dtype, hq",
    [(None, torch.float16, 4), (False, torch.float16, 4), (None, torch.bfloat16, 8)],
    ids=["own-keys", "chunk-call", "own-keys-bf16-g4"],
)
def test_lse_is_one_softmaxs_over_all_keys(own_keys, dtype, hq):
    batch = make_batch(REQUESTS, dtype=dtype, num_q_heads=hq, num_kv_heads=2, seed=34)
    out, lse = run(batch, return_lse=True, split_len=32, own_keys=own_keys)
    for r in range(len(batch.seq_lens)):
        q0, q1 = batch.query_start_loc[r], batch.query_start_loc[r + 1]
        if q1 == q0:
            continue
        q, k_new, _, cache, bt, cached = batch.request(r)
        from tq_chunked.runtime.format import dequantize_reference

        cfg = TQConfig.from_preset(batch.kwargs["preset"], q.shape[2])
        k, _ = dequantize_reference(
            cache, bt, 0, cached, cfg, batch.kwargs["centroids"]
        )
        k = k.double() @ batch.kwargs["rotation"].double()  # (Hk, cached, D)
        k = torch.cat([k, k_new.transpose(0, 1).double()], 1)
        g = q.shape[1] // k.shape[0]
        s = torch.einsum("lhd,hkd->hlk", q.double(), k.repeat_interleave(g, 0))
        s = s * batch.kwargs["scale"]
        i = torch.arange(q1 - q0, device=s.device)[:, None]
        later = torch.arange(k.shape[1], device=s.device)[None] > i + cached
        s = s.masked_fill(later, float("-inf"))
        want = torch.logsumexp(s, -1)  # (Hq, q_len)
        # the window path's bound (tests/test_varlen.py): the keys' fp16 rounding
        assert rel_err(lse[:, q0:q1], want) < 1e-3, f"seed 34, request {r}"


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("bad", ["past the end", "negative"])
def test_a_bad_block_id_is_never_read_and_makes_its_request_nan(bad, prefetch):
    batch = make_batch(REQUESTS, head_dim=32, seed=35)
    batch.kv_cache = batch.kv_cache[: int(batch.block_table.max()) + 1]  # ends there
    past = batch.kv_cache.shape[0] + 7
    batch.block_table[3, 2] = past if bad == "past the end" else -3  # request 3
    with reads_within_arguments():
        out = run(batch, split_len=32, prefetch=prefetch)
    q = batch.query_start_loc
    assert out[q[3] : q[4]].isnan().all(), "seed 35"
    others = torch.cat([out[: q[3]], out[q[4] :]])
    assert torch.isfinite(others).all(), "seed 35"


@pytest.mark.parametrize(
    "block_m, own_keys",
    [(None, None), (8, None), (None, False)],
    ids=["default-tile", "transposed", "chunk-call"],
)
@pytest.mark.parametrize("where,value,token", NONFINITE_CASES, ids=str)
def test_non_finite_values_propagate_as_in_one_softmax_over_all_keys(
    where, value, token, block_m, own_keys
):
    # the cases of tests/test_promises.py (request 0: 220 cached, 12 new tokens)
    seed = 31 + len(where) + token
    batch = make_batch(
        [(220, 12), (30, 6)],
        "turboquant_3bit_nc",
        num_q_heads=4,
        num_kv_heads=2,
        seed=seed,
    )
    batch.query.mul_(0.2)
    allowed = poison(batch, where, value, token)
    out = run(batch, split_len=64, block_m=block_m, own_keys=own_keys)
    assert not torch.isfinite(out).all(), f"seed {seed}: the non-finite value vanished"
    check_against_oracle(batch, out, allowed)


@pytest.mark.parametrize("block_m", [None, 8], ids=["default-tile", "transposed"])
def test_a_value_scale_that_is_not_finite_in_bf16_and_with_fp8_keys(block_m):
    for preset, dtype, seed in [
        ("turboquant_k8v4", torch.float16, 41),
        ("turboquant_4bit_nc", torch.bfloat16, 42),
    ]:
        batch = make_batch(
            [(220, 12), (30, 6)], preset, dtype, num_kv_heads=2, seed=seed
        )
        batch.query.mul_(0.2)
        poison(batch, "value scale", float("inf"), 150)
        check_against_oracle(batch, run(batch, split_len=64, block_m=block_m))


# --- the plan -------------------------------------------------------------------------


def test_the_plan_covers_each_requests_cached_positions_once_per_kv_head_and_tile():
    qsl, lens = [0, 4, 9, 9, 10, 16], [74, 5, 33, 131, 51]
    plan = plan_paged(qsl, lens, 8, 2, 64, "turboquant_3bit_nc", split_len=48,
                      block_m=16, block_n=16)  # fmt: skip
    work = plan.work.view(-1, WORK_FIELDS).tolist()
    covered = {}
    for r, h, tok0, _crow0, rows, row0, p0, p1, _part0 in work:
        assert tok0 == qsl[r] and rows == 4 * (qsl[r + 1] - qsl[r])
        assert p0 % plan.split_len == 0 and 0 <= p0 < p1 <= lens[r] - rows // 4
        covered.setdefault((r, h, row0), []).append((p0, p1))
    for (r, _, _), spans in covered.items():
        cached = lens[r] - (qsl[r + 1] - qsl[r])
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == cached
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # requests 0 and 4 (two tiles of 16 rows: 24 rows), request 3 (one): 2 kv heads
    assert {(r, row0) for r, _, row0 in covered} == {(0, 0), (3, 0), (4, 0), (4, 16)}
    tokens = plan.tokens.view(-1, TOKEN_FIELDS).tolist()
    assert [t[0] for t in tokens] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] + list(
        range(10, 16)
    )  # every query token once: the first chunk's (request 1) too
    assert tokens[4][2] == 0  # request 1 has nothing cached: no splits


def _work_list_by_loops(plan, qsl, lens, served):
    """The work list and tokens as plain loops over the served requests, tiles, kv
    heads and splits (paged._build builds them with numpy's array ops): the
    reference."""
    group = plan.num_q_heads // plan.num_kv_heads
    work, tokens, part, crow = [], [], 0, 0
    for r in served:
        q0, q = qsl[r], qsl[r + 1] - qsl[r]
        cached, rows = lens[r] - q, q * group
        busy = cached > 0 and q > 0
        n_splits = -(-cached // plan.split_len) if busy else 0
        tokens += [(q0 + t, part + t, n_splits, q, q0) for t in range(q)]
        for tile in range(-(-rows // plan.block_m) if busy else 0):
            for h in range(plan.num_kv_heads):
                for j in range(n_splits):
                    p0 = j * plan.split_len
                    p1 = min(cached, p0 + plan.split_len)
                    work.append((r, h, q0, crow, rows, tile * plan.block_m, p0, p1,
                                 part + j * q))  # fmt: skip
        part += n_splits * q
        crow += q
    return work, tokens, part


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 300), st.integers(0, 9)), min_size=1, max_size=12
    ),
    st.sampled_from([(8, 2), (4, 4), (32, 8)]),
    st.sampled_from([16, 32, 48, 64]),
    st.data(),
)
def test_the_plans_work_list_is_the_loops(reqs, heads, split_len, data):
    """Every served request, tile, kv head and split in the order the loops give
    them, on batches with first chunks (nothing cached), requests without query
    tokens and several tiles; all requests or a run of them (as the plan serves)."""
    qsl, lens = [0], []
    for cached, q in reqs:
        qsl.append(qsl[-1] + q)
        lens.append(cached + q)
    a = data.draw(st.integers(0, len(reqs) - 1))
    served = data.draw(st.sampled_from([None, range(a, len(reqs))]))
    plan = plan_paged(qsl, lens, *heads, 64, "turboquant_3bit_nc", requests=served,
                      split_len=split_len, block_m=16, block_n=16)  # fmt: skip
    served = range(len(reqs)) if served is None else served
    work, tokens, part = _work_list_by_loops(plan, qsl, lens, served)
    assert plan.work.tolist() == [x for w in work for x in w]
    assert plan.tokens.tolist() == [x for t in tokens for x in t]
    assert plan.part_rows == part
    assert plan.max_splits == max([t[2] for t in tokens], default=0)
    assert plan.max_q_len == max([t[3] for t in tokens], default=0)


def test_the_plans_split_aims_at_the_sms_and_its_scratch_is_its_regions():
    qsl, lens = [0, 1, 2], [4097, 9001]
    plan = plan_paged(qsl, lens, 32, 8, 128, "turboquant_3bit_nc", sms=132,
                      interpret=False)  # fmt: skip
    assert plan.split_len >= MIN_SPLIT and plan.split_len % plan.block_n == 0
    assert 132 <= plan.programs <= 8 * 132
    regions = plan.regions()
    end = max(at + torch.Size(shape).numel() * dtype.itemsize
              for at, shape, dtype in regions.values())  # fmt: skip
    assert plan.scratch_bytes >= end and plan.scratch_bytes - end < 256
    scratch = plan.carve(torch.empty(plan.scratch_bytes, dtype=torch.uint8))
    assert scratch.part_out.shape == (plan.part_rows, 32, 128)


@pytest.mark.parametrize(
    "q_len, head_dim, launch, cap",
    [
        (1, 128, {}, 216),  # decode, 16-row tiles of one warp: 9 warps an SM
        (1, 64, {}, 144),  # TRANSPOSED_LAUNCH by default: 14 warps an SM
        (1, 128, {"block_n": 64, "num_warps": 4}, 168),  # 0.6.3's: 3 programs an SM
        (1, 64, {"block_n": 64, "num_warps": 4}, 128),  # 4 programs an SM
        (1, 128, {"block_m": 32}, 0),  # a 32-row tile: TILE32_LAUNCH, 4 warps
        (8, 64, {}, 0),  # a 32-row tile at D 64: TILE32_D64_LAUNCH, 2 warps
        (16, 64, {}, 0),  # a 64-row tile at D 64: TILE64_D64_LAUNCH, 2 warps
        (16, 128, {}, 0),  # a 64-row tile at D 128: TILE64_LAUNCH, 4 warps
        (1, 256, {}, 0),  # Triton's count (4 warps: one spills at D 256)
        (8, 128, {}, 0),  # 32-row tiles
        (1, 128, {"block_n": 128}, 0),  # another launch
        (1, 128, {"max_registers": 0}, 0),  # asked for
        (1, 64, {"block_m": 8}, 144),  # TRANSPOSED_LAUNCH: 14 warps an SM
        (1, 128, {"block_m": 8}, 0),  # Triton's 255: a cap spills
    ],
)
def test_the_register_cap_is_the_default_launchs_alone(q_len, head_dim, launch, cap):
    qsl, lens = [0, q_len], [4096 + q_len]
    plan = plan_paged(qsl, lens, 16, 4, head_dim, "turboquant_3bit_nc",
                      interpret=False, **launch)  # fmt: skip
    assert plan.max_registers == cap
    launched = (plan.block_m, plan.block_n, plan.num_warps)
    if not launch:  # one warp at D 64 and 128 (DECODE_ or TRANSPOSED_LAUNCH), else
        # the 32- and 64-row tiles' own launches at D 128 and 64, else 4 warps
        tiles = {(32, 128): paged.TILE32_LAUNCH, (32, 64): paged.TILE32_D64_LAUNCH,
                 (64, 64): paged.TILE64_D64_LAUNCH,
                 (64, 128): paged.TILE64_LAUNCH}  # fmt: skip
        if q_len == 1 and head_dim in (64, 128):
            assert plan.num_warps == 1
        elif (plan.block_m, head_dim) in tiles:
            assert launched == tiles[plan.block_m, head_dim]
        else:
            assert plan.num_warps == 4
    # the L2 prefetch at the one-warp launches and TILE32_LAUNCH alone (NOTES.md §46;
    # TILE32_D64_LAUNCH not timed with it, §57)
    prefetching = [paged.DECODE_LAUNCH, paged.TILE32_LAUNCH, paged.TRANSPOSED_LAUNCH]
    assert plan.prefetch == (launched in prefetching)
    # the values' bytes with the keys' at TILE32_LAUNCH and TILE64_LAUNCH alone
    # (NOTES.md §62, §63)
    assert plan.loads_first == (launched in (paged.TILE32_LAUNCH, paged.TILE64_LAUNCH))
    interp = plan_paged(qsl, lens, 16, 4, head_dim, "turboquant_3bit_nc",
                        interpret=True)  # fmt: skip
    assert interp.max_registers == 0


@pytest.mark.parametrize(
    "q_len, head_dim, given, want",
    [
        (1, 128, {}, paged.DECODE_LAUNCH),
        (1, 64, {}, paged.TRANSPOSED_LAUNCH),  # transposed_by_default
        (2, 64, {}, paged.TRANSPOSED_LAUNCH),  # 8 rows a kv head
        (4, 64, {}, paged.DECODE_LAUNCH),  # 16
        (1, 64, {"block_m": 16}, paged.DECODE_LAUNCH),  # the tile asked for
        (1, 32, {}, (16, 64, 4)),  # measured at D 64 and 128 alone
        (1, 256, {}, (16, 64, 4)),
        (8, 128, {}, paged.TILE32_LAUNCH),
        (8, 64, {}, paged.TILE32_D64_LAUNCH),
        (12, 64, {}, paged.TILE64_D64_LAUNCH),  # 48 rows: one tile of 64
        (16, 64, {}, paged.TILE64_D64_LAUNCH),
        (12, 128, {}, paged.TILE64_LAUNCH),  # 48 rows: one tile of 64, mma.sync
        (16, 128, {}, paged.TILE64_LAUNCH),
        (1, 64, {"block_m": 64}, paged.TILE64_D64_LAUNCH),
        (16, 64, {"block_n": 64}, (32, 64, 4)),  # in part: never 64 rows on 4 warps
        (16, 64, {"num_warps": 4}, (32, 64, 4)),
        (8, 256, {}, (32, 64, 4)),
        (1, 128, {"block_m": 32}, paged.TILE32_LAUNCH),  # the tile's own launch
        (1, 128, {"block_m": 64}, paged.TILE64_LAUNCH),
        (16, 128, {"block_n": 128}, (32, 128, 4)),  # in part: at most MAX_GPU_TILE
        (1, 128, {"block_m": 8}, paged.TRANSPOSED_LAUNCH),
        (1, 64, {"block_m": 8}, paged.TRANSPOSED_LAUNCH),
        (1, 256, {"block_m": 8}, (8, 32, 2)),  # one warp spills at D 256
        (1, 128, {"block_m": 8, "block_n": 64}, (8, 64, 1)),  # in part: one warp
        (1, 128, {"num_warps": 4}, (16, 64, 4)),  # in part: 0.6.3's for the rest
        (1, 128, {"block_n": 128}, (16, 128, 4)),
        (8, 128, {"num_warps": 2}, (32, 64, 2)),
    ],
)
def test_a_launch_given_in_part_takes_the_four_warp_launch_for_the_rest(
    q_len, head_dim, given, want
):
    plan = plan_paged([0, q_len], [4096 + q_len], 16, 4, head_dim,
                      "turboquant_3bit_nc", interpret=False, **given)  # fmt: skip
    assert (plan.block_m, plan.block_n, plan.num_warps) == want


@pytest.mark.parametrize(
    "device, capability, hip, want",
    [
        (None, None, None, "ieee"),  # the CPU interpreter
        ("cpu", None, None, "ieee"),
        ("cuda", (9, 0), None, "tf32x3"),
        ("cuda", (8, 0), None, "tf32x3"),
        ("cuda", (7, 5), None, "ieee"),  # no tf32 before sm_80
        ("cuda", (9, 4), "6.2", "ieee"),  # ROCm's Triton takes only "ieee"
    ],
)
def test_the_rotation_takes_tf32x3_only_where_triton_compiles_it(
    monkeypatch, device, capability, hip, want
):
    """paged.rotation_precision: three tf32 products on NVIDIA GPUs from sm_80, float32
    FMA dots elsewhere."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability)
    monkeypatch.setattr(torch.version, "hip", hip)
    device = None if device is None else torch.device(device)
    # the function itself, not its cache of earlier answers
    assert paged.rotation_precision.__wrapped__(device) == want


def test_a_triton_that_does_not_read_the_switch_keeps_two_32_row_tiles(monkeypatch):
    """The 64-row tile at head size 128 needs Triton's DISABLE_MMA_V3 (its 4 warps are
    wgmma otherwise, NOTES.md §33, §63): without it the default keeps 0.6.16's two
    32-row tiles; head size 64's 2-warp tile is mma.sync either way."""
    monkeypatch.setattr(paged, "mma_switch_read", lambda: False)
    plan = lambda d: plan_paged([0, 16], [4096 + 16], 16, 4, d, "turboquant_3bit_nc",
                                interpret=False)  # fmt: skip
    assert (plan(128).block_m, plan(128).num_warps) == (32, 4)
    assert (plan(64).block_m, plan(64).num_warps) == (64, 2)
    monkeypatch.setattr(paged, "mma_switch_read", lambda: True)
    assert (plan(128).block_m, plan(128).num_warps) == (64, 4)


@pytest.mark.parametrize(
    "dtype, q_split, want",
    [(torch.float16, None, True), (torch.bfloat16, None, False),
     (torch.bfloat16, True, True), (torch.float16, False, False)],
)  # fmt: skip
def test_bf16_queries_take_one_key_dot_by_default(dtype, q_split, want):
    """paged.q_split_by_default (NOTES.md §63): the rotated query as fp16 hi + lo (two
    key dots) for fp16 queries, its fp16 part alone for bf16; an explicit q_split is
    taken as given."""
    batch = make_batch([(40, 2)], dtype=dtype, seed=362)
    cfg = TQConfig.from_preset(batch.kwargs["preset"], 64)
    plan = plan_paged(batch.query_start_loc, batch.seq_lens, 4, 2, 64, cfg)
    work, tokens = plan.upload(DEVICE)
    scratch = plan.carve(torch.empty(plan.scratch_bytes, dtype=torch.uint8,
                                     device=DEVICE))  # fmt: skip
    launches = paged.paged_launches(
        batch.query, batch.kv_cache, batch.block_table, plan, work, tokens, scratch,
        torch.empty_like(batch.query), cfg=cfg, centroids=batch.kwargs["centroids"],
        rotation=batch.kwargs["rotation"], scale=batch.kwargs["scale"],
        key=batch.key, value=batch.value, q_split=q_split,
    )  # fmt: skip
    kernel = paged._paged_kernel
    names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
    (args,) = [a for launcher, _, a, _ in launches if launcher is paged.launch_paged]
    assert args[names.index("Q_SPLIT")] is want


@pytest.mark.parametrize(
    "q_len, head_dim, preset, transposed",
    [
        (1, 64, "turboquant_k3v4_nc", True),  # 8 rows a kv head
        (1, 64, "turboquant_k8v4", True),
        (2, 64, "turboquant_3bit_nc", False),  # 16 rows
        (1, 128, "turboquant_3bit_nc", False),  # 255 registers: 8 warps an SM
        (1, 128, "turboquant_k8v4", False),  # tied the 16-row tile without prefetch
        (1, 256, "turboquant_k8v4", False),  # not measured
    ],
)
def test_the_transposed_tile_is_the_gpu_default_where_it_was_measured_faster(
    q_len, head_dim, preset, transposed
):
    """NOTES.md §49: decode batches (at most 8 rows a kv head) at head size 64 take the
    transposed 8-row tile on a GPU; a launch given in part and the interpreter keep
    their 16-row tiles."""
    plan = plan_paged([0, q_len], [4096 + q_len], 16, 2, head_dim, preset,
                      interpret=False)  # fmt: skip
    assert plan.transposed == transposed
    if transposed:
        assert (plan.block_m, plan.block_n, plan.num_warps) == paged.TRANSPOSED_LAUNCH
    part = plan_paged([0, q_len], [4096 + q_len], 16, 2, head_dim, preset,
                      interpret=False, num_warps=4)  # fmt: skip
    assert not part.transposed
    interp = plan_paged([0, q_len], [4096 + q_len], 16, 2, head_dim, preset,
                        interpret=True)  # fmt: skip
    assert not interp.transposed


@pytest.mark.parametrize(
    "given, want",
    [({"prefetch": 0}, 0), ({"prefetch": 2}, 2),
     ({"num_warps": 4, "prefetch": 2}, 2), ({"num_warps": 4}, 0)],
)  # fmt: skip
def test_an_explicit_prefetch_is_the_plans(given, want):
    plan = plan_paged([0, 1], [4097], 16, 4, 128, "turboquant_3bit_nc",
                      interpret=False, **given)  # fmt: skip
    assert plan.prefetch == want


@pytest.mark.parametrize(
    "q_len, head_dim, fp8_prefetch",
    [(1, 128, 0),  # DECODE_LAUNCH: timed, 1.09-1.10x the time with it
     (1, 64, 1), (8, 128, 1)],  # TRANSPOSED_LAUNCH, TILE32_LAUNCH: not timed
)  # fmt: skip
def test_fp8_keys_take_no_prefetch_at_the_decode_launch(q_len, head_dim, fp8_prefetch):
    """NOTES.md §55: at fp8 keys and DECODE_LAUNCH the L2 prefetch took 1.09-1.10x the
    time without it; the other presets keep it at every PREFETCH_LAUNCHES launch, as
    fp8 keys do at the two others (not timed); asked for, it is the plan's."""
    for preset, want in [("turboquant_k8v4", fp8_prefetch), ("turboquant_4bit_nc", 1)]:
        plan = plan_paged([0, q_len], [4096 + q_len], 16, 4, head_dim, preset,
                          interpret=False)  # fmt: skip
        assert (plan.block_m, plan.block_n, plan.num_warps) in paged.PREFETCH_LAUNCHES
        assert plan.prefetch == want, preset
    asked = plan_paged([0, q_len], [4096 + q_len], 16, 4, head_dim, "turboquant_k8v4",
                       interpret=False, prefetch=1)  # fmt: skip
    assert asked.prefetch == 1


@pytest.mark.parametrize(
    "head_dim, launch, per_sm",
    [(128, {}, paged.ONE_WARP_PROGRAMS_PER_SM),
     (128, {"num_warps": 4}, paged.PROGRAMS_PER_SM),
     (128, {"num_warps": 2}, 2 * paged.PROGRAMS_PER_SM),
     (128, {"programs_per_sm": 8}, 8),  # asked for, at one warp
     (256, {}, paged.WIDE_HEAD_PROGRAMS_PER_SM),  # (16, 64, 4): 2 programs fill an SM
     (256, {"num_warps": 2}, 2 * paged.PROGRAMS_PER_SM),
     (256, {"num_warps": 8}, paged.PROGRAMS_PER_SM),
     (256, {"block_m": 32}, paged.PROGRAMS_PER_SM),  # a 32-row tile: not timed
     (256, {"programs_per_sm": 4}, 4)],
)  # fmt: skip
def test_the_split_aims_at_the_launchs_programs_per_sm(head_dim, launch, per_sm):
    """64 decode requests of 64K positions over 132 SMs: the split is the work over
    132 x per_sm programs, rounded up to block_n."""
    b, hk, cached = 64, 8, 65536
    qsl, lens = list(range(b + 1)), [cached + 1] * b
    plan = plan_paged(qsl, lens, 32, hk, head_dim, "turboquant_3bit_nc", sms=132,
                      interpret=False, **launch)  # fmt: skip
    want = -(-b * hk * cached // (132 * per_sm))
    assert plan.split_len == -(-want // plan.block_n) * plan.block_n


@pytest.mark.parametrize(
    "head_dim, launch, per_sm",
    [(128, {}, 8),  # TILE32_LAUNCH
     (64, {}, 32),  # TILE32_D64_LAUNCH
     (64, {"block_m": 64}, 16),  # TILE64_D64_LAUNCH
     (128, {"block_m": 64}, 8),  # TILE64_LAUNCH
     (256, {}, paged.PROGRAMS_PER_SM),  # (32, 64, 4): not measured otherwise
     (128, {"block_n": 64}, paged.PROGRAMS_PER_SM),  # (32, 64, 4): not TILE32_LAUNCH
     (128, {"num_warps": 2}, 2 * paged.PROGRAMS_PER_SM),  # (32, 64, 2), not at D 64
     (64, {"num_warps": 4}, paged.PROGRAMS_PER_SM)],  # (32, 64, 4)
)  # fmt: skip
def test_the_32_row_tiles_aim_at_their_own_programs_per_sm(head_dim, launch, per_sm):
    """NOTES.md §57, §58: TILE32_PROGRAMS_PER_SM at those launches and head sizes
    alone; 16 requests of 8 query tokens (32 rows a kv head) over 64K positions, 132
    SMs."""
    b, hk, cached = 16, 8, 65536
    qsl, lens = list(range(0, 8 * b + 1, 8)), [cached + 8] * b
    plan = plan_paged(qsl, lens, 32, hk, head_dim, "turboquant_3bit_nc", sms=132,
                      interpret=False, **launch)  # fmt: skip
    assert plan.block_m == launch.get("block_m", 32)
    want = -(-b * hk * cached // (132 * per_sm))
    assert plan.split_len == -(-want // plan.block_n) * plan.block_n


def test_splits_grow_until_the_scratch_fits_or_the_plan_is_refused():
    qsl, lens = [0, 64], [64 + 8192]
    small = plan_paged(qsl, lens, 32, 8, 128, "turboquant_3bit_nc", split_len=256)
    capped = plan_paged(qsl, lens, 32, 8, 128, "turboquant_3bit_nc", split_len=256,
                        max_scratch_bytes=small.scratch_bytes // 4)  # fmt: skip
    assert capped.split_len > small.split_len
    assert capped.scratch_bytes <= small.scratch_bytes // 4
    with pytest.raises(ValueError, match="max_scratch_bytes"):
        plan_paged(qsl, lens, 32, 8, 128, "turboquant_3bit_nc",
                   max_scratch_bytes=1 << 16)  # fmt: skip


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(block_m=48), "block_m"),
        (dict(block_m=8, num_warps=4), "num_warps"),  # not built for it
        (dict(block_n=24), "block_n"),
        (dict(num_q_heads=6), "num_q_heads"),
        (dict(lens=[2]), "seq_lens"),
        (dict(qsl=[0, paged.OWN_KEYS_MAX + 1], own_keys=True), "own_keys"),
        # host ints only: a device tensor ("meta" here) would need a read back
        (dict(qsl=torch.tensor([0, 4], device="meta")), "query_start_loc must be host"),
        (dict(lens=torch.tensor([40], device="meta")), "seq_lens must be host"),
        (dict(lens=[40.5]), "seq_lens must be a 1-D sequence of ints"),
        (dict(qsl=[[0, 4]]), "query_start_loc must be a 1-D"),
        (dict(qsl=[0]), "B \\+ 1 = 2"),
    ],
)
def test_bad_plan_arguments_are_value_errors_naming_them(kw, match):
    args = dict(num_q_heads=8, lens=[40], qsl=[0, 4])
    args.update(kw)
    qsl, lens, hq = args.pop("qsl"), args.pop("lens"), args.pop("num_q_heads")
    with pytest.raises(ValueError, match=match):
        plan_paged(qsl, lens, hq, 4, 64, "turboquant_3bit_nc", **args)


@pytest.mark.parametrize("most", [1, paged.OWN_KEYS_MAX, paged.OWN_KEYS_MAX + 1])
def test_the_combine_attends_to_the_own_keys_up_to_own_keys_max(most):
    plan = plan_paged([0, 1, 1 + most], [300, 300 + most], 8, 2, 64,
                      "turboquant_3bit_nc")  # fmt: skip
    assert plan.own_keys == (most <= paged.OWN_KEYS_MAX)
    assert plan.max_q_len == most


def test_a_plan_with_own_keys_refuses_a_run_without_key_and_value():
    batch = make_batch(REQUESTS, head_dim=32, seed=37)
    n, hq, d = batch.query.shape
    cfg = TQConfig.from_preset("turboquant_3bit_nc", d)
    plan = plan_paged(batch.query_start_loc, batch.seq_lens, hq, 2, d, cfg)
    assert plan.own_keys
    work, tokens = plan.upload(batch.query.device)
    buf = torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=out_device(batch))
    kw = {k: v for k, v in batch.kwargs.items() if k != "preset"}
    wrong = dict(key=batch.key, value=batch.value[:, :1])
    for extra, match in [({}, "key must be"), (wrong, "value must be")]:
        with pytest.raises(ValueError, match=match):
            paged_attention(batch.query, batch.kv_cache, batch.block_table, plan,
                            work, tokens, plan.carve(buf), poisoned(batch), cfg=cfg,
                            **kw, **extra)  # fmt: skip


def test_a_buffer_too_small_for_the_scratch_is_refused():
    plan = plan_paged([0, 4], [40], 8, 2, 64, "turboquant_3bit_nc")
    with pytest.raises(ValueError, match="buffer must hold"):
        plan.carve(torch.empty(plan.scratch_bytes - 1, dtype=torch.uint8))


@pytest.mark.parametrize("own_keys", [True, False], ids=["own-keys", "cached-only"])
def test_run_writes_only_the_planned_requests_rows(own_keys):
    # the lead's dispatch: some requests on this path, the rest elsewhere
    batch = make_batch(REQUESTS, head_dim=32, seed=36)
    n, hq, d = batch.query.shape
    cfg = TQConfig.from_preset("turboquant_3bit_nc", d)
    plan = plan_paged(batch.query_start_loc, batch.seq_lens, hq, 2, d, cfg,
                      requests=[0, 4], split_len=32, own_keys=own_keys)  # fmt: skip
    work, tokens = plan.upload(batch.query.device)
    buf = torch.empty(plan.scratch_bytes, dtype=torch.uint8, device=out_device(batch))
    out = poisoned(batch)
    kw = {k: v for k, v in batch.kwargs.items() if k != "preset"}
    if own_keys:
        kw.update(key=batch.key, value=batch.value)
    paged_attention(batch.query, batch.kv_cache, batch.block_table, plan, work,
                    tokens, plan.carve(buf), out, cfg=cfg, **kw)  # fmt: skip
    q = batch.query_start_loc
    mine = torch.zeros(n, dtype=torch.bool, device=out.device)
    mine[q[0] : q[1]] = mine[q[4] : q[5]] = True
    assert torch.isfinite(out[mine]).all() and out[~mine].isnan().all(), "seed 36"


# --- bounds ---------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's addresses")
@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 90), st.integers(0, 5)), min_size=1, max_size=3
    ),
    preset=st.sampled_from(list(PRESETS)),
    group=st.sampled_from([1, 3, 4]),
    block_size=st.sampled_from([16, 32, 24]),
    layout=st.sampled_from(["v020", "v033"]),
    odd_cache=st.booleans(),
    split_len=st.sampled_from([16, 32, 48]),
    prefetch=st.sampled_from([0, 1, 2]),
    block_m=st.sampled_from([None, 8]),
    own_keys=st.sampled_from([None, False]),
    loads_first=st.booleans(),
    bad=st.integers(0, 2**31 - 1),
)
def test_the_kernels_stay_inside_their_tensors(
    requests, preset, group, block_size, layout, odd_cache, split_len, prefetch,
    block_m, own_keys, loads_first, bad,
):  # fmt: skip
    """Rotation, attention and combine, on a cache that ends at its last block in use,
    at an odd address or not, with a block size that is not a power of two, a bad
    block id in one request's cached part, a strided query, key and value, the slots
    of 0-2 tiles ahead prefetched (loads under the interpreter), 16-row or transposed
    8-row tiles, the chunk's own keys in the combine or through a causal call, the
    values' bytes loaded with the keys' or where they are used."""
    seed = bad % 1000
    batch = make_batch(requests, preset, head_dim=32 if preset != "turboquant_k8v4"
                       else 40, num_q_heads=2 * group, num_kv_heads=2,
                       block_size=block_size, layout=layout, seed=seed)  # fmt: skip
    batch.kv_cache = batch.kv_cache[: int(batch.block_table.max()) + 1]
    hit = [r for r, (c, q) in enumerate(requests) if c > 0]
    victim = hit[bad % len(hit)] if hit else None
    if victim is not None:
        col = (bad // 7) % -(-requests[victim][0] // block_size)
        batch.block_table[victim, col] = -1 - bad % 3 if bad % 2 else 10**6
    if odd_cache:
        buf = torch.empty(batch.kv_cache.numel() + 1, dtype=torch.uint8)
        batch.kv_cache = buf[1:].view(batch.kv_cache.shape).copy_(batch.kv_cache)
    for name in ("query", "key", "value"):
        t = getattr(batch, name)
        setattr(batch, name, t.transpose(0, 1).contiguous().transpose(0, 1))
    with reads_within_arguments() as seen:
        out = run(batch, split_len=split_len, prefetch=prefetch, block_m=block_m,
                  own_keys=own_keys, loads_first=loads_first)  # fmt: skip
    assert {"_paged_kernel", "_combine_kernel"} <= seen.kernels or not any(
        c > 0 and q > 0 for c, q in requests
    )
    for r, (_, q) in enumerate(requests):
        rows = out[batch.query_start_loc[r] : batch.query_start_loc[r + 1]]
        if r == victim and q > 0:
            assert rows.isnan().all(), f"seed {seed}, request {r}"
        else:
            assert torch.isfinite(rows).all(), f"seed {seed}, request {r}"
