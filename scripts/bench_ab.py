"""Compare two versions of shardkit in the same minutes: convert, merge and reshard (and `cp -r` of
the source) alternate between the versions, round after round, each step in a fresh child prepared
exactly as `bench_convert.py` prepares its steps. On a VM whose copy into the page cache costs
2-5x more from one minute to the next, a before/after pair measured an hour apart says little;
alternating pairs do.

    python scripts/bench_ab.py --refs 2cb9501,WORK --rounds 6                 # warm
    python scripts/bench_ab.py --refs 2cb9501,WORK --rounds 3 --ops merge --drop-caches
    python scripts/bench_ab.py --refs a13f4ca,WORK --rounds 5 --ops reshard,merge      # tp 8 pp 2 -> tp 4 pp 4

WORK is the working tree; anything else is a git ref (exported once under the work dir).
Prints every sample (seconds, CPU seconds, CPU by thread), then each version's median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import bench_common as bc  # noqa: E402
from bench_convert import smallest_kv_multiplier  # noqa: E402

PRELOAD = ("torch", "shardkit.api")  # shardkit itself imports its names lazily
OPS = ("convert", "merge", "reshard", "cp")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--refs", default="HEAD,WORK", help="two (or more) versions, comma-separated: git refs or WORK")
    p.add_argument("--rounds", type=int, default=4, help="rounds; each runs every op of every version once")
    p.add_argument(
        "--ops",
        default="convert,merge,cp",
        help="steps per version and round: convert, merge, reshard (the shards to tp/2, pp*2), cp",
    )
    p.add_argument("--shape", choices=sorted(bc.SHAPES), default=None, help="named model shape (default tinyllama)")
    p.add_argument("--config", default=None, help="a Llama-style config.json instead of --shape")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--workers", type=workers_arg, default=1, help="a worker count, or auto (shardkit's default)")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before every step (needs root)")
    p.add_argument("--workdir", default="/tmp/shardkit-bench", help="where the synthetic checkpoint is cached")
    return p.parse_args(argv)


def workers_arg(value: str) -> int | str:
    """--workers: a positive integer, or auto."""
    if value == "auto":
        return value
    count = int(value)
    if count < 1:
        raise argparse.ArgumentTypeError("workers must be a positive integer or auto")
    return count


def main(argv=None) -> int:
    args = parse_args(argv)
    unknown = sorted(set(args.ops.split(",")) - set(OPS))
    if unknown:
        print(f"bench_ab: unknown --ops {','.join(unknown)}: use {', '.join(OPS)}", file=sys.stderr)
        return 2
    if args.drop_caches:
        bc.require_drop_caches()
    workdir = Path(args.workdir)
    run_dir, logdir = workdir / "run-ab", workdir / "logs"
    name, config = bc.load_shape(args.shape, args.config)
    src, _ = bc.synthetic_source(workdir, logdir, name, config)
    envs: dict[str, dict[str, str] | None] = {}
    for ref in args.refs.split(","):
        envs[ref] = bc.child_env(SCRIPTS.parent if ref == "WORK" else bc.shardkit_snapshot(ref, workdir)[0])
    ops = args.ops.split(",")
    kwargs = {
        "src": str(src),
        "tp": args.tp,
        "pp": args.pp,
        "qkv": "gqa",
        "fmt": "torch",
        "workers": args.workers,
        "kv_multiplier": smallest_kv_multiplier(config, args.tp),
    }
    shards = run_dir / "shards"
    if "merge" in ops or "reshard" in ops:  # their input, written once by the first version
        bc.remove(shards)
        bc.run_python(
            "convert",
            "bench_convert:run_convert",
            dict(kwargs, dst=str(shards)),
            logdir,
            preload=PRELOAD,
            env=envs[next(iter(envs))],
            sys_path=[SCRIPTS],
        )
    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for ref, env in envs.items():
            for op in ops:
                dst = run_dir / op
                if op == "cp":
                    m = bc.cp_baseline("cp -r source", src, dst, logdir, keep=True, drop=args.drop_caches)
                elif op == "convert":
                    m = bc.run_python(
                        op,
                        "bench_convert:run_convert",
                        dict(kwargs, dst=str(dst)),
                        logdir,
                        preload=PRELOAD,
                        env=env,
                        sys_path=[SCRIPTS],
                        before=lambda d=dst: bc.settle(args.drop_caches, d),
                    )
                elif op == "reshard":
                    target = {
                        "tp": max(1, args.tp // 2),
                        "pp": args.pp * 2,
                        "qkv": "gqa",
                        "workers": args.workers,
                        "kv_multiplier": smallest_kv_multiplier(config, max(1, args.tp // 2)),
                    }
                    m = bc.run_python(
                        op,
                        "bench_reshard:run_reshard",
                        dict(target, src=str(shards), dst=str(dst)),
                        logdir,
                        preload=PRELOAD,
                        env=env,
                        sys_path=[SCRIPTS],
                        before=lambda d=dst: bc.settle(args.drop_caches, d),
                    )
                else:
                    m = bc.run_python(
                        op,
                        "bench_convert:run_merge",
                        {"src": str(shards), "dst": str(dst), "workers": args.workers},
                        logdir,
                        preload=PRELOAD,
                        env=env,
                        sys_path=[SCRIPTS],
                        before=lambda d=dst: bc.settle(args.drop_caches, d),
                    )
                samples.setdefault((ref, op), []).append(m.seconds)
                cpu = f"  CPU {m.cpu_seconds:.2f} s  {bc.thread_cpu_line(m)}" if m.cpu_seconds is not None else ""
                print(f"round {r + 1}  {ref:10s} {op:8s} {m.seconds:6.2f} s{cpu}", flush=True)
    print()
    for (ref, op), values in samples.items():
        print(f"{ref:10s} {op:8s} median {statistics.median(values):6.2f} s  ({' '.join(f'{v:.2f}' for v in values)})")
    bc.remove(run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
