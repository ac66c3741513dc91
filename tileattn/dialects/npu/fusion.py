"""``npu_fusion_attention`` / ``npu_fusion_attention_grad`` (FlashAttentionScore) and their
``_v2`` variants, on tileattn's partial-attention layer.

The translation, point by point (docs/dialects.md has the full table):

* ``atten_mask`` True/1 = masked **out**; tileattn's mask is True = take part: it is inverted.
* ``scale`` defaults to 1.0; ``keep_prob = 1 - dropout_p``.
* ``pse`` (``pse_type=1``, the default) is added *before* scaling: tileattn gets
  ``bias = scale * pse``; ``pse_type=0`` adds it after; ``pse_type`` 2/3 pass ALiBi slopes.
* Without ``atten_mask``, ``sparse_mode`` and pre/next tokens do not apply: full attention, as
  the torch_npu docs state (a warning says so once when the call looks like it meant a pattern).
* Bands are counted from the top-left (modes 0, 2) or bottom-right (3, 4, 7, 8) corner of every
  sequence; :mod:`tileattn.npu._plan` turns them into tileattn windows placed by ``align``.
* ``softmax_max``/``softmax_sum``: the row maximum and ``sum(exp(s - max))``, fp32, repeated over a
  last dim of 8; ``max + log(sum)`` is tileattn's LSE. TND comes in torch_npu's default order
  (per sequence, head-major: "NTD") or T-major with ``softmax_layout="TND"``.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch

from ...core.layouts import LAYOUT, LAYOUTS, user_shape
from . import _plan as plan
from ._common import (
    FLOAT_DTYPES, UNBOUNDED, NpuTypeError, band_side, check_float, check_int, check_layout, check_tensor, core_errors,
    fail, int_list, is_int, refuse, warn_once,
)
from ._plan import Band, Geometry, PadIndex, Piece, band_call, region
from .install import beside_stand_in
from ._stats import lse_from_stats, stats_from_lse

__all__ = ["npu_fusion_attention", "npu_fusion_attention_grad", "npu_fusion_attention_v2",
           "npu_fusion_attention_grad_v2"]

_TEMPLATE = {2: (2048, 2048), 3: (2048, 2048), 4: (2048, 2048), 6: (3072, 2048), 7: (2048, 2048),
             8: (2048, 2048)}
_ALIBI_ROWS = 1024


class _Call:
    """A validated call: geometry, pieces and what the outputs need."""

    def __init__(self, fn, layout, query, key, value, head_num):
        self.fn, self.layout, self.heads = fn, layout, head_num
        self.query, self.key, self.value = query, key, value
        self.pieces: List[Piece] = []
        self.cu_q: Optional[List[int]] = None
        self.numels = 0
        self.seed = 0
        self.offset = 0
        lay = LAYOUT[layout]
        self.varlen = lay.packed
        if lay.fused:
            self.heads_kv = key.shape[-1] // (query.shape[-1] // head_num)
            self.dv = value.shape[-1] // self.heads_kv
        else:
            self.heads_kv, self.dv = key.shape[lay.heads_dim], value.shape[-1]
        # a packed call's sequences come from its lists (_plan_varlen); its rows are the packed ones
        self.batch = None if self.varlen else query.shape[lay.batch_dim]
        self.sq, self.sk = query.shape[lay.seq_dim], key.shape[lay.seq_dim]

    def geometry(self) -> Geometry:
        if self.varlen:
            return Geometry((self.heads, self.sq), total=self.sq)
        return Geometry((self.batch, self.heads, self.sq))

    def out_shape(self):
        return user_shape(self.layout, self.batch, self.heads, self.sq, self.dv)

    def stat_shape(self):
        if self.varlen:
            return (self.sq, self.heads, 8)
        return (self.batch, self.heads, self.sq, 8)


# ---------------------------------------------------------------------------------------------
# Validation


def _check_qkv(fn, query, key, value, head_num, layout):
    lay = LAYOUT[layout]
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(fn, name, t, lay.rank, FLOAT_DTYPES, f" in input_layout '{layout}'")
    if not (query.dtype == key.dtype == value.dtype):
        fail(fn, "query/key/value", f"dtypes {query.dtype}, {key.dtype}, {value.dtype}", "one shared dtype", NpuTypeError)
    if not (query.device == key.device == value.device):
        fail(fn, "query/key/value", f"devices {query.device}, {key.device}, {value.device}", "one shared device")
    head_num = check_int(fn, "head_num", head_num, 1)
    if lay.fused:
        if query.shape[2] % head_num:
            fail(fn, "head_num", head_num, f"a divisor of query's hidden size {query.shape[2]}")
        d = query.shape[2] // head_num
        if d == 0 or key.shape[2] % d or key.shape[2] == 0:
            fail(fn, "key", f"hidden size {key.shape[2]}", f"a positive multiple of the head dim {d}")
        heads_kv = key.shape[2] // d
        if value.shape[2] % heads_kv:
            fail(fn, "value", f"hidden size {value.shape[2]}", f"a multiple of the {heads_kv} kv heads")
    else:
        h_axis = lay.heads_dim
        if query.shape[h_axis] != head_num:
            fail(fn, "head_num", head_num, f"{query.shape[h_axis]}, the heads of query in layout {layout}")
        heads_kv = key.shape[h_axis]
        if value.shape[h_axis] != heads_kv:
            fail(fn, "value", f"{value.shape[h_axis]} heads", f"{heads_kv}, the heads of key")
        if key.shape[-1] != query.shape[-1]:
            fail(fn, "key", f"head dim {key.shape[-1]}", f"{query.shape[-1]}, the head dim of query")
    b_axis, s_axis = lay.batch_dim, lay.seq_dim
    if heads_kv == 0 or head_num % heads_kv:
        fail(fn, "key", f"{heads_kv} heads for head_num={head_num}", "a number of kv heads dividing head_num (GQA)")
    if b_axis is not None and not (query.shape[b_axis] == key.shape[b_axis] == value.shape[b_axis]):
        fail(fn, "query/key/value", f"batch sizes {query.shape[b_axis]}, {key.shape[b_axis]}, {value.shape[b_axis]}",
             "one batch size")
    if key.shape[s_axis] != value.shape[s_axis]:
        fail(fn, "value", f"sequence length {value.shape[s_axis]}", f"{key.shape[s_axis]}, as key")
    return head_num


def _cumulative(fn, name, values, total):
    """torch_npu's cumulative ends, trailing zeros allowed (batches left out): [0, ends...]."""
    ends = int_list(fn, name, values)
    if not ends:
        fail(fn, name, repr(values), "a non-empty list of cumulative sequence ends, e.g. [2, 4, 6]", NpuTypeError)
    used = len(ends)
    while used > 1 and ends[used - 1] == 0:
        used -= 1
    body = ends[:used]
    if body[0] < 0 or any(b < a for a, b in zip(body, body[1:])):
        fail(fn, name, ends, "non-decreasing cumulative ends (lengths [2, 2, 2] are passed as [2, 4, 6]; batches "
             "left out are trailing zeros, [2, 5, 9, 0, 0])")
    if body[-1] > total:
        fail(fn, name, f"last entry {body[-1]}", f"at most the {total} rows of the packed tensor")
    return ends, [0] + body


