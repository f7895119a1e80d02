"""The checkpoint tree on disk: markers, durable writes, listing, ordering, retention, deletion.

Nothing here knows about tensors. See base.py for the protocol these functions keep.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..formats import nxd
from ..formats import MANIFEST
from .base import CheckpointError, check_retention

log = logging.getLogger(__name__)

CHECKPOINT_MARKER = "checkpoint"
DONE_MARKER = "done"
CONFIG = "config.json"
SCHEDULER = "scheduler.pt"
USER_CONTENT = "user_content.pt"
MODEL_DIR = "model"
OPTIM_DIR = "optim"

_STEP_RE = re.compile(r"step[=_\-]?(\d+)", re.IGNORECASE)
_LAST_INT_RE = re.compile(r"(\d+)(?!.*\d)")


# ---- durable writes ------------------------------------------------------------------------------


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (its entries) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: Path, text: str, fsync: bool = True) -> None:
    """Write a small file and (with fsync) make it and its directory entry durable."""
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
    if fsync:
        fsync_path(path.parent)


def write_marker(tag_dir: Path, name: str, fsync: bool = True) -> None:
    """NxD's marker files hold the text "1"."""
    write_text(Path(tag_dir) / name, "1", fsync)


def check_tag_name(tag: str) -> str:
    tag = str(tag)
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or tag.startswith("."):
        raise CheckpointError(f"tag {tag!r} is not a plain folder name: use e.g. step_1000")
    return tag


# ---- listing -------------------------------------------------------------------------------------


def tag_step(tag: str) -> int | None:
    """The step in a tag name: step_120, epoch=1-step=120, global_step120, or a bare number."""
    m = _STEP_RE.search(tag) or _LAST_INT_RE.search(tag)
    return int(m.group(1)) if m else None


