"""Every keyword transformers' models pass to the attention function is honoured, harmless or refused.

The attention function is called directly here, against the models' own eager attention functions
(gpt-oss, Inkling 2, DeepSeek-V3.2, MiniMax-M3) or against ``tileattn.reference`` (fp64). Whole tiny
models are in ``test_transformers_models.py``.
"""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'transformers')")

import tileattn  # noqa: E402
import tileattn.integrations.transformers as tt  # noqa: E402

#: fp32 against an fp32 eager function or the fp64 reference: rounding only.
ATOL = 2e-5


def _qkv(batch=2, heads=4, kv_heads=2, q_len=6, k_len=6, dim=8, dv=None, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, generator=g)
    k = torch.randn(batch, kv_heads, k_len, dim, generator=g)
    v = torch.randn(batch, kv_heads, k_len, dv or dim, generator=g)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def _module(heads=4, kv_heads=2, causal=True, **attrs):
    m = torch.nn.Module()
    m.num_key_value_groups = heads // kv_heads
    m.is_causal = causal
    m.eval()
    for name, value in attrs.items():
        setattr(m, name, value)
    return m


def _causal_mask(batch, q_len, k_len):
    keep = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    return keep.expand(batch, 1, q_len, k_len).clone()


def _eager_module(model_type):
    return __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=["eager_attention_forward"])


# --- the audit -----------------------------------------------------------------------------------


def _keywords_of_attention_calls(source):
    """Keyword names of every ``attention_interface(...)`` call in a modeling file (depth-1 ``name=``)."""
    names = set()
    for match in re.finditer(r"attention_interface\(", source):
        depth, i, start = 1, match.end(), match.end()
        while depth and i < len(source):
            depth += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        body, level, flat = source[start:i - 1], 0, []
        for ch in body:
            level += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
            flat.append(ch if level == 0 or ch in "([{" else " ")
        names.update(re.findall(r"(?:^|[,(\s])(\w+)\s*=(?!=)", "".join(flat)))
    return names


def test_every_keyword_a_model_passes_is_classified():
    """Scans every model of the installed transformers: a keyword missing from tt.KWARGS fails here
    (a new transformers may add one, and it must be audited, not dropped)."""
    root = Path(transformers.__file__).parent
    seen = {}
    for path in root.glob("models/*/modeling_*.py"):
        for name in _keywords_of_attention_calls(path.read_text()):
            seen.setdefault(name, set()).add(path.parent.name)
    from transformers.modeling_flash_attention_utils import FlashAttentionKwargs
    from transformers.utils.generic import TransformersKwargs

    for typed in (TransformersKwargs, FlashAttentionKwargs):
        for name in typed.__annotations__:
            seen.setdefault(name, set()).add(typed.__name__)
    positional = {"query", "key", "value", "attention_mask"}  # some models pass them by name
    assert {"s_aux", "sinks", "indices", "block_indices", "position_bias", "softcap"} <= set(seen), seen.keys()
    unclassified = {name: sorted(models)[:5] for name, models in seen.items()
                    if name not in tt.KWARGS and name not in positional}
    assert not unclassified, f"keywords models pass that tileattn does not classify: {unclassified}"
    assert {how for how, _ in tt.KWARGS.values()} == {"honoured", "harmless", "refused"}


def test_an_unknown_keyword_raises_naming_it_and_none_is_absent():
    q, k, v = _qkv()
    module = _module()
    with pytest.raises(TypeError, match=r"passed 'attention_temperature' \(0\.5\).*HARMLESS_KWARGS"):
        tt.tileattn_attention_forward(module, q, k, v, None, attention_temperature=0.5)
    out, _ = tt.tileattn_attention_forward(module, q, k, v, None, attention_temperature=None)
    expected = tileattn.reference(q.double(), k.double(), v.double(), causal=True, align="top_left")
    torch.testing.assert_close(out.double(), expected.transpose(1, 2), atol=ATOL, rtol=0)


