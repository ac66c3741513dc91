"""Helpers shared by the subcommands: argument parsing and checks, tables, CSV/JSON, plots.

Machine facts come from :mod:`tileattn.tools.measure`.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Iterable, List, Optional, Sequence


class CliError(Exception):
    """A bad argument or an impossible request: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------------------------
# Argument parsing.


#: Seeds are unsigned 64-bit integers (``torch.Generator.manual_seed``).
SEED_LIMIT = 2**64


def int_arg(minimum: int = 1, maximum: int = None):
    """An argparse ``type``: an int in ``minimum..maximum``, else a one-line error naming the range."""
    expected = f"an int >= {minimum}" if maximum is None else f"an int in {minimum}..{maximum}"

    def parse(text):
        try:
            value = int(str(text).strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}; expected {expected}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"got {text!r}; expected {expected}")
        return value

    return parse


#: ``--seed``: what ``torch.Generator.manual_seed`` accepts, without its overflow error.
seed_arg = int_arg(0, SEED_LIMIT - 1)


def positive_float_arg(text) -> float:
    """An argparse ``type``: a finite number > 0 (not inf, not nan)."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a finite number > 0") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"got {text!r}; expected a finite number > 0")
    return value


def parse_positive_ints(text: str, option: str, count: Optional[int] = None, what: str = "") -> List[int]:
    """'1,4,256,64' -> [1, 4, 256, 64]; every value a positive int (``count`` of them if given)."""
    parts = [p.strip() for p in str(text).split(",")]
    expected = what or (f"{count} comma-separated positive ints" if count else "comma-separated positive ints")
    if not parts or any(not re.fullmatch(r"\d+", p) for p in parts):
        raise CliError(f"argument {option}: got {text!r}; expected {expected}")
    values = [int(p) for p in parts]
    if any(v <= 0 for v in values) or (count is not None and len(values) != count):
        raise CliError(f"argument {option}: got {text!r}; expected {expected}")
    return values


def parse_shape(text: str, option: str = "--shape") -> tuple:
    """'B,H,S,D' -> (B, H, S, D)."""
    return tuple(parse_positive_ints(text, option, 4, "B,H,S,D: four positive ints, e.g. 1,4,256,64"))


def parse_dtype(name: str, option: str = "--dtype"):
    from ..bench import DTYPES

    key = str(name).lower()
    aliases = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float64": "fp64", "double": "fp64"}
    key = aliases.get(key, key)
    if key not in DTYPES:
        raise CliError(f"argument {option}: got {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[key]


def parse_names(text: str, option: str, known: Sequence[str]) -> List[str]:
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        bad = ", ".join(unknown) if unknown else repr(text)
        raise CliError(f"argument {option}: unknown {bad}; expected a comma-separated subset of {', '.join(known)}")
    return list(dict.fromkeys(names))


def add_measure_outputs(p: argparse.ArgumentParser, run, rows: str, saved: str, plotted: str) -> argparse.ArgumentParser:
    """The options a measuring command ends with (--csv with one row per ``rows``, --json with what
    it ``saved``, --plot of what it ``plotted``, --quiet), and ``run`` as its function."""
    p.add_argument("--csv", metavar="PATH", help=f"write one row per {rows}")
    p.add_argument("--json", metavar="PATH", help=f"write {saved}")
    p.add_argument("--plot", metavar="PATH.png", help=f"plot {plotted}")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def parse_device(name: Optional[str]) -> str:
    import torch

    if name is None or name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CliError(f"argument --device: got {name!r}; no CUDA device is visible here (use cpu)")
        return name
    raise CliError(f"argument --device: got {name!r}; expected auto, cpu or cuda")


def resolve_backend(name: str, option: str = "--backend"):
    """The registered backend called ``name``, or a CliError listing the registered ones."""
    from ...core.dispatch import get_backend, list_backends

    known = [b.name for b in list_backends()]
    if name not in known:
        raise CliError(f"argument {option}: got {name!r}; expected one of {', '.join(known)}")
    return get_backend(name)


# ---------------------------------------------------------------------------------------------
# Output.


def fmt_num(x, digits: int = 3) -> str:
    """Compact number: '12.3', '0.0456', '1.23e-05'; '-' for None."""
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    ax = abs(x)
    if ax != 0 and (ax < 1e-3 or ax >= 1e6):
        return f"{x:.{digits - 1}e}"
    if ax >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}" if abs(n) < 10**4 * size else f"{n / size:.2e} {unit}"
    return f"{int(n)} B"


def format_table(headers: Sequence[str], rows: Iterable[Sequence], right: Optional[Sequence[bool]] = None) -> str:
    """A plain-text table with a header rule; numeric-looking columns are right-aligned."""
    rows = [["" if c is None else str(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]
    if right is None:
        right = [i > 0 and all(re.match(r"^[-+]?[\d.]", r[i]) or r[i] in ("-", "") for r in rows) for i in range(len(headers))]

    def line(cells):
        return "  ".join(c.rjust(w) if rj else c.ljust(w) for c, w, rj in zip(cells, widths, right)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def write_csv(path: str, records: List[dict], fields: Sequence[str]) -> None:
    _ensure_parent(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        w.writeheader()
        for rec in records:
            w.writerow({k: ("" if rec.get(k) is None else rec.get(k)) for k in fields})


def write_json(path: str, obj) -> None:
    _ensure_parent(path)
    Path(path).write_text(json.dumps(obj, indent=1, default=str) + "\n")


def _ensure_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot create the folder of {path!r}: {exc}") from None


def check_writable(path: Optional[str], option: str, suffix: Optional[str] = None) -> None:
    """Fail before any measurement when an output path cannot work (its folder is made if missing)."""
    if path is None:
        return
    if suffix and not path.lower().endswith(suffix):
        raise CliError(f"argument {option}: got {path!r}; expected a file name ending in {suffix}")
    if os.path.isdir(path):
        raise CliError(f"argument {option}: got {path!r}, a folder; expected a file name")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise CliError(f"argument {option}: got {path!r}, a file this user cannot overwrite")
    check_writable_dir(os.path.dirname(os.path.abspath(path)), f"argument {option}", create=True)


def pyplot():
    """matplotlib.pyplot with a file-only backend, or a CliError if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError("--plot needs matplotlib (pip install 'tileattn[plot]')") from None
    return plt


# ---------------------------------------------------------------------------------------------
# Checks made before any measurement: the machine can hold the tensors, the outputs can be written.


def check_memory(need_bytes: int, device: str, what: str) -> None:
    """Refuse, before allocating, a request whose tensors cannot fit in the device's free memory."""
    from ..measure import available_memory

    have = available_memory(device)
    if have is not None and need_bytes > have:
        raise CliError(f"{what} would need about {fmt_bytes(need_bytes)} of memory; {device} has "
                       f"{fmt_bytes(have)} available: choose a smaller shape")


def tensor_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of a tensor of ``shape``, as a Python int: no overflow, however absurd the shape."""
    return math.prod(int(n) for n in shape) * itemsize


def check_writable_dir(path, what: str, create: bool = False) -> None:
    """Fail unless a file can be created in the folder ``path`` (made first when ``create``)."""
    path = os.fspath(path)
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise CliError(f"{what}: cannot create the folder {path!r} ({exc.strerror or exc})") from None
    if not os.path.isdir(path):
        why = "is not a folder" if os.path.exists(path) else "does not exist"
        raise CliError(f"{what}: {path!r} {why}; expected an existing, writable folder")
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".tileattn-write-check-"):
            pass
    except OSError as exc:
        raise CliError(f"{what}: cannot write in {path!r} ({exc.strerror or exc})") from None
