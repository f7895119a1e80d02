"""What a torch.save file holds, read without its tensor data: its zip directory validated
(`torch_zip.read_archive`), its pickle read by `torch_pickle` (a plain state dict) or by torch's
own weights-only unpickler, and where each tensor's bytes sit in the file (`load_metadata`,
`read_metadata`: parsed once per file and cached); the one tensor of an archive embedded in a
larger file (`embedded_tensor`, PyTorch DCP's chunks). The only class a file may name beside
torch's own is torch-xla's `TensorReference` (xser reference files), allowed under its real name.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import struct
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import torch_compat
from ..errors import FormatError, ShardkitError
from ..io.data.strided import StoredTensor
from ..io.data.taps import OpenFile
from . import torch_pickle
from .torch_zip import Archive, read_archive

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
def references_allowed():
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


def refused(path: Path, e: Exception) -> FormatError:
    reason = _refused_global(str(e)) if "GLOBAL" in str(e) else (str(e).splitlines() or [""])[0][:160]
    return FormatError(
        f"refusing to load {path}: it holds Python objects other than tensors ({reason}); "
        "shardkit never runs arbitrary pickle: re-save it as a plain state dict"
    )


def corrupt(path: Path, e: Exception) -> FormatError:
    reason = str(e).splitlines()[0][:120] if str(e).strip() else type(e).__name__
    return FormatError(f"{path} is truncated or corrupt ({reason}): re-create it")


def _refused_global(message: str) -> str:
    for line in message.splitlines():
        if "GLOBAL" in line:
            return line.strip()[:160]
    return "unsupported global"


def _zip_record_offsets(path: Path) -> tuple[str, dict[str, tuple[int, int]]]:
    """The archive's folder prefix and, per record name, (data offset in the file, size).

    torch.save writes records uncompressed (ZIP_STORED) and aligned; a record's data starts after
    its local header, whose extra field (torch's alignment padding) may differ from the central one.
    """
    with zipfile.ZipFile(path) as archive, open(path, "rb") as fh:
        return _archive_records(archive, fh.fileno(), 0, path)


def _archive_records(
    archive: zipfile.ZipFile, fd: int, base: int, path: Path
) -> tuple[str, dict[str, tuple[int, int]]]:
    """`_zip_record_offsets` of an archive that starts at byte `base` of the file open as `fd`."""
    records: dict[str, tuple[int, int]] = {}
    infos = archive.infolist()
    pickles = [i.filename for i in infos if i.filename.endswith("data.pkl")]
    if not pickles:
        raise FormatError(f"{path} is not a torch.save file (no data.pkl): re-create it")
    prefix = pickles[0][: -len("data.pkl")]
    if hasattr(os, "posix_fadvise"):  # a cold file's headers (one per tensor) are read in parallel
        for info in infos:
            os.posix_fadvise(fd, base + info.header_offset + 26, 4, os.POSIX_FADV_WILLNEED)
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise FormatError(f"{path}: record {info.filename} is compressed; torch files never are")
        name_len, extra_len = struct.unpack("<HH", os.pread(fd, 4, base + info.header_offset + 26))
        records[info.filename] = (base + info.header_offset + 30 + name_len + extra_len, info.file_size)
    return prefix, records


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a file of their own (read positionally)."""

    def __init__(self, fd: int, start: int, length: int):
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = max(0, offset + (0, self._pos, self._length)[whence])
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        data = os.pread(self._fd, n, self._start + self._pos) if n else b""
        view[: len(data)] = data
        self._pos += len(data)
        return len(data)


def embedded_tensor(path: Path, offset: int, length: int) -> StoredTensor:
    """Where the one tensor of a torch.save archive stored at bytes [offset, offset + length) of
    `path` sits in that file (how PyTorch DCP's `.distcp` files hold each chunk, one archive after
    another): read from the archive's directory and its small pickle, nothing else."""
    path = Path(path)
    try:
        with open(path, "rb") as fh, zipfile.ZipFile(_Window(fh.fileno(), offset, length)) as archive:
            prefix, records = _archive_records(archive, fh.fileno(), offset, path)
            raw = archive.read(prefix + "data.pkl")
        value = _plain_metadata(raw, path, prefix, records)
    except (zipfile.BadZipFile, OSError, ValueError, struct.error, KeyError, EOFError) as e:
        raise FormatError(
            f"{path}: the tensor stored at bytes {offset}..{offset + length} is truncated or corrupt "
            f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}): re-create the checkpoint"
        ) from None
    if not isinstance(value, StoredTensor):
        raise FormatError(f"{path}: bytes {offset}..{offset + length} do not hold one plain tensor: re-create it")
    return value


def load_metadata(path: Path, file: OpenFile | None = None) -> Any:
    """The object a torch.save file holds, every tensor as a StoredTensor saying where its bytes
    are (no tensor data read); None for a legacy (non-zip) file. The archive's directory is
    validated first (`torch_zip.read_archive`). A plain state dict's pickle is read by
    `torch_pickle.load_plain`; anything else by torch's weights-only unpickler with its storages on
    the meta device (`_torch_metadata`), which accepts exactly what torch.load(weights_only=True)
    does, or refuses it. `file`: the file, opened (through its store); else opened here as a local file."""
    path = Path(path)
    archive = read_archive(path, file)
    if archive is None:
        return None
    plain = _plain_metadata(archive.pickle, path, archive.prefix, archive.records)
    if plain is not None:
        return plain
    return _torch_metadata(archive, path)


