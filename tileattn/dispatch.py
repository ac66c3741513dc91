"""Backend registry and dispatch, xformers style: engines declare what they support as data.

Each backend carries :class:`Capabilities` (devices, dtypes, head dims, modifiers, varlen, paged KV,
backward, bias gradient, determinism). One function, :meth:`Backend.not_supported_reasons`, derives
human-readable refusals from them (availability on this machine first), plus whatever an engine adds
in :meth:`Backend.extra_reasons`; nobody else recombines them. ``backend="auto"`` takes the first
backend in priority order that accepts the call, skipping the exact reference. A call that nobody
accepts, or an explicitly named backend that refuses, raises :class:`NoBackendError` listing every
backend with its reasons. ``TILEATTN_BACKEND`` in the environment replaces "auto".

Engines are registered lazily, on the first dispatch, so ``import tileattn`` stays cheap.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional

import torch

from .spec import AttentionSpec

ALL_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
ALL_MODIFIERS = frozenset(("band", "mask", "bias", "alibi", "softcap", "dropout", "sinks"))


class NoBackendError(ValueError):
    """No backend can run this call; the message lists every backend and why it refused."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine can run, as data. Tests are generated from these declarations."""

    devices: FrozenSet[str]
    dtypes: FrozenSet[torch.dtype] = ALL_DTYPES
    max_head_dim: Optional[int] = None
    #: Modifier kinds the engine applies itself. Sinks are applied above every engine (a merge of its
    #: (out, LSE) with the sink logit), so engines never declare them.
    modifiers: FrozenSet[str] = ALL_MODIFIERS - {"sinks"}
    varlen: bool = True
    seqused_k: bool = True
    paged_kv: bool = True
    backward: bool = True
    bias_grad: bool = True
    #: Bitwise-reproducible gradients with ``deterministic=True``.
    deterministic: bool = True


class Backend:
    """Base class of an engine.

    ``forward(spec, out, lse)`` writes the attention of ``spec`` into ``out`` (the canonical view of
    an output allocated by the caller, in the input dtype or in fp32 for partial results) and the
    natural-log LSE into ``lse`` (fp32, fp64 for fp64 inputs, shape ``spec.lse_shape()``; -inf for
    rows that see no key, whose output is 0).

    ``backward(spec, grads)`` with a :class:`Gradients` bundle: given ``out``, ``dout`` (canonical
    views), ``lse`` and ``delta`` (``rowsum(dout * out) - dlse``, fp32, lse-shaped; ``dlse`` itself too,
    or None, for engines that recompute a row's statistics), it writes dq, dk,
    dv into the canonical views ``grads.dq``/``dk``/``dv`` (input dtype) and, when
    ``grads.dbias`` is set, accumulates dS reduced over the bias's broadcast dims into it (fp32,
    the bias's 4-d shape with size-1 dims). Sinks and the LSE gradient are handled by the caller.
    """

    name: str = "?"
    #: Chosen by "auto" when it supports the call (the reference is not).
    auto: bool = True
    #: Lower runs first under "auto".
    priority: int = 100
    capabilities: Capabilities = Capabilities(devices=frozenset())

    def unavailable_reason(self) -> Optional[str]:
        """Why this engine cannot run on this machine at all (None: it can)."""
        return None

    def _unavailable(self) -> Optional[str]:
        """:meth:`unavailable_reason`, asked once: what a machine offers does not change while a
        process runs, and dispatch asks on every call."""
        if "_unavailable_answer" not in self.__dict__:
            self._unavailable_answer = self.unavailable_reason()
        return self._unavailable_answer

    def extra_reasons(self, spec: AttentionSpec, backward: bool) -> List[str]:
        """Engine-specific refusals beyond the declared capabilities."""
        return []

    def auto_refusal(self, spec: AttentionSpec) -> List[str]:
        """Reasons "auto" must not pick this engine even though it could run the call."""
        return []

    def not_supported_reasons(self, spec: AttentionSpec, backward: bool = False) -> List[str]:
        """Every reason this engine cannot run ``spec`` (forward, and backward when asked)."""
        unavailable = self._unavailable()
        if unavailable:
            return [unavailable]
        cap = self.capabilities
        why = []
        if spec.device.type not in cap.devices:
            why.append(f"needs {' or '.join(sorted(cap.devices))} tensors (got {spec.device.type})")
        if spec.dtype not in cap.dtypes:
            names = ", ".join(sorted(str(d).replace("torch.", "") for d in cap.dtypes))
            why.append(f"dtype {str(spec.dtype).replace('torch.', '')} is not supported ({names})")
        if cap.max_head_dim is not None:
            for name, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.head_dim_v)):
                if d > cap.max_head_dim:
                    why.append(f"{name} {d} > {cap.max_head_dim}")
        missing = [k for k in spec.kinds if k != "sinks" and k not in cap.modifiers]
        if missing:
            why.append("modifiers not supported: " + ", ".join(missing))
        for flag, present, what in (
            (cap.varlen, spec.is_varlen, "varlen (layout='TND')"),
            (cap.seqused_k, spec.seqused_k is not None, "seqused_k"),
            (cap.paged_kv, spec.is_paged, "a paged KV cache (block_table)"),
        ):
            if present and not flag:
                why.append(f"{what} is not supported")
        if backward:
            if not cap.backward:
                why.append("no backward pass (gradients)")
            elif spec.is_paged:
                why.append("gradients of a paged KV cache are not supported (decode is forward-only)")
            if spec.modifier("bias") is not None and spec.modifier("bias").tensor.requires_grad and not cap.bias_grad:
                why.append("no bias gradient")
            if spec.deterministic and not cap.deterministic:
                why.append("deterministic=True is not supported")
        return why + self.extra_reasons(spec, backward)

    def forward(self, spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor) -> None:
        raise NotImplementedError

    def backward(self, spec: AttentionSpec, grads: "Gradients") -> None:
        raise NotImplementedError


@dataclass
class Gradients:
    """What a backward pass reads and writes (see :class:`Backend`); all tensors canonical views."""

    out: torch.Tensor
    dout: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor
    dlse: Optional[torch.Tensor]
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: Optional[torch.Tensor] = None


_REGISTRY: Dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    _VERSION[0] += 1
    return backend


_VERSION = [0]


def registry_version() -> tuple:
    """Changes whenever the set of engines changes (so remembered engine choices are redone)."""
    return _VERSION[0], id(_REGISTRY), len(_REGISTRY)


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


def _load_builtin() -> bool:
    if not _REGISTRY:
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
