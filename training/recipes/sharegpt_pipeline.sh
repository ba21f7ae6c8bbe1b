#!/usr/bin/env bash
# The ShareGPT pipeline of issue 12 on the demo target, sized for a 2-core CPU
# (training/README.md#sharegpt). Every stage resumes: rerun the same command.
#   nice -n 10 bash training/recipes/sharegpt_pipeline.sh [data|distill|ablation|main|eval|all] > outputs/logs/pipeline.log 2>&1 &
# Knobs (environment): TRAIN_PARTS (parts of the training cache, default 5: teacher-forced ShareGPT records
# [0, FIRST_RECORDS=150) in sharegpt-train, then PART_RECORDS=300 more per part in sharegpt-train-K; each part is
# sealed and usable on its own, so the data grows without redoing what is cached),
# EVAL_RECORDS (120), ABLATION_TOKENS (30000), ABLATIONS (variants), MAIN_TOKENS (300000), EVAL_EVERY (20),
# SAVE_EVERY (20), RECIPE (train.py flags of the main runs: soft labels and the heads' draft vocabulary),
# METHODS of the main runs (clover medusa), MTBENCH_LIMIT (24), BUDGETS (4,8),
# DISTILL_PROMPTS (4000: ShareGPT training prompts the target answers itself in the distill stage),
# DISTILL_PART_RECORDS (400: distilled answers per cache part, sharegpt-distill-K; only complete parts are cached),
# FINETUNE_INIT (heads the finetune stage starts from: the shipped Clover heads), FINETUNE_EPOCHS (2),
# FINETUNE_MAX_TOKENS (answer-token cap over all epochs; default: none, unlike demo.json's 500k of the runs from scratch).
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=${1:-all}
DISTILL_PROMPTS=${DISTILL_PROMPTS:-4000}
TRAIN_PARTS=${TRAIN_PARTS:-5}
FIRST_RECORDS=${FIRST_RECORDS:-150}
PART_RECORDS=${PART_RECORDS:-300}
EVAL_RECORDS=${EVAL_RECORDS:-120}
ABLATION_TOKENS=${ABLATION_TOKENS:-30000}
MAIN_TOKENS=${MAIN_TOKENS:-300000}
EVAL_EVERY=${EVAL_EVERY:-20}
ABLATIONS=${ABLATIONS:-hard soft soft-reg10 soft-reg1}
MTBENCH_LIMIT=${MTBENCH_LIMIT:-24}
BUDGETS=${BUDGETS:-4,8}
RECIPE=${RECIPE:---labels soft --draft-vocab clover/assets/smollm2-135m-instruct/clover}
SG=outputs/data/sharegpt
CACHE=outputs/data/cache
part_dir() { if (( $1 == 1 )); then echo $CACHE/sharegpt-train; else echo $CACHE/sharegpt-train-$1; fi; }
part_range() {  # "offset limit" of part $1
  if (( $1 == 1 )); then echo "0 $FIRST_RECORDS"; else echo "$(( FIRST_RECORDS + ($1 - 2) * PART_RECORDS )) $PART_RECORDS"; fi; }
TRAIN_CACHES=$(for k in $(seq 1 "$TRAIN_PARTS"); do part_dir "$k"; done | paste -sd,)
COMMON="--config training/configs/demo.json --no-progress --eval-cache $CACHE/sharegpt-eval --eval-conversations 80"
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }

if [[ $STAGE == data || $STAGE == all ]]; then
  stamp "data: ShareGPT records"
  [[ -f $SG/stats.json ]] || python -m training.sharegpt --output $SG
  [[ -d engines/demo-features ]] || python -m training.hidden_cache --make-feature-engine engines/demo-features --target demo
  stamp "data: eval cache"
  python -m training.hidden_cache --engine engines/demo-features --distill $SG/teacher_eval.jsonl --limit "$EVAL_RECORDS" --output $CACHE/sharegpt-eval
  for k in $(seq 1 "$TRAIN_PARTS"); do
    read -r offset limit <<< "$(part_range "$k")"
    stamp "data: train cache part $k (records $offset..$(( offset + limit )))"
    python -m training.hidden_cache --engine engines/demo-features --distill $SG/teacher_train.jsonl \
      --offset "$offset" --limit "$limit" --output "$(part_dir "$k")"
  done
