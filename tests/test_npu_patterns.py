"""Megatron/MindSpeed-style calls of torch_npu's attention, reproduced in this file's own code and
judged against ``tileattn.reference`` with FlashAttention's 2x rule.

* Megatron's default: SBH with a causal mask, sparse_mode 0 (full mask, pre = S, next = 0) or 2
  (the 2048x2048 compressed template), forward and backward (autograd and the grad op).
* Packed sequences (``--reset-attention-mask``): TND with cumulative ends, modes 2 and 3.
* Causal ring attention (context parallelism) over two ranks with head-tail load balancing: each
  rank attends its two query chunks to the key/value chunks passed around the ring, merges the
  partial results from softmax_max/softmax_sum, and computes its gradients with
  npu_fusion_attention_grad from the merged statistics, as MindSpeed's ring attention does.
"""

import pytest
import torch

import tileattn
from tileattn.npu import npu_fusion_attention, npu_fusion_attention_grad, npu_ring_attention_update
from tileattn.core.testing import check_against_reference, judge

TRIU = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed + 7 * sum(shape))).to(dtype)


def _assert_ok(verdicts, expected):
    assert len(verdicts) == expected
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", [0, 2])
def test_megatron_sbh_causal(mode, dtype):
    s, b, n, d = 24, 2, 4, 16
    q, k, v = (_rand(s, b, n * d, seed=i, dtype=dtype) for i in range(3))
    scale = d ** -0.5
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1) if mode == 0 else TRIU

    def megatron(q, k, v, **_):
        return npu_fusion_attention(q, k, v, n, "SBH", atten_mask=mask, scale=scale, pre_tockens=s, next_tockens=0,
                                    keep_prob=1.0, inner_precise=0, sparse_mode=mode)[0]

    _assert_ok(check_against_reference(megatron, q, k, v, layout="SBH", num_heads=n, causal=True, scale=scale), 4)
    # The grad op with the forward's statistics gives the same gradients as autograd.
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out, smax, ssum = npu_fusion_attention(*leaves, n, "SBH", atten_mask=mask, scale=scale, pre_tockens=s,
                                           next_tockens=0, sparse_mode=mode)[:3]
    dy = _rand(*out.shape, seed=5, dtype=dtype)
    auto = torch.autograd.grad(out, leaves, dy)
    grads = npu_fusion_attention_grad(q, k, v, dy, n, "SBH", atten_mask=mask, softmax_max=smax, softmax_sum=ssum,
                                      attention_in=out.detach(), scale_value=scale, pre_tockens=s, next_tockens=0,
                                      sparse_mode=mode)
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, g in zip(auto, grads[:3]):
        torch.testing.assert_close(g.float(), a.float(), **tol)


@pytest.mark.parametrize("mode", [2, 3])
def test_packed_sequences_tnd(mode):
    lens, n, d = [5, 9, 3, 7], 4, 16
    total = sum(lens)
    q, k, v = (_rand(total, n, d, seed=i) for i in range(3))
    ends = torch.tensor(lens).cumsum(0).tolist()
    cu = torch.tensor([0] + ends, dtype=torch.int32)

    def mindspeed(q, k, v, **_):
        return npu_fusion_attention(q, k, v, n, "TND", atten_mask=TRIU, scale=d ** -0.5, actual_seq_qlen=ends,
                                    actual_seq_kvlen=ends, sparse_mode=mode)[0]

    # Sq == Sk per sequence: top-left and bottom-right causal agree.
    _assert_ok(check_against_reference(mindspeed, q, k, v, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu,
                                       causal=True, scale=d ** -0.5), 4)


