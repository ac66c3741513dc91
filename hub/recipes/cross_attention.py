"""Recipe: Stable-Diffusion-style cross-attention (image tokens attending to text tokens).

In a Stable Diffusion 1.x UNet, the first cross-attention layer sees a 64x64 latent (4096 image
tokens, 320 channels = 8 heads x 40) attend to the 77 tokens of the CLIP text encoding. Queries and
keys have different lengths (Sq=4096, Sk=77) and head dim 40 is not a power of two: both are fine.

The hidden states stay in the model's (batch, tokens, channels) layout: ``layout="BSH"`` with
``num_heads`` splits the heads on the fly, no reshape or transpose copies. Forward and backward
(training the UNet) are checked against the fp64 reference with FlashAttention's 2x rule.

    python hub/recipes/cross_attention.py
    TILEATTN_SMALL=1 python hub/recipes/cross_attention.py     # 16x16 latent
"""

import os
import time

import torch
import torch.nn.functional as F

import tileattn
from tileattn.core.testing import check_against_reference

SMALL = os.environ.get("TILEATTN_SMALL") == "1"
BATCH, HEADS, HEAD_DIM = 2, 8, 40
IMAGE_TOKENS = (16 * 16) if SMALL else (64 * 64)
TEXT_TOKENS, TEXT_DIM = 77, 768


class CrossAttention(torch.nn.Module):
    """The UNet's attention block with tileattn in place of the attention product."""

    def __init__(self, channels, context_dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q = torch.nn.Linear(channels, channels, bias=False)
        self.to_k = torch.nn.Linear(context_dim, channels, bias=False)
        self.to_v = torch.nn.Linear(context_dim, channels, bias=False)
        self.to_out = torch.nn.Linear(channels, channels)

    def forward(self, x, context, backend="auto"):
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        if backend == "sdpa":  # what diffusers does by default, for comparison
            split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # noqa: E731
            out = F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).flatten(2)
        else:
            out = tileattn.flash_attention(q, k, v, layout="BSH", num_heads=self.heads, backend=backend)
        return self.to_out(out)


def main():
    torch.manual_seed(0)
    channels = HEADS * HEAD_DIM
    x = torch.randn(BATCH, IMAGE_TOKENS, channels)
    context = torch.randn(BATCH, TEXT_TOKENS, TEXT_DIM)
    block = CrossAttention(channels, TEXT_DIM, HEADS)
    print(f"{BATCH} images x {IMAGE_TOKENS} tokens attend to {TEXT_TOKENS} text tokens; {HEADS} heads x {HEAD_DIM}")

    # 1. The attention product itself, forward and backward, against the fp64 reference.
    with torch.no_grad():
        q, k, v = block.to_q(x), block.to_k(context), block.to_v(context)
    verdicts = check_against_reference(tileattn.flash_attention, q, k, v, layout="BSH", num_heads=HEADS)
    for verdict in verdicts:
        print("  ", verdict)
    if not all(x_.ok for x_ in verdicts):
        raise SystemExit("cross-attention FAILED the accuracy rule")

    # 2. The whole block: tileattn vs SDPA, output and parameter gradients.
    results = {}
    for backend in ("auto", "sdpa"):
        block.zero_grad()
        t0 = time.perf_counter()
        y = block(x, context, backend=backend)
        y.square().mean().backward()
        results[backend] = (y.detach(), block.to_k.weight.grad.clone(), time.perf_counter() - t0)
    dy = (results["auto"][0] - results["sdpa"][0]).abs().max().item()
    dgrad = (results["auto"][1] - results["sdpa"][1]).abs().max().item()
    scale_y = results["sdpa"][0].abs().max().item()
    scale_g = results["sdpa"][1].abs().max().item()
    print(f"block output max|tileattn - SDPA| {dy:.2e} (of {scale_y:.2e}); to_k grad {dgrad:.2e} (of {scale_g:.2e}); "
          f"fwd+bwd {results['auto'][2] * 1e3:.0f} ms vs SDPA {results['sdpa'][2] * 1e3:.0f} ms")
    # Relative to each quantity's own magnitude: fp32 rounding is ~1e-7 relative, 1e-4 leaves room
    # for the different summation orders but catches any real disagreement.
    if not (dy <= 1e-4 * scale_y and dgrad <= 1e-4 * scale_g):
        raise SystemExit("cross-attention block disagrees with SDPA beyond fp32 rounding")
    print("cross-attention recipe passed")


if __name__ == "__main__":
    main()
