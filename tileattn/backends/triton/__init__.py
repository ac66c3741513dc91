"""The Triton engine: FlashAttention-2 kernels for GPUs (and Triton's CPU interpreter in tests).

Layers, top to bottom:

* :class:`TritonBackend` (here): what the engine accepts, registered with :mod:`tileattn.dispatch`
  at priority 10, ahead of the CPU engine, so ``backend="auto"`` runs CUDA tensors here;
* :mod:`.launch`: validates, allocates, chooses block sizes (fixed, tune cache or autotune), launches;
* :mod:`.forward_kernel`, :mod:`.backward_kernel`, :mod:`.tile_math`: the ``@triton.jit`` kernels.

Gradients are computed by two passes that each own the rows they write (no atomics), so they are
bitwise reproducible run to run: ``deterministic=True`` is always honoured at no cost.

CPU tensors run only through Triton's interpreter, in a process where ``TRITON_INTERPRET=1`` was set
before ``triton`` was imported (:func:`.launch.interpreter_active`). It exists for testing: "auto"
never picks this engine for CPU tensors, only an explicit ``backend="triton"`` does.
"""

from __future__ import annotations

import torch

from ...dispatch import Backend, register
from ...spec import AttentionInputs
from . import launch


class TritonBackend(Backend):
    name = "triton"
    priority = 10

    def available(self):
        if torch.cuda.is_available() or launch.interpreter_active():
            return []
        return ["needs a CUDA/ROCm GPU, or TRITON_INTERPRET=1 set before triton is imported (interpreter)"]

    def not_supported_reasons(self, inp: AttentionInputs):
        why = []
        dev = inp.device.type
        if dev == "cpu" and not launch.interpreter_active():
            why.append("CPU tensors run only under Triton's interpreter (TRITON_INTERPRET=1 set before "
                       "triton is imported); use backend='cpu'")
        elif dev not in ("cpu", "cuda"):
            why.append(f"needs CUDA/ROCm tensors (got {dev})")
        if inp.dtype == torch.float64:
            why.append("float64 is not supported (fp16, bf16, fp32); use backend='cpu'")
        if inp.dtype == torch.bfloat16 and launch.interpreter_active():
            why.append("bfloat16 under Triton's interpreter: its bf16 tl.dot gives wrong results")
        for name, d in (("head_dim", inp.head_dim), ("head_dim_v", inp.head_dim_v)):
            if d > launch.MAX_HEAD_DIM:
                why.append(f"{name} {d} > {launch.MAX_HEAD_DIM}")
        return why

    def auto_refusal(self, inp: AttentionInputs):
        if inp.device.type == "cpu":
            return ["CPU tensors: the Triton interpreter is for tests; 'auto' uses the cpu engine"]
        return []

    def forward(self, inp: AttentionInputs):
        return launch.forward(inp)

    def backward(self, inp: AttentionInputs, out, lse, dout, need_dbias: bool):
        return launch.backward(inp, out, lse, dout, need_dbias)


register(TritonBackend())
