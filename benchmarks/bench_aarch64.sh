#!/usr/bin/env bash
# What to run on an aarch64 machine (AWS Graviton, Ampere, Apple silicon under Linux) to measure the
# native kernels there. No aarch64 numbers exist yet: CI only checks correctness under emulation
# (scripts/check_aarch64.sh), where time means nothing. Results land in
# benchmarks/results/aarch64_<cpu>_*.{csv,json}; docs/native.md says what to compare.
#
#   bash benchmarks/bench_aarch64.sh            # about 15-30 minutes
#
# 1. which library loads and why (tileattn env), and the CPU's Features line;
# 2. the variants against each other (neon with -mcpu=native, generic) and their FMA probes
#    (bench_native.py --only isa);
# 3. the neon library compiled here against the prebuilt levels of an installed aarch64 wheel, where
#    there is one (bench_prebuilt.py: decides whether TILEATTN_NATIVE=auto should keep compiling
#    neon, prebuilt.NATIVE_WINS);
# 4. the sections of bench_native.py against SDPA: fp32 grid, bf16/fp16 (the BFDOT tiles where the
#    library's throughput probe turns them on: the summary prints its BFDOT/FMA rate), decode and KV
#    cache; on one core (CPU time) and on all cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ "$(uname -m)" = aarch64 ] || { echo "bench_aarch64: run this on an aarch64 machine, not $(uname -m)"; exit 1; }
CPU=$(grep -m1 -E '^(CPU part|model name)' /proc/cpuinfo | sed 's/.*: *//; s/[^A-Za-z0-9]/_/g')
OUT=benchmarks/results/aarch64_${CPU:-unknown}
mkdir -p benchmarks/results

grep -m1 '^Features' /proc/cpuinfo
tileattn env | sed -n '/native kernels/,/library/p'
"$PY" benchmarks/bench_native.py --only machine,isa --reps 5 --out "${OUT}_isa"
if "$PY" -c "import tileattn.backends.native.prebuilt as p; raise SystemExit(not p.PREBUILT_DIR.is_dir())"; then
    "$PY" benchmarks/bench_prebuilt.py | tee "${OUT}_prebuilt.txt"
fi
"$PY" benchmarks/bench_native.py --only grid,lowp --threads 1 --cpu-time --reps 7 --out "${OUT}_1core"
"$PY" benchmarks/bench_native.py --only grid,lowp,decode,cache --reps 7 --out "${OUT}_all"
echo "results: ${OUT}_*"
