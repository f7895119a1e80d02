"""The one place that turns names read from files, repos or users into paths, safely.

Every name that comes from data (an index's weight_map, a manifest's file list, an xser tensor
id, a checkpoint tag) goes through `inside`, which refuses absolute names, `..`, and names that
resolve through a symlink to somewhere outside their folder. `overlaps` compares folders by
what they really are (resolved paths), so an alias of a source (`OTHER/../SRC`, a symlink) is
recognised. `remove_tree` never deletes through a link.
"""

from __future__ import annotations

import os
import shutil
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


def resolved(path: str | Path) -> Path:
    """The real path (symlinks and `..` resolved; a missing tail is kept as written)."""
    return Path(os.path.realpath(Path(path).expanduser()))


def overlaps(a: str | Path, b: str | Path) -> bool:
    """True when a and b are the same folder or one contains the other, after resolving links."""
    ra, rb = resolved(a), resolved(b)
    if ra == rb or ra in rb.parents or rb in ra.parents:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def is_link(path: str | Path) -> bool:
    """A symlink (or a Windows junction): something never to delete or descend through."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISLNK(st.st_mode) or bool(getattr(st, "st_reparse_tag", 0))


def remove_tree(path: str | Path) -> None:
    """Delete a folder we created, never through a link: a symlink itself is unlinked (its target
    is left alone), a folder is removed with links inside it unlinked, not followed."""
    path = Path(path)
    if is_link(path) or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path)  # symlink-attack resistant: links inside are unlinked, never followed


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


# ---- leftovers of interrupted runs (staging folders, replaced destinations) -------------------

STAGING_TAG = "shardkit-tmp"
OLD_TAG = "shardkit-old"
OWNER_FILE = ".shardkit-owner"
"""Written into every staging folder: `host pid`, so that only this host's dead runs are cleaned."""


def sibling_name(dst: str | Path, tag: str, pid: int | None = None) -> Path:
    """`.DST.<tag>-PID` beside dst: where a run stages its output or keeps the DST it replaces."""
    dst = Path(dst)
    return dst.parent / f".{dst.name}.{tag}-{os.getpid() if pid is None else pid}"


def pid_alive(pid: int) -> bool:
    """True when a process with this id runs on this host (or may: when we may not signal it)."""
    if pid <= 0:
        return True  # not a real id: never treat it as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _owner_elsewhere(folder: Path) -> str | None:
    """The other host that owns a staging folder (from its owner file), else None."""
    import socket

    try:
        host = (folder / OWNER_FILE).read_text().split()[0]
    except (OSError, IndexError):
        return None
    return None if host == socket.gethostname() else host


def write_owner(folder: str | Path) -> None:
    """Mark a staging folder as this host's and this process's."""
    import socket

    (Path(folder) / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")


def recover_interrupted(dst: str | Path, log=None) -> list[str]:
    """Repair what a killed run left beside `dst`, on this host, and say so (returns the notes).

    - `.DST.shardkit-old-PID` of a dead process and no DST: a kill between the two renames of a
      replace; the old DST is moved back into place.
    - `.DST.shardkit-old-PID` and a DST: the replace finished but the old copy was not removed;
      it is left alone (never delete data we cannot prove superseded) and named.
    - `.DST.shardkit-tmp-PID` of a dead process (of this host): a half-written staging folder;
      removed. Links are never followed nor deleted through."""
    import re

    dst = Path(dst)
    parent = dst.parent
    notes: list[str] = []
    pattern = re.compile(rf"^\.{re.escape(dst.name)}\.({STAGING_TAG}|{OLD_TAG})-(\d+)$")
    try:
        entries = sorted(os.listdir(parent))
    except OSError:
        return notes
    for entry in entries:
        match = pattern.match(entry)
        if not match:
            continue
        kind, pid = match.group(1), int(match.group(2))
        path = parent / entry
        if pid == os.getpid() or pid_alive(pid) or is_link(path) or not path.is_dir():
            continue
        if kind == OLD_TAG:
            if not os.path.lexists(dst):
                os.rename(path, dst)
                notes.append(f"restored {dst} from {path.name}: a run (process {pid}) was killed while replacing it")
            else:
                notes.append(
                    f"{path} holds the {dst.name} that an interrupted run (process {pid}) replaced: "
                    "delete it once you have checked the new one"
                )
        else:
            host = _owner_elsewhere(path)
            if host is not None:
                continue  # another host's run: its process ids mean nothing here
            remove_tree(path)
            notes.append(f"removed {path.name}, the staging folder of a run (process {pid}) that no longer runs")
    if log is not None:
        for note in notes:
            log.warning("%s", note)
    return notes
