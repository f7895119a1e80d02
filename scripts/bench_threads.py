#!/usr/bin/env python
"""Benchmark the trainer's CPU-thread default (`--threads 0`) on a quiet and on a busy host.

One process (`python -m trainer`, no torchrun) trains the same model and data with:

* `--threads 1`: one thread;
* the trainer's default (`--threads 0`: one thread per physical core of the process's CPU
  affinity; OpenMP threads wait passively when the host is busy at start, else spin as by default);
* the same, always passive (OMP_WAIT_POLICY=PASSIVE);
* torch's own default, the baseline: one thread per logical CPU with OpenMP's default waiting
  (threads spin for a while before they sleep), what `--threads 0` meant before.

each on a quiet host and then beside one busy-looping process per core (started before each run,
half a second before it, and stopped after it, so only the run sees them). Reported: the median step time over the steps
after `--skip`, each row's ratio to the baseline on the same host state, and the thread count the
trainer announced. The runs alternate within a round, best of `--repeats` rounds.

    python scripts/bench_threads.py                        # tinyllama-mini, 12 steps, quiet + busy
    python scripts/bench_threads.py --models llama-trainer-tiny --steps 20
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENVIRONMENT = dict(os.environ)  # as given: importing the trainer (build_data does) sets OMP_WAIT_POLICY on a busy host
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench_train import build_data, build_model  # noqa: E402

# name -> (--threads, environment changes); None removes a variable
RUNS: dict[str, tuple[int, dict[str, str | None]]] = {
    "threads 1": (1, {"OMP_NUM_THREADS": None}),
    "trainer default (--threads 0)": (0, {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}),
    "--threads 0, always passive": (0, {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": "PASSIVE"}),
    # the baseline: torch's default thread count, and OpenMP's default waiting: libgomp spins 300,000
    # rounds before it sleeps when OMP_WAIT_POLICY is unset, and GOMP_SPINCOUNT wins over the policy
    "torch default (baseline)": (os.cpu_count() or 1, {"OMP_NUM_THREADS": None, "GOMP_SPINCOUNT": "300000"}),
}
BASELINE = "torch default (baseline)"


def _spin(deadline: float) -> None:
    while time.monotonic() < deadline:
        pass


class Busy:
    """One busy-looping process per logical CPU while the block runs (and at most `limit_s`)."""

    def __init__(self, on: bool, limit_s: float = 900.0):
        self.on, self.limit_s = on, limit_s
        self.procs: list[multiprocessing.Process] = []

    def __enter__(self) -> Busy:
        if self.on:
            deadline = time.monotonic() + self.limit_s
            self.procs = [multiprocessing.Process(target=_spin, args=(deadline,)) for _ in range(os.cpu_count() or 1)]
            for p in self.procs:
                p.start()
            time.sleep(0.5)  # running before the trainer looks at the host
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.terminate()
            p.join()


def run(args, model: Path, data: Path, work: Path, name: str) -> tuple[float, str]:
    """One single-process run: (median step time after --skip, the threads and waiting it announced)."""
    threads, changes = RUNS[name]
    env = dict(ENVIRONMENT)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    metrics = work / "run.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        "--model",
        str(model),
        "--data",
        str(data),
        "--device",
        "cpu",
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        "1",
        "--global-batch",
        str(args.global_batch),
        "--steps",
        str(args.steps),
        "--dtype",
        "fp32",
        "--threads",
        str(threads),
        "--no-progress",
        "--metrics",
        str(metrics),
    ]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"bench_threads: a run failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")
    announced = re.search(r"(\d+) CPU threads? waiting ([^;]*)\);", done.stderr)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    times = [r["step_time"] for r in records if r.get("event") == "step"][args.skip :]
    how = announced.group(2) if announced else "?"
    return statistics.median(times), f"{announced.group(1) if announced else threads} ({how})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tinyllama-mini"], help="fixture configs to train")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="steps not timed (warm-up)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-busy", dest="busy", action="store_false", help="the quiet host only")
    args = parser.parse_args(argv)

    lines = [
        "| model | host | run | threads (waiting) | median step | speed vs baseline |",
        "|---|---|---|---|---:|---:|",
    ]
    with tempfile.TemporaryDirectory(prefix="bench-threads-") as tmp:
        work = Path(tmp)
        for config in args.models:
            model = build_model(config, work / config)
            data = build_data(work / f"{config}.bin", json.loads((model / "config.json").read_text())["vocab_size"])
            for busy in (False, True) if args.busy else (False,):
                best: dict[str, tuple[float, str]] = {}
                for _ in range(args.repeats):
                    for name in RUNS:
                        with Busy(busy):
                            t, threads = run(args, model, data, work, name)
                        if name not in best or t < best[name][0]:
                            best[name] = (t, threads)
                base = best[BASELINE][0]
                for name, (t, threads) in best.items():
                    lines.append(
                        f"| {config} | {'busy' if busy else 'quiet'} | {name} | {threads} | "
                        f"{t * 1000:.0f} ms | {base / t:.2f}x |"
                    )
                print(lines[-3:], flush=True)
    print(f"load average before: {os.getloadavg()}, {os.cpu_count()} logical CPUs")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
