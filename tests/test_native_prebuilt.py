"""Choosing between the wheel's prebuilt native libraries and a compile here (issue 37).

The prebuilt folder is a stand-in: copies of this session's compiled library under each variant's
name, with the records setup.py writes (the choice reads the CPU's flags, the records and the
folder, never the code). scripts/check_wheel.sh runs the real prebuilt libraries from the wheel on a
machine without a compiler; :func:`prebuilt.compile_all` is what setup.py runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tileattn.backends.native import build, prebuilt
from tileattn.programs import toolchain

ROOT = Path(__file__).resolve().parent.parent
SPR = prebuilt.LEVELS[0].cpu + ("amx_tile", "amx_bf16")     # Sapphire Rapids: every prebuilt level
SKYLAKE_X = tuple(f for f in SPR if not f.startswith(("amx", "avx512_bf16")))  # AVX-512 without BF16
OLD = prebuilt.LEVELS[2].cpu                                  # SSE4.2, no AVX2


def _stand_in(root: Path) -> Path:
    """A prebuilt/ folder holding this session's library under every variant's name."""
    from tileattn.backends.native import kernels as nk

    source = Path(nk.load().path)
    for level in prebuilt.LEVELS:
        folder = root / level.isa
        folder.mkdir(parents=True)
        lib = folder / build.LIB_NAME
        lib.write_bytes(source.read_bytes())
        (folder / build.RECORD_NAME).write_text(json.dumps(toolchain.fingerprint(lib)))
        (folder / prebuilt.META_NAME).write_text(json.dumps(dict(
            compiler="cc", compiler_version="cc 12", isa=level.isa, flags=list(level.flags) + ["-fopenmp"],
            features=[], cpu=list(level.cpu))))
    return root


@pytest.fixture
def wheel(tmp_path, monkeypatch):
    """The stand-in prebuilt folder in place of the package's; compiles recorded instead of run."""
    root = _stand_in(tmp_path / "prebuilt")
    monkeypatch.setattr(prebuilt, "PREBUILT_DIR", root)
    for name in (prebuilt.MODE_ENV, build.ISA_ENV, build.PROFILE_ENV):
        monkeypatch.delenv(name, raising=False)
    compiles = []

    def fake_build(isa=None, profile=False):
        if os.environ.get("CC") == "/nonexistent":
            raise build.BuildError("$CC='/nonexistent' is not an executable compiler")
        compiles.append(isa)
        return build.BuildInfo(compiler="cc", compiler_version="cc 12", isa=isa or "avx512", flags=("-march=native",),
                               path="/compiled.so", build_seconds=0.0, cached=True, features=(), source="compiled",
                               state_dir="/state")

    monkeypatch.setattr(build, "build", fake_build)
    return dataclasses.make_dataclass("Wheel", ["root", "compiles"])(root, compiles)


def cpu(monkeypatch, flags):
    monkeypatch.setattr(prebuilt, "cpu_flags", lambda: frozenset(flags))


def test_the_prebuilt_library_of_the_cpus_own_variant_is_loaded_without_a_compile(wheel, monkeypatch):
    cpu(monkeypatch, SPR)
    info = prebuilt.resolve()
    assert (info.source, info.isa, info.path) == ("prebuilt", "avx512", str(wheel.root / "avx512" / build.LIB_NAME))
    assert "as fast as a -march=native build" in info.reason and wheel.compiles == []
    assert info.flags[0] == "-march=x86-64-v4" and str(toolchain.cache_root()) in info.state_dir
    monkeypatch.setenv(build.ISA_ENV, "avx2")  # forced: that variant's prebuilt library
    info = prebuilt.resolve()
    assert (info.source, info.isa) == ("prebuilt", "avx2") and "forced by TILEATTN_NATIVE_ISA" in info.reason


def test_a_cpu_the_prebuilt_avx512_cannot_run_compiles_its_own_and_without_a_compiler_takes_avx2(wheel, monkeypatch):
    cpu(monkeypatch, SKYLAKE_X)
    info = prebuilt.resolve()
    assert info.source == "compiled" and wheel.compiles == [None]
    assert "best prebuilt variant this CPU runs is avx2, not avx512" in info.reason
    assert "prebuilt avx512 needs avx512_bf16, which this CPU lacks" in info.reason
    monkeypatch.setenv("CC", "/nonexistent")
    info = prebuilt.resolve()
    assert (info.source, info.isa) == ("prebuilt", "avx2")
    assert "compiling was tried first" in info.reason and "/nonexistent" in info.reason


