"""The Triton engine, run on CPU through Triton's interpreter, and compiled ahead of time for sm_90.

Triton decides at import whether it interprets (``TRITON_INTERPRET=1`` must be set *before* ``triton``
is imported: it decorates its own library then), so the two halves need two processes:

* the numerical tests are marked ``interpreted``: in an ordinary pytest run they are skipped and
  :func:`test_interpreter_suite` re-runs this file in a subprocess with the variable set;
* the ahead-of-time compile (ptxas for an H100/H200, no GPU needed) runs in the ordinary process. The
  interpreter accepts Python that the real compiler rejects, so this keeps the GPU path honest.

Every numerical check is FlashAttention's rule against the fp64 reference (forward, LSE and all
gradients). Shapes are tiny: the interpreter runs programs one by one, about a millisecond each.
bf16 is skipped on CPU: the interpreter's bf16 ``tl.dot`` is broken; ``benchmarks/gpu_check.py``
covers it on a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tileattn
from tileattn.core.modifiers import Band, TileState
from tileattn.core.spec import build_spec
from tileattn.core.testing import check_against_reference

from conftest import make_qkv, strided_view
from test_unit_stride import CASES as UNIT_STRIDE_CASES

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tileattn.backends.triton import launch  # noqa: E402  (needs triton)

ROOT = Path(__file__).resolve().parents[1]
IN_INTERPRETER = launch.interpreter_active()
launch.kernels()  # decorates tile_math in this process's mode before the probe kernel below uses it
from tileattn.backends.triton import tile_math  # noqa: E402

interpreted = pytest.mark.skipif(
    not IN_INTERPRETER, reason="runs in the TRITON_INTERPRET=1 subprocess of test_interpreter_suite")
compiled_process = pytest.mark.skipif(IN_INTERPRETER, reason="needs a process where triton compiles")
BF16_REASON = ("the Triton interpreter's bf16 tl.dot is broken; covered on GPU by benchmarks/gpu_check.py")


@compiled_process
def test_interpreter_suite():
    """This file's interpreted tests, in a process that imports triton with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
           str(Path(__file__).resolve())]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    # Guard against a subprocess that silently collected (almost) nothing.
    assert passed and int(passed.group(1)) >= 50, report


def check(q, k, v, grad=True, **kwargs):
    """Triton vs the fp64 reference with the 2x rule (out, lse, dq, dk, dv and dbias when asked).

    The LSE verdict's floor scales with max|LSE|, infinite as soon as one row sees no key, so the rows
    with LSE = -inf are also compared exactly and the finite ones against a fixed bound.
    """
    captured = []

    def run(q, k, v, **kw):
        res = tileattn.flash_attention(q, k, v, backend="triton", **kw)
        captured.append(res)
        return res

    verdicts = check_against_reference(run, q, k, v, grad=grad, return_lse=True, **kwargs)
    expected = ["out", "lse"] + (["dq", "dk", "dv"] if grad else [])
    bias = kwargs.get("bias")
    if grad and bias is not None and bias.requires_grad:
        expected.append("dbias")
    assert [x.name for x in verdicts] == expected
    failed = [str(x) for x in verdicts if not x.ok]
    assert not failed, " | ".join(failed)

    lse = captured[0][1]
    ref_lse = tileattn.reference(q.detach(), k.detach(), v.detach(), compute_dtype=torch.float64,
                                 return_lse=True, **kwargs)[1]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows with no visible key differ"
    finite = torch.isfinite(ref_lse)
    if finite.any():
        err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
        assert err < (1e-4 if q.dtype == torch.float32 else 2e-2), f"lse error {err}"
    return verdicts


# ------------------------------------------------------------------------------ shapes and dtypes


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_plain(dtype):
    q, k, v = make_qkv(b=2, hq=2, sq=48, sk=40, d=32, dtype=dtype)
    check(q, k, v)


@interpreted
@pytest.mark.parametrize("sq, sk", [(65, 33), (17, 127), (1, 1), (33, 33), (127, 127)])
def test_causal_bottom_right(sq, sk):
    q, k, v = make_qkv(b=1, hq=1, sq=sq, sk=sk, d=16, seed=sq + sk)
    check(q, k, v, causal=True)


@interpreted
@pytest.mark.parametrize("sq", [1, 17, 33, 127])
def test_odd_lengths_noncausal(sq):
    q, k, v = make_qkv(b=1, hq=1, sq=sq, sk=sq + 2, d=16, seed=sq)
    check(q, k, v)


@interpreted
@pytest.mark.parametrize("d, dv", [(16, 16), (40, 40), (64, 64), (40, 24), (16, 64)])
def test_head_dims(d, dv):
    # 40 and 24 are not powers of two: padded to 64 / 32 with masked loads.
    q, k, v = make_qkv(b=1, hq=2, sq=33, sk=47, d=d, dv=dv, seed=d + dv)
    check(q, k, v, causal=True)


