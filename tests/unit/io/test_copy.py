"""Bytes that move unchanged are copied by the kernel, file to file (`HashingFile.copy_ranges`):
the output is byte for byte what writing them from memory gives, the digests and CRC32s describe
the bytes the file holds, the source's check on read still sees every byte, and failures leave
nothing behind."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
import zipfile

import pytest
import torch
from safetensors.torch import load_file

from shardkit import Layout, convert, merge, reshard
from shardkit.engine import planning
from shardkit.errors import FormatError, ShardkitError
from shardkit.formats import source_check
from shardkit.formats.base import tensor_bytes
from shardkit.io.data import copy as io_copy
from shardkit.io.data import hashing, taps
from shardkit.io.data.copy import FileRange
from shardkit.io.data.digest import file_digests
from shardkit.io.data.hashing import HashingFile
from shardkit.io.data.taps import OpenFile

READ_EXACT_CALLERS = (taps, hashing, source_check)
"""The modules whose code reads through `read_exact` (positional reads and the checks' taps;
the copies, their read-back and the reads of a file written around the page cache; the gaps a
check reads between the operation's reads)."""


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def kernel_copies(monkeypatch) -> list[int]:
    """The byte counts the kernel was asked to copy, in order."""
    asked: list[int] = []
    real = hashing.kernel_copy

    def counting(src: int, offset: int, out: int, count: int, fetcher=None) -> int | None:
        asked.append(count)
        return real(src, offset, out, count, fetcher)

    monkeypatch.setattr(hashing, "kernel_copy", counting)
    return asked


def _files(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_convert_and_merge_copy_row_blocks_by_the_kernel_and_write_the_same_bytes(
    tiny_model, tmp_path, monkeypatch, kernel_copies
):
    """Convert (row blocks of the HF tensors into torch shards) and an unchecked merge (each
    shard's rows of a dim-0 tensor into the HF file) copy every such piece by the kernel; the
    files are those of the same operations written from memory, the manifest's digests are the
    files' own, torch loads the shards with their CRC32s checked, and no descriptor is left open.
    A checked merge of cold shards (an output without digests: only the check would read the
    copies back) reads and writes instead."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    layout = Layout(tp=2, pp=2)
    q = load_file(src / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    before = _open_fds()
    convert(src, tmp_path / "copied", layout, format="torch", workers=1)
    assert sum(kernel_copies) >= q.numel() * q.element_size()  # q's halves, at least
    kernel_copies.clear()
    with monkeypatch.context() as cold:
        cold.setattr(planning, "cached_share", lambda extents: 0.0)
        merge(tmp_path / "copied", tmp_path / "merged-checked", workers=1)
    assert not kernel_copies
    merge(tmp_path / "copied", tmp_path / "merged-copied", workers=1, verify_hashes=False)
    assert sum(kernel_copies) >= q.numel() * q.element_size()
    assert _open_fds() == before
    assert _files(tmp_path / "merged-checked") == _files(tmp_path / "merged-copied")
    kernel_copies.clear()
    from shardkit.formats import safetensors_io, torch_io  # writers that take no copies: every tensor from memory

    monkeypatch.setattr(safetensors_io.SafetensorsWriter, "can_copy", lambda self: False)
    monkeypatch.setattr(torch_io.TorchWriter, "can_copy", lambda self: False)
    convert(src, tmp_path / "written", layout, format="torch", workers=1)
    merge(tmp_path / "written", tmp_path / "merged-written", workers=1, verify_hashes=False)
    assert not kernel_copies

    for a, b in (("copied", "written"), ("merged-copied", "merged-written")):
        assert _files(tmp_path / a) == _files(tmp_path / b), (a, b)
    import json

    manifest = json.loads((tmp_path / "copied" / "shardkit.json").read_text())
    for entry in manifest["files"]:
        _, fast = file_digests(tmp_path / "copied" / entry["path"])
        assert fast == entry["xxh3_128"], entry["path"]
    for shard in (tmp_path / "copied").rglob("*.pt"):
        with zipfile.ZipFile(shard) as archive:
            assert archive.testzip() is None  # every record's CRC32 matches its bytes
        torch.load(shard, weights_only=True)


def test_digests_and_crc_of_copied_bytes_follow_file_order(tmp_path):
    """Small writes, large blocks hashed by the helper thread and copied ranges, interleaved: the
    file's xxh3-128 and sha256 are those of its bytes, and `seen` gets the copied bytes in order."""
    source = tmp_path / "source.bin"
    data = os.urandom(5 << 20)
    source.write_bytes(data)
    fd = os.open(source, os.O_RDONLY)
    try:
        out = HashingFile(tmp_path / "out.bin", tmp_path, digests="sha256")
        seen: list[bytes] = []
        big = torch.frombuffer(bytearray(os.urandom(3 << 20)), dtype=torch.uint8)
        out.write(b"header")
        out.write_owned(tensor_bytes(big), big)
        ranges = [
            FileRange(OpenFile(fd), 7, (2 << 20) + 3, "source"),
            FileRange(OpenFile(fd), 3 << 20, 1 << 20, "source"),
        ]
        assert out.copy_ranges(ranges, lambda b: seen.append(bytes(b)), lambda: b"after", 5) == (3 << 20) + 3
        out.write(b"tail")
        out.write_owned(tensor_bytes(big), big)
        record = out.close()
    finally:
        os.close(fd)
    copied = data[7 : 7 + (2 << 20) + 3] + data[3 << 20 : 4 << 20]
    expected = b"header" + bytes(big.numpy()) + copied + b"after" + b"tail" + bytes(big.numpy())
    assert (tmp_path / "out.bin").read_bytes() == expected
    assert b"".join(seen) == copied
    assert (record.sha256, record.xxh3_128) == file_digests(tmp_path / "out.bin", sha256=True)
    assert record.size == len(expected)


@pytest.mark.parametrize("how", ["unsupported", "partly"])
def test_where_the_kernel_cannot_copy_the_bytes_are_read_and_written(tmp_path, monkeypatch, how):
    """copy_file_range and sendfile refused (another file system), from the start or after part
    of a block: the rest is read and written, with the same bytes and digests."""
    source = tmp_path / "source.bin"
    data = os.urandom(3 << 20)
    source.write_bytes(data)
    real = hashing.kernel_copy
    calls = {"n": 0}

    def refusing(src: int, offset: int, out: int, count: int, fetcher=None) -> int | None:
        calls["n"] += 1
        if how == "partly" and calls["n"] == 1:
            return real(src, offset, out, 1000)
        return None

    monkeypatch.setattr(hashing, "kernel_copy", refusing)
    fd = os.open(source, os.O_RDONLY)
    try:
        out = HashingFile(tmp_path / "out.bin", tmp_path)
        out.write(b"x")
        out.copy_ranges([FileRange(OpenFile(fd), 5, len(data) - 5, "source")])
        record = out.close()
    finally:
        os.close(fd)
    assert (tmp_path / "out.bin").read_bytes() == b"x" + data[5:]
    assert record.xxh3_128 == file_digests(tmp_path / "out.bin")[1]


def test_kernel_copy_falls_back_to_sendfile(tmp_path, monkeypatch):
    """copy_file_range refused between two files (EXDEV): sendfile copies instead."""
    source = tmp_path / "source.bin"
    source.write_bytes(b"0123456789")

    def exdev(*args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", exdev)
    src = os.open(source, os.O_RDONLY)
    out = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert io_copy.kernel_copy(src, 2, out, 5) == 5
    finally:
        os.close(src)
        os.close(out)
    assert (tmp_path / "out.bin").read_bytes() == b"23456"


def test_without_copy_file_range_or_a_file_to_file_sendfile_nothing_is_copied_by_the_kernel(tmp_path, monkeypatch):
    """Where os has no copy_file_range and sendfile sends to sockets only (macOS), kernel_copy
    says so (None), and the caller reads and writes."""
    monkeypatch.delattr(os, "copy_file_range", raising=False)

    def sockets_only(*args, **kwargs):
        raise OSError(errno.ENOTSOCK, "Socket operation on non-socket")

    monkeypatch.setattr(os, "sendfile", sockets_only)
    source = tmp_path / "source.bin"
    source.write_bytes(b"0123456789")
    src = os.open(source, os.O_RDONLY)
    out = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert io_copy.kernel_copy(src, 2, out, 5) is None
    finally:
        os.close(src)
        os.close(out)


def test_a_full_disk_during_a_copy_is_a_one_line_error_and_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    calls = {"n": 0}
    real = hashing.kernel_copy

    def filling(src_fd: int, offset: int, out: int, count: int, fetcher=None) -> int | None:
        calls["n"] += 1
        if calls["n"] > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src_fd, offset, out, count)

    monkeypatch.setattr(hashing, "kernel_copy", filling)
    before = _open_fds()
    with pytest.raises(ShardkitError, match="space") as info:
        convert(src, tmp_path / "out", Layout(tp=2), format="torch", workers=1)
    assert "\n" not in str(info.value)
    assert sorted(os.listdir(tmp_path)) == []
    assert _open_fds() == before


def test_a_source_that_shrinks_during_a_copy_is_refused(tiny_model, tmp_path, monkeypatch):
    """The kernel finds the source shorter than its header said (0 bytes copied): FormatError
    naming the file, nothing written."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    monkeypatch.setattr(hashing, "kernel_copy", lambda src_fd, offset, out, count, fetcher=None: 0)
    with pytest.raises(FormatError, match="truncated"):
        convert(src, tmp_path / "out", Layout(tp=2), format="torch", workers=1)
    assert sorted(os.listdir(tmp_path)) == []


def test_a_flipped_bit_in_copied_bytes_is_refused_by_the_check_on_read(tiny_model, tmp_path, kernel_copies):
    """The bytes the kernel copies are read by the worker for the source's check as it queues
    the copy: a shard whose MLP rows (a piece reshard copies) have a flipped bit is refused, and
    nothing is written."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "shards", Layout(tp=2), format="torch", workers=1)
    shard = sorted((tmp_path / "shards").rglob("*.pt"))[1]
    with zipfile.ZipFile(shard) as archive:
        names = [i for i in archive.infolist() if i.filename.split("/")[-2:-1] == ["data"]]
        info = max(names, key=lambda i: i.file_size)  # the largest record: an MLP row block
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw = bytearray(shard.read_bytes())
    raw[start + info.file_size // 2] ^= 0x10
    shard.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="does not match"):
        reshard(tmp_path / "shards", tmp_path / "tp1", Layout(tp=1), format="torch", workers=1)
    assert kernel_copies
    assert not (tmp_path / "tp1").exists()


def test_giving_up_a_file_stops_its_copy_between_blocks_and_closes_the_sources(tmp_path, monkeypatch):
    """abort() while the write-behind thread copies: the copy stops after the block under way,
    the file is deleted, and the descriptors the job held are closed."""
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(8 * io_copy.COPY_BLOCK))
    gate, started = threading.Event(), threading.Event()
    real = hashing.kernel_copy
    calls = {"n": 0}

    def slow(src: int, offset: int, out: int, count: int, fetcher=None) -> int | None:
        calls["n"] += 1
        started.set()
        gate.wait(10)
        return real(src, offset, out, count)

    monkeypatch.setattr(hashing, "kernel_copy", slow)
    fd = os.open(source, os.O_RDONLY)
    before = _open_fds()
    try:
        out = HashingFile(tmp_path / "out.bin", tmp_path)
        out.copy_ranges([FileRange(OpenFile(fd), 0, 8 * io_copy.COPY_BLOCK, "source")])
        assert started.wait(10)
        stopper = threading.Thread(target=out.abort)
        stopper.start()
        time.sleep(0.1)
        gate.set()
        stopper.join(10)
        assert not stopper.is_alive()
    finally:
        os.close(fd)
    assert calls["n"] == 1
    assert not (tmp_path / "out.bin").exists()
    assert _open_fds() == before - 1


def test_one_worker_closes_each_file_while_it_writes_the_next(tiny_model, tmp_path, monkeypatch):
    """With one worker, a file's close (its queued copies and writes, then the zip directory)
    runs in a helper thread while the next file's tensors are written: each close here waits
    until the next file is opened, which a one-after-another loop would never do."""
    from shardkit.formats import torch_io

    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    opened: list[threading.Event] = []
    overlapped: list[bool] = []
    real_init, real_close = torch_io.TorchWriter.__init__, torch_io.TorchWriter.close

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        if opened:
            opened[-1].set()
        opened.append(threading.Event())
        self.next_opened = opened[-1]

    def close(self, fsync=False):
        last = self.path.name.endswith("pp_rank_01.pt") and "tp_rank_01" in self.path.name
        overlapped.append(last or self.next_opened.wait(10))
        return real_close(self, fsync)

    monkeypatch.setattr(torch_io.TorchWriter, "__init__", init)
    monkeypatch.setattr(torch_io.TorchWriter, "close", close)
    convert(src, tmp_path / "out", Layout(tp=2, pp=2), format="torch", workers=1)
    assert len(overlapped) == 4 and all(overlapped)
    monkeypatch.undo()
    convert(src, tmp_path / "plain", Layout(tp=2, pp=2), format="torch", workers=1)
    assert _files(tmp_path / "out") == _files(tmp_path / "plain")


def test_a_failure_closing_a_file_stops_the_next_and_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    """The first file's close fails while the second is being written: the error is raised, the
    second file is given up, no write is left queued, no closing thread is left running and
    nothing is left behind."""
    from shardkit.formats import torch_zip

    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    real_finish = torch_zip.ZipRecords.finish
    finishes = {"n": 0}

    def failing_finish(self):
        finishes["n"] += 1
        if finishes["n"] == 1:  # writing the first file's zip directory
            raise OSError(errno.EIO, "Input/output error")
        return real_finish(self)

    monkeypatch.setattr(torch_zip.ZipRecords, "finish", failing_finish)
    with pytest.raises(ShardkitError, match="Input/output error"):
        convert(src, tmp_path / "out", Layout(tp=2, pp=2), format="torch", workers=1)
    assert finishes["n"] == 1
    assert sorted(os.listdir(tmp_path)) == []
    assert not [t.name for t in threading.enumerate() if t.name.startswith("shardkit-close")]
    assert hashing.queued_writes() == 0


def test_the_check_on_read_hashes_the_copied_bytes_without_reading_them_again(
    tiny_model, tmp_path, monkeypatch, kernel_copies
):
    """Reshard (torch output, with digests) copies the shards' row blocks by the kernel; the check
    of the shards against their manifest is fed from the worker's reads of the ranges it queues
    for copying, in file order, so no listed file is read a second time for it."""

    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "shards", Layout(tp=2), format="torch", workers=1)
    finished: dict[str, tuple[int, int]] = {}
    real = source_check.feed_file

    def counting(path, digest, start=0, store=None):
        size = real(path, digest, start, store)
        finished[os.path.basename(path)] = (start, size)
        return size

    monkeypatch.setattr(source_check, "feed_file", counting)
    kernel_copies.clear()
    reshard(tmp_path / "shards", tmp_path / "tp1", Layout(tp=1), format="torch", workers=1)
    assert kernel_copies
    shards = sorted(p.name for p in (tmp_path / "shards").rglob("*.pt"))
    assert sorted(finished) == shards
    # only the zip directory at the end (no tensor's bytes) is read for the check
    assert all(size - start < 16 << 10 for start, size in finished.values()), finished


