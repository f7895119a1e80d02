"""One safe reader for torch files: attacks on the metadata reader (`torch_pickle`, `torch_io`) and
on the zip archive around it (`torch_zip.read_archive`), and an xser info file that lies.

Every crafted file is either refused with one line or read exactly as
`torch.load(path, weights_only=True, map_location="cpu")` reads it (shardkit always maps to the
CPU); a few that torch reads as values other than the file's bytes are refused, as listed. Nothing
one file holds changes how another is read. The CLI turns each refusal into exit code 2 and one
line, never a traceback, an internal error, or a merge of garbage that exits 0.
"""

from __future__ import annotations

import os
import shutil
import struct
import warnings
import zipfile
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shardkit.cli import cli
from shardkit.errors import FormatError
from shardkit.formats import torch_io, torch_metadata, xser
from shardkit.io.data.strided import StoredTensor, read_stored
from shardkit.io.data.taps import OpenFile

# ---- a pickle assembler (protocol 2, the opcodes torch.save writes) ---------------------------------

PROTO, STOP, MARK, TUPLE, REDUCE, BUILD = b"\x80\x02", b".", b"(", b"t", b"R", b"b"
FALSE, TRUE, NONE, EMPTY_TUPLE, EMPTY_DICT, EMPTY_LIST = b"\x89", b"\x88", b"N", b")", b"}", b"]"
SETITEM, SETITEMS, APPEND, BINPERSID = b"s", b"u", b"a", b"Q"


