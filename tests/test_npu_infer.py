"""torch_npu's inference attention ops (FIA, FIA v2, PFA, IFA) and the update ops, on tileattn.

The oracle is ``tileattn.reference`` run per batch on the valid rows/keys with the kept region of
the documented sparse_mode materialised as a mask (the test may loop; the dialect may not).
"""

import math

import pytest
import torch

import tileattn
import tileattn.npu as torch_npu
from tileattn.core.testing import judge

TRIU = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
B, N, NKV, D = 2, 4, 2, 8


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 97 + sum(shape))).to(dtype)


def keep_of(mode, lq, lk, pre=None, nxt=None):
    i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
    off = lk - lq
    rel = {0: j - i, 2: j - i, 3: j - i - off, 4: j - i - off}.get(mode, j - i)
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if mode in (2, 3):
        keep &= rel <= 0
    if mode in (0, 4):
        if pre is not None:
            keep &= rel >= -pre
        if nxt is not None:
            keep &= rel <= nxt
    return keep


def oracle(q_bsnd, k_bsnd, v_bsnd, lq, lk, scale, keep_fn, dtype=None, sinks=None, bias=None):
    """(B, S, N, D) output (rows past lq[b]: 0) and (B, N, S) LSE (-inf there), fp64 or ``dtype``."""
    out = torch.zeros(q_bsnd.shape[:3] + (v_bsnd.shape[-1],), dtype=torch.float64)
    lse = torch.full((q_bsnd.shape[0], q_bsnd.shape[2], q_bsnd.shape[1]), -math.inf, dtype=torch.float64)
    for b in range(q_bsnd.shape[0]):
        if lq[b] == 0:
            continue
        o, l = tileattn.reference(q_bsnd[b:b + 1, :lq[b]], k_bsnd[b:b + 1, :lk[b]], v_bsnd[b:b + 1, :lk[b]],
                                  layout="BSND", scale=scale, mask=keep_fn(b, lq[b], lk[b]), sinks=sinks,
                                  bias=None if bias is None else bias[b:b + 1, :, :lq[b], :lk[b]],
                                  compute_dtype=dtype or torch.float64, return_lse=True)
        out[b, :lq[b]] = o[0].double()
        lse[b, :, :lq[b]] = l[0].double()
    return out, lse


def assert_fa_rule(name, got, q, k, v, lq, lk, scale, keep_fn, **kw):
    o64, _ = oracle(q, k, v, lq, lk, scale, keep_fn, **kw)
    o32, _ = oracle(q, k, v, lq, lk, scale, keep_fn, dtype=q.dtype, **kw)
    verdict = judge(name, got, o64, o32, q.dtype)
    assert verdict.ok, str(verdict)


def _bsnd(b=B, sq=5, sk=9, seed=0):
    return _rand(b, sq, N, D, seed=seed), _rand(b, sk, NKV, D, seed=seed + 1), _rand(b, sk, NKV, D, seed=seed + 2)


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND", "BSND_NBSD", "BNSD_NBSD", "BSH_NBSD"])
def test_fia_padded_layouts_and_lse(layout):
    q, k, v = _bsnd()
    conv = {"BSH": lambda t: t.flatten(2), "BSND": lambda t: t, "BNSD": lambda t: t.transpose(1, 2)}
    src = layout.split("_")[0]
    out, lse = torch_npu.npu_fused_infer_attention_score(
        conv[src](q), conv[src](k), conv[src](v), num_heads=N, num_key_value_heads=NKV, input_layout=layout, scale=0.3,
        softmax_lse_flag=True)
    dst = layout.split("_")[-1]
    back = {"BSH": lambda t: t.unflatten(-1, (N, D)), "BSND": lambda t: t, "BNSD": lambda t: t.transpose(1, 2),
            "NBSD": lambda t: t.permute(1, 2, 0, 3)}[dst]
    lq, lk = [5, 5], [9, 9]
    assert_fa_rule("out", back(out), q, k, v, lq, lk, 0.3, lambda b, a, c: None)
    _, ref_lse = oracle(q, k, v, lq, lk, 0.3, lambda b, a, c: None)
    assert lse.shape == (B, N, 5, 1)
    torch.testing.assert_close(lse[..., 0].double(), ref_lse, rtol=1e-5, atol=1e-5)
    _, no_lse = torch_npu.npu_fused_infer_attention_score(conv[src](q), conv[src](k), conv[src](v), num_heads=N,
                                                         num_key_value_heads=NKV, input_layout=layout)
    assert no_lse.shape == (1,) and no_lse.item() == 0


