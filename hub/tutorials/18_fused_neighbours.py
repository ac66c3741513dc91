# ---
# jupyter:
#   jupytext:
#     formats: py:percent
# ---

# %% [markdown]
# # 18 · Fusing the attention's neighbours
#
# The seed documents describe more than the attention kernel. After tuning FlashAttention, the graph
# engine fused the operators around it: `RMSNorm -> MatMul(Q) -> MatMul(K) -> MatMul(V) ->
# FlashAttention -> MatMul(O)`, six operators and twelve passes over memory, became two fused
# operators (FusedNormQKV, FusedAttnProj) and four passes, for another 8-16% of throughput on a 13B
# service. This chapter builds that fusion for the CPU and measures what it is worth here:
#
# 1. **the two blocks**: the attention half of a Llama layer as Hugging Face writes it (six operators
#    and the elementwise work between them), and as `tileattn.fused.norm_qkv` + `attention_out_proj`;
#    the same numbers, checked in fp64;
# 2. **counted**: every operator each block launches and every pass it makes over activations, with
#    the bytes moved (the same on every machine), and the tensors each keeps for its backward;
# 3. **profiled**: where each block's time goes: the GEMMs, the attention, everything else;
# 4. **the speed table** of the full benchmark (`benchmarks/bench_fused.py`) and why the answer on a
#    CPU is not the seed's: the GEMMs dominate, and what fusion removes is a few percent in fp32; in
#    bf16 the fused block runs its GEMMs in fp32, which this CPU does several times faster;
# 5. **a real model**: `fuse(model)` on a Llama, the same greedy tokens.
#
# Timings run on one thread, in the thread's CPU time; they are printed, never checked.

# %%
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tileattn
from tileattn import fused
from tileattn.core.testing import judge
from tileattn.tools import measure
from _hub import REPO, check, figure, pick, save_figure

torch.set_num_threads(1)
print(f"CPU: {measure.cpu_model()}; torch {torch.__version__}, 1 thread")
print("fused C passes:", "available" if fused.available()[0] else fused.available()[1])

HIDDEN, HEADS, KV_HEADS, D = pick((256, 4, 2, 64), (2048, 16, 8, 128))
S, EPS = pick(128, 1024), 1e-6

# %% [markdown]
# ## 1. Six operators, and two
#
# The unfused block is Llama's: an RMSNorm (in fp32 or wider, then rounded back), three projections, the
# `(B, S, H, D) -> (B, H, S, D)` views, rotary embeddings as `q * cos + rotate_half(q) * sin` with
# full-width tables, the attention, and the output projection. The fused block is two calls:
#
# * `norm_qkv` computes each row's 1/rms once and writes the GEMM's operand already normalised
#   (one pass), runs the projections (PyTorch's GEMMs: MKL/oneDNN), and in one pass per projection
#   adds the bias, rotates, and stores q, k and v in the layout the attention kernels read;
# * `attention_out_proj` attends and multiplies by `w_o`; in bf16 the attention's fp32 result goes
#   straight into an fp32 GEMM.

# %%
def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def composed_block(x, p, cos_full, sin_full):
    dtype = x.dtype
    h = x.to(torch.promote_types(dtype, torch.float32))                                  # 1 RMSNorm
    h = p["norm"] * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    shape = (*x.shape[:-1], -1, D)
    q = F.linear(h, p["wq"]).view(shape).transpose(1, 2)                                 # 2-4 MatMul Q, K, V
    k = F.linear(h, p["wk"]).view(shape).transpose(1, 2)
    v = F.linear(h, p["wv"]).view(shape).transpose(1, 2)
    c, s = cos_full.unsqueeze(1), sin_full.unsqueeze(1)                                  # RoPE
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    out = tileattn.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="BSND",
                                   causal=True)                                          # 5 FlashAttention
    return F.linear(out.reshape(*x.shape[:-1], -1), p["wo"])                             # 6 MatMul O


def fused_block(x, p, cos, sin):
    q, k, v = fused.norm_qkv(x, p["norm"], (p["wq"], p["wk"], p["wv"]), eps=EPS, num_heads=HEADS,
                             num_kv_heads=KV_HEADS, head_dim=D, rope=(cos, sin), layout="BSND")
    return fused.attention_out_proj(q, k, v, p["wo"], layout="BSND", causal=True)


