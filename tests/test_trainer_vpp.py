"""Interleaved (virtual) pipeline stages: shardkit's layout algebra for vpp and the trainer's
--vpp / --pp-schedule (issue 13, item 2).

1. layout algebra: which layers each (pp rank, chunk) holds (NxD's rule: pp x vpp chunks of
   consecutive layers, the remainder to the last chunks, chunk c on pp rank c % pp); convert with
   --pp 2 --vpp 2 then merge gives the Hugging Face model back exactly; the rank files hold their
   chunks' layers under the global names; reshard vpp2 -> vpp1 equals a direct convert, file for
   file; NxD shards without a manifest have their vpp read from the layers they hold;
2. the trainer: pp2 vpp2 equals pp1 (losses and final weights to 1e-5) with the interleaved
   schedule, and so does every other schedule torch provides; a vpp checkpoint holds the expected
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
