"""The digests shardkit records for every file it writes, and how a file is checked on read.

- `xxh3_128` (the xxhash library's XXH3, 128 bits): not cryptographic, about as fast as memory.
  Any accidental change (a flipped bit, a torn or truncated write, a file swapped for another)
  goes unnoticed with probability 2^-128, which is all a check on read can promise anyway: the
  manifest lives beside the files it lists, so whoever can rewrite a file on purpose can rewrite
  the manifest too. Always recorded.
- `sha256`: cryptographic, what `sha256sum` prints and what the Hub's LFS ids are. An order of
  magnitude slower even with the CPU's SHA instructions (as much CPU as everything else a reshard
  does), so it is recorded only on request (`--sha256`, `sha256=True`): for manifests
  whose own hash is pinned somewhere the files' writer cannot reach, where the files' digests must
  resist a deliberate collision. Hub uploads compute their own sha256 and do not need it.

Writers compute what they record while writing (`Recording`) and report it as a `FileRecord`. Readers check the fast digest by
default (`FAST`) and fall back to sha256 for manifests written before the fast digest existed;
`STRONG` checks sha256 only, and refuses, saying how to fix it, a manifest that lists none.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import xxhash

from ...errors import FormatError
from ...paths import open_regular
from ..objects import remote


class WholeFiles(Protocol):
    """What a file is read through when it is hashed whole: its store (`io.store.Store`)."""

    def fetch_whole(self, path: str | os.PathLike[str]) -> None:
        """Every byte of `path` there (an object store's mirror file: fetched)."""


FAST_DIGEST = "xxh3_128"
"""The manifest key of the fast digest (hex)."""


class Recording(str, enum.Enum):
    """What a writer hashes for its records. Its values are the spellings they replace ("sha256"
    compares equal to SHA256), and NONE alone is false."""

    NONE = "none"
    """Nothing: files no manifest lists (their records' digests are None)."""
    FAST = "fast"
    """The fast digest (xxh3-128)."""
    SHA256 = "sha256"
    """The fast digest and sha256."""

    def __bool__(self) -> bool:
        return self is not Recording.NONE


@dataclass(frozen=True)
class FileRecord:
    """A file written: path relative to the output directory, size, sha256 and the fast digest
    (xxh3-128). Both are None for files written without digests (outputs no manifest lists, such
    as a merged Hugging Face folder's); sha256 alone is None unless asked for (see above), and
    xxh3-128 alone in records of older manifests."""

    path: str
    size: int
    sha256: str | None
    xxh3_128: str | None = None
    blocks: tuple[str, ...] | None = None
    """The xxh3-128 of each BLOCK bytes, when recorded (see `recording_blocks`)."""


class CheckMode(str, enum.Enum):
    """How a reader checks files against their manifest (its values are the `verify_hashes`
    spellings, and compare equal to them)."""

    FAST = "fast"
    """The fast digest where the manifest lists it, else sha256."""
    SHA256 = "sha256"
    """sha256 only (refused, saying how to fix it, where the manifest lists none)."""
    NONE = "none"
    """No check."""


FAST = CheckMode.FAST
STRONG = CheckMode.SHA256
NONE = CheckMode.NONE

HASH_WINDOW = 16 << 20
"""A file is hashed through a read-only mapping of this many bytes at a time: warm, that costs
about half the CPU of reading the same bytes into a buffer (no copy out of the page cache); cold,
the same time. Mapped pages count as resident while mapped: 16 MiB keeps them a small part of a
7B merge's 512 MiB memory bound."""

HASH_BLOCK = 1 << 20
"""Bytes read at once where a file cannot be mapped."""


def check_mode(value: bool | str | CheckMode | None) -> CheckMode:
    """The check a `verify_hashes` argument asks for: True or "fast" -> fast, "sha256" -> sha256,
    False/None/"none" -> none."""
    if isinstance(value, CheckMode):
        return value
    if value is True or value == FAST:
        return FAST
    if value is False or value is None or value == NONE:
        return NONE
    if value == STRONG:
        return STRONG
    raise ValueError(f"verify_hashes must be True, False, 'fast', 'sha256' or 'none', not {value!r}")


BLOCK_SIZE = 32 << 20
"""Block digests: the xxh3-128 of each BLOCK_SIZE bytes of a file (the last block shorter)."""
BLOCKS_KEY = "xxh3_128_blocks"
"""A manifest entry's list of block digests (with "block_size" beside it)."""

_RECORDING_BLOCKS = [0]


@contextlib.contextmanager
def recording_blocks() -> Iterator[None]:
    """Records made inside the block also carry block digests. An output bound for object storage
    records them: a reader that receives a file's bytes out of order, as ranged GETs in the order
    an operation reads them, checks each block as it arrives and need not keep the bytes it has
    read until the whole file has been checked in order (`io.objects.remote`, streamed sources)."""
    _RECORDING_BLOCKS[0] += 1
    try:
        yield
    finally:
        _RECORDING_BLOCKS[0] -= 1


class Digests:
    """xxh3-128 and (with `sha256`) sha256 of the same bytes, fed together (both release the GIL
    on large blocks); inside `recording_blocks`, the block digests too."""

    __slots__ = ("sha256", "fast", "blocks", "_block", "_filled")

    def __init__(self, sha256: bool = False) -> None:
        self.sha256 = hashlib.sha256() if sha256 else None
        self.fast = xxhash.xxh3_128()
        self.blocks: list[str] | None = [] if _RECORDING_BLOCKS[0] else None
        self._block = xxhash.xxh3_128() if _RECORDING_BLOCKS[0] else None
        self._filled = 0

    def update(self, data: Any) -> None:
        if self.sha256 is not None:
            self.sha256.update(data)
        self.fast.update(data)
        if self._block is not None:
            self._feed_blocks(data)

    def _feed_blocks(self, data: Any) -> None:
        assert self._block is not None and self.blocks is not None
        view = memoryview(data)
        if view.ndim != 1 or view.format not in ("B", "b", "c"):
            view = view.cast("B")
        while len(view):
            n = min(len(view), BLOCK_SIZE - self._filled)
            self._block.update(view[:n])
            self._filled += n
            view = view[n:]
            if self._filled == BLOCK_SIZE:
                self.blocks.append(self._block.hexdigest())
                self._block.reset()
                self._filled = 0

    def block_digests(self) -> tuple[str, ...] | None:
        """The block digests so far (the last block as fed so far), None when not recorded."""
        if self.blocks is None or self._block is None:
            return None
        return (*self.blocks, self._block.hexdigest()) if self._filled else tuple(self.blocks)

    def hexdigests(self) -> tuple[str | None, str]:
        """(sha256 or None when not computed, xxh3_128) as hex."""
        return (self.sha256.hexdigest() if self.sha256 is not None else None), self.fast.hexdigest()


def feed_file(path: Path, digest: Any, start: int = 0, store: WholeFiles | None = None) -> int:
    """Feed a file's bytes from `start` to its end to `digest`, window by window out of a read-only
    mapping (see HASH_WINDOW), or read in blocks where the file system cannot map it; returns
    the file's size. `store`: the store the file is read through (an object store's mirror file's
    every byte is fetched first; without one, the file must be a local file)."""
    import mmap

    if store is not None:
        store.fetch_whole(path)
    else:
        remote.refuse_unfetched(path)  # (a mirror's file that may miss bytes: an internal error)
    with os.fdopen(open_regular(path, "file to hash"), "rb", buffering=0) as fh:
        fd = fh.fileno()
        size = os.fstat(fd).st_size
        base = start - start % mmap.ALLOCATIONGRANULARITY  # mappings start at a page boundary
        for offset in range(base, size, HASH_WINDOW):
            if os.fstat(fd).st_size < size:  # touching a page past the new end would raise SIGBUS
                raise OSError(f"{path} shrank while it was being hashed")
            try:
                window = mmap.mmap(fd, min(HASH_WINDOW, size - offset), access=mmap.ACCESS_READ, offset=offset)
            except (OSError, ValueError):
                if offset > base:
                    raise
                fh.seek(start)
                _read_into(fh, digest)  # nothing fed yet
                return size
            try:
                window.madvise(mmap.MADV_SEQUENTIAL)
                with memoryview(window) as view:
                    digest.update(view[max(0, start - offset) :])
            finally:
                window.close()
        return size


def _read_into(fh: Any, digest: Any) -> None:
    """Feed an open file to `digest` in large blocks read into one reused buffer, with sequential
    read-ahead."""
    view = memoryview(bytearray(HASH_BLOCK))
    try:
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
    except (AttributeError, OSError):  # not on every platform or file system
        pass
    while n := fh.readinto(view):
        digest.update(view[:n])


def file_digests(path: Path, sha256: bool = False, store: WholeFiles | None = None) -> tuple[str | None, str]:
    """(sha256 when asked for else None, xxh3_128) of a file, from one read (`store`: see `feed_file`)."""
    digests = Digests(sha256)
    feed_file(path, digests, store=store)
    return digests.hexdigests()


def new_digest(algorithm: str) -> Any:
    """A fresh hash object for a manifest digest name (FAST_DIGEST or "sha256")."""
    return xxhash.xxh3_128() if algorithm == FAST_DIGEST else hashlib.sha256()


class NoSha256Error(FormatError):
    """A sha256 check of a manifest entry that lists no sha256."""


def has_digest(entry: Mapping[str, Any]) -> bool:
    """Whether a manifest file entry lists a digest a reader can check (xxh3-128 or sha256)."""
    return isinstance(entry.get(FAST_DIGEST), str) or isinstance(entry.get("sha256"), str)


def expected_digest(entry: Mapping[str, Any], check: CheckMode) -> tuple[str, str]:
    """(algorithm, hex digest) a manifest file entry is checked against: the fast digest when the
    entry has one and `check` is fast, else its sha256 (NoSha256Error when it lists only the fast
    digest; KeyError when it lists neither, a malformed entry)."""
    if check == FAST and isinstance(entry.get(FAST_DIGEST), str):
        return FAST_DIGEST, entry[FAST_DIGEST]
    if not isinstance(entry.get("sha256"), str) and isinstance(entry.get(FAST_DIGEST), str):
        raise NoSha256Error(
            f"the manifest lists no sha256 for {entry.get('path')} (it was written without --sha256): check "
            "with the default xxh3-128 (--verify-hashes), or re-create the files with --sha256"
        )
    return "sha256", entry["sha256"]


def file_matches(
    path: Path, entry: Mapping[str, Any], check: CheckMode = FAST, store: WholeFiles | None = None
) -> bool:
    """Whether a file has the size and digest its manifest entry lists (OSError when unreadable;
    `store`: see `feed_file`)."""
    size = entry.get("size")
    if size is not None and os.stat(path).st_size != size:
        return False
    algorithm, expected = expected_digest(entry, check)
    digest = new_digest(algorithm)
    feed_file(path, digest, store=store)
    return bool(digest.hexdigest() == expected)
