"""What the batched call promises (docs/design.md, "What the call promises"):
non-finite values propagate exactly as in one softmax over all keys (the float64 oracle
is the judge), no call writes into its inputs or reads what it writes, and every bad
argument is a ValueError naming it, raised before anything runs, with the inputs and
``out`` untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICE, TRITON_OK
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tq_chunked import continuation_prefill_varlen, workspace_bytes
from tq_chunked.runtime import prefill
from tq_chunked.runtime.format import TQConfig, encode_reference
from tq_chunked.tools.reference import oracle_continuation_prefill
from tq_chunked.tools.testing import make_batch, strided

BACKEND = "triton" if TRITON_OK else "torch"
NAN, INF = float("nan"), float("inf")
FP16_BITS = {NAN: 0x7E00, INF: 0x7C00}
# A long request (3 part windows and a last one at window 64) and a short one beside it.
REQUESTS = [(220, 12), (30, 6)]
WINDOW = 64


# --- non-finite values ----------------------------------------------------------------


def _set_fp16(batch, request, token, head, offset, value):
    """The fp16 at byte ``offset`` of a cached token's slot (a key norm, a value
    scale)."""
    bs = batch.kv_cache.shape[1]
    block = int(batch.block_table[request, token // bs])
    bits = FP16_BITS[value]
    batch.kv_cache[block, token % bs, head, offset] = bits & 0xFF
    batch.kv_cache[block, token % bs, head, offset + 1] = bits >> 8


def poison(batch, where, value, token):
    """Put a NaN or inf into one place of the batch (request 0 unless said otherwise).
    Returns the elements that may come out NaN though one softmax over the keys each
    query sees is finite there: a new token's inf or NaN value in the rows of the
    earlier tokens of its request (attention kernels weigh a key a query does not see
    by exactly 0 within a tile, and 0 * inf is NaN, as in one matmul over all keys);
    else None."""
    cfg = TQConfig.from_preset(batch.kwargs["preset"], batch.query.shape[2])
    if where == "chunk value":
        r = next(
            r
            for r in range(len(batch.seq_lens))
            if batch.query_start_loc[r + 1] > token
        )
        g = batch.query.shape[1] // batch.key.shape[1]
        allowed = torch.zeros(
            batch.query.shape, dtype=torch.bool, device=batch.query.device
        )
        allowed[batch.query_start_loc[r] : token, g : 2 * g, 9] = True
    if where == "key norm":
        _set_fp16(batch, 0, token, 1, cfg.key_index_bytes, value)
    elif where == "value scale":
        _set_fp16(batch, 0, token, 0, cfg.key_bytes + cfg.value_index_bytes, value)
    elif where == "short request's key norm":
        _set_fp16(batch, 1, token, 0, cfg.key_index_bytes, value)
    elif where == "query":
        batch.query[token, 3, 5] = value
    elif where == "chunk key":
        batch.key[token, 0, 7] = value
    elif where == "chunk value":
        batch.value[token, 1, 9] = value
        return allowed
    return None


def _first(mask):
    i = mask.nonzero()
    if not len(i):
        return "none"
    first = tuple(i[0].tolist())
    return f"{int(mask.sum())} elements, the first at (row, head, d) {first}"


def check_against_oracle(batch, out, allowed=None, bound=None):
    """Per request: NaN exactly where the oracle has NaN (and where ``allowed``, see
    ``poison``, maybe), inf (with its sign) exactly where it has inf, and the finite
    elements within ``bound`` of it (relative; default: 2x the full path's bf16 or fp16
    error at these sizes)."""
    bound = bound or (8e-3 if batch.query.dtype == torch.bfloat16 else 2e-3)
    for r in range(len(batch.seq_lens)):
        q0, q1 = batch.query_start_loc[r], batch.query_start_loc[r + 1]
        if q1 == q0:
            continue
        oracle = oracle_continuation_prefill(*batch.request(r), **batch.kwargs)
        got = out[q0:q1].double()
        maybe = (
            allowed[q0:q1] & got.isnan()
            if allowed is not None
            else torch.zeros_like(got, dtype=torch.bool)
        )
        tag = f"seed {batch.seed}, request {r}"
        nan_diff = (got.isnan() != oracle.isnan()) & ~maybe
        assert not nan_diff.any(), (
            f"{tag}: NaN pattern differs at {_first(nan_diff)}: ours "
            f"{got[nan_diff][:3].tolist()}, oracle {oracle[nan_diff][:3].tolist()}"
        )
        inf_diff = (got.isinf() != oracle.isinf()) | (oracle.isinf() & (got != oracle))
        assert not inf_diff.any(), (
            f"{tag}: inf pattern differs at {_first(inf_diff)}: ours "
            f"{got[inf_diff][:3].tolist()}, oracle {oracle[inf_diff][:3].tolist()}"
        )
        fin = torch.isfinite(oracle) & ~maybe
        if fin.any():
            e = ((got[fin] - oracle[fin]).norm() / oracle[fin].norm()).item()
            assert e < bound, (
                f"{tag}: error {e:.2e} on the finite elements (bound {bound:.0e})"
            )


NONFINITE_CASES = [
    # (where, value, token): cached tokens 0-219 of request 0 lie in part windows 0-2
    # and the last window (tokens 168-219), token 10 of request 1 in its batch window
    ("key norm", NAN, 5),
    ("key norm", NAN, 100),
    ("key norm", NAN, 200),
    ("key norm", INF, 60),
    ("value scale", NAN, 70),
    ("value scale", INF, 150),
    ("value scale", INF, 210),
    ("short request's key norm", NAN, 10),
    ("short request's key norm", INF, 10),
    ("query", INF, 4),
    ("query", NAN, 14),
    ("chunk key", NAN, 3),
    ("chunk key", INF, 9),
    ("chunk value", INF, 5),
    ("chunk value", NAN, 15),
]


@pytest.mark.parametrize("where,value,token", NONFINITE_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_non_finite_values_propagate_as_in_one_softmax_over_all_keys(
    where, value, token, dtype
):
    seed = 31 + len(where) + token
    # A small query keeps every softmax weight far from underflow, so that inf * weight
    # is inf in every dtype (a weight rounded to 0 would make it NaN, in any attention).
    batch = make_batch(
        REQUESTS, "turboquant_3bit_nc", dtype, num_q_heads=4, num_kv_heads=2, seed=seed
    )
    batch.query.mul_(0.2)
    allowed = poison(batch, where, value, token)
    q, k, v, cache, bt, qsl, lens = batch.args
    out = continuation_prefill_varlen(
        q,
        k,
        v,
        cache,
        bt,
        qsl,
        lens,
        **batch.kwargs,
        window=WINDOW,
        backend=BACKEND,
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
    )
    assert not torch.isfinite(out).all(), f"seed {seed}: the non-finite value vanished"
    check_against_oracle(batch, out, allowed)


def check_a_row_of_minus_inf_scores(path, backend, device, lse_marks=(-INF,)):
    """docs/design.md's third exception: a query of +inf in one element against keys
    that are all negative there (fp8 keys, cached and new) makes every score of that
    row -inf; the oracle's softmax gives NaN, the call 0 and lse -inf, as a row without
    keys (``lse_marks``: the lse values allowed there). Every other element as the
    oracle."""
    seed, cached, q_len = 7, 40, 3
    batch = make_batch(
        [(cached, q_len), (24, 2)], "turboquant_k8v4", seed=seed, device=device
    )
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(cached + q_len, 2, 64, generator=gen)
    key[:, :, 0] = -1.0 - key[:, :, 0].abs()
    key, value = key.to(device), torch.randn(key.shape, generator=gen).to(device)
    bs = batch.kv_cache.shape[1]
    pos = torch.arange(cached + q_len, device=device)
    slots = batch.block_table[0].long()[pos // bs] * bs + pos % bs
    cfg = TQConfig.from_preset("turboquant_k8v4", 64)
    encode_reference(key, value, batch.kv_cache, slots, cfg, batch.kwargs["centroids"])
    batch.key[:q_len] = key[cached:].to(batch.key)
    batch.value[:q_len] = value[cached:].to(batch.value)
    batch.query[q_len - 1, 0] = 0.0
    batch.query[q_len - 1, 0, 0] = INF  # the last token sees every key of request 0
    out, lse = continuation_prefill_varlen(
        *batch.args,
        **batch.kwargs,
        backend=backend,
        path=path,
        return_lse=True,
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
    )
    oracle = oracle_continuation_prefill(*batch.request(0), **batch.kwargs)
    tag = f"seed {seed}, {path}, {backend}"
    assert oracle[q_len - 1, 0].isnan().all(), f"{tag}: the oracle's row"
    assert (out[q_len - 1, 0] == 0).all(), f"{tag}: {out[q_len - 1, 0, :4]}"
    assert lse[0, q_len - 1].item() in lse_marks, f"{tag}: lse {lse[0, q_len - 1]}"
    assert torch.isfinite(lse[1:, q_len - 1]).all(), f"{tag}: the other heads' lse"
    got = out.clone()
    got[q_len - 1, 0] = NAN  # the exception's row, as the oracle has it
    check_against_oracle(batch, got)


@pytest.mark.parametrize("path", ["window", "paged"])
def test_a_row_whose_every_score_is_minus_inf_is_zero_with_lse_minus_inf(path):
    if path == "paged" and not TRITON_OK:
        pytest.skip("the memory-bound path needs Triton (a GPU or the interpreter)")
    check_a_row_of_minus_inf_scores(path, BACKEND, DEVICE)


# --- overlaps and layouts of what the call writes -------------------------------------


@pytest.fixture(scope="module")
def small():
    return make_batch([(100, 20), (0, 9)], seed=22)


def _call(batch, **override):
    names = [
        "query",
        "key",
        "value",
        "kv_cache",
        "block_table",
        "query_start_loc",
        "seq_lens",
    ]
    args = dict(zip(names, batch.args))
    kwargs = dict(
        batch.kwargs,
        backend=BACKEND,
        window=64,
        query_start_loc_cpu=batch.query_start_loc,
        seq_lens_cpu=batch.seq_lens,
    )
    for k, v in override.items():
        (args if k in args else kwargs)[k] = v
    return continuation_prefill_varlen(*args.values(), **kwargs)


def _bits(t):
    """A tensor's contents as bytes (NaN compares equal to itself)."""
    return (
        t.contiguous().view(torch.uint8)
        if t.dtype.is_floating_point and t.numel()
        else t
    )


