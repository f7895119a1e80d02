"""The command line: bad input gives one clear line, exit code 2, no DST, SRC untouched; --help
teaches every option; NxD's flag spellings mean the same as shardkit's; inspect and verify."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import torch
from click.testing import CliRunner

from shardkit.cli import cli


def run(*args: str):
    return CliRunner().invoke(cli, ["-q", *map(str, args)], catch_exceptions=False)


def tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(path)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def assert_clean_failure(result, dst: Path, *phrases: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("shardkit: error: ")
    assert "Traceback" not in result.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    assert not dst.exists(), "a failed command left its destination behind"
    leftovers = [p.name for p in dst.parent.iterdir() if "shardkit-tmp" in p.name]
    assert not leftovers, leftovers


@pytest.fixture(scope="module")
def sharded(tiny_model, tmp_path_factory):
    """A tp 4, pp 2 shard directory of llama-gqa64 (built once), and its HF source."""
    src = tiny_model("llama-gqa64")
    out = tmp_path_factory.mktemp("cli") / "tp4pp2"
    result = run("convert", src, out, "--tp", "4", "--pp", "2", "--qkv", "gqa")
    assert result.exit_code == 0, result.stderr
    return src, out


def copy_of(path: Path, tmp_path: Path) -> Path:
    dst = tmp_path / f"copy-{path.name}"
    shutil.copytree(path, dst)
    return dst


def test_missing_rank_file(sharded, tmp_path):
    _, shards = sharded
    src = copy_of(shards, tmp_path)
    (src / "model/dp_rank_00_tp_rank_02_pp_rank_01.pt").unlink()
    before = tree_digest(src)
    result = run("merge", src, tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "dp_rank_00_tp_rank_02_pp_rank_01.pt", "missing")
    assert tree_digest(src) == before


def test_missing_rank_file_nxd_without_manifest(sharded, tmp_path):
    _, shards = sharded
    src = copy_of(shards, tmp_path)
    (src / "shardkit.json").unlink()
    for f in (src / "model").glob("dp_rank_00_tp_rank_03_*"):
        f.unlink()  # a whole tp rank gone: file names alone would suggest tp 3
    result = run("merge", src, tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "tp 4", "missing")


def test_truncated_file(sharded, tmp_path):
    _, shards = sharded
    src = copy_of(shards, tmp_path)
    victim = src / "model/dp_rank_00_tp_rank_01_pp_rank_00.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    before = tree_digest(src)
    result = run("merge", src, tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "dp_rank_00_tp_rank_01_pp_rank_00.pt", "truncated")
    assert tree_digest(src) == before


def test_config_does_not_match_shards(sharded, tmp_path):
    _, shards = sharded
    src = copy_of(shards, tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] *= 2
    (src / "config.json").write_text(json.dumps(config))
    result = run("merge", src, tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "does not match")


def test_config_does_not_match_hf_weights(tiny_model, tmp_path):
    src = copy_of(tiny_model("llama-mha"), tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] += 1
    (src / "config.json").write_text(json.dumps(config))
    result = run("convert", src, tmp_path / "out", "--tp", "2")
    assert_clean_failure(result, tmp_path / "out", "model.layers.3", "does not match")


def test_unknown_model_type(tiny_model, tmp_path):
    src = copy_of(tiny_model("llama-mha"), tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "mamba"
    (src / "config.json").write_text(json.dumps(config))
    before = tree_digest(src)
    result = run("convert", src, tmp_path / "out", "--tp", "2")
    assert_clean_failure(result, tmp_path / "out", "'mamba' is not supported", "llama")
    assert tree_digest(src) == before


@pytest.mark.parametrize(
    "flags, phrase",
    [
        (["--tp", "48"], "64 q heads are not divisible by tp 48"),
        (["--tp", "16"], "8 kv heads x kv-multiplier 1 = 8 is not a multiple of tp 16: use --kv-multiplier 2"),
        (["--tp", "8", "--kv-multiplier", "16"], "kv-multiplier 16 is too large"),
        (["--tp", "2", "--pp", "6"], "5 layers cannot fill 6 pipeline stages"),
        (["--tp", "2", "--hw", "trn1", "--kv-replication", "blocked"], "--hw trn1 means interleaved"),
        (["--tp", "2", "--fuse-qkv", "--coalesce-qkv"], "exclude each other"),
    ],
)
def test_impossible_layout(tiny_model, tmp_path, flags, phrase):
    result = run("convert", tiny_model("llama-gqa64"), tmp_path / "out", *flags)
    assert_clean_failure(result, tmp_path / "out", phrase)


def test_existing_destination_needs_overwrite(sharded, tmp_path):
    src, _ = sharded
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    result = run("convert", src, dst, "--tp", "2")
    assert result.exit_code == 2 and "--overwrite" in result.stderr
    assert [p.name for p in dst.iterdir()] == ["keep.txt"], "DST was modified without --overwrite"
    result = run("convert", src, dst, "--tp", "2", "--overwrite")
    assert result.exit_code == 0, result.stderr
    assert not (dst / "keep.txt").exists() and (dst / "shardkit.json").is_file()


def test_destination_inside_source_is_refused(sharded, tmp_path):
    src, _ = sharded
    src_copy = copy_of(src, tmp_path)
    before = tree_digest(src_copy)
    result = run("convert", src_copy, src_copy / "shards", "--tp", "2")
    assert result.exit_code == 2 and "overlaps the source" in result.stderr
    assert tree_digest(src_copy) == before


def test_not_a_model_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run("merge", tmp_path / "empty", tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "not a model directory")


def test_nxd_shards_without_config_ask_for_it(sharded, tmp_path):
    _, shards = sharded
    src = copy_of(shards, tmp_path)
    (src / "shardkit.json").unlink()
    (src / "config.json").unlink()
    result = run("merge", src, tmp_path / "out")
    assert_clean_failure(result, tmp_path / "out", "--config")
    result = run("merge", src, tmp_path / "out", "--config", shards / "config.json")
    assert result.exit_code == 0, result.stderr


def test_real_entry_point_exit_code_and_debug(tmp_path):
    """The installed console entry: exit 2 and one line; --debug adds the traceback."""
    args = [sys.executable, "-m", "shardkit", "-q", "merge", str(tmp_path / "nope"), str(tmp_path / "out")]
    plain = subprocess.run(args, capture_output=True, text=True)
    assert plain.returncode == 2
    assert plain.stderr.strip().count("\n") == 0 and "does not exist" in plain.stderr
    debug = subprocess.run(args[:3] + ["--debug"] + args[3:], capture_output=True, text=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_every_option_has_help():
    for name, command in cli.commands.items():
        assert command.help, f"command {name} has no help"
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help and len(param.help) > 10, f"{name} {param.opts} has no help"
        result = CliRunner().invoke(cli, [name, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output


def test_nxd_flag_spellings_mean_the_same(tiny_model, tmp_path):
    src = tiny_model("llama-gqa64")
    a = run(
        "convert",
        src,
        tmp_path / "a",
        "--tp",
        "16",
        "--pp",
        "2",
        "--qkv",
        "gqa",
        "--kv-multiplier",
        "2",
        "--hw",
        "trn1",
    )
    b = run(
        "convert",
        src,
        tmp_path / "b",
        "--tp-size",
        "16",
        "--pp-size",
        "2",
        "--qkv-linear",
        "--kv-size-multiplier",
        "2",
        "--kv-replication",
        "interleaved",
    )
    assert a.exit_code == b.exit_code == 0
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a/model").iterdir())
    assert len(files) == 32
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    fused = run("convert", src, tmp_path / "c", "--tp", "8", "--qkv-linear", "--fuse-qkv", "--json")
    assert json.loads(fused.output)["layout"]["qkv"] == "fused"


def test_inspect_reports_layout_and_problems(sharded, tmp_path):
    _, shards = sharded
    result = run("inspect", shards, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.output)
    assert report["layout"]["tp"] == 4 and report["layout"]["pp"] == 2 and report["layout"]["qkv"] == "gqa"
    assert report["files"] == 8 and report["problems"] == []
    assert [s["layers"] for s in report["stages"]] == [[0, 1], [2, 4]]
    text = run("inspect", shards)
    assert "tp 4, pp 2, qkv gqa" in text.output and "problems: none found" in text.output

    # a replicated norm that disagrees between tp ranks is a problem only a data check can see
    broken = copy_of(shards, tmp_path)
    f = broken / "model/dp_rank_00_tp_rank_03_pp_rank_01.pt"
    state = torch.load(f, weights_only=True)
    state["model.norm.weight"] = state["model.norm.weight"] + 1
    torch.save(state, f)
    assert run("inspect", broken).exit_code == 0
    checked = run("inspect", broken, "--check-data", "--json")
    assert checked.exit_code == 1
    problems = json.loads(checked.output)["problems"]
    assert any("model/dp_rank_00_tp_rank_03_pp_rank_01.pt does not match its size and digests" in p for p in problems)
    assert any("copies of model.norm.weight" in p for p in problems)


def test_verify_finds_a_one_ulp_change(sharded, tmp_path):
    src, shards = sharded
    assert run("verify", src, shards).exit_code == 0
    broken = copy_of(shards, tmp_path)
    f = broken / "model/dp_rank_00_tp_rank_02_pp_rank_01.pt"
    state = torch.load(f, weights_only=True)
    name = "model.layers.3.mlp.down_proj.weight"
    state[name][5, 1] = torch.nextafter(state[name][5, 1], torch.tensor(10.0))
    torch.save(state, f)
    result = run("verify", src, broken)
    assert result.exit_code == 1
    assert f"MISMATCH {name}" in result.output and "1 of" in result.output
    report = json.loads(run("verify", src, broken, "--json").output)
    assert [t["name"] for t in report["tensors"] if not t["equal"]] == [name]
    assert run("verify", src, broken, "--atol", "1e-3").exit_code == 0


@pytest.mark.parametrize(
    "args, phrases",
    [
        (["convert", "a", "b", "--tpp", "2"], ["No such option '--tpp'", "'--tp'", "Try 'shardkit convert --help'"]),
        (["convert", "a", "b", "--tp", "0"], ["'--tp'", "0 is not in the range", "Try 'shardkit convert --help'"]),
        (["ckpt", "prune", "x", "--keep", "0"], ["'--keep'", "Try 'shardkit ckpt prune --help'"]),
        (["ckpt", "prune", "x"], ["Missing option '--keep'", "Try 'shardkit ckpt prune --help'"]),
        (["ckpt", "reshard", "x"], ["Missing argument 'DST'", "Try 'shardkit ckpt reshard --help'"]),
        (["convrt", "a", "b"], ["No such command 'convrt'", "'convert'", "Try 'shardkit --help'"]),
        (["--bogus", "convert"], ["No such option '--bogus'", "Try 'shardkit --help'"]),
        (["ckpt", "lst"], ["No such command 'lst'", "Try 'shardkit ckpt --help'"]),
    ],
)
def test_usage_errors_are_one_line_with_clicks_hint(args, phrases):
    """A typo'd option or command, a value out of range, a missing argument: click's message and
    its "Try '... --help'" hint on ONE stderr line `shardkit: error: ...`, exit 2 (also -q)."""
    for quiet in ([], ["-q"]):
        result = CliRunner().invoke(cli, [*quiet, *args], prog_name="shardkit")
        assert result.exit_code == 2, (result.exit_code, result.output)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("shardkit: error: "), result.stderr
        for phrase in phrases:
            assert phrase in lines[0], (phrase, lines[0])
        assert not result.stdout.strip(), result.stdout


def test_usage_error_of_the_real_entry_point_is_one_line():
    """The console entry prints the same one line (click's standalone main, not the test runner)."""
    done = subprocess.run(
        [sys.executable, "-m", "shardkit", "convert", "a", "b", "--tpp", "2"], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--tpp" in done.stderr and "Try 'shardkit convert --help' for help." in done.stderr
    bare = CliRunner().invoke(cli, [])  # no command: the help, as before
    assert "Commands:" in bare.output
