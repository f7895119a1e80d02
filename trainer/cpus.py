"""How many CPU threads a process of the job computes with (`--threads`), and how they wait.

torch's default is one OpenMP thread per logical CPU, and libgomp's threads spin (300,000 rounds)
while they wait for work. On a host whose cores are busy with other work, spinning threads fight it
and a run slows many times over (measured on 2 busy cores: 36 s a step against 1.2-1.5 s on the quiet
host); waiting passively (OMP_WAIT_POLICY=PASSIVE) is the fastest there (2.3-4.2 s), but on a
dedicated host it costs up to 1.3x a step, and no fixed spin length was fast in both cases
(scripts/bench_threads.py). So the trainer looks at the host when it starts (`choose_waiting`, from
`trainer/__init__.py`, before torch loads its OpenMP runtime, which reads the setting once): threads
wait passively when other work keeps at least half the CPUs this process may use busy (sampled for
0.2 s), else as OpenMP does by default; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment decide instead. The
thread count defaults to one per *physical* core this process may run on, shared among the job's
processes on the host.
"""

from __future__ import annotations

import os
import time
from collections.abc import MutableMapping
from pathlib import Path

CPU_TOPOLOGY = Path("/sys/devices/system/cpu")


WAITING: list[str] = ["as OpenMP's default"]  # how threads wait, for the run's first log line


def affinity() -> set[int]:
    """The logical CPUs this process may run on."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def busy_cpus(sample_s: float = 0.2) -> float | None:
    """How many CPUs of the host other work keeps busy now: /proc/stat's non-idle share over
    `sample_s` (this process sleeps meanwhile), times the CPUs; None where there is no /proc/stat.
    Not the load average, which lags a minute behind (a job that just ended still counts in it)."""

    def times() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields[:8])  # idle + iowait, total

    try:
        idle0, total0 = times()
        time.sleep(sample_s)
        idle1, total1 = times()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return 0.0
    return (1 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def choose_waiting(env: MutableMapping[str, str], busy: float | None = None, cpus: int | None = None) -> str:
    """Set OMP_WAIT_POLICY=PASSIVE in `env` when other work already keeps at least half the CPUs of
    this process's affinity busy (`busy`, default `busy_cpus()`) and the environment says nothing of
    how OpenMP threads wait; returns (and records in WAITING) how they wait."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        how = "as OMP_WAIT_POLICY / GOMP_SPINCOUNT say"
    else:
        busy = busy if busy is not None else busy_cpus()
        cpus = cpus if cpus is not None else len(affinity())
        if busy is None:  # no /proc/stat: the load average
            busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if busy >= cpus / 2:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
            how = f"passively, {busy:.1f} of {cpus} CPUs busy at start"
        else:
            how = "as OpenMP does by default, a quiet host"
    WAITING[0] = how
    return how


def physical_cores(cpus: set[int] | None = None) -> int:
    """The physical cores among `cpus` (default: this process's CPU affinity): logical CPUs that are
    hyper-threads of one core count once. Without the topology (not Linux), the logical CPUs."""
    if cpus is None:
        cpus = affinity()
    cores = set()
    for cpu in cpus:
        topology = CPU_TOPOLOGY / f"cpu{cpu}" / "topology"
        try:
            cores.add(
                (topology / "physical_package_id").read_text().strip()
                + ":"
                + (topology / "core_id").read_text().strip()
            )
        except OSError:
            cores.add(f"cpu{cpu}")
    return max(1, len(cores))


def default_threads(env: dict[str, str] | os._Environ[str] = os.environ, cores: int | None = None) -> int:
    """`--threads 0`: OMP_NUM_THREADS when set (torchrun sets 1 for several processes per host), else
    the physical cores of this process's affinity divided among the job's processes on this host
    (LOCAL_WORLD_SIZE), at least one."""
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    local = env.get("LOCAL_WORLD_SIZE", "").strip()
    processes = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, (cores if cores is not None else physical_cores()) // processes)


def use_threads(requested: int) -> int:
    """Set torch's intra-op threads (`requested`, or `default_threads()` for 0); returns the count."""
    import torch

    threads = requested or default_threads()
    torch.set_num_threads(threads)
    return threads
