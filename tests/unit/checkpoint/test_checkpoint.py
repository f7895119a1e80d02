"""Training checkpoints (shardkit.checkpoint): NxD's tree, resume into any layout, async saves,
retention, crash safety under SIGKILL, torch.distributed (gloo) jobs, bad input and the CLI.

Models are tiny fixtures; the direct conversions that loaded pieces are compared with come from
`shardkit.convert` (model) and `placements.shard` (moments). Child processes (the kill test, the
gloo job) fork from a forkserver that has torch and shardkit preloaded (tests/support/ckpt_child.py).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import socket
import time
from pathlib import Path

import ckpt_child
import pytest
import torch
from click.testing import CliRunner
from conftest import golden_or_skip
from safetensors.torch import load_file, save_file

import shardkit
from shardkit.api import export_checkpoint
from shardkit.checkpoint import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointError,
    CheckpointWriteError,
    IncompleteCheckpointError,
    NoCheckpointError,
    OptimizerState,
    Rank,
    StateMismatchError,
    finalize_checkpoint,
    has_checkpoint,
    latest,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from shardkit.checkpoint import save as ckpt_save
from shardkit.checkpoint import tree as ckpt_tree
from shardkit.cli import cli
from shardkit.errors import ConfigMismatchError, FormatError, LayoutError
from shardkit.formats import xser
from shardkit.io.safety import delete as io_delete
from shardkit.layout import Layout
from shardkit.testing import fixture_config

CONFIG = "llama-gqa64"  # 64 q heads, 8 kv heads, 5 layers: uneven stages at pp 2
TP2PP2 = Layout(tp=2, pp=2, qkv="gqa")
GROUPS = [{"lr": 0.001, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]


# ---- helpers -----------------------------------------------------------------------------------------


def write_hf(path: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    """A Hugging Face directory holding `weights` (no transformers needed)."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


def ranks_of(layout: Layout) -> list[Rank]:
    return [Rank(tp=tp, pp=pp, ep=ep) for ep, tp, pp in layout.ranks()]


def save_all_ranks(root: Path, tag: str, layout: Layout, config: dict, state: dict, step: int, **options) -> None:
    """Every rank's pieces from one process ({(tp, pp): pieces})."""
    model = {(r.tp, r.pp): ckpt_child.rank_pieces(config, layout, r, state["weight"]) for r in ranks_of(layout)}
    optim = {
        (r.tp, r.pp): OptimizerState(ckpt_child.rank_optimizer(config, layout, r, state, step), GROUPS)
        for r in ranks_of(layout)
    }
    save_checkpoint(
        root,
        tag,
        model,
        optim,
        user_content={"step": step, "data": torch.arange(3)},
        scheduler={"last_epoch": step, "_last_lr": [0.001]},
        layout=layout,
        config=config,
        **options,
    )


def assert_pieces_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def direct_rank(direct: Path, rank: Rank) -> dict[str, torch.Tensor]:
    return torch.load(
        direct / "model" / f"dp_rank_00_tp_rank_{rank.tp:02d}_pp_rank_{rank.pp:02d}.pt", weights_only=True
    )


