"""Compile the native kernels on first use, for this machine's CPU, into a per-user cache.

The C sources in ``csrc/`` are compiled by the machine's C compiler (``$CC`` if set, else the first
of ``cc``, ``gcc``, ``clang`` on ``PATH``) with ``-O3`` and the CPU's own instruction set
(``-march=native``, or ``-mcpu=native`` where that is the spelling). Three variants exist:

* ``avx512``: AVX-512 F/BW/VL + FMA (uses ``vdpbf16ps`` where the CPU has AVX512_BF16)
* ``avx2``: AVX2 + FMA, built with ``-mno-avx512f`` so it runs on CPUs without AVX-512
* ``generic``: portable vector extensions only (no intrinsics), for CPUs without a hand-written
  variant (aarch64 NEON, ...): the machine's own flags, so the compiler picks the vector instructions
  and contracts a*b+c into FMAs (on x86 it is built without AVX-512: AVX2 + FMA through the
  portable code)

The best variant the CPU supports is chosen, or the one named by ``TILEATTN_NATIVE_ISA``
(``avx512``, ``avx2``, ``generic``; for tests and for machines whose compiler misreports).
``TILEATTN_NATIVE_PROFILE=1`` builds the same variant with per-phase time-stamp counters
(``-DTA_PROFILE=1``, csrc/profile.h) into its own cache folder; ``kernels.profile()`` reads them.

The library lands in ``<cache>/native/<variant>-<key>/libtileattn_native.so`` where ``<cache>`` is
``$TILEATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/tileattn``, else ``~/.cache/tileattn``, and the key
hashes the sources, the compiler's identity and version, the flags and the instruction-set macros
the compiler enables for this CPU. A different CPU, compiler or source gets its own folder. Several
processes starting at once serialise on an ``fcntl`` lock in that folder; the library is linked
under a temporary name and renamed into place, so no process ever loads a half-written file.

A library damaged later (a truncated copy, a disk error, stray writes) would kill any process that
loads it (SIGBUS, SIGSEGV, SIGILL), so its size and SHA-256 are recorded beside it at build time
(``library.json``) and checked before every load (about a millisecond, once per process). A library
that does not match its record, or has none, is rebuilt under the lock; when that fails the
BuildError names the damage and the engine falls back to ``cpu`` with one warning.

Failures raise :class:`BuildError` with a reason meant for a one-line warning (no compiler, a
compile error with the compiler's last lines, an unsupported variant).
"""

from __future__ import annotations

import dataclasses
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_NAME = "libtileattn_native.so"
#: the size and SHA-256 of the library, written when it is built, checked before it is loaded
RECORD_NAME = "library.json"
ISA_ENV = "TILEATTN_NATIVE_ISA"
PROFILE_ENV = "TILEATTN_NATIVE_PROFILE"
ISAS = ("avx512", "avx2", "generic")
#: translation units: (source, value of TA_REAL_BITS); the kernels are compiled once per real type
UNITS = (("kernels.c", 32), ("kernels.c", 64))
BASE_FLAGS = ("-O3", "-fPIC", "-std=gnu11", "-fno-strict-aliasing")
#: macros that decide which variant can run and what it can use
ISA_MACROS = ("__x86_64__", "__aarch64__", "__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__AVX512BF16__",
              "__AVX512FP16__", "__AVX2__", "__FMA__", "__F16C__", "__AVX__", "__ARM_NEON")


class BuildError(RuntimeError):
    """The native library cannot be built or loaded; the message says why."""


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    compiler: str            #: the command used, e.g. "cc"
    compiler_version: str    #: first line of ``--version``
    isa: str                 #: avx512, avx2 or generic
    flags: tuple             #: flags given to every compile
    path: str                #: the shared library
    build_seconds: float     #: time this process spent compiling (0.0 when the cache had it)
    cached: bool             #: True when the library was already in the cache
    features: tuple          #: instruction-set macros the compiler enabled


