"""The plan of a write: everything `executor.run` does, decided before anything is written.

`plan_write` says which output files are built together (`lockstep_groups`), how each tensor is
written (copied by the kernel, streamed as blocks of rows, written in chunks or whole), which
source bytes are read ahead and in what order (`plan_read_ahead`), which source files are checked,
how many workers run and whether files go around the page cache. It reads the sources' headers and
asks the kernel what is cached, but writes nothing and starts no thread: the runner
(`executor.run`) does all of that.
"""

from __future__ import annotations

import enum
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import FormatError
from ..formats import Checkpoint, get_format
from ..formats.base import TensorSpec
from ..formats.registry import Abilities
from ..formats.source_check import HashCheck
from ..io.data.digest import NONE, Recording
from ..io.data.direct import direct_io_pays
from ..io.data.strided import SHARED_WINDOW
from ..placements import Piece, Read, SegmentIndex
from .options import AUTO, Auto, DirectIO, WriteOptions, parse_workers
from .outputs import OutputFile
from .prefetch import Prefetcher, cached_share, extents_of, reads_around_pay

WARM_SOURCES = 0.5
"""A merge whose sources have at least this share of their bytes in the page cache copies them in
the kernel (see `_kernel_copies`)."""


class Way(enum.Enum):
    """A way a tensor is written; a tensor's plan lists the ways it may take, the first that its
    file and its sources allow at run time wins, and WHOLE always does."""

    COPY = "copy"
    """Source byte ranges copied by the kernel (`CopyingWriter.write_copy`): bytes that move unchanged."""
    ROWS = "rows"
    """Blocks of columns cut from windows of source rows read once for the files of a group
    (`RowStreamingWriter.begin_rows`)."""
    CHUNKS = "chunks"
    """Consecutive blocks of rows, never assembled (`ChunkedWriter.write_chunks`)."""
    WHOLE = "whole"
    """Read whole into memory, then written (`TensorFileWriter.write`)."""


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of an output file: the piece it is made of, what is written, and how."""

    piece: Piece
    spec: TensorSpec
    ways: tuple[Way, ...]


@dataclass(frozen=True)
class FilePlan:
    """One output file and its tensors, in the order they are written."""

    out: OutputFile
    tensors: tuple[TensorPlan, ...]


Span = tuple[Path, int, int, int]
"""Where a source piece's bytes are: (path, byte offset, byte count, rows: see `byte_span`)."""


@dataclass(frozen=True)
class ReadAhead:
    """The read-ahead's plan: the source bytes as the outputs first read them ((path, offset,
    length) spans), which are read once (when cold bytes are read around the page cache, else
    None), and where each read falls among them."""

    spans: list[tuple[Path, int, int]]
    once: list[bool] | None
    order: dict[tuple, int]
    """The plan's keys of the source pieces and blocks of rows (`_span_keys`) -> their span."""
    places: dict[tuple[str, str], Span]
    """Where each source piece's bytes are, by (file key, piece name)."""

    def extents(self) -> list[tuple[Path, int, int]]:
        """The extents a `Prefetcher` of this plan reads."""
        return extents_of(self.spans, self.once)

    def waiter(self, ahead: Prefetcher) -> Callable[[Read], None]:
        """What a worker calls before each read: it waits until `ahead` has read the read's span."""

        def ready(r: Read) -> None:
            keys = _span_keys(r, self.places)
            if keys is not None:
                found = self.order.get(keys[1], self.order.get(keys[0]))
                if found is not None:
                    ahead.wait(found + 1)

        return ready


