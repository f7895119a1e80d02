"""Reading object storage: a remote prefix as a local folder of sparse "mirror" files.

Every reader of shardkit works on local files (positional reads, mappings, kernel copies, zip and
torch.load of small files). A remote prefix is therefore opened as a temporary local folder
holding one sparse file per object, of the object's size, into which byte ranges are fetched
(ranged GETs, `GETS_IN_FLIGHT` at once) before anything reads them:

- when the mirror opens: every small object whole, and every larger file that is not a tensor
  container (tokenizer.json);
- when a part of it is prepared (`Mirror.prepare`), as the operation needs (`Need`):
  EVERYTHING (merge, reshard, verify, export, ckpt reshard: they read all but a few percent of the
  source, kv replicas): every byte, in `PART` GETs; METADATA (inspect, load_checkpoint, the
  trainer): a safetensors header, or a torch zip's head and tail, then its central directory,
  local headers and small records (`io.containers`), in GETs joined across holes under `HOLE`;
- the tensor spans the engine's plan lists, in order, joined as above, a bounded window ahead of
  the read-ahead (`expect`, called by `engine.prefetch.Prefetcher`);
- anything else on demand, before the read (`before_read`: `io.taps.read_exact`, kernel copies,
  the mappings of `io.strided`, whole-file hashing and `torch.load` through `ensure_file`).

Why whole files and joined holes rather than one GET per record: a request costs a round trip
(and, on a server such as moto, a read of the whole object), while the bytes of a hole cost
little; Apache Arrow's read coalescing sets its hole limit the same way (time to first byte times
bandwidth: a few MiB on S3). A torch shard of TinyLlama at tp 8 has 201 records: one GET per
local header would be 201 round trips per file.

So an operation reads from the store the bytes it uses, plus holes of at most `HOLE`, and nothing
ever reads a hole of the mirror. Fetched bytes change a mirror file's mtime and ctime: `stamp`
gives the stable identity the "source changed while read" checks compare instead (every GET is
made If-Match the object's listed ETag, so a replaced object is refused, never mixed). The folder
(in the system's temporary folder; as large as the bytes fetched) is removed when the mirror
closes, and a killed run's mirror by the next run (its owner process is gone).
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import enum
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import FormatError, ShardkitError
from ..paths import inside
from . import containers, s3
from .delete import remove_tree
from .location import RemoteLocation

log = logging.getLogger(__name__)

SMALL = 1 << 20
"""Objects up to this size are fetched whole when the mirror opens."""
TENSOR_SUFFIXES = (".safetensors", ".pt", ".bin", ".pth")
PART = s3.PART_SIZE
"""The largest single ranged GET: a larger range is fetched as several GETs in flight."""
HOLE = 4 << 20
"""Wanted ranges of one object at most this far apart are fetched in one GET (the hole too)."""
GETS_IN_FLIGHT = s3.CONCURRENCY
WINDOW = 512 << 20
"""How far (bytes) the planned fetches may run ahead of the bytes readers have asked for."""
MIRROR_PREFIX = "shardkit-s3-"
WRITING = ".shardkit-writing"
"""A remote output's first object and the last one deleted (`io.upload`): while it exists the
prefix is incomplete."""


class Need(enum.Enum):
    """What an operation reads of the tensor containers it opens (see the module's docstring)."""

    METADATA = "metadata"
    """Their metadata when opened, then the ranges planned or read."""
    EVERYTHING = "everything"
    """All their bytes (merge, reshard, verify, export: all but a few percent of a source)."""


_MIRRORED: dict[tuple[int, int], MirrorFile] = {}
"""Open mirror files by identity (device, inode), for the read hooks."""
_REGISTRY_LOCK = threading.Lock()


# ---- fetched byte ranges --------------------------------------------------------------------------


class _Ranges:
    """Disjoint, sorted [start, end) ranges."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self.ends, start)
        j = bisect.bisect_right(self.starts, end)
        if i < j:
            start, end = min(start, self.starts[i]), max(end, self.ends[j - 1])
        self.starts[i:j], self.ends[i:j] = [start], [end]

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) not covered."""
        out: list[tuple[int, int]] = []
        i = bisect.bisect_right(self.ends, start)
        pos = start
        while pos < end and i < len(self.starts):
            if self.starts[i] >= end:
                break
            if self.starts[i] > pos:
                out.append((pos, self.starts[i]))
            pos = max(pos, self.ends[i])
            i += 1
        if pos < end:
            out.append((pos, end))
        return out

    def total(self) -> int:
        return sum(e - s for s, e in zip(self.starts, self.ends))


class MirrorFile:
    """One object's sparse local copy, and which of its bytes are there or on their way."""

    def __init__(self, mirror: Mirror, name: str, path: Path, size: int, etag: str):
        self.mirror, self.name, self.path, self.size, self.etag = mirror, name, path, size, etag
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        os.ftruncate(self.fd, size)
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)
        self.fetched = _Ranges()
        self.pending: dict[tuple[int, int], Future[int]] = {}
        self.lock = threading.Lock()
        self.prepared = False

    def _claim(self, start: int, end: int) -> tuple[list[tuple[int, int]], list[Future[int]]]:
        """Under the lock: the parts nobody fetches yet (now claimed) and the fetches to wait for."""
        todo: list[tuple[int, int]] = []
        waits: list[Future[int]] = []
        for s, e in self.fetched.missing(start, end):
            covered = _Ranges()
            for (ps, pe), future in self.pending.items():
                if ps < e and pe > s:
                    waits.append(future)
                    covered.add(ps, pe)
            for ms, me in covered.missing(s, e):
                for part in range(ms, me, PART):
                    todo.append((part, min(part + PART, me)))
        return todo, waits

    def fetch_async(self, start: int, end: int) -> list[Future[int]]:
        """Start fetching the missing bytes of [start, end); the futures to wait for."""
        start, end = max(0, start), min(self.size, end)
        if start >= end:
            return []
        with self.lock:
            todo, waits = self._claim(start, end)
            for s, e in todo:
                future = self.mirror.pool.submit(self._get, s, e)
                self.pending[(s, e)] = future
                waits.append(future)
        return waits

    def fetch_ranges(self, ranges: Iterable[tuple[int, int]]) -> list[Future[int]]:
        """Start fetching [start, end) ranges, joined across holes under HOLE."""
        return [f for s, e in _joined(ranges) for f in self.fetch_async(s, e)]

    def pread(self, offset: int, n: int) -> bytes:
        """Bytes already fetched (the metadata steps read only those)."""
        return os.pread(self.fd, max(0, min(n, self.size - offset)), offset)

    def ensure(self, start: int, length: int) -> None:
        """Return once bytes [start, start + length) are in the local file."""
        for future in self.fetch_async(start, start + length):
            future.result()

    def _get(self, start: int, end: int) -> int:
        try:
            got = s3.get_range(self.mirror.loc, self.name, start, end - start, self.etag, self.fd, start)
            with self.lock:
                self.fetched.add(start, end)
            self.mirror.count(got)
            return got
        finally:
            with self.lock:
                self.pending.pop((start, end), None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


# ---- a mirror ----------------------------------------------------------------------------------------


class Mirror:
    """A remote prefix as a local folder of sparse files (see the module's docstring)."""

    def __init__(self, loc: RemoteLocation, objects: Sequence[s3.ObjectInfo]):
        self.loc = loc
        self.base = Path(tempfile.mkdtemp(prefix=MIRROR_PREFIX))
        self.root = self.base / (loc.name or loc.bucket)
        self.pool = ThreadPoolExecutor(GETS_IN_FLIGHT, thread_name_prefix="shardkit-s3-get")
        self.files: dict[str, MirrorFile] = {}
        self.bytes_fetched = 0
        self._count_lock = threading.Lock()
        self._planner: _Planner | None = None
        try:
            (self.base / ".shardkit-owner").write_text(f"{_host()} {os.getpid()}\n")
            self.root.mkdir()
            for obj in objects:
                path = inside(self.root, obj.name, f"object key under {loc}")  # never outside the mirror
                path.parent.mkdir(parents=True, exist_ok=True)
                mf = MirrorFile(self, obj.name, path, obj.size, obj.etag)
                self.files[obj.name] = mf
                with _REGISTRY_LOCK:
                    _MIRRORED[mf.identity] = mf
            waits = [f for mf in self.files.values() if not _lazy(mf) for f in mf.fetch_async(0, mf.size)]
            _wait_all(waits)
        except BaseException:
            self.close()
            raise

    def count(self, n: int) -> None:
        with self._count_lock:
            self.bytes_fetched += n

    def prepare(self, under: str = "", need: Need = Need.METADATA) -> None:
        """Fetch what opening the tensor containers under `under` (a relative folder; "" for all)
        reads, or with Need.EVERYTHING every byte of them (see the module's docstring)."""
        inside_ = under.rstrip("/") + "/"
        chosen = [
            mf
            for name, mf in self.files.items()
            if _lazy(mf) and (not under or name == under or name.startswith(inside_))
        ]
        if need is Need.EVERYTHING:  # part i of every file, then part i + 1: many objects at once
            parts = max((-(-mf.size // PART) for mf in chosen), default=0)
            _wait_all([f for i in range(parts) for mf in chosen for f in mf.fetch_async(i * PART, (i + 1) * PART)])
        else:
            _fetch_metadata([mf for mf in chosen if not mf.prepared])
        for mf in chosen:
            mf.prepared = True

    def expect(self, extents: Sequence[tuple[Path, int, int]]) -> None:
        """The engine's plan: fetch these (path, offset, length) ranges of this mirror's files in
        order, at most WINDOW bytes ahead of what readers have asked for."""
        mine = [(self._by_path(p), o, n) for p, o, n in extents]
        planned = [(mf, o, n) for mf, o, n in mine if mf is not None]
        if not planned:
            return
        if self._planner is not None:
            self._planner.stop()
        self._planner = _Planner(planned)

    def _by_path(self, path: Path) -> MirrorFile | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        found = _MIRRORED.get((st.st_dev, st.st_ino))
        return found if found is not None and found.mirror is self else None

    def asked(self, n: int) -> None:
        if self._planner is not None:
            self._planner.asked(n)

    def close(self) -> None:
        if self._planner is not None:
            self._planner.stop()
        self.pool.shutdown(wait=True, cancel_futures=True)
        for mf in self.files.values():
            with _REGISTRY_LOCK:
                _MIRRORED.pop(mf.identity, None)
            mf.close()
        with contextlib.suppress(OSError, ShardkitError):
            remove_tree(self.base)
        log.debug("%s: fetched %d bytes", self.loc, self.bytes_fetched)


class _Planner:
    """Fetches the plan's ranges in order in a thread, a bounded window ahead of the readers."""

    def __init__(self, planned: list[tuple[MirrorFile, int, int]]):
        self.planned = planned
        self._asked = 0
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="shardkit-s3-plan", daemon=True)
        self._thread.start()

    def asked(self, n: int) -> None:
        with self._cond:
            self._asked += n
            self._cond.notify_all()

    def _run(self) -> None:
        ahead = 0
        run: list[Any] = []  # [file, start, end]: planned ranges of one file joined into one fetch so far
        try:
            for mf, offset, length in self.planned:
                with self._cond:
                    while not self._stop and ahead > self._asked + WINDOW:
                        self._cond.wait(0.5)
                    if self._stop:
                        return
                end = offset + length
                if run and run[0] is mf and run[2] - HOLE <= offset <= run[2] + HOLE and end - run[1] <= PART:
                    run[1], run[2] = min(run[1], offset), max(run[2], end)
                else:
                    if run:
                        run[0].fetch_async(run[1], run[2])
                    run = [mf, offset, end]
                ahead += length
            if run:
                run[0].fetch_async(run[1], run[2])
        except Exception as e:  # noqa: BLE001 - readers fetch on demand and meet real errors themselves
            log.debug("planned fetches stopped: %s", e)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()


def _lazy(mf: MirrorFile) -> bool:
    """A tensor container too large to fetch whole: only its metadata and the used spans are."""
    return mf.size > SMALL and mf.name.endswith(TENSOR_SUFFIXES)


def _joined(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and s - out[-1][1] <= HOLE:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _fetch_metadata(files: list[MirrorFile]) -> None:
    """Need.METADATA for `files`, every step for all of them at once (`io.containers`): head and
    tail; the safetensors header or zip central directory they point at; the zip records' local
    headers and small records; the rest of any header longer than its window."""

    def step(ranges: Callable[[MirrorFile], list[tuple[int, int]]], of: list[MirrorFile]) -> None:
        _wait_all([f for mf in of for f in mf.fetch_ranges(ranges(mf))])

    step(lambda mf: [(0, containers.HEAD), (max(0, mf.size - containers.TAIL), mf.size)], files)
    step(lambda mf: containers.after_head_and_tail(mf.name, mf.size, mf.pread), files)
    zips = [mf for mf in files if not mf.name.endswith(".safetensors") and containers.is_zip(mf.pread)]
    listed = {mf.name: containers.central_records(mf.size, mf.pread) for mf in zips}
    step(lambda mf: containers.zip_records(mf.size, listed[mf.name]), zips)
    step(lambda mf: containers.zip_header_rests(mf.size, listed[mf.name], mf.pread), zips)


def _wait_all(futures: Iterable[Future[int]]) -> None:
    first: BaseException | None = None
    for future in futures:
        try:
            future.result()
        except BaseException as e:  # noqa: BLE001 - the first failure is raised once all are done
            first = first or e
    if first is not None:
        raise first


def _host() -> str:
    import socket

    return socket.gethostname()


# ---- opening, and the hooks every read path calls ------------------------------------------------------

_OPEN: list[Mirror] = []
_OPEN_LOCK = threading.Lock()


def open_mirror(loc: RemoteLocation, objects: Sequence[s3.ObjectInfo] | None = None) -> Mirror:
    """A new mirror of `loc` (listed now unless `objects` is given); closed by `close_mirrors`,
    at the end of a `mirrors_scope`, or at exit."""
    _remove_stale()
    mirror = Mirror(loc, s3.list_objects(loc) if objects is None else objects)
    with _OPEN_LOCK:
        _OPEN.append(mirror)
    return mirror


def close_mirrors(keep: int = 0) -> None:
    """Close every mirror opened after the first `keep`."""
    with _OPEN_LOCK:
        closing, _OPEN[keep:] = _OPEN[keep:], []
    for mirror in closing:
        mirror.close()


@contextlib.contextmanager
def mirrors_scope() -> Iterator[None]:
    """Mirrors opened inside the block are closed (their folders removed) when it ends; an error
    raised inside it names the URLs its mirrors stand for, not their local folders."""
    with _OPEN_LOCK:
        keep = len(_OPEN)
    try:
        yield
    except ShardkitError as e:
        _name_urls(e)
        raise
    finally:
        close_mirrors(keep)


def _name_urls(error: ShardkitError) -> None:
    if len(error.args) != 1 or not isinstance(error.args[0], str):
        return
    text = error.args[0]
    with _OPEN_LOCK:
        mirrors = list(_OPEN)
    for mirror in mirrors:
        text = text.replace(str(mirror.root), str(mirror.loc))
    error.args = (text,)


atexit.register(close_mirrors)


def _remove_stale() -> None:
    """Remove the mirror folders of this host's runs that no longer run (killed mid-way)."""
    from .transaction import pid_alive

    base = Path(tempfile.gettempdir())
    try:
        entries = [e for e in os.listdir(base) if e.startswith(MIRROR_PREFIX)]
    except OSError:
        return
    for entry in entries:
        folder = base / entry
        try:
            host, pid = (folder / ".shardkit-owner").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if host == _host() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            with contextlib.suppress(OSError, ShardkitError):
                remove_tree(folder)
                log.info("removed %s, the S3 mirror of a run (process %s) that no longer runs", folder, pid)


def _in_mirrors(path: str | os.PathLike[str]) -> Iterator[tuple[Mirror, str]]:
    """Each open mirror holding the local `path`, with `path` relative to its root ("" for the root)."""
    here = Path(path)
    with _OPEN_LOCK:
        mirrors = list(_OPEN)
    for mirror in mirrors:
        if here == mirror.root or mirror.root in here.parents:
            rel = here.relative_to(mirror.root).as_posix()
            yield mirror, "" if rel == "." else rel


def location_of(path: str | os.PathLike[str]) -> RemoteLocation | None:
    """The remote location an open mirror's local path stands for (None: not in a mirror)."""
    for mirror, rel in _in_mirrors(path):
        return mirror.loc.child(rel) if rel else mirror.loc
    return None


def prepare_path(path: str | os.PathLike[str], need: Need = Need.METADATA) -> None:
    """`Mirror.prepare` of the part of an open mirror that `path` names (nothing for a local path)."""
    for mirror, rel in _in_mirrors(path):
        mirror.prepare(rel, need)


def readable(text: str, what: str) -> Path | None:
    """A local path to read `text` through: itself, or for s3:// a mirror of the prefix (kept until
    exit; None when the prefix holds nothing yet)."""
    from .location import remote as remote_location

    loc = remote_location(text, what)
    if loc is None:
        return Path(text)
    objects = s3.list_objects(loc)
    if not objects:
        s3.check_bucket(loc)
        return None
    return open_mirror(loc, [o for o in objects if o.name != WRITING]).root


def active() -> bool:
    return bool(_MIRRORED)


def _of_fd(fd: int) -> MirrorFile | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return _MIRRORED.get((st.st_dev, st.st_ino))


def before_read(fd: int, offset: int, length: int) -> None:
    """Called before a read of `length` bytes at `offset` through `fd`: when fd is a mirror
    file, those bytes are fetched first (nothing else to do for a local file)."""
    if _MIRRORED:
        mf = _of_fd(fd)
        if mf is not None:
            mf.mirror.asked(length)
            mf.ensure(offset, length)


def _of_path(path: str | os.PathLike[str]) -> MirrorFile | None:
    """The mirror file `path` is (by device and inode), if any."""
    if not _MIRRORED:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _MIRRORED.get((st.st_dev, st.st_ino))


def ensure_file(path: str | os.PathLike[str]) -> None:
    """Fetch the whole of `path` when it is a mirror file (before torch.load or hashing it whole)."""
    mf = _of_path(path)
    if mf is not None:
        mf.ensure(0, mf.size)


def expect(extents: Sequence[tuple[Path, int, int]]) -> None:
    """The engine's read plan (see `Mirror.expect`); nothing to do without mirrors."""
    if _MIRRORED:
        with _OPEN_LOCK:
            mirrors = list(_OPEN)
        for mirror in mirrors:
            mirror.expect(extents)


def ensure_range(path: str | os.PathLike[str], offset: int, length: int) -> None:
    """Fetch bytes [offset, offset + length) of `path` when it is a mirror file."""
    mf = _of_path(path)
    if mf is not None:
        mf.mirror.asked(length)
        mf.ensure(offset, length)


def is_mirrored(path: str | os.PathLike[str]) -> bool:
    if not _MIRRORED:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) in _MIRRORED


def stamp(st: os.stat_result) -> tuple[int, ...]:
    """A file's identity for the "changed while read" checks: device, inode, size, mtime and
    ctime; for a mirror file (whose times move as bytes arrive) device, inode and size: its
    object is pinned by ETag on every GET."""
    if _MIRRORED and (st.st_dev, st.st_ino) in _MIRRORED:
        return (st.st_dev, st.st_ino, st.st_size)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def open_prefix(loc: RemoteLocation, *, need: Need | None = Need.METADATA, output: bool = True) -> Mirror:
    """A mirror of `loc` to read from (see `open_mirror`), with what `need` says of every tensor
    container fetched (None: nothing yet; the caller prepares the part it reads). `output` (an
    engine source: one output of one run): a prefix still marked as being written is refused; a
    training checkpoint root is not (its tags say for themselves whether they are complete). An
    empty or absent prefix is a one-line error."""
    objects = s3.list_objects(loc)
    if not objects:
        s3.check_bucket(loc)
        raise FormatError(f"{loc} holds no objects: check the bucket and prefix")
    if output and any(o.name == WRITING for o in objects):
        raise FormatError(
            f"{loc} is incomplete (an upload was interrupted, or is still running): write it again "
            "(the next run into it removes the partial upload, saying so)"
        )
    mirror = open_mirror(loc, [o for o in objects if o.name != WRITING])
    if need is not None:
        mirror.prepare("", need)
    return mirror
