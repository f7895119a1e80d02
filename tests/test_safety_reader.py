"""One safe reader for torch files: attacks on the zip archive around a torch file's pickle
(`torch_zip.read_archive`).

Every crafted file is either refused with one line or read exactly as
`torch.load(path, weights_only=True, map_location="cpu")` reads it (shardkit always maps to the
CPU). The CLI turns each refusal into exit code 2 and one line, never a traceback, an internal
error, or a merge of garbage that exits 0.
"""

from __future__ import annotations

import os
import shutil
import struct
import warnings
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shardkit.cli import cli
from shardkit.errors import FormatError
from shardkit.formats import torch_io
from shardkit.formats.base import StoredTensor, read_stored

# ---- files -----------------------------------------------------------------------------------------


def base_file(path: Path) -> Path:
    """torch.save of a float32 (2, 3) tensor (record data/0, 24 bytes) and 24 uint8 (data/1)."""
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "u": torch.arange(24, dtype=torch.uint8) * 7}, path)
    return path


def records_of(path: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def write_zip(path: Path, records: list[tuple[str, bytes]], crc: dict[str, int] | None = None,
              local_name: dict[str, str] | None = None, local_size: dict[str, int] | None = None,
              offsets: dict[str, int] | None = None, tail: bytes = b"", zip64: bool = False) -> Path:
    """A stored zip archive of `records`, written field by field, so that a test can make it say
    what no zip writer would: a CRC, a local header's name or size, a directory entry's offset.
    zip64: every size and offset in zip64 fields (as in archives of 4 GiB and more)."""
    crc, local_name, local_size, offsets = crc or {}, local_name or {}, local_size or {}, offsets or {}
    out, directory, count, wide = bytearray(), bytearray(), 0, 0xFFFFFFFF
    for name, data in records:
        check = crc.get(name, zlib.crc32(data))
        lname = local_name.get(name, name).encode()
        lsize = local_size.get(name, len(data))
        offset = offsets.get(name, len(out))
        if name not in offsets:
            extra = struct.pack("<HHQQ", 1, 16, lsize, lsize) if zip64 else b""
            size = wide if zip64 else lsize
            out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 45, 0, 0, 0, 0, check, size, size, len(lname), len(extra))
            out += lname + extra + data
        raw = name.encode()
        extra = struct.pack("<HHQQQ", 1, 24, len(data), len(data), offset) if zip64 else b""
        size, where = (wide, wide) if zip64 else (len(data), offset)
        directory += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0, 0, 0, 0, check, size, size,
                                 len(raw), len(extra), 0, 0, 0, 0, where) + raw + extra
        count += 1
    start = len(out)
    out += directory
    if zip64:
        end64 = len(out)
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, len(directory), start)
        out += struct.pack("<IIQI", 0x07064B50, 0, end64, 1)
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, wide, wide, 0) + tail
    else:
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(directory), start, 0) + tail
    path.write_bytes(bytes(out))
    return path


def one_line(error: BaseException) -> str:
    message = str(error)
    assert message and "\n" not in message, repr(message)
    return message


REFUSED = "refused"


def torch_reads(path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # protocol 4, ComplexHalf...
        try:
            return torch.load(path, weights_only=True, map_location="cpu")
        except Exception:  # noqa: BLE001 - any refusal
            return REFUSED


def shardkit_reads(path: Path):
    """What shardkit reads from `path`: its metadata with every tensor's bytes read by shardkit's
    own reader (`read_stored`), or REFUSED (a one-line FormatError)."""
    try:
        meta = torch_io.read_metadata(path)
    except FormatError as e:
        one_line(e)
        return REFUSED
    fd = os.open(path, os.O_RDONLY)
    try:
        return _materialize(meta, fd, str(path))
    finally:
        os.close(fd)


def _materialize(value, fd: int, what: str):
    if isinstance(value, StoredTensor):
        return read_stored(fd, value, 0, None, None, what)
    if isinstance(value, dict):
        out = type(value)()
        for k, v in value.items():
            out[k] = _materialize(v, fd, what)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_materialize(v, fd, what) for v in value)
    return value


