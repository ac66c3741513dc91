"""Ring attention: K/V blocks travel around the ranks; each rank merges its queries' partial results.

Forward (per rank ``r`` of ``W``): at step ``i`` the rank holds the K/V block of rank
``(r - i) mod W`` and, while it computes on it, already sends it on to ``r + 1`` and receives the
next one from ``r - 1`` (``batch_isend_irecv``): ``W - 1`` K/V transfers overlapped with compute.
Each (query run, key run) pair is placed by its diagonal offset ``off = pos_q - pos_k`` (an ``align``
int) and classified by the band as skipped, full (computed without the band) or partial (computed
with it); the partial results ``(out in fp32, lse)`` are merged into the running result by LSE.

Backward (FlashAttention-2's ring backward): the same walk, with the *global* (out, LSE) given to
:func:`tileattn.attention_backward`, so each block's gradients are its exact share. dQ accumulates
locally; dK/dV accumulators (fp32) travel with the blocks and reach their owner after ``W`` sends.

Sinks are merged once, after the walk (a sink added by every block would be counted ``W`` times).
Padded batches use one call per pair (or one call for all full pairs of a step when nothing in the
call depends on positions); varlen batches group the pairs of every sequence that share an offset
into one varlen call, since ``align`` is one int per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..api import attention_backward, attention_partial
from ..merge import merge_into, merge_sink
from ..modifiers import Band, Bias, Mask, Modifier, Sinks, TileState
from . import comm
from .plan import Run

Sel = Union[slice, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Which calls a (query rows, key block) step makes.


@dataclass(frozen=True)
class Call:
    """One engine call of a step: local query rows ``q`` against rows ``k`` of the K/V block."""

    q: Sel
    k: Sel
    off: int
    band: bool  # apply the band (a partial pair); False for pairs the band leaves whole
    k_pos: torch.Tensor  # global position of each key row (columns of a bias or mask)
    cu_q: Optional[torch.Tensor] = None  # varlen: segments of the gathered rows
    cu_k: Optional[torch.Tensor] = None
    max_q: int = 0
    max_k: int = 0


def _aranges(starts_and_lengths) -> torch.Tensor:
    parts = [torch.arange(a, a + n) for a, n in starts_and_lengths]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _rows(runs: Sequence[Run]) -> torch.Tensor:
    return _aranges((r.row, r.length) for r in runs)


def _positions(runs: Sequence[Run]) -> torch.Tensor:
    return _aranges((r.pos, r.length) for r in runs)


def _span(runs: Sequence[Run]) -> Optional[slice]:
    """The rows of ``runs`` as one slice when they are adjacent."""
    for a, b in zip(runs, runs[1:]):
        if a.row + a.length != b.row:
            return None
    return slice(runs[0].row, runs[-1].row + runs[-1].length)


def block_kind(q_pos: int, q_len: int, k_pos: int, k_len: int, *, causal: bool = False, window=None,
               align: int = 0) -> Tuple[str, int]:
    """How to compute the pair (queries ``q_pos .. q_pos + q_len - 1``, keys ``k_pos ..``) of one
    sequence: ``("skip" | "full" | "partial", off)``. ``off = q_pos - k_pos + align`` is the
    ``align=`` int that places the pair's diagonal; "full" pairs need no causal/window flag (only
    ALiBi still reads ``off``), "partial" ones take ``causal``/``window`` with ``align=off``."""
    band = Band.from_args(causal, window)
    off = q_pos - k_pos + align
    if band is None or q_len == 0 or k_len == 0:
        return ("skip" if q_len == 0 or k_len == 0 else "full"), off
    state = band.tile_state(0, q_len, 0, k_len, off)
    return {TileState.EMPTY: "skip", TileState.FULL: "full", TileState.PARTIAL: "partial"}[state], off


def _classify(q_runs, k_runs, band: Optional[Band], align: int):
    """{(qi, ki): (off, state)} for every pair of the same sequence that is not skipped."""
    pairs = {}
    for qi, qr in enumerate(q_runs):
        for ki, kr in enumerate(k_runs):
            if qr.seq != kr.seq:
                continue
            off = qr.pos - kr.pos + align
            state = band.tile_state(0, qr.length, 0, kr.length, off) if band is not None else TileState.FULL
            if state != TileState.EMPTY:
                pairs[(qi, ki)] = (off, state)
    return pairs


def _cumulative(lengths: List[int], device) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def _groups_of_adjacent(indices: List[int]) -> List[List[int]]:
    out: List[List[int]] = []
    for i in sorted(indices):
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def plan_calls(q_runs: Sequence[Run], k_runs: Sequence[Run], band: Optional[Band], align: int,
               positional: bool, varlen: bool, device) -> List[Call]:
    """The calls of one step. ``positional``: a score depends on positions even in a full pair (ALiBi)."""
    pairs = _classify(q_runs, k_runs, band, align)
    free = {p for p, (_, state) in pairs.items() if state == TileState.FULL and not positional}
    calls: List[Call] = []
    if varlen:
        groups: Dict[tuple, List[Tuple[int, List[int]]]] = {}
        for qi in range(len(q_runs)):
            ks = [ki for ki in range(len(k_runs)) if (qi, ki) in free]
            if ks:
                groups.setdefault(("free",), []).append((qi, ks))
        for (qi, ki), (off, state) in sorted(pairs.items()):
            if (qi, ki) not in free:
                groups.setdefault((off, state), []).append((qi, [ki]))
        for key, members in groups.items():
            q_sel = _rows([q_runs[qi] for qi, _ in members])
            k_runs_of = [[k_runs[ki] for ki in ks] for _, ks in members]
            k_sel = _rows([r for rs in k_runs_of for r in rs])
            q_lens = [q_runs[qi].length for qi, _ in members]
            k_lens = [sum(r.length for r in rs) for rs in k_runs_of]
            off, band_on = (0, False) if key == ("free",) else (key[0], key[1] == TileState.PARTIAL)
            calls.append(Call(q_sel.to(device), k_sel.to(device), off, band_on,
                              _positions([r for rs in k_runs_of for r in rs]), _cumulative(q_lens, device),
                              _cumulative(k_lens, device),
                              max(q_lens), max(k_lens)))
        return calls
    # Padded: pairs that need their offset get a call each; the free ones are coalesced.
    for (qi, ki), (off, state) in sorted(pairs.items()):
        if (qi, ki) not in free:
            calls.append(Call(_span([q_runs[qi]]), _span([k_runs[ki]]), off, state == TileState.PARTIAL,
                              _positions([k_runs[ki]])))
    if not free:
        return calls
    # Join the free pairs of one query run over adjacent key runs, or of one key run over adjacent
    # query runs, whichever makes fewer calls (zigzag: one call per step either way).
    by_q, by_k = [], []
    for qi in range(len(q_runs)):
        by_q += [([qi], ks) for ks in _groups_of_adjacent([ki for ki in range(len(k_runs)) if (qi, ki) in free])]
    for ki in range(len(k_runs)):
        by_k += [(qs, [ki]) for qs in _groups_of_adjacent([qi for qi in range(len(q_runs)) if (qi, ki) in free])]
    for qs, ks in min(by_q, by_k, key=len):
        kr = [k_runs[ki] for ki in ks]
        calls.append(Call(_span([q_runs[qi] for qi in qs]), _span(kr), 0, False, _positions(kr)))
    return calls


# ---------------------------------------------------------------------------------------------
# The ring.


@dataclass
class RingConfig:
    """Everything but the differentiable tensors: who holds what, the call's modifiers, the engine."""

    group: Optional[comm.Group]  # None: a single ring rank (Ulysses alone), no communication
    runs: List[List[Run]]  # runs of each ring rank, in its local row order
    varlen: bool
    band: Optional[Band]
    align: int
    kwargs: dict  # scale, deterministic, backend
    modifiers: Tuple[Modifier, ...]  # applied by every block as they are (softcap, ALiBi)
    mask: Optional[torch.Tensor] = None  # 4-d (B|1, H|1, rows|1, S|1), bool
    calls: Optional[Dict[int, List[Call]]] = None

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank

    def block_rows(self, src: int) -> int:
        return sum(r.length for r in self.runs[src])

    def calls_for(self, src: int, device) -> List[Call]:
        if self.calls is None:
            self.calls = {}
        if src not in self.calls:
            positional = any(m.positional for m in self.modifiers)
            self.calls[src] = plan_calls(self.runs[self.rank], self.runs[src], self.band, self.align, positional,
                                         self.varlen, device)
        return self.calls[src]