@pytest.mark.parametrize("mode,pre,nxt", [(0, None, None), (2, None, None), (3, None, None), (4, 2, 0), (4, 3, -1)])
def test_fia_actual_lengths_and_sparse_modes(mode, pre, nxt):
    """Rows past actual_seq_lengths are not computed (0, LSE -inf); bottom-right modes count from
    the actual lengths of every batch."""
    q, k, v = _bsnd()
    lq, lk = [3, 5], [7, 9]
    kw = dict(sparse_mode=mode, atten_mask=TRIU if mode else None,
              pre_tokens=2147483647 if pre is None else pre, next_tokens=2147483647 if nxt is None else nxt)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q.flatten(2), k.flatten(2), v.flatten(2), num_heads=N, num_key_value_heads=NKV, input_layout="BSH", scale=0.3,
        actual_seq_lengths=lq, actual_seq_lengths_kv=lk, softmax_lse_flag=True, **kw)
    keep = lambda b, a, c: keep_of(mode, a, c, pre, nxt) if mode else None  # noqa: E731
    assert_fa_rule("out", out.unflatten(-1, (N, D)), q, k, v, lq, lk, 0.3, keep)
    _, ref_lse = oracle(q, k, v, lq, lk, 0.3, keep)
    torch.testing.assert_close(lse[..., 0].double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert (out[0, 3:] == 0).all()


def _pool(lk, block=4, blocks=8, kv_layout="BSH", seed=5):
    """A paged cache holding the keys of ``lk`` tokens per batch, in shuffled blocks."""
    k_all, v_all = _rand(blocks, block, NKV, D, seed=seed), _rand(blocks, block, NKV, D, seed=seed + 1)
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))
    need = -(-max(lk) // block)
    table = perm[: B * need].view(B, need).to(torch.int32)
    k_pad = k_all[table.long()].flatten(1, 2)  # (B, need*block, NKV, D): the oracle's view
    v_pad = v_all[table.long()].flatten(1, 2)
    if kv_layout == "BSH":
        return k_all.flatten(2), v_all.flatten(2), table, k_pad, v_pad
    return k_all.transpose(1, 2).contiguous(), v_all.transpose(1, 2).contiguous(), table, k_pad, v_pad


@pytest.mark.parametrize("kv_layout", ["BSH", "BNSD"])
def test_fia_decode_with_paged_cache(kv_layout):
    lk = [10, 7]
    pool_k, pool_v, table, k_pad, v_pad = _pool(lk, kv_layout=kv_layout)
    q = _rand(B, 1, N, D, seed=9)
    if kv_layout == "BSH":
        args, layout = (q.flatten(2), pool_k, pool_v), "BSH"
    else:
        args, layout = (q.transpose(1, 2), pool_k, pool_v), "BNSD"
    out, _ = torch_npu.npu_fused_infer_attention_score(*args, num_heads=N, num_key_value_heads=NKV,
                                                       input_layout=layout, scale=0.3, block_table=table, block_size=4,
                                                       actual_seq_lengths=[1, 1], actual_seq_lengths_kv=lk)
    got = out.unflatten(-1, (N, D)) if layout == "BSH" else out.transpose(1, 2)
    assert_fa_rule("out", got, q, k_pad, v_pad, [1, 1], lk, 0.3, lambda b, a, c: None)
    # the same through IFA, whose actual_seq_lengths are the key lengths
    ifa = torch_npu.npu_incre_flash_attention(*args, num_heads=N, num_key_value_heads=NKV, input_layout=layout,
                                              scale_value=0.3, block_table=table, block_size=4, actual_seq_lengths=lk)
    torch.testing.assert_close(ifa, out)
    # a (B, KV_S) decode mask over a paged cache (read in place, indexed by logical key position)
    dmask = torch.zeros(B, table.shape[1] * 4, dtype=torch.bool)
    dmask[0, 1], dmask[1, 5] = True, True
    out, _ = torch_npu.npu_fused_infer_attention_score(*args, num_heads=N, num_key_value_heads=NKV,
                                                       input_layout=layout, scale=0.3, block_table=table, block_size=4,
                                                       actual_seq_lengths_kv=lk, atten_mask=dmask)
    got = out.unflatten(-1, (N, D)) if layout == "BSH" else out.transpose(1, 2)
    assert_fa_rule("paged + mask", got, q, k_pad, v_pad, [1, 1], lk, 0.3, lambda b, a, c: ~dmask[b, :c][None])


@pytest.mark.parametrize("kv_layout", ["BSH", "BNSD"])
def test_fia_prefill_mask_and_pse_read_a_paged_cache_in_place(monkeypatch, kv_layout):
    """atten_mask and pse_shift over a paged cache: one core call on the pool itself (no gathered copy),
    the mask/bias indexed by logical key position."""
    lk, lq = [10, 7], [3, 2]
    pool_k, pool_v, table, k_pad, v_pad = _pool(lk, kv_layout=kv_layout)
    q = _rand(B, 3, N, D, seed=12)
    capacity = table.shape[1] * 4
    mask = torch.rand(B, 1, 3, capacity, generator=torch.Generator().manual_seed(2)) > 0.7
    pse = _rand(B, N, 3, capacity, seed=13)
    seen = []

    def spy(q_, k_, v_, **kwargs):
        seen.append((k_.data_ptr(), kwargs.get("block_table") is not None))
        return tileattn.flash_attention(q_, k_, v_, **kwargs)

    monkeypatch.setattr(tileattn.npu.inference, "flash_attention", spy)
    args = (q.transpose(1, 2), pool_k, pool_v) if kv_layout == "BNSD" else (q.flatten(2), pool_k, pool_v)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        *args, num_heads=N, num_key_value_heads=NKV, input_layout=kv_layout, scale=0.3, block_table=table,
        block_size=4, actual_seq_lengths=lq, actual_seq_lengths_kv=lk, atten_mask=mask, pse_shift=pse,
        softmax_lse_flag=True)
    assert seen == [(pool_k.data_ptr(), True)]
    got = out.transpose(1, 2) if kv_layout == "BNSD" else out.unflatten(-1, (N, D))
    keep = lambda b, a, c: ~mask[b, 0, :a, :c]  # noqa: E731
    assert_fa_rule("paged prefill + mask + pse", got, q, k_pad, v_pad, lq, lk, 0.3, keep, bias=pse)
    _, want_lse = oracle(q, k_pad, v_pad, lq, lk, 0.3, keep, bias=pse)
    torch.testing.assert_close(lse[..., 0].double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", ["none", "atten_mask", "pse_shift"])
@pytest.mark.parametrize("op", ["fia", "ifa"])
def test_block_table_is_checked_alike_with_or_without_a_mask(extra, op):
    """Every slot a sequence reads must hold a block of the cache (an entry 9 in an 8-block pool, or -5,
    used to be clamped to a real page when a mask or pse was given); the slots past them are not read
    (torch_npu: block ids are the caller's to keep valid; CANN's PagedAttention pads with -1)."""
    lk = [10, 5]  # 3 and 2 blocks of 4 are read
    pool_k, pool_v = _rand(8, 4, NKV * D, seed=21), _rand(8, 4, NKV * D, seed=22)
    q = _rand(B, 1, N * D, seed=23)
    kw = {"none": {}, "atten_mask": dict(atten_mask=torch.zeros(B, 12, dtype=torch.bool)),
          "pse_shift": dict(pse_shift=torch.zeros(B, N, 1, 12))}[extra]

    def call(rows):
        table = torch.tensor(rows, dtype=torch.int32)
        if op == "fia":
            return torch_npu.npu_fused_infer_attention_score(
                q, pool_k, pool_v, num_heads=N, num_key_value_heads=NKV, input_layout="BSH", scale=0.3,
                block_table=table, block_size=4, actual_seq_lengths_kv=lk, **kw)[0]
        return torch_npu.npu_incre_flash_attention(
            q, pool_k, pool_v, num_heads=N, num_key_value_heads=NKV, input_layout="BSH", scale_value=0.3,
            block_table=table, block_size=4, actual_seq_lengths=lk, **kw)

    for rows, bad in (([[0, 1, 9], [2, 3, 0]], "block_table\\[0\\]\\[2\\] = 9"),
                      ([[0, 1, 2], [-5, 3, 0]], "block_table\\[1\\]\\[0\\] = -5")):
        with pytest.raises(ValueError, match="argument 'block_table'.*" + bad) as info:
            call(rows)
        assert isinstance(info.value, RuntimeError)
    padded = call([[0, 1, 2], [3, 4, -1]])
    torch.testing.assert_close(padded, call([[0, 1, 2], [3, 4, 7]]), rtol=0, atol=0)
    k_pad = pool_k[torch.tensor([[0, 1, 2], [3, 4, 0]])].flatten(1, 2).unflatten(-1, (NKV, D))
    v_pad = pool_v[torch.tensor([[0, 1, 2], [3, 4, 0]])].flatten(1, 2).unflatten(-1, (NKV, D))
    assert_fa_rule("-1 padding", padded.unflatten(-1, (N, D)), q.unflatten(-1, (N, D)), k_pad, v_pad, [1, 1], lk,
                   0.3, lambda b, a, c: None)


def test_fia_tnd_prefill_over_paged_cache_like_vllm_ascend():
    """vllm-ascend's chunked prefill: TND query, (blocks, block_size, H) cache, cumulative query
    ends, per-sequence cached lengths, sparse_mode=3 with the 2048x2048 template."""
    lq, lk = [3, 2], [6, 9]
    pool_k, pool_v, table, k_pad, v_pad = _pool(lk)
    q = _rand(sum(lq), N, D, seed=3)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, pool_k, pool_v, atten_mask=TRIU, block_table=table, input_layout="TND", block_size=4,
        actual_seq_lengths=[3, 5], actual_seq_lengths_kv=lk, num_key_value_heads=NKV, num_heads=N, scale=0.3,
        sparse_mode=3, softmax_lse_flag=True)
    q_pad = torch.zeros(B, 3, N, D)
    q_pad[0, :3], q_pad[1, :2] = q[:3], q[3:]
    want, want_lse = oracle(q_pad, k_pad, v_pad, lq, lk, 0.3, lambda b, a, c: keep_of(3, a, c))
    torch.testing.assert_close(out.double(), torch.cat([want[0, :3], want[1, :2]]), rtol=1e-5, atol=1e-6)
    assert lse.shape == (5, N, 1)
    torch.testing.assert_close(lse[:, :, 0].double(), torch.cat([want_lse[0, :, :3], want_lse[1, :, :2]], 1).T,
                               rtol=1e-5, atol=1e-5)
    # NTD_TND: the query comes head-major
    out2, _ = torch_npu.npu_fused_infer_attention_score(
        q.transpose(0, 1).contiguous(), pool_k, pool_v, atten_mask=TRIU, block_table=table, input_layout="NTD_TND",
        block_size=4, actual_seq_lengths=[3, 5], actual_seq_lengths_kv=lk, num_key_value_heads=NKV, num_heads=N,
        scale=0.3, sparse_mode=3)
    torch.testing.assert_close(out2, out)


