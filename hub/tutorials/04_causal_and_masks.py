# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 04 · Causal attention and masks: skipping tiles
#
# A decoder only lets query `i` see keys `j <= i` (causal). In the naive version that is a mask
# applied to a full `S x S` matrix: the masked half is computed and then thrown away. A tiled kernel
# can do better: a tile whose keys all lie after its queries is *entirely* hidden, so it is never
# visited. Only the tiles on the diagonal need the element-wise mask.
#
# With `n = S / block` blocks per side there are `n^2` tiles; `n (n - 1) / 2` lie strictly above the
# diagonal and can be skipped, `n` straddle it. The skipped fraction is `(n - 1) / 2n`, which tends
# to 50% for long sequences, and the work saved approaches 2x.
#
# tileattn aligns causal (and sliding windows) to the **bottom-right** corner like FlashAttention-2:
# query `i` sees key `j` iff `j <= i + (Sk - Sq)`. For `Sq == Sk` that is the usual lower triangle.
# `tileattn.core.modifiers.Band` owns that geometry for every engine: `Band.tile_state` classifies a
# (query block, key block) tile as EMPTY (skipped), PARTIAL (masked) or FULL (no mask needed); we
# use it here to count tiles exactly as the engines do.

# %%
import tileattn
from tileattn.backends.cpu import TileConfig
from tileattn.core.modifiers import Band, TileState
from tileattn.core.testing import check_against_reference
from _hub import check, figure, interleaved_times, pick, save_figure, seeded, tiles_visited


def tile_states(S, block, left=None, right=None):
    """{(first query row, first key): EMPTY, PARTIAL or FULL} for every tile of an S x S problem."""
    band = Band(left, right)
    return {(i0, j0): band.tile_state(i0, min(i0 + block, S), j0, min(j0 + block, S), offset=0)
            for i0 in range(0, S, block) for j0 in range(0, S, block)}


def tile_census(S, block, left=None, right=None):
    """(total tiles, tiles never visited, tiles that need an element-wise mask)."""
    states = list(tile_states(S, block, left, right).values())
    return len(states), states.count(TileState.EMPTY), states.count(TileState.PARTIAL)


def visited(S, block, left=None, right=None):
    """The tiles a kernel must compute: every one that is not EMPTY."""
    return {tile for tile, state in tile_states(S, block, left, right).items() if state != TileState.EMPTY}


# %% [markdown]
# ## Counting tiles
# Check the census against the closed form, for the block size the catlass article uses (128).