def _forward_update(prev, cur):
    """MindSpeed's forward_update (SBH), written out: merge (out, max, sum) by the statistics."""
    (o1, m1, s1), (o2, m2, s2) = prev, cur
    m = torch.maximum(m1, m2)
    s1, s2 = s1 * torch.exp(m1 - m), s2 * torch.exp(m2 - m)
    total = s1 + s2
    heads, hidden = m.shape[1], o1.shape[-1]

    def to_sbh(w):  # (B, N, S, 8) -> (S, B, N * D)
        return w[..., 0].permute(2, 0, 1).repeat_interleave(hidden // heads, dim=-1)

    return o1 * to_sbh(s1 / total) + o2 * to_sbh(s2 / total), m, total


def test_causal_ring_attention_over_two_ranks():
    world, c, b, n, d = 2, 6, 2, 2, 8
    s = 2 * world * c
    scale = d ** -0.5
    q, k, v = (_rand(s, b, n * d, seed=i, dtype=torch.float64) for i in range(3))
    dout = _rand(s, b, n * d, seed=9, dtype=torch.float64)
    chunk = lambda t, i: t[i * c:(i + 1) * c]  # noqa: E731
    ids = [(r, 2 * world - 1 - r) for r in range(world)]  # head-tail load balancing
    local = [[torch.cat([chunk(t, i) for i in ids[r]]) for t in (q, k, v, dout)] for r in range(world)]

    def block(r, j, tensors_q, tensors_kv):
        """The (query rank r, key rank j) block of causal attention, as MindSpeed fetches it."""
        qr = tensors_q
        kr, vr = tensors_kv
        if j == r:
            return qr, kr, vr, slice(None), dict(atten_mask=TRIU, sparse_mode=3)
        if j < r:
            return qr, kr[:c], vr[:c], slice(None), {}
        return qr[c:], kr, vr, slice(c, None), {}

    outs, stats = [], []
    for r in range(world):
        acc = None
        for step in range(world):
            j = (r - step) % world
            cq, ck, cv, rows, kw = block(r, j, local[r][0], local[j][1:3])
            o, m, sm = npu_fusion_attention(cq, ck, cv, n, "SBH", scale=scale, **kw)[:3]
            if acc is None:
                acc = [o, m, sm]
            elif rows == slice(None):
                acc = list(_forward_update(acc, (o, m, sm)))
            else:  # only the second half of the queries: merge into it (npu_ring_attention_update's SBH)
                merged = npu_ring_attention_update(acc[0][c:], acc[1][:, :, c:], acc[2][:, :, c:], o, m, sm)
                acc[0] = torch.cat([acc[0][:c], merged[0]])
                acc[1] = torch.cat([acc[1][:, :, :c], merged[1]], 2)
                acc[2] = torch.cat([acc[2][:, :, :c], merged[2]], 2)
        outs.append(acc[0])
        stats.append(acc)
    grads = [[torch.zeros_like(t) for t in local[r][:3]] for r in range(world)]
    for r in range(world):
        out_r, m_r, s_r = stats[r]
        for j in range(world):
            cq, ck, cv, rows, kw = block(r, j, local[r][0], local[j][1:3])
            dq, dk, dv = npu_fusion_attention_grad(cq, ck, cv, local[r][3][rows], n, "SBH", softmax_max=m_r[:, :, rows],
                                                   softmax_sum=s_r[:, :, rows], attention_in=out_r[rows],
                                                   scale_value=scale, **kw)[:3]
            grads[r][0][rows] += dq
            grads[j][1][:ck.shape[0]] += dk
            grads[j][2][:cv.shape[0]] += dv

    def unshard(per_rank):  # back to the original chunk order
        pieces = {}
        for r, t in enumerate(per_rank):
            pieces[ids[r][0]], pieces[ids[r][1]] = t[:c], t[c:]
        return torch.cat([pieces[i] for i in range(2 * world)])

    got = [unshard(outs)] + [unshard([g[i] for g in grads]) for i in range(3)]

    def reference(cdt):
        leaves = [t.detach().to(cdt).requires_grad_(True) for t in (q, k, v)]
        o = tileattn.reference(*leaves, layout="SBH", num_heads=n, causal=True, scale=scale)
        return [o, *torch.autograd.grad(o, leaves, dout.to(cdt))]

    ref64, ref32 = reference(torch.float64), reference(torch.float32)
    # the statistics travel in fp32 (torch_npu's format): judged as fp32 math
    verdicts = [judge(name, a, b_, c_, torch.float32) for name, a, b_, c_ in
                zip(("out", "dq", "dk", "dv"), got, ref64, ref32)]
    _assert_ok(verdicts, 4)
