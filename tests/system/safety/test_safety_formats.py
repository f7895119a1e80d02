"""Data safety of the file-format layer: writers that fail (full disk, Ctrl-C, abandoned) without
aborting the process or leaving half files; full-disk messages and the free-space pre-check; the
safetensors reader held to the safetensors library's rules; names from files kept inside their
folder; FIFOs, folders and empty files refused instead of hanging or crashing.

Anything that could abort the interpreter (torch's zip writer throwing in a destructor) runs in a
subprocess, so a regression fails the test instead of killing pytest."""

from __future__ import annotations

import errno
import gc
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest
import torch

from shardkit import FormatError, open_checkpoint
from shardkit.errors import ShardkitError
from shardkit.formats import hf, nxd, torch_io, xser
from shardkit.formats.base import TensorSpec
from shardkit.formats.safetensors_io import SafetensorsFile, SafetensorsWriter, read_header
from shardkit.formats.torch_io import TorchWriter
from shardkit.formats.torch_metadata import TensorReference
from shardkit.formats.xser import XserFile, XserWriter
from shardkit.io.data import hashing
from shardkit.paths import NoSpaceError, UnsafePathError

ROOT = Path(__file__).resolve().parents[3]
MODEL = "llama-gqa64"
SPECS = [TensorSpec(f"t{i}", (1000,), torch.float32) for i in range(5)]


# ---- helpers -----------------------------------------------------------------------------------


def run_child(script: str, tmp: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter with this worktree first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    path = tmp / "child.py"
    path.write_text(textwrap.dedent(script))
    return subprocess.run(
        [sys.executable, str(path), str(tmp)], capture_output=True, text=True, env=env, cwd=tmp, timeout=timeout
    )


# a file object that fails after LIMIT bytes, installed as the `open` HashingFile uses
FAILING_OPEN = """
    import errno, gc, io, os, signal, sys
    from pathlib import Path
    import torch
    import shardkit.io.data.hashing as hashing
    from shardkit.formats.base import TensorSpec
    tmp = Path(sys.argv[1])
    SPECS = [TensorSpec(f"t{i}", (1000,), torch.float32) for i in range(5)]
    # Ctrl-C raises KeyboardInterrupt here even when the tests run with SIGINT ignored (a shell's
    # background job), which the child would inherit
    signal.signal(signal.SIGINT, signal.default_int_handler)

    class Failing(io.FileIO):
        written = 0
        def write(self, b):
            b = memoryview(b).cast("B")
            if Failing.written + len(b) > LIMIT:
                if HOW == "enospc":
                    raise OSError(errno.ENOSPC, "No space left on device")
                if HOW == "sigint" and not getattr(Failing, "sent", False):
                    Failing.sent = True
                    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered while torch is writing
            Failing.written += len(b)
            return super().write(b)

    hashing.open = lambda path, mode: Failing(path, "w")
"""

WRITERS = ["native", "torch"]
"""TorchWriter's two zip writers: shardkit's own (torch_zip.ZipRecords) and torch's, which it uses
for archives of 4 GiB and more (forced here)."""


def choose_writer(writer: str) -> str:
    """Child-script lines that make TorchWriter use `writer`."""
    return f"""
    import shardkit.formats.torch_io as _tio
    _tio.native_writer = lambda records, bound: {writer == "native"}
    """


def clean_exit(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode not in (134, -6) and "terminate called" not in proc.stderr, (
        f"the process aborted:\n{proc.stderr[-2000:]}"
    )
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-2000:]}"


def one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text, repr(text)
    return text


def returns_within(fn, seconds: float, fifos=()):
    """fn()'s result or exception, failing the test if it blocks longer than `seconds` (then the
    FIFOs it may be stuck on are opened for writing and closed, to release it)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(5)
        pytest.fail(f"blocked for more than {seconds}s (on a FIFO?)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def st_bytes(header, data: bytes) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def entry(offsets, shape=(2,), dtype="F32") -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def hf_dir(tiny_model, tmp_path: Path) -> Path:
    """An HF folder with the tiny model's config.json and no weights yet."""
    root = tmp_path / "hf"
    root.mkdir()
    shutil.copyfile(tiny_model(MODEL) / "config.json", root / "config.json")
    return root


