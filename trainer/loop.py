"""The training run: check the inputs, join the job, load this rank's pieces, train, save, export.

Order matters for bad input: everything that can be checked without talking to other processes
(options, world size, the model's config against the layout, the data file, the checkpoint to
resume, the export destination) is checked first on every rank, before any file is written
(`plan.py`). Then the ranks join the job and agree (`parallel.agree`): if any rank failed, every
rank raises `JobFailed` with the first failure (rank 0 prints it; every rank exits with its code,
2 for bad input). Later phases that can fail on one rank only (reading weights, restoring a
checkpoint) run under `Parallel.all_ok`, which agrees the same way; every collective has a
timeout, so no rank waits forever for a peer that died.

A step is device work only until its end: losses, the gradient norm and the MoE counts stay on
the device, one vector of them is summed over the job, the rank cuts the graph (a no-op on gloo
and nccl; on XLA the step's last graph runs) and reads that vector once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from shardkit.errors import ShardkitError

from . import checkpointing, cpus, encoder, lora, moe
from .clocks import COMM, COMPUTE
from .config import TrainConfig
from .cpus import use_threads
from .data import Batches, TargetWeight, TokenFile
from .encoder import Encoder
from .errors import TrainerError
from .exchange import ExchangePipeline
from .layers import TPContext, vocab_parallel_cross_entropy
from .model import StageModel, param_count
from .optim import LRSchedule, Optimizer, run_settings
from .parallel import Parallel, agree, choose_device, device_kind, init_parallel, join, world_from_env
from .pipeline import Pipeline, resolve_schedule, run_micro_batches
from .preflight import DTYPES, Plan, RunSchedule, check_resume_settings, plan_eval, plan_run, run_layout, saved_settings
from .weights import EXPORT_MARKER, absolute, export_hf, export_run, init_rank_pieces, read_rank_pieces

log = logging.getLogger("trainer")
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
    "eval_accuracy": "eval/accuracy",  # BERT's tasks (trainer/encoder.py)
    "eval_mlm_accuracy": "eval/mlm_accuracy",
    "eval_nsp_accuracy": "eval/nsp_accuracy",
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
            self.postfix["eval"] = f"{record['eval_loss']:.4f}"
            if "eval_ppl" in record:
                self.postfix["ppl"] = f"{record['eval_ppl']:.2f}"
            if "eval_accuracy" in record:  # a classification's
                self.postfix["acc"] = f"{record['eval_accuracy']:.1%}"
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
    """Run training as this process's part of the job (torchrun's environment, or one process). On
    XLA with several devices in this process (`CPU_NUM_DEVICES=N` on CPU) every device is a rank,
    one thread each (trainer/comm/threads.py); rank 0's summary is returned."""
    devices = _threaded_devices(cfg)
    if devices:
        return _train_in_threads(cfg, devices)
    _, world, local_rank = world_from_env()
    device, plan, run_record, error = None, None, None, None
    try:
        device = choose_device(cfg.device, local_rank)
        plan = plan_run(cfg, world)
        run_record = checkpointing.check_run(plan)  # whose --checkpoint-dir and metrics are: before any write
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised on every rank
        error = e
    comm = join(device, cfg.timeout)
    try:
        agree(comm, error)
        assert device is not None and plan is not None and run_record is not None  # agree() raised if any failed
        use_threads(cfg.threads)
        par = init_parallel(cfg.tp, cfg.pp, plan.dp, device, cfg.timeout, cfg.ep, comm=comm)
        return _run(plan, par, run_record)
    finally:
        comm.shutdown()


def _threaded_devices(cfg: TrainConfig) -> list[Any]:
    """The XLA devices to run as one rank each in this process's threads; empty for a plain run
    (one device, torchrun, or not XLA)."""
    from .comm import threads

    _, world, _ = world_from_env()
    if threads.current() is not None or world > 1:
        return []
    try:
        kind = device_kind(cfg.device)
    except Exception:  # noqa: BLE001 - reported by choose_device in the plain run
        return []
    if kind != "xla":
        return []
    from .comm.xla import local_devices, runtime_for_threads, runtime_type, thread_devices, xla_available

    if not xla_available():
        return []
    if runtime_type() != "CPU":  # several devices in one process exist for torch-xla's CPU runtime only
        devices = local_devices()
        if devices > 1:
            raise TrainerError(
                f"this process sees {devices} {runtime_type()} devices: run one process per device with "
                f"torchrun --nproc-per-node {devices} -m trainer ... (several devices in one process are "
                "torch-xla's CPU runtime's, PJRT_DEVICE=CPU with CPU_NUM_DEVICES)"
            )
        return []
    runtime_for_threads(int(os.environ.get("CPU_NUM_DEVICES", "1") or 1))  # before the first graph runs
    if local_devices() < 2:
        return []
    return thread_devices()