def _check_options(fn, scale, keep_prob, pre, nxt, inner_precise, sparse_mode, layout, padding_mask):
    scale = check_float(fn, "scale", scale, "a finite float (torch_npu's default is 1.0: pass 1/sqrt(head_dim))")
    keep_prob = check_float(fn, "keep_prob", keep_prob, "a float in (0, 1]")
    if not 0.0 < keep_prob <= 1.0:
        fail(fn, "keep_prob", keep_prob, "a float in (0, 1] (1 - dropout probability)")
    pre, nxt = check_int(fn, "pre_tockens", pre), check_int(fn, "next_tockens", nxt)
    check_int(fn, "inner_precise", inner_precise)
    if inner_precise not in (0, 1, 2):
        fail(fn, "inner_precise", inner_precise, "0, 1 (reserved) or 2 (rows that see no key give 0)")
    sparse_mode = check_int(fn, "sparse_mode", sparse_mode)
    if layout == "TND" and not (0 <= sparse_mode <= 8 and sparse_mode != 5):
        fail(fn, "sparse_mode", sparse_mode, "0-4 or 6-8 for input_layout='TND' (varlen has no mode 5: use 6)")
    if layout != "TND" and not 0 <= sparse_mode <= 6:
        fail(fn, "sparse_mode", sparse_mode, f"0-6 for input_layout='{layout}' (7 and 8 are varlen-only)")
    if padding_mask is not None:
        refuse(fn, "argument 'padding_mask'", "torch_npu does not support it either; pass None")
    return scale, keep_prob, pre, nxt, sparse_mode


def _keep_mask(fn, atten_mask, sparse_mode, layout, batch, heads, sq, sk):
    """The caller's mask as tileattn's keep mask (True = take part), or None for a template."""
    if not isinstance(atten_mask, torch.Tensor) or atten_mask.dtype not in (torch.bool, torch.uint8):
        given = f"dtype {atten_mask.dtype}" if isinstance(atten_mask, torch.Tensor) else type(atten_mask).__name__
        fail(fn, "atten_mask", given, "a torch.bool or torch.uint8 tensor (1/True = masked out)", NpuTypeError)
    shape = tuple(atten_mask.shape)
    if sparse_mode in _TEMPLATE:
        if shape != _TEMPLATE[sparse_mode]:
            rows, cols = _TEMPLATE[sparse_mode]
            fail(fn, "atten_mask", f"shape {shape}", f"the compressed {rows}x{cols} template for sparse_mode="
                 f"{sparse_mode} (the kept region comes from the mode)")
        return None
    if layout == "TND":
        if atten_mask.dim() != 2 or shape[0] < sq or shape[1] < sk:
            fail(fn, "atten_mask", f"shape {shape}", f"the varlen form (maxSq, maxSkv) = ({sq}, {sk}) (or larger, "
                 "read from the top-left corner of every sequence)")
        return ~atten_mask[:sq, :sk].bool()
    allowed = [(batch, heads, sq, sk), (batch, 1, sq, sk)]
    if sparse_mode != 5:
        allowed += [(1, 1, sq, sk), (sq, sk)]
    if shape not in allowed:
        fail(fn, "atten_mask", f"shape {shape}", " or ".join(str(s) for s in allowed))
    return ~atten_mask.bool()


