"""Deleting, the one way shardkit does it: never through a link, never across a mount point.

A folder is removed by walking it through descriptors (each subfolder opened relative to its
parent, without following links, and checked to be the entry just listed), so a folder swapped
for a symlink mid-walk is never followed. A mount point inside the tree (a bind mount of another
folder, a tmpfs, another disk) is never entered: the whole removal is refused before anything is
deleted, since deleting "a tag" must not delete the files of whatever is mounted into it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from ...errors import ShardkitError
from .oserror import shown

log = logging.getLogger(__name__)


class DeleteRefusedError(ShardkitError):
    """A deletion that would reach beyond the folder shardkit owns (a mount point inside it)."""


def is_link(path: str | Path) -> bool:
    """A symlink (or a Windows junction): something never to delete or descend through."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISLNK(st.st_mode) or bool(getattr(st, "st_reparse_tag", 0))


def _unescape(field: str) -> str:
    """A path as /proc/self/mountinfo writes it (space, tab, newline, backslash octal-escaped)."""
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_points() -> list[str]:
    """Every mount point of this process's mount namespace (empty where /proc is not there)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    points = []
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4:
            points.append(_unescape(fields[4]))
    return points


def mounts_inside(path: str | Path) -> list[str]:
    """The mount points strictly inside `path` (its real path), or at it when `path` itself is a
    mount point that is not its parent's file system root."""
    real = os.path.realpath(path)
    prefix = real.rstrip(os.sep) + os.sep
    found = [p for p in mount_points() if p.startswith(prefix)]
    if real in mount_points() and real != os.sep:
        found.insert(0, real)
    return found


def refuse_mounts(path: str | Path, what: str = "delete") -> None:
    """DeleteRefusedError when a mount point sits inside `path` (or is `path`)."""
    inside = mounts_inside(path)
    if inside:
        raise DeleteRefusedError(
            f"refusing to {what} {shown(path)}: {shown(inside[0])} is a mount point inside it "
            "(deleting it would delete the files of whatever is mounted there): unmount it first"
        )


def remove_file(path: str | Path) -> None:
    """Unlink one file or link (a link's target is never touched); a missing file is fine."""
    path = Path(path)
    _unlink_entry(None, str(path), path)


def _unlink_entry(dir_fd: int | None, name: str, path: Path) -> None:
    """Unlink `name` (relative to `dir_fd`, else a path); `path` is what it is called in messages.
    Every file shardkit deletes goes through here."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def remove_tree(path: str | Path) -> None:
    """Delete `path`: a link or file is unlinked (a link's target left alone); a folder is
    removed with everything in it, links inside unlinked, never followed, and never across a mount
    point (DeleteRefusedError, before anything is deleted). A missing path is fine."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        remove_file(path)
        return
    refuse_mounts(path)
    parent_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _remove_entry(parent_fd, path.name, st.st_dev, path)
    finally:
        os.close(parent_fd)


def _open_dir(parent_fd: int, name: str, expected: os.stat_result) -> int | None:
    """`name` in `parent_fd` opened as a folder, provided it is still the folder listed (no link,
    same device and inode); None when it is gone or was swapped."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # it became a link
            return None
        raise
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (expected.st_dev, expected.st_ino):
        os.close(fd)
        return None
    return fd


def _entries(fd: int) -> Iterator[str]:
    with os.scandir(fd) as it:
        names = [e.name for e in it]
    yield from names


def _remove_entry(parent_fd: int, name: str, device: int, shown_path: Path) -> None:
    """Remove `name` of `parent_fd` (a folder: its content first), staying on `device`."""
    try:
        st = os.lstat(name, dir_fd=parent_fd)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        _unlink_entry(parent_fd, name, shown_path)
        return
    if st.st_dev != device:
        raise DeleteRefusedError(
            f"refusing to delete {shown(shown_path)}: it is on another file system (a mount point): unmount it first"
        )
    fd = _open_dir(parent_fd, name, st)
    if fd is None:  # gone or swapped for something else while we walked: unlink what is there now
        try:
            if not stat.S_ISDIR(os.lstat(name, dir_fd=parent_fd).st_mode):
                _unlink_entry(parent_fd, name, shown_path)
        except FileNotFoundError:
            pass
        return
    try:
        for child in _entries(fd):
            _remove_entry(fd, child, device, shown_path / child)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except FileNotFoundError:
        pass
