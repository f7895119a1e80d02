"""Interleaved (virtual) pipeline stages: shardkit's layout algebra for vpp and the trainer's
--vpp / --pp-schedule (issue 13, item 2).

1. layout algebra: which layers each (pp rank, chunk) holds (NxD's rule: pp x vpp chunks of
   consecutive layers, the remainder to the last chunks, chunk c on pp rank c % pp); convert with
   --pp 2 --vpp 2 then merge gives the Hugging Face model back exactly; the rank files hold their
   chunks' layers under the global names; reshard vpp2 -> vpp1 equals a direct convert, file for
   file; NxD shards without a manifest have their vpp read from the layers they hold;
2. the trainer: pp2 vpp2 equals pp1 (losses, evaluations and final weights to 1e-5) with the
   interleaved schedule, and so does every other schedule torch provides (also with dp2 ZeRO-1
   and with tp2 sequence parallelism); a vpp checkpoint holds the expected
   global layer names and resumes at another layout; bad vpp input is one line, exit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from trainer_helpers import COMMON, run_args, tiny_run_fixtures

from shardkit import Layout, convert
from shardkit.cli import cli
from shardkit.formats import open_checkpoint
from shardkit.formats.torch_io import safe_load
from shardkit.testing import make_tiny_model

CONFIG = "llama-trainer-tiny"  # 4 layers: pp 2 x vpp 2 = 4 chunks of one layer


def run_cli(*args: str):
    return CliRunner().invoke(cli, ["-q", *map(str, args)], catch_exceptions=False)


def hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def layers_in(rank_file: Path) -> list[int]:
    return sorted({int(k.split(".")[2]) for k in safe_load(rank_file) if k.startswith("model.layers.")})


# ---- 1. layout algebra ------------------------------------------------------------------------------


def test_chunks_go_round_robin_over_pp_ranks():
    layout = Layout(pp=2, vpp=2)
    assert layout.chunk_layers(8) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [layout.chunk_rank(c) for c in range(4)] == [0, 1, 0, 1]
    assert layout.rank_chunks(0) == [0, 2] and layout.rank_chunks(1) == [1, 3]
    assert layout.stage_layers(8) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # the remainder goes to the last chunks, as NxD's partitioner does
    assert Layout(pp=2, vpp=2).chunk_layers(10) == [range(0, 2), range(2, 4), range(4, 7), range(7, 10)]
    assert Layout(pp=2, vpp=2).stage_layers(10) == [[0, 1, 4, 5, 6], [2, 3, 7, 8, 9]]
    assert Layout(pp=3, vpp=2).stage_layers(6) == [[0, 3], [1, 4], [2, 5]]
    # vpp 1 is the plain rule: one run per stage, the remainder to the last stages
    assert Layout(pp=2).stage_layers(5) == [[0, 1], [2, 3, 4]]
    assert Layout(pp=4, vpp=1).stage_layers(4) == [[0], [1], [2], [3]]


def test_too_few_layers_for_the_chunks_is_refused(tiny_model):
    from shardkit.errors import LayoutError
    from shardkit.families import family_for
    from shardkit.layout import ModelDims

    config = json.loads((tiny_model(CONFIG) / "config.json").read_text())
    dims = ModelDims.from_config(config)
    with pytest.raises(LayoutError, match="cannot fill pp 2 x vpp 4 = 8 pipeline chunks"):
        family_for(config).validate(Layout(pp=2, vpp=4), dims)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The tiny model converted by the CLI to tp2 pp2 vpp2 (qkv gqa)."""
    work = tmp_path_factory.mktemp("vpp-layout")
    hf = make_tiny_model(CONFIG, work / "hf", seed=5)
    out = work / "tp2pp2vpp2"
    result = run_cli("convert", hf, out, "--tp", "2", "--pp", "2", "--vpp", "2", "--qkv", "gqa")
    assert result.exit_code == 0, result.output
    return hf, out


