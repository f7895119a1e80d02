"""The digests shardkit records and checks (shardkit/io/data/digest.py): the same values as hashlib
and xxhash over the file's bytes whichever way the file is read, and the check's choice of digest."""

from __future__ import annotations

import hashlib
import mmap
import os

import pytest
import xxhash

from shardkit.io.data import digest
from shardkit.io.data.digest import NoSha256Error, check_mode, expected_digest, file_digests, file_matches
from shardkit.io.data.taps import OpenFile


def expected(data: bytes) -> tuple[str, str]:
    return hashlib.sha256(data).hexdigest(), xxhash.xxh3_128_hexdigest(data)


@pytest.mark.parametrize("size", [0, 1, 4095, 3 * 65536, 3 * 65536 + 17])
def test_digests_across_window_boundaries(tmp_path, monkeypatch, size):
    monkeypatch.setattr(digest, "HASH_WINDOW", 65536)  # many windows, one partial at the end
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    assert file_digests(tmp_path / "f", sha256=True) == expected(data)
    assert file_digests(tmp_path / "f") == (None, expected(data)[1])


def test_a_file_that_cannot_be_mapped_is_read_instead(tmp_path, monkeypatch):
    data = os.urandom(300_000)
    (tmp_path / "f").write_bytes(data)

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # what a file system without mmap says

    monkeypatch.setattr(mmap, "mmap", refuse)
    assert file_digests(tmp_path / "f", sha256=True) == expected(data)


def test_a_file_that_shrinks_while_hashed_is_an_error_not_a_crash(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "HASH_WINDOW", 65536)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(4 * 65536))
    real = xxhash.xxh3_128
    shrunk = []

    class Shrinking:  # truncates the file after the first window is hashed
        def __init__(self):
            self.inner = real()

        def update(self, data):
            self.inner.update(data)
            if not shrunk:
                shrunk.append(True)
                os.truncate(path, 65536)

        def hexdigest(self):
            return self.inner.hexdigest()

    monkeypatch.setattr(digest.xxhash, "xxh3_128", Shrinking)
    with pytest.raises(OSError, match="shrank"):
        file_digests(path)


def test_the_check_compares_the_digest_it_names(tmp_path):
    data = os.urandom(1000)
    (tmp_path / "f").write_bytes(data)
    sha, fast = expected(data)
    entry = {"path": "f", "size": 1000, "sha256": sha, "xxh3_128": fast}
    assert file_matches(tmp_path / "f", entry, "fast") and file_matches(tmp_path / "f", entry, "sha256")
    assert not file_matches(tmp_path / "f", {**entry, "xxh3_128": "0" * 32}, "fast")
    assert file_matches(tmp_path / "f", {**entry, "xxh3_128": "0" * 32}, "sha256")
    assert not file_matches(tmp_path / "f", {**entry, "sha256": "0" * 64}, "sha256")
    assert not file_matches(tmp_path / "f", {**entry, "size": 999}, "fast")
    older = {"path": "f", "size": 1000, "sha256": sha}  # a manifest from before the fast digest
    assert expected_digest(older, "fast") == ("sha256", sha)
    assert not file_matches(tmp_path / "f", {**older, "sha256": "0" * 64}, "fast")
    newer = {"path": "f", "size": 1000, "xxh3_128": fast}  # written without --sha256 (the default)
    assert file_matches(tmp_path / "f", newer, "fast")
    with pytest.raises(NoSha256Error, match="lists no sha256 for f .*--sha256"):
        file_matches(tmp_path / "f", newer, "sha256")
    with pytest.raises(KeyError):  # neither digest: malformed, and callers say so
        expected_digest({"path": "f", "size": 1000}, "sha256")


@pytest.mark.parametrize(
    "value,mode",
    [(True, "fast"), ("fast", "fast"), ("sha256", "sha256"), (False, "none"), (None, "none"), ("none", "none")],
)
def test_check_modes(value, mode):
    assert check_mode(value) == mode


def test_an_unknown_check_mode_is_refused():
    with pytest.raises(ValueError, match="verify_hashes"):
        check_mode("md5")


def test_only_outputs_a_manifest_lists_are_hashed(tiny_model, tmp_path):
    """convert's records carry xxh3-128 (its manifest lists it), and sha256 too with sha256=True;
    merge writes a Hugging Face folder, which has no manifest, so its files are not hashed: same
    bytes, digests None."""
    import json

    from safetensors.torch import load_file

    from shardkit import Layout, convert, merge

    src = tiny_model("llama-mha")
    for sha256 in (False, True):
        out = tmp_path / f"tp2-{sha256}"
        converted = convert(src, out, Layout(tp=2), sha256=sha256)
        listed = {e["path"]: e for e in json.loads((out / "shardkit.json").read_text())["files"]}
        for record in converted.files:
            sha, fast = expected((out / record.path).read_bytes())
            assert (record.sha256, record.xxh3_128) == (sha if sha256 else None, fast)
            assert listed[record.path]["xxh3_128"] == fast
            assert listed[record.path].get("sha256") == (sha if sha256 else None)
    merged = merge(tmp_path / "tp2-True", tmp_path / "hf", sha256=True)
    assert merged.files and all(r.sha256 is None and r.xxh3_128 is None for r in merged.files)
    for record in merged.files:
        assert (tmp_path / "hf" / record.path).stat().st_size == record.size
    original = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    again = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert original.keys() == again.keys() and all(original[k].equal(again[k]) for k in original)


