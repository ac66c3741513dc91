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
  pointer).

Kinds: ``p`` pointer, ``i`` int64, ``d`` double, ``i3``/``i4``/``i6`` int64 arrays (a tuple of
that length).
"""

from __future__ import annotations

import ctypes
import struct
from typing import Callable, Dict, List, Tuple

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
