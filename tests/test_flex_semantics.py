"""tileattn.flex.semantics: the exact FlexAttention reference, against PyTorch's own flex_attention
(eager, on CPU) and against dense attention written out by hand (for gradients, which PyTorch's CPU
FlexAttention does not have)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import flex_attention as torch_flex
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, noop_mask

import tileattn
from tileattn.flex.examples import MASKS, causal, document, relative_bias, score_mods
from tileattn.flex.semantics import flex_reference

TOL = {torch.float32: 5e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2}


@pytest.fixture
def pytorch_flex(monkeypatch):
    """PyTorch's flex_attention, eager (its math implementation) without the per-call dynamo trace."""
    monkeypatch.setattr(torch_flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")
    return torch_flex.flex_attention


def qkv(batch, heads_q, heads_kv, q_len, kv_len, dim=16, dim_v=None, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads_q, q_len, dim), (batch, heads_kv, kv_len, dim), (batch, heads_kv, kv_len, dim_v or dim)]
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


CASES = [  # (mask, score_mod, batch, heads_q, heads_kv, q_len, kv_len)
    ("causal", "alibi", 2, 4, 2, 37, 53),
    ("sliding_window", "softcap", 1, 2, 2, 64, 64),
    ("prefix_lm", "relative_bias", 2, 2, 1, 45, 45),
    ("document", "head_scales", 1, 4, 4, 70, 70),
    ("dilated_window", None, 1, 2, 2, 33, 50),
    ("natten", "t5_bias", 1, 2, 2, 64, 64),
    ("sink_tokens", "alibi", 2, 2, 2, 29, 61),
    (None, "relative_bias", 1, 3, 1, 17, 40),
]


@pytest.mark.parametrize("mask_name,score_name,batch,hq,hkv,q_len,kv_len", CASES)
def test_reference_matches_pytorch_eager(pytorch_flex, mask_name, score_name, batch, hq, hkv, q_len, kv_len):
    q, k, v = qkv(batch, hq, hkv, q_len, kv_len, dim_v=12)
    score_mod = score_mods(hq, q_len, kv_len)[score_name][0] if score_name else None
    block_mask = (create_block_mask(MASKS[mask_name](q_len, kv_len), batch, None, q_len, kv_len, device="cpu",
                                    BLOCK_SIZE=16) if mask_name else None)
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, enable_gqa=hq != hkv, return_aux=AuxRequest(lse=True))
    out, aux = pytorch_flex(q, k, v, **kwargs)
    ref, ref_aux = flex_reference(q, k, v, **kwargs)
    assert ref.dtype == out.dtype and ref_aux.lse.dtype == aux.lse.dtype
    torch.testing.assert_close(ref, out, atol=TOL[torch.float32], rtol=0)
    torch.testing.assert_close(ref_aux.lse, aux.lse, atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_reference_dtypes_match_pytorch(pytorch_flex, dtype):
    """Scores are modified in float32 (float64 for float64 inputs) and probabilities rounded to the
    input dtype before @ v, exactly as PyTorch does."""
    q, k, v = qkv(2, 2, 2, 31, 47, dtype=dtype)
    block_mask = create_block_mask(MASKS["sliding_window"](31, 47), None, None, 31, 47, device="cpu", BLOCK_SIZE=16)
    score_mod = score_mods(2, 31, 47)["relative_bias"][0]
    out, lse = pytorch_flex(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    ref, ref_lse = flex_reference(q, k, v, score_mod=score_mod, block_mask=block_mask, return_lse=True)
    assert ref.dtype == dtype and ref_lse.dtype == lse.dtype
    torch.testing.assert_close(ref, out, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(ref_lse, lse, atol=TOL[torch.float32], rtol=0)


def test_reference_matches_pytorch_default_eager_path():
    """The same answer as flex_attention's default eager route (traced by dynamo each call)."""
    q, k, v = qkv(1, 2, 2, 24, 24)
    block_mask = create_block_mask(causal, None, None, 24, 24, device="cpu", BLOCK_SIZE=8)
    score_mod = score_mods(2, 24, 24)["softcap"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch_flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    torch.testing.assert_close(flex_reference(q, k, v, score_mod=score_mod, block_mask=block_mask), out,
                               atol=TOL[torch.float32], rtol=0)


def _dense_attention(q, k, v, scale, bias, keep):
    """Plain attention with an additive bias and a keep mask, broadcast over (B, H, L, S)."""
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-2, -1)) * scale + bias
    s = s.masked_fill(~keep, -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def test_reference_gradients_with_captured_table():
    """Gradients of q, k, v and of the captured bias table match dense autograd (float64)."""
    q_len = kv_len = 40
    q, k, v = (t.requires_grad_() for t in qkv(2, 4, 2, q_len, kv_len, dtype=torch.float64))
    table = torch.randn(4, q_len + kv_len - 1, dtype=torch.float64, requires_grad=True)
    doc_ids = torch.arange(q_len) * 3 // q_len
    block_mask = create_block_mask(document(doc_ids), None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=16)
    out = flex_reference(q, k, v, score_mod=relative_bias(table, kv_len), block_mask=block_mask, enable_gqa=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, table), dout)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, table)]
    i, j = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    bias = leaves[3][:, i - j + kv_len - 1].unsqueeze(0)
    keep = (doc_ids[i] == doc_ids[j]) & (i >= j)
    expected_out = _dense_attention(*leaves[:3], 1 / math.sqrt(16), bias, keep)
    expected = torch.autograd.grad(expected_out, leaves, dout)
    torch.testing.assert_close(out, expected_out, atol=1e-12, rtol=0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-11, rtol=0)


