"""optimum-neuron's training checkpoints (NeuronTrainer's checkpoint-<step> folders) through
`shardkit ckpt`: inspect, export, and reshard with the optimizer state, checked by meaning.

The checkpoints come from tests/support/optimum_neuron_ref.py `save ... OPTIM GRADS`: the model files
sharded by optimum-neuron 0.4.5's own `adapt_state_dict`, its own metadata, and the optimizer
files NxD's save_checkpoint writes for optimum-neuron's trainer. NxD and torch-xla do not run
here, so those files are constructed from their source (see the ref script): torch's own AdamW,
stepped twice on each rank over gradients that optimum-neuron's code sharded from seeded
full-model gradients, saved as torch's state_dict (zero_1 off) or in NxD's ZeRO-1 state dict
(zero_1 on). The truth for every moment is torch's AdamW run on the full Hugging Face tensors
with the same gradients, in this process.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from optimum_helpers import invoke, ref, same_tensors
from safetensors.torch import load_file

from shardkit.cli import cli


def saved(hf: Path, run: Path, optim: str, step: int = 2) -> Path:
    """optimum-neuron's trainer's checkpoint-<step> (tp 4, pp 2, NxD's GQA layer, kv-multiplier 2)."""
    ref("save", hf, run / f"checkpoint-{step}", 4, 2, 0, 0, optim, run.parent / f"{run.name}.grads.safetensors")
    return run / f"checkpoint-{step}"


def true_moments(grads_file: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every Hugging Face tensor's AdamW moments after the saved gradient steps, on the full tensors."""
    grads = load_file(str(grads_file))
    steps = sorted({int(k.split(".", 1)[0][4:]) for k in grads})
    names = sorted({k.split(".", 1)[1] for k in grads})
    out = {}
    for name in names:
        param = torch.nn.Parameter(torch.zeros_like(grads[f"step0.{name}"]))
        opt = torch.optim.AdamW([param], lr=1e-3, foreach=False)
        for k in steps:
            param.grad = grads[f"step{k}.{name}"]
            opt.step()
        out[name] = {m: opt.state[param][m] for m in ("exp_avg", "exp_avg_sq", "step")}
    return out


def hf_name_moment(truth: dict, name: str, moment: str) -> torch.Tensor:
    """The moment of an NxD tp-1 name (separate q/k/v, fused gate_up_proj) from the Hugging Face truth."""
    if name.endswith("mlp.gate_up_proj.weight"):
        base = name[: -len("gate_up_proj.weight")]
        return torch.cat([truth[base + "gate_proj.weight"][moment], truth[base + "up_proj.weight"][moment]])
    return truth[name][moment]


def nxd_tp1_moments(tag: Path) -> dict[str, dict[str, torch.Tensor]]:
    """An NxD tp 1 pp 1 dp 1 tag's moments by parameter name, read with torch alone: ZeRO-1 indices
    follow the model file's order, decay group (no "norm" in the name) first."""
    names = list(torch.load(tag / "model/dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True))
    order = [n for n in names if "norm" not in n] + [n for n in names if "norm" in n]
    optim = torch.load(tag / "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt", weights_only=True)
    assert [len(g["params"]) for g in optim["param_groups"]] == [len(names) - 7, 7]  # 3 layers x 2 norms + model.norm
    return {n: optim["base_state"][i] for i, n in enumerate(order)}


@pytest.mark.parametrize("optim", ["zero1", "adamw", "zero1+xser"])
def test_reshard_carries_optimums_moments_by_meaning(optim, tiny_model, tmp_path):
    """optimum-neuron's checkpoint (zero_1 on: NxD's ZeRO-1 file at dp 1; off: torch's AdamW
    state_dict; xser: its default use_xser, kept by the first reshard) -> ckpt reshard to tp 2 dp 2
    (separate q/k/v) -> tp 1 dp 1 (torch files): every moment equals
    AdamW's on the full tensors (kv replicas, fused gate_up, vocab rows, dp padding undone);
    the scheduler is carried byte for byte and the trainer state becomes the user content."""
    hf = tiny_model("llama-3.1-tiny", torch.bfloat16)
    run = tmp_path / "run"
    folder = saved(hf, run, optim)
    truth = true_moments(tmp_path / "run.grads.safetensors")
    invoke(
        "ckpt",
        "reshard",
        run,
        tmp_path / "tp2dp2",
        "--tp",
        "2",
        "--dp",
        "2",
        "--qkv",
        "separate",
        "--kv-multiplier",
        "1",
    )
    tag = tmp_path / "tp2dp2/checkpoint-2"
    assert sorted(p.name for p in (tag / "optim").glob("*_pp_rank_00.pt")) == [
        f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for d in range(2) for t in range(2)
    ]
    assert (tag / "scheduler.pt").read_bytes() == (folder / "scheduler.pt").read_bytes()
    content = torch.load(tag / "user_content.pt", weights_only=True)
    assert content == json.loads((folder / "trainer_state.json").read_text())
    assert (tag / "optim/dp_rank_01_tp_rank_01_pp_rank_00.pt.tensors").is_dir() == optim.endswith("xser")
    invoke(
        "ckpt",
        "reshard",
        tmp_path / "tp2dp2",
        tmp_path / "tp1",
        "--tp",
        "1",
        "--pp",
        "1",
        "--dp",
        "1",
        "--format",
        "torch",
    )
    moments = nxd_tp1_moments(tmp_path / "tp1/checkpoint-2")
    assert len(moments) == len(truth) - sum("gate_proj" in n for n in truth)  # gate and up fused
    for name, state in moments.items():
        for m in ("exp_avg", "exp_avg_sq"):
            want = hf_name_moment(truth, name, m)
            assert state[m].dtype == torch.float32 and torch.equal(state[m], want.float()), (name, m)
        assert float(state["step"]) == 2.0
    invoke("ckpt", "export", tmp_path / "tp1", tmp_path / "back")
    same_tensors(load_file(str(tmp_path / "back/model.safetensors")), load_file(str(hf / "model.safetensors")))


def test_inspect_and_export_optimums_checkpoint(tiny_model, tmp_path):
    """ckpt inspect tells the layout, dp 1, the step and the trainer's two param groups, from the
    checkpoint folder, its shards/ or the output directory (newest complete checkpoint-<step>,
    or --tag); ckpt export gives the Hugging Face tensors exactly."""
    hf = tiny_model("llama-3.1-tiny", torch.bfloat16)
    run = tmp_path / "run"
    folder = saved(hf, run, "zero1")
    shutil.copytree(folder, run / "checkpoint-9")
    (run / "checkpoint-9/shards/done").unlink()  # an interrupted save: never picked
    for where, tag in ((run, None), (folder, None), (folder / "shards", None), (run, "checkpoint-2")):
        info = json.loads(invoke("ckpt", "inspect", where, "--json", *(["--tag", tag] if tag else [])))
        assert (info["tag"], info["format"], info["dp"], info["step"]) == ("checkpoint-2", "optimum-neuron", 1, 2)
        assert (info["layout"]["tp"], info["layout"]["pp"], info["layout"]["qkv"]) == (4, 2, "gqa")
        groups = info["param_groups"]
        assert [g["hyper"]["weight_decay"] for g in groups] == [0.01, 0.0]
        assert all("norm" in n for n in groups[1]["parameters_on_tp0_pp0"])
    invoke("ckpt", "export", run, tmp_path / "hf-out")
    same_tensors(load_file(str(tmp_path / "hf-out/model.safetensors")), load_file(str(hf / "model.safetensors")))
    result = CliRunner().invoke(cli, ["ckpt", "inspect", str(run), "--tag", "checkpoint-9"])
    assert result.exit_code == 2 and "did not finish" in result.output, result.output


def test_a_dp2_zero1_run_is_refused_but_exports(tiny_model, tmp_path):
    """A ZeRO-1 run with 2 data-parallel ranks: optimum-neuron's trainer saved dp rank 0's shard
    only, so reshard refuses in one line (nothing written) while export still gives the weights."""
    hf = tiny_model("llama-3.1-tiny", torch.bfloat16)
    run = tmp_path / "run"
    saved(hf, run, "zero1-dp2")
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["ckpt", "reshard", str(run), str(out), "--tp", "2"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "several data-parallel ranks" in result.output and not out.exists()
    invoke("ckpt", "export", run, tmp_path / "hf-out")
    same_tensors(load_file(str(tmp_path / "hf-out/model.safetensors")), load_file(str(hf / "model.safetensors")))


def test_a_tag_name_that_leaves_the_directory_is_refused(tmp_path):
    """`--tag` names a checkpoint-<step> folder inside DIR: `..` or an absolute path never reaches
    a folder elsewhere (not even an optimum-neuron checkpoint there)."""
    from shardkit.checkpoint.optimum import find_tag
    from shardkit.checkpoint.tree import UnsafeTagError

    outside = tmp_path / "elsewhere" / "checkpoint-5"
    (outside / "shards").mkdir(parents=True)
    (tmp_path / "run").mkdir()
    for tag in ("../elsewhere/checkpoint-5", str(outside)):
        with pytest.raises(UnsafeTagError):
            find_tag(tmp_path / "run", tag)