@interpreted
def test_fp16_causal_gqa():
    q, k, v = make_qkv(b=1, hq=4, hkv=2, sq=40, sk=40, d=40, dtype=torch.float16, seed=4)
    check(q, k, v, causal=True)


@interpreted
@pytest.mark.parametrize("sq, sk", [(10, 0), (0, 10)])
def test_empty_sequences(sq, sk):
    # No keys: every row outputs 0 with LSE -inf and all gradients are 0; no queries: empty outputs.
    q, k, v = make_qkv(b=1, hq=2, sq=sq, sk=sk, d=16, seed=21)
    check(q, k, v)


@interpreted
def test_zero_scale_and_fp16_bias_gradient():
    q, k, v = make_qkv(b=1, hq=2, sq=20, sk=20, d=16, dtype=torch.float16, seed=22)
    bias = torch.randn(2, 20, 20, generator=torch.Generator().manual_seed(6)).half().requires_grad_(True)
    check(q, k, v, bias=bias)
    check(*make_qkv(b=1, hq=1, sq=20, sk=20, d=16, seed=23), scale=0.0)


@interpreted
@pytest.mark.parametrize("hq, hkv", [(4, 2), (4, 1)])
def test_gqa_mqa(hq, hkv):
    q, k, v = make_qkv(b=2, hq=hq, hkv=hkv, sq=33, sk=20, d=16, seed=hq + hkv)
    check(q, k, v, causal=True)


# ---------------------------------------------------------------------- block skipping and masking


@triton.jit
def _block_ranges_probe(Out, first, q_len, k_len, offset, left, right, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                        KEYS: tl.constexpr):
    if KEYS:
        a, b, c, d = tile_math.visible_key_blocks(first, q_len, k_len, offset, left, right, BLOCK_M, BLOCK_N,
                                                  HAS_LEFT, HAS_RIGHT)
    else:
        a, b, c, d = tile_math.visible_query_blocks(first, q_len, k_len, offset, left, right, BLOCK_M, BLOCK_N,
                                                    HAS_LEFT, HAS_RIGHT)
    tl.store(Out + 0, a)
    tl.store(Out + 1, b)
    tl.store(Out + 2, c)
    tl.store(Out + 3, d)


@interpreted
@pytest.mark.parametrize("window", [(None, 0), (3, 2), (0, 0), (7, None), (20, 4)])
def test_block_ranges_follow_the_band_classification(window):
    """The kernels' block ranges agree with :meth:`Band.tile_state`, the one rule every engine
    follows: blocks outside [start, end) are EMPTY, blocks in the unmasked middle [mid_lo, mid_hi)
    are FULL (so skipping their mask is exact), for bottom-right, top-left and shifted diagonals."""
    left, right = window
    band = Band(left, right)
    block_m, block_n = 16, 8
    out = torch.zeros(4, dtype=torch.int32)
    for q_len in (1, 5, 17, 40):
        for k_len in (1, 9, 17, 40):
            for offset in sorted({k_len - q_len, 0, 5, -3}):
                for keys in (True, False):
                    own, other = (block_m, block_n) if keys else (block_n, block_m)
                    own_len, other_len = (q_len, k_len) if keys else (k_len, q_len)
                    for first in range(0, own_len, own):
                        _block_ranges_probe[(1,)](out, first, q_len, k_len, offset, left or 0, right or 0,
                                                  block_m, block_n, left is not None, right is not None, keys)
                        start, mid_lo, mid_hi, end = out.tolist()
                        assert start % other == 0 and start <= mid_lo <= mid_hi <= end, out
                        last = min(first + own, own_len)
                        for j0 in range(0, other_len, other):
                            j1 = min(j0 + other, other_len)
                            tile = (first, last, j0, j1) if keys else (j0, j1, first, last)
                            state = band.tile_state(*tile, offset)
                            where = (q_len, k_len, offset, keys, first, j0, out.tolist())
                            if not start <= j0 < end:
                                assert state == TileState.EMPTY, where
                            if mid_lo <= j0 < mid_hi:
                                assert state == TileState.FULL and j1 - j0 == other, where


# ------------------------------------------------------------------------------------ layouts


@interpreted
@pytest.mark.parametrize("layout", ["BSND", "BSH", "SBH"])
def test_layouts(layout):
    q, k, v = make_qkv(b=2, hq=2, hkv=1, sq=20, sk=36, d=16, layout=layout, seed=5)
    nh = 2 if layout in ("BSH", "SBH") else None
    check(q, k, v, layout=layout, num_heads=nh, causal=True)


