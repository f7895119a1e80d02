#!/usr/bin/env python
"""Benchmark shardkit training checkpoints: save and load throughput per format, and the time a
training loop is blocked by an async save vs a synchronous one.

Acceptance target: an async save blocks the training loop for at most 15% of the time a
synchronous save of the same state takes.

Method (bench_common.py provides the synthetic model and the measured child processes):
* The synthetic Hugging Face checkpoint of bench_convert.py (default TinyLlama-1.1B shape, bf16,
  2.2 GB, seeded values) is built once and cached under --workdir.
* One fresh child process per format. It reads the model's rank pieces for the layout (default
  tp 1, pp 1: one process holding the whole model under NxD's names) into memory, then runs a
  simulated training loop: steps of fixed-size matmuls that also update a state tensor. The loop
  saves --sync-saves checkpoints synchronously, then --async-saves asynchronously, each after
  --interval seconds of training (default: 2 x the synchronous save time, so that a background
  write finishes before the next save). Every save goes through `Checkpointer.save` with fsync
  and retention (num_kept 1).
* blocked = wall time inside `save()` as the loop sees it. For a sync save that is the whole save
  (write + fsync + markers); for an async save, the copy of the state to host memory (the first
  async save also allocates the host buffers; later ones reuse them: "steady"). "write" = from
  `save()` returning until the background write is durable (`done` written), sampled at step
  granularity. Save throughput = checkpoint bytes on disk / sync save seconds.
* Load = `load_checkpoint` of the newest tag for every rank of the layout, with verify (sha256 of
  every file read, against the manifest) and without, and into a different layout (--reshard-tp)
  without verify. Load throughput = tensor bytes returned / seconds. The page cache is whatever
  the save left (warm) unless --drop-caches works (needs a writable /proc/sys/vm/drop_caches).
* Step times are reported while no write is in flight and while a background write runs (two
  CPUs shared between training and the writer's hashing and copying).

Examples:
    python scripts/bench_checkpoint.py --shape tiny            # a quick smoke run (~60 MB)
    python scripts/bench_checkpoint.py                         # TinyLlama shape, all three formats
    python scripts/bench_checkpoint.py --formats torch --async-saves 4 --json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

BLOCKED_TARGET = 0.15
PRELOAD = ("torch", "shardkit.api", "shardkit.checkpoint")  # shardkit itself imports its names lazily
DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "shardkit-bench-checkpoint"


# ---- what the child runs (imported lazily: the parent never imports torch) -----------------------


def _rank_pieces(src: str, layout) -> tuple[dict, dict]:
    """Every rank's pieces of `layout`, read from the HF checkpoint (a direct conversion in memory)."""
    from shardkit.formats import SourceReader, open_checkpoint

    ckpt = open_checkpoint(src)
    reader = SourceReader(ckpt)
    pieces = {}
    try:
        for ep, tp, pp in layout.ranks():
            ranked = ckpt.family.rank_pieces(layout, ckpt.dims, tp, pp, ckpt.full_shapes, ep)
            pieces[(tp, pp)] = {p.name: reader.read_piece(p).clone() for p in ranked}
    finally:
        reader.close()
    return pieces, ckpt.config


