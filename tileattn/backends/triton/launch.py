"""Launchers of the Triton kernels: validate, allocate, pick a configuration, launch.

The kernels know nothing of the public API. This layer turns an :class:`~tileattn.spec.AttentionInputs`
into pointers, strides and flags: canonical strided views are passed as they are (a transposed BSND or
SBH tensor is read in place, never copied), broadcast masks and biases become stride-0 dimensions, and
packed (TND) problems pass ``stride_b = 0`` plus their ``cu_seqlens``.

Interpreter or compiler
-----------------------
``@triton.jit`` reads ``TRITON_INTERPRET`` when it *decorates* a function, and Triton decorates its own
library when it is imported: the interpreter is on for a whole process or not at all. The kernel
modules are imported lazily, in the same mode as Triton's library (:func:`kernels`).

Configurations
--------------
Under the interpreter (and under pytest) one fixed small configuration runs, so tests stay fast and
repeatable. On a GPU the tune cache (``tileattn tune``, :mod:`tileattn.tuning`) may name the forward
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

from ...spec import AttentionInputs, empty_in_layout, to_canonical
from ...tunecache import lookup, seqlen_bucket

LOG2E = 1.4426950408889634
LN2 = math.log(2.0)
MAX_HEAD_DIM = 256

_KERNEL_MODULES = ("tile_math", "forward_kernel", "backward_kernel")
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
    """(forward module, backward module), imported on first use.

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
        _state["modules"] = (mods[1], mods[2])
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
_TUNE_KEY = ["tune_bucket", "BLOCK_D", "BLOCK_DV", "HAS_LEFT", "HAS_RIGHT", "IS_VARLEN", "HAS_MASK",
             "HAS_BIAS", "HAS_ALIBI", "HAS_SOFTCAP", "HAS_DROPOUT", "DOT_PRECISION"]


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
    """Launch with a fixed, cached or autotuned configuration; ``grid_of(block_m, block_n)``."""
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


def _cached_forward_config(inp: AttentionInputs):
    entry = lookup("triton", inp)
    if not entry:
        return None
    return KernelConfig(int(entry["block_m"]), int(entry["block_n"]), int(entry.get("num_warps", 4)),
                        int(entry.get("num_stages", 2)))


def _block_dim(d: int) -> int:
    """Head dims are padded to a power of two (tl.arange needs one) and at least 16 (tl.dot does)."""
    return max(16, triton.next_power_of_2(d))


def _strides4(t: torch.Tensor, varlen: bool):
    """(batch, head, seq, dim) strides of a canonical view; packed (T, H, D) has no batch stride."""
    if varlen:
        return (0, t.stride(1), t.stride(0), t.stride(2))
    return tuple(t.stride())


def _broadcast4(x: torch.Tensor, full):
    """A (B, Hq, Sq, Sk) stride-0 view of a broadcastable tensor: no copy, no materialised mask."""
    x = x[(None,) * (4 - x.dim())]
    return x.expand(full)