def test_fia_masks_pse_and_sliding_window_decode():
    q, k, v = _bsnd(sk=9)
    lq, lk = [5, 5], [9, 6]
    mask = torch.rand(B, 5, 12, generator=torch.Generator().manual_seed(1)) > 0.7  # KV_S padded up to 12
    mask[..., 0] = False
    pse = _rand(1, N, 5, 9, seed=4)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=N, num_key_value_heads=NKV, input_layout="BSND", scale=0.3, atten_mask=mask,
        pse_shift=pse, actual_seq_lengths_kv=lk, next_tokens=0)
    keep = lambda b, a, c: (~mask[b, :a, :c]) & keep_of(0, a, c, None, 0)  # noqa: E731  mode 0: band with the mask
    assert_fa_rule("out", out, q, k, v, lq, lk, 0.3, keep, bias=pse.expand(B, -1, -1, -1))
    # PFA's defaults (pre 2147473647, next 0) make mode 0 with a mask causal from the top-left
    pfa = torch_npu.npu_prompt_flash_attention(q, k, v, num_heads=N, num_key_value_heads=NKV, input_layout="BSND",
                                               scale_value=0.3, atten_mask=mask, pse_shift=pse,
                                               actual_seq_lengths_kv=lk)
    torch.testing.assert_close(pfa, out)
    # decode: (B, KV_S) mask and a sliding window read from pre_tokens (vllm-ascend)
    q1 = q[:, :1]
    dmask = torch.zeros(B, 9, dtype=torch.bool)
    dmask[0, 2] = True
    out, _ = torch_npu.npu_fused_infer_attention_score(q1, k, v, num_heads=N, num_key_value_heads=NKV,
                                                       input_layout="BSND", scale=0.3, atten_mask=dmask,
                                                       actual_seq_lengths_kv=lk)
    assert_fa_rule("decode mask", out, q1, k, v, [1, 1], lk, 0.3, lambda b, a, c: ~dmask[b, :c][None])


