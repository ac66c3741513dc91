"""Ascend ``torch_npu.npu_fusion_attention`` (and its grad), served by tileattn.

Same signature, defaults and results as torch_npu (spelling "tockens" included). The translation:

* ``atten_mask`` True/1 = masked **out**; tileattn's mask is True = take part, so it is inverted.
* ``scale`` defaults to 1.0 (callers pass ``1/sqrt(D)``); ``keep_prob = 1 - dropout_p``.
* ``pse`` is added to Q.K^T *before* scaling: tileattn gets ``bias = scale * pse`` (autograd then
  returns ``dpse = scale * dbias``).
* ``sparse_mode`` bands are counted from the top-left (modes 0, 2) or bottom-right (3, 4) corner;
  they become a tileattn window around a diagonal placed by ``align`` (see :func:`_band_kwargs`).
* ``softmax_max``/``softmax_sum`` (fp32, last dim 8, the value repeated) come from tileattn's LSE and
  the true row max of the masked, scaled scores, computed tile by tile (see :func:`_row_max`), so
  ``softmax_max + log(softmax_sum) == LSE``.

Differences (documented in docs/dialects.md): rows where every key is masked give 0 output (what
torch_npu gives with ``inner_precise=2``) with ``softmax_max = -inf`` and ``softmax_sum = 0``; the
dropout pattern comes from tileattn's counter-based RNG, so ``seed`` is tileattn's and ``offset`` is 0.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .api import attention_backward as tileattn_backward, flash_attention
from .modifiers import TileState
from .spec import build_spec, user_shape

__all__ = ["npu_fusion_attention", "npu_fusion_attention_grad"]

_UNBOUNDED = 2147483647
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
_RANK = {"BSH": 3, "SBH": 3, "BSND": 4, "BNSD": 4, "TND": 3}
_SEQ_AXIS = {"BSH": 1, "SBH": 0, "BSND": 1, "BNSD": 2}
_COMPRESSED = {2: (2048, 2048), 3: (2048, 2048), 4: (2048, 2048), 6: (3072, 2048)}
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_WARNED = set()


def _fail(fn, arg, given, expected, exc=ValueError):
    raise exc(f"tileattn.npu.{fn}: argument '{arg}': got {given}; expected {expected}.")


def _warn_once(key, message):
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"tileattn.npu: {message}", UserWarning, stacklevel=4)


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@dataclass
class _Piece:
    """One call of ``flash_attention``; ``rows`` is the TND row range it fills (None = everything)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict
    rows: Optional[tuple] = None
    empty_keys: bool = False
    #: (axis, start, length) of the caller's key/value tensors this piece reads (its dk/dv region).
    key_region: Optional[tuple] = None


@dataclass
class _Call:
    """A validated npu_fusion_attention call, translated into one or more ``flash_attention`` calls."""

    layout: str
    batch: int
    heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim_v: int
    pieces: List[_Piece] = field(default_factory=list)
    numels: int = 0


