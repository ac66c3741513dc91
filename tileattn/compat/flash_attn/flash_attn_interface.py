"""The functions of ``flash_attn.flash_attn_interface`` (flash-attn 2.x), translated onto tileattn.

Every function validates its arguments under flash-attn's own names, then makes one call to
:func:`tileattn.flash_attention` with ``layout="BSND"`` (or ``"TND"`` for varlen). Packed inputs are
split into views, never copied. Gradients flow through autograd like the original; dropout draws its
seed from torch's default generator, so ``torch.manual_seed`` makes it reproducible.
"""

from __future__ import annotations

import numbers

import torch

from ...api import flash_attention
from ...reference import reference


def _fail(fn, arg, given, expected, exc=ValueError):
    raise exc(f"tileattn.compat.flash_attn.{fn}: argument '{arg}': got {given}; expected {expected}.")


def _check_rank(fn, name, t, rank, shape):
    if not isinstance(t, torch.Tensor):
        _fail(fn, name, type(t).__name__, f"a torch.Tensor of shape {shape}", TypeError)
    if t.dim() != rank:
        _fail(fn, name, f"a {t.dim()}-d tensor of shape {tuple(t.shape)}", f"a {rank}-d tensor {shape}")


def _check_options(fn, dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_probs):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        _fail(fn, "dropout_p", repr(dropout_p), "a float in [0, 1)")
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)):
        _fail(fn, "softmax_scale", repr(softmax_scale), "None (= 1/sqrt(headdim)) or a float", TypeError)
    if not isinstance(causal, bool):
        _fail(fn, "causal", repr(causal), "True or False", TypeError)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or any(isinstance(w, bool) or not isinstance(w, numbers.Integral) for w in window_size)):
        _fail(fn, "window_size", repr(window_size), "a pair (left, right) of ints, -1 = unbounded", TypeError)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or softcap < 0:
        _fail(fn, "softcap", repr(softcap), "a float >= 0 (0 = off)")
    for name, flag in (("deterministic", deterministic), ("return_attn_probs", return_probs)):
        if not isinstance(flag, bool):
            _fail(fn, name, repr(flag), "True or False", TypeError)
    return tuple(int(w) for w in window_size)


def _draw_seed(dropout_p):
    """The dropout seed, from torch's default generator as flash-attn does (None without dropout)."""
    return int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else None


def _attention_probs(q, k, kwargs, dropout_p, seed):
    """The softmax matrix (B, H, Sq, Sk) from the exact reference, flash-attn's ``S_dmask``.

    Attending with ``v = identity`` returns the probabilities themselves. Entries dropped by dropout
    come back negated (flash-attn encodes the dropout pattern in the sign).
    """
    varlen = kwargs.get("layout") == "TND"
    with torch.no_grad():
        if varlen:
            cu_q = kwargs["cu_seqlens_q"].tolist()
            cu_k = kwargs["cu_seqlens_k"].tolist()
            max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
            max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
            seq_of_key = torch.repeat_interleave(
                torch.arange(len(cu_k) - 1), torch.tensor([b - a for a, b in zip(cu_k, cu_k[1:])]))
            pos = torch.arange(k.shape[0]) - torch.tensor(cu_k[:-1], dtype=torch.long)[seq_of_key]
            eye = torch.nn.functional.one_hot(pos, max(max_k, 1)).to(device=k.device, dtype=k.dtype)
            v_eye = eye[:, None, :].expand(k.shape[0], k.shape[1], eye.shape[1])
        else:
            sk = k.shape[1]
            eye = torch.eye(sk, dtype=k.dtype, device=k.device)
            v_eye = eye[None, :, None, :].expand(k.shape[0], sk, k.shape[2], sk)
        kw = dict(kwargs, dropout_p=0.0, seed=None)
        probs = reference(q, k, v_eye, compute_dtype=torch.float32, **kw)
        if dropout_p > 0:
            kept = reference(q, k, v_eye, compute_dtype=torch.float32, **dict(kwargs, dropout_p=dropout_p, seed=seed))
            probs = torch.where((kept == 0) & (probs != 0), -probs, probs)
        if not varlen:
            return probs.permute(0, 2, 1, 3)
        out = probs.new_zeros(len(cu_q) - 1, q.shape[1], max_q, max(max_k, 1))
        for b, (q0, q1) in enumerate(zip(cu_q, cu_q[1:])):
            out[b, :, : q1 - q0] = probs[q0:q1].transpose(0, 1)
        return out


