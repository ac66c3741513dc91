"""``fuse(model)``: the attention blocks of a Hugging Face Llama-family model on :mod:`tileattn.fused`.

    import tileattn.integrations.transformers as tt
    model = tt.fuse(AutoModelForCausalLM.from_pretrained(...))     # returns the model, changed in place

(:func:`tileattn.dialects.transformers.fuse`, which hands this module the attention function and its
registration, so that this module does not import that one.)

Each decoder layer's input RMSNorm, q/k/v projections, per-head norms (Qwen3, Gemma 3) and RoPE become
one :func:`tileattn.fused.norm_qkv` call, and the attention with the output projection becomes the
attention implementation ``"tileattn"`` (:func:`tileattn.dialects.transformers.tileattn_attention_forward`,
which reads transformers' masks, windows and softcaps exactly as for an unfused model) followed by
:func:`tileattn.fused.out_proj`. The model keeps its parameters, their names (``state_dict`` loads
either way) and its caches (the new keys and values go through ``cache.update`` as before); it
trains and generates as before. The model's attention implementation is set to ``"tileattn"``.

Covered architectures are listed by ``model_type`` in :data:`FUSABLE`, with the attention and decoder
layer classes each must have; any other model (or a covered one whose layers are not the expected
classes) is refused with :class:`UnsupportedModelError` naming it, before anything is changed. What
each covered architecture's attention does that changes its result, and how it is honoured:

* Llama, Mistral, Qwen2/3, Phi-3: RMSNorm ``w * x / rms(x)``; Qwen2's q/k/v biases; Qwen3's per-head
  q/k norms; Phi-3's packed ``qkv_proj`` and partial rotary (the cos/sin width); Mistral's and
  Phi-3's ``config.sliding_window``, Qwen2/3's per-layer windows;
* Gemma 2/3: RMSNorm ``(1 + w) * x / rms(x)`` (the input norm and Gemma 3's q/k norms),
  ``query_pre_attn_scalar`` (the module's ``scaling``), Gemma 2's attention logit softcap, per-layer
  sliding windows and Gemma 3's per-layer-type rotary tables.

The norms after attention (Gemma's ``post_attention_layernorm``) stay where they are: they read the
block's output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from typing import Callable

from .. import fused
from .transformers_models import UnsupportedModelError


class Family(NamedTuple):
    """How one architecture's attention block maps onto the fused operators."""

    decoder_layer: str       #: the decoder layer's class
    attention: str           #: its self_attn's class
    gemma_norms: bool        #: RMSNorm weights applied as (1 + w)
    window: str              #: where the sliding window comes from: "module", "config" or "none"
    softcap: bool            #: passes the module's attn_logit_softcapping


#: model_type -> the layer classes fuse() expects and what their attention does
FUSABLE = {
    "llama": Family("LlamaDecoderLayer", "LlamaAttention", False, "none", False),
    "mistral": Family("MistralDecoderLayer", "MistralAttention", False, "config", False),
    "qwen2": Family("Qwen2DecoderLayer", "Qwen2Attention", False, "module", False),
    "qwen3": Family("Qwen3DecoderLayer", "Qwen3Attention", False, "module", False),
    "gemma2": Family("Gemma2DecoderLayer", "Gemma2Attention", True, "module", True),
    "gemma3_text": Family("Gemma3DecoderLayer", "Gemma3Attention", True, "module", False),
    "phi3": Family("Phi3DecoderLayer", "Phi3Attention", False, "config", False),
}


