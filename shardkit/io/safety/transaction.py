"""The output transaction: how every folder shardkit produces comes into being.

A staged output (`staged_output`) is written into `.DST.shardkit-tmp-PID` beside the destination
and renamed into place at the end, so a failure, Ctrl-C or SIGTERM leaves nothing half-written:

1. the destination is checked: not a symlink; not the same folder as a source, nor inside one,
   nor holding one (`overlap.overlaps`: real paths, then device and inode of every ancestor, so
   bind mounts and other aliases are caught); empty unless `overwrite`;
2. it is locked (`.DST.shardkit-lock`, `lock.lock_destination`): a second run into the same
   destination is told who holds it;
3. what killed runs left beside it is repaired, saying so (`recover_interrupted`): a staging
   folder of a dead process of this host is removed; a destination caught between the two renames
   of a replace is put back;
4. the caller writes into the staging folder (on every rank of a torch.distributed job);
5. commit: the caller's last files (a manifest, a `done` marker), then, once the output's sink
   has taken every file handed to it (`sinks`: an upload's), the rename; a replace is two
   renames (DST -> `.DST.shardkit-old-PID`, staging -> DST) with signals held between them;
6. on any failure the staging folder is removed, and an OSError becomes one line (`oserror`).

A marked folder (`MarkedFolder`) is written in place instead and is complete only once its marker
is written last, as NxD's checkpoint protocol (`<tag>/done`) and object stores (no rename) need.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import signal
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...distributed import Job, current_job
from ...errors import DestinationExistsError, ShardkitError
from ...sizes import format_bytes
from .delete import is_link, refuse_mounts, remove_file, remove_tree
from .durable import fsync_path, write_marker, write_text
from .lock import FolderLock, lock_destination
from .oserror import disk_error, shown
from .overlap import overlaps
from .sinks import NO_SINK, Sink

log = logging.getLogger(__name__)

STAGING_TAG = "shardkit-tmp"
OLD_TAG = "shardkit-old"
SCRATCH_TAG = "shardkit-scratch"
"""`.DST.shardkit-scratch-PID`: intermediate files of a run that writes DST (never committed)."""
OWNER_FILE = ".shardkit-owner"
"""Written into every staging folder and every marked folder while it is written: `host pid`,
so that only this host's dead runs are cleaned up."""

NAME_MAX = 255


# ---- names beside the destination ------------------------------------------------------------------


def sibling_name(dst: str | Path, tag: str, pid: int | None = None) -> Path:
    """`.DST.<tag>-PID` beside dst: where a run stages its output or keeps the DST it replaces.
    A name too long for that is shortened, with a hash of the whole name kept in it."""
    dst = Path(dst)
    suffix = f".{tag}-{os.getpid() if pid is None else pid}"
    name = f".{dst.name}"
    if len(os.fsencode(name + suffix)) > NAME_MAX:
        digest = hashlib.sha256(dst.name.encode(errors="surrogateescape")).hexdigest()[:16]
        name = f".{dst.name.encode(errors='surrogateescape')[:120].decode(errors='ignore')}~{digest}"
    return dst.parent / (name + suffix)


def _sibling_pattern(dst: Path) -> re.Pattern[str]:
    stem = re.escape(sibling_name(dst, "X", 0).name[: -len(".X-0")])
    return re.compile(rf"^{stem}\.({STAGING_TAG}|{SCRATCH_TAG}|{OLD_TAG})-(\d+)$")


# ---- owners of folders being written ------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """True when a process with this id runs on this host (or may: when we may not signal it)."""
    if pid <= 0:
        return True  # not a real id: never treat it as dead
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def owner_text() -> str:
    """What an owner file (or an object store's writing marker) holds: "host pid" of this process."""
    return f"{socket.gethostname()} {os.getpid()}\n"


