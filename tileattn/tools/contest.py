"""``tileattn contest``: score an attention kernel against the baseline and tileattn, keep a leaderboard.

Two tracks, one set of rules (``hub/contest/RULES.md``): **prefill**, a file defining
``attention(q, k, v, causal=False)`` over (B, H, S, D) tensors, and **decode**, a file defining
``attention(q, k_cache, v_cache, cache_seqlens)``: one query token per sequence against a KV cache of
which sequence ``b`` uses the first ``cache_seqlens[b]`` positions. Scoring a submission:

1. A worker subprocess (``python -m tileattn.tools.contest _worker ...``) imports the submission, so a crash,
   a hang or a ``sys.exit`` in it cannot take the scorer down. The whole worker runs under a wall-clock
   limit; past it the worker's process group is killed and the submission is rejected.
2. Correctness: on inputs drawn from a fresh seed (recorded with the result, so a run can be replayed
   with ``--seed``), the output must have q's shape and dtype and leave the inputs unmodified (checked
   in the worker), and pass FlashAttention's rule (:mod:`tileattn.core.testing`): max error against the
   fp64 reference at most 2x the error of plain PyTorch math in the inputs' dtype, plus a small floor.
   The rule is applied in the scorer's own process to the outputs the worker saved, so code in the
   submission can never reach the reference or the judge.
3. Timing: for each timed shape, the submission, the track's baseline and tileattn run round-robin
   (so machine noise hits all three alike; :func:`tileattn.tools.measure.median_times`); the median of the
   repeats is kept, and the query tokens of a call over it give tokens/s.
4. Score: the geometric mean over the timed shapes of ``baseline time / submission time``, which is
   the submission's tokens/s over the baseline's.

Any failure in 1-2 rejects the submission with the reason and no score. Accepted or not, the result
is recorded in the track's ``leaderboard*.csv`` in the leaderboard folder (``--leaderboard DIR``, an
existing folder; by default :func:`default_leaderboard_dir`, the user's data folder, created when
missing: never the current directory unasked, never the installed package) and its Markdown table
is re-rendered from it. The baselines are :mod:`tileattn.tools.contest_baseline` and
:mod:`tileattn.tools.contest_baseline_decode`, inside the package, so the command works from an installed
wheel.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from .cli.common import CliError, SEED_LIMIT, check_writable_dir, int_arg, positive_float_arg, seed_arg

#: The baselines' files, next to this module in the installed package.
DEFAULT_BASELINE = Path(__file__).resolve().with_name("contest_baseline.py")
DECODE_BASELINE = Path(__file__).resolve().with_name("contest_baseline_decode.py")
DEFAULT_TIME_LIMIT_S = 600.0
#: names the default leaderboard folder (else $XDG_DATA_HOME/tileattn/contest or ~/.local/share/tileattn/contest)
LEADERBOARD_ENV = "TILEATTN_LEADERBOARD_DIR"
CSV_FIELDS = ["time_utc", "name", "submission", "status", "reason", "score", "vs_tileattn", "tokens_per_s", "seed",
              "threads", "shapes", "details"]


def _generator(seed: int):
    import torch

    return torch.Generator().manual_seed(seed % SEED_LIMIT)  # seeds derived as seed + i may pass 2**64


@dataclass(frozen=True)
class Shape:
    """A prefill shape: q, k and v all (B, H, S, D)."""

    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool
    dtype: str  # "fp32" or "fp16"
    timed: bool = True  # False: checked for correctness only

    def label(self) -> str:
        return (f"{self.batch}x{self.heads}x{self.seqlen}x{self.head_dim} {self.dtype}"
                + (" causal" if self.causal else ""))

    @property
    def tokens(self) -> int:
        """Query tokens one call processes."""
        return self.batch * self.seqlen

    def inputs(self, seed: int) -> dict:
        import torch

        dtype = {"fp32": torch.float32, "fp16": torch.float16}[self.dtype]
        gen = _generator(seed)
        dims = (self.batch, self.heads, self.seqlen, self.head_dim)
        return dict(zip("qkv", (torch.randn(dims, generator=gen).to(dtype) for _ in range(3))))

    def call(self, fn, x: dict):
        return fn(x["q"], x["k"], x["v"], causal=self.causal)

    def reference(self, x: dict, compute_dtype=None):
        from ..core.reference import reference

        return reference(x["q"], x["k"], x["v"], causal=self.causal, compute_dtype=compute_dtype)


#: What the cache holds past a sequence's length (a reused slot's stale keys and values): a kernel
#: that reads it gets scores and outputs thousands of times too large.
STALE = 1.0e4


@dataclass(frozen=True)
class DecodeShape:
    """A decode step in fp32: q (B, Hq, 1, D) against caches (B, Hkv, L, D), ``cache_seqlens`` (B,) int32.

    Sequence 0 fills the cache; the others use a length drawn from [L/2, L], the rest of their cache
    holding :data:`STALE` values.
    """

    batch: int
    heads_q: int
    heads_kv: int
    cache_len: int
    head_dim: int
    timed: bool = True

    def label(self) -> str:
        return f"{self.batch}x{self.heads_q}/{self.heads_kv}x{self.cache_len}x{self.head_dim} fp32"

    @property
    def tokens(self) -> int:
        return self.batch

    def inputs(self, seed: int) -> dict:
        import torch

        gen = _generator(seed)
        q = torch.randn((self.batch, self.heads_q, 1, self.head_dim), generator=gen)
        k, v = (torch.randn((self.batch, self.heads_kv, self.cache_len, self.head_dim), generator=gen) for _ in "kv")
        lengths = torch.randint(self.cache_len // 2, self.cache_len + 1, (self.batch,), generator=gen,
                                dtype=torch.int32)
        lengths[0] = self.cache_len
        for b, used in enumerate(lengths.tolist()):
            k[b, :, used:] = STALE
            v[b, :, used:] = STALE
        return {"q": q, "k_cache": k, "v_cache": v, "cache_seqlens": lengths}

    def call(self, fn, x: dict):
        return fn(x["q"], x["k_cache"], x["v_cache"], x["cache_seqlens"])

    def reference(self, x: dict, compute_dtype=None):
        from ..core.reference import reference

        return reference(x["q"], x["k_cache"], x["v_cache"], seqused_k=x["cache_seqlens"], compute_dtype=compute_dtype)


#: The prefill shapes (q, k and v are all (B, H, S, D), Sq == Sk). Untimed ones catch kernels that
#: assume S is a multiple of their tile size or that the head dim is 64.
SHAPES = (
    Shape(1, 8, 1024, 64, False, "fp32"),
    Shape(1, 8, 2048, 64, True, "fp32"),
    Shape(2, 4, 1024, 128, True, "fp16"),
    Shape(1, 2, 200, 64, True, "fp32", timed=False),
    Shape(2, 3, 77, 32, False, "fp32", timed=False),
    Shape(1, 2, 129, 80, True, "fp16", timed=False),
)
#: ``--small`` (or ``TILEATTN_SMALL=1``): the same kinds of shapes, seconds instead of minutes.
SMALL_SHAPES = (
    Shape(1, 2, 256, 32, False, "fp32"),
    Shape(1, 2, 256, 32, True, "fp32"),
    Shape(1, 2, 128, 64, True, "fp16"),
    Shape(1, 2, 77, 32, True, "fp32", timed=False),
)
#: The decode shapes: Llama-3-8B-like heads (32 over 8 kv heads) and a small model's (8 over 2).
#: Untimed ones catch kernels that assume a group of 4, a head dim of 128 or a full cache.
DECODE_SHAPES = (
    DecodeShape(1, 32, 8, 16384, 128),
    DecodeShape(4, 32, 8, 8192, 128),
    DecodeShape(8, 8, 2, 4096, 128),
    DecodeShape(3, 6, 2, 100, 64, timed=False),
    DecodeShape(2, 4, 1, 77, 80, timed=False),
)
DECODE_SMALL_SHAPES = (
    DecodeShape(2, 4, 2, 512, 64),
    DecodeShape(4, 8, 2, 256, 32),
    DecodeShape(3, 6, 2, 77, 64, timed=False),
)
REPEATS, SMALL_REPEATS = 5, 3


def _tileattn_prefill(q, k, v, causal=False):
    from ..core.api import flash_attention

    return flash_attention(q, k, v, causal=causal)


def _tileattn_decode(q, k_cache, v_cache, cache_seqlens):
    from ..core.api import flash_attention

    return flash_attention(q, k_cache, v_cache, seqused_k=cache_seqlens)


@dataclass(frozen=True)
class Track:
    """A contest track: what a submission defines, its shapes, baseline and leaderboard files."""

    name: str
    signature: str
    shapes: tuple
    small_shapes: tuple
    baseline: Path
    library: Callable  # tileattn, called with the submission's signature
    files: Tuple[str, str]  # (CSV, Markdown) in the leaderboard folder

    def contest_shapes(self, small: bool):
        return self.small_shapes if small else self.shapes


TRACKS = {
    "prefill": Track("prefill", "attention(q, k, v, causal=False)", SHAPES, SMALL_SHAPES, DEFAULT_BASELINE,
                     _tileattn_prefill, ("leaderboard.csv", "LEADERBOARD.md")),
    "decode": Track("decode", "attention(q, k_cache, v_cache, cache_seqlens)", DECODE_SHAPES, DECODE_SMALL_SHAPES,
                    DECODE_BASELINE, _tileattn_decode, ("leaderboard_decode.csv", "LEADERBOARD_decode.md")),
}


def _track(name: str) -> Track:
    if name not in TRACKS:
        raise ValueError(f"argument '--track': got {name!r}; expected one of {', '.join(map(repr, TRACKS))}")
    return TRACKS[name]


# ---------------------------------------------------------------------------------------------
# The worker: runs inside the subprocess, imports the submission, checks and times it.


def _load_module(path: Path, name: str, signature: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, str(path))
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, "attention", None)
    if not callable(fn):
        raise AttributeError(f"{path} defines no callable {signature}")
    return fn


def _run_shape(fn, shape, seed: int, out_path: Path) -> Optional[str]:
    """Worker side: call the submission on ``shape`` and save its output to ``out_path``.

    Returns None, or the reason the call itself is unacceptable. Judging the saved output happens in
    the scorer's process (:func:`_judge_shape`), where the submission's code never ran, so a
    submission cannot tamper with the reference or the rule.
    """
    import torch

    x = shape.inputs(seed)
    copies = {name: t.clone() for name, t in x.items()}
    out = shape.call(fn, x)
    q = x["q"]
    if not isinstance(out, torch.Tensor):
        return f"{shape.label()}: attention returned {type(out).__name__}; expected a torch.Tensor"
    if out.shape != q.shape or out.dtype != q.dtype:
        return (f"{shape.label()}: output shape {tuple(out.shape)} dtype {out.dtype}; "
                f"expected {tuple(q.shape)} {q.dtype}")
    if any(not torch.equal(x[name], copies[name]) for name in x):
        return f"{shape.label()}: the submission modified its inputs"
    torch.save(out.detach().to("cpu").contiguous().clone(), out_path)
    return None


def _judge_shape(shape, seed: int, out_path: Path) -> Optional[str]:
    """Scorer side: None when the saved output passes FlashAttention's rule, else the reason."""
    import torch

    from ..core.testing import judge

    x = shape.inputs(seed)
    q = x["q"]
    try:
        out = torch.load(out_path, weights_only=True)
    except Exception as exc:  # a file the worker did not write as a plain tensor
        return f"{shape.label()}: unreadable output ({type(exc).__name__}: {exc})"
    if not isinstance(out, torch.Tensor) or out.shape != q.shape or out.dtype != q.dtype:
        return f"{shape.label()}: the saved output is not a {tuple(q.shape)} {q.dtype} tensor"
    oracle = shape.reference(x, compute_dtype=torch.float64)
    plain = shape.reference(x)
    verdict = judge("out", out, oracle, plain, q.dtype)
    if verdict.ok:
        return None
    return (f"{shape.label()}: wrong result: max error {verdict.error:.3e} exceeds the tolerance "
            f"{verdict.tolerance:.3e} (2x plain-math error {verdict.baseline_error:.3e} + floor)")


