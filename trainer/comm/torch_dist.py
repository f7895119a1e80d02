"""The communication interface on torch.distributed: gloo on CPU, nccl on CUDA (eager).

Every group is created with the job's timeout: a collective that a peer never joins fails after
`timeout` seconds instead of hanging the job.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from shardkit.distributed import Job

from .base import Comm, Group

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch >= 2.10 names them *_single; 2.9 (the floor) has only the older names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchGroup(Group):
    """A torch.distributed process group."""

    def __init__(self, ranks: list[int], rank: int, pg: Any) -> None:
        super().__init__(ranks, rank)
        self.pg = pg

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        dist.all_reduce(tensor, op=_OPS[op], group=self.pg)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.new_empty((tensor.shape[0] * self.size, *tensor.shape[1:]))
        _ALL_GATHER(out, tensor, group=self.pg)
        return out

    def _reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.new_empty((tensor.shape[0] // self.size, *tensor.shape[1:]))
        _REDUCE_SCATTER(out, tensor, group=self.pg)
        return out

    def all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
        if self.size == 1:
            return out.copy_(tensor)
        from ..clocks import COMM

        with COMM.timed():
            dist.all_to_all_single(out, tensor.contiguous(), recv, send, group=self.pg)
        return out


class TorchComm(Comm):
    """gloo (CPU) or nccl (CUDA) through torch.distributed; one rank per process."""

    def __init__(self, rank: int, world: int, device: torch.device, timeout: datetime.timedelta) -> None:
        super().__init__(rank, world, device)
        self.name = "nccl" if device.type == "cuda" else "gloo"
        self.timeout = timeout

    @property
    def job(self) -> Job:
        return Job(self.rank, self.world)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _make_groups(self, sets: list[list[int]]) -> dict[frozenset, Group]:
        made: dict[frozenset, Group] = {}
        for ranks in sets:
            if len(ranks) == 1:
                continue
            pg = dist.new_group(ranks, timeout=self.timeout)
            if self.rank in ranks:
                made[frozenset(ranks)] = TorchGroup(ranks, ranks.index(self.rank), pg)
        return made

    def shutdown(self) -> None:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def join_torch(device: torch.device | None, rank: int, world: int, timeout_s: float) -> TorchComm:
    """Join (or create) the job's default process group (none for one process). Without a device
    (choosing it failed) the group is gloo's, just to agree on the failure."""
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s > 0 else 600.0)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timeout)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return TorchComm(rank, world, device or torch.device("cpu"), timeout)
