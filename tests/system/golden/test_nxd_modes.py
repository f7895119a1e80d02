"""NxD's other save modes (issue "Interop beyond NxD's default save", part 1).

avoid-lp: the reference checkpoint NxD 2.29 saved with `avoid_saving_lower_precision_weights`
(../shared/golden/nxd-train/tp2_dp2_pp1_xser_avoidlp: xser model files without tensor files, the
weights in the ZeRO-1 master weights) is read, inspected, exported and resharded without a
manifest or hints; every logical tensor equals what NxD's own `load_checkpoint` reassembled
(`*.load.json`: sha256 of the raw bytes), in any other layout too, and the way back gives NxD's
files byte for byte.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import golden_or_skip
from nxd_helpers import _flat, file_hash, sha

from shardkit.checkpoint import load_checkpoint
from shardkit.checkpoint.reshard import reshard_training
from shardkit.cli import cli
from shardkit.errors import FormatError
from shardkit.layout import Layout

AVOID = "tp2_dp2_pp1_xser_avoidlp"


def nxd() -> Path:
    root = golden_or_skip() / "nxd-train"
    if not (root / AVOID).is_dir():
        pytest.skip(f"NxD's avoid-lp reference checkpoint not found at {root / AVOID}")
    return root


def logical_matches(tag_root: Path, want: dict, config: Path | None = None) -> None:
    """Every parameter's full weight, exp_avg, exp_avg_sq and step, reassembled by shardkit from
    `tag_root` (its newest tag, any layout), equals NxD's `load_checkpoint` description."""
    loaded = load_checkpoint(tag_root, None, target_layout=Layout(qkv="gqa"), rank=(0, 0), config=config)
    assert set(loaded.model) == set(want["params"])
    for name, entry in want["params"].items():
        state = loaded.optimizer.state[name]
        for what, tensor in (
            ("weight", loaded.model[name]),
            ("exp_avg", state["exp_avg"]),
            ("exp_avg_sq", state["exp_avg_sq"]),
        ):
            assert list(tensor.shape) == entry[what]["shape"], (name, what)
            assert sha(tensor) == entry[what]["sha256"], (name, what)
        assert float(state["step"]) == entry["step"]


# ---- avoid-lp -----------------------------------------------------------------------------------------


def test_avoid_lp_reference_reads_without_hints_and_inspects():
    root = nxd()
    want = json.loads((root / f"{AVOID}.load.json").read_text())
    logical_matches(root / AVOID, want, root / "config.json")
    result = CliRunner().invoke(
        cli, ["ckpt", "inspect", str(root / AVOID), "--config", str(root / "config.json"), "--json"]
    )
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert (info["nxd_mode"], info["model_has_data"], info["master_weights"], info["dp"]) == (
        "avoid-lp",
        False,
        True,
        2,
    )
    text = CliRunner().invoke(cli, ["ckpt", "inspect", str(root / AVOID), "--config", str(root / "config.json")])
    assert "saved as NxD's avoid-lp" in text.output


@pytest.mark.parametrize(
    "mid", [(Layout(qkv="gqa", pp=2), 3), (Layout(tp=2, pp=2, qkv="fused"), 1)], ids=["tp1pp2dp3", "tp2pp2dp1-fused"]
)
def test_avoid_lp_reshard_to_another_layout_and_back(mid, tmp_path):
    """Into another tp / pp / dp (and qkv style): the same logical weights and moments as NxD
    reassembled; the model files there again hold no data (the source's mode is kept); and back
    to tp2 dp2: NxD's own files, byte for byte."""
    root = nxd()
    want = json.loads((root / f"{AVOID}.load.json").read_text())
    there = reshard_training(root / AVOID, tmp_path / "there", mid[0], dp=mid[1], config=root / "config.json")
    assert not list((there / "model").glob("*.tensors")) and list((there / "model").glob("*.info.pt"))
    logical_matches(there.parent, want)
    back = reshard_training(there.parent, tmp_path / "back", Layout(tp=2, qkv="gqa"), dp=2)
    orig = root / AVOID / "step_3"
    files = [f for f in orig.rglob("*") if f.is_file()]
    assert len(files) > 80
    for f in files:
        assert file_hash(back / f.relative_to(orig)) == file_hash(f), f.relative_to(orig)


