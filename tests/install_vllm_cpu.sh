#!/usr/bin/env bash
# Builds .vllm-envs/vllm-<version>/ for each version given (default: the oldest supported
# 0.20.x, 0.23.0 from the release line whose continuation prefill takes its buffers from a
# WorkspaceManager nothing reserves them in (0.21-0.23: the locked-workspace crash), and
# the latest release, 0.34.0, whose builder reserves a max_model_len-sized pair as 0.24 to
# 0.33 do): a virtual environment with a CPU torch, that vLLM release (installed without
# its CUDA-only dependencies), this project (editable) and pytest; and beside it, in
# src/, the release's own TurboQuant tests and pyproject.toml (its ruff configuration),
# taken from its source distribution. For the newest version given, also pre-commit/:
# vLLM's pre-commit checks as that release runs them, offline: tree/, the parts of the
# source distribution they read (the vllm/ Python sources, tests/, tools/pre_commit/,
# .buildkite/, pyproject.toml, .pre-commit-config.yaml), and venv/, the tools at the
# release's pins (ruff, typos, mypy and the hooks' additional dependencies).
# tests/test_vllm_plugin.py and tests/test_vendor.py run inside each environment they
# find; tests/test_vllm_upstream.py runs vLLM's tests from src/, and vLLM's pre-commit
# checks from pre-commit/ on the files the vendor tool writes.
#   bash tests/install_vllm_cpu.sh [VERSION ...]
#   bash tests/install_vllm_cpu.sh --sources-only VERSION ...   # src/ only (no venv):
#       e.g. 0.20.0's tests for benchmarks/vllm_tests_gpu.sh on the H200 machine
# Needs python3, curl and unzip, and about 6.7 GB of disk for the three environments:
# 3.3 GB for the first, 1.6 GB for each later one, which takes the first one's torch and
# triton (1.75 GB) as hard links (a full copy where the file system has none), and
# 0.3 GB for pre-commit/. Every version is looked up on the package index before anything
# is built (an unknown one stops the script, nothing built); an environment whose build
# fails is removed, so none is left half-built.
# pip prints resolver "ERROR: ... requires torch==..." lines while it installs vLLM's
# requirements: expected (vLLM pins a CUDA torch; the environment keeps the CPU one).
set -euo pipefail
cd "$(dirname "$0")/.."
sources_only=0
if [ "${1:-}" = "--sources-only" ]; then
  sources_only=1
  shift
  [ $# -gt 0 ] || { echo "usage: $0 --sources-only VERSION ..." >&2; exit 2; }
fi
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(0.20.2 0.23.0 0.34.0)
for tool in python3 curl unzip; do
  command -v "$tool" >/dev/null || { echo "$0: needs $tool" >&2; exit 1; }
done
work=$(mktemp -d)  # this run's downloads
partial=()  # what a failed step leaves half-built, removed on the way out
cleanup() {
  local path
  for path in "${partial[@]}"; do rm -rf "$path"; done
  rm -rf "$work"
}
trap cleanup EXIT

# Every version's source distribution, looked up on the index before anything is built:
# its address and sha256 from the index's JSON simple API (PEP 691), one line each in
# $work/sdists.
curl -fsSL -H "Accept: application/vnd.pypi.simple.v1+json" https://pypi.org/simple/vllm/ \
  | python3 -c '
import json, sys
files = {f["filename"]: f for f in json.load(sys.stdin)["files"]}
missing = [v for v in sys.argv[1:] if f"vllm-{v}.tar.gz" not in files]
if missing:
    names = ", ".join(missing)
    sys.exit(
        f"install_vllm_cpu.sh: no vLLM {names} on the package index (no source "
        "distribution of that version); nothing built"
    )
for v in sys.argv[1:]:
    f = files[f"vllm-{v}.tar.gz"]
    print(v, f["url"], f["hashes"]["sha256"])' "${versions[@]}" > "$work/sdists"
newest=$(printf '%s\n' "${versions[@]}" | sort -V | tail -1)
torch_spec=${TQ_TORCH_SPEC:-torch==2.13.0}
# vLLM's requirements that are CUDA/ROCm kernels, GPU runtimes or torch itself: skipped.
skip='^(torch|torchaudio|torchvision|torchcodec|xformers|flashinfer|flashinfer-python|flashinfer-cubin|tilelang|triton|nvidia-|cuda-|cupy|pynvvideocodec|quack-kernels|humming-kernels|tokenspeed-mla|fastsafetensors|instanttensor|ray|deep-gemm|vllm-flash-attn|numba|apache-tvm-ffi|kernels)'
# What src/ holds: vLLM's TurboQuant (and UltraQuant) tests, the ROCm backend-selection
# test (its TurboQuant cases), and pyproject.toml.
members='pyproject.toml tests/quantization/test_turboquant.py tests/kernels/turboquant/ tests/kernels/ultraquant/ tests/v1/attention/test_rocm_attention_backends_selection.py'

# The first environment's torch and triton, hard-linked into a new one before pip runs
# there (pip then finds them installed): the same files, not a second 1.75 GB copy.
# Their command-line scripts are left out (their first line names the first
# environment's python); a file system without hard links gets pip's full install.
link_torch_and_triton() {  # link_torch_and_triton FROM_ENV TO_ENV
  "$1/bin/python" - "$2" <<'PY'
import os, sys, sysconfig
from importlib.metadata import distribution

site = os.path.relpath(sysconfig.get_path("purelib"), sys.prefix)
dest = os.path.join(sys.argv[1], site)
files = []
for name in ("torch", "triton"):
    dist = distribution(name)
    files += [(dist.locate_file(f), f) for f in dist.files
              if not str(f).startswith("..") and f.suffix != ".pyc"]
probe = os.path.join(dest, ".link-probe")
try:
    os.link(files[0][0], probe)
    os.unlink(probe)
except OSError as e:
    sys.exit(f"no hard links into {dest} ({e}): torch and triton installed in full")
done = []
try:
    for src, rel in files:
        os.makedirs(os.path.join(dest, os.path.dirname(str(rel))), exist_ok=True)
        os.link(src, os.path.join(dest, str(rel)))
        done.append(os.path.join(dest, str(rel)))
except OSError as e:  # none left half-linked: pip installs them in full
    for path in done:
        os.unlink(path)
    sys.exit(f"linking into {dest} failed ({e}): torch and triton installed in full")
print(f"{sys.argv[1]}: torch and triton linked from {sys.prefix} ({len(files)} files)")
PY
}

need_disk() {  # need_disk TENTHS_OF_A_GB: stop before pip would, naming the figures
  local free_kb
  free_kb=$(df -Pk . | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt $(($1 * 1024 * 1024 / 10)) ]; then
    echo "$0: the next vLLM environment needs about $(($1 / 10)).$(($1 % 10)) GB of disk;" \
      "$(df -Ph . | awk 'NR == 2 {print $4}') is free here" >&2
    exit 1
  fi
}

sdist() {  # sdist VERSION: the path of that version's source distribution, downloaded once
  local v=$1 url sha
  local path=$work/vllm-$v.tar.gz
  if [ ! -f "$path" ]; then
    read -r url sha < <(awk -v v="$v" '$1 == v {print $2, $3}' "$work/sdists")
    curl -fsSL -o "$path.part" "$url"
    echo "$sha  $path.part" | sha256sum -c --quiet
    mv "$path.part" "$path"
  fi
  echo "$path"
}

extract() {  # extract ARCHIVE DEST MEMBER...: the members (a directory: ending in /) into DEST
  python3 - "$@" <<'PY'
import sys, tarfile
from pathlib import Path
archive, dest, wanted = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
# vllm/: its Python sources only (what mypy reads of it), not its data files.
python = (".py", ".pyi", "/py.typed")
with tarfile.open(archive) as tar:
    for m in tar.getmembers():
        rel = m.name.split("/", 1)[1] if "/" in m.name else ""
        if not m.isfile() or (rel.startswith("vllm/") and not rel.endswith(python)):
            continue
        if any(rel == w or (w.endswith("/") and rel.startswith(w)) for w in wanted):
            m.name = rel
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extract(m, dest, **safe)
PY
}

fetch_sources() {  # fetch_sources VERSION DIR: the sdist's tests and pyproject.toml into DIR
  local v=$1 dir=$2
  [ -f "$dir/pyproject.toml" ] && { echo "$dir ready"; return; }
  local archive
  archive=$(sdist "$v")
  rm -rf "$dir.tmp"
  partial+=("$dir.tmp")
  mkdir -p "$dir.tmp"
  extract "$archive" "$dir.tmp" $members
  mv "$dir.tmp" "$dir"
  echo "$dir: $(find "$dir" -name '*.py' | wc -l) test files and pyproject.toml from the vllm-$v sdist"
}

fetch_pre_commit() {  # fetch_pre_commit VERSION ENV: vLLM's pre-commit checks, offline, in ENV/pre-commit
  local v=$1 dir=$2/pre-commit
  [ -f "$dir/ready" ] && { echo "$dir ready"; return; }
  rm -rf "$dir"
  partial+=("$dir")
  mkdir -p "$dir/tree"
  extract "$(sdist "$v")" "$dir/tree" pyproject.toml .pre-commit-config.yaml tools/pre_commit/ \
    .buildkite/ tests/ vllm/
  # The versions vLLM's .pre-commit-config.yaml pins: ruff's and typos' hook revisions
  # (a tag, or a frozen commit with the tag in its comment), and the additional
  # dependencies of its Python hooks (mypy's among them). Read with the environment's
  # PyYAML (a vLLM dependency), the comments from the text.
  "$2/bin/python" - "$dir/tree/.pre-commit-config.yaml" > "$dir/requirements.txt" <<'PY'
import re, sys
import yaml
text = open(sys.argv[1]).read()
repos = yaml.safe_load(text)["repos"]
tools = {"ruff-pre-commit": "ruff", "typos": "typos"}
for repo in repos:
    tool = tools.pop(repo["repo"].rstrip("/").rsplit("/", 1)[-1], None)
    if tool:
        frozen = re.search(
            rf"rev:\s*{re.escape(str(repo['rev']))}\s*#\s*frozen:\s*v?(\S+)", text
        )
        print(f"{tool}=={frozen.group(1) if frozen else str(repo['rev']).lstrip('v')}")
    for hook in repo["hooks"]:
        if hook.get("language") == "python":
            print(*hook.get("additional_dependencies", []), sep="\n")
if tools:
    sys.exit(f"{sys.argv[1]}: no hook repository for {', '.join(tools.values())}")
PY
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/python" -m pip install -q -r <(sort -u "$dir/requirements.txt")
  touch "$dir/ready"
  echo "$dir: vLLM $v's pre-commit checks ($(sort -u "$dir/requirements.txt" | grep -E '^(ruff|typos|mypy)==' | paste -sd ' '))"
}

first=""  # an environment of this run with torch and triton, to link them from
for v in "${versions[@]}"; do
  env=.vllm-envs/vllm-$v
  if [ "$sources_only" = 0 ]; then
    check="import vllm, vllm.v1.attention.backends.turboquant_attn, tq_chunked"
    if [ -x "$env/bin/python" ] && "$env/bin/python" -c "$check" 2>/dev/null; then
      echo "$env ready"
    else
      rm -rf "$env"  # what an interrupted build left
      partial+=("$env")
      python3 -m venv "$env"
      py=$env/bin/python
      linked=0
      if [ -n "$first" ] && link_torch_and_triton "$first" "$env"; then linked=1; fi
      (cd "$env" && need_disk "$([ "$linked" = 1 ] && echo 16 || echo 33)")
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
      "$py" -c "$check; print('vllm', vllm.__version__, 'imports on CPU')"
    fi
    [ -n "$first" ] || first=$env
  fi
  fetch_sources "$v" "$env/src"
  if [ "$sources_only" = 0 ] && [ "$v" = "$newest" ]; then
    fetch_pre_commit "$v" "$env"
  fi
  partial=()  # this version is complete
done
