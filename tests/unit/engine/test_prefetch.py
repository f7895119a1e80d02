"""The cold-cache read-ahead: what it reads, in which order, how far ahead, and that workers
never wait on a read-ahead that failed."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardkit import Layout, convert, merge, reshard
from shardkit.engine import executor, planning, prefetch
from shardkit.engine.prefetch import Prefetcher
from shardkit.errors import FormatError
from shardkit.io.data.hashing import HashingFile
from shardkit.io.data.taps import read_exact

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
        def __init__(self, spans, window=None, once=None, store=None):
            plans.append(list(spans))
            super().__init__(spans, window, once, store)

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

    monkeypatch.setattr(planning, "plan_read_ahead", lambda outputs, index, spans, written=0, streamed=False: None)
    convert(src, tmp_path / "plain", layout, format="torch", workers=1)
    shards = sorted((tmp_path / "plain").rglob("*.pt"))
    assert shards
    for shard in shards:
        assert shard.read_bytes() == (tmp_path / "ahead" / shard.relative_to(tmp_path / "plain")).read_bytes()


# ---- bytes read once, read around the page cache into the read-ahead's buffers -------------------


def _direct_or_skip(path: Path) -> None:
    opened = prefetch._open_direct(path)
    if opened is None:
        pytest.skip(f"the file system of {path} refuses O_DIRECT: the read-ahead reads it through the page cache")
    os.close(opened[0])


@pytest.fixture
def cold(monkeypatch):
    """Every extent counts as not cached (the test cannot drop the machine's page cache), and
    buffers are small, so that spans cross them."""
    monkeypatch.setattr(prefetch, "cached_fraction", lambda fd, offset, length: 0.0)
    monkeypatch.setattr(planning, "reads_around_pay", lambda nbytes: True)
    monkeypatch.setattr(prefetch, "DIRECT_CHUNK", 64 << 10)
    monkeypatch.setattr(prefetch, "DIRECT_EXTENT", 256 << 10)


def _serve(ahead: Prefetcher, fd: int, offset: int, length: int) -> tuple[bytes, bool]:
    """Read like a worker's `pread_exact`: from the read-ahead's buffers where it serves the file."""
    view = memoryview(bytearray(length))
    source = ahead.source_for(os.fstat(fd))
    served = source is not None and source(fd, view, offset, "test file")
    if not served:
        read_exact(fd, view, offset, "test file")
    return bytes(view), served


def test_cold_bytes_read_once_are_served_from_buffers_each_once_then_freed(tmp_path, cold, monkeypatch):
    """Spans read once are read around the page cache into buffers and served from there (the
    file changed afterwards proves it: served bytes are the old ones); each planned byte is handed
    out once (a second read reads the file); every buffer is free again once its planned bytes are
    copied out; a span read twice goes through the page cache and is never served."""
    monkeypatch.setattr(prefetch, "DIRECT_BUDGET", 4 << 20)
    path = tmp_path / "src.bin"
    data = os.urandom(3 * MiB)
    path.write_bytes(data)
    _direct_or_skip(path)
    # unaligned spans, in no file order; the last one is read twice
    spans = [(path, 1000 + i * 300_000, 250_000) for i in (3, 0, 5, 1, 2)] + [(path, 2 * MiB + 7, 5000)]
    once = [True] * 5 + [False]
    ahead = Prefetcher(spans, window=64 * MiB, once=once).start()
    fd = os.open(path, os.O_RDONLY)
    try:
        ahead.wait(len(spans))
        assert ahead.direct_bytes == 5 * 250_000
        changed = bytes(b ^ 0xFF for b in data)
        with open(path, "r+b") as fh:  # later bytes on disk: served bytes come from the buffers
            fh.write(changed)
        for _, offset, length in spans[:5]:
            half = length // 2  # in two reads, as a worker's blocks of rows do
            first, served = _serve(ahead, fd, offset, half)
            second, served_too = _serve(ahead, fd, offset + half, length - half)
            assert served and served_too
            assert first + second == data[offset : offset + length]
            again, _ = _serve(ahead, fd, offset, length)
            assert again == changed[offset : offset + length]  # handed out once: now read from the file
        # a read that starts before a span and ends after it: the span from the buffer, the rest from the file
        _, offset, length = spans[4]
        assert _serve(ahead, fd, offset - 10, 20)[0] == changed[offset - 10 : offset + 10]
        _, offset, length = spans[5]
        got, served = _serve(ahead, fd, offset, length)
        assert not served and got == changed[offset : offset + length]
        assert not ahead._held and len(ahead._free) == prefetch.DIRECT_BUDGET // prefetch.DIRECT_CHUNK
    finally:
        os.close(fd)
        ahead.stop()


def test_a_store_that_fetches_leaves_local_files_it_does_not_hold_read_around_the_cache(tmp_path, cold):
    """The read-ahead asks its own store which files are mirror files (fetched by their mirror,
    never read around the page cache), not the process: a file that store does not hold (a LoRA
    model's local base beside its mirrored adapters) has its cold bytes read once around it."""
    from shardkit.io.store import Store

    class Fetching(Store):
        fetches = True
        asked: list[Path] = []

        def holds(self, path):
            self.asked.append(Path(path))
            return False

    path = tmp_path / "src.bin"
    path.write_bytes(os.urandom(2 * MiB))
    _direct_or_skip(path)
    spans = [(path, i * 500_000, 400_000) for i in range(4)]
    store = Fetching(tmp_path)
    ahead = Prefetcher(spans, window=64 * MiB, once=[True] * 4, store=store).start()
    try:
        ahead.wait(len(spans))
        assert ahead.direct_bytes == 4 * 400_000 and store.asked == [path]
    finally:
        ahead.stop()


def test_small_extents_read_together_still_let_each_wait_return_in_turn(tmp_path, cold, monkeypatch):
    """Small extents are read around the page cache several at once; a worker waiting for the
    first of them returns as soon as they are read, while the read-ahead stays paused at its
    window (it must not need the worker to ask for more first)."""
    monkeypatch.setattr(prefetch, "DIRECT_BUDGET", 4 << 20)
    path = tmp_path / "src.bin"
    data = os.urandom(2 * MiB)
    path.write_bytes(data)
    _direct_or_skip(path)
    spans = [(path, i * 200_000, 100_000) for i in range(8)]  # not continuing each other: 8 extents
    ahead = Prefetcher(spans, window=300_000, once=[True] * 8).start()
    fd = os.open(path, os.O_RDONLY)
    try:
        for n in (1, 3, 8):
            waiter = threading.Thread(target=ahead.wait, args=(n,), daemon=True)
            waiter.start()
            waiter.join(30)
            assert not waiter.is_alive(), f"wait({n}) never returned"
            if n < 8:
                _until(lambda: ahead.paused, "paused at its window")
                assert ahead.position < 8 * 100_000
            for _, offset, length in spans[:n]:
                got, _ = _serve(ahead, fd, offset, length)
                assert got == data[offset : offset + length]
        assert ahead.direct_bytes == 8 * 100_000
    finally:
        os.close(fd)
        ahead.stop()


def test_a_read_across_spans_takes_each_from_its_buffer(tmp_path, cold, monkeypatch):
    """One read covering several planned spans and the bytes between them (zip headers) gets every
    byte right, and frees the buffers."""
    monkeypatch.setattr(prefetch, "DIRECT_BUDGET", 4 << 20)
    path = tmp_path / "src.bin"
    data = os.urandom(2 * MiB)
    path.write_bytes(data)
    _direct_or_skip(path)
    spans = [(path, 5000 + i * 100_000, 90_000) for i in range(8)]  # 10_000 bytes between spans
    ahead = Prefetcher(spans, window=64 * MiB, once=[True] * 8).start()
    fd = os.open(path, os.O_RDONLY)
    try:
        ahead.wait(len(spans))
        got, served = _serve(ahead, fd, 0, MiB)
        assert served and got == data[:MiB]
        assert not ahead._held
    finally:
        os.close(fd)
        ahead.stop()


def test_full_buffers_and_a_waiting_worker_send_the_rest_through_the_page_cache(tmp_path, cold, monkeypatch):
    """When a worker waits for more bytes than the buffers hold (it copies out nothing until all
    are read ahead, like a merged row-parallel weight), the read-ahead reads the rest through the
    page cache instead of waiting for buffers that would never be freed: no deadlock, right bytes."""
    monkeypatch.setattr(prefetch, "DIRECT_BUDGET", 4 * (64 << 10))
    path = tmp_path / "src.bin"
    data = os.urandom(4 * MiB)
    path.write_bytes(data)
    _direct_or_skip(path)
    spans = [(path, i * 500_000, 400_000) for i in range(8)]
    ahead = Prefetcher(spans, window=64 * MiB, once=[True] * 8).start()
    fd = os.open(path, os.O_RDONLY)
    try:
        waiter = threading.Thread(target=ahead.wait, args=(len(spans),), daemon=True)
        waiter.start()
        waiter.join(30)
        assert not waiter.is_alive(), "the worker waited for ever"
        assert 0 < ahead.direct_bytes < 8 * 400_000
        for _, offset, length in spans:
            assert _serve(ahead, fd, offset, length)[0] == data[offset : offset + length]
    finally:
        os.close(fd)
        ahead.stop()


def test_a_file_swapped_in_at_the_path_is_never_served_the_old_files_bytes(tmp_path, cold):
    """Buffers belong to the file the read-ahead opened: a reader of another file now at the same
    path (renamed over it) reads its own file."""
    path = tmp_path / "src.bin"
    data = os.urandom(MiB)
    path.write_bytes(data)
    _direct_or_skip(path)
    ahead = Prefetcher([(path, 0, MiB)], window=64 * MiB, once=[True]).start()
    try:
        ahead.wait(1)
        assert ahead.direct_bytes == MiB
        other = tmp_path / "other.bin"
        other.write_bytes(bytes(MiB))
        os.replace(other, path)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert _serve(ahead, fd, 0, MiB) == (bytes(MiB), False)
        finally:
            os.close(fd)
    finally:
        ahead.stop()


def test_a_file_shorter_than_planned_is_reported_truncated(tmp_path, cold):
    """Planned bytes past the end of the file are not served: the reader's own read finds the file
    short and says so (one line, FormatError)."""
    path = tmp_path / "src.bin"
    path.write_bytes(os.urandom(300_000))
    _direct_or_skip(path)
    ahead = Prefetcher([(path, 0, 200_000), (path, 200_000, 200_000)], window=64 * MiB, once=[True, True]).start()
    fd = os.open(path, os.O_RDONLY)
    try:
        ahead.wait(2)
        view = memoryview(bytearray(200_000))
        source = ahead.source_for(os.fstat(fd))
        assert source is not None
        with pytest.raises(FormatError, match="test file is truncated"):
            source(fd, view, 200_000, "test file")
    finally:
        os.close(fd)
        ahead.stop()


def test_o_direct_refused_at_read_falls_back_to_the_page_cache(tmp_path, cold, monkeypatch):
    """A file system that accepts O_DIRECT at open but refuses the reads (EINVAL) is read through
    the page cache: nothing is served, nothing fails."""
    path = tmp_path / "src.bin"
    data = os.urandom(MiB)
    path.write_bytes(data)
    _direct_or_skip(path)
    real_preadv = os.preadv

    def refusing(fd, buffers, offset, *flags):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.setattr(prefetch.os, "preadv", refusing)
    # two spans read alone, then four small ones read together (a batch)
    spans = [(path, 0, MiB // 4), (path, MiB // 4, MiB // 4)] + [
        (path, MiB // 2 + i * (MiB // 8), MiB // 8) for i in range(4)
    ]
    ahead = Prefetcher(spans, window=64 * MiB, once=[True] * len(spans)).start()
    fd = os.open(path, os.O_RDONLY)
    try:
        ahead.wait(len(spans))
        assert ahead.direct_bytes == 0 and ahead.position == MiB
        assert _serve(ahead, fd, 0, MiB) == (data, False)
    finally:
        os.close(fd)
        ahead.stop()


def test_cached_fraction_tells_cached_from_dropped_pages(tmp_path, monkeypatch):
    """cachestat (or mincore on a mapping where cachestat is missing) says how much of a range is
    in the page cache: all of a file just written, none once its pages are dropped."""
    path = tmp_path / "src.bin"
    with open(path, "wb") as fh:
        fh.write(os.urandom(2 * MiB))
        fh.flush()
        os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        for how in ("cachestat", "mincore"):
            monkeypatch.setattr(prefetch, "_how", how)
            os.pread(fd, 2 * MiB, 0)
            assert prefetch.cached_fraction(fd, 100, MiB) == 1.0, how
            for _ in range(100):  # pages being added to the LRU on another CPU are dropped on a later try
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if prefetch.cached_fraction(fd, 100, MiB) < 0.5:
                    break
                time.sleep(0.01)
            assert prefetch.cached_fraction(fd, 100, MiB) < 0.5, how
    finally:
        os.close(fd)


@pytest.fixture
def recorded(monkeypatch) -> list[Prefetcher]:
    """The read-aheads operations make, in order; each notes the buffers still held when stopped."""
    made: list[Prefetcher] = []
    real = executor.Prefetcher

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, spans, window=None, once=None, store=None):
            super().__init__(spans, window, once, store)
            made.append(self)

        def stop(self):
            self.left = sum(len(chunks) for chunks in self._held.values())
            super().stop()

    monkeypatch.setattr(executor, "Prefetcher", Recording)
    return made


def test_reads_go_around_the_page_cache_only_when_the_operation_would_not_fit_in_free_memory(
    tiny_model, tmp_path, monkeypatch, recorded
):
    """Below the free memory, the page cache holds what an operation reads and writes without
    evicting anything, and reads through it are faster; above it, cold bytes read once go around
    it. The bytes counted are the sources planned plus the output."""
    free = {"MemFree": 10 << 30}
    monkeypatch.setattr(prefetch, "meminfo", lambda field: free.get(field))
    assert prefetch.reads_around_pay(11 << 30) and not prefetch.reads_around_pay(9 << 30)
    free.clear()  # no /proc/meminfo: never
    assert not prefetch.reads_around_pay(1 << 50)

    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "shards", Layout(tp=2), format="torch", workers=1)
    shard_bytes = sum(p.stat().st_size for p in (tmp_path / "shards").rglob("*.pt"))
    made = recorded
    monkeypatch.setattr(prefetch, "cached_fraction", lambda fd, offset, length: 0.0)  # the shards are cold
    for fits, name in ((True, "fits"), (False, "does-not-fit")):
        # tensors read (a little less than the shards) + the merged output (about as much)
        free["MemFree"] = 3 * shard_bytes if fits else shard_bytes
        merge(tmp_path / "shards", tmp_path / name, workers=1)
        assert made.pop()._direct is not fits, name


def test_warm_bytes_are_never_read_around_the_page_cache(tiny_model, tmp_path, monkeypatch, recorded):
    """When an operation would not fit in the free memory, only the bytes not already cached as
    it starts are planned around the page cache; a merge of cached shards then copies them file
    to file, and serves no reader from the buffers."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "shards", Layout(tp=2), format="torch", workers=1)
    _direct_or_skip(next((tmp_path / "shards").rglob("*.pt")))
    monkeypatch.setattr(prefetch, "reads_around_pay", lambda nbytes: True)
    monkeypatch.setattr(planning, "reads_around_pay", lambda nbytes: True)
    cached = {"fraction": 1.0}
    monkeypatch.setattr(prefetch, "cached_fraction", lambda fd, offset, length: cached["fraction"])
    copies = []
    real = HashingFile.copy_ranges
    monkeypatch.setattr(HashingFile, "copy_ranges", lambda self, *a, **k: copies.append(1) or real(self, *a, **k))
    merge(tmp_path / "shards", tmp_path / "warm", workers=1, verify_hashes=False)  # unchecked: copied
    ahead = recorded.pop()
    assert not ahead._direct and ahead.source_for(os.stat(next((tmp_path / "shards").rglob("*.pt")))) is None
    assert copies  # the dim-0 pieces went file to file
    cached["fraction"] = 0.0
    copies.clear()
    merge(tmp_path / "shards", tmp_path / "cold", workers=1, verify_hashes=False)
    assert recorded.pop()._direct and not copies  # every shard served from the buffers
    for name in ("warm", "cold"):
        assert (tmp_path / name / "model.safetensors").read_bytes() == (
            tmp_path / "warm" / "model.safetensors"
        ).read_bytes()


def test_only_spans_read_once_and_overlapped_by_none_are_read_into_buffers():
    """A span read by two reads, or overlapping another (a piece planned whole after blocks of its
    rows), goes through the page cache; disjoint spans read once may use the buffers."""
    a, b = Path("a"), Path("b")
    plan = [(a, 0, 100), (a, 100, 100), (a, 150, 300), (b, 0, 100), (b, 100, 50)]
    assert planning._read_once(plan, [1, 1, 1, 1, 2]) == [True, False, False, True, False]


def test_a_cold_merge_through_the_buffers_writes_the_same_bytes(tiny_model, tmp_path, cold, monkeypatch, recorded):
    """A merge whose shards are read around the page cache (buffers of 16 KiB, so that pieces span
    several, and too few for some tensors, so that some bytes go through the page cache) writes
    the bytes of a merge without read-ahead, with the hash check on; a shard with a flipped bit is
    still refused (the check hashes the bytes served from the buffers)."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "shards", Layout(tp=4, pp=2), format="torch", workers=1)
    _direct_or_skip(next((tmp_path / "shards").rglob("*.pt")))
    monkeypatch.setattr(prefetch, "DIRECT_CHUNK", 16 << 10)
    monkeypatch.setattr(prefetch, "DIRECT_BUDGET", 6 * (16 << 10))
    made = recorded
    merge(tmp_path / "shards", tmp_path / "direct", workers=2)
    assert made and made[0].direct_bytes > 0
    assert made[0].left == 0  # every byte read ahead into a buffer was served from it
    assert made[0].direct_bytes < made[0].position  # some through the page cache
    monkeypatch.setattr(planning, "plan_read_ahead", lambda outputs, index, spans, written=0, streamed=False: None)
    merge(tmp_path / "shards", tmp_path / "plain", workers=1)
    files = sorted(p.relative_to(tmp_path / "plain") for p in (tmp_path / "plain").rglob("*") if p.is_file())
    assert files
    for name in files:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name

    monkeypatch.setattr(planning, "plan_read_ahead", real_plan)
    shard = max((tmp_path / "shards").rglob("*.pt"), key=lambda p: p.stat().st_size)
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    shard.write_bytes(raw)
    made.clear()
    with pytest.raises(FormatError, match="does not match"):
        merge(tmp_path / "shards", tmp_path / "corrupt", workers=1)
    assert made and made[0].direct_bytes > 0
    assert not (tmp_path / "corrupt").exists()


@pytest.mark.parametrize("operation", ["convert", "reshard"])
def test_convert_and_reshard_through_the_buffers_write_the_same_bytes(
    tiny_model, tmp_path, cold, monkeypatch, recorded, operation
):
    """Convert (row blocks of the Hugging Face tensors read once) and reshard (tp 4 pp 2 -> tp 2
    pp 3) read around the page cache write the tensor files of the same operation without
    read-ahead, byte for byte, and serve every byte they read into the buffers."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    if operation == "convert":
        source = src

        def run(dst):
            convert(source, dst, Layout(tp=4, pp=2), format="torch", workers=1)

    else:
        source = tmp_path / "shards"
        convert(src, source, Layout(tp=4, pp=2), format="torch", workers=1)

        def run(dst):
            reshard(source, dst, Layout(tp=2, pp=3), workers=2)

    _direct_or_skip(next(p for p in source.rglob("*") if p.suffix in (".pt", ".safetensors")))
    monkeypatch.setattr(prefetch, "DIRECT_CHUNK", 16 << 10)
    monkeypatch.setattr(prefetch, "DIRECT_BUDGET", 8 * (16 << 10))
    run(tmp_path / "direct")
    assert recorded and recorded[-1].direct_bytes > 0 and recorded[-1].left == 0
    monkeypatch.setattr(planning, "plan_read_ahead", lambda outputs, index, spans, written=0, streamed=False: None)
    run(tmp_path / "plain")
    tensors = sorted(
        p.relative_to(tmp_path / "plain")
        for p in (tmp_path / "plain").rglob("*")
        if p.suffix in (".pt", ".safetensors")
    )
    assert tensors
    for name in tensors:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes(), name


real_plan = planning.plan_read_ahead
