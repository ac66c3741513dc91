"""PyTorch's FlexAttention as a dialect: ``flex_attention``, ``create_block_mask`` and ``patch_flex``
on CPU tensors, exact, forward and backward.

A call is one :func:`tileattn.flash_attention` call (:mod:`.attention`): ``score_mod`` and the block
mask are user-function modifiers (:mod:`tileattn.core.functions`), compiled into the native kernels'
tiles by :mod:`tileattn.programs`. Modules: :mod:`.attention` (:func:`flex_attention`,
:func:`explain`), :mod:`.semantics` (PyTorch's argument checks and the exact reference,
:func:`~.semantics.flex_reference`), :mod:`.patch` (:func:`patch_flex`: PyTorch's flex_attention on
CPU tensors routed here), :mod:`.examples` (attention-gym's patterns).

The semantics matched (``torch.nn.attention.flex_attention.flex_attention`` in torch 2.13; where its
documentation is silent or wrong, what its implementations do, as noted):

* **Signature**: ``flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
  enable_gqa=False, return_lse=False, kernel_options=None, *, return_aux=None)``; q (B, Hq, L, E),
  k (B or 1, Hkv, S, E), v (B or 1, Hkv, S, Ev) -> out (B, Hq, L, Ev) in the inputs' dtype.
* **Scores**: ``s = (q @ k^T) * scale`` with ``scale = 1/sqrt(E)`` by default, computed in float32
  (float64 for float64 inputs) whatever the input dtype; ``score_mod`` receives these (the
  documentation says "the same data type as the query": for fp16/bf16 it is float32 in both the eager
  and the compiled implementations).
* **Order**: ``score_mod`` -> mask -> softmax: ``p = softmax(where(visible, score_mod(s, b, h, q_idx,
  kv_idx), -inf))``, then ``out = p @ v`` (eager PyTorch rounds p to the input dtype first).
  ``score_mod``'s value at hidden positions never matters (PyTorch evaluates it there and discards
  it; tileattn's kernels skip hidden blocks and need not evaluate it there). A ``score_mod`` may hide
  scores itself by returning -inf.
* **Indices**: ``b``, ``h`` (the *query* head, 0..Hq-1 under GQA), ``q_idx``, ``kv_idx`` are 0-d
  int32 tensors (torch.int, as documented; PyTorch's CPU implementations pass int64, which only
  matters for arithmetic that overflows int32). Integer arithmetic wraps as PyTorch's does; ``t[i]``
  on a captured tensor with a 0-d index tensor is ``aten.index`` (negative indices wrap, out of range
  raises IndexError).
* **Visibility** (the block mask): blocks of BLOCK_SIZE = (Q_BLOCK, KV_BLOCK) listed in
  ``full_kv_indices`` are visible without ``mask_mod``; blocks in ``kv_indices`` are visible where
  ``mask_mod(b, h, q_idx, kv_idx)`` is true, with the call's own b and h; unlisted blocks are hidden.
  That is compiled FlexAttention's rule and the documented meaning of a block mask; PyTorch's eager
  path ignores the lists and applies ``mask_mod`` everywhere, which agrees whenever the lists come
  from ``create_block_mask`` on the same ``mask_mod``. A mask's B and H are 1 (broadcast) or the
  call's (PyTorch's kernels map other sizes by division on CPU and by modulo on GPU; refused here).
* **Lengths**: ``block_mask.seq_lengths`` must equal (L, S) exactly, else PyTorch's error as the
  installed torch raises it (ValueError up to torch 2.14, RuntimeError from 2.15; a longer mask's
  message points at ``BlockMask._adjust``); blocks past the lengths are partial and their
  out-of-range elements never count. ``BlockMask.from_kv_blocks`` without ``seq_lengths`` rounds the
  lengths up to whole blocks (rows x Q_BLOCK, ``kv_indices.shape[-1]`` x KV_BLOCK). A sliced
  BlockMask (``bm[:, :, i]``) carries a ``mask_mod`` that raises; as in PyTorch it is refused until
  ``mask_mod`` is set again.
* **Empty rows** (nothing visible): output 0, LSE -inf, max score -inf; gradients through them are 0.
* **LSE**: natural log, float32 (float64 for float64 inputs), shape (B, Hq, L): ``return_lse=True``
  returns ``(out, lse)`` (deprecated in PyTorch, which warns once); ``return_aux=AuxRequest(lse=True,
  max_scores=...)`` returns ``(out, AuxOutput(lse, max_scores))`` with unrequested fields None; both at
  once is a ValueError. PyTorch refuses ``max_scores`` on CPU; the reference computes it.
* **GQA**: ``enable_gqa=True`` with Hq a multiple of Hkv (query head h reads kv head h // (Hq/Hkv));
  Hq != Hkv without it is a ValueError. A batch of 1 in k/v serves a larger query batch only with a
  block mask of the query's batch (PyTorch's rule).
* **Dtypes**: float16, bfloat16, float32, float64; q, k, v of one dtype and device.
* **kernel_options**: accepted and checked as PyTorch checks them (BACKEND in AUTO/TRITON/FLASH/
  TRITON_DECODE, not with FORCE_USE_FLEX_ATTENTION; the internal OUTPUT_LOGSUMEXP/OUTPUT_MAX refused);
  no key changes the result (they are tuning knobs of PyTorch's kernels), so none is honoured.
* **Gradients**: of q, k, v and of every floating-point tensor ``score_mod`` captures (a bias table,
  per-head scales), by the chain rule through ``score_mod``, accumulated in fp32 (fp64 for fp64
  inputs); PyTorch's CPU FlexAttention has none.
  Where PyTorch's autograd has no derivative (``//`` on floats) the compiled derivative is 0, as for
  ``torch.div(..., rounding_mode="floor")``.
"""

from . import examples
from .attention import create_block_mask, explain, flex_attention
from .patch import install, patch_flex, uninstall


__all__ = ["flex_attention", "explain", "create_block_mask", "examples", "patch_flex", "install", "uninstall"]
