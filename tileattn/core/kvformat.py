"""K/V cache formats: what the bytes of a quantised cache mean, one named :class:`KVFormat` each.

A format says how a row of a cache tensor holds a head's values: the dtype of the stored tensor, how
many values a block holds and in how many elements of that dtype, and where the block's scale lives:

* ``"beside"``: no scale in the row; fp32 ``k_scale``/``k_offset``/``v_scale``/``v_offset`` tensors
  (:mod:`tileattn.core.kvquant`) hold them, with strides of their own (int8, e4m3, e5m2, int4);
* ``"inside"``: each block starts with its own scale (llama.cpp's ggml blocks): ``q8_0`` is per 32
  values an fp16 ``d`` then 32 int8 ``q`` (34 bytes, value ``d * q``); ``q4_0`` an fp16 ``d`` then 16
  bytes of nibbles, the low nibbles the block's first 16 values and the high nibbles its last 16
  (18 bytes, value ``d * (nibble - 8)``). Value ``i`` of a row lives in block ``i // 32``.

The registry :data:`FORMATS` names them ("int8", "e4m3", "e5m2", "int4", "q8_0", "q4_0"). A cache
given without a format name (``k_format``/``v_format`` of :func:`tileattn.flash_attention`) has its
dtype's default format (:data:`DEFAULTS`: int8, float8_e4m3fn, float8_e5m2, uint8 -> int4), so a
uint8 tensor holds ggml blocks only when the call says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from .modifiers import fail


@dataclass(frozen=True)
class KVFormat:
    """One K/V cache format (the module docstring). ``decode(stored, dtype)``: the values of a cache
    (..., W) as a tensor (..., head dim) of ``dtype``, its inside scales applied (exact in fp32 and fp64
    for every format here); beside scales are the caller's."""

    name: str
    storage: torch.dtype
    block: int
    block_bytes: int
    scales: str
    scale_dtype: torch.dtype
    decode: Callable[[torch.Tensor, torch.dtype], torch.Tensor] = field(compare=False, repr=False)

    def width(self, last_dim: int) -> int:
        """The head dim a row of ``last_dim`` stored elements holds."""
        return last_dim // self.block_bytes * self.block

    def row_size(self, head_dim: int) -> int:
        """The stored elements of a row of ``head_dim`` values (a multiple of :attr:`block`)."""
        return head_dim // self.block * self.block_bytes


def unpack_int4(x: torch.Tensor) -> torch.Tensor:
    """int4 values of a packed cache (..., W) as int8 (..., 2W): byte c holds channel 2c in its low
    nibble and channel 2c + 1 in its high nibble, each a two's complement int4 in [-8, 7]."""
    low = (x & 15).to(torch.int8)
    high = (x >> 4).to(torch.int8)
    return ((torch.stack((low, high), dim=-1) ^ 8) - 8).flatten(-2)


def _int4(x: torch.Tensor, dtype) -> torch.Tensor:
    return unpack_int4(x).to(dtype)


def _ggml(block_bytes: int, values: Callable[[torch.Tensor], torch.Tensor]):
    """The decoder of a ggml block format: an fp16 scale, then ``values`` of the block's other bytes."""
    def decode(x: torch.Tensor, dtype) -> torch.Tensor:
        blocks = x.unflatten(-1, (x.shape[-1] // block_bytes, block_bytes))
        d = blocks[..., :2].contiguous().view(torch.float16).to(dtype)  # little-endian fp16
        return (d * values(blocks[..., 2:]).to(dtype)).flatten(-2)
    return decode


def _q8_0(body: torch.Tensor) -> torch.Tensor:
    return body.contiguous().view(torch.int8)


def _q4_0(body: torch.Tensor) -> torch.Tensor:
    return torch.cat((body & 15, body >> 4), dim=-1).to(torch.int8) - 8


def _cast(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype)


#: The formats by name.
FORMATS: Dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("int8", torch.int8, 1, 1, "beside", torch.float32, _cast),
    KVFormat("e4m3", torch.float8_e4m3fn, 1, 1, "beside", torch.float32, _cast),
    KVFormat("e5m2", torch.float8_e5m2, 1, 1, "beside", torch.float32, _cast),
    KVFormat("int4", torch.uint8, 2, 1, "beside", torch.float32, _int4),
    KVFormat("q8_0", torch.uint8, 32, 34, "inside", torch.float16, _ggml(34, _q8_0)),
    KVFormat("q4_0", torch.uint8, 32, 18, "inside", torch.float16, _ggml(18, _q4_0)),
)}

#: The format of a cache of each quantised dtype given without a format name.
DEFAULTS: Dict[torch.dtype, KVFormat] = {f.storage: f for f in FORMATS.values() if f.scales == "beside"}


def format_of(name, dtype, arg: str = "k_format") -> Optional[KVFormat]:
    """The format called ``name`` (argument ``arg``), or the default of a cache of ``dtype`` when
    ``name`` is None (None for a float cache)."""
    if name is None:
        return DEFAULTS.get(dtype)
    if not isinstance(name, str):
        fail(TypeError, arg, type(name).__name__, "a format name: " + ", ".join(repr(n) for n in FORMATS))
    if name not in FORMATS:
        fail(ValueError, arg, repr(name), "a format name: " + ", ".join(repr(n) for n in FORMATS))
    return FORMATS[name]


def check_cache(arg: str, t: torch.Tensor, fmt: KVFormat, format_arg: str) -> None:
    """A cache tensor ``t`` (argument ``arg``) that holds format ``fmt`` (named by ``format_arg``): its
    dtype and whole blocks a row."""
    if t.dtype is not fmt.storage:
        fail(TypeError, arg, f"dtype {t.dtype}", f"{fmt.storage} for {format_arg}='{fmt.name}'")
    if t.shape[-1] % fmt.block_bytes:
        fail(ValueError, arg, f"last dim {t.shape[-1]}", f"a multiple of {fmt.block_bytes} ({format_arg}='{fmt.name}': "
             f"{fmt.block_bytes} bytes per {fmt.block} values)")
