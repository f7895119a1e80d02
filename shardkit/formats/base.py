"""The protocol every tensor-file backend follows, and helpers they share.

A backend reads one file lazily (`TensorFile`: names, shapes, dtypes, and slices on demand) and
writes one file as tensors arrive (`TensorFileWriter`), reporting the files it produced with
their sizes and sha256 (hashed while writing, never by reading back).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch

DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: name, shape and dtype, known before its data."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class FileRecord:
    """A file written: path relative to the output directory, size, sha256."""

    path: str
    size: int
    sha256: str


class TensorFile(Protocol):
    """A lazily read tensor file."""

    def keys(self) -> list[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor: ...
    def close(self) -> None: ...


class TensorFileWriter(Protocol):
    """Writes one rank file; `write` is called once per spec, in spec order."""

    def write(self, name: str, tensor: torch.Tensor) -> None: ...
    def close(self) -> list[FileRecord]: ...


class HashingFile:
    """A binary file that hashes what is written to it (for manifests)."""

    def __init__(self, path: Path, root: Path):
        self.path = Path(path)
        self.root = Path(root)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "wb")
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self.size += len(view)
        return self._fh.write(view)

    def flush(self) -> None:
        self._fh.flush()

    def close(self, fsync: bool = False) -> FileRecord:
        self._fh.flush()
        if fsync:
            os.fsync(self._fh.fileno())
        self._fh.close()
        return FileRecord(self.path.relative_to(self.root).as_posix(), self.size, self._hash.hexdigest())


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, without copying when it is contiguous."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


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
