"""The graph-mode entry points of torch_npu's FusedInferAttentionScore, which serving code (vllm-ascend's
ACL-graph capture and update paths) calls instead of the ops themselves:

* ``npu_fused_infer_attention_score.out(query, key, value, *, <the op's keywords>, workspace=None,
  out=[attention_out, softmax_lse])`` and ``npu_fused_infer_attention_score_v2.out(...)``: the op,
  its result written into the caller's tensors, which are returned. ``out`` may also be given as
  ``attention_out=``/``softmax_lse=`` (the schema's names). ``attention_out`` must have the result's
  shape and the query's dtype; ``softmax_lse`` is written only when the LSE is asked for
  (``softmax_lse_flag``/``return_softmax_lse``), then fp32 of the LSE's shape, else it may be any
  tensor (a (1,) placeholder, as serving code passes) and is left as it is. Everything is checked
  before anything is written.
* ``_npu_fused_infer_attention_score_get_max_workspace(...)`` and ``_v2``: the op's arguments
  checked as the op checks them (the core's checks included), nothing computed; the workspace is an
  empty tensor of the query's dtype and device (tileattn needs none), which ``.out`` accepts.
* ``_npu_fused_infer_attention_score_infer_output(query, value, ...)`` and ``_v2``: uninitialised
  ``(attention_out, softmax_lse)`` shaped as the op's results (``softmax_lse`` (0,) fp32 without the
  LSE flag), to pass to ``.out``.

A graph captured on an NPU replays the recorded kernels; here every call computes, so a captured
"replay" is a plain call with the current arguments.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ...core.layouts import LAYOUT
from ._common import NpuTypeError, check_layout, check_tensor, fail, is_int, refuse
from .inference import (
    INPUT_LAYOUTS, _flag, _output_shapes, fused_v1, fused_v2, io_layouts, npu_fused_infer_attention_score,
    npu_fused_infer_attention_score_v2,
)
from .install import beside_stand_in

__all__ = ["_npu_fused_infer_attention_score_get_max_workspace",
           "_npu_fused_infer_attention_score_v2_get_max_workspace",
           "_npu_fused_infer_attention_score_infer_output", "_npu_fused_infer_attention_score_v2_infer_output"]


@functools.lru_cache(maxsize=None)
def _signature(op):
    return inspect.signature(op)


def _arguments(op, fn, query, key, value, kwargs) -> dict:
    """The op's arguments by name, defaults filled in; an unknown or missing one is a TypeError naming it."""
    try:
        bound = _signature(op).bind(query, key, value, **kwargs)
    except TypeError as e:
        raise NpuTypeError(f"tileattn.npu.{fn}: {e}") from None
    bound.apply_defaults()
    return dict(bound.arguments)


def _outs(fn, out, attention_out, softmax_lse):
    """The two output tensors, given as ``out=[attention_out, softmax_lse]`` or by name."""
    if out is not None:
        if attention_out is not None or softmax_lse is not None:
            fail(fn, "out", "out together with attention_out/softmax_lse", "one of the two forms", NpuTypeError)
        if not isinstance(out, (list, tuple)) or len(out) != 2:
            fail(fn, "out", f"{type(out).__name__} of {len(out) if isinstance(out, (list, tuple)) else '?'}",
                 "a list [attention_out, softmax_lse]", NpuTypeError)
        return tuple(out)
    if attention_out is None or softmax_lse is None:
        fail(fn, "out", None, "out=[attention_out, softmax_lse] (or attention_out= and softmax_lse=)", NpuTypeError)
    return attention_out, softmax_lse


def _check_workspace(fn, workspace):
    if workspace is not None and not isinstance(workspace, torch.Tensor):
        fail(fn, "workspace", type(workspace).__name__, "None or the tensor _get_max_workspace returned",
             NpuTypeError)


def _out_overload(op, run):
    name = f"{op.__name__}.out"

    def out_overload(query, key, value, *, workspace=None, out=None, attention_out=None, softmax_lse=None, **kwargs):
        outs = _outs(name, out, attention_out, softmax_lse)
        _check_workspace(name, workspace)
        return run(_arguments(op, name, query, key, value, kwargs), fn=name, out=outs)

    out_overload.__name__, out_overload.__qualname__ = "out", name
    out_overload.__doc__ = (f"torch_npu's ``{name}``: :func:`{op.__name__}` written into ``out=[attention_out, "
                            "softmax_lse]`` (see :mod:`tileattn.npu.graph`).")
    return beside_stand_in(out_overload)


