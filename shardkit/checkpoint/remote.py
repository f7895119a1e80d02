"""Training checkpoints in object storage (`s3://bucket/prefix`), with NxD's keys and protocol.

NxD's trainer keeps its checkpoints in S3 under the same tree as on disk
(`<prefix>/<tag>/model/dp_rank_.._tp_rank_.._pp_rank_...pt`, `optim/...`, `scheduler.pt`,
`user_content.pt`, `checkpoint`, and `done` written last), a tag being complete once `done`
exists. shardkit reads and writes exactly that:

- listing, loading and inspecting go through a local mirror of the prefix (`io.remote`): small
  objects (markers, manifests, the scheduler) are fetched whole, tensor files only in the ranges
  read;
- a save writes the tag into a local staging root with the usual code (every rank, `done`
  last), then rank 0 uploads it: `<tag>/.shardkit-owner` (host, pid) first, the files (local
  copies deleted as each is up), `done` last, then the owner object is deleted. A tag whose
  upload was killed has no `done`: it lists as incomplete, `latest_if_exists` skips it, and the
  next save's retention removes it (its owner is a process of this host that no longer runs),
  saying so;
- retention and `prune` delete a tag's `done` first, then its files, its `checkpoint` marker last.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..io import remote as remote_io
from ..io import s3
from ..io.delete import remove_tree
from ..io.location import RemoteLocation
from ..io.location import remote as remote_location
from ..io.transaction import OWNER_FILE
from ..io.upload import remove_objects, upload_tree
from .tree import (
    CHECKPOINT_MARKER,
    DONE_MARKER,
    CheckpointInfo,
    RetentionPlan,
    list_checkpoints,
    plan_retention,
    prune_checkpoints,
)

log = logging.getLogger(__name__)


def staging_root(loc: RemoteLocation) -> Path:
    """The local folder a save to `loc` writes its tag into before uploading it: the same path for
    every rank of this host (named after the location), in the system's temporary folder."""
    digest = hashlib.sha256(str(loc).encode()).hexdigest()[:16]
    root = Path(tempfile.gettempdir()) / f"shardkit-s3-save-{digest}"
    root.mkdir(mode=0o700, exist_ok=True)
    return root


def list_remote(loc: RemoteLocation, details: bool = True) -> list[CheckpointInfo]:
    """`tree.list_checkpoints` of a prefix (its markers and small files fetched, nothing else);
    each info's path is the tag's URL."""
    with remote_io.mirrors_scope():
        objects = s3.list_objects(loc)
        if not objects:
            s3.check_bucket(loc)
            return []
        mirror = remote_io.open_mirror(loc, objects)
        infos = list_checkpoints(mirror.root, details)
        return [dataclasses.replace(i, path=str(loc.child(i.tag))) for i in infos]  # type: ignore[arg-type]


def remove_remote_tags(loc: RemoteLocation, tags: list[str]) -> RetentionPlan:
    """Delete whole tags: every `done` first, then each tag's files, its `checkpoint` marker last."""
    plan = RetentionPlan(remove=list(tags))
    names = [o.name for o in s3.list_objects(loc)]
    by_tag = {tag: [n for n in names if n.startswith(tag + "/")] for tag in tags}
    s3.delete_objects(loc, [f"{t}/{DONE_MARKER}" for t in tags if f"{t}/{DONE_MARKER}" in by_tag[t]])
    for tag, members in by_tag.items():
        try:
            marker = f"{tag}/{CHECKPOINT_MARKER}"
            remove_objects(loc, [n for n in members if n != marker])
            s3.delete_objects(loc, [marker] if marker in members else [])
            plan.removed.append(tag)
        except Exception as e:  # noqa: BLE001 - recorded; the other tags are still removed
            plan.failed[tag] = str(e)
    if plan.removed:
        log.info("retention removed %s from %s", ", ".join(plan.removed), loc)
    return plan


