"""Sequential read-ahead of the source bytes an operation will read, in the order it reads them.

On a cold page cache a worker otherwise pays every read's disk time itself, in tensor order and
in small pieces (a slice of a column-split tensor faults in its pages one by one), and the disk
idles while the worker copies and writes: cold time is then about warm time plus the whole disk
time. A `Prefetcher` thread instead streams the tensors' bytes into the page cache in large
sequential reads, in the order of their first use, a bounded window ahead of the workers; before
a worker reads a piece it waits until the read-ahead has passed the piece's tensors, so that the
worker only ever copies cached bytes and the disk never waits for the CPU.

The bytes go from the file to /dev/null with `sendfile` (the kernel fills the page cache and
copies nothing to user memory, so neither memory nor CPU is spent on them); where that is not
possible they are read into one reused buffer. The read-ahead holds no memory of the process:
the page cache it fills is reclaimable, and the window bounds how far it runs ahead of the
workers, so a model larger than memory is not read past what the workers will reach soon.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from ..paths import open_regular

logger = logging.getLogger(__name__)


READ_CHUNK = 8 << 20
"""Bytes read ahead per system call (progress is reported per chunk)."""

WINDOW = 1 << 30
"""At most this many bytes are read ahead of the furthest point a worker has asked for (less when
the machine has little available memory: see `window_bytes`)."""


EXTENT = 16 << 20
"""Spans that continue each other in one file are read together, up to this many bytes: a merge
needs a small piece of each of tp files per tensor (1 MiB at tp 32 on 7B), and reading them one
by one makes a disk seek between every MiB (measured 2-3x slower than cp, cold)."""

BRIDGE = 64 << 10
"""A span that starts at most this many bytes after the previous span of its file ends (the zip
headers between a torch file's records) still continues it; the bytes between are read too."""


def window_bytes() -> int:
    """WINDOW, or a quarter of the memory the kernel reports available when that is smaller (the
    read-ahead must not evict what the workers are about to read), at least 4 chunks."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    return max(4 * READ_CHUNK, min(WINDOW, available // 4))
    except (OSError, ValueError, IndexError):
        pass
    return WINDOW


class Prefetcher:
    """Reads `spans` ((path, offset, length), in the order the workers first need them) into the
    page cache in a background thread. Workers call `wait(n)` before reading bytes of the first
    n spans; the thread stays at most `window` bytes ahead of the largest n asked for so far.

    A failure of the read-ahead itself (a file that cannot be opened or read) only ends it: the
    workers then read as without it and meet the error themselves."""

    def __init__(self, spans: Sequence[tuple[Path, int, int]], window: int | None = None):
        self.window = window_bytes() if window is None else window
        self.extents, self._covered = coalesce(spans)
        self._ends: list[int] = []  # bytes read ahead once extent i is done (cumulative)
        total = 0
        for _, _, length in self.extents:
            total += length
            self._ends.append(total)
        self._done = 0  # extents fully read ahead
        self._needed = 0  # the most extents a worker has asked for
        self._finished = False  # the thread stopped (all read, stopped, or failed)
        self._stop = False
        self.position = 0  # bytes read ahead so far
        self.paused = False  # the thread waits for the workers (the window is full)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def start(self) -> Prefetcher:
        if self.extents and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardkit-read-ahead", daemon=True)
            self._thread.start()
        else:
            self._finished = True
        return self

    def wait(self, count: int) -> None:
        """Return once the first `count` spans are in the page cache (or the read-ahead ended)."""
        if count <= 0:
            return
        count = self._covered[min(count, len(self._covered)) - 1]  # in extents
        with self._cond:
            if count > self._needed:
                self._needed = count
                self._cond.notify_all()
            while self._done < count and not self._finished:
                self._cond.wait()

    def stop(self) -> None:
        """End the read-ahead (it stops after its current chunk) and wait for the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _allowed(self, position: int) -> bool:
        """May the thread read on at byte `position` of the plan (called under the lock)?"""
        needed = self._ends[self._needed - 1] if self._needed else 0
        return position < needed + self.window

    def _run(self) -> None:
        sink = None  # /dev/null, while sendfile works
        null = None
        buffer = None
        fds: dict[Path, int] = {}
        try:
            try:
                sink = null = os.open(os.devnull, os.O_WRONLY)
            except OSError:
                pass
            for i, (path, offset, length) in enumerate(self.extents):
                fd = fds.get(path)
                if fd is None:
                    # opened again by name, after the readers checked it: a FIFO swapped in since
                    # would block a plain open, and the operation waiting for it, for ever
                    fd = fds[path] = open_regular(path, "source file")
                done = 0
                while done < length:
                    with self._cond:
                        while not self._stop and not self._allowed(self.position):
                            self.paused = True
                            self._cond.wait()
                        self.paused = False
                        if self._stop:
                            return
                    size = min(READ_CHUNK, length - done)
                    got = 0
                    if sink is not None:
                        try:
                            got = os.sendfile(sink, fd, offset + done, size)
                        except OSError:
                            sink = None  # not supported here: read into a buffer instead
                    if sink is None:
                        if buffer is None:
                            buffer = memoryview(bytearray(READ_CHUNK))
                        got = os.preadv(fd, [buffer[:size]], offset + done)
                    if got <= 0:  # the file is shorter than its header says: the worker reports it
                        return
                    done += got
                    with self._cond:
                        self.position += got
                with self._cond:
                    self._done = i + 1
                    self._cond.notify_all()
        except Exception as e:  # noqa: BLE001 - the workers read anyway and report real errors
            logger.debug("read-ahead stopped: %s", e)
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()
            for fd in fds.values():
                os.close(fd)
            if null is not None:
                os.close(null)


def coalesce(spans: Sequence[tuple[Path, int, int]]) -> tuple[list[tuple[Path, int, int]], list[int]]:
    """The extents the read-ahead reads, in order: each span joins the last extent of its file when
    it continues it (see BRIDGE) and the extent stays within EXTENT bytes, else it starts a new
    one; and for each n, the number of extents that hold the first n spans (`covered[n - 1]`)."""
    extents: list[list] = []  # [path, start, end]
    last: dict[Path, int] = {}
    covered: list[int] = []
    for path, offset, length in spans:
        j = last.get(path)
        if (
            j is not None
            and extents[j][2] <= offset <= extents[j][2] + BRIDGE
            and offset + length - extents[j][1] <= EXTENT
        ):
            extents[j][2] = offset + length
        else:
            j = last[path] = len(extents)
            extents.append([path, offset, offset + length])
        covered.append(max(j + 1, covered[-1] if covered else 0))
    return [(path, start, end - start) for path, start, end in extents], covered
