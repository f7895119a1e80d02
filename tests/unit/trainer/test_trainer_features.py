"""The trainer's features for people coming from NxD (tests/unit/trainer/test_trainer.py has the core):

1. evaluation on held-out tokens (--eval-data/--eval-every/--eval-steps): the same loss and
   perplexity at tp1pp1, tp2pp1 and tp1pp2, in the metrics;
2. TensorBoard scalars (--tensorboard), rank 0 only; a one-line refusal without tensorboard;
3. pre-training from a config (--model-config): the same initial full weights in every layout;
4. resume honesty: a resume with other --steps/--warmup/--lr/batch sizes is refused (exit 2)
   unless --override-schedule, which says what changed;
5. sequence parallelism keeps only the local chunk of each gathered input for backward;
6. gradients all-reduced in buckets of bounded size (--grad-bucket-mb).
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from trainer_helpers import COMMON, ROOT, check_ok, losses, rel_diff, run_inprocess, run_ranks, steps, tiny_run_fixtures

from shardkit.testing import fixture_config, make_tiny_model

CONFIG = "llama-trainer-tiny"  # 8 q heads, 2 kv heads, head_dim 4, hidden 32, 4 layers, vocab 256
REL = 1e-5


work, hf_model, tokens = tiny_run_fixtures("features", CONFIG)


# ---- 5. sequence parallelism: only the local chunk is kept for backward ---------------------------------

SP_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from shardkit import open_checkpoint
    from shardkit.layout import make_layout
    from trainer.layers import TPContext, vocab_parallel_cross_entropy
    from trainer.model import ModelSpec, StageModel
    from trainer.parallel import init_parallel
    from trainer.weights import read_rank_pieces

    torch.set_num_threads(1)
    model_dir, seq, batch, hidden = sys.argv[1], 64, 2, None
    par = init_parallel(2, 1, 1, torch.device("cpu"), 120.0)
    ckpt = open_checkpoint(model_dir)
    spec = ModelSpec.from_config(ckpt.config, make_layout(tp=2))
    hidden = spec.dims.hidden_size
    pieces = read_rank_pieces(ckpt, spec, par.tp_rank, 0)
    ids = torch.randint(0, spec.dims.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(7))
    result = {}
    for sp in (False, True):
        model = StageModel(spec, TPContext(par.tp_group, sp), 0, torch.float32, torch.device("cpu"))
        model.load_pieces({k: v.clone() for k, v in pieces.items()})
        saved = {}
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = (t.shape[-1] if t.dim() else 0, t.numel(), storage.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = model.model.embed_tokens(ids[:, :-1].t())
            cos, sin = model.rotary(seq, h.dtype)
            layers_in = h
            for layer in model.model.layers.values():
                h = layer(h, cos, sin)
            layer_saved = dict(saved)
            logits = model.lm_head(model.model.norm(h))
        loss = vocab_parallel_cross_entropy(logits, ids[:, 1:].t(), par.tp_group).mean()
        loss.backward()
        grads = {}
        replicated = spec.replicated_names(0)
        for name, p in model.named_parameters():
            g = p.grad.clone()
            if sp and name in replicated:  # partial over the sequence chunks: the optimizer sums them
                par.tp_group.all_reduce(g)
            grads[name] = g
        # activations of the hidden size (whole or 1/tp of the sequence): inputs of attention and MLP
        hidden_sized = sum(n for last, numel, n in layer_saved.values()
                           if last == hidden and numel in (seq * batch * hidden, seq * batch * hidden // 2))
        result[sp] = {"loss": float(loss), "grads": grads, "layers": sum(n for *_, n in layer_saved.values()),
                      "hidden": hidden_sized}
    off, on = result[False], result[True]
    grad_rel = max(float((on["grads"][k] - off["grads"][k]).abs().max() / off["grads"][k].abs().max().clamp_min(1e-12))
                   for k in off["grads"])
    if par.tp_rank == 0:
        print("RESULT " + json.dumps({"loss": [off["loss"], on["loss"]], "grad_rel": grad_rel,
                                      "layers": [off["layers"], on["layers"]], "hidden": [off["hidden"], on["hidden"]]}))
    torch.distributed.destroy_process_group()
""")


