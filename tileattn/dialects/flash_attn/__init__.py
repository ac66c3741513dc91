"""Stand-in for the ``flash_attn`` 2.x package: ``import tileattn.compat.flash_attn as flash_attn``.

Same functions, signatures and semantics as flash-attn 2.x (``(B, S, H, D)`` tensors, bottom-right
causal, ``window_size=(-1, -1)``, softcap, ALiBi, dropout, LSE), computed by tileattn. Unlike the
original it also runs on CPU and in fp32/fp64.
"""

from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

#: The flash-attn API version these functions mirror (not tileattn's version).
__version__ = "2.7.4"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
