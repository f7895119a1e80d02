"""Weights in and out, through shardkit's checkpoint API (never the whole model on one rank).

In: the rank's pieces for the run's layout (`ModelSpec.rank_pieces`), each read from the
`--model` checkpoint whatever its layout or format (`SourceReader.read_piece` reads only the
slices a piece is made of: a Hugging Face directory is sharded on load, a sharded directory of
another layout is resharded on load).

Out (`--export-hf`): every model replica-0 rank saves its rank file (its `state_dict()`, which is
the NxD rank file by construction) as a model-only checkpoint tag in a staging directory, with
shardkit's `Checkpointer`; then `export_checkpoint` (divided among the job's processes) merges
the tag into the Hugging Face directory.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from shardkit.api import export_checkpoint
from shardkit.checkpoint import Checkpointer, CheckpointerConfig, Rank
from shardkit.formats import SourceReader
from shardkit.formats import Checkpoint, hf

from .model import ModelSpec
from .parallel import Parallel

EXPORT_TAG = "export"


def read_rank_pieces(ckpt: Checkpoint, spec: ModelSpec, tp_rank: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """This rank's pieces for the run's layout, read from any checkpoint."""
    reader = SourceReader(ckpt)
    try:
        return {p.name: reader.read_piece(p) for p in spec.rank_pieces(tp_rank, pp_rank)}
    finally:
        reader.close()


def check_export_destination(dst: str | Path) -> None:
    from .errors import TrainerError

    dst = Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise TrainerError(f"--export-hf {dst} exists and is not empty: choose another directory or remove it")


def export_hf(model: torch.nn.Module, spec: ModelSpec, par: Parallel, dst: str | Path, source_dir: str | Path | None,
              dtype: torch.dtype) -> Path:
    """Write the merged Hugging Face model of the current weights to `dst` (all ranks call this):
    the rank files are saved as a model-only checkpoint tag in a staging folder, which
    `export_checkpoint` merges (divided among the job's processes)."""
    dst = Path(dst).absolute()
    staging = dst.parent / f".{dst.name}.trainer-export-{os.getpid()}"
    staging = Path(par.broadcast_object(str(staging) if par.leader else None))
    checkpointer = Checkpointer(CheckpointerConfig(format="torch", fsync=False))  # a throwaway tag

    def copy_side_files() -> None:
        if par.leader and source_dir is not None and Path(source_dir).is_dir():
            hf.copy_side_files(Path(source_dir), staging / EXPORT_TAG)

    try:
        state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
        rank = Rank(tp=par.tp_rank, pp=par.pp_rank, ep=0, dp=par.dp_rank)
        checkpointer.save(staging, EXPORT_TAG, state, layout=spec.layout, config=spec.config, rank=rank)
        par.all_ok(copy_side_files)
        export_checkpoint(staging, dst, EXPORT_TAG, dtype=dtype)
    finally:
        checkpointer.close()
        par.barrier()
        if par.leader:
            shutil.rmtree(staging, ignore_errors=True)
    return dst
