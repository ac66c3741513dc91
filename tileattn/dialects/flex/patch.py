"""Route PyTorch's ``flex_attention`` on CPU tensors to :func:`tileattn.flex_attention`, so that code
written for FlexAttention trains on CPU (PyTorch's CPU FlexAttention has no backward).

:func:`install` replaces ``torch.nn.attention.flex_attention.flex_attention`` (and, when transformers
is imported, the function its ``attn_implementation="flex_attention"`` models call,
``transformers.integrations.flex_attention.compile_friendly_flex_attention``) by a router: CPU
tensors go to tileattn, tensors on any other device to the function that was there before (PyTorch's
compiled FlexAttention for transformers; on CUDA, wrap PyTorch's in ``torch.compile`` as usual).
``create_block_mask`` (PyTorch's, and the name transformers' masking utilities call) is routed
likewise: a CPU mask is built by :func:`tileattn.flex.create_block_mask` (no torch.compile, no dense
mask), a PyTorch ``BlockMask`` all the same.
:func:`uninstall` restores them; :func:`patch_flex` does both around a ``with`` block. Code that
imported the function object itself before :func:`install` (``from torch.nn.attention.flex_attention
import flex_attention``) keeps the original: install first, or call :func:`tileattn.flex_attention`.
Install transformers' route after importing transformers.
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch.nn.attention.flex_attention as torch_flex

from .attention import create_block_mask, flex_attention

_HF_MODULE = "transformers.integrations.flex_attention"
_HF_NAME = "compile_friendly_flex_attention"
_HF_MASKS = "transformers.masking_utils"
_SAVED = []  # stack of [(module, name, previous value)] per install


def _routed(previous):
    @functools.wraps(previous)
    def flex_attention_on_cpu(query, key, value, *args, **kwargs):
        if query.device.type == "cpu":
            return flex_attention(query, key, value, *args, **kwargs)
        return previous(query, key, value, *args, **kwargs)
    flex_attention_on_cpu.tileattn_routed = True
    return flex_attention_on_cpu


def _routed_hf(previous):
    @functools.wraps(previous)
    def compile_friendly_on_cpu(query, key, value, training=False, **kwargs):
        if query.device.type == "cpu":
            return flex_attention(query, key, value, **kwargs)
        return previous(query, key, value, training=training, **kwargs)
    compile_friendly_on_cpu.tileattn_routed = True
    return compile_friendly_on_cpu


def _routed_block_mask(previous):
    @functools.wraps(previous)
    def create_block_mask_on_cpu(mask_mod, B, H, Q_LEN, KV_LEN, device="cuda", BLOCK_SIZE=128, _compile=False):
        if device is not None and str(device).startswith("cpu"):
            return create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, "cpu", BLOCK_SIZE)
        return previous(mask_mod, B, H, Q_LEN, KV_LEN, device=device, BLOCK_SIZE=BLOCK_SIZE, _compile=_compile)
    create_block_mask_on_cpu.tileattn_routed = True
    return create_block_mask_on_cpu


def _module(name, attribute):
    try:
        module = __import__(name, fromlist=[attribute])
    except ImportError:  # a transformers without FlexAttention support: nothing of it to route
        return None
    return module if hasattr(module, attribute) else None


def install() -> None:
    """Route FlexAttention on CPU tensors to tileattn (until :func:`uninstall`). Installing twice
    stacks: each :func:`uninstall` undoes one install."""
    targets = [(torch_flex, "flex_attention", _routed), (torch_flex, "create_block_mask", _routed_block_mask)]
    if "transformers" in sys.modules:
        for name, attribute, make in ((_HF_MODULE, _HF_NAME, _routed_hf),
                                      (_HF_MASKS, "create_block_mask", _routed_block_mask)):
            module = _module(name, attribute)
            if module is not None:
                targets.append((module, attribute, make))
    saved = []
    for module, name, make in targets:
        previous = getattr(module, name)
        saved.append((module, name, previous))
        setattr(module, name, make(previous))
    _SAVED.append(saved)


def uninstall() -> None:
    """Undo the last :func:`install` (nothing when none is in place)."""
    if not _SAVED:
        return
    for module, name, previous in reversed(_SAVED.pop()):
        setattr(module, name, previous)


def installed() -> bool:
    return bool(getattr(torch_flex.flex_attention, "tileattn_routed", False))


@contextlib.contextmanager
def patch_flex():
    """``with tileattn.patch_flex(): ...``: FlexAttention on CPU tensors runs on tileattn inside the block
    (restored on exit, also when the block raises)."""
    install()
    try:
        yield flex_attention
    finally:
        uninstall()
