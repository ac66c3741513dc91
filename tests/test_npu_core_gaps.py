"""What the torch_npu dialect would need from tileattn's core to drop a copy or an extra pass.

Each test is the feature as the dialect would use it, marked ``xfail(strict=True)``: when the core
gains it, the test passes, strict xfail turns that into a failure, and the dialect's workaround
(named in the reason) should be removed with the mark.
"""

import pytest
import torch

import tileattn


@pytest.mark.xfail(strict=True, raises=TypeError, reason=(
    "softmax_max is the row maximum of the masked scores; the engines track it in their online softmax but "
    "return only the LSE, so tileattn.npu reads it off a second call at a 2**40 score scale "
    "(_plan.row_max), an extra Q.K^T pass (and libm's slow exp on huge negative arguments on CPU)"))
def test_partial_attention_returns_the_row_max():
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    tileattn.attention_partial(q, k, v, causal=True, return_max=True)


@pytest.mark.xfail(strict=True, raises=ValueError, reason=(
    "varlen (TND) calls take no bool mask, so torch_npu's varlen atten_mask (maxSq, maxSkv, read from every "
    "sequence's top-left corner), prefix mode 6 and bands above the diagonal with unequal Sk - Sq are run on "
    "a padded copy of the sequences (_plan.PadIndex)"))
def test_varlen_call_with_a_per_sequence_mask():
    q, k, v = (torch.randn(7, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    mask = torch.rand(4, 4) > 0.3
    tileattn.flash_attention(q, k, v, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, mask=mask)


@pytest.mark.xfail(strict=True, raises=ValueError, reason=(
    "a paged cache takes no mask or bias, so npu_fused_infer_attention_score with atten_mask/pse_shift and "
    "block_table gathers the pages into a padded cache first (inference._gather_pages)"))
def test_paged_cache_with_a_mask():
    q = torch.randn(2, 1, 2, 8)
    pool = torch.randn(4, 4, 2, 8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    tileattn.flash_attention(q, pool, pool, layout="BSND", block_table=table,
                             seqused_k=torch.tensor([5, 8], dtype=torch.int32), mask=torch.ones(2, 1, 1, 8, dtype=torch.bool))
