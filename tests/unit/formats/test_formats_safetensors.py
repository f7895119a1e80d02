"""safetensors written by shardkit: shards of every family and dtype laid out as the safetensors
library writes them, casting on write, and the streaming writer with any shapes and dtypes."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from format_helpers import MODEL, assert_same_tensor, convert_to, load_plain, rank_files
from safetensors.torch import load_file

from shardkit import Layout
from shardkit.formats.base import TensorSpec
from shardkit.formats.safetensors_io import SafetensorsWriter

# ---- 4. safetensors written by shardkit --------------------------------------------------------------


def read_st_header(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8 : 8 + length])


def check_st_layout(path: Path) -> dict:
    """Header length a multiple of 8, metadata {"format": "pt"}, data offsets packed and covering the file."""
    length, header = read_st_header(path)
    assert length % 8 == 0, f"{path.name}: header length {length} is not a multiple of 8"
    assert header.pop("__metadata__", None) == {"format": "pt"}, path.name
    spans = sorted(tuple(v["data_offsets"]) for v in header.values())
    end = 0
    for start, stop in spans:
        assert start == end, f"{path.name}: gap or overlap at {start}"
        end = stop
    assert path.stat().st_size == 8 + length + end, f"{path.name}: size does not match the header"
    return header


@pytest.mark.parametrize(
    "model,dtype", [(MODEL, torch.float32), (MODEL, torch.bfloat16), ("llama-bias", torch.bfloat16)]
)
def test_safetensors_shards(model, dtype, tiny_model, tmp_path):
    src = tiny_model(model, dtype=dtype)
    layout = Layout(tp=2, pp=2, qkv="gqa")
    st = convert_to(src, tmp_path / "st", "safetensors", layout)
    pt = convert_to(src, tmp_path / "pt", "torch", layout)
    st_files = rank_files(st)
    assert [f.stem for f in st_files] == [f.stem for f in rank_files(pt)]
    assert all(f.suffix == ".safetensors" for f in st_files)
    st_name = {torch.float32: "F32", torch.bfloat16: "BF16"}[dtype]
    for path in st_files:
        header = check_st_layout(path)
        want = load_plain(pt / "model" / (path.stem + ".pt"))
        assert list(header) == list(want), f"{path.name}: names or order differ from the torch format"
        assert {v["dtype"] for v in header.values()} == {st_name}
        got = load_file(path)
        assert set(got) == set(want)
        for key in want:
            assert want[key].dtype == dtype
            assert_same_tensor(got[key], want[key], f"{path.name}:{key}")


def test_safetensors_cast_on_write(tiny_model, tmp_path):
    """dtype="bf16" from an fp32 source: the streamed bf16 file equals the cast tensors."""
    src = tiny_model(MODEL)
    st = convert_to(src, tmp_path / "st", "safetensors", dtype="bf16")
    pt = convert_to(src, tmp_path / "pt", "torch")
    for path in rank_files(st):
        check_st_layout(path)
        want = load_plain(pt / "model" / (path.stem + ".pt"))
        got = load_file(path)
        for key in want:
            assert_same_tensor(got[key], want[key].to(torch.bfloat16), f"{path.name}:{key}")


def test_safetensors_writer_streams_any_shapes_and_dtypes(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 5),
        "b.bf16": torch.randn(7, 3).to(torch.bfloat16),
        "c.fp16": torch.randn(1).to(torch.float16),
        "d.scalar": torch.tensor(2.5),
        "e.int": torch.arange(11, dtype=torch.int64),
        "f.bool": torch.tensor([True, False, True]),
        "g.u8": torch.arange(5, dtype=torch.uint8),
        "h.noncontiguous": torch.randn(4, 6).t(),
        "i.fp64": torch.randn(2, 2, dtype=torch.float64),
    }
    specs = [TensorSpec(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    path = tmp_path / "out" / "file.safetensors"
    writer = SafetensorsWriter(path, tmp_path, specs, digests="sha256")
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    (record,) = writer.close()
    raw = path.read_bytes()
    assert record.path == "out/file.safetensors"
    assert record.size == len(raw) and record.sha256 == hashlib.sha256(raw).hexdigest()
    header = check_st_layout(path)
    assert list(header) == list(tensors)
    got = load_file(path)
    for name, tensor in tensors.items():
        assert_same_tensor(got[name], tensor.contiguous(), name)
