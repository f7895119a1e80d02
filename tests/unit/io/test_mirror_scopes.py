"""Who owns an open mirror (`shardkit.io.objects.scopes`): the scope it was opened in closes it and
names its URL; scopes nest; a rank thread of the trainer opens into its caller's scope; a mirror
opened outside any scope removes its own folder. Mirrors here are stand-ins with a real folder:
what is tested is ownership, not fetching (tests/system/s3 opens real ones against moto)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from shardkit.errors import FormatError
from shardkit.io.objects import scopes

ROOT = Path(__file__).resolve().parents[3]


class FakeMirror:
    """What a scope uses of a mirror: its folder, the URL it stands for, close."""

    scope = None

    def __init__(self, base: Path, url: str):
        self.base = base
        self.root = base / "prefix"
        self.root.mkdir(parents=True)
        self.loc = url
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _open(tmp_path: Path, name: str) -> FakeMirror:
    mirror = FakeMirror(tmp_path / name, f"s3://bucket/{name}")
    scopes.adopt(mirror)  # type: ignore[arg-type]
    return mirror


def test_a_scope_closes_its_mirrors_and_names_their_urls(tmp_path):
    with pytest.raises(FormatError) as raised:
        with scopes.mirrors_scope():
            mirror = _open(tmp_path, "a")
            assert scopes.named(mirror.root / "config.json") == "s3://bucket/a/config.json"
            raise FormatError(f"{mirror.root}/model.pt is truncated")
    assert str(raised.value) == "s3://bucket/a/model.pt is truncated"
    assert mirror.closed
    assert scopes.current() is None
    assert scopes.named(mirror.root) == str(mirror.root)  # no scope: nothing to name


def test_an_inner_scope_closes_only_its_own_and_names_the_outer_ones_too(tmp_path):
    with scopes.mirrors_scope() as outer:
        first = _open(tmp_path, "outer")
        with scopes.mirrors_scope() as inner:
            second = _open(tmp_path, "inner")
            assert inner.outer is outer
            assert scopes.named(f"{first.root} {second.root}") == "s3://bucket/outer s3://bucket/inner"
        assert second.closed and not first.closed
        assert scopes.named(second.root) == str(second.root)
    assert first.closed


def test_a_mirror_closed_by_its_store_leaves_its_scope(tmp_path):
    with scopes.mirrors_scope() as scope:
        mirror = _open(tmp_path, "a")
        scopes.release(mirror)  # type: ignore[arg-type]
        assert scope.mirrors() == []
    assert not mirror.closed  # its store closed it; the scope does not close it again


def test_the_trainers_rank_threads_open_into_the_callers_scope(tmp_path):
    from trainer.comm.threads import run_in_threads

    with scopes.mirrors_scope() as scope:
        outcomes = run_in_threads(
            [None, None], lambda: _open(tmp_path, threading.current_thread().name), 60, lambda d: None
        )
        assert [e for _, e in outcomes] == [None, None]
        opened = [m for m, _ in outcomes]
        assert sorted(m.loc for m in scope.mirrors()) == sorted(m.loc for m in opened)  # type: ignore[union-attr]
    assert all(m.closed for m in opened)  # type: ignore[union-attr]


def test_a_mirror_outside_any_scope_removes_its_folder_once_collected(tmp_path):
    mirror = _open(tmp_path, "alone")
    base = mirror.base
    assert mirror.scope is None and base.is_dir()
    del mirror
    gc.collect()
    assert not base.exists()


def test_a_mirror_outside_any_scope_removes_its_folder_at_exit(tmp_path):
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_mirror_scopes import _open
        kept = _open(Path({str(tmp_path)!r}), "kept")
        print(kept.base, flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    base = Path(out.stdout.strip())
    assert base.parent == tmp_path
    assert not base.exists()
