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
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from shardkit.api import open_source
from shardkit.checkpoint.load import plain_file
from shardkit.checkpoint.tree import SCHEDULER, USER_CONTENT
from shardkit.errors import ShardkitError
from shardkit.formats import Checkpoint, load_config
from shardkit.io.location import as_local, is_url, parse_location
from shardkit.layout import make_layout

if TYPE_CHECKING:
    from shardkit.layout import Layout

from . import checkpointing, lora, moe
from .config import TrainConfig, check_positions
from .data import Batches, TokenFile
from .errors import DataError, TrainerError
from .layers import TPContext, vocab_parallel_cross_entropy
from .model import ModelSpec, StageModel, param_count
from .optim import LRSchedule, Optimizer
from .parallel import (
    COMM,
    COMPUTE,
    Parallel,
    agree,
    choose_device,
    init_parallel,
    join,
    resolve_dp,
    shutdown,
    world_from_env,
)
from .pipeline import Pipeline, resolve_schedule, run_micro_batches
from .weights import (
    EXPORT_MARKER,
    absolute,
    check_export_destination,
    export_hf,
    export_run,
    init_rank_pieces,
    read_rank_pieces,
)

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
    resume: checkpointing.ResumePoint | None = None
    metrics_path: Path | None = None
    exported_step: int | None = None  # the step of this run's earlier export in --export-hf
    eval_tokens: TokenFile | None = None
    eval_steps: int = 0  # batches per evaluation
    lora: lora.Lora | None = None  # --lora-rank: the adapters (only they train)

    @property
    def micro_batches(self) -> int:
        return self.cfg.global_batch // (self.cfg.micro_batch * self.dp)


