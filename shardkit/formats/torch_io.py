"""torch.save files (NxD's own format): safe loading, positional reads, streamed hashed writes.

Loading never runs arbitrary pickle: `torch.load(weights_only=True)`, with the one foreign class
the formats need (torch-xla's `TensorReference`, which xser files reference) allowed under its
real name. A file that asks for anything else is refused with a clear error. A rank file's
metadata is read without tensor data (`torch_metadata`). Writing: `TorchWriter` streams a file a
tensor at a time, `save_file` saves a small object whole; both name the zip records' folder as
asked (`archive_folder`: "archive/", or after the file as NxD's files do).
"""

from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import torch_compat
from ..errors import FormatError, ShardkitError
from ..io.data.copy import FileRange
from ..io.data.digest import FileRecord, Recording
from ..io.data.hashing import PARALLEL_HASH_MIN, HashingFile
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
from ..io.safety.delete import remove_file
from ..io.safety.durable import fsync_path
from ..io.safety.oserror import disk_error
from ..io.safety.sinks import NO_SINK, Sink
from ..io.safety.small import check_small
from ..io.store import Store
from ..paths import ensure_free_space, free_space, no_space_error, regular_file
from .base import DiscardOnFailure, RowBlocks, TensorSpec, check_specs, compact, narrow, tensor_bytes
from .manifest import file_record
from .torch_metadata import corrupt, read_metadata, references_allowed, refused
from .torch_zip import ARCHIVE, ZipRecords, native_writer, read_archive


def regular(path: Path, what: str = "file") -> Path:
    """`path` if it is a regular file; else a one-line FormatError (missing, a folder, or a FIFO,
    device or socket, which would block a reader forever)."""
    try:
        return regular_file(path, what)
    except ShardkitError as e:
        raise FormatError(str(e)) from None


def safe_load(path: Path, mmap: bool = True, store: Store | None = None) -> Any:
    """torch.load with weights_only=True; TensorReference allowed; clear errors for bad files. A zip
    archive's directory is validated first (`torch_zip.read_archive`), as for `load_metadata`.
    `store`: what the file is read through (default: a local folder)."""
    path = regular(Path(path))
    store = store if store is not None else Store(path.parent)
    store.fetch_whole(path)  # a mirror file of an object store: fetched whole before torch reads it
    try:
        read_archive(path, store=store)
        with references_allowed():
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if mmap and "mmap" in str(e):  # legacy (pre-zip) files cannot be mapped
                    return torch.load(path, map_location="cpu", weights_only=True)
                raise
    except pickle.UnpicklingError as e:
        raise refused(path, e) from None
    except ShardkitError:
        raise
    except OSError as e:  # permissions, I/O errors: the file system's reason, not "corrupt"
        raise FormatError(str(disk_error(e, "read", path))) from None
    except Exception as e:  # noqa: BLE001 - whatever torch raises for a bad file, said on one line
        raise corrupt(path, e) from None


def load_small(path: Path, what: str, within: Path | None = None, store: Store | None = None) -> Any:
    """A small torch file read whole (scheduler, user content, xser info): `safe_load` (through
    `store`), once the bounded reader's rules hold (a regular file, not too large, and with
    `within` one lying inside that folder: `io.safety.small.check_small`)."""
    return safe_load(check_small(path, what, within=within), mmap=False, store=store)


def state_dict_of(obj: Any, path: Path) -> dict[str, Any]:
    """The flat name -> tensor dict inside a loaded file (training checkpoints wrap it in 'model')."""
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict) and "model.embed_tokens.weight" not in obj:
        obj = obj["model"]
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise FormatError(f"{path} does not hold a state dict (name -> tensor)")
    return obj


