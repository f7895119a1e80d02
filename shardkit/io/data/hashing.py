"""Files that hash what is written to them (`HashingFile`), for the manifests' digests.

Hashing and the kernel's copy into the page cache are the largest CPU costs of writing on a warm
cache, so both run beside the caller: large blocks whose owner keeps them alive are written and
hashed in file order by a few shared write-behind threads (`_Writers`), blocks the caller may reuse
are hashed by a helper thread while the caller writes them (`_Hasher`), and bytes copied by the
kernel (`HashingFile.copy_ranges`) are hashed from one read of them. The bytes waiting in memory
are bounded per file and in all files together.
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import queue
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from ...errors import FormatError
from ..safety.sinks import NO_SINK, Sink
from .copy import _COPY_BUFFER, COPY_BLOCK, FileRange, kernel_copy
from .digest import Digests, FileRecord, Recording
from .direct import WRITE_BLOCK, DirectFile, preallocate
from .taps import OpenFile, _feed_taps, read_exact

if TYPE_CHECKING:
    import io


PARALLEL_HASH_MIN = 1 << 20
"""Blocks at least this large are hashed beside the caller: by the write-behind thread after it
writes them (owned blocks), or by the helper thread while the caller writes them."""

BEHIND_MIN = 256 << 10
"""Owned blocks at least this large are written and hashed by a write-behind thread; smaller ones
are written (or queued, copied) by the caller."""

TAIL_MAX = 1 << 20
"""At most this many bytes of small writes wait (copied) for the blocks before them to be hashed;
beyond it the caller waits for those blocks and hashes the small writes."""

HASH_BEHIND = 32 << 20
"""At most this many bytes of owned blocks (`HashingFile.write_owned`) wait to be hashed per file
after their write returned: bounds the memory their owners keep alive (a single larger block is
hashed before its write returns)."""


class _HashJob:
    """One block to hash: done by the helper thread or, when the helper has not begun it by the
    time the block is written, by the writing thread itself (`finish`). The blocks of one file
    are chained (`prev`): a block is hashed only once the one before it is, so the digest sees
    the bytes in file order whichever thread runs which block. `prefix`: small writes that came
    between the block before and this one (copied), hashed first."""

    __slots__ = ("hash", "prefix", "view", "owner", "prev", "size", "taken", "done")

    hash: Digests
    prefix: bytes | None
    view: memoryview | None  # None once hashed
    owner: object  # keeps the bytes of `view` alive (None: the caller waits until they are hashed)
    prev: _HashJob | _CopyJob | None  # the file's block before this one, until it is hashed
    size: int
    taken: bool
    done: threading.Event

    def __init__(
        self,
        digest: Digests,
        view: memoryview,
        owner: object = None,
        prev: _HashJob | _CopyJob | None = None,
        prefix: bytes | None = None,
    ):
        self.hash, self.view, self.owner, self.prev, self.prefix = digest, view, owner, prev, prefix
        self.size, self.taken, self.done = len(view), False, threading.Event()

    def take(self) -> bool:
        with _HASH_LOCK:
            if self.taken:
                return False
            self.taken = True
            return True

    def run(self) -> None:
        try:
            prev = self.prev
            if prev is not None:
                prev.wait()
            if self.prefix:
                self.hash.update(self.prefix)
            self.hash.update(self.view)
        finally:
            self.view = self.owner = self.prev = self.prefix = None
            self.done.set()

    def wait(self) -> None:
        try:
            self.done.wait()
        except BaseException:  # Ctrl-C: the helper still reads the caller's bytes, never leave before it is done
            self.done.wait()
            raise

    def finish(self) -> None:
        """Hash the block now unless the helper has begun it; then wait until it is hashed (the
        caller may free the bytes as soon as this returns)."""
        if self.take():
            self.run()
            return
        self.wait()

    def cancel(self) -> None:
        """Drop the block unhashed unless the helper has begun it, else wait until it is done: either
        way the helper holds none of the caller's bytes afterwards."""
        if self.take():
            self.view = self.owner = self.prev = self.prefix = None
            self.done.set()
            return
        self.wait()


_HASH_LOCK = threading.Lock()


