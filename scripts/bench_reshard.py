#!/usr/bin/env python
"""Benchmark direct `shardkit reshard` against merge-then-convert, side by side.

Builds (or reuses) the synthetic checkpoint of bench_convert.py (default TinyLlama-1.1B's shape in
bf16), converts it once to the source layout (default tp 8, pp 2; untimed setup), then measures,
each operation in a fresh child process (wall time of the call, the child's own peak RSS):
  - cp -r of the source shards (the baseline for moving these bytes),
  - reshard source -> target (default tp 4, pp 4) directly,
  - merge source -> HF, then convert HF -> target (the two-step way, times added),
for each --workers count, so the speed-up of threads on this machine shows too.
Targets (issue): direct reshard at least 2x faster than merge-then-convert; peak RSS under 25% of
the checkpoint size.

`sync` runs (untimed) before every timed step; with --drop-caches the page cache is also dropped
(`sync; echo 3 > /proc/sys/vm/drop_caches`) before every timed step, the cp baseline included. That
needs root: without it the benchmark says so and exits 2. The default is a warm cache.

Examples:
    python scripts/bench_reshard.py --shape tiny --workers 1     # a quick smoke run (~60 MB)
    python scripts/bench_reshard.py                              # TinyLlama shape, workers 1 and 2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.dont_write_bytecode = True
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
from bench_convert import PRELOAD, smallest_kv_multiplier  # noqa: E402

CP_TARGET = 0.5  # issue 15: reshard at >= 0.5x the throughput of cp -r of the same bytes (warm)
SPEEDUP_TARGET = 2.0
RSS_TARGET = 0.25


def run_reshard(
    src: str,
    dst: str,
    tp: int,
    pp: int,
    qkv: str,
    kv_multiplier: int,
    workers: int,
    direct_io: str | None = None,
    sha256: bool = False,
) -> dict:
    from bench_convert import direct_io_options, sha256_option

    import shardkit

    result = shardkit.reshard(
        src,
        dst,
        shardkit.Layout(tp=tp, pp=pp, kv_multiplier=kv_multiplier, qkv=qkv),
        workers=workers,
        overwrite=True,
        **direct_io_options(direct_io),
        **sha256_option(sha256),
    )
    return {"files": len(result.files), "bytes": result.bytes, "shardkit": str(Path(shardkit.__file__).parent)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="tinyllama", choices=sorted(bc.SHAPES), help="named model shape")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES), help="dtype of the synthetic checkpoint")
    p.add_argument("--source", default="8,2", help="source layout tp,pp (default 8,2)")
    p.add_argument("--target", default="4,4", help="target layout tp,pp (default 4,4)")
    p.add_argument("--qkv", default="gqa", help="qkv style of both layouts")
    p.add_argument("--workers", default="1,2", help="worker counts to run, comma-separated")
    p.add_argument("--repeat", type=int, default=1, help="repeats per worker count (median taken)")
    p.add_argument(
        "--direct-io",
        choices=("auto", "on", "off"),
        help="shardkit's --direct-io for every step (default: shardkit's default)",
    )
    p.add_argument("--workdir", default=str(bc.DEFAULT_WORKDIR), help="cache and scratch folder")
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the page cache before every timed step, cp included (needs root; exits 2 otherwise)",
    )
    bc.add_settle_wait(p)
    p.add_argument(
        "--sha256",
        action="store_true",
        help="reshard and convert record each shard's sha256 as well as xxh3-128 (shardkit's --sha256)",
    )
    p.add_argument(
        "--direct-only",
        action="store_true",
        help="time the direct reshard and cp only, not merge-then-convert (no speed-up column)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p.parse_args(argv)


def parse_layouts(args: argparse.Namespace) -> tuple[tuple[int, int], tuple[int, int]]:
    """(source tp, pp), (target tp, pp) from --source and --target."""
    (stp, spp), (ttp, tpp) = (tuple(int(x) for x in v.split(",")) for v in (args.source, args.target))
    return (stp, spp), (ttp, tpp)


def prepare_source(args, workdir: Path, name: str, config: dict, source: Path, stp: int, spp: int) -> int:
    """Build (or reuse) the HF checkpoint, convert it to the source layout (untimed); returns the HF size."""
    logdir = workdir / "logs"
    hf, _ = bc.synthetic_source(workdir, logdir, name, config, args.dtype)
    bc.remove(source)
    bc.progress(f"setup: converting {hf.name} to tp {stp} pp {spp} (untimed)")
    bc.run_python(
        "setup",
        "bench_convert:run_convert",
        {
            "src": str(hf),
            "dst": str(source),
            "tp": stp,
            "pp": spp,
            "qkv": args.qkv,
            "kv_multiplier": smallest_kv_multiplier(config, stp),
            "fmt": "torch",
            "workers": 2,
        },
        logdir,
        preload=PRELOAD,
    )
    return bc.dir_bytes(hf)


def measured_ops(args, source: Path, rundir: Path, ttp: int, tpp: int, tkv: int, workers: int):
    """(key, child target, kwargs) of the direct reshard and of the two steps of merge-then-convert."""
    target = {
        "tp": ttp,
        "pp": tpp,
        "qkv": args.qkv,
        "kv_multiplier": tkv,
        "workers": workers,
        "direct_io": args.direct_io,
        "sha256": args.sha256,
    }
    return (
        ("direct", "bench_reshard:run_reshard", {"src": str(source), "dst": str(rundir / "direct"), **target}),
        (
            "merge",
            "bench_convert:run_merge",
            {"src": str(source), "dst": str(rundir / "merged"), "workers": workers, "direct_io": args.direct_io},
        ),
        (
            "convert",
            "bench_convert:run_convert",
            {"src": str(rundir / "merged"), "dst": str(rundir / "two-step"), **target, "fmt": "torch"},
        ),
    )


def run_repeat(
    args, source: Path, rundir: Path, logdir: Path, ttp: int, tpp: int, tkv: int, workers: int, samples: dict[str, list]
) -> bool:
    """One repeat: cp baseline, direct reshard, merge, convert; returns whether both ways agree."""
    # every step's output stays until that step runs again (see bench_common.settle), cp's too
    samples["cp"].append(
        bc.cp_baseline("cp -r shards", source, rundir / "cp", logdir, keep=True, drop=args.drop_caches)
    )
    ops = measured_ops(args, source, rundir, ttp, tpp, tkv, workers)
    for key, target, kwargs in ops[:1] if args.direct_only else ops:
        m = bc.run_python(
            f"{key} w{workers}",
            target,
            kwargs,
            logdir,
            preload=PRELOAD,
            before=lambda dst=kwargs["dst"]: bc.settle(args.drop_caches, dst),
        )
        samples[key].append(m)
        bc.progress(f"workers {workers}: {key} {m.seconds:.2f} s, peak RSS {m.peak_rss / bc.MB:.0f} MB")
    return (
        args.direct_only
        or bc.run_python(
            "compare",
            "bench_reshard:same_shards",
            {"a": str(rundir / "direct"), "b": str(rundir / "two-step")},
            logdir,
            preload=PRELOAD,
        ).result
    )


OUTPUTS = ("cp", "direct", "merged", "two-step")
"""The folders under the run folder that the timed steps write."""


def summarize(workers: int, c: dict[str, bc.Measurement], ok: bool, size: int) -> tuple[tuple, dict]:
    """The table row and the JSON record of one worker count (no two-step figures with --direct-only)."""
    two_step = c["merge"].seconds + c["convert"].seconds if "merge" in c else float("nan")
    speedup = two_step / c["direct"].seconds
    rss = max(c["direct"].peak_rss, 1) / size
    vs_cp = c["cp"].seconds / c["direct"].seconds  # the same bytes in and out: a ratio of throughputs
    row = (
        workers,
        f"{c['cp'].seconds:.2f}",
        f"{c['direct'].seconds:.2f}",
        f"{vs_cp:.2f}x",
        f"{two_step:.2f}",
        f"{speedup:.2f}x",
        f"{c['direct'].peak_rss / bc.MB:.0f}",
        f"{100 * rss:.1f}%",
        f"{max(c['merge'].peak_rss, c['convert'].peak_rss) / bc.MB:.0f}" if "merge" in c else "-",
        ("not compared" if "merge" not in c else "equal") if ok else "DIFFER",
    )
    record = {
        "workers": workers,
        "cp_s": c["cp"].seconds,
        "direct_s": c["direct"].seconds,
        "merge_s": c["merge"].seconds if "merge" in c else None,
        "convert_s": c["convert"].seconds if "convert" in c else None,
        "speedup": speedup,
        "vs_cp": vs_cp,
        "direct_peak_rss": c["direct"].peak_rss,
        "same_result": ok,
        "direct_cpu_by_thread": c["direct"].cpu_by_thread,
    }
    return row, record


def print_report(args, name: str, size: int, layouts, rows: list, report: dict) -> None:
    (stp, spp), (ttp, tpp) = layouts
    print(f"\n{name} ({size / bc.GB:.2f} GB {args.dtype}): tp {stp} pp {spp} -> tp {ttp} pp {tpp}, qkv {args.qkv}")
    print(bc.busy_note(bc.load_average()))
    print(
        bc.format_table(
            (
                "workers",
                "cp -r s",
                "reshard s",
                "vs cp",
                "merge+convert s",
                "speed-up",
                "reshard RSS MB",
                "RSS % ckpt",
                "2-step RSS MB",
                "result",
            ),
            rows,
        )
    )
    for r in report["runs"]:
        print(
            f"  workers {r['workers']}: reshard CPU by thread (median run): "
            f"{bc.thread_cpu_line(r['direct_cpu_by_thread']) or 'not measured'}"
        )
        print(
            f"  workers {r['workers']}: speed-up >= {SPEEDUP_TARGET}x  {'PASS' if r['speedup'] >= SPEEDUP_TARGET else 'FAIL' if r['merge_s'] else '-'};"
            f"  throughput >= {CP_TARGET}x cp  {'PASS' if r['vs_cp'] >= CP_TARGET else 'FAIL'};"
            f"  RSS < 25%  {'PASS' if r['direct_peak_rss'] / size < RSS_TARGET else 'FAIL'}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.drop_caches:
        bc.require_drop_caches()
    bc.use_settle_wait(args)
    name, config = bc.load_shape(args.shape)
    (stp, spp), (ttp, tpp) = layouts = parse_layouts(args)
    workdir = Path(args.workdir).absolute()
    logdir, rundir = workdir / "logs", workdir / "run-reshard"
    source = rundir / f"source-tp{stp}pp{spp}"
    size = prepare_source(args, workdir, name, config, source, stp, spp)
    tkv = smallest_kv_multiplier(config, ttp)
    rows, report = [], {"checkpoint_bytes": size, "runs": []}
    for workers in bc.parse_int_list(args.workers):
        samples: dict[str, list] = (
            {"cp": [], "direct": []} if args.direct_only else {"cp": [], "direct": [], "merge": [], "convert": []}
        )
        try:
            oks = [
                run_repeat(args, source, rundir, logdir, ttp, tpp, tkv, workers, samples) for _ in range(args.repeat)
            ]
        finally:
            for d in OUTPUTS:
                bc.remove(rundir / d)
        row, record = summarize(workers, {k: bc.combine(v) for k, v in samples.items()}, oks[-1], size)
        rows.append(row)
        report["runs"].append(record)
    if args.json:
        bc.print_json(report)
    else:
        print_report(args, name, size, layouts, rows, report)
    return 0


def same_shards(a: str, b: str) -> bool:
    """Do two shard directories hold the same tensors under the same names?"""
    import torch

    names = sorted(p.name for p in Path(a, "model").glob("*.pt"))
    if names != sorted(p.name for p in Path(b, "model").glob("*.pt")):
        return False
    for n in names:
        x, y = torch.load(Path(a, "model", n), weights_only=True), torch.load(Path(b, "model", n), weights_only=True)
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
