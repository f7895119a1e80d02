"""torch.save's zip archive written by shardkit itself, record by record, byte for byte as torch's
own writer (`torch._C.PyTorchFileWriter`) writes it.

Why not torch's writer: it computes each record's CRC32 with miniz on the writing thread, which
was a third of a reshard's main thread; zlib-ng's SIMD CRC32 is about ten times faster. Everything
else is the same bytes through the same `HashingFile`.

What torch 2.9-2.13 write (a stored archive, every name under "archive/", or under the file's
name without its extension when torch.save opens the file itself):
- per record: a local header (version 0, flags 0x0808: sizes in a data descriptor, UTF-8 names;
  method 0, time and date 0, CRC and sizes 0), the name, one extra field "FB" + a 2-byte length +
  "Z" bytes that pads the data to the storage alignment, the data, and a data descriptor
  (signature, CRC32, size, size); an empty record has flags 0x0800, CRC 0 and no descriptor;
- after the caller's records, torch's own (`version`, "3\\n"), then `.data/serialization_id`: 20
  digits of a hash of the set of record names and 20 digits of the CRC32s of every earlier
  non-empty record, chained in order with boost's hash_combine;
- a central directory entry per record (versions 0, the same flags, CRC, sizes, name, no extra
  field, offset), a zip64 end-of-central-directory record (made by 0x031e, needs 45) with its
  locator, and the classic end record.

torch's own trailing records and the name hash are taken from torch (an archive of empty
records with the same names, written through torch's writer once per list of names). The first
use in a process writes a sample archive both ways and compares the bytes (`native_matches`):
where they differ (a torch that writes differently), `TorchWriter` uses torch's writer. So do
archives that reach 4 GiB or 65535 records, which need zip64 fields in every record.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import os
import re
import struct
import sys
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # SIMD CRC32, several times faster than the standard zlib's
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - a platform without zlib-ng's wheels: same values, slower
    from zlib import crc32

from .. import torch_compat
from ..errors import FormatError
from ..io.data.copy import FileRange
from ..io.data.taps import OpenFile
from ..io.store import Store, Unpredicted

ARCHIVE = "archive/"
"""The folder torch's writer puts every record in when it writes to a stream."""

MAX_RECORDS = 0xFFFF
MAX_ARCHIVE = 0xFFFFFFFF
"""At or past these, torch writes zip64 fields in every record: left to torch's writer."""

_FLAGS = 0x0808  # bit 3: CRC and sizes follow the data; bit 11: names are UTF-8
_EMPTY_FLAGS = 0x0800  # an empty record has no data descriptor
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<IIII")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_MASK64 = (1 << 64) - 1


def _hash_combine(seed: int, value: int) -> int:
    """boost::hash_combine on 64-bit size_t, as c10::hash_combine computes it."""
    return seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)


@dataclass
class _Entry:
    """A record written: full name, CRC32 (a copied record's is filled in as it is copied), size,
    offset of its local header."""

    name: bytes
    crc: int
    size: int
    offset: int
    written: int = 0  # of a record still being written (`begin`, `append`)


