"""tileattn.integrations.transformers.PagedCache: a Hugging Face cache in a paged (quantised) pool, read
as stored by the "tileattn" attention implementation."""

import copy
import re

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (extra 'transformers')")

import tileattn  # noqa: E402
import tileattn.integrations.transformers as tt  # noqa: E402
from tileattn.core.kvquant import dequantise  # noqa: E402
from tileattn.core.testing import judge  # noqa: E402
from tileattn.dialects import transformers_cache  # noqa: E402

VOCAB = 128
DTYPES = [None, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn, "int4"]


def _config(**extra):
    # head dim 64: an int8 row and its fp32 scale are 68 bytes against bf16's 128
    base = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=256, pad_token_id=0)
    base.update(extra)
    return transformers.LlamaConfig(**base)


def _models(config, dtype=torch.float32):
    tt.register()
    torch.manual_seed(0)
    sdpa = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tileattn")
    ours.load_state_dict(sdpa.state_dict())
    return sdpa.to(dtype).eval(), ours.to(dtype).eval()


def _prompts(batch=3, length=14, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[2, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_fp32_greedy_tokens_equal_sdpa_with_a_dynamic_cache(name):
    config = _config() if name == "llama" else transformers.MistralConfig(**{
        **_config().to_dict(), "sliding_window": 6, "model_type": "mistral"})  # a window shorter than the prompt
    sdpa, ours = _models(config)
    ids, mask = _prompts()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        expected = sdpa.generate(ids, cache=transformers.DynamicCache(config=sdpa.config), **kwargs)
        cache = tt.PagedCache(ours.config, max_batch_size=4, max_cache_len=40, page_size=8)
        got = ours.generate(ids, cache=cache, **kwargs)
    assert torch.equal(got, expected)
    assert cache.lengths() == [25, 25, 25] and cache.get_seq_length() == 25  # the last token is not fed back


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_dtype_reads_as_stored_and_matches_the_fp64_attention_over_the_dequantised_pool(dtype, monkeypatch):
    _, ours = _models(_config())
    cache = tt.PagedCache(ours.config, max_batch_size=3, max_cache_len=48, dtype=dtype, page_size=8)
    read = []
    real = transformers_cache.flash_attention

    def spy(q, k, v, **kwargs):
        read.append((k.dtype, kwargs["k_scale"] is not None))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(transformers_cache, "flash_attention", spy)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # three sequences at different lengths: 5, 17 and 9 tokens, then one more each
        for s, n in zip(cache.add(3), (5, 17, 9)):
            cache.select([s])
            ours(torch.randint(1, VOCAB, (1, n), generator=g), cache=cache)
        cache.select([0, 1, 2])
        ours(torch.randint(1, VOCAB, (3, 1), generator=g), cache=cache,
             position_ids=torch.tensor([[5], [17], [9]]))
    stored = {None: torch.float32, "int4": torch.uint8}.get(dtype, dtype)
    assert read and all(k == stored and scaled == (stored not in (torch.float32, torch.bfloat16, torch.float16))
                        for k, scaled in read)
    assert cache.lengths() == [6, 18, 10]
    layer = cache.layers[1]
    q = torch.randn(3, 4, 2, 64, generator=g)  # (B, H, q_len, D): the last two tokens of each row
    _, used, table, _ = cache._step
    out, _ = transformers_cache.paged_attention(layer.read, q, None, scaling=0.125, softcap=0.0, sinks=None)

    def pools(compute):
        k = dequantise(layer.keys, layer.k_scale, None, compute)
        v = dequantise(layer.values, layer.v_scale, None, compute)
        return k, v

    qc = q.transpose(1, 2).to(layer.keys.dtype if layer.keys.dtype in (torch.bfloat16, torch.float16) else q.dtype)
    call = dict(layout="BSND", block_table=table, seqused_k=used, causal=True, scale=0.125)
    oracle = tileattn.reference(qc.double(), *pools(torch.float64), compute_dtype=torch.float64, **call)
    baseline = tileattn.reference(qc, *pools(qc.dtype), compute_dtype=qc.dtype, **call)
    verdict = judge("out", out.to(qc.dtype), oracle, baseline, qc.dtype)
    assert verdict.ok, verdict


def test_storage_bytes_include_the_scales_and_int8_is_at_most_055_of_bf16():
    _, ours = _models(_config())
    sizes = {}
    for dtype in DTYPES[1:]:
        cache = tt.PagedCache(ours.config, max_batch_size=2, max_cache_len=32, dtype=dtype)
        assert cache.nbytes == 0  # pools are allocated at the first forward
        with torch.no_grad():
            ours(torch.randint(1, VOCAB, (2, 3)), cache=cache)
        rows = 2 * 2 * 64 * 2  # layers, K and V, slots (2 sequences x 32), kv heads
        per_row = {torch.int8: 64 + 4, torch.float8_e4m3fn: 64 + 4, "int4": 32 + 2 * 4}.get(dtype, 128)
        assert cache.nbytes == rows * per_row
        sizes[dtype] = cache.nbytes
    assert sizes[torch.int8] <= 0.55 * sizes[torch.bfloat16]
    assert sizes["int4"] <= 0.33 * sizes[torch.bfloat16]


def test_continuous_batching_requests_join_and_leave_one_pool():
    sdpa, ours = _models(_config())
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (1, n), generator=g) for n in (7, 12, 4, 9)]
    wanted = [6, 3, 8, 5]
    with torch.no_grad():
        alone = [sdpa.generate(p, max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, p.shape[1]:].tolist()
                 for p, n in zip(prompts, wanted)]
        # two sequences at a time in a pool too small for all four at full length: the third and fourth
        # requests join once the first ones leave and reuse their pages
        cache = tt.PagedCache(ours.config, max_batch_size=2, max_cache_len=24, page_size=4, num_pages=8)
        waiting, running, out = list(range(4)), {}, {}
        while waiting or running:
            while waiting and len(running) < 2:
                r = waiting.pop(0)
                (s,) = cache.add()
                cache.select([s])
                logits = ours(prompts[r], cache=cache).logits[:, -1]
                running[r] = (s, [int(logits.argmax())])
            order = list(running)
            cache.select([running[r][0] for r in order])
            last = torch.tensor([[running[r][1][-1]] for r in order])
            positions = torch.tensor([[prompts[r].shape[1] + len(running[r][1]) - 1] for r in order])
            logits = ours(last, cache=cache, position_ids=positions).logits[:, -1]
            for r, token in zip(order, logits.argmax(-1).tolist()):
                running[r][1].append(token)
                if len(running[r][1]) == wanted[r]:
                    cache.release([running[r][0]])
                    out[r] = running.pop(r)[1]
    assert [out[r] for r in range(4)] == alone
    assert cache.sequences == [] and int(cache.free_count[0]) == 8


