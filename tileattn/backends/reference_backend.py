"""The exact reference as engines: ``reference`` (each sequence's whole score matrix, for tests and
teaching; never chosen by ``backend="auto"``) and ``eager`` (the same arithmetic in blocks of rows,
so memory stays bounded: what "auto" falls back to for user functions the compiler refuses, or a
machine without one).

Both compute in fp32 (fp64 for fp64 inputs) and round the result to the output's dtype, so they have
the accuracy a fused kernel should reach, and apply every modifier through its own reference hooks:
they declare every type :func:`tileattn.reference` computes. Their backward is
:func:`tileattn.core.reference.reference_backward` (the formulas written out, using the given LSE;
a score_mod's derivative by autograd through it, block by block).
"""

from __future__ import annotations

from ..core.engine import ALL_DTYPES, Backend, Capabilities, Gradients, register
from ..core.functions import MaskMod, ScoreMod
from ..core.kvquant import KVQuant
from ..core.modifiers import Alibi, Band, Bias, Dropout, Mask, Softcap
from ..core.reference import reference_backward, reference_from_spec
from ..core.layouts import to_canonical
from ..core.spec import AttentionSpec

#: every modifier type the reference computes
REFERENCE_MODIFIERS = frozenset((Softcap, Alibi, Bias, ScoreMod, Band, Mask, MaskMod, Dropout, KVQuant))


class ReferenceBackend(Backend):
    name = "reference"
    #: It applies the modifiers through their own reference hooks, not kernel arguments.
    reads_kernel_args = False
    #: Torch operators only: a tensor subclass or a meta tensor answers them itself.
    reads_memory = False
    auto = False
    priority = 1000
    capabilities = Capabilities(devices=frozenset(("cpu", "cuda", "meta")), dtypes=ALL_DTYPES,
                                modifiers=REFERENCE_MODIFIERS)
    #: scores materialised per step (None: a sequence's whole matrix)
    max_elements = None

    def forward(self, spec: AttentionSpec, out, lse):
        result, result_lse = reference_from_spec(spec, compute_dtype=spec.acc_dtype(), max_elements=self.max_elements)
        out.copy_(to_canonical(result, spec.layout, spec.heads_q))
        lse.copy_(result_lse)

    def backward(self, spec: AttentionSpec, grads: Gradients):
        reference_backward(spec, grads.out, grads.dout, grads.lse, grads.delta, grads.dq, grads.dk, grads.dv,
                           grads.dbias, grads.captures, max_elements=self.max_elements)


class EagerBackend(ReferenceBackend):
    """The reference in blocks of at most :attr:`max_elements` scores per step: PyTorch ops, exact,
    memory O(block) instead of O(S^2). "auto" takes it only for calls with user functions that no
    other engine runs (the native engine needs them compiled)."""

    name = "eager"
    auto = True
    priority = 900
    capabilities = Capabilities(devices=frozenset(("cpu", "cuda")), dtypes=ALL_DTYPES, modifiers=REFERENCE_MODIFIERS)
    max_elements = 1 << 22

    def auto_refusal(self, spec: AttentionSpec):
        if any(m.user_function for m in spec.modifiers):
            return []
        return ["auto runs only user functions here (a faster engine runs every other call)"]


register(ReferenceBackend())
register(EagerBackend())