class ZipRecords:
    """Writes the records of one torch.save archive into `out` (a `HashingFile`, or anything with
    `write(data)`, `write_owned(data, owner)` and a `size`), then `finish()` adds torch's own
    trailing records, the serialization id and the central directory."""

    def __init__(self, out: Any, alignment: int, archive: str = ARCHIVE):
        self.out = out
        self.alignment = alignment
        self.archive = archive  # the records' folder: torch.save names it after a file it opens itself
        self._entries: list[_Entry] = []

    def add(self, name: str, data: Any, owner: object = None) -> None:
        """One stored record: header, `data` (a buffer; with `owner`, handed to `write_owned`, so
        it may be written and hashed behind), data descriptor."""
        view = memoryview(data).cast("B")
        entry = self.begin(name, len(view))
        self.append(entry, view, owner)
        self.end(entry)

    def begin(self, name: str, size: int) -> _Entry:
        """Start a stored record of `size` bytes: its header. Its data follows in `append`s (no
        other record in between), then `end`."""
        full, offset = self._header(name, size)
        return _Entry(full, 0, size, offset)

    def append(self, entry: _Entry, data: Any, owner: object = None) -> None:
        """The next bytes of the record `begin` started (`owner`: as in `add`)."""
        view = memoryview(data).cast("B")
        if entry.written + len(view) > entry.size:
            raise RuntimeError(f"{entry.name.decode()}: more than its {entry.size} bytes")
        if len(view):
            entry.crc = crc32(view, entry.crc)
            if owner is not None:
                self.out.write_owned(view, owner)
            else:
                self.out.write(view)
        entry.written += len(view)

    def end(self, entry: _Entry) -> None:
        """After all of a record's bytes: its data descriptor; the record joins the directory."""
        if entry.written != entry.size:
            raise RuntimeError(f"{entry.name.decode()}: {entry.written} of its {entry.size} bytes written")
        self._end(entry.name, entry.crc, entry.size, entry.offset)

    def add_copied(self, name: str, ranges: Iterable[FileRange], size: int) -> None:
        """One stored record whose data is `ranges` of source files, one after another, `size` (> 0)
        bytes in all, copied by the kernel (`out.copy_ranges`, a `HashingFile`); the CRC32 is
        computed from the bytes read back as they are copied, and the data descriptor written
        once it is known (`finish` waits for all)."""
        full, offset = self._header(name, size)
        entry = _Entry(full, 0, size, offset)

        def seen(block: memoryview) -> None:
            entry.crc = crc32(block, entry.crc)

        def descriptor() -> bytes:
            return _DESCRIPTOR.pack(0x08074B50, entry.crc, size, size)

        copied = self.out.copy_ranges(ranges, seen, descriptor, _DESCRIPTOR.size)
        if copied != size:
            raise RuntimeError(f"{name}: copied {copied} bytes, expected {size}")
        self._entries.append(entry)

    def _header(self, name: str, size: int) -> tuple[bytes, int]:
        """Write a record's local header; its full name and offset."""
        full = (self.archive + name).encode()
        offset = self.out.size
        start = offset + _LOCAL.size + len(full) + 4  # where the data would start without padding
        padding = -start % self.alignment
        flags = _FLAGS if size else _EMPTY_FLAGS
        header = _LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), padding + 4)
        self.out.write(header + full + b"FB" + struct.pack("<H", padding) + b"Z" * padding)
        return full, offset

    def _end(self, full: bytes, checksum: int, size: int, offset: int) -> None:
        """After a record's data: its data descriptor; the record joins the directory."""
        if size:
            self.out.write(_DESCRIPTOR.pack(0x08074B50, checksum, size, size))
        self._entries.append(_Entry(full, checksum, size, offset))

    def finish(self) -> None:
        """torch's trailing records, the serialization id, then the central directory."""
        self.out.flush()  # copied records are written and their CRC32s known
        names = tuple(entry.name.decode()[len(self.archive) :] for entry in self._entries)
        trailer, id_name, name_hash = torch_trailer(names)
        for name, content in trailer:
            self.add(name, content)
        combined = 0
        for entry in self._entries:
            if entry.size:  # torch leaves empty records out of the chain
                combined = _hash_combine(combined, entry.crc)
        self.add(id_name, f"{name_hash}{combined:020d}".encode())
        start = self.out.size
        directory = bytearray()
        for entry in self._entries:
            flags = _FLAGS if entry.size else _EMPTY_FLAGS
            directory += _CENTRAL.pack(
                0x02014B50,
                0,
                0,
                flags,
                0,
                0,
                0,
                entry.crc,
                entry.size,
                entry.size,
                len(entry.name),
                0,
                0,
                0,
                0,
                0,
                entry.offset,
            )
            directory += entry.name
        count, length = len(self._entries), len(directory)
        end64 = start + length
        directory += _ZIP64_END.pack(0x06064B50, _ZIP64_END.size - 12, 0x031E, 45, 0, 0, count, count, length, start)
        directory += _ZIP64_LOCATOR.pack(0x07064B50, 0, end64, 1)
        directory += _END.pack(0x06054B50, 0, 0, count, count, length, start, 0)
        self.out.write(directory)


class _Buffer:
    """An in-memory `out` for ZipRecords and torch's writer alike."""

    def __init__(self) -> None:
        self.data = bytearray()

    @property
    def size(self) -> int:
        return len(self.data)

    def write(self, data: Any) -> int:
        self.data += data
        return len(data)

    def write_owned(self, data: Any, owner: object) -> int:
        return self.write(data)

    def flush(self) -> None:
        pass


def _torch_archive(records: Sequence[tuple[str, bytes]]) -> bytes:
    """The archive torch's own writer writes for these records (without its extra fields)."""
    out = _Buffer()
    writer, _ = torch_compat.file_writer(out)
    for name, data in records:
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return bytes(out.data)


