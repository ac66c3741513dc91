"""The attention half of a Llama layer, fused (``tileattn.fused``: two operators) against the same block
composed of PyTorch operators around ``tileattn.flash_attention`` (six operators, as Hugging Face's
Llama writes it), and a Llama-class model with ``fuse(model)`` against ``attn_implementation="sdpa"``.

    python benchmarks/bench_fused.py                       # every section -> benchmarks/results/fused.{csv,json,png}
    python benchmarks/bench_fused.py --sections block --seqlens 512 --dtypes fp32 --budget 30

Sections:

* ``block``: hidden 2048, 16/8 heads, head dim 128, causal, B 1, S in ``--seqlens``: forward, and
  forward + backward (gradients of x and every weight), fp32 and bf16.
* ``decode``: one decode step of that block over a cache of ``--cache`` keys: the composed step
  (RMSNorm, three projections, RoPE, the new key and value copied into a preallocated cache,
  ``flash_attention`` with ``seqused_k``, the output projection) against ``norm_qkv`` writing the
  cache and ``attention_out_proj``.
* ``memory``: peak resident memory added by the block's forward + backward (``VmHWM``, after
  ``malloc_trim``), each in a fresh process.
* ``model``: a Llama-class model (hidden 1024, 8 layers, 16/8 heads, random weights): prefill
  tokens/s, the time of a greedy decode step (``generate``) and of a training step, for
  ``sdpa``, ``tileattn`` and ``tileattn`` + ``fuse(model)``.

Timing: one thread (``--threads``), each contender's thread CPU time (``time.thread_time``: what a
single-threaded call keeps on a shared machine), contenders interleaved, start rotated each round;
medians of the rounds and the composed/fused ratio of each round's pair. A block row gets one untimed
round, then 3 to 9 rounds (as many as fit in ``--budget`` seconds), except bf16 forward + backward at
``--long-seqlen``: one unwarmed round (the composed side's bf16 GEMMs take minutes there). The load average
before and after is recorded with the CPU's name.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import tileattn
from tileattn import fused
from tileattn.tools.measure import cpu_flags, cpu_model, peak_memory, time_interleaved, write_results

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EPS = 2048, 16, 8, 128, 1e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# ------------------------------------------------------------------------------------- the block


class Weights:
    """The block's parameters (Llama's initialisation scale), as leaves that take gradients."""

    def __init__(self, dtype, seed=0, grad=False):
        g = torch.Generator().manual_seed(seed)

        def param(*shape, scale):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_(grad)

        self.norm = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype).requires_grad_(grad)
        self.wq = param(HEADS * HEAD_DIM, HIDDEN, scale=0.02)
        self.wk = param(KV_HEADS * HEAD_DIM, HIDDEN, scale=0.02)
        self.wv = param(KV_HEADS * HEAD_DIM, HIDDEN, scale=0.02)
        self.wo = param(HIDDEN, HEADS * HEAD_DIM, scale=0.02)

    def leaves(self):
        return [self.norm, self.wq, self.wk, self.wv, self.wo]


def rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)


def composed_block(x, w: Weights, cos_full, sin_full, cache=None):
    """Hugging Face Llama's attention half, with tileattn's attention: RMSNorm (in fp32, as LlamaRMSNorm),
    q/k/v projections, (B, H, S, D) views, apply_rotary_pos_emb, the attention on the BSND views
    (what attn_implementation="tileattn" passes), the output projection. ``cache`` =
    (k_cache, v_cache, lengths): the new rows copied in place, attention over the used part."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    h = w.norm * h.to(dtype)
    shape = (*x.shape[:-1], -1, HEAD_DIM)
    q = F.linear(h, w.wq).view(shape).transpose(1, 2)
    k = F.linear(h, w.wk).view(shape).transpose(1, 2)
    v = F.linear(h, w.wv).view(shape).transpose(1, 2)
    c, s = cos_full.unsqueeze(1), sin_full.unsqueeze(1)
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    if cache is None:
        out = tileattn.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout="BSND",
                                       causal=True)
    else:
        k_cache, v_cache, lengths = cache
        pos = int(lengths[0])
        k_cache[:, pos:pos + x.shape[1]] = k.transpose(1, 2)
        v_cache[:, pos:pos + x.shape[1]] = v.transpose(1, 2)
        out = tileattn.flash_attention(q.transpose(1, 2), k_cache, v_cache, layout="BSND", causal=True,
                                       seqused_k=lengths + x.shape[1])
    return F.linear(out.reshape(*x.shape[:-1], -1), w.wo)


