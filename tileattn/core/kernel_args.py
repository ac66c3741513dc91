"""Kernel arguments: the one record the native, Triton and PyTorch-ops engines read of a call's
modifiers (besides its tensors and shapes).

Each modifier lowers itself (:meth:`tileattn.core.modifiers.Modifier.lower`) once per plan into the
static fields below, and binds its tensors and per-call values (:meth:`~tileattn.core.modifiers.Modifier.bind`)
on each call. The static record holds no tensor, so a remembered plan can keep it (and the lean
call, :mod:`tileattn.core.lean`, a kernel call prepared from it); :meth:`KernelArgs.bound` gives a call's
copy with its tensors. No engine reads a modifier: a new modifier that lowers into these fields runs
on every engine that declares it, and one that needs new fields adds them here and to the kernels
that read them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, FrozenSet, Iterable, Optional

import torch

from . import plans
from .modifiers import Band, Modifier, fail
from .score_math import dropout_threshold

#: The fields a modifier binds per call (a tensor or a per-call value), never kept by a plan.
PER_CALL_FIELDS = ("alibi_slopes", "mask", "bias", "seed", "k_scale", "k_offset", "v_scale", "v_offset", "q_scale",
                   "score_mod", "mask_mod", "block_states")


@dataclass(frozen=True)
class KernelArgs:
    """The lowered modifiers of a call, plus its scale and alignment.

    Static: ``scale``; ``bottom_right`` and ``shift`` (query row ``i`` of a sequence is aligned with
    key ``i + off``, ``off = shift + (k_len - q_len if bottom_right else 0)``); the band sides
    ``left``/``right`` (-1: unbounded); ``softcap`` (0: none); ``dropout_p`` (0: none); and
    ``per_call``, the per-call fields this call binds. Per call: ``alibi_slopes`` fp32 (Hq,) or
    (B, Hq); ``mask`` (bool) and ``bias`` (float), 4-d with size-1 dims where they broadcast against
    (B, Hq, Sq, Sk); the dropout ``seed``; the scales and offsets of a quantised cache and ``q_scale``
    (:mod:`tileattn.core.kvquant`, in the shapes the caller gave); the user's ``score_mod`` and
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
    alibi_slopes: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    seed: int = 0
    k_scale: Optional[torch.Tensor] = None
    k_offset: Optional[torch.Tensor] = None
    v_scale: Optional[torch.Tensor] = None
    v_offset: Optional[torch.Tensor] = None
    q_scale: Optional[torch.Tensor] = None
    score_mod: Optional[object] = None
    mask_mod: Optional[object] = None
    block_states: Optional[object] = None

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
        return {name: self.__dict__[name] for name in _defaults(type(self))[0]}

    def is_set(self, name: str) -> bool:
        """Whether field ``name`` differs from its default (a modifier set it)."""
        value, default = self.__dict__[name], _defaults(type(self))[1][name]
        return value is not None if default is None else value != default

    def bound(self, modifiers: Iterable[Modifier]) -> "KernelArgs":
        """This static record with the tensors and per-call values of ``modifiers`` (the same types
        it was lowered from). The static record itself when the call binds nothing."""
        if not self.per_call:
            return self
        values: Dict[str, object] = {}
        for m in modifiers:
            if m.binds:
                values.update(m.bind())
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update(values)
        return copy

    def static(self) -> "KernelArgs":
        """The record without its per-call values (what a plan keeps)."""
        if not self.per_call:
            return self
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        copy.__dict__.update({f.name: f.default for f in fields(KernelArgs) if f.name in PER_CALL_FIELDS})
        return copy


_STATIC_FIELDS = frozenset(f.name for f in fields(KernelArgs)) - set(PER_CALL_FIELDS) - {"scale", "bottom_right",
                                                                                          "shift", "per_call"}
_DEFAULTS: Dict[type, tuple] = {}


def _defaults(cls) -> tuple:
    """(the static number fields of a record class, in order; each field's default), made once."""
    known = _DEFAULTS.get(cls)
    if known is None:
        every = fields(cls)
        known = _DEFAULTS[cls] = (tuple(f.name for f in every if f.name not in PER_CALL_FIELDS and f.name != "per_call"),
                                  {f.name: f.default for f in every})
    return known


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
