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
# and a **block mask** computed once says which (query block, key block) tiles are EMPTY (skipped),
# FULL (no mask to apply) or PARTIAL (apply the mask element by element). On CPU, PyTorch's
# FlexAttention has no backward; `tileattn.flex_attention` has the same signature and semantics and
# runs forward and backward: mask-only calls on the native kernels one row of blocks at a time, a
# `score_mod` compiled to C with its derivative. This chapter writes a mask, looks at its block map,
# checks the result against the fp64 reference, trains a learned bias through a `score_mod`, and
# measures.

# %%
import math

import torch
from torch.nn.attention import flex_attention as torch_flex

import tileattn
from tileattn.flex import create_block_mask, examples
from tileattn.flex.blocks import EMPTY, FULL, PARTIAL, classify
from tileattn.flex.semantics import flex_reference
from tileattn.core.testing import judge
from _hub import check, figure, interleaved_times, pick, save_figure, seeded

B, H, S, D = 1, 2, pick(320, 2048), 32
BLOCK = pick(32, 128)

# %% [markdown]
# ## A mask is a function
# Packed training puts several documents in one sequence; a token must attend only to the earlier
# tokens of its own document. With the document id of every position in a tensor, that is one line.
# `create_block_mask` evaluates it block by block (never the whole S x S at once) and classifies
# each tile.

# %%
doc_ids = torch.arange(S) * 5 // S   # five documents of S/5 tokens
doc_ids[S // 2:] = torch.clamp(doc_ids[S // 2:] + (torch.arange(S - S // 2) % 7 == 0).long(), max=4)


def packed_documents(b, h, q_idx, kv_idx):
    return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)


block_mask = create_block_mask(packed_documents, None, None, S, S, BLOCK_SIZE=BLOCK)
block_map = classify(block_mask, B, H)
counts = block_map.counts()
print(f"  S {S}, blocks of {BLOCK}: {counts}; the mask ran {block_map.how}")
dense = packed_documents(0, 0, torch.arange(S)[:, None], torch.arange(S)[None, :])
check(torch.equal(block_map.to_dense()[0, 0], dense), "the block map (tile states + partial bits) is exactly the mask")
check(counts["empty"] > counts["full"] + counts["partial"], "most tiles of a packed causal mask are EMPTY (skipped)")

# %% [markdown]
# ## The block map as a picture
# White tiles are skipped, dark ones computed without any mask, and only the grey ones evaluate the
# mask (their bits were packed once, eight rows per byte).

# %%
fig, ax = figure(1, 2, figsize=(9, 4))
ax[0].imshow(dense, cmap="Greys", interpolation="nearest")
ax[0].set_title("the mask (query rows x keys)")
states = block_map.states[0, 0].float()
picture = torch.where(states == EMPTY, 0.0, torch.where(states == PARTIAL, 0.45, 1.0))
ax[1].imshow(picture, cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
ax[1].set_title("its block map: empty / partial / full")
save_figure(fig, "16_block_map.png")
check(int((states == FULL).sum()) == counts["full"], "the picture shows every FULL tile of the map")

# %% [markdown]
# ## Same answer, forward and backward
# FlashAttention's rule (tutorial 05): the error against an fp64 oracle may be at most twice that of
# plain PyTorch math in the same precision. The oracle here is `flex_reference`, which materialises
# the scores, applies `score_mod` and the mask exactly as PyTorch documents, and takes a safe softmax.
# A `score_mod` adds ALiBi on top of the mask; the score is modified first, then masked.

# %%
q, k, v = (seeded(B, H, S, D, seed=i) for i in range(3))
alibi = examples.alibi(H)


def run(fn, dtype, **extra):
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, score_mod=alibi, block_mask=block_mask, **extra)
    return [out, *torch.autograd.grad(out, leaves, seeded(*out.shape, seed=9).to(dtype))]


got = run(tileattn.flex_attention, torch.float32)
oracle = run(flex_reference, torch.float32, compute_dtype=torch.float64)
plain = run(flex_reference, torch.float32)
for name, a, o, p in zip(("out", "dq", "dk", "dv"), got, oracle, plain):
    verdict = judge(name, a, o, p, torch.float32)
    print(" ", verdict)
    check(verdict.ok, f"{name} of tileattn.flex_attention is within 2x plain fp32 math of the fp64 oracle")
print("  how the call ran:", tileattn.flex.explain(q, k, v, score_mod=alibi, block_mask=block_mask))

try:  # PyTorch's own CPU FlexAttention, for comparison: forward only (in torch 2.13)
    torch_flex.flex_attention(*(t.detach().clone().requires_grad_() for t in (q, k, v)), block_mask=block_mask).sum().backward()
    print("  this torch's CPU FlexAttention has a backward")
except NotImplementedError as exc:
    print(f"  PyTorch's CPU FlexAttention: {exc}")

# %% [markdown]
# ## Training a learned bias
# A `score_mod` may read tensors it captures: here a relative-position bias table `(H, 2S - 1)`,
# T5/Swin style. Its gradient is the sum of dL/dscore over every (query, key) pair at each relative
# distance; the compiled derivative accumulates it per tile. A few steps of Adam fit the table so that
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
# runs the full comparison (compiled PyTorch Flex, tileattn's built-in modifiers, SDPA with a dense
# mask, forward and backward) at S 4096.

# %%
dense4 = dense[None, None]
times = interleaved_times({
    "tileattn.flex_attention (mask only)": lambda: tileattn.flex_attention(q, k, v, block_mask=block_mask),
    "tileattn.flex_attention + ALiBi score_mod": lambda: tileattn.flex_attention(q, k, v, score_mod=alibi,
                                                                                  block_mask=block_mask),
    "SDPA with the dense mask": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense4),
}, repeat=pick(2, 5))
for name, seconds in times.items():
    print(f"  {name:45s} {1e3 * seconds:8.2f} ms")
visible = float(dense.float().mean())
print(f"  {100 * visible:.1f}% of the scores are visible; {100 * (counts['empty']) / sum(counts.values()):.0f}% "
      f"of the tiles are skipped")
check(math.isfinite(sum(times.values())), "every contender ran")

# %% [markdown]
# ## Exercises
#
# 1. Write the prefix-LM mask (a prefix of `P` tokens that every query sees, causal after it) as a
#    `mask_mod` and draw its block map for `P` a multiple of the block size and one that is not. How
#    many PARTIAL tiles does each have, and why?
# 2. `examples.dilated_window(w, 2)` keeps every other key of a window. Its tiles are all PARTIAL:
#    count them with `classify(...).counts()` and compare the time of `tileattn.flex_attention` with
#    SDPA's dense mask as `w` grows. Where does skipping tiles stop paying?
# 3. A `score_mod` that branches on a tensor in Python (`if score > 0:`) cannot be compiled. Write one,
#    read the reason in `tileattn.flex.explain(...)["score_mod"]`, then rewrite it with `torch.where`
#    and see the reason disappear.
# 4. Train the relative bias table above with a per-head scale captured as well
#    (`score * scales[h] + table[h, q_idx - kv_idx + S - 1]`). Do both receive gradients? Check the
#    scales' gradient against `flex_reference` in fp64.
# 5. Time `tileattn.flex_attention` with and without `score_mod=examples.alibi(H)`, then with
#    `tileattn.flash_attention(alibi_slopes=...)`. What does the built-in modifier save, and what would
#    a `score_mod` need to run at that speed?
