"""LoRA adapter checkpoints (the trainer's --lora-rank) are first-class in `shardkit ckpt`:

1. `ckpt list` and `ckpt inspect` show them (rank, alpha, targets, the base model, the layout);
2. `ckpt export` writes the PEFT adapter folder, equal to the trainer's own `--export-lora`, which
   peft loads onto the base model; `--merged` writes the merged model, equal to the trainer's merged
   export, from the base the checkpoint records or `--base` (any layout);
3. `ckpt reshard` moves adapters and their Adam state to another layout; exported again: equal;
4. wrong requests (--merged on full weights, a base that is gone or another model, `merge` of an
   adapter checkpoint): one line, exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_helpers import one_line_error
from click.testing import CliRunner
from safetensors.torch import load_file
from trainer_helpers import COMMON, run_inprocess, tiny_run_fixtures

from shardkit.cli import cli
from shardkit.testing import fixture_config, make_tiny_model

ROOT = Path(__file__).resolve().parents[3]
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q,k,v,o,gate,up,down", "--steps", "3"]

work, hf_model, tokens = tiny_run_fixtures("ckpt-lora")


def run(*args: object):
    return CliRunner().invoke(cli, ["-q", *map(str, args)], catch_exceptions=False)


def ok(result) -> str:
    assert result.exit_code == 0, (result.output, result.stderr)
    return result.output


@pytest.fixture(scope="module")
def trained(work, hf_model, tokens):
    """A tp1 LoRA run: its checkpoint folder, its PEFT export and its merged export (a resume of
    the final tag with nothing left to train)."""
    base = ["--model", str(hf_model), "--data", str(tokens), *COMMON, *LORA, "--metrics", str(work / "m.jsonl")]
    run_inprocess([*base, "--checkpoint-dir", str(work / "ckpt"), "--export-hf", str(work / "peft"), "--export-lora"])
    run_inprocess([*base, "--resume", str(work / "ckpt" / "step_3"), "--export-hf", str(work / "merged")])
    return work / "ckpt", work / "peft", work / "merged"


def logits(model_dir: Path, peft_dir: Path | None = None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if peft_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, peft_dir)
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_same_adapters(got: Path, expected: Path) -> None:
    a, b = load_file(str(got / "adapter_model.safetensors")), load_file(str(expected / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    config = json.loads((got / "adapter_config.json").read_text())
    assert config == json.loads((expected / "adapter_config.json").read_text())


def test_list_and_inspect_show_the_adapters(trained, hf_model):
    ckpt, _, _ = trained
    assert "step_3" in ok(run("ckpt", "list", ckpt))
    text = ok(run("ckpt", "inspect", ckpt))
    assert "tp 1, pp 1" in text
    assert "LoRA adapters: rank 4, alpha 8, targets q,k,v,o,gate,up,down" in text
    assert f"trained on the llama model {hf_model.absolute()}" in text
    info = json.loads(ok(run("ckpt", "inspect", ckpt, "--json")))
    assert info["lora"]["rank"] == 4 and info["lora"]["base_model"] == str(hf_model.absolute())
    # as a user runs it: a fresh process, where no trainer has registered anything
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-m", "shardkit", "ckpt", "inspect", str(ckpt)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0 and "LoRA adapters: rank 4" in done.stdout, done.stderr


def test_export_writes_the_peft_folder_the_trainer_writes(trained, hf_model, tmp_path):
    ckpt, peft, merged = trained
    ok(run("ckpt", "export", ckpt, tmp_path / "peft"))
    assert_same_adapters(tmp_path / "peft", peft)
    got, want = logits(hf_model, tmp_path / "peft"), logits(hf_model, peft)
    assert torch.equal(got, want)
    assert (got - logits(hf_model)).abs().max() > 1e-3, "the adapters changed nothing"
    assert torch.allclose(got, logits(merged), rtol=0, atol=1e-5)


def test_export_merged_equals_the_trainers_merged_export(trained, hf_model, tmp_path):
    """--merged takes the base from the checkpoint's record, or --base of any layout."""
    ckpt, _, merged = trained
    ok(run("ckpt", "export", ckpt, tmp_path / "merged", "--merged"))
    ok(run("verify", tmp_path / "merged", merged, "--atol", "1e-6"))
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "llama"
    shards = tmp_path / "base-tp4"
    ok(run("convert", hf_model, shards, "--tp", "4", "--kv-multiplier", "2", "--qkv", "fused"))
    ok(run("ckpt", "export", ckpt, tmp_path / "merged-from-shards", "--merged", "--base", shards))
    ok(run("verify", tmp_path / "merged-from-shards", merged, "--atol", "1e-6"))


