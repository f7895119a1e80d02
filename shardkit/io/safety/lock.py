"""One writer per folder: an flock on a lock file, opened so that it can never be turned against
the user's files.

A checkpoint folder keeps its lock file (`.shardkit.lock`, NxD's tree gains one hidden file);
an output folder being produced is locked through `.DST.shardkit-lock` beside it, removed when
the transaction ends. The lock file is opened without following a link and without truncating,
and refused unless it is a regular file with a single name: `ln victim CK/.shardkit.lock` must
not let shardkit write the holder's name into `victim`. The kernel releases the lock when its
holder dies, so a stale lock file never blocks anyone.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import sys
from pathlib import Path

from ...errors import ShardkitError
from .oserror import disk_error, shown

log = logging.getLogger(__name__)

LOCK_FILE = ".shardkit.lock"
"""The lock file inside a checkpoint folder; holds the holder's pid, host and command."""

DESTINATION_LOCK = "shardkit-lock"
"""`.DST.shardkit-lock` beside an output folder while it is produced."""


class FolderInUseError(ShardkitError):
    """Another process is writing the same folder."""


class FolderLock:
    """An exclusive flock held on an open lock file. `release()` is idempotent; with `remove`,
    the lock file is unlinked first (while still held, so no third process can take a lock on
    the name that a second one is about to lose)."""

    def __init__(self, path: Path, fd: int | None, remove: bool = False):
        self.path = path
        self._fd = fd
        self._remove = remove

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._remove and _same_file(self.path, fd):
                os.unlink(self.path)
            else:
                os.ftruncate(fd, 0)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicit: a forked child may share this open file
        finally:
            os.close(fd)

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _same_file(path: Path, fd: int) -> bool:
    try:
        a, b = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def holder_text(fd: int) -> str:
    """Who holds a lock, as the lock file says (one line, whatever it holds)."""
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or not info:
        return "another process (it has not written its pid yet)"
    text = f"pid {info.get('pid', '?')} on host {info.get('host', '?')}"
    extra = [str(info[k]) for k in ("what",) if info.get(k)]
    if info.get("since"):
        extra.append(f"since {info['since']}")
    if info.get("command"):
        extra.append(f"command: {info['command']}")
    text += f" ({'; '.join(extra)})" if extra else ""
    return shown(" ".join(text.split()))


def _open_lock_file(path: Path) -> int:
    """The lock file's descriptor: created if missing, never through a link, never truncated,
    and only when it is a regular file with one name (else a one-line error)."""
    flags = os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        try:
            fd = os.open(path, os.O_RDWR | flags, 0o644)
        except PermissionError:  # another user's lock file: lock it read-only (holder not named)
            fd = os.open(path, os.O_RDONLY | flags)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise ShardkitError(
                f"{shown(path)} is a symlink: remove it (shardkit's lock file is never followed)"
            ) from None
        raise disk_error(e, "open the lock file", path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ShardkitError(f"{shown(path)} is not a regular file: remove it (it is shardkit's lock file)")
        if st.st_nlink != 1:
            raise ShardkitError(
                f"{shown(path)} has {st.st_nlink} names (a hard link to another file): remove it; "
                "shardkit never writes into a file that has other names"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_folder(
    folder: str | Path,
    what: str,
    *,
    name: str | None = None,
    remove: bool = False,
    error: type[ShardkitError] = FolderInUseError,
) -> FolderLock:
    """Take the writer lock of `folder` without waiting, or raise `error` naming the holder.

    The lock file is `folder/.shardkit.lock`, or `name` (a path) when given; with `remove` it is
    deleted when released. On a file system without flock, warn and go on unlocked."""
    folder = Path(folder)
    path = Path(name) if name is not None else folder / LOCK_FILE
    for _ in range(8):  # a lock file removed by its previous holder between our open and flock
        fd = _open_lock_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = holder_text(fd)
            os.close(fd)
            mine = holder.startswith(f"pid {os.getpid()} on host {socket.gethostname()} ")
            hint = "that is this process: let its save finish first" if mine else "wait for it to finish or stop it"
            raise error(
                f"{shown(folder)} is in use by {holder}: {hint}, then retry (two writers on one folder "
                "would mix or delete each other's files)"
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                log.warning(
                    "%s: the file system does not support flock (%s): writing without the one-writer lock; "
                    "make sure no other job writes to this folder",
                    folder,
                    e.strerror,
                )
                return FolderLock(path, None)
            raise disk_error(e, "lock", path) from None
        if remove and not _same_file(path, fd):
            os.close(fd)  # its holder removed it as we opened it: lock the new one
            continue
        _write_holder(fd, what)
        return FolderLock(path, fd, remove)
    raise error(f"{shown(folder)}: its lock file keeps changing: another process is writing it; retry later")


def _write_holder(fd: int, what: str) -> None:
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "what": what,
        "since": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv)[:300] if sys.argv else "",
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    except OSError:
        pass  # a read-only lock file: the lock holds, the holder is just not named


def destination_lock_path(dst: str | Path) -> Path:
    """`.DST.shardkit-lock` beside `dst`."""
    dst = Path(dst)
    return dst.parent / f".{dst.name}.{DESTINATION_LOCK}"


def lock_destination(dst: str | Path, what: str) -> FolderLock:
    """The lock of an output folder being produced (FolderInUseError while another run produces
    it), released and removed when the run ends."""
    return lock_folder(dst, what, name=str(destination_lock_path(dst)), remove=True)