# ---- 1. writer failures never abort the process ---------------------------------------------------


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("limit", [100, 9000], ids=["in-header", "in-tensor"])
def test_torch_writer_disk_full_is_a_clean_error(limit, writer, tmp_path):
    """ENOSPC from the file under the zip writer: a one-line NoSpaceError, no abort (exit 134)
    when the failed writer is collected, and no partial file left."""
    proc = run_child(
        FAILING_OPEN.replace("LIMIT", str(limit)).replace("HOW", '"enospc"')
        + choose_writer(writer)
        + """
    from shardkit.formats.torch_io import TorchWriter
    def run():
        w = TorchWriter(tmp / "out" / "x.pt", tmp / "out", SPECS)
        for s in SPECS:
            w.write(s.name, torch.ones(1000))
        w.close()
    try:
        run()
    except Exception as e:
        print(type(e).__name__, "|", e)
    gc.collect()
    print("left", os.path.exists(tmp / "out" / "x.pt"))
    """,
        tmp_path,
    )
    clean_exit(proc)
    assert "NoSpaceError | no space left on" in proc.stdout and "needed" in proc.stdout, proc.stdout
    assert "left False" in proc.stdout


@pytest.mark.parametrize("writer", WRITERS)
def test_torch_writer_ctrl_c_is_a_clean_keyboard_interrupt(writer, tmp_path):
    """SIGINT arriving while the zip writer is pushing a record: KeyboardInterrupt reaches the
    caller, the process does not abort, the partial file is deleted."""
    proc = run_child(
        FAILING_OPEN.replace("LIMIT", "9000").replace("HOW", '"sigint"')
        + choose_writer(writer)
        + """
    from shardkit.formats.torch_io import TorchWriter
    def run():
        w = TorchWriter(tmp / "out" / "x.pt", tmp / "out", SPECS)
        for s in SPECS:
            w.write(s.name, torch.ones(1000))
        w.close()
    try:
        run()
        print("no interrupt")
    except KeyboardInterrupt:
        print("interrupted")
    gc.collect()
    print("left", os.path.exists(tmp / "out" / "x.pt"))
    """,
        tmp_path,
    )
    clean_exit(proc)
    assert "interrupted" in proc.stdout and "left False" in proc.stdout, proc.stdout


@pytest.mark.parametrize("how", ["enospc", "sigint"])
@pytest.mark.parametrize("fmt", ["torch", "torch-own-writer", "safetensors"])
def test_a_failure_behind_the_writes_is_clean(fmt, how, tmp_path):
    """Owned tensors of several MiB are written by the write-behind thread: a full disk there
    becomes the caller's one-line NoSpaceError at its next write or close, Ctrl-C while blocks are
    queued a KeyboardInterrupt; no abort, no partial file, no thread left writing."""
    limit = 5 * (3 << 20) // 2  # inside the third tensor
    writer = choose_writer("torch" if fmt == "torch-own-writer" else "native")
    proc = run_child(
        FAILING_OPEN.replace("LIMIT", str(limit)).replace("HOW", f'"{how}"')
        + writer
        + f"""
    import threading
    from shardkit.formats.torch_io import TorchWriter
    from shardkit.formats.safetensors_io import SafetensorsWriter
    BIG = [TensorSpec(f"w{{i}}", (3 << 18,), torch.float32) for i in range(6)]  # 3 MiB each
    def run():
        cls = SafetensorsWriter if "{fmt}" == "safetensors" else TorchWriter
        w = cls(tmp / "out" / "x.bin", tmp / "out", BIG)
        for s in BIG:
            w.write(s.name, torch.full(s.shape, 1.5), owned=True)
        w.close()
    try:
        run()
        print("finished")
    except KeyboardInterrupt:
        print("interrupted")
    except Exception as e:
        print(type(e).__name__, "|", e)
    gc.collect()
    print("left", os.path.exists(tmp / "out" / "x.bin"))
    from shardkit.io.data.hashing import queued_writes
    print("writers", queued_writes())
    """,
        tmp_path,
    )
    clean_exit(proc)
    expected = "interrupted" if how == "sigint" else "NoSpaceError | no space left on"
    assert expected in proc.stdout and "left False" in proc.stdout and "writers 0" in proc.stdout, proc.stdout


def test_abort_takes_its_blocks_back_from_the_hash_helper(tmp_path):
    """Aborting a file drops the blocks still queued for the hash helper on the aborting thread:
    none is left for the helper to free later, which at interpreter exit aborted the process
    (the helper is stopped inside torch's tensor deallocator)."""
    import weakref

    from shardkit.io.data.digest import Digests

    class Block:
        def __init__(self) -> None:
            self.data = bytearray(2 << 20)

    gate = hashing._HashJob(Digests(), memoryview(b""))
    assert gate.take()  # nobody runs the gate: the helper stalls on the job that follows it
    hashing._HASHER.submit(hashing._HashJob(Digests(), memoryview(b""), prev=gate))
    try:
        out = hashing.HashingFile(tmp_path / "x.bin", tmp_path)
        blocks = [Block() for _ in range(3)]
        for block in blocks:
            out.write_owned(memoryview(block.data), block)
        refs = [weakref.ref(block) for block in blocks]
        del blocks, block
        out.abort()
        assert [r() for r in refs] == [None] * 3, "the hash helper still holds blocks of an aborted file"
        assert not (tmp_path / "x.bin").exists()
    finally:
        gate.done.set()
        hashing._HASHER.drain()


