"""CLI conventions users expect, all offline: the cli/ package laid out by command group, global
flags after the subcommand, one size grammar, missing local paths never taken for Hub repo ids,
progress bars only on a terminal, reshard keeping the source's qkv style, inspect --check-data
saying what it checked, single-file sources, ckpt export's side files, plan --suggest, and the
README's commands writing under runs/.
"""

from __future__ import annotations

import ast
import json
import socket
from pathlib import Path

import pytest
import torch
from cli_helpers import one_line_error
from click.testing import CliRunner

import shardkit.api
from shardkit.cli import cli, main
from shardkit.engine.operations import StagingProgress
from shardkit.layout import Layout, make_layout

ROOT = Path(__file__).resolve().parents[3]
CLI_DIR = ROOT / "shardkit" / "cli"


def invoke(*args, **kw):
    return CliRunner().invoke(cli, [str(a) for a in args], **kw)


@pytest.fixture(scope="module")
def gqa_shards(tiny_model, tmp_path_factory):
    """llama-gqa64 as tp 2 shards, qkv gqa, kv-multiplier 2, blocked replicas."""
    src = tiny_model("llama-gqa64")
    out = tmp_path_factory.mktemp("conv") / "tp2-gqa"
    result = invoke("-q", "convert", src, out, "--tp", "2", "--qkv", "gqa", "--kv-multiplier", "2", "--hw", "trn2")
    assert result.exit_code == 0, result.stderr
    return src, out


# ---- the cli/ package --------------------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
            found.update("." * node.level + (node.module + "." if node.module else "") + a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_cli_is_a_package_laid_out_by_command_group():
    assert callable(main) and cli.name == "cli"
    for name in ("__init__", "main", "options", "convert", "inspect", "plan", "ckpt", "hub"):
        assert (CLI_DIR / f"{name}.py").is_file(), name
    assert not (ROOT / "shardkit" / "cli.py").exists()
    assert set(cli.commands) == {"convert", "merge", "reshard", "inspect", "verify", "plan", "push", "ckpt"}
    for module in ("options", "convert", "inspect", "plan", "ckpt", "hub"):
        imports = _imports(CLI_DIR / f"{module}.py")
        assert not {".main", "shardkit.cli.main", ".", "shardkit.cli", "shardkit"} & imports, (module, imports)


def test_plan_command_is_split_into_short_steps():
    tree = ast.parse((CLI_DIR / "plan.py").read_text())
    lengths = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert {"check_options", "suggest", "plan_one", "plan_cmd"} <= set(lengths)
    too_long = {name: n for name, n in lengths.items() if n > 42 and name != "plan_cmd"}
    assert not too_long, too_long
    body = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "plan_cmd")
    assert body.end_lineno - body.body[0].end_lineno < 10  # the docstring, then a dispatch


# ---- global flags after the subcommand ----------------------------------------------------------


def test_quiet_verbose_debug_work_after_the_subcommand(tiny_model, tmp_path, caplog):
    from shardkit.errors import ShardkitError

    src = tiny_model("llama-gqa64")
    quiet = invoke("convert", src, tmp_path / "a", "--tp", "2", "-q")
    assert quiet.exit_code == 0, quiet.stderr
    assert quiet.output == "" and quiet.stderr == ""
    loud = invoke("convert", src, tmp_path / "b", "--tp", "2", "--verbose")
    assert loud.exit_code == 0 and "wrote" in loud.output
    assert any(r.levelname == "INFO" and "wrote 2 files" in r.getMessage() for r in caplog.records)  # -v: INFO
    debug = invoke("merge", tmp_path / "nothing-here", tmp_path / "c", "--debug")
    assert isinstance(debug.exception, ShardkitError)  # --debug re-raises instead of the one line
    assert "shardkit: error" not in debug.stderr
    for args in (["plan", "--help"], ["ckpt", "list", "--help"]):
        assert "-q, --quiet" in invoke(*args).output


# ---- one size grammar ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["5GB", "5GiB", "5G", "500MB", "5368709120"])
def test_max_shard_size_accepts_the_size_grammar(gqa_shards, tmp_path, size):
    _, shards = gqa_shards
    result = invoke("-q", "merge", shards, tmp_path / "hf", "--max-shard-size", size)
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_small_max_shard_size_splits_and_bad_sizes_are_one_line(gqa_shards, tmp_path):
    _, shards = gqa_shards
    result = invoke("-q", "merge", shards, tmp_path / "hf", "--max-shard-size", "64KiB")
    assert result.exit_code == 0, result.stderr
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    one_line_error(invoke("merge", shards, tmp_path / "x", "--max-shard-size", "lots"), "max shard size 'lots'")
    assert not (tmp_path / "x").exists()
    one_line_error(
        invoke("plan", "--config", ROOT / "fixtures/llama-2-7b.json", "--device-memory", "16"), "give a unit"
    )
    # the library takes the same grammar: huggingface_hub's splitter gets bytes
    assert shardkit.api.merge(shards, tmp_path / "lib", max_shard_size="5GiB").path == tmp_path / "lib"


