"""tileattn behind torch's own SDPA hook (``torch.nn.attention.activate_flash_attention_impl``).

Each accuracy check also asserts that the call went through the hook (its op counters moved), so a
check can never pass by letting torch compute; the oracle is ``tileattn.reference`` in fp64 with the
SDPA semantics spelled out explicitly (a top-left ``tril`` mask for ``is_causal``, the float mask as
``bias``), never torch's SDPA itself.
"""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.profiler import profile

import tileattn
import tileattn.integrations.torch_sdpa as hook
from tileattn.core.testing import check_against_reference

pytestmark = pytest.mark.skipif(not hook.hook_available(), reason="torch without the flash-attention hook")


def _inductor_has_a_compiler() -> bool:
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return False
    return True


#: torch.compile's CPU backend (inductor) compiles C++; scripts/check_wheel.sh runs this file without one
needs_inductor = pytest.mark.skipif(not _inductor_has_a_compiler(), reason="no C++ compiler for torch.compile")

FWD = "_scaled_dot_product_flash_attention_for_cpu"
BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + 7 * len(shape) + sum(shape))
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def _calls():
    counts = hook.call_counts()
    return counts.get(FWD, 0), counts.get(BWD, 0)


def _restore_torch():
    if torch.nn.attention.current_flash_attention_impl() is not None:
        torch.nn.attention.restore_flash_attention_impl()
    hook._Installed().remove()  # also kernels installed without torch's registry knowing


@pytest.fixture(autouse=True)
def _torch_default():
    """Every test starts and ends with torch's own kernels, also when it fails half-way."""
    hook.register()
    _restore_torch()
    yield
    _restore_torch()


@pytest.fixture
def active():
    torch.nn.attention.activate_flash_attention_impl(hook.IMPL_NAME)
    assert torch.nn.attention.current_flash_attention_impl() == hook.IMPL_NAME


def _tril(sq, sk):
    """SDPA's is_causal: top-left aligned, query i sees keys j <= i."""
    return torch.ones(sq, sk, dtype=torch.bool).tril()


def _assert_verdicts(verdicts, grad=True):
    names = [v.name for v in verdicts]
    assert names == (["out", "dq", "dk", "dv"] if grad else ["out"]), names
    bad = [str(v) for v in verdicts if not v.ok]
    assert not bad, "\n".join(bad)


def _check(sdpa, q, k, v, sdpa_kwargs, reference_kwargs, grad=True):
    """``sdpa(q, k, v, **sdpa_kwargs)`` against the reference given ``reference_kwargs``, through the hook."""
    before = _calls()

    def run(q_, k_, v_, **_reference_kwargs):
        return sdpa(q_, k_, v_, **sdpa_kwargs)

    _assert_verdicts(check_against_reference(run, q, k, v, grad=grad, **reference_kwargs), grad)
    after = _calls()
    assert after[0] == before[0] + 1, "the forward did not go through tileattn's hook"
    assert after[1] == before[1] + (1 if grad else 0), "the backward did not go through tileattn's hook"


def _case(name, dtype=torch.float32):
    """(q, k, v, SDPA kwargs, reference kwargs) for the named case."""
    B, H, D = 2, 4, 16
    q, k, v = _rand(B, H, 13, D, dtype=dtype), _rand(B, H, 13, D, dtype=dtype, seed=1), _rand(B, H, 13, D, dtype=dtype, seed=2)
    if name == "plain":
        return q, k, v, {}, {}
    if name in ("causal_sq<sk", "causal_sq>sk", "causal_sq=sk"):
        sq, sk = {"causal_sq<sk": (5, 13), "causal_sq>sk": (13, 5), "causal_sq=sk": (13, 13)}[name]
        return q[:, :, :sq], k[:, :, :sk], v[:, :, :sk], {"is_causal": True}, {"mask": _tril(sq, sk)}
    if name == "float_mask_2d":
        m = _rand(13, 13, dtype=dtype, seed=3)
        return q, k, v, {"attn_mask": m}, {"bias": m}
    if name == "float_mask_4d":
        m = _rand(B, 1, 13, 13, dtype=dtype, seed=4)
        return q, k, v, {"attn_mask": m}, {"bias": m}
    if name == "bool_mask":
        m = _rand(13, 13, seed=5) > 0
        m[:, 0] = True
        return q, k, v, {"attn_mask": m}, {"mask": m}
    if name == "gqa_causal":
        return q, k[:, :1], v[:, :1], {"enable_gqa": True, "is_causal": True}, {"mask": _tril(13, 13)}
    if name == "scale":
        return q, k, v, {"scale": 0.3}, {"scale": 0.3}
    if name == "bshd_views":
        t = [_rand(B, 13, H, D, dtype=dtype, seed=s).transpose(1, 2) for s in range(3)]
        return t[0], t[1], t[2], {"is_causal": True}, {"mask": _tril(13, 13)}
    if name == "row_sees_no_key":
        m = torch.ones(13, 13, dtype=torch.bool)
        m[3] = False
        m[:, 0] |= torch.arange(13) != 3
        return q, k, v, {"attn_mask": m}, {"mask": m}
    raise AssertionError(name)


