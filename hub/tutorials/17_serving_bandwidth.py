# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 17 · Serving at memory bandwidth: a cache read as stored, in every format
#
# A decode step reads the whole KV cache once and does about one multiply-add per byte of a bf16
# cache: the step is as fast as the memory is. Two levers are left once the kernel streams:
# read the cache **as it is stored** (no dequantised copy, no concatenation: every extra pass over
# the cache costs a full pass of bandwidth), and store **fewer bytes** (int8 and fp8 half a bf16
# cache, int4 a quarter, plus their scales).
#
# This chapter:
#
# 1. stores one cache in five formats with `tileattn.serving.quantise` and counts the bytes of each,
#    scales included;
# 2. checks that the kernels reading each stored cache give the fp64 attention over the dequantised
#    cache (FlashAttention's 2x rule), and shows int4's layout, two values a byte;
# 3. measures each format's decode, the bytes read per second against the machine's streaming
#    bandwidth, with the cache hot (in the last-level cache) and streamed (copies larger than it);
# 4. puts a Hugging Face model on a `PagedCache` that the attention reads as stored, and counts what
#    a `DynamicCache` step copies instead.
#
# Measurements are printed and drawn, never checked: a claim checked here holds on every machine.

# %%
import torch

import tileattn
from tileattn.core.kvquant import dequantise, pack_int4, unpack_int4
from tileattn.core.testing import judge
from tileattn.serving import quantise
from tileattn.tools import measure
from _hub import check, figure, pick, save_figure

THREADS = measure.usable_cores()
torch.set_num_threads(THREADS)
print(f"CPU: {measure.cpu_model()}; torch {torch.__version__}, {THREADS} threads")
B, HQ, HKV, D = pick((1, 8, 2, 128), (4, 32, 8, 128))
gen = torch.Generator().manual_seed(0)
FORMATS = {"bf16": (None, None), "int8": (torch.int8, None), "fp8 e4m3": (torch.float8_e4m3fn, None),
           "fp8 e5m2": (torch.float8_e5m2, None), "int4 g32": ("int4", 32)}


def store(x, fmt, group):
    """(stored, scale) of keys or values (B, Hkv, S, D): bf16, or quantised per token (per group)."""
    if fmt is None:
        return x.bfloat16(), None
    stored, scale, _ = quantise(x, fmt, group_size=group)
    return stored, scale


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# %% [markdown]
# ## 1. Bytes per cached token
#
# Per token and kv head, a bf16 row of D = 128 is 256 bytes. int8 and fp8 store 128 bytes and one
# fp32 scale (132); int4 stores 64 bytes and, with Q4_0's blocks of 32 channels, 4 scales (80).

# %%
keys = 512
k, v = (torch.randn(B, HKV, keys, D, generator=gen) for _ in range(2))
sizes = {}
for name, (fmt, group) in FORMATS.items():
    (ks, kscale), (vs, vscale) = store(k, fmt, group), store(v, fmt, group)
    sizes[name] = nbytes(ks, kscale, vs, vscale) / (2 * B * HKV * keys)
    print(f"  {name:9s} {sizes[name]:6.1f} bytes per token and kv head")
check(sizes["bf16"] == 256 and sizes["int8"] == sizes["fp8 e4m3"] == 132 and sizes["int4 g32"] == 80,
      "bytes per token and kv head at D 128: bf16 256, int8/fp8 132 with the scale, int4 80 with 4 group scales")

# %% [markdown]
# ## 2. Read as stored, exact against the dequantised cache
#
# The kernels widen each stored value to fp32 in registers and apply its scale there; the oracle is
# the fp64 attention over the cache dequantised here, and the baseline of the 2x rule plain math
# in q's dtype (bf16) over that cache. int4's layout is ONNX Runtime's: byte c of a row holds
# channel 2c in its low nibble and 2c + 1 in its high nibble, two's complement.

# %%
packed = pack_int4(torch.tensor([[-8, 7, 0, -1]]))
print("  [-8, 7, 0, -1] packs to", [hex(b) for b in packed[0].tolist()])
check(packed[0].tolist() == [0x78, 0xF0] and unpack_int4(packed).tolist() == [[-8, 7, 0, -1]],
      "int4: channel 2c in the low nibble of byte c, 2c + 1 in the high one, two's complement")
q = torch.randn(B, HQ, 1, D, generator=gen).bfloat16()
for name, (fmt, group) in FORMATS.items():
    (ks, kscale), (vs, vscale) = store(k, fmt, group), store(v, fmt, group)
    out = tileattn.flash_attention(q, ks, vs, k_scale=kscale, v_scale=vscale)
    kd, vd = (dequantise(x, s, None, torch.float64) for x, s in ((ks, kscale), (vs, vscale)))
    verdict = judge("out", out, tileattn.reference(q.double(), kd, vd),
                    tileattn.reference(q, kd.bfloat16(), vd.bfloat16()), torch.bfloat16)
    check(verdict.ok, f"{name}: the stored cache read as stored is within 2x of bf16 math's error "
                      f"({verdict.error:.1e} <= {verdict.tolerance:.1e})")

# %% [markdown]
# ## 3. Bytes per second against the bandwidth
#
# Each format of one cache is decoded over and over; "streamed" reads another copy each call, the
# copies together larger than the last-level cache, as a server whose caches outgrow it. The figure
# is the bytes stored (K, V, scales) read per second, over the streaming read bandwidth that
# `tileattn.tools.measure.memory_bandwidth` measures (a sum over a buffer larger than the cache).

