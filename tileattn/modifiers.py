"""Attention modifiers: one small frozen object per variant of the score pipeline.

    s = scale * q.k^T -> Softcap -> + Alibi + Bias -> Band and Mask -> softmax (+ Sinks) -> Dropout -> . v

Each modifier owns, in one place, everything about itself that is not an engine's private
arithmetic: how its user argument is validated (``from_args``), what it does to the exact score
matrix of the reference (``reference_*``), how it classifies a (query block, key block) tile as
:class:`TileState` EMPTY / PARTIAL / FULL (masking modifiers), and how the PyTorch engine applies it
to a tile. Engines in other languages (Triton, C) keep their own arithmetic; their block ranges are
tested against the classification rules here.

Positions. Every modifier that depends on where a score sits (band, ALiBi) reads one number per
sequence, its *diagonal offset* ``off``: query row ``i`` is aligned with key column ``i + off``.
``align="bottom_right"`` (FlashAttention-2, the default) gives ``off = k_len - q_len``;
``align="top_left"`` (SDPA's ``is_causal``) gives ``off = 0``; an int gives that offset to every
sequence (a key shard inside a longer sequence, as context parallelism needs).

Flattening. A modifier crosses the ``torch.library`` op boundary as tensors, ints and floats; the
field metadata below (``OP_TENSOR``, ``OP_INT``, ``OP_OPT_INT``, ``OP_FLOAT``) says how, so
:func:`flatten` and :func:`unflatten` serve every modifier and nothing else counts argument slots.
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field, fields
from typing import ClassVar, Dict, Optional, Tuple

import torch

OP_TENSOR = {"op": "tensor"}
OP_INT = {"op": "int"}
OP_OPT_INT = {"op": "opt_int"}  # None travels as -1 (window sides are never negative once validated)
OP_FLOAT = {"op": "float"}

#: Largest window side accepted: anything longer than any sequence is "unbounded" in effect, and the
#: value must survive int64 arithmetic in every engine.
MAX_WINDOW = 2**62


def fail(exc, arg: str, given, expected: str):
    raise exc(f"tileattn: argument '{arg}': got {given}; expected {expected}.")


class TileState(enum.IntEnum):
    """What a masking modifier (or all of them together) does to a (query block, key block) tile."""

    EMPTY = 0  # every pair hidden: the tile is skipped
    PARTIAL = 1  # some pairs hidden: the tile is computed and masked
    FULL = 2  # every pair visible: the tile is computed without masking


def combine(*states: TileState) -> TileState:
    """The state of a tile under several masks: hidden if any hides it, full only if all keep it."""
    return TileState(min(states))


def diagonal_offset(align, q_len: int, k_len: int) -> int:
    """``off``: query row ``i`` of a sequence is aligned with key column ``i + off``."""
    if align == "bottom_right":
        return k_len - q_len
    if align == "top_left":
        return 0
    return int(align)


def _slice_or_broadcast(size: int, start: int, stop: int) -> slice:
    return slice(None) if size == 1 else slice(start, stop)


def to_4d(t: torch.Tensor) -> torch.Tensor:
    """A tensor broadcastable to (B, H, Sq, Sk) as a 4-d view, size-1 dims where it broadcasts."""
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t


def reduce_to_shape(full: torch.Tensor, shape) -> torch.Tensor:
    """Sum a gradient over the dimensions a broadcast tensor of ``shape`` was repeated along."""
    shape4 = (1,) * (full.dim() - len(shape)) + tuple(shape)
    dims = [i for i, (n, f) in enumerate(zip(shape4, full.shape)) if n == 1 and f != 1]
    if dims:
        full = full.sum(dim=dims, keepdim=True)
    return full.reshape(shape)


class Modifier:
    """Base of the modifiers. Subclasses are frozen dataclasses with op metadata on their fields."""

    #: Name used by capabilities, flattening and ``spec.modifier(kind)``.
    kind: ClassVar[str]
    #: Position in the pipeline (see the module docstring); modifiers are kept sorted by it.
    stage: ClassVar[int]
    #: Whether the modifier hides scores (and so classifies tiles).
    masks: ClassVar[bool] = False


# ---------------------------------------------------------------------------------------------
# Score transforms: softcap, ALiBi, bias.


@dataclass(frozen=True)
class Softcap(Modifier):
    """``s -> cap * tanh(s / cap)`` on the scaled scores (Gemma 2, Grok)."""

    kind: ClassVar[str] = "softcap"
    stage: ClassVar[int] = 0
    cap: float = field(metadata=OP_FLOAT)

    @classmethod
    def from_args(cls, softcap) -> Optional["Softcap"]:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            fail(TypeError, "softcap", repr(softcap), "a float > 0 (or 0 to disable)")
        if not math.isfinite(softcap) or softcap < 0:
            fail(ValueError, "softcap", repr(softcap), "a finite float > 0 (or 0 to disable)")
        return cls(float(softcap)) if softcap > 0 else None

    def apply(self, s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(capped scores, tanh(s / cap)); the backward multiplies dS by ``1 - tanh**2``."""
        t = torch.tanh(s / self.cap)
        return self.cap * t, t


