"""torch.compile(fullgraph=True) traces through flash_attention (custom ops), forward and backward.

Compiling costs 20-40 s on two cores, so there is one compiled function, exercised with a feature-rich
call (GQA, causal, window, bias with gradient, softcap, LSE) and checked against eager bitwise-close.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tileattn
from tileattn.core import engine, ops
from tileattn.core.dispatch import get_backend
from tileattn.core.spec import build_spec
from tileattn.core.testing import check_against_reference
from torch._dynamo.utils import counters

from conftest import make_qkv


def attention_block(q, k, v, bias):
    """A little model around the operator: ops before and after it must fuse into one graph."""
    out, lse = tileattn.flash_attention(
        q * 1.5, k, v, bias=bias, causal=True, window=(24, 0), softcap=10.0, return_lse=True, backend="cpu"
    )
    return torch.tanh(out) * 2.0, lse


@pytest.fixture(autouse=True)
def no_cached_graphs():
    """Graphs cached on disk by an earlier run would not notice a changed fake implementation."""
    import torch._functorch.config
    import torch._inductor.config

    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def inputs():
    q, k, v = make_qkv(b=2, hq=4, hkv=2, sq=40, sk=48, d=16, dv=8, seed=31)
    # Strided views (BNSD values stored as BSND): gradients must still come back contiguous.
    q, k = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k))
    bias = torch.randn(4, 40, 48, generator=torch.Generator().manual_seed(32))
    return q, k, v, bias


def run(fn, q, k, v, bias):
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out, lse = fn(*leaves)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(33))
    out.backward(dout)
    return [out.detach(), lse] + [t.grad for t in leaves]


def _engine_modules():
    return {m: mod for m, mod in sys.modules.items() if m == "tileattn.backends" or m.startswith("tileattn.backends.")}


@pytest.fixture
def fresh_registry(monkeypatch):
    """As in a new process: no engine registered yet, engine modules not imported. Restored after."""
    saved = _engine_modules()
    for name in saved:
        del sys.modules[name]
    monkeypatch.setattr(engine, "_REGISTRY", {})
    yield
    for name in _engine_modules():
        del sys.modules[name]
    sys.modules.update(saved)
    for name, module in saved.items():  # the package attributes too, e.g. tileattn.backends
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, module)


def test_compile_fullgraph_forward_and_backward_match_eager(inputs, fresh_registry):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attention_block, fullgraph=True)
    # The compiled call comes first, so engine registration happens while dynamo traces.
    compiled_results = run(compiled, *inputs)
    eager_results = run(attention_block, *inputs)
    names = ["out", "lse", "dq", "dk", "dv", "dbias"]
    for name, e, c in zip(names, eager_results, compiled_results):
        assert c.shape == e.shape and c.dtype == e.dtype, name
        # The operator itself runs the same engine; only the surrounding pointwise ops are fused.
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # A second call with new values reuses the compiled graph (no recompilation for new data).
    q, k, v, bias = inputs
    again = run(compiled, q * 0.5, k, v, bias)
    torch.testing.assert_close(again[0], run(attention_block, q * 0.5, k, v, bias)[0], rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


_FRESH_DEFAULT_ENGINE = """
    import torch
    import tileattn
    from tileattn.backends.native import kernels
    from tileattn.core.dispatch import select
    from tileattn.core.spec import build_spec
    from tileattn.core.testing import check_against_reference

    assert not kernels._state, "the library must be loaded (or found unavailable) first while dynamo traces"
    gen = torch.Generator().manual_seed(38)
    q, k, v = (torch.randn(1, h, 24, 16, generator=gen) for h in (4, 2, 2))
    compiled = torch.compile(lambda q, k, v, causal: tileattn.flash_attention(q, k, v, causal=causal),
                             fullgraph=True)
    verdicts = check_against_reference(compiled, q, k, v, causal=True)
    assert [v.name for v in verdicts] == ["out", "dq", "dk", "dv"], verdicts
    assert all(v.ok for v in verdicts), "\\n".join(map(str, verdicts))
    print("engine", select(build_spec(q, k, v, causal=True), backward=True).name)
