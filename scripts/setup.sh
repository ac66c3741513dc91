#!/usr/bin/env bash
# Create .venv with the CPU build of PyTorch first (a bare "torch" requirement would pull a
# multi-GB CUDA build), then tileattn with its test, Triton, plotting and transformers extras, then
# build the native CPU kernels once (into the per-user cache) so that no later call pays the compile.
# A machine without a C compiler gets a message, not a failure: the PyTorch-ops engine serves it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q "torch==2.13.0" || .venv/bin/python -m pip install -q "torch>=2.13,<2.16" --index-url https://download.pytorch.org/whl/cpu
.venv/bin/python -m pip install -q -e ".[test,triton,plot,transformers]"
.venv/bin/python - <<'PYEOF' || echo "setup.sh: the native kernels could not be checked (see above); the PyTorch-ops engine serves CPU calls"
from tileattn.backends.native import kernels
ok, why = kernels.available()
if ok:
    info = kernels.build_info()
    how = "found in the cache" if info["cached"] else f"built in {info['build_seconds']:.1f} s"
    print(f"setup.sh: native kernels {how}: {info['isa']}, {info['compiler_version']}; {info['path']}")
else:
    print(f"setup.sh: {why}; the PyTorch-ops engine ('cpu') serves CPU calls (`tileattn env` says more)")
PYEOF
