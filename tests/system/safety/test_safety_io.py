"""The I/O core against attackers and unlucky users: the folder lock through links, overlaps and
deletes through bind mounts, full disks on every writer, `ckpt reshard`'s transaction (flipped
bits, aliases, kills, a source changed while read, broken destinations, a second run), retention
that never counts damaged tags, small files that are FIFOs, devices or huge, and names that
break lines or file systems. One test per attack or fault; mounts need root (skipped otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from safety_helpers import (
    CONFIG,
    LAYOUT,
    MODEL_FILE,
    ckpt_of_two,
    leftovers,
    one_line_error,
    pieces,
    precious_folder,
    run,
    save,
    snapshot,
    tags,
    tree_digest,
)

import shardkit.api as api
from shardkit.checkpoint import Checkpointer, load_checkpoint, prune_checkpoints, save_checkpoint
from shardkit.checkpoint import reshard as ckpt_reshard
from shardkit.cli import cli
from shardkit.errors import ShardkitError
from shardkit.io.safety.lock import lock_destination
from shardkit.io.safety.transaction import recover_interrupted
from shardkit.layout import Layout

REPO = Path(__file__).resolve().parents[3]


# ---- helpers --------------------------------------------------------------------------------------


def _root_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a bind mount or tmpfs needs root")


@contextlib.contextmanager
def mounted(*args: str):
    """`mount ARGS... TARGET` for the block (the last argument is the mount point); unmounted after."""
    _root_or_skip()
    target = args[-1]
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here ({done.stderr.strip()})")
    try:
        yield Path(target)
    finally:
        subprocess.run(["umount", "-l", target], capture_output=True)


def tiny_disk(path: Path, size: str, *options: str):
    """A tmpfs of `size` at `path` (a full disk that really is one)."""
    path.mkdir(parents=True, exist_ok=True)
    return mounted("-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path))


def stray(folder: Path) -> list[str]:
    """What shardkit may never leave beside an output: staging, scratch, lock and old folders."""
    return leftovers(folder)


# ---- 1. the folder lock ------------------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return ckpt_of_two(tmp_path)


def test_a_lock_file_hard_linked_to_a_victim_is_refused_and_never_written(ckpt, tmp_path):
    victim = ckpt / "victim.txt"  # a hard link needs the same file system
    victim.write_text("the user's notes\n")
    lock = ckpt / ".shardkit.lock"
    lock.unlink(missing_ok=True)
    os.link(victim, lock)
    one_line_error(run("ckpt", "prune", ckpt, "--keep", "1"), "hard link")
    with pytest.raises(ShardkitError, match="hard link"):
        save(ckpt, 3, Checkpointer())
    assert victim.read_text() == "the user's notes\n" and tags(ckpt) == [("step_1", True), ("step_2", True)]


def test_a_lock_file_that_is_a_symlink_is_refused_and_never_followed(ckpt, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    lock = ckpt / ".shardkit.lock"
    lock.unlink(missing_ok=True)
    lock.symlink_to(victim)
    one_line_error(run("ckpt", "prune", ckpt, "--keep", "1"), "symlink")
    assert victim.read_text() == "keep me\n" and len(tags(ckpt)) == 2


def test_a_second_run_into_the_same_destination_is_told_who_writes_it(tiny_model, tmp_path):
    dst = tmp_path / "out"
    holder = lock_destination(dst, "a convert that is still running")
    try:
        line = one_line_error(run("convert", tiny_model("llama-mha"), dst, "--tp", "2"), "in use by")
        assert f"pid {os.getpid()}" in line and "still running" in line
        assert not dst.exists()
    finally:
        holder.release()
    assert run("convert", tiny_model("llama-mha"), dst, "--tp", "2").exit_code == 0
    assert stray(tmp_path) == []  # the lock file is gone with its run


# ---- 2. bind mounts ------------------------------------------------------------------------------------


def test_a_bind_mount_alias_of_the_source_is_refused(tiny_model, tmp_path):
    real, alias = tmp_path / "P", tmp_path / "A"
    shutil.copytree(tiny_model("llama-mha"), real / "inner" / "src")
    alias.mkdir()
    before = tree_digest(real)
    with mounted("--bind", str(real), str(alias)):
        # A/inner is P/inner under another name: replacing it would delete the source
        one_line_error(run("convert", real / "inner" / "src", alias / "inner", "--tp", "2", "--overwrite"), "overlaps")
        one_line_error(
            run("merge", alias / "inner" / "src", real / "inner", "--overwrite", "--dtype", "bf16"), "overlaps"
        )  # a re-save (same model: refused first)
    assert tree_digest(real) == before


def test_prune_never_deletes_the_files_of_a_folder_mounted_inside_an_old_tag(ckpt, tmp_path):
    precious = precious_folder(tmp_path / "data")
    before = snapshot(precious)
    mount_point = ckpt / "step_1" / "model" / "mnt"
    mount_point.mkdir()
    with mounted("--bind", str(precious), str(mount_point)):
        plan = prune_checkpoints(ckpt, num_kept=1)
        assert "step_1" in plan.failed and "mount point" in plan.failed["step_1"]
        assert snapshot(precious) == before and (ckpt / "step_1" / "done").exists()  # refused before deleting
    assert snapshot(precious) == before
    assert prune_checkpoints(ckpt, num_kept=1).removed == ["step_1"]  # once unmounted, it goes


# ---- 3. full disks ---------------------------------------------------------------------------------------


def _cli_writers(model: Path, shards: Path, ckpt: Path, out: Path) -> dict[str, list]:
    return {
        "convert": ["convert", model, out, "--tp", "2"],
        "merge": ["merge", shards, out],
        "reshard": ["reshard", shards, out, "--tp", "1"],
        "ckpt reshard": ["ckpt", "reshard", ckpt, out, "--tp", "1"],
        "ckpt export": ["ckpt", "export", ckpt, out],
    }


@pytest.fixture(scope="module")
def sources(tiny_model, tmp_path_factory):
    """A Hugging Face model, its tp2 shards and a training checkpoint, built once."""
    base = tmp_path_factory.mktemp("full-disk")
    model = tiny_model("llama-mha")
    api.convert(model, base / "shards", Layout(tp=2))
    return model, base / "shards", ckpt_of_two(base)


@pytest.mark.parametrize("writer", ["convert", "merge", "reshard", "ckpt reshard", "ckpt export"])
def test_a_full_disk_is_one_line_and_leaves_nothing_on_it(sources, tmp_path, writer):
    model, shards, ckpt = sources
    with tiny_disk(tmp_path / "disk", "256k") as disk:
        args = _cli_writers(model, shards, ckpt, disk / "out")[writer]
        one_line_error(run(*args), "no space left")
        assert sorted(os.listdir(disk)) == []  # no staging, lock, scratch or half-written output


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_under_save_checkpoint_is_one_line_and_leaves_no_tag(tmp_path, async_save):
    with tiny_disk(tmp_path / "disk", "256k") as disk:
        with Checkpointer() as ck, pytest.raises(ShardkitError, match="(?i)no space left") as e:
            save(disk, 1, ck, async_save=async_save)
        assert len(str(e.value).splitlines()) == 1 and "enforce fail" not in str(e.value)
        assert [p for p in os.listdir(disk) if not p.startswith(".shardkit.lock")] == []


def test_a_read_only_destination_is_one_line_for_ckpt_reshard(sources, tmp_path):
    _, _, ckpt = sources
    with tiny_disk(tmp_path / "ro", "1m", "ro") as ro:
        one_line_error(run("ckpt", "reshard", ckpt, ro / "out", "--tp", "1"), "Read-only")


# ---- 4. ckpt reshard's transaction ---------------------------------------------------------------------


def test_ckpt_reshard_refuses_a_source_with_a_flipped_bit(ckpt, tmp_path):
    path = ckpt / "step_2" / MODEL_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    one_line_error(run("ckpt", "reshard", ckpt, tmp_path / "out", "--tp", "1"), "does not match", "xxh3_128")
    assert not (tmp_path / "out").exists() and stray(tmp_path) == []


@pytest.mark.parametrize("where", ["step_2/model/x", "step_2", "."])
def test_ckpt_reshard_never_writes_inside_its_source(ckpt, where):
    before = snapshot(ckpt)
    one_line_error(run("ckpt", "reshard", ckpt, ckpt / where, "--tp", "1"), "overlaps")
    assert snapshot(ckpt) == before


def test_ckpt_reshard_refuses_a_dangling_symlink_destination(ckpt, tmp_path):
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    one_line_error(run("ckpt", "reshard", ckpt, tmp_path / "out", "--tp", "1"), "symlink")
    assert not (tmp_path / "nowhere").exists()


def test_ckpt_reshard_refuses_a_second_run_into_the_same_destination(ckpt, tmp_path):
    holder = lock_destination(tmp_path / "out", "ckpt reshard")
    try:
        one_line_error(run("ckpt", "reshard", ckpt, tmp_path / "out", "--tp", "1"), "in use by")
    finally:
        holder.release()


def test_ckpt_reshard_refuses_a_tag_pruned_while_it_is_read(ckpt, tmp_path, monkeypatch):
    real = ckpt_reshard.write_rank

    def prune_meanwhile(*args, **kwargs):
        (ckpt / "step_2" / "user_content.pt").unlink(missing_ok=True)
        (ckpt / "step_2" / "done").unlink(missing_ok=True)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_reshard, "write_rank", prune_meanwhile)
    one_line_error(run("ckpt", "reshard", ckpt, tmp_path / "out", "--tp", "1", "--tag", "step_2"), "changed while")
    assert not (tmp_path / "out").exists() and stray(tmp_path) == []


KILLED = r"""
import random, sys, time
from shardkit.checkpoint import reshard
real, rng = reshard.write_rank, random.Random(int(sys.argv[3]))
def slow(*args, **kwargs):
    print("writing", flush=True)
    time.sleep(rng.uniform(0.0, 0.3))  # killed before, inside or after the rank files
    return real(*args, **kwargs)
