"""Positional reads through a source file's descriptor, and what may watch or serve them.

A descriptor a reader reads through may have a tap (the check on read hashes the bytes the
operation reads anyway, instead of reading them again), a source (the read-ahead's buffers serve
cold bytes read around the page cache) and a watch (its file is compared, once the operation's
copies are done, with its stat as opened). Each is kept per open descriptor and dropped as it
closes, so a reused descriptor number inherits none.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import cast

from ...errors import FormatError
from ..objects import remote
from .copy import _COPY_BUFFER, COPY_BLOCK, FileRange

ReadTap = Callable[[int, int, memoryview], None]
"""Called as tap(fd, offset, bytes) with every byte range a reader has just read (see
`DescriptorReader.tap`)."""

_TAPS: dict[int, ReadTap] = {}
"""Open descriptors whose reads are passed on: fd -> tap (an entry lives as long as its reader's
descriptor is open, so a reused descriptor number never inherits it)."""

ReadSource = Callable[[int, memoryview, int, str], bool]
"""Called as source(fd, view, offset, what) by `pread_exact` before it reads: True when it has
filled `view` with the bytes at `offset` of fd's file (from memory it holds, reading the rest
through fd), False when it holds none of them (see `DescriptorReader.read_from`)."""

_SOURCES: dict[int, ReadSource] = {}
"""Open descriptors whose reads may be served from memory: fd -> source (kept like `_TAPS`)."""

_WATCHED: set[int] = set()
"""Open descriptors of sources whose file is compared, once the operation's copies are done, with
what it was when opened (`DescriptorReader.watch`, `reader.SourceStamps`): the bytes of a kernel
copy may then be hashed from the worker's own read of them, a moment before the kernel copies
them (kept like `_TAPS`)."""


class DescriptorReader:
    """The open file descriptor a lazy reader reads positionally through (`_fd`, None once closed)."""

    path: Path
    _fd: int | None = None

    @property
    def _open_fd(self) -> int:
        """The file's descriptor; ValueError once the reader is closed."""
        if self._fd is None:
            raise ValueError(f"{self.path}: the reader is closed")
        return self._fd

    def tap(self, taps: Callable[[Path], ReadTap | None]) -> None:
        """Pass every byte range this reader reads from now on to `taps(path)` (when that is not
        None): the hash check on read hashes the bytes the operation reads anyway."""
        tap = taps(self.path)
        if tap is not None and self._fd is not None:
            _TAPS[self._fd] = tap

    def read_from(self, sources: Callable[[os.stat_result], ReadSource | None]) -> None:
        """Let `sources(stat of this reader's descriptor)` serve this reader's reads from now on
        (when that is not None): the read-ahead's buffers of a cold file. The source is chosen by
        the identity of the file this reader has open, so bytes read ahead from another file put
        at the same path since are never served as this one's."""
        if self._fd is not None:
            source = sources(os.fstat(self._fd))
            if source is not None:
                _SOURCES[self._fd] = source

    def watch(self) -> os.stat_result | None:
        """Mark this reader's file as compared with its stat as opened (returned) once the
        operation's copies are done (see `_WATCHED`); None once closed."""
        if self._fd is None:
            return None
        _WATCHED.add(self._fd)
        return os.fstat(self._fd)

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            _TAPS.pop(fd, None)
            _SOURCES.pop(fd, None)
            _WATCHED.discard(fd)
            os.close(fd)


def pread_exact(fd: int, view: memoryview, offset: int, what: str, tapped: bool = True) -> None:
    """Fill `view` with the bytes at `offset` (FormatError when the file is shorter: truncated),
    from the descriptor's source where it has them (see `read_from`), and pass them to its tap,
    if any. `tapped` False (bytes outside the operation's plan, read for the hash check): read
    from the file itself, tapped by nobody."""
    source = _SOURCES.get(fd) if tapped else None
    if source is None or not source(fd, view, offset, what):
        read_exact(fd, view, offset, what)
    if tapped and (tap := _TAPS.get(fd)) is not None:
        tap(fd, offset, view)


def read_exact(fd: int, view: memoryview, offset: int, what: str) -> None:
    """Fill `view` with the file's bytes at `offset` (FormatError when the file is shorter)."""
    done, nbytes = 0, len(view)
    if remote._MIRRORED:  # an object store's bytes are fetched into their mirror file first
        remote.before_read(fd, offset, nbytes)
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise FormatError(f"{what} is truncated: re-create it")
        done += got
    if remote._MIRRORED:  # a streamed mirror file drops what it holds once it is read
        remote.after_read(fd, offset, nbytes)


def _feed_taps(sources: Sequence[FileRange], every: Callable[[memoryview], None] | None = None) -> None:
    """Read the bytes of `sources` that their checks still want, a block at a time, and pass them
    to their taps; with `every`, read every byte and pass each block to it too."""
    view = _COPY_BUFFER.view
    for source in sources:
        tap = _TAPS.get(source.fd)
        if tap is None and every is None:
            continue
        wants = getattr(tap, "wants", None)
        for start in range(0, source.length, COPY_BLOCK):
            n = min(COPY_BLOCK, source.length - start)
            wanted = tap is not None and (wants is None or wants(source.offset + start, n))
            if not wanted and every is None:
                continue
            block = view[:n]
            read_exact(source.fd, block, source.offset + start, source.what)
            if every is not None:
                every(block)
            if wanted:
                cast(ReadTap, tap)(source.fd, source.offset + start, block)
