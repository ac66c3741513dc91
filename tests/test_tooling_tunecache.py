"""The tune cache the engines read (tileattn.core.tunecache): read once, validated, written atomically.

Before: every call re-read the cache's stamp, entries went to the engines unchecked (a negative
block gave uninitialised output, zero or a string crashed every call of that shape bucket) and
``tileattn tune`` crashed on such an entry instead of replacing it; writes were a plain
``write_text`` that a crash or a second writer could leave half-written.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch

import tileattn
from tileattn.core import tunecache
from tileattn.backends.cpu import default_config
from tileattn.core.spec import build_spec


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of this test's own, whose changes look-ups see at once (no recheck
    delay: the tests rewrite the file right after a look-up); returns the cache file's path."""
    monkeypatch.setenv("TILEATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tunecache, "RECHECK_SECONDS", 0.0)
    return tmp_path / tunecache.CACHE_FILE


def _qkv(s=96, d=16, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, 2, s, d, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


def _write(path, entries):
    path.write_text(entries if isinstance(entries, str) else json.dumps(entries))


def _tune_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, tunecache.TuneCacheWarning)]


BAD_CPU_ENTRIES = [
    ({"block_m": -16, "block_n": 64}, "block_m: -16 is outside 1..4096"),
    ({"block_m": 0, "block_n": 64}, "block_m: 0 is outside"),
    ({"block_m": 32, "block_n": 10**9}, "block_n: 1000000000 is outside 1..8192"),
    ({"block_m": 32.5, "block_n": 64}, "block_m: 32.5 is a float, not an int"),
    ({"block_m": "64", "block_n": 64}, "block_m: '64' is a str, not an int"),
    ({"block_m": True, "block_n": 64}, "block_m: True is a bool, not an int"),
    ({"block_m": None, "block_n": 64}, "block_m: None is a NoneType, not an int"),
    ({"block_n": 64}, "missing key 'block_m'"),
    ({"block_m": 32, "block_n": 64, "blockk": 8}, "unknown key 'blockk'"),
    ([32, 64], "the entry is a JSON list"),
]


@pytest.mark.parametrize("entry, problem", BAD_CPU_ENTRIES, ids=[p for _, p in BAD_CPU_ENTRIES])
def test_a_malformed_entry_is_ignored_with_one_warning_and_never_computed_with(cache, entry, problem):
    q, k, v = _qkv(requires_grad=True)
    inp = build_spec(q, k, v)
    heuristic = default_config(inp)  # no cache file yet
    key = tunecache.cache_key("cpu", inp)
    _write(cache, {key: entry})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert default_config(inp) == heuristic
            out = tileattn.flash_attention(q, k, v, backend="cpu")
    expected = tileattn.reference(q, k, v)
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    messages = _tune_warnings(caught)
    assert len(messages) == 1, messages
    assert str(cache) in messages[0] and repr(key) in messages[0] and problem in messages[0], messages[0]


