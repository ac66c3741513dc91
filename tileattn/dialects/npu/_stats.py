"""torch_npu's softmax statistics (``softmax_max``, ``softmax_sum``) from and to tileattn's LSE.

Both are fp32 with a last dim of 8 (the value repeated: one 32-byte block). Padded layouts:
(B, N, Sq, 8). TND: a tensor of shape (T, N, 8) whose memory holds, by default, each sequence's
rows head-major, ``[b][n][t_local][8]`` (the "NTD" order the FlashAttentionVarLenScore kernel
writes, and that MindSpeed's ``flatten_softmax`` and the RingAttentionUpdate kernel read);
``softmax_layout="TND"`` asks for plain T-major ``[t][n][8]``. Rows past the last sequence
(batches left out with trailing zeros in ``actual_seq_qlen``) follow in T-major order.
"""

from __future__ import annotations

from typing import List, Optional

import torch


def _ntd_positions(cu_q: List[int], heads: int, total: int, device) -> torch.Tensor:
    """(N, T) flat row index (in units of 8-blocks) of each (head, token) in the "NTD" order."""
    lens = torch.tensor([b - a for a, b in zip(cu_q, cu_q[1:])], device=device)
    starts = torch.tensor(cu_q[:-1], device=device)
    used = cu_q[-1]
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)
    t = torch.arange(used, device=device)
    local = t - starts[seq]
    n = torch.arange(heads, device=device)[:, None]
    pos = starts[seq][None] * heads + n * lens[seq][None] + local[None]
    if total > used:
        tail = torch.arange(used, total, device=device)
        pos = torch.cat([pos, tail[None] * heads + n], 1)
    return pos


def _expand8(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(-1).expand(*t.shape, 8).contiguous()


def stats_from_lse(lse, rmax, layout: str, softmax_layout: str, cu_q: Optional[List[int]]):
    """``(softmax_max, softmax_sum)`` from the LSE and row maximum (tileattn LSE shapes).
    Rows that see no key: max -inf, sum 0 (with a sink: max = sink, sum 1)."""
    lse, rmax = lse.detach().float(), rmax.detach().float()
    dead = torch.isneginf(rmax)
    total = torch.where(dead, torch.zeros_like(lse), torch.exp(lse - torch.where(dead, torch.zeros_like(rmax), rmax)))
    if layout != "TND":
        return _expand8(rmax), _expand8(total)
    heads, rows = lse.shape
    if softmax_layout == "TND":
        return _expand8(rmax.transpose(0, 1)), _expand8(total.transpose(0, 1))
    pos = _ntd_positions(cu_q, heads, rows, lse.device).flatten()
    out = []
    for t in (rmax, total):
        flat = torch.empty(rows * heads, dtype=torch.float32, device=lse.device)
        flat[pos] = t.flatten()
        out.append(_expand8(flat.view(rows, heads)))
    return tuple(out)


def lse_from_stats(softmax_max, softmax_sum, layout: str, softmax_layout: str, cu_q: Optional[List[int]]):
    """tileattn's LSE ((B, N, Sq) or (N, T)) from torch_npu's statistics: ``max + log(sum)``."""
    lse = softmax_max[..., 0].float() + torch.log(softmax_sum[..., 0].float())
    if layout != "TND":
        return lse
    rows, heads = lse.shape
    if softmax_layout == "TND":
        return lse.transpose(0, 1)
    pos = _ntd_positions(cu_q, heads, rows, lse.device)
    return lse.flatten()[pos]
