"""A file whose size is known in advance gets its disk blocks reserved before it is written
(`io.data.direct.preallocate`): the blocks are there before the first write, blocks reserved past what was
written are freed at close, a full disk is refused before anything is written, and a file system
without reservations is written as before."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest

from shardkit.io.data import direct as io_direct
from shardkit.io.data import hashing
from shardkit.io.data.hashing import HashingFile
from shardkit.paths import NoSpaceError

MiB = 1 << 20


def _allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def _reserves(tmp_path) -> bool:
    """Whether this file system takes reservations (ext4, xfs, btrfs and tmpfs do)."""
    probe = tmp_path / "probe"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        return io_direct.preallocate(fd, MiB)
    finally:
        os.close(fd)
        probe.unlink()


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "direct-io"])
def test_blocks_are_reserved_before_the_first_write_and_the_rest_freed_at_close(tmp_path, direct):
    if not _reserves(tmp_path):
        pytest.skip("this file system offers no fallocate reservation")
    path = tmp_path / "out.bin"
    out = HashingFile(path, tmp_path, expected_size=8 * MiB, direct=direct)
    assert os.stat(path).st_size == 0  # the size is kept: only blocks are reserved
    assert _allocated(path) >= 8 * MiB
    data = os.urandom(MiB + 123)
    out.write(data)
    record = out.close()
    assert record.size == len(data) == os.stat(path).st_size
    assert path.read_bytes() == data
    assert _allocated(path) < 2 * MiB  # the 6+ MiB reserved past the end were given back


def test_a_full_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    def full(fd: int, nbytes: int) -> bool:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(hashing, "preallocate", full)
    path = tmp_path / "out.bin"
    with pytest.raises(NoSpaceError) as info:
        HashingFile(path, tmp_path, expected_size=4 * MiB)
    assert "\n" not in str(info.value)
    assert not path.exists()  # nothing half-written is left


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_no_reservation_where_the_file_system_offers_none(tmp_path, monkeypatch, code):
    """fallocate refused: nothing is reserved and nothing written (never glibc's zero-filling
    fallback), and the file is written as before."""
    calls = []

    def refusing(fd, mode, offset, nbytes):
        calls.append((mode, offset, nbytes))
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(io_direct, "_FALLOCATE", refusing)
    fd = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        assert io_direct.preallocate(fd, 4 * MiB) is False
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
    assert calls == [(io_direct.FALLOC_FL_KEEP_SIZE, 0, 4 * MiB)]
    path = tmp_path / "out.bin"
    out = HashingFile(path, tmp_path, expected_size=4 * MiB)
    out.write(b"abc")
    assert out.close().size == 3
    assert path.read_bytes() == b"abc"


def test_other_fallocate_errors_are_raised(tmp_path, monkeypatch):
    def failing(fd, mode, offset, nbytes):
        ctypes.set_errno(errno.EDQUOT)
        return -1

    monkeypatch.setattr(io_direct, "_FALLOCATE", failing)
    fd = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        with pytest.raises(OSError) as info:
            io_direct.preallocate(fd, MiB)
        assert info.value.errno == errno.EDQUOT
    finally:
        os.close(fd)
