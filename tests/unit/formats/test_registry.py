"""Each format's registry entry declares what its writer takes besides whole tensors
(`registry.Abilities`), and the engine reads that instead of probing writers. These tests hold
every entry's declarations to what its writer does, both ways: a declared ability is taken and
writes the bytes `write` writes; an undeclared one is not offered (the entry gives no such
writer, and the writer has no such method, so a stale declaration cannot hide)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from shardkit.formats import torch_io
from shardkit.formats.base import TensorSpec
from shardkit.formats.registry import FORMATS, Format
from shardkit.formats.torch_zip import ARCHIVE
from shardkit.io.data.copy import FileRange
from shardkit.io.data.digest import Recording
from shardkit.io.data.taps import OpenFile
from shardkit.io.safety.sinks import NO_SINK

MATRIX = torch.arange(6 * 4, dtype=torch.bfloat16).reshape(6, 4)
VECTOR = torch.arange(3, dtype=torch.float32)
SPECS = [TensorSpec("m", (6, 4), torch.bfloat16), TensorSpec("v", (3,), torch.float32)]
BLOCKS = (slice(0, 1), slice(1, 5), slice(5, 6))

ABILITIES = {"copy": "kernel_copies", "rows": "row_streaming", "chunks": "chunked_writes"}
"""How the matrix is written -> the ability that way needs."""

METHODS = {"copy": "write_copy", "rows": "begin_rows", "chunks": "write_chunks"}
"""How the matrix is written -> the writer method that way calls."""


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _write(fmt: Format, out: Path, how: str, source: Path) -> dict[str, bytes]:
    """One rank file of SPECS, its matrix written `how`; every file written under `out`."""
    writer = fmt.writer(out / f"r{fmt.suffix}", out, SPECS, [], Recording.FAST, False, NO_SINK, ARCHIVE)
    if how == "write":
        writer.write("m", MATRIX)
    elif how == "copy":
        copying = fmt.copying(writer)
        assert copying is writer
        fd = os.open(source, os.O_RDONLY)
        try:  # the matrix's bytes, in two ranges of a source file
            copying.write_copy(
                "m", [FileRange(OpenFile(fd), 100, 20, "source"), FileRange(OpenFile(fd), 120, 28, "source")]
            )
        finally:
            os.close(fd)
    elif how == "rows":
        streaming = fmt.streaming(writer)
        assert streaming is writer
        rows = streaming.begin_rows("m")
        for block in BLOCKS:
            rows.add(MATRIX[block].clone())
        rows.end()
    else:
        chunked = fmt.chunked(writer)
        assert chunked is writer
        chunked.write_chunks("m", (MATRIX[block].clone() for block in BLOCKS), owned=True)
    writer.write("v", VECTOR)
    records = writer.close()
    assert sorted(r.path for r in records) == sorted(_files(out))
    return _files(out)


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_formats_declared_abilities_are_what_its_writer_does(name, tmp_path):
    fmt = FORMATS[name]
    source = tmp_path / "source.bin"
    source.write_bytes(b"\0" * 100 + MATRIX.view(torch.uint8).numpy().tobytes())
    whole = _write(fmt, tmp_path / "write", "write", source)
    for how, ability in ABILITIES.items():
        if getattr(fmt.abilities, ability):
            assert _write(fmt, tmp_path / how, how, source) == whole, (name, how)
            continue
        writer = fmt.writer(
            tmp_path / how / f"r{fmt.suffix}", tmp_path / how, SPECS, [], Recording.FAST, False, NO_SINK, ARCHIVE
        )
        try:
            accessor = {"copy": fmt.copying, "rows": fmt.streaming, "chunks": fmt.chunked}[how]
            assert accessor(writer) is None, (name, how)
            assert not hasattr(writer, METHODS[how]), f"{name} writes {METHODS[how]} but its entry omits {ability}"
        finally:
            writer.abort()


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if f.abilities.kernel_copies and n != "safetensors"])
def test_a_file_that_cannot_copy_or_stream_says_so_and_is_written_whole(name, tmp_path, monkeypatch):
    """Where torch's own zip writer writes an archive (4 GiB or more; forced here), the format's
    entry still declares copies and row streaming, the file refuses them (`can_copy`,
    `can_stream_rows`), and the entry then gives no such writer: the engine writes it whole."""
    fmt = FORMATS[name]
    source = tmp_path / "source.bin"
    source.write_bytes(b"\0" * 100 + MATRIX.view(torch.uint8).numpy().tobytes())
    native = _write(fmt, tmp_path / "native", "write", source)
    monkeypatch.setattr(torch_io, "native_writer", lambda records, bound: False)
    writer = fmt.writer(
        tmp_path / "torch" / f"r{fmt.suffix}", tmp_path / "torch", SPECS, [], Recording.FAST, False, NO_SINK, ARCHIVE
    )
    try:
        assert fmt.copying(writer) is None and fmt.streaming(writer) is None
    finally:
        writer.abort()
    assert _write(fmt, tmp_path / "torch", "write", source) == native
