"""Layout inference for NxD shards without a shardkit.json manifest, across families; the
layout rules that depend on the family (vocabulary split); config paths in plan errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardkit import FormatError, Layout, convert, merge, open_checkpoint


def _full(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _nxd_style(tiny_model, tmp_path: Path, model: str, layout: Layout, fmt: str = "torch") -> tuple[Path, Path]:
    """The tiny model and its shards under `layout` with the manifest removed (as NxD writes them)."""
    src = tiny_model(model)
    dst = tmp_path / "shards"
    convert(src, dst, layout, format=fmt)
    (dst / "shardkit.json").unlink()
    return src, dst


def _assert_merges_exactly(src: Path, shards: Path, out: Path) -> None:
    merge(shards, out)
    want, got = _full(src), _full(out)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), f"{name} differs"


# ---- 1. kv replication decided from the family's own k source --------------------------------

@pytest.mark.parametrize("model", ["phi3-tiny", "dbrx-tiny"])
def test_blocked_replication_of_fused_qkv_families_is_inferred(tiny_model, tmp_path, model):
    layout = Layout(tp=4, pp=1, kv_multiplier=2, kv_replication="blocked")
    src, shards = _nxd_style(tiny_model, tmp_path, model, layout)
    _assert_merges_exactly(src, shards, tmp_path / "merged")
    assert open_checkpoint(shards).layout == layout


@pytest.mark.parametrize("model", ["phi3-tiny", "dbrx-tiny"])
@pytest.mark.parametrize("qkv", ["fused", "gqa"])
def test_interleaved_replication_of_fused_qkv_families_is_inferred(tiny_model, tmp_path, model, qkv):
    layout = Layout(tp=4, pp=1, kv_multiplier=2, kv_replication="interleaved", qkv=qkv)
    src, shards = _nxd_style(tiny_model, tmp_path, model, layout)
    _assert_merges_exactly(src, shards, tmp_path / "merged")
    assert open_checkpoint(shards).layout == layout


def test_blocked_replication_of_llama_coalesced_is_inferred(tiny_model, tmp_path):
    layout = Layout(tp=2, pp=1, kv_multiplier=2, kv_replication="blocked", qkv="coalesced")
    src, shards = _nxd_style(tiny_model, tmp_path, "llama-3.2-tiny", layout)
    assert open_checkpoint(shards).layout == layout
    _assert_merges_exactly(src, shards, tmp_path / "merged")
