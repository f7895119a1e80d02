"""The tp files of one pipeline stage are built together, a piece of each in turn, when they cut
blocks of columns out of their sources (`planning.lockstep_groups`): each such source tensor is
then read once for all of them (`io.data.strided.shared_column_reads`). The files are byte for byte those
built one after another, the check on read still refuses a flipped bit, a failure in one file
leaves none behind, and the files' write-behind queues together stay under WRITE_BEHIND_ALL."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from shardkit import Layout, convert, merge, reshard
from shardkit.engine import planning
from shardkit.engine.outputs import plan_full, plan_sharded
from shardkit.errors import ShardkitError
from shardkit.formats import open_checkpoint
from shardkit.formats.safetensors_io import SafetensorsFile
from shardkit.io.data import hashing, strided
from shardkit.io.data.hashing import HashingFile
from shardkit.io.safety.sinks import NO_SINK


def _files(root) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def column_reads(monkeypatch) -> dict[str, list]:
    """Every tensor counts as large (its blocks of columns take the strided path, as o_proj's do in
    a real model); records the whole-tensor reads of the shared path and the per-block mappings."""
    monkeypatch.setattr(strided, "STRIDED_READ_CHUNK", 0)
    monkeypatch.setattr(strided, "SHARED_WINDOW", 1024)  # windows of 4 rows of o_proj, 8 of down_proj
    monkeypatch.setattr(strided, "BEHIND_MIN", 64)  # (each file's block of a window at least this)
    monkeypatch.setattr(hashing, "BEHIND_MIN", 64)  # (and such a block written behind)
    seen: dict[str, list] = {"whole": [], "mapped": []}
    real_pread, real_map = strided.pread_exact, strided._copy_columns

    def pread(file, view, offset, what):
        seen["whole"].append((what, offset, len(view)))
        return real_pread(file, view, offset, what)

    def mapped(file, t, dim, start, out, what):
        seen["mapped"].append((what, t.file_offset, start))
        return real_map(file, t, dim, start, out, what)

    monkeypatch.setattr(strided, "pread_exact", pread)
    monkeypatch.setattr(strided, "_copy_columns", mapped)
    return seen


def _plan(src, layout):
    ckpt = open_checkpoint(src)
    return ckpt, ckpt.family, ckpt.dims, plan_sharded(ckpt.family, ckpt.dims, layout, "torch")


def test_the_tp_files_of_a_stage_that_cut_columns_are_grouped(tiny_model, tmp_path, monkeypatch):
    """A convert groups the tp files of each stage (in the order of their first file, at most
    LOCKSTEP_MAX together); a reshard whose output pieces are whole source pieces and a merge
    leave every file alone; `in_order` takes a piece of each file of a group in turn."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    ckpt, family, dims, outputs = _plan(src, Layout(tp=4, pp=2))
    groups = planning.lockstep_groups(outputs, ckpt.index())
    assert [[o.rank for o in g] for g in groups] == [
        [(0, tp, 0) for tp in range(4)],
        [(0, tp, 1) for tp in range(4)],
    ]
    pieces = list(planning.in_order(groups))
    first = groups[0]
    assert pieces[: 2 * len(first)] == [o.pieces[0] for o in first] + [o.pieces[1] for o in first]
    assert len(pieces) == sum(len(o.pieces) for o in outputs)

    monkeypatch.setattr(planning, "LOCKSTEP_MAX", 3)
    assert [len(g) for g in planning.lockstep_groups(outputs, ckpt.index())] == [3, 3, 1, 1]
    monkeypatch.undo()

    convert(src, tmp_path / "tp4", Layout(tp=4, pp=2), format="torch", workers=1)
    shards = open_checkpoint(tmp_path / "tp4")
    to_tp2 = plan_sharded(family, dims, Layout(tp=2, pp=2), "torch")  # o_proj: two whole tp4 pieces
    assert all(len(g) == 1 for g in planning.lockstep_groups(to_tp2, shards.index()))
    full, _ = plan_full(family, dims, 2, "5GB")
    assert all(len(g) == 1 for g in planning.lockstep_groups(full, shards.index()))
    to_tp8 = plan_sharded(family, dims, Layout(tp=8, pp=2), "torch")  # halves of tp4's columns
    assert [len(g) for g in planning.lockstep_groups(to_tp8, shards.index())] == [8, 8]


