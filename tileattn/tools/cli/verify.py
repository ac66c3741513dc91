"""``tileattn verify``: every usable backend against the fp64 reference and against PyTorch's SDPA.

Two independent oracles, one rule (FlashAttention's, :mod:`tileattn.core.testing`): a backend's max error
may be at most twice the error of plain math in the input dtype, plus a small floor.

* reference: tileattn's exact reference in fp64 is the oracle, the same reference in the input dtype
  the plain-math yardstick (out, lse, dq, dk, dv).
* sdpa: ``torch.nn.functional.scaled_dot_product_attention`` in fp64 is the oracle, SDPA in the input
  dtype the yardstick (out, dq, dk, dv; SDPA returns no LSE). This catches a semantic error shared by
  a backend and tileattn's own reference. SDPA's ``is_causal`` is top-left aligned, tileattn's
  bottom-right: when Sq != Sk the causal mask is passed explicitly.
"""

from __future__ import annotations

import torch

from .common import (CliError, check_memory, format_table, parse_device, parse_dtype, parse_shape, resolve_backend,
                     SEED_LIMIT, seed_arg, tensor_bytes)

HELP = "check every usable backend against the fp64 reference and PyTorch SDPA"


def add_parser(subparsers):
    p = subparsers.add_parser("verify", help=HELP, description=HELP + ". Exit 1 on any failure.")
    p.add_argument("--shape", default="1,4,256,64", help="B,H,S,D (default 1,4,256,64)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default), fp16, bf16 or fp64")
    p.add_argument("--causal", action="store_true", help="bottom-right aligned causal mask")
    p.add_argument("--backend", default=None, help="check only this backend (default: every usable one)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the random inputs, 0..2**64-1 (default 0)")
    p.add_argument("--device", default="auto", help="auto (default: cuda if visible), cpu or cuda")
    p.set_defaults(func=run)
    return p


def oracle_bytes(b: int, h: int, s: int, d: int) -> int:
    """Rough bytes of checking one (B, H, S, D) call against fp64 oracles with gradients: a dozen
    fp64 copies of q, k, v and their gradients, and the fp64 oracle's materialised score matrices
    (scores, probabilities and their gradients)."""
    return 16 * tensor_bytes((b, h, s, d), 8) + 4 * tensor_bytes((b, h, s, s), 8)


def _sdpa_verdicts(backend_name, q, k, v, causal, seed):
    """Judge the backend's out/dq/dk/dv with SDPA in fp64 as the oracle."""
    import torch.nn.functional as F

    from ... import flash_attention
    from ..bench import bottom_right_causal_mask
    from ...core.testing import judge

    sq, sk = q.shape[2], k.shape[2]
    mask = bottom_right_causal_mask(sq, sk, q.device) if causal and sq != sk else None
    is_causal = causal and mask is None
    gen = torch.Generator(device="cpu").manual_seed((seed + 1) % SEED_LIMIT)
    dout = torch.randn(q.shape[:3] + (v.shape[3],), generator=gen).to(q.device)

    def run(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, dout.to(dtype))
        return [out] + list(grads)

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, attn_mask=mask, is_causal=is_causal)

    def ours(a, b, c):
        return flash_attention(a, b, c, causal=causal, backend=backend_name)

    oracle = run(sdpa, torch.float64)
    yardstick = run(sdpa, q.dtype)
    result = run(ours, q.dtype)
    return [judge(name, r, o, y, q.dtype) for name, r, o, y in zip(("out", "dq", "dk", "dv"), result, oracle, yardstick)]


def _candidates(args, q, k, v):
    """[(backend, reasons it cannot run this call)] for the requested backend or all of them."""
    from ...core.dispatch import list_backends
    from ...core.spec import build_spec

    inp = build_spec(q, k, v, causal=args.causal)
    if args.backend:
        b = resolve_backend(args.backend)
        why = b.not_supported_reasons(inp)
        if why:
            raise CliError(f"backend {b.name!r} cannot run {args.dtype} shape {args.shape} here: {'; '.join(why)}")
        return [(b, [])]
    # The reference is the oracle itself: it is checked only when asked for by name.
    return [(b, b.not_supported_reasons(inp)) for b in list_backends() if b.name != "reference"]


def run(args) -> int:
    from ... import flash_attention
    from ...core.testing import check_against_reference

    b, h, s, d = parse_shape(args.shape)
    dtype = parse_dtype(args.dtype)
    device = parse_device(args.device)
    check_memory(oracle_bytes(b, h, s, d), device, f"--shape {args.shape}")
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(b, h, s, d, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    candidates = _candidates(args, q, k, v)
    runnable = [bk for bk, why in candidates if not why]
    if not runnable:
        reasons = "; ".join(f"{bk.name}: {', '.join(why)}" for bk, why in candidates)
        raise CliError(f"no backend can run {args.dtype} shape {args.shape} on {device}: {reasons}")

    print(f"tileattn verify: shape B,H,S,D = {b},{h},{s},{d}, dtype {args.dtype}, causal {args.causal}, "
          f"device {device}, seed {args.seed}")
    print("rule: max err <= 2 x (plain math in the same dtype vs the fp64 oracle) + floor")
    failures = []
    for bk, why in candidates:
        if why:
            print(f"\n[{bk.name}] skipped: {'; '.join(why)}")
            continue

        def fn(q_, k_, v_, name=bk.name, **kw):
            return flash_attention(q_, k_, v_, backend=name, **kw)

        rows = []
        try:
            verdicts = [("reference fp64", vd) for vd in check_against_reference(
                fn, q, k, v, grad=True, seed=args.seed, causal=args.causal, return_lse=True)]
            verdicts += [("sdpa fp64", vd) for vd in _sdpa_verdicts(bk.name, q, k, v, args.causal, args.seed)]
        except Exception as exc:  # a backend that crashes fails verification; the others still run
            text = str(exc).strip().splitlines()
            print(f"\n[{bk.name}] FAIL: raised {type(exc).__name__}: {text[-1] if text else ''}")
            failures.append(bk.name)
            continue
        for oracle, vd in verdicts:
            rows.append([oracle, vd.name, f"{vd.error:.3e}", f"{vd.tolerance:.3e}", f"{vd.baseline_error:.3e}", "PASS" if vd.ok else "FAIL"])
        ok = all(vd.ok for _, vd in verdicts)
        print(f"\n[{bk.name}] {'PASS' if ok else 'FAIL'}")
        print(format_table(["oracle", "tensor", "max err", "tolerance", "plain-math err", "verdict"], rows))
        if not ok:
            failures.append(bk.name)
    checked = len(runnable)
    if failures:
        print(f"\nFAIL: {', '.join(failures)} ({len(failures)} of {checked} backends)")
        return 1
    print(f"\nPASS: {checked} backend{'s' if checked != 1 else ''} ({', '.join(bk.name for bk in runnable)})")
    return 0