reshard.write_rank = slow
from shardkit.cli import main
sys.argv = ["shardkit", "ckpt", "reshard", sys.argv[1], sys.argv[2], "--tp", "1"]
main()
"""


@pytest.mark.slow  # each kill starts a Python with torch
def test_ckpt_reshard_killed_again_and_again_leaves_nothing_a_rerun_does_not_remove(ckpt, tmp_path, caplog):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    rng = random.Random(11)
    killed = []
    for round_ in range(6):
        child = subprocess.Popen(
            [sys.executable, "-c", KILLED, str(ckpt), str(out), str(round_)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "writing"
        time.sleep(0.0 if round_ == 0 else rng.uniform(0.0, 0.2))  # the first kill surely before the commit
        sig = signal.SIGKILL if round_ % 2 == 0 else signal.SIGTERM
        child.send_signal(sig)
        child.wait(30)
        if out.exists():  # the kill came after the commit: then the output is whole
            assert load_checkpoint(out, "step_2").step == 2
            break
        left = [n for n in stray(tmp_path) if "shardkit-tmp" in n]
        if sig == signal.SIGTERM:
            assert left == [], left  # Ctrl-C and SIGTERM clean up themselves
        else:
            killed.append(child.pid)
            assert left == [f".out.shardkit-tmp-{child.pid}"], left
            with caplog.at_level(logging.WARNING, logger="shardkit"):
                recover_interrupted(out)  # what the next run does first, saying so
            assert f"left by a run (process {child.pid}) that no longer runs" in caplog.text
    if not out.exists():
        result = run("ckpt", "reshard", ckpt, out, "--tp", "1")
        assert result.exit_code == 0, result.output
    assert stray(tmp_path) == [] and load_checkpoint(out, "step_2").step == 2
    assert killed, "no SIGKILL landed"


# ---- 5. retention counts only sound tags ----------------------------------------------------------------


def test_retention_never_counts_a_tag_whose_files_fail_the_manifests_size_check(ckpt):
    path = ckpt / "step_2" / MODEL_FILE
    path.write_bytes(path.read_bytes()[:1000])  # the newest tag's model file is truncated
    result = CliRunner().invoke(cli, ["ckpt", "prune", str(ckpt), "--keep", "1"])
    assert result.exit_code == 0, result.output
    assert tags(ckpt) == [("step_1", True), ("step_2", True)]  # the loadable older tag is kept
    loaded = load_checkpoint(ckpt, "latest_if_exists")
    assert loaded is not None and loaded.tag == "step_1"
    listed = json.loads(CliRunner().invoke(cli, ["ckpt", "list", str(ckpt), "--json"]).stdout)
    assert listed["latest"] == "step_1" and [c["damaged"] for c in listed["checkpoints"]] == [False, True]


# ---- 6. small files: FIFOs, devices, huge ----------------------------------------------------------------


def _shardkit(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI in its own process, with a deadline: a test of a would-be hang must not hang."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_manifest_that_is_a_fifo_or_a_device_never_hangs_listing_or_pruning(ckpt, kind):
    manifest = ckpt / "step_2" / "shardkit.json"
    manifest.unlink()
    if kind == "fifo":
        os.mkfifo(manifest)
    else:
        manifest.symlink_to("/dev/zero")
    listed = _shardkit("ckpt", "list", ckpt, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {c["tag"]: c for c in json.loads(listed.stdout)["checkpoints"]}
    assert rows["step_2"]["damaged"] and "not a regular file" in rows["step_2"]["problem"]
    pruned = _shardkit("ckpt", "prune", ckpt, "--keep", "1")
    assert pruned.returncode == 0, pruned.stderr
    assert load_checkpoint(ckpt, "latest_if_exists").tag == "step_1"


@pytest.mark.parametrize("source", ["/dev/zero", "fifo", "huge"])
def test_a_param_order_file_that_is_a_device_fifo_or_huge_is_one_line(ckpt, tmp_path, source):
    path = Path(source)
    if source == "fifo":
        path = tmp_path / "order.json"
        os.mkfifo(path)
    elif source == "huge":
        path = tmp_path / "order.json"
        with open(path, "wb") as fh:
            fh.truncate(1 << 30)  # sparse: 1 GiB of nothing
    done = _shardkit("ckpt", "reshard", ckpt, tmp_path / "out", "--tp", "1", "--param-order", path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "param-order" in lines[0] and "internal error" not in lines[0], done.stderr


def test_a_config_that_is_a_fifo_is_one_line(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model("llama-mha"), model)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    done = _shardkit("inspect", model)  # answers at once: nothing waits on the FIFO
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    done = _shardkit(
        "convert", tiny_model("llama-mha"), tmp_path / "out", "--tp", "2", "--config", model / "config.json"
    )
    assert done.returncode == 2 and "not a regular file" in done.stderr and len(done.stderr.splitlines()) == 1


def test_an_unreadable_config_is_one_line(tiny_model, tmp_path, monkeypatch):
    real = os.open

    def denied(path, *args, **kwargs):
        if str(path).endswith("config.json"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    one_line_error(run("inspect", tiny_model("llama-mha")), "Permission denied")


# ---- 7. names ----------------------------------------------------------------------------------------------


def test_a_destination_name_with_a_newline_is_reported_on_one_line(tiny_model, tmp_path):
    dst = tmp_path / "two\nlines"
    holder = lock_destination(dst, "convert")
    try:
        line = one_line_error(run("convert", tiny_model("llama-mha"), dst, "--tp", "2"), "in use")
        assert "two\\nlines" in line
    finally:
        holder.release()


def test_a_tag_too_long_for_the_file_system_is_one_line(tmp_path):
    tag = "step_1_" + "x" * 300
    with pytest.raises(ShardkitError) as e:
        save_checkpoint(tmp_path / "ckpt", tag, pieces(1), layout=LAYOUT, config=CONFIG)
    assert len(str(e.value).splitlines()) == 1 and ("too long" in str(e.value) or "name" in str(e.value))
    assert not [p for p in (tmp_path / "ckpt").glob("*") if not p.name.startswith(".shardkit.lock")]


def test_an_index_naming_a_file_too_long_for_the_file_system_is_one_line(tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model("llama-mha"), model)
    long = "m" * 5000 + ".safetensors"
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": long}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line_error(run("convert", model, tmp_path / "out", "--tp", "2"), "long")


# ---- 8. push never publishes what a shard folder links to -------------------------------------------------


def test_push_of_shards_whose_tokenizer_links_to_a_secret_is_refused_before_any_hub_call(
    sources, tmp_path, monkeypatch
):
    _, shards, _ = sources
    folder = tmp_path / "shards"
    shutil.copytree(shards, folder)
    secret = tmp_path / "id_rsa"
    secret.write_text("-----BEGIN PRIVATE KEY-----\n")
    (folder / "tokenizer.json").symlink_to(secret)
    import importlib

    hub_push = importlib.import_module("shardkit.hub.push")

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was called")

    monkeypatch.setattr(hub_push, "check_repo", no_hub)
    one_line_error(run("push", folder, "me/model"), "symlink", "outside")


# ---- 9. the trainer's data ---------------------------------------------------------------------------------


def test_negative_token_ids_are_one_line(tiny_model, tmp_path, capsys):
    import numpy as np

    from trainer.__main__ import main

    data = tmp_path / "tokens.npy"
    np.save(data, np.array([5, 7, -3, 9] * 200, dtype=np.int64))
    model = tiny_model("llama-trainer-tiny")
    capsys.readouterr()  # building the model printed its own progress
    args = [
        "--model",
        str(model),
        "--data",
        str(data),
        "--seq-len",
        "16",
        "--global-batch",
        "2",
        "--steps",
        "1",
        "--checkpoint-dir",
        str(tmp_path / "c"),
    ]
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trainer")]
    assert len(err) == 1 and "negative token id" in err[0] and "Traceback" not in err[0], err


def test_the_token_file_writer_never_writes_through_a_link(tmp_path):
    from trainer.data import write_tokens

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "tokens.bin").symlink_to(victim)
    with pytest.raises(ShardkitError, match="symlink"):
        write_tokens(tmp_path / "tokens.bin", [1, 2, 3], 256)
    (tmp_path / "tokens.bin.tmp").symlink_to(victim)  # the old writer's temporary name: never opened now
    (tmp_path / "tokens.bin").unlink()
    write_tokens(tmp_path / "tokens.bin", [1, 2, 3], 256)
    assert victim.read_text() == "precious\n" and stray(tmp_path) == []


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_user_content_that_is_a_fifo_or_a_device_is_one_line_and_never_hangs(ckpt, kind):
    (ckpt / "step_2" / "shardkit.json").unlink()  # as NxD writes tags: no manifest lists the file
    path = ckpt / "step_2" / "user_content.pt"
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    code = (
        "import sys\n"
        "from shardkit.checkpoint import load_checkpoint\n"
        "from shardkit.errors import ShardkitError\n"
        "try:\n"
        f"    load_checkpoint({str(ckpt)!r}, 'step_2', verify=False)\n"
        "except ShardkitError as e:\n"
        "    print(e); sys.exit(2)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "not a regular file" in done.stdout and len(done.stdout.strip().splitlines()) == 1


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_under_the_trainers_checkpoints_is_one_line_and_leaves_no_tag(
    tiny_model, tmp_path, capsys, async_save
):
    import numpy as np

    from trainer.__main__ import main

    data = tmp_path / "tokens.npy"
    np.save(data, np.arange(4000, dtype=np.int64) % 200)
    model = tiny_model("llama-trainer-tiny")
    capsys.readouterr()
    with tiny_disk(tmp_path / "disk", "256k") as disk:
        args = [
            "--model",
            str(model),
            "--data",
            str(data),
            "--seq-len",
            "16",
            "--global-batch",
            "2",
            "--steps",
            "3",
            "--checkpoint-dir",
            str(disk / "ckpt"),
            "--checkpoint-every",
            "1",
            *(["--async-save"] if async_save else []),
        ]
        assert main(args) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("trainer")]
        assert len(err) == 1 and "no space left" in err[0].lower() and "enforce fail" not in err[0], err
        root = disk / "ckpt"
        left = [p.name for p in root.iterdir() if p.is_dir()] if root.exists() else []
        assert left == [], left  # no half-written tag (the metrics file is the run's own)


@pytest.mark.parametrize("name", ["user_content.pt", "shardkit.json", "config.json"])
def test_an_unreadable_file_of_a_tag_is_one_line(ckpt, tmp_path, monkeypatch, name):
    real = os.open

    def denied(path, *args, **kwargs):
        if str(path).endswith(f"step_2/{name}"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    line = one_line_error(run("ckpt", "reshard", ckpt, tmp_path / "out", "--tag", "step_2", "--tp", "1"))
    assert "Permission denied" in line or "damaged" in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # each kill starts a trainer (a Python with torch and transformers)
def test_the_trainer_killed_while_saving_again_and_again_always_resumes_from_a_sound_tag(tiny_model, tmp_path):
    import numpy as np

    from shardkit.checkpoint import list_checkpoints

    data = tmp_path / "tokens.npy"
    np.save(data, np.arange(4000, dtype=np.int64) % 200)
    model = tiny_model("llama-trainer-tiny")
    ckpt = tmp_path / "ckpt"
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def trainer(steps: int, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "trainer",
            "--model",
            str(model),
            "--data",
            str(data),
            "--seq-len",
            "16",
            "--global-batch",
            "2",
            "--steps",
            str(steps),
            "--checkpoint-dir",
            str(ckpt),
            "--checkpoint-every",
            "1",
            "--num-kept",
            "2",
            "--resume",
            "latest_if_exists",
            "--no-progress",
            "--threads",
            "1",
            *extra,
        ]

    rng = random.Random(5)
    kills = cut_short = 0
    for round_ in range(16):  # at least 6 kills, and on until one has landed inside a save
        if round_ >= 6 and cut_short:
            break
        async_save = ["--async-save"] if round_ % 2 else []
        before = {p.name for p in ckpt.iterdir()} if ckpt.exists() else set()
        child = subprocess.Popen(
            trainer(10_000, *async_save), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 120
        while not (ckpt.exists() and {p.name for p in ckpt.iterdir()} - before - {"metrics.jsonl", "run.json"}):
            assert child.poll() is None, child.stderr.read() if child.stderr else ""
            assert time.monotonic() < deadline, "the trainer wrote no checkpoint in 2 minutes"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere inside a save, or between two
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        kills += 1
        for info in list_checkpoints(ckpt):  # whatever lists as loadable loads, with its step
            if info.loadable:
                assert load_checkpoint(ckpt, info.tag).step == info.step
            else:
                cut_short += 1
    assert kills >= 6 and cut_short, f"none of {kills} kills landed inside a save"
    newest = max(i.step for i in list_checkpoints(ckpt) if i.loadable)
    done = subprocess.run(
        trainer(newest + 2, "--override-schedule"), env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    infos = list_checkpoints(ckpt)
    assert [i.step for i in infos] == [newest + 1, newest + 2] and all(i.loadable for i in infos), infos
    assert [n for n in os.listdir(ckpt) if "shardkit-tmp" in n] == []  # the killed runs' leftovers are gone


# ---- 10. a source's files never lead shardkit out of it --------------------------------------------------


SECRET = "-----BEGIN PRIVATE KEY----- the user's secret -----END PRIVATE KEY-----"


def _secret_files(tmp_path: Path, config: Path) -> dict[str, Path]:
    """Files outside every source, one per kind a source's link might point at: plain text, JSON
    (a config with a key added, so that it still parses) and a torch pickle."""
    outside = tmp_path / "outside"
    outside.mkdir()
    json_secret = json.loads(config.read_text()) | {"api_key": SECRET}
    (outside / "id_rsa").write_text(SECRET + "\n")
    (outside / "secret.json").write_text(json.dumps(json_secret))
    import torch

    torch.save({"api_key": SECRET}, outside / "secret.pt")
    return {"text": outside / "id_rsa", "json": outside / "secret.json", "pickle": outside / "secret.pt"}


def _holding_the_secret(folder: Path) -> list[str]:
    if not folder.exists():
        return []
    return [str(p) for p in folder.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


LINKED = {  # command -> (the source's kind, the file linked out of it, what the link points at)
    "convert tokenizer.json": ("hf", "tokenizer.json", "text"),
    "convert config.json": ("hf", "config.json", "json"),
    "merge generation_config.json": ("shards", "generation_config.json", "json"),
    "merge config.json": ("shards", "config.json", "json"),
    "reshard tokenizer.json": ("shards", "tokenizer.json", "text"),
    "ckpt export tokenizer.json": ("ckpt", "tokenizer.json", "text"),
    "ckpt reshard user_content.pt": ("ckpt-tag", "user_content.pt", "pickle"),
}


@pytest.mark.parametrize("case", list(LINKED))
def test_a_file_linked_out_of_the_source_is_refused_by_every_command_and_never_copied(sources, tmp_path, case):
    """A tokenizer.json linked to ~/.ssh/id_rsa (or a config, generation config, user content
    linked to a file outside) is refused in one line naming it, before any output exists."""
    model, shards, _ = sources
    kind, name, target = LINKED[case]
    secrets = _secret_files(tmp_path, model / "config.json")
    src = tmp_path / "src"
    if kind == "hf":
        shutil.copytree(model, src)
    elif kind == "shards":
        shutil.copytree(shards, src)
    else:
        ckpt_of_two(tmp_path / "made")
        shutil.copytree(tmp_path / "made" / "ckpt", src)
    folder = src / "step_2" if kind == "ckpt-tag" else src
    if kind == "ckpt-tag":
        (folder / "shardkit.json").unlink()  # as NxD writes tags: no manifest lists the file
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(secrets[target])
    out = tmp_path / "out"
    args = {
        "convert": ["convert", src, out, "--tp", "2"],
        "merge": ["merge", src, out],
        "reshard": ["reshard", src, out, "--tp", "1"],
        "ckpt export": ["ckpt", "export", src, out],
        "ckpt reshard": ["ckpt", "reshard", src, out, "--tag", "step_2", "--tp", "1"],
    }[case.rsplit(" ", 1)[0]]
    one_line_error(run(*args), name, "outside")
    assert not out.exists() and _holding_the_secret(tmp_path / "out") == [] and stray(tmp_path) == []


def test_a_file_linked_inside_the_source_is_copied_as_a_file(sources, tmp_path):
    model, shards, _ = sources
    src = tmp_path / "src"
    shutil.copytree(shards, src)
    (src / "extra").mkdir()
    (src / "extra" / "tok.json").write_text('{"model": "inside"}')
    (src / "tokenizer.json").symlink_to("extra/tok.json")
    result = run("merge", src, tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    copied = tmp_path / "out" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == '{"model": "inside"}'


def test_a_huggingface_cache_snapshot_whose_files_link_to_its_blobs_still_converts(sources, tmp_path):
    model, _, _ = sources
    repo = tmp_path / "hub" / "models--me--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    files = {p.name: p for p in model.iterdir() if p.is_file()} | {"tokenizer.json": None}
    for i, (name, path) in enumerate(sorted(files.items())):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(path.read_bytes() if path is not None else b'{"model": "cached"}')
        (snapshot / name).symlink_to(f"../../blobs/blob{i}")
    result = run("convert", snapshot, tmp_path / "out", "--tp", "2")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": "cached"}'


def test_a_copied_side_file_is_no_more_readable_than_its_source_nor_the_umask(sources, tmp_path):
    model, _, _ = sources
    src = tmp_path / "src"
    shutil.copytree(model, src)
    (src / "tokenizer.json").write_text('{"private": true}')
    (src / "tokenizer.json").chmod(0o600)
    (src / "tokenizer_config.json").write_text("{}")
    (src / "tokenizer_config.json").chmod(0o644)
    result = run("convert", src, tmp_path / "out", "--tp", "2")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "tokenizer.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "out" / "tokenizer_config.json").stat().st_mode & 0o777 == 0o644
    old = os.umask(0o077)
    try:
        result = run("convert", src, tmp_path / "out2", "--tp", "2")
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out2" / "tokenizer_config.json").stat().st_mode & 0o777 == 0o600


def test_reading_within_a_folder_refuses_links_out_dangling_loops_and_magic_links(tmp_path):
    """The I/O core's small-file reader, `within` a folder: what the descriptor really opened
    must lie inside it (or in a Hub cache snapshot's blobs); every other case is one line."""
    from shardkit.formats import hf
    from shardkit.io.safety.small import SmallFileError, check_small, read_small

    folder = tmp_path / "src"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "real.json").write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    links = {
        "inside": "sub/real.json",
        "outside": str(secret),
        "dotdot": "../secret.txt",
        "dangling": str(tmp_path / "nowhere"),
        "loop": "loop",
        "magic": f"/proc/self/root{secret}",
    }
    for name, target in links.items():
        (folder / name).symlink_to(target)
    (folder / "linked-dir").symlink_to(tmp_path, target_is_directory=True)
    assert read_small(folder / "inside", "side file", within=folder) == b"{}"
    assert check_small(folder / "inside", "side file", within=folder) == (folder / "sub" / "real.json").resolve()
    assert read_small(folder / "outside", "side file") == SECRET.encode()  # only `within` asks where it leads
    expected = {
        "outside": "outside",
        "dotdot": "outside",
        "magic": "outside",
        "dangling": "does not exist",
        "loop": "loop",
    }
    for name, words in expected.items():
        for reader in (read_small, check_small):
            with pytest.raises(SmallFileError, match=words) as caught:
                reader(folder / name, "side file", within=folder)
            assert "\n" not in str(caught.value) and name in str(caught.value)
    with pytest.raises(SmallFileError, match="outside"):
        read_small(folder / "linked-dir" / "secret.txt", "side file", within=folder)
    kept = open(tmp_path / "deleted.txt", "w")  # noqa: SIM115 - held open while its name is gone
    try:
        os.unlink(tmp_path / "deleted.txt")
        (folder / "gone").symlink_to(f"/proc/self/fd/{kept.fileno()}")
        with pytest.raises(SmallFileError, match="place can be told"):
            read_small(folder / "gone", "side file", within=folder)
    finally:
        kept.close()
    with pytest.raises(SmallFileError, match="outside"):  # the trainer's --export-hf copies through this
        hf.copy_side_files(_one_side_file(tmp_path, secret), tmp_path / "dst")
    assert not (tmp_path / "dst" / "tokenizer.json").exists()


def _one_side_file(tmp_path: Path, target: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "dst").mkdir()
    (folder / "tokenizer.json").symlink_to(target)
    return folder
