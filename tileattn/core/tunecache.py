"""The tune cache the engines read: tile configurations ``tileattn tune`` measured, per shape bucket.

This module is part of the core: the CPU engines (``default_config``, the native backend's call
arguments) and the Triton launcher (its forward configuration) call :func:`lookup` on every
attention call, so it imports nothing from the tooling (:mod:`tileattn.tools.tuning`,
:mod:`tileattn.tools.bench`, the CLI) and costs a dictionary look-up per call once the file has been read.

* **Where.** ``$TILEATTN_CACHE_DIR/tune_cache.json``; without that variable
  ``$XDG_CACHE_HOME/tileattn/`` or ``~/.cache/tileattn/``.
* **Key.** (device model and core count, backend, dtype, head dim, causal, sequence-length bucket =
  next power of two >= 64): tile sizes that suit one CPU or GPU and one problem size may not suit
  another.
* **Read once.** The file is parsed on the first look-up and again only when its mtime, size or
  inode change; those are checked (one ``stat``) at most every :data:`RECHECK_SECONDS`, so a
  decode-sized call does not pay a system call.
* **Never trusted blindly.** The file is written by a program but lives in the user's home, where
  anything can happen to it. Each entry is validated against the engine's rules (:data:`RULES`)
  before any engine sees it; a malformed entry (or file) is ignored, falling back to the engine's
  built-in heuristics, and reported by one :class:`TuneCacheWarning` per (file, key) naming both and
  what was wrong.
* **Written atomically.** :func:`store` writes a temporary file in the same folder and renames it
  over the cache (under an advisory lock where the OS has one), so a crash mid-write or two writers
  never leave a half-written file; it replaces a malformed entry or file, which is how
  ``tileattn tune`` repairs one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional

CACHE_FILE = "tune_cache.json"
#: Seconds between two checks of the file's stamp: another process's ``tileattn tune`` is seen
#: within this delay; this process's own :func:`store` is seen at once.
RECHECK_SECONDS = 1.0


class TuneCacheWarning(UserWarning):
    """A tune-cache file or entry was ignored: the message names the file, the key and the problem."""


# ---------------------------------------------------------------------------------------------
# Where the cache lives, and its keys.


def cache_dir() -> Path:
    root = os.environ.get("TILEATTN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tileattn"
    )
    return Path(root)


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


_PATH_MEMO = {"env": None, "path": None}


def _current_path() -> Path:
    """:func:`cache_path`, recomputed only when the environment variables it depends on change."""
    env = (os.environ.get("TILEATTN_CACHE_DIR"), os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))
    if env != _PATH_MEMO["env"]:
        _PATH_MEMO.update(env=env, path=cache_path())
    return _PATH_MEMO["path"]


def seqlen_bucket(n: int) -> int:
    """Next power of two >= n (at least 64): calls of similar length share a tuned config."""
    b = 64
    while b < n:
        b *= 2
    return b


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), which can be fewer than the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def _cpu_device_name() -> str:
    """Cached: every CPU attention call builds a key."""
    return f"cpu:{cpu_model()}:{usable_cores()} cores"


@functools.lru_cache(maxsize=16)
def _cuda_device_name(index: int) -> str:
    import torch

    return "cuda:" + torch.cuda.get_device_name(index)


def device_name(device) -> str:
    """'cpu:<model>:<n> cores' or 'cuda:<GPU name>': the device part of a cache key."""
    if device.type == "cuda":
        import torch

        return _cuda_device_name(torch.cuda.current_device() if device.index is None else device.index)
    return _cpu_device_name()


def cache_key(backend: str, inp) -> str:
    device = inp.device
    memo = None
    if device.type == "cpu":
        # A decode loop asks for the same key every step: the string is built once per call shape.
        memo = (backend, inp.dtype, inp.head_dim, bool(inp.causal), max(inp.seqlen_q, inp.seqlen_k))
        key = _KEYS.get(memo)
        if key is not None:
            return key
    key = "|".join(
        str(x)
        for x in (
            device_name(device), backend, str(inp.dtype).replace("torch.", ""), inp.head_dim,
            bool(inp.causal), seqlen_bucket(max(inp.seqlen_q, inp.seqlen_k)),
        )
    )
    if memo is not None:
        if len(_KEYS) >= 1024:
            _KEYS.clear()
        _KEYS[memo] = key
    return key


#: (backend, dtype, head dim, causal, longest length) -> the key of a CPU call (the CPU's name and
#: core count are fixed for the process).
_KEYS: Dict[tuple, str] = {}


# ---------------------------------------------------------------------------------------------
# What a valid entry is.


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int_at_most(limit: int) -> Callable[[object], Optional[str]]:
    def check(value):
        if not _is_int(value):
            return f"{value!r} is a {type(value).__name__}, not an int"
        if not 0 < value <= limit:
            return f"{value} is outside 1..{limit}"
        return None

    return check


def _power_of_two_between(low: int, high: int) -> Callable[[object], Optional[str]]:
    def check(value):
        if not _is_int(value):
            return f"{value!r} is a {type(value).__name__}, not an int"
        if not (low <= value <= high and value & (value - 1) == 0):
            return f"{value} is not a power of two in {low}..{high}"
        return None

    return check


def _multiple_between(step: int, low: int, high: int) -> Callable[[object], Optional[str]]:
    def check(value):
        if not _is_int(value):
            return f"{value!r} is a {type(value).__name__}, not an int"
        if not (low <= value <= high and value % step == 0):
            return f"{value} is not a multiple of {step} in {low}..{high}"
        return None

    return check


#: backend -> key -> (required, check(value) -> problem or None). The CPU engines size their
#: scratch buffers by the tile, not by the sequence, so a huge block would allocate gigabytes: 8x
#: the largest tile ``tileattn tune`` tries is the ceiling. The native kernels take any number of
#: query lanes (``block_m``), but their AMX backward pads a key tile to 32 keys, so ``block_n`` must
#: be a multiple of 32 (other values give wrong bf16 gradients or overrun its buffers). Triton needs
#: power-of-two blocks of at least 16 (``tl.dot``), power-of-two warps, and a few pipeline stages.
RULES: Dict[str, Dict[str, tuple]] = {
    "cpu": {
        "block_m": (True, _positive_int_at_most(4096)),
        "block_n": (True, _positive_int_at_most(8192)),
    },
    "native": {
        "block_m": (True, _positive_int_at_most(4096)),
        "block_n": (True, _multiple_between(32, 32, 8192)),
    },
    "triton": {
        "block_m": (True, _power_of_two_between(16, 256)),
        "block_n": (True, _power_of_two_between(16, 256)),
        "num_warps": (False, _power_of_two_between(1, 32)),
        "num_stages": (False, _positive_int_at_most(8)),
    },
}
#: Rules for an engine this module does not know (a third-party backend): every value a positive int.
_ANY_POSITIVE = _positive_int_at_most(1 << 20)


def problems(backend: str, entry) -> List[str]:
    """Why ``entry`` cannot be a configuration of ``backend`` (empty: it is a valid one)."""
    if not isinstance(entry, dict):
        return [f"the entry is a JSON {type(entry).__name__}, not an object of tile sizes"]
    rules = RULES.get(backend)
    if rules is None:
        return [f"{k}: {why}" for k, v in entry.items() for why in [_ANY_POSITIVE(v)] if why]
    found = []
    for name, (required, check) in rules.items():
        if name not in entry:
            if required:
                found.append(f"missing key {name!r}")
            continue
        why = check(entry[name])
        if why:
            found.append(f"{name}: {why}")
    unknown = sorted(set(entry) - set(rules))
    if unknown:
        found.append(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                     f"(expected {', '.join(rules)})")
    return found


# ---------------------------------------------------------------------------------------------
# Reading.

_WARNED = set()
_LOCK = threading.Lock()


def _warn_once(path: Path, key: Optional[str], message: str) -> None:
    if (str(path), key) in _WARNED:
        return
    _WARNED.add((str(path), key))
    warnings.warn(TuneCacheWarning(message), stacklevel=4)


def _stamp(path: Path):
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class _Snapshot:
    """One reading of the cache file: its raw entries and, per key already looked up, the verdict."""

    def __init__(self, path: Path, stamp, entries: dict):
        self.path, self.stamp, self.entries = path, stamp, entries
        self.checked_at = time.monotonic()
        self.valid: Dict[str, Optional[dict]] = {}

    def config(self, backend: str, key: str) -> Optional[dict]:
        if key not in self.valid:
            entry = self.entries.get(key)
            found = [] if entry is None else problems(backend, entry)
            if found:
                _warn_once(self.path, key, f"tileattn: ignoring the tune cache entry {key!r} in {self.path}: "
                           f"{'; '.join(found)}. The engine uses its built-in tile sizes; `tileattn tune` for "
                           "this shape replaces the entry.")
            self.valid[key] = None if (entry is None or found) else dict(entry)
        return self.valid[key]


def _parse(path: Path, text: str, warn: bool) -> dict:
    """The file's entries, or {} (with one warning per file when ``warn``) when it is not a JSON object."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        if warn:
            _warn_once(path, None, f"tileattn: ignoring the tune cache {path}: not valid JSON ({exc}). The engines "
                       "use their built-in tile sizes; `tileattn tune` rewrites the file.")
        return {}
    if not isinstance(data, dict):
        if warn:
            _warn_once(path, None, f"tileattn: ignoring the tune cache {path}: it holds a JSON {type(data).__name__}, "
                       "not an object mapping keys to tile sizes. `tileattn tune` rewrites the file.")
        return {}
    return data