@pytest.mark.parametrize("workers,fmt", [(1, "torch"), (2, "torch"), (1, "safetensors"), (1, "xser")])
def test_a_stage_reads_each_column_split_tensor_once_and_writes_the_same_bytes(
    tiny_model, tmp_path, monkeypatch, column_reads, workers, fmt
):
    """Built together, the tp files of a stage read each window of rows of o_proj and down_proj
    once and cut their columns from it (no mapping per block); the shards are byte for byte those
    built one file after another (each mapping its blocks), and merge back to the source."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    layout = Layout(tp=4, pp=2)
    convert(src, tmp_path / "together", layout, format=fmt, workers=workers)
    assert not column_reads["mapped"]
    hf = SafetensorsFile(src / "model.safetensors")
    column_split = [n for n in hf.keys() if n.endswith(("o_proj.weight", "down_proj.weight"))]
    hf.close()
    assert len(column_split) == 10
    spans = [span[:2] for span in map(SafetensorsFile(src / "model.safetensors").span, column_split)]
    windows = [
        (offset, length) for _, offset, length in column_reads["whole"] if any(a <= offset < a + n for a, n in spans)
    ]
    assert len(set(windows)) == len(windows)  # no window of rows read twice
    assert sum(length for _, length in windows) == sum(n for _, n in spans)  # every row read, once
    assert len(windows) == 5 * (128 // 4) + 5 * (128 // 8)  # in windows of SHARED_WINDOW bytes

    monkeypatch.setattr(planning, "LOCKSTEP_MAX", 1)
    column_reads["whole"].clear()
    convert(src, tmp_path / "apart", layout, format=fmt, workers=workers)
    assert len(column_reads["mapped"]) == 4 * len(column_split)  # every rank maps its own block
    assert _files(tmp_path / "together") == _files(tmp_path / "apart")

    merge(tmp_path / "together", tmp_path / "merged", workers=1)
    assert load_file(tmp_path / "merged" / "model.safetensors").keys() == load_file(src / "model.safetensors").keys()
    for name, tensor in load_file(src / "model.safetensors").items():
        assert torch.equal(load_file(tmp_path / "merged" / "model.safetensors")[name], tensor), name


def test_a_reshard_that_halves_columns_checks_the_shared_reads(tiny_model, tmp_path, column_reads):
    """tp 2 -> tp 4 cuts each shard's o_proj/down_proj columns in two: the stage's files are built
    together from one read of each, checked against the manifest; the result is a direct
    convert's, and a flipped bit in such a tensor is refused with nothing written."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "tp2", Layout(tp=2, pp=2), format="torch", workers=1)
    convert(src, tmp_path / "direct", Layout(tp=4, pp=2), format="torch", workers=1)
    column_reads["mapped"].clear()
    reshard(tmp_path / "tp2", tmp_path / "tp4", Layout(tp=4, pp=2), workers=1)
    assert not column_reads["mapped"]
    out, direct = _files(tmp_path / "tp4"), _files(tmp_path / "direct")
    assert {k: v for k, v in out.items() if k.endswith(".pt")} == {k: v for k, v in direct.items() if k.endswith(".pt")}

    # a flipped bit in the last bytes of a shard's down_proj (read whole once, cut for two files)
    shard = tmp_path / "tp2" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    import zipfile

    with zipfile.ZipFile(shard) as z:
        names = [i for i in z.infolist() if i.filename.startswith("archive/data/")]
        largest = max(names, key=lambda i: i.file_size)
        data_offset = largest.header_offset + 30 + len(largest.filename.encode()) + len(largest.extra)
    data = bytearray(shard.read_bytes())
    data[data_offset + largest.file_size - 1] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardkitError, match="(?i)hash|digest|changed|corrupt"):
        reshard(tmp_path / "tp2", tmp_path / "bad", Layout(tp=4, pp=2), workers=1)
    assert not (tmp_path / "bad").exists()
    assert [p.name for p in tmp_path.iterdir() if "shardkit-tmp" in p.name] == []