def test_generic_compiles_where_it_can_since_its_native_build_is_faster(wheel, monkeypatch):
    cpu(monkeypatch, OLD)
    info = prebuilt.resolve()
    assert info.source == "compiled" and "-march=native build of the generic variant is faster" in info.reason
    monkeypatch.setenv("CC", "/nonexistent")
    assert (prebuilt.resolve().source, prebuilt.resolve().isa) == ("prebuilt", "generic")


def test_the_mode_variable_forces_a_compile_or_the_prebuilt_library(wheel, monkeypatch):
    cpu(monkeypatch, SPR)
    monkeypatch.setenv(prebuilt.MODE_ENV, "compile")
    assert prebuilt.resolve().source == "compiled" and wheel.compiles == [None]
    monkeypatch.setenv(prebuilt.MODE_ENV, "prebuilt")
    cpu(monkeypatch, OLD)
    info = prebuilt.resolve()
    assert (info.source, info.isa, info.reason) == ("prebuilt", "generic", "TILEATTN_NATIVE=prebuilt: the best "
                                                    "prebuilt variant this CPU runs")
    cpu(monkeypatch, ("sse2",))
    with pytest.raises(build.BuildError, match="TILEATTN_NATIVE=prebuilt, but prebuilt avx512 needs"):
        prebuilt.resolve()
    monkeypatch.setenv(prebuilt.MODE_ENV, "fast")
    with pytest.raises(build.BuildError, match="TILEATTN_NATIVE='fast'; expected one of auto, prebuilt, compile"):
        prebuilt.resolve()


def test_a_source_install_compiles(wheel, monkeypatch, tmp_path):
    monkeypatch.setattr(prebuilt, "PREBUILT_DIR", tmp_path / "absent")
    info = prebuilt.resolve()
    assert info.source == "compiled" and "carries no prebuilt library (a source install or a checkout)" in info.reason


@pytest.mark.parametrize("how", ["truncated", "record"])
def test_a_damaged_prebuilt_library_is_never_loaded(wheel, monkeypatch, how):
    cpu(monkeypatch, SPR)
    lib = wheel.root / "avx512" / build.LIB_NAME
    if how == "truncated":
        lib.write_bytes(lib.read_bytes()[:4096])
    else:
        (lib.parent / build.RECORD_NAME).write_text("{}")
    with pytest.warns(RuntimeWarning, match="prebuilt library .*avx512.*; compiled the native kernels"):
        info = prebuilt.resolve()
    assert info.source == "compiled"
    # without a compiler, the next variant this CPU runs, with one warning naming the damage
    monkeypatch.setenv("CC", "/nonexistent")
    with pytest.warns(RuntimeWarning, match="prebuilt library .*avx512.*; loaded the prebuilt avx2 library instead"):
        info = prebuilt.resolve()
    assert (info.source, info.isa) == ("prebuilt", "avx2") and "compiling instead failed" not in info.reason
    monkeypatch.setenv(prebuilt.MODE_ENV, "prebuilt")
    with pytest.warns(RuntimeWarning, match="loaded the prebuilt avx2 library instead"):
        assert prebuilt.resolve().isa == "avx2"


def test_every_damaged_variant_without_a_compiler_is_an_error_naming_the_damage(wheel, monkeypatch):
    cpu(monkeypatch, SPR)
    for level in prebuilt.LEVELS:
        lib = wheel.root / level.isa / build.LIB_NAME
        lib.write_bytes(lib.read_bytes()[:4096])
    monkeypatch.setenv("CC", "/nonexistent")
    with pytest.raises(build.BuildError, match="prebuilt library .*generic.* is damaged.*compiling instead failed"):
        prebuilt.resolve()


def _claim_a_feature_the_cpu_lacks(lib: Path) -> None:
    """Rewrite the feature list inside ``lib``'s bytes so it claims a feature no CPU has (a stand-in for
    an AVX-512 library copied into the avx2 folder), and its record so it matches: only the CPU check
    can refuse it."""
    data = lib.read_bytes()
    at = data.index(prebuilt.FEATURE_MARKER) + len(prebuilt.FEATURE_MARKER)
    end = data.index(b";", at)
    assert end - at >= 7, "the library's feature list is too short to rewrite"
    lib.write_bytes(data[:at] + b"zzzzzz," + data[at + 7:])
    (lib.parent / build.RECORD_NAME).write_text(json.dumps(toolchain.fingerprint(lib)))