def _time(contenders: dict, shape, seed: int, repeats: int) -> dict:
    from .measure import median_times

    x = shape.inputs(seed)
    calls = {name: (lambda fn=fn: shape.call(fn, x)) for name, fn in contenders.items()}
    return median_times(calls, repeats, warmup=1)


def _worker(args) -> int:
    result = {"status": "rejected", "reason": "", "shapes": []}
    out_path = Path(args.out)
    track = TRACKS[args.track]

    def finish(code):
        out_path.write_text(json.dumps(result))
        return code

    try:
        submission = _load_module(Path(args.submission), "contest_submission", track.signature)
    except BaseException as exc:  # a submission that fails to import is rejected, whatever it raised
        result["reason"] = f"import failed: {type(exc).__name__}: {exc}"
        return finish(0)
    small = args.small
    seed = int(args.seed)
    if args.threads:
        import torch

        torch.set_num_threads(int(args.threads))
    for i, shape in enumerate(track.contest_shapes(small)):
        try:
            reason = _run_shape(submission, shape, seed + i, out_path.parent / f"output_{i}.pt")
        except BaseException as exc:
            reason = f"{shape.label()}: attention raised {type(exc).__name__}: {exc}"
        if reason is not None:
            result["reason"] = reason
            return finish(0)
    baseline = _load_module(Path(args.baseline), "contest_baseline", track.signature)
    contenders = {"submission": submission, "baseline": baseline, "tileattn": track.library}
    for i, shape in enumerate(track.contest_shapes(small)):
        if shape.timed:
            times = _time(contenders, shape, seed + 1000 + i, SMALL_REPEATS if small else REPEATS)
            result["shapes"].append({"shape": shape.label(), "tokens": shape.tokens, **times})
    result["status"] = "completed"  # the scorer judges the saved outputs before accepting
    return finish(0)