def glob(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


def text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def num(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -(1 << 31) <= n < 1 << 31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def tup(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE


def ordered() -> bytes:
    return glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE


def pid(
    kind: bytes = glob("torch", "FloatStorage"), key: bytes = text("0"), loc: bytes = text("cpu"), numel: bytes = num(6)
) -> bytes:
    return tup(text("storage"), kind, key, loc, numel) + BINPERSID


UNTYPED = glob("torch.storage", "UntypedStorage")


def v2(
    storage: bytes | None = None,
    offset: bytes = num(0),
    size: bytes = tup(num(2), num(3)),
    stride: bytes = tup(num(3), num(1)),
    grad: bytes = FALSE,
    hooks: bytes | None = None,
    meta: bytes | None = None,
) -> bytes:
    """_rebuild_tensor_v2 of the float32 (2, 3) tensor in record 0, or what the arguments say."""
    args = [pid() if storage is None else storage, offset, size, stride, grad, ordered() if hooks is None else hooks]
    return glob("torch._utils", "_rebuild_tensor_v2") + tup(*args, *([meta] if meta else [])) + REDUCE


def v3(
    dtype: bytes = glob("torch", "bfloat16"),
    storage: bytes | None = None,
    size: bytes = tup(num(2), num(3)),
    stride: bytes = tup(num(3), num(1)),
    grad: bytes = FALSE,
) -> bytes:
    """_rebuild_tensor_v3: record 1's 24 bytes as `dtype` (bf16: (2, 3) of the first 12)."""
    storage = pid(UNTYPED, text("1"), numel=num(24)) if storage is None else storage
    return (
        glob("torch._utils", "_rebuild_tensor_v3") + tup(storage, num(0), size, stride, grad, ordered(), dtype) + REDUCE
    )


def param(data: bytes, grad: bytes = TRUE, hooks: bytes | None = None) -> bytes:
    return glob("torch._utils", "_rebuild_parameter") + tup(data, grad, ordered() if hooks is None else hooks) + REDUCE


def entries(*pairs: tuple[str, bytes]) -> bytes:
    """A dict pickle {name: value}, built as torch.save builds one (EMPTY_DICT, MARK ... SETITEMS)."""
    return PROTO + EMPTY_DICT + MARK + b"".join(text(k) + v for k, v in pairs) + SETITEMS + STOP


def sd(**values: bytes) -> bytes:
    return entries(*values.items())


def put(i: int) -> bytes:
    return b"q" + bytes([i])


def get(i: int) -> bytes:
    return b"h" + bytes([i])


# ---- files -----------------------------------------------------------------------------------------


def base_file(path: Path) -> Path:
    """torch.save of a float32 (2, 3) tensor (record data/0, 24 bytes) and 24 uint8 (data/1)."""
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "u": torch.arange(24, dtype=torch.uint8) * 7}, path)
    return path


def records_of(path: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as archive:
        return [(info.filename, archive.read(info)) for info in archive.infolist()]


def write_zip(
    path: Path,
    records: list[tuple[str, bytes]],
    crc: dict[str, int] | None = None,
    local_name: dict[str, str] | None = None,
    local_size: dict[str, int] | None = None,
    offsets: dict[str, int] | None = None,
    tail: bytes = b"",
    zip64: bool = False,
) -> Path:
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
        directory += (
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                45,
                45,
                0,
                0,
                0,
                0,
                check,
                size,
                size,
                len(raw),
                len(extra),
                0,
                0,
                0,
                0,
                where,
            )
            + raw
            + extra
        )
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


def with_pickle(src: Path, dst: Path, raw: bytes) -> Path:
    """`src` with its data.pkl replaced by `raw`."""
    return write_zip(dst, [(n, raw if n.endswith("/data.pkl") else d) for n, d in records_of(src)])


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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's unpickler warns of protocol 4 as torch.load does
            meta = torch_metadata.read_metadata(path)
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
        return read_stored(OpenFile(fd), value, 0, None, None, what)
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
        return (
            type(ours) is type(theirs) and list(ours) == list(theirs) and all(same(ours[k], theirs[k]) for k in theirs)
        )
    if isinstance(theirs, (list, tuple)):
        return type(ours) is type(theirs) and len(ours) == len(theirs) and all(map(same, ours, theirs))
    return type(ours) is type(theirs) and ours == theirs


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# ---- 1. a pickle that changes how other files read ------------------------------------------------

# BUILD on torch.FloatStorage with slot state (None, {"dtype": float16}), as the C unpickler sets a
# __slots__ object's fields; then POP, and an otherwise plain state dict
POISONING = (
    PROTO
    + glob("torch", "FloatStorage")
    + NONE
    + EMPTY_DICT
    + text("dtype")
    + glob("torch", "float16")
    + SETITEM
    + b"\x86"
    + BUILD
    + b"0"
)
POISON = POISONING + sd(w=v2())[2:]


def test_a_pickle_that_builds_a_storage_stand_in_changes_no_other_file(tmp_path):
    clean = base_file(tmp_path / "clean.pt")
    evil = with_pickle(clean, tmp_path / "evil.pt", POISON)
    verdict = shardkit_reads(evil)
    later = base_file(tmp_path / "later.pt")  # a clean file read after it, in the same process
    ours, theirs = shardkit_reads(later), torch_reads(later)
    assert ours["w"].dtype == torch.float32
    assert same(ours, theirs)
    assert torch_reads(evil) == REFUSED and verdict == REFUSED


# ---- 2. crafted pickles: refused exactly when torch refuses, else read the same --------------------

REDUCER_V2 = glob("torch._utils", "_rebuild_tensor_v2")
HALF = glob("torch", "HalfStorage")

CASES = {
    # read by both, the same
    "plain": sd(w=v2()),
    "a storage used by two tensors (memo)": sd(
        w=v2(storage=pid() + put(200)), v=v2(storage=get(200), size=tup(num(3)), stride=tup(num(2)))
    ),
    "the same tensor twice (memo)": entries(("w", v2() + put(200)), ("v", get(200))),
    "a view: offset and strides": sd(w=v2(offset=num(1), size=tup(num(2), num(2)), stride=tup(num(1), num(2)))),
    "v3: bf16 over untyped bytes": sd(b=v3()),
    "v3: float8 and uint16": sd(
        f=v3(glob("torch", "float8_e4m3fn"), size=tup(num(24)), stride=tup(num(1))),
        i=v3(glob("torch", "uint16"), size=tup(num(12)), stride=tup(num(1))),
    ),
    "a parameter": sd(p=param(v2())),
    "a parameter not requiring grad": sd(p=param(v2(), FALSE)),
    "a parameter of a parameter": sd(p=param(param(v2()))),
    "hooks: None, 5, a full OrderedDict": sd(
        a=v2(hooks=NONE),
        b=v2(hooks=num(5)),
        c=v2(hooks=ordered() + text("h") + num(1) + SETITEM),
        p=param(v2(), hooks=num(5)),
    ),
    "metadata: empty, 0, an unknown key": sd(
        a=v2(meta=EMPTY_DICT), b=v2(meta=num(0)), c=v2(meta=EMPTY_DICT + text("xyz") + TRUE + SETITEM)
    ),
    "a tensor requiring grad": sd(w=v2(grad=TRUE)),
    "sizes as a list": sd(w=v2(size=EMPTY_LIST + MARK + num(2) + num(3) + b"e")),
    "an empty tensor far past its storage": sd(w=v2(offset=num(1 << 40), size=tup(num(0), num(3)))),
    "a storage on cuda:0 and at location 3": sd(w=v2(storage=pid(loc=text("cuda:0"))), v=v2(storage=pid(loc=num(3)))),
    "an integer storage key": sd(w=v2(storage=pid(key=num(0)))),
    "one key, two dtypes: the first wins": sd(w=v2(), h=v2(storage=pid(HALF, numel=num(12)))),
    "pickle protocol 4": b"\x80\x04" + sd(w=v2())[2:],
    "a global named torch / _utils._rebuild_tensor_v2": sd(
        w=glob("torch", "_utils._rebuild_tensor_v2") + v2()[len(REDUCER_V2) :]
    ),
    "a Python 2 module name (UserDict.OrderedDict)": sd(
        o=glob("UserDict", "OrderedDict") + EMPTY_TUPLE + REDUCE, w=v2()
    ),
    "torch.cuda.FloatStorage": sd(w=v2(storage=pid(glob("torch.cuda", "FloatStorage")))),
    "BUILD of an OrderedDict (a state dict's _metadata)": sd(
        o=ordered() + EMPTY_DICT + text("_metadata") + num(1) + SETITEM + BUILD, w=v2()
    ),
    "BUILD of a tensor (set_ to another view)": sd(
        w=v2()
        + tup(
            pid(),
            num(2),
            tup(
                num(3),
            ),
            tup(
                num(1),
            ),
        )
        + BUILD
    ),
    "a Counter, a list, nested tuples": sd(
        c=glob("collections", "Counter") + EMPTY_TUPLE + REDUCE + MARK + text("a") + num(2) + SETITEMS,
        l=EMPTY_LIST + v2() + APPEND,
        t=tup(tup(num(1), NONE), text("x"), b"G" + struct.pack(">d", 2.5)),
    ),
    "NEWOBJ of an OrderedDict": sd(o=glob("collections", "OrderedDict") + EMPTY_TUPLE + b"\x81", w=v2()),
    # refused by both
    "BUILD of a storage class (stand-in)": POISON,
    "BUILD of a dtype": sd(
        d=glob("torch", "float32") + EMPTY_DICT + text("itemsize") + num(8) + SETITEM + BUILD, w=v2()
    ),
    "SETITEM on a list": sd(l=EMPTY_LIST + v2() + APPEND + num(0) + num(5) + SETITEM),
    "APPEND to a dict": sd(d=EMPTY_DICT + num(1) + APPEND),
    "BUILD of an OrderedDict with a (state, slots) pair": sd(
        o=ordered() + tup(NONE, EMPTY_DICT + text("x") + num(1) + SETITEM) + BUILD
    ),
    "an alias dtype name (torch.float)": sd(w=v3(glob("torch", "float"))),
    "torch.UntypedStorage (not torch.storage's)": sd(
        w=v3(storage=pid(glob("torch", "UntypedStorage"), text("1"), numel=num(24)))
    ),
    "os.system": PROTO + glob("os", "system") + tup(text("true")) + REDUCE + STOP,
    "requires_grad 1": sd(w=v2(grad=num(1))),
    "requires_grad None": sd(w=v2(grad=NONE)),
    "v3 requiring grad": sd(w=v3(grad=TRUE)),
    "metadata 5": sd(w=v2(meta=num(5))),
    "metadata conj on a float tensor": sd(w=v2(meta=EMPTY_DICT + text("conj") + FALSE + SETITEM)),
    "a storage larger than its record": sd(w=v2(storage=pid(numel=num(100)))),
    "a storage smaller than its record": sd(w=v2(storage=pid(numel=num(5)))),
    "a tensor past its storage": sd(w=v2(size=tup(num(3), num(3)))),
    "a negative stride": sd(w=v2(offset=num(3), stride=tup(num(-3), num(1)))),
    "a negative size": sd(w=v2(size=tup(num(-2), num(3)))),
    "a negative offset": sd(w=v2(offset=num(-1))),
    "more elements than int64": sd(w=v2(size=tup(num(1 << 40), num(1 << 40)), stride=tup(num(0), num(0)))),
    "a storage whose record is missing (unused)": sd(w=v2(), x=pid(key=text("9"))),
    "a persistent id of 4 fields": sd(
        w=v2(storage=tup(text("storage"), glob("torch", "FloatStorage"), text("0"), text("cpu")) + BINPERSID)
    ),
    "a persistent id that is an int": sd(w=num(0) + BINPERSID),
    "a persistent id of another kind": sd(
        w=tup(text("module"), glob("torch", "FloatStorage"), text("0"), text("cpu"), num(6)) + BINPERSID
    ),
    "v2 with 5 arguments": sd(
        w=REDUCER_V2
        + tup(
            pid(),
            num(0),
            tup(
                num(6),
            ),
            tup(
                num(1),
            ),
            FALSE,
        )
        + REDUCE
    ),
    "a tensor of an int instead of a storage": sd(w=v2(storage=num(0))),
    "a protocol 4 opcode (SHORT_BINUNICODE)": PROTO + EMPTY_DICT + b"\x8c\x01w" + v2() + SETITEM + STOP,
    "DUP and POP": sd(w=v2() + b"2" + b"0"),
    "a memo entry never put": sd(w=get(77)),
    "a truncated pickle": sd(w=v2())[:-10],
    "a state dict of a tensor's parameter of an int tensor requiring grad": sd(
        p=param(v2(storage=pid(glob("torch", "IntStorage"))))
    ),
}

STRICTER = {
    # torch reads these as values other than the file's bytes, or as objects a state dict never holds
    "metadata neg (torch negates every value)": sd(w=v2(meta=EMPTY_DICT + text("neg") + TRUE + SETITEM)),
    "a list that contains itself": sd(l=EMPTY_LIST + put(201) + get(201) + APPEND, w=v2()),
    "a quantized tensor (qint8 without a quantizer)": sd(
        w=v2(
            storage=pid(glob("torch", "QInt8Storage"), numel=num(24)),
            size=tup(
                num(4),
            ),
            stride=tup(
                num(1),
            ),
        )
    ),
    "a bits8 tensor": sd(b=v3(glob("torch", "bits8"), size=tup(num(24)), stride=tup(num(1)))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_crafted_pickles_are_refused_exactly_when_torch_refuses(name, tmp_path):
    path = with_pickle(base_file(tmp_path / "base.pt"), tmp_path / "crafted.pt", CASES[name])
    theirs, ours = torch_reads(path), shardkit_reads(path)
    if isinstance(theirs, str):
        assert ours == REFUSED, f"torch refuses it, shardkit read {ours!r}"
    else:
        assert not isinstance(ours, str), "torch reads it, shardkit refused it"
        assert same(ours, theirs), (ours, theirs)


@pytest.mark.parametrize("name", list(STRICTER))
def test_pickles_torch_reads_as_other_values_are_refused(name, tmp_path):
    path = with_pickle(base_file(tmp_path / "base.pt"), tmp_path / "crafted.pt", STRICTER[name])
    assert not isinstance(torch_reads(path), str)
    assert shardkit_reads(path) == REFUSED


def test_the_crafted_cases_cover_both_verdicts(tmp_path):
    """The table above holds files torch reads and files it refuses (so both branches are tested)."""
    verdicts = Counter()
    for name in ("plain", "a view: offset and strides", "BUILD of a dtype", "requires_grad 1"):
        path = with_pickle(base_file(tmp_path / "base.pt"), tmp_path / f"{len(verdicts)}.pt", CASES[name])
        verdicts[isinstance(torch_reads(path), str)] += 1
    assert verdicts == {False: 2, True: 2}


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
        "records": [(n, b"x" if n.endswith("/.storage_alignment") else d) for n, d in records]
    },
    "big-endian bytes (torch swaps them)": lambda records: {
        "records": [(n, b"big" if n.endswith("/byteorder") else d) for n, d in records]
    },
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
    for read in (torch_metadata.read_metadata, torch_io.safe_load, torch_io.TorchFile):
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


@pytest.mark.parametrize("attack", list(ARCHIVE_ATTACKS) + ["poisoning pickle"])
@pytest.mark.parametrize("command", ["merge", "inspect"])
def test_cli_refuses_a_shard_folder_holding_a_crafted_file(attack, command, shards, tmp_path):
    folder = tmp_path / "shards"
    shutil.copytree(shards, folder)
    victim = folder / VICTIM
    if attack == "poisoning pickle":
        with zipfile.ZipFile(victim) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
            raw = archive.read(name)
        assert raw[:2] == PROTO  # the poison, then the file's own state dict
        write_zip(victim, [(n, POISONING + raw[2:] if n == name else d) for n, d in records_of(victim)])
    else:
        crafted_archive(victim, victim, ARCHIVE_ATTACKS[attack])
    if command == "merge":
        clean_failure(run("merge", folder, tmp_path / "out"), VICTIM.split("/")[-1])
        assert not (tmp_path / "out").exists()
    else:
        clean_failure(run("inspect", folder, "--check-data"), VICTIM.split("/")[-1])


# ---- 5. an xser info file that lies ----------------------------------------------------------------


@pytest.fixture(scope="module")
def xser_shards(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("reader-xser") / "tp2"
    result = run("convert", tiny_model("llama-gqa64"), out, "--tp", "2", "--format", "xser")
    assert result.exit_code == 0, result.output
    (out / "shardkit.json").unlink()
    return out


@pytest.mark.parametrize("lie", ["dtype", "shape"])
@pytest.mark.parametrize("tensor", ["model.embed_tokens.weight", "model.norm.weight"])
def test_an_info_file_that_disagrees_with_its_tensor_file_is_a_one_line_error(lie, tensor, xser_shards, tmp_path):
    """Every reader plans with the info file's shapes and dtypes; the tensor file holds another.
    dtype: every rank's info file says float16 (the pieces agree, and with the config); shape:
    rank 0's tensor file lost a row. model.norm.weight is replicated: `inspect --check-data`
    compares its copies, so it reads it too."""
    folder = tmp_path / "shards"
    shutil.copytree(xser_shards, folder)
    for rank in sorted((folder / "model").glob("dp_rank_00_tp_rank_*_pp_rank_00.pt")):
        tid = xser.safe_load(rank)[tensor].tid
        if lie == "dtype":
            table = torch.load(xser.info_path(rank), weights_only=True)
            table[tid]["dtype"] = torch.float16
            torch.save(table, xser.info_path(rank))
        elif "tp_rank_00" in rank.name:
            file = xser.tensor_path(rank, tid)
            torch.save(torch.load(file, weights_only=True)[:-1].clone(), file)
    clean_failure(run("merge", folder, tmp_path / "out"), "info.pt")
    if tensor == "model.norm.weight":
        clean_failure(run("inspect", folder, "--check-data"), "info.pt")
