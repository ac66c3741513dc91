"""A transformers script as an Ascend user runs it: a tiny Llama with attn_implementation="flash_attention_2",
which transformers routes to its own NPU integration (transformers.integrations.npu_flash_attention ->
torch_npu.npu_fusion_attention). Run under `python -m tileattn.npu`, torch_npu is tileattn.npu.

Against the same model on sdpa: a left-padded batch (transformers unpads it: TND calls), an unpadded
batch (BSND calls), greedy generate() with the KV cache (decode: one query against the cache), and
a training step's loss and gradients; once with transformers' default bottom-right causal mask
(SPARSE_MODE=3) and once with top-left (2), set as NPU_FA2_SPARSE_MODE=2 sets it at import.
Prints one line per check; exits non-zero on a mismatch.
"""

import copy
import sys

import torch
import torch_npu  # noqa: F401  (tileattn.npu under python -m tileattn.npu)
import transformers.integrations.flash_attention as hf_flash
import transformers.integrations.npu_flash_attention as npu_integration
from transformers import LlamaConfig, LlamaForCausalLM

assert torch.npu.is_available(), "torch.npu is tileattn's stand-in under python -m tileattn.npu"
calls = []
real = npu_integration.npu_fusion_attention


def counted(*args, **kwargs):
    calls.append((args[4] if len(args) > 4 else kwargs["input_layout"], kwargs.get("sparse_mode", 0)))
    return real(*args, **kwargs)


npu_integration.npu_fusion_attention = counted
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
fa = LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="flash_attention_2",
                                  torch_dtype=torch.float32).eval()
ref = LlamaForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="sdpa", torch_dtype=torch.float32).eval()
ref.load_state_dict(fa.state_dict())
assert fa.config._attn_implementation == "flash_attention_2" and ref.config._attn_implementation == "sdpa"
failures = []


def check(name, a, b, tol=1e-4):
    diff = (a - b).abs().max().item()
    print(f"  {name}: max diff {diff:.2e}")
    if not diff <= tol:
        failures.append(name)


ids = torch.randint(1, 96, (2, 9))
mask = torch.ones(2, 9, dtype=torch.long)
mask[1, :4] = 0  # left padding
labels = ids.masked_fill(mask == 0, -100)
for sparse_mode in (3, 2):
    npu_integration.SPARSE_MODE = sparse_mode
    hf_flash._use_top_left_mask = sparse_mode == 2
    calls.clear()
    print(f"SPARSE_MODE={sparse_mode}")
    with torch.no_grad():
        check("left-padded prefill", fa(ids, attention_mask=mask).logits[mask.bool()],
              ref(ids, attention_mask=mask).logits[mask.bool()])
        check("unpadded prefill", fa(ids).logits, ref(ids).logits)
        same = torch.equal(fa.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False),
                           ref.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False))
    print(f"  greedy tokens equal: {same}")
    if not same:
        failures.append("generate")
    fa.zero_grad()
    ref.zero_grad()
    loss_fa = fa.train()(ids, attention_mask=mask, labels=labels).loss
    loss_ref = ref.train()(ids, attention_mask=mask, labels=labels).loss
    loss_fa.backward()
    loss_ref.backward()
    fa.eval()
    ref.eval()
    check("training loss", loss_fa.detach(), loss_ref.detach())
    check("gradients", torch.cat([p.grad.flatten() for p in fa.parameters()]),
          torch.cat([p.grad.flatten() for p in ref.parameters()]))
    layouts, modes = sorted({c[0] for c in calls}), sorted({c[1] for c in calls})
    print(f"  npu_fusion_attention calls: {len(calls)}, layouts {layouts}, sparse modes {modes}")
    # Bottom-right causal serves decode too; with top-left, transformers makes one-token decode calls
    # non-causal (mode 0).
    if layouts != ["BSND", "TND"] or modes != ([3] if sparse_mode == 3 else [0, 2]):
        failures.append(f"call pattern (SPARSE_MODE={sparse_mode})")
if failures:
    print("FAILED:", ", ".join(failures))
    sys.exit(1)
print("ok")
