"""The slim trainer (trainer/): acceptance tests of the issue, plus unit tests of its parts.

1. parallel equals serial: from the same weights and data, the per-step losses of tp1pp1, tp2pp1,
   tp1pp2, tp2pp2, dp2 (with and without ZeRO-1) and tp4 with kv-multiplier 2 (8 q heads, 2 kv
   heads) agree to 1e-5 relative over 5 steps (real gloo jobs, fp32, their ranks forked by
   trainer_helpers.run_ranks, as is the README's command run twice; the failure cases run under
   torchrun);
   tp1pp1 also equals transformers' model + torch AdamW; exports of tp1pp1 and tp2pp2 hold the
   same weights;
3. a tiny model learns the bundled text (loss well below the unigram entropy) and its
   --export-hf output loads with transformers and generates;
4. bad input: one line on rank 0, every rank exits with code 2 (torchrun itself exits 1), nothing
   written, no hang.
(2, resuming on another layout, is in the checkpoint section at the end.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_helpers import (
    COMMON,
    CORPUS,
    adamw_reference,
    check_ok,
    corpus_tokens,
    losses,
    rel_diff,
    run_args,
    run_inprocess,
    run_ranks,
    serial_adamw_step,
    steps,
    tiny_run_fixtures,
    torchrun,
    worker_exit_codes,
)

from shardkit import Layout, convert
from shardkit.formats.manifest import file_entry, file_record
from shardkit.testing import make_tiny_model

CONFIG = "llama-trainer-tiny"  # 8 q heads, 2 kv heads, head_dim 4, hidden 32, 4 layers, vocab 256
REL = 1e-5


work, hf_model, tokens = tiny_run_fixtures("trainer", CONFIG)


@pytest.fixture(scope="module")
def serial(work, hf_model, tokens):
    """The reference: tp1pp1 in this process; its metrics and its exported HF weights."""
    metrics = work / "tp1pp1.jsonl"
    summary = run_inprocess(run_args(hf_model, tokens, metrics, "--export-hf", str(work / "tp1pp1-export")))
    assert summary.steps == 5
    return losses(metrics), work / "tp1pp1-export"


# ---- 1. parallel equals serial ------------------------------------------------------------------------

PARALLEL_CASES = {
    "tp2pp1": (2, ["--tp", "2", "--qkv", "gqa"]),
    "tp1pp2": (2, ["--pp", "2"]),
    "tp2pp2": (4, ["--tp", "2", "--pp", "2", "--qkv", "fused"]),
    "dp2": (2, ["--dp", "2"]),
    "dp2-zero1": (2, ["--dp", "2", "--zero1"]),
    "tp4-kvmult2": (4, ["--tp", "4", "--kv-multiplier", "2", "--qkv", "gqa"]),
}
# (blocked kv replication, sequence parallelism and activation checkpointing: the tp4 resume below)


@pytest.mark.parametrize("name", list(PARALLEL_CASES))
def test_parallel_equals_serial(name, work, hf_model, tokens, serial):
    nproc, extra = PARALLEL_CASES[name]
    model = hf_model
    if name == "tp2pp2":
        # start from shards of ANOTHER layout: resharded on load to the run's tp2pp2
        model = work / "sharded-tp4-gqa"
        if not model.exists():
            convert(hf_model, model, Layout(tp=4, kv_multiplier=2, qkv="gqa"))
        extra = [*extra, "--export-hf", str(work / "tp2pp2-export")]
    metrics = work / f"{name}.jsonl"
    check_ok(run_ranks(nproc, run_args(model, tokens, metrics, *extra)))
    got, (expected, _) = losses(metrics), serial
    assert len(got) == 5
    assert rel_diff(got, expected) < REL, f"{name}: {got} vs tp1pp1 {expected}"
    assert abs(expected[-1] - expected[0]) > 0.1, "the weights barely moved: the comparison would be weak"
    if name == "tp2pp2":
        from safetensors.torch import load_file

        ours = load_file(str(work / "tp2pp2-export" / "model.safetensors"))
        ref = load_file(str(serial[1] / "model.safetensors"))
        assert set(ours) == set(ref)
        for k in ref:
            assert torch.allclose(ours[k], ref[k], rtol=1e-4, atol=1e-5), k


def test_serial_equals_transformers_and_adamw(work, hf_model, tokens, serial):
    """tp1pp1 is the Hugging Face model trained by torch.optim.AdamW, step for step."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_model, dtype=torch.float32)
    got = adamw_reference(model, list(model.parameters()), tokens)
    assert rel_diff(serial[0], got) < REL, (serial[0], got)


