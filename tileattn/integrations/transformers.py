"""Public import path of :mod:`tileattn.dialects.transformers` (the same module object)."""

from .._aliases import alias

alias(__name__, "tileattn.dialects.transformers")
