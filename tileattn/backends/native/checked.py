"""Direct calls of the native kernels (tests, benchmarks, tuning, tutorials), every argument checked
before any C runs: the keyword interface over :func:`.kernels.forward` / :func:`.kernels.backward`.

The native engine does not come here: the spec validated its calls once (:mod:`tileattn.core.spec`
and the modifiers), and a second pass over every argument would cost a decode step microseconds.
So the checks live apart from the kernels' binding, and the binding takes its arguments as the
engine holds them: a :class:`tileattn.core.kernel_args.KernelArgs`, a :class:`.kernels.Geometry` and
:class:`.kernels.Tiles`.

Interface::

    forward(q, k, v, out, lse, *, scale, <keywords>) -> None
    backward(q, k, v, out, dout, lse, delta, dq, dk, dv, *, scale, <keywords>, dbias=None) -> None

Each keyword is taken by its name: a field of ``KernelArgs`` (``scale``, ``left=-1``, ``right=-1``,
``bottom_right=True``, ``shift=0``, ``softcap=0.0``, ``dropout_p=0.0``, ``seed=0``,
``alibi_slopes``, ``mask``, ``bias``, ``k_scale``, ``k_offset``, ``v_scale``, ``v_offset``,
``q_scale``), of ``Geometry`` (``cu_seqlens_q``, ``cu_seqlens_k``, ``seqused_k``, ``block_table``)
or of ``Tiles`` (``block_m``, ``block_n``, ``num_threads``, ``options``), or ``cancel``; any other
name is refused.

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
j of the sequence, wherever its page lies; not with varlen q); ``dbias`` is an fp32 (fp64) 4-d
buffer whose every dimension is the full one or 1, which the backward pass *adds* to, summing over
its size-1 dimensions. ``alibi_slopes`` fp32 (Hq,) or (B, Hq). ``delta`` = rowsum(dout * out) - dlse,
lse-shaped with lse's strides, computed by the caller; ``out`` is not read by the backward pass
(pass it or None).

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
(two values a byte, the last dim half the head dim; layout in csrc/kv.h) (q fp32, bf16 or fp16; out
q's dtype or fp32), read as stored and dequantised in the kernel as ``(x + offset) * scale`` (the
Ascend antiquant convention; no offset = symmetric). The scales and offsets, and what they may be:
:func:`.kernels.forward`.

``num_threads`` (default ``torch.get_num_threads()``) OpenMP threads run inside the call; the work
split depends only on the problem, so the results are bitwise identical for any thread count and a
row's result does not depend on the other batch items. ``block_m`` (query lanes per tile, default
128) and ``block_n`` (keys per tile, default 256) change the tiling and therefore the rounding.
``options`` takes the FORCE_* / *BF16DOT / NO_AMX flags of :mod:`.kernels` (tests and tuning).
``cancel``: a :class:`.kernels.CancelFlag` (or None), see there.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from ...core.engine import Gradients
from ...core.kernel_args import PER_CALL_FIELDS, KernelArgs
from . import kernels
from .kernels import (_BF16, _DTYPES, _F16, _F32, _F64, _KV_FORMATS, _KV_QUANT, _QUANT_FIELDS, CancelFlag, Geometry,
                      Tiles, _check_memory, _fail, _width, accumulation_dtype)

_ARGUMENTS = tuple(f.name for f in fields(KernelArgs) if f.name != "per_call")


def forward(q, k, v, out, lse, **keywords) -> None:
    """Attention forward into ``out`` and ``lse``, every argument checked first (the module docstring)."""
    args, geometry, tiles, cancel = _split(keywords)
    if tiles.options & _KV_QUANT:
        _fail("options", tiles.options, f"flags without {_KV_QUANT} (set by the k_scale/... arguments)")
    _validate(q, k, v, out, lse, args, geometry, cancel, False, _kv_format(q, k) if _quantised(k, args) else None)
    kernels.forward(q, k, v, out, lse, args, geometry, tiles, cancel=cancel)


def backward(q, k, v, out, dout, lse, delta, dq, dk, dv, *, dbias=None, **keywords) -> None:
    """Gradients into ``dq``, ``dk``, ``dv`` (overwritten) and ``dbias`` (added to), every argument
    checked first (the module docstring)."""
    args, geometry, tiles, cancel = _split(keywords)
    # dout takes out's place in the forward-shaped checks (same shape and dtype rules)
    full, varlen = _validate(q, k, v, dout, lse, args, geometry, cancel, True)
    _validate_backward(q, k, v, dout, lse, delta, dq, dk, dv, args.bias, dbias, full, varlen)
    grads = Gradients(out=out, dout=dout, lse=lse, delta=delta, dlse=None, dq=dq, dk=dk, dv=dv, dbias=dbias)
    kernels.backward(q, k, v, grads, args, geometry, tiles, cancel=cancel)


def _split(keywords: dict):
    """(KernelArgs, Geometry, Tiles, cancel) of a direct call's keywords, each taken by its name."""
    unknown = set(keywords) - set(_ARGUMENTS) - set(Geometry._fields) - set(Tiles._fields) - {"cancel"}
    if unknown:
        raise TypeError(f"tileattn native: unexpected argument(s) {', '.join(sorted(unknown))}")
    if "scale" not in keywords:
        raise TypeError("tileattn native: missing argument 'scale'")
    given = {name: keywords[name] for name in _ARGUMENTS if name in keywords}
    per_call = frozenset(name for name in PER_CALL_FIELDS if given.get(name) is not None)
    return (KernelArgs(per_call=per_call, **given),
            Geometry(*(keywords.get(name) for name in Geometry._fields)),
            Tiles(*(keywords.get(name, default) for name, default in Tiles._field_defaults.items())),
            keywords.get("cancel"))


def _quantised(k, args) -> bool:
    """Whether a call reads a quantised or scaled cache (the "quant" section: its format and scales)."""
    return getattr(k, "dtype", None) in _KV_FORMATS or any(getattr(args, name) is not None for name in _QUANT_FIELDS)


def _kv_format(q, k):
    """The dtype of a quantised (or scaled) cache, checked against q's: one of the formats, or q's own."""
    dtype, kv = getattr(q, "dtype", None), getattr(k, "dtype", None)
    if dtype not in (_F32, _BF16, _F16):
        _fail("q", f"dtype {dtype} with a quantised or scaled cache", "float32, bfloat16 or float16", TypeError)
    if kv is not dtype and kv not in _KV_FORMATS:
        _fail("k", f"dtype {kv}", f"q's dtype {dtype} or a quantised format "
              f"({', '.join(str(f) for f in _KV_FORMATS)})", TypeError)
    return kv


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


def _out2(dtype):
    """The second allowed dtype of outputs and gradients besides the input dtype: fp32."""
    return None if dtype is _F64 else _F32


def _validate(q, k, v, out, lse, args, geometry, cancel, backward, kv_dtype=None):
    """Every check of the forward-shaped arguments of a direct call. ``kv_dtype``: the dtype of k and v
    when it is not q's (a quantised cache). Returns the full (B, Hq, Sq, Sk) shape and whether the call
    is varlen."""
    cu_seqlens_q, cu_seqlens_k, seqused_k, block_table = geometry
    alibi_slopes, mask, bias = args.alibi_slopes, args.mask, args.bias
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
    dk, dv = _width(k, args), _width(v, args)
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
    if not 0.0 <= args.dropout_p < 1.0:
        _fail("dropout_p", args.dropout_p, "a float in [0, 1)")
    if args.softcap < 0:
        _fail("softcap", args.softcap, "a float >= 0")
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
