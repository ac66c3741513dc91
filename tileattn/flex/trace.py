"""Key a score_mod / mask_mod by its structure, find the tensors it captures, and trace it once.

A modification function is compiled once per *structure*: its code, the constants it reads (closure
cells, defaults, the globals it names, recursively through nested functions and ``functools.partial``)
and the dtype and shape of each tensor it captures. The tensors themselves are not part of the key:
they are arguments of the compiled code, so a closure that captures a different tensor value (a bias
table after an optimizer step, another batch's document ids) runs the same compiled code, and no
cache ever holds a caller's tensor.

:func:`structure` walks the function (microseconds) and returns ``(key, captures)``; :func:`trace`
runs it once on 0-d fake tensors (``make_fx``, as PyTorch's compiled FlexAttention does, with indexing
by 0-d tensors turned into ``aten.index``) and returns an fx graph whose placeholders are
``score`` (score_mods only), ``b``, ``h``, ``q_idx``, ``kv_idx`` and then one per captured tensor the
graph reads. Anything that cannot be keyed or traced raises :class:`Unsupported` with a reason that
names the cause (for ``tileattn.explain``).
"""

from __future__ import annotations

import enum
import functools
import types
from dataclasses import dataclass

import torch

#: dtype of the index arguments b, h, q_idx, kv_idx, as PyTorch's documentation specifies (torch.int)
INDEX_DTYPE = torch.int32
INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
_PLAIN = (type(None), bool, int, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format)


class Unsupported(Exception):
    """The function cannot be compiled; ``reason`` says why in one line."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Traced:
    kind: str                       #: "score" or "mask"
    graph: torch.fx.Graph           #: placeholders: [score,] b, h, q_idx, kv_idx, then captures
    captures: tuple                 #: for each capture placeholder, its position in structure()'s list
    constants: dict                 #: get_attr target -> the 0-d value of a tensor made inside the function

    @property
    def reads(self) -> frozenset:
        """Which of b, h, q_idx, kv_idx the function reads."""
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        first = 1 if self.kind == "score" else 0
        return frozenset(name for name, node in zip(INDEX_NAMES, placeholders[first:])
                         if any(not _reads_only_metadata(user, node) for user in node.users))


#: ops that read only the dtype and device of their first argument (``b.new_zeros(())`` in or_masks)
_METADATA_OPS = {"new_zeros", "new_ones", "new_full", "new_empty", "zeros_like", "ones_like", "full_like",
                 "empty_like"}


def _reads_only_metadata(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    packet = getattr(user.target, "overloadpacket", None)
    return (getattr(packet, "__name__", None) in _METADATA_OPS and user.args[:1] == (node,)
            and node not in user.args[1:] and node not in user.kwargs.values())


def _code_globals(code: types.CodeType):
    """Names a code object (and the functions defined inside it) may read as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_globals(const)
    return names


class _Walker:
    def __init__(self):
        self.captures = []
        self.seen = {}

    def key(self, obj, where: str):
        if isinstance(obj, torch.Tensor):
            self.captures.append(obj)
            return ("tensor", obj.dtype, tuple(obj.shape), obj.device.type)
        if isinstance(obj, float):
            return ("float", obj.hex())  # hex keeps -0.0, inf and nan apart and equal to themselves
        if isinstance(obj, complex):
            return ("complex", obj.real.hex(), obj.imag.hex())
        if isinstance(obj, _PLAIN) or isinstance(obj, enum.Enum):
            return (type(obj), obj)
        if isinstance(obj, (tuple, list)):
            return (type(obj), tuple(self.key(x, where) for x in obj))
        if isinstance(obj, dict):
            return ("dict", tuple((self.key(k, where), self.key(v, where)) for k, v in obj.items()))
        if isinstance(obj, (types.ModuleType, types.BuiltinFunctionType)):
            return ("named", getattr(obj, "__module__", None), obj.__name__)
        if isinstance(obj, type):
            return ("type", obj.__module__, obj.__qualname__)
        if isinstance(obj, torch._ops.OpOverload) or isinstance(obj, torch._ops.OpOverloadPacket):
            return ("op", str(obj))
        if isinstance(obj, functools.partial):
            return ("partial", self.key(obj.func, where), self.key(obj.args, where), self.key(obj.keywords, where))
        if isinstance(obj, types.FunctionType):
            return self._function(obj)
        raise Unsupported(f"{where} holds a {type(obj).__module__}.{type(obj).__qualname__}, which tileattn "
                          "cannot key for compilation; capture plain numbers, tensors and functions instead")

    def _function(self, fn: types.FunctionType):
        if id(fn) in self.seen:
            return ("cycle", self.seen[id(fn)])
        self.seen[id(fn)] = len(self.seen)
        name = fn.__qualname__
        cells = []
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                cells.append(self.key(cell.cell_contents, f"closure variable {var!r} of {name}"))
            except ValueError:  # a cell not yet assigned: the function would fail when called
                raise Unsupported(f"closure variable {var!r} of {name} is not assigned") from None
        names = []
        for var in sorted(_code_globals(fn.__code__)):
            if var in fn.__globals__:
                value = fn.__globals__[var]
                if isinstance(value, (types.ModuleType, type)):
                    continue  # modules and classes: read-only namespaces (torch, math, ...)
                names.append((var, self.key(value, f"global {var!r} read by {name}")))
        return ("function", fn.__code__, tuple(cells), tuple(names),
                self.key(fn.__defaults__, f"defaults of {name}"),
                self.key(fn.__kwdefaults__, f"keyword defaults of {name}"))


