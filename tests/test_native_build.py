"""Building the native kernels: the variants without AVX-512, the cache and its lock, no compiler.

Each test runs fresh Python processes with their own empty cache directory, so it sees exactly what
a first use on a new machine sees.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tileattn.backends.native import build, prebuilt
from tileattn.programs import toolchain

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
#: and of test_user_functions.py: compiled functions in the tiles (built with the variant's flags too),
#: forward and backward, varlen, paged decode
USER_VARIANT_TESTS = "composed or decode_over or varlen or captured"


def run(args, tmp_path, **env):
    full = dict(os.environ, TILEATTN_CACHE_DIR=str(tmp_path / "cache"), **env)
    return subprocess.run([sys.executable] + args, capture_output=True, text=True, cwd=ROOT, env=full, timeout=900)


@needs_cc
@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_variant_without_avx512_passes_the_kernel_tests(isa, tmp_path):
    got = toolchain.variant(CC, isa)
    if isinstance(got, str):
        pytest.skip(f"{isa} cannot be built here: {got}")
    selection = (f"(test_native_kernels and ({VARIANT_TESTS})) or (test_native_serving and ({SERVING_VARIANT_TESTS}))"
                 f" or (test_user_functions and ({USER_VARIANT_TESTS}))")
    res = run(["-m", "pytest", "-x", "-p", "no:cacheprovider", "tests/test_native_kernels.py",
               "tests/test_native_serving.py", "tests/test_user_functions.py", "-k", selection], tmp_path,
              TILEATTN_NATIVE_ISA=isa)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    summary = res.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


NO_OPENMP = """
import json, os, torch, tileattn
from tileattn.backends.native import kernels as nk

def threads():
    return int(next(line for line in open("/proc/self/status") if line.startswith("Threads")).split()[1])

q, k, v = (torch.randn(2, 8, 700, 64, requires_grad=True) for _ in range(3))
torch.set_num_threads(1)
out1 = tileattn.flash_attention(q, k, v, causal=True, window=(300, 0))
out1.sum().backward()
grads1 = [t.grad.clone() for t in (q, k, v)]
before = threads()
torch.set_num_threads(2)
for t in (q, k, v):
    t.grad = None
out2 = tileattn.flash_attention(q, k, v, causal=True, window=(300, 0))
out2.sum().backward()
ref = tileattn.reference(q, k, v, causal=True, window=(300, 0), compute_dtype=torch.float64)
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the pool's workers do not survive fork: the child starts its own. (No other torch op
    # runs there: torch's own OpenMP threads do not survive fork either, and its parallel ops hang.)
    with torch.no_grad():
        data = tileattn.flash_attention(q, k, v, causal=True, window=(300, 0)).numpy().tobytes()
    with os.fdopen(write, "wb") as f:
        f.write(data)
    os._exit(0)
os.close(write)
with os.fdopen(read, "rb") as f:
    forked = f.read()
child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
child = child if forked == out1.detach().numpy().tobytes() else "the forked child's output differs"
print(json.dumps(dict(openmp=nk.build_info()["openmp"], error=float((out2.detach().double() - ref).abs().max()),
                      bitwise=torch.equal(out1, out2) and all(torch.equal(a, t.grad) for a, t in zip(grads1, (q, k, v))),
                      workers=threads() - before, child=child)))