CASES = ["plain", "causal_sq<sk", "causal_sq>sk", "causal_sq=sk", "float_mask_2d", "float_mask_4d", "bool_mask",
         "gqa_causal", "scale", "bshd_views", "row_sees_no_key"]


@pytest.mark.parametrize("name", CASES)
def test_eager_matches_reference(active, name):
    q, k, v, sdpa_kwargs, reference_kwargs = _case(name)
    _check(F.scaled_dot_product_attention, q, k, v, sdpa_kwargs, reference_kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["causal_sq<sk", "causal_sq>sk", "float_mask_4d", "gqa_causal"])
def test_eager_dtypes(active, name, dtype):
    q, k, v, sdpa_kwargs, reference_kwargs = _case(name, dtype)
    _check(F.scaled_dot_product_attention, q, k, v, sdpa_kwargs, reference_kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_with_mask_and_causal_applies_both(active, dtype):
    """torch's CPU flash op applies a mask and top-left causal together. F.scaled_dot_product_attention
    refuses the pair from torch 2.14 on (2.13's CPU path passes it through), so call the op itself,
    which is differentiable through torch's own derivative formula."""
    op = getattr(torch.ops.aten, FWD)
    q, k, v = _rand(2, 4, 6, 16, dtype=dtype), _rand(2, 4, 13, 16, dtype=dtype, seed=1), _rand(2, 4, 13, 16, dtype=dtype, seed=2)
    m = _rand(6, 13, seed=6).to(dtype)

    def sdpa(q_, k_, v_):
        return op(q_, k_, v_, 0.0, True, attn_mask=m)[0]

    _check(sdpa, q, k, v, {}, {"bias": m, "mask": _tril(6, 13)})


def test_inference_mode(active):
    q, k, v, sdpa_kwargs, reference_kwargs = _case("causal_sq>sk")
    with torch.inference_mode():
        _check(F.scaled_dot_product_attention, q, k, v, sdpa_kwargs, reference_kwargs, grad=False)


def test_profiler_sees_tileattn(active):
    """The aten op runs tileattn's own operator, forward and backward (not only our wrapper)."""
    q, k, v = (_rand(1, 2, 9, 8, seed=s).requires_grad_() for s in range(3))
    with profile() as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"aten::" + FWD, "aten::" + BWD} <= names
    assert any(n.startswith("tileattn::") for n in names), sorted(names)


@needs_inductor
def test_compile_fullgraph_before_and_after_activation():
    """A graph compiled before the activation reaches tileattn once it is active (the ops are called at
    run time, not inlined), and after restore the same graph is torch's own again."""
    q, k, v, sdpa_kwargs, reference_kwargs = _case("causal_sq<sk")

    @torch.compile(fullgraph=True)
    def compiled(q_, k_, v_):
        return F.scaled_dot_product_attention(q_, k_, v_, **sdpa_kwargs)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    before = _calls()
    torch_own = compiled(*leaves)
    torch_own.sum().backward()
    assert _calls() == before
    torch.nn.attention.activate_flash_attention_impl(hook.IMPL_NAME)
    _check(compiled, q, k, v, {}, reference_kwargs)
    torch.nn.attention.restore_flash_attention_impl()
    before = _calls()
    assert torch.equal(compiled(*leaves), torch_own)
    assert _calls() == before, "the compiled graph still reaches tileattn after restore"


