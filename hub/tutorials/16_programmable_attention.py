# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 16 · Programmable attention
#
# Tutorial 04 skipped the tiles a causal mask or a sliding window hides. Those masks are built in:
# a band has a formula for which tiles are empty. Research code wants masks nobody wrote a kernel
# for: packed documents, a prefix that sees both ways, sink tokens, 2-D neighbourhoods. PyTorch's
# FlexAttention lets you write them as two small functions,
#
# ```
# mask_mod(b, h, q_idx, kv_idx) -> bool          score_mod(score, b, h, q_idx, kv_idx) -> score
# ```
#
# and a **block mask** says which (query block, key block) tiles are hidden (never computed),
# visible (no mask to apply) or partial (the mask decides element by element). In tileattn the two
# functions are **kernel arguments**: each is traced once, translated to C and compiled with the
# machine's compiler, and the native kernel calls it inside its tiles, forward, backward and at
# decode. The block map is read by the tile loop itself. PyTorch's own CPU FlexAttention has no
# backward; `tileattn.flex_attention` is one `tileattn.flash_attention` call that has one. This
# chapter writes a mask, draws its block map, looks inside the kernel call, checks the result against
# the fp64 reference, trains a learned bias through a `score_mod`, decodes over a cache with one block
# mask, and measures.

# %%
import math

import torch
from torch.nn.attention import flex_attention as torch_flex

import tileattn
from tileattn.flex import create_block_mask, examples
from tileattn.flex.semantics import flex_reference
from tileattn.core.testing import judge
from tileattn.programs import compiler
from tileattn.programs.blocks import HIDDEN, PARTIAL, VISIBLE, states_of
from _hub import check, figure, interleaved_times, pick, save_figure, seeded

B, H, S, D = 1, 2, pick(320, 2048), 32
BLOCK = pick(32, 128)

# %% [markdown]
# ## A mask is a function
# Packed training puts several documents in one sequence; a token must attend only to the earlier
# tokens of its own document. With the document id of every position in a tensor, that is one line.
# `create_block_mask` evaluates it a row of blocks at a time (never the whole S x S at once) and
# classifies each block.

