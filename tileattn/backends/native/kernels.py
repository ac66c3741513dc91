"""ctypes binding of the native kernels: the argument record filled from the engine's arguments.

Interface (the engine calls exactly this; direct calls, checked, go through :mod:`.checked`)::

    forward(q, k, v, out, lse, args, geometry=PADDED, tiles=DEFAULT_TILES, *, cancel=None) -> None
    backward(q, k, v, grads, args, geometry=PADDED, tiles=DEFAULT_TILES, *, cancel=None) -> None

``args``: the call's :class:`tileattn.core.kernel_args.KernelArgs` (the modifiers lowered and bound);
``geometry``: its :class:`Geometry` (packed offsets, keys in use, a block table); ``tiles``: its
:class:`Tiles` (tile sizes, threads, option flags); ``grads``: a :class:`tileattn.core.engine.Gradients`
bundle. The tensors are canonical views, CPU, any strides with a unit last-dim stride, read and
written in place (their shapes, dtypes and the semantics: :mod:`.checked`). Nothing is checked here
but what the engine's validation cannot know: a quantised cache's scales, laid out as the cache is.

The record. The arguments travel as one flat struct, declared once in ``csrc/ta.h`` (``TA_FIELDS``:
sections of fields) and filled by field name (:mod:`.record`: one generated ``struct.pack_into``
per section) into a per-thread buffer, by one function, :func:`pack` (also the prepared decode
call's template, :mod:`.prepared`):

* the core section, on every call: the tensors' sizes, strides and pointers, the geometry, the
  tiles, and every number of ``args`` (:meth:`~tileattn.core.kernel_args.KernelArgs.numbers`) by
  the field of its name, so a number the header declares reaches the kernels with no change here,
  and a name it does not is refused (a TypeError naming it);
* the section of each per-call field ``args`` binds, named in the field's metadata
  (:func:`tileattn.core.kernel_args.per_call_field`): a tensor's own section (mask, bias, ALiBi: its
  pointer, its broadcast strides and its dtype, by the section's field names) or a quantised
  cache's; user functions and block maps travel in a second record (:class:`.record.UserCall`) that the
  core's ``user`` field points at. A padded call without per-call tensors (a decode step) fills the
  core section alone.

Cancellation: ``cancel`` is a :class:`CancelFlag` (or None). The kernels poll it between tiles;
once set, every thread stops at its next tile, the call returns and the wrapper raises
:class:`Cancelled` (outputs are then partly written). Another thread, a timer or a signal handler
may set it. ``with flag.on_sigint():`` arms a C-level SIGINT handler around a call from the main
thread: Ctrl-C sets the flag and is passed on to Python's own handler, so a long call stops within
one tile and KeyboardInterrupt is raised as usual. It arms only while Python's default SIGINT
handler is installed; under ``SIG_IGN`` or a program's own handler Ctrl-C does not cancel.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import threading
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from ...core import kernel_args
from ...core.engine import WITH_MEMORY, storage_problem
from ...core.kernel_args import SCORE_AXES, broadcast_strides
from ...core.kvformat import DEFAULTS, format_of
from . import build as _build
from . import prebuilt as _prebuilt
from . import record as _record

_F32, _F64, _BF16, _F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
_DTYPES = {_F32: 0, _F64: 1, _BF16: 2, _F16: 3}
#: the kernels' code (csrc/ta.h, kv.h) of each K/V cache format (tileattn.core.kvformat), besides q's own dtype
_KV_CODES = {"int8": 4, "e4m3": 5, "e5m2": 6, "int4": 7, "q8_0": 8, "q4_0": 9}
#: the dtypes of a quantised cache (a uint8 one holds int4 unless the call names another format)
_KV_FORMATS = frozenset(DEFAULTS)
#: options bit that says the "quant" section is set; only forward() sets it
_KV_QUANT = 128
_ERR_LEN = 512

#: status codes of the C functions
OK, CANCELLED, EINVAL, ENOMEM = 0, 1, -1, -2

#: options (bit flags) for tests and tuning; see csrc/ta.h
FORCE_PREFILL, FORCE_DECODE, FORCE_SPLIT, FORCE_FUSED, NO_BF16DOT, BF16DOT, NO_AMX = 1, 2, 4, 8, 16, 32, 64

#: What the kernels do natively. A call outside this is for another engine.
CAPABILITIES = {
    "dtypes": frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16}),
    "forward": frozenset({"band", "shift", "gqa", "varlen", "seqused_k", "paged_kv", "softcap", "alibi",
                          "mask", "bias", "dropout", "decode"}),
    "backward": frozenset({"band", "shift", "gqa", "varlen", "seqused_k", "softcap", "alibi", "mask", "bias",
                           "dbias", "dropout"}),
    #: K/V formats (names, tileattn.core.kvformat) read natively by the forward pass (beside scales with
    #: k_scale/k_offset/v_scale/v_offset; q_scale with any)
    "kv_formats": frozenset(_KV_CODES),
}

class Unavailable(RuntimeError):
    """The native library cannot be used here (no prebuilt one and no compiler, failed build); the message
    says why."""


class Cancelled(RuntimeError):
    """A call stopped early because its CancelFlag was set."""


class CancelFlag:
    """An int32 the kernels poll between tiles; ``set()`` from any thread stops a running call."""

    def __init__(self):
        self._value = ctypes.c_int32(0)
        self.address = ctypes.addressof(self._value)
        self.by_sigint = False

    def set(self):
        self._value.value = 1

    def clear(self):
        self._value.value = 0
        self.by_sigint = False

    @property
    def is_set(self) -> bool:
        return self._value.value != 0

    @contextlib.contextmanager
    def on_sigint(self):
        """Within the block (main thread), SIGINT also sets this flag; Python still gets its
        KeyboardInterrupt once the native call returns.

        Only while SIGINT means KeyboardInterrupt, i.e. Python's default handler is installed: a
        program that ignores SIGINT or handles it itself decided what Ctrl-C does, so the block
        then arms nothing and the call runs to its end (a handler of its own runs after it)."""
        lib = _library().lib
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("CancelFlag.on_sigint() must be used from the main thread")
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            yield self
            return
        before = self._value.value
        if lib.ta_sigint_arm(ctypes.c_void_p(self.address)) != 0:
            raise OSError("sigaction(SIGINT) failed")
        try:
            yield self
        finally:
            lib.ta_sigint_disarm()
            if self._value.value and not before:
                self.by_sigint = True


class _Library:
    def __init__(self, info: _build.BuildInfo):
        self.info = info
        lib = ctypes.CDLL(info.path)
        # before any of its code that may use vector instructions runs: the features it was built
        # for against this CPU's (prebuilt.py read them from the file already; this holds for every
        # library, compiled ones included, at the cost of one call)
        lib.ta_isa_features.restype = ctypes.c_char_p
        wants = {f for f in lib.ta_isa_features().decode().split(";")[0].split(",") if f}
        missing = sorted(wants - _prebuilt.host_flags()) if _prebuilt.host_flags() else []
        if missing:
            raise _build.BuildError(f"the library {info.path} was compiled for {', '.join(missing)}, which this CPU "
                                    "lacks; loading its kernels would end the process (SIGILL)")
        lib.ta_abi.restype = ctypes.c_char_p
        lib.ta_build_info.restype = ctypes.c_char_p
        for name in ("ta_forward", "ta_backward", "ta_sigint_arm"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_int
        lib.ta_sigint_disarm.restype = ctypes.c_int
        lib.ta_probe_bf16dot.restype = ctypes.c_double
        lib.ta_probe_fma_gflops.restype = ctypes.c_double
        lib.ta_probe_fma_gflops.argtypes = [ctypes.c_int64]
        if "amx=1" in lib.ta_build_info().decode():
            lib.ta_amx_available.restype = ctypes.c_int
            self.amx_available = lambda: bool(lib.ta_amx_available())
        else:
            self.amx_available = lambda: False
        self.lib = lib
        self.forward_fn, self.backward_fn = lib.ta_forward, lib.ta_backward
        self.build_info = lib.ta_build_info().decode()
        lib.ta_user_abi.restype = ctypes.c_char_p
        #: the argument record (csrc/ta.h), filled section by section by field name (record.py)
        self.record = _record.Record(lib.ta_abi().decode())
        if self.record.section_offset["core"] != 0 or self.record.names("core")[:5] != ("q", "k", "v", "out", "lse"):
            raise _build.BuildError("the library's argument record does not start with its core section (q, k, v, "
                                    "out, lse)")
        self.size, self.field_offset, self.fill = self.record.size, self.record.offset, self.record.fill
        #: the user-function record (user functions and block maps), passed by pointer
        self.UserArgs = _record.structure(lib.ta_user_abi().decode(), "UserArgs")
        self.local = threading.local()
        self.bf16dot_speedup = self._probe()
        #: vdpbf16ps tiles for bf16 where they beat fp32 tiles by a clear margin on this machine
        self.default_options = BF16DOT if self.bf16dot_speedup >= 1.25 else 0

    def _probe(self) -> float:
        """vdpbf16ps vs fp32 FMA throughput, measured once per machine and kept beside the library
        (so every process makes the same choice, and so computes the same bits)."""
        path = Path(self.info.state_dir) / "probe.json"
        try:
            return float(json.loads(path.read_text())["bf16dot_speedup"])
        except (OSError, ValueError, KeyError):
            pass
        speedup = self.lib.ta_probe_bf16dot()
        tmp = path.with_name(f"probe.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"bf16dot_speedup": speedup}))
            os.replace(tmp, path)
        except OSError:
            pass
        return speedup

    def buffers(self):
        """This thread's argument struct and error buffer, allocated once."""
        loc = self.local
        if not hasattr(loc, "args"):
            loc.args = ctypes.create_string_buffer(self.size)
            loc.err = ctypes.create_string_buffer(_ERR_LEN)
            loc.args_addr = ctypes.addressof(loc.args)
            loc.err_addr = ctypes.addressof(loc.err)
        return loc

