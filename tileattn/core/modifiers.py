"""Attention modifiers: one small frozen object per variant of the score pipeline.

    s = scale * q.k^T -> Softcap -> + Alibi + Bias -> Band and Mask -> softmax (+ Sinks) -> Dropout -> . v

Modifiers in. :func:`modifiers_from_keywords` is the one place the variant keywords of the public API
(``causal``, ``window``, ``mask``, ``bias``, ``alibi_slopes``, ``softcap``, ``dropout_p``/``seed``/
``generator``, ``sinks``) become modifier objects: each modifier type declares the keywords it reads
(:attr:`Modifier.keywords`) and parses them (:meth:`Modifier.from_args`). Code that already holds
modifier objects (context parallelism, a user's own modifier type) passes them as they are
(``modifiers=``).

The protocol. A modifier type is a frozen dataclass deriving from :class:`Modifier`; defining it
registers it (by :attr:`~Modifier.kind`). It implements, besides what it is:

* validation: ``from_args`` (its keywords, on their own) and :meth:`~Modifier.check` (against the
  call: shapes, devices), both raising before any compute;
* identity: :meth:`~Modifier.plan_key`, a value-like key (type, non-tensor fields, tensor metadata)
  the plan memo keys calls on, so that a remembered call shape holds no tensor;
* kernel arguments out: :meth:`~Modifier.lower` (once per plan: the static fields of
  :class:`tileattn.core.kernel_args.KernelArgs` it sets) and :meth:`~Modifier.bind` (per call: its
  tensors and per-call values); engines read that record and never the modifier;
* the exact reference, through the hooks below, applied in stage order: :meth:`~Modifier.scores`
  (and :meth:`~Modifier.scores_grad`), :meth:`~Modifier.visible`, :meth:`~Modifier.weights` (and
  :meth:`~Modifier.weights_grad`), :meth:`~Modifier.extra_logits` (merged into the result);
* context parallelism (:mod:`tileattn.distributed`): how it is sharded
  (:attr:`~Modifier.context_parallel`, :meth:`~Modifier.for_heads`, :meth:`~Modifier.check_shards`)
  and what every rank must pass alike (:meth:`~Modifier.agreement`, :meth:`~Modifier.as_keywords`).

Engines declare the modifier *types* they apply (:class:`tileattn.core.dispatch.Capabilities`); a type an
engine does not list is refused by it with a reason, never ignored. Adding a modifier is one class
plus the kernels that implement it (or a lowering into kernel arguments that already exist).

Positions. Every modifier that depends on where a score sits (band, ALiBi) reads one number per
sequence, its *diagonal offset* ``off``: query row ``i`` is aligned with key column ``i + off``.
``align="bottom_right"`` (FlashAttention-2, the default) gives ``off = k_len - q_len``;
``align="top_left"`` (SDPA's ``is_causal``) gives ``off = 0``; an int gives that offset to every
sequence (a key shard inside a longer sequence, as context parallelism needs).

Flattening. A modifier crosses the ``torch.library`` op boundary as tensors, ints and floats; the
field metadata below (``OP_TENSOR``, ``OP_INT``, ``OP_OPT_INT``, ``OP_FLOAT``) says how, so
:func:`tileattn.core.ops.flatten` and :func:`~tileattn.core.ops.unflatten` serve every modifier and nothing
else counts argument slots.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
from dataclasses import dataclass, field, fields
from typing import ClassVar, Dict, Iterable, Mapping, Optional, Tuple

import torch

from .score_math import (  # noqa: F401  (TileState, combine, to_4d, ...: re-exported, the modifiers' vocabulary)
    ScoreBlock, TileState, accumulate_broadcast, alibi_scores, broadcastable, combine, diagonal_offset,
    dropout_keep, reduce_to_shape, score_block, to_4d,
)

OP_TENSOR = {"op": "tensor"}
OP_INT = {"op": "int"}
OP_OPT_INT = {"op": "opt_int"}  # None travels as -1 (window sides are never negative once validated)
OP_FLOAT = {"op": "float"}
OP_FORMAT = {"op": "format"}  # a KV format's name travels as its index in kvformat.FORMATS (None as -1)

#: Largest window side accepted: anything longer than any sequence is "unbounded" in effect, and the
#: value must survive int64 arithmetic in every engine.
MAX_WINDOW = 2**62


def fail(exc, arg: str, given, expected: str):
    raise exc(f"tileattn: argument '{arg}': got {given}; expected {expected}.")


def tensor_metadata(t: torch.Tensor) -> Optional[tuple]:
    """What a plan may remember of a tensor: everything validation reads, never the tensor (None for
    a tensor that is not plain and dense, which the full validation refuses or handles)."""
    if t.layout is not torch.strided or t.is_nested:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


#: Field names of each modifier type, for :meth:`Modifier.plan_key`.
_FIELD_NAMES: Dict[type, Tuple[str, ...]] = {}


def _check_per_head(name: str, t, spec, dtype_ok, kind: str, shapes: tuple, shown: str):
    """A tensor of one of ``shapes`` on q's device whose dtype ``dtype_ok`` accepts (``kind``: what it
    is, ``shown``: the shapes as a message names them)."""
    if not isinstance(t, torch.Tensor) or not dtype_ok(t):
        given = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        fail(TypeError, name, given, f"{kind} of shape {shown}")
    if tuple(t.shape) not in shapes:
        fail(ValueError, name, f"shape {tuple(t.shape)}", shown)
    if t.device != spec.device:
        fail(ValueError, name, f"device {t.device}", f"device {spec.device}, as q")


def _check_dense(name: str, t: torch.Tensor):
    if t.layout != torch.strided or getattr(t, "is_nested", False):
        fail(TypeError, name, f"a {t.layout} tensor" if t.layout != torch.strided else "a nested tensor",
             "a regular strided (dense) tensor")


# ---------------------------------------------------------------------------------------------
# The protocol.

_TYPES: Dict[str, type] = {}
_TABLE: list = [None]  # the keyword table (see _keyword_table), rebuilt when a type registers


class Modifier:
    """Base of the modifiers (see the module docstring for the protocol). Subclasses are frozen
    dataclasses with op metadata on their fields; a subclass that sets ``kind`` is registered."""

    #: Name in messages, capability reports and the op's configuration string.
    kind: ClassVar[str]
    #: Position in the pipeline (see the module docstring); modifiers are kept sorted by it.
    stage: ClassVar[int]
    #: Whether the modifier hides scores (and so classifies tiles).
    masks: ClassVar[bool] = False
    #: Whether a score depends on its position even where no modifier hides anything (ALiBi).
    positional: ClassVar[bool] = False
    #: The public keywords this type reads, with the values that mean "absent", in signature order.
    keywords: ClassVar[Mapping[str, object]] = {}
    #: The per-call fields of the kernel arguments that :meth:`bind` sets.
    binds: ClassVar[Tuple[str, ...]] = ()
    #: Where the gradients it owns go: the op argument of its one differentiable tensor ("bias",
    #: "sinks"), or "captures" (a score_mod's captured tensors, :attr:`tileattn.core.engine.Gradients.captures`).
    grad_slot: ClassVar[Optional[str]] = None
    #: Applied to every engine's (out, LSE) above the engines (sinks), so no engine declares it.
    applied_by_op: ClassVar[bool] = False
    #: Inference only (a quantised cache): engines refuse a backward pass of a call that has it.
    forward_only: ClassVar[bool] = False
    #: A user function (score_mod / mask_mod, :mod:`tileattn.core.functions`): its call takes the
    #: autograd function that returns the gradients of the tensors the function captures.
    user_function: ClassVar[bool] = False
    #: How context parallelism applies it to the shards of a sequence, or None when it cannot (such a
    #: call is refused, naming the modifier): "block" (every block call applies it as it is), "band"
    #: (placed per block by the blocks' positions), "keys" (a ``tensor`` over (local rows, global
    #: keys), cut to each block's rows and keys), "merge" (merged into the result once, after the walk).
    context_parallel: ClassVar[Optional[str]] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is None:
            return
        if kind in _TYPES and _TYPES[kind].__qualname__ != cls.__qualname__:
            raise TypeError(f"tileattn: modifier kind {kind!r} is already taken by {_TYPES[kind].__qualname__}")
        _TYPES[kind] = cls
        _TABLE[0] = _build_keyword_table()  # now, not on a call: a call that torch.compile traces mutates nothing

    @classmethod
    def from_args(cls, *values) -> Optional["Modifier"]:
        """The modifier of its keywords' values (in :attr:`keywords` order), or None when absent."""
        return None

    def check(self, spec) -> None:
        """Raise (naming the argument) when this modifier does not fit the call ``spec``."""

    def plan_key(self) -> Optional[tuple]:
        """Type, non-tensor fields (with their types: ``True`` is not ``1``) and tensor metadata:
        equal keys validate, dispatch and lower alike. None: a call no plan may serve."""
        known = self.__dict__.get("_plan_key")
        if known is not None:
            return known
        cls = type(self)
        names = _FIELD_NAMES.get(cls)
        if names is None:
            names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
        key, holds_tensors = [cls], False
        for name in names:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                holds_tensors = True
                value = tensor_metadata(value)
                if value is None:
                    return None
                key.append(value)
            else:
                key += (type(value), value)
        key = tuple(key)
        if not holds_tensors:  # a tensor's metadata may change (requires_grad_); values of a frozen object do not
            object.__setattr__(self, "_plan_key", key)
        return key

    def grad_tensor(self) -> Optional[torch.Tensor]:
        """The tensor the op differentiates (see :attr:`grad_slot`), or None."""
        return None

    def lower(self) -> Dict[str, object]:
        """The static kernel-argument fields this modifier sets (no tensors): asked once per plan.
        A type no engine declares need not lower itself."""
        raise NotImplementedError(f"tileattn: the {self.kind} modifier has no kernel lowering")

    def bind(self) -> Dict[str, object]:
        """This call's values of the :attr:`binds` fields (tensors, a dropout seed)."""
        return {}

    # The reference hooks (identity by default), applied in stage order.

    def scores(self, s: torch.Tensor, block: ScoreBlock) -> torch.Tensor:
        """The scores after this modifier (score transforms: softcap, ALiBi, bias)."""
        return s

    def scores_grad(self, ds: torch.Tensor, s_before: torch.Tensor, block: ScoreBlock,
                    tensor_grad: Optional[torch.Tensor]) -> torch.Tensor:
        """The gradient of the scores before this modifier (``s_before``) from that of the scores
        after it; accumulates its own tensor's gradient into ``tensor_grad`` when given."""
        return ds

    def visible(self, block: ScoreBlock) -> Optional[torch.Tensor]:
        """Bool, broadcastable to (heads, rows, cols): which pairs take part (masks), or None."""
        return None

    def weights(self, p: torch.Tensor, block: ScoreBlock, heads_q: int) -> torch.Tensor:
        """The attention weights after this modifier (dropout), from the softmax's."""
        return p

    def weights_grad(self, dp: torch.Tensor, block: ScoreBlock, heads_q: int) -> torch.Tensor:
        return dp

    def extra_logits(self, lse: torch.Tensor, heads_axis: int) -> Optional[torch.Tensor]:
        """The LSE of a partial result with output 0 that this modifier adds to every row (a sink's
        logit), broadcastable to ``lse`` (whose head axis is ``heads_axis``), or None. The caller
        merges it in with :func:`tileattn.core.merge.merge_weights`."""
        return None

    # Context parallelism.

    @classmethod
    def agreement(cls) -> Dict[str, str]:
        """How the ranks of a context-parallel call compare each of its keywords (see
        :mod:`tileattn.distributed.agreement`): "bool", "float", "tensor", "rows" (a tensor whose row
        dim, sharded like q, may differ between ranks) or "window"; by default, a "keys" modifier's
        tensors by their rows, other keywords by the type of their "absent" value."""
        if cls.context_parallel == "keys":
            return dict.fromkeys(cls.keywords, "rows")
        return {name: {float: "float", bool: "bool"}.get(type(absent), "tensor") for name, absent in cls.keywords.items()}

    def as_keywords(self) -> Dict[str, object]:
        """The values of its keywords that make this modifier (one per field, in order, by default)."""
        return {name: getattr(self, f.name) for name, f in zip(self.keywords, fields(self))}

    def for_heads(self, heads: slice) -> "Modifier":
        """This modifier for the query heads ``heads`` of the call alone (a Ulysses rank's share)."""
        return self

    def check_shards(self, varlen: bool) -> None:
        """Raise NotImplementedError (naming the argument) for what context parallelism cannot shard."""

    def keys_band(self) -> Optional["Band"]:
        """The band of keys this modifier limits every row to (a :class:`Band`: its geometry gives key
        ranges and flop counts), or None."""
        return None