def _plain_metadata(raw: bytes, path: Path, prefix: str, records: dict[str, tuple[int, int]]) -> Any:
    """A plain state dict's metadata read by `torch_pickle.load_plain`; None for any other pickle
    (or one it cannot read), which torch's weights-only unpickler then reads or refuses."""
    try:
        return torch_pickle.load_plain(raw, path, records, prefix)
    except FormatError:
        raise
    except Exception:  # noqa: BLE001 - torch's unpickler reads it, or says what is wrong with it
        return None


def _torch_metadata(archive: Archive, path: Path) -> Any:
    """The pickle read by torch's own weights-only unpickler, its storages made on the meta device
    the way torch.load makes them (`persistent_load`), then every tensor located (`_located`)."""
    storages: dict[Any, torch.storage.TypedStorage] = {}
    located: dict[int, tuple[int, int]] = {}  # a meta storage's id -> its record's (data offset, bytes)

    def persistent_load(saved: Any) -> torch.storage.TypedStorage:
        # as torch.serialization._load's: the first storage of a key is the one every later use gets
        if not isinstance(saved, tuple) or _ascii(saved[0]) != "storage" or len(saved) != 5:
            raise pickle.UnpicklingError("a persistent id other than a storage")
        _, storage_type, key, location, numel = saved
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        if key in storages:
            return storages[key]
        if not isinstance(dtype, torch.dtype) or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError("a storage of an unexpected type or size")
        nbytes = numel * dtype.itemsize
        offset = torch_pickle.record_offset(path, archive.records, f"{archive.prefix}data/{key}", nbytes)
        _ascii(location)
        storage = torch.UntypedStorage(nbytes, device="meta")
        located[storage._cdata] = (offset, nbytes)
        typed = storages[key] = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
        return typed

    with references_allowed():
        unpickler = torch_compat.weights_only_unpickler(io.BytesIO(archive.pickle), encoding="utf-8")
        unpickler.persistent_load = persistent_load
        obj = unpickler.load()
    return _located(obj, path, located)


def _ascii(value: Any) -> Any:
    """torch.serialization._maybe_decode_ascii: bytes (a Python 2 pickle's) as ASCII text."""
    return value.decode("ascii") if isinstance(value, bytes) else value


def _located(obj: Any, path: Path, located: dict[int, tuple[int, int]]) -> Any:
    """`obj` with every tensor replaced by the StoredTensor of its bytes in the file. A tensor torch
    would read as other values than its bytes (quantized, sparse, conjugate or negative bits, a
    subclass, not made from a storage of this file) is refused. Each object is visited once (a
    pickle may repeat one many times); a container that contains itself is refused."""
    done: dict[int, Any] = {}
    busy: set[int] = set()

    def locate(value: Any) -> Any:
        if id(value) in done:
            return done[id(value)]
        if id(value) in busy:
            raise FormatError(f"{path}: a container contains itself: the file is corrupt; re-create it")
        busy.add(id(value))
        result: Any
        if isinstance(value, torch.Tensor):
            result = _stored(value, path, located)
        elif isinstance(value, dict):  # item by item: a Counter built from pairs would count them
            result = type(value)()
            for k, v in value.items():
                result[k] = locate(v)
        elif isinstance(value, (list, tuple)):
            result = type(value)(locate(v) for v in value)
        else:
            result = value
        busy.discard(id(value))
        done[id(value)] = result
        return result

    return locate(obj)


def _stored(tensor: torch.Tensor, path: Path, located: dict[int, tuple[int, int]]) -> StoredTensor:
    """The StoredTensor of a meta tensor torch's unpickler built on a storage of this file."""
    plain = (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )
    where = located.get(tensor.untyped_storage()._cdata) if plain and tensor.device.type == "meta" else None
    if where is None:
        raise FormatError(
            f"{path}: a tensor is not a plain view of a storage of the file (a {type(tensor).__name__}, "
            f"{tensor.layout}, conjugate or negative bits, or quantized): shardkit cannot read it as torch does"
        )
    offset, nbytes = where
    shape, stride, start = tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset())
    torch_pickle.check_tensor(path, tensor.dtype, shape, stride, start, nbytes)
    return StoredTensor(tensor.dtype, shape, offset, start, stride)


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


def read_metadata(path: Path, file: OpenFile | None = None) -> Any:
    """load_metadata with shardkit's errors (unsafe pickle refused, truncation reported), parsed
    once per file (`parsed_once`; `file`: as for `load_metadata`)."""
    return parsed_once(path, "torch", lambda p: _read_metadata_uncached(p, file))


def _read_metadata_uncached(path: Path, file: OpenFile | None = None) -> Any:
    try:
        return load_metadata(path, file)
    except ShardkitError:
        raise
    except pickle.UnpicklingError as e:
        raise refused(path, e) from None
    except Exception as e:  # noqa: BLE001 - whatever torch's unpickler raises for a bad pickle, on one line
        raise corrupt(path, e) from None