def _train_in_threads(cfg: TrainConfig, devices: list[Any]) -> Summary:
    """`train` as every rank of a threaded XLA job; the job's error is rank 0's agreed one, else
    the first rank's own."""
    from .comm.threads import JobAborted, run_in_threads
    from .comm.xla import enter_device

    use_threads(cfg.threads)
    outcomes = run_in_threads(devices, lambda: train(cfg), cfg.timeout, enter_device)
    errors = [e for _, e in outcomes if e is not None]
    if errors:
        first = outcomes[0][1]
        if first is not None and not isinstance(first, JobAborted):
            raise first
        raise next((e for e in errors if not isinstance(e, JobAborted)), errors[0])
    summary = outcomes[0][0]
    assert summary is not None  # rank 0 returned without an error
    return summary


@dataclass
class Run:
    """What a rank trains: its stage, optimizer, schedule, data and (pp > 1) pipeline."""

    model: StageModel | Encoder
    optimizer: Optimizer
    schedule: LRSchedule
    batches: Batches
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    pipeline: Pipeline | ExchangePipeline | None
    start_step: int
    moe_loss: moe.MoELoss | None = None
    adapters: torch.nn.Module | None = None  # --lora-rank: the adapters (what the optimizer trains)
    target_weight: TargetWeight = field(default_factory=TargetWeight)  # masked data: 1 / the step's unmasked targets


def _run(plan: Plan, par: Parallel, record: checkpointing.RunRecord) -> Summary:
    run = _set_up(plan, par)
    _announce(plan, par, run)
    summary = _train_steps(plan, par, run, record)
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
    if plan.task is not None:  # BERT's tasks: trainer/encoder.py
        model_, optimizer_, schedule_, batches_, loss_, start = encoder.set_up(plan, par)
        return Run(model_, optimizer_, schedule_, batches_, loss_, None, start)
    cfg, spec = plan.cfg, plan.spec
    tensors, restored = _initial_tensors(plan, par)
    ctx = TPContext(par.tp_group, cfg.sequence_parallel)
    is_moe = moe.is_moe(spec)
    model: StageModel
    if is_moe:
        model = moe.MoEStageModel(spec, ctx, par, plan.dtype, cfg.activation_checkpointing, cfg.capacity_factor)
    else:
        model = StageModel(
            spec, ctx, par.pp_rank, plan.dtype, par.device, cfg.activation_checkpointing, par.comm.checkpoint
        )
    # cast on the host, then moved: the device gets data, not a graph (a lazy backend's set-up then
    # traces nothing, and a resumed run's first graphs are a fresh run's)
    model.load_pieces(dict(zip(tensors, par.comm.to_device([v.to(plan.dtype) for v in tensors.values()]))))
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
        sequence_parallel=cfg.sequence_parallel,
        sources=tensors,
        experts=experts,
        tp_partial=tp_partial,
        **run_settings(cfg, restored),
    )
    del tensors
    schedule = RunSchedule(cfg)
    assert plan.tokens is not None  # a causal LM's plan has its tokens
    batches = _batches(plan, par, plan.tokens)
    start_step = 0
    if restored is not None:
        assert plan.resume is not None  # _initial_tensors restores a checkpoint only when resuming
        start_step = par.all_ok(lambda: checkpointing.apply(restored, optimizer, schedule, batches))
        log.info("resumed from %s at step %d (%s)", plan.resume.shown, start_step, spec.layout.describe())
    scale, tp_group, target_weight = 1.0 / (plan.micro_batches * plan.dp), par.tp_group, TargetWeight()

    def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if target_weight.value is not None:  # a loss mask: the unmasked targets' sum / their count
            per_token = vocab_parallel_cross_entropy(logits, targets.t().clamp(min=0), tp_group)
            return target_weight.loss(per_token, targets.t())
        return vocab_parallel_cross_entropy(logits, targets.t(), tp_group).mean() * scale

    moe_loss = moe.MoELoss(lm_loss, spec, scale, par.tp, par.comm.accumulate_dtype) if is_moe else None
    loss_fn: Callable = moe_loss or lm_loss
    pipeline = _pipeline(plan, par, model, loss_fn) if par.pp > 1 else None
    par.comm.isolate()  # the rank's own set-up in a graph of its own, not in its first step's
    return Run(model, optimizer, schedule, batches, loss_fn, pipeline, start_step, moe_loss, adapters, target_weight)


