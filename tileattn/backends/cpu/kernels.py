"""FlashAttention-2 on the CPU, one range of kv heads of one sequence at a time.

Forward: for a block of ``block_m`` query rows (of the ``G`` query heads sharing each kv head of the
range ``hs``), stream the visible key blocks of ``block_n`` columns through an online softmax. Only
an ``(nh, G*block_m, block_n)`` tile of scores ever exists; key blocks the band (causal/window)
hides are never visited, and blocks that a bool mask hides entirely are skipped after a cheap check.

The online softmax keeps, per row, a reference maximum ``m`` (base-2 logits), the running sum ``l``
of ``2^(s - m)`` and the unnormalised output ``acc``. At the end ``out = acc / l`` and
``lse = (m + log2 l) * ln 2``. Rows that see no key keep ``m = -inf`` and ``l = 0``; they output 0 and
``lse = -inf`` (the "safe" maximum ``m_safe = 0`` for such rows avoids ``-inf - -inf = NaN``).

Where the time goes: per tile, two GEMMs and the passes over the score tile between them. The
textbook step (row max, subtract, exp2, row sum, rescale) makes four passes; here a tile makes two:

* **Lazy maximum.** ``m`` does not have to be the running maximum: any value at or below the true row
  maximum that keeps ``2^(s - m)`` finite gives exact results, because ``out`` and ``lse`` only
  depend on ratios (fp32 keeps its relative precision up to ``2^127``). So the first tile that gives
  every row a finite maximum fixes ``m`` for good; later tiles skip the max pass and never rescale
  ``acc`` (FlashAttention-4 rescales only when the maximum grows by more than a threshold; in fp32 the
  threshold can be the whole exponent range). If a later score exceeds ``m`` by more than the range,
  ``l`` or ``acc`` overflows, which the end-of-block check sees; the block is then recomputed with
  the textbook step (same result, rare: it needs a logit jump of ~88 nats within one row).
* **Subtraction inside the GEMM.** The query block carries an extra column ``-m`` and K an extra
  column of ones (``SequenceProblem.kt_aug``), so ``q.k^T - m`` comes out of the GEMM itself (plain
  scores only; with a softcap, ALiBi or bias the modifiers must see the raw score first).
* **Band edges after exp2.** Once ``m`` is fixed, the causal/window edge of a tile is cut by zeroing
  the probabilities with ``tril_``/``triu_`` (10x faster than a masked fill of the scores). Before
  that, the maximum must not see hidden scores, so the first tile is masked the slow way.

Backward (FlashAttention-2): the probabilities are recomputed from the saved LSE, never stored.
With ``Delta_i = sum_d dO_id * O_id`` (given by the caller, minus the LSE gradient)::

    P = 2^(s - lse2)        dV += P^T dO        dP = dO V^T
    dS = P * (dP - Delta)   dQ += dS K * scale  dK += dS^T Q * scale

The same augmentation folds ``- lse2`` into the first GEMM and ``- Delta`` into ``dO V^T`` (``dO``
carries a ``-Delta`` column, V a ones column), leaving two passes per tile (exp2, the product).
Query blocks form the outer loop: dQ of a block is complete when its inner loop ends, and dK/dV of
the head accumulate into fp32 buffers in a fixed order, so gradients are bitwise reproducible without
atomics (``deterministic`` costs nothing here).
"""

from __future__ import annotations

import math

import torch

from .tiles import LOG2E, SequenceProblem, scratch, scratch_tile


def key_blocks(prob: SequenceProblem, i0: int, i1: int, block_n: int):
    """Key blocks [j0, j1) that some row of [i0, i1) sees, on the grid of ``block_n`` (so a mask's
    per-tile states, computed once per call on that grid, apply)."""
    lo, hi = prob.key_range(i0, i1)
    for j0 in range(lo - lo % block_n, hi, block_n):
        yield j0, min(j0 + block_n, hi)


