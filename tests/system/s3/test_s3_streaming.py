"""Reading from s3:// (moto's server on loopback, tests/support/s3_fixtures.py): convert, merge,
reshard and verify through a bucket with exact results and nothing created locally; reads fetch each
byte once in few requests; large sources stream through a window, every block checked, and sources
that cannot stream are fetched whole and checked.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[s3]')")

from s3_helpers import (  # noqa: E402
    _fetched,
    keys,
    no_mirrors_left,
    own_temporary_folder,  # noqa: F401 - autouse: each test its own temporary folder
    run,
    run_sub,
    s3_loc,
)

import shardkit  # noqa: E402
from shardkit.api import convert, merge, verify  # noqa: E402
from shardkit.errors import FormatError  # noqa: E402
from shardkit.formats.containers import fetch_metadata  # noqa: E402
from shardkit.io.objects import remote, s3, scopes, streamed  # noqa: E402

# ---- convert, merge, reshard, verify -----------------------------------------------------------------


def test_convert_merge_reshard_verify_through_s3(tiny_model, bucket, tmp_path, workdir):
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/models/tp4"
    result = convert(hf, url, shardkit.make_layout(tp=4, pp=2, qkv="gqa"))
    assert str(result.path) == url
    names = keys(bucket, "models/tp4/")
    assert "models/tp4/shardkit.json" in names and "models/tp4/config.json" in names
    assert "models/tp4/model/dp_rank_00_tp_rank_03_pp_rank_01.pt" in names
    assert not any(".shardkit-writing" in n for n in names)
    assert verify(hf, url).ok

    merged = tmp_path / "out" / "merged"
    merge(url, merged)
    assert verify(hf, merged).ok
    assert sorted(p.name for p in merged.parent.iterdir()) == ["merged"]  # nothing beside it

    # the wrong kind of folder is named by its URL, with the command that reads it
    res = run("ckpt", "export", url, tmp_path / "x")
    assert res.exit_code == 2 and f"use `shardkit merge {url} OUT`" in res.stderr, res.stderr
    url2 = f"s3://{bucket}/models/tp2"
    res = run("reshard", url, url2, "--tp", "2", "--pp", "1")
    assert res.exit_code == 0, res.output
    assert verify(url, url2).ok and verify(hf, url2).ok
    # an existing output is replaced only with --overwrite; an output inside its source is refused
    again = run("convert", hf, url2, "--tp", "2")
    assert again.exit_code == 2 and "--overwrite" in again.stderr, again.stderr
    overlap = run("reshard", url, f"{url}/inner", "--tp", "1")
    assert overlap.exit_code == 2 and "overlaps" in overlap.stderr, overlap.stderr
    assert not list(workdir.iterdir())
    no_mirrors_left()


@pytest.mark.slow  # the CLI in its own processes (8 of them); in process: the test above
def test_cli_convert_to_s3_and_verify(tiny_model, bucket, workdir):
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/cli/tp2"
    out = run_sub("convert", hf, url, "--tp", "2", cwd=workdir)
    assert out.returncode == 0, out.stderr
    out = run_sub("verify", hf, url, cwd=workdir)
    assert out.returncode == 0, out.stderr + out.stdout
    out = run_sub("inspect", url, "--json", cwd=workdir)
    assert out.returncode == 0 and json.loads(out.stdout)["path"] == url
    again = run_sub("convert", hf, url, "--tp", "2", cwd=workdir)
    assert again.returncode == 2 and "--overwrite" in again.stderr
    assert run_sub("convert", hf, url, "--tp", "4", "--overwrite", cwd=workdir).returncode == 0
    assert run_sub("verify", hf, url, cwd=workdir).returncode == 0
    overlap = run_sub("reshard", url, f"{url}/inner", "--tp", "1", cwd=workdir)
    assert overlap.returncode == 2 and "overlaps" in overlap.stderr
    assert not list(workdir.iterdir())


def test_reads_fetch_each_byte_once_in_few_requests(tiny_model, bucket, tmp_path, monkeypatch):
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/tp8"
    convert(hf, url, shardkit.make_layout(tp=8, pp=1, qkv="gqa", kv_multiplier=2))
    objects = s3.list_objects(s3_loc(url))
    size = sum(o.size for o in objects)
    fetched = _fetched(monkeypatch)
    merge(url, tmp_path / "merged")  # reads every shard: fetched whole, each byte once
    assert verify(hf, tmp_path / "merged").ok
    nbytes, gets = fetched[0]
    assert 0 < nbytes <= size
    parts = sum(-(-o.size // s3.PART_SIZE) for o in objects)
    assert gets <= parts, (gets, parts)  # never a GET per zip record (201 per shard here)

    # inspect reads only what opening the shards reads, even where no hole is joined
    monkeypatch.setattr(remote, "HOLE", 0)
    report = shardkit.inspect(url)
    assert report["path"] == url
    nbytes, gets = fetched[-1]
    assert nbytes < size * 0.25, (nbytes, size)
    assert gets < 8 * 250  # head, tail, central directory, one window per record header at most


@pytest.fixture
def streamed_sizes(monkeypatch):
    """Parts, blocks, the window and the whole-object threshold scaled down to the tiny model's
    files, so that its shards stream as a large model's do (every other path is unchanged)."""
    from shardkit.io.data import digest

    monkeypatch.setattr(remote, "SMALL", 8 << 10)
    monkeypatch.setattr(remote, "PART", 32 << 10)
    monkeypatch.setattr(digest, "BLOCK_SIZE", 32 << 10)
    monkeypatch.setattr(remote, "STREAM_BUDGET", 256 << 10)
    seen: list[dict] = []
    close = remote.Mirror.close

    def recording(self):
        files = [mf for mf in self.files.values() if mf.streamed]
        seen.append(
            {
                "streamed": len(files),
                "most_held": self.most_held,
                "dropped": sum(mf.dropped.total() for mf in files),
                "checked": sum(len(mf.verified) for mf in files),
                "memory": str(self.base).startswith(remote.MEMORY_DIR),
            }
        )
        close(self)

    monkeypatch.setattr(remote.Mirror, "close", recording)
    return seen


