"""The trainer on XLA, with torch-xla's own runtime on CPU (`PJRT_DEVICE=CPU`): one device, and
several devices in one process (`CPU_NUM_DEVICES=N`, one rank per device, each a thread, as
torch-xla runs them on CPU). Every XLA run is a fresh process (`trainer_helpers.run_xla`); its
per-step losses must equal the gloo run of the same layout to 1e-5 (fp32), checkpoints move
between the two, and the graphs compiled over 8 steps are bounded (torch_xla.debug.metrics).

Skipped, saying why, where torch-xla is not importable (the main environment); CI runs this file
in a torch 2.9 + torch-xla 2.9 environment with TRAINER_XLA_TESTS=1, which turns that skip into
a failure, so the tests cannot silently not run there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import (
    COMMON,
    ROOT,
    XLA_TIMEOUT,
    check_ok,
    corpus_tokens,
    losses,
    rel_diff,
    run_args,
    run_inprocess,
    run_ranks,
    run_xla,
    steps,
    tiny_run_fixtures,
)

from shardkit.testing import fixture_config, make_tiny_model

if importlib.util.find_spec("torch_xla") is None:
    if os.environ.get("TRAINER_XLA_TESTS"):
        raise RuntimeError("TRAINER_XLA_TESTS is set but torch_xla is not importable: the XLA tests would not run")
    pytest.skip("torch_xla is not importable (the XLA tests run in CI's torch-xla job)", allow_module_level=True)

REL = 1e-5
CPU = ["--device", "cpu"]  # the gloo references (torch-xla installed: the default device would be xla)

work, hf_model, tokens = tiny_run_fixtures("trainer-xla")


def xla_ok(devices: int, args: list[str]) -> None:
    """Run the trainer on `devices` XLA devices; it must succeed and have trained on XLA (every
    step record counts the graphs compiled, which only the XLA backend does)."""
    done = run_xla(devices, args)
    assert done.returncode == 0, f"XLA run failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    records = steps(Path(args[args.index("--metrics") + 1]))
    assert records and all(r.get("xla_compiles", 0) > 0 for r in records), f"not an XLA run: {records}"


@pytest.fixture(scope="module")
def moe_model(work) -> Path:
    return make_tiny_model(fixture_config("mixtral-tiny") | {"router_aux_loss_coef": 0.5}, work / "moe", seed=3)


@pytest.fixture(scope="module")
def moe_tokens(work) -> Path:
    return corpus_tokens(work / "moe-corpus.bin", vocab=64)


# ---- one device ------------------------------------------------------------------------------------------


def test_one_device_equals_cpu_and_compiles_stay_bounded(work, hf_model, tokens):
    """`python -m trainer --device xla` on one device, 8 steps: the losses of `--device cpu`, no
    graph is compiled after the third step (a few graphs in all: a micro-batch's, the update's),
    and steps 5-8 each take under 10% of step 1 (which traces and compiles; ~1% measured)."""
    eight = [*COMMON, "--steps", "8"]
    cpu, xla = work / "one-cpu.jsonl", work / "one-xla.jsonl"
    run_inprocess(run_args(hf_model, tokens, cpu, *CPU, common=eight))
    xla_ok(1, run_args(hf_model, tokens, xla, common=eight))
    assert rel_diff(losses(xla), losses(cpu)) < REL, (losses(xla), losses(cpu))
    compiles = [r["xla_compiles"] for r in steps(xla)]
    assert compiles[2] == compiles[-1], f"graphs compiled after step 3: {compiles}"
    assert compiles[-1] <= 8, f"{compiles[-1]} graphs compiled for 8 steps: {compiles}"
    times = [r["step_time"] for r in steps(xla)]
    assert max(times[4:]) < 0.1 * times[0], f"steps 5-8 not under 10% of step 1: {times}"


# ---- several devices in one process -----------------------------------------------------------------------

LAYOUTS = {  # name -> (devices, the run's layout options)
    "tp2": (2, ["--tp", "2", "--qkv", "gqa"]),
    "dp2-zero1": (2, ["--dp", "2", "--zero1"]),
    "pp2": (2, ["--pp", "2"]),
    "tp2pp2": (4, ["--tp", "2", "--pp", "2"]),
    "dp2-buckets": (2, ["--dp", "2", "--grad-bucket-mb", "0.002"]),  # dozens of gradient buckets a step
}
# bf16 runs (weights and activations in bf16, fp32 masters and Adam state), against the same layout's
# fp32 gloo run: bf16 keeps 8 significant bits, so one rounding of a value is up to 2^-9 of it and a
# loss computed from bf16 activations cannot be expected closer than about that; 2^-8 allows two
# such roundings over the 5 steps. Measured: 1.5-2.5e-4 (bf16 against fp32 on gloo as on XLA, tp2pp2);
# a run that dropped its updates or its masters (bf16 updates of 1e-2 * lr-sized steps) is off by
# percents, as the losses fall 7% over the 5 steps.
BF16 = ["--dtype", "bf16"]
BF16_REL = 2**-8
BF16_LAYOUTS = {
    **LAYOUTS,
    "vpp2": (2, ["--pp", "2", "--vpp", "2"]),
    "tp2-sp-ac": (2, ["--tp", "2", "--sequence-parallel", "--activation-checkpointing"]),
    "lora": (1, ["--lora-rank", "4", "--lora-targets", "q,k,v,o"]),
}
_GLOO: dict[str, Path] = {}


def gloo_run(work: Path, hf_model: Path, tokens: Path, name: str) -> Path:
    """The fp32 gloo run of layout `name` (once per module): its metrics."""
    if name not in _GLOO:
        devices, layout = BF16_LAYOUTS[name]
        metrics = work / f"{name}-gloo.jsonl"
        args = run_args(hf_model, tokens, metrics, *CPU, *layout)
        if devices == 1:
            run_inprocess(args)
        else:
            check_ok(run_ranks(devices, args))
        _GLOO[name] = metrics
    return _GLOO[name]


@pytest.fixture(scope="module")
def xla_tp2(work, hf_model, tokens) -> Path:
    """The tp2 run on two XLA devices, saving step 3 (xser) under work/xla-ckpt: its metrics."""
    metrics = work / "tp2-xla.jsonl"
    xla_ok(
        2,
        run_args(
            hf_model,
            tokens,
            metrics,
            *LAYOUTS["tp2"][1],
            "--checkpoint-dir",
            str(work / "xla-ckpt"),
            "--checkpoint-every",
            "3",
            "--checkpoint-format",
            "xser",
        ),
    )
    return metrics


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_devices_equal_gloo(name, request, work, hf_model, tokens):
    """Each layout on N XLA devices (threads of one process) against the same layout as an
    N-process gloo job: the same per-step losses."""
    devices, layout = LAYOUTS[name]
    gloo, xla = gloo_run(work, hf_model, tokens, name), work / f"{name}-xla.jsonl"
    if name == "tp2":
        xla = request.getfixturevalue("xla_tp2")  # the run whose checkpoint resumes on gloo below
    else:
        xla_ok(devices, run_args(hf_model, tokens, xla, *layout))
    assert len(losses(xla)) == 5
    assert rel_diff(losses(xla), losses(gloo)) < REL, (losses(xla), losses(gloo))


@pytest.mark.parametrize("name", [n for n in BF16_LAYOUTS if n != "tp2pp2"])  # tp2pp2: the test below
def test_bf16_devices_near_fp32(name, work, hf_model, tokens):
    """Each layout and option in bf16 (the default dtype, fp32 masters) on XLA devices: the fp32 gloo
    run's losses to BF16_REL."""
    devices, layout = BF16_LAYOUTS[name]
    gloo, xla = gloo_run(work, hf_model, tokens, name), work / f"{name}-xla-bf16.jsonl"
    xla_ok(devices, run_args(hf_model, tokens, xla, *layout, *BF16))
    assert len(losses(xla)) == 5
    assert rel_diff(losses(xla), losses(gloo)) < BF16_REL, (losses(xla), losses(gloo))


