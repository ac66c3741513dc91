"""FlashAttention-2 on the CPU, one sequence at a time.

Forward: for each block of ``block_m`` query rows, stream the visible key blocks of ``block_n``
columns through an online softmax. Only a ``(Hkv, G*block_m, block_n)`` tile of scores ever exists;
key blocks the band (causal/window) hides are never visited, and blocks that a bool mask hides
entirely are skipped after a cheap check.

The online softmax keeps, per row, the running maximum ``m`` (base-2 logits), the running sum ``l`` of
``2^(s - m)`` and the unnormalised output ``acc``. When a new tile raises the maximum, the old sums
and accumulator are rescaled by ``alpha = 2^(m_old - m_new)``. At the end ``out = acc / l`` and
``lse = (m + log2 l) * ln 2``. Rows that see no key keep ``m = -inf`` and ``l = 0``; they output 0
and ``lse = -inf`` (the "safe" maximum ``m_safe = 0`` for such rows avoids ``-inf - -inf = NaN``).

Backward (FlashAttention-2): the probabilities are recomputed from the saved LSE, never stored.
With ``Delta_i = sum_d dO_id * O_id``::

    P = 2^(s - lse2)        dV += P^T dO        dP = dO V^T
    dS = P * (dP - Delta)   dQ += dS K * scale  dK += dS^T Q * scale

Query blocks form the outer loop: dQ of a block is complete when its inner loop ends, and dK/dV
accumulate into full-size fp32 buffers in a fixed order, so gradients are bitwise reproducible
without atomics (``deterministic`` costs nothing here).
"""

from __future__ import annotations

import math

import torch

from .tiles import LOG2E, SequenceProblem


def _key_blocks(prob: SequenceProblem, i0: int, i1: int, block_n: int):
    from ...scores import key_range

    lo, hi = key_range(i0, i1, prob.sq, prob.sk, prob.left, prob.right)
    for j0 in range(lo, hi, block_n):
        yield j0, min(j0 + block_n, hi)


def forward(prob: SequenceProblem, out: torch.Tensor, lse: torch.Tensor, block_m: int, block_n: int):
    """Write ``out`` (Hq, Sq, Dv) and ``lse`` (Hq, Sq), both strided views, for one sequence."""
    hq, hkv, g = prob.heads_q, prob.heads_kv, prob.group
    dv = prob.v.shape[-1]
    cdt = prob.compute_dtype
    dropout = prob.dropout_p > 0
    for i0 in range(0, prob.sq, block_m):
        i1 = min(i0 + block_m, prob.sq)
        rows = g * (i1 - i0)
        m = torch.full((hkv, rows, 1), -math.inf, dtype=cdt)
        l = torch.zeros((hkv, rows, 1), dtype=cdt)
        acc = torch.zeros((hkv, rows, dv), dtype=cdt)
        qb = None
        for j0, j1 in _key_blocks(prob, i0, i1, block_n):
            keep = prob.tile_mask(i0, i1, j0, j1)
            if prob.tile_is_empty(keep):
                continue
            if qb is None:
                qb = prob.load_q(i0, i1)
            s, _ = prob.scores(qb, j0, j1, i0, i1, keep)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
            alpha = torch.exp2(m - m_safe)
            p = s.sub_(m_safe).exp2_()
            l.mul_(alpha).add_(p.sum(-1, keepdim=True))
            if dropout:
                p.masked_fill_(~prob.dropout_keep(i0, i1, j0, j1), 0.0)
            acc.mul_(alpha).baddbmm_(p, prob.v[:, j0:j1])
            m = m_new
        m_safe = m.masked_fill(m == -math.inf, 0.0)
        inv_l = torch.where(l > 0, 1.0 / l, torch.zeros((), dtype=cdt))
        if dropout:
            inv_l.mul_(1.0 / (1.0 - prob.dropout_p))
        acc.mul_(inv_l)
        out[:, i0:i1].copy_(acc.view(hkv, g, i1 - i0, dv).flatten(0, 1))
        lse_b = (m_safe + torch.log2(l)).mul_(1.0 / LOG2E)
        lse[:, i0:i1].copy_(lse_b.view(hkv, g, i1 - i0).flatten(0, 1))