def _cumulative(fn, name, value, total, batch):
    """Validate torch_npu's cumulative end offsets (e.g. lengths [2, 2, 2] -> [2, 4, 6])."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point():
            _fail(fn, name, f"tensor of shape {tuple(value.shape)}, dtype {value.dtype}", "a 1-d integer list")
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value or not all(_is_int(x) for x in value):
        _fail(fn, name, repr(value), "a non-empty list of ints: cumulative sequence ends, e.g. [2, 4, 6]",
              TypeError)
    ends = [int(x) for x in value]
    if batch is not None and len(ends) != batch:
        _fail(fn, name, f"{len(ends)} entries", f"{batch} entries, one per sequence as in actual_seq_qlen")
    if ends[0] < 0 or any(b < a for a, b in zip(ends, ends[1:])):
        _fail(fn, name, ends, "non-decreasing cumulative ends (lengths [2, 2, 2] are passed as [2, 4, 6])")
    if ends[-1] != total:
        _fail(fn, name, f"last entry {ends[-1]}", f"the token count {total} of the packed tensor")
    return [0] + ends


def _validate_tensors(fn, query, key, value, head_num, input_layout):
    if not isinstance(input_layout, str) or input_layout not in _LAYOUTS:
        _fail(fn, "input_layout", repr(input_layout), "one of " + ", ".join(repr(x) for x in _LAYOUTS))
    rank = _RANK[input_layout]
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            _fail(fn, name, type(t).__name__, f"a torch.Tensor in layout {input_layout}", TypeError)
        if t.dim() != rank:
            _fail(fn, name, f"a {t.dim()}-d tensor of shape {tuple(t.shape)}",
                  f"a {rank}-d tensor for input_layout='{input_layout}'")
    if not _is_int(head_num) or head_num < 1:
        _fail(fn, "head_num", repr(head_num), "a positive int, the number of query heads", TypeError)
    if input_layout in ("BSH", "SBH"):
        if query.shape[2] % head_num:
            _fail(fn, "head_num", head_num, f"a divisor of query's hidden size {query.shape[2]}")
        d = query.shape[2] // head_num
        if key.shape[2] % d:
            _fail(fn, "key", f"hidden size {key.shape[2]}", f"a multiple of the head dim {d}")
        heads_kv = key.shape[2] // d
    else:
        axis = 1 if input_layout == "TND" else (2 if input_layout == "BSND" else 1)
        if query.shape[axis] != head_num:
            _fail(fn, "head_num", head_num, f"{query.shape[axis]}, the heads of query in layout {input_layout}")
        heads_kv = key.shape[axis]
    if heads_kv == 0 or head_num % heads_kv:
        _fail(fn, "key", f"{heads_kv} heads for head_num={head_num}", "a number of kv heads dividing head_num (GQA)")
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in _DTYPES:
        _fail(fn, "query/key/value", f"dtypes {query.dtype}, {key.dtype}, {value.dtype}",
              "one shared dtype among float16, bfloat16, float32 (float64 also works here)", TypeError)
    if not (query.device == key.device == value.device):
        _fail(fn, "query/key/value", f"devices {query.device}, {key.device}, {value.device}", "one shared device")


def _geometry(layout, query, key, value, head_num):
    """(batch, heads, heads_kv, seqlen_q, seqlen_k, head_dim_v) of a padded layout."""
    if layout == "BNSD":
        return query.shape[0], head_num, key.shape[1], query.shape[2], key.shape[2], value.shape[3]
    if layout == "BSND":
        return query.shape[0], head_num, key.shape[2], query.shape[1], key.shape[1], value.shape[3]
    d = query.shape[2] // head_num
    hkv = key.shape[2] // d
    b_axis, s_axis = (0, 1) if layout == "BSH" else (1, 0)
    return query.shape[b_axis], head_num, hkv, query.shape[s_axis], key.shape[s_axis], value.shape[2] // max(hkv, 1)


def _validate_options(fn, scale, keep_prob, pre_tockens, next_tockens, inner_precise, sparse_mode, padding_mask):
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        _fail(fn, "scale", repr(scale), "a finite float (torch_npu's default is 1.0: pass 1/sqrt(head_dim))", TypeError)
    if isinstance(keep_prob, bool) or not isinstance(keep_prob, numbers.Real) or not 0.0 < keep_prob <= 1.0:
        _fail(fn, "keep_prob", repr(keep_prob), "a float in (0, 1] (1 - dropout probability)")
    for name, val in (("pre_tockens", pre_tockens), ("next_tockens", next_tockens)):
        if not _is_int(val):
            _fail(fn, name, repr(val), "an int", TypeError)
    if pre_tockens < 0 and next_tockens < 0:
        _fail(fn, "pre_tockens/next_tockens", f"{pre_tockens}/{next_tockens}",
              "at most one of them negative (the band pre..next must not be empty)")
    if inner_precise not in (0, 1, 2) or isinstance(inner_precise, bool):
        _fail(fn, "inner_precise", repr(inner_precise), "0, 1 or 2")
    if not _is_int(sparse_mode) or not 0 <= sparse_mode <= 8:
        _fail(fn, "sparse_mode", repr(sparse_mode), "an int in 0..8")
    if sparse_mode in (7, 8):
        raise NotImplementedError(
            f"tileattn.npu.{fn}: sparse_mode={sparse_mode} (varlen with the query split across devices, "
            "context parallelism) is not supported; run the unsplit sequence with sparse_mode="
            f"{3 if sparse_mode == 7 else 2}.")
    if padding_mask is not None:
        raise NotImplementedError(f"tileattn.npu.{fn}: argument 'padding_mask' is not supported (torch_npu does "
                                  "not support it either); pass None.")


def _keep_from_atten_mask(fn, atten_mask, sparse_mode, batch, heads, sq, sk, layout):
    """Validate ``atten_mask``; return tileattn's keep mask (True = take part) or None for templates."""
    if atten_mask is None:
        if sparse_mode in (1, 5):
            _fail(fn, "atten_mask", None, f"a bool/uint8 mask (required for sparse_mode={sparse_mode})")
        return None
    if not isinstance(atten_mask, torch.Tensor) or atten_mask.dtype not in (torch.bool, torch.uint8):
        given = f"dtype {atten_mask.dtype}" if isinstance(atten_mask, torch.Tensor) else type(atten_mask).__name__
        _fail(fn, "atten_mask", given, "a torch.bool or torch.uint8 tensor (1/True = masked out)", TypeError)
    shape = tuple(atten_mask.shape)
    if sparse_mode in _COMPRESSED:
        if shape != _COMPRESSED[sparse_mode]:
            _fail(fn, "atten_mask", f"shape {shape}",
                  f"the compressed {_COMPRESSED[sparse_mode][0]}x{_COMPRESSED[sparse_mode][1]} template for "
                  f"sparse_mode={sparse_mode} (the kept region comes from the mode)")
        return None
    if layout == "TND":
        raise NotImplementedError(
            f"tileattn.npu.{fn}: argument 'atten_mask' with sparse_mode={sparse_mode} and input_layout='TND' is "
            "not supported; use sparse_mode 2, 3 or 4 (causal/band) or a padded layout.")
    allowed = [(batch, heads, sq, sk), (batch, 1, sq, sk)]
    if sparse_mode != 5:
        allowed += [(1, 1, sq, sk), (sq, sk)]
    if shape not in allowed:
        _fail(fn, "atten_mask", f"shape {shape}", " or ".join(str(s) for s in allowed))
    return ~atten_mask.bool()


