"""The exact reference: attention that materialises the score matrix of every sequence.

It is the oracle of every test, benchmark and tutorial, so it is written to be obviously right rather
than fast: one einsum for the scores, each modifier applied by its own hooks in pipeline order
(:mod:`tileattn.core.modifiers`: scores, visible pairs, weights, extra logits), a softmax, one einsum for
the output, one sequence at a time. It is
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

from .kvquant import quant_of
from .merge import merge_weights
from .score_math import ScoreBlock
from .spec import AttentionSpec, SequenceSlice, build_spec, check_bool, dequantised_spec, sequence_views


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


def _blocks(spec: AttentionSpec, seq: SequenceSlice, cdtype, max_elements=None):
    """The score blocks of one sequence, every query head: its whole matrix, or blocks of rows of at
    most ``max_elements`` scores (the ``eager`` engine's bound on memory)."""
    step = seq.q_len if max_elements is None else max(1, max_elements // max(1, spec.heads_q * seq.k_len))
    for i0 in range(0, max(1, seq.q_len), max(1, step)):  # a sequence without queries: one empty block
        yield ScoreBlock(seq.batch, slice(None), i0, min(seq.q_len, i0 + step), 0, seq.k_len, seq.offset, cdtype,
                         spec.device)


def _scores(spec: AttentionSpec, block: ScoreBlock, q, k, cdtype):
    """Masked scores (Hq, q_len, k_len) of one sequence, the scores before each modifier (its
    ``scores_grad`` reads them) and the pairs that take part (None: all). Every modifier is applied
    by its own hooks, in pipeline order."""
    k = k.to(cdtype).repeat_interleave(spec.group_size, dim=0)
    s = torch.einsum("hid,hjd->hij", q.to(cdtype), k) * spec.scale
    before = []
    for m in spec.modifiers:
        before.append(s)
        s = m.scores(s, block).to(cdtype)  # a score_mod may promote (bf16 scores times a float32 table)
    keep = None
    for m in spec.modifiers:
        visible = m.visible(block)
        if visible is not None:
            keep = visible if keep is None else keep & visible
    if keep is not None:
        s = s.masked_fill(~keep, -math.inf)
    return s.expand(spec.heads_q, block.i1 - block.i0, block.j1 - block.j0), before, keep


def _lse(s):
    """Log-sum-exp of each row of scores. A row that sees no key gets -inf, computed over zeros so that
    neither the forward nor the logsumexp backward meets ``-inf - (-inf) = NaN`` (which would leak
    into dq, dk and dbias)."""
    empty = torch.isneginf(s).all(dim=-1)
    lse = torch.logsumexp(s.masked_fill(empty[..., None], 0.0), dim=-1)
    return lse.masked_fill(empty, -math.inf)


def _with_extra_parts(spec: AttentionSpec, out, lse):
    """(out, lse) with the partial results the modifiers add (the sinks: an extra logit in every
    row's denominator), merged by :func:`tileattn.core.merge.merge_weights`, whose form keeps gradients
    finite for a sink of +-inf and for rows that see no key (whose LSE becomes the sink)."""
    for m in spec.modifiers:
        logits = m.extra_logits(lse, 0)
        if logits is not None:
            (weight, _), lse = merge_weights(lse, logits)
            out = out * weight[..., None]
    return out, lse


def _probabilities(s, lse):
    """exp(s - lse), 0 in rows whose LSE is -inf."""
    return torch.exp(s - lse.masked_fill(torch.isneginf(lse), math.inf)[..., None])


def reference_from_spec(spec: AttentionSpec, compute_dtype=None, max_elements=None):
    """(out in the user's layout, LSE) of a validated call, computed in ``compute_dtype`` (an
    autocast region around the call does not change that: the oracle's precision is its argument),
    in blocks of rows of at most ``max_elements`` scores (None: each sequence's whole matrix)."""
    if spec.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(spec.device.type):
        with torch.autocast(spec.device.type, enabled=False):
            return reference_from_spec(spec, compute_dtype, max_elements)
    cdtype = compute_dtype or spec.dtype
    if quant_of(spec) is not None:  # a quantised cache: dequantised, and q_scale applied, in cdtype
        spec = dequantised_spec(spec, cdtype)
    outs, lses = [], []
    for seq in spec.sequences:
        q, k, v = sequence_views(spec, seq)
        v = v.to(cdtype).repeat_interleave(spec.group_size, dim=0)
        seq_outs, seq_lses = [], []
        for block in _blocks(spec, seq, cdtype, max_elements):
            s, _, _ = _scores(spec, block, q[:, block.i0:block.i1], k, cdtype)
            lse = _lse(s)
            p = _probabilities(s, lse)
            for m in spec.modifiers:
                p = m.weights(p, block, spec.heads_q)
            out, lse = _with_extra_parts(spec, torch.einsum("hij,hjd->hid", p, v), lse)
            seq_outs.append(out)
            seq_lses.append(lse)
        outs.append(torch.cat(seq_outs, 1))
        lses.append(torch.cat(seq_lses, 1))
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


#: score elements a step of :func:`row_max` materialises (bounds its memory)
ROW_MAX_ELEMENTS = 1 << 24


@torch.no_grad()
def row_max(spec: AttentionSpec) -> torch.Tensor:
    """The largest score each query row sees (after every modifier and mask), lse-shaped, in the
    accumulation dtype; -inf for rows that see nothing. Computed in blocks of rows, never the whole
    score matrix (FlexAttention's ``AuxRequest(max_scores=True)``)."""
    cdtype = spec.acc_dtype()
    out = torch.full(spec.lse_shape(), -math.inf, dtype=cdtype, device=spec.device)
    for seq in spec.sequences:
        q, k, _ = sequence_views(spec, seq)
        step = max(1, ROW_MAX_ELEMENTS // max(1, spec.heads_q * seq.k_len))
        for i0 in range(0, seq.q_len, step):
            i1 = min(seq.q_len, i0 + step)
            block = ScoreBlock(seq.batch, slice(None), i0, i1, 0, seq.k_len, seq.offset, cdtype, spec.device)
            s, _, _ = _scores(spec, block, q[:, i0:i1], k, cdtype)
            top = s.amax(-1) if seq.k_len else s.new_full(s.shape[:-1], -math.inf)
            if spec.is_varlen:
                out[:, seq.q_start + i0:seq.q_start + i1] = top
            else:
                out[seq.batch, :, i0:i1] = top
    return out


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
def reference_backward(spec: AttentionSpec, out_c, dout_c, lse, delta, dq_c, dk_c, dv_c, dbias4=None, captures=(),
                       max_elements=None):
    """FlashAttention's backward, written out, in the accumulation dtype, with the *given* LSE and
    ``delta = rowsum(dO * O) - dLSE``::

        P = exp(S - lse)        dV = (P * D)^T dO        dP = (dO V^T) * D     (D: dropout factor)
        dS = P * (dP - delta)   dBias = dS               dS *= 1 - tanh^2     (softcap)
        dQ = dS K * scale       dK = dS^T Q * scale

    Writes dq, dk, dv (canonical views) and accumulates into ``dbias4`` (the bias's 4-d shape) and
    ``captures`` (the buffers of a score_mod's captured tensors, :class:`tileattn.core.engine.Gradients`),
    in blocks of rows of at most ``max_elements`` scores (None: each sequence's whole matrix).
    """
    cdt = spec.acc_dtype()
    g = spec.group_size
    dk_c.zero_(), dv_c.zero_()
    for seq in spec.sequences:
        q, k, v = sequence_views(spec, seq)
        v_rep = v.to(cdt).repeat_interleave(g, dim=0)
        k_rep = k.to(cdt).repeat_interleave(g, dim=0)
        dk = torch.zeros(spec.heads_kv, seq.k_len, spec.head_dim, dtype=cdt, device=spec.device)
        dv = torch.zeros(spec.heads_kv, seq.k_len, spec.head_dim_v, dtype=cdt, device=spec.device)
        for block in _blocks(spec, seq, cdt, max_elements):
            qb = q[:, block.i0:block.i1]
            s, before, keep = _scores(spec, block, qb, k, cdt)
            rows = slice(seq.q_start + block.i0, seq.q_start + block.i1)
            if spec.is_varlen:
                lse_s, delta_s = lse[:, rows].to(cdt), delta[:, rows].to(cdt)
                do = dout_c[rows].transpose(0, 1).to(cdt)
            else:
                lse_s, delta_s = lse[seq.batch, :, rows].to(cdt), delta[seq.batch, :, rows].to(cdt)
                do = dout_c[seq.batch, :, rows].to(cdt)
            p = _probabilities(s, lse_s)
            pd = p
            for m in spec.modifiers:
                pd = m.weights(pd, block, spec.heads_q)
            dv += torch.einsum("hij,hid->hjd", pd, do).unflatten(0, (spec.heads_kv, g)).sum(1)
            dp = torch.einsum("hid,hjd->hij", do, v_rep)
            for m in reversed(spec.modifiers):
                dp = m.weights_grad(dp, block, spec.heads_q)
            ds = p * (dp - delta_s[..., None])
            if keep is not None:
                # Hidden pairs get no gradient, even in a row made NaN by a +inf score (as autograd
                # through the forward's masked_fill gives).
                ds = ds.masked_fill(~keep, 0.0)
            for m, s_before in reversed(list(zip(spec.modifiers, before))):
                ds = m.scores_grad(ds, s_before, block, {"bias": dbias4, "captures": captures}.get(m.grad_slot))
            dq = torch.einsum("hij,hjd->hid", ds, k_rep) * spec.scale
            dk += (torch.einsum("hij,hid->hjd", ds, qb.to(cdt)) * spec.scale).unflatten(0, (spec.heads_kv, g)).sum(1)
            if spec.is_varlen:
                dq_c[rows] = dq.transpose(0, 1)
            else:
                dq_c[seq.batch, :, rows] = dq
        if spec.is_varlen:
            keys = slice(seq.k_start, seq.k_start + seq.k_len)
            dk_c[keys] = dk.transpose(0, 1)
            dv_c[keys] = dv.transpose(0, 1)
        else:
            dk_c[seq.batch, :, : seq.k_len] = dk
            dv_c[seq.batch, :, : seq.k_len] = dv

