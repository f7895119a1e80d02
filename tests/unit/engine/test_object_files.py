"""Object files in the engine (`outputs.FileBody`): files holding any object of tensors (ZeRO-1
optimizer shards, `checkpoint.zero1.build_optim`), built in lockstep, a tensor of each in turn.
Each source piece is read once for the files of its group and cut by the leaf's `then`;
constants are written as they are. The files are torch.save's (and xser's) bytes of the same
objects held whole, and a failure in one file leaves none behind."""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

import pytest
import torch

from shardkit.checkpoint.object_writer import Deferred, object_body, save_object
from shardkit.checkpoint.zero1 import MASTER, build_optim
from shardkit.engine.executor import execute
from shardkit.engine.options import WriteOptions
from shardkit.engine.outputs import OutputFile, plan_sharded
from shardkit.formats import SourceReader, open_checkpoint
from shardkit.io.data.digest import NONE
from shardkit.layout import Layout

DP = 3  # the norms' 64 rows do not divide by it: the last shard is padded


def _digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _objects(pieces, state) -> list[dict]:
    names = [p.name for p in pieces]
    groups = [0 if p.name.endswith("proj.weight") else 1 for p in pieces]
    hyper = [{"lr": 0.1, "betas": (0.9, 0.95)}, {"lr": 0.1, "betas": (0.9, 0.95)}]
    return [build_optim(names, groups, hyper, state, DP, d, True) for d in range(DP)]


def _state(pieces, tensor_of) -> dict:
    """Adam state of each piece: both moments and the master weights are the piece itself."""
    return {
        p.name: {"step": 3, "exp_avg": tensor_of(p), "exp_avg_sq": tensor_of(p), MASTER: tensor_of(p)} for p in pieces
    }


@pytest.fixture
def source(tiny_model):
    ckpt = open_checkpoint(tiny_model("llama-gqa64", dtype=torch.float32))
    pieces = plan_sharded(ckpt.family, ckpt.dims, Layout(tp=2), "torch")[1].pieces  # tp rank 1's
    return ckpt, pieces


def _engine_outputs(pieces, use_xser: bool) -> list[OutputFile]:
    lazy = _state(pieces, lambda p: Deferred(p.shape, torch.float32, lambda: torch.zeros(0), p))
    return [
        OutputFile.of_body(f"optim/dp_rank_{d:02d}.pt", object_body(obj, use_xser), together="rank 1")
        for d, obj in enumerate(_objects(pieces, lazy))
    ]


@pytest.mark.parametrize("use_xser", [False, True], ids=["torch", "xser"])
def test_object_files_are_torch_saves_bytes_and_read_each_piece_once(source, tmp_path, monkeypatch, use_xser):
    ckpt, pieces = source
    reader = SourceReader(ckpt)
    held = _state(pieces, lambda p: reader.read_piece(p).float().clone())
    reader.close()
    for d, obj in enumerate(_objects(pieces, held)):
        save_object(tmp_path / "whole" / f"optim/dp_rank_{d:02d}.pt", obj, use_xser)

    reads: list[str] = []
    read_piece = SourceReader.read_piece

    def counted(self, piece, *args, **kwargs):
        reads.append(piece.name)
        return read_piece(self, piece, *args, **kwargs)

    monkeypatch.setattr(SourceReader, "read_piece", counted)
    options = WriteOptions(fmt="xser" if use_xser else "torch", verify_hashes=NONE, archive=None)
    records = execute(ckpt, _engine_outputs(pieces, use_xser), tmp_path / "engine", options)
    assert _digest(tmp_path / "engine") == _digest(tmp_path / "whole")
    assert {r.path for r in records} == set(_digest(tmp_path / "engine"))
    # moments one after the other (read once for both and the 3 files), the master weights later
    assert set(Counter(reads).values()) == {2} and set(reads) == {p.name for p in pieces}


def test_a_failure_in_one_object_file_leaves_no_file(source, tmp_path):
    ckpt, pieces = source
    outputs = _engine_outputs(pieces, False)
    body = outputs[1].body
    assert body is not None
    broken = list(body.leaves)
    k = next(i for i, leaf in enumerate(broken) if leaf.piece is not None and i > 3)

    def fail(t: torch.Tensor) -> torch.Tensor:
        raise OSError(5, "Input/output error")

    broken[k] = type(broken[k])(broken[k].spec, broken[k].piece, fail)
    outputs[1] = OutputFile.of_body(outputs[1].path, type(body)(tuple(broken), body.data_pkl), "rank 1")
    with pytest.raises(OSError, match="Input/output"):
        execute(ckpt, outputs, tmp_path / "out", WriteOptions(verify_hashes=NONE))
    assert not [p for p in (tmp_path / "out").rglob("*") if p.is_file()]


def test_a_format_without_object_files_says_so(source, tmp_path):
    ckpt, pieces = source
    with pytest.raises(Exception, match="state dicts, not objects"):
        execute(
            ckpt, _engine_outputs(pieces, False), tmp_path / "out", WriteOptions(fmt="safetensors", verify_hashes=NONE)
        )