def test_sequence_parallel_keeps_only_the_local_chunk(tmp_path):
    """tp2, 4 decoder layers, seq 64: the bytes autograd saves for backward of hidden-sized
    activations (the attention/MLP inputs, norms, residuals) with sequence parallelism are half of
    those without (the gathered inputs are not kept); loss and gradients are the same to 1e-5."""
    cfg = fixture_config(CONFIG) | {"hidden_size": 48, "head_dim": 6, "intermediate_size": 128}
    model = make_tiny_model(cfg, tmp_path / "hf", seed=1)
    script = tmp_path / "sp_child.py"
    script.write_text(SP_CHILD)
    done = torchrun_script(2, script, [str(model)])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    (loss_off, loss_on), (hidden_off, hidden_on) = result["loss"], result["hidden"]
    assert abs(loss_on - loss_off) / loss_off < REL and result["grad_rel"] < REL, result
    assert hidden_on / hidden_off == pytest.approx(0.5, abs=0.02), result  # 1/tp
    layers_off, layers_on = result["layers"]
    assert layers_on < layers_off - 0.9 * (hidden_off - hidden_on), result


def torchrun_script(nproc: int, script: Path, args: list[str], timeout: float = 180):
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        str(script),
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---- 1. evaluation; 2. TensorBoard ------------------------------------------------------------------------

EVAL = ["--eval-every", "2", "--eval-steps", "3"]


@pytest.fixture(scope="module")
def split_tokens(work, tokens):
    """The bundled text's tokens: the first 90% to train on, the rest held out."""
    import numpy as np

    from trainer.data import TokenFile, write_tokens

    ids = np.asarray(TokenFile(tokens).tokens)
    cut = len(ids) * 9 // 10
    return write_tokens(work / "train.bin", ids[:cut], 256), write_tokens(work / "eval.bin", ids[cut:], 256)


def eval_records(metrics: Path) -> list[dict]:
    return [r for r in (json.loads(line) for line in metrics.read_text().splitlines()) if r.get("event") == "eval"]


@pytest.fixture(scope="module")
def serial_eval(work, hf_model, split_tokens):
    """tp1pp1 with evaluation every 2 steps (and after the last) and TensorBoard, in this process."""
    train, held_out = split_tokens
    metrics, tb = work / "eval-tp1pp1.jsonl", work / "tb-tp1pp1"
    summary = run_inprocess(
        [
            "--model",
            str(hf_model),
            "--data",
            str(train),
            "--eval-data",
            str(held_out),
            *COMMON,
            *EVAL,
            "--metrics",
            str(metrics),
            "--tensorboard",
            str(tb),
        ]
    )
    return summary, metrics, tb


def test_evaluation_records(serial_eval):
    summary, metrics, _ = serial_eval
    records = eval_records(metrics)
    assert [r["step"] for r in records] == [2, 4, 5]
    for r in records:
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"]), rel=1e-12)
        assert r["eval_tokens"] == 3 * 4 * 32 and r["eval_time"] > 0
    assert records[-1]["eval_loss"] < records[0]["eval_loss"] - 0.1  # the model learns; held-out loss falls
    assert summary.eval_loss == records[-1]["eval_loss"]
    assert all(r["memory_mb"] > 0 for r in steps(metrics))


@pytest.mark.parametrize("layout", ["tp2pp1", "tp1pp2"])
def test_evaluation_is_the_same_in_every_layout(layout, work, hf_model, split_tokens, serial_eval):
    """Held-out loss at tp2pp1 (with the progress bar and TensorBoard) and tp1pp2 (the pipeline's
    forward-only schedule) equals tp1pp1's to 1e-5, and evaluating leaves training as it was."""
    train, held_out = split_tokens
    metrics, tb = work / f"eval-{layout}.jsonl", work / f"tb-{layout}"
    extra = ["--tp", "2", "--progress", "--tensorboard", str(tb)] if layout == "tp2pp1" else ["--pp", "2"]
    done = run_ranks(
        2,
        [
            "--model",
            str(hf_model),
            "--data",
            str(train),
            "--eval-data",
            str(held_out),
            *COMMON,
            *EVAL,
            "--metrics",
            str(metrics),
            *extra,
        ],
    )
    check_ok(done)
    _, serial_metrics, _ = serial_eval
    got, expected = eval_records(metrics), eval_records(serial_metrics)
    assert [r["step"] for r in got] == [2, 4, 5]
    assert rel_diff([r["eval_loss"] for r in got], [r["eval_loss"] for r in expected]) < REL
    assert rel_diff(losses(metrics), losses(serial_metrics)) < REL
    if layout == "tp2pp1":
        assert f"eval={expected[-1]['eval_loss']:.4f}" in done.stderr  # the progress bar shows it
        assert "eval loss" in done.stderr.splitlines()[-1]  # and the summary line
        assert len(list(tb.glob("events.out.tfevents.*"))) == 1  # rank 0 only


