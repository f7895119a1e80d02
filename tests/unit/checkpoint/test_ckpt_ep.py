"""Expert parallelism in `shardkit ckpt reshard` (and `shardkit reshard`): `--ep`, and the source's
ep kept when it is not given, with a line saying so (an ep2 checkpoint was written as ep1, silently).

The source is a real ep2 checkpoint: the trainer's tiny Mixtral (4 experts) at ep2 on 2 processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from trainer_helpers import check_ok, corpus_tokens, run_ranks

from shardkit.cli import cli
from shardkit.testing import fixture_config, make_tiny_model

FILES = [f"{kind}/dp_rank_00_ep_rank_0{e}_tp_rank_00_pp_rank_00.pt" for kind in ("model", "optim") for e in (0, 1)]


def run(*args: object):
    return CliRunner().invoke(cli, [*map(str, args)], catch_exceptions=False)


def ok(result) -> str:
    assert result.exit_code == 0, (result.output, result.stderr)
    return result.output


def layout_of(ckpt: Path) -> dict:
    return json.loads(ok(run("ckpt", "inspect", ckpt, "--json")))["layout"]


@pytest.fixture(scope="module")
def ep2(tmp_path_factory) -> Path:
    """The checkpoint directory of 2 steps of a tiny Mixtral trained at ep2."""
    work = tmp_path_factory.mktemp("ckpt-ep")
    model = make_tiny_model(fixture_config("mixtral-tiny"), work / "hf", seed=3)
    tokens = corpus_tokens(work / "tokens.bin", vocab=64)
    check_ok(
        run_ranks(
            2,
            [
                "--model",
                str(model),
                "--data",
                str(tokens),
                "--seq-len",
                "32",
                "--global-batch",
                "4",
                "--steps",
                "2",
                "--dtype",
                "fp32",
                "--no-progress",
                "--threads",
                "1",
                "--ep",
                "2",
                "--checkpoint-dir",
                str(work / "ckpt"),
            ],
        )
    )
    assert layout_of(work / "ckpt")["ep"] == 2
    return work / "ckpt"


def test_reshard_without_ep_keeps_the_sources_ep_and_says_so(ep2, tmp_path):
    result = run("ckpt", "reshard", ep2, tmp_path / "tp2", "--tp", "2")
    ok(result)
    assert "kept the source's ep 2" in result.stderr and "--ep" in result.stderr, result.stderr
    assert "pp 1, dp 2 and no ZeRO-1" in result.stderr, result.stderr  # the trainer's run: dp 2, no ZeRO-1
    assert layout_of(tmp_path / "tp2")["ep"] == 2 and layout_of(tmp_path / "tp2")["tp"] == 2
    assert "ep 2" in ok(run("ckpt", "inspect", tmp_path / "tp2"))
    optim = sorted(p.name for p in (tmp_path / "tp2" / "step_2" / "optim").iterdir())
    assert optim == [f"dp_rank_00_ep_rank_0{e}_tp_rank_0{t}_pp_rank_00.pt" for e in (0, 1) for t in (0, 1)]
    ok(run("ckpt", "export", ep2, tmp_path / "a"))
    ok(run("ckpt", "export", tmp_path / "tp2", tmp_path / "b"))
    ok(run("verify", tmp_path / "a", tmp_path / "b"))


def test_ep_1_then_back_to_ep_2(ep2, tmp_path):
    """--ep 1 puts every expert in one rank file and exports the same weights; --ep 2 from there
    gives the trainer's optimizer files back byte for byte."""
    result = run("ckpt", "reshard", ep2, tmp_path / "ep1", "--ep", "1")
    ok(result)
    assert "kept the source's ep" not in result.stderr
    assert layout_of(tmp_path / "ep1")["ep"] == 1
    assert sorted(p.name for p in (tmp_path / "ep1" / "step_2" / "model").iterdir()) == [
        "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    ]
    ok(run("ckpt", "export", ep2, tmp_path / "a"))
    ok(run("ckpt", "export", tmp_path / "ep1", tmp_path / "b"))
    ok(run("verify", tmp_path / "a", tmp_path / "b"))
    ok(run("ckpt", "reshard", tmp_path / "ep1", tmp_path / "back", "--ep", "2"))
    for name in FILES[2:]:  # the model files' bytes differ only in the zip's folder name (torch.save's)
        assert (ep2 / "step_2" / name).read_bytes() == (tmp_path / "back" / "step_2" / name).read_bytes(), name
    ok(run("ckpt", "export", tmp_path / "back", tmp_path / "c"))
    ok(run("verify", tmp_path / "a", tmp_path / "c"))


def test_plain_reshard_keeps_the_sources_ep_too(ep2, tmp_path):
    result = run("reshard", ep2 / "step_2", tmp_path / "shards", "--tp", "2")
    ok(result)
    assert "kept the source's ep 2" in result.stderr
    assert json.loads(ok(run("inspect", tmp_path / "shards", "--json")))["layout"]["ep"] == 2


def test_dp_counts_every_data_parallel_rank_as_the_trainers_does(ep2, tmp_path):
    """--dp is the trainer's: all data-parallel ranks, the ep ranks carved out of them. At ep 2,
    --dp 4 --zero1 writes 2 optimizer shards per ep rank (the trainer's --dp 4 --ep 2 --zero1
    files); --zero1 alone keeps the source's dp 2 (1 shard per ep rank); --ep 1 --zero1 puts that
    dp 2 in 2 shards; a dp that ep does not divide, and a --dp that would shard nothing, are one line."""
    ok(run("ckpt", "reshard", ep2, tmp_path / "dp4", "--dp", "4", "--zero1"))
    optim = sorted(p.name for p in (tmp_path / "dp4" / "step_2" / "optim").iterdir())
    assert optim == [f"dp_rank_0{d}_ep_rank_0{e}_tp_rank_00_pp_rank_00.pt" for d in (0, 1) for e in (0, 1)]
    assert "dp 4 (ZeRO-1, 2 shards per ep rank)" in ok(run("ckpt", "inspect", tmp_path / "dp4"))
    assert json.loads(ok(run("ckpt", "inspect", tmp_path / "dp4", "--json")))["data_parallel"] == 4
    result = run("ckpt", "reshard", tmp_path / "dp4", tmp_path / "again", "--tp", "2")
    assert "dp 4 and ZeRO-1" in ok(result), result.stderr  # kept, as the trainer keeps what it is not told
    assert len(list((tmp_path / "again" / "step_2" / "optim").iterdir())) == 8  # 2 ep x 2 tp x 2 shards
    ok(run("ckpt", "reshard", ep2, tmp_path / "kept", "--zero1"))
    assert sorted(p.name for p in (tmp_path / "kept" / "step_2" / "optim").iterdir()) == [f[6:] for f in FILES[2:]]
    ok(run("ckpt", "reshard", ep2, tmp_path / "ep1", "--ep", "1", "--zero1"))
    assert sorted(p.name for p in (tmp_path / "ep1" / "step_2" / "optim").iterdir()) == [
        f"dp_rank_0{d}_tp_rank_00_pp_rank_00.pt" for d in (0, 1)
    ]
    for args, phrase in (
        (["--dp", "3", "--zero1"], "--dp 3 is not a multiple of ep 2"),
        (["--dp", "4"], "--dp 4 shards nothing"),
        (["--ep", "4", "--zero1"], "the source's dp 2 is not a multiple of ep 4"),
    ):
        result = run("ckpt", "reshard", ep2, tmp_path / "refused", *args)
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and phrase in lines[0], (args, result.stderr)
        assert not (tmp_path / "refused").exists()
