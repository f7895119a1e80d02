"""The protocol every tensor-file backend follows, and helpers they share .

Raw tensor bytes are read and written in the machine's byte order without swapping; every file
format here is little-endian, so `tensor_bytes` refuses to run on a big-endian machine rather
than write wrong bytes.

A backend reads one file lazily (`TensorFile`: names, shapes, dtypes, and slices on demand) and
writes one file as tensors arrive (`TensorFileWriter`), reporting the files it produced with
their sizes and sha256 (hashed while writing, never by reading back).
"""

from __future__ import annotations

import hashlib
import math
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import torch

from ..errors import FormatError

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
        return self.dtype.itemsize * math.prod(self.shape)


@dataclass(frozen=True)
class FileRecord:
    """A file written: path relative to the output directory, size, sha256."""

    path: str
    size: int
    sha256: str


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
    """Writes one rank file; `write` is called once per spec, in spec order. Formats whose
    registry entry says `chunked_writes` also take a tensor as row blocks (`write_chunks`)."""

    def write(self, name: str, tensor: torch.Tensor) -> None: ...
    def close(self, fsync: bool = False) -> list[FileRecord]: ...


class DiscardOnFailure:
    """What every streaming writer does with failure: leaving a `with` block on an exception
    aborts the file, and a writer abandoned unfinished is aborted when it is collected (never
    finished by a destructor, as torch's zip writer would)."""

    def abort(self) -> None:
        raise NotImplementedError

    def _unfinished(self) -> bool:
        raise NotImplementedError

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