def test_bad_input_is_refused_naming_the_argument_before_anything_is_written():
    _, ours = _models(_config())
    config = ours.config
    with pytest.raises(TypeError, match="argument 'dtype'.*torch.int16"):
        tt.PagedCache(config, max_batch_size=2, max_cache_len=16, dtype=torch.int16)
    with pytest.raises(ValueError, match="argument 'max_cache_len'"):
        tt.PagedCache(config, max_batch_size=2, max_cache_len=0)
    with pytest.raises(ValueError, match="argument 'dtype'.*'int4' for head dim 48"):
        tt.PagedCache(_config(head_dim=48), max_batch_size=2, max_cache_len=16, dtype="int4")
    cache = tt.PagedCache(config, max_batch_size=2, max_cache_len=16, dtype=torch.int8, page_size=4, num_pages=6)
    with torch.no_grad():
        ours(torch.randint(1, VOCAB, (2, 10)), cache=cache)

        def state():
            layer = cache.layers[0]
            return [t.clone() for t in (cache.block_table, cache.seq_lengths, cache.pages_held, cache.free_pages,
                                        cache.free_count, cache.rows, layer.keys, layer.k_scale)]

        before = state()
        with pytest.raises(ValueError, match="argument 'max_cache_len'.*7 more tokens of sequence 0, which holds 10"):
            ours(torch.randint(1, VOCAB, (2, 7)), cache=cache)
        with pytest.raises(ValueError, match="argument 'num_pages'.*2 free pages for this forward \\(0 free\\)"):
            ours(torch.randint(1, VOCAB, (2, 3)), cache=cache)
        with pytest.raises(ValueError, match="argument 'key_states'.*a batch of 3 rows.*2"):
            ours(torch.randint(1, VOCAB, (3, 1)), cache=cache)
        with pytest.raises(ValueError, match="argument 'max_batch_size'.*room for 1 more"):
            cache.add()
        with pytest.raises(ValueError, match="argument 'sequences'.*sequence 5"):
            cache.select([5])
        assert all(torch.equal(a, b) for a, b in zip(state(), before))
        ours(torch.randint(1, VOCAB, (2, 2)), cache=cache)  # what fits still runs
    assert cache.lengths() == [12, 12]
    sdpa_model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    with pytest.raises(TypeError, match="PagedCache is read as stored by the 'tileattn' attention implementation"):
        sdpa_model(torch.randint(1, VOCAB, (1, 3)),
                   cache=tt.PagedCache(config, max_batch_size=1, max_cache_len=8))
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([1, 0]))


