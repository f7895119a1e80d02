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

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from shardkit.checkpoint import (
    LATEST_IF_EXISTS,
    CheckpointerConfig,
    OptimizerState,
    Rank,
    list_checkpoints,
    load_checkpoint,
    resolve_tag,
)
from shardkit.checkpoint.tree import CHECKPOINT_MARKER, DONE_MARKER
from shardkit.families.lora import base_config
from shardkit.formats import load_config
from shardkit.io.location import is_url, parse_location
from shardkit.io.records import claim_record, read_head, read_record
from shardkit.io.safety.overlap import resolved
from shardkit.io.store import Store, named, readable
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
    store: Store | None = field(default=None, repr=False)  # what it is read through (an s3:// one's mirror)

    @property
    def path(self) -> Path:
        return self.directory / self.tag

    @property
    def shown(self) -> str:
        """The tag as messages name it: its s3:// URL when it is read through a mirror."""
        return named(self.path)


def _resolve(cfg) -> tuple[Path, str | None, Store] | None:
    """(checkpoint directory, tag or None for the newest, the store it is read through) for
    --resume; None: nothing to resume."""
    spec = cfg.resume
    if spec is None:
        return None
    if spec == LATEST_IF_EXISTS:
        if not cfg.checkpoint_dir:
            raise TrainerError("--resume latest_if_exists needs --checkpoint-dir (where to look for checkpoints)")
        found = readable(cfg.checkpoint_dir, "--checkpoint-dir")  # s3://: a local mirror
        return None if found is None else (found.root, LATEST_IF_EXISTS, found)
    store = readable(spec, "--resume") or Store(spec)
    path = store.root
    if not path.exists():
        raise TrainerError(
            f"--resume {path} does not exist: give a checkpoint tag directory, a checkpoint "
            "directory, or latest_if_exists"
        )
    if (path / CHECKPOINT_MARKER).exists() or (path / DONE_MARKER).exists():
        return path.parent, path.name, store
    return path, None, store


def find_resume(cfg, model_config: Mapping[str, Any] | None) -> ResumePoint | None:
    """The checkpoint --resume names, checked against the model (no process group, no writes)."""
    where = _resolve(cfg)
    if where is None:
        return None
    directory, tag, store = where
    name = resolve_tag(directory, tag)
    if name is None:
        log.info("no checkpoint in %s yet: starting from %s", named(directory), cfg.model)
        return None
    tag_dir = directory / name
    if not (tag_dir / "config.json").is_file():
        lora.check_checkpoint(cfg, None, tag_dir)
        if model_config is None:  # an NxD checkpoint carries no config: the model's comes from --model
            raise TrainerError(
                f"checkpoint {tag_dir} has no config.json (an NxD checkpoint): pass --model with the "
                "model's Hugging Face config"
            )
        return ResumePoint(directory, name, dict(model_config), store)
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
    return ResumePoint(directory, name, saved, store)


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
        loaded = load_checkpoint(
            point.directory, point.tag, target_layout=spec.layout, rank=rank, config=spec.config, store=point.store
        )
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
        log.warning("checkpoint %s has no optimizer state: Adam restarts from zero moments", point.shown)
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


# ---- whose a checkpoint folder is: the run record --------------------------------------------------------

RUN_FILE = "run.json"
RUN_FORMAT = "shardkit-trainer-run"
RUN_VERSION = 1

# Options a run's jobs may change without becoming another run: where things are (the model's and
# the data's identities are recorded instead), the layout, evaluation, checkpointing, outputs and
# the runtime. Every other option (seed, schedule, batch and sequence sizes, optimizer, dtype,
# LoRA, MoE capacity, task...: an option added later too) defines the run.
JOB_OPTIONS = frozenset(
    {
        *("model", "model_config", "data", "eval_data", "text_column", "tokenizer", "data_cache"),
        *("eval_every", "eval_steps"),
        *("tp", "pp", "vpp", "pp_schedule", "dp", "ep", "kv_multiplier", "kv_replication", "qkv", "zero1"),
        *("sequence_parallel", "activation_checkpointing", "micro_batch", "grad_bucket_mb"),
        *("checkpoint_dir", "checkpoint_every", "num_kept", "keep_every", "async_save", "checkpoint_format"),
        *("resume", "override_schedule"),
        *("export_hf", "export_lora", "overwrite_export", "metrics", "tensorboard", "log_every", "progress"),
        *("device", "timeout", "threads", "debug"),
    }
)
VOLATILE_CONFIG = ("_name_or_path", "transformers_version")  # config.json keys that say nothing of the model


