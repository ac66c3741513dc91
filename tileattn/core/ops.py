"""The attention operator as ``torch.library`` custom ops, with autograd.

``tileattn::attention_forward`` and ``tileattn::attention_backward`` are opaque to ``torch.compile``
and ``torch.export`` (fake implementations give their output shapes, and FakeTensorMode's), so a
compiled graph calls each as one node with no graph break. Autograd is registered on the forward
op: it saves only q, k, v, the modifier tensors, out and the LSE (a dropout mask is regenerated
from its seed, never stored) and calls the backward op, whose own autograd raises a clear error
(no double backward). Both outputs are differentiable: a gradient reaching the LSE enters the
backward as ``delta = rowsum(dout * out) - dlse``.

A spec crosses the op boundary through one pair of functions, :func:`pack` and :func:`unpack`;
nothing else counts argument slots. ``unpack`` does not validate again: the spec was validated once,
before the op. The bias and the sinks are separate op arguments because autograd only sees tensors
passed directly; every other tensor travels in one list.

Above the engines, here and once for all of them: the output is allocated in the user's layout
(fp32 for partial results), sinks are merged into (out, LSE), the bias gradient is reduced to the
bias's shape, ``delta`` is computed, ``dsinks`` follows from it, and an engine reading memory is
given only tensors that have some (:func:`check_memory`).

A call with user functions (``score_mod``, ``mask_mod``, :mod:`tileattn.core.functions`) cannot
cross a ``torch.library`` boundary (an op takes no Python function): it runs as
:class:`UserFunctionAttention`, an autograd function whose inputs are also the tensors the functions
capture, so their gradients (a learned bias table, per-head scales) come back like the bias's.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import fields
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .dispatch import Backend, Gradients, get_backend
from .engine import WITH_MEMORY, storage_problem
from .layouts import LAYOUT, empty_in_layout, to_canonical
from .merge import merge_weights
from .modifiers import Modifier, fail, modifier_type
from .score_math import reduce_to_shape
from .spec import AttentionSpec, check_sequence_values, tracing

#: The op arguments of a modifier's one differentiable tensor (autograd only sees tensors passed
#: directly): :attr:`tileattn.core.modifiers.Modifier.grad_slot`.
_GRAD_SLOTS = ("bias", "sinks")
_SEQUENCE_TENSORS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table")


_FLAT: Dict[type, tuple] = {}


def _flat_fields(cls) -> tuple:
    """((name, op kind), ...) of a modifier type's fields. Dynamo takes the answer as a constant:
    it reads no field of a class, nor (once the traced model mutated a dict) the fields' metadata."""
    layout = _FLAT.get(cls)
    if layout is None:
        layout = _FLAT[cls] = tuple((f.name, f.metadata["op"]) for f in fields(cls))
    return layout


# What torch._dynamo.assume_constant_result does, without importing Dynamo (3 s) into every process
# that imports tileattn: the mark Dynamo reads when it meets the function in a compiled frame.
# tests/test_compile.py checks that the decorator still sets exactly this mark.
_flat_fields._dynamo_marked_constant = True


def _format_names() -> tuple:
    """The KV formats by index: a format's name travels through the op as an int (imported here, on
    a quantised call only: kvformat sits above this module's imports)."""
    from .kvformat import FORMATS

    return tuple(FORMATS)


def flatten(modifier: Modifier) -> Tuple[list, list, list]:
    """(tensors, ints, floats) of a modifier, in field order."""
    tensors, ints, floats = [], [], []
    for name, op in _flat_fields(type(modifier)):
        value = getattr(modifier, name)
        if op == "tensor":
            tensors.append(value)
        elif op == "int":
            ints.append(value)
        elif op == "opt_int":
            ints.append(-1 if value is None else value)
        elif op == "format":
            ints.append(-1 if value is None else _format_names().index(value))
        else:
            floats.append(value)
    return tensors, ints, floats


