#!/usr/bin/env bash
# Clover's GPU check in one command (docs/status.md#the-gpu-check). `--help` explains; for example:
#   bash scripts/gpu_check.sh --out /tmp/gpu_check             # on a CUDA GPU, under 8 minutes
#   bash scripts/gpu_check.sh --dry-run --out /tmp/gpu_check   # on a CPU: the plumbing at tiny shapes (CI)
# Works from a fresh copy of the tree: nothing needs to be installed from it (PYTHONPATH is the repo root).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python3}"
# -P (Python 3.11+): the current folder does not come first on sys.path, so a `scripts` or `clover` there
# (another checkout) cannot shadow this tree's
safe_path="$("$python" -P -c '' 2>/dev/null && echo -P || true)"
exec "$python" $safe_path -m scripts.gpu_check "$@"
