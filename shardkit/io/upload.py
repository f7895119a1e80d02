"""Writing object storage: the output transaction without rename.

An object store has no rename, so an output there is complete only once its last object is
written: the manifest (`shardkit.json`), a Hugging Face folder's index or config, or a training
checkpoint tag's `done` marker (NxD's protocol). `remote_output` is the object-store twin of
`transaction.staged_output`:

1. the destination is checked: it must not overlap a source prefix; it must be empty unless
   `overwrite`; a prefix left by an interrupted run of this host (its `.shardkit-writing` marker
   names a process that no longer runs) is removed, saying so;
2. `.shardkit-writing` (host, pid) is written first, by a conditional PUT (If-None-Match: *)
   that S3 decides atomically, so of two runs started on one prefix at once only one writes;
   a prefix whose marker names a process of this host that still runs is refused even with
   `overwrite` (another host's marker is taken over with `overwrite`: whether that run still
   runs cannot be told from here). Until the marker is gone the prefix reads as incomplete
   (opening it as a source is refused, a checkpoint's tags lack `done`);
3. the caller writes into a local staging folder in the system's temporary folder (nothing
   beside the destination, nothing in the working directory); each file its writers close goes
   up at once (`StreamingUpload`, the folder's `io.sinks` sink: multipart, several files in
   flight, the local copy deleted once it is up), so uploading overlaps writing and the local
   folder holds only the files in flight (a writer that gets further ahead waits);
4. commit: the staged output's rename waits for those uploads; then the files written last (a
   manifest, config, tokenizer files) go up, the final objects one kind after another, and the
   marker is deleted;
5. on failure, Ctrl-C or SIGTERM the uploads under way are cancelled (their multipart uploads
   aborted), what was uploaded is deleted again and the staging folder removed; after a kill,
   the marker says the prefix is incomplete until the next run cleans it (and aborts the
   multipart uploads the killed run left open under it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path

from ..errors import DestinationExistsError, ShardkitError
from ..sizes import format_bytes
from . import s3, sinks
from .location import RemoteLocation
from .remote import WRITING
from .transaction import (
    OWNER_FILE,
    STAGING_TAG,
    owner_text,
    parse_owner,
    pid_alive,
    sibling_name,
    temporary_folder,
    terminate_as_interrupt,
)

log = logging.getLogger(__name__)

FILES_IN_FLIGHT = 4
"""Files of one output uploading at once; a writer closing one more waits (the local copy of an
output holds at most these, beside the files being written)."""
FINAL_NAMES = ("model.safetensors.index.json", "config.json", "shardkit.json", "done")
"""Objects uploaded last, in this order (by base name): whichever exists completes the output."""


_WRITING_HERE: set[str] = set()
"""The prefixes this process is writing now (`remote_output`)."""


def writing_here(owner: tuple[str, int] | None, loc: RemoteLocation) -> bool | None:
    """Whether the writer a marker of `loc` names still writes it: a process of this host that
    still runs (this process: while it writes `loc`); None for another host's, which cannot be
    told from here."""
    if owner is None or owner[0] != socket.gethostname():
        return None
    return str(loc) in _WRITING_HERE if owner[1] == os.getpid() else pid_alive(owner[1])


def _writer(owner: tuple[str, int] | None) -> str:
    return f"process {owner[1]} on {owner[0]}" if owner else "another run"


def remove_objects(loc: RemoteLocation, names: Iterable[str]) -> int:
    """Delete `names` under `loc` so that an interruption leaves something incomplete, never
    something complete-looking: the final objects (`done`, manifests) first, then the rest."""
    names = list(names)
    finals = [n for n in names if n.rsplit("/", 1)[-1] in FINAL_NAMES]
    rest = [n for n in names if n not in set(finals)]
    s3.delete_objects(loc, finals)
    s3.delete_objects(loc, rest)
    return len(names)


def _final_rank(path: str) -> int:
    base = path.rsplit("/", 1)[-1]
    return FINAL_NAMES.index(base) + 1 if base in FINAL_NAMES else 0


def upload_tree(
    local: Path, loc: RemoteLocation, files_in_flight: int = 4, remove: bool = True, exclude: Collection[str] = ()
) -> int:
    """Upload every file under `local` to `loc` (names relative to `local`, but those in
    `exclude`): the others first, several at once, then the final objects one kind after another
    (a tag's `done` very last). Links are never followed. With `remove`, each local file is
    deleted once it is up. Returns the bytes uploaded."""
    files: list[tuple[int, str, Path]] = []
    for here, dirs, names in os.walk(local):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(here, d))]
        for name in names:
            path = Path(here) / name
            if path.is_symlink() or not path.is_file():
                continue
            rel = path.relative_to(local).as_posix()
            if rel not in exclude:
                files.append((_final_rank(rel), rel, path))
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


def check_destination(loc: RemoteLocation, overwrite: bool, sources: Sequence[RemoteLocation]) -> list[str]:
    """Step 1 of `remote_output`; returns the names of the objects an overwrite replaces."""
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
        owner = parse_owner(s3.get_bytes(loc, WRITING))
        alive = writing_here(owner, loc)
        if alive is False:
            remove_objects(loc, [n for n in names if n != WRITING])
            s3.abort_uploads(loc)
            s3.delete_objects(loc, [WRITING])
            log.warning(
                "removed %s under %s, left incomplete by a run (process %s) that is no longer writing it",
                f"{len(names) - 1} objects",
                loc,
                owner[1] if owner else "?",
            )
            return []
        if alive:
            raise DestinationExistsError(
                f"{loc} is being written by {_writer(owner)}, which still runs: wait for it to finish (or stop "
                "it) and run again, or write elsewhere"
            )
        if not overwrite:
            raise DestinationExistsError(
                f"{loc} is being written by {_writer(owner)} (or that run was interrupted): pass --overwrite to "
                "replace it"
            )
        # another host's run, running or killed (which cannot be told from here): --overwrite takes over
        s3.delete_objects(loc, [WRITING])
        log.warning("%s: taking it over from %s, whose run may still be writing (--overwrite)", loc, _writer(owner))
    elif not overwrite:
        raise DestinationExistsError(f"{loc} exists and is not empty: pass --overwrite to replace it")
    return names


class StreamingUpload:
    """The sink (`io.sinks`) of a remote output's local folder: each file the writers close in
    its staging folder goes up at once (several in flight; `files_in_flight` bounds them, so a
    writer that gets ahead waits and the local copy holds only the files in flight), and is
    deleted locally once it is up. The final objects wait for `upload_tree` at the commit."""

    def __init__(self, loc: RemoteLocation, local: Path, files_in_flight: int = FILES_IN_FLIGHT):
        self.loc = loc
        self.folders = (local.absolute(), sibling_name(local.absolute(), STAGING_TAG))
        self._uploader = s3.Uploader(files_in_flight)
        self.sent = 0

    def closed(self, path: Path) -> None:
        for folder in self.folders:
            if folder in path.parents:
                rel = path.relative_to(folder).as_posix()
                if rel != OWNER_FILE and _final_rank(rel) == 0:
                    self._uploader.upload(path, self.loc, rel, remove=True)
                return

    def drain(self) -> None:
        self.sent = self._uploader.wait()

    def close(self, cancel: bool) -> None:
        self._uploader.close(cancel=cancel)


@contextlib.contextmanager
def remote_output(
    loc: RemoteLocation, *, overwrite: bool = False, sources: Sequence[RemoteLocation] = (), what: str = "write"
) -> Iterator[Path]:
    """Yield a local path (not yet existing, in a temporary folder) to write the output into;
    its files go up as they are closed, the rest on a normal exit, as the module's docstring says."""
    with terminate_as_interrupt():
        replaced = check_destination(loc, overwrite, sources)
        if not s3.put_new(loc, WRITING, owner_text().encode()):  # claimed atomically: of two runs, one writes
            owner = parse_owner(s3.get_bytes(loc, WRITING))
            raise DestinationExistsError(
                f"{loc} is being written by {_writer(owner)}, which began while this run checked it: wait for it "
                "to finish and run again, or write elsewhere"
            )
        started = True
        _WRITING_HERE.add(str(loc))
        streaming: StreamingUpload | None = None
        try:
            if replaced:
                remove_objects(loc, [n for n in replaced if n != WRITING])
                log.info("%s: removed the %d objects of the output it replaces", loc, len(replaced))
            with temporary_folder(prefix="shardkit-s3-out-") as work:
                local = work.path / (loc.name or loc.bucket)
                streaming = StreamingUpload(loc, local, FILES_IN_FLIGHT)
                with sinks.registered(work.path, streaming):
                    yield local
                    streaming.drain()
                if not local.exists():
                    raise ShardkitError(f"nothing was written for {loc}")
                sent = streaming.sent + upload_tree(local, loc)
                log.info("%s: uploaded %s (%s)", loc, format_bytes(sent), what)
            s3.delete_objects(loc, [WRITING])
            started = False
        finally:
            if streaming is not None:
                streaming.close(cancel=started)
            if started:
                _undo(loc)
            _WRITING_HERE.discard(str(loc))


def _undo(loc: RemoteLocation) -> None:
    """Delete what a failed run uploaded (its marker last); logged, never raised."""
    try:
        names = [o.name for o in s3.list_objects(loc) if o.name != WRITING]
        remove_objects(loc, names)
        s3.delete_objects(loc, [WRITING])
    except (ShardkitError, OSError) as e:
        log.warning("could not remove the incomplete upload under %s (%s): the next run removes it", loc, e)