def _check_prefix(fn, prefix, batch, sq, sk):
    values = int_list(fn, "prefix", prefix)
    if values is None or len(values) != batch:
        fail(fn, "prefix", repr(prefix), f"a list of {batch} ints, the fully visible leading keys of each batch",
             NpuTypeError)
    lows = [0 if lq > lk else lk - lq for lq, lk in zip(sq, sk)]
    for b, (p, lo, lk) in enumerate(zip(values, lows, sk)):
        if not lo <= p <= lk:
            fail(fn, "prefix", values, f"prefix[{b}] in [{lo}, {lk}] (Skv - Sq .. Skv when Sq <= Skv, else 0 .. Skv)")
    return values


def _pse_bias(fn, pse, pse_type, scale, q, layout, batch, heads, sq, sk, q_start, kv_start):
    """A differentiable builder of the bias tileattn adds after scaling, or None without ``pse``."""
    if pse is None:
        return None
    if layout == "TND":
        refuse(fn, "argument 'pse' with input_layout='TND' (documented only as the 1024-row compressed ALiBi form, "
               "whose per-sequence row anchoring the documentation does not specify)",
               "use a padded layout (BSND, BNSD, BSH, SBH) for pse")
    if pse_type in (2, 3):
        check_tensor(fn, "pse", pse, (1, 2), (torch.float32,), " of ALiBi slopes, shape (N,) or (B, N)")
        if tuple(pse.shape) not in ((heads,), (batch, heads)):
            fail(fn, "pse", f"shape {tuple(pse.shape)}", f"ALiBi slopes of shape ({heads},) or ({batch}, {heads})")
        offset = q_start - kv_start
        rows = torch.arange(sq, device=q.device)[:, None] + offset
        dist = (rows - torch.arange(sk, device=q.device)[None, :]).abs().float()
        if pse_type == 3:
            dist = dist.sqrt()
        slopes = pse if pse.dim() == 2 else pse[None]

        def alibi():
            return -slopes[:, :, None, None] * dist
        return alibi
    check_tensor(fn, "pse", pse, 4, (q.dtype,), f" of query's dtype {q.dtype}")
    shape = tuple(pse.shape)
    factor = scale if pse_type == 1 else 1.0
    if shape[0] in (1, batch) and shape[1] == heads and shape[2] == _ALIBI_ROWS and shape[3] == sk \
            and sq > _ALIBI_ROWS:
        if sq != sk:
            fail(fn, "pse", f"the compressed ALiBi shape {shape} with Sq={sq}, Skv={sk}",
                 "Sq == Skv (the compressed form is documented for equal lengths only)")
        index = _alibi_expansion(sq, q.device)

        def expanded():
            rows, cols, valid = index
            return factor * pse[:, :, rows, cols].masked_fill(~valid, 0)
        return expanded
    if not (shape[0] in (1, batch) and shape[1] == heads and shape[2] in (1, sq) and shape[3] == sk):
        fail(fn, "pse", f"shape {shape}", f"({batch}, {heads}, {sq}, {sk}), ({batch}, {heads}, 1, {sk}), "
             f"(1, {heads}, {sq}, {sk}) or, for Sq == Skv > 1024, the compressed ALiBi "
             f"({batch}|1, {heads}, 1024, {sk})")

    def scaled():
        return pse * factor if factor != 1.0 else pse
    return scaled


def _alibi_expansion(s, device):
    """Index of the full (s, s) pse in its compressed last 1024 rows: row ``i`` of the full matrix
    is compressed row ``i - (s - 1024)`` when that exists; above, ALiBi is constant along
    diagonals, so ``P[i, j] = P[i + m, j + m]`` with ``m = s - 1024 - i`` reads compressed row 0.
    Positions whose diagonal leaves the stored columns lie above the causal diagonal (the
    documented use is causal), and are 0."""
    i = torch.arange(s, device=device)[:, None]
    j = torch.arange(s, device=device)[None, :]
    shift = (s - _ALIBI_ROWS - i).clamp(min=0)
    rows = (i - (s - _ALIBI_ROWS)).clamp(min=0).expand(s, s)
    cols = j + shift
    valid = cols < s
    return rows, cols.clamp(max=s - 1), valid


def _check_sink(fn, sink, heads, device):
    if sink is None:
        return None
    check_tensor(fn, "sink", sink, 1, (torch.float16, torch.bfloat16, torch.float32, torch.float64),
                 f" of shape ({heads},), one learnable sink logit per query head")
    if tuple(sink.shape) != (heads,):
        fail(fn, "sink", f"shape {tuple(sink.shape)}", f"({heads},), one logit per query head")
    if sink.device != device:
        fail(fn, "sink", f"device {sink.device}", f"{device}, as query")
    return sink


