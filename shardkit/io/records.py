"""Small records that say whose a folder is (the trainer's `run.json` in its checkpoint directory),
and the first line of a log a writer appends to (whose records a metrics file holds).

A record lives in a local folder or an s3:// prefix. It is read bounded and within its folder (a
link leading out of it is refused, `io.safety.small`), and created only when absent: a local one is
written beside its place and hard-linked there (`link` fails when the name exists, so of two
writers at once one creates it and the other reads the winner's, never a torn file; on a file
system without hard links, created with O_EXCL), an object in S3 by a conditional PUT. Failures
are one line naming the record and what to do.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ..errors import ShardkitError
from ..paths import open_regular
from .location import remote as remote_location
from .objects import s3
from .safety.durable import fsync_path, write_bytes
from .safety.oserror import disk_error, shown
from .safety.small import SmallFileError, read_small
from .safety.transaction import STAGING_TAG, sibling_name

RECORD_LIMIT = 1 << 20
"""The largest record read (a run record is a few KB)."""

_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV)


def read_record(where: str | Path, name: str, what: str, limit: int = RECORD_LIMIT) -> bytes | None:
    """The bytes of the record `name` in the folder or s3:// prefix `where`; None when it has none."""
    loc = remote_location(where, what)
    if loc is not None:
        data = s3.get_bytes(loc, name)
        if data is not None and len(data) > limit:
            raise SmallFileError(f"{what} {loc}/{name} is larger than any {what} should be: is it the right object?")
        return data
    path = Path(where) / name
    if not os.path.lexists(path):
        return None
    return read_small(path, what, limit, within=where)


def claim_record(where: str | Path, name: str, data: bytes, what: str) -> bytes | None:
    """Create the record `name` holding `data` in the folder (made when missing) or s3:// prefix
    `where`, unless one exists: None when this call created it, else the existing record's bytes."""
    loc = remote_location(where, what)
    if loc is not None:
        for _ in range(3):  # created, or read; a record removed in between is claimed again
            if s3.put_new(loc, name, data):
                return None
            existing = s3.get_bytes(loc, name)
            if existing is not None:
                return existing
        raise ShardkitError(f"{what} {loc}/{name} keeps appearing and vanishing: is another job writing it?")
    folder = Path(where)
    path = folder / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if _create(path, data):
            return None
    except OSError as e:
        raise disk_error(e, f"write the {what}", path) from None
    existing = read_record(folder, name, what)
    return b"" if existing is None else existing


def _create(path: Path, data: bytes) -> bool:
    """Write `data` as the new file `path` whole or not at all; False when `path` exists (even as a
    dangling link)."""
    tmp = sibling_name(path, STAGING_TAG)
    write_bytes(tmp, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
        return _create_in_place(path, data)
    finally:
        os.unlink(tmp)
    fsync_path(path.parent)
    return True


def _create_in_place(path: Path, data: bytes) -> bool:
    """`_create` on a file system without hard links: the new file made with O_EXCL, then written."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent)
    return True


def read_head(path: str | Path, what: str, limit: int = RECORD_LIMIT) -> bytes:
    """The first line of the local file `path` (without its newline; at most `limit` bytes): a
    regular file only, never waited on (a FIFO in its place is refused in one line)."""
    fd = open_regular(path, what)
    try:
        head = b""
        while b"\n" not in head and len(head) < limit:
            chunk = os.read(fd, min(64 << 10, limit - len(head)))
            if not chunk:
                break
            head += chunk
    except OSError as e:
        raise disk_error(e, f"read the {what}", path) from None
    finally:
        os.close(fd)
    return head.split(b"\n", 1)[0]


def shown_where(where: str | Path, name: str) -> str:
    """How messages name the record `name` of `where`."""
    loc = remote_location(where)
    return f"{loc}/{name}" if loc is not None else shown(Path(where) / name)
