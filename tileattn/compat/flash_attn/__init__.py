"""Public import path of :mod:`tileattn.dialects.flash_attn` (the same module object)."""

from ..._aliases import alias

alias(__name__, "tileattn.dialects.flash_attn")
