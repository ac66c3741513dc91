"""The kernels' argument records (``csrc/ta.h``), filled by field name.

The C header declares each record once, as an X-macro (``TA_FIELDS`` for ``ta_args``,
``TA_USER_FIELDS`` for ``ta_user_args``); the library exports that list as a string (``ta_abi``,
``ta_user_abi``: ``section:name:kind,...``). Everything Python knows of the layout is derived from
it here, when the library loads:

* :class:`Record` gives each field its byte offset and each section (a contiguous run of fields
  written together) a *filler*: a function generated from the field list whose keyword arguments
  are the field names (absent ones are 0), packing the whole section with one ``struct.pack_into``.
  So no caller counts positions, and a field added to the header is a keyword here at once.
* :func:`structure` builds a ``ctypes.Structure`` from a record's list (the user record, passed by
  pointer), and :class:`UserCall` fills one for a call.

Kinds: ``p`` pointer, ``i`` int64, ``d`` double, ``i3``/``i4``/``i6`` int64 arrays (a tuple of
that length).
"""

from __future__ import annotations

import ctypes
import struct
from typing import Callable, Dict, List, Optional, Tuple

import torch

_ELEMENT = {"p": "Q", "i": "q", "d": "d", "i3": "3q", "i4": "4q", "i6": "6q"}
_WIDTH = {"p": 1, "i": 1, "d": 1, "i3": 3, "i4": 4, "i6": 6}
_CTYPE = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "d": ctypes.c_double, "i3": ctypes.c_int64 * 3,
          "i4": ctypes.c_int64 * 4, "i6": ctypes.c_int64 * 6}


def parse(abi: str) -> List[Tuple[str, str, str]]:
    """[(section, name, kind)] of an exported description."""
    return [tuple(field.split(":")) for field in abi.strip(",").split(",")]  # type: ignore[misc]


def _filler(offset: int, fields: List[Tuple[str, str]], packer: struct.Struct) -> Callable:
    """``fill(buffer, **fields)``: the section at ``offset`` packed from keyword arguments named like
    the fields (missing ones 0; an array field takes a tuple)."""
    params, values = [], []
    for name, kind in fields:
        width = _WIDTH[kind]
        default = "0.0" if kind == "d" else "0" if width == 1 else "(" + "0, " * width + ")"
        params.append(f"{name}={default}")
        values += [name] if width == 1 else [f"{name}[{i}]" for i in range(width)]
    source = (f"def fill(buffer, *, {', '.join(params)}):\n"
              f"    _pack(buffer, {offset}, {', '.join(values)})\n")
    namespace = {"_pack": packer.pack_into}
    exec(compile(source, f"<tileattn native record {offset}>", "exec"), namespace)  # noqa: S102 - from the ABI
    return namespace["fill"]


class Record:
    """The layout of one record: ``size`` in bytes, ``offset[name]``, and ``fill[section]``."""

    def __init__(self, abi: str):
        self.size, self.offset = 0, {}
        self.fields: Dict[str, List[Tuple[str, str]]] = {}
        starts: Dict[str, int] = {}
        formats: Dict[str, str] = {}
        for section, name, kind in parse(abi):
            if section in starts and list(self.fields)[-1] != section:
                raise ValueError(f"section {section!r} of the record is not contiguous")
            starts.setdefault(section, self.size)
            self.fields.setdefault(section, []).append((name, kind))
            formats[section] = formats.get(section, "<") + _ELEMENT[kind]
            self.offset[name] = self.size
            self.size += 8 * _WIDTH[kind]
        self.section_offset = starts
        self.fill = {section: _filler(starts[section], self.fields[section], struct.Struct(formats[section]))
                     for section in self.fields}

    def names(self, section: str) -> Tuple[str, ...]:
        return tuple(name for name, _ in self.fields[section])


def structure(abi: str, name: str) -> type:
    """A ``ctypes.Structure`` with the fields of an exported description, in order."""
    return type(name, (ctypes.Structure,), {"_fields_": [(field, _CTYPE[kind]) for _, field, kind in parse(abi)]})