@needs_inductor
def test_compile_mask_and_gqa(active):
    q, k, v, sdpa_kwargs, reference_kwargs = _case("float_mask_4d", torch.float64)
    k, v = k[:, :2], v[:, :2]
    compiled = torch.compile(lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, enable_gqa=True, **sdpa_kwargs),
                             fullgraph=True)
    _check(compiled, q, k, v, {}, reference_kwargs)


def test_registered_but_not_active_until_activated():
    """register() is idempotent and switches nothing on: torch asks providers to wait for the user."""
    assert hook.register() == hook.IMPL_NAME == hook.register()
    assert hook.IMPL_NAME in torch.nn.attention.list_flash_attention_impls()
    assert torch.nn.attention.current_flash_attention_impl() is None
    before = _calls()
    q = _rand(1, 2, 8, 8)
    F.scaled_dot_product_attention(q, q, q)
    assert _calls() == before


def test_restore_gives_torch_back():
    """After restore, SDPA is torch's own kernel again: bitwise torch's output, and no call reaches us."""
    q, k, v = (_rand(2, 2, 11, 16, seed=s).requires_grad_() for s in range(3))
    dout = _rand(2, 2, 11, 16, seed=9)

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    torch_own = run()
    torch.nn.attention.activate_flash_attention_impl(hook.IMPL_NAME)
    before = _calls()
    ours = run()
    assert _calls() == (before[0] + 1, before[1] + 1)
    assert not all(torch.equal(a, b) for a, b in zip(ours, torch_own)), "tileattn and torch agree bitwise: test is blind"
    torch.nn.attention.restore_flash_attention_impl()
    assert torch.nn.attention.current_flash_attention_impl() is None
    before = _calls()
    again = run()
    assert _calls() == before
    for a, b in zip(again, torch_own):
        assert torch.equal(a, b)


def test_activate_and_restore_twice():
    q = _rand(1, 2, 8, 8)
    for _ in range(2):
        torch.nn.attention.activate_flash_attention_impl(hook.IMPL_NAME)
        torch.nn.attention.activate_flash_attention_impl(hook.IMPL_NAME)
        before = _calls()
        F.scaled_dot_product_attention(q, q, q)
        assert _calls()[0] == before[0] + 1, "a second activation must not stack a second kernel"
        torch.nn.attention.restore_flash_attention_impl()
        torch.nn.attention.restore_flash_attention_impl()  # torch logs a warning; nothing else happens
        before = _calls()
        F.scaled_dot_product_attention(q, q, q)
        assert _calls() == before
        assert torch.nn.attention.current_flash_attention_impl() is None


def test_forward_output_interchangeable_with_torch(active):
    """out and logsumexp in torch's strides, dtype and values (0 on a row that sees no key), so a forward
    run by tileattn can be finished by torch's own backward (restore between the two)."""
    op = getattr(torch.ops.aten, FWD)
    q, k, v = (_rand(2, 11, 4, 16, seed=s).transpose(1, 2) for s in range(3))
    mask = torch.zeros(11, 11)
    mask[4] = float("-inf")
    ours = op(q, k, v, 0.0, True, attn_mask=mask)
    torch.nn.attention.restore_flash_attention_impl()
    theirs = op(q, k, v, 0.0, True, attn_mask=mask)
    for a, b in zip(ours, theirs):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
    assert float(ours[1][:, :, 4].abs().max()) == 0.0
    torch.testing.assert_close(ours[1], theirs[1])
    dout = _rand(2, 4, 11, 16, seed=5)
    torch_bwd = getattr(torch.ops.aten, BWD)
    from_ours = torch_bwd(dout, q, k, v, ours[0], ours[1], 0.0, True, attn_mask=mask)
    from_theirs = torch_bwd(dout, q, k, v, theirs[0], theirs[1], 0.0, True, attn_mask=mask)
    for a, b in zip(from_ours, from_theirs):
        torch.testing.assert_close(a, b)
    torch.nn.attention.activate_flash_attention_impl(hook.IMPL_NAME)
    for a, b in zip(torch_bwd(dout, q, k, v, ours[0], ours[1], 0.0, True, attn_mask=mask), from_theirs):
        assert (a.shape, a.stride()) == (b.shape, b.stride())
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("what", ["plain", "dropout", "3d", "5d", "last_dim_stride_2", "dv_differs", "mask_3d",
                                  "empty_keys"])