def fused_block(x, w: Weights, cos, sin, cache=None):
    """The same block as two operators."""
    kw = dict(eps=EPS, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope=(cos, sin), layout="BSND")
    if cache is None:
        q, k, v = fused.norm_qkv(x, w.norm, (w.wq, w.wk, w.wv), **kw)
        return fused.attention_out_proj(q, k, v, w.wo, layout="BSND", causal=True)
    k_cache, v_cache, lengths = cache
    q, k, v = fused.norm_qkv(x, w.norm, (w.wq, w.wk, w.wv), kv_cache=(k_cache, v_cache), cache_seqlens=lengths, **kw)
    return fused.attention_out_proj(q, k, v, w.wo, layout="BSND", causal=True, seqused_k=lengths + x.shape[1])


def tables(positions, dtype):
    """(half-width cos, sin) for the fused block and HF's full-width (1, S, D) ones."""
    cos, sin = fused.rotary_tables(positions, HEAD_DIM, dtype=dtype)
    return cos, sin, torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]


def _ratios(samples, a, b):
    return [x / y for x, y in zip(samples[a], samples[b])]


def bench_block(seqlen, dtype, backward, budget, long):
    """{contender: [seconds per round]}: one untimed round (none for a ``long`` row), then as many rounds
    as fit in ``budget`` seconds (3 to 9; one for a long row)."""
    g = torch.Generator().manual_seed(seqlen)
    x0 = torch.randn(1, seqlen, HIDDEN, generator=g).to(dtype)
    cos, sin, cos_full, sin_full = tables(torch.arange(seqlen), dtype)
    w = Weights(dtype, grad=backward)
    dy = torch.randn(1, seqlen, HIDDEN, generator=g).to(dtype)

    def step(block, *rope):
        def run():
            x = x0.detach().requires_grad_(backward)
            y = block(x, w, *rope)
            if backward:
                torch.autograd.backward(y, dy)
                for t in [x] + w.leaves():
                    t.grad = None
        return run

    contenders = {"composed": step(composed_block, cos_full, sin_full), "fused": step(fused_block, cos, sin)}
    with torch.set_grad_enabled(backward):
        reps = 1
        if not long:
            warm = time_interleaved(contenders, reps=1, clock=time.thread_time)
            reps = max(3, min(9, int(budget / sum(s[0] for s in warm.values()))))
        return time_interleaved(contenders, reps=reps, clock=time.thread_time)


def bench_decode(cache_len, dtype, reps, iters):
    g = torch.Generator().manual_seed(cache_len)
    w = Weights(dtype)
    x = torch.randn(1, 1, HIDDEN, generator=g).to(dtype)
    # head-major storage (B, Hkv, L, D), Hugging Face's cache layout, passed as its (B, L, Hkv, D) view: each
    # head's keys are contiguous, which the decode kernel streams at twice the speed of (B, L, Hkv, D) rows
    caches = {name: [torch.randn(1, KV_HEADS, cache_len + 1, HEAD_DIM, generator=g).to(dtype).transpose(1, 2)
                     for _ in range(2)] for name in ("composed", "fused")}
    lengths = torch.tensor([cache_len], dtype=torch.int32)
    cos, sin, cos_full, sin_full = tables(torch.tensor([cache_len]), dtype)
    with torch.no_grad():
        samples = time_interleaved({
            "composed": lambda: composed_block(x, w, cos_full, sin_full, (*caches["composed"], lengths)),
            "fused": lambda: fused_block(x, w, cos[None], sin[None], (*caches["fused"], lengths)),
        }, reps=reps, warmup=2, iters=iters, clock=time.thread_time)
    return samples


def memory_child(block_name, seqlen, dtype_name):
    """Peak bytes added by one forward + backward of the block (run in a fresh process)."""
    dtype = DTYPES[dtype_name]
    torch.set_num_threads(1)
    block = {"composed": composed_block, "fused": fused_block}[block_name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, seqlen, HIDDEN, generator=g).to(dtype).requires_grad_()
    cos, sin, cos_full, sin_full = tables(torch.arange(seqlen), dtype)
    w = Weights(dtype, grad=True)
    dy = torch.randn(1, seqlen, HIDDEN, generator=g).to(dtype)
    rope = (cos_full, sin_full) if block_name == "composed" else (cos, sin)
    block(x[:, :16].detach().requires_grad_(), w, *(t[..., :16, :] for t in rope)).sum().backward()  # warm, small
    for t in [x] + w.leaves():
        t.grad = None

    def run():
        torch.autograd.backward(block(x, w, *rope), dy)

    _, peak = peak_memory(run)
    print(json.dumps({"peak": peak}))


