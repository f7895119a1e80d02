"""Reading slices of full tensors out of any checkpoint, whatever its layout.

A `SourceReader` answers "give me rows a..b of full tensor X" by locating the pieces that hold
them (`SegmentIndex.locate`) and reading exactly those bytes from the files, positionally.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import torch

from ..errors import FormatError
from ..io.data.buffers import empty_tensor
from ..io.data.copy import FileRange
from ..io.data.strided import window_rows
from ..io.data.taps import ReadSource
from ..placements import Piece, Read, Segment, SegmentIndex, build_piece
from .base import TensorFile
from .source_check import HashCheck, SourceStamps

if TYPE_CHECKING:
    from .source import Checkpoint


COLUMN_BLOCK_BYTES = 4 << 20
"""A matrix assembled along dim 1 for a writer that takes row blocks is streamed in blocks of
about this many bytes (not assembled whole: a merged 7B MLP weight is 86 MiB of fresh memory)."""


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
