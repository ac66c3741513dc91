# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 10 · Decoding
#
# A language model generates text one token at a time. The first forward pass over the prompt (the
# *prefill*) is the attention of tutorials 01-09: `S` queries against `S` keys, `O(S^2 D)` work,
# limited by arithmetic. Every later step (*decode*) adds one token: **one query per head against
# every key so far**. This chapter is about that step:
#
# 1. **why a KV cache**: the keys and values of old tokens never change, so they are stored, not
#    recomputed; the FLOPs and bytes, counted;
# 2. **decode is bandwidth-bound**: one query does 2 FLOPs per key element it reads; the machine's
#    streaming bandwidth, measured here, sets the time of a decode call, measured against it;
# 3. **grouped-query attention**: `G` query heads share one kv head, so K/V are read once per kv
#    head, not once per query head;
# 4. **ragged batches and a paged cache**: sequences of different lengths (`seqused_k`,
#    `cache_seqlens`), and a cache cut into blocks scattered over a pool (`block_table`), built by
#    hand;
# 5. **split-KV** (flash-decoding): cutting the keys into chunks and merging the chunks by their
#    LSE, because a decode step has too few (sequence, kv head) rows to fill a machine;
# 6. **batch invariance**: a row's bits must not depend on what else is in the batch, and why a split
#    chosen by the machine's load would break that;
# 7. **a generate loop**: a Hugging Face Llama generating with `attn_implementation="tileattn"`, and
#    the same loop written by hand with `flash_attn_with_kvcache`, updating its cache in place.
#
# Every result is checked against `tileattn.reference` in fp64. Timings run on **one thread**
# (`torch.set_num_threads(1)`) and are taken in the thread's CPU time (as tutorial 09), which other
# jobs on a shared machine do not inflate; only the two-thread measurements of section 5 use the wall
# clock.

# %%
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from matplotlib.ticker import FormatStrFormatter

try:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging
except ImportError as exc:
    raise SystemExit(f"tutorial 10 needs transformers: pip install 'tileattn[transformers]' ({exc})")

import tileattn
import tileattn.integrations.transformers as tileattn_hf
from tileattn.tools import measure
from tileattn.compat.flash_attn import flash_attn_with_kvcache
from tileattn.core.testing import judge
from _hub import MiB, check, figure, peak_memory, pick, save_figure, seeded

torch.set_num_threads(1)
F64, GiB, GB = torch.float64, 2.0**30, 1e9
print(f"CPU: {measure.cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} thread")


def cpu_seconds(fns: dict, reps: int, iters: int = 1) -> dict:
    """{name: median seconds per call} in this thread's CPU time; functions run round-robin, each
    repetition `iters` calls in a row, after one warm-up call each."""
    samples = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.thread_time()
            for _ in range(iters):
                fn()
            samples[name].append((time.thread_time() - t0) / iters)
    return {name: statistics.median(s) for name, s in samples.items()}


def rule(name, result, oracle, plain, dtype=torch.float32):
    """FlashAttention's accuracy rule (tutorial 05): error <= 2x that of plain math in ``dtype``."""
    verdict = judge(name, result, oracle, plain, dtype)
    print(" ", verdict)
    return verdict.ok


hf_logging.set_verbosity_error()
tileattn_hf.register()
config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
LAYERS, HQ, HKV = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
HEAD_DIM = config.hidden_size // HQ

# %% [markdown]
# ## 1. Why a KV cache
#
# In a causal model, the hidden state of position `i` at every layer depends on tokens `0..i` only.
# So when token `t` arrives, the keys and values of positions `0..t-1`, in every layer, are exactly
# what they were at the previous step. Without a cache, generating token `t + 1` runs the whole
# model over all `t` tokens again; with one, it runs the model over the one new token, **appends**
# its K and V to the cache, and lets its query attend to the whole cache.
#
# Count the matrix-product FLOPs of one forward over `n` new tokens ending at position `t`: every
# linear layer costs `2 W` per token (`W` the weights of the model's linear layers, LM head included),
# and the new token at position `p` attends to `p + 1` keys, `4 Hq D (p + 1)` FLOPs per layer
# (`2 D` for a score, `2 D` for its share of `P V`). Generating `N` tokens after a prompt of `P`:
#
# ```
# no cache:  forwards over t = P, P+1, ..., P+N-1 tokens     linear: N W (2P + N - 1), attention ~ t^2 each
# KV cache:  one forward over the P prompt tokens, then       linear: 2 W (P + N - 1),  attention ~ t each
#            N - 1 forwards over one token each
# ```
#
# The cache turns a cost quadratic in the length into a linear one, and costs memory instead:
# `2 x layers x Hkv x D` numbers per token. We first check the premise on the model itself (the
# keys of old positions do not change when tokens are added), then that attention of the new query
# over cached K/V is the last row of full causal attention, against the fp64 reference.

# %%
ids = torch.randint(0, config.vocab_size, (1, pick(24, 64)), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    model.set_attn_implementation("eager")
    short = model.to(F64)(ids[:, :-8], use_cache=True).past_key_values
    longer = model(ids, use_cache=True).past_key_values
    model.float()
stable = max(float((getattr(short.layers[i], name) - getattr(longer.layers[i], name)[:, :, :-8]).abs().max())
             for i in range(LAYERS) for name in ("keys", "values"))
check(stable < 1e-12, f"adding 8 tokens leaves every layer's keys and values of the old positions unchanged (fp64, "
      f"max change {stable:.1e})")

x = seeded(1, ids.shape[1], config.hidden_size, seed=2, dtype=F64)
attn = model.model.layers[0].self_attn
w_q, w_k, w_v = (p.weight.detach().to(F64) for p in (attn.q_proj, attn.k_proj, attn.v_proj))


def heads(x, w):
    """(B, S, hidden) @ w.T -> (B, heads, S, D)."""
    return (x @ w.T).unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2)


