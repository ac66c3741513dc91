"""Recipe: an Ascend inference script, unchanged, on CPU (or GPU): prefill and decode with a paged KV cache.

The model code below is written the way Ascend serving code (vllm-ascend) calls
``torch_npu.npu_fused_infer_attention_score``: a paged cache of (num_blocks, block_size, H) for keys
and values, a block table per request, and

* prefill: every prompt packed back to back ("TND"), cumulative query ends in
  ``actual_seq_lengths``, cached lengths in ``actual_seq_lengths_kv``, ``sparse_mode=3`` with the
  2048x2048 causal template (causal counted from each request's bottom-right corner);
* decode: one new token per request ("BSH", Q_S = 1) against everything cached so far;
* chunked prefill: a further chunk of several tokens per request against its whole cache (the
  query is shorter than the keys, and causality counts from the bottom-right corner).

On an Ascend NPU ``import torch_npu`` finds the real package. Anywhere else the import line falls
back to tileattn, which serves the same op (``python -m tileattn.npu this_script.py`` does the same
without the fallback). Each step is checked against ``tileattn.reference`` on the requests' keys and
values laid out contiguously, with FlashAttention's 2x accuracy rule.

    python hub/recipes/ascend_inference.py
"""

import os

import torch

try:
    import torch_npu
except ImportError:  # no Ascend NPU here: tileattn stands in for torch_npu
    import tileattn.npu

    tileattn.npu.install()
    import torch_npu

import tileattn
from tileattn.core.testing import judge

SMALL = os.environ.get("TILEATTN_SMALL") == "1"
HEADS, KV_HEADS, HEAD_DIM = (4, 2, 16) if SMALL else (16, 4, 128)
BLOCK_SIZE, NUM_BLOCKS = (16, 32) if SMALL else (128, 96)
PROMPTS = [37, 5, 20] if SMALL else [700, 96, 1500, 333]
DECODE_STEPS = 3 if SMALL else 8
CHUNKS = [4, 1, 6] if SMALL else [64, 7, 200, 33]
CAUSAL_TEMPLATE = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
CHECKS = []


# ----- Serving code as written for torch_npu (unchanged) ---------------------------------------------

class PagedAttention:
    """One attention layer's cache and its two calls, vllm-ascend style."""

    def __init__(self, num_blocks, block_size, kv_heads, head_dim, dtype):
        shape = (num_blocks, block_size, kv_heads * head_dim)
        self.key_cache = torch.zeros(shape, dtype=dtype).npu()
        self.value_cache = torch.zeros(shape, dtype=dtype).npu()
        self.block_size = block_size

    def write(self, key, value, slots):
        """Scatter new tokens' keys/values (T, Hkv*D) into their cache slots (block * size + offset)."""
        self.key_cache.view(-1, self.key_cache.shape[-1])[slots] = key
        self.value_cache.view(-1, self.value_cache.shape[-1])[slots] = value

    def prefill(self, query, block_table, query_lens, context_lens):
        # query: (T, N, D) packed prompts; actual_seq_lengths are cumulative query ends.
        ends = torch.tensor(query_lens).cumsum(0).tolist()
        out, _ = torch_npu.npu_fused_infer_attention_score(
            query, self.key_cache, self.value_cache, atten_mask=CAUSAL_TEMPLATE.npu(), block_table=block_table,
            input_layout="TND", block_size=self.block_size, actual_seq_lengths=ends,
            actual_seq_lengths_kv=context_lens, num_key_value_heads=KV_HEADS, num_heads=HEADS,
            scale=HEAD_DIM ** -0.5, sparse_mode=3)
        return out

    def decode(self, query, block_table, context_lens):
        # query: (B, 1, N*D), one new token per request.
        out, _ = torch_npu.npu_fused_infer_attention_score(
            query, self.key_cache, self.value_cache, num_heads=HEADS, num_key_value_heads=KV_HEADS,
            input_layout="BSH", block_size=self.block_size, scale=HEAD_DIM ** -0.5, block_table=block_table,
            actual_seq_lengths=[1] * len(context_lens), actual_seq_lengths_kv=context_lens)
        return out


# ----- Driver and checks ----------------------------------------------------------------------------

def allocate(lengths, capacity, block_size):
    """A block table with room for ``capacity`` tokens per request, blocks handed out shuffled."""
    per_request = -(-capacity // block_size)
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0))
    assert len(lengths) * per_request <= NUM_BLOCKS
    return order[: len(lengths) * per_request].view(len(lengths), per_request).to(torch.int32)