def _refused(batch, match, **override):
    """A ValueError matching ``match``; nothing read was written, ``out`` untouched."""
    inputs = [
        batch.query,
        batch.key,
        batch.value,
        batch.kv_cache,
        batch.block_table,
        batch.kwargs["rotation"],
        batch.kwargs["centroids"],
    ] + [
        v
        for k, v in override.items()
        if isinstance(v, torch.Tensor) and v.device.type != "meta"
    ]
    before = [_bits(t).clone() for t in inputs]
    with pytest.raises(ValueError, match=match):
        _call(batch, **override)
    for t, b in zip(inputs, before):
        assert torch.equal(_bits(t), b), "a tensor was written"


def _as_bytes_of(t, dtype, shape):
    """A tensor of ``dtype`` and ``shape`` laid over t's first bytes."""
    n = 1
    for s in shape:
        n *= s
    return t.reshape(-1).view(torch.uint8)[: n * dtype.itemsize].view(dtype).view(shape)


@pytest.mark.parametrize(
    "case",
    [
        "workspace over kv_cache",
        "workspace over query",
        "out over kv_cache",
        "out over rotation",
        "out over block_table",
        "lse over out",
        "lse over workspace",
        "out over workspace",
    ],
)
def test_what_the_call_writes_may_not_share_memory_with_what_it_reads_or_writes(
    small, case
):
    n, hq, d = small.query.shape
    ws_bytes = workspace_bytes(n, hq, 2, d, 64)
    ws = torch.zeros(ws_bytes, dtype=torch.uint8, device=DEVICE)
    # the rotation: the top-left corner
    rot16 = small.kwargs["rotation"].half().repeat(8, 8)
    big = torch.zeros(n * hq * d * 4 + ws_bytes, dtype=torch.uint8, device=DEVICE)
    out_big = _as_bytes_of(big, torch.float16, (n, hq, d))

    def inside_big(t):  # a copy of t laid over the first bytes of a large workspace
        x = _as_bytes_of(big, t.dtype, tuple(t.shape))
        x.copy_(t)
        return x

    override, names = {
        "workspace over kv_cache": (
            dict(kv_cache=inside_big(small.kv_cache), workspace=big),
            ("workspace", "kv_cache"),
        ),
        "workspace over query": (
            dict(query=inside_big(small.query), workspace=big),
            ("workspace", "query"),
        ),
        "out over kv_cache": (
            dict(out=_as_bytes_of(small.kv_cache, torch.float16, (n, hq, d))),
            ("out", "kv_cache"),
        ),
        "out over rotation": (
            dict(
                out=_as_bytes_of(rot16, torch.float16, (n, hq, d)),
                rotation=rot16[:d, :d],
            ),
            ("out", "rotation"),
        ),
        "out over block_table": (
            dict(
                out=_as_bytes_of(
                    torch.zeros(n * hq * d, dtype=torch.int32, device=DEVICE),
                    torch.float16,
                    (n, hq, d),
                )
            ),
            None,
        ),
        "lse over out": (
            dict(
                out=out_big,
                lse=_as_bytes_of(big, torch.float32, (hq, n)),
                return_lse=True,
            ),
            ("out", "lse"),
        ),
        "lse over workspace": (
            dict(
                lse=_as_bytes_of(ws, torch.float32, (hq, n)),
                workspace=ws,
                return_lse=True,
            ),
            ("lse", "workspace"),
        ),
        "out over workspace": (
            dict(out=out_big, workspace=big[n * hq * d * 2 - 256 :]),
            ("out", "workspace"),
        ),
    }[case]
    if names is None:  # the block table itself laid under out's bytes
        out = override["out"]
        bt = _as_bytes_of(out, torch.int32, tuple(small.block_table.shape))
        bt.copy_(small.block_table)
        override["block_table"], names = bt, ("out", "block_table")
    _refused(small, f"{names[0]} must not share memory with {names[1]}", **override)


