"""The exact reference as a backend: materialises the scores, for tests and teaching only.

Never chosen by ``backend="auto"``. It computes in fp32 (fp64 for fp64 inputs) and rounds the result
to the output's dtype, so it has the accuracy a fused kernel should reach. Its backward is
:func:`tileattn.core.reference.reference_backward` (the formulas written out, using the given LSE).
"""

from __future__ import annotations

from ..core.engine import ALL_DTYPES, BUILTIN_MODIFIERS, Backend, Capabilities, Gradients, register
from ..core.kvquant import KVQuant
from ..core.reference import reference_backward, reference_from_spec
from ..core.spec import AttentionSpec, to_canonical


class ReferenceBackend(Backend):
    name = "reference"
    #: It applies the modifiers through their own reference hooks, not kernel arguments.
    reads_kernel_args = False
    #: Torch operators only: a tensor subclass or a meta tensor answers them itself.
    reads_memory = False
    auto = False
    priority = 1000
    capabilities = Capabilities(devices=frozenset(("cpu", "cuda", "meta")), dtypes=ALL_DTYPES,
                                modifiers=BUILTIN_MODIFIERS | {KVQuant})

    def forward(self, spec: AttentionSpec, out, lse):
        result, result_lse = reference_from_spec(spec, compute_dtype=spec.acc_dtype())
        out.copy_(to_canonical(result, spec.layout, spec.heads_q))
        lse.copy_(result_lse)

    def backward(self, spec: AttentionSpec, grads: Gradients):
        reference_backward(spec, grads.out, grads.dout, grads.lse, grads.delta, grads.dq, grads.dk, grads.dv,
                           grads.dbias)


register(ReferenceBackend())