def slots_of(block_table, request, positions, block_size):
    return block_table[request, positions // block_size].long() * block_size + positions % block_size


def verify(name, got, q, k, v, causal):
    """``got`` against the reference on contiguous keys/values (q (1, S, N, D), k/v (1, Sk, Hkv, D))."""
    oracle = tileattn.reference(q, k, v, layout="BSND", causal=causal, scale=HEAD_DIM ** -0.5,
                                compute_dtype=torch.float64)
    plain = tileattn.reference(q, k, v, layout="BSND", causal=causal, scale=HEAD_DIM ** -0.5)
    verdict = judge(name, got, oracle, plain, q.dtype)
    CHECKS.append(verdict.ok)
    return verdict


def main():
    torch.manual_seed(0)
    dtype = torch.float32
    layer = PagedAttention(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype)
    print(f"npu_fused_infer_attention_score from {torch_npu.npu_fused_infer_attention_score.__module__}; "
          f"prompts {PROMPTS}, block size {BLOCK_SIZE}, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}")
    table = allocate(PROMPTS, max(p + c for p, c in zip(PROMPTS, CHUNKS)) + DECODE_STEPS, BLOCK_SIZE)
    # Every token's key/value, kept contiguous per request for the checks.
    keys = [torch.randn(n, KV_HEADS, HEAD_DIM, dtype=dtype) for n in PROMPTS]
    values = [torch.randn(n, KV_HEADS, HEAD_DIM, dtype=dtype) for n in PROMPTS]

    # Prefill: write every prompt's keys/values, then one call for all prompts.
    for r, n in enumerate(PROMPTS):
        slots = slots_of(table, r, torch.arange(n), BLOCK_SIZE)
        layer.write(keys[r].flatten(1), values[r].flatten(1), slots)
    query = torch.randn(sum(PROMPTS), HEADS, HEAD_DIM, dtype=dtype)
    out = layer.prefill(query, table, PROMPTS, list(PROMPTS))
    start = 0
    worst = None
    for r, n in enumerate(PROMPTS):
        verdict = verify(f"prefill request {r}", out[start:start + n][None], query[start:start + n][None],
                         keys[r][None], values[r][None], causal=True)
        worst = verdict if worst is None or verdict.error > worst.error else worst
        start += n
    print(f"   prefill of {len(PROMPTS)} packed prompts: {worst}")

    # Decode: one token per request and step, appended to the cache first.
    lengths = list(PROMPTS)
    for step in range(DECODE_STEPS):
        new_k = torch.randn(len(PROMPTS), KV_HEADS, HEAD_DIM, dtype=dtype)
        new_v = torch.randn(len(PROMPTS), KV_HEADS, HEAD_DIM, dtype=dtype)
        for r in range(len(PROMPTS)):
            layer.write(new_k[r].flatten()[None], new_v[r].flatten()[None],
                        slots_of(table, r, torch.tensor([lengths[r]]), BLOCK_SIZE))
            keys[r] = torch.cat([keys[r], new_k[r][None]])
            values[r] = torch.cat([values[r], new_v[r][None]])
            lengths[r] += 1
        query = torch.randn(len(PROMPTS), 1, HEADS * HEAD_DIM, dtype=dtype)
        out = layer.decode(query, table, lengths)
        verdicts = [verify(f"decode step {step} request {r}", out[r:r + 1].unflatten(-1, (HEADS, HEAD_DIM)),
                           query[r:r + 1].unflatten(-1, (HEADS, HEAD_DIM)), keys[r][None], values[r][None],
                           causal=False) for r in range(len(PROMPTS))]
        print(f"   decode step {step} (cached lengths {lengths}): {max(verdicts, key=lambda v: v.error)}")

    # Chunked prefill: a chunk of new tokens per request, attending to all of its cache.
    query = torch.randn(sum(CHUNKS), HEADS, HEAD_DIM, dtype=dtype)
    for r, n in enumerate(CHUNKS):
        new_k = torch.randn(n, KV_HEADS, HEAD_DIM, dtype=dtype)
        new_v = torch.randn(n, KV_HEADS, HEAD_DIM, dtype=dtype)
        layer.write(new_k.flatten(1), new_v.flatten(1), slots_of(table, r, lengths[r] + torch.arange(n), BLOCK_SIZE))
        keys[r], values[r] = torch.cat([keys[r], new_k]), torch.cat([values[r], new_v])
        lengths[r] += n
    out = layer.prefill(query, table, CHUNKS, lengths)
    start, worst = 0, None
    for r, n in enumerate(CHUNKS):
        verdict = verify(f"chunked prefill request {r}", out[start:start + n][None], query[start:start + n][None],
                         keys[r][None], values[r][None], causal=True)
        worst = verdict if worst is None or verdict.error > worst.error else worst
        start += n
    print(f"   chunked prefill of {CHUNKS} tokens on caches of {lengths}: {worst}")

    if not all(CHECKS):
        raise SystemExit(f"ascend inference recipe FAILED: {CHECKS.count(False)} check(s)")
    print(f"ascend inference recipe passed ({len(CHECKS)} checks)")


if __name__ == "__main__":
    main()