@pytest.mark.parametrize("writer", WRITERS)
def test_owned_blocks_written_behind_keep_the_file_order(writer, tmp_path, monkeypatch):
    """Large owned tensors (written by the write-behind thread) between small unowned ones and
    the zip headers: the same bytes as torch.save, and a record whose digests are those bytes'."""
    import hashlib

    import shardkit.formats.torch_io as tio

    monkeypatch.setattr(tio, "native_writer", lambda records, bound: writer == "native")
    import io

    import xxhash

    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for i in range(8):
        tensors[f"big{i}"] = torch.randn((3 << 18) + 1000 * i, generator=gen)  # 3 MiB and up
        tensors[f"small{i}"] = torch.randn(7 + i, generator=gen)
    expected = io.BytesIO()
    torch.save({n: t.clone() for n, t in tensors.items()}, expected)
    writer = TorchWriter(
        tmp_path / "x.pt",
        tmp_path,
        [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()],
        digests="sha256",
    )
    for name in list(tensors):
        tensor = tensors.pop(name)
        writer.write(name, tensor, owned=name.startswith("big"))
        del tensor  # the writer holds the only reference of an owned tensor
    (record,) = writer.close()
    raw = (tmp_path / "x.pt").read_bytes()
    assert raw == expected.getvalue()
    assert (record.size, record.sha256, record.xxh3_128) == (
        len(raw),
        hashlib.sha256(raw).hexdigest(),
        xxhash.xxh3_128_hexdigest(raw),
    )


def test_exception_thrown_through_torch_does_not_abort_later(tmp_path):
    """An exception that escapes into torch's C++ writer (e.g. Ctrl-C before the sink's guard)
    leaves it mid-record: it must never be destroyed (its destructor would std::terminate)."""
    proc = run_child(
        """
    import gc, os, sys
    from pathlib import Path
    import torch
    import shardkit.formats.torch_io as tio
    from shardkit.formats.base import TensorSpec
    tmp = Path(sys.argv[1])
    SPECS = [TensorSpec(f"t{i}", (1000,), torch.float32) for i in range(5)]
    tio.native_writer = lambda records, bound: False  # torch's zip writer
    def run():
        w = tio.TorchWriter(tmp / "out" / "x.pt", tmp / "out", SPECS)
        w.write("t0", torch.ones(1000))
        def escape(self, data):
            raise KeyboardInterrupt
        tio._ZipSink.write = escape
        w.write("t1", torch.ones(1000))
    try:
        run()
    except KeyboardInterrupt:
        print("interrupted")
    gc.collect()
    print("left", os.path.exists(tmp / "out" / "x.pt"))
    """,
        tmp_path,
    )
    clean_exit(proc)
    assert "interrupted" in proc.stdout and "left False" in proc.stdout, proc.stdout


@pytest.mark.parametrize("writer", WRITERS)
def test_abandoned_torch_writer_is_discarded_when_collected(writer, tmp_path):
    """A writer dropped mid-way (an exception elsewhere) and collected later: exit 0, and the
    end of archive is not written (no half checkpoint that looks finished): the file is gone."""
    proc = run_child(
        choose_writer(writer)
        + """
    import gc, os, sys
    from pathlib import Path
    import torch
    from shardkit.formats.torch_io import TorchWriter
    from shardkit.formats.base import TensorSpec
    tmp = Path(sys.argv[1])
    SPECS = [TensorSpec(f"t{i}", (1000,), torch.float32) for i in range(5)]
    def run():
        w = TorchWriter(tmp / "out" / "x.pt", tmp / "out", SPECS)
        w.write("t0", torch.ones(1000))
        w.cycle = w  # only the cycle collector frees it
    run()
    gc.collect()
    print("left", os.path.exists(tmp / "out" / "x.pt"))
    """,
        tmp_path,
    )
    clean_exit(proc)
    assert "left False" in proc.stdout, proc.stdout


