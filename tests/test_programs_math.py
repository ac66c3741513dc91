"""The prelude's fp32 exp, exp2, log, log2, tanh and sigmoid (inline, so compiled tile loops
vectorise) against correctly rounded values: within 2 ulp over the fp32 range, and libm's values at
NaN, +-inf, 0, overflow and underflow."""

from __future__ import annotations

import math

import pytest
import torch

from tileattn.programs import compiler

FUNCTIONS = {
    "exp": (torch.exp, (-104.0, 89.0)),
    "exp2": (torch.exp2, (-150.0, 128.0)),
    "log": (torch.log, (1e-44, 3e38)),
    "log2": (torch.log2, (1e-44, 3e38)),
    "tanh": (torch.tanh, (-12.0, 12.0)),
    "sigmoid": (torch.sigmoid, (-105.0, 90.0)),
}
SPECIAL = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 3.4e38, -3.4e38, 0.5,
           88.8, -103.9, 127.9, -149.9, 0.39999, 0.40001]


def _compiled(name, x):
    fn = getattr(torch, name)
    bound = compiler.score_program(lambda score, b, h, q_idx, kv_idx: fn(score))
    tile = x.clone().reshape(-1, 1)  # key-major (cols, ld): one row
    zeros = torch.zeros(1, dtype=torch.int32)
    bound.forward(tile, zeros, zeros, zeros, torch.zeros(tile.shape[0], dtype=torch.int32))
    return tile.reshape(-1)


def _ulps(got, want):
    """Distance in units in the last place of fp32 (0 where both are the same NaN/inf)."""
    exact = (got == want) | (got.isnan() & want.isnan())
    spacing = torch.nextafter(want.abs(), torch.tensor(math.inf)) - want.abs()
    spacing = torch.where(spacing > 0, spacing, torch.finfo(torch.float32).tiny)
    return torch.where(exact, 0.0, ((got.double() - want.double()).abs() / spacing.double()))


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_within_two_ulp_and_exact_at_special_points(name):
    fn, (lo, hi) = FUNCTIONS[name]
    gen = torch.Generator().manual_seed(7)
    if lo > 0:  # logarithms: uniform in the exponent
        x = torch.exp(torch.empty(20000, dtype=torch.float64).uniform_(math.log(lo), math.log(hi), generator=gen))
    else:
        x = torch.empty(20000, dtype=torch.float64).uniform_(lo, hi, generator=gen)
    x = torch.cat([x.float(), torch.tensor(SPECIAL)])
    got = _compiled(name, x)
    want = fn(x.double()).float()  # correctly rounded from fp64
    ulps = _ulps(got, want)
    assert float(ulps.max()) <= 2.0, (name, float(ulps.max()), float(x[ulps.argmax()]))


def test_the_inline_functions_vectorise():
    """A loop over any of them vectorises (GCC's report), in the flags programs are built with: the
    reason they exist. An int flag in integer arithmetic, for one, once kept log's loop scalar."""
    import subprocess
    import tempfile
    from pathlib import Path

    from tileattn.programs import codegen

    try:
        cc, _, isa, flags = compiler._toolchain()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no toolchain: {exc}")
    from tileattn.programs import toolchain

    predefined = toolchain.macros(tuple(cc), ()) or frozenset()
    if "__GNUC__" not in predefined or "__clang__" in predefined:
        pytest.skip("the vectorisation report read here is GCC's")
    names = ["ta_expf", "ta_exp2f", "ta_logf", "ta_log2f", "ta_tanhf", "ta_sigmoidf"]
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            src = Path(tmp) / f"{name}.c"
            src.write_text(codegen.PRELUDE + f"\nvoid f(int n, float *restrict a) {{ for (int i = 0; i < n; i++) "
                           f"a[i] = {name}(a[i]); }}\n")
            res = subprocess.run(list(cc) + ["-O3", "-std=gnu11", *flags, "-c", str(src), "-o", str(src) + ".o",
                                             "-fopt-info-vec-optimized"], capture_output=True, text=True)
            assert res.returncode == 0, res.stderr[-2000:]
            assert "loop vectorized" in res.stderr, (name, isa, res.stderr[-1000:])
