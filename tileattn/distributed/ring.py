"""Ring attention: K/V travel around the ranks; each rank merges its queries' partial results.

Forward (per rank ``r`` of ``W``): each rank's K/V block is cut into the same number of pieces
(a few, of hundreds of rows or more), and for each piece index ``j`` the ring makes one walk of
``W`` steps: at step ``i`` the rank holds piece ``j`` of the block of rank ``(r - i) mod W`` and,
while it computes on it, already sends it on to ``r + 1`` and receives piece ``j`` of the next
block from ``r - 1`` (``batch_isend_irecv``): ``W - 1`` transfers per walk, overlapped with
compute, the same bytes as whole blocks. A received piece is computed on at the next step, so two
receive buffers of a piece's size, reused by every step, hold all the K/V a rank receives.
Each (query run, key run) pair is placed by its diagonal offset ``off = pos_q - pos_k`` (an
``align`` int) and classified by the band as skipped, full (computed without the band) or partial
(computed with it); the partial results ``(out in fp32, lse)``, a chunk of query rows at a time,
are merged in place into one fp32 accumulator.

Backward (FlashAttention-2's ring backward): the same walks, with the *global* (out, LSE) given to
:func:`tileattn.attention_backward`, so each piece's gradients are its exact share. dQ accumulates
locally; each piece's dK/dV accumulator (fp32) follows the piece one step behind and reaches its
owner after ``W`` sends, which writes it into dk/dv.

Sinks are merged once, after the walks (a sink added by every piece would be counted many times).
Padded batches use one call per pair (or one call for all full pairs of a step when nothing in the
call depends on positions); varlen batches group the pairs of every sequence that share an offset
into one varlen call, since ``align`` is one int per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..core.api import attention_backward, attention_partial, flash_attention
from ..core.merge import merge_into, merge_sink
from ..core.modifiers import Band, Modifier, TileState
from . import comm
from .plan import Run, split_sizes

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

#: A rank's K/V block travels in ``pieces`` of at least MIN_PIECE_ROWS rows, at most MAX_PIECES of
#: them; query rows are computed in chunks of the same size. What a rank holds besides its own
#: shards and results is then a few pieces (receive buffers, dK/dV accumulators, a call's partial
#: result), not whole blocks. More pieces would shrink that further but multiply the engine calls
#: and the points where neighbours wait for each other: 16 pieces took 2.5x the time of 4 at 16k
#: tokens on 4 ranks (2 shared cores), where 4 pieces take the time of whole blocks.
MIN_PIECE_ROWS = 256
MAX_PIECES = 4


def _pieces(rows: int) -> int:
    return max(1, min(MAX_PIECES, rows // MIN_PIECE_ROWS))


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
    #: over (local rows, global keys), their tensors 4-d (B|1, H|1, rows|1, S|1): cut per block (bias, mask)
    keyed: Tuple[Modifier, ...] = ()
    merged: Optional[Modifier] = None  # merged once after the walk (sinks)
    calls: Optional[Dict[Tuple[int, int], List[Call]]] = None

    def __post_init__(self):
        self.rank, self.size = comm.place(self.group)

    def block_rows(self, src: int) -> int:
        return sum(r.length for r in self.runs[src])

    @cached_property
    def pieces(self) -> int:
        """K/V pieces per block, the same for every block (every rank must agree on the messages)."""
        return _pieces(max(self.block_rows(r) for r in range(self.size)))

    def piece(self, src: int, j: int) -> Tuple[int, int]:
        """(first row, rows) of piece ``j`` of the block of ring rank ``src``."""
        sizes = split_sizes(self.block_rows(src), self.pieces)
        return sum(sizes[:j]), sizes[j]

    def piece_runs(self, src: int, j: int) -> List[Run]:
        """The runs of piece ``j`` of block ``src``, rows counted from the piece's first row."""
        a, n = self.piece(src, j)
        runs = []
        for r in self.runs[src]:
            lo, hi = max(a, r.row), min(a + n, r.row + r.length)
            if lo < hi:
                runs.append(Run(r.seq, r.pos + lo - r.row, hi - lo, lo - a))
        return runs

    def calls_for(self, src: int, j: int, device) -> List[Call]:
        """The calls of this rank's queries against piece ``j`` of block ``src``; padded calls take
        at most a piece's worth of query rows each (their partial results are that small)."""
        if self.calls is None:
            self.calls = {}
        if (src, j) not in self.calls:
            positional = any(m.positional for m in self.modifiers)
            calls = plan_calls(self.runs[self.rank], self.piece_runs(src, j), self.band, self.align, positional,
                               self.varlen, device)
            if not self.varlen:
                rows = self.block_rows(self.rank)
                chunk = -(-rows // _pieces(rows)) if rows else 1
                calls = [part for call in calls for part in _row_chunks(call, chunk)]
            self.calls[(src, j)] = calls
        return self.calls[(src, j)]


def _row_chunks(call: Call, chunk: int) -> List[Call]:
    """``call`` cut into calls of at most ``chunk`` query rows; a chunk starting ``d`` rows later has
    its diagonal at ``off + d``."""
    a, b = call.q.start, call.q.stop
    if b - a <= chunk:
        return [call]
    return [Call(slice(s, min(s + chunk, b)), call.k, call.off + (s - a), call.band, call.k_pos)
            for s in range(a, b, chunk)]


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


def grad_tensors(cfg: RingConfig) -> tuple:
    """The tensors of the keyed and merged modifiers: what :class:`RingAttention` differentiates."""
    return tuple(m.tensor for m in cfg.keyed) + ((cfg.merged.tensor,) if cfg.merged is not None else ())


class _Block:
    """The tensors of one call, in the layout the engine is called with."""

    def __init__(self, cfg: RingConfig, call: Call, q, k, v):
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
            modifiers += [replace(m, tensor=_take_4d(m.tensor, call.q, call.k_pos)) for m in cfg.keyed]
        self.kwargs, self.modifiers = kw, modifiers

    def call_kwargs(self, bias_grad: bool = False) -> dict:
        """The keywords of this block's attention_partial / attention_backward call; with
        ``bias_grad`` the modifier whose gradient the call returns as ``dbias`` holds a leaf copy of
        its block."""
        modifiers = [replace(m, tensor=m.tensor.detach().requires_grad_()) if bias_grad and m.grad_slot == "bias"
                     else m for m in self.modifiers]
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


def _unpack(buf: torch.Tensor, shapes: Sequence[tuple]) -> List[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(buf[at:at + n].view(shape))
        at += n
    return out


class _Pieces:
    """The K/V pieces a rank computes on, walk by walk: for each piece index ``j``, one walk of
    ``W`` steps; at step ``i`` the rank holds piece ``j`` of block ``(r - i) mod W`` and, while it
    computes on it, sends it on to ``r + 1`` and receives piece ``j`` of the next block from ``r - 1``.
    A received piece is computed on at the very next step, so two flat buffers of a piece's size,
    reused by every step of every walk, hold all the K/V that travels (no block is ever whole)."""

    def __init__(self, cfg: RingConfig, k: torch.Tensor, v: torch.Tensor, what: str):
        self.cfg, self.k, self.v, self.what = cfg, k, v, what
        biggest = max(cfg.piece(src, j)[1] for src in range(cfg.size) for j in range(cfg.pieces))
        self.size = sum(math.prod(s) for s in self.shapes(biggest))  # elements of the largest piece
        self.buffers = [k.new_empty(self.size) for _ in range(2)] if cfg.size > 1 else []
        self.current, self.pending = 0, None

    def shapes(self, rows: int):
        return (self.k.shape[0], self.k.shape[1], rows, self.k.shape[3]), \
               (self.v.shape[0], self.v.shape[1], rows, self.v.shape[3])

    def numel(self, src: int, j: int) -> int:
        return sum(math.prod(s) for s in self.shapes(self.cfg.piece(src, j)[1]))

    def start(self, step: int, j: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of this step's piece; the exchange of pieces for the next step is under way."""
        cfg = self.cfg
        world, rank = cfg.size, cfg.rank
        src = (rank - step) % world
        a, rows = cfg.piece(src, j)
        if step == 0:  # this rank's own piece: views of its shard; a contiguous copy travels
            kc, vc = self.k.narrow(2, a, rows), self.v.narrow(2, a, rows)
            send = None
            if world > 1 and rows:
                send = self.buffers[1][:self.numel(src, j)]
                for dst, t in zip(_unpack(send, self.shapes(rows)), (kc, vc)):
                    dst.copy_(t)
            self.current = 1
        else:
            send = self.buffers[self.current][:self.numel(src, j)]
            kc, vc = _unpack(send, self.shapes(rows))
            send = send if rows else None
        if step + 1 < world:
            n = self.numel((src - 1) % world, j)
            recv = self.buffers[1 - self.current][:n] if n else None
            self.pending = comm.exchange(cfg.group, send, (rank + 1) % world, recv, (rank - 1) % world, "kv",
                                         f"the ring K/V exchange ({self.what}, piece {j + 1} of {cfg.pieces}, step "
                                         f"{step + 1} of {world - 1})")
            self.current = 1 - self.current
        return kc, vc

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None


def ring_forward(cfg: RingConfig, q, k, v):
    """(out fp32 (B, Hq, S, Dv), lse (B, Hq, S)) of this rank's queries over every rank's keys,
    merged in place into one accumulator."""
    world, rank = cfg.size, cfg.rank
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape[:3] + (v.shape[3],), dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=acc, device=q.device)
    pieces = _Pieces(cfg, k, v, "forward")
    for j in range(cfg.pieces):
        for step in range(world):
            kc, vc = pieces.start(step, j)
            for call in cfg.calls_for((rank - step) % world, j, q.device):
                blk = _Block(cfg, call, q, kc, vc)
                o, l = attention_partial(blk.q, blk.k, blk.v, **blk.call_kwargs())
                if cfg.varlen:  # (T', H, Dv), (H, T') -> gathered rows of the (1, H, T, .) accumulators
                    rows_o, rows_l = _take(out[0], 1, call.q), _take(lse[0], 1, call.q)
                    merge_into(rows_o, rows_l, o.transpose(0, 1), l, scratch=True)
                    if not isinstance(call.q, slice):
                        out[0].index_copy_(1, call.q, rows_o)
                        lse[0].index_copy_(1, call.q, rows_l)
                else:
                    merge_into(_take(out, 2, call.q), _take(lse, 2, call.q), o, l, scratch=True)
                del o, l
            pieces.finish()
    if cfg.merged is not None:
        merge_sink(out, lse, cfg.merged.tensor)
    return out, lse


class _Gradients:
    """The dK/dV accumulators of the pieces: each one starts at the piece's owner, collects every
    rank's share as it follows the piece around the ring (one step behind it) and returns to its
    owner after ``W`` sends, where it is written into dk/dv. Three flat fp32 buffers of a piece's
    size (filling, arriving, leaving) serve every step of every walk."""

    def __init__(self, cfg: RingConfig, pieces: _Pieces, acc, dk: torch.Tensor, dv: torch.Tensor):
        self.cfg, self.pieces, self.dk, self.dv = cfg, pieces, dk, dv
        self.buffers = [torch.empty(pieces.size, dtype=acc, device=dk.device) for _ in range(3 if cfg.size > 1 else 1)]
        self.fill, self.arriving, self.pending = 0, None, None

    def open(self, step: int, j: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (dk, dv) accumulators of this step's piece, for this rank's share."""
        src = (self.cfg.rank - step) % self.cfg.size
        buf = self.buffers[self.fill][:self.pieces.numel(src, j)].zero_()
        return tuple(_unpack(buf, self.pieces.shapes(self.cfg.piece(src, j)[1])))

    def close(self, step: int, j: int) -> None:
        """Add what the earlier ranks collected for this piece and pass it on."""
        cfg = self.cfg
        world, rank = cfg.size, cfg.rank
        src = (rank - step) % world
        mine = self.buffers[self.fill][:self.pieces.numel(src, j)]
        if self.pending is not None:
            self.pending.wait()  # the share of the earlier ranks has arrived, the previous send has left
            mine += self.buffers[self.arriving][:mine.numel()]
        if world == 1:
            self._deliver(j, mine)
            return
        n = self.pieces.numel((src - 1) % world, j)
        self.arriving, self.fill = (i for i in range(3) if i != self.fill)
        self.pending = comm.exchange(cfg.group, mine if mine.numel() else None, (rank + 1) % world,
                                     self.buffers[self.arriving][:n] if n else None, (rank - 1) % world, "dkv",
                                     f"the ring dK/dV exchange (backward, piece {j + 1} of {cfg.pieces}, step "
                                     f"{step + 1} of {world})")
        if step + 1 == world:  # the last send: what arrives is this rank's own piece, complete
            self.pending.wait()
            self._deliver(j, self.buffers[self.arriving][:n])
            self.arriving, self.pending = None, None

    def _deliver(self, j: int, flat: torch.Tensor) -> None:
        a, rows = self.cfg.piece(self.cfg.rank, j)
        for dst, part in zip((self.dk, self.dv), _unpack(flat, self.pieces.shapes(rows))):
            dst.narrow(2, a, rows).copy_(part)


def ring_backward(cfg: RingConfig, dout, dlse, q, k, v, out, lse, bias_grad: bool):
    """(dq fp32, dk, dv in k's dtype, dbias, dsinks) of this rank's shards, from the global ``out``
    and ``lse``; ``dbias`` (with ``bias_grad``) is the gradient of the keyed modifier whose gradient
    the op returns as ``dbias`` (a bias), ``dsinks`` that of the merged one (sinks)."""
    world, rank = cfg.size, cfg.rank
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    bias = next((m.tensor for m in cfg.keyed if m.grad_slot == "bias"), None) if bias_grad else None
    dbias = torch.zeros(bias.shape, dtype=acc, device=q.device) if bias is not None else None
    pieces = _Pieces(cfg, k, v, "backward")
    grads = _Gradients(cfg, pieces, acc, dk, dv)
    for j in range(cfg.pieces):
        for step in range(world):
            kc, vc = pieces.start(step, j)
            dk_piece, dv_piece = grads.open(step, j)
            for call in cfg.calls_for((rank - step) % world, j, q.device):
                blk = _Block(cfg, call, q, kc, vc)
                # attention_backward returns dbias for a bias that requires grad
                g = attention_backward(blk.rows(dout), blk.q, blk.k, blk.v, blk.rows(out), blk.lse_rows(lse),
                                       dlse=None if dlse is None else blk.lse_rows(dlse),
                                       **blk.call_kwargs(dbias is not None))
                if cfg.varlen:
                    dq[0].index_add_(1, call.q, g.dq.transpose(0, 1).to(acc))
                    dk_piece[0].index_add_(1, call.k, g.dk.transpose(0, 1).to(acc))
                    dv_piece[0].index_add_(1, call.k, g.dv.transpose(0, 1).to(acc))
                else:
                    _take(dq, 2, call.q).add_(g.dq)
                    _take(dk_piece, 2, call.k).add_(g.dk)
                    _take(dv_piece, 2, call.k).add_(g.dv)
                    if dbias is not None:
                        _add_4d(dbias, call.q, call.k_pos, g.dbias)
                del g
            grads.close(step, j)
            pieces.finish()
    dsinks = None
    if cfg.merged is not None:
        dsinks = _sink_gradient(dout, dlse, out, lse, cfg.merged, acc)
    return dq, dk, dv, dbias, dsinks


def _sink_gradient(dout, dlse, out, lse, sinks: Modifier, acc) -> torch.Tensor:
    """d loss / d sinks of this rank's rows, computed a piece of rows at a time (no fp32 copy of
    the whole output)."""
    rows = out.shape[2]
    chunk = max(1, -(-rows // _pieces(rows)))
    total = torch.zeros(sinks.tensor.shape, dtype=acc, device=out.device)
    in_acc = replace(sinks, tensor=sinks.tensor.to(acc))
    for a in range(0, rows, chunk):
        n = min(chunk, rows - a)
        delta = (dout.narrow(2, a, n).to(acc) * out.narrow(2, a, n).to(acc)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.narrow(2, a, n).to(acc)
        total += in_acc.result_grad(lse.narrow(2, a, n).to(acc), delta, heads_axis=1)
    return total.to(sinks.tensor.dtype)


def _add_4d(dst: torch.Tensor, rows: Sel, cols: torch.Tensor, value: torch.Tensor) -> None:
    """``dst[..., rows, cols] += value`` for a 4-d bias gradient, broadcast dims kept."""
    target = _take(dst, 2, rows) if dst.shape[2] > 1 else dst
    if dst.shape[3] > 1:
        target.index_add_(3, cols.to(dst.device), value.to(dst.dtype))
    else:
        target.add_(value.to(dst.dtype))


def whole_forward(cfg: RingConfig, q, k, v):
    """(out in q's dtype, lse) when one ring rank holds every key (Ulysses alone) and its queries and
    keys make one call: the engine writes the output directly, no fp32 accumulator. None otherwise."""
    rows = cfg.block_rows(0)
    if cfg.size > 1 or cfg.varlen or not rows:
        return None
    positional = any(m.positional for m in cfg.modifiers)
    calls = plan_calls(cfg.runs[0], cfg.runs[0], cfg.band, cfg.align, positional, False, q.device)
    if len(calls) != 1 or calls[0].q != slice(0, rows) or calls[0].k != slice(0, rows):
        return None
    blk = _Block(cfg, calls[0], q, k, v)
    kwargs = blk.call_kwargs()
    kwargs["modifiers"] += (cfg.merged,) if cfg.merged is not None else ()  # sinks, merged by the operator
    return flash_attention(blk.q, blk.k, blk.v, return_lse=True, **kwargs)


class RingAttention(torch.autograd.Function):
    """Autograd around :func:`ring_forward` / :func:`ring_backward`; tensors in (B, H, S, D), then
    the tensors of the keyed and merged modifiers (:func:`grad_tensors`), which the blocks read from
    ``cfg``."""

    @staticmethod
    def forward(ctx, cfg: RingConfig, q, k, v, *modifier_tensors):
        out, lse = whole_forward(cfg, q, k, v) or ring_forward(cfg, q, k, v)
        out = out.to(q.dtype)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        if dout is None:
            dout = torch.zeros_like(out)
        wanted = ctx.needs_input_grad[4:4 + len(cfg.keyed)]
        bias_grad = any(w and m.grad_slot == "bias" for w, m in zip(wanted, cfg.keyed))
        dq, dk, dv, dbias, dsinks = ring_backward(cfg, dout, dlse, q, k, v, out, lse, bias_grad)
        keyed = [dbias.to(m.tensor.dtype) if dbias is not None and m.grad_slot == "bias" else None for m in cfg.keyed]
        return (None, dq.to(q.dtype), dk, dv, *keyed, *((dsinks,) if cfg.merged is not None else ()))