# %%
doc_ids = torch.arange(S) * 5 // S   # five documents of S/5 tokens
doc_ids[S // 2:] = torch.clamp(doc_ids[S // 2:] + (torch.arange(S - S // 2) % 7 == 0).long(), max=4)


def documents(ids):
    def packed_documents(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)
    return packed_documents


packed_documents = documents(doc_ids)
block_mask = create_block_mask(packed_documents, None, None, S, S, BLOCK_SIZE=BLOCK)
blocks = states_of(block_mask)
counts = blocks.counts()
print(f"  S {S}, blocks of {BLOCK}: {counts}")
dense = packed_documents(0, 0, torch.arange(S)[:, None], torch.arange(S)[None, :])
check(counts["hidden"] > counts["visible"] + counts["partial"], "most blocks of a packed causal mask are hidden")

# %% [markdown]
# ## The block map as a picture
# White blocks are never computed (the tile loop does not even load their keys), dark ones are
# computed without the mask, and only the grey ones call the compiled `mask_mod`, inside the tile,
# vectorised.

# %%
fig, ax = figure(1, 2, figsize=(9, 4))
ax[0].imshow(dense, cmap="Greys", interpolation="nearest")
ax[0].set_title("the mask (query rows x keys)")
states = blocks.states[0, 0].float()
picture = torch.where(states == HIDDEN, 0.0, torch.where(states == PARTIAL, 0.45, 1.0))
ax[1].imshow(picture, cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
ax[1].set_title("its block map: hidden / partial / visible")
save_figure(fig, "16_block_map.png")
block_of = (torch.arange(S) // BLOCK)
expected = dense.reshape(S // BLOCK, BLOCK, S // BLOCK, BLOCK).transpose(1, 2).flatten(2)
exact = torch.where(~expected.any(-1), HIDDEN, torch.where(expected.all(-1), VISIBLE, PARTIAL))
check(torch.equal(blocks.states[0, 0], exact.to(torch.uint8)), "each block's state is what its elements say")

# %% [markdown]
# ## Inside the call
# `explain` says which engine runs the call and how the functions run. The mask's captured tensor
# (`doc_ids`) is an *argument* of the compiled code, not part of it: another batch's document ids
# run the same program, and nothing is compiled again. The same holds for a float in a closure (a
# temperature): it is a run-time scalar.

# %%
q, k, v = (seeded(B, H, S, D, seed=i) for i in range(3))
alibi = examples.alibi(H)
how = tileattn.flex.explain(q, k, v, score_mod=alibi, block_mask=block_mask)
print("  ", how["path"], "| score_mod:", how["score_mod"], "| mask_mod:", how["mask_mod"])
check(how["path"].endswith("native engine") and how["score_mod"] == how["mask_mod"] == "compiled",
      "the native engine runs both functions compiled")
traces = compiler.STATS["traces"]
other_ids = torch.randint(0, 5, (S,)).sort().values
create_block_mask(documents(other_ids), None, None, S, S, BLOCK_SIZE=BLOCK)
check(compiler.STATS["traces"] == traces, "another tensor of the same shape runs the compiled program as it is")

# %% [markdown]
# ## Same answer, forward and backward
# FlashAttention's rule (tutorial 05): the error against an fp64 oracle may be at most twice that of
# plain PyTorch math in the same precision. The oracle here is `flex_reference`, which materialises
# the scores, applies `score_mod` and the mask exactly as PyTorch documents, and takes a safe softmax.
# A `score_mod` adds ALiBi on top of the mask; the score is modified first, then masked.

# %%
def run(fn, dtype, **extra):
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, score_mod=alibi, block_mask=block_mask, **extra)
    return [out, *torch.autograd.grad(out, leaves, seeded(*out.shape, seed=9).to(dtype))]


for dtype in (torch.float32, torch.bfloat16):
    got = run(tileattn.flex_attention, dtype)
    oracle = run(flex_reference, dtype, compute_dtype=torch.float64)
    plain = run(flex_reference, dtype)
    for name, a, o, p in zip(("out", "dq", "dk", "dv"), got, oracle, plain):
        verdict = judge(name, a, o, p, dtype)
        print(" ", str(dtype).replace("torch.", ""), verdict)
        check(verdict.ok, f"{name} ({dtype}) of tileattn.flex_attention is within 2x plain math of the fp64 oracle")

try:  # PyTorch's own CPU FlexAttention, for comparison: forward only (in torch 2.13)
    torch_flex.flex_attention(*(t.detach().clone().requires_grad_() for t in (q, k, v)), block_mask=block_mask).sum().backward()
    print("  this torch's CPU FlexAttention has a backward")
except NotImplementedError as exc:
    print(f"  PyTorch's CPU FlexAttention: {exc}")

# %% [markdown]
# ## Training a learned bias
# A `score_mod` may read tensors it captures: here a relative-position bias table `(H, 2S - 1)`,
# T5/Swin style. Its gradient is the sum of dL/dscore over every (query, key) pair at each relative
# distance; the kernel's backward runs the function's compiled derivative in its tiles and adds into
# one fp32 buffer per thread, summed once at the end. A few steps of Adam fit the table so that
# attention reproduces a target made with a hidden ALiBi slope per head, under the document mask.

# %%
target = flex_reference(q, k, v, score_mod=alibi, block_mask=block_mask).detach()
table = torch.zeros(H, 2 * S - 1, requires_grad=True)
learned = examples.relative_bias(table, S)
opt = torch.optim.Adam([table], lr=0.05)
losses = []
for step in range(pick(15, 40)):
    opt.zero_grad()
    loss = (tileattn.flex_attention(q, k, v, score_mod=learned, block_mask=block_mask) - target).pow(2).mean()
    loss.backward()
    opt.step()
    losses.append(float(loss.detach()))
print(f"  loss {losses[0]:.2e} -> {losses[-1]:.2e} in {len(losses)} steps")
check(losses[-1] < 0.5 * losses[0], "the learned bias table trains on CPU through the score_mod's gradient")
table64 = table.detach().double().requires_grad_()
exact = torch.autograd.grad(flex_reference(q.double(), k.double(), v.double(), block_mask=block_mask,
                                           score_mod=examples.relative_bias(table64, S)).sum(), table64)[0]
ours = torch.autograd.grad(tileattn.flex_attention(q, k, v, score_mod=learned, block_mask=block_mask).sum(), table)[0]
check(torch.allclose(ours.double(), exact, atol=1e-4 * max(1.0, float(exact.abs().max()))),
      "the table's gradient matches fp64 autograd through the reference")

# %% [markdown]
# ## Decoding with one block mask
# At decode, `flash_attention` takes the block mask built once for the whole cache: a query's
# `q_idx` is its position at the end of its sequence (bottom-right, as `causal=True` counts), so step
# `t` reads row `t // BLOCK` of the map in place. PyTorch's FlexAttention would need a new block
# mask (or a sliced, re-adjusted one) every step.

# %%
cache_k, cache_v = seeded(B, H, S, D, seed=11), seeded(B, H, S, D, seed=12)
worst = 0.0
for t in (S // 5, S // 2, S - 1):
    q1 = seeded(B, H, 1, D, seed=t)
    used = torch.tensor([t + 1], dtype=torch.int32)
    step = tileattn.flash_attention(q1, cache_k, cache_v, seqused_k=used, block_mask=block_mask)
    ref = tileattn.reference(q1.double(), cache_k.double(), cache_v.double(), seqused_k=used,
                             mask_mod=packed_documents)
    worst = max(worst, float((step.double() - ref).abs().max()))
print(f"  three decode steps against one block mask: largest error {worst:.1e}")
check(worst < 1e-5, "decode steps read the block mask built for the whole cache")

# %% [markdown]
# ## Code written for Flex, unchanged
# `tileattn.patch_flex()` routes `torch.nn.attention.flex_attention.flex_attention` on CPU tensors
# to tileattn (GPU tensors keep PyTorch's compiled kernels), so a training loop written for
# FlexAttention runs its backward on CPU. Hugging Face models with
# `attn_implementation="flex_attention"` go through it too.

# %%
with tileattn.patch_flex():
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch_flex.flex_attention(*leaves, score_mod=alibi, block_mask=block_mask).sum().backward()
check(all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves),
      "inside patch_flex(), PyTorch's flex_attention call trains on CPU")

# %% [markdown]
# ## Measured
# Timings depend on the CPU and its load; they are reported, not checked. `benchmarks/bench_flex.py`
# runs the full comparison (compiled PyTorch Flex, the built-in keywords the functions spell, forward
# and backward, decode) at S 4096; docs/dialects.md has its table. Here: a mask written as a function
# against the same mask as the built-in keyword, and the dense mask SDPA needs.

# %%
slopes = torch.exp2(-(torch.arange(H, dtype=torch.float32) + 1) * 8.0 / H)


def alibi_as_function(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx).abs()


times = interleaved_times({
    "mask_mod causal": lambda: tileattn.flash_attention(q, k, v, mask_mod=examples.causal),
    "causal=True": lambda: tileattn.flash_attention(q, k, v, causal=True),
    "score_mod ALiBi": lambda: tileattn.flash_attention(q, k, v, score_mod=alibi_as_function),
    "alibi_slopes=": lambda: tileattn.flash_attention(q, k, v, alibi_slopes=slopes),
    "document block mask": lambda: tileattn.flex_attention(q, k, v, block_mask=block_mask),
    "SDPA, dense document mask": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                                          attn_mask=dense[None, None]),
}, repeat=pick(2, 5))
for name, seconds in times.items():
    print(f"  {name:30s} {1e3 * seconds:8.2f} ms")
print(f"  {100 * float(dense.float().mean()):.1f}% of the scores are visible; "
      f"{100 * counts['hidden'] / sum(counts.values()):.0f}% of the blocks are never computed")
check(math.isfinite(sum(times.values())), "every contender ran")

# %% [markdown]
# ## Exercises
#
# 1. Write the prefix-LM mask (a prefix of `P` tokens that every query sees, causal after it) as a
#    `mask_mod` and draw its block map for `P` a multiple of the block size and one that is not. How
#    many partial blocks does each have, and why?
# 2. `examples.dilated_window(w, 2)` keeps every other key of a window: all its blocks are partial.
#    Compare the time of `tileattn.flex_attention` with SDPA's dense mask as `w` grows. Where does
#    skipping blocks stop paying?
# 3. A `score_mod` that branches on a tensor in Python (`if score > 0:`) cannot be compiled. Write one,
#    read the reason in `tileattn.flex.explain(...)["score_mod"]` and which engine runs it instead,
#    then rewrite it with `torch.where` and see the native engine take it back.
# 4. Capture a temperature in a closure (`score / temperature`) and call it with ten temperatures:
#    how many times does `compiler.STATS["traces"]` grow, and why? Now read it from a class attribute
#    (`Cfg.temperature`) instead: what changes, and why is that the sound choice?
# 5. Train the relative bias table above with a per-head scale captured as well
#    (`score * scales[h] + table[h, q_idx - kv_idx + S - 1]`). Do both receive gradients? Check the
#    scales' gradient against `flex_reference` in fp64.
