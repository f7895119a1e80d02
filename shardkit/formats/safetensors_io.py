"""safetensors: read with the safetensors library, write streaming (one tensor in memory).

The safetensors library can only save a complete dict of tensors; shardkit knows every shape in
advance, so it writes the header first and then each tensor's bytes as it is assembled, which
keeps peak memory at one tensor. The bytes follow the format's specification: an 8-byte
little-endian header length, a JSON header (`dtype`, `shape`, `data_offsets` per tensor and
`__metadata__`) padded with spaces to 8 bytes, then the data.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Sequence

import torch

from ..errors import FormatError
from .base import FileRecord, HashingFile, StoredTensor, TensorSpec, check_specs, read_rows_into, read_stored, tensor_bytes

_DTYPE_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}


class SafetensorsFile:
    """Lazy reader: the header once, then positional reads of exactly the bytes a slice spans.

    (safetensors' own `safe_open` memory-maps the file, and the tensors it returns keep that
    mapping alive: the pages of every byte read would stay in this process's resident memory.)"""

    def __init__(self, path: Path):
        self.path = Path(path)
        header = read_header(self.path)
        data_start = 8 + struct.unpack("<Q", open(self.path, "rb").read(8))[0]
        size = self.path.stat().st_size
        self._tensors: dict[str, StoredTensor] = {}
        try:
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                stored = StoredTensor(_ST_TO_DTYPE[info["dtype"]], tuple(info["shape"]), data_start + begin)
                if data_start + end > size or end - begin != stored.numel() * stored.dtype.itemsize:
                    raise FormatError(f"{self.path} is truncated (tensor {name} lies past its end): re-create it")
                self._tensors[name] = stored
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"{self.path} has a corrupt safetensors header: re-create it") from None
        self._fd = os.open(self.path, os.O_RDONLY)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._tensors[name].dtype

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        return read_stored(self._fd, self._tensors[name], dim, start, stop, str(self.path))

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows [start, stop) straight into `out`; False when not possible (then use read)."""
        return read_rows_into(self._fd, self._tensors[name], start, stop, out, str(self.path))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SafetensorsWriter:
    """Streams one safetensors file: header from the specs, then each tensor as it comes."""

    def __init__(self, path: Path, root: Path, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None):
        check_specs(specs)
        self._specs = list(specs)
        self._next = 0
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        for spec in self._specs:
            header[spec.name] = {"dtype": _DTYPE_TO_ST[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = HashingFile(path, root)
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._specs[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise RuntimeError(f"expected {spec}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        self._file.write(tensor_bytes(tensor))
        self._next += 1

    def write_chunks(self, name: str, chunks) -> None:
        """Write a tensor as consecutive row blocks (each a tensor), without assembling it."""
        spec = self._specs[self._next]
        if name != spec.name:
            raise RuntimeError(f"expected {spec.name}, got {name}")
        written = 0
        for chunk in chunks:
            if chunk.dtype != spec.dtype:
                chunk = chunk.to(spec.dtype)
            data = tensor_bytes(chunk)
            self._file.write(data)
            written += len(data)
        if written != spec.nbytes:
            raise RuntimeError(f"{name}: wrote {written} bytes, expected {spec.nbytes}")
        self._next += 1

    def close(self, fsync: bool = False) -> list[FileRecord]:
        if self._next != len(self._specs):
            raise RuntimeError(f"{self._file.path}: {len(self._specs) - self._next} tensors were not written")
        return [self._file.close(fsync)]


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (names, dtypes, shapes) without reading data."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise FormatError(f"{path} is empty or truncated: re-create it")
        (length,) = struct.unpack("<Q", head)
        if length > 100 * 2**20:
            raise FormatError(f"{path} has a corrupt safetensors header (claims {length} bytes): re-create it")
        raw = fh.read(length)
        if len(raw) < length:
            raise FormatError(f"{path} is truncated inside its header: re-create it")
    try:
        return json.loads(raw)
    except ValueError:
        raise FormatError(f"{path} has a corrupt safetensors header: re-create it") from None

