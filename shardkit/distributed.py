"""Dividing one convert/merge/reshard among the processes of a torch.distributed job.

Under `torchrun` (or inside a job that already initialised torch.distributed), every process
plans the same output files and writes every `world`-th one; rank 0 checks the destination,
creates the shared staging folder, collects the file records, writes the manifest last and
renames the folder into place. A failure on any rank fails every rank and leaves nothing behind.
Without a distributed environment this is a one-process job and costs nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass
class Job:
    """This process's place in the job: rank and world size (1 for a plain run)."""

    rank: int = 0
    world: int = 1
    group: Any = None
    """The process group of the collectives (None: the default group)."""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, items: list[T]) -> list[T]:
        """This rank's items (every world-th, starting at its rank)."""
        return items[self.rank :: self.world]

    def broadcast(self, value: Any) -> Any:
        """rank 0's value, on every rank."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group
        )
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value, in rank order (on every rank)."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    def agree(
        self, step: Callable[[], T], elsewhere: Callable[[str], BaseException] | None = None, share: bool = True
    ) -> list[T]:
        """Run `step` on every rank; every rank's result (in rank order; only this rank's, the others
        None, when not `share`), or, if it failed anywhere, an error on every rank: the local one,
        else `elsewhere(first message)`."""
        error: BaseException | None = None
        result = None
        try:
            result = step()
        except BaseException as e:  # noqa: BLE001 - re-raised below, on every rank
            error = e
        answers = self.gather((None if error is None else f"rank {self.rank}: {error}", result if share else None))
        if not share:
            answers[self.rank] = (answers[self.rank][0], result)
        if error is not None:
            raise error
        failed = [m for m, _ in answers if m]
        if failed:
            if elsewhere is not None:
                raise elsewhere(failed[0])
            from .errors import ShardkitError

            raise ShardkitError(f"another process of the job failed ({failed[0]})")
        return [v for _, v in answers]

    def run_all_or_none(self, step: Callable[[], T]) -> T:
        """Run `step` on every rank; if it fails anywhere, raise on every rank (the first error)."""
        return self.agree(step, share=False)[self.rank]


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


_ALONE = threading.local()


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """While the block runs, in this thread, `current_job()` is a one-process job even inside a
    torch.distributed job: one process writes an output by itself (an upload to object storage,
    whose local staging only this host has), the others not taking part."""
    before = getattr(_ALONE, "on", False)
    _ALONE.on = True
    try:
        yield
    finally:
        _ALONE.on = before


def current_job() -> Job:
    """The job of this process: from an initialised process group, or torchrun's environment
    (the gloo group is then created here), or a single process (also inside `alone`)."""
    if getattr(_ALONE, "on", False):
        return Job()
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch always has it, but stay importable
        return Job()
    if dist.is_available() and dist.is_initialized():
        return Job(dist.get_rank(), dist.get_world_size())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "MASTER_ADDR" in os.environ:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
        # we own this group: tear it down before exit, or gloo's threads abort the process
        atexit.register(_destroy_group)
        log.info("joined a job of %d processes as rank %d", dist.get_world_size(), dist.get_rank())
        return Job(dist.get_rank(), dist.get_world_size())
    return Job()
