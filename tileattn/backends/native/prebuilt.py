"""The native library prebuilt into the platform wheel, and which library a process loads.

The Linux wheels (``setup.py``, docs/install.md) carry the kernels compiled for three levels of their
architecture (``toolchain.ISA_TABLE``), each with an explicit flag set, never ``-march=native`` /
``-mcpu=native`` (which would bake the build machine's instruction set into the wheel), all with
``-fopenmp`` (``auditwheel repair`` bundles libgomp). x86-64:

* ``avx512``: ``-march=x86-64-v4 -mavx512bf16 -mamx-tile -mamx-bf16``: the AMX bf16 tiles (used only
  where Linux grants the tile state: ``ta_amx_available``) and the vdpbf16ps tiles; runs on CPUs with
  AVX-512 F/BW/CD/DQ/VL and AVX512_BF16 (Sapphire Rapids and later, Cooper Lake, Zen 4 and later)
* ``avx2``: ``-march=x86-64-v3`` (AVX2, FMA, F16C, BMI: Haswell, Zen 1 and later)
* ``generic``: ``-march=x86-64-v2`` (SSE4.2: the portable code on 16-byte vectors)

aarch64 (the ``neon`` variant at three levels):

* ``neon-bf16``: ``-march=armv8.4-a+bf16+i8mm``: the BFDOT tiles (Graviton 3 and 4, Neoverse V1/V2/N2,
  Apple M2 and later; not armv8.6-a, whose FRINT the Graviton 3 lacks)
* ``neon-dotprod``: ``-march=armv8.2-a+fp16+dotprod`` (Graviton 2, Neoverse N1, Ampere Altra, Apple M1)
* ``neon``: ``-march=armv8-a`` (every aarch64 CPU)

Each sits in ``prebuilt/<level>/`` beside its size/SHA-256 record (``library.json``, checked before
every load like a cached library's) and ``build.json`` (compiler, flags, macros). The CPU's
features come from ``/proc/cpuinfo``; a prebuilt library is loaded only on a CPU that has every
feature its flags let the compiler use (:data:`LEVELS`).

Which library a process loads (:func:`resolve`) follows ``TILEATTN_NATIVE``:

* ``auto`` (default): the prebuilt library of the variant the compile path would build for this CPU
  (its best: avx512 where the CPU has AVX-512 F/BW/VL + FMA, else avx2 where it has AVX2 + FMA, neon
  on aarch64, else generic; ``TILEATTN_NATIVE_ISA`` forces one) when that is avx512 or avx2: they
  measured as fast as the ``-march=native`` builds (docs/install.md). A compile for this CPU instead
  when the variant is generic or neon (:data:`NATIVE_WINS`), when no prebuilt library
  is that variant (a CPU with AVX-512 but without AVX512_BF16, a source install), or when it is
  damaged (with one warning). Where that compile fails, the best prebuilt library the CPU runs;
  a damaged one is never loaded: the next variant this CPU runs serves (with one warning), and with
  none left and no compiler the ``cpu`` engine (one warning)
* ``prebuilt``: the best prebuilt variant this CPU runs, never a compile (a damaged one passed over)

Before a prebuilt library is chosen, the CPU features it was compiled for are read from its own bytes
(csrc/api.c writes them after a marker) and compared with the host's: a library copied into another
variant's folder, with its records, is refused like a damaged one instead of dying of SIGILL at its
first kernel call. Once loaded, ``ta_isa_features()`` is checked again (kernels.py).
* ``compile``: always compile on first use (:mod:`.build`), as a source install does

``TILEATTN_NATIVE_PROFILE=1`` always compiles (the profiling counters are not in the wheel). The
choice and its reason are in :class:`~.build.BuildInfo` (``source``, ``reason``) and ``tileattn env``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import tempfile
import warnings
from pathlib import Path
from typing import Optional, Tuple

from ...programs import toolchain
from ...programs.toolchain import Level  # noqa: F401  (a prebuilt level, as this module's users name it)
from . import build
from .build import LIB_NAME, BuildError, BuildInfo

PREBUILT_DIR = Path(__file__).resolve().parent / "prebuilt"
MODE_ENV = "TILEATTN_NATIVE"
MODES = ("auto", "prebuilt", "compile")
#: what setup.py writes beside each prebuilt library (the record of its size and hash is library.json)
META_NAME = "build.json"


#: the architecture this process runs on, as the ISA table names it
HOST_ARCH = platform.machine()
#: variants whose -march=native build measured faster than the prebuilt one (docs/install.md: generic,
#: whose prebuilt library is SSE4.2 while a compile uses whatever the CPU has above it), or that were
#: never measured against it (neon: docs/install.md; a -mcpu=native build can only match or beat a
#: fixed level); ``auto`` compiles these where a compiler works
NATIVE_WINS = frozenset({"generic", "neon"})
#: the prebuilt levels of this architecture, best first (toolchain.ISA_TABLE)
LEVELS = toolchain.levels(HOST_ARCH)


def cpuinfo_flags(lines) -> frozenset:
    """The feature flags of the first CPU that /proc/cpuinfo's ``lines`` describe: x86's "flags",
    aarch64's "Features" (empty when there is neither)."""
    keys = {arch.cpuinfo for arch in toolchain.ARCHES}
    for line in lines:
        key, colon, value = line.partition(":")
        if colon and key.strip() in keys:
            return frozenset(value.split())
    return frozenset()


