"""Every torch.distributed call tileattn makes, in one place: counted, timed and bounded.

* **Counting**: ``with count_collectives() as stats:`` records each call as (op, tag) with its
  message count and bytes (``stats.count("send", "kv")`` = K/V blocks this rank sent forward), so
  tests can assert the communication pattern (ring: ``world - 1`` K/V sends per forward) and the
  benchmark can check the analytic volume model against what really crossed the wire. It also sums
  the time spent blocked in ``wait``: communication that compute did not hide.
* **Bounded**: every operation is issued asynchronously and waited for with a timeout, so a peer
  that raised, died or made a different call ends this rank with :class:`CollectiveError` instead
  of a hang. The timeout is the caller's (``timeout=``), else ``$TILEATTN_CP_TIMEOUT`` seconds, else
  :data:`DEFAULT_TIMEOUT_S`. (Gloo honours it per wait; NCCL waits on the stream and relies on the
  process group's own timeout and watchdog.)
* **Transport**: only torch.distributed (``batch_isend_irecv``, ``all_to_all_single``,
  ``all_gather``, ``all_reduce``); any backend, any device.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

#: Seconds a rank waits for one communication before giving up, when nobody chose.
DEFAULT_TIMEOUT_S = 300.0


class CollectiveError(RuntimeError):
    """A communication of context-parallel attention failed or timed out on this rank."""


@dataclass
class CommStats:
    """What this rank sent and received: ``messages[(op, tag)]``, ``bytes[(op, tag)]``, wait time."""

    messages: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    calls: Counter = field(default_factory=Counter)
    wait_s: float = 0.0

    def count(self, op: str, tag: Optional[str] = None) -> int:
        """Messages of ``op`` (send, recv, all_to_all, all_gather, all_reduce), of ``tag`` if given."""
        return sum(n for (o, t), n in self.messages.items() if o == op and (tag is None or t == tag))

    def nbytes(self, op: str, tag: Optional[str] = None) -> int:
        return sum(n for (o, t), n in self.bytes.items() if o == op and (tag is None or t == tag))


_ACTIVE: List[CommStats] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[CommStats]:
    """Record every communication tileattn.distributed makes on this rank inside the block."""
    stats = CommStats()
    _ACTIVE.append(stats)
    try:
        yield stats
    finally:
        _ACTIVE.remove(stats)


def _record(op: str, tag: str, messages: int, nbytes: int, calls: int = 1) -> None:
    for s in _ACTIVE:
        s.messages[(op, tag)] += messages
        s.bytes[(op, tag)] += nbytes
        s.calls[(op, tag)] += calls


def resolve_timeout(timeout) -> float:
    """Seconds: the caller's ``timeout`` (seconds or timedelta), else the environment, else the default."""
    if timeout is None:
        env = os.environ.get("TILEATTN_CP_TIMEOUT")
        timeout = float(env) if env else DEFAULT_TIMEOUT_S
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"tileattn: argument 'timeout': got {timeout!r}; expected seconds > 0 (or a timedelta).")
    return float(timeout)


@dataclass
class Group:
    """A process group plus this rank's place in it and how to address its peers."""

    pg: object
    rank: int
    size: int
    timeout: float
    #: Global rank of each member, by group rank.
    members: Tuple[int, ...]

    @staticmethod
    def of(pg, timeout: float) -> "Group":
        size = dist.get_world_size(pg)
        members = tuple(dist.get_global_rank(pg, i) if pg is not None and pg != dist.group.WORLD else i
                        for i in range(size))
        return Group(pg, dist.get_rank(pg), size, timeout, members)


def place(group: Optional[Group]) -> Tuple[int, int]:
    """(this rank, ranks) of ``group``; None stands for a group of one rank."""
    return (0, 1) if group is None else (group.rank, group.size)


class Pending:
    """Works in flight, waited for together under the group's timeout. Holds the tensors they read
    and write until then (a temporary send buffer must outlive an asynchronous transfer)."""

    def __init__(self, group: Group, works, what: str, tensors=()):
        self.group, self.works, self.what = group, [w for w in works if w is not None], what
        self.tensors = tuple(tensors)

    def wait(self) -> None:
        t0 = time.perf_counter()
        try:
            for w in self.works:
                w.wait(timeout=datetime.timedelta(seconds=self.group.timeout))
        except RuntimeError as exc:
            raise _failure(self.group, self.what, exc) from exc
        finally:
            for s in _ACTIVE:
                s.wait_s += time.perf_counter() - t0
        self.works, self.tensors = [], ()


def _failure(group: Group, what: str, exc: BaseException) -> CollectiveError:
    text = str(exc)
    if "imed out" in text or "timeout" in text.lower():
        why = (f"did not complete within {group.timeout:g} s: a peer rank raised, died or is not making the same "
               "call (set timeout= or $TILEATTN_CP_TIMEOUT to wait longer)")
    else:
        why = "failed: a peer rank closed its connection (it died or gave up after an error of its own)"
    return CollectiveError(f"tileattn.distributed: rank {group.rank} of {group.size}: {what} {why}. "
                           f"[{type(exc).__name__}: {text.splitlines()[0] if text else ''}]")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def exchange(group: Group, send: Optional[torch.Tensor], dst: int, recv: Optional[torch.Tensor], src: int,
             tag: str, what: str) -> Pending:
    """Send ``send`` to group rank ``dst`` and receive ``recv`` from ``src`` (``batch_isend_irecv``)."""
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, group.members[dst], group.pg))
        _record("send", tag, 1, _nbytes(send))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, group.members[src], group.pg))
        _record("recv", tag, 1, _nbytes(recv))
    try:
        works = dist.batch_isend_irecv(ops) if ops else []
    except RuntimeError as exc:
        raise _failure(group, what, exc) from exc
    return Pending(group, works, what, (send, recv))


def all_to_all(group: Group, out: torch.Tensor, inp: torch.Tensor, out_splits: Sequence[int],
               in_splits: Sequence[int], tag: str, what: str) -> None:
    """``all_to_all_single`` of flat buffers with the given split sizes (elements), waited for with
    the timeout. Counted as ``size - 1`` messages: the piece a rank keeps does not travel."""
    _record("all_to_all", tag, group.size - 1, (inp.numel() - in_splits[group.rank]) * inp.element_size())
    try:
        work = dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=group.pg, async_op=True)
    except RuntimeError as exc:
        raise _failure(group, what, exc) from exc
    Pending(group, [work], what).wait()


def all_gather(group: Group, inp: torch.Tensor, tag: str, what: str) -> List[torch.Tensor]:
    """Every rank's ``inp`` (all of one shape), by group rank."""
    outs = [torch.empty_like(inp) for _ in range(group.size)]
    _record("all_gather", tag, group.size - 1, _nbytes(inp) * (group.size - 1))
    try:
        work = dist.all_gather(outs, inp.contiguous(), group=group.pg, async_op=True)
    except RuntimeError as exc:
        raise _failure(group, what, exc) from exc
    Pending(group, [work], what).wait()
    return outs


def all_reduce(group: Group, t: torch.Tensor, tag: str, what: str) -> torch.Tensor:
    """Sum ``t`` over the group, in place."""
    _record("all_reduce", tag, 1, _nbytes(t))
    try:
        work = dist.all_reduce(t, group=group.pg, async_op=True)
    except RuntimeError as exc:
        raise _failure(group, what, exc) from exc
    Pending(group, [work], what).wait()
    return t
