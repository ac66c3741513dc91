"""Writing a quantised KV cache: quantise new keys/values and store them in place, with their scales.

The caches these write are the ones :func:`tileattn.flash_attention` reads as stored with
``k_scale``/``k_offset``/``v_scale``/``v_offset`` (:mod:`tileattn.core.kvquant`): ``real = (x + offset) *
scale``.

* :func:`quantise`: x (float) -> (stored x in int8 / float8_e4m3fn / float8_e5m2 / int4, fp32 scale,
  fp32 offset or None), the scale taken over the dims ``reduce`` (the scale has size 1 there): per token
  ``reduce=(-1,)``, per channel over a block of tokens ``reduce=(0,)``, per tensor all dims; with
  ``group_size``, over groups of that many channels of the last dim instead of all of it (per-token
  groups: ``reduce=(-1,), group_size=32``; the scale's last dim is then ``D / group_size``). int8 and
  int4 are symmetric (offset None, ``x = round(real / scale)`` in [-127, 127] / [-7, 7]) or, with
  ``symmetric=False``, asymmetric: int8 centred on each group's midrange, int4 spanning the group's
  [min, max] over [-8, 7]; fp8 is symmetric, ``x = real / scale`` rounded to the format, with the
  group's absolute maximum mapped to the format's largest finite value. int4 (``dtype="int4"``) comes
  back packed, two values a byte (a torch.uint8 tensor with half the last dim; the layout in
  :mod:`tileattn.core.kvquant`).
* :func:`store`: write new tokens (T, Hkv, D) into a paged pool (num_blocks, block_size, Hkv, D) or a
  contiguous cache (B, S, Hkv, D) at flat slot indices (vLLM's ``slot_mapping``: block * block_size +
  offset, or b * S + position; each slot at most once per call), in place, whatever the cache's
  strides (a pool stored head-major within each page is a transposed view): quantised per token (or
  per group of channels of each token) into per-slot scale (and offset) caches of shape
  (num_blocks, block_size, Hkv, G), G = 1 or a divisor of D, or with a fixed scale, the same for every
  token, in the form ``flash_attention`` reads it (per channel (1, 1, Hkv, D), per group of channels
  (1, 1, Hkv, G), per head (1, 1, Hkv, 1), per tensor (1, 1, 1, 1)) or any shape broadcastable to
  (1, Hkv, D), or copied into a float cache. An int4 cache is a torch.uint8 tensor of last dim D / 2.
  Everything is checked before anything is written. Caches hold data, not a graph: ``new`` is read
  without autograd (a cache never joins a graph), while a given ``scale`` that requires grad is
  refused, as ``flash_attention`` refuses one.

Given scales are fp32, finite and positive (``real = stored * scale``: zero, a negative, NaN or inf
would store what no reader recovers).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from .core.kvformat import FORMATS
from .core.kvquant import INT4, INT4_STORAGE, QUANT_DTYPES, QUANT_NAMES, head_width, pack_int4
from .core.modifiers import fail

_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_TINY = 1e-12  # a group of zeros gets a tiny positive scale (and stores zeros)


def quantise(x: torch.Tensor, dtype, reduce: Sequence[int] = (-1,), symmetric: bool = True,
             scale: Optional[torch.Tensor] = None,
             group_size: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(stored, scale, offset) with ``(stored + offset) * scale ~= x``; see the module docstring.
    ``scale`` given: that (fp32, broadcastable to x) is used instead of one computed over ``reduce``."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype in QUANT_DTYPES:
        fail(TypeError, "x", getattr(x, "dtype", type(x).__name__), "a float tensor (the keys or values to store)")
    if dtype in _BLOCKS:
        return _ggml_blocks(x, FORMATS[dtype], reduce, symmetric, scale, group_size), None, None
    if dtype not in QUANT_DTYPES[:3] + (INT4,):
        fail(TypeError, "dtype", dtype, "torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, 'int4', 'q8_0' or 'q4_0'")
    if not symmetric and dtype not in (torch.int8, INT4):
        fail(ValueError, "symmetric", False, "True for fp8 (only int8 and int4 take an offset)")
    if dtype == INT4 and (x.dim() == 0 or x.shape[-1] % 2):
        fail(ValueError, "x", f"shape {tuple(x.shape)}", "an even last dim for int4 (two values a byte)")
    real = x.float()
    dims = _reduced_dims(reduce, x.dim())
    if group_size is not None:
        width = x.shape[-1] if x.dim() else 0
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 or width % group_size:
            fail(ValueError, "group_size", repr(group_size), f"a positive divisor of the last dim {width}")
        if scale is not None:
            fail(ValueError, "group_size", group_size, "None with a given scale (the scale's shape says its groups)")
        real = real.unflatten(-1, (width // group_size, group_size))  # the scale over each group's channels
        dims = tuple(d for d in dims if d != x.dim() - 1) + (x.dim(),)
    offset = None
    top = 127.0 if dtype is torch.int8 else 7.0 if dtype == INT4 else _FP8_MAX.get(dtype)
    if scale is not None:
        _check_scale(scale)
        if len(scale.shape) > x.dim() or any(n not in (1, f) for n, f in zip(scale.shape[::-1], x.shape[::-1])):
            fail(ValueError, "scale", f"shape {tuple(scale.shape)}", f"a shape broadcastable to x {tuple(x.shape)}")
    elif symmetric:
        peak = real.abs().amax(dim=dims, keepdim=True) if dims else real.abs()
        scale = (peak / top).clamp_min(_TINY)
    else:
        hi = real.amax(dim=dims, keepdim=True) if dims else real
        lo = real.amin(dim=dims, keepdim=True) if dims else real
        if dtype is torch.int8:
            scale = ((hi - lo) / 254.0).clamp_min(_TINY)
            offset = (hi + lo) / (2.0 * scale)  # real = (stored + offset) * scale: the midrange stores as 0
        else:
            scale = ((hi - lo) / 15.0).clamp_min(_TINY)
            offset = lo / scale + 8.0  # the group's minimum stores as -8, its maximum as 7
    scaled = real / scale - (0.0 if offset is None else offset)
    if group_size is not None:
        scaled = scaled.flatten(-2)
        scale = scale.squeeze(-1)
        offset = None if offset is None else offset.squeeze(-1)
    if dtype is torch.int8:
        stored = scaled.round().clamp_(-127, 127).to(torch.int8)
    elif dtype == INT4:
        stored = pack_int4(scaled.round().clamp_(-8 if offset is not None else -7, 7))
    else:
        stored = scaled.clamp(-top, top).to(dtype)
    return stored, scale, offset


#: llama.cpp's block formats, which hold their scales (:mod:`tileattn.core.kvformat`).
_BLOCKS = ("q8_0", "q4_0")


def _ggml_blocks(x, fmt, reduce, symmetric, scale, group_size) -> torch.Tensor:
    """x (..., D) as ggml's blocks of ``fmt`` (uint8 (..., D / 32 * block bytes)), rounded as llama.cpp's
    reference quantisers do: q8_0 ``d = absmax / 127``, ``q = round(x / d)`` (half away from zero); q4_0
    ``d = m / -8`` for the value m of largest magnitude, ``nibble = min(15, trunc(x / d + 8.5))``. The
    scale d is stored in fp16; the values are divided by d before it is rounded."""
    for name, value, default in (("reduce", reduce, (-1,)), ("symmetric", symmetric, True), ("scale", scale, None),
                                 ("group_size", group_size, None)):
        if (value is not None or default is not None) and (type(value) is not type(default) or value != default):
            fail(ValueError, name, repr(value), f"{default!r} for '{fmt.name}' (a scale per block of "
                 f"{fmt.block} values of the last dim, stored in the block)")
    if x.dim() == 0 or x.shape[-1] % fmt.block:
        fail(ValueError, "x", f"shape {tuple(x.shape)}", f"a last dim that is a multiple of {fmt.block} for "
             f"'{fmt.name}' (its block)")
    real = x.detach().float().unflatten(-1, (x.shape[-1] // fmt.block, fmt.block))
    if fmt.name == "q8_0":
        d = real.abs().amax(dim=-1, keepdim=True) / 127
        scaled = real * torch.where(d == 0, 0.0, 1.0 / d)
        body = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8).view(torch.uint8)
    else:
        peak = real.gather(-1, real.abs().argmax(dim=-1, keepdim=True))
        d = peak / -8
        nibbles = (real * torch.where(d == 0, 0.0, 1.0 / d) + 8.5).trunc().clamp(max=15).to(torch.uint8)
        body = nibbles[..., :16] | (nibbles[..., 16:] << 4)
    head = d.to(torch.float16).view(torch.uint8)  # little-endian, as ggml stores it
    return torch.cat((head, body), dim=-1).flatten(-2)


def _reduced_dims(reduce, ndim):
    """``reduce`` as sorted non-negative dims of an ``ndim``-d tensor (torch's rule: a 0-d tensor
    takes -1 and 0, and has nothing to reduce)."""
    bound = max(1, ndim)
    if not isinstance(reduce, (tuple, list)) or \
            any(isinstance(d, bool) or not isinstance(d, int) or not -bound <= d < bound for d in reduce):
        fail(ValueError, "reduce", repr(reduce), f"a tuple of dims of x in [-{bound}, {bound - 1}]")
    return tuple(sorted({d % ndim for d in reduce})) if ndim else ()


def _check_scale(scale):
    """A given scale: an fp32 tensor of finite positive values, not one autograd would have to reach."""
    if not isinstance(scale, torch.Tensor) or scale.dtype is not torch.float32:
        fail(TypeError, "scale", getattr(scale, "dtype", type(scale).__name__), "an fp32 tensor")
    if scale.requires_grad and torch.is_grad_enabled():
        fail(ValueError, "scale", "a tensor that requires grad",
             "a tensor without gradients (detach it or use torch.no_grad()): stored values are not differentiable")
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        fail(ValueError, "scale", f"{float(scale[bad].flatten()[0])} at {tuple(bad.nonzero()[0].tolist())}",
             "finite positive scales (real = stored * scale)")


def _fixed_scale(scale, heads, width):
    """:func:`store`'s fixed scale as a tensor broadcastable to the new tokens (T, Hkv, D)."""
    _check_scale(scale)
    shape = tuple(scale.shape)
    if len(shape) == 4 and shape[:2] == (1, 1) and shape[2] in (1, heads) and shape[3] and width % shape[3] == 0:
        return scale[0].repeat_interleave(width // shape[3], dim=-1)
    if len(shape) <= 3 and all(n in (1, f) for n, f in zip(shape[::-1], (width, heads, 1))):
        return scale
    fail(ValueError, "scale", f"shape {shape}", f"one scale for every token: (1, 1, {heads} or 1, G) with G dividing "
         f"{width}, as flash_attention reads the cache, or a shape broadcastable to (1, {heads}, {width})")


def _check_cache(name, t, width, packed=False):
    """A cache (N0, N1, Hkv, W) of any strides (slot s is [s // N1, s % N1]). ``packed``: an int4
    cache, W = width / 2 bytes."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        fail(TypeError, name, getattr(t, "shape", type(t).__name__),
             "a 4-d cache (num_blocks, block_size, kv_heads, head_dim) or (batch, seqlen, kv_heads, head_dim)")
    if head_width(t) != width:
        fail(ValueError, name, f"last dim {t.shape[-1]}" + (" (int4: two values a byte)" if packed else ""),
             f"{width // 2 if packed else width}" + (f" bytes for head dim {width}" if packed else ""))


def _check_groups(name, t, cache, width):
    """A per-slot scale (or offset) cache (N0, N1, Hkv, G): fp32, the cache's slots and heads, G dividing
    the head dim."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.dtype is not torch.float32 or \
            t.shape[-1] < 1 or width % t.shape[-1]:
        fail(ValueError, name, f"shape {tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t).__name__)}",
             f"fp32 (N0, N1, Hkv, G) slots, G dividing the head dim {width} (1: per token)")
    if t.shape[:3] != cache.shape[:3]:
        fail(ValueError, name, f"shape {tuple(t.shape)}",
             f"the cache's slots and heads {tuple(cache.shape[:3])} + (G,)")


def store(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor, *, scale_cache: Optional[torch.Tensor] = None,
          offset_cache: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None) -> None:
    """Write ``new`` (T, Hkv, D) at the flat ``slots`` (T,) of ``cache``, in place (module docstring).

    A quantised cache takes either ``scale_cache`` (fp32 (N0, N1, Hkv, G): per-token scales, or per
    group of D / G channels of each token, written at the same slots; with ``offset_cache`` alike,
    asymmetric int8 or int4) or a fixed ``scale`` (module docstring); a float cache takes neither.
    An int4 cache is torch.uint8 with last dim D / 2 (two values a byte).
    """
    if not isinstance(new, torch.Tensor) or new.dim() != 3 or not new.is_floating_point():
        fail(TypeError, "new", getattr(new, "shape", type(new).__name__), "a float tensor (tokens, kv_heads, head_dim)")
    if not isinstance(cache, torch.Tensor) or not (cache.is_floating_point() or cache.dtype in QUANT_DTYPES):
        fail(TypeError, "cache", f"dtype {cache.dtype}" if isinstance(cache, torch.Tensor) else type(cache).__name__,
             f"a float cache or a quantised one ({QUANT_NAMES})")
    packed = cache.dtype is INT4_STORAGE
    width = new.shape[-1]
    _check_cache("cache", cache, width, packed)
    slot_count, heads = cache.shape[0] * cache.shape[1], cache.shape[2]
    if heads != new.shape[1]:
        fail(ValueError, "new", f"{new.shape[1]} kv heads", f"{heads}, the cache's")
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.int32, torch.int64) or \
            tuple(slots.shape) != (new.shape[0],):
        fail(TypeError, "slots", getattr(slots, "shape", type(slots).__name__),
             f"an int64 tensor ({new.shape[0]},): the flat slot of each new token")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= slot_count):
        fail(ValueError, "slots", f"values in [{int(slots.min())}, {int(slots.max())}]",
             f"slots in [0, {slot_count}) of the cache")
    for name, t in (("new", new), ("slots", slots), ("scale_cache", scale_cache), ("offset_cache", offset_cache),
                    ("scale", scale)):
        if isinstance(t, torch.Tensor) and t.device != cache.device:
            fail(ValueError, name, f"device {t.device}", f"the cache's device {cache.device}")
    index = slots.long()
    if index.numel() > 1:
        seen, counts = torch.unique(index, return_counts=True)
        if bool((counts > 1).any()):
            fail(ValueError, "slots", f"slot {int(seen[counts > 1][0])} given {int(counts[counts > 1][0])} times",
                 "each slot at most once per call (a slot's value and its scale must come from one token)")
    fmt = INT4 if packed else cache.dtype
    if cache.dtype not in QUANT_DTYPES:
        for name, t in (("scale_cache", scale_cache), ("offset_cache", offset_cache), ("scale", scale)):
            if t is not None:
                fail(ValueError, name, "a tensor for a float cache", "None (the cache stores the values as given)")
        writes = [(cache, new.to(cache.dtype))]
    elif (scale_cache is None) == (scale is None):
        fail(ValueError, "scale_cache/scale", "both" if scale is not None else "neither",
             "per-token scales (scale_cache) or one fixed scale (scale) for a quantised cache")
    elif scale is not None:
        if offset_cache is not None:
            fail(ValueError, "offset_cache", "a tensor with a fixed scale", "None")
        writes = [(cache, quantise(new, fmt, scale=_fixed_scale(scale, heads, width))[0])]
    else:
        _check_groups("scale_cache", scale_cache, cache, width)
        if offset_cache is not None:
            _check_groups("offset_cache", offset_cache, cache, width)
            if offset_cache.shape[-1] != scale_cache.shape[-1]:
                fail(ValueError, "offset_cache", f"{offset_cache.shape[-1]} groups",
                     f"{scale_cache.shape[-1]}, the scale cache's")
            if fmt not in (torch.int8, INT4):
                fail(ValueError, "offset_cache", f"a tensor for a {fmt} cache",
                     "None (only int8 and int4 take offsets)")
        groups = scale_cache.shape[-1]
        stored, s, o = quantise(new, fmt, reduce=(-1,), symmetric=offset_cache is None,
                                group_size=None if groups == 1 else width // groups)
        writes = [(cache, stored), (scale_cache, s)] + ([] if offset_cache is None else [(offset_cache, o)])
    page, slot = index // cache.shape[1], index % cache.shape[1]
    with torch.no_grad():  # every value computed, every tensor checked: no write is left half-done
        for target, values in writes:
            target[page, slot] = values
