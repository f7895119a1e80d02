"""Positional reads of stored tensors.

`StoredTensor` says where a tensor's elements sit in a file; a slice is read with positional
reads of only the bytes it spans, into memory the result owns, so nothing stays mapped. Blocks of
columns of a large matrix are cut from windows of rows read once for all the files built together
(`shared_column_reads`).
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch

from ...errors import FormatError
from .buffers import _thread_scope, array_view, empty_bytes, empty_tensor
from .copy import FileRange
from .hashing import BEHIND_MIN
from .taps import OpenFile, pread_exact


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


def stored_range(
    file: OpenFile, t: StoredTensor, dim: int, start: int | None, stop: int | None, what: str
) -> FileRange | None:
    """The bytes of `file` a slice of a stored tensor spans, when they are the slice's bytes in
    order (the whole of a row-major tensor, or a block of its rows) and no read-ahead buffer serves
    them (`DescriptorReader.read_from`): the kernel can then copy the slice. None otherwise."""
    if file.source is not None or not t.shape:
        return None
    shape = list(t.shape)
    start = 0 if start is None else start
    stop = shape[dim] if stop is None else stop
    sub = shape.copy()
    sub[dim] = stop - start
    if 0 in sub or list(t.strides()) != list(StoredTensor(t.dtype, tuple(sub), 0).strides()):
        return None  # (row-major strides of the slice's own shape: its bytes are one run, in order)
    offset, length = cast(tuple[int, int], stored_span(t, dim, start, stop))
    return FileRange(file, offset, length, what)


def pread_into(file: OpenFile, nbytes: int, offset: int, what: str) -> torch.Tensor:
    """Read exactly nbytes at offset into a new uint8 tensor. The buffer is not zero-filled first."""
    buf = empty_bytes(nbytes)
    pread_exact(file, array_view(buf.numpy()), offset, what)
    return buf


def read_stored(
    file: OpenFile, t: StoredTensor, dim: int, start: int | None, stop: int | None, what: str
) -> torch.Tensor:
    """Read [start, stop) along dim of a stored tensor with positional reads: only the bytes the
    slice spans are read, and the result owns its memory (nothing stays mapped)."""
    shape, stride, item = list(t.shape), list(t.strides()), t.dtype.itemsize
    if not shape:
        buf = pread_into(file, item, t.file_offset + t.storage_offset * item, what)
        return buf.view(t.dtype).reshape(())
    start = 0 if start is None else start
    stop = shape[dim] if stop is None else stop
    out_shape = shape.copy()
    out_shape[dim] = stop - start
    if 0 in out_shape:
        return torch.empty(out_shape, dtype=t.dtype)
    extent = 1 + sum((n - 1) * st for n, st in zip(out_shape, stride))
    row_major = stride == list(StoredTensor(t.dtype, t.shape, 0).strides())
    whole = start == 0 and stop == shape[dim]  # then one contiguous read, whatever the dim
    if dim > 0 and row_major and not whole and shape[0] > 1 and extent * item > STRIDED_READ_CHUNK:
        # A column block of a large row-major tensor spans (nearly) all of its bytes, of which it
        # needs only a part (1/8 for tp 8): copied out of a mapping of the file, so that only the
        # bytes of the block are copied (reading the span copied all of it, once per rank). The
        # files built together cut their blocks from rows read once instead (`read_block`).
        out = empty_tensor(out_shape, t.dtype)
        _copy_columns(file, t, dim, start, out, what)
        return out
    view = _read_span(file, t, dim, start, stop, what)
    return view if view.is_contiguous() else _copy(view)


MAP_WINDOW = 32 << 20
"""At most this many bytes of a file are mapped at once by `_copy_columns`."""


def _copy_columns(file: OpenFile, t: StoredTensor, dim: int, start: int, out: torch.Tensor, what: str) -> None:
    """Fill `out` (contiguous) with the block of a row-major stored tensor that starts at `start`
    along `dim` > 0, copying just its bytes out of a private read-only mapping of the file, a window
    of rows at a time (mapped pages count as resident while mapped: at most MAP_WINDOW bytes)."""
    import mmap

    import numpy

    fd, fetcher = file.fd, file.fetcher
    shape, stride, item = list(t.shape), list(t.strides()), t.dtype.itemsize
    out_shape = list(out.shape)
    target = out.view(torch.uint8).numpy().reshape(*out_shape, item)
    file_size = os.fstat(fd).st_size
    rows = max(1, MAP_WINDOW // (stride[0] * item))
    for r0 in range(0, shape[0], rows):
        r1 = min(shape[0], r0 + rows)
        sub_shape = [r1 - r0, *out_shape[1:]]
        first = t.file_offset + (t.storage_offset + r0 * stride[0] + start * stride[dim]) * item
        end = first + (1 + sum((n - 1) * st for n, st in zip(sub_shape, stride))) * item
        if end > file_size:  # a mapping past the end of the file would fault (SIGBUS) when touched
            raise FormatError(f"{what} is truncated: re-create it")
        base = first - first % mmap.ALLOCATIONGRANULARITY
        if fetcher is not None:  # a mirror file's bytes are fetched before they are mapped
            fetcher.before(first, end - first)
        mapping = mmap.mmap(fd, end - base, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ, offset=base)
        try:
            data = numpy.frombuffer(mapping, dtype=numpy.uint8, offset=first - base)
            block = numpy.lib.stride_tricks.as_strided(
                data, shape=(*sub_shape, item), strides=(*(s * item for s in stride), 1), writeable=False
            )
            numpy.copyto(target[r0:r1], block)
            del data, block  # the buffer exports end before the mapping is closed
            if fetcher is not None:
                fetcher.after(first, end - first)
        finally:
            try:
                mapping.close()
            except BufferError:  # still exported after a failure: unmapped when collected
                pass


SHARED_WINDOW = 8 << 20
"""About this many bytes of rows are read at once for the blocks of columns the files of a group
cut from them, and at most this many are kept (`read_block`, `shared_column_reads`): a block that
joins the columns of several source pieces takes a window of each, of this size together."""


class _SharedRows(threading.local):
    """This thread's windows of rows kept for blocks of columns (see `shared_column_reads`)."""

    def __init__(self) -> None:
        self.depth = 0
        self.windows: collections.OrderedDict[tuple[int, int, int, int], bytearray] = collections.OrderedDict()