class HashingFile:
    """A binary file that hashes what is written to it (for manifests, without reading back).

    `expected_size` (when the caller knows the file's size in advance) is checked against the free
    space first, so a full disk is refused before anything is written. A full disk (ENOSPC, or an
    exhausted quota) while writing becomes a one-line NoSpaceError. `abort()` discards the file."""

    def __init__(self, path: Path, root: Path, expected_size: int | None = None):
        from ..paths import ensure_free_space

        self.path = Path(path)
        self.root = Path(root)
        self.expected_size = expected_size
        self._fh = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if expected_size is not None:
            try:  # the file this one replaces frees its blocks (unless linked elsewhere too)
                old = os.lstat(self.path)
                replaced = old.st_size if stat.S_ISREG(old.st_mode) and old.st_nlink == 1 else 0
            except OSError:
                replaced = 0
            ensure_free_space(self.path.parent, expected_size, replaced)
        try:  # a new file, never written through: an old one (or a link to a source) is replaced, not truncated
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._fh = open(self.path, "xb")
        st = os.fstat(self._fh.fileno())
        self._identity = (st.st_dev, st.st_ino)
        self._hash = hashlib.sha256()
        self.size = 0

    def _failed(self, error: OSError, pending: int = 0) -> Exception:
        import errno

        from ..paths import no_space_error

        if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            needed = self.expected_size if self.expected_size is not None else self.size + pending
            return no_space_error(self.path.parent, needed)
        return error

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self._fh.write(view)
        except OSError as e:
            raise self._failed(e, len(view)) from None
        self._hash.update(view)
        self.size += len(view)
        return written

    def flush(self) -> None:
        try:
            self._fh.flush()
        except OSError as e:
            raise self._failed(e) from None

    def close(self, fsync: bool = False) -> FileRecord:
        try:
            self._fh.flush()
            if fsync:
                os.fsync(self._fh.fileno())
            self._fh.close()
        except OSError as e:
            raise self._failed(e) from None
        return FileRecord(self.path.relative_to(self.root).as_posix(), self.size, self._hash.hexdigest())

    def abort(self) -> None:
        """Close and delete the file, if the path still names the file this object created (a
        retry may have written a new one there since). Never raises an OSError."""
        fh, self._fh = self._fh, None
        if fh is None:
            return
        try:
            fh.close()  # a failing flush of the last buffered bytes still closes the descriptor
        except (OSError, ValueError):
            pass
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
                import logging

                logging.getLogger(__name__).info("removed the unfinished file %s", self.path)
        except OSError:
            pass


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor (little-endian: the machine's order, checked), without copying
    when it is contiguous."""
    if sys.byteorder != "little":
        raise RuntimeError("shardkit writes little-endian files and does not byte-swap: run it on a little-endian machine")
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor that owns exactly its bytes (a view would drag its whole storage into
    torch.save files and keep source pages alive)."""
    tensor = tensor.contiguous()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's elements sit in a file: byte offset of its storage, element offset,
    shape and stride (row-major when `stride` is None)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    file_offset: int
    storage_offset: int = 0
    stride: tuple[int, ...] | None = None

    def strides(self) -> tuple[int, ...]:
        if self.stride is not None:
            return self.stride
        out, step = [], 1
        for size in reversed(self.shape):
            out.append(step)
            step *= size
        return tuple(reversed(out))

    def numel(self) -> int:
        return math.prod(self.shape)


STRIDED_READ_CHUNK = 4 << 20  # bytes read at once for a slice along a dimension other than the first


def pread_exact(fd: int, view: memoryview, offset: int, what: str) -> None:
    """Fill `view` with the bytes at `offset` (FormatError when the file is shorter: truncated)."""
    done, nbytes = 0, len(view)
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise FormatError(f"{what} is truncated: re-create it")
        done += got


def pread_into(fd: int, nbytes: int, offset: int, what: str) -> torch.Tensor:
    """Read exactly nbytes at offset into a new uint8 tensor. The buffer is not zero-filled first."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    pread_exact(fd, memoryview(buf.numpy()), offset, what)
    return buf


def read_stored(fd: int, t: StoredTensor, dim: int, start: int | None, stop: int | None, what: str) -> torch.Tensor:
    """Read [start, stop) along dim of a stored tensor with positional reads: only the bytes the
    slice spans are read, and the result owns its memory (nothing stays mapped)."""
    shape, stride, item = list(t.shape), list(t.strides()), t.dtype.itemsize
    if not shape:
        buf = pread_into(fd, item, t.file_offset + t.storage_offset * item, what)
        return buf.view(t.dtype).reshape(())
    start = 0 if start is None else start
    stop = shape[dim] if stop is None else stop
    out_shape = shape.copy()
    out_shape[dim] = stop - start
    if 0 in out_shape:
        return torch.empty(out_shape, dtype=t.dtype)
    first = t.storage_offset + start * stride[dim]
    extent = 1 + sum((n - 1) * st for n, st in zip(out_shape, stride))
    row_major = stride == list(StoredTensor(t.dtype, t.shape, 0).strides())
    if dim > 0 and row_major and shape[0] > 1 and extent * item > STRIDED_READ_CHUNK:
        # A column block of a large row-major tensor spans (nearly) all of its bytes: read it in
        # blocks of rows, so that the transient buffer stays small whatever the tensor's size.
        out = torch.empty(out_shape, dtype=t.dtype)
        rows = max(1, STRIDED_READ_CHUNK // (stride[0] * item))
        for r0 in range(0, shape[0], rows):
            r1 = min(shape[0], r0 + rows)
            block = StoredTensor(t.dtype, (r1 - r0, *shape[1:]), t.file_offset, t.storage_offset + r0 * stride[0])
            out[r0:r1] = read_stored(fd, block, dim, start, stop, what)
        return out
    buf = pread_into(fd, extent * item, t.file_offset + first * item, what)
    base = buf.view(t.dtype)
    if extent == math.prod(out_shape) and stride == list(StoredTensor(t.dtype, tuple(out_shape), 0).strides()):
        return base.reshape(out_shape)  # a contiguous run of rows: no copy
    return base.as_strided(out_shape, stride).clone()


def read_rows_into(fd: int, t: StoredTensor, start: int, stop: int, out: torch.Tensor, what: str) -> bool:
    """Read rows [start, stop) of a row-major stored tensor straight into `out` (a contiguous
    tensor of the same dtype and row shape). False when the stored layout does not allow it."""
    stride = list(t.strides())
    row_shape = list(t.shape[1:])
    if (not t.shape or out.dtype != t.dtype or not out.is_contiguous() or list(out.shape[1:]) != row_shape
            or stride != list(StoredTensor(t.dtype, tuple(t.shape), 0).strides())):
        return False
    nbytes = out.numel() * out.element_size()
    if out.shape[0] != stop - start:
        return False
    first = t.storage_offset + start * (stride[0] if stride else 1)
    view = memoryview(out.view(torch.uint8).reshape(-1).numpy()) if nbytes else memoryview(b"")
    pread_exact(fd, view, t.file_offset + first * t.dtype.itemsize, what)
    return True


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
