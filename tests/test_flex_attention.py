"""tileattn.flex_attention: PyTorch's flex_attention on CPU, forward and backward, judged against the
fp64 reference (tileattn.flex.semantics.flex_reference) under FlashAttention's 2x rule, and against
PyTorch's own eager flex_attention forward. A call is one flash_attention call: the native engine
runs compiled functions in its tiles, the eager engine the ones the compiler refuses."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import flex_attention as torch_flex
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, and_masks, create_block_mask

import tileattn
from tileattn.flex import examples
from tileattn.flex import create_block_mask as ta_create_block_mask
from tileattn.flex.semantics import flex_reference
from tileattn.programs import compiler
from tileattn.core.testing import judge


@pytest.fixture
def pytorch_flex(monkeypatch):
    """PyTorch's eager flex_attention without the per-call dynamo trace."""
    monkeypatch.setattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")
    return torch_flex.flex_attention


def qkv(batch, heads_q, heads_kv, q_len, kv_len, dim=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads_q, q_len, dim), (batch, heads_kv, kv_len, dim), (batch, heads_kv, kv_len, dim)]
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def verdicts(q, k, v, captures=(), lse_weight=0.5, **kwargs):
    """Verdicts of tileattn.flex_attention vs the fp64 reference, with the same-dtype reference as the
    plain-math baseline: out, lse and the gradients of q, k, v and each capture (through out and lse)."""
    dtype = q.dtype

    def run(fn, compute_dtype, cast):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        caps = list(captures)
        for c in caps:
            c.grad = None
        extra = {} if fn is tileattn.flex_attention else {"compute_dtype": compute_dtype}
        out, lse = fn(*leaves, return_lse=True, **kwargs, **extra)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
        loss = (out * dout).sum() + lse_weight * lse.masked_fill(torch.isinf(lse), 0).sum()
        grads = torch.autograd.grad(loss, leaves + caps)
        return [out, lse, *grads]

    got = run(tileattn.flex_attention, None, dtype)
    oracle = run(flex_reference, torch.float64, dtype)
    base = run(flex_reference, None, dtype)
    names = ["out", "lse", "dq", "dk", "dv"] + [f"dcapture{i}" for i in range(len(captures))]
    return [judge(n, a, b, c, dtype) for n, a, b, c in zip(names, got, oracle, base)]


def assert_ok(found):
    bad = [str(v) for v in found if not v.ok]
    assert not bad, "\n".join(bad)


MASK_CASES = [  # (mask, batch, heads_q, heads_kv, q_len, kv_len, block, also with a score_mod)
    ("causal", 2, 4, 2, 77, 77, 32, False),
    ("sliding_window", 1, 2, 2, 100, 100, 16, False),
    ("prefix_lm", 1, 2, 1, 64, 64, 16, False),
    ("document", 2, 2, 2, 90, 90, 16, True),
    ("dilated_window", 1, 2, 2, 48, 61, 16, False),
    ("natten", 1, 2, 2, 64, 64, 16, True),
    ("sink_tokens", 1, 2, 2, 80, 80, 16, False),
]


@pytest.mark.parametrize("mask_name,batch,hq,hkv,q_len,kv_len,block,scored", MASK_CASES)
def test_mask_patterns_forward_backward(mask_name, batch, hq, hkv, q_len, kv_len, block, scored):
    """Every attention-gym mask, mask-only, against the fp64 reference; two of them (keys in
    non-contiguous blocks) with a score_mod too. Both run on the native engine's compiled path."""
    q, k, v = qkv(batch, hq, hkv, q_len, kv_len)
    mask_mod = examples.MASKS[mask_name](q_len, kv_len)
    block_mask = create_block_mask(mask_mod, None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=block)
    assert_ok(verdicts(q, k, v, block_mask=block_mask, enable_gqa=hq != hkv))
    if scored:
        score_mod, captures = examples.score_mods(hq, q_len, kv_len, requires_grad=True)["relative_bias"]
        assert_ok(verdicts(q, k, v, captures, block_mask=block_mask, score_mod=score_mod, enable_gqa=hq != hkv))


@pytest.mark.parametrize("score_name", ["alibi", "softcap", "relative_bias", "head_scales", "t5_bias"])
def test_score_mod_patterns_with_capture_gradients(score_name):
    """Every score_mod pattern, with and without a mask, gradients of captured tables included."""
    q, k, v = qkv(2, 2, 2, 45, 52)
    score_mod, captures = examples.score_mods(2, 45, 52, requires_grad=True)[score_name]
    assert_ok(verdicts(q, k, v, captures, score_mod=score_mod))
    block_mask = create_block_mask(examples.causal, None, None, 45, 52, device="cpu", BLOCK_SIZE=16)
    assert_ok(verdicts(q, k, v, captures, score_mod=score_mod, block_mask=block_mask))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])  # fp16 takes bf16's path (fp32 scores)
