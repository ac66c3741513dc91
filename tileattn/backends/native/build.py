"""Compile the native kernels on first use, for this machine's CPU, into a per-user cache (where the
wheel's prebuilt library does not serve: :mod:`.prebuilt` decides).

The C sources in ``csrc/`` are compiled by the machine's C compiler (the toolchain shared with the
compiled user functions, :mod:`tileattn.programs.toolchain`: ``$CC`` if set, else the first of ``cc``,
``gcc``, ``clang`` on ``PATH``) with ``-O3`` and the CPU's own instruction set
(``-march=native`` on x86, ``-mcpu=native`` on aarch64). The variants (``toolchain.ISA_TABLE``):

* ``avx512``: AVX-512 F/BW/VL + FMA (uses ``vdpbf16ps`` where the CPU has AVX512_BF16)
* ``avx2``: AVX2 + FMA, built with ``-mno-avx512f`` so it runs on CPUs without AVX-512
* ``neon``: aarch64 Advanced SIMD (uses BFDOT where the CPU has bf16)
* ``generic``: portable vector extensions only (no intrinsics), for CPUs without a hand-written
  variant: the machine's own flags, so the compiler picks the vector instructions and contracts
  a*b+c into FMAs (on x86 it is built without AVX-512: AVX2 + FMA through the portable code)

The best variant the CPU supports is chosen, or the one named by ``TILEATTN_NATIVE_ISA``
(``avx512``, ``avx2``, ``neon``, ``generic``; for tests and for machines whose compiler misreports).
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
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ...programs import toolchain
from ...programs.toolchain import (  # noqa: F401  (the toolchain's names, as the engine's build spells them)
    BASE_FLAGS, ISA_ENV, ISA_MACROS, ISAS, RECORD_NAME, BuildError, find_compiler,
)

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_NAME = "libtileattn_native.so"
PROFILE_ENV = "TILEATTN_NATIVE_PROFILE"
#: translation units: (source, value of TA_REAL_BITS); the kernels are compiled once per real type
UNITS = (("kernels.c", 32), ("kernels.c", 64))


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    compiler: str            #: the command used, e.g. "cc"
    compiler_version: str    #: first line of ``--version``
    isa: str                 #: a variant of toolchain.ISAS
    flags: tuple             #: flags given to every compile
    path: str                #: the shared library
    build_seconds: float     #: time this process spent compiling (0.0 when the cache had it)
    cached: bool             #: True when the library was already in the cache
    features: tuple          #: instruction-set macros the compiler enabled
    source: str              #: "compiled" (here, on first use) or "prebuilt" (shipped in the wheel: .prebuilt)
    state_dir: str           #: where the library's per-machine probe results are kept (probe.json)
    reason: str = ""         #: why this library was chosen (.prebuilt.resolve)


def cache_dir() -> Path:
    return toolchain.cache_root() / "native"


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
        results = list(pool.map(lambda job: toolchain.run(job[0], timeout=300), jobs))
    for (cmd, _), res in zip(jobs, results):
        if res.returncode != 0:
            tail = " | ".join(res.stderr.strip().splitlines()[-6:])
            raise BuildError(f"compiling {cmd[-3]} failed ({' '.join(cc)}): {tail}")
    lib = workdir / LIB_NAME
    link = list(cc) + ["-shared"] + [f for f in flags if f == "-fopenmp"] + [str(o) for _, o in jobs] + \
        ["-o", str(lib), "-lm"]
    res = toolchain.run(link, timeout=300)
    if res.returncode != 0:
        raise BuildError(f"linking failed ({' '.join(cc)}): {res.stderr.strip()[-400:]}")
    return lib


def build(isa=None, profile=None) -> BuildInfo:
    """Return the cached library for this machine, compiling it first if needed. ``isa`` and
    ``profile`` override TILEATTN_NATIVE_ISA and TILEATTN_NATIVE_PROFILE (benchmarks that compare
    variants in one process)."""
    cc = tuple(find_compiler())
    version = toolchain.compiler_version(cc)
    isa, flags, macros = toolchain.choose(cc, isa)
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
    cached, seconds = toolchain.cached_library(lib, lambda workdir: _compile(cc, flags, isa, workdir))
    if not cached:
        (folder / "build.json").write_text(json.dumps(dict(info, build_seconds=seconds), indent=1))
    return BuildInfo(build_seconds=seconds, cached=cached, source="compiled", state_dir=str(folder), **info)
