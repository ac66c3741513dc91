"""The Ascend inference ops' int8 caches read as stored: ``antiquant_scale``/``antiquant_offset``
(FIA v1, IFA), the key_/value_ forms, v2's ``dequant_scale_key``/... with ``key_quant_mode``,
``antiquant_mode`` 0 (per channel / per tensor) and 1 (per token), padded, packed (actual lengths)
and paged caches. Oracle: tileattn.reference in fp64 over the cache dequantised here as torch_npu
documents, ``(x + offset) * scale``; the 2x rule against plain math in q's dtype.
"""

from __future__ import annotations

import pytest
import torch

import tileattn
import tileattn.core.kvquant
import tileattn.npu as torch_npu
from tileattn.core.testing import judge

B, N, NKV, D, SQ, SK = 2, 4, 2, 16, 3, 21


def gen(seed):
    return torch.Generator().manual_seed(seed)


def cache(seed):
    g = gen(seed)
    return (torch.randint(-120, 121, (B, SK, NKV, D), generator=g, dtype=torch.int8),
            torch.randint(-120, 121, (B, SK, NKV, D), generator=g, dtype=torch.int8))


def check(name, out_bsnd, q_bsnd, kd, vd, lk, dtype, scale=0.3):
    """out (B, Sq, N, D) against the fp64 attention over the dequantised cache, per batch item."""
    o64 = torch.cat([tileattn.reference(q_bsnd[b:b + 1].double(), kd[b:b + 1, :lk[b]], vd[b:b + 1, :lk[b]],
                                        layout="BSND", scale=scale) for b in range(B)])
    base = torch.cat([tileattn.reference(q_bsnd[b:b + 1], kd[b:b + 1, :lk[b]].to(dtype), vd[b:b + 1, :lk[b]].to(dtype),
                                         layout="BSND", scale=scale) for b in range(B)])
    verdict = judge(name, out_bsnd, o64, base, dtype)
    assert verdict.ok, str(verdict)


@pytest.fixture
def no_python_dequantisation(monkeypatch):
    """The native engine reads the int8 cache as stored: nothing dequantises it in Python."""
    from tileattn.backends.native import kernels
    if not kernels.available()[0]:
        pytest.skip("native kernels unavailable")

    def refuse(*args, **kwargs):
        raise AssertionError("the cache was dequantised in Python")

    monkeypatch.setattr(tileattn.core.kvquant, "dequantise", refuse)
    import tileattn.npu.inference as inference
    core = inference.flash_attention

    def int8_in(q, k, v, **kwargs):
        assert k.dtype == v.dtype == torch.int8, "the dialect passed a dequantised cache"
        return core(q, k, v, **kwargs)

    monkeypatch.setattr(inference, "flash_attention", int8_in)


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH"])
@pytest.mark.parametrize("offset,dtype", [(False, torch.float32), (True, torch.float16)])
def test_fia_v1_antiquant_per_channel(no_python_dequantisation, layout, offset, dtype):
    k, v = cache(1)
    g = gen(2)
    q = torch.randn(B, SQ, N, D, generator=g).to(dtype)
    scale = torch.rand(2, NKV, D, generator=g) * 0.02 + 0.005
    off = torch.randint(-4, 5, (2, NKV, D), generator=g).float() if offset else None
    conv = {"BSND": lambda t: t, "BNSD": lambda t: t.transpose(1, 2), "BSH": lambda t: t.flatten(2)}[layout]
    factor = {"BSND": lambda t: t, "BNSD": lambda t: t[:, :, None, :], "BSH": lambda t: t.flatten(1)}[layout]
    lk = [SK, 13]
    out, _ = torch_npu.npu_fused_infer_attention_score(
        conv(q), conv(k), conv(v), num_heads=N, num_key_value_heads=NKV, input_layout=layout, scale=0.3,
        antiquant_scale=factor(scale).to(dtype), antiquant_offset=None if off is None else factor(off).to(dtype),
        actual_seq_lengths_kv=lk)
    back = {"BSND": lambda t: t, "BNSD": lambda t: t.transpose(1, 2), "BSH": lambda t: t.unflatten(-1, (N, D))}[layout]
    kd = (k.double() + (0 if off is None else off[0].double())) * scale[0].to(dtype).double()
    vd = (v.double() + (0 if off is None else off[1].double())) * scale[1].to(dtype).double()
    check("fia v1 per-channel", back(out), q, kd, vd, lk, dtype)


