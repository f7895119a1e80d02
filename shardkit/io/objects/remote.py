"""Reading object storage: a remote prefix as a local folder of sparse "mirror" files.

Every reader of shardkit works on local files (positional reads, mappings, kernel copies, zip and
torch.load of small files). A remote prefix is therefore opened as a temporary local folder
holding one sparse file per object, of the object's size, into which byte ranges are fetched
(ranged GETs, `GETS_IN_FLIGHT` at once) before anything reads them:

- when the mirror opens: every small object whole, and every larger file that is not a tensor
  container (tokenizer.json);
- what an operation prepares (`Mirror.prepare`, through `io.store.Store.prepare`: only the files it opens), as it
  needs (`Need`): EVERYTHING (a checked source: a digest needs every byte), METADATA (a safetensors
  header, or a torch zip's head, tail, central directory, local headers and small records:
  `formats.containers`, handed down as a `MetadataPlanner`), PLANNED (an unchecked streamed source: its metadata, then the plan's ranges);
- the tensor spans the engine's plan lists, in order, a bounded window ahead of the read-ahead
  (`Mirror.expect`, called through the source's store by `engine.prefetch.Prefetcher`);
- anything else on demand, before the read: a file opened through its store
  (`io.store.MirrorStore.open`) carries its `MirrorFile` as what fetches its bytes
  (`io.data.copy.Fetcher`: `before` and `after` every positional read, kernel copy and mapping of
  `io.data`), and whole-file hashing and `torch.load` ask the store first (`fetch_whole`). A
  tensor file read as a local file while it has a hole is an internal error (`refuse_unfetched`).

Ranges of one object are joined across holes of at most `HOLE` (64 KiB): a request costs a round
trip, the bytes of a small hole little (small records and zip headers come with their
neighbours); larger holes are bytes the operation skips (other ranks' records, a K/V head's
other replicas), never fetched. Nothing ever reads a hole of the mirror.

Streamed sources (a merge's, read once): see `io.objects.streamed`.

Fetched bytes change a mirror file's mtime and ctime: its store's `stamp` gives the stable
identity the "source changed while read" checks compare instead (every GET is made If-Match the
object's listed ETag, so a replaced object is refused, never mixed). The folder (in this user's
private folder of the system's temporary folder, or a streamed source's of MEMORY_DIR:
`transaction.private_root`) is removed when the mirror closes: by its store, at the end of the
`mirrors_scope` it was opened in (a `MirrorScope`, also on Ctrl-C and SIGTERM), or, opened in no
scope, once nothing refers to it and at exit (removed on SIGTERM too). Closing never waits for a
GET the store does not answer (`io.objects.fetching`); a killed run's mirror goes with the next
run (its owner process is gone). No module holds a table of open mirrors or their files: a mirror
is its scope's or its store's, and messages name its URL from the mirror's own folder (`named`).
A listing is trusted only as far as it can be: a size no object can have is refused, and every
GET checks the object's real size.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Protocol

from ...errors import FormatError, ShardkitError
from ...paths import inside
from ..location import RemoteLocation
from ..safety import transaction
from ..safety.delete import remove_tree
from . import published, s3, scopes
from . import streamed as stream_io
from .fetching import GetPool, Planner, joined, wait_all
from .ranges import Claimed, Ranges, whole_parts

log = logging.getLogger(__name__)

SMALL = 1 << 20
"""Objects up to this size are fetched whole when the mirror opens."""
TENSOR_SUFFIXES = (".safetensors", ".pt", ".bin", ".pth")
PART = s3.PART_SIZE
"""The largest single ranged GET: a larger range is fetched as several GETs in flight."""
HOLE = 64 << 10
"""Wanted ranges of one object at most this far apart are fetched in one GET (the hole too). A
larger hole is bytes the operation skips (another rank's records, a K/V head's other replicas):
not fetched."""
PART_HOLE = 4 << 20
"""A streamed file's metadata ranges this close are taken as one when choosing the whole parts
that hold them (read once anyway: those parts are fetched, not the holes' bytes alone)."""
GETS_IN_FLIGHT = s3.CONCURRENCY
WINDOW = 512 << 20
"""How far (bytes) the planned fetches may run ahead of the bytes readers have asked for."""
STREAM_BUDGET = 384 << 20
"""A streamed source (see "Streamed sources" above) holds at most about this many bytes fetched
or being fetched and not yet read and dropped (more only while readers ask for bytes it has not
reached)."""
PAGE = stream_io.PAGE
MEMORY_DIR = "/dev/shm"
"""Where a streamed source's mirror lives when this is a writable folder whose file system can
punch holes (a memory file system, tmpfs): see "Streamed sources" above."""
MIRROR_PREFIX = "shardkit-s3-"


class Container(Protocol):
    """A file whose metadata a `MetadataPlanner` finds: its name, size, and reads of bytes there."""

    name: str
    size: int

    def pread(self, offset: int, n: int) -> bytes: ...


Fetch = Callable[[Iterable[tuple[Any, list[tuple[int, int]]]]], None]
"""Fetches each file's byte ranges, returning once they are there."""


class MetadataPlanner(Protocol):
    """Where a tensor container's metadata lies: a format's knowledge, handed to the mirror by
    whoever prepares files (`formats.containers.fetch_metadata`), never imported by `io`. It
    fetches (`fetch`) what opening `files` reads, step by step from the bytes each step brought;
    without `tensor_headers` (a streamed file) only the first tensor record's local header."""

    def __call__(self, fetch: Fetch, files: Sequence[Container], tensor_headers: bool = True) -> None: ...


class Need(enum.Enum):
    """What an operation reads of the tensor containers it opens (see the module's docstring)."""

    METADATA = "metadata"
    """Their metadata when opened, then the ranges planned or read."""
    EVERYTHING = "everything"
    """All their bytes (merge, reshard, verify, export: all but a few percent of a source)."""
    PLANNED = "planned"
    """Of a streamed source checked by no digest: its metadata, then the ranges the engine plans
    to read and nothing more (a K/V head's other replicas are not fetched)."""


class MirrorFile:
    """One object's sparse local copy, and which of its bytes are there or on their way."""

    def __init__(self, mirror: Mirror, name: str, path: Path, size: int, etag: str, stored: str = ""):  # noqa: PLR0913
        self.mirror, self.name, self.path, self.size, self.etag = mirror, name, path, size, etag
        self.stored = stored or name  # the object's name under the location (where its bytes are read)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(self.fd, size)
        except (OSError, OverflowError) as e:
            os.close(self.fd)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise s3.RemoteError(
                f"cannot mirror {mirror.loc}/{name}, listed as {size:,} bytes, in the temporary folder: {reason}: "
                "check the object (and the store's listing), or set TMPDIR to a file system that takes a file this large"
            ) from None
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)
        self.fetched = Ranges()
        self.pending = Claimed()  # the parts being fetched, with their futures
        self.lock = threading.Lock()
        self.prepared = False
        self.streamed = False  # see "Streamed sources" above
        self.planned_only = False  # streamed as the engine plans it, nothing more (Need.PLANNED)
        self.once = Ranges()  # bytes the operation's plan reads exactly once
        self.consumed = Ranges()  # of those, the bytes read so far
        self.dropped = Ranges()  # bytes punched out of the file once read (never fetched again but on demand)
        self.blocks: list[str] | None = None  # the block digests it is checked against (see `Mirror.check`)
        self.block_size = 1
        self.verified: set[int] = set()  # blocks checked (their bytes may be dropped once read)
        self.checking: set[int] = set()  # blocks being checked now
        self.later: list[tuple[list[tuple[int, int]], Callable[[int], None]]] = []  # checks before commit
        self.active = 0  # GETs writing into the file now (its descriptor is closed once none is)
        self.failed: ShardkitError | None = None  # a GET's failure: its other GETs are not sent
        self.closed = False

    def _claim(self, start: int, end: int, feeding: bool = False) -> tuple[list[tuple[int, int]], list[Future[int]]]:
        """Under the lock: the parts nobody fetches yet (now claimed) and the fetches to wait for
        (`feeding`: not the bytes already read and dropped)."""
        todo: list[tuple[int, int]] = []
        waits: list[Future[int]] = []
        wanted = self.fetched.missing(start, end)
        if feeding:
            wanted = [r for s, e in wanted for r in self.dropped.missing(s, e)]
        for s, e in wanted:
            covered = Ranges()
            for ps, pe, future in self.pending.overlapping(s, e):
                if future.cancelled():  # given up (the mirror's fetches failed or were interrupted)
                    self.pending.pop(ps, pe)
                else:
                    waits.append(future)
                    covered.add(ps, pe)
            for ms, me in covered.missing(s, e):
                for part in range(ms, me, PART):
                    todo.append((part, min(part + PART, me)))
        return todo, waits

    def fetch_async(self, start: int, end: int, feeding: bool = False) -> list[Future[int]]:
        """Start fetching the missing bytes of [start, end); the futures to wait for."""
        start, end = max(0, start), min(self.size, end)
        if start >= end:
            return []
        with self.lock:
            todo, waits = self._claim(start, end, feeding)
            if self.streamed:
                self.mirror.hold(sum(e - s for s, e in todo))
            for s, e in todo:
                future = self.mirror.pool.submit(self._get, s, e)
                self.pending.add(s, e, future)
                waits.append(future)
        return waits

    def fetch_ranges(self, ranges: Iterable[tuple[int, int]]) -> list[Future[int]]:
        """Start fetching [start, end) ranges, joined across holes under HOLE."""
        return [f for s, e in joined(ranges, HOLE) for f in self.fetch_async(s, e)]

    def pread(self, offset: int, n: int) -> bytes:
        """Bytes already fetched (the metadata steps read only those)."""
        return os.pread(self.fd, max(0, min(n, self.size - offset)), offset)

    def ensure(self, start: int, length: int) -> None:
        """Return once bytes [start, start + length) are in the local file."""
        futures = self.fetch_async(start, start + length)
        if futures and self.streamed:
            self.mirror.order_parts(None)  # bytes read before the engine's plan came: the feeder goes on without it
        for future in futures:
            future.result()

    # -- what a read through the file asks of it (`io.data.copy.Fetcher`, set by `io.store.MirrorStore.open`)

    def before(self, offset: int, length: int) -> None:
        """Before a read of `length` bytes at `offset`: they are fetched first (the planned
        fetches' window moves on)."""
        self.mirror.asked(length)
        self.ensure(offset, length)

    def after(self, offset: int, length: int) -> None:
        """After such a read: a streamed file drops the bytes its plan reads once."""
        if self.streamed:
            self.read_done(offset, offset + length)

    def check_later(self, check: Callable[[int], None], ranges: list[tuple[int, int]]) -> None:
        """Run `check` (given the file's descriptor) once bytes `ranges` are there, before an
        engine run that read the file commits (`Mirror.verified`)."""
        self.later.append((ranges, check))

    @property
    def shown(self) -> str:
        """The file as messages name it: the object it stands for."""
        return f"{self.mirror.loc}/{self.name}"

    def _get(self, start: int, end: int) -> int:
        with self.lock:
            if self.closed or self.failed is not None:
                self.pending.pop(start, end)
                raise self.failed or s3.RemoteError(f"{self.mirror.loc}/{self.name}: the mirror was closed")
            self.active += 1
        try:
            try:
                got = s3.get_range(
                    self.mirror.loc, self.stored, start, end - start, self.etag, self.fd, start, size=self.size
                )
            except ShardkitError as e:  # final (botocore retried what can be): the file's other GETs fail at once
                self.failed = e
                raise
            with self.lock:
                self.fetched.add(start, end)
            self.mirror.count(got)
            if self.blocks is not None:
                self.check_blocks(start, end)
            return got
        finally:
            with self.lock:
                self.pending.pop(start, end)
                self.active -= 1
                last = self.closed and not self.active
            if last:
                os.close(self.fd)

    def check_blocks(self, start: int, end: int) -> None:
        """Check each block touching [start, end) whose bytes have all arrived against its digest;
        a block that matches may drop its bytes once read, one that does not fails the run."""
        import xxhash

        size = self.block_size
        assert self.blocks is not None
        for index in range(start // size, -(-end // size)):
            lo, hi = index * size, min(self.size, (index + 1) * size)
            with self.lock:
                if index in self.verified or index in self.checking or self.fetched.missing(lo, hi):
                    continue
                self.checking.add(index)
            digest = xxhash.xxh3_128()
            view = stream_io.check_buffer()
            got = 0
            while lo + got < hi:
                n = os.preadv(self.fd, [view[: min(len(view), hi - lo - got)]], lo + got)
                if n <= 0:
                    break
                digest.update(view[:n])
                got += n
            with self.lock:
                self.checking.discard(index)
                if got == hi - lo and digest.hexdigest() == self.blocks[index]:
                    self.verified.add(index)
                    self._drop(lo, hi)
                else:
                    self.mirror.mismatch(self.name)
        self.mirror.arrived()

    def read_done(self, start: int, end: int) -> None:
        """A read of [start, end) finished: of a streamed file, the bytes the plan reads once are
        dropped once read and checked."""
        with self.lock:
            for s, e in self.once.within(start, end):
                self.consumed.add(s, e)
            self._drop(start, end)

    def _drop(self, start: int, end: int) -> None:
        """Under the lock: punch out the whole pages near [start, end) that are read and checked."""
        freed = 0
        for cs, ce in self.consumed.within(max(0, start - PAGE), min(self.size, end + PAGE)):
            a = -(-cs // PAGE) * PAGE
            b = ce if ce == self.size else ce - ce % PAGE
            for x, y in [r for c in self._checked(a, b) for r in self.dropped.missing(*c)]:
                if not stream_io.punch(self.fd, x, y - x):
                    self.streamed = False  # bytes are then kept, as in a mirror read whole
                    return
                self.dropped.add(x, y)
                self.fetched.remove(x, y)
                freed += y - x
        if freed:
            self.mirror.release(freed)

    def _checked(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) in blocks already checked (all of it when none are)."""
        if start >= end:
            return []
        if self.blocks is None:
            return [(start, end)]
        size = self.block_size
        out = []
        for index in range(start // size, -(-end // size)):
            if index in self.verified:
                out.append((max(start, index * size), min(end, (index + 1) * size)))
        return out

    def close(self) -> None:
        """Close the file's descriptor, or (while GETs still write into it) let the last one close it."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if self.active:
                return
        with contextlib.suppress(OSError):
            os.close(self.fd)


# ---- a mirror ----------------------------------------------------------------------------------------


class Mirror:
    """A remote prefix as a local folder of sparse files (see the module's docstring)."""

    scope: scopes.MirrorScope | None = None  # its owner (`scopes.adopt`), None when it owns itself

    def __init__(self, loc: RemoteLocation, objects: Sequence[s3.ObjectInfo], streamed: bool = False):
        self.loc = loc
        self.streamed = streamed and stream_io.libc_fallocate() is not None  # bytes read can be given back
        memory = (
            stream_io.memory_dir(MEMORY_DIR, 4 * STREAM_BUDGET, sum(o.size for o in objects)) if self.streamed else None
        )
        self.base = Path(tempfile.mkdtemp(prefix=MIRROR_PREFIX, dir=transaction.private_root(memory)))
        self.root = self.base / (loc.name or loc.bucket)
        self.pool = GetPool(GETS_IN_FLIGHT, "shardkit-s3-get")
        self.files: dict[str, MirrorFile] = {}
        self.by_identity: dict[tuple[int, int], MirrorFile] = {}
        self.bytes_fetched = 0
        self._count_lock = threading.Lock()
        self._planner: Planner | None = None
        self.held = 0  # bytes of streamed files fetched or being fetched, not yet dropped
        self.most_held = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._draining = False
        self._threads: list[threading.Thread] = []
        self._checked: list[MirrorFile] = []  # files checked against block digests
        self._mismatched: list[str] = []
        self._order: list[tuple[MirrorFile, int, int]] | None = None  # the feeder's parts, in order
        self._failure: BaseException | None = None
        try:
            transaction.write_owner(self.base)  # a killed run's mirror is removed by the next (`_remove_stale`)
            self.root.mkdir()
            for obj in objects:
                if published.hidden(obj.name):  # shardkit's bookkeeping (a writing marker, a staged replace)
                    continue
                path = inside(self.root, obj.name, f"object key under {loc}")  # never outside the mirror
                path.parent.mkdir(parents=True, exist_ok=True)
                mf = MirrorFile(self, obj.name, path, obj.size, obj.etag, obj.stored or obj.name)
                self.files[obj.name] = mf
                self.by_identity[mf.identity] = mf
            waits = [f for mf in self.files.values() if not _lazy(mf) for f in mf.fetch_async(0, mf.size)]
            wait_all(waits)
        except BaseException:
            self.close()
            raise

    def count(self, n: int) -> None:
        with self._count_lock:
            self.bytes_fetched += n

    def prepare(self, under: str | Sequence[str], need: Need, metadata: MetadataPlanner) -> None:
        """Fetch what opening the tensor containers under `under` (a relative folder or file, or
        several; "" for all) reads (`metadata`: where it lies), or with Need.EVERYTHING every byte
        of them (see the module's docstring). Several files are prepared together: each step's GETs of all of them in flight."""
        wanted = [under] if isinstance(under, str) else list(under)
        folders = [w.rstrip("/") + "/" for w in wanted]
        chosen = [
            mf
            for name, mf in self.files.items()
            if _lazy(mf) and ("" in wanted or name in wanted or name.startswith(tuple(folders)))
        ]
        if need is not Need.METADATA and self.streamed:
            fresh = [mf for mf in chosen if not mf.streamed]
            fetch = _fetch_all if need is Need.PLANNED else self._fetch_parts
            metadata(fetch, [mf for mf in fresh if not mf.prepared], tensor_headers=False)
            for mf in fresh:
                mf.streamed = True
                mf.planned_only = need is Need.PLANNED
            if fresh:
                self._start(self._feed)
        elif need is Need.EVERYTHING:  # part i of every file, then part i + 1: many objects at once
            parts = max((-(-mf.size // PART) for mf in chosen), default=0)
            wait_all([f for i in range(parts) for mf in chosen for f in mf.fetch_async(i * PART, (i + 1) * PART)])
        else:
            metadata(_fetch_all, [mf for mf in chosen if not mf.prepared])
        for mf in chosen:
            mf.prepared = True

    # -- streamed sources --

    def _fetch_parts(self, wanted: Iterable[tuple[MirrorFile, list[tuple[int, int]]]]) -> None:
        """Streamed files' metadata ranges, fetched as the whole parts holding them while the budget
        allows (the bytes beyond the metadata count against it): the metadata costs no GET of its own."""
        futures: list[Future[int]] = []
        for mf, ranges in wanted:
            exact: list[tuple[int, int]] = []
            for start, end, metadata in whole_parts(joined(ranges, PART_HOLE), mf.size, PART):
                absent = [sum(b - a for a, b in mf.fetched.missing(s, e)) for s, e in [(start, end), *metadata]]
                more = absent[0] - sum(absent[1:])  # bytes still to fetch beyond the metadata
                if self.held + more > STREAM_BUDGET:
                    exact += metadata
                    continue
                self.hold(more)
                futures += mf.fetch_async(start, end)
            futures += mf.fetch_ranges(exact)
        wait_all(futures)

    def hold(self, n: int) -> None:
        with self._cond:
            self.held += n
            self.most_held = max(self.most_held, self.held)

    def release(self, n: int) -> None:
        with self._cond:
            self.held -= n
            self._cond.notify_all()

    def arrived(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _start(self, target: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            try:
                target(*args)
            except BaseException as e:  # noqa: BLE001 - readers fetch on demand; the check reports it
                log.debug("%s stopped: %s", target.__name__, e)
                with self._cond:
                    self._failure = self._failure or e
                    self._cond.notify_all()

        thread = threading.Thread(target=run, name=f"shardkit-s3{target.__name__}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _feed(self) -> None:
        """Fetch every part of the streamed files in the engine's order (`order_parts`) while
        fewer than STREAM_BUDGET bytes are held."""
        with self._cond:
            while self._order is None and not self._stopping:
                self._cond.wait(0.05)
        position = 0
        while True:
            with self._cond:
                order = self._order
                if self._stopping or order is None or position >= len(order):
                    return
                mf, start, end = order[position]
                while (
                    not self._stopping
                    and not self._draining
                    and self.held > 0
                    and self.held + (end - start) > STREAM_BUDGET
                ):
                    self._cond.wait(0.05)
                if self._stopping:
                    return
            mf.fetch_async(start, end, feeding=True)
            position += 1

    def order_parts(self, plan: Sequence[tuple[MirrorFile, int, int]] | None) -> None:
        """Set the feeder's order once: the PART-sized parts of the streamed files in the order
        `plan` ((file, offset, length) ranges) first reads them, then the rest, part i of every
        file before part i + 1 (None: in that order alone). A file prepared with Need.PLANNED is
        fetched as planned, nothing more: its ranges joined across holes under HOLE."""
        with self._cond:
            if self._order is not None:
                return
            seen: set[tuple[MirrorFile, int]] = set()
            order: list[tuple[MirrorFile, int, int]] = []

            def add(mf: MirrorFile, index: int) -> None:
                if (mf, index) not in seen:
                    seen.add((mf, index))
                    order.append((mf, index * PART, min(mf.size, (index + 1) * PART)))

            unchecked: list[list[Any]] = []  # [file, start, end]: a file not checked by blocks, read as planned
            for mf, offset, length in plan or ():
                if mf.planned_only:
                    last = unchecked[-1] if unchecked else None
                    if (
                        last
                        and last[0] is mf
                        and last[2] <= offset <= last[2] + HOLE
                        and offset + length - last[1] <= PART
                    ):
                        last[2] = max(last[2], offset + length)
                    else:
                        unchecked.append([mf, offset, offset + length])
                    continue
                for index in range(offset // PART, -(-(offset + length) // PART)):
                    add(mf, index)
            order += [(mf, start, end) for mf, start, end in unchecked]
            # the rest of every file but those read as planned (of every file when the plan came
            # too late: bytes were read before it)
            streamed = [mf for mf in self.files.values() if mf.streamed and (plan is None or not mf.planned_only)]
            for index in range(max((-(-mf.size // PART) for mf in streamed), default=0)):
                for mf in streamed:
                    if index * PART < mf.size:
                        add(mf, index)
            self._order = order
            self._cond.notify_all()

    def check(self, expected: Mapping[str, Sequence[str]], block_size: int) -> None:
        """Check the streamed files named in `expected` (name -> its block digests, see
        the xxh3-128 of each `block_size` bytes) block by block as they arrive; no byte is dropped before
        its block is checked. `verified` says whether all matched."""
        for name, blocks in expected.items():
            mf = self.files.get(name)
            if mf is None or not mf.streamed:
                continue
            if len(blocks) != -(-mf.size // block_size):
                raise FormatError(
                    f"{self.loc}/{name}: its manifest lists {len(blocks)} block digests for {mf.size} bytes: re-create it"
                )
            with mf.lock:
                mf.blocks, mf.block_size = list(blocks), block_size
            self._checked.append(mf)
            mf.check_blocks(0, mf.size)  # blocks whose bytes came with the metadata

    def mismatch(self, name: str) -> None:
        with self._cond:
            self._mismatched.append(name)
            self._cond.notify_all()

    def verified(self) -> None:
        """Wait until every block `check` was asked for is checked (all are fetched in the end);
        FormatError naming the first file that does not match its digests."""

        def pending() -> bool:
            return any(len(mf.verified) < -(-mf.size // mf.block_size) for mf in self._checked)

        self.order_parts(None)  # (a run that planned nothing: the feeder's own order)
        with self._cond:
            self._draining = True  # the readers are done: the rest is fetched whatever is held
            self._cond.notify_all()
        for thread in self._threads:  # every part asked for (the checks below then find their bytes)
            thread.join()
        for mf in self.files.values():
            for ranges, check in mf.later:  # the torch files' predicted data offsets (formats.torch_zip)
                for start, end in ranges:
                    mf.ensure(start, end - start)
                check(mf.fd)
            mf.later = []
        with self._cond:
            while self._failure is None and not self._mismatched and not self._stopping and pending():
                self._cond.wait(0.1)
            if self._failure is not None:
                raise self._failure
            if self._mismatched:
                raise FormatError(
                    f"{self.loc}/{self._mismatched[0]} does not match the digest its manifest lists: re-create it"
                )

    def expect(self, extents: Sequence[tuple[Path, int, int]], once: Sequence[tuple[Path, int, int]] = ()) -> None:
        """The engine's plan: fetch these (path, offset, length) ranges of this mirror's files in
        order, at most WINDOW bytes ahead of what readers have asked for; of a streamed file,
        note the ranges read exactly once (`once`: dropped once read)."""
        by_path: dict[Path, MirrorFile | None] = {}

        def of(path: Path) -> MirrorFile | None:
            if path not in by_path:
                by_path[path] = self.file_at(path)
            return by_path[path]

        for p, o, n in once:
            found = of(p)
            if found is not None and found.streamed:
                with found.lock:
                    found.once.add(o, o + n)
        mine = [(of(p), o, n) for p, o, n in extents]
        if self.streamed:
            self.order_parts([(mf, o, n) for mf, o, n in mine if mf is not None and mf.streamed])
        planned = [(mf, o, n) for mf, o, n in mine if mf is not None and not mf.streamed]
        if not planned:
            return
        if self._planner is not None:
            self._planner.stop()
        self._planner = Planner(planned, WINDOW, HOLE, PART)

    def file_at(self, path: str | os.PathLike[str]) -> MirrorFile | None:
        """The mirror file `path` is (by device and inode: never by name), if any."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return self.by_identity.get((st.st_dev, st.st_ino))

    def asked(self, n: int) -> None:
        if self._planner is not None:
            self._planner.asked(n)

    def close(self) -> None:
        if self._planner is not None:
            self._planner.stop()
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()
        self.pool.shutdown()  # GETs not started are cancelled; a running one (a hung read) is not waited for
        for mf in self.files.values():
            mf.close()
        with contextlib.suppress(OSError, ShardkitError):
            remove_tree(self.base)
        log.debug("%s: fetched %d bytes, at most %d held at once", self.loc, self.bytes_fetched, self.most_held)


def _lazy(mf: MirrorFile) -> bool:
    """A tensor container too large to fetch whole: only its metadata and the used spans are."""
    return mf.size > SMALL and mf.name.endswith(TENSOR_SUFFIXES)


def _fetch_all(wanted: Iterable[tuple[MirrorFile, list[tuple[int, int]]]]) -> None:
    wait_all([f for mf, ranges in wanted for f in mf.fetch_ranges(ranges)])


# ---- opening, and the hooks every read path calls ------------------------------------------------------


def open_mirror(loc: RemoteLocation, objects: Sequence[s3.ObjectInfo] | None = None, streamed: bool = False) -> Mirror:
    """A new mirror of `loc` (listed now unless `objects` is given), owned by the current
    `scopes.mirrors_scope` (closed when it ends) or, outside any, by itself (removed at exit).
    `streamed`: its tensor containers are read once, by an engine run (see "Streamed sources"
    above)."""
    _remove_stale()
    mirror = Mirror(loc, s3.list_objects(loc) if objects is None else objects, streamed)
    scopes.adopt(mirror)
    return mirror


class Unpredicted(FormatError):
    """A streamed torch file's records are not where their central directory predicted them
    (`check_later`): the operation is to read it again, fetched whole first."""


def close_mirror(mirror: Mirror) -> None:
    """Close `mirror` (its folder removed), before its scope ends."""
    scopes.release(mirror)
    mirror.close()


def _remove_stale() -> None:
    """Remove the mirror folders of this host's runs that no longer run (killed mid-way)."""
    for base in (Path(tempfile.gettempdir()), Path(MEMORY_DIR)):
        for folder, pid in transaction.remove_dead_folders(base, MIRROR_PREFIX):
            log.info("removed %s, the S3 mirror of a run (process %s) that no longer runs", folder, pid)


class ReadWithoutStore(RuntimeError):
    """An internal error: a file of a mirror whose bytes may not all be there read without its
    store (`unfetched`): read as it is, the bytes not fetched yet would read as zeros."""


def _bases_in(text: str) -> set[str]:
    """The mirror folders of this user (in the system's temporary folder or MEMORY_DIR) `text` names."""
    found: set[str] = set()
    for place in (Path(tempfile.gettempdir()), Path(MEMORY_DIR)):
        root = re.escape(str(place / transaction.PRIVATE_ROOT.format(uid=os.getuid())))
        found |= {m.group(0) for m in re.finditer(root + "/" + re.escape(MIRROR_PREFIX) + r"[A-Za-z0-9_]+", text)}
    return found


def unfetched(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a file of one of this user's mirrors with bytes not there: a tensor
    container too large to be fetched as its mirror opened (`_lazy`; every other file of a mirror
    is there whole), in a mirror's folder (MIRROR_PREFIX) of this user's private folder in the
    system's temporary folder or MEMORY_DIR, with a hole (a range never fetched, or dropped once
    read). Such a file is read through its store (`io.store.MirrorStore.open`, `fetch_whole`),
    never as a local file; one fetched whole (`Need.EVERYTHING`) has no hole and reads as one."""
    here = os.path.abspath(path)
    if MIRROR_PREFIX not in here or not here.endswith(TENSOR_SUFFIXES):
        return False
    if not any(here.startswith(base + os.sep) for base in _bases_in(here)):
        return False
    try:
        fd = os.open(here, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False  # (the reader meets the error itself)
    try:
        size = os.fstat(fd).st_size
        return size > SMALL and os.lseek(fd, 0, os.SEEK_HOLE) < size
    except OSError:
        return True  # where no hole can be found, any may be there
    finally:
        os.close(fd)


def refuse_unfetched(path: str | os.PathLike[str]) -> None:
    """ReadWithoutStore when `path` is a mirror's file that may miss bytes (`unfetched`): the
    safety net of every reader of a local file."""
    if unfetched(path):
        raise ReadWithoutStore(
            f"internal error: {path} is a file of an object store's mirror ({scopes.named(path)}) read as a local file, not "
            "through its store: bytes not fetched yet would read as zeros"
        )


def open_prefix(loc: RemoteLocation, *, output: bool = True, streamed: bool = False) -> Mirror:
    """A mirror of `loc` to read from (see `open_mirror`; no tensor container fetched yet: the
    caller prepares the files it reads). `output` (an
    engine source: one output of one run): the objects its record names are read, where it says
    (`published.readable_objects`: the old output while a replace runs, the new one once it is
    committed), and a prefix being written for the first time is refused; a training checkpoint
    root is read whole (its tags say for themselves whether they are complete). An empty or
    absent prefix is a one-line error."""
    objects = s3.list_objects(loc)
    if not objects:
        s3.check_bucket(loc)
        raise FormatError(f"{loc} holds no objects: check the bucket and prefix")
    return open_mirror(loc, published.readable_objects(loc, objects) if output else objects, streamed)