def test_xser_writer_disk_full_is_a_clean_error(tmp_path):
    """xser's per-tensor torch.save on a full disk: NoSpaceError (not torch's 'enforce fail ...
    unexpected pos'), the files written so far deleted."""
    proc = run_child(
        FAILING_OPEN.replace("LIMIT", "9000").replace("HOW", '"enospc"')
        + """
    from shardkit.formats.xser import XserWriter
    def run():
        w = XserWriter(tmp / "out" / "x.pt", tmp / "out", SPECS)
        for s in SPECS:
            w.write(s.name, torch.ones(1000))
        w.close()
    try:
        run()
    except Exception as e:
        print(type(e).__name__, "|", e)
    gc.collect()
    print("left", sorted(str(p.relative_to(tmp)) for p in (tmp / "out").rglob("*")))
    """,
        tmp_path,
    )
    clean_exit(proc)
    assert "NoSpaceError | no space left on" in proc.stdout and "enforce fail" not in proc.stdout, proc.stdout
    assert "left []" in proc.stdout


def test_safetensors_writer_disk_full_is_a_clean_error(tmp_path, monkeypatch):
    written = {"n": 0}
    real_open = open

    class Failing:
        def __init__(self, path, mode):
            self._fh = real_open(path, mode)

        def write(self, data):
            view = memoryview(data).cast("B")
            if written["n"] + len(view) > 3000:
                raise OSError(errno.ENOSPC, "No space left on device")
            written["n"] += len(view)
            return self._fh.write(view)

        def __getattr__(self, name):
            return getattr(self._fh, name)

    monkeypatch.setattr(hashing, "open", Failing, raising=False)
    writer = SafetensorsWriter(tmp_path / "x.safetensors", tmp_path, SPECS)
    with pytest.raises(NoSpaceError) as info:
        for spec in SPECS:
            writer.write(spec.name, torch.ones(1000))
    assert one_line(info.value).startswith(f"no space left on {tmp_path} (needed ")
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("fmt", ["torch", "xser", "safetensors"])
def test_free_space_is_checked_before_writing(fmt, tmp_path, monkeypatch):
    """The writers know their size from the specs: a disk without room is refused up front,
    before any file is created, with the same one-line message."""
    real = os.statvfs

    def tiny(path):
        st = real(path)
        return os.statvfs_result(
            (st.f_bsize, 4096, st.f_blocks, 2, 2, st.f_files, st.f_ffree, st.f_favail, st.f_flag, st.f_namemax)
        )

    monkeypatch.setattr(os, "statvfs", tiny)
    make = {"torch": TorchWriter, "xser": XserWriter, "safetensors": SafetensorsWriter}[fmt]
    with pytest.raises(NoSpaceError) as info:
        make(tmp_path / "out" / "x.pt", tmp_path / "out", SPECS)
    assert one_line(info.value).startswith(f"no space left on {tmp_path / 'out'} (needed ")
    assert "free 8.00 KiB" in str(info.value)
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]


@pytest.mark.parametrize("fmt", ["torch", "xser", "safetensors"])
def test_abort_and_with_discard_partial_output(fmt, tmp_path):
    """Every writer has abort(); `with` aborts on an exception; a finished writer is untouched."""
    make = {"torch": TorchWriter, "xser": XserWriter, "safetensors": SafetensorsWriter}[fmt]
    out = tmp_path / "out"
    writer = make(out / "a.pt", out, SPECS)
    writer.write("t0", torch.ones(1000))
    writer.abort()
    writer.abort()  # twice is fine
    assert not [p for p in out.rglob("*") if p.is_file()]
    with pytest.raises(RuntimeError):
        writer.write("t1", torch.ones(1000))

    with pytest.raises(ValueError):
        with make(out / "b.pt", out, SPECS) as w:
            w.write("t0", torch.ones(1000))
            raise ValueError("boom")
    assert not [p for p in out.rglob("*") if p.is_file()]

    with make(out / "c.pt", out, SPECS) as w:
        for spec in SPECS:
            w.write(spec.name, torch.ones(1000))
        records = w.close()
    assert all((out / r.path).is_file() and (out / r.path).stat().st_size == r.size for r in records)
    del w
    gc.collect()
    assert all((out / r.path).is_file() for r in records)


def test_abort_leaves_a_newer_file_at_the_same_path_alone(tmp_path):
    """A retry may write the same path while the failed writer is still alive: its abort must
    not delete the new file."""
    old = SafetensorsWriter(tmp_path / "x.safetensors", tmp_path, SPECS)
    new = SafetensorsWriter(tmp_path / "x.safetensors", tmp_path, SPECS)  # replaces the file
    for spec in SPECS:
        new.write(spec.name, torch.ones(1000))
    new.close()
    old.abort()
    assert SafetensorsFile(tmp_path / "x.safetensors").keys() == [s.name for s in SPECS]


