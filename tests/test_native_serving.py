"""Serving-grade decode in the native kernels, at the kernels.py level: K/V caches read as stored
(bf16, fp16), quantised caches (int8 and int4 with and without offsets, fp8 e4m3 / e5m2) with every
scale granularity, and ragged batches (decode rows and prefill chunks in one call over a paged pool).

The oracle is tileattn.reference in fp64 on the dequantised cache, ``(x.double() + offset) * scale``;
the baseline of FlashAttention's 2x rule is plain PyTorch math in q's dtype on that cache rounded to
q's dtype. Bitwise checks: thread counts, split-KV and the other sequences of a batch change no bit.
"""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn.core.kvquant import pack_int4, unpack_int4
from tileattn.core.testing import judge

nk = pytest.importorskip("tileattn.backends.native.kernels")
checked = pytest.importorskip("tileattn.backends.native.checked")
if not nk.available()[0]:
    pytest.skip(nk.available()[1], allow_module_level=True)

FORMATS = {"int8": torch.int8, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "int4": torch.uint8}
# scale shapes over the logical cache (B, Hkv, S, groups): the Ascend antiquant modes, FlashAttention-3's
# descales and per-token groups
GRANULARITIES = {
    "tensor": lambda b, h, s, d: (1, 1, 1, 1),
    "head": lambda b, h, s, d: (1, h, 1, 1),
    "batch_head": lambda b, h, s, d: (b, h, 1, 1),
    "channel": lambda b, h, s, d: (1, 1, 1, d),
    "head_channel": lambda b, h, s, d: (1, h, 1, d),
    "token": lambda b, h, s, d: (b, 1, s, 1),
    "head_token": lambda b, h, s, d: (b, h, s, 1),
    "token_group": lambda b, h, s, d: (b, h, s, d // 16),
}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def quantised(shape, fmt, g):
    """A stored cache of logical shape ``shape`` (int4: packed, half the last dim)."""
    if fmt is torch.int8:
        return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    if fmt is torch.uint8:
        return pack_int4(torch.randint(-8, 8, shape, generator=g))
    return (torch.randn(shape, generator=g) * 24).to(fmt)  # normals and subnormals of both fp8 formats


def width(x):
    return x.shape[-1] * 2 if x.dtype is torch.uint8 else x.shape[-1]


def scales(shape, g, offset):
    scale = torch.rand(shape, generator=g) * 0.04 + 0.01
    return scale, (torch.randint(-6, 7, shape, generator=g).float() if offset else None)


def dequantise(x, scale, offset):
    """(x + offset) * scale in fp64, the scale's channel groups spread over the head dim."""

    def spread(t):
        return t.double().repeat_interleave(width(x) // t.shape[-1], -1)

    y = (unpack_int4(x) if x.dtype is torch.uint8 else x).double()
    if offset is not None:
        y = y + spread(offset)
    return y if scale is None else y * spread(scale)


def pool_of(x, table, page_size):
    """The pool (pages, page_size, H, E) of a logical (B, H, S, E) tensor of any dtype, in the pages of
    `table` (exact: int8 and fp8 travel through fp32)."""
    b, h, s, e = x.shape
    per_seq = table.shape[1]
    pages = int(table.max()) + 4
    padded = torch.nn.functional.pad(x.float(), (0, 0, 0, per_seq * page_size - s)).transpose(1, 2)
    fill = 0.0 if x.dtype in (torch.int8, torch.uint8) else float("nan")  # unused slots: NaN where the format has one
    p = torch.full((pages, page_size, h, e), fill)
    p[table.long().flatten()] = padded.reshape(b * per_seq, page_size, h, e)
    return p.to(x.dtype)


def block_table(b, s, page_size, seed=0):
    per_seq = -(-s // page_size)
    return torch.randperm(b * per_seq + 3, generator=gen(seed))[:b * per_seq].reshape(b, per_seq).to(torch.int32)


def paged_scale(t, b, table, page_size):
    """A logical scale (B or 1, H or 1, S or 1, G) as the kernels take it with a paged cache: per-key
    scales in the pool's slots, per-sequence ones with a leading batch axis."""
    if t is None:
        return None
    if t.shape[2] > 1:
        return pool_of(t.expand(b, -1, -1, -1), table, page_size)
    squeezed = t[:, :, 0, :]  # (B or 1, H or 1, G)
    if t.shape[0] > 1:
        return squeezed.reshape(t.shape[0], 1, 1, t.shape[1], t.shape[3])
    return squeezed.reshape(1, 1, t.shape[1], t.shape[3])


def raw(q, k, v, out_dtype=None, **kw):
    out = torch.empty(q.shape[:3] + (width(v),), dtype=out_dtype or q.dtype)
    lse = torch.empty(q.shape[:3])
    kw.setdefault("scale", q.shape[-1] ** -0.5)
    checked.forward(q, k, v, out, lse, **kw)
    return out, lse


def oracle(q, kd, vd, used, q_scale=None, **kw):
    """(fp64 out, fp64 lse, baseline out in q's dtype) per sequence on its first used[b] keys."""
    g = q.shape[1] // kd.shape[1]
    qd = q.double()
    if q_scale is not None:
        qd = qd * q_scale.double().repeat_interleave(g, 1).expand(q.shape[0], -1)[:, :, None, None]
    outs, lses, bases = [], [], []
    for b, u in enumerate(used):
        kwb = {n: t[b:b + 1, ..., :u] if n in ("mask", "bias") and t.shape[0] > 1 else
               t[..., :u] if n in ("mask", "bias") else t for n, t in kw.items()}
        o, l = tileattn.reference(qd[b:b + 1], kd[b:b + 1, :, :u], vd[b:b + 1, :, :u], compute_dtype=torch.float64,
                                  return_lse=True, **kwb)
        base = tileattn.reference(qd[b:b + 1].to(q.dtype), kd[b:b + 1, :, :u].to(q.dtype),
                                  vd[b:b + 1, :, :u].to(q.dtype), **kwb)
        outs.append(o), lses.append(l), bases.append(base)
    return torch.cat(outs), torch.cat(lses), torch.cat(bases)


def assert_close(out, lse, q, kd, vd, used, **kw):
    ref, ref_lse, base = oracle(q, kd, vd, used, **kw)
    verdict = judge("out", out, ref, base, q.dtype)
    assert verdict.ok, str(verdict)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-4


# ----------------------------------------------------------------------------- bf16 / fp16 caches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["padded", "seqused", "paged"])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (8, 1, 128), (6, 2, 40)], ids=["gqa4", "mqa-d128", "d40"])
def test_low_precision_cache_is_read_as_stored(dtype, layout, hq, hkv, d):
    g = gen(1)
    b, s = 3, 1100  # three chunks of 512 keys for the longest
    q = torch.randn(b, hq, 1, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, s, d, generator=g).to(dtype) for _ in range(2))
    used = [s, 1, 701] if layout != "padded" else [s] * b
    kw = dict(seqused_k=torch.tensor(used, dtype=torch.int32)) if layout != "padded" else {}
    if layout == "paged":
        table = block_table(b, s, 16)
        out, lse = raw(q, pool_of(k, table, 16), pool_of(v, table, 16), block_table=table, **kw)
        contiguous = raw(q, k, v, **kw)
        assert torch.equal(out, contiguous[0]) and torch.equal(lse, contiguous[1])  # bit for bit
    else:
        out, lse = raw(q, k, v, **kw)
    assert_close(out, lse, q, k.double(), v.double(), used)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_decode_bits_do_not_depend_on_threads_or_the_batch(dtype):
    g = gen(2)
    q = torch.randn(3, 8, 1, 64, generator=g).to(dtype)
    k, v = (torch.randn(3, 2, 5000, 64, generator=g).to(dtype) for _ in range(2))
    used = torch.tensor([5000, 3, 2049], dtype=torch.int32)
    runs = [raw(q, k, v, seqused_k=used, num_threads=n) for n in (1, 2, 3)]
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    alone = raw(q[2:], k[2:], v[2:], seqused_k=used[2:])
    assert torch.equal(alone[0], runs[0][0][2:]) and torch.equal(alone[1], runs[0][1][2:])


# ------------------------------------------------------------------------------ quantised caches


def quantised_case(fmt, gran, b=2, hq=8, hkv=2, s=600, d=64, seed=3, offsets=None, qdtype=torch.float32):
    g = gen(seed)
    fmt = FORMATS[fmt]
    q = torch.randn(b, hq, 1, d, generator=g).to(qdtype)
    kq, vq = quantised((b, hkv, s, d), fmt, g), quantised((b, hkv, s, d), fmt, g)
    with_offset = fmt in (torch.int8, torch.uint8) if offsets is None else offsets
    shape = GRANULARITIES[gran](b, hkv, s, d)
    (ks, ko), (vs, vo) = scales(shape, g, with_offset), scales(shape, g, with_offset)
    return q, kq, vq, dict(k_scale=ks, k_offset=ko, v_scale=vs, v_offset=vo)


@pytest.mark.parametrize("layout", ["seqused", "paged"])
@pytest.mark.parametrize("gran", list(GRANULARITIES))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantised_cache_matches_the_dequantised_reference(fmt, gran, layout):
    """int8 with offsets (Ascend antiquant), fp8 symmetric; every granularity; fp32 q."""
    q, kq, vq, sc = quantised_case(fmt, gran)
    used = [600, 77]
    kd, vd = dequantise(kq, sc["k_scale"], sc["k_offset"]), dequantise(vq, sc["v_scale"], sc["v_offset"])
    kw = dict(seqused_k=torch.tensor(used, dtype=torch.int32))
    if layout == "paged":
        table = block_table(2, 600, 16)
        sc = {name: paged_scale(t, 2, table, 16) for name, t in sc.items()}
        kq, vq, kw["block_table"] = pool_of(kq, table, 16), pool_of(vq, table, 16), table
    out, lse = raw(q, kq, vq, **kw, **{n: t for n, t in sc.items() if t is not None})
    assert_close(out, lse, q, kd, vd, used)


@pytest.mark.parametrize("qdtype,out_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.float32),
                                              (torch.float16, None)], ids=["bf16", "bf16-out-fp32", "fp16"])
@pytest.mark.parametrize("fmt,gran", [("int8", "head_channel"), ("e4m3", "batch_head"), ("e5m2", "head_token"),
                                      ("int8", "token_group"), ("int4", "token_group")])
def test_quantised_cache_with_low_precision_queries(qdtype, out_dtype, fmt, gran):
    q, kq, vq, sc = quantised_case(fmt, gran, qdtype=qdtype, seed=4)
    kd, vd = dequantise(kq, sc["k_scale"], sc["k_offset"]), dequantise(vq, sc["v_scale"], sc["v_offset"])
    out, lse = raw(q, kq, vq, out_dtype=out_dtype, **{n: t for n, t in sc.items() if t is not None})
    assert out.dtype is (out_dtype or qdtype)
    assert_close(out, lse, q, kd, vd, [600, 600])


def test_mixed_granularities_and_q_descale():
    """K per channel with a per-token offset, V per token with a per-channel offset, FlashAttention-3's
    q_descale per (batch, kv head); a bf16 cache with descales only."""
    g = gen(5)
    q = torch.randn(2, 8, 1, 64, generator=g)
    kq, vq = quantised((2, 2, 300, 64), torch.int8, g), quantised((2, 2, 300, 64), torch.int8, g)
    ks, vo = torch.rand(1, 2, 1, 64, generator=g) * 0.03, torch.randn(1, 1, 1, 64, generator=g)
    ko, vs = torch.randn(2, 1, 300, 1, generator=g) * 3, torch.rand(2, 2, 300, 1, generator=g) * 0.03
    q_scale = torch.rand(2, 2, generator=g) + 0.5
    out, lse = raw(q, kq, vq, k_scale=ks, k_offset=ko, v_scale=vs, v_offset=vo, q_scale=q_scale)
    assert_close(out, lse, q, dequantise(kq, ks, ko), dequantise(vq, vs, vo), [300, 300], q_scale=q_scale)
    kb, vb = (torch.randn(2, 2, 300, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    qb = q.to(torch.bfloat16)
    k_descale, v_descale = torch.rand(2, 2, 1, 1, generator=g) + 0.5, torch.rand(2, 2, 1, 1, generator=g) + 0.5
    out, lse = raw(qb, kb, vb, k_scale=k_descale, v_scale=v_descale, q_scale=q_scale)
    assert_close(out, lse, qb, dequantise(kb, k_descale, None), dequantise(vb, v_descale, None), [300, 300],
                 q_scale=q_scale)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_group_scales_mixed_with_per_token_and_per_head_factors(fmt):
    """Scales per (key, channel group) are applied to K and V in registers, with the other factor of the
    pair per token or per head (and groups of 32 and 16 channels, whole vectors either way)."""
    g = gen(13)
    b, hq, hkv, s, d = 2, 8, 2, 700, 64
    q = torch.randn(b, hq, 1, d, generator=g)
    kq, vq = quantised((b, hkv, s, d), FORMATS[fmt], g), quantised((b, hkv, s, d), FORMATS[fmt], g)
    ks, _ = scales((b, hkv, s, d // 32), g, False)  # per token, 2 groups of 32 channels
    ko = torch.randint(-6, 7, (b, 1, s, 1), generator=g).float()  # per token
    vs, _ = scales((1, hkv, 1, 1), g, False)  # per head
    vo = torch.randint(-6, 7, (b, hkv, s, d // 16), generator=g).float()  # per token, 4 groups of 16
    out, lse = raw(q, kq, vq, k_scale=ks, k_offset=ko, v_scale=vs, v_offset=vo)
    assert_close(out, lse, q, dequantise(kq, ks, ko), dequantise(vq, vs, vo), [s, s])


@pytest.mark.parametrize("fmt", ["e4m3", "int4"])
@pytest.mark.parametrize("d", [36, 72], ids=["d36", "d72"])
@pytest.mark.parametrize("gran", ["head_channel", "token"])
def test_quantised_cache_with_head_dims_off_the_vector_width(d, gran, fmt):
    q, kq, vq, sc = quantised_case(fmt, gran, d=d, s=130, offsets=True, seed=6)
    out, lse = raw(q, kq, vq, **sc)
    assert_close(out, lse, q, dequantise(kq, sc["k_scale"], sc["k_offset"]),
                 dequantise(vq, sc["v_scale"], sc["v_offset"]), [130, 130])


@pytest.mark.parametrize("modifier", ["causal-spec", "window", "mask", "bias", "alibi", "softcap"])
def test_quantised_cache_with_modifiers(modifier):
    g = gen(7)
    b, hq, hkv, sq, s, d = 2, 8, 2, 1, 333, 64
    if modifier == "causal-spec":
        sq = 2  # two query tokens (speculative decode), causal at the end
    q = torch.randn(b, hq, sq, d, generator=g)
    kq, vq = quantised((b, hkv, s, d), torch.int8, g), quantised((b, hkv, s, d), torch.int8, g)
    (ks, ko), (vs, vo) = scales((1, hkv, 1, d), g, True), scales((b, 1, s, 1), g, True)
    kd, vd = dequantise(kq, ks, ko), dequantise(vq, vs, vo)
    kern, ref = {}, {}
    if modifier == "causal-spec":
        kern, ref = dict(right=0), dict(causal=True)
    elif modifier == "window":
        kern, ref = dict(left=40, right=0), dict(window=(40, 0))
    elif modifier == "mask":
        mask = torch.rand(b, 1, sq, s, generator=g) > 0.3
        kern, ref = dict(mask=mask.expand(b, hq, sq, s)), dict(mask=mask)
    elif modifier == "bias":
        bias = torch.randn(1, hq, sq, s, generator=g)
        kern, ref = dict(bias=bias.expand(b, hq, sq, s)), dict(bias=bias)
    elif modifier == "alibi":
        slopes = torch.rand(hq, generator=g) * 0.1
        kern, ref = dict(alibi_slopes=slopes), dict(alibi_slopes=slopes)
    else:
        kern, ref = dict(softcap=3.0), dict(softcap=3.0)
    out, lse = raw(q, kq, vq, k_scale=ks, k_offset=ko, v_scale=vs, v_offset=vo, **kern)
    assert_close(out, lse, q, kd, vd, [s, s], **ref)


def test_rows_that_see_no_key_and_fp8_nan():
    g = gen(8)
    q = torch.randn(3, 4, 1, 64, generator=g)
    kq, vq = quantised((3, 2, 200, 64), torch.float8_e4m3fn, g), quantised((3, 2, 200, 64), torch.float8_e4m3fn, g)
    ks = torch.rand(1, 2, 1, 1, generator=g) * 0.1
    mask = torch.ones(3, 4, 1, 200, dtype=torch.bool)
    mask[1, 2] = False  # one head of sequence 1 sees nothing
    used = torch.tensor([200, 150, 0], dtype=torch.int32)  # sequence 2 has an empty cache
    kq[0, 1, 7, 5] = torch.tensor(float("nan")).to(torch.float8_e4m3fn)  # 0x7f: NaN in e4m3fn
    assert kq[0, 1, 7, 5].view(torch.uint8) == 0x7f
    out, lse = raw(q, kq, vq, seqused_k=used, mask=mask, k_scale=ks, v_scale=ks)
    assert torch.isnan(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()  # kv head 1 serves heads 2, 3
    assert torch.equal(out[1, 2], torch.zeros(1, 64)) and lse[1, 2, 0] == float("-inf")
    assert torch.equal(out[2], torch.zeros(4, 1, 64)) and (lse[2] == float("-inf")).all()
    kd, vd = dequantise(kq[:1], ks, None), dequantise(vq[:1], ks, None)
    ref = oracle(q[:1], kd, vd, [200])[0]
    assert torch.equal(torch.isnan(ref), torch.isnan(out[:1]))


@pytest.mark.parametrize("byte", [0x7F, 0xFF])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("column", [3, 37])
def test_an_e4m3_nan_anywhere_in_the_cache_is_found(byte, where, column):
    """The kernels scan an e4m3 cache for NaN bytes (low seven bits set) and take a faster path where
    there are none: a NaN in a vector's body or in a row's tail past the last whole vector (D 40: 32 + 8
    bytes on AVX2), in K or V, of either sign, in the last cached row, reaches the output as the fp64
    reference says."""
    g = gen(11)
    q = torch.randn(2, 4, 1, 40, generator=g)
    kq, vq = (quantised((2, 2, 33, 40), torch.float8_e4m3fn, g) for _ in range(2))
    scale = torch.rand(1, 2, 1, 1, generator=g) * 0.1
    (kq if where == "k" else vq).view(torch.uint8)[1, 0, 32, column] = byte
    out, lse = raw(q, kq, vq, k_scale=scale, v_scale=scale)
    ref = oracle(q, dequantise(kq, scale, None), dequantise(vq, scale, None), [33, 33])[0]
    assert torch.isnan(ref[1, :2]).any() and torch.isfinite(ref[0]).all()
    assert torch.equal(torch.isnan(ref), torch.isnan(out))


@pytest.mark.parametrize("fmt", ["int8", "e4m3", "int4"])
def test_quantised_paged_bits_do_not_depend_on_threads_or_the_batch(fmt):
    q, kq, vq, sc = quantised_case(fmt, "head_token", b=3, s=2600, seed=9)
    table = block_table(3, 2600, 32)
    kp, vp = pool_of(kq, table, 32), pool_of(vq, table, 32)
    sp = {n: paged_scale(t, 3, table, 32) for n, t in sc.items() if t is not None}
    used = torch.tensor([2600, 1500, 9], dtype=torch.int32)
    runs = [raw(q, kp, vp, block_table=table, seqused_k=used, num_threads=n, **sp) for n in (1, 2, 3)]
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    alone = raw(q[1:2], kp, vp, block_table=table[1:2], seqused_k=used[1:2], **sp)
    assert torch.equal(alone[0], runs[0][0][1:2]) and torch.equal(alone[1], runs[0][1][1:2])


# --------------------------------------------------------------------------------- ragged batches


def ragged_case(lengths_q, used, fmt=None, dtype=torch.float32, hq=8, hkv=2, d=64, page_size=16, seed=10):
    """A varlen query batch against one paged pool: q (Tq, Hq, D), cu_seqlens_q, the pools, the table,
    per-kv-head-token scales for a quantised pool, and the logical (dequantised) cache."""
    g = gen(seed)
    b, s = len(lengths_q), max(used)
    q = torch.randn(sum(lengths_q), hq, d, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32)
    if fmt is None:
        k, v = (torch.randn(b, hkv, s, d, generator=g).to(dtype) for _ in range(2))
        sc, kd, vd = {}, k.double(), v.double()
    else:
        k, v = quantised((b, hkv, s, d), FORMATS[fmt], g), quantised((b, hkv, s, d), FORMATS[fmt], g)
        (ks, _), (vs, _) = scales((b, hkv, s, 1), g, False), scales((1, hkv, 1, d), g, False)
        sc, kd, vd = dict(k_scale=ks, v_scale=vs), dequantise(k, ks, None), dequantise(v, vs, None)
    table = block_table(b, s, page_size, seed)
    sc = {n: paged_scale(t, b, table, page_size) for n, t in sc.items()}
    return q, cu, pool_of(k, table, page_size), pool_of(v, table, page_size), table, sc, kd, vd


def ragged_forward(q, cu, kp, vp, table, used, **kw):
    out = torch.empty(q.shape[0], q.shape[1], vp.shape[-1], dtype=q.dtype)
    lse = torch.empty(q.shape[1], q.shape[0])
    checked.forward(q, kp, vp, out, lse, scale=q.shape[-1] ** -0.5, cu_seqlens_q=cu, block_table=table,
                    seqused_k=torch.tensor(used, dtype=torch.int32), right=0, **kw)
    return out, lse


RAGGED = dict(lengths_q=[1, 1, 37, 1, 3, 1, 70], used=[900, 1, 600, 1300, 40, 517, 70])  # decode rows, chunks


@pytest.mark.parametrize("fmt,dtype", [(None, torch.float32), (None, torch.bfloat16), ("int8", torch.float32),
                                       ("e4m3", torch.bfloat16)], ids=["fp32", "bf16", "int8", "e4m3-bf16q"])
def test_ragged_batch_matches_the_reference_per_sequence(fmt, dtype):
    """Decode rows and prefill chunks in one call, causal at each sequence's end (bottom-right)."""
    q, cu, kp, vp, table, sc, kd, vd = ragged_case(RAGGED["lengths_q"], RAGGED["used"], fmt, dtype)
    out, lse = ragged_forward(q, cu, kp, vp, table, RAGGED["used"], **sc)
    for b, u in enumerate(RAGGED["used"]):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        qb = q[rows].transpose(0, 1)[None]  # (1, Hq, q_len, D)
        ref, ref_lse, base = oracle(qb, kd[b:b + 1], vd[b:b + 1], [u], causal=True)
        verdict = judge(f"out of sequence {b}", out[rows].transpose(0, 1)[None], ref, base, dtype)
        assert verdict.ok, str(verdict)
        assert (lse[:, rows].double() - ref_lse[0]).abs().max() < 1e-4


@pytest.mark.parametrize("fmt", [None, "int8"], ids=["bf16", "int8"])
def test_ragged_batch_is_batch_invariant_bitwise(fmt):
    """A sequence's bits are the same alone, in the ragged batch, and for any thread count."""
    lengths, used = RAGGED["lengths_q"], RAGGED["used"]
    q, cu, kp, vp, table, sc, _, _ = ragged_case(lengths, used, fmt, torch.bfloat16)
    full = [ragged_forward(q, cu, kp, vp, table, used, num_threads=n, **sc) for n in (1, 2, 3)]
    for out, lse in full[1:]:
        assert torch.equal(out, full[0][0]) and torch.equal(lse, full[0][1])
    out, lse = full[0]
    for b in (0, 2, 5, 6):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        one = torch.tensor([0, lengths[b]], dtype=torch.int32)
        o1, l1 = ragged_forward(q[rows], one, kp, vp, table[b:b + 1], used[b:b + 1], **sc)
        assert torch.equal(o1, out[rows]) and torch.equal(l1, lse[:, rows]), f"sequence {b}"


def test_ragged_batch_over_a_contiguous_cache_as_one_page_per_sequence():
    """A (B, S, Hkv, D) cache with seqused_k is a pool of B pages of S slots: block_table = arange(B)."""
    g = gen(11)
    cache_k, cache_v = (torch.randn(3, 400, 2, 64, generator=g) for _ in range(2))
    lengths, used = [1, 25, 1], [400, 100, 7]
    q = torch.randn(sum(lengths), 8, 64, generator=g)
    cu = torch.tensor([0, 1, 26, 27], dtype=torch.int32)
    table = torch.arange(3, dtype=torch.int32)[:, None]
    out, _ = ragged_forward(q, cu, cache_k, cache_v, table, used)
    for b in range(3):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        kd, vd = (t[b:b + 1].transpose(1, 2).double() for t in (cache_k, cache_v))
        ref, _, base = oracle(q[rows].transpose(0, 1)[None], kd, vd, [used[b]], causal=True)
        assert judge("out", out[rows].transpose(0, 1)[None], ref, base, torch.float32).ok


def test_ragged_batch_over_packed_quantised_keys():
    """Varlen q and varlen k (cu_seqlens_k) in int8: per-token-head scales in the packed token layout
    (Tk, Hkv, 1), per-sequence descales with a leading batch axis (B, 1, Hkv, 1)."""
    g = gen(12)
    lq, lk = [1, 9, 1], [300, 40, 1]
    q = torch.randn(sum(lq), 8, 64, generator=g)
    k, v = (quantised((sum(lk), 2, 64), torch.int8, g) for _ in range(2))
    ks = torch.rand(sum(lk), 2, 1, generator=g) * 0.03 + 0.01
    vs = torch.rand(3, 1, 2, 1, generator=g) * 0.03 + 0.01
    cu_q, cu_k = (torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32) for x in (lq, lk))
    out, lse = torch.empty(sum(lq), 8, 64), torch.empty(8, sum(lq))
    checked.forward(q, k, v, out, lse, scale=0.125, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, right=0, k_scale=ks,
                    v_scale=vs)
    for b in range(3):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        kd = (k[keys].double() * ks[keys].double()).transpose(0, 1)[None]
        vd = (v[keys].double() * vs[b].double()).transpose(0, 1)[None]
        ref, _, base = oracle(q[rows].transpose(0, 1)[None], kd, vd, [lk[b]], causal=True, scale=0.125)
        verdict = judge("out", out[rows].transpose(0, 1)[None], ref, base, torch.float32)
        assert verdict.ok, str(verdict)


# ------------------------------------------------------------------------------------- bad input


def test_bad_quantised_arguments_fail_before_compute():
    q, kq, vq, sc = quantised_case("int8", "head_channel")
    ok = dict(k_scale=sc["k_scale"], v_scale=sc["v_scale"])
    cases = [
        (dict(k_scale=sc["k_scale"].double()), TypeError, "k_scale.*fp32"),
        (dict(v_scale=torch.ones(2, 2, 1, 5)), ValueError, "v_scale.*G channel groups dividing the head dim 64"),
        (dict(k_offset=torch.ones(3, 2, 600, 1)), ValueError, r"k_offset.*\(2, 2, 600, 'G'\)"),
        (dict(q_scale=torch.ones(2, 3)), TypeError, r"q_scale.*\(2, 2\)"),
        (dict(options=128), ValueError, "options"),
    ]
    for kw, exc, words in cases:
        with pytest.raises(exc, match=words):
            raw(q, kq, vq, **dict(ok, **kw))
    with pytest.raises(TypeError, match="q.*float64.*quantised"):
        raw(q.double(), kq, vq, **ok)
    with pytest.raises(TypeError, match="'v'.*dtype torch.bfloat16"):
        raw(q, kq, vq.to(torch.bfloat16), **ok)
    with pytest.raises(TypeError, match="'k'.*dtype torch.float16"):
        raw(q, kq.to(torch.float16), vq.to(torch.float16), **ok)
    lse = torch.empty(2, 8, 1)
    with pytest.raises(TypeError, match="'k'"):  # the backward pass reads no quantised cache
        checked.backward(q, kq, vq, None, q, lse, lse, q.clone(), kq.float(), vq.float(), scale=0.1)
