"""FlashAttention-2 on the CPU, one range of kv heads of one sequence at a time.

Forward: for a block of ``block_m`` query rows (of the ``G`` query heads sharing each kv head of the
range ``hs``), stream the visible key blocks of ``block_n`` columns through an online softmax. Only
an ``(nh, G*block_m, block_n)`` tile of scores ever exists; key blocks the band (causal/window)
hides are never visited, and blocks that a bool mask hides entirely are skipped after a cheap check.

The online softmax keeps, per row, a reference ``m`` (base-2 logits), the running sum ``l`` of
``2^(s - m)`` and the unnormalised output ``acc``. At the end ``out = acc / l`` and
``lse = (m + log2 l) * ln 2``. Rows that see no key keep ``m = -inf`` and ``l = 0``; they output 0 and
``lse = -inf`` (they are shifted by 0 instead of ``m``, which avoids ``-inf - -inf = NaN``).

Where the time goes: per tile, two GEMMs and the passes over the score tile between them. The
textbook step (row max, subtract, exp2, row sum, rescale) makes four passes; here a tile makes two:

* **A reference that rarely moves.** ``m`` need not be the running maximum: ``out`` and ``lse`` only
  depend on ratios. But the arguments ``s - m`` of the terms that dominate a row must stay small:
  rounding ``s - m`` costs ``ulp(s - m)``, so a reference ``d`` units below the maximum multiplies
  the error of the dominant terms (and of the LSE and gradients) by about ``d``. The first tile of a
  block takes its row maximum (the careful step), then the reference moves up to ``log2`` of the
  sum so far, so that a tile of rows with many comparable keys sums to about 1. Later tiles skip the
  max pass: each tile's row sums, computed anyway, bound its largest term, and a tile whose sum
  exceeds ``2^GROWTH`` (a few units, as FlashAttention-4 rescales only when the maximum grows by
  more than a threshold) is recomputed with the careful step, which moves the reference of the rows
  that grew and rescales their ``l`` and ``acc``. Blocks keep the careful step while it keeps
  moving references (steep ALiBi), and until every row has seen a key.
* **Subtraction inside the GEMM.** The query block carries an extra column ``-m`` and K an extra
  column of ones (``SequenceProblem.kt_aug``), so ``q.k^T - m`` comes out of the GEMM itself (plain
  scores only; with a softcap, ALiBi or bias the modifiers must see the raw score first).
* **Band edges after exp2.** Outside the careful step the causal/window edge of a tile is cut by
  zeroing the probabilities with ``tril_``/``triu_`` (10x faster than a masked fill of the scores);
  the careful step's maximum must not see hidden scores, so it masks the slow way.

Backward (FlashAttention-2): the probabilities are recomputed from the saved LSE, never stored.
With ``Delta_i = sum_d dO_id * O_id`` (given by the caller, minus the LSE gradient)::

    P = 2^(s - lse2)        dV += P^T dO        dP = dO V^T
    dS = P * (dP - Delta)   dQ += dS K * scale  dK += dS^T Q * scale

The same augmentation folds ``- lse2`` into the first GEMM and ``- Delta`` into ``dO V^T`` (``dO``
carries a ``-Delta`` column, V a ones column), leaving two passes per tile (exp2, the product).

**Large logits.** Both fast paths rest on the scores rounding far below one unit. Plain scores are
taken from q pre-scaled by ``scale * log2(e)``, which rounds every ``q_d``: an error of the size of
the GEMM's own, and the backward's ``P`` is only ``<= 1`` because ``lse2`` was taken over scores
that rounded the same way. When a bound on that rounding (``(D + 2) u |q| |k|``, plus ``|lse2|`` in
the backward) exceeds :data:`EXACT_LIMIT`, a query block computes its scores as plain math does
(``q * scale`` through the GEMM, then ``* log2(e)``), without the folds, and the backward first takes
the block's own LSE and ``Delta`` from exactly the scores and ``dP`` it then uses (one more pass
over its keys). So ``P <= 1`` and gradients stay finite however large the logits, and a one-hot row
gets ``dP - Delta = 0`` exactly at its key (``rowsum(dO * O)`` rounds differently from the GEMM
that gives ``dP``), as plain math does.

Query blocks form the outer loop: dQ of a block is complete when its inner loop ends, and dK/dV of
the head accumulate into fp32 buffers in a fixed order, so gradients are bitwise reproducible without
atomics (``deterministic`` costs nothing here).

A score of +inf (a bias entry) gives its row LSE +inf and NaN output and gradients, like the exact
reference (softmax of +inf is ``inf - inf``); other rows are unaffected.
"""

