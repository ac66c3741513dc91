"""Who talks to whom: the context-parallel group as a ring level and a Ulysses level.

``group`` may be None (the default group), a ProcessGroup, a 1-D DeviceMesh or, for
``mode="hybrid"``, a 2-D DeviceMesh whose dimensions are named ``"ring"`` and ``"ulysses"`` (else
dimension 0 is the ring, 1 Ulysses, USP's and Megatron's ``a2a+p2p`` arrangement: Ulysses inside
a node, where all-to-all bandwidth is high, the ring across nodes). The CP rank of a process is
``g = ring_rank * U + ulysses_rank``; :mod:`tileattn.distributed.plan` places tokens by ``g``.

:meth:`Topology.gather_all` is the one all-gather over CP ranks that the agreement check before any
compute uses (:mod:`tileattn.distributed.agreement`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ..core.modifiers import fail
from . import comm

MODES = ("ring", "ulysses", "hybrid")


@dataclass
class Topology:
    ring: Optional[comm.Group]  # None: one ring rank
    ulysses: Optional[comm.Group]  # None: one Ulysses rank
    timeout: float

    def __post_init__(self):
        # this process's ring and Ulysses ranks, and how many of each (R, U)
        self.ring_rank, self.R = comm.place(self.ring)
        self.ulysses_rank, self.U = comm.place(self.ulysses)

    @property
    def world(self) -> int:
        return self.U * self.R

    @property
    def rank(self) -> int:
        """CP rank ``g = ring_rank * U + ulysses_rank``."""
        return self.ring_rank * self.U + self.ulysses_rank

    def ring_members(self, i: int) -> range:
        """CP ranks whose tokens ring rank ``i`` holds after the Ulysses all-to-all."""
        return range(i * self.U, (i + 1) * self.U)

    def gather_all(self, x: torch.Tensor, tag: str, what: str) -> List[torch.Tensor]:
        """Every CP rank's ``x`` (one shape everywhere), in CP-rank order."""
        inner = comm.all_gather(self.ulysses, x, tag, what) if self.ulysses is not None else [x]
        if self.ring is None:
            return inner
        outer = comm.all_gather(self.ring, torch.stack(inner), tag, what)
        return [t for block in outer for t in block.unbind(0)]


def _is_mesh(group) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:
        return False
    return isinstance(group, DeviceMesh)


def resolve(group, mode: str, timeout) -> Topology:
    """The topology of ``group`` for ``mode``; raises a clear error for a wrong combination."""
    if not isinstance(mode, str) or mode not in MODES:
        fail(ValueError, "mode", repr(mode), "'ring', 'ulysses' or 'hybrid'")
    if not dist.is_available() or not dist.is_initialized():
        fail(RuntimeError, "group", "no initialised torch.distributed process group",
             "torch.distributed.init_process_group(...) first (or launch with torchrun)")
    seconds = comm.resolve_timeout(timeout)
    if _is_mesh(group):
        names = tuple(group.mesh_dim_names or ())
        if group.ndim == 2:
            if mode != "hybrid":
                fail(ValueError, "mode", repr(mode), "'hybrid' for a 2-D DeviceMesh (or pass a 1-D mesh or group)")
            ring_dim, uly_dim = (names.index("ring"), names.index("ulysses")) if {"ring", "ulysses"} <= set(names) \
                else (0, 1)
            coord = group.get_coordinate()
            ring = comm.Group.of(group.get_group(ring_dim), seconds)
            uly = comm.Group.of(group.get_group(uly_dim), seconds)
            if coord is None or (ring.rank, uly.rank) != (coord[ring_dim], coord[uly_dim]):
                fail(ValueError, "group", f"a DeviceMesh whose coordinate {coord} is not this rank's place in its "
                     "ring and ulysses groups", "a mesh from init_device_mesh or tileattn.distributed.hybrid_mesh")
            return Topology(_nontrivial(ring), _nontrivial(uly), seconds)
        if group.ndim != 1:
            fail(ValueError, "group", f"a {group.ndim}-d DeviceMesh", "a 1-d mesh, or a 2-d (ring, ulysses) mesh for "
                 "mode='hybrid'")
        group = group.get_group()
    if mode == "hybrid":
        fail(ValueError, "group", "a process group with mode='hybrid'",
             "a 2-D DeviceMesh (ring, ulysses), e.g. tileattn.distributed.hybrid_mesh(ring_size, ulysses_size)")
    g = comm.Group.of(group, seconds)
    return Topology(g, None, seconds) if mode == "ring" else Topology(None, g, seconds)


def _nontrivial(g: comm.Group) -> Optional[comm.Group]:
    return g if g.size > 1 else None


def hybrid_mesh(ring_size: int, ulysses_size: int, device_type: str = "cpu"):
    """A 2-D DeviceMesh ``(ring, ulysses)`` over the default group for ``mode="hybrid"``: Ulysses
    over consecutive ranks (a node's devices), the ring across them."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (ring_size, ulysses_size), mesh_dim_names=("ring", "ulysses"))