def parse_owner(text: str | bytes | None) -> tuple[str, int] | None:
    """(host, pid) from an owner's text (`owner_text`); None when there is none or it is garbled."""
    try:
        host, pid_text = (text.decode() if isinstance(text, bytes) else text or "").split()[:2]
        return host, int(pid_text)
    except (ValueError, UnicodeDecodeError):
        return None


def write_owner(folder: str | Path) -> None:
    """Mark a folder being written as this host's and this process's."""
    write_text(Path(folder) / OWNER_FILE, owner_text(), fsync=False)


def owner_of(folder: str | Path) -> tuple[str, int] | None:
    """(host, pid) of the run writing `folder`, from its owner file (None when it has none)."""
    from .small import SmallFileError, read_text

    try:
        return parse_owner(read_text(Path(folder) / OWNER_FILE, "owner file", limit=4096))
    except SmallFileError:
        return None


def dead_owner(folder: str | Path) -> int | None:
    """The pid of the process of THIS host that was writing `folder` and is no longer running;
    None when the folder has no owner file, another host's, or a live one."""
    owner = owner_of(folder)
    if owner is None or owner[0] != socket.gethostname() or owner[1] == os.getpid() or pid_alive(owner[1]):
        return None
    return owner[1]


def recover_interrupted(dst: str | Path, logger: logging.Logger | None = None) -> list[str]:
    """Repair what a killed run left beside `dst`, on this host, and say so (returns the notes).

    - `.DST.shardkit-old-PID` of a dead process and no DST: a kill between the two renames of a
      replace; the old DST is moved back into place.
    - `.DST.shardkit-old-PID` and a DST: the replace finished but the old copy was not removed;
      it is left alone (never delete data we cannot prove superseded) and named.
    - `.DST.shardkit-tmp-PID` (or `-scratch-PID`) of a dead process of this host: a half-written
      staging folder (or its scratch files); removed. Links are never followed nor deleted through."""
    dst = Path(dst)
    notes: list[str] = []
    pattern = _sibling_pattern(dst)
    try:
        entries = sorted(os.listdir(dst.parent))
    except OSError:
        return notes
    for entry in entries:
        match = pattern.match(entry)
        if not match:
            continue
        kind, pid = match.group(1), int(match.group(2))
        path = dst.parent / entry
        if pid == os.getpid() or pid_alive(pid) or is_link(path) or not path.is_dir():
            continue
        if kind == OLD_TAG:
            if not os.path.lexists(dst):
                os.rename(path, dst)
                notes.append(f"restored {dst} from {path.name}: a run (process {pid}) was killed while replacing it")
            else:
                notes.append(
                    f"{path} holds the {dst.name} that an interrupted run (process {pid}) replaced: "
                    "delete it once you have checked the new one"
                )
        else:
            owner = owner_of(path)
            if owner is not None and owner[0] != socket.gethostname():
                continue  # another host's run: its process ids mean nothing here
            size = format_bytes(_tree_bytes(path))
            remove_tree(path)
            notes.append(f"removed {path.name} ({size}), left by a run (process {pid}) that no longer runs")
    for note in notes:
        (logger or log).warning("%s", shown(note, 1000))
    return notes


def _tree_bytes(path: Path) -> int:
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


