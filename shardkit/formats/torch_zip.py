"""torch.save's zip archive written by shardkit itself, record by record, byte for byte as torch's
own writer (`torch._C.PyTorchFileWriter`) writes it.

Why not torch's writer: it computes each record's CRC32 with miniz on the writing thread, about
0.4 CPU-s per GB (a third of the main thread of a reshard). zlib-ng's CRC32 (SIMD) does the same
in 0.04. Everything else is the same bytes through the same `HashingFile`.

What torch 2.9-2.13 write (a stored archive, every name under "archive/"):
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

import functools
import io
import struct
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

try:  # SIMD CRC32 (~24 GB/s against the standard zlib's ~3)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - a platform without zlib-ng's wheels: same values, slower
    from zlib import crc32

from .. import torch_compat
from ..io.copy import FileRange

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

    def __init__(self, out: Any, alignment: int):
        self.out = out
        self.alignment = alignment
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
        full = (ARCHIVE + name).encode()
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
        names = tuple(entry.name.decode()[len(ARCHIVE) :] for entry in self._entries)
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
