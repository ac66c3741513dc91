"""Context parallelism across processes: every mode against single-process ``tileattn.reference``.

Two process groups are spawned by the tests themselves (gloo on CPU, ``run_local``: no launcher),
one of 2 and one of 4 processes, and each runs *all* its cases in one go (process start-up is the
expensive part on a 2-core CI machine). For every case each rank shards the same full inputs,
runs :func:`tileattn.distributed.context_parallel_attention` forward and backward (through the
output and the LSE), and the shards are put back together; the parent judges them against the
fp64 reference with FlashAttention's rule, the tolerance scaled by the world size as PyTorch's own
context-parallel tests scale theirs (``atol = 1e-3 * world_size``): a sharded gradient is a sum of
``world`` separately rounded parts. Each case also checks the communication counted on every rank.

The ranks need no launcher; under torchrun the same worker runs unchanged: on each rank,
``init_process_group("gloo")`` and then ``_group_main(CASES_2)`` (``CASES_4`` on 4 ranks).
"""

from __future__ import annotations

import ctypes
import sys
import zlib

import pytest
import torch
import torch.distributed as dist

import tileattn
import tileattn.distributed as cp
from tileattn.tools import measure
from tileattn.distributed import ring
from tileattn.distributed.launch import run_local
from tileattn.distributed.plan import ShardPlan
from tileattn.core.testing import judge

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIN_PIECE_ROWS = ring.MIN_PIECE_ROWS
BASE = dict(mode="ring", dtype="fp32", layout="BNSD", causal=True, lb=True, S=64, lens=None, b=2, hq=4, hkv=2,
            d=16, dv=16, window=None, alibi=False, softcap=0.0, sinks=False, bias=None, mask=False, align=None,
            dlse=True, piece_rows=None)


def case(name, **kw):
    return dict(BASE, name=name, **kw)


CASES_2 = [
    case("ring-causal-zigzag-fp32"),
    case("ring-causal-zigzag-bf16", dtype="bf16"),
    case("ring-full-contiguous-fp32", causal=False, lb=False),
    case("ring-causal-contiguous-odd37-fp32", lb=False, S=37),
    case("ring-causal-zigzag-odd37-bf16", S=37, dtype="bf16"),
    case("ring-window-alibi-softcap-fp32", window=(9, 0), alibi=True, softcap=4.0),
    case("ring-bidirectional-window-fp32", causal=False, window=(5, 3)),
    case("ring-sinks-fp32", sinks=True),
    case("ring-bias-rows-grad-fp32", bias="rows"),
    case("ring-bias-broadcast-grad-fp32", bias="bcast", causal=False),
    case("ring-mask-fp32", mask=True, causal=False, dlse=False),
    case("ring-bsnd-bf16", layout="BSND", dtype="bf16"),
    case("ring-bsh-fp32", layout="BSH", dv=8),
    case("ring-sbh-mqa-fp32", layout="SBH", hkv=1),
    case("ring-align-minus3-fp32", align=-3),
    case("ring-varlen-fp32", layout="TND", lens=[13, 40, 3, 24]),
    case("ring-varlen-window-alibi-bf16", layout="TND", lens=[13, 40, 3, 24], window=(6, 0), alibi=True,
         dtype="bf16"),
    # K/V blocks travelling in pieces of 4-5 rows and queries computed in chunks of as many rows (what
    # long sequences do, cut at 256+ rows): the same results, in more messages of the same bytes.
    case("ring-pieces-causal-zigzag-odd37-bf16", S=37, dtype="bf16", piece_rows=4),
    case("ring-pieces-window-alibi-bias-rows-fp32", window=(9, 0), alibi=True, bias="rows", piece_rows=4),
    case("ring-pieces-varlen-sinks-fp32", layout="TND", lens=[13, 40, 3, 24], sinks=True, piece_rows=4),
    case("ring-pieces-mask-full-fp32", mask=True, causal=False, dlse=False, piece_rows=4),
    case("ulysses-causal-fp32", mode="ulysses"),
    case("ulysses-sinks-alibi-bf16", mode="ulysses", sinks=True, alibi=True, dtype="bf16"),
    case("ulysses-causal-odd37-bf16", mode="ulysses", S=37, dtype="bf16"),
    case("ulysses-mqa-replicated-fp32", mode="ulysses", hkv=1),
    case("ulysses-varlen-sinks-fp32", mode="ulysses", layout="TND", lens=[13, 40, 3, 24], sinks=True),
    case("ulysses-bias-rows-grad-fp32", mode="ulysses", bias="rows"),
    case("ulysses-mask-bf16", mode="ulysses", mask=True, causal=False, dlse=False, dtype="bf16"),
    case("ulysses-window-alibi-softcap-bf16", mode="ulysses", window=(7, 0), alibi=True, softcap=5.0,
         dtype="bf16"),
]
CASES_4 = [
    case("ring-causal-zigzag-fp32"),
    case("ring-causal-zigzag-bf16", dtype="bf16"),
    case("ring-causal-zigzag-odd37-fp32", S=37),
    case("ring-causal-contiguous-fp32", lb=False),
    case("ring-window-alibi-fp32", window=(10, 0), alibi=True),
    case("ring-varlen-bf16", layout="TND", lens=[13, 40, 3, 24], dtype="bf16"),
    case("ring-pieces-causal-zigzag-fp32", piece_rows=4),
    case("ulysses-gqa-replicated-fp32", mode="ulysses", hkv=2),
    case("ulysses-mqa-bf16", mode="ulysses", hkv=1, dtype="bf16"),
    case("ulysses-8-heads-odd37-fp32", mode="ulysses", hq=8, hkv=4, S=37),
    case("hybrid-causal-zigzag-fp32", mode="hybrid"),
    case("hybrid-causal-zigzag-bf16", mode="hybrid", dtype="bf16"),
    case("hybrid-odd37-window-alibi-fp32", mode="hybrid", S=37, window=(9, 0), alibi=True),
    case("hybrid-varlen-sinks-fp32", mode="hybrid", layout="TND", lens=[13, 40, 3, 24], sinks=True),
    case("hybrid-bias-rows-grad-fp32", mode="hybrid", bias="rows", causal=False),
    case("hybrid-pieces-window-bf16", mode="hybrid", window=(9, 0), dtype="bf16", piece_rows=4),
]