@dataclass(frozen=True)
class Alibi(Modifier):
    """ALiBi: adds ``-slope[h] * |i + off - j|``; slopes fp32 (Hq,) or (B, Hq)."""

    kind: ClassVar[str] = "alibi"
    stage: ClassVar[int] = 1
    slopes: torch.Tensor = field(metadata=OP_TENSOR)

    @classmethod
    def from_args(cls, slopes, batch, heads_q, device) -> Optional["Alibi"]:
        if slopes is None:
            return None
        if not isinstance(slopes, torch.Tensor) or slopes.dtype != torch.float32:
            given = f"dtype {slopes.dtype}" if isinstance(slopes, torch.Tensor) else type(slopes).__name__
            fail(TypeError, "alibi_slopes", given, f"a float32 tensor of shape ({heads_q},) or ({batch}, {heads_q})")
        if tuple(slopes.shape) not in ((heads_q,), (batch, heads_q)):
            fail(ValueError, "alibi_slopes", f"shape {tuple(slopes.shape)}", f"({heads_q},) or ({batch}, {heads_q})")
        if slopes.device != device:
            fail(ValueError, "alibi_slopes", f"device {slopes.device}", f"device {device}, as q")
        return cls(slopes)

    def slopes_of(self, b: int) -> torch.Tensor:
        """(Hq,) slopes of batch item ``b``."""
        return self.slopes if self.slopes.dim() == 1 else self.slopes[b]

    def distance(self, rows: torch.Tensor, cols: torch.Tensor, offset: int, dtype) -> torch.Tensor:
        """``|i + off - j|`` as a (len(rows), len(cols)) tensor."""
        return (rows[:, None] + offset - cols[None, :]).abs().to(dtype)

    def scores(self, b, heads: slice, rows, cols, offset, dtype) -> torch.Tensor:
        """The ALiBi term for query heads ``heads``: (nheads, len(rows), len(cols))."""
        slopes = self.slopes_of(b)[heads].to(dtype)
        return -slopes[:, None, None] * self.distance(rows, cols, offset, dtype)


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
    def from_args(cls, t, full_shape, device, refused_with=None):
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or not cls.accepts(t):
            given = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            fail(TypeError, cls.kind, given, f"{cls.expected} broadcastable to (B, Hq, Sq, Sk)")
        _check_dense(cls.kind, t)
        if refused_with:
            fail(ValueError, cls.kind, f"a {cls.kind} with {refused_with}", cls.instead)
        if not broadcastable(t.shape, full_shape):
            fail(ValueError, cls.kind, f"shape {tuple(t.shape)}",
                 f"a shape broadcastable to (B, Hq, Sq, Sk) = {full_shape}")
        if t.device != device:
            fail(ValueError, cls.kind, f"device {t.device}", f"device {device}, as q")
        return cls(t)

    @property
    def view4(self) -> torch.Tensor:
        return to_4d(self.tensor)

    def block(self, b, heads: slice, i0, i1, j0, j1) -> torch.Tensor:
        """Rows i0:i1, cols j0:j1 of batch item b, query heads ``heads``, broadcast dims kept at 1."""
        t = self.view4
        t = t[b if t.shape[0] > 1 else 0]
        t = t[heads] if t.shape[0] > 1 else t
        return t[:, _slice_or_broadcast(t.shape[1], i0, i1), _slice_or_broadcast(t.shape[2], j0, j1)]


@dataclass(frozen=True)
class Bias(_ScoreShaped):
    """A float tensor added to the scores, broadcastable to (B, Hq, Sq, Sk); differentiable."""

    kind: ClassVar[str] = "bias"
    stage: ClassVar[int] = 2
    expected: ClassVar[str] = "a floating tensor"
    instead: ClassVar[str] = "no bias (build the scores of each sequence separately)"
    tensor: torch.Tensor = field(metadata=OP_TENSOR)

    @classmethod
    def accepts(cls, t: torch.Tensor) -> bool:
        return t.is_floating_point()


