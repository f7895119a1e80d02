"""Where this rank sits in the tp x pp x dp grid, its device and its groups.

Rank order. On gloo and nccl: tp fastest, then pp, then dp, `global rank = dp * (pp * tp) +
pp_rank * tp + tp_rank`. On XLA: NxD's (`parallel_state.initialize_model_parallel` reshapes the
ranks to [pp, dp, tp]): tp fastest, then dp, then pp, `global rank = pp_rank * (dp * tp) + dp *
tp + tp_rank`, so the replica groups are the ones NxD passes to the same collectives. Either way
the tp ranks of one stage are neighbours (one node, fastest links), and rank 0 is tp 0 of the
first stage of replica 0; everything else (data, checkpoint files) goes by coordinates.

Collectives go through the communication interface (`trainer/comm`): torch.distributed (gloo on
CPU, nccl on CUDA, every group with a timeout) or torch-xla (`--device xla`). A one-process run
creates no group at all; every collective on a group of size 1 is a no-op.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from shardkit.distributed import Job

from .clocks import COMM, COMPUTE, Clock
from .comm.base import Comm, Group
from .errors import JobFailed, TrainerError, decide_exit, exit_code, one_line

log = logging.getLogger("trainer")
T = TypeVar("T")

__all__ = ["COMM", "COMPUTE", "Clock", "Group", "Parallel", "agree", "choose_device", "init_parallel", "join"]


# ---- groups --------------------------------------------------------------------------------------


@dataclass
class Parallel:
    """This process's coordinates in the tp x pp x dp grid, its device and its groups."""

    tp: int
    pp: int
    dp: int
    rank: int
    world: int
    device: torch.device
    comm: Comm
    tp_group: Group
    pp_group: Group
    dp_group: Group
    mp_group: Group  # tp x pp: one model replica
    world_group: Group  # every rank (metrics)
    extra: dict[frozenset, Group] = field(default_factory=dict)
    ep: int = 1  # expert parallel: ep groups are carved out of the dp ranks (trainer/moe.py)
    ep_group: Group | None = None  # dp ranks exchanging tokens: edp * ep .. edp * ep + ep - 1
    edp_group: Group | None = None  # expert data parallel: the dp ranks holding the same experts
    nxd_order: bool = False  # pp slowest (XLA), else dp slowest

    @property
    def backend(self) -> str:
        return self.comm.name

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.tp * self.dp) if self.nxd_order else self.rank // self.tp % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp % self.dp if self.nxd_order else self.rank // (self.tp * self.pp)

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def edp_rank(self) -> int:
        return self.dp_rank // self.ep

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def global_rank(self, dp: int, pp: int, tp: int) -> int:
        if self.nxd_order:
            return pp * self.dp * self.tp + dp * self.tp + tp
        return dp * self.pp * self.tp + pp * self.tp + tp

    def describe(self) -> str:
        return f"rank {self.rank} (dp {self.dp_rank}, pp {self.pp_rank}, tp {self.tp_rank})"

    def new_groups(self, rank_sets: Iterable[Iterable[int]]) -> dict[frozenset, Group]:
        """Create a group for each set of global ranks; EVERY process must call this with the same
        sets in the same order. Returns the groups this process belongs to, keyed by rank set
        (and keeps them in `extra`)."""
        created = self.comm.new_groups([list(r) for r in rank_sets])
        self.extra.update(created)
        return created

    def mine(self, rank_sets: list[list[int]]) -> Group:
        """Create the groups of `rank_sets` (every process, the same sets) and return this rank's."""
        return self.comm.new_groups(rank_sets)[next(frozenset(s) for s in rank_sets if self.rank in s)]

    # ---- whole-job helpers (host side) -------------------------------------------------------------
    def barrier(self) -> None:
        if self.world > 1:
            with COMM.timed():
                self.comm.barrier()

    @property
    def job(self) -> Job:
        """The whole job as shardkit's whole-job helpers see it."""
        return self.comm.job

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's value, on every rank."""
        return self.job.broadcast(value)

    def all_ok(self, step: Callable[[], T]) -> T:
        """Run `step` on every rank; if it fails anywhere, raise `JobFailed` on every rank (no rank
        is left waiting in a collective for one that died; every rank exits with the same code)."""
        error, result = None, None
        try:
            result = step()
        except Exception as e:  # noqa: BLE001 - agreed on, then raised on every rank
            error = e
        agree(self.comm, error)
        return result  # type: ignore[return-value]


# ---- failing together ------------------------------------------------------------------------------


def agree(comm: Comm, error: BaseException | None) -> None:
    """Every rank calls this with its own error (or None). If any rank failed, every rank raises
    `JobFailed` with the first failing rank's one-line message and exit code, and only after a
    barrier: by then every rank has decided its exit code (`decide_exit`), so whichever rank
    torchrun reaches first, all exit with the same code. A one-process run re-raises `error`."""
    mine = None if error is None else (exit_code(error), one_line(error))
    if mine is not None:
        decide_exit(mine[0])
    if comm.world == 1:
        if error is not None:
            raise error
        return
    reports = comm.job.gather(mine)
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    rank, (code, message) = failed[0]
    decide_exit(code)
    comm.barrier()
    raise JobFailed(message, rank, code, comm.world) from error