k_cache, v_cache, worst = x.new_zeros(1, HKV, 0, HEAD_DIM), x.new_zeros(1, HKV, 0, HEAD_DIM), 0.0
for t in range(1, x.shape[1] + 1):
    new = x[:, t - 1:t]
    k_cache = torch.cat((k_cache, heads(new, w_k)), dim=2)  # append this token's K and V
    v_cache = torch.cat((v_cache, heads(new, w_v)), dim=2)
    cached = tileattn.reference(heads(new, w_q), k_cache, v_cache)
    recomputed = tileattn.reference(heads(x[:, :t], w_q), heads(x[:, :t], w_k), heads(x[:, :t], w_v), causal=True)
    worst = max(worst, float((cached - recomputed[:, :, -1:]).abs().max()))
check(worst < 1e-12, f"at each of {x.shape[1]} steps, the new query over the cache = the last row of full causal "
      f"attention recomputed from scratch (fp64, max difference {worst:.1e})")
q32, k32, v32 = (t.float() for t in (heads(x[:, -1:], w_q), k_cache, v_cache))
check(rule("decode", tileattn.flash_attention(q32, k32, v32), cached, tileattn.reference(q32, k32, v32)),
      "tileattn's decode over the fp32 cache passes the 2x rule (GQA: 8 query heads read 2 cached kv heads)")

# %% [markdown]
# The FLOPs of both ways for this model, and the measured cost of `generate` with and without the
# cache (`use_cache=False` recomputes everything at every step):

# %%
W = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def forward_flops(n, t):
    """(linear, attention) matmul FLOPs of a forward over n new tokens, the last at position t - 1."""
    keys_seen = n * t - n * (n - 1) // 2  # the token at position p sees p + 1 keys (causal)
    return 2 * W * n, LAYERS * 4 * HQ * HEAD_DIM * keys_seen


P_gen, N_gen = pick(32, 128), pick(8, 64)
lin_none, att_none = map(sum, zip(*(forward_flops(t, t) for t in range(P_gen, P_gen + N_gen))))
lin_cache, att_cache = map(sum, zip(forward_flops(P_gen, P_gen),
                                    *(forward_flops(1, t) for t in range(P_gen + 1, P_gen + N_gen))))
check(lin_none == W * N_gen * (2 * P_gen + N_gen - 1) and lin_cache == 2 * W * (P_gen + N_gen - 1),
      f"linear layers: N W (2P + N - 1) without a cache, 2 W (P + N - 1) with one (W = {W / 1e6:.2f} M weights)")
no_cache, with_cache = lin_none + att_none, lin_cache + att_cache
print(f"{N_gen} tokens after a {P_gen}-token prompt: {no_cache / 1e9:.2f} GFLOP without a cache "
      f"({att_none / no_cache:.0%} attention), {with_cache / 1e9:.3f} GFLOP with one: {no_cache / with_cache:.0f}x")

prompt = torch.randint(0, config.vocab_size, (1, P_gen), generator=torch.Generator().manual_seed(3))
model.set_attn_implementation("tileattn")
generated, seconds = {}, {}
for use_cache in (True, False):
    with torch.no_grad():
        t0 = time.perf_counter()
        generated[use_cache] = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=N_gen,
                                              do_sample=False, pad_token_id=0, use_cache=use_cache)
        seconds[use_cache] = time.perf_counter() - t0
print(f"generate {N_gen} tokens after {P_gen}: {seconds[True]:.2f} s with the cache, {seconds[False]:.2f} s "
      f"without ({seconds[False] / seconds[True]:.1f}x; the FLOPs say {no_cache / with_cache:.0f}x); with the cache "
      f"{seconds[True] / N_gen * 1e3:.1f} ms per token for {with_cache / N_gen / 1e6:.0f} MFLOP")
check(torch.equal(generated[True], generated[False]), "with or without the cache, greedy decoding gives the same tokens")

# %% [markdown]
# The price is memory. Per token the cache holds `2 x layers x Hkv x D` numbers: for this toy
# model in fp32 that is `2 x 4 x 2 x 32 x 4` bytes; for Llama-3-8B (32 layers, 8 kv heads, `D = 128`,
# bf16) it is 128 KiB per token, 1 GiB for one 8k-token sequence. The model's weights (8.03 B
# parameters, 16 GB in bf16) are shared by every sequence of a batch; the cache is not: at a batch
# of 32 sequences of 8k tokens the cache is more than twice the weights.

# %%
def cache_bytes_per_token(layers, kv_heads, head_dim, element_bytes):
    return 2 * layers * kv_heads * head_dim * element_bytes


toy_per_token = cache_bytes_per_token(LAYERS, HKV, HEAD_DIM, 4)
held = sum(t.keys.numel() + t.values.numel() for t in short.layers) // short.get_seq_length()
check(toy_per_token == 2048 == 4 * held,
      f"the toy model's cache: {toy_per_token} bytes per token in fp32, as its DynamicCache holds")
llama3 = cache_bytes_per_token(32, 8, 128, 2)
check(llama3 == 128 * 2**10 and llama3 * 8192 == GiB, "Llama-3-8B: 128 KiB per token, 1 GiB per 8k-token sequence")
check(32 * 8192 * llama3 > 2 * (8.03e9 * 2), "32 sequences of 8k tokens: the cache (32 GiB) is more than twice the "
      "bf16 weights (16 GB)")

