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


def test_isa_section_runs_every_variant_this_cpu_runs(tmp_path):
    """Each variant the CPU runs gets its rows; one it cannot run (AVX-512 on a Zen 3) is named with the
    reason, not a crash of the whole section."""
    from tileattn.backends.native import build
    from tileattn.programs import toolchain

    cc = tuple(build.find_compiler())
    runs = [isa for isa in build.ISAS if isinstance(toolchain.variant(cc, isa), tuple)]
    out = tmp_path / "native_isa"
    rows = bench_native.main(["--quick", "--reps", "1", "--only", "isa", "--out", str(out)])
    # per variant run: the forward grid's 2 quick shapes, two providers each
    assert runs and [r["isa"] for r in rows] == [isa for isa in runs for _ in range(4)]
    assert all(r["section"] == "isa" and r["pct_of_peak"] > 0 for r in rows)
    doc = json.loads(out.with_suffix(".json").read_text())
    variants, skipped = doc["info"]["isa_variants"], doc["info"]["isa_skipped"]
    assert sorted(variants) == sorted(runs) and all(variants[i]["isa"] == i for i in runs)
    assert sorted(skipped) == sorted(set(build.ISAS) - set(runs)) and all(skipped.values())
    assert all(variants[i]["fma_peak_1core"] > 0 for i in runs)
    assert sum(line.startswith("isa ") for line in doc["summary"]) == len(build.ISAS)
    assert all(f"isa {isa} skipped: " in "\n".join(doc["summary"]) for isa in skipped)
