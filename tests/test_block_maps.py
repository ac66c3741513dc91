"""Block maps (tileattn.programs.blocks) and the kernels reading them: the native engine's visibility of
a BlockMask (hidden blocks skipped, full blocks without the mask_mod, partial blocks with it) judged
against the dense mask evaluated element by element (PyTorch's create_mask, and the block lists read
out by plain loops)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

import tileattn
from tileattn.flex.examples import MASKS, causal, document, padding
from tileattn.programs import blocks
from tileattn.programs.blocks import HIDDEN, PARTIAL, VISIBLE


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


def kernel_visibility(block_mask, batch, heads):
    """Which (row, key) pairs the native kernels let through for ``block_mask``: an attention whose
    values are one-hot keys, so each output row is the softmax weight per key (0 where hidden)."""
    q_len, kv_len = block_mask.seq_lengths
    q = torch.zeros(batch, heads, q_len, 8)
    k = torch.zeros(batch, heads, kv_len, 8)
    v = torch.eye(kv_len).expand(batch, heads, kv_len, kv_len)
    assert tileattn.explain(q, k, v, block_mask=block_mask, align="top_left")["native"] == []
    weights = tileattn.flash_attention(q, k, v, block_mask=block_mask, align="top_left")
    return weights > 0


def check_kernels(block_mask, truth):
    batch, heads = truth.shape[:2]
    assert torch.equal(kernel_visibility(block_mask, batch, heads), truth)


def check_states(block_mask, batch, heads):
    """The map's states are the block lists read by loops: listed full VISIBLE, listed partial PARTIAL."""
    states = blocks.states_of(block_mask)
    num, idx = block_mask.kv_num_blocks, block_mask.kv_indices
    rows, cols = blocks.block_grid(block_mask)
    expected = torch.zeros(*num.shape[:2], rows, cols, dtype=torch.uint8)
    for lists, value in ((( num, idx), PARTIAL), ((block_mask.full_kv_num_blocks, block_mask.full_kv_indices), VISIBLE)):
        if lists[0] is None:
            continue
        for b in range(num.shape[0]):
            for h in range(num.shape[1]):
                for row in range(rows):
                    for i in range(int(lists[0][b, h, row])):
                        expected[b, h, row, int(lists[1][b, h, row, i])] = value
    assert torch.equal(states.states, expected)


@pytest.mark.parametrize("name", sorted(MASKS))
def test_patterns_from_pytorch_create_block_mask(name):
    q_len, kv_len = 77, 101
    mask_mod = MASKS[name](q_len, kv_len)
    block_mask = create_block_mask(mask_mod, None, None, q_len, kv_len, device="cpu", BLOCK_SIZE=(16, 32))
    check_states(block_mask, 2, 3)
    check_kernels(block_mask, lists_truth(block_mask, 2, 3))


@pytest.mark.parametrize("seed", range(4))
def test_random_block_lists(seed):
    """Block lists made at random (not from the mask): the lists decide, the mask_mod refines partial
    blocks only; B and H broadcast or per sequence and head."""
    gen = torch.Generator().manual_seed(seed)
    batch, heads, q_len, kv_len, bq, bk = 2, 3, 50, 70, 16, 8
    rows, cols = -(-q_len // bq), -(-kv_len // bk)
    bm_b, bm_h = (1, heads) if seed % 2 else (batch, 1)
    states = torch.randint(0, 3, (bm_b, bm_h, rows, cols), generator=gen)
    (num, idx), (fnum, fidx) = blocks._lists(states, PARTIAL), blocks._lists(states, VISIBLE)
    mask_mod = document(torch.arange(kv_len) // 11)
    block_mask = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=(bq, bk), mask_mod=mask_mod,
                                          seq_lengths=(q_len, kv_len))
    check_states(block_mask, batch, heads)
    check_kernels(block_mask, lists_truth(block_mask, batch, heads))


def test_mask_reading_b_is_evaluated_per_sequence():
    """Lists built for b = 0 (B=None) are broadcast, but partial blocks apply mask_mod with each
    sequence's own b, as compiled FlexAttention does (and full blocks, as there, apply nothing)."""
    lengths = torch.tensor([33, 70, 9])
    block_mask = create_block_mask(padding(lengths), None, None, 48, 70, device="cpu", BLOCK_SIZE=16)
    seen = kernel_visibility(block_mask, 3, 1)
    assert torch.equal(seen, lists_truth(block_mask, 3, 1))
    assert seen[2, 0, :, :32].all()           # full for b = 0 (length 33), so full for every b
    assert not seen[2, 0, :, 32:48].any()     # partial: sequence 2's own length 9 hides it all
    assert seen[1, 0, :, 32:48].all()         # partial: sequence 1's own length 70 shows it all
    assert not seen[1, 0, :, 48:].any()       # hidden for b = 0, so skipped for every b


def test_tail_blocks_are_partial_only_where_pytorch_lists_them():
    """With lengths not multiples of the block size PyTorch lists the last blocks as partial; their
    out-of-range elements never count."""
    block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= 0, None, None, 20, 40, device="cpu",
                                   BLOCK_SIZE=16)
    assert int(block_mask.kv_num_blocks.sum()) > 0  # PyTorch: partial because of the padding
    assert kernel_visibility(block_mask, 1, 1).all()


