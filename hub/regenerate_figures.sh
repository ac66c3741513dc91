#!/usr/bin/env bash
# Re-run every tutorial at full size, writing docs/hub/*.png and a log per tutorial
# (docs/hub/logs/NN.txt, the measured numbers quoted in the tutorials). Takes several minutes on two
# cores; run it on a quiet machine, since the timings are part of the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
mkdir -p docs/hub/logs
unset TILEATTN_SMALL
for tutorial in $(cd hub/tutorials && ls [0-9][0-9]_*.py | sed "s/\.py$//"); do
    echo "== $tutorial"
    (cd hub/tutorials && "../../$python" "$tutorial.py") | tee "docs/hub/logs/${tutorial%%_*}.txt"
done
