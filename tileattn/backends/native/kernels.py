"""ctypes binding of the native kernels: thin wrappers that take torch tensors.

Interface (stable; the backend calls exactly this)::

    forward(q, k, v, out, lse, *, scale, left=-1, right=-1, bottom_right=True, shift=0,
            cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, block_table=None,
            softcap=0.0, alibi_slopes=None, mask=None, bias=None, dropout_p=0.0, seed=0,
            block_m=0, block_n=0, num_threads=None, cancel=None, options=0) -> None

    backward(q, k, v, out, dout, lse, delta, dq, dk, dv, *, <the same keywords>, dbias=None) -> None

Tensors (CPU; any strides with a unit last-dim stride; views are read and written in place):

* padded: q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv); out (B, Hq, Sq, Dv);
  lse (B, Hq, Sq)
* varlen (``cu_seqlens_q`` and ``cu_seqlens_k``, int32 (B+1,)): q (Tq, Hq, D), k (Tk, Hkv, D),
  v (Tk, Hkv, Dv); out (Tq, Hq, Dv); lse (Hq, Tq)
* paged KV (``block_table`` int32 (B, max_pages), forward only): k (pages, page_size, Hkv, D),
  v (pages, page_size, Hkv, Dv), key j of batch item b in page ``block_table[b, j // page_size]``;
  q padded (B, Hq, Sq, D) or varlen with ``cu_seqlens_q`` alone
* ``seqused_k`` int32 (B,): batch item b uses only its first ``seqused_k[b]`` keys

dtypes: q, k, v share one of fp32, fp64, bf16, fp16. ``out``, ``dq``, ``dk``, ``dv`` and ``dout``
are that dtype or fp32 (fp64 inputs: fp64); ``lse`` and ``delta`` are fp32 (fp64 for fp64 inputs).
``mask`` is bool and ``bias`` any float dtype, both 4-d and broadcast to (B, Hq, Sq, Sk) (expanded
views with stride 0 are read in place); ``dbias`` is an fp32 (fp64) 4-d buffer whose every dimension
is the full one or 1, which the backward pass *adds* to, summing over its size-1 dimensions. ``alibi_slopes`` fp32 (Hq,) or
(B, Hq). ``delta`` = rowsum(dout * out) - dlse, computed by the caller; ``out`` is not read by the
backward pass (pass it or None).

Semantics, as :func:`tileattn.reference`: ``s = scale * q.k -> softcap -> + ALiBi + bias -> band and
mask -> softmax -> dropout -> . v``; query row i of a sequence sees key j iff
``i + off - left <= j <= i + off + right`` (-1 = unbounded) with
``off = shift + (k_len - q_len if bottom_right else 0)``; ALiBi adds ``-slope * |i + off - j|``;
a row that sees no key gets out = 0 and lse = -inf. Dropout keeps (seed, batch, head, row, col)
by the counter-based hash of :mod:`tileattn.scores` (row and column within the sequence).

``num_threads`` (default ``torch.get_num_threads()``) OpenMP threads run inside the call; the work
split depends only on the problem, so the results are bitwise identical for any thread count and a
row's result does not depend on the other batch items. ``block_m`` (query lanes per tile, default
128) and ``block_n`` (keys per tile, default 256) change the tiling and therefore the rounding.

Cancellation: ``cancel`` is a :class:`CancelFlag` (or None). The kernels poll it between tiles;
once set, every thread stops at its next tile, the call returns and the wrapper raises
:class:`Cancelled` (outputs are then partly written). Another thread, a timer or a signal handler
may set it. ``with flag.on_sigint():`` arms a C-level SIGINT handler around a call from the main
thread: Ctrl-C sets the flag and is passed on to Python's own handler, so a long call stops within
one tile and KeyboardInterrupt is raised as usual.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading

import torch

from . import build as _build

_DTYPES = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
_ELEMENT = {"p": "Q", "i": "q", "d": "d", "i3": "3q", "i4": "4q"}
_WIDTH = {"p": 1, "i": 1, "d": 1, "i3": 3, "i4": 4}
_ERR_LEN = 512

#: status codes of the C functions
OK, CANCELLED, EINVAL, ENOMEM = 0, 1, -1, -2

#: options (bit flags) for tests and tuning; see csrc/ta.h
FORCE_PREFILL, FORCE_DECODE, FORCE_SPLIT, FORCE_FUSED, NO_BF16DOT, BF16DOT = 1, 2, 4, 8, 16, 32

#: What the kernels do natively. A call outside this is for another engine.
CAPABILITIES = {
    "dtypes": frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16}),
    "forward": frozenset({"band", "shift", "gqa", "varlen", "seqused_k", "paged_kv", "softcap", "alibi",
                          "mask", "bias", "dropout", "decode"}),
    "backward": frozenset({"band", "shift", "gqa", "varlen", "seqused_k", "softcap", "alibi", "mask", "bias",
                           "dbias", "dropout"}),
}


class Unavailable(RuntimeError):
    """The native library cannot be used here (no compiler, failed build); the message says why."""


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
        KeyboardInterrupt once the native call returns."""
        lib = _library().lib
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("CancelFlag.on_sigint() must be used from the main thread")
        before = self._value.value
        if lib.ta_sigint_arm(ctypes.c_void_p(self.address)) != 0:
            raise OSError("sigaction(SIGINT) failed")
        try:
            yield self
        finally:
            lib.ta_sigint_disarm()
            if self._value.value and not before:
                self.by_sigint = True