@functools.lru_cache(maxsize=16)
def torch_trailer(names: tuple[str, ...]) -> tuple[tuple[tuple[str, bytes], ...], str, str]:
    """What torch's writer adds after records with these names: ((name, content) of its own
    records, the serialization id's record name, the id's first 20 digits: the hash of the set of
    names). Read off an archive of empty records with the same names, written by torch."""
    with zipfile.ZipFile(io.BytesIO(_torch_archive([(name, b"") for name in names]))) as archive:
        infos = archive.infolist()
        added = [(info.filename[len(ARCHIVE) :], archive.read(info)) for info in infos[len(names) :]]
    *own, (id_name, id_value) = added
    if len(id_value) != 40 or not id_value.isdigit():
        raise torch_compat.changed("the serialization id of torch._C.PyTorchFileWriter")
    return tuple(own), id_name, id_value[:20].decode()


def _sample() -> list[tuple[str, bytes]]:
    """Records shaped like a rank file's: the metadata records, an empty tensor, odd sizes."""
    return [
        ("data.pkl", b"\x80\x02}q\x00." * 3),
        (".format_version", b"1"),
        (".storage_alignment", b"64"),
        ("byteorder", b"little"),
        ("data/0", b""),
        ("data/1", bytes(range(256)) * 5 + b"odd"),
        ("data/2", b"\x01" * 64),
    ]


def native_writer(records: int, size_bound: int) -> bool:
    """Whether an archive of this many records, at most `size_bound` bytes, is written by
    ZipRecords (else by torch's writer)."""
    return records + 8 < MAX_RECORDS and size_bound < MAX_ARCHIVE and native_matches()


def clear_caches() -> None:
    """Forget the checks against the running torch (for tests that swap its internals)."""
    native_matches.cache_clear()
    torch_trailer.cache_clear()


@functools.cache
def native_matches() -> bool:
    """Whether ZipRecords writes what the running torch's writer writes (checked once, on a sample
    archive; False on any difference, and then torch's writer is used)."""
    alignment = torch_compat.zip_options()[1]
    if not torch_compat.zip_options()[0]:  # torch set not to compute CRC32s: its bytes differ
        return False
    ours = _Buffer()
    records = ZipRecords(ours, alignment)
    try:
        for name, data in _sample():
            records.add(name, data)
        records.finish()
    except (torch_compat.TorchInternalsError, zipfile.BadZipFile, ValueError):
        return False
    return bytes(ours.data) == _torch_archive(_sample())


# ---- reading: the archive's directory, validated before any record is used ------------------------
#
# torch reads an archive with miniz, shardkit with its own parser below. Where the two could see
# different records (two records of one name, records sharing bytes, a local header that names
# another record, data before the archive, a record outside the archive's folder...) the file is
# refused: it was not written by torch.save, and whatever it holds, torch and shardkit must not
# read different tensors from it. What torch itself refuses (no version record, an unknown version
# or byte order) is refused too.

_LOCAL_SIGNATURE = b"PK\x03\x04"  # torch's own test of whether a file is a zip archive
_ZIP64_EXTRA = 0x0001
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_KNOWN_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names: all torch (and zipfile) write
TORCH_VERSIONS = (1, 10)
"""The archive versions torch 2.9-2.13 read (`version` or `.data/version`; it writes 3)."""


@dataclass(frozen=True)
class Archive:
    """A torch.save archive whose directory was validated (`read_archive`): its folder ("archive/"),
    each record's data offset and size by full name, and its data.pkl."""

    prefix: str
    records: dict[str, tuple[int, int]]
    pickle: bytes


@dataclass
class _Listed:
    """A record as the central directory lists it."""

    name: str
    crc: int
    size: int
    header: int  # offset of its local header
    flags: int
    data: int = 0  # offset of its data, from its local header


class _Refused(Exception):
    """What is wrong with an archive; `read_archive` says it with the file's name."""


