"""tileattn: exact FlashAttention everywhere PyTorch runs.

One operator, :func:`flash_attention`, forward and backward, served by several engines (a tiled CPU
engine, Triton kernels for GPUs, an exact reference) behind one dispatcher that says why an engine
refused a call.
"""

from .api import explain, flash_attention
from .dispatch import NoBackendError, get_backend, list_backends
from .reference import reference
from .spec import LAYOUTS

__version__ = "0.1.0"

__all__ = [
    "flash_attention",
    "reference",
    "explain",
    "list_backends",
    "get_backend",
    "NoBackendError",
    "LAYOUTS",
    "__version__",
]
