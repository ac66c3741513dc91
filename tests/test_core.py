"""Core operator: shapes, layouts, dtypes, LSE, gradients, determinism, edge cases and dispatch.

Every numerical check compares against the fp64 reference with FlashAttention's 2x rule, for each
engine that runs on CPU (``cpu`` and ``reference``).
"""

from __future__ import annotations

import math

import pytest
import torch

import tileattn
from tileattn import NoBackendError
from tileattn.core.dispatch import Backend, list_backends
from tileattn.core.engine import _REGISTRY

from conftest import assert_matches_reference, assert_nonfinite_like_reference, attention_fn, make_qkv, strided_view

ALL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    "sq, sk",
    [(1, 1), (17, 17), (127, 127), (1, 333), (333, 17), (17, 127)],
)
@pytest.mark.parametrize("causal", [False, True])
def test_odd_lengths(backend, sq, sk, causal):
    q, k, v = make_qkv(b=1, hq=2, sq=sq, sk=sk, d=16)
    assert_matches_reference(backend, q, k, v, causal=causal, return_lse=True)


@pytest.mark.parametrize("causal", [False, True])
def test_long_odd_length(backend, causal):
    # One big odd length: several partial tiles in both directions of the CPU engine (block 256).
    q, k, v = make_qkv(b=1, hq=1, sq=1025, sk=1025, d=16, seed=3)
    assert_matches_reference(backend, q, k, v, causal=causal, return_lse=True)


@pytest.mark.parametrize("sq, sk", [(5, 2), (40, 9), (2, 5), (9, 300), (300, 9)])
def test_causal_bottom_right_with_unequal_lengths(backend, sq, sk):
    q, k, v = make_qkv(b=2, hq=2, sq=sq, sk=sk, d=16, seed=sq * 31 + sk)
    assert_matches_reference(backend, q, k, v, causal=True, return_lse=True)


def test_causal_is_bottom_right_aligned():
    """Sq=2, Sk=5 causal: query 0 sees keys 0..3, query 1 sees 0..4 (FlashAttention-2 convention)."""
    q = torch.zeros(1, 1, 2, 4)
    k = torch.zeros(1, 1, 5, 4)
    v = torch.eye(5).reshape(1, 1, 5, 5)  # out[i, j] = weight of key j for query i
    out = tileattn.flash_attention(q, k, v, causal=True, backend="cpu")
    expected = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    torch.testing.assert_close(out[0, 0], expected)


@pytest.mark.parametrize("d", [8, 40, 64, 80, 128, 256])
def test_head_dims(backend, d):
    q, k, v = make_qkv(b=1, hq=2, sq=33, sk=47, d=d, seed=d)
    assert_matches_reference(backend, q, k, v, causal=d % 16 == 0, return_lse=True)


@pytest.mark.parametrize("d, dv", [(64, 32), (16, 80), (40, 8)])
def test_value_head_dim_differs(backend, d, dv):
    q, k, v = make_qkv(b=2, hq=2, sq=19, sk=23, d=d, dv=dv)
    out = tileattn.flash_attention(q, k, v, backend=backend)
    assert out.shape == (2, 2, 19, dv)
    assert_matches_reference(backend, q, k, v, causal=True)