def read_archive(path: Any, file: OpenFile | None = None, store: Store | None = None) -> Archive | None:
    """The validated directory of the torch.save archive at `path` (read through `file`, that
    file opened; else opened through `store`, default a local folder); None when the file does
    not start as a zip archive (torch reads it as a legacy pickle file). Anything torch could read
    differently from shardkit is a one-line FormatError naming the file. (Its metadata is read as
    it is: a mirror's file has it fetched when its store prepares it, `io.store.Store.prepare`.)"""
    opened = file if file is not None else (store if store is not None else Store(Path(path).parent)).open(path)
    try:
        fd = opened.fd
        if os.pread(fd, 4, 0) != _LOCAL_SIGNATURE:
            return None
        try:
            return _read_archive(opened, os.fstat(fd).st_size)
        except (_Refused, struct.error, UnicodeDecodeError) as e:
            what = str(e) if isinstance(e, _Refused) else f"an unreadable directory entry ({e})"
            raise FormatError(f"{path} is truncated or corrupt ({what}): re-create it") from None
    finally:
        if file is None:
            opened.close()


def _read_archive(file: OpenFile, size: int) -> Archive:
    fd = file.fd
    count, start, length = _directory_place(fd, size)
    listed = _central_directory(os.pread(fd, length, start), count)
    prefix = _folder(listed)
    if not (file.fetcher is not None and file.fetcher.streamed and _predict_data(file, listed, start)):
        _local_headers(fd, listed, start)
    records = {r.name: (r.data, r.size) for r in listed}
    # The small records torch reads before the pickle (and data.pkl itself) are read whole here:
    # their CRC-32 is checked. The tensor records' is not: the manifest's digests cover their bytes,
    # and checking the CRC of gigabytes at every open would cost more than the reading it guards.
    small: dict[str, bytes] = {}
    for record in listed:
        short = record.name[len(prefix) :]
        if not short.startswith("data/"):
            data = os.pread(fd, record.size, record.data)
            if len(data) != record.size:
                raise _Refused(f"record {record.name} cut short")
            if crc32(data) != record.crc:
                raise _Refused(f"record {record.name} does not match its CRC-32")
            small[short] = data
    _check_torch_records(small)
    return Archive(prefix, records, small["data.pkl"])


def _directory_place(fd: int, size: int) -> tuple[int, int, int]:
    """(records, offset, length) of the central directory, from the end record (zip64's where
    there is one, as miniz reads it). The directory must end where the end records begin: no data
    before the archive, no comment, nothing after it."""
    if size < _END.size + _LOCAL.size:
        raise _Refused("no end-of-archive record")
    sig, disk, cd_disk, on_disk, count, length, start, comment = _END.unpack(os.pread(fd, _END.size, size - _END.size))
    if sig != 0x06054B50 or comment:
        raise _Refused("no end-of-archive record at its end: cut short, or bytes after it")
    end = size - _END.size
    locator = os.pread(fd, _ZIP64_LOCATOR.size, end - _ZIP64_LOCATOR.size) if end >= _ZIP64_LOCATOR.size else b""
    if locator[:4] == struct.pack("<I", 0x07064B50):
        _, z_disk, z_offset, disks = _ZIP64_LOCATOR.unpack(locator)
        if z_disk or disks != 1 or z_offset > end - _ZIP64_LOCATOR.size - _ZIP64_END.size:
            raise _Refused("an invalid zip64 end-of-archive locator")
        fields = _ZIP64_END.unpack(os.pread(fd, _ZIP64_END.size, z_offset))
        z_sig, z_size, _, _, z_this, z_cd_disk, z_on_disk, z_count, z_length, z_start = fields
        if z_sig != 0x06064B50 or z_offset + 12 + z_size != end - _ZIP64_LOCATOR.size:
            raise _Refused("an invalid zip64 end-of-archive record")
        for classic, wide, sentinel in (
            (on_disk, z_on_disk, _U16),
            (count, z_count, _U16),
            (length, z_length, _U32),
            (start, z_start, _U32),
            (disk, z_this, _U16),
            (cd_disk, z_cd_disk, _U16),
        ):
            if classic not in (wide, sentinel):
                raise _Refused("two end-of-archive records that disagree")
        disk, cd_disk, on_disk, count, length, start, end = (
            z_this,
            z_cd_disk,
            z_on_disk,
            z_count,
            z_length,
            z_start,
            z_offset,
        )
    if disk or cd_disk or on_disk != count:
        raise _Refused("a multi-part archive")
    if start + length != end:
        raise _Refused("a central directory that is not where its end record says")
    return count, start, length


