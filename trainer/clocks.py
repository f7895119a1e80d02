"""Clocks of kinds of work (compute, communication, MoE dispatch), per rank.

Each clock keeps its state per thread: on XLA's CPU runtime every rank of a job is a thread of one
process (trainer/comm/threads.py), and each rank times its own work. A process holds one rank per
thread, so for gloo and nccl (one rank per process) this is one state per process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class Clock:
    """Accumulated wall time of a kind of work; nested regions count once. A clock with `exclude`
    does not count the time the excluded clock accumulates inside its regions (compute net of the
    collectives it waits on). On CPU (gloo) collectives are synchronous, so the communication clock
    measures their cost, including waiting for slower peers. On XLA the regions time the tracing
    of the work, not its execution (which runs at the graph cut)."""

    def __init__(self, exclude: Clock | None = None) -> None:
        self.exclude = exclude
        self._local = threading.local()

    def _state(self) -> threading.local:
        state = self._local
        if not hasattr(state, "seconds"):
            state.seconds, state.depth, state.start, state.excluded = 0.0, 0, 0.0, 0.0
        return state

    @property
    def seconds(self) -> float:
        return self._state().seconds

    @contextmanager
    def timed(self) -> Iterator[None]:
        state = self._state()
        if state.depth == 0:
            state.start = time.perf_counter()
            state.excluded = self.exclude.seconds if self.exclude else 0.0
        state.depth += 1
        try:
            yield
        finally:
            state.depth -= 1
            if state.depth == 0:
                inside = (self.exclude.seconds - state.excluded) if self.exclude else 0.0
                state.seconds += time.perf_counter() - state.start - inside

    def take(self) -> float:
        """Seconds since the last take (of this thread's rank)."""
        state = self._state()
        seconds, state.seconds = state.seconds, 0.0
        return seconds


COMM = Clock()
"""Time inside blocking collectives (tp, dp, ZeRO, norm, replica syncs)."""
COMPUTE = Clock(exclude=COMM)
"""Time computing forward, backward and the update (net of collectives inside them)."""
