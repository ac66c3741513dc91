"""The spec: one validated description of an attention call.

Every public entry point (``flash_attention``, ``attention_partial``, the dialects) ends in
:func:`build_spec`, which checks the arguments *before any compute* and returns an
:class:`AttentionSpec`. Below this layer nothing parses user arguments: the op boundary flattens a
spec and rebuilds it without validating again (:mod:`tileattn.core.ops`), and engines read its fields.

Conventions used everywhere below the public API:

* ``B`` batch, ``Hq``/``Hkv`` query/key-value heads, ``Sq``/``Sk`` lengths, ``D`` head dim of q/k,
  ``Dv`` head dim of v.
* The *canonical view* of a padded tensor is ``(B, H, S, D)``; it is a strided view of the user's
  tensor (never a copy), whatever the layout (:mod:`tileattn.core.layouts`, the one table of them).
  Varlen (``layout="TND"``) tensors are ``(T, H, D)``; sequence ``b`` occupies rows
  ``cu_seqlens[b]:cu_seqlens[b+1]``. A paged KV cache is a pool of
  blocks, canonically ``(num_blocks, Hkv, block_size, D)``; sequence ``b`` reads the blocks listed in
  ``block_table[b]``.
* Sequence ``b`` has ``q_len`` queries and ``k_len`` keys (``seqused_k[b]`` when given) and a
  diagonal offset (:func:`tileattn.core.score_math.diagonal_offset`): see :class:`SequenceSlice`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import List, Optional, Tuple

import torch

from . import functions  # noqa: F401  (registers score_mod= / mask_mod= / block_mask=)
from .kernel_args import KernelArgs, lower
from .layouts import (  # noqa: F401  (LAYOUTS, empty_in_layout, user_shape: importable from here as before)
    LAYOUT, LAYOUTS, empty_in_layout, from_canonical, to_canonical, user_shape,
)
from .kvquant import (QUANT_DTYPES, QUANT_NAMES, _has_batch_axis, _per_sequence, cache_format, dequantise,
                      head_width, quant_of, with_cache_scales, without_cache_scales)
from .modifiers import Band, Modifier, check_keywords, fail, modifiers_from_keywords
from .score_math import diagonal_offset

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ALIGNS = ("bottom_right", "top_left")

_dispatch_modes = torch._C._len_torch_dispatch_stack
_get_dispatch_mode = torch._C._get_dispatch_mode
_TRACING_MODES = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY,
                  torch._C._TorchDispatchModeKey.FUNCTIONAL)


def tracing() -> bool:
    """Whether tensors are traced rather than computed: torch.compile or torch.export traces, or a
    tracing dispatch mode is active (FakeTensorMode, make_fx's proxy mode, functionalization). A call
    then runs as the custom op, which the mode records or answers (a FakeTensor gets the op's fake
    kernel), and the values of its sequence tensors are checked by the op when it runs, not read
    while tracing. A mode that only watches (FlopCounterMode, a logging mode) sees the call run as
    without it. Costs one C call when no dispatch mode is active."""
    return torch.compiler.is_compiling() or (
        _dispatch_modes() > 0 and any(_get_dispatch_mode(key) is not None for key in _TRACING_MODES))


@dataclass(frozen=True)
class SequenceSlice:
    """One attention problem of a call: batch item (or varlen sequence) ``batch``.

    Queries are rows ``q_start:q_start + q_len`` of the packed q (``q_start = 0`` when padded); keys
    ``k_start:k_start + k_len`` likewise (for a paged cache, the first ``k_len`` positions of the
    sequence's blocks). Query row ``i`` is aligned with key column ``i + offset``.
    """

    batch: int
    q_start: int
    q_len: int
    k_start: int
    k_len: int
    offset: int


@dataclass(frozen=True)
class AttentionSpec:
    """A validated attention call. Tensors are the user's; ``*_c`` are canonical strided views."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: str
    heads_q: int
    heads_kv: int
    batch: int
    seqlen_q: int  # the longest query sequence
    seqlen_k: int  # the longest key sequence (capacity for a paged cache)
    head_dim: int
    head_dim_v: int
    scale: float
    align: object = "bottom_right"  # "bottom_right", "top_left" or an int offset
    #: Modifiers in pipeline order (see :mod:`tileattn.core.modifiers`).
    modifiers: Tuple[Modifier, ...] = ()
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    seqused_k: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    deterministic: bool = False
    q_c: torch.Tensor = field(default=None, repr=False)
    k_c: torch.Tensor = field(default=None, repr=False)
    v_c: torch.Tensor = field(default=None, repr=False)
    #: The static kernel arguments when a plan lowered them already (see :attr:`kernel_args`).
    lowered: Optional[KernelArgs] = field(default=None, repr=False)

    #: The fields that hold the caller's tensors (or modifiers holding tensors): never in a plan.
    TENSOR_FIELDS = ("q", "k", "v", "q_c", "k_c", "v_c", "modifiers", "cu_seqlens_q", "cu_seqlens_k", "seqused_k",
                     "block_table")

    def template(self) -> dict:
        """Every field and derived value of this call that is not a tensor: what a plan keeps, and
        :meth:`from_template` rebinds to the next call of the same shape."""
        kept = {name: value for name, value in self.__dict__.items() if name not in self.TENSOR_FIELDS}
        kept["lowered"] = self.kernel_args.static() if "kernel_args" in self.__dict__ else self.lowered
        kept.pop("kernel_args", None)
        if self.seqused_k is not None or self.is_varlen:
            kept.pop("sequences", None)  # depends on the values of seqused_k / cu_seqlens
        return kept

    @staticmethod
    def from_template(template: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modifiers: tuple,
                      seqused_k: Optional[torch.Tensor] = None,
                      block_table: Optional[torch.Tensor] = None) -> "AttentionSpec":
        """The call of ``template`` with these tensors and modifiers, which must have the shapes,
        strides, dtypes, devices and modifier keys the template was made from (a padded layout). The
        values of ``seqused_k`` and ``block_table`` are not checked here: :func:`check_sequence_values`
        does that."""
        spec = object.__new__(AttentionSpec)
        spec.__dict__.update(template)
        layout = template["layout"]
        kv_layout, heads_kv = ("paged" if block_table is not None else layout), template["heads_kv"]
        k_c, v_c = to_canonical(k, kv_layout, heads_kv), to_canonical(v, kv_layout, heads_kv)
        spec.__dict__.update(q=q, k=k, v=v, q_c=to_canonical(q, layout, template["heads_q"]), k_c=k_c, v_c=v_c,
                             modifiers=modifiers, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=seqused_k,
                             block_table=block_table)
        lowered = template["lowered"]
        if lowered is not None:
            spec.__dict__["kernel_args"] = lowered.bound(modifiers)
        return spec

    @cached_property
    def kernel_args(self) -> KernelArgs:
        """The modifiers lowered for the engines, with this call's tensors bound."""
        static = self.lowered if self.lowered is not None else lower(self.modifiers, self.scale, self.align)
        return static.bound(self.modifiers)

    def for_engines(self) -> "AttentionSpec":
        """The call as engines see it: without the modifiers applied above them (sinks)."""
        if not any(m.applied_by_op for m in self.modifiers):
            return self
        return replace(self, modifiers=tuple(m for m in self.modifiers if not m.applied_by_op))

    @property
    def kinds(self) -> Tuple[str, ...]:
        return tuple(m.kind for m in self.modifiers)

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_varlen(self) -> bool:
        return self.layout == "TND"

    @property
    def is_paged(self) -> bool:
        return self.block_table is not None

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def band(self) -> Optional[Band]:
        """The call's band (causal / window), or None: the geometry flop counts and tuning read."""
        for m in self.modifiers:
            band = m.keys_band()
            if band is not None:
                return band
        return None

    @property
    def causal(self) -> bool:
        band = self.band
        return band is not None and band.right == 0

    @property
    def block_size(self) -> int:
        """Positions per block of a paged cache."""
        return self.k_c.shape[2]

    @property
    def rows_q(self) -> int:
        """Rows of the output: packed tokens (TND) or the padded query length."""
        return self.q_c.shape[0] if self.is_varlen else self.seqlen_q

    def acc_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def lse_shape(self) -> tuple:
        return (self.heads_q, self.rows_q) if self.is_varlen else (self.batch, self.heads_q, self.seqlen_q)

    def out_shape(self) -> tuple:
        return user_shape(self.layout, self.batch, self.heads_q, self.rows_q, self.head_dim_v)

    @cached_property
    def sequences(self) -> List[SequenceSlice]:
        """Every sequence of the call (reads cu_seqlens / seqused_k from the device once)."""
        if self.is_varlen:
            cq = self.cu_seqlens_q.tolist()
            q_spans = [(cq[b], cq[b + 1] - cq[b]) for b in range(self.batch)]
        else:
            q_spans = [(0, self.seqlen_q)] * self.batch
        if self.cu_seqlens_k is not None:
            ck = self.cu_seqlens_k.tolist()
            k_spans = [(ck[b], ck[b + 1] - ck[b]) for b in range(self.batch)]
        else:
            k_spans = [(0, self.seqlen_k)] * self.batch
        if self.seqused_k is not None:
            used = self.seqused_k.tolist()
            k_spans = [(k0, n) for (k0, _), n in zip(k_spans, used)]
        return [SequenceSlice(b, q0, lq, k0, lk, diagonal_offset(self.align, lq, lk))
                for b, ((q0, lq), (k0, lk)) in enumerate(zip(q_spans, k_spans))]

    def visible_pairs(self) -> int:
        """(row, key) pairs inside the band summed over sequences (a bool mask is not counted)."""
        band = self.band
        total = 0
        for s in self.sequences:
            total += s.q_len * s.k_len if band is None else band.visible_pairs(s.q_len, s.k_len, s.offset)
        return total

    def flops(self) -> float:
        """Forward FLOPs of the useful work: 2 GEMMs over the visible pairs of every head."""
        return 2.0 * self.visible_pairs() * self.heads_q * (self.head_dim + self.head_dim_v)


def sequence_views(spec: AttentionSpec, seq: SequenceSlice):
    """(q, k, v) of one sequence as (Hq, q_len, D), (Hkv, k_len, D), (Hkv, k_len, Dv).

    Views of the user's tensors, except for a paged cache, whose blocks are gathered (a copy).
    """
    b, q0, lq, k0, lk = seq.batch, seq.q_start, seq.q_len, seq.k_start, seq.k_len
    if spec.is_varlen:
        q = spec.q_c[q0:q0 + lq].transpose(0, 1)
    else:
        q = spec.q_c[b]
    if spec.is_paged:
        blocks = spec.block_table[b, : -(-lk // spec.block_size)].long()

        def gather(pool):  # (num_blocks, H, block_size, E) -> (H, k_len, E)
            return pool[blocks].transpose(0, 1).flatten(1, 2)[:, :lk]

        return q, gather(spec.k_c), gather(spec.v_c)
    if spec.cu_seqlens_k is not None:
        return q, spec.k_c[k0:k0 + lk].transpose(0, 1), spec.v_c[k0:k0 + lk].transpose(0, 1)
    return q, spec.k_c[b, :, :lk], spec.v_c[b, :, :lk]


def _check_tensor(name: str, t, rank: int, shape_name: str, layout_note: str, dtypes=FLOAT_DTYPES):
    if not isinstance(t, torch.Tensor):
        fail(TypeError, name, type(t).__name__, f"a torch.Tensor of shape {shape_name}")
    if t.layout != torch.strided or getattr(t, "is_nested", False):
        fail(TypeError, name, "a nested tensor" if t.layout == torch.strided else f"a {t.layout} tensor",
             "a regular strided (dense) tensor")
    if t.dtype not in dtypes:
        fail(TypeError, name, f"dtype {t.dtype}", "one of float16, bfloat16, float32, float64"
             + (f" (or a quantised cache: {QUANT_NAMES})" if dtypes is not FLOAT_DTYPES else ""))
    if t.dim() != rank:
        fail(ValueError, name, f"{t.dim()}-d tensor of shape {tuple(t.shape)}", f"a {rank}-d tensor {shape_name}{layout_note}")


def check_int(name, value, minimum=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(TypeError, name, repr(value), "an int")
    if minimum is not None and value < minimum:
        fail(ValueError, name, value, f"an int >= {minimum}")
    return int(value)


def check_bool(name, value) -> bool:
    if not isinstance(value, bool):
        fail(TypeError, name, repr(value), "True or False")
    return value


def _check_index_tensor(name, t, shape, device, what):
    """An int32 index tensor of ``shape`` (None: any size along that dim) on ``device``."""
    shown = "(" + ", ".join("n" if n is None else str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"
    if not isinstance(t, torch.Tensor):
        fail(TypeError, name, type(t).__name__, f"an int32 tensor of shape {shown}: {what}")
    if t.dtype != torch.int32:
        fail(TypeError, name, f"dtype {t.dtype}", f"torch.int32 ({what})")
    if t.dim() != len(shape) or any(n is not None and m != n for m, n in zip(t.shape, shape)):
        fail(ValueError, name, f"shape {tuple(t.shape)}", f"{shown}: {what}")
    if t.device != device:
        fail(ValueError, name, f"device {t.device}", f"device {device}, as q")


def _check_cu_seqlens(name, cu, batch, device):
    _check_index_tensor(name, cu, (None if batch is None else batch + 1,), device, "cumulative sequence offsets")
    if cu.numel() < 2:
        fail(ValueError, name, f"shape {tuple(cu.shape)}", "a 1-d tensor of length B+1 >= 2")


def _offsets_max(name, cu, total) -> int:
    values = cu.tolist()
    if values[0] != 0:
        fail(ValueError, name, f"first entry {values[0]}", "cumulative offsets starting at 0")
    if any(b < a for a, b in zip(values, values[1:])):
        fail(ValueError, name, values, "non-decreasing cumulative offsets")
    if values[-1] != total:
        fail(ValueError, name, f"last entry {values[-1]}", f"the token count {total} of the packed tensor")
    return max(b - a for a, b in zip(values, values[1:]))


def check_sequence_values(spec: "AttentionSpec", max_seqlen_q=None, max_seqlen_k=None) -> "AttentionSpec":
    """Check the values of cu_seqlens, seqused_k and block_table (data, read from the device) and
    return the spec with the true longest lengths. :func:`build_spec` calls it; while
    ``torch.compile`` traces, the values are data a graph cannot branch on, so the op calls it
    instead, with real tensors, before computing (:mod:`tileattn.core.ops`)."""
    sq, sk = spec.seqlen_q, spec.seqlen_k
    if spec.is_varlen:
        sq = _offsets_max("cu_seqlens_q", spec.cu_seqlens_q, spec.q_c.shape[0])
        if spec.cu_seqlens_k is not None:
            sk = _offsets_max("cu_seqlens_k", spec.cu_seqlens_k, spec.k_c.shape[0])
        for name, given, actual in (("max_seqlen_q", max_seqlen_q, sq), ("max_seqlen_k", max_seqlen_k, sk)):
            if given is not None and given < actual and not (name == "max_seqlen_k" and spec.is_paged):
                fail(ValueError, name, given, f">= {actual}, the longest sequence in the cu_seqlens")
    if spec.is_paged and spec.block_table.numel():
        lo, hi = int(spec.block_table.min()), int(spec.block_table.max())
        if lo < 0 or hi >= spec.k_c.shape[0]:
            fail(ValueError, "block_table", f"block indices in [{lo}, {hi}]",
                 f"indices in [0, {spec.k_c.shape[0]}) (the blocks of k/v)")
    if spec.seqused_k is not None:
        used = spec.seqused_k.tolist()
        capacity = spec.cu_seqlens_k.diff().tolist() if spec.cu_seqlens_k is not None else [sk] * spec.batch
        bad = [(b, n, c) for b, (n, c) in enumerate(zip(used, capacity)) if not 0 <= n <= c]
        if bad:
            b, n, c = bad[0]
            fail(ValueError, "seqused_k", f"{n} keys for sequence {b}", f"a count in [0, {c}] (the keys it has)")
    if (sq, sk) == (spec.seqlen_q, spec.seqlen_k):
        return spec
    return replace(spec, seqlen_q=sq, seqlen_k=sk)


def _check_align(align):
    if isinstance(align, str):
        if align not in ALIGNS:
            fail(ValueError, "align", repr(align), "'bottom_right', 'top_left' or an int diagonal offset")
        return align
    if isinstance(align, bool) or not isinstance(align, numbers.Integral):
        fail(TypeError, "align", repr(align), "'bottom_right', 'top_left' or an int diagonal offset")
    if abs(align) > 2**62:
        fail(ValueError, "align", repr(align), "an offset within +-2**62")
    return int(align)


#: The keywords of a call that are not variant keywords (those belong to the modifier types).
CALL_KEYWORDS = ("layout", "num_heads", "scale", "align", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                 "max_seqlen_k", "seqused_k", "block_table", "deterministic", "modifiers")


def build_spec(
    q, k, v, *, layout="BNSD", num_heads=None, scale=None, align="bottom_right", cu_seqlens_q=None,
    cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None, block_table=None, deterministic=False,
    modifiers=(), **variants,
) -> AttentionSpec:
    """Validate a call and build its :class:`AttentionSpec`. Raises before any compute.

    ``variants`` are the variant keywords of :func:`tileattn.flash_attention` (``causal``, ``mask``,
    ...), turned into modifiers by :func:`tileattn.core.modifiers.modifiers_from_keywords`; ``modifiers``
    adds modifier objects (already built: a caller's own modifier type, or context parallelism's).
    """
    check_keywords(variants, CALL_KEYWORDS)
    return spec_of(q, k, v, modifiers_from_keywords(variants, modifiers), layout=layout, num_heads=num_heads,
                   scale=scale, align=align, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_k=seqused_k,
                   block_table=block_table, deterministic=deterministic)


def spec_of(q, k, v, found: Tuple[Modifier, ...], *, layout="BNSD", num_heads=None, scale=None, align="bottom_right",
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
            block_table=None, deterministic=False) -> AttentionSpec:
    """:func:`build_spec` for modifiers already parsed by
    :func:`tileattn.core.modifiers.modifiers_from_keywords` (``found``, in pipeline order). The steps,
    each raising before any compute: the layout, the tensors, their canonical views, heads and head
    dims, the scale and flags, the sequences' lengths; then the spec, which each modifier checks, and
    (outside a trace) the sequence tensors' values."""
    layout, block_table = _layout_of(layout, k, cu_seqlens_q, cu_seqlens_k, block_table)
    paged = block_table is not None
    found, fmt = _check_tensors(q, k, v, layout, paged, found)
    q_c, k_c, v_c, num_heads = _canonical_views(q, k, v, layout, num_heads, paged)
    hq, hkv, d, dv = _check_heads(q, k, v, q_c, k_c, v_c, layout, paged, num_heads, fmt)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        fail(TypeError, "scale", repr(scale), "a finite float (default 1/sqrt(head_dim))")
    if not math.isfinite(scale):
        fail(ValueError, "scale", repr(scale), "a finite float (default 1/sqrt(head_dim))")
    check_bool("deterministic", deterministic)
    align = _check_align(align)
    batch, sq, sk = _sequence_lengths(layout, q_c, k_c, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      seqused_k, block_table)
    spec = AttentionSpec(
        q=q, k=k, v=v, layout=layout, heads_q=hq, heads_kv=hkv, batch=batch, seqlen_q=sq, seqlen_k=sk,
        head_dim=d, head_dim_v=dv, scale=float(scale), align=align, modifiers=found,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, block_table=block_table,
        deterministic=deterministic, q_c=q_c, k_c=k_c, v_c=v_c,
    )
    for m in found:
        m.check(spec)
    if tracing():
        return spec
    return check_sequence_values(spec, max_seqlen_q, max_seqlen_k)


def _layout_of(layout, k, cu_seqlens_q, cu_seqlens_k, block_table):
    """(the layout's name, the block table): a contiguous cache (B, S, Hkv, D) under varlen queries is
    the pool of B pages of S slots, sequence b reading page b."""
    if not isinstance(layout, str) or layout.upper() not in LAYOUTS:
        exc = ValueError if isinstance(layout, str) else TypeError
        fail(exc, "layout", repr(layout), "one of " + ", ".join(repr(x) for x in LAYOUTS))
    layout = layout.upper()
    if layout == "TND" and block_table is None and cu_seqlens_k is None and isinstance(k, torch.Tensor) \
            and k.dim() == 4 and isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1:
        # Varlen queries against a contiguous cache (B, S, Hkv, D) (with seqused_k, a ragged batch).
        if k.shape[0] != cu_seqlens_q.numel() - 1:
            fail(ValueError, "k", f"a cache of {k.shape[0]} sequences (shape {tuple(k.shape)})",
                 f"one row per sequence of cu_seqlens_q ({cu_seqlens_q.numel() - 1}), or a paged pool with block_table")
        block_table = torch.arange(k.shape[0], dtype=torch.int32, device=k.device)[:, None]
    return layout, block_table


def _check_tensors(q, k, v, layout, paged, found):
    """q, k and v: ranks, dtypes (a quantised cache's too) and one device. Returns the modifiers with a
    quantised cache's scales (:func:`tileattn.core.kvquant.with_cache_scales`) and the cache's format
    (:class:`tileattn.core.kvformat.KVFormat`; None: a float cache)."""
    lay, pool = LAYOUT[layout], LAYOUT["paged"]
    _check_tensor("q", q, lay.rank, lay.shape_name, f" for layout='{layout}'")
    cache_dtypes = FLOAT_DTYPES + QUANT_DTYPES
    for name, t in (("k", k), ("v", v)):
        if paged:
            _check_tensor(name, t, pool.rank, pool.shape_name, " (a paged cache: block_table is given)", cache_dtypes)
        else:
            _check_tensor(name, t, lay.rank, lay.shape_name, f" for layout='{layout}'", cache_dtypes)
    if k.dtype != v.dtype or (k.dtype != q.dtype and k.dtype not in QUANT_DTYPES):
        fail(TypeError, "k/v", f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}",
             f"one shared dtype (or k and v of one quantised dtype: {QUANT_NAMES})")
    found = with_cache_scales(found, q.dtype, k.dtype)
    if not (q.device == k.device == v.device):
        fail(ValueError, "k/v", f"devices q={q.device}, k={k.device}, v={v.device}", "one shared device")
    return found, cache_format(found, k, v)


def _canonical_views(q, k, v, layout, num_heads, paged):
    """(q_c, k_c, v_c, num_heads): the canonical views, a fused layout's widths split by ``num_heads``."""
    if LAYOUT[layout].fused:
        if num_heads is None:
            fail(ValueError, "num_heads", None, f"the number of query heads (required for layout='{layout}')")
        num_heads = check_int("num_heads", num_heads, 1)
        if q.shape[2] == 0 or q.shape[2] % num_heads:
            fail(ValueError, "num_heads", num_heads, f"a divisor of q's width {q.shape[2]} (which must be positive)")
        d = q.shape[2] // num_heads
        q_c = to_canonical(q, layout, num_heads)
        if paged:
            return q_c, to_canonical(k, "paged", None), to_canonical(v, "paged", None), num_heads
        if k.shape[2] == 0 or k.shape[2] % d:
            fail(ValueError, "k", f"width {k.shape[2]}", f"a positive multiple of the head dim {d} (q width / num_heads)")
        hkv = k.shape[2] // d
        if v.shape[2] == 0 or v.shape[2] % hkv:
            fail(ValueError, "v", f"width {v.shape[2]}", f"a positive multiple of the {hkv} kv heads")
        return q_c, to_canonical(k, layout, hkv), to_canonical(v, layout, hkv), num_heads
    if num_heads is not None:
        num_heads = check_int("num_heads", num_heads, 1)
    k_c, v_c = (to_canonical(t, "paged" if paged else layout, None) for t in (k, v))
    return to_canonical(q, layout, None), k_c, v_c, num_heads


def _check_heads(q, k, v, q_c, k_c, v_c, layout, paged, num_heads, fmt):
    """(query heads, kv heads, head dim, value head dim), checked against each other and the batch."""
    hq, hkv = q_c.shape[1], k_c.shape[1]
    batch = None if layout == "TND" else q_c.shape[0]
    if batch is not None and not paged and (k_c.shape[0] != batch or v_c.shape[0] != batch):
        fail(ValueError, "k/v", f"batch sizes q={batch}, k={k_c.shape[0]}, v={v_c.shape[0]}", "equal batch sizes")
    if num_heads is not None and hq != num_heads:
        fail(ValueError, "num_heads", num_heads, f"{hq}, the number of heads in q")
    if v_c.shape[1] != hkv:
        fail(ValueError, "v", f"{v_c.shape[1]} heads", f"{hkv} heads, as in k")
    if hq == 0:
        fail(ValueError, "q", "0 heads", "at least one query head")
    if hkv == 0 or hq % hkv:
        fail(ValueError, "k", f"{hkv} kv heads for {hq} query heads", "a number of kv heads dividing the query heads (GQA/MQA)")
    d, dv = q_c.shape[-1], head_width(v_c, fmt)  # int4: two channels a byte; q8_0 / q4_0: 32 a block
    if fmt is not None and fmt.scales == "inside" and d % fmt.block:
        fail(ValueError, "k_format", f"'{fmt.name}' for head dim {d}",
             f"a head dim that is a multiple of {fmt.block} ({fmt.name}'s block) or another format")
    if head_width(k_c, fmt) != d:
        packed = fmt is not None and fmt.block > 1
        fail(ValueError, "k", f"{k_c.shape[-1]} bytes of {fmt.name} a row" if packed else f"head dim {k_c.shape[-1]}",
             f"the head dim of q, {d}" + (f" ({fmt.row_size(d)} bytes of {fmt.name}, {fmt.block} values per "
                                          f"{fmt.block_bytes} bytes)" if packed else ""))
    if d == 0 or dv == 0:
        fail(ValueError, "q/v", f"head dims {d}/{dv}", "positive head dims")
    if paged:
        if v_c.shape[:3] != k_c.shape[:3]:
            fail(ValueError, "v", f"shape {tuple(v.shape)}", f"the blocks, block size and heads of k {tuple(k.shape[:3])}")
    elif k_c.shape[-2] != v_c.shape[-2] or (layout == "TND" and k_c.shape[0] != v_c.shape[0]):
        fail(ValueError, "v", f"shape {tuple(v.shape)}", f"the sequence length of k {tuple(k.shape)}")
    return hq, hkv, d, dv


def _sequence_lengths(layout, q_c, k_c, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                      block_table):
    """(batch, Sq, Sk) from varlen offsets, a paged cache or the tensors, and the index tensors'
    shapes, dtypes and devices (their values are checked at the end, by check_sequence_values)."""
    device, paged = q_c.device, block_table is not None
    for name, given in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if given is not None:
            check_int(name, given, 0)
    if layout == "TND":
        if cu_seqlens_q is None:
            fail(ValueError, "cu_seqlens_q", "None", "int32 cumulative offsets, required for layout='TND'")
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, device)
        batch = cu_seqlens_q.numel() - 1
        if paged:
            if cu_seqlens_k is not None:
                fail(ValueError, "cu_seqlens_k", "a tensor with a paged cache", "None (key lengths come from seqused_k)")
        else:
            if cu_seqlens_k is None:
                fail(ValueError, "cu_seqlens_k", "None", "int32 cumulative offsets, required for layout='TND'")
            _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch, device)
        sq, sk = max_seqlen_q or 0, max_seqlen_k or 0
    else:
        for name, val in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                          ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if val is not None:
                fail(ValueError, name, repr(val) if isinstance(val, int) else "a tensor",
                     f"None for the padded layout '{layout}' (varlen arguments need layout='TND')")
        batch, sq, sk = q_c.shape[0], q_c.shape[2], (0 if paged else k_c.shape[2])
    if paged:
        _check_index_tensor("block_table", block_table, (batch, None), device, "the cache blocks of each sequence")
        sk = block_table.shape[1] * k_c.shape[2]
    if seqused_k is not None:
        _check_index_tensor("seqused_k", seqused_k, (batch,), device, "keys used by each sequence")
    return batch, sq, sk


def dequantised_spec(spec, dtype):
    """The call with its cache dequantised into ``dtype`` (and q_scale folded into q): a plain spec
    that any engine and the reference run. Memory: a copy of the cache (of the pages the sequences
    read, for per-sequence scales of a paged pool)."""
    m = quant_of(spec)
    q = spec.q
    if m.q_scale is not None:
        factor = m.q_scale.to(dtype).expand(spec.batch, spec.heads_kv).repeat_interleave(spec.group_size, dim=1)
        if spec.is_varlen:
            lengths = spec.cu_seqlens_q.diff().long()
            factor = factor[torch.repeat_interleave(torch.arange(spec.batch, device=q.device), lengths)]
            q = spec.q_c.to(dtype) * factor[:, :, None]
        else:
            q_c = spec.q_c.to(dtype) * factor[:, :, None, None]
            q = from_canonical(q_c, spec.layout)
    else:
        q = q.to(dtype)
    k, v, block_table = spec.k, spec.v, spec.block_table
    fmt = m.formats(k, v)[0]
    if not _has_batch_axis(m, k):
        kd, vd = dequantise(k, m.k_scale, m.k_offset, dtype, fmt), dequantise(v, m.v_scale, m.v_offset, dtype, fmt)
    elif spec.is_paged:
        # Per-sequence scales over a shared pool: each sequence gets its own dequantised pages.
        b = spec.batch
        rows, table = torch.arange(b, device=k.device)[:, None], block_table.long()

        def pages(x, scale, offset):
            scale, offset = _per_sequence(scale, x, b), _per_sequence(offset, x, b)
            return dequantise(x[table], None if scale is None else scale[rows, table],
                              None if offset is None else offset[rows, table], dtype).flatten(0, 1)

        kd, vd = pages(k, m.k_scale, m.k_offset), pages(v, m.v_scale, m.v_offset)
        block_table = torch.arange(kd.shape[0], dtype=torch.int32, device=k.device).view(table.shape)
    else:  # packed TND keys, per-sequence scales: token t reads the scales of its own sequence
        b = spec.batch
        owner = torch.repeat_interleave(torch.arange(b, device=k.device), spec.cu_seqlens_k.diff().long())
        tokens = torch.arange(k.shape[0], device=k.device)

        def packed(x, scale, offset):
            scale, offset = _per_sequence(scale, x, b), _per_sequence(offset, x, b)
            return dequantise(x, None if scale is None else scale[owner, tokens],
                              None if offset is None else offset[owner, tokens], dtype)

        kd, vd = packed(k, m.k_scale, m.k_offset), packed(v, m.v_scale, m.v_offset)
    others = without_cache_scales(spec.modifiers)
    return spec_of(q, kd, vd, others, layout=spec.layout, scale=spec.scale, align=spec.align,
                   cu_seqlens_q=spec.cu_seqlens_q, cu_seqlens_k=spec.cu_seqlens_k, seqused_k=spec.seqused_k,
                   block_table=block_table, deterministic=spec.deterministic)