"""


def _clang_without_openmp():
    clang = shutil.which("clang")
    if clang is None:
        return None, "no clang here (scripts/ci_matrix.sh installs Debian's, without libomp)"
    if toolchain.openmp_links((clang,), ()):
        return None, "this clang links OpenMP programs (libomp is installed): the pool is not what it builds"
    return clang, ""


@pytest.mark.skipif(_clang_without_openmp()[0] is None, reason=_clang_without_openmp()[1])
def test_a_compiler_without_openmp_runs_the_kernels_on_a_thread_pool(tmp_path):
    """clang without libomp (macOS's situation) builds the kernels with no OpenMP at all: they run on
    their own POSIX-thread pool, exact, with the same bits at one thread and two, a second thread
    started for the second, and a forked child that starts its own."""
    res = run(["-c", NO_OPENMP], tmp_path, CC="clang", TILEATTN_NATIVE="compile")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["openmp"] is False and got["error"] < 1e-5 and got["bitwise"], got
    assert got["workers"] >= 1 and got["child"] == 0, got
    env = run(["-m", "tileattn", "env"], tmp_path, CC="clang", TILEATTN_NATIVE="compile")
    assert "a pool of POSIX threads (the compiler has no OpenMP runtime)" in env.stdout, env.stdout[-2000:]


@pytest.mark.skipif(_clang_without_openmp()[0] is None, reason=_clang_without_openmp()[1])
def test_a_compiler_without_openmp_passes_the_kernel_tests(tmp_path):
    selection = f"(test_native_kernels and ({VARIANT_TESTS})) or (test_user_functions and ({USER_VARIANT_TESTS}))"
    res = run(["-m", "pytest", "-x", "-p", "no:cacheprovider", "tests/test_native_kernels.py",
               "tests/test_user_functions.py", "-k", selection], tmp_path, CC="clang", TILEATTN_NATIVE="compile")
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
from tileattn.backends.native import checked, kernels as nk
import torch
print(nk.available())
try:
    checked.forward(*[torch.zeros(1, 1, 1, 8)] * 4, torch.zeros(1, 1, 1), scale=1.0)
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
    (dict(TILEATTN_NATIVE_ISA="sse9"), "TILEATTN_NATIVE_ISA='sse9'; expected one of avx512, avx2, neon, generic"),
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
from tileattn.backends.native import checked, kernels as nk
q, k, v = (torch.randn(1, 4, 300, 64) for _ in range(3))
out, lse = torch.empty_like(q), torch.empty(1, 4, 300)
for _ in range(5):
    checked.forward(q, k, v, out, lse, scale=0.125, right=0, num_threads=2)
fwd = nk.profile()
delta = (out * out).sum(-1)
dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
for _ in range(5):
    checked.backward(q, k, v, out, out, lse, delta, dq, dk, dv, scale=0.125, right=0, num_threads=2)
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
@pytest.mark.parametrize("isa,flags", [("generic", ("-march=armv8-a",)), ("neon", ("-march=armv8.4-a+bf16+i8mm",))])
def test_aarch64_variants_cross_compile(isa, flags, tmp_path):
    """What an aarch64 machine builds: the portable variant (NEON through vector extensions, FMAs from
    contraction) and the NEON one (with BFDOT at armv8.4-a+bf16): both translation units and the
    link, with the flags build.py uses; the library lists the cpuinfo Features it needs. scripts/check_aarch64.sh
    runs them under emulation."""
    lib = build._compile(_cross_compiler(), flags + ("-fopenmp",), isa, tmp_path)
    header = lib.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
    wants = prebuilt.features_of(lib)
    assert {"fp", "asimd"} <= wants and ("bf16" in wants) == (isa == "neon")


CALL_AFTER_DAMAGE = """
import json, warnings
import torch, tileattn
from tileattn.backends.native import build, kernels as nk
from tileattn.core.testing import check_against_reference
{setup}
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 70, 32, generator=g) for _ in range(3))
    engine = "native" if nk.available()[0] else "auto"
    verdicts = check_against_reference(lambda *a, **kw: tileattn.flash_attention(*a, backend=engine, **kw),
                                       q, k, v, causal=True, return_lse=True)
    ok = [v.name for v in verdicts if v.ok] == ["out", "lse", "dq", "dk", "dv"]
    tileattn.flash_attention(q, k, v)
print(json.dumps(dict(available=nk.available(), ok=ok, engine=engine,
                      cached=nk.build_info()["cached"] if nk.available()[0] else None,
                      warnings=[str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)])))
