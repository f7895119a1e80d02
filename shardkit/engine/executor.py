"""The streaming executor: runs a plan (`planning.plan_write`), building each output file from
exactly the source slices it needs.

Sources are read positionally (nothing is memory-mapped), so memory stays near one output
tensor (torch, xser) or one block of rows (formats with chunked writes) per worker, whatever
the model size. Workers are threads over groups of output files (copies and I/O release the
GIL): a file alone, or the tp files of a pipeline stage built together, a step of each in turn,
when they cut blocks of columns from the same source tensors (`planning.lockstep_groups`).
"""

from __future__ import annotations

import contextlib
import gc
import queue
import threading
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import FormatError
from ..formats import Checkpoint, SourceReader, get_format
from ..formats.base import ChunkedWriter, CopyingWriter, RowStreamingWriter, TensorFileWriter, TensorSpec
from ..formats.source_check import SourceStamps
from ..io.data.buffers import one_torch_thread, reused_buffers
from ..io.data.digest import FileRecord
from ..io.data.strided import shared_column_reads
from ..placements import Piece
from .options import ProgressCallback, WriteOptions
from .outputs import OutputFile
from .planning import FilePlan, Plan, TensorPlan, Way, plan_write
from .prefetch import Prefetcher

_GC_LOCK = threading.Lock()
_GC_HOLDERS = 0
_GC_SAVED: tuple[int, ...] = ()
FULL_COLLECTIONS_OFF = 1 << 30
"""The third garbage-collection threshold while `no_full_collections` holds."""


