# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 09 · A native kernel
#
# Tutorial 02 built FlashAttention out of PyTorch operations; tutorial 07 wrote it as a Triton
# kernel, where one GPU program keeps its tile in registers and the softmax never leaves the chip.
# On a CPU, tileattn's PyTorch engine (`backend="cpu"`) still runs every step of the online softmax
# as a separate tensor operation, and its native engine (`backend="native"`,
# `tileattn/backends/native/`) is the same algorithm written in C, compiled on first use for the
# machine's CPU and called through `ctypes`. This chapter measures why the second exists and builds
# its three parts in miniature, in C compiled here, by the machine's own compiler:
#
# 1. **where a tile's time goes** when every step is a torch call: the two matrix products against
#    the max / exp / sum / rescale passes between them;
# 2. **one fused pass** for those: a polynomial `exp2` (its accuracy in ulps against `torch.exp2`),
#    then max, `exp2` and sum in one sweep over the tile;
# 3. **a micro-GEMM**: how many accumulators a register block needs, its GFLOP/s against the
#    machine's measured FMA peak, and what `-march=native` changes;
#
# and then (4) runs the whole native engine against SDPA and the PyTorch engine, fp32 and bf16, where
# this CPU's AMX units enter.
#
# Everything runs on **one core** (`torch.set_num_threads(1)`): this chapter is about what one core
# does with its instructions, and threads multiply every contender alike. Micro-measurements use
# the thread's **CPU time** (like `benchmarks/bench_native.py --cpu-time`), which other jobs on a
# shared machine do not inflate; the engine comparison uses `tileattn.tools.measure`'s interleaved wall
# clock, like `tileattn bench`.

# %%
import atexit
import ctypes
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tileattn
from tileattn.tools import measure
from tileattn.core.testing import judge
from _hub import check, figure, pick, save_figure, seeded

torch.set_num_threads(1)
LOG2E, LN2 = 1.4426950408889634, 0.6931471805599453
flags = set(measure.cpu_flags())
print(f"CPU: {measure.cpu_model()}; {', '.join(f for f in measure.SIMD_FLAGS if f in flags) or 'no listed SIMD flags'}")
print(f"torch {torch.__version__}, {torch.get_num_threads()} thread")


def cpu_times(fns: dict, reps: int, iters: int = 1, stat=statistics.median) -> dict:
    """{name: seconds per call}, in this thread's CPU time: every repetition runs each function
    `iters` times in a row, the functions round-robin (as tileattn.tools.measure interleaves); the median
    of the repetitions, or `stat` of them (min: the best, for rates held against a peak)."""
    samples = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        fn()
    for rnd in range(reps):
        names = list(fns)
        names = names[rnd % len(names):] + names[:rnd % len(names)]
        for name in names:
            fn = fns[name]
            t0 = time.thread_time()
            for _ in range(iters):
                fn()
            samples[name].append((time.thread_time() - t0) / iters)
    return {name: stat(s) for name, s in samples.items()}


# %% [markdown]
# ## 1. Where a tile's time goes
#
# One step of tutorial 02's loop, in base 2 (the query block is pre-multiplied by
# `scale * log2(e)`, so `exp2` replaces `exp`), for a tile of `block_m` query rows and `block_n` keys:
#
# ```
# s     = q_blk @ k_blk.T                        GEMM 1: 2 * bm * bn * D flops
# m_new = maximum(m, s.amax(-1))                 \
# alpha = exp2(m - m_new)                         |  elementwise: 4 passes over the bm x bn tile
# p     = exp2(s - m_new)                         |  (max, subtract, exp2, sum), a few more over
# l     = alpha * l + p.sum(-1)                   |  vectors of bm values and the bm x D accumulator
# acc   = alpha * acc + p @ v_blk                GEMM 2: 2 * bm * bn * D flops
# ```
#
# Per score element the GEMMs do `4 D` flops (256 at `D = 64`), the passes between them about 4
# operations: under 2 % of the arithmetic. We time every one of the 13 torch calls of the step
# separately (inputs prepared beforehand), at three tile sizes: 64x64, 128x256 (the native engine's
# default tile) and 512x512 (the PyTorch engine's: it takes big tiles precisely to amortise the cost
# of each call). First, the step is checked: looping it over the key blocks is attention.

# %%
D = 64


def torch_step(q_blk, k_blk, v_blk, m, l, acc):
    """One online-softmax step of tutorial 02, base 2, every operation a torch call."""
    s = q_blk @ k_blk.T
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))
    alpha = torch.exp2(m - m_new)
    p = torch.exp2(s - m_new)
    l = alpha * l + p.sum(-1, keepdim=True)
    acc = alpha * acc + p @ v_blk
    return m_new, l, acc


def torch_forward(q, k, v, block_m, block_n):
    """FlashAttention forward of one head, (S, D) tensors, tiles of block_m x block_n."""
    out, lse = torch.empty_like(q), torch.empty(q.shape[0])
    for i0 in range(0, q.shape[0], block_m):
        q_blk = q[i0:i0 + block_m] * (q.shape[1] ** -0.5 * LOG2E)
        m = torch.full((q_blk.shape[0], 1), -math.inf)
        l, acc = torch.zeros_like(m), torch.zeros(q_blk.shape[0], v.shape[1])
        for j0 in range(0, k.shape[0], block_n):
            m, l, acc = torch_step(q_blk, k[j0:j0 + block_n], v[j0:j0 + block_n], m, l, acc)
        out[i0:i0 + block_m] = acc / l
        lse[i0:i0 + block_m] = ((m + torch.log2(l)) * LN2).squeeze(-1)
    return out, lse


S1 = pick(512, 1024)
q1, k1, v1 = (seeded(1, 1, S1, D, seed=i) for i in range(3))
oracle1, oracle1_lse = tileattn.reference(q1, k1, v1, compute_dtype=torch.float64, return_lse=True)
plain1 = tileattn.reference(q1, k1, v1)
out, lse = torch_forward(q1[0, 0], k1[0, 0], v1[0, 0], 128, 256)
verdict = judge("torch-ops forward", out[None, None], oracle1, plain1, torch.float32)
print(verdict)
check(verdict.ok and torch.allclose(lse.double(), oracle1_lse[0, 0], atol=1e-4),
      "the torch-ops tile step, looped over key blocks, is attention (2x rule; LSE matches)")

# %%
TILES = [(64, 64), (128, 256), (512, 512)]
tile_reps = pick(5, 9)