def test_tensorboard_event_file(serial_eval):
    """The scalars in TensorBoard's own event file (read with tensorboard's reader)."""
    pytest.importorskip("tensorboard", reason="pip install tensorboard (pyproject's test extra)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, metrics, tb = serial_eval
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "memory/peak_mb",
        "eval/loss",
        "eval/perplexity",
    } <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses(metrics), rel=1e-6)
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([r["lr"] for r in steps(metrics)], rel=1e-6)
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [
        (r["step"], pytest.approx(r["eval_loss"], rel=1e-6)) for r in eval_records(metrics)
    ]


def _fake_tensorboard_module(monkeypatch):
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("tensorboard") is None:  # the package is only checked for, never used by the fake
        monkeypatch.setitem(sys.modules, "tensorboard", types.ModuleType("tensorboard"))


def test_tensorboard_writer_calls(tmp_path, hf_model, split_tokens, monkeypatch):
    """What the trainer asks SummaryWriter to log (a fake writer: no tensorboard needed)."""
    from trainer import loop

    calls, closed = [], []

    class FakeWriter:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, float(value), step))

        def close(self):
            closed.append(True)

    _fake_tensorboard_module(monkeypatch)
    monkeypatch.setattr(loop, "summary_writer", FakeWriter)
    train, held_out = split_tokens
    metrics = tmp_path / "m.jsonl"
    run_inprocess(
        [
            "--model",
            str(hf_model),
            "--data",
            str(train),
            "--eval-data",
            str(held_out),
            *COMMON,
            "--steps",
            "2",
            "--eval-steps",
            "1",
            "--metrics",
            str(metrics),
            "--tensorboard",
            str(tmp_path / "tb"),
        ]
    )
    assert calls[0] == ("init", str(tmp_path / "tb")) and closed == [True]
    by_tag = {}
    for tag, value, step in calls[1:]:
        by_tag.setdefault(tag, []).append((step, value))
    assert [s for s, _ in by_tag["train/loss"]] == [1, 2]
    assert [v for _, v in by_tag["train/loss"]] == pytest.approx(losses(metrics))
    ((step, value),) = by_tag["eval/loss"]
    assert step == 2 and value == pytest.approx(eval_records(metrics)[0]["eval_loss"])
    assert by_tag["eval/perplexity"][0][1] == pytest.approx(math.exp(value))
    for tag in ("train/lr", "train/grad_norm", "train/tokens_per_s", "memory/peak_mb"):
        assert [s for s, _ in by_tag[tag]] == [1, 2], tag


