"""Where this rank sits in the tp x pp x dp grid, its device and its groups.

Rank order. On gloo and nccl: tp fastest, then pp, then dp, `global rank = dp * (pp * tp) +
pp_rank * tp + tp_rank`. On XLA: NxD's, so the replica groups are the lists NxD's
`parallel_state.initialize_model_parallel` passes to the same collectives (`nxd_layout`): in
general the ranks reshaped to [pp, dp, tp] (tp fastest, then dp, then pp, `global rank = pp_rank *
(dp * tp) + dp * tp + tp_rank`); on Trn1 with tp 4, tp groups strided inside each node; on Trn2
with tp 32 at LNC 2 or tp 64 at LNC 1, tp groups of a node's first and last rows ("LOGIC2"). Every
group, and every rank's coordinates, follow from one table (`Layout`), so all collectives agree.
Either way rank 0 is tp 0 of the first stage of replica 0; everything else (data, checkpoint
files) goes by coordinates.

Collectives go through the communication interface (`trainer/comm`): torch.distributed (gloo on
CPU, nccl on CUDA, every group with a timeout) or torch-xla (`--device xla`). A one-process run
creates no group at all; every collective on a group of size 1 is a no-op.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import torch

from shardkit.distributed import Job

from .clocks import COMM, COMPUTE, Clock
from .comm.base import Comm, Group
from .errors import JobFailed, TrainerError, decide_exit, exit_code, one_line

log = logging.getLogger("trainer")
T = TypeVar("T")

__all__ = [
    "COMM",
    "COMPUTE",
    "Clock",
    "Group",
    "Layout",
    "Parallel",
    "agree",
    "choose_device",
    "init_parallel",
    "join",
    "nxd_layout",
]


# ---- rank layout ---------------------------------------------------------------------------------

PLATFORM_ENV = "TRAINER_NXD_PLATFORM"  # trn1, trn2, trn3 or generic: the platform NxD's groups are chosen for
TRN1 = ("trn1", "trn1n", "inf2")  # what NxD's `hardware` enum counts as Trn1


@dataclass(frozen=True)
class Layout:
    """Which global rank holds each (dp, pp, tp) coordinate: `rows[pp_rank * dp + dp_rank][tp_rank]`
    (on XLA, NxD's tp groups in NxD's order). The group lists are built from it in NxD's order."""

    name: str
    rows: tuple[tuple[int, ...], ...]
    dp: int

    @property
    def pp(self) -> int:
        return len(self.rows) // self.dp

    @property
    def tp(self) -> int:
        return len(self.rows[0])

    def rank(self, dp: int, pp: int, tp: int) -> int:
        return self.rows[pp * self.dp + dp][tp]

    @cached_property
    def coords(self) -> dict[int, tuple[int, int, int]]:
        """global rank -> (dp, pp, tp)"""
        return {r: (i % self.dp, i // self.dp, t) for i, row in enumerate(self.rows) for t, r in enumerate(row)}

    def tp_groups(self) -> list[list[int]]:
        return [list(row) for row in self.rows]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(d, p, t) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def mp_groups(self) -> list[list[int]]:
        """tp x pp: one model replica"""
        return [[self.rank(d, p, t) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)]

    def ep_groups(self, ep: int) -> list[list[int]]:
        """The dp ranks exchanging tokens: dp rank d is ep rank d % ep of expert-data-parallel rank d // ep."""
        return [
            [self.rank(e * ep + j, p, t) for j in range(ep)]
            for p in range(self.pp)
            for e in range(self.dp // ep)
            for t in range(self.tp)
        ]

    def edp_groups(self, ep: int) -> list[list[int]]:
        """The dp ranks holding the same experts."""
        return [
            [self.rank(e * ep + j, p, t) for e in range(self.dp // ep)]
            for p in range(self.pp)
            for j in range(ep)
            for t in range(self.tp)
        ]


def torch_layout(tp: int, pp: int, dp: int) -> Layout:
    """gloo's and nccl's: tp fastest, then pp, then dp."""
    rows = tuple(tuple(d * pp * tp + p * tp + t for t in range(tp)) for p in range(pp) for d in range(dp))
    return Layout("torch", rows, dp)


def nxd_layout(
    tp: int, pp: int, dp: int, ep: int = 1, platform: str | None = None, lnc: int = 1, local_world: int | None = None
) -> Layout:
    """The layout NxD's `parallel_state.initialize_model_parallel` builds on `platform` (None:
    the generic one) at logical-core size `lnc`, with LOCAL_WORLD_SIZE `local_world` (None: unset);
    a TrainerError where NxD builds none (or groups that do not fit together)."""
    world = tp * pp * dp
    trn1_tp4 = platform in TRN1 and tp == 4
    # get_logic_chosen: Trn2 at (lnc 1, tp 64) or (lnc 2, tp 32), but lnc 2 on fewer than 64 ranks is generic
    logic2 = platform == "trn2" and (lnc, tp) in ((1, 64), (2, 32)) and not (lnc == 2 and world < 64)
    if not (trn1_tp4 or logic2):
        return Layout("nxd", tuple(tuple(i * tp + t for t in range(tp)) for i in range(pp * dp)), dp)
    name = "nxd-trn1-tp4" if trn1_tp4 else "nxd-trn2-logic2"
    if ep > 1:  # NxD raises (Trn1) or builds ep groups that do not lie in its dp groups (Trn2)
        raise TrainerError(
            f"NxD's {name} layout has no expert parallelism: use --ep 1, another --tp, or {PLATFORM_ENV}=generic"
        )
    if trn1_tp4:
        # each node's ranks as [tp, node's dp rows]: tp rank t of row j is the node's rank t * rows + j
        rows_per_node = (world if local_world is None else local_world) // tp
        if rows_per_node < 1 or dp % rows_per_node:
            raise TrainerError(
                f"NxD's Trn1 tp 4 layout needs dp to be a multiple of the {rows_per_node} tp groups of a node "
                f"(LOCAL_WORLD_SIZE / 4), got dp {dp}: change --dp/--pp, or set {PLATFORM_ENV}=generic"
            )
        node = tp * rows_per_node
        rows = tuple(
            tuple(p * dp * tp + d // rows_per_node * node + t * rows_per_node + d % rows_per_node for t in range(tp))
            for p in range(pp)
            for d in range(dp)
        )
    else:
        # each node's four rows of cores: tp groups of its first and last rows and of its middle two
        # (one group of rows 0, 3, 1, 2 when tp is a whole node)
        per_node = 64 if local_world is None else local_world
        row = per_node // 4
        groups = []
        for base in range(0, world // per_node * per_node, per_node):
            r = [list(range(base + k * row, base + (k + 1) * row)) for k in range(4)]
            groups += [r[0] + r[3] + r[1] + r[2]] if per_node // tp == 1 else [r[0] + r[3], r[1] + r[2]]
        if len(groups) != pp * dp or any(len(g) != tp for g in groups):
            raise TrainerError(
                f"NxD's Trn2 tp {tp} layout needs nodes of tp or 2 x tp ranks (LOCAL_WORLD_SIZE {per_node}) "
                f"filling the {world} ranks: change --tp, or set {PLATFORM_ENV}=generic"
            )
        rows = tuple(tuple(g) for g in groups)
    return Layout(name, rows, dp)


def nxd_platform() -> str | None:
    """The platform NxD chooses its groups for: TRAINER_NXD_PLATFORM (`generic`: none), else
    NEURON_PLATFORM_TARGET_OVERRIDE, else torch-neuronx's `get_platform_target()` as NxD asks it,
    else None (no torch-neuronx, e.g. torch-xla's CPU runtime: NxD's generic layout)."""
    chosen = os.environ.get(PLATFORM_ENV) or os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    if chosen is None:
        try:
            from torch_neuronx.utils import get_platform_target

            target = get_platform_target()
            chosen = str(getattr(target, "value", target))  # a string; an enum in some releases
        except Exception:  # noqa: BLE001 - not installed, or not on a Neuron instance
            return None
    chosen = chosen.strip().lower()
    return None if chosen == "generic" else "trn1" if chosen in TRN1 else chosen


def nxd_lnc(platform: str | None) -> int:
    """Logical NeuronCore size: NEURON_LOGICAL_NC_CONFIG (NxD's `get_platform_lnc`), else the
    runtime's NEURON_RT_VIRTUAL_CORE_SIZE, else 2 on Trn2 and Trn3 and 1 elsewhere."""
    given = os.environ.get("NEURON_LOGICAL_NC_CONFIG") or os.environ.get("NEURON_RT_VIRTUAL_CORE_SIZE")
    return int(given) if given else 2 if platform in ("trn2", "trn3") else 1


def layout_for(comm_name: str, tp: int, pp: int, dp: int, ep: int) -> Layout:
    """This job's layout: NxD's on XLA (for the platform and LNC of this machine), else torch's."""
    if comm_name != "xla":
        return torch_layout(tp, pp, dp)
    platform = nxd_platform()
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return nxd_layout(tp, pp, dp, ep, platform, nxd_lnc(platform), int(local) if local else None)


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
    layout: Layout | None = None  # which rank holds which coordinates; None: torch's order

    def __post_init__(self) -> None:
        if self.layout is None:
            self.layout = torch_layout(self.tp, self.pp, self.dp)

    @property
    def _coords(self) -> tuple[int, int, int]:
        assert self.layout is not None
        return self.layout.coords[self.rank]

    @property
    def backend(self) -> str:
        return self.comm.name

    @property
    def tp_rank(self) -> int:
        return self._coords[2]

    @property
    def pp_rank(self) -> int:
        return self._coords[1]

    @property
    def dp_rank(self) -> int:
        return self._coords[0]

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
        assert self.layout is not None
        return self.layout.rank(dp, pp, tp)

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
    the expert-parallel and expert-data-parallel groups inside dp), each kind's list in NxD's order."""
    comm = comm or join(device, timeout_s)
    rank, world = comm.rank, comm.world
    solo = Group([rank], 0)
    layout = layout_for(comm.name, tp, pp, dp, ep) if world > 1 else None
    par = Parallel(tp, pp, dp, rank, world, device, comm, solo, solo, solo, solo, solo, ep=ep, layout=layout)
    par.ep_group, par.edp_group = solo, solo
    if world == 1:
        return par
    assert par.layout is not None
    par.tp_group = par.mine(par.layout.tp_groups())
    par.pp_group = par.mine(par.layout.pp_groups())
    par.dp_group = par.mine(par.layout.dp_groups())
    par.mp_group = par.mine(par.layout.mp_groups())
    par.world_group = par.mine([list(range(world))])
    par.edp_group = par.dp_group
    if ep > 1:
        par.ep_group = par.mine(par.layout.ep_groups(ep))
        par.edp_group = par.mine(par.layout.edp_groups(ep))
    log.debug("%s of %d (%s backend, %s layout, device %s)", par.describe(), world, comm.name, par.layout.name, device)
    return par
