"""What the torch_npu dialect would need from tileattn's core to drop a copy or an extra pass.

Each test is the feature as the dialect would use it, marked ``xfail(strict=True)``: when the core
gains it, the test passes, strict xfail turns that into a failure, and the dialect's workaround
(named in the reason) should be removed with the mark. A gap closed keeps its test here, unmarked
(a mask and a bias with a paged cache).
"""

import pytest
import torch

import tileattn
from tileattn.core.testing import judge

from conftest import skip_unless_supported


@pytest.mark.xfail(strict=True, raises=TypeError, reason=(
    "softmax_max is the row maximum of the masked scores; the engines track it in their online softmax but "
    "return only the LSE, so tileattn.npu computes it from the scores in fp32 (_plan.row_max through "
    "tileattn.core.reference.row_max), an extra Q.K^T pass"))
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sq", [1, 3])
def test_paged_cache_with_a_mask_and_a_bias(backend, dtype, sq):
    """A bool mask and a float bias with a paged cache, indexed by logical key position (0 ..
    max_blocks * block_size - 1): what npu_fused_infer_attention_score passes for atten_mask /
    pse_shift with block_table (it used to gather the pages into a padded cache first). The oracle
    is the same call on the cache gathered by hand, unpaged, in fp64 (FlashAttention's 2x rule)."""
    gen = torch.Generator().manual_seed(sq)
    q = torch.randn(2, sq, 4, 8, generator=gen).to(dtype)  # BSND, GQA 4:2
    pool_k, pool_v = (torch.randn(10, 4, 2, 8, generator=gen).to(dtype) for _ in range(2))
    table = torch.tensor([[7, 2, 9], [0, 5, 3]], dtype=torch.int32)
    used = torch.tensor([11, 6], dtype=torch.int32)
    mask = torch.rand(2, 1, sq, 12, generator=gen) > 0.3
    mask[1, :, :, :6] = False  # sequence 1: every key it has is masked out (output 0, LSE -inf)
    bias = torch.randn(1, 4, sq, 12, generator=gen).to(dtype)
    kwargs = dict(layout="BSND", seqused_k=used, mask=mask, bias=bias, causal=True)
    skip_unless_supported(backend, q, pool_k, pool_v, block_table=table, **kwargs)
    out, lse = tileattn.flash_attention(q, pool_k, pool_v, block_table=table, backend=backend, return_lse=True,
                                        **kwargs)
    k_pad, v_pad = (pool[table.long()].flatten(1, 2) for pool in (pool_k, pool_v))
    want, want_lse = tileattn.reference(q, k_pad, v_pad, compute_dtype=torch.float64, return_lse=True, **kwargs)
    plain = tileattn.reference(q, k_pad, v_pad, **kwargs)
    verdict = judge("out", out, want, plain, dtype)
    assert verdict.ok, str(verdict)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)) and torch.isneginf(lse[1]).all()
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse.double()[finite], want_lse[finite], rtol=1e-3, atol=1e-3)