def test_trainium_command_in_bf16_resumes_on_gloo(work, hf_model, tokens):
    """The README's Trainium command shape on torch-xla's CPU runtime: 4 devices, tp2 pp2, bf16 (the
    default), a checkpoint every 3 steps. Its losses are the fp32 run's to BF16_REL; its step-3
    checkpoint holds fp32 masters of which the saved bf16 weights are the rounding, and resumed on
    gloo (tp1, bf16) it continues the XLA run's steps 4-5 to BF16_REL."""
    import torch

    from shardkit.checkpoint import load_checkpoint

    devices, layout = LAYOUTS["tp2pp2"]
    metrics, ckpt = work / "trainium-bf16.jsonl", work / "trainium-ckpt"
    xla_ok(
        devices,
        run_args(
            hf_model,
            tokens,
            metrics,
            *layout,
            "--dtype",
            "bf16",
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "3",
        ),
    )
    fp32 = losses(gloo_run(work, hf_model, tokens, "tp2pp2"))
    assert rel_diff(losses(metrics), fp32) < BF16_REL, (losses(metrics), fp32)
    tag = ckpt / "step_3"
    for pp in range(2):
        for tp in range(2):
            saved = load_checkpoint(ckpt, "step_3", rank=(tp, pp))
            weights, states = saved.model, saved.optimizer.state
            assert weights and all(w.dtype == torch.bfloat16 for w in weights.values())
            for name, weight in weights.items():
                master = states[name]["master"]
                assert master.dtype == torch.float32
                assert torch.equal(master.to(torch.bfloat16), weight), name
            assert any(not torch.equal(states[n]["master"], w.float()) for n, w in weights.items()), (
                "the masters hold no more than the bf16 weights"
            )
    resumed = work / "trainium-resumed-gloo.jsonl"
    run_inprocess(run_args(hf_model, tokens, resumed, *CPU, "--dtype", "bf16", "--resume", str(tag)))
    assert [r["step"] for r in steps(resumed)] == [4, 5]
    assert rel_diff(losses(resumed), losses(metrics)[3:]) < BF16_REL, (losses(resumed), losses(metrics))


