"""The layouts have one home, :mod:`tileattn.core.layouts`: every conversion (to and from the canonical
view, output shapes and strides, the lean path's K/V reader, the merge's row factor, context
parallelism's 4-d views) is derived from its table, and nothing else in the package spells a
layout's axes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import tileattn
from tileattn.core import layouts
from tileattn.core.layouts import LAYOUT, LAYOUTS

PACKAGE = Path(tileattn.__file__).parent
B, H, S, D = 2, 3, 5, 4
#: Each layout's shape, and its canonical view, written out by hand.
BY_HAND = {
    "BNSD": ((B, H, S, D), lambda x: x),
    "BSND": ((B, S, H, D), lambda x: x.transpose(1, 2)),
    "BSH": ((B, S, H * D), lambda x: x.view(B, S, H, D).transpose(1, 2)),
    "SBH": ((S, B, H * D), lambda x: x.view(S, B, H, D).permute(1, 2, 0, 3)),
    "TND": ((S, H, D), lambda x: x),
    "paged": ((B, S, H, D), lambda x: x.transpose(1, 2)),
    # the Ascend dialect's heads-first layouts (a packed layout's canonical view is (T, H, D))
    "NTD": ((H, S, D), lambda x: x.transpose(0, 1)),
    "NBSD": ((H, B, S, D), lambda x: x.transpose(0, 1)),
}


@pytest.mark.parametrize("name", list(BY_HAND))
def test_each_layout_to_and_from_its_canonical_view(name):
    shape, canonical = BY_HAND[name]
    assert layouts.user_shape(name, B, H, S, D) == shape
    x = torch.randn(shape)
    c = layouts.to_canonical(x, name, H)
    assert c.data_ptr() == x.data_ptr() and c.stride() == canonical(x).stride() and torch.equal(c, canonical(x))
    assert torch.equal(layouts.from_canonical(c, name), x)
    if name in LAYOUTS:
        t, view = layouts.empty_in_layout(name, B, H, S, D, torch.float32, "cpu")
        assert t.shape == shape and t.is_contiguous() and view.stride() == canonical(t).stride()
    if name in LAYOUTS and name != "TND":  # the padded layouts of the public calls
        assert layouts.output_strides(name, B, H, S, D) == view.stride()[:3]
        read, order = layouts.kv_reader(name, B, H, D)
        keys, strides = read(x)
        assert keys == S and tuple(strides[i] for i in order) == c.stride()[:3]
        assert read(torch.randn(shape[:-1] + (shape[-1] + 1,))) is None  # another head dim
        assert read(x.transpose(-1, -2).contiguous().transpose(-1, -2)) is None  # head dim not unit-stride
    if name == "paged":  # blocks in the place of a batch: the free size is the number of blocks
        read, order = layouts.kv_reader(name, None, H, D, seq=S)
        blocks, strides = read(x)
        assert blocks == B and tuple(strides[i] for i in order) == c.stride()[:3]


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_row_factor_scales_each_row_of_an_output(name):
    shape, _ = BY_HAND[name]
    out = torch.randn(shape)
    w = torch.rand((H, S) if name == "TND" else (B, H, S))
    c = layouts.to_canonical(out, name, H)
    expected = c * (w.transpose(0, 1) if name == "TND" else w)[..., None]
    assert torch.equal(layouts.to_canonical(layouts.row_factor(w, name, shape[-1]) * out, name, H), expected)


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_batched_views_of_context_parallelism(name):
    shape, canonical = BY_HAND[name]
    x = torch.randn(shape)
    y = layouts.to_batched(x, name, H)
    assert y.dim() == 4 and torch.equal(y, x.transpose(0, 1)[None] if name == "TND" else canonical(x))
    back = layouts.from_batched(y, name)
    assert back.is_contiguous() and torch.equal(back, x)
    assert LAYOUT[name].seq_dim == {"BNSD": 2, "BSND": 1, "BSH": 1, "SBH": 0, "TND": 0}[name]
    assert LAYOUT[name].batch_dim == {"BNSD": 0, "BSND": 0, "BSH": 0, "SBH": 1, "TND": None}[name]
    assert LAYOUT[name].heads_dim == {"BNSD": 1, "BSND": 2, "BSH": None, "SBH": None, "TND": 1}[name]


def test_no_module_but_the_table_spells_a_layout_s_axes():
    """Outside core/layouts.py no module compares a layout with the name of a padded layout (which
    would be a conversion written again): the Ascend dialect too reads its layouts (NTD, NBSD and
    the IN_OUT pairs of its inference ops included) from the table."""
    names = {"BNSD", "BSND", "BSH", "SBH"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "core/layouts.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = {c.value for side in [node.left, *node.comparators] for c in ast.walk(side)
                             if isinstance(c, ast.Constant)}
                if constants & names:
                    found.append(f"{rel}:{node.lineno}")
    assert not found, found