@interpreted
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_strided_views_read_in_place(layout):
    q, k, v = make_qkv(b=1, hq=2, sq=24, sk=24, d=16, layout=layout, seed=6)
    nh = 2 if layout in ("BSH", "SBH") else None
    qs, ks, vs = (strided_view(t, layout, 2) for t in (q, k, v))
    check(qs, ks, vs, layout=layout, num_heads=nh)


@interpreted
def test_varlen_with_empty_sequence():
    # Three sequences; the middle one has no keys at all (its queries see nothing: 0 and -inf).
    cu_q = torch.tensor([0, 5, 22, 60], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 9, 40], dtype=torch.int32)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(60, 4, 16, generator=gen)
    k = torch.randn(40, 2, 16, generator=gen)
    v = torch.randn(40, 2, 24, generator=gen)
    out, lse = tileattn.flash_attention(q, k, v, layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                        backend="triton", return_lse=True)
    assert torch.all(out[5:22] == 0) and torch.all(torch.isneginf(lse[:, 5:22]))
    check(q, k, v, layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)


@interpreted
def test_varlen_transposed_storage():
    cu = torch.tensor([0, 3, 40], dtype=torch.int32)
    gen = torch.Generator().manual_seed(8)
    # (T, H, D) views of (H, T, D) storage: token stride is not the largest.
    q, k, v = (torch.randn(2, 40, 16, generator=gen).transpose(0, 1) for _ in range(3))
    check(q, k, v, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, window=(5, 3))


# ---------------------------------------------------------------------------- score modifiers


@interpreted
@pytest.mark.parametrize("window, causal",
                         [((3, 2), False), ((8, 0), False), ((4, -1), True), ((-1, 5), False), ((0, 0), False)])
def test_windows(window, causal):
    q, k, v = make_qkv(b=1, hq=2, sq=45, sk=70, d=16, seed=9)
    check(q, k, v, window=window, causal=causal)


@interpreted
@pytest.mark.parametrize("per_batch", [False, True])
def test_alibi(per_batch):
    q, k, v = make_qkv(b=2, hq=2, sq=33, sk=40, d=16, seed=10)
    slopes = torch.tensor([[0.5, 0.125], [0.25, 0.0625]]) if per_batch else torch.tensor([0.5, 0.125])
    check(q, k, v, alibi_slopes=slopes, causal=True)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softcap(dtype):
    q, k, v = make_qkv(b=1, hq=2, sq=40, sk=40, d=32, dtype=dtype, seed=11)
    check(q, k, v, softcap=2.0, scale=1.0, causal=True)


@interpreted
def test_all_modifiers_together():
    q, k, v = make_qkv(b=1, hq=4, hkv=2, sq=30, sk=50, d=40, dv=16, seed=12)
    gen = torch.Generator().manual_seed(1)
    bias = torch.randn(1, 4, 30, 50, generator=gen)
    check(q, k, v, softcap=3.0, alibi_slopes=torch.tensor([0.3, 0.2, 0.1, 0.05]), bias=bias,
          window=(20, 4), dropout_p=0.2, seed=99)


@interpreted
def test_fully_masked_rows():
    q, k, v = make_qkv(b=1, hq=2, sq=20, sk=33, d=16, seed=13)
    mask = torch.rand(20, 33, generator=torch.Generator().manual_seed(2)) > 0.3
    mask[3] = False
    mask[17] = False
    out, lse = tileattn.flash_attention(q, k, v, mask=mask, backend="triton", return_lse=True)
    assert torch.all(out[:, :, [3, 17]] == 0) and torch.all(torch.isneginf(lse[:, :, [3, 17]]))
    check(q, k, v, mask=mask)


@interpreted
@pytest.mark.parametrize("shape", [(1, 2, 21, 37), (2, 1, 1, 37), (37,)])
def test_bool_mask_broadcast(shape):
    b, h, sq, sk = 2, 2, 21, 37
    q, k, v = make_qkv(b=b, hq=h, sq=sq, sk=sk, d=16, seed=14)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(3)) > 0.4
    check(q, k, v, mask=mask, causal=True)


