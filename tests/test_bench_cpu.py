"""benchmarks/bench_cpu.py --quick runs end to end and writes complete CSV and JSON results."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu.py"
NUMERIC = ("median_ms", "min_ms", "spread_pct", "gflops", "vs_sdpa", "vs_naive")


def test_quick_benchmark_writes_csv_and_json(tmp_path):
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--reps", "2", "--only", "grid,memory",
         "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "vs sdpa" in res.stdout

    with open(tmp_path / "cpu_quick.csv") as f:
        rows = list(csv.DictReader(f))
    report = json.loads((tmp_path / "cpu_quick.json").read_text())
    assert len(report["rows"]) == len(rows)
    assert set(report["meta"]["geomean_vs_sdpa"]) == {"grid/fp32/fwd", "grid/fp32/fwd+bwd"}

    timed = [r for r in report["rows"] if r["section"] == "grid"]
    # Two modes x three providers, all measured interleaved with the requested repetitions.
    assert sorted((r["mode"], r["provider"]) for r in timed) == sorted(
        (m, p) for m in ("fwd", "fwd+bwd") for p in ("tileattn", "sdpa", "naive"))
    for r in timed:
        assert r["reps"] == 2
        for name in NUMERIC:
            assert isinstance(r[name], float) and r[name] > 0, (name, r)
        assert r["min_ms"] <= r["median_ms"]
    for mode in ("fwd", "fwd+bwd"):
        by = {r["provider"]: r for r in timed if r["mode"] == mode}
        assert by["sdpa"]["vs_sdpa"] == 1.0 and by["naive"]["vs_naive"] == 1.0
        ratio = by["sdpa"]["median_ms"] / by["tileattn"]["median_ms"]
        assert abs(by["tileattn"]["vs_sdpa"] - ratio) < 1e-9

    memory = [r for r in report["rows"] if r["section"] == "memory"]
    assert len(memory) == 1 and memory[0]["provider"] == "tileattn"
    # A fresh process really ran the call: its resident set grew.
    assert memory[0]["peak_mib"] is not None and memory[0]["peak_mib"] > 0
    assert memory[0]["median_ms"] is None  # memory-only row: nothing timed
    csv_memory = [r for r in rows if r["section"] == "memory"]
    assert float(csv_memory[0]["peak_mib"]) == memory[0]["peak_mib"]
