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


# ---- 2. families with their own layer prefix and qkv names ---------------------------------


@pytest.mark.parametrize(
    "model, layout",
    [
        ("gpt-neox-tiny", Layout(tp=2, pp=1)),
        ("gpt-neox-tiny", Layout(tp=4, pp=3)),
        ("bert-tiny", Layout(tp=2, pp=1)),
        ("bert-tiny", Layout(tp=4, pp=2)),
    ],
)
def test_gpt_neox_and_bert_shards_without_manifest_open_and_merge(tiny_model, tmp_path, model, layout):
    src, shards = _nxd_style(tiny_model, tmp_path, model, layout)
    assert open_checkpoint(shards).layout == layout
    _assert_merges_exactly(src, shards, tmp_path / "merged")


def test_gpt_neox_shards_cut_for_another_tp_are_refused(tiny_model, tmp_path):
    _, shards = _nxd_style(tiny_model, tmp_path, "gpt-neox-tiny", Layout(tp=2))
    for f in (shards / "model").glob("*tp_rank_01*"):
        f.unlink()
    with pytest.raises(FormatError, match="cut for tp 2 but 1 tp rank files"):
        open_checkpoint(shards)


def _empty_weights(shards: Path) -> None:
    """Every tensor of every rank file replaced by a 0-element one (NxD's
    avoid_saving_lower_precision_weights keeps the master weights in the optimizer files only)."""
    for f in (shards / "model").glob("*.pt"):
        state = torch.load(f, weights_only=True)
        torch.save({k: torch.empty(0, dtype=v.dtype) for k, v in state.items()}, f)


@pytest.mark.parametrize("model", ["llama-3.2-tiny", "phi3-tiny"])
def test_rank_files_without_data_say_to_pass_the_layout(tiny_model, tmp_path, model):
    _, shards = _nxd_style(tiny_model, tmp_path, model, Layout(tp=2, kv_multiplier=2 if model == "phi3-tiny" else 1))
    _empty_weights(shards)
    with pytest.raises(FormatError, match="holds no data.*shardkit.json") as excinfo:
        open_checkpoint(shards)
    assert "\n" not in str(excinfo.value)
    layout = open_checkpoint(
        shards, hints={"qkv": "separate", "kv_multiplier": 1, "kv_replication": "interleaved"}
    ).layout
    assert (layout.tp, layout.kv_multiplier, layout.qkv) == (2, 1, "separate")


# ---- 3. the vocabulary rule belongs to families that split the vocabulary ----------------------


def test_bert_large_plans_at_tp_8_its_vocabulary_is_replicated():
    from shardkit.memory import plan_memory, suggest_layouts
    from shardkit.testing import FIXTURES

    config = FIXTURES / "bert-large-uncased.json"  # vocab 30522: not a multiple of 4 or 8
    for tp in (4, 8):
        report = plan_memory(config, Layout(tp=tp))
        assert report.layout.tp == tp and report.peak.params > 0
    found = suggest_layouts(config, "16GiB", tp=8)
    assert found.layouts and all(r.layout.tp == 8 for r in found.layouts)


def test_split_vocabulary_must_still_divide_by_tp():
    from shardkit.errors import LayoutError
    from shardkit.memory import plan_memory, suggest_layouts
    from shardkit.testing import fixture_config

    config = {**fixture_config("llama-2-7b"), "vocab_size": 32001}
    with pytest.raises(LayoutError, match="vocab size 32001 is not divisible by tp 8: pad the vocabulary"):
        plan_memory(config, Layout(tp=8))
    with pytest.raises(LayoutError, match="vocab size 32001 is not divisible by tp 8"):
        suggest_layouts(config, "16GiB", tp=8)
    found = suggest_layouts(config, "80GiB")
    assert {r.layout.tp for r in found.layouts} == {1}
    assert any("vocab size 32001" in i["reason"] for i in found.impossible)


