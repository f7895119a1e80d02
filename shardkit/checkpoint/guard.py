"""A source tag held to what it was when an operation opened it.

`ckpt reshard` reads a tag's model and optimizer files over minutes; retention, a second job or a
disk fault may change the tag meanwhile. `TagCheck` stamps every file of the tag as it is opened
(device, inode, size, mtime, ctime), hashes the files the tag's manifest lists in a background
thread while the operation reads them, and `verify` (called before the output is committed)
refuses a tag that was pruned, rewritten or damaged: a flipped bit listed with its digest never
becomes a clean-looking new checkpoint.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..errors import FormatError, ShardkitError
from ..formats import MANIFEST
from ..io.data.digest import FAST, expected_digest, file_matches
from ..io.store import Store
from ..paths import inside
from .tree import read_manifest

Stamp = tuple[int, ...]


def stamp_tree(folder: Path, store: Store | None = None) -> dict[str, Stamp]:
    """Every file (and link) under `folder`, by relative path: device, inode, size, mtime, ctime
    (`Store.stamp` of the store it is read through, default a local folder). Links are stamped
    themselves, never followed."""
    store = store if store is not None else Store(folder)
    stamps: dict[str, Stamp] = {}
    for here, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(here, d))]:
            path = os.path.join(here, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            stamps[os.path.relpath(path, folder)] = store.stamp(st)  # a mirror file: see io.store.MirrorStore.stamp
    return stamps


class TagCheck:
    """A tag's files as opened, and (with `hashes`) its listed files' digests, checked by `verify`."""

    def __init__(self, tag_dir: Path, hashes: bool = True, store: Store | None = None):
        self.tag_dir = Path(tag_dir)
        self.store = store if store is not None else Store(self.tag_dir)  # what the tag is read through
        self.stamps = stamp_tree(self.tag_dir, self.store)
        manifest = read_manifest(self.tag_dir) if hashes else None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        entries = list((manifest or {}).get("files", []))
        self._thread = threading.Thread(target=self._hash, args=(entries,), name="shardkit-tag-check", daemon=True)
        self._thread.start()

    def _hash(self, entries: list[dict]) -> None:
        for entry in entries:
            if self._stop.is_set():
                return
            try:
                path = inside(self.tag_dir, entry["path"], f"file listed in {MANIFEST}")
                if not file_matches(path, entry, FAST, self.store):
                    self.error = FormatError(
                        f"{self.tag_dir.name}/{entry['path']} does not match its size and "
                        f"{expected_digest(entry, FAST)[0]} in {MANIFEST}: the file is corrupt or was changed; "
                        "restore it or use another tag (--tag)"
                    )
                    return
            except ShardkitError as e:  # an unsafe listed name, or a file open_regular refuses (one line each)
                rel = str(entry.get("path", ""))
                gone = rel in self.stamps and not os.path.lexists(self.tag_dir / rel)  # removed since opened
                self.error = self._changed(rel, "was removed") if gone else e
                return
            except FileNotFoundError as e:  # removed since the tag was opened: a change, as verify says
                rel = str(entry["path"])
                self.error = self._changed(rel, "was removed") if rel in self.stamps else self._unreadable(rel, e)
                return
            except OSError as e:
                self.error = self._unreadable(str(entry["path"]), e)
                return

    def _unreadable(self, rel: str, e: OSError) -> FormatError:
        return FormatError(f"cannot read {self.tag_dir.name}/{rel}: {e.strerror or e}")

    def _changed(self, rel: str, what: str) -> FormatError:
        return FormatError(
            f"{self.tag_dir} changed while shardkit read it ({rel} {what}: pruned, rewritten or saved "
            "over by another process?): nothing was written; run again when nothing else touches it"
        )

    def stop(self) -> None:
        self._stop.set()

    def verify(self) -> None:
        """FormatError when a listed file does not match its digest, or any file of the tag was
        removed, added or written to since the tag was opened."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        now = stamp_tree(self.tag_dir, self.store)
        for rel in sorted(set(self.stamps) | set(now)):
            before, after = self.stamps.get(rel), now.get(rel)
            if before == after:
                continue
            what = "was removed" if after is None else "appeared" if before is None else "was written to"
            raise self._changed(rel, what)