# ---- 3. a tiny model learns ---------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_model_learns_and_exports(work, tokens):
    """A transformers-initialised tiny model on the bundled text (bytes): the loss falls well below
    the unigram entropy in 150 CPU steps; the --export-hf output loads with transformers, has the
    trained model's loss and generates."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardkit.testing import fixture_config
    from trainer.data import unigram_entropy

    cfg = fixture_config(CONFIG)
    model_type = cfg.pop("model_type")
    cfg.pop("architectures")
    torch.manual_seed(0)
    start = work / "learn-hf"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg)).save_pretrained(start)
    metrics, export = work / "learn.jsonl", work / "learn-export"
    run_inprocess(
        [
            "--model",
            str(start),
            "--data",
            str(tokens),
            "--metrics",
            str(metrics),
            "--seq-len",
            "128",
            "--micro-batch",
            "16",
            "--global-batch",
            "16",
            "--steps",
            "150",
            "--lr",
            "1e-2",
            "--warmup",
            "15",
            "--dtype",
            "fp32",
            "--no-progress",
            "--threads",
            "1",
            "--export-hf",
            str(export),
        ]
    )
    text = np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8)
    entropy = unigram_entropy(text)
    trained = losses(metrics)
    final = float(np.mean(trained[-10:]))
    assert trained[0] > entropy + 1.0  # starts near log(256)
    assert final < 0.75 * entropy, f"final loss {final:.3f} is not well below the unigram entropy {entropy:.3f}"

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    windows = torch.from_numpy(text[: 16 * 128].astype(np.int64)).view(16, 128)  # the trained length
    with torch.no_grad():
        loss = model(input_ids=windows, labels=windows).loss.item()
    assert loss < 0.8 * entropy, f"exported model's loss {loss:.3f} (trainer's {final:.3f})"
    prompt = torch.tensor([list(b"The river ")])
    out = model.generate(prompt, max_new_tokens=40, do_sample=False)
    assert out.shape == (1, prompt.shape[1] + 40)
    generated = bytes(out[0, prompt.shape[1] :].tolist())
    assert sum(32 <= b < 127 for b in generated) >= 30, generated  # mostly printable text


# ---- 4. bad input -------------------------------------------------------------------------------------


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("trainer: error:")]


BAD_CASES = {
    # name: (nproc, extra args, expected message fragment)
    "layout-vs-model": (2, ["--tp", "2", "--kv-multiplier", "3"], "kv-multiplier 3"),
    "layout-vs-world": (2, ["--tp", "2", "--pp", "2"], "does not divide the 2 processes"),
    "missing-data": (2, ["--tp", "2", "--data", "/nonexistent/tokens.bin"], "does not exist"),
}


# one case under torchrun in the main suite (the others: -m slow, and single-process below)
@pytest.mark.parametrize(
    "name", [name if name == "layout-vs-model" else pytest.param(name, marks=pytest.mark.slow) for name in BAD_CASES]
)
def test_bad_input_one_line_every_rank_exits(name, work, hf_model, tokens):
    nproc, extra, fragment = BAD_CASES[name]
    out = work / f"bad-{name}"
    args = [
        "--model",
        str(hf_model),
        "--data",
        str(tokens),
        *COMMON,
        "--checkpoint-dir",
        str(out / "ckpt"),
        "--metrics",
        str(out / "metrics.jsonl"),
        "--export-hf",
        str(out / "export"),
        *extra,
    ]
    done = torchrun(nproc, args, timeout=120)  # a hang fails here
    assert done.returncode == 1, done.stderr  # torchrun's own code when its workers fail
    assert worker_exit_codes(done.stderr) == {rank: 2 for rank in range(nproc)}, done.stderr  # none SIGTERMed
    lines = _error_lines(done.stderr)
    assert len(lines) == 1, done.stderr  # rank 0 only, one line
    assert fragment in lines[0], lines[0]
    assert "/trainer/" not in done.stderr, "a traceback from the trainer leaked"
    assert not out.exists(), "bad input wrote something"


def test_bad_input_single_process(tmp_path, hf_model, tokens, capsys):
    from trainer.__main__ import main

    code = main(["--model", str(tmp_path / "nope"), "--data", str(tokens), "--checkpoint-dir", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("trainer: error:") and "does not exist" in err[0]
    code = main(
        [
            "--model",
            str(hf_model),
            "--data",
            str(tokens),
            "--seq-len",
            "32",
            "--global-batch",
            "3",
            "--micro-batch",
            "2",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "multiple of --micro-batch 2" in err[0]
    from trainer.config import parse_args
    from trainer.errors import TrainerError
    from trainer.loop import plan_run

    with pytest.raises(TrainerError, match="launch 4 processes"):
        plan_run(parse_args(["--model", str(hf_model), "--data", str(tokens), "--dp", "4"]), world=2)
    with pytest.raises(TrainerError, match="sequence-parallel needs --seq-len divisible"):
        plan_run(
            parse_args(
                [
                    "--model",
                    str(hf_model),
                    "--data",
                    str(tokens),
                    "--tp",
                    "4",
                    "--kv-multiplier",
                    "2",
                    "--seq-len",
                    "30",
                    "--sequence-parallel",
                ]
            ),
            world=4,
        )
    from trainer.data import write_tokens

    wide = write_tokens(tmp_path / "wide.bin", np.arange(5000) % 300, 512)  # another tokenizer's ids
    (tmp_path / "t.bin").write_bytes(b"not a token file at all, sorry" * 3)
    for data, fragment in ((tmp_path / "t.bin", "not a token file"), (wide, "vocabulary of 512 ids")):
        assert (
            main(
                [
                    "--model",
                    str(hf_model),
                    "--data",
                    str(data),
                    "--seq-len",
                    "32",
                    "--checkpoint-dir",
                    str(tmp_path / "c"),
                ]
            )
            == 2
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "c").exists()


def test_one_rank_failing_stops_every_rank(work, hf_model, tokens):
    """A failure on ONE rank after the job formed (its rank file is corrupt): every rank exits,
    rank 0 says which rank failed and why; no hang."""
    shards = work / "sharded-tp2-corrupt"
    convert(hf_model, shards, Layout(tp=2))
    victim = shards / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    victim.write_bytes(victim.read_bytes()[:200])
    done = torchrun(2, ["--model", str(shards), "--data", str(tokens), *COMMON, "--tp", "2"], timeout=120)
    assert done.returncode == 1
    assert worker_exit_codes(done.stderr) == {0: 2, 1: 2}, done.stderr  # the same code on every rank
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("trainer:") and "error" in ln]
    assert len(lines) == 1 and "rank 1 of 2" in lines[0] and "truncated or corrupt" in lines[0], done.stderr
    assert "/trainer/" not in done.stderr, "a trainer traceback without --debug"


def test_debug_prints_the_failing_ranks_traceback(tmp_path, tokens, capsys):
    from trainer.__main__ import main

    assert main(["--model", str(tmp_path / "nope"), "--data", str(tokens), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("trainer: error:")


# ---- re-running a finished command; --export-hf ----------------------------------------------------------


def test_rerunning_the_finished_readme_command_succeeds(tmp_path, hf_model, tokens):
    """README's command (checkpoints, async save, latest_if_exists, --export-hf) run twice as a
    2-rank gloo job: the second run finds the run finished, keeps its own export and exits 0."""
    ckpt, export = tmp_path / "ckpt", tmp_path / "trained"
    args = [
        "--model",
        str(hf_model),
        "--data",
        str(tokens),
        *COMMON,
        "--steps",
        "2",
        "--tp",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "1",
        "--num-kept",
        "3",
        "--async-save",
        "--resume",
        "latest_if_exists",
        "--export-hf",
        str(export),
    ]
    check_ok(run_ranks(2, args, timeout=120))
    weights = (export / "model.safetensors").read_bytes()
    assert json.loads((export / "trainer-export.json").read_text())["step"] == 2
    again = run_ranks(2, args, timeout=120)
    check_ok(again)
    assert "already holds this run's export of step 2" in again.stderr, again.stderr
    assert "nothing to train: already at step 2" in again.stderr
    assert (export / "model.safetensors").read_bytes() == weights


def test_export_destination_rules(tmp_path, hf_model, tokens, capsys):
    """--export-hf never clobbers what is not this run's export unless --overwrite-export; this
    run's export is replaced when the run went on; never the --model."""
    from safetensors.torch import load_file

    from trainer.__main__ import main

    export = tmp_path / "out"
    export.mkdir()
    (export / "notes.txt").write_text("mine")
    base = ["--model", str(hf_model), "--data", str(tokens), *COMMON, "--steps", "1", "--export-hf", str(export)]
    assert main(base) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an earlier export of this run" in err[0] and "--overwrite-export" in err[0], err
    assert (export / "notes.txt").read_text() == "mine"
    assert main([*base, "--overwrite-export"]) == 0
    assert not (export / "notes.txt").exists() and (export / "config.json").is_file()
    first = load_file(str(export / "model.safetensors"))
    assert main([*base, "--steps", "2"]) == 0  # the same run, one step further: its export is replaced
    assert json.loads((export / "trainer-export.json").read_text())["step"] == 2
    assert not torch.equal(
        load_file(str(export / "model.safetensors"))["model.norm.weight"], first["model.norm.weight"]
    )
    capsys.readouterr()
    assert main([*base[:-1], str(hf_model), "--overwrite-export"]) == 2
    assert "overlaps --model" in capsys.readouterr().err
    # nor an alias of it: through a symlink, or through a `..` detour
    alias = tmp_path / "alias"
    alias.symlink_to(hf_model, target_is_directory=True)
    detour = f"{hf_model.parent}/{tmp_path.name}-nowhere/../{hf_model.name}"
    for other in (alias, detour):
        assert main([*base[:-1], str(other), "--overwrite-export"]) == 2
        assert "overlaps --model" in capsys.readouterr().err
    assert (hf_model / "config.json").is_file()


