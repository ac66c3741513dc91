# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 15 · Where the time of a small call goes
#
# Chapter 10 timed decode steps against long caches, where the kernel reads megabytes and the
# bandwidth sets the time. A serving loop spends most of its steps on short caches and small
# batches: one query token per head against 128 cached keys is ~130 KFLOP, a fraction of a
# microsecond of arithmetic. What such a call costs is everything *around* the arithmetic: Python
# parsing the keywords, validating the tensors, choosing an engine, crossing an autograd custom op,
# allocating the output, packing the kernel's arguments, and the kernel's own fixed costs.
#
# This chapter takes one decode call apart:
#
# 1. **the layers, timed one by one**: the whole call, its validation, dispatch, the custom op, the
#    kernel wrapper and the C kernel alone, next to SDPA's whole call;
# 2. **the lean call**: what a repeated inference call can skip (the spec, dispatch, the op), and why
#    its result is bitwise the full path's;
# 3. **counted, not timed**: Python function calls and tensor operations per call, the same on
#    every machine, which is what the timings follow;
# 4. **what the memo keeps**: one plan for a cache that grows every step, and no tensor of the
#    caller's.
#
# Timings run on one thread and in the thread's CPU time (as chapters 09 and 10). They are printed,
# never checked: a claim checked here holds on every machine, loaded or not.

# %%
import sys
import time
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tileattn
from tileattn.tools import decode_bench, measure
from tileattn.core import lean, plans
from tileattn.core.dispatch import get_backend
from tileattn.core.testing import judge
from _hub import check, pick

torch.set_num_threads(1)
print(f"CPU: {measure.cpu_model()}; torch {torch.__version__}, 1 thread")
NATIVE = not get_backend("native").unavailable_reason()
print("native engine:", "available" if NATIVE else "unavailable here (the PyTorch engine serves every call)")

B, HQ, HKV, D, KEYS = 1, 8, 2, 64, 128
gen = torch.Generator().manual_seed(0)
q = torch.randn(B, HQ, 1, D, generator=gen)
k = torch.randn(B, HKV, KEYS, D, generator=gen)
v = torch.randn(B, HKV, KEYS, D, generator=gen)

# %% [markdown]
# ## 1. The layers, timed one by one
#
# `tileattn.tools.decode_bench.overhead` times each layer of `flash_attention(q, k, v, seqused_k=...)`
# on its own, many calls in a row, the layers interleaved so that a burst of load on a shared
# machine hits them alike. The rows nest: the whole call contains validation (`build_spec`),
# dispatch (`select`) and `run_forward` (the output's allocation and the engine), which contains the
# kernel wrapper (`kernels.forward`: no argument checks, the struct packed from the call's kernel
# arguments, then C). The custom op round trip is what a call with autograd pays on top:
# `torch.library` dispatch, the op's flattening of the spec into tensors, ints and strings and back,
# and autograd's bookkeeping.

# %%
rows = []
if NATIVE:
    for dtype in (torch.float32, torch.bfloat16):
        rows += decode_bench.overhead(cache=KEYS, batch=B, heads_q=HQ, heads_kv=HKV, head_dim=D, dtype=dtype,
                                      iters=pick(50, 1000), reps=pick(3, 9), clock=time.thread_time)
    for r in rows:
        print(f"  {r['dtype']}  {r['layer']:62s} {r['median_us']:8.1f} us  (spread {r['spread_pct']:.0f}%)")
    table = {(r["dtype"], r["layer"].strip()): r["median_us"] for r in rows}
    for dtype in ("fp32", "bf16"):
        lean_us = table[(dtype, "flash_attention(seqused_k=) whole call, lean path")]
        full_us = table[(dtype, "flash_attention(seqused_k=) whole call, full path")]
        c_us = table[(dtype, "C kernel alone (ta_forward)")]
        sdpa_us = table[(dtype, "sdpa whole call (enable_gqa)")]
        print(f"  {dtype}: Python above the kernel: lean {lean_us - c_us:.1f} us, full {full_us - c_us:.1f} us; "
              f"SDPA / lean = {sdpa_us / lean_us:.2f}x, SDPA / full = {sdpa_us / full_us:.2f}x")

