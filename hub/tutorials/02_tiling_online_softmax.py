# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 02 · Tiling and the online softmax
#
# Tutorial 01 showed that the `S x S` score matrix is the problem. Tiling the two matrix products is
# easy; the softmax in between is not, because every output row needs the *whole* row of scores:
#
# $$\mathrm{softmax}(s)_j = \frac{e^{s_j - m}}{\sum_k e^{s_k - m}}, \qquad m = \max_k s_k .$$
#
# (Subtracting the row maximum `m` changes nothing mathematically and keeps `exp` from
# overflowing.) FlashAttention computes it in one pass over the keys, one block at a time, with
# three running quantities per query row: the maximum so far `m`, the sum so far `l` of
# `exp(s - m)`, and the *unnormalised* output so far `acc = sum_j exp(s_j - m) v_j`.
#
# **The rescaling.** Suppose we have processed some keys with maximum `m_old` and a new block
# arrives whose scores have maximum `m_blk`. The new maximum is `m_new = max(m_old, m_blk)`.
# Everything accumulated so far was computed relative to `m_old`; since
# `exp(s - m_new) = exp(s - m_old) * exp(m_old - m_new)`, multiplying by
# `alpha = exp(m_old - m_new)` moves it to the new reference:
#
# $$l \leftarrow \alpha\, l + \sum_{j \in blk} e^{s_j - m_{new}}, \qquad
#   acc \leftarrow \alpha\, acc + \sum_{j \in blk} e^{s_j - m_{new}} v_j .$$
#
# After the last block, `out = acc / l`, exactly the softmax-weighted sum. We also keep
# `lse = m + log(l)`, the log-sum-exp of the row: the backward pass (tutorial 03) needs nothing else.
#
# We build this step by step and check each step against `tileattn.reference`.

# %%
import math

import torch

import tileattn
from tileattn.core.testing import judge
from _hub import check, pick, seeded

B, H, S, D = 1, 2, pick(192, 512), 64
q, k, v = (seeded(B, H, S, D, seed=i) for i in range(3))
scale = D ** -0.5
oracle, oracle_lse = tileattn.reference(q, k, v, compute_dtype=torch.float64, return_lse=True)
plain_fp32 = tileattn.reference(q, k, v)  # plain math in fp32: the yardstick of the 2x rule


def verdict(name, out):
    v_ = judge(name, out, oracle, plain_fp32, torch.float32)
    print(v_)
    return v_.ok


# %% [markdown]
# ## Step 1: one row, all at once
# The textbook softmax of one query row, as a baseline for the streaming version.

# %%
row_scores = (q[0, 0, 0] @ k[0, 0].T) * scale  # (S,)
p = torch.exp(row_scores - row_scores.max())
row_out = (p / p.sum()) @ v[0, 0]
check(torch.allclose(row_out.double(), oracle[0, 0, 0], atol=1e-5), "step 1: one softmax row matches the reference")

# %% [markdown]
# ## Step 2: one row, streamed over key blocks
# Now the same row, visiting the keys `block_n` at a time and never holding more than one block of
# scores. This is the online softmax with the rescaling derived above.

# %%
block_n = 64
m, l, acc = -math.inf, 0.0, torch.zeros(D)
for j0 in range(0, S, block_n):
    s_blk = (q[0, 0, 0] @ k[0, 0, j0:j0 + block_n].T) * scale
    m_new = max(m, s_blk.max().item())
    alpha = math.exp(m - m_new)  # exp(-inf) = 0 on the first block
    p_blk = torch.exp(s_blk - m_new)
    l = alpha * l + p_blk.sum().item()
    acc = alpha * acc + p_blk @ v[0, 0, j0:j0 + block_n]
    m = m_new
streamed = acc / l
check(torch.allclose(streamed.double(), oracle[0, 0, 0], atol=1e-5), "step 2: the streamed row equals the full softmax row")
check(abs(m + math.log(l) - oracle_lse[0, 0, 0].item()) < 1e-4, "step 2: m + log(l) is the row's log-sum-exp")

# %% [markdown]
# ## Step 3: a block of rows at a time (the FlashAttention-2 forward)
# Rows are independent, so we process `block_m` query rows together: the scalars become vectors
# and the dot products become matrix products. This is the whole forward kernel: the outer loop
# over query blocks can run in parallel (one block per GPU program or CPU thread), the inner loop
# streams key blocks through the online softmax.

# %%
def tiled_forward(q, k, v, scale, block_m=64, block_n=64):
    """FlashAttention-2 forward for (B, H, S, D) tensors; returns (out, lse)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1])
    for i0 in range(0, q.shape[2], block_m):
        qb = q[:, :, i0:i0 + block_m] * scale
        m = torch.full(qb.shape[:-1] + (1,), -math.inf)
        l = torch.zeros_like(m)
        acc = torch.zeros(qb.shape[:-1] + (v.shape[-1],))
        for j0 in range(0, k.shape[2], block_n):
            s = qb @ k[:, :, j0:j0 + block_n].transpose(-1, -2)  # the only score tile in memory
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = alpha * l + p.sum(-1, keepdim=True)
            acc = alpha * acc + p @ v[:, :, j0:j0 + block_n]
            m = m_new
        out[:, :, i0:i0 + block_m] = acc / l
        lse[:, :, i0:i0 + block_m] = (m + torch.log(l)).squeeze(-1)
    return out, lse


out, lse = tiled_forward(q, k, v, scale)
check(verdict("step 3 tiled out", out), "step 3: the tiled forward passes FlashAttention's 2x accuracy rule")
check(torch.allclose(lse.double(), oracle_lse, atol=1e-4), "step 3: the tiled LSE matches the reference LSE")

# %% [markdown]
# ## Step 4: the tile size does not change the answer
# Only rounding differs between tilings, so every choice of `(block_m, block_n)`, even ones that do
# not divide `S`, passes the same accuracy check. Tile sizes are a pure speed knob (tutorial 06).

# %%
for bm, bn in [(16, 16), (32, 128), (64, 40), (S, S)]:
    o, _ = tiled_forward(q, k, v, scale, bm, bn)
    check(verdict(f"tiles {bm}x{bn}", o), f"step 4: tiles {bm}x{bn} pass the accuracy rule")

# %% [markdown]
# ## Step 5: the library version
# `tileattn.flash_attention` runs the same algorithm with more care for speed: it uses `exp2`
# with `log2(e)` folded into the query scale, stacks the query heads that share a K/V head (GQA)
# into one matrix product, and skips tiles that a causal mask hides entirely (tutorial 04).

# %%
lib_out, lib_lse = tileattn.flash_attention(q, k, v, return_lse=True)
check(verdict("tileattn.flash_attention", lib_out), "step 5: tileattn passes the accuracy rule")
check(torch.allclose(lib_lse.double(), oracle_lse, atol=1e-4), "step 5: tileattn's LSE matches")
print("our tiled forward vs tileattn, max |diff|:", (out - lib_out).abs().max().item())

# %% [markdown]
# ## Exercises
#
# 1. Replace `torch.exp` by `torch.exp2` in `tiled_forward`. Which quantity must you multiply by
#    `log2(e)` so the result stays the same, and how does `lse` change?
# 2. A row whose keys are all masked has `m = -inf` at the end. What do `alpha` and `acc / l`
#    become? Guard the code so such a row outputs 0 (the convention tileattn follows).
# 3. Count the bytes alive inside `tiled_forward` for one query block, as a function of
#    `block_m`, `block_n` and `D`. Compare with the `S x S` matrix of tutorial 01.
