"""PyTorch DCP folders on disk: their metadata read safely, chunks read positionally, data files
written streaming, `.metadata` written with torch's own classes (the format on top: `dcp.py`).

A DCP folder (`torch.distributed.checkpoint`'s `FileSystemWriter`) is a `.metadata` pickle and
data files `__<rank>_<n>.distcp`. The metadata lists every entry of the saved state dict under its
flattened name (`a.b.c`, with `planner_data` giving the nested path): a tensor is a global shape,
a dtype and the chunks it was saved in (offsets and sizes in the global tensor); anything else is
bytes. `storage_data` says where each chunk or object is: (file, byte offset, length). Each
tensor chunk is one whole `torch.save` archive of the chunk at that offset, each object the
`torch.save` bytes of it (see docs/FORMATS.md, "PyTorch DCP").

Reading never loads a file: the metadata is unpickled with only DCP's own classes allowed, each
chunk's archive directory is read to find its data (`torch_io.embedded_tensor`), and slices are
read positionally from there. Writing appends one archive per chunk to a rank's file
(`DcpFileWriter`, shardkit's zip writer: the bytes `torch.save` writes), and returns where each
went (`ChunkedRecord`), from which `finish_folder` writes `.metadata` once every file is written,
under torchrun too.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import math
import os
import pickle
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .. import torch_compat
from ..errors import FormatError
from ..io.data.buffers import array_view
from ..io.data.copy import FileRange
from ..io.data.digest import FileRecord, Recording
from ..io.data.hashing import HashingFile
from ..io.data.strided import StoredTensor, read_stored
from ..io.data.taps import DescriptorReader, pread_exact
from ..io.safety.durable import write_bytes
from ..io.safety.sinks import NO_SINK, Sink
from ..io.safety.small import PICKLE_LIMIT, read_small
from ..io.store import Store
from ..paths import inside
from .base import DiscardOnFailure, TensorSpec, compact, tensor_bytes
from .torch_io import regular, tensor_pickle, torch_save, written_natively
from .torch_metadata import embedded_tensor, parsed_once
from .torch_zip import ZipRecords

log = logging.getLogger(__name__)

METADATA = ".metadata"
SUFFIX = ".distcp"

Path_ = tuple[str | int, ...]


@dataclass(frozen=True)
class Chunk:
    """One saved part of a tensor: where it sits in the global tensor, and where its archive is."""

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int
    dtype: torch.dtype | None = None  # the metadata's (checked against the archive's when read)

    @property
    def name(self) -> str:
        """The chunk's name in the reader of its file: `fqn@o0,o1,...`."""
        return f"{self.fqn}@{','.join(map(str, self.offsets))}"