def run_format(
    src: str,
    workdir: str,
    fmt: str,
    tp: int,
    pp: int,
    qkv: str,
    kv_multiplier: int,
    sync_saves: int,
    async_saves: int,
    interval: float | None,
    step_ms: float,
    reshard_tp: int,
    drop_caches: bool,
    optimizer: str = "none",
) -> dict[str, Any]:
    """The whole scenario for one format (see the module docstring); returns the timings."""
    import torch

    from shardkit import Layout, list_checkpoints, load_checkpoint
    from shardkit.checkpoint import Checkpointer, CheckpointerConfig

    layout = Layout(tp=tp, pp=pp, qkv=qkv, kv_multiplier=kv_multiplier)
    t0 = time.perf_counter()
    model, config = _rank_pieces(src, layout)
    prepare_seconds = time.perf_counter() - t0
    optim = None
    if optimizer != "none":  # Adam moments shaped like their parameters (values do not matter here)
        dtype = getattr(torch, optimizer)
        optim = {
            rank: {n: {"exp_avg": t.to(dtype), "exp_avg_sq": t.to(dtype).abs(), "step": 1} for n, t in part.items()}
            for rank, part in model.items()
        }
    state_bytes = sum(t.numel() * t.element_size() for part in model.values() for t in part.values())
    if optim:
        state_bytes += sum(
            m.numel() * m.element_size()
            for part in optim.values()
            for entry in part.values()
            for m in entry.values()
            if isinstance(m, torch.Tensor)
        )
    root = Path(workdir) / f"ckpt-{fmt}"
    if root.exists():
        import shutil

        shutil.rmtree(root)

    # the training step: matmuls of a fixed size, plus an update of a small state tensor
    a = torch.randn(768, 768)
    b = torch.randn(768, 768)
    first = next(iter(model.values()))
    touched = first[[n for n in first if n.endswith("norm.weight")][0]]

    def matmuls(n: int) -> None:
        x = a
        for _ in range(n):
            x = torch.mm(x, b).clamp_(-1, 1)

    timings = []
    for _ in range(10):  # the best of 10: other processes on the machine only ever slow it down
        start = time.perf_counter()
        matmuls(5)
        timings.append((time.perf_counter() - start) / 5)
    reps = max(1, round(step_ms / 1000 / min(timings)))

    def step() -> float:
        s = time.perf_counter()
        matmuls(reps)
        touched.add_(1e-3)
        return time.perf_counter() - s

    ck = Checkpointer(CheckpointerConfig(format=fmt, num_kept=1))
    tag_no = 0

    def training(mode: str, saves: int, gap: float) -> dict[str, Any]:
        nonlocal tag_no
        records: list[dict[str, float]] = []
        steps: list[tuple[float, bool]] = []
        next_save = time.perf_counter() + min(gap, 2.0)
        while len(records) < saves or ck.in_flight:
            busy = ck.in_flight
            steps.append((step(), busy))
            now = time.perf_counter()
            if records and "write" not in records[-1] and not ck.in_flight:
                records[-1]["write"] = now - records[-1]["returned"]
            if len(records) < saves and now >= next_save:
                tag_no += 1
                s = time.perf_counter()
                ck.save(root, f"step_{tag_no}", model, optim, layout=layout, config=config, async_save=mode == "async")
                e = time.perf_counter()
                records.append({"blocked": e - s, "returned": e})
                next_save = e + gap
        ck.wait()
        idle = [d for d, busy in steps if not busy]
        during = [d for d, busy in steps if busy]
        return {
            "blocked": [r["blocked"] for r in records],
            "write": [r.get("write") for r in records],
            "steps": len(steps),
            "step_idle_ms": 1000 * statistics.median(idle) if idle else None,
            "step_during_write_ms": 1000 * statistics.median(during) if during else None,
        }

    sync = training("sync", sync_saves, 1.0)
    sync_seconds = statistics.median(sync["blocked"])
    gap = interval if interval is not None else max(2.0 * sync_seconds, 3.0)
    asyn = training("async", async_saves, gap)
    ck.close()
    info = list_checkpoints(root)[-1]

    # loads
    loads: dict[str, Any] = {}
    cache = "warm (the save's pages)"
    cases = [("same layout, verify", layout, True), ("same layout", layout, False)]
    if reshard_tp and reshard_tp != tp:
        cases.append(
            (f"into tp {reshard_tp} pp {pp}", Layout(tp=reshard_tp, pp=pp, qkv=qkv, kv_multiplier=kv_multiplier), False)
        )
    for label, target, verify in cases:
        if drop_caches and bc.drop_caches()[0]:
            cache = "dropped before each load"
        s = time.perf_counter()
        nbytes = 0
        for ep, t, p in target.ranks():
            loaded = load_checkpoint(root, target_layout=target, rank=(ep, t, p), verify=verify)
            nbytes += sum(x.numel() * x.element_size() for x in loaded.model.values())
            if loaded.optimizer is not None:
                nbytes += sum(
                    m.numel() * m.element_size()
                    for entry in loaded.optimizer.state.values()
                    for m in entry.values()
                    if isinstance(m, torch.Tensor)
                )
            del loaded
        loads[label] = {
            "seconds": time.perf_counter() - s,
            "bytes": nbytes,
            "verify": verify,
            "ranks": target.tp * target.pp * target.ep,
        }
    return {
        "format": fmt,
        "state_bytes": state_bytes,
        "checkpoint_bytes": info.size,
        "files": info.files,
        "prepare_seconds": prepare_seconds,
        "step_reps": reps,
        "interval": gap,
        "sync": sync,
        "async": asyn,
        "loads": loads,
        "cache": cache,
        "torch_threads": torch.get_num_threads(),
    }


