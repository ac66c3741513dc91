# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 06 · Tuning: tile sizes and the on-chip budget
#
# Tutorial 02 showed that the tile size `(block_m, block_n)` never changes the result. It changes
# the speed, in two opposite directions:
#
# * **bigger tiles** mean fewer, larger matrix products (less per-tile overhead: loop iterations,
#   kernel launches, rescaling of the accumulator) and more reuse of each loaded query block;
# * **smaller tiles** keep the working set (the score tile, the query block, the key/value block and
#   the accumulator) inside fast on-chip memory: an Ascend NPU's Unified Buffer (~192-256 KB), a GPU
#   SM's shared memory and registers, a CPU core's L2 cache.
#
# The catlass article's budget for one tile: `block_m * D * bytes * 3` (Q, K, V) times 2-3 for the
# intermediates; past the budget the kernel silently splits loads and gets slower. The tileattn CPU
# engine has the same model in `TileConfig.working_set_bytes`. Here we compare that model with this
# machine's caches, measure every configuration, and use `tileattn tune` to store the winner.

# %%
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import tileattn
from tileattn.core import tunecache
from tileattn.backends.cpu import TileConfig, default_config
from tileattn.core.spec import build_spec
from tileattn.core.testing import judge
from _hub import check, figure, interleaved_times, pick, save_figure, seeded, tiles_visited


def cache_bytes(level):
    """Size of this CPU's cache of the given level (per core for L1/L2), from sysfs."""
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        if (index / "level").read_text().strip() == str(level) and (index / "type").read_text().strip() != "Instruction":
            text = (index / "size").read_text().strip()
            return int(text[:-1]) * {"K": 1024, "M": 2**20}[text[-1]]
    return None


l2 = cache_bytes(2)
print(f"L1d {cache_bytes(1)} B, L2 {l2} B per core")

# %% [markdown]
# ## The budget model
# Bytes touched by one tile step (fp32 compute) with `D=64`. The CPU engine gives each core whole
# tasks of one (kv head, query block), so the budget is per head and per core.

# %%
H, D = pick(4, 8), 64
blocks = pick([32, 128, 256], [32, 64, 128, 256, 512])
print(f"{'block_m':>8} {'block_n':>8} {'working set':>12}  fits in L2?")
for bm in blocks:
    for bn in blocks:
        ws = TileConfig(bm, bn).working_set_bytes(group=1, head_dim=D, head_dim_v=D)
        print(f"{bm:>8} {bn:>8} {ws / 1024:>10.0f} K  {'yes' if l2 and ws <= l2 else 'no'}")
small_ws = TileConfig(32, 32).working_set_bytes(group=1, head_dim=D, head_dim_v=D)
check(TileConfig(64, 64).working_set_bytes(group=1, head_dim=D, head_dim_v=D) > small_ws, "the working set grows with the tile")

# %% [markdown]
# ## Measuring every configuration
# `CpuBackend.config_override` forces a `TileConfig` for the next calls (it is what `tileattn tune`
# uses internally). Each configuration is checked for correctness and timed; all are timed
# round-robin so the machine's noise does not favour any.

# %%
S = pick(512, 4096)
q, k, v = (seeded(1, H, S, D, seed=i) for i in range(3))
oracle = tileattn.reference(q, k, v, compute_dtype=torch.float64)
plain = tileattn.reference(q, k, v)
cpu = tileattn.get_backend("cpu")
configs = [TileConfig(bm, bn) for bm in blocks for bn in blocks]


def run_with(cfg):
    def go():
        cpu.config_override = cfg
        try:
            return tileattn.flash_attention(q, k, v, backend="cpu")
        finally:
            cpu.config_override = None
    return go