@interpreted
@pytest.mark.parametrize("shape", [(2, 2, 21, 37), (21, 37), (1, 2, 1, 37)])
def test_bias_with_gradient(shape):
    q, k, v = make_qkv(b=2, hq=2, sq=21, sk=37, d=16, seed=15)
    bias = torch.randn(shape, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    verdicts = check(q, k, v, bias=bias)
    assert [x.name for x in verdicts][-1] == "dbias"


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dropout_matches_reference_rng(dtype):
    # Same seed, same counter-based hash: the reference drops exactly the same weights.
    q, k, v = make_qkv(b=2, hq=2, hkv=1, sq=33, sk=40, d=16, dtype=dtype, seed=16)
    check(q, k, v, dropout_p=0.3, seed=2**40 + 12345, causal=True)


@interpreted
def test_dropout_check_tells_seeds_apart():
    # The check above is only meaningful if another seed would fail it.
    q, k, v = make_qkv(b=1, hq=1, sq=32, sk=32, d=16, seed=20)

    def other_seed(q, k, v, **kw):
        return tileattn.flash_attention(q, k, v, backend="triton", **dict(kw, seed=2))

    verdicts = check_against_reference(other_seed, q, k, v, grad=False, dropout_p=0.3, seed=1)
    assert verdicts[0].name == "out" and not verdicts[0].ok


@interpreted
def test_dropout_rate():
    q, k, v = make_qkv(b=1, hq=1, sq=64, sk=64, d=16, seed=17)
    v = torch.ones_like(v)
    out = tileattn.flash_attention(q, k, v, dropout_p=0.5, seed=5, backend="triton", scale=0.0)
    # Uniform weights 1/64, each kept with prob 1/2 and scaled by 2: the row mean stays near 1.
    assert abs(out.mean().item() - 1.0) < 0.05
    assert (out != out[0, 0, 0, 0]).any()


# ------------------------------------------------- alignment, sinks, partial results, LSE gradient


@interpreted
@pytest.mark.parametrize("align, window", [("top_left", (None, 0)), (5, (3, 0)), (-4, (None, 2))])
def test_align_places_the_diagonal(align, window):
    q, k, v = make_qkv(b=1, hq=4, hkv=2, sq=40, sk=56, d=16, seed=41)
    check(q, k, v, window=window, align=align)


@interpreted
def test_sinks():
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=33, sk=20, d=16, seed=42)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], requires_grad=True)
    check(q, k, v, causal=True, sinks=sinks)
    out = tileattn.flash_attention(q, k, v, causal=True, sinks=sinks, backend="triton")
    ref = tileattn.reference(q, k, v, causal=True, sinks=sinks, compute_dtype=torch.float64)
    (g,) = torch.autograd.grad(out, sinks, torch.ones_like(out))
    (g_ref,) = torch.autograd.grad(ref, sinks, torch.ones_like(ref))
    torch.testing.assert_close(g.double(), g_ref.double(), rtol=1e-4, atol=1e-5)


