"""Inputs whose strides the kernels do not read directly: a head dim that is not unit-stride (a
transposed (…, D, S) tensor viewed as (…, S, D)) and index tensors that are views (``t[::2]``).

They are valid calls: every engine ``explain`` names must run them, forward and backward, within
FlashAttention's rule of the fp64 reference, and ``auto`` must run what ``explain`` says it picks
(the native engine used to be chosen and then refuse with "expected a unit stride in the last
dimension"). Gradients reach the caller's tensors in their own layout. The Triton engine runs the
same inputs in tests/test_triton.py (interpreter).
"""

from __future__ import annotations

import pytest
import torch

import tileattn
from tileattn.core.dispatch import explain, get_backend
from tileattn.core.spec import build_spec
from tileattn.core.testing import check_against_reference

from conftest import CPU_BACKENDS, assert_matches_reference, attention_fn


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def head_dim_transposed():
    """(B, N, S, D) views of (B, N, D, S) storage, Sq != Sk, GQA; q's head dim stride is Sq."""
    q = _randn(2, 4, 32, 37, seed=1).transpose(-1, -2)
    k, v = (_randn(2, 2, 32, 45, seed=s).transpose(-1, -2) for s in (2, 3))
    return (q, k, v), dict(causal=True, return_lse=True), True


def head_dim_outermost_bsnd():
    """(B, S, N, D) views of (B, D, S, N) storage: the head dim has the largest stride but one. Dense,
    so check_against_reference's clones keep these strides."""
    q, k, v = (_randn(2, 20, 21, 3, seed=s).permute(0, 2, 3, 1) for s in (4, 5, 6))
    return (q, k, v), dict(layout="BSND", window=(7, 2)), True


def seqused_k_view():
    q, k, v = (_randn(3, 2, 5 if i == 0 else 40, 16, seed=7 + i) for i in range(3))
    used = torch.tensor([40, -1, 9, -1, 0, -1], dtype=torch.int32)[::2]
    return (q, k, v), dict(seqused_k=used, causal=True), True


def cu_seqlens_views():
    cu_q = torch.tensor([0, 99, 5, 99, 22], dtype=torch.int32)[::2]
    cu_k = torch.tensor([0, 99, 9, 99, 31], dtype=torch.int32)[::2]
    q, k, v = _randn(22, 4, 16, seed=10), _randn(31, 2, 16, seed=11), _randn(31, 2, 24, seed=12)
    return (q, k, v), dict(layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True), True


def paged_views():
    """A paged cache whose block table skips rows and columns of a bigger table; seqused_k a view."""
    pool_k, pool_v = _randn(6, 4, 2, 16, seed=13), _randn(6, 4, 2, 16, seed=14)
    big = torch.tensor([[5, 9, 0, 9, 3, 9], [9, 9, 9, 9, 9, 9], [1, 9, 4, 9, 2, 9]], dtype=torch.int32)
    table = big[::2, ::2]
    used = torch.tensor([12, 0, 7, 0], dtype=torch.int32)[::2]
    q = _randn(2, 3, 4, 16, seed=15)
    return (q, pool_k, pool_v), dict(layout="BSND", block_table=table, seqused_k=used), False


CASES = {f.__name__: f for f in (head_dim_transposed, head_dim_outermost_bsnd, seqused_k_view, cu_seqlens_views,
                                 paged_views)}


def test_the_cases_have_the_strides_they_are_named_for():
    (q, k, v), kw, _ = head_dim_transposed()
    assert q.stride(-1) != 1 and k.stride(-1) != 1 and v.stride(-1) != 1
    (q, _, _), kw, _ = head_dim_outermost_bsnd()
    assert q.stride(-1) == 21 * 3 and q.clone().stride() == q.stride()
    for case in (seqused_k_view, cu_seqlens_views, paged_views):
        _, kw, _ = case()
        views = [t for name, t in kw.items() if name in ("seqused_k", "cu_seqlens_q", "cu_seqlens_k", "block_table")]
        assert views and not any(t.is_contiguous() for t in views), case.__name__


@pytest.mark.parametrize("engine", CPU_BACKENDS + ("auto",))
@pytest.mark.parametrize("case", CASES)
def test_every_engine_explain_names_runs_the_call(case, engine):
    (q, k, v), kwargs, grad = CASES[case]()
    claims = explain(build_spec(q, k, v, **{n: x for n, x in kwargs.items() if n != "return_lse"}), backward=grad)
    if engine != "auto":
        assert claims[engine] == [], f"{engine} refuses a valid call: {claims[engine]}"
        assert_matches_reference(engine, q, k, v, grad=grad, **kwargs)
        return
    verdicts = check_against_reference(attention_fn("auto"), q, k, v, grad=grad, **kwargs)
    expected = ["out"] + (["lse"] if kwargs.get("return_lse") else []) + (["dq", "dk", "dv"] if grad else [])
    assert [v.name for v in verdicts] == expected and all(v.ok for v in verdicts), [str(v) for v in verdicts]


@pytest.mark.parametrize("case", CASES)
def test_auto_runs_the_engine_explain_names(case):
    (q, k, v), kwargs, _ = CASES[case]()
    claims = tileattn.explain(q, k, v, **kwargs)
    named = next(name for name, why in claims.items() if not why and get_backend(name).auto)
    auto = tileattn.flash_attention(q, k, v, **kwargs)
    picked = tileattn.flash_attention(q, k, v, backend=named, **kwargs)
    for a, b in zip(auto, picked) if isinstance(auto, tuple) else [(auto, picked)]:
        assert torch.equal(a, b), f"auto did not run {named}, which explain() names"


@pytest.mark.parametrize("engine", CPU_BACKENDS)
def test_gradients_reach_the_callers_tensors_in_their_layout(engine):
    (q, k, v), kwargs, _ = head_dim_transposed()
    assert q.clone().stride() == q.stride()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = tileattn.flash_attention(*leaves, backend=engine, **kwargs)
    (out.sum() + lse.sum()).backward()
    for t in leaves:
        assert t.grad is not None and t.grad.stride() == t.stride() and torch.isfinite(t.grad).all()
