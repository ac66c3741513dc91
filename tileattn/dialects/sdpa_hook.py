"""tileattn behind PyTorch's own SDPA plug-in point, ``torch.nn.attention.activate_flash_attention_impl``.

    import torch, tileattn.integrations.torch_sdpa as tileattn_sdpa
    tileattn_sdpa.register()                                        # once; idempotent
    torch.nn.attention.activate_flash_attention_impl("tileattn")
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)   # tileattn
    torch.nn.attention.restore_flash_attention_impl()               # torch's own kernels again

Why this instead of :func:`tileattn.patch_sdpa`: the hook replaces the *kernels* SDPA dispatches to,
not the Python function, so it reaches code that imported ``scaled_dot_product_attention`` before
(``from torch.nn.functional import scaled_dot_product_attention``), ``torch.ops.aten`` callers and
graphs ``torch.compile`` compiled before the activation; and torch keeps choosing the backend, so
calls SDPA sends to its math path (see below) stay exactly torch's.

How: activation registers Python kernels with ``torch.library.Library("aten", "IMPL")`` for

* ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, dispatch key ``CPU``
  (SDPA's "flash" backend on CPU tensors);
* ``aten::_scaled_dot_product_flash_attention`` and its ``_backward``, dispatch key ``CUDA`` (SDPA's
  flash backend on GPUs; tileattn's Triton engine serves it).

Autograd is untouched: torch's derivative formula still calls the ``_backward`` op, which lands on
tileattn too. ``torch.compile`` traces both ops through torch's meta kernels and calls them at run
time (Inductor keeps them as fallback kernels), so compiled graphs reach tileattn as well; outputs are
returned with exactly the strides the meta kernels promise. Restoring destroys the library, which
puts torch's kernels back for every caller, compiled code included.

What the kernels honour, with torch's meaning: ``is_causal`` **top-left** aligned (``tril(ones(Sq,
Sk))``, tileattn's ``align="top_left"``), a float ``attn_mask`` added to the scores (together with
``is_causal`` both apply, as in torch's kernel), ``scale``, GQA (``Hq % Hkv == 0``), any strides. The
returned logsumexp has torch's shape, strides and dtype (fp32, fp64 for fp64 inputs) and torch's value
0 on rows that see no key, so torch's own backward could consume it. The backward op receives no
tileattn state, only ``(q, k, v, out, lse)``: that is all :func:`tileattn.attention_backward` needs
(FlashAttention-2's backward from given statistics), so no forward is recomputed. The CUDA op has no mask; its ``is_causal`` is FlashAttention-2's bottom-right (torch
only sends it there with ``Sq == Sk``, where both alignments agree), and its dropout is honoured with
tileattn's RNG, the seed travelling to the backward in ``rng_state``. What cannot be honoured raises
:class:`SdpaHookError` before any compute: dropout on CPU (torch's CPU kernel refuses it too; SDPA
sends dropout to the math path), ``return_debug_mask``, different head dims, kv heads not dividing
query heads, bool or wrongly typed masks (SDPA converts bool masks to float before these ops).

Threads: calls from any number of threads are fine while tileattn is active (each call is
independent; the counters are locked). Switch (activate/restore) while no SDPA call is in flight in
another thread: torch deregisters a ``torch.library`` Python kernel without waiting for calls running
inside it, which trips an internal assert or crashes the process (torch's limitation, the same for
FA3/FA4), and torch's registry itself takes no lock.

What never reaches a flash kernel (torch's math path, unchanged by the hook): on CPU, dropout > 0,
5-D inputs (3-D ones too before torch 2.14), a last dim with stride != 1, ``Dv != D``, empty
sequences, masks that are neither 2-D nor 4-D (docs/sdpa_hook.md has the measured table); on CUDA, everything torch's FlashAttention-2 constraints exclude (fp32/fp64,
any ``attn_mask``, causal with ``Sq != Sk``, head dims over 256...). Nested tensors and
``torch.nn.attention.varlen`` use ``aten::_flash_attention_forward`` on CUDA, which is not replaced.
"""

from __future__ import annotations

import collections
import math
import threading
import warnings

import torch

from ..core.api import attention_backward, flash_attention

__all__ = ["IMPL_NAME", "hook_available", "register", "call_counts", "SdpaHookError"]

IMPL_NAME = "tileattn"