_lock = threading.Lock()
_state = {}


def _library() -> _Library:
    lib = _state.get("lib")
    if lib is not None:
        return lib
    with _lock:
        if "lib" not in _state:
            if "error" in _state:
                raise Unavailable(_state["error"])
            try:
                _state["lib"] = _Library(_prebuilt.resolve())
            except (_build.BuildError, OSError) as exc:
                _state["error"] = f"native kernels unavailable: {exc}"
                raise Unavailable(_state["error"]) from exc
    return _state["lib"]


def load():
    """Load the library (the wheel's prebuilt one, or one compiled on first use: :func:`.prebuilt.resolve`);
    returns its :class:`~.build.BuildInfo`.

    Raises :class:`Unavailable` with the reason when there is no library (no prebuilt one for this CPU
    and no compiler, a failed build); the reason is remembered, so later calls fail fast without
    retrying the build.
    """
    return _library().info


def available():
    """(True, "") when the kernels can run here, else (False, reason)."""
    try:
        load()
    except Unavailable as exc:
        return False, str(exc)
    return True, ""


def build_info() -> dict:
    """Compiler, chosen ISA, cache path, build seconds and what the library was compiled with."""
    lib = _library()
    fields = dict(item.split("=", 1) for item in lib.build_info.split(";"))
    info = lib.info
    return dict(compiler=info.compiler, compiler_version=info.compiler_version, isa=info.isa,
                flags=" ".join(info.flags), path=info.path, source=info.source, reason=info.reason,
                build_seconds=info.build_seconds, cached=info.cached,
                openmp=fields.get("openmp") == "1", amx=lib.amx_available(),
                bf16dot=fields.get("bf16dot") == "1",
                bf16dot_speedup=round(lib.bf16dot_speedup, 2), bf16dot_default=bool(lib.default_options & BF16DOT))


