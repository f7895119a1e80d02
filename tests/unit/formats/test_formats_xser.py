"""xser as torch-xla writes and reads it: shardkit's xser output loads with (a fake of) torch-xla's
public loader, is the reference form, and matches real torch-xla output; shardkit reads xser with
inline and referenced tensors, also real torch-xla output."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import pytest
import torch
import xxhash
from conftest import golden_or_skip
from format_helpers import (
    GOLDEN_XSER_CASE,
    MODEL,
    REFERENCE_GLOBAL,
    _Ref,
    assert_same_tensor,
    convert_to,
    fake_xla_load,
    files_under,
    load_plain,
    load_refs,
    pickle_globals,
    rank_files,
)
from safetensors.torch import load_file

from shardkit import Layout, merge, open_checkpoint
from shardkit.formats.base import TensorSpec
from shardkit.formats.xser import XserFile
from shardkit.formats.xser import load as shardkit_xser_load

# ---- 1. xser written by shardkit is what torch-xla writes and reads ------------------------------


def test_xser_output_loads_with_torch_xla_loader(tiny_model, torch_shards, fake_xla, tmp_path):
    """torch-xla's xser.load (faked, full pickle) gives, for every rank file, a dict with the
    torch-format file's keys in the same order and equal tensors: shardkit's TensorReference
    resolves to torch-xla's own class."""
    xser_dir = convert_to(tiny_model(MODEL), tmp_path / "xser", "xser")
    files = rank_files(xser_dir)
    assert [f.name for f in files] == [f.name for f in rank_files(torch_shards)]
    report = fake_xla_load(fake_xla, files, tmp_path)
    assert len(report["files"]) == len(files)
    for entry, path in zip(report["files"], files):
        want = load_plain(torch_shards / "model" / path.name)
        assert entry["raw_type"] in ("builtins.dict", "collections.OrderedDict"), entry["raw_type"]
        assert entry["type"] == entry["raw_type"]
        assert entry["keys"] == list(want), f"{path.name}: keys or key order differ from the torch format"
        for key, (cls, is_fake_class, tid) in entry["raw"].items():
            assert cls == "torch_xla.utils.serialization.TensorReference" and is_fake_class, (path.name, key, cls)
            assert isinstance(tid, int), (path.name, key, tid)
        assert entry["loaded_types"] == ["torch.Tensor"]
        got = load_plain(Path(entry["out"]))
        for key in want:
            assert_same_tensor(got[key], want[key], f"{path.name}:{key}")


def test_xser_output_is_the_reference_form(tiny_model, torch_shards, tmp_path):
    """The .pt holds only torch-xla TensorReference objects (pickle GLOBAL under torch-xla's name),
    each tensor sits alone in <file>.tensors/tensor_<tid>.pt, and <file>.info.pt maps
    tid -> {dtype, shape, expert_model_parallel}."""
    xser_dir = convert_to(tiny_model(MODEL), tmp_path / "xser", "xser")
    for path in rank_files(xser_dir):
        want = load_plain(torch_shards / "model" / path.name)
        globals_ = pickle_globals(path)
        assert REFERENCE_GLOBAL in globals_, f"{path.name}: no {REFERENCE_GLOBAL!r} GLOBAL in {globals_}"
        assert not [g for g in globals_ if g.startswith("torch.")], f"{path.name}: inline tensors in {globals_}"
        refs = load_refs(path)
        assert list(refs) == list(want)
        assert all(isinstance(v, _Ref) and isinstance(v.tid, int) for v in refs.values())
        tids = {k: v.tid for k, v in refs.items()}
        assert len(set(tids.values())) == len(tids), f"{path.name}: duplicate tids"
        tensor_dir = Path(str(path) + ".tensors")
        assert {p.name for p in tensor_dir.iterdir()} == {f"tensor_{t}.pt" for t in tids.values()}
        for key, tid in tids.items():
            assert_same_tensor(load_plain(tensor_dir / f"tensor_{tid}.pt"), want[key], f"{path.name}:{key}")
        info = load_plain(Path(str(path) + ".info.pt"))
        assert set(info) == set(tids.values())
        for key, tid in tids.items():
            assert info[tid] == {"dtype": want[key].dtype, "shape": want[key].shape, "expert_model_parallel": False}
            assert isinstance(info[tid]["shape"], torch.Size)


@pytest.mark.parametrize("writer", ["native", "torch"])
def test_xser_tensor_files_are_torch_save_of_the_bare_tensor(writer, monkeypatch, tmp_path):
    """Each tensor file XserWriter streams is byte for byte torch.save(tensor) (what torch-xla's
    xser.save writes for it, into a file object), whichever zip writer writes it and whether the
    tensor is handed over (owned: written and hashed behind); its record's digests are the file's."""
    from shardkit.formats import torch_io, torch_zip
    from shardkit.formats.xser import XserWriter, tensor_path

    if writer == "torch":
        monkeypatch.setattr(torch_io, "native_writer", lambda records, bound: False)
    gen = torch.Generator().manual_seed(7)
    tensors = {
        "big.bf16": torch.randn(1500, 700, generator=gen).to(torch.bfloat16),  # large enough to go behind
        "w.fp32": torch.randn(33, 17, generator=gen),
        "strided": torch.randn(12, 8, generator=gen).t(),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "ids.i64": torch.arange(9),
        "mask": torch.tensor([True, False]),
    }
    if hasattr(torch, "float8_e4m3fn"):
        tensors["f8"] = torch.randn(5, 3, generator=gen).to(torch.float8_e4m3fn)
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    path = tmp_path / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    out = XserWriter(path, tmp_path, specs, digests="sha256")
    for i, (name, tensor) in enumerate(tensors.items()):
        out.write(name, tensor.clone(), owned=bool(i % 2))
    records = {r.path: r for r in out.close()}
    assert torch_zip.native_matches() or writer == "torch"
    for tid, (name, tensor) in enumerate(tensors.items()):
        want = io.BytesIO()
        torch.save(tensor.contiguous().clone(), want)
        file = tensor_path(path, tid)
        raw = file.read_bytes()
        assert raw == want.getvalue(), name
        record = records[file.relative_to(tmp_path).as_posix()]
        assert (record.size, record.sha256, record.xxh3_128) == (
            len(raw),
            hashlib.sha256(raw).hexdigest(),
            xxhash.xxh3_128_hexdigest(raw),
        ), name


