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

import torch

from ...core.engine import ALL_DTYPES, Backend, Capabilities, Gradients, register
from ...core.functions import MaskMod, ScoreMod
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
        if quant_of(spec) is not None:
            if spec.dtype not in (torch.float32, torch.bfloat16, torch.float16):
                why.append(f"a quantised or scaled cache with {spec.dtype} queries (fp32, bf16 or fp16)")
            elif spec.k.dtype is not spec.dtype and spec.k.dtype not in kernels.CAPABILITIES["kv_formats"]:
                why.append(f"a cache of dtype {spec.k.dtype}")
        return why

    def forward(self, spec: AttentionSpec, out, lse):
        kwargs = self._call_arguments(spec)
        k, v = (spec.k, spec.v) if spec.is_paged else (spec.k_c, spec.v_c)
        with self._interruptible(spec) as cancel:
            kernels.forward(kernels.unit_stride(spec.q_c), kernels.unit_stride(k), kernels.unit_stride(v), out, lse,
                            cancel=cancel, validate=False, user=self._user(spec), **kwargs)

    def backward(self, spec: AttentionSpec, grads: Gradients):
        kwargs = self._call_arguments(spec)
        # Statistics given by a caller (an SDPA op's logsumexp, Ascend softmax_max/sum) may be fp32
        # for fp64 inputs; the kernels read them in their accumulation type.
        lse = grads.lse.to(kernels.accumulation_dtype(spec.q.dtype)).contiguous()
        # The kernels read delta with lse's strides, which a row slice of one head's LSE keeps from
        # the whole (contiguous() leaves the strides of size-1 dims alone).
        delta = torch.empty_like(lse).copy_(grads.delta)
        user = self._user(spec, grads.captures)
        with self._interruptible(spec) as cancel:
            kernels.backward(kernels.unit_stride(spec.q_c), kernels.unit_stride(spec.k_c),
                             kernels.unit_stride(spec.v_c), grads.out, grads.dout, lse, delta, grads.dq, grads.dk,
                             grads.dv, cancel=cancel, dbias=grads.dbias, validate=False, user=user, **kwargs)
        if user is not None and user.grads is not None:
            # each thread added into its own copy of a captured tensor's gradient: sum them
            wanted = {id(t): i for i, t in enumerate(user.score_mod.grad_captures)}
            for t, buffer in zip(user.score.captures, user.grads):
                if buffer is not None:
                    grads.captures[wanted[id(t)]] += buffer.sum(0).to(grads.captures[wanted[id(t)]].dtype)

    def prepare(self, spec: AttentionSpec):
        """The struct of a short decode step packed once (:mod:`.prepared`): a lean call writes only
        its pointers, key length and K/V strides."""
        return prepared.prepare(spec, _INTERRUPTIBLE_WORK)

    @staticmethod
    def _user(spec: AttentionSpec, capture_grads=None):
        """The user record of a call with user functions or a block map (None without): their compiled
        tile functions bound to this call, and for a backward with ``capture_grads`` a buffer per
        thread for each captured tensor that requires grad."""
        a = spec.kernel_args
        if a.score_mod is None and a.mask_mod is None and a.block_states is None:
            return None
        score = a.score_mod.bound if a.score_mod is not None else None
        grads = None
        if capture_grads and score is not None:
            wanted = {id(t) for t in a.score_mod.grad_captures}
            threads = torch.get_num_threads()
            grads = [torch.zeros((threads, *t.shape), dtype=score.program.dtype) if id(t) in wanted else None
                     for t in score.captures]
        user = kernels.UserCall(kernels._library(), score=score,
                                mask=a.mask_mod.bound if a.mask_mod is not None else None, states=a.block_states,
                                grads=grads)
        user.score_mod = a.score_mod
        return user

    @staticmethod
    def _call_arguments(spec: AttentionSpec) -> dict:
        """The kernels' keywords for a validated call: its kernel arguments (the modifiers lowered,
        :class:`tileattn.core.kernel_args.KernelArgs`: its numbers by name, which fill the record's
        fields of those names, and its tensors) and the tuned tiles; index tensors made contiguous (a
        caller's ``t[::2]`` is valid input, the kernels read plain arrays)."""
        tuned = lookup("native", spec) or {}
        a = spec.kernel_args
        quant = canonical_scales(spec, a) if "k_scale" in a.per_call else {}
        return dict(**quant, **a.numbers(), cu_seqlens_q=kernels.contiguous_index(spec.cu_seqlens_q),
                    cu_seqlens_k=kernels.contiguous_index(spec.cu_seqlens_k),
                    seqused_k=kernels.contiguous_index(spec.seqused_k), block_table=spec.block_table,
                    alibi_slopes=a.alibi_slopes, mask=a.mask, bias=a.bias, seed=a.seed,
                    block_m=tuned.get("block_m", 0), block_n=tuned.get("block_n", 0))

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