def forward_block(prob: SequenceProblem, hs: slice, i0: int, i1: int, out: torch.Tensor, lse: torch.Tensor,
                  block_n: int) -> None:
    """Rows [i0, i1) of the query heads of kv heads ``hs``: write ``out`` (nh*G, bm, Dv) and
    ``lse`` (nh*G, bm), both strided views."""
    state = _online_softmax(prob, hs, i0, i1, block_n, lazy=True)
    if state is None:
        state = _online_softmax(prob, hs, i0, i1, block_n, lazy=False)
    acc, l, m, fixed = state
    heads, bm = out.shape[0], out.shape[1]
    keep_rate = 1.0 - prob.dropout_p
    if fixed:
        # Every row has a finite maximum, attained by a visible score that added 2^0 to l: l >= 1.
        scaled_l = l * keep_rate if keep_rate != 1.0 else l
        torch.div(acc.view(out.shape), scaled_l.view(heads, bm, 1), out=out)
        torch.add(torch.log(l).view(heads, bm), m.view(heads, bm), alpha=1.0 / LOG2E, out=lse)
        return
    m_safe = m.masked_fill(m == -math.inf, 0.0)
    inv_l = torch.where(l > 0, 1.0 / l, torch.zeros((), dtype=prob.compute_dtype))
    if keep_rate != 1.0:
        inv_l.mul_(1.0 / keep_rate)
    out.copy_(acc.mul_(inv_l).view(out.shape))
    lse.copy_((m_safe + torch.log2(l)).mul_(1.0 / LOG2E).view(lse.shape))


def _online_softmax(prob: SequenceProblem, hs: slice, i0: int, i1: int, block_n: int, lazy: bool):
    """(acc, l, m, fixed) of the block, or None when the lazy maximum overflowed (the caller then
    recomputes with ``lazy=False``). ``fixed``: the lazy maximum was used (every ``m`` is finite)."""
    d, cdt = prob.head_dim, prob.compute_dtype
    qa = prob.load_q(hs, i0, i1)  # last column: 0, then -m once the maximum is fixed
    qa[..., d].zero_()
    qb = qa[..., :d]
    nh, rows = qa.shape[0], qa.shape[1]
    m = l = acc = None  # no key seen yet
    fixed = False  # True once every row has a finite reference maximum, kept from then on
    fold = prob.plain and prob.kt_aug is not None
    buffer = scratch(nh * rows * block_n, cdt)
    kt_aug = prob.kt_aug[hs] if fold else None
    v = prob.v[hs]
    for j0, j1 in key_blocks(prob, i0, i1, block_n):
        hidden = prob.mask_hidden(hs, i0, i1, j0, j1)
        if prob.tile_is_empty(hidden):
            continue
        edge = prob.on_band_edge(i0, i1, j0, j1)
        tile = scratch_tile(buffer, nh, rows, j1 - j0)
        if fold:
            # The same aligned GEMM before and after the maximum is fixed (the column is 0 before).
            s = torch.bmm(qa, kt_aug[:, :, j0:j1], out=tile)
            prob.apply_mask(s, hidden, i0, i1)
        else:
            s = prob.scores(hs, qb, i0, i1, j0, j1, hidden, tile)[0]
            if fixed:
                s.sub_(m)
        if fixed:
            p = s.exp2_()
            if edge:
                prob.zero_outside_band(p, i0, i1, j0, j1)
        else:
            if edge:
                prob.hide_outside_band(s, i0, i1, j0, j1)
            tile_max = s.amax(-1, keepdim=True)
            if m is None and lazy and bool(torch.isfinite(tile_max).all()):
                # First tile and every row saw a key: its maximum becomes the reference for good.
                m, fixed = tile_max, True
                s.sub_(m)
                torch.neg(m, out=qa[..., d:])
            else:
                m = tile_max if m is None else m
                m = _rescale(s, m, tile_max, l, acc)
                if lazy and bool(torch.isfinite(m).all()):
                    fixed = True
                    torch.neg(m, out=qa[..., d:])
            p = s.exp2_()
        l = p.sum(-1, keepdim=True) if l is None else l.add_(p.sum(-1, keepdim=True))
        if prob.dropout_p > 0:
            p.masked_fill_(~prob.dropout_keep(hs, i0, i1, j0, j1), 0.0)
        if acc is None:
            acc = scratch(nh * rows * v.shape[-1], cdt, "acc").view(nh, rows, v.shape[-1])
            torch.bmm(p, v[:, j0:j1], out=acc)
        else:
            acc.baddbmm_(p, v[:, j0:j1])
    if m is None:
        m = torch.full((nh, rows, 1), -math.inf, dtype=cdt)
        l = torch.zeros((nh, rows, 1), dtype=cdt)
        acc = torch.zeros((nh, rows, prob.v.shape[-1]), dtype=cdt)
    # One reduction sees any inf/NaN in l or acc. A finite sum that overflows only costs a recompute.
    if fixed and not math.isfinite(float(acc.sum()) + float(l.sum())):
        return None
    return acc, l, m, fixed