class UserCall:
    """The user record of one call (csrc/ta.h's ta_user_args: user functions, a block map, the status
    word) and everything it points at, kept alive for the call. ``score``/``mask``: bound programs
    (:class:`tileattn.programs.compiler.Bound`); ``states``: a :class:`tileattn.programs.blocks.BlockStates`;
    ``grads``: per capture of the score program, a buffer (threads, *shape) of its dtype or None."""

    def __init__(self, lib, score=None, mask=None, states=None, grads=None):
        self.score, self.mask, self.states, self.grads = score, mask, states, grads
        record, keep = lib.UserArgs(), []
        for name, bound, functions in (("score", score, ("ta_user_score", "ta_user_score_rows", "ta_user_score_bwd",
                                                         "ta_user_logits")),
                                       ("mask", mask, ("ta_user_mask", "ta_user_mask_rows"))):
            if bound is None:
                continue
            pointers, sizes, scalars, tensors = bound.pack()
            keep += [pointers, sizes, scalars, tensors]
            for field, function in zip(("_fn", "_rows_fn", "_bwd_fn", "_logits_fn"), functions):
                setattr(record, name + field, bound.program.address(function))
            setattr(record, name + "_cap", ctypes.addressof(pointers))
            setattr(record, name + "_sizes", ctypes.addressof(sizes))
            setattr(record, name + "_scalars", ctypes.addressof(scalars))
        if grads is not None:
            threads = max(g.shape[0] for g in grads if g is not None)
            table = (ctypes.c_void_p * (threads * len(grads)))(*[
                None if g is None else g[t].data_ptr() for t in range(threads) for g in grads])
            keep.append(table)
            record.score_grad, record.score_ncap = ctypes.addressof(table), len(grads)
        if states is not None:
            st = states.states
            record.states = st.data_ptr()
            record.states_st = tuple(st.stride(d) if st.shape[d] > 1 else 0 for d in range(4))
            record.block_q, record.block_kv = states.block_q, states.block_kv
            record.map_q_len, record.map_kv_len = states.q_len, states.kv_len
        self.status = ctypes.c_int32(0)
        record.status = ctypes.addressof(self.status)
        self._record, self._keep = record, keep
        self.address = ctypes.addressof(record)

    @classmethod
    def of(cls, lib, args, capture_grads=None, threads: Optional[int] = None) -> Optional["UserCall"]:
        """The user record of a call whose kernel arguments (:class:`tileattn.core.kernel_args.KernelArgs`)
        have user functions or a block map, None without; with ``capture_grads`` (a backward's gradients
        of the captured tensors that require grad) a buffer of ``threads`` for each of them."""
        if not args.per_call or args.score_mod is None and args.mask_mod is None and args.block_states is None:
            return None
        score = args.score_mod.bound if args.score_mod is not None else None
        grads = None
        if capture_grads and score is not None:
            wanted = {id(t) for t in args.score_mod.grad_captures}
            grads = [torch.zeros((threads, *t.shape), dtype=score.program.dtype) if id(t) in wanted else None
                     for t in score.captures]
        call = cls(lib, score, args.mask_mod.bound if args.mask_mod is not None else None, args.block_states, grads)
        call.grad_captures = args.score_mod.grad_captures if grads is not None else ()
        return call

    def add_capture_grads(self, captures):
        """Add what the threads computed of each captured tensor's gradient (each into its own buffer)
        to ``captures``, the gradients of :attr:`grad_captures` in order."""
        wanted = {id(t): i for i, t in enumerate(self.grad_captures)}
        for t, buffer in zip(self.score.captures, self.grads):
            if buffer is not None:
                captures[wanted[id(t)]] += buffer.sum(0).to(captures[wanted[id(t)]].dtype)

    def raise_failed(self):
        """Raise the error a user function reported (an index out of range), if any."""
        code = self.status.value
        if code > 0:
            self.score.program.raise_check(code, self.score.captures)
        elif code < 0:
            self.mask.program.raise_check(-code, self.mask.captures)