def backward(
    prob: SequenceProblem,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    dbias,
    block_m: int,
    block_n: int,
):
    """Gradients of one sequence. ``dq`` (Hq, Sq, D), ``dk`` (Hkv, Sk, D), ``dv`` (Hkv, Sk, Dv) are
    views to write; ``dk``/``dv`` must be zero-initialised compute-dtype buffers. ``dbias``, when not
    None, is a compute-dtype buffer of the (per batch item) broadcast bias shape to accumulate into.
    """
    hkv, g = prob.heads_kv, prob.group
    d = prob.q.shape[-1]
    cdt = prob.compute_dtype
    keep_scale = 1.0 / (1.0 - prob.dropout_p) if prob.dropout_p > 0 else None
    for i0 in range(0, prob.sq, block_m):
        i1 = min(i0 + block_m, prob.sq)
        bm = i1 - i0
        dq_acc = torch.zeros((hkv, g * bm, d), dtype=cdt)
        qb = None
        for j0, j1 in _key_blocks(prob, i0, i1, block_n):
            keep = prob.tile_mask(i0, i1, j0, j1)
            if prob.tile_is_empty(keep):
                continue
            if qb is None:
                qb = prob.load_q(i0, i1)
                dob = prob.load_rows(dout, i0, i1)
                delta = (dob * prob.load_rows(out, i0, i1)).sum(-1, keepdim=True)
                lse2 = prob.load_rows(lse[..., None], i0, i1).mul_(LOG2E)
                # Rows that saw no key: make every probability exactly 0 instead of NaN.
                lse2.masked_fill_(lse2 == -math.inf, math.inf)
            s, tanh = prob.scores(qb, j0, j1, i0, i1, keep)
            p = s.sub_(lse2).exp2_()
            vj = prob.v[:, j0:j1]
            dp = torch.bmm(dob, vj.transpose(1, 2))
            if keep_scale is not None:
                drop = prob.dropout_keep(i0, i1, j0, j1)
                p_used = p.masked_fill(~drop, 0.0).mul_(keep_scale)
                dp.masked_fill_(~drop, 0.0).mul_(keep_scale)
            else:
                p_used = p
            dv[:, j0:j1].baddbmm_(p_used.transpose(1, 2), dob)
            ds = p.mul_(dp.sub_(delta))
            if dbias is not None:
                _accumulate_bias_grad(dbias, ds, hkv, g, i0, i1, j0, j1)
            if tanh is not None:
                ds.mul_(1.0 - tanh * tanh)
            kj = prob.k[:, j0:j1]
            dq_acc.baddbmm_(ds, kj)
            dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), qb)
        dq_acc.mul_(prob.scale)
        dq[:, i0:i1].copy_(dq_acc.view(hkv, g, bm, d).flatten(0, 1))
    # dK was accumulated against the pre-scaled q block; with scale = 0 that block is all zeros and
    # so is dK (the true gradient, scale * dS^T q, is zero too).
    dk.mul_(prob.scale / prob.q_factor if prob.q_factor != 0 else 0.0)


def _accumulate_bias_grad(dbias, ds, hkv, g, i0, i1, j0, j1):
    """Add the tile's dS, reduced over the dims the bias broadcasts, into ``dbias`` (H?, Sq?, Sk?)."""
    t = ds.view(hkv * g, i1 - i0, j1 - j0)
    if dbias.shape[0] == 1:
        t = t.sum(0, keepdim=True)
    rows = slice(i0, i1)
    cols = slice(j0, j1)
    if dbias.shape[1] == 1:
        t = t.sum(1, keepdim=True)
        rows = slice(None)
    if dbias.shape[2] == 1:
        t = t.sum(2, keepdim=True)
        cols = slice(None)
    dbias[:, rows, cols].add_(t)
