"""Data safety of training checkpoints: what an unlucky user or an attacker can do to a checkpoint
directory must never cost a checkpoint.

1. Symlinked tags: prune, retention and a save onto the tag never delete through the link.
2. Two writers on one directory: a per-directory flock; the second writer gets a one-line error
   naming the holder; it works again once the holder is gone (also when it was killed).
3. Damaged manifests: listed as damaged, skipped (never crash list/prune/resume); the newest
   loadable tag is resumed, also when the newest tag fails its digest check.
4. Names used as paths: tags and manifest file names stay inside their folders.
5. Tags that only look complete (`done`, but not the files of a checkpoint): unloadable, said why,
   never the latest, never counted or removed by retention; locally and in object storage.
6. Tag names: one validator (no control characters, separators, dots, leading '-', spaces at the
   ends, more than 255 bytes) for save, load, list, prune and the CLI's --tag.
7. A checkpoint folder that is a symlink is never saved into or pruned through.
8. Two files of one rank (its number spelled twice) are refused, never one of them taken.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ckpt_child
import pytest
from click.testing import CliRunner
from safety_helpers import CONFIG, LAYOUT, MODEL_FILE, pieces, precious_folder, save, snapshot, tags

from shardkit.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointLockedError,
    Rank,
    finalize_checkpoint,
    latest,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)
from shardkit.checkpoint import save as ckpt_save
from shardkit.cli import cli
from shardkit.errors import FormatError, ShardkitError
from shardkit.io.objects import s3
from shardkit.layout import Layout
from shardkit.paths import UnsafePathError

REPO = Path(__file__).resolve().parents[3]


# ---- helpers -----------------------------------------------------------------------------------------


def one_line(text: str) -> bool:
    return len(text.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def two_tags(tmp_path_factory) -> Path:
    """step_1 and step_2, complete, saved once (tests copy them)."""
    root = tmp_path_factory.mktemp("two") / "ckpt"
    with Checkpointer() as ck:
        save(root, 1, ck)
        save(root, 2, ck)
    return root


@pytest.fixture
def ckpt(two_tags, tmp_path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(two_tags, root, symlinks=True)
    return root


def edit_manifest(tag_dir: Path, change) -> None:
    path = tag_dir / "shardkit.json"
    data = json.loads(path.read_text())
    result = change(data)  # changes data in place, or returns a whole new (list) manifest
    path.write_text(json.dumps(result if isinstance(result, list) else data))


# ---- 1. symlinked tags ------------------------------------------------------------------------------


def test_prune_unlinks_a_symlinked_tag_and_never_touches_its_target(ckpt, tmp_path):
    precious = precious_folder(tmp_path / "pinned" / "step_0", ckpt / "step_1")
    before = snapshot(precious)
    (ckpt / "step_0").symlink_to(precious, target_is_directory=True)  # oldest: pruned first
    plan = prune_checkpoints(ckpt, num_kept=1)
    assert plan.failed == {} and set(plan.removed) == {"step_0", "step_1"}
    assert snapshot(precious) == before  # every byte of the target is still there
    assert not os.path.lexists(ckpt / "step_0") and tags(ckpt) == [("step_2", True)]


def test_retention_after_a_save_never_deletes_through_a_symlinked_tag(ckpt, tmp_path):
    precious = precious_folder(tmp_path / "elsewhere", ckpt / "step_1")  # a loadable tag: retention removes it
    (precious / "sub").mkdir()
    (precious / "sub" / "notes.txt").write_text("keep me")
    before = snapshot(precious)
    (ckpt / "step_0").symlink_to(precious, target_is_directory=True)
    with Checkpointer() as ck:
        save(ckpt, 3, ck, num_kept=1)
    assert snapshot(precious) == before
    assert tags(ckpt) == [("step_3", True)]


def test_saving_onto_a_symlinked_tag_replaces_the_link_not_the_target(ckpt, tmp_path):
    precious = precious_folder(tmp_path / "pinned" / "step_5")
    before = snapshot(precious)
    (ckpt / "step_5").symlink_to(precious, target_is_directory=True)
    (ckpt / "step_6").symlink_to(tmp_path / "nowhere", target_is_directory=True)  # dangling
    with Checkpointer() as ck:
        save(ckpt, 5, ck)
        save(ckpt, 6, ck)
    assert snapshot(precious) == before
    for step in (5, 6):
        tag = ckpt / f"step_{step}"
        assert tag.is_dir() and not tag.is_symlink()
        assert load_checkpoint(ckpt, f"step_{step}").user_content == {"step": step}


def test_links_inside_a_tag_are_unlinked_not_followed(ckpt, tmp_path):
    precious = precious_folder(tmp_path / "data")
    before = snapshot(precious)
    (ckpt / "step_1" / "model" / "more").symlink_to(precious, target_is_directory=True)
    (ckpt / "step_1" / "notes.tex").symlink_to(precious / "thesis.tex")  # not listed: the tag stays sound
    prune_checkpoints(ckpt, num_kept=1)
    assert snapshot(precious) == before and tags(ckpt) == [("step_2", True)]


# ---- 2. one writer per directory -------------------------------------------------------------------

HOLDER = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import ckpt_child
from shardkit.checkpoint import Rank, save_checkpoint
from shardkit.checkpoint import save as ckpt_save
from shardkit.layout import Layout
from shardkit.testing import fixture_config

root, flag = Path(sys.argv[1]), Path(sys.argv[2])
real = ckpt_save.write_tensor_file

def stuck(*args, **kwargs):  # the save is in progress, holding the lock, until killed
    flag.write_text("holding")
    time.sleep(60)
    return real(*args, **kwargs)

ckpt_save.write_tensor_file = stuck
config = fixture_config("llama-mha")
state = ckpt_child.full_state(config, 7)
save_checkpoint(root, "step_7", ckpt_child.rank_pieces(config, Layout(), Rank(), state["weight"]),
                layout=Layout(), config=config, num_kept=1)
"""


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, "the holder never took the lock"
        time.sleep(0.02)