def test_reference_gradients_through_lse():
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 12, 20, dtype=torch.float64))
    scales = torch.tensor([0.7, 1.3], dtype=torch.float64, requires_grad=True)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * scales[h]

    _, lse = flex_reference(q, k, v, score_mod=score_mod, return_lse=True)
    grads = torch.autograd.grad(lse.sum(), (q, k, scales))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, scales)]
    s = (leaves[0] @ leaves[1].transpose(-2, -1)) / 4 * leaves[2].view(1, 2, 1, 1)
    expected = torch.autograd.grad(torch.logsumexp(s, -1).sum(), leaves)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_empty_rows(pytorch_flex):
    """A query that sees no key gets output 0 and LSE -inf (mask_mod or score_mod -inf alike), and
    finite zero gradients."""
    q, k, v = (t.requires_grad_() for t in qkv(1, 2, 2, 20, 20, dtype=torch.float64))

    def upper(b, h, q_idx, kv_idx):
        return kv_idx > q_idx

    block_mask = create_block_mask(upper, None, None, 20, 20, device="cpu", BLOCK_SIZE=8)
    out, lse = flex_reference(q, k, v, block_mask=block_mask, return_lse=True)
    assert torch.equal(out[:, :, -1], torch.zeros_like(out[:, :, -1]))
    assert torch.isneginf(lse[:, :, -1]).all() and torch.isfinite(lse[:, :, :-1]).all()
    expected, expected_lse = pytorch_flex(*(t.detach() for t in (q, k, v)), block_mask=block_mask, return_lse=True)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=1e-12, rtol=0)
    grads = torch.autograd.grad((out.sum() + lse[:, :, :-1].sum()), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :, -1], torch.zeros_like(grads[0][:, :, -1]))

    def hide_upper(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx > q_idx, score, -math.inf)

    out2, aux = flex_reference(q, k, v, score_mod=hide_upper, return_aux=AuxRequest(lse=True, max_scores=True))
    torch.testing.assert_close(out2, out, atol=1e-12, rtol=0)
    assert torch.isneginf(aux.lse[:, :, -1]).all() and torch.isneginf(aux.max_scores[:, :, -1]).all()


def test_block_lists_are_semantic():
    """Blocks missing from a BlockMask are skipped even where mask_mod is true (what compiled
    FlexAttention does; PyTorch's eager path ignores the lists and applies mask_mod alone)."""
    q, k, v = qkv(1, 2, 2, 32, 32)
    diagonal = torch.arange(2, dtype=torch.int32).view(1, 1, 2, 1)
    block_mask = BlockMask.from_kv_blocks(torch.ones(1, 1, 2, dtype=torch.int32), diagonal, BLOCK_SIZE=16,
                                          seq_lengths=(32, 32))
    keep = torch.zeros(32, 32, dtype=torch.bool)
    keep[:16, :16] = keep[16:, 16:] = True
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    torch.testing.assert_close(flex_reference(q, k, v, block_mask=block_mask), expected, atol=1e-6, rtol=0)
    full = BlockMask.from_kv_blocks(torch.zeros(1, 1, 2, dtype=torch.int32), diagonal,
                                    torch.ones(1, 1, 2, dtype=torch.int32), diagonal, BLOCK_SIZE=16,
                                    mask_mod=lambda b, h, q_idx, kv_idx: q_idx < 0, seq_lengths=(32, 32))
    torch.testing.assert_close(flex_reference(q, k, v, block_mask=full), expected, atol=1e-6, rtol=0)


def test_batch_broadcast_key_and_block_mask(pytorch_flex):
    """Key/value with batch 1 serve a query batch when the block mask carries the batch."""
    q, _, _ = qkv(3, 2, 2, 24, 24)
    _, k, v = qkv(1, 2, 2, 24, 24, seed=1)
    lengths = torch.tensor([24, 10, 5])
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < lengths[b], 3, None, 24, 24, device="cpu",
                                   BLOCK_SIZE=8)
    torch.testing.assert_close(flex_reference(q, k, v, block_mask=block_mask),
                               pytorch_flex(q, k, v, block_mask=block_mask), atol=TOL[torch.float32], rtol=0)


