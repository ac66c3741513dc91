"""Ascend inference attention ops on tileattn's decode path: ``npu_fused_infer_attention_score``
(and ``_v2``), ``npu_prompt_flash_attention`` (prefill), ``npu_incre_flash_attention`` (decode).

Every call becomes one ``flash_attention(..., seqused_k=, block_table=)`` call:

* layouts BSH/BSND/BNSD (a view as BSND or BNSD), TND, NTD (a view as TND), and the output
  variants ``X_Y`` (input X, output Y: BNSD_BSND, *_NBSD, TND_NTD, NTD_TND);
* ``actual_seq_lengths_kv`` -> ``seqused_k`` (bottom-right alignment counts from it, as
  rightDownCausal does); ``block_table``/``block_size`` -> tileattn's paged pools, read in place
  ((blocks, block_size, H) is viewed as (blocks, block_size, N, D); (blocks, N, block_size, D) is
  transposed, a view);
* query rows past ``actual_seq_lengths`` are not computed (output 0, LSE -inf): the valid rows
  are gathered into a packed (TND) query once;
* ``atten_mask`` (1 = masked out) and ``pse_shift`` (added after scaling) become a bool mask /
  bias over the padded positions (a paged cache's logical positions 0 .. max_blocks * block_size - 1,
  read in place);
* ``block_table``: the blocks a sequence reads (the first ceil(actual_seq_lengths_kv[b] / block_size)
  of row b) must be blocks of the cache, else an error names ``block_table``; the slots after them
  are never read, as on the NPU, and may hold anything (-1 padding as CANN's PagedAttention
  documents, or 0 as vLLM pads): one check, :func:`_read_blocks`, for every path;
* int8 caches with ``antiquant_scale``/``antiquant_offset`` (or the key_/value_ forms, and v2's
  ``dequant_scale_key``/...), ``antiquant_mode`` 0 (per channel / per tensor) and 1 (per token), are
  read as stored: the factors become the core's ``k_scale``/``k_offset``/... (views, no copy), and
  the native kernels apply ``(x + offset) * scale`` as they read each tile (:mod:`tileattn.core.kvquant`);
  full int8 quantisation (``dequant_scale1``, ``quant_scale2``, ...) is refused by name.

These ops are inference-only in torch_npu and run without autograd here.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import List, NamedTuple, Optional

import torch

from ...core.api import flash_attention
from ...core.layouts import LAYOUT, from_canonical, to_canonical, user_shape
from ...core.spec import build_spec
from ._common import (
    FLOAT_DTYPES, UNBOUNDED, NpuTypeError, band_side, check_float, check_int, check_tensor, core_errors, fail,
    int_list, refuse, warn_once,
)
from ._plan import Band, band_call, region
from .install import beside_stand_in

__all__ = ["npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2", "npu_prompt_flash_attention",
           "npu_incre_flash_attention"]

#: The ops' input layouts: a layout of :data:`tileattn.core.layouts.LAYOUT`, or ``IN_OUT`` (input IN,
#: output OUT).
INPUT_LAYOUTS = ("BSH", "BSND", "BNSD", "TND", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "TND_NTD",
                 "NTD_TND")


def io_layouts(input_layout: str):
    """(the input's layout, the output's) of one of :data:`INPUT_LAYOUTS`."""
    parts = input_layout.split("_")
    return parts[0], parts[-1]


def _read_layout(layout: str) -> str:
    """The layout tileattn reads a tensor of ``layout`` in, as a view: heads split off a fused last dim
    (BSH as BSND), packed rows first (NTD as TND)."""
    lay = LAYOUT[layout]
    if lay.fused:
        return "BSND"
    return "TND" if lay.packed else layout


def _as_read(t, layout: str, heads: Optional[int], read: str):
    """``t`` (in ``layout``, a fused one's last dim split into ``heads``) as a view in layout ``read``."""
    return from_canonical(to_canonical(t, layout, heads), read)
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


class _Names:
    """The argument names of one op, for its error messages."""

    def __init__(self, fn, q_lens="actual_seq_lengths", kv_lens="actual_seq_lengths_kv", heads="num_heads",
                 scale="scale", lse="softmax_lse_flag"):
        self.fn, self.q_lens, self.kv_lens, self.heads, self.scale, self.lse = fn, q_lens, kv_lens, heads, scale, lse


def _per_batch(names, name, values, batch, limit):
    """torch_npu's per-batch lengths: one value for every batch, or the first ``batch`` values."""
    lens = int_list(names.fn, name, values)
    if lens is None:
        return None
    if len(lens) == 1:
        lens = lens * batch
    if len(lens) < batch:
        fail(names.fn, name, f"{len(lens)} values", f"1 or at least {batch} (one per batch)")
    lens = lens[:batch]
    bad = [(b, n) for b, n in enumerate(lens) if not 0 <= n <= limit]
    if bad:
        fail(names.fn, name, f"{bad[0][1]} for batch {bad[0][0]}", f"a length in [0, {limit}]")
    return lens


def _cumulative(names, name, values, total):
    ends = int_list(names.fn, name, values)
    if not ends:
        fail(names.fn, name, repr(values), "cumulative sequence ends (required for TND), e.g. [3, 7]", NpuTypeError)
    if ends[0] < 0 or any(b < a for a, b in zip(ends, ends[1:])) or ends[-1] > total:
        fail(names.fn, name, ends, f"non-decreasing cumulative ends up to the {total} packed rows")
    return [0] + ends


def _antiquant_factor(names, t, name, raw, layout, view, per_token):
    """An antiquant scale or offset of the raw int8 ``raw`` (the caller's layout) as the core reads it:
    fp32, broadcastable to the key *view* with its last dim 1 or D. Per-channel and per-tensor factors
    broadcast against the raw cache as given ((N, 1, D) for BNSD, (N, D) for BSND, (H,) for BSH,
    (1,)); per-token factors are (B, S) (or (1, B, S)), one per cached token. A view, never a copy of
    the cache."""
    if t is None:
        return None
    fn = names.fn
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        fail(fn, name, type(t).__name__ if not isinstance(t, torch.Tensor) else f"dtype {t.dtype}",
             "a float tensor", NpuTypeError)
    t = t.float()
    lay = LAYOUT[layout]
    if per_token:
        if lay.packed:
            refuse(fn, f"per-token dequantisation of a '{layout}' cache", "use a padded, unpaged cache")
        if t.dim() < 2 or t.shape[-2:] != (raw.shape[0], raw.shape[lay.seq_dim]) or \
                any(n != 1 for n in t.shape[:-2]):
            fail(fn, name, f"shape {tuple(t.shape)}", f"(B, S) or (1, B, S): one factor per cached token of the "
                 f"'{layout}' cache of shape {tuple(raw.shape)}")
        batch, seq = t.shape[-2:]
        # one factor per (batch, position), as the layout's four dims order them
        return t.reshape([batch if axis == "b" else seq if axis == "s" else 1 for axis in lay.dims])
    if t.dim() > raw.dim() or (t.numel() and not _broadcasts(t.shape, raw.shape)):
        fail(fn, name, f"shape {tuple(t.shape)}", f"a per-channel or per-tensor factor broadcastable to the cache "
             f"{tuple(raw.shape)} ((N, 1, D) for BNSD, (N, D) for BSND, (H,) for BSH, (1,))")
    t = t.reshape((1,) * (raw.dim() - t.dim()) + tuple(t.shape))
    if lay.fused and t.shape[-1] == 1:
        return t.unsqueeze(-1)  # (..., 1) -> (..., 1, 1): no channel axis
    return view(t)


def _broadcasts(shape, full):
    return all(n in (1, f) for n, f in zip(reversed(shape), reversed(full)))


def _antiquant(names, key, value, aq, layout, view):
    """The core's k_scale/k_offset/v_scale/v_offset of an int8 cache, from the documented antiquant
    arguments, applied as ``(x + offset) * scale`` by the kernels as they read the cache (mode 0:
    per-channel/per-tensor, mode 1: per-token; the per-head and paged-scale modes 2-5 are refused)."""
    fn = names.fn
    modes = {}
    for name in ("antiquant_mode", "key_antiquant_mode", "value_antiquant_mode"):
        modes[name] = check_int(fn, name, aq.get(name, 0))
        if modes[name] not in (0, 1):
            refuse(fn, f"{name}={modes[name]} (per-head or paged-scale dequantisation)",
                   "use 0 (per-channel/per-tensor) or 1 (per-token)")
    if aq.get("key_antiquant_scale") is not None or aq.get("value_antiquant_scale") is not None:
        parts = {"k": ("key_antiquant_scale", "key_antiquant_offset", modes["key_antiquant_mode"] == 1, key),
                 "v": ("value_antiquant_scale", "value_antiquant_offset", modes["value_antiquant_mode"] == 1, value)}
        factors = {c: (aq.get(s), aq.get(o), s, o, tok, raw) for c, (s, o, tok, raw) in parts.items()}
    else:
        scale, offset = aq.get("antiquant_scale"), aq.get("antiquant_offset")
        if scale is None:
            fail(fn, "antiquant_scale", None, "the dequantisation scales of the int8 key and value, shape (2, ...)")
        for name, t in (("antiquant_scale", scale), ("antiquant_offset", offset)):
            if t is not None and (not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != 2):
                fail(fn, name, _shape_of(t), "a tensor of shape (2, ...): the key's factors, then the value's")
        per_token = modes["antiquant_mode"] == 1
        factors = {c: (scale[i], None if offset is None else offset[i], "antiquant_scale", "antiquant_offset",
                       per_token, raw) for i, (c, raw) in enumerate((("k", key), ("v", value)))}
    out = {}
    for c, (scale, offset, scale_name, offset_name, per_token, raw) in factors.items():
        if scale is None:
            fail(fn, scale_name, None, "the dequantisation scale of the int8 cache")
        out[f"{c}_scale"] = _antiquant_factor(names, scale, scale_name, raw, layout, view, per_token)
        out[f"{c}_offset"] = _antiquant_factor(names, offset, offset_name, raw, layout, view, per_token)
    return out


def _shape_of(t):
    return f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _bsnd_scales(scales, layout):
    """Scales of a cache read in ``layout`` as those of its (B, S, N, D) view."""
    return {n: None if t is None else _as_read(t, layout, None, "BSND") for n, t in scales.items()}


def _packed_scales(scales, batch, sk):
    """Scales of a (B, S, N, D) cache for the same cache packed as (B*S, N, D) sequences (:func:`_pack`):
    per-token factors flattened with it, the others per sequence (a leading batch axis)."""
    packed = {}
    for name, t in scales.items():
        if t is not None and t.shape[1] == sk and sk != 1:
            t = t.expand(batch, *t.shape[1:]).flatten(0, 1)
        packed[name] = t
    return packed


def _keep_from_mask(names, mask, decode, batch, sq, sk):
    """``atten_mask`` (1 = masked out; sizes may be padded up to aligned ones) as a keep mask
    (True = take part) of shape (B|1, 1, sq, sk)."""
    check_tensor(names.fn, "atten_mask", mask, None, _MASK_DTYPES, " (1/True = masked out)")
    shape = tuple(mask.shape)
    if decode:
        ok = mask.dim() in (2, 3, 4) and shape[0] == batch and all(n == 1 for n in shape[1:-1])
        view = mask.reshape(batch, 1, 1, shape[-1]) if ok else None
        expected = f"(B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S) with B={batch}, KV_S >= {sk}"
    else:
        lead = shape[:-2]
        ok = mask.dim() in (2, 3, 4) and lead in ((), (batch,), (1,), (batch, 1), (1, 1))
        view = mask.reshape(lead[0] if lead else 1, 1, *shape[-2:]) if ok else None
        expected = f"(Q_S, KV_S), (B|1, Q_S, KV_S) or (B|1, 1, Q_S, KV_S) with B={batch}, Q_S >= {sq}, KV_S >= {sk}"
    if not ok or view.shape[-2] < sq or view.shape[-1] < sk:
        fail(names.fn, "atten_mask", f"shape {shape}", expected)
    return view[..., :sq, :sk] == 0


def _band(fn, sparse_mode, pre, nxt, decode, atten_mask) -> Optional[Band]:
    """The band of the call (None: none). Modes 2-4 need the 2048x2048 template (torch_npu raises
    without it). At Q_S = 1 outside TND neither the sparse mode nor pre/next tokens apply (torch_npu
    documents both as having no effect there): a sliding-window decode is TND with sparse_mode=4."""
    lo, hi = (None if band_side(pre) is None else -pre), band_side(nxt)
    if decode:
        if (lo, hi) != (None, None):
            warn_once(("decode-band", fn), f"{fn}: pre_tokens/next_tokens have no effect at Q_S = 1 outside "
                      "input_layout 'TND' (torch_npu documents them as ignored there): every cached key up to "
                      "actual_seq_lengths_kv is attended; for a sliding-window decode pass input_layout='TND' "
                      "with sparse_mode=4 and the 2048x2048 template.")
        return None
    if sparse_mode in (2, 3, 4):
        if atten_mask is None or tuple(atten_mask.shape)[-2:] != (2048, 2048) or atten_mask.dim() > 4 \
                or any(n != 1 for n in atten_mask.shape[:-2]):
            fail(fn, "atten_mask", "None" if atten_mask is None else f"shape {tuple(atten_mask.shape)}",
                 f"the 2048x2048 triu template, shape (2048, 2048) or (1, 1, 2048, 2048), for sparse_mode={sparse_mode}")
    if sparse_mode in (0, 4) and (sparse_mode == 4 or atten_mask is not None) and lo is not None and hi is not None \
            and lo > hi:
        fail(fn, "pre_tokens/next_tokens", f"{pre}/{nxt}", "a band that is not empty (pre_tokens + next_tokens >= 0)")
    if sparse_mode == 0:
        return Band("top_left", lo, hi) if atten_mask is not None else None
    return {1: None, 2: Band("top_left", None, 0), 3: Band("bottom_right", None, 0),
            4: Band("bottom_right", lo, hi)}[sparse_mode]


def _kv(names, key, value, key_rope, query, layout_in, paged, block_size, kv_heads, d, antiquant):
    """Keys and values as tileattn reads them -- paged pools (blocks, block_size, N, D), packed
    (T, N, D), or (B, S, N, D) / (B, N, S, D) like the query -- as views; an int8 cache is
    read as stored, with its antiquant factors as the core's scales (returned third)."""
    fn = names.fn
    quantized = isinstance(key, torch.Tensor) and key.dtype == torch.int8
    for name, t in (("key", key), ("value", value)):
        check_tensor(fn, name, t, (3, 4), FLOAT_DTYPES + ((torch.int8,) if quantized else ()), "")
        if t.dtype != (torch.int8 if quantized else query.dtype):
            fail(fn, name, f"dtype {t.dtype}", f"{query.dtype}, as query (or int8 with antiquant scales)", NpuTypeError)
    if key.shape[:-1] != value.shape[:-1] or key.dim() != value.dim():
        fail(fn, "value", f"shape {tuple(value.shape)}", f"the shape of key {tuple(key.shape)} but the head dim")
    if paged:
        block_size = check_int(fn, "block_size", block_size, 1)
        if key.dim() == 3 and key.shape[1] != block_size:
            fail(fn, "key", f"shape {tuple(key.shape)}", f"(blocks, block_size={block_size}, H)")
        if key.dim() == 4 and (key.shape[2] != block_size or key.shape[1] != kv_heads):
            fail(fn, "key", f"shape {tuple(key.shape)}", f"(blocks, num_key_value_heads={kv_heads}, "
                 f"block_size={block_size}, D)")
        raw_layout = "BSH" if key.dim() == 3 else "BNSD"  # a pool's blocks in the place of the batch
    else:
        expected = LAYOUT[layout_in].rank
        if key.dim() != expected:
            fail(fn, "key", f"a {key.dim()}-d tensor", f"a {expected}-d tensor in input_layout '{layout_in}'")
        raw_layout = layout_in
    read = "BSND" if paged else _read_layout(raw_layout)  # a paged pool: tileattn's (blocks, block_size, N, D)
    if LAYOUT[raw_layout].fused and (key.shape[2] % kv_heads or value.shape[2] % kv_heads):
        fail(fn, "num_key_value_heads", kv_heads, f"a divisor of key's hidden size {key.shape[2]}")
    if not quantized and antiquant and any(t is not None for n, t in antiquant.items() if not n.endswith("mode")):
        fail(fn, "antiquant_scale", "a scale for a float cache", "None (dequantisation applies to int8 key/value)")
    if quantized and key_rope is not None:
        refuse(fn, "key_rope with an int8 cache (MLA over a quantised cache)", "pass a float cache with key_rope")

    def view(t):
        return _as_read(t, raw_layout, kv_heads, read)

    k, v = view(key), view(value)
    h_axis = LAYOUT[read].heads_dim
    if k.shape[h_axis] != kv_heads:
        fail(fn, "num_key_value_heads", kv_heads, f"{k.shape[h_axis]}, the heads of key")
    if not paged and not LAYOUT[layout_in].packed and k.shape[0] != query.shape[0]:
        fail(fn, "key", f"batch {k.shape[0]}", f"{query.shape[0]}, as query")
    if key_rope is not None:
        check_tensor(fn, "key_rope", key_rope, key.dim(), (query.dtype,), " in key's layout")
        k = torch.cat([k, view(key_rope)], -1)
    if k.shape[-1] != d:
        fail(fn, "key", f"head dim {k.shape[-1]}", f"{d}, the head dim of query (with query_rope/key_rope added)")
    scales = _antiquant(names, key, value, antiquant or {}, raw_layout, view) if quantized else {}
    return k, v, scales


def _query(names, query, query_rope, layout_in, heads):
    """The query as tileattn reads it (BSH as BSND, NTD as TND: views) and that layout."""
    fn = names.fn
    lay = LAYOUT[layout_in]
    check_tensor(fn, "query", query, lay.rank, FLOAT_DTYPES, f" in input_layout '{layout_in}'")
    if lay.fused and query.shape[2] % heads:
        fail(fn, names.heads, heads, f"a divisor of query's hidden size {query.shape[2]}")
    q_layout = _read_layout(layout_in)
    q = _as_read(query, layout_in, heads, q_layout)
    h_axis = LAYOUT[q_layout].heads_dim
    if q.shape[h_axis] != heads:
        fail(fn, names.heads, heads, f"{q.shape[h_axis]}, the heads of query in input_layout '{layout_in}'")
    if query_rope is not None:
        check_tensor(fn, "query_rope", query_rope, query.dim(), (query.dtype,), " in query's layout")
        q = torch.cat([q, _as_read(query_rope, layout_in, heads, q_layout)], -1)
    return q, q_layout


class _Inputs(NamedTuple):
    """One call's arguments, by what they are (each op names some of them its own way: :class:`_Names`)."""

    query: object
    key: object
    value: object
    pse_shift: object = None
    atten_mask: object = None
    q_lens: object = None
    kv_lens: object = None
    block_table: object = None
    block_size: object = 0
    num_heads: object = 1
    num_kv_heads: object = 0
    scale: object = 1.0
    pre_tokens: object = UNBOUNDED
    next_tokens: object = UNBOUNDED
    input_layout: object = "BSH"
    sparse_mode: object = 0
    inner_precise: object = 0
    want_lse: bool = False
    sinks: object = None
    antiquant: object = None
    query_rope: object = None
    key_rope: object = None


class _Options(NamedTuple):
    """A call's options, checked (:func:`_check_options`)."""

    layout_in: str
    layout_out: str
    heads: int
    kv_heads: int
    scale: float
    pre_tokens: int
    next_tokens: int
    sparse_mode: int


class _Sequences(NamedTuple):
    """Where a call's sequences are (:func:`_sequences`): packed or padded, their query and key lengths,
    the cumulative offsets of packed tensors, the padded query length and key capacity, the block
    table as it is read."""

    varlen: bool
    batch: int
    sq: Optional[int]
    capacity: Optional[int]
    lq: List[int]
    lk: List[int]
    cu_q: Optional[List[int]]
    cu_k: Optional[List[int]]
    block_table: object


def _infer(names, x: _Inputs, out=None, dry_run=False):
    """The op's ``(attention_out, softmax_lse)``; with ``out`` (the graph-mode ``.out`` overloads) the
    caller's two tensors, written in place once everything is checked; with ``dry_run`` (the
    workspace queries) nothing is computed: the call is only checked, the core's checks included.
    The steps: the options, the query and the keys as tileattn reads them, the sequences, the
    pattern (band, mask, bias, sinks), the core call's arguments; then the call and the result in the
    requested layout."""
    fn = names.fn
    o = _check_options(names, x)
    q, q_layout = _query(names, x.query, x.query_rope, o.layout_in, o.heads)
    paged = x.block_table is not None
    k, v, scales = _kv(names, x.key, x.value, x.key_rope, x.query, o.layout_in, paged, x.block_size, o.kv_heads,
                       q.shape[-1], x.antiquant)
    if out is not None:
        _check_out(fn, out, x.query, x.value, x.input_layout.upper(), paged, o.heads, o.kv_heads, x.want_lse)
    seqs = _sequences(names, x, q, k, q_layout)
    band, keep, bias = _pattern(names, x, o, seqs)
    q, k, v, kwargs, rows = _core_arguments(fn, o, q, k, v, q_layout, scales, seqs, band, keep, bias)
    kwargs["sinks"] = x.sinks
    if dry_run:
        with core_errors(fn):
            build_spec(q, k, v, **kwargs)
        return None
    with core_errors(fn), torch.no_grad():
        result, lse = flash_attention(q, k, v, return_lse=True, **kwargs)
    result, lse = _finish(result, lse, rows, x.query, o.heads, o.layout_out, q_layout, seqs.batch, seqs.sq,
                          x.want_lse)
    if out is None:
        return result, lse
    out[0].copy_(result)
    if x.want_lse:
        out[1].copy_(lse)
    return out[0], out[1]


def _check_options(names, x: _Inputs) -> _Options:
    fn = names.fn
    input_layout = x.input_layout
    if not isinstance(input_layout, str) or input_layout.upper() not in INPUT_LAYOUTS:
        fail(fn, "input_layout", repr(input_layout), "one of " + ", ".join(repr(n) for n in INPUT_LAYOUTS))
    layout_in, layout_out = io_layouts(input_layout.upper())
    heads = check_int(fn, names.heads, x.num_heads, 1)
    kv_heads = check_int(fn, "num_key_value_heads", x.num_kv_heads, 0) or heads
    if heads % kv_heads:
        fail(fn, "num_key_value_heads", kv_heads, f"a divisor of {names.heads}={heads} (GQA)")
    scale = check_float(fn, names.scale, x.scale, "a finite float (the default is 1.0: pass 1/sqrt(head_dim))")
    pre_tokens, next_tokens = check_int(fn, "pre_tokens", x.pre_tokens), check_int(fn, "next_tokens", x.next_tokens)
    sparse_mode = check_int(fn, "sparse_mode", x.sparse_mode)
    if not 0 <= sparse_mode <= 4:
        if 5 <= sparse_mode <= 8:
            refuse(fn, f"sparse_mode={sparse_mode} (prefix/global/dilated/block_local)",
                   "torch_npu does not support it either; use 0-4")
        fail(fn, "sparse_mode", sparse_mode, "0-4")
    check_int(fn, "inner_precise", x.inner_precise)
    if x.inner_precise not in (0, 1, 2, 3):
        fail(fn, "inner_precise", x.inner_precise, "0-3")
    if (x.query_rope is None) != (x.key_rope is None):
        fail(fn, "query_rope/key_rope", "only one of them", "both or neither (MLA)")
    return _Options(layout_in, layout_out, heads, kv_heads, scale, pre_tokens, next_tokens, sparse_mode)


def _sequences(names, x: _Inputs, q, k, q_layout) -> _Sequences:
    """The sequences' lengths: cumulative for packed (TND) tensors, per batch otherwise; a paged
    cache's block table checked for the blocks they read."""
    fn = names.fn
    read = LAYOUT[q_layout]
    varlen, paged = read.packed, x.block_table is not None
    batch = None if varlen else q.shape[read.batch_dim]
    sq = None if varlen else q.shape[read.seq_dim]
    block_table = x.block_table
    if paged:
        check_tensor(fn, "block_table", block_table, 2, (torch.int32,), " of shape (B, max_blocks)")
        capacity = block_table.shape[1] * k.shape[1]
    else:
        capacity = None if varlen else k.shape[read.seq_dim]
    cu_q = cu_k = None
    if varlen:
        cu_q = _cumulative(names, names.q_lens, x.q_lens, q.shape[0])
        batch = len(cu_q) - 1
        lq = [b - a for a, b in zip(cu_q, cu_q[1:])]
        if paged:
            lk = _per_batch(names, names.kv_lens, x.kv_lens, batch, capacity)
        else:
            cu_k = _cumulative(names, names.kv_lens, x.kv_lens, k.shape[0])
            if len(cu_k) != len(cu_q):
                fail(fn, names.kv_lens, f"{len(cu_k) - 1} entries", f"{batch}, one per sequence")
            lk = [b - a for a, b in zip(cu_k, cu_k[1:])]
    else:
        lq = (_per_batch(names, names.q_lens, x.q_lens, batch, sq) if sq > 1 else None) or [sq] * batch
        lk = _per_batch(names, names.kv_lens, x.kv_lens, batch, capacity)
    if paged and lk is None:
        fail(fn, names.kv_lens, None, "the cached length of every sequence (required with block_table)")
    lk = lk or [capacity] * batch
    if paged:
        block_table = _read_blocks(fn, block_table, lk, k.shape[1], k.shape[0])
    return _Sequences(varlen, batch, sq, capacity, lq, lk, cu_q, cu_k, block_table)


def _pattern(names, x: _Inputs, o: _Options, seqs: _Sequences):
    """(band, keep mask, bias): a band, and with a real atten_mask or pse_shift an explicit mask and
    bias over the padded positions; the sinks checked."""
    fn, varlen, batch, sq, capacity = names.fn, seqs.varlen, seqs.batch, seqs.sq, seqs.capacity
    decode = not varlen and sq == 1
    band = _band(fn, o.sparse_mode, o.pre_tokens, o.next_tokens, decode, x.atten_mask)
    keep = bias = None
    if x.atten_mask is not None and (decode or o.sparse_mode in (0, 1)):
        if varlen:
            refuse(fn, "atten_mask with input_layout 'TND'/'NTD' (documented: sparse_mode=0 without a mask, or 3 with "
                   "the 2048x2048 template)", "pass sparse_mode=3 with the template, or use a padded layout")
        keep = _keep_from_mask(names, x.atten_mask, decode, batch, sq, capacity)
    if x.pse_shift is not None:
        if varlen:
            refuse(fn, "pse_shift with input_layout 'TND'/'NTD'", "use a padded layout")
        check_tensor(fn, "pse_shift", x.pse_shift, 4, (x.query.dtype, torch.float32),
                     f" of shape (B|1, N, Q_S, KV_S) in {x.query.dtype}")
        ps = tuple(x.pse_shift.shape)
        if ps[0] not in (1, batch) or ps[1] != o.heads or ps[2] < sq or ps[3] < capacity:
            fail(fn, "pse_shift", f"shape {ps}", f"({batch}|1, {o.heads}, >= {sq}, >= {capacity})")
        bias = x.pse_shift[:, :, :sq, :capacity]
    if x.sinks is not None:
        check_tensor(fn, "learnable_sink", x.sinks, 1, FLOAT_DTYPES, f" of shape ({o.heads},)")
        if tuple(x.sinks.shape) != (o.heads,):
            fail(fn, "learnable_sink", f"shape {tuple(x.sinks.shape)}", f"({o.heads},), one logit per query head")
    return band, keep, bias


def _core_arguments(fn, o: _Options, q, k, v, q_layout, scales, seqs: _Sequences, band, keep, bias):
    """(q, k, v, keywords, rows) of the one flash_attention call: an explicit mask or bias addresses
    padded positions (one padded call, the exact per-batch region folded into the mask); otherwise
    the sequences' lengths and band become packed offsets, seqused_k and the band's keywords, a
    padded query with shorter actual lengths packed first (``rows``: where its rows were)."""
    device = q.device
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    varlen, batch, sq, capacity, lq, lk, cu_q, cu_k, block_table = seqs
    paged = block_table is not None
    kwargs = dict(scale=o.scale, **scales)
    rows = None  # positions of the packed query rows in a padded query that had shorter actual lengths
    if keep is not None or bias is not None:
        reg = region(band, torch.tensor(lq, device=device), torch.tensor(lk, device=device), sq, capacity)
        kwargs.update(layout=q_layout, mask=reg if keep is None else reg & keep, bias=bias)
        if paged:
            kwargs.update(block_table=block_table, seqused_k=i32(lk))
        return q, k, v, kwargs, rows
    full_k = lk if varlen else [capacity] * batch
    if not varlen and any(n != sq for n in lq):
        sk_padded = k.shape[LAYOUT[q_layout].seq_dim]
        q, k, v, cu_q, cu_k, rows = _pack(q, k, v, q_layout, lq, paged)
        if scales and not paged:
            kwargs.update(_packed_scales(_bsnd_scales(scales, q_layout), batch, sk_padded))
        full_k = [capacity] * batch
        varlen = True
    same = {b - a for a, b in zip(lq, lk)}
    band_kw = {} if band is None else band_call(band, same.pop() if len(same) == 1 else None)
    if band_kw is None:
        refuse(fn, f"the band pre_tokens={o.pre_tokens}, next_tokens={o.next_tokens} above the diagonal with "
               "sequences of different Skv - Sq", "pass an atten_mask for it")
    trim = band_kw.pop("trim", 0)
    kwargs.update(band_kw)
    used = [max(0, n - trim) for n in lk]
    if varlen:
        kwargs.update(layout="TND", cu_seqlens_q=i32(cu_q))
        if not paged:
            kwargs["cu_seqlens_k"] = i32(cu_k)
    else:
        kwargs["layout"] = q_layout
    if paged:
        kwargs["block_table"] = block_table
    if paged or used != full_k:
        kwargs["seqused_k"] = i32(used)
    return q, k, v, kwargs, rows


def _output_shapes(query, value, layout, paged, heads, kv_heads):
    """The shapes of ``attention_out`` and of ``softmax_lse`` (when asked for) of a call with these
    (already checked) tensors, as torch_npu derives them from query and value alone."""
    layout_in, layout_out = io_layouts(layout)
    lay = LAYOUT[layout_in]
    hidden = value.dim() == 3 and (paged or lay.fused)  # (..., H): heads * head dim
    dv = value.shape[2] // kv_heads if hidden else value.shape[-1]
    if lay.packed:
        t, n = query.shape[lay.seq_dim], query.shape[lay.heads_dim]
        return user_shape(layout_out, 0, n, t, dv), (t, n, 1)
    b, s = query.shape[lay.batch_dim], query.shape[lay.seq_dim]
    return user_shape(layout_out, b, heads, s, dv), (b, heads, s, 1)


def _check_out(fn, out, query, value, layout, paged, heads, kv_heads, want_lse):
    """The ``.out`` overloads' tensors: ``attention_out`` of the result's shape, dtype and device;
    ``softmax_lse`` fp32 of the LSE's shape when it is asked for (otherwise not written)."""
    out_shape, lse_shape = _output_shapes(query, value, layout, paged, heads, kv_heads)
    attention_out, softmax_lse = out
    for name, t, shape, dtype in (("attention_out", attention_out, out_shape, query.dtype),
                                  ("softmax_lse", softmax_lse, lse_shape if want_lse else None, torch.float32)):
        if not isinstance(t, torch.Tensor):
            fail(fn, name, type(t).__name__, "a torch.Tensor", NpuTypeError)
        if t.device != query.device:
            fail(fn, name, f"device {t.device}", f"query's device {query.device}")
        if shape is not None and (tuple(t.shape) != shape or t.dtype != dtype):
            fail(fn, name, f"shape {tuple(t.shape)}, dtype {t.dtype}", f"shape {shape}, dtype {dtype}")

def _read_blocks(fn, block_table, lengths, block_size, blocks):
    """``block_table`` as tileattn reads it: every slot a sequence reads (its first
    ceil(lengths[b] / block_size)) must hold a block of the cache, named in the error otherwise; the
    slots past them, never read on the NPU either, are set to block 0 in a small copy of the table
    when they hold anything else (-1 padding, stale ids)."""
    if block_table.shape[0] != len(lengths):
        fail(fn, "block_table", f"{block_table.shape[0]} rows", f"{len(lengths)}, one per sequence")
    device = block_table.device
    read = torch.arange(block_table.shape[1], device=device)[None, :] < \
        torch.tensor([-(-n // block_size) for n in lengths], device=device)[:, None]
    outside = (block_table < 0) | (block_table >= blocks)
    bad = read & outside
    if bool(bad.any()):
        b, slot = (int(i) for i in bad.nonzero()[0])
        fail(fn, "block_table", f"block_table[{b}][{slot}] = {int(block_table[b, slot])}",
             f"a block index in [0, {blocks}) (the cache's blocks) in each slot sequence {b} reads (its first "
             f"{-(-lengths[b] // block_size)}, for {lengths[b]} keys of blocks of {block_size}); later slots are "
             "not read")
    return torch.where(outside, 0, block_table) if bool(outside.any()) else block_table


def _pack(q, k, v, q_layout, lq, paged):
    """A padded query whose batches use fewer rows (``actual_seq_lengths``) as a packed (T, N, D)
    query of its valid rows (one copy), so that bottom-right alignment counts from the actual
    lengths; unpaged keys become packed sequences of the full cache length (a view for BSND), cut
    by ``seqused_k``. Returns the packed rows' positions in the padded (B*S) rows."""
    batch, device = len(lq), q.device
    qb = _as_read(q, q_layout, None, "BSND")
    sq = qb.shape[1]
    valid = torch.arange(sq, device=device)[None, :] < torch.tensor(lq, device=device)[:, None]
    rows = valid.flatten().nonzero().flatten()
    packed = qb.flatten(0, 1)[rows]
    cu_q = [0]
    for n in lq:
        cu_q.append(cu_q[-1] + n)
    if paged:
        return packed, k, v, cu_q, None, rows
    kb, vb = _as_read(k, q_layout, None, "BSND"), _as_read(v, q_layout, None, "BSND")
    sk = kb.shape[1]
    cu_k = [b * sk for b in range(batch + 1)]
    return packed, kb.flatten(0, 1), vb.flatten(0, 1), cu_q, cu_k, rows


def _finish(out, lse, rows, query, heads, layout_out, q_layout, batch, sq, want_lse):
    """The output in the requested layout (contiguous) and the LSE torch_npu returns ((B, N, Q_S, 1),
    (T, N, 1) for TND, or a (1,) zero tensor without ``softmax_lse_flag``)."""
    if rows is not None:  # packed rows back into the padded (B, S, N, D) output
        full = out.new_zeros((batch * sq,) + tuple(out.shape[1:]))
        full[rows] = out
        out = full.unflatten(0, (batch, sq))
        lse_full = torch.full((heads, batch * sq), -math.inf, dtype=lse.dtype, device=lse.device)
        lse_full[:, rows] = lse
        lse = lse_full.unflatten(1, (batch, sq)).transpose(0, 1)
        q_layout = "BSND"
    result = from_canonical(to_canonical(out, q_layout, None), layout_out).contiguous()
    if not want_lse:
        return result, torch.zeros(1, dtype=torch.float32, device=query.device)
    if lse.dim() == 2:  # (N, T) -> (T, N, 1)
        return result, lse.transpose(0, 1).unsqueeze(-1).float()
    return result, lse.unsqueeze(-1).float()


#: The input layouts of the prompt (prefill) and incremental (decode) ops.
_PROMPT_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND")
_INCRE_LAYOUTS = ("BSH", "BSND", "BNSD")
_FULL_QUANT = ("dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2")
_PREFIX = ("key_shared_prefix", "value_shared_prefix", "actual_shared_prefix_len")


def _refuse_given(fn, given: dict, what: str, instead: str):
    for name, value in given.items():
        if value is not None:
            refuse(fn, f"argument '{name}' ({what})", instead)


@beside_stand_in
def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
                                    dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
                                    antiquant_offset=None, block_table=None, query_padding_size=None,
                                    kv_padding_size=None, key_antiquant_scale=None, key_antiquant_offset=None,
                                    value_antiquant_scale=None, value_antiquant_offset=None, key_shared_prefix=None,
                                    value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
                                    key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
                                    pre_tokens=2147483647, next_tokens=2147483647, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0,
                                    value_antiquant_mode=0):
    """torch_npu's FusedInferAttentionScore: ``(attention_out, softmax_lse)``, prefill (Q_S > 1) and
    decode (Q_S = 1) alike. ``softmax_lse`` is the natural-log LSE, (B, N, Q_S, 1) or (T, N, 1) for
    TND, when ``softmax_lse_flag`` is set, else a (1,) zero tensor. See the module docstring for the
    translation; refused arguments name themselves."""
    return fused_v1(dict(locals()))  # locals() here: exactly the op's arguments, by name


def fused_v1(args: dict, fn="npu_fused_infer_attention_score", out=None, dry_run=False):
    """:func:`npu_fused_infer_attention_score` on its arguments by name (also its ``.out`` overload and
    workspace query: :mod:`.graph`); ``out``/``dry_run`` as for :func:`_infer`."""
    a = SimpleNamespace(**args)
    _refuse_given(fn, dict(zip(_FULL_QUANT, (a.dequant_scale1, a.quant_scale1, a.dequant_scale2, a.quant_scale2,
                                             a.quant_offset2))),
                  "int8 query/output quantisation", "dequantise before the call and quantise after it")
    _refuse_given(fn, dict(zip(_PREFIX, (a.key_shared_prefix, a.value_shared_prefix, a.actual_shared_prefix_len))),
                  "a shared system prefix", "concatenate the prefix into key/value")
    _refuse_given(fn, dict(query_padding_size=a.query_padding_size, kv_padding_size=a.kv_padding_size),
                  "left padding", "pass right-padded tensors with actual_seq_lengths/actual_seq_lengths_kv")
    _refuse_given(fn, dict(key_rope_antiquant_scale=a.key_rope_antiquant_scale), "reserved in torch_npu", "pass None")
    antiquant = {name: args[name] for name in (
        "antiquant_scale", "antiquant_offset", "antiquant_mode", "key_antiquant_scale", "key_antiquant_offset",
        "value_antiquant_scale", "value_antiquant_offset", "key_antiquant_mode", "value_antiquant_mode")}
    return _infer(_Names(fn), _Inputs(
        a.query, a.key, a.value, pse_shift=a.pse_shift, atten_mask=a.atten_mask, q_lens=a.actual_seq_lengths,
        kv_lens=a.actual_seq_lengths_kv, block_table=a.block_table, block_size=a.block_size, num_heads=a.num_heads,
        num_kv_heads=a.num_key_value_heads, scale=a.scale, pre_tokens=a.pre_tokens, next_tokens=a.next_tokens,
        input_layout=a.input_layout, sparse_mode=a.sparse_mode, inner_precise=a.inner_precise,
        want_lse=_flag(fn, "softmax_lse_flag", a.softmax_lse_flag), antiquant=antiquant, query_rope=a.query_rope,
        key_rope=a.key_rope), out, dry_run)


def _flag(fn, name, value) -> bool:
    if not isinstance(value, bool):
        fail(fn, name, repr(value), "True or False", NpuTypeError)
    return value


@beside_stand_in
def npu_fused_infer_attention_score_v2(query, key, value, *, query_rope=None, key_rope=None, pse_shift=None,
                                       atten_mask=None, actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None,
                                       dequant_scale_query=None, dequant_scale_key=None, dequant_offset_key=None,
                                       dequant_scale_value=None, dequant_offset_value=None,
                                       dequant_scale_key_rope=None, quant_scale_out=None, quant_offset_out=None,
                                       quant_scale_p=None, learnable_sink=None, num_query_heads=1,
                                       num_key_value_heads=0, softmax_scale=1.0, pre_tokens=2147483647,
                                       next_tokens=2147483647, input_layout="BSH", sparse_mode=0, block_size=0,
                                       query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0,
                                       return_softmax_lse=False, query_dtype=None, key_dtype=None, value_dtype=None,
                                       query_rope_dtype=None, key_rope_dtype=None, key_shared_prefix_dtype=None,
                                       value_shared_prefix_dtype=None, dequant_scale_query_dtype=None,
                                       dequant_scale_key_dtype=None, dequant_scale_value_dtype=None,
                                       dequant_scale_key_rope_dtype=None, out_dtype=None):
    """``npu_fused_infer_attention_score`` with v2's names (``num_query_heads``, ``softmax_scale``,
    ``actual_seq_qlen``/``actual_seq_kvlen``, ``return_softmax_lse``, ``dequant_scale_key``/...
    for the int8 cache) and ``learnable_sink`` ((N,) sink logits; the LSE includes them). The
    ``*_dtype`` arguments are reserved in torch_npu and have no effect; ``out_dtype`` (the output
    dtype of int8/fp8 inputs) and the reserved ``quant_scale_p`` are refused unless None."""
    return fused_v2(dict(locals()))  # locals() here: exactly the op's arguments, by name


def fused_v2(args: dict, fn="npu_fused_infer_attention_score_v2", out=None, dry_run=False):
    """:func:`npu_fused_infer_attention_score_v2` on its arguments by name (as :func:`fused_v1`)."""
    a = SimpleNamespace(**args)
    _refuse_given(fn, dict(dequant_scale_query=a.dequant_scale_query, quant_scale_out=a.quant_scale_out,
                           quant_offset_out=a.quant_offset_out, dequant_scale_key_rope=a.dequant_scale_key_rope),
                  "int8 query/output quantisation", "dequantise before the call and quantise after it")
    _refuse_given(fn, dict(quant_scale_p=a.quant_scale_p), "reserved in torch_npu", "pass None")
    if a.out_dtype is not None:
        refuse(fn, f"out_dtype={a.out_dtype!r} (the output dtype of int8/fp8 inputs)",
               "pass None: the output has the query's dtype")
    if a.query_quant_mode not in (0,):
        refuse(fn, f"query_quant_mode={a.query_quant_mode}", "pass a float query")
    antiquant = dict(key_antiquant_scale=a.dequant_scale_key, key_antiquant_offset=a.dequant_offset_key,
                     value_antiquant_scale=a.dequant_scale_value, value_antiquant_offset=a.dequant_offset_value,
                     key_antiquant_mode=a.key_quant_mode, value_antiquant_mode=a.value_quant_mode)
    names = _Names(fn, "actual_seq_qlen", "actual_seq_kvlen", "num_query_heads", "softmax_scale", "return_softmax_lse")
    return _infer(names, _Inputs(
        a.query, a.key, a.value, pse_shift=a.pse_shift, atten_mask=a.atten_mask, q_lens=a.actual_seq_qlen,
        kv_lens=a.actual_seq_kvlen, block_table=a.block_table, block_size=a.block_size, num_heads=a.num_query_heads,
        num_kv_heads=a.num_key_value_heads, scale=a.softmax_scale, pre_tokens=a.pre_tokens,
        next_tokens=a.next_tokens, input_layout=a.input_layout, sparse_mode=a.sparse_mode,
        inner_precise=a.inner_precise, want_lse=_flag(fn, "return_softmax_lse", a.return_softmax_lse),
        sinks=a.learnable_sink, antiquant=antiquant, query_rope=a.query_rope, key_rope=a.key_rope), out, dry_run)


@beside_stand_in
def npu_prompt_flash_attention(query, key, value, *, pse_shift=None, padding_mask=None, atten_mask=None,
                               actual_seq_lengths=None, deq_scale1=None, quant_scale1=None, deq_scale2=None,
                               quant_scale2=None, quant_offset2=None, num_heads=1, scale_value=1.0,
                               pre_tokens=2147473647, next_tokens=0, input_layout="BSH", num_key_value_heads=0,
                               actual_seq_lengths_kv=None, sparse_mode=0):
    """torch_npu's PromptFlashAttention (prefill): the attention output. Note its defaults:
    ``next_tokens=0`` (with ``sparse_mode=0`` and a mask, the band is causal from the top-left)."""
    fn = "npu_prompt_flash_attention"
    _refuse_given(fn, dict(deq_scale1=deq_scale1, quant_scale1=quant_scale1, deq_scale2=deq_scale2,
                           quant_scale2=quant_scale2, quant_offset2=quant_offset2),
                  "int8 quantisation", "dequantise before the call and quantise after it")
    if padding_mask is not None:
        refuse(fn, "argument 'padding_mask'", "it is reserved in torch_npu; pass None")
    input_upper = input_layout.upper() if isinstance(input_layout, str) else input_layout
    if input_upper not in _PROMPT_LAYOUTS:
        fail(fn, "input_layout", repr(input_layout), "'BSH', 'BSND', 'BNSD' or 'BNSD_BSND'")
    return _infer(_Names(fn, scale="scale_value"), _Inputs(
        query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, q_lens=actual_seq_lengths,
        kv_lens=actual_seq_lengths_kv, num_heads=num_heads, num_kv_heads=num_key_value_heads, scale=scale_value,
        pre_tokens=pre_tokens, next_tokens=next_tokens, input_layout=input_layout, sparse_mode=sparse_mode,
        inner_precise=1))[0]


@beside_stand_in
def npu_incre_flash_attention(query, key, value, *, padding_mask=None, pse_shift=None, atten_mask=None,
                              actual_seq_lengths=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
                              quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
                              block_table=None, kv_padding_size=None, num_heads=1, scale_value=1.0, input_layout="BSH",
                              num_key_value_heads=0, block_size=0, inner_precise=1):
    """torch_npu's IncreFlashAttention (decode): the attention output. ``actual_seq_lengths`` here
    are the *key/value* lengths (the cached tokens of every batch)."""
    fn = "npu_incre_flash_attention"
    _refuse_given(fn, dict(zip(_FULL_QUANT, (dequant_scale1, quant_scale1, dequant_scale2, quant_scale2,
                                             quant_offset2))),
                  "int8 output quantisation", "quantise after the call")
    _refuse_given(fn, dict(kv_padding_size=kv_padding_size), "left padding",
                  "pass right-padded caches with actual_seq_lengths")
    if padding_mask is not None:
        refuse(fn, "argument 'padding_mask'", "it is reserved in torch_npu; pass None")
    input_upper = input_layout.upper() if isinstance(input_layout, str) else input_layout
    if input_upper not in _INCRE_LAYOUTS:
        fail(fn, "input_layout", repr(input_layout), "'BSH', 'BSND' or 'BNSD'")
    return _infer(_Names(fn, q_lens="(none)", kv_lens="actual_seq_lengths", scale="scale_value"), _Inputs(
        query, key, value, pse_shift=pse_shift, atten_mask=atten_mask, kv_lens=actual_seq_lengths,
        block_table=block_table, block_size=block_size, num_heads=num_heads, num_kv_heads=num_key_value_heads,
        scale=scale_value, input_layout=input_layout,
        antiquant=dict(antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset)))[0]
