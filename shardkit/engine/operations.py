"""The three operations on opened checkpoints: reshard (any layout -> shards of a layout),
merge (any layout -> a Hugging Face directory), and convert (reshard from a full model).

They take an opened `Checkpoint` (the api layer resolves paths and Hub repo ids), plan the
output files, stream them through the executor into a staging folder, and add config.json,
tokenizer files and the manifest before the folder is renamed into place.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..formats import MANIFEST, Checkpoint, get_format, hf
from ..formats.base import FileRecord, parse_dtype
from ..formats.manifest import manifest
from ..layout import FULL, Layout
from .executor import ProgressCallback
from .outputs import plan_full, plan_sharded
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
    return [src.root, src.root.parent] if src.kind == "sharded" and src.manifest is None else [src.root]


def _copy_side_files(src: Checkpoint, dst: Path) -> None:
    for folder in _side_file_dirs(src):
        if hf.copy_side_files(folder, dst):
            break


# ---- the public operations ---------------------------------------------------------------------


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
    dtype: str | torch.dtype | None = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
    command: str | None = None,
    verify_hashes: bool = True,
) -> Result:
    """Write `ckpt` as shards of `layout` in `format`, reading only the slices each shard needs.

    `verify_hashes`: check each source file against the sha256 in its manifest when first read."""
    get_format(format)
    target_dtype = parse_dtype(dtype)
    layout.validate(ckpt.dims)
    ckpt.check_files()
    outputs = plan_sharded(ckpt.family, ckpt.dims, layout, format)

    def finish(stage: Path, records: list[FileRecord]) -> None:
        _write_json(stage / "config.json", _config_for_output(ckpt, target_dtype))
        _copy_side_files(ckpt, stage)
        dtype_name = str(target_dtype or ckpt.dtype()).replace("torch.", "")
        _write_json(stage / MANIFEST, manifest(
            fmt=format, family=ckpt.family.name, layout=layout, dtype=dtype_name, records=records,
            tensors=ckpt.full_shapes, source=str(ckpt.root), command=command))

    records = produce(ckpt, outputs, Path(dst), format, target_dtype, workers, overwrite, progress, finish,
                      verify_hashes=verify_hashes)
    log.info("wrote %d files (%s) to %s", len(records), layout.describe(), dst)
    return Result(Path(dst), records, layout, format)


def merge_checkpoint(
    ckpt: Checkpoint,
    dst: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: ProgressCallback | None = None,
    verify_hashes: bool = True,
) -> Result:
    """Write `ckpt` as a Hugging Face model directory (safetensors + index + config).

    `verify_hashes`: check each source file against the sha256 in its manifest when first read."""
    target_dtype = parse_dtype(dtype)
    ckpt.check_files()
    itemsize = (target_dtype or ckpt.dtype()).itemsize
    outputs, index = plan_full(ckpt.family, ckpt.dims, itemsize, max_shard_size)

    def finish(stage: Path, records: list[FileRecord]) -> None:
        if index is not None:
            _write_json(stage / "model.safetensors.index.json", index)
        _write_json(stage / "config.json", _config_for_output(ckpt, target_dtype))
        _copy_side_files(ckpt, stage)

    records = produce(ckpt, outputs, Path(dst), "safetensors", target_dtype, workers, overwrite, progress, finish,
                      verify_hashes=verify_hashes)
    log.info("merged %s into %s (%d files)", ckpt.root, dst, len(records))
    return Result(Path(dst), records, FULL, "safetensors")