def _take(x: torch.Tensor, dim: int, sel: Sel) -> torch.Tensor:
    if isinstance(sel, slice):
        return x.narrow(dim, sel.start, sel.stop - sel.start)
    return x.index_select(dim, sel)


def _take_4d(t: Optional[torch.Tensor], rows: Sel, cols: torch.Tensor) -> Optional[torch.Tensor]:
    """Rows and key columns of a 4-d bias/mask, keeping broadcast (size-1) dims."""
    if t is None:
        return None
    if t.shape[2] > 1:
        t = _take(t, 2, rows)
    if t.shape[3] > 1:
        lo, n = int(cols[0]), cols.numel()
        contiguous = bool(n and int(cols[-1]) - lo + 1 == n and torch.equal(cols, torch.arange(lo, lo + n)))
        t = t.narrow(3, lo, n) if contiguous else t.index_select(3, cols.to(t.device))
    return t


class _Block:
    """The tensors of one call, in the layout the engine is called with."""

    def __init__(self, cfg: RingConfig, call: Call, q, k, v, bias):
        self.cfg, self.call = cfg, call
        kw = dict(cfg.kwargs, align=call.off)
        modifiers = list(cfg.modifiers)
        if call.band:
            modifiers.append(cfg.band)
        if cfg.varlen:
            kw.update(layout="TND", cu_seqlens_q=call.cu_q, cu_seqlens_k=call.cu_k, max_seqlen_q=call.max_q,
                      max_seqlen_k=call.max_k)
            self.q = self.tnd(q, call.q)
            self.k, self.v = self.tnd(k, call.k), self.tnd(v, call.k)
        else:
            self.q, self.k, self.v = _take(q, 2, call.q), _take(k, 2, call.k), _take(v, 2, call.k)
            self.bias = _take_4d(bias, call.q, call.k_pos)
            if self.bias is not None:
                modifiers.append(Bias(self.bias))
            mask = _take_4d(cfg.mask, call.q, call.k_pos)
            if mask is not None:
                modifiers.append(Mask(mask))
        self.kwargs, self.modifiers = kw, modifiers

    def call_kwargs(self, bias: Optional[torch.Tensor] = None) -> dict:
        """The keywords of this block's attention_partial / attention_backward call; ``bias``
        replaces the block's bias (a leaf for its gradient)."""
        modifiers = [Bias(bias) if bias is not None and isinstance(m, Bias) else m for m in self.modifiers]
        return dict(self.kwargs, modifiers=tuple(modifiers))

    @staticmethod
    def tnd(x: torch.Tensor, sel: Sel) -> torch.Tensor:
        """(1, H, T, D) -> the selected tokens as (T', H, D)."""
        return _take(x[0], 1, sel).transpose(0, 1)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of an internal (B, H, S, E) tensor in this call's layout."""
        return self.tnd(x, self.call.q) if self.cfg.varlen else _take(x, 2, self.call.q)

    def lse_rows(self, lse: torch.Tensor) -> torch.Tensor:
        return _take(lse[0], 1, self.call.q) if self.cfg.varlen else _take(lse, 2, self.call.q)


