"""Recipe: run tileattn's FlashAttention and verify it against PyTorch's SDPA.

The cann-learning-hub recipe of the same name generates random Q/K/V, calls the FlashAttention
operator, compares it with ``scaled_dot_product_attention`` and asserts ``max diff < 1e-3``. Here the
same check runs on the CPU, with one improvement: a fixed ``1e-3`` is too strict for bf16 and too loose
for fp32, so the verdict uses FlashAttention's own rule (error vs an fp64 oracle at most 2x that of
plain PyTorch math in the same dtype), and SDPA is held to the same rule for comparison.

    python hub/recipes/run_flash_attention.py            # B=1, H=32, S=2048, D=128 (as the recipe)
    TILEATTN_SMALL=1 python hub/recipes/run_flash_attention.py
"""

import os
import time

import torch
import torch.nn.functional as F

import tileattn
from tileattn.core.testing import judge, max_error

SMALL = os.environ.get("TILEATTN_SMALL") == "1"
B, H, S, D = (1, 4, 256, 64) if SMALL else (1, 32, 2048, 128)


def timed(fn):
    fn()  # warm-up
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main():
    torch.manual_seed(0)
    print(f"tileattn {tileattn.__version__}, torch {torch.__version__}; B={B} H={H} S={S} D={D}")
    failures = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(B, H, S, D).to(dtype) for _ in range(3))
        for causal in (False, True):
            # scale is explicit, as the NPU operator requires; SDPA's default is the same 1/sqrt(D).
            out_flash, t_flash = timed(lambda: tileattn.flash_attention(q, k, v, scale=D ** -0.5, causal=causal))
            # Sq == Sk, so SDPA's top-left causal mask equals tileattn's bottom-right one.
            out_sdpa, t_sdpa = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
            oracle = tileattn.reference(q, k, v, causal=causal, compute_dtype=torch.float64)
            plain = tileattn.reference(q, k, v, causal=causal)
            ours, theirs = judge("tileattn", out_flash, oracle, plain, dtype), judge("SDPA", out_sdpa, oracle, plain, dtype)
            diff = max_error(out_flash, out_sdpa.double())
            name = f"{str(dtype)[6:]:>8} causal={causal!s:5}"
            print(f"{name}  max|tileattn - SDPA| {diff:.2e}  err vs fp64: tileattn {ours.error:.2e}, "
                  f"SDPA {theirs.error:.2e}, tol {ours.tolerance:.2e}  time {t_flash * 1e3:.1f} / {t_sdpa * 1e3:.1f} ms")
            if not ours.ok:
                failures.append(f"{name}: {ours}")
    if failures:
        raise SystemExit("FlashAttention verification FAILED:\n" + "\n".join(failures))
    print("FlashAttention verification passed: every dtype and mask within FlashAttention's 2x rule")


if __name__ == "__main__":
    main()