from __future__ import annotations

import math

import torch

from .tiles import LOG2E, SequenceProblem, scratch, scratch_tile

#: A key tile whose probabilities, against the current reference, sum to more than ``2^GROWTH`` is
#: redone with the careful step (its row maximum). Also the most a row's maximum may exceed its
#: reference in a tile taken without that step.
GROWTH = 4.0

#: Above this bound (base-2 units) on the rounding of a score, a query block computes its scores
#: the way plain math rounds them, and the backward takes its LSE and ``Delta`` from its own scores
#: (see the module docstring). Below it the fast paths keep the 2x rule (measured on random inputs:
#: they stay within it up to a bound of ~5e-3 and fail it from ~7e-3).
EXACT_LIMIT = 2.0 ** -8


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
    rows = _online_softmax(prob, hs, i0, i1, block_n)
    heads, bm = out.shape[0], out.shape[1]
    l = rows.l.masked_fill(rows.l == 0, 1.0)  # rows that saw no key: acc is 0 there, and so is out
    if prob.dropout_p > 0:
        l = l * (1.0 - prob.dropout_p)
    torch.div(rows.acc.view(out.shape), l.view(heads, bm, 1), out=out)
    value = torch.log(rows.l).add_(rows.m, alpha=1.0 / LOG2E)  # -inf where no key was seen
    # A +inf score makes l NaN (inf - inf): its LSE is +inf, as the reference's logsumexp says.
    value = torch.where(rows.m == math.inf, rows.m, value)
    lse.copy_(value.view(heads, bm))


class _Rows:
    """The online-softmax state of a block's rows: reference ``m`` (-inf until a row sees a key),
    sum ``l``, unnormalised output ``acc`` (all three None before the first tile), and ``neg_ref``,
    the query block's extra column: ``-m``, or 0 for rows that saw no key yet.

    References are whole numbers and move by whole numbers, so moving one is exact and rescaling
    by a power of two is too: what a row accumulated and what later tiles add stay relative to
    exactly the same reference.
    """

    def __init__(self, neg_ref):
        self.m = self.l = self.acc = None  # set by the first tile
        self.neg_ref = neg_ref
        neg_ref.zero_()

    def shift(self, s: torch.Tensor) -> torch.Tensor:
        """``s - m`` in place, for scores that did not come out of the GEMM already shifted."""
        return s.add_(self.neg_ref)

    def start(self, m: torch.Tensor):
        """First references, before anything was accumulated (-inf for rows without a key)."""
        self._set(m)

    def move(self, rows: torch.Tensor, to: torch.Tensor):
        """Raise the reference of ``rows`` to the whole numbers ``to`` and rescale what they
        accumulated (rows that saw no key have nothing to rescale)."""
        m_new = torch.where(rows, to, self.m)
        alpha = torch.where(rows, torch.exp2(self.m - m_new), 1.0)  # 0 for rows without a key yet
        self.l.mul_(alpha)
        if self.acc is not None:
            self.acc.mul_(alpha)
        self._set(m_new)

    def renormalise(self):
        """Move each reference up by ``floor(log2 l)``, so that it follows the row's LSE (within one
        unit) rather than its maximum: a tile of rows with many comparable keys then sums to about
        1, not to the number of keys, and does not look like growth."""
        k = torch.log2(self.l).floor_().clamp_(min=0.0).nan_to_num_(0.0)  # 0 for l < 2 and NaN rows
        scale = torch.exp2(k.neg())
        self.l.mul_(scale)
        self.acc.mul_(scale)
        self._set(self.m + k)

    def _set(self, m):
        self.m = m
        torch.nan_to_num(m, nan=0.0, posinf=math.inf, neginf=0.0, out=self.neg_ref).neg_()


