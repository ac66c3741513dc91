"""The exact reference as a backend: materialises the scores, for tests and teaching only.

Never chosen by ``backend="auto"``. It computes in fp32 (fp64 for fp64 inputs) and rounds the
result to the input dtype, so it has the accuracy a fused kernel should reach.
"""

from __future__ import annotations

import torch

from ..dispatch import Backend, register
from ..reference import reference_from_inputs
from ..spec import AttentionInputs, make_inputs


class ReferenceBackend(Backend):
    name = "reference"
    auto = False
    priority = 1000

    def forward(self, inp: AttentionInputs):
        out, lse = reference_from_inputs(inp, compute_dtype=inp.acc_dtype(), return_lse=True)
        return out.to(inp.dtype).contiguous(), lse

    def backward(self, inp: AttentionInputs, out, lse, dout, need_dbias: bool):
        cdt = inp.acc_dtype()
        primals = [t.detach().to(cdt) for t in (inp.q, inp.k, inp.v)]
        if need_dbias:
            primals.append(inp.bias.detach().to(cdt))

        def attention(q, k, v, *maybe_bias):
            sub = make_inputs(
                q, k, v, layout=inp.layout, num_heads=inp.heads_q,
                scale=inp.scale, causal=inp.causal, window=inp.window, mask=inp.mask,
                bias=maybe_bias[0] if need_dbias else inp.bias, alibi_slopes=inp.alibi_slopes,
                softcap=inp.softcap, dropout_p=inp.dropout_p, seed=inp.seed,
                cu_seqlens_q=inp.cu_seqlens_q, cu_seqlens_k=inp.cu_seqlens_k,
            )
            return reference_from_inputs(sub, compute_dtype=cdt)

        # torch.func.vjp, not torch.autograd.grad: this runs inside a torch.library custom op, where
        # the autograd dispatch keys are excluded and plain autograd records no graph.
        _, pullback = torch.func.vjp(attention, *primals)
        grads = pullback(dout.to(cdt))
        dq, dk, dv = (g.to(inp.dtype) for g in grads[:3])
        dbias = grads[3].to(inp.bias.dtype) if need_dbias else None
        return dq, dk, dv, dbias


register(ReferenceBackend())
