#!/usr/bin/env python
"""Benchmark `shardkit plan --suggest` on Llama-2-70B's config edited to more layers.

Why: an absurd layer count (num_hidden_layers 4096, which ModelDims accepts) made --suggest run
for many minutes at gigabytes of memory, as it priced every piece of every layer of every rank
and held every stage of every layout. plan now prices each block once; this times both.

Method: for each layer count (default 80 and 4096) a config.json is written under --workdir
(fixtures/llama-2-70b.json with num_hidden_layers changed). Each run is a fresh child process
that imports shardkit, then times `shardkit -q plan --config C --suggest --device-memory 16GiB`
in-process (CliRunner, output discarded) and reports the seconds, CPU seconds and its peak RSS
(VmHWM, imports included). With --baseline-ref, shardkit as committed at that ref (exported to the
work dir) is timed the same way; a run longer than --timeout is killed and reported as such.

Examples:
    python scripts/bench_plan.py
    python scripts/bench_plan.py --baseline-ref 16b9ccd --layers 80,1024,4096 --timeout 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.dont_write_bytecode = True  # leave no __pycache__ beside the scripts
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

SOURCE = bc.REPO_ROOT / "fixtures" / "llama-2-70b.json"


def child(config: str, device_memory: str) -> None:
    """In the child: time one `plan --suggest` after the imports, print the measurement as JSON."""
    from click.testing import CliRunner

    from shardkit.cli import cli

    start, cpu = time.perf_counter(), time.process_time()
    result = CliRunner().invoke(cli, ["-q", "plan", "--config", config, "--suggest", "--device-memory", device_memory])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    with open("/proc/self/status") as fh:
        hwm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    best = next((line for line in result.output.splitlines() if line.startswith("best:")), "best: none fits --")
    print(
        json.dumps(
            {
                "seconds": seconds,
                "cpu_seconds": cpu,
                "peak_rss": hwm,
                "exit_code": result.exit_code,
                "best": best.removeprefix("best:").split(" -- ")[0].strip(),
            }
        )
    )


def run_once(config: Path, device_memory: str, env: dict[str, str] | None, timeout: float) -> dict[str, Any]:
    """One child run; {"timeout": True, ...} when it outlives `timeout` seconds."""
    cmd = [sys.executable, "-B", str(Path(__file__).resolve()), "--child", str(config), device_memory]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"timeout": True, "seconds": time.perf_counter() - start}
    if proc.returncode != 0:
        raise SystemExit(f"plan --suggest on {config} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return {"timeout": False, **json.loads(proc.stdout.splitlines()[-1])}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--layers", default="80,4096", help="comma-separated layer counts (default 80,4096)")
    p.add_argument("--device-memory", default="16GiB", help="--device-memory of the runs (default 16GiB)")
    p.add_argument("--repeat", type=int, default=3, help="runs per case; the median is reported (default 3)")
    p.add_argument("--baseline-ref", metavar="GIT_REF", help="also time shardkit as committed at this git ref")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds after which a run is killed and reported as not finished (default 300)",
    )
    p.add_argument(
        "--workdir", default=str(bc.DEFAULT_WORKDIR), help=f"configs and snapshots (default {bc.DEFAULT_WORKDIR})"
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    args.layers = bc.parse_int_list(args.layers)
    return args


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    workdir = Path(args.workdir).absolute() / "plan"
    workdir.mkdir(parents=True, exist_ok=True)
    versions: list[tuple[str, dict[str, str] | None]] = [("this tree", bc.child_env(bc.REPO_ROOT))]
    if args.baseline_ref:
        snap, sha = bc.shardkit_snapshot(args.baseline_ref, workdir)
        versions.insert(0, (f"{args.baseline_ref} ({sha[:12]})", bc.child_env(snap)))
    rows = []
    for layers in args.layers:
        config = json.loads(SOURCE.read_text())
        config["num_hidden_layers"] = layers
        path = workdir / f"llama-2-70b-{layers}-layers.json"
        path.write_text(json.dumps(config))
        for name, env in versions:
            runs = []
            for r in range(args.repeat):
                runs.append(run_once(path, args.device_memory, env, args.timeout))
                bc.progress(
                    f"{name}, {layers} layers, run {r + 1}: "
                    + ("killed after the timeout" if runs[-1]["timeout"] else f"{runs[-1]['seconds']:.2f} s")
                )
                if runs[-1]["timeout"]:
                    break  # the next ones would time out too
            done = [x for x in runs if not x["timeout"]]
            rows.append(
                {
                    "shardkit": name,
                    "layers": layers,
                    "timeout": len(done) < len(runs),
                    "seconds": statistics.median(x["seconds"] for x in done) if done else None,
                    "cpu_seconds": statistics.median(x["cpu_seconds"] for x in done) if done else None,
                    "peak_rss": max(x["peak_rss"] for x in done) if done else None,
                    "best": done[0]["best"] if done else "",
                    "runs": runs,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(*argv[1:3])
    args = parse_args(argv)
    start_load = bc.load_average()
    rows = measure(args)
    if args.json:
        bc.print_json({"device_memory": args.device_memory, "timeout": args.timeout, "rows": rows})
        return
    print(
        f"shardkit plan --suggest --device-memory {args.device_memory}, Llama-2-70B config at each layer count "
        f"(median of {args.repeat}; peak RSS includes the imports)"
    )
    table = [
        [
            r["shardkit"],
            r["layers"],
            f"> {args.timeout:.0f} (killed)" if r["timeout"] else bc.fmt(r["seconds"]),
            bc.fmt(r["cpu_seconds"]),
            "-" if r["peak_rss"] is None else f"{r['peak_rss'] / bc.MB:.0f}",
            r["best"],
        ]
        for r in rows
    ]
    print(bc.format_table(["shardkit", "layers", "seconds", "cpu s", "peak RSS MB", "best layout"], table))
    for line in bc.load_lines(start_load, bc.load_average()):
        print(line)


if __name__ == "__main__":
    main()
