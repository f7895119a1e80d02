"""Async saving: copy the state to host memory, then write it in one background thread.

The training loop is blocked only while its tensors are copied (`HostStaging.copy`): the trainer
may change them as soon as `save` returns. The copies are kept for the next save (same names,
shapes and dtypes: no allocation and no page faults the second time), which costs one host copy
of the saved state between saves; `CheckpointerConfig(reuse_buffers=False)` frees them instead.

`BackgroundWriter` runs one task at a time: at most one save is in flight, and the next save,
`wait()`, `close()` or interpreter exit waits for it. A failed write is re-raised by the next of
those calls (and logged at once), never dropped. Retention runs in the same thread after the
`done` marker; its failures are logged, never raised: a checkpoint that could not be deleted is
retried at the next save.

Collectives. With torch.distributed initialised, the background thread synchronises the ranks of
a save on a dedicated gloo group created with the Checkpointer (`dist.new_group(backend="gloo")`,
a collective every rank must reach at the same point): collectives on the default group from a
second thread could interleave with the trainer's own collectives and deadlock or corrupt them.
Destroy the default process group only after `wait()`/`finalize_checkpoint()`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..errors import ShardkitError
from .base import CheckpointWriteError

log = logging.getLogger(__name__)


class HostStaging:
    """Host (CPU) copies of tensors, reused between saves when names, shapes and dtypes repeat."""

    def __init__(self, reuse: bool = True):
        self.reuse = reuse
        self._buffers: dict[Any, torch.Tensor] = {}
        self._next: dict[Any, torch.Tensor] = {}

    def begin(self) -> None:
        self._next = {}

    def copy(self, key: Any, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        buf.copy_(tensor)
        self._next[key] = buf
        return buf

    def end(self) -> None:
        self._buffers = self._next if self.reuse else {}
        self._next = {}

    def clear(self) -> None:
        self._buffers, self._next = {}, {}


def host_copy(obj: Any) -> Any:
    """A deep copy of plain data with every tensor copied to host memory."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


class BackgroundWriter:
    """One background thread; at most one save in flight; errors re-raised by the next call."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._save: Future | None = None
        self._save_what = ""
        self._purge: Future | None = None

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardkit-ckpt")
        return self._executor

    @property
    def busy(self) -> bool:
        return any(f is not None and not f.done() for f in (self._save, self._purge))

    def submit_save(self, what: str, task: Callable[[], Any]) -> None:
        """Run a save in the background (call `wait` first: one save at a time)."""
        assert self._save is None, "wait() before submitting the next save"

        def run() -> Any:
            try:
                return task()
            except ShardkitError as e:  # bad input or a full disk: one line (the traceback only at debug level)
                log.error("async save of %s failed (%s); the error is raised at the next save/wait", what, e)
                log.debug("async save of %s failed", what, exc_info=True)
                raise
            except BaseException:
                log.exception("async save of %s failed; the error is raised at the next save/wait", what)
                raise

        self._save_what = what
        self._save = self._pool().submit(run)

    def submit_purge(self, task: Callable[[], Any]) -> None:
        """Retention in the background; failures are logged, never raised."""

        def run() -> None:
            try:
                task()
            except Exception:  # noqa: BLE001 - retention must never fail training
                log.exception("checkpoint retention failed (retried at the next save)")

        self._purge = self._pool().submit(run)

    def wait(self) -> None:
        """Wait for the save and retention in flight; raise the save's error, once."""
        save, self._save = self._save, None
        purge, self._purge = self._purge, None
        if purge is not None:
            purge.result()
        if save is not None:
            try:
                save.result()
            except CheckpointWriteError:
                raise
            except Exception as e:  # noqa: BLE001 - re-raised with what failed
                raise CheckpointWriteError(f"the async save of {self._save_what} failed: {e}") from e

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
