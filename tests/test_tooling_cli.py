"""Every ``tileattn`` subcommand turns a bad value into one line on stderr and exit status 2 before any
work, Ctrl-C into one line and exit status 130, and never shows a traceback.

Before: ``--seed`` past 2**64 and ``--budget-kib inf`` ended in tracebacks, a huge ``--shape`` in a
storage-size overflow (or an attempt to allocate it), an unwritable tune cache only failed after the
whole search, and Ctrl-C during the CPU engine's backward pass aborted the process ("terminate called
without an active exception").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tileattn.tools import contest, tuning
from tileattn.tools.cli import main

from conftest import sigint_as_usual


def _one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


BAD_VALUES = [
    (["verify", "--seed", "-1"], ["argument --seed: got '-1'", "0..18446744073709551615"]),
    (["verify", "--seed", str(2**64)], ["argument --seed", str(2**64)]),
    (["tune", "--shape", "1,2,64,16", "--seed", str(2**70)], ["argument --seed"]),
    (["verify", "--seed", "seven"], ["argument --seed: got 'seven'"]),
    (["tune", "--shape", "1,2,64,16", "--budget-kib", "inf"], ["argument --budget-kib: got 'inf'", "finite"]),
    (["tune", "--shape", "1,2,64,16", "--budget-kib", "nan"], ["argument --budget-kib: got 'nan'"]),
    (["tune", "--shape", "1,2,64,16", "--budget-kib", "-4"], ["argument --budget-kib: got '-4'"]),
    (["tune", "--shape", "1,2,64,16", "--budget-kib", "lots"], ["argument --budget-kib: got 'lots'"]),
    (["tune", "--shape", "1,2,64,16", "--reps", "0"], ["argument --reps: got '0'", "an int >= 1"]),
    (["tune", "--shape", "1,2,64,16", "--warmup", "x"], ["argument --warmup: got 'x'"]),
    (["verify", "--shape", "100000,100000,100000,128"], ["--shape 100000,100000,100000,128 would need about 2.86e+06 "
                                                         "PiB of memory", "available: choose a smaller shape"]),
    (["tune", "--shape", "1,8,131072,64"], ["--shape 1,8,131072,64 would need about 4.0 TiB of memory"]),
    (["bench", "--seqlens", "4000000", "--heads", "64"], ["S=4000000", "with tileattn, cpu, sdpa, naive would need about"]),
    (["memory", "--seqlens", "1024," + "9" * 30], ["would need about", "of memory"]),
    (["bench", "--batch", "many"], ["argument --batch: got 'many'"]),
    (["bench", "--reps", "-2"], ["argument --reps: got '-2'"]),
    (["memory", "--heads", "0"], ["argument --heads: got '0'"]),
    (["memory", "--cap-gib", "inf"], ["argument --cap-gib: got 'inf'"]),
    (["bench", "--providers", "cpu,warp-drive"], ["argument --providers: unknown warp-drive"]),
    (["verify", "--backend", "abacus"], ["argument --backend: got 'abacus'"]),
    (["tune", "--shape", "1,2,64,16", "--backend", "reference"], ["tuning exists for native, cpu, triton"]),
    (["contest", "score", "x.py", "--seed", "-3"], ["argument --seed: got '-3'"]),
    (["contest", "score", "x.py", "--time-limit", "inf"], ["argument --time-limit: got 'inf'"]),
    (["contest", "score", "x.py", "--threads", "two"], ["argument --threads: got 'two'"]),
]


@pytest.mark.parametrize("argv, needles", BAD_VALUES, ids=[" ".join(a)[:60] for a, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_and_exit_2(argv, needles, capsys):
    started = time.monotonic()
    assert main(argv) == 2
    line = _one_line_error(capsys, *needles)
    assert line.startswith(f"tileattn {argv[0]}: error: ") or line.startswith("tileattn contest score: error: ")
    assert time.monotonic() - started < 30, "refused only after doing work"


def test_an_unwritable_tune_cache_is_refused_before_the_search(tmp_path, monkeypatch, capsys):
    def search(*args, **kwargs):
        raise AssertionError("the search ran although its result could not be stored")

    monkeypatch.setattr(tuning, "tune", search)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TILEATTN_CACHE_DIR", str(blocker / "cache"))
    assert main(["tune", "--shape", "1,2,64,16", "--quiet"]) == 2
    _one_line_error(capsys, "tune cache folder", str(blocker / "cache"), "--no-store")
    (tmp_path / "cache" / "tune_cache.json").mkdir(parents=True)
    monkeypatch.setenv("TILEATTN_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["tune", "--shape", "1,2,64,16", "--quiet"]) == 2
    _one_line_error(capsys, "tune_cache.json is a folder")


def test_an_unexpected_error_is_one_line_and_exit_1(monkeypatch, capsys):
    from tileattn.tools.cli import env

    def broken(args):
        raise RuntimeError("the probe exploded\nwith a second line")

    monkeypatch.setattr(env, "run", broken)
    assert main(["env"]) == 1
    _one_line_error(capsys, "tileattn env: internal error: RuntimeError: the probe exploded with a second line",
                    "TILEATTN_DEBUG=1")


# ------------------------------------------------------------------------------------ contest


def test_contest_leaderboard_on_a_missing_file_is_an_error(tmp_path, capsys):
    assert main(["contest", "leaderboard", "--leaderboard", str(tmp_path)]) == 2
    _one_line_error(capsys, "argument '--leaderboard'", "holds no leaderboard.csv")
    (tmp_path / "leaderboard.csv").write_text("a,b\n1,2\n")
    assert main(["contest", "leaderboard", "--leaderboard", str(tmp_path)]) == 2
    _one_line_error(capsys, "is not a contest leaderboard")


def test_contest_score_refuses_a_missing_or_unwritable_leaderboard_before_scoring(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(contest, "score_submission", lambda *a, **k: pytest.fail("scored before checking"))
    assert main(["contest", "score", str(contest.DEFAULT_BASELINE), "--leaderboard", str(tmp_path / "nope")]) == 2
    _one_line_error(capsys, "argument --leaderboard", "does not exist")
    (tmp_path / "file").write_text("")
    assert main(["contest", "score", str(contest.DEFAULT_BASELINE), "--leaderboard", str(tmp_path / "file")]) == 2
    _one_line_error(capsys, "is not a folder")


def test_contest_score_records_in_the_leaderboard_folder_not_the_package_nor_the_working_folder(
        tmp_path, monkeypatch, capsys):
    package = Path(contest.__file__).resolve().parent
    before = sorted(p.name for p in package.iterdir())
    shapes = [{"shape": "s", "submission": 0.5, "baseline": 1.0, "tileattn": 0.25}]
    monkeypatch.setattr(contest, "score_submission", lambda *a, **k: contest.Outcome("accepted", "", 7, shapes))
    board, work = tmp_path / "board", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("TILEATTN_LEADERBOARD_DIR", str(board))
    monkeypatch.chdir(work)
    assert main(["contest", "score", str(contest.DEFAULT_BASELINE), "--name", "me"]) == 0
    assert "score 2.000" in capsys.readouterr().out
    assert [r["name"] for r in contest.read_rows(board)] == ["me"]
    assert (board / "LEADERBOARD.md").read_text().count("| 1 | me | 2.000 |") == 1
    assert main(["contest", "leaderboard"]) == 0
    assert "| 1 | me |" in capsys.readouterr().out
    assert sorted(p.name for p in package.iterdir()) == before and list(work.iterdir()) == []


def test_the_contest_baseline_ships_inside_the_package():
    """A wheel holds the package only: the command must not reach into a repository checkout."""
    package = Path(contest.__file__).resolve().parent
    assert contest.DEFAULT_BASELINE.parent == package and contest.DEFAULT_BASELINE.is_file()
    import torch

    from tileattn.tools.contest_baseline import attention

    q = torch.randn(1, 2, 16, 8)
    assert torch.allclose(attention(q, q, q, causal=True), torch.nn.functional.scaled_dot_product_attention(
        q, q, q, is_causal=True), atol=1e-6)
    assert "hub" not in Path(contest.__file__).read_text().split('"""', 2)[2].split("def ")[0]


# ------------------------------------------------------------------------------------ Ctrl-C


INTERRUPTED = [
    # The CPU engine's backward pass, where an interrupt used to abort the process at exit.
    (["bench", "--seqlens", "2048", "--providers", "cpu", "--mode", "fwd+bwd", "--reps", "1000", "--no-memory"],
     "stderr"),
    (["tune", "--shape", "1,8,2048,64", "--reps", "100"], "stderr"),
    (["verify", "--shape", "1,8,2048,64"], "stdout"),
]


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT")
@pytest.mark.parametrize("argv, stream", INTERRUPTED, ids=[a[0] for a, _ in INTERRUPTED])
def test_ctrl_c_is_one_line_and_exit_130(argv, stream):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TILEATTN_BACKEND", None)
    proc = subprocess.Popen([sys.executable, "-m", "tileattn", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=sigint_as_usual)
    try:
        first = getattr(proc, stream).readline()  # the command has started measuring
        assert first, "the command ended before it could be interrupted"
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if stream == "stderr":
        err = first + err
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert err.strip().splitlines()[-1] == f"tileattn {argv[0]}: interrupted", err[-2000:]
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
