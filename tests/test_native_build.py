"""Building the native kernels: the variants without AVX-512, the cache and its lock, no compiler.

Each test runs fresh Python processes with their own empty cache directory, so it sees exactly what
a first use on a new machine sees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tileattn.backends.native import build

ROOT = Path(__file__).resolve().parent.parent

try:
    CC = tuple(build.find_compiler())
except build.BuildError:
    CC = None
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler on this machine")

INFO = "from tileattn.backends.native import kernels as nk; import json; print(json.dumps(nk.build_info()))"

#: the kernel tests a variant must pass: every dtype, GQA, odd lengths, causal, varlen, decode (with
#: its transposing reductions), paged KV, modifiers, dropout, dbias and thread-count determinism
VARIANT_TESTS = ("(matches_reference and not tiles) or (decode_shapes and (17 or 1000)) or (varlen and fp32) "
                 "or softcap or bias_and_its_gradient or paged or bitwise or dropout or active_isa")
#: and of test_native_serving.py: K/V formats widened in registers or element by element, scale classes,
#: converted rows (head dims off the vector width), ragged batches, thread and batch invariance
SERVING_VARIANT_TESTS = ("(dequantised_reference and seqused and (head_channel or token_group or batch_head)) "
                         "or ragged or bits or off_the or (low_precision_cache and gqa4)")


def run(args, tmp_path, **env):
    full = dict(os.environ, TILEATTN_CACHE_DIR=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, cwd=ROOT, env=full, timeout=900)


@needs_cc
@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_variant_without_avx512_passes_the_kernel_tests(isa, tmp_path):
    got = build._variant(CC, isa)
    if isinstance(got, str):
        pytest.skip(f"{isa} cannot be built here: {got}")
    selection = f"(test_native_kernels and ({VARIANT_TESTS})) or (test_native_serving and ({SERVING_VARIANT_TESTS}))"
    res = run(["-m", "pytest", "-x", "-p", "no:cacheprovider", "tests/test_native_kernels.py",
               "tests/test_native_serving.py", "-k", selection], tmp_path, TILEATTN_NATIVE_ISA=isa)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    summary = res.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


@needs_cc
def test_first_uses_in_parallel_processes_build_once(tmp_path):
    """`python -c` on an empty cache works; concurrent first uses wait on the lock instead of racing."""
    env = dict(os.environ, TILEATTN_CACHE_DIR=str(tmp_path / "cache"))
    procs = [subprocess.Popen([sys.executable, "-c", INFO], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=env) for _ in range(2)]
    infos = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err
        infos.append(json.loads(out))
    assert len({i["path"] for i in infos}) == 1
    built, waited = sorted(infos, key=lambda i: i["cached"])
    assert not built["cached"] and built["build_seconds"] > 0 and waited["cached"]
    lib = Path(built["path"])
    assert lib.is_file() and str(tmp_path / "cache") in str(lib) and lib.parent.name.startswith(built["isa"] + "-")
    assert built["compiler_version"] and built["isa"] in build.ISAS and built["openmp"]
    assert json.loads((lib.parent / "build.json").read_text())["isa"] == built["isa"]
    assert [p.name for p in lib.parent.iterdir() if p.name.startswith("build-")] == []  # no temp left


NO_COMPILER = """
from tileattn.backends.native import kernels as nk
import torch
print(nk.available())
try:
    nk.forward(*[torch.zeros(1, 1, 1, 8)] * 4, torch.zeros(1, 1, 1), scale=1.0)
except nk.Unavailable as exc:
    print("raised:", exc)
"""


def test_no_compiler_makes_the_kernels_unavailable_with_the_reason(tmp_path):
    res = run(["-c", NO_COMPILER], tmp_path, CC="/nonexistent")
    assert res.returncode == 0, res.stderr
    reason = "native kernels unavailable: $CC='/nonexistent' is not an executable compiler"
    assert res.stdout.splitlines() == [str((False, reason)), "raised: " + reason]


@pytest.mark.parametrize("env,words", [
    (dict(CC="", PATH="/nonexistent-dir"), "no C compiler found"),
    (dict(TILEATTN_NATIVE_ISA="sse9"), "TILEATTN_NATIVE_ISA='sse9'; expected one of avx512, avx2, generic"),
], ids=["no-compiler-on-PATH", "unknown-isa"])
def test_build_errors_say_why(env, words, tmp_path, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TILEATTN_CACHE_DIR", str(tmp_path))
    with pytest.raises(build.BuildError) as info:
        build.build()
    assert words in str(info.value)


@needs_cc
def test_a_failing_compile_reports_the_compiler_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "BASE_FLAGS", build.BASE_FLAGS + ("-include", "/nonexistent.h"))
    with pytest.raises(build.BuildError, match="compiling .*kernels.c failed.*nonexistent.h"):
        build.build()
