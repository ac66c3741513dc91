"""The exact reference: attention that materialises the full score matrix.

It is the oracle of every test, benchmark and tutorial, so it is written to be obviously right rather
than fast: one einsum for the scores, the shared score pipeline of :mod:`tileattn.scores`, a softmax,
one einsum for the output. It is differentiable by plain autograd.

``compute_dtype`` chooses the arithmetic: ``None`` computes in the inputs' own dtype ("plain PyTorch
math in the same dtype", the yardstick of FlashAttention's error rule), ``torch.float32`` or
``torch.float64`` upcast first. The result comes back in ``compute_dtype`` (the input dtype when None).
"""

from __future__ import annotations

import math

import torch

from . import scores as S
from .spec import AttentionInputs, make_inputs, user_shape


def reference(q, k, v, *, compute_dtype=None, return_lse=False, **kwargs):
    """Exact attention with the semantics of :func:`tileattn.flash_attention`.

    Takes the same keyword arguments as ``flash_attention`` (layout, num_heads, scale, causal,
    window, mask, bias, alibi_slopes, softcap, dropout_p, seed, generator, cu_seqlens_q/k, ...).
    """
    kwargs.pop("backend", None)
    inp = make_inputs(q, k, v, **kwargs)
    return reference_from_inputs(inp, compute_dtype=compute_dtype, return_lse=return_lse)


def reference_from_inputs(inp: AttentionInputs, compute_dtype=None, return_lse=False):
    cdtype = compute_dtype or inp.dtype
    if inp.is_varlen:
        outs, lses = [], []
        for b, (q0, lq, k0, lk) in enumerate(inp.seq_lengths()):
            qs = inp.q_c[q0:q0 + lq].transpose(0, 1)[None]
            ks = inp.k_c[k0:k0 + lk].transpose(0, 1)[None]
            vs = inp.v_c[k0:k0 + lk].transpose(0, 1)[None]
            o, l = _dense(inp, qs, ks, vs, b, cdtype)
            outs.append(o[0].transpose(0, 1))
            lses.append(l[0])
        out = torch.cat(outs, 0) if outs else inp.q.new_zeros((0, inp.heads_q, inp.head_dim_v), dtype=cdtype)
        lse = torch.cat(lses, 1) if lses else torch.zeros(inp.lse_shape(), dtype=cdtype)
    else:
        out_c, lse = _dense(inp, inp.q_c, inp.k_c, inp.v_c, None, cdtype)
        out = _from_canonical(out_c, inp)
    lse = lse.to(torch.float64 if cdtype == torch.float64 else torch.float32)
    return (out, lse) if return_lse else out


def _from_canonical(out_c: torch.Tensor, inp: AttentionInputs) -> torch.Tensor:
    b, h, s, d = out_c.shape
    if inp.layout == "BNSD":
        return out_c
    if inp.layout == "BSND":
        return out_c.transpose(1, 2)
    if inp.layout == "BSH":
        return out_c.transpose(1, 2).reshape(user_shape("BSH", b, h, s, d))
    return out_c.permute(2, 0, 1, 3).reshape(user_shape("SBH", b, h, s, d))


def _dense(inp: AttentionInputs, q, k, v, batch_index, cdtype):
    """Attention of canonical (B, H, S, D) tensors; ``batch_index`` set for one varlen sequence."""
    bsz, hq, sq, _ = q.shape
    sk = k.shape[2]
    g = inp.group_size
    q, k, v = q.to(cdtype), k.to(cdtype), v.to(cdtype)
    if g > 1:
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("bhid,bhjd->bhij", q, k) * inp.scale
    if inp.softcap > 0:
        s = inp.softcap * torch.tanh(s / inp.softcap)
    dev = q.device
    rows = torch.arange(sq, device=dev)
    cols = torch.arange(sk, device=dev)
    if inp.alibi_slopes is not None:
        slopes = inp.alibi_slopes.to(cdtype)
        if slopes.dim() == 1:
            slopes = slopes[None].expand(inp.batch, hq)
        if batch_index is not None:
            slopes = slopes[batch_index:batch_index + 1]
        s = s - slopes[:, :, None, None] * S.alibi_distance(rows, cols, sq, sk, cdtype)
    if inp.bias is not None:
        s = s + inp.bias.to(cdtype)
    keep = None
    left, right = inp.window_bounds
    if left is not None or right is not None:
        keep = S.band_keep(rows, cols, sq, sk, left, right)
    if inp.mask is not None:
        keep = inp.mask if keep is None else keep & inp.mask
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    s = s.expand(bsz, hq, sq, sk)
    # Rows that see no key (every score -inf, from masks or from a -inf bias) output exactly 0 and
    # LSE -inf. Their log-sum-exp is taken over zeros instead, so that neither the forward nor the
    # logsumexp backward meets -inf - (-inf) = NaN (which would leak into dq, dk and dbias).
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    lse = torch.logsumexp(s.masked_fill(empty, 0.0), dim=-1, keepdim=True)
    p = torch.exp(s - lse)
    lse = lse.squeeze(-1).masked_fill(empty.squeeze(-1), -math.inf)
    if inp.dropout_p > 0:
        keep_drop = torch.empty(p.shape, dtype=torch.bool, device=dev)
        heads = torch.arange(hq, device=dev)
        for b in range(bsz):
            rng_b = b if batch_index is None else batch_index
            keys = S.dropout_row_keys(inp.seed, rng_b, heads, rows)
            keep_drop[b] = S.dropout_keep(keys, cols, inp.dropout_p)
        p = torch.where(keep_drop, p / (1.0 - inp.dropout_p), torch.zeros((), dtype=p.dtype, device=dev))
    out = torch.einsum("bhij,bhjd->bhid", p, v)
    return out, lse
