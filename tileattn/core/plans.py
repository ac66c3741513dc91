"""The plan memo: what validation, dispatch and lowering derived from a call's shape, kept for the
calls that repeat it (a decode loop, a training step: the same shape thousands of times).

One bounded store with one eviction rule (the oldest entry goes first) and one :func:`clear`. Its
entries are of four kinds, the first element of their key:

- ``"lean"`` (:mod:`tileattn.core.lean`): a :class:`~tileattn.core.lean.LeanPlan`, the engine's
  prepared kernel call, keyed without K/V's key length so that a growing cache finds one entry;
- ``"full"`` (:mod:`tileattn.core.api`): a :class:`~tileattn.core.api.Plan`, the validated spec's
  template with its engine and lowered :class:`~tileattn.core.kernel_args.KernelArgs`;
- ``"lowered"`` (:mod:`tileattn.core.kernel_args`): the static ``KernelArgs`` of a set of modifiers,
  which the calls of a growing cache (a new shape each step, so no full plan) lower once;
- ``"kvcache"`` (:mod:`tileattn.dialects.flash_attn.kvcache`): the window of a ``flash_attn_with_kvcache``
  step whose arguments passed every check, so that its repeats skip them.

A value of None marks a key seen once whose plan is made when it comes back, or one for which
there is nothing to keep. Keys hold shapes, strides, dtypes, devices and flags; entries hold no
tensor (``tests/test_plan_memo.py`` walks them), so nothing a caller passed is kept alive here.
Whoever changes what a plan was derived from (an engine's declaration, its ``forward``) clears it.
"""

from __future__ import annotations

import threading
from typing import Iterator

#: entries kept, of all kinds together
LIMIT = 512

_MEMO: dict = {}
_WRITING = threading.Lock()  # eviction reads the oldest key: one writer at a time
#: the store's own lookup (a bound method: the lean call reads it on every call)
get = _MEMO.get


def put(key: tuple, value) -> None:
    """Keep ``value`` under ``key`` (whose first element is its kind), the oldest entry going first
    when the memo is full."""
    with _WRITING:
        if key not in _MEMO and len(_MEMO) >= LIMIT:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = value


def entries(kind: str) -> Iterator:
    """The values of one kind of entry (None included), oldest first."""
    return (value for key, value in list(_MEMO.items()) if key[0] == kind)


def count(kind: str) -> int:
    return sum(1 for key in list(_MEMO) if key[0] == kind)


def clear() -> None:
    """Forget every plan: the next call of each shape takes the full path and plans again."""
    _MEMO.clear()