def _pack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buf: torch.Tensor, shapes: Sequence[tuple]) -> List[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(buf[at:at + n].view(shape))
        at += n
    return out


def _kv_shapes(k: torch.Tensor, v: torch.Tensor, rows: int):
    return (k.shape[0], k.shape[1], rows, k.shape[3]), (v.shape[0], v.shape[1], rows, v.shape[3])


def ring_forward(cfg: RingConfig, q, k, v, bias, sinks):
    """(out fp32 (B, Hq, S, Dv), lse (B, Hq, S)) of this rank's queries over every rank's keys."""
    world, rank = cfg.size, cfg.rank
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
    cur = _pack(k, v) if world > 1 else None
    kc, vc = k, v
    for step in range(world):
        src = (rank - step) % world
        pending = None
        if step + 1 < world:
            nxt = torch.empty(sum(math.prod(s) for s in _kv_shapes(k, v, cfg.block_rows((src - 1) % world))),
                              dtype=cur.dtype, device=cur.device)
            pending = comm.exchange(cfg.group, cur, (rank + 1) % world, nxt, (rank - 1) % world, "kv",
                                    f"the ring K/V exchange (forward, step {step + 1} of {world - 1})")
        for call in cfg.calls_for(src, q.device):
            blk = _Block(cfg, call, q, kc, vc, bias)
            o, l = attention_partial(blk.q, blk.k, blk.v, **blk.call_kwargs())
            if cfg.varlen:  # (T', H, Dv), (H, T') -> gathered rows of the (1, H, T, .) accumulators
                rows_o, rows_l = _take(out[0], 1, call.q), _take(lse[0], 1, call.q)
                merge_into(rows_o, rows_l, o.transpose(0, 1), l, scratch=True)
                if not isinstance(call.q, slice):
                    out[0].index_copy_(1, call.q, rows_o)
                    lse[0].index_copy_(1, call.q, rows_l)
            else:
                merge_into(_take(out, 2, call.q), _take(lse, 2, call.q), o, l, scratch=True)
        if pending is not None:
            pending.wait()
            cur = nxt
            kc, vc = _unpack(cur, _kv_shapes(k, v, cfg.block_rows((src - 1) % world)))
    if sinks is not None:
        merge_sink(out, lse, sinks)
    return out, lse


def ring_backward(cfg: RingConfig, dout, dlse, q, k, v, out, lse, bias, bias_grad: bool, sinks):
    """(dq, dk, dv, dbias, dsinks) of this rank's shards, from the global ``out`` and ``lse``."""
    world, rank = cfg.size, cfg.rank
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dbias = torch.zeros(bias.shape, dtype=acc, device=q.device) if bias_grad else None
    cur = _pack(k, v) if world > 1 else None
    kc, vc = k, v
    d_pending, d_recv = None, None
    for step in range(world):
        src = (rank - step) % world
        shapes = _kv_shapes(k, v, cfg.block_rows(src))
        pending = None
        if step + 1 < world:
            nxt = torch.empty(sum(math.prod(s) for s in _kv_shapes(k, v, cfg.block_rows((src - 1) % world))),
                              dtype=cur.dtype, device=cur.device)
            pending = comm.exchange(cfg.group, cur, (rank + 1) % world, nxt, (rank - 1) % world, "kv",
                                    f"the ring K/V exchange (backward, step {step + 1} of {world - 1})")
        # The block's dK and dV accumulate in one flat fp32 buffer: it is sent as it is, no packing copy.
        d_blk = torch.zeros(sum(math.prod(x) for x in shapes), dtype=acc, device=q.device)
        dk_blk, dv_blk = _unpack(d_blk, shapes)
        for call in cfg.calls_for(src, q.device):
            blk = _Block(cfg, call, q, kc, vc, bias)
            # attention_backward returns dbias for a bias that requires grad
            leaf = blk.bias.detach().requires_grad_() if bias_grad else None
            g = attention_backward(blk.rows(dout), blk.q, blk.k, blk.v, blk.rows(out), blk.lse_rows(lse),
                                   dlse=None if dlse is None else blk.lse_rows(dlse), **blk.call_kwargs(leaf))
            if cfg.varlen:
                dq[0].index_add_(1, call.q, g.dq.transpose(0, 1).to(acc))
                dk_blk[0].index_add_(1, call.k, g.dk.transpose(0, 1).to(acc))
                dv_blk[0].index_add_(1, call.k, g.dv.transpose(0, 1).to(acc))
            else:
                _take(dq, 2, call.q).add_(g.dq)
                _take(dk_blk, 2, call.k).add_(g.dk)
                _take(dv_blk, 2, call.k).add_(g.dv)
                if dbias is not None:
                    _add_4d(dbias, call.q, call.k_pos, g.dbias)
        if d_pending is not None:
            d_pending.wait()
            d_blk += d_recv
        if pending is not None:
            pending.wait()
            cur = nxt
            kc, vc = _unpack(cur, _kv_shapes(k, v, cfg.block_rows((src - 1) % world)))
        if world > 1:
            d_recv = torch.empty(sum(math.prod(s) for s in _kv_shapes(k, v, cfg.block_rows((src - 1) % world))),
                                 dtype=acc, device=q.device)
            d_pending = comm.exchange(cfg.group, d_blk, (rank + 1) % world, d_recv, (rank - 1) % world,
                                      "dkv", f"the ring dK/dV exchange (backward, step {step + 1} of {world})")
    if world > 1:
        d_pending.wait()
        dk_blk, dv_blk = _unpack(d_recv, _kv_shapes(k, v, cfg.block_rows(rank)))
    dsinks = None
    if sinks is not None:
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        dsinks = Sinks(sinks).result_grad(lse.to(acc), delta, heads_axis=1)
    return dq, dk_blk, dv_blk, dbias, dsinks


def _add_4d(dst: torch.Tensor, rows: Sel, cols: torch.Tensor, value: torch.Tensor) -> None:
    """``dst[..., rows, cols] += value`` for a 4-d bias gradient, broadcast dims kept."""
    target = _take(dst, 2, rows) if dst.shape[2] > 1 else dst
    if dst.shape[3] > 1:
        target.index_add_(3, cols.to(dst.device), value.to(dst.dtype))
    else:
        target.add_(value.to(dst.dtype))


class RingAttention(torch.autograd.Function):
    """Autograd around :func:`ring_forward` / :func:`ring_backward`; tensors in (B, H, S, D)."""

    @staticmethod
    def forward(ctx, cfg: RingConfig, q, k, v, bias, sinks):
        out, lse = ring_forward(cfg, q, k, v, bias, sinks)
        out = out.to(q.dtype)
        ctx.cfg = cfg
        ctx.bias_grad = bias is not None and bias.requires_grad
        ctx.save_for_backward(q, k, v, out, lse, bias, sinks)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, bias, sinks = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dbias, dsinks = ring_backward(ctx.cfg, dout, dlse, q, k, v, out, lse, bias, ctx.bias_grad, sinks)
        return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None if dbias is None else dbias.to(bias.dtype), dsinks)