# ---------------------------------------------------------------------------------------------
# Inputs, the same on every rank and in the parent.


def _to_layout(x, layout):
    """(B, H, S, D) -> layout ("TND": B must be 1)."""
    return {"BNSD": lambda t: t, "BSND": lambda t: t.transpose(1, 2).contiguous(),
            "BSH": lambda t: t.transpose(1, 2).flatten(2), "SBH": lambda t: t.permute(2, 0, 1, 3).flatten(2),
            "TND": lambda t: t[0].transpose(0, 1).contiguous()}[layout](x)


def _inputs(c):
    """Full tensors and call keywords of case ``c``."""
    gen = torch.Generator().manual_seed(zlib.crc32(c["name"].encode()))
    dtype = DTYPES[c["dtype"]]
    varlen = c["layout"] == "TND"
    b, s = (1, sum(c["lens"])) if varlen else (c["b"], c["S"])
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, v = rand(b, c["hq"], s, c["d"]), rand(b, c["hkv"], s, c["d"]), rand(b, c["hkv"], s, c["dv"])
    dout = rand(b, c["hq"], s, c["dv"])
    t = dict(q=q, k=k, v=v, dout=dout)
    t = {n: _to_layout(x.to(dtype), c["layout"]) for n, x in t.items()}
    t["dlse"] = rand(c["hq"], s) if varlen else rand(b, c["hq"], s)
    kw = dict(causal=c["causal"], layout=c["layout"], window=c["window"], softcap=c["softcap"])
    if c["layout"] in ("BSH", "SBH"):
        kw["num_heads"] = c["hq"]
    if varlen:
        cu = torch.tensor([0] + c["lens"]).cumsum(0).to(torch.int32)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    if c["align"] is not None:
        kw["align"] = c["align"]
    if c["alibi"]:
        kw["alibi_slopes"] = torch.linspace(0.1, 0.8, c["hq"])
    if c["sinks"]:
        kw["sinks"] = rand(c["hq"])
    if c["bias"] == "rows":
        kw["bias"] = rand(b, c["hq"], s, s).to(dtype)
    elif c["bias"] == "bcast":
        kw["bias"] = rand(1, c["hq"], 1, s).to(dtype)
    if c["mask"]:
        keep = torch.rand(b, 1, s, s, generator=gen) > 0.3
        kw["mask"] = keep | torch.eye(s, dtype=torch.bool)  # every row keeps a key
    return t, kw