def test_a_failure_in_one_file_of_a_group_leaves_no_file_behind(tiny_model, tmp_path, monkeypatch, column_reads):
    """The third file of a stage fails at its fifth piece: every file of the group is given up
    (the two before it had written as many pieces), no descriptor stays open, nothing is left."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    from shardkit.formats import torch_io

    real_write, real_copy = torch_io.TorchWriter.write, torch_io.TorchWriter.write_copy
    calls: dict[str, int] = {}
    aborted: list[str] = []
    real_abort = torch_io.TorchWriter.abort

    def fail_at_fifth(self) -> None:
        calls[self.path.name] = calls.get(self.path.name, 0) + 1
        if "tp_rank_02_pp_rank_00" in self.path.name and calls[self.path.name] == 5:
            raise OSError(28, "No space left on device")

    def write(self, name, tensor, owned=False):
        fail_at_fifth(self)
        return real_write(self, name, tensor, owned)

    def write_copy(self, name, ranges):
        fail_at_fifth(self)
        return real_copy(self, name, ranges)

    def abort(self):
        aborted.append(self.path.name)
        return real_abort(self)

    monkeypatch.setattr(torch_io.TorchWriter, "write", write)
    monkeypatch.setattr(torch_io.TorchWriter, "write_copy", write_copy)
    monkeypatch.setattr(torch_io.TorchWriter, "abort", abort)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ShardkitError):
        convert(src, tmp_path / "out", Layout(tp=4, pp=2), format="torch", workers=1)
    assert calls["dp_rank_00_tp_rank_00_pp_rank_00.pt"] == calls["dp_rank_00_tp_rank_01_pp_rank_00.pt"] == 5
    assert "dp_rank_00_tp_rank_03_pp_rank_00.pt" in calls  # the group's files were all open at once
    assert {f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt" for tp in range(4)} <= set(aborted)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []
    assert len(os.listdir("/proc/self/fd")) == before


class _SlowFile:
    """A file whose writes take a while, and that records how many bytes wait in all queues."""

    def __init__(self, fh, peaks: list[int]):
        self._fh, self._peaks = fh, peaks

    def write(self, data):
        self._peaks.append(hashing._Queued.total)
        time.sleep(0.002)
        return self._fh.write(data)

    def __getattr__(self, name):
        return getattr(self._fh, name)


def test_the_write_behind_queues_of_all_files_together_stay_bounded(tmp_path, monkeypatch):
    """Owned blocks written round-robin into eight files whose disk is slow: the bytes queued in
    all of them stay under WRITE_BEHIND_ALL (plus the block being queued), though each file alone
    may queue WRITE_BEHIND, and every file holds its bytes in order."""
    monkeypatch.setattr(hashing, "WRITE_BEHIND_ALL", 3 << 20)
    monkeypatch.setattr(hashing, "WRITE_BLOCK", 256 << 10)
    block = 1 << 20
    peaks: list[int] = []
    threads_before = threading.active_count()  # earlier tests' threads (an S3 client's pool) may still run
    files = [HashingFile(tmp_path / f"f{i}", tmp_path) for i in range(8)]
    for f in files:
        f._fh = _SlowFile(f._fh, peaks)
    expected = {i: bytearray() for i in range(8)}
    for round_ in range(4):
        for i, f in enumerate(files):
            data = torch.full((block,), round_ * 8 + i, dtype=torch.uint8)
            f.write_owned(data.numpy(), data)
            expected[i] += bytes(data.numpy())
    records = [f.close() for f in files]
    assert max(peaks) <= (3 << 20) + block
    assert max(peaks) >= 2 << 20  # the queues did fill: the bound was tested
    for i, record in enumerate(records):
        assert (tmp_path / f"f{i}").read_bytes() == bytes(expected[i])
        assert record.size == 4 * block
    assert threading.active_count() - threads_before < 8  # a few shared write-behind threads, not one per file


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_a_matrix_written_in_blocks_of_rows_is_checked_and_gives_the_file_up_when_wrong(tmp_path, fmt):
    """`begin_rows`: blocks that add up to the matrix give the bytes `write` gives; a block of the
    wrong width, more rows than the matrix, another tensor while its rows are open or an `end`
    before its last rows discard the file."""
    from shardkit.formats import get_format
    from shardkit.formats.base import TensorSpec

    writer_of = get_format(fmt).writer
    matrix = torch.arange(6 * 4, dtype=torch.bfloat16).reshape(6, 4)
    specs = [TensorSpec("m", (6, 4), torch.bfloat16), TensorSpec("v", (3,), torch.float32)]

    def write(path, blocks, finish=True):
        w = writer_of(path, tmp_path, specs, [], True, False, NO_SINK, "archive/")
        rows = w.begin_rows("m")
        for block in blocks:
            rows.add(block)
        if finish:
            rows.end()
            w.write("v", torch.ones(3))
            return w.close()
        return w

    write(tmp_path / f"whole.{fmt}", [matrix])
    write(tmp_path / f"blocks.{fmt}", [matrix[:1].clone(), matrix[1:5].clone(), matrix[5:].clone()])
    assert (tmp_path / f"whole.{fmt}").read_bytes() == (tmp_path / f"blocks.{fmt}").read_bytes()
    for bad in ([matrix[:, :3].clone()], [matrix, matrix[:1].clone()]):
        with pytest.raises(RuntimeError, match="do not fit|more rows"):
            write(tmp_path / f"bad.{fmt}", bad)
        assert not (tmp_path / f"bad.{fmt}").exists()
    w = write(tmp_path / f"open.{fmt}", [matrix[:5].clone()], finish=False)
    with pytest.raises(RuntimeError, match="rows of m"):  # no other tensor while m's rows are open
        w.write("v", torch.ones(3))
    assert not (tmp_path / f"open.{fmt}").exists()
    w = write(tmp_path / f"short.{fmt}", [matrix[:5].clone()], finish=False)
    with pytest.raises(RuntimeError, match="of its"):
        w._rows.end()
    assert not (tmp_path / f"short.{fmt}").exists()


def test_owned_blocks_are_hashed_by_their_files_write_behind_thread_in_file_order(tmp_path, monkeypatch):
    """Owned blocks queued behind slow kernel copies in several files are hashed by the files'
    write-behind threads as they write them, never by the shared hash helper (which hashed them
    before and stalled on one file's copies while every other file's blocks waited in memory);
    each file's digests are those of its bytes, small writes in between included."""
    from shardkit.io.data.copy import FileRange
    from shardkit.io.data.digest import file_digests
    from shardkit.io.data.taps import OpenFile

    helper: list[int] = []
    real_submit = hashing._HASHER.submit
    monkeypatch.setattr(hashing._HASHER, "submit", lambda job: (helper.append(job.size), real_submit(job))[1])
    real_copy = hashing.kernel_copy

    def slow_copy(src, offset, out, count, fetcher=None):
        time.sleep(0.003)
        return real_copy(src, offset, out, count)

    monkeypatch.setattr(hashing, "kernel_copy", slow_copy)
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(3 << 20))
    fd = os.open(source, os.O_RDONLY)
    try:
        files = [HashingFile(tmp_path / f"out{i}", tmp_path) for i in range(4)]
        for step in range(3):
            for f in files:
                f.copy_ranges([FileRange(OpenFile(fd), step << 20, 1 << 20, "source.bin")])
                f.write(b"header %d" % step)  # a small write behind the copy
                block = torch.full((300 << 10,), step, dtype=torch.uint8)
                f.write_owned(block.numpy(), block)
        records = [f.close() for f in files]
    finally:
        os.close(fd)
    assert helper == []
    for i, record in enumerate(records):
        assert record.xxh3_128 == file_digests(tmp_path / f"out{i}")[1]
    # a 7B down_proj's window of rows at tp 32: each file's block of it is written behind, and
    # the window is no larger than SHARED_WINDOW or that needs
    rows = strided.window_rows(11008 * 2, 344 * 2)
    assert rows * 344 * 2 >= hashing.BEHIND_MIN
    assert rows * 11008 * 2 <= strided.SHARED_WINDOW or (rows - 1) * 344 * 2 < hashing.BEHIND_MIN


