# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 12 · Context parallelism: one sequence, many devices
#
# FlashAttention removed the `S x S` score matrix from memory (tutorial 01), and with it the first
# wall long sequences hit. It did not remove the sequence itself: Q, K, V, the
# output and everything a model keeps for its backward still grow like `S`, and at 128k-1M tokens
# that is more than one device holds. *Context parallelism* splits the sequence over `W` devices
# ("ranks"). Every per-token layer (norms, MLPs, projections) runs on its shard unchanged; only
# attention needs every key, so only attention talks to the other ranks.
#
# This chapter builds the two ways of doing that on top of tutorial 11's LSE merge:
#
# * **ring attention**: queries stay, K/V shards travel around the ranks, and each step's partial
#   result `(out, lse)` is merged exactly; the backward needs no merge at all;
# * **Ulysses**: one all-to-all trades "all heads of `S/W` tokens" for "`H/W` heads of all tokens",
#   and attention runs locally.
#
# We build a ring by hand in one process and check it against `tileattn.reference`, then run
# `tileattn.distributed` on real processes (gloo on this CPU, NCCL on GPUs: the same code),
# balance the causal work with the zigzag placement, count every byte the ranks send against the
# analytic model, and read off when each method wins on a cluster.

# %% [markdown]
# ## Why one device is not enough
# Take a Llama-3-8B-shaped model: 32 layers, 32 query heads over 8 kv heads (GQA), head dim 128,
# bf16 (`e = 2` bytes). Per token and layer, attention's own tensors are
#
# ```
# K, V       2 * Hkv * D * e  =  4 KiB     (the KV cache of inference)
# Q, out     2 * H   * D * e  = 16 KiB     (kept for the backward in training, with K and V)
# LSE        H * 4            = 128 B      (fp32, one per row and head)
# ```
#
# and the score matrix, which FlashAttention never builds, would be `S^2` entries *per head*. Below,
# the sizes at 128k-1M tokens, computed from the shapes (meta tensors: shapes without storage), next
# to an H200's 141 GB (131 GiB).

# %%
import math
import statistics

import torch

import tileattn
import tileattn.distributed as cp
from tileattn.distributed import model
from tileattn.core.testing import judge
from _cp_ranks import four_ranks, inputs, spawn, two_ranks
from _hub import check, figure, pick, save_figure

GiB = float(2**30)
H200 = 141e9 / GiB
LAYERS, H_LLAMA, HKV_LLAMA, D_LLAMA = 32, 32, 8, 128