def test_avoid_lp_to_default_and_back_by_flag(tmp_path):
    """--nxd-mode default writes the weights (the masters in bf16) into the model files; from
    there --nxd-mode avoid-lp leaves them out again: NxD's files byte for byte."""
    root = nxd()
    cfg = str(root / "config.json")
    run = CliRunner().invoke(
        cli,
        [
            "ckpt",
            "reshard",
            str(root / AVOID),
            str(tmp_path / "full"),
            "--config",
            cfg,
            "--tp",
            "2",
            "--dp",
            "2",
            "--nxd-mode",
            "default",
        ],
    )
    assert run.exit_code == 0, run.output
    full = tmp_path / "full/step_3"
    assert len(list((full / "model/dp_rank_00_tp_rank_00_pp_rank_00.pt.tensors").iterdir())) == 19
    want = json.loads((root / f"{AVOID}.load.json").read_text())
    logical_matches(tmp_path / "full", want)
    run = CliRunner().invoke(
        cli,
        [
            "ckpt",
            "reshard",
            str(tmp_path / "full"),
            str(tmp_path / "bare"),
            "--tp",
            "2",
            "--dp",
            "2",
            "--nxd-mode",
            "avoid-lp",
        ],
    )
    assert run.exit_code == 0, run.output
    orig = root / AVOID / "step_3"
    for f in (x for x in orig.rglob("*") if x.is_file()):
        assert file_hash(tmp_path / "bare/step_3" / f.relative_to(orig)) == file_hash(f), f.relative_to(orig)


def test_avoid_lp_export_is_the_master_weights(tmp_path):
    """`ckpt export` of the avoid-lp tag: a Hugging Face folder whose tensors are the logical
    weights NxD reassembled (gate_up split into gate and up)."""
    from safetensors.torch import load_file

    root = nxd()
    want = json.loads((root / f"{AVOID}.load.json").read_text())["params"]
    run = CliRunner().invoke(
        cli, ["ckpt", "export", str(root / AVOID), str(tmp_path / "hf"), "--config", str(root / "config.json")]
    )
    assert run.exit_code == 0, run.output
    hf = load_file(str(tmp_path / "hf/model.safetensors"))
    renames = {
        "qkv_proj.weight_q": "q_proj.weight",
        "qkv_proj.weight_k": "k_proj.weight",
        "qkv_proj.weight_v": "v_proj.weight",
    }
    for name, entry in want.items():
        if "gate_up_proj" in name:
            tensor = torch.cat(
                [hf[name.replace("gate_up_proj", "gate_proj")], hf[name.replace("gate_up_proj", "up_proj")]]
            )
        else:
            tensor = hf[next((name.replace(a, b) for a, b in renames.items() if a in name), name)]
        assert sha(tensor) == entry["weight"]["sha256"], name


def _empty_tensor_folders(tag: Path) -> int:
    """An empty `<model file>.tensors` folder beside every xser model file, as NxD's avoid-lp save
    leaves them at pp > 1."""
    count = 0
    for ref in (tag / "model").glob("*.pt.info.pt"):
        Path(str(ref)[: -len(".info.pt")] + ".tensors").mkdir(exist_ok=True)
        count += 1
    return count


def test_avoid_lp_with_empty_tensor_folders_is_read_from_the_master_weights(tmp_path):
    """NxD's avoid-lp save may leave an empty `.tensors` folder per model file (it does at pp > 1):
    the mode is told by the tensor files being absent and the masters present, whether or not
    the folder is there; inspected, loaded and resharded as without the folders."""
    root = nxd()
    cfg = root / "config.json"
    want = json.loads((root / f"{AVOID}.load.json").read_text())
    pp2 = reshard_training(root / AVOID, tmp_path / "pp2", Layout(qkv="gqa", pp=2), dp=2, config=cfg)
    src = tmp_path / "tp2"
    shutil.copytree(root / AVOID, src)
    for tag in (pp2, src / "step_3"):
        assert _empty_tensor_folders(tag) == len(list((tag / "model").glob("*.pt.info.pt"))) >= 2
        logical_matches(tag.parent, want, cfg)
        run = CliRunner().invoke(cli, ["ckpt", "inspect", str(tag.parent), "--config", str(cfg), "--json"])
        assert run.exit_code == 0, run.output
        assert json.loads(run.output)["nxd_mode"] == "avoid-lp"
    out = tmp_path / "out"
    run = CliRunner().invoke(
        cli, ["ckpt", "reshard", str(src), str(out), "--config", str(cfg), "--tp", "1", "--dp", "1"]
    )
    assert run.exit_code == 0, run.output
    logical_matches(out, want)


def test_empty_tensor_folders_without_master_weights_are_one_line(tmp_path):
    """An xser checkpoint whose tensor files are gone (their folders empty) and whose optimizer
    files hold no master weights holds no weights: said in one line, nothing written."""
    root = nxd()
    src = tmp_path / "src"
    shutil.copytree(root / "tp2_dp2_pp1_xser", src)
    for folder in (src / "step_3" / "model").glob("*.tensors"):
        shutil.rmtree(folder)
        folder.mkdir()
    run = CliRunner().invoke(
        cli,
        [
            "ckpt",
            "reshard",
            str(src),
            str(tmp_path / "out"),
            "--config",
            str(root / "config.json"),
            "--tp",
            "1",
            "--qkv",
            "gqa",
        ],
    )
    assert run.exit_code == 2 and len(run.output.strip().splitlines()) == 1, run.output
    assert "no master weights" in run.output and not (tmp_path / "out").exists()
    with pytest.raises(FormatError, match="no master weights") as e:
        load_checkpoint(src, "step_3", target_layout=Layout(qkv="gqa"), rank=(0, 0), config=root / "config.json")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("ask", [["--format", "torch"], ["--master-weights", "drop"]])