class TorchFile(DescriptorReader):
    """Lazy reader of a torch.save state dict: metadata once, then positional reads of exactly
    the bytes a slice spans (no memory mapping, so nothing read stays resident)."""

    SINGLE = ""  # the name of the one tensor of a single-tensor file (xser's tensor files)

    def __init__(self, path: Path, single_tensor: bool = False, store: Store | None = None):
        """`store`: what the file is read through (default: a local folder)."""
        self.path = regular(Path(path))
        store = store if store is not None else Store(self.path.parent)
        self._file: OpenFile | None = store.open(self.path)
        try:
            meta = read_metadata(self.path, self._file)
            if meta is None:  # legacy format: load it (bounded by one rank file)
                self._close_fd()
                meta = safe_load(self.path, mmap=False, store=store)
        except BaseException:
            self._close_fd()
            raise
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
            return read_stored(self._open_file, value, dim, start, stop, str(self.path))
        return compact(narrow(value, dim, start, stop))

    def read_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows [start, stop) straight into `out`; False when not possible (then use read)."""
        value = self._sd[name]
        return isinstance(value, StoredTensor) and read_rows_into(
            self._open_file, value, start, stop, out, str(self.path)
        )

    def read_block(self, name: str, first: int, last: int, start: int, stop: int, out: torch.Tensor) -> bool:
        """Rows [first, last), columns [start, stop) of a matrix into `out` (see `read_block`)."""
        value = self._sd[name]
        return isinstance(value, StoredTensor) and read_block(
            self._open_file, value, first, last, start, stop, out, str(self.path)
        )

    def advise(self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None) -> None:
        """Start reading a slice's bytes in the background (see `advise_stored`)."""
        value = self._sd[name]
        if isinstance(value, StoredTensor):
            advise_stored(self._open_file.fd, value, dim, start, stop)

    def byte_range(
        self, name: str, dim: int = 0, start: int | None = None, stop: int | None = None
    ) -> FileRange | None:
        """The file bytes of a slice, when the kernel can copy them as they are (`stored_range`)."""
        value = self._sd[name]
        if not isinstance(value, StoredTensor) or self._file is None:
            return None
        return stored_range(self._file, value, dim, start, stop, str(self.path))

    def span(self, name: str) -> tuple[int, int, int] | None:
        """Where a tensor's bytes are in the file, for read-ahead (see `byte_span`); None when
        the file was loaded whole (legacy format)."""
        value = self._sd[name]
        return byte_span(value) if isinstance(value, StoredTensor) and self._file is not None else None

    def close(self) -> None:
        self._close_fd()
        self._sd = {}