# ---------------------------------------------------------------------------------------------
# The scorer: runs the worker under a time limit and records the outcome.


@dataclass
class Outcome:
    status: str  # "accepted" or "rejected"
    reason: str
    seed: int
    shapes: List[dict]
    threads: Optional[int] = None  # --threads, or None for torch's default

    @property
    def score(self) -> Optional[float]:
        return _geomean([s["baseline"] / s["submission"] for s in self.shapes]) if self.accepted else None

    @property
    def vs_tileattn(self) -> Optional[float]:
        return _geomean([s["tileattn"] / s["submission"] for s in self.shapes]) if self.accepted else None

    @property
    def tokens_per_s(self) -> Optional[float]:
        """Geometric mean over the timed shapes of the submission's query tokens per second (None when
        rejected, or for shapes recorded without their token count)."""
        if not self.accepted or not all("tokens" in s for s in self.shapes):
            return None
        return _geomean([s["tokens"] / s["submission"] for s in self.shapes])

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


def _geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def score_submission(submission, baseline=None, time_limit_s=DEFAULT_TIME_LIMIT_S, seed=None, small=False,
                     threads=None, track="prefill") -> Outcome:
    """Check and time ``submission`` in a subprocess; never raises for a bad submission.

    ``track``: "prefill" or "decode"; ``baseline`` defaults to the track's packaged baseline.
    """
    spec = _track(track)
    submission, baseline = Path(submission), Path(baseline or spec.baseline)
    for what, path in (("SUBMISSION", submission), ("--baseline", baseline)):
        if not path.is_file():
            raise ValueError(f"argument '{what}': got {str(path)!r}, which is not a file; "
                             f"expected a Python file defining {spec.signature}")
    if not (isinstance(time_limit_s, (int, float)) and math.isfinite(time_limit_s) and time_limit_s > 0):
        raise ValueError(f"argument '--time-limit': got {time_limit_s!r}; expected a finite number of seconds > 0")
    if threads is not None and not (isinstance(threads, int) and not isinstance(threads, bool) and threads > 0):
        raise ValueError(f"argument '--threads': got {threads!r}; expected a positive int")
    if seed is not None and not (isinstance(seed, int) and 0 <= seed < SEED_LIMIT):
        raise ValueError(f"argument '--seed': got {seed!r}; expected an int in 0..{SEED_LIMIT - 1}")
    seed = secrets.randbits(31) if seed is None else seed
    with tempfile.TemporaryDirectory(prefix="tileattn-contest-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "tileattn.tools.contest", "_worker", "--submission", str(submission.resolve()),
               "--baseline", str(baseline.resolve()), "--seed", str(seed), "--out", str(out), "--track", spec.name]
        if small:
            cmd.append("--small")
        if threads:
            cmd += ["--threads", str(threads)]
        # Its own session, so a timeout can kill the submission's children too; cwd is a scratch dir
        # so files the submission writes land there.
        proc = subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True, text=True)
        try:
            log, _ = proc.communicate(timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Outcome("rejected", f"timed out: still running after the {time_limit_s:g} s limit", seed, [])
        except BaseException:  # Ctrl-C: the worker, in its own session, did not get it; end it too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        if not out.exists():
            tail = " | ".join((log or "").strip().splitlines()[-3:])
            return Outcome("rejected", f"crashed: worker exited with status {proc.returncode} "
                           f"before reporting ({tail or 'no output'})", seed, [])
        try:
            data = json.loads(out.read_text())
            status, reason, shapes = data["status"], str(data["reason"]), list(data["shapes"])
        except (ValueError, KeyError, TypeError) as exc:  # the submission shares the worker's directory
            return Outcome("rejected", f"unreadable worker report ({type(exc).__name__})", seed, [])
        if status == "completed":
            for i, shape in enumerate(spec.contest_shapes(small)):
                reason = _judge_shape(shape, seed + i, Path(tmp) / f"output_{i}.pt")
                if reason is not None:
                    return Outcome("rejected", reason, seed, [], threads)
            return Outcome("accepted", "", seed, shapes, threads)
    return Outcome("rejected", reason or "the worker reported no result", seed, [])


# ---------------------------------------------------------------------------------------------
# The leaderboard.


def record(outcome: Outcome, name: str, submission, leaderboard_dir, track="prefill") -> Path:
    """Add ``outcome`` to the track's CSV in the (existing) folder and re-render its Markdown table.

    The CSV is rewritten whole (through a temporary file), with today's columns: a file written by an
    older tileattn gains the new columns, empty for its rows, instead of rows shifted under its header.
    """
    spec = _track(track)
    root = Path(leaderboard_dir)
    csv_path = root / spec.files[0]
    rows = read_rows(root, track) if csv_path.exists() else []
    tokens_per_s = outcome.tokens_per_s
    rows.append({
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "name": name, "submission": Path(submission).name, "status": outcome.status, "reason": outcome.reason,
        "score": "" if outcome.score is None else f"{outcome.score:.3f}",
        "vs_tileattn": "" if outcome.vs_tileattn is None else f"{outcome.vs_tileattn:.3f}",
        "tokens_per_s": "" if tokens_per_s is None else f"{tokens_per_s:.1f}",
        "seed": outcome.seed, "threads": outcome.threads or "default", "shapes": len(outcome.shapes),
        "details": "; ".join(f"{s['shape']}: {s['submission'] * 1e3:.2f} ms (baseline {s['baseline'] * 1e3:.2f}, "
                             f"tileattn {s['tileattn'] * 1e3:.2f})" for s in outcome.shapes),
    })
    partial = csv_path.with_name(csv_path.name + ".tmp")
    with partial.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(partial, csv_path)
    (root / spec.files[1]).write_text(render(rows, track))
    return root


def read_rows(leaderboard_dir, track="prefill") -> List[dict]:
    """The rows of the track's CSV in the folder; ValueError if it is missing or not a leaderboard."""
    name = _track(track).files[0]
    path = Path(leaderboard_dir) / name
    if not path.is_file():
        raise ValueError(f"argument '--leaderboard': got {str(leaderboard_dir)!r}, which holds no {name}; "
                         f"expected a folder where `tileattn contest score --track {track}` recorded results")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in ("name", "status", "score") if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path} is not a contest leaderboard: no {', '.join(missing)} column")
        return list(reader)


