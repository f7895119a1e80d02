"""NxD-native training checkpoints (issue 11): the reference checkpoints NxD 2.29 wrote
(../shared/golden/nxd-train) read by meaning, resharded byte-exactly, bad input refused."""

from __future__ import annotations

import json
import shutil
import stat
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import golden_or_skip
from nxd_helpers import file_hash, sha

from shardkit.checkpoint import finalize_checkpoint, load_checkpoint, save_checkpoint
from shardkit.checkpoint.reshard import reshard_training
from shardkit.cli import cli
from shardkit.layout import Layout

CASES = {
    "tp2_dp2_pp1_torch": (Layout(tp=2, qkv="gqa"), 2),
    "tp2_dp2_pp1_xser": (Layout(tp=2, qkv="gqa"), 2),
    "tp2_pp2_dp1_torch": (Layout(tp=2, pp=2, qkv="gqa"), 1),
}


def nxd() -> Path:
    root = golden_or_skip() / "nxd-train"
    if not root.is_dir():
        pytest.skip(f"NxD training reference checkpoints not found at {root}")
    return root


def writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(p.stat().st_mode | stat.S_IWUSR)
    return dst


# ---- 1. read: full weights and Adam moments equal what NxD's own load reassembled ------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_reassembles_to_nxds_logical_tensors(case):
    root = nxd()
    want = json.loads((root / f"{case}.load.json").read_text())
    loaded = load_checkpoint(
        root / case, "latest_if_exists", target_layout=Layout(qkv="gqa"), rank=(0, 0), config=root / "config.json"
    )
    assert loaded.tag == "step_3" and set(loaded.model) == set(want["params"])
    for name, entry in want["params"].items():
        weight, state = loaded.model[name], loaded.optimizer.state[name]
        for what, tensor in (("weight", weight), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            assert list(tensor.shape) == entry[what]["shape"], (name, what)
            assert sha(tensor) == entry[what]["sha256"], (name, what)
        assert float(state["step"]) == entry["step"]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in loaded.optimizer.param_groups]
    assert json.loads(json.dumps(hyper)) == want["param_groups"]
    assert loaded.scheduler == want["scheduler_state"] and loaded.user_content == want["user_content"]


def test_every_rank_of_the_source_layout_reads_its_own_shards():
    """Each (tp, pp) rank of tp2 pp2 gets its tp-local pieces: the model file's tensors exactly."""
    root = nxd()
    case = root / "tp2_pp2_dp1_torch"
    for tp in range(2):
        for pp in range(2):
            loaded = load_checkpoint(case, "step_3", rank=(tp, pp), config=root / "config.json")
            on_disk = torch.load(
                case / f"step_3/model/dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt", weights_only=True
            )
            assert list(loaded.model) == list(on_disk)
            assert all(torch.equal(loaded.model[n], on_disk[n]) for n in on_disk)
            optim = torch.load(
                case / f"step_3/optim/dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt", weights_only=True
            )
            for idx, name in enumerate(n for g in [0, 1] for n in loaded.model if loaded.optimizer.groups[n] == g):
                assert torch.equal(loaded.optimizer.state[name]["exp_avg"], optim["base_state"][idx]["exp_avg"])


# ---- 2. reshard: round trips are byte-equal ----------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "mid", [(Layout(qkv="gqa"), 1), (Layout(tp=2, pp=2, qkv="gqa"), 2)], ids=["tp1pp1dp1", "tp2pp2dp2"]
)
def test_reshard_round_trip_is_byte_equal(case, mid, tmp_path):
    root = nxd()
    layout, dp = CASES[case]
    there, back = tmp_path / "there", tmp_path / "back"
    reshard_training(root / case, there, mid[0], dp=mid[1], config=root / "config.json")
    assert (there / "step_3" / "done").is_file()
    if mid[1] > 1:
        assert (there / "step_3/optim/dp_rank_01_tp_rank_01_pp_rank_01.pt").is_file()
    reshard_training(there, back, layout, dp=dp)
    orig = root / case / "step_3"
    files = [f for f in orig.rglob("*") if f.is_file()]
    assert files
    for f in files:
        assert file_hash(back / "step_3" / f.relative_to(orig)) == file_hash(f), f.relative_to(orig)


