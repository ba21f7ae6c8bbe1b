#!/usr/bin/env bash
# A small end-to-end run of the whole pipeline (about 35 min on 2 CPU cores): 48 eval + 240 train
# prompts distilled, 25k assistant tokens of training per method, evaluation. Usage: training/recipes/pilot.sh [WORKDIR]
set -euo pipefail
W=$(realpath -m "${1:-outputs/pilot}")
cd "$(dirname "$0")/../.."  # the commands below run from the repository root
date
mkdir -p $W && (apt-get update -qq && bash training/recipes/install_sources.sh) > $W/install.log 2>&1 || echo "sources install failed (see $W/install.log)"
python -m training.data --output $W/data/prompts
[ -f engines/demo-vanilla/engine.json ] || clover build --target demo --drafter none --max-seq 1024 --output engines/demo-vanilla
python -m training.distill --prompts $W/data/prompts/eval.jsonl --engine engines/demo-vanilla --output $W/data/distill/eval.jsonl --limit 48 --batch-size 16
date
python -m training.distill --prompts $W/data/prompts/train.jsonl --engine engines/demo-vanilla --output $W/data/distill/train.jsonl --limit 240 --batch-size 16
date
[ -f $W/engines/demo-features/engine.json ] || python -m training.hidden_cache --make-feature-engine $W/engines/demo-features --target demo
python -m training.hidden_cache --engine $W/engines/demo-features --distill $W/data/distill/train.jsonl --output $W/data/cache/train
python -m training.hidden_cache --engine $W/engines/demo-features --distill $W/data/distill/eval.jsonl --output $W/data/cache/eval
date
for m in clover medusa; do
  python -m training.train --config training/configs/demo.json --method $m --cache $W/data/cache/train --output $W/runs/pilot-$m --max-tokens 25000
  date
done
python -m training.evaluate --heads clover=$W/runs/pilot-clover --heads medusa=$W/runs/pilot-medusa --cache $W/data/cache/eval --prompts $W/data/distill/eval.jsonl --output $W/eval-pilot
date
