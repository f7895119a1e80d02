"""s3:// everywhere, against a real S3 API on loopback: moto's server mode (tests/support/s3_fixtures.py).

Every command, the checkpoint API and the trainer read from and write to a bucket of a moto server
on 127.0.0.1 (no network). Checked: exact results (verify), the objects really in the bucket,
nothing created locally (no `s3:` folder, nothing in the working directory or beside a local
destination), reads of only the byte ranges used, the commit protocol without rename (an
interrupted upload never lists as complete; the next run removes it, saying so), and one-line
errors (unsupported schemes, missing buckets and credentials, missing boto3).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[s3]')")

import ckpt_child  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from s3_fixtures import ENV, free_port  # noqa: E402
from s3_helpers import (  # noqa: E402, F401 - own_temporary_folder: autouse
    CONFIG,
    TP2PP2,
    _fetched,
    _save,
    keys,
    kill_while_uploading,
    no_mirrors_left,
    own_temporary_folder,
    run,
    run_sub,
    s3_loc,
)

import shardkit  # noqa: E402
from shardkit.api import convert, merge, verify  # noqa: E402
from shardkit.checkpoint import finalize_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint  # noqa: E402
from shardkit.cli import cli  # noqa: E402
from shardkit.errors import FormatError  # noqa: E402
from shardkit.io import remote, s3, streamed  # noqa: E402
from shardkit.testing import fixture_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


# ---- the location parser -------------------------------------------------------------------------------


def test_unsupported_scheme_is_one_line_for_every_command(tmp_path, workdir):
    hf = tmp_path / "x"
    hf.mkdir()
    commands = [
        ["convert", "gs://b/x", tmp_path / "o", "--tp", "2"],
        ["convert", hf, "gs://b/x", "--tp", "2"],
        ["merge", "http://h/x", tmp_path / "o"],
        ["reshard", "hf://org/x", tmp_path / "o", "--tp", "2"],
        ["inspect", "gs://b/x"],
        ["verify", "gs://b/x", hf],
        ["verify", hf, "gs://b/x"],
        ["ckpt", "list", "gs://b/x"],
        ["ckpt", "inspect", "gs://b/x"],
        ["ckpt", "prune", "gs://b/x", "--keep", "1"],
        ["ckpt", "export", "gs://b/x", tmp_path / "o"],
        ["ckpt", "export", hf, "gs://b/x"],
        ["ckpt", "reshard", "gs://b/x", tmp_path / "o", "--tp", "2"],
    ]
    for args in commands:
        out = CliRunner().invoke(cli, list(map(str, args)))
        assert out.exit_code == 2, (args, out.output)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "is not supported" in lines[0], (args, out.stderr)
    out = run_sub("convert", hf, "gs://b/x", "--tp", "2", cwd=workdir)  # the real process, its real stderr
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "gs://" in out.stderr
    assert not list(workdir.iterdir())  # never a folder named gs: or http:


def test_without_boto3_the_extra_is_named(tmp_path, workdir):
    code = (
        "import sys; sys.modules['boto3'] = None\n"
        "from shardkit.cli import main; sys.argv = ['shardkit', 'ckpt', 'list', 's3://bucket/x']; main()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=workdir)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "shardkit: error: s3:// locations need boto3, the 's3' extra: pip install 'shardkit[s3]'"
    ]


def test_missing_bucket_and_credentials_are_one_line(s3_server, tmp_path, workdir, monkeypatch):
    out = run_sub("ckpt", "list", "s3://no-such-bucket-here/x")
    assert out.returncode == 2 and "does not exist" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k == "AWS_ENDPOINT_URL"}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    env["AWS_EC2_METADATA_DISABLED"] = "true"
    out = subprocess.run(
        [sys.executable, "-m", "shardkit", "ckpt", "list", "s3://bucket/x"],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
    )
    assert out.returncode == 2 and "no AWS credentials" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_api_and_trainer_refuse_other_schemes(tmp_path, workdir, capsys):
    from shardkit.errors import ShardkitError
    from trainer.__main__ import main as trainer_main

    layout = shardkit.make_layout(tp=2)
    calls = {
        "convert": lambda: convert(tmp_path, "gs://b/x", layout),
        "merge": lambda: merge("az://b/x", tmp_path / "o"),
        "inspect": lambda: shardkit.inspect("http://h/x"),
        "save_checkpoint": lambda: save_checkpoint("gs://b/x", "step_1", {"w": torch.zeros(2)}),
        "load_checkpoint": lambda: load_checkpoint("gs://b/x"),
        "list_checkpoints": lambda: list_checkpoints("gs://b/x"),
    }
    for name, call in calls.items():
        with pytest.raises(ShardkitError, match="is not supported") as refused:
            call()
        assert "\n" not in str(refused.value), name
    for flag in ("--model", "--checkpoint-dir", "--resume", "--data"):
        args = {"--model": str(tmp_path), "--data": str(tmp_path / "tokens.bin"), flag: "gs://b/x"}
        assert trainer_main([*(a for item in args.items() for a in item), "--steps", "1"]) == 2, flag
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "gs://" in err[0] and flag in err[0], (flag, err)
    assert not list(workdir.iterdir())


def test_denied_access_is_one_line(s3_server, bucket, tiny_model, workdir):
    """A user the store knows, with no permission on the bucket: one line, exit 2, for a read
    and for a write (moto checks IAM once its authentication is switched on)."""
    import urllib.request

    iam = boto3.client("iam", endpoint_url=s3_server, region_name="us-east-1")
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    hf = tiny_model("tinyllama-mini", torch.bfloat16)

    def auth(count: str) -> None:
        request = urllib.request.Request(
            f"{s3_server}/moto-api/reset-auth",
            data=count.encode(),
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        urllib.request.urlopen(request, timeout=30).read()

    auth("0")
    try:
        env = dict(os.environ, AWS_ACCESS_KEY_ID=key["AccessKeyId"], AWS_SECRET_ACCESS_KEY=key["SecretAccessKey"])
        for args in (["ckpt", "list", f"s3://{bucket}/x"], ["convert", hf, f"s3://{bucket}/y", "--tp", "2"]):
            out = subprocess.run(
                [sys.executable, "-m", "shardkit", *map(str, args)],
                capture_output=True,
                text=True,
                env=env,
                cwd=workdir,
            )
            assert out.returncode == 2, out.stderr
            lines = out.stderr.strip().splitlines()
            # (moto answers a signed listing of this user SignatureDoesNotMatch, a PUT AccessDenied: both 403)
            assert len(lines) == 1 and "access denied (" in lines[0] and f"s3://{bucket}/" in lines[0], lines
    finally:
        auth("inf")
    assert not keys(bucket)
    assert not list(workdir.iterdir())


def test_throttling_and_5xx_are_retried(tiny_model, bucket, tmp_path, faulty):
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    proxy = faulty(fail_every=4)  # a quarter of all requests: SlowDown and InternalError in turn
    url = f"s3://{bucket}/flaky"
    convert(hf, url, shardkit.make_layout(tp=2, pp=2, qkv="gqa"))
    merge(url, tmp_path / "merged")
    assert verify(hf, url).ok and verify(hf, tmp_path / "merged").ok
    methods = {what.split()[0] for what in proxy.faulted}
    assert proxy.faults >= 6 and {"GET", "PUT"} <= methods, proxy.faulted


def test_retries_give_up_in_one_line(bucket, faulty, workdir):
    proxy = faulty(fail_all=True)
    env = dict(os.environ, SHARDKIT_S3_MAX_ATTEMPTS="3")
    out = subprocess.run(
        [sys.executable, "-m", "shardkit", "ckpt", "list", f"s3://{bucket}/x"],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and f"s3://{bucket}/x" in lines[0] and ("SlowDown" in lines[0] or "InternalError" in lines[0])
    ), lines
    assert proxy.requests == 3, proxy.faulted  # the first attempt and two retries


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
    assert not list(workdir.iterdir())
    no_mirrors_left()


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
    from shardkit.io import digest

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


def test_streamed_source_holds_a_window_and_checks_every_block(tiny_model, bucket, tmp_path, streamed_sizes):
    """A source shardkit wrote to object storage lists block digests; a merge of it fetches it a
    bounded window ahead, checks each block as it arrives and drops what it has read: the result
    is exact while at most the window is held."""
    from shardkit.io import digest

    hf = tiny_model("tinyllama-mini", torch.bfloat16)
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


def test_streamed_metadata_comes_in_the_parts_that_hold_it(tiny_model, bucket, streamed_sizes, monkeypatch):
    """A streamed source's metadata (a torch shard's head and tail) is fetched as the whole parts
    holding it, which the feeder then skips: each part of each shard is one GET, none is a GET for
    metadata alone. With no room in the window for those parts, the metadata alone is fetched."""
    monkeypatch.setattr(remote, "PART_HOLE", 0)  # head and tail apart, as in a shard of a real model
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
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
        with remote.mirrors_scope():
            mirror = remote.open_mirror(s3_loc(url), streamed=True)
            shards = [mf for mf in mirror.files.values() if mf.name.endswith(".pt")]
            mirror.prepare("", remote.Need.EVERYTHING)
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


def test_streamed_source_without_a_memory_folder_streams_on_disk(
    tiny_model, bucket, tmp_path, streamed_sizes, monkeypatch
):
    """No memory file system to hold the window (a container without /dev/shm): the mirror is in
    the temporary folder, and still gives back what has been read."""
    monkeypatch.setattr(remote, "MEMORY_DIR", str(tmp_path / "no-such-folder"))
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/disk"
    convert(hf, url, shardkit.make_layout(tp=2, qkv="gqa"))
    merge(url, tmp_path / "merged")
    assert verify(hf, tmp_path / "merged").ok
    run = streamed_sizes[-1]
    assert run["streamed"] > 0 and not run["memory"] and run["dropped"] > 0
    no_mirrors_left()


def test_streamed_source_with_a_flipped_bit_is_refused(tiny_model, bucket, tmp_path, streamed_sizes):
    """A byte changed in the store after the manifest was written: the block holding it does not
    match, and nothing is written."""
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
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


def test_source_without_block_digests_is_fetched_whole_and_checked(tiny_model, bucket, tmp_path, streamed_sizes):
    """Shards written locally and copied up by another tool list no block digests: read as
    before (fetched whole, each file checked), exact, and a flipped bit is still refused."""
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
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
    tiny_model, bucket, tmp_path, streamed_sizes, caplog
):
    """A streamed torch file's tensor offsets are predicted from its central directory (its local
    headers are not fetched ahead of the plan) and checked against the real headers before the
    output is committed: a valid archive laid out otherwise (a descriptor without its signature)
    is read again, fetched whole first, and the result is exact."""
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
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


def _hf_tensors(hf: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return [t for f in hf.glob("*.safetensors") for t in load_file(f).values()]


def test_outputs_upload_as_their_files_close(tiny_model, bucket, workdir, monkeypatch):
    """Each shard goes up as soon as it is written (the sink of the staging folder), and the local
    copy holds only the files in flight, never the whole output."""
    from shardkit.io import upload

    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    monkeypatch.setattr(upload, "FILES_IN_FLIGHT", 1)
    on_disk: list[int] = []
    at_end: list[str] = []
    closed, upload_tree = upload.StreamingUpload.closed, upload.upload_tree

    def counting_closed(self, path):
        on_disk.append(sum(1 for folder in self.folders for _ in folder.rglob("dp_rank_*.pt")))
        closed(self, path)

    def recording_upload_tree(local, loc, *args, **kwargs):
        at_end.extend(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
        return upload_tree(local, loc, *args, **kwargs)

    monkeypatch.setattr(upload.StreamingUpload, "closed", counting_closed)
    monkeypatch.setattr(upload, "upload_tree", recording_upload_tree)
    url = f"s3://{bucket}/streamed"
    convert(hf, url, shardkit.make_layout(tp=2, pp=4, qkv="gqa"), workers=1)
    assert len([k for k in keys(bucket, "streamed/model/")]) == 8
    assert not [n for n in at_end if n.startswith("model/")], at_end  # every shard went up as it closed
    assert "shardkit.json" in at_end  # the manifest at the commit, last
    # a stage's 2 files are written together, the next stage's while they close, one uploading
    assert len(on_disk) >= 8 and max(on_disk) <= 5, on_disk
    assert verify(hf, url).ok
    assert not list(workdir.iterdir())
    no_mirrors_left()


def test_next_file_goes_up_while_the_store_completes_the_last(bucket, tmp_path, faulty, monkeypatch):
    """A file stops counting against `files_in_flight` once all of it is sent, not once the store
    has assembled its object: with one file in flight, the second file's upload begins while the
    first's CompleteMultipartUpload is held back, and the first is already deleted locally. Every
    part's first attempt fails after its body was sent, so parts are sent again after their file
    was deleted (from the descriptors they hold), and every object is still exact."""
    monkeypatch.setattr(s3, "PART_SIZE", 5 << 20)  # moto's smallest part: 3 parts per file
    proxy = faulty(fail_first="partNumber=")
    rng = torch.Generator().manual_seed(0)
    files = []
    for i in range(3):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(torch.randint(0, 256, (11 << 20,), dtype=torch.uint8, generator=rng).numpy().tobytes())
        files.append((path, path.read_bytes()))
    second_began = threading.Event()
    seen_at_first_complete: dict[str, bool] = {}

    def on_create(params, **kwargs):
        if params["Key"].endswith("/f1.bin"):
            second_began.set()

    def on_complete(params, **kwargs):
        if params["Key"].endswith("/f0.bin"):
            seen_at_first_complete["local copy"] = files[0][0].exists()
            seen_at_first_complete["second began"] = second_began.wait(20)

    events = s3.client().meta.events
    events.register("before-parameter-build.s3.CreateMultipartUpload", on_create)
    events.register("before-parameter-build.s3.CompleteMultipartUpload", on_complete)
    uploader = s3.Uploader(files_in_flight=1)
    try:
        for path, _ in files:
            uploader.upload(path, s3_loc(f"s3://{bucket}/early"), path.name, remove=True)
        sent = uploader.wait()
    finally:
        uploader.close()
    assert seen_at_first_complete == {"local copy": False, "second began": True}
    assert sent == 3 * (11 << 20)
    direct = boto3.client("s3", endpoint_url=proxy.upstream.geturl())
    for path, data in files:
        assert not path.exists()
        assert direct.get_object(Bucket=bucket, Key=f"early/{path.name}")["Body"].read() == data
    assert len([w for w in proxy.faulted if "partNumber=" in w]) == 9, proxy.faulted


def test_interrupted_upload_is_incomplete_and_cleaned_up(tiny_model, bucket, tmp_path, workdir):
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/killed"
    kill_while_uploading(["convert", str(hf), url, "--tp", "2"], workdir)  # a slow upload, killed
    names = keys(bucket, "killed/")
    assert "killed/.shardkit-writing" in names and "killed/shardkit.json" not in names
    refused = run_sub("merge", url, tmp_path / "m", cwd=workdir)
    assert refused.returncode == 2 and "incomplete" in refused.stderr
    again = run_sub("-v", "convert", hf, url, "--tp", "2", cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert "left incomplete by a run" in again.stderr
    assert "killed/.shardkit-writing" not in keys(bucket, "killed/")
    assert verify(hf, url).ok
    assert not list(workdir.iterdir())


def _marker(bucket: str, prefix: str, host: str, pid: int) -> None:
    s3.client().put_object(Bucket=bucket, Key=f"{prefix}/.shardkit-writing", Body=f"{host} {pid}\n".encode())


def test_prefix_written_by_a_running_process_is_refused_even_with_overwrite(tiny_model, bucket, tmp_path, workdir):
    """A prefix whose marker names a process of this host that still runs is another run's
    output in the making: --overwrite does not take it over (it would mix two runs' objects);
    once that process is gone, the next run removes what it left."""
    import socket

    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/busy"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _marker(bucket, "busy", socket.gethostname(), other.pid)
        s3.client().put_object(Bucket=bucket, Key="busy/model/part.pt", Body=b"theirs")
        refused = run_sub("convert", hf, url, "--tp", "2", "--overwrite", cwd=workdir)
        assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert f"process {other.pid}" in refused.stderr and "still runs" in refused.stderr
        assert keys(bucket, "busy/") == ["busy/.shardkit-writing", "busy/model/part.pt"]  # untouched
    finally:
        other.kill()
        other.wait()
    again = run_sub("-v", "convert", hf, url, "--tp", "2", cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert "left incomplete by a run" in again.stderr and "busy/model/part.pt" not in keys(bucket, "busy/")
    assert verify(hf, url).ok


def test_prefix_left_by_a_failed_write_of_this_process_is_cleaned_up(tiny_model, bucket, workdir, caplog):
    """A marker naming this very process, which is not writing that prefix now (an earlier write
    of it failed and could not remove its objects): the next write removes them, saying so."""
    import socket

    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    _marker(bucket, "mine", socket.gethostname(), os.getpid())
    s3.client().put_object(Bucket=bucket, Key="mine/model/part.pt", Body=b"left")
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        convert(hf, f"s3://{bucket}/mine", shardkit.make_layout(tp=2))
    assert "left incomplete by a run" in caplog.text
    assert "mine/model/part.pt" not in keys(bucket, "mine/")
    assert verify(hf, f"s3://{bucket}/mine").ok


def test_claim_of_a_prefix_is_atomic(tiny_model, bucket, workdir, monkeypatch):
    """Two runs that both found the prefix free: the marker's conditional PUT lets one write; the
    other is refused in one line and touches nothing (not even the winner's marker)."""
    from shardkit.errors import DestinationExistsError
    from shardkit.io import upload

    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    _marker(bucket, "raced", "other-host", 4242)  # the winner's, put just after this run checked
    monkeypatch.setattr(upload, "check_destination", lambda loc, overwrite, sources, patterns: [])
    with pytest.raises(DestinationExistsError, match="process 4242 on other-host, which began while"):
        shardkit.convert(hf, f"s3://{bucket}/raced", shardkit.make_layout(tp=2))
    assert keys(bucket, "raced/") == ["raced/.shardkit-writing"]
    body = s3.client().get_object(Bucket=bucket, Key="raced/.shardkit-writing")["Body"].read()
    assert body == b"other-host 4242\n"
    no_mirrors_left()


def test_two_runs_started_on_one_prefix_at_once(tiny_model, bucket, tmp_path, workdir):
    """Started together: exactly one writes the output (the other is refused, exit 2), and the
    output is the model, whole."""
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/both"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "shardkit", "convert", str(hf), url, "--tp", str(tp)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=workdir,
        )
        for tp in (2, 4)
    ]
    results = [(p.wait(), p.communicate()[1]) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "being written by" in refused or "exists and is not empty" in refused, refused
    assert ".shardkit-writing" not in " ".join(keys(bucket, "both/"))
    assert verify(hf, url).ok


def test_terminated_upload_removes_what_it_uploaded(tiny_model, bucket, workdir):
    """SIGTERM while a part of a multipart upload is on its way: the uploads are cancelled (their
    multipart uploads aborted), the objects already up deleted, the local staging folder removed."""
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/terminated"
    code = (
        "import sys, time\n"
        "from shardkit.io import s3\n"
        "s3.PART_SIZE = 5 << 20\n"
        "def part_sent(**kwargs):\n"
        "    print('UPLOADING', flush=True); time.sleep(0.5)\n"
        "s3.client().meta.events.register('before-call.s3.UploadPart', part_sent)\n"
        f"sys.argv = ['shardkit', 'convert', {str(hf)!r}, {url!r}, '--tp', '2']\n"
        "from shardkit.cli import main; main()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir
    )
    assert proc.stdout is not None and proc.stderr is not None
    for line in proc.stdout:
        if "UPLOADING" in line:
            break
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read()
    assert proc.wait(60) != 0
    assert len(err.strip().splitlines()) == 1, err
    assert not keys(bucket, "terminated/")
    assert not s3.client().list_multipart_uploads(Bucket=bucket, Prefix="terminated/").get("Uploads", [])
    assert not list(workdir.iterdir())


# ---- training checkpoints ------------------------------------------------------------------------------


def test_checkpoint_save_list_reshard_export(bucket, tmp_path, workdir, monkeypatch):
    config = fixture_config(CONFIG)
    state = ckpt_child.full_state(config, 100, seed=1)
    root = f"s3://{bucket}/run1"
    _save(root, "step_100", TP2PP2, config, state, 100)
    _save(root, "step_200", TP2PP2, config, state, 200, num_kept=1)
    finalize_checkpoint()
    names = keys(bucket, "run1/")
    assert "run1/step_200/done" in names and "run1/step_200/checkpoint" in names
    assert "run1/step_200/model/dp_rank_00_tp_rank_01_pp_rank_01.pt" in names
    assert any(n.startswith("run1/step_200/optim/") for n in names)
    assert not any(n.startswith("run1/step_100/") for n in names)  # retention on the prefix
    assert not any("shardkit-owner" in n for n in names)
    infos = list_checkpoints(root)
    assert [(i.tag, i.complete) for i in infos] == [("step_200", True)]

    res = run("ckpt", "list", root, "--json")
    assert res.exit_code == 0 and json.loads(res.output)["latest"] == "step_200"
    res = run("ckpt", "reshard", root, f"{root}/inner", "--tp", "1", "--pp", "1")
    assert res.exit_code == 2 and "overlaps" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    fetched = _fetched(monkeypatch)
    res = run("merge", root, tmp_path / "m")  # a checkpoint root: refused before any tag is fetched
    assert res.exit_code == 2 and f"`shardkit ckpt export {root} OUT`" in res.stderr, res.stderr
    assert fetched[-1][0] < 100_000, fetched
    dst = f"s3://{bucket}/run1-tp1"
    res = run("ckpt", "reshard", root, dst, "--tp", "1", "--pp", "1")
    assert res.exit_code == 0, res.output
    assert f"{bucket}/run1-tp1/step_200/done".split("/", 1)[1] in keys(bucket, "run1-tp1/")
    loaded = load_checkpoint(dst, "latest_if_exists", target_layout=TP2PP2, rank=(1, 1))
    direct = load_checkpoint(root, "latest_if_exists", target_layout=TP2PP2, rank=(1, 1))
    assert loaded is not None and direct is not None
    for name, t in direct.model.items():
        assert torch.equal(loaded.model[name], t), name
    out = tmp_path / "exported"
    res = run("ckpt", "export", dst, out)
    assert res.exit_code == 0, res.output
    full = tmp_path / "hf"
    from safetensors.torch import save_file

    full.mkdir()
    save_file({k: v.contiguous() for k, v in state["weight"].items()}, str(full / "model.safetensors"))
    (full / "config.json").write_text(json.dumps(config))
    assert verify(full, out).ok
    assert not list(workdir.iterdir())
    no_mirrors_left()


def test_checkpoint_files_upload_as_they_close(bucket, monkeypatch):
    """A save to object storage uploads each rank file as it is closed: what is left for the end
    is the markers, the manifest and config.json."""
    from shardkit.checkpoint import s3_tags as ckpt_remote

    swept: list[str] = []
    upload_tree = ckpt_remote.upload_tree

    def recording(local, loc, *args, **kwargs):
        swept.extend(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        return upload_tree(local, loc, *args, **kwargs)

    monkeypatch.setattr(ckpt_remote, "upload_tree", recording)
    config = fixture_config(CONFIG)
    _save(f"s3://{bucket}/streamed", "step_1", TP2PP2, config, ckpt_child.full_state(config, 1, seed=1), 1)
    names = keys(bucket, "streamed/step_1/")
    assert len([n for n in names if "/model/" in n]) == 4 and len([n for n in names if "/optim/" in n]) == 4
    assert "done" in swept and "shardkit.json" in swept
    assert not [n for n in swept if n.startswith(("model/", "optim/"))], swept  # each went up as it closed


def test_killed_checkpoint_upload_lists_incomplete_and_next_save_removes_it(bucket, workdir, caplog):
    import logging

    from shardkit.checkpoint.s3_tags import staging_root

    config = fixture_config(CONFIG)
    state = ckpt_child.full_state(config, 100, seed=1)
    root = f"s3://{bucket}/run2"
    _save(root, "step_100", TP2PP2, config, state, 100)
    finalize_checkpoint()
    # a save killed while a part of a multipart upload is on its way
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'tests' / 'support')!r}); import ckpt_child\n"
        f"ckpt_child.s3_save_killed_while_uploading({root!r}, 'step_200', 200)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=workdir)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "UPLOADING" in line or "SAVED" in line:
            break
    proc.kill()
    proc.wait()
    assert "SAVED" not in line
    names = keys(bucket, "run2/step_200/")
    assert "run2/step_200/.shardkit-owner" in names and "run2/step_200/done" not in names
    open_uploads = s3.client().list_multipart_uploads(Bucket=bucket, Prefix="run2/").get("Uploads", [])
    assert open_uploads, "the kill came while a multipart upload was open"
    staged = staging_root(s3_loc(root))
    assert (staged / "step_200").is_dir()  # the killed save's local copy

    infos = {i.tag: i for i in list_checkpoints(root)}
    assert infos["step_200"].complete is False and infos["step_100"].complete
    loaded = load_checkpoint(root, "latest_if_exists", target_layout=TP2PP2, rank=(0, 0))
    assert loaded is not None and loaded.step == 100
    res = run("ckpt", "prune", root, "--keep", "5", "--dry-run", "--json")
    assert res.exit_code == 0 and "step_200" in json.loads(res.output)["remove"]
    with caplog.at_level(logging.WARNING):
        _save(root, "step_300", TP2PP2, config, state, 300)
        finalize_checkpoint()
    assert "step_200" in caplog.text and "no longer runs" in caplog.text  # the next save says so
    assert not keys(bucket, "run2/step_200/")
    assert not s3.client().list_multipart_uploads(Bucket=bucket, Prefix="run2/").get("Uploads", [])
    assert not list(staged.iterdir()) or [p.name for p in staged.iterdir()] == [".shardkit.lock"]
    assert [i.tag for i in list_checkpoints(root)] == ["step_100", "step_300"]


