"""Writing to s3:// (moto's server on loopback, tests/support/s3_fixtures.py): outputs upload as
their files close (each to its own prefix, however many are written at once), the next file goes
up while the store completes the last, and the commit protocol without rename: an interrupted or
terminated upload never lists as complete and is cleaned up, a prefix another running process
writes is refused, claims of a prefix are atomic.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[s3]')")

from s3_helpers import (  # noqa: E402
    keys,
    kill_while_uploading,
    no_mirrors_left,
    own_temporary_folder,  # noqa: F401 - autouse: each test its own temporary folder
    run,
    run_sub,
    s3_loc,
)

import shardkit  # noqa: E402
from shardkit.api import convert, verify  # noqa: E402
from shardkit.io.objects import s3, upload  # noqa: E402


def _hf_tensors(hf: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return [t for f in hf.glob("*.safetensors") for t in load_file(f).values()]


def test_outputs_upload_as_their_files_close(tiny_model, bucket, workdir, monkeypatch):
    """Each shard goes up as soon as it is written (the sink of the staging folder), and the local
    copy holds only the files in flight, never the whole output."""
    from shardkit.io.objects import upload

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


@pytest.mark.slow  # kill -9 while uploading: in the main suite, test_safety_s3's killed overwrite
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


def test_prefix_left_by_a_failed_write_of_this_process_is_cleaned_up(tiny_model, bucket, tmp_path, workdir, caplog):
    """A marker naming this very process, which is not writing that prefix now (an earlier write
    of it failed and could not remove its objects): a read of it is refused as incomplete; the
    next write removes them, saying so."""
    import socket

    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    _marker(bucket, "mine", socket.gethostname(), os.getpid())
    s3.client().put_object(Bucket=bucket, Key="mine/model/part.pt", Body=b"left")
    refused = run("merge", f"s3://{bucket}/mine", tmp_path / "m")
    assert refused.exit_code == 2 and "incomplete" in refused.stderr, refused.stderr
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        convert(hf, f"s3://{bucket}/mine", shardkit.make_layout(tp=2))
    assert "left incomplete by a run" in caplog.text
    assert "mine/model/part.pt" not in keys(bucket, "mine/")
    assert verify(hf, f"s3://{bucket}/mine").ok


def test_a_prefix_another_thread_of_this_process_writes_is_refused(bucket, tmp_path):
    """Two threads of one process writing one prefix: the second is refused in one line (this
    host's write lock on the prefix is held), touching nothing; once the first is done, the prefix
    is free again."""
    from shardkit.errors import DestinationExistsError
    from shardkit.io.location import parse_location

    loc = parse_location(f"s3://{bucket}/threads")
    inside, release, failures = threading.Event(), threading.Event(), []

    def first() -> None:
        try:
            with upload.remote_output(loc) as (local, _):
                local.mkdir(parents=True)
                (local / "a.txt").write_text("first")
                inside.set()
                release.wait(30)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            failures.append(e)
            inside.set()

    writer = threading.Thread(target=first)
    writer.start()
    try:
        assert inside.wait(30) and not failures, failures
        with pytest.raises(DestinationExistsError, match="being written by another run of this host"):
            with upload.remote_output(loc, overwrite=True):
                pass
        assert keys(bucket, "threads/") == ["threads/.shardkit-writing"]  # the first's marker, untouched
    finally:
        release.set()
        writer.join(30)
    assert not failures, failures
    assert "threads/a.txt" in keys(bucket, "threads/")
    with upload.remote_output(loc, overwrite=True) as (local, _):
        local.mkdir(parents=True)
        (local / "a.txt").write_text("second")
    assert s3.client().get_object(Bucket=bucket, Key="threads/a.txt")["Body"].read() == b"second"


def test_two_outputs_written_at_once_each_upload_their_own_files_only(bucket, tmp_path):
    """Two outputs of one process written at the same time, and a local one beside them: each
    file goes up, as it closes, to the prefix of the output whose sink its writer was given, and
    to no other; a sink ignores a file of another output's folder; the local file goes nowhere."""
    from shardkit.io.data.hashing import HashingFile
    from shardkit.io.location import parse_location

    a, b = parse_location(f"s3://{bucket}/a"), parse_location(f"s3://{bucket}/b")
    with upload.remote_output(a) as (local_a, sink_a), upload.remote_output(b) as (local_b, sink_b):
        for i in range(3):
            for local, sink, name in ((local_a, sink_a, "a"), (local_b, sink_b, "b")):
                out = HashingFile(local / f"{name}{i}.bin", local, sink=sink)
                out.write(name.encode() * (i + 1))
                out.close()
            mine = HashingFile(tmp_path / "local" / f"local{i}.bin", tmp_path / "local")
            mine.write(b"local")
            mine.close()
        sink_a.closed(local_b / "b0.bin")  # not a file of its folder: never sent
        sink_a.drain()
        sink_b.drain()
        assert sink_a.names == ["a0.bin", "a1.bin", "a2.bin"] and sink_b.names == ["b0.bin", "b1.bin", "b2.bin"]
    assert [k for k in keys(bucket, "a/") if not k.startswith("a/.")] == ["a/a0.bin", "a/a1.bin", "a/a2.bin"]
    assert [k for k in keys(bucket, "b/") if not k.startswith("b/.")] == ["b/b0.bin", "b/b1.bin", "b/b2.bin"]
    assert s3.client().get_object(Bucket=bucket, Key="b/b2.bin")["Body"].read() == b"bbb"
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["local0.bin", "local1.bin", "local2.bin"]
    assert not [k for k in keys(bucket, "") if "local" in k]


def test_claim_of_a_prefix_is_atomic(tiny_model, bucket, workdir, monkeypatch):
    """Two runs that both found the prefix free: the marker's conditional PUT lets one write; the
    other is refused in one line and touches nothing (not even the winner's marker)."""
    from shardkit.errors import DestinationExistsError
    from shardkit.io.objects import upload

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
        "from shardkit.io.objects import s3\n"
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