# ---- signals -------------------------------------------------------------------------------------------


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during an operation (handled like Ctrl-C: the staging folder is removed)."""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """While the block runs (in the main thread), SIGTERM raises `Terminated` so that cleanup
    runs; the previous handler is put back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(f"terminated by signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not allowed here (e.g. an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGTERM and SIGINT wait until the block is done (the two renames of a replace)."""
    signals = {signal.SIGTERM, signal.SIGINT}
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# ---- private roots in shared temporary folders ------------------------------------------------------


class UnsafeFolderError(ShardkitError):
    """A folder shardkit keeps its own files in is not safely this user's (a link, not a folder,
    another user's, or writable by others)."""


PRIVATE_ROOT = "shardkit-{uid}"
"""This user's folder in a shared temporary folder (the system's, /dev/shm): every staging root,
mirror and temporary folder shardkit makes there lives inside it (`private_root`)."""


def private_root(parent: str | Path | None = None, name: str | None = None) -> Path:
    """This user's own folder for shardkit's work in a shared place: `shardkit-UID` in `parent`
    (default: the system's temporary folder), and with `name` the folder `name` inside that.
    Each is created mode 0700, opened without following a link and refused (UnsafeFolderError,
    one line) when it is a link, not a folder, not this user's, or writable by group or others;
    so a name another user can predict and plant (a link to somewhere else, a folder of theirs)
    is never written, locked or deleted through."""
    base = Path(tempfile.gettempdir() if parent is None else parent)
    root = _private(base / PRIVATE_ROOT.format(uid=os.getuid()))
    return root if name is None else _private(root / name)


def _private(path: Path) -> Path:
    """`path` made (0700) or found, and checked to be this user's own private folder."""
    fix = "remove it, or set TMPDIR to a folder of your own"
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) or is_link(path):
            what = "a symlink" if is_link(path) else "not a folder"
            raise UnsafeFolderError(
                f"{shown(path)} is {what}: shardkit keeps its temporary files there and never follows a link; {fix}"
            ) from None
        raise disk_error(e, "create the temporary folder", path) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise UnsafeFolderError(
                f"{shown(path)} belongs to another user (uid {st.st_uid}): shardkit keeps its temporary files in a "
                f"folder of its user's own; {fix}"
            )
        if st.st_mode & 0o022:
            raise UnsafeFolderError(
                f"{shown(path)} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): shardkit keeps its "
                f"temporary files in a folder only its user can write; {fix}"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # this user's own folder, readable by others: made private
    finally:
        os.close(fd)
    return path


def owned_folder(path: str | Path) -> bool:
    """Whether `path` is a real folder (not a link) of this user: what a cleanup of leftovers in a
    shared place may look into."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def refuse_link(dst: str | Path) -> None:
    """The destination check of every writer: a destination folder that is a symlink (dangling
    or not), also when spelled through it (`link/sub/..`), is refused in one line, before anything
    is written or deleted through it."""
    for path in (Path(dst), Path(os.path.normpath(dst))):
        if is_link(path):
            raise DestinationExistsError(
                f"{shown(path)} is a symlink (to {shown(os.readlink(path))}): shardkit never writes or deletes "
                "through a link; give the real destination path"
            )


def remove_dead_folders(base: str | Path, prefix: str) -> list[tuple[Path, int]]:
    """Remove the folders named `prefix...` in this user's `private_root` of `base` (when it is
    there) whose owner file names a process of this host that no longer runs (a killed run's
    mirror or temporary folder): never another user's, never through a link. Returns what was
    removed, with its owner's pid."""
    mine = Path(base) / PRIVATE_ROOT.format(uid=os.getuid())
    if not owned_folder(mine):
        return []
    removed = []
    with contextlib.suppress(OSError, ShardkitError):
        mine = private_root(base)  # refused unless private: nothing in it is then looked at
        for entry in sorted(os.listdir(mine)):
            folder = mine / entry
            pid = dead_owner(folder) if entry.startswith(prefix) and owned_folder(folder) else None
            if pid is not None:
                with contextlib.suppress(OSError, ShardkitError):
                    remove_tree(folder)
                    removed.append((folder, pid))
    return removed


