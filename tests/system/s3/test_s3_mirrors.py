"""Who reads a mirror of object storage (moto's server on loopback, tests/support/s3_fixtures.py):
a mirror's file is read through its store, which fetches its bytes; read as a local file while it
misses bytes, it is an internal error, never zeros. A mirror opened in no scope goes once its store
is dropped (its fetch threads keep nothing of it). Who owns a mirror: tests/unit/io/test_mirror_scopes.py.
"""

from __future__ import annotations

import gc

import pytest
import torch
from s3_helpers import own_temporary_folder, s3_loc  # noqa: F401 - own_temporary_folder: autouse
from safetensors.torch import save_file

from shardkit.formats.containers import fetch_metadata
from shardkit.formats.safetensors_io import SafetensorsFile
from shardkit.io.data.digest import file_digests
from shardkit.io.objects import remote, s3
from shardkit.io.store import Need, ReadWithoutStore, Store, prefix, scope


@pytest.fixture
def url(bucket) -> str:
    """A prefix of two small objects."""
    for key, body in (("src/config.json", b"{}"), ("src/sub/notes.txt", b"x" * 100)):
        s3.client().put_object(Bucket=bucket, Key=key, Body=body)
    return f"s3://{bucket}/src"


def test_a_mirror_of_no_scope_goes_once_its_store_is_dropped(url):
    store = prefix(s3_loc(url)).mirror()
    folder = store.mirror.base
    assert folder.is_dir()
    del store
    gc.collect()
    assert not folder.exists()


@pytest.fixture
def large(bucket, tmp_path) -> tuple[str, dict[str, torch.Tensor]]:
    """A prefix holding a safetensors file too large to be fetched as its mirror opens (3 MiB)."""
    tensors = {"a": torch.arange(1 << 19, dtype=torch.float32), "b": torch.ones(1 << 18, dtype=torch.float32)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    s3.client().put_object(Bucket=bucket, Key="big/m.safetensors", Body=(tmp_path / "m.safetensors").read_bytes())
    return f"s3://{bucket}/big", tensors


def test_a_mirror_file_read_without_its_store_is_an_internal_error_not_zeros(large):
    url, tensors = large
    with scope():  # as every command opens its mirrors: errors name the mirror's URL
        store = prefix(s3_loc(url)).mirror()
        path = store.root / "m.safetensors"
        assert remote.unfetched(path)
        for read in (
            lambda: Store(store.root).open(path),
            lambda: SafetensorsFile(path),
            lambda: file_digests(path),
            lambda: Store(store.root).fetch_whole(path),
        ):
            with pytest.raises(ReadWithoutStore, match=f"{url}/m.safetensors"):
                read()
        store.prepare([path], Need.METADATA, fetch_metadata)  # its header
        reader = SafetensorsFile(path, store=store)  # through its store: the bytes read are fetched first
        try:
            assert torch.equal(reader.read("b", 0, 100, 300), tensors["b"][100:300])
            assert torch.equal(reader.read("a"), tensors["a"])
        finally:
            reader.close()
        store.fetch_whole(path)  # every byte there: a local file like any other
        assert not remote.unfetched(path)
        assert file_digests(path) == file_digests(path, store=store)
        store.close()
