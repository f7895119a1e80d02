"""Pipeline parallelism by neighbour exchanges: the pipeline of the XLA path.

XLA has no point-to-point send/recv on Neuron. NxD's pipeline (`pipeline/comm.py`) moves a
stage's activations to the next stage, and gradients back, with collectives over two-rank replica
groups: both neighbours join one all-gather, each contributing its tensor (or zeros), and each
keeps the other's. Such a collective blocks both sides until both arrive, so the two neighbours
must meet for their exchanges in the same order. This module makes that order by construction:

1. every pp rank's order of actions -- forward F(chunk, micro-batch) and backward B(chunk,
   micro-batch) -- is the schedule's (1F1B, GPipe, or interleaved 1F1B over `--vpp` chunks, chunk
   c on pp rank c % pp, Megatron's order);
2. `timetable` plays those orders in lock step: at every tick each rank does its next action if
   its input has arrived (else waits), then every pair of neighbouring ranks with something to
   pass exchanges it (a forward's output goes to the next chunk's rank, a backward's input
   gradient to the previous chunk's), pairs taken in one global order;
3. every rank computes the same timetable, so the two ranks of a pair know at which ticks they
   exchange; a rank that has nothing to send contributes zeros.

After each tick the rank cuts the graph (as NxD cuts after each pipeline task), so a step is a
few small graphs that repeat from micro-batch to micro-batch instead of one unrolled graph.
It runs on any `Comm` (on gloo too: the exchange is an all-gather there as well).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardkit.layout import Layout

from .clocks import COMPUTE
from .comm.base import Group
from .errors import TrainerError
from .model import StageModel
from .parallel import Parallel


@dataclass(frozen=True)
class Action:
    forward: bool
    chunk: int  # global chunk (virtual stage) index; it runs on pp rank chunk % pp
    micro: int

    def __repr__(self) -> str:
        return f"{'F' if self.forward else 'B'}{self.chunk}.{self.micro}"


def rank_orders(schedule: str, pp: int, vpp: int, n: int, training: bool = True) -> list[list[Action]]:
    """Each pp rank's actions in the schedule's order (forward only when not `training`)."""
    if not training:
        return [[Action(True, v * pp + r, m) for m in range(n) for v in range(vpp)] for r in range(pp)]
    orders = []
    for r in range(pp):
        if schedule == "gpipe":
            order = [Action(True, r, m) for m in range(n)] + [Action(False, r, m) for m in range(n)]
        elif schedule == "1f1b":
            warmup = min(pp - r - 1, n)
            order = [Action(True, r, m) for m in range(warmup)]
            for i in range(n - warmup):
                order += [Action(True, r, warmup + i), Action(False, r, i)]
            order += [Action(False, r, m) for m in range(n - warmup, n)]
        else:  # interleaved 1F1B (Megatron): micro-batches in groups of pp, chunk by chunk
            total = n * vpp

            def nth(k: int, forward: bool, r: int = r) -> Action:
                v = (k // pp) % vpp
                return Action(forward, (v if forward else vpp - 1 - v) * pp + r, (k // (pp * vpp)) * pp + k % pp)

            warmup = min((pp - r - 1) * 2 + (vpp - 1) * pp, total)
            order = [nth(k, True) for k in range(warmup)]
            for i in range(total - warmup):
                order += [nth(warmup + i, True), nth(i, False)]
            order += [nth(k, False) for k in range(total - warmup, total)]
        orders.append(order)
    return orders


def timetable(orders: list[list[Action]], chunks: int) -> list[list[Action | None]]:
    """The orders played in lock step (module docstring): per tick, each rank's action or None."""
    pp = len(orders)
    done: set[Action] = set()
    arrived: set[tuple[str, int, int]] = set()
    position = [0] * pp
    ticks: list[list[Action | None]] = []

    def ready(a: Action) -> bool:
        if a.forward:
            return a.chunk == 0 or ("act", a.chunk, a.micro) in arrived
        return Action(True, a.chunk, a.micro) in done and (
            a.chunk == chunks - 1 or ("grad", a.chunk, a.micro) in arrived
        )

    while any(position[r] < len(orders[r]) for r in range(pp)):
        row: list[Action | None] = []
        for r in range(pp):
            a = orders[r][position[r]] if position[r] < len(orders[r]) else None
            row.append(a if a is not None and ready(a) else None)
        if all(a is None for a in row):
            raise RuntimeError(
                f"pipeline timetable stuck at tick {len(ticks)}: {[o[p:] for o, p in zip(orders, position)]}"
            )
        for r, a in enumerate(row):
            if a is None:
                continue
            position[r] += 1
            done.add(a)
            if a.forward and a.chunk < chunks - 1:
                arrived.add(("act", a.chunk + 1, a.micro))
            elif not a.forward and a.chunk > 0:
                arrived.add(("grad", a.chunk - 1, a.micro))
        ticks.append(row)
    return ticks