def unflatten(kind: str, tensors, ints, floats) -> Modifier:
    """Rebuild a modifier of ``kind`` from iterators over the op's tensors, ints and floats."""
    cls = modifier_type(kind)
    values = {}
    for name, op in _flat_fields(cls):
        if op == "tensor":
            values[name] = next(tensors)
        elif op == "int":
            values[name] = next(ints)
        elif op == "opt_int":
            value = next(ints)
            values[name] = None if value < 0 else value
        elif op == "format":
            value = next(ints)
            values[name] = None if value < 0 else _format_names()[value]
        else:
            values[name] = next(floats)
    return cls(**values)


def pack(spec: AttentionSpec, backend: str, partial: bool) -> tuple:
    """The op arguments of a call: ``(q, k, v, bias, sinks, extras, ints, floats, config)``."""
    extras = [getattr(spec, name) for name in _SEQUENCE_TENSORS]
    align = spec.align if isinstance(spec.align, int) else 0
    ints = [spec.heads_q, spec.seqlen_q, spec.seqlen_k, int(spec.deterministic), align]
    floats = [spec.scale]
    own = {slot: None for slot in _GRAD_SLOTS}
    for m in spec.modifiers:
        tensors, mi, mf = flatten(m)
        if m.grad_slot is not None:
            own[m.grad_slot] = tensors[0]
        else:
            extras += tensors
        ints += mi
        floats += mf
    align_name = spec.align if isinstance(spec.align, str) else "offset"
    # A spec built while tracing has unchecked sequence data: the op checks it.
    traced = "traced" if tracing() and _has_sequence_data(spec) else "checked"
    config = "|".join((spec.layout, align_name, ",".join(spec.kinds), backend, "partial" if partial else "full",
                       traced))
    return (spec.q, spec.k, spec.v, own["bias"], own["sinks"], extras, ints, floats, config)


def _has_sequence_data(spec: AttentionSpec) -> bool:
    return any(getattr(spec, name) is not None for name in _SEQUENCE_TENSORS)


@functools.lru_cache(maxsize=256)
def _parse_config(config: str):
    layout, align_name, kinds, backend, kind, traced = config.split("|")
    return layout, align_name, tuple(k for k in kinds.split(",") if k), backend, kind == "partial", traced == "traced"


def unpack(q, k, v, bias, sinks, extras, ints, floats, config) -> Tuple[AttentionSpec, str, bool, bool]:
    """The spec, backend name, partial flag and whether the sequence data is still unchecked (the
    spec was built while torch.compile traced), from :func:`pack`'s arguments. No validation."""
    layout, align_name, kinds, backend, partial, traced = _parse_config(config)
    cu_q, cu_k, seqused_k, block_table = extras[:4]
    heads_q, seqlen_q, seqlen_k, deterministic, align = ints[:5]
    tensors, int_values, float_values = iter(extras[4:]), iter(ints[5:]), iter(floats[1:])
    own = {"bias": bias, "sinks": sinks}
    modifiers = []
    for kind in kinds:
        slot = modifier_type(kind).grad_slot
        modifiers.append(unflatten(kind, iter([own[slot]]) if slot is not None else tensors, int_values, float_values))
    modifiers = tuple(modifiers)
    q_c = to_canonical(q, layout, heads_q)
    kv_layout = "paged" if block_table is not None else layout
    heads_kv = k.shape[2] // q_c.shape[-1] if LAYOUT[kv_layout].fused else None
    k_c, v_c = to_canonical(k, kv_layout, heads_kv), to_canonical(v, kv_layout, heads_kv)
    batch = cu_q.numel() - 1 if layout == "TND" else q_c.shape[0]
    spec = AttentionSpec(
        q=q, k=k, v=v, layout=layout, heads_q=heads_q, heads_kv=k_c.shape[1], batch=batch, seqlen_q=seqlen_q,
        seqlen_k=seqlen_k, head_dim=q_c.shape[-1], head_dim_v=v_c.shape[-1], scale=floats[0],
        align=align if align_name == "offset" else align_name, modifiers=modifiers, cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k, seqused_k=seqused_k, block_table=block_table, deterministic=bool(deterministic),
        q_c=q_c, k_c=k_c, v_c=v_c,
    )
    return spec, backend, partial, traced


