"""`shardkit.json`, the manifest shardkit writes beside every sharded directory and training
checkpoint tag: what the files are (layout, family, format, dtype, full tensor shapes) and every
file's size and sha256, so that readers can trust nothing they cannot check."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..layout import Layout
from ..version import __version__
from .base import FileRecord

MANIFEST = "shardkit.json"

HASH_BLOCK = 1 << 20
"""Bytes read at once when a file is re-hashed."""


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
        "files": [{"path": r.path, "size": r.size, "sha256": r.sha256} for r in sorted(records, key=lambda r: r.path)],
        **sections,
    }


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in large blocks into one reused buffer (no allocation, and no
    fresh pages to fault in, per block), with sequential read-ahead."""
    digest = hashlib.sha256()
    view = memoryview(bytearray(HASH_BLOCK))
    with open(path, "rb", buffering=0) as fh:
        try:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):  # not on every platform or file system
            pass
        while n := fh.readinto(view):
            digest.update(view[:n])
    return digest.hexdigest()