def test_a_merge_of_shards_no_manifest_lists_copies_in_the_kernel(tiny_model, tmp_path, kernel_copies, monkeypatch):
    """Shards without shardkit's manifest (as NxD writes them) have nothing to check: merge then
    copies their rows by the kernel, cold or not, with the bytes of a merge of the same shards
    with it."""
    import shutil

    monkeypatch.setattr(planning, "cached_share", lambda extents: 0.0)  # cold shards

    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "listed", Layout(tp=2), format="torch", workers=1)
    shutil.copytree(tmp_path / "listed", tmp_path / "bare")
    (tmp_path / "bare" / "shardkit.json").unlink()
    kernel_copies.clear()
    merge(tmp_path / "listed", tmp_path / "from-listed", workers=1)
    assert not kernel_copies  # checked: read in the worker, written behind it
    merge(tmp_path / "bare", tmp_path / "from-bare", workers=1)
    assert kernel_copies
    assert _files(tmp_path / "from-bare") == _files(tmp_path / "from-listed")


def _evict(root) -> float:
    """Drop a folder's files from the page cache (written back first); the share of their bytes
    still cached afterwards."""
    from shardkit.engine.prefetch import cached_share

    os.sync()
    extents = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        extents.append((path, 0, path.stat().st_size))
    return cached_share(extents)


