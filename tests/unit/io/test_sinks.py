"""An output's sink (`io.safety.sinks`) is handed down with the output, never looked up by path:
each writer hands the files it closes to the sink it was given, the staged output's commit waits
for its sink, and a failure of the sink fails the commit with nothing put in place."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from shardkit import Layout
from shardkit.distributed import Job
from shardkit.engine import merge_checkpoint, reshard_checkpoint
from shardkit.errors import ShardkitError
from shardkit.formats import open_checkpoint
from shardkit.io.data.hashing import HashingFile
from shardkit.io.safety.sinks import NO_SINK
from shardkit.io.safety.transaction import STAGING_TAG, commit_all, sibling_name, staged_output


class Recording:
    """A sink that records what it is handed (and, when drained, what the staging folder holds)."""

    def __init__(self, fail: str | None = None):
        self.paths: list[Path] = []
        self.drained: list[list[str]] = []
        self.fail = fail
        self.lock = threading.Lock()

    def closed(self, path: Path) -> None:
        with self.lock:
            self.paths.append(Path(path))

    def drain(self) -> None:
        self.drained.append(sorted(p.name for p in self.paths if p.exists()))
        if self.fail:
            raise ShardkitError(self.fail)


def test_a_file_goes_to_its_own_sink_once_when_closed_never_when_aborted(tmp_path):
    mine, other = Recording(), Recording()
    out = HashingFile(tmp_path / "a.bin", tmp_path, sink=mine)
    out.write(b"x" * 10)
    assert mine.paths == []  # not before it is finished
    out.close()
    assert mine.paths == [tmp_path / "a.bin"] and other.paths == []
    dropped = HashingFile(tmp_path / "b.bin", tmp_path, sink=mine)
    dropped.write(b"y")
    dropped.abort()
    assert mine.paths == [tmp_path / "a.bin"] and not (tmp_path / "b.bin").exists()
    local = HashingFile(tmp_path / "c.bin", tmp_path)  # a local output's file: no sink
    assert local.sink is NO_SINK
    local.close()
    assert mine.paths == [tmp_path / "a.bin"] and other.paths == []


def test_a_staged_output_commits_once_its_sink_is_drained(tmp_path):
    sink = Recording()
    with staged_output(tmp_path / "out", sink=sink, job=Job()) as out:
        assert out.sink is sink
        HashingFile(out.path / "f.bin", out.path, sink=out.sink).close()
        commit_all(out, Job())
    assert sink.drained == [["f.bin"]]  # drained before the rename, the file still staged
    assert (tmp_path / "out" / "f.bin").is_file()


def test_a_failed_sink_fails_the_commit_and_nothing_is_put_in_place(tmp_path):
    sink = Recording(fail="upload of f.bin failed: AccessDenied")
    with pytest.raises(ShardkitError, match=r"^upload of f.bin failed: AccessDenied$"):
        with staged_output(tmp_path / "out", sink=sink, job=Job()) as out:
            HashingFile(out.path / "f.bin", out.path, sink=out.sink).close()
            commit_all(out, Job())
    assert sink.drained == [["f.bin"]]
    assert list(tmp_path.iterdir()) == []  # no destination, no staging folder, no lock left


def test_the_engine_hands_every_data_file_to_the_sink_it_is_given(tiny_model, tmp_path):
    """`sink` rides with the operation to every writer (WriteOptions.sink): each file of its
    records (xser's tensor and info files too; a merge's safetensors files) once, as it closes, in
    the staging folder; the files the commit writes last (config, manifest, index) are not handed
    over; an operation given no sink hands nothing to anyone."""
    src = open_checkpoint(tiny_model("llama-gqa64", dtype=torch.bfloat16))
    sink = Recording()
    dst = tmp_path / "shards"
    staging = sibling_name(dst, STAGING_TAG)
    result = reshard_checkpoint(src, dst, Layout(tp=2, pp=2), format="xser", sink=sink, workers=2)
    handed = [p.relative_to(staging).as_posix() for p in sink.paths]
    assert sorted(handed) == sorted(r.path for r in result.files) and len(set(handed)) == len(handed)
    assert any(".tensors/" in h for h in handed) and result.rank_files == 4
    assert sink.drained == [sorted(p.name for p in sink.paths)]  # once, before the rename
    merged = Recording()
    done = merge_checkpoint(open_checkpoint(dst), tmp_path / "hf", max_shard_size=200_000, sink=merged)
    assert sorted(p.name for p in merged.paths) == sorted(r.path for r in done.files) and len(done.files) > 1
    assert not {"config.json", "shardkit.json", "model.safetensors.index.json"} & {p.name for p in merged.paths}
    reshard_checkpoint(src, tmp_path / "again", Layout(tp=2), format="torch")
    assert len(sink.paths) == len(result.files) and len(merged.paths) == len(done.files)