def _lse_heads_axis(spec: AttentionSpec) -> int:
    return 0 if spec.is_varlen else 1


def _rows_to_lse(x: Tensor, spec: AttentionSpec) -> Tensor:
    """A canonical (B, H, S, ...) or (T, H, ...) row-wise tensor reduced to lse layout."""
    return x.transpose(0, 1) if spec.is_varlen else x


def _autocast_off(device: torch.device):
    """Engines compute in the inputs' dtype (accumulating in fp32): an autocast region around the
    call must not lower their internal matmuls. Dialects that follow autocast cast the inputs first."""
    if device.type in ("cpu", "cuda") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


#: The tensors of a spec an engine reads (besides the modifiers' kernel arguments), by argument name.
_READ_TENSORS = ("q", "k", "v") + _SEQUENCE_TENSORS
_functorch_interpreter = torch._C._functorch.peek_interpreter_stack


def check_memory(spec: AttentionSpec, engine: Backend, *named: Tuple[str, Optional[Tensor]]) -> None:
    """Every tensor ``engine`` reads has memory, or a TypeError naming it before any pointer is read
    (:attr:`Backend.reads_memory`): q, k, v, the sequence tensors, the modifiers' kernel arguments
    and ``named`` (a backward pass's). A traced call never gets here with such tensors (the op's
    fake kernel answers it); this is for those that reach a real engine anyway (a wrapper subclass
    whose dispatch hands itself on, a FakeTensor given to an engine directly, a vmap's tensor).

    Outside torch.func's transforms a plain tensor has memory (a meta one never reaches such an
    engine: dispatch refuses its device), so the common call costs a type check per tensor; inside
    them, and for any subclass, :func:`tileattn.core.engine.storage_problem` asks."""
    if not engine.reads_memory:
        return
    transformed = _functorch_interpreter() is not None
    for i, t in enumerate((spec.q, spec.k, spec.v, spec.cu_seqlens_q, spec.cu_seqlens_k, spec.seqused_k,
                           spec.block_table)):
        if t is not None and (transformed or type(t) is not Tensor):
            _require_memory(_READ_TENSORS[i], t, engine)
    args = spec.kernel_args
    if args.per_call or named:
        for name, t in tuple((n, getattr(args, n)) for n in args.per_call) + named:
            if isinstance(t, Tensor) and (transformed or type(t) is not Tensor):  # per_call names the seed, an int
                _require_memory(name, t, engine)


def _require_memory(name: str, t: Tensor, engine: Backend) -> None:
    problem = storage_problem(t)
    if problem is not None:
        fail(TypeError, name, problem, f"{WITH_MEMORY}, for the {engine.name!r} engine")


def run_forward(spec: AttentionSpec, engine: Backend, partial: bool) -> Tuple[Tensor, Tensor]:
    """(out in the user's layout, LSE): the engine's result with the sinks merged in."""
    check_memory(spec, engine)
    merged_above = [m for m in spec.modifiers if m.applied_by_op] if spec.modifiers else ()
    acc = spec.acc_dtype()
    out_dtype = acc if (partial or merged_above) else spec.dtype
    out, out_c = empty_in_layout(spec.layout, spec.batch, spec.heads_q, spec.rows_q, spec.head_dim_v, out_dtype,
                                 spec.device)
    lse = torch.empty(spec.lse_shape(), dtype=acc, device=spec.device)
    if out.numel():
        with _autocast_off(spec.device):
            engine.forward(spec.for_engines() if merged_above else spec, out_c, lse)
    elif lse.numel():
        lse.fill_(-math.inf)
    for m in merged_above:
        # A sink is an extra logit with no value: merging (out, lse) with the empty partial result
        # (0, sink) rescales the output by its merge weight.
        (weight, _), lse = merge_weights(lse, m.extra_logits(lse, _lse_heads_axis(spec)))
        out_c.mul_(_lse_to_rows(weight, spec))
    if merged_above:
        if not partial:
            out = out.to(spec.dtype)
    return out, lse


