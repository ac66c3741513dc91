"""The entry point: :func:`context_parallel_attention` on each rank's shard of one attention call."""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from dataclasses import replace

from ..core.modifiers import check_keywords, fail, modifier_types, modifiers_from_keywords, to_4d
from ..core.layouts import LAYOUT, LAYOUTS, from_batched, to_batched
from ..core.spec import CALL_KEYWORDS, build_spec, check_bool
from . import ring as ring_mod
from . import agreement, topology, ulysses
from .plan import ShardPlan

#: Dimension of the sequence in each layout (public: what :func:`shard` is given as ``seq_dim``).
SEQ_DIM = {name: LAYOUT[name].seq_dim for name in LAYOUTS}


def _refuse(name, given, why):
    fail(NotImplementedError, name, given, why)


def _sharded_4d(m, batch, heads, rows, seq_len):
    """A modifier over (local rows, global keys) (a bias, a mask) with its tensor as a 4-d
    (B|1, H|1, rows|1, S|1) view, or a clear error."""
    t, name = m.tensor, m.kind
    expected = f"{m.expected} broadcastable to (B, Hq, local rows, global keys)"
    if not isinstance(t, torch.Tensor) or not m.accepts(t):
        fail(TypeError, name, type(t).__name__ if not isinstance(t, torch.Tensor) else f"dtype {t.dtype}", expected)
    t4 = to_4d(t)
    full = (batch, heads, rows, seq_len)
    if t.dim() > 4 or any(n not in (1, f) for n, f in zip(t4.shape, full)):
        fail(ValueError, name, f"shape {tuple(t.shape)}",
             f"a shape broadcastable to (B, Hq, local rows, global keys) = {full}: rows sharded like q, keys "
             "in global order")
    return replace(m, tensor=t4)


def _sharded_types() -> tuple:
    """The modifier types context parallelism shards (:attr:`~tileattn.core.modifiers.Modifier.context_parallel`)."""
    return tuple(cls for cls in modifier_types() if cls.context_parallel is not None)


def _placed(found, how: str) -> list:
    return [m for m in found if m.context_parallel == how]
_OWN_KEYWORDS = ("group", "mode", "load_balance", "timeout", "return_lse", "backend")


