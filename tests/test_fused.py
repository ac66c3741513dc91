"""tileattn.fused: norm_qkv and attention_out_proj against their unfused PyTorch composition.

The oracle is the composition (:mod:`tileattn.fused.composed`) in fp64; the fused operators must
match it to rounding in fp64 and stay within FlashAttention's 2x rule in fp32, bf16 and fp16 (at
most twice the error of the composition run in that dtype, plus the dtype's floor), forward and
backward. Then: KV cache writes (contiguous, head-major, paged), bad input refused before any write,
the bf16 GEMV, fuse(model) on every covered architecture (greedy tokens, gradients), and one
torch.compile(fullgraph=True) of a fused block, forward and backward.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch

import tileattn
from tileattn import fused
from tileattn.core.testing import judge
from tileattn.fused import checks, composed, native

pytestmark = pytest.mark.skipif(not native.available()[0], reason="the fused C passes need a C compiler")

HIDDEN, HEADS, KV_HEADS, DIM = 48, 4, 2, 16
EPS = 1e-5


def _weights(dtype, seed=0, bias=False, qk_norm=False):
    g = torch.Generator().manual_seed(seed)
    rows = (HEADS + 2 * KV_HEADS) * DIM
    w = dict(norm_weight=(1 + 0.3 * torch.randn(HIDDEN, generator=g)).to(dtype),
             w_qkv=(torch.randn(rows, HIDDEN, generator=g) * HIDDEN ** -0.5).to(dtype))
    if bias:
        w["bias_qkv"] = (0.5 * torch.randn(rows, generator=g)).to(dtype)
    if qk_norm:
        w["q_norm_weight"] = (1 + 0.3 * torch.randn(DIM, generator=g)).to(dtype)
        w["k_norm_weight"] = (1 + 0.3 * torch.randn(DIM, generator=g)).to(dtype)
    return w


def _x(layout, dtype, batch=2, seqlen=7, seed=1):
    shape = {"bs": (batch, seqlen, HIDDEN), "sb": (seqlen, batch, HIDDEN), "s": (seqlen, HIDDEN)}
    return torch.randn(shape[checks.token_axes(layout)], generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rope(seqlen, rot, dtype, batch=None):
    positions = torch.arange(seqlen) + 3 if batch is None else torch.arange(seqlen)[None] + torch.arange(batch)[:, None]
    cos, sin = fused.rotary_tables(positions, rot, dtype=torch.float64)
    return cos.to(dtype), sin.to(dtype)


def _norm_qkv(impl, x, w, cast=None, **kw):
    """norm_qkv with every tensor argument cast to ``cast`` (the oracle's fp64)."""
    def c(t):
        return t if cast is None or not isinstance(t, torch.Tensor) else t.to(cast)
    args = {name: c(t) for name, t in w.items()}
    if kw.get("rope") is not None:
        kw["rope"] = tuple(c(t) for t in kw["rope"])
    return fused.norm_qkv(c(x), args.pop("norm_weight"), args.pop("w_qkv"), eps=EPS, num_heads=HEADS,
                          num_kv_heads=KV_HEADS, head_dim=DIM, impl=impl, **args, **kw)


def _grads(impl, x, w, cast=None, compute_dtype=None, **kw):
    """(q, k, v) and the gradients of x and every weight for fixed output gradients."""
    leaves = {name: t.detach().clone().to(cast or t.dtype).requires_grad_() for name, t in dict(w, x=x).items()}
    xs = leaves.pop("x")
    if compute_dtype is not None:  # the plain composition in a given dtype (the 2x rule's baseline)
        call = checks.check_norm_qkv(xs, leaves["norm_weight"], leaves["w_qkv"], eps=EPS, num_heads=HEADS,
                                     num_kv_heads=KV_HEADS, head_dim=DIM, bias_qkv=leaves.get("bias_qkv"),
                                     rope=kw.get("rope"), rotary_interleaved=kw.get("rotary_interleaved", False),
                                     q_norm_weight=leaves.get("q_norm_weight"),
                                     k_norm_weight=leaves.get("k_norm_weight"), qk_norm_eps=None,
                                     layout=kw.get("layout", "BSND"), kv_cache=None, cache_seqlens=None,
                                     block_table=None)
        outs = composed.norm_qkv(call, compute_dtype)
    else:
        rope = kw.pop("rope", None)
        if rope is not None and cast is not None:
            rope = tuple(t.to(cast) for t in rope)
        outs = _norm_qkv(impl, xs, leaves, rope=rope, **kw)
    g = torch.Generator().manual_seed(9)
    douts = [torch.randn(o.shape, generator=g) for o in outs]
    names = ["x"] + list(leaves)
    grads = torch.autograd.grad(outs, [xs] + list(leaves.values()), [d.to(o.dtype) for d, o in zip(douts, outs)])
    return list(outs), dict(zip(names, grads))


LAYOUTS = ("BSND", "BNSD", "BSH", "SBH", "TND")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary", ["half", "interleaved", "partial", "none"])
def test_norm_qkv_equals_the_composition_in_fp64(layout, rotary):
    x = _x(layout, torch.float64)
    seqlen = x.shape[1] if layout == "SBH" else x.shape[-2]
    rot = {"half": DIM, "interleaved": DIM, "partial": DIM // 2, "none": None}[rotary]
    kw = dict(layout=layout, rope=None if rot is None else _rope(x.shape[0] if layout == "SBH" else seqlen, rot,
                                                                   torch.float64),
              rotary_interleaved=rotary == "interleaved")
    w = _weights(torch.float64, bias=True, qk_norm=True)
    outs, grads = _grads("native", x, w, **kw)
    ref_outs, ref_grads = _grads("composed", x, w, **kw)
    for got, ref in zip(outs, ref_outs):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    assert set(grads) == {"x", "norm_weight", "w_qkv", "bias_qkv", "q_norm_weight", "k_norm_weight"}
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-11, atol=1e-11, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("extras", ["plain", "bias+qk_norm"])
def test_norm_qkv_within_twice_the_composition_error(dtype, extras):
    x = _x("BSND", dtype, seqlen=9)
    w = _weights(dtype, bias=extras != "plain", qk_norm=extras != "plain")
    kw = dict(layout="BSND", rope=_rope(9, DIM, dtype, batch=2))
    outs, grads = _grads("native", x, w, **kw)
    oracle, oracle_grads = _grads("composed", x, w, cast=torch.float64, **kw)
    base, base_grads = _grads(None, x, w, compute_dtype=dtype, **kw)
    verdicts = [judge(n, o, r, b, dtype) for n, o, r, b in zip("qkv", outs, oracle, base)]
    verdicts += [judge("d" + n, grads[n], oracle_grads[n], base_grads[n], dtype) for n in oracle_grads]
    assert len(verdicts) == 3 + len(w) + 1
    assert all(v.ok for v in verdicts), "\n".join(map(str, verdicts))


def test_packed_and_separate_weights_and_threads_give_the_same_bits():
    x = _x("BSND", torch.float32, seqlen=40)
    w = _weights(torch.float32, bias=True)
    packed = _norm_qkv("native", x, w, rope=_rope(40, DIM, torch.float32))
    rows = [HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM]
    split = dict(w, w_qkv=tuple(w["w_qkv"].split(rows)), bias_qkv=tuple(w["bias_qkv"].split(rows)))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _norm_qkv("native", x, split, rope=_rope(40, DIM, torch.float32))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(packed, one):
        assert torch.equal(a, b)


def _cache_step(impl, kind, dtype=torch.float32):
    """One decode/prefill chunk of two sequences with 3 and 6 tokens cached, written by norm_qkv."""
    g = torch.Generator().manual_seed(5)
    batch, new, cap = 2, 2, 12
    lengths = torch.tensor([3, 6], dtype=torch.int32)
    table = None
    if kind == "paged":
        k_cache = torch.randn(7, 4, KV_HEADS, DIM, generator=g).to(dtype)
        table = torch.tensor([[6, 2, 0], [1, 4, 5]], dtype=torch.int32)
    elif kind == "head-major":  # (B, Hkv, L, D) storage, passed as its (B, L, Hkv, D) view
        k_cache = torch.randn(batch, KV_HEADS, cap, DIM, generator=g).to(dtype).transpose(1, 2)
    else:
        k_cache = torch.randn(batch, cap, KV_HEADS, DIM, generator=g).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=g).to(dtype).as_strided(k_cache.shape, k_cache.stride())
    positions = lengths[:, None].long() + torch.arange(new)
    cos, sin = fused.rotary_tables(positions, DIM, dtype=dtype)
    x = _x("BSND", dtype, batch=batch, seqlen=new, seed=6)
    with torch.no_grad():
        q, kc, vc = _norm_qkv(impl, x, _weights(dtype, qk_norm=True), rope=(cos, sin), kv_cache=(k_cache, v_cache),
                              cache_seqlens=lengths, block_table=table)
    return q, kc, vc, lengths, table, new


@pytest.mark.parametrize("kind", ["contiguous", "head-major", "paged"])
def test_cache_writes_match_the_composition_and_touch_nothing_else(kind):
    q, kc, vc, lengths, table, new = _cache_step("native", kind)
    rq, rk, rv, *_ = _cache_step("composed", kind)
    torch.testing.assert_close(q, rq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kc, rk, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(vc, rv, rtol=1e-6, atol=1e-6)
    # the attention over the cache sees the new keys: the same as attending the composition's cache
    kw = dict(layout="BSND", causal=True, seqused_k=lengths + new, block_table=table)
    torch.testing.assert_close(tileattn.flash_attention(q, kc, vc, **kw), tileattn.flash_attention(rq, rk, rv, **kw),
                               rtol=1e-5, atol=1e-6)


def test_cache_write_leaves_other_slots_untouched():
    g = torch.Generator().manual_seed(2)
    k_cache, v_cache = torch.randn(2, 12, KV_HEADS, DIM, generator=g), torch.randn(2, 12, KV_HEADS, DIM, generator=g)
    before = k_cache.clone(), v_cache.clone()
    lengths = torch.tensor([3, 6], dtype=torch.int32)
    with torch.no_grad():
        _norm_qkv("native", _x("BSND", torch.float32, seqlen=2), _weights(torch.float32),
                  kv_cache=(k_cache, v_cache), cache_seqlens=lengths)
    written = torch.zeros(2, 12, dtype=torch.bool)
    written[0, 3:5] = written[1, 6:8] = True
    for new, old in zip((k_cache, v_cache), before):
        assert torch.equal(new[~written], old[~written])
        assert not torch.equal(new[written], old[written])


def _bad(name):
    """(keyword overrides, the argument the error must name) for a bad norm_qkv call."""
    g = torch.Generator().manual_seed(0)
    return {
        "x rank": (dict(x=torch.randn(2, HIDDEN)), "'x'"),
        "x int": (dict(x=torch.ones(2, 3, HIDDEN, dtype=torch.int32)), "'x'"),
        "heads": (dict(num_kv_heads=3), "'num_kv_heads'"),
        "head_dim": (dict(head_dim=0), "'head_dim'"),
        "norm shape": (dict(norm_weight=torch.ones(HIDDEN + 1)), "'norm_weight'"),
        "w rows": (dict(w_qkv=torch.randn(10, HIDDEN)), "'w_qkv'"),
        "w dtype": (dict(w_qkv=torch.randn((HEADS + 2 * KV_HEADS) * DIM, HIDDEN, dtype=torch.float64)), "'w_qkv'"),
        "w part": (dict(w_qkv=(torch.randn(HEADS * DIM, HIDDEN), torch.randn(3, HIDDEN),
                               torch.randn(KV_HEADS * DIM, HIDDEN))), "'w_qkv[1]'"),
        "bias": (dict(bias_qkv=torch.randn(5)), "'bias_qkv'"),
        "rope wide": (dict(rope=(torch.ones(3, DIM), torch.ones(3, DIM))), "'rope[0] (cos)'"),
        "rope rows": (dict(rope=(torch.ones(4, 2), torch.ones(4, 2))), "'rope[0] (cos)'"),
        "rope grad": (dict(rope=(torch.ones(3, 2, requires_grad=True), torch.ones(3, 2))), "'rope[0] (cos)'"),
        "interleaved": (dict(rotary_interleaved=1), "'rotary_interleaved'"),
        "qk norm": (dict(q_norm_weight=torch.ones(DIM - 1)), "'q_norm_weight'"),
        "eps": (dict(eps=0.0), "'eps'"),
        "layout": (dict(layout="BHSD"), "'layout'"),
        "impl": (dict(impl="fast"), "'impl'"),
        "seqlens alone": (dict(cache_seqlens=torch.zeros(2, dtype=torch.int32)), "'cache_seqlens'"),
        "cache overflow": (dict(cache_seqlens=torch.tensor([3, 10], dtype=torch.int32)), "'cache_seqlens'"),
        "cache dtype": (dict(cache_seqlens=torch.tensor([3, 1])), "'cache_seqlens'"),
        "cache heads": (dict(kv_cache=(torch.zeros(2, 12, 3, DIM), torch.zeros(2, 12, 3, DIM))),
                        "'kv_cache[0] (k_cache)'"),
        "cache packed": (dict(layout="TND", x=torch.randn(3, HIDDEN)), "'layout'"),
        "cache grad": (dict(x=torch.randn(2, 3, HIDDEN, generator=g, requires_grad=True)), "'kv_cache'"),
        "page": (dict(block_table=torch.tensor([[0, 9, 1], [2, 3, 4]], dtype=torch.int32),
                      kv=(torch.zeros(6, 4, KV_HEADS, DIM), torch.zeros(6, 4, KV_HEADS, DIM)),
                      cache_seqlens=torch.tensor([3, 1], dtype=torch.int32)), "'block_table'"),
    }[name]


@pytest.mark.parametrize("name", ["x rank", "x int", "heads", "head_dim", "norm shape", "w rows", "w dtype", "w part",
                                  "bias", "rope wide", "rope rows", "rope grad", "interleaved", "qk norm", "eps",
                                  "layout", "impl", "seqlens alone", "cache overflow", "cache dtype", "cache heads",
                                  "cache packed", "cache grad", "page"])
def test_bad_input_is_refused_before_any_write_naming_the_argument(name):
    overrides, argument = _bad(name)
    k_cache, v_cache = overrides.pop("kv", (torch.zeros(2, 12, KV_HEADS, DIM), torch.zeros(2, 12, KV_HEADS, DIM)))
    cache = name.startswith(("cache", "page")) and "kv_cache" not in overrides
    args = dict(x=torch.randn(2, 3, HIDDEN), norm_weight=torch.ones(HIDDEN),
                w_qkv=torch.randn((HEADS + 2 * KV_HEADS) * DIM, HIDDEN), eps=EPS, num_heads=HEADS,
                num_kv_heads=KV_HEADS, head_dim=DIM)
    if cache or "kv_cache" in overrides:
        args.update(kv_cache=(k_cache, v_cache), cache_seqlens=torch.tensor([3, 1], dtype=torch.int32))
    args.update(overrides)
    with pytest.raises((ValueError, TypeError), match=re.escape(f"argument {argument}")):
        fused.norm_qkv(args.pop("x"), args.pop("norm_weight"), args.pop("w_qkv"), **args)
    assert not k_cache.any() and not v_cache.any()


def test_gemv_reads_bf16_and_fp16_weights_as_stored():
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float16):
        w = torch.randn(37, 203, generator=g).to(dtype)          # odd rows and columns: every tail
        for rows in range(1, native.GEMV_ROWS + 1):
            a = torch.randn(rows, 203, generator=g)
            expected = a.double() @ w.double().t()
            got = native.gemm_lowp(a, w)
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", ["BSND", "BNSD", "BSH", "SBH"])
def test_attention_out_proj_equals_attention_then_projection_in_fp64(layout):
    g = torch.Generator().manual_seed(3)
    x = _x(layout, torch.float64, seqlen=9)
    q, k, v = _norm_qkv("native", x, _weights(torch.float64), layout=layout)
    w_o = torch.randn(HIDDEN, HEADS * DIM, generator=g, dtype=torch.float64)
    bias = torch.randn(HIDDEN, generator=g, dtype=torch.float64)
    sinks = torch.randn(HEADS, generator=g, dtype=torch.float64)
    kw = dict(layout=layout, causal=True, window=(4, 0), softcap=3.0, sinks=sinks,
              num_heads=HEADS if layout in ("BSH", "SBH") else None)
    y, lse = fused.attention_out_proj(q, k, v, w_o, bias, return_lse=True, **kw)
    out, ref_lse = tileattn.flash_attention(q, k, v, return_lse=True, **kw)
    tokens = out.transpose(1, 2) if layout == "BNSD" else out
    expected = tokens.reshape(*y.shape[:-1], HEADS * DIM) @ w_o.t() + bias
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_out_proj_within_twice_the_composition_error(dtype):
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 11, n, DIM, generator=g) for n in (HEADS, KV_HEADS, KV_HEADS))
    w_o = torch.randn(HIDDEN, HEADS * DIM, generator=g) * (HEADS * DIM) ** -0.5
    bias = torch.randn(HIDDEN, generator=g)
    dy = torch.randn(2, 11, HIDDEN, generator=g)

    def run(fn, cast):
        leaves = [t.to(cast).requires_grad_() for t in (q, k, v, w_o, bias)]
        y = fn(*leaves)
        return [y.detach()] + list(torch.autograd.grad(y, leaves, dy.to(y.dtype)))

    def plain(q, k, v, w_o, bias):
        out = tileattn.flash_attention(q, k, v, layout="BSND", causal=True, backend="reference")
        return torch.nn.functional.linear(out.flatten(-2), w_o, bias)

    got = run(lambda *t: fused.attention_out_proj(*t, layout="BSND", causal=True), dtype)
    oracle, base = run(plain, torch.float64), run(plain, dtype)
    verdicts = [judge(n, a, b, c, dtype) for n, a, b, c in zip(("y", "dq", "dk", "dv", "dw_o", "dbias"), got, oracle,
                                                                  base)]
    assert len(verdicts) == 6 and all(v.ok for v in verdicts), "\n".join(map(str, verdicts))