npu_fused_infer_attention_score.out = _out_overload(npu_fused_infer_attention_score, fused_v1)
npu_fused_infer_attention_score_v2.out = _out_overload(npu_fused_infer_attention_score_v2, fused_v2)


def _workspace(op, run, fn, query, key, value, kwargs):
    run(_arguments(op, fn, query, key, value, kwargs), fn=fn, dry_run=True)
    return query.new_empty(0)


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs):
    """The workspace of :func:`npu_fused_infer_attention_score` with these arguments (checked as the op
    checks them): an empty tensor, as tileattn needs none."""
    return _workspace(npu_fused_infer_attention_score, fused_v1, "_npu_fused_infer_attention_score_get_max_workspace",
                      query, key, value, kwargs)


def _npu_fused_infer_attention_score_v2_get_max_workspace(query, key, value, **kwargs):
    """As :func:`_npu_fused_infer_attention_score_get_max_workspace`, for the v2 op."""
    return _workspace(npu_fused_infer_attention_score_v2, fused_v2,
                      "_npu_fused_infer_attention_score_v2_get_max_workspace", query, key, value, kwargs)


def _empty_outputs(fn, query, value, input_layout, block_table, heads, kv_heads, want_lse, heads_name):
    check_tensor(fn, "query", query, None)
    check_tensor(fn, "value", value, None, None)
    layout = check_layout(fn, "input_layout", input_layout, INPUT_LAYOUTS)
    if not is_int(heads) or heads < 1:
        fail(fn, heads_name, repr(heads), "an int >= 1")
    if not is_int(kv_heads) or kv_heads < 0:
        fail(fn, "num_key_value_heads", repr(kv_heads), "an int >= 0 (0 = the query's heads)")
    expected = LAYOUT[io_layouts(layout)[0]].rank
    if query.dim() != expected or value.dim() not in (3, 4):
        fail(fn, "query/value", f"{query.dim()}-d/{value.dim()}-d tensors",
             f"a {expected}-d query and a 3- or 4-d value in input_layout '{layout}'")
    out_shape, lse_shape = _output_shapes(query, value, layout, block_table is not None, heads, kv_heads or heads)
    out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
    lse = torch.empty(lse_shape if want_lse else (0,), dtype=torch.float32, device=query.device)
    return out, lse


def _npu_fused_infer_attention_score_infer_output(query, value, *, input_layout="BSH", quant_scale2=None,
                                                  block_table=None, num_heads=1, num_key_value_heads=0,
                                                  softmax_lse_flag=False, query_rope=None):
    """Uninitialised ``(attention_out, softmax_lse)`` of :func:`npu_fused_infer_attention_score` with
    this query, value and layout, for its ``.out`` overload."""
    fn = "_npu_fused_infer_attention_score_infer_output"
    if quant_scale2 is not None:
        refuse(fn, "argument 'quant_scale2' (int8 output quantisation)", "quantise after the call")
    return _empty_outputs(fn, query, value, input_layout, block_table, num_heads, num_key_value_heads,
                          _flag(fn, "softmax_lse_flag", softmax_lse_flag), "num_heads")


def _npu_fused_infer_attention_score_v2_infer_output(query, value, *, query_dtype=None, value_dtype=None,
                                                     input_layout="BSH", quant_scale_out=None, block_table=None,
                                                     num_query_heads=1, num_key_value_heads=0,
                                                     return_softmax_lse=False, query_rope=None, out_dtype=None):
    """As :func:`_npu_fused_infer_attention_score_infer_output`, for the v2 op (``query_dtype`` and
    ``value_dtype`` are reserved in torch_npu and have no effect)."""
    fn = "_npu_fused_infer_attention_score_v2_infer_output"
    if quant_scale_out is not None or out_dtype is not None:
        refuse(fn, "arguments 'quant_scale_out'/'out_dtype' (quantised output)", "quantise after the call")
    return _empty_outputs(fn, query, value, input_layout, block_table, num_query_heads, num_key_value_heads,
                          _flag(fn, "return_softmax_lse", return_softmax_lse), "num_query_heads")
