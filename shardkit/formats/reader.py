"""Reading slices of full tensors out of any checkpoint, whatever its layout.

A `SourceReader` answers "give me rows a..b of full tensor X" by locating the pieces that hold
them (`SegmentIndex.locate`) and reading exactly those bytes from the files, positionally.
"""

from __future__ import annotations

import bisect
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from ..errors import FormatError
from ..io.data.buffers import empty_tensor
from ..io.data.copy import FileRange
from ..io.data.digest import FAST, FAST_DIGEST, CheckMode, NoSha256Error, expected_digest, feed_file, new_digest
from ..io.data.strided import window_rows
from ..io.data.taps import OpenFile, ReadSource, ReadTap, read_exact
from ..io.store import Store
from ..placements import Piece, Read, Segment, SegmentIndex, build_piece
from .base import TensorFile
from .manifest import MANIFEST
from .registry import format_of_file

if TYPE_CHECKING:
    from .source import Checkpoint


COLUMN_BLOCK_BYTES = 4 << 20
"""A matrix assembled along dim 1 for a writer that takes row blocks is streamed in blocks of
about this many bytes (not assembled whole: a merged 7B MLP weight is 86 MiB of fresh memory)."""

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

    def __init__(self, ckpt: Checkpoint, check: CheckMode = FAST):
        self.root = Path(ckpt.root)
        self.ckpt = ckpt
        self.mode = check
        self.expected: dict[str, dict] = {}
        for entry in (ckpt.manifest or {}).get("files", []) or []:
            try:
                expected_digest(entry, check)  # the digest is there
                self.expected[str(entry["path"])] = entry
            except NoSha256Error as e:
                raise NoSha256Error(f"{self.root}: {e}") from None
            except (KeyError, TypeError, AttributeError):
                raise FormatError(f"{self.root / MANIFEST} has a malformed files entry: re-create the shards") from None
        # by listed path (see _named), in the order the operation needs them
        self._files: dict[str, _FileCheck] = {}
        self._of_key: dict[str, list[_FileCheck]] = {}
        self._failing = False
        self._queue: queue.SimpleQueue[_FileCheck | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(
        self, keys=None, planned: Sequence[tuple[Path, int, int]] = (), requested: Callable[[], int] | None = None
    ) -> HashCheck:
        """Check the files of `keys` (default: every file of the checkpoint), listed in the order
        the operation first reads them. `planned`: (path, offset, length) of the bytes the
        operation reads, in the order it first reads them, where it knows them, and `requested()`
        how many of those the workers have reached (see `_FileCheck`)."""
        spans: dict[str, list[tuple[int, int, int]]] = {}
        for place, (path, offset, length) in enumerate(planned):
            spans.setdefault(_named(path), []).append((offset, offset + length, place))
        for key in self.ckpt.files if keys is None else keys:
            path = self.ckpt.files[key]
            for file in format_of_file(path, self.ckpt.format).files_of(path):
                try:
                    rel = Path(file).relative_to(self.root).as_posix()
                except ValueError:
                    continue
                if rel in self.expected:
                    name = _named(file)
                    if name not in self._files:
                        ranges = _merged(spans.get(name, []))
                        self._files[name] = _FileCheck(
                            Path(file), rel, self.expected[rel], self.mode, ranges, requested, self.ckpt.store
                        )
                    check = self._files[name]
                    self._of_key.setdefault(key, []).append(check)
        if self._files and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardkit-hash-check", daemon=True)
            self._thread.start()
            for check in self._files.values():
                if check.algorithm != FAST_DIGEST:
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
                    f"{check.rel} in {self.root} does not match the size and {check.algorithm} in its {MANIFEST}: the "
                    "file is corrupt or was changed; restore it or re-create the shards (--no-verify-hashes skips this check)"
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
        for check in self._files.values():
            try:
                check.unchanged()
            except OSError as e:
                raise FormatError(f"cannot read {check.path}: {e.strerror or e}") from None
        if self.error is not None:
            raise self.error

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


def _named(path: Path | str) -> str:
    """The key of a file's check: its absolute path as named, links not followed. Resolving them
    would let a listed file turned into a link to another listed file share that file's check,
    and never be compared with its own entry. A reader path named otherwise only misses its tap:
    the file is then hashed by reading it again, never left unchecked."""
    return os.path.abspath(path)


def _key(holder: object) -> str:
    """The file key a read's holder is (the index of a checkpoint holds pieces by file key)."""
    if not isinstance(holder, str):
        raise TypeError(f"a source piece is held by {holder!r}, not by a file key")
    return holder


class SourceReader:
    """Reads slices of a checkpoint's pieces. Readers hold only metadata and a file descriptor
    (bytes are read positionally, nothing is mapped), so files stay open, up to `max_open`."""

    def __init__(
        self,
        ckpt: Checkpoint,
        max_open: int = 256,
        index: SegmentIndex | None = None,
        hashes: HashCheck | None = None,
        sources: Callable[[os.stat_result], ReadSource | None] | None = None,
        ready: Callable[[Read], None] | None = None,
        stamps: SourceStamps | None = None,
    ):
        self.ckpt = ckpt
        self.hashes = hashes
        self.stamps = stamps  # every file as first opened, compared once the operation's copies are done
        self.sources = sources  # what may serve reads of a file from memory (the read-ahead's buffers)
        self.ready = ready  # called before each read (waits for the read-ahead)
        self.index = index or ckpt.index()
        self.max_open = max_open
        self._open: OrderedDict[str, TensorFile] = OrderedDict()
        self._kept: dict[tuple, torch.Tensor] = {}  # read_rows: stacked/transposed pieces of one tensor
        self._kept_source: str | None = None

    def _file(self, key: str) -> TensorFile:
        if key in self._open:
            self._open.move_to_end(key)
        else:
            if len(self._open) >= self.max_open:
                self._open.popitem(last=False)[1].close()
            if self.hashes is not None:
                self.hashes.using(key)
            file = self._open[key] = self.ckpt.open(key)
            tap = getattr(file, "tap", None)
            if self.hashes is not None and tap is not None:
                tap(self.hashes.taps)
            watch = getattr(file, "watch", None)
            if self.stamps is not None and watch is not None:
                st = watch()
                if st is not None:
                    self.stamps.watch(file.path, st)
            read_from = getattr(file, "read_from", None)
            if self.sources is not None and read_from is not None:
                read_from(self.sources)
        return self._open[key]

    def _span(self, r: Read) -> tuple[int, int]:
        """[start, stop) of a read along its dim, a None bound being the start / end of the dim
        (of the slab, for a stacked piece)."""
        start = 0 if r.start is None else r.start
        if r.stop is not None:
            return start, r.stop
        shape = self._file(_key(r.holder)).shape(r.piece_name)
        return start, shape[r.dim + (1 if r.slab is not None else 0)]

    def read(self, r: Read) -> torch.Tensor:
        """One read: a slice of a source piece, in the full tensor's orientation."""
        if self.ready is not None:
            self.ready(r)
        file = self._file(_key(r.holder))
        if r.slab is None and not r.transposed:
            tensor = file.read(r.piece_name, r.dim, r.start, r.stop)
        else:
            base = file.read(r.piece_name, 0, r.slab, r.slab + 1)[0] if r.slab is not None else file.read(r.piece_name)
            tensor = r.take(base)
        return tensor

    def read_segment(self, seg: Segment) -> torch.Tensor:
        parts = [self.read(r) for r in self.index.locate(seg)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=seg.dim)

    def read_piece(self, piece: Piece) -> torch.Tensor:
        if piece.stacked or piece.transposed or piece.cat_dim != 0:
            return build_piece(piece, self.read_segment)
        reads = [r for seg in piece.slabs[0] for r in self.index.locate(seg)]
        if len(reads) == 1:
            return self.read(reads[0])
        # several blocks of rows: read each straight into its place, no concatenation copy
        out = empty_tensor(piece.shape, self.dtype_of(piece.slabs[0][0].source))
        row = 0
        for r in reads:
            start, stop = self._span(r)
            block = out.narrow(0, row, stop - start)
            if self.ready is not None:
                self.ready(r)
            file = self._file(_key(r.holder))
            if r.slab is not None or not file.read_into(r.piece_name, start, stop, block):
                block.copy_(self.read(r))
            row += stop - start
        return out

    def byte_ranges(self, piece: Piece) -> Iterator[FileRange] | None:
        """A piece as the source byte ranges it is made of, in order, when its bytes are exactly
        those ranges one after another: every read is a whole row-major stored tensor or a block
        of its rows, concatenated along dim 0. The kernel can then copy it
        (`HashingFile.copy_ranges`). None otherwise: a block of columns, stacked or transposed
        pieces, a format that does not say where its bytes are, bytes the read-ahead holds in its
        own buffers. Each range is given once the read-ahead has its bytes."""
        if piece.stacked or piece.transposed or (len(piece.slabs[0]) > 1 and piece.cat_dim != 0):
            return None
        reads: list[Read] = []
        for seg in piece.slabs[0]:
            located = self.index.locate(seg)
            if len(located) > 1 and seg.dim != 0:
                return None
            reads += located
        if len({r.holder for r in reads}) > self.max_open:  # every file stays open until copied
            return None
        ranges = [self._byte_range(r) for r in reads]
        if any(found is None for found in ranges):
            return None
        return self._when_ready(reads, cast(list[FileRange], ranges))

    def _when_ready(self, reads: list[Read], ranges: list[FileRange]) -> Iterator[FileRange]:
        for r, found in zip(reads, ranges):
            if self.ready is not None:
                self.ready(r)
            yield found

    def _byte_range(self, r: Read) -> FileRange | None:
        if r.slab is not None or r.transposed:
            return None
        byte_range = getattr(self._file(_key(r.holder)), "byte_range", None)
        return None if byte_range is None else byte_range(r.piece_name, r.dim, r.start, r.stop)

    def advise(self, piece: Piece) -> None:
        """Hint the kernel to start reading the bytes `piece` will need (readers that can: the
        safetensors and torch ones), so that a cold disk reads them while the piece before is
        being written."""
        for seg in piece.segments:
            for r in self.index.locate(seg):
                file = self._file(_key(r.holder))
                advise = getattr(file, "advise", None)
                if advise is None:
                    continue
                if r.slab is None and not r.transposed:
                    advise(r.piece_name, r.dim, r.start, r.stop)
                else:
                    advise(r.piece_name)

    def row_blocks(self, piece: Piece) -> Iterator[torch.Tensor] | None:
        """A piece as consecutive blocks of rows, streamed without assembling the piece: its reads
        one after another when it is concatenated along dim 0, or, for a matrix concatenated
        along dim 1 (a merged row-parallel weight), blocks of about COLUMN_BLOCK_BYTES whose rows
        are read from every source piece (contiguous bytes in each). None when it must be
        assembled whole (stacked or transposed pieces)."""
        if piece.stacked or piece.transposed:
            return None
        reads = [r for seg in piece.slabs[0] for r in self.index.locate(seg)]
        if piece.cat_dim == 0:
            return (self.read(r) for r in reads)
        if piece.cat_dim != 1 or len(piece.shape) != 2 or any(seg.dim != 1 for seg in piece.slabs[0]):
            return None
        for r in reads:  # plain reads of whole pieces that hold every row (merge, or a lower tp)
            if r.slab is not None or r.transposed or r.dim != 1:
                return None
            shape = self._file(_key(r.holder)).shape(r.piece_name)
            # a part of a piece's columns is better copied out on its own (`_copy_columns`) than read as whole rows
            if len(shape) != 2 or shape[0] != piece.shape[0] or self._span(r) != (0, shape[1]):
                return None
        return self._column_blocks(piece, reads)

    def column_windows(self, piece: Piece) -> list[tuple[int, int]] | None:
        """The windows of rows (`io.data.strided.window_rows`) in which a matrix joined along dim 1 from
        blocks of columns of row-major source matrices (a tp rank's part of a row-parallel
        weight) can be read (`read_column_rows`), when the files holding them can cut blocks from rows
        (`read_block`): the files of a group built together then read each window once for all
        of them (`io.data.strided.shared_column_reads`). None otherwise."""
        reads = self._column_reads(piece)
        if reads is None:
            return None
        item = self.dtype_of(piece.slabs[0][0].source).itemsize
        sources = {(r.holder, r.piece_name) for r in reads}  # a window of each, SHARED_WINDOW together
        row_bytes = sum(self._file(_key(holder)).shape(name)[1] for holder, name in sources) * item
        rows, step = piece.shape[0], window_rows(row_bytes, piece.shape[1] * item)
        return [(first, min(rows, first + step)) for first in range(0, rows, step)]

    def _column_reads(self, piece: Piece) -> list[Read] | None:
        if piece.stacked or piece.transposed or len(piece.shape) != 2 or piece.cat_dim != 1:
            return None
        if any(seg.dim != 1 for seg in piece.slabs[0]):
            return None
        reads = [r for seg in piece.slabs[0] for r in self.index.locate(seg)]
        for r in reads:
            file = self._file(_key(r.holder))
            shape = file.shape(r.piece_name)
            if r.slab is not None or r.transposed or r.dim != 1 or getattr(file, "read_block", None) is None:
                return None
            if len(shape) != 2 or shape[0] != piece.shape[0] or r.start is None or r.stop is None:
                return None
        return reads

    def read_column_rows(self, piece: Piece, first: int, last: int) -> torch.Tensor:
        """Rows [first, last) of a piece `column_windows` accepts, cut from its sources' rows."""
        reads = self._column_reads(piece)
        if reads is None:
            raise ValueError(f"{piece.name} is not a block of columns of source matrices")
        out = empty_tensor((last - first, piece.shape[1]), self.dtype_of(piece.slabs[0][0].source))
        col = 0
        for r in reads:
            start, stop = cast(int, r.start), cast(int, r.stop)
            if self.ready is not None:
                self.ready(r)
            if col + stop - start > piece.shape[1]:
                raise FormatError(f"{piece.name}: the sources hold more than its {piece.shape[1]} columns")
            file = self._file(_key(r.holder))
            block = out[:, col : col + stop - start]
            if not file.read_block(r.piece_name, first, last, start, stop, block):  # type: ignore[attr-defined]
                block.copy_(self.read(r)[first:last])
            col += stop - start
        if col != piece.shape[1]:
            raise FormatError(f"{piece.name}: the sources hold {col} columns, expected {piece.shape[1]}")
        return out

    def _column_blocks(self, piece: Piece, reads: list[Read]) -> Iterator[torch.Tensor]:
        rows, cols = piece.shape
        dtype = self.dtype_of(piece.slabs[0][0].source)
        step = max(1, COLUMN_BLOCK_BYTES // max(1, cols * dtype.itemsize))
        spans = [(r, *self._span(r)) for r in reads]
        held = sum(stop - start for _, start, stop in spans)
        if held != cols:
            raise FormatError(f"{piece.name}: the sources hold {held} columns, expected {cols}")
        if self.ready is not None:  # every block reads rows of every piece
            for r in reads:
                self.ready(r)
        for first in range(0, rows, step):
            last = min(rows, first + step)
            block = empty_tensor((last - first, cols), dtype)
            col = 0
            for r, start, stop in spans:
                part = self._file(_key(r.holder)).read(r.piece_name, 0, first, last)
                block[:, col : col + stop - start].copy_(part[:, start:stop])
                del part  # its pooled buffer is free again before the next read
                col += stop - start
            yield block
            del block

    def read_rows(self, source: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) along dim 0 of full tensor `source`, whatever dim it is held split
        along: a block of a tensor split along dim 1 is read as those rows of every piece
        (contiguous bytes in row-major files) rather than as a block of columns (which spans
        nearly all of a file's bytes). Pieces that store the tensor stacked or transposed are
        read whole once and kept until a block of another tensor is asked for."""
        dim = self.index.dim_of(source)
        if dim == 0:
            reads = self.index.locate(Segment(source, 0, start, stop))
        else:
            size = max((h.stop for h in self.index.holdings(source)), default=0)
            reads = self.index.locate(Segment(source, dim, 0, size))
        if self._kept_source != source:
            self._kept.clear()
            self._kept_source = source
        parts = []
        for r in reads:
            if r.slab is None and not r.transposed:
                if dim == 0:
                    parts.append(self.read(r))
                else:  # a plain piece's dim 0 is the full tensor's dim 0
                    rows = self._file(_key(r.holder)).read(r.piece_name, 0, start, stop)
                    first, last = self._span(r)
                    parts.append(rows.narrow(dim, first, last - first))
                continue
            key = (r.holder, r.piece_name, r.slab)
            if key not in self._kept:
                file = self._file(_key(r.holder))
                self._kept[key] = (
                    file.read(r.piece_name, 0, r.slab, r.slab + 1)[0] if r.slab is not None else file.read(r.piece_name)
                )
            part = r.take(self._kept[key])
            parts.append(part if dim == 0 else part.narrow(0, start, stop - start))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def forget(self) -> None:
        """Drop the pieces `read_rows` keeps."""
        self._kept.clear()
        self._kept_source = None

    def dtype_of(self, source: str) -> torch.dtype:
        holdings = self.index.holdings(source)
        if not holdings:
            raise FormatError(f"no file holds {source}")
        return self._file(_key(holdings[0].holder)).dtype(holdings[0].piece_name)

    def close(self) -> None:
        self.forget()
        for reader in self._open.values():
            reader.close()
        self._open.clear()