def _common(inp: AttentionInputs):
    """Pointer arguments, strides, scalars and flags shared by every kernel of a call."""
    dev = inp.device
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    full = (inp.batch, inp.heads_q, inp.seqlen_q, inp.seqlen_k)
    if inp.mask is not None:
        mask = _broadcast4(inp.mask.view(torch.uint8), full)
        mask_strides = mask.stride()
    else:
        mask, mask_strides = dummy, (0, 0, 0, 0)
    if inp.bias is not None:
        bias = _broadcast4(inp.bias, full)
        bias_strides = bias.stride()
    else:
        bias, bias_strides = dummy, (0, 0, 0, 0)
    if inp.alibi_slopes is not None:
        slopes = inp.alibi_slopes
        slope_strides = (0, slopes.stride(0)) if slopes.dim() == 1 else tuple(slopes.stride())
    else:
        slopes, slope_strides = dummy, (0, 0)
    if inp.is_varlen:
        cu_q, cu_k = inp.cu_seqlens_q, inp.cu_seqlens_k
    else:
        cu_q = cu_k = torch.zeros(2, dtype=torch.int32, device=dev)
    left, right = inp.window_bounds
    threshold = int(round(inp.dropout_p * (1 << 24)))
    scalars = (
        inp.seqlen_q, inp.seqlen_k, inp.group_size, inp.head_dim, inp.head_dim_v,
        inp.scale, inp.softcap if inp.softcap > 0 else 1.0, left or 0, right or 0,
        inp.seed & 0xFFFFFFFF, (inp.seed >> 32) & 0xFFFFFFFF, threshold,
        1.0 / (1.0 - inp.dropout_p), seqlen_bucket(max(inp.seqlen_q, inp.seqlen_k)),
    )
    flags = dict(
        HAS_LEFT=left is not None, HAS_RIGHT=right is not None, IS_VARLEN=inp.is_varlen,
        HAS_MASK=inp.mask is not None, HAS_BIAS=inp.bias is not None,
        HAS_ALIBI=inp.alibi_slopes is not None, HAS_SOFTCAP=inp.softcap > 0,
        HAS_DROPOUT=inp.dropout_p > 0, BLOCK_D=_block_dim(inp.head_dim), BLOCK_DV=_block_dim(inp.head_dim_v),
        # fp32 inputs must not be rounded to TF32 inside tl.dot: the accuracy rule is fp32's.
        DOT_PRECISION="ieee" if inp.dtype == torch.float32 else "tf32",
    )
    extras = (mask, bias, slopes, cu_q, cu_k)
    strides = tuple(mask_strides) + tuple(bias_strides) + tuple(slope_strides)
    return extras, strides, scalars, flags


def _lse_strides(lse: torch.Tensor, varlen: bool):
    return (0, lse.stride(0), lse.stride(1)) if varlen else tuple(lse.stride())


def forward(inp: AttentionInputs):
    """(out in the user's layout, natural-log LSE of shape ``inp.lse_shape()``)."""
    fwd, _ = kernels()
    s = inp.q.shape[0] if inp.is_varlen else inp.seqlen_q
    out, out_c = empty_in_layout(inp.layout, inp.batch, inp.heads_q, s, inp.head_dim_v, inp.q)
    lse = torch.empty(inp.lse_shape(), dtype=torch.float32, device=inp.device)
    (mask, bias, slopes, cu_q, cu_k), extra_strides, scalars, flags = _common(inp)
    v = inp.is_varlen
    args = (inp.q_c, inp.k_c, inp.v_c, out_c, lse, mask, bias, slopes, cu_q, cu_k,
            *_strides4(inp.q_c, v), *_strides4(inp.k_c, v), *_strides4(inp.v_c, v), *_strides4(out_c, v),
            *_lse_strides(lse, v), *extra_strides, *scalars)

    def grid(block_m, block_n):
        return (triton.cdiv(max(inp.seqlen_q, 1), block_m), inp.heads_q, inp.batch)

    if out.numel():
        _launch("forward", fwd.attention_forward_kernel, FORWARD_SPACE, grid, args, flags,
                _cached_forward_config(inp))
    lse.mul_(LN2)  # the kernel stores log2; the API's LSE is a natural log (-inf stays -inf)
    return out, lse


