"""tileattn: exact FlashAttention everywhere PyTorch runs.

One operator, :func:`flash_attention`, forward and backward, served by several engines (a tiled CPU
engine, Triton kernels for GPUs, an exact reference) behind one dispatcher that says why an engine
refused a call.
"""

from .core.api import AttentionGradients, attention_backward, attention_partial, explain, flash_attention
from .core.dispatch import NoBackendError, get_backend, list_backends
from .core.merge import merge_attentions
from .dialects.flex import flex_attention, patch_flex
from .core.reference import reference
from .core.spec import LAYOUTS
from .dialects import flash_attn as _flash_attn
from .dialects import npu
from .dialects.flash_attn import *  # noqa: F401,F403  (the flash-attn 2.x functions, its __all__)
from .dialects.sdpa import patch_sdpa, scaled_dot_product_attention

__version__ = "0.1.0"

__all__ = [
    "flash_attention",
    "attention_partial",
    "attention_backward",
    "AttentionGradients",
    "merge_attentions",
    "flex_attention",
    "patch_flex",
    "reference",
    "explain",
    "list_backends",
    "get_backend",
    "NoBackendError",
    "LAYOUTS",
    "npu",
    *_flash_attn.__all__,
    "scaled_dot_product_attention",
    "patch_sdpa",
    "__version__",
]
