"""ctypes binding of the native kernels: thin wrappers that take torch tensors.

Interface (stable; the backend calls exactly this)::

    forward(q, k, v, out, lse, *, scale, left=-1, right=-1, bottom_right=True, shift=0,
            cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, block_table=None,
            softcap=0.0, alibi_slopes=None, mask=None, bias=None, dropout_p=0.0, seed=0,
            block_m=0, block_n=0, num_threads=None, cancel=None, options=0, validate=True,
            k_scale=None, k_offset=None, v_scale=None, v_offset=None, q_scale=None, **fields) -> None

    backward(q, k, v, out, dout, lse, delta, dq, dk, dv, *, <the same keywords>, dbias=None) -> None

``fields``: further fields of the record's core section (``csrc/ta.h``), by name, as they are: a
kernel argument the header declares reaches the kernels with no change here (the engine passes every
number of :class:`tileattn.core.kernel_args.KernelArgs` by name); a name it does not is refused.

``validate=False`` skips the argument checks below: only for arguments validated already (the
native engine's calls, validated once by the spec and the modifiers).

Tensors (CPU; any strides with a unit last-dim stride; views are read and written in place):

* padded: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv); out (B, Hq, Sq, Dv);
  lse (B, Hq, Sq)
* varlen (``cu_seqlens_q`` and ``cu_seqlens_k``, int32 (B+1,)): q (Tq, Hq, D), k (Tk, Hkv, D),
  v (Tk, Hkv, Dv); out (Tq, Hq, Dv); lse (Hq, Tq)
* paged KV (``block_table`` int32 (B, max_pages), forward only): k (pages, page_size, Hkv, D),
  v (pages, page_size, Hkv, Dv), key j of batch item b in page ``block_table[b, j // page_size]``;
  q padded (B, Hq, Sq, D) or varlen with ``cu_seqlens_q`` alone (a ragged batch, below)
* ``seqused_k`` int32 (B,): batch item b uses only its first ``seqused_k[b]`` keys

dtypes: q, k, v share one of fp32, fp64, bf16, fp16. ``out``, ``dq``, ``dk``, ``dv`` and ``dout``
are that dtype or fp32 (fp64 inputs: fp64); ``lse`` and ``delta`` are fp32 (fp64 for fp64 inputs).
``mask`` is bool and ``bias`` any float dtype, both 4-d and broadcast to (B, Hq, Sq, Sk) (expanded
views with stride 0 are read in place; with paged KV, Sk = max_pages * page_size and column j is key
j of the sequence, wherever its page lies; not with varlen q); ``dbias`` is an fp32 (fp64) 4-d buffer whose every dimension
is the full one or 1, which the backward pass *adds* to, summing over its size-1 dimensions.
``alibi_slopes`` fp32 (Hq,) or (B, Hq). ``delta`` = rowsum(dout * out) - dlse, lse-shaped with
lse's strides, computed by the caller; ``out`` is not read by the backward pass (pass it or None).

Semantics, as :func:`tileattn.reference`: ``s = scale * q.k -> softcap -> + ALiBi + bias -> band and
mask -> softmax -> dropout -> . v``; query row i of a sequence sees key j iff
``i + off - left <= j <= i + off + right`` (-1 = unbounded) with
``off = shift + (k_len - q_len if bottom_right else 0)``; ALiBi adds ``-slope * |i + off - j|``;
a row that sees no key gets out = 0 and lse = -inf. Dropout keeps (seed, batch, head, row, col)
by the counter-based hash of :mod:`tileattn.core.score_math` (row and column within the sequence).

Ragged batches: varlen q (``cu_seqlens_q``) with a paged cache (``block_table`` + ``seqused_k``), or
with varlen k (``cu_seqlens_k``, ``seqused_k`` optional), mixes decode rows and prefill chunks in one
call, each causal at its own end with ``right=0`` (bottom-right). Every sequence takes its own path:
at most 8 rows per kv head (q_len * Hq / Hkv) the split-KV decode kernel, else the prefill tiles, so
a sequence's bits do not depend on the rest of the batch. A contiguous cache (B, S, Hkv, D) with
``seqused_k`` is the pool of B pages of S slots: ``block_table = arange(B)[:, None]``.

Quantised K/V (forward only): k and v may be int8, float8_e4m3fn, float8_e5m2 or uint8 holding int4
(two values a byte, the last dim half the head dim; layout in csrc/kv.h) (q fp32, bf16 or
fp16; out q's dtype or fp32), read as stored and dequantised in the kernel as
``(x + offset) * scale`` (the Ascend antiquant convention; no offset = symmetric). ``k_scale``,
``k_offset``, ``v_scale``, ``v_offset`` are optional fp32 tensors broadcastable to the cache's own
shape with its last dim replaced by G channel groups (1: no channel axis; D: per channel; a divisor
of D: groups of D/G channels), and, for varlen or paged k, an optional leading batch axis of size B
(per-sequence scales): padded k (B, Hkv, Sk, D) -> (B|1, Hkv|1, Sk|1, G); varlen k (Tk, Hkv, D)
-> ([B|1,] Tk|1, Hkv|1, G); paged pools (pages, page_size, Hkv, D) -> ([B|1,] pages|1,
page_size|1, Hkv|1, G), per-key scales living in the pool's slots. ``q_scale`` fp32 (B|1, Hkv|1)
multiplies the scores of kv head h's query heads (FlashAttention-3's q_descale). The same scale
arguments apply to an unquantised cache of q's dtype (descales of a bf16 cache). Precision: int8
and fp8 widen exactly to fp32; dot products in fp32 FMA (q times a per-channel K scale rounded once
to fp32); bf16 / fp16 caches likewise, as stored. See csrc/kv.h for how each granularity is applied.

``num_threads`` (default ``torch.get_num_threads()``) OpenMP threads run inside the call; the work
split depends only on the problem, so the results are bitwise identical for any thread count and a
row's result does not depend on the other batch items. ``block_m`` (query lanes per tile, default
128) and ``block_n`` (keys per tile, default 256) change the tiling and therefore the rounding.
``options`` takes the FORCE_* / *BF16DOT / NO_AMX flags below (tests and tuning).

Cancellation: ``cancel`` is a :class:`CancelFlag` (or None). The kernels poll it between tiles;
once set, every thread stops at its next tile, the call returns and the wrapper raises
:class:`Cancelled` (outputs are then partly written). Another thread, a timer or a signal handler
may set it. ``with flag.on_sigint():`` arms a C-level SIGINT handler around a call from the main
thread: Ctrl-C sets the flag and is passed on to Python's own handler, so a long call stops within
one tile and KeyboardInterrupt is raised as usual. It arms only while Python's default SIGINT
handler is installed; under ``SIG_IGN`` or a program's own handler Ctrl-C does not cancel.

Cost of a call: the arguments travel as one flat struct (``csrc/ta.h``) filled by field name
(:mod:`.record`: one generated ``struct.pack_into`` per section) into a per-thread buffer; only its
"core" section is filled on every call, optional sections (paged KV, mask, bias, ALiBi, backward,
a quantised cache) when used. User functions and block maps travel in a second record
(:class:`UserCall`) the core's ``user`` field points at.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import struct
import threading
from pathlib import Path

import torch

from ...core.engine import WITH_MEMORY, storage_problem
from . import build as _build
from . import prebuilt as _prebuilt
from . import record as _record

_F32, _F64, _BF16, _F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
_DTYPES = {_F32: 0, _F64: 1, _BF16: 2, _F16: 3}
#: element formats of a quantised K/V cache (csrc/kv.h), besides q's own dtype
_KV_FORMATS = {torch.int8: 4, torch.float8_e4m3fn: 5, torch.float8_e5m2: 6, torch.uint8: 7}  # uint8: int4, packed
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
    #: K/V formats read natively by the forward pass (with k_scale/k_offset/v_scale/v_offset/q_scale)
    "kv_formats": frozenset(_KV_FORMATS),
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


# ----------------------------------------------------------------------------------- argument checks
# A direct call (tests, benchmarks, tuning) is checked here before any C runs. The engine's calls
# pass ``validate=False``: the spec validated them once (tileattn.core.spec and the modifiers), and a
# second pass over every argument costs a decode step microseconds.


def _width(t) -> int:
    """The head dim a K/V tensor holds: its last dim, twice that for packed int4 (uint8, two values a byte)."""
    return t.shape[-1] * 2 if t.dtype is torch.uint8 else t.shape[-1]


def _fail(arg, given, expected, exc=ValueError):
    raise exc(f"tileattn native: argument '{arg}': got {given}; expected {expected}.")


def _check(name, t, dim, dtype=None, dtype2=None):
    """A CPU tensor of `dim` dims with a unit last-dim stride (and dtype `dtype` or `dtype2` when
    given); returns its shape."""
    if not isinstance(t, torch.Tensor):
        _fail(name, type(t).__name__, "a torch.Tensor", TypeError)
    if not t.is_cpu:
        _fail(name, f"device {t.device}", "a CPU tensor")
    shape, st = t.shape, t.stride()
    if len(shape) != dim:
        _fail(name, f"shape {tuple(shape)}", f"a {dim}-d tensor")
    if dtype is not None and t.dtype is not dtype and t.dtype is not dtype2:
        _fail(name, f"dtype {t.dtype}", f"{dtype}" + (f" or {dtype2}" if dtype2 is not None else ""), TypeError)
    if st[-1] != 1 and shape[-1] != 1 and t.numel():
        _fail(name, f"strides {st}", "a unit stride in the last dimension (a strided view, not a copy)")
    return shape


def _check_memory(**tensors):
    """Each tensor argument has memory the kernels can read (a FakeTensor, a wrapper subclass whose
    data_ptr() is 0, a meta tensor would be read at address 0): checked first, by name."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            problem = storage_problem(t)
            if problem is not None:
                _fail(name, problem, WITH_MEMORY, TypeError)


