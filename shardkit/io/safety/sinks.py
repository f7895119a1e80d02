"""Where a finished output file goes: the sink an output hands down to the writers that fill it.

An output bound for object storage is written into a local folder first (every writer works on
local files). Rather than uploading the whole folder at the end, its files are handed to the
output's sink as each one is closed, so uploading overlaps writing and the local copy holds only
the files still in flight (`io.objects.upload.StreamingUpload`, which `remote_output` gives its
caller). The sink travels with the output, never looked up by path: the caller passes it to the
staged output (`transaction.staged_output(sink=...)`, whose commit waits for it before the rename)
and to the writers (`io.data.hashing.HashingFile(sink=...)`, the formats' writers, the engine's
`WriteOptions.sink`, a training checkpoint's `SaveJob.sink`). A local output's sink is `NO_SINK`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Sink(Protocol):
    """What takes an output's finished files."""

    def closed(self, path: Path) -> None:
        """`path` (under the output's folder) is finished: nothing will write it again."""

    def drain(self) -> None:
        """Return once every file handed over is dealt with (raise the first failure)."""


class NoSink:
    """The sink of a local output: the files stay where they are written."""

    def closed(self, path: Path) -> None:
        """Nothing to do: the file is in place."""

    def drain(self) -> None:
        """Nothing is in flight."""


NO_SINK: Sink = NoSink()
