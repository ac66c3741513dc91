"""The public operator: :func:`flash_attention`."""

from __future__ import annotations

from .dispatch import select
from .ops import attention_forward
from .spec import make_inputs


def flash_attention(
    q,
    k,
    v,
    *,
    layout="BNSD",
    num_heads=None,
    scale=None,
    causal=False,
    window=None,
    mask=None,
    bias=None,
    alibi_slopes=None,
    softcap=0.0,
    dropout_p=0.0,
    seed=None,
    generator=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    return_lse=False,
    deterministic=False,
    backend="auto",
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
    ========  =====================  ==========================================================

    The output has q's layout, batch/length and v's head dim, in q's dtype. Inputs are read through
    their strides (a transposed view is never copied to contiguous memory). GQA/MQA: ``Hq % Hkv == 0``
    and query head ``h`` reads kv head ``h // (Hq // Hkv)``; K/V are never repeated.

    Order of operations (fixed)::

        s = scale * q.k^T -> softcap -> + ALiBi + bias -> causal, window and mask -> softmax
          -> dropout -> . v

    Causal and window are aligned to the **bottom-right** corner (FlashAttention-2): query row ``i``
    sees key ``j`` iff ``i + (Sk - Sq) - left <= j <= i + (Sk - Sq) + right``. ``causal=True`` sets
    ``right = 0``. Sq = 2, Sk = 5, causal::

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

    Sliding window ``window=(2, 0)`` at Sq = Sk = 5 (Mistral-style, each query sees itself and the
    two keys before it)::

        1 0 0 0 0
        1 1 0 0 0
        1 1 1 0 0
        0 1 1 1 0
        0 0 1 1 1

    Args:
        q, k, v: fp16, bf16, fp32 or fp64 tensors of one dtype and device (shapes above).
        layout: "BNSD" (default), "BSND", "BSH", "SBH" or "TND" (variable length).
        num_heads: number of query heads; required for BSH/SBH (kv heads follow from k's width).
        scale: multiplies q.k^T; default ``1 / sqrt(D)``.
        causal: bottom-right aligned causal mask (see above).
        window: ``(left, right)`` sliding window; ``None`` or a negative value = unbounded side.
        mask: bool tensor broadcastable to (B, Hq, Sq, Sk); **True = take part** (SDPA convention).
        bias: float tensor broadcastable to (B, Hq, Sq, Sk), added to the scores; when it requires
            grad its gradient is returned, reduced over its broadcast dimensions.
        alibi_slopes: fp32 (Hq,) or (B, Hq); adds ``-slope * |i + Sk - Sq - j|``.
        softcap: > 0 replaces scores by ``softcap * tanh(scores / softcap)``.
        dropout_p: probability of dropping an attention weight (training); kept weights are scaled
            by ``1 / (1 - dropout_p)``. The mask is a pure function of (seed, batch, head, row, col).
        seed / generator: dropout randomness; the same seed gives bitwise the same output and
            gradients. Without either, a seed is drawn from torch's default generator.
        cu_seqlens_q, cu_seqlens_k: int32 (B+1,) cumulative offsets for ``layout="TND"``.
        max_seqlen_q, max_seqlen_k: optional; checked against the cu_seqlens.
        return_lse: also return the log-sum-exp (natural log) of the masked scores, fp32 (fp64 for
            fp64 inputs), shape (B, Hq, Sq) or (Hq, Tq) for TND. Rows that see no key: -inf.
        deterministic: bitwise-reproducible gradients (the CPU engine always is).
        backend: "auto" (default; ``$TILEATTN_BACKEND`` overrides it), "cpu", "triton" or
            "reference". :func:`tileattn.explain` tells why each backend accepts or refuses a call.

    Returns:
        ``out``, or ``(out, lse)`` with ``return_lse=True``.

    Raises:
        ValueError / TypeError before any compute, naming the argument, what was given and what
        would work; :class:`tileattn.NoBackendError` when no engine can run the call.
    """
    inp = make_inputs(
        q, k, v, layout=layout, num_heads=num_heads, scale=scale, causal=causal, window=window,
        mask=mask, bias=bias, alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
        seed=seed, generator=generator, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, deterministic=deterministic,
    )
    engine = select(inp, backend)
    left, right = inp.window
    out, lse = attention_forward(
        q, k, v, mask, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, inp.layout,
        inp.heads_q, inp.scale, inp.causal, -1 if left is None else left, -1 if right is None else right,
        inp.softcap, inp.dropout_p, inp.seed, inp.deterministic, engine.name,
    )
    return (out, lse) if return_lse else out


def explain(q, k, v, **kwargs):
    """Which backend would run this call, and every backend's reasons for refusing it."""
    from .dispatch import explain as _explain

    kwargs.pop("backend", None)
    kwargs.pop("return_lse", None)
    return _explain(make_inputs(q, k, v, **kwargs))
