"""Sequential read-ahead of the source bytes an operation will read, in the order it reads them.

On a cold page cache a worker otherwise pays every read's disk time itself, in tensor order and
in small pieces (a slice of a column-split tensor faults in its pages one by one), and the disk
idles while the worker copies and writes: cold time is then about warm time plus the whole disk
time. A `Prefetcher` thread instead reads the tensors' bytes in large sequential reads, in the
order of their first use, a bounded window ahead of the workers; before a worker reads a piece it
waits until the read-ahead has passed the piece's tensors, so that the worker never waits for the
disk and the disk never waits for the CPU.

Two ways, chosen per run of bytes (an extent):

- Bytes the operation reads once (`once`: a merge's shards, the rows of a row-split tensor), when
  they are not in the page cache (`cached_fraction`) and the operation would not fit in the free
  memory (`reads_around_pay`), are read around it (O_DIRECT) into buffers the read-ahead owns,
  and workers' reads of them are served from those buffers (`DescriptorReader.read_from`); a
  buffer is reused once every planned byte in it has been copied out. Once the page cache has to
  evict to take new pages, it is the expensive part of a cold read on a VM (many times the CPU of
  a read around it), and none of the source then takes page-cache memory that the output's writes
  have to reclaim. The buffers are memory of the
  process: at most DIRECT_BUDGET. When they are all full and a worker waits for bytes not yet
  read, the rest goes through the page cache instead (never a deadlock, only the slower way).
  Small extents are read several at once, each by its own thread (DIRECT_BATCH).
- Everything else (bytes read more than once, cached or mostly cached bytes, file systems that
  refuse O_DIRECT) goes from the file to /dev/null with `sendfile`: the kernel fills the page
  cache and copies nothing to user memory; where that is not possible they are read into one
  reused buffer. That holds no memory of the process: the page cache it fills is reclaimable,
  and the window bounds how far it runs ahead of the workers, so a model larger than memory is
  not read past what the workers will reach soon.

Reading a mapping of the source or `copy_file_range` would save a copy too, but then the bytes
the hash check hashes would not be the bytes written, and a source truncated while mapped kills
the process (SIGBUS); the served bytes are the bytes hashed (the tap sees them).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import ShardkitError
from ..io.data.direct import is_direct, meminfo, set_direct, unmap
from ..io.data.taps import ReadSource, read_exact
from ..io.store import Store
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
by one makes a disk seek between every MiB."""

BRIDGE = 64 << 10
"""A span that starts at most this many bytes after the previous span of its file ends (the zip
headers between a torch file's records) still continues it; the bytes between are read too."""

DIRECT_EXTENT = 1 << 20
"""Spans read once are joined up to this many bytes only: their extents are held in the
read-ahead's own buffers until copied out, and a merge at tp 32 reads a piece of each of 32 files
for every tensor it writes (with 4 MiB extents of each file, one tensor waited for 128 MiB)."""

DIRECT_CHUNK = 256 << 10
"""The read-ahead's buffers for bytes read once: each is reused as soon as every planned byte in
it has been copied out (small, so that little of a buffer is wasted on a span's unaligned ends)."""

DIRECT_BUDGET = 96 << 20
"""At most this many bytes of such buffers (a merge at tp 32 on 7B needs 88 MiB at once for a
row-parallel MLP weight, streamed in blocks of rows from all 32 pieces)."""

DIRECT_READ = 32
"""Buffers filled per O_DIRECT system call at most (one vectored read: large enough to keep a
disk streaming, small enough to hand the first bytes to a waiting worker soon)."""

DIRECT_BATCH = 8
"""Up to this many consecutive small extents are read around the page cache at once, each by its
own thread: one small read at a time leaves the disk idle between requests while it also takes
the output's writes, where reads through the page cache go in large batches of requests."""

DIRECT_BATCH_BYTES = 8 << 20
"""...and up to about this many bytes."""

ALIGN = 4096
"""O_DIRECT reads start at a multiple of this (the largest logical block size in use)."""

COLD = 0.5
"""An extent with less than this fraction of its bytes in the page cache is read around it."""