_CPU_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_CPU_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"
_CUDA_FWD = "_scaled_dot_product_flash_attention"
_CUDA_BWD = "_scaled_dot_product_flash_attention_backward"

_HOOK_FUNCTIONS = ("register_flash_attention_impl", "activate_flash_attention_impl",
                   "restore_flash_attention_impl", "current_flash_attention_impl")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# rng_state[1] of a CUDA forward run by tileattn (b"tileatt\0"): torch's own kernel keeps a Philox offset
# there, so a backward can tell whose dropout mask it is asked to regenerate.
_SEED_TAG = 0x74696C6561747400

_lock = threading.Lock()
_counts = collections.Counter()
_library = None  # the live torch.library.Library while tileattn is active


class SdpaHookError(ValueError, RuntimeError):
    """An op argument the hook cannot honour. Also a RuntimeError, which torch's kernels raise."""


def hook_available() -> bool:
    """Whether this torch has the flash-attention plug-in point (detected by feature, not version)."""
    attention = getattr(torch.nn, "attention", None)
    return attention is not None and all(hasattr(attention, name) for name in _HOOK_FUNCTIONS)


def register() -> str:
    """Make ``"tileattn"`` known to ``torch.nn.attention.activate_flash_attention_impl``; idempotent.

    Registering does not activate anything (torch asks providers not to switch themselves on), so
    importing or registering tileattn never changes what SDPA computes. Returns the name.
    Raises RuntimeError on a torch without the hook: use :func:`tileattn.patch_sdpa` there.
    """
    if not hook_available():
        raise RuntimeError(
            f"tileattn: torch {torch.__version__} has no torch.nn.attention.register_flash_attention_impl; "
            "use `with tileattn.patch_sdpa(): ...` to route F.scaled_dot_product_attention through tileattn.")
    with _lock:
        torch.nn.attention.register_flash_attention_impl(IMPL_NAME, register_fn=_install)
    return IMPL_NAME


def status() -> dict:
    """Whether this torch has the hook, whether tileattn is registered with it, and whether it is
    the active flash implementation (plain data, for ``tileattn env``)."""
    if not hook_available():
        return {"available": False, "registered": False, "active": False}
    attention = torch.nn.attention
    return {"available": True, "registered": IMPL_NAME in attention.list_flash_attention_impls(),
            "active": attention.current_flash_attention_impl() == IMPL_NAME}


def call_counts() -> dict:
    """Calls served so far, per aten op name: proof that an activation really reaches tileattn."""
    with _lock:
        return dict(_counts)


class _Installed:
    """The handle torch's registry keeps while tileattn is active; ``remove()`` restores torch.

    A token, not the owner of the kernels: at most one set of tileattn kernels is ever registered
    (module state, under a lock), and any ``remove()`` takes it away, so a restore always gives torch
    its kernels back even if activations were interleaved.
    """

    def remove(self) -> None:
        global _library
        with _lock:
            if _library is not None:
                # Explicitly, not by dropping the reference: the kernels must be gone when
                # restore_flash_attention_impl() returns, whatever else still references them.
                _library._destroy()
                _library = None


def _install() -> _Installed:
    """``register_fn`` for torch's registry: put tileattn's kernels in front of torch's (once)."""
    global _library
    with _lock:
        if _library is None:
            library = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                # Overriding torch's kernels is the point; torch warns about it once per process.
                warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
                library.impl(_CPU_FWD, _cpu_forward, "CPU")
                library.impl(_CPU_BWD, _cpu_backward, "CPU")
                library.impl(_CUDA_FWD, _cuda_forward, "CUDA")
                library.impl(_CUDA_BWD, _cuda_backward, "CUDA")
            _library = library
    return _Installed()


def _fail(op, arg, given, expected):
    raise SdpaHookError(f"tileattn SDPA hook: aten::{op}: argument '{arg}': got {given}; expected {expected}.")


