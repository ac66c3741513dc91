"""The ``tileattn`` command: ``env``, ``verify``, ``bench``, ``memory``, ``tune`` (and ``contest``
when :mod:`tileattn.contest` is installed).

Every subcommand registers itself with ``set_defaults(func=handler)``; :func:`main` parses the
arguments and calls ``args.func(args)``. Bad arguments end with one line on stderr and exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from .common import CliError

SUBCOMMANDS = ("env", "verify", "bench", "memory", "tune")


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
        contest = importlib.import_module("tileattn.contest")
    except ModuleNotFoundError as exc:
        if exc.name != "tileattn.contest":
            contest_error = exc
    except Exception as exc:  # another helper's module failing to import must not break the CLI
        contest_error = exc
    else:
        contest.add_subparser(sub)
    return parser, contest_error


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, contest_error = build_parser()
    if argv[:1] == ["contest"] and contest_error is not None:
        print(f"tileattn contest: error: tileattn.contest failed to import: {contest_error}", file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or an argparse error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except CliError as exc:
        print(f"tileattn {args.command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tileattn {args.command}: interrupted", file=sys.stderr)
        return 130