# ---------------------------------------------------------------------------------------------
# On every rank.


def _stats(s: cp.CommStats):
    return dict(messages=dict(s.messages), calls=dict(s.calls), bytes=dict(s.bytes))


def _run_case(c, mesh):
    if c["piece_rows"]:
        ring.MIN_PIECE_ROWS = c["piece_rows"]
    try:
        return _run_case_with_pieces(c, mesh)
    finally:
        ring.MIN_PIECE_ROWS = MIN_PIECE_ROWS


def _run_case_with_pieces(c, mesh):
    t, kw = _inputs(c)
    group = mesh if c["mode"] == "hybrid" else None
    sd = cp.SEQ_DIM[c["layout"]]
    varlen = c["layout"] == "TND"
    place = dict(group=group, load_balance=c["lb"], cu_seqlens=kw.get("cu_seqlens_q"))
    q, k, v = (cp.shard(t[n], seq_dim=sd, **place).requires_grad_() for n in ("q", "k", "v"))
    dout = cp.shard(t["dout"], seq_dim=sd, **place)
    lse_dim = 1 if varlen else 2
    dlse = cp.shard(t["dlse"], seq_dim=lse_dim, **place)
    leaves = {}
    if "bias" in kw:
        bias = cp.shard(kw["bias"], seq_dim=2, **place) if c["bias"] == "rows" else kw["bias"].clone()
        kw["bias"] = leaves["bias"] = bias.requires_grad_()
    if "sinks" in kw:
        kw["sinks"] = leaves["sinks"] = kw["sinks"].clone().requires_grad_()
    if "mask" in kw:
        kw["mask"] = cp.shard(kw["mask"], seq_dim=2, **place)
    with cp.count_collectives() as fwd:
        out, lse = cp.context_parallel_attention(q, k, v, group=group, mode=c["mode"], load_balance=c["lb"],
                                                 return_lse=True, timeout=120, **kw)
    with cp.count_collectives() as bwd:
        torch.autograd.backward([out, lse] if c["dlse"] else [out], [dout, dlse] if c["dlse"] else [dout])
    got = dict(out=cp.unshard(out, seq_dim=sd, **place), lse=cp.unshard(lse, seq_dim=lse_dim, **place))
    for n, x in (("dq", q), ("dk", k), ("dv", v)):
        got[n] = cp.unshard(x.grad, seq_dim=sd, **place)
    if "bias" in leaves:
        g = leaves["bias"].grad
        got["dbias"] = cp.unshard(g, seq_dim=2, **place) if c["bias"] == "rows" else _summed(g)
    if "sinks" in leaves:
        got["dsinks"] = _summed(leaves["sinks"].grad)
    local = dict(k_bytes=k.numel() * k.element_size(), v_bytes=v.numel() * v.element_size())
    return dict(got=got if dist.get_rank() == 0 else None, fwd=_stats(fwd), bwd=_stats(bwd), local=local)


def _summed(g):
    """A replicated parameter's gradient: each rank holds its share; the sum is the gradient."""
    g = g.detach().clone()
    dist.all_reduce(g)
    return g


def _expect_error(fn, exc, *needles):
    try:
        fn()
    except exc as e:
        missing = [n for n in needles if n not in str(e)]
        return f"missing {missing} in: {e}" if missing else "ok"
    except Exception as e:  # the wrong kind of error is a failure to report, not to crash on
        return f"{type(e).__name__} instead of {exc.__name__}: {e}"
    return "no error"


