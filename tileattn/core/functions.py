"""User functions as modifiers: FlexAttention's ``score_mod``, ``mask_mod`` and block masks.

``score_mod(score, b, h, q_idx, kv_idx) -> score`` runs after softcap, ALiBi and bias;
``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = take part) beside causal/window and ``mask``. A
PyTorch ``BlockMask`` (``block_mask=``) brings its own ``mask_mod`` and a block map: blocks it lists
as full are visible without the function, blocks it lists as partial apply it, the others are hidden
and never computed. The indices are int32: ``b`` the sequence, ``h`` the query head (under GQA),
``kv_idx`` the key's position in its sequence, and ``q_idx = i + off``, the query row's position on
the keys' axis as the band counts it (``align``: bottom-right by default, so with Sq != Sk, a KV
cache or ``seqused_k`` a query's ``q_idx`` is its position at the end of its sequence; ``top_left``
gives ``q_idx = i``, FlexAttention's convention; varlen counts within each sequence).

They are modifiers like the others: they parse their keywords, check themselves against the call,
apply themselves in the reference (``torch.vmap`` over each block of scores, differentiable), and
bind into the kernel arguments. Binding compiles the function (:mod:`tileattn.programs`): the kernel
arguments carry a :class:`UserFunction` with the compiled tile functions and this call's captured
tensors and run-time scalars, or the reason it did not compile (an engine that needs it compiled
refuses the call with that reason, and the ``eager`` engine serves it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Optional, Tuple

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..programs import blocks, compiler
from ..programs.eager import mask_tile, score_tile
from ..programs.trace import INDEX_DTYPE, Unsupported, structure
from .modifiers import Alibi, Band, Bias, Modifier, ScoreBlock, Softcap, diagonal_offset, fail

#: BLOCK_SIZE of PyTorch's "no block mask" placeholder (one block covering everything)
NO_MASK_BLOCK = 1 << 30


@dataclass(frozen=True, eq=False)
class UserFunction:
    """A user function as one call passes it to an engine: the Python function, its compiled program
    bound to the call's captures and scalars (None when it did not compile), and how it runs."""

    fn: object
    bound: Optional[compiler.Bound]
    how: str                         #: "compiled", or why it runs through torch.vmap
    captures: Optional[tuple]        #: the tensors it captures (None when the walk cannot find them)
    score_dtype: Optional[torch.dtype] = None  #: the scores' working dtype (score_mods)

    @property
    def grad_captures(self) -> Tuple[torch.Tensor, ...]:
        """The captured floating-point tensors that require grad: the gradients a backward returns.
        For a function whose captures the walk cannot find (a callable object, a tensor behind an
        object's attribute), the leaves its graph reaches, found by evaluating it once."""
        found = self.__dict__.get("_grad_captures")
        if found is None:
            if self.captures is not None:
                found = tuple(t for t in self.captures if t.is_floating_point() and t.requires_grad)
            else:
                found = _leaves_reached(self.fn, self.score_dtype) if torch.is_grad_enabled() else ()
            object.__setattr__(self, "_grad_captures", found)
        return found


def _leaves_reached(fn, score_dtype) -> tuple:
    """The tensors requiring grad that ``fn`` reaches (its autograd graph's leaves), by one evaluation."""
    index = torch.zeros(1, dtype=INDEX_DTYPE)
    with torch.enable_grad():
        if score_dtype is None:
            out = mask_tile(fn, index, index, index, index)
        else:
            out = score_tile(fn, torch.zeros(1, 1, dtype=score_dtype), index, index, index, index)
    leaves, seen, todo = [], set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return tuple(leaves)


def _user_function(kind: str, fn, dtype) -> UserFunction:
    try:
        found = structure(fn)
    except Unsupported as exc:
        return UserFunction(fn, None, f"torch.vmap: {exc.reason}", None, dtype)
    try:
        bound = compiler.score_program(fn, dtype, found) if kind == "score" else compiler.mask_program(fn, found)
    except Unsupported as exc:
        return UserFunction(fn, None, f"torch.vmap: {exc.reason}", found.captures, dtype)
    return UserFunction(fn, bound, "compiled", found.captures, dtype)