"""


def _damaged_cache_copy(tmp_path, how):
    """A copy of this session's native cache whose library is damaged `how`; the library's path."""
    from tileattn.backends.native import kernels as nk

    source = Path(nk.load().path)
    root = tmp_path / "cache"
    shutil.copytree(source.parent, root / "native" / source.parent.name)
    lib = root / "native" / source.parent.name / build.LIB_NAME
    data = bytearray(lib.read_bytes())
    if how == "truncated":  # the ELF headers survive, the mapped segments run past the end: SIGBUS
        data = data[: len(data) // 2]
    else:  # the ELF headers survive, the code is noise: SIGSEGV or SIGILL once called
        data[8192:] = random.Random(how).randbytes(len(data) - 8192)
    lib.write_bytes(bytes(data))
    return lib


@needs_cc
@pytest.mark.parametrize("how", ["truncated", "scrambled"])
def test_a_damaged_cached_library_is_rebuilt_not_loaded(how, tmp_path):
    """A damaged library in the cache used to kill every process that loaded it (SIGBUS, SIGSEGV)
    until the user deleted the cache. It fails its recorded size/hash, is rebuilt in place, and the
    call is correct against the fp64 reference (forward, LSE and gradients) with no warning."""
    lib = _damaged_cache_copy(tmp_path, how)
    res = run(["-c", CALL_AFTER_DAMAGE.format(setup="")], tmp_path)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-3000:]}"
    got = json.loads(res.stdout.splitlines()[-1])
    assert got == dict(available=[True, ""], ok=True, engine="native", cached=False, warnings=[]), got
    assert toolchain.damage(lib) is None  # rebuilt in place, with its record: the next process loads it


@needs_cc
def test_a_damaged_library_that_cannot_be_rebuilt_falls_back_to_the_cpu_engine_with_one_warning(tmp_path):
    lib = _damaged_cache_copy(tmp_path, "truncated")
    broken_compiler = 'build.BASE_FLAGS = build.BASE_FLAGS + ("-include", "/nonexistent.h")'
    res = run(["-c", CALL_AFTER_DAMAGE.format(setup=broken_compiler)], tmp_path)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-3000:]}"
    got = json.loads(res.stdout.splitlines()[-1])
    available, why = got["available"]
    assert not available and "is damaged" in why and "rebuilding it failed" in why and str(lib) in why, why
    assert got["ok"] and got["engine"] == "auto"
    assert len(got["warnings"]) == 1 and "rebuilding it failed" in got["warnings"][0], got["warnings"]
    assert "('cpu') serves every call" in got["warnings"][0]


def test_the_library_record_catches_a_changed_size_or_content(tmp_path):
    lib = tmp_path / build.LIB_NAME
    assert toolchain.damage(lib) == "missing"
    lib.write_bytes(b"\x7fELF" + bytes(1000))
    assert "no valid size/hash record" in toolchain.damage(lib)
    (tmp_path / build.RECORD_NAME).write_text(json.dumps(toolchain.fingerprint(lib)))
    assert toolchain.damage(lib) is None
    lib.write_bytes(b"\x7fELF" + bytes(999) + b"\x01")
    assert "its SHA-256 differs" in toolchain.damage(lib)
    lib.write_bytes(b"\x7fELF" + bytes(500))
    assert "504 bytes, 1004 when built" in toolchain.damage(lib)


def test_ci_matrix_lists_the_other_builds_this_machine_runs():
    """scripts/ci_matrix.sh asks scripts/other_native_builds.py which builds to add: it must run (a
    function it calls was once renamed and only CI's last stage failed) and name only buildable ones."""
    def here(args):  # this session's cache: the engine's library is built once for the whole suite
        return subprocess.run([sys.executable] + args, capture_output=True, text=True, cwd=ROOT, timeout=900)

    res = here(["scripts/other_native_builds.py"])
    assert res.returncode == 0, res.stderr[-2000:]
    listed = res.stdout.split()
    assert set(listed) <= {"avx2", "generic"} and len(listed) == len(set(listed)), listed
    default = json.loads(here(["-c", INFO]).stdout)["isa"] if CC is not None else None
    assert default not in listed
    if CC is not None:
        buildable = [isa for isa in ("avx2", "generic") if isa != default and isinstance(toolchain.variant(CC, isa), tuple)]
        assert listed == buildable
    else:
        assert listed == []
