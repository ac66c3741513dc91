"""The machine's C toolchain and the verified on-disk cache of what it builds: one place for the native
engine's kernels (:mod:`tileattn.backends.native.build`) and the compiled user functions
(:mod:`tileattn.programs.compiler`).

Compiler: ``$CC`` if set, else the first of ``cc``, ``gcc``, ``clang`` on ``PATH``. Variants of the
instruction set, best first (:data:`ISA_TABLE`, the one list that this module, the engine's build
and its prebuilt libraries read):

* ``avx512``: AVX-512 F/BW/VL + FMA (``-march=native`` on such a CPU)
* ``avx2``: AVX2 + FMA, built with ``-mno-avx512f`` so it runs on CPUs without AVX-512
* ``neon``: aarch64 Advanced SIMD (``-mcpu=native``; BFDOT where the CPU has bf16)
* ``generic``: portable vector extensions only (the machine's own flags; on x86 without AVX-512)

Each variant adds ``-fopenmp`` where the compiler links an OpenMP program; without an OpenMP
runtime the kernels run on their own pool of POSIX threads (``tileattn env`` says which).

``TILEATTN_NATIVE_ISA`` (``avx512``, ``avx2``, ``neon``, ``generic``) forces one. The cache root is
``$TILEATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/tileattn``, else ``~/.cache/tileattn``.

A library in the cache is only ever loaded after a check: its size and SHA-256 are recorded beside it
when it is built (``library.json``) and compared before every load. A truncated, scrambled or
replaced file (which would kill the process that maps it: SIGBUS, SIGSEGV, or silently run other
code) is rebuilt under the folder's ``fcntl`` lock instead (:func:`cached_library`). Libraries are
linked under a temporary name and renamed into place, so no process ever loads a half-written file.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Tuple

ISA_ENV = "TILEATTN_NATIVE_ISA"


# ------------------------------------------------------------------------------ the instruction sets


@dataclass(frozen=True)
class Arch:
    name: str       #: as platform.machine() and the manylinux tags spell it
    macro: str      #: what the compiler predefines for it
    native: tuple   #: the flags of a build for the compiling machine's own CPU
    cpuinfo: str    #: the /proc/cpuinfo field that lists the CPU's features


@dataclass(frozen=True)
class Level:
    """A prebuilt library of the platform wheel (:mod:`tileattn.backends.native.prebuilt`)."""

    name: str       #: its folder under prebuilt/
    isa: str        #: the variant it is
    arch: str       #: the architecture its flags compile for
    flags: tuple    #: compile flags besides BASE_FLAGS and -fopenmp, never -march=native
    cpu: tuple      #: /proc/cpuinfo features the CPU must have (everything the flags let the compiler emit)


@dataclass(frozen=True)
class Isa:
    """A variant of the kernels: simd.h's TA_ISA_<NAME> branch."""

    name: str
    arch: Optional[str]   #: the architecture it is written for; None: any
    macros: tuple         #: compiler macros a build needs (with the native flags)
    cpu: tuple            #: /proc/cpuinfo features a CPU needs for the compile path to pick it
    levels: tuple = ()    #: its prebuilt libraries, best first
    extra: tuple = ()     #: (architecture, flags) added to the native flags there
    uses: tuple = ()      #: macros that change what a build of it uses (a cache key, build.json)


ARCHES = (
    Arch("x86_64", "__x86_64__", ("-march=native",), "flags"),
    Arch("aarch64", "__aarch64__", ("-mcpu=native",), "Features"),
)
_NO_AVX512 = (("x86_64", ("-mno-avx512f",)),)
_V2 = ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3")
_V3 = _V2 + ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave")  # abm: LZCNT
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
_A80 = ("fp", "asimd")
_A82 = _A80 + ("atomics", "crc32", "asimdrdm", "fphp", "asimdhp", "asimddp")
#: armv8.4-a, not 8.6-a: Graviton 3 (Neoverse V1) is armv8.4 with bf16 and i8mm, and lacks 8.5's FRINT
_A84 = _A80 + ("atomics", "crc32", "asimdrdm", "asimddp", "fcma", "jscvt", "bf16", "i8mm")
#: the variants, best first. AMX needs no CPU flag here (the kernels ask the OS at run time); the
#: prebuilt levels' cpu lists are what csrc/simd.h writes into each library (ta_cpu_features)
ISA_TABLE = (
    Isa("avx512", "x86_64", ("__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__FMA__"),
        ("avx512f", "avx512bw", "avx512vl", "fma"),
        (Level("avx512", "avx512", "x86_64", ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
               _V4 + ("avx512_bf16",)),),
        uses=("__AVX512BF16__", "__AVX512FP16__")),
    Isa("avx2", "x86_64", ("__AVX2__", "__FMA__"), ("avx2", "fma"),
        (Level("avx2", "avx2", "x86_64", ("-march=x86-64-v3",), _V3),), _NO_AVX512, ("__F16C__",)),
    Isa("neon", "aarch64", ("__ARM_NEON",), ("asimd",),
        (Level("neon-bf16", "neon", "aarch64", ("-march=armv8.4-a+bf16+i8mm",), _A84),
         Level("neon-dotprod", "neon", "aarch64", ("-march=armv8.2-a+fp16+dotprod",), _A82),
         Level("neon", "neon", "aarch64", ("-march=armv8-a",), _A80)),
        uses=("__ARM_FEATURE_BF16_VECTOR_ARITHMETIC", "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC",
              "__ARM_FEATURE_DOTPROD", "__ARM_FEATURE_MATMUL_INT8", "__ARM_FEATURE_SVE")),
    Isa("generic", None, (), (), (Level("generic", "generic", "x86_64", ("-march=x86-64-v2",), _V2),), _NO_AVX512,
        ("__AVX__", "__F16C__", "__FMA__")),
)
ISAS = tuple(row.name for row in ISA_TABLE)
ISA = {row.name: row for row in ISA_TABLE}
#: macros that decide which variant can run and what it can use (the cache key, build.json)
ISA_MACROS = tuple(dict.fromkeys([arch.macro for arch in ARCHES] +
                                 [m for row in ISA_TABLE for m in row.macros + row.uses]))


