"""Pipeline parallelism with PyTorch's own schedules (torch.distributed.pipelining).

Each pipeline rank runs its part of the model as one or more `PipelineStage`s over the pp group
(the ranks with the same tp and dp coordinates). With one stage per rank (`--vpp 1`) the stage is
the rank's whole `StageModel` and `Schedule1F1B` runs it: after a warm-up of (stages - stage index)
forwards, every forward is followed by a backward, so at most `stages` micro-batches' activations
are alive on a stage. When a step has fewer micro-batches than stages, 1F1B cannot fill the pipe
and `ScheduleGPipe` runs instead.

Virtual stages (`--vpp N`, NxD's virtual_pipeline_size): the layers are cut into pp x N chunks of
consecutive layers and chunk c runs on pp rank c % pp (`Layout.chunk_layers`/`rank_chunks`, the
same rule the rank files follow). A rank's `StageModel` still holds all its layers under their
global names (its state dict is its rank file); each chunk is a `StageChunk`, a view that runs
some of those layers (the embedding on chunk 0, the final norm and head on the last chunk), and
`ScheduleInterleaved1F1B` runs the rank's chunks as its stages, which cuts the pipeline's idle
time ("bubble") by about N at the cost of N times as many stage-to-stage transfers.

Shapes are static and given to each stage (no metadata round-trip at the first step): the first
stage takes token ids [micro_batch, seq]; every stage boundary carries hidden states
[seq (/tp with sequence parallelism), micro_batch, hidden]; the last stage yields local logits
[seq, micro_batch, vocab/tp] and the loss (vocab-parallel cross entropy over tp) is computed
there. Gradients are accumulated, not scaled by the schedule (`scale_grads=False`): the loss is
already divided by micro-batches x dp. The tp ranks of a stage run the same schedule in lock
step, so their tensor-parallel collectives pair up.

With pp = 1 no pipeline machinery is used: `run_micro_batches` is a plain accumulation loop.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from shardkit.layout import Layout

from .clocks import COMPUTE
from .comm.base import Comm
from .comm.torch_dist import TorchGroup
from .errors import TrainerError
from .model import StageModel
from .parallel import Parallel

SINGLE_STAGE = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}
MULTI_STAGE = {
    "interleaved": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "looped-bfs": "ScheduleLoopedBFS",
}
ZBV_REASON = (
    "--pp-schedule zbv is not supported: ZBV needs a V-shaped stage placement (pp rank r runs chunks r and "
    "2 x pp - 1 - r, the embedding and the head both on rank 0), which NxD's round-robin per-pp-rank files "
    "cannot hold; use --pp-schedule interleaved (or interleaved-zb) with --vpp 2"
)


def resolve_schedule(name: str, pp: int, vpp: int, n_micro: int, num_layers: int) -> str:
    """The schedule to run ('1f1b', 'gpipe', 'interleaved', ...) for --pp-schedule `name`, or a
    TrainerError saying what is wrong with the combination and how to fix it."""
    if pp == 1:
        if vpp > 1:
            raise TrainerError(f"--vpp {vpp} needs --pp > 1: virtual stages interleave the pipeline ranks")
        if name != "auto":
            raise TrainerError(f"--pp-schedule {name} needs --pp > 1 (with one stage no pipeline schedule runs)")
        return "none"
    if vpp > 1 and num_layers % (pp * vpp):
        raise TrainerError(
            f"{num_layers} layers do not divide into pp {pp} x vpp {vpp} = {pp * vpp} equal chunks: "
            "choose pp x vpp dividing the layer count"
        )
    if name == "zbv":
        raise TrainerError(ZBV_REASON)
    if name == "auto":
        name = "interleaved" if vpp > 1 else "1f1b" if n_micro >= pp else "gpipe"
    if name in SINGLE_STAGE and vpp > 1:
        raise TrainerError(
            f"--pp-schedule {name} runs one stage per pp rank, not --vpp {vpp}: use --pp-schedule interleaved "
            "(or --vpp 1)"
        )
    if name == "1f1b" and n_micro < pp:
        raise TrainerError(
            f"--pp-schedule 1f1b needs at least pp {pp} micro-batches per step, got {n_micro}: raise "
            "--global-batch or lower --micro-batch, or use gpipe"
        )
    if name in ("interleaved", "interleaved-zb"):
        # torch's rule: the micro-batches run in rounds of about pp, and must fill whole rounds
        rounds = max(1, n_micro // pp)
        if n_micro % rounds:
            raise TrainerError(
                f"the {name} schedule needs the {n_micro} micro-batches per step to split into "
                f"{rounds} equal rounds (n // pp of them): use a multiple of pp {pp} micro-batches"
            )
    return name


def _timed_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A PipelineStage that books its forward/backward compute on the COMPUTE clock, so the
        time a stage waits on its neighbours shows as communication in the metrics."""

        def forward_one_chunk(self, *args, **kwargs):
            with COMPUTE.timed():
                return super().forward_one_chunk(*args, **kwargs)

        def backward_one_chunk(self, *args, **kwargs):
            with COMPUTE.timed():
                return super().backward_one_chunk(*args, **kwargs)

        def backward_weight_one_chunk(self, *args, **kwargs):
            with COMPUTE.timed():
                return super().backward_weight_one_chunk(*args, **kwargs)

        def _get_init_p2p_neighbors_ops(self):
            # torch 2.9 greets its neighbours with an int64 stage index into a float32 buffer, and
            # gloo refuses the size mismatch (later torch sends float32, as here)
            ops = super()._get_init_p2p_neighbors_ops()
            for op in ops:
                if op.tensor.dtype != torch.float32:
                    op.tensor = op.tensor.to(torch.float32)
            return ops

    return TimedStage


