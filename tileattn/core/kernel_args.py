"""Kernel arguments: the one record the native, Triton and PyTorch-ops engines read of a call's
modifiers (besides its tensors and shapes).

Each modifier lowers itself (:meth:`tileattn.core.modifiers.Modifier.lower`) once per plan into the
static fields below, and binds its tensors and per-call values (:meth:`~tileattn.core.modifiers.Modifier.bind`)
on each call. The static record holds no tensor, so a remembered plan can keep it (and the lean
call, :mod:`tileattn.core.lean`, a kernel call prepared from it); :meth:`KernelArgs.bound` gives a call's
copy with its tensors. No engine reads a modifier: a new modifier that lowers into these fields runs
on every engine that declares it, and one that needs new fields adds them here and to the kernels
that read them.

Each per-call field says, in its metadata (:func:`per_call_field`), which section of the native kernels'
argument record (``csrc/ta.h``) takes it, and a tensor the canonical axes it runs along. That is the
one place a tensor's way into the kernels is declared: the native engine fills each section from
these fields by name, and Triton's launcher takes its group of modifier tensors by name too.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, FrozenSet, Iterable, NamedTuple, Optional, Tuple

import torch

from . import plans
from .modifiers import Band, Modifier, fail
from .score_math import dropout_threshold

#: The canonical axes of a call's scores, in the order of :meth:`KernelArgs.broadcast_strides`.
SCORE_AXES = "bhqk"


def per_call_field(section: str, axes: str = "", default=None):
    """A per-call field: one a modifier binds on each call (a tensor or a per-call value), never kept by
    a plan. ``section``: the section of the native kernels' record (``csrc/ta.h``) that takes it
    ("core": a number of the core section by its name; "user": the user record of compiled
    functions; otherwise the tensor's own section, whose pointer is the core field named after the
    section). ``axes``: a tensor's dims as letters of :data:`SCORE_AXES`, which its dims are
    right-aligned to (``"bh"``: (heads,) or (batch, heads); ``"bhqk"``: 4-d, broadcast where of
    size 1); none for the tensors whose section lays them out itself (a quantised cache's scales)."""
    return field(default=default, metadata={"section": section, "axes": axes})


@dataclass(frozen=True)
class KernelArgs:
    """The lowered modifiers of a call, plus its scale and alignment.

    Static: ``scale``; ``bottom_right`` and ``shift`` (query row ``i`` of a sequence is aligned with
    key ``i + off``, ``off = shift + (k_len - q_len if bottom_right else 0)``); the band sides
    ``left``/``right`` (-1: unbounded); ``softcap`` (0: none); ``dropout_p`` (0: none); and
    ``per_call``, the per-call fields this call binds. Per call: ``alibi_slopes`` fp32 (Hq,) or
    (B, Hq); ``mask`` (bool) and ``bias`` (float), 4-d with size-1 dims where they broadcast against
    (B, Hq, Sq, Sk); the dropout ``seed``; the scales and offsets of a quantised cache and ``q_scale``
    (:mod:`tileattn.core.kvquant`, in the shapes the caller gave) and the name of its format
    (``kv_format``, :mod:`tileattn.core.kvformat`; None: its dtype's default); the user's ``score_mod`` and
    ``mask_mod`` (:class:`tileattn.core.functions.UserFunction`: compiled and bound to this call's
    captures, or the reason not) and a block mask's ``block_states``
    (:class:`tileattn.programs.blocks.BlockStates`).
    """

    scale: float
    bottom_right: bool = True
    shift: int = 0
    left: int = -1
    right: int = -1
    softcap: float = 0.0
    dropout_p: float = 0.0
    per_call: FrozenSet[str] = frozenset()
    alibi_slopes: Optional[torch.Tensor] = per_call_field("alibi", "bh")
    mask: Optional[torch.Tensor] = per_call_field("mask", SCORE_AXES)
    bias: Optional[torch.Tensor] = per_call_field("bias", SCORE_AXES)
    seed: int = per_call_field("core", default=0)
    k_scale: Optional[torch.Tensor] = per_call_field("quant")
    k_offset: Optional[torch.Tensor] = per_call_field("quant")
    v_scale: Optional[torch.Tensor] = per_call_field("quant")
    v_offset: Optional[torch.Tensor] = per_call_field("quant")
    q_scale: Optional[torch.Tensor] = per_call_field("quant")
    kv_format: Optional[str] = per_call_field("quant")
    score_mod: Optional[object] = per_call_field("user")
    mask_mod: Optional[object] = per_call_field("user")
    block_states: Optional[object] = per_call_field("user")

    @property
    def band(self) -> Optional[Band]:
        """The band's geometry (key ranges, tile states, diagonals), or None when unbounded."""
        if self.left < 0 and self.right < 0:
            return None
        return Band(None if self.left < 0 else self.left, None if self.right < 0 else self.right)

    @property
    def causal(self) -> bool:
        return self.right == 0

    @property
    def plain(self) -> bool:
        """No score transform between the GEMM and the softmax (softcap, ALiBi, bias, score_mod)."""
        return (self.softcap == 0 and "alibi_slopes" not in self.per_call and "bias" not in self.per_call
                and "score_mod" not in self.per_call)

    @property
    def dropout_threshold(self) -> int:
        """A weight survives when the top 24 bits of its hash are >= this."""
        return dropout_threshold(self.dropout_p)

    def numbers(self) -> Dict[str, object]:
        """The static fields that are numbers (the scale, the alignment, the band sides, the softcap, the
        dropout rate, and any field added here), by name: what the engines pass on to their kernels as
        they are (the native record's fields of these names, Triton's ``Scalars``)."""
        return {name: self.__dict__[name] for name in _layout(type(self)).numbers}

    def is_set(self, name: str) -> bool:
        """Whether field ``name`` differs from its default (a modifier set it)."""
        value, default = self.__dict__[name], _layout(type(self)).defaults[name]
        return value is not None if default is None else value != default

    def broadcast_strides(self, name: str) -> Tuple[int, int, int, int]:
        """The strides of tensor field ``name`` along (batch, head, query, key) (:func:`broadcast_strides`
        with the field's axes, :func:`per_call_field`)."""
        return broadcast_strides(self.__dict__[name], _layout(type(self)).axes[name])

    def replaced(self, values: Dict[str, object]) -> "KernelArgs":
        """A copy with ``values`` (field: value) in place of its own, unchecked: :meth:`bound`'s way,
        for an engine that reads a per-call tensor in another order than the caller gave it."""
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(values)
        return copy

    def bound(self, modifiers: Iterable[Modifier]) -> "KernelArgs":
        """This static record with the tensors and per-call values of ``modifiers`` (the same types
        it was lowered from). The static record itself when the call binds nothing."""
        if not self.per_call:
            return self
        values: Dict[str, object] = {}
        for m in modifiers:
            if m.binds:
                values.update(m.bind())
        return self.replaced(values)

    def static(self) -> "KernelArgs":
        """The record without its per-call values (what a plan keeps)."""
        if not self.per_call:
            return self
        layout = _layout(type(self))
        return self.replaced({name: layout.defaults[name] for name in layout.sections})


def broadcast_strides(t: torch.Tensor, axes: str) -> Tuple[int, int, int, int]:
    """The strides of ``t`` along (batch, head, query, key): its dims right-aligned to ``axes`` (letters
    of :data:`SCORE_AXES`, a prefix of them), 0 where it broadcasts (a dim of size 1, or one it does
    not have)."""
    shape, strides = t.shape, t.stride()
    first = len(axes) - len(shape)
    out = [0, 0, 0, 0]
    for d, n in enumerate(shape):
        if n != 1:
            out[first + d] = strides[d]
    return out[0], out[1], out[2], out[3]


class _Layout(NamedTuple):
    """What the engines read of a record class's fields, made once per class (a subclass may add
    fields: tests/test_kernel_field.py): its static numbers in order, each field's default, the
    section of each per-call field and the axes of each tensor that has them (:func:`per_call_field`)."""

    numbers: Tuple[str, ...]
    defaults: Dict[str, object]
    sections: Dict[str, str]
    axes: Dict[str, str]


_LAYOUTS: Dict[type, _Layout] = {}


def _layout(cls) -> _Layout:
    known = _LAYOUTS.get(cls)
    if known is None:
        every = fields(cls)
        sections = {f.name: f.metadata["section"] for f in every if "section" in f.metadata}
        known = _LAYOUTS[cls] = _Layout(
            tuple(f.name for f in every if f.name not in sections and f.name != "per_call"),
            {f.name: f.default for f in every}, sections,
            {f.name: f.metadata["axes"] for f in every if f.metadata.get("axes")})
    return known


def sections(cls=KernelArgs) -> Dict[str, str]:
    """Each per-call field of a record class and the section of the native kernels' record it fills."""
    return _layout(cls).sections


#: The fields a modifier binds per call (a tensor or a per-call value), never kept by a plan.
PER_CALL_FIELDS = tuple(sections())
_STATIC_FIELDS = frozenset(f.name for f in fields(KernelArgs)) - set(PER_CALL_FIELDS) - {"scale", "bottom_right",
                                                                                          "shift", "per_call"}


def lower(modifiers: Iterable[Modifier], scale: float, align) -> KernelArgs:
    """The static kernel arguments of a call's modifiers (those the engines apply, not the ones
    applied above them). Two modifiers may not set the same field. Remembered by the modifiers'
    plan keys: the calls of a growing KV cache (a new shape, so no plan, every step) lower once."""
    modifiers = tuple(modifiers)
    keys = tuple(m.plan_key() for m in modifiers)
    key = None if None in keys else (KIND, keys, type(scale), scale, type(align), align)
    known = plans.get(key) if key is not None else None
    if known is not None:
        return known
    lowered = _lower(modifiers, scale, align)
    if key is not None:
        plans.put(key, lowered)
    return lowered


#: this module's kind of entry in :mod:`tileattn.core.plans`: static kernel arguments by the plan
#: keys of their modifiers, scale and alignment (values only)
KIND = "lowered"


def _lower(modifiers, scale, align) -> KernelArgs:
    values: Dict[str, object] = {}
    owner: Dict[str, Modifier] = {}
    per_call = set()
    for m in modifiers:
        if m.applied_by_op:
            continue
        static = m.lower()
        for name in list(static) + list(m.binds):
            if name not in _STATIC_FIELDS and name not in PER_CALL_FIELDS:
                raise TypeError(f"tileattn: the {m.kind} modifier lowers into {name!r}, which is not a kernel "
                                f"argument ({', '.join(sorted(_STATIC_FIELDS | set(PER_CALL_FIELDS)))})")
            if name in owner:
                fail(ValueError, "modifiers", f"{owner[name].kind} and {m.kind}, which both set the kernel argument "
                     f"{name!r}", "modifiers that lower into different kernel arguments")
            owner[name] = m
        values.update(static)
        per_call.update(m.binds)
    return KernelArgs(scale=scale, bottom_right=align == "bottom_right", shift=align if isinstance(align, int) else 0,
                      per_call=frozenset(per_call), **values)