def test_dtypes(dtype):
    q, k, v = qkv(1, 2, 2, 40, 40, dtype=dtype)
    block_mask = create_block_mask(examples.sliding_window(9), None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    assert_ok(verdicts(q, k, v, block_mask=block_mask))
    assert_ok(verdicts(q, k, v, score_mod=examples.softcap(5.0), block_mask=block_mask))


SCORE_NAMES = ["alibi", "softcap", "relative_bias", "head_scales", "t5_bias"]


@pytest.mark.parametrize("index,mask_name", list(enumerate(examples.MASKS)))
def test_every_pattern_matches_pytorch_eager_forward(pytorch_flex, index, mask_name):
    """Each attention-gym mask, with a score_mod (each score_mod appears), as PyTorch's eager Flex has it."""
    q, k, v = qkv(1, 2, 2, 56, 56)
    block_mask = create_block_mask(examples.MASKS[mask_name](56, 56), None, None, 56, 56, device="cpu",
                                   BLOCK_SIZE=16)
    score_mod, _ = examples.score_mods(2, 56, 56)[SCORE_NAMES[index % len(SCORE_NAMES)]]
    for mod in (None, score_mod):
        out, lse = tileattn.flex_attention(q, k, v, score_mod=mod, block_mask=block_mask, return_lse=True)
        expected, expected_lse = pytorch_flex(q, k, v, score_mod=mod, block_mask=block_mask, return_lse=True)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
        torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=0)