def _check_callable(name, fn):
    if not callable(fn):
        fail(TypeError, name, type(fn).__name__, f"a function {name}(" + ("score, " if name == "score_mod" else "")
             + "b, h, q_idx, kv_idx)")


def _indices(block: ScoreBlock, heads_q: int):
    """(b, h, q_idx) per row and kv_idx per column of a reference block, int32; rows = heads x rows."""
    heads = block.head_indices(heads_q).to(INDEX_DTYPE)
    rows = (block.rows + block.offset).to(INDEX_DTYPE)
    cols = block.cols.to(INDEX_DTYPE)
    n = len(heads) * len(rows)
    b = torch.full((n,), block.batch, dtype=INDEX_DTYPE, device=rows.device)
    return b, heads.repeat_interleave(len(rows)), rows.repeat(len(heads)), cols


def _working_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ScoreMod(Modifier):
    """FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx) -> score``, after softcap, ALiBi, bias."""

    kind: ClassVar[str] = "score_mod"
    stage: ClassVar[int] = 2  # with Bias, registered after it: applied after it
    keywords: ClassVar[Mapping[str, object]] = {"score_mod": None}
    binds: ClassVar[Tuple[str, ...]] = ("score_mod",)
    #: the gradients it returns are its captured tensors' (:attr:`UserFunction.grad_captures`)
    grad_slot: ClassVar[Optional[str]] = "captures"
    user_function: ClassVar[bool] = True
    fn: object = field(metadata={"op": "callable"})
    heads_q: int = field(default=0, metadata={"op": "int"})     #: set by check(): the reference indexes heads
    user: Optional[UserFunction] = field(default=None, metadata={"op": "callable"})  #: set by check()
    #: set by check(): the cap when the function is exactly ``c * tanh(score / c)`` and nothing else
    #: transforms the scores: lowered as the kernels' own softcap argument
    softcap: Optional[float] = field(default=None, metadata={"op": "callable"})

    @classmethod
    def from_args(cls, score_mod):
        if score_mod is None:
            return None
        _check_callable("score_mod", score_mod)
        return cls(score_mod)

    def check(self, spec):
        _check_callable("score_mod", self.fn)
        object.__setattr__(self, "heads_q", spec.heads_q)
        if self.user is None:
            object.__setattr__(self, "user", _user_function("score", self.fn, _working_dtype(spec.dtype)))
        form = self.user.bound.program.generated.softcap if self.user.bound is not None else None
        if form is not None and not any(isinstance(m, (Softcap, Alibi, Bias)) for m in spec.modifiers):
            cap = form[1] if form[0] == "literal" else self.user.bound.scalars[form[1]]
            if cap > 0 and math.isfinite(cap):
                object.__setattr__(self, "softcap", float(cap))

    def plan_key(self):
        return None  # a function is no plan key (its captures and scalars are per call)

    def lower(self):
        return {} if self.softcap is None else {"softcap": self.softcap}

    def bind(self):
        return {} if self.softcap is not None else {"score_mod": self.user}

    def scores(self, s, block):
        # under autograd (the reference), a captured table that requires grad and is narrower than the
        # scores (bf16 against fp32/fp64) is read as a copy in their dtype, so its gradient sums per
        # element products in that precision (autograd would sum them in bf16)
        wide = {id(t): t.to(s.dtype) for t in self.user.grad_captures
                if t.dtype.itemsize < s.dtype.itemsize} if torch.is_grad_enabled() else {}
        return self._scores(s, block, wide)

    def _scores(self, s, block, replace):
        b, h, q, kv = _indices(block, self.heads_q)
        flat = s.expand(len(h) // len(block.rows), len(block.rows), len(kv)).reshape(len(h), len(kv))
        return score_tile(self.fn, flat, b, h, q, kv, replace).reshape(-1, len(block.rows), len(kv))

    def scores_grad(self, ds, s_before, block, tensor_grad):
        """Through the function by autograd; ``tensor_grad``: buffers for the captures that require
        grad (:attr:`UserFunction.grad_captures`, in order), added to. The function reads each such
        capture as a leaf of at least the buffer's dtype (fp32 for bf16 inputs): its gradient is
        accumulated from the fp32 dS and scores, never rounded to the capture's bf16 on the way."""
        wanted = self.user.grad_captures if tensor_grad is not None else ()
        leaves = [t.detach().to(torch.promote_types(t.dtype, buffer.dtype)).requires_grad_()
                  for t, buffer in zip(wanted, tensor_grad or ())]
        with torch.enable_grad():
            s = s_before.detach().requires_grad_()
            out = self._scores(s, block, {id(t): leaf for t, leaf in zip(wanted, leaves)})
            grads = torch.autograd.grad(out, (s, *leaves), ds.expand_as(out), allow_unused=True)
        for buffer, g in zip(tensor_grad or (), grads[1:]):
            if g is not None:
                buffer += g
        return grads[0].sum_to_size(s_before.shape) if grads[0] is not None else torch.zeros_like(s_before)


@dataclass(frozen=True)
class MaskMod(Modifier):
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = take part), or a ``BlockMask``
    (its block lists and its ``mask_mod``), beside the other masks."""

    kind: ClassVar[str] = "mask_mod"
    stage: ClassVar[int] = 4
    masks: ClassVar[bool] = True
    keywords: ClassVar[Mapping[str, object]] = {"mask_mod": None, "block_mask": None}
    binds: ClassVar[Tuple[str, ...]] = ("mask_mod", "block_states")
    user_function: ClassVar[bool] = True
    fn: object = field(metadata={"op": "callable"})
    block_mask: object = field(default=None, metadata={"op": "callable"})
    heads_q: int = field(default=0, metadata={"op": "int"})
    user: Optional[UserFunction] = field(default=None, metadata={"op": "callable"})
    states: Optional[blocks.BlockStates] = field(default=None, metadata={"op": "callable"})
    #: set by check(): the (left, right) band the function is on this call's grid, lowered as the
    #: kernels' own band arguments (no function call in the tiles), or None
    band: Optional[tuple] = field(default=None, metadata={"op": "callable"})

    @classmethod
    def from_args(cls, mask_mod=None, block_mask=None):
        if block_mask is None:
            if mask_mod is None:
                return None
            _check_callable("mask_mod", mask_mod)
            return cls(mask_mod)
        if mask_mod is not None:
            fail(ValueError, "mask_mod", "a function together with block_mask",
                 "one of them (a BlockMask applies its own mask_mod to its partial blocks)")
        if not isinstance(block_mask, BlockMask):
            fail(TypeError, "block_mask", type(block_mask).__name__,
                 "a torch.nn.attention.flex_attention.BlockMask (create_block_mask) or None")
        if tuple(block_mask.BLOCK_SIZE) == (NO_MASK_BLOCK, NO_MASK_BLOCK):
            return None  # PyTorch's "no block mask" placeholder
        return cls(block_mask.mask_mod, block_mask)

    def check(self, spec):
        _check_callable("mask_mod", self.fn)
        object.__setattr__(self, "heads_q", spec.heads_q)
        if self.block_mask is not None and self.states is None:
            check_block_mask(self.block_mask, spec.batch, spec.heads_q, spec.device)
            object.__setattr__(self, "states", blocks.states_of(self.block_mask))
        if self.user is None:
            object.__setattr__(self, "user", _user_function("mask", self.fn, None))
        bound = self.user.bound
        if bound is None or bound.captures or spec.is_varlen or spec.is_paged or spec.seqused_k is not None:
            return
        off = diagonal_offset(spec.align, spec.seqlen_q, spec.seqlen_k)
        if off < 0:
            return
        # a pure function of the indices (causal, windows, prefixes): its block map is made once per
        # size, and the kernels skip the tiles it hides without evaluating them; one that is exactly a
        # band there (and the call has no band of its own) runs as the band itself
        if self.states is None:
            states = blocks.function_states(bound, spec.batch, spec.heads_q, spec.seqlen_q + off, spec.seqlen_k)
            object.__setattr__(self, "states", states)
            band = states.band
        else:
            band = self._band_of_block_mask(spec, bound, off)
        if band is not None and not any(isinstance(m, Band) for m in spec.modifiers):
            object.__setattr__(self, "band", band)

    def _band_of_block_mask(self, spec, bound, off):
        """The band a BlockMask is, when its ``mask_mod`` is a band on the call's grid and its block lists
        are exactly that function's (as ``create_block_mask`` makes them): then the lists add nothing."""
        bq, bk = self.block_mask.BLOCK_SIZE
        if off != 0 or bq != bk or tuple(self.block_mask.seq_lengths) != (spec.seqlen_q, spec.seqlen_k):
            return None
        own = blocks.function_states(bound, spec.batch, spec.heads_q, spec.seqlen_q, spec.seqlen_k, block=bq)
        if own.band is None or own.states.shape[2:] != self.states.states.shape[2:]:
            return None
        return own.band if bool((self.states.states == own.states).all()) else None

    def plan_key(self):
        return None

    def lower(self):
        if self.band is None:
            return {}
        left, right = self.band
        return {"left": -1 if left is None else left, "right": -1 if right is None else right}

    def bind(self):
        if self.band is not None:
            return {}
        return {"mask_mod": self.user, "block_states": self.states}

    def visible(self, block):
        b, h, q, kv = _indices(block, self.heads_q)
        keep = mask_tile(self.fn, b, h, q, kv)
        if self.states is not None:
            state = self.states.per_element(q[:, None], kv[None, :], b[:, None], h[:, None])
            keep = (state == blocks.VISIBLE) | ((state == blocks.PARTIAL) & keep)
        return keep.reshape(-1, len(block.rows), len(kv))