def test_bert_converts_at_a_tp_that_does_not_divide_its_vocabulary(tiny_model, tmp_path):
    from shardkit.testing import fixture_config, make_tiny_model

    src = make_tiny_model({**fixture_config("bert-tiny"), "vocab_size": 63}, tmp_path / "hf")
    convert(src, tmp_path / "shards", Layout(tp=2))
    _assert_merges_exactly(src, tmp_path / "shards", tmp_path / "merged")


def test_llama_converts_refuses_a_tp_that_does_not_divide_its_vocabulary(tmp_path):
    from shardkit.errors import LayoutError
    from shardkit.testing import fixture_config, make_tiny_model

    src = make_tiny_model({**fixture_config("llama-3.2-tiny"), "vocab_size": 95}, tmp_path / "hf")
    with pytest.raises(LayoutError, match="vocab size 95 is not divisible by tp 2"):
        convert(src, tmp_path / "shards", Layout(tp=2))
    assert not (tmp_path / "shards").exists()


# ---- 4. plan errors name the config file ---------------------------------------------------------


def test_plan_errors_name_the_config_file(tmp_path):
    from shardkit.errors import ConfigMismatchError
    from shardkit.memory import plan_memory
    from shardkit.testing import fixture_config

    config = {**fixture_config("llama-2-7b")}
    del config["intermediate_size"]
    path = tmp_path / "my-model.json"
    path.write_text(__import__("json").dumps(config))
    with pytest.raises(ConfigMismatchError, match=f"^{path} has no 'intermediate_size'"):
        plan_memory(path, Layout())
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "config.json").write_text(path.read_text())
    with pytest.raises(ConfigMismatchError, match=f"^{tmp_path / 'dir' / 'config.json'} has no"):
        plan_memory(tmp_path / "dir", Layout())


# ---- 5. scheduler.pt / user_content.pt: torch_save's sink (bytes unchanged, full disk is NoSpaceError) --

SCHEDULER_STATE = {"last_epoch": 3, "_last_lr": [0.001, 0.0005], "base_lrs": [0.001], "buffer": torch.arange(300.0)}


def test_save_object_hashed_writes_the_bytes_torch_save_writes(tmp_path):
    import zipfile

    from shardkit.checkpoint.save import save_object_hashed
    from shardkit.io.data.hashing import HashingFile

    for name, obj in (("scheduler.pt", SCHEDULER_STATE), ("user_content.pt", {"step": 3, "note": "x" * 100})):
        before = HashingFile(tmp_path / "before" / name, tmp_path / "before")  # what save_object_hashed wrote before
        torch.save(obj, before)  # type: ignore[arg-type]
        want = before.close()
        got = save_object_hashed(tmp_path / "after", name, obj, fsync=False)
        assert (tmp_path / "after" / name).read_bytes() == (tmp_path / "before" / name).read_bytes()
        assert (got.path, got.size, got.sha256) == (name, want.size, want.sha256)
        with zipfile.ZipFile(tmp_path / "after" / name) as archive:  # torch.save's name for a file object
            assert archive.namelist()[0] == "archive/data.pkl"


def test_save_object_hashed_on_a_full_disk_is_no_space_error(tmp_path, monkeypatch):
    import builtins
    import errno

    import shardkit.io.data.hashing as hashing
    from shardkit.checkpoint.save import save_object_hashed
    from shardkit.paths import NoSpaceError

    class FullDisk:
        """A file whose writes fail with ENOSPC after the first 100 bytes."""

        def __init__(self, fh):
            self.fh, self.written = fh, 0

        def write(self, data):
            if self.written + len(data) > 100:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return self.fh.write(data)

        def __getattr__(self, name):
            return getattr(self.fh, name)

    monkeypatch.setattr(hashing, "open", lambda path, mode: FullDisk(builtins.open(path, mode)), raising=False)
    with pytest.raises(NoSpaceError) as excinfo:
        save_object_hashed(tmp_path, "scheduler.pt", SCHEDULER_STATE, fsync=False)
    message = str(excinfo.value)
    assert "\n" not in message and "enforce fail" not in message
    assert not (tmp_path / "scheduler.pt").exists()
