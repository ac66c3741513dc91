"""FlashAttention's accuracy rule, shared by the tests, ``tileattn verify``, benchmarks and the hub.

A kernel's output is judged against an fp64 oracle: its max error may be at most ``factor`` (2) times
the max error of plain PyTorch math run in the inputs' own dtype, plus a small floor for the dtype.
Plain math in fp64 has error ~0 against the oracle, so the floor is what judges fp64 engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .reference import reference

FLOORS = {
    torch.float64: 1e-10,
    torch.float32: 2e-6,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


@dataclass
class Verdict:
    name: str
    error: float
    baseline_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    def __str__(self) -> str:
        flag = "PASS" if self.ok else "FAIL"
        return (f"{self.name}: max err {self.error:.3e} <= tol {self.tolerance:.3e} "
                f"(2x plain-math err {self.baseline_error:.3e} + floor) {flag}")


def max_error(x: torch.Tensor, oracle: torch.Tensor) -> float:
    """Max |x - oracle| in fp64; positions where both are equal infinities/NaN count as 0."""
    x = x.detach().to(torch.float64)
    oracle = oracle.detach().to(torch.float64)
    if x.shape != oracle.shape:
        raise AssertionError(f"shape mismatch: {tuple(x.shape)} vs oracle {tuple(oracle.shape)}")
    if x.numel() == 0:
        return 0.0
    same = (x == oracle) | (torch.isnan(x) & torch.isnan(oracle))
    diff = (x - oracle).abs().masked_fill(same, 0.0)
    return float(diff.nan_to_num(nan=float("inf")).max())


def judge(name, result, oracle, baseline, dtype, factor: float = 2.0, floor: float = None) -> Verdict:
    """Verdict for ``result`` vs ``oracle`` (fp64), with ``baseline`` = plain math in ``dtype``."""
    base = max_error(baseline, oracle)
    if floor is None:
        # Scale the floor by the largest *finite* magnitude: an LSE of -inf (a row that sees no key)
        # must not make the tolerance infinite.
        finite = oracle.detach()[torch.isfinite(oracle.detach())]
        magnitude = float(finite.abs().max()) if finite.numel() else 1.0
        floor = FLOORS[dtype] * max(1.0, magnitude)
    return Verdict(name, max_error(result, oracle), base, factor * base + floor)


def check_against_reference(fn, q, k, v, grad=True, grad_seed=0, **kwargs):
    """Run ``fn(q, k, v, **kwargs)`` and the reference (fp64 and same-dtype), forward and backward.

    ``grad_seed`` draws the output gradient; a ``seed`` in ``kwargs`` reaches ``fn`` and the reference
    alike, so a dropout check compares the same dropout mask.

    Returns a list of :class:`Verdict` for out, lse (when ``fn`` returns one) and dq, dk, dv (and
    dbias when ``kwargs['bias']`` requires grad).
    """
    dtype = q.dtype
    bias = kwargs.get("bias")
    want_dbias = bias is not None and bias.requires_grad

    def run(f, cdt, *tensors):
        leaves = [t.detach().clone().requires_grad_(grad) for t in tensors]
        kw = dict(kwargs)
        if want_dbias:
            kw["bias"] = bias.detach().clone().requires_grad_(True)
        if cdt is None:
            res = f(*leaves, **kw)
        else:
            res = reference(*leaves, compute_dtype=cdt, **kw)
        out = res[0] if isinstance(res, tuple) else res
        lse = res[1] if isinstance(res, tuple) else None
        grads = []
        if grad:
            gen = torch.Generator(device=out.device).manual_seed(grad_seed + 1)
            dout = torch.randn(out.shape, generator=gen, dtype=torch.float32, device=out.device)
            wrt = leaves + ([kw["bias"]] if want_dbias else [])
            grads = torch.autograd.grad(out, wrt, dout.to(out.dtype))
        return out, lse, grads

    out, lse, grads = run(fn, None, q, k, v)
    o64, l64, g64 = run(None, torch.float64, q, k, v)
    ob, lb, gb = run(None, dtype, q, k, v)
    verdicts = [judge("out", out, o64, ob, dtype)]
    if lse is not None:
        verdicts.append(judge("lse", lse, l64, lb, dtype))
    for name, a, b, c in zip(("dq", "dk", "dv", "dbias"), grads, g64, gb):
        verdicts.append(judge(name, a, b, c, dtype))
    return verdicts