def test_a_forked_child_writes_through_its_own_write_behind_threads(tmp_path, monkeypatch):
    """A child forked while the parent's blocks wait to be written starts its own write-behind
    threads and counts only its own queued bytes (the parent's threads and queues are not in it):
    its writes end, where a count inherited from the parent would make it wait for ever."""
    import signal

    monkeypatch.setattr(hashing, "WRITE_BLOCK", 256 << 10)
    parent = HashingFile(tmp_path / "parent", tmp_path)
    parent._fh = _SlowFile(parent._fh, [])
    for i in range(3):
        block = torch.full((1 << 20,), i, dtype=torch.uint8)
        parent.write_owned(block.numpy(), block)
    assert hashing.queued_writes() > 0  # the parent's blocks are still queued as it forks
    pid = os.fork()
    if pid == 0:  # the child: exit 0 once its own file is written and closed
        try:
            hashing.WRITE_BEHIND_ALL = 1 << 20
            child = HashingFile(tmp_path / "child", tmp_path)
            data = bytearray(b"\7" * (2 << 20))  # (no torch in a forked child: its thread pool is the parent's)
            child.write_owned(memoryview(data), data)
            record = child.close()
            os._exit(0 if record.size == 2 << 20 else 1)
        except BaseException:
            os._exit(1)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's write never ended")
    assert os.waitstatus_to_exitcode(status) == 0
    parent.close()
    assert (tmp_path / "child").stat().st_size == 2 << 20


def test_no_block_outlives_its_files_close_in_a_write_behind_thread(tmp_path, monkeypatch):
    """Once `close` returns, no write-behind thread holds a block of the file any more (it is
    dropped before the block counts as written): those threads are daemons, and one that freed a
    tensor while the interpreter shut down would be stopped inside torch's deallocator."""
    import weakref

    real = hashing._WriteBehind._written

    def slow_to_go_on(self, size, block):
        real(self, size, block)
        time.sleep(0.05)  # the caller's close returns now: anything the thread still holds is seen

    monkeypatch.setattr(hashing._WriteBehind, "_written", slow_to_go_on)

    class Block:
        def __init__(self) -> None:
            self.data = bytearray(2 << 20)

    out = HashingFile(tmp_path / "x.bin", tmp_path)
    block = Block()
    ref = weakref.ref(block)
    out.write_owned(memoryview(block.data), block)
    del block
    out.close()
    assert ref() is None, "a write-behind thread still holds a block of a closed file"
