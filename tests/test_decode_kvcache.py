"""flash_attn_with_kvcache against the exact reference, on flash-attn's own test pattern.

flash-attn's ``tests/test_flash_attn.py::test_flash_attn_kvcache`` draws random cache lengths (room
left for the new tokens, and for causal rotary queries), random left pads below them, a random
permutation of cache entries (``cache_batch_idx``), a paged pool with a random page permutation, ALiBi
slopes (B, H), random windows, rotary tables covering the cache; it writes the rotated new keys into
a copy of the cache and compares against attention over the keys ``[leftpad, seqlen + new)`` of each
sequence. The same here, with the oracle being :func:`tileattn.reference` in fp64 per sequence and
FlashAttention's 2x rule against the reference in the inputs' dtype (:func:`tileattn.core.testing.judge`).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tileattn
import tileattn.compat.flash_attn as flash_attn
from tileattn.compat.flash_attn import kvcache
from tileattn.core import lean
from tileattn.core.testing import judge

from conftest import rotary_oracle

MODES = ("contiguous", "batch_idx", "leftpad", "batch_idx+leftpad", "paged")


def _case(index):
    """The parameters flash-attn's test takes from its grid, drawn per case from a seeded generator."""
    g = torch.Generator().manual_seed(1000 + index)
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=g))]  # noqa: E731
    return dict(seqlen_q=pick([1, 1, 3, 4]), mha=pick([(6, 6), (6, 3), (6, 1)]), d=pick([32, 48]),
                alibi=pick([False, True]), dtype=pick([torch.float32, torch.float32, torch.float16, torch.bfloat16]),
                seqlen_new_eq_seqlen_q=pick([True, False]), generator=g)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("new_kv,rotary", [(False, None), (True, None), (True, "interleaved"), (True, "neox")])
