"""Producing an output folder: the engine's outputs written through the I/O core's staged
output (`io.safety.transaction.staged_output`: staging beside the destination, overlap and lock checks,
cleanup on failure, Ctrl-C and SIGTERM, commit by rename). Under torchrun the output files are
divided among the job's processes (`distributed.Job`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from ..distributed import current_job
from ..formats import Checkpoint
from ..io.data.digest import FileRecord
from ..io.safety.transaction import commit_all, staged_output
from .executor import execute
from .options import WriteOptions
from .outputs import OutputFile

log = logging.getLogger(__name__)


def source_paths(src: Checkpoint) -> list[Path]:
    """What a checkpoint is made of on disk: its folder, or only its file for a single-file source
    (whose root is merely the folder the file sits in), plus every file it reads. `overlaps`
    compares them as real paths, so files linked from elsewhere (the Hugging Face cache's blobs)
    count where they really are."""
    paths = [] if src.single_file else [Path(src.root)]
    return paths + [Path(path) for path in src.files.values()]


def produce(
    src: Checkpoint,
    outputs: Sequence[OutputFile],
    dst: Path,
    finish: Callable[[Path, list[FileRecord]], None],
    options: WriteOptions,
) -> list[FileRecord]:
    """Write `outputs` into a staging folder as `options` say (see `execute`; each file handed to
    `options.sink` as it is closed, and the commit waits for it), let `finish` add its files, and
    rename to `dst`.

    In a torch.distributed job every rank writes its share of the files (see distributed.py).
    With `options.verify_hashes`, every source file listed in the source's manifest is checked
    against its digest before the output is committed (see `execute`)."""
    job = current_job()
    with staged_output(
        dst, sources=source_paths(src), overwrite=options.overwrite, what="writing", job=job, sink=options.sink
    ) as out:
        mine_options = options if job.leader else dataclasses.replace(options, progress=None)
        mine = job.run_all_or_none(lambda: execute(src, job.share(list(outputs)), out.path, mine_options))
        records = sorted((r for part in job.gather(mine) for r in part), key=lambda r: r.path)
        commit_all(out, job, lambda staging: finish(staging, records))
        if job.world > 1:
            log.info("rank %d wrote %d of %d files", job.rank, len(mine), len(records))
    return records
