"""Compiled score_mod / mask_mod tile functions: trace once, build once, cache in memory and on disk.

:func:`score_program` and :func:`mask_program` return a :class:`Bound` program: the compiled
:class:`Program` for the function's structure (:func:`tileattn.programs.trace.structure`) with the
tensors and run-time scalars to pass it now. The first call of a structure traces it and generates C
(:mod:`tileattn.programs.codegen`); the library is built by the machine's C compiler with the native
engine's toolchain (:mod:`tileattn.programs.toolchain`: same compiler discovery, ``$CC``, flags and
cache root) plus ``-fwrapv -fno-math-errno``, under ``<cache>/programs/<variant>-<hash of source and
toolchain>/``. Like the engine's library it is verified (size and SHA-256) before every load and
rebuilt when damaged or replaced, never loaded as it is.

Later calls with an equal structure (another closure of the same code capturing other tensor values
or another temperature) neither retrace nor rebuild: they walk the function (tens of microseconds)
and look the key up. A function whose floats cannot be traced as run-time scalars (it uses them in
Python) is traced with them in place and keyed by their values; one that reads its captures' sizes
in Python is keyed by them (otherwise a capture's rank is keyed, its sizes are run-time arguments).

Concurrency: the memo is guarded by a lock held only for lookups; a structure is traced and built
under its own lock, so a thread compiling one function never stalls another thread's calls of a
program already built. After ``fork`` the child gets fresh locks (a lock a compiling thread held in
the parent would otherwise never be released in the child).

The memo keeps the :data:`MEMO_SIZE` most recently used programs (and refusals); older ones are
dropped (their libraries stay loaded: a process cannot safely unload code it may have handed out).

Functions the compiler does not cover, and machines without a compiler, raise
:class:`~tileattn.programs.trace.Unsupported` with the reason; the reason is memoised like a program,
so a refused function is not retraced on every call.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from . import codegen, toolchain
from .trace import INDEX_DTYPE, Structure, Unsupported, structure, trace

LIB_NAME = "libtileattn_user.so"
#: integer arithmetic wraps, as PyTorch's does; sqrt vectorises (no errno); a select between two
#: computed floats (``x != x ? x : y``, a clamp) becomes a vector blend without AVX-512's masked
#: instructions only where the compiler may evaluate both arms (no trapping math): on AVX2 and the
#: generic build a loop over ta_expf stayed scalar without it
EXTRA_FLAGS = ("-fwrapv", "-fno-math-errno", "-fno-trapping-math")
#: programs (and refusals) kept in memory, most recently used first
MEMO_SIZE = 512
#: the exported tile functions, with their arguments after (rows, cols, ld)
FUNCTIONS = {"score": ("ta_user_score", "ta_user_score_rows", "ta_user_score_bwd", "ta_user_logits"),
             "mask": ("ta_user_mask", "ta_user_mask_rows")}

#: what happened so far in this process: traces, builds (compiles), libraries found on disk (disk_hits)
STATS = Counter()

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_TAIL = (_P, _P, _P, _P, _P, _P, _P)  # b, h, q, kv, cap, cap_sizes, scalars


def _fresh_locks():
    global _LOCK, _BUILDING
    _LOCK = threading.Lock()     # guards the dictionaries below, never held while tracing or building
    _BUILDING = {}               # memo key -> the lock its first caller traces and builds under


_fresh_locks()
os.register_at_fork(after_in_child=_fresh_locks)
_MEMO: "OrderedDict" = OrderedDict()   # memo key -> Program | Unsupported | _NEEDS_VALUES | _NEEDS_SHAPES
_TOOLCHAINS = {}                       # ($CC, $TILEATTN_NATIVE_ISA) -> (cc, version, isa, flags) | Unsupported
_LIBRARIES = {}                        # library path -> ctypes.CDLL
#: memo marker: this structure's floats cannot be run-time scalars; look the values up
_NEEDS_VALUES = object()
#: memo marker: this structure reads its captures' sizes in Python; look the sizes up
_NEEDS_SHAPES = object()


@dataclass(frozen=True, eq=False)
class Program:
    """The compiled tile functions of one function structure. Holds no tensor."""

    kind: str                       #: "score" or "mask"
    dtype: torch.dtype              #: working precision of the scores (score programs; None for masks)
    generated: codegen.Generated
    #: (dtype, shape) of each capture the functions read, in ABI order; the sizes are None (any) unless
    #: the function read them in Python
    capture_specs: tuple
    scalars: int                    #: run-time scalars the functions read (0 when traced in)
    path: str                       #: the shared library
    library: ctypes.CDLL
    trace_seconds: float
    build_seconds: float            #: 0.0 when the library came from the disk cache

    def address(self, name: str) -> int:
        """Address of one of :data:`FUNCTIONS`, for the native kernels."""
        return ctypes.cast(getattr(self.library, name), _P).value

    @property
    def reads(self) -> frozenset:
        """Which of b, h, q_idx, kv_idx the function reads."""
        return self.generated.reads

    def check_captures(self, captures):
        """Refuse captures that differ from what the program was built for, or that it cannot read."""
        for i, (t, (dtype, shape)) in enumerate(zip(captures, self.capture_specs)):
            if t.device.type != "cpu" or t.dtype != dtype or t.dim() != len(shape) or \
                    any(n is not None and n != size for n, size in zip(shape, t.shape)):
                sizes = ["any" if n is None else str(n) for n in shape]
                built = "(" + ", ".join(sizes) + ("," if len(shape) == 1 else "")
                raise ValueError(f"tileattn: a tensor the {self.kind}_mod captures is {t.dtype} {tuple(t.shape)} on "
                                 f"{t.device}; this program was built for {dtype} of sizes {built}) on cpu")
            if t.numel() == 0:  # every read of it is out of range (element 0 does not exist either)
                raise IndexError(f"tileattn: the {self.kind}_mod indexes captured tensor #{i} of shape "
                                 f"{tuple(t.shape)}, which is empty: index 0 is out of bounds")
            if t.layout is not torch.strided or t.is_nested or not _has_storage(t):
                raise TypeError(f"tileattn: argument '{self.kind}_mod': got a captured tensor that is a "
                                f"{type(t).__name__} without storage; expected a dense CPU tensor with memory of its "
                                "own (unwrap a tensor subclass first, e.g. a DTensor's .to_local())")

    def raise_check(self, code: int, captures):
        """Raise the error of failed check ``code`` (a tile function's nonzero return)."""
        check = self.generated.checks[code - 1]
        if check.capture < 0:
            raise ZeroDivisionError(f"tileattn: integer division by zero in {check.op} of the {self.kind}_mod")
        shape = tuple(captures[check.capture].shape)
        raise IndexError(f"tileattn: {check.op} of the {self.kind}_mod indexes dimension {check.dim} of captured "
                         f"tensor #{check.capture} (shape {shape}) out of range")


def _has_storage(t: torch.Tensor) -> bool:
    """Whether a tensor's elements are real memory at data_ptr() (not a fake, meta or wrapper tensor)."""
    try:
        return t.device.type == "cpu" and t.data_ptr() != 0
    except RuntimeError:  # FakeTensor and friends refuse to give a pointer
        return False


@dataclass(frozen=True, eq=False)
class Bound:
    """A program with this call's tensors and run-time scalars (what a kernel call passes)."""

    program: Program
    captures: tuple                 #: the captured tensors, in the program's ABI order
    scalars: tuple                  #: floats, in the program's order

    def pack(self):
        """(capture pointers, sizes, scalars, kept) as ctypes arrays, after checking the captures;
        ``kept``: the dense copies the pointers address (keep them alive for the call)."""
        self.program.check_captures(self.captures)
        kept = [t.detach().contiguous() for t in self.captures]
        pointers = (_P * max(1, len(kept)))(*[t.data_ptr() for t in kept])
        sizes = [s for t in kept for s in t.shape]
        scalars = (ctypes.c_double * max(1, len(self.scalars)))(*self.scalars)
        return pointers, (_I64 * max(1, len(sizes)))(*sizes), scalars, kept

    def _call(self, name, tiles, b, h, q, kv, tail=(), row_major=False):
        """Run one tile function on torch tensors: ``tiles`` are (cols, ld) key-major tensors, or
        (rows, ld) row-major ones for the ``_rows`` functions."""
        program = self.program
        for t in (b, h, q, kv):
            if t.dtype != INDEX_DTYPE or not t.is_contiguous():
                raise ValueError("tileattn: b, h, q, kv must be contiguous int32 vectors")
        rows, cols = b.numel(), kv.numel()
        want = torch.uint8 if program.kind == "mask" else program.dtype
        outer, ld = tiles[0].shape
        if any(t.dtype != want or t.shape != tiles[0].shape or not t.is_contiguous() for t in tiles):
            raise ValueError(f"tileattn: tiles must be contiguous {want} tensors of one shape")
        if not (h.numel() == q.numel() == rows and (outer, ld) >= ((rows, cols) if row_major else (cols, rows))
                and ld >= (cols if row_major else rows)):
            raise ValueError("tileattn: tile and index vectors disagree in size")
        pointers, sizes, scalars, kept = self.pack()
        code = getattr(program.library, name)(rows, cols, ld, *[t.data_ptr() for t in tiles], b.data_ptr(),
                                              h.data_ptr(), q.data_ptr(), kv.data_ptr(), pointers, sizes, scalars,
                                              *tail)
        if code:
            program.raise_check(code, self.captures)

    def forward(self, s, b, h, q, kv):
        """``s`` (cols, ld) key-major scores of the program's dtype, modified in place."""
        self._call("ta_user_score", [s], b, h, q, kv)

    def forward_rows(self, s, b, h, q, kv):
        """``s`` (rows, ld) row-major scores, modified in place."""
        self._call("ta_user_score_rows", [s], b, h, q, kv, row_major=True)

    def logits(self, s, b, h, q, kv, alpha, cmax):
        """The fused forward sweep (see :mod:`.codegen`) on key-major ``s``; ``cmax`` one entry per row of
        the program's dtype (folded into)."""
        if cmax.dtype != self.program.dtype or not cmax.is_contiguous() or cmax.numel() < b.numel():
            raise ValueError(f"tileattn: cmax must be a contiguous {self.program.dtype} vector of one entry per row")
        self._call("ta_user_logits", [s], b, h, q, kv, (alpha, cmax.data_ptr()))

    def backward(self, s, ds, b, h, q, kv, grads):
        """``ds`` becomes dL/d(raw score); ``grads[i]`` (a tensor of the program's dtype shaped like
        capture ``i``, or None) receives dL/d(capture ``i``) added to what it holds."""
        program = self.program
        for g, t in zip(grads, self.captures):
            if g is not None and (g.dtype != program.dtype or g.shape != t.shape or not g.is_contiguous()):
                raise ValueError(f"tileattn: a gradient buffer must be contiguous {program.dtype} of shape "
                                 f"{tuple(t.shape)}")
        buffers = (_P * max(1, len(grads)))(*[None if g is None else g.data_ptr() for g in grads])
        self._call("ta_user_score_bwd", [s, ds], b, h, q, kv, (buffers,))

    def mask(self, out, b, h, q, kv):
        """``out`` (cols, ld) uint8, written with the mask (0/1)."""
        self._call("ta_user_mask", [out], b, h, q, kv)

    def mask_rows(self, out, b, h, q, kv):
        """``out`` (rows, ld) uint8, row-major."""
        self._call("ta_user_mask_rows", [out], b, h, q, kv, row_major=True)


def _toolchain():
    key = (os.environ.get("CC"), os.environ.get(toolchain.ISA_ENV))
    found = _TOOLCHAINS.get(key)
    if found is None:
        try:
            cc, version, isa, flags = toolchain.toolchain()
            # the tile loops run on whole AVX-512 vectors (GCC tunes Intel's AVX-512 cores for 256-bit
            # vectors unless told; the kernels' intrinsics are 512-bit already)
            wide = ("-mprefer-vector-width=512",) if isa == "avx512" else ()
            found = (cc, version, isa, tuple(f for f in flags if f != "-fopenmp") + EXTRA_FLAGS + wide)
        except toolchain.BuildError as exc:
            found = Unsupported(f"no C compiler for compiled score_mod/mask_mod: {exc}")
        _TOOLCHAINS[key] = found
    if isinstance(found, Unsupported):
        raise found
    return found


def _library(source: str):
    """(path, seconds spent compiling) of the verified shared library of ``source``, built if needed."""
    cc, version, isa, flags = _toolchain()
    digest = hashlib.sha256(json.dumps([source, list(cc), version, list(flags)]).encode()).hexdigest()
    lib = toolchain.cache_root() / "programs" / f"{isa}-{digest[:24]}" / LIB_NAME

    def make(workdir: Path) -> Path:
        src, out = workdir / "user.c", workdir / LIB_NAME
        src.write_text(source)
        cmd = list(cc) + list(toolchain.BASE_FLAGS) + list(flags) + ["-shared", str(src), "-o", str(out), "-lm"]
        res = toolchain.run(cmd, timeout=300)
        if res.returncode != 0:
            tail = " | ".join(res.stderr.strip().splitlines()[-4:])
            raise Unsupported(f"the C compiler rejected the generated code ({' '.join(cc)}): {tail}")
        return out

    try:
        cached, seconds = toolchain.cached_library(lib, make)
    except toolchain.BuildError as exc:
        raise Unsupported(f"cannot build the compiled function: {exc}") from exc
    except OSError as exc:
        raise Unsupported(f"cannot build in the cache folder {lib.parent}: {exc}") from exc
    STATS["disk_hits" if cached else "compiles"] += 1
    return lib, seconds


def _load(path, dtype) -> ctypes.CDLL:
    """The library at ``path`` with its functions' signatures (``dtype``: the scores' working precision)."""
    path = str(path)
    library = _LIBRARIES.get(path)
    if library is None:
        library = ctypes.CDLL(path)
        real = ctypes.c_double if dtype == torch.float64 else ctypes.c_float
        for name in FUNCTIONS["score"] + FUNCTIONS["mask"]:
            fn = getattr(library, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                heads = (_P, _P) if name == "ta_user_score_bwd" else (_P,)
                tails = {"ta_user_score_bwd": (_P,), "ta_user_logits": (real, _P)}
                fn.argtypes = (_I64, _I64, _I64) + heads + _TAIL + tails.get(name, ())
        _LIBRARIES[path] = library
    return library


def _memo_get(key):
    with _LOCK:
        found = _MEMO.get(key)
        if found is not None:
            _MEMO.move_to_end(key)
        return found


def _memo_put(key, value):
    with _LOCK:
        _MEMO[key] = value
        _MEMO.move_to_end(key)
        while len(_MEMO) > MEMO_SIZE:
            _MEMO.popitem(last=False)
        _BUILDING.pop(key, None)


def _memoised(key, make):
    """The memo's entry for ``key``, made by ``make()`` (a Program, or an Unsupported it raised) under
    the key's own lock when missing."""
    found = _memo_get(key)
    if found is not None:
        return found
    with _LOCK:
        lock = _BUILDING.setdefault(key, threading.Lock())
    with lock:
        found = _memo_get(key)  # made by another thread while this one waited
        if found is None:
            try:
                found = make()
            except Unsupported as exc:
                found = exc
            _memo_put(key, found)
    return found


def _program(kind: str, fn, dtype, found: Structure = None) -> Bound:
    found = structure(fn) if found is None else found
    key = (kind, dtype, os.environ.get("CC"), os.environ.get(toolchain.ISA_ENV), found.key)
    runtime, by_shape = True, False
    while True:  # each marker is answered once: floats traced in, then keyed by the captures' sizes
        program = _memoised(key, lambda r=runtime, s=by_shape: _make(kind, fn, dtype, found, r, s))
        if program is _NEEDS_VALUES:
            key, runtime = key + (found.valued_key,), False
        elif program is _NEEDS_SHAPES:
            key, by_shape = key + (found.shapes,), True
        else:
            break
    scalars = found.scalars if runtime else ()
    if isinstance(program, Unsupported):
        raise program
    captures = tuple(found.captures[p] for p in program.generated.captures)
    return Bound(program, captures, scalars if program.scalars else ())


def _make(kind, fn, dtype, found: Structure, runtime_scalars: bool, by_shape: bool = False):
    """The Program of ``found`` (keyed by its captures' ranks; with ``by_shape``, by their sizes), or a
    memo marker: retrace with the floats in place, or keyed by the sizes the function read."""
    _toolchain()  # no tracing on a machine that cannot build
    start = time.perf_counter()
    try:
        traced = trace(fn, kind, dtype, found, runtime_scalars=runtime_scalars and bool(found.scalars))
        STATS["traces"] += 1
        if traced.shaped and not by_shape:
            return _NEEDS_SHAPES
        used = [found.captures[p] for p in traced.captures]
        generated = codegen.generate(traced, kind, [(t.dtype, t.dim()) for t in used])
    except Unsupported as exc:
        if runtime_scalars and found.scalars:
            return _NEEDS_VALUES  # try again with the floats traced in
        if exc.shaped and not by_shape:
            return _NEEDS_SHAPES  # a refusal for these sizes only
        raise
    traced_at = time.perf_counter()
    path, seconds = _library(generated.source)
    shapes = [tuple(t.shape) if by_shape else (None,) * t.dim() for t in used]
    return Program(kind=kind, dtype=dtype, generated=generated,
                   capture_specs=tuple((t.dtype, shape) for t, shape in zip(used, shapes)), scalars=traced.scalars,
                   path=str(path), library=_load(path, dtype), trace_seconds=traced_at - start, build_seconds=seconds)


def score_program(score_mod, dtype=torch.float32, found: Structure = None) -> Bound:
    """The compiled ``score_mod`` on scores of working precision ``dtype`` (float32 for fp32/bf16/fp16
    inputs, float64 for fp64), bound to its captures (``found``: its :func:`structure`, when the
    caller walked it already). Raises :class:`Unsupported` with the reason."""
    if dtype not in codegen.FLOATS:
        raise ValueError(f"tileattn: score programs work on float32 or float64 scores, not {dtype}")
    return _program("score", score_mod, dtype, found)


def mask_program(mask_mod, found: Structure = None) -> Bound:
    """The compiled ``mask_mod``, bound to its captures. Raises :class:`Unsupported` with the reason."""
    return _program("mask", mask_mod, None, found)