def render(rows: List[dict], track="prefill") -> str:
    """Markdown: accepted entries ranked by score (best first), then rejected ones with the reason."""
    accepted = sorted((r for r in rows if r["status"] == "accepted"), key=lambda r: -float(r["score"]))
    rejected = [r for r in rows if r["status"] != "accepted"]
    lines = [f"# Attention contest leaderboard: {track} track", "",
             "Score: geometric mean over the timed shapes of baseline time / submission time, that is of the "
             "submission's tokens/s over the baseline's (higher is better; see hub/contest/RULES.md). tokens/s: "
             "geometric mean over the timed shapes of the query tokens a call processes per second.", "",
             "| rank | name | score (x baseline) | x tileattn | tokens/s | submission | seed | threads | when (UTC) |",
             "|---:|---|---:|---:|---:|---|---:|---:|---|"]
    for rank, r in enumerate(accepted, 1):
        lines.append(f"| {rank} | {r['name']} | {r['score']} | {r['vs_tileattn']} | {r.get('tokens_per_s') or ''} | "
                     f"{r['submission']} | {r['seed']} | {r.get('threads') or 'default'} | {r['time_utc']} |")
    if rejected:
        lines += ["", "## Rejected", "", "| name | submission | reason | when (UTC) |", "|---|---|---|---|"]
        for r in rejected:
            reason = r["reason"].replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r['name']} | {r['submission']} | {reason} | {r['time_utc']} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line.


