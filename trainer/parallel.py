"""Process groups for tensor (tp), pipeline (pp) and data (dp) parallelism.

Rank order is NxD's and Megatron's: tp fastest, then pp, then dp,
`global rank = dp * (pp * tp) + pp_rank * tp + tp_rank`. So the tp ranks of one stage are
neighbours (one node, fastest links), and rank 0 is tp 0 of the first stage of replica 0.

Every group is created with a timeout: a collective that a peer never joins fails after
`timeout` seconds instead of hanging the job. The backend follows the device: gloo on CPU,
nccl on CUDA, xla when torch-xla is installed (Trainium); `--device` forces one.

A one-process run creates no process group at all; every collective on a group of size 1 is a
no-op, so the single-process path costs nothing.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from shardkit.distributed import Job

from .errors import JobFailed, TrainerError, decide_exit, exit_code, one_line

log = logging.getLogger("trainer")
T = TypeVar("T")

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xla": "xla"}
# torch >= 2.10 names them *_single; 2.9 (the floor) has only the older names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ---- timing of communication -------------------------------------------------------------------


class Clock:
    """Accumulated wall time of a kind of work; nested regions count once. A clock with `exclude`
    does not count the time the excluded clock accumulates inside its regions (compute net of the
    collectives it waits on). On CPU (gloo) collectives are synchronous, so the communication clock
    measures their cost, including waiting for slower peers."""

    def __init__(self, exclude: Clock | None = None) -> None:
        self.seconds = 0.0
        self.exclude = exclude
        self._depth = 0
        self._start = 0.0
        self._excluded = 0.0

    @contextmanager
    def timed(self) -> Iterator[None]:
        if self._depth == 0:
            self._start = time.perf_counter()
            self._excluded = self.exclude.seconds if self.exclude else 0.0
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                inside = (self.exclude.seconds - self._excluded) if self.exclude else 0.0
                self.seconds += time.perf_counter() - self._start - inside

    def take(self) -> float:
        """Seconds since the last take."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds


COMM = Clock()
"""Time inside blocking collectives (tp, dp, ZeRO, norm, replica syncs)."""
COMPUTE = Clock(exclude=COMM)
"""Time computing forward, backward and the update (net of collectives inside them)."""


# ---- groups --------------------------------------------------------------------------------------


@dataclass
class Group:
    """A process group and this rank's place in it. `ranks` are global ranks in group order."""

    ranks: list[int]
    rank: int  # this process's index in `ranks`
    pg: Any = None  # torch ProcessGroup; None when size 1

    @property
    def size(self) -> int:
        return len(self.ranks)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            with COMM.timed():
                dist.all_reduce(tensor, op=op, group=self.pg)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Broadcast from group member `src` (an index into `ranks`)."""
        if self.size > 1:
            with COMM.timed():
                dist.broadcast(tensor, src=self.ranks[src], group=self.pg)
        return tensor

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every member's `tensor` along dim 0 into `output`."""
        return self._along_dim0(_ALL_GATHER, output, tensor)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """Sum every member's `tensor`, each member keeping its chunk (along dim 0) in `output`."""
        return self._along_dim0(_REDUCE_SCATTER, output, tensor)

    def _along_dim0(self, collective, output: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            output.copy_(tensor)
            return output
        with COMM.timed():
            collective(output, tensor.contiguous(), group=self.pg)
        return output


def _solo(rank: int) -> Group:
    return Group([rank], 0, None)


@dataclass
class Parallel:
    """This process's coordinates in the tp x pp x dp grid, its device and its groups."""

    tp: int
    pp: int
    dp: int
    rank: int
    world: int
    device: torch.device
    backend: str
    timeout: datetime.timedelta
    tp_group: Group
    pp_group: Group
    dp_group: Group
    mp_group: Group  # tp x pp: one model replica
    extra: dict[frozenset, Group] = field(default_factory=dict)
    ep: int = 1  # expert parallel: ep groups are carved out of the dp ranks (trainer/moe.py)
    ep_group: Group | None = None  # dp ranks exchanging tokens: edp * ep .. edp * ep + ep - 1
    edp_group: Group | None = None  # expert data parallel: the dp ranks holding the same experts

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.pp)

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
        return dp * self.pp * self.tp + pp * self.tp + tp

    def describe(self) -> str:
        return f"rank {self.rank} (dp {self.dp_rank}, pp {self.pp_rank}, tp {self.tp_rank})"

    def new_groups(self, rank_sets: Iterable[Iterable[int]]) -> dict[frozenset, Group]:
        """Create a group for each set of global ranks; EVERY process must call this with the same
        sets in the same order. Returns the groups this process belongs to, keyed by rank set
        (and keeps them in `extra`)."""
        created = self._make_groups(rank_sets)
        self.extra.update(created)
        return created

    def _make_groups(self, rank_sets: Iterable[Iterable[int]]) -> dict[frozenset, Group]:
        created: dict[frozenset, Group] = {}
        for ranks in sorted({tuple(sorted(r)) for r in rank_sets}):
            key = frozenset(ranks)
            if len(ranks) == 1:
                if self.rank in ranks:
                    created[key] = _solo(self.rank)
                continue
            pg = dist.new_group(list(ranks), timeout=self.timeout)
            if self.rank in ranks:
                created[key] = Group(list(ranks), list(ranks).index(self.rank), pg)
        return created

    # ---- whole-job helpers (default group) -------------------------------------------------------
    def barrier(self) -> None:
        if self.world > 1:
            with COMM.timed():
                dist.barrier()

    @property
    def job(self) -> Job:
        """The whole job as shardkit's whole-job helpers see it."""
        return Job(self.rank, self.world)

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
        agree(self.job, error)
        return result  # type: ignore[return-value]

    def sum_over_world(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.world > 1:
            with COMM.timed():
                dist.all_reduce(t)
        return t.tolist()


# ---- failing together ------------------------------------------------------------------------------


def agree(job: Job, error: BaseException | None) -> None:
    """Every rank calls this with its own error (or None). If any rank failed, every rank raises
    `JobFailed` with the first failing rank's one-line message and exit code, and only after a
    barrier: by then every rank has decided its exit code (`decide_exit`), so whichever rank
    torchrun reaches first, all exit with the same code. A one-process run re-raises `error`."""
    mine = None if error is None else (exit_code(error), one_line(error))
    if mine is not None:
        decide_exit(mine[0])
    if job.world == 1:
        if error is not None:
            raise error
        return
    reports = job.gather(mine)
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if not failed:
        return
    rank, (code, message) = failed[0]
    decide_exit(code)
    dist.barrier()
    raise JobFailed(message, rank, code, job.world) from error


# ---- environment ---------------------------------------------------------------------------------


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) for a plain run."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    return rank, world, local


