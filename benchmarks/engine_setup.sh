# Gathers a carry built by benchmarks/make_engine_carry.sh on the H200 machine, one part
# per device call (a warm machine keeps /tmp between calls), and on the call that brings
# the last part unpacks it and puts that vLLM on PYTHONPATH with this checkout installed
# beside it (so vLLM's plugin loader finds tq_chunked's entry point).
#
#   bash benchmarks/engine_setup.sh .engine-carry-0.21.0/part1     # calls 1 .. n-1
#   source benchmarks/engine_setup.sh .engine-carry-0.21.0/part3 && python3 benchmarks/engine.py ...
#
# Source it in the shell itself (not through a pipe): it exports PYTHONPATH. It prints
# "engine carry ready: vllm X" when the release is importable, else what is missing.
#   source benchmarks/engine_setup.sh 0.21.0    # a later call on the same warm machine
_tq_part=${1:?usage: engine_setup.sh .engine-carry-VERSION/partK | VERSION}
if [ -e "$_tq_part/manifest" ]; then
  read -r _tq_ver _tq_n _tq_sha < "$_tq_part/manifest"
  _tq_dest=/tmp/tq-engine/$_tq_ver
  mkdir -p "$_tq_dest"
  _tq_k=${_tq_part%/}; _tq_k=${_tq_k##*part}
  cp "$_tq_part/chunk" "$_tq_dest/chunk.$_tq_k"
  _tq_have=$(ls "$_tq_dest"/chunk.* 2>/dev/null | wc -l)
  echo "engine carry $_tq_ver: part $_tq_k staged ($_tq_have of $_tq_n in $_tq_dest)"
else  # a version: unpacked by an earlier call
  _tq_ver=$_tq_part _tq_n=0 _tq_have=-1 _tq_dest=/tmp/tq-engine/$_tq_part
  [ -e "$_tq_dest/ready" ] || echo "engine carry $_tq_ver: not on this machine" >&2
fi
if [ "$_tq_have" -eq "$_tq_n" ] && [ ! -e "$_tq_dest/ready" ]; then
  for _tq_i in $(seq 1 "$_tq_n"); do cat "$_tq_dest/chunk.$_tq_i"; done > "$_tq_dest/carry.tar.xz"
  if [ "$(sha256sum "$_tq_dest/carry.tar.xz" | cut -d' ' -f1)" != "$_tq_sha" ]; then
    echo "engine carry $_tq_ver: checksum mismatch (parts from different builds?)" >&2
  else
    xz -d -T0 -c "$_tq_dest/carry.tar.xz" | tar x -C "$_tq_dest"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$_tq_dest/site" \
      "$_tq_dest"/whl/*.whl
    # Stand-ins for compiled modules left out of the carry (MoE and MLA kernels, which a
    # Llama model never calls), so vLLM's guarded imports of them succeed quietly.
    for _tq_m in _moe_C _moe_C_stable_libtorch _flashmla_C _flashmla_extension_C; do
      [ -e "$_tq_dest/vllm/vllm/$_tq_m.abi3.so" ] \
        || echo "# stand-in: not carried (a Llama engine never calls it)" > "$_tq_dest/vllm/vllm/$_tq_m.py"
    done
    rm -f "$_tq_dest"/chunk.* "$_tq_dest/carry.tar.xz"
    touch "$_tq_dest/ready"
  fi
fi
if [ -e "$_tq_dest/ready" ]; then
  # This checkout, installed as a package so its vllm.general_plugins entry point is seen.
  rm -rf "$_tq_dest/tq" && python3 -m pip install -q --no-index --no-deps \
    --no-build-isolation --target "$_tq_dest/tq" . >/dev/null
  export PYTHONPATH=$_tq_dest/tq:$_tq_dest/site:$_tq_dest/vllm${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import vllm; print('engine carry ready: vllm', vllm.__version__)" 2>&1 | tail -1
fi
