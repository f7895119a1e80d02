"""The one place that turns names read from files, repos or users into paths, safely.

Every name that comes from data (an index's weight_map, a manifest's file list, an xser tensor
id, a checkpoint tag) goes through `inside`, which refuses absolute names, `..`, and names that
resolve through a symlink to somewhere outside their folder. (Comparing folders, deleting and
staging are the I/O core's: `shardkit.io`.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import ShardkitError


class UnsafePathError(ShardkitError):
    """A name read from a file, a repo or the command line would lead outside its folder."""


def _relative_parts(root: Path, text: str, what: str) -> list[str]:
    """The parts of a name that must be relative and free of `..` (else UnsafePathError)."""
    if (
        not text
        or "\x00" in text
        or PurePosixPath(text).is_absolute()
        or PureWindowsPath(text).is_absolute()
        or PureWindowsPath(text).drive
    ):
        raise UnsafePathError(f"{what} {text!r} is not a relative path inside {root}: refusing to use it")
    parts = text.replace("\\", "/").split("/")
    if any(p == ".." for p in parts):
        raise UnsafePathError(f"{what} {text!r} climbs out of {root} ('..'): refusing to use it")
    return parts


def inside(root: str | Path, name: str, what: str = "name") -> Path:
    """`root / name`, provided `name` is relative, has no `..` and stays inside `root` once
    symlinks are resolved; else UnsafePathError naming `what`."""
    root = Path(root)
    text = str(name)
    _relative_parts(root, text, what)
    path = root / text
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise UnsafePathError(f"{what} {text!r} leads outside {root} (through a symlink): refusing to use it")
    return path


def regular_file(path: str | Path, what: str = "file") -> Path:
    """`path` if it is a regular file (not a folder, FIFO, device or socket), else a clear error."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ShardkitError(f"{what} {path} does not exist") from None
    if stat.S_ISDIR(st.st_mode):
        raise ShardkitError(f"{what} {path} is a folder, not a file: remove or rename it")
    if not stat.S_ISREG(st.st_mode):
        raise ShardkitError(f"{what} {path} is not a regular file (a FIFO, device or socket): refusing to read it")
    return path


def open_regular(path: str | Path, what: str = "file") -> int:
    """A descriptor for reading `path`, refused (one-line ShardkitError) unless it is a regular
    file. Opened without blocking, then checked on the descriptor itself: a FIFO or device in its
    place (also one swapped in after an earlier check) is refused, never waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ShardkitError(f"cannot open {what} {path}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ShardkitError(f"{what} {path} is not a regular file (a FIFO, device or socket): refusing to read it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def member(root: str | Path, name: str, what: str = "name") -> Path:
    """`root / name` for a file a folder's own index names (an HF index's weight_map): like
    `inside`, the name must be relative, without `..`, and its folders must stay inside `root`;
    unlike `inside`, the file itself may be a symlink to elsewhere, as the Hub cache and
    shardkit's own mirrors link every file to a blob outside the snapshot folder."""
    root = Path(root)
    text = str(name)
    parts = _relative_parts(root, text, what)
    if parts[-1] in ("", "."):
        raise UnsafePathError(f"{what} {text!r} does not name a file inside {root}: refusing to use it")
    folder = "/".join(p for p in parts[:-1] if p not in ("", "."))
    if folder:
        try:
            inside(root, folder, what)
        except UnsafePathError:
            raise UnsafePathError(
                f"{what} {text!r} leads outside {root} (through a linked folder): refusing to use it"
            ) from None
    return root / text


class NoSpaceError(ShardkitError):
    """The file system that should hold an output has no room left for it."""


def free_space(folder: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system holding `folder` (None when
    it cannot be told, e.g. on a platform without statvfs)."""
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def no_space_error(folder: str | Path, needed: int, free: int | None = None) -> NoSpaceError:
    """The one-line error for a full disk (or an exhausted quota) under `folder`."""
    from .sizes import format_bytes

    free = free_space(folder) if free is None else free
    have = "unknown" if free is None else format_bytes(free)
    return NoSpaceError(
        f"no space left on {folder} (needed {format_bytes(needed)}, free {have}): "
        "free some space there or write somewhere else"
    )


def ensure_free_space(folder: str | Path, needed: int, reclaimed: int = 0) -> None:
    """Refuse early (NoSpaceError) when the file system under `folder` has less than `needed`
    bytes free; `reclaimed` counts bytes the write will free (a file it replaces)."""
    free = free_space(folder)
    if free is not None and free + reclaimed < needed:
        raise no_space_error(folder, needed, free + reclaimed)
