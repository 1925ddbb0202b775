"""The window fill compiled for the H200 (sm_90) on a machine without a GPU: registers,
shared memory, and the SASS instructions per cache slot, by kind (no device time).

    python benchmarks/sass_report.py [--preset P] [--head-dim D] [--kv-heads H]
        [--chunk] [--config SLOTS,COLUMNS,WARPS[,SPLIT[,SYLVESTER]]]
        [--sass FILE]
    python benchmarks/sass_report.py --grid [--kv-heads H] [--dump DIR]
    python benchmarks/sass_report.py --fused ROWS,POSITIONS,WARPS [--preset P]
        [--head-dim D] [--group G]
    python benchmarks/sass_report.py --paged ROWS,POSITIONS,WARPS [--preset P]
        [--head-dim D] [--group G] [--q-len Q] [--dtype float16|bfloat16]
        [--q-split 0|1] [--prefetch TILES] [--loads-first 0|1] [--gather]
        [--no-fence] [--max-registers R] [--block-size B] [--sass FILE]

With --fused, the fused kernel (tq_chunked/experimental/fused.py, one request of 16
query tokens, G query heads per kv head) at that launch: registers, shared memory, and
its main loop's SASS instructions x warps / positions per iteration = warp
instructions per decoded slot-row (a tile of ROWS rows decodes each slot once;
benchmarks/NOTES.md §27).

With --paged, the memory-bound path's attention kernel
(tq_chunked/runtime/paged.py, one request of Q query tokens, default 1: decode, G
query heads per kv head) at that launch, the same way: its hot loop's SASS instructions
x warps / positions = warp instructions per decoded slot-row (the tile holds all Q x G
rows of the kv head, so each slot-row is decoded once; the exact loop for non-finite
value fields, run only when one is seen, is reported apart; benchmarks/NOTES.md §32).

The fill's arguments are the ones ``fill_window`` passes for the case (recorded from a
call on CPU tensors, the launch itself replaced), compiled by Triton for sm_90 with the
specialization a CUDA launch would get (16-byte aligned tensors, ints by value class).
Instructions per slot = the kernel's SASS instructions x warps / slots per program:
besides the segment search's few iterations the fill is straight-line code, so this
static count is near what a warp issues, with both branches of the rotation counted
(the H200 machine's profiler counted 154 warp instructions per slot for 3bit_nc at D
128 with 0.4.0's fill, where this count gives 192: benchmarks/NOTES.md §20). With a
split config the two programs' branches are counted together. Needs the Triton release
of the H200 machine for comparable figures (3.6.0 there).

With --grid, every preset at D 64, 128 and 256, one request's window and a batch
window, at FILL's configuration: registers, stack, spill instructions, shared memory,
the SASS instructions and a hash of their text, so that two versions of the fill can
be compared (benchmarks/NOTES.md §34); --dump writes each case's SASS.
"""

import argparse
import collections
import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import tq_chunked.runtime.dequant as dq
import tq_chunked.runtime.paged as pg
from tq_chunked.runtime._utils import mma_sync_only
from tq_chunked.runtime.format import PRESETS, TQConfig, hadamard, lloyd_max_centroids
from tq_chunked.runtime.plan import windows
from tq_chunked.tools.reference import cached_window