def _norm_eps(norm: nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(eps if eps is not None else norm.eps)


class NormHandedOver(nn.Module):
    """The decoder layer's input RMSNorm after :func:`fuse`: its weight stays here (and in the
    ``state_dict`` under its name), its forward passes the hidden states through unchanged, and the
    fused attention block applies it while writing its GEMM's operand."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight = norm.weight
        self.eps = _norm_eps(norm)

    def forward(self, hidden_states):
        return hidden_states


class FusedAttention(nn.Module):
    """A Llama-family attention module on :func:`tileattn.fused.norm_qkv` and
    :func:`tileattn.fused.out_proj`, with the same submodules (so the same parameter names) and the
    attributes transformers' attention functions read."""

    def __init__(self, attention: nn.Module, norm: NormHandedOver, family: Family, attend: Callable):
        super().__init__()
        #: transformers' attention function "tileattn" (masks, windows, softcap, caches read as given)
        self.attend = attend
        for name, child in attention.named_children():
            self.add_module(name, child)
        config = attention.config
        self.config, self.layer_idx, self.family = config, attention.layer_idx, family
        self.head_dim = attention.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling, self.is_causal = attention.scaling, attention.is_causal
        self.attention_dropout = attention.attention_dropout
        self.sliding_window = {"module": lambda: attention.sliding_window,
                               "config": lambda: getattr(config, "sliding_window", None),
                               "none": lambda: None}[family.window]()
        self.softcap = attention.attn_logit_softcapping if family.softcap else None
        # the input norm is the decoder layer's child, not this module's: its weight keeps its one name
        object.__setattr__(self, "input_norm", norm)
        self._halves_checked = False

    def _qkv_weights(self):
        if hasattr(self, "qkv_proj"):  # Phi-3: one packed projection, rows q, k, v
            return self.qkv_proj.weight, self.qkv_proj.bias
        biases = (self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)
        return (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight), \
            None if all(b is None for b in biases) else biases

    def _norm_weight(self, weight):
        return 1.0 + weight.float() if self.family.gemma_norms else weight

    def _half_tables(self, cos, sin):
        """transformers' full-width tables cat(f, f) as the half-width ones norm_qkv takes; checked
        once that the two halves are equal (true of every rotary type these models build)."""
        half = cos.shape[-1] // 2
        if not self._halves_checked and not torch.compiler.is_compiling():
            if not (torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])):
                raise UnsupportedModelError(
                    f"tileattn.integrations.transformers.fuse: layer {self.layer_idx}'s rotary tables are not cat(freqs, freqs); "
                    "norm_qkv rotates halves (i, i + rot/2) with one frequency per pair")
            self._halves_checked = True
        return cos[..., :half], sin[..., :half]

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        weights, biases = self._qkv_weights()
        cos, sin = self._half_tables(*position_embeddings)
        qk_norms = {}
        if hasattr(self, "q_norm"):
            qk_norms = dict(q_norm_weight=self._norm_weight(self.q_norm.weight),
                            k_norm_weight=self._norm_weight(self.k_norm.weight), qk_norm_eps=_norm_eps(self.q_norm))
        q, k, v = fused.norm_qkv(hidden_states, self._norm_weight(self.input_norm.weight), weights, bias_qkv=biases,
                                 eps=self.input_norm.eps, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                 head_dim=self.head_dim, rope=(cos, sin), layout="BSND", **qk_norms)
        # transformers' caches and attention functions take (B, H, S, D): views of the BSND tensors
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        extra = {} if self.softcap is None else dict(softcap=self.softcap)
        out, _ = self.attend(self, q, k, v, attention_mask,
                             dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                             sliding_window=self.sliding_window, **extra, **kwargs)
        return fused.out_proj(out.reshape(*hidden_states.shape[:-1], -1), self.o_proj.weight, self.o_proj.bias,
                              out_dtype=hidden_states.dtype), None


def _layers(model: nn.Module, family: Family):
    """The decoder layers of ``model``, or UnsupportedModelError naming what is not as expected."""
    found = [m for m in model.modules() if type(m).__name__ == family.decoder_layer]
    if not found:
        raise UnsupportedModelError(f"tileattn.integrations.transformers.fuse: no {family.decoder_layer} in this "
                                    f"{model.config.model_type} model; nothing to fuse")
    for layer in found:
        attention = getattr(layer, "self_attn", None)
        if type(attention).__name__ != family.attention or not hasattr(layer, "input_layernorm"):
            raise UnsupportedModelError(
                f"tileattn.integrations.transformers.fuse: a {family.decoder_layer} has self_attn {type(attention).__name__}, expected "
                f"{family.attention} after an input_layernorm; this variant is not covered")
    return found


def fuse(model: nn.Module, register: Callable, attend: Callable) -> nn.Module:
    """Swap the attention blocks of a covered model (:data:`FUSABLE`) for the fused operators, with the
    same weights; returns the model. Refuses any other architecture, by name, before changing anything.
    ``register(model=model)`` switches the model to the attention implementation ``attend`` is."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    family = FUSABLE.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"tileattn.integrations.transformers.fuse: architecture {model_type!r} ({type(model).__name__}) is not covered; fuse() covers "
            f"{', '.join(sorted(FUSABLE))}. Its attention can still run on tileattn unfused: "
            "attn_implementation='tileattn'.")
    layers = _layers(model, family)
    register(model=model)
    for layer in layers:
        if isinstance(layer.self_attn, FusedAttention):
            continue
        norm = NormHandedOver(layer.input_layernorm)
        layer.input_layernorm = norm
        layer.self_attn = FusedAttention(layer.self_attn, norm, family, attend)
    return model