# %% [markdown]
# On the Sapphire Rapids machine this chapter was written on (unloaded), the full path cost
# 43-51 us for a kernel of ~4.5 us: ten times the arithmetic's container. Most of it is Python:
# each layer builds objects (an `AttentionSpec`, the lowered kernel arguments, a dict of ~25
# keywords) that the next one takes apart.
#
# ## 2. The lean call
#
# A decode loop calls attention with the same *kind* of arguments thousands of times: the same
# heads, head dims, dtype, flags; only the key length, the strides of the growing cache and the data
# change. `tileattn.core.lean` keys a memo by everything validation and dispatch read **except** the key
# length and K/V's strides. The first call takes the full path and leaves a plan: the engine's
# prepared call (for the native engine, the kernel's argument struct with every constant packed
# once) and the geometry to check. Every later call checks what the key leaves out (K/V's batch,
# heads and head dims, a unit-stride head dim, the key count within the short-call limit), allocates
# the output, writes a dozen pointers and strides into the struct and calls the kernel. Anything
# unexpected, and any value the kernel refuses, sends the call to the full path, which validates and
# raises its usual error before computing.
#
# The lean path only serves calls that need no gradient (no input requires grad, or `no_grad` /
# `inference_mode`), are not being traced by `torch.compile`, and carry no per-call modifier tensor
# (mask, bias, ALiBi, sinks, dropout). Training and compiled graphs keep the custom op.

# %%
served = []
real_run = lean.LeanPlan.run


def counting_run(self, *args):
    result = real_run(self, *args)
    served.append(result is not None)
    return result


lean.LeanPlan.run = counting_run
plans.clear()
outs = [tileattn.flash_attention(q, k, v) for _ in range(3)]
with lean.bypassed():
    full = tileattn.flash_attention(q, k, v)
lean.LeanPlan.run = real_run
exact = tileattn.reference(q, k, v, compute_dtype=torch.float64)
verdict = judge("out", outs[-1], exact, tileattn.reference(q, k, v), torch.float32)
print(" ", verdict)
check(verdict.ok, "the decode call passes FlashAttention's accuracy rule against the fp64 reference")
if NATIVE:
    check(served == [True, True], "the first call takes the full path and makes the plan; the next two are lean")
check(all(torch.equal(o, full) for o in outs), "lean and full paths give bitwise the same output")

q_train = q.clone().requires_grad_()
out_train = tileattn.flash_attention(q_train, k, v)
with torch.no_grad():
    out_infer = tileattn.flash_attention(q_train, k, v)
check(out_train.grad_fn is not None and out_infer.grad_fn is None,
      "with a gradient to compute the call goes through the autograd op; under no_grad it does not")
check(torch.equal(out_train.detach(), out_infer), "both give the same bits")

# %% [markdown]
# ## 3. Counted, not timed
#
# Time on a shared machine moves with everyone else's work; the amount of work a call does does
# not. Two counts explain the timings of section 1 on any machine: the Python functions a call
# enters (`sys.setprofile` sees each one) and the tensor operations it dispatches (a
# `TorchDispatchMode` sees each one: allocations, views, copies).


# %%
def python_calls(fn) -> int:
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


class TensorOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def tensor_ops(fn) -> list:
    with TensorOps() as mode:
        fn()
    return mode.ops


def lean_call():
    return tileattn.flash_attention(q, k, v)


def full_call():
    with lean.bypassed():
        return tileattn.flash_attention(q, k, v)


def sdpa_call():
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


with torch.inference_mode():
    lean_call()
    counts = {name: (python_calls(fn), tensor_ops(fn)) for name, fn in
              (("tileattn lean", lean_call), ("tileattn full", full_call), ("sdpa", sdpa_call))}
for name, (calls, ops) in counts.items():
    print(f"  {name:14s} {calls:4d} Python function calls, {len(ops):2d} tensor ops: {', '.join(ops)}")
if NATIVE:
    lean_calls, lean_ops = counts["tileattn lean"]
    full_calls, full_ops = counts["tileattn full"]
    check(lean_calls * 3 <= full_calls, f"the lean call enters at most a third of the full path's Python functions "
                                        f"({lean_calls} vs {full_calls})")
    check(len(lean_ops) == 1 and lean_ops[0] in ("empty", "empty_like"),
          "the lean call dispatches one tensor operation: the output's allocation "
          "(the LSE it does not return goes to a scratch buffer)")
    check(len(full_ops) > len(lean_ops), "the full path dispatches more: it allocates the LSE too")