@functools.lru_cache(maxsize=None)
def host_flags() -> frozenset:
    """The feature flags of the CPU this process runs on, as Linux lists them (empty where
    /proc/cpuinfo cannot be read). What the guard against loading a library this CPU cannot run
    (:func:`features_of`) reads."""
    try:
        with open("/proc/cpuinfo") as f:
            return cpuinfo_flags(f)
    except OSError:
        return frozenset()


def cpu_flags() -> frozenset:
    """The CPU's flags the choice of a variant reads: :func:`host_flags` (the tests stand in other CPUs
    here; the guard still reads the real one)."""
    return host_flags()


#: what precedes the library's feature list in its bytes (csrc/api.c, ``ta_isa_features``)
FEATURE_MARKER = b"tileattn-isa-features:"


def features_of(lib: Path) -> Optional[frozenset]:
    """The CPU features ``lib`` was compiled to use, read from its bytes without loading it (None when
    it carries no list: a library older than the list)."""
    data = lib.read_bytes()
    at = data.find(FEATURE_MARKER)
    if at < 0:
        return None
    end = data.find(b";", at)
    return frozenset(f for f in data[at + len(FEATURE_MARKER):end].decode("ascii", "replace").split(",") if f)


def unrunnable(lib: Path) -> Optional[str]:
    """Why this CPU cannot run ``lib`` (the features it was compiled for that the CPU lacks), or None.
    Loading such a library kills the process with SIGILL at its first vector instruction."""
    have = host_flags()
    wants = features_of(lib)
    if not have:
        return None  # no /proc/cpuinfo to compare with: the variant's own CPU rule decided
    if wants is None:
        return f"the library {lib} does not say which CPU features it needs (no {FEATURE_MARKER.decode()} list)"
    missing = sorted(wants - have)
    if missing:
        return f"the library {lib} was compiled for {', '.join(missing)}, which this CPU lacks"
    return None


def cpu_variant(flags: frozenset, isa: Optional[str] = None) -> str:
    """The variant the compile path builds on a CPU with these flags (:func:`toolchain.variant`'s rule,
    read from the CPU's flags instead of the compiler's macros), or the forced one."""
    forced = (isa or os.environ.get(build.ISA_ENV, "")).strip().lower()
    if forced:
        if forced not in build.ISAS:
            raise BuildError(f"{build.ISA_ENV}={forced!r}; expected one of {', '.join(build.ISAS)}")
        return forced
    return toolchain.cpu_variant(flags, HOST_ARCH)


# ------------------------------------------------------------------------------ building (setup.py)


def target_levels(cc: tuple) -> tuple:
    """The levels the compiler ``cc`` builds: those of the architecture it compiles for (a cross
    compiler builds another architecture's wheel)."""
    arch = toolchain.target_arch(cc)
    return toolchain.levels(arch.name) if arch else ()


def unbuildable(cc: tuple) -> Optional[str]:
    """Why the compiler ``cc`` cannot build every level of its architecture (its flags, or OpenMP), or
    None."""
    if not target_levels(cc):
        return f"compiler {' '.join(cc)!r} builds for an architecture without prebuilt levels"
    for level in target_levels(cc):
        flags = level.flags + ("-fopenmp",)
        macros = toolchain.macros(cc, flags)
        if macros is None or "_OPENMP" not in macros:
            return f"compiler {' '.join(cc)!r} rejects {' '.join(flags)} (prebuilt {level.name})"
    return None


def compile_all(dest: Path, cc: tuple) -> list:
    """Compile every level of the compiler's architecture into ``dest/<level>/`` with its records; the
    levels built. Runs at wheel build time (setup.py), with explicit flags only."""
    why = unbuildable(cc)
    if why:
        raise BuildError(why)
    version = toolchain.compiler_version(cc)
    built = []
    for level in target_levels(cc):
        flags = level.flags + ("-fopenmp",)
        macros = toolchain.macros(cc, flags)
        folder = dest / level.name
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder, prefix="build-") as tmp:
            toolchain.install(build._compile(cc, flags, level.isa, Path(tmp)), folder / LIB_NAME)
        meta = dict(compiler=" ".join(cc), compiler_version=version, isa=level.isa, flags=list(flags),
                    features=[m for m in build.ISA_MACROS if m in macros], cpu=list(level.cpu), level=level.name)
        (folder / META_NAME).write_text(json.dumps(meta, indent=1))
        built.append(level.name)
    return built


# ------------------------------------------------------------------------------ choosing at run time


@dataclasses.dataclass(frozen=True)
class Found:
    """The best prebuilt library this CPU runs, or why there is none."""

    info: Optional[BuildInfo]   #: the verified library, or None
    why_not: str                #: why the variants above it (or all) were passed over; "" when none was
    damaged: bool = False       #: True when a variant the CPU would run failed its record or its CPU check


