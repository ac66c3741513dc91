"""Backend registry and dispatch, xformers style: engines declare what they support as data.

Each backend (:mod:`tileattn.core.engine`: the interface, its capabilities and the registry engines join)
carries :class:`Capabilities` (devices, dtypes, head dims, the modifier types it applies, varlen,
paged KV, backward, bias gradient, determinism). One function, :meth:`Backend.not_supported_reasons`, derives
human-readable refusals from them (availability on this machine first), plus whatever an engine adds
in :meth:`Backend.extra_reasons`; nobody else recombines them. ``backend="auto"`` takes the first
backend in priority order that accepts the call, skipping the exact reference. A call that nobody
accepts, or an explicitly named backend that refuses, raises :class:`NoBackendError` listing every
backend with its reasons. ``TILEATTN_BACKEND`` in the environment replaces "auto".

Engines are registered lazily, on the first dispatch, so ``import tileattn`` stays cheap; they
import :mod:`tileattn.core.engine`, not this module, so the registry is no import cycle.
"""

from __future__ import annotations

import importlib
import os
from typing import Dict, List

from . import engine as _engine
from .engine import (  # noqa: F401  (the engine interface, importable from here as before)
    ALL_DTYPES, Backend, Capabilities, Gradients, register, registry_version,
)
from .spec import AttentionSpec


class NoBackendError(ValueError):
    """No backend can run this call; the message lists every backend and why it refused."""


def list_backends() -> List[Backend]:
    """All registered backends in "auto" priority order."""
    _load_builtin()
    return sorted(_engine._REGISTRY.values(), key=lambda b: b.priority)


def get_backend(name: str) -> Backend:
    _load_builtin()
    if name not in _engine._REGISTRY:
        known = ", ".join(repr(b.name) for b in list_backends())
        raise ValueError(f"tileattn: argument 'backend': got {name!r}; expected 'auto' or one of {known}.")
    return _engine._REGISTRY[name]


def _load_builtin() -> bool:
    if not _engine._REGISTRY:
        importlib.import_module("tileattn.backends")  # registers the built-in engines
    return True


# The first call may come from inside torch.compile: the import's side effect (registering engines)
# cannot be traced, so dynamo must run this function eagerly at trace time and treat it as a
# constant. That is all torch.compiler.assume_constant_result does (it sets this attribute), but
# calling it imports torch._dynamo, which costs seconds of `import tileattn`; tests/test_compile.py
# checks that a first call inside a compiled function still works.
_load_builtin._dynamo_marked_constant = True


def explain(spec: AttentionSpec, backward: bool = False) -> Dict[str, List[str]]:
    """Every backend's refusal reasons for this call (an empty list = would run)."""
    return {b.name: b.not_supported_reasons(spec, backward) for b in list_backends()}


def _format_reasons(reasons: Dict[str, List[str]]) -> str:
    return "\n".join(f"  {name}: " + ("supported" if not why else "; ".join(why)) for name, why in reasons.items())


def select(spec: AttentionSpec, backend: str = "auto", backward: bool = False) -> Backend:
    """Pick the engine for a call, or raise :class:`NoBackendError` saying why each one refused."""
    if not isinstance(backend, str):
        raise TypeError(f"tileattn: argument 'backend': got {backend!r}; expected a backend name or 'auto'.")
    requested = backend
    if backend == "auto":
        backend = os.environ.get("TILEATTN_BACKEND", "auto") or "auto"
    if backend != "auto":
        chosen = get_backend(backend)
        if chosen.not_supported_reasons(spec, backward):
            origin = "" if requested != "auto" else " (from TILEATTN_BACKEND)"
            raise NoBackendError(f"tileattn: backend {backend!r}{origin} cannot run this call:\n"
                                 + _format_reasons(explain(spec, backward)))
        return chosen
    for b in list_backends():
        if b.auto and not b.not_supported_reasons(spec, backward) and not b.auto_refusal(spec):
            return b
    raise NoBackendError("tileattn: no backend supports this call:\n" + _format_reasons(explain(spec, backward)))