def test_a_checked_merge_copies_shards_in_the_page_cache_and_reads_cold_ones(tiny_model, tmp_path, kernel_copies):
    """Whether a checked merge copies in the kernel follows where its shards are as it starts:
    in the page cache (just written), copied and read back for the check; evicted, read by the
    worker and written behind it. The same bytes either way, and a flipped bit is refused either
    way."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "shards", Layout(tp=2), format="torch", workers=1)
    kernel_copies.clear()
    merge(tmp_path / "shards", tmp_path / "warm", workers=1)
    assert kernel_copies
    if _evict(tmp_path / "shards") >= planning.WARM_SOURCES:
        pytest.skip("the page cache here keeps files that fadvise(DONTNEED) should drop")
    kernel_copies.clear()
    merge(tmp_path / "shards", tmp_path / "cold", workers=1)
    assert not kernel_copies
    assert _files(tmp_path / "warm") == _files(tmp_path / "cold")

    shard = sorted((tmp_path / "shards").rglob("*.pt"))[0]
    with zipfile.ZipFile(shard) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename and i.file_size > 4096)
    data = bytearray(shard.read_bytes())
    offset = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + info.file_size // 2
    for state in ("warm", "cold"):
        flipped = bytearray(data)
        flipped[offset] ^= 0x10
        shard.write_bytes(bytes(flipped))
        if state == "cold":
            _evict(tmp_path / "shards")
        with pytest.raises(FormatError):
            merge(tmp_path / "shards", tmp_path / f"bad-{state}", workers=1)
        assert not (tmp_path / f"bad-{state}").exists()
        shard.write_bytes(bytes(data))


def test_a_shard_read_by_two_output_files_is_checked_without_reading_it_whole_again(
    tiny_model, tmp_path, monkeypatch, kernel_copies
):
    """At tp 8 -> 4 with kv heads regrouped (kv-multiplier 2 -> 1), a shard's attention goes to
    one output file and its embedding and MLP rows to a later one. The first file's reads jump
    over bytes only the later one reads: they are dropped and read again once the later file's
    reads bring the shard's check there, instead of the shard being hashed whole a second time.
    The output is a direct convert's, and a flipped bit in a dropped read is refused."""

    # the tensors of tinyllama-mini are 64x smaller than TinyLlama-1.1B's: so are the gaps here
    monkeypatch.setattr(source_check, "FILL_GAP", source_check.FILL_GAP // 64)
    monkeypatch.setattr(source_check, "SMALL_GAP", source_check.SMALL_GAP // 64)
    src = tiny_model("tinyllama-mini", dtype=torch.bfloat16)
    source = Layout(tp=8, pp=2, kv_multiplier=2, qkv="gqa")
    target = Layout(tp=4, pp=4, kv_multiplier=1, qkv="gqa")
    convert(src, tmp_path / "tp8", source, format="torch", workers=1)
    convert(src, tmp_path / "direct", target, format="torch", workers=1)
    finished: dict[str, tuple[int, int]] = {}
    dropped: list[tuple[str, int]] = []
    real_feed, real_later = source_check.feed_file, source_check._FileCheck._later_than_soon

    def counting(path, digest, start=0, store=None):
        size = real_feed(path, digest, start, store)
        finished[os.path.basename(path)] = (start, size)
        return size

    def later(check, offset):
        found = real_later(check, offset)
        if found:
            dropped.append((check.rel, offset))
        return found

    monkeypatch.setattr(source_check, "feed_file", counting)
    monkeypatch.setattr(source_check._FileCheck, "_later_than_soon", later)
    reshard(tmp_path / "tp8", tmp_path / "tp4", target, format="torch", workers=1)
    assert kernel_copies and dropped
    assert len(finished) == 16
    # only the zip directories at the ends (no tensor's bytes) are read by the check's thread
    assert all(size - start < 16 << 10 for start, size in finished.values()), finished
    direct, resharded = _files(tmp_path / "direct"), _files(tmp_path / "tp4")
    assert {k: v for k, v in resharded.items() if k != "shardkit.json"} == {
        k: v for k, v in direct.items() if k != "shardkit.json"
    }

    rel, offset = dropped[0]
    shard = tmp_path / "tp8" / rel
    raw = bytearray(shard.read_bytes())
    raw[offset + 1] ^= 0x10
    shard.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="does not match"):
        reshard(tmp_path / "tp8", tmp_path / "bad", target, format="torch", workers=1)
    assert not (tmp_path / "bad").exists()


def test_copies_from_checked_sources_are_not_read_back(tiny_model, tmp_path, kernel_copies, monkeypatch):
    """When every source of a copy is checked, the worker reads its ranges once, as it queues the
    copy, for the check, the output file's digests and the zip record's CRC32: the write-behind
    thread copies in the kernel and reads nothing back (the busier thread does the least). Merge
    and reshard alike; the reshard's manifest lists the digests of the bytes its files hold."""
    import json

    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "shards", Layout(tp=2), format="torch", workers=1)
    read_from: list[str] = []
    real = taps.read_exact

    def recording(fd, view, offset, what, fetcher=None):
        read_from.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd, view, offset, what, fetcher)

    for module in READ_EXACT_CALLERS:
        monkeypatch.setattr(module, "read_exact", recording)
    merge(tmp_path / "shards", tmp_path / "merged", workers=1)
    reshard(tmp_path / "shards", tmp_path / "tp1", Layout(tp=1), format="torch", workers=1)
    assert kernel_copies
    assert read_from and all("/shards/" in path for path in read_from), sorted(set(read_from))
    for module in READ_EXACT_CALLERS:
        monkeypatch.setattr(module, "read_exact", real)
    for entry in json.loads((tmp_path / "tp1" / "shardkit.json").read_text())["files"]:
        assert file_digests(tmp_path / "tp1" / entry["path"])[1] == entry["xxh3_128"]
    for name in sorted(p.name for p in (tmp_path / "tp1").rglob("*.pt")):  # the CRC32s
        with zipfile.ZipFile(next((tmp_path / "tp1").rglob(name))) as archive:
            assert archive.testzip() is None