@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
def test_pre_and_next_tokens_have_no_effect_at_decode_outside_tnd(layout):
    """torch_npu: pre_tokens/next_tokens are ignored at Q_S = 1 (FIA and v2 docs); the whole cache up
    to actual_seq_lengths_kv is attended, with a warning; a sliding-window decode is TND + sparse_mode 4."""
    q, k, v = _bsnd(sq=1, sk=9)
    lk = [9, 6]
    conv = {"BSH": lambda t: t.flatten(2), "BSND": lambda t: t, "BNSD": lambda t: t.transpose(1, 2)}[layout]
    back = {"BSH": lambda t: t.unflatten(-1, (N, D)), "BSND": lambda t: t, "BNSD": lambda t: t.transpose(1, 2)}[layout]
    torch_npu.reset_warnings()
    with pytest.warns(UserWarning, match="no effect at Q_S = 1"):
        out, _ = torch_npu.npu_fused_infer_attention_score(
            conv(q), conv(k), conv(v), num_heads=N, num_key_value_heads=NKV, input_layout=layout, scale=0.3,
            pre_tokens=3, next_tokens=0, actual_seq_lengths_kv=lk)
    assert_fa_rule("decode, pre_tokens ignored", back(out), q, k, v, [1, 1], lk, 0.3, lambda b, a, c: None)
    out2, _ = torch_npu.npu_fused_infer_attention_score_v2(
        conv(q), conv(k), conv(v), num_query_heads=N, num_key_value_heads=NKV, input_layout=layout, softmax_scale=0.3,
        pre_tokens=3, actual_seq_kvlen=lk)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)
    # TND, one query per sequence: sparse_mode=4 with pre_tokens is the sliding window
    packed = lambda t, n: torch.cat([t[b, :n[b]] for b in range(B)])  # noqa: E731
    out3, _ = torch_npu.npu_fused_infer_attention_score(
        packed(q, [1, 1]), packed(k, lk), packed(v, lk), num_heads=N, num_key_value_heads=NKV, input_layout="TND",
        scale=0.3, atten_mask=TRIU, sparse_mode=4, pre_tokens=3, next_tokens=0, actual_seq_lengths=[1, 2],
        actual_seq_lengths_kv=[9, 15])
    assert_fa_rule("TND sliding-window decode", out3[:, None], q, k, v, [1, 1], lk, 0.3,
                   lambda b, a, c: keep_of(4, a, c, 3, 0))