def _check_qkv(op, query, key, value):
    """torch's own checks for these ops, plus GQA divisibility (torch's CPU kernel reads out of range)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            _fail(op, name, f"a {t.dim()}-d tensor", "a 4-d (batch, heads, seqlen, head_dim) tensor")
        if t.dtype not in _FLOAT_DTYPES:
            _fail(op, name, f"dtype {t.dtype}", "float16, bfloat16, float32 or float64")
        if t.dtype != query.dtype or t.device != query.device:
            _fail(op, name, f"{t.dtype} on {t.device}", f"query's {query.dtype} on {query.device}")
    if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
        _fail(op, "key/value", f"batch sizes {key.shape[0]}/{value.shape[0]}", f"query's {query.shape[0]}")
    if value.shape[1] != key.shape[1] or value.shape[2] != key.shape[2]:
        _fail(op, "value", f"shape {tuple(value.shape)}", f"key's heads and length, {tuple(key.shape)}")
    if key.shape[3] != query.shape[3] or value.shape[3] != query.shape[3]:
        _fail(op, "key/value", f"head dims {key.shape[3]}/{value.shape[3]}", f"query's {query.shape[3]}")
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        _fail(op, "key", f"{key.shape[1]} heads for {query.shape[1]} query heads",
              "a number of kv heads dividing the query heads")


def _check_mask(op, query, key, attn_mask):
    """torch's CPU kernel contract: a float mask, query's dtype (or fp32 for fp16/bf16), 2-d or 4-d."""
    if attn_mask is None:
        return
    allowed = (query.dtype, torch.float32) if query.dtype in (torch.float16, torch.bfloat16) else (query.dtype,)
    if attn_mask.dtype not in allowed:
        _fail(op, "attn_mask", f"dtype {attn_mask.dtype}",
              f"one of {allowed} (F.scaled_dot_product_attention converts bool masks before this op)")
    if attn_mask.device != query.device:
        _fail(op, "attn_mask", f"device {attn_mask.device}", f"query's {query.device}")
    full = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    try:
        torch.broadcast_shapes(tuple(attn_mask.shape), full)
        ok = attn_mask.dim() in (2, 4)
    except RuntimeError:
        ok = False
    if not ok:
        _fail(op, "attn_mask", f"shape {tuple(attn_mask.shape)}", f"a 2-d or 4-d shape broadcastable to {full}")


def _attention_kwargs(is_causal, attn_mask, scale, dropout_p=0.0, seed=None, top_left=True):
    """flash_attention's keywords for the op's arguments. ``top_left``: SDPA's causal (query ``i``
    sees keys ``j <= i``); otherwise FlashAttention-2's bottom-right causal (torch's CUDA op)."""
    return dict(causal=is_causal, align="top_left" if top_left else "bottom_right", bias=attn_mask, scale=scale,
                dropout_p=dropout_p, seed=seed)


def _attend(query, key, value, is_causal, attn_mask, scale, dropout_p=0.0, seed=None, top_left=True):
    """tileattn on (B, H, S, D) tensors: returns ``(out (B, Hq, Sq, D), lse (B, Hq, Sq))``."""
    return flash_attention(query, key, value, return_lse=True,
                           **_attention_kwargs(is_causal, attn_mask, scale, dropout_p, seed, top_left))


def _torch_lse(lse, query, layout_bshd, dtype):
    """tileattn's LSE in the layout and dtype torch's kernel returns, with torch's 0 for rows that see no key."""
    batch, heads, sq = query.shape[:3]
    if layout_bshd:
        result = torch.empty(batch, sq, heads, dtype=dtype, device=query.device).transpose(1, 2)
    else:
        result = torch.empty(batch, heads, sq, dtype=dtype, device=query.device)
    return result.copy_(lse.masked_fill(lse == -math.inf, 0.0))


def _like(t, reference):
    """``t`` with ``reference``'s strides (what the meta kernels promise), copying only if needed."""
    if t.stride() == reference.stride():
        return t
    return torch.empty_like(reference).copy_(t)


def _bshd_like(t):
    """``t`` stored as (B, S, H, D) in memory: the layout torch's CPU backward returns."""
    if t.dim() == 4 and t.transpose(1, 2).is_contiguous():
        return t
    return torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype, device=t.device).copy_(t)


def _gradients(grad_out, query, key, value, out, logsumexp, is_causal, attn_mask, scale, dropout_p=0.0, seed=None,
               top_left=True):
    """dq, dk, dv from the forward's output and logsumexp (tileattn's backward with given statistics).

    torch's logsumexp holds 0 where tileattn's holds -inf (rows that see no key); every score of such
    a row is hidden, so its probabilities are 0 with either value.
    """
    grads = attention_backward(grad_out, query, key, value, out, logsumexp,
                               **_attention_kwargs(is_causal, attn_mask, scale, dropout_p, seed, top_left))
    return grads.dq, grads.dk, grads.dv


def _count(op):
    with _lock:
        _counts[op] += 1


