#!/usr/bin/env bash
# Re-run the tutorials that draw figures at full size, writing docs/hub/*.png and a log per tutorial
# (docs/hub/logs/NN.txt, the measured numbers quoted in the tutorials). Takes several minutes on two
# cores; run it on a quiet machine, since the timings are part of the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
mkdir -p docs/hub/logs
unset TILEATTN_SMALL
for tutorial in 01_attention_memory 04_causal_and_masks 05_precision 06_tuning 08_real_model; do
    echo "== $tutorial"
    (cd hub/tutorials && "../../$python" "$tutorial.py") | tee "docs/hub/logs/${tutorial%%_*}.txt"
done