def test_the_library_says_which_cpu_features_it_needs():
    from tileattn.backends.native import kernels as nk

    wants = prebuilt.features_of(Path(nk.load().path))
    assert wants and wants <= prebuilt.host_flags()
    assert {"avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl"}}.get(nk.load().isa, set()) <= wants


def test_a_library_copied_into_another_variants_folder_is_refused_before_it_loads(wheel, monkeypatch):
    cpu(monkeypatch, SPR)
    _claim_a_feature_the_cpu_lacks(wheel.root / "avx512" / build.LIB_NAME)
    assert "compiled for zzzzzz, which this CPU lacks" in prebuilt.verified(wheel.root / "avx512")[1]
    monkeypatch.setenv(prebuilt.MODE_ENV, "prebuilt")
    with pytest.warns(RuntimeWarning, match="compiled for zzzzzz, which this CPU lacks .*labelled avx512.*avx2"):
        info = prebuilt.resolve()
    assert (info.source, info.isa) == ("prebuilt", "avx2")


def test_a_loaded_library_is_refused_where_the_cpu_lacks_what_it_was_built_for(monkeypatch):
    from tileattn.backends.native import kernels as nk

    info = nk.load()
    wants = prebuilt.features_of(Path(info.path))
    lacking = frozenset(prebuilt.host_flags() - {sorted(wants)[0]})
    monkeypatch.setattr(prebuilt, "host_flags", lambda: lacking)
    with pytest.raises(build.BuildError, match=f"compiled for {sorted(wants)[0]}, which this CPU lacks.*SIGILL"):
        nk._Library(info)


MISLABELLED = """
import json, sys, warnings
from pathlib import Path
from tileattn.backends.native import prebuilt
prebuilt.PREBUILT_DIR = Path(sys.argv[1])
import torch, tileattn
from tileattn.backends.native import kernels as nk
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    out = tileattn.flash_attention(q, k, v, causal=True)
    ok = torch.allclose(out, tileattn.reference(q, k, v, causal=True), atol=1e-5)
print(json.dumps(dict(ok=ok, isa=nk.build_info()["isa"], warnings=[str(w.message) for w in caught])))
"""


