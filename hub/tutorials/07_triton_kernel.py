# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 07 · Writing the kernel in Triton
#
# Tutorials 02-04 wrote FlashAttention with PyTorch tensor operations. On a GPU (or an Ascend NPU
# through triton-ascend) the same algorithm is written as a **kernel**: a function that one
# *program* (a GPU thread block) runs for one query block, with explicit loads from and stores to
# global memory. Triton is the shortest way to write one in Python.
#
# No GPU here? Triton has an interpreter that runs kernels on CPU tensors with NumPy, one program
# after the other: slow, but exact enough to check a kernel. It is switched on by the environment
# variable `TRITON_INTERPRET=1`, which Triton reads when `@triton.jit` decorates a kernel, so we set
# it before importing anything that defines kernels.

# %%
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import tileattn  # noqa: E402
from tileattn.core.testing import judge  # noqa: E402
from _hub import check, pick, seeded  # noqa: E402

# %% [markdown]
# ## The kernel
#
# One program handles `BLOCK_M` query rows of one (batch, head). It loads its query block once,
# then walks over the key blocks with the online softmax of tutorial 02, in base 2: the scale is
# multiplied by `log2(e)` once so that `exp2` (cheaper in hardware) replaces `exp`.
#
# Three details every real kernel has:
# * **bounds masks**: `S` need not be a multiple of the block, and `D` need not be a power of two
#   (`tl.arange` needs one), so loads are masked and padded, and padded keys get score `-inf`;
# * **causal skipping**: with `CAUSAL`, the loop stops at the last key block the query block can
#   see (tutorial 04), and the diagonal block is masked element-wise;
# * **strides**: the kernel receives every tensor's strides, so it reads any layout without copies.

# %%
@triton.jit
def attention_fwd_kernel(
    Q, K, V, Out, Lse,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    H, S, D, scale_log2,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    block = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // H
    h = batch_head % H
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols_d = tl.arange(0, BLOCK_D)
    row_ok = rows < S
    d_ok = cols_d < D

    q_ptrs = Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + cols_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Causal: key blocks past the last row of this query block are never loaded.
    end = tl.minimum((block + 1) * BLOCK_M, S) if CAUSAL else S
    for start in range(0, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < S
        k = tl.load(K + b * stride_kb + h * stride_kh + keys[:, None] * stride_ks + cols_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + b * stride_vb + h * stride_vh + keys[:, None] * stride_vs + cols_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale_log2  # base-2 logits, fp32
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        m = m_new

    out = acc / l[:, None]
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_os + cols_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    # Natural-log LSE (what the backward pass needs): (m + log2 l) * ln 2.
    tl.store(Lse + batch_head * S + rows, (m + tl.log2(l)) * 0.6931471805599453, mask=row_ok)


def triton_attention(q, k, v, causal=False, block_m=16, block_n=16):
    """Launch the kernel on (B, H, S, D) tensors whose last dim is contiguous; returns (out, lse)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"argument '{name}': last dim must be contiguous (stride 1), got stride {t.stride(-1)}")
    B, H, S, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((B, H, S), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(S, block_m), B * H)
    attention_fwd_kernel[grid](
        q, k, v, out, lse,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        H, S, D, D ** -0.5 * 1.4426950408889634,
        CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(D),
    )
    return out, lse


# %% [markdown]
# ## Checking it against the reference
# The interpreter runs one program at a time, so we keep the shapes tiny. We test the awkward
# cases on purpose: `S` not a multiple of the block, `D` not a power of two, causal, fp16.

# %%
cases = [
    dict(B=1, H=2, S=pick(48, 128), D=32, causal=False, dtype=torch.float32),
    dict(B=2, H=1, S=pick(37, 100), D=40, causal=True, dtype=torch.float32),
    dict(B=1, H=2, S=pick(40, 96), D=16, causal=True, dtype=torch.float16),
]
for case in cases:
    B, H, S, D, causal, dtype = (case[x] for x in ("B", "H", "S", "D", "causal", "dtype"))
    q, k, v = (seeded(B, H, S, D, seed=i, dtype=dtype) for i in range(3))
    out, lse = triton_attention(q, k, v, causal=causal)
    oracle, oracle_lse = tileattn.reference(q, k, v, causal=causal, compute_dtype=torch.float64, return_lse=True)
    plain = tileattn.reference(q, k, v, causal=causal)
    verdict = judge("out", out, oracle, plain, dtype)
    print(case, verdict)
    check(verdict.ok, f"Triton kernel passes the 2x rule: S={S} D={D} causal={causal} {dtype}")
    check(torch.allclose(lse.double(), oracle_lse, atol=1e-4), "Triton kernel's LSE matches the reference")

# %% [markdown]
# ## Strided inputs
# A `(B, S, H, D)` tensor viewed as `(B, H, S, D)` by `transpose(1, 2)` is not contiguous, but its
# last dimension is: the kernel reads it through the strides, no copy.

# %%
x = seeded(1, 40, 2, 32, seed=7)
qt = x.transpose(1, 2)
out, _ = triton_attention(qt, qt, qt)
verdict = judge("strided", out, tileattn.reference(qt, qt, qt, compute_dtype=torch.float64), tileattn.reference(qt, qt, qt), torch.float32)
check(not qt.is_contiguous() and verdict.ok, "a transposed (non-contiguous) view gives the right answer")

# %% [markdown]
# ## From here to tileattn's Triton engine
# `tileattn/backends/triton/` is this kernel grown up: the same loop plus GQA, masks, bias, ALiBi,
# softcap, dropout, variable length, a backward pass in two kernels (dK/dV and dQ, no atomics) and
# block sizes from `tileattn tune`. On a GPU, `tileattn.flash_attention` picks it automatically; on
# the CPU it runs only when asked (`backend="triton"`) under the interpreter, as here.
#
# ## Exercises
#
# 1. Change `BLOCK_M`/`BLOCK_N` to 32: the results must not change. On a GPU they change the speed
#    (tutorial 06).
# 2. The causal loop still masks element-wise in blocks fully below the diagonal. Split the loop in
#    two stages (off-diagonal without a mask, diagonal with one) like Triton's fused-attention
#    tutorial.
# 3. Add `window_left`: which key blocks can the loop skip at the *start*?