@pytest.mark.parametrize("causal,local", [(False, False), (True, False), (False, True)])
def test_kvcache_matches_reference_on_flash_attns_pattern(mode, new_kv, rotary, causal, local):
    index = MODES.index(mode) * 100 + (rotary is not None) * 10 + new_kv * 20 + causal * 3 + local
    p = _case(index)
    g = p["generator"]
    dtype, (heads, heads_k), d, seqlen_q = p["dtype"], p["mha"], p["d"], p["seqlen_q"]
    batch, seqlen_k, page = 3, 37, 8
    has_batch_idx, has_leftpad, paged = "batch_idx" in mode, "leftpad" in mode, mode == "paged"
    batch_cache = 2 * batch if has_batch_idx else batch

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q = rnd(batch, seqlen_q, heads, d)
    seqlen_new = seqlen_q if p["seqlen_new_eq_seqlen_q"] else int(torch.randint(1, seqlen_q + 1, (1,), generator=g))
    k_new = rnd(batch, seqlen_new, heads_k, d) if new_kv else None
    v_new = rnd(batch, seqlen_new, heads_k, d) if new_kv else None
    rotary_dim = 0 if rotary is None else 16 * int(torch.randint(1, d // 16 + 1, (1,), generator=g))
    if paged:
        blocks_per_seq = math.ceil(seqlen_k / page)
        num_blocks = blocks_per_seq * batch * 3
        pool_k, pool_v = rnd(num_blocks, page, heads_k, d), rnd(num_blocks, page, heads_k, d)
        block_table = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_seq].view(batch, -1).int()
        k_cache = pool_k[block_table.long()].flatten(1, 2)[:, :seqlen_k].clone()
        v_cache = pool_v[block_table.long()].flatten(1, 2)[:, :seqlen_k].clone()
        capacity = blocks_per_seq * page
    else:
        k_cache, v_cache = rnd(batch_cache, seqlen_k, heads_k, d), rnd(batch_cache, seqlen_k, heads_k, d)
        block_table, capacity = None, seqlen_k
    room = (seqlen_q if (causal or local) and rotary_dim else seqlen_new) if new_kv else 0
    lens = torch.randint(0 if new_kv else 1, seqlen_k - room + 1, (batch,), generator=g, dtype=torch.int32)
    leftpad = None
    if has_leftpad:
        leftpad = torch.stack([torch.randint(0, int(n), (1,), generator=g)[0] if n > 0 else torch.tensor(0)
                               for n in lens]).int()
    batch_idx = torch.randperm(batch_cache, generator=g)[:batch].int() if has_batch_idx else None
    slopes = torch.rand(batch, heads, generator=g) * 0.3 if p["alibi"] else None
    window = tuple(int(w) for w in torch.randint(0, seqlen_k, (2,), generator=g)) if local else (-1, -1)
    cos = sin = None
    q_ro, k_ro = q, k_new
    if rotary_dim:
        angle = torch.rand(capacity if paged else seqlen_k, rotary_dim // 2, generator=g) * 2 * math.pi
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        inter = rotary == "interleaved"
        q_ro = torch.stack([rotary_oracle(q[b], torch.arange(n, n + seqlen_q) if causal or local
                                           else torch.full((seqlen_q,), int(n)), cos, sin, inter)
                            for b, n in enumerate(lens)]).to(dtype)
        k_ro = torch.stack([rotary_oracle(k_new[b], torch.arange(n, n + seqlen_new), cos, sin, inter)
                            for b, n in enumerate(lens)]).to(dtype)
    rows = batch_idx.long() if has_batch_idx else torch.arange(batch)
    k_ref, v_ref = k_cache[rows].clone(), v_cache[rows].clone()
    if new_kv:
        for b, n in enumerate(lens.tolist()):
            k_ref[b, n:n + seqlen_new], v_ref[b, n:n + seqlen_new] = k_ro[b], v_new[b]

    out, lse = flash_attn.flash_attn_with_kvcache(
        q, pool_k if paged else k_cache, pool_v if paged else v_cache, k_new, v_new, rotary_cos=cos,
        rotary_sin=sin, cache_seqlens=lens, cache_batch_idx=batch_idx, cache_leftpad=leftpad,
        block_table=block_table, causal=causal, window_size=window, rotary_interleaved=rotary != "neox",
        alibi_slopes=slopes, return_softmax_lse=True)

    if new_kv:  # the caches were updated in place, the rotated keys as flash-attn's test checks them
        if paged:
            k_sel = pool_k[block_table.long()].flatten(1, 2)[:, :seqlen_k]
            v_sel = pool_v[block_table.long()].flatten(1, 2)[:, :seqlen_k]
        else:
            k_sel, v_sel = k_cache[rows], v_cache[rows]
        torch.testing.assert_close(k_sel.double(), k_ref.double(), rtol=1e-2, atol=1e-2)
        assert torch.equal(v_sel, v_ref)
    outs = {name: [] for name in ("oracle", "baseline")}
    lses = []
    for b, n in enumerate(lens.tolist()):
        start, end = (int(leftpad[b]) if has_leftpad else 0), n + (seqlen_new if new_kv else 0)
        keys, vals = k_ref[b:b + 1, start:end], v_ref[b:b + 1, start:end]
        kw = dict(layout="BSND", causal=causal, window=tuple(None if w < 0 else w for w in window),
                  alibi_slopes=None if slopes is None else slopes[b:b + 1])
        o64, l64 = tileattn.reference(q_ro[b:b + 1], keys, vals, compute_dtype=torch.float64, return_lse=True, **kw)
        outs["oracle"].append(o64)
        lses.append(l64)
        outs["baseline"].append(tileattn.reference(q_ro[b:b + 1], keys, vals, **kw))
    verdict = judge("out", out, torch.cat(outs["oracle"]), torch.cat(outs["baseline"]), dtype)
    assert verdict.ok, verdict
    ref_lse = torch.cat(lses)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max() < (1e-4 if dtype == torch.float32 else 2e-2)


def _inputs(batch=3, cap=24, heads=4, heads_k=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads, d, generator=g)
    k_cache, v_cache = torch.randn(batch, cap, heads_k, d, generator=g), torch.randn(batch, cap, heads_k, d, generator=g)
    k_new, v_new = torch.randn(batch, 1, heads_k, d, generator=g), torch.randn(batch, 1, heads_k, d, generator=g)
    return q, k_cache, v_cache, k_new, v_new


def _captured(monkeypatch):
    """Record the arguments kvcache hands to tileattn.flash_attention."""
    calls = []
    real = kvcache.flash_attention

    def spy(q, k, v, **kwargs):
        calls.append((q, k, v, kwargs))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(kvcache, "flash_attention", spy)
    return calls


def test_kvcache_is_one_core_call_reading_the_cache_in_place(monkeypatch):
    """cache_seqlens -> seqused_k, cache_batch_idx -> a one-column block table over the cache itself,
    leftpad -> pages of the cache itself: one flash_attention call, and the cache is never copied."""
    calls = _captured(monkeypatch)
    q, k_cache, v_cache, k_new, v_new = _inputs()
    lens = torch.tensor([3, 10, 0], dtype=torch.int32)
    flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens)
    (_, k, _, kw), = calls
    assert k is k_cache and torch.equal(kw["seqused_k"], lens + 1) and kw.get("block_table") is None
    big_k, big_v = torch.randn(5, 24, 2, 16), torch.randn(5, 24, 2, 16)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    flash_attn.flash_attn_with_kvcache(q, big_k, big_v, cache_seqlens=lens, cache_batch_idx=idx)
    _, k, _, kw = calls[-1]
    assert k is big_k and torch.equal(kw["block_table"], idx[:, None])
    pads = torch.tensor([2, 4, 0], dtype=torch.int32)
    flash_attn.flash_attn_with_kvcache(q, big_k, big_v, cache_seqlens=lens, cache_batch_idx=idx, cache_leftpad=pads)
    _, k, _, kw = calls[-1]
    assert k.data_ptr() == big_k.data_ptr() and k.shape[1] == 2  # pages of gcd(24, 2, 4, 0) = 2 slots
    assert torch.equal(kw["seqused_k"], lens - pads)
    assert len(calls) == 3


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["contiguous", "paged", "leftpad"])
def test_cache_update_and_rotary_are_vectorised(mode):
    """The same number of tensor operations for 2 sequences of 1 new token as for 16 of 5: no Python
    loop over batch items or tokens (the update is one index_put_ per cache, rotary one gather)."""
    def ops(batch, new):
        g = torch.Generator().manual_seed(batch)
        q = torch.randn(batch, new, 4, 32, generator=g)
        k_new, v_new = (torch.randn(batch, new, 2, 32, generator=g) for _ in range(2))
        cos, sin = torch.rand(64, 8, generator=g), torch.rand(64, 8, generator=g)
        lens = torch.randint(5, 40, (batch,), generator=g, dtype=torch.int32)
        extra = {}
        if mode == "paged":
            k_cache, v_cache = torch.randn(batch * 8, 8, 2, 32), torch.randn(batch * 8, 8, 2, 32)
            extra["block_table"] = torch.randperm(batch * 8, generator=g).view(batch, 8).int()
        else:
            k_cache, v_cache = torch.randn(batch, 64, 2, 32), torch.randn(batch, 64, 2, 32)
        if mode == "leftpad":
            extra["cache_leftpad"] = (lens // 2).int()
        # the attention call on one path for both shapes (a lean call allocates fewer tensors than
        # the full path, and only decode-shaped calls take it): what is counted is the dialect's own
        with lean.bypassed(), _CountOps() as counter:
            flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                               cache_seqlens=lens, causal=True, **extra)
        return counter.count

    assert ops(2, 1) == ops(16, 5)


