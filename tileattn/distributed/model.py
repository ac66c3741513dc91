"""Analytic model of context parallelism: bytes each rank sends per attention layer, and whether
compute can hide them. The benchmark checks the byte counts against what ``count_collectives``
measured; docs/distributed.md tabulates the model at 8-1024 GPUs and 128k-1M tokens.

Per rank, per layer, ``S`` tokens, ``W`` ranks, ``H``/``Hkv`` heads, head dim ``D``, ``e`` bytes per
element (``a`` for the dK/dV accumulators, fp32 = 4):

* **ring**: forward ``W - 1`` K/V blocks of ``2 (S/W) Hkv D e``; backward as many K/V blocks and
  ``W`` dK/dV blocks of ``2 (S/W) Hkv D a``. About ``2 S Hkv D (2e + a)`` in all, *independent of
  W*: adding ranks does not reduce a rank's traffic, it only shortens the compute that hides it.
* **Ulysses** (``U`` ranks): four all-to-alls forward (q, k, v, out) and four backward (their
  gradients), each sending the fraction ``(U-1)/U`` of a local tensor: about
  ``2 (S/U) (2 H + 2 Hkv') D e`` with ``Hkv' = lcm(Hkv, U)`` kv heads after replication. Falls as
  ``1/U``, but ``U <= H`` and every all-to-all is exposed (nothing to overlap it with).
* **hybrid** (``U`` x ``R``): the Ulysses all-to-alls over ``U`` ranks, then a ring over ``R`` of
  blocks with ``Hkv'/U`` heads: the ring's traffic divided by ``U``.

Overlap of the ring: a step computes one K/V block while the next one travels. Causal and zigzag,
each step is half a ``(S/W) x (S/W)`` block pair, ``2 (S/W)^2 H D`` FLOPs forward, against
``2 (S/W) Hkv D e`` bytes: the transfer hides when ``S/W >= e Hkv F / (H B)`` (F: attainable
FLOP/s, B: link bytes/s). The backward moves ~3x the bytes for ~2.5x the FLOPs (same condition
within 20%).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int = 1
    elem_bytes: int = 2  # bf16
    acc_bytes: int = 4  # dK/dV accumulators travel in fp32


def _kv_heads_after_replication(kv_heads: int, ulysses: int) -> int:
    return kv_heads * (ulysses // math.gcd(kv_heads, ulysses))


def ring_bytes(s: Shape, world: int, *, kv_heads=None, backward: bool = True) -> float:
    """Bytes one ring rank sends per layer (forward, plus backward when ``backward``)."""
    if world <= 1:
        return 0.0
    hkv = s.kv_heads if kv_heads is None else kv_heads
    block = 2 * s.batch * (s.tokens / world) * hkv * s.head_dim
    fwd = (world - 1) * block * s.elem_bytes
    return fwd + ((world - 1) * block * s.elem_bytes + world * block * s.acc_bytes if backward else 0.0)


def ulysses_bytes(s: Shape, ulysses: int, *, backward: bool = True, with_lse: bool = False) -> float:
    """Bytes one Ulysses rank sends per layer: (U-1)/U of q, k, v, out (and their gradients)."""
    if ulysses <= 1:
        return 0.0
    hkv = _kv_heads_after_replication(s.kv_heads, ulysses)
    local = s.batch * (s.tokens / ulysses) * s.head_dim * s.elem_bytes
    per_pass = (2 * s.heads + 2 * hkv) * local * (ulysses - 1) / ulysses
    if with_lse:
        per_pass += s.batch * (s.tokens / ulysses) * s.heads * 4 * (ulysses - 1) / ulysses
    return per_pass * (2 if backward else 1)


def hybrid_bytes(s: Shape, ulysses: int, ring: int, *, backward: bool = True):
    """(all-to-all bytes inside the Ulysses group, ring bytes across groups) per rank per layer."""
    per_rank_kv = _kv_heads_after_replication(s.kv_heads, ulysses) // ulysses
    inner = ulysses_bytes(Shape(s.tokens // ring, s.heads, s.kv_heads, s.head_dim, s.batch, s.elem_bytes,
                                s.acc_bytes), ulysses, backward=backward)
    outer = ring_bytes(s, ring, kv_heads=per_rank_kv, backward=backward)
    return inner, outer


def ring_hides_transfer_from(s: Shape, flops: float, link_bytes_per_s: float) -> float:
    """Tokens per rank from which a causal zigzag ring step's compute covers its K/V transfer."""
    return s.elem_bytes * s.kv_heads * flops / (s.heads * link_bytes_per_s)