def _rescale(s, m, tile_max, l, acc):
    """Textbook online-softmax step: raise the running maximum to cover the tile, rescale ``l`` and
    ``acc`` (None before the first tile) by ``2^(m_old - m_new)`` and subtract the new maximum from
    ``s``. Returns the new maximum."""
    m_new = torch.maximum(m, tile_max)
    m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
    if l is not None:
        alpha = torch.exp2(m - m_safe)
        l.mul_(alpha)
        acc.mul_(alpha)
    s.sub_(m_safe)
    return m_new


def backward_heads(prob: SequenceProblem, hs: slice, dout, lse, delta, dq, dk, dv, dbias, block_m: int,
                   block_n: int) -> None:
    """Gradients for kv heads ``hs`` of one sequence and their query heads.

    ``dout`` (Hq, Sq, Dv), ``lse`` and ``delta`` (Hq, Sq; ``delta = rowsum(dO * O) - dLSE``),
    ``dq`` (Hq, Sq, D): the sequence's views.
    ``dk`` (nh, Sk, D) and ``dv`` (nh, Sk, Dv): the zero-initialised compute-dtype buffers of
    heads ``hs``. ``dbias``, when not None, is a compute-dtype buffer of the (per batch item)
    broadcast bias shape.
    """
    g, d, dvd, cdt = prob.group, prob.head_dim, prob.v.shape[-1], prob.compute_dtype
    nh = hs.stop - hs.start
    heads = prob.q_heads(hs)
    dropout = prob.dropout_p > 0
    keep_scale = 1.0 / (1.0 - prob.dropout_p) if dropout else None
    fold_lse = prob.plain and prob.kt_aug is not None
    fold_delta = prob.vt_aug is not None and not dropout
    buffers = scratch(2 * nh * g * block_m * block_n, cdt).view(2, -1)
    k, v = prob.k[hs], prob.v[hs]
    kt_aug = prob.kt_aug[hs] if fold_lse else None
    vt_aug = prob.vt_aug[hs] if fold_delta else None
    for i0 in range(0, prob.sq, block_m):
        i1 = min(i0 + block_m, prob.sq)
        bm = i1 - i0
        blocks = [(j0, j1, prob.mask_hidden(hs, i0, i1, j0, j1))
                  for j0, j1 in key_blocks(prob, i0, i1, block_n)]
        blocks = [b for b in blocks if not prob.tile_is_empty(b[2])]
        if not blocks:
            dq[heads, i0:i1].zero_()
            continue
        qa = prob.load_q(hs, i0, i1)
        qb = qa[..., :d]
        doa = prob.load_rows(dout, hs, i0, i1, 1, "do")
        dob = doa[..., :dvd]
        row_delta = delta[heads, i0:i1].reshape(nh, g * bm, 1).to(cdt)
        lse2 = lse[heads, i0:i1].reshape(nh, g * bm, 1).to(cdt) * LOG2E  # a copy: never write lse
        # Rows that saw no key: a huge finite lse2 makes every probability exactly 0 (not NaN, which
        # an infinite one could give inside the GEMM).
        lse2.masked_fill_(lse2 == -math.inf, torch.finfo(lse2.dtype).max)
        torch.neg(lse2, out=qa[..., d:])
        torch.neg(row_delta, out=doa[..., dvd:])
        dq_acc = None
        for j0, j1, hidden in blocks:
            tile_s = scratch_tile(buffers[0], nh, g * bm, j1 - j0)
            tile_dp = scratch_tile(buffers[1], nh, g * bm, j1 - j0)
            if fold_lse:
                s, tanh = torch.bmm(qa, kt_aug[:, :, j0:j1], out=tile_s), None
                prob.apply_mask(s, hidden, i0, i1)
            else:
                s, tanh = prob.scores(hs, qb, i0, i1, j0, j1, hidden, tile_s)
                s.sub_(lse2)
            p = s.exp2_()
            if prob.on_band_edge(i0, i1, j0, j1):
                prob.zero_outside_band(p, i0, i1, j0, j1)
            if fold_delta:
                dp_minus_delta = torch.bmm(doa, vt_aug[:, :, j0:j1], out=tile_dp)
                dv[:, j0:j1].baddbmm_(p.transpose(1, 2), dob)
            else:
                dp = torch.bmm(dob, v[:, j0:j1].transpose(1, 2), out=tile_dp)
                if dropout:
                    drop = ~prob.dropout_keep(hs, i0, i1, j0, j1)
                    dp.masked_fill_(drop, 0.0).mul_(keep_scale)
                    dv[:, j0:j1].baddbmm_(p.masked_fill(drop, 0.0).mul_(keep_scale).transpose(1, 2), dob)
                else:
                    dv[:, j0:j1].baddbmm_(p.transpose(1, 2), dob)
                dp_minus_delta = dp.sub_(row_delta)
            ds = p.mul_(dp_minus_delta)
            if dbias is not None:
                _accumulate_bias_grad(dbias, ds, prob, hs, i0, i1, j0, j1)
            if tanh is not None:
                ds.mul_(1.0 - tanh * tanh)
            if dq_acc is None:
                dq_acc = torch.bmm(ds, k[:, j0:j1], out=scratch(nh * g * bm * d, cdt, "dq").view(nh, g * bm, d))
            else:
                dq_acc.baddbmm_(ds, k[:, j0:j1])
            dk[:, j0:j1].baddbmm_(ds.transpose(1, 2), qb)
        torch.mul(dq_acc.view(nh * g, bm, d), prob.scale, out=dq[heads, i0:i1])
    # dK was accumulated against the pre-scaled q block; with scale = 0 that block is all zeros and
    # so is dK (the true gradient, scale * dS^T q, is zero too).
    dk.mul_(prob.scale / prob.q_factor if prob.q_factor != 0 else 0.0)


def _accumulate_bias_grad(dbias, ds, prob, hs, i0, i1, j0, j1):
    """Add the tile's dS, reduced over the dims the bias broadcasts, into ``dbias`` (H?, Sq?, Sk?)."""
    t = ds.view(-1, i1 - i0, j1 - j0)
    if dbias.shape[0] == 1:
        t = t.sum(0, keepdim=True)
        heads = slice(None)
    else:
        heads = prob.q_heads(hs)
    rows = slice(i0, i1)
    cols = slice(j0, j1)
    if dbias.shape[1] == 1:
        t = t.sum(1, keepdim=True)
        rows = slice(None)
    if dbias.shape[2] == 1:
        t = t.sum(2, keepdim=True)
        cols = slice(None)
    dbias[heads, rows, cols].add_(t)