def test_convert_then_merge_is_the_hf_model_exactly(shards, tmp_path):
    hf, out = shards
    assert json.loads((out / "shardkit.json").read_text())["layout"]["vpp"] == 2
    assert run_cli("merge", out, tmp_path / "merged").exit_code == 0
    original, merged = hf_tensors(hf), hf_tensors(tmp_path / "merged")
    assert original.keys() == merged.keys()
    for name, tensor in original.items():
        assert torch.equal(tensor, merged[name]), name


def test_rank_files_hold_their_chunks_under_global_names(shards):
    _, out = shards
    files = sorted(p.name for p in (out / "model").iterdir())
    assert files == [f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}.pt" for t in range(2) for p in range(2)]
    for tp in range(2):
        first = out / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt"
        last = out / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_01.pt"
        assert layers_in(first) == [0, 2] and layers_in(last) == [1, 3]
        first_keys, last_keys = set(safe_load(first)), set(safe_load(last))
        assert "model.embed_tokens.weight" in first_keys and "lm_head.weight" not in first_keys
        assert {"model.norm.weight", "lm_head.weight"} <= last_keys and "model.embed_tokens.weight" not in last_keys
        assert "model.layers.2.self_attn.qkv_proj.weight_q" in first_keys


def test_inspect_and_verify_a_vpp_layout(shards):
    hf, out = shards
    report = json.loads(run_cli("inspect", out, "--json").output)
    assert report["layout"]["vpp"] == 2 and report["problems"] == []
    assert [s["chunks"] for s in report["stages"]] == [[[0, 0], [2, 2]], [[1, 1], [3, 3]]]
    text = run_cli("inspect", out).output
    assert "vpp 2" in text and "0: 0-0 + 2-2" in text
    assert run_cli("verify", hf, out).exit_code == 0


