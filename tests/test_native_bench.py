"""benchmarks/bench_native.py --quick runs end to end and writes complete CSV and JSON results."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
nk = pytest.importorskip("tileattn.backends.native.kernels")
if not nk.available()[0]:
    pytest.skip(nk.available()[1], allow_module_level=True)

import bench_native  # noqa: E402


def test_quick_run_writes_every_row(tmp_path):
    out = tmp_path / "native_quick"
    rows = bench_native.main(["--quick", "--reps", "1", "--only", "grid,lowp,decode,cache,memory", "--out", str(out)])
    # grid: 2 causal x 2 modes; lowp: 2 dtypes x 2 modes; 2 decode; 1 cache; two providers each
    assert len(rows) == 2 * (4 + 4 + 2 + 1)
    assert all(r["median_ms"] > 0 and r["vs_sdpa"] > 0 for r in rows)
    with open(out.with_suffix(".csv")) as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and set(bench_native.FIELDS) == set(table[0])
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["info"]["isa"] == nk.build_info()["isa"] and "memory_extra_mib_h4" in doc["info"]
    assert any(line.startswith("grid fwd: geomean") for line in doc["summary"])


def test_isa_section_runs_every_variant(tmp_path):
    from tileattn.backends.native import build

    out = tmp_path / "native_isa"
    rows = bench_native.main(["--quick", "--reps", "1", "--only", "isa", "--out", str(out)])
    # per variant: the forward grid's 2 quick shapes, two providers each
    assert [r["isa"] for r in rows] == [isa for isa in build.ISAS for _ in range(4)]
    assert all(r["section"] == "isa" and r["pct_of_peak"] > 0 for r in rows)
    doc = json.loads(out.with_suffix(".json").read_text())
    variants = doc["info"]["isa_variants"]
    assert sorted(variants) == sorted(build.ISAS) and all(variants[i]["isa"] == i for i in build.ISAS)
    assert all(variants[i]["fma_peak_1core"] > 0 for i in build.ISAS)
    assert sum(line.startswith("isa ") for line in doc["summary"]) == len(build.ISAS)