def test_reshard_reads_each_piece_once_for_every_dp_file(tmp_path, monkeypatch):
    """Into dp 4, the 4 optimizer files of a rank are written together a tensor at a time: each
    moment piece is read once (not once per dp file), and the files are still NxD's bytes."""
    from shardkit.formats import SourceReader

    root = nxd()
    reads: list[str] = []
    read_piece = SourceReader.read_piece

    def counted(self, piece, *args, **kwargs):
        reads.append(piece.name)
        return read_piece(self, piece, *args, **kwargs)

    monkeypatch.setattr(SourceReader, "read_piece", counted)
    out = reshard_training(
        root / "tp2_dp2_pp1_torch", tmp_path / "dp4", Layout(tp=2, qkv="gqa"), dp=4, config=root / "config.json"
    )
    monkeypatch.undo()
    assert len(list((out / "optim").glob("dp_rank_03_*.pt"))) == 2
    moments = Counter(r for r in reads if "::" in r)
    assert moments and set(Counter(reads).values()) == {2}  # once per tp rank, not per dp file
    reshard_training(tmp_path / "dp4", tmp_path / "back", Layout(tp=2, qkv="gqa"), dp=2)
    for f in (root / "tp2_dp2_pp1_torch" / "step_3" / "optim").iterdir():
        assert file_hash(tmp_path / "back" / "step_3" / "optim" / f.name) == file_hash(f), f.name


def test_model_files_are_written_by_the_engine(tmp_path, monkeypatch):
    """`ckpt reshard` writes the model files through the engine (`engine.executor`), the optimizer
    files beside them: into dp 1 at the same tp, every model piece moves unchanged and is copied
    by the kernel (the engine's way; nothing else copies), and both kinds are NxD's bytes."""
    from shardkit.formats.torch_io import TorchWriter

    root = nxd()
    copied: list[str] = []
    write_copy = TorchWriter.write_copy

    def counted(self, name, ranges):
        copied.append(self.path.parent.name)
        return write_copy(self, name, ranges)

    monkeypatch.setattr(TorchWriter, "write_copy", counted)
    src = root / "tp2_dp2_pp1_torch"
    out = reshard_training(src, tmp_path / "dp1", Layout(tp=2, qkv="gqa"), dp=1, config=root / "config.json")
    monkeypatch.undo()
    assert copied and set(copied) == {"model"}
    for f in (src / "step_3" / "model").iterdir():
        assert file_hash(out / "model" / f.name) == file_hash(f), f.name
    reshard_training(tmp_path / "dp1", tmp_path / "back", Layout(tp=2, qkv="gqa"), dp=2)
    for f in (src / "step_3").rglob("*.pt"):
        assert file_hash(tmp_path / "back/step_3" / f.relative_to(src / "step_3")) == file_hash(f), f


@pytest.mark.parametrize("case", ["tp2_dp2_pp1_torch", "tp2_dp2_pp1_xser"])
def test_round_trip_through_torchs_own_writer_is_byte_equal(case, tmp_path, monkeypatch):
    """Where shardkit's zip writer stands aside (archives of 4 GiB or more, or a torch whose bytes
    it does not match; forced here), NxD's files, whose zip records are named after the file, are
    written by torch's writer of the path: model files (the engine's) and optimizer files alike
    are still NxD's bytes."""
    from shardkit.formats import torch_io

    root = nxd()
    monkeypatch.setattr(torch_io, "native_writer", lambda records, bound: False)
    reshard_training(root / case, tmp_path / "tp1", Layout(qkv="gqa"), dp=1, config=root / "config.json")
    reshard_training(tmp_path / "tp1", tmp_path / "back", Layout(tp=2, qkv="gqa"), dp=2)
    orig = root / case / "step_3"
    for f in [f for f in orig.rglob("*") if f.is_file()]:
        assert file_hash(tmp_path / "back/step_3" / f.relative_to(orig)) == file_hash(f), f.relative_to(orig)


