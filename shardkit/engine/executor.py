"""The streaming executor: build each output file from exactly the source slices it needs.

Sources are read positionally (nothing is memory-mapped), so memory stays near one output
tensor (torch, xser) or one block of rows (formats with chunked writes) per worker, whatever
the model size. Workers are threads over groups of output files (copies and I/O release the
GIL): a file alone, or the tp files of a pipeline stage built together, a step of each in turn,
when they cut blocks of columns from the same source tensors (`lockstep_groups`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path

import torch

from ..errors import FormatError
from ..formats import Checkpoint, SourceReader, get_format
from ..formats.base import TensorFileWriter, TensorSpec
from ..formats.reader import HashCheck, SourceStamps
from ..io.buffers import reused_buffers
from ..io.digest import NONE, CheckMode, FileRecord, Recording, check_mode
from ..io.direct import direct_io_pays
from ..io.strided import SHARED_WINDOW, shared_column_reads
from ..placements import Piece, Read, SegmentIndex
from .outputs import OutputFile
from .prefetch import Prefetcher, cached_share, reads_around_pay

WARM_SOURCES = 0.5
"""A merge whose sources have at least this share of their bytes in the page cache copies them in
the kernel (see `execute`)."""

ProgressCallback = Callable[[int, int], None]
"""Called as progress(bytes_done_now, bytes_total) while output is written."""


_GC_LOCK = threading.Lock()
_GC_HOLDERS = 0
_GC_SAVED: tuple[int, ...] = ()
FULL_COLLECTIONS_OFF = 1 << 30
"""The third garbage-collection threshold while `no_full_collections` holds."""


@contextlib.contextmanager
def no_full_collections() -> Iterator[None]:
    """Until the block ends (in any thread), the interpreter collects only its young generations:
    the oldest one holds every object of torch and its imports (200,000+), and one full collection
    in the middle of a TinyLlama merge took 0.08 s of its 0.84 s. Young objects are still
    collected, and the thresholds are restored when the last such block ends. Also a decorator."""
    global _GC_HOLDERS, _GC_SAVED
    with _GC_LOCK:
        if _GC_HOLDERS == 0:
            _GC_SAVED = gc.get_threshold()
            gc.set_threshold(*_GC_SAVED[:2], FULL_COLLECTIONS_OFF)
        _GC_HOLDERS += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_HOLDERS -= 1
            if _GC_HOLDERS == 0:
                gc.set_threshold(*_GC_SAVED)


@no_full_collections()
def execute(
    src: Checkpoint,
    outputs: Sequence[OutputFile],
    out_root: Path,
    fmt: str,
    dtype: torch.dtype | None = None,
    workers: int | str = "auto",
    progress: ProgressCallback | None = None,
    verify_hashes: bool | CheckMode = True,
    digests: Recording = True,
    direct_io: bool | str = False,
) -> list[FileRecord]:
    """Write every output file from `src`; returns the records of the files written (with their
    xxh3-128, and sha256 too when `digests` is "sha256"; none when it is False: for outputs no
    manifest lists).

    `direct_io`: write around the page cache (True), through it (False, the default), or "auto":
    around it when this host's processes write more than the kernel's dirty limit
    (`io.direct.direct_io_pays`).

    With `verify_hashes` (True/"fast": the manifest's xxh3-128 where listed, else its sha256;
    "sha256": sha256 only), each source file the manifest lists is checked (once per file, from
    the bytes the workers read: see `HashCheck`) before this returns: a mismatch raises
    FormatError and nothing is committed."""
    check = check_mode(verify_hashes)
    file_format = get_format(fmt)
    auto = workers is None or workers == "auto"
    index = src.index()
    groups = lockstep_groups(outputs, index)
    workers = resolve_workers(workers, len(groups))
    spans: dict[tuple[str, str], Span] = {}
    source_dtypes = check_dtypes(src, spans)
    hashes = None
    if check != NONE:  # only the files this process reads (under torchrun, its share of the outputs)
        needed = dict.fromkeys(r.holder for p in in_order(groups) for seg in p.segments for r in index.locate(seg))
        checked = [key for key in needed if key in src.files]  # in the order the outputs first read them
        hashes = HashCheck(src, check)
    dtypes: dict[str, torch.dtype] = {}
    for out in outputs:
        for piece in out.pieces:
            source = piece.segments[0].source
            if source not in dtypes:
                if source not in source_dtypes:
                    raise FormatError(f"no file holds {source}")
                dtypes[source] = dtype or source_dtypes[source]
    total = sum(p.numel() * dtypes[p.segments[0].source].itemsize for o in outputs for p in o.pieces)
    read_ahead, ready = plan_read_ahead(groups, index, spans, total)  # see prefetch.py
    advise = read_ahead is None  # formats that do not say where their bytes are: read-ahead hints
    sources = read_ahead.source_for if read_ahead is not None else None
    if direct_io not in (True, False, "auto"):
        raise ValueError(f"direct_io must be True, False or 'auto', not {direct_io!r}")
    # the page cache is the host's: under torchrun, this host's ranks write about as much each
    direct = direct_io_pays(total * ranks_here()) if direct_io == "auto" else bool(direct_io)
    if auto and workers > 1:
        largest = max(
            (
                _held_bytes(p, dtypes[p.segments[0].source].itemsize, file_format.abilities.chunked_writes)
                for o in outputs
                for p in o.pieces
            ),
            default=0,
        )
        if any(len(group) > 1 for group in groups):  # the rows whose columns they share, kept
            largest = max(largest, SHARED_WINDOW)
        workers = max(1, min(workers, AUTO_MEMORY // max(1, 2 * largest)))
    done = 0
    reports: queue.SimpleQueue[int] = queue.SimpleQueue()  # bytes written, from worker threads
    cancel = threading.Event()

    def report(nbytes: int) -> None:
        """Progress is always called in the calling thread (a Ctrl-C or SIGTERM raised in a
        callback then stops the operation, as with one worker)."""
        nonlocal done
        if threading.current_thread() is caller:
            done += nbytes
            if progress is not None:
                progress(done, total)
        else:
            reports.put(nbytes)

    def drain() -> None:
        nonlocal done
        if not progress:
            return
        moved = 0
        while True:
            try:
                moved += reports.get_nowait()
            except queue.Empty:
                break
        if moved:
            done += moved
            progress(done, total)

    def build(group: list[OutputFile]) -> list[TensorFileWriter]:
        """The files of a group, a step of each in turn (see `lockstep_groups`), one reader for all."""
        together = len(group) > 1
        shared = shared_column_reads() if together else contextlib.nullcontext()
        with reused_buffers(), shared:  # every tensor read is written and dropped before the next read
            reader = SourceReader(src, index=index, hashes=hashes, sources=sources, ready=ready, stamps=stamps)
            steps: list[Generator[None, None, TensorFileWriter]] = []
            writers: dict[int, TensorFileWriter] = {}
            try:
                for out in group:
                    steps.append(build_file(out, reader, together))
                    next(steps[-1])  # opens the writer
                active = list(range(len(steps)))
                while active:
                    for k in list(active):
                        try:
                            next(steps[k])
                        except StopIteration as done:
                            writers[k] = done.value
                            active.remove(k)
                return [writers[k] for k in range(len(steps))]
            except BaseException:
                for step in steps:
                    step.close()  # a file not finished aborts its writer
                for writer in writers.values():
                    writer.abort()
                raise
            finally:
                reader.close()

    def build_file(out: OutputFile, reader: SourceReader, together: bool) -> Generator[None, None, TensorFileWriter]:
        """Writes one file: opens its writer, then a step at a time (a piece, or a window of rows
        of a block of columns: the same steps in every file of a group); returns (StopIteration)
        the writer, to be closed. Closed early (an error, another file of the group failed), it
        aborts."""
        specs = [TensorSpec(p.name, p.shape, dtypes[p.segments[0].source]) for p in out.pieces]
        writer = file_format.writer(out_root / out.path, out_root, specs, out.expert_parallel, digests, direct)
        # what the writer takes besides whole tensors, as the format's registry entry declares it
        chunked = file_format.chunked(writer)
        copying = file_format.copying(writer) if kernel_copies else None
        # built together, blocks of columns are cut from windows of rows read once for the group
        streaming = file_format.streaming(writer) if together else None
        try:
            yield
            for i, (piece, spec) in enumerate(zip(out.pieces, specs)):
                if cancel.is_set():
                    raise _Cancelled()
                if advise and i + 1 < len(out.pieces):  # a cold disk reads the next piece while this one is written
                    reader.advise(out.pieces[i + 1])
                # bytes that move unchanged are copied by the kernel (see HashingFile.copy_ranges)
                copied = (
                    copying is not None and spec.nbytes > 0 and spec.dtype == source_dtypes[piece.segments[0].source]
                )
                ranges = reader.byte_ranges(piece) if copied else None
                windows = reader.column_windows(piece) if streaming is not None and ranges is None else None
                blocks = (
                    reader.row_blocks(piece) if chunked is not None and ranges is None and windows is None else None
                )
                if copying is not None and ranges is not None:
                    copying.write_copy(piece.name, ranges)
                elif streaming is not None and windows is not None:
                    rows = streaming.begin_rows(piece.name)
                    for k, (first, last) in enumerate(windows):
                        if k:
                            yield  # every file of the group cuts its columns of this window first
                        block = reader.read_column_rows(piece, first, last)
                        rows.add(block if block.dtype == spec.dtype else block.to(spec.dtype))
                        del block
                    rows.end()
                elif chunked is not None and blocks is not None:
                    chunked.write_chunks(piece.name, blocks, owned=True)
                else:
                    tensor = reader.read_piece(piece)
                    if tensor.dtype != spec.dtype:
                        tensor = tensor.to(spec.dtype)
                    if tuple(tensor.shape) != piece.shape:
                        raise FormatError(f"{piece.name}: read shape {tuple(tensor.shape)}, expected {piece.shape}")
                    writer.write(piece.name, tensor, owned=True)  # read for this file alone: never changed
                    del tensor
                if progress:
                    report(spec.nbytes)
                yield
        except BaseException:
            writer.abort()
            raise
        return writer

    # Bytes copied by the kernel are read back for whatever needs them. When only the check of the
    # sources does (an output without digests, as merge's, from sources a manifest lists), cold
    # sources are better read by the worker and written behind it, which splits the two copies
    # between two threads while the read-ahead fills the page cache (cold TinyLlama merge: 1.32-1.52
    # s reading, 1.71-1.75 s copying); sources already in the page cache are better copied: a
    # write from the process's memory into the page cache costs 1-2x what the kernel's own copy
    # does, from one minute to the next on a VM (warm merge: 0.75-4.21 s reading, 0.90-1.19 s
    # copying, alternating).
    kernel_copies = (
        bool(digests)
        or hashes is None
        or not hashes.expected
        or read_ahead is None
        or cached_share(read_ahead.extents) >= WARM_SOURCES
    )
    caller = threading.current_thread()
    stamps = SourceStamps()  # the sources as first opened (see io.hashing.HashingFile.copy_ranges)
    records: list[FileRecord] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the work is copies; torch's intra-op threads only contend
    if read_ahead is not None:
        read_ahead.start()
    try:
        if hashes is not None:
            if read_ahead is not None:
                hashes.start(checked, read_ahead.spans, read_ahead.requested)
            else:
                hashes.start(checked)
        _write_all(build, groups, workers, records, cancel, drain)
        stamps.verify()  # every copy is done: a source written to meanwhile is refused before commit
        if hashes is not None:
            hashes.finish()  # before anything is committed: corrupt sources never reach the destination
    except KeyboardInterrupt:
        if hashes is not None:
            hashes.stop()
        raise
    except BaseException as e:
        mismatch = hashes.failure() if hashes is not None else None
        if mismatch is not None and mismatch is not e:
            raise mismatch from None
        raise
    finally:
        if read_ahead is not None:
            read_ahead.stop()
        torch.set_num_threads(threads)
    return records


LOCKSTEP_MAX = 32
"""At most this many files are built together (`lockstep_groups`): each is open, and has its own
queue of blocks to write, until the group is closed."""


def lockstep_groups(outputs: Sequence[OutputFile], index: SegmentIndex) -> list[list[OutputFile]]:
    """The output files in the groups they are built in, each group by one worker, a piece of each
    file in turn (`in_order`). Files that hold the same tensors in the same order (the tp ranks of
    one pipeline stage) and read blocks of columns of their sources (row-parallel weights cut
    from full tensors: a convert) go together, at most LOCKSTEP_MAX: each source tensor is then
    read once for all of them (`io.strided.shared_column_reads`), where built one after another each
    would touch all of its bytes for its 1/tp of them (TinyLlama tp 8: 0.32 CPU-s of 0.41 in the
    worker). Any other file is a group of its own. Groups keep the order of their first file."""
    groups: list[list[OutputFile]] = []
    open_group: dict[tuple[str, ...], list[OutputFile]] = {}
    for out in outputs:
        if not _reads_columns(out, index):
            groups.append([out])
            continue
        names = tuple(p.name for p in out.pieces)
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


Span = tuple[Path, int, int, int]
"""Where a source piece's bytes are: (path, byte offset, byte count, rows: see `byte_span`)."""


