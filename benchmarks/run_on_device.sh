#!/usr/bin/env bash
# What ran on the H200 machine for the figures in benchmarks/NOTES.md, in calls that each fit
# under the machine's 10-minute limit (the carries are built by ../shared/gpu/make-vllm-carry.sh):
#   bash benchmarks/run_on_device.sh checks    # carry .gpu-carry: GPU suite, soak, sanitizer
#   bash benchmarks/run_on_device.sh forward   # carry .gpu-carry, .gpu-carry-0.21.0 (0.26.0 likewise)
#   bash benchmarks/run_on_device.sh stack     # carry .gpu-carry: layer stacks, stage breakdown
#   bash benchmarks/run_on_device.sh serving   # carry .gpu-carry: serving batches
#   bash benchmarks/run_on_device.sh crossover # carry .gpu-carry: short continuations, host profile
#   bash benchmarks/run_on_device.sh grid      # carry .gpu-carry: the rest of the single-request grid
#   bash benchmarks/run_on_device.sh bigq      # carry .gpu-carry: stages of long queries, by workspace budget
# Logs, JSON, Markdown and plots land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
carry() { (source "$1/setup.sh" >/dev/null && shift && "$@"); }
case "${1:-}" in
  checks)
    carry .gpu-carry timeout 200 python3 -m pytest -q -s -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu-tests.log" | grep -E "MiB|1M|passed|failed|Error|assert" | tail -12
    carry .gpu-carry timeout 300 python3 benchmarks/soak.py 300 2>&1 | tee "$OUT/soak.log" | tail -3
    carry .gpu-carry timeout 40 compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py 2>&1 \
      | tee "$OUT/sanitizer-memcheck.log" | tail -1
    carry .gpu-carry timeout 40 compute-sanitizer --tool racecheck python3 benchmarks/sanitize.py 2>&1 \
      | tee "$OUT/sanitizer-racecheck.log" | tail -1 ;;
  forward)
    for c in .gpu-carry .gpu-carry-0.21.0 .gpu-carry-0.26.0; do
      [ -d "$c" ] && carry "$c" timeout 90 python3 benchmarks/vllm_forward.py "$OUT" 2>&1 | grep -v "^INFO\|^WARNING"
    done ;;
  stack)
    carry .gpu-carry timeout 240 python3 -m tq_chunked.bench --stack --repeats 3 --methods latest,tq_chunked \
      --out "$OUT" 2>&1 | grep "^|"
    carry .gpu-carry timeout 120 python3 benchmarks/breakdown.py 2>&1 | tee "$OUT/breakdown.md" ;;
  serving)
    carry .gpu-carry timeout 240 python3 -m tq_chunked.bench --serving --repeats 3 --methods latest,vllm,patched \
      --out "$OUT" 2>&1 | grep "^|" ;;
  crossover)
    carry .gpu-carry timeout 240 python3 -m tq_chunked.bench --crossover --repeats 3 --methods latest,tq_chunked \
      --out "$OUT" 2>&1 | grep "^|"
    carry .gpu-carry timeout 120 python3 benchmarks/host_profile.py 2>&1 | tee "$OUT/host-profile.txt" | grep "==" ;;
  grid)
    carry .gpu-carry timeout 540 python3 benchmarks/stack_grid.py "$OUT" --parts q,presets,d256 2>&1 | grep -E "^grid-|Error" ;;
  bigq)
    for sq in llama3-8b:8192 70b-tp1:8192 d256:8192 d256:2048; do
      carry .gpu-carry timeout 60 python3 benchmarks/breakdown.py --shape "${sq%:*}" --q-len "${sq#*:}" \
        --cached-lens 8192 --windows "" --presets turboquant_3bit_nc --budgets-mib 128,512 2>&1 | grep -E "^\||^[a-z0-9-]+ \(|Error"
    done | tee "$OUT/bigq.md" ;;
  *) echo "usage: $0 checks|forward|stack|serving|crossover|grid|bigq" >&2; exit 2 ;;
esac
