"""A disk cache for step-time tables that are slow to build (the opdb backend's grids).

An entry is one numpy `.npz` file (no pickle: it is read with `allow_pickle=False`) named
by a hash of its key, a JSON-able mapping of everything the tables depend on; the key is
stored inside the file too and compared on load, so a stale, foreign or corrupt file is
rebuilt, never trusted and never a crash. Writers write a temporary file in the same
directory and `os.replace` it into place, so concurrent runs may build the same entry:
the last one wins and readers see a whole file or none.

Where: `$SERVETWIN_CACHE_DIR/<kind>` when set (`off` or empty: no disk cache), else
`$XDG_CACHE_HOME/servetwin/<kind>`, else `~/.cache/servetwin/<kind>`. Deleting the
directory is always safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

log = logging.getLogger("twin.perf.cache")

ENV = "SERVETWIN_CACHE_DIR"
_KEY = "__key__"


def cache_dir(kind: str) -> Path | None:
    """The directory for `kind` entries, or None when the disk cache is off."""
    root = os.environ.get(ENV)
    if root is not None:
        return None if root.strip() in ("", "off") else Path(root) / kind
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "servetwin" / kind


def key_text(key: Mapping) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"), default=str)


def entry_path(kind: str, key: Mapping) -> Path | None:
    d = cache_dir(kind)
    if d is None:
        return None
    digest = hashlib.sha256(key_text(key).encode()).hexdigest()[:32]
    return d / f"{digest}.npz"


def load(kind: str, key: Mapping) -> dict[str, np.ndarray] | None:
    """The arrays stored under `key`, or None (absent, unreadable or another key's)."""
    path = entry_path(kind, key)
    if path is None or not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z[_KEY]) != key_text(key):
                return None
            return {name: z[name] for name in z.files if name != _KEY}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        log.info("table cache: %s unreadable (%s); rebuilding", path, exc)
        return None


def store(kind: str, key: Mapping, arrays: Mapping[str, np.ndarray]) -> Path | None:
    """Write the entry atomically; a cache that cannot be written is only logged."""
    path = entry_path(kind, key)
    if path is None:
        return None
    import tempfile  # only when writing (start-up time)

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **{_KEY: np.array(key_text(key))}, **arrays)
        os.replace(tmp, path)
        return path
    except OSError as exc:
        log.info("table cache: cannot write %s (%s)", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return None
