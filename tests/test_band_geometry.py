"""The native C kernels' band geometry against :class:`tileattn.core.modifiers.Band`, the one rule every
engine lowers (``left``/``right`` kernel arguments) and the reference applies.

The kernels reveal which keys each row sees: with q = 0 every visible score is equal, so with v the
identity a row's output is ``1/n`` on its n visible keys and 0 elsewhere. That set, and each row's
key range, must be exactly Band's, on a grid of lengths, band sides, alignments, tile sizes and both
kernel paths (prefill tiles, decode).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tileattn.core.modifiers import Band
from tileattn.core.score_math import diagonal_offset

nk = pytest.importorskip("tileattn.backends.native.kernels")
checked = pytest.importorskip("tileattn.backends.native.checked")
if not nk.available()[0]:
    pytest.skip(nk.available()[1], allow_module_level=True)

LENGTHS = [(1, 1), (1, 300), (2, 5), (5, 2), (37, 64), (130, 129), (64, 300)]
SIDES = [(None, None), (None, 0), (0, 0), (3, None), (5, 2), (None, 7), (0, None), (40, 0), (1, 1)]
ALIGNS = ["bottom_right", "top_left", -3, 4]
TILES = [(0, 0, 0), (16, 32, nk.FORCE_PREFILL), (0, 0, nk.FORCE_DECODE)]


def _kernel_visibility(sq, sk, band, align, block_m, block_n, options):
    """Bool (sq, sk): the pairs the kernel attended to, and its LSE (B=1, one head)."""
    q = torch.zeros(1, 1, sq, sk)  # head dim = sk, so that v can be the identity
    k = torch.randn(1, 1, sk, sk, generator=torch.Generator().manual_seed(sq * 1000 + sk))
    v = torch.eye(sk).reshape(1, 1, sk, sk)
    out, lse = torch.empty(1, 1, sq, sk), torch.empty(1, 1, sq)
    args = band.lower() if band is not None else {"left": -1, "right": -1}
    checked.forward(q, k, v, out, lse, scale=1.0, bottom_right=align == "bottom_right",
                    shift=align if isinstance(align, int) else 0, block_m=block_m, block_n=block_n, options=options,
                    **args)
    return out[0, 0] > 0, lse[0, 0]


@pytest.mark.parametrize("sq,sk", LENGTHS)
def test_kernel_rows_see_exactly_the_keys_band_says(sq, sk):
    checked = 0
    for (left, right), align, (block_m, block_n, options) in itertools.product(SIDES, ALIGNS, TILES):
        if options == nk.FORCE_DECODE and sq > 4:
            continue  # the decode path serves a few query rows
        band = None if (left, right) == (None, None) else Band(left, right)
        seen, lse = _kernel_visibility(sq, sk, band, align, block_m, block_n, options)
        off = diagonal_offset(align, sq, sk)
        rows, cols = torch.arange(sq), torch.arange(sk)
        want = torch.ones(sq, sk, dtype=torch.bool) if band is None else band.keep(rows, cols, off)
        where = f"sq={sq} sk={sk} band=({left}, {right}) align={align} tiles=({block_m}, {block_n}) options={options}"
        assert torch.equal(seen, want), where
        for i in range(sq):
            lo, hi = (0, sk) if band is None else band.key_range(i, i + 1, sk, off)
            keys = seen[i].nonzero().flatten()
            if hi > lo:
                assert (int(keys[0]), int(keys[-1]) + 1) == (lo, hi), f"{where} row {i}"
            else:
                assert keys.numel() == 0 and lse[i] == -torch.inf, f"{where} row {i}"
        checked += 1
    assert checked >= len(SIDES) * len(ALIGNS) * 2