def test_torch_size_bound_is_an_upper_bound_and_tight(tmp_path):
    """The pre-check's estimate of a torch file's size never undershoots (or a file that fits
    could be refused) and stays within a few hundred bytes per record."""
    from torch.serialization import _get_storage_alignment

    from shardkit.formats.torch_io import _zip_size_bound, state_dict_pickle

    specs = [
        TensorSpec("a" * 60, (3, 7), torch.bfloat16),
        TensorSpec("e", (0,), torch.float32),
        TensorSpec("b", (100_000,), torch.float32),
        TensorSpec("c", (), torch.int64),
    ]
    writer = TorchWriter(tmp_path / "x.pt", tmp_path, specs)
    for spec in specs:
        writer.write(spec.name, torch.zeros(spec.shape, dtype=spec.dtype))
    size = writer.close()[0].size
    records = [
        ("data.pkl", len(state_dict_pickle(specs))),
        (".format_version", 1),
        (".storage_alignment", 8),
        ("byteorder", 8),
    ] + [(f"data/{i}", s.nbytes) for i, s in enumerate(specs)]
    bound = _zip_size_bound(records, _get_storage_alignment())
    assert size <= bound < size + 300 * (len(records) + 3), (size, bound)


# ---- 3. safetensors reader strictness -------------------------------------------------------------

STRICT_CASES = {
    "overlap": ({"a": entry([0, 8]), "b": entry([4, 12])}, 12),
    "gap": ({"a": entry([0, 8]), "b": entry([12, 20])}, 20),
    "not-at-0": ({"a": entry([4, 12])}, 12),
    "trailing-bytes": ({"a": entry([0, 8])}, 12),
    "duplicate-key": (
        b'{"a":' + json.dumps(entry([0, 8])).encode() + b',"a":' + json.dumps(entry([0, 8])).encode() + b"}",
        8,
    ),
    "duplicate-field": (b'{"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}}', 8),
    "list": (b"[1, 2]", 0),
    "number": (b"42", 0),
    "float-offsets": ({"a": entry([0.0, 8.0])}, 8),
    "negative-offset": ({"a": entry([-8, 0])}, 8),
    "three-offsets": ({"a": entry([0, 8, 9])}, 8),
    "negative-shape": ({"a": entry([0, 8], [-2])}, 8),
    "string-shape": ({"a": entry([0, 8], ["2"])}, 8),
    "bool-shape": ({"a": entry([0, 8], [True, 2])}, 8),
    "unknown-dtype": ({"a": entry([0, 8], dtype="F33")}, 8),
    "size-mismatch": ({"a": entry([0, 8], [3])}, 8),
    "metadata-not-strings": ({"__metadata__": {"format": 1}, "a": entry([0, 8])}, 8),
    "not-utf8": (b'{"\xff":1}', 0),
    "data-missing": ({"a": entry([0, 8])}, 4),
}
LIBRARY_ACCEPTS = {"duplicate-key"}  # serde keeps the last; shardkit refuses: a key given twice hides a tensor


