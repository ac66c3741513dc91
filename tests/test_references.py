"""Every file or module of the repository that the package's sources, the docs and the hub name exists.

Before: the native kernels' ``common.h`` cited ``tileattn/scores.py`` (its hash lives in
``tileattn/core/score_math.py`` since the core moved), the Triton tile math cited
``modifiers._mix32`` and ``tileattn.core.modifiers.diagonal_offset``, the docs cited
``AttentionInputs`` and ``tests/test_npu_api.py``. Here a path such as ``tileattn/core/spec.py`` or
``tests/test_errors.py`` must be a file of the repository, and a dotted name ``tileattn.x.y`` must
be a module or an attribute of one.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = sorted(p for folder in ("tileattn", "docs", "hub") for p in (REPO / folder).rglob("*")
                 if p.suffix in (".py", ".md", ".c", ".h", ".sh")) + [REPO / "README.md"]
PATH = re.compile(r"(?<![\w/.-])((?:tileattn|tests|docs|hub|benchmarks|scripts)/[\w/.-]*\.(?:py|c|h|md|sh|json|csv))\b")
DOTTED = re.compile(r"(?<![\w/.])tileattn(?:\.[A-Za-z_]\w*)+(?![\w/])")  # not a folder (auditwheel's tileattn.libs/)


def _mentions(pattern):
    for path in SCANNED:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for match in pattern.finditer(line):
                yield f"{path.relative_to(REPO)}:{lineno}", match.group(0)


def _resolves(name: str) -> bool:
    """A module of the repository, or an attribute chain of the longest one. A module whose optional
    dependency is missing here (triton, transformers) exists, but its names cannot be read."""
    parts = name.split(".")
    end = next((end for end in range(len(parts), 0, -1)
                if REPO.joinpath(*parts[:end]).with_suffix(".py").is_file()
                or REPO.joinpath(*parts[:end], "__init__.py").is_file()), 0)
    if end == 0:
        return False
    try:
        obj = importlib.import_module(".".join(parts[:end]))
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "tileattn":
            return True
        raise
    for attr in parts[end:]:
        if dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}:
            return True  # a field (an instance attribute: one without a default is no class attribute)
        if not hasattr(obj, attr):
            return False
        obj = getattr(obj, attr)
    return True


def test_the_scan_reads_the_sources_and_the_docs():
    """The folders are where the scan looks (a move would otherwise leave it nothing to check)."""
    assert REPO / "tileattn" / "backends" / "native" / "csrc" / "common.h" in SCANNED
    assert REPO / "docs" / "dialects.md" in SCANNED
    assert sum(1 for _ in _mentions(PATH)) > 100 and sum(1 for _ in _mentions(DOTTED)) > 300


def test_every_named_file_exists():
    missing = [f"{where}: {ref}" for where, ref in _mentions(PATH) if not (REPO / ref).is_file()]
    assert not missing, "files named but not in the repository:\n" + "\n".join(missing)


def test_every_named_module_or_attribute_exists():
    # python -m tileattn (``__main__``) would run the command on import.
    names = {name for _, name in _mentions(DOTTED) if "__main__" not in name}
    missing = sorted(name for name in names if not _resolves(name))
    assert not missing, "tileattn names that do not resolve:\n" + "\n".join(missing)