def _same(name, shape, expected):
    if shape != expected:  # torch.Size is a tuple
        _fail(name, f"shape {tuple(shape)}", f"shape {tuple(expected)}")


def _check_index(name, t, length):
    if not isinstance(t, torch.Tensor) or t.dtype is not torch.int32 or t.dim() != 1 or not t.is_cpu:
        _fail(name, getattr(t, "dtype", type(t).__name__), "a 1-d int32 CPU tensor", TypeError)
    if not t.is_contiguous() or t.shape[0] != length:
        _fail(name, f"shape {tuple(t.shape)}, strides {t.stride()}", f"a contiguous tensor of length {length}")


def _check_bcast4(name, t, full, dtypes):
    """A 4-d tensor broadcastable to `full` (any strides are read)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.dim() != 4 or not t.is_cpu:
        _fail(name, getattr(t, "shape", type(t).__name__), f"a 4-d CPU tensor of dtype {' or '.join(map(str, dtypes))}",
              TypeError)
    for n, f in zip(t.shape, full):
        if n != f and n != 1:
            _fail(name, f"shape {tuple(t.shape)}", f"a 4-d shape broadcastable to {tuple(full)}")


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


def _out2(dtype):
    """The second allowed dtype of outputs and gradients besides the input dtype: fp32."""
    return None if dtype is _F64 else _F32


def _validate(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, softcap, alibi_slopes, mask,
              bias, dropout_p, cancel, backward, kv_dtype=None):
    """Every check of the forward-shaped arguments of a direct call (see the comment above).
    ``kv_dtype``: the dtype of k and v when it is not q's (a quantised cache)."""
    _check_memory(q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                  seqused_k=seqused_k, block_table=block_table, alibi_slopes=alibi_slopes, mask=mask, bias=bias)
    dtype = q.dtype if isinstance(q, torch.Tensor) else None
    if dtype not in _DTYPES:
        _fail("q", f"dtype {dtype}", "float32, float64, bfloat16 or float16", TypeError)
    varlen, paged = cu_seqlens_q is not None, block_table is not None
    if cu_seqlens_k is not None and not varlen:
        _fail("cu_seqlens_k", "a tensor", "None unless cu_seqlens_q is given (varlen)")
    if paged and cu_seqlens_k is not None:
        _fail("cu_seqlens_k", "a tensor", "None with a block_table (key counts come from seqused_k)")
    if varlen and not paged and cu_seqlens_k is None:
        _fail("cu_seqlens_k", None, "int32 cumulative key offsets (varlen)")
    if paged and backward:
        _fail("block_table", "a paged KV cache in the backward pass", "k/v tensors (paged KV is forward-only)")
    qdim = 3 if varlen else 4
    kdim = 4 if paged else qdim
    qs = _check("q", q, qdim)
    ks = _check("k", k, kdim, kv_dtype or dtype)
    vs = _check("v", v, kdim, kv_dtype or dtype)
    if varlen:
        tq, hq, d = qs
        batch, sq = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) else 0, 0
    else:
        batch, hq, sq, d = qs
        tq = 0
    if paged:
        pages, page_size, hkv = ks[:3]
        _same("v", vs, (pages, page_size, hkv, vs[3]))
        sk = tk = 0
    elif varlen:
        tk, hkv = ks[:2]
        _same("v", vs, (tk, hkv, vs[2]))
        sk = 0
    else:
        hkv, sk = ks[1], ks[2]
        _same("k", ks, (batch, hkv, sk, ks[3]))
        _same("v", vs, (batch, hkv, sk, vs[3]))
        tk = 0
    dk, dv = _width(k), _width(v)
    if dk != d:
        _fail("k", f"head dim {dk}", f"the head dim of q, {d}")
    if hkv == 0 or hq % hkv:
        _fail("k", f"{hkv} kv heads for {hq} query heads", "a number of kv heads dividing the query heads")
    if d == 0 or dv == 0:
        _fail("q/v", f"head dims {d}/{dv}", "positive head dims")
    if max(sq, sk, tq, tk) >= 2**31 - 1:
        _fail("q/k", "a sequence of 2^31 tokens or more", "fewer tokens")
    os_ = _check("out", out, qdim, dtype, _out2(dtype))
    ls = _check("lse", lse, qdim - 1, accumulation_dtype(dtype))
    if varlen:
        _same("out", os_, (tq, hq, dv))
        _same("lse", ls, (hq, tq))
        _check_index("cu_seqlens_q", cu_seqlens_q, batch + 1)
        if cu_seqlens_k is not None:
            _check_index("cu_seqlens_k", cu_seqlens_k, batch + 1)
    else:
        _same("out", os_, (batch, hq, sq, dv))
        _same("lse", ls, (batch, hq, sq))
    if seqused_k is not None:
        _check_index("seqused_k", seqused_k, batch)
    if not 0.0 <= dropout_p < 1.0:
        _fail("dropout_p", dropout_p, "a float in [0, 1)")
    if softcap < 0:
        _fail("softcap", softcap, "a float >= 0")
    if cancel is not None and not isinstance(cancel, CancelFlag):
        _fail("cancel", type(cancel).__name__, "a CancelFlag or None", TypeError)
    if paged:
        if not isinstance(block_table, torch.Tensor) or block_table.dtype is not torch.int32 or \
                block_table.dim() != 2 or block_table.shape[0] != batch or not block_table.is_cpu:
            _fail("block_table", getattr(block_table, "shape", type(block_table).__name__),
                  f"an int32 CPU tensor of shape ({batch}, max_pages)", TypeError)
        if block_table.shape[1] == 0 or page_size == 0:
            _fail("block_table", f"shape {tuple(block_table.shape)} with page size {page_size}", "at least one page")
        sk = block_table.shape[1] * page_size
    full = (batch, hq, sq, sk)
    for name, t, dtypes in (("mask", mask, (torch.bool,)), ("bias", bias, _DTYPES)):
        if t is not None:
            if varlen:
                _fail(name, f"a {name} with varlen inputs", f"no {name} (sequences are already separated)")
            _check_bcast4(name, t, full, dtypes)
    if alibi_slopes is not None:
        sl = alibi_slopes
        if not isinstance(sl, torch.Tensor) or sl.dtype is not _F32 or tuple(sl.shape) not in ((hq,), (batch, hq)):
            _fail("alibi_slopes", getattr(sl, "shape", type(sl).__name__), f"fp32 ({hq},) or ({batch}, {hq})")
    return full, varlen