# %%
block = 128
for S in (2048, 4096, 8192, 16384):
    n = S // block
    total, skipped, partial = tile_census(S, block, right=0)
    check((total, skipped, partial) == (n * n, n * (n - 1) // 2, n),
          f"S={S}: {total} tiles, {skipped} skipped ({skipped / total:.1%}), {partial} on the diagonal")

# %% [markdown]
# ## Correctness first
# The skipped tiles must not change anything: causal output and gradients pass the accuracy rule,
# also with `Sq != Sk` (bottom-right alignment) and with tiles smaller than the sequence.

# %%
cpu = tileattn.get_backend("cpu")
cpu.config_override = TileConfig(block_m=32, block_n=32)
for sq, sk in ((100, 100), (40, 100), (100, 40)):
    q = seeded(1, 2, sq, 32, seed=1)
    k, v = seeded(1, 2, sk, 32, seed=2), seeded(1, 2, sk, 32, seed=3)
    verdicts = check_against_reference(tileattn.flash_attention, q, k, v, causal=True)
    check(all(x.ok for x in verdicts), f"causal Sq={sq} Sk={sk}: out/dq/dk/dv pass the 2x rule")

# %% [markdown]
# ## The work skipped, and the measured speed-up
# Same engine, same tile configuration, with and without `causal=True`. First the work: `tiles_visited`
# watches the PyTorch-ops engine walk its key blocks and collects the tiles whose scores it computes.
# They must be exactly the tiles the census says are not EMPTY, and all of them without the mask.
# That is the saving, and it is the same on every machine. Then the two calls are timed round-robin.

# %%
block = pick(64, 128)
cpu.config_override = TileConfig(block_m=block, block_n=block)
H, D = 4, 64
lengths = pick([512, 1024], [1024, 2048, 4096, 8192])
table = []
for S in lengths:
    q, k, v = (seeded(1, H, S, D, seed=i) for i in range(3))
    with tiles_visited() as full_tiles:
        tileattn.flash_attention(q, k, v, backend="cpu")
    with tiles_visited() as causal_tiles:
        tileattn.flash_attention(q, k, v, causal=True, backend="cpu")
    total, skipped, _ = tile_census(S, block, right=0)
    check(full_tiles == visited(S, block) and causal_tiles == visited(S, block, right=0),
          f"S={S}: the engine computed {len(causal_tiles)} of {len(full_tiles)} tiles with causal=True, exactly "
          f"the {total - skipped} the census leaves (all {total} without)")
    t = interleaved_times({
        "full": lambda: tileattn.flash_attention(q, k, v, backend="cpu"),
        "causal": lambda: tileattn.flash_attention(q, k, v, causal=True, backend="cpu"),
    }, repeat=pick(5, 3))
    total, skipped, _ = tile_census(S, block, right=0)
    table.append((S, total, skipped, t["full"], t["causal"]))

print(f"block {block}x{block}, H={H}, D={D}, fp32")
print(f"{'S':>6} {'tiles':>7} {'skipped':>8} {'ratio':>6} {'full ms':>8} {'causal ms':>10} {'speed-up':>9}")
for S, total, skipped, tf, tc in table:
    print(f"{S:>6} {total:>7} {skipped:>8} {skipped / total:>6.1%} {tf * 1e3:>8.1f} {tc * 1e3:>10.1f} {tf / tc:>8.2f}x")

S_last, total, skipped, tf, tc = table[-1]
print(f"at S={S_last}: measured speed-up {tf / tc:.2f}x for a tile work ratio of {total / (total - skipped):.2f}x")

# %% [markdown]
# The speed-up is a measurement, not a property of the kernel: it moves with the CPU, the tile size
# and whatever else runs on the machine (on a busy one a single timing can even invert), which is
# why the chapter checks the work and prints the time. Measured at full size on this machine (2
# cores, Xeon with AVX-512, shared with other jobs; log in `docs/hub/logs/04.txt`), 128x128 tiles,
# H=4, D=64, fp32:
#
# | S | tiles | skipped | ratio | full ms | causal ms | speed-up |
# |---:|---:|---:|---:|---:|---:|---:|
# | 1024 | 64 | 28 | 43.8% | 21.8 | 18.6 | 1.17x |
# | 2048 | 256 | 120 | 46.9% | 77.0 | 45.2 | 1.70x |
# | 4096 | 1024 | 496 | 48.4% | 313.3 | 151.3 | 2.07x |
# | 8192 | 4096 | 2016 | 49.2% | 1067.1 | 480.3 | 2.22x |
#
# The skip ratio follows `(n - 1) / 2n` exactly. The speed-up is below the tile work ratio for short
# sequences (diagonal tiles pay for the element-wise mask, and fixed per-call costs weigh more) and
# was above it for long ones: skipped tiles also save loading their K/V blocks, and the smaller
# causal working set stays in cache better. The catlass article reports 1.3x-1.5x on an Ascend NPU
# for the same 50% skip.
#
# ## Sliding windows
# A window `(left, right)` lets query `i` see keys `i - left .. i + right` (Mistral uses
# `(4095, 0)`). Now the visited tiles form a band of constant width: the work grows *linearly*
# in `S`.

# %%
W = pick(128, 512)
q, k, v = (seeded(1, H, pick(1024, 4096), D, seed=i) for i in range(3))
S = q.shape[2]
verdicts = check_against_reference(tileattn.flash_attention, q, k, v, grad=False, window=(W, 0))
check(all(x.ok for x in verdicts), f"window ({W}, 0) passes the accuracy rule")
total, skipped, partial = tile_census(S, block, left=W, right=0)
print(f"S={S}, window ({W}, 0): {total - skipped} of {total} tiles visited, {partial} need a mask")
with tiles_visited() as window_tiles:
    tileattn.flash_attention(q, k, v, window=(W, 0), backend="cpu")
causal_count = len(visited(S, block, right=0))
check(window_tiles == visited(S, block, left=W, right=0) and len(window_tiles) < causal_count / 2,
      f"the window's engine computed exactly its {len(window_tiles)} band tiles, under half of causal's {causal_count}")
t = interleaved_times({
    "causal": lambda: tileattn.flash_attention(q, k, v, causal=True, backend="cpu"),
    "window": lambda: tileattn.flash_attention(q, k, v, window=(W, 0), backend="cpu"),
}, repeat=pick(5, 3))
print(f"causal {t['causal'] * 1e3:.1f} ms, window {t['window'] * 1e3:.1f} ms: measured {t['causal'] / t['window']:.2f}x "
      f"for {causal_count / len(window_tiles):.2f}x fewer tiles")
cpu.config_override = None

# %%
fig, ax = figure(figsize=(6, 4))
xs = [r[0] for r in table]
ax.plot(xs, [r[3] / r[4] for r in table], "o-", label="measured speed-up (causal vs full)")
ax.plot(xs, [r[1] / (r[1] - r[2]) for r in table], "k--", label="tile work ratio")
ax.set(xscale="log", xlabel="sequence length S", ylabel="x faster", title=f"causal tile skipping, {block}x{block} tiles")
ax.legend()
save_figure(fig, "04_causal_skip.png")

# %% [markdown]
# ![causal speed-up against S](../../docs/hub/04_causal_skip.png)
#
# ## Exercises
#
# 1. Change `block` to 32 and to 256: how do the skip ratio and the measured speed-up move? Why is a
#    small block not automatically better?
# 2. Compute the census for `Sq = 1, Sk = 4096` (one decoding step): how many tiles are skipped?
# 3. Pass an arbitrary boolean `mask` that hides whole 128-wide blocks of keys. The CPU engine
#    skips a tile after checking `mask.any()`: measure how much that saves compared with a band.
