"""``flex_attention`` on CPU: one :func:`tileattn.flash_attention` call.

A FlexAttention call translates into the operator's own terms: ``score_mod=`` and the ``BlockMask``
(``block_mask=``: its block lists and its ``mask_mod``) become the user-function modifiers of
:mod:`tileattn.core.functions`, ``align="top_left"`` gives FlexAttention's ``q_idx`` (the query's
row), ``enable_gqa`` is the operator's own GQA. The native engine runs the compiled functions inside
its tiles, forward and backward (captured tensors get their gradients), and never visits a block the
mask hides; a function the compiler refuses runs on the ``eager`` engine (``explain`` says which and
why). Tensors on another device go to PyTorch's compiled FlexAttention.
"""

from __future__ import annotations

import torch
import torch.nn.attention.flex_attention as torch_flex
from torch.nn.attention.flex_attention import AuxOutput

from ...core.api import flash_attention
from ...core.dispatch import explain as explain_spec
from ...core.dispatch import select
from ...core.functions import NO_MASK_BLOCK
from ...core.modifiers import fail
from ...core.reference import row_max
from ...core.spec import build_spec
from ...programs import blocks
from .semantics import validate

#: PyTorch's own flex_attention, kept before any :func:`tileattn.patch_flex` replaces it (GPU calls)
TORCH_FLEX_ATTENTION = torch_flex.flex_attention
_COMPILED_TORCH_FLEX = []


def _torch_flex_on_device(*args, **kwargs):
    """PyTorch's FlexAttention compiled (its eager form is only a reference; PyTorch compiles it for
    real use), compiled once per process."""
    if not _COMPILED_TORCH_FLEX:
        _COMPILED_TORCH_FLEX.append(torch.compile(TORCH_FLEX_ATTENTION))
    return _COMPILED_TORCH_FLEX[0](*args, **kwargs)


def _keywords(call, score_mod):
    """flash_attention's keywords for a validated call."""
    block_mask = call.block_mask
    if block_mask is not None and tuple(block_mask.BLOCK_SIZE) == (NO_MASK_BLOCK, NO_MASK_BLOCK):
        block_mask = None
    return dict(scale=call.scale, align="top_left", score_mod=score_mod, block_mask=block_mask)


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None):
    """:func:`torch.nn.attention.flex_attention.flex_attention`, forward and backward, on CPU.

    Same signature, returns and semantics (see :mod:`tileattn.flex`): ``score_mod(score, b, h, q_idx,
    kv_idx)`` then the block mask (PyTorch's ``BlockMask`` from ``create_block_mask``, ``and_masks`` /
    ``or_masks``, ``BlockMask.from_kv_blocks``, or :func:`tileattn.flex.create_block_mask`), then the
    softmax; natural-log LSE with ``return_lse`` or ``return_aux=AuxRequest(lse=True)`` (and
    ``max_scores``); rows that see nothing give 0 and LSE -inf. Gradients reach q, k, v and every
    floating tensor ``score_mod`` captures. Tensors on another device go to PyTorch's compiled
    FlexAttention. :func:`explain` says which engine runs a call and why.
    """
    if isinstance(query, torch.Tensor) and query.device.type != "cpu":
        return _torch_flex_on_device(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                     enable_gqa=enable_gqa, return_lse=return_lse, kernel_options=kernel_options,
                                     return_aux=return_aux)
    call = validate(query, key, value, block_mask, scale, enable_gqa, return_lse, kernel_options, return_aux)
    key, value = key.expand(call.batch, -1, -1, -1), value.expand(call.batch, -1, -1, -1)
    keywords = _keywords(call, score_mod)
    out, lse = flash_attention(query, key, value, return_lse=True, **keywords)
    if call.aux:
        top = row_max(query, key, value, compute_dtype=lse.dtype, **keywords) if call.want_max else None
        return out, AuxOutput(lse=lse if call.want_lse else None, max_scores=top)
    return (out, lse) if call.want_lse else out


def explain(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
            kernel_options=None, *, return_aux=None) -> dict:
    """How :func:`flex_attention` would run this call: ``path`` (the engine "auto" picks, forward and
    backward when the inputs require grad), ``engines`` (each engine's reasons for refusing it, as
    :func:`tileattn.explain` gives them), ``score_mod`` / ``mask_mod`` (compiled, or the reason they
    run through torch.vmap) and ``blocks`` (the block map's counts)."""
    if isinstance(query, torch.Tensor) and query.device.type != "cpu":
        return {"path": f"PyTorch's compiled FlexAttention (tensors on {query.device})"}
    call = validate(query, key, value, block_mask, scale, enable_gqa, return_lse, kernel_options, return_aux)
    key, value = key.expand(call.batch, -1, -1, -1), value.expand(call.batch, -1, -1, -1)
    spec = build_spec(query, key, value, **_keywords(call, score_mod))
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    found = {"path": f"tileattn.flash_attention on the {select(spec, 'auto', backward=backward).name} engine",
             "engines": explain_spec(spec, backward)}
    functions = {m.kind: m for m in spec.modifiers if m.user_function}
    for kind in ("score_mod", "mask_mod"):
        found[kind] = functions[kind].user.how if kind in functions else "none"
    if "mask_mod" in functions and functions["mask_mod"].band is not None:
        left, right = functions["mask_mod"].band
        found["mask_mod"] = f"{found['mask_mod']}; runs as the kernels' band (left={left}, right={right})"
    states = functions["mask_mod"].states if "mask_mod" in functions else None
    found["blocks"] = None if states is None else states.counts()
    return found


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, *, compiled: bool = True):
    """A PyTorch ``BlockMask`` for ``mask_mod``, as ``torch.nn.attention.flex_attention.create_block_mask``
    makes it (B or H None: 1, evaluated at b = 0 / h = 0), built a row of blocks at a time without the
    dense (B, H, Q, KV) mask PyTorch's materialises; ``compiled=False`` evaluates it with torch.vmap."""
    if device is not None and torch.device(device).type != "cpu":
        fail(ValueError, "device", device, "cpu (PyTorch's create_block_mask serves other devices)")
    block_q, block_kv = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    for name, value in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN), ("BLOCK_SIZE", block_q), ("BLOCK_SIZE", block_kv)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            fail(ValueError, name, value, "a positive int")
    return blocks.create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, (block_q, block_kv), compiled=compiled)
