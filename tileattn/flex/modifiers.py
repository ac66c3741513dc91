"""``score_mod=`` and ``mask_mod=`` on :func:`tileattn.flash_attention`: two modifier types, and the
route that runs a call holding them.

:class:`ScoreMod` and :class:`MaskMod` are modifiers like Softcap or Mask (they register themselves,
parse their keyword, validate themselves against the call and apply themselves in the reference
through the hooks), with FlexAttention's functions: ``score_mod(score, b, h, q_idx, kv_idx)`` after
softcap, ALiBi and bias, and ``mask_mod(b, h, q_idx, kv_idx)`` beside causal/window and ``mask``. No
kernel engine declares them (capabilities are closed: an engine named with ``backend=`` refuses the
call, naming them). ``backend="auto"`` runs such a call as one :func:`tileattn.flex_attention` call
(:func:`run`): the built-in modifiers are composed into one score_mod and one mask_mod (whose block
mask is built per call), compiled like any other, so gradients reach q, k, v, a bias and the tensors
the functions capture.

Not supported with them (a clear error): layout "TND", paged or ragged caches, dropout, sinks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Mapping

import torch

from ..core.modifiers import Alibi, Band, Bias, Mask, Modifier, Softcap, diagonal_offset, fail
from ..core.score_math import to_4d
from .attention import flex_attention
from .blocks import _Evaluator, create_block_mask
from .semantics import mask_tile, score_tile
from .trace import INDEX_DTYPE

def _index(block, heads_q):
    """(b, h, q) per row and kv per column of a reference ScoreBlock, int32, rows = heads x rows."""
    heads = block.head_indices(heads_q).to(INDEX_DTYPE)
    rows, cols = block.rows.to(INDEX_DTYPE), block.cols.to(INDEX_DTYPE)
    n = len(heads) * len(rows)
    b = torch.full((n,), block.batch, dtype=INDEX_DTYPE, device=rows.device)
    return b, heads.repeat_interleave(len(rows)), rows.repeat(len(heads)), cols


def _check_callable(name, fn):
    if not callable(fn):
        fail(TypeError, name, type(fn).__name__, f"a function {name}(" +
             ("score, " if name == "score_mod" else "") + "b, h, q_idx, kv_idx)")


@dataclass(frozen=True)
class ScoreMod(Modifier):
    """FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, after softcap, ALiBi, bias."""

    kind: ClassVar[str] = "score_mod"
    stage: ClassVar[int] = 2  # with Bias, registered after it: applied after it
    keywords: ClassVar[Mapping[str, object]] = {"score_mod": None}
    routed_to_flex: ClassVar[bool] = True
    fn: object = field(metadata={"op": "callable"})
    heads_q: int = field(default=0, metadata={"op": "int"})  #: set by check(): the reference hooks index heads

    @classmethod
    def from_args(cls, score_mod):
        if score_mod is None:
            return None
        _check_callable("score_mod", score_mod)
        return cls(score_mod)

    def check(self, spec):
        _check_callable("score_mod", self.fn)
        _check_route(spec)
        object.__setattr__(self, "heads_q", spec.heads_q)

    def plan_key(self):
        return None  # a function is no plan key

    def run_call(self, spec, return_lse):
        return run(spec, return_lse)

    def scores(self, s, block):
        b, h, q, kv = _index(block, self.heads_q)
        flat = s.expand(len(h) // len(block.rows), len(block.rows), len(kv)).reshape(len(h), len(kv))
        return score_tile(self.fn, flat, b, h, q, kv).reshape(-1, len(block.rows), len(kv))


@dataclass(frozen=True)
class MaskMod(Modifier):
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = take part), beside the other masks."""

    kind: ClassVar[str] = "mask_mod"
    stage: ClassVar[int] = 4
    masks: ClassVar[bool] = True
    keywords: ClassVar[Mapping[str, object]] = {"mask_mod": None}
    routed_to_flex: ClassVar[bool] = True
    fn: object = field(metadata={"op": "callable"})
    heads_q: int = field(default=0, metadata={"op": "int"})  #: set by check(): the reference hooks index heads

    @classmethod
    def from_args(cls, mask_mod):
        if mask_mod is None:
            return None
        _check_callable("mask_mod", mask_mod)
        return cls(mask_mod)

    def check(self, spec):
        _check_callable("mask_mod", self.fn)
        _check_route(spec)
        object.__setattr__(self, "heads_q", spec.heads_q)

    def plan_key(self):
        return None

    def run_call(self, spec, return_lse):
        return run(spec, return_lse)

    def visible(self, block):
        b, h, q, kv = _index(block, self.heads_q)
        return mask_tile(self.fn, b, h, q, kv).reshape(-1, len(block.rows), len(kv))


FLEX_TYPES = (ScoreMod, MaskMod)
#: the built-in modifiers :func:`run` composes with them
COMPOSED = (Softcap, Alibi, Bias, Band, Mask)


