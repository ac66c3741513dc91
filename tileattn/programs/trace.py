"""Key a score_mod / mask_mod by its structure, find the tensors and numbers it captures, and trace it once.

A user function is compiled once per *structure*: its code, the values it reads that shape the code
(closure cells, defaults, ``functools.partial`` arguments, the globals it names and the attributes of
modules and classes it reads, recursively through nested functions) and the type, dtype, rank, device
and layout of each tensor it captures, with which captures are the same tensor. Three kinds of values
are arguments of the compiled code rather than part of its key:

* **tensors** it captures (:attr:`Structure.captures`): a closure over another bias table, or another
  batch's document ids, runs the same program, and no cache ever holds a caller's tensor. The key
  records which capture slots hold the *same* tensor object (``t`` captured twice reads one slot;
  two different tensors of that shape read two), so aliasing never changes a program's meaning;
* **float constants** in closure cells, defaults and ``partial`` arguments (:attr:`Structure.scalars`):
  a temperature that changes every step neither retraces nor recompiles. They are traced as
  run-time scalars (FlashAttention-4's ``aux_scalars``). A function that uses such a float in
  Python itself (``if temperature > 1``, ``math.exp(t)``) cannot be traced that way: it is traced
  again with the values in place, and then keyed by them (:attr:`Structure.valued_key`);
* nothing else: ints, bools, strings, floats read from globals and attributes of modules and classes
  (``Cfg.temperature``) are part of the key by value, so a changed attribute is a new program, never
  a stale one. Ints stay in the key even in closures: Python ints promote differently from any
  tensor that could stand for them (``int8_table[i] + n`` stays int8, ``n * 2`` never overflows),
  so a traced int would not always compute what the function computes. An int that changes every
  call (a decode offset) is a compile per value: capture it as a tensor instead.

A captured tensor's **sizes** are read by the compiled code at run time, so they are not in the key
(a table that grows each decode step is one program); a function that reads them in Python
(``t.shape[0]``, ``len(t)``, iterating) has them compiled in, and is keyed by them
(:attr:`Traced.shaped`). Its **values** and **strides** must never reach Python while it is traced:
``t.tolist()``, ``t[0].item()``, ``bool(t[0] > 0)``, ``t.numpy()``, ``t.stride()``,
``t.is_contiguous()``, ``t.data_ptr()`` would become constants of a program another tensor then
reuses, so the function is refused with the reason and runs exactly through ``torch.vmap``.

:func:`structure` walks the function (tens of microseconds) and returns a :class:`Structure`;
:func:`trace` runs it once on 0-d fake tensors (``make_fx``, as PyTorch's compiled FlexAttention
does, with indexing by 0-d tensors turned into ``aten.index``) and returns an fx graph whose
placeholders are ``score`` (score_mods only), ``b``, ``h``, ``q_idx``, ``kv_idx``, one per run-time
scalar, then one per captured tensor the graph reads. Anything that cannot be keyed or traced raises
:class:`Unsupported` with a reason that names the cause (for ``tileattn.explain``).
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
_NAMED = (types.BuiltinFunctionType, torch._ops.OpOverload, torch._ops.OpOverloadPacket)
#: packages whose modules, classes and functions without a closure are keyed by name (their code is
#: the library's, not the user's)
_LIBRARY_PACKAGES = ("torch", "math", "numpy", "operator", "builtins", "functools")


class Unsupported(Exception):
    """The function cannot be compiled; ``reason`` says why in one line. ``shaped``: the refusal may
    depend on the sizes of the tensors it captures (it read them in Python), so it holds for
    those sizes only."""

    def __init__(self, reason: str, shaped: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.shaped = shaped


class BadReturn(TypeError):
    """A function whose value is not one score (score_mod) or one boolean (mask_mod) per element: the
    caller's error, raised before any compute, never a reason to run the function another way."""


