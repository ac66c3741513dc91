"""A model of how the native kernels split a prefill call into tasks, for planning and for the docs.

The C kernels (csrc/forward.c, csrc/backward.c) cut a call into tasks and run them on OpenMP threads
longest first with a dynamic schedule; a task's result never depends on which thread runs it. This
module reproduces the task lists (their number and their costs) so the schedule can be studied for
machines with more cores than the one at hand: :func:`simulate` plays the dynamic schedule and returns
the makespan over the ideal ``total work / threads``. ``docs/performance.md`` and hub chapter 14 use
it, and the chapter checks it against the task count the profiling build reports.

Costs are in (query row x key) pairs of work; the backward's are in tiles weighted by their GEMMs.
"""

from __future__ import annotations

import heapq

#: fp32 reals per byte, the unit of the working-set rule
_REAL = 4


def forward_block(d, dv, heads_kv, q_rows, threads, l2_bytes=2 << 20, group=1):
    """(query rows per block, keys per tile) as ``fwd_tiling`` in forward.c chooses them: 256 keys
    (fewer for wide heads, so a K/V tile stays ~256 KiB), and the widest block of 512, 256, ..., 32
    lanes (query rows x the ``group`` heads of a kv head) whose working set fits 3/4 of L2 and that
    leaves every thread 4 blocks. ``q_rows``: query rows of each sequence."""
    width = d + dv
    bn = max(64, min(256, 256 * 256 // width // 32 * 32))
    lanes = 512
    while lanes > 32:
        bmq = max(1, lanes // group)
        blocks = sum(-(-rows // bmq) for rows in q_rows) * heads_kv
        if (lanes * (width + bn) + bn * width) * _REAL <= l2_bytes // 4 * 3 and blocks >= 4 * threads:
            break
        lanes //= 2
    return max(1, lanes // group), bn


def forward_tasks(seqlen, heads, d, dv=None, causal=False, threads=1, l2_bytes=2 << 20, batch=1):
    """Costs of the forward's tasks (one per query block and kv head) for a batch of equal sequences
    (bottom-right causal when ``causal``)."""
    dv = dv or d
    bmq, _ = forward_block(d, dv, heads, [seqlen] * batch, threads, l2_bytes)
    costs = []
    for _ in range(batch):
        for i0 in range(0, seqlen, bmq):
            end = min(seqlen, i0 + bmq)
            costs += [(end if causal else seqlen) * (end - i0)] * heads
    return costs


def backward_tasks(seqlen, heads, causal=False, threads=1, batch=1, block_m=128, block_n=256):
    """Costs of the backward's tasks, as backward.c plans them: one per kv head (fused schedule, five
    GEMMs a tile) when there are two heads per thread, else one per key block (dK and dV: four GEMMs a
    tile) and one per query block (dQ: three GEMMs a tile)."""
    nq, nkb = -(-seqlen // block_m), -(-seqlen // block_n)

    def key_blocks_seen(qb):
        return min(nkb, ((qb + 1) * block_m - 1) // block_n + 1) if causal else nkb

    def query_blocks_seeing(kb):
        return nq - (kb * block_n) // block_m if causal else nq

    groups = heads * batch
    if groups >= 2 * threads or threads == 1:
        return [5 * sum(key_blocks_seen(q) for q in range(nq))] * groups
    return ([4 * query_blocks_seeing(k) for k in range(nkb)] + [3 * key_blocks_seen(q) for q in range(nq)]) * groups


def simulate(costs, threads):
    """The dynamic schedule played out: tasks longest first, each to the thread that frees up first.
    Returns the makespan over the ideal (total / threads), >= 1."""
    loads = [0] * threads
    for c in sorted(costs, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + c)
    ideal = sum(costs) / threads
    return max(loads) / ideal if ideal else 1.0
