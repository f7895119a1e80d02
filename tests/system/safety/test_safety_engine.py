"""Data safety and security of the engine: a source is never destroyed through an alias of it,
a replace killed half-way is repaired, killed runs leave nothing behind, corrupt or mixed shards
are refused, push publishes nothing outside its folder, absurd configs and broken destinations
are one clear line (exit 2)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load_file, save_file
from safety_helpers import leftovers, one_line_error, run, tree_digest

import shardkit.api as api
from shardkit.errors import ShardkitError
from shardkit.formats import open_checkpoint
from shardkit.formats.manifest import file_entry, file_record
from shardkit.layout import Layout

ROOT = Path(__file__).resolve().parents[3]


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture(scope="module")
def shards(tiny_model, tmp_path_factory):
    """safetensors shards (tp 4, pp 1, manifest with sha256) of llama-mha, built once."""
    out = tmp_path_factory.mktemp("safety") / "tp4"
    api.convert(tiny_model("llama-mha"), out, Layout(tp=4), format="safetensors", sha256=True)
    return out


@pytest.fixture
def src_copy(shards, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(shards, dst)
    return dst


# ---- 1. the destination must never alias a source ------------------------------------------------


def test_merge_into_dotdot_alias_of_the_source_is_refused(src_copy, tmp_path):
    (tmp_path / "other").mkdir()
    before = tree_digest(src_copy)
    result = run("merge", src_copy, tmp_path / "other" / ".." / "src", "--overwrite")
    one_line_error(result, "overlaps the source")
    assert tree_digest(src_copy) == before and leftovers(tmp_path) == []


def test_destination_symlink_to_the_source_is_refused(src_copy, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(src_copy)
    before = tree_digest(src_copy)
    one_line_error(run("merge", src_copy, link, "--overwrite"), "symlink")
    assert tree_digest(src_copy) == before and link.is_symlink()


def test_source_given_through_a_symlink_is_recognised(src_copy, tmp_path):
    link = tmp_path / "via-link"
    link.symlink_to(src_copy)
    before = tree_digest(src_copy)
    one_line_error(run("merge", link, src_copy, "--overwrite"), "overlaps the source")
    assert tree_digest(src_copy) == before


def test_destination_symlink_elsewhere_is_never_replaced_through(tiny_model, tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "weights.bin").write_bytes(b"weeks of training")
    link = tmp_path / "out"
    link.symlink_to(target)
    one_line_error(run("convert", tiny_model("llama-mha"), link, "--tp", "2", "--overwrite"), "symlink")
    assert (target / "weights.bin").read_bytes() == b"weeks of training" and link.is_symlink()
    assert leftovers(tmp_path) == []


def test_single_file_source_with_a_sibling_destination_still_works(tiny_model, tmp_path):
    hf = tiny_model("llama-mha")
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(hf / "config.json", folder / "config.json")
    torch.save(load_file(hf / "model.safetensors"), folder / "sd.pt")
    result = run("convert", folder / "sd.pt", folder / "shards", "--tp", "2")
    assert result.exit_code == 0, result.stderr
    # ... but the folder holding the file is the source's: never replaced
    before = (folder / "sd.pt").read_bytes()
    one_line_error(
        run("convert", folder / "sd.pt", tmp_path / "x" / ".." / "m", "--tp", "2", "--overwrite"), "overlaps the source"
    )
    assert (folder / "sd.pt").read_bytes() == before


# ---- 2. interrupted runs -----------------------------------------------------------------------------


def test_sigterm_mid_convert_leaves_no_staging_folder(tiny_model, tmp_path):
    ready = tmp_path / "ready"
    dst = tmp_path / "out"
    script = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        import shardkit.api as api
        from shardkit.layout import Layout
        src, dst, ready = sys.argv[1:4]
        def progress(done, total):
            Path(ready).write_text("1")
            time.sleep(120)
        api.convert(src, dst, Layout(tp=2), progress=progress)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tiny_model("llama-mha")), str(dst), str(ready)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the child never started writing"
            time.sleep(0.05)
        assert leftovers(tmp_path), "expected a staging folder while the child writes"
        child.send_signal(signal.SIGTERM)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode != 0
    assert leftovers(tmp_path) == [] and not dst.exists()


def test_stale_staging_folder_of_a_dead_process_is_removed(tiny_model, tmp_path, caplog):
    stale = tmp_path / f".out.shardkit-tmp-{dead_pid()}"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "half.pt").write_bytes(b"half-written")
    alive = tmp_path / f".out.shardkit-tmp-{os.getppid()}"  # a live process's: left alone
    alive.mkdir()
    with caplog.at_level("WARNING"):
        api.convert(tiny_model("llama-mha"), tmp_path / "out", Layout(tp=2))
    assert not stale.exists() and alive.is_dir()
    assert any("no longer runs" in r.getMessage() for r in caplog.records)


def test_stale_staging_link_is_never_followed(tiny_model, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    (tmp_path / f".out.shardkit-tmp-{dead_pid()}").symlink_to(victim)
    api.convert(tiny_model("llama-mha"), tmp_path / "out", Layout(tp=2))
    assert (victim / "keep").read_text() == "x"


def test_crash_between_the_two_renames_is_restored_by_the_next_run(shards, tmp_path, caplog):
    old = tmp_path / f".out.shardkit-old-{dead_pid()}"
    shutil.copytree(shards, old)
    before = tree_digest(old)
    # a rerun without --overwrite restores DST, then (rightly) refuses to replace it
    with caplog.at_level("WARNING"):
        one_line_error(run("reshard", shards, tmp_path / "out", "--tp", "2"), "not empty")
    assert not old.exists() and tree_digest(tmp_path / "out") == before
    assert any("restored" in r.getMessage() for r in caplog.records)


def test_crash_between_the_two_renames_is_restored_on_open_and_inspect(shards, tmp_path):
    old = tmp_path / f".out.shardkit-old-{dead_pid()}"
    shutil.copytree(shards, old)
    result = run("inspect", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    assert (tmp_path / "out" / "shardkit.json").is_file() and not old.exists()
    assert open_checkpoint(tmp_path / "out").layout.tp == 4


def test_replace_with_overwrite_leaves_nothing_beside(shards, tmp_path):
    out = tmp_path / "out"
    api.reshard(shards, out, Layout(tp=2))
    api.reshard(shards, out, Layout(tp=1), overwrite=True)
    assert open_checkpoint(out).layout.tp == 1 and leftovers(tmp_path) == []


# ---- 3. corrupt data -----------------------------------------------------------------------------------


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # safetensors: the last byte is tensor data, so the file still parses
    path.write_bytes(bytes(data))


def a_rank_file(root: Path) -> Path:
    return sorted((root / "model").glob("*.safetensors"))[1]


def test_flipped_byte_is_refused_by_merge_and_reshard(src_copy, tmp_path):
    flip_last_byte(a_rank_file(src_copy))
    one_line_error(run("merge", src_copy, tmp_path / "hf"), "xxh3_128", a_rank_file(src_copy).name)
    one_line_error(run("reshard", src_copy, tmp_path / "tp2", "--tp", "2"), "xxh3_128")
    one_line_error(run("merge", src_copy, tmp_path / "hf", "--verify-sha256"), "sha256", a_rank_file(src_copy).name)
    with pytest.raises(ShardkitError, match="sha256"):
        api.merge(src_copy, tmp_path / "hf", verify_hashes="sha256")
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path) == []
    # the check can be skipped on purpose, in the library and on the command line
    api.merge(src_copy, tmp_path / "hf", verify_hashes=False)
    assert run("merge", src_copy, tmp_path / "hf2", "--no-verify-hashes").exit_code == 0


def _edit_entry(root: Path, path: Path, **changes) -> None:
    manifest = json.loads((root / "shardkit.json").read_text())
    entry = next(e for e in manifest["files"] if e["path"] == path.relative_to(root).as_posix())
    for key, value in changes.items():
        if value is None:
            del entry[key]
        else:
            entry[key] = value
    (root / "shardkit.json").write_text(json.dumps(manifest))


def test_each_check_reads_its_own_digest(src_copy, tmp_path):
    """The default check compares the fast xxh3-128, --verify-sha256 the sha256: a manifest whose
    other digest is wrong passes each (so each really compares the one it names)."""
    target = a_rank_file(src_copy)
    _edit_entry(src_copy, target, sha256="0" * 64)
    assert run("merge", src_copy, tmp_path / "fast").exit_code == 0
    one_line_error(run("merge", src_copy, tmp_path / "strong", "--verify-sha256"), "sha256", target.name)
    _edit_entry(src_copy, target, sha256=file_record(target, src_copy, sha256=True).sha256, xxh3_128="0" * 32)
    one_line_error(run("merge", src_copy, tmp_path / "fast2"), "xxh3_128", target.name)
    assert run("merge", src_copy, tmp_path / "strong2", "--verify-sha256").exit_code == 0
    # inspect --check-data compares both digests
    report = api.inspect(src_copy, check_data=True)
    assert report["checked"]["hash_mismatches"] == 1 and any(target.name in p for p in report["problems"])


def test_a_manifest_without_the_fast_digest_is_checked_by_sha256(src_copy, tmp_path):
    """Manifests written before xxh3-128 existed list only sha256: the default check uses it."""
    target = a_rank_file(src_copy)
    manifest = json.loads((src_copy / "shardkit.json").read_text())
    for entry in manifest["files"]:
        entry.pop("xxh3_128")
    (src_copy / "shardkit.json").write_text(json.dumps(manifest))
    assert run("merge", src_copy, tmp_path / "ok").exit_code == 0
    flip_last_byte(target)
    one_line_error(run("merge", src_copy, tmp_path / "hf"), "sha256", target.name)
    assert not (tmp_path / "hf").exists()


def test_sha256_is_recorded_on_request_and_its_check_needs_it(src_copy, tmp_path):
    """Without --sha256 a manifest lists xxh3-128 only: the default check passes, --verify-sha256
    is one line saying how to get a sha256 (exit 2, nothing written); with --sha256 it is listed."""
    plain, strong = tmp_path / "plain", tmp_path / "strong"
    assert run("reshard", src_copy, plain, "--tp", "2").exit_code == 0
    entries = json.loads((plain / "shardkit.json").read_text())["files"]
    assert entries and all("sha256" not in e and len(e["xxh3_128"]) == 32 for e in entries)
    assert run("merge", plain, tmp_path / "hf").exit_code == 0
    one_line_error(run("merge", plain, tmp_path / "hf2", "--verify-sha256"), "lists no sha256", "--sha256")
    assert not (tmp_path / "hf2").exists() and leftovers(tmp_path) == []
    assert run("reshard", src_copy, strong, "--tp", "2", "--sha256").exit_code == 0
    for entry in json.loads((strong / "shardkit.json").read_text())["files"]:
        data = (strong / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["xxh3_128"] == xxhash.xxh3_128_hexdigest(
            data
        )
    assert run("merge", strong, tmp_path / "hf3", "--verify-sha256").exit_code == 0


def test_flipped_byte_is_refused_by_ckpt_export(shards, tmp_path):
    tag = tmp_path / "ckpt" / "step_5"
    shutil.copytree(shards, tag)
    (tag / "done").write_text("1")
    flip_last_byte(a_rank_file(tag))
    one_line_error(run("ckpt", "export", tmp_path / "ckpt", tmp_path / "hf", "--tag", "step_5"), "xxh3_128")
    with pytest.raises(ShardkitError, match="xxh3_128"):
        api.export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", "step_5")
    assert (
        run("ckpt", "export", tmp_path / "ckpt", tmp_path / "hf", "--tag", "step_5", "--no-verify-hashes").exit_code
        == 0
    )


def test_each_source_file_is_hashed_once_and_from_the_reads_themselves(shards, tmp_path, monkeypatch):
    """Merge reads the shards in order: the check hashes the bytes it reads (no second read of
    them), finishing each listed file exactly once with only what no read reached."""
    from shardkit.formats import source_check

    finished: dict[str, tuple[int, int]] = {}
    real = source_check.feed_file

    def counting(path, digest, start=0, store=None):
        assert Path(path).name not in finished, f"{path} hashed twice"
        size = real(path, digest, start, store)
        finished[Path(path).name] = (start, size)
        return size

    monkeypatch.setattr(source_check, "feed_file", counting)
    api.merge(shards, tmp_path / "hf", workers=3)
    files = json.loads((shards / "shardkit.json").read_text())["files"]
    assert sorted(finished) == sorted(Path(f["path"]).name for f in files)
    assert all(start == size for start, size in finished.values()), finished  # nothing read twice


def test_a_listed_file_swapped_for_a_link_to_another_listed_file_is_refused(src_copy, tmp_path):
    """Each file the manifest lists is compared with its own entry, even when it has become an
    alias of another listed file (a symlink to it): its bytes are then the other file's, and the
    merge would otherwise write the other rank's weights in its place."""
    files = sorted((src_copy / "model").glob("*.safetensors"))
    files[1].unlink()
    files[1].symlink_to(files[0].name)
    one_line_error(run("merge", src_copy, tmp_path / "hf"), "xxh3_128", files[1].name)
    assert not (tmp_path / "hf").exists()