def levels(arch: str) -> tuple:
    """The prebuilt levels for ``arch``, best first."""
    return tuple(level for row in ISA_TABLE for level in row.levels if level.arch == arch)


def isas_of(arch: Optional[str]) -> tuple:
    """The variants a machine of ``arch`` may build or run, best first."""
    return tuple(row for row in ISA_TABLE if row.arch in (None, arch))


def cpu_variant(flags: frozenset, arch: Optional[str]) -> str:
    """The variant the compile path builds on a CPU of ``arch`` with these /proc/cpuinfo features
    (:func:`variant`'s rule, read from the CPU instead of the compiler's macros)."""
    return next(row.name for row in isas_of(arch) if set(row.cpu) <= flags)
BASE_FLAGS = ("-O3", "-fPIC", "-std=gnu11", "-fno-strict-aliasing")
#: the size and SHA-256 of a cached library, written when it is built, checked before it is loaded
RECORD_NAME = "library.json"


class BuildError(RuntimeError):
    """Nothing can be built or loaded here; the message says why in one line."""


def cache_root() -> Path:
    root = os.environ.get("TILEATTN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tileattn")
    return Path(root)


def find_compiler() -> list:
    """The compiler command as an argument list, or BuildError."""
    env = os.environ.get("CC")
    if env:
        cmd = shlex.split(env)
        if not cmd or shutil.which(cmd[0]) is None:
            raise BuildError(f"$CC={env!r} is not an executable compiler")
        return cmd
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return [name]
    raise BuildError("no C compiler found (tried $CC, cc, gcc, clang); install gcc or clang, or set $CC")


