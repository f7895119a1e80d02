"""scripts/demo.py, the newcomer's first command: its --out folder is its own.

A folder holding anything the demo did not make (a user's notes.txt) is refused with one line and
exit 2, before any model is built, and the user's file is left as it was; (slow) the full demo
runs, and a second run into the folder it made works.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "scripts" / "demo.py"
MARK = ".shardkit-demo"


def demo(out: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(DEMO), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line(done: subprocess.CompletedProcess, *phrases: str) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("demo: error:"), (
        done.returncode,
        done.stderr,
    )
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def test_demo_refuses_a_folder_it_did_not_make(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("the user's notes\n")
    done = demo(out, timeout=120)
    one_line(done, str(out), "not empty", "--out")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # no model, no mark, nothing else
    assert (out / "notes.txt").read_text() == "the user's notes\n"
    assert "building" not in done.stdout
    (tmp_path / "a-file").write_text("not a folder\n")
    one_line(demo(tmp_path / "a-file", timeout=120), "is a file", "--out")
    assert (tmp_path / "a-file").read_text() == "not a folder\n"


@pytest.mark.slow
def test_demo_runs_and_runs_again_in_its_own_folder(tmp_path):
    out = tmp_path / "demo"
    for run in (1, 2):
        done = demo(out, timeout=1200)
        assert done.returncode == 0, (run, done.stdout[-3000:], done.stderr[-3000:])
        assert "are identical to the original's" in done.stdout, done.stdout[-2000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MARK, "tinyllama-mini", "tinyllama-mini-tp8pp2", "tinyllama-mini-merged"]
    )