def test_num_splits_is_a_hint_that_changes_no_bit():
    q, k_cache, v_cache, _, _ = _inputs(cap=600, seed=3)
    lens = torch.tensor([599, 17, 300], dtype=torch.int32)
    outs = [flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=n)
            for n in (0, 1, 7, torch.tensor(3))]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    with pytest.raises(ValueError, match="'num_splits'") as info:
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=-1)
    assert isinstance(info.value, RuntimeError)


def test_a_sequence_decodes_to_the_same_bits_alone_or_in_a_batch():
    """The decode path's chunking depends on the sequence alone (batch invariance), through kvcache."""
    q, k_cache, v_cache, _, _ = _inputs(batch=4, cap=3000, heads=8, heads_k=2, d=64, seed=4)
    lens = torch.tensor([2999, 5, 1024, 2048], dtype=torch.int32)
    together = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens)
    for b in range(4):
        alone = flash_attn.flash_attn_with_kvcache(q[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1],
                                                   cache_seqlens=lens[b:b + 1])
        assert torch.equal(alone, together[b:b + 1]), b


def test_leftpad_on_a_cache_whose_dims_cannot_merge_is_gathered_exactly():
    q, k_big, v_big, k_new, v_new = _inputs(cap=40, seed=5)
    k_cache, v_cache = k_big[:, :24], v_big[:, :24]  # a slice of a longer buffer: (B, S) not mergeable
    lens, pads = torch.tensor([20, 7, 3], dtype=torch.int32), torch.tensor([5, 6, 0], dtype=torch.int32)
    out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens,
                                             cache_leftpad=pads, causal=True)
    expected = flash_attn.flash_attn_with_kvcache(q, k_cache.contiguous(), v_cache.contiguous(), cache_seqlens=lens + 1,
                                                  cache_leftpad=pads, causal=True)
    assert torch.equal(k_big[1, 7], k_new[1, 0])  # written in place, in the user's buffer
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_empty_and_fully_padded_sequences_see_nothing():
    q, k_cache, v_cache, _, _ = _inputs(seed=6)
    lens, pads = torch.tensor([0, 5, 9], dtype=torch.int32), torch.tensor([0, 5, 2], dtype=torch.int32)
    out, lse = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, cache_leftpad=pads,
                                                  return_softmax_lse=True)
    assert torch.all(out[:2] == 0) and torch.all(torch.isneginf(lse[:2])) and torch.isfinite(lse[2]).all()