def test_scale_head_dims_and_kernel_options(pytorch_flex):
    q, k, v = qkv(1, 2, 2, 9, 13, dim=8, dim_v=5)
    out = flex_reference(q, k, v, scale=0.3, kernel_options={"BLOCK_M": 64, "PRESCALE_QK": True})
    torch.testing.assert_close(out, pytorch_flex(q, k, v, scale=0.3), atol=TOL[torch.float32], rtol=0)
    assert out.shape == (1, 2, 9, 5)
    oracle = flex_reference(q, k, v, scale=0.3, compute_dtype=torch.float64)
    assert oracle.dtype == torch.float64
    torch.testing.assert_close(out.double(), oracle, atol=1e-5, rtol=0)


@pytest.mark.parametrize("change,exc,words", [
    (dict(enable_gqa=False, hkv=1), ValueError, "enable_gqa"),
    (dict(enable_gqa=True, hkv=3), ValueError, "divisor"),
    (dict(return_lse=True, return_aux=AuxRequest(lse=True)), ValueError, "return_aux"),
    (dict(kernel_options={"BACKEND": "CUDNN"}), ValueError, "BACKEND"),
    (dict(kernel_options={"OUTPUT_LOGSUMEXP": True}), ValueError, "OUTPUT_LOGSUMEXP"),
    (dict(kernel_options={"BACKEND": "AUTO", "FORCE_USE_FLEX_ATTENTION": True}), RuntimeError, "BACKEND"),
    (dict(key_dtype=torch.float64), ValueError, "dtype"),
    (dict(three_d=True), NotImplementedError, "4-D"),
    (dict(key_batch=2), ValueError, "batch"),
])
def test_validation_errors(change, exc, words):
    q, k, v = qkv(1, 4, change.pop("hkv", 4), 8, 8)
    if change.pop("key_dtype", None):
        k = k.double()
    if change.pop("three_d", False):
        q = q[0]
    if change.pop("key_batch", None):
        k, v = k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)
    with pytest.raises(exc, match=words):
        flex_reference(q, k, v, **change)


def test_block_mask_errors(pytorch_flex):
    q, k, v = qkv(2, 2, 2, 40, 40)
    block_mask = create_block_mask(causal, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    # A mask longer than the call: the exception the installed torch raises (ValueError up to 2.14,
    # RuntimeError from 2.15), pointing at _adjust.
    with pytest.raises((ValueError, RuntimeError), match="_adjust") as theirs:
        pytorch_flex(q[:, :, :30], k, v, block_mask=block_mask)
    with pytest.raises(type(theirs.value), match="_adjust"):
        flex_reference(q[:, :, :30], k, v, block_mask=block_mask)
    with pytest.raises(RuntimeError, match="sliced"):
        flex_reference(q, k, v, block_mask=block_mask[:, :, :2])
    three = create_block_mask(causal, 3, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="B of 1 or the batch size"):
        flex_reference(q, k, v, block_mask=three)
    num, idx = torch.ones(1, 1, 3, dtype=torch.int32), torch.full((1, 1, 3, 1), 5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"indices in \[0, 3\)"):
        flex_reference(q, k, v, block_mask=BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, seq_lengths=(40, 40),
                                                                     compute_q_blocks=False))
    zero = torch.zeros(1, 1, 3, 1, dtype=torch.int32)
    both = BlockMask.from_kv_blocks(num, zero, num, zero, BLOCK_SIZE=16, seq_lengths=(40, 40), mask_mod=noop_mask,
                                    compute_q_blocks=False)
    with pytest.raises(ValueError, match="both as partial"):
        flex_reference(q, k, v, block_mask=both)


def test_messages_start_with_pytorchs_own_words(pytorch_flex):
    """Code that matches on PyTorch's messages keeps working: return_lse with return_aux, and a block
    mask made for other lengths (shorter and longer), raise what the installed torch raises and begin
    with its own text (the mask's lengths: ValueError up to torch 2.14, RuntimeError from 2.15)."""
    q, k, v = qkv(1, 2, 2, 40, 40)
    block_mask = create_block_mask(causal, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    length_error = RuntimeError if tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 15) else ValueError
    cases = [(q, dict(return_lse=True, return_aux=AuxRequest(lse=True)), ValueError),
             (q[:, :, :30], dict(block_mask=block_mask), length_error),
             (torch.cat([q, q], 2), dict(block_mask=block_mask), length_error)]
    for query, kwargs, error in cases:
        with pytest.raises(error) as theirs:
            pytorch_flex(query, k, v, **kwargs)
        assert type(theirs.value) is error
        for ours in (flex_reference, tileattn.flex_attention):
            with pytest.raises(error) as mine:
                ours(query, k, v, **kwargs)
            assert type(mine.value) is error
            first = str(theirs.value).split(". ")[0]
            assert str(mine.value).startswith(first), (str(mine.value), first)
