"""torchtitan's DCP training checkpoints <-> NxD's ZeRO-1 tree (issue "Interop beyond NxD's default
save", part 3).

The source is what torchtitan's `CheckpointManager.save` leaves: `dcp.save` from 2 gloo processes
of a model sharded by FSDP2, under torchtitan's names and q/k row order, with AdamW's flattened
per-parameter state, the LambdaLR schedule, the data loader's and train state (tests/support/titan_dcp.py,
written from torchtitan's code). `shardkit ckpt reshard` writes it as NxD's tree at tp2 pp2 dp2,
by meaning (the test's own torchtitan -> Hugging Face mapping, not shardkit's, says what each
tensor must be), and back: every item torch's DCP reader reads is bit-identical; shardkit's trainer
resumed from the NxD tree takes the same first step as torch's AdamW from the same state.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from dcp_helpers import torch_reads
from nxd_helpers import _flat
from safetensors.torch import load_file
from titan_dcp import (
    TitanLlama03,
    hf_rows,
    qkv_rows,
    titan03_code,
    titan03_optimizer,
    titan03_state,
    titan03_states,
    titan_state,
    to_hf,
    to_hf03,
    to_titan03,
)
from trainer_helpers import _hf_names, check_ok, corpus_tokens, run_ranks, serial_adamw_step, steps

from shardkit.checkpoint import load_checkpoint
from shardkit.cli import cli
from shardkit.layout import Layout

SUPPORT = Path(__file__).resolve().parents[2] / "support"
MODEL = "llama-trainer-tiny"  # 8 q heads, 2 kv heads, head_dim 4, hidden 32, 4 layers, vocab 256


@pytest.fixture(scope="module")
def titan(tiny_model, tmp_path_factory):
    """(HF model dir, the full state, torchtitan's checkpoint folder `ckpt/step-2`)."""
    src = tiny_model(MODEL)
    config = json.loads((src / "config.json").read_text())
    tmp = tmp_path_factory.mktemp("titan")
    state = titan_state(load_file(str(src / "model.safetensors")), config, steps=2)
    torch.save(state, tmp / "state.pt")
    done = subprocess.run(
        [
            sys.executable,
            str(SUPPORT / "titan_dcp.py"),
            str(tmp / "ckpt/step-2"),
            str(tmp / "state.pt"),
            str(src / "config.json"),
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return src, state, tmp / "ckpt"


def _reshard(*args) -> None:
    run = CliRunner().invoke(cli, ["ckpt", "reshard", *map(str, args)])
    assert run.exit_code == 0, run.output


def test_titan_to_nxd_tp2_pp2_by_meaning_and_back_bit_identical(titan, tmp_path):
    src, state, ckpt = titan
    cfg = json.loads((src / "config.json").read_text())
    _reshard(
        ckpt,
        tmp_path / "nxd",
        "--config",
        src / "config.json",
        "--tp",
        2,
        "--pp",
        2,
        "--dp",
        2,
        "--zero1",
        "--qkv",
        "gqa",
        "--format",
        "torch",
    )
    tag = tmp_path / "nxd/step_2"
    assert sorted(p.name for p in (tag / "optim").iterdir()) == sorted(
        f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_{p:02d}.pt" for d in range(2) for t in range(2) for p in range(2)
    )
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
    got, want = (
        _flat(torch_reads(tmp_path / "back/step-2", tmp_path / "b.pt")),
        _flat(torch_reads(ckpt / "step-2", tmp_path / "a.pt")),
    )
    assert set(got) == set(want) and len(want) > 600
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
    q = "layers.0.attention.wq.weight"  # q stays in torchtitan's row order, the moments too
    assert torch.equal(
        hf_rows(got[f"optimizer.state.{q}.exp_avg"], 8),
        to_hf({q: state["optimizer"][q]["exp_avg"]}, cfg)["model.layers.0.self_attn.q_proj.weight"],
    )


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
    _reshard(
        ckpt,
        tmp_path / "nxd",
        "--config",
        src / "config.json",
        "--tp",
        2,
        "--pp",
        2,
        "--qkv",
        "gqa",
        "--format",
        "torch",
    )
    tag = tmp_path / "nxd/step_2"
    lr = torch.load(tag / "scheduler.pt", weights_only=True)["_last_lr"][0]
    tokens = corpus_tokens(tmp_path / "tokens.bin", vocab=256)
    args = [
        "--model",
        str(src),
        "--data",
        str(tokens),
        "--resume",
        str(tag),
        "--export-hf",
        str(tmp_path / "out"),
        "--metrics",
        str(tmp_path / "m.jsonl"),
        "--steps",
        "3",
        "--dtype",
        "fp32",
        "--seq-len",
        "16",
        "--micro-batch",
        "1",
        "--global-batch",
        "4",
        "--no-progress",
        "--threads",
        "1",
        "--lr",
        str(lr),
        "--decay",
        "constant",
        "--tp",
        "2",
        "--pp",
        "2",
        "--qkv",
        "gqa",
    ]
    check_ok(run_ranks(4, args))
    (record,) = steps(tmp_path / "m.jsonl")
    assert record["step"] == 3 and record["lr"] == pytest.approx(lr, rel=1e-12)
    inputs, targets = Batches(TokenFile(tokens), 16, 4, 1, 1, 0, 1234, 256).step_batch()
    before, after, loss = serial_adamw_step(tag, src / "config.json", inputs, targets)
    assert abs(record["loss"] - loss) <= 1e-5 * loss
    got = load_file(str(tmp_path / "out/model.safetensors"))
    assert set(got) == set(after)
    assert max(float((after[n] - before[n]).abs().max()) for n in after) > 1e-4
    for n in after:
        torch.testing.assert_close(got[n], after[n], rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_a_dcp_without_optimizer_state_is_one_line_exit_2(tiny_model, tmp_path):
    """A model-only DCP folder is no training checkpoint: `ckpt reshard` says what is missing."""
    import shardkit

    src = tiny_model(MODEL)
    shardkit.convert(src, tmp_path / "dcp", Layout(), format="dcp", convention="torchtitan")
    run = CliRunner().invoke(
        cli, ["ckpt", "reshard", str(tmp_path / "dcp"), str(tmp_path / "out"), "--format", "torch"]
    )
    assert run.exit_code == 2 and len(run.output.strip().splitlines()) == 1, run.output
    assert "optimizer.state.tok_embeddings.weight.exp_avg is missing" in run.output
    assert not (tmp_path / "out").exists()


# ---- torchtitan 0.3, q/k/v fused (its llama3 default) or not -------------------------------------


@pytest.fixture(scope="module", params=["fused", "unfused"])
def titan03(request, tiny_model, tmp_path_factory):
    """(HF model dir, the full state, torchtitan 0.3's checkpoint folder `ckpt/step-2`), saved as
    torchtitan 0.3 saves it from 2 FSDP2 processes (tests/support/titan_dcp.py), q/k/v fused or not."""
    src = tiny_model(MODEL)
    config = json.loads((src / "config.json").read_text())
    tmp = tmp_path_factory.mktemp(f"titan03-{request.param}")
    state = titan03_state(load_file(str(src / "model.safetensors")), config, request.param == "fused", steps=2)
    torch.save(state, tmp / "state.pt")
    done = subprocess.run(
        [
            sys.executable,
            str(SUPPORT / "titan_dcp.py"),
            str(tmp / "ckpt/step-2"),
            str(tmp / "state.pt"),
            str(src / "config.json"),
            "2",
            "--0.3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return src, state, tmp / "ckpt"


def _by_name03(state: dict, config: dict, moment: str) -> dict[str, torch.Tensor]:
    """A moment of the 0.3 state per Hugging Face tensor, by the test's own mapping: the fused
    parameter's q, k and v rows (`qkv_rows`), then 0.3's names and row order undone."""
    split = {}
    for name, entry in state["optimizer"].items():
        if name.endswith(".wqkv.weight"):
            rows = qkv_rows(config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"])
            for part, index in zip(("wq", "wk", "wv"), rows):
                split[name.replace(".wqkv.", f".{part}.")] = entry[moment][index]
        else:
            split[name] = entry[moment]
    return to_hf03(split, config)


def test_titan03_to_nxd_by_meaning_and_its_export(titan03, tmp_path):
    """torchtitan 0.3's checkpoint, q/k/v fused (its optimizer state under `qkv_linear.wqkv`) or
    not: `ckpt reshard` to NxD's tree at tp2 pp2 dp2 holds every weight and moment of the state
    (in Hugging Face's names and rows, by the test's own mapping), and its merge to Hugging Face gives
    the weights."""
    src, state, ckpt = titan03
    cfg = json.loads((src / "config.json").read_text())
    _reshard(
        ckpt,
        tmp_path / "nxd",
        "--config",
        src / "config.json",
        "--tp",
        2,
        "--pp",
        2,
        "--dp",
        2,
        "--zero1",
        "--qkv",
        "gqa",
        "--format",
        "torch",
    )
    loaded = load_checkpoint(tmp_path / "nxd", None, target_layout=Layout(), rank=(0, 0))
    want = to_hf03(state["model"], cfg)
    got = _hf_names(loaded.model)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    for moment in ("exp_avg", "exp_avg_sq"):
        wanted = _by_name03(state, cfg, moment)
        have = _hf_names({n: e[moment] for n, e in loaded.optimizer.state.items()})
        assert set(have) == set(wanted) and all(torch.equal(have[n], wanted[n]) for n in wanted), moment
    assert {float(e["step"]) for e in loaded.optimizer.state.values()} == {2.0}
    assert loaded.optimizer.param_groups == [state["hyper"]]  # betas saved as the tuple it is
    run = CliRunner().invoke(
        cli, ["merge", str(ckpt / "step-2"), str(tmp_path / "hf"), "--config", str(src / "config.json")]
    )
    assert run.exit_code == 0, run.output
    merged = load_file(str(tmp_path / "hf/model.safetensors"))
    assert set(merged) == set(want) and all(torch.equal(merged[n], want[n]) for n in want)
    run = CliRunner().invoke(cli, ["ckpt", "inspect", str(ckpt), "--config", str(src / "config.json")])
    names = "torchtitan-0.3" if state["fused"] else "torchtitan-0.3-unfused"
    assert f"a torchtitan checkpoint ({names} names)" in run.output, run.output


def _load_like_titan03(folder: Path, config: dict, fused: bool) -> tuple[dict, dict]:
    """Load a DCP checkpoint as torchtitan 0.3's `CheckpointManager` loads one into its llama3
    model (q/k/v fused or not) and optimizer (`dcp.load` of what it saves, then the model's and the
    optimizer's own load): (the model's state dict, the optimizer's flat one). A key the model or
    optimizer has and the checkpoint lacks fails in `dcp.load` ("Missing key in checkpoint")."""
    import functools

    import torch.distributed.checkpoint as dcp
    from titan_dcp import _warmup

    code = titan03_code()
    model = TitanLlama03(config, code if fused else None)
    optimizer = titan03_optimizer(model)
    torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(_warmup, steps=10))
    states = titan03_states(model, optimizer, code, 0)
    dcp.load(states, checkpoint_id=str(folder))
    model.load_state_dict({k: v for k, v in states.items() if isinstance(v, torch.Tensor)})
    code.load_flat_state(optimizer, states["optimizer"])
    return model.state_dict(), code.flat_state(optimizer)


def test_titan03_written_back_loads_in_torchtitans_model(titan03, tmp_path):
    """NxD's tree written from it, written back with `--convention torchtitan-0.3` (fused, 0.3's
    default) or `torchtitan-0.3-unfused` as the source was: torch's DCP reader reads every item of
    the original, bit for bit; torchtitan 0.3's load (its hooks and optimizer functions) loads it
    into the model of the same kind with the state's values; the other kind's keys are missing."""
    src, state, ckpt = titan03
    cfg = json.loads((src / "config.json").read_text())
    _reshard(
        ckpt,
        tmp_path / "nxd",
        "--config",
        src / "config.json",
        "--tp",
        2,
        "--pp",
        2,
        "--dp",
        2,
        "--zero1",
        "--qkv",
        "gqa",
        "--format",
        "torch",
    )
    mine, other = ("torchtitan-0.3", "torchtitan-0.3-unfused")[:: 1 if state["fused"] else -1]
    _reshard(tmp_path / "nxd", tmp_path / "back", "--format", "dcp", "--convention", mine, "--tp", "2")
    got, want = (
        _flat(torch_reads(tmp_path / "back/step-2", tmp_path / "b.pt")),
        _flat(torch_reads(ckpt / "step-2", tmp_path / "a.pt")),
    )
    assert set(got) == set(want) and len(want) > 500
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key
    model, optim = _load_like_titan03(tmp_path / "back/step-2", cfg, state["fused"])
    assert set(model) == set(state["model"]) and all(torch.equal(model[k], v) for k, v in state["model"].items())
    for name, entry in state["optimizer"].items():
        for key, value in entry.items():
            assert torch.equal(optim[f"state.{name}.{key}"], value), (name, key)
    _reshard(tmp_path / "nxd", tmp_path / "other", "--format", "dcp", "--convention", other)
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises(
        CheckpointException,
        match=r"Missing key in checkpoint state_dict: optimizer\.state\.layers\.\d+"
        r"\.attention\.qkv_linear\.wq",
    ):
        _load_like_titan03(tmp_path / "other/step-2", cfg, state["fused"])


def test_titan03_moments_in_128_chunks_are_read_or_refused(titan03, tmp_path):
    """The q moments (the fused parameter's, or wq's) saved in 128 chunks (a 16 x 8 grid): resharded
    exactly; with one chunk missing and another listed twice, `ckpt reshard` refuses in one line."""
    from dcp_helpers import _miscounted, grid, retile

    src, state, ckpt = titan03
    cfg = json.loads((src / "config.json").read_text())
    name = "layers.0.attention.qkv_linear." + ("wqkv" if state["fused"] else "wq") + ".weight"
    moment = state["optimizer"][name]["exp_avg"]
    for case, tiles in (
        ("good", grid(tuple(moment.shape), 16, 8)),
        ("bad", _miscounted(grid(tuple(moment.shape), 16, 8))),
    ):
        shutil.copytree(ckpt, tmp_path / case)
        retile(tmp_path / case / "step-2", f"optimizer.state.{name}.exp_avg", tiles, moment)
        run = CliRunner().invoke(
            cli,
            [
                "ckpt",
                "reshard",
                str(tmp_path / case),
                str(tmp_path / f"{case}-nxd"),
                "--config",
                str(src / "config.json"),
                "--format",
                "torch",
            ],
        )
        if case == "bad":
            assert run.exit_code == 2 and len(run.output.strip().splitlines()) == 1, run.output
            assert f"the chunks of optimizer.state.{name}.exp_avg do not tile its shape" in run.output
            assert not (tmp_path / "bad-nxd").exists()
            continue
        assert run.exit_code == 0, run.output
        loaded = load_checkpoint(tmp_path / "good-nxd", None, target_layout=Layout(), rank=(0, 0))
        have = _hf_names({n: e["exp_avg"] for n, e in loaded.optimizer.state.items()})
        wanted = _by_name03(state, cfg, "exp_avg")
        assert all(torch.equal(have[n], wanted[n]) for n in wanted)


@pytest.mark.skipif(
    titan03_code().whose == "imitation",
    reason="torchtitan 0.3's files are not here: "
    "`python scripts/check_torchtitan.py fetch DIR`, then TORCHTITAN_SRC=DIR",
)
def test_the_imitation_of_torchtitan03_is_torchtitans_code(tiny_model):
    """tests/support/titan_dcp.py's imitation of torchtitan 0.3's fused-qkv hooks and flat optimizer state
    gives what torchtitan's own code (its published wheel's files) gives: the model's state dict
    and the flat optimizer state of a fused model after two steps, and the load of both back."""
    import titan_dcp

    src = tiny_model(MODEL)
    cfg = json.loads((src / "config.json").read_text())
    hf = load_file(str(src / "model.safetensors"))
    own = titan03_code()
    imitation = titan_dcp.TitanCode(
        titan_dcp.split_fused,
        titan_dcp.merge_fused,
        titan_dcp.init_state,
        titan_dcp.flat_state,
        titan_dcp.load_flat_state,
        "imitation",
    )
    results = []
    for code in (own, imitation):
        model = TitanLlama03(cfg, code)
        model.load_state_dict(to_titan03(hf, cfg))
        optimizer = titan03_optimizer(model)
        code.init_state(optimizer)
        torch.manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        optimizer.step()
        states = titan03_states(model, optimizer, code, 1)
        again = TitanLlama03(cfg, code)
        fresh = titan03_optimizer(again)
        code.init_state(fresh)
        again.load_state_dict({k: v for k, v in states.items() if isinstance(v, torch.Tensor)})
        code.load_flat_state(fresh, states["optimizer"])
        results.append((_flat(states), dict(again.named_parameters()), fresh.state_dict()["state"]))
    (a, pa, sa), (b, pb, sb) = results
    assert set(a) == set(b) and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )
    assert any(".wqkv." in k for k in a) and any(".qkv_linear.wq." in k for k in a)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_titan03_state_both_fused_and_apart_is_one_line_exit_2(titan03, tmp_path):
    """A 0.3 checkpoint holding q's moments both under the fused parameter and apart (two saves
    mixed): which is the state cannot be told; `ckpt reshard` refuses it in one line."""
    src, state, ckpt = titan03
    shutil.copytree(ckpt, tmp_path / "mixed")
    folder = tmp_path / "mixed/step-2"
    meta = pickle.loads((folder / ".metadata").read_bytes())
    fused, apart = (f"optimizer.state.layers.1.attention.qkv_linear.{p}.weight.exp_avg" for p in ("wqkv", "wq"))
    have, add = (fused, apart) if state["fused"] else (apart, fused)
    meta.state_dict_metadata[add] = meta.state_dict_metadata[have]  # the same chunks, listed under the other name
    meta.storage_data.update({replace(k, fqn=add): v for k, v in meta.storage_data.items() if k.fqn == have})
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    run = CliRunner().invoke(
        cli,
        [
            "ckpt",
            "reshard",
            str(tmp_path / "mixed"),
            str(tmp_path / "out"),
            "--config",
            str(src / "config.json"),
            "--format",
            "torch",
        ],
    )
    assert run.exit_code == 2 and len(run.output.strip().splitlines()) == 1, run.output
    assert "holds the optimizer state of layers.1.attention.qkv_linear.wq.weight both apart and fused" in run.output
    assert not (tmp_path / "out").exists()