def test_harmless_keywords_change_nothing_and_can_be_extended(monkeypatch):
    q, k, v = _qkv()
    module = _module()
    plain, _ = tt.tileattn_attention_forward(module, q, k, v, None)
    harmless = dict(position_ids=torch.arange(6)[None], use_cache=True, cache_position=torch.arange(6),
                    output_hidden_states=True, output_router_logits=False, return_dict=True,
                    num_items_in_batch=torch.tensor(12), seq_idx=torch.zeros(1, 6, dtype=torch.int32),
                    max_length_q=6, max_length_k=6, output_attentions=False, logits_to_keep=0)
    assert set(harmless) == {n for n, (how, _) in tt.KWARGS.items() if how != "honoured"}
    out, _ = tt.tileattn_attention_forward(module, q, k, v, None, **harmless)
    assert torch.equal(out, plain)
    monkeypatch.setitem(tt.HARMLESS_KWARGS, "my_flag", "a flag of my model that attention does not read")
    assert torch.equal(tt.tileattn_attention_forward(module, q, k, v, None, my_flag=True)[0], plain)
    with pytest.raises(NotImplementedError, match="output_attentions"):
        tt.tileattn_attention_forward(module, q, k, v, None, output_attentions=True)


# --- sinks ---------------------------------------------------------------------------------------


def test_s_aux_per_head_sinks_match_gpt_oss_eager_forward_and_gradients():
    q, k, v = _qkv(grad=True)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0], requires_grad=True)
    mask = _causal_mask(2, 6, 6)
    mask[0, :, :, :2] = False  # left padding
    module = _module(sinks=sinks)
    eager = _eager_module("gpt_oss").eager_attention_forward
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    expected, _ = eager(module, q, k, v, additive, scaling=0.3, dropout=0.0)
    got, _ = tt.tileattn_attention_forward(module, q, k, v, mask, scaling=0.3, s_aux=sinks)
    # Rows that see no key (padding): the sink takes all the weight in both, so the output is 0.
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    dout = torch.randn_like(got)
    grads = torch.autograd.grad((expected * dout).sum(), (q, k, v, sinks))
    ours = torch.autograd.grad((got * dout).sum(), (q, k, v, sinks))
    for a, b in zip(ours, grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    without, _ = tt.tileattn_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert (without - got).abs().max() > 0.1, "the sinks must matter in this test"


def test_per_row_sinks_match_inkling2_eager_forward_and_gradients():
    q, k, v = _qkv(grad=True)
    sinks = torch.randn(2, 4, 6, 1, generator=torch.Generator().manual_seed(3)).mul(2).requires_grad_()
    bias = torch.randn(1, 4, 6, 6, generator=torch.Generator().manual_seed(4))
    mask = _causal_mask(2, 6, 6)
    module = _module()
    eager = _eager_module("inkling2").eager_attention_forward
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    expected, _ = eager(module, q, k, v, additive, scaling=0.3, position_bias=bias, sinks=sinks)
    got, _ = tt.tileattn_attention_forward(module, q, k, v, mask, scaling=0.3, position_bias=bias, sinks=sinks)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    dout = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * dout).sum(), (q, k, sinks)),
                    torch.autograd.grad((expected * dout).sum(), (q, k, sinks))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_bad_sinks_are_refused_naming_the_keyword():
    q, k, v = _qkv()
    module = _module()
    with pytest.raises(ValueError, match=r"argument 's_aux': got shape \(3,\); expected .*\(4,\)"):
        tt.tileattn_attention_forward(module, q, k, v, None, s_aux=torch.zeros(3))
    with pytest.raises(TypeError, match="argument 'sinks'"):
        tt.tileattn_attention_forward(module, q, k, v, None, sinks=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="argument 's_aux/sinks': got both"):
        tt.tileattn_attention_forward(module, q, k, v, None, s_aux=torch.zeros(4), sinks=torch.zeros(4))


# --- top-k sparse indices ------------------------------------------------------------------------