@pytest.mark.parametrize("layout", ["BSND", "BNSD"])
def test_fia_v2_per_token_and_key_value_forms_with_actual_query_lengths(no_python_dequantisation, layout):
    """Mode 1 (per token, (1, B, S)) for keys, mode 0 (per tensor) for values; the query rows past
    actual_seq_qlen are packed away (the scales follow the packed cache)."""
    k, v = cache(3)
    g = gen(4)
    q = torch.randn(B, SQ, N, D, generator=g)
    tok = torch.rand(1, B, SK, generator=g) * 0.02 + 0.005
    tok_off = torch.randint(-3, 4, (1, B, SK), generator=g).float()
    vscale = torch.tensor([0.011])
    conv = (lambda t: t) if layout == "BSND" else (lambda t: t.transpose(1, 2))
    lq, lk = [SQ, 1], [SK, 11]
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(
        conv(q), conv(k), conv(v), num_query_heads=N, num_key_value_heads=NKV, input_layout=layout,
        softmax_scale=0.3, dequant_scale_key=tok, dequant_offset_key=tok_off, dequant_scale_value=vscale,
        key_quant_mode=1, value_quant_mode=0, actual_seq_qlen=lq, actual_seq_kvlen=lk)
    out = conv(out)
    kd = (k.double() + tok_off[0, :, :, None, None].double()) * tok[0, :, :, None, None].double()
    vd = v.double() * vscale.double()
    check("fia v2 per-token rows 0..", out[:, :1], q[:, :1], kd, vd, lk, torch.float32)
    assert torch.equal(out[1, 1:], torch.zeros_like(out[1, 1:]))  # rows past actual_seq_qlen


def test_ifa_paged_bsh_pool_per_channel(no_python_dequantisation):
    """npu_incre_flash_attention over a paged (blocks, block_size, H) int8 pool, (2, H) factors."""
    g = gen(5)
    bs, blocks = 8, 7
    pool_k = torch.randint(-120, 121, (blocks, bs, NKV * D), generator=g, dtype=torch.int8)
    pool_v = torch.randint(-120, 121, (blocks, bs, NKV * D), generator=g, dtype=torch.int8)
    table = torch.tensor([[4, 0, 6], [2, 5, -1]], dtype=torch.int32)
    lk = [20, 11]
    q = torch.randn(B, 1, N * D, generator=g).bfloat16()
    scale = (torch.rand(2, NKV * D, generator=g) * 0.02 + 0.005).bfloat16()
    off = torch.randint(-4, 5, (2, NKV * D), generator=g).bfloat16()
    out = torch_npu.npu_incre_flash_attention(q, pool_k, pool_v, num_heads=N, num_key_value_heads=NKV,
                                              input_layout="BSH", scale_value=0.3, antiquant_scale=scale,
                                              antiquant_offset=off, block_table=table, actual_seq_lengths=lk,
                                              block_size=bs)
    def gathered(pool, i):
        rows = torch.cat([pool[max(int(p), 0)] for p in table[i]])  # pages in order
        return rows.unflatten(-1, (NKV, D))
    kd = torch.stack([gathered(pool_k, i) for i in range(B)]).double()
    vd = torch.stack([gathered(pool_v, i) for i in range(B)]).double()
    kd = (kd + off[0].double().view(NKV, D)) * scale[0].double().view(NKV, D)
    vd = (vd + off[1].double().view(NKV, D)) * scale[1].double().view(NKV, D)
    check("ifa paged", out.unflatten(-1, (N, D)), q.unflatten(-1, (N, D)), kd, vd, lk, torch.bfloat16)


def test_antiquant_errors_name_the_ascend_argument():
    k, v = cache(6)
    q = torch.randn(B, SQ, N, D)
    fia = torch_npu.npu_fused_infer_attention_score
    kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BSND")
    with pytest.raises(ValueError, match="'antiquant_scale'.*shape \\(3, 2, 16\\)") as info:
        fia(q, k, v, antiquant_scale=torch.ones(3, NKV, D), **kw)
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ValueError, match="'antiquant_offset'.*broadcastable"):
        fia(q, k, v, antiquant_scale=torch.ones(2, NKV, D), antiquant_offset=torch.ones(2, 3, D), **kw)
    with pytest.raises(ValueError, match="'key_antiquant_scale'.*per cached token"):
        fia(q, k, v, key_antiquant_scale=torch.ones(B, 5), value_antiquant_scale=torch.ones(1), key_antiquant_mode=1,
            **kw)
    with pytest.raises(ValueError, match="'antiquant_scale'"):
        fia(q, k, v, **kw)