@dataclass(frozen=True)
class Plan:
    """What `executor.run` does (see the module's docstring)."""

    groups: tuple[tuple[FilePlan, ...], ...]
    """The output files, in the groups one worker builds together (a step of each in turn)."""
    index: SegmentIndex
    """Where every slice of every source tensor lives: the reads each output's pieces take."""
    total: int
    """Bytes of the tensors written (progress's total)."""
    workers: int
    """Threads that build groups."""
    direct: bool
    """Output files are written around the page cache."""
    read_ahead: ReadAhead | None
    """None when no source says where its bytes are (each file then hints the kernel to read its
    next piece: `SourceReader.advise`)."""
    hashes: HashCheck | None
    """The check of the sources (not started), None when there is none."""
    checked: tuple[str, ...]
    """The source files the check hashes, in the order the outputs first read them."""


def plan_write(src: Checkpoint, outputs: Sequence[OutputFile], options: WriteOptions) -> Plan:
    """The plan of writing `outputs` from `src` as `options` say (see the module's docstring)."""
    index = src.index()
    groups = lockstep_groups(outputs, index)
    spans: dict[tuple[str, str], Span] = {}
    source_dtypes = check_dtypes(src, spans)
    hashes: HashCheck | None = None
    checked: tuple[str, ...] = ()
    if options.verify_hashes != NONE:  # only the files this process reads (under torchrun, its share)
        needed = dict.fromkeys(r.holder for p in in_order(groups) for seg in p.segments for r in index.locate(seg))
        checked = tuple(key for key in needed if key in src.files)  # in the order the outputs first read them
        hashes = HashCheck.of(src, options.verify_hashes)
    dtypes = _output_dtypes(outputs, source_dtypes, options.dtype)
    total = sum(_file_bytes(o, dtypes) for o in outputs)
    read_ahead = plan_read_ahead(groups, index, spans, total, src.store.streamed)  # see prefetch.py
    # the page cache is the host's: under torchrun, this host's ranks write about as much each
    direct = options.direct_io is DirectIO.ON or (
        options.direct_io is DirectIO.AUTO and direct_io_pays(total * ranks_here())
    )
    abilities = get_format(options.fmt).abilities
    workers = _workers(options.workers, groups, dtypes, abilities)
    copies = _kernel_copies(options.digests, hashes, read_ahead)
    planned = tuple(
        tuple(_file_plan(out, dtypes, source_dtypes, abilities, copies, len(group) > 1) for out in group)
        for group in groups
    )
    return Plan(planned, index, total, workers, direct, read_ahead, hashes, checked)


def _file_bytes(out: OutputFile, dtypes: dict[str, torch.dtype]) -> int:
    """The bytes of an output file's tensors."""
    if out.nbytes is not None:
        return out.nbytes
    return sum(p.numel() * dtypes[p.segments[0].source].itemsize for p in out.pieces)


def _output_dtypes(
    outputs: Sequence[OutputFile], source_dtypes: dict[str, torch.dtype], dtype: torch.dtype | None
) -> dict[str, torch.dtype]:
    """The dtype each source tensor is written in: `dtype`, else its own."""
    dtypes: dict[str, torch.dtype] = {}
    for out in outputs:
        for piece in out.pieces:
            source = piece.segments[0].source
            if source not in dtypes:
                if source not in source_dtypes:
                    raise FormatError(f"no file holds {source}")
                dtypes[source] = dtype or source_dtypes[source]
    return dtypes


