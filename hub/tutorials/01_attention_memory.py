# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 01 · Why attention runs out of memory
#
# You know `torch.nn.functional.scaled_dot_product_attention`. Written out by hand, attention is
# three lines:
#
# ```python
# scores = (q @ k.transpose(-1, -2)) * scale     # (B, H, S, S)
# probs = scores.softmax(-1)                      # (B, H, S, S)
# out = probs @ v                                 # (B, H, S, D)
# ```
#
# The inputs and the output are `S x D` per head, but the two intermediates are `S x S`. With
# `D = 64` and `S = 8192`, one head's score matrix is 128 times larger than its queries. Doubling
# `S` doubles the inputs and *quadruples* the intermediates. This tutorial measures exactly that:
# the peak memory and time of naive attention as `S` grows, next to `tileattn.flash_attention`,
# which only ever holds one `block_m x block_n` tile of scores per core at a time.
#
# How we measure memory on a CPU: Linux keeps a high-water mark of the process's resident memory
# (`VmHWM`), which we can reset. `_hub.peak_memory(fn)` resets it, runs `fn` and reports how far
# the mark rose above where it started.

# %%
import torch

import tileattn
from tileattn.core.testing import check_against_reference
from _hub import MiB, check, figure, interleaved_times, peak_memory, pick, save_figure, seeded

torch.manual_seed(0)
B, H, D = 1, 4, 64
lengths = pick([256, 512, 1024], [512, 1024, 2048, 4096, 8192])


def naive_attention(q, k, v):
    scale = q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    probs = scores.softmax(-1)
    return probs @ v


# %% [markdown]
# First, both functions must compute the same thing. `tileattn.core.testing.check_against_reference`
# applies FlashAttention's own accuracy rule: the error against an fp64 oracle may be at most twice
# the error of plain PyTorch math in the same dtype.

# %%
q, k, v = (seeded(B, H, 256, D, seed=i) for i in range(3))
for fn in (naive_attention, tileattn.flash_attention):
    verdicts = check_against_reference(fn, q, k, v, grad=False)
    print(fn.__name__, *verdicts)
    check(all(x.ok for x in verdicts), f"{fn.__name__} matches the fp64 reference")

# %% [markdown]
# Now the measurement. For each length we record the peak extra memory and the median time of
# both versions (timed round-robin, so a busy machine slows both alike).

# %%
rows = []
for S in lengths:
    q, k, v = (seeded(B, H, S, D, seed=i) for i in range(3))
    naive_attention(q, k, v)  # warm-up: first calls allocate thread pools and caches
    tileattn.flash_attention(q, k, v)
    _, naive_peak = peak_memory(lambda: naive_attention(q, k, v))
    _, flash_peak = peak_memory(lambda: tileattn.flash_attention(q, k, v))
    times = interleaved_times(
        {"naive": lambda: naive_attention(q, k, v), "flash": lambda: tileattn.flash_attention(q, k, v)},
        repeat=pick(3, 3),
    )
    score_bytes = B * H * S * S * 4
    rows.append((S, score_bytes, naive_peak, flash_peak, times["naive"], times["flash"]))

print(f"{'S':>6} {'S*S fp32 (MiB)':>15} {'naive peak':>11} {'flash peak':>11} {'naive ms':>9} {'flash ms':>9}")
for S, sb, npk, fpk, tn, tf in rows:
    print(f"{S:>6} {sb / MiB:>15.1f} {npk / MiB:>10.1f}M {fpk / MiB:>10.1f}M {tn * 1e3:>9.1f} {tf * 1e3:>9.1f}")

# %% [markdown]
# What the numbers say (each line is checked):
#
# * naive attention needs at least one full `B x H x S x S` fp32 matrix; in fact two or three
#   (`q @ k^T`, its scaled copy and `probs` can all be alive at once);
# * its peak grows about 4x per doubling of `S`;
# * the tiled version's peak stays a small fraction of it.

# %%
first, last = rows[0], rows[-1]
for S, sb, npk, fpk, *_ in rows:
    check(npk >= 0.9 * sb, f"S={S}: naive peak {npk / MiB:.0f} MiB >= one S*S matrix ({sb / MiB:.0f} MiB)")
growth = last[2] / first[2]
expected = (last[0] / first[0]) ** 2
check(growth > 0.5 * expected, f"naive peak grew {growth:.1f}x for a {last[0] // first[0]}x longer sequence (S^2 predicts {expected:.0f}x)")
check(last[3] < last[2] / 4, f"at S={last[0]} tileattn's peak ({last[3] / MiB:.1f} MiB) is under a quarter of naive ({last[2] / MiB:.1f} MiB)")

# %%
fig, (ax_mem, ax_time) = figure(1, 2, figsize=(10, 4))
xs = [r[0] for r in rows]
ax_mem.loglog(xs, [r[2] / MiB for r in rows], "o-", label="naive (measured)")
ax_mem.loglog(xs, [r[3] / MiB + 1e-3 for r in rows], "s-", label="tileattn (measured)")
ax_mem.loglog(xs, [r[1] / MiB for r in rows], "k--", label="one S x S fp32 matrix")
ax_mem.set(xlabel="sequence length S", ylabel="peak extra memory (MiB)", title=f"B={B} H={H} D={D} fp32")
ax_mem.legend()
ax_time.loglog(xs, [r[4] * 1e3 for r in rows], "o-", label="naive")
ax_time.loglog(xs, [r[5] * 1e3 for r in rows], "s-", label="tileattn")
ax_time.set(xlabel="sequence length S", ylabel="median time (ms)", title="forward time")
ax_time.legend()
for ax in (ax_mem, ax_time):  # label the measured lengths, not log-scale minor ticks
    ax.set_xticks(xs, [str(x) for x in xs], minor=False)
    ax.set_xticks([], minor=True)
save_figure(fig, "01_attention_memory.png")

# %% [markdown]
# ![peak memory and time against S](../../docs/hub/01_attention_memory.png)
#
# Measured at full size on this machine (`docs/hub/logs/01.txt`; B=1, H=4, D=64, fp32):
#
# | S | one S x S matrix | naive peak | tileattn peak | naive ms | tileattn ms |
# |---:|---:|---:|---:|---:|---:|
# | 512 | 4 MiB | 12.5 MiB | 1.8 MiB | 11.5 | 13.2 |
# | 1024 | 16 MiB | 49 MiB | 3.4 MiB | 58.2 | 35.5 |
# | 2048 | 64 MiB | 130 MiB | 4.4 MiB | 253 | 94 |
# | 4096 | 256 MiB | 516 MiB | 8.5 MiB | 1022 | 306 |
# | 8192 | 1024 MiB | 2056 MiB | 18.6 MiB | 2276 | 628 |
#
# At S = 8192 naive attention needed two full score matrices (2 GiB) where tileattn needed 19 MiB,
# 110x less; tileattn's extra memory grows linearly (its output-sized buffers), naive's
# quadratically.
#
# Time grows as `S^2` for both: FlashAttention does not remove the quadratic *compute*, it removes
# the quadratic *memory* (and on a GPU the memory traffic that comes with it). How it does that
# without changing the result is the subject of tutorial 02.
#
# ## Exercises
#
# 1. Run the naive version in fp16 (`q.half()`): does the peak halve? Why not exactly?
# 2. Add a backward pass (`out.sum().backward()`) to both. Autograd keeps `probs` for the backward
#    of naive attention: how does the peak change? (Tutorial 03 explains what tileattn keeps.)
# 3. With 24 GiB of RAM and `B=1, H=32, D=128`, estimate the longest `S` naive attention can run.
