"""Training checkpoints through shardkit.checkpoint: save in the run's layout, resume in ANY layout.

Save (every `--checkpoint-every` steps and at the end, tag `step_<N>` under `--checkpoint-dir`):
every rank calls `Checkpointer.save` with its model pieces (`model.state_dict()`, which is the
rank file), its optimizer state keyed by piece name (`exp_avg`, `exp_avg_sq`, `step`, and the fp32
`master` of bf16 parameters) with NxD's two param groups, the LR schedule's state and
`user_content` = {step, data position}: NxD's tree and ZeRO-1 optimizer files. Without ZeRO-1 the
dp > 0 replicas write nothing (dp rank 0 writes one optimizer file per (tp, pp) rank); with
ZeRO-1 every dp rank passes its own shards (already cut as NxD cuts them) and writes its own
`optim/dp_rank_DD_...` file, all in parallel; nothing is gathered. `--async-save` writes in the
background; `--num-kept` / `--keep-every` prune old tags.

Resume (`--resume`): `load_checkpoint(..., target_layout=this run's layout, rank=this rank)` reads
exactly this rank's pieces and moments from a checkpoint saved in any layout and dp size (dp
shards merged, resharded slice by slice, moments like their parameters); the optimizer keeps its
own rows. NxD's own checkpoints resume too: no config.json (the model's comes from --model), the
checkpoint's betas / eps / weight decay are adopted, and NxD's cosine schedule continues. The
checkpoint's config must be the model's: that, the tag's completeness and the rest are checked
before any process group exists.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint import (
    LATEST_IF_EXISTS,
    CheckpointerConfig,
    OptimizerState,
    Rank,
    load_checkpoint,
    resolve_tag,
)
from shardkit.checkpoint.tree import CHECKPOINT_MARKER, DONE_MARKER
from shardkit.families.lora import base_config
from shardkit.formats import load_config
from shardkit.io import remote as remote_io
from shardkit.io.location import is_url
from shardkit.layout import ModelDims

from . import lora
from .errors import TrainerError
from .moe import file_state

log = logging.getLogger("trainer")


@dataclass
class ResumePoint:
    """A complete checkpoint tag to resume from (resolved before the job starts)."""

    directory: Path
    tag: str
    config: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.directory / self.tag


def _resolve(cfg) -> tuple[Path, str | None] | None:
    """(checkpoint directory, tag or None for the newest) for --resume; None: nothing to resume."""
    spec = cfg.resume
    if spec is None:
        return None
    if spec == LATEST_IF_EXISTS:
        if not cfg.checkpoint_dir:
            raise TrainerError("--resume latest_if_exists needs --checkpoint-dir (where to look for checkpoints)")
        found = remote_io.readable(cfg.checkpoint_dir, "--checkpoint-dir")  # s3://: a local mirror
        return None if found is None else (found, LATEST_IF_EXISTS)
    path = remote_io.readable(spec, "--resume") or Path(spec)
    if not path.exists():
        raise TrainerError(
            f"--resume {path} does not exist: give a checkpoint tag directory, a checkpoint "
            "directory, or latest_if_exists"
        )
    if (path / CHECKPOINT_MARKER).exists() or (path / DONE_MARKER).exists():
        return path.parent, path.name
    return path, None


def find_resume(cfg, model_config: Mapping[str, Any] | None) -> ResumePoint | None:
    """The checkpoint --resume names, checked against the model (no process group, no writes)."""
    where = _resolve(cfg)
    if where is None:
        return None
    directory, tag = where
    name = resolve_tag(directory, tag)
    if name is None:
        log.info("no checkpoint in %s yet: starting from %s", directory, cfg.model)
        return None
    tag_dir = directory / name
    remote_io.prepare_path(tag_dir)  # a tag in object storage: its files' metadata fetched
    if not (tag_dir / "config.json").is_file():
        lora.check_checkpoint(cfg, None, tag_dir)
        if model_config is None:  # an NxD checkpoint carries no config: the model's comes from --model
            raise TrainerError(
                f"checkpoint {tag_dir} has no config.json (an NxD checkpoint): pass --model with the "
                "model's Hugging Face config"
            )
        return ResumePoint(directory, name, dict(model_config))
    saved = load_config(tag_dir / "config.json")
    lora.check_checkpoint(cfg, saved, tag_dir)
    if model_config is not None:  # (an adapter checkpoint's config wraps its model's)
        a, b = ModelDims.from_config(base_config(saved)), ModelDims.from_config(model_config)
        if a != b:
            field_name = next(f for f in a.__dataclass_fields__ if getattr(a, f) != getattr(b, f))
            raise TrainerError(
                f"checkpoint {tag_dir} is of another model ({field_name} {getattr(a, field_name)!r}, the model "
                f"has {getattr(b, field_name)!r}): resume with that model's --model, or another checkpoint"
            )
    return ResumePoint(directory, name, saved)


@dataclass
class Restored:
    """What a resume hands the run: this rank's pieces, optimizer state and position."""

    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, Any]]
    scheduler: Any
    step: int
    data: Mapping[str, Any]
    param_groups: list[dict[str, Any]] = field(default_factory=list)  # the checkpoint's hyperparameters
    groups: dict[str, int] = field(default_factory=dict)  # piece -> index into param_groups


