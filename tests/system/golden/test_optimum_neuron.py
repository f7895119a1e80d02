"""optimum-neuron's training checkpoints, both ways, against optimum-neuron's own code.

The oracle is optimum-neuron 0.4.5's own modules, run in a separate process without shardkit
(tests/support/optimum_neuron_ref.py: its source from the published wheel, NxD's rank/size and
`create_local_weight` stood in for): `save` shards a Hugging Face Llama for every rank with its
`adapt_state_dict` (what its `from_pretrained` does) and writes its `create_parameter_metadata`;
`consolidate` is its `consolidate_model_parallel_checkpoints_to_unified_checkpoint`. optimum-neuron's
`save_pretrained` itself needs NxD's `save_checkpoint` and torch-xla, which do not run here: the
files `save` writes are torch.save state dicts as NxD writes without xser.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from optimum_helpers import invoke, ref, same_tensors
from safetensors.torch import load_file

from shardkit.cli import cli

# case -> (model config, shardkit's layout options, optimum-neuron's tp, pp, fuse_qkv, kv_size_multiplier)
CASES = {
    "tp4pp2-gqa": ("llama-3.1-tiny", ["--tp", "4", "--pp", "2", "--qkv", "gqa", "--kv-multiplier", "2"], (4, 2, 0, 0)),
    "tp4-fused-kv4": ("llama-3.1-tiny", ["--tp", "4", "--qkv", "fused", "--kv-multiplier", "4"], (4, 1, 1, 4)),
    "tp8pp3-gqa": ("llama-3.1-tiny", ["--tp", "8", "--pp", "3", "--qkv", "gqa", "--kv-multiplier", "4"], (8, 3, 0, 0)),
    "tp2pp3-separate": ("llama-3.1-tiny", ["--tp", "2", "--pp", "3"], (2, 3, 0, 0)),
    "tp2-coalesced": ("llama-mha", ["--tp", "2", "--qkv", "coalesced"], (2, 1, 1, 0)),
    "tp1": ("llama-3.1-tiny", [], (1, 1, 0, 0)),
}


def optimum_saved(hf: Path, out: Path, case: str) -> Path:
    tp, pp, fuse, mult = CASES[case][2]
    ref("save", hf, out, tp, pp, fuse, mult)
    return out


def rank_files(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: torch.load(p, weights_only=True) for p in sorted((folder / "shards/model").glob("*.pt"))}


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimum_consolidates_shardkits_checkpoint_to_the_original(case, tiny_model, tmp_path):
    """shardkit's convert --format optimum-neuron: optimum-neuron's consolidation gives every
    Hugging Face tensor exactly; each stage's metadata is byte for byte what optimum-neuron's
    create_parameter_metadata writes, and each rank file holds the tensors its own sharding makes."""
    config, options, _ = CASES[case]
    hf = tiny_model(config, torch.bfloat16)
    ours = tmp_path / "ours"
    invoke("convert", hf, ours, "--format", "optimum-neuron", *options)
    ref("consolidate", ours, tmp_path / "consolidated")
    same_tensors(load_file(str(tmp_path / "consolidated/model.safetensors")), load_file(str(hf / "model.safetensors")))
    theirs = optimum_saved(hf, tmp_path / "theirs", case)
    metadata = sorted(p.name for p in (theirs / "shards").glob("mp_metadata_pp_rank_*.json"))
    assert metadata == sorted(p.name for p in (ours / "shards").glob("mp_metadata_pp_rank_*.json"))
    for name in metadata:
        assert (ours / "shards" / name).read_bytes() == (theirs / "shards" / name).read_bytes(), name
    mine, want = rank_files(ours), rank_files(theirs)
    assert set(mine) == set(want)
    for name in want:
        same_tensors(mine[name], want[name])
    assert (ours / "shards/done").is_file() and json.loads((ours / "trn_config.json").read_text())[
        "tensor_parallel_size"
    ]


@pytest.mark.parametrize("case", ["tp4pp2-gqa", "tp4-fused-kv4", "tp2-coalesced"])
def test_shardkit_reads_optimums_checkpoint_to_the_original(case, tiny_model, tmp_path):
    """A checkpoint sharded by optimum-neuron's own code: merge gives the Hugging Face tensors
    exactly; inspect tells its layout from the metadata (the saved folder or its shards/)."""
    config, options, (tp, pp, _, _) = CASES[case]
    hf = tiny_model(config, torch.bfloat16)
    theirs = optimum_saved(hf, tmp_path / "theirs", case)
    invoke("merge", theirs, tmp_path / "merged")
    same_tensors(load_file(str(tmp_path / "merged/model.safetensors")), load_file(str(hf / "model.safetensors")))
    for folder in (theirs, theirs / "shards"):
        info = json.loads(invoke("inspect", folder, "--json", "--check-data"))
        assert (info["format"], info["layout"]["tp"], info["layout"]["pp"]) == ("optimum-neuron", tp, pp)
        assert info["layout"]["qkv"] == options[options.index("--qkv") + 1]
        assert info["layout_from"] == "optimum-neuron's mp_metadata" and not info["problems"]
    assert "optimum-neuron format" in invoke("inspect", theirs)
    from shardkit.hub.card import model_card

    card = model_card(tmp_path / "merged", "org/tiny", origin=theirs)
    assert f"tp {tp}, pp {pp}" in card and "(optimum-neuron shards, llama family)" in card


def test_reshard_optimums_checkpoint_to_another_layout_and_back(tiny_model, tmp_path):
    """optimum-neuron's tp4 pp2 (GQA layer) -> shardkit reshard -> tp2 pp3 (separate q/k/v), which
    optimum-neuron consolidates to the original, and NxD shards; back to tp4 pp2: the tensors of
    optimum-neuron's own files."""
    hf = tiny_model("llama-3.1-tiny", torch.bfloat16)
    theirs = optimum_saved(hf, tmp_path / "theirs", "tp4pp2-gqa")
    there = tmp_path / "tp2pp3"
    invoke(
        "reshard",
        theirs,
        there,
        "--format",
        "optimum-neuron",
        "--tp",
        "2",
        "--pp",
        "3",
        "--qkv",
        "separate",
        "--kv-multiplier",
        "1",
    )
    ref("consolidate", there, tmp_path / "consolidated")
    same_tensors(load_file(str(tmp_path / "consolidated/model.safetensors")), load_file(str(hf / "model.safetensors")))
    invoke("reshard", there, tmp_path / "nxd", "--format", "torch", "--tp", "4", "--qkv", "gqa", "--kv-multiplier", "2")
    invoke(
        "reshard",
        tmp_path / "nxd",
        tmp_path / "back",
        "--format",
        "optimum-neuron",
        "--tp",
        "4",
        "--pp",
        "2",
        "--kv-multiplier",
        "2",
    )
    mine, want = rank_files(tmp_path / "back"), rank_files(theirs)
    assert set(mine) == set(want)
    for name in want:
        same_tensors(mine[name], want[name])