def cache_dir() -> Path:
    root = os.environ.get("TILEATTN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tileattn")
    return Path(root) / "native"


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


def _run(cmd, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


@functools.lru_cache(maxsize=None)
def _compiler_version(cc: tuple) -> str:
    try:
        res = _run(list(cc) + ["--version"], timeout=30)
    except OSError as exc:
        raise BuildError(f"compiler {' '.join(cc)!r} cannot run: {exc}") from exc
    if res.returncode != 0:
        raise BuildError(f"compiler {' '.join(cc)!r} failed to report its version: {res.stderr.strip()[:200]}")
    return (res.stdout.strip().splitlines() or ["unknown"])[0]


@functools.lru_cache(maxsize=None)
def _macros(cc: tuple, flags: tuple):
    """Macros the compiler predefines with these flags, or None when it rejects the flags."""
    res = _run(list(cc) + list(flags) + ["-dM", "-E", "-x", "c", os.devnull], timeout=30)
    if res.returncode != 0:
        return None
    return frozenset(line.split()[1] for line in res.stdout.splitlines() if line.startswith("#define "))


def _arch_flags(cc: tuple) -> tuple:
    for flags in (("-march=native",), ("-mcpu=native",), ()):
        if _macros(cc, flags) is not None:
            return flags
    raise BuildError(f"compiler {' '.join(cc)!r} cannot preprocess C")


def _variant(cc: tuple, isa: str):
    """(flags, macros) for one variant, or a reason string when this CPU/compiler cannot build it."""
    arch = _arch_flags(cc)
    base = _macros(cc, arch)
    x86 = "__x86_64__" in base
    if isa == "avx512":
        flags = arch
        need = ("__AVX512F__", "__AVX512BW__", "__AVX512VL__", "__FMA__")
    elif isa == "avx2":
        flags = arch + (("-mno-avx512f",) if x86 else ())
        need = ("__AVX2__", "__FMA__")
    else:
        flags = arch + (("-mno-avx512f",) if x86 else ())
        need = ()
    macros = _macros(cc, flags)
    if macros is None:
        return f"the compiler rejects {' '.join(flags)}"
    missing = [m.strip("_") for m in need if m not in macros]
    if missing:
        return f"this CPU (as the compiler sees it with {' '.join(flags) or 'no flags'}) lacks {', '.join(missing)}"
    openmp = _macros(cc, flags + ("-fopenmp",))
    if openmp is not None and "_OPENMP" in openmp:
        flags = flags + ("-fopenmp",)
    return flags, macros


def _choose(cc: tuple, isa=None):
    forced = (isa or os.environ.get(ISA_ENV, "")).strip().lower()
    if forced and forced not in ISAS:
        raise BuildError(f"{ISA_ENV}={forced!r}; expected one of {', '.join(ISAS)}")
    reasons = []
    for isa in ((forced,) if forced else ISAS):
        got = _variant(cc, isa)
        if isinstance(got, tuple):
            return isa, got[0], got[1]
        reasons.append(f"{isa}: {got}")
    raise BuildError("no native variant can be built: " + "; ".join(reasons))


def toolchain():
    """``(compiler command, its version line, variant, flags)`` that :func:`build` compiles with on this
    machine, for other C code compiled on first use (``tileattn.flex``); BuildError when there is none."""
    cc = tuple(find_compiler())
    isa, flags, _ = _choose(cc)
    return cc, _compiler_version(cc), isa, flags


def _source_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.glob("*.[ch]")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _compile(cc: tuple, flags: tuple, isa: str, workdir: Path) -> Path:
    defines = ["-DTA_ISA_" + isa.upper()]
    jobs = []
    for src, bits in UNITS:
        obj = workdir / f"{Path(src).stem}_f{bits}.o"
        cmd = list(cc) + list(BASE_FLAGS) + list(flags) + defines + [f"-DTA_REAL_BITS={bits}", "-c",
                                                                     str(CSRC / src), "-o", str(obj)]
        jobs.append((cmd, obj))
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda job: _run(job[0], timeout=300), jobs))
    for (cmd, _), res in zip(jobs, results):
        if res.returncode != 0:
            tail = " | ".join(res.stderr.strip().splitlines()[-6:])
            raise BuildError(f"compiling {cmd[-3]} failed ({' '.join(cc)}): {tail}")
    lib = workdir / LIB_NAME
    link = list(cc) + ["-shared"] + [f for f in flags if f == "-fopenmp"] + [str(o) for _, o in jobs] + \
        ["-o", str(lib), "-lm"]
    res = _run(link, timeout=300)
    if res.returncode != 0:
        raise BuildError(f"linking failed ({' '.join(cc)}): {res.stderr.strip()[-400:]}")
    return lib