def _rewrite_first_byte(path) -> None:
    """Write a file's first byte over with its own value: its bytes stay, its mtime moves."""
    with open(path, "r+b") as fh:
        byte = fh.read(1)
        fh.seek(0)
        time.sleep(0.01)  # a later mtime, even on coarse clocks
        fh.write(byte)


def test_a_source_written_to_while_it_is_read_is_refused(tiny_model, tmp_path, monkeypatch):
    """The check hashes a range as the worker queues its copy, a moment before the kernel moves
    it: a shard written to in between (here: a byte rewritten with its own value, after the first
    ranges were hashed) is refused before anything is committed, whatever its bytes now are."""

    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "shards", Layout(tp=2), format="torch", workers=1)
    shard = sorted((tmp_path / "shards").rglob("*.pt"))[0]
    real = source_check._FileCheck.feed
    calls = []

    def feeding_then_writing(check, fd, offset, view):
        fed = real(check, fd, offset, view)
        calls.append(1)
        if len(calls) == 3:
            _rewrite_first_byte(shard)
        return fed

    monkeypatch.setattr(source_check._FileCheck, "feed", feeding_then_writing)
    for operation in (merge, lambda src, dst, **kw: reshard(src, dst, Layout(tp=1), format="torch", **kw)):
        calls.clear()
        with pytest.raises(FormatError, match="changed while shardkit read it"):
            operation(tmp_path / "shards", tmp_path / "out", workers=1)
        assert not (tmp_path / "out").exists()


