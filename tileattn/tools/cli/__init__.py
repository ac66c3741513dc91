"""The ``tileattn`` command: ``env``, ``verify``, ``bench``, ``memory``, ``tune`` (and ``contest``
when :mod:`tileattn.tools.contest` is installed).

Every subcommand registers itself with ``set_defaults(func=handler)``; :func:`main` parses the
arguments and calls ``args.func(args)``. Whatever goes wrong ends in one line on stderr, never a
traceback: a bad argument exits with status 2, Ctrl-C with 130, an unexpected error with 1
(``TILEATTN_DEBUG=1`` shows its traceback).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import threading
import time
from typing import List, Optional

from .common import CliError

SUBCOMMANDS = ("env", "verify", "bench", "memory", "tune")
#: Seconds Ctrl-C waits for the CPU engine's worker threads to finish the call they are in, so the
#: process does not end under them (they finish it: the engine has no cancellation).
WORKER_GRACE_S = 30.0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser():
    parser = _Parser(prog="tileattn", description="tileattn: exact FlashAttention everywhere PyTorch runs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    contest_error = None
    try:
        contest = importlib.import_module("tileattn.tools.contest")
    except ModuleNotFoundError as exc:
        if exc.name != "tileattn.tools.contest":
            contest_error = exc
    except Exception as exc:  # another helper's module failing to import must not break the CLI
        contest_error = exc
    else:
        contest.add_subparser(sub)
    return parser, contest_error


def _wait_for_workers(timeout: float) -> None:
    """Join the other threads still running (an interrupted call's workers), for at most ``timeout``."""
    deadline = time.monotonic() + timeout
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))


def _interrupted(command: str, as_program: bool) -> int:
    """One line, exit status 130.

    When Ctrl-C lands inside the CPU engine's backward pass, the interpreter's normal shutdown
    aborts ("terminate called without an active exception", SIGABRT) even after its worker threads
    have been joined: native state left by the interrupted call is torn down under them. As the
    program (not as a function in someone else's process) the command therefore ends with
    ``os._exit`` once its output is flushed, which also ends the workers at once; an interrupted run
    has nothing left to save.
    """
    print(f"tileattn {command}: interrupted", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if as_program:
        os._exit(130)
    _wait_for_workers(WORKER_GRACE_S)  # returning into a caller's process: leave no thread writing
    return 130


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command; ``argv`` None means this process is the ``tileattn`` program itself."""
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else ""
    try:
        parser, contest_error = build_parser()
        if command == "contest" and contest_error is not None:
            print(f"tileattn contest: error: tileattn.tools.contest failed to import: {contest_error}", file=sys.stderr)
            return 2
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help (0) or an argparse error (2), already printed
            return exc.code if isinstance(exc.code, int) else 2
        if getattr(args, "func", None) is None:
            parser.print_help(sys.stderr)
            return 2
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"tileattn {command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(command, as_program)
    except Exception as exc:
        if os.environ.get("TILEATTN_DEBUG") == "1":
            raise
        text = " ".join(str(exc).split())
        print(f"tileattn {command}: internal error: {type(exc).__name__}: {text[:300]} "
              "(TILEATTN_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1