def test_decode_steps_compile_to_one_graph_that_matches_eager():
    from torch._dynamo.utils import counters

    _, ours = _models(_config())
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))

    def decode(forward):
        cache = tt.PagedCache(ours.config, max_batch_size=2, max_cache_len=32, dtype=torch.int8, page_size=4)
        with torch.no_grad():
            logits = ours(ids, cache=cache).logits[:, -1]  # prefill, eager (as generate does)
            tokens = []
            for _ in range(6):  # crosses page boundaries: pages are taken inside the graph
                tokens.append(logits.argmax(-1, keepdim=True))
                logits = forward(tokens[-1], cache=cache).logits[:, -1]
        return torch.cat(tokens, 1)

    eager = decode(ours.forward)
    torch._dynamo.reset()
    counters.clear()
    compiled = decode(torch.compile(ours.forward, fullgraph=True))
    assert torch.equal(compiled, eager)
    assert counters["stats"]["unique_graphs"] == 1


def _state(cache):
    """The cache's bookkeeping, to compare before and after a refusal."""
    return [t.clone() for t in (cache.block_table, cache.seq_lengths, cache.pages_held, cache.free_pages,
                                cache.free_count, cache.rows)] + [cache.sequences]


def _same(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("ids", [[1, 1], [0, 1, 0], [0.9], [True], ["1"], "01", [1.0], torch.tensor([0.0]), 1])
def test_release_and_select_refuse_repeated_and_non_int_ids_before_any_change(ids):
    """release([s, s]) once put s's pages on the free list twice (two later sequences then shared
    them), and 0.9, True and '1' were taken as ids: both methods refuse them, and nothing changes."""
    _, ours = _models(_config())
    cache = tt.PagedCache(ours.config, max_batch_size=3, max_cache_len=16, page_size=4)
    with torch.no_grad():
        ours(torch.randint(1, VOCAB, (2, 6)), cache=cache)
    before = _state(cache)
    for method in (cache.release, cache.select):
        with pytest.raises((TypeError, ValueError), match="argument 'sequences'.*distinct int sequence ids"):
            method(ids)
        assert _same(_state(cache), before)


def test_released_pages_are_never_shared_by_two_sequences():
    """After a sequence leaves, the two that take its pages hold disjoint pages, and each one's
    logits are those of its prompt alone."""
    sdpa, ours = _models(_config())
    g = torch.Generator().manual_seed(6)
    cache = tt.PagedCache(ours.config, max_batch_size=3, max_cache_len=16, page_size=4, num_pages=8)
    with torch.no_grad():
        first = cache.add(2)
        for s in first:
            cache.select([s])
            ours(torch.randint(1, VOCAB, (1, 8)), cache=cache)
        cache.release(first[:1])
        prompts = [torch.randint(1, VOCAB, (1, 8), generator=g) for _ in range(2)]
        got = []
        for p in prompts:
            (s,) = cache.add()
            cache.select([s])
            got.append(ours(p, cache=cache).logits[0, -1])
        expected = [sdpa(p).logits[0, -1] for p in prompts]
    held = [set(cache.block_table[s, :int(cache.pages_held[s])].tolist()) for s in cache.sequences]
    assert sum(map(len, held)) == len(set().union(*held)) == 6
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(got, expected))


