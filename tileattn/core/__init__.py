"""The operator's core, in call order: :mod:`.api` (the public entry points) -> :mod:`.spec` (one
validated description of a call) -> :mod:`.modifiers` (each variant an object that checks, applies and
lowers itself into :mod:`.kernel_args`) -> :mod:`.dispatch` (engines declared in :mod:`.engine`) ->
:mod:`.ops` (the autograd op). Beside them: :mod:`.merge` (partial results), :mod:`.reference` (the fp64
oracle), :mod:`.testing` (its comparison rule), :mod:`.score_math`, :mod:`.tunecache`. The core never
imports the dialects or the tools."""