def test_load_keeps_the_sources_qkv_style_and_kv_replication(tmp_path, hf_model, tokens, caplog):
    """Shards (tp4, kv-multiplier 2, blocked, fused qkv) resharded on load to tp2: the run keeps
    fused and blocked (and says so) unless --qkv / --kv-replication ask otherwise."""
    import logging

    from trainer.config import parse_args
    from trainer.loop import plan_run

    shards = tmp_path / "tp4-fused-blocked"
    convert(hf_model, shards, Layout(tp=4, kv_multiplier=2, kv_replication="blocked", qkv="fused"))
    base = ["--model", str(shards), "--data", str(tokens), "--tp", "2", "--seq-len", "32"]
    with caplog.at_level(logging.INFO, logger="trainer"):
        layout = plan_run(parse_args(base), world=2).spec.layout
    assert (layout.tp, layout.qkv, layout.kv_replication) == (2, "fused", "blocked")
    kept = [r.getMessage() for r in caplog.records if "keeping" in r.getMessage()]
    assert len(kept) == 1 and "fused" in kept[0] and "blocked" in kept[0], kept
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        layout = plan_run(parse_args([*base, "--qkv", "gqa"]), world=2).spec.layout
    assert (layout.qkv, layout.kv_replication) == ("gqa", "blocked")
    assert (
        plan_run(
            parse_args(["--model", str(hf_model), "--data", str(tokens), "--seq-len", "32"]), world=1
        ).spec.layout.qkv
        == "separate"
    )


