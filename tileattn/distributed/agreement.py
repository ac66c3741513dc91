"""Every rank must make the same call, and the shards must be the shards of one sequence.

Before any compute, :func:`check_agreement` all-gathers a small integer description of every rank's
arguments (shapes except the sequence length, dtypes, flags, modifiers) and, when two ranks differ,
raises the same error on every rank: it names the user's argument and shows the value each rank
passed, as the user wrote it (``argument 'causal': got True on CP rank 0 and False on CP rank 1``).
Otherwise the collectives of the two calls would not match and would hang or fail obscurely.

:func:`check_lengths` then checks the shard lengths against the placement, and when they do not
fit it names the ranks whose shards differ from the sequence the other ranks' shards imply (the
length that fits the most ranks), not the first rank that differs from a plan of the summed lengths.
"""

from __future__ import annotations

import struct
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..core.modifiers import fail
from .plan import ShardPlan, local_lengths

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.int32, torch.int64,
           torch.int16, torch.int8, torch.uint8)
_WIDTH = 7  # slots per field: a 5-d tensor is (dtype, ndim, 5 sizes)
_NONE = -1


class Field(NamedTuple):
    """One argument as every rank describes it: ints to compare, and how to show them to the user."""

    name: str  # the user's argument
    values: Tuple[int, ...]
    show: Callable[[Sequence[int]], str]
    #: On a mismatch, the argument itself is gathered and shown (small tensors: cu_seqlens).
    tensor: Optional[torch.Tensor] = None


def tensor_field(name: str, t, seq_dim: Optional[int] = None) -> Field:
    """dtype and shape; the sequence dim (which may differ between shards) is shown as ``S``."""
    if t is None:
        return Field(name, (_NONE,), _show_tensor)
    shape = [(-2 if i == seq_dim else n) for i, n in enumerate(t.shape)]
    code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99
    return Field(name, (code, t.dim(), *shape), _show_tensor)


def _show_tensor(row: Sequence[int]) -> str:
    if row[0] == _NONE:
        return "None"
    dtype = str(_DTYPES[row[0]]) if 0 <= row[0] < len(_DTYPES) else "another dtype"
    shape = ", ".join("S" if x == -2 else str(x) for x in row[2:2 + row[1]])
    return f"a {dtype} tensor of shape ({shape}{',' if row[1] == 1 else ''})"


def float_field(name: str, x: float) -> Field:
    return Field(name, (struct.unpack("<q", struct.pack("<d", float(x)))[0],),
                 lambda row: repr(struct.unpack("<d", struct.pack("<q", row[0]))[0]))


def bool_field(name: str, x: bool) -> Field:
    return Field(name, (int(bool(x)),), lambda row: repr(bool(row[0])))


def int_field(name: str, x: int) -> Field:
    return Field(name, (int(x),), lambda row: repr(row[0]))


def choice_field(name: str, value: str, choices: Sequence[str]) -> Field:
    return Field(name, (list(choices).index(value),), lambda row: repr(choices[row[0]]))


def window_field(name: str, window) -> Field:
    """A window as given, ``(left, right)`` or None; None = unbounded (a negative side and None are
    the same window)."""
    def show(row):
        if row[0] == 0:
            return "None"
        return repr(tuple(None if side == _NONE else side for side in row[1:3]))

    left, right = (None, None) if window is None else (None if s is None or s < 0 else int(s) for s in window)
    if left is None and right is None:
        return Field(name, (0,), show)
    return Field(name, (1, _NONE if left is None else left, _NONE if right is None else right), show)


def rows_field(name: str, t) -> Field:
    """A tensor whose row dim (its second to last: rows sharded like q) may differ between ranks."""
    return tensor_field(name, t, t.dim() - 2 if t is not None and t.dim() >= 2 else None)


#: The field of a modifier's keyword, by how its type compares it
#: (:meth:`tileattn.core.modifiers.Modifier.agreement`).
MODIFIER_FIELDS = {"bool": bool_field, "float": float_field, "tensor": tensor_field, "rows": rows_field,
                   "window": window_field}


