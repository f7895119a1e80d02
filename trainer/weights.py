"""Weights in and out, through shardkit's checkpoint API (never the whole model on one rank).

In: the rank's pieces for the run's layout (`ModelSpec.rank_pieces`), each read from the
`--model` checkpoint whatever its layout or format (`SourceReader.read_piece` reads only the
slices a piece is made of: a Hugging Face directory is sharded on load, a sharded directory of
another layout is resharded on load).

Out (`--export-hf`): every model replica-0 rank saves its rank file (its `state_dict()`, which is
the NxD rank file by construction) as a model-only checkpoint tag in a staging directory, with
shardkit's `Checkpointer`; then `export_checkpoint` (divided among the job's processes) merges
the tag into the Hugging Face directory, replacing what is there (the destination was checked
before the job started, `check_export_destination`), and rank 0 adds `trainer-export.json`: which
run (--model, --data, --checkpoint-dir) and step it holds. That marker is what lets the same
command run again: its own earlier export is replaced, or kept when it already holds the final
step; any other non-empty directory needs `--overwrite-export`.

From a config (`--model-config`, pre-training): `init_rank_pieces` draws the rank's pieces from
full tensors that are a function of (--seed, tensor name) only, never of the layout, so every
layout starts from the same full weights. The rule (transformers' `_init_weights` distributions
for these families): matrices ~ N(0, initializer_range) (0.02 when absent), the embedding row of
`pad_token_id` zero, 1-D weights (norm scales) one (zero for Gemma's (1 + w) norms), biases zero. A full tensor's rows are drawn in
blocks of `INIT_BLOCK_ROWS`, each from its own generator seeded by sha256(seed, name, block), so a
rank draws only the blocks of rows its pieces touch (all of them, one block at a time, for a
piece split by columns) and never holds a whole tensor. The values differ from
`AutoModelForCausalLM.from_config` after `torch.manual_seed`, whose single random stream makes
every tensor depend on all the tensors drawn before it (so a rank could not draw its slice alone).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from shardkit.api import export_checkpoint
from shardkit.checkpoint import Checkpointer, CheckpointerConfig, Rank
from shardkit.distributed import alone
from shardkit.formats import Checkpoint, SourceReader, hf
from shardkit.io.location import RemoteLocation, is_url
from shardkit.io.location import remote as remote_location
from shardkit.io.safety.overlap import resolved
from shardkit.io.safety.small import SmallFileError, read_json
from shardkit.io.safety.transaction import private_root, scratch_folder
from shardkit.io.store import hidden, prefix
from shardkit.placements import Segment, build_piece

from .errors import TrainerError
from .model import ModelSpec
from .moe import file_state, stage_pieces
from .parallel import Parallel

log = logging.getLogger("trainer")
EXPORT_TAG = "export"
EXPORT_MARKER = "trainer-export.json"


def read_rank_pieces(
    ckpt: Checkpoint, spec: ModelSpec, tp_rank: int, pp_rank: int, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's pieces for the run's layout (with ep, its own experts), read from any checkpoint."""
    reader = SourceReader(ckpt)
    try:
        return {p.name: reader.read_piece(p) for p in stage_pieces(spec, tp_rank, pp_rank, ep_rank)}
    finally:
        reader.close()


INIT_BLOCK_ROWS = 256