def ulysses_beats_ring_from(s: Shape) -> float:
    """Ulysses size from which its traffic (forward) is below the ring's: ``U > 1 + 2H/(2Hkv)``
    roughly; computed exactly by search over powers of two up to H."""
    u = 2
    while u <= s.heads:
        if s.heads % u == 0 and ulysses_bytes(s, u, backward=False) < ring_bytes(s, u, backward=False):
            return u
        u *= 2
    return math.inf


def step_times(s: Shape, world: int, flops: float, link_bytes_per_s: float, causal: bool = True):
    """(compute seconds, transfer seconds) of one forward ring step for a rank."""
    n = s.tokens / world
    work = (2.0 if causal else 4.0) * s.batch * n * n * s.heads * s.head_dim
    moved = 2 * s.batch * n * s.kv_heads * s.head_dim * s.elem_bytes
    return work / flops, moved / link_bytes_per_s


# ---------------------------------------------------------------------------------------------
# Time per layer on a cluster (forward): what the tables in docs/distributed.md are made of.

#: Illustrative cluster: 8 GPUs per node on NVLink, one 400 Gb/s NIC per GPU across nodes,
#: attention at 400 TFLOP/s (bf16, FlashAttention-class kernels).
FLOPS = 400e12
NVLINK = 450e9
NIC = 50e9
GPUS_PER_NODE = 8


def forward_time(s: Shape, mode: str, world: int, ulysses: int = GPUS_PER_NODE):
    """(seconds, exposed communication seconds) of one causal attention layer's forward per rank,
    or None when the mode cannot run (Ulysses needs ``world <= heads`` and ``heads % world == 0``)."""
    compute = 2.0 * s.batch * s.tokens ** 2 * s.heads * s.head_dim / world / FLOPS
    if mode == "ring":
        link = NVLINK if world <= GPUS_PER_NODE else NIC
        c, t = step_times(s, world, FLOPS, link)
        total = c + (world - 1) * max(c, t)
    elif mode == "ulysses":
        if world > s.heads or s.heads % world:
            return None
        link = NVLINK if world <= GPUS_PER_NODE else NIC
        total = compute + ulysses_bytes(s, world, backward=False) / link
    else:  # hybrid: Ulysses inside a node, ring across nodes
        u = min(ulysses, world)
        r = world // u
        inner = ulysses_bytes(Shape(s.tokens // r, s.heads, s.kv_heads, s.head_dim, s.batch, s.elem_bytes), u,
                              backward=False) / NVLINK
        heads_kv = _kv_heads_after_replication(s.kv_heads, u) // u
        ring_shape = Shape(s.tokens, s.heads // u, heads_kv, s.head_dim, s.batch, s.elem_bytes)
        c, t = step_times(ring_shape, r, FLOPS, NIC)
        total = inner + c + (r - 1) * max(c, t)
    return total, total - compute


def table(s: Shape, tokens=(131072, 262144, 524288, 1048576), worlds=(8, 16, 32, 64, 128, 256, 512, 1024)):
    """Rows (tokens, world, mode, ms, exposed %, MiB sent per rank fwd+bwd)."""
    rows = []
    for n in tokens:
        shape = Shape(n, s.heads, s.kv_heads, s.head_dim, s.batch, s.elem_bytes, s.acc_bytes)
        for w in worlds:
            for mode in ("ring", "ulysses", "hybrid"):
                est = forward_time(shape, mode, w)
                if est is None:
                    continue
                sent = {"ring": lambda: ring_bytes(shape, w),
                        "ulysses": lambda: ulysses_bytes(shape, w),
                        "hybrid": lambda: sum(hybrid_bytes(shape, min(GPUS_PER_NODE, w), w // min(GPUS_PER_NODE, w)))
                        }[mode]()
                rows.append((n, w, mode, 1e3 * est[0], 100.0 * est[1] / est[0], sent / 2**20))
    return rows


if __name__ == "__main__":
    llama = Shape(0, 32, 8, 128)
    print(f"ring hides its K/V transfer from {ring_hides_transfer_from(llama, FLOPS, NIC):.0f} tokens per rank "
          f"across nodes, {ring_hides_transfer_from(llama, FLOPS, NVLINK):.0f} on NVLink; Ulysses moves fewer bytes "
          f"than ring from U = {ulysses_beats_ring_from(Shape(131072, 32, 8, 128))}")
    cells = {}
    for n, w, mode, ms, exposed, mib in table(llama):
        cells[(n, w, mode)] = f"{ms:.1f} ms, {exposed:.0f}%, {mib / 1024:.2f} GiB"
    print("| tokens | GPUs | ring | Ulysses | hybrid (U=8) |")
    print("|---|---|---|---|---|")
    for n, w in sorted({(n, w) for n, w, _ in cells}):
        print(f"| {n // 1024}k | {w} | " + " | ".join(cells.get((n, w, m), "-") for m in ("ring", "ulysses", "hybrid"))
              + " |")