def _validate_backward(q, k, v, dout, lse, delta, dq, dk, dv, bias, dbias, full, varlen):
    """The checks a direct backward call adds to :func:`_validate` (which took dout for out)."""
    _check_memory(delta=delta, dq=dq, dk=dk, dv=dv, dbias=dbias)
    dtype = q.dtype
    ds = _check("delta", delta, lse.dim(), accumulation_dtype(dtype))
    _same("delta", ds, lse.shape)
    if delta.stride() != lse.stride():
        _fail("delta", f"strides {delta.stride()}", f"the strides of lse, {lse.stride()}")
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _same(name, _check(name, grad, like.dim(), dtype, _out2(dtype)), like.shape)
    if dk.dtype is not dv.dtype:
        _fail("dv", f"dtype {dv.dtype}", f"the dtype of dk, {dk.dtype}", TypeError)
    if dbias is not None:
        if bias is None:
            _fail("dbias", "a buffer", "None when there is no bias")
        _check_bcast4("dbias", dbias, full, (accumulation_dtype(dtype),))


# --------------------------------------------------------------------------------------------- calls
# Packing reads shapes and strides of arguments that are valid (validated here or by the spec).


def _bcast4(t, full):
    """Strides of a 4-d tensor broadcast to `full`: 0 along its size-1 dims."""
    st = t.stride()
    return [st[d] if n == f and f != 1 else 0 for d, (n, f) in enumerate(zip(t.shape, full))]


