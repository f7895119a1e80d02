"""safetensors, read and written by shardkit itself (the safetensors library is not used).

Reading: the header once, then positional reads of exactly the bytes a slice spans. The header
is held to the rules the safetensors library enforces (`safe_open` refuses the same files): a
JSON object without duplicate keys, known dtypes, non-negative integer shapes and offsets, and
tensors that tile the data section exactly (starting at 0, no gaps, no overlaps, nothing after
the last one). Writing: the safetensors library can only save a complete dict of tensors;
shardkit knows every shape in advance, so it writes the header first and then each tensor's
bytes as it is assembled, which keeps peak memory at one tensor. The bytes follow the format's
specification: an 8-byte little-endian header length, a JSON header (`dtype`, `shape`,
`data_offsets` per tensor and `__metadata__`) padded with spaces to 8 bytes, then the data.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..errors import FormatError, ShardkitError
from ..io.data.copy import FileRange
from ..io.data.digest import FileRecord, Recording
from ..io.data.hashing import HashingFile
from ..io.data.strided import (
    StoredTensor,
    advise_stored,
    byte_span,
    read_block,
    read_rows_into,
    read_stored,
    stored_range,
)
from ..io.data.taps import DescriptorReader, OpenFile
from ..io.safety.sinks import NO_SINK, Sink
from ..io.store import Store
from .base import DiscardOnFailure, RowBlocks, TensorSpec, check_specs, tensor_bytes
from .torch_io import regular

_DTYPE_TO_ST = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}
# every dtype of the safetensors format, with its size in bits (the library's own list)
_ST_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
MAX_HEADER = 100_000_000  # bytes, as the safetensors library


def _open(path: Path, store: Store | None = None) -> tuple[OpenFile, int]:
    """(the open file, its size) of a regular file, opened through `store` (default: a local
    folder) without blocking: a FIFO or device in place of a weight file is refused, never waited on."""
    path = regular(Path(path), "safetensors file")
    try:
        file = (store if store is not None else Store(path.parent)).open(path, "safetensors file")
    except ShardkitError as e:
        raise FormatError(str(e)) from None
    return file, os.fstat(file.fd).st_size


def _pread(fd: int, n: int, offset: int) -> bytes:
    parts, done = [], 0
    while done < n:
        chunk = os.pread(fd, n - done, offset + done)
        if not chunk:
            break
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


class _HeaderError(ValueError):
    """Why a header is refused."""


class _Truncated(_HeaderError):
    """The header describes more data than the file holds."""


def _no_duplicates(pairs: list) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice (which would hide a tensor)."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise _HeaderError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _bad_constant(name: str):
    raise _HeaderError(f"{name} is not JSON")


def _natural(value) -> bool:
    return type(value) is int and value >= 0


def _parse(path: Path, fd: int, size: int) -> tuple[dict, int]:
    """The validated header of the open safetensors file and where its data starts."""
    if size < 8:
        raise FormatError(f"{path} is empty or truncated ({size} bytes): re-create it")
    (length,) = struct.unpack("<Q", _pread(fd, 8, 0))
    if length > MAX_HEADER:
        raise FormatError(f"{path} has a corrupt safetensors header (claims {length} bytes): re-create it")
    if 8 + length > size:
        raise FormatError(f"{path} is truncated inside its header: re-create it")
    raw = _pread(fd, length, 8)
    try:
        text = raw.decode("utf-8")
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_bad_constant)
        if not isinstance(header, dict):
            raise _HeaderError("it is not a JSON object")
        _check_entries(header, size - 8 - length)
    except UnicodeDecodeError:
        raise FormatError(f"{path} has a corrupt safetensors header (not UTF-8): re-create it") from None
    except _Truncated as e:
        raise FormatError(f"{path} is truncated ({e}): re-create it") from None
    except (_HeaderError, ValueError, RecursionError) as e:
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise FormatError(f"{path} has a corrupt safetensors header ({reason}): re-create it") from None
    return header, 8 + length


def _check_entries(header: dict, data_size: int) -> None:
    """The rules of the safetensors library: metadata is str -> str; each tensor has a known
    dtype, a shape of non-negative ints and [begin, end] offsets matching its size; sorted by
    offset, the tensors cover the data section exactly."""
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if info is not None and (not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values())):
                raise _HeaderError("__metadata__ is not a map of strings to strings")
            continue
        if not isinstance(info, dict):
            raise _HeaderError(f"tensor {name!r} is described by a {type(info).__name__}, not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _ST_BITS:
            raise _HeaderError(f"tensor {name!r} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_natural(n) for n in shape):
            raise _HeaderError(f"tensor {name!r} has an invalid shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_natural(n) for n in offsets)
            or offsets[0] > offsets[1]
        ):
            raise _HeaderError(f"tensor {name!r} has invalid data_offsets {offsets!r}")
        bits = _ST_BITS[dtype]
        for n in shape:
            bits *= n
        if bits != 8 * (offsets[1] - offsets[0]):
            raise _HeaderError(
                f"tensor {name!r}: data_offsets span {offsets[1] - offsets[0]} bytes, "
                f"its shape {shape} of {dtype} needs {bits / 8:g}"
            )
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    end = 0
    for begin, stop, name in spans:
        if begin < end:
            raise _HeaderError(f"tensor {name!r} overlaps the tensor before it")
        if begin > end:
            raise _HeaderError(
                f"the data does not start at 0: the first tensor, {name!r}, starts at {begin}"
                if end == 0
                else f"a gap of {begin - end} bytes lies before tensor {name!r}"
            )
        end = stop
    if end > data_size:
        raise _Truncated(f"its tensors need {end} bytes of data, it holds {data_size}")
    if end < data_size:
        raise _HeaderError(f"{data_size - end} bytes follow the last tensor")


class SafetensorsFile(DescriptorReader):
    """Lazy reader: the header once, then positional reads of exactly the bytes a slice spans.

    (safetensors' own `safe_open` memory-maps the file, and the tensors it returns keep that
    mapping alive: the pages of every byte read would stay in this process's resident memory.)"""

    def __init__(self, path: Path, store: Store | None = None):
        """`store`: what the file is read through (default: a local folder)."""
        self.path = Path(path)
        file, size = _open(self.path, store)
        try:
            header, data_start = _parse(self.path, file.fd, size)
            self._tensors: dict[str, StoredTensor] = {}
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if info["dtype"] not in _ST_TO_DTYPE:
                    raise FormatError(
                        f"{self.path}: tensor {name} has dtype {info['dtype']}, which shardkit does not "
                        f"read (it reads {', '.join(sorted(_ST_TO_DTYPE))})"
                    )
                self._tensors[name] = StoredTensor(
                    _ST_TO_DTYPE[info["dtype"]], tuple(info["shape"]), data_start + info["data_offsets"][0]
                )
        except BaseException:
            file.close()
            raise
        self._file = file

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._tensors[name].dtype

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        return read_stored(self._open_file, self._tensors[name], dim, start, stop, str(self.path))

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows [start, stop) straight into `out`; False when not possible (then use read)."""
        return read_rows_into(self._open_file, self._tensors[name], start, stop, out, str(self.path))

    def read_block(self, name: str, first: int, last: int, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows [first, last), columns [start, stop) of a matrix into `out` (see `io.data.strided.read_block`)."""
        return read_block(self._open_file, self._tensors[name], first, last, start, stop, out, str(self.path))

    def advise(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> None:
        """Start reading a slice's bytes in the background (see `advise_stored`)."""
        advise_stored(self._open_file.fd, self._tensors[name], dim, start, stop)

    def byte_range(
        self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None
    ) -> FileRange | None:
        """The file bytes of a slice, when the kernel can copy them as they are (`stored_range`)."""
        return stored_range(self._open_file, self._tensors[name], dim, start, stop, str(self.path))

    def span(self, name: str) -> tuple[int, int, int] | None:
        """Where a tensor's bytes are in the file, for read-ahead (see `byte_span`)."""
        return byte_span(self._tensors[name])

    def close(self) -> None:
        self._close_fd()


class SafetensorsWriter(DiscardOnFailure):
    """Streams one safetensors file: header from the specs, then each tensor as it comes.

    Its size is known from the specs, so a disk without room for it is refused before writing.
    Any failure aborts the writer and deletes the partial file; so does a writer dropped without
    `close`, when it is collected."""

    def __init__(
        self,
        path: Path,
        root: Path,
        specs: Sequence[TensorSpec],
        metadata: dict[str, str] | None = None,
        digests: Recording = Recording.FAST,
        direct: bool = False,
        sink: Sink = NO_SINK,
    ):
        check_specs(specs)
        self._specs = list(specs)
        self._next = 0
        self._file: HashingFile | None = None
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for spec in self._specs:
            header[spec.name] = {
                "dtype": _DTYPE_TO_ST[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = HashingFile(
            path, root, expected_size=8 + len(raw) + offset, digests=digests, direct=direct, sink=sink
        )
        with self._discarding():
            self._file.write(struct.pack("<Q", len(raw)))
            self._file.write(raw)

    def write(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        with self._discarding():
            spec = self._expect(name)
            if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
                raise RuntimeError(f"expected {spec}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
            self._put(tensor_bytes(tensor), owned)
            self._next += 1

    def write_chunks(self, name: str, chunks: Iterable[torch.Tensor], owned: bool = False) -> None:
        """Write a tensor as consecutive row blocks (each a tensor), without assembling it."""
        with self._discarding():
            spec = self._expect(name)
            written = 0
            for chunk in chunks:
                if chunk.dtype != spec.dtype:
                    chunk = chunk.to(spec.dtype)
                data = tensor_bytes(chunk)
                self._put(data, owned)
                written += len(data)
            if written != spec.nbytes:
                raise RuntimeError(f"{name}: wrote {written} bytes, expected {spec.nbytes}")
            self._next += 1

    def can_copy(self) -> bool:
        """`write_copy` may always be used: a tensor's bytes are stored as they are, in one run."""
        return True

    def can_stream_rows(self) -> bool:
        """`begin_rows` may always be used (the same reason)."""
        return True

    def begin_rows(self, name: str) -> RowBlocks:
        """Write the next tensor (a matrix) as blocks of rows handed over one at a time, with other
        files written in between (see `base.RowStreamingWriter`)."""
        with self._discarding():
            spec = self._expect(name)
            if len(spec.shape) != 2:
                raise RuntimeError(f"{name}: only a matrix is written in blocks of rows, not {spec}")

        def put(data: memoryview, owner: torch.Tensor) -> None:
            self._open_file.write_owned(data, owner)

        def done() -> None:
            self._next += 1

        return RowBlocks(self, spec, put, done)

    def write_copy(self, name: str, ranges: Iterable[FileRange]) -> None:
        """Write the next tensor as source byte ranges, copied by the kernel (see
        `HashingFile.copy_ranges`)."""
        with self._discarding():
            spec = self._expect(name)
            copied = self._open_file.copy_ranges(ranges)
            if copied != spec.nbytes:
                raise RuntimeError(f"{name}: copied {copied} bytes, expected {spec.nbytes}")
            self._next += 1

    def _put(self, data: memoryview, owned: bool) -> None:
        if owned:  # the view keeps its tensor alive until hashed
            self._open_file.write_owned(data, data)
        else:
            self._open_file.write(data)

    @property
    def _open_file(self) -> HashingFile:
        if self._file is None:
            raise RuntimeError("the safetensors writer is closed or was aborted")
        return self._file

    def _expect(self, name: str) -> TensorSpec:
        file = self._open_file
        self.check_no_rows()
        spec = self._specs[self._next] if self._next < len(self._specs) else None
        if spec is None or name != spec.name:
            raise RuntimeError(f"{file.path}: expected {spec.name if spec else 'no more tensors'}, got {name}")
        return spec

    def close(self, fsync: bool = False) -> list[FileRecord]:
        with self._discarding():
            file = self._open_file
            if self._next != len(self._specs):
                raise RuntimeError(f"{file.path}: {len(self._specs) - self._next} tensors were not written")
            record = file.close(fsync)
        self._file = None
        return [record]

    def abort(self) -> None:
        """Give up this file: close and delete it. Safe to call more than once."""
        file, self._file = getattr(self, "_file", None), None
        if file is not None:
            file.abort()

    def _unfinished(self) -> bool:
        return bool(getattr(self, "_file", None) is not None)


def read_header(path: Path, store: Store | None = None) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes) without reading data,
    validated as the safetensors library validates it (read through `store`: see `_open`)."""
    file, size = _open(Path(path), store)
    try:
        return _parse(Path(path), file.fd, size)[0]
    finally:
        file.close()