@pytest.mark.parametrize(
    "case", ["out stride 0", "out overlapping rows", "lse stride 0"]
)
def test_written_tensors_must_not_overlap_themselves(small, case):
    n, hq, d = small.query.shape
    if case == "out stride 0":
        out = torch.zeros(1, hq, d, dtype=torch.float16, device=DEVICE)
        override = dict(out=out.expand(n, hq, d))
    elif case == "out overlapping rows":
        base = torch.zeros(n * d + hq * d, dtype=torch.float16, device=DEVICE)
        # token t, head h+1 = token t+1, head h
        override = dict(out=base.as_strided((n, hq, d), (d, d, 1)))
    else:
        override = dict(
            lse=torch.zeros(1, n, device=DEVICE).expand(hq, n), return_lse=True
        )
    name = "lse" if "lse" in case else "out"
    _refused(small, f"{name} must not have elements that share memory", **override)


# --- every bad argument is a ValueError naming it -------------------------------------


@pytest.mark.parametrize(
    "override,match",
    [
        (lambda b: dict(backend=["flash"]), "backend must be one of"),
        (lambda b: dict(backend=None), "backend must be one of"),
        (lambda b: dict(preset=["turboquant_3bit_nc"]), "preset must be"),
        (
            lambda b: dict(
                seq_lens_cpu=None,
                seq_lens=torch.tensor([120, 9], dtype=torch.int32, device="meta"),
            ),
            "seq_lens must be on",
        ),
        (
            lambda b: dict(seq_lens_cpu=[120, 2**31 + 5]),
            r"seq_lens_cpu\[1\] must be in \[0, 2\*\*31\)",
        ),
        (
            lambda b: dict(query_start_loc_cpu=[0, 20, -3]),
            r"query_start_loc_cpu\[2\] must be in",
        ),
        (
            lambda b: dict(block_table=torch.cat([b.block_table, b.block_table[:1]])),
            r"block_table must have one row per request \(2",
        ),
        (
            lambda b: dict(key=b.key[:, :1], value=b.value[:, :1]),
            r"key must have shape \(29, 2, 64\)",
        ),
        (
            lambda b: dict(centroids=None),
            "centroids is required for preset turboquant_3bit_nc",
        ),
        (
            lambda b: dict(rotation=None),
            "rotation is required for preset turboquant_3bit_nc",
        ),
        (
            lambda b: dict(
                key=torch.empty(29, 2, 64, dtype=torch.float16, device="meta")
            ),
            "key must be on",
        ),
        (
            lambda b: dict(
                query_start_loc=torch.tensor(
                    [0, 20, 29], dtype=torch.int64, device=DEVICE
                )
            ),
            "query_start_loc must have dtype",
        ),
        (
            lambda b: dict(seq_lens_cpu=np.array([120.0, 9.0])),
            "seq_lens_cpu must be a 1-D integer array",
        ),
        (lambda b: dict(check_block_table="yes"), "check_block_table must be a bool"),
        (
            lambda b: dict(
                lse=torch.zeros(4, 29, dtype=torch.float16, device=DEVICE),
                return_lse=True,
            ),
            "lse must have dtype",
        ),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_arguments_are_value_errors_naming_the_argument(small, override, match):
    _refused(small, match, **override(small))


def test_numpy_arrays_are_host_copies_like_tensors_and_lists(small):
    ref = _call(small)
    out = _call(
        small,
        query_start_loc_cpu=np.array(small.query_start_loc, dtype=np.int32),
        seq_lens_cpu=np.array(small.seq_lens, dtype=np.int64),
    )
    assert torch.equal(out, ref)


def test_a_given_lse_is_written_and_returned(small):
    n, hq, _ = small.query.shape
    lse = torch.full((hq, n), NAN, device=DEVICE)
    out, got = _call(small, lse=lse, return_lse=True)
    assert got is lse and torch.isfinite(lse).all()
    _, ref = _call(small, return_lse=True)
    assert torch.equal(lse, ref)


def _first_bad_request(qsl, seq_lens, block_size, max_blocks):
    """The reference of prefill._check_lengths past its first entry: the first request
    whose lengths are refused, and why (None: none is)."""
    for r, s in enumerate(seq_lens):
        q = qsl[r + 1] - qsl[r]
        if q < 0:
            return r, "non-decreasing"
        if s < q:
            return r, "at least the request's query"
        if q and -(-(s - q) // block_size) > max_blocks:
            return r, "more cached blocks"
    return None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-3, 40), st.integers(0, 120)), max_size=10),
    st.sampled_from([1, 16]),
    st.integers(0, 6),
)
def test_the_lengths_check_refuses_exactly_the_first_bad_request(reqs, bs, max_blocks):
    """prefill._check_lengths (every request at once, the loop only to name the first
    bad one) against the plain loop: the same request refused for the same reason,
    or none; requests without query tokens are not held to the block table."""
    qsl, lens = [0], []
    for q, s in reqs:
        qsl.append(qsl[-1] + q)
        lens.append(s)
    bad = _first_bad_request(qsl, lens, bs, max_blocks)
    names = ("query_start_loc", "seq_lens[{r}]")
    if bad is None:
        prefill._check_lengths(qsl, lens, bs, max_blocks, names)
        return
    r, why = bad
    with pytest.raises(ValueError, match=why) as e:
        prefill._check_lengths(qsl, lens, bs, max_blocks, names)
    assert f"request {r}" in str(e.value) or f"seq_lens[{r}]" in str(e.value)


