"""Other attention APIs, each a thin translation onto the core: :mod:`.flash_attn` (flash-attn 2/3),
:mod:`.sdpa` and :mod:`.sdpa_hook` (PyTorch SDPA), :mod:`.npu` (Ascend torch_npu), :mod:`.transformers`
(Hugging Face). Their public import paths are the older ones: ``tileattn.compat.flash_attn``,
``tileattn.sdpa``, ``tileattn.npu``, ``tileattn.integrations.transformers`` and
``tileattn.integrations.torch_sdpa`` (aliases of the modules here)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def reraised_as(prefix: str, kept: tuple, classes: tuple):
    """Re-raise what tileattn's core raises under a dialect's call as the dialect's own error classes:
    as the class of the first ``(core class, dialect class)`` pair of ``classes`` the error is an
    instance of, its message kept and prefixed with ``prefix``. Errors of ``kept`` (the dialect's own,
    already in its terms) and of no listed class pass as they are."""
    try:
        yield
    except kept:
        raise
    except tuple(core for core, _ in classes) as e:
        own = next(cls for core, cls in classes if isinstance(e, core))
        raise own(f"{prefix}: {e}") from e
