"""Training checkpoints in object storage (`s3://bucket/prefix`), with NxD's keys and protocol.

NxD's trainer keeps its checkpoints in S3 under the same tree as on disk
(`<prefix>/<tag>/model/dp_rank_.._tp_rank_.._pp_rank_...pt`, `optim/...`, `scheduler.pt`,
`user_content.pt`, `checkpoint`, and `done` written last), a tag being complete once `done`
exists. shardkit reads and writes exactly that:

- listing, loading and inspecting go through a local mirror of the prefix (`io.objects.remote`): small
  objects (markers, manifests, the scheduler) are fetched whole, tensor files only in the ranges
  read;
- a save: rank 0 writes `<tag>/.shardkit-owner` (host, pid) and removes a tag of that name;
  every rank writes its files into a local staging root on its host with the usual code, each
  file uploaded as soon as it is closed (local copy deleted once up); the first rank of each host
  then uploads the rest its host wrote (markers, manifest); once every host is done, rank 0
  uploads `done` and deletes the owner object. A tag whose upload was killed has no `done`: it
  lists as incomplete, `latest_if_exists` skips it, and the next save's retention removes it (its
  owner is a process of this host that no longer runs), saying so;
- retention and `prune` delete a tag's `done` first, then its files, its `checkpoint` marker last.

An object store has no lock: two jobs saving to the same prefix at once are not told of each
other (NxD's own S3 checkpoint storage has no lock either). Run one writer per prefix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ShardkitError
from ..io.location import RemoteLocation
from ..io.location import remote as remote_location
from ..io.safety.delete import remove_tree
from ..io.safety.transaction import OWNER_FILE, owner_text, private_root
from ..io.store import prefix, scope
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
    every rank of this host (named after the location), inside this user's private folder of the
    system's temporary folder (`io.safety.transaction.private_root`: never followed through a link,
    never another user's)."""
    digest = hashlib.sha256(str(loc).encode(errors="surrogateescape")).hexdigest()[:16]
    return private_root(None, f"s3-save-{digest}")


def list_remote(loc: RemoteLocation, details: bool = True) -> list[CheckpointInfo]:
    """`tree.list_checkpoints` of a prefix (its markers and small files fetched, nothing else);
    each info's path is the tag's URL."""
    with scope():
        objects = prefix(loc).listing()
        if not objects:
            prefix(loc).check_bucket()
            return []
        store = prefix(loc).mirror(objects)
        infos = list_checkpoints(store.root, details)
        return [dataclasses.replace(i, path=str(loc.child(i.tag))) for i in infos]  # type: ignore[arg-type]


def remove_remote_tags(loc: RemoteLocation, tags: list[str]) -> RetentionPlan:
    """Delete whole tags: every `done` first, then each tag's files, its `checkpoint` marker last,
    and the multipart uploads a killed save left open under the tag (stored and billed until
    aborted, though no listing shows them)."""
    plan = RetentionPlan(remove=list(tags))
    names = [o.name for o in prefix(loc).listing()]
    by_tag = {tag: [n for n in names if n.startswith(tag + "/")] for tag in tags}
    prefix(loc).delete([f"{t}/{DONE_MARKER}" for t in tags if f"{t}/{DONE_MARKER}" in by_tag[t]])
    for tag, members in by_tag.items():
        try:
            marker = f"{tag}/{CHECKPOINT_MARKER}"
            prefix(loc).remove_objects([n for n in members if n != marker])
            prefix(loc).delete([marker] if marker in members else [])
            prefix(loc.child(tag)).abort_uploads()
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


def _clear_host(job: Any) -> None:
    """Before a save, on the first rank of each host: what killed uploads left in this host's
    staging root (the leader's own tag folder is replaced by `save.prepare_tag`)."""
    for stale in job.root.iterdir():
        if stale.is_dir() and not (job.leader and stale.name == job.tag):
            remove_tree(stale)


