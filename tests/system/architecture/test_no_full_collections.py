"""The streaming operations hold off the interpreter's full garbage collections while they run
(`engine.no_full_collections`) and give the thresholds back after, whatever happens; the command's
start-up (torch, click, the commands) runs none either, and leaves what it imported frozen."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from shardkit import Layout, api, convert, merge
from shardkit.engine import executor, no_full_collections

ROOT = Path(__file__).resolve().parents[3]

COMMAND_START = r"""
import gc, sys
full = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and full.append(1))
from shardkit.cli import main  # the console script's two lines
sys.argv = ["shardkit", "--version"]
try:
    main()
except SystemExit:
    pass
print(len(full), gc.isenabled(), gc.get_freeze_count())
"""


@pytest.fixture(autouse=True)
def _thresholds():
    before = gc.get_threshold()
    yield before
    assert gc.get_threshold() == before
    gc.set_threshold(*before)


def test_only_young_generations_are_collected_inside_and_thresholds_come_back(_thresholds):
    with no_full_collections():
        inside = gc.get_threshold()
        with no_full_collections():  # nested: the outer block still holds
            pass
        assert gc.get_threshold() == inside
    assert inside[:2] == _thresholds[:2]
    assert inside[2] == executor.FULL_COLLECTIONS_OFF
    assert gc.get_threshold() == _thresholds


def test_thresholds_come_back_after_an_error_and_only_when_the_last_thread_leaves(_thresholds):
    with pytest.raises(RuntimeError):
        with no_full_collections():
            raise RuntimeError("boom")
    assert gc.get_threshold() == _thresholds

    entered, leave = threading.Event(), threading.Event()

    def other() -> None:
        with no_full_collections():
            entered.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    assert entered.wait(10)
    with no_full_collections():
        pass
    assert gc.get_threshold()[2] == executor.FULL_COLLECTIONS_OFF  # the other thread still holds
    leave.set()
    thread.join()
    assert gc.get_threshold() == _thresholds


def test_convert_and_merge_run_without_full_collections_from_opening_the_source_on(tiny_model, tmp_path, monkeypatch):
    """Held from the moment the source is opened (its planning allocates too), not only while the
    files are written."""
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    seen: list[int] = []
    real_open = api.open_source

    def opening(*args, **kwargs):
        seen.append(gc.get_threshold()[2])
        return real_open(*args, **kwargs)

    monkeypatch.setattr(api, "open_source", opening)
    progress: list[int] = []
    convert(
        src,
        tmp_path / "shards",
        Layout(tp=2, pp=1),
        progress=lambda done, total: progress.append(gc.get_threshold()[2]),
    )
    merge(tmp_path / "shards", tmp_path / "merged")
    assert seen == [executor.FULL_COLLECTIONS_OFF] * 2
    assert progress and set(progress) == {executor.FULL_COLLECTIONS_OFF}


def test_the_command_starts_without_full_collections_and_with_the_collector_on():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", COMMAND_START], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    version, counts = done.stdout.strip().splitlines()
    full, enabled, frozen = counts.split()
    assert version.startswith("shardkit, version")
    assert (full, enabled) == ("0", "True"), done.stdout
    assert int(frozen) > 50_000  # torch's and the commands' objects: no full collection walks them again
