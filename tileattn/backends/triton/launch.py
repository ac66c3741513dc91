"""Launchers of the Triton kernels: validate, allocate, pick a configuration, launch.

The kernels know nothing of the public API. This layer turns an :class:`~tileattn.core.spec.AttentionSpec`
and its kernel arguments (:class:`~tileattn.core.kernel_args.KernelArgs`, the modifiers lowered) into
pointers and the argument groups of :mod:`.arguments` (:func:`_common`, shared by every kernel of a
call): canonical strided views are passed as they are (a transposed BSND or SBH tensor is read in
place, never copied), broadcast masks and biases become stride-0 dimensions, and packed (TND)
problems pass a batch stride of 0 plus their ``cu_seqlens``. Every kernel is launched by
:func:`_launch`, with a fixed, cached or autotuned configuration.

Interpreter or compiler
-----------------------
``@triton.jit`` reads ``TRITON_INTERPRET`` when it *decorates* a function, and Triton decorates its own
library when it is imported: the interpreter is on for a whole process or not at all. The kernel
modules are imported lazily, in the same mode as Triton's library (:func:`kernels`).

Configurations
--------------
Under the interpreter (and under pytest) one fixed small configuration runs, so tests stay fast and
repeatable. On a GPU the tune cache (``tileattn tune``, :mod:`tileattn.tools.tuning`) may name the forward
configuration; otherwise ``triton.autotune`` picks among a handful, keyed by a coarse length bucket,
head dims and the feature flags, so one tuning serves all lengths of similar size.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...core.score_math import reduce_to_shape
from ...core.spec import AttentionSpec
from ...core.tunecache import lookup, seqlen_bucket
from .arguments import Flags, ModifierStrides, ModifierTensors, Scalars, Sequences, Sizes, Strides

LOG2E = 1.4426950408889634
LN2 = math.log(2.0)
MAX_HEAD_DIM = 256

_KERNEL_MODULES = ("tile_math", "forward_kernel", "backward_kernel", "decode_kernel")
_state = {"modules": None, "tuned": None}


def interpreter_active() -> bool:
    """True when this process's Triton runs kernels in its CPU interpreter.

    That is decided once, when ``triton`` is imported: ``TRITON_INTERPRET=1`` must be set then, because
    Triton decorates its own library functions (``tl.zeros``, ``tl.sum``, ...) at import, and an
    interpreted kernel cannot call a compiled one. Setting the variable later changes nothing.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    probe = getattr(tl.standard, "zeros", None)
    if isinstance(probe, (InterpretedFunction, JITFunction)):
        return isinstance(probe, InterpretedFunction)
    return bool(triton.knobs.runtime.interpret)


def kernels():
    """(forward, backward, decode) kernel modules, imported on first use.

    Our kernels are decorated in the same mode as Triton's library (see :func:`interpreter_active`),
    whatever ``TRITON_INTERPRET`` says at the moment of the import.
    """
    if _state["modules"] is None:
        package = __name__.rsplit(".", 1)[0]
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if interpreter_active() else "0"
        try:
            mods = [importlib.import_module(f"{package}.{name}") for name in _KERNEL_MODULES]
        finally:
            if saved is None:
                os.environ.pop("TRITON_INTERPRET")
            else:
                os.environ["TRITON_INTERPRET"] = saved
        _state["modules"] = tuple(mods[1:])
    return _state["modules"]


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


#: Under the interpreter each program costs about a millisecond, so blocks are small and grids tiny.
FIXED_CONFIG = KernelConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
#: The autotuner's search spaces on a GPU: few points, so tuning a new shape bucket takes seconds.
#: The last, small tile of each space is for head dims up to 256, whose accumulators would spill in
#: the large ones (the dK/dV pass holds two (BLOCK_N, D) fp32 accumulators).
FORWARD_SPACE = (KernelConfig(128, 64, 4, 3), KernelConfig(128, 128, 8, 3), KernelConfig(64, 64, 4, 3),
                 KernelConfig(128, 32, 4, 4), KernelConfig(64, 32, 4, 2))