def test_expert_parallel_equals_gloo(work, moe_model, moe_tokens):
    """Mixtral at ep2 (dp2): tokens dispatched over the ep group by all-gather and reduce-scatter
    on XLA (static shapes), by all-to-all on gloo; the same language-model and load-balancing losses
    (fp32), and in bf16 the fp32 ones to BF16_REL."""
    gloo, xla = work / "ep2-gloo.jsonl", work / "ep2-xla.jsonl"
    layout = ["--dp", "2", "--ep", "2"]
    check_ok(run_ranks(2, run_args(moe_model, moe_tokens, gloo, *CPU, *layout)))
    xla_ok(2, run_args(moe_model, moe_tokens, xla, *layout))
    for key in ("loss", "aux_loss"):
        got, want = [r[key] for r in steps(xla)], [r[key] for r in steps(gloo)]
        assert rel_diff(got, want) < REL, (key, got, want)
    bf16 = work / "ep2-xla-bf16.jsonl"  # and in bf16, to the fp32 run (BF16_REL)
    xla_ok(2, run_args(moe_model, moe_tokens, bf16, *layout, *BF16))
    for key in ("loss", "aux_loss"):
        got, want = [r[key] for r in steps(bf16)], [r[key] for r in steps(gloo)]
        assert rel_diff(got, want) < BF16_REL, (key, got, want)


