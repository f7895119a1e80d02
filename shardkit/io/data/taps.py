"""Positional reads through a source file's descriptor, and what may watch or serve them.

A reader reads a file through an `OpenFile`: its descriptor, and what its reads pass through. It
may have a fetcher (a file of object storage's mirror, whose bytes are fetched before they are
read: set by the store that opened it, `io.store.Store.open`), a tap (the check on read hashes the
bytes the operation reads anyway, instead of reading them again), a source (the read-ahead's
buffers serve cold bytes read around the page cache) and a watch (its file is compared, once the
operation's copies are done, with its stat as opened). They are state of that open file, set by
its store and reader (`DescriptorReader`) and dropped as it closes: a new open is a new
`OpenFile`, so a descriptor number the system reuses inherits none of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from ...errors import FormatError
from .copy import _COPY_BUFFER, COPY_BLOCK, Fetcher, FileRange

ReadTap = Callable[["OpenFile", int, memoryview], None]
"""Called as tap(file, offset, bytes) with every byte range a reader has just read from `file`
(see `DescriptorReader.tap`)."""

ReadSource = Callable[[int, memoryview, int, str], bool]
"""Called as source(fd, view, offset, what) by `pread_exact` before it reads: True when it has
filled `view` with the bytes at `offset` of fd's file (from memory it holds, reading the rest
through fd), False when it holds none of them (see `DescriptorReader.read_from`)."""


class OpenFile:
    """One open descriptor of a source file and what its reads pass through: `tap` (passed every
    byte range read), `source` (may serve reads from memory) and `watched` (the file is compared
    with its stat as opened once the operation's copies are done: the bytes of a kernel copy may
    then be hashed from the worker's own read of them, a moment before the kernel copies them).
    Its `fetcher` (None for a local file) fetches the bytes a read is about to read (see
    `Fetcher`). Owned by the reader that opened it, which closes it."""

    __slots__ = ("_fd", "fetcher", "tap", "source", "watched")

    def __init__(self, fd: int, fetcher: Fetcher | None = None) -> None:
        self._fd: int | None = fd
        self.fetcher = fetcher
        self.tap: ReadTap | None = None
        self.source: ReadSource | None = None
        self.watched = False

    @property
    def fd(self) -> int:
        """The descriptor; ValueError once closed (a range of a closed file never reads another
        file that was given its number since)."""
        if self._fd is None:
            raise ValueError("the source file is closed")
        return self._fd

    def close(self) -> None:
        """Close the descriptor and drop its tap, source and watch (idempotent)."""
        fd, self._fd = self._fd, None
        self.tap, self.source, self.watched = None, None, False
        if fd is not None:
            os.close(fd)


class DescriptorReader:
    """A lazy reader that reads positionally through the file it has open (`_file`, None once
    closed)."""

    path: Path
    _file: OpenFile | None = None

    @property
    def _open_file(self) -> OpenFile:
        """The open file; ValueError once the reader is closed."""
        if self._file is None:
            raise ValueError(f"{self.path}: the reader is closed")
        return self._file

    def tap(self, taps: Callable[[Path], ReadTap | None]) -> None:
        """Pass every byte range this reader reads from now on to `taps(path)` (when that is not
        None): the hash check on read hashes the bytes the operation reads anyway."""
        tap = taps(self.path)
        if tap is not None and self._file is not None:
            self._file.tap = tap

    def read_from(self, sources: Callable[[os.stat_result], ReadSource | None]) -> None:
        """Let `sources(stat of this reader's descriptor)` serve this reader's reads from now on
        (when that is not None): the read-ahead's buffers of a cold file. The source is chosen by
        the identity of the file this reader has open, so bytes read ahead from another file put
        at the same path since are never served as this one's."""
        if self._file is not None:
            source = sources(os.fstat(self._file.fd))
            if source is not None:
                self._file.source = source

    def watch(self) -> os.stat_result | None:
        """Mark this reader's file as compared with its stat as opened (returned) once the
        operation's copies are done (see `OpenFile.watched`); None once closed."""
        if self._file is None:
            return None
        self._file.watched = True
        return os.fstat(self._file.fd)

    def _close_fd(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()


def pread_exact(file: OpenFile, view: memoryview, offset: int, what: str) -> None:
    """Fill `view` with the bytes at `offset` of `file` (FormatError when the file is shorter:
    truncated), from its source where it has them (see `DescriptorReader.read_from`), and pass
    them to its tap, if any."""
    fd, source, tap = file.fd, file.source, file.tap
    if source is None or not source(fd, view, offset, what):
        read_exact(fd, view, offset, what, file.fetcher)
    if tap is not None:
        tap(file, offset, view)


def read_exact(fd: int, view: memoryview, offset: int, what: str, fetcher: Fetcher | None = None) -> None:
    """Fill `view` with the file's bytes at `offset` (FormatError when the file is shorter);
    `fetcher`: the file's, when it has one (see `OpenFile.fetcher`)."""
    done, nbytes = 0, len(view)
    if fetcher is not None:  # an object store's bytes are fetched into their mirror file first
        fetcher.before(offset, nbytes)
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise FormatError(f"{what} is truncated: re-create it")
        done += got
    if fetcher is not None:  # a streamed mirror file drops what it holds once it is read
        fetcher.after(offset, nbytes)


def _feed_taps(sources: Sequence[FileRange], every: Callable[[memoryview], None] | None = None) -> None:
    """Read the bytes of `sources` that their checks still want, a block at a time, and pass them
    to their taps; with `every`, read every byte and pass each block to it too."""
    view = _COPY_BUFFER.view
    for source in sources:
        tap = source.file.tap
        if tap is None and every is None:
            continue
        wants = getattr(tap, "wants", None)
        for start in range(0, source.length, COPY_BLOCK):
            n = min(COPY_BLOCK, source.length - start)
            wanted = tap is not None and (wants is None or wants(source.offset + start, n))
            if not wanted and every is None:
                continue
            block = view[:n]
            read_exact(source.fd, block, source.offset + start, source.what, source.file.fetcher)
            if every is not None:
                every(block)
            if tap is not None and wanted:
                tap(source.file, source.offset + start, block)
