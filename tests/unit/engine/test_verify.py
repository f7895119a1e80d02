"""verify streams blocks of rows (exact in the tensors' own dtype, or float32 with atol; NaN equals
NaN in the same place) and reports progress; inspect --check-data says what it checked and never
opens a file outside the checkpoint, whatever its manifest says."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import shardkit
from shardkit import Layout, convert
from shardkit.engine import check
from shardkit.formats import SourceReader

MODEL = "llama-gqa64"  # hidden 128, intermediate 64, vocab 128, 5 layers
DOWN = "model.layers.3.mlp.down_proj.weight"  # split along dim 1 in the shards
GATE = "model.layers.1.mlp.gate_proj.weight"  # split along dim 0


@pytest.fixture(scope="module")
def shards(tiny_model, tmp_path_factory):
    """The HF source and its tp 4, pp 2 shards (torch format)."""
    src = tiny_model(MODEL)
    out = tmp_path_factory.mktemp("verify") / "tp4pp2"
    convert(src, out, Layout(tp=4, pp=2, qkv="gqa"))
    return src, out


def edited_hf(src: Path, dst: Path, edit) -> Path:
    """A copy of the HF directory `src` whose tensors went through `edit(state)`."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    edit(state)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def mismatched(report) -> dict[str, float | None]:
    return {t.name: t.max_abs_diff for t in report.tensors if not t.equal}


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows, so that every tensor of the tiny models spans several blocks."""
    monkeypatch.setattr(check, "VERIFY_BLOCK_BYTES", 1024)


# ---- exact and atol --------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", ["default", "small"])
def test_hf_and_its_shards_are_bit_equal(shards, blocks, request):
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    src, out = shards
    report = shardkit.verify(src, out)
    assert report.ok, mismatched(report)
    assert all(t.max_abs_diff == 0.0 and t.note == "" for t in report.tensors)
    assert shardkit.verify(out, src).ok


@pytest.mark.parametrize("fmt", ["xser", "safetensors"])
def test_every_format_reads_blocks_of_rows(tiny_model, tmp_path, small_blocks, fmt):
    src = tiny_model(MODEL)
    convert(src, tmp_path / fmt, Layout(tp=4, pp=1, qkv="fused", kv_multiplier=2), format=fmt)
    report = shardkit.verify(tmp_path / fmt, src)
    assert report.ok and all(t.max_abs_diff == 0.0 for t in report.tensors), mismatched(report)


def test_experts_stacked_and_transposed_compare_in_blocks(tiny_model, tmp_path, small_blocks):
    src = tiny_model("mixtral-tiny")
    convert(src, tmp_path / "ep2", Layout(tp=2, ep=2, qkv="gqa"))
    report = shardkit.verify(src, tmp_path / "ep2")
    assert report.ok and len(report.tensors) > 20, mismatched(report)
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"

    def edit(state):
        state[name][7, 3] += 0.25

    broken = edited_hf(src, tmp_path / "broken", edit)
    report = shardkit.verify(tmp_path / "ep2", broken)
    assert list(mismatched(report)) == [name]


@pytest.mark.parametrize("name,where", [(DOWN, (5, 1)), (GATE, (17, 100))])
def test_one_flipped_element_is_found_with_its_difference(shards, tmp_path, small_blocks, name, where):
    src, out = shards
    want = torch.tensor(0.5)

    def edit(state):
        state[name][where] += want

    broken = edited_hf(src, tmp_path / "broken", edit)
    original = load_file(src / "model.safetensors")[name][where]
    changed = load_file(broken / "model.safetensors")[name][where]
    report = shardkit.verify(out, broken)
    assert mismatched(report) == {name: (changed - original).abs().item()}
    assert not report.ok and len(report.mismatches) == 1
    assert shardkit.verify(out, broken, atol=0.6).ok
    report = shardkit.verify(out, broken, atol=0.4)
    assert list(mismatched(report)) == [name]
    assert shardkit.verify(out, broken, atol=0.6).to_dict()["mismatches"] == 0


def test_atol_counts_the_worst_difference_of_every_tensor(shards, tmp_path):
    src, out = shards

    def edit(state):
        state[GATE] += 1e-4

    broken = edited_hf(src, tmp_path / "broken", edit)
    report = shardkit.verify(out, broken, atol=1e-3)
    assert report.ok
    gate = next(t for t in report.tensors if t.name == GATE)
    assert 0 < gate.max_abs_diff < 1e-3
    assert list(mismatched(shardkit.verify(out, broken))) == [GATE]


# ---- NaN and infinities ----------------------------------------------------------------------------


def test_nan_equals_nan_in_the_same_place(shards, tmp_path):
    src, _ = shards

    def edit(state):
        state[DOWN][2, 9] = math.nan
        state[GATE][0, 0] = math.inf
        state[GATE][1, 0] = -math.inf

    nan = edited_hf(src, tmp_path / "nan", edit)
    assert shardkit.verify(nan, nan).ok
    convert(nan, tmp_path / "nan-shards", Layout(tp=2, pp=1))
    assert shardkit.verify(nan, tmp_path / "nan-shards").ok
    assert shardkit.verify(nan, tmp_path / "nan-shards", atol=1e-3).ok

    # NaN against a number, and an infinity against the other one, differ infinitely
    report = shardkit.verify(nan, src)
    assert mismatched(report) == {DOWN: math.inf, GATE: math.inf}
    assert mismatched(shardkit.verify(src, nan, atol=1.0)) == {DOWN: math.inf, GATE: math.inf}

    def flip(state):
        state[DOWN][2, 9] = math.nan
        state[GATE][0, 0] = -math.inf
        state[GATE][1, 0] = -math.inf

    flipped = edited_hf(src, tmp_path / "flipped", flip)
    assert mismatched(shardkit.verify(nan, flipped)) == {GATE: math.inf}


def test_nan_vs_number_is_a_mismatch_at_any_atol(tmp_path):
    a = torch.tensor([[1.0, math.nan], [math.inf, 2.0]])
    assert check._worst(a, a.clone(), torch.float32) == 0.0
    b = torch.tensor([[1.0, 3.0], [math.inf, 2.0]])
    assert check._worst(a, b, torch.float32) == math.inf
    assert check._same(a, a.clone()) and not check._same(a, b)
    # exact means bitwise: +0.0 and -0.0 are different bits with no difference in value
    assert not check._same(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert check._worst(torch.tensor([0.0]), torch.tensor([-0.0]), torch.float32) == 0.0


# ---- dtypes ----------------------------------------------------------------------------------------


def test_different_dtypes_compare_in_float32_and_differ_unless_ignored(tiny_model, tmp_path):
    bf16 = tiny_model(MODEL, torch.bfloat16)
    convert(bf16, tmp_path / "fp32", Layout(tp=2, pp=1), dtype="float32")
    report = shardkit.verify(bf16, tmp_path / "fp32")
    assert all(t.equal and t.max_abs_diff == 0.0 for t in report.tensors)  # bf16 -> fp32 is exact
    assert all(
        t.note == "dtype bfloat16 vs float32" and (t.dtype_a, t.dtype_b) == ("bfloat16", "float32")
        for t in report.tensors
    )
    assert not report.ok and len(report.mismatches) == len(report.dtype_differences) == len(report.tensors)
    ignored = shardkit.verify(bf16, tmp_path / "fp32", ignore_dtype=True)
    assert ignored.ok and len(ignored.dtype_differences) == len(report.tensors)  # still named

    fp32 = tiny_model(MODEL, torch.float32)  # same seed: bf16 is fp32 rounded
    report = shardkit.verify(fp32, bf16, ignore_dtype=True)
    assert not report.ok and report.tensors[0].note == "dtype float32 vs bfloat16"
    worst = max(t.max_abs_diff for t in report.tensors)
    assert 0 < worst < 0.02
    assert shardkit.verify(fp32, bf16, atol=0.02, ignore_dtype=True).ok
    assert not shardkit.verify(fp32, bf16, atol=0.02).ok  # a tolerance on values says nothing of dtypes


def test_cli_names_the_tensors_whose_dtype_differs_and_exits_1_unless_ignored(tiny_model, tmp_path):
    """A bf16 model and its fp32 copy hold equal values in different dtypes: not "equal" (exit 1),
    the text and --json name the count and the tensors; --ignore-dtype exits 0 and still says so."""
    bf16 = tiny_model(MODEL, torch.bfloat16)
    convert(bf16, tmp_path / "fp32", Layout(tp=2, pp=1), dtype="float32")
    count = len(shardkit.open_checkpoint(bf16).full_shapes)
    result = cli_run("verify", bf16, tmp_path / "fp32")
    assert result.exit_code == 1, result.output
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"{count} tensors compared: equal values; {count} tensors differ in dtype")
    assert "bfloat16 in A, float32 in B: model.embed_tokens.weight" in last and "--ignore-dtype" in last
    assert result.stdout.count("DTYPE    ") == count and "MISMATCH" not in result.stdout

    report = json.loads(cli_run("verify", bf16, tmp_path / "fp32", "--json").stdout)
    assert not report["ok"] and report["mismatches"] == count
    assert report["dtype_differences"]["count"] == count and not report["dtype_differences"]["ignored"]
    assert report["dtype_differences"]["tensors"]["model.norm.weight"] == ["bfloat16", "float32"]
    assert all(t["equal"] and t["dtype_a"] == "bfloat16" and t["dtype_b"] == "float32" for t in report["tensors"])

    result = cli_run("verify", bf16, tmp_path / "fp32", "--ignore-dtype")
    assert result.exit_code == 0, result.output
    assert "differ in dtype" in result.stdout and "ignored (--ignore-dtype)" in result.stdout
    result = cli_run("verify", bf16, bf16)
    assert result.exit_code == 0 and result.stdout.strip().endswith(f"{count} tensors compared: equal")


@pytest.mark.parametrize("atol", ["nan", "-1", "inf", "-0.5", "lots"])
def test_cli_atol_that_is_not_a_finite_number_at_least_0_is_a_usage_error(shards, atol):
    src, out = shards
    result = cli_run("verify", src, out, "--atol", atol)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardkit: error: --atol") and ">= 0" in lines[0], result.stderr
    with pytest.raises(shardkit.ShardkitError, match=">= 0"):
        shardkit.verify(src, out, atol=float(atol) if atol != "lots" else atol)


def cli_run(*args):
    from click.testing import CliRunner

    from shardkit.cli import cli

    return CliRunner().invoke(cli, ["-q", *map(str, args)], catch_exceptions=False)


# ---- streaming -------------------------------------------------------------------------------------


def test_verify_reads_blocks_never_a_whole_tensor_nor_float64(shards, monkeypatch, small_blocks):
    src, out = shards
    largest = {"numel": 0, "reads": 0}
    read_rows = SourceReader.read_rows

    def spy(self, source, start, stop):
        t = read_rows(self, source, start, stop)
        largest["numel"] = max(largest["numel"], t.numel())
        largest["reads"] += 1
        return t

    def no_double(self, *args, **kwargs):
        raise AssertionError("verify converted a tensor to float64")

    monkeypatch.setattr(SourceReader, "read_rows", spy)
    monkeypatch.setattr(torch.Tensor, "double", no_double)
    report = shardkit.verify(src, out)
    assert report.ok
    biggest = max(math.prod(s) for s in shardkit.open_checkpoint(src).full_shapes.values())
    assert biggest == 128 * 128
    assert 0 < largest["numel"] <= check.VERIFY_BLOCK_BYTES // 4 < biggest
    assert largest["reads"] > 2 * len(report.tensors)


def test_progress_reaches_the_bytes_of_a(shards):
    src, out = shards
    calls = []
    threads = torch.get_num_threads()
    shardkit.verify(out, src, progress=lambda done, total: calls.append((done, total)))
    assert torch.get_num_threads() == threads  # verify runs single-threaded, then restores torch's setting
    total = sum(math.prod(s) * 4 for s in shardkit.open_checkpoint(src).full_shapes.values())  # float32
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_progress_counts_tensors_missing_from_b(shards, tiny_model):
    src, _ = shards
    other = tiny_model("llama-mha")
    calls = []
    report = shardkit.verify(src, other, progress=lambda done, total: calls.append((done, total)))
    assert not report.ok
    assert calls[-1][0] == calls[-1][1] > 0
    assert any(t.max_abs_diff is None for t in report.tensors)


# ---- inspect --check-data --------------------------------------------------------------------------


def test_inspect_check_data_says_what_it_checked(shards, tmp_path):
    src, out = shards
    assert "checked" not in shardkit.inspect(out)
    calls = []
    report = shardkit.inspect(out, check_data=True, progress=lambda d, t: calls.append((d, t)))
    assert report["problems"] == []
    checked = report["checked"]
    assert checked["files_hashed"] == 8 and checked["hash_mismatches"] == 0
    assert checked["replica_groups"] > 0 and checked["replica_mismatches"] == 0
    assert calls and calls[-1][0] == calls[-1][1] >= report["bytes"] - 8 * 4096

    hf = shardkit.inspect(src, check_data=True)
    assert hf["checked"] == {"files_hashed": 0, "hash_mismatches": 0, "replica_groups": 0, "replica_mismatches": 0}

    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    f = broken / "model/dp_rank_00_tp_rank_03_pp_rank_01.pt"
    state = torch.load(f, weights_only=True)
    state["model.norm.weight"][3] = math.nan
    torch.save(state, f)
    report = shardkit.inspect(broken, check_data=True)
    assert report["checked"]["hash_mismatches"] == 1 and report["checked"]["replica_mismatches"] == 1
    assert any("copies of model.norm.weight" in p for p in report["problems"])


def test_replicas_holding_nan_in_the_same_place_agree(shards, tmp_path):
    _, out = shards
    nan = tmp_path / "nan"
    shutil.copytree(out, nan)
    for f in sorted((nan / "model").glob("*_pp_rank_01.pt")):
        state = torch.load(f, weights_only=True)
        state["model.norm.weight"][3] = math.nan
        torch.save(state, f)
    report = shardkit.inspect(nan, check_data=True)
    assert report["checked"]["replica_mismatches"] == 0
    assert report["checked"]["hash_mismatches"] == 4  # the files changed, the copies agree


def hostile(out: Path, dst: Path, files) -> Path:
    shutil.copytree(out, dst)
    manifest = json.loads((dst / "shardkit.json").read_text())
    manifest["files"] = files(manifest["files"])
    (dst / "shardkit.json").write_text(json.dumps(manifest))
    return dst


@pytest.mark.parametrize(
    "name,words",
    [
        ("../../etc/passwd", "climbs out"),
        ("/etc/passwd", "not a relative path"),
        ("model/../../x", "climbs out"),
    ],
)
def test_manifest_paths_outside_the_folder_are_problems_not_opens(shards, tmp_path, monkeypatch, name, words):
    _, out = shards
    root = hostile(out, tmp_path / "hostile", lambda files: files + [{"path": name, "size": 1, "sha256": "0" * 64}])
    hashed = []
    real = check.file_digests
    monkeypatch.setattr(check, "file_digests", lambda p, **kw: hashed.append(Path(p)) or real(p, **kw))
    report = shardkit.inspect(root, check_data=True)
    bad = [p for p in report["problems"] if name in p]
    assert len(bad) == 1 and words in bad[0] and "\n" not in bad[0]
    assert len(hashed) == 8 and all(root in p.parents for p in hashed)
    assert report["checked"]["files_hashed"] == 8 and report["checked"]["replica_groups"] > 0


def test_symlink_out_of_the_folder_is_refused(shards, tmp_path, monkeypatch):
    _, out = shards
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"secret")
    root = hostile(
        out, tmp_path / "hostile", lambda files: files + [{"path": "link.bin", "size": 6, "sha256": "0" * 64}]
    )
    (root / "link.bin").symlink_to(secret)
    report = shardkit.inspect(root, check_data=True)
    assert any("link.bin" in p and "outside" in p for p in report["problems"])


@pytest.mark.parametrize(
    "files",
    [
        "model.pt",
        {"path": "model"},
        [["model/x.pt", 1, "ab"]],
        [{"path": 3, "size": 1, "sha256": "ab"}],
        [{"path": "model/x.pt", "size": "1", "sha256": "ab"}],
        [{"path": "model/x.pt", "size": True, "sha256": "ab"}],
        [{"path": "model/x.pt", "size": 1}],
    ],
)
def test_malformed_manifest_files_are_problems_not_crashes(shards, tmp_path, files):
    _, out = shards
    root = hostile(out, tmp_path / "malformed", lambda _: files)
    report = shardkit.inspect(root, check_data=True)
    assert report["problems"] and all("\n" not in p for p in report["problems"])
    assert any("shardkit.json" in p for p in report["problems"])
    assert report["checked"]["files_hashed"] == 0