def test_failed_save_leaves_no_partial_tag(bucket, monkeypatch):
    """A save that fails, while writing or while uploading, leaves no objects of its tag (a tag of
    that name it replaces is gone, as a local save replaces it) and no local copy; the other tags
    stay."""
    from shardkit.checkpoint import save as ckpt_save
    from shardkit.checkpoint.s3_tags import staging_root
    from shardkit.errors import ShardkitError

    config = fixture_config(CONFIG)
    state = ckpt_child.full_state(config, 100, seed=1)
    root = f"s3://{bucket}/run3"
    _save(root, "step_100", TP2PP2, config, state, 100)
    before = keys(bucket, "run3/")
    staged = staging_root(s3_loc(root))

    def full_disk(job):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(ckpt_save, "write_rank_files", full_disk)
        with pytest.raises(ShardkitError, match="no space left on the disk") as failed:
            _save(root, "step_100", TP2PP2, config, state, 100)
    assert "\n" not in str(failed.value)
    assert not keys(bucket, "run3/step_100/") and not (staged / "step_100").exists()
    _save(root, "step_100", TP2PP2, config, state, 100)
    assert keys(bucket, "run3/") == before

    uploads = [0]
    upload = s3.Uploader.upload

    def failing(self, path, loc, name, remove=False):
        uploads[0] += 1
        if uploads[0] == 3:
            raise s3.RemoteError(f"cannot upload to {loc}/{name}: injected")
        return upload(self, path, loc, name, remove)

    with monkeypatch.context() as m:
        m.setattr(s3.Uploader, "upload", failing)
        with pytest.raises(ShardkitError, match="injected"):
            _save(root, "step_200", TP2PP2, config, state, 200)
    assert uploads[0] == 3
    assert keys(bucket, "run3/") == before  # what step_200 had uploaded is gone
    assert not (staged / "step_200").exists()
    assert [(i.tag, i.complete) for i in list_checkpoints(root)] == [("step_100", True)]


