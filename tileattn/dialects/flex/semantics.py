"""Exact reference of FlexAttention (the semantics in :mod:`tileattn.flex`), differentiable by autograd.

:func:`flex_reference` materialises the (B, Hq, L, S) scores, applies ``score_mod`` elementwise with
``torch.vmap`` over index grids (PyTorch's eager implementation does the same), masks with the block
mask (its block lists and its ``mask_mod``), and takes a safe softmax. Gradients flow to q, k, v and to
every tensor ``score_mod`` captures, by plain autograd. With ``compute_dtype=torch.float64`` it is the
oracle the compiled paths are judged against; with ``compute_dtype=None`` it computes what PyTorch's
own eager FlexAttention computes in the inputs' dtype (scores in float32, or float64 for float64
inputs; probabilities rounded to the input dtype before ``@ v``), the "plain math" baseline of
FlashAttention's 2x accuracy rule.

:func:`validate` holds the argument checks (PyTorch's, with its exception types, plus the ones that
make a call unambiguous).
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest, BlockMask

from ...core.engine import storage_problem
from ...core.functions import NO_MASK_BLOCK, check_block_mask as check_block_lists
from ...core.modifiers import fail
from ...programs.blocks import block_grid, listed_blocks
from ...programs.eager import mask_tile, score_tile
from ...programs.trace import INDEX_DTYPE

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: What would work instead of a tensor without memory (the CPU path's compiled C reads its tiles by pointer).
WITH_MEMORY = ("a tensor with memory of its own (FlexAttention on CPU computes by pointer and has no fake kernel; "
               "unwrap a tensor subclass first, e.g. a DTensor's .to_local())")
BACKENDS = ("AUTO", "TRITON", "FLASH", "TRITON_DECODE")


@dataclass(frozen=True)
class Call:
    """A validated call: sizes, scale and what to return."""

    batch: int
    heads_q: int
    heads_kv: int
    q_len: int
    kv_len: int
    scale: float
    block_mask: object      #: the BlockMask, or None when the call has none (or PyTorch's no-op mask)
    want_lse: bool
    want_max: bool
    aux: bool               #: return (out, AuxOutput) rather than out or (out, lse)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision scores are computed and modified in: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: PyTorch's advice for a block mask made for other lengths (the same words in torch 2.13 to 2.15).
SHORTER_MASK = ("block_mask was created for a smaller length than you're using it for, you likely need to create a "
                "new block mask.")
LONGER_MASK = ("block_mask was created for a larger length than you're using it for, you can either 1. create a new "
               "block mask with the correct length, or 2. 'adjust' the existing block mask to the correct length by "
               "calling block_mask._adjust(q_len, kv_len). This essentially 'crops' the block mask to the upper left "
               "corner, which does not work for all mask_mods!")


@functools.cache
def length_error_type() -> type:
    """The exception PyTorch's flex_attention raises for a block mask of other lengths: ValueError up to
    torch 2.14, RuntimeError from torch 2.15 (its ``_validate_block_mask_shape``, which raises the
    advice alone, without the sentence on the shapes). Read from the installed torch's version on the
    first such mask, not at import; a 2.15 pre-release counts as 2.15."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return RuntimeError if found and tuple(map(int, found.groups())) >= (2, 15) else ValueError


def check_block_mask(block_mask, q_len, kv_len, batch, heads, device):
    """Refuse a BlockMask that does not fit a call of these sizes: PyTorch's rule that its lengths are
    the call's (with its exception type and words, :func:`length_error_type`), then the operator's
    checks of its block lists (O(blocks) work)."""
    check_block_lists(block_mask, batch, heads, device)
    mask_q, mask_kv = block_mask.seq_lengths
    if (q_len, kv_len) != (mask_q, mask_kv):  # PyTorch's words first: code matches on them
        shorter = q_len > mask_q or kv_len > mask_kv
        shapes = (f"block_mask was created for block_mask.shape={block_mask.shape} but got q_len={q_len} and "
                  f"kv_len={kv_len}")
        ours = "(tileattn: argument 'block_mask': a mask for these lengths.)"
        if length_error_type() is ValueError:  # torch 2.13 / 2.14: the shapes, then the advice
            advice = ("As the block mask was created for a smaller length than you're using it for, you likely need to "
                      "create a new block mask." if shorter else
                      "As the block mask was created for a larger length than you're using it for, you can either 1. "
                      "create a new block mask with the correct length, or 2. 'adjust' the existing block mask to the "
                      "correct length by calling block_mask._adjust(q_len, kv_len).")
            raise ValueError(f"{shapes}. {advice} {ours}")
        raise RuntimeError(f"{SHORTER_MASK if shorter else LONGER_MASK} ({shapes}.) {ours}")


