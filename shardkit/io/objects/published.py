"""An output in object storage: the record naming its objects, and how a replace commits.

An object store has no rename, so an output there cannot be swapped in whole the way a local one
is (`transaction.StagedOutput.commit`). Each output `io.objects.upload.remote_output` writes therefore
ends with a record, `<prefix>/.shardkit-output` (JSON), naming every object of the output; one
PUT of the record is the commit, and S3 makes a PUT visible whole. A reader of the prefix
(`readable_objects`) reads the objects the record names and nothing else:

- a new output (an empty prefix) is written in place, the record last;
- a replace (`--overwrite`) writes the new output beside the old one, under a staged sub-prefix
  `<prefix>/.shardkit-staged-<host>-<pid>-<random>/`, while the old output stays as it was and
  readable; its commit is a record naming the new objects *under the staged sub-prefix*
  (`under`), so from that PUT on readers read the new output. The new objects are then copied
  server-side to their own names (the manifest and other final objects last), the record is
  rewritten to name them there, and only then are the old objects the new output does not have
  (`replaces`, listed in the record) deleted, and the staged objects with them;
- a run stopped before the commit (an error, a source failing its digest check, Ctrl-C,
  SIGTERM, kill -9) leaves the old output untouched: the staged objects are deleted by the run
  itself, or after a kill by the next run into the prefix; a run stopped after the commit is
  finished by the next run into the prefix (`finish`), which says so.

Objects whose top-level name is hidden (`hidden`: the record, the writing marker, staged
sub-prefixes) are never part of what is read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ...errors import FormatError
from ..location import RemoteLocation
from . import s3

log = logging.getLogger(__name__)

RECORD = ".shardkit-output"
"""The record of an output's objects, written last (see the module's docstring)."""
WRITING = ".shardkit-writing"
"""A remote output's first object and the last one deleted (`io.objects.upload`): while it exists a run
writes the prefix (and, with no record, the prefix is incomplete)."""
STAGED = ".shardkit-staged-"
"""The start of a staged sub-prefix's name: a replace's new output until it is committed."""
MANIFEST = "shardkit.json"
"""shardkit's manifest (`formats.manifest`): of an output written before records existed, the
objects it lists count as shardkit's (`shardkit_names`)."""


FINAL_NAMES = ("model.safetensors.index.json", "config.json", "shardkit.json", "done")
"""Objects uploaded last, in this order (by base name): whichever exists completes the output."""


@dataclass
class Record:
    """What `.shardkit-output` holds: the output's objects (names relative to the prefix); while a
    replace is being finished, the staged sub-prefix they are read from (`under`) and the old
    objects to delete once they are in place (`replaces`)."""

    objects: list[str]
    under: str = ""
    replaces: list[str] = field(default_factory=list)

    def dumps(self) -> bytes:
        body = {"objects": self.objects, "under": self.under, "replaces": self.replaces}
        return (json.dumps(body, indent=1, ensure_ascii=True) + "\n").encode()

    @classmethod
    def loads(cls, raw: bytes, where: str) -> Record:
        """The record in `raw` (FormatError, one line, when it is not one)."""
        try:
            body = json.loads(raw)
            objects, under, replaces = body["objects"], body.get("under", ""), body.get("replaces", [])
            names = [*objects, *replaces]
            if not all(isinstance(n, str) and n and not hidden(n) for n in names) or not isinstance(under, str):
                raise ValueError("names")
            if under and not under.startswith(STAGED):
                raise ValueError("under")
        except (ValueError, TypeError, KeyError, AttributeError):
            raise FormatError(
                f"{where} is not a record of shardkit's: the output's objects cannot be told; write the output again"
            ) from None
        return cls(list(objects), under, list(replaces))

    def stored(self, name: str) -> str:
        """Where the object `name` of the output is read from."""
        return f"{self.under}/{name}" if self.under else name


def remove_objects(loc: RemoteLocation, names: Iterable[str]) -> int:
    """Delete `names` under `loc` so that an interruption leaves something incomplete, never
    something complete-looking: the final objects (`done`, manifests) first, then the rest."""
    names = list(names)
    finals = [n for n in names if n.rsplit("/", 1)[-1] in FINAL_NAMES]
    rest = [n for n in names if n not in set(finals)]
    s3.delete_objects(loc, finals)
    s3.delete_objects(loc, rest)
    return len(names)


def final_rank(path: str) -> int:
    """0 for an ordinary object; for a final one (`FINAL_NAMES`), its place among them, from 1."""
    base = path.rsplit("/", 1)[-1]
    return FINAL_NAMES.index(base) + 1 if base in FINAL_NAMES else 0


def hidden(name: str) -> bool:
    """Whether `name` (relative to a prefix) is shardkit's bookkeeping, never part of an output."""
    top = name.split("/", 1)[0]
    return top in (RECORD, WRITING) or top.startswith(STAGED)