class _Hasher:
    """A daemon thread that hashes the blocks being written (the digests release the GIL), so the
    hash of a block is computed while the kernel copies it into the file: on a warm page cache
    the two are the largest CPU costs of writing. The writing thread takes a block back when the
    helper is busy (with another worker's block), so hashing never waits for the helper. Blocks
    written by the caller's own thread are hashed here while it writes them; blocks whose owner keeps
    them alive (`HashingFile.write_owned`) are hashed by the file's write-behind thread as it
    writes them, so the caller reads and writes the next block meanwhile."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_HashJob] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None

    def submit(self, job: _HashJob) -> _HashJob:
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            with _HASH_LOCK:  # (re)started lazily, also in a forked child
                if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                    self._queue = queue.SimpleQueue()
                    self._pid = os.getpid()
                    self._thread = threading.Thread(
                        target=self._run, args=(self._queue,), name="shardkit-hash-writes", daemon=True
                    )
                    self._thread.start()
        self._queue.put(job)
        return job

    @staticmethod
    def _run(jobs: queue.SimpleQueue[_HashJob]) -> None:
        while True:
            job = jobs.get()
            if job.take():
                job.run()

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every block queued so far is hashed or dropped."""
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            return
        marker = self.submit(_HashJob(Digests(), memoryview(b"")))
        marker.done.wait(timeout)


_HASHER = _Hasher()
# The helper drops the last reference to blocks it hashed; that must not happen while the
# interpreter shuts down (a daemon thread is then stopped as it retakes the GIL, and inside torch's
# tensor deallocator that stop aborts the process), so the queue is drained before.
atexit.register(_HASHER.drain)

WRITE_BEHIND = 32 << 20
"""At most this many bytes of owned blocks per file wait for their write (`HashingFile.write_owned`)."""

WRITE_BEHIND_ALL = 32 << 20
"""At most this many bytes of owned blocks wait for their write in all files together (a larger
block is written before its write returns): the files of a group built together (see
`engine.planning.lockstep_groups`) each have a queue, and their write-behind threads run at once.
Every queued block is written by its own file's thread, whatever the caller does, so a caller
waiting for the others' blocks always gets to go on."""


class _Queued:
    """The bytes of owned blocks queued in all files (see WRITE_BEHIND_ALL), and the condition
    every write-behind thread notifies as it writes."""

    total = 0
    jobs = 0  # blocks and copies queued or being written, in all files
    changed = threading.Condition()


def queued_writes() -> int:
    """Blocks and copies of any file still queued for, or being written by, a write-behind
    thread (0 once every file is closed or given up)."""
    return _Queued.jobs


WRITE_THREADS = max(2, min(8, os.cpu_count() or 2))
"""Threads that run the write-behind queues of all files (each file's queue in one of them)."""


class _Writers:
    """The write-behind threads: each file is given one of them (in turn, `assign`) for all its
    writes, so its blocks are written in order; many files share a thread. A thread per file cost
    a thread start per file, a 1 MiB read-back buffer per thread and a wake-up per block (the tp
    files of a stage built together: 32 files, 64 threads while one group closes)."""

    def __init__(self) -> None:
        self._queues: list[queue.SimpleQueue] = []
        self._pid: int | None = None
        self._turn = 0
        self._lock = threading.Lock()

    def assign(self) -> queue.SimpleQueue:
        """The queue of the thread the next file writes through (started lazily, also in a forked
        child)."""
        with self._lock:
            if self._pid != os.getpid():  # (in a forked child: the parent's queues and counts are not its own)
                self._queues, self._pid = [], os.getpid()
                _Queued.total, _Queued.jobs, _Queued.changed = 0, 0, threading.Condition()
                for _ in range(WRITE_THREADS):
                    jobs: queue.SimpleQueue = queue.SimpleQueue()
                    threading.Thread(target=self._run, args=(jobs,), name="shardkit-write-behind", daemon=True).start()
                    self._queues.append(jobs)
            self._turn = (self._turn + 1) % len(self._queues)
            return self._queues[self._turn]

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            behind, job = jobs.get()
            done = behind._run_one(job)
            # the owner's memory goes before the caller learns the block is written: a caller that
            # then ends the interpreter never leaves a tensor for this daemon thread to free
            del job
            behind._written(*done)
            del behind


_WRITERS = _Writers()


