"""Staging and commit: every output is written into a hidden folder beside the destination and
renamed into place at the end, so a failure leaves nothing half-written. Under torchrun the
output files are divided among the job's processes (`distributed.Job`).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..distributed import current_job
from ..errors import DestinationExistsError, ShardkitError
from ..formats import Checkpoint
from ..formats.base import FileRecord
from .executor import ProgressCallback, execute
from .outputs import OutputFile

log = logging.getLogger(__name__)


def prepare_staging(dst: Path, overwrite: bool, sources: Sequence[Path] = ()) -> Path:
    """Check the destination and create a staging folder beside it (renamed to dst at the end)."""
    dst = Path(dst).absolute()
    for src in sources:
        src = Path(src).absolute()
        if dst == src or src in dst.parents or dst in src.parents:
            raise ShardkitError(f"destination {dst} overlaps the source {src}: choose another destination")
    if dst.exists() and not dst.is_dir():
        raise DestinationExistsError(f"{dst} exists and is a file: choose another destination")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise DestinationExistsError(f"{dst} exists and is not empty: pass --overwrite to replace it")
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = dst.parent / f".{dst.name}.shardkit-tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def commit_staging(staging: Path, dst: Path) -> None:
    """Put the finished staging folder in place of dst (replacing it when it exists)."""
    dst = Path(dst).absolute()
    if dst.exists():
        old = dst.parent / f".{dst.name}.shardkit-old-{os.getpid()}"
        os.rename(dst, old)
        os.rename(staging, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, dst)


def produce(
    src: Checkpoint,
    outputs: Sequence[OutputFile],
    dst: Path,
    fmt: str,
    dtype: torch.dtype | None,
    workers: int,
    overwrite: bool,
    progress: ProgressCallback | None,
    finish: Callable[[Path, list[FileRecord]], None],
) -> list[FileRecord]:
    """Write `outputs` into a staging folder, let `finish` add its files, and rename to `dst`.

    In a torch.distributed job every rank writes its share of the files (see distributed.py)."""
    job = current_job()
    if job.leader:
        try:
            prepared: Any = prepare_staging(dst, overwrite, [src.root])
        except ShardkitError as e:
            prepared = e
    staging = job.broadcast(prepared if job.leader else None)
    if isinstance(staging, BaseException):
        raise staging
    try:
        mine = job.run_all_or_none(lambda: execute(src, job.share(list(outputs)), staging, fmt, dtype, workers,
                                                   progress if job.leader else None))
        records = sorted((r for part in job.gather(mine) for r in part), key=lambda r: r.path)

        def finish_and_rename() -> None:
            if job.leader:
                finish(staging, records)
                commit_staging(staging, dst)

        job.run_all_or_none(finish_and_rename)
        if job.world > 1:
            log.info("rank %d wrote %d of %d files", job.rank, len(mine), len(records))
    except BaseException:
        if job.leader:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return records