def test_hook_serves_exactly_the_calls_torch_routes_to_flash(active, what):
    """torch picks the backend; the hook serves a call iff torch picked flash, and the result is right
    either way. What goes where (docs/sdpa_hook.md) differs between torch versions: 3-D inputs go to
    the math path on 2.13 and to flash on 2.14."""
    q, k, v = (_rand(2, 2, 8, 16, seed=s) for s in range(3))
    kwargs, reference_kwargs = {}, {}
    if what == "dropout":
        kwargs["dropout_p"] = 0.3
    elif what == "3d":
        q, k, v = q[0], k[0], v[0]
    elif what == "5d":
        q, k, v = q[None], k[None], v[None]
    elif what == "last_dim_stride_2":
        q, k, v = (_rand(2, 2, 8, 32, seed=s)[..., ::2] for s in range(3))
    elif what == "dv_differs":
        v = _rand(2, 2, 8, 24)
    elif what == "mask_3d":
        kwargs["attn_mask"] = reference_kwargs["bias"] = _rand(2, 8, 8)
    elif what == "empty_keys":
        k, v = k[:, :, :0], v[:, :, :0]
    routed_to_flash = {"plain": True, "3d": torch.__version__ >= (2, 14)}.get(what, False)
    choice = torch._fused_sdp_choice(q, k, v, kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0), False)
    assert (SDPBackend(choice) == SDPBackend.FLASH_ATTENTION) == routed_to_flash, \
        "torch routes this call differently from what docs/sdpa_hook.md says"
    before = _calls()
    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert _calls()[0] == before[0] + int(routed_to_flash)
    if what not in ("dropout", "empty_keys"):
        as_4d = [t.reshape((-1,) + tuple(t.shape[-3:])).double() for t in (q, k, v)]
        expected = tileattn.reference(*as_4d, **reference_kwargs).reshape(out.shape).to(out.dtype)
        torch.testing.assert_close(out, expected)


def _op_args(**over):
    args = dict(query=_rand(1, 4, 6, 8), key=_rand(1, 2, 6, 8), value=_rand(1, 2, 6, 8), dropout_p=0.0,
                is_causal=False, attn_mask=None)
    args.update(over)
    return args


@pytest.mark.parametrize("over, arg", [
    ({"dropout_p": 0.1}, "dropout_p"),
    ({"attn_mask": torch.ones(6, 6, dtype=torch.bool)}, "attn_mask"),
    ({"attn_mask": torch.zeros(6, 6, dtype=torch.float64)}, "attn_mask"),
    ({"attn_mask": torch.zeros(4, 6, 6)}, "attn_mask"),
    ({"key": _rand(1, 3, 6, 8), "value": _rand(1, 3, 6, 8)}, "key"),
    ({"key": _rand(1, 0, 6, 8), "value": _rand(1, 0, 6, 8)}, "key"),
    ({"value": _rand(1, 2, 6, 4)}, "key/value"),
    ({"query": _rand(4, 6, 8)}, "query"),
    ({"query": _rand(1, 4, 6, 8, dtype=torch.float64)}, "key"),
])
def test_unhonourable_arguments_raise_before_compute(active, over, arg):
    a = _op_args(**over)
    before = _calls()
    with pytest.raises(hook.SdpaHookError, match=f"argument '{arg}'"):
        getattr(torch.ops.aten, FWD)(a["query"], a["key"], a["value"], a["dropout_p"], a["is_causal"],
                                     attn_mask=a["attn_mask"])
    assert _calls() == before


def test_threads_share_the_active_hook():
    """Several threads run SDPA forward and backward at once through the hook: every result exact,
    every call counted once (switching itself must not race in-flight calls: see the module doc)."""
    torch.nn.attention.activate_flash_attention_impl(hook.IMPL_NAME)
    failures, threads, rounds = [], 3, 4

    def worker(seed):
        try:
            q, k, v = (_rand(1, 2, 10, 8, dtype=torch.float64, seed=seed + s) for s in range(3))
            for _ in range(rounds):
                verdicts = check_against_reference(
                    lambda q_, k_, v_, **_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True),
                    q, k[:, :, :7], v[:, :, :7], mask=_tril(10, 7))
                failures.extend(str(v) for v in verdicts if not v.ok)
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(repr(exc))

    workers = [threading.Thread(target=worker, args=(10 * i,)) for i in range(threads)]
    before = _calls()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not failures, failures
    assert _calls() == (before[0] + threads * rounds, before[1] + threads * rounds)