@pytest.mark.parametrize("case", sorted(STRICT_CASES))
def test_safetensors_reader_refuses_what_the_library_refuses(case, tmp_path):
    header, data_size = STRICT_CASES[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(st_bytes(header, b"\0" * data_size))
    if case not in LIBRARY_ACCEPTS:
        from safetensors import SafetensorError, safe_open

        with pytest.raises(SafetensorError):
            with safe_open(str(path), "pt") as f:
                list(f.keys())
    for read in (SafetensorsFile, read_header):
        with pytest.raises(FormatError) as info:
            read(path)
        assert str(path) in one_line(info.value)


def test_safetensors_reader_accepts_what_the_library_accepts(tmp_path):
    """Padding, leading blanks, a zero-size tensor, null metadata and out-of-order entries are fine."""
    from safetensors import safe_open

    data = torch.arange(6, dtype=torch.float32)
    header = (
        b' {"b":'
        + json.dumps(entry([8, 24], [4])).encode()
        + b',"__metadata__":null,"z":'
        + json.dumps(entry([24, 24], [0, 3])).encode()
        + b',"a":'
        + json.dumps(entry([0, 8])).encode()
        + b"}"
    )
    path = tmp_path / "ok.safetensors"
    path.write_bytes(st_bytes(header, data.numpy().tobytes()))
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["a", "b", "z"]
    reader = SafetensorsFile(path)
    try:
        assert reader.read("a").tolist() == [0, 1] and reader.read("b").tolist() == [2, 3, 4, 5]
        assert reader.shape("z") == (0, 3)
    finally:
        reader.close()
    assert set(read_header(path)) == {"a", "b", "z", "__metadata__"}


def test_safetensors_reader_does_not_leak_file_handles(tmp_path):
    path = tmp_path / "x.safetensors"
    writer = SafetensorsWriter(path, tmp_path, SPECS)
    for spec in SPECS:
        writer.write(spec.name, torch.ones(1000))
    writer.close()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(st_bytes({"a": entry([0, 8])}, b"\0" * 12))
    fds = len(os.listdir("/proc/self/fd"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            SafetensorsFile(path).close()
            with pytest.raises(FormatError):
                SafetensorsFile(bad)
            read_header(path)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]
    assert len(os.listdir("/proc/self/fd")) == fds
    import shardkit.formats.safetensors_io as module

    assert "read with the safetensors library" not in module.__doc__


def test_shardkit_writer_output_passes_its_own_reader(tmp_path):
    specs = [
        TensorSpec("w", (3, 5), torch.bfloat16),
        TensorSpec("e", (0,), torch.float32),
        TensorSpec("b", (7,), torch.int64),
    ]
    writer = SafetensorsWriter(tmp_path / "x.safetensors", tmp_path, specs)
    tensors = {"w": torch.randn(3, 5).bfloat16(), "e": torch.zeros(0), "b": torch.arange(7)}
    for spec in specs:
        writer.write(spec.name, tensors[spec.name])
    writer.close()
    reader = SafetensorsFile(tmp_path / "x.safetensors")
    try:
        assert all(torch.equal(reader.read(n), t) for n, t in tensors.items())
    finally:
        reader.close()


# ---- 4. names used as paths -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["/ABS/outside.safetensors", "../outside.safetensors", "sub/../../outside.safetensors"]
)
def test_hf_index_names_outside_the_folder_are_refused(name, tiny_model, tmp_path):
    root = hf_dir(tiny_model, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(next(tiny_model(MODEL).glob("*.safetensors")), outside)
    (root / "sub").mkdir()
    name = name.replace("/ABS", str(tmp_path))
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": name}}))
    with pytest.raises(UnsafePathError) as info:
        hf.weight_files(root)
    assert "refusing" in one_line(info.value) and "model.safetensors.index.json" in str(info.value)


def test_hf_index_through_a_linked_folder_is_refused(tiny_model, tmp_path):
    root = hf_dir(tiny_model, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copyfile(next(tiny_model(MODEL).glob("*.safetensors")), elsewhere / "w.safetensors")
    (root / "sub").symlink_to(elsewhere)
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "sub/w.safetensors"}}))
    with pytest.raises(UnsafePathError):
        hf.weight_files(root)


def test_hf_index_of_linked_files_like_the_hub_cache_still_works(tiny_model, tmp_path):
    """The Hub cache (and shardkit's own mirrors) link every file of a snapshot to a blob
    elsewhere: that is not an escape, and must keep working."""
    root = hf_dir(tiny_model, tmp_path)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    shutil.copyfile(next(tiny_model(MODEL).glob("*.safetensors")), blobs / "0123abcd")
    (root / "model-00001-of-00001.safetensors").symlink_to(blobs / "0123abcd")
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00001-of-00001.safetensors"}})
    )
    assert hf.weight_files(root) == [root / "model-00001-of-00001.safetensors"]


def test_hf_index_weight_map_of_the_wrong_type_is_a_format_error(tiny_model, tmp_path):
    root = hf_dir(tiny_model, tmp_path)
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": ["a"]}}))
    with pytest.raises(FormatError):
        hf.weight_files(root)


@pytest.mark.parametrize("tid", ["../../x", -1, True, 1.0, None])
def test_xser_tensor_ids_that_are_not_naturals_are_refused(tid, tmp_path):
    with pytest.raises(FormatError) as info:
        xser.tensor_path(tmp_path / "r.pt", tid)
    assert "invalid id" in one_line(info.value)
    path = tmp_path / "model" / "r.pt"
    path.parent.mkdir()
    torch.save({"a": TensorReference(tid)}, path, pickle_module=xser._PICKLE_MODULE, pickle_protocol=2)
    with pytest.raises(FormatError) as info:
        XserFile(path)
    assert "invalid id" in one_line(info.value) and str(path) in str(info.value)


