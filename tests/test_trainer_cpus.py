"""The trainer's CPU threads (`--threads`, trainer/cpus.py): physical cores of the affinity, shared
among the host's processes, OMP_NUM_THREADS when given, and a short OpenMP spin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import cpus

ROOT = Path(__file__).resolve().parent.parent


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


def test_importing_the_trainer_shortens_openmp_spinning():
    """GOMP_SPINCOUNT is set before torch loads its OpenMP runtime (which reads it once), unless the
    user chose how threads wait (OMP_WAIT_POLICY or GOMP_SPINCOUNT)."""
    code = "import os, trainer, torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(ROOT)

    def spin(**extra: str) -> str:
        done = subprocess.run([sys.executable, "-c", code], env=dict(env, **extra), capture_output=True, text=True,
                              check=True)
        return done.stdout.strip()

    assert spin() == "3000"
    assert spin(OMP_WAIT_POLICY="PASSIVE") == "None"
    assert spin(GOMP_SPINCOUNT="10") == "10"