def test_after_another_failure_only_the_files_readers_opened_are_hashed(src_copy, tmp_path, monkeypatch):
    """A merge that fails for another reason (here a full disk after the first file it reads)
    reports the check's verdict on the files it opened, and does not read the rest of the
    checkpoint first."""
    from shardkit.formats import reader, source_check
    from shardkit.paths import NoSpaceError

    files = sorted((src_copy / "model").glob("*.safetensors"))
    flip_last_byte(files[-1])  # corrupt, but never opened before the failure: not reported
    hashed: list[str] = []
    real_feed, real_file = source_check.feed_file, reader.SourceReader._file
    monkeypatch.setattr(
        source_check,
        "feed_file",
        lambda path, digest, start=0, store=None: (
            hashed.append(Path(path).name) or real_feed(path, digest, start, store)
        ),
    )

    def full_disk_after_one_file(self, key):
        if len(self._open) == 1 and key not in self._open:
            raise NoSpaceError("no space left on the destination: free some space")
        return real_file(self, key)

    monkeypatch.setattr(reader.SourceReader, "_file", full_disk_after_one_file)
    with pytest.raises(NoSpaceError):
        api.merge(src_copy, tmp_path / "hf", workers=1)
    assert len(hashed) == 1 and hashed[0] != files[-1].name
    # the same failure after opening the corrupt file: the mismatch is the better message
    flip_last_byte(files[-1])
    flip_last_byte(files[0])
    with pytest.raises(ShardkitError, match="xxh3_128"):
        api.merge(src_copy, tmp_path / "hf", workers=1)