@contextlib.contextmanager
def no_full_collections() -> Iterator[None]:
    """Until the block ends (in any thread), the interpreter collects only its young generations:
    the oldest one holds every object of torch and its imports (200,000+), so one full collection
    in the middle of a small merge is a visible share of its time. Young objects are still
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
def execute(src: Checkpoint, outputs: Sequence[OutputFile], out_root: Path, options: WriteOptions) -> list[FileRecord]:
    """Write every output file from `src` into `out_root`, as `options` say: plan, then run the
    plan. Returns the records of the files written (with the digests `options.digests` asks for).
    With `options.verify_hashes`, each source file the manifest lists is checked (once per file,
    from the bytes the workers read: see `HashCheck`) before this returns: a mismatch raises
    FormatError and nothing is committed."""
    return run(src, plan_write(src, outputs, options), out_root, options)


def run(src: Checkpoint, plan: Plan, out_root: Path, options: WriteOptions) -> list[FileRecord]:
    """Run `plan`: the read-ahead and the check of the sources beside the workers, every group of
    output files by `plan.workers` threads, then the sources are compared with their stamps and
    their check finished, so that nothing is returned (and committed) from changed or corrupt
    sources."""
    ahead = None
    if plan.read_ahead is not None:
        ahead = Prefetcher(plan.read_ahead.spans, once=plan.read_ahead.once, store=src.store)
    hashes = plan.hashes
    builder = _Builder(src, plan, out_root, options, ahead)
    records: list[FileRecord] = []
    with one_torch_thread():  # the work is copies
        if ahead is not None:
            ahead.start()
        try:
            if hashes is not None:
                if ahead is not None:
                    hashes.start(plan.checked, ahead.spans, ahead.requested)
                else:
                    hashes.start(plan.checked)
            _write_all(builder.build, plan.groups, plan.workers, records, builder.cancel, builder.progress.drain)
            builder.stamps.verify()  # every copy is done: a source written to meanwhile is refused before commit
            src.store.verified()  # a source streamed from object storage: checked as fetched, before commit
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
            if ahead is not None:
                ahead.stop()
    return records


class _Progress:
    """Bytes written, reported to `callback` in the thread that made this only (a Ctrl-C or
    SIGTERM raised in a callback then stops the operation, as with one worker); the workers'
    reports wait in a queue until that thread `drain`s them."""

    def __init__(self, callback: ProgressCallback | None, total: int):
        self.callback, self.total, self.done = callback, total, 0
        self.caller = threading.current_thread()
        self.reports: queue.SimpleQueue[int] = queue.SimpleQueue()

    def report(self, nbytes: int) -> None:
        if self.callback is None:
            return
        if threading.current_thread() is self.caller:
            self.done += nbytes
            self.callback(self.done, self.total)
        else:
            self.reports.put(nbytes)

    def drain(self) -> None:
        if self.callback is None:
            return
        moved = 0
        while True:
            try:
                moved += self.reports.get_nowait()
            except queue.Empty:
                break
        if moved:
            self.done += moved
            self.callback(self.done, self.total)


@dataclass
class _Ways:
    """A file's writer as each of its format's abilities, where its file takes them (else None)."""

    copying: CopyingWriter | None
    streaming: RowStreamingWriter | None
    chunked: ChunkedWriter | None


class _Builder:
    """What the workers of one run share (the plan, the sources' read-ahead, check and stamps, the
    progress, the cancel flag); `build` writes a group of output files."""

    def __init__(self, src: Checkpoint, plan: Plan, out_root: Path, options: WriteOptions, ahead: Prefetcher | None):
        self.src, self.plan, self.out_root = src, plan, out_root
        self.format = get_format(options.fmt)
        self.digests = options.digests
        self.sink = options.sink
        self.archive = options.archive
        self.sources = ahead.source_for if ahead is not None else None
        self.ready = plan.read_ahead.waiter(ahead) if ahead is not None and plan.read_ahead is not None else None
        self.advise = plan.read_ahead is None  # sources that do not say where their bytes are: read-ahead hints
        self.stamps = SourceStamps(
            src.store
        )  # the sources as first opened (see io.data.hashing.HashingFile.copy_ranges)
        self.progress = _Progress(options.progress, plan.total)
        self.cancel = threading.Event()

    def build(self, group: Sequence[FilePlan]) -> list[TensorFileWriter]:
        """The files of a group, a step of each in turn (see `planning.lockstep_groups`), one reader
        for all; returns their writers, to be closed."""
        together = len(group) > 1
        shared = shared_column_reads() if together else contextlib.nullcontext()
        with reused_buffers(), shared:  # every tensor read is written and dropped before the next read
            reader = SourceReader(
                self.src,
                index=self.plan.index,
                hashes=self.plan.hashes,
                sources=self.sources,
                ready=self.ready,
                stamps=self.stamps,
            )
            steps: list[Generator[None, None, TensorFileWriter]] = []
            writers: dict[int, TensorFileWriter] = {}
            last = _LastRead(reader)
            try:
                for file in group:
                    steps.append(
                        self.build_body(file, last) if file.out.body is not None else self.build_file(file, reader)
                    )
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

    def build_file(self, file: FilePlan, reader: SourceReader) -> Generator[None, None, TensorFileWriter]:
        """Writes one file: opens its writer, then a step at a time (a tensor, or a window of rows
        of a block of columns: the same steps in every file of a group); returns (StopIteration)
        the writer, to be closed. Closed early (an error, another file of the group failed), it
        aborts."""
        out, tensors = file.out, file.tensors
        specs = [t.spec for t in tensors]
        writer = self.format.writer(
            self.out_root / out.path,
            self.out_root,
            specs,
            out.expert_parallel,
            self.digests,
            self.plan.direct,
            self.sink,
            self.archive,
        )
        # what the writer takes besides whole tensors, as its format's registry entry declares it
        ways = _Ways(self.format.copying(writer), self.format.streaming(writer), self.format.chunked(writer))
        try:
            yield
            for i, tensor in enumerate(tensors):
                if self.cancel.is_set():
                    raise _Cancelled()
                if self.advise and i + 1 < len(tensors):  # a cold disk reads the next piece while this one is written
                    reader.advise(tensors[i + 1].piece)
                yield from _write_tensor(tensor, writer, ways, reader)
                self.progress.report(tensor.spec.nbytes)
                yield
        except BaseException:
            writer.abort()
            raise
        return writer

    def build_body(self, file: FilePlan, last: _LastRead) -> Generator[None, None, TensorFileWriter]:
        """Writes one object file (`OutputFile.body`) as `build_file` writes a rank file, a leaf at
        a step: a constant, or a source piece (read once for the files of its group: `last`)
        made what is written by the leaf's `then`."""
        body = file.out.body
        assert body is not None
        make = self.format.objects
        if make is None:
            raise FormatError(f"{self.format.name} files hold state dicts, not objects such as optimizer shards")
        specs = [leaf.spec for leaf in body.leaves]
        path = self.out_root / file.out.path
        writer = make(
            path,
            self.out_root,
            specs,
            body.data_pkl,
            body.refs,
            body.info,
            self.digests,
            self.plan.direct,
            self.sink,
            self.archive,
        )
        try:
            yield
            for leaf in body.leaves:
                if self.cancel.is_set():
                    raise _Cancelled()
                if leaf.value is not None:
                    tensor, owned = leaf.value, False
                else:
                    assert leaf.piece is not None
                    tensor, owned = last.read(leaf.piece), False
                    if leaf.then is not None:
                        tensor, owned = leaf.then(tensor), True  # a new tensor, this file's alone
                if tensor.dtype != leaf.spec.dtype:
                    tensor, owned = tensor.to(leaf.spec.dtype), True
                writer.write(leaf.spec.name, tensor, owned=owned)
                self.progress.report(leaf.spec.nbytes)
                yield
        except BaseException:
            writer.abort()
            raise
        return writer