def test_streamed_source_holds_a_window_and_checks_every_block(small_model, bucket, tmp_path, streamed_sizes):
    """A source shardkit wrote to object storage lists block digests; a merge of it fetches it a
    bounded window ahead, checks each block as it arrives and drops what it has read: the result
    is exact while at most the window is held."""
    from shardkit.io.data import digest

    hf = small_model(torch.bfloat16)
    url = f"s3://{bucket}/tp4"
    convert(hf, url, shardkit.make_layout(tp=4, pp=2, qkv="gqa"))
    manifest = json.loads(s3.client().get_object(Bucket=bucket, Key="tp4/shardkit.json")["Body"].read())
    shards = [f for f in manifest["files"] if f["path"].endswith(".pt")]
    assert all(len(f["xxh3_128_blocks"]) == -(-f["size"] // digest.BLOCK_SIZE) for f in shards)
    total = sum(f["size"] for f in shards)
    assert total > 4 * remote.STREAM_BUDGET  # the window is what bounds it

    merge(url, tmp_path / "merged")
    assert verify(hf, tmp_path / "merged").ok
    run = streamed_sizes[-1]
    assert run["streamed"] == len(shards)
    assert run["memory"] == (streamed.memory_dir(remote.MEMORY_DIR, 4 * remote.STREAM_BUDGET, total) is not None)
    assert run["checked"] == sum(len(f["xxh3_128_blocks"]) for f in shards)
    assert run["dropped"] > 0.9 * total  # all but the pages shared with headers: read once, then given back
    assert run["most_held"] <= remote.STREAM_BUDGET + 2 * remote.PART, run

    no_mirrors_left()


def test_streamed_metadata_comes_in_the_parts_that_hold_it(small_model, bucket, streamed_sizes, monkeypatch):
    """A streamed source's metadata (a torch shard's head and tail) is fetched as the whole parts
    holding it, which the feeder then skips: each part of each shard is one GET, none is a GET for
    metadata alone. With no room in the window for those parts, the metadata alone is fetched."""
    monkeypatch.setattr(remote, "PART_HOLE", 0)  # head and tail apart, as in a shard of a real model
    hf = small_model(torch.bfloat16)
    url = f"s3://{bucket}/tp4"
    convert(hf, url, shardkit.make_layout(tp=4, pp=2, qkv="gqa"))
    gets: list[tuple[str, int, int]] = []
    get_range = s3.get_range

    def counted(loc, name, start, length, *args, **kwargs):
        gets.append((name, start, length))
        return get_range(loc, name, start, length, *args, **kwargs)

    monkeypatch.setattr(s3, "get_range", counted)

    def fetch(budget: int) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]], int]:
        monkeypatch.setattr(remote, "STREAM_BUDGET", budget)
        gets.clear()
        with scopes.mirrors_scope():
            mirror = remote.open_mirror(s3_loc(url), streamed=True)
            shards = [mf for mf in mirror.files.values() if mf.name.endswith(".pt")]
            mirror.prepare("", remote.Need.EVERYTHING, fetch_metadata)
            first = [g for g in gets if g[0].endswith(".pt")]
            mirror.order_parts(None)
            mirror.verified()  # the feeder has asked for every part; wait for them
            for mf in shards:
                mf.ensure(0, mf.size)
                assert not mf.fetched.missing(0, mf.size)
            every = [g for g in gets if g[0].endswith(".pt")]
            assert sum(length for _, _, length in every) == sum(mf.size for mf in shards)  # each byte once
            return first, every, sum(-(-mf.size // remote.PART) for mf in shards)

    first, every, parts = fetch(16 << 20)
    assert first and all(start % remote.PART == 0 for _, start, _ in first)  # whole parts
    assert len(every) == parts, (len(every), parts)
    first, _, _ = fetch(0)
    assert any(start % remote.PART for _, start, _ in first)  # the metadata alone (a tail's start)


@pytest.mark.slow  # the window on disk; in memory: test_streamed_source_holds_a_window_and_checks_every_block
def test_streamed_source_without_a_memory_folder_streams_on_disk(
    small_model, bucket, tmp_path, streamed_sizes, monkeypatch
):
    """No memory file system to hold the window (a container without /dev/shm): the mirror is in
    the temporary folder, and still gives back what has been read."""
    monkeypatch.setattr(remote, "MEMORY_DIR", str(tmp_path / "no-such-folder"))
    hf = small_model(torch.bfloat16)
    url = f"s3://{bucket}/disk"
    convert(hf, url, shardkit.make_layout(tp=2, qkv="gqa"))
    merge(url, tmp_path / "merged")
    assert verify(hf, tmp_path / "merged").ok
    run = streamed_sizes[-1]
    assert run["streamed"] > 0 and not run["memory"] and run["dropped"] > 0
    no_mirrors_left()


def test_streamed_source_with_a_flipped_bit_is_refused(small_model, bucket, tmp_path, streamed_sizes):
    """A byte changed in the store after the manifest was written: the block holding it does not
    match, and nothing is written."""
    hf = small_model(torch.bfloat16)
    url = f"s3://{bucket}/flip"
    convert(hf, url, shardkit.make_layout(tp=2, qkv="gqa"))
    key = "flip/model/dp_rank_00_tp_rank_01_pp_rank_00.pt"
    data = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(FormatError, match="dp_rank_00_tp_rank_01_pp_rank_00.pt does not match the digest"):
        merge(url, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    assert streamed_sizes[-1]["streamed"] > 0
    no_mirrors_left()


def test_source_without_block_digests_is_fetched_whole_and_checked(small_model, bucket, tmp_path, streamed_sizes):
    """Shards written locally and copied up by another tool list no block digests: read as
    before (fetched whole, each file checked), exact, and a flipped bit is still refused."""
    hf = small_model(torch.bfloat16)
    local = tmp_path / "tp2"
    convert(hf, local, shardkit.make_layout(tp=2, qkv="gqa"))
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        s3.client().upload_file(str(f), bucket, f"copied/{f.relative_to(local).as_posix()}")
    merge(f"s3://{bucket}/copied", tmp_path / "merged")
    assert verify(hf, tmp_path / "merged").ok
    assert streamed_sizes[-1]["streamed"] == 0
    key = "copied/model/dp_rank_00_tp_rank_00_pp_rank_00.pt"
    data = bytearray(s3.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10
    s3.client().put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(FormatError, match="does not match the digest"):
        merge(f"s3://{bucket}/copied", tmp_path / "merged2")


def _drop_a_descriptor_signature(path: Path, record: str) -> None:
    """Rewrite the torch zip at `path` so that `record`'s data descriptor has no signature (12
    bytes, which the zip format allows and torch reads), shifting what follows."""
    import struct
    import zipfile

    data = bytearray(path.read_bytes())
    info = next(i for i in zipfile.ZipFile(path).infolist() if i.filename.endswith(record))
    nlen, xlen = struct.unpack_from("<HH", data, info.header_offset + 26)
    at = info.header_offset + 30 + nlen + xlen + info.file_size
    assert data[at : at + 4] == b"PK\x07\x08"
    del data[at : at + 4]
    end = len(data) - 22
    assert data[end : end + 4] == b"PK\x05\x06"
    count, _, directory = struct.unpack_from("<HII", data, end + 10)
    if data[end - 20 : end - 16] == b"PK\x06\x07":  # zip64 end records (torch writes them)
        record = struct.unpack_from("<Q", data, end - 12)[0]
        struct.pack_into("<Q", data, end - 12, record - 4)
        count, directory = (
            struct.unpack_from("<Q", data, record - 4 + 32)[0],
            struct.unpack_from("<Q", data, record - 4 + 48)[0],
        )
        struct.pack_into("<Q", data, record - 4 + 48, directory - 4)
    if struct.unpack_from("<I", data, end + 16)[0] != 0xFFFFFFFF:
        struct.pack_into("<I", data, end + 16, directory - 4)
    pos = directory - 4
    for _ in range(count):
        header = struct.unpack_from("<I", data, pos + 42)[0]
        if header > at:
            struct.pack_into("<I", data, pos + 42, header - 4)
        pos += 46 + sum(struct.unpack_from("<HHH", data, pos + 28))
    path.write_bytes(bytes(data))


def test_streamed_torch_file_laid_out_otherwise_is_read_again_whole(
    small_model, bucket, tmp_path, streamed_sizes, caplog
):
    """A streamed torch file's tensor offsets are predicted from its central directory (its local
    headers are not fetched ahead of the plan) and checked against the real headers before the
    output is committed: a valid archive laid out otherwise (a descriptor without its signature)
    is read again, fetched whole first, and the result is exact."""
    hf = small_model(torch.bfloat16)
    local = tmp_path / "tp2"
    convert(hf, local, shardkit.make_layout(tp=2, qkv="gqa"))
    shard = local / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt"
    before = torch.load(shard, weights_only=True)
    _drop_a_descriptor_signature(shard, "data/5")
    after = torch.load(shard, weights_only=True)  # a valid archive: torch reads the same tensors
    assert all(torch.equal(before[k], after[k]) for k in before)
    merge(local, tmp_path / "local-merge", verify_hashes=False)  # read by its headers: exact
    assert verify(hf, tmp_path / "local-merge").ok
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        s3.client().upload_file(str(f), bucket, f"odd/{f.relative_to(local).as_posix()}")
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        merge(f"s3://{bucket}/odd", tmp_path / "merged", verify_hashes=False)
    assert verify(hf, tmp_path / "merged").ok
    assert "dp_rank_00_tp_rank_00_pp_rank_00.pt is not laid out as torch.save lays out its records" in caplog.text
    assert "reading it again" in caplog.text
    assert [run["streamed"] > 0 for run in streamed_sizes] == [True, False]
    no_mirrors_left()
