"""Weights in and out, through shardkit's checkpoint API (never the whole model on one rank).

In: the rank's pieces for the run's layout (`ModelSpec.rank_pieces`), each read from the
`--model` checkpoint whatever its layout or format (`SourceReader.read_piece` reads only the
slices a piece is made of: a Hugging Face directory is sharded on load, a sharded directory of
another layout is resharded on load).

Out (`--export-hf`): every model replica-0 rank writes its rank file (its `state_dict()`, which is
the NxD rank file by construction) into a staging directory with a shardkit manifest; then
`shardkit.merge` (divided among the job's processes) writes the Hugging Face directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from shardkit import __version__ as shardkit_version
from shardkit import merge
from shardkit.convert import SourceReader
from shardkit.formats import MANIFEST, Checkpoint
from shardkit.formats import hf, nxd

from .model import ModelSpec
from .parallel import Parallel


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
    """Write the merged Hugging Face model of the current weights to `dst` (all ranks call this)."""
    dst = Path(dst).absolute()
    staging = dst.parent / f".{dst.name}.trainer-export-{os.getpid()}"
    staging = Path(par.broadcast_object(str(staging) if par.leader else None))

    def make_staging() -> None:
        if par.leader:
            (staging / "model").mkdir(parents=True, exist_ok=True)

    def write_rank_files() -> None:
        if par.dp_rank == 0:
            state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
            name = nxd.rank_file_name(0, par.tp_rank, par.pp_rank, spec.layout, "torch")
            torch.save(state, staging / name)
        if par.leader:
            config = dict(spec.config)
            config["torch_dtype"] = config["dtype"] = str(dtype).replace("torch.", "")
            (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if source_dir is not None and Path(source_dir).is_dir():
                hf.copy_side_files(Path(source_dir), staging)
            manifest = {"shardkit": shardkit_version, "kind": "sharded", "format": "torch",
                        "family": spec.family.name, "layout": spec.layout.to_dict(),
                        "dtype": config["dtype"], "source": "trainer", "command": "trainer --export-hf",
                        "tensors": {n: list(s) for n, s in spec.full_shapes.items()}, "files": []}
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")

    try:
        par.all_ok(make_staging)
        par.all_ok(write_rank_files)
        merge(staging, dst)
    finally:
        par.barrier()
        if par.leader:
            shutil.rmtree(staging, ignore_errors=True)
    return dst
