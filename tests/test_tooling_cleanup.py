"""The tooling files carry no dead code, and three-state results are enums, not bare strings.

Before: ``bench.PROVIDER_HELP`` and ``bench.cpu_memory_method`` were defined and never used anywhere
(package, tests, hub, benchmarks); a benchmark result's status and a tuning candidate's verdict were
strings compared by spelling ("ok", "unsupported", "error"; "pending", "rejected", ...).
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

import torch

from tileattn.tools import bench, tuning

REPO = Path(__file__).resolve().parents[1]
TOOLING_FILES = sorted(
    [REPO / "tileattn" / "tools" / name for name in ("bench.py", "tuning.py", "contest.py", "measure.py",
                                                      "contest_baseline.py", "contest_baseline_decode.py")]
    + [REPO / "tileattn" / "core" / "tunecache.py"]
    + list((REPO / "tileattn" / "tools" / "cli").glob("*.py"))
    + [REPO / "benchmarks" / "bench_cpu.py", REPO / "benchmarks" / "gpu_check.py", REPO / "hub" / "tutorials" / "_hub.py"]
)



def test_the_tooling_file_list_is_real():
    """Every listed file exists and the command's modules are among them (a moved folder would
    otherwise leave the checks below with nothing to read)."""
    assert all(p.is_file() for p in TOOLING_FILES)
    assert sum(p.parent.name == "cli" for p in TOOLING_FILES) >= 5

def _defined_names(path: Path):
    """Top-level functions, classes and assignments, and the methods of top-level classes."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            yield node.name
            if isinstance(node, ast.ClassDef):
                yield from (n.name for n in node.body if isinstance(n, ast.FunctionDef))
        elif isinstance(node, ast.Assign):
            yield from (t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id


def test_every_name_the_tooling_defines_is_used_somewhere():
    """A name whose only occurrence in all the Python of the repository is its definition is dead."""
    words = Counter()
    for folder in ("tileattn", "tests", "hub", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            words.update(re.findall(r"\w+", path.read_text()))
    dead = [f"{path.relative_to(REPO)}: {name}" for path in TOOLING_FILES for name in _defined_names(path)
            if not (name.startswith("__") and name.endswith("__")) and words[name] <= 1]
    assert not dead, "defined but never used:\n" + "\n".join(dead)


def test_a_benchmark_status_is_an_enum_member():
    case = bench.Case(1, 1, 32, 32, 16, torch.float32, False, "bwd", "cpu")
    ok, unsupported = bench.run_case(case, ["sdpa", "flex"], reps=1, warmup=0, memory=False)
    assert ok.status is bench.Status.OK and unsupported.status is bench.Status.UNSUPPORTED
    assert "no backward" in unsupported.note and unsupported.as_record()["status"] == "unsupported"
    assert {s.value for s in bench.Status} == {"ok", "unsupported", "error"}


def test_a_tuning_verdict_is_an_enum_member():
    case = bench.Case(1, 1, 64, 64, 16, torch.float32, False, "fwd", "cpu")
    candidates, winner, path = tuning.tune("cpu", case, budget=40 * 1024, reps=1, warmup=0, store_winner=False)
    assert path is None and winner is not None and winner.status is tuning.Verdict.TIMED
    assert {c.status for c in candidates} == {tuning.Verdict.REJECTED, tuning.Verdict.TIMED}
    assert {c.as_record()["status"] for c in candidates} == {"rejected", "timed"}
