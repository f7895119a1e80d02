"""Training checkpoints and the trainer on s3:// (moto's server on loopback,
tests/support/s3_fixtures.py): save, list, reshard and export from a bucket, files uploading as they
close, a killed upload listed incomplete and removed by the next save, no partial tag after a failed
save, saves from several hosts; the trainer saving to and resuming from a bucket, and a killed run's
mirror removed by the next run and no other.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[s3]')")

import ckpt_child  # noqa: E402
from s3_fixtures import ENV, free_port  # noqa: E402
from s3_helpers import (  # noqa: E402
    CONFIG,
    TP2PP2,
    _fetched,
    _save,
    keys,
    no_mirrors_left,
    own_temporary_folder,  # noqa: F401 - autouse: each test its own temporary folder
    run,
    s3_loc,
)

import shardkit  # noqa: E402
from shardkit.api import convert, verify  # noqa: E402
from shardkit.checkpoint import finalize_checkpoint, list_checkpoints, load_checkpoint  # noqa: E402
from shardkit.io.objects import remote, s3  # noqa: E402
from shardkit.testing import fixture_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


# ---- training checkpoints ------------------------------------------------------------------------------


def test_checkpoint_save_list_reshard_export(bucket, tmp_path, workdir, monkeypatch):
    config = fixture_config(CONFIG) | {"num_hidden_layers": 4}  # the checkpoint's size is not the point here
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
    from shardkit.io.store import S3Prefix

    swept: list[str] = []
    upload_tree = S3Prefix.upload_tree

    def recording(self, local, *args, **kwargs):
        swept.extend(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
        return upload_tree(self, local, *args, **kwargs)

    monkeypatch.setattr(S3Prefix, "upload_tree", recording)
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


def test_trainer_saves_to_and_resumes_from_s3(small_model, bucket, tmp_path, workdir, caplog):
    import logging

    from trainer_helpers import COMMON

    from trainer.__main__ import main

    hf = small_model()
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
