#!/usr/bin/env bash
# aarch64 check (docs/native.md, "aarch64"): the native kernels cross-compiled for aarch64 and run
# under qemu-user, against a double-precision reference, on every variant and prebuilt level.
#
#   scripts/check_aarch64.sh          # CI (.ci/run): installs what it lacks (as root), ~2-3 minutes
#
# 1. gcc-aarch64-linux-gnu and qemu-user from Debian's packages, where missing;
# 2. the three prebuilt aarch64 levels through the wheel's own build path (prebuilt.compile_all with
#    the cross compiler) and the generic variant (build._compile); each library's feature list
#    (ta_isa_features, read from its bytes) must be covered by its level's /proc/cpuinfo list;
# 3. the user-function programs generated on this machine by tileattn.programs
#    (scripts/aarch64/user_programs.py) and the C harness (scripts/aarch64/harness.c), cross-compiled
#    for plain armv8-a;
# 4. the harness under qemu-aarch64 on each library, on an emulated CPU that has no more than its
#    level: neon-bf16 on "max" (bf16, i8mm, SVE), neon-dotprod on Neoverse N1 (armv8.2 + fp16 +
#    dotprod), neon and generic on Cortex-A53 (armv8.0); and neon-bf16 on Cortex-A53 must die of
#    SIGILL, which shows the emulated CPUs refuse what they lack.
# A C harness rather than an aarch64 Python with PyTorch under emulation: the latter needs a ~200 MB
# torch wheel and runs the suite orders of magnitude slower than CI's budget allows (docs/install.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
CC_A64=${CC_AARCH64:-aarch64-linux-gnu-gcc}
SYSROOT=${AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tileattn-aarch64.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
step() { printf '[check_aarch64 +%ss] %s\n' "$((SECONDS - START))" "$*"; }

if ! command -v "$CC_A64" >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
    step "installing gcc-aarch64-linux-gnu and qemu-user (Debian packages)"
    if [ "$(id -u)" != 0 ]; then
        echo "check_aarch64: needs $CC_A64 and qemu-aarch64 (apt-get install gcc-aarch64-linux-gnu qemu-user)"
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user \
        >"$WORK/apt.log" 2>&1 || { tail -20 "$WORK/apt.log"; exit 1; }
fi
"$CC_A64" --version | head -1
qemu-aarch64 --version | head -1

step "the prebuilt aarch64 levels (prebuilt.compile_all, cross) and the generic variant"
"$PY" - "$CC_A64" "$WORK" <<'EOF'
import sys
from pathlib import Path

from tileattn.backends.native import build, prebuilt

cc, work = (sys.argv[1],), Path(sys.argv[2])
built = prebuilt.compile_all(work / "prebuilt", cc)
assert built == [level.name for level in prebuilt.target_levels(cc)] and len(built) == 3, built
(work / "generic").mkdir()
build._compile(cc, ("-march=armv8-a", "-fopenmp"), "generic", work / "generic")
for level in prebuilt.target_levels(cc):
    wants = prebuilt.features_of(work / "prebuilt" / level.name / build.LIB_NAME)
    assert wants and wants <= set(level.cpu), f"{level.name}: the library uses {sorted(wants - set(level.cpu))} beyond its level"
    print(f"{level.name:13} {' '.join(level.flags):32} features {','.join(sorted(wants))}")
EOF

step "the user-function programs (generated here by tileattn.programs) and the harness, for armv8-a"
"$PY" scripts/aarch64/user_programs.py "$WORK/user"
for src in "$WORK"/user/*.c; do
    "$CC_A64" -O3 -std=gnu11 -march=armv8-a -fwrapv -fno-math-errno -fno-trapping-math -c "$src" -o "${src%.c}.o"
done
"$CC_A64" -O2 -std=gnu11 -Wall -Werror -march=armv8-a -I tileattn/backends/native/csrc scripts/aarch64/harness.c \
    "$WORK"/user/*.o -o "$WORK/harness" -ldl -lm

run() { # CPU LIBRARY: the harness under qemu on that emulated CPU
    step "qemu-aarch64 -cpu $1: $(basename "$(dirname "$2")")"
    qemu-aarch64 -cpu "$1" -L "$SYSROOT" "$WORK/harness" "$2" 2 >"$WORK/out.txt" 2>&1 || { cat "$WORK/out.txt"; exit 1; }
    grep -v '^ok ' "$WORK/out.txt"
}
run max "$WORK/prebuilt/neon-bf16/libtileattn_native.so"
run neoverse-n1 "$WORK/prebuilt/neon-dotprod/libtileattn_native.so"
run cortex-a53 "$WORK/prebuilt/neon/libtileattn_native.so"
run cortex-a53 "$WORK/generic/libtileattn_native.so"

step "the armv8.4-a+bf16 library on an armv8.0 CPU: SIGILL (the emulated CPUs refuse what they lack)"
if (qemu-aarch64 -cpu cortex-a53 -L "$SYSROOT" "$WORK/harness" "$WORK/prebuilt/neon-bf16/libtileattn_native.so") \
    >"$WORK/sigill.txt" 2>&1; then
    echo "check_aarch64: the armv8.4-a+bf16 library ran on Cortex-A53"; exit 1
fi
grep -q "Illegal instruction" "$WORK/sigill.txt" || { cat "$WORK/sigill.txt"; exit 1; }
echo "died of SIGILL, as it must"
step "done"