def _read(path: Path, stamp) -> _Snapshot:
    if stamp is None:
        return _Snapshot(path, stamp, {})
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        _warn_once(path, None, f"tileattn: ignoring the tune cache {path}: cannot read it ({exc}).")
        return _Snapshot(path, stamp, {})
    return _Snapshot(path, stamp, _parse(path, text, warn=True))


_STATE = {"snapshot": None}


def _snapshot() -> _Snapshot:
    path = _current_path()
    snap = _STATE["snapshot"]
    now = time.monotonic()
    if snap is not None and snap.path == path and now - snap.checked_at < RECHECK_SECONDS:
        return snap
    stamp = _stamp(path)
    if snap is None or snap.path != path or snap.stamp != stamp:
        snap = _read(path, stamp)
        _STATE["snapshot"] = snap
    snap.checked_at = now
    return snap


#: backend name -> config that :func:`lookup` returns while :func:`overriding` is active.
_OVERRIDES: Dict[str, dict] = {}


def lookup(backend: str, inp) -> Optional[dict]:
    """The validated tuned configuration of ``backend`` for this call's bucket, or None."""
    override = _OVERRIDES.get(backend)
    if override is not None:
        return dict(override)
    with _LOCK:
        config = _snapshot().config(backend, cache_key(backend, inp))
    return None if config is None else dict(config)


