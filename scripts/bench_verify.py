#!/usr/bin/env python
"""Benchmark shardkit verify (HF vs its shards) against convert of the same model.

Target (issue "verify streams"): verify of a model takes at most 2x the time of its convert and
stays under 1 GB of peak RSS.

Method (the measuring machinery is bench_common's):
* A synthetic Hugging Face checkpoint of a named shape (default "tiny", ~60 MB in bf16) is built
  once and cached under --workdir.
* Each repeat runs, each in a fresh child process timed inside the child (after imports) with
  its own peak RSS (VmHWM): convert of the source to tp/pp shards, then `verify` of the source
  against those shards (bit-exact), then `verify --atol` (the float32 path), and with
  --baseline-ref the exact verify of shardkit at that git ref (not held to the targets).
* `sync` runs (untimed) before every step; the page cache stays warm (convert reads the source
  that the previous step read; verify reads the source and the shards convert just wrote).

Examples:
    python scripts/bench_verify.py                       # tiny shape, tp 8 pp 2
    python scripts/bench_verify.py --shape tinyllama --repeat 3 --json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.dont_write_bytecode = True  # leave no __pycache__ beside the scripts
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
import bench_convert  # noqa: E402  (its run_convert and smallest_kv_multiplier; it imports no torch)

TIME_TARGET = 2.0  # verify seconds / convert seconds
RSS_TARGET = 10**9  # bytes of peak RSS
PRELOAD = ("torch", "shardkit.api")  # shardkit itself imports its names lazily


def run_verify(a: str, b: str, atol: float) -> dict:
    """What the child runs: shardkit.verify(a, b), with a progress callback like the CLI's."""
    import inspect

    import shardkit

    seen = {"calls": 0, "done": 0, "total": 0}

    def progress(done: int, total: int) -> None:
        seen.update(calls=seen["calls"] + 1, done=done, total=total)

    options = {"progress": progress} if "progress" in inspect.signature(shardkit.verify).parameters else {}
    report = shardkit.verify(a, b, atol=atol, **options)  # a --baseline-ref may predate progress
    worst = max((t.max_abs_diff or 0.0) for t in report.tensors)
    return {
        "ok": report.ok,
        "tensors": len(report.tensors),
        "mismatches": len(report.mismatches),
        "worst": worst,
        "progress": seen,
        "shardkit": shardkit.__file__,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="tiny", choices=sorted(bc.SHAPES), help="named model shape (default tiny)")
    p.add_argument("--config", help="a Llama-style config.json to use instead of --shape")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES), help="dtype of the synthetic checkpoint")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--qkv", default="gqa")
    p.add_argument("--format", default="torch", choices=("torch", "xser", "safetensors"), help="shard format")
    p.add_argument("--atol", type=float, default=1e-6, help="tolerance of the float32 run (0: skip that run)")
    p.add_argument(
        "--baseline-ref",
        metavar="GIT_REF",
        help="also time the exact verify of shardkit as committed at this git ref (e.g. the commit before "
        "streaming verify), exported to the work dir",
    )
    p.add_argument("--repeat", type=int, default=1, help="repeats (median seconds, largest peak RSS)")
    p.add_argument(
        "--workdir", default=str(bc.DEFAULT_WORKDIR), help=f"cache and outputs (default {bc.DEFAULT_WORKDIR})"
    )
    p.add_argument("--keep", action="store_true", help="keep the shards")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    return args