def _central_directory(directory: bytes, count: int) -> list[_Listed]:
    """The records the central directory lists, each a stored (uncompressed, unencrypted) record
    whose name is UTF-8; sizes and offsets from zip64 fields where the entry has them."""
    listed, pos = [], 0
    for _ in range(count):
        fields = _CENTRAL.unpack_from(directory, pos)
        sig, _, _, flags, method, _, _, crc, csize, usize, nlen, xlen, clen, disk, _, _, header = fields
        if sig != 0x02014B50:
            raise _Refused("a corrupt central directory")
        raw = directory[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen]
        extra = directory[pos + _CENTRAL.size + nlen : pos + _CENTRAL.size + nlen + xlen]
        pos += _CENTRAL.size + nlen + xlen + clen
        name = raw.decode("utf-8")
        usize, csize, header, disk = _zip64_fields(extra, usize, csize, header, disk)
        if method != 0 or csize != usize:
            raise _Refused(f"record {name} is compressed; torch files never are")
        if flags & ~_KNOWN_FLAGS or disk:
            raise _Refused(f"record {name} is encrypted or split (flags {flags:#x})")
        listed.append(_Listed(name, crc, usize, header, flags))
    if pos != len(directory):
        raise _Refused("a central directory of another number of records than its end record says")
    return listed


def _zip64_fields(extra: bytes, usize: int, csize: int, header: int, disk: int) -> tuple[int, int, int, int]:
    """The fields a directory entry marks as in its zip64 extra field (all 1s), read from it in
    the order the format (and miniz) reads them."""
    wanted = [usize == _U32, csize == _U32, header == _U32, disk == _U16]
    if not any(wanted):
        return usize, csize, header, disk
    pos = 0
    while pos + 4 <= len(extra):
        kind, length = struct.unpack_from("<HH", extra, pos)
        if kind == _ZIP64_EXTRA:
            values = list(struct.unpack_from(f"<{sum(wanted[:3])}Q{'I' if wanted[3] else ''}", extra, pos + 4))
            fields = [usize, csize, header, disk]
            for i, want in enumerate(wanted):
                if want:
                    fields[i] = values.pop(0)
            return fields[0], fields[1], fields[2], fields[3]
        pos += 4 + length
    raise _Refused("a record's header lacks its zip64 fields")


def _folder(listed: list[_Listed]) -> str:
    """The archive's folder ("archive/"), as torch finds it: the first component of the first
    record's name. Every record must be inside it, under a plain relative name, and no two names
    may be equal ignoring ASCII case (miniz looks names up so)."""
    if not listed:
        raise _Refused("no records")
    first = listed[0].name
    if "/" not in first:
        raise _Refused(f"record {first} is not inside the archive's folder")
    prefix = first[: first.index("/") + 1]
    seen: set[bytes] = set()
    for record in listed:
        name = record.name
        parts = name.split("/")
        if (
            not name.startswith(prefix)
            or any(part in ("", ".", "..") for part in parts)
            or "\\" in name
            or any(ord(c) < 32 for c in name)
        ):
            raise _Refused(f"record {name!r} is outside the archive's folder {prefix[:-1]!r} or not a plain name")
        folded = name.encode().lower()
        if folded in seen:
            raise _Refused(f"two records are named {name!r}")
        seen.add(folded)
    if prefix + "data.pkl" not in {r.name for r in listed}:
        raise _Refused("no data.pkl: not a torch.save file")
    return prefix


def _local_headers(fd: int, listed: list[_Listed], directory: int) -> None:
    """Each record's data offset, from its local header, which must agree with the directory
    (name, flags, method, sizes); no two records' bytes (header and data) may overlap each other
    or the central directory."""
    if hasattr(os, "posix_fadvise"):  # a cold file's headers (one per tensor) are read in parallel
        for record in listed:
            os.posix_fadvise(fd, record.header, _LOCAL.size + 256, os.POSIX_FADV_WILLNEED)
    for record in listed:
        name = record.name.encode()
        raw = os.pread(fd, _LOCAL.size + len(name), record.header)
        if len(raw) < _LOCAL.size + len(name):
            raise _Refused(f"the header of record {record.name} cut short")
        sig, _, flags, method, _, _, crc, csize, usize, nlen, xlen = _LOCAL.unpack_from(raw)
        if sig != 0x04034B50 or raw[_LOCAL.size :] != name or nlen != len(name):
            raise _Refused(f"the local header of record {record.name} names another record")
        if _U32 in (csize, usize):  # zip64: both sizes in the header's zip64 extra field
            extra = os.pread(fd, xlen, record.header + _LOCAL.size + nlen)
            usize, csize, _, _ = _zip64_fields(extra, usize, csize, 0, 0)
        descriptor = bool(flags & 0x08)  # CRC and sizes after the data: the header's may be 0
        if (
            flags != record.flags
            or method != 0
            or not _agrees(crc, record.crc, descriptor)
            or not _agrees(csize, record.size, descriptor)
            or not _agrees(usize, record.size, descriptor)
        ):
            raise _Refused(f"the local header of record {record.name} disagrees with the central directory")
        record.data = record.header + _LOCAL.size + nlen + xlen
    end = 0
    for record in sorted(listed, key=lambda r: r.header):
        if record.header < end:
            raise _Refused(f"record {record.name} overlaps another record")
        end = record.data + record.size
    if end > directory:
        raise _Refused("a record that overlaps the central directory")


