# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 03 · The backward pass
#
# Training needs `dQ, dK, dV` from `dO` (the gradient flowing into the output). Autograd on naive
# attention saves the `S x S` probability matrix `P` for this. FlashAttention saves only
# `q, k, v, out` and the per-row log-sum-exp `lse` from tutorial 02, and **recomputes** each tile
# of `P` when it needs it: `P_ij = exp(s_ij - lse_i)`, a single subtraction, no second softmax.
#
# With `s = scale * Q K^T`, `P = softmax(s)`, `O = P V`, the chain rule gives, per tile:
#
# | quantity | formula | why |
# |---|---|---|
# | `dV` | `P^T dO` | `O` is linear in `V` |
# | `dP` | `dO V^T` | `O` is linear in `P` |
# | `dS` | `P * (dP - Delta)`, `Delta_i = sum_d dO_id O_id` | softmax Jacobian, row by row |
# | `dQ` | `scale * dS K` | `s` is linear in `Q` |
# | `dK` | `scale * dS^T Q` | `s` is linear in `K` |
#
# The softmax Jacobian needs `sum_j P_ij dP_ij` per row; expanding `dP = dO V^T` shows it equals
# `sum_d dO_id O_id`, which is cheap to compute once from `O` and `dO` (FlashAttention-2's trick):
# no pass over all keys is needed before the tiles can be processed.

# %%
import math

import torch

import tileattn
from tileattn.core.testing import check_against_reference, judge
from _hub import MiB, check, pick, seeded

B, H, S, D = 1, 2, pick(128, 512), 32
scale = D ** -0.5
q, k, v = (seeded(B, H, S, D, seed=i) for i in range(3))
dout = seeded(B, H, S, D, seed=9)


# %% [markdown]
# ## Forward (from tutorial 02, compact) and the tiled backward

# %%
def tiled_forward(q, k, v, scale, block=32):
    out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=q.dtype)
    for i0 in range(0, q.shape[2], block):
        qb = q[:, :, i0:i0 + block] * scale
        m = torch.full(qb.shape[:-1] + (1,), -math.inf, dtype=q.dtype)
        l, acc = torch.zeros_like(m), torch.zeros(qb.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
        for j0 in range(0, k.shape[2], block):
            s = qb @ k[:, :, j0:j0 + block].transpose(-1, -2)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new)
            l = alpha * l + p.sum(-1, keepdim=True)
            acc = alpha * acc + p @ v[:, :, j0:j0 + block]
            m = m_new
        out[:, :, i0:i0 + block] = acc / l
        lse[:, :, i0:i0 + block] = (m + torch.log(l)).squeeze(-1)
    return out, lse


def tiled_backward(q, k, v, out, lse, dout, scale, block=32):
    """dQ, dK, dV from the saved (q, k, v, out, lse): P is recomputed tile by tile, never stored."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (dout * out).sum(-1, keepdim=True)  # Delta_i = rowsum(dO * O)
    for i0 in range(0, q.shape[2], block):
        rows = slice(i0, i0 + block)
        for j0 in range(0, k.shape[2], block):
            cols = slice(j0, j0 + block)
            s = (q[:, :, rows] @ k[:, :, cols].transpose(-1, -2)) * scale
            p = torch.exp(s - lse[:, :, rows, None])  # recomputation from the LSE
            dv[:, :, cols] += p.transpose(-1, -2) @ dout[:, :, rows]
            dp = dout[:, :, rows] @ v[:, :, cols].transpose(-1, -2)
            ds = p * (dp - delta[:, :, rows])
            dq[:, :, rows] += scale * ds @ k[:, :, cols]
            dk[:, :, cols] += scale * ds.transpose(-1, -2) @ q[:, :, rows]
    return dq, dk, dv


# %% [markdown]
# ## Check against autograd on the exact reference
# The fp64 reference differentiated by autograd is the oracle; plain fp32 math is the yardstick.

# %%
def reference_grads(dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    o = tileattn.reference(*leaves, compute_dtype=dtype)
    return torch.autograd.grad(o, leaves, dout.to(dtype))


g64, g32 = reference_grads(torch.float64), reference_grads(torch.float32)
out, lse = tiled_forward(q, k, v, scale)
ours = tiled_backward(q, k, v, out, lse, dout, scale)
for name, a, oracle, plain in zip(("dq", "dk", "dv"), ours, g64, g32):
    v_ = judge(name, a, oracle, plain, torch.float32)
    print(v_)
    check(v_.ok, f"our tiled {name} passes the 2x accuracy rule")

# %% [markdown]
# ## gradcheck
# `torch.autograd.gradcheck` compares analytic gradients with finite differences, which needs
# fp64. We wrap our two functions in an `autograd.Function` (saving exactly what FlashAttention
# saves) and check them, then check `tileattn.flash_attention` itself (its CPU engine runs fp64).

# %%
class TutorialAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = tiled_forward(q, k, v, q.shape[-1] ** -0.5, block=4)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return tiled_backward(q, k, v, out, lse, dout, q.shape[-1] ** -0.5, block=4)


small = [seeded(1, 2, 10, 8, seed=i, dtype=torch.float64).requires_grad_() for i in range(3)]
check(torch.autograd.gradcheck(TutorialAttention.apply, small), "gradcheck passes for the tutorial's forward/backward")
check(torch.autograd.gradcheck(lambda a, b, c: tileattn.flash_attention(a, b, c, causal=True), small),
      "gradcheck passes for tileattn.flash_attention (causal, fp64)")

# %%
verdicts = check_against_reference(tileattn.flash_attention, q, k, v, grad=True)
print(*verdicts, sep="\n")
check(all(x.ok for x in verdicts), "tileattn's out, dq, dk, dv all pass the 2x rule")

# %% [markdown]
# ## What each method keeps for the backward
# `torch.autograd.graph.saved_tensors_hooks` lets us see every tensor autograd stores between the
# forward and the backward. We add up their sizes.

# %%
def saved_bytes(fn):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*leaves)
    return sum(total)


def naive(q, k, v):
    return ((q @ k.transpose(-1, -2)) * scale).softmax(-1) @ v


naive_saved, flash_saved = saved_bytes(naive), saved_bytes(tileattn.flash_attention)
print(f"naive attention saves {naive_saved / MiB:.2f} MiB, tileattn saves {flash_saved / MiB:.2f} MiB")
check(naive_saved >= B * H * S * S * 4, "naive autograd keeps at least one S x S matrix")
check(flash_saved <= 4 * B * H * S * D * 4 + B * H * S * 4 + 4096, "tileattn keeps only q, k, v, out and lse (O(S*D))")

# %% [markdown]
# The price of recomputation is one extra `Q K^T` per tile in the backward (about 2.5x the forward
# FLOPs in total instead of 2x); the reward is that training memory grows linearly in `S`.
#
# ## Exercises
#
# 1. In `tiled_backward`, the query-block loop is outside. Which of `dq`, `dk`, `dv` would two
#    threads processing different query blocks both write to? How does FlashAttention-2 avoid
#    atomics there (hint: swap the loops for `dk, dv`)?
# 2. Derive `sum_j P_ij dP_ij = sum_d dO_id O_id` from `O = P V`.
# 3. Add causal masking to both functions (set `s` to `-inf` where `j > i`) and re-run gradcheck.