def load(point: ResumePoint, spec, par) -> Restored:
    """This rank's part of the checkpoint, in the run's layout (call on every rank)."""

    def read(ep: int):
        rank = Rank(tp=par.tp_rank, pp=par.pp_rank, ep=ep, dp=par.edp_rank)
        loaded = load_checkpoint(point.directory, point.tag, target_layout=spec.layout, rank=rank, config=spec.config)
        if loaded is None:  # resolved before; it vanished since
            raise TrainerError(f"checkpoint {point.path} disappeared before it could be loaded")
        return loaded

    loaded = read(par.ep_rank)
    if par.ep_rank:  # an ep rank's file holds its experts; the dense pieces are ep rank 0's
        dense = read(0)
        loaded.model = {**dense.model, **loaded.model}
        if dense.optimizer is not None and loaded.optimizer is not None:
            loaded.optimizer.state = {**dense.optimizer.state, **loaded.optimizer.state}
            loaded.optimizer.groups = {**dense.optimizer.groups, **loaded.optimizer.groups}
    content = loaded.user_content if isinstance(loaded.user_content, Mapping) else {}
    step = int(content.get("step", loaded.step or 0))
    optimizer = dict(loaded.optimizer.state) if loaded.optimizer is not None else {}
    if not optimizer:
        log.warning("checkpoint %s has no optimizer state: Adam restarts from zero moments", point.path)
    if "data" not in content and par.leader:
        log.warning(
            "checkpoint %s records no data position (not the trainer's): the data starts from the beginning of --data",
            point.path,
        )
    opt = loaded.optimizer
    return Restored(
        dict(loaded.model),
        optimizer,
        loaded.scheduler,
        step,
        content.get("data") or {},
        [dict(g) for g in opt.param_groups] if opt is not None else [],
        dict(opt.groups) if opt is not None else {},
    )


def apply(restored: Restored, optimizer, schedule, batches) -> int:
    """Give the restored state to the optimizer, schedule and data; returns the step to start at."""
    optimizer.load_state_dict(restored.optimizer, restored.param_groups, restored.groups)
    if isinstance(restored.scheduler, Mapping):
        schedule.load_state_dict(restored.scheduler)
    batches.load_state(restored.data, log)
    return restored.step


class Saver:
    """Saves the run's checkpoints (create on every rank at the same point: it makes a group)."""

    def __init__(self, plan, par, spec=None):
        cfg = plan.cfg
        self.plan, self.par = plan, par
        self.spec = spec or plan.spec  # what the saved pieces are cut from (LoRA: the adapters' spec)
        # s3://bucket/prefix is handed to shardkit's Checkpointer as it is (saved, then uploaded)
        self.root = cfg.checkpoint_dir if is_url(cfg.checkpoint_dir) else Path(cfg.checkpoint_dir)
        self.checkpointer = par.comm.checkpointer(
            CheckpointerConfig(
                format=cfg.checkpoint_format,
                async_save=cfg.async_save,
                num_kept=cfg.num_kept or None,
                keep_every=cfg.keep_every or None,
            )
        )

    def save(self, step: int, model, optimizer, schedule, batches) -> str:
        """Every rank: its pieces (dp rank 0 writes them) and its optimizer state: with ZeRO-1 its
        own NxD shards, written by itself; without, dp rank 0's (the replicas hold the same)."""
        tag = f"step_{step}"
        zero1 = optimizer.zero1
        # on a lazy backend every tensor moves to the host once, together, before shardkit sees it
        to_host = self.par.comm.to_host if self.par.comm.lazy else None
        states = None
        if zero1 or self.par.edp_rank == 0:
            param_groups, groups = optimizer.save_param_groups(schedule.at(step))
            states = OptimizerState(file_state(optimizer.state_dict(to_host), self.par.ep_rank), param_groups, groups)
        model_state = file_state({k: v.detach() for k, v in model.state_dict().items()}, self.par.ep_rank)
        if to_host is not None:
            model_state = dict(zip(model_state, to_host(list(model_state.values()))))
        user_content = {
            "step": step,
            "data": batches.state().to_dict(),
            "trainer": {
                "layout": self.spec.layout.to_dict(),
                "dp": self.par.dp,
                "zero1": bool(self.plan.cfg.zero1),
                "dtype": self.plan.cfg.dtype,
            },
        }
        rank = Rank(tp=self.par.tp_rank, pp=self.par.pp_rank, ep=self.par.ep_rank, dp=self.par.edp_rank)
        self.checkpointer.save(
            self.root,
            tag,
            model_state,
            states,
            schedule.state_dict(),
            user_content,
            layout=self.spec.layout,
            config=self.spec.config,
            rank=rank,
            step=step,
            zero1=zero1,
        )
        return tag

    def finish(self) -> None:
        """Wait for a background save (its error is raised here) and release the writer."""
        self.checkpointer.close()