@dataclass(frozen=True)
class RunRecord:
    """What defines a training run, whatever its layout: the model (its path and a digest of its
    config), the data (its identity, as a resume compares it) and the settings (`JOB_OPTIONS`
    aside). Written as `run.json` into the run's checkpoint folder; `id` names the run."""

    model: dict[str, Any]
    data: dict[str, Any]
    settings: dict[str, Any]

    @property
    def id(self) -> str:
        data = self.data.get("identity") or self.data.get("path")
        text = json.dumps({"model": self.model, "data": data, "settings": self.settings}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def to_json(self) -> bytes:
        body = {"format": RUN_FORMAT, "version": RUN_VERSION, "run": self.id, "model": self.model}
        body.update(data=self.data, settings=self.settings)
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> RunRecord:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        parts = [body.get(k) for k in ("model", "data", "settings")] if isinstance(body, dict) else []
        if not parts or body.get("format") != RUN_FORMAT or not all(isinstance(p, dict) for p in parts):
            raise TrainerError(
                f"{where} is not a trainer run record ({RUN_FORMAT}): remove it if nothing else uses the folder, "
                "or choose another --checkpoint-dir"
            )
        model, data, settings = (dict(p) for p in parts if isinstance(p, dict))
        return cls(model, data, settings)

    def changes(self, other: RunRecord) -> str:
        """What `other` (this run) changes of this record's run, as `--seed 1 -> 2, other --data`."""
        said = []
        if self.model.get("path") != other.model.get("path"):
            said.append(f"--model {self.model.get('path')} -> {other.model.get('path')}")
        elif self.model != other.model:
            said.append("another model config")
        if self.data != other.data:
            said.append(f"other --data ({self.data.get('path')} -> {other.data.get('path')})")
        for key in sorted(set(self.settings) | set(other.settings)):
            if self.settings.get(key) != other.settings.get(key):
                said.append(f"--{key.replace('_', '-')} {self.settings.get(key)} -> {other.settings.get(key)}")
        return ", ".join(said[:4]) + (", ..." if len(said) > 4 else "")


def describe_run(plan) -> RunRecord:
    """This job's run record, from its plan."""
    cfg = plan.cfg
    start = cfg.model or cfg.model_config
    path = None if not start else start if is_url(start) else str(resolved(start))
    config = {k: v for k, v in plan.spec.config.items() if k not in VOLATILE_CONFIG}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()
    tokens = plan.tokens
    shown = cfg.data if is_url(cfg.data) else str(resolved(cfg.data))
    data = {"path": tokens.shown if tokens is not None else shown, "identity": getattr(tokens, "identity", None)}
    settings = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in JOB_OPTIONS}
    return RunRecord({"path": path, "config": digest}, data, json.loads(json.dumps(settings, default=str)))


def read_run(where: str | Path | None) -> RunRecord | None:
    """The run record of the checkpoint folder (or s3:// prefix) `where`; None when it has none."""
    if where is None:
        return None
    raw = read_record(where, RUN_FILE, "run record")
    return None if raw is None else RunRecord.from_json(raw, f"{where}/{RUN_FILE}")


def _tags(where: str) -> list[str]:
    """Every tag of the checkpoint folder `where`, complete or not, oldest first."""
    if not is_url(where) and not Path(where).is_dir():
        return []
    return [i.tag for i in list_checkpoints(where, details=False)]


def _whose(owner: RunRecord | None, tags: list[str]) -> str:
    listed = ", ".join(tags) if len(tags) <= 3 else f"{tags[0]} ... {tags[-1]}, {len(tags)} tags"
    if owner is None:
        return f"checkpoints no run record names ({listed}: an older trainer's, or NxD's)"
    return (
        f"run {owner.id}'s checkpoints ({listed})" if tags else f"run {owner.id}'s record ({RUN_FILE}, no checkpoint)"
    )