def _online_softmax(prob: SequenceProblem, hs: slice, i0: int, i1: int, block_n: int) -> _Rows:
    d, cdt = prob.head_dim, prob.compute_dtype
    qa = prob.load_q(hs, i0, i1)  # last column: -m, see _Rows
    qb = qa[..., :d]
    nh, nrows = qa.shape[0], qa.shape[1]
    rows = _Rows(qa[..., d:])
    exact = _rounding_bound(prob, hs) > EXACT_LIMIT
    fold = prob.plain and prob.kt_aug is not None and not exact
    buffer = scratch(nh * nrows * block_n, cdt)
    kt_aug = prob.kt_aug[hs] if fold else None
    v = prob.v[hs]
    careful = True  # until every row has seen a key, and while rows keep growing
    scores = _raw_scores(prob, hs, qb, i0, i1, exact)

    def raw_scores(tile, j0, j1, hidden):
        if fold:
            s = torch.bmm(qb, kt_aug[:, :d, j0:j1], out=tile)
            prob.apply_mask(s, hidden, i0, i1)
            return s
        return scores(j0, j1, hidden, tile)[0]

    def shifted_scores(tile, j0, j1, hidden):
        if fold:
            s = torch.bmm(qa, kt_aug[:, :, j0:j1], out=tile)
            prob.apply_mask(s, hidden, i0, i1)
            return s
        return rows.shift(raw_scores(tile, j0, j1, hidden))

    tiles = list(key_blocks(prob, i0, i1, block_n))
    for n, (j0, j1) in enumerate(tiles):
        hidden = prob.mask_hidden(hs, i0, i1, j0, j1)
        if prob.tile_is_empty(hidden):
            continue
        edge = prob.on_band_edge(i0, i1, j0, j1)
        tile = scratch_tile(buffer, nh, nrows, j1 - j0)
        if not careful:
            p = shifted_scores(tile, j0, j1, hidden).exp2_()
            if edge:
                prob.zero_outside_band(p, i0, i1, j0, j1)
            tile_sum = p.sum(-1, keepdim=True)
            # A row grew (or overflowed): redo the tile carefully. One reduction answers for every
            # row unless some row is NaN (which a NaN input or a +inf score makes), then ask row-wise.
            peak = float(tile_sum.amax())
            careful = not peak <= 2.0 ** GROWTH and bool((tile_sum > 2.0 ** GROWTH).any())
        if careful:
            s = raw_scores(tile, j0, j1, hidden)
            p, tile_sum, grew = _careful_step(prob, rows, s, edge, i0, i1, j0, j1)
        rows.l = tile_sum if rows.l is None else rows.l.add_(tile_sum)
        if prob.dropout_p > 0:
            p.masked_fill_(~prob.dropout_keep(hs, i0, i1, j0, j1), 0.0)
        if rows.acc is None:
            rows.acc = scratch(nh * nrows * v.shape[-1], cdt, "acc").view(nh, nrows, v.shape[-1])
            torch.bmm(p, v[:, j0:j1], out=rows.acc)
        else:
            rows.acc.baddbmm_(p, v[:, j0:j1])
        if careful and n + 1 < len(tiles):  # (after the last tile, references no longer matter)
            rows.renormalise()
            careful = grew or bool((rows.m == -math.inf).any())
    if rows.acc is None:  # no key tile: every row is empty
        rows.m = torch.full((nh, nrows, 1), -math.inf, dtype=cdt)
        rows.l = torch.zeros((nh, nrows, 1), dtype=cdt)
        rows.acc = torch.zeros((nh, nrows, prob.v.shape[-1]), dtype=cdt)
    return rows


def _careful_step(prob, rows: _Rows, s, edge, i0, i1, j0, j1):
    """The textbook step on raw scores ``s``, thresholded: rows whose tile maximum exceeds their
    reference by more than ``GROWTH``, and rows that see their first key, move their reference to
    the maximum (rounded up to a whole number). Raw scores, not ones shifted by the old reference:
    a shift far from the maximum would round the dominant scores at its magnitude. Returns the
    probabilities (in place of ``s``), their row sums, and whether a row that had seen keys grew."""
    if edge:
        prob.hide_outside_band(s, i0, i1, j0, j1)
    tile_max = s.amax(-1, keepdim=True)
    if rows.acc is None:  # the block's first tile: no row has a reference yet
        rows.start(tile_max.ceil_())
        p = rows.shift(s).exp2_()
        return p, p.sum(-1, keepdim=True), False
    seen = rows.m > -math.inf
    grew = (tile_max > rows.m + GROWTH) & seen
    first = (tile_max > -math.inf) & ~seen
    any_grew, any_first = torch.stack((grew.any(), first.any())).tolist()
    if any_grew or any_first:
        rows.move(grew | first, tile_max.ceil())
    p = rows.shift(s).exp2_()
    return p, p.sum(-1, keepdim=True), any_grew