def _core(lib, loc, q, k, v, out, lse, scale, left, right, bottom_right, shift, cu_seqlens_q, cu_seqlens_k,
          seqused_k, block_table, softcap, alibi_slopes, mask, bias, dropout_p, seed, block_m, block_n, num_threads,
          cancel, options, user, extra, backward=None):
    """Fill every section but the backward ones and the quantised cache's, by field name (``extra``:
    further core fields as they are; ``backward``: core fields of the backward pass, which may replace
    any other). Returns the full (B, Hq, Sq, Sk) shape and whether the call is varlen. A padded call
    without mask, bias or ALiBi (a decode step) fills the core section alone."""
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
        lib.fill["paged"](loc.args, num_pages=pages, page_size=page_size, max_pages=block_table.shape[1],
                          bt_st=block_table.stride() + (0,))
    elif varlen:
        tk, hkv = k.shape[:2]
        sk = 0
        k_st, v_st = (0, kst[1], kst[0]), (0, vst[1], vst[0])
    else:
        hkv, sk = k.shape[1], k.shape[2]
        tk, k_st, v_st = 0, kst[:3], vst[:3]
    full = (batch, hq, sq, sk)
    if mask is not None:
        lib.fill["mask"](loc.args, mask_st=_bcast4(mask, full))
    if bias is not None:
        lib.fill["bias"](loc.args, bias_st=_bcast4(bias, full), bias_dtype=_DTYPES[bias.dtype])
    if alibi_slopes is not None:
        sl = alibi_slopes
        lib.fill["alibi"](loc.args, alibi_st=((0, sl.stride(0)) if sl.dim() == 1 else sl.stride()) + (0,))
    ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
    fields = dict(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(),
                     lse=lse.data_ptr(), cu_q=ptr(cu_seqlens_q), cu_k=ptr(cu_seqlens_k), seqused_k=ptr(seqused_k),
                     block_table=ptr(block_table), alibi=ptr(alibi_slopes), mask=ptr(mask), bias=ptr(bias),
                     cancel=0 if cancel is None else cancel.address, err=loc.err_addr,
                     user=0 if user is None else user.address, B=batch, Hq=hq, Hkv=hkv, Sq=sq, Sk=sk, D=d,
                     Dv=_width(v), Tq=tq, Tk=tk, q_st=q_st, k_st=k_st, v_st=v_st, o_st=o_st, lse_st=l_st,
                     dtype=_DTYPES[q.dtype], out_dtype=_DTYPES[out.dtype], left=left, right=right,
                     bottom_right=1 if bottom_right else 0, shift=shift,
                     drop_threshold=int(round(dropout_p * (1 << 24))), seed=seed & (2**63 - 1), block_m=block_m,
                     block_n=block_n, num_threads=torch.get_num_threads() if num_threads is None else num_threads,
                     varlen=1 if varlen else 0, paged=1 if paged else 0, options=options | lib.default_options,
                     scale=scale, softcap=softcap, dropout_p=dropout_p, **extra)
    fields.update(backward or {})
    lib.fill["core"](loc.args, **fields)
    return full, varlen


