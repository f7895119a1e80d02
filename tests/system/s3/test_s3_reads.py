"""What shardkit fetches from object storage, counted by a proxy in front of the moto server: an
operation reads the files it uses, each byte once."""

from __future__ import annotations

import os

import ckpt_child
import pytest
import torch
from s3_faults import FaultProxy
from s3_helpers import CONFIG, TP2PP2, _save, keys, own_temporary_folder, run  # noqa: F401 - own_temporary_folder: autouse

import shardkit
from shardkit.api import convert
from shardkit.checkpoint import finalize_checkpoint, load_checkpoint
from shardkit.io.objects import remote, s3
from shardkit.testing import fixture_config, make_tiny_model

SLACK = 256 << 10
"""Bytes an operation may read besides the tensors it needs (markers, manifests, headers, zip
directories)."""


@pytest.fixture
def proxy(s3_server, monkeypatch):
    """A counting proxy in front of the moto server, which boto3 now talks to."""
    counting = FaultProxy(s3_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", counting.url)
    s3.reset_client()
    yield counting
    counting.close()
    s3.reset_client()


def sizes(bucket: str, prefix: str) -> dict[str, int]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


@pytest.fixture
def tag(bucket, proxy):
    """A training tag at tp 2 pp 2 with ZeRO-1 Adam state in s3://bucket/run/step_3, and its
    objects' sizes; nothing counted yet."""
    config = fixture_config(CONFIG)
    _save(f"s3://{bucket}/run", "step_3", TP2PP2, config, ckpt_child.full_state(config, 3, seed=1), 3)
    finalize_checkpoint()
    proxy.reset_counts()
    return sizes(bucket, "run/step_3/")


def fetched(proxy: FaultProxy, prefix: str) -> int:
    return sum(n for key, n in proxy.got.items() if key.startswith(prefix))


def test_ckpt_reshard_fetches_each_byte_of_the_tag_once(bucket, proxy, tag, tmp_path):
    res = run("ckpt", "reshard", f"s3://{bucket}/run", f"s3://{bucket}/tp1", "--tp", "1", "--pp", "1")
    assert res.exit_code == 0, res.output
    assert "tp1/step_3/done" in keys(bucket, "tp1/")
    total = sum(tag.values())
    assert fetched(proxy, "run/") <= 1.05 * total, (fetched(proxy, "run/"), total)


def test_load_checkpoint_of_one_rank_fetches_that_ranks_model_file(bucket, proxy, tag):
    loaded = load_checkpoint(f"s3://{bucket}/run", "step_3", target_layout=TP2PP2, rank=(0, 0), optimizer=False)
    assert loaded is not None and loaded.model
    model_file = tag["run/step_3/model/dp_rank_00_tp_rank_00_pp_rank_00.pt"]
    assert fetched(proxy, "run/") <= 1.05 * model_file + SLACK, (fetched(proxy, "run/"), model_file)


def test_ckpt_inspect_reads_the_optimizer_files_through_the_mirror(bucket, proxy, tag):
    """`ckpt inspect` opens the tag's ZeRO-1 optimizer files whole (torch.load) through the
    mirror's store, which fetches them first: never read as local files with holes."""
    from shardkit.api import inspect_training_checkpoint

    lazy = [k for k, n in tag.items() if "/optim/" in k and n > remote.SMALL]
    assert lazy  # files the mirror does not fetch as it opens
    info = inspect_training_checkpoint(f"s3://{bucket}/run")
    assert info["tag"] == "step_3" and info["dp"] == 1 and info["param_groups"]
    optim = sum(n for key, n in tag.items() if "/optim/" in key)
    assert optim <= fetched(proxy, "run/") <= 1.05 * optim + SLACK * len(tag), (fetched(proxy, "run/"), optim)


def test_ckpt_export_fetches_the_model_files_only(bucket, proxy, tag, tmp_path):
    res = run("ckpt", "export", f"s3://{bucket}/run", tmp_path / "hf")
    assert res.exit_code == 0, res.output
    model = sum(n for key, n in tag.items() if "/model/" in key)
    assert fetched(proxy, "run/") <= 1.05 * model + SLACK, (fetched(proxy, "run/"), model)


def test_mqa_reshard_fetches_one_replica_of_each_kv_head(bucket, proxy, tmp_path):
    """tp 8 with one K/V head replicated 8 times -> tp 4: each K/V byte is fetched from one replica."""
    config = fixture_config(CONFIG)
    config.update(hidden_size=1024, head_dim=64, num_attention_heads=16, num_key_value_heads=1, num_hidden_layers=4)
    hf = make_tiny_model(config, tmp_path / "hf", dtype=torch.bfloat16)
    url = f"s3://{bucket}/mqa8"
    convert(hf, url, shardkit.make_layout(tp=8, pp=1, qkv="gqa", kv_multiplier=8))
    proxy.reset_counts()
    res = run("reshard", url, tmp_path / "tp4", "--tp", "4", "--kv-multiplier", "4", "--no-verify-hashes")
    assert res.exit_code == 0, res.output
    kv_replica = 2 * config["num_hidden_layers"] * config["head_dim"] * config["hidden_size"] * 2  # k and v, bf16
    unique = sum(sizes(bucket, "mqa8/").values()) - 7 * kv_replica
    assert 7 * kv_replica > 0.15 * unique  # fetching every replica would fail the bound
    assert fetched(proxy, "mqa8/") <= 1.05 * unique, (fetched(proxy, "mqa8/"), unique)
    assert os.path.isdir(tmp_path / "tp4")


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_inspect_fetches_the_manifest_and_the_files_metadata_only(bucket, proxy, tmp_path, fmt):
    """`inspect` without --check-data reads the manifest, the config and each tensor file's header
    (a safetensors header; a torch zip's directory and records' headers), never the tensors."""
    config = fixture_config(CONFIG)
    config.update(hidden_size=512, num_hidden_layers=2)
    hf = make_tiny_model(config, tmp_path / "hf", dtype=torch.bfloat16)
    url = f"s3://{bucket}/inspect-{fmt}"
    convert(hf, url, shardkit.make_layout(tp=2, pp=1), format=fmt)
    proxy.reset_counts()
    res = run("inspect", url, "--json")
    assert res.exit_code == 0, res.output
    total = sum(sizes(bucket, f"inspect-{fmt}/").values())
    files = len([k for k in sizes(bucket, f"inspect-{fmt}/") if k.endswith((".pt", ".safetensors"))])
    assert total > 10 * files * SLACK  # fetching the tensors would fail the bound by far
    assert fetched(proxy, f"inspect-{fmt}/") <= files * SLACK, (fetched(proxy, f"inspect-{fmt}/"), total)