def fma_peak_gflops(threads=1) -> float:
    """Measured fp32 FMA peak of `threads` cores (GFLOP/s), the yardstick of the benchmarks."""
    return _library().lib.ta_probe_fma_gflops(int(threads))


def exp2_rate() -> float:
    """Elements per second of the kernels' exp2 (with the max subtraction and row sum of the softmax
    pass) on one core: the second roof of attention, which shares the FMA ports."""
    lib = _library().lib
    lib.ta_probe_exp2_rate.restype = ctypes.c_double
    return lib.ta_probe_exp2_rate()


def amx_peak_gflops() -> float:
    """Measured AMX bf16 peak of one core (GFLOP/s, tdpbf16ps in registers); 0.0 without AMX."""
    lib = _library().lib
    lib.ta_probe_amx_gflops.restype = ctypes.c_double
    return lib.ta_probe_amx_gflops()


def l2_bytes() -> int:
    """This core's L2 cache as the kernels size their query blocks by (1 MiB where the OS does not say)."""
    lib = _library().lib
    lib.ta_l2_bytes.restype = ctypes.c_int64
    return int(lib.ta_l2_bytes())


def profile():
    """The profiling build's counters since the last read (then cleared): {phase: TSC ticks} plus
    ``calls``, ``tasks`` and ``preempted`` (counts); None unless the library was built with
    TILEATTN_NATIVE_PROFILE=1. ``region`` is the thread-ticks the parallel regions offered,
    ``task_all`` what all tasks used, ``task`` what the tasks that ran without being preempted used
    (the phases count those tasks only, so their shares are of ``task``)."""
    lib = _library().lib
    lib.ta_profile_read.restype = ctypes.c_int64
    lib.ta_profile_names.restype = ctypes.c_char_p
    names = lib.ta_profile_names().decode().strip(",").split(",")
    buf = (ctypes.c_double * len(names))()
    if lib.ta_profile_read(buf, len(names)) < 0:
        return None
    return dict(zip(names, buf))