def _one_line_refusal(args: list, out: Path, *words: str) -> None:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert all(w in result.output for w in words), result.output
    assert not out.exists()


def test_layouts_optimum_does_not_build_are_refused(tiny_model, tmp_path):
    """optimum-neuron chooses its qkv layer from tp and the head counts: a layout it would not
    build is one line naming the flags to use; so are other families and ep."""
    hf = tiny_model("llama-3.1-tiny")
    out = tmp_path / "out"
    _one_line_refusal(
        ["convert", hf, out, "--format", "optimum-neuron", "--tp", "4", "--qkv", "separate", "--kv-multiplier", "2"],
        out,
        "--qkv gqa",
    )
    _one_line_refusal(
        ["convert", hf, out, "--format", "optimum-neuron", "--tp", "2", "--qkv", "gqa"], out, "--qkv separate"
    )
    _one_line_refusal(
        [
            "convert",
            hf,
            out,
            "--format",
            "optimum-neuron",
            "--tp",
            "4",
            "--qkv",
            "gqa",
            "--kv-multiplier",
            "2",
            "--kv-replication",
            "blocked",
        ],
        out,
        "interleaved",
    )
    _one_line_refusal(["convert", tiny_model("qwen2-tiny"), out, "--format", "optimum-neuron"], out, "Llama")


@pytest.mark.parametrize("damage", ["metadata", "missing-rank"])
def test_a_checkpoint_unlike_optimums_is_refused(damage, tiny_model, tmp_path):
    """Metadata that is not what optimum-neuron writes for the layout (a partition dim changed),
    or a missing rank file: one line, exit 2, nothing written."""
    hf = tiny_model("llama-3.1-tiny")
    src = tmp_path / "src"
    invoke(
        "convert",
        hf,
        src,
        "--format",
        "optimum-neuron",
        "--tp",
        "4",
        "--pp",
        "2",
        "--qkv",
        "gqa",
        "--kv-multiplier",
        "2",
    )
    if damage == "metadata":
        path = src / "shards/mp_metadata_pp_rank_1.json"
        meta = json.loads(path.read_text())
        meta["parameters"]["model.layers.2.mlp.down_proj.weight"]["partition_dim"] = 0
        path.write_text(json.dumps(meta))
        words = ("down_proj", "partition_dim")
    else:
        (src / "shards/model/dp_rank_00_tp_rank_03_pp_rank_01.pt").unlink()
        words = ("dp_rank_00_tp_rank_03_pp_rank_01.pt",)
    _one_line_refusal(["merge", src, tmp_path / "merged"], tmp_path / "merged", *words)
