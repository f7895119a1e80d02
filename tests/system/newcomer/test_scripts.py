"""Quick checks of the benchmark scripts' shared code (scripts/bench_common.py) and their command lines.

The benchmarks themselves take minutes; these run in seconds and never drop the page cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import bench_common as bc  # noqa: E402


def test_split_files_uses_shardkit_sizes():
    tensors = [("a", (1000,)), ("b", (1000,)), ("c", (1500,))]  # 2000, 2000, 3000 bytes in bf16
    assert bc.split_files(tensors, 2, "4KB") == {
        "model-00001-of-00002.safetensors": ["a", "b"],
        "model-00002-of-00002.safetensors": ["c"],
    }
    assert bc.split_files(tensors, 2, "1MB") == {"model.safetensors": ["a", "b", "c"]}
    assert bc.split_files(tensors, 2, 4000) == bc.split_files(tensors, 2, "4KB")


def test_require_drop_caches_exits_2_when_not_root(monkeypatch, capsys):
    monkeypatch.setattr(bc.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(bc, "drop_caches", lambda: pytest.fail("must not try to drop caches"))
    with pytest.raises(SystemExit) as e:
        bc.require_drop_caches()
    assert e.value.code == 2
    assert "not running as root" in capsys.readouterr().err


def test_require_drop_caches_exits_2_when_the_kernel_refuses(monkeypatch, capsys):
    monkeypatch.setattr(bc.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bc, "drop_caches", lambda: (False, "cannot drop caches (Read-only file system)"))
    with pytest.raises(SystemExit) as e:
        bc.require_drop_caches()
    assert e.value.code == 2
    assert "Read-only file system" in capsys.readouterr().err


def test_settle_syncs_or_drops(monkeypatch):
    calls = []
    monkeypatch.setattr(bc, "sync_disks", lambda: calls.append("sync"))
    monkeypatch.setattr(bc, "drop_caches", lambda: (calls.append("drop"), (True, "dropped"))[1])
    bc.settle(False)
    bc.settle(True)
    assert calls == ["sync", "drop"]
    monkeypatch.setattr(bc, "drop_caches", lambda: (False, "no"))
    with pytest.raises(SystemExit) as e:
        bc.settle(True)
    assert e.value.code == 2


def test_settle_removes_the_steps_old_output_first_and_waits(monkeypatch, tmp_path):
    calls = []
    old = tmp_path / "old-output"
    (old / "sub").mkdir(parents=True)
    monkeypatch.setattr(bc, "sync_disks", lambda: calls.append(("sync", old.exists())))
    monkeypatch.setattr(bc.time, "sleep", lambda s: calls.append(("sleep", s)))
    monkeypatch.setattr(bc, "SETTLE_WAIT", 2.5)
    bc.settle(False, old, tmp_path / "absent")
    assert calls == [("sync", False), ("sleep", 2.5)]


def test_settle_wait_option(capsys):
    import argparse

    p = argparse.ArgumentParser()
    bc.add_settle_wait(p)
    try:
        bc.use_settle_wait(p.parse_args(["--settle-wait", "1.5"]))
        assert bc.SETTLE_WAIT == 1.5
        with pytest.raises(SystemExit) as e:
            bc.use_settle_wait(p.parse_args(["--settle-wait", "-1"]))
        assert e.value.code == 2 and "--settle-wait" in capsys.readouterr().err
    finally:
        bc.SETTLE_WAIT = 0.0


def _slow_import_module(tmp_path: Path) -> Path:
    """A module whose import takes a while and leaves a mark, and whose function reports whether
    the parent's preparation (`before`) had run when it was called."""
    (tmp_path / "slow_import_probe.py").write_text(
        "import time\nfrom pathlib import Path\n"
        f"HERE = Path({str(tmp_path)!r})\n"
        "time.sleep(0.3)\n"
        "(HERE / 'imported').write_text('yes')\n"
        "def probe():\n"
        "    return {'settled': (HERE / 'settled').exists()}\n"
    )
    return tmp_path


def test_run_python_prepares_the_step_after_the_childs_imports_and_before_its_call(tmp_path):
    """The page cache is settled right before the timed call, as for cp, not before the child's
    imports (on a VM that hands free memory back to its host, the imports' delay changed the result)."""
    here = _slow_import_module(tmp_path)
    seen = []

    def before():
        seen.append((here / "imported").exists())
        (here / "settled").write_text("yes")

    m = bc.run_python("probe", "slow_import_probe:probe", {}, tmp_path / "logs", sys_path=[here], before=before)
    assert seen == [True]  # the child had imported everything
    assert m.result == {"settled": True}  # and the call came after the preparation


def test_run_python_kills_the_child_when_the_preparation_fails(tmp_path):
    here = _slow_import_module(tmp_path)

    def before():
        raise SystemExit(2)  # as settle does when the page cache cannot be dropped

    with pytest.raises(SystemExit):
        bc.run_python("probe", "slow_import_probe:probe", {}, tmp_path / "logs", sys_path=[here], before=before)
    assert not (here / "settled").exists()


def test_run_python_reports_a_child_that_fails_before_it_is_ready(tmp_path):
    with pytest.raises(bc.ChildError, match="failed"):
        bc.run_python("probe", "no_such_module_anywhere:probe", {}, tmp_path / "logs", before=pytest.fail)


def test_cp_baseline_measures_and_removes_the_copy(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"x" * 5000)
    m = bc.cp_baseline("cp -r src", src, tmp_path / "copy", tmp_path / "logs")
    assert m.bytes_written == 5000 and m.seconds > 0 and m.peak_rss > 0
    assert not (tmp_path / "copy").exists()


def test_load_lines():
    assert bc.load_lines(None, (1.0, 1.0, 1.0)) == []
    lines = bc.load_lines((0.0, 0.1, 0.2), (0.0, 0.0, 0.0))
    assert lines == ["load:   1/5/15-min load average 0.0/0.1/0.2 at start, 0.0/0.0/0.0 at end"]
    busy = bc.load_lines((99.0, 0.0, 0.0), (99.0, 0.0, 0.0))
    assert len(busy) == 2 and busy[1].startswith("        WARNING: 1-min load average 99.0")


def test_format_table_aligns_numbers_right():
    text = bc.format_table(["op", "seconds"], [["cp", "1.50"], ["convert", "12.25"]])
    assert text.splitlines() == ["op       seconds", "-------  -------", "cp          1.50", "convert    12.25"]


@pytest.mark.parametrize(
    "script",
    [
        "bench_ab.py",
        "bench_convert.py",
        "bench_reshard.py",
        "bench_checkpoint.py",
        "bench_start.py",
        "bench_train.py",
        "bench_verify.py",
    ],
)
def test_scripts_parse_their_options(script):
    out = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True, check=True)
    assert "usage:" in out.stdout
    if script in ("bench_ab.py", "bench_convert.py", "bench_reshard.py"):
        assert "--drop-caches" in out.stdout


def test_bench_ab_takes_a_worker_count_or_auto(capsys):
    import bench_ab

    assert bench_ab.parse_args(["--workers", "auto"]).workers == "auto"
    assert bench_ab.parse_args(["--workers", "2"]).workers == 2
    with pytest.raises(SystemExit):
        bench_ab.parse_args(["--workers", "0"])
    assert "workers must be a positive integer or auto" in capsys.readouterr().err


def test_bench_ab_refuses_an_unknown_step(capsys):
    import bench_ab

    assert bench_ab.main(["--ops", "merge,resahrd"]) == 2
    assert "unknown --ops resahrd" in capsys.readouterr().err
