"""Bytes that move unchanged, copied by the kernel from file to file.

A copy from page cache to page cache (`kernel_copy`) is one copy where reading and writing is two,
and on a VM the copy out of this process's memory is the dear one. `FileRange` names such bytes;
`hashing.HashingFile.copy_ranges` appends them to a file.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .taps import OpenFile


class Fetcher(Protocol):
    """What fetches an open file's bytes before they are read: a file of object storage's mirror
    (`io.objects.remote.MirrorFile`), set on the `OpenFile` by the store that opened it."""

    streamed: bool
    """Its bytes arrive as the store streams them and are dropped once read: they are read into
    memory, never copied by the kernel (a copy read back to hash it would find them dropped)."""

    @property
    def shown(self) -> str:
        """The file as messages name it (the object it stands for)."""

    def before(self, offset: int, length: int) -> None:
        """Called before a read of `length` bytes at `offset`: they are fetched first."""

    def after(self, offset: int, length: int) -> None:
        """Called once such a read has copied its bytes out (a streamed file may drop them)."""

    def check_later(self, check: Callable[[int], None], ranges: list[tuple[int, int]]) -> None:
        """Run `check(descriptor)` once bytes `ranges` are there, before what read the file is
        committed (a streamed torch file's predicted layout: `formats.torch_zip`)."""


@dataclass(frozen=True)
class FileRange:
    """Bytes of an open source file that go into an output unchanged: `length` bytes at `offset` of
    `file` (`what` names the file in errors; the file's tap and watch come with it). Written by
    the kernel's copy (`HashingFile.copy_ranges`), not through this process's memory."""

    file: OpenFile
    offset: int
    length: int
    what: str

    @property
    def fd(self) -> int:
        """The file's descriptor (ValueError once its reader closed it)."""
        return self.file.fd


COPY_BLOCK = 1 << 20
"""Copied ranges (`HashingFile.copy_ranges`) move, and are read back for their digests, in blocks
of this size: a block read back right after the kernel wrote it is still in the CPU's cache."""

_NO_KERNEL_COPY = (
    errno.EXDEV,
    errno.EINVAL,
    errno.ENOSYS,
    errno.EOPNOTSUPP,
    errno.ENOTSUP,
    errno.EBADF,
    errno.ENOTSOCK,
)
"""What copy_file_range and sendfile fail with where they cannot copy between these two files
(ENOTSOCK: a sendfile that sends to sockets only, as on macOS)."""


def kernel_copy(src: int, offset: int, out: int, count: int, fetcher: Fetcher | None = None) -> int | None:
    """Copy up to `count` bytes at `offset` of descriptor `src` to descriptor `out` at its
    position, inside the kernel: copy_file_range (a server-side copy or a reflink where the file
    system offers one), else sendfile. The bytes copied (0: `src` ends at `offset`); None when
    neither call can copy between these files (the caller then reads and writes), as for a
    streamed file (`fetcher`: the source file's, see `Fetcher`)."""
    if fetcher is not None:  # an object store's bytes are fetched into their mirror file first
        if fetcher.streamed:
            return None
        fetcher.before(offset, count)
    copy_file_range = getattr(os, "copy_file_range", None)  # Linux only
    if copy_file_range is not None:
        try:
            return copy_file_range(src, out, count, offset)
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise
    try:
        return os.sendfile(out, src, offset, count)
    except OSError as e:
        if e.errno not in _NO_KERNEL_COPY:
            raise
    return None


class _CopyBuffer(threading.local):
    """This thread's buffer for reading copied blocks back (`HashingFile.copy_ranges`)."""

    def __init__(self) -> None:
        self.view = memoryview(bytearray(COPY_BLOCK))


_COPY_BUFFER = _CopyBuffer()
