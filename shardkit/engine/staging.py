"""Staging and commit: every output is written into a hidden folder beside the destination and
renamed into place at the end, so a failure leaves nothing half-written. Under torchrun the
output files are divided among the job's processes (`distributed.Job`).

Safety rules (users' checkpoints cost weeks of training):
- the destination may never be, contain or sit inside a source, compared as real paths (so
  `OTHER/../SRC`, a symlink to SRC or SRC given through a link are all recognised);
- a destination that is itself a symlink is refused: nothing is ever deleted or replaced
  through a link (give the real path instead);
- a replace is two renames (DST -> `.DST.shardkit-old-PID`, staging -> DST); a run killed in
  between is repaired by the next one (`paths.recover_interrupted`), which also removes the
  staging folders of dead runs of this host;
- SIGTERM, like Ctrl-C, interrupts the operation and removes its staging folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..distributed import current_job
from ..errors import DestinationExistsError, ShardkitError
from ..formats import Checkpoint
from ..io.digest import FileRecord
from ..paths import (
    OLD_TAG,
    OWNER_FILE,
    STAGING_TAG,
    is_link,
    overlaps,
    recover_interrupted,
    remove_tree,
    sibling_name,
    write_owner,
)
from .executor import execute
from .options import WriteOptions
from .outputs import OutputFile

log = logging.getLogger(__name__)


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during an operation (handled like Ctrl-C: the staging folder is removed)."""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM raises `Terminated` so that cleanup
    runs; the previous handler is put back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(f"terminated by signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not allowed here (e.g. an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _disk_error(e: OSError, what: str, path: Path) -> ShardkitError:
    """One line for a failure of the file system (read-only, full, permissions, not a folder)."""
    reason = e.strerror or str(e)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "choose a destination you can write to"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free some space or choose a destination on another disk"
    elif e.errno in (errno.ENOTDIR, errno.EEXIST):
        fix = "a part of the destination's path is a file: choose another destination"
    else:
        fix = "check the destination's disk and permissions"
    return ShardkitError(f"cannot {what} {path}: {reason}: {fix}")


def source_paths(src: Checkpoint) -> list[Path]:
    """What a checkpoint is made of on disk: its folder, or only its file for a single-file source
    (whose root is merely the folder the file sits in), plus every file it reads. `overlaps`
    compares them as real paths, so files linked from elsewhere (the Hugging Face cache's blobs)
    count where they really are."""
    paths = [] if src.single_file else [Path(src.root)]
    return paths + [Path(path) for path in src.files.values()]


def prepare_staging(dst: Path, overwrite: bool, sources: Iterable[Path] = ()) -> Path:
    """Check the destination and create a staging folder beside it (renamed to dst at the end).

    Refuses a destination that is, contains or sits inside any of `sources` (real paths
    compared), and a destination that is a symlink. Repairs what killed runs left beside dst."""
    dst = Path(dst).expanduser().absolute()
    try:
        if is_link(dst):
            raise DestinationExistsError(
                f"{dst} is a symlink (to {os.readlink(dst)}): shardkit never writes or deletes through a link; "
                "give the real destination path"
            )
        for src in sources:
            if overlaps(dst, src):
                raise ShardkitError(
                    f"destination {dst} overlaps the source {src} (same folder, or one inside the "
                    "other, once links and '..' are resolved): choose another destination"
                )
        recover_interrupted(dst, log)
        if dst.exists() and not dst.is_dir():
            raise DestinationExistsError(f"{dst} exists and is a file: choose another destination")
        if dst.is_dir() and any(dst.iterdir()) and not overwrite:
            raise DestinationExistsError(f"{dst} exists and is not empty: pass --overwrite to replace it")
        dst.parent.mkdir(parents=True, exist_ok=True)
        staging = sibling_name(dst, STAGING_TAG)
        remove_tree(staging)
        staging.mkdir()
        try:
            write_owner(staging)
        except OSError:
            remove_tree(staging)
            raise
    except OSError as e:
        raise _disk_error(e, "write", dst) from None
    return staging


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT wait until the block is done (the two renames of a replace)."""
    signals = {signal.SIGTERM, signal.SIGINT}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def commit_staging(staging: Path, dst: Path) -> None:
    """Put the finished staging folder in place of dst (replacing it when it exists).

    A replace renames dst to `.DST.shardkit-old-PID`, then staging to dst, then deletes the old
    folder; if the second rename fails the old one is put back, and a run killed in between is
    repaired by the next run (or by opening dst)."""
    dst = Path(dst).expanduser().absolute()
    staging = Path(staging)
    try:
        (staging / OWNER_FILE).unlink(missing_ok=True)
        if is_link(dst):
            raise DestinationExistsError(f"{dst} became a symlink while shardkit wrote: refusing to replace it")
        if not dst.exists():
            os.rename(staging, dst)
            return
        old = sibling_name(dst, OLD_TAG)
        with _signals_deferred():
            os.rename(dst, old)
            try:
                os.rename(staging, dst)
            except BaseException:
                os.rename(old, dst)
                raise
    except OSError as e:
        raise _disk_error(e, "move the finished output into", dst) from None
    try:
        remove_tree(old)
    except OSError as e:
        log.warning("could not delete the replaced copy %s (%s): delete it yourself", old, e.strerror or e)


def produce(
    src: Checkpoint,
    outputs: Sequence[OutputFile],
    dst: Path,
    finish: Callable[[Path, list[FileRecord]], None],
    options: WriteOptions,
) -> list[FileRecord]:
    """Write `outputs` into a staging folder as `options` say (see `execute`), let `finish` add
    its files, and rename to `dst`.

    In a torch.distributed job every rank writes its share of the files (see distributed.py).
    With `options.verify_hashes`, every source file listed in the source's manifest is checked
    against its digest before the output is committed (see `execute`)."""
    with terminate_as_interrupt():
        return _produce(src, outputs, dst, finish, options)


def _produce(
    src: Checkpoint,
    outputs: Sequence[OutputFile],
    dst: Path,
    finish: Callable[[Path, list[FileRecord]], None],
    options: WriteOptions,
) -> list[FileRecord]:
    job = current_job()
    if job.leader:
        try:
            prepared: Any = prepare_staging(dst, options.overwrite, source_paths(src))
        except ShardkitError as e:
            prepared = e
    staging = job.broadcast(prepared if job.leader else None)
    if isinstance(staging, BaseException):
        raise staging
    try:
        mine_options = options if job.leader else dataclasses.replace(options, progress=None)
        mine = job.run_all_or_none(lambda: execute(src, job.share(list(outputs)), staging, mine_options))
        records = sorted((r for part in job.gather(mine) for r in part), key=lambda r: r.path)

        def finish_and_rename() -> None:
            if job.leader:
                finish(staging, records)
                commit_staging(staging, dst)

        job.run_all_or_none(finish_and_rename)
        if job.world > 1:
            log.info("rank %d wrote %d of %d files", job.rank, len(mine), len(records))
    except BaseException as e:
        if job.leader:
            _discard(staging)
        if isinstance(e, OSError):
            name = str(getattr(e, "filename", None) or "")
            if name and not name.startswith(str(staging)):
                raise _disk_error(e, "read", Path(name)) from None
            raise _disk_error(e, "write", dst) from None
        raise
    return records


def _discard(staging: Path) -> None:
    try:
        remove_tree(staging)
    except OSError as e:
        log.warning("could not remove the staging folder %s (%s): delete it yourself", staging, e.strerror or e)
