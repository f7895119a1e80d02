"""The run's plan: every option, the model's config against the layout, the data, the checkpoint
to resume (and whether its settings are this run's) and the export destination, checked on every
rank before any process group exists or any file is written (bad input: one line, exit 2)."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardkit.api import open_source
from shardkit.checkpoint.load import plain_file
from shardkit.checkpoint.tree import SCHEDULER, USER_CONTENT
from shardkit.formats import Checkpoint, load_config
from shardkit.io.location import as_local, is_url, parse_location
from shardkit.layout import make_layout

if TYPE_CHECKING:
    from shardkit.layout import Layout

from . import checkpointing, lora, moe
from .config import TrainConfig, check_positions
from .data import TokenFile
from .encoder import TaskPlan, plan_task
from .errors import DataError, TrainerError
from .model import ModelSpec
from .optim import LRSchedule
from .parallel import resolve_dp
from .pipeline import resolve_schedule
from .tokenizing import DataOptions, open_data
from .weights import check_export_destination

log = logging.getLogger("trainer")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class Plan:
    """The validated run, before any process group exists or any file is written."""

    cfg: TrainConfig
    world: int
    dp: int
    spec: ModelSpec
    source: Checkpoint | None
    tokens: TokenFile | None  # None: an encoder task's rows (`task`)
    dtype: torch.dtype
    resume: checkpointing.ResumePoint | None = None
    metrics_path: Path | None = None
    exported_step: int | None = None  # the step of this run's earlier export in --export-hf
    eval_tokens: TokenFile | None = None
    eval_steps: int = 0  # batches per evaluation
    lora: lora.Lora | None = None  # --lora-rank: the adapters (only they train)
    task: TaskPlan | None = None  # BERT's --task: its head and rows (trainer/encoder.py)

    @property
    def micro_batches(self) -> int:
        return self.cfg.global_batch // (self.cfg.micro_batch * self.dp)


def _check_locations(cfg: TrainConfig) -> None:
    """--model, --checkpoint-dir, --resume, --data, --eval-data and --export-hf: a local path or
    s3://bucket/prefix; the other paths local. Any other URL is refused here, in one line, before
    anything is read or written."""
    for name in ("model", "checkpoint_dir", "resume", "data", "eval_data", "export_hf"):
        if getattr(cfg, name):
            parse_location(getattr(cfg, name), f"--{name.replace('_', '-')}")
    for name in ("model_config", "metrics", "tensorboard", "tokenizer", "data_cache"):
        if getattr(cfg, name):
            as_local(getattr(cfg, name), f"--{name.replace('_', '-')}")


def _positive(cfg: TrainConfig) -> None:
    for name in (
        "tp",
        "pp",
        "vpp",
        "ep",
        "kv_multiplier",
        "micro_batch",
        "global_batch",
        "seq_len",
        "steps",
        "log_every",
    ):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise TrainerError(f"--{name.replace('_', '-')} must be a positive whole number, got {value!r}")
    for name in ("dp", "warmup", "checkpoint_every", "num_kept", "keep_every", "threads", "eval_every", "eval_steps"):
        if getattr(cfg, name) < 0:
            raise TrainerError(f"--{name.replace('_', '-')} must not be negative")
    if not cfg.lr > 0:
        raise TrainerError(f"--lr must be positive, got {cfg.lr}")
    if not cfg.grad_bucket_mb > 0:
        raise TrainerError(f"--grad-bucket-mb must be positive (MiB), got {cfg.grad_bucket_mb}")
    if cfg.timeout <= 0:
        raise TrainerError("--timeout must be positive (seconds)")


def plan_run(cfg: TrainConfig, world: int) -> Plan:
    """Check everything that can be checked locally; raise a ShardkitError with what to do."""
    _check_locations(cfg)
    if cfg.model and cfg.model_config:
        raise TrainerError(
            "--model and --model-config both say where to start: give one (--model-config starts from random weights)"
        )
    if not cfg.model and not cfg.model_config and not cfg.resume:
        raise TrainerError(
            "--model is required: a Hugging Face or sharded model directory to start from (or "
            "--model-config config.json to pre-train from random weights)"
        )
    if not cfg.data:
        raise TrainerError("--data is required: a token file (scripts/prepare_data.py writes one)")
    _positive(cfg)
    dp = resolve_dp(cfg.tp, cfg.pp, cfg.dp, world)
    if cfg.global_batch % (cfg.micro_batch * dp):
        raise TrainerError(
            f"--global-batch {cfg.global_batch} is not a multiple of --micro-batch {cfg.micro_batch} x dp {dp}: "
            f"use a global batch divisible by {cfg.micro_batch * dp}"
        )
    if cfg.sequence_parallel and cfg.seq_len % cfg.tp:
        raise TrainerError(f"--sequence-parallel needs --seq-len divisible by tp {cfg.tp} (got {cfg.seq_len})")
    if cfg.tensorboard:
        check_tensorboard(cfg.tensorboard)
    lora_settings = lora.check_options(cfg)
    source = open_source(cfg.model) if cfg.model else None  # a path, or s3:// read through a mirror
    model_config = load_config(Path(cfg.model_config)) if cfg.model_config else None
    if model_config is None and source is not None:
        model_config = source.config
    layout = run_layout(cfg, source)
    resume = checkpointing.find_resume(cfg, model_config)
    if model_config is None:
        if resume is None:
            raise TrainerError(f"--resume {cfg.resume} found no checkpoint and there is no --model to start from")
        model_config = resume.config
    if cfg.checkpoint_dir and Path(cfg.checkpoint_dir).exists() and not Path(cfg.checkpoint_dir).is_dir():
        raise TrainerError(f"--checkpoint-dir {cfg.checkpoint_dir} is a file: give a directory")
    moe.check_plan(cfg, model_config, dp)
    check_positions(cfg.seq_len, model_config)
    task = plan_task(cfg, model_config, layout, tokenizer_folders(cfg, source), resume)  # None: a causal LM
    spec = task.spec if task is not None else ModelSpec.from_config(model_config, layout)
    resolve_schedule(cfg.pp_schedule, cfg.pp, cfg.vpp, cfg.global_batch // (cfg.micro_batch * dp), spec.dims.num_layers)
    tokens: TokenFile | None = None
    eval_tokens, eval_steps = None, task.eval_steps if task is not None else 0
    if task is None:
        tokens = open_data(cfg.data, "--data", data_options(cfg), tokenizer_folders(cfg, source))
        if tokens.vocab_size is not None and tokens.vocab_size > spec.dims.vocab_size:
            raise DataError(
                f"{cfg.data} was tokenized with a vocabulary of {tokens.vocab_size} ids, but the model has "
                f"{spec.dims.vocab_size}: tokenize with the model's tokenizer"
            )
        if len(tokens) < cfg.seq_len + 1:
            raise DataError(
                f"{cfg.data} holds {len(tokens)} tokens: fewer than one sequence of --seq-len {cfg.seq_len} + 1"
            )
        eval_tokens, eval_steps = plan_eval(cfg, spec, source)
    if resume is not None:
        check_resume_settings(cfg, resume)
    exported_step = check_export_destination(cfg) if cfg.export_hf else None
    metrics = (
        Path(cfg.metrics)
        if cfg.metrics
        else (
            Path(cfg.checkpoint_dir) / "metrics.jsonl"
            if cfg.checkpoint_dir and not is_url(cfg.checkpoint_dir)
            else None
        )
    )
    if metrics is not None and metrics.exists() and metrics.is_dir():
        raise TrainerError(f"--metrics {metrics} is a directory: give a file path")
    plan = Plan(
        cfg, world, dp, spec, source, tokens, DTYPES[cfg.dtype], resume, metrics, exported_step, eval_tokens, eval_steps
    )
    plan.lora = lora.make_lora(lora_settings, spec)
    plan.task = task
    return plan


def plan_eval(cfg: TrainConfig, spec: ModelSpec, source: Checkpoint | None = None) -> tuple[TokenFile | None, int]:
    """--eval-data checked: (its tokens, batches per evaluation), or (None, 0) without it."""
    if not cfg.eval_data:
        if cfg.eval_every or cfg.eval_steps:
            raise TrainerError("--eval-every / --eval-steps need --eval-data (a held-out token file)")
        return None, 0
    tokens = open_data(cfg.eval_data, "--eval-data", data_options(cfg), tokenizer_folders(cfg, source))
    if tokens.vocab_size is not None and tokens.vocab_size > spec.dims.vocab_size:
        raise DataError(
            f"{cfg.eval_data} was tokenized with a vocabulary of {tokens.vocab_size} ids, but the model "
            f"has {spec.dims.vocab_size}: tokenize with the model's tokenizer"
        )
    whole = max(0, len(tokens) - 1) // cfg.seq_len // cfg.global_batch
    if whole < 1:
        raise DataError(
            f"{cfg.eval_data} holds {len(tokens)} tokens: fewer than one batch of --global-batch "
            f"{cfg.global_batch} sequences of --seq-len {cfg.seq_len} + 1"
        )
    if cfg.eval_steps > whole:
        log.info(
            "%s holds %d batch%s of %d x %d tokens: evaluating on %s, not --eval-steps %d",
            cfg.eval_data,
            whole,
            "es" if whole > 1 else "",
            cfg.global_batch,
            cfg.seq_len,
            "it" if whole == 1 else "them",
            cfg.eval_steps,
        )
    return tokens, min(cfg.eval_steps or whole, whole)


def data_options(cfg: TrainConfig) -> DataOptions:
    """How text data is tokenized (trainer/tokenizing.py); the progress bar on rank 0 only."""
    rank0 = int(os.environ.get("RANK", "0") or 0) == 0
    return DataOptions(cfg.text_column, cfg.tokenizer, cfg.data_cache, cfg.progress and rank0)


def tokenizer_folders(cfg: TrainConfig, source: Checkpoint | None) -> list[Path]:
    """Where the model's tokenizer may be: --model's folder (and the one above a sharded tag), or
    --model-config's."""
    if source is not None:
        return [source.root, source.root.parent] if source.kind == "sharded" else [source.root]
    if cfg.model_config:
        config = Path(cfg.model_config)
        return [config if config.is_dir() else config.parent]
    return []


