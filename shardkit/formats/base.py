"""The protocol every tensor-file backend follows, and the small helpers they share.

Raw tensor bytes are read and written in the machine's byte order without swapping; every file
format here is little-endian, so `tensor_bytes` refuses to run on a big-endian machine rather
than write wrong bytes.

A backend reads one file lazily (`TensorFile`: names, shapes, dtypes, and slices on demand) and
writes one file as tensors arrive (`TensorFileWriter`), reporting the files it produced with
their sizes and digests. The byte machinery they share (hashing files, write-behind, kernel
copies, direct I/O, buffers, positional reads) is `shardkit.io`.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..errors import FormatError
from ..io.data.buffers import array_view
from ..io.data.copy import FileRange
from ..io.data.digest import FileRecord

DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: name, shape and dtype, known before its data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


class TensorFile(Protocol):
    """A lazily read tensor file."""

    path: Path

    def keys(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor: ...

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows [start, stop) straight into `out`; False when the stored layout does not allow it
        (the caller then uses `read`)."""
        ...

    def close(self) -> None: ...


class TensorFileWriter(Protocol):
    """Writes one rank file; `write` is called once per spec, in spec order. What else a writer
    takes is declared once, in its format's registry entry (`registry.Abilities`), and the writer
    then follows that ability's protocol too: `ChunkedWriter`, `RowStreamingWriter`,
    `CopyingWriter`."""

    def write(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        """Write the next tensor. `owned`: the caller hands the tensor over and never changes it
        afterwards, so its bytes may still be hashed after this returns (the writer keeps it alive
        until then); otherwise they are hashed before this returns."""
        ...

    def close(self, fsync: bool = False) -> list[FileRecord]: ...

    def abort(self) -> None:
        """Give up the file: close and delete it (safe to call more than once)."""
        ...


class ChunkedWriter(TensorFileWriter, Protocol):
    """A writer of a format whose registry entry declares `chunked_writes`: it also takes a tensor
    as consecutive blocks of rows, without the tensor ever being assembled."""

    def write_chunks(self, name: str, chunks: Iterable[torch.Tensor], owned: bool = False) -> None: ...


class RowBlocks:
    """A matrix being written as blocks of rows (`RowStreamingWriter.begin_rows`) by `writer`:
    each block is checked against `spec` and its bytes handed to `put(bytes, owner)`; `done()`
    runs after the last. A failure gives the whole file up (the writer's `_discarding`)."""

    def __init__(
        self,
        writer: DiscardOnFailure,
        spec: TensorSpec,
        put: Callable[[memoryview, torch.Tensor], None],
        done: Callable[[], None],
    ):
        self._writer, self._spec, self._put, self._done = writer, spec, put, done
        self.written = 0
        writer._rows = self  # until `end`: the writer takes no other tensor (see `check_no_rows`)

    def add(self, rows: torch.Tensor) -> None:
        """The next rows (handed over: never changed afterwards)."""
        spec = self._spec
        with self._writer._discarding():
            if rows.dtype != spec.dtype or rows.dim() != 2 or rows.shape[1] != spec.shape[1]:
                raise RuntimeError(f"{spec.name}: rows {tuple(rows.shape)} {rows.dtype} do not fit {spec}")
            rows = compact(rows.detach())
            data = tensor_bytes(rows)
            if self.written + len(data) > spec.nbytes:
                raise RuntimeError(f"{spec.name}: more rows than its {spec.shape[0]}")
            self._put(data, rows)
            self.written += len(data)

    def end(self) -> None:
        """After the last rows (RuntimeError when rows are missing)."""
        with self._writer._discarding():
            if self.written != self._spec.nbytes:
                raise RuntimeError(f"{self._spec.name}: {self.written} of its {self._spec.nbytes} bytes written")
            self._writer._rows = None
            self._done()


class RowStreamingWriter(TensorFileWriter, Protocol):
    """A writer of a format whose registry entry declares `row_streaming`: it also takes a matrix
    as blocks of rows handed over one at a time, with other files written in between
    (`begin_rows`), where its file allows it (`can_stream_rows`)."""

    def can_stream_rows(self) -> bool:
        """Whether this file takes `begin_rows` (a TorchWriter does not where torch's own zip
        writer writes its archive: see `torch_zip`)."""
        ...

    def begin_rows(self, name: str) -> RowBlocks: ...


class CopyingWriter(TensorFileWriter, Protocol):
    """A writer of a format whose registry entry declares `kernel_copies`: it also takes a tensor
    as byte ranges of source files, copied by the kernel (`io.data.hashing.HashingFile.copy_ranges`),
    where its file allows it (`can_copy`)."""

    def can_copy(self) -> bool:
        """Whether this file takes `write_copy` (a TorchWriter does not where torch's own zip
        writer writes its archive: archives of 4 GiB or more, see `torch_zip`)."""
        ...

    def write_copy(self, name: str, ranges: Iterable[FileRange]) -> None:
        """Write the next tensor, whose bytes are `ranges`' bytes one after another."""
        ...


class DiscardOnFailure:
    """What every streaming writer does with failure: any failure inside its own steps
    (`_discarding`) or leaving a `with` block on an exception aborts the file, and a writer
    abandoned unfinished is aborted when it is collected (never finished by a destructor, as
    torch's zip writer would)."""

    _rows: RowBlocks | None = None  # a matrix being written in blocks of rows (`RowBlocks`)

    def abort(self) -> None:
        raise NotImplementedError

    def _unfinished(self) -> bool:
        raise NotImplementedError

    def check_no_rows(self) -> None:
        """Refuse another tensor while a matrix's blocks of rows are still coming."""
        if self._rows is not None:
            raise RuntimeError(f"the rows of {self._rows._spec.name} are not all written yet")

    @contextlib.contextmanager
    def _discarding(self) -> Iterator[None]:
        """Run a step of the writer; any failure in it (Ctrl-C included) aborts the file first,
        then propagates."""
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            self.abort()

    def __del__(self) -> None:
        try:
            if self._unfinished():
                self.abort()
        except Exception:  # noqa: BLE001 - at interpreter exit modules may be half gone
            pass


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (little-endian: the machine's order, checked), without copying
    when it is contiguous."""
    if sys.byteorder != "little":
        raise RuntimeError(
            "shardkit writes little-endian files and does not byte-swap: run it on a little-endian machine"
        )
    flat = tensor.detach().contiguous().reshape(-1)
    return array_view(flat.view(torch.uint8).numpy())


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns exactly its bytes (a view would drag its whole storage into
    torch.save files and keep source pages alive)."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def narrow(tensor: torch.Tensor, dim: int, start: int | None, stop: int | None) -> torch.Tensor:
    if start is None and stop is None or tensor.dim() == 0:
        return tensor
    start = 0 if start is None else start
    stop = tensor.shape[dim] if stop is None else stop
    if start == 0 and stop == tensor.shape[dim]:
        return tensor
    return tensor.narrow(dim, start, stop - start)


def check_specs(specs: Sequence[TensorSpec]) -> None:
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in one file")


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from a name or alias (bf16, fp16, fp32, bfloat16, ...); None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise FormatError(f"dtype {dtype!r} is unknown: use one of bf16, fp16, fp32")
    return DTYPE_NAMES[dtype]