@interpreted
def test_partial_result_is_fp32_and_lse_is_differentiable():
    q, k, v = (t.requires_grad_() for t in make_qkv(b=1, hq=2, sq=24, sk=40, d=16, dtype=torch.float16, seed=43))
    out, lse = tileattn.attention_partial(q, k, v, causal=True, backend="triton")
    assert out.dtype == torch.float32
    want_out, want_lse = tileattn.reference(q, k, v, causal=True, return_lse=True, compute_dtype=torch.float64)
    torch.testing.assert_close(out.double(), want_out, rtol=2e-3, atol=2e-3)
    gen = torch.Generator().manual_seed(44)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    want = torch.autograd.grad((want_out, want_lse), (q, k, v), (dout.double(), dlse.double()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w.double(), rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------- determinism, dispatch


@interpreted
def test_deterministic_bitwise_repeat():
    q, k, v = make_qkv(b=1, hq=4, hkv=2, sq=40, sk=40, d=16, seed=18, requires_grad=True)
    dout = torch.randn(1, 4, 40, 16, generator=torch.Generator().manual_seed(5))
    results = []
    for _ in range(2):
        out = tileattn.flash_attention(q, k, v, causal=True, deterministic=True, backend="triton")
        results.append((out,) + torch.autograd.grad(out, (q, k, v), dout))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@interpreted
def test_refusals_in_interpreter():
    from tileattn.core.dispatch import get_backend, select

    engine = get_backend("triton")
    assert engine.priority < get_backend("cpu").priority
    q, k, v = make_qkv(b=1, hq=1, sq=8, d=16)
    inp = build_spec(q, k, v)
    assert engine.not_supported_reasons(inp) == []
    # "auto" never takes CPU tensors to the interpreter; an explicit backend="triton" does.
    assert select(inp).name != "triton"
    assert any("CPU tensors" in r for r in engine.auto_refusal(inp))
    cases = {
        "float64": make_qkv(b=1, hq=1, sq=8, d=16, dtype=torch.float64),
        "bfloat16": make_qkv(b=1, hq=1, sq=8, d=16, dtype=torch.bfloat16),
        "head_dim 320": make_qkv(b=1, hq=1, sq=8, d=320),
        "head_dim_v 272": make_qkv(b=1, hq=1, sq=8, d=16, dv=272),
    }
    for needle, qkv in cases.items():
        reasons = engine.not_supported_reasons(build_spec(*qkv))
        assert any(needle in r for r in reasons), (needle, reasons)
        with pytest.raises(tileattn.NoBackendError, match=needle):
            tileattn.flash_attention(*qkv, backend="triton")


@compiled_process
def test_cpu_tensors_refused_without_interpreter():
    from tileattn.core.dispatch import get_backend, select

    q, k, v = make_qkv(b=1, hq=1, sq=8, d=16)
    inp = build_spec(q, k, v)
    reasons = get_backend("triton").not_supported_reasons(inp)
    assert any("TRITON_INTERPRET=1" in r for r in reasons), reasons
    assert select(inp).name in ("native", "cpu")
    with pytest.raises(tileattn.NoBackendError, match="TRITON_INTERPRET"):
        tileattn.flash_attention(q, k, v, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=BF16_REASON)
def test_bf16_on_gpu():
    q, k, v = (t.cuda() for t in make_qkv(b=1, hq=4, hkv=2, sq=100, sk=77, d=64, dtype=torch.bfloat16))
    check(q, k, v, causal=True)


@interpreted
def test_tune_cache_supplies_the_forward_config(monkeypatch):
    from tileattn.tools import tuning

    seen = []
    original = launch._launch

    def spy(name, kernel, space, grid_of, args, flags, cached=None):
        seen.append((name, cached))
        return original(name, kernel, space, grid_of, args, flags, cached)

    monkeypatch.setattr(launch, "_launch", spy)
    q, k, v = make_qkv(b=1, hq=2, sq=40, sk=40, d=16, seed=24)
    config = {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 1}
    with tuning.overriding("triton", config):
        check(q, k, v, causal=True)
    assert ("forward", launch.KernelConfig(16, 64, 4, 1)) in seen


@interpreted
def test_autograd_through_custom_op():
    # The autograd custom op saves only q, k, v, out, lse: the backward must rebuild everything.
    q, k, v = make_qkv(b=1, hq=2, sq=20, sk=20, d=16, seed=19, requires_grad=True)
    out = tileattn.flash_attention(q, k, v, backend="triton", window=(3, 3))
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


# ----------------------------------------------------------- KV caches: seqused_k, pages, decode


def _kernels_run(monkeypatch):
    """Names of the launcher paths a call takes ('decode' or 'prefill')."""
    seen = []
    for name in ("_decode", "_prefill"):
        original = getattr(launch, name)
        monkeypatch.setattr(launch, name, lambda *a, _o=original, _n=name: (seen.append(_n[1:]), _o(*a))[1])
    return seen


def _paged(k, v, page, seed):
    """(pool_k, pool_v, block_table): (B, Hkv, S, D) caches scattered over a shuffled pool of pages."""
    b, hkv, s, d = k.shape
    pages = -(-s // page)
    pad = pages * page - s
    blocks = [F.pad(t.transpose(1, 2), (0, 0, 0, 0, 0, pad)).reshape(b * pages, page, hkv, t.shape[-1])
              for t in (k, v)]
    order = torch.randperm(b * pages + 3, generator=torch.Generator().manual_seed(seed))
    pool_k, pool_v = (torch.zeros(b * pages + 3, page, hkv, t.shape[-1], dtype=t.dtype) for t in (k, v))
    pool_k[order[: b * pages]], pool_v[order[: b * pages]] = blocks
    return pool_k, pool_v, order[: b * pages].view(b, pages).int()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sq, hq, hkv, kwargs", [
    (1, 4, 2, {}),
    (1, 8, 1, {"causal": True}),
    (4, 8, 2, {"causal": True}),
    (3, 4, 2, {"causal": True, "window": (200, 0)}),
    (1, 2, 2, {"alibi_slopes": torch.tensor([0.3, 0.05]), "softcap": 3.0, "sinks": torch.tensor([0.5, -1.0])}),
    (2, 4, 4, {"causal": True, "align": "top_left"}),
])
def test_decode_kernel_matches_reference(monkeypatch, dtype, sq, hq, hkv, kwargs):
    """Split-K decoding of ragged caches: the full odd-length cache (6 chunks), an empty one, 3 chunks
    and 1 chunk; GQA and MQA, multi-token queries aligned bottom-right, bands, ALiBi, softcap, sinks."""
    q, k, v = make_qkv(b=4, hq=hq, hkv=hkv, sq=sq, sk=701, d=40, dtype=dtype, seed=sq + hq)
    used = torch.tensor([701, 0, 333, 100], dtype=torch.int32)
    assert [launch.decode_chunks(n) for n in used.tolist()] == [6, 0, 3, 1]
    seen = _kernels_run(monkeypatch)
    check(q, k, v, grad=False, seqused_k=used, **kwargs)
    assert seen[0] == "decode"


@interpreted
def test_decode_kernel_caps_the_splits_of_a_long_cache(monkeypatch):
    """Past DECODE_MAX_SPLITS x DECODE_MIN_CHUNK keys the chunks lengthen instead of multiplying
    (the limits are lowered here so that the interpreter sees the cap on a short cache)."""
    monkeypatch.setattr(launch, "DECODE_MIN_CHUNK", 64)
    monkeypatch.setattr(launch, "DECODE_MAX_SPLITS", 3)
    q, k, v = make_qkv(b=1, hq=2, hkv=1, sq=1, sk=901, d=16, seed=31)
    seen = _kernels_run(monkeypatch)
    check(q, k, v, grad=False, causal=True)
    assert seen == ["decode"] and launch.decode_chunks(901) == 3


@interpreted
@pytest.mark.parametrize("sq", [1, 24])
def test_paged_kv_cache(monkeypatch, sq):
    """A paged pool (pages of 7 keys, shuffled) read through the block table, by the decode kernel
    (1 query) and the prefill one; the same bits as the contiguous cache."""
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=sq, sk=300, d=32, layout="BSND", seed=sq)
    pool_k, pool_v, table = _paged(k.transpose(1, 2), v.transpose(1, 2), 7, seed=sq)
    used = torch.tensor([300, 161], dtype=torch.int32)
    seen = _kernels_run(monkeypatch)
    check(q, pool_k, pool_v, grad=False, layout="BSND", block_table=table, seqused_k=used, causal=True)
    assert seen[0] == ("decode" if sq == 1 else "prefill")
    out = tileattn.flash_attention(q, pool_k, pool_v, layout="BSND", block_table=table, seqused_k=used,
                                   backend="triton")
    ref = tileattn.flash_attention(q, k, v, layout="BSND", seqused_k=used, backend="triton")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@interpreted
