"""tileattn.programs: the C tile functions compiled from score_mods and mask_mods agree with torch
evaluating the same function (torch.vmap) and with torch.autograd through it, including gradients of
captured tensors, key-major and row-major; unsupported functions give a reason; compiled code is
cached soundly (aliasing, attributes, run-time scalars), verified on disk, and safe across threads
and fork."""

from __future__ import annotations

import gc
import json
import os
import pathlib
import random
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from tileattn.flex.examples import MASKS, padding, score_mods
from tileattn.programs import blocks, compiler
from tileattn.programs.eager import mask_tile, score_tile
from tileattn.programs.trace import Unsupported, trace

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float64: dict(atol=1e-11, rtol=1e-11)}


def tile_indices(rows, cols, heads, q_len, kv_len, seed):
    gen = torch.Generator().manual_seed(seed)

    def draw(n, high):
        return torch.randint(0, high, (n,), generator=gen, dtype=torch.int32)

    return draw(rows, 3), draw(rows, heads), draw(rows, q_len), draw(cols, kv_len)


def run_score_tiles(score_mod, dtype, captures_with_grad=(), rows=13, cols=9, heads=4, q_len=40, kv_len=40, seed=0):
    """Forward (key-major, row-major and the fused logits sweep) and backward of the compiled tile
    against vmap + autograd; returns the bound program."""
    bound = compiler.score_program(score_mod, dtype)
    captures = bound.captures
    b, h, q, kv = tile_indices(rows, cols, heads, q_len, kv_len, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    scores = (torch.randn(rows, cols, generator=gen, dtype=torch.float64) * 3).to(dtype)
    ld = rows + 3  # rows past ``rows`` belong to nobody: they must stay untouched
    tile = torch.full((cols, ld), float("nan"), dtype=dtype)
    tile[:, :rows] = scores.t()
    bound.forward(tile, b, h, q, kv)
    leaf = scores.clone().requires_grad_()
    expected = score_tile(score_mod, leaf, b, h, q, kv)
    torch.testing.assert_close(tile[:, :rows].t(), expected.detach(), equal_nan=True, **TOL[dtype])
    assert tile[:, rows:].isnan().all()
    fused = torch.full((cols, ld), float("nan"), dtype=dtype)
    fused[:, :rows] = scores.t() * 2
    top = torch.full((ld,), -float("inf"), dtype=dtype)
    bound.logits(fused, b, h, q, kv, 0.5, top)
    logits = expected.detach() * 1.4426950408889634
    torch.testing.assert_close(fused[:, :rows].t(), logits, equal_nan=True, **TOL[dtype])
    no_nan = logits.masked_fill(logits.isnan(), -float("inf"))  # a NaN score never becomes a row's maximum
    torch.testing.assert_close(top[:rows], no_nan.max(1).values, equal_nan=True, **TOL[dtype])
    row_major = torch.full((rows, cols + 2), float("nan"), dtype=dtype)
    row_major[:, :cols] = scores
    bound.forward_rows(row_major, b, h, q, kv)
    torch.testing.assert_close(row_major[:, :cols], expected.detach(), equal_nan=True, **TOL[dtype])
    assert row_major[:, cols:].isnan().all()

    dout = torch.randn(rows, cols, generator=gen, dtype=torch.float64).to(dtype)
    wrt = [leaf, *captures_with_grad]
    grads = torch.autograd.grad(expected, wrt, dout, allow_unused=True)
    ds = torch.zeros(cols, ld, dtype=dtype)
    ds[:, :rows] = dout.t()
    raw = torch.zeros(cols, ld, dtype=dtype)
    raw[:, :rows] = scores.t()
    buffers = [torch.zeros(t.shape, dtype=dtype) if t.dtype.is_floating_point else None for t in captures]
    bound.backward(raw, ds, b, h, q, kv, buffers)
    torch.testing.assert_close(ds[:, :rows].t(), grads[0], equal_nan=True, **TOL[dtype])
    for t, want in zip(captures_with_grad, grads[1:]):
        used = [i for i, c in enumerate(captures) if c is t]
        got = buffers[used[0]].to(t.dtype) if used else torch.zeros_like(t)  # a capture the plan never reads
        torch.testing.assert_close(got, torch.zeros_like(t) if want is None else want, **TOL[t.dtype])
    return bound


@pytest.mark.parametrize("name", ["alibi", "softcap", "relative_bias", "head_scales", "t5_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_score_mod_patterns(name, dtype):
    score_mod, captured = score_mods(4, 40, 40, dtype=dtype, requires_grad=True)[name]
    bound = run_score_tiles(score_mod, dtype, captured)
    assert bound.program.generated.grad_captures == tuple(range(len(captured)))


@pytest.mark.parametrize("name", sorted(MASKS))
def test_mask_patterns(name):
    mask_mod = MASKS[name](50, 61)
    bound = compiler.mask_program(mask_mod)
    b, h, q, kv = tile_indices(17, 23, 3, 50, 61, seed=3)
    out = torch.full((23, 20), 7, dtype=torch.uint8)
    bound.mask(out, b, h, q, kv)
    expected = mask_tile(mask_mod, b, h, q, kv)
    assert torch.equal(out[:, :17].t().bool(), expected)
    assert (out[:, 17:] == 7).all()
    rows = torch.full((17, 25), 7, dtype=torch.uint8)
    bound.mask_rows(rows, b, h, q, kv)
    assert torch.equal(rows[:, :23].bool(), expected) and (rows[:, 23:] == 7).all()


def test_reads():
    mods = score_mods(4, 8, 8)
    assert compiler.score_program(mods["alibi"][0]).program.reads == {"h", "q_idx", "kv_idx"}
    assert compiler.score_program(mods["softcap"][0]).program.reads == frozenset()
    assert compiler.mask_program(padding(torch.tensor([3, 4]))).program.reads == {"b", "kv_idx"}
    assert compiler.mask_program(MASKS["prefix_lm"](8, 8)).program.reads == {"q_idx", "kv_idx"}  # not a read


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

    bound = compiler.mask_program(mask_mod)
    b, h, q, kv = tile_indices(31, 27, 4, 64, 64, seed)
    out = torch.empty(27, 31, dtype=torch.uint8)
    bound.mask(out, b, h, q, kv)
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
    (_object_closure(Holder()), "closure variable 'holder' .* holds a test_programs.Holder"),
    (_vector, "aten.dot"),
    (lambda score, b, h, q_idx, kv_idx: score + (BF16[h] * 2), "computes in torch.bfloat16"),
    (lambda score, b, h, q_idx, kv_idx: q_idx > kv_idx, "returns torch.bool"),
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

    bound = compiler.score_program(score_mod)
    b, h, q, kv = (torch.zeros(2, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                   torch.tensor([3, 0], dtype=torch.int32), torch.tensor([5, 1], dtype=torch.int32))
    tile = torch.zeros(2, 2)
    bound.forward(tile, b, h, q, kv)
    assert tile.t().tolist() == [[float(table[0, -2]), float(table[0, 2])], [float(table[1, -5]), float(table[1, -1])]]
    with pytest.raises(IndexError, match=r"dimension 1 of captured tensor #0 \(shape \(2, 10\)\)"):
        bound.forward(tile, b, h, q, torch.tensor([5, 14], dtype=torch.int32))

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx // (kv_idx - 3) > 0

    bound = compiler.mask_program(mask_mod)
    with pytest.raises(ZeroDivisionError, match="floor_divide"):
        bound.mask(torch.empty(2, 2, dtype=torch.uint8), b, h, q, torch.tensor([3, 1], dtype=torch.int32))


# ---- caching ---------------------------------------------------------------------------------------
def _biased(table):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score * 0.5 + table[h]
    return score_mod


def test_same_structure_is_traced_and_built_once():
    first = torch.randn(3)
    bound = compiler.score_program(_biased(first))
    assert bound.captures[0] is first
    before = dict(compiler.STATS)
    second = torch.randn(3)
    again = compiler.score_program(_biased(second))   # another closure, another tensor value
    assert again.program is bound.program and again.captures[0] is second and dict(compiler.STATS) == before
    run_score_tiles(_biased(second.requires_grad_()), torch.float32, (second,), heads=3)

    longer = compiler.score_program(_biased(torch.randn(5)))      # another size, same rank: same program
    assert longer.program is bound.program and dict(compiler.STATS) == before
    compiler.score_program(_biased(torch.randn(5, dtype=torch.float64)))  # another dtype: traced
    assert compiler.STATS["traces"] == before["traces"] + 1


def test_caches_do_not_keep_captured_tensors_alive():
    table = torch.randn(6)
    compiler.score_program(_biased(table))
    blocks.create_block_mask(padding(table.long()), 2, 1, 16, 16, BLOCK_SIZE=8)
    ref = weakref.ref(table)
    del table
    gc.collect()
    assert ref() is None


def test_disk_cache_serves_a_new_process():
    code = textwrap.dedent("""
        import torch
        from tileattn.programs import compiler

        def score_mod(score, b, h, q_idx, kv_idx):
            return score * 0.25 - (q_idx - kv_idx).abs() * 0.125

        bound = compiler.score_program(score_mod)
        print(dict(compiler.STATS), bound.program.build_seconds)
    """)
    exec(compile(code, "<programs-cache-test>", "exec"), {})  # built here (or found on disk)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                         timeout=300)
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
    assert blocks.states_of(block_mask).counts()["partial"] > 0


def test_program_addresses_for_native_callers():
    program = compiler.score_program(score_mods(2, 4, 4)["softcap"][0], torch.float64).program
    addresses = {program.address(name) for name in compiler.FUNCTIONS["score"]}
    assert len(addresses) == 4 and all(isinstance(a, int) and a for a in addresses)
    assert program.dtype == torch.float64 and "double *restrict s" in program.generated.source


def _scaled_by(score, b, h, q_idx, kv_idx, scales=None, shift=0.0):
    return score * scales[h] + shift


def test_partials_and_defaults_are_lifted():
    """Tensors reached through functools.partial or default arguments are arguments too; so are their
    floats (run-time scalars: a new value is the same program)."""
    import functools

    scales = torch.rand(4, dtype=torch.float64, requires_grad=True)
    bound = compiler.score_program(functools.partial(_scaled_by, scales=scales), torch.float64)
    assert bound.captures == (scales,) and bound.scalars == (0.0,)
    run_score_tiles(functools.partial(_scaled_by, scales=scales), torch.float64, (scales,))
    other = torch.rand(4, dtype=torch.float64)
    assert compiler.score_program(functools.partial(_scaled_by, scales=other), torch.float64).program is bound.program
    shifted = compiler.score_program(functools.partial(_scaled_by, scales=other, shift=1.0), torch.float64)
    moved = compiler.score_program(functools.partial(_scaled_by, scales=other, shift=2.5), torch.float64)
    assert moved.program is shifted.program and (shifted.scalars[-1], moved.scalars[-1]) == (1.0, 2.5)
    run_score_tiles(functools.partial(_scaled_by, scales=scales, shift=2.5), torch.float64, (scales,))

    def with_default(score, b, h, q_idx, kv_idx, table=other):
        return score + table[h]

    assert compiler.score_program(with_default, torch.float64).captures == (other,)


# ---- soundness of the program key (hardening: a reused program must mean what the function means) --
def _two_tables(x, y):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + x[q_idx] - y[kv_idx]
    return score_mod


def test_aliased_captures_get_their_own_program():
    """One tensor captured twice reads one slot; two tensors of that shape must not share that program
    (it read one table twice: a document mask lost almost every pair, a gradient was lost)."""
    t, u = torch.randn(40), torch.randn(40)
    same = compiler.score_program(_two_tables(t, t))
    other = compiler.score_program(_two_tables(t, u))
    assert other.program is not same.program and len(same.captures) == 1 and len(other.captures) == 2
    run_score_tiles(_two_tables(t, t.clone()), torch.float32)
    run_score_tiles(_two_tables(t.requires_grad_(), u.requires_grad_()), torch.float32, (t, u))

    doc_a, doc_b = torch.arange(40) // 10, torch.arange(40) // 20

    def document(doc_q, doc_kv):
        return lambda b, h, q_idx, kv_idx: doc_q[q_idx] == doc_kv[kv_idx]

    compiler.mask_program(document(doc_a, doc_a))
    b, h, q, kv = tile_indices(40, 40, 1, 40, 40, seed=0)
    q, kv = torch.arange(40, dtype=torch.int32), torch.arange(40, dtype=torch.int32)
    out = torch.empty(40, 40, dtype=torch.uint8)
    compiler.mask_program(document(doc_a, doc_b)).mask(out, b, h, q, kv)
    assert torch.equal(out.t().bool(), doc_a[:, None] == doc_b[None, :])


class Cfg:
    temperature = 2.0


def test_attributes_of_classes_and_modules_are_read_per_call():
    """A score_mod reading ``Cfg.temperature`` or ``module.slope`` must see the attribute's value now,
    never the one a cached program baked in."""
    import types as pytypes

    module = pytypes.ModuleType("user_settings")
    module.slope = 0.5
    globals()["user_settings"] = module

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * Cfg.temperature - user_settings.slope * (q_idx - kv_idx)  # noqa: F821

    try:
        first = run_score_tiles(score_mod, torch.float32)
        Cfg.temperature, module.slope = 3.0, -1.25
        second = run_score_tiles(score_mod, torch.float32)
        assert second.program is not first.program
    finally:
        Cfg.temperature = 2.0
        del globals()["user_settings"]


def test_float_constants_are_run_time_scalars():
    """A changing temperature neither retraces nor recompiles nor loads another library; a float the
    function uses in Python itself is traced in and keys the program by its value."""
    def tempered(temperature):
        return lambda score, b, h, q_idx, kv_idx: torch.tanh(score / temperature) * temperature

    run_score_tiles(tempered(30.0), torch.float32)
    before, libraries = dict(compiler.STATS), len(compiler._LIBRARIES)
    for t in (0.5, 7.25, 1e3, float("inf")):
        bound = run_score_tiles(tempered(t), torch.float32)
        assert bound.scalars == (t,)
    assert dict(compiler.STATS) == before and len(compiler._LIBRARIES) == libraries

    def branchy(temperature):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score * temperature if temperature > 1 else score - temperature
        return score_mod

    hot, cold = run_score_tiles(branchy(2.0), torch.float32), run_score_tiles(branchy(0.5), torch.float32)
    assert hot.program is not cold.program and hot.scalars == cold.scalars == ()


_READS = {  # what the function does with its captured tensor t in Python -> words of the refusal
    "tolist": (lambda t: lambda score, b, h, q_idx, kv_idx: score * t.tolist()[0], "values .*tolist"),
    "item": (lambda t: lambda score, b, h, q_idx, kv_idx: score * t[0, 0].item(), "value"),
    "bool": (lambda t: lambda score, b, h, q_idx, kv_idx: score * (2.0 if t[0, 0] > 1 else 1.0), "value"),
    "int": (lambda t: lambda score, b, h, q_idx, kv_idx: score * int(t.sum()), "value"),
    "numpy": (lambda t: lambda score, b, h, q_idx, kv_idx: score * float(t.numpy()[0]), "values .*numpy"),
    "iteration": (lambda t: lambda score, b, h, q_idx, kv_idx: score * max(x.item() for x in t[0]), "value"),
    "torch.tensor": (lambda t: lambda score, b, h, q_idx, kv_idx: score * torch.tensor(t)[h % 2], "copies"),
    "stride": (lambda t: lambda score, b, h, q_idx, kv_idx: score * t.stride(0), "layout .*stride"),
    "is_contiguous": (lambda t: lambda score, b, h, q_idx, kv_idx: score * (1.0 if t.is_contiguous() else 2.0),
                      "layout .*is_contiguous"),
    "data_ptr": (lambda t: lambda score, b, h, q_idx, kv_idx: score * (t.data_ptr() % 2), "layout .*data_ptr"),
}


@pytest.mark.parametrize("name", sorted(_READS))
def test_python_reads_of_a_captures_values_or_layout_are_refused_not_compiled_in(name):
    """A value or a stride a captured tensor yields in Python must never become a constant of a
    program another tensor (another value, a transposed view) then reuses: the function is refused
    with the reason, and runs exactly through torch.vmap."""
    make, words = _READS[name]
    first, other = torch.tensor([[2.0, 0.5], [1.0, 3.0]]), torch.tensor([[0.25, 4.0], [1.5, 1.0]]).t()
    for t in (first, other):
        with pytest.raises(Unsupported, match=words):
            compiler.score_program(make(t))


def _scaled_by_length(table):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score * len(table) + table[kv_idx % table.shape[0]]
    return score_mod


def test_captures_are_keyed_by_rank_unless_python_reads_their_sizes(monkeypatch):
    """The C reads a capture's sizes at run time: a table that grows each decode step is one program,
    indexed and bounds-checked with its size now. A function that reads the sizes in Python has them
    compiled in, so it is keyed by them."""
    traces = compiler.STATS["traces"]
    bound = compiler.score_program(_biased(torch.randn(4)))
    for n in range(5, 12):
        grown = torch.randn(n)
        assert compiler.score_program(_biased(grown)).program is bound.program
        run_score_tiles(_biased(grown), torch.float32, heads=n)
    assert compiler.STATS["traces"] <= traces + 1
    short = compiler.score_program(_biased(torch.randn(2)))
    with pytest.raises(IndexError, match=r"captured tensor #0 \(shape \(2,\)\)"):
        short.forward(torch.zeros(1, 1), *(torch.tensor([3], dtype=torch.int32) for _ in range(4)))

    sized = [run_score_tiles(_scaled_by_length(torch.randn(n)), torch.float32) for n in (3, 7)]
    assert sized[0].program is not sized[1].program
    assert compiler.score_program(_scaled_by_length(torch.randn(7))).program is sized[1].program
    with pytest.raises(ValueError, match=r"built for torch.float32 of sizes \(7,\)"):
        sized[1].program.check_captures((torch.randn(3),))

    calls = []
    monkeypatch.setattr(compiler, "trace", lambda *args, **kwargs: calls.append(1) or trace(*args, **kwargs))
    for n in range(2, 8):  # refused (t[9] is out of range): once, not once per size
        with pytest.raises(Unsupported, match="tracing failed"):
            compiler.score_program(lambda score, b, h, q_idx, kv_idx, t=torch.randn(n): score + t[9] * t[h])
    assert len(calls) == 1


def test_a_container_that_contains_itself_is_refused_with_a_reason():
    """A closure over a list holding itself is refused, and runs through torch.vmap (it raised
    RecursionError out of the call)."""
    loop = [torch.ones(3)]
    loop.append(loop)

    def looped(score, b, h, q_idx, kv_idx):
        return score * loop[0][h]

    with pytest.raises(Unsupported, match="list that contains itself"):
        compiler.score_program(looped)


def test_a_sparse_capture_refused_does_not_refuse_a_dense_one():
    """The key holds each capture's layout: a sparse capture refused must not send a dense capture of
    the same code to the fallback."""
    table = torch.rand(4) + 0.5
    with pytest.raises(Unsupported, match="torch.sparse_coo tensor"):
        compiler.score_program(_biased(table.to_sparse()))
    run_score_tiles(_biased(table), torch.float32)


def test_the_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(compiler, "MEMO_SIZE", 3)
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.int16):
        compiler.score_program(_biased(torch.zeros(5, dtype=dtype)))
    assert len(compiler._MEMO) == 3


def test_an_empty_captured_tensor_raises_index_error_not_a_crash():
    empty = torch.zeros(0)
    bound = compiler.score_program(lambda score, b, h, q_idx, kv_idx: score + empty[h])
    b, h, q, kv = tile_indices(3, 2, 2, 4, 4, seed=0)
    with pytest.raises(IndexError, match="empty"):
        bound.forward(torch.zeros(2, 3), b, h, q, kv)
    with pytest.raises(IndexError, match="empty"):
        blocks.create_block_mask(lambda b, h, q_idx, kv_idx: empty[q_idx] > 0, None, None, 8, 8, BLOCK_SIZE=4)


_DAMAGE = {"truncated": lambda data: data[: len(data) // 2], "scrambled": lambda data: bytes(reversed(data)),
           "empty": lambda data: b""}


@pytest.mark.parametrize("how", ["truncated", "scrambled", "empty", "another function's"])
def test_a_damaged_library_on_disk_is_rebuilt_not_loaded(tmp_path, how):
    """Program libraries carry the engine library's size + SHA-256 record: a damaged or replaced file
    is rebuilt (in a fresh process, where it would otherwise be loaded and crash or run other code)."""
    code = textwrap.dedent("""
        import json, sys, torch
        from tileattn.programs import compiler
        scale = float(sys.argv[1])
        bound = compiler.score_program(lambda score, b, h, q_idx, kv_idx: score * 2 + q_idx + int(scale))
        tile = torch.zeros(1, 1)
        i = torch.zeros(1, dtype=torch.int32)
        bound.forward(tile, i, i, i + 3, i)
        print(json.dumps([bound.program.path, tile.item(), dict(compiler.STATS)]))
    """)
    env = dict(os.environ, TILEATTN_CACHE_DIR=str(tmp_path))
    run = lambda *args: subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,  # noqa
                                       env=env, timeout=300)
    first = run("1")
    assert first.returncode == 0, first.stderr
    path, value, _ = json.loads(first.stdout.splitlines()[-1])
    assert value == 4.0
    lib = pathlib.Path(path)
    if how == "another function's":
        other = run("5")
        assert other.returncode == 0, other.stderr
        lib.write_bytes(pathlib.Path(json.loads(other.stdout.splitlines()[-1])[0]).read_bytes())
    else:
        lib.write_bytes(_DAMAGE[how](lib.read_bytes()))
    again = run("1")
    assert again.returncode == 0, f"exit {again.returncode}: {again.stderr[-2000:]}"
    _, value, stats = json.loads(again.stdout.splitlines()[-1])
    assert value == 4.0 and stats.get("compiles") == 1


def test_compiling_one_function_does_not_stall_calls_of_built_ones_nor_a_forked_child():
    """A thread compiling a new function holds only that function's lock: another thread's call of a
    program already built goes on, and a child forked meanwhile compiles on its own (no lock is
    inherited held)."""
    import threading
    import time

    built = compiler.score_program(_biased(torch.randn(4)))
    release = threading.Event()
    original = compiler._library

    def slow_library(source):
        release.wait(30)
        return original(source)

    compiler._library = slow_library
    try:
        worker = threading.Thread(target=compiler.score_program,
                                  args=(lambda score, b, h, q_idx, kv_idx: score * q_idx + 0.125 * kv_idx,))
        worker.start()
        time.sleep(0.3)  # the worker now holds its function's lock, waiting in the build
        start = time.perf_counter()
        again = compiler.score_program(_biased(torch.randn(4)))
        assert again.program is built.program and time.perf_counter() - start < 1.0
        pid = os.fork()
        if pid == 0:  # the child: a function of its own, compiled while the parent's build is under way
            try:
                compiler._library = original
                child = compiler.score_program(lambda score, b, h, q_idx, kv_idx: score * q_idx + 0.125 * kv_idx)
                os._exit(0 if child.program is not None else 1)
            except BaseException:  # noqa: BLE001
                os._exit(2)
        deadline = time.time() + 120
        while time.time() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung on a lock the parent held")
        assert os.WEXITSTATUS(status) == 0
    finally:
        release.set()
        compiler._library = original
        worker.join(60)


def test_library_combinators_are_keyed_by_the_functions_they_hold():
    """``and_masks``/``or_masks`` return closures defined in PyTorch: their programs must differ with
    the user functions they combine (keying them by their name would run one mask for another)."""
    from torch.nn.attention.flex_attention import and_masks

    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < 3

    def even(b, h, q_idx, kv_idx):
        return kv_idx % 2 == 0

    causal = MASKS["causal"](8, 8)
    first, second = compiler.mask_program(and_masks(causal, near)), compiler.mask_program(and_masks(causal, even))
    assert first.program is not second.program
    q, kv = torch.arange(8, dtype=torch.int32), torch.arange(8, dtype=torch.int32)
    zeros = torch.zeros(8, dtype=torch.int32)
    for bound, fn in ((first, near), (second, even)):
        out = torch.empty(8, 8, dtype=torch.uint8)
        bound.mask(out, zeros, zeros, q, kv)
        assert torch.equal(out.t().bool(), mask_tile(and_masks(causal, fn), zeros, zeros, q, kv))
