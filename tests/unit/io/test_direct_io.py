"""Writing around the page cache (O_DIRECT, `io.data.direct.DirectFile`): the same bytes as buffered writes
whatever the write sizes, flushes in the middle, file systems that refuse O_DIRECT at open or at
the first write, a full disk and Ctrl-C mid-file (one-line error, no file left), the "auto"
choice, and convert/merge/reshard with --direct-io on writing exactly what they write without it."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from shardkit import Layout, convert, merge, reshard
from shardkit.cli import cli
from shardkit.io.data import direct as io_direct
from shardkit.io.data.direct import DirectFile
from shardkit.io.data.hashing import HashingFile
from shardkit.paths import NoSpaceError

MODEL = "llama-gqa64"
SMALL_CHUNK = 64 << 10  # so that the tiny models' files span many direct writes


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(io_direct, "DIRECT_CHUNK", SMALL_CHUNK)


@pytest.fixture
def direct_writes(monkeypatch):
    """Records, for every buffer DirectFile writes out, whether the descriptor had O_DIRECT."""
    seen: list[bool] = []
    original = DirectFile._write_out

    def spy(self, nbytes):
        seen.append(bool(fcntl.fcntl(self._fd, fcntl.F_GETFL) & os.O_DIRECT))
        return original(self, nbytes)

    monkeypatch.setattr(DirectFile, "_write_out", spy)
    return seen


def random_writes(seed: int, total: int) -> list[bytes]:
    rng = random.Random(seed)
    sizes = [1, 7, 4095, 4096, 4097, SMALL_CHUNK - 1, SMALL_CHUNK, SMALL_CHUNK + 1, 3 * SMALL_CHUNK + 5]
    pieces, size = [], 0
    while size < total:
        n = rng.choice(sizes) if rng.random() < 0.5 else rng.randrange(1, 2 * SMALL_CHUNK)
        pieces.append(rng.randbytes(n))
        size += n
    return pieces


@pytest.mark.parametrize("seed", range(3))
def test_any_sequence_of_writes_and_flushes_gives_the_same_bytes(seed, tmp_path, small_chunks, direct_writes):
    pieces = random_writes(seed, 20 * SMALL_CHUNK)
    rng = random.Random(seed)
    flush_at = {rng.randrange(len(pieces))} if seed else set()  # seed 0: no flush before close
    out = DirectFile(tmp_path / "f.bin")
    assert out.direct, "this file system takes O_DIRECT: the tests below rely on it"
    for i, piece in enumerate(pieces):
        assert out.write(piece) == len(piece)
        if i in flush_at:
            out.flush()  # a tail shorter than a block: the rest goes through the page cache
    out.close()
    assert (tmp_path / "f.bin").read_bytes() == b"".join(pieces)
    # around the page cache until a flush left a tail shorter than a block (then through the cache)
    assert direct_writes.count(True) >= (1 if flush_at else 10), direct_writes
    out.close()  # twice is harmless


def test_a_file_system_without_o_direct_is_written_through_the_page_cache(tmp_path, monkeypatch, small_chunks):
    """Refused at open (tmpfs says EINVAL to F_SETFL O_DIRECT), or accepted at open and refused
    at the first write (some FUSE file systems): every byte still arrives, through the cache."""
    pieces = random_writes(7, 5 * SMALL_CHUNK)
    real_fcntl = fcntl.fcntl

    def no_direct(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(io_direct.fcntl, "fcntl", no_direct)
    out = DirectFile(tmp_path / "a.bin")
    assert not out.direct
    for piece in pieces:
        out.write(piece)
    out.close()
    assert (tmp_path / "a.bin").read_bytes() == b"".join(pieces)
    monkeypatch.undo()

    real_pwrite = os.pwrite

    def refuse_direct(fd, data, offset):
        if real_fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(io_direct, "DIRECT_CHUNK", SMALL_CHUNK)
    monkeypatch.setattr(io_direct.os, "pwrite", refuse_direct)
    out = DirectFile(tmp_path / "b.bin")
    for piece in pieces:
        out.write(piece)
    out.close()
    assert not out.direct and (tmp_path / "b.bin").read_bytes() == b"".join(pieces)


@pytest.mark.parametrize("failure", ["enospc", "ctrl-c"])
def test_a_full_disk_or_ctrl_c_mid_file_leaves_nothing(failure, tmp_path, monkeypatch, small_chunks):
    """The disk fills (or Ctrl-C arrives) during a direct write: the caller gets the one-line
    NoSpaceError (or KeyboardInterrupt), and abort() removes the partial file."""
    real_pwrite = os.pwrite
    written = 0

    def failing(fd, data, offset):
        nonlocal written
        if written > 4 * SMALL_CHUNK:
            if failure == "enospc":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise KeyboardInterrupt
        n = real_pwrite(fd, data, offset)
        written += n
        return n

    monkeypatch.setattr(io_direct.os, "pwrite", failing)
    out = HashingFile(tmp_path / "out" / "x.bin", tmp_path / "out", direct=True)
    expected = NoSpaceError if failure == "enospc" else KeyboardInterrupt
    with pytest.raises(expected) as excinfo:
        for piece in random_writes(3, 20 * SMALL_CHUNK):
            out.write(piece)
        out.close()
    if failure == "enospc":
        assert "\n" not in str(excinfo.value) and "no space left" in str(excinfo.value)
    out.abort()
    assert not (tmp_path / "out" / "x.bin").exists()


def test_auto_goes_around_the_page_cache_only_past_the_dirty_limit():
    assert not io_direct.direct_io_pays(1 << 20)
    assert io_direct.direct_io_pays(1 << 50)


def sorted_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def same_output(a: Path, b: Path) -> None:
    files_a, files_b = sorted_files(a), sorted_files(b)
    assert files_a.keys() == files_b.keys()
    for name in files_a:
        if name == "shardkit.json":  # the command line differs; the listed files and digests do not
            ma, mb = json.loads(files_a[name]), json.loads(files_b[name])
            assert ma["files"] == mb["files"] and ma["tensors"] == mb["tensors"]
        else:
            assert files_a[name] == files_b[name], name


@pytest.mark.parametrize("fmt", ["torch", "xser", "safetensors"])
def test_convert_reshard_and_merge_write_the_same_bytes_around_the_page_cache(
    fmt, tiny_model, tmp_path, small_chunks, direct_writes
):
    src = tiny_model(MODEL, torch.bfloat16)
    layout, other = Layout(tp=2, pp=2, qkv="gqa"), Layout(tp=4, pp=1, qkv="gqa", kv_multiplier=2)
    for direct in (False, True):
        tag = "direct" if direct else "cached"
        convert(src, tmp_path / f"shards-{tag}", layout, format=fmt, direct_io=direct)
        reshard(tmp_path / f"shards-{tag}", tmp_path / f"other-{tag}", other, format=fmt, direct_io=direct)
        merge(tmp_path / f"other-{tag}", tmp_path / f"hf-{tag}", direct_io=direct)
        if not direct:
            assert not direct_writes
    assert direct_writes.count(True) >= 10
    for name in ("shards", "other", "hf"):
        same_output(tmp_path / f"{name}-cached", tmp_path / f"{name}-direct")


def test_cli_direct_io_option(tiny_model, tmp_path, small_chunks, direct_writes, monkeypatch):
    runner = CliRunner()
    assert "--direct-io [auto|on|off]" in runner.invoke(cli, ["convert", "--help"]).output
    src = str(tiny_model(MODEL))
    result = runner.invoke(
        cli, ["convert", src, str(tmp_path / "on"), "--to-sharded", "--tp", "2", "--direct-io", "on"]
    )
    assert result.exit_code == 0, result.output
    assert direct_writes.count(True) >= 10
    direct_writes.clear()
    result = runner.invoke(
        cli, ["convert", src, str(tmp_path / "off"), "--to-sharded", "--tp", "2", "--direct-io", "off"]
    )
    assert result.exit_code == 0 and not direct_writes
    # auto goes around the page cache past the dirty limit only; the default is off, past it too
    monkeypatch.setattr("shardkit.engine.planning.direct_io_pays", lambda nbytes: True)
    result = runner.invoke(cli, ["convert", src, str(tmp_path / "default"), "--to-sharded", "--tp", "2"])
    assert result.exit_code == 0 and not direct_writes
    result = runner.invoke(
        cli, ["convert", src, str(tmp_path / "auto"), "--to-sharded", "--tp", "2", "--direct-io", "auto"]
    )
    assert result.exit_code == 0 and direct_writes.count(True) >= 10
    bad = runner.invoke(cli, ["convert", src, str(tmp_path / "x"), "--to-sharded", "--direct-io", "sometimes"])
    assert bad.exit_code == 2 and "sometimes" in bad.output