# ------------------------------------------------------------------------------------ the arguments


class Geometry(NamedTuple):
    """Where each sequence's rows and keys are: int32 index tensors the kernels read as plain arrays
    (contiguous), None where absent. Packed offsets of queries and keys (varlen: q, k, v (T, H, D)),
    the keys in use per sequence, a paged pool's block table (k, v (pages, page_size, Hkv, D))."""

    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None


#: A padded call's geometry: every sequence has the tensors' own lengths.
PADDED = Geometry()


class Tiles(NamedTuple):
    """How the kernels cut a call and run it: query lanes and keys per tile (0: the defaults, 128 and
    256; they change the tiling and so the rounding), the OpenMP threads inside the call (None:
    ``torch.get_num_threads()``; the results are bitwise the same for any count) and option flags
    (the FORCE_* / *BF16DOT / NO_AMX flags above: tests and tuning)."""

    block_m: int = 0
    block_n: int = 0
    num_threads: Optional[int] = None
    options: int = 0


DEFAULT_TILES = Tiles()


def _width(t, args) -> int:
    """The head dim a K/V tensor holds in the call's format (``args.kv_format``, default its dtype's): its
    last dim, twice that for packed int4 (uint8, two values a byte), 32 values per q8_0 / q4_0 block."""
    fmt = format_of(args.kv_format, t.dtype)
    return t.shape[-1] if fmt is None else fmt.width(t.shape[-1])


def _fail(arg, given, expected, exc=ValueError):
    raise exc(f"tileattn native: argument '{arg}': got {given}; expected {expected}.")


