#!/usr/bin/env bash
# One point of the scale run's curve (issue 35; docs/results/heads-scale/README.md#2-all-of-sharegpt): the heads of
# the run's last checkpoint, measured as the shipped heads were, so the points line up with the curve and with
# docs/results/heads-scale/baseline:
#   - teacher-forced agreement on the ablations' 40 held-out conversations;
#   - MT-bench tau on all 80 first turns (greedy, 128 new tokens, batch 8) at budgets 2, 4, 8 and 32, heads alone
#     and heads + suffix candidates;
#   - a per-question paired comparison against the shipped heads (training/paired_tau.py).
#
#   bash training/scale_point.sh            # the checkpoint as it is now: outputs/snapshots/scale-STEP, eval-STEP
#   bash training/scale_point.sh 250        # continue the point of step 250 after an interruption
#
# Rerunning it continues where it stopped (evaluate.py saves MT-bench rows per chunk). It does not pause the run:
# kill -STOP it first if the machine should be idle (tau does not depend on load; only the wall time does).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-outputs/runs/scale-clover-eagle3}
SNAP=outputs/snapshots
SHIPPED=docs/results/heads-scale/baseline/rows-shipped/shipped
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

step=${1:-}
if [[ -z $step ]]; then  # the checkpoint's step is only known once its heads are written
  rm -rf "$SNAP/scale-new"
  python training/snapshot_heads.py "$RUN" "$SNAP/scale-new"
  step=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['step'])" "$SNAP/scale-new/snapshot.json")
  if [[ -e $SNAP/scale-$step ]]; then rm -rf "$SNAP/scale-new"; else mv "$SNAP/scale-new" "$SNAP/scale-$step"; fi
elif [[ ! -e $SNAP/scale-$step ]]; then
  echo "no $SNAP/scale-$step: run without a step to take the checkpoint as it is now" >&2
  exit 2
fi
name=scale-$step
stamp "evaluate $name ($(cat "$SNAP/$name/snapshot.json" | tr -d '\n '))"
python training/evaluate.py --heads "$name=$SNAP/$name" --target demo \
    --cache outputs/data/ablation/teacher_eval40.jsonl --mtbench --budgets 2,4,8,32 \
    --variants heads,heads+suffix --mtbench-max-new-tokens 128 --batch-size 8 --output "$SNAP/eval-$step"
rows=$SNAP/eval-$step/mtbench_rows
python training/paired_tau.py "$SHIPPED" "$rows/$name" --budgets 2,4,8,32 > "$SNAP/eval-$step/paired-heads.md"
python training/paired_tau.py "$SHIPPED-heads+suffix" "$rows/$name-heads+suffix" --budgets 2,4,8,32 \
    > "$SNAP/eval-$step/paired-heads+suffix.md"
stamp "done: $SNAP/eval-$step (eval.md, paired-heads.md, paired-heads+suffix.md)"
