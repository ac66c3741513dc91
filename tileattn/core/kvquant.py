"""Quantised and low-precision K/V caches: one representation in the core, :class:`KVQuant`.

A cache stored as int8, float8_e4m3fn, float8_e5m2 or int4 (or in q's own dtype with descales) is read as

    k_real = (k + k_offset) * k_scale        v_real = (v + v_offset) * v_scale

(the Ascend antiquant convention; no offset = symmetric, no scale = 1), and ``q_scale`` multiplies
the scores of each kv head's query heads (FlashAttention-3's ``q_descale``). The keywords
``k_scale``, ``k_offset``, ``v_scale``, ``v_offset``, ``q_scale`` of :func:`tileattn.flash_attention`
(and of ``attention_partial`` / ``tileattn.reference``) make one :class:`KVQuant` modifier; a k/v
of a quantised dtype without any of them is read with unit scales.

Shapes: every scale and offset is an fp32 tensor broadcastable to k's (v's) own shape *as passed*
with its last dim replaced by ``G`` channel groups (1: no channel axis; the head dim: per channel;
a divisor of it: groups of channels). So, for k (B, Sk, Hkv, D) in ``layout="BSND"``: per tensor
``(1, 1, 1, 1)``, per kv head ``(1, 1, Hkv, 1)``, per channel ``(1, 1, Hkv, D)``, per token
``(B, Sk, Hkv, 1)``. A paged pool (num_blocks, block_size, Hkv, D) or a packed TND cache (Tk, Hkv, D)
takes the same, and also a leading batch axis of size B (per-sequence scales, such as
FlashAttention-3's descales of shape (B, Hkv)). ``q_scale``: fp32 (B|1, Hkv|1). Flattened-head
layouts (BSH, SBH) take no scales.

int4: a torch.uint8 tensor whose last dim is half the head dim, two values a byte: byte c of a row
holds channel 2c in its low nibble and channel 2c + 1 in its high nibble, each a two's complement
int4 in [-8, 7] (ONNX Runtime's int4 packing; llama.cpp's Q4_0 stores ``nibble = x + 8`` and orders
a 32-channel block's channels as low nibbles 0-15, high nibbles 16-31). Scales have the head dim's
channel groups (per group of 32 channels: G = D / 32, as Q4_0's blocks), not the bytes'.

Forward only (inference): a call that would need gradients is refused, and so is a scale or offset
that requires grad (no gradient would reach it). Engines: the native kernels read the cache as
stored and dequantise inside their tile loop (declared in their capabilities; a per-tensor or
per-token K scale that is not finite makes them dequantise the keys first, as the reference does);
the ``cpu`` engine and the exact reference dequantise a copy first
(:func:`tileattn.core.spec.dequantised_spec`), the reference in its own compute dtype, which makes it
the independent check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Optional, Tuple

import torch

from .kvformat import DEFAULTS, KVFormat, check_cache, format_of, unpack_int4  # noqa: F401 (unpack_int4: public here)
from .layouts import LAYOUT, to_canonical
from .modifiers import OP_FORMAT, OP_TENSOR, Modifier, fail

#: The name of the int4 format (:func:`tileattn.serving.quantise`'s ``dtype``) and the dtype that stores
#: it: two values a byte, ``head_dim / 2`` bytes a row (see the module docstring).
INT4, INT4_STORAGE = "int4", torch.uint8
#: The stored dtypes of a quantised cache (besides q's own dtype with descales).
QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, INT4_STORAGE)
#: How errors name them.
QUANT_NAMES = "int8, float8_e4m3fn, float8_e5m2 or uint8 (int4, two values a byte; q8_0 / q4_0 blocks with k_format)"


def head_width(t: torch.Tensor, fmt: Optional[KVFormat] = None) -> int:
    """The head dim a cache tensor of format ``fmt`` (default: its dtype's) holds: its last dim, twice that
    for int4 (two values a byte), 32 values per block of q8_0 / q4_0."""
    fmt = fmt or DEFAULTS.get(t.dtype)
    return t.shape[-1] if fmt is None else fmt.width(t.shape[-1])


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """The packed int4 cache (..., W / 2) of integer values in [-8, 7] (..., W); W even."""
    nibbles = (values.to(torch.int16) & 15).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
_SCALE_NAMES = ("k_scale", "k_offset", "v_scale", "v_offset")


@dataclass(frozen=True)
class KVQuant(Modifier):
    """The scales and offsets of a quantised (or descaled) K/V cache; see the module docstring."""

    kind: ClassVar[str] = "kv_quant"
    stage: ClassVar[int] = -1  # acts on the inputs, before any score transform
    keywords: ClassVar[Mapping[str, object]] = {"k_scale": None, "k_offset": None, "v_scale": None,
                                                "v_offset": None, "q_scale": None, "k_format": None,
                                                "v_format": None}
    binds: ClassVar[Tuple[str, ...]] = ("k_scale", "k_offset", "v_scale", "v_offset", "q_scale", "kv_format")
    forward_only: ClassVar[bool] = True
    k_scale: Optional[torch.Tensor] = field(default=None, metadata=OP_TENSOR)
    k_offset: Optional[torch.Tensor] = field(default=None, metadata=OP_TENSOR)
    v_scale: Optional[torch.Tensor] = field(default=None, metadata=OP_TENSOR)
    v_offset: Optional[torch.Tensor] = field(default=None, metadata=OP_TENSOR)
    q_scale: Optional[torch.Tensor] = field(default=None, metadata=OP_TENSOR)
    #: The names of the cache's formats (:mod:`tileattn.core.kvformat`); None: the dtype's default.
    k_format: Optional[str] = field(default=None, metadata=OP_FORMAT)
    v_format: Optional[str] = field(default=None, metadata=OP_FORMAT)

    @classmethod
    def from_args(cls, k_scale=None, k_offset=None, v_scale=None, v_offset=None, q_scale=None, k_format=None,
                  v_format=None):
        if k_scale is None and k_offset is None and v_scale is None and v_offset is None and q_scale is None and \
                k_format is None and v_format is None:
            return None
        format_of(k_format, None, "k_format")  # a name that is no format is refused as the call is parsed
        format_of(v_format, None, "v_format")
        return cls(k_scale, k_offset, v_scale, v_offset, q_scale, k_format, v_format)

    def formats(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[Optional[KVFormat], Optional[KVFormat]]:
        """The formats of k and v: the named ones, checked against the tensors (dtype, whole blocks), one
        format for both; or their dtypes' defaults (None: a float cache)."""
        kf, vf = format_of(self.k_format, k.dtype, "k_format"), format_of(self.v_format, v.dtype, "v_format")
        for arg, t, fmt, name in (("k", k, kf, "k_format"), ("v", v, vf, "v_format")):
            if getattr(self, name) is not None:
                check_cache(arg, t, fmt, name)
        if kf is not vf:
            fail(ValueError, "v_format", f"{vf.name if vf else None} ({v.dtype})",
                 f"k's format {kf.name if kf else None} (one cache format for k and v)")
        return kf, vf

    def check(self, spec) -> None:
        if LAYOUT[spec.layout].fused:
            fail(ValueError, self._first_given(), f"a quantised or scaled cache with layout='{spec.layout}'",
                 "layout 'BNSD', 'BSND' or 'TND', or a paged cache (scales follow k's head axis)")
        q, k, v = spec.q, spec.k, spec.v
        if k.dtype is not v.dtype:
            fail(TypeError, "v", f"dtype {v.dtype}", f"k's dtype {k.dtype} (one cache format)")
        if k.dtype is not q.dtype and k.dtype not in QUANT_DTYPES:
            fail(TypeError, "k", f"dtype {k.dtype} for q of dtype {q.dtype}", f"q's dtype or a quantised format "
                 f"({QUANT_NAMES})")
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            fail(ValueError, self._first_given(), "a quantised or scaled cache with inputs that require grad",
                 "inputs without gradients or torch.no_grad(): quantised K/V are forward only (inference)")
        for name in _SCALE_NAMES + ("q_scale",):
            t = getattr(self, name)
            if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
                fail(ValueError, name, "a tensor that requires grad",
                     "a tensor without gradients (detach it or use torch.no_grad()): quantised K/V are forward "
                     "only, no gradient reaches the scales")
        leading = spec.is_paged or spec.is_varlen
        fmt = self.formats(k, v)[0]
        for name in _SCALE_NAMES:
            t = getattr(self, name)
            if t is not None and fmt is not None and fmt.scales == "inside":
                fail(ValueError, name, f"a tensor for a {fmt.name} cache",
                     f"None ({fmt.name} blocks hold their own scales)")
            if t is not None:
                _check_scale(name, t, k if name[0] == "k" else v, spec.batch, leading, spec.device)
        if self.q_scale is not None:
            t = self.q_scale
            _check_fp32(t, "q_scale", spec.device, f"(batch, kv heads) = ({spec.batch}, {spec.heads_kv})")
            if t.dim() != 2 or any(n not in (1, f) for n, f in zip(t.shape, (spec.batch, spec.heads_kv))):
                fail(ValueError, "q_scale", f"shape {tuple(t.shape)}",
                     f"a shape broadcastable to (batch, kv heads) = ({spec.batch}, {spec.heads_kv})")

    def _first_given(self) -> str:
        return next((n for n in _SCALE_NAMES + ("q_scale",) if getattr(self, n) is not None), "k")

    def lower(self):
        return {}

    def bind(self):
        return {"k_scale": self.k_scale, "k_offset": self.k_offset, "v_scale": self.v_scale,
                "v_offset": self.v_offset, "q_scale": self.q_scale, "kv_format": self.k_format}


def _check_fp32(t, name, device, shape_text):
    if not isinstance(t, torch.Tensor) or t.dtype is not torch.float32:
        given = f"dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        fail(TypeError, name, given, f"an fp32 tensor broadcastable to {shape_text}")
    if t.layout is not torch.strided or t.is_nested:
        fail(TypeError, name, "a non-strided tensor", "a regular strided (dense) fp32 tensor")
    if t.device != device:
        fail(ValueError, name, f"device {t.device}", f"device {device}, as q")


def _check_scale(name, t, cache, batch, leading, device):
    """A scale/offset broadcastable to the cache's shape with its last dim replaced by G channel
    groups (G divides the head dim), with an optional leading batch axis when ``leading``."""
    shape = tuple(cache.shape[:-1]) + ("G",)
    width = head_width(cache)
    options = f"{shape}" + (f" or {(batch,) + shape}" if leading else "")
    what = f"a shape broadcastable to {options}, G channel groups dividing the head dim {width} (1: none)"
    _check_fp32(t, name, device, options)
    full = tuple(cache.shape[:-1])
    if leading and t.dim() == cache.dim() + 1:
        full = (batch,) + full
    if t.dim() != len(full) + 1:
        fail(ValueError, name, f"shape {tuple(t.shape)}", what)
    groups = t.shape[-1]
    if groups < 1 or width % groups or any(n not in (1, f) for n, f in zip(t.shape[:-1], full)):
        fail(ValueError, name, f"shape {tuple(t.shape)}", what)


def quant_of(spec) -> Optional[KVQuant]:
    """The call's :class:`KVQuant` (one with unit scales for a quantised cache given none), or None."""
    for m in spec.modifiers:
        if isinstance(m, KVQuant):
            return m
    return KVQuant() if spec.k.dtype is not spec.q.dtype else None


def with_cache_scales(found: tuple, q_dtype, k_dtype) -> tuple:
    """The modifiers ``found`` of a call, with a :class:`KVQuant` of unit scales added when the cache's
    dtype is not q's and none is given (a quantised cache read as stored)."""
    if k_dtype == q_dtype or any(isinstance(m, KVQuant) for m in found):
        return found
    return tuple(sorted(found + (KVQuant(),), key=lambda m: m.stage))


def cache_format(found: tuple, k: torch.Tensor, v: torch.Tensor) -> Optional[KVFormat]:
    """The format of a call's cache (:meth:`KVQuant.formats`, checked) given its modifiers ``found``, or
    None for a float cache read without scales."""
    quant = next((m for m in found if isinstance(m, KVQuant)), None)
    return None if quant is None else quant.formats(k, v)[0]


def without_cache_scales(modifiers: tuple) -> tuple:
    """The modifiers of a call whose cache is dequantised already."""
    return tuple(m for m in modifiers if not isinstance(m, KVQuant))


def dequantise(x: torch.Tensor, scale: Optional[torch.Tensor], offset: Optional[torch.Tensor], dtype,
               fmt: Optional[KVFormat] = None) -> torch.Tensor:
    """``(x + offset) * scale`` in ``dtype``, scale and offset broadcast along x's shape, their last
    dim (G channel groups) repeated over the groups' channels; x decoded by its format first (``fmt``,
    default its dtype's: int4 unpacked, q8_0 / q4_0 blocks times their own scales)."""
    fmt = fmt or DEFAULTS.get(x.dtype)
    y = x.to(dtype) if fmt is None else fmt.decode(x, dtype)
    for t, op in ((offset, torch.add), (scale, torch.mul)):
        if t is not None:
            y = op(y, t.to(dtype).repeat_interleave(y.shape[-1] // t.shape[-1], dim=-1))
    return y


def _per_sequence(t: Optional[torch.Tensor], cache: torch.Tensor, batch: int):
    """A scale as a (batch, *cache shape[:-1], G) view (a scale without a batch axis repeated)."""
    if t is None:
        return None
    if t.dim() == cache.dim():
        t = t[None]
    return t.expand((batch,) + tuple(cache.shape[:-1]) + (t.shape[-1],))


def _has_batch_axis(m: KVQuant, k: torch.Tensor) -> bool:
    return any(t is not None and t.dim() == k.dim() + 1 for t in (m.k_scale, m.k_offset, m.v_scale, m.v_offset))


def canonical_scales(spec, args) -> dict:
    """The kernels' scale keywords from a call's kernel arguments: each scale in the cache's canonical
    order (a BSND cache's (B, Sk, Hkv, G) read as (B, Hkv, Sk, G), as its keys are)."""
    out = {}
    for name in _SCALE_NAMES:
        t = getattr(args, name)  # a pool's scales stay in the pool's order, as its keys are read
        out[name] = t if t is None or spec.is_paged else to_canonical(t, spec.layout, None)
    out["q_scale"] = args.q_scale
    return out
