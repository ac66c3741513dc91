"""Recipe: continuous batching over a paged, quantised KV cache, against SDPA on padded caches.

A small synthetic decoder (random weights, greedy decoding; no download) serves a few dozen requests
of mixed prompt and output lengths the way a CPU inference server does:

* one paged pool per layer for keys and one for values, int8 with a per-token, per-head scale
  (:mod:`tileattn.serving` quantises each new token as it is stored, in place);
* continuous batching: every step packs the running requests' new tokens back to back -- prompt
  chunks of requests that are prefilling, one token for those decoding -- and each layer makes ONE
  ragged ``tileattn.flash_attention(layout="TND", cu_seqlens_q=, block_table=, seqused_k=,
  causal=True, k_scale=, v_scale=)`` call over the pool, causal at each sequence's end; finished
  requests free their pages and waiting ones start;
* the same loop with ``torch.nn.functional.scaled_dot_product_attention`` on padded bf16 caches
  (B, Hkv, S_max, D), one call per layer per step with a mask for lengths and causality.

It reports tokens per second, time to first token and bytes per cached token of both, and checks
(on every step of the first requests) each ragged call against ``tileattn.reference`` in fp64 over
the dequantised cache with FlashAttention's 2x rule, and the exact bytes of both caches. No claim
about speed is checked: that depends on the machine.

    python hub/recipes/serving_quantised_cache.py
"""

import math
import os
import time

import torch
import torch.nn.functional as F

import tileattn
from tileattn.serving import store
from tileattn.core.testing import judge

SMALL = os.environ.get("TILEATTN_SMALL") == "1"
LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = (2, 4, 2, 32, 97) if SMALL else (4, 8, 2, 64, 1000)
REQUESTS, MAX_RUNNING, CHUNK = (24, 8, 32) if SMALL else (32, 16, 128)
PROMPT_RANGE, OUTPUT_RANGE = ((3, 70), (2, 9)) if SMALL else ((16, 600), (8, 32))
PAGE = 16
DTYPE = torch.bfloat16
CHECKS = []


class Decoder:
    """Embedding, LAYERS x (norm, q/k/v/o projections, MLP), LM head: random bf16 weights."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        hidden = HEADS * HEAD_DIM

        def w(*shape):
            return (torch.randn(shape, generator=g) / math.sqrt(shape[0])).to(DTYPE)

        self.embed = w(VOCAB, hidden) * math.sqrt(VOCAB)
        self.layers = [dict(q=w(hidden, hidden), k=w(hidden, KV_HEADS * HEAD_DIM), v=w(hidden, KV_HEADS * HEAD_DIM),
                            o=w(hidden, hidden), up=w(hidden, 2 * hidden), down=w(2 * hidden, hidden))
                       for _ in range(LAYERS)]
        self.head = w(hidden, VOCAB)

    def forward(self, tokens, attend):
        """Logits of the last token of each sequence; ``attend(layer, q, k, v)`` is the attention of
        the step's packed tokens (T, H, D) for that layer (it also stores k and v in the cache)."""
        x = self.embed[tokens]
        for i, p in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],))
            q, k, v = (h @ p[n] for n in "qkv")
            a = attend(i, q.unflatten(-1, (HEADS, HEAD_DIM)), k.unflatten(-1, (KV_HEADS, HEAD_DIM)),
                       v.unflatten(-1, (KV_HEADS, HEAD_DIM)))
            x = x + a.flatten(-2) @ p["o"]
            x = x + F.silu(F.rms_norm(x, (x.shape[-1],)) @ p["up"]) @ p["down"]
        return F.rms_norm(x, (x.shape[-1],)) @ self.head


class PagedInt8Cache:
    """Per layer: int8 pools (pages, PAGE, Hkv, D) and fp32 scale pools (pages, PAGE, Hkv, 1)."""

    def __init__(self, pages):
        self.k = [torch.zeros(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.int8) for _ in range(LAYERS)]
        self.v = [torch.zeros(pages, PAGE, KV_HEADS, HEAD_DIM, dtype=torch.int8) for _ in range(LAYERS)]
        self.ks = [torch.zeros(pages, PAGE, KV_HEADS, 1) for _ in range(LAYERS)]
        self.vs = [torch.zeros(pages, PAGE, KV_HEADS, 1) for _ in range(LAYERS)]
        self.free = list(range(pages))

    @staticmethod
    def bytes_per_token():
        return LAYERS * 2 * KV_HEADS * (HEAD_DIM * 1 + 4)  # int8 values + one fp32 scale per head


