"""Compiled score_mod / mask_mod tile functions: trace once, build once, cache in memory and on disk.

:func:`score_program` and :func:`mask_program` return ``(program, captures)``: the compiled
:class:`Program` for the function's structure (:func:`tileattn.flex.trace.structure`) and the tensors
to pass it now. The first call of a structure traces it and generates C (:mod:`tileattn.flex.codegen`);
the library is built by the machine's C compiler with the native engine's toolchain
(:func:`tileattn.backends.native.build.toolchain`: same compiler discovery, ``$CC``, flags and cache
root) plus ``-fwrapv``, under ``<cache>/native/flex/<hash of source and toolchain>/``, serialised by an
``fcntl`` lock and renamed into place, so neither another thread nor another process compiles it
again. Later calls with an equal structure (another closure of the same code capturing other tensor
values, for instance) neither retrace nor rebuild: they walk the function (tens of microseconds) and
look the key up.

Functions the compiler does not cover, and machines without a compiler, raise
:class:`~tileattn.flex.trace.Unsupported` with the reason; the reason is cached like a program, so a
refused function is not retraced on every call.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ..backends.native import build
from ..core.engine import storage_problem
from ..core.modifiers import fail
from . import codegen
from .semantics import WITH_MEMORY
from .trace import INDEX_DTYPE, Unsupported, structure, trace

LIB_NAME = "libtileattn_flex.so"
EXTRA_FLAGS = ("-fwrapv",)  # integer arithmetic wraps, as PyTorch's does

#: what happened so far in this process: traces, builds (compiles), libraries found on disk (disk_hits)
STATS = Counter()
_LOCK = threading.RLock()
_PROGRAMS = {}      # structure key -> Program | Unsupported
_TOOLCHAINS = {}    # ($CC, $TILEATTN_NATIVE_ISA) -> (cc, version, isa, flags) | Unsupported
_LIBRARIES = {}     # library path -> ctypes.CDLL

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INDEX = (_P, _P, _P, _P, _P, _P)  # b, h, q, kv, cap, cap_sizes


@dataclass(frozen=True, eq=False)
class Program:
    """The compiled tile functions of one function structure. Holds no tensor."""

    kind: str                       #: "score" or "mask"
    dtype: torch.dtype              #: working precision of the scores (score programs; None for masks)
    generated: codegen.Generated
    capture_specs: tuple            #: (dtype, shape) of each capture the functions read, in ABI order
    path: str                       #: the shared library
    library: ctypes.CDLL
    trace_seconds: float
    build_seconds: float            #: 0.0 when the library came from the disk cache

    def address(self, name: str) -> int:
        """Address of ``ta_flex_score_fwd``, ``ta_flex_score_bwd`` or ``ta_flex_mask``, for native callers."""
        return ctypes.cast(getattr(self.library, name), _P).value

    @property
    def reads(self) -> frozenset:
        """Which of b, h, q_idx, kv_idx the function reads."""
        return self.generated.reads

    def pack(self, captures):
        """(pointer array, sizes array, contiguous tensors to keep alive) for the C functions."""
        tensors = []
        for t, (dtype, shape) in zip(captures, self.capture_specs):
            problem = storage_problem(t)
            if problem is not None:
                fail(TypeError, f"{self.kind}_mod", f"a captured tensor that is {problem}", WITH_MEMORY)
            if t.device.type != "cpu" or t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(f"tileattn.flex: a captured tensor is {t.dtype} {tuple(t.shape)} on {t.device}; "
                                 f"this program was built for {dtype} {shape} on cpu")
            tensors.append(t.detach().contiguous())
        pointers = (_P * max(1, len(tensors)))(*[t.data_ptr() for t in tensors])
        sizes = [s for t in tensors for s in t.shape]
        return pointers, (_I64 * max(1, len(sizes)))(*sizes), tensors

    def _raise(self, code: int, tensors):
        check = self.generated.checks[code - 1]
        if check.capture < 0:
            raise ZeroDivisionError(f"tileattn.flex: integer division by zero in {check.op} of the {self.kind}_mod")
        shape = tuple(tensors[check.capture].shape)
        raise IndexError(f"tileattn.flex: {check.op} of the {self.kind}_mod indexes dimension {check.dim} of captured "
                         f"tensor #{check.capture} (shape {shape}) out of range")

    def _call(self, name, tiles, b, h, q, kv, captures, tail=()):
        """Run one tile function on torch tensors: ``tiles`` are key-major (cols, ld) tensors."""
        rows, (cols, ld) = b.numel(), tiles[0].shape
        for t in (b, h, q, kv):
            if t.dtype != INDEX_DTYPE or not t.is_contiguous():
                raise ValueError("tileattn.flex: b, h, q, kv must be contiguous int32 vectors")
        want = torch.uint8 if self.kind == "mask" else self.dtype
        if any(t.dtype != want or t.shape != (cols, ld) or not t.is_contiguous() for t in tiles):
            raise ValueError(f"tileattn.flex: tiles must be contiguous {want} (cols, ld) tensors of one shape")
        if not (h.numel() == q.numel() == rows <= ld and kv.numel() == cols):
            raise ValueError("tileattn.flex: tile and index vectors disagree in size")
        pointers, sizes, tensors = self.pack(captures)
        code = getattr(self.library, name)(rows, cols, ld, *[t.data_ptr() for t in tiles], b.data_ptr(),
                                           h.data_ptr(), q.data_ptr(), kv.data_ptr(), pointers, sizes, *tail)
        if code:
            self._raise(code, tensors)

    def forward(self, s, b, h, q, kv, captures):
        """``s`` (cols, ld) key-major scores of this program's dtype, modified in place."""
        self._call("ta_flex_score_fwd", [s], b, h, q, kv, captures)

    def backward(self, s, ds, b, h, q, kv, captures, grads):
        """``ds`` becomes dL/d(raw score); ``grads[i]`` (a float64 tensor shaped like capture ``i``, or
        None) receives dL/d(capture ``i``) added to what it holds."""
        buffers = (_P * max(1, len(grads)))(*[None if g is None else g.data_ptr() for g in grads])
        for g, (_, shape) in zip(grads, self.capture_specs):
            if g is not None and (g.dtype != torch.float64 or tuple(g.shape) != shape or not g.is_contiguous()):
                raise ValueError(f"tileattn.flex: a gradient buffer must be contiguous float64 of shape {shape}")
        self._call("ta_flex_score_bwd", [s, ds], b, h, q, kv, captures, (buffers,))

    def mask(self, out, b, h, q, kv, captures):
        """``out`` (cols, ld) uint8, written with the mask (0/1)."""
        self._call("ta_flex_mask", [out], b, h, q, kv, captures)


