"""The exact reference: attention that materialises the score matrix of every sequence.

It is the oracle of every test, benchmark and tutorial, so it is written to be obviously right rather
than fast: one einsum for the scores, each modifier's ``reference`` rule from
:mod:`tileattn.modifiers`, a softmax, one einsum for the output, one sequence at a time. It is
differentiable by plain autograd (the tests' oracle for gradients), and :func:`reference_backward`
writes FlashAttention's backward formulas out explicitly for the reference backend, which must use
the LSE it is given (a partial result's backward with global statistics).

``compute_dtype`` chooses the arithmetic: ``None`` computes in the inputs' own dtype ("plain PyTorch
math in the same dtype", the yardstick of FlashAttention's error rule), ``torch.float32`` or
``torch.float64`` upcast first. The result comes back in ``compute_dtype`` (the input dtype when None).
"""

from __future__ import annotations

import math

import torch

from .spec import AttentionSpec, SequenceSlice, build_spec, check_bool


def reference(q, k, v, *, compute_dtype=None, return_lse=False, **kwargs):
    """Exact attention with the semantics of :func:`tileattn.flash_attention`.

    Takes the same keyword arguments as ``flash_attention`` (layout, num_heads, scale, causal,
    window, align, mask, bias, alibi_slopes, softcap, dropout_p, seed, generator, sinks,
    cu_seqlens_q/k, seqused_k, block_table, ...).
    """
    kwargs.pop("backend", None)
    check_bool("return_lse", return_lse)
    spec = build_spec(q, k, v, **kwargs)
    out, lse = reference_from_spec(spec, compute_dtype)
    return (out, lse) if return_lse else out