def test_tp4_kv_multiplier_2_round_trip(tmp_path):
    """tp4 with kv-multiplier 2 (the reference's vocab 90 does not split over tp 4: a vocab-96
    copy of its model, written by shardkit as NxD's trainer would at tp2 dp2)."""
    root = nxd()
    cfg = json.loads((root / "config.json").read_text()) | {"vocab_size": 96}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    import ckpt_child

    from shardkit.checkpoint import OptimizerState, Rank
    from shardkit.families import family_for
    from shardkit.layout import ModelDims

    family, dims = family_for(cfg), ModelDims.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    full = {
        m: {n: torch.randn(s, generator=gen).abs() for n, s in family.full_shapes(dims).items()}
        for m in ("weight", "exp_avg", "exp_avg_sq")
    }
    full["weight"] = {n: t.to(torch.bfloat16) for n, t in full["weight"].items()}
    tp2 = Layout(tp=2, qkv="gqa")
    ranks = [Rank(tp=t) for t in range(2)]
    groups = [
        {"lr": 0.001, "betas": [0.9, 0.95], "weight_decay": 0.01},
        {"lr": 0.001, "betas": [0.9, 0.95], "weight_decay": 0.0},
    ]

    def grouped(r):
        state = ckpt_child.rank_optimizer(cfg, tp2, r, full, 7)
        return OptimizerState(state, groups, {n: int("norm" in n) for n in state})

    save_checkpoint(
        tmp_path / "ref1",
        "step_7",
        {(r.tp, r.pp): ckpt_child.rank_pieces(cfg, tp2, r, full["weight"]) for r in ranks},
        {(r.tp, r.pp): grouped(r) for r in ranks},
        layout=tp2,
        config=cfg,
    )
    finalize_checkpoint()
    reshard_training(tmp_path / "ref1", tmp_path / "ref", tp2, dp=2, zero1=True)  # ref1 was saved without ZeRO-1
    reshard_training(tmp_path / "ref", tmp_path / "kv", Layout(tp=4, kv_multiplier=2, qkv="gqa"), dp=1)
    reshard_training(tmp_path / "kv", tmp_path / "back", tp2, dp=2)
    orig = tmp_path / "ref" / "step_7"
    for f in (x for x in orig.rglob("*") if x.is_file() and x.name != "shardkit.json"):
        assert file_hash(tmp_path / "back/step_7" / f.relative_to(orig)) == file_hash(f), f.relative_to(orig)
    k = torch.load(tmp_path / "kv/step_7/model/dp_rank_00_tp_rank_01_pp_rank_00.pt", weights_only=True)
    assert k["model.layers.0.self_attn.qkv_proj.weight_k"].shape == (8, 32)  # one (replicated) kv head per rank


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------------


def _run_reshard(src: Path, dst: Path, cfg: Path):
    return CliRunner().invoke(cli, ["ckpt", "reshard", str(src), str(dst), "--config", str(cfg), "--tp", "1"])


@pytest.mark.parametrize("damage", ["shape_info", "missing_dp_shard", "step"])
def test_bad_input_is_one_line_exit_2_nothing_written(damage, tmp_path):
    root = nxd()
    src = writable_copy(root / "tp2_dp2_pp1_torch", tmp_path / "src")
    victim = src / "step_3/optim/dp_rank_01_tp_rank_01_pp_rank_00.pt"
    if damage == "missing_dp_shard":
        victim.unlink()
    else:
        obj = torch.load(victim, weights_only=True)
        if damage == "shape_info":
            obj["shape_info"][4] = [32, 8]
        else:
            obj["base_state"][5]["step"] = torch.tensor(2.0)
        torch.save(obj, str(victim))
    out = tmp_path / "out"
    result = _run_reshard(src, out, root / "config.json")
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.strip().splitlines() if x]
    assert len(lines) == 1 and "dp_rank_01_tp_rank_01_pp_rank_00.pt" in lines[0], result.output
    assert {"shape_info": "shape_info", "missing_dp_shard": "missing", "step": "steps"}[damage] in lines[0]
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


