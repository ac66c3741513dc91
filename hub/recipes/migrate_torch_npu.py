"""Recipe: run torch_npu attention code unchanged in meaning on tileattn.

Code written for Ascend calls ``torch_npu.npu_fusion_attention``. ``tileattn.npu`` has the same
signature, defaults and seven return values. Two routes, neither touching the attention code:

1. the import line::

       try:
           from torch_npu import npu_fusion_attention          # on an Ascend NPU
       except ImportError:
           from tileattn.npu import npu_fusion_attention       # anywhere PyTorch runs

2. no edit at all: ``python -m tileattn.npu your_script.py`` (or ``tileattn.npu.install()`` at
   start-up) makes ``import torch_npu`` resolve to tileattn and gives ``torch.npu`` /
   ``Tensor.npu()`` for device placement. This recipe checks that route too, in a subprocess.

The functions below are written the way Ascend model code writes them (BSND with the compressed
causal mask and ``sparse_mode=3``, a padding mask in BNSD, variable-length TND with cumulative
``actual_seq_qlen``, a ``pse`` position bias, MindSpeed's ring-attention merge of two key halves
from ``softmax_max``/``softmax_sum``). Each result is checked against ``tileattn.reference`` given the
torch_npu semantics spelled out in the comments, with FlashAttention's 2x accuracy rule.

    python hub/recipes/migrate_torch_npu.py
"""

import math
import os
import subprocess
import sys
import tempfile

import torch

import tileattn
from tileattn.core.testing import check_against_reference, judge

try:
    from torch_npu import npu_fusion_attention
except ImportError:
    from tileattn.npu import npu_fusion_attention

SMALL = os.environ.get("TILEATTN_SMALL") == "1"
B, N, S, D = (2, 4, 128, 64) if SMALL else (2, 8, 1024, 128)
CHECKS = []


# ----- Model code as written for torch_npu (unchanged) ----------------------------------------------

def causal_self_attention_bsnd(q, k, v):
    # torch_npu: 1/True in atten_mask = masked OUT; sparse_mode=3 = causal from the bottom-right corner,
    # with a fixed compressed 2048x2048 upper-triangular mask whatever the sequence length.
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out = npu_fusion_attention(q, k, v, q.shape[2], "BSND", atten_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]),
                               sparse_mode=3)
    return out[0], out[1], out[2]


def padded_attention_bnsd(q, k, v, key_lengths):
    # Padding mask [B, 1, Sq, Sk], True where the key is padding (masked out).
    sk = k.shape[2]
    pad = torch.arange(sk)[None, :] >= key_lengths[:, None]
    mask = pad[:, None, None, :].expand(-1, 1, q.shape[2], sk)
    return npu_fusion_attention(q, k, v, q.shape[1], "BNSD", atten_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]))[0]


def varlen_attention_tnd(q, k, v, seq_lengths):
    # TND packs sequences back to back; actual_seq_qlen/kvlen are CUMULATIVE end offsets ([2,2,2] -> [2,4,6]).
    ends = torch.tensor(seq_lengths).cumsum(0).tolist()
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    return npu_fusion_attention(q, k, v, q.shape[1], "TND", atten_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]),
                                actual_seq_qlen=ends, actual_seq_kvlen=ends, sparse_mode=3)[0]


def ring_merge_tnd(q, k_parts, v_parts, seq_lengths, kv_lengths):
    # MindSpeed-style ring attention over key halves: attend to each half, then merge the partial
    # outputs by their softmax_max/softmax_sum. torch_npu returns TND statistics (T, N, 8) laid out
    # per sequence head-major ("NTD"); MindSpeed's flatten_softmax reorders them per sequence.
    n = q.shape[1]
    ends = torch.tensor(seq_lengths).cumsum(0).tolist()
    parts = [npu_fusion_attention(q, k, v, n, "TND", scale=1.0 / math.sqrt(q.shape[-1]), actual_seq_qlen=ends,
                                  actual_seq_kvlen=torch.tensor(lens).cumsum(0).tolist())[:3]
             for k, v, lens in zip(k_parts, v_parts, kv_lengths)]

    def flatten_softmax(x):
        blocks = x.view(-1, 8).split([s * n for s in seq_lengths])
        return torch.cat([b.view(n, -1, 8).transpose(0, 1) for b in blocks])

    (o1, m1, s1), (o2, m2, s2) = [(o, flatten_softmax(m), flatten_softmax(s_)) for o, m, s_ in parts]
    m = torch.maximum(m1, m2)
    s1, s2 = s1 * torch.exp(m1 - m), s2 * torch.exp(m2 - m)
    return o1 * (s1 / (s1 + s2))[..., :1] + o2 * (s2 / (s1 + s2))[..., :1]


def attention_with_pse(q, k, v, pse):
    # pse is added to Q.K^T BEFORE the scale: softmax(scale * (pse + Q.K^T)).
    return npu_fusion_attention(q, k, v, q.shape[1], "BNSD", pse=pse, scale=1.0 / math.sqrt(q.shape[-1]))[0]


# ----- Checks: the same computation in tileattn's own terms --------------------------------------------