def test_save_from_several_hosts_uploads_every_hosts_files(bucket, tmp_path):
    """Each host stages its own ranks' files on its own disk: the first rank of each host uploads
    them, and `done` goes up only once every host is done."""
    import multiprocessing

    url = f"s3://{bucket}/hosts"
    env = {k: os.environ[k] for k in [*ENV, "AWS_ENDPOINT_URL"]}
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    tmps = [tmp_path / f"host-{r}" for r in range(2)]
    procs = []
    for rank, tmp in enumerate(tmps):
        tmp.mkdir()
        procs.append(spawn.Process(target=ckpt_child.s3_host_worker, args=(rank, 2, port, url, str(tmp), env)))
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    names = keys(bucket, "hosts/step_100/")
    for tp in (0, 1):
        assert f"hosts/step_100/model/dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt" in names
        assert f"hosts/step_100/optim/dp_rank_00_tp_rank_{tp:02d}_pp_rank_00.pt" in names
    assert "hosts/step_100/done" in names and not any("shardkit-owner" in n for n in names)
    assert [(i.tag, i.complete) for i in list_checkpoints(url)] == [("step_100", True)]
    for tmp in tmps:  # each host's staging root keeps nothing of the tag once it is up
        assert not [p for p in tmp.rglob("*") if p.is_file() and p.name != ".shardkit.lock"], list(tmp.rglob("*"))


