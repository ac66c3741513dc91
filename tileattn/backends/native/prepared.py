"""A prepared native forward call: the kernels' argument struct (``csrc/ta.h``) packed once per
call shape, so that a repeated decode step writes only what changes between steps.

:func:`prepare` takes a validated call that every sequence of which the split-KV decode kernel
takes (at most ``DECODE_MAX_ROWS`` query rows per kv head: that kernel reads no tuned tile size,
so nothing in the struct depends on the tune cache), whose modifiers bind no per-call value
(causal, window, softcap: no mask, bias, ALiBi or dropout seed) and which is short enough to run
without the Ctrl-C hook. Everything else of the struct is constant for the shape: dims, q's,
the output's and the LSE's strides, the band, scale and options. Per call :meth:`PreparedForward.run`
writes the data pointers, the key length (or the pages of a paged pool), K/V's strides and the
thread count into this thread's copy and calls the kernel.

A prepared call holds no tensor: its template is bytes, and each thread gets its own argument
buffer and an LSE scratch buffer (the LSE of a call that does not return it) as plain memory.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Optional

import torch

from ...core.layouts import empty_in_layout
from . import kernels

#: A sequence with at most this many query rows per kv head (q_len * Hq / Hkv) takes the split-KV
#: decode kernel (``TA_DECODE_MAX_ROWS`` in csrc/kernels.h).
DECODE_MAX_ROWS = 8


class PreparedForward:
    """The constant part of one call shape's argument struct, and the slots a call writes."""

    __slots__ = ("_lib", "_template", "_lse_bytes", "_local", "_sk", "_k_st", "_v_st", "_pages", "_threads",
                 "_used", "_table", "paged", "max_keys", "order")

    def __init__(self, lib, template: bytes, lse_bytes: int, paged: bool, max_keys: int):
        self._lib = lib
        self._template = template
        self._lse_bytes = lse_bytes
        self._local = threading.local()
        slot = {name: offset // 8 for name, offset in lib.field_offset.items()}
        if [slot[name] for name in ("q", "k", "v", "out", "lse")] != [0, 1, 2, 3, 4]:
            raise kernels._build.BuildError("the library's argument struct does not start with q, k, v, out, lse")
        self._sk, self._k_st, self._v_st, self._pages = slot["Sk"], slot["k_st"], slot["v_st"], slot["num_pages"]
        self._threads, self._used, self._table = slot["num_threads"], slot["seqused_k"], slot["block_table"]
        self.paged = paged
        #: The most keys a call may have to be served here: the engine arms the Ctrl-C hook above.
        self.max_keys = max_keys
        #: Which of the strides :meth:`run` is given are (batch or page, head, key or slot).
        self.order = (0, 1, 2)

    def _buffers(self):
        """This thread's argument struct (an int64 view and its address) and LSE scratch address."""
        loc = self._local
        args = bytearray(self._template)
        view = memoryview(args).cast("q")
        view[self._lib.field_offset["err"] // 8] = self._lib.buffers().err_addr
        scratch = ctypes.create_string_buffer(max(self._lse_bytes, 8))
        loc.args, loc.view, loc.scratch = args, view, scratch
        loc.address = ctypes.addressof(ctypes.c_char.from_buffer(args))
        loc.scratch_address = ctypes.addressof(scratch)
        return loc

    def run(self, q_ptr: int, k_ptr: int, v_ptr: int, out_ptr: int, lse_ptr: Optional[int], keys: int, k_st, v_st,
            used_ptr: int, table_ptr: int) -> bool:
        """Call the kernel; ``keys`` is the key length (the pool's page count for a paged call),
        ``k_st``/``v_st`` strides of K and V of which ``order`` picks the (batch or page, head, key
        or slot) ones, ``lse_ptr`` None for the scratch buffer. True when computed; False when the
        kernel refused a value before computing (the caller's full path then names it); raises as
        :func:`kernels.forward` does."""
        loc = self._local
        try:
            view = loc.view
        except AttributeError:
            view = self._buffers().view
        view[0], view[1], view[2], view[3] = q_ptr, k_ptr, v_ptr, out_ptr
        view[4] = loc.scratch_address if lse_ptr is None else lse_ptr
        view[self._used], view[self._table] = used_ptr, table_ptr
        view[self._pages if self.paged else self._sk] = keys
        a, b, c = self.order
        i, j = self._k_st, self._v_st
        view[i], view[i + 1], view[i + 2] = k_st[a], k_st[b], k_st[c]
        view[j], view[j + 1], view[j + 2] = v_st[a], v_st[b], v_st[c]
        view[self._threads] = torch.get_num_threads()
        status = self._lib.forward_fn(loc.address)
        if status == kernels.OK:
            return True
        if status == kernels.EINVAL:
            return False  # a value refused before any compute (seqused_k beyond the keys)
        kernels._raise(self._lib.buffers(), status)


def prepare(spec, interruptible_work: int) -> Optional[PreparedForward]:
    """A :class:`PreparedForward` for ``spec`` (validated; native engine), or None when the call is
    not one a prepared call serves (see the module docstring)."""
    args = spec.kernel_args
    if spec.is_varlen or spec.cu_seqlens_k is not None or args.per_call or args.dropout_p:
        return None
    if any(m.applied_by_op for m in spec.modifiers) or spec.seqlen_q * spec.group_size > DECODE_MAX_ROWS:
        return None
    rows = spec.batch * spec.heads_q * spec.seqlen_q
    if rows == 0 or spec.head_dim_v == 0 or spec.q_c.stride(-1) != 1 and spec.head_dim > 1:
        return None
    try:
        lib = kernels._library()
    except kernels.Unavailable:
        return None
    if spec.dtype not in kernels._DTYPES or spec.seqused_k is not None and not spec.seqused_k.is_contiguous():
        return None  # the engine passes a contiguous copy of a strided seqused_k; a plan has no copy to pass
    paged = spec.is_paged
    if paged and rows * spec.seqlen_k >= interruptible_work:
        return None
    # The template is what kernels.forward would pack for this call, from an output and an LSE of the
    # call's own (the full path's) layout: every pointer, key length, K/V stride and the thread count
    # are written per call by run().
    out = empty_in_layout(spec.layout, spec.batch, spec.heads_q, spec.seqlen_q, spec.head_dim_v, spec.dtype,
                          spec.device)[1]
    lse = torch.empty(spec.lse_shape(), dtype=kernels.accumulation_dtype(spec.dtype))
    template = bytearray(lib.size)
    kernels.pack(lib, template, spec.q_c, spec.k if paged else spec.k_c, spec.v if paged else spec.v_c, out, lse,
                 args, kernels.Geometry(seqused_k=spec.seqused_k, block_table=spec.block_table),
                 kernels.Tiles(num_threads=1))
    return PreparedForward(lib, bytes(template), lse.nbytes, paged, (interruptible_work - 1) // rows)
