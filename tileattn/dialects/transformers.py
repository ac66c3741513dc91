"""Hugging Face transformers attention implementation ``"tileattn"``.

    import tileattn.integrations.transformers as tt
    tt.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="tileattn")
    tt.check_model(model)          # warns if this architecture will not call tileattn
    # a model that computes attention itself raises UnsupportedModelError at its first forward

The attention function receives transformers' (B, H, S, D) tensors (transposed views of (B, S, H, D)
projections); it hands them to :func:`tileattn.flash_attention` as ``layout="BSND"`` views, so
nothing is copied or transposed and the output comes back as the (B, S, H, D) transformers wants.
Masks are built by transformers' SDPA mask builder (bool, True = attend, sliding windows and padding
included), so the semantics are SDPA's: a missing mask with ``is_causal`` means top-left causal.
GQA heads are read in place (no ``repeat_kv``). A :class:`PagedCache` (``tileattn.integrations.transformers
.PagedCache``, :mod:`tileattn.dialects.transformers_cache`) is read as stored: paged, quantised or not,
with no concatenation and no dequantised copy.

**No keyword argument is dropped.** Models pass extra keywords to the attention function, and some
of them change the result (learnable sinks, top-k sparse indices, relative position bias...). Every
keyword transformers 5.24's models pass is listed in :data:`KWARGS` as *honoured* (applied, with how),
*harmless* (no effect on attention values, with why) or *refused* (a clear error). A keyword that is
not listed raises a ``TypeError`` naming it, unless its value is ``None`` (the model does not use the
feature). Under ``torch.autocast`` the inputs are cast exactly as torch casts SDPA's
(:func:`tileattn.sdpa.autocast_inputs`), so results match ``attn_implementation="sdpa"``.

**Which models call it.** Only architectures whose attention layers look the implementation up in
transformers' ``AttentionInterface`` call tileattn. The others, when they build masks through
transformers, are refused at their first forward (:class:`UnsupportedModelError`, naming the
architecture; opt-out ``register(allow_bypass=True)`` or ``$TILEATTN_HF_ALLOW_BYPASS=1``): found from
the model's own modules, not from a list (:mod:`tileattn.dialects.transformers_models`).
:data:`ARCHITECTURES` is the tested table, :func:`check_model` checks a given model,
:func:`integration_report` summarises both.
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
from typing import NamedTuple, Optional

import torch

from ..core.api import attention_partial, flash_attention
from ..core.merge import merge_weights
from . import transformers_fuse
from .sdpa import autocast_dtype, autocast_inputs
from .transformers_models import (ALLOW_BYPASS_ENV, ARCHITECTURES, HANDLING, Architecture,  # noqa: F401
                                  UnsupportedModelError, _configs, attention_classes, mask_builder,
                                  name_attention_tables)

NAME = "tileattn"
#: The transformers version the keyword audit and the architecture table were made against.
AUDITED_TRANSFORMERS = "5.24.0"

#: Every keyword argument transformers' models pass to the attention function: (how, why).
#: Built by reading every ``attention_interface(...)`` call in transformers 5.24's models and the
#: keyword types that travel in their ``**kwargs`` (``TransformersKwargs``, ``FlashAttentionKwargs``).
KWARGS = {
    "dropout": ("honoured", "dropout_p, with tileattn's counter-based RNG seeded from torch's generator"),
    "scaling": ("honoured", "scale"),
    "is_causal": ("honoured", "top-left causal when there is no mask and more than one query, as sdpa; "
                              "else the mask decides (module.is_causal when not passed)"),
    "softcap": ("honoured", "softcap (Gemma 2), which sdpa refuses"),
    "position_bias": ("honoured", "added to the scores as a float bias (T5 family); its gradient is returned"),
    "s_aux": ("honoured", "learnable sinks (gpt-oss and others): (H,) through flash_attention(sinks=); "
                          "per-row sinks merged into the partial attention's (out, LSE)"),
    "sinks": ("honoured", "as s_aux (Inkling 2 passes per-token sinks (B, H, S, 1))"),
    "indices": ("honoured", "top-k key indices (B, Sq, k) (DeepSeek-V3.2 sparse attention and relatives): "
                            "the keep-mask the eager path builds, and-ed into the mask"),
    "block_indices": ("honoured", "top-k key blocks (B, H_index, Sq, k), -1 = none (MiniMax-M3): the block "
                                  "keep-mask the eager path builds, block size from module.indexer.block_size"),
    "sliding_window": ("honoured", "transformers puts the window into the mask every implementation but flash "
                                   "gets (sdpa and eager ignore the keyword); without a mask, applied natively "
                                   "when queries and keys align unambiguously, else an error"),
    "deterministic": ("honoured", "deterministic="),
    "cu_seq_lens_q": ("honoured", "packed sequences (padding-free training): flash-attn varlen semantics, "
                                  "layout='TND' without a mask, otherwise a same-sequence mask and-ed in"),
    "cu_seq_lens_k": ("honoured", "as cu_seq_lens_q"),
    "output_attentions": ("refused", "True raises NotImplementedError: tileattn never materialises the "
                                     "attention weights (use eager); False/None change nothing"),
    "max_length_q": ("harmless", "an upper bound flash-attn sizes its grid with; the values do not depend on it"),
    "max_length_k": ("harmless", "as max_length_q"),
    "position_ids": ("harmless", "rotary embeddings are applied to q/k before the call, and packed sequences "
                                 "found from position_ids are already in transformers' mask"),
    "use_cache": ("harmless", "the cache is updated before the call; keys and values arrive complete"),
    "cache_position": ("harmless", "as use_cache: positions are already in the keys and the mask"),
    "output_hidden_states": ("harmless", "what the model returns, not what attention computes"),
    "output_router_logits": ("harmless", "MoE router outputs, not attention"),
    "return_dict": ("harmless", "the model's output container"),
    "num_items_in_batch": ("harmless", "loss normalisation"),
    "logits_to_keep": ("harmless", "which positions the language-model head computes logits for, after attention "
                                   "(GOT-OCR2 passes it on to its language model's layers)"),
    "seq_idx": ("harmless", "sequence index for the Mamba/convolution layers of hybrid models; attention gets "
                            "packing from the mask or cu_seq_lens"),
}
#: Names the attention function accepts and ignores. Extend it for a keyword of your own model that
#: does not affect attention (``HARMLESS_KWARGS["my_flag"] = "why"``); anything else unknown raises.
HARMLESS_KWARGS = {name: why for name, (how, why) in KWARGS.items() if how == "harmless"}


class _Calls:
    """How many times the attention function ran (for the first-forward check of :func:`check_model`)."""

    count = 0


def tileattn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                               is_causal=None, softcap=None, position_bias=None, sliding_window=None,
                               s_aux=None, sinks=None, indices=None, block_indices=None, deterministic=None,
                               cu_seq_lens_q=None, cu_seq_lens_k=None, output_attentions=None, **kwargs):
    """An ``AttentionInterface`` function: returns ``(attn_output (B, Sq, H, Dv), None)``.

    Every keyword is handled as :data:`KWARGS` says; an unknown one with a value raises ``TypeError``.
    All checks run before any compute.
    """
    if not _compiling():
        _Calls.count += 1
    _check_other_kwargs(module, kwargs)
    if not isinstance(key, torch.Tensor):  # a PagedCache's layer, read as stored
        return _paged(module, query, key, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                      softcap=softcap, sinks=s_aux if s_aux is not None else sinks, sliding_window=sliding_window,
                      output_attentions=output_attentions,
                      unsupported=dict(position_bias=position_bias, indices=indices, block_indices=block_indices,
                                       cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k))
    if output_attentions:
        raise NotImplementedError("tileattn never materialises attention weights; use attn_implementation="
                                  "'eager' for output_attentions=True.")
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
        _fail(ValueError, "dropout", repr(dropout), "a float in [0, 1)")
    if s_aux is not None and sinks is not None:
        _fail(ValueError, "s_aux/sinks", "both", "at most one of them: they are the same sink logits")
    device_type = query.device.type
    cast_to = autocast_dtype(device_type)
    if cast_to is not None:
        # The same casts torch's autocast applies to SDPA, which the sdpa implementation calls.
        query, key, value, attention_mask, position_bias = autocast_inputs(
            cast_to, query, key, value, attention_mask, position_bias)
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    causal_flag = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    # Same rule as transformers' SDPA path: without a mask, causal prefill is top-left aligned.
    causal = causal_flag and q_len > 1 and attention_mask is None
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = attention_mask
        else:
            bias = attention_mask.to(query.dtype)
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    head_sinks, row_sinks = _sinks(s_aux if s_aux is not None else sinks, "s_aux" if s_aux is not None else "sinks",
                                   batch, heads, q_len)
    keep = None
    if indices is not None:
        keep = _index_keep(indices, batch, q_len, k_len)
    if block_indices is not None:
        blocks = _block_keep(module, block_indices, batch, heads, q_len, k_len)
        keep = blocks if keep is None else keep & blocks
    if keep is not None:
        mask = keep if mask is None else mask & keep
    window = None
    common = dict(scale=scaling, dropout_p=float(dropout), softcap=float(softcap or 0.0),
                  deterministic=bool(deterministic))
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        cu_q, cu_k = _cu_seq_lens(cu_seq_lens_q, cu_seq_lens_k, batch, q_len, k_len)
        free = attention_mask is None and mask is None and bias is None and row_sinks is None
        if free:
            # Packed sequences with nothing else to mask: flash-attn's own varlen call.
            window = _flash_window(sliding_window, causal_flag, k_len)
            with _autocast_off(device_type, cast_to):
                out = flash_attention(
                    query.transpose(1, 2)[0], key.transpose(1, 2)[0], value.transpose(1, 2)[0], layout="TND",
                    cu_seqlens_q=cu_q.to(torch.int32), cu_seqlens_k=cu_k.to(torch.int32), causal=causal_flag,
                    window=window, sinks=head_sinks, **common)
            return out.unsqueeze(0), None
        # Keys of another sequence are hidden; without transformers' mask, causality and the window
        # are flash-attn's (bottom-right within each sequence).
        no_mask = attention_mask is None
        same = _segment_keep(cu_q, cu_k, q_len, k_len, causal_flag and no_mask,
                             _flash_window(sliding_window, causal_flag, k_len) if no_mask else None)
        mask = same if mask is None else mask & same
        causal = False
    elif attention_mask is None:
        window = _window_without_mask(sliding_window, causal_flag, q_len, k_len)
    args = (query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    call = dict(layout="BSND", causal=causal, align="top_left", window=window, mask=mask, bias=bias, **common)
    with _autocast_off(device_type, cast_to):
        if row_sinks is None:
            return flash_attention(*args, sinks=head_sinks, **call), None
        # Per-row sinks: the sink is an extra logit with no value, so merging it with the attention's
        # (out, LSE) rescales out by its merge weight exp(lse - logaddexp(lse, sink)). Exact, differentiable.
        out, lse = attention_partial(*args, **call)
        (weight, _), _ = merge_weights(lse, row_sinks.to(lse.dtype))
        return (out * weight.transpose(1, 2).unsqueeze(-1)).to(query.dtype), None


def _paged(module, query, kv, attention_mask, *, dropout, scaling, is_causal, softcap, sinks, sliding_window,
           output_attentions, unsupported):
    """Attention over a :class:`tileattn.dialects.transformers_cache.PagedCache` layer (``kv``). The
    layer was written before this call: a refusal takes the forward's tokens out again."""
    from .transformers_cache import PagedKV, paged_attention

    if not isinstance(kv, PagedKV):
        _fail(TypeError, "key", _describe(kv), "a tensor (B, Hkv, Sk, D), or a PagedCache's layer")
    try:
        given = [name for name, value in unsupported.items() if value is not None]
        if given or output_attentions:
            raise NotImplementedError(f"tileattn PagedCache: {type(module).__name__} passed "
                                      f"{', '.join(given) or 'output_attentions=True'}, which the paged cache's reader "
                                      "does not apply; use a DynamicCache or StaticCache for this model")
        if dropout:
            _fail(ValueError, "dropout", repr(dropout), "0.0: a PagedCache serves inference (call model.eval())")
        if is_causal is False or getattr(module, "is_causal", True) is False:
            _fail(ValueError, "is_causal", False, "a causal decoder: a PagedCache holds the tokens written before")
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (query.shape[1],)):
            _fail(ValueError, "s_aux/sinks", _describe(sinks), f"one sink logit per head ({query.shape[1]},) with a "
                  "PagedCache")
        if sliding_window is not None and (isinstance(sliding_window, bool) or
                                           not isinstance(sliding_window, numbers.Integral) or sliding_window < 1):
            _fail(ValueError, "sliding_window", repr(sliding_window), "None or a positive int")
        _temperature_per_row(module, kv.cache._step[3], query.shape[2])
        cast_to = autocast_dtype(query.device.type)
        if cast_to is not None:
            query = query.to(cast_to)
        with _autocast_off(query.device.type, cast_to):
            return paged_attention(kv, query, attention_mask, scaling=scaling, softcap=float(softcap or 0.0),
                                   sinks=sinks, sliding_window=None if sliding_window is None else int(sliding_window))
    except BaseException:
        kv.cache.abandon()
        raise


