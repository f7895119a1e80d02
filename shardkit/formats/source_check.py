"""The one check of what an operation reads from a source, before anything is committed.

`HashCheck` holds the files a manifest lists to their digests: fed by the reads the operation makes
anyway where it can, hashed by a background thread where it cannot; `finish()` raises the first
mismatch, a file written to while it was read, and (`whole_folder`, a training tag) any file of
the folder removed, added or written to since the check was made. `SourceStamps` holds every file
readers open to what it was when first opened, also files no manifest lists. The engine checks its
sources with them (`HashCheck.of`), and so do the operations on training tags (`ckpt reshard`,
`ckpt export`, `load_checkpoint`: `checkpoint.tree.tag_check`).
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import FormatError
from ..io.data.digest import FAST, FAST_DIGEST, CheckMode, NoSha256Error, expected_digest, feed_file, new_digest
from ..io.data.taps import OpenFile, ReadTap, read_exact
from ..io.store import Store
from ..paths import inside
from .manifest import MANIFEST
from .registry import format_of_file

if TYPE_CHECKING:
    from .source import Checkpoint

SHARDS_REMEDY = "restore it or re-create the shards (--no-verify-hashes skips this check)"
"""What a mismatch's message tells the user to do, unless the check is told otherwise."""

Stamp = tuple[int, ...]


