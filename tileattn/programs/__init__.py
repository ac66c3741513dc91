"""User functions as programs: FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` and
``mask_mod(b, h, q_idx, kv_idx)`` traced, translated to C, compiled with the machine's toolchain and
handed to the kernels as tile functions. The lowest layer: it imports nothing else of tileattn, and
the core (the ``ScoreMod``/``MaskMod`` modifiers) and the native engine build on it.

Modules: :mod:`.trace` (structure keys, captured tensors and run-time scalars, tracing),
:mod:`.codegen` (C tile functions and their derivatives), :mod:`.compiler` (building and caching
them), :mod:`.toolchain` (the C compiler and the verified library cache, shared with the native
engine), :mod:`.eager` (the same functions evaluated by PyTorch), :mod:`.blocks` (block maps:
which tiles a block mask hides, shows or masks).
"""