# ---------------------------------------------------------------------------------------------
# Planning


def _mix_seed(seed: int, salt: int) -> int:
    """A distinct, reproducible dropout seed per piece (and per Philox offset)."""
    if salt == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + salt * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 31
    return x & ((1 << 62) - 1)


class _Options(NamedTuple):
    """The options of one call (the forward's and the gradient's alike; v2's last five), validated by
    :func:`_build`."""

    pse: object
    padding_mask: object
    atten_mask: object
    scale: object
    keep_prob: object
    pre: object
    nxt: object
    inner_precise: object
    prefix: object
    actual_seq_qlen: object
    actual_seq_kvlen: object
    sparse_mode: object
    softmax_layout: object
    sink: object
    pse_type: object = 1
    q_start_idx: object = None
    kv_start_idx: object = None
    query_rope: object = None
    key_rope: object = None


def _build(fn, query, key, value, head_num, input_layout, o: _Options, seed) -> _Call:
    """The validated call and its pieces (the core calls that compute it): the tensors and options
    checked, then a packed call planned per sequence (:func:`_plan_varlen`), a padded one as one
    piece (:func:`_plan_padded`)."""
    layout = check_layout(fn, "input_layout", input_layout, LAYOUTS)
    head_num = _check_qkv(fn, query, key, value, head_num, layout)
    scale, keep_prob, pre, nxt, sparse_mode = _check_options(fn, o.scale, o.keep_prob, o.pre, o.nxt, o.inner_precise,
                                                             o.sparse_mode, layout, o.padding_mask)
    if o.softmax_layout not in ("", "TND"):
        fail(fn, "softmax_layout", repr(o.softmax_layout), "'' (torch_npu's default order) or 'TND'")
    if o.softmax_layout == "TND" and layout != "TND":
        warn_once(("softmax_layout", layout), f"softmax_layout='TND' only applies to input_layout='TND'; "
                  f"the statistics of '{layout}' are (B, N, Sq, 8) either way.")
    query, key = _with_rope(fn, query, key, o.query_rope, o.key_rope, layout, head_num)
    call = _Call(fn, layout, query, key, value, head_num)
    sink = _check_sink(fn, o.sink, head_num, query.device)
    base = dict(scale=scale, dropout_p=1.0 - keep_prob, sinks=sink)
    mode = _mode(fn, o.atten_mask, sparse_mode, pre, nxt, o.prefix, o.pse, key, layout)
    if keep_prob < 1.0:
        call.seed = seed
    if call.varlen:
        _plan_varlen(call, fn, mode, o.atten_mask, pre, nxt, o.prefix, o.actual_seq_qlen, o.actual_seq_kvlen, o.pse,
                     base)
        return call
    for name, val in (("actual_seq_qlen", o.actual_seq_qlen), ("actual_seq_kvlen", o.actual_seq_kvlen)):
        if val is not None:
            fail(fn, name, repr(val), f"None for input_layout='{layout}' (only TND is variable-length)")
    _plan_padded(call, fn, mode, o._replace(scale=scale, pre=pre, nxt=nxt), base)
    return call


def _mode(fn, atten_mask, sparse_mode, pre, nxt, prefix, pse, key, layout) -> int:
    """The sparse mode the call computes (-1: full attention, as without a mask), its options checked
    against it and what it ignores said once."""
    has_mask = atten_mask is not None
    bands_apply = has_mask and sparse_mode in (0, 4, 7, 8)
    if bands_apply and band_side(pre) is not None and band_side(nxt) is not None and pre + nxt < 0:
        fail(fn, "pre_tockens/next_tockens", f"{pre}/{nxt}", "a band that is not empty (pre_tockens + next_tockens "
             ">= 0: the two must intersect)")
    if not has_mask and sparse_mode != 0:
        warn_once(("no-mask", sparse_mode), f"sparse_mode={sparse_mode} without atten_mask computes full attention, "
                  "as torch_npu documents (the mode and pre/next tokens apply only with a mask); pass the mask "
                  "(e.g. the 2048x2048 triu template) for the pattern.")
    elif not has_mask and (pre, nxt) != (UNBOUNDED, UNBOUNDED):
        warn_once(("no-mask-band", 0), "pre_tockens/next_tockens without atten_mask are ignored: full attention, "
                  "as in torch_npu.")
    if has_mask and sparse_mode in (1, 2, 3, 5, 6) and _band_meant(sparse_mode, pre, nxt, key, layout):
        warn_once(("ignored-band", sparse_mode), f"pre_tockens/next_tockens are ignored with sparse_mode={sparse_mode} "
                  "(as in torch_npu).")
    if prefix is not None and sparse_mode not in (5, 6):
        warn_once(("ignored-prefix", sparse_mode), f"prefix is ignored with sparse_mode={sparse_mode}.")
    if sparse_mode in (7, 8) and pse is not None:
        fail(fn, "pse", "a tensor with sparse_mode=" + str(sparse_mode), "None (torch_npu has no pse in modes 7/8)")
    return sparse_mode if has_mask else -1