class _WriteBehind:
    """One file's queue of owned blocks (and the small writes and copies queued after them),
    written in order by a write-behind thread (`_Writers`) while the caller reads and prepares the
    next block: the kernel's copy into the page cache is then off the caller's thread, as the
    digests are. The first write error is kept and raised to the caller at its next write, flush
    or close; later blocks are dropped."""

    def __init__(self, fh: io.BufferedRandom | DirectFile) -> None:
        self._fh = fh
        self._jobs = _WRITERS.assign()
        self._pending = 0
        self._changed = _Queued.changed
        self._cancelled = False
        self.error: BaseException | None = None

    def put(self, view: memoryview | _CopyJob, owner: object, job: _HashJob | None = None) -> None:
        """Queue `view` (kept alive by `owner`; `job`: its hash, run once it is written), then
        wait until at most WRITE_BEHIND bytes are queued for this file and WRITE_BEHIND_ALL for all:
        the caller's memory grows by at most that much (a larger block is written before this
        returns, while its digests are computed). A `_CopyJob` is queued the same way, with `owner`
        the bytes it appends (it holds none of the caller's memory, only descriptors)."""
        size = len(view) if isinstance(view, memoryview) else cast(int, owner)
        if self.error is not None:
            raise self.error
        with self._changed:
            self._pending += size
            _Queued.jobs += 1
            if isinstance(view, memoryview):
                _Queued.total += size
        if isinstance(view, _CopyJob):
            view.queued = True
        self._jobs.put((self, (view, owner, job)))
        with self._changed:
            while (self._pending > WRITE_BEHIND or _Queued.total > WRITE_BEHIND_ALL) and self.error is None:
                self._changed.wait()

    @property
    def pending(self) -> int:
        return self._pending

    def drain(self) -> BaseException | None:
        """Wait until every queued block is written; the first error, if any."""
        with self._changed:
            while self._pending:
                self._changed.wait()
        return self.error

    def stop(self, cancel: bool = False) -> None:
        """Return once the queue is written (`cancel`: dropped)."""
        if cancel:
            self._cancelled = True
        while True:
            try:
                self.drain()
                return
            except BaseException:  # Ctrl-C: the thread still writes the caller's bytes; never leave before it ends
                continue

    def _run_one(self, job: tuple[memoryview | _CopyJob, object, _HashJob | None]) -> tuple[int, bool]:
        """Write one queued block (in a write-behind thread); its size and whether it was a block
        of the caller's memory, for `_written` once nothing here holds it."""
        view, owner, hashing = job
        size = len(view) if isinstance(view, memoryview) else cast(int, owner)
        block = isinstance(view, memoryview)
        try:
            if isinstance(view, _CopyJob):
                view.run(self._fh, skip=self.error is not None or self._cancelled)
            else:
                for start in range(0, size, WRITE_BLOCK):
                    if self.error is not None or self._cancelled:
                        break
                    self._fh.write(view[start : start + WRITE_BLOCK])
                # hashed here, in file order (the blocks before it were queued before it), while
                # its bytes are still in the CPU's cache; a helper thread that hashed it would
                # wait there for this file's copies, while every other file's blocks wait too
                if hashing is not None and self.error is None and not self._cancelled and hashing.take():
                    hashing.run()
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
            self.error = e
        finally:
            del view, owner, job, hashing  # the owner's memory may go now
        return size, block

    def _written(self, size: int, block: bool) -> None:
        with self._changed:
            self._pending -= size
            _Queued.jobs -= 1
            if block:
                _Queued.total -= size
            self._changed.notify_all()