def window_bytes() -> int:
    """WINDOW, or a quarter of the memory the kernel reports available when that is smaller (the
    read-ahead must not evict what the workers are about to read), at least 4 chunks."""
    available = meminfo("MemAvailable")
    return WINDOW if available is None else max(4 * READ_CHUNK, min(WINDOW, available // 4))


def reads_around_pay(nbytes: int) -> bool:
    """Whether an operation that brings `nbytes` into the page cache (the sources it reads and the
    output it writes) should read its cold bytes around it: when they are more than the free
    memory, so the kernel would have to evict pages to cache them. Below that, reads through the
    page cache are the faster way (the kernel's read-ahead outpaces reads around it), the CPU they
    cost is small, and the bytes stay cached for the next command; above it, the eviction makes
    every cached byte cost several times what reading around the cache does (docs/history/ has the
    measurements)."""
    free = meminfo("MemFree")
    return hasattr(os, "O_DIRECT") and free is not None and nbytes > free


Opened = tuple[int, tuple[int, int]]
"""An O_DIRECT descriptor of a source file, and the file's identity (st_dev, st_ino)."""


class _Chunk:
    """One buffer of bytes read around the page cache: file bytes [start, end) of `key`'s file,
    the planned ranges in it not yet copied out, and the copies in progress (`pins`)."""

    __slots__ = ("key", "start", "end", "slot", "planned", "pins")

    def __init__(self, key: tuple[int, int], start: int, end: int, slot: int, planned: list[list[int]]):
        self.key, self.start, self.end, self.slot, self.planned, self.pins = key, start, end, slot, planned, 0


class _CacheFill:
    """Reads bytes into the page cache: sendfile to /dev/null while the kernel allows it (no copy
    into this process), else reads into one reused buffer."""

    def __init__(self) -> None:
        self.buffer: memoryview | None = None
        try:
            self.null: int | None = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            self.null = None
        self.sink = self.null

    def fill(self, fd: int, offset: int, size: int) -> int:
        if self.sink is not None:
            try:
                return os.sendfile(self.sink, fd, offset, size)
            except OSError:
                self.sink = None  # not supported here: read into a buffer instead
        if self.buffer is None:
            self.buffer = memoryview(bytearray(READ_CHUNK))
        return os.preadv(fd, [self.buffer[:size]], offset)

    def close(self) -> None:
        if self.null is not None:
            os.close(self.null)
            self.null = self.sink = None


class Prefetcher:
    """Reads `spans` ((path, offset, length), in the order the workers first need them) ahead of
    the workers in a background thread. Workers call `wait(n)` before reading bytes of the first
    n spans; the thread stays at most `window` bytes ahead of the largest n asked for so far.

    `once[i]` True says the operation reads span i's bytes exactly once (no other span overlaps
    it): such bytes may be read around the page cache into the read-ahead's buffers (see the
    module's docstring), and served to readers set up with `source_for`.

    A failure of the read-ahead itself (a file that cannot be opened or read) only ends it: the
    workers then read as without it and meet the error themselves."""

    def __init__(
        self,
        spans: Sequence[tuple[Path, int, int]],
        window: int | None = None,
        once: Sequence[bool] | None = None,
        store: Store | None = None,
    ):
        self.spans = spans  # as planned (the hash check knows by them which reads come later)
        self.store = store if store is not None else Store("/")
        self._once_spans: list[tuple[Path, int, int]] = []
        if self.store.fetches and once is not None:
            # an object store's mirror files: fetched by the mirror, never read around the page cache
            # (a local file is, whatever mirrors this process holds open)
            mirrored = {path: self.store.holds(path) for path in {span[0] for span in spans}}
            self._once_spans = [span for span, single in zip(spans, once) if single and mirrored[span[0]]]
            once = [bool(single) and not mirrored[span[0]] for span, single in zip(spans, once)]
        self._requested = 0  # the most spans a worker has asked for
        self.window = window_bytes() if window is None else window
        self.extents, self._covered, self._members = _coalesce(spans, once)
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
        self.direct_bytes = 0  # bytes read around the page cache so far
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._cold_files: set[tuple[int, int]] = set()  # identities of the files with extents read around
        if any(members is not None for members in self._members):
            self._members, self._cold_files = _only_cold(self.extents, self._members)
        self._direct = any(members is not None for members in self._members)
        self._pool: mmap.mmap | None = None  # DIRECT_BUDGET bytes of page-aligned buffers
        self._free: list[int] = []  # buffer slots not holding bytes
        self._held: dict[tuple[int, int], list[_Chunk]] = {}  # file identity -> buffers holding its bytes

    def start(self) -> Prefetcher:
        if self.extents and self._thread is None:
            self.store.expect(self.extents, self._once_spans)  # an object store's spans: fetched in this order
            self._thread = threading.Thread(target=self._run, name="shardkit-read-ahead", daemon=True)
            self._thread.start()
        else:
            self._finished = True
        return self

    def wait(self, count: int) -> None:
        """Return once the first `count` spans are read ahead (or the read-ahead ended)."""
        if count <= 0:
            return
        spans = count
        count = self._covered[min(count, len(self._covered)) - 1]  # in extents
        with self._cond:
            self._requested = max(self._requested, spans)
            if count > self._needed:
                self._needed = count
                self._cond.notify_all()
            while self._done < count and not self._finished:
                self._cond.wait()

    def requested(self) -> int:
        """How many of the planned spans the workers have asked for so far (their reads are under way)."""
        return self._requested

    def stop(self) -> None:
        """End the read-ahead (it stops after its current chunk), wait for the thread, and free
        its buffers (readers then read the files themselves)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        logger.debug("read ahead %d bytes, %d of them around the page cache", self.position, self.direct_bytes)
        with self._cond:
            self._held.clear()
            self._free.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            unmap(pool)

    def source_for(self, st: os.stat_result) -> ReadSource | None:
        """What serves the reads of the file `st` describes from the read-ahead's buffers (for
        `DescriptorReader.read_from`); None when nothing is read around the page cache."""
        key = (st.st_dev, st.st_ino)
        if not self._direct or key not in self._cold_files:
            return None

        def serve(fd: int, view: memoryview, offset: int, what: str) -> bool:
            return self._serve(key, fd, view, offset, what)

        return serve

    def _serve(self, key: tuple[int, int], fd: int, view: memoryview, offset: int, what: str) -> bool:
        """Copy the planned bytes of [offset, offset + len(view)) that buffers hold into `view`,
        read the rest from fd, and free each buffer whose planned bytes have all been copied.
        Each planned byte is handed out once: a second read of it reads the file."""
        end = offset + len(view)
        parts: list[tuple[int, int, _Chunk]] = []
        with self._cond:
            for chunk in self._held.get(key, ()):
                if chunk.start >= end or chunk.end <= offset:
                    continue
                left: list[list[int]] = []
                for s, e in chunk.planned:
                    lo, hi = max(s, offset), min(e, end)
                    if lo >= hi:
                        left.append([s, e])
                        continue
                    parts.append((lo, hi, chunk))
                    left += [r for r in ([s, lo], [hi, e]) if r[0] < r[1]]
                if parts and parts[-1][2] is chunk:
                    chunk.planned = left
                    chunk.pins += 1
            pool = self._pool
        if not parts:
            return False
        pinned = {id(c): c for _, _, c in parts}
        try:
            parts.sort(key=lambda part: part[0])
            position = offset
            assert pool is not None
            with memoryview(pool) as buffers:
                for lo, hi, chunk in parts:
                    if lo > position:
                        read_exact(fd, view[position - offset : lo - offset], position, what)
                    base = chunk.slot * DIRECT_CHUNK - chunk.start
                    view[lo - offset : hi - offset] = buffers[base + lo : base + hi]
                    position = hi
            if position < end:
                read_exact(fd, view[position - offset :], position, what)
        finally:
            with self._cond:
                for chunk in pinned.values():
                    chunk.pins -= 1
                    if not chunk.planned and not chunk.pins:
                        self._release(chunk)
        return True

    def _release(self, chunk: _Chunk) -> None:
        """Give a buffer back (under the lock)."""
        held = self._held.get(chunk.key)
        if held is not None and chunk in held:
            held.remove(chunk)
            if not held:
                del self._held[chunk.key]
            if self._pool is not None:
                self._free.append(chunk.slot)
            self._cond.notify_all()

    def _allowed(self, position: int) -> bool:
        """May the thread read on at byte `position` of the plan (called under the lock)?"""
        needed = self._ends[self._needed - 1] if self._needed else 0
        return position < needed + self.window

    def _pause(self, ready) -> bool:
        """Wait (under the lock) until the window lets the thread read on and `ready()`; False
        when the read-ahead is being stopped."""
        while not self._stop and not (self._allowed(self.position) and ready()):
            self.paused = True
            self._cond.wait()
        self.paused = False
        return not self._stop

    def _through_cache(self, cache: _CacheFill, fd: int, offset: int, length: int) -> bool:
        """Bring `length` bytes at `offset` of fd into the page cache (False: stopped, or the file
        is shorter than its header says, which the worker reading it reports)."""
        done = 0
        while done < length:
            with self._cond:
                if not self._pause(lambda: True):
                    return False
            got = cache.fill(fd, offset + done, min(READ_CHUNK, length - done))
            if got <= 0:
                return False
            done += got
            with self._cond:
                self.position += got
        return True

    def _run(self) -> None:
        cache = _CacheFill()
        fds: dict[Path, int] = {}
        direct_fds: dict[Path, Opened | None] = {}
        readers: ThreadPoolExecutor | None = None  # O_DIRECT reads of a batch of extents at once

        def cold(j: int) -> Opened | None:
            """The O_DIRECT descriptor to read extent j with, when its bytes are read once, are
            not in the page cache, and the file takes O_DIRECT; else None."""
            path, offset, length = self.extents[j]
            fd = fds.get(path)
            if fd is None:
                # opened again by name, after the readers checked it: a FIFO swapped in since
                # would block a plain open, and the operation waiting for it, for ever
                fd = fds[path] = open_regular(path, "source file")
            if self._members[j] is None or cached_fraction(fd, offset, length) >= COLD:
                return None
            if path not in direct_fds:
                direct_fds[path] = _open_direct(path)
            opened = direct_fds[path]
            if opened is not None and not is_direct(opened[0]):  # a read refused it
                os.close(opened[0])
                opened = direct_fds[path] = None
            return opened

        try:
            i = 0
            while i < len(self.extents):
                path, offset, length = self.extents[i]
                if self.store.is_streamed(
                    path
                ):  # its mirror fetches it, a bounded window ahead, and drops it once read
                    with self._cond:
                        self._done = i + 1
                        self._cond.notify_all()
                    i += 1
                    continue
                self.store.ensure(path, offset, length)  # a mirror file's bytes are there before they are read
                opened = cold(i)
                done = 0
                if opened is not None:
                    batch = [(i, opened)]
                    size = length
                    while (
                        len(batch) < DIRECT_BATCH and size < DIRECT_BATCH_BYTES and i + len(batch) < len(self.extents)
                    ):
                        j = i + len(batch)
                        if self.extents[j][2] > DIRECT_EXTENT or (following := cold(j)) is None:
                            break
                        batch.append((j, following))
                        size += self.extents[j][2]
                    if len(batch) > 1:
                        if readers is None:
                            readers = ThreadPoolExecutor(DIRECT_BATCH, thread_name_prefix="shardkit-read-ahead-io")
                        count = self._read_batch(batch, readers)
                        if count < 0:
                            return
                        if count:
                            i += count
                            continue
                        opened = cold(i)  # unless a read of the batch refused O_DIRECT
                    if opened is not None:
                        done = self._read_direct(i, opened, offset, length)
                        if done < 0:
                            return
                if not self._through_cache(cache, fds[path], offset + done, length - done):
                    return
                with self._cond:
                    self._done = i + 1
                    self._cond.notify_all()
                i += 1
        except Exception as e:  # noqa: BLE001 - the workers read anyway and report real errors
            logger.debug("read-ahead stopped: %s", e)
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()
            if readers is not None:
                readers.shutdown(wait=True)
            for fd in fds.values():
                os.close(fd)
            for opened in direct_fds.values():
                if opened is not None:
                    os.close(opened[0])
            cache.close()

    def _take(self, i: int, slots: int) -> bool:
        """Wait (under the lock) until the window lets the thread read extent i and `slots`
        buffers are free, or a worker waits for extent i (then there may be fewer): a worker
        waiting while every buffer is full would wait for ever. False when being stopped."""
        if not self._pause(lambda: self._pool is None or len(self._free) >= slots or self._needed > i):
            return False
        if self._pool is None:
            self._pool = mmap.mmap(-1, DIRECT_BUDGET)  # page-aligned, as O_DIRECT needs
            self._free = list(range(DIRECT_BUDGET // DIRECT_CHUNK))[::-1]
        return True

    def _read_batch(self, batch: list[tuple[int, Opened]], readers: ThreadPoolExecutor) -> int:
        """Read consecutive small extents around the page cache at once, each by its own thread
        (one read at a time leaves a disk busy with the output's writes half idle); the number
        of extents done, from the first (0: the buffers did not hold the first one: read it
        alone), or -1 when the read-ahead is being stopped."""
        jobs = []  # (extent, descriptor, file identity, first byte, bytes, buffers)
        for i, (fd, key) in batch:
            _, offset, length = self.extents[i]
            first = offset - offset % ALIGN
            size = -(-(offset + length - first) // ALIGN) * ALIGN
            jobs.append((i, fd, key, first, size, -(-size // DIRECT_CHUNK)))
        with self._cond:
            if not self._take(batch[0][0], jobs[0][5]):
                return -1
            taken: list[tuple[int, int, tuple[int, int], int, int, list[int]]] = []
            position = self.position
            for i, fd, key, first, size, count in jobs:
                if count > len(self._free) or taken and not self._allowed(position):
                    break
                taken.append((i, fd, key, first, size, [self._free.pop() for _ in range(count)]))
                position += self.extents[i][2]
            pool = self._pool
        assert pool is not None

        def read(job: tuple[int, int, tuple[int, int], int, int, list[int]]) -> int | None:
            _, fd, _, first, size, slots = job
            return _read_around(pool, fd, first, slots, size)

        results = list(readers.map(read, taken))
        done, refused = 0, False
        with self._cond:
            for (i, _, key, first, _, slots), got in zip(taken, results):
                refused = refused or got is None
                if refused or got is None:  # this one and those after it go through the page cache
                    self._free += slots
                    continue
                _, offset, length = self.extents[i]
                self._register(key, first, got, slots, self._members[i] or [], offset, offset + length)
                self._done = i + 1
                done += 1
            self._cond.notify_all()
        return done

    def _read_direct(self, i: int, opened: Opened, offset: int, length: int) -> int:
        """Read extent i around the page cache into free buffers, DIRECT_READ at a time; the bytes
        of it done (the rest goes through the page cache: the buffers were all full while a
        worker waited for this extent, or O_DIRECT was refused), or -1 when the read-ahead is
        being stopped."""
        fd, key = opened
        end = offset + length
        position = offset - offset % ALIGN
        while position < end:
            with self._cond:
                if not self._take(i, 1):
                    return -1
                if not self._free:
                    return max(0, position - offset)
                wanted = min(DIRECT_READ, len(self._free), -(-(end - position) // DIRECT_CHUNK))
                slots = [self._free.pop() for _ in range(wanted)]
                pool = self._pool
            assert pool is not None
            size = min(wanted * DIRECT_CHUNK, -(-(end - position) // ALIGN) * ALIGN)
            got = _read_around(pool, fd, position, slots, size)
            with self._cond:
                if got is None:  # refused at read: through the page cache from here
                    self._free += slots
                    return max(0, position - offset)
                self._register(key, position, got, slots, self._members[i] or [], offset, end)
                self._cond.notify_all()
            if got < size:  # the end of the file: shorter than planned, the workers report it
                return length
            position += got
        return length

    def _register(
        self, key: tuple[int, int], position: int, got: int, slots: list[int], members, offset: int, end: int
    ) -> None:
        """Hold the buffers just filled with `got` bytes from `position` (under the lock), each with
        the planned bytes in it; one holding none is freed at once. Counts the extent's bytes
        [offset, end) among them as read ahead."""
        for k, slot in enumerate(slots):
            start = position + k * DIRECT_CHUNK
            stop = min(start + DIRECT_CHUNK, position + got)
            planned = [[max(s, start), min(e, stop)] for s, e in members if max(s, start) < min(e, stop)]
            if planned:
                self._held.setdefault(key, []).append(_Chunk(key, start, stop, slot, planned))
            else:
                self._free.append(slot)
        moved = max(0, min(end, position + got) - max(offset, position))
        self.position += moved
        self.direct_bytes += moved


def _read_around(pool: mmap.mmap, fd: int, position: int, slots: list[int], size: int) -> int | None:
    """Read `size` bytes at `position` of an O_DIRECT descriptor into the buffers `slots` of
    `pool`, in one call; the bytes read (fewer at the end of the file), or None when the file
    system refuses the read (EINVAL: O_DIRECT is then cleared on fd)."""
    with memoryview(pool) as buffers:
        views = [
            buffers[s * DIRECT_CHUNK : s * DIRECT_CHUNK + min(DIRECT_CHUNK, size - k * DIRECT_CHUNK)]
            for k, s in enumerate(slots)
        ]
        try:
            return os.preadv(fd, views, position)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            set_direct(fd, False)
            return None
        finally:
            for view in views:
                view.release()


def _open_direct(path: Path) -> Opened | None:
    """A descriptor reading `path` around the page cache, with the file's identity (st_dev,
    st_ino); None where the file system refuses O_DIRECT (tmpfs, some FUSE)."""
    fd = open_regular(path, "source file")
    try:
        set_direct(fd, True)
        st = os.fstat(fd)
    except (OSError, AttributeError):
        os.close(fd)
        return None
    return fd, (st.st_dev, st.st_ino)


def coalesce(spans: Sequence[tuple[Path, int, int]]) -> tuple[list[tuple[Path, int, int]], list[int]]:
    """The extents the read-ahead reads, in order: each span joins the last extent of its file when
    it continues it (see BRIDGE) and the extent stays within EXTENT bytes, else it starts a new
    one; and for each n, the number of extents that hold the first n spans (`covered[n - 1]`)."""
    extents, covered, _ = _coalesce(spans, None)
    return extents, covered


def extents_of(
    spans: Sequence[tuple[Path, int, int]], once: Sequence[bool] | None = None
) -> list[tuple[Path, int, int]]:
    """The extents a `Prefetcher` of `spans` (and `once`) reads, without making one."""
    return _coalesce(spans, once)[0]


def _coalesce(
    spans: Sequence[tuple[Path, int, int]], once: Sequence[bool] | None
) -> tuple[list[tuple[Path, int, int]], list[int], list[list[tuple[int, int]] | None]]:
    """`coalesce`, where spans read once join only spans read once, within DIRECT_EXTENT bytes;
    also, for each extent, the byte ranges of its spans when they are all read once (else None)."""
    extents: list[list] = []  # [path, start, end]
    members: list[list[tuple[int, int]] | None] = []
    last: dict[Path, int] = {}
    covered: list[int] = []
    for n, (path, offset, length) in enumerate(spans):
        single = bool(once[n]) if once is not None else False
        j = last.get(path)
        if (
            j is not None
            and (members[j] is not None) == single
            and extents[j][2] <= offset <= extents[j][2] + BRIDGE
            and offset + length - extents[j][1] <= (DIRECT_EXTENT if single else EXTENT)
        ):
            extents[j][2] = offset + length
        else:
            j = last[path] = len(extents)
            extents.append([path, offset, offset + length])
            members.append([] if single else None)
        spans_of = members[j]
        if spans_of is not None:
            spans_of.append((offset, offset + length))
        covered.append(max(j + 1, covered[-1] if covered else 0))
    return [(path, start, end - start) for path, start, end in extents], covered, members


def _only_cold(
    extents: Sequence[tuple[Path, int, int]], members: list[list[tuple[int, int]] | None]
) -> tuple[list[list[tuple[int, int]] | None], set[tuple[int, int]]]:
    """Of the extents read once, those whose bytes are mostly not in the page cache as the
    operation starts: only they may be read around it (the thread checks again as it reaches
    each). The rest stay where they are: a worker copies warm bytes by the kernel, file to file
    (`HashingFile.copy_ranges`), which bytes served from the buffers cannot be. Also the
    identities of the files that keep such extents (only their readers are served from the
    buffers). A file that cannot be opened keeps none (its readers meet the error)."""
    kept = list(members)
    cold: set[tuple[int, int]] = set()
    with _opened_once() as descriptor:
        for j, (path, offset, length) in enumerate(extents):
            if kept[j] is None:
                continue
            fd = descriptor(path)
            if fd is None or cached_fraction(fd, offset, length) >= COLD:
                kept[j] = None
                continue
            st = os.fstat(fd)
            cold.add((st.st_dev, st.st_ino))
    return kept, cold


def cached_share(extents: Sequence[tuple[Path, int, int]]) -> float:
    """The fraction of the bytes of `extents` ((path, offset, length)) in the page cache now
    (`cached_fraction`, by bytes; 1.0 for no bytes). A file that cannot be opened counts as cached
    (its readers meet the error)."""
    total = cached = 0.0
    with _opened_once() as descriptor:
        for path, offset, length in extents:
            fd = descriptor(path)
            total += length
            cached += length if fd is None else length * cached_fraction(fd, offset, length)
    return cached / total if total else 1.0


@contextlib.contextmanager
def _opened_once() -> Iterator[Callable[[Path], int | None]]:
    """descriptor(path): the file opened once, on first use (None when it cannot be opened: its
    readers meet the error); every one closed when the block ends."""
    fds: dict[Path, int | None] = {}

    def descriptor(path: Path) -> int | None:
        if path not in fds:
            try:
                fds[path] = open_regular(path, "source file")
            except ShardkitError:
                fds[path] = None
        return fds[path]

    try:
        yield descriptor
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


_CACHESTAT = 451  # the same number on every architecture (Linux 6.5+)
_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None = None
_how: str | None = None  # "cachestat", "mincore", or "" (neither works here)


def cached_fraction(fd: int, offset: int, length: int) -> float:
    """The fraction of the file's bytes [offset, offset + length) in the page cache: from the
    cachestat system call (Linux 6.5+), else from mincore over a mapping of the range (which
    never reads the file), else 1.0 (unknown: treated as cached, the way without O_DIRECT)."""
    global _libc, _how
    if length <= 0:
        return 1.0
    if _libc is None and _how != "":
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _how = ""
    if _how is None:
        _how = "cachestat"
    libc = _libc
    first = offset - offset % _PAGE
    pages = -(-(offset + length - first) // _PAGE)
    if _how == "cachestat" and libc is not None:
        span, stat_ = _CachestatRange(first, pages * _PAGE), _Cachestat()
        if libc.syscall(_CACHESTAT, fd, ctypes.byref(span), ctypes.byref(stat_), 0) == 0:
            return min(1.0, stat_.cache / pages)
        _how = "mincore"
    if _how == "mincore" and libc is not None:
        found = _mincore(libc, fd, first, pages)
        if found is not None:
            return found
        _how = ""
    return 1.0


def _mincore(libc: ctypes.CDLL, fd: int, first: int, pages: int) -> float | None:
    """mincore's count of resident pages of a read-only mapping of the range, or None."""
    mmap_ = libc.mmap
    mmap_.restype = ctypes.c_void_p
    mmap_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    addr = mmap_(None, pages * _PAGE, mmap.PROT_READ, mmap.MAP_SHARED, fd, first)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(pages * _PAGE), vec) != 0:
            return None
        return sum(b & 1 for b in vec) / pages
    finally:
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(pages * _PAGE))