def _lse_to_rows(x: Tensor, spec: AttentionSpec) -> Tensor:
    """An lse-shaped tensor as a canonical row-wise factor (…, S, 1) / (T, H, 1)."""
    return (x.transpose(0, 1) if spec.is_varlen else x).unsqueeze(-1)


def run_backward(spec: AttentionSpec, engine: Backend, dout: Tensor, dlse: Optional[Tensor], out: Tensor,
                 lse: Tensor, need_dbias: bool, captures: tuple = ()
                 ) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], list]:
    """(dq, dk, dv, dbias or None, dsinks or None, [gradient of each of ``captures``]) for the output
    gradient ``dout`` (and ``dlse``); ``captures``: the score_mod's captured tensors that need one
    (:attr:`tileattn.core.functions.UserFunction.grad_captures`)."""
    check_memory(spec, engine, ("dout", dout), ("out", out), ("lse", lse), ("dlse", dlse))
    acc = spec.acc_dtype()
    out_c = to_canonical(out, spec.layout, spec.heads_q)
    dout_c = to_canonical(dout, spec.layout, spec.heads_q)
    delta = _rows_to_lse((dout_c.to(acc) * out_c.to(acc)).sum(-1), spec)
    if dlse is not None:
        dlse = dlse.to(acc)
        delta = delta - dlse
    if dout.dtype != spec.dtype:
        # A partial result's output (and so its gradient) is fp32; engines take dO in the input dtype.
        dout_c = dout_c.to(spec.dtype)
    dq = torch.empty(spec.q.shape, dtype=spec.dtype, device=spec.device)
    dk = torch.empty(spec.k.shape, dtype=spec.dtype, device=spec.device)
    dv = torch.empty(spec.v.shape, dtype=spec.dtype, device=spec.device)
    bias = next((m for m in spec.modifiers if m.grad_slot == "bias"), None)
    dbias4 = torch.zeros(bias.view4.shape, dtype=acc, device=spec.device) if need_dbias else None
    dcaptures = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in captures]
    grads = Gradients(out=out_c, dout=dout_c, lse=lse, delta=delta, dlse=dlse,
                      dq=to_canonical(dq, spec.layout, spec.heads_q), dk=to_canonical(dk, spec.layout, spec.heads_kv),
                      dv=to_canonical(dv, spec.layout, spec.heads_kv), dbias=dbias4, captures=dcaptures)
    if dq.numel() and dk.numel():
        with _autocast_off(spec.device):
            engine.backward(spec.for_engines(), grads)
    else:
        dq.zero_(), dk.zero_(), dv.zero_()
    dbias = reduce_to_shape(dbias4, bias.tensor.shape).to(bias.tensor.dtype) if need_dbias else None
    dsinks = None
    for m in spec.modifiers:
        if m.applied_by_op:
            dsinks = m.result_grad(lse.to(acc), delta, _lse_heads_axis(spec))
    return dq, dk, dv, dbias, dsinks, [g.to(t.dtype) for g, t in zip(dcaptures, captures)]


def grad_captures(spec: AttentionSpec) -> tuple:
    """The tensors the call's score_mod captures that require grad (none without one)."""
    return next((m.user.grad_captures for m in spec.modifiers if m.grad_slot == "captures"), ())