@pytest.mark.parametrize("sq", [1, 5])
def test_paged_kv_cache_with_a_mask_and_a_bias(sq):
    """A bool mask and a float bias over a paged cache, indexed by logical key position (the torch_npu
    dialect's atten_mask / pse_shift with block_table): the prefill kernel, even for one query."""
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=sq, sk=40, d=16, layout="BSND", seed=40 + sq)
    pool_k, pool_v, table = _paged(k.transpose(1, 2), v.transpose(1, 2), 8, seed=sq)
    gen = torch.Generator().manual_seed(sq)
    mask = torch.rand(2, 1, sq, 40, generator=gen) > 0.3
    bias = torch.randn(1, 4, sq, 40, generator=gen)
    used = torch.tensor([40, 19], dtype=torch.int32)
    check(q, pool_k, pool_v, grad=False, layout="BSND", block_table=table, seqused_k=used, mask=mask, bias=bias,
          causal=True)
    out = tileattn.flash_attention(q, pool_k, pool_v, layout="BSND", block_table=table, seqused_k=used, mask=mask,
                                   bias=bias, backend="triton")
    ref = tileattn.flash_attention(q, k, v, layout="BSND", seqused_k=used, mask=mask, bias=bias, backend="triton")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@interpreted
def test_varlen_queries_over_a_paged_cache():
    cu_q = torch.tensor([0, 1, 1, 3], dtype=torch.int32)  # 1, 0 and 2 queries
    gen = torch.Generator().manual_seed(32)
    q = torch.randn(3, 4, 16, generator=gen)
    pool_k, pool_v = torch.randn(20, 8, 2, 16, generator=gen), torch.randn(20, 8, 2, 16, generator=gen)
    table = torch.randperm(20, generator=gen)[:15].view(3, 5).int()
    used = torch.tensor([37, 5, 40], dtype=torch.int32)
    check(q, pool_k, pool_v, grad=False, layout="TND", cu_seqlens_q=cu_q, block_table=table, seqused_k=used,
          causal=True)


@interpreted
def test_seqused_k_forward_and_backward_in_the_prefill_kernels():
    """Keys past seqused_k neither count nor get a gradient (the launcher zeroes their dK/dV)."""
    q, k, v = make_qkv(b=3, hq=4, hkv=2, sq=20, sk=45, d=16, seed=33)
    check(q, k, v, seqused_k=torch.tensor([45, 3, 0], dtype=torch.int32), causal=True)
    cu = torch.tensor([0, 20, 50], dtype=torch.int32)
    gen = torch.Generator().manual_seed(34)
    q, k, v = (torch.randn(50, 2, 16, generator=gen) for _ in range(3))
    check(q, k, v, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_k=torch.tensor([7, 30], dtype=torch.int32))