def test_fia_v2_names_learnable_sink_and_int8_cache():
    q, k, v = _bsnd()
    sink = torch.tensor([0.5, -0.5, 1.0, 0.0])
    out, lse = torch_npu.npu_fused_infer_attention_score_v2(
        q, k, v, num_query_heads=N, num_key_value_heads=NKV, input_layout="BSND", softmax_scale=0.3,
        learnable_sink=sink, return_softmax_lse=True, actual_seq_kvlen=[9, 7])
    assert_fa_rule("sink", out, q, k, v, [5, 5], [9, 7], 0.3, lambda b, a, c: None, sinks=sink)
    _, ref_lse = oracle(q, k, v, [5, 5], [9, 7], 0.3, lambda b, a, c: None, sinks=sink)
    torch.testing.assert_close(lse[..., 0].double(), ref_lse, rtol=1e-5, atol=1e-5)
    # int8 cache: (x + offset) * scale, per channel (N, D) for BSND, and per token (B, S)
    kq = torch.randint(-100, 100, k.shape, generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    vq = torch.randint(-100, 100, v.shape, generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    scale = torch.rand(2, NKV, D, generator=torch.Generator().manual_seed(3)) * 0.02
    offset = torch.randn(2, NKV, D, generator=torch.Generator().manual_seed(4))
    out, _ = torch_npu.npu_fused_infer_attention_score(q, kq, vq, num_heads=N, num_key_value_heads=NKV,
                                                       input_layout="BSND", scale=0.3, antiquant_scale=scale,
                                                       antiquant_offset=offset)
    kd, vd = (kq.float() + offset[0]) * scale[0], (vq.float() + offset[1]) * scale[1]
    assert_fa_rule("int8 per-channel", out, q, kd, vd, [5, 5], [9, 9], 0.3, lambda b, a, c: None)
    tok = torch.rand(1, B, 9, generator=torch.Generator().manual_seed(5)) * 0.02
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(q, kq, vq, num_query_heads=N, num_key_value_heads=NKV,
                                                          input_layout="BSND", softmax_scale=0.3,
                                                          dequant_scale_key=tok, dequant_scale_value=tok,
                                                          key_quant_mode=1, value_quant_mode=1)
    assert_fa_rule("int8 per-token", out, q, kq.float() * tok[0, :, :, None, None],
                   vq.float() * tok[0, :, :, None, None], [5, 5], [9, 9], 0.3, lambda b, a, c: None)


def test_update_ops_merge_partial_results():
    q, k, v = _bsnd(b=1, sq=4, sk=10)
    halves = [tileattn.attention_partial(q, k[:, a:b_], v[:, a:b_], layout="BSND", scale=0.3) for a, b_ in ((0, 6), (6, 10))]
    full = tileattn.reference(q, k, v, layout="BSND", scale=0.3)
    rows = [(o.reshape(-1, D), l.transpose(1, 2).reshape(-1)) for o, l in halves]  # (B*S*N, D), (B*S*N,)
    out, lse_out = torch_npu.npu_attention_update([r[1] for r in rows], [r[0] for r in rows], 1)
    torch.testing.assert_close(out.view(1, 4, N, D), full)
    assert out.dtype == torch.float32 and lse_out.shape == (4 * N,)
    out, none = torch_npu.npu_attention_update([r[1] for r in rows], [r[0].half() for r in rows], 0)
    assert none is None and out.dtype == torch.float16
    # SBH ring update from npu_fusion_attention's statistics
    sbh = [t.transpose(0, 1).flatten(2) for t in (q, k, v)]
    parts = [torch_npu.npu_fusion_attention(sbh[0], sbh[1][a:b_], sbh[2][a:b_], N, "SBH", scale=0.3)
             for a, b_ in ((0, 6), (6, 10))]
    out, smax, ssum = torch_npu.npu_ring_attention_update(*parts[0][:3], *parts[1][:3])
    whole = torch_npu.npu_fusion_attention(*sbh, N, "SBH", scale=0.3)
    torch.testing.assert_close(out, whole[0])
    torch.testing.assert_close(smax, whole[1])
    torch.testing.assert_close(ssum, whole[2], rtol=1e-5, atol=1e-6)


def test_inference_bad_arguments_name_themselves():
    q, k, v = _bsnd()
    fia = torch_npu.npu_fused_infer_attention_score
    cases = [
        (NotImplementedError, "'quant_scale2'", lambda: fia(q, k, v, num_heads=N, num_key_value_heads=NKV,
                                                             input_layout="BSND", quant_scale2=torch.ones(1))),
        (NotImplementedError, "'key_shared_prefix'", lambda: fia(q, k, v, num_heads=N, num_key_value_heads=NKV,
                                                                  input_layout="BSND", key_shared_prefix=k)),
        (NotImplementedError, "'kv_padding_size'", lambda: fia(q, k, v, num_heads=N, num_key_value_heads=NKV,
                                                                input_layout="BSND", kv_padding_size=torch.ones(1))),
        (NotImplementedError, "sparse_mode=5", lambda: fia(q, k, v, num_heads=N, num_key_value_heads=NKV,
                                                            input_layout="BSND", sparse_mode=5)),
        (ValueError, "'atten_mask'.*template", lambda: fia(q, k, v, num_heads=N, num_key_value_heads=NKV,
                                                            input_layout="BSND", sparse_mode=3)),
        (ValueError, "'num_heads'", lambda: fia(q, k, v, num_heads=3, input_layout="BSND")),
        (ValueError, "'num_key_value_heads'", lambda: fia(q, k, v, num_heads=N, num_key_value_heads=4,
                                                           input_layout="BSND")),
        (ValueError, "'input_layout'", lambda: fia(q, k, v, num_heads=N, input_layout="SBH")),
        (ValueError, "'actual_seq_lengths'", lambda: fia(q, k, v, num_heads=N, num_key_value_heads=NKV,
                                                          input_layout="BSND", actual_seq_lengths=[6, 1])),
        (ValueError, "'actual_seq_lengths_kv'.*required", lambda: fia(
            q[:, :1], k.flatten(2), v.flatten(2), num_heads=N, num_key_value_heads=NKV, input_layout="BSND",
            block_table=torch.zeros(B, 2, dtype=torch.int32), block_size=9)),
        (ValueError, "'atten_mask'", lambda: fia(q, k, v, num_heads=N, num_key_value_heads=NKV, input_layout="BSND",
                                                  atten_mask=torch.zeros(3, 5, 9, dtype=torch.bool))),
        (TypeError, "'softmax_lse_flag'", lambda: fia(q, k, v, num_heads=N, num_key_value_heads=NKV,
                                                       input_layout="BSND", softmax_lse_flag=1)),
        (NotImplementedError, "key_antiquant_mode=2", lambda: fia(
            q, k.to(torch.int8), v.to(torch.int8), num_heads=N, num_key_value_heads=NKV, input_layout="BSND",
            key_antiquant_scale=torch.ones(1), value_antiquant_scale=torch.ones(1), key_antiquant_mode=2)),
        (ValueError, "'update_type'", lambda: torch_npu.npu_attention_update([torch.zeros(2)], [torch.zeros(2, 8)], 2)),
        (ValueError, "'actual_seq_qlen'.*cumulative", lambda: torch_npu.npu_ring_attention_update(
            *(torch.zeros(3, 2, 8),) + (torch.zeros(3, 2, 8),) * 2, *(torch.zeros(3, 2, 8),) * 3, [1, 3], "TND")),
    ]
    for exc, match, call in cases:
        with pytest.raises(exc, match=match) as info:
            call()
        assert isinstance(info.value, RuntimeError), (match, type(info.value))
