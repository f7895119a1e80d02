"""The GETs of a mirror (`io.objects.remote`): a pool of daemon threads, the planner that fetches an
engine's plan a bounded window ahead of its readers, and waiting for a set of fetches.

The pool's threads are daemon threads, so a request the store never answers (a hung connection,
retried for minutes by botocore) holds neither the mirror's closing nor the process's exit: a
closed mirror cancels the GETs that have not started, fails the futures of the running ones (so
nothing waits for them: `Abandoned`) and lets those finish into their (already removed) file,
whose descriptor is closed once the last such GET ends (`remote.MirrorFile.close`). A set of fetches gives up at its first failure: the GETs not yet
started are cancelled, so a listing that claims more bytes than an object has fails on its first
GET rather than after every one of thousands (`wait_all`).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

from ...errors import ShardkitError

log = logging.getLogger(__name__)


class Abandoned(ShardkitError):
    """A GET still under way when its mirror was closed (an interrupted run): nothing waits for it."""


class GetPool:
    """`workers` daemon threads running submitted calls (a ThreadPoolExecutor's submit and
    shutdown, without its join of the threads at exit)."""

    def __init__(self, workers: int, name: str):
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._workers, self._name = workers, name
        self._threads: list[threading.Thread] = []
        self._running: set[Future[Any]] = set()
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the mirror is closed")
            self._queue.put((future, fn, args))
            if len(self._threads) < self._workers:
                thread = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running.add(future)
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
                with contextlib.suppress(InvalidStateError):  # (abandoned by `shutdown` meanwhile)
                    future.set_exception(e)
            else:
                with contextlib.suppress(InvalidStateError):
                    future.set_result(result)
            finally:
                with self._lock:
                    self._running.discard(future)
                # an idle thread holds nothing of what it ran: a mirror nobody refers to is collected
                del item, future, fn, args

    def shutdown(self) -> None:
        """Cancel every call not started yet and fail the futures of the running ones (`Abandoned`:
        whoever waits for them stops waiting); those calls finish in their threads, which then end."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
            running = list(self._running)
        for future in running:
            with contextlib.suppress(InvalidStateError):
                future.set_exception(Abandoned("the read was given up: the mirror it fetched for was closed"))
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            self._queue.put(None)


def wait_all(futures: Iterable[Future[Any]]) -> None:
    """Wait for `futures`; at the first failure cancel the ones not started and raise it."""
    pending = list(futures)
    for i, future in enumerate(pending):
        try:
            future.result()
        except BaseException:
            for other in pending[i + 1 :]:
                other.cancel()
            raise


class Fetchable(Protocol):
    """What the planner fetches from: a mirror file."""

    def fetch_async(self, start: int, end: int, feeding: bool = False) -> list[Future[int]]: ...


class Planner:
    """Fetches a plan's (file, offset, length) ranges in order in a thread, at most `window` bytes
    ahead of what readers have asked for (`asked`); ranges of one file at most `hole` apart are
    joined into one fetch of at most `part` bytes."""

    def __init__(self, planned: list[tuple[Any, int, int]], window: int, hole: int, part: int):
        self.planned = planned
        self.window, self.hole, self.part = window, hole, part
        self._asked = 0
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="shardkit-s3-plan", daemon=True)
        self._thread.start()

    def asked(self, n: int) -> None:
        with self._cond:
            self._asked += n
            self._cond.notify_all()

    def _run(self) -> None:
        ahead = 0
        run: list[Any] = []  # [file, start, end]: planned ranges of one file joined into one fetch so far
        try:
            for mf, offset, length in self.planned:
                with self._cond:
                    while not self._stop and ahead > self._asked + self.window:
                        self._cond.wait(0.5)
                    if self._stop:
                        return
                end = offset + length
                if (
                    run
                    and run[0] is mf
                    and run[2] - self.hole <= offset <= run[2] + self.hole
                    and end - run[1] <= self.part
                ):
                    run[1], run[2] = min(run[1], offset), max(run[2], end)
                else:
                    if run:
                        run[0].fetch_async(run[1], run[2])
                    run = [mf, offset, end]
                ahead += length
            if run:
                run[0].fetch_async(run[1], run[2])
        except Exception as e:  # noqa: BLE001 - readers fetch on demand and meet real errors themselves
            log.debug("planned fetches stopped: %s", e)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()


def joined(ranges: Iterable[tuple[int, int]], hole: int) -> list[tuple[int, int]]:
    """`ranges` sorted, those at most `hole` apart joined."""
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and s - out[-1][1] <= hole:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]