def schedule(requests):
    """(arrival order, prompt length, output length) of every request, mixed lengths."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(*PROMPT_RANGE, (requests,), generator=g).tolist()
    outputs = torch.randint(*OUTPUT_RANGE, (requests,), generator=g).tolist()
    tokens = [torch.randint(0, VOCAB, (n,), generator=g) for n in prompts]
    return tokens, outputs


class Request:
    def __init__(self, rid, prompt, max_new):
        self.rid, self.prompt, self.max_new = rid, prompt, max_new
        self.done_prompt, self.generated, self.pages, self.ttft = 0, [], [], None

    @property
    def cached(self):
        return self.done_prompt + max(0, len(self.generated) - 1)

    def next_tokens(self):
        if self.done_prompt < len(self.prompt):
            return self.prompt[self.done_prompt:self.done_prompt + CHUNK]
        return torch.tensor(self.generated[-1:])


def advance(running, q_lens, logits, start):
    """After one step: count each request's prompt chunk (its time to first token when the prompt is
    done), append the greedy token of those generating, and take the finished ones out of
    ``running``; returns them, for the caller to free what they held."""
    now, done = time.perf_counter(), []
    for r, n, row in zip(list(running), q_lens, logits):
        if r.done_prompt < len(r.prompt):
            r.done_prompt += n
            if r.done_prompt < len(r.prompt):
                continue
            r.ttft = now - start
        r.generated.append(int(row.argmax()))
        if len(r.generated) >= r.max_new:
            running.remove(r)
            done.append(r)
    return done


def serve_paged(model, prompts, outputs, check_first):
    """Continuous batching with ragged calls over the int8 pool; (tokens generated, seconds, TTFTs)."""
    pages_needed = sum(-(-(len(p) + n) // PAGE) for p, n in zip(prompts, outputs))
    cache = PagedInt8Cache(pages_needed)
    waiting = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, outputs))]
    running, finished, step_checks = [], [], 0
    start = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < MAX_RUNNING:
            running.append(waiting.pop(0))
        chunks = [r.next_tokens() for r in running]
        q_lens = [len(c) for c in chunks]
        starts = [r.cached for r in running]
        for r, n, s in zip(running, q_lens, starts):  # pages for the new tokens
            while len(r.pages) * PAGE < s + n:
                r.pages.append(cache.free.pop())
        width = max(len(r.pages) for r in running)
        table = torch.tensor([r.pages + [0] * (width - len(r.pages)) for r in running], dtype=torch.int32)
        slots = torch.cat([torch.tensor(r.pages)[(s + torch.arange(n)) // PAGE] * PAGE + (s + torch.arange(n)) % PAGE
                           for r, n, s in zip(running, q_lens, starts)])
        cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        used = torch.tensor([s + n for s, n in zip(starts, q_lens)], dtype=torch.int32)
        checking = step_checks < check_first

        def attend(i, q, k, v):
            store(cache.k[i], slots, k, scale_cache=cache.ks[i])
            store(cache.v[i], slots, v, scale_cache=cache.vs[i])
            kw = dict(layout="TND", cu_seqlens_q=cu_q, block_table=table, seqused_k=used, causal=True)
            out = tileattn.flash_attention(q, cache.k[i], cache.v[i], k_scale=cache.ks[i], v_scale=cache.vs[i], **kw)
            if checking:
                kd, vd = cache.k[i].double() * cache.ks[i].double(), cache.v[i].double() * cache.vs[i].double()
                oracle = tileattn.reference(q.double(), kd, vd, **kw)
                verdict = judge(f"ragged int8 step layer {i}", out, oracle,
                                tileattn.reference(q, kd.to(DTYPE), vd.to(DTYPE), **kw), DTYPE)
                CHECKS.append(verdict.ok)
                if not verdict.ok:
                    print("   FAIL", verdict)
            return out

        logits = model.forward(torch.cat(chunks), attend)[cu_q[1:].long() - 1]
        step_checks += 1
        for r in advance(running, q_lens, logits, start):
            cache.free += r.pages
            finished.append(r)
    seconds = time.perf_counter() - start
    return sum(len(r.generated) for r in finished), seconds, [r.ttft for r in finished]


def serve_padded_sdpa(model, prompts, outputs):
    """The same continuous batching with SDPA over padded bf16 caches (one slot of S_max per running
    request): every layer one SDPA call on (B, H, max new tokens, S_max) with a mask."""
    s_max = max(len(p) + n for p, n in zip(prompts, outputs))
    k_cache = [torch.zeros(MAX_RUNNING, KV_HEADS, s_max, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS)]
    v_cache = [torch.zeros(MAX_RUNNING, KV_HEADS, s_max, HEAD_DIM, dtype=DTYPE) for _ in range(LAYERS)]
    free_slots = list(range(MAX_RUNNING))
    waiting = [Request(i, p, n) for i, (p, n) in enumerate(zip(prompts, outputs))]
    running, finished = [], []
    start = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < MAX_RUNNING:
            r = waiting.pop(0)
            r.slot = free_slots.pop()
            running.append(r)
        chunks = [r.next_tokens() for r in running]
        q_lens = [len(c) for c in chunks]
        starts = [r.cached for r in running]
        sq = max(q_lens)
        cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
        rows = torch.arange(sq)
        keys = torch.arange(s_max)
        valid = torch.stack([(keys[None, :] <= s + rows[:, None]) & (rows[:, None] < n)
                             for s, n in zip(starts, q_lens)])[:, None]  # (B, 1, sq, S_max)
        valid[..., 0] |= True  # padded query rows see one key (their output is dropped), no NaN
        r_slots = [r.slot for r in running]
        slots = torch.tensor(r_slots)

        def attend(i, q, k, v):
            padded_q = torch.zeros(len(running), sq, HEADS, HEAD_DIM, dtype=DTYPE)
            for b, (s, n) in enumerate(zip(starts, q_lens)):
                a = int(cu_q[b])
                k_cache[i][r_slots[b], :, s:s + n] = k[a:a + n].transpose(0, 1)
                v_cache[i][r_slots[b], :, s:s + n] = v[a:a + n].transpose(0, 1)
                padded_q[b, :n] = q[a:a + n]
            out = F.scaled_dot_product_attention(padded_q.transpose(1, 2), k_cache[i][slots], v_cache[i][slots],
                                                 attn_mask=valid, enable_gqa=True)
            return torch.cat([out[b, :, :n].transpose(0, 1) for b, n in enumerate(q_lens)])

        logits = model.forward(torch.cat(chunks), attend)[cu_q[1:] - 1]
        for r in advance(running, q_lens, logits, start):
            free_slots.append(r.slot)
            finished.append(r)
    seconds = time.perf_counter() - start
    return sum(len(r.generated) for r in finished), seconds, [r.ttft for r in finished], s_max


def main():
    torch.manual_seed(0)
    model = Decoder()
    prompts, outputs = schedule(REQUESTS)
    print(f"{REQUESTS} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, outputs "
          f"{min(outputs)}-{max(outputs)}; {LAYERS} layers, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}; "
          f"{MAX_RUNNING} running at most, prefill chunks of {CHUNK}; {torch.get_num_threads()} threads")
    with torch.inference_mode():
        serve_paged(model, prompts, outputs, check_first=4 if SMALL else 2)  # checked run, not timed
        timed = {"paged": [], "sdpa": []}
        for _ in range(1 if SMALL else 2):  # interleaved, the best of each
            timed["paged"].append(serve_paged(model, prompts, outputs, check_first=0))
            timed["sdpa"].append(serve_padded_sdpa(model, prompts, outputs))
    n_paged, t_paged, ttft_paged = min(timed["paged"], key=lambda r: r[1])
    n_sdpa, t_sdpa, ttft_sdpa, s_max = min(timed["sdpa"], key=lambda r: r[1])
    CHECKS.append(n_paged == n_sdpa == sum(outputs))
    int8_bytes = PagedInt8Cache.bytes_per_token()
    bf16_bytes = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2
    CHECKS.append(int8_bytes == LAYERS * 2 * KV_HEADS * (HEAD_DIM + 4) and int8_bytes < 0.6 * bf16_bytes)
    reserved = s_max * bf16_bytes  # a padded slot per running request holds S_max tokens
    print(f"{'':34s} {'tokens/s':>9s} {'TTFT mean':>10s} {'bytes/cached token':>19s}")
    print(f"{'tileattn ragged, paged int8':34s} {n_paged / t_paged:9.1f} {sum(ttft_paged) / len(ttft_paged):9.3f}s "
          f"{int8_bytes:19d}")
    print(f"{'SDPA, padded bf16 caches':34s} {n_sdpa / t_sdpa:9.1f} {sum(ttft_sdpa) / len(ttft_sdpa):9.3f}s "
          f"{bf16_bytes:19d}  (+ padding: {reserved / 1024:.0f} KiB reserved per running request)")
    print(f"speed ratio (tileattn / SDPA): {(n_paged / t_paged) / (n_sdpa / t_sdpa):.2f}x on this machine "
          "(not checked: it depends on the machine)")
    if not all(CHECKS):
        raise SystemExit(f"serving recipe FAILED: {CHECKS.count(False)} check(s)")
    print(f"serving recipe passed ({len(CHECKS)} checks)")


if __name__ == "__main__":
    main()