@pytest.mark.parametrize("kwargs,name,exc", [
    (dict(cache_seqlens=torch.tensor([3, 4, 5], dtype=torch.int32), cache_leftpad=torch.tensor([0, 5, 0])),
     "cache_leftpad", TypeError),
    (dict(cache_seqlens=torch.tensor([3, 4, 5], dtype=torch.int32),
          cache_leftpad=torch.tensor([0, 5, 0], dtype=torch.int32)), "cache_leftpad", ValueError),
    (dict(cache_seqlens=3, cache_leftpad=1), "cache_leftpad", TypeError),
    (dict(cache_seqlens=torch.tensor([3, 4, 25], dtype=torch.int32)), "cache_seqlens", ValueError),
    (dict(cache_seqlens=3, cache_batch_idx=torch.tensor([0, 1, 3], dtype=torch.int32)), "cache_batch_idx",
     ValueError),
    (dict(cache_seqlens=3, cache_batch_idx=torch.tensor([0, 1])), "cache_batch_idx", TypeError),
    (dict(cache_seqlens=3, alibi_slopes=torch.ones(3, 5)), "alibi_slopes", ValueError),
])
def test_bad_cache_arguments_are_named_before_anything_is_written(kwargs, name, exc):
    q, k_cache, v_cache, k_new, v_new = _inputs(seed=7)
    before = k_cache.clone()
    with pytest.raises(exc, match=f"'{name}'") as info:
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kwargs)
    assert isinstance(info.value, RuntimeError) and torch.equal(k_cache, before)


