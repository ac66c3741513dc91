"""Quantisation error of quantised KV caches: attention over a cache stored as int8 / fp8 / int4 (by
:func:`tileattn.serving.quantise`) against the fp64 attention over the *unquantised* cache.

    python benchmarks/quant_error.py            # markdown table on stdout (docs/serving.md)

Two errors per row, both against fp64 over the original fp32 keys and values:

* ``quantisation``: what storing the cache in that format costs (fp64 attention over the
  dequantised cache): the format's own error, independent of any kernel;
* ``tileattn``: the native kernels reading the stored cache (fp32 q), which adds only fp32 rounding
  (it is within the 2x rule of fp32 math over the dequantised cache, which the tests check).

Keys and values: standard normal, and "outlier channels" (keys with 4 channels per head scaled by
20, as the key caches of many LLMs have). Decode shape: B 4, Hq 8 / Hkv 2, D 128, 4096 keys, one
query per sequence. Errors: max |error| over outputs, and mean |error| / mean |output|.
"""

from __future__ import annotations

import torch

import tileattn
from tileattn.core.kvquant import dequantise
from tileattn.serving import quantise

#: (name, format, reduce, symmetric, group size)
FORMATS = [("bf16 cache (for scale)", None, None, True, None), ("int8 per channel", torch.int8, (0,), True, None),
           ("int8 per token", torch.int8, (-1,), True, None),
           ("int8 per token, offset", torch.int8, (-1,), False, None),
           ("fp8 e4m3 per token", torch.float8_e4m3fn, (-1,), True, None),
           ("fp8 e4m3 per tensor", torch.float8_e4m3fn, (0, 1, 2), True, None),
           ("fp8 e5m2 per token", torch.float8_e5m2, (-1,), True, None),
           ("int4 per token", "int4", (-1,), True, None),
           ("int4 per 32-channel group (Q4_0)", "int4", (-1,), True, 32),
           ("int4 per 32-channel group, offset", "int4", (-1,), False, 32)]


def data(outliers, g):
    b, sk, hq, hkv, d = 4, 4096, 8, 2, 128
    q = torch.randn(b, 1, hq, d, generator=g)
    k, v = torch.randn(b, sk, hkv, d, generator=g), torch.randn(b, sk, hkv, d, generator=g)
    if outliers:
        k[..., :4] *= 20
    return q, k, v


def stored(x, fmt, reduce, symmetric, group):
    """(stored cache, scale, offset) with scales over ``reduce`` (and groups of ``group`` channels) of each
    sequence's (S, Hkv, D) cache."""
    if fmt is None:
        return x.bfloat16(), None, None
    per_seq = [quantise(x[i], fmt, reduce=reduce, symmetric=symmetric, group_size=group) for i in range(x.shape[0])]
    st = torch.stack([p[0] for p in per_seq])
    sc = torch.stack([p[1] for p in per_seq])
    off = None if symmetric else torch.stack([p[2] for p in per_seq])
    return st, sc, off


def deq(st, sc, off):
    return dequantise(st, sc, off, torch.float64)


def errors(x, exact):
    e = (x.double() - exact).abs()
    return float(e.max()), float(e.mean() / exact.abs().mean())


def main():
    g = torch.Generator().manual_seed(0)
    print("| cache | bytes / token / head (D 128) | keys | quantisation max / mean rel | tileattn max / mean rel |")
    print("|---|---|---|---|---|")
    for outliers in (False, True):
        q, k, v = data(outliers, g)
        exact = tileattn.reference(q.double(), k.double(), v.double(), layout="BSND")
        for name, fmt, reduce, symmetric, group in FORMATS:
            ks, kscale, koff = stored(k, fmt, reduce, symmetric, group)
            vs, vscale, voff = stored(v, fmt, reduce, symmetric, group)
            quant = tileattn.reference(q.double(), deq(ks, kscale, koff), deq(vs, vscale, voff), layout="BSND")
            with torch.no_grad():
                if fmt is None:
                    out = tileattn.flash_attention(q.bfloat16(), ks, vs, layout="BSND")
                else:
                    out = tileattn.flash_attention(q, ks, vs, layout="BSND", k_scale=kscale, k_offset=koff,
                                                   v_scale=vscale, v_offset=voff)
            values = 256 if fmt is None else 64 if fmt == "int4" else 128
            per_token = values + (4 if reduce == (-1,) else 0) * (128 // (group or 128)) * (1 if symmetric else 2)
            qe, te = errors(quant, exact), errors(out, exact)
            print(f"| {name} | {per_token} | {'outlier channels' if outliers else 'normal'} | "
                  f"{qe[0]:.2e} / {qe[1]:.2e} | {te[0]:.2e} / {te[1]:.2e} |")


if __name__ == "__main__":
    main()