def test_attention_out_proj_checks_w_o_before_attending():
    q, k, v = (torch.randn(1, 5, n, DIM) for n in (HEADS, KV_HEADS, KV_HEADS))
    with pytest.raises(ValueError, match="argument 'w_o'"):
        fused.attention_out_proj(q, k, v, torch.randn(HIDDEN, HEADS * DIM + 1), layout="BSND")
    with pytest.raises(TypeError, match="argument 'w_o'"):
        fused.attention_out_proj(q, k, v, torch.randn(HIDDEN, HEADS * DIM, dtype=torch.float64), layout="BSND")
    with pytest.raises(ValueError, match="argument 'bias'"):
        fused.attention_out_proj(q, k, v, torch.randn(HIDDEN, HEADS * DIM), torch.randn(3), layout="BSND")


def test_double_backward_says_so():
    x = _x("BSND", torch.float64).requires_grad_()
    q, _, _ = _norm_qkv("native", x, _weights(torch.float64))
    (g,) = torch.autograd.grad(q.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


# ------------------------------------------------------------------------------- the model integration

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'transformers')")
import tileattn.integrations.transformers as tt  # noqa: E402

VOCAB = 96
SLIDING = ["sliding_attention", "full_attention"]


def _decoder(**extra):
    return dict(dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
                     eos_token_id=1, bos_token_id=2), **extra)


