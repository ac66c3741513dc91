"""What an engine is: the :class:`Backend` interface, its :class:`Capabilities` (declared as data)
and the registry engines join with :func:`register`.

Engines import this module and nothing of dispatch: :mod:`tileattn.core.dispatch` loads the built-in
engines on first use and chooses among the registered ones, so the registry has no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .spec import AttentionSpec

ALL_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))


@dataclass(frozen=True)
class Capabilities:
    """What an engine can run, as data. Tests are generated from these declarations."""

    devices: FrozenSet[str]
    dtypes: FrozenSet[torch.dtype] = ALL_DTYPES
    max_head_dim: Optional[int] = None
    #: The modifier types the engine applies, exactly: a type not listed is refused (closed by
    #: default). Each engine lists its own (no shared set: a new type is granted engine by engine, as
    #: its kernels learn it). Sinks are applied above every engine (a merge of its (out, LSE) with the
    #: sink logit), so engines never declare them.
    modifiers: FrozenSet[type] = frozenset()
    varlen: bool = True
    seqused_k: bool = True
    paged_kv: bool = True
    backward: bool = True
    bias_grad: bool = True
    #: Bitwise-reproducible gradients with ``deterministic=True``.
    deterministic: bool = True
    #: User functions (score_mod / mask_mod) run only compiled (:mod:`tileattn.programs`): one the
    #: compiler refused is refused, with its reason.
    compiled_functions: bool = False


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
    the bias's 4-d shape with size-1 dims), and the gradients of a score_mod's captured tensors into
    ``grads.captures``. Sinks and the LSE gradient are handled by the caller.
    """

    name: str = "?"
    #: Whether forward/backward read :attr:`AttentionSpec.kernel_args` (a plan lowers them once).
    reads_kernel_args: bool = True
    #: Whether the engine reads its tensors' memory itself (by pointer from C or Triton, or on worker
    #: threads of its own) rather than only through torch operators, which a tensor subclass or a
    #: FakeTensor answers: every tensor it reads must then have memory (:func:`storage_problem`),
    #: which :mod:`tileattn.core.ops` checks before it runs.
    reads_memory: bool = True
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

    # The first dispatch may come from inside torch.compile, and finding out may load a library
    # (the native engine builds and loads its kernels under a lock, which dynamo cannot trace):
    # dynamo runs this method eagerly at trace time and takes its answer as a constant (what
    # torch.compiler.assume_constant_result sets, without importing torch._dynamo here), guarding
    # on the engine object. tests/test_compile.py checks a first call in a fresh process.
    _unavailable._dynamo_marked_constant = True

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
        missing = [m.kind for m in spec.modifiers if not m.applied_by_op and type(m) not in cap.modifiers]
        if missing:
            why.append("modifiers not supported: " + ", ".join(missing))
        if cap.compiled_functions:
            why += [f"the {m.kind} is not compiled ({m.user.how})" for m in spec.modifiers
                    if m.user_function and m.user.bound is None]
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
            elif any(m.forward_only for m in spec.modifiers):
                why.append("gradients of a quantised or scaled K/V cache are not supported (inference only)")
            if not cap.bias_grad and any(m.grad_slot == "bias" and m.grad_tensor().requires_grad
                                         for m in spec.modifiers):
                why.append("no bias gradient")
            if spec.deterministic and not cap.deterministic:
                why.append("deterministic=True is not supported")
        return why + self.extra_reasons(spec, backward)

    def forward(self, spec: AttentionSpec, out: torch.Tensor, lse: torch.Tensor) -> None:
        raise NotImplementedError

    def backward(self, spec: AttentionSpec, grads: "Gradients") -> None:
        raise NotImplementedError

    def prepare(self, spec: AttentionSpec):
        """A prepared forward call for repeated inference calls of this shape (:mod:`tileattn.core.lean`),
        or None (the default: every call takes the full path through :meth:`forward`)."""
        return None


def storage_problem(t: torch.Tensor) -> Optional[str]:
    """What ``t`` is when it has no memory of its own to read, or None when it has (or is empty).

    A FakeTensor (FakeTensorMode, torch.export), a wrapper subclass (DTensor-like: its
    ``data_ptr()`` is 0), a meta tensor or a tensor wrapped by a torch.func transform (vmap, grad:
    no storage at all) would be read at address 0 by a kernel. A FakeTensor is asked first: reading
    its pointer warns."""
    if type(t) is not torch.Tensor and isinstance(t, FakeTensor):
        return "a FakeTensor (shapes without data)"
    try:
        if t.data_ptr() or t.numel() == 0:
            return None
    except RuntimeError:
        return "a tensor without storage (wrapped by a torch.func transform such as vmap)"
    if t.is_meta:
        return "a meta tensor (shapes without data)"
    return f"a {type(t).__name__} without storage (its data_ptr() is 0)"


#: What would work instead of a tensor without memory, for messages.
WITH_MEMORY = ("a tensor with memory of its own (for shapes alone, call under FakeTensorMode, torch.compile or "
               "torch.export, which run the op's fake kernel; unwrap a tensor subclass first, e.g. a DTensor's "
               ".to_local(); under torch.func.vmap, loop over the batch instead)")


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
    #: one buffer (accumulation dtype, the tensor's shape) per tensor the score_mod captures that
    #: requires grad (:attr:`tileattn.core.functions.UserFunction.grad_captures`, in order), added to
    captures: List[torch.Tensor] = field(default_factory=list)


_REGISTRY: Dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    _VERSION[0] += 1
    return backend


_VERSION = [0]


def registry_version() -> tuple:
    """Changes whenever the set of engines changes (so remembered engine choices are redone)."""
    return _VERSION[0], id(_REGISTRY), len(_REGISTRY)
