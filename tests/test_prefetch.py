"""The cold-cache read-ahead: what it reads, in which order, how far ahead, and that workers
never wait on a read-ahead that failed."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardkit import Layout, convert, merge
from shardkit.engine import executor, prefetch
from shardkit.engine.prefetch import Prefetcher

MiB = 1 << 20


def _until(condition, what: str) -> None:
    """Poll a condition the read-ahead thread reaches by itself (a hang fails, never a timing)."""
    deadline = time.monotonic() + 30
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"the read-ahead never {what}")
        time.sleep(0.001)


def test_read_ahead_stays_a_window_ahead_of_the_workers(tmp_path, monkeypatch):
    """The thread reads the spans in plan order, pauses once `window` bytes beyond what the
    workers asked for, and goes on as they ask for more; wait() returns once the spans are read."""
    monkeypatch.setattr(prefetch, "READ_CHUNK", 256 << 10)
    path = tmp_path / "src.bin"
    path.write_bytes(os.urandom(12 * MiB))
    order = [5, 0, 7, 1, 11, 2, 3]  # spans of 1 MiB, not in file order
    spans = [(path, i * MiB, MiB) for i in order]
    reads: list[tuple[int, int]] = []
    real_sendfile = os.sendfile

    def recording_sendfile(out_fd, in_fd, offset, count):
        reads.append((offset, count))
        return real_sendfile(out_fd, in_fd, offset, count)

    monkeypatch.setattr(prefetch.os, "sendfile", recording_sendfile)
    ahead = Prefetcher(spans, window=2 * MiB).start()
    try:
        _until(lambda: ahead.paused, "paused at its window")
        assert ahead.position == 2 * MiB  # nothing asked for yet: one window
        ahead.wait(3)
        _until(lambda: ahead.paused and ahead.position == 5 * MiB, "paused a window past span 3")
        ahead.wait(len(spans))
        assert ahead.position == len(spans) * MiB
    finally:
        ahead.stop()
    covered = [offset // MiB for offset, _ in reads if offset % MiB == 0]
    assert covered == order  # each span once, in plan order
    assert sum(count for _, count in reads) == len(spans) * MiB


def test_pieces_of_files_read_in_turn_are_read_ahead_in_long_runs(tmp_path, monkeypatch):
    """A merge needs a small piece of each file in turn. The read-ahead reads each file's
    consecutive pieces (zip headers between them included) in one run of up to EXTENT bytes,
    instead of seeking between files for every piece; wait(n) still covers the first n pieces."""
    monkeypatch.setattr(prefetch, "EXTENT", 4 * MiB)
    files = [tmp_path / f"rank{r}.pt" for r in range(3)]
    for f in files:
        f.write_bytes(os.urandom(9 * MiB))
    piece = MiB - 128  # a piece, then 128 bytes of the next record's header
    spans = [(f, i * MiB, piece) for i in range(8) for f in files]
    extents, covered = prefetch.coalesce(spans)
    # each file in runs of 4 pieces (the EXTENT), header bytes between pieces included
    assert extents == [(f, start * MiB, 3 * MiB + piece) for start in (0, 4) for f in files]
    assert covered[:4] == [1, 2, 3, 3] and covered[-1] == 6
    reads: list[tuple[str, int, int]] = []
    real_sendfile = os.sendfile
    names = {}

    def recording_sendfile(out_fd, in_fd, offset, count):
        reads.append((names.setdefault(os.readlink(f"/proc/self/fd/{in_fd}"), len(names)), offset, count))
        return real_sendfile(out_fd, in_fd, offset, count)

    monkeypatch.setattr(prefetch.os, "sendfile", recording_sendfile)
    ahead = Prefetcher(spans, window=64 * MiB).start()
    try:
        ahead.wait(len(spans))
        assert ahead.position == sum(length for _, _, length in extents)
    finally:
        ahead.stop()
    assert [(offset, count) for _, offset, count in reads] == [(s, n) for _, s, n in extents]  # one call each
    # a span that does not continue its file's last run, or would make it too long, starts a new one
    assert len(prefetch.coalesce([(files[0], 0, MiB), (files[0], 3 * MiB, MiB)])[0]) == 2
    assert len(prefetch.coalesce([(files[0], 0, 5 * MiB), (files[0], 5 * MiB, MiB)])[0]) == 2


def test_waits_end_when_the_read_ahead_fails(tmp_path):
    """A source the read-ahead cannot open ends it: workers stop waiting (and meet the error
    themselves when they read)."""
    ahead = Prefetcher([(tmp_path / "missing.bin", 0, MiB)], window=MiB).start()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (ahead.wait(1), done.set()), daemon=True)
    waiter.start()
    waiter.join(30)
    ahead.stop()
    assert done.is_set()


def test_a_source_swapped_for_a_fifo_ends_the_read_ahead_without_blocking(tmp_path):
    """The read-ahead opens sources again by name: a FIFO put there meanwhile (by a second process)
    is refused at once instead of blocking the open, and so the operation, for ever."""
    fifo = tmp_path / "swapped.bin"
    os.mkfifo(fifo)
    ahead = Prefetcher([(fifo, 0, MiB)], window=MiB).start()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (ahead.wait(1), done.set()), daemon=True)
    waiter.start()
    waiter.join(30)
    stopper = threading.Thread(target=ahead.stop, daemon=True)
    stopper.start()
    stopper.join(30)
    if stopper.is_alive():  # release a blocked open so the test process can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert done.is_set() and not stopper.is_alive()


def test_convert_reads_ahead_each_source_byte_once_and_in_order(tiny_model, tmp_path, monkeypatch):
    """convert plans every byte of the sources' tensors exactly once (rows of row-split tensors
    as blocks, column-split tensors whole), the output is that of a convert without read-ahead;
    merge reads its shards ahead the same way, with or without the hash check (which hashes the
    bytes the workers read)."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    plans: list[list[tuple[Path, int, int]]] = []
    real = executor.Prefetcher

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, spans, window=None):
            plans.append(list(spans))
            super().__init__(spans, window)

    monkeypatch.setattr(executor, "Prefetcher", Recording)
    layout = Layout(tp=2, pp=2)
    convert(src, tmp_path / "ahead", layout, format="torch", workers=1)
    merge(tmp_path / "ahead", tmp_path / "checked", workers=1)
    merge(tmp_path / "ahead", tmp_path / "merged", workers=1, verify_hashes=False)
    assert len(plans) == 3
    convert_plan, merge_plan, unchecked_plan = plans
    assert merge_plan == unchecked_plan
    for plan in plans:
        by_file: dict[Path, list[tuple[int, int]]] = {}
        for path, offset, length in plan:
            by_file.setdefault(path, []).append((offset, offset + length))
        for ranges in by_file.values():
            ranges.sort()
            assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # no byte twice
    tensor_bytes = sum(t.numel() * t.element_size() for f in src.glob("*.safetensors") for t in load_file(f).values())
    assert sum(length for _, _, length in convert_plan) == tensor_bytes
    assert sum(length for _, _, length in merge_plan) == tensor_bytes
    # row blocks are planned apart: more spans than source tensors
    assert len(convert_plan) > sum(len(load_file(f)) for f in src.glob("*.safetensors"))

    monkeypatch.setattr(executor, "plan_read_ahead", lambda outputs, index, spans: (None, {}))
    convert(src, tmp_path / "plain", layout, format="torch", workers=1)
    shards = sorted((tmp_path / "plain").rglob("*.pt"))
    assert shards
    for shard in shards:
        assert shard.read_bytes() == (tmp_path / "ahead" / shard.relative_to(tmp_path / "plain")).read_bytes()