def run(cmd, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


@functools.lru_cache(maxsize=None)
def compiler_version(cc: tuple) -> str:
    try:
        res = run(list(cc) + ["--version"], timeout=30)
    except OSError as exc:
        raise BuildError(f"compiler {' '.join(cc)!r} cannot run: {exc}") from exc
    if res.returncode != 0:
        raise BuildError(f"compiler {' '.join(cc)!r} failed to report its version: {res.stderr.strip()[:200]}")
    return (res.stdout.strip().splitlines() or ["unknown"])[0]


@functools.lru_cache(maxsize=None)
def macros(cc: tuple, flags: tuple):
    """Macros the compiler predefines with these flags, or None when it rejects the flags."""
    res = run(list(cc) + list(flags) + ["-dM", "-E", "-x", "c", os.devnull], timeout=30)
    if res.returncode != 0:
        return None
    return frozenset(line.split()[1] for line in res.stdout.splitlines() if line.startswith("#define "))


def target_arch(cc: tuple) -> Optional[Arch]:
    """The architecture ``cc`` compiles for (a cross compiler's target), None when not in ARCHES."""
    found = macros(cc, ())
    if found is None:
        raise BuildError(f"compiler {' '.join(cc)!r} cannot preprocess C")
    return next((arch for arch in ARCHES if arch.macro in found), None)


def _arch_flags(cc: tuple) -> tuple:
    arch = target_arch(cc)
    for flags in ((arch.native,) if arch else ()) + (("-march=native",), ("-mcpu=native",), ()):
        if macros(cc, flags) is not None:
            return flags
    raise BuildError(f"compiler {' '.join(cc)!r} cannot preprocess C")


def variant(cc: tuple, isa: str):
    """(flags, macros) for one variant, or a reason string when this CPU/compiler cannot build it."""
    row, arch = ISA[isa], target_arch(cc)
    if row.arch is not None and (arch is None or arch.name != row.arch):
        return f"{isa} is for {row.arch}, and the compiler builds for {arch.name if arch else 'another architecture'}"
    flags = _arch_flags(cc) + sum((extra for name, extra in row.extra if arch and name == arch.name), ())
    found = macros(cc, flags)
    if found is None:
        return f"the compiler rejects {' '.join(flags)}"
    missing = [m.strip("_") for m in row.macros if m not in found]
    if missing:
        return f"this CPU (as the compiler sees it with {' '.join(flags) or 'no flags'}) lacks {', '.join(missing)}"
    if openmp_links(cc, flags):
        flags = flags + ("-fopenmp",)
    return flags, found


_OPENMP_PROBE = "#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n"


@functools.lru_cache(maxsize=None)
def openmp_links(cc: tuple, flags: tuple) -> bool:
    """Whether ``-fopenmp`` compiles and links a program that includes omp.h. A compiler can accept the
    flag and define _OPENMP without an OpenMP runtime to link (clang without libomp, as on macOS);
    such a build runs its kernels on the library's own POSIX-thread pool instead (csrc/threads.c)."""
    with tempfile.TemporaryDirectory(prefix="tileattn-omp-") as tmp:
        src = Path(tmp) / "omp.c"
        src.write_text(_OPENMP_PROBE)
        try:
            res = run(list(cc) + list(flags) + ["-fopenmp", str(src), "-o", str(Path(tmp) / "omp")], timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return res.returncode == 0


def choose(cc: tuple, isa=None):
    """(variant, flags, macros): the best variant this machine builds, or the forced one."""
    forced = (isa or os.environ.get(ISA_ENV, "")).strip().lower()
    if forced and forced not in ISAS:
        raise BuildError(f"{ISA_ENV}={forced!r}; expected one of {', '.join(ISAS)}")
    reasons = []
    for name in ((forced,) if forced else ISAS):
        got = variant(cc, name)
        if isinstance(got, tuple):
            return name, got[0], got[1]
        reasons.append(f"{name}: {got}")
    raise BuildError("no native variant can be built: " + "; ".join(reasons))


def toolchain() -> Tuple[tuple, str, str, tuple]:
    """``(compiler command, its version line, variant, flags)`` this machine compiles with."""
    cc = tuple(find_compiler())
    isa, flags, _ = choose(cc)
    return cc, compiler_version(cc), isa, flags


# ------------------------------------------------------------------------------ the verified cache


def fingerprint(path: Path) -> dict:
    return dict(size=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def damage(lib: Path, what: str = "cached library") -> Optional[str]:
    """None when ``lib`` matches the size and hash recorded when it was built, else what is wrong
    ("missing" when there is no library at all); ``what`` names it in the message."""
    if not lib.exists():
        return "missing"
    try:
        record = json.loads((lib.parent / RECORD_NAME).read_text())
        size, digest = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"the {what} {lib} has no valid size/hash record ({RECORD_NAME})"
    try:
        if lib.stat().st_size != size:
            return f"the {what} {lib} is damaged: {lib.stat().st_size} bytes, {size} when built"
        if fingerprint(lib)["sha256"] != digest:
            return f"the {what} {lib} is damaged: its SHA-256 differs from the one recorded when built"
    except OSError as exc:
        return f"the {what} {lib} cannot be read: {exc}"
    return None


def install(built: Path, lib: Path) -> None:
    """Move a freshly linked library into place with its record (each by an atomic rename: a reader
    that sees the new library with the old record finds a mismatch and waits for the lock)."""
    record = lib.parent / f"{RECORD_NAME}.{os.getpid()}.tmp"
    record.write_text(json.dumps(fingerprint(built)))
    os.replace(built, lib)
    os.replace(record, lib.parent / RECORD_NAME)


def cached_library(lib: Path, make: Callable[[Path], Path]) -> Tuple[bool, float]:
    """Make sure ``lib`` is in the cache and matches its record: ``(was cached, seconds spent
    building)``. ``make(workdir)`` builds the library in a temporary folder and returns its path; it
    runs under the folder's lock, so concurrent processes build it once. A damaged library is rebuilt;
    when that fails the BuildError names the damage."""
    if damage(lib) is None:
        return True, 0.0
    folder = lib.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create the cache folder {folder}: {exc}") from exc
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        found = damage(lib)
        if found is None:  # another process built it while this one waited
            return True, 0.0
        start = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(dir=folder, prefix="build-") as tmp:
                install(make(Path(tmp)), lib)
        except (BuildError, OSError) as exc:
            if found == "missing":
                raise
            raise BuildError(f"{found}, and rebuilding it failed: {exc}") from exc
        return False, time.perf_counter() - start
