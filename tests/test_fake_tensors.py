"""Tensors without memory: FakeTensorMode gets fake outputs from the ops' fake kernels; a tensor whose
memory cannot be read (a wrapper subclass whose data_ptr() is 0, a FakeTensor handed to an engine,
a tensor wrapped by torch.func.vmap, one given to FlexAttention's compiled C) is refused by name
before any kernel reads a pointer.

Each of these once segfaulted the process, so the cases run in one child process that reports each
result on a line of its own as it goes: a crash fails this test (naming the case it reached)
instead of ending the run.
"""

from __future__ import annotations

import os
import subprocess
import sys

_CHILD = r'''
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map_only

import tileattn
from tileattn.backends.native import checked
from tileattn.core import ops
from tileattn.core.dispatch import get_backend
from tileattn.core.spec import build_spec


class Hollow(torch.Tensor):
    """A wrapper subclass without data (its data_ptr() is 0, as a DTensor's) that computes on a real
    tensor and wraps every result: through its own dispatch it works, read by pointer it is empty."""

    @staticmethod
    def __new__(cls, like):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                   device=like.device)

    def __init__(self, like):
        self.like = like

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.like  # noqa: E731
        out = func(*tree_map_only(Hollow, unwrap, args), **tree_map_only(Hollow, unwrap, kwargs or {}))
        return tree_map_only(torch.Tensor, Hollow, out)


def case(name):
    def run(fn):
        try:
            result = fn()
        except Exception as exc:  # the parent checks the type and the message
            result = f"{type(exc).__name__}: {exc}"
        print(f"{name} | {result}", flush=True)
    return run


def fake_summary(*tensors):
    assert all(isinstance(t, FakeTensor) for t in tensors), [type(t).__name__ for t in tensors]
    return " ".join(f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for t in tensors)


gen = torch.Generator().manual_seed(40)
q, k, v = (torch.randn(2, h, 8, 16, generator=gen) for h in (4, 2, 2))


@case("fake inference")
def _():
    with FakeTensorMode():
        fq, fk, fv = (torch.randn(2, h, 8, 16) for h in (4, 2, 2))
        return fake_summary(*tileattn.flash_attention(fq, fk, fv, causal=True, return_lse=True))


@case("fake training")
def _():
    with FakeTensorMode():
        fq, fk, fv = (torch.randn(2, h, 8, 16, requires_grad=True) for h in (4, 2, 2))
        out = tileattn.flash_attention(fq, fk, fv, causal=True)
        out.sum().backward()
        return fake_summary(out, fq.grad, fk.grad, fv.grad)


@case("fake varlen")
def _():
    with FakeTensorMode():
        fq, fk, fv = (torch.randn(10, h, 16) for h in (4, 2, 2))
        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
        return fake_summary(tileattn.flash_attention(fq, fk, fv, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu))


@case("fake attention_backward")
def _():
    with FakeTensorMode():
        fq, fk, fv = (torch.randn(2, h, 8, 16) for h in (4, 2, 2))
        out, lse = tileattn.flash_attention(fq, fk, fv, return_lse=True)
        grads = tileattn.attention_backward(torch.randn(out.shape), fq, fk, fv, out, lse)
        return fake_summary(grads.dq, grads.dk, grads.dv)


@case("fake mode, real inputs, warm lean plan")
def _():
    for _ in range(3):
        tileattn.flash_attention(q[:, :, :1], k, v, causal=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        return fake_summary(tileattn.flash_attention(q[:, :, :1], k, v, causal=True))


@case("hollow q k v")
def _():
    out = tileattn.flash_attention(Hollow(q), Hollow(k), Hollow(v), causal=True)
    torch.testing.assert_close(out.like, tileattn.flash_attention(q, k, v, causal=True), rtol=0, atol=0)
    return "same"


for engine in ("native", "cpu"):
    @case(f"hollow mask {engine}")
    def _():
        mask = Hollow(torch.ones(8, 8, dtype=torch.bool))
        return tileattn.flash_attention(q, k, v, mask=mask, backend=engine)


@case("hollow bias checked.forward")
def _():
    out, lse = torch.empty(2, 4, 8, 16), torch.empty(2, 4, 8)
    return checked.forward(q, k, v, out, lse, scale=0.25, bias=Hollow(torch.zeros(1, 1, 8, 8)))


@case("fake q to an engine")
def _():
    with FakeTensorMode() as mode:
        spec = build_spec(*(mode.from_tensor(t) for t in (q, k, v)), causal=True)
    return ops.run_forward(spec, get_backend("native"), False)


@case("vmap")
def _():
    return torch.func.vmap(lambda x: tileattn.flash_attention(x, k, v))(q[None].expand(3, -1, -1, -1, -1))


@case("hollow q k v with a score_mod")
def _():
    return tileattn.flash_attention(Hollow(q), Hollow(k), Hollow(v), score_mod=lambda s, b, h, i, j: s + 0.1 * j)


@case("hollow tensor captured by a compiled score_mod")
def _():
    captured = [torch.arange(8.0)]
    score_mod = lambda s, b, h, i, j: s + captured[0][j]  # noqa: E731
    dense = tileattn.flash_attention(q, k, v, score_mod=score_mod)  # compiles the program for an fp32 capture
    captured[0] = Hollow(torch.arange(8.0))  # its type is in the key: not that program, but torch.vmap
    assert "Hollow (a tensor subclass)" in tileattn.explain(q, k, v, score_mod=score_mod)["native"][0]
    torch.testing.assert_close(tileattn.flash_attention(q, k, v, score_mod=score_mod), dense, rtol=0, atol=2e-6)
    return "same"
'''

_EXPECTED = {
    "fake inference": "(2, 4, 8, 16):float32 (2, 4, 8):float32",
    "fake training": "(2, 4, 8, 16):float32 (2, 4, 8, 16):float32 (2, 2, 8, 16):float32 (2, 2, 8, 16):float32",
    "fake varlen": "(10, 4, 16):float32",
    "fake attention_backward": "(2, 4, 8, 16):float32 (2, 2, 8, 16):float32 (2, 2, 8, 16):float32",
    "fake mode, real inputs, warm lean plan": "(2, 4, 1, 16):float32",
    "hollow q k v": "same",
    "hollow mask native": "TypeError: tileattn: argument 'mask': got a Hollow without storage",
    "hollow mask cpu": "TypeError: tileattn: argument 'mask': got a Hollow without storage",
    "hollow bias checked.forward": "TypeError: tileattn native: argument 'bias': got a Hollow without storage",
    "fake q to an engine": "TypeError: tileattn: argument 'q': got a FakeTensor",
    "vmap": "TypeError: tileattn: argument 'q': got a tensor without storage",
    "hollow q k v with a score_mod": "TypeError: tileattn: argument 'q': got a Hollow without storage",
    "hollow tensor captured by a compiled score_mod": "same",
}


def test_tensors_without_memory_get_fake_outputs_or_a_named_error():
    env = {k: v for k, v in os.environ.items() if k != "TILEATTN_BACKEND"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, cwd=root,
                          timeout=300)
    results = dict(line.split(" | ", 1) for line in proc.stdout.splitlines() if " | " in line)
    reached = list(results)
    assert proc.returncode == 0, f"the child died (exit {proc.returncode}) after {reached}:\n{proc.stderr[-3000:]}"
    assert reached == list(_EXPECTED), reached
    for name, expected in _EXPECTED.items():
        assert results[name].startswith(expected), f"{name}: {results[name]}"