def check_return(kind: str, out) -> None:
    """Raise :class:`BadReturn` unless ``out``, one element's value as the function returned it (under
    torch.vmap: per element), is one score (a real number) or one boolean, as a 0-d tensor or a Python
    number (a constant)."""
    if kind == "score":
        what, example = "one floating-point score per element", "score * 2, torch.where(...)"
        ok = isinstance(out, (int, float)) or (isinstance(out, torch.Tensor) and out.dim() == 0
                                                and not out.is_complex())
    else:
        what, example = "one boolean per element", "q_idx >= kv_idx, (a < b) & (c == d)"
        ok = isinstance(out, bool) or (isinstance(out, torch.Tensor) and out.dim() == 0 and out.dtype == torch.bool)
    if ok:
        return
    if isinstance(out, (tuple, list)):
        got = f"a {type(out).__name__} of {len(out)} values"
    elif isinstance(out, torch.Tensor):
        got = (f"a {out.dtype} value" if out.dim() == 0 else
               f"a tensor of shape {tuple(out.shape)} per element (stacked or unreduced values)")
    else:
        got = f"a {type(out).__name__}"
    raise BadReturn(f"tileattn: argument '{kind}_mod': got a function that returns {got}; {kind}_mod must return "
                    f"{what} (a 0-d tensor: {example}).")


@dataclass(frozen=True)
class Structure:
    """What :func:`structure` found: the key with scalar slots, the captured tensors and float scalars
    in slot order, and the key with the scalars' values (for functions that need them traced in)."""

    key: tuple
    captures: tuple         #: captured tensors, one per distinct tensor object, in walk order
    scalars: tuple          #: float constants that become run-time scalars, in walk order

    @property
    def valued_key(self) -> tuple:
        return (self.key, tuple(x.hex() for x in self.scalars))

    @property
    def shapes(self) -> tuple:
        """The captures' sizes: the key of a function that reads them in Python (:attr:`Traced.shaped`)."""
        return tuple(tuple(t.shape) for t in self.captures)


@dataclass(frozen=True)
class Traced:
    kind: str                       #: "score" or "mask"
    graph: torch.fx.Graph           #: placeholders: [score,] b, h, q_idx, kv_idx, scalars, then captures
    captures: tuple                 #: for each capture placeholder, its position in Structure.captures
    constants: dict                 #: get_attr target -> the 0-d value of a tensor made inside the function
    scalars: int                    #: number of run-time scalar placeholders (0: the values are traced in)
    shaped: bool = False            #: the function read a capture's sizes in Python (they may be in the graph)

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