def test_concurrent_register_and_interleaved_installs():
    """register() from many threads at once, then installs interleaved without restores in between:
    one set of kernels at most, and a single restore gives torch its kernels back."""
    errors = []

    def reg():
        try:
            hook.register()
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(repr(exc))

    workers = [threading.Thread(target=reg) for _ in range(8)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors and torch.nn.attention.list_flash_attention_impls().count(hook.IMPL_NAME) == 1
    first, second = hook._install(), hook._install()
    q = _rand(1, 2, 8, 8)
    before = _calls()
    F.scaled_dot_product_attention(q, q, q)
    assert _calls()[0] == before[0] + 1
    first.remove()
    before = _calls()
    F.scaled_dot_product_attention(q, q, q)
    assert _calls() == before
    second.remove()


def test_register_without_hook_points_to_patch_sdpa(monkeypatch):
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl")
    assert not hook.hook_available()
    with pytest.raises(RuntimeError, match="patch_sdpa"):
        hook.register()


def _meta_like(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
@pytest.mark.parametrize("sq, sk", [(9, 9), (5, 9)])
def test_cuda_kernels_honour_the_cuda_op_contract(dropout_p, sq, sk):
    """The CUDA kernels, called directly on CPU tensors (no GPU here): torch's meta shapes and dtypes,
    exact results with FlashAttention-2's bottom-right causal (what torch's CUDA flash op computes for
    Sq != Sk), and dropout regenerated in backward from the seed left in ``rng_state``."""
    q = _rand(2, 4, sq, 16, dtype=torch.float64).requires_grad_()
    k, v = (_rand(2, 2, sk, 16, dtype=torch.float64, seed=s).requires_grad_() for s in (1, 2))
    out = hook._cuda_forward(q.detach(), k.detach(), v.detach(), dropout_p, True)
    meta = torch.ops.aten._scaled_dot_product_flash_attention(*(_meta_like(t) for t in (q, k, v)), dropout_p, True)
    assert len(out) == len(meta) == 9
    for ours, theirs in zip(out, meta):
        if isinstance(theirs, torch.Tensor):
            assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)
        else:
            assert ours == theirs
    assert out[0].stride() == q.stride()
    seed = int(out[6][0].item()) if dropout_p else None
    expected, lse = tileattn.flash_attention(q, k, v, causal=True, dropout_p=dropout_p, seed=seed, return_lse=True)
    torch.testing.assert_close(out[0], expected.detach())
    torch.testing.assert_close(out[1], lse.detach().to(torch.float32))
    dout = _rand(2, 4, sq, 16, dtype=torch.float64, seed=7)
    grads = hook._cuda_backward(dout, q.detach(), k.detach(), v.detach(), out[0], out[1], None, None, sq, sk,
                                dropout_p, True, out[6], out[7])
    # The backward uses the op's logsumexp, which torch's contract makes fp32 even for fp64 inputs:
    # the gradients carry that rounding (~1e-7 relative), not the recomputed forward's fp64.
    for ours, theirs in zip(grads, torch.autograd.grad(expected, (q, k, v), dout)):
        assert ours.stride() == theirs.stride()
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_cuda_backward_refuses_dropout_state_it_did_not_write():
    """A forward by torch's own CUDA kernel leaves a Philox state; regenerating "its" mask with tileattn's
    RNG would silently give wrong gradients, so the backward refuses."""
    q = _rand(1, 2, 8, 16, dtype=torch.float64)
    torch_state = torch.tensor([1234, 8], dtype=torch.uint64)
    with pytest.raises(hook.SdpaHookError, match="argument 'philox_seed'"):
        hook._cuda_backward(q, q, q, q, q, q[..., 0].float(), None, None, 8, 8, 0.1, False, torch_state,
                            torch.zeros((), dtype=torch.uint64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_dispatch_reaches_tileattn(active):
    q, k, v = (_rand(2, 4, 128, 64, dtype=torch.bfloat16, seed=s).cuda() for s in range(3))
    before = hook.call_counts().get("_scaled_dot_product_flash_attention", 0)
    verdicts = check_against_reference(
        lambda q_, k_, v_, **_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True), q, k, v,
        mask=_tril(128, 128).cuda())
    _assert_verdicts(verdicts)
    assert hook.call_counts().get("_scaled_dot_product_flash_attention", 0) == before + 1
