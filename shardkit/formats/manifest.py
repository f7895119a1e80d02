"""`shardkit.json`, the manifest shardkit writes beside every sharded directory and training
checkpoint tag: what the files are (layout, family, format, dtype, full tensor shapes) and every
file's size and sha256, so that readers can trust nothing they cannot check."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..layout import Layout
from ..version import __version__
from .base import FileRecord

MANIFEST = "shardkit.json"

HASH_BLOCK = 4 << 20
"""Bytes read at once when a file is re-hashed."""


def manifest(*, fmt: str, family: str, layout: Layout, dtype: str | None, records: Sequence[FileRecord],
             tensors: Mapping[str, Sequence[int]], source: str | None = None, command: str | None = None,
             **sections: Any) -> dict[str, Any]:
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
        "files": [{"path": r.path, "size": r.size, "sha256": r.sha256}
                  for r in sorted(records, key=lambda r: r.path)],
        **sections,
    }


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in large blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()
