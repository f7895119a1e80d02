"""Writing object storage: the output transaction without rename.

An object store has no rename, so an output there is complete only once its record is written
(`io.objects.published`: `.shardkit-output`, naming every object of the output; after a Hugging Face
folder's index and config, a manifest or a checkpoint tag's `done`). `remote_output` is the
object-store twin of `transaction.staged_output`:

1. this host's write lock on the prefix is taken (`_write_lock`: one writer per prefix per host,
   threads included), then the destination is checked: it must not overlap a source prefix; it must be empty unless
   `overwrite`, which replaces only what shardkit wrote there (its record's objects, or an older
   output's manifest's) and the objects named by `replace` globs: any other object, and any at a
   bucket's root, is refused in one line (`replaceable`). What an interrupted run of this host
   left (its `.shardkit-writing` marker names a process that no longer runs) is repaired, saying
   so: a committed replace is finished, anything else it uploaded removed;
2. `.shardkit-writing` (host, pid) is written first, by a conditional PUT (If-None-Match: *)
   that S3 decides atomically, so of two runs started on one prefix at once only one writes;
   a prefix whose marker names a process of this host that still runs is refused even with
   `overwrite` (another host's marker is taken over with `overwrite`: whether that run still
   runs cannot be told from here). A prefix being written for the first time reads as incomplete
   until its record is up (opening it as a source is refused, a checkpoint's tags lack `done`);
3. the caller writes into a local staging folder in this user's private temporary folder
   (`transaction.private_root`; nothing beside the destination, nothing in the working
   directory); each file its writers close goes up at once (`StreamingUpload`, the output's sink,
   which `remote_output` yields beside the folder for the caller to hand down to its staged output
   and writers, `io.safety.sinks`: multipart, several files in flight, the local copy deleted once
   it is up), so uploading overlaps writing and the local folder holds only the files in flight. A
   first output goes to its own names; a replace goes beside the old output, under a staged sub-prefix,
   while the old output stays as it was, readable;
4. commit: the staged output's rename waits for those uploads; then the files written last (a
   manifest, config, tokenizer files) go up, the final objects one kind after another, then the
   record (the commit); a replace is then finished (`published.finish`: copied into place
   server-side, the old objects the new output lacks deleted last) and the marker deleted;
5. on failure, Ctrl-C or SIGTERM before the commit the uploads under way are cancelled (their
   multipart uploads aborted) and what was uploaded is deleted again (a replace's staged objects:
   the old output is untouched); after a kill, the marker says a run was writing until the next
   run repairs the prefix (and aborts the multipart uploads the killed run left open under it).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import logging
import os
import secrets
import socket
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

from ...errors import DestinationExistsError, ShardkitError
from ...sizes import format_bytes
from ..location import RemoteLocation
from ..safety.lock import FolderInUseError, FolderLock, lock_folder
from ..safety.oserror import shown
from ..safety.transaction import (
    OWNER_FILE,
    STAGING_TAG,
    owner_text,
    parse_owner,
    pid_alive,
    private_root,
    sibling_name,
    signals_deferred,
    temporary_folder,
    terminate_as_interrupt,
)
from . import published, s3
from .published import WRITING, final_rank, remove_objects

log = logging.getLogger(__name__)

FILES_IN_FLIGHT = 4
"""Files of one output uploading at once; a writer closing one more waits (the local copy of an
output holds at most these, beside the files being written)."""


def writing_here(owner: tuple[str, int] | None, loc: RemoteLocation) -> bool | None:
    """Whether the writer a marker of `loc` names still writes it, asked with this host's write
    lock on `loc` held (`_write_lock`): this process is then the only one of the host writing it,
    so a marker naming it is one an earlier write left; another process of this host that still
    runs may be a writer without the lock (an older shardkit); None for another host's, which
    cannot be told from here."""
    if owner is None or owner[0] != socket.gethostname():
        return None
    return False if owner[1] == os.getpid() else pid_alive(owner[1])


def _write_lock(loc: RemoteLocation) -> FolderLock:
    """This host's lock on writing `loc`: one writer of a prefix per host, threads of one process
    included (an flock on a file of this user's private folder, named by the prefix's digest)."""
    root = private_root(None, "s3-writing")
    digest = hashlib.sha256(str(loc).encode(errors="surrogateescape")).hexdigest()[:24]
    try:
        return lock_folder(root, f"writing {loc}", name=str(root / f"{digest}.lock"), remove=True)
    except FolderInUseError:
        raise DestinationExistsError(
            f"{loc} is being written by another run of this host: wait for it to finish (or stop it) and run "
            "again, or write elsewhere"
        ) from None


def _writer(owner: tuple[str, int] | None) -> str:
    return f"process {owner[1]} on {owner[0]}" if owner else "another run"


def upload_tree(
    local: Path, loc: RemoteLocation, files_in_flight: int = 4, remove: bool = True, exclude: Collection[str] = ()
) -> int:
    """Upload every file under `local` to `loc` (names relative to `local`, but those in
    `exclude`): the others first, several at once, then the final objects one kind after another
    (a tag's `done` very last). Links are never followed. With `remove`, each local file is
    deleted once it is up. Returns the bytes uploaded."""
    files = _tree_files(local, exclude)
    sent = 0
    uploader = s3.Uploader(files_in_flight)
    ok = False
    try:
        for rank in sorted({r for r, _, _ in files}):
            for _, rel, path in sorted(f for f in files if f[0] == rank):
                uploader.upload(path, loc, rel, remove=remove)
            sent = uploader.wait()  # every object of this rank is up before the next rank starts
        ok = True
    finally:
        uploader.close(cancel=not ok)
    return sent


def _tree_files(local: Path, exclude: Collection[str] = ()) -> list[tuple[int, str, Path]]:
    """The regular files under `local` (links neither followed nor taken), but those in `exclude`:
    (`final_rank`, name relative to `local`, path)."""
    files: list[tuple[int, str, Path]] = []
    for here, dirs, names in os.walk(local):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(here, d))]
        for name in names:
            path = Path(here) / name
            if path.is_symlink() or not path.is_file():
                continue
            rel = path.relative_to(local).as_posix()
            if rel not in exclude:
                files.append((final_rank(rel), rel, path))
    return files


def check_destination(
    loc: RemoteLocation, overwrite: bool, sources: Sequence[RemoteLocation], patterns: Sequence[str] = ()
) -> list[str]:
    """Step 1 of `remote_output`: what an interrupted run left is finished or removed; returns the
    names of the objects an overwrite replaces (see `replaceable`)."""
    for src in sources:
        if loc.overlaps(src):
            raise ShardkitError(
                f"destination {loc} overlaps the source {src} (the same prefix, or one inside the other): "
                "choose another destination"
            )
    names = [o.name for o in s3.list_objects(loc)]
    if not names:
        s3.check_bucket(loc)
        return []
    if WRITING in names:
        names = _take_over(loc, names, overwrite)
    if not [n for n in names if not published.hidden(n)]:
        if published.RECORD in names:  # the record of an output with no objects: nothing it names is read
            s3.delete_objects(loc, [published.RECORD])
        return []
    if not overwrite:
        raise DestinationExistsError(f"{loc} exists and is not empty: pass --overwrite to replace it")
    return replaceable(loc, names, patterns)


def _take_over(loc: RemoteLocation, names: list[str], overwrite: bool) -> list[str]:
    """A prefix marked as being written: refused while its writer runs (or, without `overwrite`,
    may run); else what that run left is repaired, saying so (a committed replace finished, a
    replace's staged objects or a first write's objects removed). Returns the names left."""
    text = s3.get_bytes(loc, WRITING)
    owner = parse_owner(text)
    alive = writing_here(owner, loc)
    if alive:
        raise DestinationExistsError(
            f"{loc} is being written by {_writer(owner)}, which still runs: wait for it to finish (or stop "
            "it) and run again, or write elsewhere"
        )
    if alive is None and not overwrite:
        raise DestinationExistsError(
            f"{loc} is being written by {_writer(owner)} (or that run was interrupted): pass --overwrite to replace it"
        )
    if alive is None:  # another host's run, running or killed (which cannot be told from here)
        log.warning("%s: taking it over from %s, whose run may still be writing (--overwrite)", loc, _writer(owner))
    who = f"a run (process {owner[1] if owner else '?'})"
    record = published.read_record(loc) if published.RECORD in names else None
    if record is not None and (record.under or record.replaces):
        published.finish(loc, record)
        log.warning("%s: finished the replace that %s committed before it was stopped", loc, who)
    elif record is None and not _staged_run(text):  # a first write, stopped before its commit
        left = [n for n in names if n != WRITING]
        remove_objects(loc, left)
        log.warning(
            "removed %d objects under %s, left incomplete by %s that is no longer writing it", len(left), loc, who
        )
    removed = published.remove_staged(loc)
    if removed:
        log.warning(
            "removed %d staged objects under %s, left incomplete by %s that is no longer writing it", removed, loc, who
        )
    s3.abort_uploads(loc)
    s3.delete_objects(loc, [WRITING])
    return [o.name for o in s3.list_objects(loc)]


def _staged_run(marker: bytes | None) -> bool:
    """Whether a writing marker's run wrote beside an old output (a replace), not in place."""
    return b"\nstaged " in (marker or b"")


def replaceable(loc: RemoteLocation, names: Sequence[str], patterns: Sequence[str] = ()) -> list[str]:
    """The objects `names` under `loc` that `--overwrite` replaces: those shardkit wrote (its record
    names them, or the manifest of an older output) and those matching one of `patterns` (shell
    globs of names relative to `loc`). Any other object, and at a bucket root any object at all
    that no pattern names, is refused in one line before anything is written."""
    visible = [n for n in names if not published.hidden(n)]
    named = [n for n in visible if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not loc.prefix:
        unnamed = [n for n in visible if n not in set(named)]
        if unnamed:
            raise DestinationExistsError(
                f"{loc} is a whole bucket ({len(visible)} objects, e.g. {_examples(unnamed)}): --overwrite of a bucket "
                f"replaces only the objects named with --replace-objects GLOB ('*' for all of them); or write under a "
                "prefix"
            )
        return visible
    ours = published.shardkit_names(loc, names)
    unnamed = [n for n in visible if n not in ours and n not in set(named)]
    if unnamed:
        raise DestinationExistsError(
            f"{loc} holds {len(unnamed)} objects shardkit did not write (e.g. {_examples(unnamed)}): --overwrite "
            "replaces only shardkit's own output; name the others to delete with --replace-objects GLOB ('*' for "
            "all), or write elsewhere"
        )
    return visible


def _examples(names: Sequence[str]) -> str:
    return ", ".join(shown(n, 80) for n in names[:3]) + (", ..." if len(names) > 3 else "")


class StreamingUpload:
    """The sink (`io.safety.sinks`) of a remote output's local folder: each file the writers close
    in it, or in its staging folder, goes up at once (several in flight; `files_in_flight` bounds
    them, so a writer that gets ahead waits and the local copy holds only the files in flight), and
    is deleted locally once it is up. The final objects wait for `upload_tree` at the commit."""

    def __init__(self, loc: RemoteLocation, local: Path, files_in_flight: int = FILES_IN_FLIGHT):
        self.loc = loc
        self.folders = (local.absolute(), sibling_name(local.absolute(), STAGING_TAG))
        self._uploader = s3.Uploader(files_in_flight)
        self.sent = 0
        self.names: list[str] = []  # the objects sent (their local files are gone)

    def closed(self, path: Path) -> None:
        path = Path(path).absolute()
        for folder in self.folders:
            if folder in path.parents:
                rel = path.relative_to(folder).as_posix()
                if rel != OWNER_FILE and final_rank(rel) == 0:
                    self._uploader.upload(path, self.loc, rel, remove=True)
                    self.names.append(rel)
                return

    def drain(self) -> None:
        self.sent = self._uploader.wait()

    def close(self, cancel: bool) -> None:
        self._uploader.close(cancel=cancel)


@contextlib.contextmanager
def remote_output(
    loc: RemoteLocation,
    *,
    overwrite: bool = False,
    sources: Sequence[RemoteLocation] = (),
    what: str = "write",
    replace: Sequence[str] = (),
) -> Iterator[tuple[Path, StreamingUpload]]:
    """Yield a local path (not yet existing, in a temporary folder) to write the output into, and
    its sink: the files handed to the sink (by the writers and the staged output the caller gives
    it to) go up as they are closed, the rest on a normal exit, then the output is committed
    (`published.commit`), as the module's docstring says. `replace`: globs naming objects
    shardkit did not write that `overwrite` may replace (`replaceable`)."""
    with terminate_as_interrupt(), _write_lock(loc):
        replaced = check_destination(loc, overwrite, sources, replace)
        staged = f"{published.STAGED}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}" if replaced else ""
        marker = owner_text() + (f"staged {staged}\n" if staged else "")
        if not s3.put_new(loc, WRITING, marker.encode()):  # claimed atomically: of two runs, one writes
            owner = parse_owner(s3.get_bytes(loc, WRITING))
            raise DestinationExistsError(
                f"{loc} is being written by {_writer(owner)}, which began while this run checked it: wait for it "
                "to finish and run again, or write elsewhere"
            )
        target = loc.child(staged) if staged else loc  # a replace writes beside the old output
        started = True
        streaming: StreamingUpload | None = None
        try:
            with temporary_folder(prefix="shardkit-s3-out-") as work:
                local = work.path / (loc.name or loc.bucket)
                streaming = StreamingUpload(target, local, FILES_IN_FLIGHT)
                yield local, streaming
                streaming.drain()
                if not local.exists():
                    raise ShardkitError(f"nothing was written for {loc}")
                names = set(streaming.names) | {rel for _, rel, _ in _tree_files(local)}
                sent = streaming.sent + upload_tree(local, target)
                log.info("%s: uploaded %s (%s)", loc, format_bytes(sent), what)
            objects = [o for o in s3.list_objects(target) if o.name in names]
            with signals_deferred():  # committed, or not at all: nothing of it is undone from here
                record = published.commit(loc, objects, staged, replaced)
                started = False
            _finish(loc, record)
        finally:
            if streaming is not None:
                streaming.close(cancel=started)
            if started:
                _undo(loc, staged)


def _finish(loc: RemoteLocation, record: published.Record) -> None:
    """After the commit: a replace finished (`published.finish`), the writing marker deleted. A
    failure here is said, not raised: the new output is committed and read as such, and the next
    run into the prefix finishes what is left."""
    try:
        if record.under or record.replaces:
            published.finish(loc, record)
            log.info("%s: replaced the output it held (%d objects no longer in it)", loc, len(record.replaces))
        s3.delete_objects(loc, [WRITING])
    except ShardkitError as e:
        log.warning(
            "%s: the new output is committed and read as such, but its replace could not be finished (%s): the "
            "next run into it finishes it",
            loc,
            e,
        )


def _undo(loc: RemoteLocation, staged: str) -> None:
    """Delete what a failed run uploaded (its marker last): a replace's staged objects, the old
    output left as it was; a first write's objects. Logged, never raised."""
    try:
        if staged:
            published.remove_staged(loc)
        else:
            remove_objects(loc, [o.name for o in s3.list_objects(loc) if o.name != WRITING])
        s3.abort_uploads(loc.child(staged) if staged else loc)
        s3.delete_objects(loc, [WRITING])
    except (ShardkitError, OSError) as e:
        log.warning("could not remove the incomplete upload under %s (%s): the next run removes it", loc, e)