def _pipeline(plan: Plan, par: Parallel, model: StageModel, loss_fn: Callable) -> Pipeline | ExchangePipeline:
    """pp > 1: torch.distributed.pipelining's schedules on torch.distributed; on XLA the schedule
    by neighbour exchanges (trainer/exchange.py)."""
    cfg, spec = plan.cfg, plan.spec
    hidden = (
        cfg.seq_len // par.tp if cfg.sequence_parallel and par.tp > 1 else cfg.seq_len,
        cfg.micro_batch,
        spec.dims.hidden_size,
    )
    if par.comm.lazy:
        name = resolve_schedule(cfg.pp_schedule, par.pp, cfg.vpp, plan.micro_batches, spec.dims.num_layers)
        payload: list[tuple[tuple[int, ...], torch.dtype]] = [(hidden, plan.dtype)]
        if moe.is_moe(spec):  # the load-balancing statistics travel beside the hidden states
            payload.append(((2, spec.dims.num_experts), torch.float32))
        return ExchangePipeline(
            model, par, loss_fn, name, plan.micro_batches, cfg.micro_batch, payload, spec.layout, spec.dims.num_layers
        )
    return Pipeline(
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
        carry=moe.carry_meta(spec) if moe.is_moe(spec) else None,
    )


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
    threaded = par.comm.name == "xla" and par.world > 1 and getattr(par.comm, "thread", None) is not None
    log.info(
        "%d %s: tp %d x pp %d%s x dp %d (%s, %s, %d CPU thread%s waiting %s); %s %.2fM parameters in %s; %d micro-batch%s of "
        "%d x %d tokens per step%s%s",
        par.world,
        ("ranks (threads of one process)" if threaded else "processes") if par.world > 1 else "process",
        par.tp,
        par.pp,
        f" (vpp {spec.layout.vpp})" if spec.layout.vpp > 1 else "",
        par.dp,
        par.backend,
        par.device,
        torch.get_num_threads(),
        "s" if torch.get_num_threads() > 1 else "",
        cpus.WAITING[0],
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


def _train_steps(plan: Plan, par: Parallel, run: Run, record: checkpointing.RunRecord) -> Summary:
    """The optimizer steps from run.start_step to --steps, with metrics and checkpoints."""
    cfg = plan.cfg
    par.all_ok(lambda: checkpointing.claim_run(plan, record) if par.leader else None)  # run.json: whose the folder is
    saver = checkpointing.Saver(plan, par, plan.lora.spec if plan.lora else None) if cfg.checkpoint_dir else None
    reporter = Reporter(plan, par, run.start_step)
    summary = Summary(first_step=run.start_step, layout=plan.spec.layout.describe())
    if par.leader:
        reporter.write(
            {
                "event": "start",
                "run": record.id,
                "step": run.start_step,
                "world": par.world,
                "dp": par.dp,
                "layout": plan.spec.layout.to_dict(),
                "schedule": getattr(run.pipeline, "schedule_name", None),
                "config": asdict(cfg),
            }
        )
    t_start, eval_seconds = time.perf_counter(), 0.0
    pending: QueuedStep | None = None  # a lazy backend's queued step, read once the next is queued
    read_at = t_start

    def finish(queued: QueuedStep, overlapped: bool) -> None:
        """Read a step's record: `overlapped`, after the next step was queued (its time then counts
        from the previous step's result), else at once (from its own start)."""
        nonlocal read_at
        record = _finish_step(plan, par, run, queued, read_at if overlapped else queued.started)
        read_at = time.perf_counter()
        summary.losses.append(record["loss"])
        summary.steps += 1
        reporter.step(record, show=queued.step + 1 == cfg.steps or (queued.step + 1) % cfg.log_every == 0)

    try:
        for step in range(run.start_step, cfg.steps):
            queued = _queue_step(plan, par, run, step)
            if pending is not None:  # step N's values, read while step N + 1 runs
                finish(pending, overlapped=True)
                pending = None
            last = step + 1 == cfg.steps
            evaluate = bool(plan.eval_steps) and (last or bool(cfg.eval_every and (step + 1) % cfg.eval_every == 0))
            save = saver is not None and (last or bool(cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0))
            if par.comm.overlaps_steps and not (last or evaluate or save):
                pending = queued
                continue
            finish(queued, overlapped=False)
            if evaluate:
                evaluated = _evaluate(plan, par, run, step + 1)
                summary.eval_loss = evaluated["eval_loss"]
                eval_seconds += evaluated["eval_time"]
                reporter.evaluation(evaluated)
            if save:
                assert saver is not None  # `save` is only set with a saver
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


def _reduced(par: Parallel, values: list[Any], local: Sequence[Any] = ()) -> torch.Tensor:
    """`values` (device tensors or numbers) summed over the job, then `local` (this rank's own), as
    one device vector: one all-reduce, then the graph cut (on XLA the rank's work up to here is
    launched). `_read` brings it to the host."""
    comm = par.comm
    comm.isolate()  # the reduction in a graph of its own (Comm.isolate)

    def vector(items: list[Any]) -> torch.Tensor:
        # the numbers travel to the device as one vector of data, not as scalars the graph may
        # fold in (ranks whose numbers differ would trace different graphs)
        numbers = [float(v) for v in items if not torch.is_tensor(v)]
        host = torch.tensor(numbers, dtype=comm.accumulate_dtype).to(comm.device) if numbers else None
        parts, taken = [], 0
        for v in items:
            if torch.is_tensor(v):
                parts.append(v.reshape(1).to(device=comm.device, dtype=comm.accumulate_dtype))
            else:
                assert host is not None  # there is a number to take
                parts.append(host[taken : taken + 1])
                taken += 1
        return torch.cat(parts)

    both = par.world_group.all_reduce(vector(values))
    if local:
        both = torch.cat([both, vector(list(local))])
    comm.cut()
    return both


def _read(par: Parallel, vector: torch.Tensor) -> list[float]:
    """The host's one read of a `_reduced` vector (on XLA it waits for the graph that computes it)."""
    return par.comm.to_host([vector])[0].tolist()


def _summed(par: Parallel, values: list[Any], local: Sequence[Any] = ()) -> list[float]:
    """`_reduced`, read at once."""
    return _read(par, _reduced(par, values, local))


def _evaluate(plan: Plan, par: Parallel, run: Run, step: int) -> dict[str, Any]:
    """Loss and perplexity on the first `plan.eval_steps` batches of --eval-data (forward only,
    the same batches every time and in every layout); returns the metrics record."""
    if plan.task is not None:  # BERT's tasks: loss and accuracy over every held-out row
        return encoder.evaluate(plan, par, run, step, _summed, _counted)
    cfg = plan.cfg
    t0 = time.perf_counter()
    assert plan.eval_tokens is not None  # plan_eval gives eval_steps > 0 only with --eval-data's tokens
    batches = _batches(plan, par, plan.eval_tokens, shuffle=False)
    total: Any = 0.0
    run.model.eval()
    try:
        with torch.no_grad():
            for _ in range(plan.eval_steps):
                inputs, targets = batches.step_batch()
                run.target_weight.set(batches, par.comm.to_device)
                if run.pipeline is not None:
                    total = total + run.pipeline.forward_only(inputs, targets)
                else:
                    total = total + run_micro_batches(
                        run.model, run.loss_fn, inputs, targets, cfg.micro_batch, par.comm, training=False
                    )
    finally:
        run.model.train()
    mine = _counted(par, total, par.is_last_stage and par.tp_rank == 0)
    loss = _summed(par, [mine])[0] / plan.eval_steps  # each step's sum is its batch's mean token loss
    return {
        "event": "eval",
        "step": step,
        "eval_loss": loss,
        "eval_ppl": math.exp(min(loss, 700.0)),
        "eval_tokens": plan.eval_steps * cfg.global_batch * cfg.seq_len,
        "eval_time": time.perf_counter() - t0,
        **({"xla_compiles": compiles} if (compiles := par.comm.compiles()) is not None else {}),
    }


def _counted(par: Parallel, value: Any, counted: bool) -> Any:
    """`value` if this rank's counts in the job's sum, else 0 -- on a lazy backend as a tensor times
    a 0/1 that is data, so every rank traces the same graph for the sum."""
    if par.comm.lazy and torch.is_tensor(value):
        return value * par.world_group.per_rank(int(counted), value)
    return value if counted else 0.0


@dataclass
class QueuedStep:
    """A step whose device work is queued: its values (losses, MoE sums, clocks, the gradient norm)
    are one device vector, read on the host by `_finish_step`."""

    step: int  # 0-based
    lr: float
    started: float  # perf_counter when the step began
    vector: torch.Tensor
    moe_count: int
    eager: bool
    timings: list[float]  # the host clocks on a lazy backend (this rank's; they time the tracing)
    compiles: int | None  # graphs compiled once this step was queued (XLA)
    consumed_samples: int  # the data position after the step


def _queue_step(plan: Plan, par: Parallel, run: Run, step: int) -> QueuedStep:
    """One optimizer step (0-based `step`) traced and queued on the device (run, on an eager one)."""
    cfg = plan.cfg
    COMM.take()
    COMPUTE.take()
    t0 = time.perf_counter()
    inputs, targets = run.batches.step_batch()
    run.target_weight.set(run.batches, par.comm.to_device)
    if run.pipeline is not None:
        loss_sum: Any = run.pipeline.step(inputs, targets)
    else:
        loss_sum = run_micro_batches(run.model, run.loss_fn, inputs, targets, cfg.micro_batch, par.comm)
    lr = run.schedule.at(step)
    norm = run.optimizer.step(lr)
    run.schedule.last_step = step + 1
    moe_values: list[Any] = []
    tp0 = par.tp_rank == 0
    if run.moe_loss is not None:  # the language-model loss, the load-balancing loss, drops
        loss_sum, aux_sum = run.moe_loss.take()
        dropped, routed = cast(moe.MoEStageModel, run.model).take_drops()
        moe_values = [
            _counted(par, aux_sum, par.is_last_stage and tp0),
            _counted(par, dropped, tp0),
            routed if tp0 else 0,
        ]
    mine = _counted(par, loss_sum, par.is_last_stage and tp0)
    # the host clocks: summed over the job in the same vector on eager backends; on XLA they time
    # the tracing, this rank's own (its non-compute share is not measured there)
    timings = [COMPUTE.take(), COMM.take(), *([moe.DISPATCH.take()] if run.moe_loss is not None else [])]
    eager = not par.comm.lazy
    vector = _reduced(par, [mine, *moe_values, *(timings if eager else [])], [norm])
    return QueuedStep(
        step,
        lr,
        t0,
        vector,
        len(moe_values),
        eager,
        [] if eager else timings,
        par.comm.compiles(),
        run.batches.consumed_samples,
    )


def _finish_step(plan: Plan, par: Parallel, run: Run, queued: QueuedStep, since: float) -> dict[str, Any]:
    """Read a queued step's values (the step's one host read) into its metrics record; its time counts
    from `since`, or from its start if that is later (a backend whose cut returns before the device
    has run the graph traces step N + 1 before it reads step N: `since` is then when step N - 1's
    values were read, so steady steps time the period between two steps' results)."""
    cfg = plan.cfg
    loss, *summed = _read(par, queued.vector)
    step_time = time.perf_counter() - max(since, queued.started)
    moe_sums, summed = summed[: queued.moe_count], summed[queued.moe_count :]
    timings = queued.timings
    if queued.eager:
        n = 3 if queued.moe_count else 2
        timings, summed = [t / par.world for t in summed[:n]], summed[n:]
    grad_norm = summed[0]
    if not queued.eager and not math.isfinite(grad_norm):
        log.warning("gradient norm is %s: the update of step %d was skipped", grad_norm, queued.step + 1)
    compute_mean, comm_mean = timings[0], timings[1]
    tokens_per_step = cfg.global_batch * cfg.seq_len
    return {
        "event": "step",
        "step": queued.step + 1,
        "loss": loss,
        "lr": queued.lr,
        "grad_norm": grad_norm,
        "step_time": step_time,
        "tokens_per_s": tokens_per_step / step_time,
        "tokens": (queued.step + 1) * tokens_per_step,
        "consumed_samples": queued.consumed_samples,
        "compute_time": compute_mean,
        "collective_time": comm_mean,
        "comm_share": max(0.0, 1.0 - compute_mean / step_time) if queued.eager else None,
        "memory_mb": peak_memory_mb(par.device),
        **(moe.step_record([*moe_sums, timings[2]], 1) if moe_sums else {}),
        **({"xla_compiles": queued.compiles} if queued.compiles is not None else {}),
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
        merged = plan.lora.merged(cast(StageModel, run.model), run.adapters, par.tp_rank, par.pp_rank)
    return str(
        export_hf(run.model, plan.spec, par, cfg.export_hf, source_dir, plan.dtype, export_run(cfg), step, merged)
    )


__all__ = [
    "train",
    "plan_run",
    "plan_eval",
    "Plan",
    "Summary",
    "ShardkitError",
    "DTYPES",
    "RunSchedule",
    "check_resume_settings",
    "run_layout",
    "saved_settings",
]
