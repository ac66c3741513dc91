"""Backend registry and dispatch, xformers style.

Each backend declares what it supports and answers ``not_supported_reasons(inputs)``, a list of
human-readable reasons (empty = supported). ``backend="auto"`` takes the first backend in priority
order that accepts the call, skipping the exact reference (it exists for tests and teaching). A call
that nobody accepts, or an explicitly named backend that refuses, raises :class:`NoBackendError`
listing every backend with its reasons. ``TILEATTN_BACKEND`` in the environment replaces "auto".
"""

from __future__ import annotations

import importlib
import os
from typing import Dict, List

import torch

from .spec import AttentionInputs


class NoBackendError(ValueError):
    """No backend can run this call; the message lists every backend and why it refused."""


class Backend:
    """Base class of an engine. Subclasses implement ``forward`` and ``backward``.

    ``forward(inp) -> (out, lse)``: ``out`` in the user's layout and dtype, ``lse`` fp32 (fp64 for
    fp64 inputs) of shape ``inp.lse_shape()``, natural log.
    ``backward(inp, out, lse, dout, need_dbias) -> (dq, dk, dv, dbias or None)`` in the shapes of
    ``q``, ``k``, ``v`` and ``bias``.
    """

    name: str = "?"
    #: Chosen by "auto" when it supports the call (the reference is not).
    auto: bool = True
    #: Lower runs first under "auto".
    priority: int = 100

    def available(self) -> List[str]:
        """Reasons this backend cannot run on this machine at all (empty = available)."""
        return []

    def not_supported_reasons(self, inp: AttentionInputs) -> List[str]:
        return list(self.available())

    def auto_refusal(self, inp: AttentionInputs) -> List[str]:
        """Reasons "auto" must not pick this backend even though it could run the call."""
        return []

    def forward(self, inp: AttentionInputs):
        raise NotImplementedError

    def backward(self, inp: AttentionInputs, out, lse, dout, need_dbias: bool):
        raise NotImplementedError


_REGISTRY: Dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def list_backends() -> List[Backend]:
    """All registered backends in "auto" priority order."""
    _load_builtin()
    return sorted(_REGISTRY.values(), key=lambda b: b.priority)


def get_backend(name: str) -> Backend:
    _load_builtin()
    if name not in _REGISTRY:
        known = ", ".join(repr(b.name) for b in list_backends())
        raise ValueError(f"tileattn: argument 'backend': got {name!r}; expected 'auto' or one of {known}.")
    return _REGISTRY[name]


# The first call may come from inside torch.compile: the import's side effect (registering engines)
# cannot be traced, so dynamo runs this function eagerly at trace time and treats it as a constant.
@torch.compiler.assume_constant_result
def _load_builtin() -> bool:
    if not _REGISTRY:
        importlib.import_module("tileattn.backends")  # registers the built-in engines
    return True


def explain(inp: AttentionInputs) -> Dict[str, List[str]]:
    """Every backend's refusal reasons for this call ({} values = would run)."""
    return {b.name: b.not_supported_reasons(inp) for b in list_backends()}


def _format_reasons(reasons: Dict[str, List[str]]) -> str:
    lines = []
    for name, why in reasons.items():
        lines.append(f"  {name}: " + ("supported" if not why else "; ".join(why)))
    return "\n".join(lines)


def select(inp: AttentionInputs, backend: str = "auto") -> Backend:
    """Pick the engine for a call, or raise :class:`NoBackendError` saying why each one refused."""
    if not isinstance(backend, str):
        raise TypeError(f"tileattn: argument 'backend': got {backend!r}; expected a backend name or 'auto'.")
    requested = backend
    if backend == "auto":
        backend = os.environ.get("TILEATTN_BACKEND", "auto") or "auto"
    if backend != "auto":
        chosen = get_backend(backend)
        why = chosen.not_supported_reasons(inp)
        if why:
            origin = "" if requested != "auto" else " (from TILEATTN_BACKEND)"
            raise NoBackendError(
                f"tileattn: backend {backend!r}{origin} cannot run this call:\n"
                + _format_reasons(explain(inp))
            )
        return chosen
    for b in list_backends():
        if b.auto and not b.not_supported_reasons(inp) and not b.auto_refusal(inp):
            return b
    raise NoBackendError("tileattn: no backend supports this call:\n" + _format_reasons(explain(inp)))