# %% [markdown]
# ## 2. Decode is bandwidth-bound
#
# One decode step of one sequence, `Hq` query heads over `Hkv` kv heads (`G = Hq / Hkv`), a cache
# of `S` keys, head dim `D`, `e` bytes per element:
#
# ```
# FLOPs  = 4 Hq S D                      (q.k and p.v, 2 D each, per key and query head)
# bytes  = 2 Hkv S D e                   (K and V, each read once per kv head)
# FLOPs / byte = 2 G / e                 = G / 2 in fp32, G in bf16
# ```
#
# independent of `S`: every key read is used by `G` queries only, where a prefill tile of the native
# engine reuses it for 128 query rows. A machine is bandwidth-bound on work whose intensity is below
# its **balance**, peak FLOP/s over bytes/s. We measure both on one core: the streaming bandwidth
# by summing a buffer several times larger than the last-level cache (so it comes from memory; under
# `TILEATTN_SMALL=1` the buffer is 256 MiB, which a large cache may hold), and the arithmetic peak by
# a 1024 x 1024 fp32 matrix product.

# %%
LLC = measure.cache_size(3) or 32 * 2**20
buffer_bytes = pick(256 * 2**20, int(min(max(4 * LLC, GiB), 2 * GiB)))
stream = torch.ones(buffer_bytes // 4)
n_mm = 1024
a_mm, b_mm = seeded(n_mm, n_mm, seed=4), seeded(n_mm, n_mm, seed=5)
rates = cpu_seconds({"stream": stream.sum, "matmul": lambda: a_mm @ b_mm}, reps=pick(5, 9))
bandwidth = buffer_bytes / rates["stream"]
peak = 2 * n_mm**3 / rates["matmul"]
balance = peak / bandwidth
print(f"last-level cache {LLC / MiB:.0f} MiB; summing {buffer_bytes / MiB:.0f} MiB: {bandwidth / GB:.1f} GB/s; "
      f"fp32 matmul {peak / 1e9:.0f} GFLOP/s; balance {balance:.0f} FLOP/byte")
G_llama = 4
check(balance > G_llama / 2, f"a decode step of Llama-3's shape (G = 4, fp32: {G_llama / 2:.0f} FLOP/byte) sits "
      f"{balance / (G_llama / 2):.0f}x below this core's balance: it is bandwidth-bound")

# %% [markdown]
# So a decode call over a cache that lives in memory should take about `bytes / bandwidth`, and no
# less. We time tileattn's decode (the
# native engine's split-KV kernel, `docs/native.md`) for Llama-3-8B's attention shape, 32 query heads
# over 8 kv heads, `D = 128`, fp32, one sequence, for growing caches, and compare the rate it reads
# K/V at with the streaming bandwidth. While the cache fits in the caches of the chip it can be read
# faster than memory streams; beyond, the bound holds.

# %%
B2, HQ2, HKV2, D2 = 1, 32, 8, 128
lengths = pick([256, 1024, 4096], [1024, 4096, 16384, 65536, 131072])
decode_rows = []
q_dec = seeded(B2, HQ2, 1, D2, seed=6)
for S in lengths:
    k_dec, v_dec = seeded(B2, HKV2, S, D2, seed=7), seeded(B2, HKV2, S, D2, seed=8)
    kv_bytes = 2 * B2 * HKV2 * S * D2 * 4
    flops = 4 * B2 * HQ2 * S * D2
    check(flops / kv_bytes == HQ2 / HKV2 / 2, f"S={S}: {flops / 1e6:.1f} MFLOP over {kv_bytes / MiB:.1f} MiB of K/V = "
          f"{HQ2 / HKV2 / 2:.0f} FLOP/byte")
    iters = max(1, int(2**24 // kv_bytes))
    t = cpu_seconds({"decode": lambda: tileattn.flash_attention(q_dec, k_dec, v_dec)}, reps=pick(5, 7),
                    iters=iters)["decode"]
    decode_rows.append(dict(S=S, bytes=kv_bytes, t=t, rate=kv_bytes / t, gflops=flops / t / 1e9))
    del k_dec, v_dec

k_chk, v_chk = seeded(B2, HKV2, lengths[0], D2, seed=7), seeded(B2, HKV2, lengths[0], D2, seed=8)
check(rule("decode", tileattn.flash_attention(q_dec, k_chk, v_chk),
           tileattn.reference(q_dec, k_chk, v_chk, compute_dtype=F64), tileattn.reference(q_dec, k_chk, v_chk)),
      "the timed decode call passes the 2x rule against the fp64 reference")
print(f"\n{'S':>7} {'K/V MiB':>8} {'ms':>8} {'bound ms':>9} {'GB/s':>6} {'% stream':>9} {'GFLOP/s':>8}")
for r in decode_rows:
    print(f"{r['S']:>7} {r['bytes'] / MiB:>8.1f} {r['t'] * 1e3:>8.3f} {r['bytes'] / bandwidth * 1e3:>9.3f} "
          f"{r['rate'] / GB:>6.1f} {r['rate'] / bandwidth:>9.0%} {r['gflops']:>8.1f}")
growth = decode_rows[-1]["t"] / decode_rows[0]["t"]
check(growth > lengths[-1] / lengths[0] / 4, f"{lengths[-1] // lengths[0]}x the cache takes {growth:.0f}x the time: "
      "a decode call's time follows the bytes it reads")
fastest = max(r["gflops"] for r in decode_rows)
check(fastest * 1e9 < peak, f"no decode call reached the matmul rate (at best {fastest:.0f} of {peak / 1e9:.0f} "
      f"GFLOP/s, {fastest * 1e9 / peak:.0%}): the arithmetic units mostly wait")

# %% [markdown]
# ## 3. Grouped-query attention: K/V read once per kv head
#
# With GQA, query heads `h` of a group all read kv head `h // G`. Hugging Face's eager attention
# implements it by `repeat_kv`: copy each kv head `G` times, then run ordinary multi-head attention.
# The copy writes `G` times the cache's bytes and the attention then reads them all, so the bytes of
# a step grow with `G`, while the FLOPs were going to grow with `G` anyway. tileattn's kernels stack
# the `G` query heads of a group as rows of one task, which brings each chunk of K/V from memory once
# and uses it for all `G` rows while it sits in the core's cache (`docs/native.md`): at fixed `Hkv`
# and `S`, the bytes read from memory are the same for every `G`, and, decode being bandwidth-bound,
# nearly the time too. We time, at `Hkv = 8`, `D = 128`, fp32: tileattn; PyTorch's SDPA given `enable_gqa=True`; and
# `repeat_kv` followed by SDPA, and measure the peak memory of each call.

# %%
S3 = pick(2048, 16384)
k3, v3 = seeded(1, HKV2, S3, D2, seed=9), seeded(1, HKV2, S3, D2, seed=10)
kv3 = 2 * k3.numel() * 4
groups = [1, 2, 4, 8]
gqa = {}
for G in groups:
    q3 = seeded(1, HKV2 * G, 1, D2, seed=11)
    fns = {"tileattn": lambda: tileattn.flash_attention(q3, k3, v3),
           "sdpa enable_gqa": lambda: F.scaled_dot_product_attention(q3, k3, v3, enable_gqa=True),
           "repeat_kv + sdpa": lambda: F.scaled_dot_product_attention(q3, k3.repeat_interleave(G, 1),
                                                                      v3.repeat_interleave(G, 1))}
    gqa[G] = cpu_seconds(fns, reps=pick(3, 7))
    if G == groups[-1]:
        oracle3 = tileattn.reference(q3, k3, v3, compute_dtype=F64)
        plain3 = tileattn.reference(q3, k3, v3)
        check(all([rule(name, fn(), oracle3, plain3) for name, fn in fns.items()]),
              f"G={G}: all three pass the 2x rule")
        peaks = {name: peak_memory(fn)[1] for name, fn in fns.items()}
print(f"Hkv=8, S={S3}, D=128, fp32; K/V {kv3 / MiB:.0f} MiB; CPU ms per call")
print(f"{'G':>3} {'Hq':>4} " + " ".join(f"{name:>17}" for name in gqa[1]))
for G, row in gqa.items():
    print(f"{G:>3} {HKV2 * G:>4} " + " ".join(f"{t * 1e3:>17.2f}" for t in row.values()))
print("peak extra memory at G=8: " + ", ".join(f"{name} {b / MiB:.1f} MiB" for name, b in peaks.items()))
check(peaks["repeat_kv + sdpa"] > 0.9 * groups[-1] * kv3 > 100 * max(peaks["tileattn"], 1),
      f"repeat_kv materialises G x the K/V bytes ({peaks['repeat_kv + sdpa'] / MiB:.0f} MiB at G=8); tileattn's "
      f"peak is {peaks['tileattn'] / MiB:.2f} MiB")
# How close to flat tileattn stays depends on the build and the CPU (the generic build of the native
# engine, `TILEATTN_NATIVE_ISA=generic`, computes slowly enough that the FLOPs show: 3.4x here); well
# under the FLOPs' 8x, and well under repeat_kv's growth, which copies G x the bytes, holds on all.
flat = gqa[groups[-1]]["tileattn"] / gqa[1]["tileattn"]
copied = gqa[groups[-1]]["repeat_kv + sdpa"] / gqa[1]["repeat_kv + sdpa"]
check(flat < 0.75 * groups[-1] and copied > 2 * flat,
      f"8x the query heads (8x the FLOPs, the same K/V bytes) cost tileattn {flat:.1f}x the time (< 6x), "
      f"repeat_kv + sdpa {copied:.1f}x (more than twice that: it copies G x the K/V)")

# %% [markdown]
# ## 4. Ragged batches and a paged cache
#
# A serving batch holds sequences of different lengths. A contiguous cache `(B, Hkv, L, D)` reserves
# `L` slots per sequence; sequence `b` uses its first `n_b` and the rest is stale: `seqused_k`
# (flash-attn's `cache_seqlens`) tells the kernel where each sequence ends. To show that nothing
# past the end is read, we fill the stale slots with NaN: a single one read would poison its row.
#
# Reserving `L` slots for every sequence wastes memory when lengths differ. vLLM's **paged** cache
# (also flash-attn's `block_table` layout) cuts every sequence into blocks of `bs` tokens stored
# anywhere in one pool `(num_blocks, bs, Hkv, D)`; row `b` of the block table lists the pool blocks
# of sequence `b` in order, so key `j` of sequence `b` is slot `j % bs` of block
# `block_table[b, j // bs]`. Memory is allocated a block at a time, the waste is under one block
# per sequence, and sequences can share blocks (a common prompt). We build a pool by hand, scatter
# the blocks in a random order, and check the result **bit for bit** against the contiguous one:
# the kernel only addresses rows differently, the arithmetic is the same.

# %%
B4, L4, bs = 6, pick(200, 1000), 16
lens4 = torch.tensor([L4, 3, L4 // 2, 17, L4 - 5, 64], dtype=torch.int32)
q4 = seeded(B4, HQ, 1, HEAD_DIM, seed=12)
k4, v4 = seeded(B4, HKV, L4, HEAD_DIM, seed=13), seeded(B4, HKV, L4, HEAD_DIM, seed=14)
for b, n in enumerate(lens4.tolist()):
    k4[b, :, n:], v4[b, :, n:] = math.nan, math.nan  # stale slots: never to be read
ragged = tileattn.flash_attention(q4, k4, v4, seqused_k=lens4)
oracle4 = tileattn.reference(q4, k4, v4, seqused_k=lens4, compute_dtype=F64)
check(bool(torch.isfinite(ragged).all()) and rule("ragged", ragged, oracle4,
                                                  tileattn.reference(q4, k4, v4, seqused_k=lens4)),
      "with NaN in every stale slot the ragged decode is finite and passes the 2x rule: nothing past n_b is read")

blocks_per_seq = [-(-n // bs) for n in lens4.tolist()]
num_blocks = sum(blocks_per_seq) + 4  # a few free blocks in the pool
order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(15)).tolist()
pool_k = torch.full((num_blocks, bs, HKV, HEAD_DIM), math.nan)
pool_v = torch.full_like(pool_k, math.nan)
table = torch.zeros(B4, max(blocks_per_seq), dtype=torch.int32)
for b, n in enumerate(lens4.tolist()):
    for j in range(blocks_per_seq[b]):
        block = order.pop()
        table[b, j] = block
        rows = slice(j * bs, min((j + 1) * bs, n))  # the last block of a sequence is partly filled
        pool_k[block, :rows.stop - rows.start] = k4[b, :, rows].transpose(0, 1)
        pool_v[block, :rows.stop - rows.start] = v4[b, :, rows].transpose(0, 1)
print(f"block table, first 8 columns (a pool of {num_blocks} blocks of {bs} tokens):\n{table[:, :8]}")
paged = tileattn.flash_attention(q4, pool_k, pool_v, block_table=table, seqused_k=lens4)
check(torch.equal(paged, ragged), "the paged cache, blocks shuffled over the pool, gives the contiguous result bit for bit")
check(rule("paged", paged, tileattn.reference(q4, pool_k, pool_v, block_table=table, seqused_k=lens4,
                                              compute_dtype=F64), tileattn.reference(q4, k4, v4, seqused_k=lens4))
      and torch.allclose(tileattn.reference(q4, pool_k, pool_v, block_table=table, seqused_k=lens4, compute_dtype=F64),
                         oracle4, rtol=0, atol=1e-14),
      "the reference reads the paged cache as the same sequences")
fa_paged = flash_attn_with_kvcache(q4.transpose(1, 2), pool_k, pool_v, cache_seqlens=lens4, block_table=table)
check(torch.equal(fa_paged.transpose(1, 2), ragged),
      "flash_attn_with_kvcache(cache_seqlens=, block_table=) is the same call: same bits")
contiguous_slots, paged_slots = B4 * L4, sum(blocks_per_seq) * bs
check(paged_slots - int(lens4.sum()) < B4 * bs,
      f"slots held: contiguous {contiguous_slots}, paged {paged_slots} for {int(lens4.sum())} tokens "
      f"({paged_slots / contiguous_slots:.0%}); paged wastes under one block per sequence")

# %% [markdown]
# ## 5. Split-KV: flash-decoding
#
# A decode kernel gives each (sequence, kv head) row to a worker. A batch of 1 with 8 kv heads has 8
# rows: 8 of an H100's 132 SMs, or 8 threads of a CPU socket. The rest of the machine idles, and on a
# GPU no single SM can pull more than a fraction of the memory bandwidth. **Split-KV** cuts the keys
# of each row into chunks, gives every (row, chunk) to a worker, and merges the chunks at the end.
#
# The merge follows from the LSE (tutorial 11). For a chunk `c` of keys, write
# `Z_c = sum_{j in c} exp(s_j)`, `L_c = log Z_c` and `o_c = sum_{j in c} exp(s_j) v_j / Z_c`. The
# whole row is
#
# ```
# o = sum_j exp(s_j) v_j / sum_j exp(s_j) = sum_c Z_c o_c / sum_c Z_c = sum_c exp(L_c - L) o_c,
# L = log sum_c exp(L_c)
# ```
#
# computed stably by subtracting `max_c L_c` before the `exp`. We write that merge by hand over
# chunks from `tileattn.attention_partial`, and check it against `tileattn.merge_attentions` and the
# reference.

# %%
S5 = pick(4096, 65536)
k5, v5 = seeded(1, 1, S5, D2, seed=16), seeded(1, 1, S5, D2, seed=17)
q5 = seeded(1, 8, 1, D2, seed=18)  # one sequence, one kv head (multi-query): a single row
oracle5, oracle5_lse = tileattn.reference(q5, k5, v5, compute_dtype=F64, return_lse=True)
plain5 = tileattn.reference(q5, k5, v5)


def chunks(n_chunks):
    size = -(-S5 // n_chunks)
    return [tileattn.attention_partial(q5, k5[:, :, a:a + size], v5[:, :, a:a + size]) for a in range(0, S5, size)]


def merge_by_hand(parts):
    lse = torch.stack([l for _, l in parts])  # (chunks, B, H, 1)
    top = lse.amax(0)
    total_lse = top + torch.log(torch.exp(lse - top).sum(0))
    return sum(torch.exp(l - total_lse)[..., None] * o for o, l in parts), total_lse


parts = chunks(8)
by_hand, by_hand_lse = merge_by_hand(parts)
merged, merged_lse = tileattn.merge_attentions([o for o, _ in parts], [l for _, l in parts])
check(torch.allclose(by_hand, merged, rtol=0, atol=1e-6) and torch.allclose(by_hand_lse, merged_lse, atol=1e-5),
      "the hand-written merge is merge_attentions")
check(rule("8 chunks merged", by_hand, oracle5, plain5) and rule("lse", by_hand_lse, oracle5_lse,
                                                                 tileattn.reference(q5, k5, v5, return_lse=True)[1]),
      f"{S5} keys in 8 chunks, merged by their LSE: output and LSE pass the 2x rule")
gpu_sms, rows = 132, 1 * 8
check(rows / gpu_sms < 0.07, f"batch 1 x 8 kv heads = {rows} rows: {rows / gpu_sms:.0%} of an H100's {gpu_sms} SMs "
      f"without a split; {math.ceil(gpu_sms / rows)} chunks per row fill them")

# %% [markdown]
# On this machine: the row above alone, on one thread, against the same row split in two halves
# computed by two threads (each `attention_partial` runs its engine on one thread; the native
# engine releases Python's lock while it computes) and merged. Since the step is bandwidth-bound, a
# split gains at most what a second core adds to the bandwidth, so we measure that too, summing the
# buffer of section 2 on two threads. These are wall-clock times, medians of interleaved rounds
# (`tileattn.tools.measure`): on a shared machine another job can take either core.

# %%
pool = ThreadPoolExecutor(max_workers=2)


def split_in_two_threads():
    half = S5 // 2
    futures = [pool.submit(tileattn.attention_partial, q5, k5[:, :, a:a + half], v5[:, :, a:a + half])
               for a in (0, half)]
    halves = [f.result() for f in futures]
    return tileattn.merge_attentions([o for o, _ in halves], [l for _, l in halves])[0]


def stream_two_threads():
    torch.set_num_threads(2)
    stream.sum()
    torch.set_num_threads(1)


check(rule("two threads", split_in_two_threads(), oracle5, plain5), "the two-thread split passes the 2x rule")
walls = measure.median_times({"one thread": lambda: tileattn.flash_attention(q5, k5, v5),
                              "split over two threads": split_in_two_threads,
                              "stream, 1 thread": stream.sum, "stream, 2 threads": stream_two_threads},
                             pick(5, 9), 1)
pool.shutdown()
row_bytes = 2 * k5.numel() * 4
split_speedup = walls["one thread"] / walls["split over two threads"]
stream_gain = walls["stream, 1 thread"] / walls["stream, 2 threads"]
print(f"one row, {S5} keys ({row_bytes / MiB:.0f} MiB of K/V), wall ms: one thread {walls['one thread'] * 1e3:.2f}, "
      f"split over two threads {walls['split over two threads'] * 1e3:.2f} ({split_speedup:.2f}x); streaming "
      f"{buffer_bytes / MiB:.0f} MiB: {buffer_bytes / walls['stream, 1 thread'] / GB:.1f} GB/s on one thread, "
      f"{buffer_bytes / walls['stream, 2 threads'] / GB:.1f} GB/s on two ({stream_gain:.2f}x)")

# %% [markdown]
# tileattn's native decode kernel splits by itself (`docs/native.md`, "Decode"): it cuts each row's
# keys into chunks of 512 keys (longer chunks, up to 4096 keys, for caches past 8k keys, so that
# the partial results stay few) and runs the (sequence, kv head, chunk) tasks on its threads,
# merging each row's chunks in chunk order.
#
# ## 6. Batch invariance
#
# A serving system batches whatever requests are in flight. If the result of a request depended on
# the others in its batch, the same prompt would generate different text depending on the traffic:
# not reproducible, and not testable. tileattn promises that a row's bits do not depend on the batch
# around it or on the number of threads. Checked: one sequence alone and inside the ragged batch of
# section 4; the batch on one thread and on two.

# %%
for b in (0, 3):
    alone = tileattn.flash_attention(q4[b:b + 1], k4[b:b + 1], v4[b:b + 1], seqused_k=lens4[b:b + 1])
    check(torch.equal(alone, ragged[b:b + 1]), f"sequence {b} ({int(lens4[b])} keys) alone = inside the batch of "
          f"{B4}, bit for bit")
one_thread = tileattn.flash_attention(q5, k5, v5)
torch.set_num_threads(2)
two_threads = [tileattn.flash_attention(q4, pool_k, pool_v, block_table=table, seqused_k=lens4),
               tileattn.flash_attention(q5, k5, v5)]
torch.set_num_threads(1)
check(torch.equal(two_threads[0], paged) and torch.equal(two_threads[1], one_thread),
      f"on two threads = on one thread, bit for bit: the paged batch, and section 5's row of {S5} keys (its chunks "
      "run on both threads)")

# %% [markdown]
# Where would that break? Floating-point addition is not associative, so **the chunking of a row
# decides its bits**: a row split in 2 chunks and in 3 gives two results that are both correct to
# fp32 rounding, and different. flash-attn's GPU kernel picks its number of splits with a heuristic
# over the batch, the heads and the number of SMs, to fill the machine: exactly the quantities that
# change with the traffic. Below, a picker of that kind (enough chunks to give every one of 64
# workers a task) decides the chunks of one row as a batch of 1 and as a batch of 16: the row's bits
# change with the batch. tileattn's chunk length depends on the row's own key count only, so the
# bits cannot change; and `flash_attn_with_kvcache` validates its `num_splits` hint and ignores it.

# %%
two, three = merge_by_hand(chunks(2))[0], merge_by_hand(chunks(3))[0]
check(not torch.equal(two, three) and rule("2 chunks", two, oracle5, plain5) and rule("3 chunks", three, oracle5,
                                                                                        plain5),
      f"2 chunks and 3 chunks: both pass the 2x rule, and differ by up to {float((two - three).abs().max()):.1e}")


def load_based_splits(batch, kv_heads, workers=64):
    """Chunks per row that give every worker a task: what a fill-the-machine heuristic does."""
    return max(1, min(16, workers // (batch * kv_heads)))


as_single, in_batch = (merge_by_hand(chunks(load_based_splits(batch, 1)))[0] for batch in (1, 16))
check(load_based_splits(1, 1) != load_based_splits(16, 1) and not torch.equal(as_single, in_batch),
      f"a load-based split gives this row {load_based_splits(1, 1)} chunks alone and {load_based_splits(16, 1)} in a "
      "batch of 16: different bits")
hints = [flash_attn_with_kvcache(q5.transpose(1, 2), k5.transpose(1, 2), v5.transpose(1, 2), num_splits=n)
         for n in (0, 1, 7)]
check(all(torch.equal(h, hints[0]) for h in hints), "flash_attn_with_kvcache(num_splits=0, 1, 7): identical bits")

# %% [markdown]
# ## 7. A generate loop
#
# Everything together. First the toy Llama of section 1, greedy `generate` with eager attention and
# with tileattn: transformers keeps its own cache (`DynamicCache`), and every step calls the
# attention function with one query against it.

# %%
prompt7 = torch.randint(0, config.vocab_size, (2, pick(16, 64)), generator=torch.Generator().manual_seed(19))
N7 = pick(8, 32)
tokens = {}
for impl in ("eager", "tileattn"):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        tokens[impl] = model.generate(prompt7, attention_mask=torch.ones_like(prompt7), max_new_tokens=N7,
                                      do_sample=False, pad_token_id=0)
check(torch.equal(tokens["tileattn"], tokens["eager"]), f"greedy generation of {N7} tokens: tileattn = eager")

# %% [markdown]
# Now the same loop written by hand on the model's own weights, the way a serving engine drives
# flash-attn: per layer one preallocated cache `(B, capacity, Hkv, D)`, and one
# `flash_attn_with_kvcache` call per layer and step that
#
# * applies the rotary embedding to the new `q` and `k` (Llama's rotate-half form,
#   `rotary_interleaved=False`; the cos/sin tables are the model's own, `rotary_emb`),
# * writes the new keys and values **into the cache, in place**, at `cache_seqlens[b]`,
# * and attends, causally, to the first `cache_seqlens[b] + new` keys of sequence `b`.
#
# The prompt goes through the same call (`new` = the prompt's length, `cache_seqlens = 0`): prefill
# and decode are one function. The loop must produce the tokens `generate` produced, and its cache
# must hold what transformers' `DynamicCache` holds.

# %%
def generate_by_hand(model, prompt, new_tokens):
    inner, batch = model.model, prompt.shape[0]
    capacity = prompt.shape[1] + new_tokens
    caches = [(torch.zeros(batch, capacity, HKV, HEAD_DIM), torch.zeros(batch, capacity, HKV, HEAD_DIM))
              for _ in inner.layers]
    cos, sin = inner.rotary_emb(torch.zeros(1), torch.arange(capacity)[None])
    cos, sin = cos[0, :, :HEAD_DIM // 2], sin[0, :, :HEAD_DIM // 2]  # (capacity, rotary_dim / 2)
    seqlens = torch.zeros(batch, dtype=torch.int32)
    ids, out = prompt, [prompt]
    for _ in range(new_tokens):
        h = inner.embed_tokens(ids)
        for layer, (k_cache, v_cache) in zip(inner.layers, caches):
            a, x = layer.self_attn, layer.input_layernorm(h)
            q, k, v = (p(x).unflatten(-1, (-1, HEAD_DIM)) for p in (a.q_proj, a.k_proj, a.v_proj))
            o = flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, rotary_cos=cos, rotary_sin=sin,
                                        cache_seqlens=seqlens, causal=True, rotary_interleaved=False)
            h = h + a.o_proj(o.flatten(2))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        seqlens += ids.shape[1]
        ids = model.lm_head(inner.norm(h[:, -1:])).argmax(-1)
        out.append(ids)
    return torch.cat(out, dim=1), caches


with torch.no_grad():
    by_hand_tokens, hand_caches = generate_by_hand(model, prompt7, N7)
    model.set_attn_implementation("eager")
    hf_cache = model(tokens["eager"][:, :-1], use_cache=True).past_key_values
check(torch.equal(by_hand_tokens, tokens["eager"]), f"the hand-written loop generates the same {N7} tokens as generate")
cache_gap = max(float((kc[:, :-1].transpose(1, 2) - layer.keys).abs().max()) + float(
    (vc[:, :-1].transpose(1, 2) - layer.values).abs().max()) for (kc, vc), layer in zip(hand_caches, hf_cache.layers))
check(cache_gap < 1e-4, f"the caches written in place hold transformers' rotated keys and values (max difference "
      f"{cache_gap:.1e})")

# %% [markdown]
# The last of the hand loop's decode steps is exactly section 2's situation: one query per head
# against the cache, bandwidth-bound. A serving engine's step time is therefore close to
# `(weights + sum over the batch of each sequence's cache) / bandwidth`: the weights are read once
# for the whole batch, which is why batching many sequences pays, until their caches dominate (the
# Llama-3-8B arithmetic of section 1).

# %%
fig, (ax_t, ax_bw, ax_g) = figure(1, 3, figsize=(15, 4.2))
xs = [r["S"] for r in decode_rows]
ticks = [f"{S // 1024}k" if S >= 1024 else str(S) for S in xs]
ax_t.plot(xs, [r["t"] * 1e3 for r in decode_rows], "o-", label="tileattn decode, measured")
ax_t.plot(xs, [r["bytes"] / bandwidth * 1e3 for r in decode_rows], "k--", label="K/V bytes / streaming bandwidth")
ax_t.set(xscale="log", yscale="log", xlabel="cache length S (keys)", ylabel="ms per decode call",
         title="Hq=32, Hkv=8, D=128, fp32, one thread")
ax_t.yaxis.set_major_formatter(FormatStrFormatter("%g"))
ax_t.legend()
ax_bw.plot(xs, [r["rate"] / GB for r in decode_rows], "o-", label="K/V read rate of the decode call")
ax_bw.axhline(bandwidth / GB, color="k", ls="--", label=f"streaming {buffer_bytes / MiB:.0f} MiB: "
              f"{bandwidth / GB:.1f} GB/s")
ax_bw.axvline(LLC / (2 * HKV2 * D2 * 4), color="gray", ls=":", label="K/V = last-level cache")
ax_bw.set(xscale="log", ylim=(0, None), xlabel="cache length S (keys)", ylabel="GB/s",
          title="the rate a decode call reads K/V at")
for ax in (ax_t, ax_bw):
    ax.set_xticks(xs, ticks)
    ax.minorticks_off()
ax_bw.legend(fontsize=8)
for name, marker in zip(gqa[1], "o^s"):
    ax_g.plot(groups, [gqa[G][name] * 1e3 for G in groups], marker + "-", label=name)
ax_g.set(xscale="log", yscale="log", xlabel="query heads per kv head G (Hkv = 8)", ylabel="ms per decode call",
         title=f"GQA, S={S3}, one thread")
ax_g.set_xticks(groups, [str(g) for g in groups])
ax_g.minorticks_off()
ax_g.yaxis.set_major_formatter(FormatStrFormatter("%g"))
ax_g.legend()
save_figure(fig, "10_decoding.png")

# %% [markdown]
# ![decode time and K/V read rate against the cache length; time against G](../../docs/hub/10_decoding.png)
#
# Measured at full size on this machine (`docs/hub/logs/10.txt`; 2 cores of a Xeon with a 480 MiB
# last-level cache, shared with other jobs: load average 5-7 during the run; CPU time of one
# thread). Summing 1920 MiB streamed at 9.4 GB/s and an fp32 matrix product ran at 159 GFLOP/s: a
# balance of 17 FLOP/byte, 8x the decode step's 2. The decode calls, Hq=32, Hkv=8, D=128, fp32,
# against `bytes / 9.4 GB/s`:
#
# | S | K/V MiB | ms | bound ms | GB/s | % of streaming | GFLOP/s |
# |---:|---:|---:|---:|---:|---:|---:|
# | 1024 | 8 | 0.63 | 0.90 | 13.2 | 141% | 26.5 |
# | 4096 | 32 | 2.29 | 3.58 | 14.7 | 156% | 29.3 |
# | 16384 | 128 | 15.5 | 14.3 | 8.7 | 93% | 17.3 |
# | 65536 | 512 | 63.6 | 57.3 | 8.4 | 90% | 16.9 |
# | 131072 | 1024 | 163.0 | 114.6 | 6.6 | 70% | 13.2 |
#
# The two smallest caches are read from the chip's caches, faster than memory streams (so 128x the
# cache took 257x the time); from 16k keys on, the call reads K/V at 70-93% of the streaming rate,
# and the arithmetic units run at about a tenth of the matrix product's rate (18% at best). The
# machine's load moves these figures: four full-size runs on the same day read the 128k-key cache at
# 63%, 69%, 77% and 70% of the streaming rate, and the 4096-key one at 50% to 156%.
#
# GQA at `S = 16384` (CPU ms per call):
#
# | G | Hq | tileattn | SDPA `enable_gqa` | `repeat_kv` + SDPA |
# |---:|---:|---:|---:|---:|
# | 1 | 8 | 12.7 | 10.6 | 65.6 |
# | 2 | 16 | 15.3 | 20.6 | 134.7 |
# | 4 | 32 | 19.1 | 33.6 | 273.1 |
# | 8 | 64 | 20.2 | 52.0 | 520.8 |
#
# 8x the query heads cost tileattn 1.6x the time: the same 128 MiB of K/V, read once per kv head.
# `repeat_kv` costs 7.9x and a 1024 MiB copy at G=8. PyTorch's SDPA with `enable_gqa=True`
# allocates nothing (its peak was 0.0 MiB), but its time grows 4.9x from G=1 to G=8.
#
# The rest of the log: the cache cut `generate`'s FLOPs 53x (64 tokens after 128) but its time only
# 3.1x, because a cached step of this toy model is 19 MFLOP, 0.12 ms at the matrix product's rate,
# and took 10.8 ms: Python and the framework around each step dominate a model this small (tutorial
# 08 measured the same). The paged cache held 44% of the contiguous cache's slots. The row of 65536
# keys split over two threads took 1.03x as long as on one (33.5 against 32.5 ms of wall clock), and
# streaming on two threads reached 0.90x the rate of one: on this loaded machine the second core
# added no bandwidth, so the split had nothing to gain. Split-KV pays where every worker adds
# bandwidth: a GPU's SMs, or a quiet socket of many cores.
#
# ## Exercises
#
# 1. Repeat section 2 in bf16 (`q_dec.bfloat16()`, and the caches). The bytes halve: does the time?
#    What is the intensity now, in FLOP/byte, and is the step still below the balance?
# 2. Sliding-window attention (Mistral, gpt-oss's odd layers) with `window=(w - 1, 0)`: a decode
#    step reads only the last `w` keys. Time section 2's sweep with `w = 4096` and explain the curve.
#    What could a cache for such a layer do with the keys that fell out of the window?
# 3. Speculative decoding checks `k` drafted tokens in one step: `Sq = k` queries against the cache,
#    `causal=True`. How does the intensity grow with `k`? Time `k = 1, 2, 4, 8` at `S = 32768` and
#    find where the step stops being bandwidth-bound.
# 4. Make the paged cache of section 4 share blocks: two sequences with the same 48-token prefix point
#    their first three table entries at the same pool blocks. Check both rows against the reference.
#    What does a sequence need to do before it writes into a shared, partly filled block?
# 5. Extend `generate_by_hand` to a ragged batch: two prompts of different lengths, `cache_seqlens`
#    different per sequence (prefill each prompt on its own, then decode both together). Check the
#    tokens against `generate` run on each prompt alone. Why does batch invariance make that
#    comparison exact?
# 6. The contest's decode track (`tileattn contest score --track decode`) scores exactly this step.
#    Start from `hub/contest/examples/decode_grouped.py`: how far is it from the bandwidth bound you
#    measured here?
# 7. On a quiet machine with more cores, repeat section 5's measurement with 1, 2, 4, ... threads
#    (`torch.set_num_threads`) for one row of 65536 keys, next to the streaming rate on as many
#    threads. Where does the decode call stop getting faster, and why there?