def tile_inputs(bm, bn, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_blk = torch.randn(bm, D, generator=g) * (D ** -0.5 * LOG2E)
    k_blk, v_blk = torch.randn(bn, D, generator=g), torch.randn(bn, D, generator=g)
    m = torch.randn(bm, 1, generator=g)  # the state a previous tile left
    return q_blk, k_blk, v_blk, m, torch.rand(bm, 1, generator=g) + 1, torch.randn(bm, D, generator=g)


def step_calls(bm, bn):
    """The 13 torch calls of one step, each on prepared inputs: (GEMM calls, elementwise calls)."""
    q_blk, k_blk, v_blk, m, l, acc = tile_inputs(bm, bn)
    s = q_blk @ k_blk.T
    row_max = s.amax(-1, keepdim=True)
    m_new = torch.maximum(m, row_max)
    alpha = torch.exp2(m - m_new)
    x = s - m_new
    p = torch.exp2(x)
    row_sum = p.sum(-1, keepdim=True)
    pv, a_l, a_acc = p @ v_blk, alpha * l, alpha * acc
    gemms = {"S = Q K^T": lambda: q_blk @ k_blk.T, "P V": lambda: p @ v_blk}
    elementwise = {
        "row max": lambda: s.amax(-1, keepdim=True), "maximum": lambda: torch.maximum(m, row_max),
        "m - m_new": lambda: m - m_new, "alpha = exp2": lambda: torch.exp2(m - m_new),
        "s - m_new": lambda: s - m_new, "p = exp2": lambda: torch.exp2(x), "row sum": lambda: p.sum(-1, keepdim=True),
        "alpha * l": lambda: alpha * l, "l + sum": lambda: a_l + row_sum,
        "alpha * acc": lambda: alpha * acc, "acc + P V": lambda: a_acc + pv,
    }
    return gemms, elementwise


one = torch.ones(1)
overhead = cpu_times({"exp2": lambda: torch.exp2(one), "add": lambda: one + one,
                      "maximum": lambda: torch.maximum(one, one)}, reps=tile_reps, iters=200)
per_call = statistics.median(overhead.values())
print(f"a torch call on a 1-element tensor: {', '.join(f'{n} {t * 1e6:.2f} us' for n, t in overhead.items())}")

profile = {}
for bm, bn in TILES:
    gemms, elementwise = step_calls(bm, bn)
    iters = max(2, int(2e5 / (bm * bn)))
    t = cpu_times({**gemms, **elementwise}, reps=tile_reps, iters=iters)
    t_gemm, t_elem = sum(t[n] for n in gemms), sum(t[n] for n in elementwise)
    profile[(bm, bn)] = dict(calls=t, gemm=t_gemm, elem=t_elem, n_elem=len(elementwise))
    n = bm * bn
    print(f"\ntile {bm}x{bn}, D={D}: GEMMs {t_gemm * 1e6:.1f} us ({4 * n * D / t_gemm / 1e9:.0f} GFLOP/s), "
          f"elementwise {t_elem * 1e6:.1f} us = {t_elem / (t_gemm + t_elem):.0%} of the step")
    print("   " + ", ".join(f"{name} {sec * 1e6:.1f}" for name, sec in t.items()) + "  (us)")
    print(f"   per score element: GEMMs {t_gemm / n * 1e9:.2f} ns, elementwise {t_elem / n * 1e9:.2f} ns "
          f"(exp2 alone {t['p = exp2'] / n * 1e9:.2f} ns); fixed cost of {len(elementwise)} calls "
          f"~{len(elementwise) * per_call * 1e6:.1f} us = {len(elementwise) * per_call / t_elem:.0%} of the "
          "elementwise time")

# %% [markdown]
# Reading the measurements (the full-size log is `docs/hub/logs/09.txt`):
#
# * **The GEMMs are ~98 % of the arithmetic and well under that share of the time.** The elementwise
#   passes, under 2 % of the arithmetic, take a third to a half of the step: per unit of work they
#   cost tens of times what the GEMMs do.
# * **Each pass is a trip through memory.** `s - m_new`, `exp2` and the reductions each read the
#   whole tile and most write a new one into a freshly allocated tensor: the tile streams through
#   the cache four to six times. A torch `exp2` is itself well vectorised; what costs is doing one
#   thing per pass.
# * **Each call has a fixed cost** (`per_call` above, under a microsecond: Python, the dispatcher,
#   `TensorIterator`, the output's allocation) before it touches an element. At 64x64 that is a large
#   part of the elementwise time; the PyTorch engine's 512x512 tiles shrink it, at the price of
#   tiles far bigger than L1 and, on the band of a causal mask, work wasted on hidden scores.
#
# What fixes all three at once is to do the elementwise work in **one pass, in registers**, with no
# call per operation: that needs code below PyTorch.

# %%
# The thresholds leave room for other CPUs (a slower GEMM library shrinks the passes' share) and
# for a loaded machine: each is several times below what any machine measured.
for (bm, bn), p_ in profile.items():
    share = p_["elem"] / (p_["gemm"] + p_["elem"])
    check(share >= 0.1, f"tile {bm}x{bn}: the elementwise passes take {share:.0%} of the step (>= 10 %) for under 2 % "
                        "of its arithmetic")
    per_work = (p_["elem"] / 4) / (p_["gemm"] / (4 * D))
    check(per_work > 5, f"tile {bm}x{bn}: per operation they cost {per_work:.0f}x what a GEMM flop costs (> 5x)")
small = profile[TILES[0]]
check(small["n_elem"] * per_call > 0.2 * small["elem"],
      f"tile {TILES[0][0]}x{TILES[0][1]}: the fixed cost of the {small['n_elem']} elementwise calls is "
      f"{small['n_elem'] * per_call / small['elem']:.0%} of their time (> 20 %)")

# %% [markdown]
# ## 2. A fused exp2 pass, in C
#
# ### exp2 from a polynomial
#
# Split `x = n + f` with `n = round(x)` and `|f| <= 1/2`. Then
#
# $$2^x = 2^n \cdot 2^f ,$$
#
# and both factors are cheap: `2^n` is a float whose exponent field is `n + 127` and whose mantissa
# is 0, so it is *built from bits* (`(n + 127) << 23`; AVX-512 has `vscalefps` for it, which the
# native engine uses); `2^f` on `[-1/2, 1/2]` is smooth and close to 1, so a low-degree polynomial
# `p(f)` approximates it to any accuracy we ask, evaluated by Horner's rule (one FMA per degree).
# Rounding to an integer is itself a trick: adding `1.5 * 2^23` to a float of magnitude below `2^22`
# makes the hardware round it to an integer (the sum has no bits left for a fraction), and that
# integer sits in the low bits of the sum's mantissa, exactly where `<< 23` moves it into an exponent
# field. Inputs below -127 are clamped to -127, whose exponent field is 0: the result is exactly 0,
# which is what `exp2(-inf)` of a masked score must give.
#
# How many degrees? An fp32 result has 24 significant bits; if `p`'s relative error is below half an
# ulp (`2^-24 = 6e-8`), the rounding of the arithmetic dominates and the result is within about an
# ulp. We fit `p` by least squares on Chebyshev nodes (nearly the minimax polynomial) and look at its
# error against `2^f` in float64:

# %%
def fit_exp2(degree, nodes=2000):
    """Coefficients c[0..degree] of p(f) ~ 2^f on [-1/2, 1/2], least squares in relative error."""
    t = torch.cos(math.pi * (torch.arange(nodes, dtype=torch.float64) + 0.5) / nodes) / 2
    vander = t[:, None] ** torch.arange(degree + 1, dtype=torch.float64) / torch.exp2(t)[:, None]
    return torch.linalg.lstsq(vander, torch.ones(nodes, 1, dtype=torch.float64)).solution[:, 0]


def poly_error(c):
    f = torch.linspace(-0.5, 0.5, 100_001, dtype=torch.float64)
    p = sum(ci * f ** i for i, ci in enumerate(c.tolist()))
    return float((p / torch.exp2(f) - 1).abs().max())


half_ulp = 2.0 ** -24
errors = {deg: poly_error(fit_exp2(deg)) for deg in range(2, 8)}
for deg, err in errors.items():
    print(f"degree {deg}: max relative error {err:.1e}{'  < half an fp32 ulp' if err < half_ulp else ''}")
DEGREE = min(d for d, e in errors.items() if e < half_ulp)
coef = fit_exp2(DEGREE).float().tolist()  # rounded to fp32, as the C code will hold them
check(DEGREE == 6 and errors[5] > half_ulp,
      f"degree {DEGREE} is the first below half an fp32 ulp ({errors[DEGREE]:.1e}; degree 5: {errors[5]:.1e})")
check(coef[0] == 1.0, "the constant coefficient rounds to exactly 1.0 in fp32, so 2^n comes out exact")

# %% [markdown]
# The native engine's `simd.h` has the same degree-6 polynomial (relative error 1.9e-9), and a
# degree-4 one (2.6e-6) for probabilities that are rounded to bf16 right after (a bf16 ulp is 2^-8).
#
# ### The C snippet
#
# Below, the whole of it: an instruction-set layer, `exp2` with the coefficients just fitted pasted
# in, the fused softmax step, and (for section 3) a micro-GEMM and an FMA loop. The vectors are GCC
# vector extensions (`vf`: 16 floats with AVX-512, 8 with AVX2, 4 with SSE2), so `+ - *` compile to
# the ISA's instructions and `a * b + c` contracts to an FMA where the ISA has one; the broadcast and
# the max go through intrinsics, as in the engine's `simd.h`.
#
# The fused pass uses the native engine's **transposed layout**: a tile of `n` keys x `M` query rows
# is stored key-major (`S[j * M + i]`: key `j`, row `i`), and a *panel* of 32 rows is two AVX-512
# vectors. Each row's running max and sum are then one *lane* of a vector: the softmax is vertical,
# with no reduction across lanes. Such a tile is what the GEMM `K Q^T` produces (rather than
# `Q K^T`). For each panel: one sweep for the max, one sweep (the panel is now in L1) computing
# `exp2(s - m_new)`, storing it and adding it into the sum, and the rescale factor
# `alpha = exp2(m_old - m_new)` for the caller's accumulator. One pass over the tile in memory,
# instead of four to six, and no per-operation call.

# %%
C_SOURCE = r"""
#include <stdint.h>
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 32")

/* --- the instruction-set layer: one vector register of VW floats ------------------------------ */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VBYTES 64
#define ISA "AVX-512"
#define SPLAT _mm512_set1_ps                 /* x -> all lanes */
#define VMAX _mm512_max_ps
#elif defined(__AVX2__)
#include <immintrin.h>
#define VBYTES 32
#define ISA "AVX2"
#define SPLAT _mm256_set1_ps
#define VMAX _mm256_max_ps
#elif defined(__SSE2__)
#include <immintrin.h>
#define VBYTES 16
#define ISA "SSE2"
#define SPLAT _mm_set1_ps
#define VMAX _mm_max_ps
#else                                        /* anything else: 16-byte vectors, portable code */
#define VBYTES 16
#define ISA "generic"
#endif
#define VW (VBYTES / 4)
typedef float vf __attribute__((vector_size(VBYTES)));
typedef int32_t vi __attribute__((vector_size(VBYTES)));
typedef uint32_t vu __attribute__((vector_size(VBYTES)));
typedef float vf_mem __attribute__((vector_size(VBYTES), aligned(4)));  /* unaligned loads, stores */
INLINE vf load(const float *p) { return *(const vf_mem *)p; }
INLINE void store(float *p, vf x) { *(vf_mem *)p = x; }
INLINE vf select_(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }
#ifdef SPLAT
INLINE vf splat(float x) { return SPLAT(x); }
INLINE vf vmax(vf a, vf b) { return VMAX(a, b); }
#else
INLINE vf splat(float x) { vf r; for (int i = 0; i < VW; i++) r[i] = x; return r; }
INLINE vf vmax(vf a, vf b) { return select_(a > b, a, b); }
#endif
const char *isa(void) { return ISA; }
int lanes(void) { return VW; }
int has_fma(void) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
    return 1;
#else
    return 0;
#endif
}

/* --- exp2: 2^x = 2^n * p(f), n = round(x), |f| <= 1/2 ----------------------------------------- */
INLINE vf exp2v(vf x) {
    x = vmax(x, splat(-127.0f));                 /* -127 and below: exponent field 0, so 2^n = 0 */
    vf t = x + 12582912.0f;                      /* + 1.5 * 2^23 rounds x to an integer n ...      */
    vf n = t - 12582912.0f;                      /* ... kept in the low bits of t's mantissa       */
    vf f = x - n;
    vf p = splat(@TOP@);                         /* p(f) ~ 2^f by Horner: one FMA per degree       */
@HORNER@    vu e = ((vu)t << 23) + (127u << 23);         /* (n + 127) << 23: the bits of the float 2^n     */
    return p * (vf)e;
}

void exp2_array(const float *x, float *y, int64_t count) {       /* count: a multiple of VW */
    for (int64_t i = 0; i < count; i += VW) store(y + i, exp2v(load(x + i)));
}

/* --- the fused online-softmax step ---------------------------------------------------------------
 * S: n keys x M rows, key-major (S[j * M + i]), base-2 logits; M a multiple of 32. Writes
 * P = 2^(S - m_new) (same layout), updates the running max m and sum l of every row and returns
 * alpha = 2^(m_old - m_new), the factor the caller rescales its accumulator by. */
#define PANEL 32
#define NV (PANEL / VW)                          /* vectors per panel row */
void softmax_step(const float *S, float *P, int64_t n, int64_t M, float *m, float *l, float *alpha) {
    for (int64_t i0 = 0; i0 < M; i0 += PANEL) {
        vf mx[NV], ref[NV], sum[NV];
        UNROLL for (int v = 0; v < NV; v++) mx[v] = load(m + i0 + v * VW);
        for (int64_t j = 0; j < n; j++)                                 /* sweep 1: the max */
            UNROLL for (int v = 0; v < NV; v++) mx[v] = vmax(mx[v], load(S + j * M + i0 + v * VW));
        UNROLL for (int v = 0; v < NV; v++) {
            ref[v] = select_(mx[v] == -__builtin_inff(), splat(0.0f), mx[v]);  /* no key seen yet: P = 0 */
            sum[v] = splat(0.0f);
        }
        for (int64_t j = 0; j < n; j++)                                 /* sweep 2: exp2, sum, store */
            UNROLL for (int v = 0; v < NV; v++) {
                vf p = exp2v(load(S + j * M + i0 + v * VW) - ref[v]);
                sum[v] += p;
                store(P + j * M + i0 + v * VW, p);
            }
        UNROLL for (int v = 0; v < NV; v++) {
            vf a = exp2v(load(m + i0 + v * VW) - ref[v]);
            store(alpha + i0 + v * VW, a);
            store(l + i0 + v * VW, a * load(l + i0 + v * VW) + sum[v]);
            store(m + i0 + v * VW, mx[v]);
        }
    }
}

/* --- the micro-GEMM: C (MR x NR) += A (MR x K) B (K x NR), C held in MR * NR/VW registers ---------
 * A packed by columns (A[k * MR + r]), B as K rows of NR floats. Per step of k: NR/VW loads of B,
 * MR broadcasts of A, MR * NR/VW independent FMAs. */
INLINE void micro(const int MR, const int NV_, int64_t K, const float *A, const float *B, float *C) {
    vf c[16][8];
    UNROLL for (int r = 0; r < MR; r++) UNROLL for (int v = 0; v < NV_; v++) c[r][v] = load(C + (r * NV_ + v) * VW);
    for (int64_t k = 0; k < K; k++) {
        vf b[8];
        UNROLL for (int v = 0; v < NV_; v++) b[v] = load(B + (k * NV_ + v) * VW);
        UNROLL for (int r = 0; r < MR; r++) {
            vf a = splat(A[k * MR + r]);
            UNROLL for (int v = 0; v < NV_; v++) c[r][v] = a * b[v] + c[r][v];   /* one FMA */
        }
    }
    UNROLL for (int r = 0; r < MR; r++) UNROLL for (int v = 0; v < NV_; v++) store(C + (r * NV_ + v) * VW, c[r][v]);
}
#define TILE(MR, NR) void gemm_##MR##x##NR(int64_t reps, int64_t K, const float *A, const float *B, float *C) \
    { for (int64_t i = 0; i < reps; i++) micro(MR, NR / VW, K, A, B, C); }
TILE(1, 16) TILE(2, 16) TILE(4, 16) TILE(6, 16) TILE(4, 32) TILE(8, 32) TILE(12, 32) TILE(16, 32)

/* --- this build's FMA peak: independent chains of vector FMAs (as many as the registers allow) ---- */
#define CHAINS (VBYTES == 64 ? 24 : 12)
int chains(void) { return CHAINS; }
float fma_loop(int64_t iters) {
    vf acc[CHAINS], x = splat(0.999f), y = splat(1e-3f);
    UNROLL for (int i = 0; i < CHAINS; i++) acc[i] = splat((float)i);
    for (int64_t it = 0; it < iters; it++)
        UNROLL for (int i = 0; i < CHAINS; i++) acc[i] = acc[i] * x + y;
    float s = 0;
    for (int i = 0; i < CHAINS; i++) for (int j = 0; j < VW; j++) s += acc[i][j];
    return s;
}
"""
C_SOURCE = C_SOURCE.replace("@TOP@", f"{coef[-1]!r}f").replace(
    "@HORNER@", "".join(f"    p = p * f + {c!r}f;\n" for c in reversed(coef[:-1])))
GEMM_TILES = [(1, 16), (2, 16), (4, 16), (6, 16), (4, 32), (8, 32), (12, 32), (16, 32)]


def find_compiler():
    """$CC, else the first of cc, gcc, clang on PATH (what tileattn's native build does), or None."""
    if os.environ.get("CC"):
        cmd = shlex.split(os.environ["CC"])
        return cmd if cmd and shutil.which(cmd[0]) else None
    return next(([name] for name in ("cc", "gcc", "clang") if shutil.which(name)), None)


BUILD_DIR = Path(tempfile.mkdtemp(prefix="tileattn-hub09-"))
atexit.register(shutil.rmtree, BUILD_DIR, True)  # the sources and libraries go when the tutorial ends


def compile_c(source, flags, name):
    """cc -O3 <flags> -shared: (ctypes library, seconds) or (None, the compiler's complaint)."""
    src, lib = BUILD_DIR / f"{name}.c", BUILD_DIR / f"lib{name}.so"
    src.write_text(source)
    cmd = CC + ["-O3", "-std=gnu11", "-fPIC", "-shared", "-Wno-psabi", *flags, str(src), "-o", str(lib)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if res.returncode != 0:
        return None, res.stderr.strip().splitlines()[-1:] or ["failed"]
    so = ctypes.CDLL(str(lib))
    so.isa.restype = ctypes.c_char_p
    so.fma_loop.restype = ctypes.c_float
    so.fma_loop.argtypes = [ctypes.c_int64]
    so.exp2_array.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    so.softmax_step.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
    for mr, nr in GEMM_TILES:
        getattr(so, f"gemm_{mr}x{nr}").argtypes = [ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
    print(f"  {' '.join(cmd[:1] + cmd[1:-3])} ... : {seconds:.2f} s, ISA {so.isa().decode()}, "
          f"{so.lanes()} floats per vector, FMA {'yes' if so.has_fma() else 'no'}")
    return so, seconds


def ptr(t):
    assert t.dtype == torch.float32 and t.is_contiguous()
    return ctypes.c_void_p(t.data_ptr())


CC = find_compiler()
if CC is None:
    print("\nNo C compiler found (tried $CC, cc, gcc, clang): the rest of this chapter compiles C, and the native\n"
          "engine needs one too. Install gcc or clang (or set $CC) and run it again. Skipping sections 2-4.")
    sys.exit(0)
version = subprocess.run(CC + ["--version"], capture_output=True, text=True).stdout.splitlines()
print(f"compiler: {' '.join(CC)} ({version[0] if version else 'unknown version'})")
native, native_seconds = compile_c(C_SOURCE, ["-march=native"], "hub09_native")
check(native is not None, f"the snippet compiles with -O3 -march=native in {native_seconds:.2f} s")

# %% [markdown]
# ### Accuracy against `torch.exp2`
#
# Over a million points of `[-126, 0]` (the range softmax logits minus their max live in), the error
# of each fp32 result against the exact `2^x` (float64), in units in the last place of the exact
# result rounded to fp32:

# %%
x = torch.linspace(-126.0, 0.0, pick(2**18, 2**20))
ours = torch.empty_like(x)
native.exp2_array(ptr(x), ptr(ours), x.numel())
exact = torch.exp2(x.double())
ulp = (torch.nextafter(exact.float(), torch.tensor(math.inf)) - exact.float()).double()
ulps_ours = float(((ours.double() - exact).abs() / ulp).max())
ulps_torch = float(((torch.exp2(x).double() - exact).abs() / ulp).max())
print(f"max error: ours {ulps_ours:.2f} ulp, torch.exp2 {ulps_torch:.2f} ulp")
check(ulps_ours <= 1.5, f"the polynomial exp2 is within {ulps_ours:.2f} ulp of exact (<= 1.5)")
special = torch.tensor([-math.inf, -1000.0, -200.0, -127.0, -126.0, -3.0, 0.0] + [0.0] * 9)
got = torch.empty_like(special)
native.exp2_array(ptr(special), ptr(got), special.numel())
check(got[:3].eq(0).all() and got[4:7].tolist() == [2.0 ** -126, 0.125, 1.0],
      "exp2(-inf) = exp2(-1000) = 0, and powers of two are exact")

# %% [markdown]
# ### The fused step against torch, and in a whole forward pass
#
# Two consecutive tiles (so the second has a running max to update and `alpha < 1` somewhere),
# compared with the same step done by torch operations:

# %%
def fused_step(s_t, m, l, alpha):
    """s_t: (n keys, M rows) key-major base-2 logits; returns P (n, M); m, l, alpha (M,) updated in place."""
    p_t = torch.empty_like(s_t)
    native.softmax_step(s_t.data_ptr(), p_t.data_ptr(), *s_t.shape, m.data_ptr(), l.data_ptr(), alpha.data_ptr())
    return p_t


M, n_keys = 128, 256
m, l, alpha = torch.full((M,), -math.inf), torch.zeros(M), torch.empty(M)
m_ref, l_ref = torch.full((M,), -math.inf), torch.zeros(M)
for step in range(2):
    s_t = seeded(n_keys, M, seed=10 + step, scale=2.0 + 3 * step)
    p_t = fused_step(s_t, m, l, alpha)
    m_new = torch.maximum(m_ref, s_t.amax(0))
    alpha_ref = torch.exp2(m_ref - m_new)
    p_ref = torch.exp2(s_t - m_new)
    l_ref = alpha_ref * l_ref + p_ref.sum(0)
    m_ref = m_new
    check(torch.equal(m, m_ref) and torch.allclose(alpha, alpha_ref, rtol=2e-7, atol=0)
          and torch.allclose(p_t, p_ref, rtol=3e-7, atol=0) and torch.allclose(l, l_ref, rtol=1e-6),
          f"tile {step + 1}: the fused C step gives torch's m, alpha, P and l (alpha < 1 in "
          f"{int((alpha < 1).sum())} rows)")

# %% [markdown]
# Now a whole forward pass of one head that uses it: torch does the two GEMMs in the transposed form
# (`S^T = K Q^T`, `acc^T += V^T P^T`), the C step everything between them.

# %%
def fused_forward(q, k, v, block_m=128, block_n=256):
    """One head, (S, D) fp32: torch GEMMs in the transposed layout, the C step between them."""
    S_, D_ = q.shape
    out, lse = torch.empty_like(q), torch.empty(S_)
    for i0 in range(0, S_, block_m):
        q_blk = q[i0:i0 + block_m] * (D_ ** -0.5 * LOG2E)
        M_ = q_blk.shape[0]
        m_, l_, alpha_ = torch.full((M_,), -math.inf), torch.zeros(M_), torch.empty(M_)
        acc_t = torch.zeros(v.shape[1], M_)
        for j0 in range(0, k.shape[0], block_n):
            p_t = fused_step(k[j0:j0 + block_n] @ q_blk.T, m_, l_, alpha_)
            acc_t.mul_(alpha_).addmm_(v[j0:j0 + block_n].T, p_t)
        out[i0:i0 + M_] = (acc_t / l_).T
        lse[i0:i0 + M_] = (m_ + torch.log2(l_)) * LN2
    return out, lse


out, lse = fused_forward(q1[0, 0], k1[0, 0], v1[0, 0])
verdict = judge("fused forward", out[None, None], oracle1, plain1, torch.float32)
print(verdict)
check(verdict.ok and torch.allclose(lse.double(), oracle1_lse[0, 0], atol=1e-4),
      "a forward pass with the fused C step is attention (2x rule; LSE matches)")

# %% [markdown]
# ### What fusing saves
#
# The fused step replaces the nine elementwise calls that touch the tile or the row statistics
# (`alpha * acc` and `+ P V` stay with the GEMM). Each is timed on a tile's worth of logits, one call
# per tile, and so is a whole forward pass of one head written each way.

# %%
fused_profile = {}
for bm, bn in TILES:
    gemms, elementwise = step_calls(bm, bn)
    torch_part = {n: f for n, f in elementwise.items() if n not in ("alpha * acc", "acc + P V")}
    s_t = seeded(bn, bm, seed=3, scale=3.0)
    m_c, l_c, alpha_c, p_c = torch.zeros(bm), torch.ones(bm), torch.empty(bm), torch.empty(bn, bm)
    args = (ptr(s_t), ptr(p_c), bn, bm, ptr(m_c), ptr(l_c), ptr(alpha_c))  # the pointers, taken once
    fns = {"fused": lambda: native.softmax_step(*args)}
    fns.update(torch_part)
    t = cpu_times(fns, reps=tile_reps, iters=max(2, int(2e5 / (bm * bn))))
    t_torch, t_fused = sum(t[n] for n in torch_part), t["fused"]
    fused_profile[(bm, bn)] = dict(torch=t_torch, fused=t_fused)
    print(f"tile {bm}x{bn}: {len(torch_part)} torch calls {t_torch * 1e6:.1f} us ({t_torch / (bm * bn) * 1e9:.2f} ns "
          f"per element), one fused C call {t_fused * 1e6:.1f} us ({t_fused / (bm * bn) * 1e9:.3f} ns): "
          f"{t_torch / t_fused:.1f}x")

S_fwd = pick(1024, 2048)
qf, kf, vf = (seeded(S_fwd, D, seed=20 + i) for i in range(3))
t_fwd = cpu_times({"torch ops": lambda: torch_forward(qf, kf, vf, 128, 256),
                   "fused step": lambda: fused_forward(qf, kf, vf, 128, 256)}, reps=pick(9, 7), stat=min)
print(f"one head, S={S_fwd}, D={D}, 128x256 tiles, fastest repetition: torch ops {t_fwd['torch ops'] * 1e3:.2f} ms, with the fused step "
      f"{t_fwd['fused step'] * 1e3:.2f} ms ({t_fwd['torch ops'] / t_fwd['fused step']:.2f}x)")

# %%
l1, l2 = measure.cache_size(1) or 32 * 1024, measure.cache_size(2) or 1024 * 1024
per_element = {t_: p_["fused"] / (t_[0] * t_[1]) for t_, p_ in fused_profile.items()}
for (bm, bn), p_ in fused_profile.items():
    panel, tile = bn * 32 * 4, 2 * bm * bn * 4  # bytes: one panel of logits; the tile's logits and P
    if panel <= l1 and tile < l2:
        check(p_["torch"] > 2 * p_["fused"],
              f"tile {bm}x{bn}: the fused pass is {p_['torch'] / p_['fused']:.1f}x faster than the torch calls it "
              f"replaces (> 2x; a panel is {panel // 1024} KiB, in L1; logits and P {tile // 1024} KiB, in L2)")
    else:
        # How much a tile beyond the caches costs depends on the memory system: measured, not claimed.
        ratio = per_element[(bm, bn)] / per_element[(128, 256)]
        print(f"tile {bm}x{bn}: the fused pass costs {ratio:.1f}x as much per element as at 128x256: a panel "
              f"({panel // 1024} KiB) against L1 ({l1 // 1024} KiB), logits and P ({tile // 1024} KiB) against L2 "
              f"({l2 // 1024} KiB)")
# In the whole forward the GEMMs (the same torch calls in both) are most of the time, so the fused
# step's gain there is small and, on a busy machine, within the noise: reported, not claimed.
print(f"the whole forward with the fused step: {t_fwd['torch ops'] / t_fwd['fused step']:.2f}x the torch-ops one")

fig, ax = figure(figsize=(7.5, 3.6))
labels = [f"{bm}x{bn}" for bm, bn in TILES]
for row, (key, name) in enumerate([("torch", "torch ops"), ("fused", "fused C pass")]):
    ys = [i * 3 + row for i in range(len(TILES))]
    gemm = [profile[t_]["gemm"] / (t_[0] * t_[1]) * 1e9 for t_ in TILES]
    between = [fused_profile[t_][key] / (t_[0] * t_[1]) * 1e9 for t_ in TILES]
    ax.barh(ys, gemm, color="#4c72b0", label="the two GEMMs (torch)" if row == 0 else None)
    ax.barh(ys, between, left=gemm, color="#dd8452" if row == 0 else "#55a868",
            label=f"max / exp2 / sum / rescale: {name}")
ax.set_yticks([i * 3 + r for i in range(len(TILES)) for r in (0, 1)])
ax.set_yticklabels([f"{lab}  {name}" for lab in labels for name in ("torch ops", "fused")])
ax.invert_yaxis()
ax.set(xlabel="ns per score element (one core)", title=f"one online-softmax step, D={D}")
ax.legend(fontsize=8, loc="lower right")
save_figure(fig, "09_tile_step.png")

# %% [markdown]
# ![time per score element of one step](../../docs/hub/09_tile_step.png)
#
# At full size on this machine (`docs/hub/logs/09.txt`) the fused pass took about 0.25-0.3 ns per
# score element against 0.8-1 ns for the torch calls: between 3x (512x512) and 8x (64x64, where the
# fixed cost of the calls dominates). The `exp2` inside it costs about as much as `torch.exp2`'s
# own (vectorised, Sleef-based) one; the gain is doing it in one pass with the max and the sum.
# The GEMMs are now most of the step, so they come next.
#
# ## 3. A micro-GEMM
#
# ### Register blocking
#
# A GEMM's inner loop, `c[r][j] += a[r][k] * b[k][j]`, is one FMA per multiply-add. This core can
# issue **two** vector FMAs per cycle, each with a **latency of 4 cycles**: to keep both units busy,
# 2 x 4 = **8 independent accumulations** must be in flight, and each needs its own register. The
# operands must come in too: at most two loads per cycle.
#
# So the kernel keeps a block of `MR x NR` results of C in registers (`MR * NR/VW` vectors) and, per
# step of `k`, loads `NR/VW` vectors of B, broadcasts `MR` values of A (a load each), and issues
# `MR * NR/VW` FMAs. With `VW = 16` (AVX-512) and 32 vector registers:
#
# | block MR x NR | accumulators | registers | loads per FMA | bound |
# |---|---:|---:|---:|---|
# | 1 x 16 | 1 | 3 | 2 | latency: 1 of 8 FMAs in flight, 1/8 of peak |
# | 2 x 16 | 2 | 4 | 1.5 | latency: 2/8 of peak |
# | 4 x 16 | 4 | 6 | 1.25 | latency: 4/8 of peak |
# | 6 x 16 | 6 | 8 | 1.17 | latency: 6/8 |
# | 4 x 32 | 8 | 11 | 0.75 | exactly 8 in flight: no slack for a late load |
# | 8 x 32 | 16 | 19 | 0.63 | compute |
# | 12 x 32 | 24 | 27 | 0.58 | compute: the native engine's block |
# | 16 x 32 | 32 | 35 | 0.56 | more registers than exist: it spills, unless the compiler takes operands straight from memory |
#
# With AVX2 (`VW = 8`, 16 registers) the same arithmetic gives the classic **6 x 16**: 12
# accumulators + 2 B vectors + 1 broadcast = 15 registers; 8 x 32 would need 32 accumulators.
#
# The micro-kernel is `micro()` in the snippet above. A is *packed* so that its `MR` values of one
# `k` are adjacent; B is `K` rows of `NR` floats. We run each block shape over `K = 128` (A and B
# stay in L1) many times, check the product against torch, and compare with the FMA peak measured by
# the native engine's probe (`kernels.fma_peak_gflops()`), and with this build's own FMA loop.

# %%
from tileattn.backends.native import checked, kernels as nk  # noqa: E402

K_GEMM = 128
flop_target = pick(4e7, 4e8)
ok, why = nk.available()
fma_peak = nk.fma_peak_gflops(1) if ok else float("nan")
print(f"measured fp32 FMA peak of one core (kernels.fma_peak_gflops, the engine's "
      f"{nk.build_info()['isa'] if ok else 'missing'} build): {fma_peak:.0f} GFLOP/s")


def gemm_rates(so):
    """{(MR, NR): GFLOP/s} of each micro-kernel of a build (thread CPU time, best of 3, as the probe), after
    checking that each computes C += A B."""
    rates, right = {}, []
    for mr, nr in GEMM_TILES:
        fn = getattr(so, f"gemm_{mr}x{nr}")
        a, b = seeded(K_GEMM, mr, seed=1), seeded(K_GEMM, nr, seed=2)  # a: A packed, a[k, r] = A[r, k]
        c = torch.zeros(mr, nr)
        fn(3, K_GEMM, ptr(a), ptr(b), ptr(c))  # three times C += A B
        right.append(torch.allclose(c, 3 * (a.T @ b), rtol=1e-5, atol=1e-4))
        reps = max(1, int(flop_target / (2 * mr * nr * K_GEMM)))
        args = (reps, K_GEMM, ptr(a), ptr(b), ptr(c))
        t = cpu_times({"gemm": lambda: fn(*args)}, reps=3, stat=min)["gemm"]
        rates[(mr, nr)] = 2 * mr * nr * K_GEMM * reps / t / 1e9
    check(all(right), f"{so.isa().decode()} build: all {len(GEMM_TILES)} micro-kernels compute C += A B "
                      "(against torch)")
    return rates


def own_peak(so):
    """GFLOP/s of the build's FMA loop (a multiply and an add where the ISA has no FMA)."""
    per_iter = 2 * so.chains() * so.lanes()
    iters = int(flop_target / per_iter)
    return per_iter * iters / cpu_times({"fma": lambda: so.fma_loop(iters)}, reps=3, stat=min)["fma"] / 1e9


native_rates, native_peak = gemm_rates(native), own_peak(native)
print(f"{native.isa().decode()} build (-march=native), own FMA loop {native_peak:.0f} GFLOP/s:")
for (mr, nr), r in native_rates.items():
    print(f"  {mr:>2} x {nr}: {r:6.1f} GFLOP/s = {r / native_peak:4.0%} of the build's FMA loop")

# %% [markdown]
# The table's predictions, measured (full size: `docs/hub/logs/09.txt`): on this AVX-512 core the
# single accumulator ran at about 1/8 of peak, each added row of accumulators added its share up to
# 8, the 8x32 and 12x32 blocks reached 85-90 % of the peak, and 16x32 fell back (spills). In
# another run 16x32 tied with them (99 %): x86 FMAs can read one operand from memory, so a compiler
# can do without the broadcast register and keep the 32 accumulators. Which of the three blocks wins
# is therefore a coin toss between compilers, CPUs and runs; what holds everywhere is that one
# accumulator is latency-bound (the ratio below is 1/8 : 4/8 with two FMA units, 1/4 : 4/4 with one,
# as on AMD Zen 4, which runs a 512-bit FMA as two 256-bit halves) and that the compute-bound blocks
# are among the fastest. Rates are compared with this build's own FMA loop, the same instructions.

# %%
if native.isa().decode() == "AVX-512":
    r = native_rates
    print(f"1x16 (one accumulator): {r[(1, 16)] / native_peak:.0%} of this build's FMA peak")
    check(r[(4, 16)] > 2.5 * r[(1, 16)],
          f"4 accumulators are {r[(4, 16)] / r[(1, 16)]:.1f}x one (> 2.5x): one accumulator is latency-bound")
    best = max(r, key=r.get)
    blocked = max(r[(8, 32)], r[(12, 32)])
    check(blocked > 0.6 * native_peak and blocked >= 0.85 * r[best],
          f"the better of 8x32 and 12x32 reaches {blocked / native_peak:.0%} of this build's FMA peak (> 60 %), "
          f"within 15 % of the fastest block ({best[0]}x{best[1]}, {r[best]:.0f} GFLOP/s)")
else:
    print(f"(the register-count checks are for AVX-512; this build is {native.isa().decode()})")

# %% [markdown]
# ### What `-march=native` changes
#
# Without `-march`, gcc targets the oldest x86-64: SSE2, 4 floats per vector, 16 registers, **no
# FMA** (a multiply and an add). `-march=native -mno-avx512f` gives AVX2 + FMA (8 floats, 16
# registers): what the native engine builds for CPUs without AVX-512. `-march=native` here gives
# AVX-512 (16 floats, 32 registers) and lets the compiler use every instruction this CPU has. The
# same snippet, compiled three ways:

# %%
VARIANTS = [("no -march", []), ("-march=native -mno-avx512f", ["-march=native", "-mno-avx512f"]),
            ("-march=native", ["-march=native"])]
builds = {}
for label, extra in VARIANTS:
    if extra == ["-march=native"]:
        so, secs = native, native_seconds  # built above
    else:
        so, secs = compile_c(C_SOURCE, extra, f"hub09_{len(builds)}")
    if so is None:
        print(f"  {label}: the compiler rejects it ({secs[0]}); skipped")
        continue
    if any(b["isa"] == so.isa().decode() for b in builds.values()):
        print(f"  {label}: same ISA as an earlier build; skipped")
        continue
    builds[label] = dict(so=so, isa=so.isa().decode(), fma=bool(so.has_fma()), seconds=secs)

x_big = seeded(pick(2**14, 2**16), scale=10.0) - 10
y_big = torch.empty_like(x_big)
bm, bn = 128, 256
s_t = seeded(bn, bm, seed=3, scale=3.0)
m_c, l_c, alpha_c, p_c = torch.zeros(bm), torch.ones(bm), torch.empty(bm), torch.empty(bn, bm)
step_args = (ptr(s_t), ptr(p_c), bn, bm, ptr(m_c), ptr(l_c), ptr(alpha_c))
exp2_args = (ptr(x_big), ptr(y_big), x_big.numel())
for label, b in builds.items():
    so = b["so"]
    if so is not native:
        b["rates"], b["peak"] = gemm_rates(so), own_peak(so)
    else:
        b["rates"], b["peak"] = native_rates, native_peak
    t = cpu_times({"exp2": lambda: so.exp2_array(*exp2_args), "step": lambda: so.softmax_step(*step_args)},
                  reps=tile_reps, iters=20)
    b["exp2_ns"], b["step_ns"] = t["exp2"] / x_big.numel() * 1e9, t["step"] / (bm * bn) * 1e9
t_torch_exp2 = cpu_times({"exp2": lambda: torch.exp2(x_big, out=y_big)}, reps=tile_reps, iters=20)["exp2"]
print(f"\n{'build':<28} {'ISA':>8} {'FMA':>4} {'own peak':>9} {'best block':>16} {'exp2':>10} {'fused step':>11}")
for label, b in builds.items():
    best = max(b["rates"], key=b["rates"].get)
    print(f"{label:<28} {b['isa']:>8} {'yes' if b['fma'] else 'no':>4} {b['peak']:>6.0f} GF "
          f"{best[0]:>3}x{best[1]:<3}{b['rates'][best]:>6.0f} GF {b['exp2_ns']:>6.3f} ns {b['step_ns']:>8.3f} ns")
print(f"{'torch.exp2':<28} {'':>8} {'':>4} {'':>9} {'':>16} {t_torch_exp2 / x_big.numel() * 1e9:>6.3f} ns")

# %% [markdown]
# Read across the rows (measured at full size in `docs/hub/logs/09.txt`):
#
# * **SSE2** (no `-march`): about 1/6 of the AVX-512 peak whatever the block: 4 lanes instead of 16
#   and no FMA. The block shape hardly matters when each "FMA" is two instructions.
# * **AVX2**: half the lanes, so half the peak on this core (two 512-bit FMA units); its best block
#   is one that fits 16 registers (6x16 or 4x16), and the 32-wide blocks spill.
# * **AVX-512**: the 8x32 and 12x32 blocks near the measured peak; `exp2` and the fused step about
#   twice as fast as with AVX2.
#
# How far apart the rows are depends on the core: AMD's Zen 4 executes a 512-bit FMA as two 256-bit
# halves, so its AVX-512 and AVX2 peaks are about the same (AVX-512 still brings 32 registers and
# masks). The checks below hold on either: every build's best block comes near its own FMA loop,
# the 16-register build cannot hold 16x32's 64 accumulators, and SSE2 without FMA is well behind.
#
# The same C, unchanged: the compiler and its target decide how much of the machine it uses. That is
# why tileattn compiles its kernels **on the machine that runs them** (`build.py`: `-march=native`,
# a cache keyed by the compiler and the ISA macros it enables) rather than shipping one binary built
# for the oldest x86-64.

# %%
by_isa = {b["isa"]: b for b in builds.values()}
for isa_name, b in by_isa.items():
    best_rate = max(b["rates"].values())
    check(best_rate > 0.6 * b["peak"],
          f"{isa_name} build: its best block reaches {best_rate / b['peak']:.0%} of its own FMA loop (> 60 %)")
if {"AVX-512", "AVX2"} <= by_isa.keys():
    best512 = max(by_isa["AVX-512"]["rates"].values())
    best256 = max(by_isa["AVX2"]["rates"].values())
    print(f"the AVX-512 build's best block is {best512 / best256:.1f}x the AVX2 build's (measured; about 2x with two "
          "512-bit FMA units, about 1x on Zen 4)")
    r2 = by_isa["AVX2"]["rates"]
    check(max(r2[(4, 16)], r2[(6, 16)]) > r2[(16, 32)],
          "with AVX2's 16 registers a 4x16 or 6x16 block beats 16x32 (64 accumulators: spilled)")
if "SSE2" in by_isa and "AVX-512" in by_isa:
    sse, avx = max(by_isa["SSE2"]["rates"].values()), max(by_isa["AVX-512"]["rates"].values())
    check(avx > 1.5 * sse, f"-march=native makes the micro-GEMM {avx / sse:.1f}x faster than the SSE2 baseline (> 1.5x)")
    check(by_isa["SSE2"]["exp2_ns"] > 1.5 * by_isa["AVX-512"]["exp2_ns"],
          f"and exp2 {by_isa['SSE2']['exp2_ns'] / by_isa['AVX-512']['exp2_ns']:.1f}x faster (> 1.5x)")

fig, ax = figure(figsize=(8.5, 3.8))
width = 0.8 / max(1, len(builds))
colors = {"SSE2": "#c44e52", "AVX2": "#dd8452", "AVX-512": "#4c72b0", "generic": "#8172b2"}
for i, (label, b) in enumerate(builds.items()):
    xs = [j + (i - (len(builds) - 1) / 2) * width for j in range(len(GEMM_TILES))]
    ax.bar(xs, [b["rates"][t_] for t_ in GEMM_TILES], width, color=colors.get(b["isa"]),
           label=f"{b['isa']} ({label}), own FMA loop {b['peak']:.0f}")
ax.axhline(fma_peak, color="k", ls="--", lw=1, label=f"measured FMA peak, one core ({fma_peak:.0f})")
ax.set_xticks(range(len(GEMM_TILES)))
ax.set_xticklabels([f"{mr}x{nr}" for mr, nr in GEMM_TILES])
ax.set(xlabel="register block MR x NR (floats)", ylabel="GFLOP/s (one core)",
       title=f"micro-GEMM, K={K_GEMM}, operands in L1")
ax.legend(fontsize=7, loc="upper left")
save_figure(fig, "09_micro_gemm.png")

# %% [markdown]
# ![micro-GEMM GFLOP/s against the register block, three builds](../../docs/hub/09_micro_gemm.png)
#
# The native engine's `gemm.h` is this kernel grown up: 12 x 32 blocks with AVX-512 (6 x 16
# otherwise), one fully unrolled variant per way of reading A (rows of K or V in place, columns of
# `V^T`, a tile's own panels) so that no operand is ever packed for fp32, and an epilogue that
# multiplies the scores by `scale * log2(e)` and folds their column max into the running tile max:
# for an interior tile the max sweep of section 2 disappears into the GEMM. Inside the forward pass
# its GEMMs run at ~88 % of peak and the softmax pass is ~12 % of the time (`docs/native.md`).
#
# ## 4. The whole engine
#
# `backend="native"` runs those kernels; `backend="cpu"` is the PyTorch-ops engine (big tiles, the
# augmented-operand trick of `tiles.py` that folds the subtraction of the max into the GEMM);
# `scaled_dot_product_attention` is PyTorch's own fused C++ kernel. Each is checked against the
# reference with FlashAttention's 2x rule at every shape, then all three are timed round-robin with
# `tileattn.tools.measure` (wall clock, one thread; the median of the repetitions, and their spread).

# %%
check(ok, f"the native engine is available here ({why or nk.build_info()['isa']})")
info = nk.build_info()
amx = bool(info["amx"])
print(f"native engine: {info['isa']} build, compiler {info['compiler_version']}, AMX {'on' if amx else 'off'}")
SHAPES = pick([(1, 4, 512, 64, False, torch.float32), (1, 4, 512, 64, True, torch.float32),
               (1, 4, 512, 128, False, torch.bfloat16)],
              [(1, 8, 1024, 64, False, torch.float32), (1, 8, 1024, 64, True, torch.float32),
               (1, 8, 2048, 128, False, torch.float32), (1, 8, 2048, 128, True, torch.float32),
               (1, 8, 2048, 128, False, torch.bfloat16)])
LABELS = {"native": "native (C)", "native, no AMX": "native, NO_AMX", "cpu": "PyTorch-ops engine", "sdpa": "SDPA"}


def engine_fns(q, k, v, causal):
    fns = {"native": lambda: tileattn.flash_attention(q, k, v, causal=causal, backend="native"),
           "cpu": lambda: tileattn.flash_attention(q, k, v, causal=causal, backend="cpu"),
           "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
    if q.dtype == torch.bfloat16 and amx:
        def no_amx():  # the same kernels on FMA units: bf16 tiles converted to fp32 (NO_AMX), no bf16 dot products
            out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
            checked.forward(q, k, v, out, lse, scale=q.shape[-1] ** -0.5, right=0 if causal else -1,
                            options=nk.NO_AMX | nk.NO_BF16DOT)
            return out
        fns["native, no AMX"] = no_amx
    return fns


results = []
for B, H, S, Dh, causal, dtype in SHAPES:
    q, k, v = (seeded(B, H, S, Dh, seed=30 + i, dtype=dtype) for i in range(3))
    oracle = tileattn.reference(q, k, v, causal=causal, compute_dtype=torch.float64)
    plain = tileattn.reference(q, k, v, causal=causal)
    fns = engine_fns(q, k, v, causal)
    name = f"{str(dtype).removeprefix('torch.')} H={H} S={S} D={Dh}{' causal' if causal else ''}"
    check(all(judge(e, fn(), oracle, plain, dtype).ok for e, fn in fns.items()),
          f"{name}: {', '.join(fns)} all pass the 2x rule")
    samples = measure.time_interleaved(fns, reps=pick(5, 7), warmup=1)
    flops = 4 * B * H * S * S * Dh * (0.5 if causal else 1.0)  # visible (query, key) pairs
    row = dict(name=name, dtype=dtype, causal=causal, flops=flops, fns=fns,
               ms={e: measure.median(x) * 1e3 for e, x in samples.items()},
               best={e: min(x) * 1e3 for e, x in samples.items()},
               spread={e: measure.spread_pct(x) for e, x in samples.items()})
    results.append(row)
    print(f"{name}:\n" + "\n".join(f"   {e:<15} {row['ms'][e]:8.2f} ms  {flops / row['ms'][e] / 1e6:4.0f} GFLOP/s  "
                                   f"spread {row['spread'][e]:3.0f}%" for e in fns))

# %%
# Each contender's fastest repetition, the one other jobs on a shared machine disturbed least; the
# table above and the figure show medians. Measurements, not checks: they depend on the build (an
# AVX2 or generic build of the engine, `TILEATTN_NATIVE_ISA`, is several times slower than this
# machine's AVX-512 one, while SDPA and the PyTorch-ops engine keep their vendor GEMMs), on the CPU
# and on the machine's load. `benchmarks/bench_native.py` is where speed is tracked.
for row in results:
    b = row["best"]
    print(f"{row['name']}: native {b['cpu'] / b['native']:.1f}x the PyTorch-ops engine's speed, "
          f"{b['sdpa'] / b['native']:.2f}x SDPA's")
fp32 = [r for r in results if r["dtype"] == torch.float32]
geo = math.exp(statistics.mean(math.log(r["best"]["sdpa"] / r["best"]["native"]) for r in fp32))
ratios = ", ".join(f"{r['best']['sdpa'] / r['best']['native']:.2f}x" for r in fp32)
print(f"fp32: native against SDPA (fastest repetitions), geometric mean {geo:.2f}x ({ratios}); "
      f"the engine's build: {info['isa']}")

# %% [markdown]
# With its AVX-512 build the native engine is on par with SDPA in fp32, and faster than the
# PyTorch-ops engine, whose elementwise passes and per-call costs section 1 measured. Measured at
# full size (`docs/hub/logs/09.txt`, one core): native against SDPA, geometric mean 0.97x over the
# four fp32 shapes (1.49x, 0.96x, 0.64x, 0.99x); native against the PyTorch-ops engine 1.0x to 3.2x in
# fp32 and 7x in bf16 (AMX).
#
# ### bf16 and AMX
#
# This Sapphire Rapids core has **AMX** (Advanced Matrix Extensions): eight *tile registers* of 16
# rows x 64 bytes and a unit that multiplies them. One `tdpbf16ps` instruction computes
# `C (16 x 16 fp32) += A (16 x 32 bf16) . B (32 x 16 bf16)`: 8192 multiply-adds, against 16 for one
# AVX-512 FMA. Even at one such instruction every 16 cycles that is 512 multiply-adds per cycle per
# core, 16x the FMA units' 32. The native engine runs every bf16 GEMM of the forward and backward
# passes on AMX tiles (`amx.h`; the option `NO_AMX` gives the same kernels on the FMA units, with
# the bf16 tiles converted to fp32). PyTorch's SDPA reaches AMX too: its bf16 CPU kernel calls
# oneDNN's brgemm, which picks AMX on a CPU that has it. The evidence, in this thread's CPU time:
# both run **above the fp32 FMA peak**, which no FMA code can do, and the same native kernels
# without AMX fall well below it.

# %%
lowp = [r for r in results if r["dtype"] == torch.bfloat16]
if amx and lowp:
    row = lowp[0]
    t = cpu_times({e: row["fns"][e] for e in ("native", "native, no AMX", "sdpa")}, reps=pick(3, 5), stat=min)
    rate = {e: row["flops"] / sec / 1e9 for e, sec in t.items()}
    print(f"{row['name']}, thread CPU time (best of the repetitions): "
          + ", ".join(f"{e} {r:.0f} GFLOP/s" for e, r in rate.items()) + f"; fp32 FMA peak {fma_peak:.0f}")
    check(rate["native"] > 1.5 * rate["native, no AMX"],
          f"AMX makes the native bf16 forward {rate['native'] / rate['native, no AMX']:.1f}x faster than FMA tiles "
          "(> 1.5x)")
    check(rate["native"] > fma_peak and rate["sdpa"] > fma_peak > rate["native, no AMX"],
          f"native bf16 ({rate['native']:.0f}) and SDPA bf16 ({rate['sdpa']:.0f} GFLOP/s) exceed the fp32 FMA peak "
          f"({fma_peak:.0f}), the same kernels without AMX do not ({rate['native, no AMX']:.0f}): both run on AMX")
else:
    print("no AMX here (or no bf16 shape): bf16 runs on the FMA units; skipped")

# %%
colors = {"native": "#4c72b0", "native, no AMX": "#8172b2", "cpu": "#dd8452", "sdpa": "#55a868"}
panels = [(rows, title) for rows, title in ((fp32, "fp32"), (lowp, "bf16")) if rows]
fig, axes = figure(1, len(panels), figsize=(11, 3.9), squeeze=False,
                   gridspec_kw=dict(width_ratios=[len(rows) for rows, _ in panels]))
for ax, (rows, title) in zip(axes[0], panels):
    engines = list(rows[0]["fns"])
    w = 0.8 / len(engines)
    for i, e in enumerate(engines):
        xs = [j + (i - (len(engines) - 1) / 2) * w for j in range(len(rows))]
        ax.bar(xs, [r["flops"] / r["ms"][e] / 1e6 for r in rows], w, color=colors[e], label=LABELS[e])
    ax.axhline(fma_peak, color="k", ls="--", lw=1, label=f"fp32 FMA peak ({fma_peak:.0f})")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["name"].split(" ", 1)[1].replace(" S=", "\nS=").replace(" causal", ", causal")
                        for r in rows], fontsize=8)
    ax.set(title=f"{title} forward, B=1, one core", ylabel="GFLOP/s (visible pairs)")
    ax.legend(fontsize=7)
save_figure(fig, "09_engines.png")

# %% [markdown]
# ![native, PyTorch-ops engine and SDPA, fp32 and bf16](../../docs/hub/09_engines.png)
#
# What the engine adds to this chapter's pieces (all in `docs/native.md`): the fused pass rescales
# the accumulator only for rows whose max grew by more than 8 (FlashAttention-4's rule: the running
# max may lag, `2^8` fits easily in fp32); the `exp2` uses `vscalefps` and masks underflowing lanes
# to 0 (an underflowing `vscalefps` takes a slow microcode assist); tasks of one kv head stack its
# GQA query heads as lanes, so K and V tiles are read once; OpenMP threads take whole tasks, so the
# result is bitwise the same for any thread count; and the library is built once per machine and
# compiler, in a cache, under a lock.
#
# ## Exercises
#
# 1. Fit a degree-4 polynomial, paste it into the snippet and measure its ulps and its speed. Why is
#    it good enough for probabilities that are rounded to bf16 next (what is a bf16 ulp)?
# 2. Make the fused step *one* sweep: compute `exp2(s - m_old)` and the tile max together, and only
#    if some row's max grew by more than 8 redo that panel against the new max (the engine's AMX
#    path does this). How often is the redo taken after the first tile of random scores?
# 3. Compile the snippet with `-S` and find `gemm_16x32`'s inner loop: where do the spilled
#    accumulators go? Do the same for the SSE2 build's `exp2v`: where did the FMAs go?
# 4. Fold `acc^T *= alpha` into the C step (it needs the accumulator and `D`). How much of the
#    remaining gap between `fused_forward` and the native engine does it close? What is left?
# 5. Compile the snippet with `-march=native -mprefer-vector-width=256`, then write `exp2_array` as
#    a plain scalar loop and let gcc vectorise it (hint: `-fno-trapping-math`). Which vector width
#    does gcc pick for this CPU on its own, and what does it cost?
# 6. Rerun section 4 with `torch.set_num_threads(2)`. Which engine gains the most from the second
#    core, and why does the PyTorch-ops engine gain the least (section 1: which of its calls are
#    too small to split)?