# --- bad input drawn at random --------------------------------------------------------

ARGUMENT_NAMES = (
    "query",
    "key",
    "value",
    "kv_cache",
    "block_table",
    "query_start_loc",
    "seq_lens",
    "query_start_loc_cpu",
    "seq_lens_cpu",
    "preset",
    "centroids",
    "rotation",
    "scale",
    "window",
    "workspace",
    "backend",
    "out",
    "lse",
    "max_workspace_bytes",
    "check_block_table",
)

MUTATIONS = {
    # name: function (batch, draw) -> overrides; draw(n) picks an int in [0, n)
    "query dtype": lambda b, r: dict(query=b.query.float()),
    "key shape": lambda b, r: dict(key=b.key[:, :, :32]),
    "value tokens": lambda b, r: dict(value=b.value[: -1 - r(3)]),
    "kv_cache slot": lambda b, r: dict(kv_cache=b.kv_cache[..., :-2]),
    "kv_cache stride": lambda b, r: dict(
        kv_cache=b.kv_cache.transpose(0, 3).contiguous().transpose(0, 3)
    ),
    "block_table dtype": lambda b, r: dict(block_table=b.block_table.long()),
    "block_table rows": lambda b, r: dict(block_table=b.block_table[:1]),
    "block_table strided": lambda b, r: dict(block_table=strided(b.block_table, r(2))),
    "query strided": lambda b, r: dict(query=strided(b.query, r(3))),
    "lengths": lambda b, r: dict(
        seq_lens_cpu=[s + (r(3) - 1) * 50 for s in b.seq_lens]
    ),
    "query_start_loc": lambda b, r: dict(
        query_start_loc_cpu=[0, 20 + r(5) - 2, 29 + r(3) - 1]
    ),
    "centroids": lambda b, r: dict(centroids=b.kwargs["centroids"][: 4 + r(4)]),
    "rotation": lambda b, r: dict(rotation=b.kwargs["rotation"][:, : r(64)]),
    "rotation fp16 strided": lambda b, r: dict(rotation=b.kwargs["rotation"].half().T),
    "scale": lambda b, r: dict(scale=[0.0, -1.0, INF, NAN, 0.125][r(5)]),
    "window": lambda b, r: dict(window=[0, -4, 1, 7, 10**9][r(5)]),
    "out stride 0": lambda b, r: dict(
        out=torch.zeros(1, 4, 64, dtype=b.query.dtype, device=DEVICE).expand(29, 4, 64)
    ),
    "out over query": lambda b, r: dict(out=b.query),
    "out over key": lambda b, r: _out_over_key(b),
    "workspace small": lambda b, r: dict(
        workspace=torch.zeros(100, dtype=torch.uint8, device=DEVICE)
    ),
    "workspace over kv_cache": lambda b, r: dict(workspace=b.kv_cache.reshape(-1)),
    "cache NaN": lambda b, r: dict(poison=("key norm", [NAN, INF][r(2)], r(100))),
    "query inf": lambda b, r: dict(poison=("query", [NAN, INF][r(2)], r(20))),
    "chunk NaN": lambda b, r: dict(poison=("chunk value", [NAN, INF][r(2)], r(20))),
    "bad block id": lambda b, r: dict(bad_block=[-1, 10**6][r(2)]),
}


