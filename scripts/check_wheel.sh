#!/usr/bin/env bash
# Ship check: build the sdist and, from it, the wheel (python -m build), check both carry every file
# tracked under tileattn/, install the wheel (not editable) into a fresh virtual environment with
# the CPU build of PyTorch, then run `tileattn env`, `tileattn verify` and a test subset against the
# installed package from a directory outside the checkout, so the checkout cannot shadow it.
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

step "fresh venv with the CPU torch (a bare torch requirement would pull a multi-GB CUDA build)"
"$PY" -m venv "$VENV"
pip_q --upgrade pip
pip_q "torch==2.13.0" build

step "python -m build: sdist, then the wheel built from the sdist"
"$VENV/bin/python" -m build --outdir "$WORK/dist" "$ROOT" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
ls -l "$WORK/dist"

step "wheel and sdist carry every file tracked under tileattn/"
git -C "$ROOT" ls-files tileattn >"$WORK/tracked.txt"
"$VENV/bin/python" - "$WORK/dist" "$WORK/tracked.txt" <<'EOF'
import pathlib, sys, tarfile, zipfile

dist, tracked = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]).read_text().split()
wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
assert len(wheels) == 1 and len(sdists) == 1, (wheels, sdists)
in_wheel = set(zipfile.ZipFile(wheels[0]).namelist())
with tarfile.open(sdists[0]) as tar:
    in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
assert tracked, "git ls-files found nothing under tileattn/"
missing = [f"{f} (wheel)" for f in tracked if f not in in_wheel] + [f"{f} (sdist)" for f in tracked if f not in in_sdist]
stray = sorted(n for n in in_wheel if not n.startswith(("tileattn/", "tileattn-")))
assert not missing, "not shipped: " + ", ".join(missing)
assert not stray, "outside the package in the wheel: " + ", ".join(stray)
print(f"{wheels[0].name}: {len(in_wheel)} files; {sdists[0].name}: {len(in_sdist)} files; all {len(tracked)} tracked package files in both")
EOF

step "install the wheel (not editable) with its test extra"
WHEEL=$(ls "$WORK"/dist/*.whl)
pip_q "$WHEEL[test]"

mkdir -p "$WORK/run/tests"
cp tests/conftest.py tests/test_sdpa_hook.py tests/test_sdpa_api.py tests/test_errors.py "$WORK/run/tests/"
cd "$WORK/run"
step "run from $PWD: the installed package, not the checkout"
"$VENV/bin/python" - "$VENV" <<'EOF'
import pathlib, sys, tileattn

where = pathlib.Path(tileattn.__file__).resolve()
assert where.is_relative_to(pathlib.Path(sys.argv[1]).resolve()), f"tileattn imported from {where}, not the venv"
print(f"tileattn {tileattn.__version__} from {where.parent}")
EOF

step "tileattn env"
"$VENV/bin/tileattn" env
step "tileattn verify"
"$VENV/bin/tileattn" verify
step "test subset against the installed package"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests
step "done"