def test_indices_match_deepseek_v32_eager_mask():
    q, k, v = _qkv(heads=4, kv_heads=4, dv=6, grad=True)
    g = torch.Generator().manual_seed(5)
    indices = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(12)]).view(2, 6, 3).int()
    mask = _causal_mask(2, 6, 6)
    mask[1, :, :, 0] = False
    module = _module(heads=4, kv_heads=4)
    # What DeepseekV32Attention.forward does for eager/sdpa: mask out the keys not selected.
    dropped = torch.ones(2, 6, 6, dtype=torch.bool).scatter(-1, indices.long(), False).unsqueeze(1)
    additive = torch.zeros(mask.shape).masked_fill(~(mask & ~dropped), torch.finfo(torch.float32).min)
    expected, _ = _eager_module("deepseek_v32").eager_attention_forward(module, q, k, v, additive, scaling=0.4)
    got, _ = tt.tileattn_attention_forward(module, q, k, v, mask, scaling=0.4, indices=indices)
    visible = (mask & ~dropped).any(-1)[:, 0]  # rows that see a key (eager gives the others uniform garbage)
    torch.testing.assert_close(got[visible], expected[visible], atol=ATOL, rtol=0)
    dense, _ = tt.tileattn_attention_forward(module, q, k, v, mask, scaling=0.4)
    assert (dense - got)[visible].abs().max() > 0.1, "the indices must matter in this test"
    dout = torch.randn_like(got).masked_fill(~visible[..., None, None], 0)
    for a, b in zip(torch.autograd.grad((got * dout).sum(), (q, k, v)),
                    torch.autograd.grad((expected * dout).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bad, error, match", [
    (torch.zeros(2, 6, 3), TypeError, r"argument 'indices': got a torch.float32 tensor"),
    (torch.zeros(2, 5, 3, dtype=torch.int32), ValueError, r"argument 'indices': got shape \(2, 5, 3\)"),
    (torch.full((2, 6, 3), 6, dtype=torch.int32), ValueError, r"argument 'indices': got values in \[6, 6\]; "
                                                              r"expected key indices in \[0, 5\]"),
])
def test_bad_indices_are_refused(bad, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        tt.tileattn_attention_forward(_module(), q, k, v, None, indices=bad)


def test_block_indices_match_minimax_m3_eager_block_mask():
    config = transformers.MiniMaxM3VLTextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, index_n_heads=2,
        index_head_dim=8, index_block_size=2, index_topk_blocks=2, index_local_blocks=1,
        layer_types=["minimax_m3_sparse"], mlp_layer_types=["dense"], num_hidden_layers=1)
    modeling = _eager_module("minimax_m3_vl")
    indexer = modeling.MiniMaxM3VLIndexer(config, 0)
    q, k, v = _qkv(q_len=7, k_len=7)
    # (B, H_index, Sq, top-k) block ids, -1 = an empty slot (what the indexer returns)
    block_indices = torch.tensor([[[[0, -1], [0, 1], [1, -1], [1, 0], [2, 0], [2, -1], [3, 1]]] * 2] * 2)
    mask = _causal_mask(2, 7, 7)
    positions = torch.arange(7).expand(2, 7)
    additive = indexer.build_block_mask(block_indices, mask, 7, torch.float32, "cpu", positions)
    module = _module(indexer=indexer)
    expected, _ = modeling.eager_attention_forward(module, q, k, v, additive, scaling=0.35)
    got, _ = tt.tileattn_attention_forward(module, q, k, v, mask, scaling=0.35, block_indices=block_indices)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    dense, _ = tt.tileattn_attention_forward(module, q, k, v, mask, scaling=0.35)
    assert (dense - got).abs().max() > 0.1, "the block indices must matter in this test"
    with pytest.raises(ValueError, match=r"argument 'block_indices': got block indices from Module, which has no "
                                         r"indexer.block_size"):
        tt.tileattn_attention_forward(_module(), q, k, v, mask, block_indices=block_indices)


