#!/usr/bin/env bash
# One call on the GPU device: real vLLM from .gpu-carry, the GPU suite, the whole test
# suite on CUDA, then the benchmark. Logs and results land in $OUT.
#   bash benchmarks/run_on_device.sh "<pytest -k expression or empty>" [bench args...]
# (device tool: carry [".gpu-carry"]; build it first with ../shared/gpu/make-vllm-carry.sh)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source .gpu-carry/setup.sh
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
tests=${1:-}; shift || true
if [ "$tests" != "skip" ]; then
  timeout 300 python3 -m pytest -q -s -m gpu tests ${tests:+-k "$tests"} 2>&1 | tee "$OUT/gpu-tests.log" | grep -E "chunked|slots|MiB|passed|failed|Error|error" | tail -60
  timeout 200 python3 -m pytest -q -x -m "not gpu" tests 2>&1 | tee "$OUT/cuda-tests.log" | tail -5
fi
[ $# -gt 0 ] && timeout 420 python3 -m tq_chunked.bench "$@" --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "bench:" | tail -80