def test_tensorboard_missing_is_one_line_exit_2(tmp_path, hf_model, tokens, monkeypatch, capsys):
    import sys

    from trainer.__main__ import main

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` fails as when not installed
    out = tmp_path / "run"
    code = main(
        [
            "--model",
            str(hf_model),
            "--data",
            str(tokens),
            *COMMON,
            "--tensorboard",
            str(out / "tb"),
            "--checkpoint-dir",
            str(out / "ckpt"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install tensorboard" in err[0], err
    assert not out.exists()


def test_eval_options_checked(tmp_path, hf_model, tokens, split_tokens):
    from trainer.config import parse_args
    from trainer.data import write_tokens
    from trainer.errors import TrainerError
    from trainer.loop import plan_run

    base = ["--model", str(hf_model), "--data", str(tokens), "--seq-len", "32", "--global-batch", "4"]
    with pytest.raises(TrainerError, match="need --eval-data"):
        plan_run(parse_args([*base, "--eval-every", "10"]), world=1)
    short = write_tokens(tmp_path / "short.bin", list(range(100)), 256)
    with pytest.raises(TrainerError, match="fewer than one batch"):
        plan_run(parse_args([*base, "--eval-data", str(short)]), world=1)
    held_out = split_tokens[1]  # 2680 tokens: 20 batches of 4 x 32
    assert plan_run(parse_args([*base, "--eval-data", str(held_out)]), world=1).eval_steps == 20
    assert plan_run(parse_args([*base, "--eval-data", str(held_out), "--eval-steps", "50"]), world=1).eval_steps == 20


# ---- 3. pre-training from a config ----------------------------------------------------------------------


def _init_config(work: Path) -> Path:
    config = fixture_config(CONFIG) | {"pad_token_id": 0, "initializer_range": 0.05}
    path = work / "init-config" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def test_model_config_init_is_the_same_full_weights_in_every_layout(work):
    """Every rank's pieces of tp2pp2 (fused qkv), tp4 (kv-multiplier 2, blocked, gqa) and tp2 with a
    tied embedding are exactly the slices of tp1pp1's full tensors; the rule (trainer/weights.py):
    N(0, initializer_range), the pad row zero, norms one; another --seed gives other weights."""
    from shardkit.layout import make_layout
    from shardkit.placements import shard
    from trainer.model import ModelSpec
    from trainer.weights import INIT_BLOCK_ROWS, InitialWeights, init_rank_pieces

    config = json.loads(_init_config(work).read_text())
    wide = config | {"vocab_size": 2 * INIT_BLOCK_ROWS + 44}  # an embedding of several blocks of rows
    for cfg in (config, wide, wide | {"tie_word_embeddings": True}):
        serial = ModelSpec.from_config(cfg, make_layout())
        drawn = InitialWeights(serial, 1234)
        full = {name: drawn.rows(name, 0, shape[0]) for name, shape in serial.full_shapes.items()}
        for piece in serial.rank_pieces(0, 0):  # tp1pp1 (gate_up fused, as NxD holds it) is the same
            assert torch.equal(init_rank_pieces(serial, 1234, 0, 0)[piece.name], shard(piece, full))
        layouts = [
            make_layout(tp=2, pp=2, qkv="fused"),
            make_layout(tp=4, kv_multiplier=2, kv_replication="blocked", qkv="gqa"),
        ]
        for layout in layouts:
            spec = ModelSpec.from_config(cfg, layout)
            for pp in range(layout.pp):
                for tp in range(layout.tp):
                    mine = init_rank_pieces(spec, 1234, tp, pp)
                    for piece in spec.rank_pieces(tp, pp):
                        assert torch.equal(mine[piece.name], shard(piece, full)), (
                            layout.describe(),
                            tp,
                            pp,
                            piece.name,
                        )
    embed = full["model.embed_tokens.weight"]
    assert torch.equal(embed[0], torch.zeros_like(embed[0]))
    assert float(embed[1:].std()) == pytest.approx(0.05, rel=0.05)
    assert float(full["model.layers.0.mlp.down_proj.weight"].mean()) == pytest.approx(0.0, abs=0.005)
    assert torch.equal(full["model.norm.weight"], torch.ones_like(full["model.norm.weight"]))
    other = InitialWeights(ModelSpec.from_config(config, make_layout()), 99)
    assert not torch.equal(
        other.rows("model.layers.0.self_attn.q_proj.weight", 0, 32), full["model.layers.0.self_attn.q_proj.weight"]
    )


def test_pretrain_from_config_in_any_layout(work, tokens):
    """--model-config: tp1pp1 in this process and tp2pp2 under torchrun train the same losses (so
    they start from the same weights) and the export loads with transformers."""
    from transformers import AutoModelForCausalLM

    config = _init_config(work)
    base = ["--model-config", str(config), "--data", str(tokens), *COMMON]
    run_inprocess([*base, "--metrics", str(work / "init-tp1pp1.jsonl"), "--export-hf", str(work / "init-export")])
    check_ok(run_ranks(4, [*base, "--metrics", str(work / "init-tp2pp2.jsonl"), "--tp", "2", "--pp", "2"]))
    serial, parallel = losses(work / "init-tp1pp1.jsonl"), losses(work / "init-tp2pp2.jsonl")
    assert rel_diff(parallel, serial) < REL, (parallel, serial)
    assert serial[0] == pytest.approx(math.log(256), rel=0.02)  # small random weights: a uniform guess
    model = AutoModelForCausalLM.from_pretrained(work / "init-export", dtype=torch.float32)
    assert model.config.pad_token_id == 0 and model.config.initializer_range == 0.05


def test_model_and_model_config_together_refused(tmp_path, hf_model, tokens, capsys):
    from trainer.__main__ import main

    code = main(["--model", str(hf_model), "--model-config", str(hf_model / "config.json"), "--data", str(tokens)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "give one" in err[0], err
    assert main(["--model-config", str(tmp_path / "none.json"), "--data", str(tokens)]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- 4. resume honesty ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def four_steps(work, hf_model, tokens):
    """4 steps (cosine after 2 warm-up steps), checkpoints at steps 2 and 4."""
    ckpt = work / "ckpt-honest"
    run_inprocess(
        [
            "--model",
            str(hf_model),
            "--data",
            str(tokens),
            *COMMON,
            "--steps",
            "4",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "2",
            "--metrics",
            str(work / "honest-first.jsonl"),
        ]
    )
    return ckpt


def test_resume_with_another_schedule_is_refused(tmp_path, hf_model, tokens, four_steps, capsys):
    """A changed --steps (cosine: the LR of every later step changes), --warmup, --lr or
    --global-batch: one line naming each, exit 2, nothing written."""
    from trainer.__main__ import main

    out = tmp_path / "out"
    base = [
        "--model",
        str(hf_model),
        "--data",
        str(tokens),
        *COMMON,
        "--resume",
        str(four_steps / "step_2"),
        "--metrics",
        str(out / "m.jsonl"),
        "--checkpoint-dir",
        str(out / "ckpt"),
    ]
    assert main([*base, "--steps", "6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--steps 4 -> 6" in err[0] and "--override-schedule" in err[0], err
    assert main([*base, "--steps", "6", "--warmup", "3", "--lr", "2e-2", "--global-batch", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for change in ("--steps 4 -> 6", "--warmup 2 -> 3", "--lr 0.01 -> 0.02", "--global-batch 4 -> 8"):
        assert change in err[0], (change, err)
    assert not out.exists()


def test_resume_override_schedule_says_what_changed(tmp_path, hf_model, tokens, four_steps, caplog):
    """--override-schedule continues with the new values (the LR of step 4 is the new cosine's) and
    says so in one line; the same settings resume without a word; a new --micro-batch is said, not
    refused (a step computes the same mean over the global batch)."""
    import logging

    from trainer.optim import LRSchedule

    base = ["--model", str(hf_model), "--data", str(tokens), *COMMON, "--resume", str(four_steps / "step_2")]
    with caplog.at_level(logging.INFO, logger="trainer"):
        run_inprocess([*base, "--steps", "6", "--override-schedule", "--metrics", str(tmp_path / "o.jsonl")])
    said = [r.getMessage() for r in caplog.records if "other than its run's" in r.getMessage()]
    assert len(said) == 1 and "--steps 4 -> 6" in said[0] and "--override-schedule" in said[0], said
    records = steps(tmp_path / "o.jsonl")
    assert [r["step"] for r in records] == [3, 4, 5, 6]
    assert records[1]["lr"] == pytest.approx(LRSchedule(1e-2, 2, 6, "cosine", 0.1).at(3))  # step 4
    assert records[1]["lr"] != pytest.approx(LRSchedule(1e-2, 2, 4, "cosine", 0.1).at(3))

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        run_inprocess([*base, "--steps", "4", "--metrics", str(tmp_path / "same.jsonl")])
    assert not [r for r in caplog.records if "other than its run's" in r.getMessage()]
    first = losses(Path(four_steps).parent / "honest-first.jsonl")
    assert rel_diff(losses(tmp_path / "same.jsonl"), first[2:]) < REL

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer"):
        run_inprocess([*base, "--steps", "4", "--micro-batch", "2", "--metrics", str(tmp_path / "mb.jsonl")])
    said = [r.getMessage() for r in caplog.records if "other than its run's" in r.getMessage()]
    assert len(said) == 1 and "--micro-batch 1 -> 2" in said[0], said
    assert rel_diff(losses(tmp_path / "mb.jsonl"), first[2:]) < REL


def test_readme_options_table_lists_every_option():
    import dataclasses

    from trainer.config import TrainConfig

    readme = (ROOT / "trainer" / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `--")]
    flags = {line.split("`")[1].split(" ")[0] for line in rows}
    assert flags == {"--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)}


# ---- 6. gradients reduced in buckets (--grad-bucket-mb) ----------------------------------------------------


def test_buckets_are_bounded_and_start_from_the_last_layer():
    """NxD's cut: reversed order, at most the cap per bucket, a larger tensor alone; every tensor once."""
    from trainer.optim import buckets, flat_buckets

    tensors = [torch.zeros(n) for n in (10, 300, 20, 30, 5, 40)]  # fp32: 4 bytes each
    cut = buckets(tensors, 100 * 4)
    assert [[t.numel() for t in b] for b in cut] == [[40, 5, 30, 20], [300], [10]]
    assert sorted(id(t) for b in cut for t in b) == sorted(id(t) for t in tensors)
    flat = torch.arange(10.0)
    views = flat_buckets(flat, 4 * 4)
    assert [v.tolist() for v in views] == [[6.0, 7.0, 8.0, 9.0], [2.0, 3.0, 4.0, 5.0], [0.0, 1.0]]
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views)  # no copies