# --- packed sequences (cu_seq_lens) and sliding windows without a mask ---------------------------


def _packed(lengths_q, lengths_k, heads=4, kv_heads=2, dim=8, seed=0):
    q, k, v = _qkv(batch=1, heads=heads, kv_heads=kv_heads, q_len=sum(lengths_q), k_len=sum(lengths_k), dim=dim,
                   seed=seed)
    cu = lambda lengths: torch.tensor([0] + lengths).cumsum(0).int()  # noqa: E731
    return q, k, v, cu(lengths_q), cu(lengths_k)


def _per_sequence_reference(q, k, v, cu_q, cu_k, **kwargs):
    """Each packed sequence on its own, in fp64: flash-attn varlen semantics (bottom-right)."""
    parts = []
    for i in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        parts.append(tileattn.reference(q[:, :, a:b].double(), k[:, :, c:d].double(), v[:, :, c:d].double(),
                                        **kwargs))
    return torch.cat(parts, dim=2).transpose(1, 2)


@pytest.mark.parametrize("lengths_q, lengths_k, window", [
    ([3, 5, 2], [3, 5, 2], None), ([3, 5, 2], [3, 5, 2], 2), ([2, 1, 3], [4, 2, 3], None)])
def test_cu_seq_lens_without_a_mask_are_flash_attn_varlen(lengths_q, lengths_k, window):
    """No mask (padding-free training): each sequence causal on its own, bottom-right, window inside."""
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k)
    expected = _per_sequence_reference(q, k, v, cu_q, cu_k, causal=True,
                                       window=None if window is None else (window - 1, 0))
    got, _ = tt.tileattn_attention_forward(_module(), q, k, v, None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k,
                                           max_length_q=max(lengths_q), max_length_k=max(lengths_k),
                                           sliding_window=window)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("lengths_q, lengths_k, causal", [([3, 5, 2], [3, 5, 2], True), ([2, 1, 3], [4, 2, 3], False)])
def test_cu_seq_lens_with_a_mask_hide_the_other_sequences(lengths_q, lengths_k, causal):
    """A mask that does not separate the sequences (transformers skips that with a cache): the
    sequences are kept apart; the mask's own pattern (here causal or nothing) still applies. With a
    float bias in the call too, which the varlen layout cannot take."""
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k)
    sq, sk = q.shape[2], k.shape[2]
    mask = torch.ones(sq, sk, dtype=torch.bool).tril() if causal else torch.ones(sq, sk, dtype=torch.bool)
    bias = torch.randn(1, 4, sq, sk, generator=torch.Generator().manual_seed(9))
    parts = []
    for i in range(len(lengths_q)):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        parts.append(tileattn.reference(q[:, :, a:b].double(), k[:, :, c:d].double(), v[:, :, c:d].double(),
                                        causal=causal, bias=bias[:, :, a:b, c:d].double()))
    expected = torch.cat(parts, dim=2).transpose(1, 2)
    got, _ = tt.tileattn_attention_forward(_module(), q, k, v, mask[None, None], position_bias=bias,
                                           cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=0)


def test_cu_seq_lens_errors():
    q, k, v, cu_q, cu_k = _packed([3, 3], [3, 3])
    module = _module()
    with pytest.raises(ValueError, match="argument 'cu_seq_lens_k': got None"):
        tt.tileattn_attention_forward(module, q, k, v, None, cu_seq_lens_q=cu_q)
    with pytest.raises(ValueError, match=r"argument 'cu_seq_lens_q': got \[0, 3, 5\]; expected non-decreasing "
                                         r"offsets from 0 to 6"):
        tt.tileattn_attention_forward(module, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 3, 5]),
                                      cu_seq_lens_k=cu_k)
    q2, k2, v2 = (torch.cat([t, t]) for t in (q, k, v))
    with pytest.raises(ValueError, match="argument 'cu_seq_lens_q': got packed sequences with a batch of 2"):
        tt.tileattn_attention_forward(module, q2, k2, v2, None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)


