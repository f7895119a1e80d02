"""Where an opened source's files live, and what reading them takes: the seam between the layers
above `io/` and object storage.

Every reader works on local files. A `Store` is the folder they are read from: a local folder
(`Store` itself: its bytes are there) or the mirror of an object-storage prefix (`MirrorStore`:
`io.objects.remote`, whose bytes are fetched as an operation plans them). An opened source owns
its store (`formats.Checkpoint.store`), and its readers open their files through it (`open`: a
mirror's file comes with what fetches its bytes before each read, `io.data.copy.Fetcher`); what
reads a file whole asks it first (`fetch_whole`), and the "changed while read" checks stamp a file
through it (`stamp`). The engine hands it its read plan (`expect`), asks it which files are
streamed and, before committing, whether what was streamed matched its digests (`verified`). A
source made of two others (a LoRA model over its base) reads through both (`joined`). A mirror's
file read as a local file, not through its store, is an internal error (`ReadWithoutStore`), never
zeros. Adding another object store means one new `Store` class, opened by `open_store`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..paths import open_regular
from .data.taps import OpenFile
from .location import RemoteLocation
from .location import remote as remote_location
from .objects import published, remote, s3, scopes, upload
from .objects.remote import TENSOR_SUFFIXES, Container, MetadataPlanner, Need, ReadWithoutStore, Unpredicted
from .objects.s3 import ObjectInfo
from .objects.scopes import mirrors_scope as scope
from .objects.upload import remote_output

__all__ = [
    "TENSOR_SUFFIXES",
    "MirrorStore",
    "Container",
    "MetadataPlanner",
    "Need",
    "ReadWithoutStore",
    "Store",
    "Unpredicted",
    "joined",
    "ObjectInfo",
    "Prefix",
    "S3Prefix",
    "hidden",
    "prefix",
    "named",
    "open_store",
    "readable",
    "remote_output",
    "scope",
]

Extent = tuple[Path, int, int]


class Store:
    """A local folder: every byte is there, nothing is fetched."""

    fetches = False  # whether its files' bytes are fetched before they are read (object storage)
    streamed = False  # whether its tensor files are streamed (read once, dropped once read)

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def holds(self, path: str | os.PathLike[str]) -> bool:
        """Whether `path` is one of this store's fetched files (a local folder fetches none)."""
        return False

    def location(self, path: str | os.PathLike[str] | None = None) -> RemoteLocation | None:
        """The remote location `path` (default: the root) stands for; None for a local folder."""
        return None

    def shown(self, path: str | os.PathLike[str] | None = None) -> str:
        """`path` (default: the root) as messages name it: its URL in object storage, else itself."""
        where = self.location(path)
        return str(where) if where is not None else str(self.root if path is None else path)

    def open(self, path: str | os.PathLike[str], what: str = "file") -> OpenFile:
        """`path` opened for positional reads (`io.data.taps`), with what fetches its bytes; a
        one-line ShardkitError unless it is a regular file (`paths.open_regular`)."""
        remote.refuse_unfetched(path)  # a mirror's file opened as a local file: an internal error
        return OpenFile(open_regular(os.fspath(path), what))

    def fetch_whole(self, path: str | os.PathLike[str]) -> None:
        """Every byte of `path` there before it is read whole (torch.load, a whole-file hash)."""
        remote.refuse_unfetched(path)

    def stamp(self, st: os.stat_result) -> tuple[int, ...]:
        """The identity of the file `st` describes for the "changed while read" checks: device,
        inode, size, mtime and ctime."""
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def prepare(self, paths: Iterable[str | os.PathLike[str]], need: Need, metadata: MetadataPlanner) -> None:
        """Fetch what opening the files (or folders) `paths` reads, or what `need` says of them
        (`metadata`: where a container's metadata lies, the formats' `containers.fetch_metadata`)."""

    def ensure(self, path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> None:
        """Have bytes [offset, offset + length) of `path` (default: all of it) there before a read."""

    def expect(self, extents: Sequence[Extent], once: Sequence[Extent] = ()) -> None:
        """The engine's read plan, in order (`once`: ranges read exactly once)."""

    def is_streamed(self, path: str | os.PathLike[str]) -> bool:
        """Whether `path` arrives as the store streams it (bytes dropped once read)."""
        return False

    def verified(self) -> None:
        """Before an output read from this store is committed: what was streamed matched its
        digests (FormatError naming the first file that did not)."""

    def close(self) -> None:
        """Release what the store holds (a mirror's folder)."""


class MirrorStore(Store):
    """An object-storage prefix read through a mirror (`io.objects.remote.Mirror`)."""

    def __init__(self, mirror: remote.Mirror):
        super().__init__(mirror.root)
        self.mirror = mirror
        self.fetches = True
        self.streamed = mirror.streamed

    def holds(self, path: str | os.PathLike[str]) -> bool:
        return self.mirror.file_at(path) is not None

    def open(self, path: str | os.PathLike[str], what: str = "file") -> OpenFile:
        """`path` opened, with its mirror file as what fetches its bytes (the mirror's own file
        the descriptor is, by device and inode; a file of no mirror is a local file)."""
        fd = open_regular(os.fspath(path), what)
        try:
            st = os.fstat(fd)
            mf = self.mirror.by_identity.get((st.st_dev, st.st_ino))
            if mf is None:
                remote.refuse_unfetched(path)  # another mirror's file
        except BaseException:
            os.close(fd)
            raise
        return OpenFile(fd, mf)

    def fetch_whole(self, path: str | os.PathLike[str]) -> None:
        mf = self.mirror.file_at(path)
        if mf is None:
            remote.refuse_unfetched(path)
        else:
            mf.ensure(0, mf.size)

    def stamp(self, st: os.stat_result) -> tuple[int, ...]:
        """A mirror file's device, inode and size: its times move as bytes arrive, and its object
        is pinned by ETag on every GET."""
        if (st.st_dev, st.st_ino) in self.mirror.by_identity:
            return (st.st_dev, st.st_ino, st.st_size)
        return super().stamp(st)

    def _relative(self, path: str | os.PathLike[str]) -> str | None:
        """`path` relative to the mirror's root ("" for the root), None when outside it."""
        here = Path(path)
        if here == self.root:
            return ""
        return here.relative_to(self.root).as_posix() if self.root in here.parents else None

    def location(self, path: str | os.PathLike[str] | None = None) -> RemoteLocation | None:
        rel = "" if path is None else self._relative(path)
        if rel is None:
            return None
        return self.mirror.loc.child(rel) if rel else self.mirror.loc

    def prepare(self, paths: Iterable[str | os.PathLike[str]], need: Need, metadata: MetadataPlanner) -> None:
        rels = [rel for rel in map(self._relative, paths) if rel is not None]
        if rels:
            self.mirror.prepare(rels, need, metadata)

    def ensure(self, path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> None:
        mf = self.mirror.file_at(path)
        if mf is not None:
            if length is not None:
                self.mirror.asked(length)  # a planned read: the mirror's window moves on
            mf.ensure(offset, mf.size - offset if length is None else length)

    def expect(self, extents: Sequence[Extent], once: Sequence[Extent] = ()) -> None:
        self.mirror.expect(extents, once)

    def is_streamed(self, path: str | os.PathLike[str]) -> bool:
        mf = self.mirror.file_at(path)
        return mf is not None and mf.streamed

    def verified(self) -> None:
        self.mirror.verified()

    def close(self) -> None:
        remote.close_mirror(self.mirror)


class _Joined(Store):
    """Several stores read by one source (a LoRA model's tag and its base model)."""

    def __init__(self, stores: Sequence[Store]):
        super().__init__(stores[0].root)
        self.stores = list(stores)
        self.fetches = any(s.fetches for s in stores)
        self.streamed = any(s.streamed for s in stores)

    def _of(self, path: str | os.PathLike[str]) -> Store | None:
        return next((s for s in self.stores if s.holds(path)), None)

    def holds(self, path: str | os.PathLike[str]) -> bool:
        return self._of(path) is not None

    def open(self, path: str | os.PathLike[str], what: str = "file") -> OpenFile:
        return (self._of(path) or self.stores[0]).open(path, what)

    def fetch_whole(self, path: str | os.PathLike[str]) -> None:
        (self._of(path) or self.stores[0]).fetch_whole(path)

    def stamp(self, st: os.stat_result) -> tuple[int, ...]:
        return min((s.stamp(st) for s in self.stores), key=len)  # a mirror's file by its mirror's stamp

    def location(self, path: str | os.PathLike[str] | None = None) -> RemoteLocation | None:
        if path is None:
            return self.stores[0].location()
        return next((where for s in self.stores if (where := s.location(path)) is not None), None)

    def prepare(self, paths: Iterable[str | os.PathLike[str]], need: Need, metadata: MetadataPlanner) -> None:
        listed = list(paths)
        for s in self.stores:
            s.prepare(listed, need, metadata)

    def ensure(self, path: str | os.PathLike[str], offset: int = 0, length: int | None = None) -> None:
        store = self._of(path)
        if store is not None:
            store.ensure(path, offset, length)

    def expect(self, extents: Sequence[Extent], once: Sequence[Extent] = ()) -> None:
        for s in self.stores:
            s.expect(extents, once)  # each takes the extents of its own files

    def is_streamed(self, path: str | os.PathLike[str]) -> bool:
        store = self._of(path)
        return store is not None and store.is_streamed(path)

    def verified(self) -> None:
        for s in self.stores:
            s.verified()


def joined(*stores: Store) -> Store:
    """One store reading through each of `stores` (when all are local folders: the first)."""
    if not any(s.fetches for s in stores):
        return stores[0]
    return _Joined(stores)


def open_store(loc: RemoteLocation, *, output: bool = True, streamed: bool = False) -> MirrorStore:
    """The store of the object-storage prefix `loc` (see `io.objects.remote.open_prefix`: `output`
    reads the objects an output's record names; `streamed`: its tensor files are read once)."""
    return MirrorStore(remote.open_prefix(loc, output=output, streamed=streamed))


class Prefix:
    """A prefix of an object store, for what is done to it by name: list, read or write small
    objects, delete, send a folder up. `S3Prefix` is the one implementation today; `prefix` picks
    it by the location's scheme."""

    def __init__(self, loc: RemoteLocation):
        self.loc = loc


class S3Prefix(Prefix):
    """An S3 prefix (`io.objects.s3`: the AWS chain, retries, one-line errors)."""

    def listing(self) -> list[ObjectInfo]:
        """Every object under the prefix (names relative to it)."""
        return s3.list_objects(self.loc)

    def check_bucket(self) -> None:
        """A one-line error when the bucket does not exist or cannot be read."""
        s3.check_bucket(self.loc)

    def head(self) -> ObjectInfo | None:
        """The object the prefix itself names (None: there is none)."""
        return s3.head(self.loc)

    def get(self, name: str) -> bytes | None:
        """The small object `name` (None: there is none)."""
        return s3.get_bytes(self.loc, name)

    def put(self, name: str, data: bytes) -> None:
        s3.put_bytes(self.loc, name, data)

    def delete(self, names: Iterable[str]) -> int:
        return s3.delete_objects(self.loc, names)

    def abort_uploads(self) -> int:
        """Abort the multipart uploads a killed writer left open under the prefix."""
        return s3.abort_uploads(self.loc)

    def published(self, objects: Sequence[ObjectInfo]) -> list[ObjectInfo]:
        """Of `objects`, those an output's record says readers read (`io.objects.published`)."""
        return published.readable_objects(self.loc, objects)

    def replaceable(self, names: Sequence[str], patterns: Sequence[str] = ()) -> list[str]:
        """Of `names`, those a replace may overwrite (`io.objects.upload.replaceable`)."""
        return upload.replaceable(self.loc, names, patterns)

    def upload_tree(self, local: Path, exclude: Sequence[str] = ()) -> None:
        """Send the files of the local folder `local` up under the prefix."""
        upload.upload_tree(local, self.loc, exclude=exclude)

    def streaming_upload(self, local: Path) -> upload.StreamingUpload:
        """A sink (`io.safety.sinks`) sending each file under `local` handed to it up as it closes:
        the caller gives it to the writers of `local`, and drains and closes it."""
        return upload.StreamingUpload(self.loc, local)

    def remove_objects(self, names: Iterable[str]) -> int:
        return published.remove_objects(self.loc, names)

    def mirror(self, objects: Sequence[ObjectInfo] | None = None) -> MirrorStore:
        """A store reading the prefix's objects (`objects`: as listed already) through a mirror."""
        return MirrorStore(remote.open_mirror(self.loc, objects))


def prefix(loc: RemoteLocation) -> S3Prefix:
    """The prefix `loc` names, in the backend of its scheme (s3:// is the one `io.location` accepts)."""
    return S3Prefix(loc)


def hidden(name: str) -> bool:
    """Whether an object is shardkit's bookkeeping of an output (a writing marker, a staged replace)."""
    return published.hidden(name)


def readable(text: str, what: str) -> Store | None:
    """The store to read `text` through: a local folder, or for s3:// a mirror of the prefix, kept
    until the process exits (None when the prefix holds nothing yet)."""
    loc = remote_location(text, what)
    if loc is None:
        return Store(text)
    objects = prefix(loc)
    listed = objects.listing()
    if not listed:
        objects.check_bucket()
        return None
    return objects.mirror(listed)


def named(text: object) -> str:
    """`text` with the local folder of every mirror of the current scope named by its s3:// URL."""
    return scopes.named(text)