def measure(args: argparse.Namespace) -> dict[str, Any]:
    name, config = bc.load_shape(args.shape, args.config)
    workdir = Path(args.workdir).absolute()
    logdir, shards = workdir / "logs", workdir / "run" / "verify-shards"
    bc.progress(f"synthetic checkpoint {name} ({args.dtype}) under {workdir}")
    src, built = bc.synthetic_source(workdir, logdir, name, config, args.dtype, args.seed)
    src_bytes = bc.dir_bytes(src)
    kv = bench_convert.smallest_kv_multiplier(config, args.tp)
    convert_kwargs = {
        "src": str(src),
        "dst": str(shards),
        "tp": args.tp,
        "pp": args.pp,
        "qkv": args.qkv,
        "kv_multiplier": kv,
        "fmt": args.format,
        "workers": 1,
    }
    samples: dict[str, list[bc.Measurement]] = {"convert": [], "verify": [], "verify_atol": [], "verify_baseline": []}
    baseline_env = None
    if args.baseline_ref:
        snap, sha = bc.shardkit_snapshot(args.baseline_ref, workdir)
        baseline_env = bc.child_env(snap)
        bc.progress(f"baseline: shardkit at {args.baseline_ref} = {sha[:12]} ({snap})")
    try:
        for r in range(args.repeat):
            tag = f"repeat {r + 1}/{args.repeat}"
            bc.remove(shards)
            bc.sync_disks()
            m = bc.run_python("convert", "bench_convert:run_convert", convert_kwargs, logdir, preload=PRELOAD)
            samples["convert"].append(m)
            bc.progress(f"[{tag}] convert: {m.seconds:.2f} s, peak RSS {m.peak_rss / bc.MB:.0f} MB")
            runs = [("verify", 0.0, None)] + ([("verify_atol", args.atol, None)] if args.atol > 0 else [])
            runs += [("verify_baseline", 0.0, baseline_env)] if baseline_env else []
            for key, atol, env in runs:
                bc.sync_disks()
                m = bc.run_python(
                    key,
                    "bench_verify:run_verify",
                    {"a": str(src), "b": str(shards), "atol": atol},
                    logdir,
                    preload=PRELOAD,
                    env=env,
                )
                if not m.result["ok"]:
                    raise SystemExit(f"{key}: the source and its shards differ ({m.result['mismatches']} tensors)")
                samples[key].append(m)
                bc.progress(f"[{tag}] {key}: {m.seconds:.2f} s, peak RSS {m.peak_rss / bc.MB:.0f} MB")
    finally:
        if not args.keep:
            bc.remove(shards)
    ops = {k: bc.combine(v) for k, v in samples.items() if v}
    conv = ops["convert"]
    targets = []
    for key, m in ops.items():
        m.extra["time_vs_convert"] = m.seconds / conv.seconds if conv.seconds else None
        if key in ("verify", "verify_atol"):
            targets.append(
                {
                    "op": key,
                    "time_vs_convert": m.extra["time_vs_convert"],
                    "time_ok": m.extra["time_vs_convert"] <= TIME_TARGET,
                    "peak_rss": m.peak_rss,
                    "rss_ok": m.peak_rss < RSS_TARGET,
                }
            )
    return {
        "shape": name,
        "dtype": args.dtype,
        "source": str(src),
        "source_bytes": src_bytes,
        "layout": {"tp": args.tp, "pp": args.pp, "qkv": args.qkv, "kv_multiplier": kv, "format": args.format},
        "built": built.to_dict(),
        "ops": {k: m.to_dict() for k, m in ops.items()},
        "targets": targets,
    }


def print_report(res: dict[str, Any]) -> None:
    lay = res["layout"]
    print(
        f"shardkit verify vs convert: {res['shape']} ({res['dtype']}, {res['source_bytes'] / bc.MB:.0f} MB), "
        f"tp {lay['tp']} pp {lay['pp']} qkv {lay['qkv']} kv x{lay['kv_multiplier']}, {lay['format']} shards"
    )
    rows = []
    for key, m in res["ops"].items():
        ratio = m["extra"].get("time_vs_convert")
        rows.append(
            [
                key,
                bc.fmt(m["seconds"]),
                bc.fmt(ratio, 2, "x"),
                f"{m['peak_rss'] / bc.MB:.0f}",
                f"{(m['base_rss'] or 0) / bc.MB:.0f}",
                bc.fmt(m["cpu_seconds"]),
            ]
        )
    print(bc.format_table(["op", "seconds", "vs convert", "peak MB", "base MB", "cpu s"], rows))
    for t in res["targets"]:
        print(
            f"{t['op']}: time {t['time_vs_convert']:.2f}x convert (target <= {TIME_TARGET}x: "
            f"{'ok' if t['time_ok'] else 'MISSED'}), peak RSS {t['peak_rss'] / bc.MB:.0f} MB "
            f"(target < {RSS_TARGET / bc.MB:.0f} MB: {'ok' if t['rss_ok'] else 'MISSED'})"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    res = measure(args)
    if args.json:
        bc.print_json(res)
    else:
        print_report(res)
    return 0 if all(t["time_ok"] and t["rss_ok"] for t in res["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