"""


def test_compile_fullgraph_default_engine_in_a_fresh_process():
    """The default engine (native where it builds) in a new process: its library is built and loaded
    for the first time while dynamo traces the dispatch, which must not break the graph."""
    # Asked here first, so the child finds the library built in this session's cache (and only loads it).
    refused = get_backend("native").not_supported_reasons(build_spec(*make_qkv(sq=4)), backward=True)
    env = {k: v for k, v in os.environ.items() if k != "TILEATTN_BACKEND"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FRESH_DEFAULT_ENGINE)], capture_output=True,
                          text=True, env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == ["engine", "cpu" if refused else "native"], proc.stdout


class _ExportedBlock(torch.nn.Module):
    def forward(self, q, k, v, bias):
        return tileattn.flash_attention(q, k, v, bias=bias, causal=True) * 2.0


def test_export_records_the_op_and_the_program_matches_the_reference():
    """torch.export (default engine) records one tileattn op, and the exported program computes
    attention for new values as eager does, within the reference's tolerance."""
    q, k, v = make_qkv(b=1, hq=4, hkv=2, sq=12, sk=12, d=16, seed=41)
    bias = torch.randn(4, 12, 12, generator=torch.Generator().manual_seed(42))
    program = torch.export.export(_ExportedBlock(), (q, k, v, bias))
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.tileattn.attention_forward.default) == 1, targets
    run = program.module()
    q2 = q.flip(2)
    torch.testing.assert_close(run(q2, k, v, bias), _ExportedBlock()(q2, k, v, bias), rtol=0, atol=0)
    verdicts = check_against_reference(lambda q, k, v, bias, causal: run(q, k, v, bias) / 2.0, q2, k, v, grad=False,
                                       bias=bias, causal=True)
    assert [v.name for v in verdicts] == ["out"] and all(v.ok for v in verdicts), verdicts


def test_make_fx_records_the_op_not_its_result():
    """make_fx's proxy mode records one tileattn op, also for a shape with a lean plan: a result
    computed beside the trace would replay as whatever memory the graph allocates."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = make_qkv(b=1, hq=4, hkv=2, sq=1, sk=9, d=16, seed=43)
    for _ in range(3):  # the decode shape gets its lean plan
        tileattn.flash_attention(q, k, v, causal=True)
    graph = make_fx(lambda q, k, v: tileattn.flash_attention(q, k, v, causal=True))(q, k, v)
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.tileattn.attention_forward.default) == 1, targets
    q2 = q.flip(-1)
    torch.testing.assert_close(graph(q2, k, v), tileattn.flash_attention(q2, k, v, causal=True), rtol=0, atol=0)


def test_custom_op_fake_shapes_match_real_ones():
    """The fake (meta) implementations predict the real output shapes for every layout, no compile."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = [
        ("BNSD", None, make_qkv(b=2, hq=4, hkv=2, sq=5, sk=7, d=8, dv=6)),
        ("BSND", None, make_qkv(b=2, hq=4, hkv=2, sq=5, sk=7, d=8, dv=6, layout="BSND")),
        ("BSH", 4, make_qkv(b=2, hq=4, hkv=2, sq=5, sk=7, d=8, dv=6, layout="BSH")),
        ("SBH", 4, make_qkv(b=2, hq=4, hkv=2, sq=5, sk=7, d=8, dv=6, layout="SBH")),
        ("TND", None, [t[0].transpose(0, 1) for t in make_qkv(b=1, hq=4, hkv=2, sq=5, sk=7, d=8, dv=6)]),
    ]
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    for layout, heads, (q, k, v) in cases:
        cu = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k) if layout == "TND" else {}
        for partial in (False, True):
            spec = build_spec(q, k, v, layout=layout, num_heads=heads, sinks=torch.zeros(4), causal=True, **cu)
            real_out, real_lse = ops.run_forward(spec, get_backend("cpu"), partial)
            args = list(ops.pack(spec, "cpu", partial))
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                args[:3] = [mode.from_tensor(t) for t in args[:3]]
                fake_out, fake_lse = torch.ops.tileattn.attention_forward(*args)
            assert fake_out.shape == real_out.shape and fake_lse.shape == real_lse.shape, layout
            assert fake_out.dtype == real_out.dtype and fake_lse.dtype == real_lse.dtype, layout


def varlen_block(q, k, v, cu_q, cu_k):
    return tileattn.flash_attention(q, k, v, layout="TND", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                    backend="cpu") * 3.0