# ---- the trainer -------------------------------------------------------------------------------------


def test_trainer_saves_to_and_resumes_from_s3(tiny_model, bucket, tmp_path, workdir, caplog):
    import logging

    from trainer_helpers import COMMON

    from trainer.__main__ import main

    hf = tiny_model("tinyllama-mini")
    model_url = f"s3://{bucket}/base"
    convert(hf, model_url, shardkit.make_layout(tp=2, pp=1))
    tokens = tmp_path / "tokens.bin"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "prepare_data.py"),
            str(ROOT / "fixtures" / "tiny-corpus.txt"),
            "--out",
            str(tokens),
        ],
        check=True,
    )
    ckpt = f"s3://{bucket}/train"
    args = [
        "--model",
        model_url,
        "--data",
        str(tokens),
        *COMMON,
        "--checkpoint-dir",
        ckpt,
        "--checkpoint-every",
        "1",
        "--num-kept",
        "2",
        "--resume",
        "latest_if_exists",
    ]
    assert main([*args, "--steps", "2"]) == 0
    assert [i.tag for i in list_checkpoints(ckpt)] == ["step_1", "step_2"]
    assert "train/step_2/done" in keys(bucket, "train/")
    with caplog.at_level(logging.INFO):
        assert main([*args, "--steps", "3", "--override-schedule"]) == 0
    assert "resumed from" in caplog.text and "step 2" in caplog.text
    assert [i.tag for i in list_checkpoints(ckpt)] == ["step_2", "step_3"]
    assert not list(workdir.iterdir())