fi
if [[ $STAGE == distill ]]; then
  # (a) of issue 12: the target's own answers to the ShareGPT training prompts (what greedy decoding
  # produces, hence what the heads must predict on MT-bench); resumable, extend with a larger DISTILL_PROMPTS
  [[ -d engines/demo ]] || clover build --target demo --output engines/demo
  stamp "distill: $DISTILL_PROMPTS ShareGPT prompts"
  python -m training.distill --prompts $SG/prompts_train.jsonl --output $SG/distill_train.jsonl --engine engines/demo \
    --limit "$DISTILL_PROMPTS" --batch-size 16 --max-new-tokens 256
fi
if [[ $STAGE == distill-cache ]]; then
  # the distilled answers' hidden states, in sealed parts of DISTILL_PART_RECORDS records (the file still grows)
  part=${DISTILL_PART_RECORDS:-400}
  records=$(wc -l < $SG/distill_train.jsonl)
  for k in $(seq 1 $(( records / part ))); do
    stamp "distill-cache: part $k (records $(( (k - 1) * part ))..$(( k * part )))"
    python -m training.hidden_cache --engine engines/demo-features --distill $SG/distill_train.jsonl \
      --offset $(( (k - 1) * part )) --limit "$part" --output $CACHE/sharegpt-distill-$k
  done
fi
if [[ $STAGE == finetune ]]; then
  # fine-tune trained heads (--init) on the target's own answers (every cached distill part) and the ShareGPT
  # answers it was not trained on, with the main runs' recipe
  distilled=$(ls -d $CACHE/sharegpt-distill-* | sort -V | paste -sd,)
  stamp "finetune: ${FINETUNE_METHOD:-clover} from ${FINETUNE_INIT:-clover/assets/smollm2-135m-instruct/clover}"
  python -m training.train $COMMON --method "${FINETUNE_METHOD:-clover}" --cache "$distilled${FINETUNE_EXTRA:+,$FINETUNE_EXTRA}" \
    --init "${FINETUNE_INIT:-clover/assets/smollm2-135m-instruct/clover}" --epochs "${FINETUNE_EPOCHS:-2}" \
    --lr "${FINETUNE_LR:-0.0005}" --eval-every "$EVAL_EVERY" --save-every "${SAVE_EVERY:-20}" $RECIPE \
    --max-tokens "${FINETUNE_MAX_TOKENS:-1000000000}" --output "${FINETUNE_OUTPUT:-outputs/runs/finetune-clover}"
fi
if [[ $STAGE == ablation || $STAGE == all ]]; then
  # the recipe, one change at a time, same data, order and token budget
  declare -A FLAGS=([hard]="--labels hard" [soft]="--labels soft" [soft-reg10]="--labels soft --regression-weight 10"
                    [soft-reg1]="--labels soft --regression-weight 1")
  for name in $ABLATIONS; do
    flags=${FLAGS[$name]}
    stamp "ablation: $name"
    python -m training.train $COMMON --method clover --cache $CACHE/sharegpt-train --max-tokens "$ABLATION_TOKENS" \
      --eval-every 1000000 --batch-tokens "${ABLATION_BATCH_TOKENS:-4096}" --log-every 2 --save-every 4 $flags \
      --output outputs/runs/ablation-$name
  done
fi
if [[ $STAGE == main || $STAGE == all ]]; then
  for method in ${METHODS:-clover medusa}; do
    stamp "main: $method"
    python -m training.train $COMMON --method $method --cache "$TRAIN_CACHES" --max-tokens "$MAIN_TOKENS" \
      --epochs 3 --eval-every "$EVAL_EVERY" --save-every "${SAVE_EVERY:-20}" $RECIPE --output outputs/runs/sharegpt-$method
  done
fi
if [[ $STAGE == eval || $STAGE == all ]]; then
  stamp "eval: MT-bench and teacher-forced"
  python -m training.evaluate --heads clover=outputs/runs/sharegpt-clover --heads medusa=outputs/runs/sharegpt-medusa \
    --heads shipped-clover=clover/assets/smollm2-135m-instruct/clover \
    --heads shipped-medusa=clover/assets/smollm2-135m-instruct/medusa \
    --cache $CACHE/sharegpt-eval --mtbench --mtbench-limit "$MTBENCH_LIMIT" --budgets "$BUDGETS" \
    --output outputs/eval-sharegpt
fi
stamp "done: $STAGE"