def _check_route(spec):
    if spec.is_varlen or spec.is_paged or spec.seqused_k is not None:
        fail(NotImplementedError, "score_mod/mask_mod", "a varlen, paged or ragged (seqused_k) call",
             "padded q/k/v (layouts BNSD, BSND, BSH, SBH): not supported with score_mod/mask_mod")
    for m in spec.modifiers:
        if not isinstance(m, FLEX_TYPES + COMPOSED):
            fail(NotImplementedError, "score_mod/mask_mod", f"together with {m.kind}",
                 "softcap, alibi_slopes, bias, causal, window and mask (the others are not supported with them)")


def holds_flex(modifiers) -> bool:
    return any(isinstance(m, FLEX_TYPES) for m in modifiers)


def _composed_score_mod(spec):
    """One score_mod doing softcap -> ALiBi -> bias -> the user's score_mod, or None."""
    steps = []
    offset = diagonal_offset(spec.align, spec.seqlen_q, spec.seqlen_k)
    for m in spec.modifiers:
        if isinstance(m, Softcap):
            steps.append(_softcap(m.cap))
        elif isinstance(m, Alibi):
            steps.append(_alibi(m.slopes if m.slopes.dim() == 2 else m.slopes[None], offset))
        elif isinstance(m, Bias):
            steps.append(_bias(to_4d(m.tensor)))
        elif isinstance(m, ScoreMod):
            steps.append(m.fn)
    if not steps:
        return None
    if len(steps) == 1:
        return steps[0]

    def composed(score, b, h, q_idx, kv_idx):
        for step in steps:
            score = step(score, b, h, q_idx, kv_idx)
        return score
    return composed


def _softcap(cap):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    return softcap


def _alibi(slopes, offset):
    per_batch = slopes.shape[0] > 1

    def alibi(score, b, h, q_idx, kv_idx):
        slope = slopes[b if per_batch else 0, h].to(score.dtype)
        return score - slope * torch.abs(q_idx + offset - kv_idx).to(score.dtype)
    return alibi


def _bias(bias):
    dims = [size > 1 for size in bias.shape]

    def add_bias(score, b, h, q_idx, kv_idx):
        picked = [i if keep else 0 for i, keep in zip((b, h, q_idx, kv_idx), dims)]
        return score + bias[picked[0], picked[1], picked[2], picked[3]].to(score.dtype)
    return add_bias


def _composed_mask_mod(spec):
    """One mask_mod doing causal/window and mask and the user's mask_mod, or None."""
    parts = []
    offset = diagonal_offset(spec.align, spec.seqlen_q, spec.seqlen_k)
    for m in spec.modifiers:
        if isinstance(m, Band):
            parts.append(_band(m.left, m.right, offset))
        elif isinstance(m, Mask):
            parts.append(_dense_mask(to_4d(m.tensor)))
        elif isinstance(m, MaskMod):
            parts.append(m.fn)
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]

    def composed(b, h, q_idx, kv_idx):
        keep = parts[0](b, h, q_idx, kv_idx)
        for part in parts[1:]:
            keep = keep & part(b, h, q_idx, kv_idx)
        return keep
    return composed


def _band(left, right, offset):
    def band(b, h, q_idx, kv_idx):  # Band.from_args never makes a band with both sides unbounded
        rel = kv_idx - q_idx - offset
        if left is None:
            return rel <= right
        if right is None:
            return rel >= -left
        return (rel >= -left) & (rel <= right)
    return band


def _dense_mask(mask):
    dims = [size > 1 for size in mask.shape]

    def dense(b, h, q_idx, kv_idx):
        picked = [i if keep else 0 for i, keep in zip((b, h, q_idx, kv_idx), dims)]
        return mask[picked[0], picked[1], picked[2], picked[3]]
    return dense


def _from_canonical(out, layout):
    if layout == "BNSD":
        return out
    if layout == "BSND":
        return out.transpose(1, 2)
    if layout == "BSH":
        return out.transpose(1, 2).flatten(2)
    return out.permute(2, 0, 1, 3).flatten(2)  # SBH


def run(spec, return_lse: bool):
    """A validated call holding ScoreMod/MaskMod, as one :func:`tileattn.flex_attention` call."""

    score_mod, mask_mod = _composed_score_mod(spec), _composed_mask_mod(spec)
    block_mask = None
    if mask_mod is not None:
        reads = _Evaluator(mask_mod, True).reads()
        block_mask = create_block_mask(mask_mod, spec.batch if "b" in reads else None,
                                       spec.heads_q if "h" in reads else None, spec.seqlen_q, spec.seqlen_k)
    out, lse = flex_attention(spec.q_c, spec.k_c, spec.v_c, score_mod=score_mod, block_mask=block_mask,
                              scale=spec.scale, enable_gqa=spec.heads_q != spec.heads_kv, return_lse=True)
    out = _from_canonical(out, spec.layout)
    return (out, lse) if return_lse else out