def test_an_xser_rank_file_is_parsed_once_until_it_changes(tmp_path, monkeypatch):
    """The readers of one operation open an xser rank file several times: its reference and info
    files are parsed and checked once. A file written to or replaced since is parsed again, and a
    tensor file removed since is a FormatError when its tensor is read."""
    path = tmp_path / "r.pt"
    with XserWriter(path, tmp_path, SPECS[:2]) as writer:
        writer.write("t0", torch.ones(1000))
        writer.write("t1", torch.zeros(1000))
        writer.close()
    loads: list[Path] = []
    real = xser.safe_load
    counted = lambda p, *a, **k: loads.append(Path(p)) or real(p, *a, **k)  # noqa: E731
    monkeypatch.setattr(xser, "safe_load", counted)
    monkeypatch.setattr(torch_io, "safe_load", counted)  # the info file, read by torch_io.load_small
    for _ in range(3):
        XserFile(path).close()
    assert loads == [path, xser.info_path(path)]

    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # written to: parsed again
    XserFile(path).close()
    assert loads[2:] == [path]

    other = tmp_path / "other" / "r.pt"  # the same size and mtime, other names: renamed over it
    with XserWriter(
        other, tmp_path / "other", [TensorSpec(n, s.shape, s.dtype) for n, s in zip(("u0", "u1"), SPECS)]
    ) as w:
        w.write("u0", torch.ones(1000))
        w.write("u1", torch.zeros(1000))
        w.close()
    st = os.stat(path)
    os.replace(other, path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size
    reader = XserFile(path)
    assert reader.keys() == ["u0", "u1"]
    reader.close()

    xser.tensor_path(path, 1).unlink()  # gone since the last parse
    reader = XserFile(path)
    with pytest.raises(FormatError, match="tensor_1.pt"):
        reader.read("u1")
    reader.close()


def test_xser_info_file_with_garbage_shapes_is_refused(tmp_path):
    path = tmp_path / "r.pt"
    writer = XserWriter(path, tmp_path, SPECS[:1])
    writer.write("t0", torch.ones(1000))
    writer.close()
    torch.save({0: {"dtype": torch.float32, "shape": ["../x"]}}, xser.info_path(path))
    with pytest.raises(FormatError) as info:
        XserFile(path)
    assert "info" in one_line(info.value)


def test_nxd_model_link_out_of_the_folder_is_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    torch.save({"a": torch.zeros(2)}, elsewhere / "dp_rank_00_tp_rank_00_pp_rank_00.pt")
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "model").symlink_to(elsewhere)
    with pytest.raises(UnsafePathError) as info:
        nxd.find_rank_files(root)
    assert "model" in one_line(info.value)


# ---- 5. non-regular files -------------------------------------------------------------------------


def test_hf_model_safetensors_fifo_is_refused_not_waited_on(tiny_model, tmp_path):
    root = hf_dir(tiny_model, tmp_path)
    os.mkfifo(root / "model.safetensors")
    with pytest.raises(FormatError) as info:
        returns_within(lambda: open_checkpoint(root), 10, [root / "model.safetensors"])
    assert "model.safetensors" in one_line(info.value) and "FIFO" in str(info.value)
    with pytest.raises(FormatError):
        returns_within(lambda: SafetensorsFile(root / "model.safetensors"), 10, [root / "model.safetensors"])
    with pytest.raises(FormatError):
        returns_within(lambda: read_header(root / "model.safetensors"), 10, [root / "model.safetensors"])


def test_hf_model_safetensors_folder_is_a_format_error(tiny_model, tmp_path):
    root = hf_dir(tiny_model, tmp_path)
    (root / "model.safetensors").mkdir()
    with pytest.raises(FormatError) as info:
        returns_within(lambda: open_checkpoint(root), 10)
    assert "model.safetensors" in one_line(info.value) and "folder" in str(info.value)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_nxd_rank_file_fifo_is_refused_not_waited_on(suffix, tiny_model, tmp_path):
    root = hf_dir(tiny_model, tmp_path)
    (root / "model").mkdir()
    fifo = root / "model" / f"dp_rank_00_tp_rank_00_pp_rank_00{suffix}"
    os.mkfifo(fifo)
    with pytest.raises(FormatError) as info:
        returns_within(lambda: open_checkpoint(root), 10, [fifo])
    assert fifo.name in one_line(info.value) and "FIFO" in str(info.value)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_nxd_empty_rank_file_is_a_format_error(suffix, tiny_model, tmp_path):
    root = hf_dir(tiny_model, tmp_path)
    (root / "model").mkdir()
    empty = root / "model" / f"dp_rank_00_tp_rank_00_pp_rank_00{suffix}"
    empty.write_bytes(b"")
    with pytest.raises(FormatError) as info:
        returns_within(lambda: open_checkpoint(root), 10)
    assert str(empty) in one_line(info.value) and "empty" in str(info.value)