def _check_memory(**tensors):
    """Each tensor argument has memory the kernels can read (a FakeTensor, a wrapper subclass whose
    data_ptr() is 0, a meta tensor would be read at address 0): checked first, by name."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            problem = storage_problem(t)
            if problem is not None:
                _fail(name, problem, WITH_MEMORY, TypeError)


def unit_stride(t):
    """``t``, or a copy of it with a unit last-dim stride when it has none (a transposed head dim):
    the kernels read rows with unit stride. None stays None."""
    if t is None or t.stride(-1) == 1 or t.shape[-1] <= 1:
        return t
    return t.contiguous()


def contiguous_index(t):
    """An index tensor (cu_seqlens, seqused_k) as the contiguous array the kernels read; None stays None."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def accumulation_dtype(dtype):
    """The dtype of the statistics (LSE, delta) and accumulators for inputs of `dtype`."""
    return _F64 if dtype is _F64 else _F32


# --------------------------------------------------------------------------------------- the record
# One function fills the record of a call, from the tensors and the kernel arguments as the engine
# holds them: forward and backward, and the prepared decode call's template (prepared.py). Shapes and
# strides are read as they are: the spec (the engine's calls) or checked.py (a direct call) validated
# them.


def pack(lib, buffer, q, k, v, out, lse, args, geometry=PADDED, tiles=DEFAULT_TILES, core=None) -> tuple:
    """Fill the record in ``buffer`` for a call (the module docstring): the core section, and the section
    of each per-call field ``args`` binds (:func:`_fill_sections`). ``core``: further core fields by
    name (pointers; the backward's replace forward ones). Returns the full (B, Hq, Sq, Sk) shape and
    whether the call is varlen."""
    cu_seqlens_q, cu_seqlens_k, seqused_k, block_table = geometry
    varlen, paged = cu_seqlens_q is not None, block_table is not None
    qst, kst, vst, ost, lst = q.stride(), k.stride(), v.stride(), out.stride(), lse.stride()
    if varlen:
        tq, hq, d = q.shape
        batch, sq = cu_seqlens_q.shape[0] - 1, 0
        q_st, o_st, l_st = (0, qst[1], qst[0]), (0, ost[1], ost[0]), (0, lst[0], lst[1])
    else:
        batch, hq, sq, d = q.shape
        tq, q_st, o_st, l_st = 0, qst[:3], ost[:3], lst
    if paged:
        pages, page_size, hkv = k.shape[:3]
        sk, tk = block_table.shape[1] * page_size, 0
        k_st, v_st = (kst[0], kst[2], kst[1]), (vst[0], vst[2], vst[1])
        lib.fill["paged"](buffer, num_pages=pages, page_size=page_size, max_pages=block_table.shape[1],
                          bt_st=block_table.stride() + (0,))
    elif varlen:
        tk, hkv = k.shape[:2]
        sk = 0
        k_st, v_st = (0, kst[1], kst[0]), (0, vst[1], vst[0])
    else:
        hkv, sk = k.shape[1], k.shape[2]
        tk, k_st, v_st = 0, kst[:3], vst[:3]
    options = tiles.options | lib.default_options
    core = {} if core is None else core
    if args.per_call or k.dtype in _KV_FORMATS:
        options |= _fill_sections(lib, buffer, core, q, k, v, args, geometry)
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    fields = dict(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(), lse=lse.data_ptr(),
                  cu_q=ptr(cu_seqlens_q), cu_k=ptr(cu_seqlens_k), seqused_k=ptr(seqused_k),
                  block_table=ptr(block_table),
                  B=batch, Hq=hq, Hkv=hkv, Sq=sq, Sk=sk, D=d, Dv=_width(v, args), Tq=tq, Tk=tk, q_st=q_st, k_st=k_st,
                  v_st=v_st, o_st=o_st, lse_st=l_st, dtype=_DTYPES[q.dtype], out_dtype=_DTYPES[out.dtype],
                  drop_threshold=args.dropout_threshold, seed=args.seed & (2**63 - 1), block_m=tiles.block_m,
                  block_n=tiles.block_n,
                  num_threads=torch.get_num_threads() if tiles.num_threads is None else tiles.num_threads,
                  varlen=1 if varlen else 0, paged=1 if paged else 0, options=options, **args.numbers())
    fields.update(core)
    lib.fill["core"](buffer, **fields)
    return (batch, hq, sq, sk), varlen


