"""Where output goes: `--out` checked before a run, files written atomically.

A run that takes minutes must not fail at the end because `--out` names a file or a place
it cannot write, so `check_out_dir` is called before the work starts. Every output file is
written to a temporary file beside it and renamed over the old one (`os.replace`), so an
interrupted run leaves the old file or none, never half a file that reads as whole.
"""

from __future__ import annotations

import contextlib
import errno
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
def atomic_writer(path: Path | str, binary: bool = False, blocks: bool = False
                  ) -> Iterator[TextIO]:
    """A text (or, `binary`, bytes) file handle whose content replaces `path` only when
    the block completes; `blocks`: a `BlockWriter` (bytes, written around the page
    cache where it can: a big file)."""
    p = Path(path)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        if blocks:
            fh = BlockWriter(fd)
            try:
                yield fh
                fh.flush()
                os.fsync(fd)
            finally:
                fh.close()
        else:
            with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")) \
                    as fh:
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


_STAGE = 8 << 20  # bytes gathered before a write to the spill (a multiple of _BLOCK)
_BLOCK = 4096  # O_DIRECT's alignment: of the buffer's address, the file offset, the size


class BlockWriter:
    """A big file's writer (the records' spill and `requests.jsonl`): bytes gathered in a
    page-aligned buffer and written around the page cache (O_DIRECT) in whole blocks
    where the file system allows, the last partial block through the page cache at
    `flush`, after which the file is read and written as usual. A day's records are
    gigabytes: through the page cache each page would be allocated and copied into, and
    written out at the fsync anyway (docs/perf.md, sixteenth round). Where O_DIRECT is
    refused (tmpfs, a file system without it) the same bytes are written as usual.
    `fd`: the file, open for writing at offset 0; `close` closes it."""

    def __init__(self, fd: int) -> None:
        import mmap

        self.fd = fd
        self.direct = False
        self._flags = 0  # the file's status flags without O_DIRECT
        with contextlib.suppress(OSError, AttributeError, ImportError):
            import fcntl

            self._flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, self._flags | os.O_DIRECT)
            self.direct = True
        self.stage = mmap.mmap(-1, _STAGE)  # (anonymous: page-aligned)
        self.view = memoryview(self.stage)
        self.n = 0  # bytes staged
        self.pos = 0  # bytes in the file

    def tell(self) -> int:
        return self.pos + self.n

    def fileno(self) -> int:
        return self.fd

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            k = min(len(data), _STAGE - self.n)
            self.view[self.n:self.n + k] = data[:k]
            self.n += k
            data = data[k:]
            if self.n == _STAGE:
                self._drain()

    def _drain(self) -> None:
        """Write the staged whole blocks (all of it, without O_DIRECT)."""
        k = self.n - self.n % _BLOCK if self.direct else self.n
        done = 0
        while done < k:
            try:
                with self.view[done:k] as part:  # (released even when interrupted)
                    wrote = os.write(self.fd, part)
            except OSError as exc:
                if not self.direct or exc.errno != errno.EINVAL:
                    raise
                self._buffered()  # refused: the rest through the page cache
                k = self.n
                continue
            done += wrote
            if self.direct and wrote % _BLOCK:  # (a short write off the blocks)
                self._buffered()
                k = self.n
        tail = self.n - k
        if tail:  # (under a block, from at least a block on: no overlap)
            self.view[:tail] = self.view[k:self.n]
        self.pos += k
        self.n = tail

    def _buffered(self) -> None:
        import fcntl

        fcntl.fcntl(self.fd, fcntl.F_SETFL, self._flags)
        self.direct = False

    def flush(self) -> None:
        """Everything written into the file, and the file read and written as usual
        from here on (the merge reads it through the page cache)."""
        self._drain()
        if self.direct:
            self._buffered()
        self._drain()

    def close(self) -> None:
        self.view.release()
        self.stage.close()
        os.close(self.fd)
