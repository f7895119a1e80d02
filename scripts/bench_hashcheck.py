#!/usr/bin/env python
"""Benchmark the cost of checking source files against their manifest (hash verification on read)
on merge and reshard of shardkit shards: the default check (`--verify-hashes`, the manifest's
xxh3-128) and `--verify-sha256`, each against no check (`--no-verify-hashes`).

Target (issue "close the CPU gap to an in-kernel copy"): the default check adds at most 10%.

Method (the measuring machinery is bench_common's): the synthetic checkpoint of bench_convert.py
(default TinyLlama-1.1B's shape in bf16) is converted once to tp 8, pp 2 (untimed). Then, for each
repeat, merge and reshard (to tp 4, pp 4) run with each check and without, alternating, each in a
fresh child timed inside the child (after imports); `sync` (untimed) before every step, and with
--drop-caches the page cache is dropped too (needs root; exits 2 otherwise). Reported: the
median seconds and CPU seconds of each, and the check's cost as a share of the time without it.

Examples:
    python scripts/bench_hashcheck.py --repeat 3
    python scripts/bench_hashcheck.py --repeat 3 --drop-caches --workers 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
from bench_convert import PRELOAD, smallest_kv_multiplier  # noqa: E402

TARGET = 0.10


MODES = ("fast", "sha256", "none")


def run_op(op: str, src: str, dst: str, verify: str, workers: str) -> dict:
    import shardkit

    count = workers if workers == "auto" else int(workers)
    if op == "merge":
        result = shardkit.merge(src, dst, workers=count, overwrite=True, verify_hashes=verify)
    else:  # to tp 4, pp 4; the kv multiplier that layout needs comes from the parent (BENCH_KV)
        layout = shardkit.Layout(tp=4, pp=4, qkv="gqa", kv_multiplier=int(os.environ.get("BENCH_KV", "1")))
        result = shardkit.reshard(src, dst, layout, workers=count, overwrite=True, verify_hashes=verify)
    return {"bytes": result.bytes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tinyllama", choices=sorted(bc.SHAPES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--workers", default="1", help="an integer or auto")
    p.add_argument("--ops", default="merge,reshard")
    p.add_argument("--workdir", default=str(bc.DEFAULT_WORKDIR))
    p.add_argument("--drop-caches", action="store_true")
    bc.add_settle_wait(p)
    args = p.parse_args(argv)
    if args.drop_caches:
        bc.require_drop_caches()
    bc.use_settle_wait(args)
    name, config = bc.load_shape(args.shape)
    workdir = Path(args.workdir).absolute()
    logdir = workdir / "logs"
    hf, _ = bc.synthetic_source(workdir, logdir, name, config, "bfloat16")
    shards = workdir / "run" / "hashcheck-src"
    if not _has_both_digests(shards):  # absent, or written by a shardkit without xxh3-128 or without --sha256
        bc.remove(shards)
        bc.progress("setup: converting to tp 8 pp 2 (untimed)")
        bc.run_python(
            "setup",
            "bench_convert:run_convert",
            {
                "src": str(hf),
                "dst": str(shards),
                "tp": 8,
                "pp": 2,
                "qkv": "gqa",
                "kv_multiplier": smallest_kv_multiplier(config, 8),
                "fmt": "torch",
                "workers": 2,
                "sha256": True,
            },
            logdir,
            preload=PRELOAD,
        )
    env = dict(os.environ, BENCH_KV=str(smallest_kv_multiplier(config, 4)))
    dst = workdir / "run" / "hashcheck-out"
    start = os.getloadavg()
    seen: dict[tuple[str, str], list[bc.Measurement]] = {}
    for i in range(args.repeat):
        for op in args.ops.split(","):
            for verify in MODES:
                m = bc.run_python(
                    f"{op} verify={verify}",
                    "bench_hashcheck:run_op",
                    {"op": op, "src": str(shards), "dst": str(dst), "verify": verify, "workers": args.workers},
                    logdir,
                    preload=PRELOAD,
                    env=env,
                    before=lambda: bc.settle(args.drop_caches, dst),
                )
                seen.setdefault((op, verify), []).append(m)
                bc.progress(
                    f"[{i + 1}/{args.repeat}] {op} verify={verify}: {m.seconds:.2f} s, CPU {m.cpu_seconds:.2f} s"
                )
    bc.remove(dst)
    end = os.getloadavg()
    print(
        f"hash verification on read: {name}, tp 8 pp 2 torch shards, workers {args.workers}, "
        f"{'cold (drop_caches before every step)' if args.drop_caches else 'warm page cache'}, median of {args.repeat}"
    )
    for line in bc.load_lines(start, end):
        print(line)
    rows = []
    for op in args.ops.split(","):
        t_off = statistics.median(m.seconds for m in seen[(op, "none")])
        c_off = statistics.median(m.cpu_seconds for m in seen[(op, "none")])
        for mode in ("fast", "sha256"):
            t_on = statistics.median(m.seconds for m in seen[(op, mode)])
            c_on = statistics.median(m.cpu_seconds for m in seen[(op, mode)])
            cost = t_on / t_off - 1
            target = ("PASS" if cost <= TARGET else "FAIL") if mode == "fast" else "-"
            rows.append(
                [op, mode, f"{t_off:.2f}", f"{t_on:.2f}", f"{100 * cost:+.0f}%", f"{c_off:.2f}", f"{c_on:.2f}", target]
            )
    print(
        bc.format_table(
            [
                "operation",
                "check",
                "s (no check)",
                "s (check)",
                "cost",
                "CPU s (no check)",
                "CPU s (check)",
                f"<= {TARGET:.0%}",
            ],
            rows,
        )
    )
    return 0


def _has_both_digests(shards: Path) -> bool:
    import json

    try:
        files = json.loads((shards / "shardkit.json").read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return bool(files) and all("xxh3_128" in entry and "sha256" in entry for entry in files)


if __name__ == "__main__":
    sys.exit(main())