def test_avoid_lp_needs_xser_and_master_weights(ask, tmp_path):
    root = nxd()
    run = CliRunner().invoke(
        cli,
        [
            "ckpt",
            "reshard",
            str(root / AVOID),
            str(tmp_path / "out"),
            "--config",
            str(root / "config.json"),
            "--qkv",
            "gqa",
            "--nxd-mode",
            "avoid-lp",
            *ask,
        ],
    )
    assert run.exit_code == 2 and len(run.output.strip().splitlines()) == 1, run.output
    assert ("xser" if ask[0] == "--format" else "master weights") in run.output
    assert not (tmp_path / "out").exists()


def test_avoid_lp_kv_replication_is_read_from_the_master_weights(tmp_path):
    """kv-multiplier 2 with blocked (trn2) replication, saved avoid-lp and stripped of shardkit's
    manifest and config: the model files hold no data to tell the replication order from, so it
    is read from the master weights (every copy of a kv head agrees only under the right one)."""
    root = nxd()
    want = json.loads((root / f"{AVOID}.load.json").read_text())
    layout = Layout(tp=2, kv_multiplier=2, kv_replication="blocked", qkv="gqa")
    tag = reshard_training(root / AVOID, tmp_path / "kv", layout, dp=2, config=root / "config.json")
    (tag / "shardkit.json").unlink()
    (tag / "config.json").unlink()
    from shardkit.checkpoint.nxd_modes import open_model

    assert open_model(tag, root / "config.json").layout == layout
    logical_matches(tag.parent, want, root / "config.json")


# ---- zero1-dcp ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero1_dcp(tmp_path_factory):
    """A tp2 dp2 training checkpoint with one param group (as NxD's DCP code needs) in NxD's
    default format (`default/`, written by shardkit, byte-equal to NxD's own format), and the same
    state as NxD's zero1-dcp save leaves it (`dcp/`: model files kept, the optimizer through
    torch's DCP as NxD wraps it, see tests/support/nxd_dcp.py; no shardkit manifest or config)."""
    import shutil
    import subprocess
    import sys

    import ckpt_child

    from shardkit.checkpoint import OptimizerState, Rank, finalize_checkpoint, save_checkpoint

    root = nxd()
    out = tmp_path_factory.mktemp("zero1-dcp")
    cfg = json.loads((root / "config.json").read_text())
    full = ckpt_child.full_state(cfg, 5)
    full["weight"] = {n: t.to(torch.bfloat16) for n, t in full["weight"].items()}
    tp2, ranks = Layout(tp=2, qkv="gqa"), [Rank(tp=0), Rank(tp=1)]
    group = [{"lr": 0.001, "betas": [0.9, 0.95], "weight_decay": 0.01, "eps": 1e-8}]

    def state(r):
        moments = ckpt_child.rank_optimizer(cfg, tp2, r, full, 5)
        return OptimizerState(moments, group, {n: 0 for n in moments})

    save_checkpoint(
        out / "one",
        "step_5",
        {(r.tp, r.pp): ckpt_child.rank_pieces(cfg, tp2, r, full["weight"]) for r in ranks},
        {(r.tp, r.pp): state(r) for r in ranks},
        layout=tp2,
        config=cfg,
    )
    finalize_checkpoint()
    reshard_training(out / "one", out / "default", tp2, dp=2, zero1=True)  # "one" was saved without ZeRO-1
    shutil.copytree(out / "default", out / "dcp")
    for name in ("shardkit.json", "config.json"):
        (out / "dcp/step_5" / name).unlink()
    helper = Path(__file__).resolve().parents[2] / "support" / "nxd_dcp.py"
    done = subprocess.run(
        [sys.executable, str(helper), str(out / "dcp/step_5"), "2", "2"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in (out / "dcp/step_5/optim").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "__2_0.distcp",
        "__3_0.distcp",
    ]
    return out, root / "config.json"


def _torch_reads(folder: Path, tmp: Path) -> dict:
    """What torch's own DCP reader makes of a folder (format_utils.dcp_to_torch_save), flattened."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, tmp)
    return _flat(torch.load(tmp, weights_only=True))


def test_zero1_dcp_reads_as_its_default_twin(zero1_dcp, tmp_path):
    """Without a manifest or hints: the same weights, moments, steps and param group as the
    per-rank files hold, inspect says zero1-dcp, and resharding it gives the twin's files."""
    out, cfg = zero1_dcp
    a = load_checkpoint(out / "default", None, target_layout=Layout(qkv="gqa"), rank=(0, 0))
    b = load_checkpoint(out / "dcp", None, target_layout=Layout(qkv="gqa"), rank=(0, 0), config=cfg)
    assert set(a.model) == set(b.model) and b.optimizer.param_groups == a.optimizer.param_groups
    for name in a.model:
        assert torch.equal(a.model[name], b.model[name]), name
        for m in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a.optimizer.state[name][m], b.optimizer.state[name][m]), (name, m)
    run = CliRunner().invoke(cli, ["ckpt", "inspect", str(out / "dcp"), "--config", str(cfg), "--json"])
    info = json.loads(run.output)
    assert (info["nxd_mode"], info["dp"], info["step"], info["layout"]["tp"]) == ("zero1-dcp", 2, 5.0, 2)
    mid = Layout(qkv="gqa", pp=2)
    reshard_training(out / "dcp", tmp_path / "from-dcp", mid, dp=3, config=cfg, nxd_mode="default")
    reshard_training(out / "default", tmp_path / "from-default", mid, dp=3)
    want = tmp_path / "from-default/step_5"
    for f in (x for x in want.rglob("*") if x.is_file() and x.name != "shardkit.json"):
        assert file_hash(tmp_path / "from-dcp/step_5" / f.relative_to(want)) == file_hash(f), f.relative_to(want)