def test_a_hugging_face_file_written_to_while_convert_reads_it_is_refused(tiny_model, tmp_path, monkeypatch):
    """Convert hashes the ranges it has the kernel copy from the worker's own read of them (no
    manifest checks a Hugging Face folder): a source written to in between (a byte rewritten
    with its own value, after the first copies were queued) is refused before anything is
    committed. Untouched, the shards' digests and CRC32s are those of the files written, and the
    write-behind threads read nothing back."""
    import shutil

    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    read_back: list[int] = []
    real_read = taps.read_exact

    def reading(fd, view, offset, what, fetcher=None):
        if threading.current_thread().name == "shardkit-write-behind":
            read_back.append(len(view))
        return real_read(fd, view, offset, what, fetcher)

    for module in READ_EXACT_CALLERS:
        monkeypatch.setattr(module, "read_exact", reading)
    convert(hf, tmp_path / "shards", Layout(tp=2, pp=2), format="torch", workers=1)
    assert read_back == []
    monkeypatch.undo()
    for entry in json.loads((tmp_path / "shards" / "shardkit.json").read_text())["files"]:
        assert file_digests(tmp_path / "shards" / entry["path"])[1] == entry["xxh3_128"]
    for shard in (tmp_path / "shards").rglob("*.pt"):
        with zipfile.ZipFile(shard) as archive:
            assert archive.testzip() is None

    real = hashing.HashingFile._read_copied
    calls = []

    def reading_then_writing(self, *args):
        data = real(self, *args)
        calls.append(1)
        if len(calls) == 3:
            _rewrite_first_byte(hf / "model.safetensors")
        return data

    monkeypatch.setattr(hashing.HashingFile, "_read_copied", reading_then_writing)
    with pytest.raises(FormatError, match="changed while shardkit read it"):
        convert(hf, tmp_path / "out", Layout(tp=2, pp=2), format="torch", workers=1)
    assert calls and not (tmp_path / "out").exists()


