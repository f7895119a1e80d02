"""Manifest checksums match what is on disk in every format, and a merge of a truncated file (torch,
safetensors, xser) fails cleanly, leaving nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xxhash
from format_helpers import (
    MODEL,
    _Ref,
    convert_to,
    copy_tree,
    files_under,
    load_refs,
    no_output_left,
    rank_files,
)

from shardkit import FormatError, merge

# ---- 5. manifest checksums ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["torch", "xser", "safetensors"])
def test_manifest_sizes_and_digests_match_disk(fmt, tiny_model, tmp_path):
    out = convert_to(tiny_model(MODEL), tmp_path / fmt, fmt)
    manifest = json.loads((out / "shardkit.json").read_text())
    assert manifest["format"] == fmt
    listed = [entry["path"] for entry in manifest["files"]]
    assert len(listed) == len(set(listed)), "a file is listed twice"
    for entry in manifest["files"]:
        path = out / entry["path"]
        assert path.is_file(), f"{entry['path']} is listed but missing"
        data = path.read_bytes()
        assert entry["size"] == len(data), entry["path"]
        assert "sha256" not in entry, "sha256 is recorded only with --sha256"
        assert entry["xxh3_128"] == xxhash.xxh3_128_hexdigest(data), entry["path"]
    model_files = {f"model/{p}" for p in files_under(out / "model")}
    assert model_files <= set(listed), f"not in the manifest: {sorted(model_files - set(listed))[:5]}"
    assert {p for p in listed if p.startswith("model/")} == model_files


# ---- 6. truncated files ------------------------------------------------------------------------


def truncate(path: Path, how: str) -> None:
    size = path.stat().st_size
    keep = size // 2 if how == "half" else size - 1
    with open(path, "r+b") as fh:
        fh.truncate(keep)


@pytest.mark.parametrize("how", ["half", "last-byte"])
@pytest.mark.parametrize("kind", ["torch", "safetensors", "xser-tensor", "xser-tensor-noinfo"])
def test_merge_of_truncated_file_fails_cleanly(kind, how, tiny_model, torch_shards, hand_xser, tmp_path):
    if kind == "torch":
        root = copy_tree(torch_shards, tmp_path / "src")
        bad = rank_files(root)[-1]
    elif kind == "safetensors":
        root = convert_to(tiny_model(MODEL), tmp_path / "src", "safetensors")
        bad = rank_files(root)[-1]
    else:
        root = copy_tree(hand_xser, tmp_path / "src")
        # rank file 2 has an .info.pt (shapes come from it, data is read while writing); rank file 3
        # has none (shapes are read from the tensor files while checking)
        main = rank_files(root)[2 if kind == "xser-tensor" else 3]
        assert Path(str(main) + ".info.pt").is_file() == (kind == "xser-tensor")
        # a tensor merge must read (tp-split, not a replicated norm that another rank also holds)
        tid = next(r.tid for k, r in load_refs(main).items() if isinstance(r, _Ref) and "norm" not in k)
        bad = Path(str(main) + ".tensors") / f"tensor_{tid}.pt"
    truncate(bad, how)
    dst = tmp_path / "merged"
    with pytest.raises(FormatError) as excinfo:
        merge(root, dst)
    message = str(excinfo.value)
    assert "\n" not in message, message
    assert bad.name in message, message
    if kind.startswith("xser"):
        assert bad.parent.name in message, message
    no_output_left(dst)
