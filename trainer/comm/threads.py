"""Several ranks in one process, one thread per device: how torch-xla runs multi-device on CPU.

torch-xla 2.9 on CPU (`PJRT_DEVICE=CPU`) has no collectives between processes (under torchrun
every process sees a world of one); `CPU_NUM_DEVICES=N` gives one process N devices whose
collectives XLA runs in process, and `xmp.spawn` runs one thread per device. The trainer does the
same (`run_in_threads`): every rank is a thread with its own default device, and the host side of
the job (agreeing on failures, small objects, checkpoint coordination) meets through a
`Rendezvous` in memory instead of a gloo group.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from shardkit.distributed import Job

T = TypeVar("T")


class JobAborted(RuntimeError):
    """Another rank of the job failed outside a point where the ranks agree on failures."""


class Rendezvous:
    """`size` threads meet: each hands in a value and gets everyone's, in rank order. `abort()` fails
    every waiting and future meeting (a rank died: nobody waits for it)."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size, self.timeout = size, timeout
        self._cond = threading.Condition()
        self._values: dict[int, Any] = {}
        self._generation = 0
        self._last: list[Any] = []
        self._error: BaseException | None = None

    def exchange(self, rank: int, value: Any) -> list[Any]:
        with self._cond:
            self._raise_if_aborted()
            generation = self._generation
            self._values[rank] = value
            if len(self._values) == self.size:
                self._last = [self._values[r] for r in range(self.size)]
                self._values = {}
                self._generation += 1
                self._cond.notify_all()
                return self._last
            if not self._cond.wait_for(lambda: self._generation != generation or self._error, self.timeout):
                self._error = TimeoutError(
                    f"ranks {sorted(set(range(self.size)) - set(self._values))} did not "
                    f"arrive within {self.timeout:g} s"
                )
                self._cond.notify_all()
            self._raise_if_aborted()
            return self._last

    def abort(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    def _raise_if_aborted(self) -> None:
        if self._error is not None:
            raise JobAborted(f"the job stopped: {self._error}") from None


@dataclass
class ThreadJob(Job):
    """shardkit's `Job` (gather, broadcast, agree) over a `Rendezvous` of threads."""

    meeting: Rendezvous | None = field(default=None, repr=False)

    def gather(self, value: Any) -> list[Any]:
        if self.world == 1 or self.meeting is None:
            return [value]
        return self.meeting.exchange(self.rank, value)

    def broadcast(self, value: Any) -> Any:
        return self.gather(value)[0]

    def barrier(self) -> None:
        self.gather(None)


class ThreadWorld:
    """What the rank threads of one job share: the main rendezvous and the ones made later (a
    Checkpointer's, an export's), the k-th made by every rank being the same object."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size, self.timeout = size, timeout
        self.main = Rendezvous(size, timeout)
        self._made: list[Rendezvous] = []
        self._lock = threading.Lock()

    def rendezvous(self, index: int) -> Rendezvous:
        with self._lock:
            while len(self._made) <= index:
                self._made.append(Rendezvous(self.size, self.timeout))
            return self._made[index]

    def abort(self, error: BaseException) -> None:
        with self._lock:
            meetings = [self.main, *self._made]
        for meeting in meetings:
            meeting.abort(error)


@dataclass
class RankThread:
    """This thread's rank in a job run by `run_in_threads`."""

    rank: int
    world: ThreadWorld
    made: int = 0  # rendezvous this rank has made (see ThreadWorld.rendezvous)

    def new_job(self) -> ThreadJob:
        """A job over a rendezvous of its own (the k-th call on every rank meets the same one)."""
        meeting = self.world.rendezvous(self.made)
        self.made += 1
        return ThreadJob(self.rank, self.world.size, None, meeting)


_local = threading.local()


def current() -> RankThread | None:
    """The rank of this thread when it runs in `run_in_threads`, else None."""
    return getattr(_local, "rank", None)


class _LeaderOnly(logging.Filter):
    """In a threaded job, info from ranks other than 0 is dropped (as a process job logs it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        me = current()
        return me is None or me.rank == 0 or record.levelno >= logging.WARNING


def run_in_threads(
    devices: list[Any], run: Callable[[], T], timeout: float, on_thread: Callable[[Any], None]
) -> list[tuple[T | None, BaseException | None]]:
    """`run()` as every rank of a job, one thread per device (`on_thread(device)` first makes the
    device the thread's own); returns each rank's (result, error). A rank that fails aborts the
    job's rendezvous, so no other rank waits for it."""
    world = ThreadWorld(len(devices), timeout)
    results: list[tuple[T | None, BaseException | None]] = [(None, None)] * len(devices)
    quiet = _LeaderOnly()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(quiet)

    def body(rank: int, device: Any) -> None:
        _local.rank = RankThread(rank, world)
        try:
            on_thread(device)
            results[rank] = (run(), None)
        except BaseException as e:  # noqa: BLE001 - reported to the caller with every rank's outcome
            results[rank] = (None, e)
            if not isinstance(e, JobAborted):
                world.abort(e)

    threads = [
        threading.Thread(
            target=contextvars.copy_context().run,  # each rank sees the caller's context (its mirror scope)
            args=(body, r, d),
            name=f"trainer-rank-{r}",
            daemon=True,
        )
        for r, d in enumerate(devices)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except BaseException as e:
        world.abort(e)
        raise
    finally:
        for handler in handlers:
            handler.removeFilter(quiet)
    return results
