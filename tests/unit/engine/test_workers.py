"""`--workers auto`: how many output files are built at once for the cores a process may use, and
what the operations then run with."""

from __future__ import annotations

import pytest
import torch

from shardkit import Layout, convert, reshard
from shardkit.engine import executor, planning


def _cores(monkeypatch, n: int) -> None:
    monkeypatch.setattr(planning.os, "sched_getaffinity", lambda pid: set(range(n)), raising=False)


@pytest.mark.parametrize(
    ("cores", "ranks", "expected"),
    [
        (1, 1, 1),
        (2, 1, 1),  # one worker and its write-behind threads already keep both cores busy
        (3, 1, 1),
        (4, 1, 2),
        (8, 1, 4),
        (64, 1, 4),  # AUTO_MAX_WORKERS
        (8, 2, 2),  # the host's cores are shared among the torchrun ranks on it
        (8, 8, 1),
        (2, 4, 1),  # never fewer than one
    ],
)
def test_auto_workers_counts_two_cores_per_worker(monkeypatch, cores, ranks, expected):
    _cores(monkeypatch, cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    assert planning.auto_workers() == expected
    assert planning.resolve_workers("auto", files=100) == expected
    assert planning.resolve_workers(None, files=100) == expected
    assert planning.resolve_workers("auto", files=1) == 1  # never more than the files to write


def test_auto_workers_without_affinity_uses_the_cpu_count(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def unsupported(pid):
        raise OSError("no affinity here")

    monkeypatch.setattr(planning.os, "sched_getaffinity", unsupported, raising=False)
    monkeypatch.setattr(planning.os, "cpu_count", lambda: 6)
    assert planning.auto_workers() == 3


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5, True, "0"])
def test_explicit_workers_must_be_a_positive_integer(bad):
    with pytest.raises(ValueError, match="workers must be a positive integer or 'auto'"):
        planning.resolve_workers(bad, files=4)


@pytest.mark.parametrize(("cores", "expected"), [(2, 1), (4, 2)])
def test_operations_run_with_the_workers_auto_picks(tiny_model, tmp_path, monkeypatch, cores, expected):
    """The default (auto) is what convert and reshard run with: one worker on a 2-core machine,
    two on 4 cores (a tiny model's tensors are far below the memory cap)."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    _cores(monkeypatch, cores)
    used: list[int] = []
    real = executor._write_all

    def spy(build, groups, workers, *args, **kwargs):
        used.append(workers)
        return real(build, groups, workers, *args, **kwargs)

    monkeypatch.setattr(executor, "_write_all", spy)
    src = tiny_model("llama-gqa64", dtype=torch.bfloat16)
    convert(src, tmp_path / "tp2", Layout(tp=2, pp=2), format="torch")
    reshard(tmp_path / "tp2", tmp_path / "tp1", Layout(tp=1, pp=2), format="torch")
    assert used == [expected, expected]