def context_parallel_attention(
    q, k, v, *, group=None, mode="ring", layout="BNSD", load_balance=True, timeout=None, num_heads=None, scale=None,
    align="bottom_right", cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    return_lse=False, deterministic=False, backend="auto", seqused_k=None, block_table=None, modifiers=(),
    **variants,
):
    r"""Exact attention of a sequence sharded over the ranks of ``group``: call it on every rank with
    that rank's shard of q, k and v; each rank gets its shard of the output (and LSE).

    The tokens a rank holds are those of :func:`shard` with the same ``group`` and ``load_balance``
    (zigzag when True: chunks ``r`` and ``2W-1-r`` of ``2W``; contiguous otherwise). Every mode
    reads the same placement, so shards can go to any mode.

    Modes:
        ``"ring"``: K/V blocks rotate with point-to-point sends, overlapped with compute
        (``W - 1`` block transfers forward; backward ``W - 1`` K/V and ``W`` dK/dV transfers).
        ``"ulysses"``: all-to-all sequence -> heads, plain attention on ``Hq / W`` heads of the
        whole sequence, all-to-all back. Needs ``Hq % W == 0``; kv heads are repeated to
        ``lcm(Hkv, W)`` when fewer or not divisible.
        ``"hybrid"``: Ulysses inside each row of a 2-D DeviceMesh ``(ring, ulysses)``, ring across.

    Args are :func:`tileattn.flash_attention`'s (its variant keywords: ``causal``, ``window``,
    ``mask``, ``bias``, ``alibi_slopes``, ``softcap``, ``sinks``), for the local shards, plus:
        group: None (default group), a ProcessGroup, a DeviceMesh (2-D for hybrid).
        load_balance: the placement the shards were cut with (:func:`shard`).
        timeout: seconds (or timedelta) any communication may wait before every rank raises
            :class:`CollectiveError`; default ``$TILEATTN_CP_TIMEOUT`` or 300 s.
        cu_seqlens_q / cu_seqlens_k: varlen (``layout="TND"``): the **global** int32 cumulative
            offsets of the packed batch (the same on every rank; sequences may span ranks, each is
            placed as a padded sequence would be). Must be equal (self-attention).
        bias / mask: broadcastable to (B, Hq, local rows, global keys): rows sharded like q, keys in
            global position order; the bias gradient is this rank's rows' share.
        sinks: counted once per row (not once per shard). ``dsinks`` and the gradient of any bias
            broadcast over rows are this rank's contribution: sum them over the group, as a
            data-parallel gradient reduction does for every replicated parameter.

    Not available across shards (raise ``NotImplementedError`` naming the argument): dropout (its
    mask is a function of local row numbers), ``seqused_k`` and ``block_table`` (KV caches),
    bias/mask with varlen (as in :func:`tileattn.flash_attention`), Sq != Sk.

    Returns ``out`` (and ``lse``, fp32, with ``return_lse=True``) for the local shard; differentiable.
    """
    check_keywords(variants, CALL_KEYWORDS + _OWN_KEYWORDS)
    check_bool("return_lse", return_lse)
    check_bool("load_balance", load_balance)
    dropout_p = variants.get("dropout_p", 0.0)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        _refuse("dropout_p", repr(dropout_p), "0.0: context-parallel attention has no dropout (the mask is a function "
                "of row/column numbers, which differ between a shard and the whole sequence)")
    found = modifiers_from_keywords(variants, modifiers)
    for m in found:
        if m.context_parallel is None:
            _refuse("modifiers", f"a {m.kind} modifier", "the modifiers context parallelism shards: "
                    + ", ".join(cls.kind for cls in _sharded_types()))
    for name, val in (("seqused_k", seqused_k), ("block_table", block_table)):
        if val is not None:
            _refuse(name, "a tensor", "None: a KV cache is not sequence-sharded; run flash_attention on each rank")
    if not isinstance(layout, str) or layout.upper() not in LAYOUTS:
        fail(ValueError, "layout", repr(layout), "one of " + ", ".join(repr(x) for x in LAYOUTS))
    layout = layout.upper()
    varlen = layout == "TND"
    sd = SEQ_DIM[layout]
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, type(t).__name__, f"a tensor in layout '{layout}'")
    if q.dim() > sd and k.dim() > sd and q.shape[sd] != k.shape[sd]:
        fail(ValueError, "k", f"{k.shape[sd]} local tokens for {q.shape[sd]} queries",
             "the same shard of the sequence as q (context parallelism is self-attention: Sq == Sk)")
    if varlen:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, torch.Tensor):
                fail(ValueError, name, type(cu).__name__, "the global int32 cumulative offsets (layout='TND')")
        if not torch.equal(cu_seqlens_q.cpu(), cu_seqlens_k.cpu()):
            fail(ValueError, "cu_seqlens_k", "offsets different from cu_seqlens_q", "the same global offsets "
                 "(context parallelism is self-attention)")
    for m in found:
        m.check_shards(varlen)
    local = q.shape[sd] if q.dim() > sd else 0
    local_cu = torch.tensor([0, local], dtype=torch.int32, device=q.device) if varlen else None
    # The local call, validated as flash_attention would validate it (bias/mask: below, global keys).
    spec = build_spec(q, k, v, layout=layout, num_heads=num_heads, scale=scale, align=align,
                      cu_seqlens_q=local_cu, cu_seqlens_k=local_cu, deterministic=deterministic,
                      modifiers=tuple(m for m in found if m.context_parallel != "keys"))
    topo = topology.resolve(group, mode, timeout)
    if topo.U > 1 and spec.heads_q % topo.U:
        fail(ValueError, "q", f"{spec.heads_q} query heads for {topo.U} Ulysses ranks",
             f"a number of heads divisible by {topo.U} (or mode='ring', or a hybrid mesh whose ulysses size "
             f"divides {spec.heads_q})")
    off0 = 0 if isinstance(spec.align, str) else spec.align
    batch = 1 if varlen else spec.batch

    # Every rank must be making the same call; the global length follows from the local ones.
    fields = _call_fields(q, k, v, layout, mode, topo, load_balance, spec.align, spec.scale, found, variants,
                          cu_seqlens_q if varlen else None)
    lengths = agreement.check_agreement(lambda t: topo.gather_all(t, "validate", "the check that every rank makes "
                                                                  "the same call"), fields, local, q.device)
    plan = agreement.check_lengths(
        lengths, topo.world, load_balance,
        ShardPlan.build(topo.world, load_balance, cu_seqlens=cu_seqlens_q) if varlen else None,
        f"the varlen batch of cu_seqlens_q ({cu_seqlens_q.numel() - 1} sequences, {int(cu_seqlens_q[-1])} tokens)"
        if varlen else "")
    seq_len = sum(plan.lengths) if varlen else plan.lengths[0]
    keyed = [_sharded_4d(m, batch, spec.heads_q, local, seq_len) for m in _placed(found, "keys")]
    others = [m for m in found if m.context_parallel != "keys"]

    qi = to_batched(q, layout, spec.heads_q)
    ki, vi = to_batched(k, layout, spec.heads_kv), to_batched(v, layout, spec.heads_kv)
    kwargs = dict(scale=spec.scale, deterministic=deterministic, backend=backend)
    if topo.U > 1:
        u = topo.ulysses_rank
        ex = ulysses.Exchange(topo.ulysses, [plan.local_len(g) for g in topo.ring_members(topo.ring_rank)],
                              plan.gather_order(list(topo.ring_members(topo.ring_rank))))
        heads = ulysses.head_slice(u, spec.heads_q, topo.U)
        repeat = ulysses.kv_repeats(spec.heads_kv, topo.U)
        if repeat > 1:
            ki, vi = ki.repeat_interleave(repeat, dim=1), vi.repeat_interleave(repeat, dim=1)
        qi, ki, vi = (ulysses.SeqToHeads.apply(ex, t, n) for t, n in ((qi, "q"), (ki, "k"), (vi, "v")))
        keyed = [replace(m, tensor=_ulysses_4d(ex, m.tensor, heads, spec.heads_q, local, m.kind)) for m in keyed]
        others = [m.for_heads(heads) for m in others]
    # Every block applies the "block" modifiers as they are; the band is placed per block, the keyed
    # modifiers' columns are cut per block, the merged ones (sinks) are merged once after the walk.
    band = next(iter(_placed(others, "band")), None)
    merged = next(iter(_placed(others, "merge")), None)
    cfg = ring_mod.RingConfig(topo.ring, [plan.runs(list(topo.ring_members(i))) for i in range(topo.R)], varlen,
                              band, off0, kwargs, tuple(_placed(others, "block")), tuple(keyed), merged)
    out, lse = ring_mod.RingAttention.apply(cfg, qi, ki, vi, *ring_mod.grad_tensors(cfg))
    if topo.U > 1:
        out = ulysses.HeadsToSeq.apply(ex, out, "out")
        if return_lse:
            lse = ulysses.HeadsToSeq.apply(ex, lse.unsqueeze(-1), "lse").squeeze(-1)
    out = from_batched(out, layout)
    if not return_lse:
        return out
    return out, (lse[0] if varlen else lse)


