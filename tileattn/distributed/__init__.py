"""Context parallelism on torch.distributed: exact attention of a sequence sharded over ranks.

    import tileattn.distributed as cp
    q, k, v = (cp.shard(t, seq_dim=2) for t in (q_full, k_full, v_full))    # this rank's tokens
    out = cp.context_parallel_attention(q, k, v, causal=True, mode="ring")  # this rank's output
    pos = cp.positions(seq_len)                                             # RoPE position ids

Ring (point-to-point K/V rotation, zigzag load balancing), Ulysses (all-to-all sequence <-> heads)
and hybrid (Ulysses inside, ring across, on a 2-D DeviceMesh), forward and backward, on any
torch.distributed backend (gloo for CPU tensors, NCCL for CUDA). Built on tileattn's partial
attention: ``attention_partial`` for each block, an LSE merge in fp32, ``attention_backward`` from
the global (out, LSE). The core never imports this package. See docs/distributed.md.
"""

from .attention import SEQ_DIM, context_parallel_attention, positions, shard, unshard
from .comm import DEFAULT_TIMEOUT_S, CollectiveError, CommStats, count_collectives
from .plan import ShardPlan, zigzag_chunks
from ..core.merge import merge_into, merge_sink
from .ring import block_kind
from .topology import hybrid_mesh

__all__ = [
    "context_parallel_attention", "shard", "unshard", "positions", "hybrid_mesh", "count_collectives",
    "CommStats", "CollectiveError", "DEFAULT_TIMEOUT_S", "ShardPlan", "zigzag_chunks", "block_kind", "merge_into",
    "merge_sink", "SEQ_DIM",
]
