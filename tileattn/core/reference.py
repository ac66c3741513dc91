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
:func:`row_max` applies the same hooks to give each row's maximum score (torch_npu's ``softmax_max``).
"""

from __future__ import annotations

import math

import torch

from .kvquant import quant_of
from .layouts import from_canonical
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
    return _modified(spec, block, torch.einsum("hid,hjd->hij", q.to(cdtype), k) * spec.scale)


def _modified(spec: AttentionSpec, block: ScoreBlock, s):
    """:func:`_scores` from the scaled scores ``s`` (Hq, rows, cols) of ``block``."""
    dtype, before = s.dtype, []
    for m in spec.modifiers:
        before.append(s)
        s = m.scores(s, block).to(dtype)  # a score_mod may promote (bf16 scores times a float32 table)
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


#: Scores held at once by :func:`row_max` (one block of query rows, every head, every key).
_ROW_MAX_BLOCK = 1 << 22


@torch.no_grad()
def row_max(q, k, v, *, compute_dtype=torch.float32, **kwargs):
    """Row maximum of the masked, scaled scores of a ``flash_attention`` call (same keywords),
    shaped like its LSE: ``-inf`` for a row that sees no key; an extra logit (a sink) counts as a
    score. Computed from the scores in ``compute_dtype`` by the modifiers' own hooks, a block of
    query rows at a time (at most ``2**22`` scores in memory); ``v`` only fixes the call's shape.
    The softmax statistics some APIs return (torch_npu's ``softmax_max``) are this and the LSE."""
    kwargs.pop("backend", None)
    spec = build_spec(q, k, v, **kwargs)
    if spec.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(spec.device.type):
        with torch.autocast(spec.device.type, enabled=False):
            return row_max(q, k, v, compute_dtype=compute_dtype, **kwargs)
    if quant_of(spec) is not None:
        spec = dequantised_spec(spec, compute_dtype)
    maxima = []
    for seq in spec.sequences:
        q_s, k_s, _ = sequence_views(spec, seq)
        k_t = k_s.to(compute_dtype).transpose(1, 2)
        m = torch.full((spec.heads_q, seq.q_len), -math.inf, dtype=compute_dtype, device=spec.device)
        rows = max(1, _ROW_MAX_BLOCK // max(1, spec.heads_q * seq.k_len))
        for i0 in range(0, seq.q_len, rows):
            i1 = min(seq.q_len, i0 + rows)
            j0, j1 = (0, seq.k_len) if spec.band is None else spec.band.key_range(i0, i1, seq.k_len, seq.offset)
            if j0 == j1:
                continue
            block = ScoreBlock(seq.batch, slice(None), i0, i1, j0, j1, seq.offset, compute_dtype, spec.device)
            # query heads grouped by the kv head they share (GQA): one GEMM per kv head, no repeated keys
            q_g = q_s[:, i0:i1].to(compute_dtype).reshape(spec.heads_kv, -1, q_s.shape[-1])
            s = torch.matmul(q_g, k_t[..., j0:j1]).view(spec.heads_q, i1 - i0, j1 - j0).mul_(spec.scale)
            m[:, i0:i1] = _modified(spec, block, s)[0].amax(-1)
        for mod in spec.modifiers:
            logits = mod.extra_logits(m, 0)
            if logits is not None:
                m = torch.maximum(m, logits)
        maxima.append(m)
    if spec.is_varlen:
        return torch.cat(maxima, 1) if maxima else torch.zeros(spec.lse_shape(), dtype=compute_dtype)
    return torch.stack(maxima) if maxima else torch.zeros(spec.lse_shape(), dtype=compute_dtype)


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