def align_field(align) -> Field:
    """``align`` as given: 'bottom_right', 'top_left' or an int."""
    names = ("bottom_right", "top_left")
    if isinstance(align, str):
        values = (names.index(align), 0)
    else:
        values = (len(names), int(align))
    return Field("align", values, lambda row: repr(names[row[0]]) if row[0] < len(names) else repr(row[1]))


def group_field(ulysses: int, ring: int) -> Field:
    def show(row):
        u, r = row
        if u == 1 or r == 1:
            return f"a group of {u * r} ranks"
        return f"a {r} x {u} (ring x ulysses) mesh"

    return Field("group", (ulysses, ring), show)


def offsets_field(name: str, cu: Optional[torch.Tensor]) -> Field:
    """Varlen offsets: compared by a digest; on a mismatch every rank's offsets are gathered and shown."""
    if cu is None:  # still gathered on a mismatch: every rank must take part in the same collectives
        return Field(name, (_NONE,), lambda row: "None", torch.zeros(0, dtype=torch.int64))
    weights = torch.arange(1, cu.numel() + 1, device=cu.device)
    digest = (cu.numel(), int(cu[-1]), int((cu.long() * weights).sum()))
    return Field(name, digest, lambda row: f"{row[0]} offsets ending at {row[1]}", cu.long())


