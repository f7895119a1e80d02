"""Bytes that move unchanged, copied by the kernel from file to file.

A copy from page cache to page cache (`kernel_copy`) is one copy where reading and writing is two,
and on a VM the copy out of this process's memory is the dear one. `FileRange` names such bytes;
`hashing.HashingFile.copy_ranges` appends them to a file.
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..objects import remote

if TYPE_CHECKING:
    from .taps import OpenFile


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


def kernel_copy(src: int, offset: int, out: int, count: int) -> int | None:
    """Copy up to `count` bytes at `offset` of descriptor `src` to descriptor `out` at its
    position, inside the kernel: copy_file_range (a server-side copy or a reflink where the file
    system offers one), else sendfile. The bytes copied (0: `src` ends at `offset`); None when
    neither call can copy between these files (the caller then reads and writes)."""
    if remote._MIRRORED:  # an object store's bytes are fetched into their mirror file first
        if remote.streamed_fd(src):
            return None
        remote.before_read(src, offset, count)
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
