#!/usr/bin/env bash
# Compile times and step ratios of the GmP models on one accelerator, and the theta -> u map's
# forms against each other, in one command (about 5 minutes on one H100/H200;
# the limits below add up to 9 minutes 10 s):
#
#   bash benchmarks/gpu_compile.sh [OUT_DIR]        # OUT_DIR: default $OUT or /tmp/gpu_compile
#   TINY=1 bash benchmarks/gpu_compile.sh           # tiny models: a smoke test (runs on a CPU)
#
# 1. vision_throughput: ResNet-50 (224 px) and VGG-6 (32 px), batch 256, float32, plain (sp),
#    BN, GmP+IMN paper form and whole-model transform: images/s and compile times, ratios.
# 2. model_map: the map of each model's layers, forward and backward, as the layers run it
#    (`associative` on an accelerator) against the experimental `window` form (one cumprod and
#    one variadic reduce-window per layer) in one process: compile time, ms, HLO op counts, the
#    memory floor at the device's bandwidth, and the window form's gradient against the
#    library's. If that process fails (a form that does not compile), each form runs alone.
# Every command's output is printed and kept under OUT_DIR (JSON files and logs).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-/tmp/gpu_compile}}"
mkdir -p "$out"
py="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && py=.venv/bin/python
if [ "${TINY:-0}" = 1 ]; then
  vision_args=(--tiny --batch=4 --repeats=2)
  map_args=(--tiny --repeats=2)
  declare -A limit=([resnet50]=400 [vgg6]=400)  # a CPU compiles slower
else
  vision_args=(--batch=256 --repeats=10)
  map_args=(--repeats=20)
  declare -A limit=([resnet50]=240 [vgg6]=100)
fi
status=0

run() {  # run NAME LIMIT_S CMD...: prints and logs the command's output, notes a failure
  local name=$1 limit_s=$2
  shift 2
  echo "== $name: $*"
  local start=$SECONDS
  timeout "$limit_s" "$@" 2>&1 | grep -v 'Unable to initialize backend' | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  [ "$rc" = 0 ] || status=1
}

"$py" -c 'import jax; print(jax.__version__, jax.devices())' | tee "$out/devices.log"
bandwidth=$("$py" - <<'EOF'
import jax
kind = jax.devices()[0].device_kind
# HBM bandwidth in GB/s of the kinds this project has used; 0 (no floor in ms) for others.
print(next((b for k, b in (('H200', 4800), ('H100', 3350), ('A100', 2039)) if k in kind), 0))
EOF
)

for model in resnet50 vgg6; do  # one process each, so a model past its limit leaves the other's
  run "vision_$model" "${limit[$model]}" "$py" -m benchmarks.vision_throughput --models="$model" \
    --parameterizations=sp,bn,gmp_imn,gmp_imn_transform --dtype=float32 "${vision_args[@]}" \
    --out="$out/vision_$model.json"
done
run map_both 150 "$py" -m benchmarks.model_map --models=resnet50,vgg6 --maps=associative,window \
  --bandwidth_gbs="$bandwidth" "${map_args[@]}" --out="$out/map_both.json"
if [ ! -s "$out/map_both.json" ]; then  # one form failed: each alone, to keep the other's numbers
  for form in associative window; do
    run "map_$form" 60 "$py" -m benchmarks.model_map --models=resnet50,vgg6 --maps="$form" \
      --bandwidth_gbs="$bandwidth" "${map_args[@]}" --out="$out/map_$form.json"
  done
fi
exit $status