# ---- parts --------------------------------------------------------------------------------------------


def test_data_order_is_deterministic_sliced_and_resumable(tmp_path):
    from trainer.data import Batches, TokenFile, write_tokens

    path = write_tokens(tmp_path / "d.bin", np.arange(1000) % 97, 97)
    f = TokenFile(path)
    whole = Batches(f, 9, 8, 2, 1, 0, seed=5)
    seen = [whole.step_batch()[0] for _ in range(30)]  # > 1 epoch (110 samples)
    for dp in (2, 4):
        ranks = [Batches(f, 9, 8, 2, dp, r, seed=5) for r in range(dp)]
        for step in range(30):
            parts = [b.step_batch()[0] for b in ranks]
            assert torch.equal(torch.cat(parts), seen[step])
    resumed = Batches(f, 9, 8, 1, 2, 1, seed=5)
    resumed.load_state(whole.state().to_dict() | {"consumed_samples": 8 * 17})
    assert torch.equal(resumed.step_batch()[0], seen[17][4:])
    inputs, targets = Batches(f, 9, 8, 2, 1, 0, seed=5).step_batch()
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_prepare_data_bytes(tmp_path):
    import subprocess
    import sys

    from trainer.data import TokenFile

    out = tmp_path / "tokens.bin"
    done = subprocess.run(
        [sys.executable, "scripts/prepare_data.py", str(CORPUS), "--out", str(out)],
        cwd=Path(__file__).resolve().parents[3],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "unigram entropy" in done.stdout
    f = TokenFile(out)
    assert f.vocab_size == 256 and len(f) == CORPUS.stat().st_size
    assert bytes(np.asarray(f.tokens[:20], dtype=np.uint8)) == CORPUS.read_bytes()[:20]


def test_lr_schedule():
    from trainer.optim import LRSchedule

    s = LRSchedule(1.0, 10, 110, "cosine", 0.1)
    assert s.at(0) == pytest.approx(0.1) and s.at(9) == pytest.approx(1.0)
    assert s.at(10) == pytest.approx(1.0) and s.at(60) == pytest.approx(0.55) and s.at(110) == pytest.approx(0.1)
    assert LRSchedule(1.0, 0, 10, "constant").at(7) == 1.0


def test_model_state_dict_is_the_rank_file(work, hf_model):
    """A StageModel's state_dict has exactly the names and shapes of the rank's pieces, for every
    qkv style: what the trainer holds IS the NxD rank file."""
    from shardkit import open_checkpoint
    from trainer.layers import TPContext
    from trainer.model import ModelSpec, StageModel
    from trainer.parallel import Group
    from trainer.weights import read_rank_pieces

    ckpt = open_checkpoint(hf_model)
    for qkv in ("separate", "gqa", "fused", "coalesced"):
        spec = ModelSpec.from_config(ckpt.config, Layout(tp=4, pp=2, kv_multiplier=2, qkv=qkv))
        for tp, pp in ((0, 0), (3, 1)):
            pieces = read_rank_pieces(ckpt, spec, tp, pp)
            model = StageModel(spec, TPContext(Group([0, 1, 2, 3], tp)), pp, torch.float32, torch.device("cpu"))
            model.load_pieces(pieces)
            state = model.state_dict()
            assert list(state) == [p.name for p in spec.rank_pieces(tp, pp)]
            assert all(torch.equal(state[k], pieces[k]) for k in pieces)


def test_issue_command_line_parses():
    from trainer import parse_args

    cfg = parse_args(
        "--model ./llama-tp2pp2 --data ./tokens.bin --tp 2 --pp 2 --dp 2 --zero1 --micro-batch 1 "
        "--global-batch 16 --seq-len 2048 --lr 3e-4 --warmup 100 --steps 1000 --checkpoint-dir ./ckpt "
        "--checkpoint-every 100 --num-kept 3 --async-save --resume latest_if_exists".split()
    )
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.zero1, cfg.async_save, cfg.num_kept) == (2, 2, 2, True, True, 3)
    assert cfg.resume == "latest_if_exists" and cfg.lr == 3e-4 and cfg.seq_len == 2048


