"""Merging partial attention results by their statistics, as sequence-parallel Ascend code does:
``npu_attention_update`` (torch_npu, per-row LSEs) and ``npu_ring_attention_update`` (MindSpeed's
ring-attention merge of ``softmax_max``/``softmax_sum`` pairs). Both are
:func:`tileattn.merge_attentions` under the torch_npu shapes; rows that no part sees give output 0
(torch_npu's formula divides 0 by 0 there)."""

from __future__ import annotations

import torch

from ...core.layouts import LAYOUT
from ...core.merge import merge_attentions
from ._common import NpuTypeError, check_layout, check_tensor, core_errors, fail, int_list
from .install import beside_stand_in
from ._stats import lse_from_stats, stats_from_lse

__all__ = ["npu_attention_update", "npu_ring_attention_update"]

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@beside_stand_in
def npu_attention_update(lse, local_out, update_type=0):
    """torch_npu's AttentionUpdate: ``lse`` is a list of fp32 (R,) LSEs, ``local_out`` the matching
    list of (R, D) partial outputs (R = batch * seq * heads rows). Returns ``(out, lse_out)``:
    ``out = sum_i exp(lse_i - lse_out) * out_i`` in ``local_out``'s dtype and, with
    ``update_type=1``, ``lse_out = logsumexp_i lse_i`` (None with ``update_type=0``)."""
    fn = "npu_attention_update"
    if not isinstance(lse, (list, tuple)) or not isinstance(local_out, (list, tuple)) or not lse:
        fail(fn, "lse/local_out", f"{type(lse).__name__}/{type(local_out).__name__}",
             "two non-empty lists of tensors", NpuTypeError)
    if len(lse) != len(local_out):
        fail(fn, "local_out", f"{len(local_out)} tensors for {len(lse)} lse", "one partial output per lse")
    if isinstance(update_type, bool) or update_type not in (0, 1):
        fail(fn, "update_type", repr(update_type), "0 (no lse_out) or 1 (also return lse_out)")
    for i, (l, o) in enumerate(zip(lse, local_out)):
        check_tensor(fn, f"lse[{i}]", l, 1, (torch.float32, torch.float64), " of shape (rows,)")
        check_tensor(fn, f"local_out[{i}]", o, 2, _OUT_DTYPES, " of shape (rows, head_dim)")
        if l.shape[0] != lse[0].shape[0] or tuple(o.shape) != (lse[0].shape[0], local_out[0].shape[1]) \
                or o.dtype != local_out[0].dtype:
            fail(fn, f"lse[{i}]/local_out[{i}]", f"shapes {tuple(l.shape)}/{tuple(o.shape)}, dtype {o.dtype}",
                 f"({lse[0].shape[0]},)/{(lse[0].shape[0], local_out[0].shape[1])} in {local_out[0].dtype}, as the "
                 "first part")
    with core_errors(fn):
        out, merged = merge_attentions([o[None, None] for o in local_out], [l[None, None] for l in lse],
                                       layout="BNSD", out_dtype=local_out[0].dtype)
    return out[0, 0], (merged[0, 0].to(lse[0].dtype) if update_type == 1 else None)


@beside_stand_in
def npu_ring_attention_update(prev_attn_out, prev_softmax_max, prev_softmax_sum, cur_attn_out, cur_softmax_max,
                              cur_softmax_sum, actual_seq_qlen=None, layout="SBH", softmax_layout=""):
    """MindSpeed's RingAttentionUpdate: merge two partial attentions by their statistics.

    ``layout="SBH"``: outputs (S, B, H), statistics (B, N, S, 8). ``layout="TND"``: outputs
    (T, N, D), statistics (T, N, 8) in npu_fusion_attention's order (``softmax_layout`` as there),
    ``actual_seq_qlen`` the cumulative query offsets starting at 0 ([0, ..., T], an int tensor or
    list). Returns ``(attn_out, softmax_max, softmax_sum)`` with ``softmax_max`` the elementwise
    maximum and ``softmax_sum`` rescaled to it, as the reference formula gives.
    """
    fn = "npu_ring_attention_update"
    layout = check_layout(fn, "layout", layout, ("SBH", "TND"))
    if softmax_layout not in ("", "TND"):
        fail(fn, "softmax_layout", repr(softmax_layout), "'' (torch_npu's default order) or 'TND'")
    outs = (("prev_attn_out", prev_attn_out), ("cur_attn_out", cur_attn_out))
    stats = (("prev_softmax_max", prev_softmax_max), ("prev_softmax_sum", prev_softmax_sum),
             ("cur_softmax_max", cur_softmax_max), ("cur_softmax_sum", cur_softmax_sum))
    for name, t in outs:
        check_tensor(fn, name, t, 3, _OUT_DTYPES, f" in layout {layout}")
        if t.shape != prev_attn_out.shape or t.dtype != prev_attn_out.dtype:
            fail(fn, name, f"shape {tuple(t.shape)}, dtype {t.dtype}", "the shape and dtype of prev_attn_out")
    if not LAYOUT[layout].packed:  # SBH
        s, b, h = prev_attn_out.shape
        heads = prev_softmax_max.shape[1] if isinstance(prev_softmax_max, torch.Tensor) else 0
        shape = (b, heads, s, 8)
        if heads == 0 or h % heads:
            fail(fn, "prev_softmax_max", getattr(prev_softmax_max, "shape", prev_softmax_max),
                 f"(B, N, S, 8) with N dividing the hidden size {h}")
    else:
        t_rows, heads, _ = prev_attn_out.shape
        shape = (t_rows, heads, 8)
    for name, t in stats:
        check_tensor(fn, name, t, len(shape), (torch.float32,), f" of shape {shape}")
        if tuple(t.shape) != shape:
            fail(fn, name, f"shape {tuple(t.shape)}", f"{shape}")
    cu = None
    if layout == "TND":
        cu = int_list(fn, "actual_seq_qlen", actual_seq_qlen)
        if not cu or cu[0] != 0 or cu[-1] != prev_attn_out.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
            fail(fn, "actual_seq_qlen", cu, f"cumulative query offsets from 0 to T={prev_attn_out.shape[0]} "
                 "(e.g. [0, 3, 7]), required for layout='TND'")
    with core_errors(fn):
        lses = [lse_from_stats(m, s_, layout, softmax_layout, cu)
                for m, s_ in ((prev_softmax_max, prev_softmax_sum), (cur_softmax_max, cur_softmax_sum))]
        out, lse = merge_attentions([prev_attn_out, cur_attn_out], lses, layout=layout, out_dtype=prev_attn_out.dtype)
        rmax = lse_from_stats(torch.maximum(prev_softmax_max, cur_softmax_max), torch.ones_like(prev_softmax_sum),
                              layout, softmax_layout, cu)
    softmax_max, softmax_sum = stats_from_lse(lse, rmax, layout, softmax_layout, cu)
    return out, softmax_max, softmax_sum
