"""Whether a destination and a source are the same folder, or one holds the other.

Compared by what the folders are, not by how they are spelled: each path's real path (symlinks
and `..` resolved, `/proc/self/fd/N` too) and then the device and inode of it and of every
ancestor. A bind mount (`mount --bind P A`: `A/inner` is `P/inner` under another name) or any
other alias has another real path but the same device and inode, so it is caught where a
comparison of path strings would let `convert P/inner/src A/inner --overwrite` delete its source.
"""

from __future__ import annotations

import os
from pathlib import Path

Identity = tuple[int, int]


def resolved(path: str | Path) -> Path:
    """The real path (symlinks and `..` resolved; a missing tail is kept as written)."""
    return Path(os.path.realpath(Path(path).expanduser()))


def identity(path: str | Path) -> Identity | None:
    """(device, inode) of what `path` names, following links; None when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def lineage(path: str | Path) -> list[Identity]:
    """The identities of `path` (when it exists) and of each existing ancestor of its real path,
    nearest first."""
    real = resolved(path)
    found = []
    for folder in (real, *real.parents):
        ident = identity(folder)
        if ident is not None:
            found.append(ident)
    return found


def overlaps(a: str | Path, b: str | Path) -> bool:
    """True when `a` and `b` are the same file or folder, or one is inside the other, by real
    path or by device and inode (bind mounts and other aliases included)."""
    ra, rb = resolved(a), resolved(b)
    if ra == rb or ra in rb.parents or rb in ra.parents:
        return True
    ida, idb = identity(ra), identity(rb)
    return (ida is not None and ida in lineage(rb)) or (idb is not None and idb in lineage(ra))


def inside_of(path: str | Path, folder: str | Path) -> bool:
    """True when `path` is `folder` or lies inside it (by real path, or device and inode)."""
    rp, rf = resolved(path), resolved(folder)
    if rp == rf or rf in rp.parents:
        return True
    idf = identity(rf)
    return idf is not None and idf in lineage(rp)
