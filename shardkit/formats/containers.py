"""Where a tensor container's metadata lies, read from the bytes of it already fetched.

An object store charges a request per ranged GET (and takes a round trip for each), so a
mirror (`io.objects.remote`) fetches a container's metadata in as few GETs as the format allows: its head
and tail first, then what they point at (`after_head_and_tail`), then the zip records' local
headers and small records (`zip_records`), and only if a header's extra field reaches past the
window fetched with it, the rest (`zip_header_rests`). Each function takes `pread(offset, n)` over
bytes that are already local; none of them validates the container (the format readers beside it
do, from the same bytes): they only say which bytes those readers will read. `fetch_metadata` is
what whoever prepares a store's files hands it (`io.store.Store.prepare`): the I/O core knows no
format.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..io.store import Container

Pread = Callable[[int, int], bytes]

HEAD = 64 << 10
"""Fetched from the start of every container: a safetensors header's length, a zip's first
records (torch.save writes data.pkl first)."""
TAIL = 64 << 10
"""Fetched from the end of every zip: its end records and, for a few hundred tensors, its whole
central directory."""
HEADER_WINDOW = 256
"""Bytes fetched after a local header's fixed part and name: its extra field (torch pads the data
to 64 bytes with it; zip64 adds 20) almost always ends inside."""

_LOCAL = 30
_END = 22


@dataclass(frozen=True)
class ZipRecord:
    """One record of a zip's central directory: name, local header offset, stored size."""

    name: str
    header: int
    size: int

    @property
    def tensor_data(self) -> bool:
        """A tensor's bytes (torch's `<archive>/data/<key>`), read only where planned."""
        return "/data/" in self.name and not self.name.endswith(".pkl")


def is_zip(pread: Pread) -> bool:
    return pread(0, 4) == b"PK\x03\x04"


def after_head_and_tail(name: str, size: int, pread: Pread) -> list[tuple[int, int]]:
    """Step 2: a safetensors header; a zip's central directory (and zip64 end record); a legacy
    pickle whole (torch.load reads it all)."""
    head = pread(0, 8)
    if name.endswith(".safetensors") and len(head) == 8:
        (n,) = struct.unpack("<Q", head)
        return [(8, min(size, 8 + n))]
    if head[:4] != b"PK\x03\x04":
        return [(0, size)]
    place = _directory(size, pread)
    if place is None:
        return [(0, size)]  # no end record where a reader looks for it: the readers refuse or read it all
    start, length, zip64_end = place
    ranges = [(start, min(size, start + length))]
    if zip64_end is not None:
        ranges.append((zip64_end, min(size, zip64_end + 56)))
    return ranges


def _directory(size: int, pread: Pread) -> tuple[int, int, int | None] | None:
    """(offset, length, zip64 end record offset or None) of the central directory, from the
    end record (as `formats.torch_zip` reads it: at the very end, no comment)."""
    if size < _END + _LOCAL:
        return None
    end = pread(size - _END, _END)
    if end[:4] != b"PK\x05\x06":
        return None
    length, start = struct.unpack("<II", end[12:20])
    locator = pread(size - _END - 20, 20) if size >= _END + 20 else b""
    if locator[:4] != b"PK\x06\x07":
        return start, length, None
    (zip64_end,) = struct.unpack("<Q", locator[8:16])
    record = pread(zip64_end, 56)
    if len(record) < 56 or record[:4] != b"PK\x06\x06":
        return start, length, zip64_end
    length, start = struct.unpack("<QQ", record[40:56])
    return start, length, zip64_end