@pytest.mark.parametrize("hq, hkv", [(4, 2), (6, 3), (8, 1), (3, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_and_mqa(backend, hq, hkv, causal):
    q, k, v = make_qkv(b=2, hq=hq, hkv=hkv, sq=21, sk=29, d=16, seed=hq + hkv)
    assert_matches_reference(backend, q, k, v, causal=causal, return_lse=True)


def test_gqa_head_mapping():
    """Query head h reads kv head h // (Hq / Hkv): equal to repeating K/V explicitly."""
    q, k, v = make_qkv(b=1, hq=6, hkv=2, sq=9, sk=11, d=8)
    got = tileattn.flash_attention(q, k, v, backend="cpu")
    rep = tileattn.flash_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), backend="cpu")
    torch.testing.assert_close(got, rep, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [0.0, 0.3, -1.0])
def test_custom_scale(backend, scale):
    q, k, v = make_qkv(b=1, hq=2, sq=19, sk=24, d=16, seed=4)
    assert_matches_reference(backend, q, k, v, scale=scale, causal=True, return_lse=True)


# ------------------------------------------------------------------------------ layouts, dtypes


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
@pytest.mark.parametrize("strided", [False, True])
def test_layouts(backend, layout, strided):
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=13, sk=18, d=16, dv=24, layout=layout, seed=7)
    if strided:
        q, k, v = strided_view(q, layout, 4), strided_view(k, layout, 2), strided_view(v, layout, 2)
    num_heads = 4 if layout in ("BSH", "SBH") else None
    out = tileattn.flash_attention(q, k, v, layout=layout, num_heads=num_heads, backend=backend)
    expected_shape = {"BNSD": (2, 4, 13, 24), "BSND": (2, 13, 4, 24), "BSH": (2, 13, 96), "SBH": (13, 2, 96)}
    assert out.shape == expected_shape[layout]
    assert_matches_reference(backend, q, k, v, layout=layout, num_heads=num_heads, causal=True, return_lse=True)


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
def test_layouts_agree_with_bnsd(layout):
    """The same problem given in any layout gives the same numbers as BNSD."""
    from tileattn.core.spec import to_canonical

    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=13, sk=18, d=16, layout=layout, seed=11)
    num_heads = 4 if layout in ("BSH", "SBH") else None
    out = tileattn.flash_attention(q, k, v, layout=layout, num_heads=num_heads, causal=True, backend="cpu")
    canon = [to_canonical(t, layout, h) for t, h in ((q, 4), (k, 2), (v, 2))]
    ref = tileattn.flash_attention(*canon, causal=True, backend="cpu")
    torch.testing.assert_close(to_canonical(out, layout, 4), ref, rtol=1e-6, atol=1e-6)


def test_strided_inputs_are_never_made_contiguous(monkeypatch):
    """A transposed view (BSND over BNSD storage) is read through its strides, not copied whole."""
    base_q, base_k, base_v = make_qkv(b=2, hq=4, hkv=2, sq=64, sk=64, d=32)
    q, k, v = (t.transpose(1, 2) for t in (base_q, base_k, base_v))  # BSND views, not contiguous
    storages = {t.untyped_storage().data_ptr(): t.numel() for t in (q, k, v)}
    whole_copies = []
    real_contiguous = torch.Tensor.contiguous

    def spy(self, *args, **kwargs):
        ptr = self.untyped_storage().data_ptr()
        if ptr in storages and self.numel() == storages[ptr] and not self.is_contiguous():
            whole_copies.append(tuple(self.shape))
        return real_contiguous(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", spy)
    # The spy must see a whole-input .contiguous(), or the check below could never fail.
    q.contiguous()
    assert whole_copies == [tuple(q.shape)]
    whole_copies.clear()

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = tileattn.flash_attention(*leaves, layout="BSND", causal=True, backend="cpu")
    out.backward(torch.ones_like(out))
    assert whole_copies == [], f"inputs copied to contiguous memory: {whole_copies}"
    assert [t.data_ptr() for t in leaves] == [t.data_ptr() for t in (q, k, v)]


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_dtypes(backend, dtype):
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=37, sk=45, d=32, dtype=dtype, seed=5)
    out, lse = tileattn.flash_attention(q, k, v, backend=backend, return_lse=True)
    assert out.dtype == dtype
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_matches_reference(backend, q, k, v, causal=True, return_lse=True)


# -------------------------------------------------------------------------------------------- LSE