def parameters(dtype, grad=False):
    g = torch.Generator().manual_seed(0)
    shapes = dict(norm=(HIDDEN,), wq=(HEADS * D, HIDDEN), wk=(KV_HEADS * D, HIDDEN), wv=(KV_HEADS * D, HIDDEN),
                  wo=(HIDDEN, HEADS * D))
    p = {n: (torch.randn(*s, generator=g) * (0.1 if n == "norm" else 0.02) + (n == "norm")) for n, s in shapes.items()}
    return {n: t.to(dtype).requires_grad_(grad) for n, t in p.items()}


def inputs(dtype):
    x = torch.randn(1, S, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    cos, sin = fused.rotary_tables(torch.arange(S), D, dtype=dtype)        # half-width: (S, D/2)
    return x, cos, sin, torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]


x64, cos64, sin64, cf64, sf64 = inputs(torch.float64)
p64 = parameters(torch.float64)
with torch.no_grad():
    err = (fused_block(x64, p64, cos64, sin64) - composed_block(x64, p64, cf64, sf64)).abs().max().item()
print(f"fp64: max |fused - composed| = {err:.2e}")
check(err < 1e-12, "in fp64 the two-operator block computes the six-operator block's numbers (to 1e-12)")

# %% [markdown]
# In fp32 the blocks round differently (the fused one never rounds the normalised activations to the
# input dtype, and rotates from the GEMM's output), so the right question is FlashAttention's: is
# the fused block's error against fp64 at most twice the composed block's, forward and backward?

# %%
def run_with_grads(block, dtype, rope_full):
    x, cos, sin, cf, sf = inputs(dtype)
    p = parameters(dtype, grad=True)
    x = x.requires_grad_()
    y = block(x, p, *((cf, sf) if rope_full else (cos, sin)))
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    grads = torch.autograd.grad(y, [x] + list(p.values()), dy)
    return [y.detach()] + list(grads)


oracle = run_with_grads(composed_block, torch.float64, True)
for dtype in (torch.float32, torch.bfloat16):
    got, base = run_with_grads(fused_block, dtype, False), run_with_grads(composed_block, dtype, True)
    names = ["y", "dx", "dnorm", "dwq", "dwk", "dwv", "dwo"]
    verdicts = [judge(n, a, o, b, dtype) for n, a, o, b in zip(names, got, oracle, base)]
    for v in verdicts:
        print(f"  {str(dtype)[6:]:8s} {v}")
    check(all(v.ok for v in verdicts), f"{str(dtype)[6:]}: the fused block's output and its 6 gradients are within "
          "twice the composed block's error against fp64")

# %% [markdown]
# ## 2. Counted: operators, passes, bytes
#
# A `TorchDispatchMode` sees every operator PyTorch runs below autograd: the GEMMs, the attention's
# allocation, each elementwise pass. What it does not see are the C passes of `norm_qkv` (called
# through ctypes), which `tileattn.fused.native.recording()` lists with the bytes each reads and
# writes. The attention kernel itself (C, the same call in both blocks) is left out of both counts.
# A *pass* is an operator that reads or writes an activation: views (`transpose`, `view`) and
# allocations move nothing and are not passes.

# %%
GEMMS = {"mm", "addmm", "bmm"}
#: what moves no data: allocations, views, dtype queries
FREE = {"empty", "empty_strided", "new_empty", "detach", "lift_fresh", "promote_types", "_unsafe_view", "view",
        "transpose", "unsqueeze", "slice", "t", "expand", "permute", "alias"}


