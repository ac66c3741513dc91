"""The Triton engine: FlashAttention-2 kernels for GPUs (and Triton's CPU interpreter in tests).

Layers, top to bottom:

* :class:`TritonBackend` (here): what the engine accepts, registered with :mod:`tileattn.core.dispatch`
  at priority 10, ahead of the CPU engine, so ``backend="auto"`` runs CUDA tensors here;
* :mod:`.launch`: validates, allocates, chooses block sizes (fixed, tune cache or autotune), launches;
* :mod:`.forward_kernel`, :mod:`.backward_kernel`, :mod:`.decode_kernel` (split-K flash-decoding for
  a few query rows per kv head), :mod:`.tile_math`: the ``@triton.jit`` kernels.

Gradients are computed by two passes that each own the rows they write (no atomics), so they are
bitwise reproducible run to run: ``deterministic=True`` is always honoured at no cost.

CPU tensors run only through Triton's interpreter, in a process where ``TRITON_INTERPRET=1`` was set
before ``triton`` was imported (:func:`.launch.interpreter_active`). It exists for testing: "auto"
never picks this engine for CPU tensors, only an explicit ``backend="triton"`` does.
"""

from __future__ import annotations

import torch

from ...core.engine import Backend, Capabilities, register
from ...core.modifiers import Alibi, Band, Bias, Dropout, Mask, Softcap
from ...core.spec import AttentionSpec
from . import launch


class TritonBackend(Backend):
    name = "triton"
    priority = 10
    capabilities = Capabilities(
        devices=frozenset(("cuda", "cpu")), dtypes=frozenset((torch.float16, torch.bfloat16, torch.float32)),
        max_head_dim=launch.MAX_HEAD_DIM, modifiers=frozenset((Softcap, Alibi, Bias, Band, Mask, Dropout)),
    )

    def unavailable_reason(self):
        if torch.cuda.is_available() or launch.interpreter_active():
            return None
        return "needs a CUDA/ROCm GPU, or TRITON_INTERPRET=1 set before triton is imported (interpreter)"

    def extra_reasons(self, spec: AttentionSpec, backward: bool):
        why = []
        if spec.device.type == "cpu" and not launch.interpreter_active():
            why.append("CPU tensors run only under Triton's interpreter (TRITON_INTERPRET=1 set before "
                       "triton is imported); use backend='cpu'")
        if spec.dtype == torch.bfloat16 and launch.interpreter_active():
            why.append("bfloat16 under Triton's interpreter: its bf16 tl.dot gives wrong results")
        return why

    def auto_refusal(self, spec: AttentionSpec):
        if spec.device.type == "cpu":
            return ["CPU tensors: the Triton interpreter is for tests; 'auto' uses the cpu engine"]
        return []

    def forward(self, spec: AttentionSpec, out, lse):
        launch.forward(spec, out, lse)

    def backward(self, spec: AttentionSpec, grads):
        launch.backward(spec, grads)


register(TritonBackend())