class UserCall:
    """The user record of one call (csrc/ta.h's ta_user_args: user functions, a block map, the status
    word) and everything it points at, kept alive for the call. ``score``/``mask``: bound programs
    (:class:`tileattn.programs.compiler.Bound`); ``states``: a :class:`tileattn.programs.blocks.BlockStates`;
    ``grads``: per capture of the score program, a buffer (threads, *shape) of its dtype or None."""

    def __init__(self, lib, score=None, mask=None, states=None, grads=None):
        self.score, self.mask, self.states, self.grads = score, mask, states, grads
        record, keep = lib.UserArgs(), []
        for name, bound, functions in (("score", score, ("ta_user_score", "ta_user_score_rows", "ta_user_score_bwd",
                                                         "ta_user_logits")),
                                       ("mask", mask, ("ta_user_mask", "ta_user_mask_rows"))):
            if bound is None:
                continue
            pointers, sizes, scalars, tensors = bound.pack()
            keep += [pointers, sizes, scalars, tensors]
            for field, function in zip(("_fn", "_rows_fn", "_bwd_fn", "_logits_fn"), functions):
                setattr(record, name + field, bound.program.address(function))
            setattr(record, name + "_cap", ctypes.addressof(pointers))
            setattr(record, name + "_sizes", ctypes.addressof(sizes))
            setattr(record, name + "_scalars", ctypes.addressof(scalars))
        if grads is not None:
            threads = max(g.shape[0] for g in grads if g is not None)
            table = (ctypes.c_void_p * (threads * len(grads)))(*[
                None if g is None else g[t].data_ptr() for t in range(threads) for g in grads])
            keep.append(table)
            record.score_grad, record.score_ncap = ctypes.addressof(table), len(grads)
        if states is not None:
            st = states.states
            record.states = st.data_ptr()
            record.states_st = tuple(st.stride(d) if st.shape[d] > 1 else 0 for d in range(4))
            record.block_q, record.block_kv = states.block_q, states.block_kv
            record.map_q_len, record.map_kv_len = states.q_len, states.kv_len
        self.status = ctypes.c_int32(0)
        record.status = ctypes.addressof(self.status)
        self._record, self._keep = record, keep
        self.address = ctypes.addressof(record)

    def raise_failed(self):
        """Raise the error a user function reported (an index out of range), if any."""
        code = self.status.value
        if code > 0:
            self.score.program.raise_check(code, self.score.captures)
        elif code < 0:
            self.mask.program.raise_check(-code, self.mask.captures)