def test_our_create_block_mask_matches_pytorch(monkeypatch):
    monkeypatch.setattr(blocks, "CHUNK_ELEMENTS", 2048)  # several rows of blocks per (b, h): the chunked path
    doc_ids = torch.tensor([0] * 30 + [1] * 45 + [2] * 25)
    mask_mod = document(doc_ids)
    ours = blocks.create_block_mask(mask_mod, None, 2, 100, 100, BLOCK_SIZE=(16, 8))
    theirs = create_block_mask(mask_mod, None, 2, 100, 100, device="cpu", BLOCK_SIZE=(16, 8))
    assert isinstance(ours, BlockMask) and ours.shape == theirs.shape and ours.BLOCK_SIZE == (16, 8)
    assert torch.equal(ours.to_dense(), theirs.to_dense())  # the same non-empty blocks
    assert blocks.states_of(ours) is blocks.states_of(ours)  # cached on the mask
    truth = create_mask(mask_mod, 1, 2, 100, 100, device="cpu").expand(4, 2, 100, 100)
    check_kernels(ours, truth)
    check_kernels(theirs, truth)
    assert blocks.states_of(ours).counts()["partial"] < int((blocks.states_of(theirs).states == PARTIAL).sum()) + 1


def test_the_cached_map_follows_the_lists():
    block_mask = create_block_mask(causal, None, None, 48, 48, device="cpu", BLOCK_SIZE=16)
    first = blocks.states_of(block_mask)
    assert blocks.states_of(block_mask) is first
    block_mask.kv_num_blocks[..., 2] = 0  # the lists change in place: the map is read again
    second = blocks.states_of(block_mask)
    assert second is not first and int((second.states == PARTIAL).sum()) == int((first.states == PARTIAL).sum()) - 1
    check_kernels(block_mask, lists_truth(block_mask, 1, 1))


def test_sliced_block_mask():
    """A sliced mask must get its mask_mod back (PyTorch's rule); decode-style slicing then works."""
    block_mask = create_block_mask(causal, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    sliced = block_mask[:, :, [2]]
    q, k, v = torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 64, 8), torch.eye(64).expand(1, 1, 64, 64)
    with pytest.raises(RuntimeError, match="sliced"):
        tileattn.flash_attention(q, k, v, block_mask=sliced)
    offset = 40

    def shifted(b, h, q_idx, kv_idx):
        return causal(b, h, q_idx + offset, kv_idx)

    sliced.mask_mod, sliced.seq_lengths = shifted, (1, 64)
    weights = tileattn.flash_attention(q, k, v, block_mask=sliced, align="top_left")
    assert (weights[0, 0, 0] > 0).tolist() == [j <= offset for j in range(64)]


def test_errors():
    q, k, v = torch.zeros(3, 1, 32, 8), torch.zeros(3, 1, 32, 8), torch.zeros(3, 1, 32, 8)
    with pytest.raises(TypeError, match="BlockMask"):
        tileattn.flash_attention(q, k, v, block_mask=torch.ones(2, 2, dtype=torch.bool))
    block_mask = create_block_mask(causal, 2, None, 32, 32, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="B=2"):
        tileattn.flash_attention(q, k, v, block_mask=block_mask)
    with pytest.raises(ValueError, match="Q_LEN"):
        tileattn.flex.create_block_mask(causal, 1, 1, 0, 8)