def test_export_merged_refuses_a_tag_changed_during_the_merge(trained, tmp_path, monkeypatch):
    """The adapters' tag is held from before the merge reads it until the merged model's commit:
    a file added to it meanwhile is refused in one line, and nothing is written."""
    import shutil

    from shardkit.engine import executor

    ckpt = shutil.copytree(trained[0], tmp_path / "ckpt")
    real_run = executor.run

    def run_then_change(*args, **kwargs):
        records = real_run(*args, **kwargs)
        (ckpt / "step_3" / "notes.txt").write_text("saved over meanwhile")
        return records

    monkeypatch.setattr(executor, "run", run_then_change)
    one_line_error(
        run("ckpt", "export", ckpt, tmp_path / "merged", "--merged"), "changed while shardkit read it", "notes.txt"
    )
    assert not (tmp_path / "merged").exists()


def test_reshard_moves_adapters_and_their_adam_state(trained, hf_model, tmp_path):
    ckpt, peft, _ = trained
    ok(run("ckpt", "reshard", ckpt, tmp_path / "tp2", "--tp", "2", "--qkv", "gqa"))
    info = json.loads(ok(run("ckpt", "inspect", tmp_path / "tp2", "--json")))
    assert info["layout"]["tp"] == 2 and info["lora"]["rank"] == 4
    ok(run("ckpt", "export", tmp_path / "tp2", tmp_path / "peft"))
    assert_same_adapters(tmp_path / "peft", peft)
    assert torch.equal(logits(hf_model, tmp_path / "peft"), logits(hf_model, peft))
    ok(run("ckpt", "reshard", tmp_path / "tp2", tmp_path / "back", "--tp", "1", "--qkv", "separate"))
    for src, back in zip(
        sorted((ckpt / "step_3" / "optim").iterdir()), sorted((tmp_path / "back" / "step_3" / "optim").iterdir())
    ):
        assert src.read_bytes() == back.read_bytes(), src.name  # Adam moments resharded and back, byte for byte


def test_wrong_requests_are_one_line(trained, hf_model, tokens, work, tmp_path):
    ckpt, _, _ = trained
    full = work / "full-ckpt"
    if not full.exists():
        run_inprocess(
            ["--model", str(hf_model), "--data", str(tokens), *COMMON, "--steps", "1", "--checkpoint-dir", str(full)]
        )
    one_line_error(run("ckpt", "export", full, tmp_path / "a", "--merged"), "not LoRA adapters", "--merged")
    gone = tmp_path / "gone"  # a base model deleted after training
    shutil.copytree(hf_model, gone)
    run_inprocess(
        [
            "--model",
            str(gone),
            "--data",
            str(tokens),
            *COMMON,
            *LORA,
            "--steps",
            "1",
            "--checkpoint-dir",
            str(tmp_path / "ck"),
        ]
    )
    shutil.rmtree(gone)
    one_line_error(run("ckpt", "export", tmp_path / "ck", tmp_path / "b", "--merged"), "does not exist", "--base")
    other = make_tiny_model(fixture_config("llama-trainer-tiny") | {"intermediate_size": 96}, tmp_path / "other")
    one_line_error(
        run("ckpt", "export", ckpt, tmp_path / "c", "--merged", "--base", other),
        "not the model the adapters were trained on",
        "--base",
    )
    one_line_error(run("merge", ckpt / "step_3", tmp_path / "d"), "holds LoRA adapters", "ckpt export", "--merged")
    assert not any((tmp_path / n).exists() for n in "abcd")
