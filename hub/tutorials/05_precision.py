# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 05 · Precision: fp16, bf16, fp32
#
# Attention usually runs in a 16-bit format. The two on offer trade range for precision:
#
# | format | exponent bits | mantissa bits | largest value | relative step (eps) |
# |---|---|---|---|---|
# | fp16 | 5 | 10 | 65504 | 9.8e-4 |
# | bf16 | 8 | 7 | 3.4e38 | 7.8e-3 |
# | fp32 | 8 | 23 | 3.4e38 | 1.2e-7 |
#
# fp16 is more precise but overflows at 65504; bf16 has fp32's range but only about 2-3 correct
# decimal digits. FlashAttention kernels read and write 16-bit tensors but keep the running maximum,
# sum and output accumulator in fp32, and judge themselves with a rule that respects the format:
# **the kernel's error against an fp64 oracle may be at most twice the error of plain PyTorch math
# done in the same 16-bit format** (`tileattn.core.testing`).

# %%
import torch

import tileattn
from tileattn.core.testing import judge, max_error
from _hub import check, figure, interleaved_times, pick, save_figure, seeded

for dt, eps, biggest in ((torch.float16, 9.77e-4, 65504), (torch.bfloat16, 7.81e-3, 3.39e38), (torch.float32, 1.19e-7, 3.40e38)):
    fi = torch.finfo(dt)
    check(abs(fi.eps - eps) / eps < 0.01 and abs(fi.max - biggest) / biggest < 0.01,
          f"{dt}: eps {fi.eps:.3g}, max {fi.max:.4g} as in the table")

# %% [markdown]
# ## Error against the fp64 oracle, per format
# For each format we compute the output three ways: tileattn, plain PyTorch math in that format
# (`tileattn.reference(..., compute_dtype=None)`), and SDPA. All are compared with the fp64 oracle.

# %%
B, H, S, D = 1, 4, pick(512, 2048), 64
dtypes = (torch.float32, torch.float16, torch.bfloat16)
q32, k32, v32 = (seeded(B, H, S, D, seed=i) for i in range(3))
oracle = tileattn.reference(q32, k32, v32, compute_dtype=torch.float64)
errors = {}
for dt in dtypes:
    q, k, v = (t.to(dt) for t in (q32, k32, v32))
    # The oracle sees exactly the rounded inputs, so only the arithmetic is judged.
    oracle_dt = tileattn.reference(q, k, v, compute_dtype=torch.float64)
    plain = tileattn.reference(q, k, v)
    ours = tileattn.flash_attention(q, k, v)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    verdict = judge(str(dt), ours, oracle_dt, plain, dt)
    errors[dt] = {"tileattn": max_error(ours, oracle_dt), "plain math": max_error(plain, oracle_dt),
                  "SDPA": max_error(sdpa, oracle_dt)}
    print(verdict, "| SDPA err", f"{errors[dt]['SDPA']:.3e}")
    check(verdict.ok, f"{dt}: tileattn passes the 2x rule")

check(errors[torch.bfloat16]["tileattn"] > errors[torch.float16]["tileattn"] > errors[torch.float32]["tileattn"],
      "error grows as mantissa bits shrink: fp32 < fp16 < bf16")
check(errors[torch.float16]["tileattn"] <= errors[torch.float16]["plain math"],
      "tileattn in fp16 is at least as accurate as plain fp16 math (it accumulates in fp32)")

# %% [markdown]
# Measured at full size on this machine (`docs/hub/logs/05.txt`, B=1, H=4, S=2048, D=64): max error
# against fp64 of tileattn / SDPA / plain math in the format: fp32 4.0e-7 / 1.8e-7 / 2.1e-7;
# fp16 6.1e-5 / 8.0e-5 / 1.2e-3; bf16 4.9e-4 / 6.0e-4 / 8.7e-3. Both fused kernels are about 15-20x
# more accurate than plain 16-bit math, because they accumulate in fp32.
#
# ## Speed per format
# The CPU engines convert each fp16 tile to fp32 before its matrix products (16-bit matrix products
# on most CPUs are slow or emulated) and round once at the end: an fp16 call computes exactly what
# fp32 computes on the same rounded inputs. That is checked below, and it holds on every CPU. What
# it costs does not: the conversions are extra work whose price depends on the CPU, and a timing
# also moves with whatever else the machine runs. bf16 depends even more on the CPU: with AMX (Intel Sapphire Rapids and later)
# the native engine runs it on the matrix units (chapter 09) and it is the fastest format here;
# without AMX it is converted like fp16. So the table reports measured times and nothing is claimed
# about them. On a GPU, 16-bit tensor cores make 16-bit formats several times faster.

# %%
speed = {}
for dt in dtypes:
    q, k, v = (t.to(dt) for t in (q32, k32, v32))
    speed[dt] = interleaved_times({
        "tileattn": lambda: tileattn.flash_attention(q, k, v),
        "SDPA": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
    }, repeat=pick(3, 5))
flops = 4 * B * H * S * S * D
print(f"{'dtype':>16} {'tileattn ms':>12} {'GFLOP/s':>8} {'SDPA ms':>8}")
for dt in dtypes:
    t = speed[dt]
    print(f"{str(dt):>16} {t['tileattn'] * 1e3:>12.2f} {flops / t['tileattn'] / 1e9:>8.1f} {t['SDPA'] * 1e3:>8.2f}")
