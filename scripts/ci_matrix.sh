#!/usr/bin/env bash
# CI after the README's test command (which .ci/run runs first, in the day's random test order):
#
#   1. the other builds of the native engine: for each of TILEATTN_NATIVE_ISA=avx2 and =generic that
#      this CPU can run and that is not already its default build, the hub chapter that measures
#      the kernels' register blocks and peaks (HUB_NATIVE, chapter 09: its claims must hold for
#      every build and CPU; the suite itself already runs the kernel tests under both builds, in
#      tests/test_native_build.py);
#   2. the build without OpenMP: CC=clang (Debian's, installed when missing, no libomp), the kernels
#      on their own thread pool (tests/test_native_build.py -k without_openmp);
#   3. only with CI_MATRIX_FULL=1 (a release check; it does not fit the 20-minute CI budget on 2
#      cores): the engine's tests (NATIVE_TESTS) and every hub tutorial and recipe under those
#      builds, and the suite again in a second
#      random order (seed from the commit, printed), leaving out the tests that only start
#      subprocesses (SUBPROCESS_ONLY), so a test that passes only after or before another fails.
#
# Budget: the whole of .ci/run must stay under 20 minutes on the CI machine (2 cores); stage 1 takes
# one to two minutes there. Each stage prints its seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
START=$SECONDS

# One stage: its wall time, and its CPU time (processes it started included), which other jobs on a
# shared machine inflate less.
stage() {
    local name=$1 TIMEFORMAT
    shift
    printf '[ci_matrix +%ss] %s\n' "$((SECONDS - START))" "$name"
    TIMEFORMAT="[ci_matrix] $name: %0R s wall, %0U s user + %0S s sys"
    time "$@"
}

NATIVE_TESTS=(tests/test_native_kernels.py tests/test_unit_stride.py tests/test_decode_path.py
              tests/test_decode_kvcache.py)
HUB_SCRIPTS="test_tutorial_runs or test_recipe_runs"
HUB_NATIVE="09_native_kernel"
SUBPROCESS_ONLY=(
    --deselect tests/test_triton.py::test_interpreter_suite
    --deselect tests/test_triton.py::test_kernels_compile_for_sm90
    --deselect "tests/test_native_build.py::test_variant_without_avx512_passes_the_kernel_tests"
    --deselect tests/test_native_bench.py::test_isa_section_runs_every_variant
    -k "not ($HUB_SCRIPTS or test_contest_accepts or test_contest_rejects)"
)

# The builds to add: those this CPU and compiler can run, other than the one the engine picks anyway.
ISAS=$("$PY" scripts/other_native_builds.py)
if [ -z "$ISAS" ]; then
    echo "[ci_matrix] no other native build to test on this machine"
fi
for isa in $ISAS; do
    if [ "${CI_MATRIX_FULL:-0}" = 1 ]; then
        stage "TILEATTN_NATIVE_ISA=$isa: the native engine's tests and every hub tutorial and recipe" \
            env TILEATTN_NATIVE_ISA="$isa" "$PY" -m pytest -p no:cacheprovider "${NATIVE_TESTS[@]}" \
            tests/test_hub.py -k "not test_hub or $HUB_SCRIPTS"
    else
        stage "TILEATTN_NATIVE_ISA=$isa: the hub chapter on the kernels" \
            env TILEATTN_NATIVE_ISA="$isa" "$PY" -m pytest -p no:cacheprovider tests/test_hub.py \
            -k "($HUB_SCRIPTS) and ($HUB_NATIVE)"
    fi
done

# A compiler without an OpenMP runtime (clang without libomp, as on macOS): the kernels build with no
# OpenMP and run on their own thread pool. Debian's clang is installed here when missing (about a
# minute); the suite's own run skipped these two tests for want of it.
if ! command -v clang >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    stage "apt-get install clang (no libomp)" sh -c 'apt-get install -y -qq clang >/dev/null 2>&1 || (apt-get update -qq >/dev/null && apt-get install -y -qq clang >/dev/null)'
fi
if command -v clang >/dev/null 2>&1; then
    stage "CC=clang without OpenMP: the kernels on the thread pool" \
        "$PY" -m pytest -p no:cacheprovider tests/test_native_build.py -k "without_openmp" -rs
else
    echo "[ci_matrix] no clang and no way to install it: the no-OpenMP build is not checked"
fi

if [ "${CI_MATRIX_FULL:-0}" = 1 ]; then
    # A second order: the commit's first 8 hex digits (any integer but the day's seed would do).
    SEED=$(( 16#$(git rev-parse --short=8 HEAD 2>/dev/null || date -u +%H%M%S) ))
    stage "second random order (TILEATTN_TEST_SEED=$SEED), without the subprocess-only tests" \
        env TILEATTN_TEST_SEED="$SEED" "$PY" -m pytest -p no:cacheprovider "${SUBPROCESS_ONLY[@]}"
fi
printf '[ci_matrix] done in %s s\n' "$((SECONDS - START))"