class _LastRead:
    """The last source piece read for a group of files built in lockstep: the next file of the
    group asking for the same piece gets it without a second read. Dropped before the next read
    (reads go into reused buffers: `io.data.buffers.reused_buffers`)."""

    def __init__(self, reader: SourceReader):
        self.reader = reader
        self.piece: Piece | None = None
        self.tensor: torch.Tensor | None = None

    def read(self, piece: Piece) -> torch.Tensor:
        if self.tensor is None or self.piece != piece:
            self.piece, self.tensor = None, None
            self.tensor, self.piece = self.reader.read_piece(piece), piece
        return self.tensor


def _write_tensor(
    tensor: TensorPlan, writer: TensorFileWriter, ways: _Ways, reader: SourceReader
) -> Generator[None, None, None]:
    """Write one tensor the first of its planned ways that its file and its sources allow (a step
    for each window of rows after the first, when streamed as rows)."""
    piece, spec = tensor.piece, tensor.spec
    for way in tensor.ways:
        if way is Way.COPY and ways.copying is not None:
            # bytes that move unchanged are copied by the kernel (see HashingFile.copy_ranges)
            ranges = reader.byte_ranges(piece)
            if ranges is not None:
                ways.copying.write_copy(piece.name, ranges)
                return
        elif way is Way.ROWS and ways.streaming is not None:
            windows = reader.column_windows(piece)
            if windows is not None:
                yield from _write_rows(ways.streaming, piece, spec, windows, reader)
                return
        elif way is Way.CHUNKS and ways.chunked is not None:
            blocks = reader.row_blocks(piece)
            if blocks is not None:
                ways.chunked.write_chunks(piece.name, blocks, owned=True)
                return
        elif way is Way.WHOLE:
            _write_whole(writer, piece, spec, reader)
            return


def _write_rows(
    writer: RowStreamingWriter,
    piece: Piece,
    spec: TensorSpec,
    windows: Sequence[tuple[int, int]],
    reader: SourceReader,
) -> Generator[None, None, None]:
    """A block of columns as blocks of rows, each cut from a window of source rows read once for
    the group; a step between windows, so that every file of the group cuts its columns of a
    window before the next is read."""
    rows = writer.begin_rows(piece.name)
    for k, (first, last) in enumerate(windows):
        if k:
            yield
        block = reader.read_column_rows(piece, first, last)
        rows.add(block if block.dtype == spec.dtype else block.to(spec.dtype))
        del block
    rows.end()


def _write_whole(writer: TensorFileWriter, piece: Piece, spec: TensorSpec, reader: SourceReader) -> None:
    tensor = reader.read_piece(piece)
    if tensor.dtype != spec.dtype:
        tensor = tensor.to(spec.dtype)
    if tuple(tensor.shape) != piece.shape:
        raise FormatError(f"{piece.name}: read shape {tuple(tensor.shape)}, expected {piece.shape}")
    writer.write(piece.name, tensor, owned=True)  # read for this file alone: never changed


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
    most `io.data.hashing.WRITE_BEHIND_ALL` in all); a failure waits for the files being closed (they are
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