def central_records(size: int, pread: Pread) -> list[ZipRecord]:
    """Every record the (fetched) central directory lists; [] when there is none to read."""
    place = _directory(size, pread)
    if place is None:
        return []
    start, length, _ = place
    cd = pread(start, min(length, max(0, size - start)))
    records: list[ZipRecord] = []
    pos = 0
    while pos + 46 <= len(cd) and cd[pos : pos + 4] == b"PK\x01\x02":
        csize, usize = struct.unpack("<II", cd[pos + 20 : pos + 28])
        nlen, xlen, clen = struct.unpack("<HHH", cd[pos + 28 : pos + 34])
        (header,) = struct.unpack("<I", cd[pos + 42 : pos + 46])
        name = cd[pos + 46 : pos + 46 + nlen].decode("utf-8", "replace")
        extra = cd[pos + 46 + nlen : pos + 46 + nlen + xlen]
        stored = csize
        if 0xFFFFFFFF in (csize, usize, header):  # the zip64 extra field holds the 8-byte values, in order
            values = _zip64_values(extra)
            if usize == 0xFFFFFFFF and values:
                values.pop(0)
            if csize == 0xFFFFFFFF and values:
                stored = values.pop(0)
            if header == 0xFFFFFFFF and values:
                header = values.pop(0)
        records.append(ZipRecord(name, header, stored))
        pos += 46 + nlen + xlen + clen
    return records


def _zip64_values(extra: bytes) -> list[int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack("<HH", extra[pos : pos + 4])
        if tag == 1:
            body = extra[pos + 4 : pos + 4 + size]
            return [struct.unpack("<Q", body[i : i + 8])[0] for i in range(0, len(body) - 7, 8)]
        pos += 4 + size
    return []


def zip_records(size: int, records: list[ZipRecord]) -> list[tuple[int, int]]:
    """Step 3, from the central directory alone: each record's local header with a window for
    its extra field, and the whole of every record that is not tensor data (data.pkl, version,
    byteorder), which the readers read whole."""
    ranges = []
    for r in records:
        window = r.header + _LOCAL + len(r.name.encode()) + HEADER_WINDOW
        end = window if r.tensor_data else window + r.size
        ranges.append((r.header, min(size, end)))
    return ranges


def zip_header_rests(size: int, records: list[ZipRecord], pread: Pread) -> list[tuple[int, int]]:
    """Step 4: each record's header up to its data (and a small record's data), from the local
    header's own name and extra field lengths; what step 3 fetched already costs nothing."""
    ranges = []
    for r in records:
        raw = pread(r.header + 26, 4)
        if len(raw) < 4:
            continue
        nlen, xlen = struct.unpack("<HH", raw)
        data = r.header + _LOCAL + nlen + xlen
        ranges.append((r.header, min(size, data if r.tensor_data else data + r.size)))
    return ranges


def fetch_metadata(
    fetch: Callable[[Iterable[tuple[Any, list[tuple[int, int]]]]], None],
    files: Sequence[Container],
    tensor_headers: bool = True,
) -> None:
    """Fetch (`fetch`: each file with its ranges, returning once they are there) what opening
    `files` reads, every step for all of them at once: head and tail; the safetensors header or
    zip central directory they point at; the zip records' local headers and small records; the
    rest of any header longer than its window. Without `tensor_headers` (a streamed file), of
    the tensor records' local headers only the first one's (`formats.torch_zip` predicts the
    others' data offsets and checks them later)."""
    fetch((f, [(0, HEAD), (max(0, f.size - TAIL), f.size)]) for f in files)
    fetch((f, after_head_and_tail(f.name, f.size, f.pread)) for f in files)
    zips = [f for f in files if not f.name.endswith(".safetensors") and is_zip(f.pread)]
    listed = {id(f): central_records(f.size, f.pread) for f in zips}
    if not tensor_headers:
        for key, records in listed.items():
            first = min((r for r in records if r.tensor_data), key=lambda r: r.header, default=None)
            listed[key] = [r for r in records if not r.tensor_data or r is first]
    fetch((f, zip_records(f.size, listed[id(f)])) for f in zips)
    fetch((f, zip_header_rests(f.size, listed[id(f)], f.pread)) for f in zips)