# ---- environment ---------------------------------------------------------------------------------


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) of this rank: from torchrun's environment, or from the
    threaded job it runs in (comm/threads.py); (0, 1, 0) for a plain run."""
    from .comm.threads import current

    me = current()
    if me is not None:
        return me.rank, me.world.size, me.rank
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world, local


def device_kind(requested: str | None) -> str:
    """cpu, cuda or xla: `requested`, else xla when torch-xla is installed and no CUDA device is
    present, else cuda when available, else cpu."""
    from .comm.xla import xla_available

    if requested:
        return requested
    cuda = torch.cuda.is_available()
    return "xla" if not cuda and xla_available() else "cuda" if cuda else "cpu"


def choose_device(requested: str | None, local_rank: int) -> torch.device:
    """This rank's device (see `device_kind`); a TrainerError when it cannot be had."""
    from .comm.xla import xla_available

    kind = device_kind(requested)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise TrainerError("--device cuda: no CUDA device is available; use --device cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if kind == "xla":
        if not xla_available():
            raise TrainerError("--device xla needs torch-xla (pip install torch-xla / the Neuron SDK)")
        _, world, _ = world_from_env()
        if world > 1 and os.environ.get("PJRT_DEVICE", "").upper() == "CPU" and "RANK" in os.environ:
            raise TrainerError(
                "torch-xla on CPU has no collectives between processes (each process of the job would train "
                "alone): run one process with CPU_NUM_DEVICES=N (N ranks, one thread each) instead of torchrun"
            )
        import torch_xla

        this_device = getattr(torch_xla, "device", None)  # torch-xla >= 2.5; xm.xla_device before
        if callable(this_device):
            return this_device()
        import torch_xla.core.xla_model as xm

        return xm.xla_device()
    return torch.device("cpu")


def resolve_dp(tp: int, pp: int, dp: int, world: int) -> int:
    """The data-parallel degree for `world` processes, or a TrainerError saying what to change."""
    if world % (tp * pp):
        raise TrainerError(
            f"tp {tp} x pp {pp} = {tp * pp} does not divide the {world} processes of this job: "
            f"launch a multiple of {tp * pp} processes or change --tp/--pp"
        )
    if dp and tp * pp * dp != world:
        raise TrainerError(
            f"tp {tp} x pp {pp} x dp {dp} = {tp * pp * dp} processes, but the job has {world}: "
            f"launch {tp * pp * dp} processes (torchrun --nproc-per-node {tp * pp * dp}) or change --dp"
        )
    return dp or world // (tp * pp)


def join(device: torch.device | None, timeout_s: float) -> Comm:
    """This rank's communication: torch-xla's on an XLA device, else torch.distributed's (joining or
    creating the default process group; none for one process). Without a device (choosing it
    failed) the group is gloo's, just to agree on the failure."""
    rank, world, _ = world_from_env()
    if device is not None and device.type == "xla":
        from .comm.xla import join_xla

        return join_xla(device, rank, world, timeout_s)
    from .comm.torch_dist import join_torch

    return join_torch(device, rank, world, timeout_s)


def init_parallel(
    tp: int, pp: int, dp: int, device: torch.device, timeout_s: float, ep: int = 1, comm: Comm | None = None
) -> Parallel:
    """Join the job (unless `comm` already did) and build the tp/pp/dp groups (and, with ep > 1,
    the expert-parallel and expert-data-parallel groups inside dp)."""
    comm = comm or join(device, timeout_s)
    rank, world = comm.rank, comm.world
    solo = Group([rank], 0)
    par = Parallel(tp, pp, dp, rank, world, device, comm, solo, solo, solo, solo, solo, ep=ep)
    par.nxd_order = comm.name == "xla"
    par.ep_group, par.edp_group = solo, solo
    if world == 1:
        return par

    def index(d: int, p: int, t: int) -> int:
        return par.global_rank(d, p, t)

    par.tp_group = par.mine([[index(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)])
    par.pp_group = par.mine([[index(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)])
    par.dp_group = par.mine([[index(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)])
    par.mp_group = par.mine([[index(d, p, t) for p in range(pp) for t in range(tp)] for d in range(dp)])
    par.world_group = par.mine([list(range(world))])
    par.edp_group = par.dp_group
    if ep > 1:  # dp rank d is ep rank d % ep of expert-data-parallel rank d // ep
        groups = dp // ep
        par.ep_group = par.mine(
            [[index(e * ep + j, p, t) for j in range(ep)] for e in range(groups) for p in range(pp) for t in range(tp)]
        )
        par.edp_group = par.mine(
            [[index(e * ep + j, p, t) for e in range(groups)] for j in range(ep) for p in range(pp) for t in range(tp)]
        )
    log.debug("%s of %d (%s backend, device %s)", par.describe(), world, comm.name, device)
    return par
