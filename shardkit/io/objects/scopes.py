"""Who owns an open mirror: the scope it was opened in, never a list of the process.

A command opens its s3:// sources inside `mirrors_scope()`. The block's `MirrorScope` (the
current one of this context, a `contextvars.ContextVar`, as `decimal.localcontext` is) owns every
mirror opened while it runs: they are closed (their folders removed) when it ends, also on Ctrl-C
and SIGTERM, and its messages name their s3:// URLs rather than their local folders (`named`).
Scopes nest: an inner one closes only its own mirrors and names its outer ones' too.

A mirror opened outside any scope (a library user's `open_source`, `io.store.readable`) is its
own owner: its folder is removed when it is closed, collected or the process exits
(`weakref.finalize`), and on SIGTERM (whose default ends the process without exit handlers).
A thread starts with an empty context: a mirror a worker thread opened is such a mirror. A run
killed outright leaves its folder to the next run (`remote._remove_stale`).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import ShardkitError
from ..safety import transaction
from ..safety.delete import remove_tree

if TYPE_CHECKING:
    from .remote import Mirror


class MirrorScope:
    """The mirrors opened while this scope was current (see the module's docstring)."""

    def __init__(self, outer: MirrorScope | None = None) -> None:
        self.outer = outer
        self._mirrors: list[Mirror] = []
        self._lock = threading.Lock()

    def adopt(self, mirror: Mirror) -> None:
        with self._lock:
            self._mirrors.append(mirror)

    def release(self, mirror: Mirror) -> None:
        """`mirror` is being closed by its store before the scope ends."""
        with self._lock:
            if mirror in self._mirrors:
                self._mirrors.remove(mirror)

    def mirrors(self) -> list[Mirror]:
        """This scope's open mirrors and its outer scopes'."""
        with self._lock:
            own = list(self._mirrors)
        return own + (self.outer.mirrors() if self.outer is not None else [])

    def named(self, text: object) -> str:
        """`text` with each of `mirrors()`'s local folders replaced by the URL it stands for."""
        out = str(text)
        for mirror in self.mirrors():
            out = out.replace(str(mirror.root), str(mirror.loc))
        return out

    def close(self) -> None:
        """Close this scope's own mirrors (their folders removed)."""
        with self._lock:
            closing, self._mirrors = self._mirrors, []
        for mirror in closing:
            mirror.close()


_CURRENT: contextvars.ContextVar[MirrorScope | None] = contextvars.ContextVar("shardkit_mirror_scope", default=None)


def current() -> MirrorScope | None:
    """The scope mirrors opened now belong to (None outside any)."""
    return _CURRENT.get()


@contextlib.contextmanager
def mirrors_scope(interrupt: bool = True) -> Iterator[MirrorScope]:
    """A new scope, current while the block runs: the mirrors opened inside it are closed when it
    ends; an error raised inside it names the URLs its mirrors stand for, not their local
    folders. `interrupt` (a command): SIGTERM becomes Ctrl-C inside the block
    (`transaction.terminate_as_interrupt`), so the block ends and its mirrors go; otherwise (a
    process with its own SIGTERM handling, the trainer) SIGTERM removes the scope's folders
    first and keeps its meaning (`transaction.remove_on_sigterm`). Closing never waits for a GET
    the store does not answer."""
    scope = MirrorScope(_CURRENT.get())
    token = _CURRENT.set(scope)
    signals = transaction.terminate_as_interrupt() if interrupt else contextlib.nullcontext()
    if not interrupt:
        transaction.remove_on_sigterm(lambda: [m.base for m in scope.mirrors()])
    try:
        with signals:
            try:
                yield scope
            except ShardkitError as e:
                if len(e.args) == 1 and isinstance(e.args[0], str):
                    e.args = (scope.named(e.args[0]),)
                raise
            finally:
                scope.close()
    finally:
        _CURRENT.reset(token)


def adopt(mirror: Mirror) -> None:
    """Give a just-opened `mirror` its owner: the current scope, else itself (module docstring)."""
    scope = _CURRENT.get()
    mirror.scope = scope
    if scope is not None:
        scope.adopt(mirror)
        return
    base = mirror.base
    weakref.finalize(mirror, _remove_folder, base)  # closed, collected, or at exit
    transaction.remove_on_sigterm(lambda: [base] if base.exists() else [])


def release(mirror: Mirror) -> None:
    """`mirror` is closed before its scope ends."""
    if mirror.scope is not None:
        mirror.scope.release(mirror)


def named(text: object) -> str:
    """`text` (a message, a path) as shown to the user: the local folder of every mirror of the
    current scope (and its outer ones) replaced by the s3:// URL it stands for
    (`<tmp>/shardkit-UID/shardkit-s3-x/step_4` -> `s3://bucket/ckpt/step_4`)."""
    scope = _CURRENT.get()
    return scope.named(text) if scope is not None else str(text)


def _remove_folder(base: Path) -> None:
    with contextlib.suppress(OSError, ShardkitError):
        remove_tree(base)
