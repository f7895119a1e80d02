"""Pipeline parallelism with PyTorch's own schedules (torch.distributed.pipelining).

Each pipeline rank wraps its `StageModel` in a `PipelineStage` over the pp group (the ranks with
the same tp and dp coordinates, one per stage) and runs `Schedule1F1B` over the step's
micro-batches: after a warm-up of (stages - stage index) forwards, every forward is followed by a
backward, so at most `stages` micro-batches' activations are alive on a stage. When a step has
fewer micro-batches than stages, 1F1B cannot fill the pipe and `ScheduleGPipe` runs instead.

Shapes are static and given to the stage (no metadata round-trip at the first step): the first
stage takes token ids [micro_batch, seq]; every stage boundary carries hidden states
[seq (/tp with sequence parallelism), micro_batch, hidden]; the last stage yields local logits
[seq, micro_batch, vocab/tp] and the loss (vocab-parallel cross entropy over tp) is computed
there. Gradients are accumulated, not scaled by the schedule (`scale_grads=False`): the loss is
already divided by micro-batches x dp. The tp ranks of a stage run the same schedule in lock
step, so their tensor-parallel collectives pair up.

With pp = 1 no pipeline machinery is used: `run_micro_batches` is a plain accumulation loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .parallel import COMPUTE, Parallel


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

    return TimedStage


class Pipeline:
    """One step = `step(inputs, targets)`: the schedule over this rank's micro-batches; returns
    the sum of the (scaled) micro-batch losses on the last stage, 0 elsewhere."""

    def __init__(
        self,
        model: torch.nn.Module,
        par: Parallel,
        loss_fn: Callable,
        n_micro: int,
        micro_batch: int,
        seq_len: int,
        hidden: int,
        vocab_local: int,
        dtype: torch.dtype,
        sequence_parallel: bool,
        carry: torch.Tensor | None = None,
    ):
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        meta = torch.device("meta")
        seq_local = seq_len // par.tp if sequence_parallel and par.tp > 1 else seq_len
        # hidden states carry gradients across stage boundaries: their metadata says so
        hidden_meta = torch.empty(seq_local, micro_batch, hidden, dtype=dtype, device=meta, requires_grad=True)
        inputs: torch.Tensor | tuple[torch.Tensor, ...]
        outputs: torch.Tensor | tuple[torch.Tensor, ...]
        if par.is_first_stage:
            inputs = torch.empty(micro_batch, seq_len, dtype=torch.long, device=meta)
        else:
            inputs = hidden_meta
        if par.is_last_stage:
            outputs = torch.empty(seq_len, micro_batch, vocab_local, dtype=dtype, device=meta, requires_grad=True)
        else:
            outputs = hidden_meta
        if carry is not None:  # a tensor every stage passes on beside its output (MoE statistics)
            inputs = inputs if par.is_first_stage else (inputs, carry)
            outputs = (outputs, carry)
        stage_cls = _timed_stage_class()
        self.stage = stage_cls(
            model, par.pp_rank, par.pp, par.device, input_args=inputs, output_args=outputs, group=par.pp_group.pg
        )
        schedule_cls = Schedule1F1B if n_micro >= par.pp else ScheduleGPipe
        self.schedule_name = schedule_cls.__name__
        self.schedule = schedule_cls(self.stage, n_micro, loss_fn=loss_fn, scale_grads=False)
        self.par = par

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        par = self.par
        losses: list[torch.Tensor] = []
        if par.is_first_stage:
            self.schedule.step(inputs, return_outputs=False)
        elif par.is_last_stage:
            self.schedule.step(target=targets, losses=losses, return_outputs=False)
        else:
            self.schedule.step(return_outputs=False)
        return float(sum(loss.detach().float() for loss in losses)) if losses else 0.0


def run_micro_batches(
    model: torch.nn.Module, loss_fn: Callable, inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int
) -> float:
    """pp = 1: forward and backward each micro-batch, accumulating gradients; returns the loss sum."""
    total = 0.0
    for ids, tgt in zip(inputs.split(micro_batch), targets.split(micro_batch)):
        with COMPUTE.timed():
            loss = loss_fn(model(ids), tgt)
            loss.backward()
        total += float(loss.detach())
    return total