def test_zero1_dcp_written_is_what_torch_reads_of_nxds(zero1_dcp, tmp_path):
    """shardkit's zero1-dcp save of the twin: torch's DCP reader gives every key and value of
    NxD's layout; back to per-rank files: the twin byte for byte."""
    out, _ = zero1_dcp
    mine = reshard_training(out / "default", tmp_path / "mine", Layout(tp=2, qkv="gqa"), dp=2, nxd_mode="zero1-dcp")
    assert not list((mine / "optim").glob("dp_rank_*"))
    got, want = (
        _torch_reads(mine / "optim", tmp_path / "a.pt"),
        _torch_reads(out / "dcp/step_5/optim", tmp_path / "b.pt"),
    )
    assert set(got) == set(want) and len(got) > 100
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
    back = reshard_training(mine.parent, tmp_path / "back", Layout(tp=2, qkv="gqa"), dp=2, nxd_mode="default")
    orig = out / "default/step_5"
    for f in (x for x in orig.rglob("*") if x.is_file() and x.name != "shardkit.json"):
        assert file_hash(back / f.relative_to(orig)) == file_hash(f), f.relative_to(orig)


def test_zero1_dcp_with_pipeline_stages_names_each_stage(zero1_dcp, tmp_path):
    """At pp 2 each moment's key carries `|pp-PPPP|tp-TTTT` (NxD's order) and its stage's own
    parameter names; torch reads every moment, and shardkit reads the state back unchanged."""
    out, cfg = zero1_dcp
    layout = Layout(tp=2, pp=2, qkv="gqa")
    mine = reshard_training(out / "default", tmp_path / "pp2", layout, dp=2, nxd_mode="zero1-dcp")
    got = _torch_reads(mine / "optim", tmp_path / "pp2.pt")
    assert "base_state.model.layers.1.mlp.down_proj.weight.exp_avg|pp-0001|tp-0001" in got
    assert "base_state.model.embed_tokens.weight.exp_avg|pp-0000|tp-0000" in got
    a = load_checkpoint(out / "default", None, target_layout=Layout(qkv="gqa"), rank=(0, 0))
    b = load_checkpoint(tmp_path / "pp2", None, target_layout=Layout(qkv="gqa"), rank=(0, 0))
    for name in a.model:
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a.optimizer.state[name][m], b.optimizer.state[name][m]), (name, m)


@pytest.mark.parametrize("case", ["master", "groups"])
def test_zero1_dcp_refuses_what_nxd_cannot_save(case, tmp_path):
    root = nxd()
    src = root / (AVOID if case == "master" else "tp2_dp2_pp1_torch")
    run = CliRunner().invoke(
        cli,
        [
            "ckpt",
            "reshard",
            str(src),
            str(tmp_path / "out"),
            "--config",
            str(root / "config.json"),
            "--tp",
            "2",
            "--qkv",
            "gqa",
            "--dp",
            "2",
            "--nxd-mode",
            "zero1-dcp",
        ],
    )
    assert run.exit_code == 2 and len(run.output.strip().splitlines()) == 1, run.output
    assert ("master weights" if case == "master" else "one param group") in run.output
    assert not (tmp_path / "out").exists()