MODELS = {
    "llama": lambda: transformers.LlamaConfig(**_decoder()),
    "mistral": lambda: transformers.MistralConfig(**_decoder(sliding_window=4)),
    "qwen2": lambda: transformers.Qwen2Config(**_decoder()),
    "qwen3": lambda: transformers.Qwen3Config(**_decoder(head_dim=16)),
    "gemma2": lambda: transformers.Gemma2Config(**_decoder(head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                                           attn_logit_softcapping=5.0)),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**_decoder(head_dim=16, sliding_window=4,
                                                                    query_pre_attn_scalar=16, layer_types=SLIDING)),
    "phi3": lambda: transformers.Phi3Config(**_decoder(partial_rotary_factor=0.5)),
}


def _model(config, implementation, dtype=torch.float32):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                             attn_implementation=implementation).to(dtype).eval()


def test_fused_covers_every_architecture_tested_here():
    assert set(MODELS) == set(tt.transformers_fuse.FUSABLE)


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_fuse_keeps_greedy_tokens_and_gradients(model_type):
    tt.register()
    config = MODELS[model_type]()
    torch.manual_seed(0)
    plain = _model(config, "tileattn")
    ours = _model(config, "tileattn")
    ours.load_state_dict(plain.state_dict())
    assert tt.fuse(ours) is ours
    assert all(isinstance(m.self_attn, tt.transformers_fuse.FusedAttention) for m in ours.model.layers)
    assert list(ours.state_dict()) == list(plain.state_dict())
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0                                                    # left padding in the second row
    with torch.no_grad():
        tokens = [m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False) for m in (plain, ours)]
    assert torch.equal(tokens[0], tokens[1])
    # gradients: fused fp32 within twice unfused fp32's error against the unfused model in fp64
    oracle = _model(config, "tileattn", torch.float64)
    oracle.load_state_dict(plain.state_dict())
    grads = []
    for m in (ours, plain, oracle):
        m.train()
        m.config.attention_dropout = 0.0
        m(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[2]) and len(grads[0]) > 10
    verdicts = [judge(n, grads[0][n], grads[2][n], grads[1][n], torch.float32) for n in grads[2]]
    assert all(v.ok for v in verdicts), "\n".join(str(v) for v in verdicts if not v.ok)