class StageChunk(nn.Module):
    """One virtual stage of a rank: some of its `StageModel`'s layers (the same modules, so the
    gradients land on the model's parameters), with the embedding when it is the model's first
    chunk and the final norm and head when it is the last."""

    def __init__(self, model: StageModel, layer_ids: list[int], first: bool, last: bool):
        super().__init__()
        self._model = [model]  # a plain reference: the chunk's parameters are only its own layers'
        self.layers = nn.ModuleList([model.layers[str(i)] for i in layer_ids])
        self.first, self.last = first, last
        if first:
            self.embed_tokens = model.embedding
        if last:
            self.norm, self.lm_head = model.final_norm, model.head

    def forward(self, x: torch.Tensor, *carried: torch.Tensor):
        return self._model[0].run_chunk(x, self.layers, self.first, self.last, *carried)


class Pipeline:
    """One step = `step(inputs, targets)` (or `forward_only`): the schedule over this rank's
    micro-batches; returns the sum of the (scaled) micro-batch losses on the last stage, 0 elsewhere."""

    def __init__(
        self,
        model: StageModel,
        par: Parallel,
        loss_fn: Callable,
        n_micro: int,
        micro_batch: int,
        seq_len: int,
        hidden: int,
        vocab_local: int,
        dtype: torch.dtype,
        sequence_parallel: bool,
        schedule: str = "auto",
        layout: Layout | None = None,
        num_layers: int = 0,
        carry: torch.Tensor | None = None,
    ):
        import torch.distributed.pipelining as pipelining

        vpp = layout.vpp if layout is not None else 1
        name = resolve_schedule(schedule, par.pp, vpp, n_micro, num_layers)
        meta = torch.device("meta")
        seq_local = seq_len // par.tp if sequence_parallel and par.tp > 1 else seq_len
        # hidden states carry gradients across stage boundaries: their metadata says so
        hidden_meta = torch.empty(seq_local, micro_batch, hidden, dtype=dtype, device=meta, requires_grad=True)
        ids_meta = torch.empty(micro_batch, seq_len, dtype=torch.long, device=meta)
        logits_meta = torch.empty(seq_len, micro_batch, vocab_local, dtype=dtype, device=meta, requires_grad=True)
        stage_cls = _timed_stage_class()

        def stage(module: nn.Module, index: int, count: int):
            first, last = index == 0, index == count - 1
            inputs: tuple[torch.Tensor, ...] = (ids_meta if first else hidden_meta,)
            outputs: tuple[torch.Tensor, ...] = (logits_meta if last else hidden_meta,)
            if carry is not None:  # a tensor every stage passes on beside its output (MoE statistics)
                inputs += () if first else (carry,)
                outputs += (carry,)
            return stage_cls(
                module,
                index,
                count,
                par.device,
                input_args=inputs,
                output_args=outputs,
                group=cast(TorchGroup, par.pp_group).pg,
            )

        if name in SINGLE_STAGE:
            self.stages = [stage(model, par.pp_rank, par.pp)]
            schedule_cls = getattr(pipelining, SINGLE_STAGE[name])
            self.schedule = schedule_cls(self.stages[0], n_micro, loss_fn=loss_fn, scale_grads=False)
        else:
            assert layout is not None  # multi-stage schedules place chunks by the layout
            chunk_layers = layout.chunk_layers(num_layers)
            self.stages = [
                stage(
                    StageChunk(model, list(chunk_layers[c]), c == 0, c == layout.chunks - 1),
                    c,
                    layout.chunks,
                )
                for c in layout.rank_chunks(par.pp_rank)
            ]
            schedule_cls = getattr(pipelining, MULTI_STAGE[name])
            self.schedule = schedule_cls(self.stages, n_micro, loss_fn=loss_fn, scale_grads=False)
        self.schedule_name = schedule_cls.__name__
        self.par = par
        # torch >= 2.10 can skip merging the last stage's outputs; 2.9 would pass the flag to the model
        takes_flag = "return_outputs" in inspect.signature(self.schedule.step).parameters
        self._quiet: dict[str, bool] = {"return_outputs": False} if takes_flag else {}

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the step's micro-batches (gradients accumulated)."""
        return self._run(self.schedule.step, inputs, targets)

    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The schedule's forward-only `eval` over the step's micro-batches (evaluation)."""
        return self._run(self.schedule.eval, inputs, targets)

    def _run(self, run: Callable, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        par = self.par
        inputs, targets = inputs.to(par.device), targets.to(par.device)
        losses: list[torch.Tensor] = []
        quiet = self._quiet
        if par.is_first_stage:
            run(inputs, **quiet)
        elif par.is_last_stage:
            run(target=targets, losses=losses, **quiet)
        else:
            run(**quiet)
        total = sum(loss.detach().float() for loss in losses) if losses else torch.zeros(())
        return torch.as_tensor(total).to(par.comm.accumulate_dtype)


def run_micro_batches(
    model: torch.nn.Module,
    loss_fn: Callable,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    micro_batch: int,
    comm: Comm,
    training: bool = True,
) -> torch.Tensor:
    """pp = 1: forward (and backward) each micro-batch, accumulating gradients; returns the loss sum
    (a tensor). Each micro-batch moves to the device on its own, and a lazy backend cuts the graph
    after it, so its graph is the same for every micro-batch (not the whole step unrolled)."""
    total = torch.zeros((), dtype=comm.accumulate_dtype, device=comm.device)
    for ids, tgt in zip(inputs.split(micro_batch), targets.split(micro_batch)):
        ids, tgt = ids.to(comm.device), tgt.to(comm.device)
        with COMPUTE.timed():
            loss = loss_fn(model(ids), tgt)
            if training:
                loss.backward()
        total = total + loss.detach().to(total.dtype)
        comm.cut()
    return total
