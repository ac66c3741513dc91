"""The CPU engine: tiled FlashAttention-2 on PyTorch tensor ops (MKL GEMMs, vectorised exp2).

Launcher layer: splits a call into per-sequence problems (:class:`~.tiles.SequenceProblem`), picks
the tile configuration, allocates outputs in the user's layout and hands canonical strided views to
the kernels in :mod:`.kernels`. Threads: PyTorch's intra-op pool parallelises every tile operation
over the cores (no nested pools, so no oversubscription).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...dispatch import Backend, register
from ...spec import AttentionInputs, empty_in_layout
from . import kernels
from .tiles import SequenceProblem


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int

    def working_set_bytes(self, group: int, head_dim: int, head_dim_v: int, heads_kv: int, itemsize: int = 4) -> int:
        """Bytes touched per tile step: the score tile plus q, k, v and accumulator blocks."""
        rows = group * self.block_m
        per_head = rows * self.block_n + rows * (head_dim + 2 * head_dim_v) + self.block_n * (head_dim + head_dim_v)
        return per_head * heads_kv * itemsize


def default_config(inp: AttentionInputs) -> TileConfig:
    from ...tuning import lookup

    tuned = lookup("cpu", inp)
    if tuned is not None:
        return TileConfig(int(tuned["block_m"]), int(tuned["block_n"]))
    block_m = max(16, 256 // inp.group_size)
    return TileConfig(block_m=block_m, block_n=256)


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
                q=q, k=k.to(cdt), v=v.to(cdt), scale=inp.scale, left=left, right=right,
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
        for b, rows, prob in self._problems(inp):
            if inp.is_varlen:
                o, l = out_c[rows].transpose(0, 1), lse[:, rows]
            else:
                o, l = out_c[b], lse[b]
            kernels.forward(prob, o, l, cfg.block_m, cfg.block_n)
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
        for b, rows, prob in self._problems(inp):
            if inp.is_varlen:
                sel = lambda t: t[rows].transpose(0, 1)  # noqa: E731
                ksel = slice(inp.cu_seqlens_k[b].item(), inp.cu_seqlens_k[b + 1].item())
                args = (sel(out_c), sel(dout_c), lse[:, rows], sel(dq_c),
                        dk_c[ksel].transpose(0, 1), dv_c[ksel].transpose(0, 1))
            else:
                args = (out_c[b], dout_c[b], lse[b], dq_c[b], dk_c[b], dv_c[b])
            db = None if dbias is None else dbias[b if dbias.shape[0] > 1 else 0]
            kernels.backward(prob, *args, db, cfg.block_m, cfg.block_n)
        if dbias is not None:
            dbias = dbias.reshape(inp.bias.shape).to(inp.bias.dtype)
        return dq, dk.to(inp.dtype), dv.to(inp.dtype), dbias


def _batch_item(x, b):
    """Batch item ``b`` of a (B?, H?, Sq?, Sk?) broadcastable tensor as (H?, Sq?, Sk?)."""
    if x is None:
        return None
    x4 = x.reshape((1,) * (4 - x.dim()) + tuple(x.shape)) if x.dim() < 4 else x
    return x4[b if x4.shape[0] > 1 else 0]


register(CpuBackend())