def modifier_types() -> Tuple[type, ...]:
    """Every registered modifier type, in pipeline order."""
    return _keyword_table()[0]


def modifier_type(kind: str) -> type:
    return _TYPES[kind]


def variant_keywords() -> Dict[str, object]:
    """Every variant keyword of the registered modifier types with its "absent" value."""
    _, names, defaults, _, _, _, _ = _keyword_table()
    return dict(zip(names, defaults))


def _keyword_table():
    """(types in pipeline order, every variant keyword, their "absent" values and the types of
    those, a getter of all of them, the (type, first, last) keyword slice owning each keyword, the
    set of the keywords): a call reads its keywords with one getter and compares one tuple."""
    return _TABLE[0]


def _build_keyword_table():
    types = tuple(sorted(_TYPES.values(), key=lambda c: c.stage))
    names, defaults, slices = [], [], []
    for cls in types:
        if cls.keywords:
            slices.append((cls, len(names), len(names) + len(cls.keywords)))
            names += cls.keywords
            defaults += cls.keywords.values()
    getter = operator.itemgetter(*names) if names else (lambda values: ())
    if len(names) == 1:
        getter = (lambda get: lambda values: (get(values),))(getter)
    owner_of = tuple(piece for piece in slices for _ in range(piece[2] - piece[1]))
    return types, tuple(names), tuple(defaults), tuple(map(type, defaults)), getter, owner_of, frozenset(names)