@interpreted
@pytest.mark.parametrize("case", UNIT_STRIDE_CASES)
def test_head_dim_strides_and_index_views(case):
    """tests/test_unit_stride.py's inputs: a head dim that is not unit-stride is read through its
    stride; index tensors that are views (t[::2]) are read as the values they hold (they used to be
    read as contiguous arrays: a silently wrong result)."""
    (q, k, v), kwargs, grad = UNIT_STRIDE_CASES[case]()
    assert tileattn.explain(q, k, v, **kwargs)["triton"] == []
    kwargs.pop("return_lse", None)
    check(q, k, v, grad=grad, **kwargs)


@interpreted
def test_decode_is_batch_invariant_and_reproducible(monkeypatch):
    """A row's bits do not depend on the other sequences of the batch nor on the cache's capacity
    (the chunking is the sequence's own), nor on the run. Few, short chunks here, so that a chunking
    taken from the capacity (900 keys: 4 chunks of 256) would differ from the sequences' own."""
    monkeypatch.setattr(launch, "DECODE_MIN_CHUNK", 64)
    monkeypatch.setattr(launch, "DECODE_MAX_SPLITS", 4)
    q, k, v = make_qkv(b=4, hq=4, hkv=2, sq=1, sk=900, d=32, seed=35)
    used = torch.tensor([900, 17, 512, 640], dtype=torch.int32)
    together = tileattn.flash_attention(q, k, v, seqused_k=used, backend="triton")
    assert torch.equal(together, tileattn.flash_attention(q, k, v, seqused_k=used, backend="triton"))
    for b, n in enumerate(used.tolist()):
        alone = tileattn.flash_attention(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], backend="triton")
        assert torch.equal(alone, together[b:b + 1]), b


@interpreted
def test_modifiers_outside_the_decode_kernel_take_the_prefill_kernel(monkeypatch):
    q, k, v = make_qkv(b=1, hq=2, sq=1, sk=200, d=16, seed=36)
    seen = _kernels_run(monkeypatch)
    mask = torch.rand(1, 200, generator=torch.Generator().manual_seed(3)) > 0.3
    check(q, k, v, grad=False, mask=mask)
    check(q, k, v, grad=False, dropout_p=0.2, seed=4)
    assert seen == ["prefill"] * 2


@interpreted
def test_paged_kv_gradients_refused_with_a_reason():
    """The kernels read a paged cache forward only: a call that needs gradients is refused before compute."""
    from tileattn.core.dispatch import get_backend

    q, k, v = make_qkv(b=1, hq=2, sq=1, sk=16, d=16, layout="BSND", seed=37)
    pool_k, pool_v, table = _paged(k.transpose(1, 2), v.transpose(1, 2), 8, seed=37)
    spec = build_spec(q, pool_k, pool_v, layout="BSND", block_table=table)
    reasons = get_backend("triton").not_supported_reasons(spec, backward=True)
    assert any("paged" in r for r in reasons), reasons
    with pytest.raises(tileattn.NoBackendError, match="paged"):
        tileattn.flash_attention(q.requires_grad_(), pool_k, pool_v, layout="BSND", block_table=table,
                                 backend="triton")


# ------------------------------------------------------------------- ahead-of-time GPU compile