def sequence_views(spec: AttentionSpec, seq: SequenceSlice):
    """(q, k, v) of one sequence as (Hq, q_len, D), (Hkv, k_len, D), (Hkv, k_len, Dv).

    Views of the user's tensors, except for a paged cache, whose blocks are gathered (a copy).
    """
    b, q0, lq, k0, lk = seq.batch, seq.q_start, seq.q_len, seq.k_start, seq.k_len
    if spec.is_varlen:
        q = spec.q_c[q0:q0 + lq].transpose(0, 1)
    else:
        q = spec.q_c[b]
    if spec.is_paged:
        blocks = spec.block_table[b, : -(-lk // spec.block_size)].long()

        def gather(pool):  # (num_blocks, H, block_size, E) -> (H, k_len, E)
            return pool[blocks].transpose(0, 1).flatten(1, 2)[:, :lk]

        return q, gather(spec.k_c), gather(spec.v_c)
    if spec.cu_seqlens_k is not None:
        return q, spec.k_c[k0:k0 + lk].transpose(0, 1), spec.v_c[k0:k0 + lk].transpose(0, 1)
    return q, spec.k_c[b, :, :lk], spec.v_c[b, :, :lk]


def _scores(spec: AttentionSpec, seq: SequenceSlice, q, k, cdtype):
    """Masked scores (Hq, q_len, k_len) of one sequence, the softcap's tanh (or None) and the keep
    mask of the band and bool mask (or None)."""
    k = k.to(cdtype).repeat_interleave(spec.group_size, dim=0)
    s = torch.einsum("hid,hjd->hij", q.to(cdtype), k) * spec.scale
    dev = s.device
    rows = torch.arange(seq.q_len, device=dev)
    cols = torch.arange(seq.k_len, device=dev)
    every_head = slice(None)
    tanh = None
    softcap = spec.modifier("softcap")
    if softcap is not None:
        s, tanh = softcap.apply(s)
    alibi = spec.modifier("alibi")
    if alibi is not None:
        s = s + alibi.scores(seq.batch, every_head, rows, cols, seq.offset, cdtype)
    bias = spec.modifier("bias")
    if bias is not None:
        s = s + bias.block(seq.batch, every_head, 0, seq.q_len, 0, seq.k_len).to(cdtype)
    keep = None
    band = spec.modifier("band")
    if band is not None:
        keep = band.keep(rows, cols, seq.offset)
    mask = spec.modifier("mask")
    if mask is not None:
        block = mask.block(seq.batch, every_head, 0, seq.q_len, 0, seq.k_len)
        keep = block if keep is None else keep & block
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    return s.expand(spec.heads_q, seq.q_len, seq.k_len), tanh, keep


def _dropout_factor(spec: AttentionSpec, seq: SequenceSlice, cdtype):
    """(Hq, q_len, k_len) factor 0 or 1/(1-p) of the dropout mask, or None without dropout."""
    dropout = spec.modifier("dropout")
    if dropout is None:
        return None
    dev = spec.q.device
    keep = dropout.keep(seq.batch, torch.arange(spec.heads_q, device=dev), torch.arange(seq.q_len, device=dev),
                        torch.arange(seq.k_len, device=dev))
    return keep.to(cdtype) * dropout.keep_scale


def _lse(s):
    """Log-sum-exp of each row of scores. A row that sees no key gets -inf, computed over zeros so that
    neither the forward nor the logsumexp backward meets ``-inf - (-inf) = NaN`` (which would leak
    into dq, dk and dbias)."""
    empty = torch.isneginf(s).all(dim=-1)
    lse = torch.logsumexp(s.masked_fill(empty[..., None], 0.0), dim=-1)
    return lse.masked_fill(empty, -math.inf)


def _with_sinks(spec: AttentionSpec, out, lse):
    """(out, lse) with the sinks in the denominator: ``out * sigmoid(lse - sink)`` and
    ``lse - logsigmoid(lse - sink)``, a form whose gradients stay finite for a sink of +-inf and for
    rows that see no key (whose LSE becomes the sink)."""
    sinks = spec.modifier("sinks")
    if sinks is None:
        return out, lse
    sink = sinks.tensor.to(lse.dtype)[:, None]
    gap = lse - sink
    total = torch.where(torch.isneginf(lse), sink.expand_as(lse), lse - torch.nn.functional.logsigmoid(gap))
    return out * torch.sigmoid(gap)[..., None], total


def _probabilities(s, lse):
    """exp(s - lse), 0 in rows whose LSE is -inf."""
    return torch.exp(s - lse.masked_fill(torch.isneginf(lse), math.inf)[..., None])


def reference_from_spec(spec: AttentionSpec, compute_dtype=None):
    """(out in the user's layout, LSE) of a validated call, computed in ``compute_dtype`` (an
    autocast region around the call does not change that: the oracle's precision is its argument)."""
    if spec.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(spec.device.type):
        with torch.autocast(spec.device.type, enabled=False):
            return reference_from_spec(spec, compute_dtype)
    cdtype = compute_dtype or spec.dtype
    outs, lses = [], []
    for seq in spec.sequences:
        q, k, v = sequence_views(spec, seq)
        s, _, _ = _scores(spec, seq, q, k, cdtype)
        lse = _lse(s)
        p = _probabilities(s, lse)
        drop = _dropout_factor(spec, seq, cdtype)
        if drop is not None:
            p = p * drop
        v = v.to(cdtype).repeat_interleave(spec.group_size, dim=0)
        out, lse = _with_sinks(spec, torch.einsum("hij,hjd->hid", p, v), lse)
        outs.append(out)
        lses.append(lse)
    lse_dtype = torch.float64 if cdtype == torch.float64 else torch.float32
    if spec.is_varlen:
        out_c = torch.cat([o.transpose(0, 1) for o in outs], 0) if outs else \
            spec.q.new_zeros((0, spec.heads_q, spec.head_dim_v), dtype=cdtype)
        lse = torch.cat(lses, 1) if lses else torch.zeros(spec.lse_shape(), dtype=lse_dtype)
        return out_c, lse.to(lse_dtype)
    out_c = torch.stack(outs) if outs else spec.q.new_zeros((0, spec.heads_q, spec.seqlen_q, spec.head_dim_v),
                                                             dtype=cdtype)
    lse = torch.stack(lses) if lses else torch.zeros(spec.lse_shape(), dtype=lse_dtype)
    return from_canonical(out_c, spec.layout), lse.to(lse_dtype)


def from_canonical(out_c: torch.Tensor, layout: str) -> torch.Tensor:
    """A canonical (B, H, S, D) tensor in ``layout`` (a copy for the flattened-head layouts)."""
    if layout in ("BNSD", "TND"):
        return out_c
    if layout == "BSND":
        return out_c.transpose(1, 2)
    if layout == "BSH":
        return out_c.transpose(1, 2).flatten(2)
    return out_c.permute(2, 0, 1, 3).flatten(2)


@torch.no_grad()
def reference_backward(spec: AttentionSpec, out_c, dout_c, lse, delta, dq_c, dk_c, dv_c, dbias4=None):
    """FlashAttention's backward, written out, in the accumulation dtype, with the *given* LSE and
    ``delta = rowsum(dO * O) - dLSE``::

        P = exp(S - lse)        dV = (P * D)^T dO        dP = (dO V^T) * D     (D: dropout factor)
        dS = P * (dP - delta)   dBias = dS               dS *= 1 - tanh^2     (softcap)
        dQ = dS K * scale       dK = dS^T Q * scale

    Writes dq, dk, dv (canonical views) and accumulates into ``dbias4`` (the bias's 4-d shape).
    """
    cdt = spec.acc_dtype()
    g = spec.group_size
    dk_c.zero_(), dv_c.zero_()
    for seq in spec.sequences:
        q, k, v = sequence_views(spec, seq)
        s, tanh, keep = _scores(spec, seq, q, k, cdt)
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        if spec.is_varlen:
            lse_s, delta_s = lse[:, rows].to(cdt), delta[:, rows].to(cdt)
            do = dout_c[rows].transpose(0, 1).to(cdt)
        else:
            lse_s, delta_s, do = lse[seq.batch].to(cdt), delta[seq.batch].to(cdt), dout_c[seq.batch].to(cdt)
        p = _probabilities(s, lse_s)
        drop = _dropout_factor(spec, seq, cdt)
        pd = p if drop is None else p * drop
        v_rep = v.to(cdt).repeat_interleave(g, dim=0)
        k_rep = k.to(cdt).repeat_interleave(g, dim=0)
        dv_rep = torch.einsum("hij,hid->hjd", pd, do)
        dp = torch.einsum("hid,hjd->hij", do, v_rep)
        if drop is not None:
            dp = dp * drop
        ds = p * (dp - delta_s[..., None])
        if keep is not None:
            # Hidden pairs get no gradient, even in a row made NaN by a +inf score (as autograd
            # through the forward's masked_fill gives).
            ds = ds.masked_fill(~keep, 0.0)
        if dbias4 is not None:
            _accumulate_bias_grad(dbias4, ds, seq)
        if tanh is not None:
            ds = ds * (1 - tanh * tanh)
        dq = torch.einsum("hij,hjd->hid", ds, k_rep) * spec.scale
        dk_rep = torch.einsum("hij,hid->hjd", ds, q.to(cdt)) * spec.scale
        dk = dk_rep.unflatten(0, (spec.heads_kv, g)).sum(1)
        dv = dv_rep.unflatten(0, (spec.heads_kv, g)).sum(1)
        if spec.is_varlen:
            keys = slice(seq.k_start, seq.k_start + seq.k_len)
            dq_c[rows] = dq.transpose(0, 1)
            dk_c[keys] = dk.transpose(0, 1)
            dv_c[keys] = dv.transpose(0, 1)
        else:
            dq_c[seq.batch] = dq
            dk_c[seq.batch, :, : seq.k_len] = dk
            dv_c[seq.batch, :, : seq.k_len] = dv


def _accumulate_bias_grad(dbias4, ds, seq: SequenceSlice):
    """Add one sequence's dS (Hq, q_len, k_len) into the (B?, H?, Sq?, Sk?) bias gradient."""
    target = dbias4[seq.batch if dbias4.shape[0] > 1 else 0]
    t = ds
    for dim in range(3):
        if target.shape[dim] == 1 and t.shape[dim] != 1:
            t = t.sum(dim, keepdim=True)
    target[:, : t.shape[1], : t.shape[2]] += t.to(target.dtype)

