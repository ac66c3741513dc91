"""The layouts, in one table: how a tensor in each layout maps to the canonical view the engines
read, and back.

A layout is the order of its dims, in letters of the canonical axes ``(B, H, S, D)`` = ``b h s d``
(:attr:`Layout.dims`); BSH and SBH fuse heads and head dim into one last dim of width ``H * D``
(:attr:`Layout.fused`). TND is packed: ``(T, H, D)``, sequence ``b`` in rows ``cu_seqlens[b]:cu_seqlens[b+1]``,
and is its own canonical view (a packed layout's canonical view is ``(T, H, D)``). A paged KV pool is
``(num_blocks, block_size, Hkv, D)``, canonically ``(num_blocks, Hkv, block_size, D)``: the layout
``"paged"`` here (a block in the place of a batch item). The Ascend dialect's own layouts (NTD, NBSD:
heads first) are in the table too, though no public call takes them.

Everything the package does with a layout is derived from that one entry: the canonical strided
view of a user's tensor (:func:`to_canonical`, never a copy), the user's layout of a canonical
tensor (:func:`from_canonical`), the shape of an output (:func:`user_shape`, :func:`empty_in_layout`),
the canonical strides of a contiguous output without allocating one (:func:`output_strides`, the
native engine's prepared call), the reader of K/V strides on the lean path (:func:`kv_reader`),
the factor that scales an output by row (:func:`row_factor`, the merge) and the 4-d views of
context parallelism (:func:`to_batched`, :func:`from_batched`: a packed batch as one sequence).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

_CANONICAL = "bhsd"
#: The canonical order of a packed layout's dims: (tokens, heads, head dim).
_PACKED = "shd"


@dataclass(frozen=True)
class Layout:
    """One layout: its name, the order of its dims (letters of ``bhsd``), whether heads and head dim
    are fused into one last dim, and its shape as messages show it."""

    name: str
    dims: str
    fused: bool
    shape_name: str

    @property
    def packed(self) -> bool:
        """TND: no batch axis; the canonical view is the tensor itself."""
        return "b" not in self.dims

    @property
    def rank(self) -> int:
        return len(self.dims) - self.fused

    @property
    def seq_dim(self) -> int:
        """The dim of the user's tensor that runs along the sequence."""
        return self.dims.index("s")

    @property
    def batch_dim(self) -> Optional[int]:
        """The dim of the user's tensor that runs along the batch (None: packed)."""
        return self.dims.index("b") if "b" in self.dims else None

    @property
    def heads_dim(self) -> Optional[int]:
        """The dim of the user's tensor that counts the heads (None: fused into the last dim)."""
        return None if self.fused else self.dims.index("h")

    @property
    def _canonical(self) -> str:
        return _PACKED if self.packed else _CANONICAL

    @property
    def to_canonical_order(self) -> Tuple[int, ...]:
        """The permutation of the (unfused) user dims that gives the canonical view."""
        return tuple(self.dims.index(axis) for axis in self._canonical)

    @property
    def from_canonical_order(self) -> Tuple[int, ...]:
        return tuple(self._canonical.index(axis) for axis in self.dims)


LAYOUT = {layout.name: layout for layout in (
    Layout("BNSD", "bhsd", False, "(batch, heads, seqlen, head_dim)"),
    Layout("BSND", "bshd", False, "(batch, seqlen, heads, head_dim)"),
    Layout("BSH", "bshd", True, "(batch, seqlen, heads * head_dim)"),
    Layout("SBH", "sbhd", True, "(seqlen, batch, heads * head_dim)"),
    Layout("TND", "shd", False, "(total_tokens, heads, head_dim)"),
    Layout("paged", "bshd", False, "(num_blocks, block_size, kv_heads, head_dim)"),
    Layout("NTD", "hsd", False, "(heads, total_tokens, head_dim)"),
    Layout("NBSD", "hbsd", False, "(heads, batch, seqlen, head_dim)"),
)}
#: The permutations each way, per layout (None: the identity).
_TO = {name: (lay.to_canonical_order, lay.fused) for name, lay in LAYOUT.items()}
_FROM = {name: (lay.from_canonical_order, lay.fused) for name, lay in LAYOUT.items()}
#: The layouts of the public API.
LAYOUTS = ("BNSD", "BSND", "BSH", "SBH", "TND")


def _reorder(x: torch.Tensor, order: Tuple[int, ...]) -> torch.Tensor:
    """``x.permute(order)``, written as the transpose it is when it swaps two dims."""
    moved = [i for i, j in enumerate(order) if i != j]
    if not moved:
        return x
    return x.transpose(*moved) if len(moved) == 2 else x.permute(order)


