"""Memory: forward + backward at S = 16384 needs O(S) extra memory, not the O(S^2) score matrix.

Measured for real, in fresh subprocesses: each one warms the library up on a tiny call, allocates
and touches the same inputs, output and gradients, then either stops there (the baseline) or runs
attention forward and backward. Peak resident memory (``VmHWM``) minus the baseline's is what the
attention call added. The naive reference at a smaller length shows that the bound can be exceeded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

MIB = 1 << 20
BOUND = 64 * MIB

_WORKER = r"""
import json, sys
import torch
import tileattn

mode, s, d = sys.argv[1], int(sys.argv[2]), 64

def tensors(n):
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 1, n, d, generator=g) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], dout

# Warm-up: library initialisation (thread pools, BLAS buffers, lazy imports) counts in every mode.
(q, k, v), dout = tensors(64)
for backend in ("cpu", "reference"):
    tileattn.flash_attention(q, k, v, causal=True, backend=backend).backward(dout)
del q, k, v, dout

(q, k, v), dout = tensors(s)
if mode == "baseline":
    # What the call must produce anyway: out, lse and the three gradients, all touched.
    kept = [torch.randn(1, 1, s, d) for _ in range(4)] + [torch.randn(1, 1, s)]
else:
    backend = "cpu" if mode == "flash" else "reference"
    # Causal halves the compute (CI time); the engine's scratch memory is the same per tile.
    out = tileattn.flash_attention(q, k, v, causal=True, backend=backend)
    out.backward(dout)
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
# VmHWM, the peak RSS of this process image. Not ru_maxrss: that one carries over the parent's peak
# through fork + exec, so a worker started from a big pytest process would report the parent's size.
from tileattn.tools.measure import proc_status_bytes
print(json.dumps({"peak_bytes": proc_status_bytes("VmHWM")}))
"""


def peak_rss(*modes: str, seqlen: int) -> list:
    """Peak RSS in bytes of one worker per mode, run side by side (memory does not mind sharing cores)."""
    env = dict(os.environ)
    env.pop("TILEATTN_BACKEND", None)
    workers = [
        subprocess.Popen([sys.executable, "-c", _WORKER, mode, str(seqlen)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for mode in modes
    ]
    try:
        peaks = []
        for w in workers:
            stdout, stderr = w.communicate(timeout=600)
            assert w.returncode == 0, stderr[-3000:]
            peaks.append(json.loads(stdout.strip().splitlines()[-1])["peak_bytes"])
        return peaks
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()


@pytest.mark.skipif(sys.platform != "linux", reason="reads the peak RSS from /proc/self/status (Linux)")
def test_cpu_forward_backward_at_16k_adds_less_than_64_mib(record_property):
    seqlen = 16384
    baseline, flash = peak_rss("baseline", "flash", seqlen=seqlen)
    extra = flash - baseline
    record_property("extra_mib_cpu_16k", round(extra / MIB, 1))
    print(f"cpu engine, S={seqlen}: baseline {baseline / MIB:.1f} MiB, with attention {flash / MIB:.1f} MiB")
    assert extra < BOUND, f"cpu engine at S={seqlen} added {extra / MIB:.1f} MiB (bound {BOUND // MIB} MiB)"


@pytest.mark.skipif(sys.platform != "linux", reason="reads the peak RSS from /proc/self/status (Linux)")
def test_the_bound_catches_a_naive_implementation(record_property):
    """The materialising reference breaks the bound already at S = 4096 (a 64 MiB score matrix)."""
    seqlen = 4096
    baseline, naive = peak_rss("baseline", "naive", seqlen=seqlen)
    extra = naive - baseline
    record_property("extra_mib_naive_4k", round(extra / MIB, 1))
    print(f"naive reference, S={seqlen}: baseline {baseline / MIB:.1f} MiB, with attention {naive / MIB:.1f} MiB")
    assert extra > BOUND, f"naive attention at S={seqlen} added only {extra / MIB:.1f} MiB"
