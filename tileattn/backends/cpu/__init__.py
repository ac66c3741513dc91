"""The CPU engine: tiled FlashAttention-2 on PyTorch tensor ops (MKL GEMMs, vectorised exp2).

Launcher layer: splits a call into per-sequence problems (:class:`~.tiles.SequenceProblem`), picks
the tile configuration, allocates outputs in the user's layout and cuts the work into independent
tasks over canonical strided views: (range of kv heads, query block) in the forward pass, range of
kv heads in the backward pass (each head owns its dK/dV). :func:`.parallel.run_tasks` runs the tasks on one
single-threaded worker per core, most expensive first.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ...dispatch import Backend, register
from ...scores import key_range
from ...spec import AttentionInputs, empty_in_layout
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

    def heads_per_task(self, inp: AttentionInputs, tasks_per_head_range: int, min_tasks: int) -> int:
        if self.heads > 0:
            return min(self.heads, inp.heads_kv)
        nh = max(1, min(inp.heads_kv, TILE_BUDGET // (inp.group_size * self.block_m * self.block_n)))
        while nh > 1 and inp.batch * -(-inp.heads_kv // nh) * tasks_per_head_range < min_tasks:
            nh -= 1
        return nh

    def working_set_bytes(self, group: int, head_dim: int, head_dim_v: int, itemsize: int = 4) -> int:
        """Bytes one task touches per tile step: the score tile plus q, k, v and accumulator blocks."""
        rows = group * self.block_m
        return (rows * self.block_n + rows * (head_dim + 2 * head_dim_v)
                + self.block_n * (head_dim + head_dim_v)) * itemsize


def default_config(inp: AttentionInputs) -> TileConfig:
    from ...tuning import lookup

    tuned = lookup("cpu", inp)
    if tuned is not None:
        return TileConfig(int(tuned["block_m"]), int(tuned["block_n"]))
    # Measured on a 2-core Sapphire Rapids (fp32, against SDPA): dense problems run best with
    # 512x512 tiles of two heads (see TILE_BUDGET); on the diagonal of a causal/windowed problem much
    # of a big tile is wasted, so banded problems use 128x256 tiles and batch up to 8 kv heads per
    # tile instead (S=1024 causal, one thread: 0.58x -> 0.83x SDPA forward). GQA stacks the G query
    # heads of a group into the rows of one block.
    if inp.has_band or inp.mask is not None:
        # Small tiles also let the skipping of fully masked tiles follow a block-sparse mask.
        return TileConfig(block_m=max(16, 128 // inp.group_size), block_n=256)
    return TileConfig(block_m=max(16, 512 // inp.group_size), block_n=512)


def _head_ranges(heads_kv: int, nh: int):
    return [slice(h, min(h + nh, heads_kv)) for h in range(0, heads_kv, nh)]


class CpuBackend(Backend):
    name = "cpu"
    priority = 20
    #: Set by ``tileattn tune`` or tests to force a configuration.
    config_override = None

    def not_supported_reasons(self, inp: AttentionInputs):
        why = []
        if inp.device.type != "cpu":
            why.append(f"needs CPU tensors (got {inp.device.type})")
        return why

    def config(self, inp: AttentionInputs) -> TileConfig:
        return self.config_override or default_config(inp)

    def _problems(self, inp: AttentionInputs):
        """Yield (batch index, q rows slice, SequenceProblem) for each sequence."""
        cdt = inp.acc_dtype()
        slopes = inp.alibi_slopes
        for b, (q0, lq, k0, lk) in enumerate(inp.seq_lengths()):
            if inp.is_varlen:
                q = inp.q_c[q0:q0 + lq].transpose(0, 1)
                k = inp.k_c[k0:k0 + lk].transpose(0, 1)
                v = inp.v_c[k0:k0 + lk].transpose(0, 1)
            else:
                q, k, v = inp.q_c[b], inp.k_c[b], inp.v_c[b]
            left, right = inp.window_bounds
            yield b, slice(q0, q0 + lq), SequenceProblem(
                q=q, k=k, v=v, scale=inp.scale, left=left, right=right,
                softcap=inp.softcap,
                mask=_batch_item(inp.mask, b), bias=_batch_item(inp.bias, b),
                slopes=None if slopes is None else (slopes if slopes.dim() == 1 else slopes[b]),
                dropout_p=inp.dropout_p, seed=inp.seed, batch_index=b, compute_dtype=cdt,
            )

    def forward(self, inp: AttentionInputs):
        cfg = self.config(inp)
        s = inp.q.shape[0] if inp.is_varlen else inp.seqlen_q
        out, out_c = empty_in_layout(inp.layout, inp.batch, inp.heads_q, s, inp.head_dim_v, inp.q)
        lse = torch.empty(inp.lse_shape(), dtype=inp.acc_dtype())
        tasks = []
        nh = cfg.heads_per_task(inp, -(-max(inp.seqlen_q, 1) // cfg.block_m), 4 * planned_workers())
        for b, rows, prob in self._problems(inp):
            prob.prepare(augment_k=prob.plain, augment_v=False)
            if inp.is_varlen:
                o, l = out_c[rows].transpose(0, 1), lse[:, rows]
            else:
                o, l = out_c[b], lse[b]
            for hs in _head_ranges(prob.heads_kv, nh):
                heads = prob.q_heads(hs)
                for i0 in range(0, prob.sq, cfg.block_m):
                    i1 = min(i0 + cfg.block_m, prob.sq)
                    lo, hi = key_range(i0, i1, prob.sq, prob.sk, prob.left, prob.right)
                    task = partial(kernels.forward_block, prob, hs, i0, i1, o[heads, i0:i1], l[heads, i0:i1],
                                   cfg.block_n)
                    tasks.append(((hi - lo) * (hs.stop - hs.start), task))
        run_tasks(_longest_first(tasks))
        return out, lse

    def backward(self, inp: AttentionInputs, out, lse, dout, need_dbias: bool):
        cfg = self.config(inp)
        cdt = inp.acc_dtype()
        dq = torch.empty_like(inp.q, memory_format=torch.contiguous_format)
        dk = torch.zeros(inp.k.shape, dtype=cdt)
        dv = torch.zeros(inp.v.shape, dtype=cdt)
        from ...spec import to_canonical

        dq_c = to_canonical(dq, inp.layout, inp.heads_q)
        dk_c = to_canonical(dk, inp.layout, inp.heads_kv)
        dv_c = to_canonical(dv, inp.layout, inp.heads_kv)
        out_c = to_canonical(out, inp.layout, inp.heads_q)
        dout_c = to_canonical(dout, inp.layout, inp.heads_q)
        dbias = None
        if need_dbias:
            shape4 = (1,) * (4 - inp.bias.dim()) + tuple(inp.bias.shape)
            dbias = torch.zeros(shape4, dtype=cdt)
        tasks = []
        nh = cfg.heads_per_task(inp, 1, planned_workers())
        for b, rows, prob in self._problems(inp):
            prob.prepare(augment_k=prob.plain, augment_v=prob.dropout_p == 0)
            if inp.is_varlen:
                sel = lambda t: t[rows].transpose(0, 1)  # noqa: E731
                ksel = slice(inp.cu_seqlens_k[b].item(), inp.cu_seqlens_k[b + 1].item())
                o, do, l, dq_b = sel(out_c), sel(dout_c), lse[:, rows], sel(dq_c)
                dk_b, dv_b = dk_c[ksel].transpose(0, 1), dv_c[ksel].transpose(0, 1)
            else:
                o, do, l, dq_b, dk_b, dv_b = out_c[b], dout_c[b], lse[b], dq_c[b], dk_c[b], dv_c[b]
            db = None if dbias is None else dbias[b if dbias.shape[0] > 1 else 0]
            for hs in _head_ranges(prob.heads_kv, nh):
                task = partial(kernels.backward_heads, prob, hs, o, do, l, dq_b, dk_b[hs], dv_b[hs], db,
                               cfg.block_m, cfg.block_n)
                tasks.append((prob.sq * prob.sk * (hs.stop - hs.start), task))
        if dbias is not None:
            # Heads (and batch items) may share bias-gradient entries: accumulate in one thread, in order.
            run_tasks([task for _, task in tasks], max_workers=1)
        else:
            run_tasks(_longest_first(tasks))
        if dbias is not None:
            dbias = dbias.reshape(inp.bias.shape).to(inp.bias.dtype)
        return dq, dk.to(inp.dtype), dv.to(inp.dtype), dbias


def _longest_first(tasks):
    """Callables sorted by decreasing cost (stable), so no core is left with a long task at the end."""
    return [task for _, task in sorted(tasks, key=lambda item: -item[0])]


def _batch_item(x, b):
    """Batch item ``b`` of a (B?, H?, Sq?, Sk?) broadcastable tensor as (H?, Sq?, Sk?)."""
    if x is None:
        return None
    x4 = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape)) if x.dim() < 4 else x
    return x4[b if x4.shape[0] > 1 else 0]


register(CpuBackend())