def read_manifest(tag_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(tag_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(tag_dir: Path) -> bool:
    return (Path(tag_dir) / DONE_MARKER).is_file()


@dataclass
class CheckpointInfo:
    """One tag of a checkpoint directory."""

    tag: str
    path: Path
    complete: bool
    step: int | None
    layout: dict[str, Any] | None  # the saved layout (manifest), or tp/pp/ep seen in file names
    format: str | None
    size: int  # bytes of every file under the tag
    mtime: float  # of the `checkpoint` marker (when the save began)
    manifest: bool = False  # True when written by shardkit (shardkit.json present)
    files: int = 0

    @property
    def layout_text(self) -> str:
        if not self.layout:
            return "-"
        text = f"tp{self.layout.get('tp', 1)} pp{self.layout.get('pp', 1)}"
        if self.layout.get("ep", 1) > 1:
            text = f"ep{self.layout['ep']} " + text
        if self.layout.get("kv_multiplier", 1) > 1:
            text += f" kv{self.layout['kv_multiplier']}"
        if self.layout.get("qkv") and self.layout.get("qkv") != "separate":
            text += f" {self.layout['qkv']}"
        return text

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"] = str(self.path)
        return data


def _tree_size(path: Path) -> tuple[int, int]:
    size = count = 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                size += os.stat(os.path.join(folder, name)).st_size
                count += 1
            except OSError:
                pass  # removed meanwhile
    return size, count


def _info(tag_dir: Path, details: bool = True) -> CheckpointInfo:
    complete = is_complete(tag_dir)
    manifest = read_manifest(tag_dir)
    marker = tag_dir / CHECKPOINT_MARKER
    try:
        mtime = (marker if marker.is_file() else tag_dir).stat().st_mtime
    except OSError:
        mtime = 0.0
    step = None
    layout = fmt = None
    if manifest:
        step = (manifest.get("checkpoint") or {}).get("step")
        layout, fmt = manifest.get("layout"), manifest.get("format")
    if step is None:
        step = tag_step(tag_dir.name)
    if layout is None and details:
        try:
            found = nxd.find_rank_files(tag_dir)
        except Exception:  # noqa: BLE001 - incomplete or damaged: no layout to show
            found = None
        if found is not None:
            layout, fmt = {"tp": found.tp, "pp": found.pp, "ep": found.ep}, found.format
    size, count = _tree_size(tag_dir) if details else (0, 0)
    return CheckpointInfo(tag_dir.name, tag_dir, complete, step, layout, fmt, size, mtime, manifest is not None, count)


def _is_tag(path: Path) -> bool:
    return path.is_dir() and not path.name.startswith(".") and (
        (path / CHECKPOINT_MARKER).is_file() or (path / DONE_MARKER).is_file())


def list_checkpoints(directory: str | Path, details: bool = True) -> list[CheckpointInfo]:
    """Every tag (complete or not) of a checkpoint directory, oldest first (see base.py, rule 5).
    Without `details`, sizes and the layouts of NxD tags (no manifest) are not looked up."""
    root = Path(directory)
    if not root.is_dir():
        return []
    infos = [_info(p, details) for p in root.iterdir() if _is_tag(p)]
    if all(i.step is not None for i in infos):
        infos.sort(key=lambda i: (i.step, i.mtime, i.tag))
    else:
        infos.sort(key=lambda i: (i.mtime, i.tag))
    return infos


def latest(directory: str | Path) -> str | None:
    """The newest complete tag, or None."""
    complete = [i for i in list_checkpoints(directory, details=False) if i.complete]
    return complete[-1].tag if complete else None


def has_checkpoint(directory: str | Path) -> bool:
    """Whether the directory holds at least one complete checkpoint."""
    return latest(directory) is not None


# ---- retention -----------------------------------------------------------------------------------


@dataclass
class RetentionPlan:
    """Which tags retention keeps and removes, and why."""

    keep: list[str] = field(default_factory=list)
    remove: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)  # filled by prune (not in dry runs)
    failed: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_retention(infos: list[CheckpointInfo], num_kept: int | None, keep_every: int | None,
                   protect: tuple[str, ...] = ()) -> RetentionPlan:
    """Keep the newest `num_kept` complete tags and those whose step is a multiple of `keep_every`;
    remove the other complete tags and the incomplete tags older than the newest complete one. The
    newest complete tag and `protect`ed tags are always kept. With no complete tag, nothing goes."""
    check_retention(num_kept, keep_every)
    plan = RetentionPlan()
    complete = [i for i in infos if i.complete]
    if not complete:
        plan.keep = [i.tag for i in infos]
        return plan
    newest = complete[-1]
    newest_pos = infos.index(newest)
    kept_recent = {i.tag for i in (complete if num_kept in (None, -1) else complete[-num_kept:])}
    for pos, info in enumerate(infos):
        if info.complete:
            if info.tag in kept_recent or info is newest:
                plan.reasons[info.tag] = "newest" if info is newest else "recent"
            elif keep_every and info.step is not None and info.step % keep_every == 0:
                plan.reasons[info.tag] = f"step multiple of {keep_every}"
            elif info.tag in protect:
                plan.reasons[info.tag] = "just saved"
            else:
                plan.remove.append(info.tag)
                plan.reasons[info.tag] = f"beyond the newest {num_kept}"
                continue
        elif pos < newest_pos and info.tag not in protect:
            plan.remove.append(info.tag)
            plan.reasons[info.tag] = "incomplete and older than the newest complete tag (interrupted save or deletion)"
            continue
        else:
            plan.reasons[info.tag] = "incomplete, newer than the newest complete tag (a save in progress or crashed)"
        plan.keep.append(info.tag)
    return plan


def _remove_file(path: Path) -> None:
    """Unlink one file (a seam for tests that interrupt deletions)."""
    os.unlink(path)


def _remove_children(folder: Path, keep: str | None = None) -> None:
    for entry in list(os.scandir(folder)):
        if entry.name == keep:
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            _remove_children(path)
            os.rmdir(path)
        else:
            _remove_file(path)


def clear_done(tag_dir: Path, fsync: bool = True) -> bool:
    """Remove a tag's `done` marker durably (the first step of deleting or re-saving it)."""
    done = Path(tag_dir) / DONE_MARKER
    if not done.exists():
        return False
    _remove_file(done)
    if fsync:
        fsync_path(tag_dir)
    return True


def remove_tag(tag_dir: Path, fsync: bool = True) -> None:
    """Delete a tag so that an interruption at any point leaves an incomplete tag (or nothing):
    `done` first (durably), then every file, then the `checkpoint` marker, then the folder."""
    tag_dir = Path(tag_dir)
    if not tag_dir.exists():
        return
    clear_done(tag_dir, fsync)
    _remove_children(tag_dir, keep=CHECKPOINT_MARKER)
    marker = tag_dir / CHECKPOINT_MARKER
    if marker.exists():
        _remove_file(marker)
    try:
        os.rmdir(tag_dir)
    except OSError:  # something appeared meanwhile: leave it to the next retention
        shutil.rmtree(tag_dir, ignore_errors=True)


def apply_retention(directory: Path, plan: RetentionPlan, fsync: bool = True) -> RetentionPlan:
    """Remove `plan.remove`: every `done` marker first, then the tags one by one. A failure is
    recorded in `plan.failed` and logged; the other tags are still removed."""
    directory = Path(directory)
    for tag in plan.remove:
        try:
            clear_done(directory / tag, fsync)
        except OSError as e:
            plan.failed[tag] = str(e)
    for tag in plan.remove:
        if tag in plan.failed:
            continue
        try:
            remove_tag(directory / tag, fsync)
            plan.removed.append(tag)
        except OSError as e:
            plan.failed[tag] = str(e)
    for tag, why in plan.failed.items():
        log.warning("retention could not remove %s: %s (it is retried at the next save)", directory / tag, why)
    if plan.removed:
        log.info("retention removed %s from %s", ", ".join(plan.removed), directory)
    return plan


def prune_checkpoints(directory: str | Path, num_kept: int | None = None, keep_every: int | None = None,
                      dry_run: bool = False, protect: tuple[str, ...] = (), fsync: bool = True) -> RetentionPlan:
    """Apply retention to a checkpoint directory now (what `shardkit ckpt prune` runs)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} does not exist: give the checkpoint directory (the parent of the tags)")
    plan = plan_retention(list_checkpoints(directory, details=False), num_kept, keep_every, protect)
    return plan if dry_run else apply_retention(directory, plan, fsync)