def same(ours, theirs) -> bool:
    """Equal structure and, for tensors, equal dtype, shape and bytes."""
    if isinstance(theirs, torch.Tensor):
        if not isinstance(ours, torch.Tensor) or ours.dtype != theirs.dtype or ours.shape != theirs.shape:
            return False
        return torch.equal(_bytes(ours), _bytes(theirs))
    if isinstance(theirs, dict):
        return type(ours) is type(theirs) and list(ours) == list(theirs) and all(same(ours[k], theirs[k]) for k in theirs)
    if isinstance(theirs, (list, tuple)):
        return type(ours) is type(theirs) and len(ours) == len(theirs) and all(map(same, ours, theirs))
    return type(ours) is type(theirs) and ours == theirs


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# ---- 3. the zip archive around the pickle ---------------------------------------------------------


def _duplicated(records):
    """A second data/0 after the first, of zeros: torch reads the last copy."""
    first = next(i for i, (n, _) in enumerate(records) if n.endswith("/data/0"))
    name, data = records[first]
    return {"records": records + [(name, bytes(len(data)))]}


def _duplicated_in_another_case(records):
    first = next(i for i, (n, _) in enumerate(records) if n.endswith("/data/0"))
    name, data = records[first]
    return {"records": records + [(name.replace("/data/", "/DATA/"), bytes(len(data)))]}


def _overlapping(records):
    """The last tensor record's header and data inside another record's data, listed twice."""
    last = max(i for i, (n, _) in enumerate(records) if "/data/" in n)
    name, data = records.pop(last)
    raw = name.encode()
    inner = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 0, 0, 0, zlib.crc32(data), len(data), len(data), len(raw), 0)
    prefix = name[: name.index("/") + 1]
    records.append((prefix + "extra", inner + raw + data))
    header = sum(30 + len(n.encode()) + len(d) for n, d in records[:-1]) + 30 + len((prefix + "extra").encode())
    return {"records": records + [(name, data)], "offsets": {name: header}}


def _outside(extra_name):
    def make(records):
        prefix = records[0][0].split("/")[0]
        return {"records": records + [(extra_name.format(prefix=prefix), b"x")]}

    return make


def _bad_crc(short):
    def make(records):
        name = next(n for n, _ in records if n.endswith("/" + short))
        return {"records": records, "crc": {name: 12345}}

    return make


def _local_name(records):
    name = next(n for n, _ in records if n.endswith("/data/0"))
    return {"records": records, "local_name": {name: name[:-1] + "X"}}


def _local_size(records):
    name = next(n for n, _ in records if n.endswith("/data/0"))
    return {"records": records, "local_size": {name: 8}}


def _compressed(records):
    """data.pkl deflated (miniz inflates it; torch.save never compresses)."""
    return {"records": records, "deflate": True}


ARCHIVE_ATTACKS = {
    "duplicated data/0": _duplicated,
    "data/0 and DATA/0 (miniz ignores case)": _duplicated_in_another_case,
    "overlapping records": _overlapping,
    "a record in another folder": _outside("other/x"),
    "a record named ../x": _outside("{prefix}/../x"),
    "an absolute record name": _outside("/{prefix}/x"),
    "a backslash in a name": _outside("{prefix}/data\\x"),
    "bad CRC of data.pkl": _bad_crc("data.pkl"),
    "bad CRC of version": _bad_crc("version"),
    "bad CRC of byteorder": _bad_crc("byteorder"),
    "a local header naming another record": _local_name,
    "a local header with another size": _local_size,
    "a compressed data.pkl": _compressed,
}