def _fill_sections(lib, buffer, core, q, k, v, args, geometry) -> int:
    """Fill the sections of the per-call fields ``args`` binds, named in the fields' metadata
    (:func:`tileattn.core.kernel_args.per_call_field`), their core pointers into ``core``: a quantised
    cache's (scales checked here: their layout follows the cache's), or a tensor's own (its pointer the
    core field named after the section, its strides ``<section>_st`` along (batch, head, query, key),
    its dtype ``<section>_dtype`` where the section has one). A "core" number is one of
    ``args.numbers()``; the "user" record is made by the caller. Returns the option bits they set."""
    section_of = kernel_args.sections(type(args))
    sections = {section_of[name]: name for name in args.per_call}
    options = 0
    if "quant" in sections or k.dtype in _KV_FORMATS:
        _fill_quant(lib, buffer, q, k, v, args, geometry)
        options |= _KV_QUANT
    for section, name in sections.items():
        t = getattr(args, name)
        if section in _NOT_TENSOR_SECTIONS or t is None:
            continue
        if section not in lib.fill:
            raise TypeError(f"tileattn native: the kernel argument {name!r} fills the section {section!r}, which the "
                            "kernels' record does not have (csrc/ta.h)")
        core[section] = t.data_ptr()
        values = {section + "_st": args.broadcast_strides(name)}  # an i3 field takes (batch, head, query)
        if section + "_dtype" in lib.field_offset:
            values[section + "_dtype"] = _DTYPES[t.dtype]
        lib.fill[section](buffer, **values)
    return options


#: Sections of per-call fields that are no tensor of their own (``_fill_sections``).
_NOT_TENSOR_SECTIONS = frozenset(("core", "user", "quant"))


# -------------------------------------------------------------------------------------- quantised K/V
#: The per-call fields of a quantised cache's section, besides its format.
_QUANT_FIELDS = ("k_scale", "k_offset", "v_scale", "v_offset", "q_scale")


def _scale_strides(name, t, k, width, batch, leading):
    """csrc/kv.h's (batch, kv head, position, slot, channel-group stride, groups) of a scale or offset
    tensor: fp32, broadcastable to k's shape with its last dim replaced by the number of channel
    groups (1, a divisor of the head dim, or the head dim), and with a leading batch axis when
    ``leading`` ("paged" or "varlen": k has no batch axis; per-sequence scales such as
    FlashAttention-3's descales need one)."""
    kshape = k.shape
    _check_memory(**{name: t})
    if isinstance(t, torch.Tensor) and t.dtype is _F32 and t.is_cpu:
        shape, st = t.shape, t.stride()
        nd, kd = len(shape), len(kshape)
        batched = leading is not None and nd == kd + 1
        groups = shape[-1] if nd else 0
        ok = (nd == kd or batched) and groups >= 1 and width % groups == 0
        if ok:
            axes = [] if batched or leading is None else [0]
            for d in range(nd - 1):
                n = shape[d]
                if n != 1 and n != (batch if batched and d == 0 else kshape[d - batched]):
                    ok = False
                axes.append(st[d] if n != 1 else 0)
        if ok:
            group_stride = st[-1] if groups > 1 else 0
            if leading == "paged":  # (batch, page, slot, kv head)
                return axes[0], axes[3], axes[1], axes[2], group_stride, groups
            if leading == "varlen":  # (batch, token, kv head)
                return axes[0], axes[2], axes[1], 0, group_stride, groups
            return axes[0], axes[1], axes[2], 0, group_stride, groups  # (batch, kv head, key)
        per_slot = tuple(kshape[:-1])
        shapes = [per_slot] + ([(batch,) + per_slot] if leading else [])
        _fail(name, f"shape {tuple(shape)}", " or ".join(f"a shape broadcastable to {f + ('G',)}" for f in shapes)
              + f" with G channel groups dividing the head dim {width} (1: no channel axis)")
    _fail(name, getattr(t, "dtype", type(t).__name__), "an fp32 CPU tensor", TypeError)