# ---- missing local paths are never Hub lookups --------------------------------------------------


@pytest.mark.parametrize("where", ["./no-such-model", "../no-such-model", "/no-such-model", "~/no-such-model"])
def test_missing_local_path_is_not_a_hub_lookup(where, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError(f"network attempt for {where}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr("shardkit.hub.download._download", no_network)
    monkeypatch.chdir(tmp_path)
    for args in (
        ["convert", where, tmp_path / "o", "--tp", "2"],
        ["merge", where, tmp_path / "o"],
        ["inspect", where],
        ["reshard", where, tmp_path / "o"],
    ):
        one_line_error(invoke(*args), f"{where} does not exist")
    assert not (tmp_path / "o").exists()


def test_org_name_offline_is_a_hub_id_with_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(socket.socket, "connect", lambda *a, **k: (_ for _ in ()).throw(AssertionError("network")))
    line = one_line_error(invoke("inspect", "some-org/some-model"))
    assert "does not exist" not in line and "some-org/some-model" in line


# ---- progress bars ------------------------------------------------------------------------------


def test_progress_bars_only_on_a_terminal_or_when_forced(tiny_model, tmp_path):
    src = tiny_model("llama-gqa64")
    plain = invoke("convert", src, tmp_path / "a", "--tp", "2")
    assert plain.exit_code == 0 and "convert:" not in plain.stderr  # CliRunner's stderr is no terminal
    forced = invoke("convert", src, tmp_path / "b", "--tp", "2", "--progress")
    assert forced.exit_code == 0 and "convert:" in forced.stderr and "100%" in forced.stderr
    hidden = invoke("--progress", "convert", src, tmp_path / "c", "--tp", "2", "-q")
    assert hidden.exit_code == 0 and hidden.stderr == ""
    off = invoke("--progress", "convert", src, tmp_path / "d", "--tp", "2", "--no-progress")
    assert off.exit_code == 0 and "convert:" not in off.stderr


def test_rank0_progress_counts_every_rank_in_the_staging_folder(tmp_path):
    import os

    seen = []
    watcher = StagingProgress(
        lambda done, total: seen.append((done, total)), tmp_path / "out", total=1000, interval=0.01
    )
    staging = tmp_path / f".out.shardkit-tmp-{os.getpid()}"
    assert watcher.staging == staging
    (staging / "model").mkdir(parents=True)
    (staging / "model" / "rank0.pt").write_bytes(b"x" * 300)  # rank 0's file
    (staging / "model" / "rank1.pt").write_bytes(b"x" * 200)  # another rank's, same folder
    assert watcher.poll() == 500 and seen[-1] == (500, 1000)
    (staging / "model" / "rank2.pt").write_bytes(b"x" * 900)
    assert watcher.poll() == 1000  # headers may push past the plan: never past the total
    with watcher:
        pass
    assert seen[-1] == (1000, 1000)


# ---- reshard keeps the source's qkv style -------------------------------------------------------


def test_reshard_keeps_the_sources_qkv_style_and_replication(gqa_shards, tmp_path):
    _, shards = gqa_shards
    result = invoke("reshard", shards, tmp_path / "tp4", "--tp", "4", "--kv-multiplier", "2")
    assert result.exit_code == 0, result.stderr
    layout = json.loads((tmp_path / "tp4" / "shardkit.json").read_text())["layout"]
    assert layout["qkv"] == "gqa" and layout["kv_replication"] == "blocked"
    notes = [line for line in result.stderr.splitlines() if "kept the source's" in line]
    assert len(notes) == 1 and "qkv style gqa" in notes[0] and "kv replication blocked" in notes[0]
    quiet = invoke("reshard", shards, tmp_path / "q", "--tp", "4", "--kv-multiplier", "2", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""
    asked = invoke(
        "-q",
        "reshard",
        shards,
        tmp_path / "sep",
        "--tp",
        "4",
        "--kv-multiplier",
        "2",
        "--qkv",
        "separate",
        "--hw",
        "trn1",
    )
    assert asked.exit_code == 0, asked.stderr
    layout = json.loads((tmp_path / "sep" / "shardkit.json").read_text())["layout"]
    assert layout["qkv"] == "separate" and layout["kv_replication"] == "interleaved"


def test_make_layout_inherits_only_what_is_unset(tiny_model, tmp_path):
    source = Layout(tp=8, kv_multiplier=2, kv_replication="blocked", qkv="fused")
    assert make_layout(tp=2, inherit=source) == Layout(tp=2, kv_replication="blocked", qkv="fused")
    assert make_layout(tp=2, qkv="gqa", hw="trn1", inherit=source) == Layout(tp=2, qkv="gqa")
    assert make_layout(tp=2) == Layout(tp=2)  # no source: separate, interleaved
    src = tiny_model("llama-gqa64")
    assert invoke("-q", "convert", src, tmp_path / "c", "--tp", "2").exit_code == 0
    assert json.loads((tmp_path / "c" / "shardkit.json").read_text())["layout"]["qkv"] == "separate"


# ---- inspect --check-data says what it checked --------------------------------------------------


def test_inspect_check_data_says_what_it_checked(gqa_shards, monkeypatch):
    _, shards = gqa_shards
    real = shardkit.api.inspect
    calls = {}

    def fake(path, config=None, hints=None, check_data=False, revision=None, progress=None):
        calls["progress"] = progress
        report = real(path, config, hints, False, revision)
        report["checked"] = {"files_hashed": 128, "hash_mismatches": 0, "replica_groups": 40, "replica_mismatches": 0}
        return report

    monkeypatch.setattr(shardkit.api, "inspect", fake)
    result = invoke("inspect", shards, "--check-data")
    assert result.exit_code == 0, result.stderr
    assert "128 files re-hashed, 0 mismatches; kv replicas agree" in result.output
    assert callable(calls["progress"])
    data = json.loads(invoke("inspect", shards, "--check-data", "--json").output)
    assert data["checked"]["files_hashed"] == 128


# ---- single-file sources, ckpt export side files, plan --suggest ---------------------------------


def test_single_file_source_writes_beside_the_file(tmp_path):
    from shardkit.testing import make_tiny_model

    hf = make_tiny_model("llama-gqa64", tmp_path / "hf")
    from safetensors.torch import load_file

    folder = tmp_path / "single"
    folder.mkdir()
    torch.save(load_file(hf / "model.safetensors"), folder / "sd.pt")
    (folder / "cfg.json").write_text((hf / "config.json").read_text())
    result = invoke("-q", "convert", folder / "sd.pt", folder / "out", "--config", folder / "cfg.json", "--tp", "2")
    assert result.exit_code == 0, result.stderr
    assert (folder / "out" / "shardkit.json").is_file() and (folder / "sd.pt").is_file()
    one_line_error(invoke("convert", folder / "sd.pt", folder / "sd.pt", "--config", folder / "cfg.json"), "overlaps")
    one_line_error(
        invoke("convert", folder / "sd.pt", folder, "--config", folder / "cfg.json", "--overwrite"), "overlaps"
    )
    assert (folder / "sd.pt").is_file()


def test_ckpt_export_copies_generation_config_from_the_checkpoint_dir(tiny_model, tmp_path):
    src = tiny_model("llama-gqa64")
    ckpt = tmp_path / "ckpt"
    assert invoke("-q", "convert", src, ckpt / "step_1", "--tp", "2").exit_code == 0
    (ckpt / "step_1" / "generation_config.json").unlink(missing_ok=True)
    (ckpt / "generation_config.json").write_text('{"max_new_tokens": 7}')
    for marker in ("checkpoint", "done"):
        (ckpt / "step_1" / marker).write_text("1")
    result = invoke("-q", "ckpt", "export", ckpt, tmp_path / "hf")
    assert result.exit_code == 0, result.stderr
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"max_new_tokens": 7}


def test_plan_suggest_leaves_out_layouts_that_add_nothing():
    result = invoke(
        "plan", "--config", ROOT / "fixtures/llama-gqa64.json", "--suggest", "--device-memory", "1GiB", "--limit", "0"
    )
    assert result.exit_code == 0, result.stderr
    rows = [line.split() for line in result.output.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    tp1 = [(int(r[1]), r[5] + r[6]) for r in rows if r[0] == "1"]
    assert [pp for pp, _ in tp1] == [1, 2, 3, 5]  # pp 4 holds 2 layers per rank, as pp 3 does
    assert len({mem for _, mem in tp1}) == len(tp1)
    best = [line for line in result.output.splitlines() if line.startswith("best:")]
    assert len(best) == 1 and "tp 1, pp 1" in best[0] and "smallest tp" in best[0]
    assert "left out" in result.output


# ---- the README ---------------------------------------------------------------------------------


def test_readme_writes_under_runs_and_installs_cpu_torch_first():
    readme = (ROOT / "README.md").read_text()
    assert "runs/" in (ROOT / ".gitignore").read_text().split()
    try_it = readme.split("## Try it", 1)[1].split("\n## ", 1)[0]
    cpu = try_it.index("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    assert cpu < try_it.index("python scripts/demo.py")
    commands = readme.split("## Commands", 1)[1].split("\n## ", 1)[0]
    for line in commands.splitlines():
        if line.startswith("shardkit ") and (" merge " in line or " convert ./" in line or " reshard " in line):
            dst = line.split()[3]
            assert dst.startswith("./runs/") or dst.startswith("runs/"), line
