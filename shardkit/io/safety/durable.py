"""Small durable writes: a file and its folder entry made to survive a power cut (fsync), as
the markers of NxD's checkpoint protocol need."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: str | Path) -> None:
    """fsync a file or a folder (its entries) by path."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str | Path, text: str, fsync: bool = True) -> None:
    """Write a small new text file (see `write_bytes`), UTF-8; a name in it that is not UTF-8 (a
    path's bytes as `os.fsdecode` gives them) is written as those bytes."""
    write_bytes(path, text.encode("utf-8", "surrogateescape"), fsync)


def write_bytes(path: str | Path, data: bytes, fsync: bool = True, mode: int = 0o644) -> None:
    """Write a small new file and (with fsync) make it and its folder entry durable. An existing
    file of that name is replaced by a new one (never written into: it may have other names).
    `mode` is narrowed by the umask, as for any new file."""
    path = Path(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if fsync:
        fsync_path(path.parent)


def write_marker(folder: str | Path, name: str, fsync: bool = True) -> None:
    """NxD's marker files (`checkpoint`, `done`) hold the text "1"."""
    write_text(Path(folder) / name, "1", fsync)
