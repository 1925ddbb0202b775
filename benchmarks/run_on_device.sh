#!/usr/bin/env bash
# What ran on the H200 machine for the figures in benchmarks/NOTES.md, in calls that each fit
# under the machine's 10-minute limit (the carries are built by ../shared/gpu/make-vllm-carry.sh):
#   bash benchmarks/run_on_device.sh suite     # carry .gpu-carry: the GPU suite
#   bash benchmarks/run_on_device.sh kernels   # carry .gpu-carry: fill bandwidth, stage breakdown, host profile
#   bash benchmarks/run_on_device.sh checks    # carry .gpu-carry: soak, sanitizers
#   bash benchmarks/run_on_device.sh serving   # carry .gpu-carry: serving grid with the floor
#   bash benchmarks/run_on_device.sh stack     # carry .gpu-carry: single requests with the floor
#   bash benchmarks/run_on_device.sh forward   # carry .gpu-carry, .gpu-carry-0.21.0 (0.26.0 likewise)
# serving and stack compare with vLLM 0.33.0's methods run in the carry's vLLM 0.20.0
# (tq-chunked bench --baseline-source): BASELINE_SOURCE, by default the 0.33.0
# turboquant_attn.py that make-vllm-carry.sh puts in the carry.
# Modes can be joined: bash benchmarks/run_on_device.sh suite kernels. Logs, JSON, Markdown and
# plots land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
BASELINE_SOURCE=${BASELINE_SOURCE:-.gpu-carry/latest/turboquant_attn.py}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
carry() { (source "$1/setup.sh" >/dev/null && shift && "$@"); }
[ $# -gt 0 ] || { echo "usage: $0 suite|kernels|checks|serving|stack|forward ..." >&2; exit 2; }
for mode in "$@"; do
  case "$mode" in
    suite)
      # every gpu-marked test but the 1M and 128K cases, which would not fit the call
      # (4 minutes without them); test_docs.py needs Sybil, which the image lacks
      carry .gpu-carry timeout 420 python3 -m pytest -q -m gpu tests -p no:cacheprovider \
        --ignore=tests/test_docs.py -k "not one_million and not 131072" -rfEs 2>&1 \
        | tee "$OUT/gpu-tests.log" | grep -E "MiB|1M|passed|failed|Error|assert|cuda" | tail -25 ;;
    kernels)
      carry .gpu-carry timeout 150 python3 benchmarks/fill_bandwidth.py "$OUT" 2>&1 | tail -3
      carry .gpu-carry timeout 100 python3 benchmarks/breakdown.py 2>&1 | tee "$OUT/breakdown.md" | tail -8
      carry .gpu-carry timeout 80 python3 benchmarks/host_profile.py 2>&1 | tee "$OUT/host-profile.txt" \
        | grep -E "==|us$" ;;
    checks)
      carry .gpu-carry timeout 300 python3 benchmarks/soak.py 300 2>&1 | tee "$OUT/soak.log" | tail -3
      carry .gpu-carry timeout 60 compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py 2>&1 \
        | tee "$OUT/sanitizer-memcheck.log" | tail -2
      carry .gpu-carry timeout 60 compute-sanitizer --tool racecheck python3 benchmarks/sanitize.py 2>&1 \
        | tee "$OUT/sanitizer-racecheck.log" | tail -2 ;;
    serving|stack)
      carry .gpu-carry timeout 420 python3 -m tq_chunked.bench --"$mode" --repeats 3 \
        --baseline-source "$BASELINE_SOURCE" --methods baseline,floor,tq_chunked \
        --out "$OUT" 2>&1 | grep -E "^\||geomean|error|Error|wrote" | tail -40 ;;
    forward)
      for c in .gpu-carry .gpu-carry-0.21.0 .gpu-carry-0.26.0; do
        [ -d "$c" ] && carry "$c" timeout 90 python3 benchmarks/vllm_forward.py "$OUT" 2>&1 | grep -v "^INFO\|^WARNING"
      done ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
done