def _bias_from_pse(fn, pse, scale, batch, heads, sq, sk, layout):
    if pse is None:
        return None
    if layout == "TND":
        raise NotImplementedError(f"tileattn.npu.{fn}: argument 'pse' with input_layout='TND' is not supported.")
    if not isinstance(pse, torch.Tensor) or not pse.is_floating_point():
        _fail(fn, "pse", type(pse).__name__ if not isinstance(pse, torch.Tensor) else f"dtype {pse.dtype}",
              "a float tensor", TypeError)
    shape = tuple(pse.shape)
    ok = len(shape) == 4 and shape[0] in (1, batch) and shape[1] == heads and shape[2] in (1, sq) and shape[3] == sk
    if not ok:
        extra = " (the 1024-row compressed ALiBi form is not supported)" if len(shape) == 4 and shape[2] == 1024 else ""
        _fail(fn, "pse", f"shape {shape}{extra}",
              f"({batch}, {heads}, {sq}, {sk}), ({batch}, {heads}, 1, {sk}) or (1, {heads}, {sq}, {sk})")
    # torch_npu adds pse before scaling: scale * (q.k^T + pse) = scale * q.k^T + scale * pse.
    return pse * scale


def _band(sparse_mode, keep, pre, nxt, sq, sk):
    """The top-left band (lo, hi) on j - i for one (sq, sk) problem, or None for no band."""
    off = sk - sq
    if sparse_mode == 0:
        return (-pre, nxt) if keep is not None else None
    if sparse_mode == 2:
        return (None, 0)
    if sparse_mode == 3:
        return (None, off)
    if sparse_mode == 4:
        return (off - pre, off + nxt)
    return None


def _prefix_keep(prefix, sq, sk, device):
    """Modes 5/6: bottom-right causal plus the first ``prefix[b]`` key columns, shape (B, 1, Sq, Sk)."""
    rows = torch.arange(sq, device=device)[:, None]
    cols = torch.arange(sk, device=device)[None, :]
    causal = cols <= rows + (sk - sq)
    lead = torch.tensor(prefix, device=device)[:, None, None] > cols[None]
    return (causal[None] | lead)[:, None]


def _check_prefix(fn, prefix, batch, sk_list):
    if not isinstance(prefix, (list, tuple)) or len(prefix) != batch or not all(_is_int(p) for p in prefix):
        _fail(fn, "prefix", repr(prefix), f"a list of {batch} ints (prefix length per batch)", TypeError)
    for p, sk in zip(prefix, sk_list):
        if not 0 <= p <= sk:
            _fail(fn, "prefix", list(prefix), f"values in [0, Skv] per batch (Skv = {sk})")
    return [int(p) for p in prefix]