def nbytes(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta").nbytes


print(f"{'tokens':>7} {'scores, 1 head':>15} {'K/V, 32 layers':>15} {'q,k,v,out,lse x 32':>19} "
      f"{'that, per rank of 8':>20}")
sizes = {}
for S in (2**17, 2**18, 2**19, 2**20):
    scores = nbytes(S, S, dtype=torch.float32)
    kv = LAYERS * 2 * nbytes(1, HKV_LLAMA, S, D_LLAMA)
    kept = LAYERS * (2 * nbytes(1, H_LLAMA, S, D_LLAMA) + 2 * nbytes(1, HKV_LLAMA, S, D_LLAMA)
                     + nbytes(1, H_LLAMA, S, dtype=torch.float32))
    sizes[S] = (scores, kv, kept)
    print(f"{S // 1024:>6}k {scores / GiB:>11.0f} GiB {kv / GiB:>11.0f} GiB {kept / GiB:>15.0f} GiB "
          f"{kept / 8 / GiB:>16.0f} GiB")
check(sizes[2**17][0] == 64 * GiB, "one head's fp32 score matrix at 128k tokens would be 64 GiB: it never exists")
check(sizes[2**20][1] == 128 * GiB and sizes[2**20][1] / GiB > 0.95 * H200,
      f"at 1M tokens K and V of 32 layers alone are 128 GiB, {sizes[2**20][1] / GiB / H200:.0%} of an H200")
check(sizes[2**17][2] / GiB < H200 < sizes[2**18][2] / GiB,
      "what attention keeps for the backward (q, k, v, out, lse of 32 layers) outgrows an H200 between 128k and "
      "256k tokens, before counting the MLPs")
mlp = LAYERS * 3 * nbytes(1, 2**20, 14336)  # Llama-3-8B's MLP keeps gate, up and their product
check(mlp / sizes[2**20][2] > 4, f"the MLPs keep {mlp / sizes[2**20][2]:.1f}x as much again (1M tokens: "
      f"{mlp / GiB:.0f} GiB), unless recomputed")
check(sizes[2**20][2] / 32 < 0.2 * H200 * GiB, f"all of it is per token: over 32 ranks, 1M tokens leave "
      f"{sizes[2**20][2] / 32 / GiB:.0f} GiB of attention tensors on each")

# %% [markdown]
# These are floors: the layer's input, norms and MLP activations come on top. The cure for all of it
# is the same: give each rank `S/W` tokens. Per-token layers then cost `1/W` of the memory and
# compute; what remains is attention, where every query needs every key.
#
# ## The merge, once more
# Tutorial 11 split the keys of a row into parts `A` and `B` and showed that the two partial results
# combine exactly through their LSEs. With `W` parts the same algebra gives
#
# ```
# L = log sum_w exp(L_w)                   o = sum_w exp(L_w - L) o_w
# ```
#
# Three properties make this the engine of ring attention:
#
# 1. **It is exact**: no approximation, only the rounding of a few fp32 operations per row.
# 2. **It is associative and commutative** (`logaddexp` is), so parts may arrive in any order and be
#    folded in one at a time: `(o, L) <- merge((o, L), (o_w, L_w))` as each arrives. That is the
#    online softmax of tutorial 02, with a *device's shard of keys* where tutorial 02 had a tile.
# 3. **Empty parts are harmless**: a row that sees none of a part's keys (causal: keys after it) has
#    `L_w = -inf` and weight 0 (tutorial 11 checked this).
#
# ## A ring by hand
# Give each of `W` ranks a contiguous shard of the sequence: rank `r` holds queries, keys and
# values of tokens `[r S/W, (r+1) S/W)`. At step `i` rank `r` holds the K/V shard of rank
# `(r - i) mod W` (its own at step 0); it computes its queries against it, folds the result into its
# running `(out, lse)`, and passes the shard on to rank `r + 1`. After `W` steps every query has met
# every key.
#
# Each (query shard, key shard) pair sits somewhere relative to the causal diagonal. Query row `i` of
# a shard starting at `q_pos` is token `q_pos + i`; key row `j` of a shard at `k_pos` is token
# `k_pos + j`; causal visibility `k_pos + j <= q_pos + i` is `j <= i + off` with `off = q_pos - k_pos`,
# which is exactly `tileattn`'s `align=off` (query `i` aligned with key `i + off`). So a pair is
#
# * **skipped** if every key comes after every query,
# * **full** if no key comes after any query (no mask needed: plain attention),
# * **partial** otherwise (`causal=True, align=off`).
#
# `cp.block_kind` returns that classification and `off`. We simulate the `W` ranks one after another
# in this process, with the same tensors the real processes will use later (`_cp_ranks.inputs`).

# %%
W = 4
S, H, HKV, D = pick(256, 1024), 4, 2, 32
q, k, v, dout, dlse = inputs(S, H, HKV, D)
shard_of = [(r * S // W, S // W) for r in range(W)]  # (first token, length) of rank r's shard


def rows(x, r):
    """Rank r's tokens of a (B, H, S, ...) tensor."""
    first, n = shard_of[r]
    return x[:, :, first:first + n]


def ring_steps(r):
    """(source rank, kind, off) of each step of rank r: the K/V shard it holds and how to compute it."""
    for step in range(W):
        src = (r - step) % W
        yield (src,) + cp.block_kind(*shard_of[r], *shard_of[src], causal=True)


def ring_forward_by_hand(q, k, v):
    outs, lses, calls = [], [], []
    for r in range(W):
        out = lse = None
        calls.append(0)
        for src, kind, off in ring_steps(r):
            if kind == "skip":
                continue
            o, l = tileattn.attention_partial(rows(q, r), rows(k, src), rows(v, src), causal=kind == "partial",
                                              align=off)
            out, lse = (o, l) if out is None else tileattn.merge_attentions([out, o], [lse, l])
            calls[-1] += 1
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2), calls


def rule(name, result, oracle, plain, dtype=torch.float32):
    """FlashAttention's accuracy rule (tutorial 05): error <= 2x that of plain math in ``dtype``."""
    verdict = judge(name, result, oracle, plain, dtype)
    print(" ", verdict)
    return verdict.ok


def reference_with_grads(q, k, v, dout, dlse, dtype):
    """out, lse, dq, dk, dv of the whole causal attention (loss = out . dout + lse . dlse)."""
    leaves = [t.to(dtype, copy=True).requires_grad_() for t in (q, k, v)]
    o, l = tileattn.reference(*leaves, causal=True, return_lse=True)
    grads = torch.autograd.grad((o * dout.to(dtype)).sum() + (l * dlse.to(dtype)).sum(), leaves)
    return (o.detach(), l.detach()) + grads


NAMES = ("out", "lse", "dq", "dk", "dv")
oracle = reference_with_grads(q, k, v, dout, dlse, torch.float64)
plain = reference_with_grads(q, k, v, dout, dlse, torch.float32)

out, lse, calls = ring_forward_by_hand(q, k, v)
check(rule("out", out, oracle[0], plain[0]) and rule("lse", lse, oracle[1], plain[1]),
      f"a {W}-rank ring by hand (attention_partial per step, merge_attentions) equals causal attention")
check(calls == [1, 2, 3, 4], f"engine calls per rank {calls}: rank r skips the {W - 1} - r shards after its own")
reverse = [tileattn.attention_partial(rows(q, W - 1), rows(k, src), rows(v, src), causal=src == W - 1)
           for src in range(W)]
merged_at_once, _ = tileattn.merge_attentions([o for o, _ in reverse], [l for _, l in reverse])
check(float((merged_at_once - rows(out, W - 1)).abs().max()) < 1e-5,
      "the last rank's 4 parts merged all at once, in the opposite order, agree with the ring's step-by-step merge")

# %% [markdown]
# ## The ring's backward: no merge, just the global statistics
# Tutorial 03's backward recomputes each probability from the row's LSE, `P_ij = exp(s_ij - L_i)`,
# and uses one more number per row, `Delta_i = rowsum(dO_i * O_i)`:
#
# ```
# dV_j += sum_i P_ij dO_i        dS_ij = P_ij (dO_i . v_j - Delta_i)        dQ_i += scale sum_j dS_ij k_j
# dK_j += scale sum_i dS_ij q_i
# ```
#
# With the *global* `L_i` and `O_i` (the merged ones), `P_ij` of a shard's key is already its final
# probability, so each (query shard, key shard) pair contributes its exact share of every gradient,
# independently of the others: FlashAttention-2's ring backward. (With an LSE gradient `dL_i`,
# tutorial 11's `Delta_i - dL_i` replaces `Delta_i`.) `tileattn.attention_backward` takes exactly
# these inputs. The ring then walks again: `dQ` of a rank's queries accumulates where it is, while the
# `dK`, `dV` of a key shard accumulate in a buffer that *travels with the shard* and, after `W` sends,
# arrives back at the rank that owns those keys.

# %%
dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
for r in range(W):
    for src, kind, off in ring_steps(r):
        if kind == "skip":
            continue
        g = tileattn.attention_backward(rows(dout, r), rows(q, r), rows(k, src), rows(v, src), rows(out, r),
                                        rows(lse, r), dlse=rows(dlse, r), causal=kind == "partial", align=off)
        rows(dq, r).add_(g.dq)
        rows(dk, src).add_(g.dk)  # in the real ring: into the buffer travelling with shard src
        rows(dv, src).add_(g.dv)
check(all([rule(n, a, b, c) for n, a, b, c in zip(NAMES[2:], (dq, dk, dv), oracle[2:], plain[2:])]),
      "the hand ring's backward (attention_backward per step, from the merged out and LSE) gives dq, dk, dv")

# %% [markdown]
# ## On real processes
# `tileattn.distributed` is that ring, plus what the hand version leaves out: K/V shards move with
# `torch.distributed` point-to-point sends (`batch_isend_irecv`), the *next* shard is already in flight
# while a rank computes on the current one, the merge is done in place in fp32 (`cp.merge_into`), the
# `dK`/`dV` accumulators travel in fp32, and every wait is bounded by a timeout so a failed rank ends
# the others instead of hanging them. On each rank:
#
# ```python
# q, k, v = (cp.shard(t, seq_dim=2) for t in (q_full, k_full, v_full))    # this rank's tokens
# out, lse = cp.context_parallel_attention(q, k, v, causal=True, mode="ring", return_lse=True)
# ```
#
# We start 2 processes joined in a gloo group with `tileattn.distributed.launch.run_local` (what
# `torchrun` would do, without a launcher). Starting processes is the expensive part, so **one group
# runs every 2-process experiment of this chapter**, in `_cp_ranks.two_ranks`, and we read the
# results section by section. Each rank shards the same full tensors as above, runs forward and
# backward, and returns its shards put back together (`cp.unshard`) with a count of every message it
# sent (`cp.count_collectives`). All judging happens here, against the reference. (`cp.shard` cuts
# the sequence with the zigzag placement explained in the next section; `ring_contiguous` uses the
# hand ring's contiguous shards.)

# %%
WORLD = 2
cfg = dict(S=S, H=H, Hkv=HKV, D=D, S_time=pick(4096, 8192), H_time=4, Hkv_time=2, D_time=64, reps=5)
ranks = spawn(two_ranks, WORLD, cfg)
got = ranks[0]  # rank 0's copy of the unsharded results (every rank holds the same)
for name in ("ring", "ring_contiguous"):
    res = got[name]
    check(all([rule(n, res[n], a, b) for n, a, b in zip(NAMES, oracle, plain)]),
          f"{name} on {WORLD} gloo processes: out, lse, dq, dk, dv pass the 2x rule against the one-process reference")
check([r["ring"]["local_tokens"] for r in ranks] == [S // WORLD] * WORLD,
      f"each rank held {S // WORLD} of the {S} tokens")
sent = [{key: n for (op, key), n in r["ring"][p]["messages"].items() if op == "send"} for r in ranks
        for p in ("fwd", "bwd")]
print("ring, messages sent per rank (forward, backward):", sent[:2])
check(all(s == ({"kv": WORLD - 1} if i % 2 == 0 else {"kv": WORLD - 1, "dkv": WORLD}) for i, s in enumerate(sent)),
      f"every rank sent {WORLD - 1} K/V shard forward; backward {WORLD - 1} K/V shard and {WORLD} dK/dV buffers "
      "(the last send brings each buffer home)")

# %% [markdown]
# ## Causal imbalance and the zigzag placement
# The hand ring's call count `[1, 2, 3, 4]` is the problem in one line. Under a causal mask a query
# at position `p` sees `p + 1` keys, so with contiguous shards the last rank does almost all the
# work: rank `r` of `W` computes `r` full pairs and one diagonal (half) pair, `r + 1/2` units, and
# rank `W - 1` does `2W - 1` times the work of rank 0. A ring step ends when its slowest rank ends,
# so the others wait.
#
# **Zigzag** (head-tail; PyTorch's load balancer, ring-flash-attention's `zigzag`): cut the sequence
# into `2W` chunks and give rank `r` chunks `r` and `2W - 1 - r`, one from the cheap head and one
# from the expensive tail. Chunk `c` costs `c + 1/2` units, so rank `r` does
# `(r + 1/2) + (2W - 1 - r + 1/2) = 2W` units: the same for every rank. Counted token by token (a
# query at `p` costs `p + 1` visible keys), with `cp.zigzag_chunks`, the placement
# `tileattn.distributed` uses:

# %%
def visible_pairs(seq_len, world, load_balance):
    """Causal (query, key) pairs each rank computes: sum of p + 1 over the positions it holds."""
    return [sum(n * (first + 1) + n * (n - 1) // 2 for first, n in cp.zigzag_chunks(seq_len, world, r, load_balance))
            for r in range(world)]


for world in (2, 4, 8):
    contiguous, zigzag = visible_pairs(2**16, world, False), visible_pairs(2**16, world, True)
    check(abs(max(contiguous) / min(contiguous) - (2 * world - 1)) < 0.01 and len(set(zigzag)) == 1,
          f"W={world}, 64k tokens: contiguous, the busiest rank does {max(contiguous) / min(contiguous):.3f}x the "
          f"least busy (2W - 1 = {2 * world - 1}); zigzag, every rank the same {zigzag[0]:.3g} pairs")
odd = visible_pairs(2**16 - 1, 4, True)
check(max(odd) / min(odd) < 1.001, f"with an odd length (65535 over 4) zigzag ranks differ by {max(odd) - min(odd)} "
      "pairs of 5e8: the chunks differ by at most one token")

# %% [markdown]
# The picture, for `W = 4` ranks and the `2W = 8` chunks of the zigzag cut: each cell is a (query
# chunk, key chunk) pair, coloured by the rank that computes it (the rank holding the queries), solid
# when full, hatched when diagonal (half the work), blank when skipped; the number is the ring step
# at which the keys arrive. Counting a full cell as 1 and a diagonal one as 1/2, contiguously rank 3
# does 14 of the 32 units and rank 0 two; zigzag gives each rank 8, and 2 in every step
# (`cp.block_kind` decides each cell, as in the ring).

# %%
GRID_W = 4
CHUNKS = 2 * GRID_W


def grid(load_balance, seq_len=CHUNKS * 64):
    """{(query chunk, key chunk): (rank, kind, step)} for the 2W-chunk cut."""
    size = seq_len // CHUNKS
    owner = {}
    for r in range(GRID_W):
        for first, n in cp.zigzag_chunks(seq_len, GRID_W, r, load_balance):
            for c in range(first // size, (first + n) // size):
                owner[c] = r
    cells = {}
    for qc in range(CHUNKS):
        for kc in range(CHUNKS):
            kind, _ = cp.block_kind(qc * size, size, kc * size, size, causal=True)
            cells[(qc, kc)] = (owner[qc], kind, (owner[qc] - owner[kc]) % GRID_W)
    return cells


def work_units(cells):
    per_rank = [0.0] * GRID_W
    for rank, kind, _ in cells.values():
        per_rank[rank] += {"full": 1.0, "partial": 0.5, "skip": 0.0}[kind]
    return per_rank


grids = {"contiguous": grid(False), "zigzag": grid(True)}
units = {name: work_units(cells) for name, cells in grids.items()}
print("work units per rank (full pair = 1, diagonal = 1/2):", units)
check(units["contiguous"] == [2.0, 6.0, 10.0, 14.0] and units["zigzag"] == [8.0] * GRID_W,
      "contiguous: 2, 6, 10, 14 units (7x from first to last); zigzag: 8 each")
per_step = {}
for rank, kind, step in grids["zigzag"].values():
    per_step[(rank, step)] = per_step.get((rank, step), 0.0) + {"full": 1.0, "partial": 0.5, "skip": 0.0}[kind]
check(set(per_step.values()) == {2.0}, "zigzag: every rank does 2 units in every one of the 4 steps, so no step "
      "waits for a slower rank")

# %% [markdown]
# **Measured.** The 2-process group ran causal ring attention, forward and backward, with both
# placements (`cfg["S_time"]` tokens, 4 heads over 2 kv heads, D = 64, one thread per rank). A rank's
# *work* is the CPU time of its compute thread (it waits for messages without using the CPU), and
# the time it spent *blocked* waiting for the other rank is counted by `cp.count_collectives`. Wall
# time on this shared 2-core machine mostly measures who else was running, so it is printed, not
# relied on.

# %%
busy = {}
for name in ("contiguous", "zigzag"):
    busy[name] = [statistics.median(cpu for _, cpu, _ in r["busy"][name]) for r in ranks]
    wall = [statistics.median(w for w, _, _ in r["busy"][name]) for r in ranks]
    waited = [statistics.median(x for _, _, x in r["busy"][name]) for r in ranks]
    print(f"{name:>10}: CPU s per rank {[round(x, 3) for x in busy[name]]}, blocked s {[round(x, 3) for x in waited]},"
          f" wall s {[round(x, 3) for x in wall]}")
ratio_contiguous = busy["contiguous"][1] / busy["contiguous"][0]
ratio_zigzag = max(busy["zigzag"]) / min(busy["zigzag"])
check(ratio_contiguous > 1.5, f"contiguous: rank 1 works {ratio_contiguous:.2f}x as long as rank 0 (counted: 3x)")
check(ratio_zigzag < 1.2, f"zigzag: the two ranks' work differs by {ratio_zigzag:.2f}x (counted: 1x)")
gain = max(busy["contiguous"]) / max(busy["zigzag"])
check(gain > 1.1, f"the busiest rank, which sets the step time, works {gain:.2f}x less with zigzag (counted: "
      "6/4 = 1.5x)")

# %% [markdown]
# The measured ratios sit below the counted ones because the engine's cost is not proportional to
# visible pairs. In blocks of `S/4` tokens, contiguous rank 1 computes 5 full blocks and 2 diagonal
# ones, rank 0 one full and 2 diagonal, a zigzag rank 3 full and 2 diagonal. A diagonal block costs
# more than the half block of useful work it holds (its diagonal tiles are masked element by element
# and cost as much as full tiles), say `d` full blocks: the contiguous imbalance is `(5 + 2d) /
# (1 + 2d)` (3 at `d = 1/2`, 2.3 at `d = 1`) and zigzag's gain `(5 + 2d) / (3 + 2d)` (1.5 down to 1.4);
# fixed per-call costs (zigzag makes twice the calls here) shave off a little more at small sizes.
# Zigzag gives both ranks the same mix of blocks, so it stays balanced whatever they cost.
#
# `tileattn.distributed` does one more thing the count above hides: in a zigzag step after the first,
# a rank's two full pairs share a query chunk or a key chunk and are joined into **one** engine call.
#
# ## Ulysses: trade the sequence for the heads
# Attention is independent per head. If a rank held *all* `S` tokens of `H/W` heads instead of all
# heads of `S/W` tokens, it could run ordinary attention with no communication at all. DeepSpeed
# Ulysses does that swap with one **all-to-all**: rank `r` cuts its `(B, H, S/W, D)` shard into `W`
# head groups and sends group `u` to rank `u`; rank `u` receives `W` pieces of `(B, H/W, S/W, D)`
# and concatenates them along the sequence. Four all-to-alls forward (q, k, v in; out back, and the
# LSE when it is returned), four backward (their gradients), each keeping `1/W` of the tensor at home
# and sending the rest.
#
# Constraints fall out of the shapes:
#
# * **`H % W == 0`**: heads are the unit of work, so `W <= H` (32 ranks at most for Llama-3-8B);
# * **GQA**: rank `u`'s query heads `[u H/W, (u+1) H/W)` read kv heads `h // (H/Hkv)`; with
#   `Hkv % W == 0` each rank gets its `Hkv/W` kv heads and nothing is repeated. With fewer kv heads
#   than ranks (MQA: 1) the kv heads are repeated to `lcm(Hkv, W)` first, the least that gives each
#   rank whole kv heads; their gradients are summed back;
# * **placement**: the gathered tokens arrive rank by rank; with zigzag shards they are sorted into
#   sequence order before attention and unsorted after.
#
# By hand, in one process, for 2 ranks with the zigzag placement, and with GQA (2 kv heads) and MQA
# (1 kv head, repeated):

# %%
def ulysses_by_hand(q, k, v, world):
    heads_kv = k.shape[1]
    repeat = world // math.gcd(heads_kv, world)
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)  # to lcm(Hkv, W) kv heads
    index = [torch.cat([torch.arange(a, a + n) for a, n in cp.zigzag_chunks(q.shape[2], world, r)])
             for r in range(world)]
    local = [[x[:, :, index[r]] for x in (q, k, v)] for r in range(world)]  # rank r: all heads, its tokens
    order = torch.argsort(torch.cat(index))  # gathered rank by rank -> sequence order
    head_outs = []
    for u in range(world):  # all-to-all, sequence -> heads: rank u receives head group u of every rank
        q_u, k_u, v_u = (torch.cat([x[i].chunk(world, dim=1)[u] for x in local], dim=2)[:, :, order] for i in range(3))
        head_outs.append(tileattn.flash_attention(q_u, k_u, v_u, causal=True))  # all tokens, H/W heads
    out_shards = [torch.cat([o[:, :, index[r]] for o in head_outs], dim=1) for r in range(world)]  # heads -> sequence
    out = torch.empty_like(q)
    for r in range(world):
        out[:, :, index[r]] = out_shards[r]
    return out, repeat


for heads_kv in (2, 1):
    kk, vv = k[:, :heads_kv].contiguous(), v[:, :heads_kv].contiguous()
    u_out, repeat = ulysses_by_hand(q, kk, vv, WORLD)
    u_oracle = tileattn.reference(q, kk, vv, causal=True, compute_dtype=torch.float64)
    check(rule("out", u_out, u_oracle, tileattn.reference(q, kk, vv, causal=True)),
          f"Ulysses by hand, {H} query heads over {heads_kv} kv heads on {WORLD} ranks (kv heads repeated "
          f"{repeat}x): two all-to-alls around plain attention equal causal attention")

# %% [markdown]
# The same on the 2 processes (`mode="ulysses"`, run in the group above), with 2 kv heads and with
# MQA; and the error a head count the group does not divide gets, raised on every rank before any
# compute (after which the group is still usable):

# %%
check(all([rule(n, got["ulysses"][n], a, b) for n, a, b in zip(NAMES, oracle, plain)]),
      "Ulysses on 2 processes: out, lse, dq, dk, dv pass the 2x rule")
mqa_inputs = inputs(S, H, 1, D, seed=2)
mqa_oracle = reference_with_grads(*mqa_inputs, torch.float64)
mqa_plain = reference_with_grads(*mqa_inputs, torch.float32)
check(all([rule(n, got["ulysses_mqa"][n], a, b) for n, a, b in zip(NAMES, mqa_oracle, mqa_plain)]),
      "Ulysses with one kv head on 2 processes (repeated to 2, gradients summed back): all five pass")
uly = {key: n for (op, key), n in got["ulysses"]["fwd"]["messages"].items() if op == "all_to_all"}
uly_bwd = {key: n for (op, key), n in got["ulysses"]["bwd"]["messages"].items() if op == "all_to_all"}
print("Ulysses all-to-alls, forward:", uly, " backward:", uly_bwd)
check(set(uly) == {"q", "k", "v", "out", "lse"} and set(uly_bwd) == {"grad_" + x for x in uly},
      "Ulysses forward: one all-to-all each for q, k, v (in) and out, lse (back); backward: their gradients")
print(" ", got["heads_error"]["message"])
check("3 query heads for 2 Ulysses ranks" in got["heads_error"]["message"] and got["heads_error"]["usable"],
      "3 heads on 2 Ulysses ranks: a ValueError naming the argument on every rank; the group stays usable")

# %% [markdown]
# **Hybrid.** Ulysses stops at `W = H` ranks and needs fast all-to-all (the GPUs of one node); the
# ring has no head limit. USP's 2-D arrangement uses both: Ulysses inside each group of `U` ranks
# (a node), a ring across the `R` groups. After the inner all-to-all a ring rank holds `H/U` heads of
# `U` ranks' tokens, so the outer ring moves blocks `U` times smaller. The zigzag cut over `2W`
# chunks, grouped by Ulysses group, is the zigzag cut over `2R` chunks, so the outer ring is balanced
# too. A second group of 4 processes runs ring, Ulysses and a 2 x 2 hybrid:

# %%
ranks4 = spawn(four_ranks, 4, cfg)
for name in ("ring", "ulysses", "hybrid"):
    check(all([rule(n, ranks4[0][name][n], a, b) for n, a, b in zip(NAMES, oracle, plain)]),
          f"{name} on 4 processes{' (2 x 2 mesh)' if name == 'hybrid' else ''}: out, lse, dq, dk, dv pass the 2x rule")

# %% [markdown]
# ## Communication against compute
# **What each rank sends, per layer** (fp32 here: `e = 4`; the dK/dV accumulators always travel in
# fp32, `a = 4`). A K/V shard is `2 (S/W) Hkv D` elements.
#
# * Ring: forward `W - 1` K/V shards; backward `W - 1` K/V shards and `W` dK/dV buffers:
#   `2 (S/W) Hkv D ((W-1)(2e) + W a)`, about `2 S Hkv D (2e + a)`: **independent of `W`**. More
#   ranks shorten each step's compute but not what every rank must send.
# * Ulysses: each of the 8 all-to-alls sends `(W-1)/W` of a local tensor:
#   `2 (S/W) (2H + 2Hkv') D e (W-1)/W` with `Hkv' = lcm(Hkv, W)`: **falls as `1/W`**.
#
# `tileattn.distributed.model` has these formulas (`python -m tileattn.distributed.model` prints its
# cluster table). The counts from the processes must equal them to the byte:

# %%
shape = model.Shape(S, H, HKV, D, batch=1, elem_bytes=4, acc_bytes=4)


def sent_bytes(res, ops=("send", "all_to_all"), skip=("lse", "grad_lse")):
    """Bytes one rank sent in a forward + backward, by the given operations (not the call check)."""
    return sum(n for p in ("fwd", "bwd") for (op, key), n in res[p]["bytes"].items() if op in ops and key not in skip)


measured = {}
for world, group in ((2, ranks), (4, ranks4)):
    for name in ("ring", "ulysses") + (("hybrid",) if world == 4 else ()):
        measured[(name, world)] = [sent_bytes(r[name]) for r in group]
want = {("ring", 2): model.ring_bytes(shape, 2), ("ring", 4): model.ring_bytes(shape, 4),
        ("ulysses", 2): model.ulysses_bytes(shape, 2), ("ulysses", 4): model.ulysses_bytes(shape, 4),
        ("hybrid", 4): sum(model.hybrid_bytes(shape, 2, 2))}
for key, per_rank in measured.items():
    print(f"  {key[0]:>7}, W={key[1]}: sent per rank {per_rank} bytes, model {want[key]:.0f}")
check(all(x == want[key] for key, per_rank in measured.items() for x in per_rank),
      "every rank of ring (W=2, 4), Ulysses (W=2, 4) and hybrid (2 x 2) sent exactly the model's bytes")
q_traffic = [sent_bytes(group[0]["ulysses"], skip=("k", "v", "grad_k", "grad_v", "lse", "grad_lse"))
             for group in (ranks, ranks4)]
check(measured[("ring", 4)][0] / measured[("ring", 2)][0] == 1.25 and q_traffic[1] / q_traffic[0] == 0.75
      and measured[("ulysses", 4)][0] == measured[("ulysses", 2)][0],
      "from 2 to 4 ranks the ring's traffic per rank grows 1.25x (towards 2 S Hkv D (2e + a)); Ulysses' q and out "
      "traffic falls 0.75x ((W-1)/W^2), but its total stays put: 4 ranks repeat the 2 kv heads to 4")

# %% [markdown]
# **When the ring hides its transfer.** While a rank computes on one K/V shard the next is in flight,
# so a step costs `max(compute, transfer)`. Causal and zigzag, a step is half of a `(S/W) x (S/W)`
# pair of blocks, `2 (S/W)^2 H D` FLOPs, against `2 (S/W) Hkv D e` bytes. With `F` FLOP/s and a link
# of `B` bytes/s, compute covers the transfer when
#
# ```
# 2 (S/W)^2 H D / F  >=  2 (S/W) Hkv D e / B      <=>      S/W  >=  e Hkv F / (H B)
# ```
#
# a number of **tokens per rank**, independent of `S` and `W` separately. Below it the step time is
# the transfer, `2 S Hkv D e / B` per layer whatever `W`: adding ranks stops helping. For the
# Llama-3-8B layer on the model's illustrative cluster (400 TFLOP/s attention, 50 GB/s per GPU
# across nodes, 450 GB/s NVLink), and for this machine (F and B measured by the 2 processes above):

# %%
llama = model.Shape(2**17, H_LLAMA, HKV_LLAMA, D_LLAMA)
across = model.ring_hides_transfer_from(llama, model.FLOPS, model.NIC)
within = model.ring_hides_transfer_from(llama, model.FLOPS, model.NVLINK)
print(f"Llama-3-8B layer: the ring hides its K/V transfer from {across:.0f} tokens per rank across nodes, "
      f"{within:.0f} on NVLink")
compute_s, transfer_s = model.step_times(model.Shape(int(across) * 32, H_LLAMA, HKV_LLAMA, D_LLAMA), 32, model.FLOPS,
                                         model.NIC)
check(abs(compute_s / transfer_s - 1) < 1e-9, f"at {across:.0f} tokens per rank a step's compute and transfer both "
      f"take {compute_s * 1e6:.0f} us")
check(round(across) == 4000 and 2**17 // 32 >= across > 2**17 // 64,
      "128k tokens: the ring alone stays overlapped up to 32 GPUs (4096 tokens each), not at 64 (2048)")
machine = ranks[0]["machine"]
here = 4 * cfg["Hkv_time"] * machine["flops"] / (cfg["H_time"] * machine["bytes_per_s"])
print(f"this machine: attention {machine['flops'] / 1e9:.1f} GFLOP/s on one thread, gloo between the 2 processes "
      f"{machine['bytes_per_s'] / 1e9:.2f} GB/s -> the ring hides its transfer from ~{here:.0f} tokens per rank "
      f"(fp32, {cfg['H_time']} heads over {cfg['Hkv_time']}); the measurement above had {cfg['S_time'] // 2}")

# %% [markdown]
# On this machine the link (gloo between two local processes) is fast against a CPU's FLOP/s, so
# the ring is compute-bound at any shard size worth sharding: the blocked time printed in the
# zigzag measurement is ranks waiting for each other to be scheduled, not for bytes. On a GPU
# cluster the ratio is the other way round: 400 TFLOP/s against 50 GB/s asks for thousands of tokens
# per rank.
#
# **Ulysses against the ring.** Forward, Ulysses sends about `2 (S/W)(H + Hkv') D e` per rank and the
# ring about `2 S Hkv D e`: Ulysses sends less once `W > 1 + H/Hkv` (without kv replication; 5 for
# Llama-3-8B, so from 8 ranks on). But it cannot overlap (each all-to-all is needed before the next
# compute), cannot exceed `W = H`, and across nodes its all-to-all crosses the slow links. Hybrid
# keeps Ulysses inside a node and lets the ring, now `U` times lighter, cross nodes: its ring hides
# its transfer from `4000` tokens per *ring* rank, `4000 / U` per GPU. The model's forward time per
# layer (ring and Ulysses over all GPUs, hybrid with `U = 8`, a node):

# %%
print(f"Ulysses sends fewer bytes than the ring (forward) from U = {model.ulysses_beats_ring_from(llama)}")
gpus = [8, 16, 32, 64, 128, 256, 512, 1024]
timeline = {}
for tokens in (2**17, 2**20):
    s = model.Shape(tokens, H_LLAMA, HKV_LLAMA, D_LLAMA)
    for mode in ("ring", "ulysses", "hybrid"):
        timeline[(tokens, mode)] = [model.forward_time(s, mode, g) for g in gpus]
print(f"{'GPUs':>5} " + " ".join(f"{m + ' ' + str(t // 1024) + 'k':>24}" for t in (2**17, 2**20)
                                 for m in ("ring", "ulysses", "hybrid")))
for i, g in enumerate(gpus):
    cells = []
    for t in (2**17, 2**20):
        for m in ("ring", "ulysses", "hybrid"):
            est = timeline[(t, m)][i]
            cells.append("-" if est is None else f"{est[0] * 1e3:.1f} ms ({100 * est[1] / est[0]:.0f}% exposed)")
    print(f"{g:>5} " + " ".join(f"{c:>24}" for c in cells))
ring_128k = timeline[(2**17, "ring")]
check(ring_128k[3][1] / ring_128k[3][0] > 0.4 and abs(ring_128k[-1][0] / ring_128k[3][0] - 1) < 0.01,
      "128k on 64+ GPUs: the ring is transfer-bound (48% exposed at 64) and its time per layer stops falling")
check(all(x is None for x in timeline[(2**17, "ulysses")][3:]), "Ulysses alone cannot run on more than 32 GPUs "
      "(32 heads)")
hybrid_128k = timeline[(2**17, "hybrid")]
check(all(h[0] <= r[0] * 1.015 for h, r in zip(hybrid_128k, ring_128k)) and ring_128k[4][0] / hybrid_128k[4][0] > 3,
      f"hybrid (U=8) is within 1.5% of the ring where the ring hides its transfer and "
      f"{ring_128k[4][0] / hybrid_128k[4][0]:.1f}x faster at 128 GPUs")

# %%
import matplotlib.patches as mpatches  # noqa: E402

fig, axes = figure(1, 3, figsize=(15, 4.6), gridspec_kw=dict(width_ratios=[1, 1, 1.1]))
colours = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
for ax, (name, cells) in zip(axes[:2], grids.items()):
    for (qc, kc), (rank, kind, step) in cells.items():
        if kind == "skip":
            continue
        diagonal = kind == "partial"
        ax.add_patch(mpatches.Rectangle((kc, qc), 1, 1, facecolor=colours[rank], edgecolor="white",
                                        alpha=0.45 if diagonal else 1.0, hatch="//" if diagonal else None))
        ax.text(kc + 0.5, qc + 0.5, str(step), ha="center", va="center", fontsize=8, color="black")
    ax.set(xlim=(0, CHUNKS), ylim=(CHUNKS, 0), aspect="equal", xlabel="key chunk", ylabel="query chunk",
           title=f"{name}: work per rank " + ", ".join(f"{u:g}" for u in units[name]))
    ax.set_xticks(range(CHUNKS))
    ax.set_yticks(range(CHUNKS))
    ax.tick_params(labelsize=7)
axes[0].legend(handles=[mpatches.Patch(color=c, label=f"rank {r}") for r, c in enumerate(colours)]
               + [mpatches.Patch(facecolor="grey", alpha=0.45, hatch="//", label="diagonal (1/2)")],
               loc="upper right", fontsize=7)
bar = axes[2]
width = 0.38
for i, name in enumerate(("contiguous", "zigzag")):
    xs = [r + (i - 0.5) * width for r in range(WORLD)]
    bar.bar(xs, busy[name], width, label=f"{name} (measured CPU s)", color=["tab:grey", "tab:purple"][i])
    counted = visible_pairs(cfg["S_time"], WORLD, name == "zigzag")
    scale = sum(busy[name]) / sum(counted)
    bar.scatter(xs, [c * scale for c in counted], marker="_", s=400, color="black", zorder=3,
                label="counted: visible pairs, scaled to the same total" if i == 0 else None)
bar.set(xticks=range(WORLD), xticklabels=[f"rank {r}" for r in range(WORLD)], ylabel="CPU seconds, fwd+bwd",
        ylim=(0, 1.35 * max(max(x) for x in busy.values())),
        title=f"2 processes, causal ring, S={cfg['S_time']}: work per rank")
bar.legend(fontsize=8)
save_figure(fig, "12_zigzag.png")

fig, (ax_bytes, ax_llama, ax_time) = figure(1, 3, figsize=(16, 4.4))
worlds = [2, 4, 8, 16, 32]
ax_bytes.plot(worlds, [model.ring_bytes(shape, w) / 2**20 for w in worlds], "o-", label="ring")
ax_bytes.plot([2, 4], [model.ulysses_bytes(shape, w) / 2**20 for w in (2, 4)], "s-", label="Ulysses (W <= H = 4)")
ax_bytes.plot(worlds[1:], [sum(model.hybrid_bytes(shape, 2, w // 2)) / 2**20 for w in worlds[1:]], "^-",
              label="hybrid, U=2")
for (name, world), per_rank in measured.items():
    ax_bytes.scatter([world], [per_rank[0] / 2**20], s=120, facecolors="none", edgecolors="black", zorder=3)
ax_bytes.scatter([], [], s=120, facecolors="none", edgecolors="black", label="counted on the processes")
ax_bytes.set(ylabel="MiB sent per rank, fwd + bwd", title=f"this chapter's shape: S={S}, {H} heads over {HKV}, "
             f"D={D}, fp32")
ax_bytes.legend(fontsize=8)
llama_worlds = [8, 16, 32, 64, 128, 256]
ax_llama.plot(llama_worlds, [model.ring_bytes(llama, w) / GiB for w in llama_worlds], "o-", label="ring")
ax_llama.plot(llama_worlds[:3], [model.ulysses_bytes(llama, w) / GiB for w in llama_worlds[:3]], "s-",
              label="Ulysses")
ax_llama.plot(llama_worlds, [sum(model.hybrid_bytes(llama, 8, w // 8)) / GiB for w in llama_worlds], "^-",
              label="hybrid, U=8")
ax_llama.set(ylabel="GiB sent per GPU, fwd + bwd (model)", title="Llama-3-8B layer, 128k tokens, bf16")
ax_llama.legend(fontsize=8)
for ax, xs in ((ax_bytes, worlds), (ax_llama, llama_worlds)):
    ax.set(xscale="log", xlabel="ranks W", ylim=(0, None))
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
for (tokens, mode), series in timeline.items():
    xs = [g for g, est in zip(gpus, series) if est is not None]
    ys = [est[0] * 1e3 for est in series if est is not None]
    ax_time.plot(xs, ys, "o-" if tokens == 2**17 else "s--", color={"ring": "tab:blue", "ulysses": "tab:orange",
                                                                    "hybrid": "tab:green"}[mode],
                 label=f"{mode}, {tokens // 1024}k tokens")
ax_time.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="forward ms per layer (model)",
            title="same layer: 8 GPUs/node, 50 GB/s NIC per GPU")
ax_time.set_xticks(gpus, [str(g) for g in gpus])
ax_time.minorticks_off()
ax_time.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.16))
save_figure(fig, "12_communication.png")

# %% [markdown]
# ![who computes what, contiguous and zigzag; measured work per rank](../../docs/hub/12_zigzag.png)
#
# ![bytes per rank against the model; forward time per layer on a cluster](../../docs/hub/12_communication.png)
#
# Measured at full size on this machine (2 cores, Xeon with AVX-512, shared: another engineer's
# process kept about one core busy during the run; log in `docs/hub/logs/12.txt`). Causal ring
# attention, forward and backward, S = 8192, 4 heads over 2 kv heads, D = 64, fp32, one thread per
# rank, median of 5 alternating rounds:
#
# | placement | CPU s, rank 0 | CPU s, rank 1 | blocked s, rank 0 | blocked s, rank 1 | wall s |
# |---|---:|---:|---:|---:|---:|
# | contiguous | 0.415 | 0.998 | 0.605 | 0.008 | 1.05 |
# | zigzag | 0.700 | 0.721 | 0.006 | 0.008 | 1.23 |
#
# Contiguously, rank 1 worked 2.41x as long as rank 0 (counted 3x; 2.3x if a diagonal block cost a
# full one) and rank 0 spent 0.6 s blocked waiting for it. Zigzag balanced the work to 3% and
# nobody waited; the busiest rank worked 1.38x less (counted 1.5x). The wall times go the other way
# here, and that is the machine, not the method: with another job on one of the two cores, zigzag's
# two busy ranks shared what was left, while contiguous rank 0, blocked, handed its core to rank 1.
# On dedicated devices, one GPU per rank, a waiting rank's device is simply idle and the step time
# is the busiest rank's work: there the 1.38x is the speed-up. Every rank's bytes, in every mode on
# 2 and 4 processes, equalled the model's (at S = 1024: ring 1.00 MiB on 2 ranks and 1.25 MiB on 4,
# Ulysses 0.75 MiB on both, hybrid 2 x 2 0.875 MiB). This machine: 36 GFLOP/s of causal attention
# per thread against 1.4 GB/s between the two processes, so the ring hides its transfer from about 50
# tokens per rank; a GPU cluster needs thousands.
#
# ## Exercises
#
# 1. Rewrite the hand ring with the zigzag placement (`cp.zigzag_chunks(S, W, r)` gives a rank's two
#    chunks): count the engine calls per rank and per step. Which two pairs of a step can be joined
#    into one call, and why does that need them to share a query or a key chunk?
# 2. A sliding window of `w` tokens, `w` much smaller than `S/W`: count the work per rank with
#    `cp.block_kind(..., causal=True, window=(w, 0))` for both placements. Why does
#    `tileattn.distributed`'s documentation recommend `load_balance=False` here?
# 3. In the hand ring's backward, keep the travelling `dK`/`dV` buffers in bf16 (round them after
#    every addition: what an implementation sending bf16 accumulators does). How does the error
#    against the oracle grow with `W`? Why does `tileattn.distributed` send them in fp32?
# 4. Llama-3-8B at 1M tokens: with the model's cluster, up to how many GPUs does the ring alone hide
#    its transfer? With hybrid `U = 8`? Check your answers against
#    `python -m tileattn.distributed.model`.
# 5. Ulysses with 32 query heads and 8 kv heads on 16 ranks: how many kv heads after replication
#    (`tileattn.distributed.ulysses.kv_repeats`)? What share of the traffic per rank are K and V then,
#    and on 8 ranks, where nothing is repeated? (`model.ulysses_bytes` computes both totals.)
# 6. Run the same rank program under `torchrun`: a script that calls
#    `torch.distributed.init_process_group("gloo")` and then `_cp_ranks.two_ranks(cfg)`, launched
#    with `torchrun --nproc-per-node 2`. What changes? (Nothing in the attention code.)
