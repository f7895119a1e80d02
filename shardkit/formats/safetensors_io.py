"""safetensors: read with the safetensors library, write streaming (one tensor in memory).

The safetensors library can only save a complete dict of tensors; shardkit knows every shape in
advance, so it writes the header first and then each tensor's bytes as it is assembled, which
keeps peak memory at one tensor. The bytes follow the format's specification: an 8-byte
little-endian header length, a JSON header (`dtype`, `shape`, `data_offsets` per tensor and
`__metadata__`) padded with spaces to 8 bytes, then the data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError, safe_open

from ..errors import FormatError
from .base import FileRecord, HashingFile, TensorSpec, check_specs, compact, tensor_bytes

_DTYPE_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_ST_TO_DTYPE = {v: k for k, v in _DTYPE_TO_ST.items()}


class SafetensorsFile:
    """Lazy reader over safetensors' own `safe_open` (slices read only their bytes)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._handle = safe_open(str(path), framework="pt")
            self._keys = list(self._handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise FormatError(f"{path} is not a readable safetensors file ({e}): it may be truncated; re-create it") from None

    def keys(self) -> list[str]:
        return self._keys

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _ST_TO_DTYPE[self._handle.get_slice(name).get_dtype()]

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        try:
            if start is None and stop is None:
                return self._handle.get_tensor(name)
            sl = self._handle.get_slice(name)
            index = [slice(None)] * len(sl.get_shape())
            index[dim] = slice(start, stop)
            return compact(sl[tuple(index)])
        except SafetensorError as e:
            raise FormatError(f"cannot read {name} from {self.path} ({e}): the file may be truncated") from None

    def close(self) -> None:
        self._handle = None


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
        raw = fh.read(length)
    try:
        return json.loads(raw)
    except ValueError:
        raise FormatError(f"{path} has a corrupt safetensors header: re-create it") from None