def _plan_padded(call, fn, mode, o: _Options, base):
    """A padded call as one piece: its band, its mask (the caller's and a prefix's region) and its
    bias (``pse``)."""
    query, head_num, layout = call.query, call.heads, call.layout
    call.numels = call.batch * head_num * call.sq * call.sk
    bias_fn = _pse_bias(fn, o.pse, o.pse_type, o.scale, query, layout, call.batch, head_num, call.sq, call.sk,
                        _start(fn, "q_start_idx", o.q_start_idx), _start(fn, "kv_start_idx", o.kv_start_idx))
    kwargs = dict(layout=layout, num_heads=head_num if LAYOUT[layout].fused else None, seed=call.seed, **base)
    keep = None
    if mode >= 0:
        keep = _keep_mask(fn, o.atten_mask, mode, layout, call.batch, head_num, call.sq, call.sk)
    if mode in (5, 6):
        pfx = _check_prefix(fn, o.prefix, call.batch, [call.sq] * call.batch, [call.sk] * call.batch)
        lens = lambda n: torch.full((call.batch,), n, device=query.device)  # noqa: E731
        region_keep = region(None, lens(call.sq), lens(call.sk), call.sq, call.sk,
                             torch.tensor(pfx, device=query.device))
        keep = region_keep if keep is None else keep & region_keep
    elif mode in (0, 2, 3, 4):
        pre, nxt = o.pre, o.nxt
        band = {0: Band("top_left", _neg(band_side(pre)), band_side(nxt)), 2: Band("top_left", None, 0),
                3: Band("bottom_right", None, 0), 4: Band("bottom_right", _neg(band_side(pre)), band_side(nxt))}[mode]
        kwargs.update(band_call(band, call.sk - call.sq))
    kwargs["mask"] = keep
    call.pieces.append(Piece(query, call.key, call.value, kwargs, bias_fn=bias_fn))


def _band_meant(sparse_mode, pre, nxt, key, layout) -> bool:
    """Whether pre/next tokens ask for something the mode ignores (Megatron passes pre = S, next = 0
    with its causal modes: that is the causal pattern itself, not worth a warning)."""
    if (pre, nxt) == (UNBOUNDED, UNBOUNDED):
        return False
    if sparse_mode in (2, 3):
        keys = key.shape[LAYOUT[layout].seq_dim]
        return nxt not in (0, UNBOUNDED) or pre < keys
    return True


def _neg(x):
    return None if x is None else -x


def _start(fn, name, value):
    values = int_list(fn, name, value)
    if not values:
        return 0
    if len(values) != 1:
        fail(fn, name, values, "a list of one int (the shard's start index)")
    return values[0]


def _with_rope(fn, query, key, query_rope, key_rope, layout, heads):
    """``query_rope``/``key_rope`` (MLA): scores ``q.k + q_rope.k_rope`` are attention over the
    head dims concatenated (a copy of q and k; v is unchanged)."""
    if query_rope is None and key_rope is None:
        return query, key
    if query_rope is None or key_rope is None:
        fail(fn, "query_rope/key_rope", "only one of them", "both or neither")
    fused = LAYOUT[layout].fused
    for name, t, ref in (("query_rope", query_rope, query), ("key_rope", key_rope, key)):
        check_tensor(fn, name, t, ref.dim(), (ref.dtype,), f" of {ref.dtype}, in input_layout '{layout}'")
        if tuple(t.shape[:-1]) != tuple(ref.shape[:-1]) and not fused:
            fail(fn, name, f"shape {tuple(t.shape)}", f"the shape of {'query' if ref is query else 'key'} except "
                 "the head dim")
    if fused:
        kv_heads = key.shape[2] // (query.shape[2] // heads)
        rq = query_rope.shape[2] // heads
        q = torch.cat([query.unflatten(-1, (heads, -1)), query_rope.unflatten(-1, (heads, rq))], -1).flatten(-2)
        k = torch.cat([key.unflatten(-1, (kv_heads, -1)), key_rope.unflatten(-1, (kv_heads, rq))], -1).flatten(-2)
        return q, k
    return torch.cat([query, query_rope], -1), torch.cat([key, key_rope], -1)