def tree(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The fixture model's config, full state at step 100, and its HF directory."""
    config = fixture_config(CONFIG)
    state = ckpt_child.full_state(config, 100, seed=1)
    hf = write_hf(tmp_path_factory.mktemp("hf") / "hf", config, state["weight"])
    return config, state, hf


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """step_100 saved at tp2 pp2 (gqa) in each format."""
    config, state, _ = model
    roots = {}
    for fmt in ("torch", "xser", "safetensors"):
        roots[fmt] = tmp_path_factory.mktemp(f"ckpt-{fmt}")
        save_all_ranks(roots[fmt], "step_100", TP2PP2, config, state, 100, format=fmt)
    finalize_checkpoint()
    return roots


# ---- the tree (acceptance 3) ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["torch", "xser", "safetensors"])
def test_tree_is_nxds(saved, model, tmp_path, fmt):
    config, state, hf = model
    tag = saved[fmt] / "step_100"
    suffix = ".safetensors" if fmt == "safetensors" else ".pt"
    rank_files = [f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}{suffix}" for t in range(2) for p in range(2)]
    expected = {"checkpoint", "done", "config.json", "shardkit.json", "scheduler.pt", "user_content.pt"}
    optim_files = [f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt" for t in range(2) for p in range(2)]
    expected |= {f"model/{f}" for f in rank_files} | {f"optim/{f}" for f in optim_files}
    files = set(tree(tag))
    if fmt == "xser":
        for d in ("model", "optim"):
            for f in rank_files:
                expected.add(f"{d}/{f}.info.pt")
                parts = {x for x in files if x.startswith(f"{d}/{f}.tensors/")}
                assert parts and all(x.rsplit("/", 1)[1].startswith("tensor_") for x in parts)
                expected |= parts
    assert files == expected
    assert (tag / "checkpoint").read_text() == "1" and (tag / "done").read_text() == "1"

    # the model files hold exactly what a direct conversion writes, under NxD's names
    shardkit.convert(hf, tmp_path / "direct", TP2PP2, format=fmt)
    for f in rank_files:
        if fmt == "torch":
            got, want = (torch.load(p / "model" / f, weights_only=True) for p in (tag, tmp_path / "direct"))
        elif fmt == "xser":  # torch-xla's xser.load form: references resolved from <file>.tensors/
            got, want = (xser.load(p / "model" / f) for p in (tag, tmp_path / "direct"))
        else:
            got, want = (load_file(p / "model" / f) for p in (tag, tmp_path / "direct"))
        assert_pieces_equal(got, want)
    # the optimizer file is NxD's ZeRO-1 state (dp 1 here): numbered parameters in NxD's order
    optim = (xser.load if fmt == "xser" else (lambda p: torch.load(p, weights_only=True)))(
        tag / "optim" / optim_files[0]
    )
    assert list(optim) == ["state", "param_groups", "base_state", "shape_info"]
    names = list(
        torch.load(tmp_path / "direct" / "model" / f"dp_rank_00_tp_rank_00_pp_rank_00{suffix}", weights_only=True)
        if fmt == "torch"
        else got
    )
    assert list(optim["base_state"][0]) == ["step", "exp_avg", "exp_avg_sq"]
    assert (
        optim["shape_info"][0] == list(direct_rank(tmp_path / "direct", Rank()).get(names[0]).shape)
        if fmt == "torch"
        else True
    )
    # plain data loads without pickle code
    assert torch.load(tag / "scheduler.pt", weights_only=True) == {"last_epoch": 100, "_last_lr": [0.001]}
    assert torch.load(tag / "user_content.pt", weights_only=True)["step"] == 100
    manifest = json.loads((tag / "shardkit.json").read_text())
    assert manifest["layout"] == TP2PP2.to_dict() and manifest["format"] == fmt
    assert manifest["checkpoint"]["step"] == 100
    assert manifest["checkpoint"]["optimizer"]["format"] == "nxd-zero1"
    assert {e["path"] for e in manifest["files"]} == expected - {"checkpoint", "done", "shardkit.json"}
    assert shardkit.inspect(tag, check_data=True)["problems"] == []


# ---- resume into any layout (acceptance 2, in one process) ----------------------------------------------


@pytest.mark.parametrize("fmt", ["torch", "xser", "safetensors"])
def test_resume_in_other_layouts(saved, model, tmp_path, fmt):
    config, state, hf = model
    targets = [Layout(tp=4, pp=1), Layout(), Layout(tp=8, pp=3, kv_multiplier=1, qkv="fused"), TP2PP2]
    if fmt != "torch":
        targets = targets[:2]
    for layout in targets:
        direct = tmp_path / f"direct-{layout.tp}-{layout.pp}-{layout.qkv}"
        shardkit.convert(hf, direct, layout)
        for rank in ranks_of(layout):
            loaded = load_checkpoint(saved[fmt], target_layout=layout, rank=(rank.tp, rank.pp))
            assert (loaded.tag, loaded.step, loaded.layout, loaded.target_layout) == ("step_100", 100, TP2PP2, layout)
            assert_pieces_equal(loaded.model, direct_rank(direct, rank))
            want = ckpt_child.rank_optimizer(config, layout, rank, state, 100)
            assert set(loaded.optimizer.state) == set(want)
            for name, entry in want.items():
                got = loaded.optimizer.state[name]
                assert torch.equal(got["exp_avg"], entry["exp_avg"])
                assert torch.equal(got["exp_avg_sq"], entry["exp_avg_sq"])
                assert got["step"] == 100
            assert loaded.optimizer.param_groups == GROUPS
            assert loaded.scheduler["last_epoch"] == 100 and torch.equal(loaded.user_content["data"], torch.arange(3))


def test_load_reads_only_the_slices_it_needs(saved, monkeypatch):
    """tp1 -> tp2: rank 1 of tp2 pp2 at tp 4 reads only from the tp-rank-0... files it overlaps."""
    opened = []
    real_open = shardkit.formats.Checkpoint.open

    def spy(self, key):
        opened.append(key)
        return real_open(self, key)

    monkeypatch.setattr(shardkit.formats.Checkpoint, "open", spy)
    load_checkpoint(saved["torch"], target_layout=Layout(tp=4, pp=1), rank=(1, 0), optimizer=False)
    # tp-rank 1 of 4 holds the second quarter: inside tp-rank 0 of 2, on both stages
    assert set(opened) == {"model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "model/dp_rank_00_tp_rank_00_pp_rank_01.pt"}


def test_optimizer_state_from_and_to_torch(tmp_path):
    """A real AdamW's state_dict saved at tp1 is resumed by a fresh AdamW at tp2, and back."""
    config = fixture_config("llama-mha")
    full = ckpt_child.full_state(config, 0)["weight"]
    layout = Layout()
    pieces = ckpt_child.rank_pieces(config, layout, Rank(), full)
    names = list(pieces)
    params = [torch.nn.Parameter(t.clone()) for t in pieces.values()]
    opt = torch.optim.AdamW([{"params": params[:3], "weight_decay": 0.0}, {"params": params[3:]}], lr=0.01)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    save_checkpoint(
        tmp_path,
        "step_2",
        {n: p.data for n, p in zip(names, params)},
        opt.state_dict(),
        layout=layout,
        config=config,
        param_names=names,
    )
    loaded = load_checkpoint(tmp_path)
    fresh = [torch.nn.Parameter(t.clone()) for t in loaded.model.values()]
    opt2 = torch.optim.AdamW([{"params": fresh[:3], "weight_decay": 0.0}, {"params": fresh[3:]}], lr=0.5)
    opt2.load_state_dict(loaded.optimizer.to_torch(list(loaded.model)))
    a, b = opt.state_dict(), opt2.state_dict()
    assert [{k: v for k, v in g.items()} for g in a["param_groups"]] == b["param_groups"]
    for i in a["state"]:
        assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    # at tp 2 every rank gets its own slices of the same moments
    tp2 = Layout(tp=2)
    for rank in ranks_of(tp2):
        part = load_checkpoint(tmp_path, target_layout=tp2, rank=(rank.tp, rank.pp))
        sd = part.optimizer.to_torch(list(part.model))
        assert len(sd["state"]) == len(part.model) and sd["param_groups"][0]["weight_decay"] == 0.0


# ---- NxD directories arranged as a tag (acceptance 3) ----------------------------------------------------


def _copy_tree(src: Path, dst: Path) -> None:
    for path in src.rglob("*"):
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)  # content only: the golden files are read-only


def test_nxd_golden_tags_load(tmp_path):
    golden = golden_or_skip()
    root = tmp_path / "ckpt"
    for tag, case in (
        ("step_10", golden / "nxd" / "gqa-tp8-pp2-qkvlinear"),
        ("step_20", golden / "nxd-xser" / "gqa-tp8-pp2-qkvlinear"),
    ):
        _copy_tree(case / "model", root / tag / "model")
        (root / tag / "checkpoint").write_text("1")
        (root / tag / "done").write_text("1")
    hf = golden / "hf" / "llama-gqa-tiny"
    shutil.copyfile(hf / "config.json", root / "step_10" / "config.json")  # step_20: config= instead
    config = json.loads((hf / "config.json").read_text())
    infos = list_checkpoints(root)
    assert [(i.tag, i.complete, i.step, i.format, i.layout_text) for i in infos] == [
        ("step_10", True, 10, "torch", "tp8 pp2"),
        ("step_20", True, 20, "xser", "tp8 pp2"),
    ]
    gqa = Layout(tp=8, pp=2, qkv="gqa")
    full = load_file(hf / "model.safetensors")
    for tag, case in (("step_10", "nxd"), ("step_20", "nxd")):
        for rank in (Rank(tp=3, pp=0), Rank(tp=7, pp=1)):
            loaded = load_checkpoint(root, tag, target_layout=gqa, rank=rank, config=config)
            assert loaded.layout == gqa and loaded.optimizer is None and loaded.step == int(tag[5:])
            want = torch.load(
                golden
                / case
                / "gqa-tp8-pp2-qkvlinear"
                / "model"
                / f"dp_rank_00_tp_rank_{rank.tp:02d}_pp_rank_{rank.pp:02d}.pt",
                weights_only=True,
            )
            assert_pieces_equal(loaded.model, want)
        whole = load_checkpoint(root, tag, target_layout=Layout(), config=config)  # one rank: NxD names, fused MLP
        assert_pieces_equal(whole.model, ckpt_child.rank_pieces(config, Layout(), Rank(), full))
    out = export_checkpoint(root, tmp_path / "hf", "step_10")
    assert out.path == tmp_path / "hf" and shardkit.verify(hf, tmp_path / "hf").ok


# ---- async saves ---------------------------------------------------------------------------------


def test_async_save_is_a_snapshot_and_failures_surface(model, tmp_path, monkeypatch):
    config, state, _ = model
    layout = Layout(tp=2, pp=1)
    pieces = {(r.tp, r.pp): ckpt_child.rank_pieces(config, layout, r, state["weight"]) for r in ranks_of(layout)}
    want = {k: {n: t.clone() for n, t in v.items()} for k, v in pieces.items()}
    with Checkpointer(CheckpointerConfig(async_save=True, format="xser")) as ck:
        ck.save(tmp_path, "step_1", pieces, layout=layout, config=config)
        for part in pieces.values():  # training goes on at once
            for t in part.values():
                t.add_(1.0)
        ck.wait()
        for key, part in want.items():
            assert_pieces_equal(load_checkpoint(tmp_path, rank=key).model, part)

        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(ckpt_save, "write_tensor_file", broken)
        ck.save(tmp_path, "step_2", pieces, layout=layout, config=config)  # returns: the write is in the background
        with pytest.raises(CheckpointWriteError, match="(?i)step_2 failed: .*no space left"):
            ck.save(tmp_path, "step_3", pieces, layout=layout, config=config)  # the next call raises, once
        monkeypatch.undo()
        # the failed save left nothing behind (its incomplete tag was removed)
        assert [(i.tag, i.complete) for i in list_checkpoints(tmp_path)] == [("step_1", True)]
        ck.save(tmp_path, "step_3", pieces, layout=layout, config=config, num_kept=1)
        ck.wait()
    assert [(i.tag, i.complete) for i in list_checkpoints(tmp_path)] == [("step_3", True)]
    assert latest(tmp_path) == "step_3" and has_checkpoint(tmp_path)


def test_sync_failure_raises_and_retention_failure_is_only_logged(model, tmp_path, monkeypatch, caplog):
    config, state, _ = model
    pieces = ckpt_child.rank_pieces(config, Layout(), Rank(), state["weight"])
    ck = Checkpointer()

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_save, "write_tensor_file", full_disk)
    with pytest.raises(CheckpointWriteError, match="(?i)saving checkpoint step_1 failed: .*no space left"):
        ck.save(tmp_path, "step_1", pieces, layout=Layout(), config=config)
    monkeypatch.undo()
    assert list_checkpoints(tmp_path) == []  # the failed save's incomplete tag is gone

    def broken(*args, **kwargs):
        raise RuntimeError("listing failed")

    monkeypatch.setattr(ckpt_save, "plan_retention", broken)
    ck.save(tmp_path, "step_2", pieces, layout=Layout(), config=config, async_save=True, num_kept=1)
    ck.wait()  # the save itself succeeded: nothing is raised
    assert latest(tmp_path) == "step_2" and "retention" in caplog.text and "listing failed" in caplog.text
    ck.close()


# ---- retention -----------------------------------------------------------------------------------


def test_retention(model, tmp_path, monkeypatch):
    config = fixture_config("llama-mha")
    state = ckpt_child.full_state(config, 1)
    layout = Layout()
    ck = Checkpointer(CheckpointerConfig(num_kept=2, keep_every=3))

    def save(step: int) -> None:
        pieces = ckpt_child.rank_pieces(config, layout, Rank(), state["weight"])
        ck.save(tmp_path, f"step_{step}", pieces, layout=layout, config=config)
        ck.wait()

    def tags() -> list[tuple[str, bool]]:
        return [(i.tag, i.complete) for i in list_checkpoints(tmp_path)]

    for step in range(1, 8):
        save(step)
    assert tags() == [("step_3", True), ("step_6", True), ("step_7", True)]

    # an interrupted deletion leaves an incomplete tag (done goes first); a crashed save a newer one
    calls = {"n": 0}
    real_remove = io_delete._unlink_entry

    def flaky(dir_fd, name, path):
        calls["n"] += 1
        if calls["n"] == 4:
            raise OSError(5, "Input/output error")
        real_remove(dir_fd, name, path)

    monkeypatch.setattr(io_delete, "_unlink_entry", flaky)
    assert prune_checkpoints(tmp_path, num_kept=1).failed  # step_3 fails half-way, step_6 goes
    monkeypatch.undo()
    assert tags() == [("step_3", False), ("step_7", True)]
    (tmp_path / "step_99").mkdir()
    (tmp_path / "step_99" / "checkpoint").write_text("1")
    save(8)  # removes the leftover step_3, keeps the newer incomplete step_99 (a crashed save)
    assert tags() == [("step_7", True), ("step_8", True), ("step_99", False)]
    plan = prune_checkpoints(tmp_path, num_kept=1, dry_run=True)
    assert plan.remove == ["step_7"] and tags()[0] == ("step_7", True)
    ck.close()


def test_retention_never_removes_the_newest_complete(tmp_path):
    infos = [
        ckpt_tree.CheckpointInfo(f"step_{s}", tmp_path, c, s, None, None, 0, s)
        for s, c in ((1, True), (2, False), (3, True), (4, False))
    ]
    plan = ckpt_tree.plan_retention(infos, 1, None)
    assert plan.remove == ["step_1", "step_2"] and plan.keep == ["step_3", "step_4"]
    assert ckpt_tree.plan_retention(infos[:1], 1, None).remove == []
    assert ckpt_tree.plan_retention([infos[1]], 1, None).remove == []  # nothing complete: nothing goes


# ---- bad input (acceptance 4) ----------------------------------------------------------------------


def test_bad_checkpoints_fail_clearly(saved, model, tmp_path):
    config, state, _ = model
    root = tmp_path / "bad"
    shutil.copytree(saved["torch"], root)
    tag = root / "step_100"
    one_line = lambda e: "\n" not in str(e.value)  # noqa: E731

    # a missing rank file
    moved = tag / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    os.rename(moved, tmp_path / "aside.pt")
    with pytest.raises(FormatError, match=r"dp_rank_00_tp_rank_01_pp_rank_00.pt is missing") as e:
        load_checkpoint(root, target_layout=Layout(tp=4))
    assert one_line(e)
    os.rename(tmp_path / "aside.pt", moved)

    # a corrupted tensor file: bytes flipped (same size), then truncated
    data = bytearray(moved.read_bytes())
    good = bytes(data)
    data[len(data) // 2] ^= 0xFF
    moved.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="does not match its size and xxh3_128.*load an older tag"):
        load_checkpoint(root, rank=(1, 0))
    assert load_checkpoint(root, rank=(0, 0)).model  # other ranks do not read that file
    moved.write_bytes(good[:1000])
    with pytest.raises(FormatError, match="truncated"):
        load_checkpoint(root, rank=(1, 0))
    moved.write_bytes(good)

    # a config that does not match the target
    other = dict(config, intermediate_size=config["intermediate_size"] * 2)
    with pytest.raises(ConfigMismatchError, match="intermediate_size 64.*target config has 128") as e:
        load_checkpoint(root, config=other)
    assert one_line(e)
    # NxD-style tag (no manifest, no config.json): the shapes disagree with the given config
    for name in ("shardkit.json", "config.json"):
        (tag / name).unlink()
    shutil.rmtree(tag / "optim")
    with pytest.raises(ConfigMismatchError, match="embed_tokens.weight has shape .64, 128. but.*expects .128, 128."):
        load_checkpoint(root, config=dict(config, vocab_size=256))
    assert load_checkpoint(root, config=config, rank=(1, 1)).model

    # incomplete and absent tags
    (tag / "done").unlink()
    with pytest.raises(IncompleteCheckpointError, match="no done marker"):
        load_checkpoint(root, "step_100")
    with pytest.raises(NoCheckpointError, match="no complete checkpoint"):
        load_checkpoint(root)
    assert load_checkpoint(root, "latest_if_exists") is None and not has_checkpoint(root)
    with pytest.raises(NoCheckpointError, match="does not exist"):
        load_checkpoint(root, "step_7")


def test_bad_state_is_refused_before_anything_is_written(model, tmp_path):
    config, state, _ = model
    layout = Layout(tp=2, pp=1)
    pieces = ckpt_child.rank_pieces(config, layout, Rank(), state["weight"])
    root = tmp_path / "c"
    with pytest.raises(LayoutError, match="no process saves rank .tp 1, pp 0.*model_state=\\{\\(tp, pp\\)"):
        save_checkpoint(root, "step_1", pieces, layout=layout, config=config)
    wrong = dict(pieces)
    wrong.pop("model.norm.weight")
    with pytest.raises(StateMismatchError, match="lacks model.norm.weight"):
        save_checkpoint(root, "step_1", {(0, 0): wrong, (1, 0): pieces}, layout=layout, config=config)
    wrong = dict(pieces, **{"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(StateMismatchError, match="shape \\(3, 3\\)"):
        save_checkpoint(root, "step_1", {(0, 0): wrong, (1, 0): pieces}, layout=layout, config=config)
    both = {(0, 0): pieces, (1, 0): pieces}
    with pytest.raises(CheckpointError, match="user_content.*is a object"):
        save_checkpoint(root, "step_1", both, user_content={"x": object()}, layout=layout, config=config)
    with pytest.raises(StateMismatchError, match="exp_avg.*not its parameter's shape"):
        save_checkpoint(
            root,
            "step_1",
            both,
            {(0, 0): {"model.norm.weight": {"exp_avg": torch.zeros(2)}}},
            layout=layout,
            config=config,
        )
    with pytest.raises(CheckpointError, match="not a plain folder name"):
        save_checkpoint(root, "../x", both, layout=layout, config=config)
    with pytest.raises(LayoutError):
        save_checkpoint(root, "step_1", both, layout=Layout(tp=3), config=config)
    assert not root.exists()


# ---- CLI -----------------------------------------------------------------------------------------


def test_cli(saved, model, tmp_path):
    config, state, hf = model
    root = tmp_path / "c"
    shutil.copytree(saved["torch"], root)
    save_all_ranks(root, "step_200", TP2PP2, config, state, 200, format="safetensors")
    finalize_checkpoint()
    (root / "step_300").mkdir()
    (root / "step_300" / "checkpoint").write_text("1")
    runner = CliRunner()
    out = runner.invoke(cli, ["ckpt", "list", str(root)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].split()[:3] == ["tag", "state", "step"]
    assert lines[1].split()[:3] == ["step_100", "complete", "100"] and "tp2 pp2 gqa" in lines[1]
    assert "complete (latest)" in lines[2] and "safetensors" in lines[2] and "INCOMPLETE" in lines[3]
    listed = json.loads(runner.invoke(cli, ["ckpt", "list", str(root), "--json"]).output)
    assert listed["latest"] == "step_200" and [c["complete"] for c in listed["checkpoints"]] == [True, True, False]

    out = runner.invoke(cli, ["ckpt", "prune", str(root), "--keep", "1", "--dry-run"])
    assert out.exit_code == 0 and "would remove step_100" in out.output and (root / "step_100" / "done").exists()
    out = runner.invoke(cli, ["ckpt", "export", str(root), str(tmp_path / "hf"), "--tag", "step_100", "--json"])
    assert out.exit_code == 0, out.output
    assert shardkit.verify(hf, tmp_path / "hf").ok
    out = runner.invoke(cli, ["ckpt", "prune", str(root), "--keep", "1"])
    assert out.exit_code == 0 and "removed step_100" in out.output and not (root / "step_100").exists()
    out = runner.invoke(cli, ["ckpt", "export", str(root), str(tmp_path / "hf2"), "--tag", "step_300"])
    assert out.exit_code == 2 and "no done marker" in out.output and not (tmp_path / "hf2").exists()
    out = runner.invoke(cli, ["ckpt", "export", str(tmp_path / "empty"), str(tmp_path / "hf3")])
    assert out.exit_code == 2 and "does not exist" in out.output and "--checkpoint-dir" in out.output


def test_reshard_keeps_every_dimension_it_is_not_given(saved, model, tmp_path):
    """`ckpt reshard`'s flags mean the trainer's: --tp alone keeps the source's pp 2 (it was reset
    to 1) and its unsharded optimizer (ZeRO-1 was switched on), saying so in one line; --dp is the
    data-parallel degree, ZeRO-1 only when asked of a source without it (--dp alone shards nothing:
    refused), and --zero1 without a --dp the source cannot tell is refused; a ZeRO-1 result keeps
    its dp and ZeRO-1 through the next reshard."""
    config, _, hf = model
    runner = CliRunner()
    src = saved["torch"]
    out = runner.invoke(cli, ["ckpt", "reshard", str(src), str(tmp_path / "tp1"), "--tp", "1"])
    assert out.exit_code == 0, out.output
    assert "kept the source's qkv style gqa, pp 2 and no ZeRO-1" in out.stderr and "--pp" in out.stderr, out.stderr
    info = json.loads(runner.invoke(cli, ["ckpt", "inspect", str(tmp_path / "tp1"), "--json"]).output)
    assert (info["layout"]["tp"], info["layout"]["pp"], info["dp"], info["zero1"]) == (1, 2, 1, False)
    for args, phrase in (
        (["--dp", "2"], "--dp 2 shards nothing"),
        (["--zero1"], "ZeRO-1 needs --dp"),
        (["--pp", "0"], "Invalid value for '--pp'"),
    ):
        out = runner.invoke(cli, ["ckpt", "reshard", str(src), str(tmp_path / "no"), *args])
        lines = out.stderr.strip().splitlines()
        assert out.exit_code == 2 and len(lines) == 1 and phrase in lines[0], (args, out.stderr)
        assert not (tmp_path / "no").exists()
    out = runner.invoke(cli, ["ckpt", "reshard", str(src), str(tmp_path / "dp2"), "--dp", "2", "--zero1"])
    assert out.exit_code == 0, out.output
    assert "tp 2 and pp 2" in out.stderr and "dp" not in out.stderr.split("(")[0], out.stderr
    out = runner.invoke(cli, ["ckpt", "reshard", str(tmp_path / "dp2"), str(tmp_path / "pp1"), "--pp", "1"])
    assert out.exit_code == 0 and "tp 2, dp 2 and ZeRO-1" in out.stderr, out.stderr
    info = json.loads(runner.invoke(cli, ["ckpt", "inspect", str(tmp_path / "pp1"), "--json"]).output)
    assert (info["layout"]["tp"], info["layout"]["pp"], info["data_parallel"], info["zero1"]) == (2, 1, 2, True)
    assert len(list((tmp_path / "pp1" / "step_100" / "optim").glob("dp_rank_01_*.pt"))) == 2
    assert shardkit.verify(hf, export_checkpoint(tmp_path / "pp1", tmp_path / "hf").path).ok


# ---- crash safety under SIGKILL (acceptance 1) ------------------------------------------------------------


@pytest.fixture(scope="module")
def forkserver():
    """Children fork from a server that has torch and shardkit imported (milliseconds per child)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shardkit.checkpoint", "ckpt_child"])
    return ctx


def _read_log(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _wait_for(path: Path, word: str, proc, timeout: float = 60.0, after: str | None = None) -> None:
    """Wait until the child's log has a line starting with `word` (after the `after` line)."""
    deadline = time.monotonic() + timeout

    def seen() -> bool:
        lines = _read_log(path)
        if after is not None:
            starts = [n for n, line in enumerate(lines) if line.startswith(after)]
            lines = lines[starts[-1] + 1 :] if starts else []
        return any(line.startswith(word) for line in lines)

    while not seen():
        assert proc.is_alive() or seen(), f"child exited with {proc.exitcode}: {_read_log(path)[-5:]}"
        assert time.monotonic() < deadline, f"child did not log {word!r}"
        time.sleep(0.002)


def _check_invariant(root: Path, config: dict, durable: int) -> int:
    """The newest complete checkpoint is loaded, bit-exact, and is at least the newest durable step."""
    loaded = load_checkpoint(root, "latest_if_exists", target_layout=Layout())
    assert loaded is not None, "no complete checkpoint after a kill"
    assert loaded.step >= durable, f"newest complete step_{loaded.step} is older than durable step_{durable}"
    full = ckpt_child.full_state(config, loaded.step)
    assert_pieces_equal(loaded.model, ckpt_child.rank_pieces(config, Layout(), Rank(), full["weight"]))
    for name, entry in ckpt_child.rank_optimizer(config, Layout(), Rank(), full, loaded.step).items():
        for m in ckpt_child.MOMENTS:
            assert torch.equal(loaded.optimizer.state[name][m], entry[m]), f"step_{loaded.step}: {m} of {name}"
    assert loaded.user_content["step"] == loaded.step and loaded.scheduler == {"last_epoch": loaded.step}
    for info in list_checkpoints(root):  # every tag with `done` is whole
        if info.complete:
            assert load_checkpoint(root, info.tag, optimizer=False).model
    return loaded.step


@pytest.mark.slow
def test_sigkill_at_random_moments_never_loses_a_complete_checkpoint(forkserver, tmp_path):
    config = fixture_config(ckpt_child.KILL_CONFIG)
    root = tmp_path / "ckpt"
    rng = random.Random(20240611)
    kills, phases = 0, {}
    durable = 0
    formats = ["torch", "safetensors", "xser", "torch", "safetensors"]  # xser writes a file per tensor: slower
    log_path = tmp_path / "run-0.log"
    first = forkserver.Process(
        target=ckpt_child.train_until_killed, args=(str(root), str(log_path), "torch", False, 0, 3)
    )
    first.start()
    first.join(60)
    assert first.exitcode == 0, _read_log(log_path)[-5:]
    durable = _check_invariant(root, config, 3)
    targets = [None, "phase write", None, "phase marker-done", None, "phase delete", None, "phase marker-checkpoint"]
    for i in range(1, 33):
        log_path = tmp_path / f"run-{i}.log"
        proc = forkserver.Process(
            target=ckpt_child.train_until_killed,
            args=(str(root), str(log_path), formats[i % len(formats)], i % 2 == 0, i),
        )
        proc.start()
        _wait_for(log_path, "ready", proc)
        target = targets[i % len(targets)]
        if target is None:  # anywhere
            time.sleep(rng.uniform(0.0, 0.5))
        else:  # just inside a phase: a tensor write, a marker, a retention delete
            _wait_for(log_path, target, proc, after="ready")
            time.sleep(rng.uniform(0.0, 0.01))
        proc.kill()
        proc.join(30)
        assert proc.exitcode == -9
        kills += 1
        lines = _read_log(log_path)
        durable = max([durable] + [int(x.split()[1]) for x in lines if x.startswith("durable")])
        last_phase = next((x.split()[1] for x in reversed(lines) if x.startswith("phase")), "before any save")
        if last_phase.startswith("marker-"):  # killed around a marker (before or after writing it)
            last_phase = "around " + last_phase[len("marker-") :] + " marker"
        phases[last_phase] = phases.get(last_phase, 0) + 1
        _check_invariant(root, config, durable)
    # a last run to the end: retention has removed every leftover
    log_path = tmp_path / "run-final.log"
    final = forkserver.Process(
        target=ckpt_child.train_until_killed, args=(str(root), str(log_path), "torch", True, 99, 3)
    )
    final.start()
    final.join(60)
    assert final.exitcode == 0
    newest = _check_invariant(root, config, durable)
    infos = list_checkpoints(root)
    assert [i.step for i in infos] == [newest - 1, newest] and all(i.complete for i in infos)
    print(f"\n{kills} SIGKILLs; last phase before each kill: {dict(sorted(phases.items()))}")
    assert kills >= 30 and phases.get("write", 0) >= 4 and phases.get("delete", 0) >= 4
    assert phases.get("around done marker", 0) >= 4 and phases.get("around checkpoint marker", 0) >= 4


# ---- a torch.distributed job (acceptance 2) ------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_gloo_job_resumes_in_any_layout(forkserver, tmp_path):
    config = fixture_config(ckpt_child.GLOO_CONFIG)
    state = ckpt_child.full_state(config, 100, seed=1)
    hf = write_hf(tmp_path / "hf", config, state["weight"])
    direct = tmp_path / "direct"
    for name, layout in (
        ("tp2pp2", Layout(tp=2, pp=2, qkv="gqa")),
        ("tp4pp1", Layout(tp=4, pp=1)),
        ("tp1pp1", Layout()),
    ):
        shardkit.convert(hf, direct / name, layout)
    root, port = tmp_path / "ckpt", _free_port()
    procs = [
        forkserver.Process(target=ckpt_child.gloo_worker, args=(r, 4, port, str(root), str(direct))) for r in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert [(i.tag, i.complete, i.layout_text, i.format) for i in list_checkpoints(root)] == [
        ("step_100", True, "tp2 pp2 gqa dp1", "torch"),
        ("step_200", True, "tp4 pp1 dp1", "xser"),
        ("step_300", True, "tp1 pp1 dp1", "torch"),
    ]
    assert [f for f in tree(root / "step_300") if f.startswith(("model/", "optim/"))] == [
        "model/dp_rank_00_tp_rank_00_pp_rank_00.pt",
        "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt",
    ]
    manifest = json.loads((root / "step_100" / "shardkit.json").read_text())
    assert manifest["checkpoint"]["world_size"] == 4 and manifest["checkpoint"]["async"] is True
