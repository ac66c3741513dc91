"""Public import path of :mod:`tileattn.dialects.flex` (the same module object)."""

from ._aliases import alias

alias(__name__, "tileattn.dialects.flex")