@pytest.mark.parametrize("text, problem", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "holds a JSON list"),
    ('"a string"', "holds a JSON str"),
])
def test_a_malformed_file_is_ignored_with_one_warning(cache, text, problem):
    q, k, v = _qkv()
    inp = build_spec(q, k, v)
    heuristic = default_config(inp)
    _write(cache, text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert tunecache.lookup("cpu", inp) is None
            assert default_config(inp) == heuristic
    messages = _tune_warnings(caught)
    assert len(messages) == 1 and str(cache) in messages[0] and problem in messages[0], messages


def test_a_valid_entry_is_used_and_other_keys_bad_entries_stay_silent(cache):
    q, k, v = _qkv()
    inp = build_spec(q, k, v)
    _write(cache, {tunecache.cache_key("cpu", inp): {"block_m": 48, "block_n": 80},
                   "some|other|key": {"block_m": -1}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = default_config(inp)
    assert (cfg.block_m, cfg.block_n) == (48, 80)
    assert _tune_warnings(caught) == []


@pytest.mark.parametrize("config, problem", [
    ({"block_m": 48, "block_n": 64}, "block_m: 48 is not a power of two in 16..256"),
    ({"block_m": 8, "block_n": 64}, "block_m: 8 is not a power of two"),
    ({"block_m": 64, "block_n": 512}, "block_n: 512 is not a power of two in 16..256"),
    ({"block_m": 64, "block_n": 64, "num_warps": 3}, "num_warps: 3 is not a power of two in 1..32"),
    ({"block_m": 64, "block_n": 64, "num_stages": 0}, "num_stages: 0 is outside 1..8"),
    ({"block_m": 64, "block_n": 64, "num_warps": 4.0}, "num_warps: 4.0 is a float"),
])
def test_triton_entries_follow_the_kernels_rules(cache, config, problem):
    assert tunecache.problems("triton", {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 3}) == []
    assert problem in "; ".join(tunecache.problems("triton", config))
    inp = build_spec(*_qkv())
    _write(cache, {tunecache.cache_key("triton", inp): config})
    with pytest.warns(tunecache.TuneCacheWarning, match=problem.split(" is ")[0]):
        assert tunecache.lookup("triton", inp) is None


@pytest.mark.parametrize("config, problem", [
    ({"block_m": 128, "block_n": 48}, "block_n: 48 is not a multiple of 32 in 32..8192"),
    ({"block_m": 128, "block_n": 33}, "block_n: 33 is not a multiple of 32"),
    ({"block_m": 128, "block_n": 16384}, "block_n: 16384 is not a multiple of 32 in 32..8192"),
    ({"block_m": 0, "block_n": 64}, "block_m: 0 is outside 1..4096"),
    ({"block_m": 64}, "missing key 'block_n'"),
])
def test_native_entries_follow_the_kernels_rules_and_reach_the_kernels(cache, config, problem, monkeypatch):
    """A bad native entry is ignored with a warning and the kernels get their defaults (0: 128 lanes x
    256 keys); a valid one is what they are called with, forward and backward."""
    from tileattn.backends.native import kernels

    calls = []

    def spy(real):
        def call(*args, **kwargs):
            tiles = next(a for a in args if isinstance(a, kernels.Tiles))
            calls.append((tiles.block_m, tiles.block_n))
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(kernels, "forward", spy(kernels.forward))
    monkeypatch.setattr(kernels, "backward", spy(kernels.backward))
    q, k, v = _qkv(requires_grad=True)
    inp = build_spec(q, k, v)
    assert tunecache.problems("native", {"block_m": 40, "block_n": 96}) == []
    assert problem in "; ".join(tunecache.problems("native", config))
    _write(cache, {tunecache.cache_key("native", inp): config})
    with pytest.warns(tunecache.TuneCacheWarning, match=problem.split(" is ")[0]):
        tileattn.flash_attention(q, k, v, backend="native").sum().backward()
    _write(cache, {tunecache.cache_key("native", inp): {"block_m": 40, "block_n": 96}})
    out = tileattn.flash_attention(q, k, v, backend="native")
    out.sum().backward()
    assert calls == [(0, 0), (0, 0), (40, 96), (40, 96)]
    assert torch.allclose(out, tileattn.reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_overriding_and_store_refuse_an_invalid_config(cache):
    inp = build_spec(*_qkv())
    with pytest.raises(ValueError, match=r"argument 'config'.*block_m: 0 is outside"):
        with tunecache.overriding("cpu", {"block_m": 0, "block_n": 64}):
            pass
    with pytest.raises(ValueError, match="missing key 'block_n'"):
        tunecache.store("cpu", inp, {"block_m": 64})
    assert not cache.exists()


def test_the_file_is_read_once_and_again_only_when_it_changes(cache, monkeypatch):
    inp = build_spec(*_qkv())
    key = tunecache.cache_key("cpu", inp)
    _write(cache, {key: {"block_m": 32, "block_n": 64}})
    monkeypatch.setattr(tunecache, "RECHECK_SECONDS", 1.0)
    reads, stamps = [], []
    real_read, real_stamp = tunecache._read, tunecache._stamp
    monkeypatch.setattr(tunecache, "_read", lambda *a: reads.append(1) or real_read(*a))
    monkeypatch.setattr(tunecache, "_stamp", lambda *a: stamps.append(1) or real_stamp(*a))
    for _ in range(1000):
        assert tunecache.lookup("cpu", inp) == {"block_m": 32, "block_n": 64}
    assert len(reads) == 1
    assert len(stamps) <= 2, "a look-up must not stat the file on every call"
    # Another process rewrites the file: seen once the recheck delay has passed.
    _write(cache, {key: {"block_m": 128, "block_n": 256}})
    monkeypatch.setattr(tunecache, "RECHECK_SECONDS", 0.0)
    assert tunecache.lookup("cpu", inp) == {"block_m": 128, "block_n": 256}
    assert tunecache.lookup("cpu", inp) == {"block_m": 128, "block_n": 256}
    assert len(reads) == 2
    # This process's own store is seen at once, whatever the delay.
    monkeypatch.setattr(tunecache, "RECHECK_SECONDS", 3600.0)
    tunecache.store("cpu", inp, {"block_m": 16, "block_n": 64})
    assert tunecache.lookup("cpu", inp) == {"block_m": 16, "block_n": 64}


def test_store_replaces_a_bad_entry_and_repairs_a_broken_file(cache):
    inp = build_spec(*_qkv())
    key = tunecache.cache_key("cpu", inp)
    _write(cache, {key: {"block_m": -1}, "other": {"block_m": 8, "block_n": 8}})
    with pytest.warns(tunecache.TuneCacheWarning):
        assert tunecache.lookup("cpu", inp) is None
    tunecache.store("cpu", inp, {"block_m": 64, "block_n": 128})
    assert json.loads(cache.read_text()) == {key: {"block_m": 64, "block_n": 128}, "other": {"block_m": 8, "block_n": 8}}
    assert tunecache.lookup("cpu", inp) == {"block_m": 64, "block_n": 128}
    _write(cache, "{truncated")
    tunecache.store("cpu", inp, {"block_m": 32, "block_n": 64})
    assert json.loads(cache.read_text()) == {key: {"block_m": 32, "block_n": 64}}


def test_a_crash_while_writing_leaves_the_old_file_whole(cache, monkeypatch):
    inp = build_spec(*_qkv())
    tunecache.store("cpu", inp, {"block_m": 64, "block_n": 128})
    before = cache.read_bytes()

    def crash(fd):
        raise OSError("disk full")

    monkeypatch.setattr(tunecache.os, "fsync", crash)
    with pytest.raises(OSError, match="disk full"):
        tunecache.store("cpu", build_spec(*_qkv(d=32)), {"block_m": 16, "block_n": 64})
    assert cache.read_bytes() == before
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name, cache.name + ".lock"]


def _store_many(args):
    cache_dir, writer, count = args
    os.environ["TILEATTN_CACHE_DIR"] = cache_dir
    for i in range(count):
        inp = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, head_dim=1000 * writer + i,
                                    causal=False, seqlen_q=64, seqlen_k=64)
        tunecache.store("cpu", inp, {"block_m": 16 + i, "block_n": 64})


@pytest.mark.skipif(sys.platform != "linux", reason="forks writer processes")
def test_concurrent_writers_lose_no_entry_and_never_corrupt_the_file(cache):
    writers, count = 4, 25
    with multiprocessing.get_context("fork").Pool(writers) as pool:
        pool.map(_store_many, [(str(cache.parent), w, count) for w in range(writers)])
    data = json.loads(cache.read_text())
    assert len(data) == writers * count
    assert {tuple(sorted(v)) for v in data.values()} == {("block_m", "block_n")}


def test_tileattn_tune_replaces_a_malformed_entry(tmp_path):
    """Before, the engine crashed on int('abc') inside `tileattn tune` itself, so the command that is
    meant to repair the entry could not run."""
    shape = (1, 2, 128, 32)
    probe = build_spec(*(torch.empty(shape) for _ in range(3)))
    key = tunecache.cache_key("cpu", probe)
    (tmp_path / tunecache.CACHE_FILE).write_text(json.dumps({key: {"block_m": "abc", "block_n": 64}}))
    env = dict(os.environ, TILEATTN_CACHE_DIR=str(tmp_path))
    env.pop("TILEATTN_BACKEND", None)
    proc = subprocess.run([sys.executable, "-m", "tileattn", "tune", "--backend", "cpu",
                           "--shape", ",".join(map(str, shape)),
                           "--mode", "fwd", "--reps", "1", "--warmup", "0", "--quiet", "--budget-kib", "256"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.count("TuneCacheWarning") == 1, proc.stderr
    stored = json.loads((tmp_path / tunecache.CACHE_FILE).read_text())[key]
    assert tunecache.problems("cpu", stored) == []
    assert f"winner {stored}" in proc.stdout