def backward(inp: AttentionInputs, out, lse, dout, need_dbias: bool):
    """(dq, dk, dv, dbias or None) in the shapes of q, k, v and bias."""
    _, bwd = kernels()
    v = inp.is_varlen
    out_c = to_canonical(out, inp.layout, inp.heads_q)
    dout_c = to_canonical(dout, inp.layout, inp.heads_q)
    dq = torch.empty_like(inp.q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(inp.k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(inp.v, memory_format=torch.contiguous_format)
    dq_c = to_canonical(dq, inp.layout, inp.heads_q)
    dk_c = to_canonical(dk, inp.layout, inp.heads_kv)
    dv_c = to_canonical(dv, inp.layout, inp.heads_kv)
    # Base-2 LSE; rows that saw no key get +inf so every recomputed probability is exactly 0.
    lse2 = (lse.float() * LOG2E).masked_fill_(lse == -math.inf, math.inf)
    delta = torch.empty_like(lse2)
    (mask, bias, slopes, cu_q, cu_k), extra_strides, scalars, flags = _common(inp)
    lse_strides = _lse_strides(lse2, v)
    q_strides, k_strides, v_strides = _strides4(inp.q_c, v), _strides4(inp.k_c, v), _strides4(inp.v_c, v)
    g_strides = _strides4(dout_c, v)
    n_q_blocks_max = max(inp.seqlen_q, 1)

    if dq.numel() == 0 or dk.numel() == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv, (torch.zeros_like(inp.bias) if need_dbias else None)

    pre_block = 64 if not interpreter_active() else FIXED_CONFIG.block_m
    bwd.attention_backward_preprocess[(triton.cdiv(n_q_blocks_max, pre_block), inp.heads_q, inp.batch)](
        out_c, dout_c, delta, cu_q, *_strides4(out_c, v), *g_strides, *lse_strides,
        inp.seqlen_q, inp.head_dim_v, IS_VARLEN=v, BLOCK_M=pre_block, BLOCK_DV=flags["BLOCK_DV"])

    dkdv_args = (inp.q_c, inp.k_c, inp.v_c, dout_c, lse2, delta, dk_c, dv_c, mask, bias, slopes, cu_q, cu_k,
                 *q_strides, *k_strides, *v_strides, *g_strides, *lse_strides,
                 *_strides4(dk_c, v), *_strides4(dv_c, v), *extra_strides, *scalars)
    _launch("dkdv", bwd.attention_backward_dkdv_kernel, DKDV_SPACE,
            lambda bm, bn: (triton.cdiv(max(inp.seqlen_k, 1), bn), inp.heads_kv, inp.batch),
            dkdv_args, flags)

    if need_dbias:
        # dS is written densely (B, Hq, Sq, Sk) in fp32, then reduced over the bias's broadcast dims.
        dbias_full = torch.zeros((inp.batch, inp.heads_q, inp.seqlen_q, inp.seqlen_k), dtype=torch.float32,
                                 device=inp.device)
        dbias_strides = dbias_full.stride()[:3]
    else:
        dbias_full = torch.empty(1, dtype=torch.float32, device=inp.device)
        dbias_strides = (0, 0, 0)
    dq_args = (inp.q_c, inp.k_c, inp.v_c, dout_c, lse2, delta, dq_c, dbias_full, mask, bias, slopes, cu_q, cu_k,
               *q_strides, *k_strides, *v_strides, *g_strides, *lse_strides,
               *_strides4(dq_c, v), *dbias_strides, *extra_strides, *scalars)
    _launch("dq", bwd.attention_backward_dq_kernel, DQ_SPACE,
            lambda bm, bn: (triton.cdiv(n_q_blocks_max, bm), inp.heads_q, inp.batch),
            dq_args, dict(flags, WRITE_DBIAS=need_dbias))

    dbias = None
    if need_dbias:
        dbias = _reduce_to_shape(dbias_full, inp.bias.shape).to(inp.bias.dtype)
    return dq, dk, dv, dbias


def _reduce_to_shape(full: torch.Tensor, shape) -> torch.Tensor:
    """Sum a (B, Hq, Sq, Sk) gradient over the dimensions a broadcast bias of ``shape`` repeated."""
    shape4 = (1,) * (4 - len(shape)) + tuple(shape)
    dims = [i for i, (n, f) in enumerate(zip(shape4, full.shape)) if n == 1 and f != 1]
    if dims:
        full = full.sum(dim=dims, keepdim=True)
    return full.reshape(shape)
