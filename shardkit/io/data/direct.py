"""Writes around the page cache (O_DIRECT) and the reservation of a new file's disk blocks.

Both pay on a VM, where fresh page-cache memory is costly: `DirectFile` copies into one aligned
buffer instead (`direct_io_pays` says when), and `preallocate` lets ext4 skip delayed allocation's
per-page bookkeeping and refuses a full disk before anything is written.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import sys
from pathlib import Path
from typing import Any

WRITE_BLOCK = 256 << 10
"""Large blocks are written in pieces of at most this size: on a VM, writes of 1 MiB or more cost
several times the CPU in the kernel's copy into the page cache. The likely cause: the page cache
sizes its folios by the write, and large folios come from the high-order free blocks that a VM's
balloon driver hands back to the host (free page reporting) or that need compaction, so their
first touch costs a host fault or a compaction. Below 256 KiB the cost per call shows instead.
The measurements: docs/history/THROUGHPUT.md, "Writes of 256 KiB"."""


DIRECT_BLOCK = 4096
"""O_DIRECT writes start at, and last, a multiple of this (the largest logical block size in use)."""

DIRECT_CHUNK = 8 << 20
"""A file written around the page cache is gathered in an aligned buffer of this size, written whole."""


class DirectFile:
    """A new file written around the page cache (O_DIRECT): bytes are gathered in one page-aligned
    buffer and written DIRECT_CHUNK at a time straight from it to the device; the tail (less than
    DIRECT_BLOCK) goes through the page cache at `flush`/`close`, and so does everything after a
    `flush` that left the file unaligned. Where the file system refuses O_DIRECT (tmpfs, some FUSE),
    at open or at the first write, every write goes through the page cache instead.

    Why: copying into fresh page-cache memory is costly on a VM, and past the kernel's dirty limit
    the writer waits for the disk anyway; from an aligned buffer the cost is one copy into it and
    the device's time. The same interface as the buffered file HashingFile otherwise writes through: write,
    flush, fileno, close; one thread writes at a time."""

    def __init__(self, path: Path):
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        self.direct = False
        self._buffer: mmap.mmap | None = None
        self._fill = 0
        self._offset = 0  # where the buffer's first byte goes
        try:
            set_direct(self._fd, True)
            self.direct = True
            self._buffer = mmap.mmap(-1, DIRECT_CHUNK)  # page-aligned, as O_DIRECT needs
        except OSError:  # no O_DIRECT on this file system: through the page cache
            pass

    def fileno(self) -> int:
        return self._fd

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n, pos = len(view), 0
        buffer = self._buffer
        while pos < n:
            if buffer is None:  # through the page cache
                written = os.pwrite(self._fd, view[pos:], self._offset)
                if written <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                pos += written
                self._offset += written
                continue
            k = min(n - pos, DIRECT_CHUNK - self._fill)
            buffer[self._fill : self._fill + k] = view[pos : pos + k]
            self._fill += k
            pos += k
            if self._fill == DIRECT_CHUNK:
                self._write_out(DIRECT_CHUNK)
        return n

    def _write_out(self, nbytes: int) -> None:
        """Write the buffer's first `nbytes` at the offset (whole blocks while direct); keep the
        rest at the buffer's start."""
        buffer = self._buffer
        assert buffer is not None
        with memoryview(buffer) as view:
            done = 0
            while done < nbytes:
                try:
                    written = os.pwrite(self._fd, view[done:nbytes], self._offset + done)
                except OSError as e:
                    if e.errno != errno.EINVAL or not self.direct:
                        raise
                    self._through_cache()  # accepted at open, refused at write: through the page cache
                    continue
                if written <= 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                done += written
                if self.direct and written % DIRECT_BLOCK:
                    self._through_cache()  # a short write left the offset unaligned
            rest = self._fill - nbytes
            if rest:
                view[:rest] = view[nbytes : self._fill]
        self._fill = rest
        self._offset += nbytes

    def _through_cache(self) -> None:
        set_direct(self._fd, False)
        self.direct = False

    def flush(self) -> None:
        """Write everything gathered (a tail shorter than a block through the page cache, after
        which the file is written through the page cache)."""
        if self._buffer is None:
            return
        if self.direct and self._fill >= DIRECT_BLOCK:
            self._write_out(self._fill - self._fill % DIRECT_BLOCK)
        if self._fill:
            if self.direct:
                self._through_cache()
            self._write_out(self._fill)
        if not self.direct:  # from now on straight through the page cache
            self._buffer.close()
            self._buffer = None

    def close(self) -> None:
        """Write what is gathered and close."""
        if self._fd < 0:
            return
        try:
            self.flush()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Close without writing what is gathered (the file is being deleted)."""
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            unmap(buffer)
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def unmap(buffer: mmap.mmap) -> None:
    """Close an anonymous mapping; where a view of it still lives (in a traceback), it is unmapped
    when that goes."""
    try:
        buffer.close()
    except BufferError:
        pass


def direct_io_pays(nbytes: int) -> bool:
    """Whether writing `nbytes` around the page cache is the better choice ("auto"): when they are
    more than the kernel lets wait in the page cache before it makes writers wait for the disk
    (vm.dirty_bytes, else vm.dirty_ratio percent of the available memory). Below that, buffered
    writes return as soon as the bytes are copied and the disk catches up later."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        limit = int(Path("/proc/sys/vm/dirty_bytes").read_text())
        if not limit:
            ratio = int(Path("/proc/sys/vm/dirty_ratio").read_text())
            available = meminfo("MemAvailable")
            if available is None:
                return False
            limit = available * ratio // 100
    except (OSError, ValueError):
        return False
    return nbytes > limit


_FALLOCATE: Any = None
FALLOC_FL_KEEP_SIZE = 1
_NOT_RESERVED = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL, errno.EBADF, errno.ENODEV)
"""What fallocate fails with where a file system or descriptor offers no reservation (never ENOSPC)."""


def preallocate(fd: int, nbytes: int) -> bool:
    """Reserve `nbytes` of disk blocks for the new file open on `fd` before it is written, keeping its
    size (Linux fallocate with FALLOC_FL_KEEP_SIZE); the bytes written later then fill blocks that
    exist, and a full disk is refused before anything is written (OSError ENOSPC/EDQUOT). False
    where the platform or the file system offers no reservation (nothing is written then: glibc's
    posix_fallocate would fall back to writing zeros). Why: on ext4, writes into reserved blocks
    skip the delayed allocation's per-page bookkeeping, a quarter to a third of the kernel's CPU for
    writes and copies alike. Blocks reserved past what is written are freed by truncating the file to
    its size (`HashingFile.close`)."""
    global _FALLOCATE
    if not sys.platform.startswith("linux") or nbytes <= 0:
        return False
    if _FALLOCATE is None:
        import ctypes

        function: Any = False
        try:
            function = ctypes.CDLL(None, use_errno=True).fallocate
            function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            function.restype = ctypes.c_int
        except (OSError, AttributeError):
            function = False
        _FALLOCATE = function
    if _FALLOCATE is False:
        return False
    import ctypes

    if _FALLOCATE(fd, FALLOC_FL_KEEP_SIZE, 0, nbytes) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NOT_RESERVED:
        return False
    raise OSError(code, os.strerror(code))


def meminfo(field: str) -> int | None:
    """A /proc/meminfo field in bytes (MemAvailable, MemFree), None where there is none."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def set_direct(fd: int, on: bool) -> None:
    """Set or clear O_DIRECT on an open descriptor (OSError where the file system refuses it)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)


def is_direct(fd: int) -> bool:
    """Whether O_DIRECT is set on fd."""
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
