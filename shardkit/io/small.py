"""The bounded reader of small files: manifests, configs, index files, --param-order, xser's
`.info.pt`, scheduler and user content, lock and owner files.

Every one of them is read through `read_small`: a regular file only (a FIFO would hang the
reader, `/dev/zero` would fill memory; both are refused without blocking), at most a size cap
(checked on the open descriptor, and again as it is read, since a file may grow), and every
failure one line naming the file and what to do.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import FormatError
from ..sizes import format_bytes
from .oserror import disk_error, shown

JSON_LIMIT = 64 << 20
"""The largest JSON file shardkit reads (a 1-trillion-parameter model's index is a few MB)."""

PICKLE_LIMIT = 256 << 20
"""The largest small pickle shardkit reads whole (scheduler, user content, xser info)."""


class SmallFileError(FormatError):
    """A small file (manifest, config, index...) is missing, unreadable, not a regular file or too large."""


def read_small(path: str | Path, what: str, limit: int = JSON_LIMIT) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (else a one-line
    SmallFileError: FIFOs and devices are refused without waiting on them)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SmallFileError(f"{what} {shown(path)} does not exist") from None
    except IsADirectoryError:
        raise SmallFileError(f"{what} {shown(path)} is a folder, not a file") from None
    except OSError as e:
        raise SmallFileError(str(disk_error(e, f"read {what}", path))) from None
    try:
        _check_kind_and_size(os.fstat(fd), path, what, limit)
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise SmallFileError(_too_large(path, what, total, limit))
        return b"".join(chunks)
    except OSError as e:
        raise SmallFileError(str(disk_error(e, f"read {what}", path))) from None
    finally:
        os.close(fd)


def check_small(path: str | Path, what: str, limit: int = PICKLE_LIMIT) -> Path:
    """`path`, once it is known to be a regular file of at most `limit` bytes (else the one-line
    SmallFileError `read_small` gives), for readers that must open it themselves (torch.load)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SmallFileError(f"{what} {shown(path)} does not exist") from None
    except OSError as e:
        raise SmallFileError(str(disk_error(e, f"read {what}", path))) from None
    _check_kind_and_size(st, path, what, limit)
    return path


def _check_kind_and_size(st: os.stat_result, path: Path, what: str, limit: int) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise SmallFileError(f"{what} {shown(path)} is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise SmallFileError(
            f"{what} {shown(path)} is not a regular file (a FIFO, device or socket): refusing to read it"
        )
    if st.st_size > limit:
        raise SmallFileError(_too_large(path, what, st.st_size, limit))


def _too_large(path: Path, what: str, size: int, limit: int) -> str:
    return (
        f"{what} {shown(path)} is {format_bytes(size)} or more, larger than any {what} should be "
        f"({format_bytes(limit)} at most): is it the right file?"
    )


def read_json(path: str | Path, what: str, limit: int = JSON_LIMIT) -> Any:
    """`read_small` parsed as JSON (a one-line SmallFileError when it is not JSON)."""
    raw = read_small(path, what, limit)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise SmallFileError(
            f"{what} {shown(path)} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): fix or re-create it"
        ) from None
    except (ValueError, RecursionError):
        raise SmallFileError(
            f"{what} {shown(path)} is not valid JSON (or nested too deeply): fix or re-create it"
        ) from None


def read_text(path: str | Path, what: str, limit: int = JSON_LIMIT) -> str:
    """`read_small` decoded as UTF-8 (a one-line SmallFileError when it is not)."""
    raw = read_small(path, what, limit)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SmallFileError(f"{what} {shown(path)} is not UTF-8 text: fix or re-create it") from None