steps = {}
for cfg in configs:
    with tiles_visited() as tiles:
        result = run_with(cfg)()
    steps[cfg] = len(tiles)
    check(judge(str(cfg), result, oracle, plain, torch.float32).ok and steps[cfg] == -(-S // cfg.block_m) * -(-S // cfg.block_n),
          f"{cfg.block_m}x{cfg.block_n} passes the accuracy rule in {steps[cfg]} tile steps per head")
times = interleaved_times({cfg: run_with(cfg) for cfg in configs}, repeat=3)
flops = 4 * H * S * S * D
best = min(times, key=times.get)
worst = max(times, key=times.get)
print(f"S={S}, H={H}, D={D}, fp32: best {best.block_m}x{best.block_n} {times[best] * 1e3:.1f} ms "
      f"({flops / times[best] / 1e9:.1f} GFLOP/s), worst {worst.block_m}x{worst.block_n} {times[worst] * 1e3:.1f} ms")
# Which tile wins, and by how much, changes with the CPU and the load. One thing cannot: the
# smallest tile takes tens of times the steps of the largest, each paying the same fixed cost.
small_tile, large_tile = TileConfig(blocks[0], blocks[0]), TileConfig(blocks[-1], blocks[-1])
step_ratio = steps[small_tile] // steps[large_tile]
check(step_ratio == (blocks[-1] // blocks[0]) ** 2 and times[small_tile] > 1.2 * times[best],
      f"the smallest tile {blocks[0]}x{blocks[0]} takes {step_ratio}x the steps of {blocks[-1]}x{blocks[-1]} and is "
      f"{times[small_tile] / times[best]:.1f}x slower than the fastest (> 1.2x: per-step overhead)")

# %%
fig, ax = figure(figsize=(6, 5))
grid = [[times[TileConfig(bm, bn)] * 1e3 for bn in blocks] for bm in blocks]
im = ax.imshow(grid, cmap="viridis_r")
ax.set(xticks=range(len(blocks)), xticklabels=blocks, yticks=range(len(blocks)), yticklabels=blocks,
       xlabel="block_n (keys per tile)", ylabel="block_m (queries per tile)",
       title=f"CPU forward ms, S={S} H={H} D={D} fp32")
for i, row in enumerate(grid):
    for j, ms in enumerate(row):
        dark = ms > (max(times.values()) + min(times.values())) * 500  # above the mid-range, in ms
        ax.text(j, i, f"{ms:.0f}" if ms >= 10 else f"{ms:.1f}", ha="center", va="center",
                color="w" if dark else "k", fontsize=8)
fig.colorbar(im, ax=ax, label="ms (lower is better)")
save_figure(fig, "06_tile_sizes.png")

# %% [markdown]
# ![time against tile size](../../docs/hub/06_tile_sizes.png)
#
# Measured at full size on this machine (`docs/hub/logs/06.txt`; S=4096, H=8, D=64, fp32): the
# fastest tile was 512x128 at 317 ms (108 GFLOP/s), the slowest 32x32 at 776 ms (2.4x slower);
# every tile of at least 128x128 was within 13% of the best.
#
# Read the timings next to the budget table above. A CPU core has megabytes of L2 and a large
# shared L3 behind it, and MKL blocks each matrix product again for its own caches, so the budget
# rarely binds here and the per-tile overhead of small tiles decides: each tile step costs a few
# Python-level tensor operations whatever its size. On an NPU or a GPU the on-chip budget is a hard
# wall instead (registers spill, loads are split), which is why the catlass tables stop at 128-256.
#
# ## `tileattn tune`: measure once, remember the winner
# `tileattn tune` runs this sweep for a shape and stores the winner in a small JSON cache
# (`$TILEATTN_CACHE_DIR`, default `~/.cache/tileattn`), keyed by device, dtype, head dim, causal and
# a power-of-two bucket of the sequence length, per engine. This chapter tunes the PyTorch-ops engine
# whose tiles we swept above (`--backend cpu`); its `default_config` looks the winner up on every
# call. On a CPU `tileattn tune` defaults to the native C kernels (chapter 09), whose tiles are tuned
# the same way. We point the cache at a temporary directory so the tutorial changes nothing on disk.

# %%
cache_dir = tempfile.mkdtemp(prefix="tileattn-tune-")
env = dict(os.environ, TILEATTN_CACHE_DIR=cache_dir)
tune_shape = pick("1,2,256,64", f"1,{H},1024,{D}")
cmd = [sys.executable, "-m", "tileattn", "tune", "--backend", "cpu", "--shape", tune_shape, "--mode", "fwd", "--quiet"]
cmd += pick(["--reps", "1", "--warmup", "0"], [])
print("$", " ".join(cmd[2:]))
proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
print(proc.stdout[-3000:], proc.stderr[-3000:])
if proc.returncode != 0 and ("invalid choice: 'tune'" in proc.stderr or "No module named" in proc.stderr):
    raise RuntimeError("`tileattn tune` is not available in this checkout (the CLI's tune command has not "
                       "landed); this part of the tutorial cannot run")
check(proc.returncode == 0, "tileattn tune exits with status 0")

os.environ["TILEATTN_CACHE_DIR"] = cache_dir
cache = json.loads((Path(cache_dir) / "tune_cache.json").read_text())
print(json.dumps(cache, indent=1))
b, h, s, d = (int(x) for x in tune_shape.split(","))
probe = build_spec(*(seeded(b, h, s, d, seed=i) for i in range(3)))
tuned = default_config(probe)
stored = tunecache.lookup("cpu", probe)
check(stored is not None and (tuned.block_m, tuned.block_n) == (int(stored["block_m"]), int(stored["block_n"])),
      f"the CPU engine now picks the tuned tiles {tuned.block_m}x{tuned.block_n} for this shape")
del os.environ["TILEATTN_CACHE_DIR"]

# %% [markdown]
# ## Exercises
#
# 1. Repeat the sweep with `causal=True`. Does the best tile change? (Smaller tiles skip more of the
#    upper triangle, tutorial 04.)
# 2. Repeat it with GQA (`k, v` with 1 head, `q` with 8): `working_set_bytes(group=8, ...)`. Why does
#    the engine's default `block_m` shrink as the group grows?
# 3. Using the catlass budget `block_m * D * 2 bytes * 3 * 2.5` and a 192 KB buffer, what is the
#    largest `block_m` for `D = 128` in fp16? Compare with the article's choice.