def _run(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
         deterministic, return_attn_probs, **layout_kwargs):
    window = _check_options(fn, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                            return_attn_probs)
    seed = _draw_seed(dropout_p)
    kwargs = dict(scale=softmax_scale, causal=causal, window=window, softcap=float(softcap),
                  alibi_slopes=alibi_slopes, deterministic=deterministic, **layout_kwargs)
    out, lse = flash_attention(q, k, v, dropout_p=float(dropout_p), seed=seed, return_lse=True, **kwargs)
    if not return_attn_probs:
        return out
    return out, lse, _attention_probs(q, k, kwargs, float(dropout_p), seed)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention of q (B, Sq, H, D), k (B, Sk, Hk, D), v (B, Sk, Hk, Dv); H % Hk == 0.

    Causal and ``window_size`` are aligned to the bottom-right corner; -1 = unbounded window side.
    Returns ``out`` (B, Sq, H, Dv), or ``(out, softmax_lse (B, H, Sq) fp32, S_dmask (B, H, Sq, Sk))``
    with ``return_attn_probs=True``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank("flash_attn_func", name, t, 4, "(batch, seqlen, nheads, headdim)")
    return _run("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_attn_probs, layout="BSND")


def _unpack(fn, name, packed, rank, count, shape):
    _check_rank(fn, name, packed, rank, shape)
    if packed.shape[-3] != count:
        _fail(fn, name, f"shape {tuple(packed.shape)} (dim {rank - 3} has size {packed.shape[-3]})",
              f"{shape} with dim {rank - 3} of size {count}")
    return [packed.select(rank - 3, i) for i in range(count)]


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` on qkv (B, S, 3, H, D), read as three views (no copy)."""
    fn = "flash_attn_qkvpacked_func"
    q, k, v = _unpack(fn, "qkv", qkv, 5, 3, "(batch, seqlen, 3, nheads, headdim)")
    return _run(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, layout="BSND")


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` on q (B, Sq, H, D) and kv (B, Sk, 2, Hk, D) (views, no copy)."""
    fn = "flash_attn_kvpacked_func"
    _check_rank(fn, "q", q, 4, "(batch, seqlen, nheads, headdim)")
    k, v = _unpack(fn, "kv", kv, 5, 2, "(batch, seqlen, 2, nheads_k, headdim)")
    return _run(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, layout="BSND")


def _check_max_seqlen(fn, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        _fail(fn, name, repr(value), "a non-negative int (the longest sequence)", TypeError)


def _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table=None):
    if block_table is not None:
        raise NotImplementedError(
            f"tileattn.compat.flash_attn.{fn}: argument 'block_table' (paged KV cache) is not supported; "
            "pass contiguous k/v of shape (total_k, nheads_k, headdim).")
    _check_max_seqlen(fn, "max_seqlen_q", max_seqlen_q)
    _check_max_seqlen(fn, "max_seqlen_k", max_seqlen_k)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
            given = f"dtype {cu.dtype}, shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            _fail(fn, name, given, "an int32 tensor of shape (batch + 1,) of cumulative offsets", TypeError)
    return _run(fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                deterministic, return_attn_probs, layout="TND", cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """Variable-length attention: q (total_q, H, D), k/v (total_k, Hk, D); sequence ``b`` is rows
    ``cu_seqlens[b]:cu_seqlens[b+1]``. softmax_lse is (H, total_q)."""
    fn = "flash_attn_varlen_func"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(fn, name, t, 3, "(total_tokens, nheads, headdim)")
    return _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, block_table)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                     deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` on qkv (total, 3, H, D), one cu_seqlens for q and k."""
    fn = "flash_attn_varlen_qkvpacked_func"
    q, k, v = _unpack(fn, "qkv", qkv, 4, 3, "(total_tokens, 3, nheads, headdim)")
    return _varlen(fn, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                    softcap=0.0, alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """:func:`flash_attn_varlen_func` on q (total_q, H, D) and kv (total_k, 2, Hk, D)."""
    fn = "flash_attn_varlen_kvpacked_func"
    _check_rank(fn, "q", q, 3, "(total_tokens, nheads, headdim)")
    k, v = _unpack(fn, "kv", kv, 4, 2, "(total_tokens, 2, nheads_k, headdim)")
    return _varlen(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


# The decoding entry point lives in its own module (cache bookkeeping, rotary, paged KV).
from .kvcache import flash_attn_with_kvcache  # noqa: E402,F401