def verify(name, out, q, k, v, **reference_kwargs):
    oracle = tileattn.reference(q, k, v, compute_dtype=torch.float64, **reference_kwargs)
    plain = tileattn.reference(q, k, v, **reference_kwargs)
    verdict = judge(name, out, oracle, plain, q.dtype)
    print("  ", verdict)
    CHECKS.append(verdict.ok)


def main():
    torch.manual_seed(0)
    print(f"npu_fusion_attention from {npu_fusion_attention.__module__}; B={B} N={N} S={S} D={D}")

    q, k, v = (torch.randn(B, S, N, D) for _ in range(3))
    out, softmax_max, softmax_sum = causal_self_attention_bsnd(q, k, v)
    verify("BSND causal (sparse_mode=3)", out, q, k, v, layout="BSND", causal=True)
    _, lse = tileattn.reference(q, k, v, layout="BSND", causal=True, return_lse=True)
    # softmax_max/sum: [B, N, S, 8], the row max and the sum of exp(s - max), repeated 8 times.
    stats_lse = softmax_max[..., 0] + torch.log(softmax_sum[..., 0])
    stats_ok = softmax_max.shape == (B, N, S, 8) and torch.allclose(stats_lse, lse, atol=1e-4)
    print(f"   softmax_max {tuple(softmax_max.shape)}: max + log(sum) equals the LSE: {stats_ok}")
    CHECKS.append(stats_ok)

    qb, kb, vb = (torch.randn(B, N, S, D) for _ in range(3))
    lengths = torch.tensor([S, S // 2 + 3])
    out = padded_attention_bnsd(qb, kb, vb, lengths)
    keep = (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :]  # tileattn: True = take part
    verify("BNSD key padding", out, qb, kb, vb, mask=keep)

    seq_lengths = [S // 2, S // 4, S // 4 + 5]
    total = sum(seq_lengths)
    qt, kt, vt = (torch.randn(total, N, D) for _ in range(3))
    out = varlen_attention_tnd(qt, kt, vt, seq_lengths)
    cu = torch.tensor([0] + seq_lengths).cumsum(0).to(torch.int32)
    verify("TND varlen causal", out, qt, kt, vt, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)

    # Ring attention merge: the keys of every sequence split in two halves.
    halves = [[], []]
    starts = torch.tensor([0] + seq_lengths).cumsum(0).tolist()
    for a, n in zip(starts, seq_lengths):
        halves[0].append(torch.arange(a, a + n // 2))
        halves[1].append(torch.arange(a + n // 2, a + n))
    idx = [torch.cat(h) for h in halves]
    kv_lengths = [[n // 2 for n in seq_lengths], [n - n // 2 for n in seq_lengths]]
    out = ring_merge_tnd(qt, [kt[i] for i in idx], [vt[i] for i in idx], seq_lengths, kv_lengths)
    verify("TND ring merge from softmax_max/sum", out, qt, kt, vt, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu)

    pse = torch.randn(1, N, S, S)
    out = attention_with_pse(qb, kb, vb, pse)
    verify("BNSD pse", out, qb, kb, vb, bias=pse / math.sqrt(D))  # tileattn adds bias AFTER the scale

    # Gradients flow through autograd, as with torch_npu on an NPU; the reference gets tileattn's terms.
    verdicts = check_against_reference(lambda q_, k_, v_, **_: causal_self_attention_bsnd(q_, k_, v_)[0],
                                       q, k, v, layout="BSND", causal=True)
    for verdict in verdicts[1:]:
        print("   gradient", verdict)
    CHECKS.extend(verdict.ok for verdict in verdicts)

    # The classic migration bug: torch_npu's scale defaults to 1.0, not 1/sqrt(D).
    forgot_scale = npu_fusion_attention(qb, kb, vb, N, "BNSD")[0]
    differs = (forgot_scale - tileattn.reference(qb, kb, vb)).abs().max().item()
    print(f"   forgetting scale=1/sqrt(D) changes the output by {differs:.2f} (as on the NPU)")
    CHECKS.append(differs > 1e-2)

    # Route 2: an unchanged script that imports torch_npu, run through python -m tileattn.npu.
    script = (
        "import torch, torch_npu\n"
        "q, k, v = (torch.randn(1, 16, 2, 8).npu() for _ in range(3))\n"
        "mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1).npu()\n"
        "out = torch_npu.npu_fusion_attention(q, k, v, 2, 'BSND', atten_mask=mask, scale=8 ** -0.5, sparse_mode=3)[0]\n"
        "torch.npu.synchronize()\n"
        "print('ran on', torch.npu.get_device_name(), tuple(out.shape))\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ascend_script.py")
        with open(path, "w") as f:
            f.write(script)
        proc = subprocess.run([sys.executable, "-m", "tileattn.npu", path], capture_output=True, text=True, timeout=300)
    print(f"   python -m tileattn.npu ascend_script.py: {(proc.stdout or proc.stderr).strip().splitlines()[-1]}")
    CHECKS.append(proc.returncode == 0)

    if not all(CHECKS):
        raise SystemExit(f"torch_npu migration recipe FAILED: {CHECKS.count(False)} check(s)")
    print(f"torch_npu migration recipe passed ({len(CHECKS)} checks)")


if __name__ == "__main__":
    main()
