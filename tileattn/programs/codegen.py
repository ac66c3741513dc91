"""Translate a traced score_mod / mask_mod (:mod:`tileattn.programs.trace`) into C tile functions.

The generated functions work on a tile of scores. Key-major, as the native kernels' transposed tiles
keep them: ``s[j * ld + r]`` is the score of key column ``j`` for tile row ``r``; row ``r`` has its own
batch, query head and query index (``b[r]``, ``h[r]``, ``q[r]``), column ``j`` its key index
``kv[j]``. The loops run over columns outside and rows inside, so the inner loop is the contiguous
one and vectorises. The ``_rows`` variants take row-major tiles (``s[r * ld + j]``, a decode step's
few rows against many keys): rows outside, columns inside.

ABI (``real`` is ``float`` for an fp32 working precision, ``double`` for fp64)::

    int ta_user_score(int64_t rows, int64_t cols, int64_t ld, real *s, IDX, const double *scalars);
    int ta_user_score_rows(<the same>);
    int ta_user_logits(int64_t rows, int64_t cols, int64_t ld, real *s, IDX, const double *scalars, real alpha,
                       real *cmax);
    int ta_user_score_bwd(int64_t rows, int64_t cols, int64_t ld, const real *s, real *ds, IDX,
                          const double *scalars, real *const *cap_grad);
    int ta_user_mask(int64_t rows, int64_t cols, int64_t ld, uint8_t *out, IDX, const double *scalars);
    int ta_user_mask_rows(<the same>);

    IDX = const int32_t *b, const int32_t *h, const int32_t *q, const int32_t *kv,
          const void *const *cap, const int64_t *cap_sizes

* ``score`` overwrites each score with ``score_mod(score, b, h, q_idx, kv_idx)``; ``logits`` is the
  forward's sweep after the GEMM fused: ``score_mod(alpha * s)`` times log2(e) (base-2 logits), each
  row's maximum folded into ``cmax[r]`` (the kernels mask band edges and hidden keys after it, on
  the tiles that have them); ``score_bwd``
  takes the raw scores ``s`` and ``ds`` = dL/d(modified score) and overwrites ``ds`` with
  dL/d(raw score), and adds dL/d(capture) into ``cap_grad[i]`` (a contiguous ``real`` buffer shaped
  like capture ``i``, or NULL to skip it; each thread passes its own buffers and the caller sums
  them); ``mask`` writes ``mask_mod(...)`` as 0/1.
* ``cap[i]`` points at capture ``i``'s first element; captures are contiguous, in the order of
  :attr:`Generated.captures`; ``cap_sizes`` holds the sizes of every capture, one after the other.
* ``scalars[i]`` is run-time scalar ``i`` (:attr:`tileattn.programs.trace.Structure.scalars`), a
  Python float used as PyTorch uses one: converted to the dtype of each operation it enters.
* The return value is 0, or ``k + 1`` for the first failed check ``k`` of :attr:`Generated.checks`
  (an index out of range, an integer division by zero); the whole tile is computed either way, with
  out-of-range reads redirected to element 0.

fp32 exp, exp2, log, log2, tanh and sigmoid are the prelude's inline functions (``prelude.h``), so
the tile loops vectorise; the library is compiled with the native engine's instruction set.
Unsupported graphs raise :class:`~tileattn.programs.trace.Unsupported` naming the op.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .trace import INDEX_NAMES, Traced, Unsupported

PRELUDE = (Path(__file__).resolve().parent / "prelude.h").read_text()

FLOATS = {torch.float32: "float", torch.float64: "double"}
INTS = {torch.int8: "int8_t", torch.int16: "int16_t", torch.int32: "int32_t", torch.int64: "int64_t",
        torch.uint8: "uint8_t"}
#: dtypes a capture may have, with the C type of its storage
STORAGE = {**FLOATS, **INTS, torch.bool: "uint8_t", torch.bfloat16: "uint16_t", torch.float16: "uint16_t"}
INT_PREFIX = {torch.int8: "ta_i8", torch.int16: "ta_i16", torch.int32: "ta_i32", torch.int64: "ta_i64",
              torch.uint8: "ta_u8"}
FLOAT_PREFIX = {torch.float32: "ta_f32", torch.float64: "ta_f64"}
#: fp32 functions of the prelude that vectorise (libm's would keep a loop scalar)
INLINE_F32 = {"exp": "ta_expf", "exp2": "ta_exp2f", "log": "ta_logf", "log2": "ta_log2f", "tanh": "ta_tanhf"}

#: ops whose value is their first argument
PASS = {"alias", "detach", "clone", "lift_fresh_copy", "lift_fresh", "view", "reshape", "_unsafe_view",
        "contiguous", "positive"}
UNARY_FLOAT = {"exp": "exp", "exp2": "exp2", "expm1": "expm1", "log": "log", "log2": "log2", "log10": "log10",
               "log1p": "log1p", "tanh": "tanh", "sqrt": "sqrt", "sin": "sin", "cos": "cos", "atan": "atan",
               "erf": "erf"}
ROUNDING = {"floor": "floor", "ceil": "ceil", "trunc": "trunc", "round": "nearbyint"}
COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
BITWISE = {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^", "__and__": "&", "__or__": "|",
           "__xor__": "^"}
LOGICAL = {"logical_and": "&&", "logical_or": "||"}
SHIFTS = {"__lshift__": "lshift", "bitwise_left_shift": "lshift", "__rshift__": "rshift",
          "bitwise_right_shift": "rshift"}
CONSTANT_MAKERS = {"scalar_tensor", "full", "new_full", "zeros", "ones", "new_zeros", "new_ones", "zeros_like",
                   "ones_like", "full_like"}

#: aten op names (overload packets) the compiler translates; anything else is refused with its name
SUPPORTED_OPS = tuple(sorted(
    PASS | set(UNARY_FLOAT) | set(ROUNDING) | set(COMPARE) | set(BITWISE) | set(LOGICAL) | set(SHIFTS)
    | CONSTANT_MAKERS | {"add", "sub", "rsub", "mul", "div", "floor_divide", "remainder", "fmod", "neg", "abs",
                         "sgn", "sign", "sigmoid", "rsqrt", "reciprocal", "relu", "pow", "clamp", "clamp_min",
                         "clamp_max", "minimum", "maximum", "where", "_to_copy", "logical_not", "logical_xor",
                         "bitwise_not", "index", "select"}))


@dataclass(frozen=True)
class Check:
    capture: int        #: the capture the index reads (-1: an integer division by zero)
    dim: int            #: its dimension
    op: str             #: the graph node, for the message


@dataclass(frozen=True)
class Generated:
    kind: str                   #: "score" or "mask"
    source: str                 #: the C translation unit
    captures: tuple             #: per capture placeholder: its position in trace.structure()'s list
    checks: tuple               #: :class:`Check` per error code - 1
    reads: frozenset            #: which of b, h, q_idx, kv_idx the function reads
    grad_captures: tuple        #: captures that receive gradients in score_bwd (float dtypes)
    identity: bool = False      #: a score_mod that returns its score unchanged (callers may skip it)
    #: a score_mod that is ``c * tanh(score / c)``: ("literal", c) or ("scalar", its run-time slot)
    softcap: tuple = None


def _softcap_form(traced: Traced):
    """("literal", c) or ("scalar", slot) when the graph is exactly ``c * tanh(score / c)`` (the
    softcap of Gemma 2 and of transformers' flex path), else None."""
    graph = traced.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    calls = [n for n in graph.nodes if n.op == "call_function"]
    output = next(n for n in graph.nodes if n.op == "output").args[0]
    if traced.kind != "score" or len(calls) != 3 or calls[2] is not output:
        return None
    name = [getattr(n.target, "overloadpacket", n.target).__name__ for n in calls]
    div, tanh, mul = calls
    if name != ["div", "tanh", "mul"] or div.kwargs or div.args[0] is not placeholders[0] or tanh.args != (div,):
        return None
    cap = div.args[1]
    if mul.args not in ((tanh, cap), (cap, tanh)):
        return None
    scalars = placeholders[1 + len(INDEX_NAMES):1 + len(INDEX_NAMES) + traced.scalars]
    if isinstance(cap, float):
        return ("literal", cap)
    return ("scalar", scalars.index(cap)) if cap in scalars else None


@dataclass
class _Scalar:
    var: str                    #: C expression (a local variable or a literal)
    dtype: torch.dtype
    node: object = None         #: the graph node (None for literals)
    deps: frozenset = frozenset()   #: what it varies with: "score", "row" (b, h, q_idx), "col" (kv_idx)
    wrapped: bool = False       #: a run-time scalar: a double that enters each op as a Python float does


@dataclass
class _View:
    capture: int
    dims: tuple                 #: remaining dimensions of the capture
    offset: str                 #: element offset expression (int64)
    deps: frozenset = frozenset()


def _section(deps) -> str:
    """Where a value is computed: once per call, per row, per column, or per element."""
    if "score" in deps or {"row", "col"} <= deps:
        return "elem"
    return "row" if "row" in deps else "col" if "col" in deps else "const"


def _union(values) -> frozenset:
    return frozenset().union(*(v.deps for v in values if v is not None))


def _literal(value, dtype) -> str:
    if dtype == torch.bool:
        return "1" if value else "0"
    if dtype.is_floating_point:
        value = float(value)
        if math.isnan(value):
            text = "NAN"
        elif math.isinf(value):
            text = "INFINITY" if value > 0 else "(-INFINITY)"
        else:
            text = value.hex()
        return f"(({FLOATS[dtype]}){text})"
    value = int(value)
    if value == -2**63:
        return "((int64_t)(-9223372036854775807LL - 1))"
    return f"(({INTS[dtype]}){value}LL)"


def _dtype_of(arg) -> torch.dtype:
    if isinstance(arg, _Scalar):
        return arg.dtype
    if isinstance(arg, bool):
        return torch.bool
    return torch.int64 if isinstance(arg, int) else torch.float64


def _result_type(*args) -> torch.dtype:
    """PyTorch's type promotion for 0-d tensors and Python numbers."""
    probes = [(0.5 if a.wrapped else torch.empty((), dtype=a.dtype)) if isinstance(a, _Scalar) else a for a in args]
    out = probes[0] if len(probes) == 1 else torch.result_type(probes[0], probes[1])
    for p in probes[2:]:
        out = torch.result_type(torch.empty((), dtype=out), p)
    return out if isinstance(out, torch.dtype) else out.dtype


class _Emitter:
    def __init__(self, traced: Traced, kind: str, capture_meta):
        self.traced, self.kind = traced, kind
        self.capture_meta = capture_meta       # per capture placeholder: (dtype, ndim)
        self.sections = {"const": [], "row": [], "col": [], "elem": []}   # statements, by where they run
        self.ctypes = {}                       # bound variable -> its C type
        self.row_vars = []                     # variables of the "row" section, in order
        self.values = {}                       # fx node -> _Scalar | _View
        self.records = []                      # (node, op, out _Scalar, inputs, extra) for the backward
        self.checks = []
        self.counter = 0

    def fresh(self, stem="v"):
        self.counter += 1
        return f"{stem}{self.counter}"

    def ctype(self, dtype):
        if dtype in FLOATS:
            return FLOATS[dtype]
        if dtype in INTS:
            return INTS[dtype]
        if dtype == torch.bool:
            return "int"
        raise Unsupported(f"values of dtype {dtype} are not compiled (they would need {dtype} rounding)")

    def cast(self, value: _Scalar, dtype) -> str:
        if value.dtype == dtype:
            return value.var
        if dtype == torch.bool:
            return f"({value.var} != 0)"
        return f"(({self.ctype(dtype)}){value.var})"

    def scalar(self, arg, where) -> _Scalar:
        if isinstance(arg, torch.fx.Node):
            value = self.values[arg]
            if isinstance(value, _View):
                if value.dims:
                    raise Unsupported(f"{where} uses a captured tensor with {len(value.dims)} unindexed "
                                      "dimension(s) as a value; index it down to one element")
                return self.load(value)
            return value
        if isinstance(arg, (bool, int, float)):
            return _Scalar(_literal(arg, _dtype_of(arg)), _dtype_of(arg))
        raise Unsupported(f"{where} has an argument {arg!r} the compiler does not handle")

    def emit(self, line: str, deps, var=None):
        """Add a statement where ``deps`` says it runs; ``var`` names the value it defines."""
        section = _section(deps)
        self.sections[section].append(line)
        if var is not None and section == "row":
            self.row_vars.append(var)

    def bind(self, node, dtype, expr, op, inputs=(), extra=None, deps=None) -> _Scalar:
        var = self.fresh()
        deps = _union(inputs) if deps is None else deps
        self.ctypes[var] = self.ctype(dtype)
        self.emit(f"const {self.ctype(dtype)} {var} = {expr};", deps, var)
        out = _Scalar(var, dtype, node, deps)
        self.records.append((node, op, out, tuple(inputs), extra))
        return out

    def load(self, view: _View) -> _Scalar:
        dtype = self.capture_meta[view.capture][0]
        raw = f"((const {STORAGE[dtype]} *)cap[{view.capture}])[{view.offset}]"
        if dtype == torch.bfloat16:
            expr, out_dtype = f"ta_bf16({raw})", torch.float32
        elif dtype == torch.float16:
            expr, out_dtype = f"ta_f16({raw})", torch.float32
        elif dtype == torch.bool:
            expr, out_dtype = f"({raw} != 0)", torch.bool
        else:
            expr, out_dtype = raw, dtype
        return self.bind(None, out_dtype, expr, "load", extra=view, deps=view.deps)

    # ---- the graph ------------------------------------------------------------------------------
    def run(self):
        graph = self.traced.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        names = (["score"] if self.kind == "score" else []) + list(INDEX_NAMES)
        real = FLOATS.get(placeholders[0].meta["val"].dtype) if self.kind == "score" else None
        origin = {"score": "score", "b": "row", "h": "row", "q_idx": "row", "kv_idx": "col"}
        for node, name in zip(placeholders, names):
            dtype = node.meta["val"].dtype
            self.values[node] = _Scalar(f"in_{name}", dtype, node, frozenset((origin[name],)))
        scalars = placeholders[len(names):len(names) + self.traced.scalars]
        for i, node in enumerate(scalars):
            self.values[node] = _Scalar(f"sc{i}", torch.float64, node, wrapped=True)
        for i, node in enumerate(placeholders[len(names) + len(scalars):]):
            self.values[node] = _View(i, tuple(range(self.capture_meta[i][1])), "0")
        output = None
        for node in graph.nodes:
            if node.op == "get_attr":
                value, dtype = self.traced.constants[node.target]
                self.values[node] = _Scalar(_literal(value, dtype), dtype, node)
            elif node.op == "call_function":
                self.values[node] = self.call(node)
            elif node.op == "output":
                output = node.args[0]
                if isinstance(output, (tuple, list)):
                    if len(output) != 1:
                        raise Unsupported(f"the function returns {len(output)} values, expected one")
                    output = output[0]
        self.output = self.scalar(output, "the return value")
        if self.kind == "mask" and self.output.dtype != torch.bool:
            raise Unsupported(f"the mask_mod returns {self.output.dtype}, expected torch.bool")
        if self.kind == "score" and not self.output.dtype.is_floating_point:
            raise Unsupported(f"the score_mod returns {self.output.dtype}, expected a floating-point score")
        self.real = real

    def call(self, node):
        target = node.target
        name = target.overloadpacket.__name__ if hasattr(target, "overloadpacket") else str(target)
        name = name.rstrip("_") if name.endswith("_") and not name.startswith("__") else name
        val = node.meta.get("val")
        where = f"op {target} ({node.name})"
        if name not in SUPPORTED_OPS:
            raise Unsupported(f"{where} is not supported by the score_mod/mask_mod compiler")
        if name in ("index", "select"):
            return self.view_op(node, name, where)
        if not isinstance(val, torch.Tensor):
            raise Unsupported(f"{where} does not produce a tensor")
        if val.dim() != 0:
            raise Unsupported(f"{where} produces a tensor of shape {tuple(val.shape)}; score_mod/mask_mod must "
                              "work on single elements (index captured tensors down to one element)")
        out = val.dtype
        if out in (torch.bfloat16, torch.float16) and name not in PASS:
            raise Unsupported(f"{where} computes in {out}; only loads of {out} captures are compiled (convert "
                              "them with .float() before arithmetic)")
        args = node.args
        if name in PASS:
            return self.scalar(args[0], where)
        if name in CONSTANT_MAKERS:
            return self.constant(node, name, args, out, where)
        if name == "_to_copy":
            a = self.scalar(args[0], where)
            return self.bind(node, out, self.cast(a, out), "cast", [a])
        if name in ("add", "sub", "rsub"):
            a, b = self.scalar(args[0], where), self.scalar(args[1], where)
            if name == "rsub":
                a, b = b, a
            alpha = node.kwargs.get("alpha", args[2] if len(args) > 2 else 1)
            other = self.cast(b, out) if alpha == 1 else f"({_literal(alpha, out)} * {self.cast(b, out)})"
            op = "add" if name == "add" else "sub"
            return self.bind(node, out, f"{self.cast(a, out)} {'+' if op == 'add' else '-'} {other}", op, [a, b],
                             alpha)
        if name == "mul":
            a, b = self.scalar(args[0], where), self.scalar(args[1], where)
            return self.bind(node, out, f"{self.cast(a, out)} * {self.cast(b, out)}", "mul", [a, b])
        if name in ("div", "floor_divide"):
            mode = "floor" if name == "floor_divide" else node.kwargs.get("rounding_mode")
            return self.divide(node, self.scalar(args[0], where), self.scalar(args[1], where), mode, out, where)
        if name in ("remainder", "fmod"):
            a, b = self.scalar(args[0], where), self.scalar(args[1], where)
            if out in FLOATS:
                fn = f"{FLOAT_PREFIX[out]}_remainder" if name == "remainder" else f"fmod{self.suffix(out)}"
                return self.bind(node, out, f"{fn}({self.cast(a, out)}, {self.cast(b, out)})", name, [a, b])
            return self.int_division(node, name, a, b, out, where)
        if name in ("neg", "abs", "sgn", "sign", "sigmoid", "rsqrt", "reciprocal", "relu") or name in UNARY_FLOAT \
                or name in ROUNDING:
            return self.unary(node, name, self.scalar(args[0], where), out, where)
        if name == "pow":
            return self.power(node, args, out, where)
        if name in ("clamp", "clamp_min", "clamp_max"):
            return self.clamp(node, name, args, out, where)
        if name in ("minimum", "maximum"):
            a, b = self.scalar(args[0], where), self.scalar(args[1], where)
            fn = f"{FLOAT_PREFIX[out]}_{name[:3]}" if out in FLOATS else None
            ca, cb = self.cast(a, out), self.cast(b, out)
            expr = f"{fn}({ca}, {cb})" if fn else f"({ca} {'<' if name == 'minimum' else '>'} {cb} ? {ca} : {cb})"
            return self.bind(node, out, expr, name, [a, b])
        if name == "where":
            c, a, b = (self.scalar(x, where) for x in args[:3])
            return self.bind(node, out, f"({self.cast(c, torch.bool)} ? {self.cast(a, out)} : {self.cast(b, out)})",
                             "where", [c, a, b])
        if name in COMPARE:
            a, b = self.scalar(args[0], where), self.scalar(args[1], where)
            common = _result_type(a, b)
            return self.bind(node, out, f"({self.cast(a, common)} {COMPARE[name]} {self.cast(b, common)})", name,
                             [a, b])
        if name in LOGICAL or name == "logical_xor":
            a, b = self.scalar(args[0], where), self.scalar(args[1], where)
            op = LOGICAL.get(name, "!=")
            return self.bind(node, out, f"({self.cast(a, torch.bool)} {op} {self.cast(b, torch.bool)})", name,
                             [a, b])
        if name == "logical_not":
            a = self.scalar(args[0], where)
            return self.bind(node, out, f"(!{self.cast(a, torch.bool)})", name, [a])
        if name in BITWISE or name == "bitwise_not":
            if out.is_floating_point:
                raise Unsupported(f"{where} applies a bitwise op to floating-point values")
            if name == "bitwise_not":
                a = self.scalar(args[0], where)
                expr = f"(!{a.var})" if out == torch.bool else f"(({self.ctype(out)})~{self.cast(a, out)})"
                return self.bind(node, out, expr, name, [a])
            a, b = self.scalar(args[0], where), self.scalar(args[1], where)
            return self.bind(node, out, f"({self.cast(a, out)} {BITWISE[name]} {self.cast(b, out)})", name, [a, b])
        if name in SHIFTS:
            if out not in INT_PREFIX:
                raise Unsupported(f"{where} shifts values of dtype {out}")
            a, b = self.scalar(args[0], where), self.scalar(args[1], where)
            return self.bind(node, out, f"{INT_PREFIX[out]}_{SHIFTS[name]}({self.cast(a, out)}, {self.cast(b, out)})",
                             name, [a, b])
        raise AssertionError(f"SUPPORTED_OPS lists {name} without a translation")

    @staticmethod
    def suffix(dtype):
        return "f" if dtype == torch.float32 else ""

    def constant(self, node, name, args, out, where):
        if name in ("new_zeros", "zeros", "zeros_like"):
            value = 0
        elif name in ("new_ones", "ones", "ones_like"):
            value = 1
        elif name == "scalar_tensor":
            value = args[0]
        else:
            value = args[-1] if name != "new_full" else args[2]
        if isinstance(value, torch.fx.Node):
            raise Unsupported(f"{where} fills a tensor with a traced value")
        return _Scalar(_literal(value, out), out, node)

    def divide(self, node, a, b, mode, out, where):
        if mode is None:
            if out in FLOATS and not b.deps and a.deps:
                # x / c for a divisor fixed for the call (a literal, a run-time scalar): x times 1/c,
                # computed once. A vector division costs ~30x a multiply; the result differs from the
                # division by at most one rounding (within the accuracy rule, and what the built-in
                # softcap does)
                inverse = self.fresh("inv")
                self.emit(f"const {FLOATS[out]} {inverse} = 1 / {self.cast(b, out)};", frozenset())
                return self.bind(node, out, f"{self.cast(a, out)} * {inverse}", "div", [a, b])
            return self.bind(node, out, f"{self.cast(a, out)} / {self.cast(b, out)}", "div", [a, b])
        if out in FLOATS:
            ca, cb = self.cast(a, out), self.cast(b, out)
            expr = (f"{FLOAT_PREFIX[out]}_floordiv({ca}, {cb})" if mode == "floor"
                    else f"trunc{self.suffix(out)}({ca} / {cb})")
            return self.bind(node, out, expr, "rounded_div", [a, b])
        return self.int_division(node, "floordiv" if mode == "floor" else "truncdiv", a, b, out, where)

    def int_division(self, node, fn, a, b, out, where):
        if out not in INT_PREFIX:
            raise Unsupported(f"{where} divides values of dtype {out}")
        flag = self.check(-1, 0, node.name)
        return self.bind(node, out, f"{INT_PREFIX[out]}_{fn}({self.cast(a, out)}, {self.cast(b, out)}, &{flag})",
                         "int_division", [a, b])

    def unary(self, node, name, a, out, where):
        ca, suf = self.cast(a, out), self.suffix(out)
        if name == "neg":
            expr = f"(-{ca})"
        elif name == "abs":
            expr = f"fabs{suf}({ca})" if out in FLOATS else f"({ca} < 0 ? -{ca} : {ca})"
        elif name in ("sgn", "sign"):
            expr = f"{FLOAT_PREFIX[out]}_sgn({ca})" if out in FLOATS else f"(({ca} > 0) - ({ca} < 0))"
        elif name == "relu":
            expr = f"({ca} < 0 ? 0 : {ca})"
        elif out not in FLOATS:
            if name in ROUNDING:
                return a
            raise Unsupported(f"{where} applies {name} to {out} values")
        elif name == "sigmoid":
            expr = f"ta_sigmoidf({ca})" if out == torch.float32 else f"ta_sigmoid({ca})"
        elif name == "rsqrt":
            expr = f"((({FLOATS[out]})1) / sqrt{suf}({ca}))"
        elif name == "reciprocal":
            expr = f"((({FLOATS[out]})1) / {ca})"
        elif name in ROUNDING:
            expr = f"{ROUNDING[name]}{suf}({ca})"
        elif out == torch.float32 and name in INLINE_F32:
            expr = f"{INLINE_F32[name]}({ca})"
        else:
            expr = f"{UNARY_FLOAT[name]}{suf}({ca})"
        return self.bind(node, out, expr, name, [a])

    def power(self, node, args, out, where):
        base, exponent = args[0], args[1]
        if not isinstance(base, torch.fx.Node):  # pow.Scalar: a number to a tensor power
            b = self.scalar(exponent, where)
            if out not in FLOATS:
                raise Unsupported(f"{where} raises an integer to a tensor power")
            return self.bind(node, out, f"pow{self.suffix(out)}({_literal(base, out)}, {self.cast(b, out)})",
                             "pow_scalar_base", [b], float(base))
        a = self.scalar(base, where)
        if not isinstance(exponent, torch.fx.Node):
            if out in FLOATS:
                return self.bind(node, out, f"{FLOAT_PREFIX[out]}_pows({self.cast(a, out)}, {float(exponent)!r})",
                                 "pow_scalar", [a], float(exponent))
            if int(exponent) < 0:
                raise Unsupported(f"{where} raises an integer to a negative power (PyTorch refuses it)")
            return self.bind(node, out, f"{INT_PREFIX[out]}_pow({self.cast(a, out)}, {int(exponent)})", "pow_int",
                             [a])
        b = self.scalar(exponent, where)
        if out in FLOATS:
            return self.bind(node, out, f"pow{self.suffix(out)}({self.cast(a, out)}, {self.cast(b, out)})",
                             "pow", [a, b])
        return self.bind(node, out, f"{INT_PREFIX[out]}_pow({self.cast(a, out)}, {self.cast(b, out)})", "pow_int",
                         [a, b])

    def clamp(self, node, name, args, out, where):
        a = self.scalar(args[0], where)
        if name == "clamp":
            lo = node.kwargs.get("min", args[1] if len(args) > 1 else None)
            hi = node.kwargs.get("max", args[2] if len(args) > 2 else None)
        else:
            bound = node.kwargs.get(name[-3:], args[1])
            lo, hi = (bound, None) if name == "clamp_min" else (None, bound)
        lo = None if lo is None else self.scalar(lo, where)
        hi = None if hi is None else self.scalar(hi, where)
        deps = _union([a, lo, hi])
        var = self.fresh("c")
        self.emit(f"{self.ctype(out)} {var} = {self.cast(a, out)};", deps)
        if lo is not None:
            self.emit(f"{var} = ({var} < {self.cast(lo, out)}) ? {self.cast(lo, out)} : {var};", deps)
        if hi is not None:
            self.emit(f"{var} = ({var} > {self.cast(hi, out)}) ? {self.cast(hi, out)} : {var};", deps)
        return self.bind(node, out, var, "clamp", [a, lo, hi])

    # ---- captured tensors -----------------------------------------------------------------------
    def check(self, capture, dim, op) -> str:
        self.checks.append(Check(capture, dim, op))
        return f"bad{len(self.checks)}"

    def view_op(self, node, name, where):
        base = self.values[node.args[0]]
        if not isinstance(base, _View):
            raise Unsupported(f"{where} indexes a value computed inside the function; only captured tensors "
                              "are indexed")
        if name == "select":
            dim, index = node.args[1], node.args[2]
            dim = dim + len(base.dims) if dim < 0 else dim
            positions = {dim: index}
        else:
            indices = node.args[1]
            if any(i is None for i in indices):
                raise Unsupported(f"{where} indexes a captured tensor with ':' before a tensor index; index "
                                  "the leading dimensions")
            positions = dict(enumerate(indices))
        if len(positions) > len(base.dims):
            raise Unsupported(f"{where} uses more indices than the tensor has dimensions")
        offset, deps = base.offset, base.deps
        for pos, index in positions.items():
            idx = self.scalar(index, where)
            if idx.dtype not in INTS or idx.dtype == torch.uint8:
                raise Unsupported(f"{where} indexes with a {idx.dtype} value (only integer indices are compiled)")
            dim, deps = base.dims[pos], deps | idx.deps
            size = f"cap{base.capture}_size{dim}"
            i, ok, var = self.fresh("i"), self.fresh("ok"), self.fresh("off")
            flag = self.check(base.capture, dim, node.name)
            for line in (f"int64_t {i} = (int64_t){idx.var};", f"{i} += ({i} < 0) ? {size} : 0;",
                         f"const int {ok} = (uint64_t){i} < (uint64_t){size};", f"{flag} |= !{ok};",
                         f"{i} = {ok} ? {i} : 0;"):
                self.emit(line, deps)
            self.emit(f"const int64_t {var} = {offset} + {i} * cap{base.capture}_stride{dim};", deps, var)
            self.ctypes[var] = "int64_t"
            offset = var
        return _View(base.capture, tuple(d for p, d in enumerate(base.dims) if p not in positions), offset, deps)


# ---- the derivative ------------------------------------------------------------------------------
#: ops whose output does not depend differentiably on their inputs (PyTorch gives zero gradients)
_NOT_DIFFERENTIABLE = {"rounded_div", "int_division", "sgn", "sign", "pow_int"} | set(ROUNDING)


def _contributions(em: _Emitter, op, out: _Scalar, inputs, extra):
    """[(input, expression of its gradient in the output's type)] for one record; ``g`` is the adjoint
    of the output. The rules are PyTorch's (tools/autograd/derivatives.yaml)."""
    dt, g, o, suf = out.dtype, f"g_{out.var}", out.var, _Emitter.suffix(out.dtype)
    ct = FLOATS[dt]
    c = [None if x is None else em.cast(x, dt) for x in inputs]
    a = inputs[0] if inputs else None
    one = {"exp": f"{g} * {o}", "exp2": f"{g} * {o} * ({ct})M_LN2", "expm1": f"{g} * ({o} + 1)",
           "log": f"{g} / {c[0] if c else ''}", "neg": f"(-{g})", "cast": g,
           "tanh": f"{g} * (1 - {o} * {o})", "sigmoid": f"{g} * (1 - {o}) * {o}", "sqrt": f"{g} / (2 * {o})",
           "rsqrt": f"(({ct})-0.5) * {g} * {o} * {o} * {o}", "reciprocal": f"(-{g}) * {o} * {o}",
           "relu": f"({o} <= 0 ? 0 : {g})"}
    if op in one:
        return [(a, one[op])]
    if op in ("log2", "log10", "log1p", "abs", "sin", "cos", "atan", "erf"):
        x = c[0]
        rule = {"log2": f"{g} / ({x} * ({ct})M_LN2)", "log10": f"{g} / ({x} * ({ct})M_LN10)",
                "log1p": f"{g} / ({x} + 1)", "abs": f"{g} * {FLOAT_PREFIX[dt]}_sgn({x})",
                "sin": f"{g} * cos{suf}({x})", "cos": f"(-{g}) * sin{suf}({x})", "atan": f"{g} / ({x} * {x} + 1)",
                "erf": f"({ct})M_2_SQRTPI * exp{suf}(-({x} * {x})) * {g}"}[op]
        return [(a, rule)]
    if op in ("add", "sub"):
        alpha = "" if extra == 1 else f" * {_literal(extra, dt)}"
        return [(inputs[0], g), (inputs[1], f"{'' if op == 'add' else '-'}{g}{alpha}")]
    if op == "mul":
        return [(inputs[0], f"{g} * {c[1]}"), (inputs[1], f"{g} * {c[0]}")]
    if op == "div":
        return [(inputs[0], f"{g} / {c[1]}"), (inputs[1], f"(-{g}) * (({c[0]} / {c[1]}) / {c[1]})")]
    if op == "remainder":
        return [(inputs[0], g), (inputs[1], f"(-{g}) * {FLOAT_PREFIX[dt]}_floordiv({c[0]}, {c[1]})")]
    if op == "fmod":
        return [(inputs[0], g), (inputs[1], f"(-{g}) * trunc{suf}({c[0]} / {c[1]})")]
    if op == "pow_scalar":
        return [] if extra == 0 else [(a, f"{g} * ({ct}){extra!r} * {FLOAT_PREFIX[dt]}_pows({c[0]}, {extra - 1!r})")]
    if op == "pow":
        x, e = c
        return [(inputs[0], f"(({e} == 0) ? 0 : {g} * {e} * pow{suf}({x}, {e} - 1))"),
                (inputs[1], f"{g} * ((({x} == 0) && ({e} >= 0)) ? 0 : {o} * log{suf}({x}))")]
    if op == "pow_scalar_base":
        return [(a, f"{g} * ((({extra!r} == 0) && ({c[0]} >= 0)) ? 0 : {o} * log{suf}(({ct}){extra!r}))")]
    if op in ("maximum", "minimum"):
        x, y = c
        win, lose = (">", "<") if op == "maximum" else ("<", ">")
        return [(inputs[0], f"(({x} == {y}) ? {g} / 2 : (({x} {lose} {y}) ? 0 : {g}))"),
                (inputs[1], f"(({x} == {y}) ? {g} / 2 : (({x} {win} {y}) ? 0 : {g}))")]
    if op == "where":
        cond = em.cast(inputs[0], torch.bool)
        return [(inputs[1], f"({cond} ? {g} : 0)"), (inputs[2], f"({cond} ? 0 : {g})")]
    if op == "clamp":
        x, lo, hi = c
        keep = " && ".join(t for t in (lo and f"{x} >= {lo}", hi and f"{x} <= {hi}") if t) or "1"
        out = [(inputs[0], f"(({keep}) ? {g} : 0)")]
        if lo is not None:
            cond = f"{x} < {lo}" + (f" && {lo} < {hi}" if hi is not None else "")
            out.append((inputs[1], f"(({cond}) ? {g} : 0)"))
        if hi is not None:
            cond = f"{x} > {hi}" + (f" || {hi} < {lo}" if lo is not None else "")
            out.append((inputs[2], f"(({cond}) ? {g} : 0)"))
        return out
    raise Unsupported(f"no derivative rule for {op}")


def _backward_lines(em: _Emitter):
    """Statements that turn ``g_<output>`` into the adjoints of the score and of every float load;
    returns (lines, adjoint variables to declare, loads that receive gradients)."""
    active = {"in_score"} if em.kind == "score" else set()
    for node, op, out, inputs, extra in em.records:
        if out.dtype not in FLOATS:
            continue
        if op == "load" or (op not in _NOT_DIFFERENTIABLE and any(x is not None and x.var in active for x in inputs)):
            active.add(out.var)
    needed = {em.output.var} & active
    body = []
    for node, op, out, inputs, extra in reversed(em.records):
        if out.var not in needed or op == "load":
            continue
        for x, expr in _contributions(em, op, out, inputs, extra):
            if x is not None and x.var in active:
                needed.add(x.var)
                body.append(f"g_{x.var} += ({FLOATS[x.dtype]})({expr});")
    loads = [(out, extra) for node, op, out, inputs, extra in em.records if op == "load" and out.var in needed]
    return body, needed, loads


# ---- assembly ------------------------------------------------------------------------------------
_INDEX_ARGS = "const int32_t *restrict b, const int32_t *restrict h, const int32_t *restrict q, " \
              "const int32_t *restrict kv, const void *const *cap, const int64_t *cap_sizes, " \
              "const double *scalars"


#: rows whose row-only values are computed ahead into stack arrays (per chunk of the tile's rows)
ROW_CHUNK = 256
_AT = "j * ld + r0 + r"   # the element's position in a key-major tile
_AT_ROWS = "r * ld + j"   # in a row-major tile


def _prologue(em: _Emitter):
    lines, base = [], 0
    for i, (dtype, ndim) in enumerate(em.capture_meta):
        for d in range(ndim):
            lines.append(f"const int64_t cap{i}_size{d} = cap_sizes[{base + d}];")
        for d in reversed(range(ndim)):
            nxt = f"cap{i}_stride{d + 1} * cap{i}_size{d + 1}" if d + 1 < ndim else "1"
            lines.append(f"const int64_t cap{i}_stride{d} = {nxt};")
        base += ndim
    lines += [f"const double sc{i} = scalars[{i}];" for i in range(em.traced.scalars)]
    lines += [f"int bad{k + 1} = 0;" for k in range(len(em.checks))]
    return "".join(f"    {x}\n" for x in lines + em.sections["const"])


def _mentions(lines, name) -> bool:
    return re.search(rf"\b{name}\b", "\n".join(lines)) is not None


def _block(lines, indent):
    return "".join(" " * indent + x + "\n" for x in lines)


def _reads(lines, offset):
    """The index arguments a block of statements reads, loaded for row ``r``."""
    return [f"const int32_t in_{n} = {src}[{offset}r];" for n, src in (("b", "b"), ("h", "h"), ("q_idx", "q"))
            if _mentions(lines, f"in_{n}")]


def _loop(em: _Emitter, head, tail, col_open=(), col_close=(), chunk_open=(), chunk_close=(), row_arrays=()):
    """The key-major loop nest. Per chunk of rows: values that vary only with the row (b, h, q_idx) are
    computed once per row into arrays; per column, values that vary only with kv_idx; then the inner
    loop over the chunk's rows (contiguous in the tile) computes the rest, ``head`` first and ``tail``
    last. ``col_open``/``col_close`` run around each column's inner loop, ``chunk_open``/``chunk_close``
    around each chunk's columns (the per-column and per-row sums of the backward, which read the
    ``row_arrays`` of row values after the columns)."""
    elem = head + em.sections["elem"] + tail
    row_vars = [v for v in em.row_vars if _mentions(elem + list(col_close), v) or v in row_arrays]
    row = _reads(em.sections["row"], "r0 + ") + em.sections["row"] + [f"row_{v}[r] = {v};" for v in row_vars]
    col = (["const int32_t in_kv_idx = kv[j];"] if _mentions(em.sections["col"] + elem, "in_kv_idx") else []) \
        + em.sections["col"]
    inner = _reads(elem, "r0 + ") + [f"const {em.ctypes[v]} {v} = row_{v}[r];" for v in row_vars] + elem
    text = (f"    for (int64_t r0 = 0; r0 < rows; r0 += {ROW_CHUNK}) {{\n"
            f"        const int64_t rn = rows - r0 < {ROW_CHUNK} ? rows - r0 : {ROW_CHUNK};\n"
            + _block([f"{em.ctypes[v]} row_{v}[{ROW_CHUNK}];" for v in row_vars], 8) + _block(chunk_open, 8))
    if row:
        text += "        for (int64_t r = 0; r < rn; ++r) {\n" + _block(row, 12) + "        }\n"
    return (text + "        for (int64_t j = 0; j < cols; ++j) {\n" + _block(col, 12) + _block(col_open, 12)
            + "            for (int64_t r = 0; r < rn; ++r) {\n" + _block(inner, 16) + "            }\n"
            + _block(col_close, 12) + "        }\n" + _block(chunk_close, 8) + "    }\n")


def _loop_rows(em: _Emitter, head, tail):
    """The row-major loop nest: per row its row-only values, then the columns (contiguous) inside."""
    elem = head + em.sections["elem"] + tail
    row = _reads(em.sections["row"] + em.sections["col"] + elem, "") + em.sections["row"]
    col = (["const int32_t in_kv_idx = kv[j];"] if _mentions(em.sections["col"] + elem, "in_kv_idx") else []) \
        + em.sections["col"]
    return ("    for (int64_t r = 0; r < rows; ++r) {\n" + _block(row, 8)
            + "        for (int64_t j = 0; j < cols; ++j) {\n" + _block(col + elem, 12) + "        }\n    }\n")


def _epilogue(em: _Emitter, lines=()):
    return (_block(lines, 4) + "".join(f"    if (bad{k + 1}) return {k + 1};\n" for k in range(len(em.checks)))
            + "    return 0;\n}\n")


def _function(name, params, em, body, tail=()):
    return f"int {name}({params}) {{\n" + _prologue(em) + body + _epilogue(em, tail)


def _capture_sums(em: _Emitter, loads, real):
    """How the backward adds each float load's adjoint into its capture's gradient: summed per row,
    per column or over the whole tile where its index varies with only those (so the inner loop stays
    vectorisable), scattered element by element otherwise. Returns the statements of each place."""
    places = {"inner": [], "col_open": [], "col_close": [], "chunk_open": [], "chunk_close": [], "start": [],
              "end": [], "row_arrays": []}
    for k, (out, view) in enumerate(loads):
        grad, g, off = f"grad{view.capture}", f"g_{out.var}", view.offset
        section = _section(view.deps)
        if section == "elem":
            places["inner"].append(f"if ({grad}) {grad}[{off}] += ({real}){g};")
        elif section == "row":
            places["chunk_open"].append(f"{real} racc{k}[{ROW_CHUNK}] = {{0}};")
            places["inner"].append(f"racc{k}[r] += ({real}){g};")
            places["chunk_close"].append(f"if ({grad}) for (int64_t r = 0; r < rn; ++r) "
                                         f"{grad}[row_{off}[r]] += racc{k}[r];")
            places["row_arrays"].append(off)
        elif section == "col":
            places["col_open"].append(f"{real} cacc{k} = 0;")
            places["inner"].append(f"cacc{k} += ({real}){g};")
            places["col_close"].append(f"if ({grad}) {grad}[{off}] += cacc{k};")
        else:
            places["start"].append(f"{real} kacc{k} = 0;")
            places["inner"].append(f"kacc{k} += ({real}){g};")
            places["end"].append(f"if ({grad}) {grad}[{off}] += kacc{k};")
    return places


def generate(traced: Traced, kind: str, capture_meta) -> Generated:
    """C source of the tile functions of one traced function (``capture_meta``: (dtype, ndim) of each
    capture placeholder, in order)."""
    for dtype, _ in capture_meta:
        if dtype not in STORAGE:
            raise Unsupported(f"captured tensors of dtype {dtype} are not compiled")
    em = _Emitter(traced, kind, capture_meta)
    em.run()
    parts = [PRELUDE]
    if kind == "mask":
        params = f"int64_t rows, int64_t cols, int64_t ld, uint8_t *restrict out, {_INDEX_ARGS}"
        parts.append(_function("ta_user_mask", params, em,
                               _loop(em, [], [f"out[{_AT}] = (uint8_t){em.output.var};"])))
        parts.append(_function("ta_user_mask_rows", params, em,
                               _loop_rows(em, [], [f"out[{_AT_ROWS}] = (uint8_t){em.output.var};"])))
        grads = ()
    else:
        real = em.real
        params = f"int64_t rows, int64_t cols, int64_t ld, {real} *restrict s, {_INDEX_ARGS}"
        parts.append(_function("ta_user_score", params, em,
                               _loop(em, [f"const {real} in_score = s[{_AT}];"],
                                     [f"s[{_AT}] = ({real}){em.output.var};"])))
        parts.append(_function("ta_user_score_rows", params, em,
                               _loop_rows(em, [f"const {real} in_score = s[{_AT_ROWS}];"],
                                          [f"s[{_AT_ROWS}] = ({real}){em.output.var};"])))
        logits = [f"const {real} y = ({real}){em.output.var} * ({real})1.4426950408889634;", f"s[{_AT}] = y;",
                  "cmax[r0 + r] = y > cmax[r0 + r] ? y : cmax[r0 + r];"]
        parts.append(_function("ta_user_logits", params + f", {real} alpha, {real} *restrict cmax", em,
                               _loop(em, [f"const {real} in_score = s[{_AT}] * alpha;"], logits)))
        body, needed, loads = _backward_lines(em)
        adjoints = [f"{FLOATS[t]} g_{v} = 0;" for v, t in _adjoint_types(em, needed)]
        seed = [f"g_{em.output.var} += ({FLOATS[em.output.dtype]})ds[{_AT}];"] if em.output.var in needed else []
        result = "g_in_score" if "in_score" in needed else "0"
        grads = tuple(sorted({view.capture for _, view in loads}))
        sums = _capture_sums(em, loads, real)
        tail = adjoints + seed + body + [f"ds[{_AT}] = ({real}){result};"] + sums["inner"]
        grad_ptrs = [f"{real} *restrict grad{i} = cap_grad ? cap_grad[{i}] : 0;" for i in grads]
        params = (f"int64_t rows, int64_t cols, int64_t ld, const {real} *restrict s, {real} *restrict ds, "
                  f"{_INDEX_ARGS}, {real} *const *cap_grad")
        loop = _loop(em, [f"const {real} in_score = s[{_AT}];"], tail, sums["col_open"], sums["col_close"],
                     sums["chunk_open"], sums["chunk_close"], sums["row_arrays"])
        parts.append(_function("ta_user_score_bwd", params, em, _block(grad_ptrs + sums["start"], 4) + loop,
                               sums["end"]))
    output = next(n for n in traced.graph.nodes if n.op == "output").args[0]
    first = next(n for n in traced.graph.nodes if n.op == "placeholder")
    return Generated(kind=kind, source="\n".join(parts), captures=traced.captures, checks=tuple(em.checks),
                     reads=traced.reads, grad_captures=grads, identity=kind == "score" and output is first,
                     softcap=_softcap_form(traced) if kind == "score" else None)


def _adjoint_types(em: _Emitter, needed):
    types_ = {"in_score": torch.float64 if em.real == "double" else torch.float32}
    types_.update({out.var: out.dtype for _, _, out, _, _ in em.records})
    return sorted(((v, types_[v]) for v in needed), key=lambda item: item[0])
