"""Building the native kernels: the variants without AVX-512, the cache and its lock, no compiler.

Each test runs fresh Python processes with their own empty cache directory, so it sees exactly what
a first use on a new machine sees.
"""

from __future__ import annotations

import json
import os
import shutil
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


def run(args, tmp_path, **env):
    full = dict(os.environ, TILEATTN_CACHE_DIR=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, cwd=ROOT, env=full, timeout=900)


@needs_cc
@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_variant_without_avx512_passes_the_kernel_tests(isa, tmp_path):
    got = build._variant(CC, isa)
    if isinstance(got, str):
        pytest.skip(f"{isa} cannot be built here: {got}")
    res = run(["-m", "pytest", "-x", "-p", "no:cacheprovider", "tests/test_native_kernels.py", "-k",
               VARIANT_TESTS], tmp_path, TILEATTN_NATIVE_ISA=isa)
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


PROFILE = """
import torch
from tileattn.backends.native import kernels as nk
q, k, v = (torch.randn(1, 4, 300, 64) for _ in range(3))
out, lse = torch.empty_like(q), torch.empty(1, 4, 300)
for _ in range(5):
    nk.forward(q, k, v, out, lse, scale=0.125, right=0, num_threads=2)
fwd = nk.profile()
delta = (out * out).sum(-1)
dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
for _ in range(5):
    nk.backward(q, k, v, out, out, lse, delta, dq, dk, dv, scale=0.125, right=0, num_threads=2)
print(json.dumps([nk.build_info()["flags"], fwd, nk.profile(), nk.profile()]))
"""


@needs_cc
def test_profiling_build_counts_every_phase(tmp_path):
    """TILEATTN_NATIVE_PROFILE=1: its own library with per-phase counters; phases add up to the time of
    the tasks that were not preempted, all tasks fit in the parallel regions, reading clears them."""
    res = run(["-c", "import json\n" + PROFILE], tmp_path, TILEATTN_NATIVE_PROFILE="1")
    assert res.returncode == 0, res.stderr[-2000:]
    flags, fwd, bwd, cleared = json.loads(res.stdout.strip().splitlines()[-1])
    assert "-DTA_PROFILE=1" in flags
    for counters, prefix in ((fwd, "fwd_"), (bwd, "bwd_")):
        phases = sum(v for name, v in counters.items() if name.startswith(prefix))
        assert counters["calls"] == 5 and counters["tasks"] >= 5 and counters["preempted"] < counters["tasks"]
        assert 0.5 * counters["task"] < phases <= counters["task"] <= counters["task_all"] <= counters["region"]
    assert fwd["fwd_scores"] > 0 and fwd["fwd_pv"] > 0 and bwd["bwd_dq"] > 0 and bwd["bwd_dk"] > 0
    assert not any(cleared.values())


def _cross_compiler():
    for cc in ("aarch64-linux-gnu-gcc", "aarch64-linux-gnu-gcc-12"):
        if shutil.which(cc):
            return (cc,)
    return None


@pytest.mark.skipif(_cross_compiler() is None,
                    reason="no aarch64 cross compiler here (apt-get install gcc-aarch64-linux-gnu to run this check)")
def test_generic_variant_cross_compiles_for_aarch64(tmp_path):
    """The portable variant is what an aarch64 machine builds (NEON through vector extensions, FMAs
    from contraction): both translation units and the link, with the flags build.py uses."""
    lib = build._compile(_cross_compiler(), ("-march=armv8-a", "-fopenmp"), "generic", tmp_path)
    header = lib.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