def _tensor(record: _Listed) -> bool:
    return "/data/" in record.name and not record.name.endswith(".pkl")


def _predict_data(file: OpenFile, listed: list[_Listed], directory: int) -> bool:
    """For a file streamed from object storage (`io.objects.remote`), whose tensor records' local headers
    have not been fetched: each tensor record's data offset from the directory alone, as torch.save
    lays records out (each record's data, then a data descriptor of the same size as the first
    tensor record's, then the next record; descriptors of zip64 records 8 bytes longer), checked
    against the real local headers before anything written from it is committed
    (`Fetcher.check_later`). False where the layout is not that (the headers are then read now)."""
    fd, fetcher = file.fd, file.fetcher
    assert fetcher is not None  # a streamed file's
    ordered = sorted(listed, key=lambda r: r.header)
    tensors = [r for r in ordered if _tensor(r)]
    if not tensors or any(r.flags & 0x08 == 0 for r in tensors):
        return False
    first = tensors[0]
    _local_headers(fd, [r for r in ordered if not _tensor(r)] + [first], directory)  # fetched with the metadata
    following = {id(a): b.header for a, b in zip(ordered, ordered[1:])}
    big = [_U32 <= max(r.size, r.header) for r in tensors]
    gap = following.get(id(first), directory) - first.data - first.size - (8 if big[0] else 0)
    if gap not in (12, 16):  # a descriptor: CRC and sizes, after its signature or without it
        return False
    for record, zip64 in zip(tensors[1:], big[1:]):
        record.data = following.get(id(record), directory) - record.size - gap - (8 if zip64 else 0)
        if record.data < record.header + 30 + len(record.name.encode()):
            return False
    predicted = [dataclasses.replace(r) for r in listed]

    def check(fd: int) -> None:
        real = [dataclasses.replace(r, data=0) for r in predicted]
        try:
            _local_headers(fd, real, directory)
        except _Refused as e:
            raise FormatError(f"{fetcher.shown} is corrupt ({e}): re-create it") from None
        for guess, found in zip(predicted, real):
            if guess.data != found.data:
                raise Unpredicted(
                    f"{fetcher.shown} is not laid out as torch.save lays out its records (record {found.name})"
                )

    fetcher.check_later(check, [(r.header, r.data) for r in tensors])
    return True


def _agrees(local: int, central: int, descriptor: bool) -> bool:
    """Whether a local header's CRC or size agrees with the directory's: equal, or 0 when the
    record has a data descriptor (torch's writer leaves them 0 there)."""
    return local == central or (descriptor and local == 0)


def _check_torch_records(small: dict[str, bytes]) -> None:
    """What torch reads and checks before the pickle: a version it supports (`.data/version`,
    else `version`), this machine's byte order (torch would swap the bytes of every tensor), a
    storage alignment that is a number; no TorchScript. (A missing byte order is little endian.)"""
    version = small.get(".data/version", small.get("version"))
    if version is None:
        raise _Refused("no version record")
    lo, hi = TORCH_VERSIONS
    if not re.fullmatch(rb"[0-9]{1,6}\n?", version) or not lo <= int(version) <= hi:
        raise _Refused(f"version {version[:20]!r}, which torch does not read")
    if small.get("byteorder", b"little") != sys.byteorder.encode():  # torch's default: little
        raise _Refused(f"byte order {small.get('byteorder', b'')[:20]!r}, not this machine's")
    if ".storage_alignment" in small:
        try:
            int(small[".storage_alignment"])
        except ValueError:
            raise _Refused("a storage alignment that is not a number") from None
    if "constants.pkl" in small:
        raise _Refused("a TorchScript archive, not a state dict")