@contextlib.contextmanager
def overriding(backend: str, config: dict):
    """Make :func:`lookup` answer ``config`` for ``backend`` (every shape) inside the block.

    ``tileattn tune`` runs each candidate through the public operator this way, so what it times is
    exactly what dispatch will run. The config must be valid for the engine (ValueError otherwise).
    """
    found = problems(backend, config)
    if found:
        raise ValueError(f"tileattn: argument 'config': got {config!r}; expected a valid {backend} "
                         f"configuration ({'; '.join(found)})")
    previous = _OVERRIDES.get(backend)
    _OVERRIDES[backend] = dict(config)
    try:
        yield
    finally:
        if previous is None:
            _OVERRIDES.pop(backend, None)
        else:
            _OVERRIDES[backend] = previous


# ---------------------------------------------------------------------------------------------
# Writing.


@contextlib.contextmanager
def _exclusive(path: Path):
    """An advisory lock on ``<cache>.lock`` around a read-modify-write (no-op where there is no fcntl)."""
    try:
        import fcntl
    except ImportError:  # Windows: the rename alone still keeps the file whole
        yield
        return
    with open(str(path) + ".lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=str(path.parent), prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.chmod(tmp, path.stat().st_mode & 0o777)
        except OSError:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def store(backend: str, inp, config: dict) -> Path:
    """Record ``config`` for this call's bucket (replacing whatever was there, malformed or not)."""
    found = problems(backend, config)
    if found:
        raise ValueError(f"tileattn: argument 'config': got {config!r}; expected a valid {backend} "
                         f"configuration ({'; '.join(found)})")
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = cache_key(backend, inp)
    with _LOCK, _exclusive(path):
        try:
            data = _parse(path, path.read_text(), warn=False)
        except (OSError, UnicodeDecodeError):
            data = {}
        data[key] = dict(config)
        _write_atomically(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        _STATE["snapshot"] = None
        _WARNED.discard((str(path), key))
    return path
