#!/usr/bin/env bash
# vLLM's own TurboQuant tests on the vendored tree, on the H200 machine: the ones the CPU
# suite (tests/test_vllm_upstream.py) skips for want of a GPU, with the rest beside them.
#
# vLLM from a carry (VLLM_TESTS_VERSION, default 0.20.0, in CARRY, default .gpu-carry:
# its Python sources and FlashAttention-3, put on PYTHONPATH under /tmp/tq-carry by the
# carry's setup.sh), tq_chunked vendored into a tree of symlinks to it (python -m
# tq_chunked.vendor), and that release's tests from its source distribution as the
# change leaves them, with the change's own
# test (tests/quantization/test_turboquant_chunked_prefill.py) added: pytest
# -k "turboquant or ultraquant", as on the CPU. The tests come from
# .vllm-envs/vllm-<version>/src, which the machine cannot download: fetch it here first,
#   bash tests/install_vllm_cpu.sh --sources-only 0.20.0
# and carry it with the checkout (with .gpu-carry). Then, on the H200 machine:
#   bash benchmarks/vllm_tests_gpu.sh
# Another release whose torch pin is the machine's (0.21-0.26: torch 2.11), e.g. 0.23.0:
#   VLLM_VERSION=0.23.0 CARRY_DIR=.gpu-carry-0.23.0 bash ../shared/gpu/make-vllm-carry.sh
#   bash tests/install_vllm_cpu.sh --sources-only 0.23.0
#   VLLM_TESTS_VERSION=0.23.0 CARRY=.gpu-carry-0.23.0 bash benchmarks/vllm_tests_gpu.sh
# (carry .gpu-carry-0.23.0 and .vllm-envs/vllm-0.23.0/src).
# It prints pytest's summary and writes, under $OUT: vllm-tests-gpu.json (counts and
# every test's outcome), vllm-tests-gpu.xml (JUnit), vllm-tests-gpu.log, vendor.diff.
# About a minute and a half (the carry's setup, then the tests); NO_CARRY=1 uses the
# vLLM importable here instead of the carry (a check of this script on a CPU).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
version=${VLLM_TESTS_VERSION:-0.20.0}
src=${VLLM_TESTS_SRC:-$root/.vllm-envs/vllm-$version/src}
if [ ! -f "$src/pyproject.toml" ]; then
  echo "no $src: run 'bash tests/install_vllm_cpu.sh --sources-only $version' and carry it" >&2
  exit 2
fi
if [ "${NO_CARRY:-0}" != 1 ]; then
  # shellcheck disable=SC1091
  source "$root/${CARRY:-.gpu-carry}/setup.sh" || exit 2
fi
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}
vllm_dir=$(python3 -c "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])")
tree=$(mktemp -d /tmp/vllm-vendored-XXXXXX)
python3 -c "import sys; from tq_chunked.tools.vllm_harness import symlink_farm; symlink_farm(*sys.argv[1:])" \
  "$vllm_dir" "$tree" "$src/tests" || exit 1
cp "$src/pyproject.toml" "$tree/"
python3 -m tq_chunked.vendor "$tree" > "$OUT/vendor.diff" || { cat "$OUT/vendor.diff"; exit 1; }
tail -3 "$OUT/vendor.diff"
cd "$tree" || exit 1
PYTHONPATH=$tree:$PYTHONPATH TQ_CHUNKED_DISABLE=1 PYTHONDONTWRITEBYTECODE=1 timeout 240 \
  python3 -m pytest -q -rfEs -p no:cacheprovider -k "turboquant or ultraquant" \
  --junitxml="$OUT/vllm-tests-gpu.xml" tests > "$OUT/vllm-tests-gpu.log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT/vllm-tests-gpu.log" | tail -25
python3 - "$OUT/vllm-tests-gpu.xml" "$OUT/vllm-tests-gpu.json" "$rc" "$vllm_dir" "$version" <<'PY'
import json, sys, xml.etree.ElementTree as ET
xml_path, json_path, rc, vllm_dir, version = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
tests = []
for case in ET.parse(xml_path).iter("testcase"):
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome = {"failure": "failed", "error": "failed"}.get(tag, tag)
            reason = node.get("message", "")
            break
    else:
        reason = ""
    tests.append({"test": f"{case.get('classname')}::{case.get('name')}",
                  "outcome": outcome, "reason": reason[:300]})
counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "skipped")}
json.dump({"vllm": vllm_dir, "pytest_exit_status": rc, "counts": counts, "tests": tests},
          open(json_path, "w"), indent=1)
print(f"vLLM {version} tests on the vendored tree (GPU):", counts, "->", json_path)
PY
exit "$rc"
