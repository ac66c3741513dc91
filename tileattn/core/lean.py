"""The lean call: a repeated inference call served by a prepared kernel call, without the spec,
dispatch, the modifiers' parsing or the custom op.

A decode step is a few microseconds of kernel; the full path around it (validation into an
:class:`~tileattn.core.spec.AttentionSpec`, engine choice, the op boundary, the kernels' keyword
wrapper) cost several times that. :func:`tileattn.flash_attention` therefore looks a call up here
first when it needs no gradient (no input requires grad, or grad mode is off), is not being traced
(:func:`tileattn.core.spec.tracing`: torch.compile, FakeTensorMode, ...), and uses only keywords
that bind no per-call tensor (``causal``, ``window``, ``softcap``, ``scale``, ``align``, ``layout``,
``num_heads``, ``seqused_k``, ``block_table``).

The memo is keyed by everything validation and dispatch read of such a call *except K/V's key
length and strides*: a decode loop whose cache grows by a key every step (a new shape each time)
finds one entry. An entry (:class:`LeanPlan`) holds the engine's prepared call
(:meth:`tileattn.core.engine.Backend.prepare`; the native engine's packs its argument struct once) and
the geometry of K/V, the output and the LSE. Per call it checks what the key leaves out (K/V's
batch, heads, head dims and unit last stride; key length within the short-call limit) and refreshes
pointers and strides; anything unexpected, and a value the kernel refuses (a ``seqused_k`` beyond
the keys, a block table entry outside the pool: the kernel checks every entry, as validation
does), returns None, and the full path runs the call: it
validates, raises its usual error before any compute, or computes. Results are bitwise those of
the full path (the same kernel, the same arguments).

Which calls are looked up is derived, not listed (:func:`front`, :func:`unserved`): a plan keys on
:func:`lookup`'s arguments, so every other keyword of the call must be at its absent value.

Entries hold no tensor (shapes, flags, the engine, the prepared struct's bytes). Whoever changes an
engine's declaration or replaces its ``forward`` (a test's spy) is served by the full path again.
"""

from __future__ import annotations

import inspect
import linecache
import os
from typing import Callable, Optional, Tuple

import torch

from . import plans
from .engine import registry_version
from .layouts import kv_reader
from .spec import tracing

#: this module's kind of entry in :mod:`tileattn.core.plans` (None: a call shape the engine
#: prepares nothing for)
KIND = "lean"
_get = plans.get


def lookup(q, k, v, layout, num_heads, scale, causal, window, align, softcap, seqused_k, block_table,
           deterministic, backend) -> Tuple[Optional[tuple], Optional["LeanPlan"]]:
    """``(key, plan)`` of a call whose other keywords are all absent: key None when the call must
    take the full path (gradients, tracing, tensor subclasses, unhashable arguments), plan None
    when there is none yet (or the engine prepares nothing for the call). Scalars of other types
    than the documented ones take the full path, so that ``causal=1`` (refused there) never shares
    ``causal=True``'s plan, though the two are equal keys."""
    if _BYPASSED or not (type(q) is type(k) is type(v) is torch.Tensor) or tracing():
        return None, None
    if not (type(causal) is bool and type(softcap) is float and type(deterministic) is bool
            and (scale is None or type(scale) is float) and (num_heads is None or type(num_heads) is int)
            and (type(align) is str or type(align) is int)):
        return None, None
    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        return None, None
    try:
        key = (KIND, q.shape, q.stride(), q.dtype, q.device, k.dtype, k.device, v.dtype, v.device, layout, num_heads,
               scale, causal, None if window is None else (window, tuple(map(type, window))), align, softcap,
               deterministic, backend,
               _ENVIRON.get(_BACKEND_VARIABLE) if _FAST_ENVIRON else os.environ.get("TILEATTN_BACKEND"),
               registry_version(),
               None if seqused_k is None else _index_meta(seqused_k),
               None if block_table is None else _index_meta(block_table))
        return key, _get(key)
    except (TypeError, RuntimeError, AttributeError):  # not tensors, a nested q, an unhashable value
        return None, None


