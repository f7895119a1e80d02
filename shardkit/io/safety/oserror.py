"""The one translation of operating-system failures into one-line errors.

Every writer, deleter and small-file reader turns an `OSError` into a `DiskError` here, so a full
disk, a read-only file system, a folder without write permission or a name too long for the file
system reads the same whichever command met it: what failed, on which path, why, and what to do.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path

from ...errors import ShardkitError
from ...paths import NoSpaceError, free_space
from ...sizes import format_bytes


class DiskError(ShardkitError):
    """The file system refused an operation (permissions, read-only, name too long, I/O error...)."""


def shown(text: object, limit: int = 300) -> str:
    """A name as it can be shown on one line: control characters (a newline in a file name)
    escaped, and very long names shortened in the middle."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    if len(out) > limit:
        half = (limit - 5) // 2
        out = f"{out[:half]}[...]{out[-half:]}"
    return out


_FIXES: dict[int, str] = {
    errno.EACCES: "choose a place you can write to (or read from), or fix its permissions",
    errno.EPERM: "choose a place you can write to, or fix its permissions",
    errno.EROFS: "choose a destination on a writable disk",
    errno.ENAMETOOLONG: "use a shorter name or path",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another path",
    errno.EISDIR: "it is a folder, not a file: choose another path",
    errno.EEXIST: "move it away or choose another path",
    errno.ENOENT: "check the path (a folder on its way may be missing)",
    errno.ELOOP: "give the real path (shardkit never follows a symlink there)",
    errno.EMFILE: "raise the open-file limit (ulimit -n) and retry",
    errno.ENFILE: "retry later",
    errno.EIO: "the disk or network file system failed: check it",
    errno.EBUSY: "a mount point or a file in use by another program: choose another path",
    errno.EXDEV: "keep the destination on the same disk as its folder",
    errno.EFBIG: "choose another disk",
}


def disk_error(error: OSError, what: str, path: str | Path | None = None) -> ShardkitError:
    """The one-line error for `error`, met while trying to `what` `path` (e.g. "write", "read",
    "delete"). A full disk or an exhausted quota becomes a NoSpaceError saying how much is free."""
    target = path if path is not None else (error.filename or "")
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        folder = Path(target) if target else Path(".")
        probe = folder if folder.is_dir() else folder.parent
        free = free_space(probe)
        have = "unknown" if free is None else format_bytes(free)
        return NoSpaceError(
            f"no space left on the disk of {shown(folder)} (free {have}) while trying to {what} it: "
            "free some space there or write somewhere else"
        )
    reason = error.strerror or type(error).__name__
    fix = _FIXES.get(error.errno or -1, "check the disk, the path and its permissions")
    return DiskError(f"cannot {what} {shown(target)}: {reason}: {fix}")


@contextlib.contextmanager
def translated(what: str, path: str | Path | None = None) -> Iterator[None]:
    """Run the block; an OSError inside becomes the one-line `disk_error` (naming the file the
    error names when it has one, else `path`)."""
    try:
        yield
    except OSError as e:
        raise disk_error(e, what, e.filename or path) from None
