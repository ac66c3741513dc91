"""The learning hub runs as tests: every tutorial and recipe, and the contest scorer.

Each tutorial and recipe is a script that checks its own claims and exits non-zero when one fails;
here they run as subprocesses with ``TILEATTN_SMALL=1``. To fit the CI budget on two cores, the
scripts (and the contest runs, which are subprocesses too) start together on a pool of two workers,
each with one thread, heaviest first; every test then waits for its own result.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tileattn import contest

REPO = Path(__file__).resolve().parents[1]
HUB = REPO / "hub"
TUTORIALS = sorted((HUB / "tutorials").glob("[0-9][0-9]_*.py"))
RECIPES = sorted((HUB / "recipes").glob("*.py"))
NEEDS_TRANSFORMERS = {"08_real_model.py", "llama.py", "sink_model.py", "train_llama_context_parallel.py"}
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
#: Seconds of CPU each script needs, roughly, on this machine: the pool starts the longest first.
HEAVY_FIRST = ("train_llama_context_parallel.py", "08_real_model.py", "06_tuning.py", "05_precision.py", "llama.py",
               "sink_model.py", "04_causal_and_masks.py", "01_attention_memory.py")
SCRIPT_TIMEOUT_S = 240

SUBMISSIONS = {
    "correct": (
        "import torch\n"
        "import torch.nn.functional as F\n\n"
        "def attention(q, k, v, causal=False):\n"
        "    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)\n"
        "    return out.to(q.dtype)\n"
    ),
    # Forgets the 1/sqrt(D) scale: runs fine, wrong numbers.
    "wrong": (
        "import torch\n\n"
        "def attention(q, k, v, causal=False):\n"
        "    s = q.float() @ k.float().transpose(-1, -2)\n"
        "    if causal:\n"
        "        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float('-inf'))\n"
        "    return (s.softmax(-1) @ v.float()).to(q.dtype)\n"
    ),
    "raising": "def attention(q, k, v, causal=False):\n    raise RuntimeError('kernel launch failed')\n",
    "crashing": "import os\n\ndef attention(q, k, v, causal=False):\n    os._exit(7)\n",
    "too_slow": "import time\n\ndef attention(q, k, v, causal=False):\n    time.sleep(600)\n",
    "no_function": "x = 1\n",
}
SLOW_LIMIT_S = 12


def _env():
    env = dict(os.environ, TILEATTN_SMALL="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TILEATTN_HUB_OUT=tempfile.mkdtemp(prefix="tileattn-hub-plots-"))
    env.pop("TRITON_INTERPRET", None)  # tutorial 07 sets it itself, before importing triton
    return env


def _run(cmd, cwd, timeout):
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout} s\n{exc.stdout or ''}{exc.stderr or ''}"
    return proc.returncode, proc.stdout + proc.stderr


def _score(path, name, board, limit):
    """What ``tileattn contest score --small --threads 1 --leaderboard board`` does, as (exit status,
    printed reason)."""
    outcome = contest.score_submission(path, time_limit_s=limit, small=True, threads=1)
    contest.record(outcome, name, path, board)
    return (0 if outcome.accepted else 1), f"{outcome.status}: {outcome.reason}"


def _selected_jobs(session) -> set:
    """Names of the scripts and contest runs the selected tests wait for (``-k`` runs fewer)."""
    needed = set()
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "path" in params and item.originalname.startswith(("test_tutorial_runs", "test_recipe_runs")):
            needed.add(params["path"].name)
        elif "name" in params and item.originalname.startswith("test_contest_"):
            needed.add(f"contest:{params['name']}")
    return needed


@pytest.fixture(scope="session")
def runs(request, tmp_path_factory):
    """Start the selected scripts and contest runs on two workers; name -> Future of (rc, output)."""
    jobs = {}
    for path in TUTORIALS + RECIPES:
        if path.name in NEEDS_TRANSFORMERS and not HAS_TRANSFORMERS:
            continue
        jobs[path.name] = (_run, [sys.executable, str(path)], str(path.parent), SCRIPT_TIMEOUT_S)
    root = tmp_path_factory.mktemp("contest")
    # The hub's baseline.py re-exports the packaged one: scoring it checks the hub still points there.
    submissions = {"baseline": REPO / "hub" / "contest" / "baseline.py",
                   "example": REPO / "hub" / "contest" / "examples" / "online_softmax.py"}
    for name, source in SUBMISSIONS.items():
        submissions[name] = root / f"{name}.py"
        submissions[name].write_text(source)
    for name, path in submissions.items():
        board = root / f"board_{name}"
        board.mkdir()
        limit = SLOW_LIMIT_S if name == "too_slow" else SCRIPT_TIMEOUT_S
        if name == "baseline":  # once through the `tileattn` command, end to end, into its working directory
            cmd = [sys.executable, "-m", "tileattn", "contest", "score", str(path), "--small", "--name", name,
                   "--time-limit", str(limit)]
            jobs[f"contest:{name}"] = (_run, cmd, str(board), SCRIPT_TIMEOUT_S + 30)
        else:  # the scorer in this process (its worker is still a subprocess): one interpreter start less
            jobs[f"contest:{name}"] = (_score, path, name, board, limit)
    needed = _selected_jobs(request.session)
    order = sorted((n for n in jobs if n in needed),
                   key=lambda n: HEAVY_FIRST.index(n) if n in HEAVY_FIRST else len(HEAVY_FIRST))
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(*jobs[name]) for name in order}
    yield {"futures": futures, "root": root}
    pool.shutdown(wait=True)


def _result(runs, name):
    rc, output = runs["futures"][name].result()
    return rc, output


def test_hub_has_every_tutorial_and_recipe():
    names = {p.name for p in TUTORIALS}
    assert [n[:2] for n in sorted(names)] == [f"{i:02d}" for i in range(1, 9)], sorted(names)
    assert {p.name for p in RECIPES} == {"run_flash_attention.py", "llama.py", "cross_attention.py",
                                         "migrate_torch_npu.py", "sink_model.py", "ascend_inference.py",
                                         "train_llama_context_parallel.py"}
    assert (HUB / "README.md").is_file() and (HUB / "contest" / "RULES.md").is_file()


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_tutorial_is_a_notebook_with_exercises(path):
    """jupytext percent format: code and markdown cells, prose first, exercises at the end."""
    text = path.read_text()
    assert text.count("# %% [markdown]") >= 3
    assert len(re.findall(r"^# %%$", text, flags=re.M)) >= 2
    assert text.split("\n# %%")[1].startswith(" [markdown]"), "a tutorial starts with prose"
    assert "## Exercises" in text.split("# %% [markdown]")[-1], "the last markdown cell holds the exercises"
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (path.parent / image).resolve().is_file(), f"{path.name} shows {image}, which is not committed"


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_tutorial_runs_and_its_checks_pass(runs, path):
    if path.name in NEEDS_TRANSFORMERS and not HAS_TRANSFORMERS:
        pytest.skip("transformers is not importable (pip install 'tileattn[transformers]')")
    rc, output = _result(runs, path.name)
    assert rc == 0, f"{path.name} failed (exit {rc}):\n{output[-4000:]}"
    assert output.count("[checked]") >= 3, f"{path.name} checked too few claims:\n{output[-2000:]}"


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_runs_and_passes(runs, path):
    if path.name in NEEDS_TRANSFORMERS and not HAS_TRANSFORMERS:
        pytest.skip("transformers is not importable (pip install 'tileattn[transformers]')")
    rc, output = _result(runs, path.name)
    assert rc == 0, f"{path.name} failed (exit {rc}):\n{output[-4000:]}"
    assert "passed" in output.splitlines()[-1], output[-2000:]


def _board(runs, name):
    rows = contest.read_rows(runs["root"] / f"board_{name}")
    assert len(rows) == 1, rows
    return rows[0], (runs["root"] / f"board_{name}" / "LEADERBOARD.md").read_text()


@pytest.mark.parametrize("name", ["baseline", "example", "correct"])
def test_contest_accepts_a_correct_submission(runs, name):
    rc, output = _result(runs, f"contest:{name}")
    assert rc == 0, output[-3000:]
    row, markdown = _board(runs, name)
    assert row["status"] == "accepted" and row["reason"] == ""
    assert float(row["score"]) > 0 and float(row["vs_tileattn"]) > 0
    assert int(row["shapes"]) == sum(s.timed for s in contest.SMALL_SHAPES)
    assert f"| 1 | {name} |" in markdown


@pytest.mark.parametrize("name, reason", [
    ("wrong", "wrong result: max error"),
    ("raising", "attention raised RuntimeError: kernel launch failed"),
    ("crashing", "crashed: worker exited with status 7"),
    ("too_slow", f"timed out: still running after the {SLOW_LIMIT_S} s limit"),
    ("no_function", "defines no callable attention"),
])
def test_contest_rejects_with_the_reason(runs, name, reason):
    rc, output = _result(runs, f"contest:{name}")
    assert rc == 1, output[-3000:]
    assert reason in output, output[-3000:]
    row, markdown = _board(runs, name)
    assert row["status"] == "rejected" and reason in row["reason"] and row["score"] == ""
    assert "## Rejected" in markdown and name in markdown.split("## Rejected")[1]


def test_leaderboard_ranks_accepted_entries_and_lists_rejected_ones(tmp_path):
    shape = lambda sub: [{"shape": "s", "submission": sub, "baseline": 1.0, "tileattn": 0.5}]  # noqa: E731
    contest.record(contest.Outcome("accepted", "", 1, shape(0.5)), "fast", "fast.py", tmp_path)
    contest.record(contest.Outcome("rejected", "wrong result | bad", 2, []), "broken", "broken.py", tmp_path)
    contest.record(contest.Outcome("accepted", "", 3, shape(0.25)), "faster", "faster.py", tmp_path)
    with (tmp_path / "leaderboard.csv").open() as f:
        assert [r["name"] for r in csv.DictReader(f)] == ["fast", "broken", "faster"]
    text = (tmp_path / "LEADERBOARD.md").read_text()
    ranked = text.split("## Rejected")[0]
    assert ranked.index("| 1 | faster | 4.000 | 2.000 |") < ranked.index("| 2 | fast | 2.000 | 1.000 |")
    assert "broken" not in ranked and "wrong result \\| bad" in text.split("## Rejected")[1]
    assert contest.Outcome("rejected", "x", 0, []).score is None


def test_contest_cli_bad_arguments_exit_2(tmp_path, capsys):
    from tileattn.cli import main

    assert main(["contest", "score", str(tmp_path / "missing.py"), "--leaderboard", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "argument 'SUBMISSION'" in err and "missing.py" in err and "expected a Python file" in err
    assert main(["contest", "score", str(REPO / "hub/contest/baseline.py"), "--time-limit", "0",
                 "--leaderboard", str(tmp_path)]) == 2
    assert "--time-limit" in capsys.readouterr().err
    assert not (tmp_path / "leaderboard.csv").exists()