def test_a_4d_mask_edited_in_place_between_forwards_is_read_again():
    """A caller's 4-d mask that hides nothing, then edited in place to hide the first keys: the
    second forward reads the edit (it was memoised per mask object and ignored). Oracle: sdpa with a
    DynamicCache given the same mask."""
    sdpa, ours = _models(_config())
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, 1, 1, 16, dtype=torch.bool)
    logits = {}
    with torch.no_grad():
        for name, model, cache in (("ours", ours, tt.PagedCache(ours.config, max_batch_size=2, max_cache_len=16)),
                                   ("sdpa", sdpa, transformers.DynamicCache(config=sdpa.config))):
            mask.fill_(True)
            model(ids, cache=cache)
            # ours: the same object both times, over the cache's 16 slots; sdpa: views over the keys it holds
            model(ids[:, :1], cache=cache, attention_mask=mask if name == "ours" else mask[..., :7])
            mask[..., :3] = False
            given = mask if name == "ours" else mask[..., :8]
            logits[name] = model(ids[:, 1:2], cache=cache, attention_mask=given).logits
    assert torch.allclose(logits["ours"], logits["sdpa"], atol=1e-4), (logits["ours"] - logits["sdpa"]).abs().max()


def test_a_model_with_more_layers_than_the_cache_is_refused_before_anything_is_written():
    """It wrote its tokens into the cache's layers, then failed past them with a raw IndexError."""
    _, ours = _models(_config())
    cache = tt.PagedCache(_config(num_hidden_layers=1), max_batch_size=2, max_cache_len=16, page_size=4)
    before = _state(cache)
    with torch.no_grad():
        with pytest.raises(ValueError, match="argument 'config'.*config of 1 layers, for a model of 2 layers.*"
                                             "nothing was written.*PagedCache\\(model.config"):
            ours(torch.randint(1, VOCAB, (2, 5)), cache=cache)
    assert _same(_state(cache), before) and cache.nbytes == 0


@pytest.mark.parametrize("mode", [dict(num_beams=2), dict(prompt_lookup_num_tokens=2)])
def test_beam_search_and_assisted_decoding_are_refused_before_the_prefill_writes(mode):
    _, ours = _models(_config())
    cache = tt.PagedCache(ours.config, max_batch_size=4, max_cache_len=32)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="argument '(num_beams|prompt_lookup_num_tokens)'"):
        ours.generate(torch.randint(1, VOCAB, (1, 5)), cache=cache, max_new_tokens=3, do_sample=False, **mode)
    assert cache.sequences == [] and cache.nbytes == 0


@pytest.mark.parametrize("call", ["forward", "generate"])
def test_another_attention_implementation_is_refused_before_anything_is_written(call):
    """An sdpa model once wrote its prefill into the cache before its attention read the layer."""
    sdpa, _ = _models(_config())
    cache = tt.PagedCache(sdpa.config, max_batch_size=2, max_cache_len=16)
    before = _state(cache)
    ids = torch.randint(1, VOCAB, (2, 3))
    with torch.no_grad(), pytest.raises(TypeError, match="argument 'attn_implementation': got 'sdpa'.*nothing was "
                                                         "written.*attn_implementation='tileattn'"):
        sdpa(ids, cache=cache) if call == "forward" else sdpa.generate(ids, cache=cache, max_new_tokens=2)
    assert _same(_state(cache), before) and cache.nbytes == 0


