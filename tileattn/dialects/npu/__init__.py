"""Ascend ``torch_npu`` attention ops, served by tileattn: ``import tileattn.npu as torch_npu``.

Same names, signatures, defaults and results as torch_npu, computed by tileattn's partial-attention
layer on CPU or GPU:

* training: :func:`npu_fusion_attention`, :func:`npu_fusion_attention_grad` and their ``_v2``;
* inference: :func:`npu_fused_infer_attention_score` (and ``_v2``), :func:`npu_prompt_flash_attention`,
  :func:`npu_incre_flash_attention`; graph mode (:mod:`.graph`): ``npu_fused_infer_attention_score.out``
  (and ``_v2.out``), ``_npu_fused_infer_attention_score_get_max_workspace`` and
  ``_npu_fused_infer_attention_score_infer_output`` (and their ``_v2``);
* merging partial results: :func:`npu_attention_update`, :func:`npu_ring_attention_update`;
* running a script written for torch_npu unchanged: :func:`install` (``import torch_npu`` then
  resolves here) or ``python -m tileattn.npu script.py``.

Errors are ``RuntimeError`` (as torch_npu's) and also ``ValueError``/``TypeError`` (as tileattn's).
A torch_npu op this module does not provide raises ``AttributeError`` naming it. Point-by-point
differences from torch_npu: docs/dialects.md.
"""

import sys as _sys

from ._common import NpuNotImplementedError, NpuTypeError, NpuValueError, reset_warnings
from .fusion import npu_fusion_attention, npu_fusion_attention_grad, npu_fusion_attention_grad_v2, npu_fusion_attention_v2
from .inference import (
    npu_fused_infer_attention_score, npu_fused_infer_attention_score_v2, npu_incre_flash_attention,
    npu_prompt_flash_attention,
)
from .graph import (
    _npu_fused_infer_attention_score_get_max_workspace, _npu_fused_infer_attention_score_infer_output,
    _npu_fused_infer_attention_score_v2_get_max_workspace, _npu_fused_infer_attention_score_v2_infer_output,
)
from . import install as _install
from .install import device, installed
from .update import npu_attention_update, npu_ring_attention_update


def install(device: "str | None" = None) -> None:
    """Make ``import torch_npu`` resolve to this module and give torch a ``torch.npu`` surface:
    ``.npu()`` moves tensors to ``device`` (default: CUDA when available, else CPU). Idempotent;
    :func:`uninstall` undoes it. Details: :mod:`tileattn.npu.install`."""
    _install.install(_sys.modules[__name__], device)


def uninstall() -> None:
    """Undo :func:`install`: ``torch_npu``, ``torch.npu``, ``Tensor.npu``, ``Module.npu`` and
    ``Module.to`` are what they were before."""
    _install.uninstall(_sys.modules[__name__])

__all__ = [
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_fusion_attention_v2",
    "npu_fusion_attention_grad_v2",
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2",
    "npu_prompt_flash_attention",
    "npu_incre_flash_attention",
    "npu_attention_update",
    "npu_ring_attention_update",
    "install",
    "uninstall",
    "installed",
    "device",
    "NpuValueError",
    "NpuTypeError",
    "NpuNotImplementedError",
    "reset_warnings",
]


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(
        f"tileattn.npu (standing in for torch_npu) does not provide '{name}': it serves torch_npu's attention ops "
        f"only ({', '.join(n for n in __all__ if n.startswith('npu_'))}); run this part on an Ascend NPU or "
        "replace the call.")
