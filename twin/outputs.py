"""Where output goes: `--out` checked before a run, files written atomically.

A run that takes minutes must not fail at the end because `--out` names a file or a place
it cannot write, so `check_out_dir` is called before the work starts. Every output file is
written to a temporary file beside it and renamed over the old one (`os.replace`), so an
interrupted run leaves the old file or none, never half a file that reads as whole.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from twin.errors import ConfigError


def check_out_dir(path: Path | str, flag: str = "--out") -> Path:
    """`path` as a directory the run can write to (created here); `ConfigError` naming
    `flag` when it is an existing file or a place that cannot be written."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path}: exists and is not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot write there: {exc.strerror or exc}") from None
    return p


def check_out_file(path: Path | str, flag: str = "--out") -> Path:
    """`path` as a file the run can (re)write: its directory exists or can be made and
    is writable, and it is not a directory itself."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; a file name expected")
    check_out_dir(p.parent if str(p.parent) else Path("."), flag)
    return p


@contextlib.contextmanager
def atomic_writer(path: Path | str, binary: bool = False) -> Iterator[TextIO]:
    """A text (or, `binary`, bytes) file handle whose content replaces `path` only when
    the block completes."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path | str, text: str) -> None:
    with atomic_writer(path) as fh:
        fh.write(text)