def test_a_second_writer_is_refused_while_a_save_holds_the_directory(ckpt, tmp_path):
    flag = tmp_path / "holding"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(ckpt), str(flag), str(REPO / "tests" / "support")],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for(flag, holder)
        who = rf"pid {holder.pid} on host {socket.gethostname()}"
        with pytest.raises(CheckpointLockedError, match=who + r".*saving checkpoint step_7") as e:
            prune_checkpoints(ckpt, num_kept=1)
        assert one_line(str(e.value))
        with pytest.raises(CheckpointLockedError, match=who):
            save(ckpt, 8, Checkpointer())
        assert not (ckpt / "step_8").exists()  # refused before anything was written
        written = snapshot(ckpt / "step_7")
        with pytest.raises(CheckpointLockedError, match=who):
            save(ckpt, 7, Checkpointer())  # the same tag: the files would mix
        assert snapshot(ckpt / "step_7") == written
        out = CliRunner().invoke(cli, ["ckpt", "prune", str(ckpt), "--keep", "1"])
        assert out.exit_code == 2 and one_line(out.output) and f"pid {holder.pid}" in out.output
        assert tags(ckpt) == [("step_1", True), ("step_2", True), ("step_7", False)]  # nothing pruned
    finally:
        holder.send_signal(signal.SIGKILL)  # a writer that dies: the kernel releases its flock
        holder.wait(30)
    plan = prune_checkpoints(ckpt, num_kept=1)  # the killed writer's half-written tag goes too, saying why
    assert plan.removed == ["step_1", "step_7"] and tags(ckpt) == [("step_2", True)]
    assert f"process {holder.pid}" in plan.reasons["step_7"] and "no longer runs" in plan.reasons["step_7"]
    with Checkpointer() as ck:
        save(ckpt, 7, ck, num_kept=1)
    assert tags(ckpt) == [("step_7", True)]