def test_bucketed_all_reduce_sums_each_tensor_with_bounded_collectives():
    """`_all_reduce_each` over a two-rank group whose peer holds other gradients: each tensor gets
    the sum, and no collective carries more than the cap unless it is one tensor larger than it."""
    from trainer.comm.base import Group
    from trainer.optim import _all_reduce_each, buckets

    peer = {}

    class Recording(Group):
        sizes: list[int] = []

        def _all_reduce(self, tensor, op):
            tensor.add_(peer[tensor.numel()])
            self.sizes.append(tensor.numel() * tensor.element_size())

    gen = torch.Generator().manual_seed(5)
    mine = [torch.randn(n, generator=gen) for n in (64, 8, 8, 700, 16, 32)]
    theirs = [torch.randn(t.shape, generator=gen) for t in mine]
    want = [a + b for a, b in zip(mine, theirs)]
    group = Recording([0, 1], 0)
    cap = 100 * 4
    for bucket_mine, bucket_theirs in zip(buckets(mine, cap), buckets(theirs, cap)):
        peer[sum(t.numel() for t in bucket_mine)] = torch.cat([t.reshape(-1) for t in bucket_theirs])
    _all_reduce_each(group, mine, cap)
    assert all(torch.equal(a, b) for a, b in zip(mine, want))
    assert group.sizes == [48 * 4, 700 * 4, 80 * 4], group.sizes  # (32, 16), 700 alone, (8, 8, 64)


