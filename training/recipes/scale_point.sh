#!/usr/bin/env bash
# One point of the scale run's curve (issue 35; docs/results/heads-scale/README.md#2-all-of-sharegpt): the run's
# last checkpoint annealed in a decay branch (training/decay_branch.py; the run is not touched), measured as the
# shipped heads were, so the points line up with the curve and with docs/results/heads-scale/baseline:
#   - teacher-forced agreement on the ablations' 40 held-out conversations;
#   - MT-bench tau on all 80 first turns (greedy, 128 new tokens, batch 8) at budgets 2, 4, 8 and 32, heads alone
#     and heads + suffix candidates;
#   - a per-question paired comparison against the shipped heads (training/experiments/paired_tau.py).
#
#   bash training/recipes/scale_point.sh            # from the run's checkpoint as it is now: outputs/branches/scale-STEP
#   bash training/recipes/scale_point.sh 250        # continue the point of step 250 after an interruption
#
# Rerunning it continues where it stopped (the branch resumes; evaluate.py saves MT-bench rows per chunk). Pause
# the run itself first (--stop-at, or kill -STOP) so that the two do not share the cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=${RUN:-outputs/runs/scale-clover-eagle3}
OUT=outputs/branches
SHIPPED=docs/results/heads-scale/baseline/rows-shipped/shipped
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

step=${1:-}
if [[ -z $step ]]; then
  step=$(python -c "import sys, torch; print(torch.load(sys.argv[1], map_location='cpu', weights_only=False)['step'])" \
         "$RUN/train_state.pt")
elif [[ ! -e $OUT/scale-$step/branch.json ]]; then
  echo "no branch $OUT/scale-$step: run without a step to start one from the run's checkpoint" >&2
  exit 2
fi
branch=$OUT/scale-$step
stamp "decay branch from step $step: $branch"
python -m training.decay_branch "$RUN" --output "$branch" --no-progress
name=scale-$step
stamp "evaluate $name"
python -m training.evaluate --heads "$name=$branch" --target demo \
    --cache outputs/data/ablation/teacher_eval40.jsonl --mtbench --budgets 2,4,8,32 \
    --variants heads,heads+suffix --mtbench-max-new-tokens 128 --batch-size 8 --output "$OUT/eval-$step"
rows=$OUT/eval-$step/mtbench_rows
python -m training.experiments.paired_tau "$SHIPPED" "$rows/$name" --budgets 2,4,8,32 > "$OUT/eval-$step/paired-heads.md"
python -m training.experiments.paired_tau "$SHIPPED-heads+suffix" "$rows/$name-heads+suffix" --budgets 2,4,8,32 \
    > "$OUT/eval-$step/paired-heads+suffix.md"
stamp "done: $OUT/eval-$step (eval.md, paired-heads.md, paired-heads+suffix.md)"