def _temperature_per_row(module, lengths, q_len):
    """Llama-4's layers without RoPE scale their queries by a temperature of the position, which the
    model computes from the cache's length, the longest row's: refused for rows at different lengths
    when it differs from a row's own (it changes every ``floor_scale`` positions)."""
    if lengths is None or not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return
    size, top = module.floor_scale, max(lengths)
    bucket = [(top - q_len + q + 1) // size for q in range(q_len)]
    wrong = [n for n in lengths if [(n - q_len + q + 1) // size for q in range(q_len)] != bucket]
    if wrong:
        _fail(ValueError, "position_ids", f"rows at lengths {lengths} through {type(module).__name__}, whose query "
              f"temperature (attn_temperature_tuning, floor_scale {size}) the model takes from the longest row",
              "rows whose positions share the longest row's temperature (decode the others in another forward), "
              "or attn_temperature_tuning=False")


def __getattr__(name):
    # PagedCache subclasses transformers' Cache: imported on first use, so this module imports
    # without transformers.
    if name in ("PagedCache", "PagedKV", "INT4_GROUP"):
        from . import transformers_cache

        return getattr(transformers_cache, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _fail(exc, arg, given, expected):
    raise exc(f"tileattn (transformers attention): argument '{arg}': got {given}; expected {expected}.")


def _describe(value):
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return repr(value) if len(repr(value)) <= 60 else type(value).__name__


#: Keywords only transformers' continuous batching (``generate_batch``, ``ContinuousBatchingManager``,
#: its ``PagedAttentionCache``) passes: it hands attention implementations a paged cache of its own.
CONTINUOUS_BATCHING_KWARGS = ("block_table", "k_cache", "v_cache", "read_index", "write_index")


def _check_other_kwargs(module, kwargs):
    paged = [name for name in CONTINUOUS_BATCHING_KWARGS if kwargs.get(name) is not None]
    if paged:
        raise NotImplementedError(
            f"tileattn (transformers attention): got {', '.join(repr(n) for n in paged)}, the paged cache of "
            "transformers' continuous batching (generate_batch / ContinuousBatchingManager), which the tileattn "
            "attention implementation does not support (transformers 5.24 only runs 'paged|eager', 'sdpa' and "
            "flash implementations there). Use model.generate() with a DynamicCache or a static cache, or "
            "tileattn.flash_attention(..., block_table=, seqused_k=) / flash_attn_with_kvcache on your own pool.")
    for name, value in kwargs.items():
        if value is None or name in HARMLESS_KWARGS:
            continue
        raise TypeError(
            f"tileattn (transformers attention): {type(module).__name__} passed '{name}' "
            f"({_describe(value)}), which tileattn does not know: it may change the attention result, so it is "
            f"not ignored. Use attn_implementation='eager' for this model; if '{name}' does not affect "
            f"attention, declare it: tileattn.integrations.transformers.HARMLESS_KWARGS['{name}'] = 'why'.")


def _compiling():
    return torch.compiler.is_compiling()


def _sinks(value, name, batch, heads, q_len):
    """(per-head sinks (H,) for flash_attention, or None; per-row sinks (B, H, Sq), or None)."""
    if value is None:
        return None, None
    expected = f"a float tensor of shape ({heads},) (one logit per head) or per row, ({batch}, {heads}, {q_len}[, 1])"
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        _fail(TypeError, name, _describe(value), expected)
    if tuple(value.shape) == (heads,):
        return value, None
    rows = value[..., 0] if value.dim() == 4 and value.shape[-1] == 1 else value
    try:
        rows = rows.expand(batch, heads, q_len)
    except RuntimeError:
        _fail(ValueError, name, f"shape {tuple(value.shape)}", expected)
    return None, rows


def _check_index_range(name, t, low, high, what):
    if t.numel() and not _compiling():
        lo, hi = int(t.min()), int(t.max())
        if lo < low or hi >= high:
            _fail(ValueError, name, f"values in [{lo}, {hi}]", f"{what} in [{low}, {high - 1}]")


def _integer_tensor(name, t, expected):
    if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        _fail(TypeError, name, _describe(t), expected)


def _index_keep(indices, batch, q_len, k_len):
    """Keep-mask (B, 1, Sq, Sk) of top-k key indices: what DeepSeek-V3.2's eager path scatters."""
    expected = f"an integer tensor of shape ({batch}, {q_len}, top_k) of key indices"
    _integer_tensor("indices", indices, expected)
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (batch, q_len):
        _fail(ValueError, "indices", f"shape {tuple(indices.shape)}", expected)
    _check_index_range("indices", indices, 0, k_len, "key indices")
    keep = torch.zeros(batch, q_len, k_len, dtype=torch.bool, device=indices.device)
    return keep.scatter_(-1, indices.long(), True).unsqueeze(1)


def _block_keep(module, block_indices, batch, heads, q_len, k_len):
    """Keep-mask (B, H, Sq, Sk) of top-k key blocks: what MiniMax-M3's ``build_block_mask`` builds."""
    size = getattr(getattr(module, "indexer", None), "block_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        _fail(ValueError, "block_indices", f"block indices from {type(module).__name__}, which has no "
              "indexer.block_size", "a module whose indexer.block_size gives the key block size (MiniMax-M3)")
    expected = f"an integer tensor of shape ({batch}, index_heads dividing {heads}, {q_len}, top_k)"
    _integer_tensor("block_indices", block_indices, expected)
    shape = tuple(block_indices.shape)
    if len(shape) != 4 or shape[0] != batch or shape[2] != q_len or shape[1] < 1 or heads % shape[1]:
        _fail(ValueError, "block_indices", f"shape {shape}", expected)
    n_blocks = -(-k_len // size)
    _check_index_range("block_indices", block_indices, -1, n_blocks, "block indices (-1 = none)")
    safe = block_indices.long().masked_fill(block_indices < 0, n_blocks)
    blocks = torch.zeros(shape[:3] + (n_blocks + 1,), dtype=torch.bool, device=block_indices.device)
    blocks = blocks.scatter_(-1, safe, True)[..., :n_blocks]
    keep = blocks.repeat_interleave(size, dim=-1)[..., :k_len]
    return keep.repeat_interleave(heads // shape[1], dim=1)


def _cu_seq_lens(cu_q, cu_k, batch, q_len, k_len):
    for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if cu is None:
            _fail(ValueError, name, "None while the other cu_seq_lens is given", "both cu_seq_lens_q and _k")
    for name, cu, other in (("cu_seq_lens_q", cu_q, cu_k), ("cu_seq_lens_k", cu_k, cu_q)):
        _integer_tensor(name, cu, "an integer tensor (sequences + 1,) of cumulative lengths starting at 0")
        if cu.dim() != 1 or cu.shape[0] < 2 or cu.shape != other.shape:
            _fail(ValueError, name, f"shape {tuple(cu.shape)}",
                  "a 1-d tensor (sequences + 1,) with as many entries as the other cu_seq_lens")
    if batch != 1:
        _fail(ValueError, "cu_seq_lens_q", f"packed sequences with a batch of {batch}",
              "batch 1: the sequences packed along the sequence dimension")
    if not _compiling():
        for name, cu, total in (("cu_seq_lens_q", cu_q, q_len), ("cu_seq_lens_k", cu_k, k_len)):
            if int(cu[0]) != 0 or int(cu[-1]) != total or bool((cu[1:] < cu[:-1]).any()):
                _fail(ValueError, name, f"{cu.tolist()}", f"non-decreasing offsets from 0 to {total}")
    return cu_q.long(), cu_k.long()


def _segment_keep(cu_q, cu_k, q_len, k_len, causal, window):
    """(1, 1, Sq, Sk) bool: query and key in the same packed sequence (and, when given, causal and
    inside the window, bottom-right aligned within the sequence as flash-attn varlen does)."""
    rows = torch.arange(q_len, device=cu_q.device)
    cols = torch.arange(k_len, device=cu_k.device)
    seg_q = torch.bucketize(rows, cu_q[1:], right=True)
    seg_k = torch.bucketize(cols, cu_k[1:], right=True)
    keep = seg_q[:, None] == seg_k[None, :]
    if causal or window is not None:
        offset = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])
        diag = (cols - cu_k[seg_k])[None, :] - (rows - cu_q[seg_q] + offset[seg_q])[:, None]
        if causal:
            keep &= diag <= 0
        if window is not None:
            keep &= diag >= -window[0]
            keep &= diag <= window[1]
    return keep[None, None]


def _flash_window(sliding_window, causal, k_len):
    """flash-attn's reading of ``sliding_window`` (transformers' flash path): (w - 1, w - 1)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1:
        _fail(ValueError, "sliding_window", repr(sliding_window), "None or a positive int")
    if k_len <= sliding_window:
        return None
    return (int(sliding_window) - 1, 0 if causal else int(sliding_window) - 1)


def _window_without_mask(sliding_window, causal, q_len, k_len):
    """The window to apply natively when transformers built no mask. Its mask builder never skips the
    mask when the window hides a key, so this only matters for direct callers; where queries and
    keys do not align one to one the position of the queries is unknown, hence the error."""
    window = _flash_window(sliding_window, causal, k_len)
    if window is not None and q_len != k_len:
        _fail(ValueError, "sliding_window", f"{sliding_window} with no attention mask, {q_len} queries and "
              f"{k_len} keys", "an attention mask (transformers builds one when the window hides keys), or "
              "as many queries as keys")
    return window


@contextlib.contextmanager
def _autocast_off(device_type, cast_to):
    """Run the operator with autocast off once the inputs are cast (torch's SDPA kernels run so too)."""
    if cast_to is None:
        yield
    else:
        with torch.autocast(device_type, enabled=False):
            yield


def register(name: str = NAME, *, model=None, allow_bypass: Optional[bool] = None) -> str:
    """Register the attention function and its mask builder under ``name`` (default "tileattn").

    The mask builder looks at each model the first time it builds a mask (see
    :mod:`tileattn.dialects.transformers_models`): a model whose attention modules never call
    transformers' AttentionInterface (BLOOM, XGLM, MPNet...) would not run tileattn and would misread
    the SDPA-style mask, so it is refused at that first forward with :class:`UnsupportedModelError`,
    unless ``allow_bypass=True`` (or ``$TILEATTN_HF_ALLOW_BYPASS=1`` when ``allow_bypass`` is None): then
    it runs on its own attention with the mask eager builds (eager's results, tileattn unused). Models
    that call the interface get SDPA's bool mask, or eager's when they do not declare SDPA support.
    With ``model``, also switch that model to ``name`` (``model.set_attn_implementation``) and run
    :func:`check_model` on it. Architectures that pick their attention class from a table keyed by
    implementation name when they are built (GPT-Neo, Falcon, GIT, Bark, SAM vision towers) find
    ``name`` there with eager's class (registering adds it, to every such table transformers imports),
    and are then judged as above: GPT-Neo and Falcon are refused at their first forward, an OCR model's
    vision tower runs its own attention beside a language model that calls tileattn.
    """
    try:
        from transformers import AttentionInterface
    except ImportError as exc:
        raise ImportError(
            "tileattn.integrations.transformers needs transformers >= 4.48 (AttentionInterface): "
            "pip install 'tileattn[transformers]'."
        ) from exc
    AttentionInterface.register(name, tileattn_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        # transformers < 4.53 builds one additive float mask for every non-flash implementation;
        # tileattn_attention_forward takes it as a bias.
        pass
    else:
        AttentionMaskInterface.register(name, mask_builder(name, allow_bypass, _compiling))
    name_attention_tables(name)
    if model is not None:
        model.set_attn_implementation(name)
        check_model(model, name=name)
    return name


class ModelCheck(NamedTuple):
    """What :func:`check_model` found."""

    model: str
    implementations: tuple  #: the attention implementations the model's configs ask for
    routed: tuple  #: attention classes that look the implementation up in transformers' interface
    bypassing: tuple  #: attention classes that compute attention themselves
    problems: tuple  #: why tileattn will not (or not only) be called; empty when it will

    @property
    def ok(self) -> bool:
        return not self.problems


def check_model(model, *, name: str = NAME, warn: bool = True, first_forward: bool = True) -> ModelCheck:
    """Check that ``model`` will call tileattn, and warn (``UserWarning``) when it will not.

    Static part, no compute: is ``name`` registered, does the model's config ask for it, and which
    attention modules look the implementation up in transformers' ``AttentionInterface`` (routed)
    versus compute attention themselves (bypassing; e.g. BLOOM, GPT-Neo, Falcon, XLNet). Bypassing
    models that build masks through transformers are also refused at their first forward by the mask
    builder :func:`register` installs; this reports the others too.
    With ``first_forward`` (default), the model's next forward is also watched: if it runs without
    calling tileattn (a model that routes only some code paths through the interface), it warns then.
    """
    problems = []
    try:
        from transformers import AttentionInterface
    except ImportError:
        registered = False
    else:
        registered = name in AttentionInterface()
    if not registered:
        problems.append(f"'{name}' is not registered: call tileattn.integrations.transformers.register()")
    implementations = tuple(dict.fromkeys(
        getattr(c, "_attn_implementation", None) for c in _configs(getattr(model, "config", None))))
    if name not in implementations:
        problems.append(f"the model's attention implementation is {implementations}, not '{name}': "
                        f"set attn_implementation='{name}' or register(model=model)")
    routed, bypassing = attention_classes(model)
    label = type(model).__name__
    if not routed:
        problems.append(f"{label} computes attention itself ({', '.join(bypassing) or 'no attention module found'}"
                        f"): it never calls the '{name}' implementation, and may misread the SDPA-style mask built "
                        "for it; use attn_implementation='eager'")
    elif bypassing:
        problems.append(f"in {label}, {', '.join(bypassing)} compute attention themselves; only "
                        f"{', '.join(routed)} call '{name}'")
    check = ModelCheck(label, implementations, routed, bypassing, tuple(problems))
    if warn and problems:
        warnings.warn("tileattn: " + "; ".join(problems), UserWarning, stacklevel=2)
    if first_forward and routed and name in implementations:
        _watch_first_forward(model, name)
    return check


def _watch_first_forward(model, name):
    """Warn after the model's next forward if the attention function did not run during it."""
    state = {}

    def before(module, args):
        state["calls"] = _Calls.count

    def after(module, args, output):
        for handle in handles:
            handle.remove()
        if _Calls.count == state.get("calls", _Calls.count) and name in (
                getattr(c, "_attn_implementation", None) for c in _configs(module.config)):
            warnings.warn(f"tileattn: {type(module).__name__} ran a forward with attn_implementation='{name}' "
                          "without calling tileattn: this architecture computes attention itself on that path",
                          UserWarning, stacklevel=2)

    handles = (model.register_forward_pre_hook(before), model.register_forward_hook(after))


def integration_report(name: str = NAME) -> dict:
    """The state of the integration, for ``tileattn env``: the transformers version, whether ``name``
    is registered (attention function and mask builder), and the tested architecture and keyword tables.
    Plain data (str, bool, lists of dicts); works without transformers installed."""
    try:
        import transformers
        from transformers import AttentionInterface
    except ImportError:
        version, registered, mask_registered = None, False, False
    else:
        version = transformers.__version__
        registered = name in AttentionInterface()
        try:
            from transformers.masking_utils import AttentionMaskInterface
        except ImportError:
            mask_registered = False
        else:
            mask_registered = name in AttentionMaskInterface()
    return {
        "transformers": version,
        "audited_with": AUDITED_TRANSFORMERS,
        "name": name,
        "registered": registered,
        "mask_registered": mask_registered,
        "architectures": [row._asdict() for row in ARCHITECTURES],
        "kwargs": [{"kwarg": k, "handling": how, "why": why} for k, (how, why) in KWARGS.items()],
    }


def fuse(model):
    """The attention blocks of a Llama-family model (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3) on
    :mod:`tileattn.fused` (RMSNorm, q/k/v, RoPE as one operator; attention and the output projection),
    same weights and parameter names; returns the model, switched to the implementation "tileattn".
    Other architectures are refused by name (:class:`UnsupportedModelError`). Details:
    :mod:`tileattn.dialects.transformers_fuse`."""
    return transformers_fuse.fuse(model, register, tileattn_attention_forward)