def record_fill(preset, d, hk, chunk, config):
    """(kernel, grid, args, options) of the fill launch for the case."""
    seen = {}

    class Recorder:
        def __call__(self, grid, *args, **options):
            seen.update(grid=grid, args=args, options=options)

    cfg = TQConfig.from_preset(preset, d)
    cache = torch.zeros(64, 16, hk, cfg.slot_bytes, dtype=torch.uint8)
    bt = torch.arange(64, dtype=torch.int32)[None]
    k = torch.zeros(512, hk, d, dtype=torch.float16)
    v = torch.zeros_like(k)
    if chunk:  # a batch window: two requests with new tokens
        w = windows((0, 16, 32), (100, 116), 1024, torch.device("cpu"))[0]
        bt = bt.repeat(2, 1)
    else:
        w = cached_window(0, 0, 512, torch.device("cpu"))
    rot = None if cfg.key_fp8 else hadamard(d)  # fp8 keys: any multiple of 8
    parts = None if cfg.key_fp8 else dq.split_rotation(rot)  # on the CPU, here
    saved = dq.launch_fill, dq.interpreting, dq.use_triton
    dq.launch_fill, dq.interpreting = Recorder(), lambda: False
    dq.use_triton = lambda t: True
    try:
        dq.fill_window(
            cache,
            bt,
            cfg,
            lloyd_max_centroids(d, cfg.centroid_bits),
            rot,
            k,
            v,
            w,
            0,
            k,
            v,
            err=torch.zeros(1, dtype=torch.int64),
            config=config,
            parts=parts,
        )
    finally:
        dq.launch_fill, dq.interpreting, dq.use_triton = saved
    return dq._fill_kernel, seen["grid"], seen["args"], seen["options"]


_TYPES = {
    torch.uint8: "*u8",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
}