@pytest.mark.parametrize("layout", [["--dp", "2"], ["--dp", "2", "--zero1"], ["--tp", "2", "--sequence-parallel"]])
def test_small_buckets_give_the_same_training(layout, work, hf_model, tokens):
    """Buckets of 2 KiB (dozens of collectives a step) train exactly as one bucket of everything."""
    whole, small = (
        work / f"bucket-whole-{len(layout)}-{layout[0]}.jsonl",
        work / f"bucket-small-{len(layout)}-{layout[0]}.jsonl",
    )
    for metrics, mb in ((whole, "512"), (small, "0.002")):
        check_ok(
            run_ranks(
                2,
                [
                    "--model",
                    str(hf_model),
                    "--data",
                    str(tokens),
                    "--metrics",
                    str(metrics),
                    *COMMON,
                    *layout,
                    "--grad-bucket-mb",
                    mb,
                ],
            )
        )
    assert rel_diff(losses(small), losses(whole)) < 1e-6, (losses(small), losses(whole))
    assert [r["grad_norm"] for r in steps(small)] == pytest.approx([r["grad_norm"] for r in steps(whole)], rel=1e-6)


def test_grad_bucket_mb_must_be_positive(tmp_path, hf_model, tokens, capsys):
    from trainer.__main__ import main

    code = main(
        ["--model", str(hf_model), "--data", str(tokens), "--grad-bucket-mb", "0", "--device", "cpu", "--no-progress"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--grad-bucket-mb must be positive" in err[0], err


# ---- the command line's usage errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, phrases",
    [
        (["--tpp", "2"], ["unrecognized arguments: --tpp 2 (Did you mean one of: --tp, --pp, --vpp?)"]),
        (["--global-bach", "2"], ["unrecognized arguments: --global-bach 2 (Did you mean one of: --global-batch,"]),
        (["--tp", "x"], ["argument --tp/--tp-size: invalid int value: 'x'"]),
        (["--decay", "foo"], ["argument --decay: invalid choice: 'foo'"]),
        (["--model"], ["argument --model: expected one argument"]),
    ],
)
def test_usage_errors_are_one_line(args, phrases, capsys, monkeypatch):
    """argparse's usage errors (a typo'd option, a bad value): ONE line on stderr with argparse's
    message, a did-you-mean for a misspelt option and the help hint, exit 2; under torchrun only
    rank 0 says it (every rank parses the same command line), every rank exits 2."""
    from trainer.__main__ import main

    monkeypatch.delenv("RANK", raising=False)
    assert main(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer: error: "), captured.err
    assert err[0].endswith("Try 'python -m trainer --help' for help."), err
    for phrase in phrases:
        assert phrase in err[0], (phrase, err)
    assert not captured.out
    monkeypatch.setenv("RANK", "1")
    assert main(args) == 2
    assert not capsys.readouterr().err


def test_usage_error_of_python_m_trainer_is_one_line():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "--tpp", "2"], capture_output=True, text=True, cwd=ROOT, env=env
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--tpp 2 (Did you mean one of: --tp," in done.stderr and "usage:" not in done.stderr


# ---- 7. a checkpoint folder belongs to one run ----------------------------------------------------------


def _folder_state(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` and its bytes (what a refused run must leave as it was)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(main, args: list[str], capsys, *phrases: str) -> str:
    capsys.readouterr()  # what ran before
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer: error: "), err
    for phrase in phrases:
        assert phrase in err[0], (phrase, err[0])
    return err[0]


@pytest.fixture(scope="module")
def run_a(work, hf_model, tokens):
    """Run A: 2 steps (seed 1), a checkpoint after each, its metrics in the checkpoint folder."""
    ckpt = work / "ckpt-run-a"
    args = [
        "--model",
        str(hf_model),
        "--data",
        str(tokens),
        *COMMON,
        "--steps",
        "2",
        "--seed",
        "1",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "1",
    ]
    run_inprocess(args)
    return ckpt, args


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    return dst


def test_a_checkpoint_folder_records_its_run(run_a):
    """run.json names the run (model, data identity, layout-free settings); the metrics' start
    record names it too; tp/pp/dp and where the outputs go are not part of it."""
    from trainer.checkpointing import JOB_OPTIONS

    ckpt, _ = run_a
    record = json.loads((ckpt / "run.json").read_text())
    assert record["format"] == "shardkit-trainer-run" and len(record["run"]) == 12
    assert record["settings"]["seed"] == 1 and record["settings"]["lr"] == 1e-2 and record["settings"]["seq_len"] == 32
    assert record["data"]["identity"] and record["model"]["config"] and record["model"]["path"]
    assert not set(record["settings"]) & {"tp", "pp", "dp", "ep", "zero1", "micro_batch", "checkpoint_dir", "metrics"}
    assert {"tp", "pp", "dp", "ep", "vpp", "zero1", "micro_batch", "resume"} <= JOB_OPTIONS
    start = json.loads((ckpt / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["run"] == record["run"]


def test_a_fresh_run_never_writes_beside_another_runs_checkpoints(run_a, tmp_path, capsys):
    """Another run (--seed 2) into A's folder: one line naming A's run, its tags and what differs,
    exit 2, the folder (tags, run.json, metrics) untouched; with --num-kept it would have pruned
    A's tags and latest_if_exists would have picked them up."""
    from trainer.__main__ import main

    ckpt = _copy(run_a[0], tmp_path / "ckpt")
    before = _folder_state(ckpt)
    args = [*run_a[1][:-4], "--checkpoint-dir", str(ckpt), "--seed", "2", "--steps", "1", "--num-kept", "1"]
    line = _refused(
        main,
        args,
        capsys,
        "'s checkpoints (step_1, step_2)",
        "--seed 1 -> 2",
        "pass --resume to continue it or choose another --checkpoint-dir",
    )
    assert _folder_state(ckpt) == before
    assert f"holds run {json.loads((ckpt / 'run.json').read_text())['run']}'s" in line
    (ckpt / "run.json").unlink()  # an older trainer's folder, or NxD's: tags no run record names
    before = _folder_state(ckpt)
    _refused(main, args, capsys, "checkpoints no run record names (step_1, step_2", "pass --resume")
    assert _folder_state(ckpt) == before


def test_the_same_run_restarted_without_resume_is_told_to_resume(run_a, tmp_path, capsys):
    """The same command again (a restarted job) into its folder holding its tags: refused with
    --resume latest_if_exists as the fix; with it, it continues from step 2 and the folder stays
    the run's (the same run.json, a second start record naming the same run)."""
    from trainer.__main__ import main

    ckpt = _copy(run_a[0], tmp_path / "ckpt")
    args = [*run_a[1][:-4], "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    record = (ckpt / "run.json").read_bytes()
    _refused(main, args, capsys, "already holds this run's checkpoints (step_1, step_2)", "--resume latest_if_exists")
    assert main([*args, "--steps", "3", "--override-schedule", "--resume", "latest_if_exists"]) == 0
    assert (ckpt / "step_3" / "done").is_file() and (ckpt / "run.json").read_bytes() == record
    starts = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in starts if r["event"] == "start"]
    assert [r["step"] for r in starts] == [0, 2] and len({r["run"] for r in starts}) == 1


def test_resume_into_another_runs_folder_is_refused(run_a, tmp_path, capsys, hf_model, tokens):
    """--resume A/step_1 continues A: into a new folder it records A's run; into a folder of
    another run's tags (or tags no record names) it is refused; latest_if_exists of a folder
    holding only another run's record (it saved nothing) does not take the folder over."""
    from trainer.__main__ import main

    a_id = json.loads((run_a[0] / "run.json").read_text())["run"]
    base = [
        "--model",
        str(hf_model),
        "--data",
        str(tokens),
        *COMMON,
        "--steps",
        "2",
        "--seed",
        "1",
        "--resume",
        str(run_a[0] / "step_1"),
    ]
    moved = tmp_path / "moved"
    assert main([*base, "--checkpoint-dir", str(moved)]) == 0
    assert json.loads((moved / "run.json").read_text())["run"] == a_id
    other = tmp_path / "other"
    run_inprocess(
        [
            "--model",
            str(hf_model),
            "--data",
            str(tokens),
            *COMMON,
            "--steps",
            "1",
            "--seed",
            "7",
            "--checkpoint-dir",
            str(other),
        ]
    )
    before = _folder_state(other)
    _refused(
        main,
        [*base, "--checkpoint-dir", str(other)],
        capsys,
        "'s checkpoints (step_1)",
        f"not those of the run --resume {run_a[0] / 'step_1'} continues (run {a_id})",
    )
    assert _folder_state(other) == before
    claimed = tmp_path / "claimed"
    claimed.mkdir()
    (claimed / "run.json").write_bytes((other / "run.json").read_bytes())
    _refused(
        main,
        [
            "--model",
            str(hf_model),
            "--data",
            str(tokens),
            *COMMON,
            "--steps",
            "1",
            "--checkpoint-dir",
            str(claimed),
            "--resume",
            "latest_if_exists",
        ],
        capsys,
        "'s record (run.json, no checkpoint)",
        "--seed 7 -> 1234",
        "no complete checkpoint to continue",
    )
    assert sorted(p.name for p in claimed.iterdir()) == ["run.json"]


def test_metrics_of_another_run_are_never_appended_to(run_a, tmp_path, capsys, hf_model, tokens):
    """--metrics naming another run's metrics file, or a file that is not the trainer's: refused,
    untouched; the same run's file is appended to."""
    from trainer.__main__ import main

    theirs = tmp_path / "theirs.jsonl"
    theirs.write_bytes((run_a[0] / "metrics.jsonl").read_bytes())
    base = ["--model", str(hf_model), "--data", str(tokens), *COMMON, "--steps", "1"]
    line = _refused(main, [*base, "--metrics", str(theirs)], capsys, "'s metrics", "choose another --metrics")
    assert theirs.read_bytes() == (run_a[0] / "metrics.jsonl").read_bytes()
    assert f"holds run {json.loads((run_a[0] / 'run.json').read_text())['run']}'s metrics" in line
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    _refused(main, [*base, "--metrics", str(notes)], capsys, "is not the trainer's")
    assert notes.read_text() == "my notes\n"
    mine = tmp_path / "mine.jsonl"
    assert main([*base, "--metrics", str(mine)]) == 0 and main([*base, "--metrics", str(mine)]) == 0
    assert [json.loads(line)["event"] for line in mine.read_text().splitlines()].count("start") == 2


def test_a_run_record_is_claimed_once_and_never_through_a_link(tmp_path):
    """claim_record: the first claim creates the record, the next reads it back; a run.json that
    links out of the folder is refused, never followed; a claim that finds another run's record
    (it appeared after the check) is refused in one line."""
    from shardkit.errors import ShardkitError
    from shardkit.io.records import claim_record, read_head
    from trainer.checkpointing import RunRecord, claim_run
    from trainer.errors import TrainerError

    assert claim_record(tmp_path / "a", "run.json", b"first", "run record") is None
    assert claim_record(tmp_path / "a", "run.json", b"second", "run record") == b"first"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["run.json"]
    secret = tmp_path / "secret"
    secret.write_text("x")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run.json").symlink_to(secret)
    with pytest.raises(ShardkitError, match="outside"):
        claim_record(tmp_path / "b", "run.json", b"mine", "run record")
    assert secret.read_text() == "x"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "run.json").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ShardkitError, match="does not exist"):
        claim_record(tmp_path / "c", "run.json", b"mine", "run record")
    assert not (tmp_path / "nowhere").exists()
    ours, theirs = RunRecord({"path": "m"}, {"identity": "d"}, {"seed": 1}), RunRecord({"path": "m"}, {}, {"seed": 2})
    plan = type("Plan", (), {"cfg": type("Cfg", (), {"checkpoint_dir": str(tmp_path / "d")})()})()
    claim_record(tmp_path / "d", "run.json", theirs.to_json(), "run record")
    with pytest.raises(TrainerError, match=f"claimed by another run \\({theirs.id}\\)"):
        claim_run(plan, ours)
    claim_run(type("Plan", (), {"cfg": type("Cfg", (), {"checkpoint_dir": str(tmp_path / "e")})()})(), ours)
    assert RunRecord.from_json((tmp_path / "e" / "run.json").read_bytes(), "e").id == ours.id
    assert read_head(tmp_path / "e" / "run.json", "run record") == b"{"