def test_xser_output_matches_real_torch_xla_golden(tmp_path):
    """Same layout as the golden files written by real torch-xla: same file names, same tids per
    key (in the same order), same .info.pt contents, equal tensors, same pickle globals."""
    golden = golden_or_skip()
    want_root = golden / "nxd-xser" / GOLDEN_XSER_CASE
    got_root = convert_to(golden / "hf" / "llama-gqa-tiny", tmp_path / "xser", "xser", Layout(tp=8, pp=2, qkv="gqa"))
    want_files = {f for f in files_under(want_root / "model")}
    got_files = {f for f in files_under(got_root / "model")}
    assert got_files == want_files, (sorted(got_files - want_files)[:5], sorted(want_files - got_files)[:5])
    for want_path in rank_files(want_root):
        got_path = got_root / "model" / want_path.name
        want_refs, got_refs = load_refs(want_path), load_refs(got_path)
        assert [(k, v.tid) for k, v in got_refs.items()] == [(k, v.tid) for k, v in want_refs.items()], want_path.name
        assert pickle_globals(got_path) == pickle_globals(want_path)
        assert load_plain(Path(str(got_path) + ".info.pt")) == load_plain(Path(str(want_path) + ".info.pt"))
        for ref in want_refs.values():
            rel = f"{want_path.name}.tensors/tensor_{ref.tid}.pt"
            assert_same_tensor(load_plain(got_root / "model" / rel), load_plain(want_root / "model" / rel), rel)


def test_fake_torch_xla_reads_real_torch_xla_output(fake_xla, tmp_path):
    """Check of the fake itself: it reads real torch-xla files to the torch-form golden tensors."""
    golden = golden_or_skip()
    files = rank_files(golden / "nxd-xser" / GOLDEN_XSER_CASE)[:2]
    report = fake_xla_load(fake_xla, files, tmp_path)
    for entry, path in zip(report["files"], files):
        want = load_plain(golden / "nxd" / GOLDEN_XSER_CASE / "model" / path.name)
        assert entry["keys"] == list(want)
        got = load_plain(Path(entry["out"]))
        for key in want:
            assert_same_tensor(got[key], want[key], f"{path.name}:{key}")


# ---- 2. reading xser with referenced and inline tensors -------------------------------------------


def test_reads_xser_with_inline_and_referenced_tensors(hand_xser, torch_shards, tiny_model, tmp_path):
    files = rank_files(hand_xser)
    for path in files:  # the fixture really mixes both forms in each file
        globals_ = pickle_globals(path)
        assert REFERENCE_GLOBAL in globals_ and "torch._utils _rebuild_tensor_v2" in globals_, (path.name, globals_)
    ckpt = open_checkpoint(hand_xser)
    assert ckpt.format == "xser" and ckpt.kind == "sharded"
    assert (ckpt.layout.tp, ckpt.layout.pp, ckpt.layout.qkv) == (2, 2, "gqa")
    for path in files:
        want = load_plain(torch_shards / "model" / path.name)
        reader = XserFile(path)
        try:
            assert reader.keys() == list(want)
            for key, tensor in want.items():
                assert reader.shape(key) == tuple(tensor.shape), (path.name, key)
                assert reader.dtype(key) == tensor.dtype, (path.name, key)
                assert_same_tensor(reader.read(key), tensor, f"{path.name}:{key}")
                rows = tensor.shape[0]
                if tensor.dim() and rows > 1:
                    assert_same_tensor(reader.read(key, 0, 1, rows), tensor[1:rows], f"{path.name}:{key}[1:]")
        finally:
            reader.close()
        loaded = shardkit_xser_load(path)
        assert list(loaded) == list(want)
        for key in want:
            assert_same_tensor(loaded[key], want[key], f"xser.load {path.name}:{key}")
    merged = tmp_path / "merged"
    merge(hand_xser, merged)
    hf = load_file(tiny_model(MODEL) / "model.safetensors")
    got = load_file(merged / "model.safetensors")
    assert set(got) == set(hf)
    for key in hf:
        assert_same_tensor(got[key], hf[key], f"merged {key}")


def test_reads_real_torch_xla_golden_with_xserfile():
    golden = golden_or_skip()
    for path in rank_files(golden / "nxd-xser" / GOLDEN_XSER_CASE):
        want = load_plain(golden / "nxd" / GOLDEN_XSER_CASE / "model" / path.name)
        reader = XserFile(path)
        try:
            assert reader.keys() == list(want)
            for key in want:
                assert_same_tensor(reader.read(key), want[key], f"{path.name}:{key}")
        finally:
            reader.close()