class UserFunctionAttention(torch.autograd.Function):
    """A call with user functions: ``(out, lse)`` of ``spec`` on ``engine``, differentiable in q, k, v,
    the bias, the sinks and the captured tensors (the trailing inputs, :func:`grad_captures`)."""

    @staticmethod
    def forward(ctx, spec, engine, partial, q, k, v, bias, sinks, *captures):
        out, lse = run_forward(spec, engine, partial)
        ctx.spec, ctx.engine = spec, engine
        ctx.save_for_backward(out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out, lse = ctx.saved_tensors
        spec = ctx.spec
        need_dbias = ctx.needs_input_grad[6]
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        with torch.no_grad():
            dq, dk, dv, dbias, dsinks, dcaptures = run_backward(spec, ctx.engine, dout, dlse, out, lse, need_dbias,
                                                                grad_captures(spec))
        return (None, None, None, dq, dk, dv, dbias if need_dbias else None,
                dsinks if ctx.needs_input_grad[7] else None, *dcaptures)


@torch.library.custom_op("tileattn::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], sinks: Optional[Tensor],
                      extras: List[Optional[Tensor]], ints: List[int], floats: List[float],
                      config: str) -> Tuple[Tensor, Tensor]:
    spec, backend, partial, traced = unpack(q, k, v, bias, sinks, extras, ints, floats, config)
    if traced:
        spec = check_sequence_values(spec)
    out, lse = run_forward(spec, get_backend(backend), partial)
    return out, lse


@attention_forward.register_fake
def _(q, k, v, bias, sinks, extras, ints, floats, config):
    spec, _, partial, _ = unpack(q, k, v, bias, sinks, extras, ints, floats, config)
    out_dtype = spec.acc_dtype() if partial else spec.dtype
    return q.new_empty(spec.out_shape(), dtype=out_dtype), q.new_empty(spec.lse_shape(), dtype=spec.acc_dtype())


@torch.library.custom_op("tileattn::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, dlse: Optional[Tensor], out: Tensor, lse: Tensor, q: Tensor, k: Tensor,
                       v: Tensor, bias: Optional[Tensor], sinks: Optional[Tensor], extras: List[Optional[Tensor]],
                       ints: List[int], floats: List[float], config: str,
                       need_dbias: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    spec, backend, _, traced = unpack(q, k, v, bias, sinks, extras, ints, floats, config)
    if traced:
        spec = check_sequence_values(spec)
    dq, dk, dv, dbias, dsinks, _ = run_backward(spec, get_backend(backend), dout, dlse, out, lse, need_dbias)
    # Absent gradients come back as fresh empty tensors: outputs of an op must not alias each other.
    return (dq, dk, dv, q.new_empty((0,)) if dbias is None else dbias,
            q.new_empty((0,)) if dsinks is None else dsinks)


@attention_backward.register_fake
def _(dout, dlse, out, lse, q, k, v, bias, sinks, extras, ints, floats, config, need_dbias):
    dbias = bias.new_empty(bias.shape) if need_dbias else q.new_empty((0,))
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, bias, sinks, extras, ints, floats, config = inputs
    out, lse = output
    ctx.extras_present = [t is not None for t in extras]
    ctx.save_for_backward(q, k, v, bias, sinks, out, lse, *(t for t in extras if t is not None))
    ctx.ints, ctx.floats, ctx.config = ints, floats, config


def _backward(ctx, dout, dlse):
    q, k, v, bias, sinks, out, lse, *present = ctx.saved_tensors
    present = iter(present)
    extras = [next(present) if p else None for p in ctx.extras_present]
    need_dbias = bias is not None and ctx.needs_input_grad[3]
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    dq, dk, dv, dbias, dsinks = attention_backward(dout, dlse, out, lse, q, k, v, bias, sinks, extras, ctx.ints,
                                                   ctx.floats, ctx.config, need_dbias)
    return (dq, dk, dv, dbias if need_dbias else None,
            dsinks if sinks is not None and ctx.needs_input_grad[4] else None, None, None, None, None)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "tileattn: double backward (gradients of gradients) through flash_attention is not supported; "
        "use tileattn.reference for higher-order derivatives."
    )


def _setup_bwd_context(ctx, inputs, output):
    pass


attention_backward.register_autograd(_no_double_backward, setup_context=_setup_bwd_context)