DKDV_SPACE = (KernelConfig(32, 128, 4, 3), KernelConfig(64, 128, 8, 3), KernelConfig(64, 64, 4, 3),
              KernelConfig(32, 64, 4, 2))
DQ_SPACE = (KernelConfig(128, 32, 4, 3), KernelConfig(128, 64, 8, 3), KernelConfig(64, 64, 4, 3),
            KernelConfig(64, 32, 4, 2))
#: What the autotuner keys a kernel's choice on (besides its tensors' dtypes): the length bucket, the
#: head dims' blocks, the call's flags (``F``) and the dots' precision.
_TUNE_KEY = ["tune_bucket", "BLOCK_D", "BLOCK_DV", "F", "DOT_PRECISION"]


def use_fixed_config() -> bool:
    return interpreter_active() or "pytest" in sys.modules or os.environ.get("TILEATTN_TRITON_FIXED") == "1"


def _autotuned(name, kernel, space):
    """The kernel wrapped in triton.autotune over ``space`` (built once)."""
    if _state["tuned"] is None:
        _state["tuned"] = {}
    if name not in _state["tuned"]:
        configs = [triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps,
                                 num_stages=c.num_stages) for c in space]
        _state["tuned"][name] = triton.autotune(configs=configs, key=_TUNE_KEY)(kernel)
    return _state["tuned"][name]


