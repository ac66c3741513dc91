"""Tile-configuration cache: winners of ``tileattn tune``, looked up by dispatch.

Key: (device, backend, dtype, head dim, causal, sequence-length bucket). The cache is a JSON file in
the user's cache directory (``$TILEATTN_CACHE_DIR`` or ``~/.cache/tileattn``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

_MEMO = {}


def cache_path() -> Path:
    root = os.environ.get("TILEATTN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tileattn"
    )
    return Path(root) / "tune_cache.json"


def seqlen_bucket(n: int) -> int:
    """Next power of two >= n (at least 64): calls of similar length share a tuned config."""
    b = 64
    while b < n:
        b *= 2
    return b


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return "cuda:" + torch.cuda.get_device_name(device)
    import platform

    return "cpu:" + (platform.processor() or platform.machine())


def cache_key(backend: str, inp) -> str:
    return "|".join(
        str(x)
        for x in (
            device_name(inp.device), backend, str(inp.dtype).replace("torch.", ""), inp.head_dim,
            bool(inp.causal), seqlen_bucket(max(inp.seqlen_q, inp.seqlen_k)),
        )
    )


def load() -> dict:
    path = cache_path()
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return {}
    if _MEMO.get("path") != path or _MEMO.get("stamp") != stamp:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        _MEMO.update(path=path, stamp=stamp, data=data if isinstance(data, dict) else {})
    return _MEMO["data"]


def lookup(backend: str, inp) -> Optional[dict]:
    return load().get(cache_key(backend, inp))


def store(backend: str, inp, config: dict) -> Path:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(load())
    data[cache_key(backend, inp)] = config
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
    return path