def unserved(fn: Callable) -> Tuple[str, ...]:
    """The keywords of ``fn`` (:func:`tileattn.flash_attention`) a plan cannot serve: all but those
    :func:`lookup` keys a plan on and ``return_lse`` (which :meth:`LeanPlan.run` takes). These are the
    variant keywords of the modifiers that bind a tensor or a per-call value (mask, bias, ALiBi,
    sinks, dropout, the scales of a quantised cache, user functions), the varlen offsets,
    ``modifiers=``, and any keyword added later: a plan knows nothing of them, so a call that
    gives one a value takes the full path."""
    keyed = set(inspect.signature(lookup).parameters) | {"return_lse", "lean_key"}
    return tuple(name for name in inspect.signature(fn).parameters if name not in keyed)


def front(full: Callable) -> Callable:
    """The public function of ``full(q, k, v, lean_key, <keywords with defaults>)`` (the full path of
    :func:`tileattn.flash_attention`): a function taking ``full``'s keywords (keyword-only), with
    its defaults and docstring, that serves a call from its lean plan when every keyword of
    :func:`unserved` is at its absent value (its default, of the same type: ``dropout_p=False`` is
    refused by the full path, not taken for 0.0) and the plan takes it, and hands any other call,
    with its lean key, to ``full`` (positionally: passing every keyword by name costs 1.5 us).

    Generated once, as dataclasses generate ``__init__``, so that the test of those keywords is the
    plain ``mask is None and ...`` a hand-written list would be while no list is written by hand:
    reading them by name through ``locals()`` costs a decode call 2 us (a fifth)."""
    params = inspect.signature(full).parameters
    names = list(params)[4:]
    if list(params)[:4] != ["q", "k", "v", "lean_key"] or \
            any(params[n].kind is not params[n].POSITIONAL_OR_KEYWORD or params[n].default is params[n].empty
                for n in names):
        raise TypeError(f"tileattn: lean.front needs {full.__qualname__}(q, k, v, lean_key, <keywords with "
                        f"defaults>)")
    namespace = {"lookup": lookup, "full": full}
    absent = ["type(return_lse) is bool"]
    for name in unserved(full):
        default = params[name].default
        if default is None:
            absent.append(f"{name} is None")
        else:
            namespace[f"_{name}_absent"], namespace[f"_{name}_type"] = default, type(default)
            absent.append(f"type({name}) is _{name}_type and {name} == _{name}_absent")
    keyed = ", ".join(list(inspect.signature(lookup).parameters)[3:])
    source = "\n".join((
        f"def {full.__name__}(q, k, v, *, {', '.join(names)}):",
        f"    if {' and '.join(absent)}:",
        f"        lean_key, plan = lookup(q, k, v, {keyed})",
        "        if plan is not None:",
        "            served = plan.run(q, k, v, seqused_k, block_table, return_lse)",
        "            if served is not None:",
        "                return served if return_lse else served[0]",
        "    else:",
        "        lean_key = None",
        f"    return full(q, k, v, lean_key, {', '.join(names)})",
        ""))
    filename = f"<tileattn.core.lean.front of {full.__module__}.{full.__qualname__}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # tracebacks show it
    exec(compile(source, filename, "exec"), namespace)
    fn = namespace[full.__name__]
    fn.__kwdefaults__ = {name: params[name].default for name in names}
    fn.__doc__, fn.__module__, fn.__qualname__ = full.__doc__, full.__module__, full.__qualname__
    return fn


#: ``os.environ``'s own dict (bytes keys on POSIX): reading TILEATTN_BACKEND there costs a tenth of
#: ``os.environ.get``, which encodes the name and decodes the value on every call. It is the
#: mapping ``os.environ[...] = ...`` and ``del`` update, so a changed variable is seen at once.
_ENVIRON = getattr(os.environ, "_data", None)
_BACKEND_VARIABLE = os.environ.encodekey("TILEATTN_BACKEND") if hasattr(os.environ, "encodekey") else None
_FAST_ENVIRON = type(_ENVIRON) is dict and _BACKEND_VARIABLE is not None


