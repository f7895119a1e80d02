"""How to write travels as one typed record (`engine.options.WriteOptions`), made once from the
public keyword arguments in their documented spellings; the executor plans (`planning.plan_write`:
nothing written, nothing started) and then runs the plan."""

from __future__ import annotations

import threading

import pytest
import torch

from shardkit import Layout, convert
from shardkit.engine import planning
from shardkit.engine.options import AUTO, DirectIO, WriteOptions
from shardkit.engine.outputs import plan_full, plan_sharded
from shardkit.engine.planning import Way, plan_write
from shardkit.formats import open_checkpoint
from shardkit.io.data.digest import CheckMode, Recording


@pytest.mark.parametrize(
    ("args", "field", "value"),
    [
        ({}, "verify_hashes", CheckMode.FAST),
        ({"verify_hashes": True}, "verify_hashes", CheckMode.FAST),
        ({"verify_hashes": "sha256"}, "verify_hashes", CheckMode.SHA256),
        ({"verify_hashes": False}, "verify_hashes", CheckMode.NONE),
        ({"verify_hashes": "none"}, "verify_hashes", CheckMode.NONE),
        ({}, "direct_io", DirectIO.OFF),
        ({"direct_io": True}, "direct_io", DirectIO.ON),
        ({"direct_io": "auto"}, "direct_io", DirectIO.AUTO),
        ({}, "workers", AUTO),
        ({"workers": "auto"}, "workers", AUTO),
        ({"workers": 3}, "workers", 3),
        ({"workers": "2"}, "workers", 2),
        ({}, "dtype", None),
        ({"dtype": "bf16"}, "dtype", torch.bfloat16),
        ({}, "digests", Recording.FAST),
        ({"sha256": True}, "digests", Recording.SHA256),
    ],
)
def test_the_public_spellings_become_one_typed_record(args, field, value):
    options = WriteOptions.from_args(args, "torch")
    assert getattr(options, field) == value and type(getattr(options, field)) is type(value)
    assert options.fmt == "torch"


def test_outputs_no_manifest_lists_are_not_hashed_whatever_sha256_says():
    assert WriteOptions.from_args({"sha256": True}, "safetensors", manifest=False).digests is Recording.NONE
    assert not Recording.NONE and Recording.FAST and Recording.SHA256 == "sha256"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"direct_io": "sometimes"}, "direct_io must be True, False or 'auto'"),
        ({"workers": 0}, "workers must be a positive integer or 'auto'"),
        ({"workers": True}, "workers must be a positive integer or 'auto'"),
        ({"verify_hashes": "md5"}, "verify_hashes"),
    ],
)
def test_a_wrong_spelling_is_refused_before_anything_is_written(tiny_model, tmp_path, args, message):
    with pytest.raises(ValueError, match=message):
        WriteOptions.from_args(args, "torch")
    with pytest.raises(ValueError, match=message):
        convert(tiny_model("llama-gqa64"), tmp_path / "out", Layout(tp=2), format="torch", **args)
    assert list(tmp_path.iterdir()) == []


def test_a_plan_writes_nothing_starts_nothing_and_says_how_each_tensor_is_written(tiny_model, tmp_path):
    """A convert's plan: the tp files of a stage built together, their blocks of columns streamed
    as rows, the rest copied by the kernel (whole tensors and blocks of rows, in the same dtype);
    with a cast, nothing is copied. Planning writes nothing and starts no thread."""
    src = open_checkpoint(tiny_model("llama-gqa64", dtype=torch.bfloat16))
    outputs = plan_sharded(src.family, src.dims, Layout(tp=2, pp=2), "torch")
    threads = threading.active_count()
    plan = plan_write(src, outputs, WriteOptions(fmt="torch", workers=1))
    assert threading.active_count() == threads and list(tmp_path.iterdir()) == []
    assert [len(group) for group in plan.groups] == [2, 2]
    assert plan.read_ahead is not None and plan.workers == 1 and not plan.direct
    ways = {t.piece.name: t.ways for group in plan.groups for file in group for t in file.tensors}
    assert ways["model.layers.0.self_attn.o_proj.weight"][:2] == (Way.COPY, Way.ROWS)
    assert ways["model.layers.0.self_attn.q_proj.weight"][0] is Way.COPY
    assert all(w[-1] is Way.WHOLE for w in ways.values())
    cast = plan_write(src, outputs, WriteOptions(fmt="torch", dtype=torch.float32))
    assert all(Way.COPY not in t.ways for group in cast.groups for file in group for t in file.tensors)


def test_a_merge_of_checked_cold_shards_reads_them_and_of_warm_ones_copies(tiny_model, tmp_path, monkeypatch):
    """Merge's output has no digests: the check of its sources is then the only reader of the
    copies, so cold shards are planned to be read (no COPY) and warm ones copied."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "shards", Layout(tp=2), format="torch", workers=1)
    shards = open_checkpoint(tmp_path / "shards")
    outputs, _ = plan_full(shards.family, shards.dims, 2, "5GB")
    options = WriteOptions.from_args({}, "safetensors", manifest=False)

    def copied(share: float) -> bool:
        monkeypatch.setattr(planning, "cached_share", lambda extents: share)
        plan = plan_write(shards, outputs, options)
        return any(Way.COPY in t.ways for group in plan.groups for file in group for t in file.tensors)

    assert not copied(0.0) and copied(1.0)
    assert not any(Way.ROWS in t.ways for t in plan_write(shards, outputs, options).groups[0][0].tensors)