# ---- the parent --------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", default="tinyllama", choices=sorted(bc.SHAPES), help="named model shape")
    p.add_argument("--config", help="a Llama-style config.json to use instead of --shape")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--tp", type=int, default=1, help="layout of the saved state (all ranks in one process)")
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--qkv", default="separate")
    p.add_argument("--kv-multiplier", type=int, default=1)
    p.add_argument("--reshard-tp", type=int, default=2, help="also load into this tp (0: skip)")
    p.add_argument("--formats", default="torch,xser,safetensors", help="comma-separated formats to measure")
    p.add_argument(
        "--optimizer",
        default="none",
        choices=("none", "bfloat16", "float32"),
        help="also save Adam moments (exp_avg, exp_avg_sq) in this dtype (default: model state only)",
    )
    p.add_argument("--sync-saves", type=int, default=2)
    p.add_argument("--async-saves", type=int, default=3)
    p.add_argument(
        "--interval",
        type=float,
        default=None,
        help="seconds of training between async saves (default 2 x the sync save time)",
    )
    p.add_argument("--step-ms", type=float, default=100.0, help="duration of one simulated training step")
    p.add_argument("--workdir", default=str(DEFAULT_WORKDIR), help=f"cache and outputs (default {DEFAULT_WORKDIR})")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before each load (needs root)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = p.parse_args(argv)
    args.formats = [f for f in args.formats.split(",") if f]
    bad = [f for f in args.formats if f not in ("torch", "xser", "safetensors")]
    if bad:
        p.error(f"unknown format {bad[0]!r}")
    if args.sync_saves < 1 or args.async_saves < 2:
        p.error("need --sync-saves >= 1 and --async-saves >= 2 (the first async save allocates its buffers)")
    return args


def _disk_note(workdir: Path) -> str:
    """A quick sequential write + fsync of 256 MB: what the disk allows."""
    path = workdir / ".disk-probe"
    block = os.urandom(2**20)
    s = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(256):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - s
    path.unlink()
    return f"{256 * 2**20 / seconds / bc.GB:.2f} GB/s (256 MiB written + fsync in {seconds:.2f} s)"


def build_fixture(args, workdir: Path, name: str, config: dict) -> tuple[Path, str]:
    """The synthetic checkpoint (built in a child) and a note on the disk's write speed."""
    workdir.mkdir(parents=True, exist_ok=True)
    bc.progress(f"synthetic checkpoint {name} ({args.dtype}) under {workdir}")
    src, _ = bc.synthetic_source(workdir, workdir / "logs", name, config, args.dtype, args.seed)
    disk = _disk_note(workdir)
    bc.progress(f"source {src} ({bc.dir_bytes(src) / bc.GB:.2f} GB); disk: {disk}")
    return src, disk


def measure_format(args, src: Path, workdir: Path, fmt: str) -> dict:
    """The whole scenario of one format in a fresh child; its result with the child's peak RSS."""
    bc.progress(f"{fmt}: {args.sync_saves} sync + {args.async_saves} async saves, then loads")
    m = bc.run_python(
        f"checkpoint-{fmt}",
        "bench_checkpoint:run_format",
        {
            "src": str(src),
            "workdir": str(workdir),
            "fmt": fmt,
            "tp": args.tp,
            "pp": args.pp,
            "qkv": args.qkv,
            "kv_multiplier": args.kv_multiplier,
            "sync_saves": args.sync_saves,
            "async_saves": args.async_saves,
            "interval": args.interval,
            "step_ms": args.step_ms,
            "reshard_tp": args.reshard_tp,
            "drop_caches": args.drop_caches,
            "optimizer": args.optimizer,
        },
        workdir / "logs",
        preload=PRELOAD,
    )
    r = m.result
    r["peak_rss"] = m.peak_rss
    sync_s = statistics.median(r["sync"]["blocked"])
    steady = statistics.median(r["async"]["blocked"][1:])
    bc.progress(
        f"{fmt}: sync save {sync_s:.2f} s, async blocked {steady:.3f} s (first {r['async']['blocked'][0]:.3f} s)"
    )
    bc.remove(workdir / f"ckpt-{fmt}")
    return r