def test_compile_varlen_forward_backward_and_runtime_validation():
    """cu_seqlens are data while tracing: the graph must not branch on them, the op checks them."""
    torch._dynamo.reset()
    q, k, v = (t[0].transpose(0, 1) for t in make_qkv(b=1, hq=4, hkv=2, sq=21, sk=25, d=8, seed=34))
    cu_q = torch.tensor([0, 5, 5, 21], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 12, 25], dtype=torch.int32)
    compiled = torch.compile(varlen_block, fullgraph=True)
    results = []
    for fn in (compiled, varlen_block):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, cu_q, cu_k)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(35)))
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, c, e in zip(["out", "dq", "dk", "dv"], *results):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    # Other offsets of the same shape reuse the graph and give their own (correct) answer.
    cu_k2 = torch.tensor([0, 2, 20, 25], dtype=torch.int32)
    torch.testing.assert_close(compiled(q, k, v, cu_q, cu_k2), varlen_block(q, k, v, cu_q, cu_k2))
    # Invalid offsets are still rejected, by the operator itself, before it computes.
    with pytest.raises(ValueError, match="'cu_seqlens_k'"):
        compiled(q, k, v, cu_q, torch.tensor([0, 12, 9, 25], dtype=torch.int32))


def _opcheck_cases():
    q, k, v = make_qkv(b=1, hq=4, hkv=2, sq=5, sk=6, d=8, dv=4, layout="BSH", seed=36)
    q = q.transpose(0, 1).contiguous().transpose(0, 1)  # strided
    yield "BSH strided + bias + sinks", (q, k, v), dict(
        layout="BSH", num_heads=4, bias=torch.randn(4, 5, 6), sinks=torch.randn(4), causal=True, window=(3, None),
        softcap=2.0, scale=0.35)
    tq, tk, tv = (t[0].transpose(0, 1) for t in make_qkv(b=1, hq=2, sq=7, sk=9, d=8, seed=37))
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 0, 9], dtype=torch.int32)
    yield "TND", (tq, tk, tv), dict(layout="TND", alibi_slopes=torch.rand(2), cu_seqlens_q=cu_q,
                                     cu_seqlens_k=cu_k, causal=True)


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_torch_library_opcheck(case):
    """Schema, fake implementation, autograd registration and AOT dispatch, checked by torch itself."""
    _, tensors, kwargs = case
    kwargs = {k: (v.requires_grad_() if k in ("bias", "sinks") else v) for k, v in kwargs.items()}
    args = ops.pack(build_spec(*(t.requires_grad_() for t in tensors), **kwargs), "cpu", False)
    result = torch.library.opcheck(torch.ops.tileattn.attention_forward.default, args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_torch_library_opcheck_backward(case):
    """The backward op's fake implementation matches its real outputs (shapes, strides, dtypes)."""
    _, tensors, kwargs = case
    q, k, v, bias, sinks, extras, ints, floats, config = ops.pack(build_spec(*tensors, **kwargs), "cpu", False)
    out, lse = torch.ops.tileattn.attention_forward(q, k, v, bias, sinks, extras, ints, floats, config)
    dout, dlse = torch.randn(out.shape), torch.randn(lse.shape)
    args = (dout, dlse, out, lse, q, k, v, bias, sinks, extras, ints, floats, config, bias is not None)
    result = torch.library.opcheck(torch.ops.tileattn.attention_backward.default, args,
                                   test_utils=("test_schema", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}, result


def test_importing_tileattn_does_not_import_dynamo():
    """`import tileattn` costs what its own modules cost: Dynamo (3 s on two cores) is imported only by
    a process that compiles. The mark that lets a compiled frame take the field layout as a constant is
    the one torch's decorator sets (ops._flat_fields), so compiling still sees it."""
    code = ("import sys, time, torch; t = time.perf_counter(); import tileattn; "
            "print(time.perf_counter() - t, 'torch._dynamo.convert_frame' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    seconds, dynamo = res.stdout.split()
    assert dynamo == "False" and float(seconds) < 2.0, res.stdout
    marked = torch._dynamo.assume_constant_result(lambda: None)
    assert {k for k in vars(marked)} == {"_dynamo_marked_constant"} and ops._flat_fields._dynamo_marked_constant