class _StorageStub:
    """Stands for a tensor's storage in the pickle: torch.save's persistent id, without data. A key
    of None is given when the pickler first meets the storage, as torch.save numbers them."""

    def __init__(self, key: str | None, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel
        self.tensor: _TensorStub | None = None


class _TensorStub:
    """Pickles exactly as `Tensor.__reduce_ex__` does for a compact CPU tensor of this shape."""

    def __init__(self, storage: _StorageStub, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape
        storage.tensor = self

    def __reduce_ex__(self, protocol):
        stride = StoredTensor(self.storage.dtype, self.shape, 0).strides()
        # fresh tuples, as torch makes them: the pickler memoizes by identity
        args = (self.storage, 0, tuple(list(self.shape)), tuple(list(stride)), False, OrderedDict())
        if self.storage.dtype in torch_compat.new_dtypes():
            return (torch_compat.rebuild_tensor_v3(), args + (self.storage.dtype,))
        return (torch_compat.rebuild_tensor_v2(), args)


class _StubPickler(pickle.Pickler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.met: list[_StorageStub] = []

    def persistent_id(self, obj):
        if not isinstance(obj, _StorageStub):
            return None
        if obj.key is None:
            obj.key = str(len(self.met))
            self.met.append(obj)
        if obj.dtype in torch_compat.new_dtypes():
            return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.numel * obj.dtype.itemsize)
        return ("storage", torch_compat.storage_type(obj.dtype), obj.key, "cpu", obj.numel)


def _stub(key: int, spec: TensorSpec) -> _TensorStub:
    return _TensorStub(_StorageStub(str(key), spec.dtype, spec.nbytes // spec.dtype.itemsize), tuple(spec.shape))


def _stub_pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    _StubPickler(buf, protocol=2).dump(obj)  # torch.save's default protocol
    return buf.getvalue()


def stub_tensor(shape: Sequence[int], dtype: torch.dtype) -> Any:
    """A stand-in for a compact CPU tensor in an object given to `object_pickle`."""
    return _TensorStub(_StorageStub(None, dtype, math.prod(shape)), tuple(shape))


def object_pickle(obj: Any) -> tuple[bytes, list[Any]]:
    """The data.pkl torch.save writes for `obj`, whose tensors are `stub_tensor`s (each its own
    storage), and those stubs in the order torch.save numbers and writes their storages (the
    order the pickler first meets them)."""
    buf = io.BytesIO()
    pickler = _StubPickler(buf, protocol=2)
    pickler.dump(obj)
    return buf.getvalue(), [storage.tensor for storage in pickler.met]


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


def keep_forever(zip_writer) -> None:
    """Never destroy a torch zip writer left mid-record by an exception that reached its C++ code:
    its destructor would throw and abort the process. Costs a few KiB, only after such a failure."""
    import ctypes
    import logging

    logging.getLogger(__name__).debug("keeping a failed torch zip writer alive: destroying it would abort")
    _KEPT.append(zip_writer)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(zip_writer))  # not even freed at interpreter exit


def _zip_size_bound(records: Sequence[tuple[str, int]], alignment: int, archive: str = ARCHIVE) -> int:
    """An upper bound of the size of the archive torch writes for these (name, bytes) records:
    per record a local header, alignment padding, a central directory entry and zip64 fields;
    then the records torch adds at the end and the end-of-archive records."""
    total = 512
    for name, size in list(records) + [("version", 8), (".data/version", 8), (".data/serialization_id", 64)]:
        total += size + 2 * len(archive + name) + alignment + 160
    return total


def archive_folder(path: Path, archive: str | None) -> str:
    """The folder a torch file's zip records are under: `archive` ("archive/": torch.save into a
    stream, as shardkit's save_checkpoint and the trainer write), or None: named after the file,
    as torch.save of a path names it (NxD's files: "x.pt" -> "x/", "x.pt.info.pt" -> "x.pt.info/")."""
    return archive if archive is not None else Path(path).stem + "/"


def writer_failure(e: RuntimeError, path: Path, needed: int) -> Exception:
    """The one-line error for a failure of torch's zip writer of `path` (its partial file deleted),
    or `e` itself when it is not the writer's."""
    text = str(e)
    if "inline_container" not in text and "PytorchStreamWriter" not in text and "cannot be opened" not in text:
        return e
    with contextlib.suppress(OSError):
        remove_file(path)  # torch's partial file (the I/O core's one delete)
    free = free_space(path.parent)
    if free is not None and free < needed:
        return no_space_error(path.parent, needed, free)
    if not os.access(path.parent, os.W_OK):
        return disk_error(PermissionError(errno.EACCES, "Permission denied"), "write", path)
    return disk_error(OSError(errno.EIO, f"torch's writer failed ({text.splitlines()[0][:120]})"), "write", path)


def _written_by_torch(path: Path, root: Path, digests: Recording, sink: Sink, fsync: bool) -> FileRecord:
    """The record of a file torch's own writer wrote (read back once: it hashes nothing), which is
    then handed to `sink`."""
    if fsync:
        fsync_path(path)
    if digests:
        record = file_record(path, root, sha256=digests is Recording.SHA256)
    else:
        record = FileRecord(path.relative_to(root).as_posix(), path.stat().st_size, None)
    sink.closed(path)  # an output bound for object storage may send it now
    return record


class SavedByPath:
    """A file torch.save wrote through its path (its records' folder named after the file): closed
    into its record, or aborted (deleted), like a HashingFile."""

    def __init__(self, path: Path, root: Path, digests: Recording, sink: Sink):
        self.path, self.root, self.digests, self.sink = path, root, digests, sink

    def close(self, fsync: bool = False) -> FileRecord:
        return _written_by_torch(self.path, self.root, self.digests, self.sink, fsync)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            remove_file(self.path)


def save_file(
    obj: Any,
    path: Path,
    root: Path,
    archive: str | None = ARCHIVE,
    digests: Recording = Recording.FAST,
    direct: bool = False,
    sink: Sink = NO_SINK,
    stored: int = 0,
    **kwargs: Any,
) -> HashingFile | SavedByPath:
    """torch.save(obj) to `path`, its records under `archive` (`archive_folder`): into a
    HashingFile (hashed as written), or by torch's writer of the path when named after the file
    (a full disk refused first, counting `stored` bytes of tensor data; its failures one line).
    Returns the file, to be closed (its record, handed to `sink`) or aborted."""
    if archive == ARCHIVE:
        out = HashingFile(path, root, digests=digests, direct=direct, sink=sink)
        try:
            torch_save(obj, out, **kwargs)
        except BaseException:
            out.abort()
            raise
        return out
    if archive is not None:
        raise ValueError(f"torch.save names the records' folder after the file or {ARCHIVE!r}, not {archive!r}")
    needed = stored + (64 << 10)
    path.parent.mkdir(parents=True, exist_ok=True)  # as HashingFile does
    ensure_free_space(path.parent, needed)
    try:
        torch.save(obj, str(path), **kwargs)
    except RuntimeError as e:
        raise writer_failure(e, path, needed) from None
    except BaseException:
        with contextlib.suppress(OSError):
            remove_file(path)
        raise
    return SavedByPath(path, root, digests, sink)


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


def _archive_size(specs: Sequence[TensorSpec], pickle_bytes: int, archive: str = ARCHIVE) -> tuple[int, int]:
    """(records, an upper bound of the bytes) of the archive torch.save writes for `specs` with a
    data.pkl of `pickle_bytes`."""
    records = [("data.pkl", pickle_bytes), (".format_version", 1), (".storage_alignment", 8), ("byteorder", 8)]
    records += [(f"data/{i}", s.nbytes) for i, s in enumerate(specs)]
    return len(records), _zip_size_bound(records, torch_compat.zip_options()[1], archive)


def written_natively(specs: Sequence[TensorSpec], data_pkl: bytes | None = None, archive: str = ARCHIVE) -> bool:
    """Whether a TorchWriter of `specs` (and `data_pkl`, as TorchWriter takes it) writes the
    archive itself (`torch_zip.ZipRecords`): then it can copy (`write_copy`) and stream rows
    (`begin_rows`)."""
    pickle_bytes = len(state_dict_pickle(list(specs)) if data_pkl is None else data_pkl)
    return native_writer(*_archive_size(specs, pickle_bytes, archive))


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
        archive: str | None = ARCHIVE,
        sink: Sink = NO_SINK,
    ):
        check_specs(specs)
        self.path, self.root = Path(path), Path(root)
        self._specs = list(specs)
        self._next = 0
        self._zip = None
        self._native: ZipRecords | None = None
        self._broken = False
        self._digests, self._handoff = digests, sink
        if data_pkl is None:  # a state dict of the specs; `tensor_pickle` for a file of one bare tensor
            data_pkl = state_dict_pickle(self._specs)
        folder = archive_folder(self.path, archive)
        alignment = torch_compat.zip_options()[1]
        count, bound = _archive_size(self._specs, len(data_pkl), folder)
        self._out: HashingFile | None = None
        self._sink: _ZipSink | None = None
        self._needed = bound
        if native_writer(count, bound) or folder == ARCHIVE:
            self._out = HashingFile(
                self.path, self.root, expected_size=bound, digests=digests, direct=direct, sink=sink
            )
            self._sink = _ZipSink(self._out)
        else:  # torch's writer names the records' folder after the file only when it opens the path itself
            self.path.parent.mkdir(parents=True, exist_ok=True)  # as HashingFile does
            ensure_free_space(self.path.parent, bound)
        with self._discarding():
            if native_writer(count, bound):
                assert self._out is not None
                self._native = ZipRecords(self._out, alignment, folder)
            elif self._sink is not None:
                self._zip, _ = torch_compat.file_writer(self._sink)
            else:
                self._zip, _ = torch_compat.file_writer(str(self.path))
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
        except BaseException as e:
            self._broken = True  # thrown through torch's C++ writer: it is mid-record now
            if isinstance(e, RuntimeError) and self._sink is None:
                raise writer_failure(e, self.path, self._needed) from None
            raise
        if self._sink is not None and self._sink.error is not None:
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
                if self._sink is not None:
                    self._sink.owner = storage if owned else None
                try:
                    self._record(f"data/{self._next}", storage, spec.nbytes)
                finally:
                    if self._sink is not None:
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
                except BaseException as e:
                    self._broken = True
                    if isinstance(e, RuntimeError) and self._sink is None:
                        raise writer_failure(e, self.path, self._needed) from None
                    raise
                if self._sink is not None and self._sink.error is not None:
                    raise self._sink.error
                self._zip = None  # finished: its destructor writes nothing more
            if self._out is not None:
                return [self._out.close(fsync)]
            return [_written_by_torch(self.path, self.root, self._digests, self._handoff, fsync)]

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
                keep_forever(zip_writer)
            del zip_writer  # its destructor writes the end of the archive into the discarding sink
        out = getattr(self, "_out", None)
        if out is not None:
            out.abort()
        elif hasattr(self, "_needed"):  # torch's writer of the path: its partial file
            with contextlib.suppress(OSError):
                remove_file(self.path)

    def _unfinished(self) -> bool:
        return getattr(self, "_zip", None) is not None or getattr(self, "_native", None) is not None