def test_async_save_holds_the_lock_until_its_retention_is_done(ckpt, monkeypatch):
    import threading

    in_retention, go_on = threading.Event(), threading.Event()
    real = ckpt_save.plan_retention

    def slow_retention(*args, **kwargs):
        in_retention.set()
        assert go_on.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt_save, "plan_retention", slow_retention)
    prune = [sys.executable, "-m", "shardkit", "ckpt", "prune", str(ckpt), "--keep", "1"]
    with Checkpointer() as ck:
        ck.save(ckpt, "step_3", pieces(3), layout=LAYOUT, config=CONFIG, async_save=True, num_kept=1)
        assert in_retention.wait(30)  # the save is complete, its retention runs in the background
        assert (ckpt / "step_3" / "done").exists()
        other = subprocess.run(prune, env=_env(), capture_output=True, text=True, timeout=60, check=False)
        assert other.returncode == 2, other.stderr
        assert one_line(other.stderr) and f"pid {os.getpid()}" in other.stderr and "step_3" in other.stderr
        go_on.set()
        ck.wait()
    assert tags(ckpt) == [("step_3", True)]
    assert prune_checkpoints(ckpt, num_kept=1).failed == {}  # released: another writer may go on


# ---- 3. damaged manifests ---------------------------------------------------------------------------