@dataclass(frozen=True)
class Entry:
    """A tensor of the state dict: its global shape and dtype, and its chunks."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Blob:
    """A non-tensor value of the state dict, stored as its `torch.save` bytes."""

    fqn: str
    file: str
    offset: int
    length: int


_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        ("torch.distributed.checkpoint.metadata", n)
        for n in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata`: only DCP's metadata classes, torch sizes, dtypes and layouts, and paths
    (a checkpoint id) may be named; anything else is refused, never run."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _ALLOWED:
            raise FormatError(f"{module}.{name}")
        return super().find_class(module, name)


@dataclass
class DcpFolder:
    """A DCP folder's metadata, checked: tensors, objects, each entry's nested path."""

    root: Path
    tensors: dict[str, Entry]
    objects: dict[str, Blob]
    paths: dict[str, Path_]

    def files(self) -> list[str]:
        """The data files the metadata refers to, sorted."""
        names = {c.file for e in self.tensors.values() for c in e.chunks} | {b.file for b in self.objects.values()}
        return sorted(names)

    def object(self, fqn: str) -> Any:
        """A saved non-tensor value (plain data only: weights-only unpickling)."""
        blob = self.objects[fqn]
        if blob.length > PICKLE_LIMIT:
            raise FormatError(f"{self.root}: {fqn} is {blob.length} bytes, more than a saved value should be")
        path = inside(self.root, blob.file, "DCP data file")
        fd = os.open(regular(path, "DCP data file"), os.O_RDONLY)
        try:
            data = os.pread(fd, blob.length, blob.offset)
        finally:
            os.close(fd)
        if len(data) != blob.length:
            raise FormatError(f"{path} is truncated (the value of {fqn} is cut short): re-create the checkpoint")
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure of the weights-only unpickler is a bad file
            raise FormatError(
                f"{path}: the value of {fqn} is corrupt or not plain data ({str(e).splitlines()[0][:120]})"
            ) from None


def read_folder(root: Path) -> DcpFolder:
    """The metadata of the DCP folder `root`, parsed and checked once per file version."""
    path = Path(root) / METADATA
    regular(path, "DCP metadata")
    return parsed_once(path, "dcp", _parse)


def _parse(path: Path) -> DcpFolder:
    root = path.parent
    raw = read_small(path, "DCP metadata", PICKLE_LIMIT)
    try:
        md = _MetadataUnpickler(io.BytesIO(raw)).load()
    except FormatError as e:
        raise FormatError(
            f"refusing to load {path}: it names {e}, which DCP metadata never holds; shardkit never runs "
            "arbitrary pickle"
        ) from None
    except Exception as e:  # noqa: BLE001 - a cut or garbled pickle
        raise FormatError(f"{path} is truncated or corrupt ({type(e).__name__}): re-create the checkpoint") from None
    try:
        entries, storage = dict(md.state_dict_metadata), dict(md.storage_data or {})
        planner = dict(md.planner_data or {})
    except (AttributeError, TypeError, ValueError):
        raise FormatError(f"{path} is not DCP metadata: re-create the checkpoint") from None
    where: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for index, info in storage.items():
        if getattr(info, "transform_descriptors", None):
            raise FormatError(
                f"{path}: {index.fqn} is stored transformed ({info.transform_descriptors}); shardkit reads "
                "plain DCP files only"
            )
        offset = None if index.offset is None else tuple(int(v) for v in index.offset)
        where[(index.fqn, offset)] = info
    tensors, objects = {}, {}
    for fqn, meta in entries.items():
        if not isinstance(fqn, str):
            raise FormatError(f"{path} is corrupt (an entry named {fqn!r}): re-create the checkpoint")
        info = where.get((fqn, None))
        if type(meta).__name__ == "BytesStorageMetadata":
            if info is None:
                raise FormatError(f"{path}: no data file holds {fqn}: the checkpoint is incomplete")
            objects[fqn] = Blob(fqn, _file(root, info.relative_path), int(info.offset), int(info.length))
            continue
        tensors[fqn] = _entry(path, root, fqn, meta, where)
    paths = {k: tuple(v) for k, v in planner.items() if isinstance(v, (tuple, list))}
    return DcpFolder(root, tensors, objects, paths)


def _file(root: Path, name: Any) -> str:
    """A data file's name, which must be a plain file name inside the folder."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise FormatError(f"{root / METADATA} names a data file {name!r} outside its folder: refusing it")
    return name


def _entry(path: Path, root: Path, fqn: str, meta: Any, where: Mapping) -> Entry:
    """A tensor entry with its chunks located and checked (inside the tensor, tiling it)."""
    shape = tuple(int(v) for v in meta.size)
    if any(n < 0 or n >= 1 << 63 for n in shape) or math.prod(shape) >= 1 << 63:
        raise FormatError(f"{path}: {fqn} has the impossible shape {list(shape)}: the metadata is corrupt")
    dtype = meta.properties.dtype
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"{path}: {fqn} has no dtype: the metadata is corrupt")
    chunks = []
    for c in meta.chunks:
        offsets, sizes = tuple(int(v) for v in c.offsets), tuple(int(v) for v in c.sizes)
        if (
            len(offsets) != len(shape)
            or len(sizes) != len(shape)
            or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape))
        ):
            raise FormatError(f"{path}: a chunk of {fqn} lies outside its shape {list(shape)}: the metadata is corrupt")
        info = where.get((fqn, offsets))
        if info is None:
            raise FormatError(f"{path}: no data file holds the chunk of {fqn} at {list(offsets)}: it is incomplete")
        file = _file(root, info.relative_path)
        chunks.append(Chunk(fqn, offsets, sizes, file, int(info.offset), int(info.length), dtype))
    problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in chunks])
    if problem is not None:
        raise FormatError(f"{path}: the chunks of {fqn} {problem}: the metadata is corrupt (re-create the checkpoint)")
    return Entry(fqn, shape, dtype, tuple(chunks))


