"""Shared helpers for the tileattn test suite.

Every correctness check goes through :func:`tileattn.core.testing.check_against_reference` (FlashAttention's
rule: at most 2x the error of plain same-dtype math, plus a floor), via :func:`assert_matches_reference`,
which also insists that the expected verdicts exist, so a check can never pass by comparing nothing.

The ``backend`` fixture is generated from the registered engines: every engine that ``auto`` would
run on CPU tensors. The exact reference is not among them: it is the oracle, tested on its own
against an independent implementation (``tests/test_reference.py``). A call an engine does not
declare in its capabilities is skipped with the engine's own reason.
"""

from __future__ import annotations

import os
import random
import signal
import tempfile
import time

import pytest
import torch

import tileattn
from tileattn.core.dispatch import explain, list_backends
from tileattn.core.spec import build_spec, to_canonical, user_shape
from tileattn.core.testing import check_against_reference

# A user's tuned tile cache or backend override must not change what the tests exercise.
os.environ.pop("TILEATTN_BACKEND", None)
os.environ["TILEATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="tileattn-test-cache-")

# ------------------------------------------------------------------------------ random test order
#: The tests run in a random order, so a test that passes only after (or before) another fails
#: here first: the test files in a shuffled order, the tests of each file shuffled. The seed is the
#: UTC date (one order per day, the same for every run that day) unless TILEATTN_TEST_SEED gives one;
#: TILEATTN_TEST_SEED=none keeps the files' own order. The seed is printed after the run, so a
#: failure can be replayed with TILEATTN_TEST_SEED=<seed>.
SEED_ENV = "TILEATTN_TEST_SEED"
_SEED_KEY = pytest.StashKey()


def _order_seed():
    raw = os.environ.get(SEED_ENV, "").strip()
    if raw.lower() == "none":
        return None
    if not raw:
        return int(time.strftime("%Y%m%d", time.gmtime()))
    try:
        return int(raw)
    except ValueError:
        raise pytest.UsageError(f"{SEED_ENV}={raw!r}: expected an integer seed, or 'none' for the files' own order")


def pytest_configure(config):
    config.stash[_SEED_KEY] = _order_seed()


def _order_line(config) -> str:
    seed = config.stash.get(_SEED_KEY, None)
    if seed is None:
        return f"tileattn: tests in the files' own order ({SEED_ENV}=none)"
    return f"tileattn: tests in random order, seed {seed} (replay: {SEED_ENV}={seed})"


def pytest_collection_modifyitems(config, items):
    seed = config.stash.get(_SEED_KEY, None)
    if seed is None:
        return
    rng = random.Random(seed)
    files = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    groups = list(files.values())
    rng.shuffle(groups)
    items[:] = [item for group in groups for item in rng.sample(group, len(group))]


def pytest_report_header(config):
    return _order_line(config)


def pytest_terminal_summary(terminalreporter, config):
    terminalreporter.write_line(_order_line(config))

def _cpu_engines():
    """Engines that ``backend="auto"`` may choose for CPU tensors (the Triton engine runs CPU tensors
    only under its interpreter and has its own test file)."""
    probe = build_spec(*(torch.zeros(1, 1, 4, 8) for _ in range(3)))
    return tuple(b.name for b in list_backends()
                 if b.auto and not b.not_supported_reasons(probe) and not b.auto_refusal(probe))


CPU_BACKENDS = _cpu_engines()


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    return request.param


def attention_fn(backend: str):
    """``flash_attention`` pinned to one backend, with the signature check_against_reference expects."""

    def run(q, k, v, **kwargs):
        return tileattn.flash_attention(q, k, v, backend=backend, **kwargs)

    run.__name__ = f"flash_attention[{backend}]"
    return run


def skip_unless_supported(backend, q, k, v, grad=False, **kwargs):
    """Skip the test when ``backend``'s declared capabilities exclude this call (with its reason)."""
    kwargs = {key: val for key, val in kwargs.items() if key not in ("return_lse", "backend")}
    why = explain(build_spec(q, k, v, **kwargs), backward=grad)[backend]
    if why:
        pytest.skip(f"{backend}: " + "; ".join(why))


def assert_matches_reference(backend, q, k, v, grad=True, **kwargs):
    """Forward (and backward) of ``backend`` within FlashAttention's error bound of the fp64 oracle."""
    skip_unless_supported(backend, q, k, v, grad=grad, **kwargs)
    verdicts = check_against_reference(attention_fn(backend), q, k, v, grad=grad, **kwargs)
    expected = ["out"]
    if kwargs.get("return_lse"):
        expected.append("lse")
    if grad:
        expected += ["dq", "dk", "dv"]
        bias = kwargs.get("bias")
        if bias is not None and bias.requires_grad:
            expected.append("dbias")
    names = [v.name for v in verdicts]
    assert names == expected, f"verdicts {names}, expected {expected}"
    failed = [str(v) for v in verdicts if not v.ok]
    assert not failed, f"{backend}: " + " | ".join(failed)
    return verdicts


def assert_nonfinite_like_reference(out, ref, clean_ref, sees):
    """The contract for a NaN or inf in an input (``tileattn.reference``'s definition, tile by tile):
    every output row that sees the bad value (``sees``: a bool per row, broadcast over the head dim)
    is non-finite exactly where the fp64 reference is; a row that does not see it is, where finite,
    the reference of the clean input (it cannot depend on a value it does not see), and non-finite
    only where the reference is too. The reference's P @ V also spreads a NaN of V into rows that
    do not see its key (0 * NaN); a tiled kernel does so only inside tiles it computes, and which
    those are depends on the build's tile sizes (AVX-512's are twice AVX2's), so those rows may be
    either."""
    finite, ref_finite = torch.isfinite(out), torch.isfinite(ref)
    sees = sees.unsqueeze(-1).expand_as(finite)
    assert not finite.all(), "a non-finite input vanished"
    assert torch.equal(finite[sees], ref_finite[sees])
    assert not (~finite & ~sees & ref_finite).any(), "a row that does not see the bad value became non-finite"
    unseen = finite & ~sees
    torch.testing.assert_close(out[unseen].double(), clean_ref[unseen].double(), rtol=1e-5, atol=1e-5)
    both = finite & ref_finite
    torch.testing.assert_close(out[both].double(), ref[both].double(), rtol=1e-5, atol=1e-5)


def make_qkv(b=2, hq=2, hkv=None, sq=16, sk=None, d=32, dv=None, dtype=torch.float32, layout="BNSD",
             seed=0, requires_grad=False):
    """Random q, k, v in ``layout`` (contiguous in that layout). Defaults: hkv=hq, sk=sq, dv=d."""
    hkv = hq if hkv is None else hkv
    sk = sq if sk is None else sk
    dv = d if dv is None else dv
    gen = torch.Generator().manual_seed(seed)

    def rand(h, s, e):
        t = torch.randn(user_shape(layout, b, h, s, e), generator=gen, dtype=torch.float32)
        return t.to(dtype).requires_grad_(requires_grad)

    return rand(hq, sq, d), rand(hkv, sk, d), rand(hkv, sk, dv)


def strided_view(x: torch.Tensor, layout: str, num_heads: int) -> torch.Tensor:
    """The same values as ``x`` (a tensor in ``layout``) but as a non-contiguous view in that layout.

    The data is stored in another layout (BNSD storage viewed as BSND, etc.) and every view also
    skips every other element of the head dim except the last-dim stride, which stays 1.
    """
    canon = to_canonical(x, layout, num_heads)  # (B, H, S, D)
    b, h, s, d = canon.shape
    # Storage: (S, B, H, 2*D) with the real data in the first D columns: nothing is contiguous.
    storage = torch.zeros(s, b, h, 2 * d, dtype=x.dtype)
    storage[..., :d] = canon.detach().permute(2, 0, 1, 3)
    canon_view = storage[..., :d].permute(1, 2, 0, 3)  # (B, H, S, D), strided
    if layout == "BNSD":
        view = canon_view
    elif layout == "BSND":
        view = canon_view.transpose(1, 2)
    elif layout in ("BSH", "SBH"):
        # A width-H*D view needs heads and dims adjacent: store (S, B, H*D) rows padded to 2*H*D.
        wide = torch.zeros(s, b, 2 * h * d, dtype=x.dtype)
        wide[..., : h * d] = canon.detach().permute(2, 0, 1, 3).reshape(s, b, h * d)
        sbh = wide[..., : h * d]
        view = sbh if layout == "SBH" else sbh.transpose(0, 1)
    else:
        raise ValueError(layout)
    assert not view.is_contiguous() and view.stride(-1) == 1
    assert torch.equal(view, x.detach())
    return view.requires_grad_(x.requires_grad)


def sigint_as_usual():
    """``preexec_fn`` for a child that must take Ctrl-C as an interactive program does. A test run
    started in the background (``cmd &`` in a script) inherits SIGINT ignored, and a Python started
    that way keeps ignoring it (no KeyboardInterrupt): the child starts with the default instead."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def rotary_oracle(x, positions, cos, sin, interleaved):
    """x (S, H, D) rotated at positions (S,) as complex rotations of dimension pairs, in fp64."""
    rd = 2 * cos.shape[1]
    x = x.double()
    if interleaved:
        pairs = x[..., :rd].unflatten(-1, (rd // 2, 2))
        z = torch.complex(pairs[..., 0], pairs[..., 1])
    else:
        z = torch.complex(x[..., : rd // 2], x[..., rd // 2:rd])
    z = z * torch.complex(cos[positions].double(), sin[positions].double())[:, None, :]
    head = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
    return torch.cat((head, x[..., rd:]), -1)


def training_step(models, ids, attention_mask, labels):
    """(losses, parameter gradients) of one training step of each Hugging Face model on the batch."""
    losses, grads = [], []
    for model in models:
        model.train()
        loss = model(input_ids=ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    return losses, grads
