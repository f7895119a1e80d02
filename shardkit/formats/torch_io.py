"""torch.save files (NxD's own format): safe loading, positional reads, streamed hashed writes.

Loading never runs arbitrary pickle: `torch.load(weights_only=True)`, with the one foreign class
the formats need (torch-xla's `TensorReference`, which xser files reference) allowed under its
real name. A file that asks for anything else is refused with a clear error.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import struct
import sys
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import torch_compat
from ..errors import FormatError, ShardkitError
from ..io import remote
from ..io.copy import FileRange
from ..io.digest import FileRecord, Recording
from ..io.hashing import PARALLEL_HASH_MIN, HashingFile
from ..io.strided import StoredTensor, advise_stored, byte_span, read_block, read_rows_into, read_stored, stored_range
from ..io.taps import DescriptorReader
from ..paths import regular_file
from .base import DiscardOnFailure, RowBlocks, TensorSpec, check_specs, compact, narrow, tensor_bytes
from .torch_zip import ZipRecords, native_writer

XSER_REFERENCE = "torch_xla.utils.serialization.TensorReference"


class TensorReference:
    """Stand-in for torch_xla.utils.serialization.TensorReference: one int field `tid`."""

    def __init__(self, tid: int | None = None):
        self.tid = tid

    def __repr__(self) -> str:
        return f"TensorReference(tid={self.tid})"


_ALLOWED_LOCK = threading.Lock()
_allowed_users = 0


@contextlib.contextmanager
def _reference_allowed():
    """torch.serialization.safe_globals([TensorReference]), safe across threads: torch's context
    adds to and removes from one process-wide list, so a thread leaving it would disallow the
    class under another thread's load (workers read xser files in parallel). Counted instead:
    allowed while any thread is inside."""
    global _allowed_users
    entry = [(TensorReference, XSER_REFERENCE)]
    with _ALLOWED_LOCK:
        if _allowed_users == 0:
            torch.serialization.add_safe_globals(entry)
        _allowed_users += 1
    try:
        yield
    finally:
        with _ALLOWED_LOCK:
            _allowed_users -= 1
            if _allowed_users == 0:
                torch.serialization.safe_globals(entry).__exit__(None, None, None)


def regular(path: Path, what: str = "file") -> Path:
    """`path` if it is a regular file; else a one-line FormatError (missing, a folder, or a FIFO,
    device or socket, which would block a reader forever)."""
    try:
        return regular_file(path, what)
    except ShardkitError as e:
        raise FormatError(str(e)) from None


def safe_load(path: Path, mmap: bool = True) -> Any:
    """torch.load with weights_only=True; TensorReference allowed; clear errors for bad files."""
    path = regular(Path(path))
    remote.ensure_file(path)  # a mirror file of an object store: fetched whole before torch reads it
    try:
        with _reference_allowed():
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if mmap and "mmap" in str(e):  # legacy (pre-zip) files cannot be mapped
                    return torch.load(path, map_location="cpu", weights_only=True)
                raise
    except pickle.UnpicklingError as e:
        reason = str(e).splitlines()[0] if "GLOBAL" not in str(e) else _refused_global(str(e))
        raise FormatError(
            f"refusing to load {path}: it holds Python objects other than tensors ({reason}); "
            "shardkit never runs arbitrary pickle: re-save it as a plain state dict"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as e:
        raise FormatError(f"{path} is truncated or corrupt ({str(e).splitlines()[0][:120]}): re-create it") from None


def _refused_global(message: str) -> str:
    for line in message.splitlines():
        if "GLOBAL" in line:
            return line.strip()[:160]
    return "unsupported global"


def state_dict_of(obj: Any, path: Path) -> dict[str, Any]:
    """The flat name -> tensor dict inside a loaded file (training checkpoints wrap it in 'model')."""
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict) and "model.embed_tokens.weight" not in obj:
        obj = obj["model"]
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise FormatError(f"{path} does not hold a state dict (name -> tensor)")
    return obj


def _zip_record_offsets(path: Path) -> tuple[str, dict[str, tuple[int, int]]]:
    """The archive's folder prefix and, per record name, (data offset in the file, size).

    torch.save writes records uncompressed (ZIP_STORED) and aligned; a record's data starts after
    its local header, whose extra field (torch's alignment padding) may differ from the central one.
    """
    records: dict[str, tuple[int, int]] = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as fh:
        infos = archive.infolist()
        pickles = [i.filename for i in infos if i.filename.endswith("data.pkl")]
        if not pickles:
            raise FormatError(f"{path} is not a torch.save file (no data.pkl): re-create it")
        prefix = pickles[0][: -len("data.pkl")]
        fd = fh.fileno()
        if hasattr(os, "posix_fadvise"):  # a cold file's headers (one per tensor) are read in parallel
            for info in infos:
                os.posix_fadvise(fd, info.header_offset + 26, 4, os.POSIX_FADV_WILLNEED)
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                raise FormatError(f"{path}: record {info.filename} is compressed; torch files never are")
            name_len, extra_len = struct.unpack("<HH", os.pread(fd, 4, info.header_offset + 26))
            records[info.filename] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return prefix, records


def load_metadata(path: Path) -> Any:
    """Unpickle a torch.save file with torch's weights-only unpickler, but with storages on the
    meta device: shapes, strides and dtypes without reading any tensor data. Every tensor is
    returned as a StoredTensor saying where its bytes are. Non-zip (legacy) files return None."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        return None
    prefix, records = _zip_record_offsets(path)
    keys: dict[int, str] = {}

    def persistent_load(saved):
        _, storage_type, key, _, numel = saved
        # dtypes without a typed storage class (float8, uint16...) are saved as UntypedStorage,
        # numel counting bytes; the tensor's dtype then comes from _rebuild_tensor_v3
        dtype = getattr(storage_type, "dtype", torch.uint8)
        storage = torch.UntypedStorage(numel * dtype.itemsize, device="meta")
        keys[storage._cdata] = str(key)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    with zipfile.ZipFile(path) as archive:
        raw = archive.read(prefix + "data.pkl")
    plain = _plain_metadata(raw, path, prefix, records)
    if plain is not None:
        return plain
    with _reference_allowed():
        unpickler = torch_compat.weights_only_unpickler(io.BytesIO(raw), encoding="utf-8")
        unpickler.persistent_load = persistent_load
        obj = unpickler.load()

    def locate(value):
        if isinstance(value, torch.Tensor):
            key = keys[value.untyped_storage()._cdata]
            offset, size = records.get(f"{prefix}data/{key}", (None, 0))
            span = value.storage_offset() + 1 + sum((n - 1) * st for n, st in zip(value.shape, value.stride()))
            if offset is None or (value.numel() and span * value.element_size() > size):
                raise FormatError(f"{path}: the data of a tensor is missing or cut short: the file is truncated")
            return StoredTensor(value.dtype, tuple(value.shape), offset, value.storage_offset(), tuple(value.stride()))
        if isinstance(value, dict):
            return type(value)((k, locate(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(locate(v) for v in value)
        return value

    return locate(obj)


class _NotPlain(Exception):
    """The pickle holds more than dicts of tensors: torch's weights-only unpickler reads it."""


class _Storage:
    """A tensor storage of a torch file: its dtype, elements, and where its record's bytes are."""

    __slots__ = ("dtype", "numel", "offset", "size")

    def __init__(self, dtype: torch.dtype, numel: int, offset: int | None, size: int):
        self.dtype, self.numel, self.offset, self.size = dtype, numel, offset, size


class _StorageType:
    """What a storage class (torch.BFloat16Storage...) stands for in a pickle: its dtype only.
    Not callable: a pickle that calls it is not a plain state dict."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


def _stored(storage: Any, storage_offset: Any, size: Any, stride: Any, dtype: torch.dtype | None) -> StoredTensor:
    """The StoredTensor a tensor reducer's arguments describe (checked once the whole pickle is
    read: `_checked`)."""
    if not isinstance(storage, _Storage):
        raise _NotPlain("a tensor rebuilt from something other than a storage")
    offset = -1 if storage.offset is None else storage.offset  # no such record: refused by `_checked`
    return StoredTensor(dtype or storage.dtype, size, offset, storage_offset, stride)


def _checked(value: Any, path: Path, sizes: dict[int, int]) -> Any:
    """`value` (what `_PlainUnpickler` read), once every object in it is a container, a number,
    a string or a StoredTensor whose fields are well-formed and whose bytes lie inside its record
    (`sizes`: each record's data offset -> size). Checked after the whole pickle is read, not as
    each tensor is built: a pickle may change an object's fields after building it (BUILD)."""
    if isinstance(value, StoredTensor):
        shape, stride, offset = value.shape, value.stride, value.storage_offset
        if not (isinstance(value.dtype, torch.dtype) and isinstance(shape, tuple) and isinstance(stride, tuple)):
            raise _NotPlain("a tensor with unexpected fields")
        if len(shape) != len(stride) or not all(type(n) is int and n >= 0 for n in (offset, *shape, *stride)):
            raise _NotPlain("a tensor with unexpected sizes")
        span = offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride))
        size = sizes.get(value.file_offset) if type(value.file_offset) is int else None
        if size is None or (0 not in shape and span * value.dtype.itemsize > size):
            raise FormatError(f"{path}: the data of a tensor is missing or cut short: the file is truncated")
        return value
    if isinstance(value, dict):
        for item in value.values():
            _checked(item, path, sizes)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _checked(item, path, sizes)
    elif value is not None and not isinstance(value, (str, bytes, int, float, torch.dtype)):
        raise _NotPlain(f"a {type(value).__name__}")
    return value


@functools.cache
def _plain_globals() -> dict[tuple[str, str], Any]:
    """The globals a plain state dict's pickle names, each mapped to an inert stand-in: containers,
    dtypes, storage classes (as `_StorageType`) and the tensor reducers (building StoredTensors)."""
    table: dict[tuple[str, str], Any] = {("collections", "OrderedDict"): OrderedDict}
    for name in dir(torch):
        if isinstance(value := getattr(torch, name, None), torch.dtype):
            table["torch", name] = value
    for dtype, storage in torch_compat.storage_types().items():
        table["torch", storage.__name__] = _StorageType(dtype)
    table["torch", "UntypedStorage"] = table["torch.storage", "UntypedStorage"] = _StorageType(torch.uint8)
    return table


class _PlainUnpickler(pickle.Unpickler):
    """Reads the pickle of a plain state dict (dicts of tensors and numbers) with Python's C
    unpickler, about 4x faster than torch's weights-only one: every global it may name is an inert
    stand-in (`_plain_globals`), so the pickle can call nothing else; a pickle naming anything more
    raises `_NotPlain` and is read by torch's weights-only unpickler instead."""

    def __init__(self, raw: bytes, prefix: str, records: dict[str, tuple[int, int]]):
        super().__init__(io.BytesIO(raw), encoding="utf-8")
        self._prefix, self._records = prefix, records

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter"):
            return getattr(self, name)
        found = _plain_globals().get((module, name))
        if found is None:
            raise _NotPlain(f"{module}.{name}")
        return found

    def persistent_load(self, saved: Any) -> _Storage:
        if not (isinstance(saved, tuple) and len(saved) == 5 and saved[0] == "storage"):
            raise _NotPlain("an unexpected persistent id")
        _, kind, key, _, numel = saved
        if not isinstance(kind, _StorageType) or type(numel) is not int or numel < 0:
            raise _NotPlain("an unexpected storage")
        offset, size = self._records.get(f"{self._prefix}data/{key}", (None, 0))
        return _Storage(kind.dtype, numel, offset, size)

    def _rebuild_tensor_v2(self, storage, storage_offset, size, stride, requires_grad, hooks, metadata=None):
        return _stored(storage, storage_offset, size, stride, None)

    def _rebuild_tensor_v3(self, storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata=None):
        if not isinstance(dtype, torch.dtype):
            raise _NotPlain("a tensor of an unexpected dtype")
        return _stored(storage, storage_offset, size, stride, dtype)

    def _rebuild_parameter(self, data, requires_grad, hooks):
        if not isinstance(data, StoredTensor):
            raise _NotPlain("a parameter of something other than a tensor")
        return data


def _plain_metadata(raw: bytes, path: Path, prefix: str, records: dict[str, tuple[int, int]]) -> Any:
    """A plain state dict's metadata read by `_PlainUnpickler`; None for any other pickle (or one
    it cannot read), which torch's weights-only unpickler then reads or refuses as before."""
    try:
        sizes = {offset: size for name, (offset, size) in records.items() if name.startswith(f"{prefix}data/")}
        return _checked(_PlainUnpickler(raw, prefix, records).load(), path, sizes)
    except FormatError:
        raise
    except Exception:  # noqa: BLE001 - torch's unpickler reads it, or says what is wrong with it
        return None


_METADATA_CACHE: OrderedDict[tuple, Any] = OrderedDict()
_METADATA_LOCK = threading.Lock()


def parsed_once(path: Path, kind: str, parse: Callable[[Path], Any]) -> Any:
    """`parse(path)`, cached per kind of parse and file as it is now (path, device, inode, size,
    mtime, ctime): the many readers of one operation open a file's metadata many times and parse it
    once, and a file written to or replaced meanwhile is parsed again. Callers never change what
    it returns."""
    stat = os.stat(path)
    key = (kind, str(Path(path).absolute()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    with _METADATA_LOCK:
        if key in _METADATA_CACHE:
            _METADATA_CACHE.move_to_end(key)
            return _METADATA_CACHE[key]
    value = parse(path)
    with _METADATA_LOCK:
        _METADATA_CACHE[key] = value
        while len(_METADATA_CACHE) > 4096:
            _METADATA_CACHE.popitem(last=False)
    return value


def read_metadata(path: Path) -> Any:
    """load_metadata with shardkit's errors (unsafe pickle refused, truncation reported), parsed
    once per file (`parsed_once`)."""
    return parsed_once(path, "torch", _read_metadata_uncached)


def _read_metadata_uncached(path: Path) -> Any:
    try:
        return load_metadata(path)
    except FormatError:
        raise
    except pickle.UnpicklingError as e:
        reason = _refused_global(str(e)) if "GLOBAL" in str(e) else str(e).splitlines()[0]
        raise FormatError(
            f"refusing to load {path}: it holds Python objects other than tensors ({reason}); "
            "shardkit never runs arbitrary pickle: re-save it as a plain state dict"
        ) from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError, KeyError, TypeError, struct.error) as e:
        raise FormatError(
            f"{path} is truncated or corrupt ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}): re-create it"
        ) from None


class TorchFile(DescriptorReader):
    """Lazy reader of a torch.save state dict: metadata once, then positional reads of exactly
    the bytes a slice spans (no memory mapping, so nothing read stays resident)."""

    SINGLE = ""  # the name of the one tensor of a single-tensor file (xser's tensor files)

    def __init__(self, path: Path, single_tensor: bool = False):
        self.path = regular(Path(path))
        meta = read_metadata(self.path)
        self._fd: int | None = None
        if meta is None:  # legacy format: load it (bounded by one rank file)
            meta = safe_load(self.path, mmap=False)
        else:
            self._fd = os.open(self.path, os.O_RDONLY)
        if single_tensor:
            if not isinstance(meta, (torch.Tensor, StoredTensor)):
                raise FormatError(f"{self.path} does not hold a tensor")
            self._sd = {self.SINGLE: meta}
        else:
            self._sd = state_dict_of(meta, self.path)
        for name, value in self._sd.items():
            if not isinstance(value, (torch.Tensor, StoredTensor)):
                raise FormatError(f"{self.path}: entry {name} is a {type(value).__name__}, not a tensor")

    def keys(self) -> list[str]:
        return list(self._sd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._sd[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._sd[name].dtype

    def read(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        value = self._sd[name]
        if isinstance(value, StoredTensor):
            return read_stored(self._open_fd, value, dim, start, stop, str(self.path))
        return compact(narrow(value, dim, start, stop))

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows [start, stop) straight into `out`; False when not possible (then use read)."""
        value = self._sd[name]
        return isinstance(value, StoredTensor) and read_rows_into(
            self._open_fd, value, start, stop, out, str(self.path)
        )

    def read_block(self, name: str, first: int, last: int, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows [first, last), columns [start, stop) of a matrix into `out` (see `read_block`)."""
        value = self._sd[name]
        return isinstance(value, StoredTensor) and read_block(
            self._open_fd, value, first, last, start, stop, out, str(self.path)
        )

    def advise(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> None:
        """Start reading a slice's bytes in the background (see `advise_stored`)."""
        value = self._sd[name]
        if isinstance(value, StoredTensor):
            advise_stored(self._open_fd, value, dim, start, stop)

    def byte_range(
        self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None
    ) -> FileRange | None:
        """The file bytes of a slice, when the kernel can copy them as they are (`stored_range`)."""
        value = self._sd[name]
        if not isinstance(value, StoredTensor) or self._fd is None:
            return None
        return stored_range(self._fd, value, dim, start, stop, str(self.path))

    def span(self, name: str) -> tuple[int, int, int] | None:
        """Where a tensor's bytes are in the file, for read-ahead (see `byte_span`); None when
        the file was loaded whole (legacy format)."""
        value = self._sd[name]
        return byte_span(value) if isinstance(value, StoredTensor) and self._fd is not None else None

    def close(self) -> None:
        self._close_fd()
        self._sd = {}


class _StorageStub:
    """Stands for a tensor's storage in the pickle: torch.save's persistent id, without data."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorStub:
    """Pickles exactly as `Tensor.__reduce_ex__` does for a compact CPU tensor of this shape."""

    def __init__(self, storage: _StorageStub, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol):
        stride = StoredTensor(self.storage.dtype, self.shape, 0).strides()
        # fresh tuples, as torch makes them: the pickler memoizes by identity
        args = (self.storage, 0, tuple(list(self.shape)), tuple(list(stride)), False, OrderedDict())
        if self.storage.dtype in torch_compat.new_dtypes():
            return (torch_compat.rebuild_tensor_v3(), args + (self.storage.dtype,))
        return (torch_compat.rebuild_tensor_v2(), args)


class _StubPickler(pickle.Pickler):
    def persistent_id(self, obj):
        if not isinstance(obj, _StorageStub):
            return None
        if obj.dtype in torch_compat.new_dtypes():
            return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.numel * obj.dtype.itemsize)
        return ("storage", torch_compat.storage_type(obj.dtype), obj.key, "cpu", obj.numel)


def _stub(key: int, spec: TensorSpec) -> _TensorStub:
    return _TensorStub(_StorageStub(str(key), spec.dtype, spec.nbytes // spec.dtype.itemsize), tuple(spec.shape))


def _stub_pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    _StubPickler(buf, protocol=2).dump(obj)  # torch.save's default protocol
    return buf.getvalue()


def state_dict_pickle(specs: Sequence[TensorSpec]) -> bytes:
    """The data.pkl torch.save writes for {name: compact tensor} in spec order, from shapes alone."""
    return _stub_pickle({spec.name: _stub(key, spec) for key, spec in enumerate(specs)})


def tensor_pickle(spec: TensorSpec) -> bytes:
    """The data.pkl torch.save writes for one compact tensor (an xser tensor file), from its shape."""
    return _stub_pickle(_stub(0, spec))


class _ZipSink:
    """What torch's zip writer (`PyTorchFileWriter`) writes into: forwards to a HashingFile, but
    never lets an exception out. An exception thrown into torch's C++ writer leaves it mid-record,
    and its destructor then finishes the archive anyway and throws inside a destructor: the process
    aborts (`terminate called ... c10::Error`). So the first failure (a full disk, Ctrl-C) is kept
    in `error`, later writes are dropped, and the owner raises `error` once torch returns.

    While `owner` is set (a storage being written as a record, handed over by its caller), torch's
    view of that storage's bytes is written with `write_owned`: hashed behind the writes."""

    __slots__ = ("out", "error", "owner")

    def __init__(self, out: HashingFile):
        self.out: HashingFile | None = out
        self.error: BaseException | None = None
        self.owner: torch.UntypedStorage | None = None

    def write(self, data) -> None:
        try:
            if self.out is not None:
                owner = self.owner
                if owner is not None and len(data) >= PARALLEL_HASH_MIN and _inside(data, owner):
                    self.out.write_owned(data, owner)
                else:  # torch's own headers (from its temporary buffers) and unowned records
                    self.out.write(data)
        except BaseException as e:  # noqa: B036 - re-raised by the owner, outside torch's C++ frames
            self.error, self.out = e, None

    def flush(self) -> None:
        try:
            if self.out is not None:
                self.out.flush()
        except BaseException as e:  # noqa: B036
            self.error, self.out = e, None

    def discard(self) -> None:
        """From now on drop everything torch writes (its end of file, when it is destroyed)."""
        self.out = None


def _inside(data: memoryview, storage: torch.UntypedStorage) -> bool:
    """Whether the bytes of `data` lie inside `storage`'s memory (then the storage keeps them alive)."""
    import numpy

    address = numpy.frombuffer(data, dtype=numpy.uint8).__array_interface__["data"][0]
    start = storage.data_ptr()
    return start <= address and address + len(data) <= start + storage.nbytes()


_KEPT: list = []


def _keep_forever(zip_writer) -> None:
    """Never destroy a torch zip writer left mid-record by an exception that reached its C++ code:
    its destructor would throw and abort the process. Costs a few KiB, only after such a failure."""
    import ctypes
    import logging

    logging.getLogger(__name__).debug("keeping a failed torch zip writer alive: destroying it would abort")
    _KEPT.append(zip_writer)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(zip_writer))  # not even freed at interpreter exit


def _zip_size_bound(records: Sequence[tuple[str, int]], alignment: int) -> int:
    """An upper bound of the size of the archive torch writes for these (name, bytes) records:
    per record a local header, alignment padding, a central directory entry and zip64 fields;
    then the records torch adds at the end and the end-of-archive records."""
    total = 512
    for name, size in list(records) + [("version", 8), (".data/version", 8), (".data/serialization_id", 64)]:
        total += size + 2 * len("archive/" + name) + alignment + 160
    return total


def torch_save(obj: Any, out: HashingFile, **kwargs) -> None:
    """torch.save into a HashingFile, safely: a write failure (a full disk, Ctrl-C) is raised as
    itself once torch has returned, never thrown through torch's zip writer (see _ZipSink)."""
    sink = _ZipSink(out)
    try:
        # torch.save writes into any object with write() and flush(); its stub says IO[bytes]
        torch.save(obj, sink, **kwargs)  # type: ignore[arg-type]
    finally:
        sink.discard()
    if sink.error is not None:
        raise sink.error


def _archive_size(specs: Sequence[TensorSpec], pickle_bytes: int) -> tuple[int, int]:
    """(records, an upper bound of the bytes) of the archive torch.save writes for `specs` with a
    data.pkl of `pickle_bytes`."""
    records = [("data.pkl", pickle_bytes), (".format_version", 1), (".storage_alignment", 8), ("byteorder", 8)]
    records += [(f"data/{i}", s.nbytes) for i, s in enumerate(specs)]
    return len(records), _zip_size_bound(records, torch_compat.zip_options()[1])


def written_natively(specs: Sequence[TensorSpec], data_pkl: bytes | None = None) -> bool:
    """Whether a TorchWriter of `specs` (and `data_pkl`, as TorchWriter takes it) writes the
    archive itself (`torch_zip.ZipRecords`): then it can copy (`write_copy`) and stream rows
    (`begin_rows`)."""
    pickle_bytes = len(state_dict_pickle(list(specs)) if data_pkl is None else data_pkl)
    return native_writer(*_archive_size(specs, pickle_bytes))


class TorchWriter(DiscardOnFailure):
    """Streams one rank file in torch.save's format, a tensor at a time (each tensor with its own
    storage, as NxD writes them): the file is byte for byte what `torch.save(state_dict)` writes,
    but only the tensor being written is in memory. `write` is called in spec order. The archive is
    written by `torch_zip.ZipRecords` (the same bytes, a faster CRC32), or by torch's own zip
    writer where that cannot promise torch's bytes (see `torch_zip`).

    Any failure (a full disk, Ctrl-C, a wrong tensor) aborts the writer: the partial file is
    deleted and torch's zip writer is released without finishing the archive. A writer dropped
    without `close` (an exception elsewhere) aborts the same way when it is collected; `abort()`
    or `with TorchWriter(...) as w:` do it at once."""

    def __init__(
        self,
        path: Path,
        root: Path,
        specs: Sequence[TensorSpec],
        digests: Recording = Recording.FAST,
        direct: bool = False,
        data_pkl: bytes | None = None,
    ):
        check_specs(specs)
        self.path, self.root = Path(path), Path(root)
        self._specs = list(specs)
        self._next = 0
        self._zip = None
        self._native: ZipRecords | None = None
        self._broken = False
        if data_pkl is None:  # a state dict of the specs; `tensor_pickle` for a file of one bare tensor
            data_pkl = state_dict_pickle(self._specs)
        alignment = torch_compat.zip_options()[1]
        count, bound = _archive_size(self._specs, len(data_pkl))
        self._out = HashingFile(self.path, self.root, expected_size=bound, digests=digests, direct=direct)
        self._sink = _ZipSink(self._out)
        with self._discarding():
            if native_writer(count, bound):
                self._native = ZipRecords(self._out, alignment)
            else:
                self._zip, _ = torch_compat.file_writer(self._sink)
            # the records torch.save writes before the storages, in its order
            self._record("data.pkl", data_pkl, len(data_pkl))
            self._record(".format_version", b"1", 1)
            self._record(".storage_alignment", str(alignment).encode(), len(str(alignment)))
            self._record("byteorder", sys.byteorder.encode(), len(sys.byteorder))

    def _record(self, name: str, data, size: int) -> None:
        """One record; through torch's writer, the sink's failure is raised here, outside torch."""
        if self._native is not None:
            self._native.add(name, data)
            return
        zip_writer = self._zip
        if zip_writer is None:
            raise RuntimeError(f"{self.path}: the writer is closed or was aborted")
        try:
            zip_writer.write_record(name, data, size)
        except BaseException:
            self._broken = True  # thrown through torch's C++ writer: it is mid-record now
            raise
        if self._sink.error is not None:
            raise self._sink.error

    def write(self, name: str, tensor: torch.Tensor, owned: bool = False) -> None:
        with self._discarding():
            if not self._unfinished():
                raise RuntimeError(f"{self.path}: the writer is closed or was aborted")
            self.check_no_rows()
            spec = self._specs[self._next] if self._next < len(self._specs) else None
            if (
                spec is None
                or spec.name != name
                or tuple(tensor.shape) != tuple(spec.shape)
                or tensor.dtype != spec.dtype
            ):
                raise RuntimeError(f"{self.path}: expected {spec}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
            tensor = compact(tensor.detach())
            if self._native is not None:
                self._native.add(f"data/{self._next}", tensor_bytes(tensor), tensor if owned else None)
            else:
                storage = tensor.untyped_storage()
                self._sink.owner = storage if owned else None
                try:
                    self._record(f"data/{self._next}", storage, spec.nbytes)
                finally:
                    self._sink.owner = None
            self._next += 1

    def can_copy(self) -> bool:
        """Whether `write_copy` may be used: shardkit writes the archive itself (`torch_zip`)."""
        return self._native is not None

    def write_copy(self, name: str, ranges: Iterable[FileRange]) -> None:
        """Write the next tensor (of more than zero bytes) as source byte ranges, copied by the
        kernel (see `HashingFile.copy_ranges`)."""
        with self._discarding():
            native = self._native
            self.check_no_rows()
            spec = self._specs[self._next] if self._next < len(self._specs) else None
            if native is None or spec is None or spec.name != name or not spec.nbytes:
                raise RuntimeError(f"{self.path}: cannot copy {name} here (expected {spec})")
            native.add_copied(f"data/{self._next}", ranges, spec.nbytes)
            self._next += 1

    def can_stream_rows(self) -> bool:
        """Whether `begin_rows` may be used: shardkit writes the archive itself (`torch_zip`)."""
        return self._native is not None

    def begin_rows(self, name: str) -> RowBlocks:
        """Write the next tensor (a matrix, more than zero bytes) as blocks of its rows, each
        handed over as it comes (`add`), then `end()`: other files may be written in between
        (the files of a group built together, see `engine.planning.lockstep_groups`)."""
        with self._discarding():
            native = self._native
            self.check_no_rows()
            spec = self._specs[self._next] if self._next < len(self._specs) else None
            if native is None or spec is None or spec.name != name or not spec.nbytes or len(spec.shape) != 2:
                raise RuntimeError(f"{self.path}: cannot stream {name} here (expected {spec})")
            entry = native.begin(f"data/{self._next}", spec.nbytes)

            def done() -> None:
                native.end(entry)
                self._next += 1

            return RowBlocks(self, spec, lambda data, owner: native.append(entry, data, owner), done)

    def close(self, fsync: bool = False) -> list[FileRecord]:
        with self._discarding():
            if not self._unfinished():
                raise RuntimeError(f"{self.path}: the writer is closed or was aborted")
            if self._next != len(self._specs):
                missing = [s.name for s in self._specs[self._next :]]
                raise RuntimeError(f"{self.path}: tensors not written: {missing[:3]}")
            if self._native is not None:
                self._native.finish()
                self._native = None
            elif self._zip is not None:
                try:
                    self._zip.write_end_of_file()
                except BaseException:
                    self._broken = True
                    raise
                if self._sink.error is not None:
                    raise self._sink.error
                self._zip = None  # finished: its destructor writes nothing more
            record = self._out.close(fsync)
        return [record]

    def abort(self) -> None:
        """Give up this file: delete it and release torch's writer without finishing the archive.
        Safe to call at any time, more than once, and after a failure."""
        sink = getattr(self, "_sink", None)
        if sink is not None:
            sink.discard()
        self._native = None
        zip_writer, self._zip = getattr(self, "_zip", None), None
        if zip_writer is not None:
            if getattr(self, "_broken", False):
                _keep_forever(zip_writer)
            del zip_writer  # its destructor writes the end of the archive into the discarding sink
        out = getattr(self, "_out", None)
        if out is not None:
            out.abort()

    def _unfinished(self) -> bool:
        return getattr(self, "_zip", None) is not None or getattr(self, "_native", None) is not None