def test_a_record_without_digests_cannot_enter_a_manifest():
    from shardkit.formats.manifest import file_entry
    from shardkit.io.data.digest import FileRecord

    with pytest.raises(ValueError, match="without digests"):
        file_entry(FileRecord("model/x.pt", 10, None))


def test_a_fifo_is_refused_not_waited_on(tmp_path):
    """A FIFO where a listed file should be (e.g. swapped in by a second process after the
    manifest's entries were checked) is refused at once: a plain open would block for ever."""
    from shardkit.errors import ShardkitError

    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ShardkitError, match="not a regular file"):
        file_digests(fifo)


def _checked_file(tmp_path, data: bytes):
    from shardkit.formats.source_check import _FileCheck

    path = tmp_path / "f"
    path.write_bytes(data)
    entry = {"path": "f", "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    return path, _FileCheck(path, "f", entry, "fast")


def _read(path, offset: int, count: int) -> tuple[int, memoryview]:
    fd = os.open(path, os.O_RDONLY)
    return fd, memoryview(os.pread(fd, count, offset))


def test_the_check_on_read_hashes_reads_in_order_and_fills_small_gaps(tmp_path, monkeypatch):
    """Reads that continue the digest feed it; a small jump is filled by reading the bytes
    between; reads behind it change nothing; finish() hashes the tail: the digest of the file."""
    from shardkit.formats import source_check

    monkeypatch.setattr(source_check, "SMALL_GAP", 1000)
    data = os.urandom(10_000)
    path, check = _checked_file(tmp_path, data)
    for offset, count in [(100, 400), (800, 200), (0, 50), (1000, 3000), (3500, 1000)]:
        fd, view = _read(path, offset, count)
        try:
            assert check.feed(OpenFile(fd), offset, view)
        finally:
            os.close(fd)
    assert check.upto == 4500
    assert check.finish()


@pytest.mark.parametrize("where", ["fed", "gap", "skipped", "tail"])
def test_the_check_on_read_sees_a_change_anywhere(tmp_path, monkeypatch, where):
    """A changed byte is caught whether it came in through a read, a filled gap, the part left
    after a jump too long to fill (the file is then hashed by reading it), or the tail."""
    from shardkit.formats import source_check

    monkeypatch.setattr(source_check, "SMALL_GAP", 1000)
    data = os.urandom(10_000)
    path, check = _checked_file(tmp_path, data)
    changed = bytearray(data)
    changed[{"fed": 10, "gap": 300, "skipped": 3000, "tail": 9999}[where]] ^= 1
    path.write_bytes(bytes(changed))
    fd, view = _read(path, 0, 200)
    try:
        assert check.feed(OpenFile(fd), 0, view)
        fd2, view2 = _read(path, 500, 100)  # a gap of 300 bytes: filled
        assert check.feed(OpenFile(fd2), 500, view2)
        os.close(fd2)
        fd3, view3 = _read(path, 5000, 100)  # 4400 bytes ahead: not filled, the file is handed on
        assert not check.feed(OpenFile(fd3), 5000, view3)
        os.close(fd3)
    finally:
        os.close(fd)
    assert not check.finish()


def test_the_check_on_read_sees_a_file_that_grew(tmp_path):
    data = os.urandom(5000)
    path, check = _checked_file(tmp_path, data)
    path.write_bytes(data + b"x")
    assert not check.finish()


def test_a_read_past_bytes_a_later_output_reads_is_dropped_and_read_again_later(tmp_path, monkeypatch):
    """A read that jumps over more bytes that only a later output file reads (a later place in
    the plan) than the reads under way have left to feed is not fed: the digest waits, and reads
    the dropped bytes again once the later reads have brought it there. A gap the reads under way
    outweigh is read at once. The digest is the file's either way, and a changed byte in a dropped
    range is still caught."""
    from shardkit.formats import source_check

    monkeypatch.setattr(source_check, "FILL_GAP", 0)
    data = os.urandom(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    entry = {"path": "f", "size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}
    reached = [1]
    # place 0: [3000, 4000) read now; place 1: [0, 3000) and [4000, 10000) read later
    planned = [(0, 3000, 1), (3000, 4000, 0), (4000, 10_000, 1)]

    def feed(check, offset, count):
        fd, view = _read(path, offset, count)
        try:
            assert check.feed(OpenFile(fd), offset, view)
        finally:
            os.close(fd)

    check = source_check._FileCheck(path, "f", entry, "fast", planned, lambda: reached[0])
    feed(check, 3000, 1000)  # 3000 later bytes before it, 1000 under way: dropped
    assert check.upto == 0
    reached[0] = 2
    feed(check, 0, 3000)
    assert check.upto == 3000
    feed(check, 4000, 6000)  # the dropped range is read again on the way
    assert check.upto == 10_000
    assert check.finish()

    reached[0] = 1
    check = source_check._FileCheck(path, "f", entry, "fast", [(0, 500, 1), (500, 4000, 0)], lambda: reached[0])
    feed(check, 500, 3500)  # 500 later bytes, 3500 under way: the gap is read now
    assert check.upto == 4000
    assert check.finish()

    changed = bytearray(data)
    changed[3500] ^= 1  # inside the dropped read
    path.write_bytes(bytes(changed))
    reached[0] = 1
    check = source_check._FileCheck(path, "f", entry, "fast", planned, lambda: reached[0])
    feed(check, 3000, 1000)
    reached[0] = 2
    feed(check, 0, 3000)
    feed(check, 4000, 6000)
    assert not check.finish()