def _plan_varlen(call, fn, mode, atten_mask, pre, nxt, prefix, actual_seq_qlen, actual_seq_kvlen, pse, base):
    query, key, value = call.query, call.key, call.value
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        fail(fn, "actual_seq_qlen/actual_seq_kvlen", None, "cumulative sequence ends, required for input_layout='TND'")
    raw_q, cu_q = _cumulative(fn, "actual_seq_qlen", actual_seq_qlen, query.shape[0])
    raw_k, cu_k = _cumulative(fn, "actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
    if len(raw_q) != len(raw_k):
        fail(fn, "actual_seq_kvlen", f"{len(raw_k)} entries", f"{len(raw_q)}, one per sequence as in actual_seq_qlen")
    batch = max(len(cu_q), len(cu_k)) - 1
    cu_q += [cu_q[-1]] * (batch + 1 - len(cu_q))
    cu_k += [cu_k[-1]] * (batch + 1 - len(cu_k))
    call.cu_q = cu_q
    accum = raw_q[0] * raw_k[0] + sum((raw_q[i] - raw_q[i - 1]) * (raw_k[i] - raw_k[i - 1]) for i in range(1, len(raw_q)))
    call.numels = call.heads * accum
    if pse is not None:
        _pse_bias(fn, pse, 1, 1.0, query, "TND", batch, call.heads, 0, 0, 0, 0)
    lq = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lk = [b - a for a, b in zip(cu_k, cu_k[1:])]
    device = query.device
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731

    def direct(b0, b1, kwargs, salt):
        """One TND call on sequences b0..b1-1: views of the packed rows they occupy."""
        rows, keys = slice(cu_q[b0], cu_q[b1]), slice(cu_k[b0], cu_k[b1])
        cq = [x - cu_q[b0] for x in cu_q[b0:b1 + 1]]
        ck = [x - cu_k[b0] for x in cu_k[b0:b1 + 1]]
        kw = dict(layout="TND", cu_seqlens_q=i32(cq), cu_seqlens_k=i32(ck), seed=_mix_seed(call.seed, salt), **base)
        trim = kwargs.pop("trim", 0)
        if trim:
            kw["seqused_k"] = i32([max(0, n - trim) for n in lk[b0:b1]])
        kw.update(kwargs)
        whole = rows == slice(0, query.shape[0]) and keys == slice(0, key.shape[0])
        call.pieces.append(Piece(query[rows], key[keys], value[keys], kw,
                                 rows=None if whole else rows, keys=None if whole else keys))

    def padded(band=None, keep=None, pfx=None):
        """One padded call with the exact per-sequence region as a mask (see _plan.PadIndex)."""
        pad = PadIndex(cu_q, cu_k, device)
        mask = region(band, pad.q_len, pad.k_len, pad.sq, pad.sk, pfx)
        if keep is not None:
            mask = mask & keep[: pad.sq, : pad.sk]
        kw = dict(layout="BSND", mask=mask, seed=call.seed, **base)
        call.pieces.append(Piece(pad.pad_q(query), pad.pad_k(key), pad.pad_k(value), kw, pad=pad))

    def banded(b0, b1, band, salt):
        """Sequences b0..b1-1 under a bottom-right band: one varlen call, or, for a band above
        the diagonal of sequences with different Sk - Sq (only possible for the whole call),
        the padded route."""
        same = {lk[b] - lq[b] for b in range(b0, b1)}
        kwargs = band_call(band, same.pop() if len(same) == 1 else None)
        if kwargs is None:
            padded(band=band)
        else:
            direct(b0, b1, kwargs, salt)

    if batch == 0 or cu_q[-1] == 0:
        return
    band_pn = Band("bottom_right", _neg(band_side(pre)), band_side(nxt))
    if mode == -1:
        direct(0, batch, {}, 0)
    elif mode in (0, 1):
        keep = _keep_mask(fn, atten_mask, mode, "TND", batch, call.heads, max(lq), max(lk))
        padded(band=Band("top_left", _neg(band_side(pre)), band_side(nxt)) if mode == 0 else None, keep=keep)
    elif mode == 2:
        _keep_mask(fn, atten_mask, mode, "TND", 0, 0, 0, 0)
        direct(0, batch, band_call(Band("top_left", None, 0), 0), 0)
    elif mode == 3:
        _keep_mask(fn, atten_mask, mode, "TND", 0, 0, 0, 0)
        direct(0, batch, band_call(Band("bottom_right", None, 0), None), 0)
    elif mode == 4:
        _keep_mask(fn, atten_mask, mode, "TND", 0, 0, 0, 0)
        banded(0, batch, band_pn, 0)
    elif mode == 6:
        _keep_mask(fn, atten_mask, mode, "TND", 0, 0, 0, 0)
        pfx = _check_prefix(fn, prefix, batch, lq, lk)
        padded(pfx=torch.tensor(pfx, device=device))
    else:  # 7, 8: one rank's shard of a split sequence; its band is the last (7) or first (8) sequence's
        _keep_mask(fn, atten_mask, mode, "TND", 0, 0, 0, 0)
        if mode == 7:
            if batch > 1:
                direct(0, batch - 1, band_call(Band("bottom_right", None, 0), None), 0)
            banded(batch - 1, batch, band_pn, 1)
        else:
            banded(0, 1, band_pn, 1)
            if batch > 1:
                direct(1, batch, band_call(Band("top_left", None, 0), 0), 0)


# ---------------------------------------------------------------------------------------------
# The ops


def _draw_seed(keep_prob, seed, offset):
    """tileattn's dropout seed: drawn from torch's default generator (so ``torch.manual_seed``
    reproduces it) unless the caller passes ``seed``/``offset`` (v2), which map to one."""
    if not isinstance(keep_prob, (int, float)) or isinstance(keep_prob, bool) or keep_prob >= 1:
        return 0, 0
    if seed or offset:
        return int(seed), int(offset)
    return int(torch.randint(0, 2**62, (1,)).item()), 0


def _forward(fn, query, key, value, head_num, input_layout, options: _Options, seed=0, offset=0):
    for name, val in (("seed", seed), ("offset", offset)):
        if not is_int(val):
            fail(fn, name, repr(val), "an int", NpuTypeError)
    seed, offset = _draw_seed(options.keep_prob, seed, offset)
    with core_errors(fn):
        call = _build(fn, query, key, value, head_num, input_layout, options, _mix_seed(seed, offset))
        geo = call.geometry()
        if call.pieces:
            out, lse = plan.forward(call.pieces, geo)
            rmax = plan.row_max(call.pieces, geo)
        else:
            out = query.new_zeros(call.out_shape())
            lse = rmax = torch.full(geo.lse_shape, -math.inf, device=query.device)
    softmax_max, softmax_sum = stats_from_lse(lse, rmax, call.layout, options.softmax_layout, call.cu_q)
    return out, softmax_max, softmax_sum, query.new_empty((0,)), seed, offset, call.numels


@beside_stand_in
def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    """torch_npu's FlashAttentionScore on tileattn: ``(attention_out, softmax_max, softmax_sum,
    softmax_out, seed, offset, numels)``.

    Gradients flow through autograd into query, key, value, pse and sink. ``softmax_out`` is an
    empty tensor (reserved in torch_npu too); ``gen_mask_parallel``/``sync`` schedule torch_npu's
    dropout-mask generation and have no effect here; so does ``inner_precise`` (rows that see no
    key always give 0). ``seed`` is tileattn's dropout seed, ``offset`` 0; ``numels`` is computed as
    torch_npu does (``B*N*Sq*Skv``; TND: ``N * sum(lq_b * lk_b)`` over the lists as passed).
    """
    return _forward("npu_fusion_attention", query, key, value, head_num, input_layout, _Options(
        pse, padding_mask, atten_mask, scale, keep_prob, pre_tockens, next_tockens, inner_precise, prefix,
        actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink))


@beside_stand_in
def npu_fusion_attention_v2(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                            query_rope=None, key_rope=None, scale=1.0, keep_prob=1.0, pre_tokens=2147483647,
                            next_tokens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                            actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False, pse_type=1,
                            q_start_idx=None, kv_start_idx=None, softmax_layout="", sink=None, dropout_mask=None,
                            seed=0, offset=0):
    """``npu_fusion_attention`` with ``pse_type`` (0: pse added after scaling; 1: before, the
    default; 2/3: ``pse`` holds fp32 ALiBi slopes (N,) or (B, N) and the bias is
    ``-slope * |i + q_start_idx - j - kv_start_idx|``, its square root for 3), ``query_rope`` /
    ``key_rope`` (extra head dims of q and k, as in MLA) and ``seed``/``offset`` (a given pair
    fixes the dropout pattern). ``dropout_mask`` (a mask torch_npu generated) is refused: the
    dropout pattern comes from tileattn's counter-based RNG."""
    fn = "npu_fusion_attention_v2"
    if dropout_mask is not None:
        refuse(fn, "argument 'dropout_mask' (a bit mask from torch_npu's Philox generator)",
               "pass seed/offset instead: tileattn draws its own counter-based dropout pattern")
    check_int(fn, "pse_type", pse_type)
    if pse_type not in (0, 1, 2, 3):
        fail(fn, "pse_type", pse_type, "0, 1, 2 or 3")
    return _forward(fn, query, key, value, head_num, input_layout, _Options(
        pse, padding_mask, atten_mask, scale, keep_prob, pre_tokens, next_tokens, inner_precise, prefix,
        actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink, pse_type, q_start_idx, kv_start_idx,
        query_rope, key_rope), seed, offset)


def _grad(fn, query, key, value, dy, head_num, input_layout, options: _Options, forward, seed, offset):
    """The gradients of a call (its options as the forward's) for the output gradient ``dy``, from
    ``forward`` = (softmax_max, softmax_sum, attention_in) as the forward returned them (or Nones:
    the forward is recomputed)."""
    softmax_max, softmax_sum, attention_in = forward
    pse, sink, softmax_layout = options.pse, options.sink, options.softmax_layout
    for name, val in (("seed", seed), ("offset", offset)):
        if not is_int(val):
            fail(fn, name, repr(val), "the int returned by npu_fusion_attention", NpuTypeError)
    check_tensor(fn, "dy", dy, None, FLOAT_DTYPES, ", the gradient of attention_out")
    pse_leaf = pse.detach().requires_grad_(True) if isinstance(pse, torch.Tensor) else pse
    sink_t = sink.detach() if isinstance(sink, torch.Tensor) else sink
    with core_errors(fn):
        call = _build(fn, query.detach(), key.detach(), value.detach(), head_num, input_layout,
                      options._replace(pse=pse_leaf, sink=sink_t), _mix_seed(int(seed), int(offset)))
    if tuple(dy.shape) != call.out_shape():
        fail(fn, "dy", f"shape {tuple(dy.shape)}", f"{call.out_shape()}, the shape of attention_out")
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != call.stat_shape()):
            fail(fn, name, f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__,
                 f"shape {call.stat_shape()}, as npu_fusion_attention returns it")
    if attention_in is not None and (not isinstance(attention_in, torch.Tensor) or attention_in.shape != dy.shape):
        fail(fn, "attention_in", getattr(attention_in, "shape", type(attention_in).__name__), "the shape of dy")
    q, k, v = call.query, call.key, call.value
    geo = call.geometry()
    with core_errors(fn), torch.no_grad():
        if not call.pieces:
            dq, dk, dv, dbiases, dsink = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), [], None
        else:
            if attention_in is None or softmax_max is None or softmax_sum is None:
                out, lse = plan.forward(call.pieces, geo)
            else:
                out = attention_in
                lse = lse_from_stats(softmax_max, softmax_sum, call.layout, softmax_layout, call.cu_q)
            dq, dk, dv, dbiases, dsink = plan.backward(call.pieces, dy, out, lse, q, k, v)
    dpse = None
    if isinstance(pse, torch.Tensor):
        dpse = torch.zeros_like(pse)
        for piece, dbias in zip(call.pieces, dbiases):
            if piece.bias_fn is not None and dbias is not None:
                with torch.enable_grad():
                    dpse += torch.autograd.grad(piece.bias_fn(), pse_leaf, dbias.to(pse.dtype))[0]
    if options.query_rope is not None:
        return _split_rope(dq, dk, query, key, call) + (dv, dpse, dsink)
    if sink is not None and dsink is None:
        dsink = torch.zeros_like(sink)
    return dq, dk, dv, dpse, dsink


