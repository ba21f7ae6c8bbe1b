#!/usr/bin/env bash
# Heads at scale (issue 35; docs/drafter.md#training-at-scale-and-exact-resume): every ShareGPT conversation, teacher
# forced with soft labels and top-K, one epoch with a held-out point every 250 steps (about 610k answer tokens), on
# features computed in the step (no disk). One command that continues wherever it stopped; rerun it after any
# interruption:
#   nice -n 19 bash training/recipes/scale_run.sh >> outputs/logs/scale.log 2>&1 &
# The run checkpoints every SAVE_MINUTES (3) minutes, atomically, so a kill loses at most that much; kill -STOP /
# kill -CONT pause it. Extra train.py flags go after the command (e.g. --epochs 4 on a GPU, --threads 2); a changed
# recipe needs another --output.
set -euo pipefail
cd "$(dirname "$0")/../.."
SG=outputs/data/sharegpt
stamp() { echo "[$(date -u +%H:%M:%S)] $*"; }
if [[ ! -f $SG/stats.json ]]; then  # ShareGPT's answers, chat-templated; held-out split by conversation
  stamp "data: ShareGPT records into $SG"
  python -m training.sharegpt --output $SG
fi
stamp "train: training/configs/scale.json $*"
python -m training.train --config training/configs/scale.json --no-progress --save-minutes "${SAVE_MINUTES:-3}" "$@"
stamp "train.py exited (complete, paused by --stop-at, or failed: see the lines above)"