def _error_checks():
    """Bad calls: every rank must raise the same clear error before any compute, and the group must
    stay usable (each check is followed by the next one on the same group)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=gen) for _ in range(3))
    call = cp.context_parallel_attention
    res = {}
    res["shape"] = _expect_error(lambda: call(*(x if rank == 0 else x[:, :2] for x in (q, k, v)), timeout=60),
                                 ValueError, "argument 'q'", "CP rank 1", "the same on every rank")
    res["dtype"] = _expect_error(
        lambda: call(*((q, k, v) if rank == 0 else (x.bfloat16() for x in (q, k, v))), timeout=60), ValueError,
        "argument 'q'", "torch.bfloat16", "CP rank 1")
    # Each argument is named as the user wrote it, with the value every rank passed.
    res["causal"] = _expect_error(lambda: call(q, k, v, causal=rank == 0, timeout=60), ValueError,
                                  "argument 'causal': got True on CP rank 0 and False on CP rank 1;")
    res["window"] = _expect_error(lambda: call(q, k, v, window=(4, -1) if rank else None, timeout=60), ValueError,
                                  "argument 'window': got None on CP rank 0 and (4, None) on CP rank 1;")
    res["mode"] = _expect_error(lambda: call(q, k, v, mode=("ring", "ulysses")[rank], timeout=60), ValueError,
                                "argument 'mode': got 'ring' on CP rank 0 and 'ulysses' on CP rank 1;")
    res["scale"] = _expect_error(lambda: call(q, k, v, scale=(0.5, None)[rank], timeout=60), ValueError,
                                 "argument 'scale': got 0.5 on CP rank 0 and 0.35355339059327373 on CP rank 1;")
    res["sinks"] = _expect_error(lambda: call(q, k, v, sinks=torch.zeros(4) if rank else None, timeout=60),
                                 ValueError, "argument 'sinks': got None on CP rank 0 and a torch.float32 tensor of "
                                 "shape (4,) on CP rank 1;")
    cu = torch.tensor([0, 10, 32] if rank else [0, 12, 32], dtype=torch.int32)
    res["cu_seqlens"] = _expect_error(
        lambda: call(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), layout="TND",
                     cu_seqlens_q=cu, cu_seqlens_k=cu, timeout=60), ValueError,
        "argument 'cu_seqlens_q': got [0, 12, 32] on CP rank 0 and [0, 10, 32] on CP rank 1;")
    # 6 and 10 tokens are no shards of one sequence: both ranks are named, with what each one fits.
    res["length"] = _expect_error(lambda: call(*(x[:, :, : 6 + 4 * rank] for x in (q, k, v)), timeout=60), ValueError,
                                  "argument 'q': got 6 local tokens on CP rank 0 and 10 local tokens on CP rank 1;",
                                  "CP rank 0's 6 tokens fit a sequence of 12 tokens", "tileattn.distributed.shard")
    res["heads"] = _expect_error(lambda: call(q[:, :3], k[:, :3], v[:, :3], mode="ulysses"), ValueError,
                                 "argument 'q'", "3 query heads for 2 Ulysses ranks")
    res["dropout"] = _expect_error(lambda: call(q, k, v, dropout_p=0.1), NotImplementedError, "argument 'dropout_p'")
    res["cache"] = _expect_error(lambda: call(q, k, v, seqused_k=torch.ones(1, dtype=torch.int32)),
                                 NotImplementedError, "argument 'seqused_k'")
    res["hybrid_group"] = _expect_error(lambda: call(q, k, v, mode="hybrid"), ValueError, "argument 'group'",
                                        "2-D DeviceMesh")
    res["bias_shape"] = _expect_error(lambda: call(q, k, v, bias=torch.zeros(1, 4, 16, 16)), ValueError,
                                      "argument 'bias'", "global keys")
    res["unknown"] = _expect_error(lambda: call(q, k, v, causual=True), TypeError, "argument 'causual'")
    # Still usable after all of that: a correct call matches the reference.
    out = call(q, k, v, causal=True, timeout=60)
    res["after"] = "ok" if out.shape == q.shape and torch.isfinite(out).all() else "bad output"
    return res


def _length_checks():
    """Four ranks, one of them with a wrong shard: that rank is named, not the first rank that differs
    from a plan of the summed lengths (here rank 0 would be, whose shard is right)."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(3))
    mine = [cp.shard(x, seq_dim=2) for x in (q, k, v)]
    if rank == 3:
        mine = [torch.cat([x, x[:, :, :1]], 2) for x in mine]
    call = cp.context_parallel_attention
    res = {}
    res["one_long"] = _expect_error(lambda: call(*mine, causal=True, timeout=60), ValueError,
                                    "argument 'q': got 5 local tokens on CP rank 3; expected 4: the shard of a "
                                    "sequence of 16 tokens, which the other ranks' shards imply")
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    tnd = [cp.shard(x[0].transpose(0, 1), seq_dim=0, cu_seqlens=cu) for x in (q, k, v)]
    if rank in (1, 2):
        tnd = [x[:-1] for x in tnd]
    res["varlen"] = _expect_error(lambda: call(*tnd, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, timeout=60),
                                  ValueError, "argument 'q': got 3 local tokens on CP ranks 1 and 2; expected 4 and "
                                  "4: the shards of the varlen batch of cu_seqlens_q (2 sequences, 16 tokens)")
    out = call(*(cp.shard(x, seq_dim=2) for x in (q, k, v)), causal=True, timeout=60)
    res["after"] = "ok" if out.shape == (1, 2, 4, 8) and torch.isfinite(out).all() else "bad output"
    return res