def test_metrics_records(work, serial):
    records = steps(work / "tp1pp1.jsonl")
    for key in ("loss", "lr", "grad_norm", "step_time", "tokens_per_s", "comm_share", "consumed_samples"):
        assert all(key in r and math.isfinite(r[key]) for r in records), key
    assert [r["consumed_samples"] for r in records] == [4, 8, 12, 16, 20]
    start = json.loads((work / "tp1pp1.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["layout"]["tp"] == 1


# ---- 2. resume anywhere (checkpoints through shardkit.checkpoint) ---------------------------------------

SIX = ["--steps", "6"]  # after COMMON's 5: the later option wins


@pytest.fixture(scope="module")
def uninterrupted(work, hf_model, tokens):
    """6 steps at tp2pp2 without a break, checkpointing at step 3 (and 6)."""
    ckpt, metrics = work / "ckpt-tp2pp2", work / "six-tp2pp2.jsonl"
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
                "--pp",
                "2",
                "--checkpoint-dir",
                str(ckpt),
                "--checkpoint-every",
                "3",
            ),
        )
    )
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step_3", "step_6"]
    return losses(metrics), ckpt


@pytest.mark.parametrize("target", ["tp4pp1", "tp1pp1"])
def test_resume_on_another_layout(target, work, hf_model, tokens, uninterrupted):
    """Resuming the tp2pp2 checkpoint of step 3 at tp4pp1 (kv-multiplier 2, blocked, fused qkv, with
    sequence parallelism and activation checkpointing) and at tp1pp1 reproduces steps 4-6 of the
    uninterrupted run: weights, Adam moments, schedule and data position."""
    expected, ckpt = uninterrupted
    metrics = work / f"resume-{target}.jsonl"
    args = run_args(hf_model, tokens, metrics, *SIX, "--resume", str(ckpt / "step_3"))
    if target == "tp4pp1":
        check_ok(
            run_ranks(
                4,
                [
                    *args,
                    "--tp",
                    "4",
                    "--kv-multiplier",
                    "2",
                    "--kv-replication",
                    "blocked",
                    "--qkv",
                    "fused",
                    "--sequence-parallel",
                    "--activation-checkpointing",
                ],
            )
        )
    else:
        summary = run_inprocess(args)
        assert summary.first_step == 3 and summary.steps == 3
    records = steps(metrics)
    assert [r["step"] for r in records] == [4, 5, 6]
    assert [r["consumed_samples"] for r in records] == [16, 20, 24]
    assert rel_diff([r["loss"] for r in records], expected[3:]) < REL, ([r["loss"] for r in records], expected)


def test_resume_checkpoint_of_another_model(work, tokens, uninterrupted):
    """Bad input 4: a checkpoint of another model: one line, every rank exits, nothing written."""
    from shardkit.testing import fixture_config

    cfg = fixture_config(CONFIG) | {"hidden_size": 64, "intermediate_size": 128}
    other = make_tiny_model(cfg, work / "other-hf")
    out = work / "bad-other-model"
    done = run_ranks(
        2,
        [
            "--model",
            str(other),
            "--data",
            str(tokens),
            *COMMON,
            "--tp",
            "2",
            "--resume",
            str(uninterrupted[1] / "step_3"),
            "--metrics",
            str(out / "m.jsonl"),
        ],
        timeout=120,
    )
    assert done.returncode != 0
    lines = _error_lines(done.stderr)
    assert len(lines) == 1 and "another model" in lines[0] and "hidden_size" in lines[0], done.stderr
    assert not out.exists()


