"""A reader's tap, read-ahead source and watch are state of the file it has open (`io.data.taps.OpenFile`),
never of its path or of a descriptor number."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from shardkit.formats.safetensors_io import SafetensorsFile
from shardkit.io.data import taps


def _recorder(seen: list[tuple[int, int]]):
    def tap(file: taps.OpenFile, offset: int, view: memoryview) -> None:
        seen.append((offset, len(view)))

    return tap


def test_two_readers_of_one_path_each_get_only_their_own_tap(tmp_path):
    """Two readers of the same file, each tapped by its own check: each tap sees only its reader's
    reads (positional reads and the ranges a copy feeds), and a reader opened after one closed
    (on the descriptor number the closed one had) inherits neither tap, source nor watch."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(64, dtype=torch.float32), "b": torch.ones(4, 8)}, str(path))
    first, second = SafetensorsFile(path), SafetensorsFile(path)
    seen_first: list[tuple[int, int]] = []
    seen_second: list[tuple[int, int]] = []
    first.tap(lambda p: _recorder(seen_first))
    second.tap(lambda p: _recorder(seen_second))
    served: list[int] = []

    def serve(fd: int, view: memoryview, offset: int, what: str) -> bool:
        served.append(offset)
        return False  # holds none of them: read from the file

    second.read_from(lambda st: serve)
    assert second.watch() is not None

    a = first.read("a", 0, 0, 16)
    b = second.read("b")
    assert torch.equal(a, torch.arange(16, dtype=torch.float32)) and torch.equal(b, torch.ones(4, 8))
    a_offset = first.span("a")[0]
    b_offset = second.span("b")[0]
    assert seen_first == [(a_offset, 16 * 4)]
    assert seen_second == [(b_offset, 4 * 8 * 4)]
    assert served == [b_offset]

    copied = first.byte_range("a", 0, 16, 32)  # a kernel copy's range carries its reader's tap
    assert copied is not None and copied.file.tap is not None and not copied.file.watched
    assert second.byte_range("b") is None  # served by the read-ahead: never copied by the kernel
    taps._feed_taps([copied])
    assert seen_first == [(a_offset, 64), (a_offset + 64, 64)] and len(seen_second) == 1

    number = copied.fd
    first.close()
    with pytest.raises(ValueError):
        copied.fd  # noqa: B018 - a closed file's range never reads a reused descriptor number
    third = SafetensorsFile(path)
    try:
        assert third._open_file.fd == number  # the lowest free number: the one `first` had
        opened = third._open_file
        assert opened.tap is None and opened.source is None and not opened.watched
        assert torch.equal(third.read("a"), torch.arange(64, dtype=torch.float32))
        range_of_third = third.byte_range("a")
        assert range_of_third is not None
        taps._feed_taps([range_of_third])
    finally:
        third.close()
        second.close()
    assert len(seen_first) == 2 and len(seen_second) == 1 and served == [b_offset]
    with pytest.raises(OSError):
        os.fstat(number)  # closed with its reader
