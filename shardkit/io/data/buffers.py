"""Memory for reads: a thread's pool of reused buffers (`reused_buffers`).

Fresh memory costs a page fault and the zeroing of every page on its first touch, about as much
CPU as the read's copy into it; a few buffers kept per thread avoid that.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    import numpy


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch runs on one intra-op thread inside the block. shardkit's tensor work is plain copies
    of a few MiB: waking torch's OpenMP threads costs more than they save, and between copies they
    spin, taking CPU from the reads, writes and transfers running beside them (a fifth of a
    `ckpt reshard`'s CPU time, measured with perf)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def array_view(array: numpy.ndarray) -> memoryview:
    """A memoryview of a numpy array's memory (arrays are buffers; numpy's stubs do not say so
    before Python 3.12)."""
    return memoryview(cast(Any, array))


class _Buffers(threading.local):
    """This thread's pool of read buffers (see `reused_buffers`)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pool: list[bytearray] = []


_BUFFERS = _Buffers()
POOLED_BUFFERS = 4
"""Read buffers kept per thread inside `reused_buffers`."""
POOLED_MIN = 1 << 20
"""Smaller reads always get fresh memory (the allocator reuses small blocks by itself)."""
POOLED_BYTES = 64 << 20
"""At most this many bytes of buffers kept per thread (larger reads get fresh memory): the pool
never holds more than the reads of one or two tensors would anyway."""


@contextlib.contextmanager
def _thread_scope(state: Any, release: Callable[[], None]) -> Iterator[None]:
    """A block that may nest in one thread (`state.depth` counts them); `release()` once the
    outermost one ends."""
    state.depth += 1
    try:
        yield
    finally:
        state.depth -= 1
        if state.depth == 0:
            release()


@contextlib.contextmanager
def reused_buffers() -> Iterator[None]:
    """In this thread, until the block ends, reads take their memory from a few buffers kept for
    reuse instead of fresh memory: fresh memory costs a page fault and the zeroing of every page
    on its first touch (about as much CPU as the read's copy itself). A buffer is handed out again
    only once no tensor, view or memoryview of its previous use is alive (Python counts the
    references `torch.frombuffer` tensors hold), so a tensor kept by its caller is never
    overwritten: the pool then simply allocates. At most POOLED_BUFFERS buffers are kept per
    thread; they are released when the outermost block ends."""
    with _thread_scope(_BUFFERS, _BUFFERS.pool.clear):
        yield


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of nbytes: from this thread's pool inside `reused_buffers`."""
    pool = _BUFFERS.pool
    if _BUFFERS.depth == 0 or nbytes < POOLED_MIN or nbytes > POOLED_BYTES // 2:
        return torch.empty(nbytes, dtype=torch.uint8)
    best = spare = None
    for i in range(len(pool)):
        if sys.getrefcount(pool[i]) > 2:  # the list's reference and getrefcount's own: else in use
            continue
        size = len(pool[i])
        if size >= nbytes and (best is None or size < len(pool[best])):
            best = i
        elif size < nbytes and (spare is None or size < len(pool[spare])):
            spare = i
    if best is None:
        kept = sum(len(b) for b in pool)
        if len(pool) < POOLED_BUFFERS and kept + nbytes <= POOLED_BYTES:
            pool.append(bytearray(nbytes))
            best = len(pool) - 1
        elif spare is not None and kept - len(pool[spare]) + nbytes <= POOLED_BYTES:
            pool[spare] = bytearray(nbytes)  # the smallest free buffer makes way for a larger one
            best = spare
        else:
            return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(pool[best], dtype=torch.uint8, count=nbytes)


def empty_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype) (contiguous), from this thread's pool inside `reused_buffers`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if _BUFFERS.depth == 0 or nbytes < POOLED_MIN:
        return torch.empty(shape, dtype=dtype)
    return empty_bytes(nbytes).view(dtype).reshape(shape)