def _aot_compile(fn, constexprs, pointer_types, num_warps=4, num_stages=3, ints_equal_one=False):
    """Compile ``fn`` for sm_90. Pointers are typed by ``pointer_types``; the argument groups of
    :mod:`tileattn.backends.triton.arguments` by their fields' annotations (int: i32, float: fp32, any
    other: the pointer its name has in ``pointer_types``, else an int32 index pointer); ``F`` is the
    Flags of ``constexprs``. ``ints_equal_one``: every int
    argument that Triton would specialise when it equals 1 (unit strides, group size 1, length 1, ...)
    becomes the constant 1, as at launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tileattn.backends.triton import arguments

    groups = {"mods": arguments.ModifierTensors, "seqs": arguments.Sequences, "sizes": arguments.Sizes,
              "sc": arguments.Scalars}
    signature, constants = {}, {}

    def integer(path):
        if ints_equal_one and fn.arg_names[path[0]] not in fn.do_not_specialize:
            constants[path] = 1
            return "constexpr"
        return "i32"

    def group(cls, path):
        types = []
        for i, (field, kind) in enumerate(cls.__annotations__.items()):
            if isinstance(kind, type) and issubclass(kind, tuple):
                types.append(group(kind, path + (i,)))
            else:
                types.append(integer(path + (i,)) if kind is int else "fp32" if kind is float
                             else pointer_types.get(field, "*i32"))
        return cls(*types)

    for i, name in enumerate(fn.arg_names):
        if name == "F":
            constants[(i,)] = arguments.Flags(**{f: constexprs[f] for f in arguments.Flags._fields})
            signature[name] = "constexpr"
        elif name in constexprs:
            constants[(i,)] = constexprs[name]
            signature[name] = "constexpr"
        elif name in pointer_types:
            signature[name] = pointer_types[name]
        elif name in groups or name.endswith("_st"):
            signature[name] = group(groups.get(name, arguments.Strides), (i,))
        else:
            signature[name] = integer((i,))
    src = ASTSource(fn, signature, constexprs=constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})


def _pointer_types(dtype: str) -> dict:
    data = {n: f"*{dtype}" for n in ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV")}
    return dict(data, Lse2="*fp32", Delta="*fp32", DBias="*fp32", mask="*u8", bias="*fp32",
                alibi_slopes="*fp32", OutPart="*fp32", LsePart="*fp32")


@compiled_process
def test_kernels_compile_for_sm90():
    """Every kernel with every feature on that the launcher gives it (the decode kernels have no mask,
    bias or dropout: those calls take the prefill kernel), through ptxas for an H100/H200 (no GPU
    needed): bf16 for all kernels, fp32 (IEEE dots) for the forward and decode ones, the prefill
    forward and the decode kernel also on a paged cache. Small blocks keep ptxas to seconds."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"triton has no NVIDIA compiler backend here: {exc}")
    fwd, bwd, dec = launch.kernels()
    flags = dict(HAS_LEFT=True, HAS_RIGHT=True, BOTTOM_RIGHT=True, IS_VARLEN=True, HAS_MASK=True, HAS_BIAS=True,
                 HAS_ALIBI_SLOPES=True,
                 HAS_SOFTCAP=True, HAS_DROPOUT=True, HAS_SEQUSED=True, PAGED=False, BLOCK_D=64, BLOCK_DV=32)
    bf16, fp32 = dict(flags, DOT_PRECISION="tf32"), dict(flags, DOT_PRECISION="ieee")
    decode = dict(MIN_CHUNK=launch.DECODE_MIN_CHUNK, MAX_SPLITS=launch.DECODE_MAX_SPLITS, BLOCK_M=16,
                  BLOCK_N=launch.DECODE_BLOCK_N, HAS_MASK=False, HAS_BIAS=False, HAS_DROPOUT=False)
    jobs = [
        (fwd.attention_forward_kernel, dict(bf16, BLOCK_M=64, BLOCK_N=32), "bf16"),
        (bwd.attention_backward_dkdv_kernel, dict(bf16, BLOCK_M=32, BLOCK_N=64), "bf16"),
        (bwd.attention_backward_dq_kernel, dict(bf16, WRITE_DBIAS=True, BLOCK_M=64, BLOCK_N=32), "bf16"),
        (dec.attention_decode_kernel, dict(bf16, **decode, PAGED=True), "bf16"),
        (dec.attention_decode_merge_kernel, dict(bf16, **decode, PAGED=True), "bf16"),
        (fwd.attention_forward_kernel, dict(bf16, BLOCK_M=64, BLOCK_N=32, PAGED=True, HAS_MASK=False,
                                            HAS_BIAS=False), "bf16"),
        (fwd.attention_forward_kernel, dict(fp32, BLOCK_M=32, BLOCK_N=32), "fp32"),
        (dec.attention_decode_kernel, dict(fp32, **decode, IS_VARLEN=False, BLOCK_D=128, BLOCK_DV=128), "fp32"),
    ]
    # The same kernels with every specialisable int argument equal to 1 (a constant, not a tensor):
    # for the decode kernel that includes group 1, one query and pages of one key (a left-padded cache).
    jobs += [(fn, dict(c, ones=True), d) for fn, c, d in jobs[:6]]
    for fn, constexprs, dtype in jobs:
        ones = constexprs.pop("ones", False)
        try:
            compiled = _aot_compile(fn, constexprs, _pointer_types(dtype), num_stages=2, ints_equal_one=ones)
        except RuntimeError as exc:  # a triton wheel without its ptxas binary
            if "ptxas" in str(exc):
                pytest.skip(f"cannot run ptxas here: {exc}")
            raise
        assert len(compiled.asm["cubin"]) > 0, fn


# ------------------------------------------------------------------------ the GPU check script


@interpreted
def test_gpu_check_dry_run(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--dry-run", str(tmp_path)]) == 0
    rows = (tmp_path / "correctness.csv").read_text().splitlines()
    assert rows[0].startswith("case,") and len(rows) > 3
    assert all(line.endswith(",PASS") for line in rows[1:]), rows


def test_gpu_check_help():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exc:
        module.main(["--help"])
    assert exc.value.code == 0