def default_leaderboard_dir() -> Path:
    """Where results go without ``--leaderboard``: ``$TILEATTN_LEADERBOARD_DIR``, else
    ``$XDG_DATA_HOME/tileattn/contest``, else ``~/.local/share/tileattn/contest``."""
    folder = os.environ.get(LEADERBOARD_ENV) or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "tileattn", "contest")
    return Path(folder)


def _check_leaderboard_writable(folder, track: str) -> None:
    """Before minutes of scoring: the folder exists (the default one is created), its two files can be
    (re)written and an existing CSV is a leaderboard."""
    if folder is None:
        folder = default_leaderboard_dir()
        check_writable_dir(folder, f"the default leaderboard folder (${LEADERBOARD_ENV}, or pass --leaderboard)",
                           create=True)
    else:
        check_writable_dir(folder, "argument --leaderboard")
    files = _track(track).files
    for name in files:
        path = Path(folder) / name
        if path.exists() and not os.access(path, os.W_OK):
            raise CliError(f"argument --leaderboard: cannot write {str(path)!r} (permission denied)")
    if (Path(folder) / files[0]).exists():
        try:
            read_rows(folder, track)
        except ValueError as exc:
            raise CliError(str(exc)) from None


def _cmd_score(args) -> int:
    small = args.small or os.environ.get("TILEATTN_SMALL") == "1"
    _check_leaderboard_writable(args.leaderboard, args.track)
    try:
        outcome = score_submission(args.submission, args.baseline, args.time_limit, args.seed, small, args.threads,
                                   args.track)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    name = args.name or Path(args.submission).stem
    print(f"{args.track} track: submission {args.submission} ({name}), seed {outcome.seed}: "
          f"{outcome.status.upper()}")
    if not outcome.accepted:
        print(f"  reason: {outcome.reason}")
    for s in outcome.shapes:
        print(f"  {s['shape']:<28} submission {s['submission'] * 1e3:9.2f} ms   baseline {s['baseline'] * 1e3:9.2f} ms"
              f"   tileattn {s['tileattn'] * 1e3:9.2f} ms")
    if outcome.accepted:
        tokens_per_s = outcome.tokens_per_s
        print(f"  score {outcome.score:.3f} (x baseline), {outcome.vs_tileattn:.3f} x tileattn"
              + ("" if tokens_per_s is None else f", {tokens_per_s:.1f} tokens/s"))
    root = record(outcome, name, args.submission, args.leaderboard or default_leaderboard_dir(), args.track).resolve()
    files = " and ".join(str(root / f) for f in TRACKS[args.track].files)
    print(f"  recorded in {files}")
    return 0 if outcome.accepted else 1


