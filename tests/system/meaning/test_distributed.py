"""convert/reshard/merge divided among the processes of a real torchrun job (gloo, local)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardkit

pytestmark = pytest.mark.slow


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "shardkit",
        "-v",
        "-q",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)


def load_all(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: torch.load(p, weights_only=True) for p in sorted((directory / "model").glob("*.pt"))}


def test_reshard_divided_among_three_processes(tiny_model, tmp_path):
    src = tiny_model("llama-gqa64")
    shardkit.convert(src, tmp_path / "tp4pp2", shardkit.Layout(tp=4, pp=2, qkv="gqa"))
    result = torchrun(
        3,
        "reshard",
        str(tmp_path / "tp4pp2"),
        str(tmp_path / "dist"),
        "--tp",
        "8",
        "--pp",
        "3",
        "--kv-multiplier",
        "2",
        "--hw",
        "trn2",
        "--qkv",
        "fused",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for rank, count in ((0, 8), (1, 8), (2, 8)):
        assert f"rank {rank} wrote {count} of 24 files" in result.stderr or rank == 0
    single = shardkit.reshard(
        tmp_path / "tp4pp2",
        tmp_path / "single",
        shardkit.make_layout(tp=8, pp=3, kv_multiplier=2, hw="trn2", qkv="fused"),
    )
    assert single.rank_files == 24  # the count each rank's share of the distributed run adds up to
    got, want = load_all(tmp_path / "dist"), load_all(tmp_path / "single")
    assert got.keys() == want.keys() and len(got) == 24
    for name in want:
        assert got[name].keys() == want[name].keys()
        assert all(torch.equal(got[name][k], want[name][k]) for k in want[name])
    manifest = (tmp_path / "dist" / "shardkit.json").read_text()
    assert all(f"model/{name}" in manifest for name in want)
    assert shardkit.verify(src, tmp_path / "dist").ok
    assert not [p for p in tmp_path.iterdir() if "shardkit-tmp" in p.name]


def test_merge_under_torchrun_and_failure_on_every_rank(tiny_model, tmp_path):
    src = tiny_model("llama-gqa64")
    shardkit.convert(src, tmp_path / "tp8pp2", shardkit.Layout(tp=8, pp=2, qkv="gqa"))
    ok = torchrun(2, "merge", str(tmp_path / "tp8pp2"), str(tmp_path / "merged"), "--max-shard-size", "200KB")
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert len(list((tmp_path / "merged").glob("model-*.safetensors"))) > 1
    assert shardkit.verify(src, tmp_path / "merged").ok

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep")
    bad = torchrun(2, "merge", str(tmp_path / "tp8pp2"), str(tmp_path / "taken"))
    assert bad.returncode != 0
    assert bad.stderr.count("exists and is not empty") >= 2, bad.stderr[-2000:]  # both ranks say why
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["x"]
    assert not [p for p in tmp_path.iterdir() if "shardkit-tmp" in p.name]
