#!/usr/bin/env bash
# Re-run tutorials at full size, writing docs/hub/*.png and a log per tutorial (docs/hub/logs/NN.txt,
# the measured numbers quoted in the tutorials). Takes several minutes on two cores; run it on a quiet
# machine, since the timings are part of the figures.
#
#   hub/regenerate_figures.sh          every tutorial
#   hub/regenerate_figures.sh 11 04    only these chapters (a new chapter need not re-measure the others)
#
# Chapter 12 starts its own groups of 2 and 4 local gloo processes (no launcher, no GPU) and takes
# about 30 s; its measured work per rank is CPU time, but the run is best done on a quiet machine too.
# Chapter 09 compiles its C snippets with the machine's compiler ($CC, else cc, gcc or clang), runs
# on one thread and times its micro-benchmarks in CPU time; its engine comparison is wall clock.
# Chapter 10 holds up to about 2 GiB at once (a streaming buffer of 4x the last-level cache, at most
# 2 GiB; a 1 GiB KV cache; a 1 GiB repeat_kv copy) and times on one thread in CPU time, except its
# two-thread split-KV measurement, which is wall clock.
# Chapter 14 compiles the profiling build of the native kernels once (TILEATTN_NATIVE_PROFILE=1, its
# own cache folder) and times on one thread in CPU time; its profile shares are best taken on a quiet
# machine (tasks that were preempted are left out, but a busy core still evicts the caches).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
mkdir -p docs/hub/logs
unset TILEATTN_SMALL
all=$(cd hub/tutorials && ls [0-9][0-9]_*.py | sed "s/\.py$//")
selected=""
for chapter in "$@"; do
    match=$(printf '%s\n' $all | grep "^${chapter}_" || true)
    if [ -z "$match" ]; then
        echo "regenerate_figures.sh: no tutorial hub/tutorials/${chapter}_*.py; chapters: $(printf '%s\n' $all | cut -c1-2 | tr '\n' ' ')" >&2
        exit 2
    fi
    selected="$selected $match"
done
for tutorial in ${selected:-$all}; do
    echo "== $tutorial"
    (cd hub/tutorials && "../../$python" "$tutorial.py") | tee "docs/hub/logs/${tutorial%%_*}.txt"
done
