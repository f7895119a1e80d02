"""The three operations on opened checkpoints: reshard (any layout -> shards of a layout),
merge (any layout -> a Hugging Face directory), and convert (reshard from a full model).

They take an opened `Checkpoint` (the api layer resolves paths and Hub repo ids), plan the
output files, stream them through the executor into a staging folder, and add config.json,
tokenizer files and the manifest before the folder is renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Unpack

from ..conventions import HF
from ..distributed import current_job
from ..formats import MANIFEST, Checkpoint, SourceReader, get_format, hf
from ..formats.manifest import file_record, manifest
from ..formats.nxd import TAG_MARKER
from ..io.data.digest import FileRecord, Recording
from ..io.safety.durable import write_text
from ..io.safety.sinks import NO_SINK, Sink
from ..io.safety.transaction import STAGING_TAG, sibling_name
from ..layout import FULL, Layout
from ..paths import inside
from .options import ProgressCallback, WriteArgs, WriteOptions
from .outputs import OutputFile, plan_full, plan_sharded
from .staging import produce

log = logging.getLogger(__name__)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def _config_for_output(src: Checkpoint, dtype: torch.dtype | None) -> dict[str, Any]:
    config = dict(src.config)
    if dtype is not None:
        name = str(dtype).replace("torch.", "")
        for key in ("torch_dtype", "dtype"):
            if key in config or key == "dtype":
                config[key] = name
    return config


def _side_file_dirs(src: Checkpoint) -> list[Path]:
    """Where generation config and tokenizer files may be: the checkpoint's folder, and for NxD
    shards without a manifest or a training checkpoint tag (DIR/<tag>) also the folder above."""
    if src.kind == "sharded" and (src.manifest is None or (src.root / TAG_MARKER).is_file()):
        return [src.root, src.root.parent]
    return [src.root]


def _side_files(src: Checkpoint) -> list[tuple[Path, str]]:
    """(folder, name) of each side file to copy: from the first folder that has it (a tag may hold
    some, DIR the others). Each is checked now (hf.side_files: a link leading out of its folder is
    refused), before any output is written."""
    found: list[tuple[Path, str]] = []
    for folder in _side_file_dirs(src):
        taken = {name for _, name in found}
        found += [(folder, n) for n in hf.side_files(folder, [n for n in hf.SIDE_FILES if n not in taken])]
    return found


def _copy_side_files(sides: list[tuple[Path, str]], dst: Path) -> None:
    """Copy the side files `_side_files` found (read again through the I/O core, within their folder)."""
    for folder, name in sides:
        hf.copy_side_files(folder, dst, [name])


class StagingProgress:
    """Progress of the whole torchrun job, as rank 0 sees it: every rank writes its files into
    the one staging folder (io.safety.transaction.staged_output: `.<dst>.shardkit-tmp-<rank 0's pid>` beside
    dst), so rank 0 polls the size of that folder against the planned bytes of all outputs.

    What rank 0 shows is bytes on disk: file headers count, a file being written counts as far as
    it got, and the bar stops at the planned total until the end, where it reports the total."""

    def __init__(self, progress: ProgressCallback, dst: Path, total: int, interval: float = 0.5):
        self.staging = sibling_name(Path(dst).expanduser().absolute(), STAGING_TAG)  # as the staged output names it
        self.progress, self.total, self.interval = progress, total, interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="shardkit-progress", daemon=True)

    def poll(self) -> int:
        done = 0
        for folder, _, names in os.walk(self.staging):
            for name in names:
                try:
                    done += os.stat(os.path.join(folder, name)).st_size
                except OSError:
                    pass  # renamed or removed under us
        done = min(done, self.total)
        self.progress(done, self.total)
        return done

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            self.poll()

    def __enter__(self) -> StagingProgress:
        self.thread.start()
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        self.stop.set()
        self.thread.join()
        if exc_type is None:
            self.progress(self.total, self.total)


def _planned_bytes(outputs: Sequence[OutputFile], itemsize: int) -> int:
    return sum(p.numel() * itemsize for o in outputs for p in o.pieces)


# ---- the public operations ---------------------------------------------------------------------


def _write(
    ckpt: Checkpoint, outputs: Sequence[OutputFile], dst: str | Path, finish, options: WriteOptions
) -> list[FileRecord]:
    """staging.produce with `options`; under torchrun rank 0's progress covers every rank's bytes
    (StagingProgress)."""
    job = current_job()
    if options.progress is None or job.world == 1:
        return produce(ckpt, outputs, Path(dst), finish, options)
    quiet = dataclasses.replace(options, progress=None)
    if not job.leader:
        return produce(ckpt, outputs, Path(dst), finish, quiet)
    with StagingProgress(
        options.progress, Path(dst), _planned_bytes(outputs, (options.dtype or ckpt.dtype()).itemsize)
    ):
        return produce(ckpt, outputs, Path(dst), finish, quiet)


@dataclass
class Result:
    """What an operation wrote."""

    path: Path
    files: list[FileRecord]
    layout: Layout
    format: str
    rank_files: int = 0
    """How many of `files` are rank files (the others belong to them: xser's tensor and info
    files); 0 for outputs of no layout (a Hugging Face folder)."""

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def files_beside(self) -> int:
        """The files that belong to the rank files (what `inspect` counts apart from them)."""
        return len(self.files) - self.rank_files if self.rank_files else 0


def reshard_checkpoint(
    ckpt: Checkpoint,
    dst: str | Path,
    layout: Layout,
    *,
    format: str = "torch",
    command: str | None = None,
    convention: str | None = None,
    sink: Sink = NO_SINK,
    **options: Unpack[WriteArgs],
) -> Result:
    """Write `ckpt` as shards of `layout` in `format`, reading only the slices each shard needs
    (`command`: the command line to record in the manifest; `convention`: the tensor names of a
    format that chooses them, DCP: Hugging Face's by default, or torchtitan's; `sink`: where each
    finished file of `dst` goes, see `io.safety.sinks`)."""
    fmt = get_format(format)
    write = WriteOptions.from_args(options, format, sink=sink)
    target_dtype = write.dtype
    layout.validate(ckpt.dims)
    ckpt.check_files()
    outputs = plan_sharded(ckpt.family, ckpt.dims, layout, format, convention)
    sides = _side_files(ckpt)

    def finish(stage: Path, records: list[FileRecord]) -> None:
        if fmt.finish is not None:  # DCP's .metadata, optimum-neuron's metadata: once the data files are written
            sha = write.digests is Recording.SHA256
            added = fmt.finish(stage, records, ckpt.family, ckpt.dims, layout)
            records = records + [file_record(p, stage, sha) for p in added]
        _write_json(stage / "config.json", _config_for_output(ckpt, target_dtype))
        _copy_side_files(sides, stage)
        dtype_name = str(target_dtype or ckpt.dtype()).replace("torch.", "")
        _write_json(
            stage / MANIFEST,
            manifest(
                fmt=format,
                family=ckpt.family.name,
                layout=layout,
                dtype=dtype_name,
                records=records,
                tensors=ckpt.full_shapes,
                source=str(ckpt.root),
                command=command,
                **({"convention": convention or HF} if fmt.plan is not None else {}),
            ),
        )

    records = _write(ckpt, outputs, dst, finish, write)
    log.info("wrote %d files (%s) to %s", len(records), layout.describe(), dst)
    return Result(Path(dst), records, layout, format, rank_files=len(outputs))


def resave_changes(ckpt: Checkpoint, max_shard_size: int | str, dtype: torch.dtype | None) -> list[str]:
    """What merging the Hugging Face model `ckpt` (already full tensors) would change: its weight
    format, its tensors' dtypes, the files they are split into, a config it lacks. Empty when the
    merge would write the same model over again."""
    changes = []
    if ckpt.format != "safetensors":
        changes.append(f"{ckpt.format} weights to safetensors")
    if dtype is not None:
        reader = SourceReader(ckpt)
        try:
            held = sorted({str(reader.dtype_of(n)).replace("torch.", "") for n in ckpt.full_shapes})
        finally:
            reader.close()
        wanted = str(dtype).replace("torch.", "")
        if held != [wanted]:
            changes.append(f"dtype {'/'.join(held)} to {wanted}")
    outputs, _ = plan_full(ckpt.family, ckpt.dims, (dtype or ckpt.dtype()).itemsize, max_shard_size)
    planned = {o.path: sorted(p.name for p in o.pieces) for o in outputs}
    files = {key: sorted(p.name for p in pieces) for key, pieces in ckpt.holdings.items()}
    if planned != files:
        size = f"{max_shard_size:,} bytes" if isinstance(max_shard_size, int) else max_shard_size
        changes.append(f"{_files(len(files))} of weights to {_files(len(planned))} of at most {size}")
    if not (ckpt.root / "config.json").is_file():
        changes.append("with the config given")
    return changes


def _files(n: int) -> str:
    return f"{n} file{'s' if n != 1 else ''}"


def merge_checkpoint(
    ckpt: Checkpoint,
    dst: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    sink: Sink = NO_SINK,
    before_commit: Callable[[], None] | None = None,
    **options: Unpack[WriteArgs],
) -> Result:
    """Write `ckpt` as a Hugging Face model directory (safetensors + index + config), in files of
    at most `max_shard_size` (`sink`: where each finished file of `dst` goes, see `io.safety.sinks`;
    `before_commit`: called once every file is written, before the output is committed: a check
    of what else the operation read, which may refuse it)."""
    # a Hugging Face folder has no manifest: its files' digests would be computed for nobody (they
    # cost about as much CPU as the rest of a merge)
    write = WriteOptions.from_args(options, "safetensors", manifest=False, sink=sink)
    target_dtype = write.dtype
    ckpt.check_files()
    itemsize = (target_dtype or ckpt.dtype()).itemsize
    outputs, index = plan_full(ckpt.family, ckpt.dims, itemsize, max_shard_size)
    sides = _side_files(ckpt)

    def finish(stage: Path, records: list[FileRecord]) -> None:
        if index is not None:
            _write_json(stage / "model.safetensors.index.json", index)
        _write_json(stage / "config.json", _config_for_output(ckpt, target_dtype))
        _copy_side_files(sides, stage)
        for name, text in (options.get("extra_files") or {}).items():
            write_text(inside(stage, name, "extra output file"), text, fsync=False)
        if before_commit is not None:
            before_commit()

    records = _write(ckpt, outputs, dst, finish, write)
    log.info("merged %s into %s (%d files)", ckpt.root, dst, len(records))
    return Result(Path(dst), records, FULL, "safetensors")