class _CopyJob:
    """Source byte ranges appended to a file at `position` by the kernel's copy, run by the file's
    write-behind thread (see `HashingFile.copy_ranges`). In the file's chain of blocks to hash
    it stands like a `_HashJob`: it hashes its bytes (read back) once the block before it is
    hashed (`prev`), after `prefix` (small writes queued between). The sources' checks are fed
    before the job is queued (`HashingFile.copy_ranges`); the job owns the ranges' descriptors and
    closes them when done or dropped."""

    size = 0  # holds none of the caller's memory: not counted against HASH_BEHIND

    def __init__(
        self,
        ranges: list[FileRange],
        position: int,
        path: Path,
        digest: Digests | None,
        prev: _HashJob | _CopyJob | None,
        prefix: bytes | None,
        seen: Callable[[memoryview], None] | None,
        after: Callable[[], bytes] | None,
        after_size: int,
    ):
        self.ranges, self.position, self.path, self.digest = ranges, position, path, digest
        self.prev: _HashJob | _CopyJob | None = prev
        self.prefix, self.seen, self.after, self.after_size = prefix, seen, after, after_size
        self.cancelled = False
        self.queued = False  # in the write-behind thread's queue
        self.done = threading.Event()

    def run(self, fh: io.BufferedRandom | DirectFile | None, skip: bool = False) -> None:
        """Copy, read back and hash (in the write-behind thread); `skip`: drop the job."""
        try:
            if not (skip or self.cancelled or fh is None):
                self._copy(cast("io.BufferedRandom", fh))
        finally:
            for source in self.ranges:
                source.file.close()
            self.ranges, self.prev, self.seen, self.after = [], None, None, None
            self.done.set()

    def _copy(self, fh: io.BufferedRandom) -> None:
        fh.flush()
        out = fh.fileno()
        os.lseek(out, self.position, os.SEEK_SET)
        view = _COPY_BUFFER.view
        readback = self.digest is not None or self.seen is not None
        by_kernel = True
        done = 0
        for source in self.ranges:
            for start in range(0, source.length, COPY_BLOCK):
                if self.cancelled:  # the file is being given up: stop between blocks
                    return
                n = min(COPY_BLOCK, source.length - start)
                block = view[:n]
                moved = 0
                while by_kernel and moved < n:
                    got = kernel_copy(source.fd, source.offset + start + moved, out, n - moved, source.file.fetcher)
                    if got is None:  # not between these files: read and write from here on
                        by_kernel = False
                    elif got == 0:
                        raise FormatError(f"{source.what} is truncated: re-create it")
                    else:
                        moved += got
                if moved < n:  # the block's rest (all of it where the kernel does not copy)
                    read_exact(source.fd, block, source.offset + start, source.what, source.file.fetcher)
                    for first in range(moved, n, WRITE_BLOCK):
                        _write_all(out, block[first : min(n, first + WRITE_BLOCK)])
                elif readback:
                    read_exact(out, block, self.position + done, str(self.path))
                if readback:
                    self._hash(block)
                    if self.seen is not None:
                        self.seen(block)
                done += n
        fh.seek(self.position + done)  # the buffered file learns where the kernel left it
        if self.after is not None:
            data = _after_bytes(self.after, self.after_size, self.path)
            fh.write(data)
            self._hash(memoryview(data))

    def _hash(self, data: memoryview) -> None:
        if self.digest is None:
            return
        if self.prev is not None:  # the file's bytes before these are hashed first
            self.prev.wait()
            self.prev = None
        if self.prefix:
            self.digest.update(self.prefix)
            self.prefix = None
        self.digest.update(data)

    def wait(self) -> None:
        try:
            self.done.wait()
        except BaseException:  # Ctrl-C: the job may still feed the caller's digest; never leave before it ends
            self.done.wait()
            raise

    def finish(self) -> None:
        self.wait()

    def cancel(self) -> None:
        """Drop the job unless it has begun; either way return once it is done with the file
        (a job never queued is dropped here)."""
        self.cancelled = True
        if not self.queued:
            self.run(None, skip=True)
        self.wait()


def _after_bytes(after: Callable[[], bytes], size: int, path: Path) -> bytes:
    """What `after()` gives to write behind a copy, of the `size` promised."""
    data = after()
    if len(data) != size:
        raise RuntimeError(f"{path}: {len(data)} bytes after a copy, expected {size}")
    return data


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