# ---- 4. mixed dtypes ------------------------------------------------------------------------------------


def test_a_piece_whose_dtype_differs_from_its_siblings_is_refused(src_copy, tmp_path):
    path = sorted((src_copy / "model").glob("*.safetensors"))[2]
    tensors = load_file(path)
    name = next(k for k in tensors if k.endswith("layers.1.mlp.down_proj.weight"))
    tensors[name] = tensors[name].to(torch.int64)
    save_file(tensors, str(path), metadata={"format": "pt"})
    manifest = json.loads((src_copy / "shardkit.json").read_text())  # a consistent manifest: hashes pass
    for entry in manifest["files"]:
        if entry["path"] == path.relative_to(src_copy).as_posix():
            entry.update(file_entry(file_record(path, src_copy)))
    (src_copy / "shardkit.json").write_text(json.dumps(manifest))
    line = one_line_error(run("merge", src_copy, tmp_path / "hf"), path.name, name, "int64", "float32")
    assert "down_proj" in line and not (tmp_path / "hf").exists()


# ---- 5. push publishes nothing outside its folder ---------------------------------------------


def test_push_refuses_a_symlink_leading_outside_before_any_hub_call(tiny_model, tmp_path, monkeypatch):
    import importlib

    push_module = importlib.import_module("shardkit.hub.push")
    folder = tmp_path / "model"
    shutil.copytree(tiny_model("llama-mha"), folder)
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    (folder / "notes.txt").symlink_to(secret)

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was called")

    monkeypatch.setattr(push_module, "check_repo", no_hub)
    monkeypatch.setattr(push_module, "_api", no_hub)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    line = one_line_error(run("push", folder, "me/model"), "notes.txt", "symlink", "outside")
    assert "PRIVATE KEY" not in line
    # a link that stays inside the folder is fine (mirrored as usual)
    (folder / "notes.txt").unlink()
    (folder / "notes.txt").symlink_to(folder / "config.json")
    push_module._link_tree(folder, tmp_path / "mirror")
    assert (tmp_path / "mirror" / "notes.txt").read_text() == (folder / "config.json").read_text()