def test_reshard_vpp2_to_vpp1_equals_a_direct_convert(shards, tmp_path):
    hf, out = shards
    assert run_cli("reshard", out, tmp_path / "resharded", "--tp", "2", "--pp", "2").exit_code == 0
    assert run_cli("convert", hf, tmp_path / "direct", "--tp", "2", "--pp", "2", "--qkv", "gqa").exit_code == 0
    resharded = sorted(p.relative_to(tmp_path / "resharded") for p in (tmp_path / "resharded" / "model").iterdir())
    direct = sorted(p.relative_to(tmp_path / "direct") for p in (tmp_path / "direct" / "model").iterdir())
    assert resharded == direct
    for rel in direct:
        a, b = safe_load(tmp_path / "resharded" / rel), safe_load(tmp_path / "direct" / rel)
        assert list(a) == list(b), rel
        assert all(torch.equal(a[k], b[k]) for k in a), rel
    assert layers_in(tmp_path / "direct" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt") == [0, 1]


def test_nxd_shards_without_a_manifest_have_their_vpp_read_from_the_layers(shards, tmp_path):
    hf, out = shards
    copy = tmp_path / "nxd"
    shutil.copytree(out, copy)
    (copy / "shardkit.json").unlink()
    ckpt = open_checkpoint(copy)
    assert ckpt.layout == Layout(tp=2, pp=2, vpp=2, qkv="gqa")
    assert run_cli("verify", hf, copy).exit_code == 0


def test_api_convert_round_trip_with_a_remainder(tmp_path):
    """5 layers at pp 2 vpp 2: chunks of 1, 1, 1, 2 layers; merge gives the model back."""
    from shardkit import merge
    from shardkit.testing import fixture_config

    hf = make_tiny_model({**fixture_config("llama-3.2-tiny"), "num_hidden_layers": 5}, tmp_path / "hf", seed=2)
    convert(hf, tmp_path / "s", Layout(pp=2, vpp=2))
    assert layers_in(tmp_path / "s" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt") == [0, 2]
    assert layers_in(tmp_path / "s" / "model" / "dp_rank_00_tp_rank_00_pp_rank_01.pt") == [1, 3, 4]
    merge(tmp_path / "s", tmp_path / "m")
    original, merged = hf_tensors(hf), hf_tensors(tmp_path / "m")
    assert all(torch.equal(original[k], merged[k]) for k in original)


# ---- 2. the trainer ---------------------------------------------------------------------------------

REL = 1e-5
EVAL = ["--eval-every", "2", "--eval-steps", "1"]  # forward-only passes of the schedule, after steps 2, 4, 5


work, hf_model, tokens = tiny_run_fixtures("trainer-vpp", CONFIG)


def eval_losses(metrics: Path) -> list[float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["eval_loss"] for r in records if r.get("event") == "eval"]


@pytest.fixture(scope="module")
def serial(work, hf_model, tokens):
    """The reference: pp1 in this process; its losses and its exported final weights."""
    from trainer_helpers import losses, run_inprocess

    metrics = work / "pp1.jsonl"
    summary = run_inprocess(
        run_args(hf_model, tokens, metrics, *EVAL, "--eval-data", str(tokens), "--export-hf", str(work / "pp1-export"))
    )
    assert summary.steps == 5
    found = losses(metrics)
    assert abs(found[-1] - found[0]) > 0.1, "the weights barely moved: the comparison would be weak"
    assert len(eval_losses(metrics)) == 3
    return found, hf_tensors(work / "pp1-export"), eval_losses(metrics)


def assert_same_weights(export: Path, reference: dict[str, torch.Tensor]) -> None:
    ours = hf_tensors(export)
    assert ours.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.allclose(ours[name], tensor, rtol=REL, atol=1e-6), name


@pytest.fixture(scope="module")
def vpp_run(work, hf_model, tokens):
    """pp2 vpp2 (interleaved 1F1B) for 5 steps, checkpointing at steps 3 and 5, exporting at the end."""
    from trainer_helpers import check_ok, losses, run_ranks, steps

    metrics, ckpt = work / "pp2vpp2.jsonl", work / "ckpt-pp2vpp2"
    check_ok(
        run_ranks(
            2,
            run_args(
                hf_model,
                tokens,
                metrics,
                *EVAL,
                "--eval-data",
                str(tokens),
                "--pp",
                "2",
                "--vpp",
                "2",
                "--checkpoint-dir",
                str(ckpt),
                "--checkpoint-every",
                "3",
                "--export-hf",
                str(work / "vpp-export"),
            ),
        )
    )
    start = json.loads(metrics.read_text().splitlines()[0])
    assert start["schedule"] == "ScheduleInterleaved1F1B" and start["layout"]["vpp"] == 2
    assert len(steps(metrics)) == 5
    return losses(metrics), ckpt, eval_losses(metrics)


def test_vpp2_at_pp2_equals_pp1(work, vpp_run, serial):
    """Losses of every step, the evaluations (the schedule's forward-only pass) and the final
    weights (--export-hf, merged from the vpp layout) equal pp1's."""
    from trainer_helpers import rel_diff

    expected, reference, evaluated = serial
    assert rel_diff(vpp_run[0], expected) < REL, (vpp_run[0], expected)
    assert rel_diff(vpp_run[2], evaluated) < REL, (vpp_run[2], evaluated)
    assert_same_weights(work / "vpp-export", reference)


def test_vpp_checkpoint_rank_files_hold_global_layer_names(vpp_run):
    tag = vpp_run[1] / "step_3"
    assert json.loads((tag / "shardkit.json").read_text())["layout"]["vpp"] == 2
    first, last = (tag / "model" / f"dp_rank_00_tp_rank_00_pp_rank_{pp:02d}.pt" for pp in (0, 1))
    assert layers_in(first) == [0, 2] and layers_in(last) == [1, 3]
    assert "model.embed_tokens.weight" in safe_load(first) and "lm_head.weight" in safe_load(last)


def test_vpp_run_resumes_at_another_layout(work, hf_model, tokens, vpp_run):
    """The pp2 vpp2 checkpoint of step 3 resumed at pp1 tp2 reproduces steps 4-5 of the vpp run."""
    from trainer_helpers import check_ok, rel_diff, run_ranks, steps

    metrics = work / "resume-tp2.jsonl"
    check_ok(
        run_ranks(
            2, run_args(hf_model, tokens, metrics, "--tp", "2", "--qkv", "gqa", "--resume", str(vpp_run[1] / "step_3"))
        )
    )
    records = steps(metrics)
    assert [r["step"] for r in records] == [4, 5]
    assert rel_diff([r["loss"] for r in records], vpp_run[0][3:]) < REL


def test_vpp_checkpoint_merges_and_reshards_to_plain_pp(work, hf_model, tokens, vpp_run):
    """The vpp checkpoint of step 3 merges to a Hugging Face model (the same weights as the merge of
    its plain-pp reshard), and `ckpt reshard` moves the whole training state to plain
    pp2 (layers 0-1 | 2-3), which resumes at pp2 vpp2 (looped BFS) reproducing steps 4-5."""
    from trainer_helpers import check_ok, rel_diff, run_ranks, steps

    tag = vpp_run[1] / "step_3"
    plain = work / "ckpt-plain-pp2"
    done = run_cli(
        "ckpt",
        "reshard",
        vpp_run[1],
        plain,
        "--config",
        hf_model / "config.json",
        "--vpp",
        "1",
        "--tag",
        "step_3",
        "--qkv",
        "separate",
        "--no-zero1",
    )  # pp: the source's 2
    assert done.exit_code == 0, done.output
    plain_tag = plain / "step_3"
    assert "vpp" not in json.loads((plain_tag / "shardkit.json").read_text())["layout"]
    assert layers_in(plain_tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt") == [0, 1]
    assert layers_in(plain_tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_01.pt") == [2, 3]
    assert run_cli("merge", tag, work / "merged-vpp").exit_code == 0
    assert run_cli("merge", plain_tag, work / "merged-plain").exit_code == 0
    merged_vpp, merged_plain = hf_tensors(work / "merged-vpp"), hf_tensors(work / "merged-plain")
    assert merged_vpp.keys() == hf_tensors(hf_model).keys() == merged_plain.keys()
    assert all(torch.equal(merged_vpp[k], merged_plain[k]) for k in merged_vpp)
    back = work / "ckpt-back-vpp2"  # and back: `ckpt reshard --vpp` (the layout options of reshard)
    done = run_cli("ckpt", "reshard", plain, back, "--pp", "2", "--vpp", "2", "--no-zero1")
    assert done.exit_code == 0, done.output
    assert layers_in(back / "step_3" / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt") == [0, 2]
    assert layers_in(back / "step_3" / "model" / "dp_rank_00_tp_rank_00_pp_rank_01.pt") == [1, 3]
    assert run_cli("merge", back / "step_3", work / "merged-back").exit_code == 0
    merged_back = hf_tensors(work / "merged-back")
    assert all(torch.equal(merged_back[k], merged_vpp[k]) for k in merged_vpp)
    metrics = work / "resume-vpp.jsonl"
    check_ok(
        run_ranks(
            2,
            run_args(
                hf_model,
                tokens,
                metrics,
                "--pp",
                "2",
                "--vpp",
                "2",
                "--pp-schedule",
                "looped-bfs",
                "--resume",
                str(plain_tag),
            ),
        )
    )
    records = steps(metrics)
    assert [r["step"] for r in records] == [4, 5]
    assert rel_diff([r["loss"] for r in records], vpp_run[0][3:]) < REL


SCHEDULES = {
    # name: (processes, options)
    "1f1b": (2, ["--pp", "2", "--pp-schedule", "1f1b"]),
    "gpipe": (2, ["--pp", "2", "--pp-schedule", "gpipe"]),
    "interleaved-zb": (2, ["--pp", "2", "--vpp", "2", "--pp-schedule", "interleaved-zb"]),
    "looped-bfs": (2, ["--pp", "2", "--vpp", "2", "--pp-schedule", "looped-bfs"]),
    "interleaved-dp2-zero1": (4, ["--pp", "2", "--vpp", "2", "--dp", "2", "--zero1"]),  # 2 micro-batches: 1 round
    "interleaved-tp2-sp": (
        4,
        [
            "--tp",
            "2",
            "--pp",
            "2",
            "--vpp",
            "2",
            "--pp-schedule",
            "interleaved",
            "--qkv",
            "fused",
            "--sequence-parallel",
            "--activation-checkpointing",
        ],
    ),
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if SCHEDULES[n][0] > 2 else n for n in SCHEDULES]
)
def test_each_schedule_equals_pp1(name, work, hf_model, tokens, serial):
    from trainer_helpers import check_ok, losses, rel_diff, run_ranks

    nproc, extra = SCHEDULES[name]
    metrics = work / f"schedule-{name}.jsonl"
    check_ok(run_ranks(nproc, run_args(hf_model, tokens, metrics, *extra)))
    assert rel_diff(losses(metrics), serial[0]) < REL, (name, losses(metrics), serial[0])


def test_bad_vpp_input_is_one_line(work, hf_model, tokens, capsys):
    """Local checks (no process group): what is wrong and how to fix it, in one line."""
    from trainer.__main__ import main
    from trainer.config import parse_args
    from trainer.errors import TrainerError
    from trainer.loop import plan_run
    from trainer.pipeline import resolve_schedule

    base = ["--model", str(hf_model), "--data", str(tokens), *COMMON]
    cases = {
        "needs --pp > 1": (["--vpp", "2"], 1),
        "not supported: ZBV needs a V-shaped stage placement": (["--pp", "2", "--vpp", "2", "--pp-schedule", "zbv"], 2),
        "runs one stage per pp rank, not --vpp 2": (["--pp", "2", "--vpp", "2", "--pp-schedule", "1f1b"], 2),
        "split into 2 equal rounds": (["--pp", "2", "--vpp", "2", "--global-batch", "5"], 2),
        "needs at least pp 2 micro-batches": (["--pp", "2", "--pp-schedule", "1f1b", "--global-batch", "1"], 2),
        "cannot fill pp 2 x vpp 4 = 8 pipeline chunks": (["--pp", "2", "--vpp", "4"], 2),
    }
    for fragment, (extra, world) in cases.items():
        with pytest.raises(Exception, match=fragment) as caught:
            plan_run(parse_args([*base, *extra]), world=world)
        assert "\n" not in str(caught.value)
    with pytest.raises(TrainerError, match="10 layers do not divide into pp 2 x vpp 2"):
        resolve_schedule("auto", 2, 2, 4, 10)
    assert resolve_schedule("auto", 2, 2, 4, 8) == "interleaved"
    assert resolve_schedule("interleaved", 2, 2, 3, 8) == "interleaved"  # one round of 3 (torch 2.13's rule)
    assert resolve_schedule("auto", 2, 1, 1, 8) == "gpipe" and resolve_schedule("auto", 2, 1, 4, 8) == "1f1b"
    out = work / "bad-single"
    assert main([*base, "--vpp", "2", "--checkpoint-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainer: error:") and "--vpp 2 needs --pp > 1" in err[0]
    assert not out.exists()


@pytest.mark.slow  # in process: the refusals above; every rank exits 2: test_trainer's bad input
def test_zbv_refused_on_every_rank(work, hf_model, tokens):
    """Under torchrun: rank 0 prints the one line, every rank exits 2, nothing is written."""
    from trainer_helpers import torchrun, worker_exit_codes

    out = work / "bad-zbv"
    done = torchrun(
        2,
        run_args(
            hf_model,
            tokens,
            out / "m.jsonl",
            "--pp",
            "2",
            "--vpp",
            "2",
            "--pp-schedule",
            "zbv",
            "--checkpoint-dir",
            str(out / "ckpt"),
        ),
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert worker_exit_codes(done.stderr) == {0: 2, 1: 2}, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("trainer: error:")]
    assert len(lines) == 1 and "V-shaped" in lines[0], done.stderr
    assert not out.exists()
