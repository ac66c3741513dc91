"""tileattn.tools.measure is the one place that times, computes statistics, reads peak memory and probes
the machine; the tooling files use it instead of their own copies.

Before, timing loops lived in six places (bench, tuning, contest, bench_cpu, gpu_check, the hub), with
two definitions of "spread" (range / median in bench, interquartile range / median in bench_cpu),
peak-memory readers in three and machine probes in four.
"""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest
import torch

from tileattn.tools import measure

REPO = Path(__file__).resolve().parents[1]
#: Files of the tooling layer: none may carry its own timing loop, statistics, memory reading or
#: machine probe. (tunecache.py, core, owns the CPU model and core count its cache key needs;
#: measure re-exports them.)
TOOLING_FILES = sorted(
    [REPO / "tileattn" / "tools" / name for name in ("bench.py", "tuning.py", "contest.py")]
    + list((REPO / "tileattn" / "tools" / "cli").glob("*.py"))
    + [REPO / "benchmarks" / "bench_cpu.py", REPO / "benchmarks" / "gpu_check.py", REPO / "hub" / "tutorials" / "_hub.py"]
)
MEASUREMENT_CODE = re.compile(r"perf_counter|VmHWM|VmRSS|clear_refs|malloc_trim|/proc/cpuinfo|sched_getaffinity|"
                              r"statistics\.|max_memory_allocated|torch\.cuda\.Event|/sys/devices/system/cpu")



def test_the_tooling_file_list_is_real():
    """Every listed file exists and the command's modules are among them (a moved folder would
    otherwise leave the checks below with nothing to read)."""
    assert all(p.is_file() for p in TOOLING_FILES)
    assert sum(p.parent.name == "cli" for p in TOOLING_FILES) >= 5

def _code_lines(path: Path):
    """(number, line without its comment) of every line outside docstrings."""
    text = path.read_text()
    prose = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            prose.update(range(body[0].lineno, body[0].end_lineno + 1))
    for number, line in enumerate(text.splitlines(), 1):
        if number not in prose:
            yield number, line.split("#", 1)[0]


def test_tooling_files_measure_only_through_measure_py():
    offenders = [f"{path.relative_to(REPO)}:{number}: {code.strip()}"
                 for path in TOOLING_FILES for number, code in _code_lines(path) if MEASUREMENT_CODE.search(code)]
    assert not offenders, "measurement code outside tileattn/tools/measure.py:\n" + "\n".join(offenders)


def test_median_and_spread_have_one_definition():
    assert measure.median([3.0, 1.0, 2.0]) == 2.0
    assert measure.median([]) is None
    assert measure.spread_pct([1.0, 2.0, 4.0]) == pytest.approx(150.0)  # (4 - 1) / 2
    assert measure.spread_pct([5.0]) is None

    class Run(measure.TimingStats):
        def __init__(self, times):
            self.times_ms = times

    run = Run([4.0, 1.0, 2.0])
    assert (run.median_ms, run.min_ms, run.max_ms, run.spread_pct) == (2.0, 1.0, 4.0, 150.0)


def test_time_interleaved_rotates_the_start_and_drops_a_failing_contender():
    order, prepared = [], []

    def make(name, fail_on=None):
        def run():
            order.append(name)
            if len([n for n in order if n == name]) == fail_on:
                raise RuntimeError(f"{name} broke")
        return run

    errors = {}
    steps = {"a": measure.Step(run=make("a"), prepare=lambda: prepared.append("a")), "b": make("b"),
             "c": make("c", fail_on=3)}
    samples = measure.time_interleaved(steps, reps=3, warmup=1, on_error=lambda n, e: errors.update({n: str(e)}))
    # Round 0 starts with a, round 1 with b, round 2 with c (which fails on its third call), round 3
    # (two survivors) with b.
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "b", "a"]
    assert errors == {"c": "c broke"} and samples["c"] == []
    assert len(samples["a"]) == len(samples["b"]) == 3 and prepared == ["a"] * 4
    assert all(t >= 0 for t in samples["a"] + samples["b"])
    with pytest.raises(RuntimeError, match="broke"):
        measure.time_interleaved({"x": make("x", fail_on=1)}, reps=1)


def test_time_call_measures_wall_time():
    assert 0.015 <= measure.time_call(lambda: time.sleep(0.02)) < 1.0
    assert measure.time_call(lambda: time.sleep(0.01), iters=3) == pytest.approx(0.01, abs=0.009)


@pytest.mark.skipif(measure.proc_status_bytes("VmHWM") is None, reason="needs Linux /proc/self/status")
def test_peak_memory_sees_a_temporary_allocation_the_call_freed():
    def touch():
        t = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, freed when the call returns
        return int(t[-1])

    result, peak = measure.peak_memory(touch)
    assert result == 1 and peak >= 60 << 20
    _, small = measure.peak_memory(lambda: None)
    assert small < 16 << 20


def test_machine_probes_describe_this_machine():
    assert measure.cpu_model() and measure.usable_cores() >= 1
    assert set(measure.cpu_flags()) <= set(measure.SIMD_FLAGS)
    l2, source = measure.l2_per_core()
    assert (l2 is None) == ("no cache information" in source)
    assert measure.available_memory("cpu") is None or measure.available_memory("cpu") > 1 << 20
    assert measure.gpus() == [] or all("name" in g for g in measure.gpus())


def test_memory_bandwidth_is_positive_finite_and_cached_per_process():
    import math

    small = measure.memory_bandwidth(threads=1, size_bytes=8 << 20, reps=2)
    assert math.isfinite(small) and small > 0
    first = measure.memory_bandwidth()
    assert math.isfinite(first) and first > 0
    assert measure.memory_bandwidth() == first  # measured once per process and thread count
    with pytest.raises(ValueError, match="threads"):
        measure.memory_bandwidth(threads=0)
