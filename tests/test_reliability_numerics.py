"""The CPU engine's softmax bookkeeping at the edges of fp32: a reference maximum far below the true
maximum (ALiBi, sharp decode rows), logits of 1e9, and +inf scores."""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn.backends.cpu import TileConfig, kernels
from tileattn.core.testing import check_against_reference

from conftest import assert_matches_reference, attention_fn, make_qkv


@pytest.fixture
def tiles_64():
    cpu = tileattn.get_backend("cpu")
    cpu.config_override = TileConfig(block_m=64, block_n=64)
    yield
    cpu.config_override = None


def test_alibi_far_from_the_first_key_tile(tiles_64):
    """Slope 1.2 over 130 keys: the first key tile's scores sit ~110 (base 2) below the row maximum
    near the diagonal. A reference maximum kept from the first tile cost 21 of 30 seeds the 2x rule
    on the LSE (and on the gradients, which read it)."""
    slopes = torch.tensor([1.2, 1.2])
    for seed in range(30):
        q, k, v = make_qkv(b=1, hq=2, sq=3, sk=130, d=16, seed=seed)
        assert_matches_reference("cpu", q, k, v, alibi_slopes=slopes, return_lse=True)


@pytest.mark.parametrize("sq", [1, 4])
def test_alibi_decode_with_default_tiles_keeps_a_margin(sq):
    """Decode shapes (a few queries, 2048 keys, default tiles) with the usual ALiBi slopes: the first
    key tile is the farthest from the diagonal. A reference kept from it left the error at 0.4-0.6 of
    the tolerance; one kept near the running maximum leaves it under 0.2."""
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(8)])
    worst = 0.0
    for seed in range(5):
        q, k, v = make_qkv(b=1, hq=8, sq=sq, sk=2048, d=64, seed=seed)
        verdicts = check_against_reference(attention_fn("cpu"), q, k, v, alibi_slopes=slopes, return_lse=True)
        worst = max([worst] + [x.error / x.tolerance for x in verdicts])
    assert worst < 0.3, f"error reached {worst:.2f} of the tolerance"


def test_fast_path_stays_fast_on_ordinary_rows(monkeypatch):
    """Random dense rows never need the careful step (row maximum of the tile) after the first tile."""
    careful = []
    real = kernels._careful_step

    def spy(*args, **kwargs):
        careful.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "_careful_step", spy)
    cpu = tileattn.get_backend("cpu")
    cpu.config_override = TileConfig(block_m=32, block_n=64, heads=1)
    try:
        q, k, v = make_qkv(b=1, hq=2, sq=64, sk=640, d=32, seed=3)
        tileattn.flash_attention(q, k, v, backend="cpu")
    finally:
        cpu.config_override = None
    assert len(careful) == 2 * 2, f"{len(careful)} careful tiles for 4 query blocks of 10 key tiles"


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 3e4), (torch.bfloat16, 3e4), (torch.float32, 300.0),
                                         (torch.float32, 30.0)])
def test_huge_logits_give_finite_gradients_within_the_rule(dtype, scale):
    """|q.k| up to ~1e9: folding -LSE into the backward GEMM lost the cancellation (inf/NaN grads)."""
    for causal in (False, True):
        q, k, v = make_qkv(b=1, hq=2, sq=24, sk=70, d=16, seed=5)
        q, k = (q * scale).to(dtype), (k * scale).to(dtype)
        assert_matches_reference("cpu", q, k, v.to(dtype), causal=causal, return_lse=True)


def test_fp16_huge_logits_give_finite_gradients():
    """q and k scaled by 1e4 in fp16: plain fp16 math overflows (so the 2x rule cannot judge), the
    fp64 reference's gradients are finite, and so must the engine's be (dv was NaN)."""
    q, k, v = make_qkv(b=1, hq=2, sq=24, sk=70, d=16, seed=6)
    q, k, v = (q * 1e4).half(), (k * 1e4).half(), v.half()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = tileattn.flash_attention(*leaves, backend="cpu")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).half()
    grads = torch.autograd.grad(out, leaves, dout)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(tileattn.reference(*ref), ref, dout.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.isfinite(r).all()
        assert torch.isfinite(g).all(), f"{name} is not finite"
    # dv = P^T dO with a one-hot P: exact enough to compare in fp16.
    torch.testing.assert_close(grads[2].double(), ref_grads[2], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("infinities,hide", [(1, {}), (2, {}), (1, {"causal": True}), (1, {"mask": "keys 0, 5"})])
def test_plus_inf_scores_follow_the_reference(infinities, hide):
    """A +inf bias entry: the fp64 reference gives LSE +inf and NaN for that row's output, its dq and
    dbias, for dk of every key the row sees (not of keys hidden from it) and for dv of the +inf keys;
    other rows are untouched."""
    q, k, v = make_qkv(b=1, hq=2, sq=5, sk=7, d=8, seed=7, dtype=torch.float64)
    bias = torch.zeros(1, 2, 5, 7, dtype=torch.float64)
    bias[0, 1, 2, 3] = float("inf")
    if infinities == 2:
        bias[0, 1, 2, 4] = float("inf")
    if "mask" in hide:
        mask = torch.ones(5, 7, dtype=torch.bool)
        mask[2, 0] = mask[2, 5] = False
        hide = {"mask": mask}
    results = []
    for backend in ("reference", "cpu"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
        out, lse = tileattn.flash_attention(*leaves[:3], bias=leaves[3], backend=backend, return_lse=True, **hide)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        results.append([out, lse] + list(torch.autograd.grad(out, leaves, dout)))
    assert results[0][1][0, 1, 2] == float("inf")
    for name, ref, got in zip(("out", "lse", "dq", "dk", "dv", "dbias"), *results):
        torch.testing.assert_close(got, ref, equal_nan=True, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("threads", [1, 2])
def test_steep_alibi_decode_flushes_subnormals_only_inside_the_call(threads):
    """The native kernels flush subnormal results to zero while their tasks run (a row's accumulator
    fed by probabilities near 2^-126 took a microcode assist per FMA): the result stays within the
    rule against the fp64 oracle, and the calling thread's floating-point mode is as it was, so
    subnormals still arise in the caller's own arithmetic afterwards."""
    slopes = torch.tensor([1.0, 0.9, 0.8, 0.7])
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=1, sk=3000, d=64, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_matches_reference("native", q, k, v, grad=False, alibi_slopes=slopes, return_lse=True)
    finally:
        torch.set_num_threads(before)
    tiny = torch.tensor([2.0 ** -120], dtype=torch.float32) * torch.tensor([2.0 ** -10], dtype=torch.float32)
    assert float(tiny) == 2.0 ** -130  # a subnormal, not flushed
