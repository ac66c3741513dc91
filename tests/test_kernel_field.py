"""A new kernel argument costs the files of docs/architecture.md's worked example, and no others: the
engines' Python code passes the numbers of :class:`tileattn.core.kernel_args.KernelArgs` on by name, to
the native record's fields of those names (and the prepared decode call's) and to Triton's
``Scalars`` and ``Flags``; and its per-call tensors by the section their field declares, to the
native record's section of that name and to Triton's ``ModifierTensors``. Here a toy number, ``toy``,
and a toy per-head tensor, ``temperature``, travel that path on a subclass of the record (no engine
file changes), up to the one place that must learn them: the C header, which refuses what it does not
declare."""

from __future__ import annotations

import re
import struct
from dataclasses import fields, make_dataclass
from pathlib import Path
from typing import NamedTuple, Optional

import pytest
import torch

from tileattn.backends.native import NativeBackend, kernels
from tileattn.backends.native.record import Record, parse
from tileattn.core.kernel_args import KernelArgs, per_call_field, sections
from tileattn.core.spec import build_spec

from conftest import make_qkv

ROOT = Path(__file__).resolve().parents[1]
#: The files new kernel math run by the native and Triton engines touches (docs/architecture.md).
NEW_FIELD_FILES = (
    "tileattn/core/kernel_args.py",
    "tileattn/core/modifiers.py",
    "tileattn/backends/native/csrc/ta.h",
    "tileattn/backends/native/csrc/tile.h",
    "tileattn/backends/triton/arguments.py",
    "tileattn/backends/triton/tile_math.py",
)
#: A new modifier type is granted in the capabilities of each engine that runs it.
CAPABILITY_FILES = ("tileattn/backends/native/__init__.py", "tileattn/backends/triton/__init__.py")
#: A new tensor modifier (a per-head temperature): the same files as a number, its new type granted.
NEW_TENSOR_MODIFIER_FILES = NEW_FIELD_FILES + CAPABILITY_FILES

ToyArgs = make_dataclass("ToyArgs", [("toy", float, 0.0),
                                     ("temperature", Optional[torch.Tensor], per_call_field("temperature", "bh"))],
                         bases=(KernelArgs,), frozen=True)


def _toy_spec(value: float, temperature=None, **kwargs):
    """A call whose kernel arguments carry the toy fields (as if a modifier lowered and bound them)."""
    q, k, v = make_qkv(b=1, hq=2, sq=1, sk=24, d=8, seed=3)
    spec = build_spec(q, k, v, **kwargs)
    a = spec.kernel_args
    values = {f.name: getattr(a, f.name) for f in fields(a)}
    if temperature is not None:
        values["per_call"] = a.per_call | {"temperature"}
    spec.__dict__["kernel_args"] = ToyArgs(**values, toy=value, temperature=temperature)
    return spec


def _named_files(heading: str) -> tuple:
    """The numbered file list under ``heading`` in docs/architecture.md."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index(heading):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    return tuple(re.findall(r"^\d\. `([^`]+)`", section, flags=re.M))


def test_the_worked_examples_list_at_most_six_and_eight_files_and_the_docs_name_them():
    assert len(NEW_FIELD_FILES) <= 6 and len(NEW_TENSOR_MODIFIER_FILES) <= 8
    assert all((ROOT / f).is_file() for f in NEW_TENSOR_MODIFIER_FILES)
    assert _named_files("## Worked example: a new kernel argument") == NEW_FIELD_FILES
    assert _named_files("## Worked example: a new tensor modifier") == NEW_TENSOR_MODIFIER_FILES


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


def test_every_per_call_section_is_one_of_the_native_record():
    """The sections the fields declare are the header's (or the user record, or core numbers)."""
    ok, why = kernels.available()
    if not ok:
        pytest.skip(why)
    record = kernels._library().record
    assert set(sections().values()) - set(record.fields) == {"user"}
    for name, section in sections().items():
        if section not in ("core", "user", "quant"):  # a tensor's own section: its pointer, its strides
            assert section in record.names("core") and f"{section}_st" in record.names(section), name


class _ToyLibrary(NamedTuple):
    """What :func:`kernels.pack` reads of a library: its record's fillers and field offsets, and the
    options it adds."""

    fill: dict
    field_offset: dict
    default_options: int


def test_a_new_tensor_reaches_its_native_section_by_name():
    ok, why = kernels.available()
    if not ok:
        pytest.skip(why)
    temperature = torch.tensor([0.5, 2.0]).expand(1, 2)  # (batch, heads), the batch broadcast
    spec = _toy_spec(0.0, temperature=temperature)
    args, geometry, tiles = NativeBackend._call_arguments(spec)
    # A header declaring it: the core pointer named after the section, the section's strides.
    declared = [":".join(f) for f in parse(kernels._library().lib.ta_abi().decode())]
    last_core = max(i for i, f in enumerate(declared) if f.startswith("core:"))
    declared[last_core + 1:last_core + 1] = ["core:temperature:p", "core:toy:d"]
    record = Record(",".join(declared + ["temperature:temperature_st:i3"]))
    lib = _ToyLibrary(record.fill, record.offset, 0)
    buffer = bytearray(record.size)
    q, k, v = spec.q_c, spec.k_c, spec.v_c
    out, lse = torch.empty_like(q), torch.empty(spec.lse_shape())
    kernels.pack(lib, buffer, q, k, v, out, lse, args, geometry, tiles)
    assert struct.unpack_from("<Q", buffer, record.offset["temperature"]) == (temperature.data_ptr(),)
    assert struct.unpack_from("<3q", buffer, record.offset["temperature_st"]) == (0, 1, 0)
    # The header as it is has no such section: refused by name, before any compute.
    with pytest.raises(TypeError, match="temperature"):
        kernels.forward(q, k, v, out, lse, args, geometry, tiles)


def test_a_new_number_and_tensor_reach_the_triton_groups_by_name(monkeypatch):
    pytest.importorskip("triton")
    from tileattn.backends.triton import arguments, launch

    # the groups as the toy fields' author writes them: the declared fields, and the new ones
    scalars = NamedTuple("Scalars", list(arguments.Scalars.__annotations__.items()) + [("toy", float)])
    flags = NamedTuple("Flags", [(name, bool) for name in arguments.Flags._fields + ("HAS_TOY", "HAS_TEMPERATURE")])
    strides = NamedTuple("ModifierStrides", list(arguments.ModifierStrides.__annotations__.items())
                         + [("temperature", arguments.Strides)])
    tensors = NamedTuple("ModifierTensors", [(name, object) for name in strides._fields] + [("st", strides)])
    for name, group in (("Scalars", scalars), ("Flags", flags), ("ModifierStrides", strides),
                        ("ModifierTensors", tensors)):
        monkeypatch.setattr(launch, name, group)
    temperature = torch.tensor([0.5, 2.0])
    on, off = launch._common(_toy_spec(0.5, temperature, window=(3, 0))), launch._common(_toy_spec(0.0))
    assert on.groups["sc"].toy == 0.5 and on.constexprs["F"].HAS_TOY and on.constexprs["F"].HAS_LEFT
    assert not off.constexprs["F"].HAS_TOY and not off.constexprs["F"].HAS_LEFT
    assert on.mods.temperature is temperature and on.mods.st.temperature == (0, 1, 0, 0)
    assert on.constexprs["F"].HAS_TEMPERATURE and not off.constexprs["F"].HAS_TEMPERATURE
    assert off.mods.temperature.numel() == 1 and off.mods.st.temperature == (0, 0, 0, 0)