class _Abi:
    """The ta_args layout, read from the library so Python and C cannot disagree."""

    def __init__(self, lib):
        fields = [f.split(":") for f in lib.ta_abi().decode().strip(",").split(",")]
        self.index = {}
        fmt, pos = "<", 0
        for name, kind in fields:
            self.index[name] = pos
            fmt += _ELEMENT[kind]
            pos += _WIDTH[kind]
        self.struct = struct.Struct(fmt)
        self.nvalues = pos


class _Library:
    def __init__(self, info: _build.BuildInfo):
        self.info = info
        lib = ctypes.CDLL(info.path)
        lib.ta_abi.restype = ctypes.c_char_p
        lib.ta_build_info.restype = ctypes.c_char_p
        for name in ("ta_forward", "ta_backward", "ta_sigint_arm"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
            getattr(lib, name).restype = ctypes.c_int
        lib.ta_sigint_disarm.restype = ctypes.c_int
        self.lib = lib
        self.abi = _Abi(lib)
        self.build_info = lib.ta_build_info().decode()
        self.local = threading.local()

    def buffers(self):
        """Per-thread argument struct and error buffer, allocated once."""
        loc = self.local
        if not hasattr(loc, "args"):
            loc.args = ctypes.create_string_buffer(self.abi.struct.size)
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
                _state["lib"] = _Library(_build.build())
            except (_build.BuildError, OSError) as exc:
                _state["error"] = f"native kernels unavailable: {exc}"
                raise Unavailable(_state["error"]) from exc
    return _state["lib"]


def load():
    """Build (first use) and load the library; returns its :class:`~.build.BuildInfo`.

    Raises :class:`Unavailable` with the reason when there is no compiler or the build fails; the
    reason is remembered, so later calls fail fast without retrying the build.
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
                flags=" ".join(info.flags), path=info.path, build_seconds=info.build_seconds, cached=info.cached,
                bf16dot=fields.get("bf16dot") == "1", openmp=fields.get("openmp") == "1")


def supports(*, dtype, backward=False, features=()):
    """Reasons (a list of strings, empty when supported) why a call is not native."""
    why = []
    if dtype not in CAPABILITIES["dtypes"]:
        why.append(f"dtype {dtype} is not native")
    native = CAPABILITIES["backward" if backward else "forward"]
    for f in features:
        if f not in native:
            why.append(f"{f} is not native in the {'backward' if backward else 'forward'} pass")
    return why


# ----------------------------------------------------------------------------------- argument checks


def _fail(arg, given, expected, exc=ValueError):
    raise exc(f"tileattn native: argument '{arg}': got {given}; expected {expected}.")


def _tensor(name, t, dim, dtypes=None, unit_last=True):
    if not isinstance(t, torch.Tensor):
        _fail(name, type(t).__name__, "a torch.Tensor", TypeError)
    if t.device.type != "cpu":
        _fail(name, f"device {t.device}", "a CPU tensor")
    if t.dim() != dim:
        _fail(name, f"shape {tuple(t.shape)}", f"a {dim}-d tensor")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(name, f"dtype {t.dtype}", "one of " + ", ".join(str(d) for d in dtypes), TypeError)
    if unit_last and t.numel() and t.stride(-1) != 1 and t.shape[-1] != 1:
        _fail(name, f"strides {t.stride()}", "a unit stride in the last dimension (a strided view, not a copy)")


def _shape(name, t, shape):
    if tuple(t.shape) != tuple(shape):
        _fail(name, f"shape {tuple(t.shape)}", f"shape {tuple(shape)}")


def _index(name, t, length):
    _tensor(name, t, 1, (torch.int32,))
    if not t.is_contiguous():
        _fail(name, f"strides {t.stride()}", "a contiguous int32 tensor")
    if t.shape[0] != length:
        _fail(name, f"length {t.shape[0]}", f"length {length}")


def _bcast4(name, t, full, dtypes):
    """Strides of a 4-d tensor broadcast to `full` (0 along its size-1 dims); any strides are read."""
    _tensor(name, t, 4, dtypes, unit_last=False)
    st = []
    for d, (n, f) in enumerate(zip(t.shape, full)):
        if n != f and n != 1:
            _fail(name, f"shape {tuple(t.shape)}", f"a 4-d shape broadcastable to {tuple(full)}")
        st.append(t.stride(d) if n == f and f != 1 else 0)
    return st


def _acc_dtypes(dtype):
    return (torch.float64,) if dtype == torch.float64 else (torch.float32,)


def _out_dtypes(dtype):
    return (torch.float64,) if dtype == torch.float64 else (dtype, torch.float32)


# --------------------------------------------------------------------------------------------- calls


def _fill(lib, q, k, v, out, lse, kw, backward):
    """Validate and return the value list of ta_args (everything but the backward-only tensors)."""
    idx = lib.abi.index
    vals = [0] * lib.abi.nvalues
    dtype = q.dtype
    if dtype not in _DTYPES:
        _fail("q", f"dtype {dtype}", "float32, float64, bfloat16 or float16", TypeError)
    cu_q, cu_k, used, table = kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["seqused_k"], kw["block_table"]
    varlen, paged = cu_q is not None, table is not None
    if cu_k is not None and not varlen:
        _fail("cu_seqlens_k", "a tensor", "None unless cu_seqlens_q is given (varlen)")
    if varlen and not paged and cu_k is None:
        _fail("cu_seqlens_k", None, "int32 cumulative key offsets (varlen)")
    if paged and cu_k is not None:
        _fail("cu_seqlens_k", "a tensor", "None with a block_table (key counts come from seqused_k)")
    if paged and backward:
        _fail("block_table", "a paged KV cache in the backward pass", "contiguous or strided k/v (paged KV is forward-only)")
    qdim = 3 if varlen else 4
    _tensor("q", q, qdim, _DTYPES)
    kvdim = 4 if paged else qdim
    _tensor("k", k, kvdim, (dtype,))
    _tensor("v", v, kvdim, (dtype,))
    if varlen:
        tq, hq, d = q.shape
        batch = cu_q.shape[0] - 1
        sq = 0
    else:
        batch, hq, sq, d = q.shape
        tq = 0
    if paged:
        pages, page_size, hkv, dk = k.shape
        _shape("v", v, (pages, page_size, hkv, v.shape[3]))
        dv = v.shape[3]
        if table.dim() != 2 or table.dtype != torch.int32 or table.shape[0] != batch:
            _fail("block_table", f"{table.dtype} tensor of shape {tuple(table.shape)}",
                  f"an int32 tensor of shape ({batch}, max_pages)", TypeError)
        if table.shape[1] == 0 or page_size == 0:
            _fail("block_table", f"shape {tuple(table.shape)} with page size {page_size}", "at least one page")
        sk, tk = table.shape[1] * page_size, 0
        st_k, st_v = (k.stride(0), k.stride(2), k.stride(1)), (v.stride(0), v.stride(2), v.stride(1))
        vals[idx["block_table"]] = table.data_ptr()
        vals[idx["num_pages"]], vals[idx["page_size"]], vals[idx["max_pages"]] = pages, page_size, table.shape[1]
        bt = idx["bt_st"]
        vals[bt], vals[bt + 1] = table.stride(0), table.stride(1)
    elif varlen:
        tk, hkv, dk = k.shape
        dv = v.shape[2]
        _shape("v", v, (tk, hkv, dv))
        sk = 0
        st_k, st_v = (0, k.stride(1), k.stride(0)), (0, v.stride(1), v.stride(0))
    else:
        _, hkv, sk, dk = k.shape
        dv = v.shape[3]
        _shape("k", k, (batch, hkv, sk, dk))
        _shape("v", v, (batch, hkv, sk, dv))
        tk = 0
        st_k, st_v = k.stride()[:3], v.stride()[:3]
    if dk != d:
        _fail("k", f"head dim {dk}", f"the head dim of q, {d}")
    if hkv == 0 or hq % hkv:
        _fail("k", f"{hkv} kv heads for {hq} query heads", "a number of kv heads dividing the query heads")
    if d == 0 or dv == 0:
        _fail("q/v", f"head dims {d}/{dv}", "positive head dims")
    if max(sq, sk, tq, tk) >= 2**31 - 1:
        _fail("q/k", "a sequence of 2^31 tokens or more", "fewer tokens")
    if varlen:
        _index("cu_seqlens_q", cu_q, batch + 1)
        if cu_k is not None:
            _index("cu_seqlens_k", cu_k, batch + 1)
            vals[idx["cu_k"]] = cu_k.data_ptr()
        vals[idx["cu_q"]] = cu_q.data_ptr()
        _tensor("out", out, 3, _out_dtypes(dtype))
        _shape("out", out, (tq, hq, dv))
        _tensor("lse", lse, 2, _acc_dtypes(dtype))
        _shape("lse", lse, (hq, tq))
        st_q, st_o, st_l = (0, q.stride(1), q.stride(0)), (0, out.stride(1), out.stride(0)), (0,) + lse.stride()
    else:
        _tensor("out", out, 4, _out_dtypes(dtype))
        _shape("out", out, (batch, hq, sq, dv))
        _tensor("lse", lse, 3, _acc_dtypes(dtype))
        _shape("lse", lse, (batch, hq, sq))
        st_q, st_o, st_l = q.stride()[:3], out.stride()[:3], lse.stride()
    if used is not None:
        _index("seqused_k", used, batch)
        vals[idx["seqused_k"]] = used.data_ptr()
    full = (batch, hq, sq, sk)
    if kw["mask"] is not None:
        if varlen or paged:
            _fail("mask", "a mask with varlen or paged inputs", "no mask (sequences are already separated)")
        i = idx["mask_st"]
        vals[i:i + 4] = _bcast4("mask", kw["mask"], full, (torch.bool,))
        vals[idx["mask"]] = kw["mask"].data_ptr()
    if kw["bias"] is not None:
        if varlen or paged:
            _fail("bias", "a bias with varlen or paged inputs", "no bias")
        bias = kw["bias"]
        i = idx["bias_st"]
        vals[i:i + 4] = _bcast4("bias", bias, full, tuple(_DTYPES))
        vals[idx["bias"]], vals[idx["bias_dtype"]] = bias.data_ptr(), _DTYPES[bias.dtype]
    slopes = kw["alibi_slopes"]
    if slopes is not None:
        if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32 or \
                tuple(slopes.shape) not in ((hq,), (batch, hq)):
            _fail("alibi_slopes", getattr(slopes, "shape", type(slopes).__name__), f"fp32 ({hq},) or ({batch}, {hq})")
        i = idx["alibi_st"]
        vals[i], vals[i + 1] = (0, slopes.stride(0)) if slopes.dim() == 1 else slopes.stride()
        vals[idx["alibi"]] = slopes.data_ptr()
    p = float(kw["dropout_p"])
    if not 0.0 <= p < 1.0:
        _fail("dropout_p", p, "a float in [0, 1)")
    if kw["softcap"] < 0:
        _fail("softcap", kw["softcap"], "a float >= 0")
    cancel = kw["cancel"]
    if cancel is not None and not isinstance(cancel, CancelFlag):
        _fail("cancel", type(cancel).__name__, "a CancelFlag or None", TypeError)
    nthreads = kw["num_threads"]
    for name, arr in (("q_st", st_q), ("k_st", st_k), ("v_st", st_v), ("o_st", st_o), ("lse_st", st_l)):
        i = idx[name]
        vals[i:i + 3] = arr
    vals[idx["q"]], vals[idx["k"]], vals[idx["v"]] = q.data_ptr(), k.data_ptr(), v.data_ptr()
    vals[idx["out"]], vals[idx["lse"]] = out.data_ptr(), lse.data_ptr()
    vals[idx["cancel"]] = 0 if cancel is None else cancel.address
    for name, val in (("B", batch), ("Hq", hq), ("Hkv", hkv), ("Sq", sq), ("Sk", sk), ("D", d), ("Dv", dv),
                      ("Tq", tq), ("Tk", tk), ("dtype", _DTYPES[dtype]), ("out_dtype", _DTYPES[out.dtype]),
                      ("left", int(kw["left"])), ("right", int(kw["right"])),
                      ("bottom_right", 1 if kw["bottom_right"] else 0), ("shift", int(kw["shift"])),
                      ("drop_threshold", int(round(p * (1 << 24)))), ("seed", int(kw["seed"]) & (2**63 - 1)),
                      ("block_m", int(kw["block_m"])), ("block_n", int(kw["block_n"])),
                      ("num_threads", torch.get_num_threads() if nthreads is None else int(nthreads)),
                      ("varlen", int(varlen)), ("paged", int(paged)), ("options", int(kw["options"])),
                      ("scale", float(kw["scale"])), ("softcap", float(kw["softcap"])), ("dropout_p", p)):
        vals[idx[name]] = val
    return vals


def _call(lib, fn, vals, cancel):
    loc = lib.buffers()
    vals[lib.abi.index["err"]] = loc.err_addr
    lib.abi.struct.pack_into(loc.args, 0, *vals)
    status = fn(loc.args_addr)
    if status == OK:
        return
    if status == CANCELLED:
        raise Cancelled("tileattn native: the call was cancelled (its CancelFlag was set)")
    if status == ENOMEM:
        raise MemoryError("tileattn native: out of memory for tile buffers")
    raise ValueError("tileattn native: " + loc.err.value.decode(errors="replace"))


_DEFAULTS = dict(left=-1, right=-1, bottom_right=True, shift=0, cu_seqlens_q=None, cu_seqlens_k=None,
                 seqused_k=None, block_table=None, softcap=0.0, alibi_slopes=None, mask=None, bias=None,
                 dropout_p=0.0, seed=0, block_m=0, block_n=0, num_threads=None, cancel=None, options=0)


def forward(q, k, v, out, lse, *, scale, **kwargs) -> None:
    """Attention forward into ``out`` and ``lse`` (see the module docstring)."""
    kw = _merge(kwargs, "forward")
    kw["scale"] = scale
    lib = _library()
    vals = _fill(lib, q, k, v, out, lse, kw, backward=False)
    _call(lib, lib.lib.ta_forward, vals, kw["cancel"])


def backward(q, k, v, out, dout, lse, delta, dq, dk, dv, *, scale, dbias=None, **kwargs) -> None:
    """Gradients into ``dq``, ``dk``, ``dv`` (overwritten) and ``dbias`` (added to)."""
    kw = _merge(kwargs, "backward")
    kw["scale"] = scale
    lib = _library()
    idx = lib.abi.index
    dtype = q.dtype
    vals = _fill(lib, q, k, v, dout, lse, kw, backward=True)
    # _fill checked dout in the place of out (same shape rules); delta is lse-shaped and typed
    _tensor("delta", delta, lse.dim(), _acc_dtypes(dtype))
    _shape("delta", delta, lse.shape)
    if delta.stride() != lse.stride():
        _fail("delta", f"strides {delta.stride()}", f"the strides of lse, {lse.stride()}")
    for name, grad, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _tensor(name, grad, like.dim(), _out_dtypes(dtype))
        _shape(name, grad, like.shape)
    if dk.dtype != dv.dtype:
        _fail("dv", f"dtype {dv.dtype}", f"the dtype of dk, {dk.dtype}", TypeError)
    varlen = kw["cu_seqlens_q"] is not None

    def st3(t):
        return (0, t.stride(1), t.stride(0)) if varlen else t.stride()[:3]

    for name, t in (("do_st", dout), ("dq_st", dq), ("dk_st", dk), ("dv_st", dv)):
        i = idx[name]
        vals[i:i + 3] = st3(t)
    vals[idx["dout"]], vals[idx["delta"]] = dout.data_ptr(), delta.data_ptr()
    vals[idx["dq"]], vals[idx["dk"]], vals[idx["dv"]] = dq.data_ptr(), dk.data_ptr(), dv.data_ptr()
    vals[idx["out"]], vals[idx["out_dtype"]] = 0, 0
    vals[idx["dout_dtype"]], vals[idx["dq_dtype"]] = _DTYPES[dout.dtype], _DTYPES[dq.dtype]
    vals[idx["dkv_dtype"]] = _DTYPES[dk.dtype]
    if dbias is not None:
        if kw["bias"] is None:
            _fail("dbias", "a buffer", "None when there is no bias")
        full = q.shape[:3] + k.shape[2:3]  # bias is padded-only, so q and k are (B, H, S, D)
        i = idx["dbias_st"]
        vals[i:i + 4] = _bcast4("dbias", dbias, full, _acc_dtypes(dtype))  # size-1 dims: reduced
        vals[idx["dbias"]] = dbias.data_ptr()
    _call(lib, lib.lib.ta_backward, vals, kw["cancel"])


_KEYWORDS = frozenset(_DEFAULTS)


def _merge(kwargs, kind):
    unknown = set(kwargs) - _KEYWORDS
    if unknown:
        raise TypeError(f"tileattn native {kind}(): unexpected keyword argument(s) {sorted(unknown)}")
    kw = dict(_DEFAULTS)
    kw.update(kwargs)
    return kw