def _index_meta(t):
    if type(t) is not torch.Tensor:
        raise TypeError("not a tensor")
    return t.shape, t.stride(), t.dtype, t.device


def remember(key: tuple, spec, engine) -> None:
    """Make the plan of a call the full path just validated and dispatched (or note that its engine
    prepares nothing for it)."""
    prepared = engine.prepare(spec)
    plans.put(key, None if prepared is None else LeanPlan(spec, engine, prepared))


_BYPASSED = False


class bypassed:
    """Every call inside the block takes the full path: what the benchmarks compare the lean call
    with, and what the tests of the full path's own plan memo measure. Not thread-local. (A class,
    not a generator context: the benchmarks enter it around calls of a few microseconds.)"""

    def __enter__(self):
        global _BYPASSED
        self._before, _BYPASSED = _BYPASSED, True

    def __exit__(self, *exc):
        global _BYPASSED
        _BYPASSED = self._before


class LeanPlan:
    """A prepared call and the geometry the call key leaves out."""

    __slots__ = ("engine", "capabilities", "forward", "prepared", "read_k", "read_v", "out_shape", "lse_shape",
                 "dtype", "acc", "like_q")

    def __init__(self, spec, engine, prepared):
        self.engine, self.capabilities, self.prepared = engine, engine.capabilities, prepared
        self.forward = getattr(engine.forward, "__func__", None)
        paged = spec.is_paged
        layout, batch, seq = ("paged", None, spec.block_size) if paged else (spec.layout, spec.batch, None)
        self.read_k, prepared.order = kv_reader(layout, batch, spec.heads_kv, spec.head_dim, seq)
        self.read_v = kv_reader(layout, batch, spec.heads_kv, spec.head_dim_v, seq)[0]
        self.out_shape, self.lse_shape = spec.out_shape(), spec.lse_shape()
        self.dtype, self.acc = spec.dtype, spec.acc_dtype()
        # q's shape and strides are in the call key: when q has the output's shape and its plain
        # contiguous strides, empty_like(q) allocates the output as the full path does, at half
        # torch.empty's cost
        self.like_q = tuple(spec.q.shape) == tuple(self.out_shape) and spec.q.stride() == _contiguous(spec.q.shape)

    def run(self, q, k, v, seqused_k, block_table, return_lse) -> Optional[Tuple[torch.Tensor, object]]:
        """``(out, lse or None)``, or None when this call is not one the plan serves."""
        engine = self.engine
        if engine.capabilities is not self.capabilities or \
                getattr(engine.forward, "__func__", None) is not self.forward:
            return None
        try:
            kg, vg = self.read_k(k), self.read_v(v)
            q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        except RuntimeError:  # a nested tensor has no strides, one wrapped by torch.func (vmap) no storage
            return None
        if kg is None or vg is None or kg[0] != vg[0]:
            return None
        prepared = self.prepared
        keys = kg[0]
        if not prepared.paged and not 0 < keys <= prepared.max_keys:
            return None  # (a paged call's block indices are checked by the kernel, which then refuses it)
        out = torch.empty_like(q) if self.like_q else torch.empty(self.out_shape, dtype=self.dtype)
        lse = torch.empty(self.lse_shape, dtype=self.acc) if return_lse else None
        if not prepared.run(q_ptr, k_ptr, v_ptr, out.data_ptr(),
                            None if lse is None else lse.data_ptr(), keys, kg[1], vg[1],
                            0 if seqused_k is None else seqused_k.data_ptr(),
                            0 if block_table is None else block_table.data_ptr()):
            return None  # the kernel refused a value before computing: the full path says which
        return out, lse


def _contiguous(shape) -> tuple:
    """The strides torch gives a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))