@pytest.mark.parametrize("score", [False, True])
def test_matches_pytorch_eager_forward(pytorch_flex, score):
    q, k, v = qkv(2, 4, 2, 70, 70)
    mask_mod = and_masks(examples.document(torch.arange(70) // 23), examples.causal)
    block_mask = create_block_mask(mask_mod, None, None, 70, 70, device="cpu", BLOCK_SIZE=32)
    kwargs = dict(block_mask=block_mask, enable_gqa=True, return_lse=True,
                  score_mod=examples.alibi(4) if score else None)
    out, lse = tileattn.flex_attention(q, k, v, **kwargs)
    expected, expected_lse = pytorch_flex(q, k, v, **kwargs)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=0)


def test_empty_rows_and_aux():
    """Rows that see nothing (a whole row of blocks, and single rows inside a block): output 0, LSE and
    max -inf, zero gradients; return_aux matches return_lse; max_scores matches the reference."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 40, 40))

    def late_keys(b, h, q_idx, kv_idx):
        return (kv_idx > q_idx) & (q_idx >= 20) | (q_idx == 5)

    block_mask = create_block_mask(late_keys, None, None, 40, 40, device="cpu", BLOCK_SIZE=8)
    for score_mod in (None, examples.softcap(3.0)):
        out, aux = tileattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                           return_aux=AuxRequest(lse=True, max_scores=True))
        ref, ref_aux = flex_reference(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                      return_aux=AuxRequest(lse=True, max_scores=True))
        empty = [r for r in range(40) if not (r >= 20 and r < 39 or r == 5)]
        assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
        assert torch.isneginf(aux.lse[:, :, empty]).all() and torch.isneginf(aux.max_scores[:, :, empty]).all()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(aux.max_scores, ref_aux.max_scores, atol=1e-5, rtol=0)
        out2, lse2 = tileattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
        torch.testing.assert_close(lse2, ref_aux.lse, atol=1e-5, rtol=0)
        grads = torch.autograd.grad(out2.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)
        assert torch.equal(grads[0][:, :, empty], torch.zeros_like(grads[0][:, :, empty]))
        only_lse = tileattn.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                           return_aux=AuxRequest(lse=True))[1]
        assert only_lse.max_scores is None


def test_block_mask_sources_and_no_mask():
    """PyTorch's from_kv_blocks (block lists are semantic), tileattn's create_block_mask, no mask,
    a batch-1 key with a batch-sized mask, scale and enable_gqa."""
    q, k, v = qkv(2, 2, 2, 64, 64)
    num = torch.tensor([[[1, 2, 1, 0]]], dtype=torch.int32)
    idx = torch.tensor([[[0, 0, 0, 0], [0, 1, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0]]], dtype=torch.int32)
    from_lists = BlockMask.from_kv_blocks(num, idx.unsqueeze(0), BLOCK_SIZE=16, mask_mod=examples.causal,
                                          seq_lengths=(64, 64))
    assert_ok(verdicts(q, k, v, block_mask=from_lists))
    ours = ta_create_block_mask(examples.prefix_lm(20), None, None, 64, 64, BLOCK_SIZE=16)
    assert_ok(verdicts(q, k, v, block_mask=ours, scale=0.3))
    assert_ok(verdicts(q, k, v, score_mod=examples.alibi(2)))
    assert_ok(verdicts(q, k, v))
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]  # BSND memory, BNSD view
    assert_ok(verdicts(*strided, block_mask=ours, score_mod=examples.alibi(2)))
    assert_ok(verdicts(*strided, block_mask=ours))
    k1, v1 = k[:1], v[:1]
    padded = create_block_mask(examples.padding(torch.tensor([50, 20])), 2, None, 64, 64, device="cpu",
                               BLOCK_SIZE=16)
    assert_ok(verdicts(q, k1, v1, block_mask=padded))


def test_compiled_once_and_fallback_with_reason():
    """A new closure of the same score_mod does not trace again; a score_mod the compiler refuses runs
    through torch.vmap, correct, with the reason in tileattn.flex.explain."""
    q, k, v = qkv(1, 2, 2, 33, 33)
    tileattn.flex_attention(q, k, v, score_mod=examples.softcap(2.5))
    traces = compiler.STATS["traces"]
    tileattn.flex_attention(q, k, v, score_mod=examples.softcap(2.5))
    assert compiler.STATS["traces"] == traces
    assert tileattn.flex.explain(q, k, v, score_mod=examples.softcap(2.5))["score_mod"] == "compiled"

    bias = torch.randn(33, requires_grad=True)

    def through_object(score, b, h, q_idx, kv_idx):
        return score + Table.values[kv_idx]

    class Holder:  # a tensor behind an object's attribute: not keyed, so not compiled
        def __init__(self, values):
            self.values = values

    holder = Holder(bias)

    def through_object(score, b, h, q_idx, kv_idx):
        return score + holder.values[kv_idx]

    why = tileattn.flex.explain(q, k, v, score_mod=through_object)
    assert why["score_mod"].startswith("torch.vmap:") and "Holder" in why["score_mod"]
    assert why["path"].endswith("the eager engine") and "score_mod is not compiled" in why["engines"]["native"][0]
    assert_ok(verdicts(q, k, v, (bias,), score_mod=through_object))
    block_mask = create_block_mask(examples.causal, None, None, 33, 33, device="cpu", BLOCK_SIZE=16)
    assert_ok(verdicts(q, k, v, (bias,), score_mod=through_object, block_mask=block_mask))
    assert tileattn.flex.explain(q, k, v, block_mask=block_mask)["path"].endswith("the native engine")

    def unchanged(score, b, h, q_idx, kv_idx):  # what transformers passes without softcap or bias
        return score

    assert tileattn.flex.explain(q, k, v, score_mod=unchanged, block_mask=block_mask)["path"].endswith("native engine")
    assert_ok(verdicts(q, k, v, score_mod=unchanged, block_mask=block_mask))


def test_errors_before_compute(pytorch_flex):
    q, k, v = qkv(1, 4, 2, 16, 16)
    with pytest.raises(ValueError, match="enable_gqa"):
        tileattn.flex_attention(q, k, v)
    block_mask = create_block_mask(examples.causal, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    # a mask made for other lengths: the exception the installed torch raises (ValueError up to
    # torch 2.14, RuntimeError from 2.15)
    with pytest.raises((ValueError, RuntimeError), match="block_mask") as theirs:
        pytorch_flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    with pytest.raises(type(theirs.value), match="block_mask"):
        tileattn.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    with pytest.raises(ValueError, match="return_lse"):
        tileattn.flex_attention(q, k, v, enable_gqa=True, return_lse=True, return_aux=AuxRequest(lse=True))

    def wrong_index(score, b, h, q_idx, kv_idx):
        return score + table[kv_idx + 100]

    table = torch.zeros(16)
    with pytest.raises(IndexError):
        tileattn.flex_attention(q, k, v, score_mod=wrong_index, enable_gqa=True)


def test_block_map_holds_no_dense_mask():
    """A long document mask's block map holds one byte per block, not q_len x kv_len."""
    from tileattn.programs.blocks import states_of

    length = 4096
    doc_ids = torch.arange(length) * 5 // length
    block_mask = ta_create_block_mask(examples.document(doc_ids), None, None, length, length)
    states = states_of(block_mask)
    assert states.states.numel() == (length // 128) ** 2 and states.counts()["partial"] > 0