def test_new_keys_of_another_dtype_are_refused():
    q, k_cache, v_cache, k_new, v_new = _inputs(seed=8)
    with pytest.raises(TypeError, match="'k'"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new.double(), v_new, cache_seqlens=2)
    with pytest.raises(TypeError, match="'k_cache'"):
        flash_attn.flash_attn_with_kvcache(q, k_cache.half(), v_cache, cache_seqlens=2)


def _pool_of(cache, page):
    """A contiguous (B, cap, Hk, D) cache as a pool of pages with a shuffled block table."""
    batch, cap = cache.shape[:2]
    order = torch.randperm(batch * cap // page, generator=torch.Generator().manual_seed(3))
    pool = torch.empty(batch * cap // page, page, *cache.shape[2:])
    pool[order] = cache.reshape(batch * cap // page, page, *cache.shape[2:])
    return pool, order.view(batch, cap // page).int()


def _bad_call(case):
    """(arguments of flash_attn_with_kvcache, the argument the error must name, exception type, an
    environment variable to set) for one bad call that appends new keys."""
    q, k_cache, v_cache, k_new, v_new = _inputs(seed=11)
    lens = torch.tensor([3, 9, 0], dtype=torch.int32)
    kw = dict(cache_seqlens=lens)
    angles = torch.arange(24.0)[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001])
    rotary = dict(rotary_cos=angles.cos(), rotary_sin=angles.sin())
    name, exc, env = None, ValueError, None
    if case == "query heads not divisible by kv heads":
        q, name = q[:, :, :3], "k_cache"
    elif case.startswith("softmax_scale"):
        kw["softmax_scale"], name = float(case.split()[-1]), "softmax_scale"
    elif case.startswith("softcap"):
        kw["softcap"], name = float(case.split()[-1]), "softcap"
    elif case == "a window beyond int64":
        kw["window_size"], name = (2**70, 0), "window_size"
    elif case == "a window beyond 2**62":
        kw["window_size"], name = (2**62 + 1, 0), "window_size"
    elif case == "alibi_slopes on another device":
        kw["alibi_slopes"], name = torch.ones(4, device="meta"), "alibi_slopes"
    elif case == "an int dtype":
        q, k_cache, v_cache, k_new, v_new = ((t * 8).to(torch.int32) for t in (q, k_cache, v_cache, k_new, v_new))
        name, exc = "q", TypeError
    elif case == "rotary tables on another device":
        kw.update(rotary_cos=angles.cos().to("meta"), rotary_sin=angles.sin().to("meta"))
        name = "rotary_cos"
    elif case == "rotary tables shorter than the cache":
        kw.update(rotary_cos=rotary["rotary_cos"][:20], rotary_sin=rotary["rotary_sin"][:20])
        name = "rotary_cos"
    elif case == "cache_seqlens leaving no room":
        kw["cache_seqlens"], name = torch.tensor([3, 24, 0], dtype=torch.int32), "cache_seqlens"
    elif case == "a page the block_table does not have":
        k_cache, table = _pool_of(k_cache, 8)
        v_cache, _ = _pool_of(v_cache, 8)
        table[1, 1] = 99
        kw["block_table"], name = table, "block_table"
    elif case == "cache_batch_idx out of range":
        kw["cache_batch_idx"], name = torch.tensor([2, 0, 3], dtype=torch.int32), "cache_batch_idx"
    elif case == "cache_leftpad past cache_seqlens":
        kw["cache_leftpad"], name = torch.tensor([0, 10, 0], dtype=torch.int32), "cache_leftpad"
    elif case == "num_splits negative":
        kw["num_splits"], name = -1, "num_splits"
    elif case == "an unknown backend in TILEATTN_BACKEND (refused by the core after validation)":
        env, name = "no_such_engine", "backend"
    elif case == "a v_cache that cannot be written (after k_cache was)":
        with torch.inference_mode():  # not writable in place outside inference mode
            v_cache = v_cache.clone()
        name, exc = None, RuntimeError
    return (q, k_cache, v_cache, k_new, v_new), kw, name, exc, env


BAD_CALLS = ["query heads not divisible by kv heads", "softmax_scale nan", "softmax_scale inf", "softcap inf",
             "softcap nan", "softcap -1", "a window beyond int64", "a window beyond 2**62",
             "alibi_slopes on another device", "an int dtype", "rotary tables on another device",
             "rotary tables shorter than the cache", "cache_seqlens leaving no room",
             "a page the block_table does not have", "cache_batch_idx out of range",
             "cache_leftpad past cache_seqlens", "num_splits negative",
             "an unknown backend in TILEATTN_BACKEND (refused by the core after validation)",
             "a v_cache that cannot be written (after k_cache was)"]


@pytest.mark.parametrize("case", BAD_CALLS)
def test_a_call_that_fails_leaves_the_caches_byte_identical(monkeypatch, case):
    """flash_attn_with_kvcache writes the new keys in place: after any error, k_cache, v_cache and
    cache_seqlens hold exactly the bytes they held before (flash-attn's own arguments are checked
    before the write; a failure after it takes the new keys out again)."""
    (q, k_cache, v_cache, k_new, v_new), kw, name, exc, env = _bad_call(case)
    if env is not None:
        monkeypatch.setenv("TILEATTN_BACKEND", env)
    before = [t.clone() for t in (k_cache, v_cache, kw["cache_seqlens"])]
    with pytest.raises(exc, match=None if name is None else f"argument '{name}'") as info:
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, **kw)
    if name is not None and name != "backend":
        assert isinstance(info.value, RuntimeError) and "flash_attn_with_kvcache" in str(info.value)
    for now, then in zip((k_cache, v_cache, kw["cache_seqlens"]), before):
        assert torch.equal(now.contiguous().view(torch.uint8), then.contiguous().view(torch.uint8))


@pytest.mark.parametrize("batch", [1, 3])  # one sequence writes through a slice, more through index ops
def test_an_interrupted_call_takes_the_new_keys_out_again(monkeypatch, batch):
    """Even a KeyboardInterrupt during the attention (after the write) leaves the caches as they were."""
    q, k_cache, v_cache, k_new, v_new = _inputs(batch=batch, seed=12)
    before = k_cache.clone(), v_cache.clone()

    def interrupted(*args, **kwargs):
        assert not torch.equal(k_cache, before[0])  # the new keys were written
        raise KeyboardInterrupt

    monkeypatch.setattr(kvcache, "flash_attention", interrupted)
    with pytest.raises(KeyboardInterrupt):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=5)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("new", [1, 4])
def test_one_sequence_whose_v_cache_cannot_be_written_keeps_both_caches(new):
    """A single sequence's new keys go in through a slice of the cache: when v_cache refuses the write
    after k_cache took it, k_cache is put back byte for byte, and the keys of a good call land where
    the index path puts them."""
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, new, 4, 16, generator=g)
    k_cache, v_cache = torch.randn(1, 24, 2, 16, generator=g), torch.randn(1, 24, 2, 16, generator=g)
    k_new, v_new = torch.randn(1, new, 2, 16, generator=g), torch.randn(1, new, 2, 16, generator=g)
    with torch.inference_mode():  # not writable in place outside inference mode
        frozen = v_cache.clone()
    before = k_cache.clone()
    with pytest.raises(RuntimeError):
        flash_attn.flash_attn_with_kvcache(q, k_cache, frozen, k_new, v_new, cache_seqlens=7)
    assert torch.equal(k_cache.view(torch.uint8), before.view(torch.uint8))
    flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=7)
    assert torch.equal(k_cache[0, 7:7 + new], k_new[0]) and torch.equal(v_cache[0, 7:7 + new], v_new[0])
    assert torch.equal(k_cache[0, :7], before[0, :7]) and torch.equal(k_cache[0, 7 + new:], before[0, 7 + new:])