# %%
bandwidth = measure.memory_bandwidth(THREADS)
print(f"  streaming read bandwidth: {bandwidth:.1f} GB/s ({THREADS} threads)")
caches = pick([256, 1024], [1024, 4096, 16384])
llc = measure.cache_size(3) or 64 * 2**20
results = {}
for mode in ("hot", "streamed"):
    for keys in caches:
        k, v = (torch.randn(B, HKV, keys, D, generator=gen) for _ in range(2))
        calls, size = {}, {}
        for name, (fmt, group) in FORMATS.items():
            one = (*store(k, fmt, group), *store(v, fmt, group))
            size[name] = nbytes(*one)
            count = 1 if mode == "hot" else max(2, min(2 * llc, 2**31) // size[name] + 1)
            copies = [one] + [tuple(None if t is None else t.clone() for t in one) for _ in range(pick(1, count) - 1)]
            state = {"i": 0}

            def call(copies=copies, state=state):
                state["i"] = (state["i"] + 1) % len(copies)
                ks, kscale, vs, vscale = copies[state["i"]]
                tileattn.flash_attention(q, ks, vs, k_scale=kscale, v_scale=vscale)

            calls[name] = call
        seconds = measure.median_times(calls, pick(3, 9), 1)
        for name in FORMATS:
            results[mode, keys, name] = size[name] / seconds[name] / 1e9
            print(f"  {mode:8s} {keys:6d} keys  {name:9s} {seconds[name] * 1e3:8.2f} ms  "
                  f"{results[mode, keys, name]:6.2f} GB/s  {100 * results[mode, keys, name] / bandwidth:5.1f}% of "
                  f"the bandwidth  x{seconds['bf16'] / seconds[name]:.2f} own bf16")
fig, ax = figure(figsize=(7, 4.2))
for mode, style in (("hot", "--"), ("streamed", "-")):
    for i, name in enumerate(FORMATS):
        ax.plot(caches, [100 * results[mode, c, name] / bandwidth for c in caches], style, marker="o",
                color=f"C{i}", label=f"{name} ({mode})")
ax.set_xscale("log", base=2)
ax.set_xlabel("cached keys per sequence")
ax.set_ylabel("% of the streaming read bandwidth")
ax.set_title(f"decode, B {B}, {HQ}/{HKV} heads, D {D}: bytes stored / s")
ax.legend(fontsize=7, ncol=2)
save_figure(fig, "17_serving_bandwidth.png")

# %% [markdown]
# ## 4. A Hugging Face cache read as stored
#
# `DynamicCache.update` concatenates the new token to each layer's keys and values: every step
# copies the whole cache once more before attention reads it. `PagedCache` writes the token into
# its page and hands the attention the pool itself (`tileattn.integrations.transformers`); the
# attention reads it once. The copy is visible in the cache tensors' addresses: a `DynamicCache`'s
# change every step, a `PagedCache`'s never.

# %%
import copy  # noqa: E402

import transformers  # noqa: E402

import tileattn.integrations.transformers as tt  # noqa: E402

tt.register()
config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64)
torch.manual_seed(0)
sdpa = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval()
ours = transformers.LlamaForCausalLM(copy.deepcopy(config)).eval()
ours.load_state_dict(sdpa.state_dict())
sdpa.set_attn_implementation("sdpa")
ours.set_attn_implementation("tileattn")
ids = torch.randint(1, 256, (1, 16), generator=gen)
dynamic = transformers.DynamicCache(config=sdpa.config)
paged = tt.PagedCache(ours.config, max_batch_size=1, max_cache_len=64, dtype=torch.int8)
with torch.no_grad():
    sdpa(ids, cache=dynamic)
    ours(ids, cache=paged)
    before = (dynamic.layers[0].keys.data_ptr(), paged.layers[0].keys.data_ptr())
    a = sdpa(ids[:, :1], cache=dynamic).logits
    b = ours(ids[:, :1], cache=paged).logits
    after = (dynamic.layers[0].keys.data_ptr(), paged.layers[0].keys.data_ptr())
print(f"  int8 PagedCache: {paged.nbytes} bytes (pools and scales); step logits within "
      f"{float((a - b).norm() / a.norm()):.1e} of sdpa + DynamicCache")
check(before[0] != after[0], "a DynamicCache step reallocates the layer's keys (the cache is copied)")
check(before[1] == after[1], "a PagedCache step writes into its pool in place (nothing is copied)")

# %% [markdown]
# ## Exercises
#
# 1. Store the keys as int8 and the values as int4 (two calls of `quantise`): what do the bytes per
#    token become, and does the kernel take a cache whose K and V formats differ? Why not?
# 2. `quantise(x, "int4", group_size=32, symmetric=False)` adds an offset per group: how many bytes
#    per token, and how much of section 3's speed does the offset cost?
# 3. Time section 3 with one thread: which formats reach a larger fraction of one core's bandwidth,
#    and where does widening int4 (split nibbles, sign-extend, convert) become the limit?
# 4. Section 4 with `dtype="int4"`: compare the step's logits with sdpa's, and read
#    `docs/serving.md`'s quantisation-error table to say why they differ more than int8's.