def read_record(loc: RemoteLocation) -> Record | None:
    """The record of the output at `loc`, None when there is none."""
    raw = s3.get_bytes(loc, RECORD)
    return None if raw is None else Record.loads(raw, f"{loc}/{RECORD}")


def readable_objects(loc: RemoteLocation, objects: Sequence[s3.ObjectInfo]) -> list[s3.ObjectInfo]:
    """The objects of the output at `loc` a reader reads, given the prefix's listing `objects`:
    those its record names (read where the record says), or, for a prefix without a record that
    no run is writing, every object but the hidden ones. A prefix being written for the first
    time is refused (incomplete); one whose record and listing disagree is listed again (a
    replace moved on meanwhile), and refused if they keep disagreeing."""
    for _ in range(3):
        names = {o.name: o for o in objects}
        record = read_record(loc) if RECORD in names else None
        if record is None:
            if WRITING in names and RECORD not in names:
                raise FormatError(
                    f"{loc} is incomplete (an upload was interrupted, or is still running): write it again "
                    "(the next run into it removes the partial upload, saying so)"
                )
            if RECORD not in names:
                return [o for o in objects if not hidden(o.name)]
        else:
            found = [names.get(record.stored(n)) for n in record.objects]
            if all(o is not None for o in found):
                return [
                    s3.ObjectInfo(n, o.size, o.etag, record.stored(n))
                    for n, o in zip(record.objects, found)
                    if o is not None
                ]
        objects = s3.list_objects(loc)
    if WRITING in {o.name for o in objects}:
        raise FormatError(f"{loc} is being replaced by another run while shardkit reads it: run the command again")
    raise FormatError(
        f"{loc}: objects its record ({RECORD}) names are missing (deleted by something other than shardkit?): "
        "write the output again"
    )


def shardkit_names(loc: RemoteLocation, names: Iterable[str]) -> set[str]:
    """Of the objects `names` under `loc`, those shardkit wrote: the record's objects, or for an
    output written before records existed, the files its manifest lists and the manifest; and
    shardkit's bookkeeping (`hidden`)."""
    names = set(names)
    ours = {n for n in names if hidden(n)}
    if RECORD in names:
        record = read_record(loc)
        if record is not None:
            return ours | set(record.objects)
    if MANIFEST in names:
        raw = s3.get_bytes(loc, MANIFEST)
        try:
            files = json.loads(raw or b"{}").get("files", []) or []
            ours |= {str(f["path"]) for f in files if isinstance(f, dict) and "path" in f} | {MANIFEST}
        except (ValueError, AttributeError, TypeError):
            pass  # not a manifest of ours: none of its neighbours count as shardkit's
    return ours


def commit(loc: RemoteLocation, objects: Sequence[s3.ObjectInfo], under: str, replaces: Iterable[str]) -> Record:
    """Commit the output whose objects (listed under `loc`, or under its staged sub-prefix
    `under`) are all up: the record is the commit (a replace is then finished by `finish`)."""
    names = sorted(o.name for o in objects)
    record = Record(names, under, sorted(set(replaces) - set(names)))
    s3.put_bytes(loc, RECORD, record.dumps())
    return record


def finish(loc: RemoteLocation, record: Record) -> None:
    """Finish a committed replace: the new objects copied from the staged sub-prefix to their
    names (final ones last), the record rewritten to name them there, then the old objects the new
    output does not have deleted, and the staged sub-prefix. Every step may run again."""
    if record.under:
        staged = {o.name: o for o in s3.list_objects(loc.child(record.under))}
        missing = [n for n in record.objects if n not in staged]
        if missing:
            raise FormatError(
                f"{loc}: the replace committed in {RECORD} cannot be finished ({record.under}/{missing[0]} is "
                "missing): write the output again"
            )
        pairs = [(record.stored(n), n, staged[n].size, staged[n].etag) for n in record.objects]
        for rank in sorted({final_rank(n) for n in record.objects}):
            s3.copy_objects(loc, [p for p in pairs if final_rank(p[1]) == rank])
        s3.put_bytes(loc, RECORD, Record(record.objects, "", record.replaces).dumps())
    remove_objects(loc, [n for n in record.replaces if n not in set(record.objects)])
    remove_staged(loc)
    if record.replaces or record.under:
        s3.put_bytes(loc, RECORD, Record(record.objects).dumps())


def remove_staged(loc: RemoteLocation, keep: str = "") -> int:
    """Delete every staged sub-prefix under `loc` (but `keep`) and abort its open multipart
    uploads; returns how many objects were deleted."""
    staged = [o.name for o in s3.list_objects(loc) if o.name.startswith(STAGED)]
    names = [n for n in staged if n.split("/", 1)[0] != keep]
    s3.delete_objects(loc, names)
    for sub in sorted({n.split("/", 1)[0] for n in names}):
        s3.abort_uploads(loc.child(sub))
    return len(names)