class Passes(TorchDispatchMode):
    """Each operator that reads or writes an activation (a tensor of S * D elements or more):
    (name, bytes read, bytes written)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in FREE or func.is_view or max((t.numel() for t in ins + outs), default=0) < S * D:
            return out
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        self.ops.append((name, size(ins), size(outs) if not name.endswith("_") else size(ins[:1])))
        return out


def count(block, rope):
    x, cos, sin, cf, sf = inputs(torch.float32)
    p = parameters(torch.float32)
    with torch.no_grad(), fused.native.recording() as c_passes, Passes() as mode:
        block(x, p, *rope(cos, sin, cf, sf))
    ops = [(n, r, w) for n, r, w in mode.ops] + [(f"C {n}", r, w) for n, r, w in c_passes]
    gemms = [o for o in ops if o[0] in GEMMS]
    rest = [o for o in ops if o[0] not in GEMMS]
    return ops, gemms, rest


tally = {}
for name, block, rope in (("composed", composed_block, lambda c, s, cf, sf: (cf, sf)),
                          ("fused", fused_block, lambda c, s, cf, sf: (c, s))):
    ops, gemms, rest = count(block, rope)
    moved = sum(r + w for _, r, w in rest)
    tally[name] = dict(operators=len(ops), gemms=len(gemms), passes=len(rest), moved=moved)
    print(f"{name}: {len(ops)} operators: {len(gemms)} GEMMs and {len(rest)} other passes moving "
          f"{moved / 2 ** 20:.1f} MiB")
    print("   ", ", ".join(n for n, _, _ in rest))
check(tally["fused"]["gemms"] == tally["composed"]["gemms"], "both blocks run the same four GEMMs")
check(tally["fused"]["passes"] < tally["composed"]["passes"] / 2 and tally["fused"]["moved"] < tally["composed"]["moved"],
      "the fused block makes less than half the composed block's non-GEMM passes, moving fewer bytes")

# %% [markdown]
# The composed block's passes: RMSNorm as PyTorch composes it is four (square, mean, two
# multiplies; the rsqrt works on one value per row), each rotary embedding five (a multiply, a
# negation, `cat`'s copy, a multiply, an add). The fused block's are one norm pass writing the GEMM's
# operand and one epilogue per projection, each reading its input once and writing its output once.
#
# What the backward keeps between the passes is counted the same way: `saved_tensors_hooks` sees
# every tensor autograd saves for the backward pass.

# %%
def saved_bytes(block, rope):
    x, cos, sin, cf, sf = inputs(torch.float32)
    p = parameters(torch.float32, grad=True)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x.requires_grad_(), p, *rope(cos, sin, cf, sf))
    weights = sum(t.numel() * t.element_size() for t in p.values())
    return sum(seen.values()) - weights       # the parameters are kept anyway: count the activations


saved = {"composed": saved_bytes(composed_block, lambda c, s, cf, sf: (cf, sf)),
         "fused": saved_bytes(fused_block, lambda c, s, cf, sf: (c, s))}
for name, b in saved.items():
    print(f"{name}: saves {b / 2 ** 20:.1f} MiB of activations for its backward")
check(saved["fused"] < saved["composed"], "the fused block keeps fewer activation bytes for its backward")

# %% [markdown]
# ## 3. Profiled: where the time goes
#
# Counting says what fusion removes; the profiler says what that is worth. Each block's self CPU
# time in ms, grouped: the GEMMs, the attention, `norm_qkv`'s own passes (its GEMMs are counted with
# the GEMMs) and every other operator. The profiler's own overhead inflates the many small operators
# of the composed block a little.

# %%
def profile(block, rope, dtype):
    """Self CPU time by group, with autograd recording (so the attention and norm_qkv run as their
    custom ops, which the profiler names; nothing runs backward)."""
    x, cos, sin, cf, sf = inputs(dtype)
    p = parameters(dtype, grad=True)
    block(x, p, *rope(cos, sin, cf, sf))
    with torch.profiler.profile() as prof:
        block(x, p, *rope(cos, sin, cf, sf))
    groups = {"GEMMs": 0.0, "attention": 0.0, "norm_qkv's C passes": 0.0, "other operators": 0.0}
    for e in prof.key_averages():
        name = e.key.split("::")[-1]
        group = ("GEMMs" if name in GEMMS else "attention" if name == "attention_forward"
                 else "norm_qkv's C passes" if name == "norm_qkv" else "other operators")
        groups[group] += e.self_cpu_time_total / 1e3
    return groups


for dtype in (torch.float32, torch.bfloat16):
    for name, block, rope in (("composed", composed_block, lambda c, s, cf, sf: (cf, sf)),
                              ("fused", fused_block, lambda c, s, cf, sf: (c, s))):
        groups = profile(block, rope, dtype)
        share = ", ".join(f"{k} {v:.1f}" for k, v in groups.items())
        print(f"  {str(dtype)[6:]:8s} {name:8s} {sum(groups.values()):8.1f} ms  ({share})")

# %% [markdown]
# In fp32 the four GEMMs are most of either block, and they are the same GEMMs: what fusion removes
# is the rest, a few percent of the block at S = 512-8192. In bf16 the composed block's GEMMs are
# PyTorch's bf16 GEMMs, which on a CPU without bf16 instructions run several times slower than fp32;
# the fused block converts its operands once while it writes them and multiplies in fp32.
#
# ## 4. The speed table
#
# `benchmarks/bench_fused.py` times the block at the sizes (hidden 2048, 16/8 heads, D 128,
# S 512 / 2k / 8k), forward and forward + backward, one thread, the two blocks interleaved; a decode
# step over an 8k cache; and the peak memory of forward + backward. Its committed results:

# %%
results = REPO / "benchmarks" / "results" / "fused.csv"
rows = []
if results.exists():
    import csv

    with open(results) as f:
        rows = list(csv.DictReader(f))
    print(f"{results.relative_to(REPO)} ({rows[0]['cpu']}, {rows[0]['threads']} thread):")
    print(f"  {'':8s} {'dtype':9s} {'S':>6s} {'pass':18s} {'composed':>10s} {'fused':>10s} {'ratio':>7s}  target")
    for r in rows:
        unit = "MiB" if r["section"] == "memory" else "s"
        print(f"  {r['section']:8s} {r['dtype']:9s} {r['length']:>6s} {r['pass']:18s} {float(r['composed_s']):9.3f}"
              f"{unit[0]} {float(r['fused_s']):9.3f}{unit[0]} {float(r['speedup']):6.2f}x  {r['target']}")
else:
    print("no committed benchmark results: run python benchmarks/bench_fused.py")

# %%
fig, (ax1, ax2) = figure(1, 2, figsize=(10, 3.6))
names = list(tally)
ax1.bar([f"{n}\npasses" for n in names], [tally[n]["passes"] for n in names], color=["#999", "#4c72b0"])
ax1.bar([f"{n}\nMiB moved" for n in names], [tally[n]["moved"] / 2 ** 20 for n in names], color=["#bbb", "#55a868"])
ax1.set_title(f"non-GEMM passes of the forward (S={S}, hidden {HIDDEN})", fontsize=9)
block_rows = [r for r in rows if r["section"] in ("block", "decode")]
if block_rows:
    labels = [f"{r['dtype'][:4]} {r['pass']}\n{r['length']}" for r in block_rows]
    ax2.bar(range(len(block_rows)), [float(r["speedup"]) for r in block_rows],
            color=["#4c72b0" if r["dtype"] == "float32" else "#dd8452" for r in block_rows])
    ax2.set_xticks(range(len(block_rows)), labels, fontsize=6, rotation=60)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.axhline(1.15, color="r", lw=0.8, ls="--")
    ax2.set_yscale("log")
    ax2.set_title("fused / composed speed (benchmarks/results/fused.csv)", fontsize=9)
save_figure(fig, "18_fused_neighbours.png")

# %% [markdown]
# ![passes and speed-ups](../../docs/hub/18_fused_neighbours.png)
#
# ## 5. A real model: `fuse(model)`
#
# `tileattn.integrations.transformers.fuse(model)` swaps every attention block of a Llama-family model
# (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3) for the two operators, with the same parameters under the
# same names; anything else is refused by name. The recipe `hub/recipes/fused_llama.py` times a whole
# model against `attn_implementation="sdpa"`; here a small one generates the same tokens fused and not.

# %%
try:
    import transformers
    from transformers.utils import logging as hf_logging
except ImportError:
    transformers = None
    print("transformers is not installed: pip install 'tileattn[transformers]'")
if transformers is not None:
    import tileattn.integrations.transformers as tt

    hf_logging.set_verbosity_error()
    tt.register()
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config).eval()
    plain.set_attn_implementation("tileattn")
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(plain.state_dict())
    tt.fuse(model)
    ids = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = plain.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        b = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    print("fused layer 0:", type(model.model.layers[0].self_attn).__name__)
    check(torch.equal(a, b), "a fused Llama generates the unfused model's greedy tokens (fp32)")

# %% [markdown]
# ## Exercises
#
# 1. Pass the three projections as one stacked `w_qkv` tensor: does anything change in section 2's
#    count? What would one GEMM of width `(H + 2 H_kv) D` save, and what would concatenating
#    separate weights on every call cost instead?
# 2. Count the passes of `norm_qkv` with `layout="BNSD"`: which pass writes the head-major layout,
#    and why is it not an extra pass?
# 3. Run section 3 in bf16 with `TILEATTN_NATIVE_ISA` unchanged on a CPU with AVX512_BF16 or AMX:
#    which GEMMs would you keep in bf16 there, and what does `tileattn.fused.projection` assume?
# 4. Write one decode step with `norm_qkv(..., kv_cache=(k_cache, v_cache), cache_seqlens=...)` over a
#    cache stored `(B, H_kv, L, D)` and passed as its `(B, L, H_kv, D)` view, then over a `(B, L, H_kv, D)`
#    cache: which one does the decode kernel read faster, and why?