def tiling_problem(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """None when the boxes (offsets, sizes), each inside `shape`, cover every element of the tensor
    exactly once; else what is wrong ("do not tile its shape [..]: element [..] is in no chunk"),
    naming an element in no box or in several. Exact for any number of boxes and axes.

    Axes every box spans whole are left out; boxes cut along one axis are intervals that must
    follow each other (sorted); along several, corners are counted (`_corner_problem`)."""
    if not math.prod(shape):
        return None  # no elements (every box inside it is empty)
    live = [(tuple(o), tuple(s)) for o, s in boxes if math.prod(s)]
    cut = [k for k, n in enumerate(shape) if any(o[k] != 0 or s[k] != n for o, s in live)]
    found: _Miscount | str | None
    if not cut:
        found = None if len(live) == 1 else ((), len(live))
    elif len(cut) == 1:
        found = _interval_problem(shape[cut[0]], live, cut[0])
    else:
        sub = [shape[k] for k in cut]
        found = _corner_problem(sub, [(tuple(o[k] for k in cut), tuple(s[k] for k in cut)) for o, s in live])
        if isinstance(found, str):
            return f"cut it along too many axes to check that they tile its shape {list(shape)} ({found})"
    if found is None:
        return None
    where, covered = found
    element = [0] * len(shape)
    for k, v in zip(cut, where):
        element[k] = v
    what = "in no chunk (a gap)" if covered == 0 else "in more than one chunk (an overlap)"
    return f"do not tile its shape {list(shape)}: element {element} is {what}"


_Miscount = tuple[tuple[int, ...], int]
"""An element (its coordinates along the cut axes) and how many boxes cover it."""


def _interval_problem(n: int, live: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], k: int) -> _Miscount | None:
    """Boxes cut along axis k only: ((element,), times covered) where they do not tile [0, n)."""
    end = 0
    for start, size in sorted((o[k], s[k]) for o, s in live):
        if start != end:
            return ((end,), 0) if start > end else ((start,), 2)
        end = start + size
    return None if end == n else ((end,), 0)


CORNER_BUDGET = 1 << 22
"""Corners (beyond 8 per chunk) `_corner_problem` counts before it refuses a tensor as cut along
too many axes to check: torch's chunks (a mesh axis per cut tensor axis) stay far below."""


def _corner_problem(
    shape: Sequence[int], live: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]
) -> _Miscount | str | None:
    """Whether non-empty boxes inside `shape` cover each element once: None, or (element, times
    covered) of the first element (row-major) where not, or a string when too costly to check.

    A box's indicator, on the tensor's elements, is a signed sum of orthant indicators ("every
    element >= p"), one per corner p: its start on every axis, or its end on the axes where it
    ends inside the tensor, signed by how many ends it takes. Orthant indicators of distinct
    points are linearly independent, so the boxes cover each element once iff their corners'
    signed counts equal the tensor's own (+1 at the origin, 0 elsewhere); and at the first point
    where they differ, the element's coverage differs from 1 by exactly that point's count."""
    starts = np.array([o for o, _ in live], dtype=np.int64).reshape(len(live), len(shape))
    ends = starts + np.array([s for _, s in live], dtype=np.int64).reshape(len(live), len(shape))
    inside = ends < np.array(shape, dtype=np.int64)
    patterns, which = np.unique(inside, axis=0, return_inverse=True)
    which = which.reshape(-1)
    sizes = np.bincount(which, minlength=len(patterns))
    corners = sum(int(n) << int(p.sum()) for p, n in zip(patterns, sizes))
    if corners > CORNER_BUDGET + 8 * len(live):
        return f"{corners} corners"
    points, signs = [np.zeros((1, len(shape)), dtype=np.int64)], [np.array([-1], dtype=np.int64)]
    for index, pattern in enumerate(patterns):
        rows = which == index
        lo, hi, axes = starts[rows], ends[rows], np.flatnonzero(pattern)
        for ends_at in itertools.product((False, True), repeat=len(axes)):
            pick = np.zeros(len(shape), dtype=bool)
            pick[axes[list(ends_at)]] = True
            points.append(np.where(pick, hi, lo))
            signs.append(np.full(len(lo), -1 if sum(ends_at) % 2 else 1, dtype=np.int64))
    at, sign = np.concatenate(points), np.concatenate(signs)
    order = np.lexsort(at.T[::-1])
    at, sign = at[order], sign[order]
    first = np.ones(len(at), dtype=bool)
    first[1:] = (at[1:] != at[:-1]).any(axis=1)
    groups = np.flatnonzero(first)
    counts = np.add.reduceat(sign, groups)
    wrong = np.flatnonzero(counts)
    if not len(wrong):
        return None
    return tuple(int(v) for v in at[groups[wrong[0]]]), 1 + int(counts[wrong[0]])