def test_torch_and_xser_readers_refuse_fifos(tmp_path):
    from shardkit.formats.torch_io import TorchFile, safe_load

    fifo = tmp_path / "r.pt"
    os.mkfifo(fifo)
    for read in (TorchFile, safe_load, XserFile):
        with pytest.raises(FormatError) as info:
            returns_within(lambda read=read: read(fifo), 10, [fifo])
        assert "FIFO" in one_line(info.value)


def test_header_that_is_a_list_is_a_format_error_through_open_checkpoint(tiny_model, tmp_path):
    root = hf_dir(tiny_model, tmp_path)
    (root / "model.safetensors").write_bytes(st_bytes(b"[1, 2]", b""))
    with pytest.raises(FormatError) as info:
        open_checkpoint(root)
    assert "model.safetensors" in one_line(info.value)


def test_errors_are_shardkit_errors():
    assert issubclass(NoSpaceError, ShardkitError) and issubclass(UnsafePathError, ShardkitError)


# ---- 6. what a source links to, and a merge of what needs none ----------------------------------------


def _cli(*args, quiet: bool = True):
    from click.testing import CliRunner

    from shardkit.cli import cli

    return CliRunner().invoke(cli, [*(["-q"] if quiet else []), *map(str, args)], catch_exceptions=False)


def _one_line(result, *phrases: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error: "), result.stderr
    assert all(p in lines[0] for p in phrases), lines[0]
    return lines[0]


def test_an_optimum_checkpoint_never_embeds_a_trainer_state_or_tokenizer_linked_outside(tiny_model, tmp_path):
    """optimum-neuron's trainer_state.json becomes the new tag's user content and its tokenizer is
    copied: linked outside the checkpoint folder, each is refused in one line and nothing is
    written; linked inside it, each is read."""
    from shardkit import convert, make_layout

    folder = tmp_path / "run" / "checkpoint-2"
    convert(tiny_model(MODEL), folder, make_layout(tp=2), format="optimum-neuron")
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"api_key": "the user's secret"}))
    (folder / "trainer_state.json").symlink_to(secret)
    _one_line(_cli("ckpt", "reshard", tmp_path / "run", tmp_path / "out", "--tp", "1"), "trainer_state.json", "outside")
    assert not (tmp_path / "out").exists()

    (folder / "trainer_state.json").unlink()
    (folder / "state").mkdir()
    (folder / "state" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (folder / "trainer_state.json").symlink_to("state/trainer_state.json")
    (folder / "tokenizer.json").symlink_to(secret)
    _one_line(_cli("merge", folder, tmp_path / "merged"), "tokenizer.json", "outside")
    assert not (tmp_path / "merged").exists()
    (folder / "tokenizer.json").unlink()
    assert _cli("ckpt", "reshard", tmp_path / "run", tmp_path / "out", "--tp", "1").exit_code == 0
    content = torch.load(tmp_path / "out" / "checkpoint-2" / "user_content.pt", weights_only=True)
    assert content == {"global_step": 2}


def test_merge_of_a_hugging_face_model_refuses_to_write_it_again_and_says_what_a_resave_changes(
    tiny_model, tmp_path, caplog
):
    """Nothing to merge in a Hugging Face model: refused when the merge would write it again as it
    is; a re-save that changes something (dtype, file split, .bin to safetensors) says what."""
    src = tmp_path / "hf"
    shutil.copytree(tiny_model(MODEL), src)
    _one_line(_cli("merge", src, tmp_path / "same"), "already a Hugging Face model", "nothing to merge", "--dtype")
    assert not (tmp_path / "same").exists()
    changed = {
        "bf16": (["--dtype", "bf16"], "dtype float32 to bfloat16"),
        "split": (["--max-shard-size", "100KB"], "1 file of weights to "),
    }
    for name, (options, says) in changed.items():
        caplog.clear()
        result = _cli("merge", src, tmp_path / name, *options, quiet=False)
        assert result.exit_code == 0, result.stderr
        assert "already a Hugging Face model: merge re-saves it" in caplog.text and says in caplog.text
    (src / "model.safetensors").unlink()
    from safetensors.torch import load_file

    torch.save(load_file(tiny_model(MODEL) / "model.safetensors"), src / "pytorch_model.bin")
    caplog.clear()
    result = _cli("merge", src, tmp_path / "from-bin", quiet=False)
    assert result.exit_code == 0 and "torch weights to safetensors" in caplog.text, result.stderr