def compile_sm90(kernel, args, options):
    """Triton's compile of ``kernel`` for sm_90 with these arguments' specialization."""
    signature, constexprs, attrs = {}, {}, {}
    for i, (p, a) in enumerate(zip(kernel.params, args)):
        name = p.name
        if p.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = a
        elif isinstance(a, torch.Tensor):
            signature[name] = _TYPES[a.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(a, bool):
            signature[name] = "i1"
        elif isinstance(a, int):
            signature[name] = "i32" if -(2**31) <= a < 2**31 else "i64"
            if not p.do_not_specialize:
                if a == 1:
                    signature[name] = "constexpr"
                    constexprs[name] = 1
                elif a % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    # on the device: no float64 dots, bf16 rounding by the hardware
    for name in ("DOT_F64", "ROUND_BF16"):
        if name in constexprs:
            constexprs[name] = False
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_of(cubin: bytes) -> str:
    tool = os.path.join(
        os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run(
            [tool, "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
        res = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return sass, res


def record_fused(preset, d, group, launch):
    """(kernel, args, options) of ``fused.cached_attention``'s launch for one request
    of 16 query tokens over 600 cached, at launch (rows, positions, warps)."""
    import tq_chunked.experimental.fused as fz
    from tq_chunked.tools.testing import make_batch

    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.update(args=args, kw=kw)

    b = make_batch(
        [(600, 16)],
        preset,
        head_dim=d,
        num_q_heads=2 * group,
        num_kv_heads=2,
        rotation="hadamard",
        seed=0,
    )
    qsl = b.query_start_loc
    saved = fz._cached_attention_kernel, fz.interpreting, torch.Tensor.is_cuda
    fz._cached_attention_kernel, fz.interpreting = Recorder(), lambda: False
    torch.Tensor.is_cuda = property(lambda self: True)  # the GPU's defaults
    try:
        fz.cached_attention(
            b.query,
            b.kv_cache,
            b.block_table,
            qsl,
            [600],
            **b.kwargs,
            splits=1,
            block_m=launch[0],
            block_n=launch[1],
            num_warps=launch[2],
        )
    finally:
        fz._cached_attention_kernel, fz.interpreting, torch.Tensor.is_cuda = saved
    kernel = fz._cached_attention_kernel
    kw = dict(seen["kw"])
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    args = list(seen["args"]) + [
        kw.pop(p.name) for p in kernel.params[len(seen["args"]) :]
    ]
    args[[p.name for p in kernel.params].index("DOT_F32")] = False
    return kernel, args, options


def record_paged(
    preset,
    d,
    group,
    launch,
    q_len,
    dtype,
    q_split,
    block_size,
    lookup=True,
    fence=True,
    max_registers=None,
    prefetch=None,
    loads_first=None,
):
    """(kernel, args, options) of ``paged_attention``'s attention launch for one
    request of ``q_len`` query tokens over 600 cached, at launch (rows, positions,
    warps), with the arguments a CUDA call passes."""
    from tq_chunked.tools.testing import make_batch

    seen = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, *args, **options):
            seen[self.name] = (args, options)

    b = make_batch(
        [(600, q_len)],
        preset,
        getattr(torch, dtype),
        head_dim=d,
        num_q_heads=2 * group,
        num_kv_heads=2,
        block_size=block_size,
        rotation="hadamard",
        seed=0,
    )
    cfg = TQConfig.from_preset(preset, d)
    plan = pg.plan_paged(
        b.query_start_loc,
        b.seq_lens,
        2 * group,
        2,
        d,
        cfg,
        block_m=launch[0],
        block_n=launch[1],
        num_warps=launch[2],
        split_len=600,
        interpret=False,
        max_registers=max_registers,
        own_keys=False,  # the cached part's launches alone
        loads_first=loads_first,
    )
    work, tokens = plan.upload("cpu")
    scratch = plan.carve(torch.zeros(plan.scratch_bytes, dtype=torch.uint8))
    saved = pg.launch_rotate, pg.launch_paged, pg.launch_combine
    pg.launch_rotate, pg.launch_paged, pg.launch_combine = (
        Recorder("rotate"),
        Recorder("paged"),
        Recorder("combine"),
    )
    try:
        pg.paged_attention(
            b.query,
            b.kv_cache,
            b.block_table,
            plan,
            work,
            tokens,
            scratch,
            torch.empty_like(b.query),
            cfg=cfg,
            centroids=b.kwargs["centroids"],
            rotation=b.kwargs["rotation"],
            scale=b.kwargs["scale"],
            q_split=q_split,
        )
    finally:
        pg.launch_rotate, pg.launch_paged, pg.launch_combine = saved
    args, options = seen["paged"]
    args = list(args)
    names = [p.name for p in pg._paged_kernel.params]
    args[names.index("DOT_F32")] = False  # what a CUDA call passes
    args[names.index("LOOKUP")] = lookup and cfg.key_bits in (3, 4)
    args[names.index("FENCE")] = fence
    # what a CUDA call passes: the plan's tiles ahead, unless asked
    args[names.index("PREFETCH")] = plan.prefetch if prefetch is None else prefetch
    return pg._paged_kernel, args, options


def loops(sass: str):
    """Each loop of the SASS, in address order: (first address, last address,
    mnemonics), from a backward branch's target to the branch (nested loops apart)."""
    rows = []
    for line in sass.splitlines():
        m = re.match(
            r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(.*)", line
        )
        if m:
            rows.append((int(m.group(1), 16), m.group(2), m.group(3)))
    spans = []
    for addr, op, rest in rows:
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr:
            spans.append((int(t.group(1), 16), addr))
    return [
        (lo, hi, [op.split(".")[0] for a, op, _ in rows if lo <= a <= hi])
        for lo, hi in sorted(spans)
    ]


def loop_body(sass: str):
    """The SASS instructions (mnemonics) of the largest loop: from a backward branch's
    target to the branch."""
    rows = []
    for line in sass.splitlines():
        m = re.match(
            r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(.*)", line
        )
        if m:
            rows.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for addr, op, rest in rows:
        t = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if t and int(t.group(1), 16) < addr:
            loops.append((int(t.group(1), 16), addr))
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    return [op.split(".")[0] for addr, op, _ in rows if lo <= addr <= hi]


def main_fused(a):
    launch = tuple(int(x) for x in a.fused.split(","))
    kernel, args, options = record_fused(a.preset, a.head_dim, a.group, launch)
    ck = compile_sm90(kernel, args, options)
    sass, res = sass_of(ck.asm["cubin"])
    body = loop_body(sass)
    regs = re.search(r"REG:(\d+)", res)
    ops = collections.Counter(body)
    print(
        f"fused {a.preset} D {a.head_dim} G {a.group} launch {launch}: "
        f"{regs.group(1) if regs else '?'} registers, {ck.metadata.shared} B shared, "
        f"wgmma {'wgmma' in ck.asm['ptx']}; loop {len(body)} SASS instructions x "
        f"{launch[2]} warps / {launch[1]} positions = "
        f"{len(body) * launch[2] / launch[1]:.0f} warp instructions per slot-row"
    )
    print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(24)))


def main_paged(a):
    launch = tuple(int(x) for x in a.paged.split(","))
    kernel, args, options = record_paged(
        a.preset,
        a.head_dim,
        a.group,
        launch,
        a.q_len,
        a.dtype,
        None if a.q_split is None else bool(a.q_split),
        a.block_size,
        not a.gather,
        not a.no_fence,
        a.max_registers,
        a.prefetch,
        None if a.loads_first is None else bool(a.loads_first),
    )
    # as launch_paged compiles it: mma.sync where it asks for it (NOTES.md §63)
    with mma_sync_only() if pg.launch_paged.mma_sync else contextlib.nullcontext():
        ck = compile_sm90(kernel, args, options)
    sass, res = sass_of(ck.asm["cubin"])
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(sass)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    arg = lambda name: args[[p.name for p in kernel.params].index(name)]
    found = [x for x in loops(sass) if len(x[2]) > 50]  # the two split loops
    hot = found[0][2]
    ops = collections.Counter(hot)
    per = len(hot) * launch[2] / launch[1]
    # barriers (BAR.SYNC: a program's warps wait for each other) and spills (local
    # memory) in the hot loop, per iteration
    bars = ops["BAR"]
    spills = ops["LDL"] + ops["STL"]
    print(
        f"paged {a.preset} D {a.head_dim} G {a.group} q {a.q_len} {a.dtype} "
        f"q_split {arg('Q_SPLIT')} lookup {not a.gather} fence {not a.no_fence} "
        f"prefetch {arg('PREFETCH')} loads_first {arg('LOADS_FIRST')} "
        f"maxnreg {options.get('maxnreg')} block_size "
        f"{a.block_size} launch {launch}: "
        f"{regs.group(1) if regs else '?'} registers, "
        f"{stack.group(1) if stack else '?'} B stack, {ck.metadata.shared} B shared, "
        f"wgmma {'wgmma' in ck.asm['ptx']}; hot loop {len(hot)} SASS instructions x "
        f"{launch[2]} warps / {launch[1]} positions = {per:.1f} warp instructions "
        f"per slot-row; {bars} barriers and {spills} spill instructions an iteration"
        + (f" (exact loop: {len(found[1][2])})" if len(found) > 1 else "")
    )
    print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(30)))