def _check_grad_out(op, grad_out, query):
    if tuple(grad_out.shape) != tuple(query.shape) or grad_out.dtype != query.dtype:
        _fail(op, "grad_out", f"{tuple(grad_out.shape)} {grad_out.dtype}", f"query's {tuple(query.shape)} {query.dtype}")


def _cpu_forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """``aten::_scaled_dot_product_flash_attention_for_cpu`` -> ``(output, logsumexp)``."""
    _check_qkv(_CPU_FWD, query, key, value)
    _check_mask(_CPU_FWD, query, key, attn_mask)
    if dropout_p != 0.0:
        _fail(_CPU_FWD, "dropout_p", repr(dropout_p),
              "0.0 (the op returns no RNG state for its backward; SDPA sends dropout to the math path)")
    _count(_CPU_FWD)
    out, lse = _attend(query, key, value, is_causal, attn_mask, scale)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    return _like(out, query), _torch_lse(lse, query, layout_bshd=True, dtype=lse_dtype)


def _cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                  scale=None):
    """``aten::_scaled_dot_product_flash_attention_for_cpu_backward`` -> ``(dq, dk, dv)``, (B, S, H, D) in memory."""
    _check_qkv(_CPU_BWD, query, key, value)
    _check_mask(_CPU_BWD, query, key, attn_mask)
    _check_grad_out(_CPU_BWD, grad_out, query)
    if dropout_p != 0.0:
        _fail(_CPU_BWD, "dropout_p", repr(dropout_p), "0.0 (no RNG state reaches this op)")
    _count(_CPU_BWD)
    grads = _gradients(grad_out, query, key, value, out, logsumexp, is_causal, attn_mask, scale)
    return tuple(_bshd_like(g) for g in grads)


def _cuda_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention`` (CUDA) -> torch's 9-tuple.

    Dropout is honoured with tileattn's counter-based RNG: its seed travels to the backward op in
    ``rng_state[0]`` (the slot torch keeps for its Philox seed), tagged in ``rng_state[1]``, so the
    backward regenerates the mask.
    """
    _check_qkv(_CUDA_FWD, query, key, value)
    if return_debug_mask:
        _fail(_CUDA_FWD, "return_debug_mask", "True", "False (tileattn never materialises the attention matrix)")
    if not 0.0 <= dropout_p < 1.0:
        _fail(_CUDA_FWD, "dropout_p", repr(dropout_p), "a float in [0, 1)")
    _count(_CUDA_FWD)
    # Drawn from torch's default generator, so torch.manual_seed reproduces the dropout.
    seed = int(torch.randint(0, 2**62, ())) if dropout_p > 0.0 else None
    out, lse = _attend(query, key, value, is_causal, None, scale, dropout_p, seed, top_left=False)
    rng_state = torch.tensor([seed or 0, _SEED_TAG], dtype=torch.uint64, device=query.device)
    unused = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return (_like(out, query), _torch_lse(lse, query, layout_bshd=False, dtype=torch.float32), None, None,
            query.shape[2], key.shape[2], rng_state, unused, debug_mask)


def _cuda_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                   dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    """``aten::_scaled_dot_product_flash_attention_backward`` (CUDA) -> ``(dq, dk, dv)`` like q, k, v."""
    _check_qkv(_CUDA_BWD, query, key, value)
    _check_grad_out(_CUDA_BWD, grad_out, query)
    if cum_seq_q is not None or cum_seq_k is not None:
        _fail(_CUDA_BWD, "cum_seq_q/cum_seq_k", "tensors", "None (dense SDPA; varlen stays on torch's kernel)")
    seed = None
    if dropout_p > 0.0:
        # A forward run by torch's kernel (tileattn activated in between) left a Philox state whose
        # dropout mask tileattn cannot regenerate.
        if philox_seed.numel() != 2 or philox_seed.dtype != torch.uint64 or int(philox_seed[1].item()) != _SEED_TAG:
            _fail(_CUDA_BWD, "philox_seed", "an RNG state tileattn's forward did not write",
                  "the rng_state of a forward run while tileattn was active (do not switch between forward and backward)")
        seed = int(philox_seed[0].item())
    _count(_CUDA_BWD)
    grads = _gradients(grad_out, query, key, value, out, logsumexp, is_causal, None, scale, dropout_p, seed,
                       top_left=False)
    return tuple(_like(g, t) for g, t in zip(grads, (query, key, value)))
