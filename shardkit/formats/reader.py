"""Reading slices of full tensors out of any checkpoint, whatever its layout.

A `SourceReader` answers "give me rows a..b of full tensor X" by locating the pieces that hold
them (`SegmentIndex.locate`) and reading exactly those bytes from the files, positionally.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from ..errors import FormatError
from ..placements import Piece, Read, Segment, SegmentIndex, build_piece
from .base import TensorFile

if TYPE_CHECKING:
    from .checkpoint import Checkpoint


class SourceReader:
    """Reads slices of a checkpoint's pieces. Readers hold only metadata and a file descriptor
    (bytes are read positionally, nothing is mapped), so files stay open, up to `max_open`."""

    def __init__(self, ckpt: "Checkpoint", max_open: int = 256, index: SegmentIndex | None = None):
        self.ckpt = ckpt
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
            self._open[key] = self.ckpt.open(key)
        return self._open[key]

    def read(self, r: Read) -> torch.Tensor:
        """One read: a slice of a source piece, in the full tensor's orientation."""
        file = self._file(r.holder)
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
        out = torch.empty(piece.shape, dtype=self.dtype_of(piece.slabs[0][0].source))
        row = 0
        for r in reads:
            block = out.narrow(0, row, r.stop - r.start)
            file = self._file(r.holder)
            if r.slab is not None or not file.read_into(r.piece_name, r.start, r.stop, block):
                block.copy_(self.read(r))
            row += r.stop - r.start
        return out

    def row_blocks(self, piece: Piece):
        """A piece as consecutive blocks of rows, when its bytes are simply its reads one after
        another (one slab, concatenated along dim 0): streamed without assembling the piece."""
        if piece.stacked or piece.transposed or piece.cat_dim != 0:
            return None
        return (self.read(r) for seg in piece.slabs[0] for r in self.index.locate(seg))

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
                    rows = self._file(r.holder).read(r.piece_name, 0, start, stop)
                    parts.append(rows.narrow(dim, r.start, r.stop - r.start))
                continue
            key = (r.holder, r.piece_name, r.slab)
            if key not in self._kept:
                file = self._file(r.holder)
                self._kept[key] = (file.read(r.piece_name, 0, r.slab, r.slab + 1)[0] if r.slab is not None
                                   else file.read(r.piece_name))
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
        return self._file(holdings[0].holder).dtype(holdings[0].piece_name)

    def close(self) -> None:
        self.forget()
        for reader in self._open.values():
            reader.close()
        self._open.clear()