DAMAGE = {
    "step is text": lambda d: d["checkpoint"].update(step="abc"),
    "not json": None,
    "a list": lambda d: [d],
    "lacks files": lambda d: d.pop("files"),
    "checkpoint is a list": lambda d: d.update(checkpoint=[]),
    "layout is text": lambda d: d.update(layout="tp2"),
    "bad file entry": lambda d: d["files"].append({"path": 3}),
    "a file name with a newline": lambda d: d["files"].append(
        {"path": "model/x\nstep_3 complete", "size": 1, "sha256": "0" * 64}
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_manifest_is_listed_skipped_and_never_blocks_resuming(ckpt, caplog, damage):
    newest = ckpt / "step_2"
    if DAMAGE[damage] is None:
        (newest / "shardkit.json").write_text("{not json")
    else:
        edit_manifest(newest, DAMAGE[damage])
    runner = CliRunner()
    out = runner.invoke(cli, ["ckpt", "list", str(ckpt)])
    assert out.exit_code == 0, out.output
    row = next(line for line in out.output.splitlines() if line.startswith("step_2"))
    assert "DAMAGED" in row and "step_2 is damaged: shardkit.json" in out.output
    listed = json.loads(runner.invoke(cli, ["ckpt", "list", str(ckpt), "--json"]).stdout)
    assert listed["latest"] == "step_1" and [c["damaged"] for c in listed["checkpoints"]] == [False, True]

    with caplog.at_level(logging.WARNING, logger="shardkit"):
        loaded = load_checkpoint(ckpt, "latest_if_exists")
    assert loaded.tag == "step_1" and loaded.user_content == {"step": 1}
    assert "step_2" in caplog.text and "shardkit.json" in caplog.text
    with pytest.raises(FormatError, match="step_2 is damaged") as e:
        load_checkpoint(ckpt, "step_2")
    assert one_line(str(e.value))

    out = runner.invoke(cli, ["ckpt", "prune", str(ckpt), "--keep", "1"])
    assert out.exit_code == 0, out.output
    assert tags(ckpt) == [("step_1", True), ("step_2", True)]  # the damaged tag is neither counted nor removed
    infos = {i.tag: i for i in list_checkpoints(ckpt)}
    assert infos["step_2"].damaged and not infos["step_1"].damaged and latest(ckpt) == "step_1"


def test_latest_falls_back_when_the_newest_tag_fails_its_hash_check(ckpt, caplog):
    path = ckpt / "step_2" / MODEL_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest check sees it
    path.write_bytes(bytes(data))
    for tag in ("latest_if_exists", None):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardkit"):
            loaded = load_checkpoint(ckpt, tag)
        assert loaded.tag == "step_1" and loaded.step == 1
        assert "skipping checkpoint" in caplog.text and "step_2" in caplog.text and "xxh3_128" in caplog.text
    with pytest.raises(FormatError, match="xxh3_128"):
        load_checkpoint(ckpt, "step_2")  # a tag asked for by name never falls back

    # every tag fails: an error, never None ("train from scratch") over existing checkpoints
    (ckpt / "step_1" / "shardkit.json").write_text("[]")
    with pytest.raises(FormatError, match="can be loaded|damaged") as e:
        load_checkpoint(ckpt, "latest_if_exists")
    assert one_line(str(e.value))
    edit_manifest(ckpt / "step_2", lambda d: d["checkpoint"].update(step="abc"))
    with pytest.raises(FormatError, match="every complete checkpoint .* is damaged"):
        load_checkpoint(ckpt, "latest_if_exists")


# ---- 4. names used as paths ---------------------------------------------------------------------------


def test_tag_names_cannot_leave_the_checkpoint_directory(ckpt, tmp_path):
    outside = tmp_path / "x"
    shutil.copytree(ckpt / "step_1", outside)  # a complete checkpoint outside the directory
    for tag in ("../x", str(outside), "step_1/../../x"):
        with pytest.raises(UnsafePathError, match="not a plain folder name") as e:
            load_checkpoint(ckpt, tag)
        assert one_line(str(e.value)) and isinstance(e.value, ShardkitError)
        with pytest.raises(CheckpointError, match="not a plain folder name"):
            save_checkpoint(ckpt, tag, pieces(9), layout=LAYOUT, config=CONFIG)
    assert snapshot(outside) == snapshot(ckpt / "step_1")  # untouched

    runner = CliRunner()
    for tag in ("../x", str(outside)):
        out = runner.invoke(cli, ["ckpt", "export", str(ckpt), str(tmp_path / "hf"), "--tag", tag])
        assert out.exit_code == 2 and one_line(out.output) and "not a plain folder name" in out.output, out.output
        assert not (tmp_path / "hf").exists()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_manifest_file_names_cannot_leave_the_tag(ckpt, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the password is swordfish\n")
    entry = {"size": secret.stat().st_size, "sha256": _sha(secret)}
    for name in ("../../secret.txt", str(secret)):
        edit_manifest(ckpt / "step_2", lambda d, name=name: d["files"].append({"path": name, **entry}))
        with pytest.raises(UnsafePathError, match="listed in step_2/shardkit.json") as e:
            load_checkpoint(ckpt, "step_2")
        assert one_line(str(e.value))
        edit_manifest(ckpt / "step_2", lambda d: d["files"].pop())

    # a listed file replaced by a symlink to an identical file outside the tag: refused too
    model = ckpt / "step_2" / MODEL_FILE
    copy = tmp_path / "model-copy.pt"
    shutil.copyfile(model, copy)
    model.unlink()
    model.symlink_to(copy)
    with pytest.raises(UnsafePathError, match="leads outside"):
        load_checkpoint(ckpt, "step_2")
    assert load_checkpoint(ckpt, "latest_if_exists").tag == "step_1"  # and resuming falls back


# ---- resuming in a torch.distributed job: the ranks never split across steps --------------------------

RANK_LOADER = r"""
import sys
import torch.distributed as dist
from shardkit.checkpoint import load_checkpoint

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
for root in sys.argv[3:]:
    try:
        print(load_checkpoint(root, "latest_if_exists", optimizer=False).tag)
    except Exception as e:
        print(type(e).__name__)
dist.destroy_process_group()
"""


@pytest.mark.slow  # two processes importing torch: ~5 s on an idle machine
def test_distributed_ranks_skip_only_what_every_rank_sees(tmp_path):
    layout = Layout(tp=2)
    full = ckpt_child.full_state(CONFIG, 1)["weight"]
    model = {(tp, 0): ckpt_child.rank_pieces(CONFIG, layout, Rank(tp=tp), full) for tp in (0, 1)}
    roots = [tmp_path / "manifest", tmp_path / "hash"]
    with Checkpointer() as ck:
        for root in roots:
            for step in (1, 2):
                ck.save(root, f"step_{step}", model, layout=layout, config=CONFIG)
                ck.wait()
    # every rank sees a damaged manifest: all of them resume from step_1
    edit_manifest(roots[0] / "step_2", lambda d: d["checkpoint"].update(step="abc"))
    # only rank 1 reads (and hashes) this file: it must not resume alone from step_1
    path = roots[1] / "step_2" / "model" / "dp_rank_00_tp_rank_01_pp_rank_00.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_LOADER, str(r), port, *map(str, roots)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert [o[0].split() for o in outs] == [["step_1", "step_2"], ["step_1", "FormatError"]]


# ---- 5. tags that only look complete -------------------------------------------------------------------


def _nxd_copy(ckpt: Path, tag: str) -> Path:
    """A copy of step_2 as an NxD tree (no manifest or config): its layout is in its file names."""
    path = ckpt / tag
    shutil.copytree(ckpt / "step_2", path)
    for name in ("shardkit.json", "config.json"):
        (path / name).unlink()
    return path


def _done_only(ckpt: Path) -> str:
    (ckpt / "step_99").mkdir()
    (ckpt / "step_99" / "done").write_text("1")
    return "no model files"


def _markers_and_empty_model_folder(ckpt: Path) -> str:
    for name in ("checkpoint", "done"):
        (ckpt / "step_99" / "model").mkdir(parents=True, exist_ok=True)
        (ckpt / "step_99" / name).write_text("1")
    return "no model files"


def _manifest_without_the_model(ckpt: Path) -> str:
    shutil.copytree(ckpt / "step_2", ckpt / "step_99")
    (ckpt / "step_99" / MODEL_FILE).unlink()

    def drop(d):
        d["checkpoint"]["step"] = 99
        d["files"] = [f for f in d["files"] if f["path"] != MODEL_FILE]

    edit_manifest(ckpt / "step_99", drop)
    return f"{MODEL_FILE} is not listed"


def _manifest_claiming_a_billion_ranks(ckpt: Path) -> str:
    """A sound manifest whose layout names ranks it has no files of: caught at the first gap (never
    a listing that walks a billion names)."""
    shutil.copytree(ckpt / "step_2", ckpt / "step_99")
    edit_manifest(ckpt / "step_99", lambda d: (d["checkpoint"].update(step=99), d["layout"].update(tp=10**9)))
    return "dp_rank_00_tp_rank_01_pp_rank_00.pt is not listed"


def _nxd_tree_without_its_model_file(ckpt: Path) -> str:
    (_nxd_copy(ckpt, "step_99") / MODEL_FILE).unlink()
    return "no model files"


def _nxd_tree_missing_a_tp_rank(ckpt: Path) -> str:
    """The optimizer files say tp 2; the model file of tp rank 1 is not there."""
    optim = _nxd_copy(ckpt, "step_99") / "optim"
    shutil.copyfile(optim / "dp_rank_00_tp_rank_00_pp_rank_00.pt", optim / "dp_rank_00_tp_rank_01_pp_rank_00.pt")
    return "dp_rank_00_tp_rank_01_pp_rank_00.pt is missing"


def _nxd_tree_with_an_empty_model_file(ckpt: Path) -> str:
    (_nxd_copy(ckpt, "step_99") / MODEL_FILE).write_bytes(b"")
    return "is empty"


def _nxd_model_file_is_a_fifo(ckpt: Path) -> str:
    path = _nxd_copy(ckpt, "step_99") / MODEL_FILE
    path.unlink()
    os.mkfifo(path)
    return "not a regular file"


SHELLS = {
    "done only": _done_only,
    "markers and an empty model folder": _markers_and_empty_model_folder,
    "manifest without the model file": _manifest_without_the_model,
    "manifest claiming a billion ranks": _manifest_claiming_a_billion_ranks,
    "NxD tree without its model file": _nxd_tree_without_its_model_file,
    "NxD tree missing a tp rank": _nxd_tree_missing_a_tp_rank,
    "NxD tree with an empty model file": _nxd_tree_with_an_empty_model_file,
    "NxD model file is a FIFO": _nxd_model_file_is_a_fifo,
}


@pytest.mark.parametrize("shell", list(SHELLS))
def test_a_tag_that_only_looks_complete_is_never_latest_nor_kept_in_place_of_a_loadable_one(ckpt, caplog, shell):
    """step_99 has `done` but not the files of a checkpoint: listed as unloadable with why, never
    the latest, never counted by retention (prune, a save's retention, an async save's), never
    removed by it either; resuming skips it with a log line."""
    why = SHELLS[shell](ckpt)
    runner = CliRunner()
    out = runner.invoke(cli, ["ckpt", "list", str(ckpt)])
    assert out.exit_code == 0, out.output
    row = next(line for line in out.stdout.splitlines() if line.startswith("step_99"))
    assert "UNLOADABLE" in row and "latest" not in row, out.stdout
    reason = next(line for line in out.stderr.splitlines() if line.startswith("step_99"))
    assert "cannot be loaded" in reason and why in reason, out.stderr
    out = runner.invoke(cli, ["ckpt", "export", str(ckpt), str(ckpt.parent / "hf"), "--tag", "step_99"])
    assert out.exit_code == 2 and one_line(out.output) and "cannot be loaded" in out.output, out.output
    assert not (ckpt.parent / "hf").exists()
    listed = json.loads(runner.invoke(cli, ["ckpt", "list", str(ckpt), "--json"]).stdout)
    assert listed["latest"] == "step_2" and latest(ckpt) == "step_2"
    info = {c["tag"]: c for c in listed["checkpoints"]}["step_99"]
    assert info["loadable"] is False and why in info["problem"]

    with caplog.at_level(logging.WARNING, logger="shardkit"):
        loaded = load_checkpoint(ckpt, "latest_if_exists")
    assert loaded.tag == "step_2" and "step_99" in caplog.text
    with pytest.raises(ShardkitError, match="step_99.*cannot be loaded") as e:
        load_checkpoint(ckpt, "step_99")
    assert one_line(str(e.value))

    out = runner.invoke(cli, ["ckpt", "prune", str(ckpt), "--keep", "1"])
    assert out.exit_code == 0, out.output
    assert "removed step_1" in out.stdout and "kept step_2" in out.stdout
    assert any(line.startswith("kept step_99") and "cannot be loaded" in line for line in out.stdout.splitlines())
    assert [t for t, _ in tags(ckpt)] == ["step_2", "step_99"]

    with Checkpointer() as ck:  # a save's retention, and an async save's, count only loadable tags
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardkit"):
            save(ckpt, 3, ck, num_kept=1)
        assert "step_99" in caplog.text and "cannot be loaded" in caplog.text  # and say why they keep it
        assert [t for t, _ in tags(ckpt)] == ["step_3", "step_99"]
        ck.save(ckpt, "step_4", pieces(4), layout=LAYOUT, config=CONFIG, async_save=True, num_kept=1)
        ck.wait()
    assert [t for t, _ in tags(ckpt)] == ["step_4", "step_99"] and latest(ckpt) == "step_4"


def test_every_rank_file_of_an_nxd_tree_and_its_xser_parts_count(tmp_path):
    """An NxD tree (no manifest) at tp 2 pp 2: loadable with all four rank files (and, in xser,
    each `.info.pt`); without any one of them it is not."""
    layout = Layout(tp=2, pp=2)
    full = ckpt_child.full_state(CONFIG, 1)["weight"]
    model = {
        (tp, pp): ckpt_child.rank_pieces(CONFIG, layout, Rank(tp=tp, pp=pp), full) for tp in (0, 1) for pp in (0, 1)
    }
    with Checkpointer() as ck:
        for step, fmt in ((1, "torch"), (2, "xser")):
            ck.save(tmp_path, f"step_{step}", model, layout=layout, config=CONFIG, format=fmt)
            ck.wait()
    for tag in ("step_1", "step_2"):
        (tmp_path / tag / "shardkit.json").unlink()
    assert latest(tmp_path) == "step_2"
    last = "model/dp_rank_00_tp_rank_01_pp_rank_01.pt"
    for victim in (f"step_2/{last}.info.pt", f"step_2/{last}", f"step_1/{last}"):
        os.rename(tmp_path / victim, tmp_path / "aside")
        infos = {i.tag: i for i in list_checkpoints(tmp_path)}
        tag = victim.split("/")[0]
        assert not infos[tag].loadable and "dp_rank_00_tp_rank_01_pp_rank_01.pt" in infos[tag].problem, victim
        os.rename(tmp_path / "aside", tmp_path / victim)
    assert all(i.loadable for i in list_checkpoints(tmp_path))


def test_a_tag_that_only_looks_complete_on_s3_is_never_latest_nor_kept(bucket, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    root = f"s3://{bucket}/run"
    for step in (1, 2):
        save_checkpoint(root, f"step_{step}", pieces(step), layout=LAYOUT, config=CONFIG, user_content={"step": step})
        finalize_checkpoint()
    s3.client().put_object(Bucket=bucket, Key="run/step_99/done", Body=b"1")
    infos = {i.tag: i for i in list_checkpoints(root)}
    assert not infos["step_99"].loadable and "no model files" in infos["step_99"].problem
    assert latest(root) == "step_2"
    assert load_checkpoint(root, "latest_if_exists").tag == "step_2"
    plan = prune_checkpoints(root, num_kept=1)
    assert plan.removed == ["step_1"] and "cannot be loaded" in plan.reasons["step_99"]
    assert [i.tag for i in list_checkpoints(root)] == ["step_2", "step_99"]


# ---- 6. tag names ------------------------------------------------------------------------------------------

BAD_NAMES = [
    "step_1\n",
    "a\nb",
    "step\t1",
    "step_1\r",
    "\x1b[31mstep_1",
    "step_1\u2028",
    "step\x7f1",
    "step\u202e1",
    "-rf",
    " step_1",
    "step_1 ",
    "x" * 256,
    "",
    ".",
    "..",
    "a/b",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=[ascii(n)[:20] for n in BAD_NAMES])
def test_tag_names_with_control_characters_are_refused_everywhere(ckpt, tmp_path, name):
    before = sorted(os.listdir(ckpt))
    with pytest.raises(CheckpointError, match="is not a plain folder name") as e:
        save_checkpoint(ckpt, name, pieces(9), layout=LAYOUT, config=CONFIG)
    assert one_line(str(e.value)) and isinstance(e.value, ShardkitError)
    with pytest.raises(ShardkitError, match="is not a plain folder name") as e:
        Checkpointer().save(ckpt, name, pieces(9), layout=LAYOUT, config=CONFIG, async_save=True)
    assert one_line(str(e.value))
    with pytest.raises(ShardkitError, match="is not a plain folder name") as e:
        load_checkpoint(ckpt, name)
    assert one_line(str(e.value))
    for command in ("export", "inspect"):
        args = ["ckpt", command, str(ckpt)] + ([str(tmp_path / "hf")] if command == "export" else [])
        out = CliRunner().invoke(cli, [*args, "--tag", name])
        assert out.exit_code == 2 and one_line(out.output) and "is not a plain folder name" in out.output, out.output
    assert sorted(os.listdir(ckpt)) == before and not (tmp_path / "hf").exists()


def test_a_tag_folder_with_a_control_character_is_listed_on_one_line_and_never_loaded(ckpt):
    odd = "step_9\nstep_100"  # made by hand, or by an older version: never read as two tags
    shutil.copytree(ckpt / "step_2", ckpt / odd)
    edit_manifest(ckpt / odd, lambda d: d["checkpoint"].update(step=9))
    runner = CliRunner()
    out = runner.invoke(cli, ["ckpt", "list", str(ckpt)])
    assert out.exit_code == 0, out.output
    rows = out.stdout.splitlines()
    assert len(rows) == 4 and rows[0].startswith("tag") and "'step_9\\nstep_100'" in rows[3] and "UNLOADABLE" in rows[3]
    assert one_line(out.stderr) and "control character" in out.stderr
    assert latest(ckpt) == "step_2" and load_checkpoint(ckpt, "latest_if_exists").tag == "step_2"
    out = runner.invoke(cli, ["ckpt", "prune", str(ckpt), "--keep", "1"])
    assert out.exit_code == 0 and len(out.stdout.splitlines()) == 3, out.output
    assert [t for t, _ in tags(ckpt)] == ["step_2", odd]


# ---- 7. a checkpoint folder that is a symlink -----------------------------------------------------------


def test_saving_into_or_pruning_a_checkpoint_folder_that_is_a_symlink_is_refused(ckpt, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(ckpt, target_is_directory=True)
    before = snapshot(ckpt)
    for async_save in (False, True):
        with pytest.raises(ShardkitError, match="is a symlink") as e:
            Checkpointer().save(
                link, "step_3", pieces(3), layout=LAYOUT, config=CONFIG, async_save=async_save, num_kept=1
            )
        assert one_line(str(e.value))
    for spelled in (str(link) + "/", str(link) + "/step_1/..", str(link) + "/./"):
        with pytest.raises(ShardkitError, match="is a symlink"):
            save_checkpoint(spelled, "step_3", pieces(3), layout=LAYOUT, config=CONFIG)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere", target_is_directory=True)
    with pytest.raises(ShardkitError, match="is a symlink"):
        save_checkpoint(dangling, "step_3", pieces(3), layout=LAYOUT, config=CONFIG)
    assert not (tmp_path / "nowhere").exists()
    out = CliRunner().invoke(cli, ["ckpt", "prune", str(link), "--keep", "1"])
    assert out.exit_code == 2 and one_line(out.output) and "is a symlink" in out.output, out.output
    assert snapshot(ckpt) == before
    assert load_checkpoint(link, "latest_if_exists").tag == "step_2"  # reading through it is fine


# ---- 8. two files of one rank -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["model", "optim"])
def test_two_files_of_one_rank_are_refused_not_one_of_them_picked(ckpt, tmp_path, kind):
    """An NxD tree holding, beside a rank's file, step_1's file of the same rank under another
    spelling of the rank number (`tp_rank_0` for `tp_rank_00`): which one is the tag's cannot be
    told, and taking whichever the folder lists last could resume from step_1's state. `ckpt
    reshard` refuses it in one line naming both; nothing is written."""
    tag = _nxd_copy(ckpt, "step_99")
    name, stale = "dp_rank_00_tp_rank_00_pp_rank_00.pt", "dp_rank_00_tp_rank_0_pp_rank_00.pt"
    shutil.copyfile(ckpt / "step_1" / kind / name, tag / kind / stale)
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    run = CliRunner().invoke(
        cli,
        [
            "ckpt",
            "reshard",
            str(ckpt),
            str(tmp_path / "out"),
            "--tag",
            "step_99",
            "--config",
            str(tmp_path / "config.json"),
        ],
    )
    assert run.exit_code == 2 and one_line(run.output), run.output
    assert f"{name} and " in run.output and f"{kind}/{stale} are both the" in run.output
    assert not (tmp_path / "out").exists()