FAMILIES = {  # name -> (fixture, devices, layout): families beyond Llama's module tree, on XLA
    "gpt-neox-tp2": ("gpt-neox-tiny", 2, ["--tp", "2"]),  # LayerNorm, partial rotary, parallel residual
    "dbrx-ep2": ("dbrx-tiny", 2, ["--dp", "2", "--ep", "2"]),  # clip_qkv, fused Wqkv, experts over ep
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_families_equal_gloo(name, work, moe_tokens):
    """GPT-NeoX at tp2 and DBRX at ep2 on XLA devices: the same layout's gloo losses (fp32, 1e-5);
    tests/unit/trainer/test_trainer_families.py proves the gloo runs equal transformers + AdamW."""
    fixture, devices, layout = FAMILIES[name]
    model = make_tiny_model(fixture_config(fixture), work / name, seed=3)
    gloo, xla = work / f"{name}-gloo.jsonl", work / f"{name}-xla.jsonl"
    check_ok(run_ranks(devices, run_args(model, moe_tokens, gloo, *CPU, *layout)))
    xla_ok(devices, run_args(model, moe_tokens, xla, *layout))
    assert len(losses(xla)) == 5
    assert rel_diff(losses(xla), losses(gloo)) < REL, (losses(xla), losses(gloo))


def test_bert_classification_dp4_equals_gloo(work):
    """BERT sequence classification from fixtures/tweets-tiny.csv (the README's workload) at dp4 on
    four XLA devices: the 4-process gloo run's losses and evaluation (fp32, 1e-5);
    tests/unit/trainer/test_trainer_bert.py proves the gloo run equals transformers + AdamW."""
    from bert_helpers import CLS, TWEETS, bert_model, eval_records, write_vocab

    model = bert_model(
        work,
        "bert-cls",
        write_vocab(work / "bert-tokenizer"),
        "BertForSequenceClassification",
        id2label={0: "negative", 1: "neutral", 2: "positive"},
    )
    common = [*COMMON, "--seq-len", "16", "--global-batch", "36", "--micro-batch", "9", "--lr", "1e-3", "--dp", "4"]
    gloo, xla = work / "bert-dp4-gloo.jsonl", work / "bert-dp4-xla.jsonl"
    args = ["--model", str(model), "--data", str(TWEETS), "--eval-data", str(TWEETS), *common, *CLS]
    check_ok(run_ranks(4, [*args, "--metrics", str(gloo), *CPU]))
    xla_ok(4, [*args, "--metrics", str(xla)])
    assert len(losses(xla)) == 5
    assert rel_diff(losses(xla), losses(gloo)) < REL, (losses(xla), losses(gloo))
    (ours,), (theirs,) = eval_records(xla), eval_records(gloo)
    assert abs(ours["eval_loss"] - theirs["eval_loss"]) < REL * theirs["eval_loss"]
    assert ours["eval_accuracy"] == theirs["eval_accuracy"]


@pytest.mark.slow
def test_interleaved_stages_equal_gloo(work, hf_model, tokens):
    """pp2 vpp2 (interleaved 1F1B by neighbour exchanges) against gloo's ScheduleInterleaved1F1B."""
    gloo, xla = work / "vpp-gloo.jsonl", work / "vpp-xla.jsonl"
    layout = ["--pp", "2", "--vpp", "2"]
    check_ok(run_ranks(2, run_args(hf_model, tokens, gloo, *CPU, *layout)))
    xla_ok(2, run_args(hf_model, tokens, xla, *layout))
    assert rel_diff(losses(xla), losses(gloo)) < REL, (losses(xla), losses(gloo))


# ---- checkpoints between XLA and gloo ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def serial(work, hf_model, tokens) -> list[float]:
    """tp1pp1 on gloo, 5 steps, saving step 3 (torch format): the losses every resume continues."""
    metrics = work / "serial.jsonl"
    run_inprocess(
        run_args(
            hf_model, tokens, metrics, *CPU, "--checkpoint-dir", str(work / "gloo-ckpt"), "--checkpoint-every", "3"
        )
    )
    return losses(metrics)


def test_xla_checkpoint_resumes_on_gloo(work, hf_model, tokens, serial, xla_tp2):
    """The tp2 XLA run's step-3 checkpoint (xser) resumed at tp1 on gloo: steps 4-5 of the serial run."""
    tag = work / "xla-ckpt" / "step_3"
    assert (tag / "done").exists(), "the tp2 XLA run wrote no complete step-3 checkpoint"
    metrics = work / "resume-on-gloo.jsonl"
    run_inprocess(run_args(hf_model, tokens, metrics, *CPU, "--resume", str(tag)))
    assert [r["step"] for r in steps(metrics)] == [4, 5]
    assert rel_diff(losses(metrics), serial[3:]) < REL, (losses(metrics), serial[3:])


def test_gloo_checkpoint_resumes_on_xla(work, hf_model, tokens, serial):
    """The serial gloo run's step-3 checkpoint resumed at dp2 with ZeRO-1 on two XLA devices."""
    metrics = work / "resume-on-xla.jsonl"
    xla_ok(
        2, run_args(hf_model, tokens, metrics, "--dp", "2", "--zero1", "--resume", str(work / "gloo-ckpt" / "step_3"))
    )
    assert [r["step"] for r in steps(metrics)] == [4, 5]
    assert rel_diff(losses(metrics), serial[3:]) < REL, (losses(metrics), serial[3:])


# ---- the graphs a Neuron job compiles ---------------------------------------------------------------------


def cached_run(cache: Path, args: list[str]) -> dict[str, int]:
    """The trainer on one XLA device with torch-xla's persistent compilation cache at `cache`
    (tests/support/xla_cached_run.py): the cache's counters."""
    report = cache.parent / f"{cache.name}-{len(list(cache.parent.glob(cache.name + '-*.json')))}.json"
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "support" / "xla_cached_run.py"),
            str(cache),
            str(report),
            *args,
            "--device",
            "xla",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=XLA_TIMEOUT,
    )
    assert done.returncode == 0, f"XLA run failed (rc {done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(report.read_text())