class ChunkFile(DescriptorReader):
    """One data file's chunks, each located on first use (its archive's directory and pickle)."""

    def __init__(self, path: Path, store: Store | None = None):
        """`store`: what the file is read through (default: a local folder)."""
        self.path = regular(Path(path), "DCP data file")
        self._file = (store if store is not None else Store(self.path.parent)).open(self.path, "DCP data file")
        self._stored: dict[tuple[int, int], StoredTensor] = {}

    def stored(self, chunk: Chunk) -> StoredTensor:
        key = (chunk.offset, chunk.length)
        if key not in self._stored:
            found = embedded_tensor(self.path, chunk.offset, chunk.length)
            if tuple(found.shape) != chunk.sizes or chunk.dtype not in (None, found.dtype):
                raise FormatError(
                    f"{self.path}: the chunk of {chunk.fqn} at {list(chunk.offsets)} holds {list(found.shape)} "
                    f"{found.dtype}, its metadata says {list(chunk.sizes)} {chunk.dtype}: the checkpoint is corrupt"
                )
            self._stored[key] = found
        return self._stored[key]

    def read_chunk(self, chunk: Chunk, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        return read_stored(self._open_file, self.stored(chunk), dim, start, stop, str(self.path))

    def close(self) -> None:
        self._close_fd()


def read_global(
    folder: DcpFolder,
    files: dict[str, ChunkFile],
    fqn: str,
    dim: int = 0,
    start: int | None = None,
    stop: int | None = None,
) -> torch.Tensor:
    """The slice [start, stop) along `dim` of the global tensor `fqn`, assembled from the chunks it
    meets (each read positionally, only the part the slice needs); `files` keeps the data files open."""
    entry = folder.tensors[fqn]
    if not entry.shape:
        return _chunk_file(folder, files, entry.chunks[0]).read_chunk(entry.chunks[0])
    start = 0 if start is None else start
    stop = entry.shape[dim] if stop is None else stop
    shape = list(entry.shape)
    shape[dim] = stop - start
    out = torch.empty(shape, dtype=entry.dtype)
    for c in entry.chunks:
        lo, hi = max(start, c.offsets[dim]), min(stop, c.offsets[dim] + c.sizes[dim])
        if lo >= hi or not math.prod(c.sizes):
            continue
        part = _chunk_file(folder, files, c).read_chunk(c, dim, lo - c.offsets[dim], hi - c.offsets[dim])
        where = [slice(o, o + s) for o, s in zip(c.offsets, c.sizes)]
        where[dim] = slice(lo - start, hi - start)
        out[tuple(where)] = part
    return out


def read_tensor(folder: DcpFolder, fqn: str) -> torch.Tensor:
    """One whole (small) tensor of the folder, its files closed again."""
    files: dict[str, ChunkFile] = {}
    try:
        return read_global(folder, files, fqn)
    finally:
        for f in files.values():
            f.close()


def _chunk_file(folder: DcpFolder, files: dict[str, ChunkFile], chunk: Chunk) -> ChunkFile:
    if chunk.file not in files:
        files[chunk.file] = ChunkFile(inside(folder.root, chunk.file, "DCP data file"))
    return files[chunk.file]


class _At:
    """`out` as seen from byte `base`: the zip writer's offsets count from its archive's start, as
    torch's writer counts them (DCP appends one archive per chunk to a file)."""

    def __init__(self, out: HashingFile):
        self.out, self.base = out, out.size

    @property
    def size(self) -> int:
        return self.out.size - self.base

    def write(self, data: Any) -> int:
        return self.out.write(data)

    def write_owned(self, data: Any, owner: object) -> int:
        return self.out.write_owned(data, owner)

    def flush(self) -> None:
        self.out.flush()

    def copy_ranges(self, ranges: Iterable[FileRange], seen: Any, after: Any, after_size: int) -> int:
        return self.out.copy_ranges(ranges, seen, after, after_size)


def from_ranges(ranges: Iterable[FileRange], spec: TensorSpec) -> torch.Tensor:
    """The tensor of `spec` whose bytes are `ranges`' bytes one after another, read into memory."""
    data = torch.empty(spec.nbytes, dtype=torch.uint8)
    view, at = array_view(data.numpy()), 0
    for r in ranges:
        pread_exact(r.file, view[at : at + r.length], r.offset, r.what)
        at += r.length
    if at != spec.nbytes:
        raise RuntimeError(f"{spec.name}: {at} bytes in its ranges, expected {spec.nbytes}")
    return data.view(spec.dtype).reshape(spec.shape)


def _archive(
    out: HashingFile,
    spec: TensorSpec,
    blocks: Iterable[torch.Tensor] = (),
    owned: bool = False,
    ranges: Iterable[FileRange] | None = None,
) -> None:
    """`torch.save(tensor, out)` appended at `out`'s end, as DCP writes a chunk, the tensor of
    `spec` handed over as consecutive blocks of rows (one block: the whole tensor) or as source
    byte `ranges` the kernel copies: shardkit's zip writer when it writes torch's bytes, else
    torch's own writer (the tensor assembled first)."""
    data_pkl = tensor_pickle(spec)
    if not written_natively([spec], data_pkl):
        parts = [from_ranges(ranges, spec)] if ranges is not None else [compact(b.detach()) for b in blocks]
        torch_save(torch.cat(parts).reshape(spec.shape) if len(parts) > 1 else parts[0].reshape(spec.shape), out)
        return
    records = ZipRecords(_At(out), torch_compat.zip_options()[1])
    records.add("data.pkl", data_pkl)
    alignment = str(torch_compat.zip_options()[1]).encode()
    for name, value in ((".format_version", b"1"), (".storage_alignment", alignment), ("byteorder", b"little")):
        records.add(name, value)
    if ranges is not None:
        records.add_copied("data/0", ranges, spec.nbytes)
        records.finish()
        return
    entry = records.begin("data/0", spec.nbytes)
    for block in blocks:
        block = compact(block.detach())
        if block.dtype != spec.dtype:
            raise RuntimeError(f"{spec.name}: a block of {block.dtype}, expected {spec.dtype}")
        records.append(entry, tensor_bytes(block), block if owned else None)
    records.end(entry)
    records.finish()


class Item(NamedTuple):
    """Where one entry of a data file went: its flat name, nested path, byte offset and length;
    for a tensor also the chunk's offsets and sizes, the global shape and the dtype."""

    fqn: str
    path: tuple[str | int, ...]
    offset: int
    length: int
    offsets: tuple[int, ...] | None = None
    sizes: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class ChunkedRecord(FileRecord):
    """A DCP data file written: its record, and where each of its entries went (for `.metadata`)."""

    items: tuple[Item, ...] = ()


class DcpFileWriter(DiscardOnFailure):
    """Writes one DCP data file: tensors (whole, or a chunk at `offsets` of a global `shape`) and
    plain values, appended as DCP writes them; `close` returns a `ChunkedRecord` saying where each
    went, from which `finish_folder` writes `.metadata`. A failure deletes the file."""

    def __init__(
        self,
        path: Path,
        root: Path,
        digests: Recording = Recording.FAST,
        direct: bool = False,
        sink: Sink = NO_SINK,
    ):
        self.path, self.root = Path(path), Path(root)
        self._out: HashingFile | None = HashingFile(self.path, self.root, digests=digests, direct=direct, sink=sink)
        self._items: list[Item] = []

    def add_tensor(
        self,
        fqn: str,
        tensor: torch.Tensor,
        *,
        offsets: Sequence[int] | None = None,
        shape: Sequence[int] | None = None,
        path: Sequence[str | int] | None = None,
        owned: bool = False,
    ) -> None:
        """A tensor (or its chunk at `offsets` of the global `shape`) under the flat name `fqn`."""
        spec = TensorSpec(fqn, tuple(tensor.shape), tensor.dtype)
        self.add_rows(spec, [tensor], offsets=offsets, shape=shape, path=path, owned=owned)

    def add_rows(
        self,
        spec: TensorSpec,
        blocks: Iterable[torch.Tensor],
        *,
        offsets: Sequence[int] | None = None,
        shape: Sequence[int] | None = None,
        path: Sequence[str | int] | None = None,
        owned: bool = False,
        ranges: Iterable[FileRange] | None = None,
    ) -> None:
        """`add_tensor` of the tensor `spec` (named `spec.name`) handed over as consecutive blocks
        of rows, never assembled: memory holds a block; or (`ranges`) as source byte ranges the
        kernel copies."""
        with self._discarding():
            out = self._live()
            start = out.size
            _archive(out, spec, blocks, owned, ranges)
            at = tuple(offsets) if offsets is not None else (0,) * len(spec.shape)
            full = tuple(shape) if shape is not None else spec.shape
            dtype = str(spec.dtype).replace("torch.", "")
            self._items.append(
                Item(spec.name, tuple(path or (spec.name,)), start, out.size - start, at, spec.shape, full, dtype)
            )

    def add_object(self, fqn: str, value: Any, *, path: Sequence[str | int] | None = None) -> None:
        """A plain value, as DCP stores one: its `torch.save` bytes."""
        with self._discarding():
            out = self._live()
            buf = io.BytesIO()
            torch.save(value, buf)
            start = out.size
            out.write(buf.getvalue())
            self._items.append(Item(fqn, tuple(path or (fqn,)), start, out.size - start))

    def _live(self) -> HashingFile:
        if self._out is None:
            raise RuntimeError(f"{self.path}: the writer is closed or was aborted")
        return self._out

    def close(self, fsync: bool = False) -> list[FileRecord]:
        with self._discarding():
            record = self._live().close(fsync)
            self._out = None
        return [
            ChunkedRecord(
                record.path, record.size, record.sha256, record.xxh3_128, blocks=record.blocks, items=tuple(self._items)
            )
        ]

    def abort(self) -> None:
        out, self._out = getattr(self, "_out", None), None
        if out is not None:
            out.abort()

    def _unfinished(self) -> bool:
        return getattr(self, "_out", None) is not None


def finish_folder(folder: Path, records: Iterable[FileRecord], root: Path | None = None) -> list[Path]:
    """Write `folder/.metadata` for the data files `records` (their `ChunkedRecord` items; paths
    relative to `root`, default `folder`) with torch's own metadata classes, as
    `FileSystemWriter.finish` does. Returns the files written ([.metadata])."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder = Path(folder)
    root = Path(root) if root is not None else folder
    chunked = [r for r in records if isinstance(r, ChunkedRecord) and (root / r.path).parent == folder]
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple] = {}
    for record in sorted(chunked, key=lambda r: _rank_order(Path(r.path).name)):
        name = Path(record.path).name
        for item in record.items:
            planner[item.fqn] = tuple(item.path)
            info = _StorageInfo(name, item.offset, item.length)
            if item.offsets is None or item.sizes is None or item.shape is None or item.dtype is None:
                entries[item.fqn] = BytesStorageMetadata()
                storage[MetadataIndex(item.fqn)] = info
                continue
            if item.fqn not in entries:
                props = TensorProperties(dtype=getattr(torch, item.dtype))
                entries[item.fqn] = TensorStorageMetadata(props, torch.Size(item.shape), [])
            chunks = entries[item.fqn].chunks
            storage[MetadataIndex(item.fqn, item.offsets, len(chunks))] = info
            chunks.append(ChunkStorageMetadata(torch.Size(item.offsets), torch.Size(item.sizes)))
    seed = json.dumps(sorted(planner)).encode()
    meta = StorageMeta(checkpoint_id=None, save_id=str(uuid.uuid5(uuid.NAMESPACE_OID, seed.hex()[:4096])))
    write_bytes(folder / METADATA, pickle.dumps(Metadata(entries, planner, storage, meta, "1.0.0")), fsync=False)
    return [folder / METADATA]


def _rank_order(name: str) -> tuple[int, ...]:
    parts = name.split(SUFFIX)[0].strip("_").split("_")
    return tuple(int(p) if p.isdigit() else 0 for p in parts)


def data_file(rank: int) -> str:
    """The data file DCP's `FileSystemWriter` gives a rank (one file per rank)."""
    return f"__{rank}_0{SUFFIX}"