def _block_seed(seed: int, source: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}/{source}/{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class InitialWeights:
    """The full tensors of `--model-config`'s random init, read by segment (see the module doc)."""

    def __init__(self, spec: ModelSpec, seed: int):
        self.shapes = spec.full_shapes
        self.seed = seed
        self.std = float(spec.config.get("initializer_range") or 0.02)
        pad = spec.config.get("pad_token_id")
        self.pad = pad if isinstance(pad, int) and not isinstance(pad, bool) else None
        self.norm_scale = 0.0 if spec.gemma else 1.0  # Gemma's norms scale by (1 + w): w starts at 0

    def rows(self, source: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) (dim 0) of full tensor `source`, fp32."""
        shape = self.shapes[source]
        if len(shape) == 1 or source.endswith(".bias"):
            fill = 0.0 if source.endswith(".bias") else self.norm_scale
            return torch.full((stop - start, *shape[1:]), fill, dtype=torch.float32)
        out = torch.empty((stop - start, *shape[1:]), dtype=torch.float32)
        for block in range(start // INIT_BLOCK_ROWS, (stop - 1) // INIT_BLOCK_ROWS + 1):
            lo, hi = block * INIT_BLOCK_ROWS, min((block + 1) * INIT_BLOCK_ROWS, shape[0])
            gen = torch.Generator().manual_seed(_block_seed(self.seed, source, block))
            values = torch.empty((hi - lo, *shape[1:]), dtype=torch.float32).normal_(0.0, self.std, generator=gen)
            a, b = max(lo, start), min(hi, stop)
            out[a - start : b - start] = values[a - lo : b - lo]
        if self.pad is not None and source.endswith("embed_tokens.weight") and start <= self.pad < stop:
            out[self.pad - start].zero_()
        return out

    def segment(self, seg: Segment) -> torch.Tensor:
        if seg.dim == 0:
            return self.rows(seg.source, seg.start, seg.stop)
        rows = self.shapes[seg.source][0]
        return torch.cat(
            [
                self.rows(seg.source, lo, min(lo + INIT_BLOCK_ROWS, rows)).narrow(
                    seg.dim, seg.start, seg.stop - seg.start
                )
                for lo in range(0, rows, INIT_BLOCK_ROWS)
            ]
        )


def init_rank_pieces(
    spec: ModelSpec, seed: int, tp_rank: int, pp_rank: int, ep_rank: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's pieces of the random init of `--model-config` (the same full weights for every
    layout; module doc)."""
    weights = InitialWeights(spec, seed)
    return {p.name: build_piece(p, weights.segment) for p in stage_pieces(spec, tp_rank, pp_rank, ep_rank)}


def absolute(path: str) -> str:
    """A path option as recorded: a local path made absolute, an s3:// URL as it is."""
    return path if is_url(path) else str(Path(path).absolute())


def export_run(cfg) -> dict[str, Any]:
    """What identifies a run's exports: its --model (or --model-config), --data and --checkpoint-dir
    (absolute)."""

    def where(path: str | None) -> str | None:
        return absolute(path) if path else None

    run = {"model": where(cfg.model), "data": where(cfg.data), "checkpoint_dir": where(cfg.checkpoint_dir)}
    if getattr(cfg, "model_config", None):
        run["model_config"] = where(cfg.model_config)
    if getattr(cfg, "lora_rank", 0):  # a LoRA run exports adapters or the merged model: not the same output
        run["lora"] = "adapters" if cfg.export_lora else "merged"
    return run


def _marker(dst: Path) -> dict[str, Any] | None:
    try:
        marker = read_json(dst / EXPORT_MARKER, EXPORT_MARKER)
    except SmallFileError:
        return None
    return marker if isinstance(marker, dict) else None


def _inputs(cfg) -> list[tuple[str, Path | RemoteLocation]]:
    named = [
        ("--model", cfg.model),
        ("--model-config", getattr(cfg, "model_config", None)),
        ("--checkpoint-dir", cfg.checkpoint_dir),
    ]
    if cfg.resume and (is_url(cfg.resume) or Path(cfg.resume).exists()):
        named.append(("--resume", cfg.resume))
    return [(flag, remote_location(path, flag) or resolved(path)) for flag, path in named if path]


def check_export_destination(cfg) -> int | None:
    """Check --export-hf before the job starts (nothing is written). Returns the step of this run's
    own earlier export found there, or None when there is none."""
    loc = remote_location(cfg.export_hf, "--export-hf")
    if loc is not None:
        return _check_remote_export(cfg, loc)
    dst = resolved(cfg.export_hf)  # real paths: an alias (`..`, a symlink) of an input is that input
    for flag, src in _inputs(cfg):
        if isinstance(src, RemoteLocation):
            continue
        if dst == src or dst in src.parents or (flag != "--checkpoint-dir" and src in dst.parents):
            raise TrainerError(f"--export-hf {cfg.export_hf} overlaps {flag} {src}: export to another directory")
    if dst.exists() and not dst.is_dir():
        raise TrainerError(f"--export-hf {cfg.export_hf} is a file: give a directory")
    if not dst.is_dir() or not any(dst.iterdir()):
        return None
    marker = _marker(dst)
    if marker is not None and marker.get("run") == export_run(cfg):
        return int(marker.get("step", -1))
    if cfg.overwrite_export:
        return None
    raise TrainerError(
        f"--export-hf {cfg.export_hf} exists, is not empty and is not an earlier export of this run: "
        "choose another directory, or pass --overwrite-export to replace it"
    )


def _check_remote_export(cfg, loc: RemoteLocation) -> int | None:
    """`check_export_destination` of an s3:// --export-hf: not overlapping an s3:// input, not
    written by a job of several hosts (rank 0 merges it from its host's staging), and empty, or
    this run's earlier export, or with --overwrite-export an output shardkit wrote there."""
    for flag, src in _inputs(cfg):
        if isinstance(src, RemoteLocation) and (src.contains(loc) if flag == "--checkpoint-dir" else loc.overlaps(src)):
            raise TrainerError(f"--export-hf {cfg.export_hf} overlaps {flag} {src}: export to another prefix")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > int(os.environ.get("LOCAL_WORLD_SIZE", str(world))):
        raise TrainerError(
            f"--export-hf {cfg.export_hf}: a job of several hosts exports to a local or shared folder, not to "
            "s3:// (rank 0 merges the export from the files its own host stages); export there, then copy it"
        )
    objects = prefix(loc)
    listed = objects.listing()
    if not [o for o in listed if not hidden(o.name)]:
        objects.check_bucket()
        return None
    marker = next((o for o in objects.published(listed) if o.name == EXPORT_MARKER), None)
    raw = objects.get(marker.stored or marker.name) if marker is not None else None
    try:
        found = json.loads(raw) if raw is not None else None
    except ValueError:
        found = None
    if isinstance(found, dict) and found.get("run") == export_run(cfg):
        return int(found.get("step", -1))
    if cfg.overwrite_export:
        objects.replaceable([o.name for o in listed])  # objects shardkit did not write are never replaced
        return None
    raise TrainerError(
        f"--export-hf {cfg.export_hf} holds objects and is not an earlier export of this run: choose another "
        "prefix, or pass --overwrite-export to replace it"
    )


def _scratch_near(dst: str | Path) -> Path:
    """Where an export's scratch tag goes (beside it: `scratch_folder`): beside a local --export-hf;
    for s3://, in this user's private folder of the temporary folder (`private_root`)."""
    loc = remote_location(dst, "--export-hf")
    if loc is None:
        return Path(dst).absolute()
    digest = hashlib.sha256(str(loc).encode()).hexdigest()[:16]
    return private_root(None, "trainer-export") / digest


@contextlib.contextmanager
def staged_tag(par: Parallel, dst: str | Path, what: str) -> Iterator[tuple[Path, Checkpointer]]:
    """A scratch folder beside `dst` (one path for every rank, `io.safety.transaction.scratch_folder`; for
    an s3:// `dst` in the temporary folder) and a throwaway Checkpointer to save a tag into it, for
    an export (`what`); the Checkpointer is closed and, once every rank is done, the folder is
    removed."""
    checkpointer = par.comm.checkpointer(CheckpointerConfig(format="torch", fsync=False))
    with scratch_folder(_scratch_near(dst), par.job) as scratch:
        log.debug("%s: scratch tag in %s", what, scratch)
        try:
            yield scratch, checkpointer
        finally:
            checkpointer.close()


def export_hf(
    model: torch.nn.Module,
    spec: ModelSpec,
    par: Parallel,
    dst: str | Path,
    source_dir: str | Path | None,
    dtype: torch.dtype,
    run: dict[str, Any],
    step: int,
    tensors: dict[str, torch.Tensor] | None = None,
) -> str | Path:
    """Write the merged Hugging Face model of the current weights (of `step`) to `dst`, replacing
    it (all ranks call this): the rank files are saved as a model-only checkpoint tag in a staging
    folder, which `export_checkpoint` merges (divided among the job's processes; into s3://, by
    rank 0 alone, uploaded and committed as every shardkit output in object storage); rank 0 then
    marks it as `run`'s export. `tensors`: the rank's pieces to write instead of the model's own
    (LoRA's merged weights)."""
    remote = remote_location(dst, "--export-hf") is not None
    dst = str(dst) if remote else Path(dst).absolute()
    with staged_tag(par, dst, "export") as (staging, checkpointer):

        def copy_side_files() -> None:
            if par.leader and source_dir is not None and Path(source_dir).is_dir():
                hf.copy_side_files(Path(source_dir), staging / EXPORT_TAG)

        pieces = tensors if tensors is not None else model.state_dict()
        state = file_state({k: v.detach().to(dtype) for k, v in pieces.items()}, par.ep_rank)
        rank = Rank(tp=par.tp_rank, pp=par.pp_rank, ep=par.ep_rank, dp=par.edp_rank)
        checkpointer.save(staging, EXPORT_TAG, state, layout=spec.layout, config=spec.config, rank=rank)
        par.all_ok(copy_side_files)
        marker = {EXPORT_MARKER: json.dumps({"run": run, "step": step}, indent=2) + "\n"}

        def merge_alone() -> None:
            if par.leader:
                with alone():
                    export_checkpoint(staging, dst, EXPORT_TAG, dtype=dtype, overwrite=True, extra_files=marker)

        if remote:
            par.all_ok(merge_alone)
        elif par.leader or not par.comm.shares_process:  # shardkit divides the merge among processes
            export_checkpoint(staging, dst, EXPORT_TAG, dtype=dtype, overwrite=True, extra_files=marker)
    return dst