# ---- 6. absurd configs and broken destinations --------------------------------------------------


def config_with(tmp_path: Path, **changes) -> Path:
    config = json.loads((ROOT / "fixtures" / "llama-mha.json").read_text())
    config.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "field, value, phrase",
    [
        ("num_hidden_layers", 10**9, "more than any real model"),
        ("num_hidden_layers", 1e9, "whole number"),
        ("hidden_size", "abc", "whole number"),
        ("hidden_size", None, "whole number"),
        ("intermediate_size", [96], "whole number"),
        ("num_attention_heads", 0, "at least 1"),
        ("vocab_size", -5, "at least 1"),
        ("tie_word_embeddings", "yes", "true or false"),
    ],
)
def test_plan_refuses_absurd_configs_at_once(tmp_path, field, value, phrase):
    path = config_with(tmp_path, **{field: value})
    one_line_error(run("plan", "--config", path), field, phrase, "config.json")  # refused before any pricing


def test_inspect_refuses_more_layers_than_tensors(tiny_model, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model("llama-mha"), folder)
    config_with(folder, num_hidden_layers=4000)
    one_line_error(run("inspect", folder), "num_hidden_layers", "4000", "tensors", str(folder / "config.json"))
    config_with(folder, num_hidden_layers=10**9)
    one_line_error(run("inspect", folder), "num_hidden_layers", str(folder / "config.json"))
    config_with(folder, hidden_size="abc")
    one_line_error(run("inspect", folder), "hidden_size", "whole number", str(folder / "config.json"))