def _step_inputs(seed=14, batch=2, cap=40, new=1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, new, 4, 16, generator=g)
    caches = torch.randn(batch, cap, 2, 16, generator=g), torch.randn(batch, cap, 2, 16, generator=g)
    k_new, v_new = torch.randn(batch, new, 2, 16, generator=g), torch.randn(batch, new, 2, 16, generator=g)
    return q, caches, k_new, v_new


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=False, return_softmax_lse=True),
                                     dict(causal=True, window_size=(5, 0), softcap=3.0, softmax_scale=0.2)])
def test_a_repeated_step_skips_the_checks_and_gives_the_checked_steps_bits(monkeypatch, batch, options):
    """The second step of a shape takes the fast path (no argument check runs again), and its caches,
    output and LSE are bitwise those of the checked path on a copy of the same state."""
    from tileattn.core import plans
    plans.clear()
    q, (k_cache, v_cache), k_new, v_new = _step_inputs(batch=batch)
    lens = torch.tensor([7, 30, 0][:batch], dtype=torch.int32)
    flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, **options)
    assert plans.count(kvcache.KIND) == 1
    twin = k_cache.clone(), v_cache.clone()
    checked = []
    real = kvcache._checked
    monkeypatch.setattr(kvcache, "_checked", lambda *a: checked.append(1) or real(*a))
    fast = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens + 1, **options)
    assert checked == []
    plans.clear()  # the same step on the copy, every check run
    slow = flash_attn.flash_attn_with_kvcache(q, *twin, k_new, v_new, cache_seqlens=lens + 1, **options)
    assert checked == [1]
    for a, b in zip(fast if isinstance(fast, tuple) else (fast,), slow if isinstance(slow, tuple) else (slow,)):
        assert torch.equal(a, b)
    assert torch.equal(k_cache, twin[0]) and torch.equal(v_cache, twin[1])


