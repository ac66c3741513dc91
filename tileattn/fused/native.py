"""The C passes of :mod:`tileattn.fused` (``csrc/fused.c``), built on first use by the machine's C
compiler with the native engine's toolchain (:mod:`tileattn.programs.toolchain`: ``$CC``, the CPU's own
flags, OpenMP, the verified cache under ``<cache>/fused/<variant>-<hash>/``), and their calls.

Each wrapper takes tensors whose shapes, dtypes and devices the caller validated
(:mod:`tileattn.fused.checks`); it only reads their pointers and strides. Where there is no compiler,
:func:`available` says why and the operators run their PyTorch composition instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import threading
from pathlib import Path
from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from ..programs import toolchain

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_NAME = "libtileattn_fused.so"
#: sqrt vectorises without errno; the rest is the native engine's flags
EXTRA_FLAGS = ("-fno-math-errno",)
#: rows per block of the weight-gradient partial sums (TA_FUSED_BLOCK in fused.c)
BLOCK = 64
#: the most rows :func:`gemm_lowp` takes (TA_GEMV_ROWS)
GEMV_ROWS = 8
#: the widest row a pass takes (TA_FUSED_MAX_WIDTH)
MAX_WIDTH = 65536
_DTYPE = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}

_P, _I, _I64, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double
_SIGNATURES = {
    "ta_fused_rms": (_P, _I, _I64, _I64, _I64, _I64, _I64, _P, _D, _P, _I, _P, _I64, _I),
    "ta_fused_rms_backward": (_P, _I, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _P, _I),
    "ta_fused_epilogues": (_P, _D),
    "ta_fused_epilogue_backward": (_P, _I, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _P, _I64, _P, _D, _P, _P, _P,
                                   _I64, _I64, _I64, _I, _P, _I64, _I),
    "ta_fused_gemm_lowp": (_P, _I64, _I64, _I64, _P, _I, _I64, _I64, _P, _I64, _I),
}


class Unavailable(RuntimeError):
    """The C passes cannot run here (no compiler, a failed build); the message says why."""


_lock = threading.Lock()
_state: dict = {}


def _build() -> Path:
    cc, version, isa, flags = toolchain.toolchain()
    flags = tuple(flags) + EXTRA_FLAGS
    sources = sorted(CSRC.glob("*.[ch]"))
    digest = hashlib.sha256(json.dumps([[p.name, p.read_text()] for p in sources] + [list(cc), version,
                                                                                      list(flags)]).encode())
    lib = toolchain.cache_root() / "fused" / f"{isa}-{digest.hexdigest()[:20]}" / LIB_NAME

    def make(workdir: Path) -> Path:
        out = workdir / LIB_NAME
        cmd = list(cc) + list(toolchain.BASE_FLAGS) + list(flags) + ["-shared", str(CSRC / "fused.c"), "-o",
                                                                     str(out), "-lm"]
        res = toolchain.run(cmd, timeout=300)
        if res.returncode != 0:
            tail = " | ".join(res.stderr.strip().splitlines()[-4:])
            raise toolchain.BuildError(f"compiling fused.c failed ({' '.join(cc)}): {tail}")
        return out

    toolchain.cached_library(lib, make)
    return lib


def library() -> ctypes.CDLL:
    """The loaded library, built first if needed; :class:`Unavailable` (remembered) when it cannot be."""
    lib = _state.get("lib")
    if lib is not None:
        return lib
    with _lock:
        if "lib" not in _state:
            if "error" in _state:
                raise Unavailable(_state["error"])
            try:
                lib = ctypes.CDLL(str(_build()))
            except (toolchain.BuildError, OSError) as exc:
                _state["error"] = f"the fused C passes are unavailable: {exc}"
                raise Unavailable(_state["error"]) from exc
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, ctypes.c_int
            _state["lib"] = lib
    return _state["lib"]


def available():
    """(True, "") when the C passes can run here, else (False, why)."""
    try:
        library()
    except Unavailable as exc:
        return False, str(exc)
    return True, ""


# A compiled graph takes the answer as a constant (what torch._dynamo.assume_constant_result marks,
# without importing Dynamo: tileattn.core.ops._flat_fields does the same): it loads the library once
# while tracing rather than tracing the lock and the load.
available._dynamo_marked_constant = True


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def _threads() -> int:
    return torch.get_num_threads()


#: the passes :func:`recording` collects: (C function, bytes read, bytes written), or None
_record: Optional[list] = None


@contextlib.contextmanager
def recording():
    """Collect the C passes run inside the block as ``(function, bytes read, bytes written)``: what
    the passes move is counted, not timed (hub chapter 18 counts a block's passes with it)."""
    global _record
    outer, _record = _record, []
    try:
        yield _record
    finally:
        _record = outer


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _call(name: str, *args) -> None:
    status = getattr(library(), name)(*args)
    if status == -2:
        raise MemoryError(f"tileattn.fused: {name} could not allocate its row buffers")
    if status != 0:
        raise RuntimeError(f"tileattn.fused: {name} refused its arguments (status {status}); this is a bug")


def rms(x3: torch.Tensor, weight: Optional[torch.Tensor], eps: float, rstd: torch.Tensor, have_rstd: bool,
        xhat: Optional[torch.Tensor]) -> None:
    """rstd (B*S,) of the rows of ``x3`` (B, S, H; unit-stride rows) and, when given, xhat (B*S, H)
    = x * rstd * weight. ``weight``, ``rstd`` and ``xhat`` are of the compute dtype."""
    n0, n1, h = x3.shape
    if _record is not None:
        _record.append(("rms", _bytes(x3), _bytes(xhat, None if have_rstd else rstd)))
    _call("ta_fused_rms", x3.data_ptr(), _DTYPE[x3.dtype], n0, n1, x3.stride(0), x3.stride(1), h, _ptr(weight), eps,
          rstd.data_ptr(), int(have_rstd), _ptr(xhat), 0 if xhat is None else xhat.stride(0), _threads())


def rms_backward(x3, weight, rstd, dxhat, dx3, dw_part) -> None:
    """dx3 (x3's shape, dtype and any row strides) and the per-block partial sums of the weight's
    gradient (dw_part: (blocks, H), or None) from dxhat (B*S, H) of ``rms``'s xhat."""
    n0, n1, h = x3.shape
    if _record is not None:
        _record.append(("rms_backward", _bytes(x3, dxhat), _bytes(x3, dw_part)))
    _call("ta_fused_rms_backward", x3.data_ptr(), _DTYPE[x3.dtype], n0, n1, x3.stride(0), x3.stride(1), h,
          _ptr(weight), rstd.data_ptr(), dxhat.data_ptr(), dxhat.stride(0), dx3.data_ptr(), dx3.stride(0),
          dx3.stride(1), _ptr(dw_part), _threads())


class Part(NamedTuple):
    """One projection's epilogue (:func:`epilogues`)."""

    y: torch.Tensor                        #: the GEMM's output (B*S, heads*D), unit-stride rows
    heads: int
    bias: Optional[torch.Tensor]           #: (heads*D,) compute dtype
    norm: Optional[torch.Tensor]           #: (D,) per-head RMSNorm weight, compute dtype
    rotated: bool
    dst: torch.Tensor
    dst_strides: Tuple[int, int, int]      #: (b, s, head) element strides of dst
    cache: Optional[tuple] = None          #: (positions (B,) int32, block table or None, page size)


def epilogues(parts: Sequence[Part], seq: Tuple[int, int], dim: int, rope, interleaved: bool, norm_eps: float) -> None:
    """The projections' epilogues in one C call: each part's rows ``y`` -> ``dst`` (+ bias, per-head
    RMSNorm with ``norm_eps``, RoPE when ``rotated``), or with ``cache`` row (b, s) to position
    positions[b] + s. ``seq`` = (B, S); ``rope`` = (cos, sin, strides (b, s), rotary dims) or None."""
    cos, sin, (cs0, cs1), rot = rope if rope is not None else (None, None, (0, 0), 0)
    values = [seq[0], seq[1], dim, rot, int(interleaved), cs0, cs1, _ptr(cos) or 0, _ptr(sin) or 0, _threads(),
              len(parts)]
    for p in parts:
        pos, table, page = p.cache if p.cache is not None else (None, None, 1)
        values += [p.y.data_ptr(), _DTYPE[p.y.dtype], p.y.stride(0), p.heads, _ptr(p.bias) or 0, _ptr(p.norm) or 0,
                   int(p.rotated), p.dst.data_ptr(), _DTYPE[p.dst.dtype], *p.dst_strides, _ptr(pos) or 0,
                   _ptr(table) or 0, 0 if table is None else table.stride(0), page]
        if _record is not None:
            _record.append(("epilogue", _bytes(p.y), p.y.shape[0] * p.y.shape[1] * p.dst.element_size()))
    _call("ta_fused_epilogues", (ctypes.c_int64 * len(values))(*values), norm_eps)


def epilogue_backward(g, g_strides, sizes, pre, norm, dnw_part, rope, interleaved, dy) -> None:
    """The epilogue's gradient: ``g`` (read at (b, s, head) strides ``g_strides``) -> ``dy`` (B*S, heads*D);
    with a per-head norm, ``pre`` is its input and ``dnw_part`` (blocks, D) gets the weight's partial sums."""
    n0, n1, heads, d = sizes
    nw, neps = norm if norm is not None else (None, 0.0)
    cos, sin, (cs0, cs1), rot = rope if rope is not None else (None, None, (0, 0), 0)
    if _record is not None:
        _record.append(("epilogue_backward", dy.numel() * g.element_size() + _bytes(pre), _bytes(dy)))
    _call("ta_fused_epilogue_backward", g.data_ptr(), _DTYPE[g.dtype], *g_strides, n0, n1, heads, d, _ptr(pre),
          0 if pre is None else pre.stride(0), _ptr(nw), neps, _ptr(dnw_part), _ptr(cos), _ptr(sin), cs0, cs1, rot,
          int(interleaved), dy.data_ptr(), dy.stride(0), _threads())


def gemm_lowp(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` in fp32 for a few fp32 rows ``a`` (M <= GEMV_ROWS, unit-stride rows) and bf16/fp16
    weights ``w`` (N, K; unit-stride rows), read as stored."""
    m, k = a.shape
    n = w.shape[0]
    c = torch.empty(m, n, dtype=torch.float32)
    if _record is not None:
        _record.append(("gemm_lowp", _bytes(a, w), _bytes(c)))
    _call("ta_fused_gemm_lowp", a.data_ptr(), m, k, a.stride(0), w.data_ptr(), _DTYPE[w.dtype], n, w.stride(0),
          c.data_ptr(), c.stride(0), _threads())
    return c
