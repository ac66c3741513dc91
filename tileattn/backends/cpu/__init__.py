"""The CPU engine: tiled FlashAttention-2 on PyTorch tensor ops (MKL GEMMs, vectorised exp2).

Launcher layer: splits a call into per-sequence problems (:class:`~.tiles.SequenceProblem`), picks
the tile configuration and cuts the work into independent tasks over canonical strided views:
(range of kv heads, query block) in the forward pass, range of kv heads in the backward pass (each
head owns its dK/dV). :func:`.parallel.run_tasks` runs the tasks on one single-threaded worker per
core, most expensive first. Outputs, the LSE gradient, sinks and the bias-gradient reduction are
handled above the engine (:mod:`tileattn.core.ops`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ...core.engine import ALL_DTYPES, Backend, Capabilities, Gradients, register
from ...core.kvquant import KVQuant, quant_of
from ...core.modifiers import Alibi, Band, Bias, Dropout, Mask, Softcap
from ...core.spec import AttentionSpec, dequantised_spec, sequence_views
from . import kernels
from .parallel import planned_workers, run_tasks
from .tiles import SequenceProblem


#: Score-tile elements one tensor operation should touch: 512 Ki fp32 = 2 MiB, a core's L2. Fewer,
#: larger operations matter most with two workers, whose Python threads contend for the GIL between
#: operations (S=1024 dense forward: 0.58x SDPA with 1 MiB tiles, 0.67x with 2 MiB).
TILE_BUDGET = 1 << 19


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    #: kv heads batched into one tile (0: as many as fit :data:`TILE_BUDGET` while leaving every
    #: core at least two tasks).
    heads: int = 0

    def heads_per_task(self, spec: AttentionSpec, tasks_per_head_range: int, min_tasks: int) -> int:
        if self.heads > 0:
            return min(self.heads, spec.heads_kv)
        nh = max(1, min(spec.heads_kv, TILE_BUDGET // (spec.group_size * self.block_m * self.block_n)))
        while nh > 1 and spec.batch * -(-spec.heads_kv // nh) * tasks_per_head_range < min_tasks:
            nh -= 1
        return nh

    def working_set_bytes(self, group: int, head_dim: int, head_dim_v: int, itemsize: int = 4) -> int:
        """Bytes one task touches per tile step: the score tile plus q, k, v and accumulator blocks."""
        rows = group * self.block_m
        return (rows * self.block_n + rows * (head_dim + 2 * head_dim_v)
                + self.block_n * (head_dim + head_dim_v)) * itemsize


def default_config(spec: AttentionSpec) -> TileConfig:
    from ...core.tunecache import lookup

    tuned = lookup("cpu", spec)
    if tuned is not None:
        return TileConfig(int(tuned["block_m"]), int(tuned["block_n"]))
    # Measured on a 2-core Sapphire Rapids (fp32, against SDPA): dense problems run best with
    # 512x512 tiles of two heads (see TILE_BUDGET); on the diagonal of a causal/windowed problem much
    # of a big tile is wasted, so banded problems use 128x256 tiles and batch up to 8 kv heads per
    # tile instead (S=1024 causal, one thread: 0.58x -> 0.83x SDPA forward). GQA stacks the G query
    # heads of a group into the rows of one block.
    args = spec.kernel_args
    if args.band is not None or args.mask is not None:
        # Small tiles also let the skipping of fully masked tiles follow a block-sparse mask.
        return TileConfig(block_m=max(16, 128 // spec.group_size), block_n=256)
    return TileConfig(block_m=max(16, 512 // spec.group_size), block_n=512)


def _head_ranges(heads_kv: int, nh: int):
    return [slice(h, min(h + nh, heads_kv)) for h in range(0, heads_kv, nh)]


class CpuBackend(Backend):
    name = "cpu"
    priority = 20
    #: A quantised cache is dequantised into a copy in q's dtype first (the native engine reads it as stored).
    capabilities = Capabilities(devices=frozenset(("cpu",)), dtypes=ALL_DTYPES,
                                modifiers=frozenset((Softcap, Alibi, Bias, Band, Mask, Dropout, KVQuant)))
    #: Set by ``tileattn tune`` or tests to force a configuration.
    config_override = None

    def config(self, spec: AttentionSpec) -> TileConfig:
        return self.config_override or default_config(spec)

    def _problems(self, spec: AttentionSpec, cfg: TileConfig):
        """Yield (SequenceSlice, SequenceProblem) for each sequence."""
        args = spec.kernel_args
        for seq in spec.sequences:
            q, k, v = sequence_views(spec, seq)
            yield seq, SequenceProblem(
                q=q, k=k, v=v, args=args, offset=seq.offset, batch_index=seq.batch,
                block_m=cfg.block_m, block_n=cfg.block_n, compute_dtype=spec.acc_dtype(),
            )

    def forward(self, spec: AttentionSpec, out, lse):
        if quant_of(spec) is not None:
            spec = dequantised_spec(spec, spec.dtype)
        cfg = self.config(spec)
        tasks = []
        nh = cfg.heads_per_task(spec, -(-max(spec.seqlen_q, 1) // cfg.block_m), 4 * planned_workers())
        for seq, prob in self._problems(spec, cfg):
            prob.prepare(augment_k=prob.plain, augment_v=False)
            if spec.is_varlen:
                rows = slice(seq.q_start, seq.q_start + seq.q_len)
                o, l = out[rows].transpose(0, 1), lse[:, rows]
            else:
                o, l = out[seq.batch], lse[seq.batch]
            for hs in _head_ranges(prob.heads_kv, nh):
                heads = prob.q_heads(hs)
                for i0 in range(0, prob.sq, cfg.block_m):
                    i1 = min(i0 + cfg.block_m, prob.sq)
                    lo, hi = prob.key_range(i0, i1)
                    task = partial(kernels.forward_block, prob, hs, i0, i1, o[heads, i0:i1], l[heads, i0:i1],
                                   cfg.block_n)
                    tasks.append(((hi - lo) * (hs.stop - hs.start), task))
        run_tasks(_longest_first(tasks))

    def backward(self, spec: AttentionSpec, grads: Gradients):
        cfg = self.config(spec)
        cdt = spec.acc_dtype()
        # dK/dV accumulate in the compute dtype, whatever the input dtype, then round once.
        dk = torch.zeros(grads.dk.shape, dtype=cdt) if spec.dtype != cdt else grads.dk.zero_()
        dv = torch.zeros(grads.dv.shape, dtype=cdt) if spec.dtype != cdt else grads.dv.zero_()
        grads.dq.zero_()
        tasks = []
        nh = cfg.heads_per_task(spec, 1, planned_workers())
        for seq, prob in self._problems(spec, cfg):
            prob.prepare(augment_k=prob.plain, augment_v=prob.dropout_p == 0)
            if spec.is_varlen:
                rows = slice(seq.q_start, seq.q_start + seq.q_len)
                keys = slice(seq.k_start, seq.k_start + seq.k_len)
                do, dq_b = grads.dout[rows].transpose(0, 1), grads.dq[rows].transpose(0, 1)
                l, delta = grads.lse[:, rows], grads.delta[:, rows]
                dlse = None if grads.dlse is None else grads.dlse[:, rows]
                dk_b, dv_b = dk[keys].transpose(0, 1), dv[keys].transpose(0, 1)
            else:
                b = seq.batch
                do, dq_b, l, delta = grads.dout[b], grads.dq[b], grads.lse[b], grads.delta[b]
                dlse = None if grads.dlse is None else grads.dlse[b]
                dk_b, dv_b = dk[b, :, : seq.k_len], dv[b, :, : seq.k_len]
            db = None if grads.dbias is None else grads.dbias[seq.batch if grads.dbias.shape[0] > 1 else 0]
            for hs in _head_ranges(prob.heads_kv, nh):
                task = partial(kernels.backward_heads, prob, hs, do, l, delta, dlse, dq_b, dk_b[hs], dv_b[hs], db,
                               cfg.block_m, cfg.block_n)
                tasks.append((prob.sq * prob.sk * (hs.stop - hs.start), task))
        if grads.dbias is not None:
            # Heads (and batch items) may share bias-gradient entries: accumulate in one thread, in order.
            run_tasks([task for _, task in tasks], max_workers=1)
        else:
            run_tasks(_longest_first(tasks))
        if dk is not grads.dk:
            grads.dk.copy_(dk)
            grads.dv.copy_(dv)


def _longest_first(tasks):
    """Callables sorted by decreasing cost (stable), so no core is left with a long task at the end."""
    return [task for _, task in sorted(tasks, key=lambda item: -item[0])]


register(CpuBackend())