def remove_on_sigterm(folders: Callable[[], Iterable[Path]]) -> None:
    """Chain SIGTERM's handler (in the main thread; once): first remove the folders `folders()`
    names (files only: no lock the interrupted code may hold is taken), then do what it did
    before (the default: end the process, which runs no exit handlers). For folders that live
    until the process exits (a mirror kept for a trainer's run), which SIGTERM would otherwise
    leave to the next run."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if getattr(previous, "removes_folders", None) is folders:
            return

        def handler(signum: int, frame: Any) -> None:
            for folder in folders():
                with contextlib.suppress(OSError, ShardkitError):
                    remove_tree(folder)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            if callable(previous):
                previous(signum, frame)
            elif previous in (signal.SIG_DFL, None):
                os.kill(os.getpid(), signum)

        handler.removes_folders = folders  # type: ignore[attr-defined]
        signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not allowed here (an embedded interpreter)
        return


# ---- a staged output -----------------------------------------------------------------------------------


@dataclass
class StagedOutput:
    """A destination folder being produced in a staging folder beside it (see the module's doc).

    The checks, the lock, the staging folder and the commit are the leader's; under
    torch.distributed every rank writes into `path` (the same staging folder). `sink`: where
    its writers hand each finished file (`io.safety.sinks`); the commit waits for it."""

    dst: Path
    sources: list[Path] = field(default_factory=list)
    overwrite: bool = False
    what: str = "write"
    sink: Sink = NO_SINK
    path: Path = Path()
    committed: bool = False
    _lock: FolderLock | None = None

    def prepare(self) -> Path:
        """Leader: check the destination, lock it, repair leftovers, create the staging folder."""
        dst = self.dst
        try:
            refuse_link(dst)
            for src in self.sources:
                if overlaps(dst, src):
                    raise ShardkitError(
                        f"destination {shown(dst)} overlaps the source {shown(src)} (the same folder, or one inside "
                        "the other, once links, '..' and mounts are resolved): choose another destination"
                    )
            dst.parent.mkdir(parents=True, exist_ok=True)
            self._lock = lock_destination(dst, self.what)
            recover_interrupted(dst, log)
            self._check_destination()
            staging = sibling_name(dst, STAGING_TAG)
            remove_tree(staging)
            staging.mkdir()
            self.path = staging
            write_owner(staging)
        except BaseException as e:
            self._give_up()
            if isinstance(e, OSError):
                raise disk_error(e, "write", e.filename or dst) from None
            raise
        return staging

    def _check_destination(self) -> None:
        dst = self.dst
        if os.path.lexists(dst) and not dst.is_dir():
            raise DestinationExistsError(f"{shown(dst)} exists and is a file: choose another destination")
        if dst.is_dir() and any(dst.iterdir()) and not self.overwrite:
            raise DestinationExistsError(f"{shown(dst)} exists and is not empty: pass --overwrite to replace it")

    def commit(self) -> None:
        """Leader: put the finished staging folder in place of dst (replacing it when it exists).
        A replace renames dst to `.DST.shardkit-old-PID`, then staging to dst, then deletes the old
        folder; if the second rename fails the old one is put back."""
        dst, staging = self.dst, self.path
        old = None
        self.sink.drain()  # files still being uploaded (an object-store output) are read by path
        try:
            (staging / OWNER_FILE).unlink(missing_ok=True)
            if is_link(dst):
                raise DestinationExistsError(
                    f"{shown(dst)} became a symlink while shardkit wrote: refusing to replace it"
                )
            self._check_destination()
            if not os.path.lexists(dst):
                os.rename(staging, dst)
            else:
                old = sibling_name(dst, OLD_TAG)
                with signals_deferred():
                    os.rename(dst, old)
                    try:
                        os.rename(staging, dst)
                    except BaseException:
                        os.rename(old, dst)
                        raise
        except OSError as e:
            raise disk_error(e, "move the finished output into", dst) from None
        self.committed = True
        if old is not None:
            try:
                remove_tree(old)
            except (OSError, ShardkitError) as e:
                log.warning("could not delete the replaced copy %s (%s): delete it yourself", old, e)

    def discard(self) -> None:
        """Leader: remove the staging folder (logged, never raised: the failure that led here wins)."""
        if self.path != Path() and not self.committed:
            try:
                remove_tree(self.path)
            except (OSError, ShardkitError) as e:
                log.warning("could not remove the staging folder %s (%s): delete it yourself", self.path, e)

    def _give_up(self) -> None:
        self.discard()
        self.release()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


@contextlib.contextmanager
def staged_output(
    dst: str | Path,
    *,
    sources: Iterable[str | Path] = (),
    overwrite: bool = False,
    what: str = "write",
    job: Job | None = None,
    sink: Sink = NO_SINK,
) -> Iterator[StagedOutput]:
    """A staged output on every rank of `job` (default: this process's job): yields the
    StagedOutput whose `path` is the staging folder. Call `commit_all(out, job, finish)` at the
    end; leaving the block otherwise (an error, Ctrl-C, SIGTERM) discards the staging folder.
    OSErrors become one-line errors, naming a source file when a read failed. `sink`: where the
    output's finished files go (`io.safety.sinks`; the writers are given it as `out.sink`)."""
    job = job or current_job()
    out = StagedOutput(Path(dst).expanduser().absolute(), [Path(s) for s in sources], overwrite, what, sink=sink)
    with terminate_as_interrupt():
        prepared: Any = None
        if job.leader:
            try:
                out.prepare()
                prepared = str(out.path)
            except ShardkitError as e:
                prepared = e
        prepared = job.broadcast(prepared)
        if isinstance(prepared, BaseException):
            raise prepared
        out.path = Path(prepared)
        try:
            yield out
        except BaseException as e:
            if job.leader:
                out.discard()
            if isinstance(e, OSError):
                name = str(getattr(e, "filename", None) or "")
                if name and not name.startswith(str(out.path)) and not name.startswith(str(out.dst)):
                    raise disk_error(e, "read", name) from None
                raise disk_error(e, "write", out.dst) from None
            raise
        finally:
            if job.leader:
                out.release()


def commit_all(out: StagedOutput, job: Job, finish: Callable[[Path], None] | None = None) -> None:
    """On every rank: the leader runs `finish(staging folder)` (the last files), then commits; a
    failure anywhere fails every rank."""

    def step() -> None:
        if job.leader:
            if finish is not None:
                finish(out.path)
            out.commit()

    job.run_all_or_none(step)


@contextlib.contextmanager
def scratch_folder(near: str | Path, job: Job | None = None) -> Iterator[Path]:
    """A throwaway folder beside `near` for a run's intermediate files (one path for every rank
    of `job`): created empty with an owner file, removed once every rank is done (also on failure,
    Ctrl-C and SIGTERM); one a killed run left is removed by the next run beside `near`."""
    job = job or current_job()
    near = Path(near).expanduser().absolute()
    with terminate_as_interrupt():
        made: Any = None
        if job.leader:
            try:
                near.parent.mkdir(parents=True, exist_ok=True)
                recover_interrupted(near, log)
                folder = sibling_name(near, SCRATCH_TAG)
                remove_tree(folder)
                folder.mkdir()
                write_owner(folder)
                made = str(folder)
            except OSError as e:
                made = disk_error(e, "write", e.filename or near)
            except ShardkitError as e:
                made = e
        made = job.broadcast(made)
        if isinstance(made, BaseException):
            raise made
        try:
            yield Path(made)
        finally:
            with contextlib.suppress(BaseException):
                job.run_all_or_none(lambda: None)  # every rank is done with it
            if job.leader:
                try:
                    remove_tree(made)
                except (OSError, ShardkitError) as e:
                    log.warning("could not remove the scratch folder %s (%s): delete it yourself", made, e)


@dataclass
class TemporaryFolder:
    """A run's own temporary folder (`temporary_folder`); `keep` spares it at the end."""

    path: Path
    keep: bool = False


@contextlib.contextmanager
def temporary_folder(parent: str | Path | None = None, prefix: str = "shardkit-") -> Iterator[TemporaryFolder]:
    """A new folder under `parent` (default: this user's `private_root` in the system's temporary
    folder) for one run's work, removed at the end (also on failure, Ctrl-C and SIGTERM) unless
    its `keep` is set; removed through `delete.remove_tree`, so links placed in it are unlinked,
    never followed."""
    folder = TemporaryFolder(Path(tempfile.mkdtemp(prefix=prefix, dir=private_root() if parent is None else parent)))
    with terminate_as_interrupt():
        try:
            write_owner(folder.path)
            yield folder
        finally:
            if not folder.keep:
                try:
                    remove_tree(folder.path)
                except (OSError, ShardkitError) as e:
                    log.warning("could not remove the temporary folder %s (%s): delete it yourself", folder.path, e)
            else:
                (folder.path / OWNER_FILE).unlink(missing_ok=True)


def write_file(path: str | Path, chunks: Iterable[bytes], *, what: str = "file") -> None:
    """A single output file: written as `.NAME.shardkit-tmp-PID` beside it (created new, never
    through a link) and renamed over `path` at the end, so a failure leaves the old file (or
    nothing); a `path` that is a symlink or a folder is refused. OSErrors become one line."""
    path = Path(path).expanduser().absolute()
    if is_link(path):
        raise DestinationExistsError(
            f"{shown(path)} is a symlink: shardkit never writes through a link; give the real path"
        )
    if path.is_dir():
        raise DestinationExistsError(f"{shown(path)} is a folder: give a file name for the {what}")
    tmp = sibling_name(path, STAGING_TAG)
    try:
        with terminate_as_interrupt():
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                try:
                    for chunk in chunks:
                        view = memoryview(chunk).cast("B")
                        while view:
                            view = view[os.write(fd, view) :]
                finally:
                    os.close(fd)
                os.rename(tmp, path)
            except BaseException:
                remove_file(tmp)
                raise
    except OSError as e:
        raise disk_error(e, f"write the {what}", path) from None


# ---- a marked folder (complete once its marker is written last) -------------------------------------


@dataclass
class MarkedFolder:
    """A folder written in place, complete only once `marker` exists (NxD's `<tag>/done`).

    `prepare` replaces an older folder of that name (`remove`) and writes `first` (NxD's
    `checkpoint` marker) and an owner file; `commit` writes the marker last; `remove` deletes a
    folder so that an interruption at any point leaves an incomplete one (never a complete-looking
    one) that is still recognisable by `first`. A folder left by a killed writer has the owner
    file of a dead process (`dead_owner`), by which retention knows it may remove it."""

    folder: Path
    marker: str
    first: str | None = None
    fsync: bool = True

    def prepare(self) -> None:
        folder = self.folder
        if is_link(folder) or os.path.lexists(folder):
            self.remove()
        folder.mkdir()
        if self.first is not None:
            write_marker(folder, self.first, self.fsync)
        write_owner(folder)
        if self.fsync:
            fsync_path(folder.parent)

    def commit(self) -> None:
        (self.folder / OWNER_FILE).unlink(missing_ok=True)
        write_marker(self.folder, self.marker, self.fsync)
        if self.fsync:
            fsync_path(self.folder.parent)

    def clear_marker(self) -> bool:
        """Remove the marker (durably): the folder becomes incomplete. False when it had none or
        is a link (a link is never written through)."""
        folder = self.folder
        if is_link(folder):
            return False
        done = folder / self.marker
        if not os.path.lexists(done):
            return False
        remove_file(done)
        if self.fsync:
            fsync_path(folder)
        return True

    def remove(self) -> None:
        """Delete the folder: a link is unlinked (its target left alone); else the marker first
        (durably), then everything but `first`, then `first`, then the folder. Refused before
        anything is deleted when a mount point sits inside (`delete.refuse_mounts`)."""
        folder = self.folder
        if is_link(folder) or (os.path.lexists(folder) and not folder.is_dir()):
            remove_file(folder)
            if self.fsync:
                fsync_path(folder.parent)
            return
        if not folder.exists():
            return
        refuse_mounts(folder)
        self.clear_marker()
        for entry in sorted(os.listdir(folder)):
            if entry != self.first:
                remove_tree(folder / entry)
        if self.first is not None:
            remove_tree(folder / self.first)
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        if self.fsync:
            fsync_path(folder.parent)