def _fill_quant(lib, buffer, q, k, v, args, geometry):
    """Check the scales of a quantised cache (in the cache's canonical order) and fill the "quant"
    section. k and v may be int8, float8_e4m3fn, float8_e5m2 or uint8 holding int4 (two values a
    byte; csrc/kv.h) or, when ``args.kv_format`` says so, llama.cpp's q8_0 / q4_0 blocks (scales inside,
    none of the four below), or q's dtype (descales of a bf16 cache). ``k_scale``, ``k_offset``, ``v_scale``,
    ``v_offset`` are optional fp32 tensors broadcastable to the cache's own shape with its last dim
    replaced by G channel groups (1: no channel axis; D: per channel; a divisor of D: groups of D/G
    channels), and, for varlen or paged k, an optional leading batch axis of size B (per-sequence
    scales): padded k (B, Hkv, Sk, D) -> (B|1, Hkv|1, Sk|1, G); varlen k (Tk, Hkv, D) -> ([B|1,]
    Tk|1, Hkv|1, G); paged pools (pages, page_size, Hkv, D) -> ([B|1,] pages|1, page_size|1, Hkv|1, G),
    per-key scales living in the pool's slots. ``q_scale`` fp32 (B|1, Hkv|1) multiplies the scores of
    kv head h's query heads (FlashAttention-3's q_descale). Precision: int8 and fp8 widen exactly to
    fp32; dot products in fp32 FMA (q times a per-channel K scale rounded once to fp32); bf16 / fp16
    caches likewise, as stored (csrc/kv.h: how each granularity is applied)."""
    cu_seqlens_q, block_table = geometry.cu_seqlens_q, geometry.block_table
    k_scale, k_offset, v_scale, v_offset, q_scale = (getattr(args, name) for name in _QUANT_FIELDS)
    leading = "paged" if block_table is not None else "varlen" if cu_seqlens_q is not None else None
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]
    none = (0, 0, 0, 0, 0, 0)
    ks = none if k_scale is None else _scale_strides("k_scale", k_scale, k, _width(k, args), batch, leading)
    ko = none if k_offset is None else _scale_strides("k_offset", k_offset, k, _width(k, args), batch, leading)
    vs = none if v_scale is None else _scale_strides("v_scale", v_scale, v, _width(v, args), batch, leading)
    vo = none if v_offset is None else _scale_strides("v_offset", v_offset, v, _width(v, args), batch, leading)
    q_st, q_ptr = (0, 0, 0), 0
    if q_scale is not None:
        _check_memory(q_scale=q_scale)
        hkv = k.shape[2] if leading == "paged" else k.shape[1]
        if not isinstance(q_scale, torch.Tensor) or q_scale.dtype is not _F32 or not q_scale.is_cpu or \
                q_scale.dim() != 2 or any(n != f and n != 1 for n, f in zip(q_scale.shape, (batch, hkv))):
            _fail("q_scale", getattr(q_scale, "shape", type(q_scale).__name__),
                  f"an fp32 CPU tensor broadcastable to (batch, kv heads) = ({batch}, {hkv})", TypeError)
        q_st = tuple(q_scale.stride(d) if q_scale.shape[d] != 1 else 0 for d in range(2)) + (0,)
        q_ptr = q_scale.data_ptr()
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    fmt = format_of(args.kv_format, k.dtype)
    lib.fill["quant"](buffer, kv_dtype=_DTYPES[q.dtype] if fmt is None else _KV_CODES[fmt.name], k_scale=ptr(k_scale),
                      k_offset=ptr(k_offset), v_scale=ptr(v_scale), v_offset=ptr(v_offset), q_scale=q_ptr,
                      k_scale_st=ks, k_offset_st=ko, v_scale_st=vs, v_offset_st=vo, q_scale_st=q_st)


