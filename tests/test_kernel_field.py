"""A new kernel argument costs the files of docs/architecture.md's worked example, and no others: the
engines' Python code passes the numbers of :class:`tileattn.core.kernel_args.KernelArgs` on by name, to
the native record's fields of those names (and the prepared decode call's) and to Triton's
``Scalars`` and ``Flags``. Here a toy field, ``toy``, travels that path on a subclass of the record
(no engine file changes), up to the one place that must learn it: the C header, which refuses a name
it does not declare."""

from __future__ import annotations

import re
import struct
from dataclasses import fields, make_dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from tileattn.backends.native import NativeBackend, kernels
from tileattn.backends.native.record import Record
from tileattn.core.kernel_args import KernelArgs
from tileattn.core.spec import build_spec

from conftest import make_qkv

ROOT = Path(__file__).resolve().parents[1]
#: The files a new kernel argument used by the native and Triton engines touches (docs/architecture.md).
NEW_FIELD_FILES = (
    "tileattn/core/kernel_args.py",
    "tileattn/core/modifiers.py",
    "tileattn/backends/native/csrc/ta.h",
    "tileattn/backends/native/csrc/tile.h",
    "tileattn/backends/triton/arguments.py",
    "tileattn/backends/triton/tile_math.py",
)
ToyArgs = make_dataclass("ToyArgs", [("toy", float, 0.0)], bases=(KernelArgs,), frozen=True)


def _toy_spec(value: float, **kwargs):
    """A call whose kernel arguments carry the toy field (as if a modifier lowered into it)."""
    q, k, v = make_qkv(b=1, hq=2, sq=1, sk=24, d=8, seed=3)
    spec = build_spec(q, k, v, **kwargs)
    a = spec.kernel_args
    spec.__dict__["kernel_args"] = ToyArgs(**{f.name: getattr(a, f.name) for f in fields(a)}, toy=value)
    return spec


def test_the_worked_example_lists_at_most_six_files_and_the_docs_name_them():
    assert len(NEW_FIELD_FILES) <= 6 and all((ROOT / f).is_file() for f in NEW_FIELD_FILES)
    text = (ROOT / "docs" / "architecture.md").read_text()
    example = text[text.index("## Worked example"):]
    named = re.findall(r"^\d\. `([^`]+)`", example, flags=re.M)
    assert tuple(named) == NEW_FIELD_FILES


def test_a_new_number_reaches_the_native_record_by_name():
    spec = _toy_spec(0.5, causal=True, softcap=3.0)
    args, geometry, tiles = NativeBackend._call_arguments(spec)
    numbers = args.numbers()
    assert numbers["toy"] == 0.5 and numbers["softcap"] == 3.0 and numbers["right"] == 0
    # A header declaring the field: the record's filler takes it by name, nothing else changes.
    abi = "core:q:p,core:scale:d,core:softcap:d,core:toy:d,core:right:i,"
    record = Record(abi)
    buffer = bytearray(record.size)
    record.fill["core"](buffer, **{name: numbers[name] for name in record.names("core") if name != "q"})
    assert struct.unpack_from("<d", buffer, record.offset["toy"]) == (0.5,)
    # The header as it is does not declare it: refused by name, before any compute.
    ok, why = kernels.available()
    if not ok:
        pytest.skip(why)
    q, k, v = spec.q_c, spec.k_c, spec.v_c
    out, lse = torch.empty_like(q), torch.empty(spec.lse_shape())
    with pytest.raises(TypeError, match="toy"):
        kernels.forward(q, k, v, out, lse, args, geometry, tiles)


def test_a_new_number_reaches_the_triton_groups_by_name(monkeypatch):
    pytest.importorskip("triton")
    from tileattn.backends.triton import arguments, launch

    # the groups as the toy field's author writes them: the declared fields, and the new one
    scalars = NamedTuple("Scalars", list(arguments.Scalars.__annotations__.items()) + [("toy", float)])
    flags = NamedTuple("Flags", [(name, bool) for name in arguments.Flags._fields + ("HAS_TOY",)])
    monkeypatch.setattr(launch, "Scalars", scalars)
    monkeypatch.setattr(launch, "Flags", flags)
    on, off = launch._common(_toy_spec(0.5, window=(3, 0))), launch._common(_toy_spec(0.0))
    assert on.groups["sc"].toy == 0.5 and on.constexprs["F"].HAS_TOY and on.constexprs["F"].HAS_LEFT
    assert not off.constexprs["F"].HAS_TOY and not off.constexprs["F"].HAS_LEFT