def _call_fields(q, k, v, layout, mode, topo, load_balance, align, scale, found, variants, cu_seqlens):
    """What every rank must agree on, each field named after the user's argument and shown as the
    user passed it; shard lengths (the sequence dim of q/k/v, the row dim of bias/mask) may differ.
    The arguments are validated already (``build_spec``)."""
    sd = SEQ_DIM[layout]
    return [
        agreement.tensor_field("q", q, sd), agreement.tensor_field("k", k, sd), agreement.tensor_field("v", v, sd),
        agreement.choice_field("layout", layout, LAYOUTS), agreement.choice_field("mode", mode, topology.MODES),
        agreement.group_field(topo.U, topo.R), agreement.bool_field("load_balance", load_balance),
        agreement.align_field(align), agreement.float_field("scale", scale), *_modifier_fields(found, variants),
        agreement.offsets_field("cu_seqlens_q", cu_seqlens),
    ]


def _modifier_fields(found, variants) -> list:
    """The keywords of every modifier type context parallelism shards, present or not (every rank
    compares the same fields), as the user passed them: a modifier passed as an object shows as the
    keywords that make it (:meth:`~tileattn.core.modifiers.Modifier.as_keywords`)."""
    out = []
    for cls in _sharded_types():
        given = next((m for m in found if type(m) is cls), None)
        values = dict(cls.keywords)
        if any(name in variants for name in cls.keywords):
            values.update((name, variants[name]) for name in cls.keywords if name in variants)
        elif given is not None:
            values.update(given.as_keywords())
        out += [agreement.MODIFIER_FIELDS[how](name, values[name]) for name, how in cls.agreement().items()]
    return out