def test_copies_nobody_needs_the_bytes_of_are_not_read(tiny_model, tmp_path, monkeypatch, kernel_copies):
    """An unchecked merge (its Hugging Face output has no digests, safetensors no CRC32): the
    kernel copies the shards' rows and neither the worker nor a write-behind thread reads them."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "shards", Layout(tp=2, pp=2), format="torch", workers=1)
    monkeypatch.setattr(hashing.HashingFile, "_read_copied", lambda *a: pytest.fail("copied bytes read"))
    monkeypatch.setattr(hashing._CopyJob, "_hash", lambda *a: pytest.fail("copied bytes read back"))
    kernel_copies.clear()
    merge(tmp_path / "shards", tmp_path / "merged", workers=1, verify_hashes=False)
    assert kernel_copies


def test_xser_tensor_files_are_copied_streamed_and_closed_behind(tiny_model, tmp_path, monkeypatch, kernel_copies):
    """An xser convert copies row blocks by the kernel into their tensor files and streams the
    blocks of columns of o_proj/down_proj, as torch shards do; the files are byte for byte those of
    a writer that takes neither, every tensor file's CRC32s and manifest digest hold, and a writer
    keeps at most CLOSING_BEHIND tensor files closing behind the one it writes."""
    from shardkit.formats import xser

    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    layout = Layout(tp=2, pp=2)
    open_at_once: list[int] = []
    real_file = xser.XserWriter._tensor_file

    def tensor_file(self, name):
        open_at_once.append(len(self._closing) + 1)  # those closing behind, and this one
        return real_file(self, name)

    monkeypatch.setattr(xser.XserWriter, "_tensor_file", tensor_file)
    before = _open_fds()
    convert(src, tmp_path / "copied", layout, format="xser", workers=1)
    assert _open_fds() == before
    q = load_file(src / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert sum(kernel_copies) >= q.numel() * q.element_size()
    assert max(open_at_once) == xser.CLOSING_BEHIND + 1

    kernel_copies.clear()
    monkeypatch.setattr(xser.XserWriter, "can_copy", lambda self: False)
    monkeypatch.setattr(xser.XserWriter, "can_stream_rows", lambda self: False)
    convert(src, tmp_path / "written", layout, format="xser", workers=1)
    assert not kernel_copies
    assert _files(tmp_path / "copied") == _files(tmp_path / "written")

    manifest = json.loads((tmp_path / "copied" / "shardkit.json").read_text())
    assert len(manifest["files"]) > 4 * 3  # every rank's reference file, .info.pt and tensor files
    for entry in manifest["files"]:
        _, fast = file_digests(tmp_path / "copied" / entry["path"])
        assert fast == entry["xxh3_128"], entry["path"]
    for tensor_file_path in (tmp_path / "copied").rglob("tensor_*.pt"):
        with zipfile.ZipFile(tensor_file_path) as archive:
            assert archive.testzip() is None
    merge(tmp_path / "copied", tmp_path / "merged", workers=1)
    for name, tensor in load_file(src / "model.safetensors").items():
        assert torch.equal(load_file(tmp_path / "merged" / "model.safetensors")[name], tensor), name


def test_xser_writer_rows_and_copies_match_write_and_misuse_discards_everything(tmp_path):
    """XserWriter's `begin_rows` and `write_copy` give the tensor file `write` gives; a tensor
    written twice, another tensor while a matrix's rows are open, or a close before they end gives
    the whole rank file up (its tensor files included, closing or closed)."""
    from shardkit.formats.base import TensorSpec
    from shardkit.formats.xser import XserFile, XserWriter

    matrix = torch.arange(6 * 4, dtype=torch.bfloat16).reshape(6, 4)
    vector = torch.arange(3, dtype=torch.float32)
    specs = [TensorSpec("v0", (3,), torch.float32), TensorSpec("m", (6, 4), torch.bfloat16)]
    specs += [TensorSpec(f"v{i}", (3,), torch.float32) for i in range(1, 4)]
    source = tmp_path / "source.bin"
    source.write_bytes(b"\0" * 100 + matrix.view(torch.uint8).numpy().tobytes())

    def write(name: str, how: str):
        out = tmp_path / name
        w = XserWriter(out / "r.pt", out, specs)
        w.write("v0", vector)
        if how == "write":
            w.write("m", matrix)
        elif how == "rows":
            rows = w.begin_rows("m")
            for block in (matrix[:1].clone(), matrix[1:5].clone(), matrix[5:].clone()):
                rows.add(block)
            rows.end()
        else:
            fd = os.open(source, os.O_RDONLY)
            try:
                w.write_copy(
                    "m", [FileRange(OpenFile(fd), 100, 20, "source"), FileRange(OpenFile(fd), 120, 28, "source")]
                )
            finally:
                os.close(fd)
        for spec in specs[2:]:
            w.write(spec.name, vector)
        return w.close()

    records = write("write", "write")
    assert len(records) == 2 + len(specs)
    write("rows", "rows")
    write("copy", "copy")
    assert _files(tmp_path / "write") == _files(tmp_path / "rows") == _files(tmp_path / "copy")
    reader = XserFile(tmp_path / "copy" / "r.pt")
    assert torch.equal(reader.read("m"), matrix) and torch.equal(reader.read("v3"), vector)
    reader.close()

    out = tmp_path / "twice"
    w = XserWriter(out / "r.pt", out, specs)
    w.write("v0", vector)
    with pytest.raises(RuntimeError, match="v0 was written already"):
        w.write("v0", vector)
    assert not [p for p in out.rglob("*") if p.is_file()]

    for misuse in ("another tensor", "close"):
        out = tmp_path / misuse
        w = XserWriter(out / "r.pt", out, specs)
        w.write("v0", vector)
        rows = w.begin_rows("m")
        rows.add(matrix[:2].clone())
        with pytest.raises(RuntimeError, match="rows of m"):
            w.write("v1", vector) if misuse == "another tensor" else w.close()
        assert not [p for p in out.rglob("*") if p.is_file()], misuse
