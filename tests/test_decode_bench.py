"""The decode and generate benchmarks run end to end at CI size and write complete results (no
timing assertions: the numbers of a shared machine are noise; their shape and finiteness are not)."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_decode  # noqa: E402

from tileattn.tools import decode_bench  # noqa: E402
from tileattn.tools.cli import main as cli_main  # noqa: E402


def _finite(x) -> bool:
    return x is not None and x != "" and math.isfinite(float(x)) and float(x) > 0


def test_bench_decode_small_writes_every_contender_with_finite_tileattn_numbers(tmp_path):
    out = tmp_path / "decode"
    rows = bench_decode.main(["--small", "--batches", "1,2", "--caches", "256", "--dtypes", "fp32,bf16",
                              "--reps", "1", "--out", str(out)])
    assert len(rows) == 2 * 2 * len(decode_bench.PROVIDERS)
    with open(out.with_suffix(".csv")) as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == decode_bench.FIELDS and len(table) == len(rows)
    ours = [r for r in table if r["provider"] == "tileattn"]
    assert len(ours) == 4 and all(r["status"] == "ok" for r in ours)
    for r in ours:
        for field in ("median_ms", "tokens_per_s", "kv_gb_per_s", "pct_bandwidth", "vs_sdpa_repeat",
                      "bandwidth_gb_per_s"):
            assert _finite(r[field]), (field, r)
        assert float(r["max_err_vs_fp64"]) < (1e-5 if r["dtype"] == "fp32" else 2e-2)
        assert int(r["kv_bytes"]) == 2 * int(r["batch"]) * 2 * 256 * 64 * (4 if r["dtype"] == "fp32" else 2)
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["bandwidth_gb_per_s"] > 0 and doc["summary"] and len(doc["results"]) == len(rows)


def test_a_shape_over_the_memory_budget_is_skipped_and_says_so():
    case = decode_bench.DecodeCase(1, 512, 4, 2, 16)
    rows = decode_bench.run_case(case, decode_bench.PROVIDERS, reps=1, warmup=0, budget_bytes=case.kv_bytes - 1,
                                 bandwidth=1.0)
    assert {r["status"] for r in rows} == {"skipped"} and "memory budget" in rows[0]["note"]
    # room for the cache but not for a repeated copy: only the contenders that repeat K/V are skipped
    rows = decode_bench.run_case(case, decode_bench.PROVIDERS, reps=1, warmup=0, budget_bytes=2 * case.kv_bytes,
                                 bandwidth=1.0)
    status = {r["provider"]: r["status"] for r in rows}
    assert status == {"tileattn": "ok", "tileattn_full": "ok", "sdpa_gqa": "ok", "sdpa_repeat": "skipped",
                      "sdpa_prerepeated": "skipped",
                      "naive": "skipped"}


def test_overhead_breakdown_names_every_layer(tmp_path):
    out = tmp_path / "overhead"
    rows = bench_decode.main(["--overhead", "--small", "--out", str(out)])
    layers = {r["layer"] for r in rows}
    assert {r["cache"] for r in rows} == {128, 4096}
    assert any("C kernel" in name for name in layers) and any("sdpa" in name for name in layers)
    assert all(_finite(r["median_us"]) for r in rows)
    assert len(json.loads(out.with_suffix(".json").read_text())["results"]) == len(rows)


def test_cli_decode_preset_writes_its_grid(tmp_path, capsys):
    path = tmp_path / "decode.csv"
    assert cli_main(["bench", "--preset", "decode", "--batch", "1", "--seqlens", "128", "--dtype", "fp32",
                     "--reps", "1", "--warmup", "0", "--quiet", "--csv", str(path)]) == 0
    assert "% bandwidth" in capsys.readouterr().out
    with open(path) as f:
        table = list(csv.DictReader(f))
    assert [r["provider"] for r in table] == list(decode_bench.PROVIDERS)
    ours = table[0]
    assert (ours["heads_q"], ours["heads_kv"], ours["head_dim"], ours["cache"]) == ("32", "8", "128", "128")
    assert _finite(ours["kv_gb_per_s"]) and _finite(ours["vs_sdpa_gqa"])


def test_cli_decode_preset_refuses_options_that_do_not_apply(capsys):
    assert cli_main(["bench", "--preset", "decode", "--mode", "fwd+bwd"]) != 0
    assert "--mode does not apply" in capsys.readouterr().err


def test_bench_generate_small_gives_eagers_tokens(tmp_path):
    pytest.importorskip("transformers")
    import bench_generate

    out = tmp_path / "generate"
    rows = bench_generate.main(["--small", "--batches", "1", "--out", str(out)])
    assert {(r["implementation"], r["cache"]) for r in rows} == {(i, c) for i in bench_generate.IMPLEMENTATIONS
                                                                  for c in bench_generate.CACHES}
    assert all(r["same_tokens_as_eager"] and _finite(r["tokens_per_s"]) for r in rows)
    with open(out.with_suffix(".csv")) as f:
        assert list(next(csv.DictReader(f))) == bench_generate.FIELDS