def test_resumed_run_compiles_only_a_fresh_runs_graphs(work, hf_model, tokens):
    """A fresh bf16 run with an evaluation every 2 steps and a checkpoint every 3 compiles every graph
    by step 3 (evaluations and saves after their first add none), and a run resumed from its step-3
    checkpoint compiles no graph whose key the fresh run's cache does not hold -- so a
    `neuron_parallel_compile` cache made from a short fresh run (one eval, one save) serves it."""
    cache, fresh, resumed = work / "xla-cache", work / "compiles-fresh.jsonl", work / "compiles-resumed.jsonl"
    common = [
        *COMMON,
        "--steps",
        "8",
        *BF16,
        "--eval-data",
        str(tokens),
        "--eval-every",
        "2",
        "--eval-steps",
        "1",
        "--checkpoint-every",
        "3",
    ]
    counters = cached_run(
        cache, run_args(hf_model, tokens, fresh, "--checkpoint-dir", str(work / "compiles-ckpt"), common=common)
    )
    records = [json.loads(line) for line in fresh.read_text().splitlines()]
    counts = [(r["event"], r["step"], r["xla_compiles"]) for r in records if "xla_compiles" in r]
    after_third = {c for _, step, c in counts if step >= 3}
    assert len(after_third) == 1, f"graphs compiled after step 3: {counts}"
    assert counters.get("PersistentCacheMiss", 0) == next(iter(after_third)), (counters, counts)
    counters = cached_run(
        cache,
        run_args(
            hf_model,
            tokens,
            resumed,
            "--checkpoint-dir",
            str(work / "compiles-ckpt-resumed"),
            "--resume",
            str(work / "compiles-ckpt" / "step_3"),
            common=common,
        ),
    )
    assert [r["step"] for r in steps(resumed)] == [4, 5, 6, 7, 8]
    assert counters.get("PersistentCacheMiss", 0) == 0, f"the resumed run compiled new graphs: {counters}"
    assert rel_diff(losses(resumed), losses(fresh)[3:]) < 1e-6, (losses(resumed), losses(fresh))


XLA_LIST_ALL_REDUCE = """
import torch, torch_xla
from trainer.comm.xla import XlaGroup
device = torch_xla.device()
tensors = [torch.arange(6.0).reshape(2, 3).to(device), torch.ones(4).to(device)]
group = XlaGroup([0, 1], 0, [[0]], 0, None)  # the collective's replica groups: this one device
group._all_reduce_many(tensors)
ir = torch_xla._XLAC._get_xla_tensors_text(tensors)
print(ir.count("cross_replica_sum("), "(f32[2,3]{1,0}, f32[4]{0}" in ir)
torch_xla.sync()
print([t.cpu().tolist() for t in tensors])
"""


def test_bucket_all_reduce_of_tensors_in_place():
    """Under torchrun (one device per process, as on Trainium) a gradient bucket is one torch-xla
    all-reduce of the list of gradients, in place, with no flat copy (NxD's call); run here over a
    replica group of the one CPU device (XLA_ALWAYS_ALLREDUCE: torch-xla skips all-reduces in a world
    of one otherwise): one collective of both tensors, whose sum here is the tensors themselves."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", XLA_ALWAYS_ALLREDUCE="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", XLA_LIST_ALL_REDUCE], env=env, capture_output=True, text=True, timeout=XLA_TIMEOUT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    collectives, lines = done.stdout.strip().splitlines()[-2:]
    assert collectives == "1 True", done.stdout
    assert lines == str([[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [1.0, 1.0, 1.0, 1.0]])
