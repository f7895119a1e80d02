"""The bounded reader of small files: manifests, configs, index files, --param-order, xser's
`.info.pt`, scheduler and user content, lock and owner files, and the side files (tokenizer,
generation config, chat template, trainer state) shardkit copies from a source into an output.

Every one of them is read through `read_small`: a regular file only (a FIFO would hang the
reader, `/dev/zero` would fill memory; both are refused without blocking), at most a size cap
(checked on the open descriptor, and again as it is read, since a file may grow), and every
failure one line naming the file and what to do.

A file of a source is read `within` its folder: the file the descriptor is open on (its real
path, as the kernel reports it) must lie inside that folder, or inside the `blobs` folder of a
huggingface_hub cache snapshot, whose files are links there. A link that leads outside (a
tokenizer.json linked to ~/.ssh/id_rsa), a dangling link, a loop, or a file whose place cannot be
told (a /proc magic link to a pipe or a deleted file) is refused in one line: shardkit never
copies into an output, or publishes, what a source only points at. `copy_small` copies such a
file into an output with no wider permissions than the source file's (nor the umask's).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from ...errors import FormatError
from ...sizes import format_bytes
from .durable import write_bytes
from .oserror import disk_error, shown

JSON_LIMIT = 64 << 20
"""The largest JSON file shardkit reads (a 1-trillion-parameter model's index is a few MB)."""

PICKLE_LIMIT = 256 << 20
"""The largest small pickle shardkit reads whole (scheduler, user content, xser info)."""

COPY_LIMIT = 256 << 20
"""The largest side file shardkit copies from a source (a large tokenizer.json is tens of MB)."""

_CACHE_BLOBS = "blobs"
_CACHE_SNAPSHOTS = "snapshots"


class SmallFileError(FormatError):
    """A small file (manifest, config, index...) is missing, unreadable, not a regular file or too large."""


def read_small(path: str | Path, what: str, limit: int = JSON_LIMIT, within: str | Path | None = None) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes (else a one-line
    SmallFileError: FIFOs and devices are refused without waiting on them); with `within`, a
    file that really lies inside that folder (see the module)."""
    return _read(Path(path), what, limit, within)[0]


def copy_small(src: str | Path, dst: str | Path, what: str, within: str | Path, limit: int = COPY_LIMIT) -> None:
    """Copy the small file `src` of a source (read `within` its folder, as `read_small` does) to
    the new file `dst`, readable by group and others only where `src` is (and the umask allows)."""
    data, st = _read(Path(src), what, limit, within)
    write_bytes(dst, data, fsync=False, mode=0o600 | (st.st_mode & 0o044))


def _read(path: Path, what: str, limit: int, within: str | Path | None) -> tuple[bytes, os.stat_result]:
    fd = _open(path, what, within)
    try:
        st = os.fstat(fd)
        _check_kind_and_size(st, path, what, limit)
        if within is not None:
            _check_within(fd, path, what, within)
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
        return b"".join(chunks), st
    except OSError as e:
        raise SmallFileError(str(disk_error(e, f"read {what}", path))) from None
    finally:
        os.close(fd)


def _open(path: Path, what: str, within: str | Path | None) -> int:
    """A descriptor on `path`, opened without blocking (a FIFO is refused after, never waited on)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if os.path.islink(path):
            raise SmallFileError(
                f"{what} {shown(path)} is a symlink to {shown(os.readlink(path))}, which does not exist: "
                "remove the link or put the file in its place"
            ) from None
        raise SmallFileError(f"{what} {shown(path)} does not exist") from None
    except IsADirectoryError:
        raise SmallFileError(f"{what} {shown(path)} is a folder, not a file") from None
    except OSError as e:
        if e.errno == errno.ENXIO:  # a socket
            raise SmallFileError(
                f"{what} {shown(path)} is not a regular file (a FIFO, device or socket): refusing to read it"
            ) from None
        if e.errno == errno.ELOOP and within is not None:
            raise SmallFileError(
                f"{what} {shown(path)} leads through a symlink loop: replace the link with a copy of the file, or remove it"
            ) from None
        raise SmallFileError(str(disk_error(e, f"read {what}", path))) from None


def source_roots(folder: str | Path) -> list[str]:
    """The real folders the files of the source folder `folder` may lie in: the folder itself,
    and for (a folder inside) a snapshot of huggingface_hub's cache, `<repo>/snapshots/<rev>`,
    its repo's `blobs` folder, which the cache links every file of a snapshot to."""
    real = Path(os.path.realpath(folder))
    roots = [str(real)]
    for snapshot in (real, *real.parents):
        repo = snapshot.parent.parent
        if snapshot.parent.name == _CACHE_SNAPSHOTS and (repo / _CACHE_BLOBS).is_dir():
            roots.append(str(repo / _CACHE_BLOBS))
            break
    return roots


def _opened_path(fd: int, path: Path) -> str | None:
    """The real path of the file `fd` is open on (what the kernel says it opened, so a link swapped
    after a check cannot fool it), or None when it cannot be told (a pipe, a deleted file)."""
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc: the path resolved now, if it is still the file open
        real = os.path.realpath(path)
        try:
            same = os.path.samestat(os.stat(real), os.fstat(fd))
        except OSError:
            return None
        return real if same else None
    if not real.startswith(os.sep) or (real.endswith(" (deleted)") and not os.path.exists(real)):
        return None
    return real


def _check_within(fd: int, path: Path, what: str, within: str | Path) -> None:
    """Refuse (one line) the file open on `fd` unless it lies inside `within` (`source_roots`)."""
    real = _opened_path(fd, path)
    fix = "replace the link with a copy of the file, or remove it"
    if real is None:
        raise SmallFileError(f"{what} {shown(path)} is not a file whose place can be told (a magic link?): {fix}")
    for root in source_roots(within):
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return
    raise SmallFileError(
        f"{what} {shown(path)} leads through a symlink to {shown(real)}, outside {shown(within)}: "
        f"refusing to read it; {fix}"
    )


def check_small(path: str | Path, what: str, limit: int = PICKLE_LIMIT, within: str | Path | None = None) -> Path:
    """`path`, once it is known to be a regular file of at most `limit` bytes (else the one-line
    SmallFileError `read_small` gives), for readers that must open it themselves (torch.load);
    with `within`, the real path of the file, which lies inside that folder (`read_small`)."""
    path = Path(path)
    fd = _open(path, what, within)
    try:
        _check_kind_and_size(os.fstat(fd), path, what, limit)
        if within is None:
            return path
        _check_within(fd, path, what, within)
        return Path(_opened_path(fd, path) or path)
    except OSError as e:
        raise SmallFileError(str(disk_error(e, f"read {what}", path))) from None
    finally:
        os.close(fd)


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


def read_json(path: str | Path, what: str, limit: int = JSON_LIMIT, within: str | Path | None = None) -> Any:
    """`read_small` parsed as JSON (a one-line SmallFileError when it is not JSON)."""
    raw = read_small(path, what, limit, within)
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


def read_text(path: str | Path, what: str, limit: int = JSON_LIMIT, within: str | Path | None = None) -> str:
    """`read_small` decoded as UTF-8 (a one-line SmallFileError when it is not)."""
    raw = read_small(path, what, limit, within)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SmallFileError(f"{what} {shown(path)} is not UTF-8 text: fix or re-create it") from None
