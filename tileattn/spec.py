"""Input spec: one validated description of an attention call.

Every public API (``flash_attention``, the FlashAttention-2, SDPA and torch_npu dialects) ends in
:func:`make_inputs`, which checks the arguments *before any compute* and returns an
:class:`AttentionInputs`. Backends only ever see that object: they never parse user arguments.

Conventions used everywhere below the public API:

* ``B`` batch, ``Hq``/``Hkv`` query/key-value heads, ``Sq``/``Sk`` lengths, ``D`` head dim of q/k,
  ``Dv`` head dim of v.
* The *canonical view* of a padded tensor is ``(B, H, S, D)``; it is a strided view of the user's
  tensor (never a copy), whatever the layout.
* Varlen (``layout="TND"``) tensors are ``(T, H, D)``; sequence ``b`` occupies rows
  ``cu_seqlens[b]:cu_seqlens[b+1]``.
* Row ``i`` (query) sees column ``j`` (key) iff
  ``i + (Sk - Sq) - left <= j <= i + (Sk - Sq) + right`` (bottom-right alignment, FlashAttention-2),
  where ``(left, right)`` is the window, ``None`` meaning unbounded, and ``causal`` forces
  ``right = 0``. A bool ``mask`` (True = take part) is and-ed on top.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Optional

import torch

PADDED_LAYOUTS = ("BNSD", "BSND", "BSH", "SBH")
LAYOUTS = PADDED_LAYOUTS + ("TND",)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_RANK = {"BNSD": 4, "BSND": 4, "BSH": 3, "SBH": 3, "TND": 3}
_SHAPE_NAME = {
    "BNSD": "(batch, heads, seqlen, head_dim)",
    "BSND": "(batch, seqlen, heads, head_dim)",
    "BSH": "(batch, seqlen, heads * head_dim)",
    "SBH": "(seqlen, batch, heads * head_dim)",
    "TND": "(total_tokens, heads, head_dim)",
}


def _fail(exc, arg: str, given, expected: str):
    raise exc(f"tileattn: argument '{arg}': got {given}; expected {expected}.")


def _describe(t: torch.Tensor) -> str:
    return f"tensor of shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def to_canonical(x: torch.Tensor, layout: str, num_heads: Optional[int]) -> torch.Tensor:
    """Strided (B, H, S, D) view of a padded-layout tensor, or (T, H, D) for TND. Never copies."""
    if layout == "BNSD" or layout == "TND":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    b_or_s0, b_or_s1, width = x.shape
    d = width // num_heads
    x4 = x.unflatten(2, (num_heads, d))
    if layout == "BSH":
        return x4.transpose(1, 2)
    return x4.permute(1, 2, 0, 3)  # SBH: (S, B, N, D) -> (B, N, S, D)


def empty_in_layout(layout: str, b: int, h: int, s: int, d: int, like: torch.Tensor):
    """Allocate a contiguous tensor in ``layout`` and return ``(user_tensor, canonical_view)``."""
    kw = dict(dtype=like.dtype, device=like.device)
    if layout == "BNSD":
        t = torch.empty(b, h, s, d, **kw)
    elif layout == "BSND":
        t = torch.empty(b, s, h, d, **kw)
    elif layout == "BSH":
        t = torch.empty(b, s, h * d, **kw)
    elif layout == "SBH":
        t = torch.empty(s, b, h * d, **kw)
    else:
        t = torch.empty(s, h, d, **kw)
    return t, to_canonical(t, layout, h)


def user_shape(layout: str, b: int, h: int, s: int, d: int) -> tuple:
    return {
        "BNSD": (b, h, s, d),
        "BSND": (b, s, h, d),
        "BSH": (b, s, h * d),
        "SBH": (s, b, h * d),
        "TND": (s, h, d),
    }[layout]


@dataclass
class AttentionInputs:
    """A validated attention call. Tensors are the user's; ``*_c`` are canonical strided views."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: str
    scale: float
    causal: bool = False
    window: tuple = (None, None)
    mask: Optional[torch.Tensor] = None
    bias: Optional[torch.Tensor] = None
    alibi_slopes: Optional[torch.Tensor] = None
    softcap: float = 0.0
    dropout_p: float = 0.0
    seed: int = 0
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    deterministic: bool = False
    # derived
    batch: int = 0
    heads_q: int = 0
    heads_kv: int = 0
    seqlen_q: int = 0
    seqlen_k: int = 0
    head_dim: int = 0
    head_dim_v: int = 0
    q_c: torch.Tensor = field(default=None, repr=False)
    k_c: torch.Tensor = field(default=None, repr=False)
    v_c: torch.Tensor = field(default=None, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def is_varlen(self) -> bool:
        return self.layout == "TND"

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def num_heads(self) -> int:
        return self.heads_q

    @property
    def window_bounds(self) -> tuple:
        """(left, right) with ``None`` for unbounded; causal clamps right to 0."""
        left, right = self.window
        if self.causal:
            right = 0 if right is None else min(right, 0)
        return left, right

    @property
    def has_band(self) -> bool:
        left, right = self.window_bounds
        return left is not None or right is not None

    def seq_lengths(self) -> list:
        """[(q_start, q_len, k_start, k_len)] per sequence (one entry of full length when padded)."""
        if not self.is_varlen:
            return [(0, self.seqlen_q, 0, self.seqlen_k)] * self.batch
        cq = self.cu_seqlens_q.tolist()
        ck = self.cu_seqlens_k.tolist()
        return [(cq[b], cq[b + 1] - cq[b], ck[b], ck[b + 1] - ck[b]) for b in range(len(cq) - 1)]

    def lse_shape(self) -> tuple:
        if self.is_varlen:
            return (self.heads_q, self.q.shape[0])
        return (self.batch, self.heads_q, self.seqlen_q)

    def out_shape(self) -> tuple:
        s = self.q.shape[0] if self.is_varlen else self.seqlen_q
        return user_shape(self.layout, self.batch, self.heads_q, s, self.head_dim_v)

    def acc_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def flops(self) -> float:
        """Forward FLOPs of the dense problem, counting only visible (row, key) pairs for causal."""
        total = 0.0
        for _, lq, _, lk in self.seq_lengths():
            pairs = visible_pairs(lq, lk, *self.window_bounds)
            total += 2.0 * pairs * self.heads_q * (self.head_dim + self.head_dim_v)
        return total


def visible_pairs(sq: int, sk: int, left, right) -> int:
    """Number of (i, j) pairs inside the band of an Sq x Sk problem (masks ignored)."""
    off = sk - sq
    total = 0
    lo_inf = left is None
    hi_inf = right is None
    for i in range(sq):
        lo = 0 if lo_inf else max(0, i + off - left)
        hi = sk - 1 if hi_inf else min(sk - 1, i + off + right)
        total += max(0, hi - lo + 1)
    return total


def _check_tensor(name: str, t, rank: int, layout: str):
    if not isinstance(t, torch.Tensor):
        _fail(TypeError, name, type(t).__name__, f"a torch.Tensor of shape {_SHAPE_NAME[layout]}")
    if t.dtype not in FLOAT_DTYPES:
        _fail(TypeError, name, f"dtype {t.dtype}", "one of float16, bfloat16, float32, float64")
    if t.dim() != rank:
        _fail(
            ValueError,
            name,
            f"{t.dim()}-d tensor of shape {tuple(t.shape)}",
            f"a {rank}-d tensor {_SHAPE_NAME[layout]} for layout='{layout}'",
        )


def _check_int(name, value, minimum=None):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(TypeError, name, repr(value), "an int")
    if minimum is not None and value < minimum:
        _fail(ValueError, name, value, f"an int >= {minimum}")
    return int(value)


def _broadcastable(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(shape), reversed(target)):
        if s != 1 and s != t:
            return False
    return True


def _check_cu_seqlens(name, cu, total, batch=None):
    if not isinstance(cu, torch.Tensor):
        _fail(TypeError, name, type(cu).__name__, "an int32 tensor of cumulative lengths, shape (B+1,)")
    if cu.dtype != torch.int32:
        _fail(TypeError, name, f"dtype {cu.dtype}", "torch.int32 (cumulative sequence offsets)")
    if cu.dim() != 1 or cu.numel() < 2:
        _fail(ValueError, name, f"shape {tuple(cu.shape)}", "a 1-d tensor of length B+1 >= 2")
    if batch is not None and cu.numel() != batch + 1:
        _fail(ValueError, name, f"length {cu.numel()}", f"length {batch + 1} (same batch as the other cu_seqlens)")
    if torch.compiler.is_compiling():
        # While torch.compile traces, the offsets are data a graph cannot branch on. The custom op
        # validates them again, with real values, before it computes anything.
        return None
    values = cu.tolist()
    if values[0] != 0:
        _fail(ValueError, name, f"first entry {values[0]}", "cumulative offsets starting at 0")
    if any(b < a for a, b in zip(values, values[1:])):
        _fail(ValueError, name, values, "non-decreasing cumulative offsets")
    if values[-1] != total:
        _fail(ValueError, name, f"last entry {values[-1]}", f"the token count {total} of the packed tensor")
    return max(b - a for a, b in zip(values, values[1:]))


def make_inputs(
    q,
    k,
    v,
    *,
    layout="BNSD",
    num_heads=None,
    scale=None,
    causal=False,
    window=None,
    mask=None,
    bias=None,
    alibi_slopes=None,
    softcap=0.0,
    dropout_p=0.0,
    seed=None,
    generator=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    deterministic=False,
) -> AttentionInputs:
    """Validate a call and build its :class:`AttentionInputs`. Raises before any compute."""
    if not isinstance(layout, str) or layout.upper() not in LAYOUTS:
        exc = ValueError if isinstance(layout, str) else TypeError
        _fail(exc, "layout", repr(layout), "one of " + ", ".join(repr(x) for x in LAYOUTS))
    layout = layout.upper()
    rank = _RANK[layout]
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, rank, layout)
    if not (q.dtype == k.dtype == v.dtype):
        _fail(TypeError, "k/v", f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}", "one shared dtype")
    if not (q.device == k.device == v.device):
        _fail(ValueError, "k/v", f"devices q={q.device}, k={k.device}, v={v.device}", "one shared device")

    if layout in ("BSH", "SBH"):
        if num_heads is None:
            _fail(ValueError, "num_heads", None, f"the number of query heads (required for layout='{layout}')")
        num_heads = _check_int("num_heads", num_heads, 1)
        if q.shape[2] % num_heads:
            _fail(ValueError, "num_heads", num_heads, f"a divisor of q's width {q.shape[2]}")
        d = q.shape[2] // num_heads
        if k.shape[2] % d or k.shape[2] == 0:
            _fail(ValueError, "k", f"width {k.shape[2]}", f"a positive multiple of the head dim {d} (q width / num_heads)")
        hkv = k.shape[2] // d
        if v.shape[2] % hkv:
            _fail(ValueError, "v", f"width {v.shape[2]}", f"a multiple of the {hkv} kv heads")
        q_c = to_canonical(q, layout, num_heads)
        k_c = to_canonical(k, layout, hkv)
        v_c = to_canonical(v, layout, hkv)
    else:
        if num_heads is not None:
            num_heads = _check_int("num_heads", num_heads, 1)
        q_c, k_c, v_c = (to_canonical(t, layout, None) for t in (q, k, v))

    head_axis = 1
    if layout == "TND":
        hq, hkv = q_c.shape[1], k_c.shape[1]
        batch = None
    else:
        hq, hkv = q_c.shape[1], k_c.shape[1]
        batch = q_c.shape[0]
        if k_c.shape[0] != batch or v_c.shape[0] != batch:
            _fail(ValueError, "k/v", f"batch sizes q={batch}, k={k_c.shape[0]}, v={v_c.shape[0]}", "equal batch sizes")
    if num_heads is not None and hq != num_heads:
        _fail(ValueError, "num_heads", num_heads, f"{hq}, the number of heads in q")
    if v_c.shape[head_axis] != hkv:
        _fail(ValueError, "v", f"{v_c.shape[head_axis]} heads", f"{hkv} heads, as in k")
    if hq == 0:
        _fail(ValueError, "q", "0 heads", "at least one query head")
    if hkv == 0 or hq % hkv:
        _fail(ValueError, "k", f"{hkv} kv heads for {hq} query heads", "a number of kv heads dividing the query heads (GQA/MQA)")
    d, dv = q_c.shape[-1], v_c.shape[-1]
    if k_c.shape[-1] != d:
        _fail(ValueError, "k", f"head dim {k_c.shape[-1]}", f"the head dim of q, {d}")
    if d == 0 or dv == 0:
        _fail(ValueError, "q/v", f"head dims {d}/{dv}", "positive head dims")
    if k_c.shape[-2] != v_c.shape[-2]:
        _fail(ValueError, "v", f"sequence length {v_c.shape[-2]}", f"the sequence length of k, {k_c.shape[-2]}")
    if layout == "TND" and k_c.shape[0] != v_c.shape[0]:
        _fail(ValueError, "v", f"{v_c.shape[0]} tokens", f"{k_c.shape[0]} tokens, as in k")

    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        _fail(TypeError, "scale", repr(scale), "a finite float (default 1/sqrt(head_dim))")
    if not math.isfinite(scale):
        _fail(ValueError, "scale", repr(scale), "a finite float (default 1/sqrt(head_dim))")
    if not isinstance(causal, bool):
        _fail(TypeError, "causal", repr(causal), "True or False")
    if not isinstance(deterministic, bool):
        _fail(TypeError, "deterministic", repr(deterministic), "True or False")

    # Variable length.
    if layout == "TND":
        if cu_seqlens_q is None or cu_seqlens_k is None:
            _fail(ValueError, "cu_seqlens_q/cu_seqlens_k", "None", "int32 cumulative offsets, required for layout='TND'")
        mq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q_c.shape[0])
        mk = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k_c.shape[0], cu_seqlens_q.numel() - 1)
        batch = cu_seqlens_q.numel() - 1
        for name, given, actual in (("max_seqlen_q", max_seqlen_q, mq), ("max_seqlen_k", max_seqlen_k, mk)):
            if given is not None:
                given = _check_int(name, given, 0)
                if actual is not None and given < actual:
                    _fail(ValueError, name, given, f">= {actual}, the longest sequence in the cu_seqlens")
        sq = mq if mq is not None else (max_seqlen_q or 0)
        sk = mk if mk is not None else (max_seqlen_k or 0)
    else:
        for name, val in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                          ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if val is not None:
                _fail(ValueError, name, repr(val) if isinstance(val, int) else "a tensor",
                      f"None for the padded layout '{layout}' (varlen arguments need layout='TND')")
        sq, sk = q_c.shape[2], k_c.shape[2]

    # Window.
    if window is None:
        window = (None, None)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        _fail(TypeError, "window", repr(window), "a pair (left, right) of ints; None or negative = unbounded")
    win = []
    for side in window:
        if side is None:
            win.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            _fail(TypeError, "window", repr(tuple(window)), "a pair (left, right) of ints; None or negative = unbounded")
        win.append(None if side < 0 else int(side))
    window = tuple(win)

    for name, value in (("softcap", softcap), ("dropout_p", dropout_p)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            _fail(TypeError, name, repr(value), "a float")
    if not math.isfinite(softcap) or softcap < 0:
        _fail(ValueError, "softcap", repr(softcap), "a float > 0 (or 0 to disable)")
    if not (0.0 <= dropout_p < 1.0):
        _fail(ValueError, "dropout_p", repr(dropout_p), "a float in [0, 1)")
    if seed is not None and generator is not None:
        _fail(ValueError, "seed/generator", "both", "at most one of them")
    if seed is not None:
        seed = _check_int("seed", seed)
    elif generator is not None:
        if not isinstance(generator, torch.Generator):
            _fail(TypeError, "generator", type(generator).__name__, "a torch.Generator")
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device).item())
    elif dropout_p > 0:
        seed = int(torch.randint(0, 2**62, (1,)).item())
    else:
        seed = 0
    # 63 bits: the seed travels through torch.library ops as a signed int64.
    seed &= (1 << 63) - 1

    full = (batch, hq, sq, sk)
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            given = f"dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            _fail(TypeError, "mask", given, "a bool tensor (True = take part) broadcastable to (B, Hq, Sq, Sk)")
        if layout == "TND":
            _fail(ValueError, "mask", "a mask with layout='TND'", "no mask for varlen inputs (sequences are already separated)")
        if not _broadcastable(mask.shape, full):
            _fail(ValueError, "mask", f"shape {tuple(mask.shape)}", f"a shape broadcastable to (B, Hq, Sq, Sk) = {full}")
        if mask.device != q.device:
            _fail(ValueError, "mask", f"device {mask.device}", f"device {q.device}, as q")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            given = f"dtype {bias.dtype}" if isinstance(bias, torch.Tensor) else type(bias).__name__
            _fail(TypeError, "bias", given, "a floating tensor broadcastable to (B, Hq, Sq, Sk)")
        if layout == "TND":
            _fail(ValueError, "bias", "a bias with layout='TND'", "no bias for varlen inputs")
        if not _broadcastable(bias.shape, full):
            _fail(ValueError, "bias", f"shape {tuple(bias.shape)}", f"a shape broadcastable to (B, Hq, Sq, Sk) = {full}")
        if bias.device != q.device:
            _fail(ValueError, "bias", f"device {bias.device}", f"device {q.device}, as q")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
            given = f"dtype {alibi_slopes.dtype}" if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__
            _fail(TypeError, "alibi_slopes", given, f"a float32 tensor of shape ({hq},) or ({batch}, {hq})")
        if tuple(alibi_slopes.shape) not in ((hq,), (batch, hq)):
            _fail(ValueError, "alibi_slopes", f"shape {tuple(alibi_slopes.shape)}", f"({hq},) or ({batch}, {hq})")
        if alibi_slopes.device != q.device:
            _fail(ValueError, "alibi_slopes", f"device {alibi_slopes.device}", f"device {q.device}, as q")

    return AttentionInputs(
        q=q, k=k, v=v, layout=layout, scale=float(scale), causal=causal, window=window,
        mask=mask, bias=bias, alibi_slopes=alibi_slopes, softcap=float(softcap),
        dropout_p=float(dropout_p), seed=seed, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=sq, max_seqlen_k=sk, deterministic=deterministic,
        batch=batch, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, head_dim=d, head_dim_v=dv,
        q_c=q_c, k_c=k_c, v_c=v_c,
    )
