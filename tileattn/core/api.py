"""The public operator and the partial-attention layer.

* :func:`flash_attention`: exact attention, forward and backward, any engine.
* :func:`attention_partial`: the attention of one key/value shard as (out in fp32, LSE), both
  differentiable; :func:`tileattn.merge_attentions` combines shards exactly.
* :func:`attention_backward`: gradients of one shard given caller-supplied (global) out and LSE, the
  FlashAttention-2 backward that ring attention needs.
* :func:`explain`: which engine would run a call and why the others refuse it.

A repeated inference call is served by :mod:`tileattn.core.lean` (a prepared kernel call) when it
can be; otherwise a call is validated once (:func:`tileattn.core.spec.build_spec`), an engine is chosen
(:func:`tileattn.core.dispatch.select`), and then either the custom op runs (gradients needed, or
``torch.compile`` tracing: one opaque node with autograd) or, for inference, the engine is called
directly, skipping the op's round trip.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from . import lean, ops, plans
from .dispatch import explain as _explain, registry_version, select
from .modifiers import fail, modifiers_from_keywords
from .spec import AttentionSpec, build_spec, check_bool, check_sequence_values, spec_of, tracing


def flash_attention(
    q, k, v, lean_key=None, layout="BNSD", num_heads=None, scale=None, causal=False, window=None,
    align="bottom_right", mask=None, bias=None, alibi_slopes=None, softcap=0.0, dropout_p=0.0, seed=None,
    generator=None, sinks=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    seqused_k=None, block_table=None, return_lse=False, deterministic=False, backend="auto", modifiers=(),
    k_scale=None, k_offset=None, v_scale=None, v_offset=None, q_scale=None, k_format=None, v_format=None,
    score_mod=None, mask_mod=None, block_mask=None,
):
    r"""Exact attention ``softmax(scale * q k^T + ...) v``, computed tile by tile (FlashAttention-2).

    Shapes (``B`` batch, ``N``/``Hq`` query heads, ``Hkv`` kv heads, ``S`` length, ``D`` head dim,
    ``Dv`` head dim of v, which may differ from ``D``):

    ========  =====================  ==========================================================
    layout    q                      k, v
    ========  =====================  ==========================================================
    BNSD      (B, Hq, Sq, D)         (B, Hkv, Sk, D), (B, Hkv, Sk, Dv)
    BSND      (B, Sq, Hq, D)         (B, Sk, Hkv, D), (B, Sk, Hkv, Dv)
    BSH       (B, Sq, Hq*D)          (B, Sk, Hkv*D), (B, Sk, Hkv*Dv); needs ``num_heads`` = Hq
    SBH       (Sq, B, Hq*D)          (Sk, B, Hkv*D), (Sk, B, Hkv*Dv); needs ``num_heads`` = Hq
    TND       (Tq, Hq, D)            (Tk, Hkv, D), (Tk, Hkv, Dv); needs ``cu_seqlens_q/k``
    paged     q in ``layout``        pools (num_blocks, block_size, Hkv, D/Dv) with ``block_table``
    ========  =====================  ==========================================================

    The output has q's layout, batch/length and v's head dim, in q's dtype. Inputs are read through
    their strides (a transposed view is never copied). GQA/MQA: ``Hq % Hkv == 0`` and query head
    ``h`` reads kv head ``h // (Hq // Hkv)``; K/V are never repeated.

    Order of operations (fixed)::

        s = scale * q.k^T -> softcap -> + ALiBi + bias -> causal, window and mask -> softmax (+ sinks)
          -> dropout -> . v

    Alignment: query row ``i`` of a sequence is aligned with key column ``i + off``. The default
    ``align="bottom_right"`` (FlashAttention-2) gives ``off = Sk - Sq``; ``"top_left"`` (SDPA's
    ``is_causal``) gives ``off = 0``; an int gives that offset (a key shard of a longer sequence).
    Causal and window: row ``i`` sees key ``j`` iff ``i + off - left <= j <= i + off + right``;
    ``causal=True`` sets ``right = 0``. ALiBi adds ``-slope * |i + off - j|``. Sq = 2, Sk = 5, causal::

        keys ->    0 1 2 3 4
        query 0    1 1 1 1 0
        query 1    1 1 1 1 1

    Sq = 5, Sk = 2, causal (the first three queries see nothing: they output 0, LSE = -inf)::

        keys ->    0 1
        query 0    0 0
        query 1    0 0
        query 2    0 0
        query 3    1 0
        query 4    1 1

    Args:
        q, k, v: fp16, bf16, fp32 or fp64 tensors of one dtype and device (shapes above).
        layout: "BNSD" (default), "BSND", "BSH", "SBH" or "TND" (variable length).
        num_heads: number of query heads; required for BSH/SBH (kv heads follow from k's width).
        scale: multiplies q.k^T; default ``1 / sqrt(D)``.
        causal: causal mask, aligned by ``align``.
        window: ``(left, right)`` sliding window; ``None`` or a negative value = unbounded side.
        align: "bottom_right" (default), "top_left" or an int diagonal offset (see above).
        mask: bool tensor broadcastable to (B, Hq, Sq, Sk); **True = take part** (SDPA convention).
            With a paged cache Sk = max_blocks * block_size, column j being the sequence's key j.
        bias: float tensor broadcastable to (B, Hq, Sq, Sk) (Sk as for ``mask``), added to the scores;
            when it requires grad its gradient is returned, reduced over its broadcast dimensions.
        alibi_slopes: fp32 (Hq,) or (B, Hq).
        softcap: > 0 replaces scores by ``softcap * tanh(scores / softcap)``.
        dropout_p: probability of dropping an attention weight (training); kept weights are scaled
            by ``1 / (1 - dropout_p)``. The mask is a pure function of (seed, batch, head, row, col).
        seed / generator: dropout randomness; the same seed gives bitwise the same output and
            gradients. Without either, a seed is drawn from torch's default generator.
        sinks: float (Hq,) learnable attention sinks (gpt-oss): one extra logit per head in every
            row's softmax denominator, with no value; differentiable. The LSE includes it.
        cu_seqlens_q, cu_seqlens_k: int32 (B+1,) cumulative offsets for ``layout="TND"``.
        max_seqlen_q, max_seqlen_k: optional; checked against the cu_seqlens.
        seqused_k: int32 (B,): sequence ``b`` uses only its first ``seqused_k[b]`` keys (a ragged
            KV cache); alignment and causality count from that length.
        block_table: int32 (B, max_blocks): k and v are paged pools (num_blocks, block_size, Hkv, D)
            and sequence ``b`` reads blocks ``block_table[b]`` (forward only). With ``layout="TND"``
            queries (``cu_seqlens_q``, a ragged batch of decode rows and prefill chunks), k/v may be a
            paged pool or a contiguous cache (B, S, Hkv, D) with ``seqused_k``; causal is aligned at
            each sequence's end.
        k_scale, k_offset, v_scale, v_offset, q_scale: a quantised cache (k/v int8, float8_e4m3fn or
            float8_e5m2, or q's dtype with descales) read as ``(k + k_offset) * k_scale``, and
            ``q_scale`` (B|1, Hkv|1) multiplying the scores (FlashAttention-3's q_descale): fp32,
            shapes and granularities in :mod:`tileattn.core.kvquant`. Forward only.
        k_format, v_format: the names of the cache's format (:mod:`tileattn.core.kvformat`), one for
            both: "int8", "e4m3", "e5m2", "int4" (the defaults of k's dtype, None) or llama.cpp's blocks
            "q8_0" / "q4_0" (uint8, D / 32 * 34 or D / 32 * 18 bytes a row, scales inside: no k_scale ...).
        return_lse: also return the log-sum-exp (natural log) of the masked scores, fp32 (fp64 for
            fp64 inputs), shape (B, Hq, Sq) or (Hq, Tq) for TND. Rows that see no key: -inf (or the
            sink). The LSE is differentiable.
        deterministic: bitwise-reproducible gradients.
        score_mod, mask_mod: FlexAttention's functions ``score_mod(score, b, h, q_idx, kv_idx)`` (applied
            after softcap, ALiBi and bias) and ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = take
            part, with causal/window and mask); b (the sequence), h (the query head), q_idx (the row's
            position on the keys' axis: ``i + off`` as ``align`` places it) and kv_idx are int32 0-d
            tensors. Compiled into the native kernels' tiles (forward, backward, decode; gradients
            reach the tensors a score_mod captures); a function the compiler refuses runs on the
            ``eager`` engine (:mod:`tileattn.core.functions`, :func:`tileattn.explain` says why).
        block_mask: a PyTorch ``BlockMask`` instead of ``mask_mod``: blocks it lists as full are
            visible, blocks it lists as partial apply its ``mask_mod``, the others are hidden and
            never computed; its lengths may exceed the call's (a decode step reads its row of blocks).
        modifiers: further :class:`tileattn.core.modifiers.Modifier` objects (a modifier type of your own
            runs on the reference and on every engine that declares it; the others refuse it).
        backend: "auto" (default; ``$TILEATTN_BACKEND`` overrides it) or an engine name.
            :func:`tileattn.explain` tells why each backend accepts or refuses a call.

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse=True``.

    Raises:
        ValueError / TypeError before any compute, naming the argument, what was given and what
        would work; :class:`tileattn.NoBackendError` when no engine can run the call.
    """
    # What callers call is lean.front's function of this one (below): it takes the keywords
    # keyword-only, serves a call from its lean plan when it can and passes this function the rest
    # positionally, with the call's lean key.
    if type(return_lse) is not bool:
        check_bool("return_lse", return_lse)
    # the arguments, which the modifier types parse (they read their own names only)
    keywords = locals()
    found = modifiers_from_keywords(keywords, modifiers)
    key = _plan_key(q, k, v, layout, num_heads, scale, align, deterministic, backend, found, seqused_k, block_table,
                    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    try:
        plan = plans.get(key, _UNSEEN) if key is not None else _UNSEEN
    except TypeError:  # an unhashable argument: the full path decides
        key, plan = None, _UNSEEN
    if plan is not None and plan is not _UNSEEN:
        # A call shape seen before: its validation, engine choice and kernel arguments stand; only
        # the tensors change (and the values of seqused_k / block_table, checked again).
        spec, engine = plan.bind(q, k, v, found, seqused_k, block_table), plan.engine
    else:
        spec = spec_of(q, k, v, found, layout=layout, num_heads=num_heads, scale=scale, align=align,
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, block_table=block_table,
                       deterministic=deterministic)
        engine = select(spec, backend, backward=_needs_grad(spec))
        if key is not None:
            # A shape gets its plan when it comes back: a growing KV cache, whose shape is new every
            # step, pays nothing for plans it would never use.
            plans.put(key, None if plan is _UNSEEN else Plan(spec, engine))
    if lean_key is not None and plans.get(lean_key, _UNSEEN) is _UNSEEN:  # the front found no plan
        lean.remember(lean_key, spec, engine)
    out, lse = _execute(spec, engine, partial=False)
    return (out, lse) if return_lse else out


#: What callers call: the lean path (:func:`tileattn.core.lean.front`) in front of the full path above.
flash_attention = lean.front(flash_attention)


class Plan:
    """A validated call shape: its engine and everything validation and lowering derived from it
    (geometry, kernel arguments), with no tensor: the caller's tensors (and modifiers holding them)
    are bound per call. So a growing KV cache, which makes a new shape every step, leaves nothing of
    its earlier steps alive here."""

    __slots__ = ("template", "engine")

    def __init__(self, spec: AttentionSpec, engine):
        if engine.reads_kernel_args:
            spec.kernel_args  # noqa: B018  (lowered once, here, for every call the plan serves)
        self.template = spec.template()
        self.engine = engine

    def bind(self, q, k, v, modifiers, seqused_k, block_table) -> AttentionSpec:
        spec = AttentionSpec.from_template(self.template, q, k, v, modifiers, seqused_k, block_table)
        if seqused_k is not None or block_table is not None:
            spec = check_sequence_values(spec)
        return spec


#: this module's kind of entry in :mod:`tileattn.core.plans`: validated call shapes (:class:`Plan`;
#: None for a shape seen once) of padded calls
KIND = "full"
_UNSEEN = object()


def _meta(t) -> Optional[tuple]:
    """What validation reads of an index tensor, or None when it is not a plain dense tensor."""
    if type(t) is not torch.Tensor or t.is_nested or t.layout is not torch.strided:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


def _plan_key(q, k, v, layout, num_heads, scale, align, deterministic, backend, modifiers, seqused_k, block_table,
              varlen) -> Optional[tuple]:
    """Everything validation, dispatch and lowering read of a call, or None when the call is not one
    a plan may serve (not tensors, varlen, a traced call: the full path then decides; an unhashable
    key is found out by the lookup). Modifiers take part through their own keys (type, non-tensor
    fields, tensor metadata, gradient flags); scalars with their types, so that ``align=True``
    never shares ``align=1``'s plan.
    Of ``seqused_k`` and ``block_table`` the key holds what validation reads but their values,
    which a served call checks again."""
    if not (type(q) is type(k) is type(v) is torch.Tensor) or tracing():
        return None
    if varlen != (None, None, None, None) or layout == "TND":
        return None  # the offsets' values set the geometry
    if q.is_nested or k.is_nested or v.is_nested or not (q.layout is k.layout is v.layout is torch.strided):
        return None
    index = []
    for t in (seqused_k, block_table):
        meta = None if t is None else _meta(t)
        if t is not None and meta is None:
            return None
        index.append(meta)
    mods = tuple(m.plan_key() for m in modifiers)
    if None in mods:
        return None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return (KIND, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
            v.dtype, v.device, layout, type(num_heads), num_heads, type(scale), scale, type(align), align,
            type(deterministic), deterministic, backend, os.environ.get("TILEATTN_BACKEND"), grad, registry_version(),
            *index, mods)


def _needs_grad(spec: AttentionSpec) -> bool:
    if not torch.is_grad_enabled():
        return False
    if spec.q.requires_grad or spec.k.requires_grad or spec.v.requires_grad:
        return True
    for m in spec.modifiers:
        t = m.grad_tensor()
        if t is not None and t.requires_grad:
            return True
    return bool(ops.grad_captures(spec))


def run(spec: AttentionSpec, backend="auto", partial: bool = False):
    """(out, lse) of a validated call on the chosen engine."""
    return _execute(spec, select(spec, backend, backward=_needs_grad(spec)), partial)


def _through_op(spec: AttentionSpec) -> bool:
    """Whether a call runs as the custom op rather than calling its engine directly: when traced (the
    tracer or dispatch mode sees one op; a FakeTensor gets its fake kernel) or when q, k or v is a
    tensor subclass (its own dispatch sees the op: a wrapper subclass unwraps its data, a FakeTensor
    outside its mode answers with the fake kernel, never a real kernel reading no memory)."""
    return tracing() or not (type(spec.q) is type(spec.k) is type(spec.v) is torch.Tensor)


def _execute(spec: AttentionSpec, engine, partial: bool):
    if any(m.user_function for m in spec.modifiers):
        if not _needs_grad(spec):
            return ops.run_forward(spec, engine, partial)
        own = {m.grad_slot: m.grad_tensor() for m in spec.modifiers if m.grad_slot is not None}
        return ops.UserFunctionAttention.apply(spec, engine, partial, spec.q, spec.k, spec.v, own.get("bias"),
                                               own.get("sinks"), *ops.grad_captures(spec))
    if _needs_grad(spec) or _through_op(spec):
        return ops.attention_forward(*ops.pack(spec, engine.name, partial))
    return ops.run_forward(spec, engine, partial)


def attention_partial(q, k, v, *, backend="auto", **kwargs):
    """The attention of q over one key/value shard: ``(out, lse)``, out in fp32 (fp64 for fp64).

    Takes :func:`flash_attention`'s keywords; ``align`` places the shard inside the full sequence
    (an int: query row ``i`` is aligned with shard key ``i + align``). Both results are
    differentiable. Combine shards with :func:`tileattn.merge_attentions`.
    """
    kwargs.pop("return_lse", None)
    return run(build_spec(q, k, v, **kwargs), backend, partial=True)


class AttentionGradients(NamedTuple):
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dbias: Optional[torch.Tensor]
    dsinks: Optional[torch.Tensor]


def attention_backward(dout, q, k, v, out, lse, *, dlse=None, backend="auto", **kwargs) -> AttentionGradients:
    """Gradients of attention over one key/value shard, given the output gradient ``dout`` and the
    caller's ``out`` and ``lse`` (those of the full attention, for ring attention: then the shard's
    dq, dk, dv are its share of the full gradients). ``dlse``: an optional gradient of the LSE.

    Takes :func:`flash_attention`'s keywords for the shard. ``dbias`` is returned when the bias
    requires grad, ``dsinks`` when sinks are given. No autograd graph is recorded.
    """
    spec = build_spec(q, k, v, **kwargs)
    engine = select(spec, backend, backward=True)
    for name, t, shape in (("dout", dout, spec.out_shape()), ("out", out, spec.out_shape()),
                           ("lse", lse, spec.lse_shape()), ("dlse", dlse, spec.lse_shape())):
        if name == "dlse" and t is None:
            continue
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, type(t).__name__, f"a tensor of shape {shape}")
        if tuple(t.shape) != tuple(shape):
            fail(ValueError, name, f"shape {tuple(t.shape)}", f"{tuple(shape)} for this call")
        if t.device != spec.device:
            fail(ValueError, name, f"device {t.device}", f"device {spec.device}, as q")
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    need_dbias = any(m.grad_slot == "bias" and m.grad_tensor().requires_grad for m in spec.modifiers)
    with torch.no_grad():
        if _through_op(spec):
            q, k, v, bias, sinks, extras, ints, floats, config = ops.pack(spec, engine.name, False)
            dq, dk, dv, dbias, dsinks = ops.attention_backward(dout, dlse, out, lse, q, k, v, bias, sinks, extras,
                                                               ints, floats, config, need_dbias)
            return AttentionGradients(dq, dk, dv, dbias if need_dbias else None, dsinks if sinks is not None else None)
        grads = ops.run_backward(spec, engine, dout, dlse, out, lse, need_dbias)[:5]
    return AttentionGradients(*grads)


def explain(q, k, v, **kwargs):
    """Which backend would run this call, and every backend's reasons for refusing it
    ({backend name: [reasons]}; an empty list = would run)."""
    kwargs.pop("backend", None)
    check_bool("return_lse", kwargs.pop("return_lse", False))
    return _explain(build_spec(q, k, v, **kwargs))