# ---------------------------------------------------------------------------------------------
# Masks: the band (causal / sliding window) and a bool mask.


@dataclass(frozen=True)
class Band(Modifier):
    """Causal and sliding window: query row i sees key j iff ``i + off - left <= j <= i + off + right``.

    ``None`` is an unbounded side; ``causal=True`` is ``right = 0``. Every piece of band geometry in
    tileattn (key ranges, tile states, edge diagonals, visible pairs) is a method here.
    """

    kind: ClassVar[str] = "band"
    stage: ClassVar[int] = 3
    masks: ClassVar[bool] = True
    left: Optional[int] = field(default=None, metadata=OP_OPT_INT)
    right: Optional[int] = field(default=None, metadata=OP_OPT_INT)

    @classmethod
    def from_args(cls, causal, window) -> Optional["Band"]:
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
        return cls(left, right)

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
    expected: ClassVar[str] = "a bool tensor (True = take part)"
    instead: ClassVar[str] = "no mask (sequences are already separated; use window/causal for bands)"
    tensor: torch.Tensor = field(metadata=OP_TENSOR)

    @classmethod
    def accepts(cls, t: torch.Tensor) -> bool:
        return t.dtype == torch.bool

    def tile_states(self, b: int, heads: slice, q_len: int, k_len: int, block_m: int, block_n: int) -> torch.Tensor:
        """uint8 (ceil(q_len/block_m), ceil(k_len/block_n)) of :class:`TileState` for batch item ``b``
        and every query head of ``heads`` together (EMPTY only if the mask hides the tile from all of
        them, FULL only if it keeps it whole for all). Two reductions over the mask, once per call:
        per-tile checks would cost two reductions per tile.
        """
        key = (b, heads.start, heads.stop, q_len, k_len, block_m, block_n)
        # Inference tensors have no version counter (so no safe cache key), and no backward reuses
        # their states: they are classified afresh.
        cache = {} if self.tensor.is_inference() else _TILE_STATE_CACHE.setdefault(_tensor_key(self.tensor), {})
        if key not in cache:
            m = self.block(b, heads, 0, q_len, 0, k_len).expand(-1, q_len, k_len)
            rows, cols = -(-q_len // block_m), -(-k_len // block_n)
            pad = (0, cols * block_n - k_len, 0, rows * block_m - q_len)
            # max/min of the bytes are any/all, and much faster than bool any/all on this layout.
            tiles = m.view(torch.uint8)
            any_kept = torch.nn.functional.pad(tiles, pad, value=0)
            all_kept = torch.nn.functional.pad(tiles, pad, value=1)
            shape = (m.shape[0], rows, block_m, cols, block_n)
            any_kept = any_kept.reshape(shape).amax((0, 2, 4))
            all_kept = all_kept.reshape(shape).amin((0, 2, 4))
            cache[key] = any_kept + all_kept  # 0 = EMPTY, 1 = PARTIAL, 2 = FULL
        return cache[key]


#: Tile states of masks, by (data pointer, version, shape, strides) of the mask tensor: computed once
#: per call and reused by the backward pass. Bounded: masks change rarely within a training loop.
_TILE_STATE_CACHE: Dict[tuple, dict] = {}
_TILE_STATE_CACHE_LIMIT = 8


def _tensor_key(t: torch.Tensor) -> tuple:
    key = (t.data_ptr(), t._version, tuple(t.shape), t.stride(), t.device.type)
    if key not in _TILE_STATE_CACHE and len(_TILE_STATE_CACHE) >= _TILE_STATE_CACHE_LIMIT:
        _TILE_STATE_CACHE.pop(next(iter(_TILE_STATE_CACHE)))
    return key


# ---------------------------------------------------------------------------------------------
# After the softmax: sinks (an extra logit in the denominator) and dropout.


@dataclass(frozen=True)
class Sinks(Modifier):
    """Learnable attention sinks (gpt-oss): one extra logit per query head in every row's softmax
    denominator, with no value vector. The LSE includes it; a row that sees no key has LSE = sink
    and output 0. Applied to any engine's (out, LSE) as a merge with an empty partial result."""

    kind: ClassVar[str] = "sinks"
    stage: ClassVar[int] = 5
    tensor: torch.Tensor = field(metadata=OP_TENSOR)

    @classmethod
    def from_args(cls, sinks, heads_q, device) -> Optional["Sinks"]:
        if sinks is None:
            return None
        if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
            given = f"dtype {sinks.dtype}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
            fail(TypeError, "sinks", given, f"a float tensor of shape ({heads_q},), one logit per query head")
        if tuple(sinks.shape) != (heads_q,):
            fail(ValueError, "sinks", f"shape {tuple(sinks.shape)}", f"({heads_q},), one logit per query head")
        if sinks.device != device:
            fail(ValueError, "sinks", f"device {sinks.device}", f"device {device}, as q")
        return cls(sinks)

    def logits(self, lse_shape_heads_axis: int, ndim: int, dtype) -> torch.Tensor:
        """The sinks shaped to broadcast against an LSE whose head axis is ``lse_shape_heads_axis``."""
        shape = [1] * ndim
        shape[lse_shape_heads_axis] = -1
        return self.tensor.to(dtype).reshape(shape)


_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so that a product of two 32-bit values fits in int64 without overflow
# and equals the uint32 product modulo 2**32 (what the Triton and C kernels compute).
_MUL_A = 0x7FEB352D
_MUL_B = 0x5BD1E995
_GOLDEN = 0x1E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _M32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class Dropout(Modifier):
    """Dropout of attention weights with a counter-based mask: the decision for
    (seed, batch, head, row, col) is a pure function of those five numbers, so the backward pass
    regenerates the mask instead of storing it and any tiling gives the same mask."""

    kind: ClassVar[str] = "dropout"
    stage: ClassVar[int] = 6
    p: float = field(metadata=OP_FLOAT)
    seed: int = field(metadata=OP_INT)

    @classmethod
    def from_args(cls, dropout_p, seed, generator) -> Optional["Dropout"]:
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

    @property
    def keep_scale(self) -> float:
        return 1.0 / (1.0 - self.p)

    @property
    def threshold(self) -> int:
        """A weight survives when the top 24 bits of its hash are >= this."""
        return int(round(self.p * (1 << 24)))

    def row_keys(self, batch: int, heads: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Per (head, row) 32-bit keys, shape (len(heads), len(rows)), int64 holding uint32 values."""
        dev = rows.device
        k = _mix32(torch.tensor([self.seed & _M32], dtype=torch.int64, device=dev) ^ _GOLDEN)
        k = _mix32(k ^ ((self.seed >> 32) & _M32))
        k = _mix32(k ^ (batch & _M32))
        kh = _mix32(k ^ heads.to(torch.int64))
        return _mix32(kh[:, None] ^ rows.to(torch.int64)[None, :])

    def keep(self, batch: int, heads: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Bool (len(heads), len(rows), len(cols)): True where the weight survives."""
        keys = self.row_keys(batch, heads, rows)
        x = _mix32(keys[..., None] ^ ((cols.to(torch.int64) * _GOLDEN) & _M32))
        return (x >> 8) >= self.threshold


#: Every modifier class, in pipeline order. :func:`unflatten` rebuilds modifiers by kind from here.
MODIFIER_TYPES = {cls.kind: cls for cls in sorted((Softcap, Alibi, Bias, Band, Mask, Sinks, Dropout),
                                                     key=lambda c: c.stage)}


# ---------------------------------------------------------------------------------------------
# Flattening across the op boundary.


def flatten(modifier: Modifier) -> Tuple[list, list, list]:
    """(tensors, ints, floats) of a modifier, in field order."""
    tensors, ints, floats = [], [], []
    for f in fields(modifier):
        value = getattr(modifier, f.name)
        op = f.metadata["op"]
        if op == "tensor":
            tensors.append(value)
        elif op == "int":
            ints.append(value)
        elif op == "opt_int":
            ints.append(-1 if value is None else value)
        else:
            floats.append(value)
    return tensors, ints, floats


def unflatten(kind: str, tensors, ints, floats) -> Modifier:
    """Rebuild a modifier of ``kind`` from iterators over the op's tensors, ints and floats."""
    cls = MODIFIER_TYPES[kind]
    values = {}
    for f in fields(cls):
        op = f.metadata["op"]
        if op == "tensor":
            values[f.name] = next(tensors)
        elif op == "int":
            values[f.name] = next(ints)
        elif op == "opt_int":
            value = next(ints)
            values[f.name] = None if value < 0 else value
        else:
            values[f.name] = next(floats)
    return cls(**values)


def broadcastable(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))


def _check_dense(name: str, t: torch.Tensor):
    if t.layout != torch.strided or getattr(t, "is_nested", False):
        fail(TypeError, name, f"a {t.layout} tensor" if t.layout != torch.strided else "a nested tensor",
             "a regular strided (dense) tensor")
