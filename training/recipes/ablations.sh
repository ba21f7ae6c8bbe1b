#!/usr/bin/env bash
# The ablation study behind the paper's Figure 7a, at a reduced budget that fits a 2-core CPU in about an hour:
# Clover, Medusa and the three Clover ablations trained on the same data, order and token budget
# (training/configs/ablation.json: 90k assistant tokens), then evaluated on the same eval split.
#
#   bash training/recipes/ablations.sh [OUT]   (default OUT=outputs/ablation; rerun to resume any stage)
#
# TRAIN_PROMPTS / EVAL_PROMPTS (default 600 / 120) set how many prompts are distilled; PER_CATEGORY (default 4)
# how many eval prompts per category are decoded. Writes OUT/eval/{eval.json,eval.md,*.png}.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${1:-outputs/ablation}"
TRAIN_PROMPTS="${TRAIN_PROMPTS:-600}"
EVAL_PROMPTS="${EVAL_PROMPTS:-120}"
PER_CATEGORY="${PER_CATEGORY:-4}"
METHODS=(clover medusa clover-no-augment clover-mlp-regressive clover-no-regressive)
step() { echo "== $(date -u +%H:%M:%S) $*" >&2; }

step prompts
[ -f "$OUT/prompts/train.jsonl" ] || python -m training.data --output "$OUT/prompts"
step engines
[ -f engines/demo-vanilla/engine.json ] || \
  clover build --target demo --drafter none --max-seq 1024 --output engines/demo-vanilla
[ -d engines/demo-features ] || python -m training.hidden_cache --make-feature-engine engines/demo-features --target demo
for split in eval train; do
  limit=$EVAL_PROMPTS; [ "$split" = train ] && limit=$TRAIN_PROMPTS
  step "distill $split ($limit prompts)"
  python -m training.distill --prompts "$OUT/prompts/$split.jsonl" --engine engines/demo-vanilla \
    --output "$OUT/distill/$split.jsonl" --limit "$limit" --batch-size 32
  step "cache $split"
  python -m training.hidden_cache --engine engines/demo-features --distill "$OUT/distill/$split.jsonl" \
    --output "$OUT/cache/$split"
done
heads=()
for method in "${METHODS[@]}"; do
  step "train $method"
  [ -f "$OUT/runs/$method/model.safetensors" ] || \
    python -m training.train --config training/configs/ablation.json --method "$method" \
      --cache "$OUT/cache/train" --output "$OUT/runs/$method" --no-progress
  heads+=(--heads "$method=$OUT/runs/$method")
done
step evaluate
python -m training.evaluate "${heads[@]}" --cache "$OUT/cache/eval" --prompts "$OUT/distill/eval.jsonl" \
  --per-category "$PER_CATEGORY" --max-new-tokens 96 --output "$OUT/eval"
step done