def sends(a: Action | None, chunks: int, pp: int) -> int | None:
    """The pp rank that action `a`'s output goes to (None: nothing leaves the rank)."""
    if a is None:
        return None
    if a.forward:
        return (a.chunk + 1) % pp if a.chunk < chunks - 1 else None
    return (a.chunk - 1) % pp if a.chunk > 0 else None


def pair_order(pp: int) -> list[tuple[int, int]]:
    """The pairs of neighbouring pp ranks, in the one order every rank exchanges in (pairs that share
    no rank side by side: (0, 1), (2, 3), ..., then (1, 2), (3, 4), ...)."""
    pairs = sorted({tuple(sorted((r, (r + 1) % pp))) for r in range(pp)}, key=lambda p: (p[0] % 2, p))
    return [(a, b) for a, b in pairs]


class ExchangePipeline:
    """One step = `step(inputs, targets)` (or `forward_only`): the timetable over this rank's
    micro-batches; returns the sum of the (scaled) micro-batch losses on the last stage (a device
    tensor), 0 elsewhere. The tp ranks of a stage run the same timetable in lock step."""

    def __init__(
        self,
        model: StageModel,
        par: Parallel,
        loss_fn: Callable,
        schedule: str,
        n_micro: int,
        micro_batch: int,
        payload: list[tuple[tuple[int, ...], torch.dtype]],
        layout: Layout,
        num_layers: int,
    ):
        from .pipeline import StageChunk

        if schedule not in ("1f1b", "gpipe", "interleaved"):
            raise TrainerError(
                f"--pp-schedule {schedule} is not available on XLA: use 1f1b, gpipe or interleaved (with --vpp)"
            )
        vpp = layout.vpp
        if schedule == "interleaved" and n_micro % par.pp:
            raise TrainerError(
                f"the interleaved schedule on XLA runs the micro-batches in groups of pp {par.pp}: use a multiple of "
                f"{par.pp} micro-batches per step (got {n_micro})"
            )
        self.par, self.model, self.loss_fn = par, model, loss_fn
        self.n_micro, self.micro_batch, self.payload = n_micro, micro_batch, payload
        self.chunks = par.pp * vpp
        self.schedule_name = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "interleaved 1F1B"}[schedule]
        self.schedule_name += " by neighbour exchanges"
        self.tables = {
            training: timetable(rank_orders(schedule, par.pp, vpp, n_micro, training), self.chunks)
            for training in (True, False)
        }
        chunk_layers = layout.chunk_layers(num_layers)
        self.modules: dict[int, nn.Module] = {
            c: (model if vpp == 1 else StageChunk(model, list(chunk_layers[c]), c == 0, c == self.chunks - 1))
            for c in layout.rank_chunks(par.pp_rank)
        }
        self.pairs = self._pair_groups()

    def _pair_groups(self) -> dict[tuple[int, int], Group]:
        """This rank's two-rank groups with its neighbouring stages, by pair of pp ranks."""
        par = self.par
        ring = pair_order(par.pp)
        sets = [
            [par.global_rank(d, a, t), par.global_rank(d, b, t)]
            for a, b in ring
            for d in range(par.dp)
            for t in range(par.tp)
        ]
        made = par.new_groups(sets)
        me = par.pp_rank
        return {
            (a, b): made[
                frozenset((par.global_rank(par.dp_rank, a, par.tp_rank), par.global_rank(par.dp_rank, b, par.tp_rank)))
            ]
            for a, b in ring
            if me in (a, b)
        }

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the step's micro-batches (gradients accumulated)."""
        return self._run(inputs, targets, training=True)

    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward over the step's micro-batches (evaluation)."""
        return self._run(inputs, targets, training=False)

    def _run(self, inputs: torch.Tensor, targets: torch.Tensor, training: bool) -> torch.Tensor:
        par, comm = self.par, self.par.comm
        device = comm.device
        first = 0 in self.modules
        last = self.chunks - 1 in self.modules
        ids = [x.to(device) for x in inputs.split(self.micro_batch)] if first else []
        tgts = [y.to(device) for y in targets.split(self.micro_batch)] if last else []
        state = _Stash()
        total = torch.zeros((), dtype=comm.accumulate_dtype, device=device)
        for row in self.tables[training]:
            mine = row[par.pp_rank]
            out: list[torch.Tensor] | None = None
            if mine is not None:
                with COMPUTE.timed():
                    if mine.forward:
                        out, loss = self._forward(mine, state, ids, tgts, training)
                        if loss is not None:
                            total = total + loss.detach().to(total.dtype)
                    else:
                        out = self._backward(mine, state)
            comm.isolate()  # the exchanges in a graph of their own (comm.base.Comm.isolate)
            self._exchange(row, out, state, training)
            comm.cut()
            state.held.clear()
        return total

    def _forward(self, a: Action, state: _Stash, ids: list, tgts: list, training: bool):
        """F(chunk, micro): the chunk on its input; the loss on the last chunk; returns what goes to
        the next chunk's rank (or None) and the loss (or None)."""
        if a.chunk == 0:
            args: list[torch.Tensor] = [ids[a.micro]]
        else:
            args = [t.detach().requires_grad_(training) for t in state.inbox.pop(("act", a.chunk, a.micro))]
            if training:
                state.inputs[(a.chunk, a.micro)] = args
        output = self.modules[a.chunk](*args)
        if a.chunk == self.chunks - 1:
            loss = self.loss_fn(output, tgts[a.micro])
            if training:
                state.losses[(a.chunk, a.micro)] = loss
            return None, loss
        outs = list(output) if isinstance(output, tuple) else [output]
        if training:
            state.outputs[(a.chunk, a.micro)] = outs
        return [t.detach() for t in outs], None

    def _backward(self, a: Action, state: _Stash) -> list[torch.Tensor] | None:
        """B(chunk, micro): backward from the loss or the gradients received; returns the gradients
        of the chunk's inputs for the previous chunk's rank (None for chunk 0)."""
        key = (a.chunk, a.micro)
        if a.chunk == self.chunks - 1:
            state.losses.pop(key).backward()
        else:
            torch.autograd.backward(state.outputs.pop(key), grad_tensors=state.inbox.pop(("grad", *key)))
        if a.chunk == 0:
            return None
        leaves = state.inputs.pop(key)
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]

    def _exchange(
        self, row: list[Action | None], out: list[torch.Tensor] | None, state: _Stash, training: bool
    ) -> None:
        """Every pair of neighbours with something to pass at this tick exchanges it (this rank's
        pairs, in the global pair order); what arrives waits in the inbox for its action."""
        par = self.par
        me, pp = par.pp_rank, par.pp
        for (a, b), group in self.pairs.items():
            peer = b if a == me else a
            mine_to = sends(row[me], self.chunks, pp)
            theirs_to = sends(row[peer], self.chunks, pp)
            give = mine_to == peer
            take = theirs_to == me
            if not give and not take:
                continue
            tensors = out if give and out is not None else self._zeros()
            got = [group.exchange(t.contiguous()) for t in tensors]
            # kept until the cut even when nothing arrives: XLA drops a collective whose result
            # nobody holds, and the peer would wait for it (NxD keeps the sender's slice alike)
            state.held.extend(got)
            if take:
                src = row[peer]
                assert src is not None  # sends() is None without an action
                if src.forward:
                    state.inbox[("act", src.chunk + 1, src.micro)] = got
                else:
                    state.inbox[("grad", src.chunk - 1, src.micro)] = got

    def _zeros(self) -> list[torch.Tensor]:
        device = self.par.comm.device
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in self.payload]


class _Stash:
    """What a rank keeps between ticks of one step."""

    def __init__(self) -> None:
        self.inbox: dict[tuple[str, int, int], list[torch.Tensor]] = {}  # received activations / gradients
        self.inputs: dict[tuple[int, int], list[torch.Tensor]] = {}  # a chunk's input leaves, for their gradients
        self.outputs: dict[tuple[int, int], list[torch.Tensor]] = {}  # a chunk's outputs, to backward from
        self.losses: dict[tuple[int, int], Any] = {}  # the last chunk's losses, to backward from
        self.held: list[torch.Tensor] = []  # this tick's exchange results, alive until the cut