# -------------------------------------------------------------------------------------- quantised K/V


def _kv_format(q, k):
    """The dtype of a quantised (or scaled) cache, checked against q's: one of the formats, or q's own."""
    dtype, kv = getattr(q, "dtype", None), getattr(k, "dtype", None)
    if dtype not in (_F32, _BF16, _F16):
        _fail("q", f"dtype {dtype} with a quantised or scaled cache", "float32, bfloat16 or float16", TypeError)
    if kv is not dtype and kv not in _KV_FORMATS:
        _fail("k", f"dtype {kv}", f"q's dtype {dtype} or a quantised format "
              f"({', '.join(str(f) for f in _KV_FORMATS)})", TypeError)
    return kv


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


def _fill_quant(lib, loc, q, k, v, cu_seqlens_q, block_table, k_scale, k_offset, v_scale, v_offset, q_scale):
    """Validate the scales of a quantised cache and fill the "quant" section (the caller sets the
    options bit that says it is there)."""
    leading = "paged" if block_table is not None else "varlen" if cu_seqlens_q is not None else None
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]
    none = (0, 0, 0, 0, 0, 0)
    ks = none if k_scale is None else _scale_strides("k_scale", k_scale, k, _width(k), batch, leading)
    ko = none if k_offset is None else _scale_strides("k_offset", k_offset, k, _width(k), batch, leading)
    vs = none if v_scale is None else _scale_strides("v_scale", v_scale, v, _width(v), batch, leading)
    vo = none if v_offset is None else _scale_strides("v_offset", v_offset, v, _width(v), batch, leading)
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
    lib.fill["quant"](loc.args, kv_dtype=_KV_FORMATS.get(k.dtype, _DTYPES[q.dtype]), k_scale=ptr(k_scale),
                      k_offset=ptr(k_offset), v_scale=ptr(v_scale), v_offset=ptr(v_offset), q_scale=q_ptr,
                      k_scale_st=ks, k_offset_st=ko, v_scale_st=vs, v_offset_st=vo, q_scale_st=q_st)


def _raise(loc, status):
    if status == CANCELLED:
        raise Cancelled("tileattn native: the call was cancelled (its CancelFlag was set)")
    if status == ENOMEM:
        raise MemoryError("tileattn native: out of memory for tile buffers")
    raise ValueError("tileattn native: " + loc.err.value.decode(errors="replace"))