def _split_rope(dq, dk, query, key, call):
    """(dq, dq_rope, dk, dk_rope) from the gradients of the concatenated head dims."""
    if LAYOUT[call.layout].fused:
        heads, kv_heads = call.heads, call.heads_kv
        dq4, dk4 = dq.unflatten(-1, (heads, -1)), dk.unflatten(-1, (kv_heads, -1))
        dq_, dqr = dq4[..., : query.shape[-1] // heads].flatten(-2), dq4[..., query.shape[-1] // heads:].flatten(-2)
        dk_, dkr = dk4[..., : key.shape[-1] // kv_heads].flatten(-2), dk4[..., key.shape[-1] // kv_heads:].flatten(-2)
        return dq_, dqr, dk_, dkr
    d = query.shape[-1]
    return dq[..., :d], dq[..., d:], dk[..., :d], dk[..., d:]


@beside_stand_in
def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False, softmax_layout="", sink=None):
    """Gradients ``(dq, dk, dv, dpse)`` (and ``dsink`` fifth when ``sink`` is given) of
    :func:`npu_fusion_attention` for the output gradient ``dy``.

    Like torch_npu, it uses the statistics it is given: ``P = exp(s - LSE)`` with
    ``LSE = softmax_max + log(softmax_sum)`` and ``D = rowsum(dy * attention_in)``. Passing the
    merged statistics and output of a larger attention (ring / context-parallel attention over key
    chunks) gives that attention's gradients for these keys. Without ``attention_in`` /
    ``softmax_max`` / ``softmax_sum`` the forward is recomputed first. ``seed``/``offset`` must be
    those the forward returned when ``keep_prob < 1``. ``dpse`` is None without ``pse``.
    """
    grads = _grad("npu_fusion_attention_grad", query, key, value, dy, head_num, input_layout, _Options(
        pse, padding_mask, atten_mask, scale_value, keep_prob, pre_tockens, next_tockens, inner_precise, prefix,
        actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink),
        (softmax_max, softmax_sum, attention_in), seed, offset)
    return grads if sink is not None else grads[:4]


@beside_stand_in
def npu_fusion_attention_grad_v2(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                                 atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                                 attention_in=None, query_rope=None, key_rope=None, scale_value=1.0, keep_prob=1.0,
                                 pre_tokens=2147483647, next_tokens=2147483647, inner_precise=0, seed=0, offset=0,
                                 numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                                 gen_mask_parallel=True, sync=False, pse_type=1, q_start_idx=None, kv_start_idx=None,
                                 softmax_layout="", sink=None):
    """Gradients of :func:`npu_fusion_attention_v2`: ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)``
    (None where the input was not given), as torch_npu's v2 returns seven values."""
    fn = "npu_fusion_attention_grad_v2"
    check_int(fn, "pse_type", pse_type)
    if pse_type not in (0, 1, 2, 3):
        fail(fn, "pse_type", pse_type, "0, 1, 2 or 3")
    grads = _grad(fn, query, key, value, dy, head_num, input_layout, _Options(
        pse, padding_mask, atten_mask, scale_value, keep_prob, pre_tokens, next_tokens, inner_precise, prefix,
        actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, sink, pse_type, q_start_idx, kv_start_idx,
        query_rope, key_rope), (softmax_max, softmax_sum, attention_in), seed, offset)
    if query_rope is not None:
        dq, dq_rope, dk, dk_rope, dv, dpse, dsink = grads
    else:
        (dq, dk, dv, dpse, dsink), dq_rope, dk_rope = grads, None, None
    return dq, dk, dv, dpse, dq_rope, dk_rope, dsink
