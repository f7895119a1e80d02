"""Object storage against unlucky users and attackers: an `--overwrite` of an s3:// output that
fails, is interrupted or killed keeps the old output (the replace commits at its record); objects
shardkit did not write are never replaced unless named; staging and mirror roots in the shared
temporary folder are per-user, 0700 and never followed through a link; SIGTERM during a read the
store never answers removes the mirror; listings that claim impossible sizes; names that are not
UTF-8; messages that name s3:// URLs, not local mirrors; the trainer's export to s3://.
Against the moto server of tests/support/s3_fixtures.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from s3_helpers import keys, kill_while_uploading, no_mirrors_left, run, run_sub, s3_loc

import shardkit
from shardkit.api import convert, verify
from shardkit.io.objects import s3, upload


@pytest.fixture(autouse=True)
def own_temporary_folder(own_temporary_folder):
    """Every test here has its own system temporary folder (tests/support/s3_fixtures.py)."""
    return own_temporary_folder


ROOT = Path(__file__).resolve().parents[3]
STAGED, WRITING, RECORD = ".shardkit-staged-", ".shardkit-writing", ".shardkit-output"


def objects(bucket: str, prefix: str) -> dict[str, str]:
    """Every object under `prefix`: key -> ETag."""
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


def one_line(result, code: int = 2) -> str:
    """The single stderr line of a CLI result that exited with `code`."""
    err = result.stderr if hasattr(result, "stderr") else ""
    exit_code = getattr(result, "exit_code", getattr(result, "returncode", None))
    assert exit_code == code, (exit_code, err, getattr(result, "output", ""))
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def layout_of(url: str) -> dict:
    return shardkit.inspect(url)["layout"]


@pytest.fixture
def old_output(small_model, bucket):
    """An s3:// output (tp 2) of the small model, its objects and ETags: what a replace must keep."""
    hf = small_model(torch.bfloat16)
    url = f"s3://{bucket}/out"
    convert(hf, url, shardkit.make_layout(tp=2))
    return hf, url, objects(bucket, "out/")


def assert_kept(bucket: str, before: dict[str, str], hf: Path, url: str) -> None:
    """The old output is there as it was (same objects, same ETags), nothing else beside it, and
    reads as the model it holds."""
    assert objects(bucket, "out/") == before
    assert layout_of(url)["tp"] == 2 and verify(hf, url).ok


# ---- 1. a replace keeps the old output until the new one commits ------------------------------------


def test_overwrite_whose_source_fails_its_digest_keeps_the_old_output(old_output, bucket, tmp_path, workdir):
    """A source byte flipped (caught by the digest check before the commit): the old output is
    untouched, and what the run staged is gone."""
    hf, url, before = old_output
    src = tmp_path / "src"
    convert(hf, src, shardkit.make_layout(tp=4))
    shard = src / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    line = one_line(run("reshard", src, url, "--tp", "1", "--overwrite"))
    assert "does not match" in line and "shardkit.json" in line, line
    assert_kept(bucket, before, hf, url)
    assert not s3.client().list_multipart_uploads(Bucket=bucket, Prefix="out/").get("Uploads", [])


