"""tileattn.flex.blocks: block classification and packed partial masks, judged against the dense mask
evaluated element by element (PyTorch's create_mask, and the block lists read out by plain loops)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from tileattn.flex.examples import MASKS, causal, document, padding
from tileattn.flex import blocks
from tileattn.flex.blocks import EMPTY, FULL, PARTIAL


def lists_truth(block_mask, batch, heads):
    """Dense visibility from the block lists (Python loops) and mask_mod (PyTorch's create_mask)."""
    q_len, kv_len = block_mask.seq_lengths
    bq, bk = block_mask.BLOCK_SIZE
    mask = create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device="cpu")
    visible = torch.zeros(batch, heads, q_len, kv_len, dtype=torch.bool)
    lists = [(block_mask.kv_num_blocks, block_mask.kv_indices, False)]
    if block_mask.full_kv_num_blocks is not None:
        lists.append((block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True))
    for num, idx, full in lists:
        for b in range(batch):
            for h in range(heads):
                nb, nh = b % num.shape[0], h % num.shape[1]  # sizes are 1 or the call's
                for row in range(-(-q_len // bq)):
                    for i in range(int(num[nb, nh, row])):
                        col = int(idx[nb, nh, row, i])
                        rs, cs = slice(row * bq, (row + 1) * bq), slice(col * bk, (col + 1) * bk)
                        visible[b, h, rs, cs] |= True if full else mask[b, h, rs, cs]
    return visible


def check_map(block_map, truth):
    """to_dense() equals the truth and each block's state agrees with its elements."""
    bs, hs = block_map.states.shape[:2]
    assert torch.equal(block_map.to_dense().expand_as(truth), truth)
    truth = truth[:bs, :hs]
    bq, bk = block_map.block_q, block_map.block_kv
    for b in range(bs):
        for h in range(hs):
            for row, col in torch.cartesian_prod(*(torch.arange(n) for n in block_map.states.shape[2:])).tolist():
                tile = truth[b, h, row * bq:(row + 1) * bq, col * bk:(col + 1) * bk]
                expected = EMPTY if not tile.any() else FULL if tile.all() else PARTIAL
                assert int(block_map.states[b, h, row, col]) == expected
                assert (int(block_map.partial[b, h, row, col]) >= 0) == (expected == PARTIAL)
    assert block_map.bits.shape == (block_map.counts()["partial"], bk, -(-bq // 8))


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "vmap"])
def test_classify_pattern_matches_dense_mask(name, compiled):
    q_len, kv_len = 77, 101
    mask_mod = MASKS[name](q_len, kv_len)
    block_mask = create_block_mask(mask_mod, None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=(16, 32))
    block_map = blocks.classify(block_mask, 2, 3, compiled=compiled)
    assert block_map.states.shape[:2] == (1, 1)  # none of these reads b or h: one map serves all
    assert (block_map.how == "compiled") == compiled
    check_map(block_map, create_mask(mask_mod, 1, 1, q_len, kv_len, device="cpu"))


@pytest.mark.parametrize("seed", range(4))
def test_classify_random_block_lists(seed):
    """from_kv_blocks with random partial and full lists (disjoint), broadcast B, per-head lists."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, bq, bk = 2, 3, 8, 16
    q_len, kv_len = 8 * 5 - 3, 16 * 4 - 5
    rows, cols = 5, 4
    draw = torch.randint(0, 3, (1, heads, rows, cols), generator=gen)   # 0 absent, 1 partial, 2 full

    def lists(value):
        chosen = (draw == value).to(torch.int32)
        order = torch.argsort(chosen + torch.rand(chosen.shape, generator=gen) * 0.5, dim=-1, descending=True)
        return chosen.sum(-1, dtype=torch.int32), order.to(torch.int32)

    def stripes(b, h, q_idx, kv_idx):
        return (q_idx * 7 + kv_idx * 3 + h) % 5 != 0

    (num, idx), (full_num, full_idx) = lists(1), lists(2)
    block_mask = BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=(bq, bk), mask_mod=stripes,
                                          seq_lengths=(q_len, kv_len))
    for compiled in (True, False):
        block_map = blocks.classify(block_mask, batch, heads, compiled=compiled)
        assert block_map.states.shape[:2] == (1, heads)
        check_map(block_map, lists_truth(block_mask, batch, heads))


def test_mask_reading_b_is_evaluated_per_sequence():
    """Lists built for b = 0 (B=None) are broadcast, but partial blocks apply mask_mod with each
    sequence's own b, as compiled FlexAttention does (and full blocks, as there, apply nothing)."""
    lengths = torch.tensor([33, 70, 9])
    block_mask = create_block_mask(padding(lengths), None, None, 48, 70, device="cpu", BLOCK_SIZE=16)
    block_map = blocks.classify(block_mask, 3, 2)
    assert block_map.states.shape[:2] == (3, 1)
    check_map(block_map, lists_truth(block_mask, 3, 1))
    dense = block_map.to_dense()
    assert dense[2, 0, :, :32].all()           # full for b = 0 (length 33), so full for every b
    assert not dense[2, 0, :, 32:48].any()     # partial: sequence 2's own length 9 hides it all
    assert dense[1, 0, :, 32:48].all()         # partial: sequence 1's own length 70 shows it all
    assert not dense[1, 0, :, 48:].any()       # empty for b = 0, so skipped for every b


def test_bit_layout_is_key_major_lsb_first():
    block_mask = create_block_mask(causal, None, None, 16, 16, device="cpu", BLOCK_SIZE=16)
    block_map = blocks.classify(block_mask, 1, 1)
    assert block_map.states.tolist() == [[[[PARTIAL]]]] and block_map.bits.shape == (1, 16, 2)
    for j in range(16):
        word = int(block_map.bits[0, j, 0]) | int(block_map.bits[0, j, 1]) << 8
        assert word == sum(1 << r for r in range(16) if r >= j)  # row r sees key j iff r >= j


def test_tail_blocks_are_classified_on_in_range_elements():
    """With lengths not multiples of the block size, PyTorch lists the last blocks as partial; the map
    makes them FULL when every in-range element is visible, and keeps bits past the end 0."""
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, 20, 40, device="cpu",
                                   BLOCK_SIZE=16)
    assert int(block_mask.kv_num_blocks.sum()) > 0  # PyTorch: partial because of the padding
    block_map = blocks.classify(block_mask, 1, 1)
    assert block_map.counts() == {"empty": 0, "partial": 0, "full": 6}


def test_native_create_block_mask(monkeypatch):
    monkeypatch.setattr(blocks, "CHUNK_ELEMENTS", 2048)  # several rows of blocks per (b, h): the chunked path
    doc_ids = torch.tensor([0] * 30 + [1] * 45 + [2] * 25)
    mask_mod = document(doc_ids)
    ours = blocks.create_block_mask(mask_mod, None, 2, 100, 100, BLOCK_SIZE=(16, 8))
    theirs = create_block_mask(mask_mod, None, 2, 100, 100, device="cpu", BLOCK_SIZE=(16, 8))
    assert isinstance(ours, BlockMask) and ours.shape == theirs.shape and ours.BLOCK_SIZE == (16, 8)
    assert torch.equal(ours.to_dense(), theirs.to_dense())  # the same non-empty blocks
    block_map = blocks.classify(ours, 4, 2)
    assert blocks.classify(ours, 4, 2) is block_map  # cached on the mask
    check_map(block_map, create_mask(mask_mod, 1, 2, 100, 100, device="cpu"))
    check_map(blocks.classify(theirs, 4, 2), create_mask(mask_mod, 1, 2, 100, 100, device="cpu"))


def test_cache_guard_sees_changed_inputs():
    doc_ids = torch.tensor([0] * 20 + [1] * 28)
    block_mask = create_block_mask(document(doc_ids), None, None, 48, 48, device="cpu", BLOCK_SIZE=16)
    first = blocks.classify(block_mask, 1, 1)
    assert blocks.classify(block_mask, 1, 1) is first
    doc_ids[20:] = 0  # the captured tensor changes in place: the partial bits must be recomputed
    second = blocks.classify(block_mask, 1, 1)
    assert second is not first
    check_map(second, lists_truth(block_mask, 1, 1))
    block_mask.mask_mod = causal
    third = blocks.classify(block_mask, 1, 1)
    assert third is not second
    check_map(third, lists_truth(block_mask, 1, 1))


def test_sliced_block_mask():
    """A sliced mask must get its mask_mod back (PyTorch's rule); decode-style slicing then works."""
    block_mask = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    sliced = block_mask[:, :, [2]]
    with pytest.raises(RuntimeError, match="sliced"):
        blocks.classify(sliced, 1, 1)
    offset = 40

    def shifted(b, h, q_idx, kv_idx):
        return causal(b, h, q_idx + offset, kv_idx)

    sliced.mask_mod, sliced.seq_lengths = shifted, (1, 64)
    block_map = blocks.classify(sliced, 1, 1)
    check_map(block_map, lists_truth(sliced, 1, 1))
    assert block_map.to_dense()[0, 0, 0].tolist() == [j <= offset for j in range(64)]


def test_classify_errors():
    with pytest.raises(TypeError, match="BlockMask"):
        blocks.classify(torch.ones(2, 2, dtype=torch.bool), 1, 1)
    block_mask = create_block_mask(causal, 2, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="B=2"):
        blocks.classify(block_mask, 3, 1)
    with pytest.raises(ValueError, match="Q_LEN"):
        blocks.create_block_mask(causal, 1, 1, 0, 8)