def modifiers_from_keywords(values: Mapping[str, object], extra: Iterable = ()) -> Tuple[Modifier, ...]:
    """The modifiers of a call, in pipeline order: those of its variant keywords (``values`` may hold
    other names, which are not read; a missing keyword is absent) plus the modifier objects
    ``extra``. Checks what does not depend on the rest of the call; :meth:`Modifier.check` does the
    rest. A keyword is absent only when it is its "absent" value *of the same type* (``causal=0``
    is parsed, and refused, not taken for False)."""
    _, names, defaults, default_types, getter, owner_of, every = _keyword_table()
    if not values:
        given = defaults
    elif torch.compiler.is_compiling():  # dynamo does not trace itemgetter
        given = tuple(values.get(name, default) for name, default in zip(names, defaults))
    elif len(values) >= len(names) and values.keys() >= every:
        given = getter(values)  # a caller's locals(): every keyword there
    else:
        given = tuple(map(values.get, names, defaults))
    found = []
    if any(map(operator.is_not, given, defaults)):
        owners = []  # the slices of the keywords given a value other than their "absent" one
        for i in itertools.compress(range(len(given)), map(operator.is_not, given, defaults)):
            value = given[i]
            # the type first: a tensor or an array is never an absent value, and comparing one with
            # None costs a tensor 11 us and gives an array an ambiguous truth value
            if type(value) is not default_types[i] or value != defaults[i]:
                if not owners or owners[-1] != owner_of[i]:
                    owners.append(owner_of[i])
        for cls, first, last in owners:
            m = cls.from_args(*given[first:last])
            if m is not None:
                found.append(m)
    if not extra:
        return tuple(found)
    if not isinstance(extra, (list, tuple)):
        fail(TypeError, "modifiers", type(extra).__name__, "a list or tuple of tileattn.core.modifiers.Modifier objects")
    for m in extra:
        if not isinstance(m, Modifier) or not hasattr(type(m), "kind"):
            fail(TypeError, "modifiers", type(m).__name__, "tileattn.core.modifiers.Modifier objects")
        twin = next((other for other in found if type(other) is type(m)), None)
        if twin is not None:
            fail(ValueError, "modifiers", f"two {m.kind} modifiers ({twin!r} and {m!r})",
                 f"at most one {m.kind} modifier per call (from its keywords or as an object)")
        found.append(m)
    return tuple(sorted(found, key=lambda m: m.stage))