def _begin_tag(loc: RemoteLocation, tag: str) -> None:
    """Leader: `<tag>/.shardkit-owner` (host, pid) first, then a tag of that name is removed
    (its `done` first, as a local save replaces one), then the `checkpoint` marker: from here
    until `done`, the tag lists as incomplete (and as its owner's, for the next save's retention)."""
    existing = [o.name for o in prefix(loc.child(tag)).listing()]
    prefix(loc).put(f"{tag}/{OWNER_FILE}", owner_text().encode())
    if existing:
        prefix(loc.child(tag)).remove_objects([n for n in existing if n != OWNER_FILE])
    prefix(loc).put(f"{tag}/{CHECKPOINT_MARKER}", b"1")  # NxD's marker, as `save.prepare_tag` writes it


def _upload_rest(job: Any, loc: RemoteLocation) -> None:
    """The first rank of each host, once every rank's streamed files are up: what its host's
    ranks wrote that was not streamed (markers, the manifest, config.json), but `done`."""
    (job.tag_dir / OWNER_FILE).unlink(missing_ok=True)
    prefix(loc.child(job.tag)).upload_tree(job.tag_dir, exclude=(DONE_MARKER,))
    if not job.leader:
        remove_tree(job.tag_dir)


def _finish_tag(job: Any, loc: RemoteLocation) -> None:
    """Leader, once every host's files are up: `done`, then the owner object goes; the local
    tag folder is removed."""
    prefix(loc.child(job.tag)).upload_tree(job.tag_dir)  # what is left: `done`
    prefix(loc).delete([f"{job.tag}/{OWNER_FILE}"])
    remove_tree(job.tag_dir)


def remote_saver(loc: RemoteLocation, run_save: Callable[..., None], agree: Callable[..., Any]) -> Callable[..., None]:
    """`save.run_save` for a checkpoint directory in object storage. The leader writes the tag's
    owner object (and removes a tag of that name); every rank saves into its host's staging root
    (`staging_root`: local disk), retention there skipped, each file it writes uploaded as soon as
    it is closed (`io.store.S3Prefix.streaming_upload`, the save job's sink) and deleted locally
    once up; then the first rank of each host uploads what was not streamed, and the leader
    uploads `done` and applies retention to the prefix. A failure anywhere fails the save on every
    rank: the uploads under way are cancelled, each host's staged files removed, and the leader
    deletes what was uploaded."""

    def run(job: Any, comm: Any, retention: Any = None) -> None:
        what = f"saving checkpoint {job.tag} to {loc}"
        # the staged copy only passes through: a completed upload is the durable one, so its
        # files are not synced to the local disk first (that was seconds of waiting per GB)
        job.fsync = False
        hosts = comm.gather(socket.gethostname())
        first_on_host = hosts.index(hosts[comm.rank]) == comm.rank
        agree(comm, what, lambda: _clear_host(job) if first_on_host else None, job.tag_dir)
        streaming = prefix(loc.child(job.tag)).streaming_upload(job.tag_dir)
        ok = False
        try:
            agree(comm, what, lambda: _begin_tag(loc, job.tag) if job.leader else None, job.tag_dir)
            job.sink = streaming  # the save's writers hand it each file they close
            run_save(job, comm, retention=None)
            agree(comm, what, streaming.drain, job.tag_dir)
            agree(comm, what, lambda: _upload_rest(job, loc) if first_on_host else None, job.tag_dir)
            agree(comm, what, lambda: _finish_tag(job, loc) if job.leader else None, job.tag_dir)
            ok = True
        finally:
            streaming.close(cancel=not ok)
            if not ok:
                if job.leader:
                    _discard_remote_tag(loc, job.tag)
                if first_on_host:  # this host's staged files, never left filling the temporary folder
                    with contextlib.suppress(OSError, ShardkitError):
                        remove_tree(job.tag_dir)
        if job.leader:
            log.info("uploaded checkpoint %s to %s", job.tag, loc)
            try:
                prune_remote(loc, job.num_kept, job.keep_every, protect=(job.tag,))
            except Exception:  # noqa: BLE001 - retention must never fail a save or training
                log.exception("checkpoint retention in %s failed (retried at the next save)", loc)

    return run


def _discard_remote_tag(loc: RemoteLocation, tag: str) -> None:
    """After a failed upload: the tag's objects (it has no `done`), logged, never raised."""
    try:
        remove_remote_tags(loc, [tag])
    except Exception as e:  # noqa: BLE001 - the save's own failure is the one to report
        log.warning("could not remove the incomplete upload %s/%s (%s): the next save removes it", loc, tag, e)


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