def test_destination_under_a_file_is_one_line(tiny_model, tmp_path):
    (tmp_path / "file").write_text("x")
    one_line_error(run("convert", tiny_model("llama-mha"), tmp_path / "file" / "out", "--tp", "2"), "file")


def test_read_only_destination_is_one_line(tiny_model, tmp_path, monkeypatch):
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if ".shardkit-tmp-" in str(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    one_line_error(run("convert", tiny_model("llama-mha"), tmp_path / "out", "--tp", "2"), "Read-only", "writable disk")


def test_full_disk_at_rename_is_one_line_and_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    real_rename = os.rename

    def full(a, b, *args, **kwargs):
        if ".shardkit-tmp-" in str(a):
            raise OSError(errno.ENOSPC, "No space left on device", str(a))
        return real_rename(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "rename", full)
    one_line_error(run("convert", tiny_model("llama-mha"), tmp_path / "out", "--tp", "2"), "no space left", "free")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_full_disk_during_a_replace_keeps_the_old_destination(shards, tmp_path, monkeypatch):
    out = tmp_path / "out"
    api.reshard(shards, out, Layout(tp=2))
    before = tree_digest(out)
    real_rename = os.rename

    def full(a, b, *args, **kwargs):
        if ".shardkit-tmp-" in str(a):
            raise OSError(errno.ENOSPC, "No space left on device", str(a))
        return real_rename(a, b, *args, **kwargs)

    monkeypatch.setattr(os, "rename", full)
    one_line_error(run("reshard", shards, out, "--tp", "1", "--overwrite"), "no space left")
    assert tree_digest(out) == before and leftovers(tmp_path) == []