def bench_memory(seqlen, dtype_name):
    out = {}
    for name in ("composed", "fused"):
        res = subprocess.run([sys.executable, __file__, "--memory-child", name, str(seqlen), dtype_name],
                             capture_output=True, text=True, check=True, env=dict(os.environ))
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])["peak"]
    return out


# ------------------------------------------------------------------------------------- the model


def model_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096,
                       rms_norm_eps=1e-6, tie_word_embeddings=False)


def bench_model(dtype, prompt, new_tokens, train_len, reps):
    import transformers  # noqa: F401
    import tileattn.integrations.transformers as tt

    tt.register()
    config = model_config()
    torch.manual_seed(0)
    models = {}
    for name, impl in (("sdpa", "sdpa"), ("tileattn", "tileattn"), ("tileattn+fuse", "tileattn")):
        m = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl).to(dtype).eval()
        if models:
            m.load_state_dict(next(iter(models.values())).state_dict())
        models[name] = tt.fuse(m) if name.endswith("fuse") else m
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (1, prompt), generator=g)
    train_ids = torch.randint(0, config.vocab_size, (1, train_len), generator=g)
    rows = []

    def prefill(m):
        return lambda: m(input_ids=ids, use_cache=False, logits_to_keep=1)

    with torch.no_grad():
        samples = time_interleaved({n: prefill(m) for n, m in models.items()}, reps=reps, warmup=1,
                                   clock=time.thread_time)
    rows += _model_rows("prefill tokens/s", samples, lambda s: prompt / s, dtype, prompt)

    def decode(m):
        # a generate of new_tokens greedy steps after the prompt; the prompt's prefill is timed apart and removed
        def run():
            m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return run

    with torch.no_grad():
        gen = time_interleaved({n: decode(m) for n, m in models.items()}, reps=reps, warmup=1, clock=time.thread_time)
        pre = time_interleaved({n: prefill(m) for n, m in models.items()}, reps=reps, warmup=0,
                               clock=time.thread_time)
    steps = {n: [(a - b) / (new_tokens - 1) for a, b in zip(gen[n], pre[n])] for n in models}
    rows += _model_rows("decode step ms", steps, lambda s: s * 1e3, dtype, prompt)

    def train(m):
        def run():
            m.train()
            m(input_ids=train_ids, labels=train_ids).loss.backward()
            m.zero_grad(set_to_none=True)
        return run

    samples = time_interleaved({n: train(m) for n, m in models.items()}, reps=reps, warmup=1, clock=time.thread_time)
    rows += _model_rows("training step s", samples, lambda s: s, dtype, train_len)
    return rows


def _model_rows(what, samples, value, dtype, length):
    base = samples["sdpa"]
    rows = []
    for name, s in samples.items():
        vs = [value(x) for x in s]
        # the speed-up over sdpa of each round (tokens/s: ours / sdpa; times: sdpa / ours)
        speed = [value(x) / value(b) if "tokens/s" in what else value(b) / value(x) for x, b in zip(s, base)]
        rows.append(dict(section="model", what=what, contender=name, dtype=str(dtype).replace("torch.", ""),
                         length=length, value=statistics.median(vs), speedup_vs_sdpa=statistics.median(speed),
                         speedup_min=min(speed), speedup_max=max(speed)))
    return rows


# ------------------------------------------------------------------------------------------- main