def test_zero1_async_retention_and_latest_if_exists(work, hf_model, tokens):
    """A dp2 ZeRO-1 job saving asynchronously every 2 steps, keeping 1 tag, is stopped after 4 steps
    and started again with the same command (--resume latest_if_exists): steps 5-6 equal those of an
    uninterrupted run. (Constant LR after warm-up, so the schedule does not depend on --steps.)"""
    ckpt = work / "ckpt-zero1"
    flags = [
        "--dp",
        "2",
        "--zero1",
        "--decay",
        "constant",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "2",
        "--num-kept",
        "1",
        "--async-save",
        "--resume",
        "latest_if_exists",
    ]
    check_ok(run_ranks(2, run_args(hf_model, tokens, work / "z-first.jsonl", "--steps", "4", *flags)))
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step_4"]
    check_ok(run_ranks(2, run_args(hf_model, tokens, work / "z-second.jsonl", *SIX, *flags)))
    run_inprocess(run_args(hf_model, tokens, work / "z-ref.jsonl", *SIX, "--decay", "constant"))
    first, second, ref = (losses(work / f"z-{n}.jsonl") for n in ("first", "second", "ref"))
    assert [r["step"] for r in steps(work / "z-second.jsonl")] == [5, 6]
    assert rel_diff(first + second, ref) < REL, (first, second, ref)
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["step_6"]


