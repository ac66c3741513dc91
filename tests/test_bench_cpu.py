"""benchmarks/bench_cpu.py --quick runs end to end and writes complete CSV and JSON results."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu.py"
NUMERIC = ("median_ms", "min_ms", "spread_pct", "gflops", "pct_peak", "vs_sdpa", "vs_naive")


def test_quick_benchmark_writes_csv_and_json(tmp_path):
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--reps", "2", "--only", "grid,decode,memory",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "vs sdpa" in res.stdout

    with open(tmp_path / "cpu_quick.csv") as f:
        rows = list(csv.DictReader(f))
    report = json.loads((tmp_path / "cpu_quick.json").read_text())
    assert len(report["rows"]) == len(rows)
    meta = report["meta"]
    assert set(meta["geomean_vs_sdpa"]) == {f"grid/fp32/{m}/{p}" for m in ("fwd", "fwd+bwd") for p in ("native", "cpu")} \
        | {f"decode/fp32/fwd/{p}" for p in ("tileattn", "native", "cpu")}
    assert meta["native"]["isa"] in ("avx512", "avx2", "generic")
    peak = meta["fma_peak_gflops"]
    assert peak["nominal"] == peak["threads"] * peak["one_core"] and peak["one_core"] > 0

    timed = [r for r in report["rows"] if r["section"] == "grid"]
    # Two modes x four providers (both engines), all measured interleaved with the requested repetitions.
    assert sorted((r["mode"], r["provider"]) for r in timed) == sorted(
        (m, p) for m in ("fwd", "fwd+bwd") for p in ("native", "cpu", "sdpa", "naive"))
    for r in timed:
        assert r["reps"] == 2
        for name in NUMERIC:
            assert isinstance(r[name], float) and r[name] > 0, (name, r)
        assert r["min_ms"] <= r["median_ms"]
        assert abs(r["pct_peak"] - 100 * r["gflops"] / peak["nominal"]) < 1e-9
    for mode in ("fwd", "fwd+bwd"):
        by = {r["provider"]: r for r in timed if r["mode"] == mode}
        assert by["sdpa"]["vs_sdpa"] == 1.0 and by["naive"]["vs_naive"] == 1.0
        for engine in ("native", "cpu"):
            ratio = by["sdpa"]["median_ms"] / by[engine]["median_ms"]
            assert abs(by[engine]["vs_sdpa"] - ratio) < 1e-9

    # A decode step: one query row per head against 128 cached keys, 8 query heads on 2 kv heads;
    # tileattn is the plain call (dispatch, Python included).
    decode = {r["provider"]: r for r in report["rows"] if r["section"] == "decode"}
    assert set(decode) == {"tileattn", "native", "cpu", "sdpa"}
    for r in decode.values():
        assert (r["seqlen_q"], r["seqlen"], r["heads"], r["heads_kv"]) == (1, 128, 8, 2)
        assert r["reps"] == 2 and 0 < r["median_ms"] < 50 and r["peak_mib"] is None
        assert abs(r["gflops"] * r["median_ms"] * 1e6 / (4 * 8 * 128 * 64) - 1) < 1e-9

    memory = [r for r in report["rows"] if r["section"] == "memory"]
    assert len(memory) == 1 and memory[0]["provider"] == "native"
    # A fresh process really ran the call: its resident set grew.
    assert memory[0]["peak_mib"] is not None and memory[0]["peak_mib"] > 0
    assert memory[0]["median_ms"] is None  # memory-only row: nothing timed
    csv_memory = [r for r in rows if r["section"] == "memory"]
    assert float(csv_memory[0]["peak_mib"]) == memory[0]["peak_mib"]
