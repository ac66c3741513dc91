"""tileattn.flex.codegen / compiler: the C tile functions compiled from score_mods and mask_mods agree
with torch evaluating the same function (torch.vmap) and with torch.autograd through it, including
gradients of captured tensors; unsupported functions give a reason; compiled code is cached."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from tileattn.flex.examples import MASKS, padding, score_mods
from tileattn.flex import blocks, compiler
from tileattn.flex.semantics import mask_tile, score_tile
from tileattn.flex.trace import Unsupported

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float64: dict(atol=1e-11, rtol=1e-11)}


def tile_indices(rows, cols, heads, q_len, kv_len, seed):
    gen = torch.Generator().manual_seed(seed)

    def draw(n, high):
        return torch.randint(0, high, (n,), generator=gen, dtype=torch.int32)

    return draw(rows, 3), draw(rows, heads), draw(rows, q_len), draw(cols, kv_len)


def run_score_tiles(score_mod, dtype, captures_with_grad=(), rows=13, cols=9, heads=4, q_len=40, kv_len=40, seed=0):
    """Forward and backward of the compiled tile against vmap + autograd; returns the program."""
    program, captures = compiler.score_program(score_mod, dtype)
    b, h, q, kv = tile_indices(rows, cols, heads, q_len, kv_len, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    scores = (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 3).to(dtype)
    ld = rows + 3  # rows past ``rows`` belong to nobody: they must stay untouched
    tile = torch.full((cols, ld), float("nan"), dtype=dtype)
    tile[:, :rows] = scores.t()
    program.forward(tile, b, h, q, kv, captures)
    leaf = scores.clone().requires_grad_()
    expected = score_tile(score_mod, leaf, b, h, q, kv)
    torch.testing.assert_close(tile[:, :rows].t(), expected.detach(), equal_nan=True, **TOL[dtype])
    assert tile[:, rows:].isnan().all()

    dout = torch.randn(rows, cols, generator=gen, dtype=torch.float64).to(dtype)
    wrt = [leaf, *captures_with_grad]
    grads = torch.autograd.grad(expected, wrt, dout, allow_unused=True)
    ds = torch.zeros(cols, ld, dtype=dtype)
    ds[:, :rows] = dout.t()
    raw = torch.zeros(cols, ld, dtype=dtype)
    raw[:, :rows] = scores.t()
    buffers = [torch.zeros(t.shape, dtype=torch.float64) if t.dtype.is_floating_point else None for t in captures]
    program.backward(raw, ds, b, h, q, kv, captures, buffers)
    torch.testing.assert_close(ds[:, :rows].t(), grads[0], equal_nan=True, **TOL[dtype])
    for t, want in zip(captures_with_grad, grads[1:]):
        used = [i for i, c in enumerate(captures) if c is t]
        got = buffers[used[0]].to(t.dtype) if used else torch.zeros_like(t)  # a capture the plan never reads
        torch.testing.assert_close(got, torch.zeros_like(t) if want is None else want, **TOL[t.dtype])
    return program


@pytest.mark.parametrize("name", ["alibi", "softcap", "relative_bias", "head_scales", "t5_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_score_mod_patterns(name, dtype):
    score_mod, captured = score_mods(4, 40, 40, dtype=dtype, requires_grad=True)[name]
    program = run_score_tiles(score_mod, dtype, captured)
    assert program.generated.grad_captures == tuple(range(len(captured)))


@pytest.mark.parametrize("name", sorted(MASKS))
def test_mask_patterns(name):
    mask_mod = MASKS[name](50, 61)
    program, captures = compiler.mask_program(mask_mod)
    b, h, q, kv = tile_indices(17, 23, 3, 50, 61, seed=3)
    out = torch.full((23, 20), 7, dtype=torch.uint8)
    program.mask(out, b, h, q, kv, captures)
    assert torch.equal(out[:, :17].t().bool(), mask_tile(mask_mod, b, h, q, kv))
    assert (out[:, 17:] == 7).all()


def test_reads():
    mods = score_mods(4, 8, 8)
    assert compiler.score_program(mods["alibi"][0])[0].reads == {"h", "q_idx", "kv_idx"}
    assert compiler.score_program(mods["softcap"][0])[0].reads == frozenset()
    assert compiler.mask_program(padding(torch.tensor([3, 4])))[0].reads == {"b", "kv_idx"}
    assert compiler.mask_program(MASKS["prefix_lm"](8, 8))[0].reads == {"q_idx", "kv_idx"}  # b.new_zeros: not a read


# ---- random compositions -------------------------------------------------------------------------
UNARY = [
    lambda x: torch.tanh(x), lambda x: torch.sigmoid(x) * 3, lambda x: torch.exp(-torch.abs(x)),
    lambda x: torch.log1p(x * x), lambda x: torch.sqrt(torch.abs(x) + 0.5), lambda x: torch.rsqrt(x * x + 1),
    lambda x: torch.clamp(x, -1.5, 2.0), lambda x: torch.sin(x) + torch.cos(x), lambda x: torch.atan(x),
    lambda x: torch.erf(x), lambda x: x.pow(2) * 0.1, lambda x: (torch.abs(x) + 1).pow(0.7),
    lambda x: torch.exp2(-x.abs()), lambda x: torch.log2(x.abs() + 1), lambda x: torch.reciprocal(x.abs() + 1),
    lambda x: torch.expm1(x.clamp(max=1)), lambda x: torch.relu(x), lambda x: torch.remainder(x, 1.5),
    lambda x: torch.fmod(x, 1.25), lambda x: torch.div(x, 0.75, rounding_mode="floor") + x, lambda x: -x,
    lambda x: x.clamp_min(-0.5),
]
BINARY = [
    lambda x, y: x + y, lambda x, y: x - y * 0.5, lambda x, y: x * y, lambda x, y: x / (y.abs() + 1),
    lambda x, y: torch.maximum(x, y), lambda x, y: torch.minimum(x, y), lambda x, y: torch.where(x > y, x, y * 2),
    lambda x, y: torch.pow(x.abs() + 0.5, y.clamp(-1, 1)), lambda x, y: torch.remainder(x, y.abs() + 0.5),
]
# Float terms are made in the tables' dtype: PyTorch's autograd rounds some derivative intermediates
# to the dtype of a float32 operand (pow's exponent - 1), the compiled derivative does not.
TERMS = [
    lambda b, h, q, kv, tab, tab2: (q - kv).to(tab.dtype) * 0.01,
    lambda b, h, q, kv, tab, tab2: h.to(tab.dtype) * 0.5 - b,
    lambda b, h, q, kv, tab, tab2: tab[h], lambda b, h, q, kv, tab, tab2: tab2[(q + kv) % 7, b],
    lambda b, h, q, kv, tab, tab2: torch.where((q - kv) % 3 == 0, 1.0, -1.0),
    lambda b, h, q, kv, tab, tab2: ((q - kv) // 4).to(tab.dtype) * 0.1,
    lambda b, h, q, kv, tab, tab2: tab[-1 - h] * tab2[kv % 7][b % 3],
]


def random_score_mod(seed, tab, tab2):
    rng = random.Random(seed)
    plan = [(rng.randrange(len(UNARY)), rng.randrange(len(BINARY)), rng.randrange(len(TERMS))) for _ in range(3)]

    def score_mod(score, b, h, q_idx, kv_idx):
        x = score
        for unary, binary, term in plan:
            x = BINARY[binary](UNARY[unary](x), TERMS[term](b, h, q_idx, kv_idx, tab, tab2))
        return x

    return score_mod


@pytest.mark.parametrize("seed", range(6))
def test_random_score_mods(seed):
    dtype = torch.float64 if seed % 2 else torch.float32
    gen = torch.Generator().manual_seed(seed)
    tab = torch.randn(4, generator=gen, dtype=dtype).requires_grad_()
    tab2 = torch.randn(7, 3, generator=gen, dtype=dtype).requires_grad_()
    run_score_tiles(random_score_mod(seed, tab, tab2), dtype, (tab, tab2), seed=seed)


MASK_TERMS = [
    lambda b, h, q, kv, doc, lens: (q - kv) // 3 % 4 != 0, lambda b, h, q, kv, doc, lens: (q * 5 + kv * 3) % 7 < 4,
    lambda b, h, q, kv, doc, lens: torch.abs(q - kv) <= 9, lambda b, h, q, kv, doc, lens: ((q >> 2) ^ (kv >> 2)) & 1 == 0,
    lambda b, h, q, kv, doc, lens: torch.fmod(q - kv, 5) > -2,
    lambda b, h, q, kv, doc, lens: torch.div(q - kv, 4, rounding_mode="trunc") >= -1,
    lambda b, h, q, kv, doc, lens: (q * 268435456) >> 28 == q % 8,  # int32 wraps as in PyTorch
    lambda b, h, q, kv, doc, lens: doc[q] == doc[kv], lambda b, h, q, kv, doc, lens: kv < lens[b],
    lambda b, h, q, kv, doc, lens: (h + kv) % 3 != 1, lambda b, h, q, kv, doc, lens: (q << 40) == 0,
    lambda b, h, q, kv, doc, lens: (kv - q) % -5 == -1, lambda b, h, q, kv, doc, lens: torch.logical_not(q == kv),
]
COMBINE = [lambda x, y: x & y, lambda x, y: x | y, lambda x, y: x ^ y, lambda x, y: ~x | y,
           lambda x, y: torch.logical_and(x, y), lambda x, y: torch.logical_xor(x, y)]


@pytest.mark.parametrize("seed", range(6))
def test_random_mask_mods(seed):
    rng = random.Random(seed)
    plan = [(rng.randrange(len(COMBINE)), rng.randrange(len(MASK_TERMS))) for _ in range(4)]
    doc, lens = torch.arange(64) // 9, torch.tensor([40, 13, 64])

    def mask_mod(b, h, q_idx, kv_idx):
        x = MASK_TERMS[plan[0][1]](b, h, q_idx, kv_idx, doc, lens)
        for combine, term in plan[1:]:
            x = COMBINE[combine](x, MASK_TERMS[term](b, h, q_idx, kv_idx, doc, lens))
        return x

    program, captures = compiler.mask_program(mask_mod)
    b, h, q, kv = tile_indices(31, 27, 4, 64, 64, seed)
    out = torch.empty(27, 31, dtype=torch.uint8)
    program.mask(out, b, h, q, kv, captures)
    assert torch.equal(out.t().bool(), mask_tile(mask_mod, b, h, q, kv))


def test_integer_and_float_division_semantics():
    """Python-style floor division and remainder (signs), trunc division, on ints and floats."""
    def score_mod(score, b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        ints = d // 3 + d % 5 * 7 + torch.fmod(d, 4) * 11 + torch.div(d, -3, rounding_mode="floor") * 13
        floor = torch.div(score, -0.7, rounding_mode="floor")  # score // -0.7 has no derivative in PyTorch
        return ints + floor + torch.remainder(score, -1.3) + torch.div(score, 0.9, rounding_mode="trunc")

    run_score_tiles(score_mod, torch.float64, rows=40, cols=40)


# ---- what is refused, and errors at run time -----------------------------------------------------
class Holder:
    bias = torch.zeros(4)


def _object_closure(holder):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + holder.bias[h]
    return score_mod


def _branchy(score, b, h, q_idx, kv_idx):
    return score if score > 0 else -score


def _vector(score, b, h, q_idx, kv_idx):
    return score + torch.dot(Holder.bias, Holder.bias)


@pytest.mark.parametrize("fn,words", [
    (_branchy, "branches on or reads a tensor's value"),
    (lambda score, b, h, q_idx, kv_idx: score + torch.atan2(score, score), "aten.atan2"),
    (_object_closure(Holder()), "closure variable 'holder' .* holds a test_flex_codegen.Holder"),
    (_vector, "attribute of an object"),
    (lambda score, b, h, q_idx, kv_idx: score + (BF16[h] * 2), "computes in torch.bfloat16"),
    (lambda score, b, h, q_idx, kv_idx: q_idx > kv_idx, "returns torch.bool"),
    (lambda score, b, h, q_idx, kv_idx: score + BIG[h], r"shape \(3,\)"),
    (lambda score, b, h, q_idx, kv_idx: score + torch.arange(5)[q_idx % 5], "aten.arange"),
])
def test_unsupported_functions_give_reasons(fn, words):
    with pytest.raises(Unsupported, match=words) as first:
        compiler.score_program(fn)
    traces = compiler.STATS["traces"]
    with pytest.raises(Unsupported) as second:
        compiler.score_program(fn)
    assert second.value.reason == first.value.reason and compiler.STATS["traces"] == traces  # cached


BF16 = torch.ones(4, dtype=torch.bfloat16)
BIG = torch.ones(4, 3)


def test_half_precision_captures_load_exactly():
    table = torch.randn(4, 8).to(torch.bfloat16)
    halves = torch.randn(8).to(torch.float16)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, kv_idx % 8] + halves[q_idx % 8]

    run_score_tiles(score_mod, torch.float32)


def test_runtime_errors_name_the_capture():
    table = torch.randn(2, 10)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx]   # negative positions wrap, as in PyTorch

    program, captures = compiler.score_program(score_mod)
    b, h, q, kv = (torch.zeros(2, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                   torch.tensor([3, 0], dtype=torch.int32), torch.tensor([5, 1], dtype=torch.int32))
    tile = torch.zeros(2, 2)
    program.forward(tile, b, h, q, kv, captures)
    assert tile.t().tolist() == [[float(table[0, -2]), float(table[0, 2])], [float(table[1, -5]), float(table[1, -1])]]
    with pytest.raises(IndexError, match=r"dimension 1 of captured tensor #0 \(shape \(2, 10\)\)"):
        program.forward(tile, b, h, q, torch.tensor([5, 14], dtype=torch.int32), captures)

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx // (kv_idx - 3) > 0

    program, captures = compiler.mask_program(mask_mod)
    with pytest.raises(ZeroDivisionError, match="floor_divide"):
        program.mask(torch.empty(2, 2, dtype=torch.uint8), b, h, q, torch.tensor([3, 1], dtype=torch.int32), captures)


# ---- caching ---------------------------------------------------------------------------------------
def _biased(table):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score * 0.5 + table[h]
    return score_mod


def test_same_structure_is_traced_and_built_once():
    first = torch.randn(3)
    program, captures = compiler.score_program(_biased(first))
    assert captures[0] is first
    before = dict(compiler.STATS)
    second = torch.randn(3)
    again, captures = compiler.score_program(_biased(second))   # another closure, another tensor value
    assert again is program and captures[0] is second and dict(compiler.STATS) == before
    run_score_tiles(_biased(second.requires_grad_()), torch.float32, (second,), heads=3)

    compiler.score_program(_biased(torch.randn(5)))               # another shape: traced, same C source
    assert compiler.STATS["traces"] == before["traces"] + 1
    assert compiler.STATS["compiles"] == before.get("compiles", 0)


def test_caches_do_not_keep_captured_tensors_alive():
    table = torch.randn(6)
    compiler.score_program(_biased(table))
    blocks.classify(blocks.create_block_mask(padding(table.long()), 2, 1, 16, 16, BLOCK_SIZE=8), 2, 1)
    ref = weakref.ref(table)
    del table
    gc.collect()
    assert ref() is None


def test_disk_cache_serves_a_new_process():
    code = textwrap.dedent("""
        import torch
        from tileattn.flex import compiler

        def score_mod(score, b, h, q_idx, kv_idx):
            return score * 0.25 - (q_idx - kv_idx).abs() * 0.125

        program, _ = compiler.score_program(score_mod)
        print(dict(compiler.STATS), program.build_seconds)
    """)
    exec(compile(code, "<flex-cache-test>", "exec"), {})  # built here (or found on disk)
    env = dict(os.environ)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == "0.0" and "'compiles'" not in res.stdout and "'disk_hits': 1" in res.stdout


def test_no_compiler_reports_unavailable(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent")

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * 3.0 + h

    with pytest.raises(Unsupported, match="/nonexistent"):
        compiler.score_program(score_mod)
    block_mask = blocks.create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + 1, None, None, 20, 20,
                                          BLOCK_SIZE=8)
    block_map = blocks.classify(block_mask, 1, 1)
    assert "/nonexistent" in block_map.how and block_map.counts()["partial"] > 0


def test_program_addresses_for_native_callers():
    program, _ = compiler.score_program(score_mods(2, 4, 4)["softcap"][0], torch.float64)
    addresses = {program.address("ta_flex_score_fwd"), program.address("ta_flex_score_bwd")}
    assert len(addresses) == 2 and all(isinstance(a, int) and a for a in addresses)
    assert program.dtype == torch.float64 and "double *restrict s" in program.generated.source


def _scaled_by(score, b, h, q_idx, kv_idx, scales=None, shift=0.0):
    return score * scales[h] + shift


def test_partials_and_defaults_are_lifted():
    """Tensors reached through functools.partial or default arguments are arguments too; numbers
    there are part of the structure (a new value is a new program)."""
    import functools

    scales = torch.rand(4, dtype=torch.float64, requires_grad=True)
    program, captures = compiler.score_program(functools.partial(_scaled_by, scales=scales), torch.float64)
    assert captures == (scales,)
    run_score_tiles(functools.partial(_scaled_by, scales=scales), torch.float64, (scales,))
    other = torch.rand(4, dtype=torch.float64)
    assert compiler.score_program(functools.partial(_scaled_by, scales=other), torch.float64)[0] is program
    assert compiler.score_program(functools.partial(_scaled_by, scales=other, shift=1.0), torch.float64)[0] \
        is not program

    def with_default(score, b, h, q_idx, kv_idx, table=other):
        return score + table[h]

    assert compiler.score_program(with_default, torch.float64)[1] == (other,)