def _fingerprint(path: Path) -> dict:
    return dict(size=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())


def _damage(lib: Path):
    """None when ``lib`` matches the size and hash recorded when it was built, else what is wrong
    ("missing" when there is no library at all)."""
    if not lib.exists():
        return "missing"
    try:
        record = json.loads((lib.parent / RECORD_NAME).read_text())
        size, digest = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"the cached library {lib} has no valid size/hash record ({RECORD_NAME})"
    try:
        if lib.stat().st_size != size:
            return f"the cached library {lib} is damaged: {lib.stat().st_size} bytes, {size} when built"
        if _fingerprint(lib)["sha256"] != digest:
            return f"the cached library {lib} is damaged: its SHA-256 differs from the one recorded when built"
    except OSError as exc:
        return f"the cached library {lib} cannot be read: {exc}"
    return None


def _install(built: Path, lib: Path) -> None:
    """Move a freshly linked library into place with its record (each by an atomic rename: a reader
    that sees the new library with the old record finds a mismatch and waits for the lock)."""
    record = lib.parent / f"{RECORD_NAME}.{os.getpid()}.tmp"
    record.write_text(json.dumps(_fingerprint(built)))
    os.replace(built, lib)
    os.replace(record, lib.parent / RECORD_NAME)


def build(isa=None, profile=None) -> BuildInfo:
    """Return the cached library for this machine, compiling it first if needed. ``isa`` and
    ``profile`` override TILEATTN_NATIVE_ISA and TILEATTN_NATIVE_PROFILE (benchmarks that compare
    variants in one process)."""
    cc = tuple(find_compiler())
    version = _compiler_version(cc)
    isa, flags, macros = _choose(cc, isa)
    if profile is None:
        profile = os.environ.get(PROFILE_ENV, "").strip() == "1"
    if profile:
        flags = flags + ("-DTA_PROFILE=1",)
    features = tuple(m for m in ISA_MACROS if m in macros)
    key = hashlib.sha256(json.dumps([_source_digest(), list(cc), version, list(flags), features]).encode())
    folder = cache_dir() / f"{isa}{'-profile' if profile else ''}-{key.hexdigest()[:20]}"
    lib = folder / LIB_NAME
    info = dict(compiler=" ".join(cc), compiler_version=version, isa=isa, flags=tuple(flags), path=str(lib),
                features=features)
    if _damage(lib) is None:
        return BuildInfo(build_seconds=0.0, cached=True, **info)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create the cache folder {folder}: {exc}") from exc
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        damage = _damage(lib)
        if damage is None:  # another process built it while this one waited
            return BuildInfo(build_seconds=0.0, cached=True, **info)
        start = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory(dir=folder, prefix="build-") as tmp:
                _install(_compile(cc, flags, isa, Path(tmp)), lib)
        except (BuildError, OSError) as exc:
            if damage == "missing":
                raise
            raise BuildError(f"{damage}, and rebuilding it failed: {exc}") from exc
        seconds = time.perf_counter() - start
        (folder / "build.json").write_text(json.dumps(dict(info, build_seconds=seconds), indent=1))
    return BuildInfo(build_seconds=seconds, cached=False, **info)
