"""Helpers of the S3 tests (tests/system/s3, tests/system/safety/test_safety_s3.py): listing a
bucket's keys, the CLI in process and in a subprocess, checkpoints saved to a bucket, a shardkit
killed while it uploads, and the per-test temporary folder (import `own_temporary_folder`: autouse).

Importing this module skips the importing test module without moto[server] or boto3, as the S3 test
modules did when they imported the former test_s3.py."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed (pip install -e '.[test]')")
boto3 = pytest.importorskip("boto3", reason="boto3 is not installed (pip install -e '.[s3]')")

import ckpt_child  # noqa: E402
from click.testing import CliRunner  # noqa: E402

from shardkit.cli import cli  # noqa: E402
from shardkit.io.objects import remote, s3  # noqa: E402
from shardkit.layout import Layout  # noqa: E402


@pytest.fixture(autouse=True)
def own_temporary_folder(own_temporary_folder):
    """Every test here has its own system temporary folder (tests/s3_fixtures.py)."""
    return own_temporary_folder


def keys(bucket: str, prefix: str = "") -> list[str]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def no_mirrors_left() -> None:
    """No mirror or output staging folder left in the test's temporary folder by this process or
    one that has ended."""
    from shardkit.io.safety.transaction import pid_alive

    base = Path(tempfile.gettempdir()) / f"shardkit-{os.getuid()}"
    left = []
    for entry in os.listdir(base) if base.is_dir() else []:
        if not entry.startswith("shardkit-s3-"):
            continue
        try:
            pid = int((base / entry / ".shardkit-owner").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # (being created or removed just now)
        if pid == os.getpid() or not pid_alive(pid):
            left.append(entry)
    assert not left, left


def run(*args: object):
    return CliRunner().invoke(cli, ["-q", *map(str, args)], catch_exceptions=False)


def run_sub(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardkit", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=os.environ
    )


def _fetched(monkeypatch) -> list[tuple[int, int]]:
    """(bytes fetched, GETs) of every mirror closed from now on."""
    counts: list[tuple[int, int]] = []
    gets = [0]
    original_close, original_get = remote.Mirror.close, s3.get_range

    def close(self):
        counts.append((self.bytes_fetched, gets[0]))
        gets[0] = 0
        original_close(self)

    def get_range(*args, **kwargs):
        gets[0] += 1
        return original_get(*args, **kwargs)

    monkeypatch.setattr(remote.Mirror, "close", close)
    monkeypatch.setattr(s3, "get_range", get_range)
    return counts


def s3_loc(url: str):
    from shardkit.io.location import parse_location

    return parse_location(url)


def kill_while_uploading(args: list[str], workdir) -> None:
    """Run `shardkit ARGS` in a process whose uploads are slowed down, and kill -9 it while it uploads."""
    code = (
        "import time, sys\n"
        "from shardkit.io.objects import s3\n"
        "orig = s3.Uploader.upload\n"
        "def slow(self, *a, **k):\n"
        "    print('UPLOADING', flush=True); time.sleep(0.5); return orig(self, *a, **k)\n"
        "s3.Uploader.upload = slow\n"
        f"sys.argv = ['shardkit', *{args!r}]\n"
        "from shardkit.cli import main; main()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=workdir)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "UPLOADING" in line:
            break
    time.sleep(1.2)
    proc.kill()
    proc.wait()


CONFIG = "tinyllama-mini"


TP2PP2 = Layout(tp=2, pp=2, qkv="gqa")


def _save(root: str, tag: str, layout: Layout, config: dict, state: dict, step: int, **options) -> None:
    ckpt_child.save_all_ranks(root, tag, layout, config, state, step, **options)