def _code_names(code: types.CodeType):
    """Names a code object (and the functions defined inside it) may read as globals or attributes."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _is_library(obj) -> bool:
    module = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
    return isinstance(module, str) and module.split(".")[0] in _LIBRARY_PACKAGES


class _Walker:
    """One walk over a function's reachable values. ``replace`` (None: only key) maps the walk's float
    scalar slots to the objects a rebuilt copy of the function holds instead (tracing proxies).

    Modules and classes of the user's own code are keyed by the attributes any walked function may
    read (every name in their code), by value, after the walk (:meth:`finish`)."""

    def __init__(self, replace=None):
        self.captures, self.scalars, self.slot_of = [], [], {}
        self.seen = {}
        self.replace = replace
        self.cycle = False
        self.open = set()  # ids of the containers being walked (one met again inside itself: a cycle)
        self.names = set()
        self.spaces, self.space_of = [], {}

    def visit(self, obj, where: str, runtime: bool):
        """(key, rebuilt object or ``obj``); floats become scalar slots where ``runtime``."""
        if isinstance(obj, torch.Tensor):
            slot = self.slot_of.get(id(obj))
            if slot is not None:
                return ("alias", slot), obj
            self.slot_of[id(obj)] = len(self.captures)
            self.captures.append(obj)
            # the rank, not the sizes: the C reads the sizes at run time (a capture that grows each
            # decode step is one program); the layout and type: a sparse or subclass capture refused
            # must not send a dense one of the same code to the fallback
            return ("tensor", type(obj), obj.dtype, obj.dim(), obj.device.type, obj.layout, obj.is_nested), obj
        if isinstance(obj, float):
            if runtime:
                self.scalars.append(obj)
                slot = len(self.scalars) - 1
                return ("scalar",), obj if self.replace is None else self.replace[slot]
            return ("float", obj.hex()), obj  # hex keeps -0.0, inf and nan apart and equal to themselves
        if isinstance(obj, complex):
            return ("complex", obj.real.hex(), obj.imag.hex()), obj
        if isinstance(obj, _PLAIN) or isinstance(obj, enum.Enum):
            return (type(obj), obj), obj
        if isinstance(obj, (tuple, list, dict)):
            if id(obj) in self.open:
                raise Unsupported(f"{where} holds a {type(obj).__name__} that contains itself, which tileattn cannot "
                                  "key for compilation; capture the values the function reads instead")
            self.open.add(id(obj))
            try:
                return self._container(obj, where, runtime)
            finally:
                self.open.discard(id(obj))
        if isinstance(obj, _NAMED):
            return ("named", getattr(obj, "__module__", None), str(obj)), obj
        if isinstance(obj, (types.ModuleType, type)):
            if _is_library(obj):
                return ("library", getattr(obj, "__name__", None), getattr(obj, "__qualname__", None)), obj
            if id(obj) not in self.space_of:
                self.space_of[id(obj)] = len(self.spaces)
                self.spaces.append(obj)
            return ("namespace", self.space_of[id(obj)]), obj
        if isinstance(obj, functools.partial):
            fk, fn = self.visit(obj.func, where, runtime)
            ak, args = self.visit(obj.args, where, runtime)
            kk, kwargs = self.visit(obj.keywords, where, runtime)
            same = fn is obj.func and args is obj.args and kwargs is obj.keywords
            return ("partial", fk, ak, kk), obj if same else functools.partial(fn, *args, **kwargs)
        if isinstance(obj, types.FunctionType):
            if _is_library(obj) and obj.__closure__ is None:  # and_masks(...) returns a closure: walked
                return ("named", obj.__module__, obj.__qualname__), obj
            return self._function(obj)
        raise Unsupported(f"{where} holds a {type(obj).__module__}.{type(obj).__qualname__}, which tileattn "
                          "cannot key for compilation; capture plain numbers, tensors and functions instead")

    def _container(self, obj, where: str, runtime: bool):
        if isinstance(obj, dict):
            items = [(self.visit(k, where, False), self.visit(v, where, runtime)) for k, v in obj.items()]
            changed = any(v is not pair[1] for v, (_, pair) in zip(obj.values(), items))
            rebuilt = {k[1]: v[1] for k, v in items} if changed else obj
            return ("dict", tuple((k[0], v[0]) for k, v in items)), rebuilt
        pairs = [self.visit(x, where, runtime) for x in obj]
        rebuilt = obj if all(a is b for a, (_, b) in zip(obj, pairs)) else type(obj)(b for _, b in pairs)
        return (type(obj), tuple(k for k, _ in pairs)), rebuilt

    def _function(self, fn: types.FunctionType):
        if id(fn) in self.seen:
            self.cycle = True
            return ("cycle", self.seen[id(fn)]), fn
        self.seen[id(fn)] = len(self.seen)
        name = fn.__qualname__
        names = _code_names(fn.__code__)
        self.names |= names
        cells, rebuilt_cells = [], []
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet assigned: the function would fail when called
                raise Unsupported(f"closure variable {var!r} of {name} is not assigned") from None
            key, rebuilt = self.visit(value, f"closure variable {var!r} of {name}", True)
            cells.append(key)
            rebuilt_cells.append(rebuilt)
        globals_ = tuple((var, self.visit(fn.__globals__[var], f"global {var!r} read by {name}", False)[0])
                         for var in sorted(names) if var in fn.__globals__)
        dk, defaults = self.visit(fn.__defaults__, f"defaults of {name}", True)
        kk, kwdefaults = self.visit(fn.__kwdefaults__, f"keyword defaults of {name}", True)
        key = ("function", fn.__code__, tuple(cells), globals_, dk, kk)
        changed = any(a is not c.cell_contents for a, c in zip(rebuilt_cells, fn.__closure__ or ()))
        if not (changed or defaults is not fn.__defaults__ or kwdefaults is not fn.__kwdefaults__):
            return key, fn
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults,
                                  tuple(types.CellType(x) for x in rebuilt_cells) if fn.__closure__ else None)
        copy.__kwdefaults__ = kwdefaults
        return key, copy

    def finish(self) -> tuple:
        """The keys of the user's modules and classes the walk met: each attribute any walked function
        may read, by value. A function or namespace found there is walked in turn, which may add names
        and namespaces: the keys are made again until neither grows."""
        memo = {}  # id -> (value, key): each attribute value is walked once (the value kept: no id reuse)
        while True:
            size = (len(self.names), len(self.spaces))
            keys = []
            for space in list(self.spaces):
                entries = []
                for name in sorted(self.names):
                    try:
                        value = getattr(space, name)
                    except Exception:  # noqa: BLE001 - not an attribute of this namespace (or one that raises)
                        continue
                    if id(value) not in memo:
                        where = f"attribute {name!r} of {getattr(space, '__name__', space)}"
                        memo[id(value)] = (value, self.visit(value, where, False)[0])
                    entries.append((name, memo[id(value)][1]))
                keys.append((getattr(space, "__name__", None), tuple(entries)))
            if (len(self.names), len(self.spaces)) == size:
                return tuple(keys)


def _check_callable(fn):
    if isinstance(fn, types.MethodType) or not isinstance(fn, (types.FunctionType, functools.partial)):
        raise Unsupported(f"{type(fn).__qualname__} objects are not compiled (only plain functions, closures "
                          "and functools.partial); the tile-wise PyTorch path runs them")


def structure(fn) -> Structure:
    """The :class:`Structure` of ``fn``: a hashable key of everything the traced graph may depend on,
    the tensors it captures and its float scalars. Raises :class:`Unsupported`."""
    _check_callable(fn)
    walker = _Walker()
    try:
        key, _ = walker.visit(fn, "the function", True)
        key = (key, walker.finish())
    except RecursionError:
        raise Unsupported("the function's closures nest containers or functions too deeply to key for "
                          "compilation") from None
    scalars = tuple(walker.scalars)
    if walker.cycle:  # a function reachable from itself is not rebuilt: its floats are traced in
        key, scalars = (key, tuple(x.hex() for x in scalars)), ()
    return Structure(key=key, captures=tuple(walker.captures), scalars=scalars)


def with_scalars(fn, replacements):
    """A copy of ``fn`` whose float scalar slots (in :func:`structure`'s order) hold ``replacements``."""
    walker = _Walker(replace=list(replacements))
    return walker.visit(fn, "the function", True)[1]


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


#: What a function may ask of a captured tensor (or of a tensor computed from one) in Python while it
#: is traced: anything it reads there is compiled in, so it must be in the program's key. The dtype,
#: device, layout and rank are; the sizes are only when read (then the program is keyed by them); the
#: values and the strides never are (the C reads the values at run time, from a dense copy), so a read
#: of those refuses the function with the reason and it runs exactly through torch.vmap.
_KEYED_READS = frozenset({"dim", "ndimension", "ndim", "dtype", "device", "layout", "is_floating_point",
                          "is_complex", "is_signed", "is_cpu", "is_cuda", "is_sparse", "is_nested", "is_quantized",
                          "is_meta", "element_size", "itemsize", "get_device"})
_SHAPE_READS = frozenset({"shape", "size", "__len__", "numel", "nelement", "nbytes", "unbind", "split", "chunk",
                          "tensor_split", "split_with_sizes", "unsafe_split", "unsafe_chunk", "hsplit", "vsplit",
                          "dsplit", "is_same_size"})
_LAYOUT_READS = frozenset({"stride", "is_contiguous", "storage_offset", "is_non_overlapping_and_dense", "data_ptr",
                           "untyped_storage", "storage", "_storage", "is_set_to"})
#: calls that copy a tensor's values into a new constant while tracing
_VALUE_COPIES = frozenset({"tensor", "as_tensor", "asarray"})


def _api_name(func) -> str:
    """``t.shape`` arrives as the getter ``__get__`` of the ``shape`` descriptor: its name is the attribute's."""
    name = getattr(func, "__name__", "")
    return getattr(getattr(func, "__self__", None), "__name__", name) if name == "__get__" else name


class _WatchCaptures(torch.overrides.TorchFunctionMode):
    """While tracing: refuse Python that reads a captured tensor's values or strides, and note reads of
    its sizes (:attr:`shaped`). Tensors computed from a capture are watched as well."""

    def __init__(self, captures):
        super().__init__()
        self.watched = {id(t): t for t in captures}  # keeps them alive: an id is never reused meanwhile
        self.shaped = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        if not any(isinstance(x, torch.Tensor) and id(x) in self.watched for x in leaves):
            return func(*args, **kwargs)
        name = _api_name(func)
        if name in _LAYOUT_READS:
            raise Unsupported(f"the function reads the layout of a captured tensor in Python ({name}); the compiled "
                              "code reads a dense copy of it, so a stride or address is never part of a program")
        if name in _VALUE_COPIES:
            raise Unsupported(f"the function copies a captured tensor's values in Python (torch.{name}); they would "
                              "be compiled in, stale for the next tensor: use the tensor itself")
        out = func(*args, **kwargs)
        found = torch.utils._pytree.tree_leaves(out)
        if name in _SHAPE_READS:
            self.shaped = True
        elif name not in _KEYED_READS and not (found and all(isinstance(x, torch.Tensor) for x in found)):
            raise Unsupported(f"the function reads the values of a captured tensor in Python ({name}); they would "
                              "be compiled in, stale for the next tensor: compute with tensor ops (indexing, "
                              "torch.where) instead of item()/tolist()/bool()/int()")
        for x in found:
            if isinstance(x, torch.Tensor):
                self.watched[id(x)] = x
        return out


def _fake_inputs(kind: str, score_dtype, scalars: int):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        idx = [torch.zeros((), dtype=INDEX_DTYPE) for _ in INDEX_NAMES]
        # float32, like the default dtype a Python float promotes to: q_idx * t and score * t take
        # the dtypes they take with the Python number
        values = [torch.zeros((), dtype=torch.float32) for _ in range(scalars)]
        return ([torch.zeros((), dtype=score_dtype)] if kind == "score" else []) + idx + values


def trace(fn, kind: str, score_dtype, found: Structure, runtime_scalars: bool = True) -> Traced:
    """Trace ``fn`` (a score_mod when ``kind == "score"``, else a mask_mod) on 0-d inputs. With
    ``runtime_scalars`` its float scalars are placeholders after the index arguments; tensors it
    captures become placeholders after those."""
    from torch.fx.experimental.proxy_tensor import make_fx

    n_index = len(INDEX_NAMES) + (1 if kind == "score" else 0)
    scalars = len(found.scalars) if runtime_scalars else 0

    def traced(*args):
        call = with_scalars(fn, args[n_index:]) if scalars else fn
        out = call(*args[:n_index])
        check_return(kind, out)
        return out

    for i, t in enumerate(found.captures):
        if t.layout is not torch.strided or t.is_nested:
            raise Unsupported(f"captured tensor #{i} is a {'nested' if t.is_nested else t.layout} tensor; compiled "
                              "functions read dense (strided) tensors")
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise Unsupported(f"captured tensor #{i} is a {type(t).__name__} (a tensor subclass); compiled functions "
                              "read a plain tensor's memory, its own ops run it through torch.vmap")
    args = _fake_inputs(kind, score_dtype, scalars)
    watch = _WatchCaptures(found.captures)
    try:
        with IndexByTensors(), watch:  # the watch innermost: it sees t[i] before it becomes aten.index
            gm = make_fx(traced, tracing_mode="real")(*args)
    except BadReturn:
        raise
    except Unsupported as exc:
        raise Unsupported(exc.reason, shaped=watch.shaped) from None
    except Exception as exc:  # noqa: BLE001 - any tracing failure is a reason not to compile
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if "DataDependent" in type(exc).__name__ or "data-dependent" in text or "_local_scalar_dense" in text:
            raise Unsupported("the function branches on or reads a tensor's value in Python (if/bool/item/"
                              "min/max on a traced tensor); write it with torch.where/torch.minimum/...",
                              shaped=watch.shaped) from None
        # keyed by the ranks unless the function read sizes: a refused function whose capture grows
        # each decode step must not be traced again every step (t[5] of a 3-element capture fails the
        # call anyway; a later, longer capture then runs exactly, on the fallback)
        raise Unsupported(f"tracing failed: {type(exc).__name__}: {text[:200]}", shaped=watch.shaped) from None
    return _lift(gm, kind, found.captures, scalars, watch)


def _lift(gm: torch.fx.GraphModule, kind: str, captures, scalars: int, watch: _WatchCaptures) -> Traced:
    """Turn the graph's tensor constants that are captured tensors into placeholders; keep the value of
    0-d tensors the function creates; refuse any other constant tensor (one computed from a capture
    outside the graph's ops, whose value would be compiled in, among them)."""
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
        elif isinstance(value, torch.Tensor) and id(value) in watch.watched:
            raise Unsupported("the function uses a tensor made from a captured tensor outside PyTorch's ops; its "
                              "values would be compiled in, stale for the next tensor")
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            constants[node.target] = (value.item(), value.dtype)
        else:
            raise Unsupported(f"the function reads a tensor of shape {tuple(getattr(value, 'shape', ()))} that is "
                              "neither captured by a closure/default/global nor 0-d (an attribute of an object?); "
                              "capture it in a closure")
    for target in lifted:
        delattr(gm, target)  # the graph must not keep the caller's tensors alive
    return Traced(kind=kind, graph=graph, captures=tuple(positions), constants=constants, scalars=scalars,
                  shaped=watch.shaped)
