"""Recipe: train a Llama with its sequence sharded over 2 processes (context parallelism).

Each process holds half of every sequence, zigzag-placed for causal balance (chunks r and 3-r of
4), and the attention layers call :func:`tileattn.distributed.context_parallel_attention`, which
rotates K/V between the processes (``mode="ring"``) or trades sequence for heads with an
all-to-all (``mode="ulysses"``). Everything else in the model is per-token, so three things make
sharded training equal to one process:

* **positions**: RoPE must see each token's global position: ``position_ids`` come from
  :func:`tileattn.distributed.positions`, not ``arange`` of the local length;
* **labels**: the next-token targets are shifted on the *whole* sequence, then sharded like the
  inputs (a local shift would pair tokens across a chunk boundary);
* **the loss and gradients**: each process sums its tokens' losses divided by the global token
  count; the gradients are summed over the processes (what data parallelism's all-reduce does
  when the context-parallel ranks are part of its group).

The recipe trains a small random Llama (``from_config``, nothing downloaded) for a few steps on 2
gloo processes in both modes, and checks every step's loss and the first step's gradients
against the same model trained in one process with SDPA. With torchrun instead of the built-in
launcher: ``torchrun --nproc-per-node 2 your_script.py`` and call ``train_on_this_rank`` after
``torch.distributed.init_process_group("gloo")``.

    python hub/recipes/train_llama_context_parallel.py
    TILEATTN_SMALL=1 python hub/recipes/train_llama_context_parallel.py
"""

import os
import time

import torch
import torch.distributed as dist

try:
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.utils import logging as hf_logging
except ImportError as exc:
    raise SystemExit(f"this recipe needs transformers: pip install 'tileattn[transformers]' ({exc})")

import tileattn.distributed as cp
from tileattn.distributed.launch import run_local

SMALL = os.environ.get("TILEATTN_SMALL") == "1"
WORLD = 2
SEQ, STEPS, LAYERS = (96, 2, 2) if SMALL else (1024, 4, 4)
BATCH = 2
MODES = ("ring", "ulysses")


def config():
    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       attention_dropout=0.0)


def cp_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, mode="ring", **kwargs):
    """The model's attention on this rank's shard: query/key/value are (B, H, S_local, D), the
    output (B, S_local, H, D) as transformers wants it. The causal mask is global (the shards know
    their positions), so transformers' local mask is not used."""
    out = cp.context_parallel_attention(query, key, value, causal=True, scale=scaling, mode=mode)
    return out.transpose(1, 2), None


def register():
    for mode in MODES:
        AttentionInterface.register(f"tileattn_cp_{mode}",
                                    lambda *a, _mode=mode, **kw: cp_attention(*a, mode=_mode, **kw))
        AttentionMaskInterface.register(f"tileattn_cp_{mode}", lambda *a, **kw: None)


def data():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config().vocab_size, (STEPS, BATCH, SEQ), generator=gen)
    labels = torch.full_like(ids, -100)
    labels[..., :-1] = ids[..., 1:]  # next-token targets, shifted on the whole sequence
    return ids, labels


def step_loss(model, ids, labels, position_ids, total_targets):
    """Sum of this shard's token losses / the global number of targets."""
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                             reduction="sum") / total_targets


def train_on_this_rank(mode):
    """One rank's training: returns (losses, first-step gradients summed over ranks)."""
    hf_logging.set_verbosity_error()
    register()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    model.set_attn_implementation(f"tileattn_cp_{mode}")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, labels = data()
    position_ids = cp.positions(SEQ).unsqueeze(0)  # global positions of this rank's tokens
    losses, first_grads = [], None
    for step in range(STEPS):
        local_ids = cp.shard(ids[step], seq_dim=1)
        local_labels = cp.shard(labels[step], seq_dim=1)
        loss = step_loss(model, local_ids, local_labels, position_ids, int((labels[step] != -100).sum()))
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # the gradient all-reduce of data parallelism over the CP group
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, first_grads


def worker():
    return {mode: train_on_this_rank(mode) for mode in MODES}


def train_single_process():
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    model.set_attn_implementation("sdpa")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, labels = data()
    losses, first_grads = [], None
    for step in range(STEPS):
        loss = step_loss(model, ids[step], labels[step], None, int((labels[step] != -100).sum()))
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return losses, first_grads


def main():
    print(f"Llama, {LAYERS} layers, batch {BATCH} x {SEQ} tokens, sharded over {WORLD} gloo processes")
    t0 = time.perf_counter()
    results = run_local(worker, WORLD, timeout=600)[0]  # rank 0's report; all ranks agree after all-reduce
    print(f"  context-parallel training: {time.perf_counter() - t0:.1f} s (both modes, with process start)")
    t0 = time.perf_counter()
    want_losses, want_grads = train_single_process()
    print(f"  one process (SDPA):        {time.perf_counter() - t0:.1f} s")
    print("  single-process losses: " + ", ".join(f"{x:.6f}" for x in want_losses))
    for mode in MODES:
        losses, grads = results[mode]
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
        grad_err = max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                       for n, g in want_grads.items())
        print(f"  {mode:>8}: losses " + ", ".join(f"{x:.6f}" for x in losses)
              + f"; max relative loss error {loss_err:.1e}, max gradient error / gradient scale {grad_err:.1e}")
        # fp32 all the way: the only differences are summation orders.
        if loss_err > 1e-5 or grad_err > 1e-4:
            raise SystemExit(f"{mode}: sharded training differs from one process")
    print("train_llama_context_parallel recipe passed: same losses and gradients as one process, ring and ulysses")


if __name__ == "__main__":
    main()