def _ulysses_4d(ex, t4, heads: slice, heads_q: int, local: int, tag: str):
    """A bias/mask for the Ulysses step: rows sharded like q travel with the all-to-all (broadcast
    heads expanded first); rows broadcast over queries only lose the heads of other ranks."""
    if t4 is None:
        return None
    if t4.shape[2] == local:
        if t4.shape[1] == 1:
            t4 = t4.expand(t4.shape[0], heads_q, t4.shape[2], t4.shape[3])
        return ulysses.SeqToHeads.apply(ex, t4.contiguous(), tag)
    return t4[:, heads] if t4.shape[1] > 1 else t4


def _group_topology(group):
    """The topology :func:`shard` and :func:`unshard` place tokens by (any mode reads the same)."""
    mode = "hybrid" if topology._is_mesh(group) and group.ndim == 2 else "ring"
    return topology.resolve(group, mode, None)


def _plan(topo, load_balance, seq_len, cu_seqlens):
    check_bool("load_balance", load_balance)
    if cu_seqlens is None and (isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 0):
        fail(ValueError, "seq_len", repr(seq_len), "the global sequence length, an int >= 0")
    return ShardPlan.build(topo.world, load_balance, seq_len=seq_len, cu_seqlens=cu_seqlens)


def shard(x: torch.Tensor, *, seq_dim: int, group=None, load_balance: bool = True, cu_seqlens=None) -> torch.Tensor:
    """This rank's shard of ``x`` (the whole sequence, or packed varlen tokens with ``cu_seqlens``)
    along ``seq_dim``: the tokens :func:`context_parallel_attention` expects here. Differentiable."""
    if not isinstance(x, torch.Tensor):
        fail(TypeError, "x", type(x).__name__, "a tensor")
    if isinstance(seq_dim, bool) or not isinstance(seq_dim, numbers.Integral) or not -x.dim() <= seq_dim < x.dim():
        fail(ValueError, "seq_dim", repr(seq_dim), f"a dimension of the {x.dim()}-d tensor")
    topo = _group_topology(group)
    plan = _plan(topo, load_balance, x.shape[seq_dim], cu_seqlens)
    if cu_seqlens is not None and sum(plan.lengths) != x.shape[seq_dim]:
        fail(ValueError, "cu_seqlens", f"{sum(plan.lengths)} tokens", f"{x.shape[seq_dim]}, the tokens of x")
    return x.index_select(seq_dim, plan.global_index([topo.rank]).to(x.device))


def positions(seq_len: Optional[int] = None, *, group=None, load_balance: bool = True, cu_seqlens=None,
              device=None) -> torch.Tensor:
    """Position of each of this rank's tokens inside its sequence (``position_ids`` for RoPE)."""
    topo = _group_topology(group)
    return _plan(topo, load_balance, seq_len, cu_seqlens).positions(topo.rank).to(device)


@torch.no_grad()
def unshard(x: torch.Tensor, *, seq_dim: int, group=None, load_balance: bool = True, cu_seqlens=None,
            seq_len: Optional[int] = None) -> torch.Tensor:
    """The whole tensor from every rank's shard (the inverse of :func:`shard`), on every rank.

    ``seq_len`` (or ``cu_seqlens``) is the global length; by default the sum of the shards. Not
    differentiable (for checking and saving results)."""
    if not isinstance(x, torch.Tensor):
        fail(TypeError, "x", type(x).__name__, "a tensor")
    topo = _group_topology(group)
    mine = torch.tensor([x.shape[seq_dim]], dtype=torch.int64, device=x.device)
    lengths = [int(t) for t in topo.gather_all(mine, "unshard", "the exchange of shard lengths")]
    plan = _plan(topo, load_balance, sum(lengths) if seq_len is None else seq_len, cu_seqlens)
    if lengths != [plan.local_len(r) for r in range(topo.world)]:
        fail(ValueError, "x", f"shards of {lengths} tokens", f"{[plan.local_len(r) for r in range(topo.world)]} "
             f"(the plan for load_balance={load_balance})")
    rows = x.movedim(seq_dim, 0)
    padded = torch.cat([rows, rows.new_zeros((max(lengths) - rows.shape[0],) + tuple(rows.shape[1:]))])
    pieces = topo.gather_all(padded.contiguous(), "unshard", "the gathering of shards")
    gathered = torch.cat([p[:n] for p, n in zip(pieces, lengths)], 0)
    order = torch.argsort(plan.global_index(range(topo.world))).to(x.device)
    return gathered.index_select(0, order).movedim(0, seq_dim)