_SHARED = _SharedRows()


@contextlib.contextmanager
def shared_column_reads() -> Iterator[None]:
    """In this thread, until the block ends, the rows `read_block` reads are kept (the last
    SHARED_WINDOW bytes of them) for the next blocks of columns of the same rows: the files of
    one pipeline stage built together (`engine.planning.lockstep_groups`) each cut their columns
    of a row-parallel weight from the same window of rows in turn, so its bytes are read once for
    all of them, where a mapping per file touches every page of the tensor once per rank. Freed
    when the outermost block ends."""
    with _thread_scope(_SHARED, _SHARED.windows.clear):
        yield


def window_rows(row_bytes: int, block_row_bytes: int) -> int:
    """Rows of a window of rows that take `row_bytes` (the source rows a block of columns is cut
    from; see SHARED_WINDOW), of which one file takes `block_row_bytes`: at least enough for that
    file's block to be BEHIND_MIN (then written and hashed behind the worker, not copied into the
    file's small writes)."""
    least = -(-BEHIND_MIN // max(1, block_row_bytes))
    return max(1, SHARED_WINDOW // max(1, row_bytes), least)


def read_block(
    file: OpenFile, t: StoredTensor, first: int, last: int, start: int, stop: int, out: torch.Tensor, what: str
) -> bool:
    """Fill `out` (last - first rows, stop - start columns; each row contiguous) with that block
    of a 2-D row-major stored tensor, from its rows [first, last) read whole (one positional read,
    which the check on read sees): inside `shared_column_reads` they are kept for the next
    blocks of the same rows. False when the tensor is not a row-major matrix."""
    import numpy

    if (
        len(t.shape) != 2
        or list(t.strides()) != [t.shape[1], 1]
        or not 0 <= first < last <= t.shape[0]
        or not 0 <= start < stop <= t.shape[1]
        or tuple(out.shape) != (last - first, stop - start)
    ):
        return False
    item = t.dtype.itemsize
    row = t.shape[1] * item
    offset, length = t.file_offset + (t.storage_offset + first * t.shape[1]) * item, (last - first) * row
    if _SHARED.depth:
        st = os.fstat(file.fd)
        key = (st.st_dev, st.st_ino, offset, length)
        windows = _SHARED.windows
        buffer = windows.get(key)
        if buffer is None:
            spare = None
            while windows and sum(len(b) for b in windows.values()) + length > SHARED_WINDOW:
                spare = windows.popitem(last=False)[1]  # the oldest goes before a new one is made
            buffer = spare if spare is not None and len(spare) >= length else bytearray(length)
            del spare
            pread_exact(file, memoryview(buffer)[:length], offset, what)
            windows[key] = buffer
        else:
            windows.move_to_end(key)
        data = numpy.frombuffer(buffer, dtype=numpy.uint8, count=length)
    else:
        data = empty_bytes(length).numpy()
        pread_exact(file, array_view(data), offset, what)
    rows = data.reshape(last - first, t.shape[1], item)
    target = out.view(torch.uint8).unflatten(1, (stop - start, item)).numpy()
    numpy.copyto(target, rows[:, start:stop])
    return True


def _copy(view: torch.Tensor) -> torch.Tensor:
    out = empty_tensor(tuple(view.shape), view.dtype)
    out.copy_(view)
    return out


def _read_span(
    file: OpenFile, t: StoredTensor, dim: int, start: int | None, stop: int | None, what: str
) -> torch.Tensor:
    """[start, stop) along dim of a stored tensor, as a view of a buffer holding the bytes the slice
    spans (contiguous when the slice is a run of whole rows)."""
    shape, stride, item = list(t.shape), list(t.strides()), t.dtype.itemsize
    start = 0 if start is None else start
    stop = shape[dim] if stop is None else stop
    out_shape = shape.copy()
    out_shape[dim] = stop - start
    first = t.storage_offset + start * stride[dim]
    extent = 1 + sum((n - 1) * st for n, st in zip(out_shape, stride))
    buf = pread_into(file, extent * item, t.file_offset + first * item, what)
    base = buf.view(t.dtype)
    if extent == math.prod(out_shape) and stride == list(StoredTensor(t.dtype, tuple(out_shape), 0).strides()):
        return base.reshape(out_shape)  # a contiguous run of rows: no copy
    return base.as_strided(out_shape, stride)


def stored_span(
    t: StoredTensor, dim: int = 0, start: int | None = None, stop: int | None = None
) -> tuple[int, int] | None:
    """(byte offset, byte count) of the file bytes a slice of a stored tensor spans (the whole
    tensor by default); None when the slice is empty."""
    shape, stride, item = list(t.shape), list(t.strides()), t.dtype.itemsize
    if not shape:
        return t.file_offset + t.storage_offset * item, item
    start = 0 if start is None else start
    stop = shape[dim] if stop is None else stop
    sub = shape.copy()
    sub[dim] = stop - start
    if 0 in sub:
        return None
    extent = 1 + sum((n - 1) * st for n, st in zip(sub, stride))
    return t.file_offset + (t.storage_offset + start * stride[dim]) * item, extent * item


def byte_span(t: StoredTensor) -> tuple[int, int, int]:
    """Where a stored tensor's bytes are, for read-ahead: (byte offset, byte count, rows), where
    `rows` is the number of equal consecutive blocks the bytes split into along dim 0 (the size of
    dim 0 when the tensor is stored row-major without gaps, else 1)."""
    offset, length = stored_span(t) or (t.file_offset, 0)
    contiguous = t.shape and list(t.strides()) == list(StoredTensor(t.dtype, t.shape, 0).strides())
    return offset, length, t.shape[0] if contiguous and t.shape[0] > 0 else 1


def advise_stored(fd: int, t: StoredTensor, dim: int, start: int | None, stop: int | None) -> None:
    """Ask the kernel to start reading the bytes a slice spans (POSIX_FADV_WILLNEED), so that on a
    cold cache the disk works while the caller is still busy with the slice before; a no-op where
    the bytes are cached or the hint is not supported."""
    if not t.shape:
        return
    span = stored_span(t, dim, start, stop)
    if span is None:
        return
    try:
        os.posix_fadvise(fd, span[0], span[1], os.POSIX_FADV_WILLNEED)
    except (AttributeError, OSError):
        pass


def read_rows_into(file: OpenFile, t: StoredTensor, start: int, stop: int, out: torch.Tensor, what: str) -> bool:
    """Read rows [start, stop) of a row-major stored tensor straight into `out` (a contiguous
    tensor of the same dtype and row shape). False when the stored layout does not allow it."""
    stride = list(t.strides())
    row_shape = list(t.shape[1:])
    if (
        not t.shape
        or out.dtype != t.dtype
        or not out.is_contiguous()
        or list(out.shape[1:]) != row_shape
        or stride != list(StoredTensor(t.dtype, tuple(t.shape), 0).strides())
    ):
        return False
    nbytes = out.numel() * out.element_size()
    if out.shape[0] != stop - start:
        return False
    first = t.storage_offset + start * (stride[0] if stride else 1)
    view = array_view(out.view(torch.uint8).reshape(-1).numpy()) if nbytes else memoryview(b"")
    pread_exact(file, view, t.file_offset + first * t.dtype.itemsize, what)
    return True