def backward_heads(prob: SequenceProblem, hs: slice, dout, lse, delta, dlse, dq, dk, dv, dbias, block_m: int,
                   block_n: int) -> None:
    """Gradients for kv heads ``hs`` of one sequence and their query heads.

    ``dout`` (Hq, Sq, Dv), ``lse`` and ``delta`` (Hq, Sq; ``delta = rowsum(dO * O) - dLSE``), ``dlse``
    (Hq, Sq, or None: no LSE gradient; a block that recomputes its own statistics needs it),
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
    fold_delta = prob.vt_aug is not None and not dropout
    buffers = scratch(2 * nh * g * block_m * block_n, cdt).view(2, -1)
    k, v = prob.k[hs], prob.v[hs]
    kt_aug = prob.kt_aug[hs] if prob.plain and prob.kt_aug is not None else None
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
        own = _rounding_bound(prob, hs, lse2) > EXACT_LIMIT
        scores = _raw_scores(prob, hs, qb, i0, i1, exact=own)
        if own:
            own_lse2, own_delta = _own_statistics(prob, hs, scores, dob, v, i0, i1, blocks, buffers, keep_scale)
            finite = torch.isfinite(lse2)  # rows without keys, or with a +inf score, stay as they are
            lse2 = torch.where(finite, own_lse2, lse2)
            if dlse is not None:
                own_delta = own_delta - dlse[heads, i0:i1].reshape(nh, g * bm, 1).to(cdt)
            row_delta = torch.where(finite, own_delta, row_delta)
        fold_lse = kt_aug is not None and not own
        fold_dp = fold_delta and not own
        # Rows that saw no key: a huge finite lse2 makes every probability exactly 0 (not NaN, which
        # an infinite one could give inside the GEMM).
        lse2.masked_fill_(lse2 == -math.inf, torch.finfo(lse2.dtype).max)
        torch.neg(lse2, out=qa[..., d:])
        torch.neg(row_delta, out=doa[..., dvd:])
        finite_rows = bool(torch.isfinite(row_delta).all())  # not with a +inf score (or a NaN input)
        dq_acc = None
        for j0, j1, hidden in blocks:
            tile_s = scratch_tile(buffers[0], nh, g * bm, j1 - j0)
            tile_dp = scratch_tile(buffers[1], nh, g * bm, j1 - j0)
            if fold_lse:
                s, tanh = torch.bmm(qa, kt_aug[:, :, j0:j1], out=tile_s), None
                prob.apply_mask(s, hidden, i0, i1)
            else:
                s, tanh = scores(j0, j1, hidden, tile_s)
                s.sub_(lse2)
            p = s.exp2_()
            if prob.on_band_edge(i0, i1, j0, j1):
                prob.zero_outside_band(p, i0, i1, j0, j1)
            if fold_dp:
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
            if not finite_rows:  # 0 * NaN: keep a NaN row out of the keys it does not see, as the reference
                if prob.on_band_edge(i0, i1, j0, j1):
                    prob.zero_outside_band(ds, i0, i1, j0, j1)
                if hidden.hidden is not None:
                    ds.view(nh, g, bm, -1).masked_fill_(hidden.hidden, 0.0)
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


def _raw_scores(prob: SequenceProblem, hs, qb, i0, i1, exact: bool):
    """``scores(j0, j1, hidden, tile) -> (base-2 scores, tanh of the softcap or None)`` for the query
    block ``qb`` (pre-scaled by ``prob.q_factor``). With ``exact``, plain scores are instead taken
    from q scaled by ``prob.scale`` alone and times log2(e) after the GEMM, as plain math rounds them
    (the pre-scaled block rounds each ``q_d`` by scale*log2(e), an error of the GEMM's own size)."""
    if not (exact and prob.plain):
        return lambda j0, j1, hidden, tile: prob.scores(hs, qb, i0, i1, j0, j1, hidden, tile)
    q_own = prob.load_rows(prob.q, hs, i0, i1, 0, "q_exact").mul_(prob.scale)
    k = prob.k[hs]

    def scores(j0, j1, hidden, tile):
        s = torch.bmm(q_own, k[:, j0:j1].transpose(1, 2), out=tile).mul_(LOG2E)
        prob.apply_mask(s, hidden, i0, i1)
        return s, None

    return scores


def _rounding_bound(prob: SequenceProblem, hs: slice, lse2=None) -> float:
    """A bound (base-2 units) on the rounding of the scores ``q.k`` of kv heads ``hs``, and of
    ``q.k - lse2`` when ``lse2`` is given: a dot product of ``D`` terms (plus the ``-lse2`` term)
    rounds by at most ``(D + 2) u`` times the sum of their magnitudes, and
    ``|q_i . k_j| <= |q_i| |k_j|``. The norms are taken once per sequence and head range."""
    cache = prob.__dict__.setdefault("_norm_products", {})
    key = (hs.start, hs.stop)
    if key not in cache:
        q, k, cdt = prob.q[prob.q_heads(hs)], prob.k[hs], prob.compute_dtype
        q_norm = float(torch.linalg.vector_norm(q, dim=-1, dtype=cdt).amax()) if q.numel() else 0.0
        k_norm = float(torch.linalg.vector_norm(k, dim=-1).amax()) if k.numel() else 0.0
        cache[key] = abs(prob.scale) * LOG2E * q_norm * k_norm
    lse_max = 0.0
    if lse2 is not None:
        finite = lse2[torch.isfinite(lse2)]
        lse_max = float(finite.abs().max()) if finite.numel() else 0.0
    unit = torch.finfo(prob.compute_dtype).eps / 2
    return (prob.head_dim + 2) * unit * (cache[key] + lse_max)


def _own_statistics(prob: SequenceProblem, hs, scores, dob, v, i0, i1, blocks, buffers, keep_scale):
    """The block's base-2 LSE and ``Delta`` taken over the very scores and ``dP`` the backward then
    computes: (nh, G*bm, 1) each, LSE -inf for rows that see no key. With both from the same
    numbers, ``P <= 1`` and, for a row whose softmax is one-hot, ``dP - Delta`` is exactly 0 at its
    key (``rowsum(dO * O)`` rounds differently from the GEMM that gives ``dP``)."""
    nh, rows = dob.shape[0], dob.shape[1]
    m = l = acc = None
    for j0, j1, hidden in blocks:
        s = scores(j0, j1, hidden, scratch_tile(buffers[0], nh, rows, j1 - j0))[0]
        if prob.on_band_edge(i0, i1, j0, j1):
            prob.hide_outside_band(s, i0, i1, j0, j1)
        tile_max = s.amax(-1, keepdim=True)
        m_new = tile_max if m is None else torch.maximum(m, tile_max)
        m_safe = m_new.masked_fill(~torch.isfinite(m_new), 0.0)
        p = s.sub_(m_safe).exp2_()
        dp = torch.bmm(dob, v[:, j0:j1].transpose(1, 2), out=scratch_tile(buffers[1], nh, rows, j1 - j0))
        if keep_scale is not None:
            dp.masked_fill_(~prob.dropout_keep(hs, i0, i1, j0, j1), 0.0).mul_(keep_scale)
        tile_sum = p.sum(-1, keepdim=True)
        tile_acc = p.mul_(dp).sum(-1, keepdim=True)
        if m is None:
            l, acc = tile_sum, tile_acc
        else:
            alpha = torch.exp2(m - m_safe)
            l = l.mul_(alpha).add_(tile_sum)
            acc = acc.mul_(alpha).add_(tile_acc)
        m = m_new
    lse2 = torch.log2(l).add_(m.masked_fill(~torch.isfinite(m), 0.0)).masked_fill_(l == 0, -math.inf)
    return lse2, acc / l.masked_fill(l == 0, 1.0)


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
        # A bias constant along a row shifts every score of the row alike, which the softmax cancels:
        # its gradient, sum_j dS_ij, is exactly 0. Summing dS only leaves the rounding noise of a
        # cancellation; times 0 keeps that exact while NaN rows still give NaN.
        t = t.sum(2, keepdim=True).mul_(0.0)
        cols = slice(None)
    dbias[heads, rows, cols].add_(t)