def summarize(results: list[dict]) -> tuple[list[list], list[dict]]:
    """Table rows (one per format) and the blocked-time target of each."""
    rows, targets = [], []
    for r in results:
        gb = r["checkpoint_bytes"] / bc.GB
        sync_s = statistics.median(r["sync"]["blocked"])
        first, steady = r["async"]["blocked"][0], statistics.median(r["async"]["blocked"][1:])
        writes = [w for w in r["async"]["write"] if w is not None]
        loads = r["loads"]
        lv, ln = loads["same layout, verify"], loads["same layout"]
        reshard = next((v for k, v in loads.items() if k.startswith("into")), None)
        ratio = steady / sync_s
        rows.append(
            [
                r["format"],
                bc.fmt(gb, 2),
                r["files"],
                bc.fmt(sync_s, 2),
                bc.fmt(gb / sync_s, 2),
                bc.fmt(first, 3),
                bc.fmt(steady, 3),
                bc.fmt(100 * ratio, 1, "%"),
                bc.fmt(statistics.median(writes), 1) if writes else "-",
                bc.fmt(lv["bytes"] / bc.GB / lv["seconds"], 2),
                bc.fmt(ln["bytes"] / bc.GB / ln["seconds"], 2),
                bc.fmt(reshard["bytes"] / bc.GB / reshard["seconds"], 2) if reshard else "-",
                bc.fmt(r["async"]["step_idle_ms"], 0),
                bc.fmt(r["async"]["step_during_write_ms"], 0),
                bc.fmt(r["peak_rss"] / bc.GB, 1),
            ]
        )
        targets.append({"format": r["format"], "blocked_ratio": ratio, "pass": ratio <= BLOCKED_TARGET})
    return rows, targets


def print_report(
    args,
    name: str,
    config: dict,
    disk: str,
    results: list[dict],
    rows: list[list],
    targets: list[dict],
    loads: dict,
    machine: dict,
) -> None:
    n_params = sum(bc.numel(s) for _, s in bc.llama_tensors(config))
    print(f"shardkit checkpoint benchmark ({machine['cpus']} CPUs, python {machine['python']})")
    print(
        f"model:  {name}: {n_params / 1e9:.3f} B params, {args.dtype}, "
        f"{results[0]['state_bytes'] / bc.GB:.2f} GB of state ("
        + ("model only" if args.optimizer == "none" else f"model + Adam moments in {args.optimizer}")
        + "), "
        f"layout tp {args.tp} pp {args.pp} ({args.tp * args.pp} rank files) in one process"
    )
    print(f"disk:   {disk}")
    print(
        f"loop:   {args.step_ms:.0f} ms steps ({results[0]['step_reps']} matmuls of 768x768 when the CPUs are free); "
        f"{args.sync_saves} sync then {args.async_saves} async saves "
        f"(fsync, num_kept 1); async saves every {results[0]['interval']:.0f} s of training"
    )
    print(f"cache:  loads: {results[0]['cache']}")
    for line in bc.load_lines(loads["start"], loads["end"]):
        print(line)
    print()
    print(
        bc.format_table(
            [
                "format",
                "GB",
                "files",
                "sync save s",
                "save GB/s",
                "async blocked s (first)",
                "(steady)",
                "blocked / sync",
                "bg write s",
                "load GB/s (verify)",
                "(no verify)",
                f"(into tp {args.reshard_tp})",
                "step ms",
                "step ms (during write)",
                "peak RSS GB",
            ],
            rows,
        )
    )
    print()
    print(
        f"target: an async save blocks the loop for at most {BLOCKED_TARGET:.0%} of a synchronous save (steady state)"
    )
    for t in targets:
        print(f"  {t['format']:<12} {100 * t['blocked_ratio']:5.1f}%  {'PASS' if t['pass'] else 'FAIL'}")


def main(argv=None) -> int:
    args = parse_args(argv)
    name, config = bc.load_shape(args.shape, args.config)
    workdir = Path(args.workdir).absolute()
    src, disk = build_fixture(args, workdir, name, config)
    load_start = bc.load_average()
    results = [measure_format(args, src, workdir, fmt) for fmt in args.formats]
    loads = {"start": load_start, "end": bc.load_average()}
    rows, targets = summarize(results)
    machine = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}
    if args.json:
        bc.print_json(
            {
                "model": name,
                "config": config,
                "dtype": args.dtype,
                "source": str(src),
                "disk": disk,
                "layout": {"tp": args.tp, "pp": args.pp, "qkv": args.qkv, "kv_multiplier": args.kv_multiplier},
                "env": machine,
                "load_average": loads,
                "results": results,
                "targets": targets,
            }
        )
    else:
        print_report(args, name, config, disk, results, rows, targets, loads, machine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
