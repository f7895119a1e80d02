"""How many CPU threads a process of the job computes with (`--threads`), and how they wait.

torch's default is one OpenMP thread per logical CPU, and libgomp's threads spin 300,000 rounds
while they wait for work. On a host whose cores are busy with other work, threads that spin against
it make a run many times slower (measured on 2 busy cores: 36 s a step against 1.3-1.5 s on the
quiet host). Passive waiting (OMP_WAIT_POLICY=PASSIVE) is the fastest there (2.3-4.2 s) but costs a
dedicated host 1.3x (1.9-2.0 s); a short spin of 3,000 rounds keeps the dedicated host's speed
(1.4-1.6 s) and is 5-6x faster than the long spin on the busy one (5.7-7.7 s). So `trainer/__init__.py`
sets GOMP_SPINCOUNT=3000 before torch loads its OpenMP runtime, unless the environment sets
OMP_WAIT_POLICY or GOMP_SPINCOUNT (OMP_WAIT_POLICY=PASSIVE for a host shared with busy jobs). The
thread count defaults to one per *physical* core this process may run on, shared among the job's
processes on the host (scripts/bench_threads.py measures both).
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_TOPOLOGY = Path("/sys/devices/system/cpu")


def physical_cores(cpus: set[int] | None = None) -> int:
    """The physical cores among `cpus` (default: this process's CPU affinity): logical CPUs that are
    hyper-threads of one core count once. Without the topology (not Linux), the logical CPUs."""
    if cpus is None:
        cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
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