def validate(query, key, value, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
             kernel_options=None, return_aux=None) -> Call:
    """Check a flex_attention call before any compute; raises with the argument named."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, name, type(t).__name__, "a torch.Tensor")
        if t.dim() != 4:
            fail(NotImplementedError, name, f"a {t.dim()}-D tensor", "a 4-D (B, H, S, E) tensor")
        if t.dtype not in FLOAT_DTYPES:
            fail(ValueError, name, t.dtype, "float16, bfloat16, float32 or float64")
        # The CPU path hands its tiles to compiled C by pointer (torch.compile traces no real tensor).
        problem = None if torch.compiler.is_compiling() else storage_problem(t)
        if problem is not None:
            fail(TypeError, name, problem, WITH_MEMORY)
    if not (query.dtype == key.dtype == value.dtype):
        fail(ValueError, "key/value", f"{key.dtype}/{value.dtype} with query {query.dtype}", "one dtype for all three")
    if not (query.device == key.device == value.device):
        fail(ValueError, "key/value", f"{key.device}/{value.device} with query {query.device}", "one device")
    batch, heads, q_len, dim = query.shape
    if key.size(-1) != dim:
        fail(ValueError, "key", f"head dim {key.size(-1)}", f"{dim}, the query's")
    if key.shape[:3] != value.shape[:3]:
        fail(ValueError, "value", f"shape {tuple(value.shape)}", f"(B, H, S) of key {tuple(key.shape[:3])}")
    heads_kv = key.size(1)
    if not enable_gqa and heads_kv != heads:
        fail(ValueError, "enable_gqa", f"False with {heads} query heads and {heads_kv} key/value heads",
             "True for grouped-query attention")
    if heads_kv == 0 or heads % heads_kv:
        fail(ValueError, "key", f"{heads_kv} heads for {heads} query heads", "a divisor of the query heads")
    if key.size(0) != batch:
        if key.size(0) != 1 or block_mask is None or block_mask.kv_num_blocks.size(0) != batch:
            fail(ValueError, "key", f"batch {key.size(0)} with query batch {batch}", "the same batch, or batch 1 "
                 "with a block_mask whose batch is the query's")
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        fail(TypeError, "block_mask", type(block_mask).__name__, "a BlockMask (create_block_mask) or None")
    if block_mask is not None and tuple(block_mask.BLOCK_SIZE) == (NO_MASK_BLOCK, NO_MASK_BLOCK):
        block_mask = None
    if block_mask is not None:
        check_block_mask(block_mask, q_len, key.size(-2), batch, heads, query.device)
    if scale is not None and not isinstance(scale, (int, float)):
        fail(TypeError, "scale", type(scale).__name__, "a float or None")
    if return_lse and return_aux is not None:
        raise ValueError("Cannot specify both return_lse and return_aux. return_lse is deprecated, please use "
                         "return_aux=AuxRequest(lse=True) instead. (tileattn: argument 'return_lse': True together "
                         "with return_aux.)")
    if return_aux is not None and not isinstance(return_aux, AuxRequest):
        fail(TypeError, "return_aux", type(return_aux).__name__, "an AuxRequest or None")
    options = dict(kernel_options or {})
    if options.get("BACKEND", "AUTO") not in BACKENDS:
        fail(ValueError, "kernel_options", f"BACKEND={options['BACKEND']!r}", f"one of {BACKENDS}")
    if "BACKEND" in options and options.get("FORCE_USE_FLEX_ATTENTION", False):
        fail(RuntimeError, "kernel_options", "BACKEND with FORCE_USE_FLEX_ATTENTION", "only BACKEND")
    for internal in ("OUTPUT_LOGSUMEXP", "OUTPUT_MAX"):
        if internal in options:
            fail(ValueError, "kernel_options", internal, "no internal keys (use return_aux)")
    return Call(batch=batch, heads_q=heads, heads_kv=heads_kv, q_len=q_len, kv_len=key.size(-2),
                scale=1.0 / math.sqrt(dim) if scale is None else float(scale), block_mask=block_mask,
                want_lse=bool(return_lse or (return_aux is not None and return_aux.lse)),
                want_max=bool(return_aux is not None and return_aux.max_scores), aux=return_aux is not None)


def index_grid(batch, heads, q_len, device):
    """Row indices (b, h, q_idx) of the (batch, heads, q_len) rows, flattened, as int32."""
    def axis(n, i):
        shape = [1, 1, 1]
        shape[i] = n
        return torch.arange(n, dtype=INDEX_DTYPE, device=device).view(shape).expand(batch, heads, q_len).reshape(-1)

    return axis(batch, 0), axis(heads, 1), axis(q_len, 2)


def visibility(block_mask, batch, heads, q_len, kv_len, device):
    """Bool (batch, heads, q_len, kv_len): which scores take part, per the block mask."""
    bq, bk = block_mask.BLOCK_SIZE
    rows, cols = block_grid(block_mask)

    def expand(blocks):
        return blocks.repeat_interleave(bq, -2).repeat_interleave(bk, -1)[..., :q_len, :kv_len]

    partial = expand(listed_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, rows, cols))
    full = torch.zeros_like(partial)
    if block_mask.full_kv_num_blocks is not None:
        full = expand(listed_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, rows, cols))
    b, h, q = index_grid(batch, heads, q_len, device)
    kv = torch.arange(kv_len, dtype=INDEX_DTYPE, device=device)
    mask = mask_tile(block_mask.mask_mod, b, h, q, kv).reshape(batch, heads, q_len, kv_len)
    return (partial & mask) | full


def flex_reference(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, kernel_options=None, *, return_aux=None, compute_dtype=None):
    """FlexAttention computed exactly, with :func:`torch.nn.attention.flex_attention.flex_attention`'s
    signature and returns, plus ``compute_dtype`` (None: PyTorch's eager precision; float64: the oracle).
    ``kernel_options`` are checked and have no effect. ``AuxRequest(max_scores=True)`` is supported."""
    call = validate(query, key, value, block_mask, scale, enable_gqa, return_lse, kernel_options, return_aux)
    wp = compute_dtype or working_dtype(query.dtype)
    group = call.heads_q // call.heads_kv
    k = key.to(wp).repeat_interleave(group, dim=1).expand(call.batch, -1, -1, -1)
    v = value.repeat_interleave(group, dim=1).expand(call.batch, -1, -1, -1)
    scores = (query.to(wp) @ k.transpose(-2, -1)) * call.scale
    shape = scores.shape
    if score_mod is not None and scores.numel():
        b, h, q = index_grid(call.batch, call.heads_q, call.q_len, query.device)
        kv = torch.arange(call.kv_len, dtype=INDEX_DTYPE, device=query.device)
        scores = score_tile(score_mod, scores.reshape(-1, call.kv_len), b, h, q, kv).reshape(shape)
    if call.block_mask is not None and scores.numel():
        keep = visibility(call.block_mask, call.batch, call.heads_q, call.q_len, call.kv_len, query.device)
        scores = scores.masked_fill(~keep, -math.inf)
    peak = scores.detach().amax(dim=-1, keepdim=True) if call.kv_len else scores.new_full((*shape[:-1], 1),
                                                                                          -math.inf)
    empty = peak == -math.inf  # rows where every score is -inf: output 0, LSE -inf
    peak = torch.where(empty, 0.0, peak)
    total = torch.exp(scores - peak).sum(dim=-1, keepdim=True)
    lse = peak + torch.log(torch.where(empty, 1.0, total))
    probs = torch.exp(scores - lse)
    if compute_dtype is None:
        out = probs.to(query.dtype) @ v.to(query.dtype)
    else:
        out = probs @ v.to(wp)
    lse = torch.where(empty, -math.inf, lse).squeeze(-1) if call.want_lse else None
    max_scores = torch.where(empty, -math.inf, peak).squeeze(-1) if call.want_max else None
    if call.aux:
        return out, AuxOutput(lse=lse, max_scores=max_scores)
    return (out, lse) if call.want_lse else out