def _band_kwargs(band, sq, sk, device):
    """flash_attention keywords for a top-left band ``lo <= j - i <= hi`` (None = open side): a
    window around the diagonal ``j = i + align``; an empty band becomes an all-False mask."""
    if band is None:
        return {}
    lo, hi = band
    if lo is not None and hi is not None and lo > hi:
        return dict(mask=torch.zeros(sq, sk, dtype=torch.bool, device=device))
    if hi is not None:
        return dict(align=hi, window=(None if lo is None else hi - lo, 0))
    return dict(align=lo, window=(0, None))


def _plan(fn, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
          pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
          seed):
    _validate_tensors(fn, query, key, value, head_num, input_layout)
    _validate_options(fn, scale, keep_prob, pre_tockens, next_tockens, inner_precise, sparse_mode, padding_mask)
    layout = input_layout
    dropout_p = 1.0 - float(keep_prob)
    band_args_default = pre_tockens == _UNBOUNDED and next_tockens == _UNBOUNDED
    if not band_args_default and sparse_mode in (1, 2, 3, 5, 6):
        _warn_once(("ignored-band", sparse_mode),
                   f"pre_tockens/next_tockens are ignored with sparse_mode={sparse_mode} (as in torch_npu).")
    if prefix is not None and sparse_mode not in (5, 6):
        _warn_once(("ignored-prefix", sparse_mode), f"prefix is ignored with sparse_mode={sparse_mode}.")
    common = dict(scale=float(scale), dropout_p=dropout_p)

    if layout == "TND":
        if actual_seq_qlen is None or actual_seq_kvlen is None:
            _fail(fn, "actual_seq_qlen/actual_seq_kvlen", None, "cumulative sequence ends, required for TND")
        cu_q = _cumulative(fn, "actual_seq_qlen", actual_seq_qlen, query.shape[0], None)
        cu_k = _cumulative(fn, "actual_seq_kvlen", actual_seq_kvlen, key.shape[0], len(cu_q) - 1)
        batch = len(cu_q) - 1
        if sparse_mode == 5:
            _fail(fn, "sparse_mode", 5, "a mode other than 5 for input_layout='TND' (prefix without compression "
                  "does not support varlen in torch_npu; use 6)")
        _keep_from_atten_mask(fn, atten_mask, sparse_mode, batch, head_num, None, None, layout)
        _bias_from_pse(fn, pse, scale, batch, head_num, None, None, layout)
        if sparse_mode == 0 and atten_mask is None and not band_args_default:
            _warn_once(("no-mask-band", 0), "sparse_mode=0 without atten_mask ignores pre_tockens/next_tockens: "
                       "full attention (as in torch_npu).")
        lens = [(cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b]) for b in range(batch)]
        pfx = _check_prefix(fn, prefix, batch, [lk for *_, lk in lens]) if sparse_mode == 6 else None
        call = _Call(layout, batch, head_num, max(l for _, l, _, _ in lens), max(l for *_, l in lens), value.shape[2])
        call.numels = sum(lq * lk for _, lq, _, lk in lens) * head_num if dropout_p > 0 else 0
        bands = [_band_kwargs(_band(sparse_mode, None, pre_tockens, next_tockens, lq, lk), lq, lk, query.device)
                 for _, lq, _, lk in lens]
        if sparse_mode == 3:
            bands = [dict(causal=True)] * batch  # bottom-right causal, per sequence
        elif sparse_mode == 4 and pre_tockens >= 0 and next_tockens >= 0:
            bands = [dict(window=(pre_tockens, next_tockens))] * batch
        if pfx is None and all(b == bands[0] and "mask" not in b for b in bands):
            to_i32 = lambda c: torch.tensor(c, dtype=torch.int32, device=query.device)  # noqa: E731
            call.pieces.append(_Piece(query, key, value, dict(
                layout="TND", cu_seqlens_q=to_i32(cu_q), cu_seqlens_k=to_i32(cu_k), seed=seed,
                **(bands[0] if bands else {}), **common), key_region=(0, 0, key.shape[0])))
            return call
        # Per-sequence diagonals or masks differ: one padded call per sequence, on views of the packed tensors.
        for b, ((q0, lq, k0, lk), kwargs) in enumerate(zip(lens, bands)):
            if lq == 0:
                continue
            if pfx is not None:
                kwargs = dict(mask=_prefix_keep([pfx[b]], lq, lk, query.device))
            call.pieces.append(_Piece(query[q0:q0 + lq].unsqueeze(0), key[k0:k0 + lk].unsqueeze(0),
                                      value[k0:k0 + lk].unsqueeze(0),
                                      dict(layout="BSND", seed=(seed + b) & ((1 << 62) - 1), **kwargs, **common),
                                      rows=(q0, q0 + lq), empty_keys=lk == 0, key_region=(0, k0, lk)))
        return call

    for name, val in (("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen)):
        if val is not None:
            _fail(fn, name, repr(val), f"None for input_layout='{layout}' (only TND is variable-length)")
    batch, heads, _, sq, sk, dv = _geometry(layout, query, key, value, head_num)
    keep = _keep_from_atten_mask(fn, atten_mask, sparse_mode, batch, heads, sq, sk, layout)
    bias = _bias_from_pse(fn, pse, scale, batch, heads, sq, sk, layout)
    if sparse_mode == 0 and keep is None and not band_args_default:
        _warn_once(("no-mask-band", 0), "sparse_mode=0 without atten_mask ignores pre_tockens/next_tockens: "
                   "full attention (as in torch_npu).")
    call = _Call(layout, batch, heads, sq, sk, dv, numels=batch * heads * sq * sk if dropout_p > 0 else 0)
    if sparse_mode in (5, 6):
        pfx = _check_prefix(fn, prefix, batch, [sk] * batch)
        pk = _prefix_keep(pfx, sq, sk, query.device)
        keep = pk if keep is None else keep & pk
        band = None
    else:
        band = _band(sparse_mode, keep, pre_tockens, next_tockens, sq, sk)
    kwargs = _band_kwargs(band, sq, sk, query.device)
    if "mask" in kwargs:
        keep = kwargs.pop("mask") if keep is None else keep & kwargs.pop("mask")
    num_heads = heads if layout in ("BSH", "SBH") else None
    call.pieces.append(_Piece(query, key, value, dict(layout=layout, num_heads=num_heads, mask=keep, bias=bias,
                                                      seed=seed, **kwargs, **common),
                              key_region=(_SEQ_AXIS[layout], 0, sk)))
    return call


@torch.no_grad()
def _row_max(piece: _Piece, block: int = None) -> torch.Tensor:
    """Row max of the masked, scaled scores of one piece, (B, N, Sq) (or (N, T) for TND).

    Walks blocks of ``block`` queries x ``block`` keys (about 1M scores per block by default),
    skipping blocks outside the band and masking only blocks the band cuts, so memory stays bounded,
    never the full score matrix. It costs one extra Q.K^T GEMM. GQA query heads of one kv head share
    one GEMM (no repeated K).
    """
    kw = {k: v for k, v in piece.kwargs.items() if k not in ("dropout_p", "seed")}
    spec = build_spec(piece.q, piece.k, piece.v, **kw)
    cdt = spec.acc_dtype()
    hq, hkv, g, scale = spec.heads_q, spec.heads_kv, spec.group_size, spec.scale
    band, mask, bias = spec.modifier("band"), spec.modifier("mask"), spec.modifier("bias")
    every_head = slice(None)
    if block is None:
        # About 2**20 scores (4 MiB fp32) per block stays in cache; measured best of 256/512/1024 at 8 heads.
        block = max(128, min(1024, 1 << int(math.log2(math.sqrt(2**20 / hq)))))
    # Without a bias, max(scale * s) = scale * max(s) for scale > 0: scale the (Sq,) maxima, not the block.
    late_scale = bias is None and scale > 0
    seqs = []
    for seq in spec.sequences:
        b, lq, lk = seq.batch, seq.q_len, seq.k_len
        if spec.is_varlen:
            q = spec.q_c[seq.q_start:seq.q_start + lq].transpose(0, 1)
            k = spec.k_c[seq.k_start:seq.k_start + lk].transpose(0, 1)
        else:
            q, k = spec.q_c[b], spec.k_c[b]
        q, k = q.unflatten(0, (hkv, g)), k.to(cdt)
        m = torch.full((hq, lq), -math.inf, dtype=cdt, device=q.device)
        seqs.append(m)
        for i0 in range(0, lq, block):
            i1 = min(lq, i0 + block)
            qb = q[:, :, i0:i1].to(cdt).reshape(hkv, g * (i1 - i0), q.shape[-1])
            j_lo, j_hi = (0, lk) if band is None else band.key_range(i0, i1, lk, seq.offset)
            for j0 in range(j_lo, j_hi, block):
                j1 = min(j_hi, j0 + block)
                s = torch.matmul(qb, k[:, j0:j1].transpose(1, 2)).view(hq, i1 - i0, j1 - j0)
                if not late_scale:
                    s.mul_(scale)
                if bias is not None:
                    s.add_(bias.block(b, every_head, i0, i1, j0, j1).to(cdt))
                keep = None
                if band is not None and band.tile_state(i0, i1, j0, j1, seq.offset) != TileState.FULL:
                    keep = band.keep(torch.arange(i0, i1, device=q.device), torch.arange(j0, j1, device=q.device),
                                     seq.offset)
                if mask is not None:
                    block_mask = mask.block(b, every_head, i0, i1, j0, j1)
                    keep = block_mask if keep is None else keep & block_mask
                if keep is not None:
                    s.masked_fill_(~keep, -math.inf)
                torch.maximum(m[:, i0:i1], s.amax(-1), out=m[:, i0:i1])
    if late_scale:
        seqs = [m * scale for m in seqs]
    if spec.is_varlen:
        return torch.cat(seqs, dim=1)
    return torch.stack(seqs, dim=0)


def _run_pieces(call: _Call, query, value, want_stats: bool):
    """Run every piece; return (out in the user's layout, lse, row max), stats None unless wanted."""
    if len(call.pieces) == 1 and call.pieces[0].rows is None:
        piece = call.pieces[0]
        out, lse = flash_attention(piece.q, piece.k, piece.v, return_lse=True, **piece.kwargs)
        rmax = _row_max(piece) if want_stats else None
        return out, lse, rmax
    # TND, one padded call per sequence: stitch rows back together.
    total = query.shape[0]
    heads = call.heads
    outs, lses, maxes = [], [], []
    for piece in call.pieces:
        lq = piece.rows[1] - piece.rows[0]
        if piece.empty_keys:
            outs.append(query.new_zeros(lq, heads, value.shape[2]))
            lses.append(torch.full((heads, lq), -math.inf, dtype=torch.float32, device=query.device))
            maxes.append(lses[-1])
            continue
        o, l = flash_attention(piece.q, piece.k, piece.v, return_lse=True, **piece.kwargs)
        outs.append(o[0])
        lses.append(l[0])
        if want_stats:
            maxes.append(_row_max(piece)[0])
    if not outs:
        return query.new_zeros(total, heads, value.shape[2]), query.new_zeros(heads, total, dtype=torch.float32), None
    out, lse = torch.cat(outs, 0), torch.cat(lses, 1)
    return out, lse, (torch.cat(maxes, 1) if want_stats else None)


def _stats(lse, rmax, layout):
    """softmax_max/softmax_sum in torch_npu's shapes: (B, N, Sq, 8), or (T, N, 8) for TND."""
    lse = lse.detach().float()
    rmax = rmax.float()
    empty = torch.isneginf(rmax)
    total = torch.where(empty, torch.zeros_like(lse), torch.exp(lse - torch.where(empty, torch.zeros_like(rmax), rmax)))
    if layout == "TND":
        rmax, total = rmax.transpose(0, 1), total.transpose(0, 1)
    expand = lambda t: t.unsqueeze(-1).expand(*t.shape, 8).contiguous()  # noqa: E731
    return expand(rmax), expand(total)


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False):
    """torch_npu's FlashAttentionScore on tileattn. Returns the 7-tuple
    ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``.

    ``softmax_out`` is an empty tensor (reserved in torch_npu too). ``gen_mask_parallel`` and ``sync``
    are scheduling hints and have no effect; ``inner_precise`` has none either (rows that see no key
    always give zeros). Gradients flow through autograd into query, key, value and pse.
    """
    fn = "npu_fusion_attention"
    seed = int(torch.randint(0, 2**62, (1,)).item()) if isinstance(keep_prob, numbers.Real) and keep_prob < 1 else 0
    call = _plan(fn, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale, keep_prob,
                 pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
                 seed)
    out, lse, rmax = _run_pieces(call, query, value, want_stats=True)
    softmax_max, softmax_sum = _stats(lse, rmax, call.layout)
    softmax_out = query.new_empty((0,))
    return out, softmax_max, softmax_sum, softmax_out, seed, 0, call.numels


def _piece_backward(piece: _Piece, out, lse, dy):
    """tileattn's backward for one piece, given its output and LSE: (dq, dk, dv, dbias or None)."""
    kwargs = dict(piece.kwargs)
    if kwargs.get("bias") is not None:
        # dpse is always returned: ask for the bias gradient (attention_backward computes it for a
        # bias that requires grad).
        kwargs["bias"] = kwargs["bias"].detach().requires_grad_()
    grads = tileattn_backward(dy, piece.q, piece.k, piece.v, out, lse, **kwargs)
    return grads.dq, grads.dk, grads.dv, grads.dbias


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=2147483647,
                              next_tockens=2147483647, inner_precise=0, seed=0, offset=0, numels=0, prefix=None,
                              actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                              sync=False):
    """Gradients ``(dq, dk, dv, dpse)`` of :func:`npu_fusion_attention` for the output gradient ``dy``.

    Like torch_npu, the backward uses the statistics it is given: ``P = exp(s - LSE)`` with
    ``LSE = softmax_max + log(softmax_sum)`` and ``D = rowsum(dy * attention_in)``. Passing the
    merged statistics and output of a larger attention (ring / context-parallel attention over key
    chunks) therefore gives that attention's gradients restricted to these keys. Without
    ``attention_in``/``softmax_max``/``softmax_sum`` the forward is recomputed first. ``seed`` must
    be the one the forward returned when ``keep_prob < 1``. ``dpse`` is None when ``pse`` is None.
    """
    fn = "npu_fusion_attention_grad"
    if not isinstance(dy, torch.Tensor):
        _fail(fn, "dy", type(dy).__name__, "the gradient of attention_out, a tensor", TypeError)
    if not _is_int(seed):
        _fail(fn, "seed", repr(seed), "the int seed returned by npu_fusion_attention", TypeError)
    call = _plan(fn, query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale_value,
                 keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen,
                 sparse_mode, int(seed))
    out_shape = (user_shape(input_layout, call.batch, head_num, call.seqlen_q, call.head_dim_v)
                 if input_layout != "TND" else (query.shape[0], head_num, call.head_dim_v))
    if tuple(dy.shape) != tuple(out_shape):
        _fail(fn, "dy", f"shape {tuple(dy.shape)}", f"{tuple(out_shape)}, the shape of attention_out")
    stat_shape = ((query.shape[0], head_num, 8) if input_layout == "TND"
                  else (call.batch, head_num, call.seqlen_q, 8))
    for name, t in (("softmax_max", softmax_max), ("softmax_sum", softmax_sum)):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != stat_shape):
            _fail(fn, name, f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__,
                  f"shape {stat_shape}, as returned by npu_fusion_attention")
    if attention_in is not None and (not isinstance(attention_in, torch.Tensor) or attention_in.shape != dy.shape):
        _fail(fn, "attention_in", getattr(attention_in, "shape", type(attention_in).__name__), "the shape of dy")
    with torch.no_grad():
        if attention_in is None or softmax_max is None or softmax_sum is None:
            out, lse, _ = _run_pieces(call, query, value, want_stats=False)
        else:
            out = attention_in
            lse = softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())
            if input_layout == "TND":
                lse = lse.transpose(0, 1)
        dy = dy.to(query.dtype)
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        dpse = torch.zeros_like(pse) if isinstance(pse, torch.Tensor) else None
        for piece in call.pieces:
            if piece.empty_keys:
                continue
            if piece.rows is None:
                grads = _piece_backward(piece, out, lse, dy)
                dq.copy_(grads[0])
            else:
                q0, q1 = piece.rows
                grads = [g[0] if g is not None else None for g in _piece_backward(
                    piece, out[q0:q1].unsqueeze(0), lse[:, q0:q1].unsqueeze(0), dy[q0:q1].unsqueeze(0))]
                dq[q0:q1] = grads[0]
            axis, start, length = piece.key_region
            dk.narrow(axis, start, length).copy_(grads[1])
            dv.narrow(axis, start, length).copy_(grads[2])
            if dpse is not None:
                # bias = scale * pse (pse enters before scaling), cut to the keys the piece reads
                dpse[..., :length].copy_(float(scale_value) * grads[3])
    return dq, dk, dv, dpse