def _source_folder(point: ResumePoint) -> str:
    """Where the checkpoint --resume reads lies: its folder, or the s3:// prefix its mirror stands for."""
    return named(point.directory)


def _same_folder(a: str, b: str) -> bool:
    if is_url(a) or is_url(b):
        return is_url(a) and is_url(b) and str(parse_location(a)).rstrip("/") == str(parse_location(b)).rstrip("/")
    return resolved(a) == resolved(b)


def check_run(plan) -> RunRecord:
    """The run this job is part of (the record its checkpoint folder keeps and its metrics name),
    refused in one line when --checkpoint-dir or the metrics file belongs to another run: a fresh
    run never writes beside another run's tags (nor, then, has latest_if_exists pick them or
    --num-kept delete them). Reads only; call on every rank before anything is written."""
    cfg, point, mine = plan.cfg, plan.resume, describe_run(plan)
    folder = cfg.checkpoint_dir
    owner, tags = (read_run(folder), _tags(folder)) if folder else (None, [])
    if point is not None:  # continuing a run: the one its checkpoint's folder records (or this one)
        here = bool(folder) and _same_folder(_source_folder(point), folder)
        source = owner if here else read_run(_source_folder(point))
        run = source or mine
        same_run = owner is not None and source is not None and owner.id == source.id
        if folder and not here and (owner is not None or tags) and not same_run:
            continued = f" (run {source.id})" if source is not None else ""
            raise TrainerError(
                f"--checkpoint-dir {folder} holds {_whose(owner, tags)}, not those of the run --resume {point.path} "
                f"continues{continued}: choose another --checkpoint-dir"
            )
    else:
        run = mine
        if owner is not None and owner.id == mine.id:
            if tags and cfg.resume is None:
                raise TrainerError(
                    f"--checkpoint-dir {folder} already holds this run's checkpoints ({', '.join(tags[-3:])}): pass "
                    "--resume latest_if_exists to continue from its newest, or choose another --checkpoint-dir to "
                    "start over"
                )
        elif owner is not None or tags:
            other = f", another run than this one ({owner.changes(mine)})" if owner is not None else ""
            fix = (
                "and --resume latest_if_exists found no complete checkpoint to continue: choose another --checkpoint-dir"
                if cfg.resume
                else f"pass --resume to continue {'it' if owner else 'them'} or choose another --checkpoint-dir"
            )
            raise TrainerError(f"--checkpoint-dir {folder} holds {_whose(owner, tags)}{other}: {fix}")
    if plan.metrics_path is not None:
        check_metrics(plan.metrics_path, run, resumed=point is not None)
    return run


def check_metrics(path: Path, run: RunRecord, resumed: bool) -> None:
    """Refuse to append to a metrics file another run started (its first record, `start`, names
    its run), or to a file that is not the trainer's metrics; a resume may append to an older
    trainer's file, which names no run."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    head = read_head(path, "metrics file")
    try:
        first = json.loads(head)
    except (ValueError, RecursionError):
        first = None
    if not isinstance(first, dict) or first.get("event") != "start":
        raise TrainerError(
            f"metrics file {path} is not the trainer's (its first line is no `start` record): choose another "
            "--metrics; the trainer appends only to its own runs' metrics"
        )
    owner = first.get("run")
    if owner == run.id or (owner is None and resumed):
        return
    whose = f"run {owner}'s metrics" if owner else "metrics of a run it does not name (an older trainer's)"
    fix = "choose another --metrics" if resumed else "pass --resume to continue that run or choose another --metrics"
    raise TrainerError(f"metrics file {path} holds {whose}, not this run's ({run.id}): {fix}")


def claim_run(plan, run: RunRecord) -> None:
    """Rank 0, as training starts: --checkpoint-dir's run.json made `run`'s (created when absent,
    atomically); another run's record that appeared since `check_run` is refused in one line."""
    folder = plan.cfg.checkpoint_dir
    if not folder:
        return
    existing = claim_record(folder, RUN_FILE, run.to_json(), "run record")
    if existing is None:
        return
    other = RunRecord.from_json(existing, f"{folder}/{RUN_FILE}")
    if other.id != run.id:
        raise TrainerError(
            f"--checkpoint-dir {folder} was claimed by another run ({other.id}) as this one started: choose another "
            "--checkpoint-dir"
        )
