#!/usr/bin/env bash
# What ran on the H200 machine for the figures in benchmarks/NOTES.md, in two calls (each
# under the machine's 10-minute limit; the carries are built by ../shared/gpu/make-vllm-carry.sh):
#   bash benchmarks/run_on_device.sh checks   # carry .gpu-carry, .gpu-carry-0.21.0
#   bash benchmarks/run_on_device.sh bench    # carry .gpu-carry, .gpu-carry-0.26.0
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
    carry .gpu-carry timeout 150 python3 benchmarks/soak.py 300 2>&1 | tee "$OUT/soak.log" | tail -3
    carry .gpu-carry timeout 30 compute-sanitizer --tool memcheck python3 benchmarks/sanitize.py 2>&1 | tail -1
    carry .gpu-carry timeout 30 compute-sanitizer --tool racecheck python3 benchmarks/sanitize.py 2>&1 | tail -1
    carry .gpu-carry timeout 90 python3 benchmarks/vllm_forward.py "$OUT" 2>&1 | grep -v "^INFO\|^WARNING"
    carry .gpu-carry-0.21.0 timeout 90 python3 benchmarks/vllm_forward.py "$OUT" 2>&1 | grep -v "^INFO\|^WARNING" ;;
  bench)
    carry .gpu-carry timeout 150 python3 benchmarks/soak.py 300 2>&1 | tee "$OUT/soak.log" | tail -3
    carry .gpu-carry-0.26.0 timeout 90 python3 benchmarks/vllm_forward.py "$OUT" 2>&1 | grep -v "^INFO\|^WARNING"
    carry .gpu-carry timeout 240 python3 -m tq_chunked.bench --serving --repeats 3 --methods latest,vllm,patched \
      --out "$OUT" 2>&1 | grep "^|"
    carry .gpu-carry timeout 200 python3 -m tq_chunked.bench --stack --repeats 3 --methods latest,tq_chunked \
      --out "$OUT" 2>&1 | grep "^|" ;;
  *) echo "usage: $0 checks|bench" >&2; exit 2 ;;
esac
