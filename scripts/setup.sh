#!/usr/bin/env bash
# Create .venv with the CPU build of PyTorch first (a bare "torch" requirement would pull a
# multi-GB CUDA build), then tileattn with its test, Triton, plotting and transformers extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q "torch>=2.13,<2.15" --index-url https://download.pytorch.org/whl/cpu
.venv/bin/python -m pip install -q -e ".[test,triton,plot,transformers]"