def test_cli_reshard_and_inspect(tmp_path):
    root = nxd()
    result = _run_reshard(root / "tp2_dp2_pp1_xser", tmp_path / "out", root / "config.json")
    assert result.exit_code == 0, result.output
    assert "kept the source's qkv style gqa" in result.stderr
    result = CliRunner().invoke(cli, ["ckpt", "inspect", str(tmp_path / "out"), "--json"])
    info = json.loads(result.output)
    # --tp 1 alone: dp (2, ZeRO-1) and pp are the source's, as in a resume of the trainer
    assert (info["layout"]["tp"], info["dp"], info["format"], info["step"], info["master_weights"]) == (
        1,
        2,
        "xser",
        3.0,
        False,
    )
    assert [len(g["parameters_on_tp0_pp0"]) for g in info["param_groups"]] == [14, 5]


def test_cli_reshard_qkv_style_is_the_sources_unless_asked(tmp_path):
    """`ckpt reshard` takes the layout options of `shardkit reshard` (one declaration): without
    --qkv the source's style is kept (and said), --qkv / NxD's --fuse-qkv change it."""
    root = nxd()
    src, cfg = root / "tp2_pp2_dp1_torch", str(root / "config.json")
    runs = {"kept": [], "fused": ["--qkv", "fused"], "nxd-flag": ["--qkv-linear", "--fuse-qkv"]}
    for name, extra in runs.items():
        result = CliRunner().invoke(
            cli, ["ckpt", "reshard", str(src), str(tmp_path / name), "--config", cfg, "--tp", "2", *extra]
        )
        assert result.exit_code == 0, result.output
        assert ("kept the source's qkv style" in result.stderr) == (name == "kept")
        keys = torch.load(tmp_path / name / "step_3/model/dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
        suffix = "weight_q" if name == "kept" else "weight_qkv"
        assert f"model.layers.0.self_attn.qkv_proj.{suffix}" in keys, sorted(keys)[:8]


# ---- generic use: any state dict, no layout or config -------------------------------------------------


def test_generic_save_load_without_layout(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    net(torch.randn(2, 4)).sum().backward()
    opt.step()
    sched = {"last_epoch": 1}
    for step in (1, 2, 3, 4):
        save_checkpoint(
            tmp_path,
            f"step_{step}",
            net.state_dict(),
            opt.state_dict(),
            sched,
            {"total_steps": step},
            async_save=True,
            num_kept=3,
        )
    finalize_checkpoint()
    loaded = load_checkpoint(tmp_path, "latest_if_exists")
    assert loaded.tag == "step_4" and loaded.user_content == {"total_steps": 4} and loaded.scheduler == sched
    assert list(loaded.model) == list(net.state_dict())
    assert all(torch.equal(loaded.model[k], v) for k, v in net.state_dict().items())
    want = opt.state_dict()
    assert loaded.optimizer["param_groups"] == want["param_groups"]
    for i, entry in want["state"].items():
        assert all(torch.equal(loaded.optimizer["state"][i][k], v) for k, v in entry.items())
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["step_2", "step_3", "step_4"]


# ---- ckpt reshard under torchrun -------------------------------------------------------------------------


def test_ckpt_reshard_under_torchrun_equals_one_process(tmp_path):
    """`shardkit ckpt reshard` in a 2-process gloo job (torchrun) divides the target (tp, pp) ranks
    between the processes; the result is byte for byte the one-process result (manifest included)."""
    import os
    import subprocess
    import sys

    root = nxd()
    src = root / "tp2_pp2_dp1_torch"
    args = [
        "ckpt",
        "reshard",
        str(src),
        str(tmp_path / "dist"),
        "--config",
        str(root / "config.json"),
        "--tp",
        "2",
        "--pp",
        "1",
        "--dp",
        "2",
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(Path(__file__).resolve().parents[3]) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "shardkit",
            "-v",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "joined a job of 2 processes" in done.stderr
    reshard_training(src, tmp_path / "single", Layout(tp=2, qkv="gqa"), dp=2, config=root / "config.json")
    dist, single = tmp_path / "dist" / "step_3", tmp_path / "single" / "step_3"
    files = sorted(f.relative_to(single) for f in single.rglob("*") if f.is_file())
    assert files == sorted(f.relative_to(dist) for f in dist.rglob("*") if f.is_file())
    assert len([f for f in files if f.parts[0] == "optim"]) == 4
    for f in files:
        assert file_hash(dist / f) == file_hash(single / f), f
    assert not [p for p in tmp_path.iterdir() if "shardkit-tmp" in p.name]