q16, k16, v16 = (t.half() for t in (q32, k32, v32))
as_fp16 = tileattn.flash_attention(q16, k16, v16)
via_fp32 = tileattn.flash_attention(q16.float(), k16.float(), v16.float()).half()
ulp = via_fp32.float().abs() * torch.finfo(torch.float16).eps + torch.finfo(torch.float16).tiny
check(bool(((as_fp16.float() - via_fp32.float()).abs() <= ulp).all()),
      "the fp16 call is fp32 attention of the same rounded inputs, rounded once to fp16 (within one fp16 ulp)")

# %% [markdown]
# Measured at full size (S=2048), before the native engine existed, with the PyTorch-ops engine:
# tileattn 98 / 108 / 110 ms and SDPA 64 / 59 / 90 ms for fp32 / fp16 / bf16 on this 2-core
# machine (shared, so +-30%).
#
# ## When fp16 overflows
# The order of operations matters. Naive code often computes `q @ k^T` first and scales after.
# With large activations (outlier features are common in big models) the raw dot products exceed
# 65504 and become `inf` in fp16; the softmax of a row containing `inf` is `NaN`. tileattn folds
# the scale into `q` and computes tiles in fp32, so the same fp16 inputs are fine. bf16 does not
# overflow either (fp32's range), at the cost of precision.

# %%
big = 60.0
qb, kb, vb = seeded(1, 2, 256, D, seed=1, scale=big), seeded(1, 2, 256, D, seed=2, scale=big), seeded(1, 2, 256, D, seed=3)
oracle_big = tileattn.reference(qb.half(), kb.half(), vb.half(), compute_dtype=torch.float64)


def naive_fp16(q, k, v):
    return ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5).softmax(-1) @ v


raw = qb.half() @ kb.half().transpose(-1, -2)
naive_out = naive_fp16(qb.half(), kb.half(), vb.half())
ours_big = tileattn.flash_attention(qb.half(), kb.half(), vb.half())
bf16_out = naive_fp16(qb.bfloat16(), kb.bfloat16(), vb.bfloat16())
print(f"largest |q.k| = {raw.float().abs().max().item():.0f} (fp16 max 65504); "
      f"inf scores: {torch.isinf(raw).sum().item()}, NaN outputs (naive fp16): {torch.isnan(naive_out).sum().item()}")
print(f"tileattn fp16 max error vs fp64: {max_error(ours_big, oracle_big):.3e}")
check(torch.isinf(raw).any() and torch.isnan(naive_out).any(), "naive fp16 attention overflows to inf and outputs NaN")
check(bool(torch.isfinite(ours_big).all()), "tileattn's fp16 output is finite on the same inputs")
# fp32 math rounded to fp16 is the best an fp16 result can be; allow twice its error plus a floor.
best_fp16 = tileattn.reference(qb.half(), kb.half(), vb.half(), compute_dtype=torch.float32).half()
v_big = judge("fp16, large inputs", ours_big, oracle_big, best_fp16, torch.float16)
print(v_big)
check(v_big.ok, "tileattn's fp16 output is as accurate as fp32 math rounded to fp16")
check(bool(torch.isfinite(bf16_out).all()), "naive bf16 attention does not overflow (fp32 range)")

# %%
fig, (ax_err, ax_t) = figure(1, 2, figsize=(10, 4))
names = [str(dt).replace("torch.", "") for dt in dtypes]
width = 0.27
for i, method in enumerate(("tileattn", "plain math", "SDPA")):
    ax_err.bar([x + (i - 1) * width for x in range(3)], [errors[dt][method] for dt in dtypes], width, label=method)
ax_err.set(yscale="log", xticks=range(3), xticklabels=names, ylabel="max |error| vs fp64", title=f"accuracy, S={S}")
ax_err.legend()
for i, method in enumerate(("tileattn", "SDPA")):
    ax_t.bar([x + (i - 0.5) * width for x in range(3)], [speed[dt][method] * 1e3 for dt in dtypes], width, label=method)
ax_t.set(xticks=range(3), xticklabels=names, ylabel="median ms", title=f"CPU forward, B={B} H={H} S={S} D={D}")
ax_t.legend()
save_figure(fig, "05_precision.png")

# %% [markdown]
# ![error and speed per format](../../docs/hub/05_precision.png)
#
# The catlass article's rule of thumb (fp16 up to 4K tokens, bf16 beyond, because fp16 softmax
# overflows) is a property of kernels that keep scores in fp16. A kernel that keeps scores and
# accumulators in fp32 can use fp16's extra precision at any length.
#
# ## Exercises
#
# 1. Lower `big` until the naive fp16 version stops producing NaN. Predict the threshold from
#    `D = 64` and the standard deviation of a dot product of two Gaussian vectors.
# 2. Move the scale before the product in `naive_fp16` (`(q * scale) @ k^T`). Does it still
#    overflow? What else could still go wrong in fp16 (hint: the sum in the softmax)?
# 3. Measure the backward error per format with `tileattn.core.testing.check_against_reference`.
