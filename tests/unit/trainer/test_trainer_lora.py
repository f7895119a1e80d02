"""LoRA fine-tuning in the slim trainer (trainer/lora.py): acceptance tests of issue 13 item 3.

1. parallel equals serial: the same adapters from the same seed in every layout; the per-step
   losses and the final adapters of tp2pp2 (fused qkv, activation checkpointing) and tp4
   (kv-multiplier 2, sequence parallel) equal tp1's to 1e-5 (real gloo jobs, fp32);
2. tp1 equals `peft.get_peft_model` on the transformers model trained by torch AdamW (adapters to 1e-5);
3. a run resumed on another layout (a tp2 x dp2 ZeRO-1 checkpoint resumed at tp1) equals the
   uninterrupted run; checkpoints hold only the adapters;
4. the PEFT export loads with `PeftModel.from_pretrained` and gives the merged export's logits;
5. bad input: one line, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from trainer_helpers import COMMON as BASE_COMMON
from trainer_helpers import (
    adamw_reference,
    check_ok,
    losses,
    rel_diff,
    run_inprocess,
    run_ranks,
    steps,
    tiny_run_fixtures,
    torchrun,
    worker_exit_codes,
)
from trainer_helpers import run_args as base_run_args

REL = 1e-5
ATOL = 1e-5
RANK, ALPHA = 4, 8.0
TARGETS = "q,k,v,o,gate,up,down"
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# AdamW moves a weight by about lr whatever its gradient's size, so a weight whose gradient nearly
# cancels (the size of float noise) moves by noise: at eps 1e-8 a few of the 9k adapter entries end
# 1e-5 apart between layouts (whose sums round differently) while the median differs by 4e-9.
# eps 1e-6 (typical adapter gradients here are ~1e-2) damps that without changing real updates.
EPS = 1e-6
COMMON = [
    *BASE_COMMON,
    "--eps",
    str(EPS),
    "--lora-rank",
    str(RANK),
    "--lora-alpha",
    str(ALPHA),
    "--lora-targets",
    TARGETS,
]
SIX = ["--steps", "6"]


work, hf_model, tokens = tiny_run_fixtures("trainer-lora")


def run_args(model: Path, data: Path, metrics: Path, *extra: str) -> list[str]:
    return base_run_args(model, data, metrics, *extra, common=COMMON)


def adapters(export: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(export / "adapter_model.safetensors"))


def assert_same_adapters(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.allclose(got[name], tensor, rtol=0, atol=ATOL), (name, (got[name] - tensor).abs().max())


@pytest.fixture(scope="module")
def serial(work, hf_model, tokens):
    """tp1 in this process: its losses, its PEFT export and its checkpoint."""
    metrics = work / "tp1.jsonl"
    summary = run_inprocess(
        run_args(
            hf_model,
            tokens,
            metrics,
            "--export-hf",
            str(work / "tp1-peft"),
            "--export-lora",
            "--checkpoint-dir",
            str(work / "tp1-ckpt"),
        )
    )
    assert summary.steps == 5
    found = adapters(work / "tp1-peft")
    assert len(found) == 2 * 7 * 4  # A and B of 7 modules in 4 layers
    # the weights moved: B left zero and the loss changed, so comparisons below mean something
    assert min(float(t.abs().max()) for n, t in found.items() if "lora_B" in n) > 1e-3
    return losses(metrics), found


# ---- 1. parallel equals serial -------------------------------------------------------------------------

PARALLEL_CASES = {
    "tp2pp2-fused": (4, ["--tp", "2", "--pp", "2", "--qkv", "fused", "--activation-checkpointing"]),
    "tp4-kvmult2-sp": (4, ["--tp", "4", "--kv-multiplier", "2", "--qkv", "gqa", "--sequence-parallel"]),
}


@pytest.mark.parametrize("name", list(PARALLEL_CASES))
def test_lora_parallel_equals_serial(name, work, hf_model, tokens, serial):
    nproc, extra = PARALLEL_CASES[name]
    metrics, export = work / f"{name}.jsonl", work / f"{name}-peft"
    check_ok(run_ranks(nproc, run_args(hf_model, tokens, metrics, *extra, "--export-hf", str(export), "--export-lora")))
    expected, expected_adapters = serial
    got = losses(metrics)
    assert len(got) == 5 and rel_diff(got, expected) < REL, (got, expected)
    assert_same_adapters(adapters(export), expected_adapters)


# ---- 2. tp1 equals peft + transformers + AdamW --------------------------------------------------------------


def test_lora_serial_equals_peft_and_adamw(hf_model, tokens, serial):
    """tp1 is peft's LoRA model on the transformers model, trained by torch AdamW from the same
    initial adapters on the same data, step for step."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shardkit.formats import load_config
    from shardkit.layout import make_layout
    from trainer.lora import LoraSettings, make_lora, parse_targets
    from trainer.model import ModelSpec

    base = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=RANK, lora_alpha=int(ALPHA), lora_dropout=0.0, target_modules=PEFT_TARGETS)
    )
    spec = ModelSpec.from_config(load_config(hf_model), make_layout())
    lora = make_lora(LoraSettings(RANK, ALPHA, parse_targets(TARGETS)), spec)
    initial = lora.initial(1234, 0, 0)  # the trainer's initial adapters (tp1: the full tensors)
    trained = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.data.copy_(initial[name.removeprefix("base_model.model.").replace(".default", "")])
            trained.append(p)
    assert len(trained) == len(initial)
    got = adamw_reference(model, trained, tokens, EPS)
    expected, expected_adapters = serial
    assert rel_diff(expected, got) < REL, (expected, got)
    ours = {n.replace(".default", ""): p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert_same_adapters(ours, expected_adapters)


# ---- 3. resume on another layout ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(work, hf_model, tokens):
    """6 steps at tp2 x dp2 with ZeRO-1 without a break, checkpointing at steps 3 and 6."""
    ckpt, metrics, export = work / "ckpt-tp2dp2", work / "six-tp2dp2.jsonl", work / "six-tp2dp2-peft"
    check_ok(
        run_ranks(
            4,
            run_args(
                hf_model,
                tokens,
                metrics,
                *SIX,
                "--tp",
                "2",
                "--dp",
                "2",
                "--zero1",
                "--qkv",
                "coalesced",
                "--checkpoint-dir",
                str(ckpt),
                "--checkpoint-every",
                "3",
                "--export-hf",
                str(export),
                "--export-lora",
            ),
        )
    )
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step_3", "step_6"]
    return losses(metrics), ckpt, adapters(export)


def test_lora_resume_on_another_layout(work, hf_model, tokens, uninterrupted):
    """The tp2 x dp2 ZeRO-1 checkpoint of step 3 resumed at tp1 reproduces steps 4-6 of the
    uninterrupted run and its final adapters (adapter pieces and their Adam moments resharded)."""
    expected, ckpt, expected_adapters = uninterrupted
    metrics, export = work / "resumed-tp1.jsonl", work / "resumed-tp1-peft"
    summary = run_inprocess(
        run_args(
            hf_model,
            tokens,
            metrics,
            *SIX,
            "--resume",
            str(ckpt / "step_3"),
            "--export-hf",
            str(export),
            "--export-lora",
        )
    )
    assert summary.first_step == 3 and summary.steps == 3
    records = steps(metrics)
    assert [r["step"] for r in records] == [4, 5, 6]
    assert rel_diff([r["loss"] for r in records], expected[3:]) < REL, ([r["loss"] for r in records], expected)
    assert_same_adapters(adapters(export), expected_adapters)


def test_lora_checkpoint_holds_only_adapters(work, hf_model, serial):
    from shardkit.formats.torch_io import safe_load

    tag = work / "tp1-ckpt" / "step_5"
    model_files = list((tag / "model").iterdir())
    assert len(model_files) == 1
    names = set(safe_load(model_files[0], mmap=False))
    assert names == {n.removeprefix("base_model.model.") for n in serial[1]}
    config = json.loads((tag / "config.json").read_text())
    assert config["trainer_lora"] == {
        "rank": RANK,
        "alpha": ALPHA,
        "targets": TARGETS.split(","),
        "base_model": str(hf_model.absolute()),
        "base_model_type": "llama",
    }


# ---- 4. exports ---------------------------------------------------------------------------------------------------


def test_lora_peft_export_loads_and_equals_the_merged_export(work, hf_model, tokens, serial):
    """The PEFT directory loads with peft on the base model; the merged export (here written by a
    resume of the final checkpoint that has nothing left to train) loads with transformers; both
    give the same logits, which differ from the base model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged_dir = work / "tp1-merged"
    summary = run_inprocess(
        run_args(
            hf_model,
            tokens,
            work / "merged.jsonl",
            "--resume",
            str(work / "tp1-ckpt" / "step_5"),
            "--export-hf",
            str(merged_dir),
        )
    )
    assert summary.steps == 0 and summary.exported
    config = json.loads((work / "tp1-peft" / "adapter_config.json").read_text())
    assert (
        config["r"] == RANK
        and config["lora_alpha"] == ALPHA
        and sorted(config["target_modules"]) == sorted(PEFT_TARGETS)
    )
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, work / "tp1-peft")(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)(input_ids=ids).logits
    assert torch.allclose(peft_logits, merged, rtol=0, atol=1e-5), (peft_logits - merged).abs().max()
    assert (peft_logits - plain).abs().max() > 1e-3, "the adapters changed nothing"


# ---- 5. bad input ---------------------------------------------------------------------------------------------------


def test_lora_bad_input_one_line_exit_2(tmp_path, work, hf_model, tokens, serial, capsys):
    from trainer.__main__ import main

    base = [
        "--model",
        str(hf_model),
        "--data",
        str(tokens),
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--no-progress",
        "--checkpoint-dir",
        str(tmp_path / "c"),
    ]
    full_ckpt = tmp_path / "full-ckpt"
    cases = [
        (["--lora-rank", "-1"], "--lora-rank must be a positive whole number"),
        (["--lora-rank", "4", "--lora-targets", "q,attn"], "unknown target 'attn'"),
        (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be positive"),
        (["--export-lora", "--export-hf", str(tmp_path / "e")], "--export-lora writes LoRA adapters"),
        (["--lora-rank", "4", "--export-lora"], "give --export-hf"),
        (["--resume", str(work / "tp1-ckpt" / "step_5")], "holds LoRA adapters (rank 4, alpha 8"),
        (
            ["--lora-rank", "8", "--lora-targets", TARGETS, "--resume", str(work / "tp1-ckpt" / "step_5")],
            "this run asks for rank 8",
        ),
    ]
    for extra, fragment in cases:
        assert main([*base, *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("trainer: error:") and fragment in err[0], (extra, err)
    code = main(["--model-config", str(hf_model / "config.json"), "--data", str(tokens), "--lora-rank", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "fine-tunes an existing model" in err[0], err
    # a checkpoint of full weights is not resumed as adapters
    run_inprocess(
        [
            "--model",
            str(hf_model),
            "--data",
            str(tokens),
            "--seq-len",
            "32",
            "--global-batch",
            "4",
            "--steps",
            "1",
            "--dtype",
            "fp32",
            "--no-progress",
            "--checkpoint-dir",
            str(full_ckpt),
        ]
    )
    assert main([*base, "--lora-rank", "4", "--resume", str(full_ckpt / "step_1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds full weights, not LoRA adapters" in err[0], err
    assert not (tmp_path / "c").exists() and not (tmp_path / "e").exists()


@pytest.mark.slow  # the same command under torchrun: test_cli_newcomer's; in process: the test above
def test_lora_bad_input_every_rank_exits_2(tmp_path, hf_model, tokens):
    done = torchrun(
        2,
        [
            "--model",
            str(hf_model),
            "--data",
            str(tokens),
            "--seq-len",
            "32",
            "--global-batch",
            "4",
            "--tp",
            "2",
            "--lora-rank",
            "4",
            "--lora-targets",
            "q,qkv",
            "--checkpoint-dir",
            str(tmp_path / "c"),
        ],
        timeout=120,
    )
    assert done.returncode == 1  # torchrun's own code when its workers fail
    assert worker_exit_codes(done.stderr) == {0: 2, 1: 2}, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("trainer: error:")]
    assert len(lines) == 1 and "unknown target 'qkv'" in lines[0], done.stderr
    assert "/trainer/" not in done.stderr and not (tmp_path / "c").exists()


# ---- the placements (no processes) ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2, pp=2, qkv="fused"),
        dict(tp=4, kv_multiplier=2, qkv="gqa"),
        dict(tp=4, kv_multiplier=2, kv_replication="blocked", qkv="coalesced"),
    ],
)
def test_adapter_pieces_follow_the_base_placement(layout, hf_model):
    """B of q/k/v/gate/up holds exactly the base piece's rows (kv replicas included), A of o/down
    its columns; the pieces of every rank gather to the full initial adapters of tp1 (the same
    adapters in every layout)."""
    from shardkit.formats import load_config
    from shardkit.layout import make_layout
    from shardkit.placements import gather
    from trainer.lora import LoraSettings, make_lora, parse_targets
    from trainer.model import ModelSpec

    config = load_config(hf_model)
    settings = LoraSettings(RANK, ALPHA, parse_targets(TARGETS))
    serial_lora = make_lora(settings, ModelSpec.from_config(config, make_layout()))
    full = serial_lora.initial(1234, 0, 0)
    spec = ModelSpec.from_config(config, make_layout(**layout))
    lora = make_lora(settings, spec)
    held = []
    for pp in range(spec.layout.pp):
        for tp in range(spec.layout.tp):
            base = {s.source: [] for p in spec.rank_pieces(tp, pp) for s in p.segments}
            for p in spec.rank_pieces(tp, pp):
                for s in p.segments:
                    base[s.source].append((s.dim, s.start, s.stop))
            pieces = {p.name: p for p in lora.spec.rank_pieces(tp, pp)}
            tensors = lora.initial(1234, tp, pp)
            for name, piece in pieces.items():
                module, kind = name.rsplit(".lora_", 1)
                cut = [(s.dim, s.start, s.stop) for s in piece.segments]
                if (
                    kind == "B.weight"
                    and module.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
                    or kind == "A.weight"
                    and module.endswith(("o_proj", "down_proj"))
                ):
                    merged = []  # the base piece's segments of this weight, adjacent ones merged
                    for d, a, b in base[module + ".weight"]:
                        if merged and merged[-1][2] == a:
                            merged[-1] = (d, merged[-1][1], b)
                        else:
                            merged.append((d, a, b))
                    assert cut == merged, name
                else:
                    assert tensors[name].shape == full[name].shape, name  # replicated: whole
                held.append((piece, tensors[name]))
    for name, tensor in full.items():
        assert torch.equal(gather(name, tensor.shape, [(p, t) for p, t in held if p.name == name]), tensor), name