def _launch(name, kernel, space, grid_of, args, flags, cached: KernelConfig = None):
    """Launch ``kernel`` on ``args`` (positional) and ``flags`` (keywords) with a fixed, cached or
    autotuned configuration (``cached``: this one, never tuned); ``grid_of(block_m, block_n)``."""
    if use_fixed_config() or cached is not None:
        cfg = cached or FIXED_CONFIG
        grid = grid_of(cfg.block_m, cfg.block_n)
        kernel[grid](*args, **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return
    if flags["DOT_PRECISION"] == "ieee":
        # fp32 tiles take twice the registers and IEEE dots run on FMA units: large tiles only spill
        # (and take minutes in ptxas), so fp32 tunes among the small ones.
        name += "-fp32"
        space = tuple(c for c in space if c.block_m * c.block_n <= 64 * 64)
    tuned = _autotuned(name, kernel, space)
    tuned[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **flags)


def _cached_forward_config(spec: AttentionSpec):
    entry = lookup("triton", spec)
    if not entry:
        return None
    return KernelConfig(int(entry["block_m"]), int(entry["block_n"]), int(entry.get("num_warps", 4)),
                        int(entry.get("num_stages", 2)))


def _block_dim(d: int) -> int:
    """Head dims are padded to a power of two (tl.arange needs one) and at least 16 (tl.dot does)."""
    return max(16, triton.next_power_of_2(d))


def _strides(t: torch.Tensor, varlen: bool) -> Strides:
    """(batch, head, seq, dim) strides of a canonical view; packed (T, H, D) has no batch stride."""
    if varlen:
        return Strides(0, t.stride(1), t.stride(0), t.stride(2))
    return Strides(*t.stride())


def _kv_strides(spec: AttentionSpec, t: torch.Tensor) -> Strides:
    """Strides of a canonical K/V view: (page, head, row in page, dim) for a paged pool, else as q's."""
    return Strides(*t.stride()) if spec.is_paged else _strides(t, spec.is_varlen)


def _lse_strides(lse: torch.Tensor, varlen: bool) -> Strides:
    return Strides(0, lse.stride(0), lse.stride(1), 0) if varlen else Strides(*lse.stride(), 0)


@dataclass
class _Args:
    """What every kernel of a call shares: the modifiers' tensors and the argument groups of
    :mod:`.arguments`, as keywords of the kernels (``F`` and the head dims' blocks are constexprs)."""

    mods: ModifierTensors
    groups: dict
    seeds: tuple
    bucket: int
    constexprs: dict


def _scalars(a) -> Scalars:
    """The :class:`.arguments.Scalars` of kernel arguments ``a``: each field the kernel argument of
    its name, in the form the kernels take (unbounded band sides and no softcap as harmless numbers,
    which the flags switch off)."""
    taken = dict(softcap=a.softcap if a.softcap else 1.0, left=max(a.left, 0), right=max(a.right, 0),
                 drop_threshold=a.dropout_threshold, drop_scale=1.0 / (1.0 - a.dropout_p))
    return Scalars(*(taken[name] if name in taken else getattr(a, name) for name in Scalars._fields))


def _flags(a, **given) -> Flags:
    """The :class:`.arguments.Flags` of a call: those ``given``, and for each other flag ``HAS_<NAME>``
    whether the kernel argument ``<name>`` is set (a band side, a mask, a bias, ALiBi slopes, a softcap,
    or a field added to both)."""
    return Flags(**{f: given[f] if f in given else a.is_set(f[len("HAS_"):].lower()) for f in Flags._fields})


_NO_STRIDES = Strides(0, 0, 0, 0)


def _modifier_tensors(a, dummy: torch.Tensor) -> ModifierTensors:
    """The :class:`.arguments.ModifierTensors` of kernel arguments ``a``: each field the kernel argument
    of its name and its broadcast strides (no copy, no materialised mask), or the dummy."""
    tensors, strides = {}, {}
    for name in ModifierStrides._fields:
        t = getattr(a, name)
        if t is None:
            tensors[name], strides[name] = dummy, _NO_STRIDES
        else:
            tensors[name] = t.view(torch.uint8) if t.dtype is torch.bool else t
            strides[name] = Strides(*a.broadcast_strides(name))
    return ModifierTensors(**tensors, st=ModifierStrides(**strides))


def _common(spec: AttentionSpec) -> _Args:
    """The modifiers' tensors, argument groups and flags shared by every kernel of a call, from its
    kernel arguments."""
    a = spec.kernel_args
    dev = spec.device
    no_index = torch.zeros(2, dtype=torch.int32, device=dev)
    # The kernels read index tensors as plain arrays (a block table by its row stride alone): a
    # caller's t[::2] is valid input, so it is made contiguous here (a few ints).
    table = spec.block_table.contiguous() if spec.is_paged else no_index.view(1, 2)
    seqs = Sequences(
        spec.cu_seqlens_q.contiguous() if spec.is_varlen else no_index,
        spec.cu_seqlens_k.contiguous() if spec.cu_seqlens_k is not None else no_index,
        spec.seqused_k.contiguous() if spec.seqused_k is not None else no_index,
        table, table.stride(0), spec.block_size if spec.is_paged else 1)
    flags = _flags(a, BOTTOM_RIGHT=a.bottom_right, IS_VARLEN=spec.is_varlen, HAS_SEQUSED=spec.seqused_k is not None,
                   PAGED=spec.is_paged, HAS_DROPOUT=a.dropout_p > 0)
    sizes = Sizes(spec.seqlen_q, spec.seqlen_k, spec.group_size, spec.head_dim, spec.head_dim_v)
    constexprs = dict(
        F=flags, BLOCK_D=_block_dim(spec.head_dim), BLOCK_DV=_block_dim(spec.head_dim_v),
        # fp32 inputs must not be rounded to TF32 inside tl.dot: the accuracy rule is fp32's.
        DOT_PRECISION="ieee" if spec.dtype == torch.float32 else "tf32",
    )
    return _Args(_modifier_tensors(a, torch.empty(1, dtype=torch.float32, device=dev)),
                 dict(seqs=seqs, sizes=sizes, sc=_scalars(a)), (a.seed & 0xFFFFFFFF, (a.seed >> 32) & 0xFFFFFFFF),
                 seqlen_bucket(max(spec.seqlen_q, spec.seqlen_k)), constexprs)


#: Flash-decoding (:mod:`.decode_kernel`) serves calls whose query rows per kv head (seqlen_q * group)
#: fit one tile of DECODE_ROWS. Its configuration is fixed, never tuned: with the chunk rule of
#: :func:`decode_chunks` that is what makes a row's bits independent of the batch and of the run.
DECODE_ROWS = 16
DECODE_BLOCK_N = 64
DECODE_MIN_CHUNK = 128
DECODE_MAX_SPLITS = 64
DECODE_CONFIG = dict(num_warps=4, num_stages=2)


def decode_splits(k_len: int) -> int:
    """Splits allowed to a sequence of ``k_len`` keys: at most DECODE_MAX_SPLITS of DECODE_MIN_CHUNK keys.

    It grows with ``k_len``, so the longest sequence's bounds every other's: that is the grid.
    """
    return max(1, min(-(-k_len // DECODE_MIN_CHUNK), DECODE_MAX_SPLITS))


def decode_chunks(k_len: int) -> int:
    """Key chunks a sequence of ``k_len`` keys is cut into (the host copy of tile_math.decode_chunk_len).

    At most :func:`decode_splits`, fewer when rounding the chunk up to whole tiles leaves the last
    ones empty; unlike the splits, not monotonic in ``k_len``.
    """
    chunk = max(1, -(-(-(-k_len // decode_splits(k_len))) // DECODE_BLOCK_N)) * DECODE_BLOCK_N
    return -(-k_len // chunk)


def uses_decode_kernel(spec: AttentionSpec) -> bool:
    """Whether a forward call runs the split-K decoding kernel rather than the FlashAttention-2 one:
    a few query rows per kv head, and only the kernel arguments it applies (band, ALiBi, softcap; a
    mask, a bias or dropout take the prefill kernel)."""
    a = spec.kernel_args
    return (spec.seqlen_q * spec.group_size <= DECODE_ROWS and a.mask is None and a.bias is None
            and a.dropout_p == 0)


def forward(spec: AttentionSpec, out_c: torch.Tensor, lse: torch.Tensor) -> None:
    """Write ``out_c`` (canonical view, any float dtype) and the natural-log ``lse``."""
    if uses_decode_kernel(spec):
        _decode(spec, out_c, lse)
    else:
        _prefill(spec, out_c, lse)
    lse.mul_(LN2)  # the kernels store log2; the API's LSE is a natural log (-inf stays -inf)


def _prefill(spec: AttentionSpec, out_c: torch.Tensor, lse: torch.Tensor) -> None:
    fwd, _, _ = kernels()
    a = _common(spec)
    v = spec.is_varlen
    args = (spec.q_c, spec.k_c, spec.v_c, out_c, lse, a.mods, _strides(spec.q_c, v),
            _kv_strides(spec, spec.k_c), _kv_strides(spec, spec.v_c), _strides(out_c, v), _lse_strides(lse, v),
            *a.groups.values(), *a.seeds, a.bucket)

    def grid(block_m, block_n):
        return (triton.cdiv(max(spec.seqlen_q, 1), block_m), spec.heads_q, spec.batch)

    _launch("forward", fwd.attention_forward_kernel, FORWARD_SPACE, grid, args, a.constexprs,
            _cached_forward_config(spec))


def _decode(spec: AttentionSpec, out_c: torch.Tensor, lse: torch.Tensor) -> None:
    """Split-K decoding: partial results per key chunk into fp32 scratch, then the ordered merge."""
    dec = kernels()[2]
    a = _common(spec)
    v = spec.is_varlen
    # One tile of rows whatever the call (tl.dot takes M >= 16): a row's arithmetic never depends on
    # how many rows its neighbours fill. The grid has the longest sequence's splits; the programs of
    # chunks a shorter sequence does not have return at once.
    splits = decode_splits(spec.seqlen_k)
    block_dv = a.constexprs["BLOCK_DV"]
    part_lse = torch.empty((spec.batch, spec.heads_kv, splits, DECODE_ROWS), dtype=torch.float32, device=spec.device)
    part_out = torch.empty(part_lse.shape + (block_dv,), dtype=torch.float32, device=spec.device)
    part_st = Strides(*part_lse.stride())
    config = KernelConfig(DECODE_ROWS, DECODE_BLOCK_N, **DECODE_CONFIG)
    chunking = dict(MIN_CHUNK=DECODE_MIN_CHUNK, MAX_SPLITS=DECODE_MAX_SPLITS)
    groups = a.groups
    _launch("decode", dec.attention_decode_kernel, (), lambda bm, bn: (splits, spec.heads_kv, spec.batch),
            (spec.q_c, spec.k_c, spec.v_c, part_out, part_lse, a.mods, _strides(spec.q_c, v),
             _kv_strides(spec, spec.k_c), _kv_strides(spec, spec.v_c), part_st, *groups.values()),
            dict(a.constexprs, **chunking), config)
    _launch("decode-merge", dec.attention_decode_merge_kernel, (), lambda bm, bn: (spec.heads_kv, spec.batch),
            (part_out, part_lse, out_c, lse, _strides(out_c, v), _lse_strides(lse, v), part_st, groups["seqs"],
             groups["sizes"], groups["sc"]), dict(F=a.constexprs["F"], BLOCK_DV=block_dv, **chunking), config)


def backward(spec: AttentionSpec, grads) -> None:
    """dq, dk, dv (and the reduced bias gradient) of a :class:`~tileattn.core.dispatch.Gradients` bundle."""
    _, bwd, _ = kernels()
    v = spec.is_varlen
    # Base-2 LSE; rows that saw no key get +inf so every recomputed probability is exactly 0.
    lse2 = (grads.lse.float() * LOG2E).masked_fill_(grads.lse == -math.inf, math.inf)
    # The kernels index delta with the LSE's strides.
    delta = grads.delta.float().contiguous()
    a = _common(spec)
    if spec.seqused_k is not None:
        # Keys past a sequence's seqused_k get no gradient; the kernels only write the keys in use.
        grads.dk.zero_()
        grads.dv.zero_()
    inputs = (spec.q_c, spec.k_c, spec.v_c, grads.dout, lse2, delta)
    strides = (_strides(spec.q_c, v), _strides(spec.k_c, v), _strides(spec.v_c, v), _strides(grads.dout, v),
               _lse_strides(lse2, v))
    rest = (*a.groups.values(), *a.seeds, a.bucket)
    _launch("dkdv", bwd.attention_backward_dkdv_kernel, DKDV_SPACE,
            lambda bm, bn: (triton.cdiv(max(spec.seqlen_k, 1), bn), spec.heads_kv, spec.batch),
            (*inputs, grads.dk, grads.dv, a.mods, *strides, _strides(grads.dk, v),
             _strides(grads.dv, v), *rest), a.constexprs)

    need_dbias = grads.dbias is not None
    if need_dbias:
        # dS is written densely (B, Hq, Sq, Sk) in fp32, then reduced over the bias's broadcast dims.
        dbias_full = torch.zeros((spec.batch, spec.heads_q, spec.seqlen_q, spec.seqlen_k), dtype=torch.float32,
                                 device=spec.device)
        dbias_strides = Strides(*dbias_full.stride())
    else:
        dbias_full = torch.empty(1, dtype=torch.float32, device=spec.device)
        dbias_strides = Strides(0, 0, 0, 0)
    _launch("dq", bwd.attention_backward_dq_kernel, DQ_SPACE,
            lambda bm, bn: (triton.cdiv(max(spec.seqlen_q, 1), bm), spec.heads_q, spec.batch),
            (*inputs, grads.dq, dbias_full, a.mods, *strides, _strides(grads.dq, v), dbias_strides,
             *rest), dict(a.constexprs, WRITE_DBIAS=need_dbias))
    if need_dbias:
        grads.dbias.add_(reduce_to_shape(dbias_full, grads.dbias.shape))