@pytest.mark.parametrize("lengths, name", [([-1, 3], "cache_seqlens"), ([40, 3], "cache_seqlens")])
def test_a_repeated_step_with_bad_lengths_raises_the_checked_error_and_writes_nothing(lengths, name):
    """The fast path checks the values: a negative length or one leaving no room for the new key goes
    to the checked path, which names the argument; the caches keep their bytes."""
    from tileattn.core import plans
    plans.clear()
    q, (k_cache, v_cache), k_new, v_new = _step_inputs()
    good = torch.tensor([3, 4], dtype=torch.int32)
    flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=good)
    assert plans.count(kvcache.KIND) == 1
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(ValueError, match=f"argument '{name}'"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                           cache_seqlens=torch.tensor(lengths, dtype=torch.int32))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_options_of_another_type_are_another_step():
    """True and 1, 0.0 and 0: the key holds the options' types, so a value the checks refuse is never
    served by a plan made for the value they accept."""
    from tileattn.core import plans
    plans.clear()
    q, (k_cache, v_cache), k_new, v_new = _step_inputs()
    lens = torch.tensor([3, 4], dtype=torch.int32)
    flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=True)
    with pytest.raises((TypeError, ValueError), match="'causal'"):
        flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lens, causal=1)


@pytest.mark.parametrize("new_kv", [False, True])
def test_a_batch_of_no_sequences_repeats_as_it_passed(new_kv):
    """Batch 0: the checked step returns an empty output (no index to write); its repeat, served by
    the repeated step, returns the same (it once failed on the lengths' empty min())."""
    from tileattn.core import plans
    plans.clear()
    q, (k_cache, v_cache), k_new, v_new = _step_inputs(batch=0)
    extra = (k_new, v_new) if new_kv else ()
    lens = torch.zeros(0, dtype=torch.int32)
    outs = [flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, *extra, cache_seqlens=lens, causal=True,
                                               return_softmax_lse=True) for _ in range(2)]
    assert plans.count(kvcache.KIND) == 1
    for out, lse in outs:
        assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 4, 1)
