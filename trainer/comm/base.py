"""The trainer's one communication interface: a `Comm` per rank and the `Group`s it makes.

Model, optimizer and pipeline code talk to each other only through `Group` (collectives over a
set of ranks: all-reduce, all-gather, reduce-scatter, a two-rank exchange) and `Comm` (the rank's
device, its groups, the host-side job for agreeing on failures and small objects, the graph cut,
moving tensors to the host, activation checkpointing). Two implementations sit beside this file:

- `torch_dist.py`: torch.distributed process groups (gloo on CPU, nccl on CUDA), eager;
- `xla.py`: torch-xla collectives with replica groups in NxD's rank order, lazy: work is traced
  and runs when the rank cuts the graph (`Comm.cut`).

A one-rank run uses the implementation of its device with no groups: every collective on a
group of size 1 is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from shardkit.distributed import Job

from ..clocks import COMM

REDUCE_OPS = ("sum", "max")


class Group:
    """A set of ranks (global ranks in group order) that run collectives together; `rank` is this
    rank's index in `ranks`. Subclasses implement the `_` methods for groups of two or more."""

    def __init__(self, ranks: Sequence[int], rank: int) -> None:
        self.ranks = list(ranks)
        self.rank = rank

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ranks={self.ranks}, rank={self.rank})"

    def per_rank(self, value: int, like: torch.Tensor) -> Any:
        """`value`, a number that differs from rank to rank, as the rank's graph should see it (a
        backend whose ranks share compiled graphs makes it data; like `like`'s dtype and device)."""
        return value

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` over the group in place ("sum" or "max"); returns it."""
        if self.size > 1:
            with COMM.timed():
                self._all_reduce(tensor, op)
        return tensor

    def all_reduce_many(self, tensors: list[torch.Tensor]) -> None:
        """Sum each of `tensors` over the group in place, as one collective (a bucket of gradients).
        Here flattened into one buffer (the bucket's size in extra memory) and back."""
        if self.size == 1 or not tensors:
            return
        with COMM.timed():
            self._all_reduce_many(tensors)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every member's `tensor` concatenated along dim 0, in group order."""
        if self.size == 1:
            return tensor.clone()
        with COMM.timed():
            return self._all_gather(tensor.contiguous())

    def reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every member's `tensor`, of which this member keeps its chunk along dim 0."""
        if tensor.shape[0] % self.size:
            raise ValueError(f"dim 0 of {tuple(tensor.shape)} does not split over {self.size} ranks")
        if self.size == 1:
            return tensor.clone()
        with COMM.timed():
            return self._reduce_scatter(tensor.contiguous())

    def exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """A two-rank group: give `tensor` to the other member and return the other's (the same
        shape and dtype) -- one all-gather, the way NxD's pipeline moves activations and
        gradients between neighbouring stages."""
        if self.size != 2:
            raise ValueError(f"exchange needs a group of two ranks, not {self.size}")
        both = self.all_gather(tensor.unsqueeze(0))
        return both[1 - self.rank]

    def all_to_all(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of `tensor` (`send[j]` of them for member j, in order) to the members; returns the
        rows received (`recv[j]` from member j). Sizes known on the host: eager backends only."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all with host-side sizes")

    # ---- implementations (groups of two or more) -------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        raise NotImplementedError

    def _all_reduce_many(self, tensors: list[torch.Tensor]) -> None:
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        flat = _flatten_dense_tensors(tensors)
        self._all_reduce(flat, "sum")
        for t, synced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
            t.copy_(synced)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Comm:
    """One rank's communication: its place in the job, its device, the groups it makes and the
    host side (agreeing on failures, small objects).

    `lazy`: device work is traced, and runs when the rank calls `cut()` (XLA); code that would read
    a value on the host in the middle of a step keeps it on the device instead."""

    name = "none"
    lazy = False
    accumulate_dtype = torch.float64  # scalar sums of a step (losses): on XLA fp32 (Neuron has no fp64)
    keeps_order = False  # groups as given: a rank's place in its set is its rank in the group (XLA's lists)

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device

    @property
    def job(self) -> Job:
        """The whole job on the host, as shardkit's whole-job helpers see it (gather, broadcast)."""
        return Job(self.rank, self.world)

    def barrier(self) -> None:
        """Wait until every rank of the job is here."""

    def new_groups(self, rank_sets: Iterable[Sequence[int]]) -> dict[frozenset, Group]:
        """A group for each set of global ranks; EVERY rank calls this with the same sets in the same
        order. Returns the groups this rank belongs to, keyed by rank set (size-1 sets included).
        Sorted, each set sorted (torch.distributed numbers a group's ranks so), unless the backend
        `keeps_order`: then in the order given, the first of equal sets."""
        if self.keeps_order:
            firsts: dict[frozenset, tuple[int, ...]] = {}
            for s in rank_sets:
                firsts.setdefault(frozenset(s), tuple(s))
            sets = list(firsts.values())
        else:
            sets = sorted({tuple(sorted(s)) for s in rank_sets})
        made = self._make_groups([list(s) for s in sets])
        for ranks in sets:
            if len(ranks) == 1 and ranks[0] == self.rank:
                made[frozenset(ranks)] = Group(ranks, 0)
        return made

    def _make_groups(self, sets: list[list[int]]) -> dict[frozenset, Group]:
        raise NotImplementedError

    def cut(self) -> None:
        """End the graph traced so far and run it (lazy backends); a no-op on eager ones."""

    def isolate(self) -> None:
        """A cut where a backend needs its collectives in graphs of their own: torch-xla's CPU
        runtime stops the process when a device waits 10 s in a collective, so a graph with
        collectives must not follow a long compile of another rank (comm/xla.py); else a no-op."""

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """`tensors` on the host (CPU); a lazy backend moves them in one transfer."""
        return [t.cpu() for t in tensors]

    @property
    def overlaps_steps(self) -> bool:
        """`cut` returns while the device still runs the graph: the host may trace the next step
        before it reads this one's results."""
        return False

    def to_device(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors as this rank's device tensors; on a lazy backend as data of the device, never
        as something a later graph computes (so set-up traces no graph)."""
        return [t.to(self.device) for t in tensors]

    def compiles(self) -> int | None:
        """Graphs compiled so far by this process (a lazy backend; None on eager ones)."""
        return None

    def checkpoint(self, function: Callable[..., Any], *args: Any) -> Any:
        """Activation checkpointing: run `function(*args)`, keeping only its inputs for backward."""
        from torch.utils.checkpoint import checkpoint

        return checkpoint(function, *args, use_reentrant=False)

    @property
    def shares_process(self) -> bool:
        """The job's ranks are threads of this one process (whole-job helpers that go by the
        process, like shardkit's merge, then run on rank 0 alone)."""
        return False

    def checkpointer_job(self) -> Job | None:
        """The host job a shardkit Checkpointer of this rank synchronises with; None: the
        Checkpointer makes its own (a gloo group under torch.distributed)."""
        return None

    def checkpointer(self, config: Any) -> Any:
        """A shardkit Checkpointer for this rank (every rank makes one at the same point)."""
        from shardkit.checkpoint import Checkpointer

        job = self.checkpointer_job()
        if job is None:
            return Checkpointer(config)
        checkpointer = Checkpointer(config, group=None)
        checkpointer.comm = job  # its collectives over this job's host side, not torch.distributed
        return checkpointer

    def shutdown(self) -> None:
        """Leave the job (after every rank is done)."""