def check_keywords(given: Mapping[str, object], others: Iterable[str] = ()):
    """Raise TypeError for a keyword that is neither a variant keyword nor one of ``others``."""
    known = _keyword_table()[1]
    for name in given:
        if name not in known:
            allowed = sorted(set(known) | set(others))
            fail(TypeError, name, "an unexpected keyword", "one of " + ", ".join(allowed))


# ---------------------------------------------------------------------------------------------
# Score transforms: softcap, ALiBi, bias.


@dataclass(frozen=True)
class Softcap(Modifier):
    """``s -> cap * tanh(s / cap)`` on the scaled scores (Gemma 2, Grok)."""

    kind: ClassVar[str] = "softcap"
    stage: ClassVar[int] = 0
    keywords: ClassVar[Mapping[str, object]] = {"softcap": 0.0}
    cap: float = field(metadata=OP_FLOAT)

    @classmethod
    def from_args(cls, softcap) -> Optional["Softcap"]:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            fail(TypeError, "softcap", repr(softcap), "a float > 0 (or 0 to disable)")
        if not math.isfinite(softcap) or softcap < 0:
            fail(ValueError, "softcap", repr(softcap), "a finite float > 0 (or 0 to disable)")
        return cls(float(softcap)) if softcap > 0 else None

    def check(self, spec):
        if type(self.cap) is not float or not (math.isfinite(self.cap) and self.cap > 0):
            fail(ValueError, "softcap", repr(self.cap), "a finite float > 0")

    def lower(self):
        return {"softcap": self.cap}

    def apply(self, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(capped scores, tanh(s / cap)); the backward multiplies dS by ``1 - tanh**2``."""
        t = torch.tanh(s / self.cap)
        return self.cap * t, t

    def scores(self, s, block):
        return self.apply(s)[0]

    def scores_grad(self, ds, s_before, block, tensor_grad):
        t = torch.tanh(s_before / self.cap)
        return ds * (1 - t * t)

    context_parallel: ClassVar[Optional[str]] = "block"


@dataclass(frozen=True)
class Alibi(Modifier):
    """ALiBi: adds ``-slope[h] * |i + off - j|``; slopes fp32 (Hq,) or (B, Hq)."""

    kind: ClassVar[str] = "alibi"
    stage: ClassVar[int] = 1
    positional: ClassVar[bool] = True
    keywords: ClassVar[Mapping[str, object]] = {"alibi_slopes": None}
    binds: ClassVar[Tuple[str, ...]] = ("alibi_slopes",)
    slopes: torch.Tensor = field(metadata=OP_TENSOR)

    @classmethod
    def from_args(cls, slopes) -> Optional["Alibi"]:
        if slopes is None:
            return None
        return cls(slopes)

    def check(self, spec):
        batch, heads_q = spec.batch, spec.heads_q
        _check_per_head("alibi_slopes", self.slopes, spec, lambda t: t.dtype == torch.float32, "a float32 tensor",
                        ((heads_q,), (batch, heads_q)), f"({heads_q},) or ({batch}, {heads_q})")

    context_parallel: ClassVar[Optional[str]] = "block"

    def for_heads(self, heads):
        return Alibi(self.slopes[..., heads])

    def check_shards(self, varlen):
        if varlen and isinstance(self.slopes, torch.Tensor) and self.slopes.dim() == 2:
            fail(NotImplementedError, "alibi_slopes", f"shape {tuple(self.slopes.shape)} with layout='TND'",
                 "one slope per head, shape (Hq,): the varlen calls of a ring step regroup the sequences")

    def lower(self):
        return {}

    def bind(self):
        return {"alibi_slopes": self.slopes}

    def scores(self, s, block):
        return s + alibi_scores(self.slopes, block.batch, block.heads, block.rows, block.cols, block.offset, s.dtype)


class _ScoreShaped(Modifier):
    """A tensor broadcastable to the scores (B, Hq, Sq, Sk): a bias or a mask, read block by block."""

    tensor: torch.Tensor
    #: For a wrong dtype: the tensors this modifier accepts; for a varlen call: what to do instead.
    expected: ClassVar[str]
    instead: ClassVar[str]

    @classmethod
    def accepts(cls, t: torch.Tensor) -> bool:
        raise NotImplementedError

    @classmethod
    def from_args(cls, t):
        if t is None:
            return None
        return cls(t)

    def check(self, spec):
        t = self.tensor
        if not isinstance(t, torch.Tensor) or not self.accepts(t):
            given = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            fail(TypeError, self.kind, given, f"{self.expected} broadcastable to (B, Hq, Sq, Sk)")
        _check_dense(self.kind, t)
        # A paged cache is padded in the key dimension (capacity = max_blocks * block_size), so a mask
        # or bias over it is indexed by logical key position; packed sequences have no such dimension.
        if spec.is_varlen:
            fail(ValueError, self.kind, f"a {self.kind} with layout='TND'", self.instead)
        full = (spec.batch, spec.heads_q, spec.seqlen_q, spec.seqlen_k)
        if not broadcastable(t.shape, full):
            fail(ValueError, self.kind, f"shape {tuple(t.shape)}", f"a shape broadcastable to (B, Hq, Sq, Sk) = {full}")
        if t.device != spec.device:
            fail(ValueError, self.kind, f"device {t.device}", f"device {spec.device}, as q")

    @property
    def view4(self) -> torch.Tensor:
        return to_4d(self.tensor)

    context_parallel: ClassVar[Optional[str]] = "keys"

    def check_shards(self, varlen):
        if varlen:
            fail(NotImplementedError, self.kind, "a tensor with layout='TND'",
                 "None (as flash_attention: no bias or mask with varlen)")

    def lower(self):
        return {}

    def bind(self):
        return {self.kind: self.view4}

    def block(self, b, heads: slice, i0, i1, j0, j1) -> torch.Tensor:
        """Rows i0:i1, cols j0:j1 of batch item b, query heads ``heads``, broadcast dims kept at 1."""
        return score_block(self.view4, b, heads, i0, i1, j0, j1)


@dataclass(frozen=True)
class Bias(_ScoreShaped):
    """A float tensor added to the scores, broadcastable to (B, Hq, Sq, Sk); differentiable."""

    kind: ClassVar[str] = "bias"
    stage: ClassVar[int] = 2
    keywords: ClassVar[Mapping[str, object]] = {"bias": None}
    binds: ClassVar[Tuple[str, ...]] = ("bias",)
    grad_slot: ClassVar[Optional[str]] = "bias"
    expected: ClassVar[str] = "a floating tensor"
    instead: ClassVar[str] = "no bias (build the scores of each sequence separately)"
    tensor: torch.Tensor = field(metadata=OP_TENSOR)

    @classmethod
    def accepts(cls, t: torch.Tensor) -> bool:
        return t.is_floating_point()

    def grad_tensor(self):
        return self.tensor

    def scores(self, s, block):
        return s + self.block(block.batch, block.heads, block.i0, block.i1, block.j0, block.j1).to(s.dtype)

    def scores_grad(self, ds, s_before, block, tensor_grad):
        if tensor_grad is not None:
            accumulate_broadcast(tensor_grad, ds, block)
        return ds


# ---------------------------------------------------------------------------------------------
# Masks: the band (causal / sliding window) and a bool mask.


@dataclass(frozen=True)
class Band(Modifier):
    """Causal and sliding window: query row i sees key j iff ``i + off - left <= j <= i + off + right``.

    ``None`` is an unbounded side; ``causal=True`` is ``right = 0``. Every piece of band geometry in
    tileattn (key ranges, tile states, edge diagonals, visible pairs) is a method here; engines get
    the band as the ``left``/``right`` kernel arguments and read its geometry back from them
    (:attr:`tileattn.core.kernel_args.KernelArgs.band`).
    """

    kind: ClassVar[str] = "band"
    stage: ClassVar[int] = 3
    masks: ClassVar[bool] = True
    positional: ClassVar[bool] = True
    keywords: ClassVar[Mapping[str, object]] = {"causal": False, "window": None}
    left: Optional[int] = field(default=None, metadata=OP_OPT_INT)
    right: Optional[int] = field(default=None, metadata=OP_OPT_INT)

    @classmethod
    def from_args(cls, causal=False, window=None) -> Optional["Band"]:
        if window is None and causal is True:
            return _CAUSAL  # the common call: one shared object, whose plan key is computed once
        if not isinstance(causal, bool):
            fail(TypeError, "causal", repr(causal), "True or False")
        if window is None:
            window = (None, None)
        expected = "a pair (left, right) of ints; None or negative = unbounded"
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            fail(TypeError, "window", repr(window), expected)
        sides = []
        for side in window:
            if side is None:
                sides.append(None)
                continue
            if isinstance(side, bool) or not isinstance(side, numbers.Integral):
                fail(TypeError, "window", repr(tuple(window)), expected)
            if side > MAX_WINDOW:
                fail(ValueError, "window", repr(tuple(window)), f"sides <= {MAX_WINDOW} (None = unbounded)")
            sides.append(None if side < 0 else int(side))
        left, right = sides
        if causal:
            right = 0 if right is None else min(right, 0)
        if left is None and right is None:
            return None
        return _CAUSAL if (left, right) == (None, 0) else cls(left, right)

    def check(self, spec):
        for side in (self.left, self.right):
            if side is not None and (type(side) is not int or not 0 <= side <= MAX_WINDOW):
                fail(ValueError, "window", repr((self.left, self.right)),
                     f"sides that are None (unbounded) or ints in [0, {MAX_WINDOW}]")

    def lower(self):
        return {"left": -1 if self.left is None else self.left, "right": -1 if self.right is None else self.right}

    context_parallel: ClassVar[Optional[str]] = "band"

    @classmethod
    def agreement(cls):
        return {"causal": "bool", "window": "window"}

    def as_keywords(self):
        return {"causal": False, "window": (self.left, self.right)}

    def keys_band(self):
        return self

    @property
    def is_causal(self) -> bool:
        return self.left is None and self.right == 0

    def key_range(self, i0: int, i1: int, k_len: int, offset: int) -> Tuple[int, int]:
        """Half-open range of keys that some query row in [i0, i1) sees."""
        lo = 0 if self.left is None else max(0, i0 + offset - self.left)
        hi = k_len if self.right is None else min(k_len, i1 - 1 + offset + self.right + 1)
        return lo, max(lo, hi)

    def tile_state(self, i0, i1, j0, j1, offset: int) -> TileState:
        lowest = j0 - (i1 - 1) - offset  # smallest j - i - off in the tile
        highest = (j1 - 1) - i0 - offset
        if (self.left is not None and highest < -self.left) or (self.right is not None and lowest > self.right):
            return TileState.EMPTY
        if (self.left is None or lowest >= -self.left) and (self.right is None or highest <= self.right):
            return TileState.FULL
        return TileState.PARTIAL

    def tile_diagonals(self, i0: int, j0: int, offset: int) -> Tuple[Optional[int], Optional[int]]:
        """(lo, hi): tile element (r, c) is inside the band iff ``lo <= c - r <= hi`` (None = open),
        the form ``tril_``/``triu_`` take."""
        shift = offset + i0 - j0
        return (None if self.left is None else shift - self.left,
                None if self.right is None else shift + self.right)

    def visible(self, block):
        return self.keep(block.rows, block.cols, block.offset)

    def keep(self, rows: torch.Tensor, cols: torch.Tensor, offset: int) -> torch.Tensor:
        """Bool (len(rows), len(cols)): True where the row sees the key."""
        rel = cols[None, :] - rows[:, None] - offset
        keep = torch.ones(rel.shape, dtype=torch.bool, device=rel.device)
        if self.left is not None:
            keep &= rel >= -self.left
        if self.right is not None:
            keep &= rel <= self.right
        return keep

    def visible_pairs(self, q_len: int, k_len: int, offset: int) -> int:
        """Number of (row, key) pairs inside the band, in O(1) per sequence."""
        def below(c):  # sum over rows i of #{j in [0, k_len): j <= i + off + c}
            return sum_clamped(q_len, offset + c + 1, k_len)

        upper = q_len * k_len if self.right is None else below(self.right)
        under = 0 if self.left is None else below(-self.left - 1)
        return upper - under


_CAUSAL = Band(None, 0)


def sum_clamped(n: int, a: int, cap: int) -> int:
    """sum_{i=0}^{n-1} clamp(i + a, 0, cap), exactly."""
    total = 0
    # rows where i + a <= 0 contribute 0; where i + a >= cap contribute cap; between, i + a.
    first = max(0, -a)  # first row with a positive count
    full = max(first, min(n, cap - a))  # first row that reaches cap
    if full > first:
        total += (first + a + full - 1 + a) * (full - first) // 2
    total += cap * max(0, n - max(full, first))
    return total


@dataclass(frozen=True)
class Mask(_ScoreShaped):
    """A bool mask broadcastable to (B, Hq, Sq, Sk), **True = take part** (SDPA's polarity)."""

    kind: ClassVar[str] = "mask"
    stage: ClassVar[int] = 4
    masks: ClassVar[bool] = True
    keywords: ClassVar[Mapping[str, object]] = {"mask": None}
    binds: ClassVar[Tuple[str, ...]] = ("mask",)
    expected: ClassVar[str] = "a bool tensor (True = take part)"
    instead: ClassVar[str] = "no mask (sequences are already separated; use window/causal for bands)"
    tensor: torch.Tensor = field(metadata=OP_TENSOR)

    @classmethod
    def accepts(cls, t: torch.Tensor) -> bool:
        return t.dtype == torch.bool

    def visible(self, block):
        return self.block(block.batch, block.heads, block.i0, block.i1, block.j0, block.j1)


# ---------------------------------------------------------------------------------------------
# After the softmax: sinks (an extra logit in the denominator) and dropout.


@dataclass(frozen=True)
class Sinks(Modifier):
    """Learnable attention sinks (gpt-oss): one extra logit per query head in every row's softmax
    denominator, with no value vector. The LSE includes it; a row that sees no key has LSE = sink
    and output 0. Applied to any engine's (out, LSE) as a merge with an empty partial result
    (:func:`tileattn.core.merge.merge_weights`), above the engines."""

    kind: ClassVar[str] = "sinks"
    stage: ClassVar[int] = 5
    keywords: ClassVar[Mapping[str, object]] = {"sinks": None}
    grad_slot: ClassVar[Optional[str]] = "sinks"
    applied_by_op: ClassVar[bool] = True
    tensor: torch.Tensor = field(metadata=OP_TENSOR)

    @classmethod
    def from_args(cls, sinks) -> Optional["Sinks"]:
        if sinks is None:
            return None
        return cls(sinks)

    def check(self, spec):
        heads_q = spec.heads_q
        _check_per_head("sinks", self.tensor, spec, lambda t: t.is_floating_point(), "a float tensor",
                        ((heads_q,),), f"({heads_q},), one logit per query head")

    def grad_tensor(self):
        return self.tensor

    context_parallel: ClassVar[Optional[str]] = "merge"

    def for_heads(self, heads):
        return Sinks(self.tensor[heads])

    def logits(self, heads_axis: int, ndim: int, dtype) -> torch.Tensor:
        """The sinks shaped to broadcast against an LSE whose head axis is ``heads_axis``."""
        shape = [1] * ndim
        shape[heads_axis] = -1
        return self.tensor.to(dtype).reshape(shape)

    def extra_logits(self, lse, heads_axis):
        return self.logits(heads_axis, lse.dim(), lse.dtype)

    def result_grad(self, lse: torch.Tensor, delta: torch.Tensor, heads_axis: int) -> torch.Tensor:
        """dsinks from the final LSE and ``delta = rowsum(dO * O) - dLSE``: d lse / d sink is the sink's
        probability ``exp(sink - lse)``, and the sink moves every probability of a row alike."""
        sink = self.logits(heads_axis, lse.dim(), lse.dtype)
        per_row = torch.exp(sink - lse).nan_to_num_(nan=0.0) * delta
        dims = [d for d in range(per_row.dim()) if d != heads_axis]
        return (-per_row.sum(dims)).to(self.tensor.dtype)


@dataclass(frozen=True)
class Dropout(Modifier):
    """Dropout of attention weights with a counter-based mask: the decision for
    (seed, batch, head, row, col) is a pure function of those five numbers, so the backward pass
    regenerates the mask instead of storing it and any tiling gives the same mask. The seed is a
    per-call value (a plan keys on ``p`` alone)."""

    kind: ClassVar[str] = "dropout"
    stage: ClassVar[int] = 6
    keywords: ClassVar[Mapping[str, object]] = {"dropout_p": 0.0, "seed": None, "generator": None}
    binds: ClassVar[Tuple[str, ...]] = ("seed",)
    p: float = field(metadata=OP_FLOAT)
    seed: int = field(metadata=OP_INT)

    @classmethod
    def from_args(cls, dropout_p=0.0, seed=None, generator=None) -> Optional["Dropout"]:
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
            fail(TypeError, "dropout_p", repr(dropout_p), "a float in [0, 1)")
        if not 0.0 <= dropout_p < 1.0:
            fail(ValueError, "dropout_p", repr(dropout_p), "a float in [0, 1)")
        if seed is not None and generator is not None:
            fail(ValueError, "seed/generator", "both", "at most one of them")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            fail(TypeError, "seed", repr(seed), "an int")
        if generator is not None and not isinstance(generator, torch.Generator):
            fail(TypeError, "generator", type(generator).__name__, "a torch.Generator")
        if dropout_p == 0:
            return None
        if seed is None:
            if generator is not None:
                seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
            else:
                seed = int(torch.randint(0, 2**62, (1,)).item())
        # 63 bits: the seed travels through torch.library ops as a signed int64.
        return cls(float(dropout_p), int(seed) & ((1 << 63) - 1))

    def check(self, spec):
        if type(self.p) is not float or not 0.0 < self.p < 1.0:
            fail(ValueError, "dropout_p", repr(self.p), "a float in (0, 1)")
        if type(self.seed) is not int or not 0 <= self.seed < 2**63:
            fail(ValueError, "seed", repr(self.seed), "an int in [0, 2**63)")

    def plan_key(self):
        return (Dropout, self.p)

    def lower(self):
        return {"dropout_p": self.p}

    def bind(self):
        return {"seed": self.seed}

    @property
    def keep_scale(self) -> float:
        return 1.0 / (1.0 - self.p)

    def keep(self, batch: int, heads: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Bool (len(heads), len(rows), len(cols)): True where the weight survives."""
        return dropout_keep(self.seed, self.p, batch, heads, rows, cols)

    def factor(self, block: ScoreBlock, heads_q: int) -> torch.Tensor:
        """(heads, rows, cols): 0 where dropped, ``1 / (1 - p)`` where kept."""
        kept = dropout_keep(self.seed, self.p, block.batch, block.head_indices(heads_q), block.rows, block.cols)
        return kept.to(block.dtype) * self.keep_scale

    def weights(self, p, block, heads_q):
        return p * self.factor(block, heads_q)

    def weights_grad(self, dp, block, heads_q):
        return dp * self.factor(block, heads_q)