def _toolchain():
    key = (os.environ.get("CC"), os.environ.get(build.ISA_ENV))
    if key not in _TOOLCHAINS:
        try:
            cc, version, isa, flags = build.toolchain()
            _TOOLCHAINS[key] = (cc, version, isa, tuple(f for f in flags if f != "-fopenmp") + EXTRA_FLAGS)
        except build.BuildError as exc:
            _TOOLCHAINS[key] = Unsupported(f"no C compiler for compiled score_mod/mask_mod: {exc}")
    found = _TOOLCHAINS[key]
    if isinstance(found, Unsupported):
        raise found
    return found


def _library(source: str):
    """(path, seconds spent compiling) of the shared library of ``source``, built if not cached."""
    cc, version, isa, flags = _toolchain()
    digest = hashlib.sha256(json.dumps([source, list(cc), version, list(flags)]).encode()).hexdigest()
    folder = build.cache_dir() / "flex" / f"{isa}-{digest[:24]}"
    lib = folder / LIB_NAME
    if lib.exists():
        STATS["disk_hits"] += 1
        return lib, 0.0
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if lib.exists():  # another process built it while this one waited
                STATS["disk_hits"] += 1
                return lib, 0.0
            start = time.perf_counter()
            with tempfile.TemporaryDirectory(dir=folder, prefix="build-") as tmp:
                src, out = Path(tmp) / "flex.c", Path(tmp) / LIB_NAME
                src.write_text(source)
                cmd = list(cc) + list(build.BASE_FLAGS) + list(flags) + ["-shared", str(src), "-o", str(out), "-lm"]
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                if res.returncode != 0:
                    tail = " | ".join(res.stderr.strip().splitlines()[-4:])
                    raise Unsupported(f"the C compiler rejected the generated code ({' '.join(cc)}): {tail}")
                os.replace(out, lib)
            STATS["compiles"] += 1
            return lib, time.perf_counter() - start
    except OSError as exc:
        raise Unsupported(f"cannot build in the cache folder {folder}: {exc}") from exc


def _load(path) -> ctypes.CDLL:
    path = str(path)
    if path not in _LIBRARIES:
        library = ctypes.CDLL(path)
        for name, head in (("ta_flex_score_fwd", (_P,)), ("ta_flex_score_bwd", (_P, _P)), ("ta_flex_mask", (_P,))):
            fn = getattr(library, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                fn.argtypes = (_I64, _I64, _I64) + head + _INDEX + ((_P,) if name == "ta_flex_score_bwd" else ())
        _LIBRARIES[path] = library
    return _LIBRARIES[path]


def _program(kind: str, fn, dtype):
    key, captures = structure(fn)
    key = (kind, dtype, key)
    with _LOCK:
        found = _PROGRAMS.get(key)
        if found is None:
            try:
                _toolchain()  # no tracing on a machine that cannot build
                found = _make(kind, fn, dtype, captures)
            except Unsupported as exc:
                found = exc
            _PROGRAMS[key] = found
    if isinstance(found, Unsupported):
        raise found
    return found, tuple(captures[p] for p in found.generated.captures)


def _make(kind, fn, dtype, captures) -> Program:
    start = time.perf_counter()
    traced = trace(fn, kind, dtype, captures)
    STATS["traces"] += 1
    used = [captures[p] for p in traced.captures]
    generated = codegen.generate(traced, kind, [(t.dtype, t.dim()) for t in used])
    traced_at = time.perf_counter()
    path, seconds = _library(generated.source)
    return Program(kind=kind, dtype=dtype, generated=generated, capture_specs=tuple((t.dtype, tuple(t.shape))
                                                                                    for t in used),
                   path=str(path), library=_load(path), trace_seconds=traced_at - start, build_seconds=seconds)


def score_program(score_mod, dtype=torch.float32):
    """``(Program, captures)`` for ``score_mod`` on scores of working precision ``dtype`` (float32 for
    fp32/bf16/fp16 inputs, float64 for fp64). Raises :class:`Unsupported` with the reason."""
    if dtype not in codegen.FLOATS:
        raise ValueError(f"tileattn.flex: score programs work on float32 or float64 scores, not {dtype}")
    return _program("score", score_mod, dtype)


def mask_program(mask_mod):
    """``(Program, captures)`` for ``mask_mod``. Raises :class:`Unsupported` with the reason."""
    return _program("mask", mask_mod, None)
