"""The single-process parts of context parallelism: token placement, load balance, the calls a ring
step makes, the LSE merge helpers, and errors raised before any communication."""

from __future__ import annotations

import math

import pytest
import torch

import tileattn
import tileattn.distributed as cp
from tileattn.distributed import model
from tileattn.distributed.agreement import check_lengths
from tileattn.distributed.plan import ShardPlan, local_lengths, split_sizes
from tileattn.distributed.ring import plan_calls
from tileattn.core.modifiers import Band


def test_zigzag_places_chunks_r_and_2w_minus_1_minus_r():
    assert cp.zigzag_chunks(16, 2, 0) == [(0, 4), (12, 4)]
    assert cp.zigzag_chunks(16, 2, 1) == [(4, 4), (8, 4)]
    assert cp.zigzag_chunks(16, 2, 1, load_balance=False) == [(8, 8)]
    # Uneven: sizes differ by at most one, the first chunks longer; a short sequence leaves chunks empty.
    assert split_sizes(37, 4) == [10, 9, 9, 9]
    assert cp.zigzag_chunks(37, 2, 0) == [(0, 10), (28, 9)]
    assert cp.zigzag_chunks(3, 4, 3) == [(3, 0), (3, 0)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("load_balance", [True, False])
@pytest.mark.parametrize("lengths", [(64,), (37,), (5,), (13, 40, 3, 24, 0)])
def test_every_token_is_held_exactly_once(world, load_balance, lengths):
    plan = (ShardPlan.build(world, load_balance, seq_len=lengths[0]) if len(lengths) == 1
            else ShardPlan.build(world, load_balance, cu_seqlens=[0, *torch.tensor(lengths).cumsum(0).tolist()]))
    held = plan.global_index(range(world))
    assert sorted(held.tolist()) == list(range(sum(lengths)))
    assert sum(plan.local_len(r) for r in range(world)) == sum(lengths)
    for r in range(world):
        pos = plan.positions(r)
        assert pos.numel() == plan.local_len(r)
        assert all(0 <= p < max(lengths) for p in pos.tolist())
    sizes = [plan.local_len(r) for r in range(world)]
    assert max(sizes) - min(sizes) <= (2 if load_balance else 1) * len(lengths)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("load_balance", [True, False])
def test_local_lengths_of_many_sequence_lengths_at_once_are_the_plans(world, load_balance):
    table = local_lengths(torch.arange(100), world, load_balance)
    for s in range(100):
        plan = ShardPlan.build(world, load_balance, seq_len=s)
        assert table[s].tolist() == [plan.local_len(r) for r in range(world)]


@pytest.mark.parametrize("world, load_balance, seq_len, wrong, message", [
    (4, True, 16, {3: 5}, "got 5 local tokens on CP rank 3; expected 4: the shard of a sequence of 16 tokens"),
    (4, True, 16, {2: 3}, "got 3 local tokens on CP rank 2; expected 4: the shard of a sequence of 16 tokens"),
    (8, True, 37, {2: 9, 6: 1}, "got 9 local tokens on CP rank 2 and 1 local tokens on CP rank 6; expected 5 and 4: "
                                "the shards of a sequence of 37 tokens"),
    (4, False, 16, {1: 7}, "got 7 local tokens on CP rank 1; expected 4: the shard of a sequence of 16 tokens"),
    # Two sequence lengths fit ranks 0 and 2 equally well: both are said.
    (3, True, 20, {1: 0}, "got 0 local tokens on CP rank 1; expected 6 or 7: the shard of a sequence of 19 or 20 "
                          "tokens"),
])
def test_a_shard_that_does_not_fit_is_blamed_not_the_first_rank_that_differs(world, load_balance, seq_len, wrong,
                                                                             message):
    """The sequence length is the one most shards fit: the ranks named are those whose shard is wrong
    (a plan of the summed lengths would blame rank 0 in most of these)."""
    plan = ShardPlan.build(world, load_balance, seq_len=seq_len)
    lengths = [wrong.get(r, plan.local_len(r)) for r in range(world)]
    with pytest.raises(ValueError) as info:
        check_lengths(lengths, world, load_balance)
    assert f"tileattn: argument 'q': {message}, which the other ranks' shards imply" in str(info.value), \
        str(info.value)
    assert check_lengths([plan.local_len(r) for r in range(world)], world, load_balance) == plan


def test_shards_of_no_one_sequence_name_every_rank_with_what_it_fits():
    with pytest.raises(ValueError, match=r"got 8 local tokens on CP rank 0 and 9 local tokens on CP rank 1; "
                                         r".*CP rank 0's 8 tokens fit a sequence of 16 tokens; "
                                         r"CP rank 1's 9 tokens fit a sequence of 18 tokens"):
        check_lengths([8, 9], 2, True)


@pytest.mark.parametrize("ring, ulysses", [(2, 2), (2, 4), (4, 2)])
def test_hybrid_ring_rank_holds_the_ring_level_zigzag(ring, ulysses):
    """The world-level zigzag, grouped by Ulysses group, is the ring-level zigzag: the outer ring of
    a hybrid mesh is balanced exactly as plain ring attention is."""
    s = 16 * ring * ulysses
    world_plan = ShardPlan.build(ring * ulysses, True, seq_len=s)
    ring_plan = ShardPlan.build(ring, True, seq_len=s)
    for i in range(ring):
        got = [(r.pos, r.length) for r in world_plan.runs(range(i * ulysses, (i + 1) * ulysses))]
        assert got == [(r.pos, r.length) for r in ring_plan.runs([i])]


def _causal_work(world, load_balance, s=64):
    plan = ShardPlan.build(world, load_balance, seq_len=s)
    band = Band.from_args(True, None)
    work, calls = [], []
    for r in range(world):
        total, n = 0, []
        for src in range(world):
            step = plan_calls(plan.runs([r]), plan.runs([src]), band, 0, False, False, "cpu")
            n.append(len(step))
            for c in step:
                lq, lk = c.q.stop - c.q.start, c.k.stop - c.k.start
                total += band.visible_pairs(lq, lk, c.off) if c.band else lq * lk
        work.append(total)
        calls.append(n)
    return work, calls


def test_zigzag_balances_causal_work_and_needs_one_call_per_remote_step():
    work, calls = _causal_work(4, True)
    assert len(set(work)) == 1 and sum(work) == 64 * 65 // 2
    # Own block: two diagonal chunks and one full pair (one diagonal for the middle rank, whose two
    # chunks touch); every other block: one call.
    assert calls == [[3, 1, 1, 1], [1, 3, 1, 1], [1, 1, 3, 1], [1, 1, 1, 1]], calls
    work, _ = _causal_work(4, False)
    assert sum(work) == 64 * 65 // 2 and work[-1] > 6 * work[0]


def test_merge_helpers_match_merge_attentions_and_keep_empty_rows_empty():
    gen = torch.Generator().manual_seed(0)
    outs = [torch.randn(2, 3, 5, 4, generator=gen) for _ in range(3)]
    lses = [torch.randn(2, 3, 5, generator=gen) * 20 for _ in range(3)]
    for l in lses:
        l[0, 0, 0] = -math.inf  # a row no part sees
    lses[1][1, 2, 3] = -math.inf
    want_out, want_lse = tileattn.merge_attentions(outs, lses)
    out, lse = torch.zeros_like(outs[0]), torch.full_like(lses[0], -math.inf)
    for o, l in zip(outs, lses):
        cp.merge_into(out, lse, o, l)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    assert (out[0, 0, 0] == 0).all() and torch.isneginf(lse[0, 0, 0])
    sinks = torch.tensor([0.5, -3.0, 2.0])
    want_out, want_lse = tileattn.merge_attentions([out, torch.zeros_like(out)],
                                                   [lse, sinks.view(1, 3, 1).expand_as(lse)])
    cp.merge_sink(out, lse, sinks)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


def test_calls_without_a_process_group_or_with_unsupported_arguments_fail_clearly():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(NotImplementedError, match="argument 'dropout_p'.*no dropout"):
        cp.context_parallel_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="argument 'block_table'"):
        cp.context_parallel_attention(q, q, q, block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="argument 'k'.*Sq == Sk"):
        cp.context_parallel_attention(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(ValueError, match="argument 'mode'"):
        cp.context_parallel_attention(q, q, q, mode="stripe")
    with pytest.raises(RuntimeError, match="argument 'group'.*init_process_group"):
        cp.context_parallel_attention(q, q, q)
    with pytest.raises(ValueError, match="argument 'timeout'"):
        cp.comm.resolve_timeout(0)


def test_block_kind_says_how_a_chunk_pair_runs():
    # Zigzag, 2 ranks, 16 tokens: chunks of 4 at 0, 4, 8, 12.
    assert cp.block_kind(0, 4, 0, 4, causal=True) == ("partial", 0)
    assert cp.block_kind(12, 4, 4, 4, causal=True) == ("full", 8)
    assert cp.block_kind(0, 4, 12, 4, causal=True) == ("skip", -12)
    assert cp.block_kind(12, 4, 4, 4) == ("full", 8)
    assert cp.block_kind(12, 4, 4, 4, causal=True, window=(5, 0)) == ("partial", 8)
    assert cp.block_kind(12, 4, 0, 4, causal=True, window=(5, 0)) == ("skip", 12)


def test_traffic_model_counts_what_the_ring_and_ulysses_send():
    """The model's bytes for the shapes the tests count (the benchmark checks larger ones)."""
    s = model.Shape(64, 4, 2, 16, batch=2, elem_bytes=4)
    block = 2 * 2 * 32 * 2 * 16  # k and v of one rank: batch 2, 32 tokens, 2 kv heads, dim 16
    assert model.ring_bytes(s, 2, backward=False) == block * 4
    assert model.ring_bytes(s, 2) == block * 4 * 2 + 2 * block * 4
    # Ulysses on 4 ranks: 2 kv heads are repeated to 4; each all-to-all keeps 1/4 at home.
    local = 2 * 16 * 16 * 4
    assert model.ulysses_bytes(s, 4, backward=False) == (2 * 4 + 2 * 4) * local * 3 / 4
    llama = model.Shape(131072, 32, 8, 128)
    assert model.ring_hides_transfer_from(llama, 400e12, 50e9) == 4000
    assert model.ulysses_beats_ring_from(llama) == 8
    assert model.forward_time(llama, "ulysses", 64) is None  # more ranks than heads