def test_fuse_refuses_an_architecture_it_does_not_cover_by_name():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    model = _model(config, "eager")
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(tt.UnsupportedModelError, match="'gpt2'.*covers gemma2, gemma3_text, llama"):
        tt.fuse(model)
    assert {n: type(m) for n, m in model.named_modules()} == before


# ------------------------------------------------------------------------------------- torch.compile

@pytest.fixture
def no_cached_graphs():
    import torch._functorch.config
    import torch._inductor.config

    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def test_compile_fullgraph_fused_block_forward_and_backward(no_cached_graphs):
    from torch._dynamo.utils import counters

    cos, sin = _rope(7, DIM // 2, torch.float32)                       # partial rotary

    def block(x, norm_weight, w_qkv, q_norm, w_o):
        q, k, v = fused.norm_qkv(x, norm_weight, w_qkv, eps=EPS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                                 head_dim=DIM, rope=(cos, sin), q_norm_weight=q_norm, k_norm_weight=q_norm)
        return torch.tanh(fused.attention_out_proj(q, k, v, w_o, layout="BSND", causal=True)) * 2.0

    g = torch.Generator().manual_seed(12)
    w = _weights(torch.float32, qk_norm=True)
    inputs = (_x("BSND", torch.float32), w["norm_weight"], w["w_qkv"], w["q_norm_weight"],
              torch.randn(HIDDEN, HEADS * DIM, generator=g) * 0.1)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        y = fn(*leaves)
        y.backward(torch.ones_like(y))
        return [y.detach()] + [t.grad for t in leaves]

    torch._dynamo.reset()
    counters.clear()
    compiled = run(torch.compile(block, fullgraph=True))
    eager = run(block)
    for name, c, e in zip(("y", "dx", "dnorm", "dw_qkv", "dq_norm", "dw_o"), compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert counters["stats"]["unique_graphs"] == 1