class HashingFile:
    """A binary file that hashes what is written to it (for manifests): blocks as they are written,
    bytes copied by the kernel (`copy_ranges`) as they are read back.

    `expected_size` (when the caller knows the file's size in advance) is checked against the free
    space first, so a full disk is refused before anything is written. A full disk (ENOSPC, or an
    exhausted quota) while writing becomes a one-line NoSpaceError. `abort()` discards the file.
    `digests` (a `digest.Recording`): FAST hashes xxh3-128, SHA256 sha256 too, NONE nothing (for
    files no manifest will list: the record's digests are None). With `direct`, the bytes are
    written around the page cache (`DirectFile`). Once closed, the file is handed to `sink`, the
    output's (`io.safety.sinks`: an output bound for object storage starts its upload)."""

    def __init__(
        self,
        path: Path,
        root: Path,
        expected_size: int | None = None,
        digests: Recording = Recording.FAST,
        direct: bool = False,
        sink: Sink = NO_SINK,
    ):
        from ...paths import ensure_free_space

        self.path = Path(path)
        self.root = Path(root)
        self.sink = sink
        self.expected_size = expected_size
        self._fh: io.BufferedRandom | DirectFile | None = None
        self._behind: collections.deque[_HashJob | _CopyJob] = collections.deque()  # written, not yet hashed
        self._behind_bytes = 0
        self._tail = bytearray()  # small writes after the blocks behind: hashed with the next block
        self._writer: _WriteBehind | None = None  # started by the first large owned block
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if expected_size is not None:
            try:  # the file this one replaces frees its blocks (unless linked elsewhere too)
                old = os.lstat(self.path)
                replaced = old.st_size if stat.S_ISREG(old.st_mode) and old.st_nlink == 1 else 0
            except OSError:
                replaced = 0
            ensure_free_space(self.path.parent, expected_size, replaced)
        try:  # a new file, never written through: an old one (or a link to a source) is replaced, not truncated
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._fh = (
            DirectFile(self.path) if direct else open(self.path, "xb+")
        )  # read too: copied ranges are read back (copy_ranges)
        st = os.fstat(self._fh.fileno())
        self._identity = (st.st_dev, st.st_ino)
        self._hash = Digests(sha256=digests == Recording.SHA256) if digests else None
        self.size = 0
        self._reserved = 0
        if expected_size:
            try:
                self._reserved = expected_size if preallocate(self._fh.fileno(), expected_size) else 0
            except OSError as e:
                self.abort()
                raise self._failed(e) from None

    @property
    def _file(self) -> io.BufferedRandom | DirectFile:
        """The open file; ValueError once closed or aborted (as a closed file object raises)."""
        if self._fh is None:
            raise ValueError(f"{self.path}: the file is closed or was aborted")
        return self._fh

    def _failed(self, error: OSError, pending: int = 0) -> Exception:
        import errno

        from ...paths import no_space_error

        if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            needed = self.expected_size if self.expected_size is not None else self.size + pending
            return no_space_error(self.path.parent, needed)
        return error

    def write(self, data: Any) -> int:
        """Write `data`; its bytes are hashed before this returns (the caller may reuse them)."""
        return self._write(memoryview(data).cast("B"), None)

    def write_owned(self, data: Any, owner: object) -> int:
        """Write `data`, whose bytes `owner` keeps alive and nobody changes any more: a large block
        may still be hashed after this returns (by the file's write-behind thread, as it writes
        it), while the caller reads and writes the next one. At most HASH_BEHIND bytes per file
        wait so; `close` waits for all."""
        return self._write(memoryview(data).cast("B"), owner)

    def _write(self, view: memoryview, owner: object) -> int:
        if self._hash is None:
            try:
                self._put(view, owner)
            except OSError as e:
                raise self._failed(e, len(view)) from None
            self.size += len(view)
            return len(view)
        behind = self._behind
        job = None
        tailed = False
        if len(view) >= PARALLEL_HASH_MIN or (owner is not None and len(view) >= BEHIND_MIN):
            prefix = bytes(self._tail) if self._tail else None
            self._tail.clear()
            job = _HashJob(self._hash, view, owner, behind[-1] if behind else None, prefix)
            if owner is None:  # written here: the helper hashes it meanwhile
                _HASHER.submit(job)
            # else written behind (`_put`), and hashed by the write-behind thread right after
        elif behind:  # blocks before it are still being hashed: a copy follows them (see _settle)
            self._tail += view
            tailed = True
        try:
            self._put(view, owner, job)
        except OSError as e:
            self._settle(job, -1)  # never return while the helper may still read `data`
            raise self._failed(e, len(view)) from None
        except BaseException:
            self._settle(job, -1)
            raise
        if job is None:
            if not tailed:
                self._hash.update(view)
            elif len(self._tail) > TAIL_MAX:  # the blocks before take long (copies): bound the copy
                self._settle(None, -1)
        else:
            self._settle(job, HASH_BEHIND if owner is not None else -1)
        self.size += len(view)
        return len(view)

    def _put(self, view: memoryview, owner: object, job: _HashJob | None = None) -> None:
        """Write `view`: a large owned block by the write-behind thread (which then hashes it,
        `job`, unless the caller has by then); anything else in this thread, or (a copy) behind
        the blocks still queued, so the file keeps its order."""
        writer = self._writer
        if writer is not None and writer.error is not None:
            raise writer.error
        if owner is not None and len(view) >= BEHIND_MIN:
            if writer is None:
                writer = self._writer = _WriteBehind(self._file)
            writer.put(view, owner, job)
        elif writer is not None and writer.pending:
            if len(view) >= PARALLEL_HASH_MIN:  # the caller may reuse its bytes: wait, then write here
                self._drain()
                self._write_now(view)
            else:
                writer.put(memoryview(bytes(view)), None)
        else:
            self._write_now(view)

    def _write_now(self, view: memoryview) -> None:
        fh = self._file
        if len(view) <= WRITE_BLOCK:
            fh.write(view)
        else:
            for start in range(0, len(view), WRITE_BLOCK):
                fh.write(view[start : start + WRITE_BLOCK])

    def _drain(self) -> None:
        """Wait for the queued writes; raise the first one's error."""
        if self._writer is not None and (error := self._writer.drain()) is not None:
            raise error

    def _settle(self, job: _HashJob | _CopyJob | None, limit: int) -> None:
        """Queue `job` behind the file's earlier blocks, then hash (or wait for) the oldest blocks
        until at most `limit` bytes are left unhashed (-1: all of them)."""
        behind = self._behind
        if job is not None:
            behind.append(job)
            self._behind_bytes += job.size
        while behind and (self._behind_bytes > limit or behind[0].done.is_set()):
            oldest = behind.popleft()
            self._behind_bytes -= oldest.size
            oldest.finish()
        # every block is hashed: the small writes after them follow (only hashing files have a tail)
        if limit < 0 and self._tail and self._hash is not None:
            self._hash.update(self._tail)
            self._tail.clear()

    def copy_ranges(
        self,
        ranges: Iterable[FileRange],
        seen: Callable[[memoryview], None] | None = None,
        after: Callable[[], bytes] | None = None,
        after_size: int = 0,
    ) -> int:
        """Append the bytes of source `ranges`, one after another, copied by the kernel
        (`kernel_copy`): one copy from page cache to page cache, where writing them from this
        process's memory is a second copy, and on a VM the dearer one. The file's write-behind
        thread copies them while the caller prepares what comes next. What needs the bytes (the
        file's digests, `seen`: a CRC32, and the sources' checks on read) gets them one of two
        ways. When every source is checked or watched (`OpenFile.watched`), the caller reads them here,
        once, for all three (`_read_copied`): the worker waits for the write-behind threads most of
        the time, and the copy then reads nothing back; a source written to between that read and
        the copy is refused by its check or its stamp. Otherwise the sources' checks are fed here (`_feed_taps`), and the
        write-behind thread reads each copied block back while it is still in the CPU's cache for
        the digests and `seen`, so that these describe the bytes the file holds, whatever happens
        to the source meanwhile. Then `after()` (`after_size` bytes, computed once the bytes are
        seen: a zip record's data descriptor) is written. Around the page cache (`DirectFile`),
        the bytes are read and written here instead. The ranges are taken in this thread (each
        waits for the read-ahead), and each source is kept open until it is copied. Returns the
        bytes of `ranges`."""
        sources = list(ranges)
        total = sum(source.length for source in sources)
        fh = self._file
        if isinstance(fh, DirectFile):
            view = _COPY_BUFFER.view
            for source in sources:
                tap = source.file.tap
                for start in range(0, source.length, COPY_BLOCK):
                    block = view[: min(COPY_BLOCK, source.length - start)]
                    read_exact(source.fd, block, source.offset + start, source.what, source.file.fetcher)
                    self.write(block)
                    if seen is not None:
                        seen(block)
                    if tap is not None:
                        tap(source.file, source.offset + start, block)
            if after is not None:
                self.write(_after_bytes(after, after_size, self.path))
            return total
        writer = self._writer
        if writer is None:
            writer = self._writer = _WriteBehind(fh)
        # The worker has time to spare while the write-behind threads (the busier ones) copy:
        # the sources' checks are fed here, and when every source is checked or watched, the
        # file's digest and `seen` too, so that the copy reads nothing back.
        needed = self._hash is not None or seen is not None  # else only the checks want the bytes
        inline = (
            needed
            and all(source.file.tap is not None or source.file.watched for source in sources)
            and (self._hash is None or self._hash.sha256 is None)  # sha256 would slow the worker: hashed behind
        )
        if inline:
            data = self._read_copied(sources, seen, after, after_size)
            seen, after = None, (functools.partial(bytes, data) if data is not None else None)
        else:
            _feed_taps(sources)
        held: list[FileRange] = []
        try:  # the reader may close its descriptor before the copy runs: the job keeps its own
            for source in sources:
                dup = OpenFile(os.dup(source.fd), source.file.fetcher)  # (its bytes still fetched by the mirror)
                held.append(FileRange(dup, source.offset, source.length, source.what))
        except BaseException:
            for source in held:
                source.file.close()
            raise
        behind = self._behind
        prefix = None
        if self._hash is not None and self._tail and not inline:
            prefix = bytes(self._tail)
            self._tail.clear()
        digest = None if inline else self._hash
        job = _CopyJob(
            held, self.size, self.path, digest, behind[-1] if behind else None, prefix, seen, after, after_size
        )
        if digest is not None:
            self._settle(job, HASH_BEHIND)  # later blocks are hashed after it
        try:
            writer.put(job, total + after_size)
        except OSError as e:
            job.cancel()
            raise self._failed(e, total) from None
        except BaseException:
            job.cancel()
            raise
        self.size += total + after_size
        return total

    def _read_copied(
        self,
        sources: Sequence[FileRange],
        seen: Callable[[memoryview], None] | None,
        after: Callable[[], bytes] | None,
        after_size: int,
    ) -> bytes | None:
        """Read the bytes of `sources` in this thread (each checked or watched), for their checks,
        the file's digest (after the blocks before them) and `seen`; then `after()`, hashed too.
        The copy of the same bytes by the kernel then reads nothing back. A source written to
        between this read and the copy is refused by its check or its stamp."""
        digest = self._hash
        if digest is not None:
            self._settle(None, -1)  # the file's bytes before these are hashed first

        def every(block: memoryview) -> None:
            if digest is not None:
                digest.update(block)
            if seen is not None:
                seen(block)

        _feed_taps(sources, every)
        if after is None:
            return None
        data = _after_bytes(after, after_size, self.path)
        if self._hash is not None:
            self._hash.update(data)
        return data

    def flush(self) -> None:
        try:
            self._drain()
            self._file.flush()
        except OSError as e:
            raise self._failed(e) from None

    def close(self, fsync: bool = False) -> FileRecord:
        self._settle(None, -1)
        try:
            fh = self._file
            self._drain()
            if self._writer is not None:
                self._writer.stop()
                self._writer = None
            fh.flush()
            size = os.fstat(fh.fileno()).st_size if self._reserved else 0
            if self._reserved > size:  # blocks reserved past the end (`expected_size` is a bound) are freed
                os.ftruncate(fh.fileno(), size)
            if fsync:
                os.fsync(fh.fileno())
            fh.close()
        except OSError as e:
            raise self._failed(e) from None
        digests = self._hash.hexdigests() if self._hash is not None else (None, None)
        blocks = self._hash.block_digests() if self._hash is not None else None
        self.sink.closed(self.path)  # an output bound for object storage starts its upload now
        return FileRecord(self.path.relative_to(self.root).as_posix(), self.size, digests[0], digests[1], blocks)

    def abort(self) -> None:
        """Close and delete the file, if the path still names the file this object created (a
        retry may have written a new one there since). Never raises an OSError."""
        fh, self._fh = self._fh, None
        while self._behind:  # the helper must not be left holding (and later freeing) the caller's blocks
            self._behind.popleft().cancel()
        self._behind_bytes = 0
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.stop(cancel=True)  # the queued blocks are dropped; the file is deleted below
        if fh is None:
            return
        try:
            if isinstance(fh, DirectFile):
                fh.abandon()
            else:
                fh.close()  # a failing flush of the last buffered bytes still closes the descriptor
        except (OSError, ValueError):
            pass
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
                import logging

                logging.getLogger(__name__).info("removed the unfinished file %s", self.path)
        except OSError:
            pass