def _xla_available() -> bool:
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def choose_device(requested: str | None, local_rank: int) -> torch.device:
    """xla when torch-xla is installed, else cuda when available, else cpu; `requested` forces."""
    kind = requested or ("xla" if _xla_available() else "cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise TrainerError("--device cuda: no CUDA device is available; use --device cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    if kind == "xla":
        if not _xla_available():
            raise TrainerError("--device xla needs torch-xla (pip install torch-xla / the Neuron SDK)")
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


def _backend(device: torch.device | None) -> str:
    return BACKENDS.get(device.type, "gloo") if device is not None else "gloo"


def join(device: torch.device | None, timeout_s: float) -> Job:
    """Join (or create) the job's default process group; no group for one process. Without a
    device (choosing it failed) the group is gloo's, just to agree on the failure."""
    rank, world, _ = world_from_env()
    if world > 1 and not dist.is_initialized():
        backend = _backend(device)
        kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s if timeout_s > 0 else 600.0)}
        if backend == "xla":
            kwargs["init_method"] = "xla://"
        dist.init_process_group(backend, **kwargs)
    if dist.is_initialized():
        return Job(dist.get_rank(), dist.get_world_size())
    return Job(rank, world)


def init_parallel(tp: int, pp: int, dp: int, device: torch.device, timeout_s: float, ep: int = 1) -> Parallel:
    """Join (or create) the job's process group and build the tp/pp/dp groups (and, with ep > 1, the
    expert-parallel and expert-data-parallel groups inside dp)."""
    backend = _backend(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    job = join(device, timeout_s)
    rank, world = job.rank, job.world
    solo = _solo(rank)
    par = Parallel(tp, pp, dp, rank, world, device, backend, timeout, solo, solo, solo, solo, ep=ep)
    par.ep_group, par.edp_group = solo, solo
    if world == 1:
        return par

    def index(d: int, p: int, t: int) -> int:
        return par.global_rank(d, p, t)

    tp_sets = [[index(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)]
    pp_sets = [[index(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)]
    dp_sets = [[index(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    mp_sets = [[index(d, p, t) for p in range(pp) for t in range(tp)] for d in range(dp)]
    for attr, sets in (("tp_group", tp_sets), ("pp_group", pp_sets), ("dp_group", dp_sets), ("mp_group", mp_sets)):
        mine = next(frozenset(s) for s in sets if rank in s)
        setattr(par, attr, par._make_groups(sets)[mine])
    par.edp_group = par.dp_group
    if ep > 1:  # dp rank d is ep rank d % ep of expert-data-parallel rank d // ep
        groups = dp // ep
        ep_sets = [
            [index(e * ep + j, p, t) for j in range(ep)] for e in range(groups) for p in range(pp) for t in range(tp)
        ]
        edp_sets = [
            [index(e * ep + j, p, t) for e in range(groups)] for j in range(ep) for p in range(pp) for t in range(tp)
        ]
        for attr, sets in (("ep_group", ep_sets), ("edp_group", edp_sets)):
            mine = next(frozenset(s) for s in sets if rank in s)
            setattr(par, attr, par._make_groups(sets)[mine])
    log.debug("%s of %d (%s backend, device %s)", par.describe(), world, backend, device)
    return par


def shutdown() -> None:
    """Leave the process group (after a barrier, so no peer is still talking to us)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