# --------------------------------------------------------------------------------------------- calls


def _raise(loc, status):
    if status == CANCELLED:
        raise Cancelled("tileattn native: the call was cancelled (its CancelFlag was set)")
    if status == ENOMEM:
        raise MemoryError("tileattn native: out of memory for tile buffers")
    raise ValueError("tileattn native: " + loc.err.value.decode(errors="replace"))


def forward(q, k, v, out, lse, args, geometry=PADDED, tiles=DEFAULT_TILES, *, cancel=None) -> None:
    """Attention forward into ``out`` and ``lse`` (canonical views; the layouts of :class:`Geometry`)
    with the kernel arguments ``args`` (:class:`tileattn.core.kernel_args.KernelArgs`: the engine's,
    or :mod:`.checked`'s for a direct call), unchecked but for a quantised cache's scales. A number
    of ``args`` the header does not declare is refused by name (a TypeError)."""
    lib = _state.get("lib") or _library()
    loc = lib.buffers()
    user = _record.UserCall.of(lib, args)
    pack(lib, loc.args, q, k, v, out, lse, args, geometry, tiles, dict(
        err=loc.err_addr, cancel=0 if cancel is None else cancel.address, user=0 if user is None else user.address))
    status = lib.forward_fn(loc.args_addr)
    if status != OK:
        _raise(loc, status)
    if user is not None:
        user.raise_failed()


def backward(q, k, v, grads, args, geometry=PADDED, tiles=DEFAULT_TILES, *, cancel=None) -> None:
    """Gradients of a :class:`tileattn.core.engine.Gradients` bundle: ``grads.dq``, ``dk``, ``dv``
    overwritten, ``grads.dbias`` and ``grads.captures`` (a score_mod's captured tensors) added to, from
    ``grads.dout``, ``lse`` and ``delta`` (lse's strides, in the accumulation dtype); ``grads.out`` is
    not read. The rest as :func:`forward`."""
    lib = _state.get("lib") or _library()
    loc = lib.buffers()
    threads = torch.get_num_threads() if tiles.num_threads is None else tiles.num_threads
    user = _record.UserCall.of(lib, args, grads.captures, threads)
    dout, dq, dk, dv, dbias = grads.dout, grads.dq, grads.dk, grads.dv, grads.dbias
    # out is not read: dout takes its place in the forward-shaped fields, the backward pointers follow
    full, varlen = pack(lib, loc.args, q, k, v, dout, grads.lse, args, geometry, tiles, dict(
        err=loc.err_addr, cancel=0 if cancel is None else cancel.address, user=0 if user is None else user.address,
        out=0, dout=dout.data_ptr(), delta=grads.delta.data_ptr(), dq=dq.data_ptr(), dk=dk.data_ptr(),
        dv=dv.data_ptr(), dbias=0 if dbias is None else dbias.data_ptr()))
    strides = [(0, g.stride(1), g.stride(0)) if varlen else tuple(g.stride()[:3]) for g in (dout, dq, dk, dv)]
    lib.fill["bwd"](loc.args, do_st=strides[0], dq_st=strides[1], dk_st=strides[2], dv_st=strides[3],
                    dout_dtype=_DTYPES[dout.dtype], dq_dtype=_DTYPES[dq.dtype], dkv_dtype=_DTYPES[dk.dtype])
    if dbias is not None:
        lib.fill["dbias"](loc.args, dbias_st=broadcast_strides(dbias, SCORE_AXES))  # size-1 dims: reduced
    status = lib.backward_fn(loc.args_addr)
    if status != OK:
        _raise(loc, status)
    if user is not None:
        user.raise_failed()
        if user.grads is not None:
            user.add_capture_grads(grads.captures)