MEMORY_SEQ = 8192


def _peak_memory():
    """Peak memory a ring call adds on this rank (forward; forward and backward), causal bf16 over
    MEMORY_SEQ tokens, each rank's shard drawn at shard size; and on rank 0 the same for one process
    over the whole sequence. Measured first, in fresh processes, from the resident-set high-water
    mark, with every buffer over 64 KiB mapped on its own so that the resident set follows what is
    alive (glibc's M_MMAP_THRESHOLD, -3)."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)
    world, rank = dist.get_world_size(), dist.get_rank()
    plan = ShardPlan.build(world, True, seq_len=MEMORY_SEQ)

    def tensors(n, grad):
        gen = torch.Generator().manual_seed(7)
        q = torch.randn(1, 4, n, 64, generator=gen, dtype=torch.bfloat16).requires_grad_(grad)
        return [q] + [torch.randn(1, 2, n, 64, generator=gen, dtype=torch.bfloat16).requires_grad_(grad)
                      for _ in range(2)]

    def run(attention, n, grad):
        q, k, v = tensors(n, grad)

        def call():
            with torch.set_grad_enabled(grad):
                out = attention(q, k, v)
            if grad:
                out.backward(torch.ones_like(out))

        return measure.peak_memory(call)[1]

    ring_call = lambda q, k, v: cp.context_parallel_attention(q, k, v, causal=True, timeout=120)  # noqa: E731
    run(ring_call, 128, True)  # warm-up: engine, connections
    peaks = dict(fwd=run(ring_call, plan.local_len(rank), False), fwd_bwd=run(ring_call, plan.local_len(rank), True))
    if rank == 0:
        single_call = lambda q, k, v: tileattn.flash_attention(q, k, v, causal=True)  # noqa: E731
        run(single_call, 128, True)
        peaks.update(single_fwd=run(single_call, MEMORY_SEQ, False), single_fwd_bwd=run(single_call, MEMORY_SEQ, True))
    return peaks


def _group_main(cases):
    mesh = cp.hybrid_mesh(2, dist.get_world_size() // 2) if dist.get_world_size() == 4 else None
    memory = _peak_memory() if dist.get_world_size() == 4 and sys.platform == "linux" else None
    results = {c["name"]: _run_case(c, mesh) for c in cases}
    results["memory"] = memory
    results["errors"] = _error_checks() if dist.get_world_size() == 2 else _length_checks()
    return results


# ---------------------------------------------------------------------------------------------
# In the parent.


@pytest.fixture(scope="module")
def groups():
    """{world: [each rank's results]}, each group spawned once, lazily."""
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = run_local(_group_main, world, CASES_2 if world == 2 else CASES_4, timeout=600)
        return cache[world]

    return get


def _reference(c, compute_dtype):
    t, kw = _inputs(c)
    leaves = {n: t[n].detach().clone().requires_grad_() for n in ("q", "k", "v")}
    for n in ("bias", "sinks"):
        if n in kw:
            kw[n] = leaves["d" + n] = kw[n].detach().clone().requires_grad_()
    out, lse = tileattn.reference(leaves["q"], leaves["k"], leaves["v"], compute_dtype=compute_dtype,
                                  return_lse=True, **kw)
    outs, grads_in = [out], [t["dout"].to(out.dtype)]
    if c["dlse"]:
        outs.append(lse)
        grads_in.append(t["dlse"].to(lse.dtype))
    names = list(leaves)
    grads = torch.autograd.grad(outs, [leaves[n] for n in names], grads_in)
    res = dict(out=out, lse=lse)
    res.update({("d" + n if n in "qkv" else n): g for n, g in zip(names, grads)})
    return res


_VERDICTS = {}


def verdicts(c, got, world):
    """(name, error, tolerance scaled by world, plain 2x tolerance) per result (computed once)."""
    key = (world, c["name"])
    if key not in _VERDICTS:
        _VERDICTS[key] = _verdicts(c, got, world)
    return _VERDICTS[key]


def _verdicts(c, got, world):
    dtype = DTYPES[c["dtype"]]
    oracle, baseline = _reference(c, torch.float64), _reference(c, None)
    assert set(got) == set(oracle), (sorted(got), sorted(oracle))
    rows = []
    for name in oracle:
        plain = judge(name, got[name], oracle[name], baseline[name], dtype)
        floor = plain.tolerance - 2.0 * plain.baseline_error
        scaled = judge(name, got[name], oracle[name], baseline[name], dtype, factor=2.0 * world, floor=floor * world)
        rows.append((name, scaled.error, scaled.tolerance, plain.tolerance))
    return rows


def _pieces(c, world, u):
    """How many pieces each K/V block travels in: the ring's blocks are the shards of U ranks."""
    varlen = c["layout"] == "TND"
    plan = ShardPlan.build(world, c["lb"], cu_seqlens=[0, *torch.tensor(c["lens"]).cumsum(0).tolist()]) if varlen \
        else ShardPlan.build(world, c["lb"], seq_len=c["S"])
    rows = max(sum(plan.local_len(g) for g in range(i * u, (i + 1) * u)) for i in range(world // u))
    return max(1, min(ring.MAX_PIECES, rows // (c["piece_rows"] or MIN_PIECE_ROWS)))


def _check_counts(c, ranks, world):
    u = {"ring": 1, "ulysses": world, "hybrid": 2}[c["mode"]]
    r = world // u
    p = _pieces(c, world, u)
    assert (p > 1) == bool(c["piece_rows"]), (c["name"], p)
    for rank, res in enumerate(ranks):
        fwd, bwd = res["fwd"]["calls"], res["bwd"]["calls"]
        sends = lambda calls, tag: calls.get(("send", tag), 0)  # noqa: E731
        # Ring: world - 1 K/V blocks forward; backward world - 1 K/V and world dK/dV; each block in p pieces.
        assert sends(fwd, "kv") == (r - 1) * p and sends(fwd, "dkv") == 0, (rank, fwd)
        assert sends(bwd, "kv") == (r - 1) * p and sends(bwd, "dkv") == (r * p if r > 1 else 0), (rank, bwd)
        if r > 1 and c["layout"] != "TND" and c["S"] % (2 * world) == 0 and u == 1:
            kv = res["local"]["k_bytes"] + res["local"]["v_bytes"]
            assert res["fwd"]["bytes"][("send", "kv")] == (r - 1) * kv, (rank, res["fwd"]["bytes"])
        a2a_f = sorted(t for (op, t) in fwd if op == "all_to_all")
        a2a_b = sorted(t for (op, t) in bwd if op == "all_to_all")
        if u == 1:
            assert not a2a_f and not a2a_b, (rank, fwd, bwd)
        else:
            rows_extra = ["bias"] if c["bias"] == "rows" else []
            rows_extra += ["mask"] if c["mask"] else []
            want_f = sorted(["q", "k", "v", "out", "lse"] + rows_extra)
            want_b = sorted(["grad_q", "grad_k", "grad_v", "grad_out"] + (["grad_lse"] if c["dlse"] else [])
                            + (["grad_bias"] if c["bias"] == "rows" else []))
            assert a2a_f == want_f and a2a_b == want_b, (rank, a2a_f, a2a_b)
            assert all(fwd[("all_to_all", t)] == 1 for t in want_f), (rank, fwd)
        # One small all-gather per level checks that every rank makes the same call.
        assert fwd[("all_gather", "validate")] == (2 if 1 < u < world else 1), (rank, fwd)
        assert not any(op == "all_gather" for (op, _) in bwd), (rank, bwd)


@pytest.mark.parametrize("world, c", [(2, c) for c in CASES_2] + [(4, c) for c in CASES_4],
                         ids=[f"w2-{c['name']}" for c in CASES_2] + [f"w4-{c['name']}" for c in CASES_4])
def test_matches_single_process_reference(groups, world, c):
    ranks = groups(world)
    rows = verdicts(c, ranks[0][c["name"]]["got"], world)
    failed = [f"{n}: err {e:.2e} > tol {t:.2e}" for n, e, t, _ in rows if not e <= t]
    assert not failed, f"{c['name']} on {world} ranks: " + " | ".join(failed)
    _check_counts(c, [r[c["name"]] for r in ranks], world)


@pytest.mark.parametrize("world", [2, 4])
def test_bad_calls_raise_the_same_clear_error_on_every_rank(groups, world):
    ranks = groups(world)
    for rank, res in enumerate(ranks):
        bad = {k: v for k, v in res["errors"].items() if v != "ok"}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.skipif(sys.platform != "linux", reason="peak memory from /proc/self (Linux)")
def test_ring_peak_memory_per_rank_falls_as_one_over_world(groups):
    """On 4 ranks, the peak a ring call adds on each rank is at most 1.3/W of one process's peak over
    the whole sequence, forward and backward: K/V travel in pieces through reused buffers, query rows
    are merged a chunk at a time into one fp32 accumulator, dK/dV accumulators follow the pieces.
    Whole blocks in flight (two K/V blocks, three fp32 dK/dV blocks, a block-sized partial result)
    made it 2.0-2.5/W. The forward alone keeps an fp32 accumulator next to its bf16 output, which one
    process never holds: 2/W is its floor (measured 2.2-2.35/W; whole blocks made it 4.5-6/W)."""
    ranks = groups(4)
    single = ranks[0]["memory"]
    for rank, res in enumerate(ranks):
        peaks = res["memory"]
        if None in (peaks["fwd"], peaks["fwd_bwd"], single["single_fwd"], single["single_fwd_bwd"]):
            pytest.skip("no peak-memory counter on this system")
        fwd_bwd = 4 * peaks["fwd_bwd"] / single["single_fwd_bwd"]
        fwd = 4 * peaks["fwd"] / single["single_fwd"]
        assert fwd_bwd <= 1.3, f"rank {rank}: forward+backward peak {peaks['fwd_bwd'] / 2**20:.1f} MiB = {fwd_bwd:.2f}/W " \
            f"of one process's {single['single_fwd_bwd'] / 2**20:.1f} MiB"
        assert fwd <= 3.0, f"rank {rank}: forward peak {peaks['fwd'] / 2**20:.1f} MiB = {fwd:.2f}/W of one " \
            f"process's {single['single_fwd'] / 2**20:.1f} MiB"


def test_every_result_also_meets_the_unscaled_rule(groups):
    """The world-scaled tolerance is PyTorch's convention, not a need: every output, LSE and
    gradient of every case (merged and accumulated in fp32, rounded once per block) meets
    FlashAttention's unscaled 2x rule, so a regression that the scaled rule would still let through
    fails here."""
    over = []
    for world, cases in ((2, CASES_2), (4, CASES_4)):
        ranks = groups(world)
        for c in cases:
            rows = verdicts(c, ranks[0][c["name"]]["got"], world)
            over += [(world, c["name"], n, f"{e / p:.2f}") for n, e, _, p in rows if e > p]
    assert not over, over