def _check_locations(cfg: TrainConfig) -> None:
    """--model, --checkpoint-dir and --resume: a local path or s3://bucket/prefix; the other paths
    local. Any other URL is refused here, in one line, before anything is read or written."""
    for name in ("model", "checkpoint_dir", "resume"):
        if getattr(cfg, name):
            parse_location(getattr(cfg, name), f"--{name.replace('_', '-')}")
    for name in ("model_config", "data", "eval_data", "export_hf", "metrics", "tensorboard"):
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
    spec = ModelSpec.from_config(model_config, layout)
    spec.check_sequence(cfg.seq_len)
    resolve_schedule(cfg.pp_schedule, cfg.pp, cfg.vpp, cfg.global_batch // (cfg.micro_batch * dp), spec.dims.num_layers)
    tokens = TokenFile(cfg.data)
    if tokens.vocab_size is not None and tokens.vocab_size > spec.dims.vocab_size:
        raise DataError(
            f"{cfg.data} was tokenized with a vocabulary of {tokens.vocab_size} ids, but the model has "
            f"{spec.dims.vocab_size}: tokenize with the model's tokenizer"
        )
    if len(tokens) < cfg.seq_len + 1:
        raise DataError(
            f"{cfg.data} holds {len(tokens)} tokens: fewer than one sequence of --seq-len {cfg.seq_len} + 1"
        )
    eval_tokens, eval_steps = plan_eval(cfg, spec)
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
    return plan


def plan_eval(cfg: TrainConfig, spec: ModelSpec) -> tuple[TokenFile | None, int]:
    """--eval-data checked: (its tokens, batches per evaluation), or (None, 0) without it."""
    if not cfg.eval_data:
        if cfg.eval_every or cfg.eval_steps:
            raise TrainerError("--eval-every / --eval-steps need --eval-data (a held-out token file)")
        return None, 0
    tokens = TokenFile(cfg.eval_data)
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
            point.path,
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


# ---- metrics and progress --------------------------------------------------------------------------


def summary_writer(directory: str):
    """TensorBoard's writer, as NxD's examples log (`torch.utils.tensorboard`)."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=directory)


# step record key -> TensorBoard tag
TB_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "step_time": "train/step_time",
    "memory_mb": "memory/peak_mb",
    "eval_loss": "eval/loss",
    "eval_ppl": "eval/perplexity",
    "aux_loss": "train/aux_loss",  # MoE: the load-balancing loss and the dropped fraction
    "moe_dropped": "train/moe_dropped",
}


def peak_memory_mb(device: torch.device) -> float:
    """This process's peak memory: allocated on a CUDA device, else the resident set (max RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # not on this platform
        return 0.0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB elsewhere


class Reporter:
    """Rank 0's progress bar (loss, tokens/s, step time, eval loss), JSONL metrics file and
    TensorBoard scalars."""

    def __init__(self, plan: Plan, par: Parallel, start_step: int):
        self.enabled = par.leader
        self.file = None
        self.bar = None
        self.tb = None
        self.postfix: dict[str, str] = {}
        if not self.enabled:
            return
        if plan.metrics_path is not None:
            plan.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(plan.metrics_path, "a", encoding="utf-8")
        if plan.cfg.tensorboard:
            self.tb = summary_writer(plan.cfg.tensorboard)
        if plan.cfg.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=plan.cfg.steps,
                initial=start_step,
                desc="train",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                leave=True,
            )

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def scalars(self, record: dict[str, Any]) -> None:
        if self.tb is not None:
            for key, tag in TB_SCALARS.items():
                if key in record:
                    self.tb.add_scalar(tag, record[key], record["step"])

    def step(self, record: dict[str, Any], show: bool) -> None:
        self.write(record)
        self.scalars(record)
        if self.bar is not None:
            if show:
                self.postfix.update(
                    {
                        "loss": f"{record['loss']:.4f}",
                        "tok/s": f"{record['tokens_per_s']:,.0f}",
                        "step": f"{record['step_time'] * 1000:.0f}ms",
                    }
                )
                if "aux_loss" in record:  # MoE
                    self.postfix["aux"] = f"{record['aux_loss']:.4f}"
                if record.get("moe_dropped"):
                    self.postfix["drop"] = f"{record['moe_dropped']:.1%}"
                self.bar.set_postfix(ordered_dict=self.postfix, refresh=False)
            self.bar.update(1)

    def evaluation(self, record: dict[str, Any]) -> None:
        self.write(record)
        self.scalars(record)
        if self.bar is not None:
            self.postfix.update({"eval": f"{record['eval_loss']:.4f}", "ppl": f"{record['eval_ppl']:.2f}"})
            self.bar.set_postfix(ordered_dict=self.postfix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


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
    eval_loss: float | None = None  # of the last evaluation (--eval-data)


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
        assert device is not None and plan is not None  # agree() raised if choosing either failed
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        par = init_parallel(cfg.tp, cfg.pp, plan.dp, device, cfg.timeout, cfg.ep)
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
    moe_loss: moe.MoELoss | None = None
    adapters: torch.nn.Module | None = None  # --lora-rank: the adapters (what the optimizer trains)


def _run(plan: Plan, par: Parallel) -> Summary:
    run = _set_up(plan, par)
    _announce(plan, par, run)
    summary = _train_steps(plan, par, run)
    if plan.cfg.export_hf:
        summary.exported = _export(plan, par, run, summary)
    return summary


def _initial_tensors(plan: Plan, par: Parallel) -> tuple[dict[str, torch.Tensor], checkpointing.Restored | None]:
    """This rank's pieces (and the restored checkpoint when resuming), read on every rank."""
    source, resume = plan.source, plan.resume
    if plan.lora is not None:  # the frozen model from --model; the adapters (resumed) from the checkpoint
        assert source is not None  # lora.check_options requires --model
        tensors = par.all_ok(lambda: read_rank_pieces(source, plan.spec, par.tp_rank, par.pp_rank))
        if resume is None:
            return tensors, None
        adapters = plan.lora.spec
        restored = par.all_ok(lambda: checkpointing.load(resume, adapters, par))
        _exact_weights(restored, restored.tensors, plan.dtype)
        return tensors, restored
    if resume is None:
        if source is None:  # --model-config: random weights, the same in every layout
            return par.all_ok(
                lambda: init_rank_pieces(plan.spec, plan.cfg.seed, par.tp_rank, par.pp_rank, par.ep_rank)
            ), None
        return par.all_ok(lambda: read_rank_pieces(source, plan.spec, par.tp_rank, par.pp_rank, par.ep_rank)), None
    restored = par.all_ok(lambda: checkpointing.load(resume, plan.spec, par))
    _exact_weights(restored, restored.tensors, plan.dtype)
    return restored.tensors, restored


def _exact_weights(restored: checkpointing.Restored, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """In an fp32 run, the fp32 masters of a bf16 run's checkpoint are the exact weights."""
    if dtype == torch.float32:
        for name, entry in restored.optimizer.items():
            if "master" in entry and name in tensors:
                tensors[name] = entry["master"]


def _set_up(plan: Plan, par: Parallel) -> Run:
    """Load this rank's weights (and a resumed state) into its stage, optimizer, schedule and data."""
    cfg, spec = plan.cfg, plan.spec
    tensors, restored = _initial_tensors(plan, par)
    ctx = TPContext(par.tp_group, cfg.sequence_parallel)
    is_moe = moe.is_moe(spec)
    model: StageModel
    if is_moe:
        model = moe.MoEStageModel(spec, ctx, par, plan.dtype, cfg.activation_checkpointing, cfg.capacity_factor)
    else:
        model = StageModel(spec, ctx, par.pp_rank, plan.dtype, par.device, cfg.activation_checkpointing)
    model.load_pieces({k: v.to(par.device) for k, v in tensors.items()})
    model.train()
    trained: torch.nn.Module = model
    trained_spec, adapters = spec, None
    if plan.lora is not None:
        tensors = restored.tensors if restored is not None else plan.lora.initial(cfg.seed, par.tp_rank, par.pp_rank)
        trained = adapters = plan.lora.attach(model, tensors, par, plan.dtype)
        trained_spec = plan.lora.spec
    experts: frozenset[str] | set[str] = frozenset()
    tp_partial: frozenset[str] | set[str] = frozenset()
    if plan.lora is not None:  # the adapters' replicated halves get partial gradients per tp rank
        tp_partial = plan.lora.spec.replicated_names(par.pp_rank)
    elif is_moe:
        experts, tp_partial = moe.expert_names(model), moe.tp_partial_names(model)
    optimizer = Optimizer(
        trained,
        trained_spec,
        par,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        clip_grad=cfg.clip_grad,
        zero1=cfg.zero1,
        sequence_parallel=cfg.sequence_parallel,
        sources=tensors,
        experts=experts,
        tp_partial=tp_partial,
    )
    del tensors
    schedule = RunSchedule(cfg)
    batches = _batches(plan, par, plan.tokens)
    start_step = 0
    if restored is not None:
        assert plan.resume is not None  # _initial_tensors restores a checkpoint only when resuming
        start_step = par.all_ok(lambda: checkpointing.apply(restored, optimizer, schedule, batches))
        log.info("resumed from %s at step %d (%s)", plan.resume.path, start_step, spec.layout.describe())
    scale, tp_group = 1.0 / (plan.micro_batches * plan.dp), par.tp_group

    def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets.t(), tp_group).mean() * scale

    moe_loss = moe.MoELoss(lm_loss, spec, scale, par.tp) if is_moe else None
    loss_fn: Callable = moe_loss or lm_loss
    pipeline = None
    if par.pp > 1:
        pipeline = Pipeline(
            model,
            par,
            loss_fn,
            plan.micro_batches,
            cfg.micro_batch,
            cfg.seq_len,
            spec.dims.hidden_size,
            spec.dims.vocab_size // par.tp,
            plan.dtype,
            cfg.sequence_parallel,
            cfg.pp_schedule,
            spec.layout,
            spec.dims.num_layers,
            carry=moe.carry_meta(spec) if is_moe else None,
        )
    return Run(model, optimizer, schedule, batches, loss_fn, pipeline, start_step, moe_loss, adapters)


def _announce(plan: Plan, par: Parallel, run: Run) -> None:
    """Rank 0's one line about the job: processes, layout, model, batch, schedule, options."""
    if not par.leader:
        return
    cfg, spec, pipeline = plan.cfg, plan.spec, run.pipeline
    extras = [
        name
        for name, on in (
            ("ZeRO-1", run.optimizer.zero1),
            ("sequence parallel", run.optimizer.sequence_parallel),
            ("activation checkpointing", cfg.activation_checkpointing),
            (f"ep {par.ep}", par.ep > 1),
            (f"capacity factor {cfg.capacity_factor:g}", cfg.capacity_factor > 0),
        )
        if on
    ]
    if plan.lora is not None:
        trained = sum(math.prod(s) for s in plan.lora.spec.full_shapes.values())
        extras.append(f"LoRA {plan.lora.settings.describe()} ({trained / 1e6:.3f}M trained)")
    log.info(
        "%d process%s: tp %d x pp %d%s x dp %d (%s, %s); %s %.2fM parameters in %s; %d micro-batch%s of "
        "%d x %d tokens per step%s%s",
        par.world,
        "es" if par.world > 1 else "",
        par.tp,
        par.pp,
        f" (vpp {spec.layout.vpp})" if spec.layout.vpp > 1 else "",
        par.dp,
        par.backend,
        par.device,
        spec.family.name,
        param_count(spec) / 1e6,
        cfg.dtype,
        plan.micro_batches,
        "es" if plan.micro_batches > 1 else "",
        cfg.micro_batch,
        cfg.seq_len,
        f" ({pipeline.schedule_name})" if pipeline else "",
        "; " + ", ".join(extras) if extras else "",
    )


def _train_steps(plan: Plan, par: Parallel, run: Run) -> Summary:
    """The optimizer steps from run.start_step to --steps, with metrics and checkpoints."""
    cfg = plan.cfg
    saver = checkpointing.Saver(plan, par, plan.lora.spec if plan.lora else None) if cfg.checkpoint_dir else None
    reporter = Reporter(plan, par, run.start_step)
    summary = Summary(first_step=run.start_step, layout=plan.spec.layout.describe())
    if par.leader:
        reporter.write(
            {
                "event": "start",
                "step": run.start_step,
                "world": par.world,
                "dp": par.dp,
                "layout": plan.spec.layout.to_dict(),
                "schedule": getattr(run.pipeline, "schedule_name", None),
                "config": asdict(cfg),
            }
        )
    t_start, eval_seconds = time.perf_counter(), 0.0
    try:
        for step in range(run.start_step, cfg.steps):
            record = _one_step(plan, par, run, step)
            summary.losses.append(record["loss"])
            summary.steps += 1
            last = step + 1 == cfg.steps
            reporter.step(record, show=last or (step + 1) % cfg.log_every == 0)
            if plan.eval_steps and (last or (cfg.eval_every and (step + 1) % cfg.eval_every == 0)):
                evaluated = _evaluate(plan, par, run, step + 1)
                summary.eval_loss = evaluated["eval_loss"]
                eval_seconds += evaluated["eval_time"]
                reporter.evaluation(evaluated)
            if saver is not None and (last or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
                summary.checkpoints.append(
                    saver.save(step + 1, run.adapters or run.model, run.optimizer, run.schedule, run.batches)
                )
        if saver is not None:
            saver.finish()
    finally:
        reporter.close()
    summary.seconds = time.perf_counter() - t_start
    if summary.steps:  # training throughput: the time spent evaluating is not training's
        summary.tokens_per_s = summary.steps * cfg.global_batch * cfg.seq_len / (summary.seconds - eval_seconds)
    return summary


def _batches(plan: Plan, par: Parallel, tokens: TokenFile, shuffle: bool = True) -> Batches:
    """This dp rank's share of each step's global batch of `tokens` (shuffled by --seed, or in order)."""
    cfg = plan.cfg
    return Batches(
        tokens,
        cfg.seq_len,
        cfg.global_batch,
        cfg.micro_batch,
        plan.dp,
        par.dp_rank,
        cfg.seed,
        plan.spec.dims.vocab_size,
        shuffle=shuffle,
    )


def _evaluate(plan: Plan, par: Parallel, run: Run, step: int) -> dict[str, Any]:
    """Loss and perplexity on the first `plan.eval_steps` batches of --eval-data (forward only,
    the same batches every time and in every layout); returns the metrics record."""
    cfg = plan.cfg
    t0 = time.perf_counter()
    assert plan.eval_tokens is not None  # plan_eval gives eval_steps > 0 only with --eval-data's tokens
    batches = _batches(plan, par, plan.eval_tokens, shuffle=False)
    total = 0.0
    run.model.eval()
    try:
        with torch.no_grad():
            for _ in range(plan.eval_steps):
                inputs, targets = batches.step_batch()
                inputs, targets = inputs.to(par.device), targets.to(par.device)
                if run.pipeline is not None:
                    total += run.pipeline.forward_only(inputs, targets)
                else:
                    total += sum(
                        float(run.loss_fn(run.model(ids), tgt))
                        for ids, tgt in zip(inputs.split(cfg.micro_batch), targets.split(cfg.micro_batch))
                    )
    finally:
        run.model.train()
    mine = total if (par.is_last_stage and par.tp_rank == 0) else 0.0
    loss = par.sum_over_world([mine])[0] / plan.eval_steps  # each step's sum is its batch's mean token loss
    return {
        "event": "eval",
        "step": step,
        "eval_loss": loss,
        "eval_ppl": math.exp(min(loss, 700.0)),
        "eval_tokens": plan.eval_steps * cfg.global_batch * cfg.seq_len,
        "eval_time": time.perf_counter() - t0,
    }


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
    moe_values: list[float] = []
    if run.moe_loss is not None:  # the language-model loss, the load-balancing loss, drops
        loss_sum, aux_sum = run.moe_loss.take()
        dropped, routed = cast(moe.MoEStageModel, run.model).take_drops()
        tp0 = par.tp_rank == 0
        moe_values = [aux_sum if (par.is_last_stage and tp0) else 0.0, dropped if tp0 else 0, routed if tp0 else 0]
        moe_values.append(moe.DISPATCH.take())
    mine = loss_sum if (par.is_last_stage and par.tp_rank == 0) else 0.0
    compute, comm = COMPUTE.take(), COMM.take()
    loss, compute_sum, comm_sum, *moe_sums = par.sum_over_world([mine, compute, comm, *moe_values])
    step_time = time.perf_counter() - t0
    compute_mean, comm_mean = compute_sum / par.world, comm_sum / par.world
    tokens_per_step = cfg.global_batch * cfg.seq_len
    return {
        "event": "step",
        "step": step + 1,
        "loss": loss,
        "lr": lr,
        "grad_norm": norm,
        "step_time": step_time,
        "tokens_per_s": tokens_per_step / step_time,
        "tokens": (step + 1) * tokens_per_step,
        "consumed_samples": run.batches.consumed_samples,
        "compute_time": compute_mean,
        "collective_time": comm_mean,
        "comm_share": max(0.0, 1.0 - compute_mean / step_time),
        "memory_mb": peak_memory_mb(par.device),
        **(moe.step_record(moe_sums, par.world) if moe_sums else {}),
    }


def _export(plan: Plan, par: Parallel, run: Run, summary: Summary) -> str:
    """--export-hf: the current weights, unless this run's export of this very step is there."""
    cfg = plan.cfg
    step = summary.first_step + summary.steps
    if summary.steps == 0 and plan.exported_step == step:
        log.info("%s already holds this run's export of step %d: kept", cfg.export_hf, step)
        return cfg.export_hf
    source_dir = cfg.model or (plan.resume.path if plan.resume else None)
    if cfg.model_config:  # its tokenizer and generation config, when beside it
        config = Path(cfg.model_config)
        source_dir = str(config if config.is_dir() else config.parent)
    merged = None
    if plan.lora is not None:
        assert isinstance(run.adapters, lora.AdapterSet)  # _set_up attaches them for a LoRA plan
        if cfg.export_lora:
            marker = (EXPORT_MARKER, {"run": export_run(cfg), "step": step})
            base = absolute(cfg.model) if cfg.model else None
            return str(lora.export_peft(plan.lora, run.adapters, par, cfg.export_hf, base, plan.dtype, marker))
        merged = plan.lora.merged(run.model, run.adapters, par.tp_rank, par.pp_rank)
    return str(
        export_hf(run.model, plan.spec, par, cfg.export_hf, source_dir, plan.dtype, export_run(cfg), step, merged)
    )


__all__ = ["train", "plan_run", "Plan", "Summary", "ShardkitError"]