def plan_read_ahead(
    groups: Sequence[Sequence[OutputFile]], index: SegmentIndex, spans: dict[tuple[str, str], Span], written: int = 0
) -> tuple[Prefetcher | None, Callable[[Read], None] | None]:
    """A read-ahead of the source bytes in the order the outputs first read them (`in_order`), and what a
    worker calls before each read: it waits until the read's span has been read ahead. A block of
    rows is planned alone (the first output of a stage then waits only for its own rows of a
    row-split tensor, not for the other ranks' rows too); any other read plans the whole source
    piece (a block of columns spans nearly all of its bytes). Cold bytes read once are read
    around the page cache when the bytes read and `written` would not fit in the free memory
    (`prefetch.reads_around_pay`; under torchrun, this host's ranks read and write about as
    much each). (None, None) when no source piece says where its bytes are."""
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
        return None, None
    around = reads_around_pay((sum(length for _, _, length in plan) + written) * ranks_here())
    ahead = Prefetcher(plan, once=_read_once(plan, uses) if around else None)

    def ready(r: Read) -> None:
        keys = _span_keys(r, spans)
        if keys is not None:
            found = order.get(keys[1], order.get(keys[0]))
            if found is not None:
                ahead.wait(found + 1)

    return ahead, ready


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
hands its writes to keep most of a second one busy (the kernel's copies into the page cache): one
warm TinyLlama worker used 1.5-1.7 CPU-s per second of wall time. On this project's 2-core VM a
second worker only contended: a warm reshard took 0.59-0.62 s with two against 0.53-0.57 s with
one (CPU 1.01-1.04 against 0.86-0.92 s, fresh processes alternating), convert was no faster, and
cold runs took the same time."""


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


def resolve_workers(workers: int | str | None, files: int) -> int:
    """A worker count from an int or "auto" (None means auto), never more than the files to write."""
    if workers is None or workers == "auto":
        count = auto_workers()
    else:
        try:
            count = int(workers)
        except (TypeError, ValueError):
            raise ValueError(f"workers must be a positive integer or 'auto', not {workers!r}") from None
        if count < 1 or isinstance(workers, bool) or (isinstance(workers, float) and workers != count):
            raise ValueError(f"workers must be a positive integer or 'auto', not {workers!r}")
    return max(1, min(count, files))


class _Cancelled(Exception):
    """A worker stops because another worker failed or the operation was interrupted."""


def _write_all(build, groups, workers: int, records: list[FileRecord], cancel: threading.Event, drain) -> None:
    """Every group of output files, by `workers` threads, in order (`build` writes a group's tensors
    and returns its writers, to be closed). The calling thread waits, and calls the progress
    callback (`drain`); on an error or Ctrl-C the groups not started are cancelled and the running
    ones stop before their next tensor (not finished first)."""
    if workers <= 1:
        _write_one_by_one(build, groups, records)
        return
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shardkit-worker")
    try:
        futures = [pool.submit(lambda group: close_all(build(group)), group) for group in groups]
        for future in futures:
            while True:
                drain()
                try:
                    result = future.result(timeout=0.05)
                    break
                except FuturesTimeout:
                    continue
            records += result
        drain()
    except BaseException:
        cancel.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def close_all(writers: Sequence[TensorFileWriter]) -> list[FileRecord]:
    """Close every writer, in order; on a failure the ones not closed yet are aborted."""
    records: list[FileRecord] = []
    for k, writer in enumerate(writers):
        try:
            records += writer.close()
        except BaseException:
            for rest in writers[k + 1 :]:
                rest.abort()
            raise
    return records


def _write_one_by_one(build, groups, records: list[FileRecord]) -> None:
    """One worker: each group's tensors in this thread, and the close of its files (the rest of
    their queued writes and copies, then the zip directories) in a helper thread while the next
    group's tensors are read: the files' write-behind threads are then busy while this one is, as
    with two workers. At most two groups are in flight (memory: their files' queued blocks, at
    most `io.hashing.WRITE_BEHIND_ALL` in all); a failure waits for the files being closed (they are
    written into the staging folder) before it is raised."""
    closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-close")
    closing = None
    try:
        for group in groups:
            writers = build(group)
            try:
                if closing is not None:
                    records += closing.result()
                    closing = None
            except BaseException:
                for writer in writers:
                    writer.abort()
                raise
            closing = closer.submit(close_all, writers)
        if closing is not None:
            records += closing.result()
            closing = None
    finally:
        if closing is not None:
            while not closing.done():  # Ctrl-C: never leave while the files are still being written
                try:
                    closing.exception()
                except BaseException:  # noqa: BLE001 - a second Ctrl-C: keep waiting
                    continue
        closer.shutdown(wait=True)


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