def forward(q, k, v, out, lse, *, scale, left=-1, right=-1, bottom_right=True, shift=0, cu_seqlens_q=None,
            cu_seqlens_k=None, seqused_k=None, block_table=None, softcap=0.0, alibi_slopes=None, mask=None,
            bias=None, dropout_p=0.0, seed=0, block_m=0, block_n=0, num_threads=None, cancel=None,
            options=0, validate=True, k_scale=None, k_offset=None, v_scale=None, v_offset=None,
            q_scale=None, user=None, **fields) -> None:
    """Attention forward into ``out`` and ``lse`` (see the module docstring; a quantised cache and
    its scales: "Quantised K/V" there; ``user``: a :class:`UserCall`). ``validate=False`` skips the
    argument checks: only for arguments validated already (the engine's calls); the scales of a
    quantised cache are always checked. ``fields``: other fields of the record's core section, by
    name (a kernel argument the header declares; a name it does not is refused)."""
    lib = _state.get("lib") or _library()
    loc = lib.buffers()
    quant = k_scale is not None or k_offset is not None or v_scale is not None or v_offset is not None or \
        q_scale is not None or getattr(k, "dtype", None) in _KV_FORMATS
    if validate:
        if options & _KV_QUANT:
            _fail("options", options, f"flags without {_KV_QUANT} (set by the k_scale/... arguments)")
        _validate(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, softcap, alibi_slopes,
                  mask, bias, dropout_p, cancel, False, _kv_format(q, k) if quant else None)
    if quant:
        _fill_quant(lib, loc, q, k, v, cu_seqlens_q, block_table, k_scale, k_offset, v_scale, v_offset, q_scale)
        options |= _KV_QUANT
    _core(lib, loc, q, k, v, out, lse, scale, left, right, bottom_right, shift, cu_seqlens_q, cu_seqlens_k,
          seqused_k, block_table, softcap, alibi_slopes, mask, bias, dropout_p, seed, block_m, block_n, num_threads,
          cancel, options, user, fields)
    status = lib.forward_fn(loc.args_addr)
    if status != OK:
        _raise(loc, status)
    if user is not None:
        user.raise_failed()


def backward(q, k, v, out, dout, lse, delta, dq, dk, dv, *, scale, left=-1, right=-1, bottom_right=True, shift=0,
             cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, block_table=None, softcap=0.0,
             alibi_slopes=None, mask=None, bias=None, dropout_p=0.0, seed=0, block_m=0, block_n=0,
             num_threads=None, cancel=None, options=0, dbias=None, validate=True, user=None, **fields) -> None:
    """Gradients into ``dq``, ``dk``, ``dv`` (overwritten), ``dbias`` and the user record's capture
    gradient buffers (added to); ``fields`` as :func:`forward`'s."""
    lib = _state.get("lib") or _library()
    loc = lib.buffers()
    if validate:
        # dout takes out's place in the forward-shaped checks (same shape and dtype rules)
        full, varlen = _validate(q, k, v, dout, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, softcap,
                                 alibi_slopes, mask, bias, dropout_p, cancel, True)
        _validate_backward(q, k, v, dout, lse, delta, dq, dk, dv, bias, dbias, full, varlen)
    # out is not read: dout takes its place in the forward-shaped fields, the backward pointers follow
    full, varlen = _core(lib, loc, q, k, v, dout, lse, scale, left, right, bottom_right, shift, cu_seqlens_q,
                         cu_seqlens_k, seqused_k, block_table, softcap, alibi_slopes, mask, bias, dropout_p, seed,
                         block_m, block_n, num_threads, cancel, options, user, fields,
                         dict(out=0, dout=dout.data_ptr(), delta=delta.data_ptr(), dq=dq.data_ptr(), dk=dk.data_ptr(),
                              dv=dv.data_ptr(), dbias=0 if dbias is None else dbias.data_ptr()))
    strides = [(0, g.stride(1), g.stride(0)) if varlen else tuple(g.stride()[:3]) for g in (dout, dq, dk, dv)]
    lib.fill["bwd"](loc.args, do_st=strides[0], dq_st=strides[1], dk_st=strides[2], dv_st=strides[3],
                    dout_dtype=_DTYPES[dout.dtype], dq_dtype=_DTYPES[dq.dtype], dkv_dtype=_DTYPES[dk.dtype])
    if dbias is not None:
        lib.fill["dbias"](loc.args, dbias_st=_bcast4(dbias, full))  # size-1 dims: reduced
    status = lib.backward_fn(loc.args_addr)
    if status != OK:
        _raise(loc, status)
    if user is not None:
        user.raise_failed()