def stamp_tree(folder: Path, store: Store | None = None) -> dict[str, Stamp]:
    """Every file (and link) under `folder`, by relative path: device, inode, size, mtime, ctime
    (`Store.stamp` of the store it is read through, default a local folder). Links are stamped
    themselves, never followed."""
    store = store if store is not None else Store(folder)
    stamps: dict[str, Stamp] = {}
    for here, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(here, d))]:
            path = os.path.join(here, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            stamps[os.path.relpath(path, folder)] = store.stamp(st)
    return stamps


SMALL_GAP = 8 << 20
"""A read that starts at most this many bytes past the point a file's check has reached is joined
to it by reading the bytes between (zip headers, a kv replica the operation skips); a longer jump
hands the file to the check's thread, which hashes the rest by reading it again (unless the read
is dropped: see `_FileCheck`)."""

FILL_GAP = 128 << 10
"""A gap up to this size is always joined by reading it."""


class _FileCheck:
    """The check of one listed file: its digest, fed the file's bytes in order up to `upto`.

    `planned` lists the byte ranges of the file the operation reads, as (start, end, place) with
    `place` the order in which the operation first reads them; `requested()` is how many places
    the workers have reached. One source file may feed several output files (at tp 8 -> 4 with
    kv heads regrouped, a file's attention goes to one output and its MLP to a later one), so a
    read may jump over bytes that only a later output file reads. Reading the gap would then read
    those bytes twice, and handing the file on would read all the rest again; when the gap holds
    more such bytes than the reads under way have still to feed past it, the read is dropped
    instead: its bytes are read again once the digest reaches them (when the later reads have
    come), which costs only those bytes."""

    def __init__(
        self,
        path: Path,
        rel: str,
        entry: dict,
        mode: CheckMode,
        planned: list[tuple[int, int, int]] | None = None,
        requested: Callable[[], int] | None = None,
        store: Store | None = None,
    ):
        self.path, self.rel, self.entry = path, rel, entry
        self.store = store if store is not None else Store(path.parent)  # what the file is read through
        self.algorithm, self.expected = expected_digest(entry, mode)
        self.digest = new_digest(self.algorithm)
        self.upto = 0
        self.lock = threading.Lock()
        self.handed = False  # queued for the check's thread, which hashes the rest: reads no longer feed it
        self.used = False  # a reader opened (or tried to open) the file
        self.planned = planned or []
        self._starts = [start for start, _, _ in self.planned]
        self.requested = requested or (lambda: 0)
        self.stamp: tuple[int, ...] | None = None  # the file as first read (see `unchanged`)

    def feed(self, file: OpenFile, offset: int, view: memoryview) -> bool:
        """Feed bytes just read from `file` at `offset` where they continue the digest, after
        reading the gap before them where there is one (see the class: a read may be dropped).
        False when the gap is longer than SMALL_GAP (the file is then to be handed on)."""
        end = offset + len(view)
        with self.lock:
            if self.stamp is None:
                self.stamp = self.store.stamp(os.fstat(file.fd))
            if self.handed or end <= self.upto:
                return True
            if offset > self.upto:
                if offset - self.upto > FILL_GAP and self._later_than_soon(offset):
                    return True  # dropped: read again once the digest reaches it
                if offset - self.upto > SMALL_GAP:
                    return False
                gap = memoryview(bytearray(offset - self.upto))
                read_exact(
                    file.fd, gap, self.upto, str(self.path), file.fetcher
                )  # for the check only: tapped by nobody
                self.digest.update(gap)
                self.upto = offset
            self.digest.update(view[self.upto - offset :])
            self.upto = end
            return True

    def _later_than_soon(self, target: int) -> bool:
        """Whether [upto, target) holds more bytes that only reads not yet under way will feed than
        the reads under way have left to feed from `target` on."""
        reached = self.requested()
        later = 0
        j = max(0, bisect.bisect_right(self._starts, self.upto) - 1)
        while j < len(self.planned) and self.planned[j][0] < target:
            first, last, place = self.planned[j]
            if last > self.upto and place >= reached:
                later += min(last, target) - max(first, self.upto)
            j += 1
        if not later:
            return False
        soon = 0
        j = max(0, bisect.bisect_right(self._starts, target) - 1)
        while j < len(self.planned) and soon <= later:
            first, last, place = self.planned[j]
            if last > target and place < reached:
                soon += last - max(first, target)
            j += 1
        return later > soon

    def hand(self) -> bool:
        """Stop feeding the digest from reads; True the first time (the file is then to be queued)."""
        with self.lock:
            first, self.handed = not self.handed, True
            return first

    def finish(self) -> bool:
        """Hash the rest of the file (read again from `upto`, once handed); whether it has the
        listed size and digest."""
        size = feed_file(self.path, self.digest, self.upto, self.store)
        listed = self.entry.get("size")
        return (listed is None or size == listed) and self.digest.hexdigest() == self.expected

    def unchanged(self) -> None:
        """Raise FormatError when the file was written to since it was first read. The reads fed
        the digest as the operation made them, but a copy by the kernel moves the bytes a moment
        after the worker read them, a dropped read is hashed when read again, and a file handed
        on is read again: a file written to meanwhile could pass with bytes other than those
        used. (A file renamed over it is another file: the one read is unchanged.)"""
        if self.stamp is not None:
            _refuse_if_changed(self.path, self.stamp, self.store)


def _refuse_if_changed(path: Path | str, stamp: tuple[int, ...], store: Store) -> None:
    """FormatError when the file at `path` is the one stamped (`Store.stamp`: device, inode, size,
    mtime, ctime; an object store's mirror file's first three) and was written to since (a file
    renamed over it is another file: the one read is unchanged)."""
    now = store.stamp(os.stat(path))
    if now[:2] == stamp[:2] and now != stamp:
        raise FormatError(
            f"{path} changed while shardkit read it (its size, mtime or ctime moved: written to, or its "
            "links or mode changed): run again when nothing else touches the source"
        )


class SourceStamps:
    """The source files an operation reads, each as it was when a reader first opened it
    (`DescriptorReader.watch`): `verify`, once every copy is done and before anything is
    committed, refuses a file written to meanwhile, also where no manifest's check covers it (a
    Hugging Face folder; a checked file is refused by its check as well, `_FileCheck.unchanged`).
    The bytes of their kernel copies are then hashed from the worker's own read of them, a moment
    before the kernel copies them (`io.data.hashing.HashingFile.copy_ranges`)."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store if store is not None else Store("/")  # what the files are read through
        self._seen: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def watch(self, path: Path, st: os.stat_result) -> None:
        with self._lock:
            self._seen.setdefault(_named(path), self.store.stamp(st))

    def verify(self) -> None:
        """FormatError when a watched file changed (see `_refuse_if_changed`)."""
        with self._lock:
            seen = list(self._seen.items())
        for path, stamp in seen:
            try:
                _refuse_if_changed(path, stamp, self.store)
            except OSError:
                continue  # gone: the one read was not changed through its name


class HashCheck:
    """Checks the source files an operation reads against the digest their manifest lists
    (`check`: the fast xxh3-128 where listed, else sha256; or sha256 only), each file once.
    Files the manifest does not list are not checked.

    The fast check hashes the bytes the operation reads anyway: readers opened through `taps` pass
    it each byte range they read (`DescriptorReader.tap`), and a range that continues a file's
    digest feeds it, with no second read. A file read out of order, and every file checked by
    sha256, is handed to a background thread that hashes the rest of it by reading, while the
    operation goes on. `finish()` hashes what no read reached (headers, tails, skipped parts) and
    must be called before the output is committed: it raises the first mismatch, so that corrupt
    data never reaches the destination."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        manifest: Mapping[str, Any] | None,
        store: Store,
        check: CheckMode = FAST,
        *,
        keys: Sequence[str] | None = None,
        files_of: Callable[[str], Iterable[str | os.PathLike[str]]] | None = None,
        remedy: str = SHARDS_REMEDY,
        whole_folder: bool = False,
    ):
        self.root = Path(root)
        self.store = store  # what the files are read through
        self.mode = check
        self.remedy = remedy  # the end of a mismatch's message: what the user can do
        self.expected: dict[str, dict] = {}
        for entry in (manifest or {}).get("files", []) or []:
            try:
                expected_digest(entry, check)  # the digest is there
                self.expected[str(entry["path"])] = entry
            except NoSha256Error as e:
                raise NoSha256Error(f"{self.root}: {e}") from None
            except (KeyError, TypeError, AttributeError):
                raise FormatError(f"{self.root / MANIFEST} has a malformed files entry: re-create the shards") from None
        self._keys = list(self.expected) if keys is None else list(keys)
        self._files_of = files_of or self._listed
        # every file and link under the root as it was (see `finish`), when the whole folder is held
        self.stamps = stamp_tree(self.root, store) if whole_folder else None
        # by listed path (see _named), in the order the operation needs them
        self._files: dict[str, _FileCheck] = {}
        self._of_key: dict[str, list[_FileCheck]] = {}
        self._failing = False
        self._queue: queue.SimpleQueue[_FileCheck | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @classmethod
    def of(cls, ckpt: Checkpoint, check: CheckMode = FAST) -> HashCheck:
        """The check of an opened source's files (a key's files: its format's `files_of`)."""

        def files_of(key: str) -> Iterable[Path]:
            path = ckpt.files[key]
            return format_of_file(path, ckpt.format).files_of(path)

        return cls(ckpt.root, ckpt.manifest, ckpt.store, check, keys=list(ckpt.files), files_of=files_of)

    def _listed(self, key: str) -> list[Path]:
        """A listed file by its listed path (a name that leaves the root is a one-line error)."""
        return [inside(self.root, key, f"file listed in {MANIFEST}")]

    def start(
        self,
        keys: Iterable[str] | None = None,
        planned: Sequence[tuple[Path, int, int]] = (),
        requested: Callable[[], int] | None = None,
        background: bool = False,
    ) -> HashCheck:
        """Check the files of `keys` (default: every key), listed in the order the operation first
        reads them. `planned`: (path, offset, length) of the bytes the operation reads, in the
        order it first reads them, where it knows them, and `requested()` how many of those the
        workers have reached (see `_FileCheck`). `background`: no reader feeds the check (the
        operation reads otherwise, or not at all): every file is hashed by the thread, at once."""
        spans: dict[str, list[tuple[int, int, int]]] = {}
        for place, (path, offset, length) in enumerate(planned):
            spans.setdefault(_named(path), []).append((offset, offset + length, place))
        for key in self._keys if keys is None else keys:
            for file in self._files_of(key):
                try:
                    rel = Path(file).relative_to(self.root).as_posix()
                except ValueError:
                    continue
                if rel in self.expected:
                    name = _named(file)
                    if name not in self._files:
                        ranges = _merged(spans.get(name, []))
                        self._files[name] = _FileCheck(
                            Path(file), rel, self.expected[rel], self.mode, ranges, requested, self.store
                        )
                    check = self._files[name]
                    self._of_key.setdefault(key, []).append(check)
        if self._files and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardkit-hash-check", daemon=True)
            self._thread.start()
            for check in self._files.values():
                if background or check.algorithm != FAST_DIGEST:
                    # sha256 is slow enough to halve the reading worker's speed: such files are
                    # read a second time by the thread instead, beside the workers
                    self._hand(check)
        return self

    def using(self, key: str) -> None:
        """A reader is opening the files of `key` (after a failure, only such files are checked)."""
        for check in self._of_key.get(key, ()):
            check.used = True

    def taps(self, path: Path) -> ReadTap | None:
        """The tap that feeds the reads of `path` to its check (None when it is not checked)."""
        check = self._files.get(_named(path))
        if check is None or check.handed:
            return None
        return _Tap(self, check)

    def _hand(self, check: _FileCheck) -> None:
        if check.hand():
            self._queue.put(check)

    def _run(self) -> None:
        while (check := self._queue.get()) is not None:
            if self._stop.is_set() or self.error is not None or (self._failing and not check.used):
                continue
            try:
                same = check.finish()
            except OSError as e:
                self.error = FormatError(f"cannot read {check.path}: {e.strerror or e}")
                continue
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self.error = e
                continue
            if not same:
                self.error = FormatError(
                    f"{check.rel} in {self.root} does not match its size and {check.algorithm} in its {MANIFEST}: the "
                    f"file is corrupt or was changed; {self.remedy}"
                )

    def _join(self) -> None:
        """Hand every file not handed yet (its rest is hashed; after a failure, only the files
        readers opened), and wait for the thread."""
        if self._thread is None:
            return
        for check in self._files.values():
            if not self._failing or check.used:
                self._hand(check)
        self._queue.put(None)
        self._thread.join()
        self._thread = None

    def finish(self) -> None:
        """Hash what no read reached, wait, and raise the first mismatch (FormatError), or a file
        written to while it was read (once every read and copy of the operation is done)."""
        self._join()
        self._refuse_folder_changes()
        for check in self._files.values():
            try:
                check.unchanged()
            except OSError as e:
                raise FormatError(f"cannot read {check.path}: {e.strerror or e}") from None
        if self.error is not None:
            raise self.error

    def _refuse_folder_changes(self) -> None:
        """With `whole_folder`: FormatError when any file or link under the root was removed,
        added or written to since the check was made (a tag pruned, rewritten or saved over)."""
        if self.stamps is None:
            return
        now = stamp_tree(self.root, self.store)
        for rel in sorted(set(self.stamps) | set(now)):
            before, after = self.stamps.get(rel), now.get(rel)
            if before == after:
                continue
            what = "was removed" if after is None else "appeared" if before is None else "was written to"
            raise FormatError(
                f"{self.root} changed while shardkit read it ({rel} {what}: pruned, rewritten or saved over by "
                "another process?): nothing was written; run again when nothing else touches it"
            )

    def failure(self) -> BaseException | None:
        """After another error: the check's verdict on the files readers opened, when it finds a
        mismatch (a corrupt file often breaks the reader first; the mismatch is the better
        message). Files no reader reached are not hashed: a full disk at 10% of a 400B-model merge
        is reported without reading the other 90%."""
        self._failing = True
        self._join()
        return self.error

    def stop(self) -> None:
        """Give up the check (Ctrl-C): the thread ends after the file it is hashing."""
        self._stop.set()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


def _merged(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """(start, end, place) byte ranges sorted, overlapping ones joined (at the earlier place)."""
    out: list[tuple[int, int, int]] = []
    for start, end, place in sorted(spans):
        if out and start < out[-1][1]:
            first, last, earlier = out[-1]
            out[-1] = (first, max(last, end), min(earlier, place))
        else:
            out.append((start, end, place))
    return out


class _Tap:
    """Feeds the reads of one file to its check; `wants(offset, length)` says whether bytes are
    still to be fed (not when the check has hashed past them, or the file was handed on): the
    worker then need not read the bytes of a copy for it (`io.data.taps._feed_taps`)."""

    def __init__(self, hashes: HashCheck, check: _FileCheck):
        self.hashes, self.check = hashes, check

    def __call__(self, file: OpenFile, offset: int, view: memoryview) -> None:
        if not self.check.feed(file, offset, view):
            self.hashes._hand(self.check)

    def wants(self, offset: int, length: int) -> bool:
        check = self.check
        return not check.handed and offset + length > check.upto


def _named(path: str | os.PathLike[str]) -> str:
    """The key of a file's check: its absolute path as named, links not followed. Resolving them
    would let a listed file turned into a link to another listed file share that file's check,
    and never be compared with its own entry. A reader path named otherwise only misses its tap:
    the file is then hashed by reading it again, never left unchecked."""
    return os.path.abspath(path)