def verified(folder: Path) -> Tuple[Optional[BuildInfo], str]:
    """(the verified prebuilt library in ``folder``, "") or (None, what is wrong with it)."""
    lib = folder / LIB_NAME
    broken = toolchain.damage(lib, "prebuilt library")
    try:
        meta = json.loads((folder / META_NAME).read_text())
        info = dict(compiler=str(meta["compiler"]), compiler_version=str(meta["compiler_version"]),
                    isa=str(meta["isa"]), flags=tuple(meta["flags"]), features=tuple(meta["features"]))
    except (OSError, ValueError, KeyError, TypeError):
        broken = broken or f"the prebuilt library {lib} has no valid {META_NAME}"
    if broken:
        return None, f"the prebuilt library {lib} is missing" if broken == "missing" else broken
    wrong = unrunnable(lib)
    if wrong:
        return None, f"{wrong} (labelled {info['isa']}: a copy from another variant's folder?)"
    state = toolchain.cache_root() / "native" / f"prebuilt-{info['isa']}-{toolchain.fingerprint(lib)['sha256'][:20]}"
    return BuildInfo(path=str(lib), build_seconds=0.0, cached=True, source="prebuilt", state_dir=str(state),
                     **info), ""


def best_prebuilt(flags: frozenset, only: Optional[str] = None) -> Found:
    """The best prebuilt variant a CPU with these flags runs (only ``only`` when given)."""
    if not PREBUILT_DIR.is_dir():
        return Found(None, "this install carries no prebuilt library (a source install or a checkout)")
    passed, damaged = [], False
    for level in LEVELS:
        if only and level.isa != only:
            continue
        missing = [f for f in level.cpu if f not in flags]
        if missing:
            passed.append(f"prebuilt {level.name} needs {', '.join(missing)}, which this CPU lacks")
            continue
        info, broken = verified(PREBUILT_DIR / level.name)
        if info is not None:
            return Found(info, "; ".join(passed), damaged=damaged)
        # a damaged (or mislabelled) variant is passed over for the next one this CPU runs
        passed.append(broken)
        damaged = True
    return Found(None, "; ".join(passed), damaged=damaged)


def resolve(isa: Optional[str] = None, profile: Optional[bool] = None) -> BuildInfo:
    """The library this process loads (see the module's docstring): prebuilt or compiled here, with
    the reason in ``reason``. BuildError when there is none."""
    mode = os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    if mode not in MODES:
        raise BuildError(f"{MODE_ENV}={mode!r}; expected one of {', '.join(MODES)}")
    if profile is None:
        profile = os.environ.get(build.PROFILE_ENV, "").strip() == "1"
    if profile or mode == "compile":
        why = f"{build.PROFILE_ENV}=1 compiles the profiling build" if profile else f"{MODE_ENV}=compile"
        return dataclasses.replace(build.build(isa, profile), reason=why)
    forced = isa or os.environ.get(build.ISA_ENV)
    wanted = cpu_variant(cpu_flags(), isa)
    found = best_prebuilt(cpu_flags(), wanted if forced else None)
    if mode == "prebuilt":
        if found.info is None:
            raise BuildError(f"{MODE_ENV}=prebuilt, but {found.why_not}")
        _warn_passed_over(found)
        return dataclasses.replace(found.info, reason=f"{MODE_ENV}=prebuilt: the best prebuilt variant this CPU runs")
    matches = found.info is not None and found.info.isa == wanted
    if matches and wanted not in NATIVE_WINS:
        return dataclasses.replace(found.info, reason=(
            f"the prebuilt {wanted} library is the variant {'forced by ' + build.ISA_ENV if forced else 'this CPU'}"
            " would compile, and as fast as a -march=native build (docs/install.md)"))
    if matches:
        why = (f"a -march=native build of the {wanted} variant is faster than the prebuilt one "
               f"({' '.join(found.info.flags)}; docs/install.md)")
    elif found.info is not None:
        why = f"the best prebuilt variant this CPU runs is {found.info.isa}, not {wanted} ({found.why_not})"
    else:
        why = found.why_not
    try:
        compiled = build.build(isa)
    except BuildError as exc:
        if found.info is not None:
            _warn_passed_over(found)
            return dataclasses.replace(found.info, reason=(
                f"the best prebuilt library this CPU runs; compiling was tried first, since {why}, and failed: {exc}"))
        raise BuildError(f"{why}, and compiling instead failed: {exc}" if found.damaged else str(exc)) from exc
    if found.damaged:
        warnings.warn(f"tileattn: {why}; compiled the native kernels for this CPU instead", RuntimeWarning,
                      stacklevel=3)
    return dataclasses.replace(compiled, reason=f"compiled for this CPU: {why}")


def _warn_passed_over(found: Found) -> None:
    if found.damaged:
        warnings.warn(f"tileattn: {found.why_not}; loaded the prebuilt {found.info.isa} library instead",
                      RuntimeWarning, stacklevel=4)