def _workers(
    workers: int | Auto, groups: Sequence[Sequence[OutputFile]], dtypes: dict[str, torch.dtype], abilities: Abilities
) -> int:
    """The worker count: as asked, or AUTO's (`auto_workers`), fewer when the largest tensors of that
    many workers would not fit AUTO_MEMORY; never more than the groups."""
    count = resolve_workers(workers, len(groups))
    if workers is not AUTO or count <= 1:
        return count
    largest = max(
        (
            _held_bytes(p, dtypes[p.segments[0].source].itemsize, abilities.chunked_writes)
            for group in groups
            for o in group
            for p in o.pieces
        ),
        default=0,
    )
    if any(len(group) > 1 for group in groups):  # the rows whose columns they share, kept
        largest = max(largest, SHARED_WINDOW)
    return max(1, min(count, AUTO_MEMORY // max(1, 2 * largest)))


def _kernel_copies(digests: Recording, hashes: HashCheck | None, read_ahead: ReadAhead | None) -> bool:
    """Whether bytes that move unchanged are copied by the kernel.

    They are read for whatever needs them. When only the check of the sources does (an output
    without digests, as merge's, from sources a manifest lists), cold sources are better read by
    the worker and written behind it, which splits the two copies between two threads while the
    read-ahead fills the page cache; sources already in the page cache are better copied: a write
    from the process's memory into the page cache costs up to twice what the kernel's own copy
    does on a VM."""
    return (
        bool(digests)
        or hashes is None
        or not hashes.expected
        or read_ahead is None
        or cached_share(read_ahead.extents()) >= WARM_SOURCES
    )


def _file_plan(
    out: OutputFile,
    dtypes: dict[str, torch.dtype],
    source_dtypes: dict[str, torch.dtype],
    abilities: Abilities,
    copies: bool,
    together: bool,
) -> FilePlan:
    """An output file's tensors and the ways each may be written: copied when the format takes
    copies, the operation copies and the bytes move unchanged (same dtype); as blocks of rows when
    the file is built together with others (blocks of columns cut from shared windows of rows); in
    chunks when the format takes them; else whole. An object file's tensors are its body's leaves,
    each made whole (`executor`)."""
    if out.body is not None:
        return FilePlan(out, ())
    tensors = []
    for piece in out.pieces:
        source = piece.segments[0].source
        spec = TensorSpec(piece.name, piece.shape, dtypes[source])
        ways = []
        if abilities.kernel_copies and copies and spec.nbytes > 0 and spec.dtype == source_dtypes[source]:
            ways.append(Way.COPY)
        if abilities.row_streaming and together:
            ways.append(Way.ROWS)
        if abilities.chunked_writes:
            ways.append(Way.CHUNKS)
        ways.append(Way.WHOLE)
        tensors.append(TensorPlan(piece, spec, tuple(ways)))
    return FilePlan(out, tuple(tensors))


LOCKSTEP_MAX = 32
"""At most this many files are built together (`lockstep_groups`): each is open, and has its own
queue of blocks to write, until the group is closed."""


def lockstep_groups(outputs: Sequence[OutputFile], index: SegmentIndex) -> list[list[OutputFile]]:
    """The output files in the groups they are built in, each group by one worker, a piece of each
    file in turn (`in_order`). Files that hold the same tensors in the same order (the tp ranks of
    one pipeline stage) and read blocks of columns of their sources (row-parallel weights cut
    from full tensors: a convert) go together, at most LOCKSTEP_MAX: each source tensor is then
    read once for all of them (`io.data.strided.shared_column_reads`), where built one after another each
    would touch all of its bytes for its 1/tp of them (most of the worker's time, at tp 8 and
    more). So do files that say they go together (`OutputFile.together`: the dp optimizer shards
    of a rank, each cut from the same pieces). Any other file is a group of its own. Groups keep
    the order of their first file."""
    groups: list[list[OutputFile]] = []
    open_group: dict[tuple, list[OutputFile]] = {}
    for out in outputs:
        if out.together is None and not _reads_columns(out, index):
            groups.append([out])
            continue
        names = ("together", out.together) if out.together is not None else tuple(p.name for p in out.pieces)
        group = open_group.get(names)
        if group is None or len(group) >= LOCKSTEP_MAX:
            group = open_group[names] = []
            groups.append(group)
        group.append(out)
    return groups


def _reads_columns(out: OutputFile, index: SegmentIndex) -> bool:
    """Whether a file reads a block of columns of a source piece (a part of it along a dim > 0)."""
    for piece in out.pieces:
        for seg in piece.segments:
            if seg.dim == 0:
                continue
            held = {(h.holder, h.piece_name): h.stop - h.start for h in index.holdings(seg.source)}
            for r in index.locate(seg):
                length = None if r.start is None or r.stop is None else r.stop - r.start
                if (
                    r.slab is None
                    and not r.transposed
                    and length is not None
                    and length < held[(r.holder, r.piece_name)]
                ):
                    return True
    return False


def in_order(groups: Sequence[Sequence[OutputFile]]) -> Iterator[Piece]:
    """Every piece in the order the workers write them: group by group, the first piece of each
    file of the group, then the second of each, and so on."""
    for group in groups:
        for i in range(max(len(out.pieces) for out in group)):
            for out in group:
                if i < len(out.pieces):
                    yield out.pieces[i]


def plan_read_ahead(
    groups: Sequence[Sequence[OutputFile]],
    index: SegmentIndex,
    spans: dict[tuple[str, str], Span],
    written: int = 0,
    streamed: bool = False,
) -> ReadAhead | None:
    """The read-ahead of the source bytes in the order the outputs first read them (`in_order`),
    which a worker waits for before each read (`ReadAhead.waiter`). A block of
    rows is planned alone (the first output of a stage then waits only for its own rows of a
    row-split tensor, not for the other ranks' rows too); any other read plans the whole source
    piece (a block of columns spans nearly all of its bytes). Cold bytes read once are read
    around the page cache when the bytes read and `written` would not fit in the free memory
    (`prefetch.reads_around_pay`; under torchrun, this host's ranks read and write about as
    much each). None when no source piece says where its bytes are."""
    order: dict[tuple, int] = {}
    plan: list[tuple[Path, int, int]] = []
    uses: list[int] = []  # reads of each planned span
    for piece in in_order(groups):
        for seg in piece.segments:
            for r in index.locate(seg):
                keys = _span_keys(r, spans)
                if keys is None:
                    continue
                whole, block = keys
                key = whole if whole in order else block  # a piece planned whole covers its row blocks
                if key not in order:
                    order[key] = len(plan)
                    path, offset, length, rows = spans[whole]
                    row_bytes = length // rows  # rows: see byte_span (1: the piece is planned whole)
                    start, stop = (block[2], block[3]) if len(block) == 4 else (0, rows)
                    plan.append((path, offset + start * row_bytes, (stop - start) * row_bytes))
                    uses.append(0)
                uses[order[key]] += 1
    if not plan:
        return None
    around = reads_around_pay((sum(length for _, _, length in plan) + written) * ranks_here())
    # a source streamed from object storage drops the bytes read once as they are read (io.objects.remote)
    return ReadAhead(plan, _read_once(plan, uses) if around or streamed else None, order, spans)


def _span_keys(r: Read, spans: dict[tuple[str, str], Span]) -> tuple[tuple, tuple] | None:
    """The keys a read has in the read-ahead's plan: its source piece's, and its block of rows'
    (the same when it reads all rows); None when the piece does not say where its bytes are."""
    if not isinstance(r.holder, str) or (r.holder, r.piece_name) not in spans:
        return None
    whole: tuple = (r.holder, r.piece_name)
    rows = spans[whole][3]
    start, stop = 0, rows
    if r.dim == 0 and r.slab is None and not r.transposed and rows > 1:  # a block of rows
        start, stop = r.start or 0, rows if r.stop is None else r.stop
    return whole, whole if (start, stop) == (0, rows) else (*whole, start, stop)


def _read_once(plan: Sequence[tuple[Path, int, int]], uses: Sequence[int]) -> list[bool]:
    """For each planned span: is it read by one read only and overlapped by no other span (a piece
    planned whole after blocks of its rows were)? Such bytes may be read ahead into buffers that
    are freed once copied out (see prefetch.py)."""
    once = [n == 1 for n in uses]
    by_file: dict[Path, list[int]] = {}
    for i, (path, _, _) in enumerate(plan):
        by_file.setdefault(path, []).append(i)
    for spans in by_file.values():
        spans.sort(key=lambda i: plan[i][1])
        reach, last = -1, -1  # the furthest end so far, and the span that reaches it
        for i in spans:
            _, offset, length = plan[i]
            if offset < reach:
                once[i] = once[last] = False
            if offset + length > reach:
                reach, last = offset + length, i
    return once


AUTO_MAX_WORKERS = 4
"""The most workers `--workers auto` picks."""

CORES_PER_WORKER = 2
"""Cores `--workers auto` counts for each worker. A worker keeps about one core busy (its reads,
the joins of split tensors, the digests of its kernel copies), and the write-behind threads it
hands its writes to keep most of a second one busy (the kernel's copies into the page cache), so
a second worker on two cores only contends for them (docs/BENCHMARKS.md)."""


def auto_workers() -> int:
    """The worker count `auto` means: one per CORES_PER_WORKER cores this process may use (shared
    with the other ranks of a torchrun job on this host), at least 1 and at most AUTO_MAX_WORKERS.
    More only contend for the cores; the read-ahead thread already keeps a cold disk busy while the
    workers copy. Memory grows with each worker by about one output tensor (bounded by the pieces
    of one file)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(AUTO_MAX_WORKERS, cores // (CORES_PER_WORKER * ranks_here())))


def ranks_here() -> int:
    """The processes of this torchrun job on this host (1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


AUTO_MEMORY = 256 << 20
"""What `auto` lets all workers together hold of tensors at once (about two of the largest piece
each: the piece and the reads it is made of); beyond that it uses fewer workers, so that peak
memory stays near what one worker needs (under 512 MiB with Python and torch on a 7B model)."""


def _held_bytes(piece, itemsize: int, chunked: bool) -> int:
    """The bytes a worker holds for one piece: all of it, unless the format streams it in blocks
    of rows (then about one read; counted as at most 64 MiB). A piece joined along dim 1 counts
    whole: `SourceReader.row_blocks` streams it only when its reads take whole source pieces."""
    nbytes = piece.numel() * itemsize
    if chunked and not piece.stacked and not piece.transposed and piece.cat_dim == 0:
        return min(nbytes, 64 << 20)
    return nbytes


def resolve_workers(workers: int | str | Auto | None, files: int) -> int:
    """A worker count from an int or "auto" (None means auto), never more than the files to write."""
    count = parse_workers(workers)
    return max(1, min(auto_workers() if count is AUTO else count, files))


def check_dtypes(src: Checkpoint, spans: dict[tuple[str, str], Span] | None = None) -> dict[str, torch.dtype]:
    """The dtype of every full tensor, read from the files' headers (each file opened once); all
    pieces of one full tensor must share it, else FormatError naming the odd file and tensor.
    `spans`, when given, receives where each piece's bytes are ((file key, piece name) -> Span),
    for the readers that can say it."""
    seen: dict[str, list[tuple[torch.dtype, str, str]]] = {}
    for key, pieces in src.holdings.items():
        if not pieces:
            continue
        file = src.open(key)
        try:
            span_of = getattr(file, "span", None) if spans is not None else None
            for piece in pieces:
                found = file.dtype(piece.name)
                if span_of is not None and spans is not None:
                    span = span_of(piece.name)
                    if span is not None and span[1] > 0:
                        spans[(key, piece.name)] = (file.path, *span)
                for seg in piece.segments:
                    seen.setdefault(seg.source, []).append((found, key, piece.name))
        finally:
            file.close()
    overall = Counter(d for held in seen.values() for d, _, _ in held)
    dtypes: dict[str, torch.dtype] = {}
    for source, held in seen.items():
        counts = Counter(d for d, _, _ in held)
        if len(counts) > 1:
            common = max(counts, key=lambda d: (counts[d], overall[d]))
            odd, key, name = next(h for h in held if h[0] != common)
            raise FormatError(
                f"{key}: {name} is {str(odd).replace('torch.', '')} but the other pieces of {source} are "
                f"{str(common).replace('torch.', '')}: the shards are corrupt or mixed from different checkpoints"
            )
        dtypes[source] = held[0][0]
    return dtypes