def _out_over_key(batch):
    """The key and out laid over the same bytes."""
    buf = torch.zeros(29 * 4 * 64, dtype=batch.key.dtype, device=DEVICE)
    key = buf[: 29 * 2 * 64].view(29, 2, 64)
    key.copy_(batch.key)
    return dict(key=key, out=buf.view(29, 4, 64))


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    names=st.lists(
        st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=2, unique=True
    ),
    picks=st.lists(st.integers(0, 2**16), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_random_bad_input_is_refused_by_name_or_answered_as_the_oracle(
    names, picks, seed
):
    batch = make_batch([(100, 20), (0, 9)], seed=seed)
    draws = iter(picks)
    r = lambda k: next(draws) % k
    override = {}
    for name in names:
        override.update(MUTATIONS[name](batch, r))
    where = override.pop("poison", None)
    allowed = poison(batch, *where) if where is not None else None
    bad_block = override.pop("bad_block", None)
    if bad_block is not None:
        batch.block_table[0, 2] = bad_block
    out = override.pop("out", None)
    if out is None:
        out = torch.full_like(batch.query, NAN)
    inputs = [
        batch.query,
        batch.key,
        batch.value,
        batch.kv_cache,
        batch.block_table,
        batch.kwargs["rotation"],
        batch.kwargs["centroids"],
    ] + [v for v in override.values() if isinstance(v, torch.Tensor)]
    before = [_bits(t).clone() for t in inputs]
    out_before = _bits(out).clone()
    try:
        res = _call(batch, out=out, **override)
    except ValueError as e:
        named = [a for a in ARGUMENT_NAMES if a in str(e)]
        assert named, f"seed {seed}, {names}: the error names no argument: {e}"
        assert torch.equal(_bits(out), out_before), f"seed {seed}, {names}: out written"
    else:
        assert res is out
        # the answer to what was asked: the lengths given, the rotation given
        batch.query_start_loc = list(
            override.get("query_start_loc_cpu", batch.query_start_loc)
        )
        batch.seq_lens = list(override.get("seq_lens_cpu", batch.seq_lens))
        batch.kwargs.update(
            {k: override[k] for k in ("rotation", "scale") if k in override}
        )
        # an fp16 rotation: a looser bound
        check_against_oracle(batch, out, allowed, bound=6e-3)
    for t, b in zip(inputs, before):
        if t is not out:
            assert torch.equal(_bits(t), b), (
                f"seed {seed}, {names}: an input was written"
            )
