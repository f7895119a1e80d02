"""The three operations on opened checkpoints: reshard (any layout -> shards of a layout),
merge (any layout -> a Hugging Face directory), and convert (reshard from a full model).

They take an opened `Checkpoint` (the api layer resolves paths and Hub repo ids), plan the
output files, stream them through the executor into a staging folder, and add config.json,
tokenizer files and the manifest before the folder is renamed into place.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from typing_extensions import TypedDict, Unpack

from ..checkpoint.tree import CHECKPOINT_MARKER
from ..conventions import HF
from ..distributed import current_job
from ..formats import MANIFEST, Checkpoint, get_format, hf
from ..formats.base import parse_dtype
from ..formats.manifest import file_record, manifest
from ..io.digest import CheckMode, FileRecord, Recording
from ..io.transaction import STAGING_TAG, sibling_name
from ..layout import FULL, Layout
from ..paths import inside
from .executor import ProgressCallback
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
    if src.kind == "sharded" and (src.manifest is None or (src.root / CHECKPOINT_MARKER).is_file()):
        return [src.root, src.root.parent]
    return [src.root]


def _copy_side_files(src: Checkpoint, dst: Path) -> None:
    """Each side file from the first folder that has it (a tag may hold some, DIR the others)."""
    copied: set[str] = set()
    for folder in _side_file_dirs(src):
        copied.update(hf.copy_side_files(folder, dst, [n for n in hf.SIDE_FILES if n not in copied]))


class StagingProgress:
    """Progress of the whole torchrun job, as rank 0 sees it: every rank writes its files into
    the one staging folder (io.transaction.staged_output: `.<dst>.shardkit-tmp-<rank 0's pid>` beside
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


class WriteOptions(TypedDict, total=False):
    """How every writing operation (reshard, convert, merge, export) writes its output."""

    dtype: str | torch.dtype | None
    """Cast weights to this dtype (bf16, fp16, fp32; default: keep the source's)."""
    workers: int | str
    """Output files built in parallel (threads); "auto" (the default): one per two CPU cores, at
    least 1 and at most 4, and fewer when the largest tensors of that many workers would not fit in
    256 MiB together."""
    overwrite: bool
    """Replace a destination that exists and is not empty (default False)."""
    progress: ProgressCallback | None
    """Called as progress(bytes_done, bytes_total) while output is written."""
    direct_io: bool | str
    """Write the output around the page cache (O_DIRECT): True, False (the default), or "auto":
    when the output is larger than the kernel's dirty limit (see `io.direct.direct_io_pays`). It saves
    the kernel's copy into the page cache (about 2 CPU-s per GB on a VM) and leaves the output on
    the device when the call returns; whether it is faster depends on the storage (measured on a
    7B checkpoint here: convert 6-12% faster, merge 30% slower)."""
    sha256: bool
    """Also record each output file's sha256 in the manifest (default False: xxh3-128 only, which
    catches any accidental change; sha256 costs about 0.7 CPU-s per GB and is for manifests whose
    own hash is pinned elsewhere, see `io.digest`). Outputs without a manifest ignore it."""
    extra_files: Mapping[str, str]
    """Small text files (name -> content) added to the output before it is committed (a marker
    saying which run wrote it, say); names are plain file names inside the output."""
    verify_hashes: bool | CheckMode
    """Check each source file against the digest its manifest lists before the output is
    committed: True or "fast" (the default) checks the fast xxh3-128 where the manifest has it and
    sha256 otherwise, "sha256" checks sha256 only, False or "none" skips the check."""


def _write(
    ckpt: Checkpoint,
    outputs: Sequence[OutputFile],
    dst: str | Path,
    fmt: str,
    finish,
    options: WriteOptions,
    digests: Recording = True,
) -> list[FileRecord]:
    """staging.produce with `options`; under torchrun rank 0's progress covers every rank's bytes
    (StagingProgress). `digests`: hash the outputs (for the manifest that lists them; sha256 too
    with the `sha256` option)."""
    dtype = parse_dtype(options.get("dtype"))
    if digests is True and options.get("sha256"):
        digests = "sha256"
    progress, job = options.get("progress"), current_job()

    def run(progress: ProgressCallback | None) -> list[FileRecord]:
        workers, overwrite = options.get("workers", "auto"), options.get("overwrite", False)
        verify = options.get("verify_hashes", True)
        direct = options.get("direct_io", False)
        return produce(
            ckpt, outputs, Path(dst), fmt, dtype, workers, overwrite, progress, finish, verify, digests, direct
        )

    if progress is None or job.world == 1:
        return run(progress)
    if not job.leader:
        return run(None)
    with StagingProgress(progress, Path(dst), _planned_bytes(outputs, (dtype or ckpt.dtype()).itemsize)):
        return run(None)


@dataclass
class Result:
    """What an operation wrote."""

    path: Path
    files: list[FileRecord]
    layout: Layout
    format: str

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


def reshard_checkpoint(
    ckpt: Checkpoint,
    dst: str | Path,
    layout: Layout,
    *,
    format: str = "torch",
    command: str | None = None,
    convention: str | None = None,
    **options: Unpack[WriteOptions],
) -> Result:
    """Write `ckpt` as shards of `layout` in `format`, reading only the slices each shard needs
    (`command`: the command line to record in the manifest; `convention`: the tensor names of a
    format that chooses them, DCP: Hugging Face's by default, or torchtitan's)."""
    fmt = get_format(format)
    target_dtype = parse_dtype(options.get("dtype"))
    layout.validate(ckpt.dims)
    ckpt.check_files()
    outputs = plan_sharded(ckpt.family, ckpt.dims, layout, format, convention)

    def finish(stage: Path, records: list[FileRecord]) -> None:
        if fmt.finish is not None:  # DCP's .metadata, from where every data file put its chunks
            records = records + [file_record(p, stage) for p in fmt.finish(stage, records)]
        _write_json(stage / "config.json", _config_for_output(ckpt, target_dtype))
        _copy_side_files(ckpt, stage)
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

    records = _write(ckpt, outputs, dst, format, finish, options)
    log.info("wrote %d files (%s) to %s", len(records), layout.describe(), dst)
    return Result(Path(dst), records, layout, format)


def merge_checkpoint(
    ckpt: Checkpoint, dst: str | Path, *, max_shard_size: int | str = "5GB", **options: Unpack[WriteOptions]
) -> Result:
    """Write `ckpt` as a Hugging Face model directory (safetensors + index + config), in files of
    at most `max_shard_size`."""
    target_dtype = parse_dtype(options.get("dtype"))
    ckpt.check_files()
    itemsize = (target_dtype or ckpt.dtype()).itemsize
    outputs, index = plan_full(ckpt.family, ckpt.dims, itemsize, max_shard_size)

    def finish(stage: Path, records: list[FileRecord]) -> None:
        if index is not None:
            _write_json(stage / "model.safetensors.index.json", index)
        _write_json(stage / "config.json", _config_for_output(ckpt, target_dtype))
        _copy_side_files(ckpt, stage)
        for name, text in (options.get("extra_files") or {}).items():
            inside(stage, name, "extra output file").write_text(text)

    # a Hugging Face folder has no manifest: its files' digests would be computed for nobody (they
    # cost about as much CPU as the rest of a merge)
    records = _write(ckpt, outputs, dst, "safetensors", finish, options, digests=False)
    log.info("merged %s into %s (%d files)", ckpt.root, dst, len(records))
    return Result(Path(dst), records, FULL, "safetensors")
