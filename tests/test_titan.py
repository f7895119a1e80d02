"""torchtitan's DCP training checkpoints <-> NxD's ZeRO-1 tree (issue "Interop beyond NxD's default
save", part 3).

The source is what torchtitan's `CheckpointManager.save` leaves: `dcp.save` from 2 gloo processes
of a model sharded by FSDP2, under torchtitan's names and q/k row order, with AdamW's flattened
per-parameter state, the LambdaLR schedule, the data loader's and train state (tests/titan_dcp.py,
written from torchtitan's code). `shardkit ckpt reshard` writes it as NxD's tree at tp2 pp2 dp2,
by meaning (the test's own torchtitan -> Hugging Face mapping, not shardkit's, says what each
tensor must be), and back: every item torch's DCP reader reads is bit-identical; shardkit's trainer
resumed from the NxD tree takes the same first step as torch's AdamW from the same state.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from trainer_helpers import check_ok, corpus_tokens, run_ranks, steps

from shardkit.checkpoint import load_checkpoint
from shardkit.cli import cli
from shardkit.layout import Layout
from test_dcp import torch_reads
from test_trainer import _hf_names, serial_adamw_step
from test_nxd_modes import _flat
from titan_dcp import hf_rows, titan_state, to_hf

HERE = Path(__file__).resolve().parent
MODEL = "llama-trainer-tiny"  # 8 q heads, 2 kv heads, head_dim 4, hidden 32, 4 layers, vocab 256


@pytest.fixture(scope="module")
def titan(tiny_model, tmp_path_factory):
    """(HF model dir, the full state, torchtitan's checkpoint folder `ckpt/step-2`)."""
    src = tiny_model(MODEL)
    config = json.loads((src / "config.json").read_text())
    tmp = tmp_path_factory.mktemp("titan")
    state = titan_state(load_file(str(src / "model.safetensors")), config, steps=2)
    torch.save(state, tmp / "state.pt")
    done = subprocess.run([sys.executable, str(HERE / "titan_dcp.py"), str(tmp / "ckpt/step-2"), str(tmp / "state.pt"),
                           str(src / "config.json"), "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return src, state, tmp / "ckpt"


def _reshard(*args) -> None:
    run = CliRunner().invoke(cli, ["ckpt", "reshard", *map(str, args)])
    assert run.exit_code == 0, run.output


def test_titan_to_nxd_tp2_pp2_by_meaning_and_back_bit_identical(titan, tmp_path):
    src, state, ckpt = titan
    cfg = json.loads((src / "config.json").read_text())
    _reshard(ckpt, tmp_path / "nxd", "--config", src / "config.json", "--tp", 2, "--pp", 2, "--dp", 2, "--qkv", "gqa",
             "--format", "torch")
    tag = tmp_path / "nxd/step_2"
    assert sorted(p.name for p in (tag / "optim").iterdir()) == sorted(
        f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt" for d in range(2) for t in range(2) for p in range(2))
    # by meaning: every weight and moment is the torchtitan state's, in Hugging Face's names and rows
    loaded = load_checkpoint(tmp_path / "nxd", None, target_layout=Layout(), rank=(0, 0))
    want = to_hf(state["model"], cfg)
    got = _hf_names(loaded.model)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    for moment in ("exp_avg", "exp_avg_sq"):
        wanted = to_hf({n: e[moment] for n, e in state["optimizer"].items()}, cfg)
        have = _hf_names({n: e[moment] for n, e in loaded.optimizer.state.items()})
        assert all(torch.equal(have[n], wanted[n]) for n in wanted), moment
    assert {float(e["step"]) for e in loaded.optimizer.state.values()} == {2.0}
    assert loaded.optimizer.param_groups == [state["hyper"] | {"betas": list(state["hyper"]["betas"])}]
    assert loaded.scheduler["last_epoch"] == 2 and loaded.user_content["step"] == 2
    # and back: torch's DCP reader reads every item of the original, bit for bit
    _reshard(tmp_path / "nxd", tmp_path / "back", "--format", "dcp")
    got, want = _flat(torch_reads(tmp_path / "back/step-2", tmp_path / "b.pt")), _flat(torch_reads(ckpt / "step-2", tmp_path / "a.pt"))
    assert set(got) == set(want) and len(want) > 600
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
    q = "layers.0.attention.wq.weight"  # q stays in torchtitan's row order, the moments too
    assert torch.equal(hf_rows(got[f"optimizer.state.{q}.exp_avg"], 8), to_hf(
        {q: state["optimizer"][q]["exp_avg"]}, cfg)["model.layers.0.self_attn.q_proj.weight"])


def test_inspect_says_torchtitan(titan):
    src, _, ckpt = titan
    run = CliRunner().invoke(cli, ["ckpt", "inspect", str(ckpt), "--config", str(src / "config.json")])
    assert run.exit_code == 0, run.output
    assert "a torchtitan checkpoint (torchtitan names)" in run.output and "step 2" in run.output


def test_resume_from_titan_via_nxd_first_step_is_adamw(titan, tmp_path):
    """shardkit's trainer resumed (tp2 pp2, 4 gloo ranks) from the NxD tree written from the
    torchtitan checkpoint: its first step equals one torch AdamW step of transformers' model from
    the same state (weights, moments, step, torchtitan's lr and weight decay) on the same batch."""
    from trainer.data import Batches, TokenFile

    src, _, ckpt = titan
    _reshard(ckpt, tmp_path / "nxd", "--config", src / "config.json", "--tp", 2, "--pp", 2, "--qkv", "gqa",
             "--format", "torch")
    tag = tmp_path / "nxd/step_2"
    lr = torch.load(tag / "scheduler.pt", weights_only=True)["_last_lr"][0]
    tokens = corpus_tokens(tmp_path / "tokens.bin", vocab=256)
    args = ["--model", str(src), "--data", str(tokens), "--resume", str(tag), "--export-hf", str(tmp_path / "out"),
            "--metrics", str(tmp_path / "m.jsonl"), "--steps", "3", "--dtype", "fp32", "--seq-len", "16",
            "--micro-batch", "1", "--global-batch", "4", "--no-progress", "--threads", "1", "--lr", str(lr),
            "--decay", "constant", "--tp", "2", "--pp", "2", "--qkv", "gqa"]
    check_ok(run_ranks(4, args))
    record, = steps(tmp_path / "m.jsonl")
    assert record["step"] == 3 and record["lr"] == pytest.approx(lr, rel=1e-12)
    inputs, targets = Batches(TokenFile(tokens), 16, 4, 1, 1, 0, 1234, 256).step_batch()
    before, after, loss = serial_adamw_step(tag, src / "config.json", inputs, targets)
    assert abs(record["loss"] - loss) <= 1e-5 * loss
    got = load_file(str(tmp_path / "out/model.safetensors"))
    assert set(got) == set(after)
    assert max(float((after[n] - before[n]).abs().max()) for n in after) > 1e-4
    for n in after:
        torch.testing.assert_close(got[n], after[n], rtol=0, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_a_dcp_without_optimizer_state_is_one_line_exit_2(tiny_model, tmp_path):
    """A model-only DCP folder is no training checkpoint: `ckpt reshard` says what is missing."""
    import shardkit

    src = tiny_model(MODEL)
    shardkit.convert(src, tmp_path / "dcp", Layout(), format="dcp", convention="torchtitan")
    run = CliRunner().invoke(cli, ["ckpt", "reshard", str(tmp_path / "dcp"), str(tmp_path / "out"), "--format", "torch"])
    assert run.exit_code == 2 and len(run.output.strip().splitlines()) == 1, run.output
    assert "optimizer.state.tok_embeddings.weight.exp_avg is missing" in run.output
    assert not (tmp_path / "out").exists()
