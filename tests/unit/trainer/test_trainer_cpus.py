"""The trainer's CPU threads (`--threads`, trainer/cpus.py): physical cores of the affinity, shared
among the host's processes, OMP_NUM_THREADS when given, and passive OpenMP waiting on a busy host."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import cpus

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def topology(tmp_path, monkeypatch):
    """A fake /sys/devices/system/cpu: 8 logical CPUs, hyper-threads in pairs on 4 cores of one package."""
    for cpu in range(8):
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text("0\n")
        (d / "core_id").write_text(f"{cpu % 4}\n")
    monkeypatch.setattr(cpus, "CPU_TOPOLOGY", tmp_path)


def test_physical_cores_count_hyperthreads_once(topology):
    assert cpus.physical_cores(set(range(8))) == 4
    assert cpus.physical_cores({0, 4}) == 1  # two threads of core 0
    assert cpus.physical_cores({0, 1, 5}) == 2


def test_physical_cores_without_topology(tmp_path, monkeypatch):
    monkeypatch.setattr(cpus, "CPU_TOPOLOGY", tmp_path / "missing")
    assert cpus.physical_cores({0, 1, 2}) == 3


@pytest.mark.parametrize(
    "env,cores,expected",
    [
        ({}, 4, 4),  # one process: every physical core
        ({"LOCAL_WORLD_SIZE": "2"}, 4, 2),  # shared among the host's processes
        ({"LOCAL_WORLD_SIZE": "8"}, 4, 1),  # at least one
        ({"OMP_NUM_THREADS": "3", "LOCAL_WORLD_SIZE": "2"}, 4, 3),  # the user's (or torchrun's) value wins
        ({"OMP_NUM_THREADS": "junk"}, 4, 4),
    ],
)
def test_default_threads(env, cores, expected):
    assert cpus.default_threads(env, cores) == expected


@pytest.mark.parametrize(
    "env,busy,expected",
    [
        ({}, 0.3, None),  # a quiet host: OpenMP's default (spinning, the fastest there)
        ({}, 1.0, "PASSIVE"),  # other work keeps half the CPUs busy at start
        ({}, 7.5, "PASSIVE"),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, 7.5, "ACTIVE"),  # the user's choice stands
        ({"GOMP_SPINCOUNT": "10"}, 7.5, None),
    ],
)
def test_threads_wait_passively_on_a_busy_host(env, busy, expected):
    given = dict(env)
    how = cpus.choose_waiting(env, busy=busy, cpus=2)
    assert env.get("OMP_WAIT_POLICY") == expected, how
    assert ("passively" in how) == (expected == "PASSIVE" and "OMP_WAIT_POLICY" not in given), how


def test_importing_the_trainer_chooses_before_torch_loads_openmp():
    """The choice is made in `import trainer`, before torch (whose OpenMP runtime reads it once)."""
    code = "import sys, trainer; from trainer import cpus; print(cpus.WAITING[0])"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="ACTIVE")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "as OMP_WAIT_POLICY / GOMP_SPINCOUNT say"
    import trainer.cpus as mod

    source = (ROOT / "trainer" / "__init__.py").read_text()
    assert source.index("choose_waiting(os.environ)") < source.index("from .config import")  # before torch
    assert "torch" not in mod.__dict__


def test_busy_cpus_sees_a_busy_loop():
    """/proc/stat's share: a process spinning on one CPU shows up as about one busy CPU."""
    if cpus.busy_cpus(0.05) is None:
        pytest.skip("no /proc/stat on this platform")
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.5)
        assert cpus.busy_cpus(0.5) >= 0.7
    finally:
        spinner.kill()
        spinner.wait()
