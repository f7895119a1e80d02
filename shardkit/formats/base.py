"""The protocol every tensor-file backend follows, and helpers they share .

Raw tensor bytes are read and written in the machine's byte order without swapping; every file
format here is little-endian, so `tensor_bytes` refuses to run on a big-endian machine rather
than write wrong bytes.

A backend reads one file lazily (`TensorFile`: names, shapes, dtypes, and slices on demand) and
writes one file as tensors arrive (`TensorFileWriter`), reporting the files it produced with
their sizes and digests: hashed while writing, except for bytes the kernel copies file to file
(`HashingFile.copy_ranges`), which are read back a block at a time as they are copied.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import fcntl
import functools
import math
import mmap
import os
import queue
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from ..errors import FormatError
from .digest import Digests, Recording

if TYPE_CHECKING:
    import io

    import numpy

DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: name, shape and dtype, known before its data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


@dataclass(frozen=True)
class FileRecord:
    """A file written: path relative to the output directory, size, sha256 and the fast digest
    (xxh3-128). Both are None for files written without digests (outputs no manifest lists, such
    as a merged Hugging Face folder's); sha256 alone is None unless asked for (see `digest`), and
    xxh3-128 alone in records of older manifests."""

    path: str
    size: int
    sha256: str | None
    xxh3_128: str | None = None


class TensorFile(Protocol):
    """A lazily read tensor file."""

    path: Path

    def keys(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor: ...

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows [start, stop) straight into `out`; False when the stored layout does not allow it
        (the caller then uses `read`)."""
        ...

    def close(self) -> None: ...


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


class TensorFileWriter(Protocol):
    """Writes one rank file; `write` is called once per spec, in spec order. Formats whose
    registry entry says `chunked_writes` also take a tensor as row blocks (`write_chunks`)."""

    def write(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        """Write the next tensor. `owned`: the caller hands the tensor over and never changes it
        afterwards, so its bytes may still be hashed after this returns (the writer keeps it alive
        until then); otherwise they are hashed before this returns."""
        ...

    def close(self, fsync: bool = False) -> list[FileRecord]: ...

    def abort(self) -> None:
        """Give up the file: close and delete it (safe to call more than once)."""
        ...


class ChunkedWriter(TensorFileWriter, Protocol):
    """A writer of a format whose registry entry says `chunked_writes`: it also takes a tensor as
    consecutive blocks of rows, without the tensor ever being assembled."""

    def write_chunks(self, name: str, chunks: Iterable[torch.Tensor], owned: bool = False) -> None: ...


class RowBlocks:
    """A matrix being written as blocks of rows (`RowStreamingWriter.begin_rows`) by `writer`:
    each block is checked against `spec` and its bytes handed to `put(bytes, owner)`; `done()`
    runs after the last. A failure gives the whole file up (the writer's `_discarding`)."""

    def __init__(
        self,
        writer: DiscardOnFailure,
        spec: TensorSpec,
        put: Callable[[memoryview, torch.Tensor], None],
        done: Callable[[], None],
    ):
        self._writer, self._spec, self._put, self._done = writer, spec, put, done
        self.written = 0
        writer._rows = self  # until `end`: the writer takes no other tensor (see `check_no_rows`)

    def add(self, rows: torch.Tensor) -> None:
        """The next rows (handed over: never changed afterwards)."""
        spec = self._spec
        with self._writer._discarding():
            if rows.dtype != spec.dtype or rows.dim() != 2 or rows.shape[1] != spec.shape[1]:
                raise RuntimeError(f"{spec.name}: rows {tuple(rows.shape)} {rows.dtype} do not fit {spec}")
            rows = compact(rows.detach())
            data = tensor_bytes(rows)
            if self.written + len(data) > spec.nbytes:
                raise RuntimeError(f"{spec.name}: more rows than its {spec.shape[0]}")
            self._put(data, rows)
            self.written += len(data)

    def end(self) -> None:
        """After the last rows (RuntimeError when rows are missing)."""
        with self._writer._discarding():
            if self.written != self._spec.nbytes:
                raise RuntimeError(f"{self._spec.name}: {self.written} of its {self._spec.nbytes} bytes written")
            self._writer._rows = None
            self._done()


class RowStreamingWriter(TensorFileWriter, Protocol):
    """A writer that also takes a matrix as blocks of rows handed over one at a time, with other
    files written in between (`begin_rows`), when `streams_rows` says it can."""

    @property
    def streams_rows(self) -> bool: ...

    def begin_rows(self, name: str) -> RowBlocks: ...


class CopyingWriter(TensorFileWriter, Protocol):
    """A writer that also takes a tensor as byte ranges of source files, copied by the kernel
    (`HashingFile.copy_ranges`), when `copies` says it can (formats that store a tensor's bytes as
    they are, in one run)."""

    copies: bool

    def write_copy(self, name: str, ranges: Iterable[FileRange]) -> None:
        """Write the next tensor, whose bytes are `ranges`' bytes one after another."""
        ...


class DiscardOnFailure:
    """What every streaming writer does with failure: any failure inside its own steps
    (`_discarding`) or leaving a `with` block on an exception aborts the file, and a writer
    abandoned unfinished is aborted when it is collected (never finished by a destructor, as
    torch's zip writer would)."""

    _rows: RowBlocks | None = None  # a matrix being written in blocks of rows (`RowBlocks`)

    def abort(self) -> None:
        raise NotImplementedError

    def _unfinished(self) -> bool:
        raise NotImplementedError

    def check_no_rows(self) -> None:
        """Refuse another tensor while a matrix's blocks of rows are still coming."""
        if self._rows is not None:
            raise RuntimeError(f"the rows of {self._rows._spec.name} are not all written yet")

    @contextlib.contextmanager
    def _discarding(self) -> Iterator[None]:
        """Run a step of the writer; any failure in it (Ctrl-C included) aborts the file first,
        then propagates."""
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self.abort()

    def __del__(self) -> None:
        try:
            if self._unfinished():
                self.abort()
        except Exception:  # noqa: BLE001 - at interpreter exit modules may be half gone
            pass


WRITE_BLOCK = 256 << 10
"""Large blocks are written in pieces of at most this size: larger writes cost several times the CPU
in the kernel's copy into the page cache. The likely cause: the page cache sizes its folios by the
write, and large folios come from the high-order free blocks that a VM's balloon driver hands back
to the host (free page reporting) or that need compaction, so their first touch costs a host fault
or a compaction. Measured on this project's VM, one new 2.2 GB file right after a cache drop: 0.5
CPU-s in 256-512 KiB writes, 1.1-3.8 in 1 MiB writes, 3.3-3.4 in 4 MiB writes; 16 files of the
same total: 0.54-0.61 (256 KiB) and 0.69-0.71 (1 MiB). A cold merge of TinyLlama (one 2.2 GB
output file) went from 2.9 s to 1.6 s. Below 256 KiB the per-call cost shows (128 KiB: 0.66-0.76)."""

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
`engine.executor.lockstep_groups`) each have a queue, and their write-behind threads run at once.
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
                os.close(source.fd)
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
                    got = kernel_copy(source.fd, source.offset + start + moved, out, n - moved)
                    if got is None:  # not between these files: read and write from here on
                        by_kernel = False
                    elif got == 0:
                        raise FormatError(f"{source.what} is truncated: re-create it")
                    else:
                        moved += got
                if moved < n:  # the block's rest (all of it where the kernel does not copy)
                    read_exact(source.fd, block, source.offset + start, source.what)
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


def _after_bytes(after: Callable[[], bytes], size: int, path: Path) -> bytes:
    """What `after()` gives to write behind a copy, of the `size` promised."""
    data = after()
    if len(data) != size:
        raise RuntimeError(f"{path}: {len(data)} bytes after a copy, expected {size}")
    return data


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


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

    Why: copying into the page cache costs 0.25-2.5 CPU-s per GB here (fresh page-cache memory is
    costly on a VM), and past the kernel's dirty limit the writer waits for the disk anyway;
    from an aligned buffer the cost is one copy into it (~0.1 CPU-s per GB) and the device's
    time. The same interface as the buffered file HashingFile otherwise writes through: write,
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
    skip the delayed allocation's per-page bookkeeping; measured here, 2.2 GB written in 256 KiB
    blocks took 0.32-0.33 CPU-s reserved against 0.46-0.52 not, and copied by copy_file_range
    0.17 against 0.23. Blocks reserved past what is written are freed by truncating the file to
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


class HashingFile:
    """A binary file that hashes what is written to it (for manifests): blocks as they are written,
    bytes copied by the kernel (`copy_ranges`) as they are read back.

    `expected_size` (when the caller knows the file's size in advance) is checked against the free
    space first, so a full disk is refused before anything is written. A full disk (ENOSPC, or an
    exhausted quota) while writing becomes a one-line NoSpaceError. `abort()` discards the file.
    `digests` (a `digest.Recording`): True hashes xxh3-128, "sha256" sha256 too, False nothing (for
    files no manifest will list: the record's digests are None). With `direct`, the bytes are
    written around the page cache (`DirectFile`)."""

    def __init__(
        self,
        path: Path,
        root: Path,
        expected_size: int | None = None,
        digests: Recording = True,
        direct: bool = False,
    ):
        from ..paths import ensure_free_space

        self.path = Path(path)
        self.root = Path(root)
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
        self._hash = Digests(sha256=digests == "sha256") if digests else None
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

        from ..paths import no_space_error

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
        ways. When every source is checked or watched (`_WATCHED`), the caller reads them here,
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
                tap = _TAPS.get(source.fd)
                for start in range(0, source.length, COPY_BLOCK):
                    block = view[: min(COPY_BLOCK, source.length - start)]
                    read_exact(source.fd, block, source.offset + start, source.what)
                    self.write(block)
                    if seen is not None:
                        seen(block)
                    if tap is not None:
                        tap(source.fd, source.offset + start, block)
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
            and all(source.fd in _TAPS or source.fd in _WATCHED for source in sources)
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
                held.append(FileRange(os.dup(source.fd), source.offset, source.length, source.what))
        except BaseException:
            for source in held:
                os.close(source.fd)
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
        return FileRecord(self.path.relative_to(self.root).as_posix(), self.size, *digests)

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


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (little-endian: the machine's order, checked), without copying
    when it is contiguous."""
    if sys.byteorder != "little":
        raise RuntimeError(
            "shardkit writes little-endian files and does not byte-swap: run it on a little-endian machine"
        )
    flat = tensor.detach().contiguous().reshape(-1)
    return array_view(flat.view(torch.uint8).numpy())


def array_view(array: numpy.ndarray) -> memoryview:
    """A memoryview of a numpy array's memory (arrays are buffers; numpy's stubs do not say so
    before Python 3.12)."""
    return memoryview(cast(Any, array))


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns exactly its bytes (a view would drag its whole storage into
    torch.save files and keep source pages alive)."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's elements sit in a file: byte offset of its storage, element offset,
    shape and stride (row-major when `stride` is None)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    file_offset: int
    storage_offset: int = 0
    stride: tuple[int, ...] | None = None

    def strides(self) -> tuple[int, ...]:
        if self.stride is not None:
            return self.stride
        out, step = [], 1
        for size in reversed(self.shape):
            out.append(step)
            step *= size
        return tuple(reversed(out))

    def numel(self) -> int:
        return math.prod(self.shape)


STRIDED_READ_CHUNK = 4 << 20  # bytes read at once for a slice along a dimension other than the first


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
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise FormatError(f"{what} is truncated: re-create it")
        done += got


@dataclass(frozen=True)
class FileRange:
    """Bytes of an open source file that go into an output unchanged: `length` bytes at `offset` of
    descriptor `fd` (`what` names the file in errors). Written by the kernel's copy
    (`HashingFile.copy_ranges`), not through this process's memory."""

    fd: int
    offset: int
    length: int
    what: str


def stored_range(
    fd: int, t: StoredTensor, dim: int, start: int | None, stop: int | None, what: str
) -> FileRange | None:
    """The file bytes of a slice of a stored tensor, when they are the slice's bytes in order (the
    whole of a row-major tensor, or a block of its rows) and no read-ahead buffer serves them
    (`DescriptorReader.read_from`): the kernel can then copy the slice. None otherwise."""
    if fd in _SOURCES or not t.shape:
        return None
    shape = list(t.shape)
    start = 0 if start is None else start
    stop = shape[dim] if stop is None else stop
    sub = shape.copy()
    sub[dim] = stop - start
    if 0 in sub or list(t.strides()) != list(StoredTensor(t.dtype, tuple(sub), 0).strides()):
        return None  # (row-major strides of the slice's own shape: its bytes are one run, in order)
    offset, length = cast(tuple[int, int], stored_span(t, dim, start, stop))
    return FileRange(fd, offset, length, what)


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


class _Buffers(threading.local):
    """This thread's pool of read buffers (see `reused_buffers`)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pool: list[bytearray] = []


_BUFFERS = _Buffers()
POOLED_BUFFERS = 4
"""Read buffers kept per thread inside `reused_buffers`."""
POOLED_MIN = 1 << 20
"""Smaller reads always get fresh memory (the allocator reuses small blocks by itself)."""
POOLED_BYTES = 64 << 20
"""At most this many bytes of buffers kept per thread (larger reads get fresh memory): the pool
never holds more than the reads of one or two tensors would anyway."""


@contextlib.contextmanager
def _thread_scope(state: Any, release: Callable[[], None]) -> Iterator[None]:
    """A block that may nest in one thread (`state.depth` counts them); `release()` once the
    outermost one ends."""
    state.depth += 1
    try:
        yield
    finally:
        state.depth -= 1
        if state.depth == 0:
            release()


@contextlib.contextmanager
def reused_buffers() -> Iterator[None]:
    """In this thread, until the block ends, reads take their memory from a few buffers kept for
    reuse instead of fresh memory: fresh memory costs a page fault and the zeroing of every page
    on its first touch (about as much CPU as the read's copy itself). A buffer is handed out again
    only once no tensor, view or memoryview of its previous use is alive (Python counts the
    references `torch.frombuffer` tensors hold), so a tensor kept by its caller is never
    overwritten: the pool then simply allocates. At most POOLED_BUFFERS buffers are kept per
    thread; they are released when the outermost block ends."""
    with _thread_scope(_BUFFERS, _BUFFERS.pool.clear):
        yield


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of nbytes: from this thread's pool inside `reused_buffers`."""
    pool = _BUFFERS.pool
    if _BUFFERS.depth == 0 or nbytes < POOLED_MIN or nbytes > POOLED_BYTES // 2:
        return torch.empty(nbytes, dtype=torch.uint8)
    best = spare = None
    for i in range(len(pool)):
        if sys.getrefcount(pool[i]) > 2:  # the list's reference and getrefcount's own: else in use
            continue
        size = len(pool[i])
        if size >= nbytes and (best is None or size < len(pool[best])):
            best = i
        elif size < nbytes and (spare is None or size < len(pool[spare])):
            spare = i
    if best is None:
        kept = sum(len(b) for b in pool)
        if len(pool) < POOLED_BUFFERS and kept + nbytes <= POOLED_BYTES:
            pool.append(bytearray(nbytes))
            best = len(pool) - 1
        elif spare is not None and kept - len(pool[spare]) + nbytes <= POOLED_BYTES:
            pool[spare] = bytearray(nbytes)  # the smallest free buffer makes way for a larger one
            best = spare
        else:
            return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(pool[best], dtype=torch.uint8, count=nbytes)


def empty_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) (contiguous), from this thread's pool inside `reused_buffers`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if _BUFFERS.depth == 0 or nbytes < POOLED_MIN:
        return torch.empty(shape, dtype=dtype)
    return empty_bytes(nbytes).view(dtype).reshape(shape)


def pread_into(fd: int, nbytes: int, offset: int, what: str) -> torch.Tensor:
    """Read exactly nbytes at offset into a new uint8 tensor. The buffer is not zero-filled first."""
    buf = empty_bytes(nbytes)
    pread_exact(fd, array_view(buf.numpy()), offset, what)
    return buf


def read_stored(fd: int, t: StoredTensor, dim: int, start: int | None, stop: int | None, what: str) -> torch.Tensor:
    """Read [start, stop) along dim of a stored tensor with positional reads: only the bytes the
    slice spans are read, and the result owns its memory (nothing stays mapped)."""
    shape, stride, item = list(t.shape), list(t.strides()), t.dtype.itemsize
    if not shape:
        buf = pread_into(fd, item, t.file_offset + t.storage_offset * item, what)
        return buf.view(t.dtype).reshape(())
    start = 0 if start is None else start
    stop = shape[dim] if stop is None else stop
    out_shape = shape.copy()
    out_shape[dim] = stop - start
    if 0 in out_shape:
        return torch.empty(out_shape, dtype=t.dtype)
    extent = 1 + sum((n - 1) * st for n, st in zip(out_shape, stride))
    row_major = stride == list(StoredTensor(t.dtype, t.shape, 0).strides())
    whole = start == 0 and stop == shape[dim]  # then one contiguous read, whatever the dim
    if dim > 0 and row_major and not whole and shape[0] > 1 and extent * item > STRIDED_READ_CHUNK:
        # A column block of a large row-major tensor spans (nearly) all of its bytes, of which it
        # needs only a part (1/8 for tp 8): copied out of a mapping of the file, so that only the
        # bytes of the block are copied (reading the span copied all of it, once per rank). The
        # files built together cut their blocks from rows read once instead (`read_block`).
        out = empty_tensor(out_shape, t.dtype)
        _copy_columns(fd, t, dim, start, out, what)
        return out
    view = _read_span(fd, t, dim, start, stop, what)
    return view if view.is_contiguous() else _copy(view)


MAP_WINDOW = 32 << 20
"""At most this many bytes of a file are mapped at once by `_copy_columns`."""


def _copy_columns(fd: int, t: StoredTensor, dim: int, start: int, out: torch.Tensor, what: str) -> None:
    """Fill `out` (contiguous) with the block of a row-major stored tensor that starts at `start`
    along `dim` > 0, copying just its bytes out of a private read-only mapping of the file, a window
    of rows at a time (mapped pages count as resident while mapped: at most MAP_WINDOW bytes)."""
    import mmap

    import numpy

    shape, stride, item = list(t.shape), list(t.strides()), t.dtype.itemsize
    out_shape = list(out.shape)
    target = out.view(torch.uint8).numpy().reshape(*out_shape, item)
    file_size = os.fstat(fd).st_size
    rows = max(1, MAP_WINDOW // (stride[0] * item))
    for r0 in range(0, shape[0], rows):
        r1 = min(shape[0], r0 + rows)
        sub_shape = [r1 - r0, *out_shape[1:]]
        first = t.file_offset + (t.storage_offset + r0 * stride[0] + start * stride[dim]) * item
        end = first + (1 + sum((n - 1) * st for n, st in zip(sub_shape, stride))) * item
        if end > file_size:  # a mapping past the end of the file would fault (SIGBUS) when touched
            raise FormatError(f"{what} is truncated: re-create it")
        base = first - first % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(fd, end - base, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ, offset=base)
        try:
            data = numpy.frombuffer(mapping, dtype=numpy.uint8, offset=first - base)
            block = numpy.lib.stride_tricks.as_strided(
                data, shape=(*sub_shape, item), strides=(*(s * item for s in stride), 1), writeable=False
            )
            numpy.copyto(target[r0:r1], block)
            del data, block  # the buffer exports end before the mapping is closed
        finally:
            try:
                mapping.close()
            except BufferError:  # still exported after a failure: unmapped when collected
                pass


SHARED_WINDOW = 8 << 20
"""About this many bytes of rows are read at once for the blocks of columns the files of a group
cut from them, and at most this many are kept (`read_block`, `shared_column_reads`): a block that
joins the columns of several source pieces takes a window of each, of this size together."""


class _SharedRows(threading.local):
    """This thread's windows of rows kept for blocks of columns (see `shared_column_reads`)."""

    def __init__(self) -> None:
        self.depth = 0
        self.windows: collections.OrderedDict[tuple[int, int, int, int], bytearray] = collections.OrderedDict()


_SHARED = _SharedRows()


@contextlib.contextmanager
def shared_column_reads() -> Iterator[None]:
    """In this thread, until the block ends, the rows `read_block` reads are kept (the last
    SHARED_WINDOW bytes of them) for the next blocks of columns of the same rows: the files of
    one pipeline stage built together (`engine.executor.lockstep_groups`) each cut their columns
    of a row-parallel weight from the same window of rows in turn, so its bytes are read once for
    all of them, where a mapping per file touches every page of the tensor once per rank. Freed
    when the outermost block ends."""
    with _thread_scope(_SHARED, _SHARED.windows.clear):
        yield


def window_rows(row_bytes: int, block_row_bytes: int) -> int:
    """Rows of a window of rows that take `row_bytes` (the source rows a block of columns is cut
    from; see SHARED_WINDOW), of which one file takes `block_row_bytes`: at least enough for that
    file's block to be BEHIND_MIN (then written and hashed behind the worker, not copied into the
    file's small writes)."""
    least = -(-BEHIND_MIN // max(1, block_row_bytes))
    return max(1, SHARED_WINDOW // max(1, row_bytes), least)


def read_block(
    fd: int, t: StoredTensor, first: int, last: int, start: int, stop: int, out: torch.Tensor, what: str
) -> bool:
    """Fill `out` (last - first rows, stop - start columns; each row contiguous) with that block
    of a 2-D row-major stored tensor, from its rows [first, last) read whole (one positional read,
    which the check on read sees): inside `shared_column_reads` they are kept for the next
    blocks of the same rows. False when the tensor is not a row-major matrix."""
    import numpy

    if (
        len(t.shape) != 2
        or list(t.strides()) != [t.shape[1], 1]
        or not 0 <= first < last <= t.shape[0]
        or not 0 <= start < stop <= t.shape[1]
        or tuple(out.shape) != (last - first, stop - start)
    ):
        return False
    item = t.dtype.itemsize
    row = t.shape[1] * item
    offset, length = t.file_offset + (t.storage_offset + first * t.shape[1]) * item, (last - first) * row
    if _SHARED.depth:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, offset, length)
        windows = _SHARED.windows
        buffer = windows.get(key)
        if buffer is None:
            spare = None
            while windows and sum(len(b) for b in windows.values()) + length > SHARED_WINDOW:
                spare = windows.popitem(last=False)[1]  # the oldest goes before a new one is made
            buffer = spare if spare is not None and len(spare) >= length else bytearray(length)
            del spare
            pread_exact(fd, memoryview(buffer)[:length], offset, what)
            windows[key] = buffer
        else:
            windows.move_to_end(key)
        data = numpy.frombuffer(buffer, dtype=numpy.uint8, count=length)
    else:
        data = empty_bytes(length).numpy()
        pread_exact(fd, array_view(data), offset, what)
    rows = data.reshape(last - first, t.shape[1], item)
    target = out.view(torch.uint8).unflatten(1, (stop - start, item)).numpy()
    numpy.copyto(target, rows[:, start:stop])
    return True


def _copy(view: torch.Tensor) -> torch.Tensor:
    out = empty_tensor(tuple(view.shape), view.dtype)
    out.copy_(view)
    return out


def _read_span(fd: int, t: StoredTensor, dim: int, start: int | None, stop: int | None, what: str) -> torch.Tensor:
    """[start, stop) along dim of a stored tensor, as a view of a buffer holding the bytes the slice
    spans (contiguous when the slice is a run of whole rows)."""
    shape, stride, item = list(t.shape), list(t.strides()), t.dtype.itemsize
    start = 0 if start is None else start
    stop = shape[dim] if stop is None else stop
    out_shape = shape.copy()
    out_shape[dim] = stop - start
    first = t.storage_offset + start * stride[dim]
    extent = 1 + sum((n - 1) * st for n, st in zip(out_shape, stride))
    buf = pread_into(fd, extent * item, t.file_offset + first * item, what)
    base = buf.view(t.dtype)
    if extent == math.prod(out_shape) and stride == list(StoredTensor(t.dtype, tuple(out_shape), 0).strides()):
        return base.reshape(out_shape)  # a contiguous run of rows: no copy
    return base.as_strided(out_shape, stride)


def stored_span(
    t: StoredTensor, dim: int = 0, start: int | None = None, stop: int | None = None
) -> tuple[int, int] | None:
    """(byte offset, byte count) of the file bytes a slice of a stored tensor spans (the whole
    tensor by default); None when the slice is empty."""
    shape, stride, item = list(t.shape), list(t.strides()), t.dtype.itemsize
    if not shape:
        return t.file_offset + t.storage_offset * item, item
    start = 0 if start is None else start
    stop = shape[dim] if stop is None else stop
    sub = shape.copy()
    sub[dim] = stop - start
    if 0 in sub:
        return None
    extent = 1 + sum((n - 1) * st for n, st in zip(sub, stride))
    return t.file_offset + (t.storage_offset + start * stride[dim]) * item, extent * item


def byte_span(t: StoredTensor) -> tuple[int, int, int]:
    """Where a stored tensor's bytes are, for read-ahead: (byte offset, byte count, rows), where
    `rows` is the number of equal consecutive blocks the bytes split into along dim 0 (the size of
    dim 0 when the tensor is stored row-major without gaps, else 1)."""
    offset, length = stored_span(t) or (t.file_offset, 0)
    contiguous = t.shape and list(t.strides()) == list(StoredTensor(t.dtype, t.shape, 0).strides())
    return offset, length, t.shape[0] if contiguous and t.shape[0] > 0 else 1


def advise_stored(fd: int, t: StoredTensor, dim: int, start: int | None, stop: int | None) -> None:
    """Ask the kernel to start reading the bytes a slice spans (POSIX_FADV_WILLNEED), so that on a
    cold cache the disk works while the caller is still busy with the slice before; a no-op where
    the bytes are cached or the hint is not supported."""
    if not t.shape:
        return
    span = stored_span(t, dim, start, stop)
    if span is None:
        return
    try:
        os.posix_fadvise(fd, span[0], span[1], os.POSIX_FADV_WILLNEED)
    except (AttributeError, OSError):
        pass


def read_rows_into(fd: int, t: StoredTensor, start: int, stop: int, out: torch.Tensor, what: str) -> bool:
    """Read rows [start, stop) of a row-major stored tensor straight into `out` (a contiguous
    tensor of the same dtype and row shape). False when the stored layout does not allow it."""
    stride = list(t.strides())
    row_shape = list(t.shape[1:])
    if (
        not t.shape
        or out.dtype != t.dtype
        or not out.is_contiguous()
        or list(out.shape[1:]) != row_shape
        or stride != list(StoredTensor(t.dtype, tuple(t.shape), 0).strides())
    ):
        return False
    nbytes = out.numel() * out.element_size()
    if out.shape[0] != stop - start:
        return False
    first = t.storage_offset + start * (stride[0] if stride else 1)
    view = array_view(out.view(torch.uint8).reshape(-1).numpy()) if nbytes else memoryview(b"")
    pread_exact(fd, view, t.file_offset + first * t.dtype.itemsize, what)
    return True


def narrow(tensor: torch.Tensor, dim: int, start: int | None, stop: int | None) -> torch.Tensor:
    if start is None and stop is None or tensor.dim() == 0:
        return tensor
    start = 0 if start is None else start
    stop = tensor.shape[dim] if stop is None else stop
    if start == 0 and stop == tensor.shape[dim]:
        return tensor
    return tensor.narrow(dim, start, stop - start)


def check_specs(specs: Sequence[TensorSpec]) -> None:
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in one file")


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from a name or alias (bf16, fp16, fp32, bfloat16, ...); None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise FormatError(f"dtype {dtype!r} is unknown: use one of bf16, fp16, fp32")
    return DTYPE_NAMES[dtype]