def prune_remote(
    loc: RemoteLocation,
    num_kept: int | None,
    keep_every: int | None,
    dry_run: bool = False,
    protect: tuple[str, ...] = (),
) -> RetentionPlan:
    """`tree.prune_checkpoints` of a prefix (no lock: an object store has none; run one writer)."""
    infos = list_remote(loc, details=False)
    plan = plan_retention(infos, num_kept, keep_every, protect)
    for tag in plan.remove:
        why = plan.reasons.get(tag, "")
        if "no longer runs" in why:
            log.warning("removing %s/%s: %s", loc, tag, why)
    if dry_run or not plan.remove:
        return plan
    done = remove_remote_tags(loc, plan.remove)
    plan.removed, plan.failed = done.removed, done.failed
    return plan


def upload_tag(tag_dir: Path, loc: RemoteLocation) -> None:
    """Rank 0, once the tag is complete locally: upload it under `loc/<tag>` as the module's
    docstring says, replacing a tag of that name (its `done` goes first), then remove the local copy."""
    tag = tag_dir.name
    existing = [o.name for o in s3.list_objects(loc.child(tag))]
    owner = f"{socket.gethostname()} {os.getpid()}\n".encode()
    s3.put_bytes(loc, f"{tag}/{OWNER_FILE}", owner)
    if existing:
        remove_objects(loc.child(tag), [n for n in existing if n != OWNER_FILE])
    local_owner = tag_dir / OWNER_FILE
    local_owner.unlink(missing_ok=True)
    upload_tree(tag_dir, loc.child(tag))  # `done` last
    s3.delete_objects(loc, [f"{tag}/{OWNER_FILE}"])
    remove_tree(tag_dir)


def remote_saver(loc: RemoteLocation, run_save: Callable[..., None], agree: Callable[..., Any]) -> Callable[..., None]:
    """`save.run_save` for a checkpoint directory in object storage: the local save into the
    staging root on every rank (retention there skipped), then rank 0 uploads the tag and applies
    retention to the prefix."""

    def run(job: Any, comm: Any, retention: Any = None) -> None:
        if job.leader:
            for stale in job.root.iterdir():  # a tag a killed upload left in the staging root
                if stale.is_dir() and stale.name != job.tag:
                    remove_tree(stale)
        run_save(job, comm, retention=None)

        def publish() -> None:
            if not job.leader:
                return
            upload_tag(job.tag_dir, loc)
            log.info("uploaded checkpoint %s to %s", job.tag, loc)
            try:
                prune_remote(loc, job.num_kept, job.keep_every, protect=(job.tag,))
            except Exception:  # noqa: BLE001 - retention must never fail a save or training
                log.exception("checkpoint retention in %s failed (retried at the next save)", loc)

        agree(comm, f"uploading checkpoint {job.tag}", publish, job.tag_dir)

    return run


# ---- the package's public listing functions, for a local folder or a prefix -------------------------


def list_checkpoints_at(directory: str | Path, details: bool = True) -> list[CheckpointInfo]:
    """`tree.list_checkpoints`; `directory` may be s3://bucket/prefix."""
    loc = remote_location(directory, "checkpoint directory")
    return list_checkpoints(directory, details) if loc is None else list_remote(loc, details)


def latest_at(directory: str | Path) -> str | None:
    """The newest complete tag that is not damaged, or None (`tree.latest`, for s3:// too)."""
    loadable = [i for i in list_checkpoints_at(directory, details=False) if i.loadable]
    return loadable[-1].tag if loadable else None


def has_checkpoint_at(directory: str | Path) -> bool:
    return latest_at(directory) is not None


def prune_checkpoints_at(
    directory: str | Path,
    num_kept: int | None = None,
    keep_every: int | None = None,
    dry_run: bool = False,
    protect: tuple[str, ...] = (),
    fsync: bool = True,
) -> RetentionPlan:
    """`tree.prune_checkpoints`; `directory` may be s3://bucket/prefix."""
    loc = remote_location(directory, "checkpoint directory")
    if loc is None:
        return prune_checkpoints(directory, num_kept, keep_every, dry_run, protect, fsync)
    return prune_remote(loc, num_kept, keep_every, dry_run, protect)
