"""The training run: check the inputs, join the job, load this rank's pieces, train, save, export.

Order matters for bad input: everything that can be checked without talking to other processes
(options, world size, the model's config against the layout, the data file, the checkpoint to
resume, the export destination) is checked first on every rank, before any file is written.
Then the ranks join the job and agree (`parallel.agree`): if any rank failed, every rank raises
`JobFailed` with the first failure (rank 0 prints it; every rank exits with its code, 2 for bad
input). Later phases that can fail on one rank only (reading weights, restoring a checkpoint)
run under `Parallel.all_ok`, which agrees the same way; every collective has a timeout, so no
rank waits forever for a peer that died.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from shardkit.layout import make_layout
from shardkit.errors import ShardkitError
from shardkit.formats import Checkpoint, open_checkpoint

if TYPE_CHECKING:
    from shardkit.layout import Layout

from . import checkpointing
from .config import TrainConfig
from .data import Batches, TokenFile
from .errors import DataError, TrainerError
from .layers import TPContext, vocab_parallel_cross_entropy
from .model import ModelSpec, StageModel, param_count
from .optim import LRSchedule, Optimizer
from .parallel import (COMM, COMPUTE, Parallel, agree, choose_device, init_parallel, join, resolve_dp, shutdown,
                       world_from_env)
from .pipeline import Pipeline, run_micro_batches
from .weights import check_export_destination, export_hf, export_run, read_rank_pieces

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
    tokens: TokenFile
    dtype: torch.dtype
    resume: Any = None  # checkpointing.ResumePoint or None
    metrics_path: Path | None = None
    exported_step: int | None = None  # the step of this run's earlier export in --export-hf

    @property
    def micro_batches(self) -> int:
        return self.cfg.global_batch // (self.cfg.micro_batch * self.dp)


def _positive(cfg: TrainConfig) -> None:
    for name in ("tp", "pp", "kv_multiplier", "micro_batch", "global_batch", "seq_len", "steps", "log_every"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise TrainerError(f"--{name.replace('_', '-')} must be a positive whole number, got {value!r}")
    for name in ("dp", "warmup", "checkpoint_every", "num_kept", "keep_every", "threads"):
        if getattr(cfg, name) < 0:
            raise TrainerError(f"--{name.replace('_', '-')} must not be negative")
    if not cfg.lr > 0:
        raise TrainerError(f"--lr must be positive, got {cfg.lr}")
    if cfg.timeout <= 0:
        raise TrainerError("--timeout must be positive (seconds)")


def plan_run(cfg: TrainConfig, world: int) -> Plan:
    """Check everything that can be checked locally; raise a ShardkitError with what to do."""
    if not cfg.model and not cfg.resume:
        raise TrainerError("--model is required: a Hugging Face or sharded model directory to start from")
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
    source = open_checkpoint(cfg.model) if cfg.model else None
    layout = run_layout(cfg, source)
    resume = checkpointing.find_resume(cfg, source.config if source is not None else None)
    if source is None and resume is None:
        raise TrainerError(f"--resume {cfg.resume} found no checkpoint and there is no --model to start from")
    if cfg.checkpoint_dir and Path(cfg.checkpoint_dir).exists() and not Path(cfg.checkpoint_dir).is_dir():
        raise TrainerError(f"--checkpoint-dir {cfg.checkpoint_dir} is a file: give a directory")
    spec = ModelSpec.from_config(source.config if source is not None else resume.config, layout)
    spec.check_sequence(cfg.seq_len)
    tokens = TokenFile(cfg.data)
    if tokens.vocab_size is not None and tokens.vocab_size > spec.dims.vocab_size:
        raise DataError(
            f"{cfg.data} was tokenized with a vocabulary of {tokens.vocab_size} ids, but the model has "
            f"{spec.dims.vocab_size}: tokenize with the model's tokenizer"
        )
    if len(tokens) < cfg.seq_len + 1:
        raise DataError(f"{cfg.data} holds {len(tokens)} tokens: fewer than one sequence of --seq-len {cfg.seq_len} + 1")
    exported_step = check_export_destination(cfg) if cfg.export_hf else None
    metrics = Path(cfg.metrics) if cfg.metrics else (Path(cfg.checkpoint_dir) / "metrics.jsonl"
                                                     if cfg.checkpoint_dir else None)
    if metrics is not None and metrics.exists() and metrics.is_dir():
        raise TrainerError(f"--metrics {metrics} is a directory: give a file path")
    return Plan(cfg, world, dp, spec, source, tokens, DTYPES[cfg.dtype], resume, metrics, exported_step)


def run_layout(cfg: TrainConfig, source: Checkpoint | None) -> Layout:
    """The run's layout from the options. The qkv style and K/V replication order not given keep
    those of a sharded --model (logged), else separate and interleaved."""
    held = source.layout if source is not None and source.kind == "sharded" else None
    kept = [f"{what} ({getattr(held, name)})" for what, name in (("qkv style", "qkv"), ("kv replication", "kv_replication"))
            if held is not None and getattr(cfg, name) is None]
    if kept:
        log.info("keeping the qkv layout of %s: %s (--qkv / --kv-replication to change)", cfg.model, " and ".join(kept))
    return make_layout(tp=cfg.tp, pp=cfg.pp, kv_multiplier=cfg.kv_multiplier,
                       kv_replication=cfg.kv_replication or (held.kv_replication if held else "interleaved"),
                       qkv=cfg.qkv or (held.qkv if held else "separate"))


# ---- metrics and progress --------------------------------------------------------------------------


class Reporter:
    """Rank 0's progress bar (loss, tokens/s, step time) and JSONL metrics file."""

    def __init__(self, plan: Plan, par: Parallel, start_step: int):
        self.enabled = par.leader
        self.file = None
        self.bar = None
        if not self.enabled:
            return
        if plan.metrics_path is not None:
            plan.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(plan.metrics_path, "a", encoding="utf-8")
        if plan.cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=plan.cfg.steps, initial=start_step, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True, leave=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def step(self, record: dict[str, Any], show: bool) -> None:
        self.write(record)
        if self.bar is not None:
            if show:
                self.bar.set_postfix(ordered_dict={"loss": f"{record['loss']:.4f}",
                                                   "tok/s": f"{record['tokens_per_s']:,.0f}",
                                                   "step": f"{record['step_time'] * 1000:.0f}ms"}, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


@dataclass
class Summary:
    """What a run did (returned by `train`)."""

    steps: int = 0
    first_step: int = 0
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    seconds: float = 0.0
    layout: str = ""
    exported: str | None = None
    checkpoints: list[str] = field(default_factory=list)


# ---- the run ---------------------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> Summary:
    """Run training as this process's part of the job (torchrun's environment, or one process)."""
    _, world, local_rank = world_from_env()
    device, plan, error = None, None, None
    try:
        device = choose_device(cfg.device, local_rank)
        plan = plan_run(cfg, world)
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised on every rank
        error = e
    job = join(device, cfg.timeout)
    try:
        agree(job, error)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        par = init_parallel(cfg.tp, cfg.pp, plan.dp, device, cfg.timeout)
        return _run(plan, par)
    finally:
        shutdown()


@dataclass
class Run:
    """What a rank trains: its stage, optimizer, schedule, data and (pp > 1) pipeline."""

    model: StageModel
    optimizer: Optimizer
    schedule: LRSchedule
    batches: Batches
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    pipeline: Pipeline | None
    start_step: int


def _run(plan: Plan, par: Parallel) -> Summary:
    run = _set_up(plan, par)
    _announce(plan, par, run)
    summary = _train_steps(plan, par, run)
    if plan.cfg.export_hf:
        summary.exported = _export(plan, par, run, summary)
    return summary


def _initial_tensors(plan: Plan, par: Parallel) -> tuple[dict[str, torch.Tensor], Any]:
    """This rank's pieces (and the restored checkpoint when resuming), read on every rank."""
    if plan.resume is None:
        return par.all_ok(lambda: read_rank_pieces(plan.source, plan.spec, par.tp_rank, par.pp_rank)), None
    restored = par.all_ok(lambda: checkpointing.load(plan.resume, plan.spec, par))
    tensors = restored.tensors
    if plan.dtype == torch.float32:  # the fp32 masters of a bf16 run are the exact weights
        for name, entry in restored.optimizer.items():
            if "master" in entry and name in tensors:
                tensors[name] = entry["master"]
    return tensors, restored


def _set_up(plan: Plan, par: Parallel) -> Run:
    """Load this rank's weights (and a resumed state) into its stage, optimizer, schedule and data."""
    cfg, spec = plan.cfg, plan.spec
    tensors, restored = _initial_tensors(plan, par)
    ctx = TPContext(par.tp_group, cfg.sequence_parallel)
    model = StageModel(spec, ctx, par.pp_rank, plan.dtype, par.device, cfg.activation_checkpointing)
    model.load_pieces({k: v.to(par.device) for k, v in tensors.items()})
    model.train()
    optimizer = Optimizer(model, spec, par, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                          weight_decay=cfg.weight_decay, clip_grad=cfg.clip_grad, zero1=cfg.zero1,
                          sequence_parallel=cfg.sequence_parallel, sources=tensors)
    del tensors
    schedule = LRSchedule(cfg.lr, cfg.warmup, cfg.steps, cfg.decay, cfg.min_lr_ratio)
    batches = Batches(plan.tokens, cfg.seq_len, cfg.global_batch, cfg.micro_batch, plan.dp, par.dp_rank, cfg.seed,
                      spec.dims.vocab_size)
    start_step = 0
    if restored is not None:
        start_step = par.all_ok(lambda: checkpointing.apply(restored, optimizer, schedule, batches))
        log.info("resumed from %s at step %d (%s)", plan.resume.path, start_step, spec.layout.describe())
    scale, tp_group = 1.0 / (plan.micro_batches * plan.dp), par.tp_group

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets.t(), tp_group).mean() * scale

    pipeline = None
    if par.pp > 1:
        pipeline = Pipeline(model, par, loss_fn, plan.micro_batches, cfg.micro_batch, cfg.seq_len,
                            spec.dims.hidden_size, spec.dims.vocab_size // par.tp, plan.dtype, cfg.sequence_parallel)
    return Run(model, optimizer, schedule, batches, loss_fn, pipeline, start_step)


def _announce(plan: Plan, par: Parallel, run: Run) -> None:
    """Rank 0's one line about the job: processes, layout, model, batch, schedule, options."""
    if not par.leader:
        return
    cfg, spec, pipeline = plan.cfg, plan.spec, run.pipeline
    extras = [name for name, on in (("ZeRO-1", run.optimizer.zero1), ("sequence parallel", run.optimizer.sequence_parallel), ("activation checkpointing", cfg.activation_checkpointing)) if on]
    log.info("%d process%s: tp %d x pp %d x dp %d (%s, %s); %s %.2fM parameters in %s; %d micro-batch%s of "
             "%d x %d tokens per step%s%s", par.world, "es" if par.world > 1 else "", par.tp, par.pp, par.dp,
             par.backend, par.device, spec.family.name, param_count(spec) / 1e6, cfg.dtype, plan.micro_batches,
             "es" if plan.micro_batches > 1 else "", cfg.micro_batch, cfg.seq_len,
             f" ({pipeline.schedule_name})" if pipeline else "", "; " + ", ".join(extras) if extras else "")


def _train_steps(plan: Plan, par: Parallel, run: Run) -> Summary:
    """The optimizer steps from run.start_step to --steps, with metrics and checkpoints."""
    cfg = plan.cfg
    saver = checkpointing.Saver(plan, par) if cfg.checkpoint_dir else None
    reporter = Reporter(plan, par, run.start_step)
    summary = Summary(first_step=run.start_step, layout=plan.spec.layout.describe())
    if par.leader:
        reporter.write({"event": "start", "step": run.start_step, "world": par.world, "dp": par.dp,
                        "layout": plan.spec.layout.to_dict(), "schedule": getattr(run.pipeline, "schedule_name", None),
                        "config": asdict(cfg)})
    t_start = time.perf_counter()
    try:
        for step in range(run.start_step, cfg.steps):
            record = _one_step(plan, par, run, step)
            summary.losses.append(record["loss"])
            summary.steps += 1
            last = step + 1 == cfg.steps
            reporter.step(record, show=last or (step + 1) % cfg.log_every == 0)
            if saver is not None and (last or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
                summary.checkpoints.append(saver.save(step + 1, run.model, run.optimizer, run.schedule, run.batches))
        if saver is not None:
            saver.finish()
    finally:
        reporter.close()
    summary.seconds = time.perf_counter() - t_start
    if summary.steps:
        summary.tokens_per_s = summary.steps * cfg.global_batch * cfg.seq_len / summary.seconds
    return summary


def _one_step(plan: Plan, par: Parallel, run: Run, step: int) -> dict[str, Any]:
    """One optimizer step (0-based `step`); returns its metrics record."""
    cfg = plan.cfg
    COMM.take()
    COMPUTE.take()
    t0 = time.perf_counter()
    inputs, targets = run.batches.step_batch()
    inputs, targets = inputs.to(par.device), targets.to(par.device)
    if run.pipeline is not None:
        loss_sum = run.pipeline.step(inputs, targets)
    else:
        loss_sum = run_micro_batches(run.model, run.loss_fn, inputs, targets, cfg.micro_batch)
    lr = run.schedule.at(step)
    norm = run.optimizer.step(lr)
    run.schedule.last_step = step + 1
    mine = loss_sum if (par.is_last_stage and par.tp_rank == 0) else 0.0
    compute, comm = COMPUTE.take(), COMM.take()
    loss, compute_sum, comm_sum = par.sum_over_world([mine, compute, comm])
    step_time = time.perf_counter() - t0
    compute_mean, comm_mean = compute_sum / par.world, comm_sum / par.world
    tokens_per_step = cfg.global_batch * cfg.seq_len
    return {
        "event": "step", "step": step + 1, "loss": loss, "lr": lr, "grad_norm": norm,
        "step_time": step_time, "tokens_per_s": tokens_per_step / step_time,
        "tokens": (step + 1) * tokens_per_step, "consumed_samples": run.batches.consumed_samples,
        "compute_time": compute_mean, "collective_time": comm_mean,
        "comm_share": max(0.0, 1.0 - compute_mean / step_time),
    }


def _export(plan: Plan, par: Parallel, run: Run, summary: Summary) -> str:
    """--export-hf: the current weights, unless this run's export of this very step is there."""
    cfg = plan.cfg
    step = summary.first_step + summary.steps
    if summary.steps == 0 and plan.exported_step == step:
        log.info("%s already holds this run's export of step %d: kept", cfg.export_hf, step)
        return cfg.export_hf
    source_dir = cfg.model or (plan.resume.path if plan.resume else None)
    return str(export_hf(run.model, plan.spec, par, cfg.export_hf, source_dir, plan.dtype, export_run(cfg), step))


__all__ = ["train", "plan_run", "Plan", "Summary", "ShardkitError"]
