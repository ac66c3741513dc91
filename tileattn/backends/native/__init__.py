"""Native CPU kernels: FlashAttention forward, decode and backward in C, compiled on first use.

Not registered with :mod:`tileattn.dispatch`; a backend calls :mod:`.kernels` directly. See
``kernels.py`` for the interface, ``build.py`` for how and where the library is built, and
``docs/native.md`` for the method and measurements.
"""

from .build import BuildError, BuildInfo
from .kernels import (CAPABILITIES, CancelFlag, Cancelled, Unavailable, available, backward, build_info, forward,
                      load, supports)

__all__ = ["CAPABILITIES", "BuildError", "BuildInfo", "CancelFlag", "Cancelled", "Unavailable", "available",
           "backward", "build_info", "forward", "load", "supports"]
