"""Where an output file goes once it is finished: a hook on every file the I/O core closes.

An output bound for object storage is written into a local folder first (every writer works on
local files). Rather than uploading the whole folder at the end, its files are handed to a sink
as each one is closed (`io.data.hashing.HashingFile.close` calls `closed`), so uploading overlaps
writing and the local copy holds only the files still in flight (`io.objects.upload.StreamingUpload`).
The staged output's commit waits for the sink (`drain`) before it renames the staging folder.
Without a registered sink (every local output) both calls return at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol


class Sink(Protocol):
    def closed(self, path: Path) -> None:
        """`path` (under the sink's folder) is finished: nothing will write it again."""

    def drain(self) -> None:
        """Return once every file handed over is dealt with (raise the first failure)."""


_SINKS: dict[Path, Sink] = {}
_LOCK = threading.Lock()


@contextlib.contextmanager
def registered(folder: Path, sink: Sink) -> Iterator[None]:
    """Files closed under `folder` while the block runs are handed to `sink`."""
    folder = Path(folder).absolute()
    with _LOCK:
        _SINKS[folder] = sink
    try:
        yield
    finally:
        with _LOCK:
            _SINKS.pop(folder, None)


def _sink_of(path: Path) -> Sink | None:
    if not _SINKS:
        return None
    path = Path(path).absolute()
    with _LOCK:
        return next((sink for folder, sink in _SINKS.items() if folder in path.parents), None)


def closed(path: Path) -> None:
    """A writer closed `path` for good (nothing happens outside a registered folder)."""
    sink = _sink_of(path)
    if sink is not None:
        sink.closed(Path(path).absolute())


def drain(folder: Path) -> None:
    """Wait for the sink of the registered folder holding `folder`, if any (before a commit)."""
    sink = _sink_of(Path(folder) / "x")
    if sink is not None:
        sink.drain()