def sass_lines(sass: str):
    """The SASS instructions as text, without addresses and encodings: two compiles
    of the same code give the same lines."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            out.append(m.group(1))
    return out


GRID_DIMS = (64, 128, 256)


def main_grid(a):
    """Every preset at D 64, 128 and 256, one request's window and a batch window, at
    FILL's configuration: registers, stack (spilled registers), shared memory, the
    local-memory instructions (spills), the SASS instructions and a hash of their text
    (equal hashes: the same instructions in the same order)."""
    print(
        "| preset | D | window | registers | stack B | STL+LDL | shared B "
        "| SASS instructions | per slot | SASS sha1 |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    for preset in PRESETS:
        for d in GRID_DIMS:
            for chunk in (False, True):
                kernel, grid, args, options = record_fill(
                    preset, d, a.kv_heads, chunk, None
                )
                ck = compile_sm90(kernel, args, options)
                sass, res = sass_of(ck.asm["cubin"])
                lines = sass_lines(sass)
                window = "batch" if chunk else "one request"
                if a.dump:
                    os.makedirs(a.dump, exist_ok=True)
                    name = f"{preset}-d{d}-{window.replace(' ', '-')}.sass"
                    with open(os.path.join(a.dump, name), "w") as f:
                        f.write("\n".join(lines) + "\n")
                names = [p.name for p in kernel.params]
                slots = args[names.index("BLOCK_T")] * args[names.index("HEADS")]
                warps = options.get("num_warps", 4)
                regs = re.search(r"REG:(\d+)", res).group(1)
                stack = re.search(r"STACK:(\d+)", res).group(1)
                local = sum(
                    re.match(r"(?:@!?U?P\w+\s+)?(STL|LDL)\b", op) is not None
                    for op in lines
                )
                sha = hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12]
                print(
                    f"| {preset} | {d} | {window} | {regs} | {stack} | {local} | "
                    f"{ck.metadata.shared} | {len(lines)} | "
                    f"{len(lines) * warps / slots:.0f} | {sha} |",
                    flush=True,
                )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="turboquant_3bit_nc")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--chunk", action="store_true")
    ap.add_argument("--config", default=None)
    ap.add_argument("--sass", default=None, help="write the SASS here")
    ap.add_argument("--fused", default=None, help="ROWS,POSITIONS,WARPS")
    ap.add_argument("--group", type=int, default=4, help="--fused, --paged: Hq / Hk")
    ap.add_argument("--paged", default=None, help="ROWS,POSITIONS,WARPS")
    ap.add_argument("--q-len", type=int, default=1, help="--paged: query tokens")
    ap.add_argument("--dtype", default="float16", help="--paged: the query's")
    ap.add_argument(
        "--q-split",
        type=int,
        default=None,
        help="--paged: 1 two key dots (hi + lo), 0 one (default: "
        "paged.q_split_by_default)",
    )
    ap.add_argument(
        "--loads-first",
        type=int,
        default=None,
        help="--paged: PagedPlan.loads_first (default: the plan's)",
    )
    ap.add_argument("--block-size", type=int, default=16, help="--paged")
    ap.add_argument(
        "--gather", action="store_true", help="--paged: 3- and 4-bit keys gathered"
    )
    ap.add_argument(
        "--no-fence", action="store_true", help="--paged: Triton's own MMA fragments"
    )
    ap.add_argument(
        "--prefetch",
        type=int,
        default=None,
        help="--paged: the slots this many tiles ahead into L2 (0: none; default "
        "PagedPlan.prefetch)",
    )
    ap.add_argument(
        "--max-registers",
        type=int,
        default=None,
        help="--paged: maxnreg (0: Triton's count; default paged.register_cap)",
    )
    ap.add_argument(
        "--grid",
        action="store_true",
        help="every preset at D 64/128/256, both windows, FILL's configuration",
    )
    ap.add_argument("--dump", default=None, help="--grid: each case's SASS here")
    a = ap.parse_args()
    if a.grid:
        return main_grid(a)
    if a.fused:
        return main_fused(a)
    if a.paged:
        return main_paged(a)
    config = None
    if a.config:
        v = [int(x) for x in a.config.split(",")]
        config = dq.FillLaunch(*v[:3], *(bool(x) for x in v[3:]))
    kernel, grid, args, options = record_fill(
        a.preset, a.head_dim, a.kv_heads, a.chunk, config
    )
    ck = compile_sm90(kernel, args, options)
    sass, res = sass_of(ck.asm["cubin"])
    if a.sass:
        with open(a.sass, "w") as f:
            f.write(sass)
    ops = collections.Counter()
    for line in sass.splitlines():
        # every instruction's address: four hex digits or more
        addr = r"\s*/\*[0-9a-f]{4,}\*/\s+"
        m = re.match(addr + r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    total = sum(ops.values())
    warps = options.get("num_warps", 4)
    names = [p.name for p in kernel.params]
    slots = args[names.index("BLOCK_T")] * args[names.index("HEADS")]
    regs = re.search(r"REG:(\d+)", res)
    print(
        f"{a.preset} D {a.head_dim} Hk {a.kv_heads} chunk {a.chunk} config {config}: "
        f"{regs.group(1) if regs else '?'} registers, {ck.metadata.shared} B shared, "
        f"{total} SASS instructions x {warps} warps / {slots} slots = "
        f"{total * warps / slots:.0f} warp instructions per slot"
    )
    print("  " + ", ".join(f"{k} {v}" for k, v in ops.most_common(24)))


if __name__ == "__main__":
    sys.exit(main())