def to_canonical(x: torch.Tensor, layout: str, num_heads: Optional[int]) -> torch.Tensor:
    """Strided (B, H, S, D) view of a tensor in ``layout`` ((T, H, D) for TND; a paged pool's
    (num_blocks, H, block_size, D)). Never copies. ``num_heads`` splits the width of a fused layout."""
    if layout == "BNSD" or layout == "TND":
        return x
    order, fused = _TO[layout]
    if fused:
        x = x.unflatten(-1, (num_heads, x.shape[-1] // num_heads))
    return _reorder(x, order)


def from_canonical(c: torch.Tensor, layout: str) -> torch.Tensor:
    """A canonical tensor in ``layout``: a view, or a copy for the fused layouts."""
    if layout == "BNSD" or layout == "TND":
        return c
    order, fused = _FROM[layout]
    x = _reorder(c, order)
    return x.flatten(-2) if fused else x


def user_shape(layout: str, b: int, h: int, s: int, d: int) -> tuple:
    """The shape of a tensor in ``layout`` with these canonical sizes (TND: ``s`` packed rows)."""
    lay = LAYOUT[layout]
    size = {"b": b, "h": h, "s": s, "d": d}
    shape = tuple(size[axis] for axis in lay.dims)
    return shape[:-2] + (h * d,) if lay.fused else shape


def empty_in_layout(layout: str, b: int, h: int, s: int, d: int, dtype, device):
    """Allocate a contiguous tensor in ``layout``; return ``(user_tensor, canonical_view)``."""
    t = torch.empty(user_shape(layout, b, h, s, d), dtype=dtype, device=device)
    return t, to_canonical(t, layout, h)


def output_strides(layout: str, b: int, h: int, s: int, d: int) -> tuple:
    """(batch, head, row) strides of the canonical view of a contiguous tensor in a padded
    ``layout`` (:func:`empty_in_layout`), without allocating one."""
    dims, size = LAYOUT[layout].dims, {"b": b, "h": h, "s": s, "d": d}
    stride, step = {}, 1
    for axis in reversed(dims):
        stride[axis] = step
        step *= size[axis]
    return stride["b"], stride["h"], stride["s"]


def kv_reader(layout: str, batch: Optional[int], heads: int, dim: int,
              seq: Optional[int] = None) -> Tuple[Callable[[torch.Tensor], Optional[tuple]], Tuple[int, int, int]]:
    """``(read, order)`` for K (or V) in a padded ``layout`` or ``"paged"``: ``read(t)`` gives
    ``(free size, strides)``, or None when t's shape is not the one given here (or its head dim is not
    unit-stride: the full path copies it). The free size is the one given as None: the keys
    (``seq=None``) or a paged pool's blocks (``batch=None``, ``seq`` the block size). The (batch,
    head, row) strides of t's canonical view are ``strides[order[0]], strides[order[1]],
    strides[order[2]]``: t's own strides, read once, for a layout with a head dim (for BSH / SBH, whose
    heads are slices of the last dim, the three themselves, in order)."""
    lay = LAYOUT[layout]
    expected = user_shape(layout, -1 if batch is None else batch, heads, -1 if seq is None else seq, dim)
    fixed = [(i, n) for i, n in enumerate(expected) if n >= 0]
    pick, values = operator.itemgetter(*(i for i, _ in fixed)), tuple(n for _, n in fixed)
    free, rank = lay.dims.index("b" if batch is None else "s"), lay.rank
    b_dim, s_dim = lay.dims.index("b"), lay.seq_dim

    own = not lay.fused

    def read(t):
        s = t.shape
        if len(s) != rank or pick(s) != values:
            return None
        st = t.stride()
        if st[-1] != 1 and dim != 1:
            return None
        return s[free], (st if own else (st[b_dim], dim * st[-1], st[s_dim]))

    return read, ((b_dim, lay.dims.index("h"), s_dim) if own else (0, 1, 2))


def row_factor(w: torch.Tensor, layout: str, width: int) -> torch.Tensor:
    """An LSE-shaped tensor, (B, H, S) or (H, T) for TND, as a factor that broadcasts against an
    output in ``layout`` whose last dim is ``width`` wide."""
    lay = LAYOUT[layout]
    c = (w.transpose(0, 1) if lay.packed else w)[..., None]
    if lay.fused:
        c = c.expand(*c.shape[:-1], width // c.shape[1])
    return from_canonical(c, layout)


def to_batched(x: torch.Tensor, layout: str, num_heads: Optional[int]) -> torch.Tensor:
    """A strided (B, H, S, D) view of a tensor in ``layout``; TND, one packed batch, is (1, H, T, D)."""
    if layout == "TND":
        return x.transpose(0, 1).unsqueeze(0)
    return to_canonical(x, layout, num_heads)


def token_axes(layout: str) -> str:
    """The order of the token axes of ``layout``: ``"bs"``, ``"sb"`` or ``"s"`` (packed). The hidden
    states (..., width) that projections turn into tensors of this layout have these leading axes."""
    return "".join(axis for axis in LAYOUT[layout].dims if axis in "bs")


def hidden_batched(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A (B, S, width) view of hidden states in ``layout``'s token order (:func:`token_axes`); packed:
    (1, T, width)."""
    axes = token_axes(layout)
    if len(axes) == 1:
        return x.unsqueeze(0)
    return x.transpose(0, 1) if axes == "sb" else x


def from_batched(y: torch.Tensor, layout: str) -> torch.Tensor:
    """(B, H, S, D) (TND: (1, H, T, D)) -> a contiguous tensor in ``layout``."""
    if layout == "TND":
        return y[0].transpose(0, 1).contiguous()
    return from_canonical(y, layout).contiguous()