def check_block_mask(block_mask, batch, heads, device):
    """Refuse a BlockMask that cannot serve a call of ``batch`` sequences and ``heads`` query heads on
    ``device`` (O(blocks) work). Its lengths need not be the call's: positions past them are hidden."""
    if getattr(block_mask.mask_mod, "__name__", "") == "_sliced_mask_mod_error":
        raise RuntimeError("tileattn: argument 'block_mask' is a sliced BlockMask whose mask_mod was reset; set "
                           "block_mask.mask_mod from the original BlockMask (as PyTorch requires)")
    if block_mask.kv_num_blocks.device != torch.device(device):
        raise RuntimeError(f"tileattn: argument 'block_mask' is on {block_mask.kv_num_blocks.device}; expected "
                           f"{device}, the device of q/k/v.")
    if not all(isinstance(n, int) and n > 0 for n in block_mask.BLOCK_SIZE):
        fail(ValueError, "block_mask", f"BLOCK_SIZE={block_mask.BLOCK_SIZE}", "two positive ints")
    nb = block_mask.kv_num_blocks
    if nb.dim() != 3:
        fail(ValueError, "block_mask", f"kv_num_blocks of shape {tuple(nb.shape)}", "(B, H, query blocks)")
    bm_b, bm_h, _ = nb.shape
    if bm_b not in (1, batch) or bm_h not in (1, heads):
        fail(ValueError, "block_mask", f"B={bm_b}, H={bm_h} for a batch of {batch} with {heads} query heads",
             "B of 1 or the batch size and H of 1 or the number of query heads")
    rows, cols = blocks.block_grid(block_mask)
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices)]
    if block_mask.full_kv_num_blocks is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices))
    q_len, kv_len = block_mask.seq_lengths
    for num, idx in lists:
        if num.shape[-1] < rows or idx.shape[-2] < rows or not num.shape[:2] == idx.shape[:2] == nb.shape[:2]:
            fail(ValueError, "block_mask", f"block lists of shapes {tuple(num.shape)} / {tuple(idx.shape)}",
                 f"at least {rows} query-block rows (q_len {q_len} / Q_BLOCK_SIZE {block_mask.BLOCK_SIZE[0]})")
        valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., :rows, None]
        used = idx[..., :rows, :][valid]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= cols):
            fail(ValueError, "block_mask", f"key-block indices in [{int(used.min())}, {int(used.max())}]",
                 f"indices in [0, {cols}) (kv_len {kv_len} / KV_BLOCK_SIZE {block_mask.BLOCK_SIZE[1]})")
    if len(lists) == 2 and bool((blocks.listed_blocks(*lists[0], rows, cols)
                                 & blocks.listed_blocks(*lists[1], rows, cols)).any()):
        fail(ValueError, "block_mask", "a block listed both as partial (kv_indices) and as full (full_kv_indices)",
             "each block in at most one list")


USER_FUNCTION_TYPES = (ScoreMod, MaskMod)