def test_lse_shape_dtype_and_value(backend):
    q, k, v = make_qkv(b=2, hq=3, sq=7, sk=10, d=8, dtype=torch.float64)
    out, lse = tileattn.flash_attention(q, k, v, backend=backend, return_lse=True)
    assert lse.shape == (2, 3, 7) and lse.dtype == torch.float64
    direct = torch.logsumexp(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1)
    torch.testing.assert_close(lse, direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND"])
def test_lse_shape_is_bhs_for_every_padded_layout(backend, layout):
    q, k, v = make_qkv(b=2, hq=3, sq=7, sk=10, d=8, layout=layout)
    num_heads = 3 if layout in ("BSH", "SBH") else None
    _, lse = tileattn.flash_attention(q, k, v, layout=layout, num_heads=num_heads, backend=backend,
                                      return_lse=True)
    assert lse.shape == (2, 3, 7) and lse.dtype == torch.float32


def test_rows_that_see_nothing_give_zero_and_minus_inf(backend):
    # Sq=5, Sk=2, causal: queries 0..2 see no key.
    q, k, v = make_qkv(b=1, hq=2, sq=5, sk=2, d=8, requires_grad=True)
    out, lse = tileattn.flash_attention(q, k, v, causal=True, backend=backend, return_lse=True)
    assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    assert torch.isneginf(lse[:, :, :3]).all()
    assert torch.isfinite(lse[:, :, 3:]).all() and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.equal(q.grad[:, :, :3], torch.zeros_like(q.grad[:, :, :3]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# -------------------------------------------------------------------------------------- gradients


def test_gradcheck_fp64_cpu():
    q, k, v = make_qkv(b=1, hq=2, hkv=1, sq=5, sk=7, d=4, dv=3, dtype=torch.float64, requires_grad=True)
    fn = attention_fn("cpu")
    assert torch.autograd.gradcheck(lambda a, b, c: fn(a, b, c, causal=True), (q, k, v))


def test_gradcheck_fp64_cpu_strided_bsnd():
    q, k, v = make_qkv(b=2, hq=2, sq=4, sk=6, d=4, dtype=torch.float64, layout="BSND")
    q, k, v = (strided_view(t, "BSND", 2).requires_grad_() for t in (q, k, v))
    fn = attention_fn("cpu")
    assert torch.autograd.gradcheck(lambda a, b, c: fn(a, b, c, layout="BSND"), (q, k, v))


def test_gradients_bitwise_reproducible(backend):
    """Two identical calls give bitwise-equal outputs, LSE and gradients."""
    results = []
    for _ in range(2):
        q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=300, sk=280, d=32, seed=9, requires_grad=True)
        out, lse = tileattn.flash_attention(q, k, v, causal=True, backend=backend, return_lse=True)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        out.backward(dout)
        results.append((out.detach(), lse, q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_double_backward_raises_clear_error(backend):
    q, k, v = make_qkv(b=1, hq=1, sq=4, sk=4, d=4, dtype=torch.float64, requires_grad=True)
    out = tileattn.flash_attention(q, k, v, backend=backend)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(dq.sum(), q)


def test_no_grad_inputs_allowed(backend):
    q, k, v = make_qkv(b=1, hq=2, sq=6, sk=6, d=8)
    k.requires_grad_()
    out = tileattn.flash_attention(q, k, v, backend=backend)
    out.sum().backward()
    assert k.grad is not None and k.grad.shape == k.shape and q.grad is None


# ------------------------------------------------------------------------------------ edge cases


def test_empty_query_gives_empty_output(backend):
    q, k, v = make_qkv(b=2, hq=2, sq=0, sk=5, d=8, dv=6, requires_grad=True)
    out, lse = tileattn.flash_attention(q, k, v, backend=backend, return_lse=True)
    assert out.shape == (2, 2, 0, 6) and lse.shape == (2, 2, 0)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and torch.equal(v.grad, torch.zeros_like(v))


def test_empty_keys_give_zeros_and_minus_inf(backend):
    q, k, v = make_qkv(b=2, hq=2, sq=5, sk=0, d=8, dv=6, requires_grad=True)
    out, lse = tileattn.flash_attention(q, k, v, backend=backend, return_lse=True)
    assert out.shape == (2, 2, 5, 6)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    assert k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_inf_propagate_like_the_reference(backend, where, value):
    q, k, v = make_qkv(b=1, hq=2, sq=40, sk=40, d=8, seed=2)
    clean_ref = tileattn.reference(q, k, v, causal=True, compute_dtype=torch.float64)
    {"q": q, "k": k, "v": v}[where][0, 1, 20, 3] = value
    out = tileattn.flash_attention(q, k, v, causal=True, backend=backend)
    ref = tileattn.reference(q, k, v, causal=True, compute_dtype=torch.float64)
    rows = torch.arange(40)
    sees = torch.zeros(1, 2, 40, dtype=torch.bool)
    sees[0, 1] = rows == 20 if where == "q" else rows >= 20  # a query row; a key every later row sees
    assert_nonfinite_like_reference(out, ref, clean_ref, sees)


# --------------------------------------------------------------------------------------- dispatch


def test_auto_picks_the_first_cpu_engine_never_the_reference(monkeypatch):
    """The native engine when it is built here, else the PyTorch engine; never the reference."""
    q, k, v = make_qkv(b=1, hq=1, sq=4, sk=4, d=8)
    calls = _count_forward_calls(monkeypatch)
    tileattn.flash_attention(q, k, v)
    expected = "native" if tileattn.get_backend("native").unavailable_reason() is None else "cpu"
    assert calls == [expected]
    assert tileattn.explain(q, k, v)["cpu"] == []
    # Forcing the PyTorch engine by name (what TILEATTN_BACKEND=cpu does) runs it.
    tileattn.flash_attention(q, k, v, backend="cpu")
    assert calls == [expected, "cpu"]


def test_env_variable_overrides_auto(monkeypatch):
    q, k, v = make_qkv(b=1, hq=1, sq=4, sk=4, d=8)
    calls = _count_forward_calls(monkeypatch)
    monkeypatch.setenv("TILEATTN_BACKEND", "reference")
    tileattn.flash_attention(q, k, v)
    assert calls == ["reference"]
    # An explicit backend argument beats the environment.
    tileattn.flash_attention(q, k, v, backend="cpu")
    assert calls == ["reference", "cpu"]
    monkeypatch.setenv("TILEATTN_BACKEND", "no-such-engine")
    with pytest.raises(ValueError, match="'backend'.*no-such-engine"):
        tileattn.flash_attention(q, k, v)


class _RefusingBackend(Backend):
    name = "refuser"
    priority = 1

    def unavailable_reason(self):
        return "refuses every call (test double)"


@pytest.fixture
def refusing_backend(monkeypatch):
    list_backends()  # load the built-in engines first
    monkeypatch.setitem(_REGISTRY, "refuser", _RefusingBackend())
    return "refuser"


def test_explicit_refusing_backend_lists_every_backend(refusing_backend):
    q, k, v = make_qkv(b=1, hq=1, sq=4, sk=4, d=8)
    with pytest.raises(NoBackendError) as info:
        tileattn.flash_attention(q, k, v, backend=refusing_backend)
    message = str(info.value)
    assert "refuses every call (test double)" in message
    for b in list_backends():
        assert f"{b.name}:" in message
    # "auto" skips the refusing engine (highest priority) and still runs the call.
    out = tileattn.flash_attention(q, k, v)
    assert out.shape == (1, 1, 4, 8)


def test_no_backend_for_call_lists_reasons(refusing_backend):
    # 'meta' tensors: the CPU engine refuses them and the reference is never chosen by "auto".
    q, k, v = (torch.empty(1, 2, 8, 16, device="meta") for _ in range(3))
    with pytest.raises(NoBackendError) as info:
        tileattn.flash_attention(q, k, v)
    message = str(info.value)
    assert "needs cpu tensors (got meta)" in message
    for b in list_backends():
        assert f"{b.name}:" in message
    with pytest.raises(NoBackendError, match="cpu"):
        tileattn.flash_attention(q, k, v, backend="cpu")


def _count_forward_calls(monkeypatch):
    calls = []
    for b in list_backends():
        if b.name in ("native", "cpu", "reference"):
            real = b.forward

            def spy(spec, out, lse, _real=real, _name=b.name):
                calls.append(_name)
                return _real(spec, out, lse)

            monkeypatch.setattr(b, "forward", spy)
    return calls
