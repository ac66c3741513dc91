"""The CPU engine's speed paths: the rarely moving reference maximum and its careful step, band
zeroing on the diagonals, augmented GEMM operands, and the single-threaded workers. Each must keep
the accuracy rule and the engine's guarantees (bitwise reproducibility, untouched inputs)."""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn.backends.cpu import TileConfig, kernels
from tileattn.backends.cpu.parallel import run_tasks

from conftest import assert_matches_reference, make_qkv


@pytest.fixture
def small_tiles():
    """Tiles much smaller than the sequences, with block_m != block_n, so every tile kind occurs."""
    cpu = tileattn.get_backend("cpu")
    cpu.config_override = TileConfig(block_m=24, block_n=40)
    yield
    cpu.config_override = None


def test_growing_rows_take_the_careful_step_and_stay_exact(small_tiles, monkeypatch):
    # Logits that grow by more than 2^127 across key blocks overflow any reference kept from the
    # first tile: the tiles where rows grow are redone with their row maximum.
    q, k, v = make_qkv(b=1, hq=2, sq=50, sk=130, d=16, seed=4)
    k = k * torch.linspace(0.1, 6.0, 130).view(1, 1, 130, 1)
    grew = []
    real = kernels._careful_step

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        grew.append(result[2])
        return result

    monkeypatch.setattr(kernels, "_careful_step", spy)
    assert_matches_reference("cpu", q * 6, k, v, return_lse=True)
    assert any(grew), "no row grew: the careful step after the first tile was not exercised"


@pytest.mark.parametrize("window", [(7, 0), (30, 11), (None, 0), (0, None)])
@pytest.mark.parametrize("sq, sk", [(70, 70), (45, 100), (100, 45)])
def test_band_edges_on_unaligned_tiles(small_tiles, window, sq, sk):
    q, k, v = make_qkv(b=1, hq=4, hkv=2, sq=sq, sk=sk, d=16, seed=5)
    assert_matches_reference("cpu", q, k, v, window=window, return_lse=True)


def test_modifiers_take_the_unfolded_path(small_tiles):
    q, k, v = make_qkv(b=1, hq=2, sq=60, sk=90, d=16, seed=6)
    bias = torch.randn(1, 2, 60, 90, requires_grad=True)
    assert_matches_reference("cpu", q, k, v, bias=bias, softcap=3.0, causal=True, return_lse=True)


def test_backward_leaves_saved_lse_untouched():
    q, k, v = make_qkv(b=1, hq=2, sq=64, sk=64, d=16, seed=7, requires_grad=True)
    out, lse = tileattn.flash_attention(q, k, v, causal=True, backend="cpu", return_lse=True)
    saved = lse.clone()
    out.backward(torch.randn_like(out))
    assert torch.equal(lse, saved)


def test_results_do_not_depend_on_the_thread_count(small_tiles):
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=80, sk=96, d=16, seed=8)
    dout = torch.randn(2, 4, 80, 16)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = tileattn.flash_attention(*leaves, causal=True, backend="cpu")
            out.backward(dout)
            results.append([out.detach()] + [t.grad for t in leaves])
            assert torch.get_num_threads() == n, "the call changed the caller's thread count"
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_worker_errors_reach_the_caller():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    done = []

    def fail():
        raise ValueError("task failed")

    try:
        with pytest.raises(ValueError, match="task failed"):
            run_tasks([fail, lambda: done.append(1), lambda: done.append(2)])
        run_tasks([lambda: done.append(3), lambda: done.append(4)])
        assert 3 in done and 4 in done
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("per_head", [False, True])
def test_block_sparse_mask_summary(per_head):
    """A mask that tiles exactly is summarised per block once (skip / no masking / masked fill);
    blocks fully hidden, fully kept and mixed must all come out right, per head or broadcast."""
    cpu = tileattn.get_backend("cpu")
    cpu.config_override = TileConfig(block_m=16, block_n=32, heads=2)
    try:
        gen = torch.Generator().manual_seed(9)
        heads = 4 if per_head else 1
        blocks = torch.randint(0, 3, (1, heads, 4, 3), generator=gen)  # 0 hidden, 1 kept, 2 mixed
        mask = blocks.repeat_interleave(16, 2).repeat_interleave(32, 3)
        mixed = torch.rand(mask.shape, generator=gen) > 0.5
        mask = torch.where(mask == 2, mixed, mask == 1)
        mask[..., 0, :] = True  # no row without any key: those are tested elsewhere
        assert (blocks == 0).any() and (blocks == 1).any() and (blocks == 2).any()
        q, k, v = make_qkv(b=1, hq=4, hkv=2, sq=64, sk=96, d=16, seed=10)
        assert_matches_reference("cpu", q, k, v, mask=mask, return_lse=True)
    finally:
        cpu.config_override = None