def plot(rows, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    block = [r for r in rows if r["section"] in ("block", "decode")]
    if not block:
        return
    fig, ax = plt.subplots(figsize=(8, 3.8))
    labels = [f"{r['dtype']} {r['pass']}\nS={r['length']}" for r in block]
    ratios = [r["speedup"] for r in block]
    colors = ["#4c72b0" if r["dtype"] == "float32" else "#dd8452" for r in block]
    ax.bar(range(len(block)), ratios, color=colors)
    ax.set_yscale("log")
    ax.axhline(1.0, color="k", lw=0.8)
    for i, r in enumerate(ratios):
        ax.text(i, r, f"{r:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(block)), labels, fontsize=6, rotation=60)
    ax.set_ylabel("fused / composed speed-up")
    ax.set_title(f"Llama attention half (2048, 16/8 heads, D 128), one thread, {rows[0]['cpu']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(out).with_suffix(".png"), dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default="block,decode,memory,model")
    p.add_argument("--seqlens", default="512,2048,8192")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--passes", default="fwd,fwd+bwd")
    p.add_argument("--cache", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget", type=float, default=120.0, help="seconds of timed rounds per block row")
    p.add_argument("--long-seqlen", type=int, default=8192)
    p.add_argument("--model-reps", type=int, default=5)
    p.add_argument("--decode-reps", type=int, default=15)
    p.add_argument("--decode-iters", type=int, default=20)
    p.add_argument("--memory-seqlen", type=int, default=2048)
    p.add_argument("--model-dtypes", default="fp32")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=17)
    p.add_argument("--train-len", type=int, default=256)
    p.add_argument("--out", default=str(RESULTS / "fused"))
    p.add_argument("--memory-child", nargs=3, metavar=("BLOCK", "SEQLEN", "DTYPE"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.memory_child:
        name, seqlen, dtype_name = args.memory_child
        return memory_child(name, int(seqlen), dtype_name)
    torch.set_num_threads(args.threads)
    sections = args.sections.split(",")
    cpu = cpu_model()
    meta = dict(cpu=cpu, flags=cpu_flags(), threads=args.threads, torch=torch.__version__, load_before=loadavg(),
                clock="thread CPU time (time.thread_time), contenders interleaved",
                native_fused=fused.available())
    rows = []

    def add(row):
        row = dict(row, cpu=cpu, threads=args.threads, load=loadavg())
        rows.append(row)
        print(json.dumps(row), flush=True)

    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        if "block" in sections:
            for seqlen in (int(s) for s in args.seqlens.split(",")):
                for pname in args.passes.split(","):
                    backward = pname == "fwd+bwd"
                    # the composed bf16 backward runs torch's bf16 GEMMs (about 1 GFLOP/s on a CPU without
                    # bf16 instructions): at --long-seqlen and above one unwarmed round (~7 min at 8k) only
                    long = dtype == torch.bfloat16 and backward and seqlen >= args.long_seqlen
                    s = bench_block(seqlen, dtype, backward, args.budget, long)
                    reps = len(s["fused"])
                    ratio = _ratios(s, "composed", "fused")
                    add(dict(section="block", dtype=str(dtype).replace("torch.", ""), length=seqlen, **{"pass": pname},
                             composed_s=statistics.median(s["composed"]), fused_s=statistics.median(s["fused"]),
                             speedup=statistics.median(ratio), speedup_min=min(ratio), speedup_max=max(ratio),
                             target=1.15, reps=reps))
        if "decode" in sections:
            s = bench_decode(args.cache, dtype, args.decode_reps, args.decode_iters)
            ratio = _ratios(s, "composed", "fused")
            add(dict(section="decode", dtype=str(dtype).replace("torch.", ""), length=args.cache, **{"pass": "decode"},
                     composed_s=statistics.median(s["composed"]), fused_s=statistics.median(s["fused"]),
                     speedup=statistics.median(ratio), speedup_min=min(ratio), speedup_max=max(ratio), target=1.3,
                     reps=args.decode_reps))
        if "memory" in sections:
            m = bench_memory(args.memory_seqlen, dname)
            add(dict(section="memory", dtype=str(dtype).replace("torch.", ""), length=args.memory_seqlen,
                     **{"pass": "fwd+bwd peak MiB"}, composed_s=m["composed"] / 2 ** 20,
                     fused_s=m["fused"] / 2 ** 20, speedup=m["composed"] / max(m["fused"], 1), speedup_min=math.nan,
                     speedup_max=math.nan, target=1.0, reps=1))
    model_rows = []
    if "model" in sections:
        for dname in args.model_dtypes.split(","):
            for row in bench_model(DTYPES[dname], args.prompt, args.new_tokens, args.train_len,
                                   args.model_reps):
                add(row)
                model_rows.append(rows.pop())
    meta["load_after"] = loadavg()
    if rows:
        write_results(args.out, rows, meta)
        plot(rows, args.out)
    if model_rows:
        write_results(args.out + "_model", model_rows, dict(meta, model=model_config().to_dict()))


if __name__ == "__main__":
    main()