def test_interrupted_overwrite_keeps_the_old_output(old_output, bucket, monkeypatch):
    """Ctrl-C (or SIGTERM, which shardkit turns into the same) once the new output is all up but
    before its commit: the old output is untouched and the staged objects are removed."""
    hf, url, before = old_output
    uploaded: list[str] = []
    upload_tree = upload.upload_tree

    def interrupted(local, loc, *args, **kwargs):
        upload_tree(local, loc, *args, **kwargs)
        uploaded.extend(objects(bucket, "out/"))
        raise KeyboardInterrupt

    monkeypatch.setattr(upload, "upload_tree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(hf, url, shardkit.make_layout(tp=4), overwrite=True)
    assert any(k.endswith("tp_rank_03_pp_rank_00.pt") for k in uploaded), uploaded  # the new output was up
    assert_kept(bucket, before, hf, url)


def test_replace_is_atomic_at_its_record(old_output, bucket, monkeypatch):
    """A reader of the prefix reads the old output until the record's PUT, then the new one:
    before the commit (the new objects all staged beside it) and while the committed replace is
    copied into place, never a mix; once done, only the new output's objects are left."""
    hf, url, before = old_output
    seen: dict[str, dict] = {}
    upload_tree, copy = upload.upload_tree, getattr(s3, "copy_objects", None)

    def uploaded_seen(local, loc, *args, **kwargs):
        sent = upload_tree(local, loc, *args, **kwargs)  # the new output's last objects, its manifest
        seen["before commit"] = layout_of(url)
        return sent

    def copy_seen(loc, pairs):
        pairs = list(pairs)
        if any(name == "shardkit.json" for _, name, _, _ in pairs):  # the old manifest is about to be replaced
            seen["while copied"] = layout_of(url)
        return copy(loc, pairs)

    monkeypatch.setattr(upload, "upload_tree", uploaded_seen)
    monkeypatch.setattr(s3, "copy_objects", copy_seen, raising=False)
    convert(hf, url, shardkit.make_layout(tp=4), overwrite=True)
    assert seen["before commit"]["tp"] == 2 and seen["while copied"]["tp"] == 4
    after = objects(bucket, "out/")
    assert layout_of(url)["tp"] == 4 and verify(hf, url).ok
    assert not any(STAGED in k or k.endswith(WRITING) for k in after), sorted(after)
    assert "out/model/dp_rank_00_tp_rank_03_pp_rank_00.pt" in after
    assert not [k for k in before if k not in after and "tp_rank_00" not in k and "tp_rank_01" not in k]
    record = json.loads(s3.client().get_object(Bucket=bucket, Key="out/.shardkit-output")["Body"].read())
    assert sorted(f"out/{n}" for n in record["objects"]) == sorted(k for k in after if not k.endswith("-output"))
    assert record["under"] == "" and record["replaces"] == []


def test_replace_stopped_after_its_commit_is_finished_by_the_next_run(old_output, bucket, monkeypatch, caplog):
    """Committed, then the copies into place fail: the new output is what readers read (from
    where it was staged), and the next run into the prefix finishes the replace, saying so."""
    hf, url, _ = old_output

    def failing(loc, pairs):
        raise s3.RemoteError("cannot copy: injected")

    with monkeypatch.context() as m:
        m.setattr(s3, "copy_objects", failing, raising=False)
        with caplog.at_level(logging.WARNING, logger="shardkit"):
            convert(hf, url, shardkit.make_layout(tp=4), overwrite=True)
    assert "committed" in caplog.text and "next run" in caplog.text
    assert any(STAGED in k for k in objects(bucket, "out/"))
    assert layout_of(url)["tp"] == 4 and verify(hf, url).ok  # the committed output, read where it was staged
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardkit"):
        convert(hf, url, shardkit.make_layout(tp=1), overwrite=True)
    assert "finished the replace" in caplog.text
    after = objects(bucket, "out/")
    assert not any(STAGED in k for k in after) and layout_of(url)["tp"] == 1 and verify(hf, url).ok
    assert not any("tp_rank_03" in k for k in after)


def test_killed_overwrite_keeps_the_old_output_and_the_next_run_removes_what_it_staged(
    old_output, bucket, tmp_path, workdir
):
    """kill -9 while the new output is being uploaded: the old output is still there and read as
    before (the killed run's marker and staged objects are not part of it); the next run removes
    them, saying so, and replaces the output."""
    hf, url, before = old_output
    kill_while_uploading(["convert", str(hf), url, "--tp", "4", "--overwrite"], workdir)
    now = objects(bucket, "out/")
    assert "out/.shardkit-writing" in now and any(STAGED in k for k in now)
    assert {k: v for k, v in now.items() if k in before} == before  # the old output, as it was
    assert layout_of(url)["tp"] == 2 and verify(hf, url).ok
    again = run_sub("-v", "convert", hf, url, "--tp", "4", "--overwrite", cwd=workdir)
    assert again.returncode == 0, again.stderr
    assert "staged objects" in again.stderr and "left incomplete" in again.stderr, again.stderr
    after = objects(bucket, "out/")
    assert not any(STAGED in k or k.endswith(WRITING) for k in after), sorted(after)
    assert layout_of(url)["tp"] == 4 and verify(hf, url).ok
    assert not s3.client().list_multipart_uploads(Bucket=bucket, Prefix="out/").get("Uploads", [])
    assert not list(workdir.iterdir())


def test_overwrite_replaces_only_what_shardkit_wrote_or_what_is_named(old_output, bucket, tmp_path):
    """An object shardkit did not write under the prefix, or any object at a bucket's root, makes
    --overwrite a one-line refusal that touches nothing, unless --replace-objects names it."""
    hf, url, before = old_output
    s3.client().put_object(Bucket=bucket, Key="out/notes/readme.txt", Body=b"the user's")
    line = one_line(run("convert", hf, url, "--tp", "4", "--overwrite"))
    assert "notes/readme.txt" in line and "--replace-objects" in line, line
    assert objects(bucket, "out/") == {**before, **objects(bucket, "out/notes/")}
    line = one_line(run("convert", hf, url, "--tp", "4", "--overwrite", "--replace-objects", "*.md"))
    assert "notes/readme.txt" in line
    res = run("convert", hf, url, "--tp", "4", "--overwrite", "--replace-objects", "notes/*")
    assert res.exit_code == 0, res.output
    assert "out/notes/readme.txt" not in objects(bucket, "out/") and layout_of(url)["tp"] == 4

    other = f"{bucket}-root"
    s3.client().create_bucket(Bucket=other)
    convert(hf, f"s3://{other}", shardkit.make_layout(tp=2))
    s3.client().put_object(Bucket=other, Key="elsewhere/data.bin", Body=b"kept")
    kept = objects(other, "")
    line = one_line(run("convert", hf, f"s3://{other}", "--tp", "4", "--overwrite"))
    assert "whole bucket" in line and "--replace-objects" in line, line
    line = one_line(run("convert", hf, f"s3://{other}", "--tp", "4", "--overwrite", "--replace-objects", "model/*"))
    assert "whole bucket" in line and objects(other, "") == kept
    res = run("convert", hf, f"s3://{other}", "--tp", "4", "--overwrite", "--replace-objects", "*")
    assert res.exit_code == 0, res.output
    assert "elsewhere/data.bin" not in objects(other, "") and verify(hf, f"s3://{other}").ok


# ---- 2. staging and mirror roots: per-user, 0700, never through a link --------------------------------


def _precious(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A folder of the user's with two folders of files (what a planted link points at)."""
    victim = tmp_path / "victim"
    for sub in ("step_1", "data"):
        (victim / sub).mkdir(parents=True)
        (victim / sub / "keep.bin").write_bytes(sub.encode() * 100)
    return victim, _tree(victim)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"" for p in sorted(folder.rglob("*"))}


def _save(url: str, tag: str = "step_1") -> None:
    import ckpt_child

    from shardkit.checkpoint import finalize_checkpoint
    from shardkit.layout import Layout
    from shardkit.testing import fixture_config

    config = fixture_config("tinyllama-mini") | {"num_hidden_layers": 4}  # its size is not the point
    ckpt_child.save_all_ranks(url, tag, Layout(tp=2, pp=1, qkv="gqa"), config, ckpt_child.full_state(config, 1), 1)
    finalize_checkpoint()


@pytest.mark.parametrize("planted", ["link", "inner link", "world-writable", "another user's"])
def test_planted_staging_root_is_refused_and_nothing_outside_is_touched(
    planted, bucket, tmp_path, own_temporary_folder, monkeypatch
):
    """A save to s3:// stages its tag in the shared temporary folder under a name anyone can
    predict: a link planted there (at this user's root, or at the save's folder inside it), a
    folder others may write, or another user's folder is refused in one line; the folder a link
    points to is not written, locked or deleted in, and nothing is uploaded."""
    from shardkit.checkpoint.s3_tags import staging_root
    from shardkit.errors import ShardkitError

    victim, was = _precious(tmp_path)
    url = f"s3://{bucket}/ckpt"
    root = own_temporary_folder / f"shardkit-{os.getuid()}"
    if planted == "link":
        root.symlink_to(victim)
    elif planted == "inner link":
        inner = staging_root(s3_loc(url))
        inner.rmdir()
        inner.symlink_to(victim)
    elif planted == "world-writable":
        root.mkdir()
        root.chmod(0o777)
        (root / "planted").symlink_to(victim)
    else:
        root.mkdir(mode=0o700)
        (root / "planted").symlink_to(victim)
        monkeypatch.setattr(os, "getuid", lambda: os.geteuid() + 1)
        os.rename(root, own_temporary_folder / f"shardkit-{os.getuid()}")
    with pytest.raises(ShardkitError) as refused:
        _save(url)
    message = str(refused.value)
    assert "\n" not in message and ("symlink" in message or "other user" in message), message
    assert _tree(victim) == was
    assert not keys(bucket, "ckpt/")
    if planted != "inner link":  # every other root shardkit makes there (mirrors, staged outputs): refused too
        from shardkit.io.safety.transaction import private_root

        with pytest.raises(ShardkitError):
            private_root()


def test_staging_root_is_this_users_and_private(bucket, own_temporary_folder):
    """A save creates its staging root 0700 inside this user's 0700 folder (one readable by
    others is made private), and uses it again."""
    from shardkit.checkpoint.s3_tags import staging_root

    root = own_temporary_folder / f"shardkit-{os.getuid()}"
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    _save(f"s3://{bucket}/ckpt")
    staged = staging_root(s3_loc(f"s3://{bucket}/ckpt"))
    assert staged.parent == root
    assert (root.stat().st_mode & 0o777, staged.stat().st_mode & 0o777) == (0o700, 0o700)
    assert [i for i in shardkit.checkpoint.list_checkpoints(f"s3://{bucket}/ckpt") if i.complete]


# ---- 3. SIGTERM while a read hangs: the mirror goes -----------------------------------------------


def _mirrors(temporary: Path, pid: int | None = None) -> list[Path]:
    """The mirror folders in `temporary` and /dev/shm (where a streamed source's mirror goes), or
    this user's folders there, those of process `pid` only when given."""
    found = []
    places = [p for base in (temporary, Path("/dev/shm")) for p in (base, base / f"shardkit-{os.getuid()}")]
    for mine in places:
        for folder in mine.iterdir() if mine.is_dir() else []:
            try:
                owner = int((folder / ".shardkit-owner").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                owner = None
            if folder.name.startswith("shardkit-s3-") and (pid is None or owner == pid):
                found.append(folder)
    return found


def test_sigterm_during_a_hung_read_removes_the_mirror(tiny_model, bucket, faulty, tmp_path, own_temporary_folder):
    """A merge reading from a store that stops answering (the GET of a tensor file hangs): SIGTERM
    removes the local mirror at once, and the process ends with one line, not after the read's
    timeout."""
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/src"
    convert(hf, url, shardkit.make_layout(tp=2))
    proxy = faulty(hang="/src/model/")
    env = {**os.environ, "SHARDKIT_S3_MAX_ATTEMPTS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardkit", "merge", url, str(tmp_path / "merged")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proxy.hung.wait(120), "the merge never read a tensor file"
        assert _mirrors(own_temporary_folder, proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0 and len(err.strip().splitlines()) == 1, err
    assert not _mirrors(own_temporary_folder, proc.pid)
    assert not (tmp_path / "merged").exists()


def test_sigterm_removes_a_mirror_kept_until_exit(tiny_model, bucket, own_temporary_folder):
    """A mirror opened outside any scope (the trainer's --resume, `readable`) lives until exit;
    SIGTERM, whose default ends the process without exit handlers, still removes it first."""
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    url = f"s3://{bucket}/kept"
    convert(hf, url, shardkit.make_layout(tp=2))
    code = (
        "import sys, time\n"
        "from shardkit.io.store import readable\n"
        f"print(readable({url!r}, 'x').root, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        mirror = Path(proc.stdout.readline().strip())
        assert mirror.is_dir() and (mirror / "config.json").is_file()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM  # SIGTERM keeps its meaning
    finally:
        proc.kill()
    assert not mirror.exists() and not _mirrors(own_temporary_folder, proc.pid)


# ---- 4. a listing that claims an impossible size ------------------------------------------------


@pytest.mark.parametrize(
    "claimed",
    [
        1 << 64,
        10**18,
        -5,
        1 << 36,
        1 << 40,  # 32768 parts of 32 MiB claimed: each claim looks up only the parts it overlaps
    ],
)
def test_listing_that_claims_an_impossible_size_is_one_line(claimed, small_model, bucket, tmp_path, workdir):
    """The store lists a tensor file as larger than it is (or at a size no object has): one line,
    exit 2, naming the s3:// object, after a handful of GETs (not one per part of the claim: a
    1 TiB claim is 32768 parts)."""
    hf = small_model(torch.bfloat16)
    url = f"s3://{bucket}/claims"
    convert(hf, url, shardkit.make_layout(tp=2))
    gets: list[str] = []

    def lie(parsed, **kwargs):
        for obj in parsed.get("Contents", []):
            if obj["Key"].endswith("tp_rank_01_pp_rank_00.pt"):
                obj["Size"] = claimed

    events = s3.client().meta.events
    events.register("after-call.s3.ListObjectsV2", lie)
    events.register("before-call.s3.GetObject", lambda params, **kw: gets.append(params.get("Key", "")))
    try:
        start = len(gets)
        line = one_line(run("convert", url, tmp_path / "merged", "--tp", "1"))  # fetches every byte first
    finally:
        events.unregister("after-call.s3.ListObjectsV2", lie)
    assert f"{url}/model/dp_rank_00_tp_rank_01_pp_rank_00.pt" in line, line
    assert len(gets) - start < 100, len(gets) - start
    assert not (tmp_path / "merged").exists()
    no_mirrors_left()


# ---- 5. names that are not UTF-8 ---------------------------------------------------------------------


def test_destination_not_valid_utf8(tiny_model, bucket, tmp_path):
    """A local destination whose name is not UTF-8 is written (file names are bytes); an s3://
    one (S3 keys are UTF-8) is refused in one line."""
    hf = tiny_model("tinyllama-mini", torch.bfloat16)
    dst = os.fsdecode(os.fsencode(str(tmp_path)) + b"/out\xff")
    res = run("convert", hf, dst, "--tp", "2")
    assert res.exit_code == 0, res.output
    assert verify(hf, dst).ok
    line = one_line(run("convert", hf, os.fsdecode(f"s3://{bucket}/".encode() + b"out\xff"), "--tp", "2"))
    assert "UTF-8" in line, line
    assert not keys(bucket)


# ---- 6. messages name s3:// URLs ---------------------------------------------------------------------


def test_messages_name_the_bucket_and_not_botocore(s3_server, caplog):
    """A missing bucket is named as the bucket (not the object asked for), and botocore's note of
    where it found the credentials is not shown."""
    missing = "shardkit-no-such-bucket"
    s3.reset_client()
    with caplog.at_level(logging.INFO):
        res = run("merge", f"s3://{missing}/x", "/nonexistent-out")
    line = one_line(res)
    assert f"the bucket {missing} does not exist" in line, line
    assert "Found credentials" not in caplog.text


@pytest.mark.slow  # the trainer resumes from s3:// in the main suite: test_s3_checkpoints
def test_trainer_resume_message_names_the_url(small_model, bucket, tmp_path, workdir, caplog):
    """The trainer's "resumed from" names the checkpoint's s3:// URL, not its local mirror, and
    botocore's credentials note is not among its messages."""
    from trainer_helpers import COMMON

    from trainer.__main__ import main

    ckpt = f"s3://{bucket}/train"
    args = [*_trainer_inputs(small_model, tmp_path), *COMMON, "--checkpoint-dir", ckpt, "--resume", "latest_if_exists"]
    assert main([*args, "--steps", "1"]) == 0
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert main([*args, "--steps", "2", "--override-schedule"]) == 0
    assert f"resumed from {ckpt}/step_1 " in caplog.text, caplog.text
    assert "shardkit-s3-" not in caplog.text and "Found credentials" not in caplog.text


# ---- 7. the trainer's --export-hf s3:// ---------------------------------------------------------------


def _trainer_inputs(small_model, tmp_path: Path) -> list[str]:
    tokens = tmp_path / "tokens.bin"
    if not tokens.exists():
        script = ROOT / "scripts" / "prepare_data.py"
        subprocess.run(
            [sys.executable, str(script), str(ROOT / "fixtures" / "tiny-corpus.txt"), "--out", str(tokens)], check=True
        )
    return ["--model", str(small_model()), "--data", str(tokens)]


def test_trainer_exports_to_s3(small_model, bucket, tmp_path, workdir):
    """--export-hf s3://bucket/prefix: the merged model is uploaded and committed (the same tensors
    as a local export of the same run), the same command run again keeps it, and another run's
    export is refused unless --overwrite-export."""
    from trainer_helpers import COMMON

    from trainer.__main__ import main

    url = f"s3://{bucket}/export"
    base = [*_trainer_inputs(small_model, tmp_path), *COMMON, "--steps", "1"]
    assert main([*base, "--export-hf", url]) == 0
    names = keys(bucket, "export/")
    assert "export/model.safetensors" in names and "export/trainer-export.json" in names
    assert f"export/{RECORD}" in names and not any(WRITING in n or STAGED in n for n in names)
    local = tmp_path / "local-export"
    assert main([*base, "--export-hf", str(local)]) == 0
    assert verify(local, url).ok
    before = objects(bucket, "export/")
    assert main([*base, "--export-hf", url]) == 0  # this run's export of this step: kept
    assert objects(bucket, "export/") == before
    data = tmp_path / "other-tokens.bin"  # another run: its --data is another file
    data.write_bytes((tmp_path / "tokens.bin").read_bytes())
    other = [*base, "--data", str(data), "--export-hf", url]
    assert main(other) == 2 and objects(bucket, "export/") == before
    assert main([*other, "--overwrite-export"]) == 0
    marker = json.loads(s3.client().get_object(Bucket=bucket, Key="export/trainer-export.json")["Body"].read())
    assert marker["run"]["data"] == str(data) and verify(local, url).ok  # (the same tokens: the same model)
    assert not list(workdir.iterdir())
    no_mirrors_left()