def test_sliding_window_without_a_mask():
    q, k, v = _qkv(q_len=7, k_len=7)
    module = _module()
    got, _ = tt.tileattn_attention_forward(module, q, k, v, None, sliding_window=3)
    expected = tileattn.reference(q.double(), k.double(), v.double(), causal=True, window=(2, 0))
    torch.testing.assert_close(got.double(), expected.transpose(1, 2), atol=ATOL, rtol=0)
    bidirectional, _ = tt.tileattn_attention_forward(_module(causal=False), q, k, v, None, sliding_window=3)
    expected = tileattn.reference(q.double(), k.double(), v.double(), window=(2, 2))
    torch.testing.assert_close(bidirectional.double(), expected.transpose(1, 2), atol=ATOL, rtol=0)
    # With a mask the window is already in it (what transformers does): the keyword adds nothing.
    mask = _causal_mask(2, 7, 7)
    torch.testing.assert_close(tt.tileattn_attention_forward(module, q, k, v, mask, sliding_window=3)[0],
                               tt.tileattn_attention_forward(module, q, k, v, mask)[0], atol=0, rtol=0)
    q1 = q[:, :, -1:]
    with pytest.raises(ValueError, match=r"argument 'sliding_window': got 3 with no attention mask, 1 queries and "
                                         r"7 keys"):
        tt.tileattn_attention_forward(module, q1, k, v, None, sliding_window=3)
    decode, _ = tt.tileattn_attention_forward(module, q1, k, v, None, sliding_window=8)  # hides nothing
    expected = tileattn.reference(q1.double(), k.double(), v.double())
    torch.testing.assert_close(decode.double(), expected.transpose(1, 2), atol=ATOL, rtol=0)


def test_deterministic_and_dropout_are_passed_on():
    q, k, v = _qkv()
    module = _module()
    torch.manual_seed(7)
    a, _ = tt.tileattn_attention_forward(module, q, k, v, None, dropout=0.5, deterministic=True)
    torch.manual_seed(7)
    b, _ = tt.tileattn_attention_forward(module, q, k, v, None, dropout=0.5, deterministic=True)
    plain, _ = tt.tileattn_attention_forward(module, q, k, v, None)
    assert torch.equal(a, b) and not torch.allclose(a, plain)
    with pytest.raises(ValueError, match="argument 'dropout'"):
        tt.tileattn_attention_forward(module, q, k, v, None, dropout=1.0)


def test_report_lists_every_keyword_and_architecture():
    report = tt.integration_report()
    assert report["transformers"] == transformers.__version__ and report["audited_with"] == tt.AUDITED_TRANSFORMERS
    assert [row["kwarg"] for row in report["kwargs"]] == list(tt.KWARGS)
    assert [row["model_type"] for row in report["architectures"]] == [a.model_type for a in tt.ARCHITECTURES]
    assert isinstance(SimpleNamespace(**report["architectures"][0]).uses_tileattn, bool)


def test_core_minus_inf_sink_on_a_row_that_sees_no_key_gives_zero():
    q, k, v = _qkv(batch=1, heads=2, kv_heads=2, q_len=4, k_len=4)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 0, :] = False
    out = tileattn.flash_attention(q, k, v, mask=mask, sinks=torch.tensor([-float("inf"), 1.0]))
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))


def test_per_row_sinks_of_minus_inf_on_a_row_that_sees_no_key_give_zero():
    """The integration's own sink merge (per-row sinks) does not have the core's NaN."""
    q, k, v = _qkv(batch=1, heads=2, kv_heads=2, q_len=4, k_len=4)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 0, :] = False
    sinks = torch.full((1, 2, 4, 1), -float("inf"))
    out, _ = tt.tileattn_attention_forward(_module(heads=2, kv_heads=2), q, k, v, mask, sinks=sinks)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0]))
    plain, _ = tt.tileattn_attention_forward(_module(heads=2, kv_heads=2), q, k, v, mask)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=0)
