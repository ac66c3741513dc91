"""Other attention APIs, each a thin translation onto the core: :mod:`.flash_attn` (flash-attn 2/3),
:mod:`.sdpa` and :mod:`.sdpa_hook` (PyTorch SDPA), :mod:`.npu` (Ascend torch_npu), :mod:`.transformers`
(Hugging Face). Their public import paths are the older ones: ``tileattn.compat.flash_attn``,
``tileattn.sdpa``, ``tileattn.npu``, ``tileattn.integrations.transformers`` and
``tileattn.integrations.torch_sdpa`` (aliases of the modules here)."""

from __future__ import annotations


class CoreErrors:
    """Base of a dialect's ``core_errors(fn)`` context: what tileattn's core raises under the call of
    the dialect's function ``fn`` leaves it as the dialect's own error classes, the class of the first
    ``(core class, dialect class)`` pair of :attr:`classes` it is an instance of, its message kept and
    prefixed with ``<prefix>.<fn>``. Errors of :attr:`kept` (the dialect's own already) and of no
    listed class pass as they are. A class, not a generator context: a decode step enters it on
    every call."""

    __slots__ = ("fn",)
    prefix: str
    kept: tuple
    classes: tuple

    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is None or issubclass(kind, self.kept):
            return False
        for core, own in self.classes:
            if issubclass(kind, core):
                raise own(f"{self.prefix}.{self.fn}: {e}") from e
        return False