def per_rank(shown: Sequence[Tuple[int, str]]) -> str:
    """'A on CP ranks 0 and 2 and B on CP rank 1': each value (rank, text) with the ranks that passed it."""
    groups = {}
    for rank, text in shown:
        groups.setdefault(text, []).append(rank)
    parts = [f"{text} on {ranks_phrase(ranks)}" for text, ranks in groups.items()]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def ranks_phrase(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"CP rank {ranks[0]}"
    return "CP ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"


def check_agreement(gather_all, fields: Sequence[Field], local_len: int, device) -> List[int]:
    """All-gather the described call (``gather_all``: one tensor -> every CP rank's, in CP-rank
    order); raise the same error on every rank when two ranks differ. Returns every CP rank's
    ``local_len`` (token count), in CP-rank order."""
    rows = []
    for f in fields:
        if len(f.values) > _WIDTH:
            raise AssertionError(f"field {f.name} needs {len(f.values)} slots")
        rows.append(list(f.values) + [0] * (_WIDTH - len(f.values)))
    mine = torch.tensor([x for r in rows for x in r] + [local_len], dtype=torch.int64, device=device)
    table = [t.tolist() for t in gather_all(mine)]
    for i, f in enumerate(fields):
        row = lambda rank: table[rank][i * _WIDTH:(i + 1) * _WIDTH]  # noqa: E731
        if any(row(rank) != row(0) for rank in range(len(table))):
            # Every rank sees the same table, so every rank takes this branch (and any gather in it).
            shown = _gathered(gather_all, f, [row(r) for r in range(len(table))], device)
            fail(ValueError, f.name, per_rank(list(enumerate(shown))),
                 "the same on every rank of the context-parallel group (each rank passes its shard of one call; "
                 "only the sequence length of a shard may differ)")
    return [t[-1] for t in table]


def _gathered(gather_all, f: Field, rows, device) -> List[str]:
    if f.tensor is None:
        return [f.show(r) for r in rows]
    longest = max(r[0] for r in rows)
    padded = torch.full((longest + 1,), _NONE, dtype=torch.int64, device=device)
    padded[0] = f.tensor.numel()
    padded[1:1 + f.tensor.numel()] = f.tensor.to(device)
    shown = []
    for row, t in zip(rows, gather_all(padded)):
        values = t[1:1 + int(t[0])].tolist()
        if row[0] == _NONE:
            shown.append(f.show(row))
        else:
            shown.append(str(values) if len(values) <= 12 else f"{values[:5]} ... {values[-5:]} ({len(values)} offsets)")
    return shown


def check_lengths(lengths: Sequence[int], world: int, load_balance: bool, plan: Optional[ShardPlan] = None,
                  what: str = "") -> ShardPlan:
    """The plan the shard ``lengths`` (every CP rank's local token count) are cut by, or an error that
    names the ranks that do not fit it. ``plan`` is given when the global lengths are known (varlen:
    ``cu_seqlens``, described by ``what``); otherwise the sequence is the one that fits the most shards."""
    lengths = list(lengths)
    how = f"over {world} ranks with load_balance={load_balance} (cut it with tileattn.distributed.shard)"
    if plan is None:
        plan = ShardPlan.build(world, load_balance, seq_len=sum(lengths))
        if _expected(plan) == lengths:
            return plan
        fits = _best_sequence_lengths(lengths, world, load_balance)
        if not fits:
            fail(ValueError, "q", per_rank([(r, f"{n} local tokens") for r, n in enumerate(lengths)]),
                 f"the shards of one sequence {how}: no sequence length fits more than half of these shards "
                 f"({_implied(lengths, world, load_balance)})")
        expected = [_expected(ShardPlan.build(world, load_balance, seq_len=n)) for n in fits]
        what = f"a sequence of {_alternatives(fits)} tokens, which the other ranks' shards imply,"
    else:
        expected = [_expected(plan)]
    bad = sorted({r for e in expected for r in range(world) if lengths[r] != e[r]})
    if bad:
        got = per_rank([(r, f"{lengths[r]} local tokens") for r in bad])
        want = " and ".join(_alternatives(sorted({e[r] for e in expected})) for r in bad)
        fail(ValueError, "q", got, f"{want}: the shard{'s' if len(bad) > 1 else ''} of {what} {how}")
    return plan


def _alternatives(values: Sequence[int]) -> str:
    """'4', '4 or 5', '3 to 5' (sorted ints)."""
    if len(values) > 2 and values[-1] - values[0] == len(values) - 1:
        return f"{values[0]} to {values[-1]}"
    return " or ".join(map(str, values)) if len(values) <= 2 else ", ".join(map(str, values[:-1])) + f" or {values[-1]}"


def _expected(plan: ShardPlan) -> List[int]:
    return [plan.local_len(r) for r in range(plan.world)]


def _candidates(lengths: Sequence[int], world: int) -> torch.Tensor:
    """Every sequence length whose shards could have one of these lengths (a shard is about S / world)."""
    spans = [torch.arange(max(0, (n - 2) * world), (n + 2) * world + 1) for n in sorted(set(lengths))]
    return torch.unique(torch.cat(spans))


def _best_sequence_lengths(lengths: Sequence[int], world: int, load_balance: bool) -> List[int]:
    """The sequence lengths whose shards match the most ranks' lengths (several on a tie), when that
    is more than half of the ranks; [] when no length fits a majority."""
    seq = _candidates(lengths, world)
    fits = (local_lengths(seq, world, load_balance) == torch.tensor(lengths)).sum(1)
    best = int(fits.max())
    return [] if 2 * best <= world else seq[fits == best].tolist()


def _implied(lengths: Sequence[int], world: int, load_balance: bool) -> str:
    """What each rank's shard alone implies: 'CP rank 0's 6 tokens fit a sequence of 12 tokens'."""
    seq = _candidates(lengths, world)
    table = local_lengths(seq, world, load_balance)
    parts = []
    for r, n in enumerate(lengths):
        fit = seq[table[:, r] == n].tolist()
        # A shard grows with the sequence, so the lengths one shard fits are a range.
        span = ("no sequence" if not fit else f"a sequence of {fit[0]} tokens" if len(fit) == 1 else
                f"a sequence of {fit[0]} to {fit[-1]} tokens")
        parts.append(f"CP rank {r}'s {n} tokens fit {span}")
    return "; ".join(parts)
