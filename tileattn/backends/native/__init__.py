"""The native engine: FlashAttention forward, decode and backward in C (:mod:`.kernels`), prebuilt in
the Linux x86-64 and aarch64 wheels or compiled on first use for this machine's CPU (:mod:`.prebuilt` chooses,
:mod:`.build` compiles), registered ahead of the PyTorch-ops ``cpu`` engine.

What the kernels do natively is declared as data (:data:`.kernels.CAPABILITIES`); dispatch routes
anything else, or every call when there is no library here (no prebuilt one this CPU runs and no
compiler, a failed build, a damaged prebuilt library: one warning says why), to the ``cpu`` engine. ``TILEATTN_BACKEND=cpu`` (or ``backend="cpu"``)
forces the PyTorch engine, ``TILEATTN_BACKEND=native`` this one. Tile sizes come from the tune cache
(``tileattn tune --backend native``) or the kernels' defaults. A long call from the main thread can
be interrupted with Ctrl-C: the kernels stop at their next tile (:class:`.kernels.CancelFlag`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import replace
from typing import Tuple

import torch

from ...core.engine import ALL_DTYPES, Backend, Capabilities, Gradients, register
from ...core.functions import MaskMod, ScoreMod
from ...core.kernel_args import KernelArgs
from ...core.kvquant import KVQuant, canonical_scales, quant_of
from ...core.modifiers import Alibi, Band, Bias, Dropout, Mask, Softcap
from ...core.spec import AttentionSpec
from ...core.tunecache import lookup
from . import kernels, prepared

#: Calls whose work (score elements) is below this run without arming the Ctrl-C hook: a decode
#: step is tens of microseconds, and the hook costs a few.
_INTERRUPTIBLE_WORK = 1 << 24


class NativeBackend(Backend):
    name = "native"
    priority = 15
    capabilities = Capabilities(
        devices=frozenset(("cpu",)), dtypes=frozenset(kernels.CAPABILITIES["dtypes"]) & ALL_DTYPES,
        # the kernels' score pipeline (csrc/tile.h); a quantised cache in the formats they read as stored
        # (kernels.CAPABILITIES["kv_formats"]); user functions compiled into tile functions the kernels
        # call (tileattn.programs)
        modifiers=frozenset((Softcap, Alibi, Bias, Band, Mask, Dropout, KVQuant, ScoreMod, MaskMod)),
        compiled_functions=True,
    )
    _warned = False

    def unavailable_reason(self):
        ok, why = kernels.available()
        if ok:
            return None
        if not NativeBackend._warned:
            NativeBackend._warned = True
            warnings.warn(f"tileattn: {why}; the PyTorch engine ('cpu') serves every call.", RuntimeWarning,
                          stacklevel=2)
        return why  # already "native kernels unavailable: <the reason>"

    def extra_reasons(self, spec: AttentionSpec, backward: bool):
        """What the kernels' struct cannot express (the calls are not checked again below: the spec
        validated them): a paged cache without pages, 2^31 tokens. A last dimension that is not
        unit-stride and index tensors that are views are handled, by copies for the kernel call."""
        why = []
        if spec.is_paged and (spec.block_table.shape[1] == 0 or spec.block_size == 0):
            why.append("a paged cache without pages")
        if max(spec.q_c.shape[0] if spec.is_varlen else spec.seqlen_q, spec.seqlen_k) >= 2**31 - 1:
            why.append("a sequence of 2^31 tokens or more")
        quant = quant_of(spec)
        if quant is not None:
            fmt = quant.formats(spec.k, spec.v)[0]
            if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                why.append(f"a quantised or scaled cache with {spec.dtype} queries (fp32, bf16 or fp16)")
            elif fmt is not None and fmt.name not in kernels.CAPABILITIES["kv_formats"]:
                why.append(f"a cache of format {fmt.name}")
        return why

    def forward(self, spec: AttentionSpec, out, lse):
        k, v = (spec.k, spec.v) if spec.is_paged else (spec.k_c, spec.v_c)
        with self._interruptible(spec) as cancel:
            kernels.forward(kernels.unit_stride(spec.q_c), kernels.unit_stride(k), kernels.unit_stride(v), out, lse,
                            *self._call_arguments(spec), cancel=cancel)

    def backward(self, spec: AttentionSpec, grads: Gradients):
        # Statistics given by a caller (an SDPA op's logsumexp, Ascend softmax_max/sum) may be fp32
        # for fp64 inputs; the kernels read them in their accumulation type.
        lse = grads.lse.to(kernels.accumulation_dtype(spec.q.dtype)).contiguous()
        # The kernels read delta with lse's strides, which a row slice of one head's LSE keeps from
        # the whole (contiguous() leaves the strides of size-1 dims alone).
        delta = torch.empty_like(lse).copy_(grads.delta)
        with self._interruptible(spec) as cancel:
            kernels.backward(kernels.unit_stride(spec.q_c), kernels.unit_stride(spec.k_c),
                             kernels.unit_stride(spec.v_c), replace(grads, lse=lse, delta=delta),
                             *self._call_arguments(spec), cancel=cancel)

    def prepare(self, spec: AttentionSpec):
        """The struct of a short decode step packed once (:mod:`.prepared`): a lean call writes only
        its pointers, key length and K/V strides."""
        return prepared.prepare(spec, _INTERRUPTIBLE_WORK)

    @staticmethod
    def _call_arguments(spec: AttentionSpec) -> Tuple[KernelArgs, kernels.Geometry, kernels.Tiles]:
        """The kernels' arguments of a validated call: its kernel arguments (the modifiers lowered,
        :class:`tileattn.core.kernel_args.KernelArgs`; a quantised cache's scales in the cache's
        canonical order, as its keys are read), its geometry (index tensors made contiguous: a caller's
        ``t[::2]`` is valid input, the kernels read plain arrays) and its tuned tiles."""
        args = spec.kernel_args
        if "k_scale" in args.per_call:
            args = args.replaced(canonical_scales(spec, args))
        geometry = kernels.PADDED
        if spec.is_varlen or spec.is_paged or spec.seqused_k is not None:
            geometry = kernels.Geometry(kernels.contiguous_index(spec.cu_seqlens_q),
                                        kernels.contiguous_index(spec.cu_seqlens_k),
                                        kernels.contiguous_index(spec.seqused_k), spec.block_table)
        tuned = lookup("native", spec)
        tiles = kernels.Tiles(tuned.get("block_m", 0), tuned.get("block_n", 0)) if tuned else kernels.DEFAULT_TILES
        return args, geometry, tiles

    @staticmethod
    def _interruptible(spec: AttentionSpec):
        """A context yielding a CancelFlag armed for Ctrl-C around a long call from the main thread;
        for a short one (a decode step: tens of microseconds of C) a no-op context yielding None,
        which costs less than arming the hook would."""
        long = spec.batch * spec.heads_q * spec.seqlen_q * max(spec.seqlen_k, 1) >= _INTERRUPTIBLE_WORK
        if long and threading.current_thread() is threading.main_thread():
            return NativeBackend._armed()
        return contextlib.nullcontext()

    @staticmethod
    @contextlib.contextmanager
    def _armed():
        """Ctrl-C sets the kernels' cancel flag; a call stopped by it ends in KeyboardInterrupt, as a
        Python loop would."""
        flag = kernels.CancelFlag()
        try:
            with flag.on_sigint():
                yield flag
        except kernels.Cancelled:
            if flag.by_sigint:
                raise KeyboardInterrupt from None
            raise


register(NativeBackend())

__all__ = ["NativeBackend", "kernels"]
