"""Hugging Face transformers attention implementation ``"tileattn"``.

    import tileattn.integrations.transformers as tt
    tt.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tileattn")

The attention function receives transformers' (B, H, S, D) tensors (transposed views of (B, S, H, D)
projections); it hands them to :func:`tileattn.flash_attention` as ``layout="BSND"`` views, so
nothing is copied or transposed and the output comes back as the (B, S, H, D) transformers wants.
Masks are built by transformers' SDPA mask builder (bool, True = attend, sliding windows and padding
included), so the semantics are SDPA's: a missing mask with ``is_causal`` means top-left causal.
GQA heads are read in place (no ``repeat_kv``); ``softcap`` (Gemma 2) is supported, unlike SDPA.
"""

from __future__ import annotations

import numbers

import torch

from ..api import flash_attention

NAME = "tileattn"


def tileattn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, softcap=None, position_bias=None, **kwargs):
    """An ``AttentionInterface`` function: returns ``(attn_output (B, Sq, H, Dv), None)``."""
    if kwargs.get("output_attentions", False):
        raise NotImplementedError("tileattn never materialises attention weights; use attn_implementation="
                                  "'eager' for output_attentions=True.")
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"tileattn: argument 'dropout': got {dropout!r}; expected a float in [0, 1).")
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Same rule as transformers' SDPA path: without a mask, causal prefill is top-left aligned.
    causal = bool(causal) and q_len > 1 and attention_mask is None
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask.to(query.dtype)
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    out = flash_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), layout="BSND", causal=causal,
        align="top_left", mask=mask, bias=bias, scale=scaling, dropout_p=float(dropout),
        softcap=float(softcap or 0.0),
    )
    return out, None


def register(name: str = NAME) -> str:
    """Register the attention function and its mask builder under ``name`` (default "tileattn")."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise ImportError(
            "tileattn.integrations.transformers needs transformers >= 4.48 (AttentionInterface): "
            "pip install 'tileattn[transformers]'."
        ) from exc
    AttentionInterface.register(name, tileattn_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        # transformers < 4.53 builds one additive float mask for every non-flash implementation;
        # tileattn_attention_forward takes it as a bias.
        return name
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
