"""The user-function programs of the aarch64 harness (scripts/aarch64/harness.c), generated here by
tileattn.programs from Python functions exactly as a call's score_mod / mask_mod would be, so the
harness runs the code tileattn generates, cross-compiled. One C file per program and working
precision, its functions renamed with a suffix (_f32, _f64) so both link into the harness:

    python scripts/aarch64/user_programs.py OUTDIR

The harness's reference computes the same functions in double (harness.c: ref_score, ref_mask)."""

import sys
from pathlib import Path

import torch

from tileattn.programs import codegen
from tileattn.programs.trace import structure, trace


def score_mod(s, b, h, q_idx, kv_idx):
    return 10 * torch.tanh(s / 10) - 0.05 * (q_idx - kv_idx).abs()


def mask_mod(b, h, q_idx, kv_idx):
    return (kv_idx % 5) != 2


NAMES = ("ta_user_score", "ta_user_score_rows", "ta_user_score_bwd", "ta_user_logits", "ta_user_mask",
         "ta_user_mask_rows")


def main(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    for kind, fn, dtypes in (("score", score_mod, (torch.float32, torch.float64)), ("mask", mask_mod, (None,))):
        for dtype in dtypes:
            traced = trace(fn, kind, dtype, structure(fn), runtime_scalars=False)
            generated = codegen.generate(traced, kind, [])
            assert not generated.captures, "the harness passes no captures"
            suffix = {torch.float32: "_f32", torch.float64: "_f64", None: ""}[dtype]
            renames = "".join(f"#define {name} {name}{suffix}\n" for name in NAMES)
            (out / f"user_{kind}{suffix}.c").write_text(renames + generated.source)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