def check_tensorboard(directory: str) -> None:
    """--tensorboard needs the tensorboard package (torch.utils.tensorboard writes with it)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise TrainerError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    if Path(directory).exists() and not Path(directory).is_dir():
        raise TrainerError(f"--tensorboard {directory} is a file: give a directory")


# ---- resuming with the checkpoint's settings ---------------------------------------------------------


# flag -> (where the checkpoint's run keeps it: the scheduler state's key, or run settings below)
SCHEDULE_FLAGS = {"steps": "total", "warmup": "warmup", "lr": "lr", "decay": "decay", "min_lr_ratio": "min_ratio"}
BATCH_FLAGS = ("global_batch", "seq_len")


class RunSchedule(LRSchedule):
    """The LR schedule, whose saved state also carries the run's batch settings (global batch,
    micro-batch, sequence length), so a resume can tell what it changes."""

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg.lr, cfg.warmup, cfg.steps, cfg.decay, cfg.min_lr_ratio)
        self.run = {"global_batch": cfg.global_batch, "micro_batch": cfg.micro_batch, "seq_len": cfg.seq_len}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "run": dict(self.run)}


def saved_settings(tag_dir: Path) -> dict[str, Any]:
    """The settings of the run that saved `tag_dir`, by flag name (those it recorded: the LR
    schedule, the batch; the global batch of older checkpoints from their data position)."""

    def read(name: str) -> Any:
        try:
            return plain_file(tag_dir, name)
        except Exception:  # noqa: BLE001 - another trainer's file (NxD): nothing to compare
            return None

    sched, content = read(SCHEDULER), read(USER_CONTENT)
    found: dict[str, Any] = {}
    if isinstance(sched, dict):
        for flag, key in SCHEDULE_FLAGS.items():
            if key in sched and isinstance(sched[key], (int, float, str)) and not isinstance(sched[key], bool):
                found[flag] = sched[key]
        run = sched.get("run")
        if isinstance(run, dict):
            found.update({k: run[k] for k in (*BATCH_FLAGS, "micro_batch") if isinstance(run.get(k), int)})
    if isinstance(content, dict) and isinstance(content.get("data"), dict):
        data, step = content["data"], content.get("step")
        if "seq_len" not in found and isinstance(data.get("seq_len"), int) and data["seq_len"] > 0:
            found["seq_len"] = data["seq_len"]
        consumed = data.get("consumed_samples")
        if (
            "global_batch" not in found
            and isinstance(step, int)
            and step > 0
            and isinstance(consumed, int)
            and consumed % step == 0
        ):
            found["global_batch"] = consumed // step
    return found


def check_resume_settings(cfg: TrainConfig, point: Any) -> None:
    """Refuse (bad input) a resume whose --steps, --warmup, --lr, --decay, --min-lr-ratio,
    --global-batch or --seq-len differ from the checkpoint's run unless --override-schedule, which
    says so in one line. --steps with a constant LR after warm-up changes no step's learning rate,
    and --micro-batch only how a step is split: both are said, not refused."""
    saved = saved_settings(point.path)
    if not saved:
        return

    def differs(flag: str) -> bool:
        if flag not in saved:
            return False
        if flag in ("lr", "min_lr_ratio"):
            return not math.isclose(float(saved[flag]), float(getattr(cfg, flag)), rel_tol=1e-12)
        return saved[flag] != getattr(cfg, flag)

    def change(flag: str) -> str:
        return f"--{flag.replace('_', '-')} {saved[flag]} -> {getattr(cfg, flag)}"

    constant = cfg.decay == "constant" and saved.get("decay", "constant") == "constant"
    refused = [f for f in (*SCHEDULE_FLAGS, *BATCH_FLAGS) if differs(f) and not (f == "steps" and constant)]
    noted = [f for f in ("steps", "micro_batch") if differs(f) and f not in refused]
    if refused and not cfg.override_schedule:
        raise TrainerError(
            f"--resume {point.path} was saved by a run with other settings ({', '.join(change(f) for f in refused)}), "
            "which changes its learning-rate schedule or batch from here on: pass the checkpoint's values, or "
            "--override-schedule to continue with these"
        )
    if refused or noted:
        why = " (--override-schedule)" if refused else " (they change no step's learning rate or batch)"
        log.info(
            "resuming %s with settings other than its run's: %s%s",
            point.shown,
            ", ".join(change(f) for f in (*refused, *noted)),
            why,
        )


def run_layout(cfg: TrainConfig, source: Checkpoint | None) -> Layout:
    """The run's layout from the options. The qkv style and K/V replication order not given keep
    those of a sharded --model (logged), else separate and interleaved."""
    held = source.layout if source is not None and source.kind == "sharded" else None
    kept = [
        f"{what} ({getattr(held, name)})"
        for what, name in (("qkv style", "qkv"), ("kv replication", "kv_replication"))
        if held is not None and getattr(cfg, name) is None
    ]
    if kept:
        log.info("keeping the qkv layout of %s: %s (--qkv / --kv-replication to change)", cfg.model, " and ".join(kept))
    return make_layout(
        tp=cfg.tp,
        pp=cfg.pp,
        vpp=cfg.vpp,
        ep=cfg.ep,
        kv_multiplier=cfg.kv_multiplier,
        kv_replication=cfg.kv_replication or (held.kv_replication if held else "interleaved"),
        qkv=cfg.qkv or (held.qkv if held else "separate"),
    )
