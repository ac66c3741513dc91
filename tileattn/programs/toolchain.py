"""The machine's C toolchain and the verified on-disk cache of what it builds: one place for the native
engine's kernels (:mod:`tileattn.backends.native.build`) and the compiled user functions
(:mod:`tileattn.programs.compiler`).

Compiler: ``$CC`` if set, else the first of ``cc``, ``gcc``, ``clang`` on ``PATH``. Variants of the
instruction set, best first:

* ``avx512``: AVX-512 F/BW/VL + FMA (``-march=native`` on such a CPU)
* ``avx2``: AVX2 + FMA, built with ``-mno-avx512f`` so it runs on CPUs without AVX-512
* ``generic``: portable vector extensions only (the machine's own flags; on x86 without AVX-512)

Each variant adds ``-fopenmp`` where the compiler links an OpenMP program; without an OpenMP
runtime the kernels run on their own pool of POSIX threads (``tileattn env`` says which).

``TILEATTN_NATIVE_ISA`` (``avx512``, ``avx2``, ``generic``) forces one. The cache root is
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
from pathlib import Path
from typing import Callable, Optional, Tuple

ISA_ENV = "TILEATTN_NATIVE_ISA"
ISAS = ("avx512", "avx2", "generic")
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


def _arch_flags(cc: tuple) -> tuple:
    for flags in (("-march=native",), ("-mcpu=native",), ()):
        if macros(cc, flags) is not None:
            return flags
    raise BuildError(f"compiler {' '.join(cc)!r} cannot preprocess C")


def variant(cc: tuple, isa: str):
    """(flags, macros) for one variant, or a reason string when this CPU/compiler cannot build it."""
    arch = _arch_flags(cc)
    base = macros(cc, arch)
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
    found = macros(cc, flags)
    if found is None:
        return f"the compiler rejects {' '.join(flags)}"
    missing = [m.strip("_") for m in need if m not in found]
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