def _cmd_leaderboard(args) -> int:
    try:
        rows = read_rows(args.leaderboard or default_leaderboard_dir(), args.track)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    print(render(rows, args.track), end="")
    return 0


def add_subparser(subparsers) -> argparse.ArgumentParser:
    """Register ``tileattn contest`` (``score`` and ``leaderboard``) on the CLI's subparsers."""
    help_text = "score an attention kernel against the baseline and tileattn; show the leaderboard"
    p = subparsers.add_parser("contest", help=help_text, description=help_text)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(sys.stderr), 2)[1])

    s = actions.add_parser("score", help="check, time and record a submission (exit 0 accepted, 1 rejected)")
    s.add_argument("submission", help="Python file defining the track's attention function (hub/contest/RULES.md)")
    s.add_argument("--track", choices=list(TRACKS), default="prefill",
                   help="prefill: attention(q, k, v, causal=False); decode: attention(q, k_cache, v_cache, "
                   "cache_seqlens) (default: prefill)")
    s.add_argument("--name", default=None, help="name on the leaderboard (default: the file's stem)")
    s.add_argument("--leaderboard", default=None, help="existing folder for the track's leaderboard files: "
                   "leaderboard.csv and LEADERBOARD.md (prefill), leaderboard_decode.csv and LEADERBOARD_decode.md "
                   f"(decode) (default: ${LEADERBOARD_ENV}, else $XDG_DATA_HOME/tileattn/contest, else "
                   "~/.local/share/tileattn/contest, created when missing)")
    s.add_argument("--time-limit", type=positive_float_arg, default=DEFAULT_TIME_LIMIT_S,
                   help=f"seconds for the whole check and timing run (default {DEFAULT_TIME_LIMIT_S:g})")
    s.add_argument("--seed", type=seed_arg, default=None, help="replay a run's inputs (default: a fresh seed)")
    s.add_argument("--baseline", default=None, help="the baseline kernel file (default: the track's, "
                   "tileattn's contest_baseline.py or contest_baseline_decode.py)")
    s.add_argument("--small", action="store_true", help="small shapes (also TILEATTN_SMALL=1): a quick trial")
    s.add_argument("--threads", type=int_arg(1), default=None,
                   help="torch threads for every contender (default: torch's default, one per core)")
    s.set_defaults(func=_cmd_score)

    b = actions.add_parser("leaderboard", help="print the leaderboard as Markdown")
    b.add_argument("--track", choices=list(TRACKS), default="prefill", help="whose table (default: prefill)")
    b.add_argument("--leaderboard", default=None, help="folder holding the track's leaderboard CSV "
                   "(default: the one score writes to without --leaderboard)")
    b.set_defaults(func=_cmd_leaderboard)
    return p


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tileattn.tools.contest")
    sub = parser.add_subparsers(dest="command")
    add_subparser(sub)
    w = sub.add_parser("_worker", help=argparse.SUPPRESS)
    for flag in ("--submission", "--baseline", "--seed", "--out", "--track"):
        w.add_argument(flag, required=True)
    w.add_argument("--small", action="store_true")
    w.add_argument("--threads", default=None)
    w.set_defaults(func=_worker)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
