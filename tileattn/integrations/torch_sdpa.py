"""Public import path of :mod:`tileattn.dialects.sdpa_hook` (the same module object)."""

from .._aliases import alias

alias(__name__, "tileattn.dialects.sdpa_hook")
