"""convert then merge is bit-exact, over layouts, qkv styles, kv replication, formats and dtypes.

Every case builds shards from a tiny seeded Hugging Face model, checks the shards are what was
asked for (rank files, format, dtype, layout), merges them back and compares the merged
safetensors with the source tensor for tensor (same keys, dtype, shape, torch.equal).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from meaning_helpers import _input_ids, _logits
from safetensors import safe_open
from safetensors.torch import load_file

from shardkit import Layout, convert, merge, open_checkpoint
from shardkit.checkpoint import Rank

QKV_STYLES = ("separate", "gqa", "fused", "coalesced")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---- helpers ---------------------------------------------------------------------------------------


def load_hf(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory (single model.safetensors or split with an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        out: dict[str, torch.Tensor] = {}
        for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(folder / name))
        return out
    return load_file(folder / "model.safetensors")


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str = "") -> None:
    assert set(got) == set(want), (
        f"{where}: key sets differ; missing {sorted(set(want) - set(got))[:5]}, extra {sorted(set(got) - set(want))[:5]}"
    )
    for name in want:
        g, w = got[name], want[name]
        assert g.dtype == w.dtype, f"{where}: {name} dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{where}: {name} shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(g, w), f"{where}: {name} values differ"


SUFFIX = {"torch": ".pt", "xser": ".pt", "safetensors": ".safetensors"}


def check_shards(shards: Path, layout: Layout, fmt: str, dtype: torch.dtype) -> None:
    """The shard directory holds one file per rank, in `fmt`, of `dtype`, described as `layout`."""
    model = shards / "model"
    names = {p.name for p in model.iterdir() if p.is_file() and not p.name.endswith(".info.pt")}
    want = {
        f"dp_rank_00_tp_rank_{t:02d}_pp_rank_{p:02d}{SUFFIX[fmt]}" for t in range(layout.tp) for p in range(layout.pp)
    }
    assert names == want, f"rank files differ: {sorted(names ^ want)[:6]}"
    tensor_dirs = [p for p in model.iterdir() if p.is_dir() and p.name.endswith(".tensors")]
    assert len(tensor_dirs) == (len(want) if fmt == "xser" else 0)
    ckpt = open_checkpoint(shards)
    assert ckpt.format == fmt
    assert ckpt.layout == layout
    assert ckpt.dtype() == dtype
    first = model / f"dp_rank_00_tp_rank_00_pp_rank_00{SUFFIX[fmt]}"
    if fmt == "torch":
        sd = torch.load(first, map_location="cpu", weights_only=True)
        assert all(t.dtype == dtype for t in sd.values())
    elif fmt == "safetensors":
        with safe_open(str(first), framework="pt") as f:
            assert all(f.get_tensor(k).dtype == dtype for k in f.keys())


def roundtrip(
    src: Path, tmp_path: Path, layout: Layout, fmt: str = "torch", dtype: torch.dtype | None = None, infer: bool = False
) -> Path:
    """convert src to `layout`, check the shards, merge back; returns the merged directory.

    With `infer`, shardkit's manifest is removed first, so the merge sees plain NxD rank files and
    must infer the layout (qkv style, kv multiplier and replication) from names, shapes and data."""
    shards = tmp_path / "shards"
    convert(src, shards, layout, format=fmt)
    check_shards(shards, layout, fmt, dtype or next(iter(load_hf(src).values())).dtype)
    out = tmp_path / "merged"
    merge(shards, out)
    if infer:
        (shards / "shardkit.json").unlink()
        ckpt = open_checkpoint(shards)
        if layout.kv_multiplier == 1:  # replication is meaningless (and not inferable) without replicas
            ckpt_layout = Layout(**{**ckpt.layout.to_dict(), "kv_replication": layout.kv_replication})
        else:
            ckpt_layout = ckpt.layout
        assert ckpt_layout == layout, f"inferred {ckpt.layout.describe()}, wrote {layout.describe()}"
        inferred = tmp_path / "merged-inferred"
        merge(shards, inferred)
        assert_same_tensors(load_hf(inferred), load_hf(src), f"{layout.describe()} (inferred)")
    return out


# ---- the GQA matrix at tp 32, pp 4, kv multiplier 4 ----------------------------------------------


@pytest.mark.parametrize("replication", ["interleaved", "blocked"])
@pytest.mark.parametrize("qkv", QKV_STYLES)
def test_gqa64_tp32_pp4_kvmult4(tiny_model, tmp_path, qkv, replication):
    src = tiny_model("llama-gqa64")
    layout = Layout(tp=32, pp=4, kv_multiplier=4, kv_replication=replication, qkv=qkv)
    out = roundtrip(src, tmp_path, layout, infer=True)
    assert_same_tensors(load_hf(out), load_hf(src), layout.describe())


# ---- smaller layouts x shard formats x dtypes ------------------------------------------------------

SMALL_LAYOUTS = {
    "tp8-pp2-m1-gqa": Layout(tp=8, pp=2, kv_multiplier=1, qkv="gqa"),
    "tp16-pp5-m2-fused-blocked": Layout(tp=16, pp=5, kv_multiplier=2, kv_replication="blocked", qkv="fused"),
    "tp1-pp1": Layout(tp=1, pp=1),
}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("fmt", ["torch", "xser", "safetensors"])
@pytest.mark.parametrize("layout_id", list(SMALL_LAYOUTS))
def test_gqa64_layouts_formats_dtypes(tiny_model, tmp_path, layout_id, fmt, dtype):
    src = tiny_model("llama-gqa64", dtype=DTYPES[dtype])
    layout = SMALL_LAYOUTS[layout_id]
    out = roundtrip(src, tmp_path, layout, fmt)
    merged = load_hf(out)
    assert all(t.dtype == DTYPES[dtype] for t in merged.values())
    assert_same_tensors(merged, load_hf(src), f"{layout_id} {fmt} {dtype}")


# ---- other model shapes ----------------------------------------------------------------------------


@pytest.mark.parametrize("tp,pp", [(4, 3), (8, 1)])
@pytest.mark.parametrize("qkv", ["coalesced", "separate"])
def test_mha(tiny_model, tmp_path, qkv, tp, pp):
    src = tiny_model("llama-mha")
    layout = Layout(tp=tp, pp=pp, qkv=qkv)
    out = roundtrip(src, tmp_path, layout, infer=True)
    assert_same_tensors(load_hf(out), load_hf(src), layout.describe())


@pytest.mark.parametrize("tp,m", [(2, 1), (4, 2)])
@pytest.mark.parametrize("qkv", QKV_STYLES)
def test_bias(tiny_model, tmp_path, qkv, tp, m):
    """attention_bias and mlp_bias: q/k/v biases follow the heads, gate/up biases the fused split."""
    src = tiny_model("llama-bias")
    source = load_hf(src)
    assert any(k.endswith("self_attn.q_proj.bias") for k in source) and any(
        k.endswith("mlp.up_proj.bias") for k in source
    )
    layout = Layout(tp=tp, pp=2, kv_multiplier=m, qkv=qkv)
    out = roundtrip(src, tmp_path, layout, infer=True)
    assert_same_tensors(load_hf(out), source, layout.describe())


def test_kv8_tied_tp4_gqa(tiny_model, tmp_path):
    """8 kv heads > tp 4, tied embeddings: no lm_head in the merged dir, transformers loads it."""
    src = tiny_model("llama-kv8-tied")
    source = load_hf(src)
    assert "lm_head.weight" not in source
    layout = Layout(tp=4, pp=2, qkv="gqa")
    out = roundtrip(src, tmp_path, layout, infer=True)
    merged = load_hf(out)
    assert "lm_head.weight" not in merged
    assert_same_tensors(merged, source, layout.describe())
    # the shards do carry lm_head (NxD needs it on the last stage): the embedding's vocab slices
    last = torch.load(tmp_path / "shards" / "model" / "dp_rank_00_tp_rank_01_pp_rank_01.pt", weights_only=True)
    emb = source["model.embed_tokens.weight"]
    rows = emb.shape[0] // 4
    assert torch.equal(last["lm_head.weight"], emb[rows : 2 * rows])

    ids = _input_ids(json.loads((src / "config.json").read_text())["vocab_size"])
    assert torch.equal(_logits(out, ids), _logits(src, ids))


def test_dtype_cast_roundtrip(tiny_model, tmp_path):
    """fp32 source, --dtype bf16: shards and merged model are exactly source.to(bf16)."""
    src = tiny_model("llama-gqa64")
    source = load_hf(src)
    assert all(t.dtype == torch.float32 for t in source.values())
    layout = Layout(tp=8, pp=2, qkv="fused")
    shards = tmp_path / "shards"
    convert(src, shards, layout, format="torch", dtype="bf16")
    check_shards(shards, layout, "torch", torch.bfloat16)
    out = tmp_path / "merged"
    merge(shards, out)
    assert_same_tensors(load_hf(out), {k: v.to(torch.bfloat16) for k, v in source.items()}, "bf16 cast")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_merge_streams_row_parallel_weights_in_blocks_of_rows(tiny_model, tmp_path, monkeypatch):
    """A weight the shards split along dim 1 (o_proj, down_proj) is merged in blocks of rows read
    from every tp piece, never assembled whole (a merged 7B MLP weight would be 86 MiB of fresh
    memory); the merged bytes are the source's, with uneven last blocks too."""
    from shardkit.formats import reader

    src = tiny_model("llama-gqa64")  # fp32, hidden 128, intermediate 64: o_proj rows 512 B, down_proj 256 B
    shards = tmp_path / "shards"
    convert(src, shards, Layout(tp=8, pp=2, qkv="gqa"))
    monkeypatch.setattr(reader, "COLUMN_BLOCK_BYTES", 1500)  # 2 rows of o_proj, 5 of down_proj (25 + a last of 3)
    blocks: dict[str, list[tuple[int, ...]]] = {}
    stream = reader.SourceReader._column_blocks

    def recorded(self, piece, reads):
        for block in stream(self, piece, reads):
            blocks.setdefault(piece.name, []).append(tuple(block.shape))
            yield block

    monkeypatch.setattr(reader.SourceReader, "_column_blocks", recorded)
    out = tmp_path / "merged"
    merge(shards, out)
    assert_same_tensors(load_hf(out), load_hf(src), "merged in row blocks")
    row_parallel = {k for k in load_hf(src) if k.endswith(("o_proj.weight", "down_proj.weight"))}
    assert set(blocks) == row_parallel
    for name, shapes in blocks.items():
        rows = 2 if "o_proj" in name else 5
        assert [s[0] for s in shapes] == [rows] * (128 // rows) + ([128 % rows] if 128 % rows else []), name
        assert max(s[0] * s[1] * 4 for s in shapes) <= 1500


def test_merge_split_by_max_shard_size(tiny_model, tmp_path):
    """A small max_shard_size gives several files and an index transformers loads."""
    src = tiny_model("llama-gqa64")
    source = load_hf(src)
    shards = tmp_path / "shards"
    convert(src, shards, Layout(tp=8, pp=2, qkv="gqa"))
    out = tmp_path / "merged"
    merge(shards, out, max_shard_size="20KB")

    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(source)
    files = sorted(set(weight_map.values()))
    assert len(files) > 1
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    total = 0
    for name in files:
        tensors = load_file(out / name)
        assert set(tensors) == {k for k, f in weight_map.items() if f == name}, (
            f"{name} holds other tensors than the index says"
        )
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        with safe_open(str(out / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert index["metadata"]["total_size"] == total
    assert_same_tensors(load_hf(out), source, "split merge")

    ids = _input_ids(json.loads((src / "config.json").read_text())["vocab_size"])
    assert torch.equal(_logits(out, ids), _logits(src, ids))


# ---- training checkpoints: ckpt reshard there and back ------------------------------------------


@pytest.mark.parametrize("fmt", ["torch", "xser"])
def test_ckpt_reshard_there_and_back_gives_back_the_saved_files(tmp_path, fmt):
    """A tag written by save_checkpoint (the trainer's writer, whose torch files name their zip
    records' folder `archive/`, as torch.save into a stream does; NxD's name it after the file),
    resharded to tp 1 pp 2 and back to tp 2: every file but shardkit.json byte for byte. The
    records' folder follows the source's way at every step."""
    import zipfile

    import ckpt_child

    from shardkit.checkpoint import finalize_checkpoint, save_checkpoint
    from shardkit.checkpoint.reshard import reshard_training
    from shardkit.testing import fixture_config

    config = fixture_config("llama-mha")
    tp2 = Layout(tp=2)
    state = ckpt_child.full_state(config, 3)
    ranks = [Rank(tp=0), Rank(tp=1)]
    model = {(r.tp, r.pp): ckpt_child.rank_pieces(config, tp2, r, state["weight"]) for r in ranks}
    optim = {(r.tp, r.pp): ckpt_child.rank_optimizer(config, tp2, r, state, 3) for r in ranks}
    save_checkpoint(
        tmp_path / "a", "step_3", model, optim, {"last_epoch": 3}, {"step": 3}, layout=tp2, config=config, format=fmt
    )
    finalize_checkpoint()
    there = reshard_training(tmp_path / "a", tmp_path / "b", Layout(pp=2))
    back = reshard_training(there.parent, tmp_path / "c", tp2)
    first = there / "model" / "dp_rank_00_tp_rank_00_pp_rank_01.pt"
    assert zipfile.ZipFile(first).namelist()[0] == "archive/data.pkl"
    orig = tmp_path / "a" / "step_3"
    files = sorted(f for f in orig.rglob("*") if f.is_file() and f.name != "shardkit.json")
    assert len(files) >= (40 if fmt == "xser" else 8)
    differ = [
        f.relative_to(orig).as_posix() for f in files if (back / f.relative_to(orig)).read_bytes() != f.read_bytes()
    ]
    assert not differ, differ