@pytest.mark.parametrize("how", ["mislabelled", "truncated"])
def test_a_bad_variant_in_the_wheel_leaves_the_next_one_serving_in_a_real_process(tmp_path, how):
    """Every variant above generic claims a feature this CPU lacks (or is truncated): the process neither
    dies (SIGILL, SIGBUS) nor drops to the slow engine; generic serves, exact, with one warning."""
    root = _stand_in(tmp_path / "prebuilt")
    for level in prebuilt.LEVELS[:-1]:
        lib = root / level.isa / build.LIB_NAME
        if how == "mislabelled":
            _claim_a_feature_the_cpu_lacks(lib)
        else:
            lib.write_bytes(lib.read_bytes()[:4096])
    env = dict(os.environ, TILEATTN_NATIVE="prebuilt", TILEATTN_CACHE_DIR=str(tmp_path / "cache"))
    env.pop(build.ISA_ENV, None)
    res = subprocess.run([sys.executable, "-c", MISLABELLED, str(root)], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["ok"] and got["isa"] == "generic"
    assert len(got["warnings"]) == 1 and "loaded the prebuilt generic library instead" in got["warnings"][0]


DAMAGED_WITHOUT_COMPILER = """
import json, sys, warnings
from pathlib import Path
from tileattn.backends.native import prebuilt
prebuilt.PREBUILT_DIR = Path(sys.argv[1])
import torch, tileattn
from tileattn.backends.native import kernels as nk
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    out = tileattn.flash_attention(q, k, v, causal=True)
    ok = torch.allclose(out, tileattn.reference(q, k, v, causal=True), atol=1e-5)
    tileattn.flash_attention(q, k, v)
print(json.dumps(dict(ok=ok, available=nk.available(), warnings=[str(w.message) for w in caught])))
"""


def test_a_damaged_prebuilt_library_without_a_compiler_leaves_the_cpu_engine_and_one_warning(tmp_path):
    root = _stand_in(tmp_path / "prebuilt")
    for level in prebuilt.LEVELS:
        lib = root / level.isa / build.LIB_NAME
        lib.write_bytes(lib.read_bytes()[:4096])  # loaded, this would be SIGBUS
    env = dict(os.environ, CC="/nonexistent", TILEATTN_CACHE_DIR=str(tmp_path / "cache"))
    env.pop(prebuilt.MODE_ENV, None)
    res = subprocess.run([sys.executable, "-c", DAMAGED_WITHOUT_COMPILER, str(root)], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["ok"] and not got["available"][0] and "is damaged" in got["available"][1]
    assert len(got["warnings"]) == 1 and "('cpu') serves every call" in got["warnings"][0], got["warnings"]


def test_env_says_which_library_was_loaded_from_where_and_why(tmp_path):
    root = _stand_in(tmp_path / "prebuilt")
    code = ("import sys; from pathlib import Path; from tileattn.backends.native import prebuilt; "
            "prebuilt.PREBUILT_DIR = Path(sys.argv[1]); from tileattn.tools.cli import main; sys.exit(main(['env']))")
    env = dict(os.environ, TILEATTN_CACHE_DIR=str(tmp_path / "cache"), TILEATTN_NATIVE="prebuilt")
    res = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert "  status       available, the prebuilt library shipped in the wheel (nothing compiled here)" in lines
    why = next(line for line in lines if line.startswith("  why "))
    assert "TILEATTN_NATIVE=prebuilt: the best prebuilt variant this CPU runs" in why
    assert any(line.startswith("  library      " + str(root)) for line in lines)
    assert any(line.endswith(", when the wheel was built") for line in lines)


def test_the_cpu_flag_rule_is_the_compile_paths_rule():
    assert prebuilt.cpu_variant(frozenset(SPR)) == "avx512" == prebuilt.cpu_variant(frozenset(SKYLAKE_X))
    assert prebuilt.cpu_variant(frozenset(prebuilt.LEVELS[1].cpu)) == "avx2"
    assert prebuilt.cpu_variant(frozenset(OLD)) == "generic" == prebuilt.cpu_variant(frozenset(SPR), "generic")
    with pytest.raises(build.BuildError, match="TILEATTN_NATIVE_ISA='sse9'"):
        prebuilt.cpu_variant(frozenset(SPR), "sse9")
    if prebuilt.cpu_flags():  # on this machine: what the compiler's -march=native macros say
        try:
            cc = tuple(build.find_compiler())
        except build.BuildError:
            return
        assert prebuilt.cpu_variant(prebuilt.cpu_flags()) == toolchain.choose(cc)[0]


GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
"""
GRAVITON2 = GRAVITON3.replace("Features\t: fp", "Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
                              "fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nx:").split("\nx:")[0] + "\n"


def test_the_isa_table_is_the_one_list():
    """Every variant is a branch of simd.h; every prebuilt level a unique folder of a variant of its
    architecture; on aarch64 the cpuinfo "Features" line decides, the Graviton 3 runs the bf16 level
    and the Graviton 2 the dotprod one."""
    simd = (Path(build.CSRC) / "simd.h").read_text()
    names = [level.name for row in toolchain.ISA_TABLE for level in row.levels]
    assert len(names) == len(set(names))
    for row in toolchain.ISA_TABLE:
        assert f"defined(TA_ISA_{row.name.upper()})" in simd, row.name
        assert all(level.isa == row.name and row.arch in (None, level.arch) for level in row.levels)
    assert [level.name for level in toolchain.levels("aarch64")] == ["neon-bf16", "neon-dotprod", "neon"]
    assert [level.name for level in toolchain.levels("x86_64")] == [level.name for level in prebuilt.LEVELS] or \
        prebuilt.HOST_ARCH != "x86_64"
    g3 = prebuilt.cpuinfo_flags(GRAVITON3.splitlines())
    g2 = prebuilt.cpuinfo_flags(GRAVITON2.splitlines())
    assert "bf16" in g3 and "bf16" not in g2 and "asimddp" in g2
    assert toolchain.cpu_variant(g3, "aarch64") == "neon" == toolchain.cpu_variant(g2, "aarch64")
    assert toolchain.cpu_variant(frozenset(), "aarch64") == "generic"
    runs = lambda flags: [lv.name for lv in toolchain.levels("aarch64") if set(lv.cpu) <= flags]  # noqa: E731
    assert runs(g3) == ["neon-bf16", "neon-dotprod", "neon"] and runs(g2) == ["neon-dotprod", "neon"]
    assert prebuilt.cpuinfo_flags(["flags\t\t: fpu sse2 avx2", "Features: x"]) == {"fpu", "sse2", "avx2"}
