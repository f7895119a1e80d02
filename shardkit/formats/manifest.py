"""`shardkit.json`, the manifest shardkit writes beside every sharded directory and training
checkpoint tag: what the files are (layout, family, format, dtype, full tensor shapes) and every
file's size, sha256 and xxh3-128 (see `digest`), so that readers can trust nothing they cannot check."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..io.data import digest
from ..io.data.digest import BLOCKS_KEY, FAST_DIGEST, Digests, FileRecord, feed_file
from ..layout import Layout
from ..version import __version__

MANIFEST = "shardkit.json"


def manifest(
    *,
    fmt: str,
    family: str,
    layout: Layout,
    dtype: str | None,
    records: Sequence[FileRecord],
    tensors: Mapping[str, Sequence[int]],
    source: str | None = None,
    command: str | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """The manifest of a sharded directory (extra `sections`, e.g. a training checkpoint's)."""
    return {
        "shardkit": __version__,
        "kind": "sharded",
        "format": fmt,
        "family": family,
        "layout": layout.to_dict(),
        "dtype": dtype,
        "source": source,
        "command": command,
        "tensors": {n: list(s) for n, s in tensors.items()},
        "files": [file_entry(r) for r in sorted(records, key=lambda r: r.path)],
        **sections,
    }


def file_entry(record: FileRecord) -> dict[str, Any]:
    """A manifest's entry for one file: path, size and the digests the record has."""
    if record.sha256 is None and record.xxh3_128 is None:
        raise ValueError(f"{record.path} was written without digests: it cannot be listed in a manifest")
    entry: dict[str, Any] = {"path": record.path, "size": record.size}
    if record.sha256 is not None:
        entry["sha256"] = record.sha256
    if record.xxh3_128 is not None:
        entry[FAST_DIGEST] = record.xxh3_128
    if record.blocks is not None:
        entry[BLOCKS_KEY] = list(record.blocks)
        entry["block_size"] = digest.BLOCK_SIZE
    return entry


def file_record(path: Path, root: Path, sha256: bool = False) -> FileRecord:
    """The record of a file already written (one read: xxh3-128, and sha256 when asked for)."""
    digests = Digests(sha256)
    feed_file(path, digests)
    return FileRecord(
        path.relative_to(root).as_posix(), path.stat().st_size, *digests.hexdigests(), digests.block_digests()
    )