def structure(fn):
    """``(key, captures)``: a hashable key of everything the traced graph may depend on, and the
    tensors ``fn`` captures (in a fixed order for equal keys). Raises :class:`Unsupported`."""
    walker = _Walker()
    if isinstance(fn, types.MethodType) or not isinstance(fn, (types.FunctionType, functools.partial)):
        raise Unsupported(f"{type(fn).__qualname__} objects are not compiled (only plain functions, closures "
                          "and functools.partial); the tile-wise PyTorch path runs them")
    key = walker.key(fn, "the function")
    return key, tuple(walker.captures)


class IndexByTensors(torch.overrides.TorchFunctionMode):
    """``t[i, j]`` with 0-d tensor indices becomes ``aten.index(t, [i, j])`` instead of reading the
    indices' values, as in PyTorch's FlexAttention (its ``TransformGetItemToIndex``, which lives in
    ``torch._dynamo``: importing that costs seconds, this costs nothing)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            tensor, index = args[0], args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) for i in index) and \
                    all(isinstance(i, (torch.Tensor, int)) and not isinstance(i, bool) for i in index):
                return torch.ops.aten.index(tensor, [i if isinstance(i, torch.Tensor) else
                                                     torch.tensor(i, dtype=torch.int64, device=tensor.device)
                                                     for i in index])
        return func(*args, **(kwargs or {}))


def _fake_inputs(kind: str, score_dtype):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        idx = [torch.zeros((), dtype=INDEX_DTYPE) for _ in INDEX_NAMES]
        return ([torch.zeros((), dtype=score_dtype)] if kind == "score" else []) + idx


def trace(fn, kind: str, score_dtype, captures) -> Traced:
    """Trace ``fn`` (a score_mod when ``kind == "score"``, else a mask_mod) on 0-d inputs; tensors it
    captures become placeholders after the index arguments (``captures`` from :func:`structure`)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    args = _fake_inputs(kind, score_dtype)
    try:
        with IndexByTensors():
            gm = make_fx(lambda *a: fn(*a), tracing_mode="real")(*args)  # any callable: make_fx reads signatures
    except Exception as exc:  # noqa: BLE001 - any tracing failure is a reason not to compile
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if "DataDependent" in type(exc).__name__ or "data-dependent" in text or "_local_scalar_dense" in text:
            raise Unsupported("the function branches on or reads a tensor's value in Python (if/bool/item/"
                              "min/max on a traced tensor); write it with torch.where/torch.minimum/...") from None
        raise Unsupported(f"tracing failed: {type(exc).__name__}: {text[:200]}") from None
    return _lift(gm, kind, captures)


def _lift(gm: torch.fx.GraphModule, kind: str, captures) -> Traced:
    """Turn the graph's tensor constants that are captured tensors into placeholders; keep the value of
    0-d tensors the function creates; refuse any other constant tensor."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    positions, constants, lifted = [], {}, {}
    anchor = placeholders[-1]
    for node in list(graph.nodes):
        if node.op != "get_attr":
            continue
        if node.target in lifted:
            node.replace_all_uses_with(lifted[node.target])
            graph.erase_node(node)
            continue
        value = getattr(gm, node.target)
        slot = next((i for i, t in enumerate(captures) if t is value), None)
        if slot is not None:
            with graph.inserting_after(anchor):
                anchor = graph.placeholder(f"capture{len(positions)}")
            anchor.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(anchor)
            graph.erase_node(node)
            lifted[node.target] = anchor
            positions.append(slot)
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            constants[node.target] = (value.item(), value.dtype)
        else:
            raise Unsupported(f"the function reads a tensor of shape {tuple(getattr(value, 'shape', ()))} that is "
                              "neither captured by a closure/default/global nor 0-d (an attribute of an object?); "
                              "capture it in a closure")
    for target in lifted:
        delattr(gm, target)  # the graph must not keep the caller's tensors alive
    return Traced(kind=kind, graph=graph, captures=tuple(positions), constants=constants)