def test_a_killed_runs_mirror_is_removed_by_the_next_and_no_other(tmp_path, monkeypatch):
    """A mirror folder whose owner is a process of this host that has ended goes when the next
    mirror opens; a running process's, another host's, and a folder without an owner stay."""
    disk, memory = tmp_path / "tmp", tmp_path / "shm"
    disk.mkdir()
    memory.mkdir()
    monkeypatch.setattr(remote.tempfile, "tempdir", str(disk))
    monkeypatch.setattr(remote, "MEMORY_DIR", str(memory))
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = socket.gethostname()
    owners = {
        "dead": (disk, f"{host} {ended.pid}\n"),
        "dead-in-memory": (memory, f"{host} {ended.pid}\n"),
        "running": (disk, f"{host} {os.getppid()}\n"),
        "mine": (disk, f"{host} {os.getpid()}\n"),
        "other-host": (disk, f"{host}-elsewhere {ended.pid}\n"),
        "garbled": (disk, "not an owner\n"),
        "no-owner": (disk, None),
    }
    for name, (base, text) in owners.items():
        folder = base / f"shardkit-{os.getuid()}" / f"{remote.MIRROR_PREFIX}{name}"
        (folder / "root").mkdir(parents=True)
        (folder / "root" / "w.safetensors").write_bytes(b"x" * 100)
        if text is not None:
            (folder / ".shardkit-owner").write_text(text)
    remote._remove_stale()
    mine = [base / f"shardkit-{os.getuid()}" for base in (disk, memory)]
    left = sorted(p.name[len(remote.MIRROR_PREFIX) :] for base in mine for p in base.iterdir())
    assert left == ["garbled", "mine", "no-owner", "other-host", "running"]