def test_what_the_caller_check_cannot_see_is_refused_after_the_write_and_taken_out_again():
    """Called from no attention module (no config to read): a layer past the cache's, or its keys read
    as tensors, is refused after the write, and the forward's tokens are taken out again."""
    cache = tt.PagedCache(_config(), max_batch_size=2, max_cache_len=16, page_size=4)
    k = torch.randn(2, 2, 3, 64)
    cache.update(k, k, 0)  # the pools exist from here on
    cache.reset()
    before = _state(cache)
    cache.update(k, k, 0)
    cache.update(k, k, 1)
    with pytest.raises(ValueError, match="argument 'layer_idx': got 2, from a model with more layers.*2 layers; the "
                                         "forward's tokens were taken out again"):
        cache.update(k, k, 2)
    assert _same(_state(cache), before)
    kv, _ = cache.update(k, k, 0)
    with pytest.raises(TypeError, match="read 'shape'.*taken out of the cache again"):
        kv.shape
    assert _same(_state(cache), before)


_HUGE = """
import resource
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # a size that got through fails to allocate, not swaps
import torch, transformers
import tileattn.integrations.transformers as tt
config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64)
for kwargs in ({CASES}):
    try:
        cache = tt.PagedCache(config, **kwargs)
        key = torch.zeros(1, 2, 1, 64)
        cache.update(key, key, 0)  # the pools are allocated by the first write
        print("accepted", flush=True)
    except Exception as exc:
        print(type(exc).__name__, str(exc).replace(chr(10), " "), flush=True)
"""


def test_huge_sizes_are_refused_naming_the_argument_in_a_child_process():
    """Sizes past int32 (the kernels' lengths and page indices), or tables and pools too large for
    memory, gave raw overflow or allocation errors (or could take the machine's memory): each is
    refused naming its argument, in a child process with a bounded address space."""
    import subprocess
    import sys

    from conftest import sigint_as_usual

    cases = [(dict(max_batch_size=1, max_cache_len=2**40), "max_cache_len': got 1099511627776 \\(1099511627776 slots"),
             (dict(max_batch_size=2**40, max_cache_len=16), "max_batch_size': got 1099511627776"),
             (dict(max_batch_size=2, max_cache_len=16, num_pages=2**33), "num_pages': got 8589934592"),
             (dict(max_batch_size=2**20, max_cache_len=2**20), "num_pages': got None, by default max_batch_size x "
              "pages per sequence = 1048576 x 65536 = 68719476736.*pass num_pages"),
             (dict(max_batch_size=2**31 - 1, max_cache_len=2**20, num_pages=16), "max_batch_size': got 2147483647 "
              "sequences of 65536 pages.*could not be allocated"),
             (dict(max_batch_size=1, max_cache_len=16, num_pages=2**31 - 1), "num_pages': got 2147483647, whose free "
              "list could not be allocated"),
             (dict(max_batch_size=1, max_cache_len=16, num_pages=2**28), "num_pages': got 268435456 pages of 16 "
              "tokens.*could not allocate")]
    script = _HUGE.replace("{CASES}", ", ".join(repr(kwargs) for kwargs, _ in cases))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         preexec_fn=sigint_as_usual)
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and len(lines) == len(cases), res.stdout + res.stderr[-3000:]
    for line, (kwargs, expected) in zip(lines, cases):
        assert re.match(f"ValueError tileattn: argument '{expected}", line) and "; expected " in line, (kwargs, line)


def test_mla_is_refused_naming_it():
    mla = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8)
    with pytest.raises(ValueError, match="argument 'config'.*DeepseekV3Config, multi-head latent attention.*PagedCache "
                                         "does not support MLA"):
        tt.PagedCache(mla, max_batch_size=1, max_cache_len=16)