TORCH_ARCHIVE_RULES = {  # what torch itself checks before the pickle (the first three: it refuses)
    "no version record": lambda records: {"records": [(n, d) for n, d in records if not n.endswith("/version")]},
    "version 11": lambda records: {"records": [(n, b"11\n" if n.endswith("/version") else d) for n, d in records]},
    "a storage alignment that is no number": lambda records: {
        "records": [(n, b"x" if n.endswith("/.storage_alignment") else d) for n, d in records]},
    "big-endian bytes (torch swaps them)": lambda records: {
        "records": [(n, b"big" if n.endswith("/byteorder") else d) for n, d in records]},
    "bytes after the archive": lambda records: {"records": records, "tail": b"junk"},
}


def crafted_archive(src: Path, dst: Path, attack) -> Path:
    made = attack(records_of(src))
    if made.pop("deflate", False):
        records = made["records"]
        with zipfile.ZipFile(dst, "w") as archive:
            for name, data in records:
                kind = zipfile.ZIP_DEFLATED if name.endswith("/data.pkl") else zipfile.ZIP_STORED
                archive.writestr(name, data, compress_type=kind)
        return dst
    return write_zip(dst, **made)


def test_the_archive_writer_of_these_tests_writes_what_torch_reads(tmp_path):
    base = base_file(tmp_path / "base.pt")
    copy = write_zip(tmp_path / "copy.pt", records_of(base))
    assert same(torch_reads(copy), torch_reads(base))
    assert same(shardkit_reads(copy), torch_reads(base))


def test_zip64_fields_are_read_as_torch_reads_them(tmp_path):
    """Archives of 4 GiB and more keep sizes and offsets in zip64 fields (torch's writer then
    writes them): read where torch reads them."""
    base = base_file(tmp_path / "base.pt")
    wide = write_zip(tmp_path / "zip64.pt", records_of(base), zip64=True)
    assert same(torch_reads(wide), torch_reads(base))
    assert same(shardkit_reads(wide), torch_reads(base))
    assert same(torch_io.safe_load(wide), torch_reads(base))


@pytest.mark.parametrize("attack", list(ARCHIVE_ATTACKS) + list(TORCH_ARCHIVE_RULES))
def test_archives_read_differently_are_refused_with_one_line(attack, tmp_path):
    make = ARCHIVE_ATTACKS.get(attack) or TORCH_ARCHIVE_RULES[attack]
    path = crafted_archive(base_file(tmp_path / "base.pt"), tmp_path / "crafted.pt", make)
    for read in (torch_io.read_metadata, torch_io.safe_load, torch_io.TorchFile):
        with pytest.raises(FormatError) as info:
            read(path)
        assert str(path) in one_line(info.value) and "re-create it" in str(info.value)


# ---- 4. the CLI on a shard folder holding such a file ----------------------------------------------


def run(*args) -> object:
    return CliRunner().invoke(cli, ["-q", *map(str, args)], catch_exceptions=False)


def clean_failure(result, *phrases: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error: "), result.stderr
    assert "Traceback" not in result.output and "internal error" not in result.output
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


@pytest.fixture(scope="module")
def shards(tiny_model, tmp_path_factory):
    """tp 2 torch shards of llama-gqa64 without a manifest (as NxD writes them: nothing to check
    the files' digests against)."""
    out = tmp_path_factory.mktemp("reader") / "tp2"
    result = run("convert", tiny_model("llama-gqa64"), out, "--tp", "2")
    assert result.exit_code == 0, result.output
    (out / "shardkit.json").unlink()
    return out


VICTIM = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


@pytest.mark.parametrize("attack", list(ARCHIVE_ATTACKS))
@pytest.mark.parametrize("command", ["merge", "inspect"])
def test_cli_refuses_a_shard_folder_holding_a_crafted_file(attack, command, shards, tmp_path):
    folder = tmp_path / "shards"
    shutil.copytree(shards, folder)
    victim = folder / VICTIM
    crafted_archive(victim, victim, ARCHIVE_ATTACKS[attack])
    if command == "merge":
        clean_failure(run("merge", folder, tmp_path / "out"), VICTIM.split("/")[-1])
        assert not (tmp_path / "out").exists()
    else:
        clean_failure(run("inspect", folder, "--check-data"), VICTIM.split("/")[-1])