def test_device_and_backend_choice_with_a_fake_torch_xla(monkeypatch):
    """torch-xla installed: the xla device (torch_xla.core.xla_model.xla_device, as documented) and
    the xla backend with init_method "xla://"; forcing a device that is absent is a clear error."""
    import sys
    import types

    import torch.distributed as dist

    from trainer import parallel
    from trainer.errors import TrainerError

    assert parallel.choose_device(None, 0) == torch.device("cpu")  # no torch-xla, no CUDA here
    with pytest.raises(TrainerError, match="needs torch-xla"):
        parallel.choose_device("xla", 0)
    with pytest.raises(TrainerError, match="no CUDA device"):
        parallel.choose_device("cuda", 0)

    xla_device = torch.device("meta")  # stands for the XLA device object torch-xla returns
    xla_model = types.SimpleNamespace(xla_device=lambda: xla_device)
    core = types.SimpleNamespace(xla_model=xla_model)
    fake = types.ModuleType("torch_xla")
    fake.core = core
    monkeypatch.setitem(sys.modules, "torch_xla", fake)
    monkeypatch.setitem(sys.modules, "torch_xla.core", core)
    monkeypatch.setitem(sys.modules, "torch_xla.core.xla_model", xla_model)
    assert parallel.choose_device(None, 0) is xla_device

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: ("group", tuple(ranks)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    par = parallel.init_parallel(1, 1, 2, torch.device("xla"), 30.0)
    ((backend, kwargs),) = calls
    assert backend == "xla" and kwargs["init_method"] == "xla://" and par.backend == "xla"
    assert par.dp_group.ranks == [0, 1]


# ---- NxD's own checkpoints: resume, first step = AdamW (issue 11) -------------------------------------

NXD_CASES = {
    # checkpoint -> (processes, the trainer's layout flags)
    "tp2_dp2_pp1_torch": (4, ["--tp", "2", "--dp", "2", "--zero1", "--qkv", "gqa"]),  # NxD's dp cut, padded rows
    "tp2_pp2_dp1_torch": (1, []),  # remapped to tp1 pp1, separate q/k/v
    "reshard:tp2_dp2_pp1_xser": (2, ["--dp", "2", "--zero1"]),  # `ckpt reshard` to tp1 dp2 (xser), then dp2
}
NXD_RUN = [
    "--steps",
    "4",
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
]


def nxd_golden() -> Path:
    from conftest import golden_or_skip

    root = golden_or_skip() / "nxd-train"
    if not root.is_dir():
        pytest.skip(f"NxD training reference checkpoints not found at {root}")
    return root


@pytest.mark.parametrize("case", list(NXD_CASES))
def test_resume_from_nxd_checkpoint_first_step_is_adamw(case, tmp_path):
    """Resuming a checkpoint NxD's own trainer wrote (or `ckpt reshard`'s output of one), in another
    or the same layout: the first step's update equals one torch AdamW step of transformers' model
    from the checkpoint's full state (weights, moments, step, hyperparameters, NxD's schedule) on
    the same batch, to 1e-6."""
    from safetensors.torch import load_file

    from shardkit.api import export_checkpoint
    from shardkit.checkpoint.reshard import reshard_training
    from trainer.data import Batches, TokenFile

    root = nxd_golden()
    config = root / "config.json"
    nproc, flags = NXD_CASES[case]
    name = case.split(":")[-1]
    tag = root / name / "step_3"
    if case.startswith("reshard:"):
        reshard_training(root / name, tmp_path / "resharded", Layout(qkv="gqa"), dp=2, config=config)
        tag = tmp_path / "resharded" / "step_3"
        assert (tag / "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt").is_file()
    hf = tmp_path / "hf"  # --model: the model's config (an NxD tag has none) and its weights, as HF
    export_checkpoint(root / name, hf, config=config)
    tokens = corpus_tokens(tmp_path / "tokens.bin", vocab=90)
    args = [
        "--model",
        str(hf),
        "--data",
        str(tokens),
        "--resume",
        str(tag),
        "--export-hf",
        str(tmp_path / "out"),
        "--metrics",
        str(tmp_path / "m.jsonl"),
        *NXD_RUN,
        *flags,
    ]
    if nproc == 1:
        run_inprocess(args)
    else:
        check_ok(run_ranks(nproc, args))
    (record,) = steps(tmp_path / "m.jsonl")
    assert record["step"] == 4

    inputs, targets = Batches(TokenFile(tokens), 16, 4, 1, 1, 0, 1234, 90).step_batch()
    before, after, loss = serial_adamw_step(tag, config, inputs, targets)
    assert abs(record["loss"] - loss) <= 1e-5 * loss
    assert record["lr"] == pytest.approx(0.000962320368593087, rel=1e-12)  # NxD's schedule at step 4
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(after)
    moved = max(float((after[n] - before[n]).abs().max()) for n in after)
    assert moved > 1e-4, "the step barely moved the weights: the comparison would be weak"
    for n in after:
        torch.testing.assert_close(got[n], after[n], rtol=0, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


# ---- ZeRO-1 checkpoints sharded over dp, fp32 master weights end to end --------------------------------


@pytest.fixture(scope="module")
def zero1_bf16(work, hf_model, tokens) -> Path:
    """tp2 dp2 ZeRO-1 in bf16 (fp32 master weights, weight decay 0.1) for 2 steps: tag step_2."""
    ckpt = work / "ckpt-zero1-bf16"
    check_ok(
        run_ranks(
            4,
            run_args(
                hf_model,
                tokens,
                work / "zb.jsonl",
                "--steps",
                "2",
                "--dtype",
                "bf16",
                "--tp",
                "2",
                "--dp",
                "2",
                "--zero1",
                "--qkv",
                "gqa",
                "--weight-decay",
                "0.1",
                "--checkpoint-dir",
                str(ckpt),
            ),
        )
    )
    return ckpt / "step_2"


def test_zero1_checkpoint_each_dp_rank_writes_its_nxd_shard(zero1_bf16):
    """With ZeRO-1 every dp rank writes its own optim/dp_rank_DD_... file in NxD's form (nothing is
    gathered): base_state and sharded_master_weights are NxD's dp cut (zero-padded dim 0, chunk d) of
    the merged tp-local state, the param groups are NxD's two, the fp32 masters are real fp32 values
    whose bf16 rounding is the saved model."""
    from shardkit.checkpoint import load_checkpoint
    from shardkit.checkpoint.zero1 import dp_shard

    tag = zero1_bf16
    assert sorted(p.name for p in (tag / "optim").iterdir()) == [
        f"dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt" for d in range(2) for t in range(2)
    ]
    assert sorted(p.name for p in (tag / "model").iterdir()) == [
        f"dp_rank_00_tp_rank_{t:02d}_pp_rank_00.pt" for t in range(2)
    ]
    info = json.loads((tag / "shardkit.json").read_text())["checkpoint"]
    assert info["zero1"] and info["dp"] == 2 and info["world_size"] == 4 and info["optimizer"]["master_weights"]
    finer = 0
    for t in range(2):
        loaded = load_checkpoint(tag.parent, tag.name, rank=(t, 0))  # dp shards merged
        order = [n for g in (0, 1) for n in loaded.model if loaded.optimizer.groups[n] == g]
        assert [loaded.optimizer.groups[n] for n in order].count(1) == 9  # 4 layers x 2 norms + model.norm
        shards = []
        for d in range(2):
            obj = torch.load(tag / f"optim/dp_rank_{d:02d}_tp_rank_{t:02d}_pp_rank_00.pt", weights_only=True)
            assert list(obj) == ["state", "param_groups", "base_state", "shape_info", "sharded_master_weights"]
            assert [g["weight_decay"] for g in obj["param_groups"]] == [0.1, 0.0]
            assert [g["params"] for g in obj["param_groups"]] == [
                list(range(len(order) - 9)),
                list(range(len(order) - 9, len(order))),
            ]
            for idx, name in enumerate(order):
                state = loaded.optimizer.state[name]
                assert obj["shape_info"][idx] == list(loaded.model[name].shape)
                assert float(obj["base_state"][idx]["step"]) == 2.0
                for m in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(obj["base_state"][idx][m], dp_shard(state[m], 2, d)), (name, m, d)
                assert torch.equal(obj["sharded_master_weights"][idx], dp_shard(state["master"], 2, d))
            shards.append(obj["base_state"][1]["exp_avg"])  # layer 0's q
        assert not torch.equal(shards[0], shards[1])  # each dp rank its own rows, not a copy
        for name, weight in loaded.model.items():
            master = loaded.optimizer.state[name]["master"]
            assert weight.dtype == torch.bfloat16 and torch.equal(master.to(torch.bfloat16), weight)
            finer += int(not torch.equal(master, weight.float()))
    assert finer > 0, "the masters hold nothing beyond the bf16 weights: they were not saved"


def _strip_model_data(tag: Path) -> None:
    """Model files without tensor data (NxD's avoid_saving_lower_precision_weights), the manifest
    updated to match: the weights live only in the optimizer files' master weights."""
    manifest = json.loads((tag / "shardkit.json").read_text())
    for f in (tag / "model").iterdir():
        names = torch.load(f, weights_only=True)
        torch.save({k: torch.empty(0, dtype=v.dtype) for k, v in names.items()}, str(f))
        entry = next(e for e in manifest["files"] if e["path"] == f"model/{f.name}")
        entry.update(file_entry(file_record(f, tag)))
    (tag / "shardkit.json").write_text(json.dumps(manifest))


def test_master_weights_survive_reshard_and_carry_a_model_without_data(zero1_bf16, tmp_path):
    """The trainer's fp32 masters (tp2 dp2) resharded with --master-weights keep to tp1 dp3 (padded
    rows) are exactly the same values; with model files holding no tensor data, load and reshard
    take the model from those masters."""
    from safetensors.torch import load_file

    from shardkit.api import export_checkpoint
    from shardkit.checkpoint import load_checkpoint
    from shardkit.checkpoint.reshard import reshard_training

    tag = zero1_bf16
    src = load_checkpoint(tag.parent, tag.name, target_layout=Layout(qkv="gqa"), rank=(0, 0))
    out = reshard_training(tag.parent, tmp_path / "tp1dp3", Layout(qkv="gqa"), dp=3, master_weights="keep")
    last = torch.load(out / "optim/dp_rank_02_tp_rank_00_pp_rank_00.pt", weights_only=True)
    emb = last["sharded_master_weights"][0]  # embed_tokens: 256 rows -> 86 per dp rank, the last 2 padding
    assert emb.shape == (86, 32) and not emb[-2:].any() and emb[:-2].any()
    dst = load_checkpoint(out.parent, out.name, rank=(0, 0))
    assert set(dst.optimizer.state) == set(src.optimizer.state)
    for name, entry in src.optimizer.state.items():
        for m in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(dst.optimizer.state[name][m], entry[m]), (name, m)
        assert torch.equal(dst.model[name], src.model[name])

    _strip_model_data(out)
    bare = load_checkpoint(out.parent, out.name, target_layout=Layout(tp=2, qkv="gqa"), rank=(1, 0))
    whole = load_checkpoint(tag.parent, tag.name, rank=(1, 0))
    for name, weight in whole.model.items():
        assert bare.model[name].dtype == torch.bfloat16 and torch.equal(bare.model[name], weight), name
        assert torch.equal(bare.optimizer.state[name]["master"], whole.optimizer.state[name]["master"])
    # `ckpt export` of a tag whose model files hold no data takes the model from the masters
    export_checkpoint(out.parent, tmp_path / "hf-direct", out.name)
    direct = load_file(str(tmp_path / "hf-direct" / "model.safetensors"))
    assert torch.equal(direct["model.embed_tokens.weight"], src.model["model.embed_tokens.weight"])
    assert torch.equal(
        direct["model.layers.3.self_attn.v_proj.weight"], src.model["model.layers.3.self_attn.qkv_proj.weight_v"]
    )
    # ckpt reshard writes the model from the masters: then it exports like any checkpoint
    again = reshard_training(out.parent, tmp_path / "materialised", Layout(qkv="gqa"), dp=1)
    export_checkpoint(again.parent, tmp_path / "hf")
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(hf["model.embed_tokens.weight"], src.model["model.embed_tokens.weight"])


def test_help_explains_every_option(capsys):
    """`python -m trainer --help` prints (argparse formats each help text: a stray '%' breaks it)
    and names every TrainConfig field."""
    import dataclasses

    from trainer.config import TrainConfig, parse_args

    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    missing = [f.name for f in dataclasses.fields(TrainConfig) if f"--{f.name.replace('_', '-')}" not in out]
    assert not missing, missing