# %% [markdown]
# ## 4. What the memo keeps
#
# The plan is keyed without the key length, so a cache that grows by one key per step (a new shape
# every step) finds one plan. It holds shapes, flags, the engine and the struct's bytes, never a
# tensor: K and V of earlier steps are freed as soon as the caller drops them.

# %%
plans.clear()
refs = []
steps = pick(8, 64)
buffer_k = torch.randn(B, HKV, KEYS + steps, D, generator=gen)
buffer_v = torch.randn(B, HKV, KEYS + steps, D, generator=gen)
for step in range(steps):
    k_step = buffer_k[:, :, :KEYS + step].clone()
    v_step = buffer_v[:, :, :KEYS + step].clone()
    out = tileattn.flash_attention(q, k_step, v_step)
    refs += [weakref.ref(k_step), weakref.ref(v_step)]
    with lean.bypassed():
        same = torch.equal(out, tileattn.flash_attention(q, k_step, v_step))
    if not same:
        break
    del k_step, v_step
lean_plans = [p for p in plans.entries("lean") if p is not None]
print(f"  {steps} steps of a growing cache: {len(lean_plans)} lean plan(s)")
check(same, "every step of the growing cache: lean and full paths bitwise equal")
if NATIVE:
    check(len(lean_plans) == 1, "one plan serves every length of the growing cache")
check(all(r() is None for r in refs), "no K or V of an earlier step is alive: the memo holds no tensor")

# %% [markdown]
# ## 5. A dialect's repeated step
#
# flash-attn's `flash_attn_with_kvcache` checks its arguments before it writes the new key into the
# cache in place: ranks, dtypes, devices, shapes, the options, the lengths. A decode loop passes the
# same shapes and options every step and only the lengths change, so a step whose shapes, strides,
# dtypes and options are those of one that passed every check skips the checks that read nothing
# else: the lengths are checked again (a bad one takes the checked path, which names it), then come
# the write and the lean call. Counted, as in section 3, and bitwise the checked step:

# %%
from tileattn.compat.flash_attn import flash_attn_with_kvcache

k_cache = torch.randn(B, 2 * KEYS, HKV, D, generator=gen)
v_cache = torch.randn(B, 2 * KEYS, HKV, D, generator=gen)
q_step = torch.randn(B, 1, HQ, D, generator=gen)
k_new, v_new = torch.randn(B, 1, HKV, D, generator=gen), torch.randn(B, 1, HKV, D, generator=gen)
lengths = torch.full((B,), KEYS - 1, dtype=torch.int32)
twin_k, twin_v = k_cache.clone(), v_cache.clone()


def kvcache_step(k_cache=k_cache, v_cache=v_cache, **options):
    return flash_attn_with_kvcache(q_step, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True,
                                   **options)


plans.clear()
with torch.inference_mode():
    kvcache_step(), kvcache_step()  # the core's plans and the step's exist
    repeated_calls = python_calls(kvcache_step)
    # num_splits is a hint the result never depends on: the same core call, a step not seen before
    checked_calls = python_calls(lambda: kvcache_step(num_splits=1))
    repeated = kvcache_step()
    plans.clear()
    checked = kvcache_step(twin_k, twin_v)
print(f"  flash_attn_with_kvcache: {checked_calls} Python function calls checked, {repeated_calls} repeated")
check(repeated_calls < checked_calls, "with the core's call warm in both, a repeated step enters fewer Python "
                                      f"functions than a checked one ({repeated_calls} vs {checked_calls})")
check(torch.equal(repeated, checked) and torch.equal(k_cache, twin_k) and torch.equal(v_cache, twin_v),
      "the repeated step's output and caches are bitwise the checked step's")

# %% [markdown]
# ## Exercises
#
# 1. Time `lean_call` with `return_lse=True`: which tensor operation appears in section 3's count,
#    and what does it cost in section 1's units?
# 2. Pass `mask=torch.ones(1, 1, 1, KEYS, dtype=torch.bool)`: the call takes the full path. Why can
#    a plan not hold a mask, and what would a prepared call need to take one per call?
# 3. Call with `layout="BSND"` views of the same tensors (`q.transpose(1, 2)`, ...): how many
#    plans are there now, and does any tensor get copied?
# 4. Set `torch.set_num_threads(2)` and time the lean call at 128 and at 4096 keys: where does a
#    second thread start paying for its start-up?
