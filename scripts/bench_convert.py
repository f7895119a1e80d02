#!/usr/bin/env python
"""Benchmark shardkit convert (HF -> tp/pp shards) and merge (shards -> HF) against `cp -r`.

Acceptance targets: convert and merge each reach >= 0.5x the throughput of `cp -r` of the same
bytes, with a peak RSS below 25% of the checkpoint size.

Method (see bench_common for the measuring machinery):
* A synthetic Hugging Face checkpoint of a named shape (default TinyLlama-1.1B in bf16, 2.2 GB in
  ~1 GB safetensors files) is built once and cached under --workdir.
* For every worker count and repeat, four steps run in order, each in a fresh child process:
  `cp -r` of the source, convert of the source, `cp -r` of the shard directory, merge of the shards.
  Each op is preceded by a cp of its own input, so op and baseline see the same (warm) page cache.
  `sync` runs (untimed) before every step so that no step pays for the previous step's writeback;
  with --drop-caches the page cache is also dropped before every step (`sync; echo 3 >
  /proc/sys/vm/drop_caches`, cp baselines included); that needs root, and without it the
  benchmark says so and exits 2. The default is a warm cache.
* seconds: for convert/merge, the call alone inside the child (after interpreter start and
  imports); for cp, the whole `cp` process. Throughput = bytes written / seconds (cp: the bytes it
  copied). With --repeat N the median seconds is reported (--stat best for the minimum) and the
  largest peak RSS over the repeats.
* peak RSS: the child's own high-water mark (VmHWM for Python children, GNU time %M for cp). For
  convert/merge it includes the interpreter and imported torch/shardkit (column "base MB").
* At the end the merged output is compared with the source (names, dtypes, shapes for all
  tensors; exact bytes for a sample, or all with --verify full) and a few shard slices are
  checked against the source.

Examples:
    python scripts/bench_convert.py --shape tiny
    python scripts/bench_convert.py                      # TinyLlama shape, tp 8 pp 2, workers 1
    python scripts/bench_convert.py --workers 1,2 --repeat 3 --json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

sys.dont_write_bytecode = True  # leave no __pycache__ beside the scripts
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

RSS_TARGET = 0.25
RATIO_TARGET = 0.5
PRELOAD = ("torch", "shardkit.api")  # shardkit itself imports its names lazily


# ---- what the children run (imported lazily: the parent never imports torch) ---------------------


def direct_io_options(direct_io: str | None) -> dict:
    """The library's direct_io option for --direct-io; none when not given (the library's default,
    and all that older code knows)."""
    return {} if direct_io is None else {"direct_io": {"on": True, "off": False, "auto": "auto"}[direct_io]}


def sha256_option(sha256: bool) -> dict:
    """The library's sha256 option when asked for (shardkit before it had the option records sha256
    always, and takes no such argument)."""
    return {"sha256": True} if sha256 else {}


def run_convert(
    src: str,
    dst: str,
    tp: int,
    pp: int,
    qkv: str,
    kv_multiplier: int,
    fmt: str,
    workers: int,
    direct_io: str | None = None,
    sha256: bool = False,
    convention: str | None = None,
) -> dict:
    import shardkit
    from shardkit import Layout, convert

    layout = Layout(tp=tp, pp=pp, qkv=qkv, kv_multiplier=kv_multiplier)
    named = {"convention": convention} if convention else {}  # older shardkit takes no such argument
    result = convert(
        src,
        dst,
        layout,
        format=fmt,
        workers=workers,
        overwrite=True,
        **direct_io_options(direct_io),
        **sha256_option(sha256),
        **named,
    )
    return {
        "files": len(result.files),
        "bytes": result.bytes,
        "shardkit": shardkit.__file__,
        "torch_threads": __import__("torch").get_num_threads(),
    }


def run_merge(src: str, dst: str, workers: int, direct_io: str | None = None) -> dict:
    import shardkit
    from shardkit import merge

    result = merge(src, dst, workers=workers, overwrite=True, **direct_io_options(direct_io))
    return {
        "files": len(result.files),
        "bytes": result.bytes,
        "shardkit": shardkit.__file__,
        "torch_threads": __import__("torch").get_num_threads(),
    }


def sample_names(config: dict) -> list[str]:
    """Global tensors plus every tensor of the first, middle and last layers."""
    names = [n for n, _ in bc.llama_tensors(config)]
    layers = int(config["num_hidden_layers"])
    picked = {0, layers // 2, layers - 1}
    return [n for n in names if not n.startswith("model.layers.") or int(n.split(".")[2]) in picked]


def verify_outputs(src: str, shards: str, merged: str, fmt: str, tp: int, pp: int, full: bool) -> dict:
    """Merged output == source, and a few shard slices == the matching source slices."""
    import torch

    config = json.loads((Path(src) / "config.json").read_text())
    report: dict[str, Any] = {"merged": bc.compare_hf_dirs(src, merged, None if full else sample_names(config))}
    manifest = json.loads((Path(shards) / "shardkit.json").read_text())
    problems = []
    rank_re = re.compile(r"^((shards/)?model/dp_rank_\d+_tp_rank_\d+_pp_rank_\d+\.(pt|safetensors)|__\d+_0\.distcp)$")
    rank_files = [f["path"] for f in manifest["files"] if rank_re.match(f["path"])]  # xser also lists tensor files
    if len(rank_files) != tp * pp:
        problems.append(f"manifest lists {len(rank_files)} rank files, expected {tp * pp}")
    checks = 0
    if fmt in ("torch", "safetensors", "optimum-neuron"):
        from safetensors import safe_open

        catalog = bc.safetensors_catalog(src)
        suffix = ".safetensors" if fmt == "safetensors" else ".pt"
        model_dir = Path(shards) / ("shards/model" if fmt == "optimum-neuron" else "model")

        def load(tp_rank: int, pp_rank: int, name: str):
            path = model_dir / f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}{suffix}"
            if fmt != "safetensors":
                sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                return sd.get(name)
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name) if name in f.keys() else None

        def source_rows(name: str, start: int, stop: int) -> bytes:
            f, st_dtype, shape, offset, _ = catalog[name]
            row = bc.numel(shape[1:]) * bc.ST_ITEMSIZE[st_dtype]
            return bc.read_range(f, offset + start * row, (stop - start) * row)

        def as_bytes(t) -> bytes:
            return t.contiguous().view(torch.uint8).numpy().tobytes()

        vocab = int(config["vocab_size"])
        rows = vocab // tp
        for t in sorted({0, tp - 1}):
            for name, p in (("model.embed_tokens.weight", 0), ("lm_head.weight", pp - 1)):
                if name not in catalog:
                    continue
                piece = load(t, p, name)
                checks += 1
                if piece is None:
                    problems.append(f"tp {t} pp {p}: no {name}")
                elif as_bytes(piece) != source_rows(name, t * rows, (t + 1) * rows):
                    problems.append(f"tp {t} pp {p}: {name} differs from source rows {t * rows}:{(t + 1) * rows}")
        # a column-parallel cut (down_proj is split on dim 1)
        name = "model.layers.0.mlp.down_proj.weight"
        inter = int(config["intermediate_size"])
        t = min(1, tp - 1)
        piece = load(t, 0, name)
        checks += 1
        with safe_open(str(catalog[name][0]), framework="pt") as f:
            want = f.get_slice(name)[:, t * inter // tp : (t + 1) * inter // tp]
        if piece is None:
            problems.append(f"tp {t} pp 0: no {name}")
        elif not torch.equal(piece, want):
            problems.append(f"tp {t} pp 0: {name} differs from the source columns")
    report["shards"] = {"ok": not problems, "slices_checked": checks, "problems": problems}
    report["ok"] = report["merged"]["ok"] and report["shards"]["ok"]
    return report


# ---- the benchmark ---------------------------------------------------------------------------------


def smallest_kv_multiplier(config: dict, tp: int) -> int:
    kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    m = 1
    while (kv * m) % tp and m <= tp:
        m += 1
    return m


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shape", default="tinyllama", choices=sorted(bc.SHAPES), help="named model shape (default tinyllama)"
    )
    p.add_argument("--config", help="a Llama-style config.json to use instead of --shape")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES), help="dtype of the synthetic checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--qkv", default="gqa", help="qkv layout (default gqa)")
    p.add_argument(
        "--kv-multiplier",
        default="auto",
        help="kv head replication; auto = the smallest that makes kv heads x multiplier a multiple of tp",
    )
    p.add_argument(
        "--format",
        default="torch",
        choices=("torch", "xser", "safetensors", "dcp", "optimum-neuron"),
        help="shard format (dcp: a PyTorch DCP folder, a data file per rank)",
    )
    p.add_argument(
        "--convention",
        choices=("hf", "torchtitan", "torchtitan-0.3"),
        help="with --format dcp: the tensor names (default hf)",
    )
    p.add_argument("--workers", default="1", help="worker counts, comma-separated (each is run): e.g. 1,2")
    p.add_argument("--repeat", type=int, default=1, help="repeats per worker count")
    p.add_argument(
        "--sha256",
        action="store_true",
        help="convert records each shard's sha256 as well as xxh3-128 (shardkit's --sha256)",
    )
    p.add_argument(
        "--direct-io",
        choices=("auto", "on", "off"),
        help="shardkit's --direct-io for convert and merge (default: shardkit's default)",
    )
    p.add_argument("--stat", default="median", choices=("median", "best"), help="how repeats are combined (seconds)")
    p.add_argument(
        "--workdir",
        default=str(bc.DEFAULT_WORKDIR),
        help=f"where the synthetic checkpoint is cached and outputs go (default {bc.DEFAULT_WORKDIR})",
    )
    p.add_argument(
        "--keep", action="store_true", help="keep the shard and merged outputs (the source is always cached)"
    )
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="drop the page cache before every timed step, cp included (needs root; exits 2 otherwise)",
    )
    bc.add_settle_wait(p)
    p.add_argument(
        "--verify",
        default="sample",
        choices=("sample", "full", "none"),
        help="compare merged vs source bytes for a sample of tensors (default) or all",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="after measuring, run convert and merge once more under cProfile and print the top functions",
    )
    p.add_argument(
        "--shardkit-ref",
        metavar="GIT_REF",
        help="measure shardkit as committed at this git ref (exported to the work dir and put first on the "
        "children's PYTHONPATH) instead of the working tree",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        metavar="N",
        help="set OMP_NUM_THREADS=N for the convert/merge children (default: torch's own choice)",
    )
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    args = p.parse_args(argv)
    args.workers = bc.parse_int_list(args.workers)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    return args


def profile_op(
    label: str, target: str, kwargs: dict, logdir: Path, dst: Path, env: dict | None, drop_caches: bool = False
) -> dict:
    import pstats

    stats_path = logdir / f"{label}.pstats"
    m = bc.run_python(
        f"{label} (cProfile)",
        target,
        kwargs,
        logdir,
        preload=PRELOAD,
        profile=stats_path,
        env=env,
        before=lambda: bc.settle(drop_caches, dst),
    )
    out = io.StringIO()
    st = pstats.Stats(str(stats_path), stream=out)
    st.sort_stats("tottime").print_stats(15)
    st.sort_stats("cumulative").print_stats(25)
    return {"seconds": m.seconds, "stats_file": str(stats_path), "text": out.getvalue()}


@dataclass
class Bench:
    """What the steps of one benchmark run share: the arguments, the paths, the measured code, the source."""

    args: argparse.Namespace
    name: str
    config: dict
    workdir: Path
    kv_mult: int
    kv_auto: bool
    env: dict | None = None  # the children's environment (None: inherit)
    snap: Path | None = None  # with --shardkit-ref: the exported shardkit
    code_note: str = ""
    threads_note: str = ""
    cache_note: str = ""
    src: Path = Path()
    built: bc.Measurement | None = None
    src_bytes: int = 0
    weights: list[str] = field(default_factory=list)
    n_params: int = 0

    @property
    def logdir(self) -> Path:
        return self.workdir / "logs"

    @property
    def rundir(self) -> Path:
        return self.workdir / "run"

    @property
    def copy_dst(self) -> Path:
        return self.rundir / "cp-copy"

    def convert_kwargs(self, dst: Path, workers: int, src: Path | None = None) -> dict:
        a = self.args
        return {
            "src": str(src or self.src),
            "dst": str(dst),
            "tp": a.tp,
            "pp": a.pp,
            "qkv": a.qkv,
            "kv_multiplier": self.kv_mult,
            "fmt": a.format,
            "workers": workers,
            "direct_io": a.direct_io,
            "sha256": a.sha256,
            **({"convention": a.convention} if a.convention else {}),
        }


# ---- the steps of main ---------------------------------------------------------------------------------


def setup(args: argparse.Namespace) -> Bench:
    name, config = bc.load_shape(args.shape, args.config)
    workdir = Path(args.workdir).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    kv_auto = args.kv_multiplier == "auto"
    kv_mult = smallest_kv_multiplier(config, args.tp) if kv_auto else int(args.kv_multiplier)
    return Bench(args, name, config, workdir, kv_mult, kv_auto)


def choose_page_cache(b: Bench) -> None:
    """Warm by default; with --drop-caches, dropped before every step, or exit 2 when that is not possible."""
    bc.use_settle_wait(b.args)
    if b.args.drop_caches:
        bc.require_drop_caches()
        b.cache_note = "dropped (sync + drop_caches) right before every step"
    else:
        b.cache_note = "warm: every op follows a cp of its own input; sync (untimed) right before every step"


def choose_code(b: Bench) -> None:
    """Which shardkit the children import (the working tree or a git ref), and their torch threads."""
    args = b.args
    if args.shardkit_ref:
        b.snap, sha = bc.shardkit_snapshot(args.shardkit_ref, b.workdir)
        b.env = bc.child_env(b.snap)
        b.code_note = f"git {args.shardkit_ref} = {sha[:12]} (snapshot {b.snap}/shardkit)"
    else:
        state = bc.git_state()
        b.code_note = f"working tree at {str(state['commit'])[:12]}" + (
            " + uncommitted changes in shardkit/" if state["dirty"] else " (clean)"
        )
    if args.torch_threads:
        b.env = dict(b.env or os.environ)
        b.env["OMP_NUM_THREADS"] = b.env["MKL_NUM_THREADS"] = str(args.torch_threads)
    b.threads_note = (
        f"OMP_NUM_THREADS={args.torch_threads}"
        if args.torch_threads
        else f"torch default intra-op threads (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})"
    )
    bc.progress(f"measuring shardkit from {b.code_note}")


def build_fixture(b: Bench) -> None:
    """The synthetic checkpoint (built in a child: the parent stays free of torch)."""
    bc.progress(f"synthetic checkpoint {b.name} ({b.args.dtype}) under {b.workdir}")
    b.src, b.built = bc.synthetic_source(b.workdir, b.logdir, b.name, b.config, b.args.dtype, b.args.seed)
    b.src_bytes = bc.dir_bytes(b.src)
    b.weights = sorted(p.name for p in b.src.glob("*.safetensors"))
    b.n_params = sum(bc.numel(s) for _, s in bc.llama_tensors(b.config))
    bc.progress(
        f"{'reusing cached' if b.built.result['cached'] else f'built in {b.built.seconds:.1f} s:'} {b.src} "
        f"({b.src_bytes / bc.GB:.2f} GB, {len(b.weights)} safetensors files)"
    )


def timed_cp(b: Bench, label: str, src: Path, tag: str) -> bc.Measurement:
    """The baseline: `cp -r` of an op's input, started right after the same settling as the op."""
    m = bc.cp_baseline(
        label, src, b.copy_dst, b.logdir, keep=True, drop=b.args.drop_caches
    )  # removed by the next settle
    bc.progress(f"[{tag}] {label}: {m.seconds:.2f} s")
    return m


def timed_op(b: Bench, op: str, target: str, kwargs: dict, dst: Path, tag: str) -> bc.Measurement:
    """A shardkit operation in a fresh child, into an emptied `dst`; bytes_written = what it wrote."""
    m = bc.run_python(
        op, target, kwargs, b.logdir, preload=PRELOAD, env=b.env, before=lambda: bc.settle(b.args.drop_caches, dst)
    )
    m.bytes_written = bc.dir_bytes(dst)
    bc.progress(f"[{tag}] {op}: {m.seconds:.2f} s, peak RSS {m.peak_rss / bc.MB:.0f} MB")
    return m


def run_repeat(
    b: Bench, w: int, tag: str, shards: Path, merged: Path, samples: dict[str, list[bc.Measurement]]
) -> None:
    """One repeat: cp source, convert, cp shards, merge (each op right after a cp of its own input)."""
    samples["cp_src"].append(timed_cp(b, "cp -r source", b.src, tag))
    m = timed_op(b, "convert", "bench_convert:run_convert", b.convert_kwargs(shards, w), shards, tag)
    if b.args.shardkit_ref and not m.result["shardkit"].startswith(str(b.snap)):
        raise SystemExit(f"the child imported {m.result['shardkit']}, not the snapshot in {b.snap}")
    samples["convert"].append(m)
    samples["cp_shards"].append(timed_cp(b, "cp -r shards", shards, tag))
    samples["merge"].append(
        timed_op(
            b,
            "merge",
            "bench_convert:run_merge",
            {"src": str(shards), "dst": str(merged), "workers": w, "direct_io": b.args.direct_io},
            merged,
            tag,
        )
    )


def run_workers(b: Bench, w: int) -> dict:
    """Every repeat for one worker count, combined, then the outputs verified."""
    args = b.args
    shards, merged = b.rundir / f"shards-w{w}", b.rundir / f"merged-w{w}"
    samples: dict[str, list[bc.Measurement]] = {"cp_src": [], "convert": [], "cp_shards": [], "merge": []}
    for r in range(args.repeat):
        run_repeat(b, w, f"workers {w}, repeat {r + 1}/{args.repeat}", shards, merged, samples)
    combined = {k: bc.combine(v, args.stat) for k, v in samples.items()}
    verify = None
    if args.verify != "none":
        bc.progress(f"[workers {w}] verifying ({args.verify})")
        verify = bc.run_python(
            "verify",
            "bench_convert:verify_outputs",
            {
                "src": str(b.src),
                "shards": str(shards),
                "merged": str(merged),
                "fmt": args.format,
                "tp": args.tp,
                "pp": args.pp,
                "full": args.verify == "full",
            },
            b.logdir,
            preload=("torch",),
        ).result
    if not args.keep and w != args.workers[-1]:
        bc.remove(merged)
        bc.remove(shards)
    return {"workers": w, "ops": combined, "verify": verify}


def run_profiles(b: Bench) -> dict:
    """With --profile: convert and merge once more under cProfile (first worker count)."""
    if not b.args.profile:
        return {}
    w = b.args.workers[0]
    shards, merged = b.rundir / "profile-shards", b.rundir / "profile-merged"
    bc.progress(f"profiling convert and merge under cProfile (workers {w})")
    profiles = {
        "convert": profile_op(
            "convert",
            "bench_convert:run_convert",
            b.convert_kwargs(shards, w),
            b.logdir,
            shards,
            b.env,
            b.args.drop_caches,
        ),
        "merge": profile_op(
            "merge",
            "bench_convert:run_merge",
            {"src": str(shards), "dst": str(merged), "workers": w, "direct_io": b.args.direct_io},
            b.logdir,
            merged,
            b.env,
            b.args.drop_caches,
        ),
    }
    bc.remove(shards)
    bc.remove(merged)
    return profiles


def measure(b: Bench) -> tuple[list[dict], dict, dict]:
    """Every worker count, then the profiles; returns (runs, profiles, load averages at start and end)."""
    load_start = bc.load_average()
    try:
        runs = [run_workers(b, w) for w in b.args.workers]
        profiles = run_profiles(b)
    finally:
        bc.remove(b.copy_dst)
        if not b.args.keep:
            bc.remove(b.rundir)
    return runs, profiles, {"start": load_start, "end": bc.load_average()}


OP_LABELS = {
    "cp_src": "cp -r source",
    "convert": "convert ({format})",
    "cp_shards": "cp -r shards",
    "merge": "merge -> HF",
}


def summarize(b: Bench, runs: list[dict]) -> tuple[list[list], list[dict]]:
    """Table rows (one per op and worker count) and the pass/fail of each target."""
    targets = []
    rows = []
    for run in runs:
        w, ops = run["workers"], run["ops"]
        pairs = (("cp_src", None), ("convert", "cp_src"), ("cp_shards", None), ("merge", "cp_shards"))
        for key, base_key in pairs:
            m = ops[key]
            ratio = m.throughput / ops[base_key].throughput if base_key else None
            m.extra["ratio_vs_cp"] = ratio
            m.extra["rss_fraction"] = m.peak_rss / b.src_bytes
            rows.append(
                [
                    OP_LABELS[key].format(format=b.args.format),
                    w if base_key else "-",
                    bc.fmt(m.bytes_written / bc.GB),
                    bc.fmt(m.seconds),
                    bc.fmt(m.throughput / bc.GB, 3),
                    bc.fmt(ratio, 2, "x") if ratio is not None else "-",
                    bc.fmt(m.peak_rss / bc.MB, 0),
                    bc.fmt(100 * m.peak_rss / b.src_bytes, 1, "%"),
                    bc.fmt(m.base_rss / bc.MB, 0) if m.base_rss else "-",
                    bc.fmt(m.peak_anon / bc.MB, 0) if m.peak_anon else "-",
                    bc.fmt(m.peak_file / bc.MB, 0) if m.peak_file else "-",
                    bc.fmt(m.cpu_seconds, 1) if m.cpu_seconds is not None else "-",
                ]
            )
            if base_key:
                targets.append(
                    {
                        "workers": w,
                        "op": key,
                        "target": f"throughput >= {RATIO_TARGET}x cp",
                        "value": ratio,
                        "pass": ratio >= RATIO_TARGET,
                    }
                )
                targets.append(
                    {
                        "workers": w,
                        "op": key,
                        "target": f"peak RSS < {RSS_TARGET:.0%} of checkpoint",
                        "value": m.peak_rss / b.src_bytes,
                        "pass": m.peak_rss / b.src_bytes < RSS_TARGET,
                    }
                )
    return rows, targets


def machine_info() -> dict:
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "shardkit": _version("shardkit"),
        "cpus": os.cpu_count(),
        "ram_gb": _ram_gb(),
        "platform": platform.platform(),
    }


def print_json_report(
    b: Bench, runs: list[dict], profiles: dict, targets: list[dict], loads: dict, machine: dict
) -> None:
    args = b.args
    bc.print_json(
        {
            "model": b.name,
            "config": b.config,
            "params": b.n_params,
            "dtype": args.dtype,
            "source": str(b.src),
            "source_bytes": b.src_bytes,
            "source_files": b.weights,
            "source_cached": b.built.result["cached"],
            "layout": {"tp": args.tp, "pp": args.pp, "qkv": args.qkv, "kv_multiplier": b.kv_mult},
            "format": args.format,
            "workers": args.workers,
            "repeat": args.repeat,
            "stat": args.stat,
            "page_cache": b.cache_note,
            "env": machine,
            "shardkit_code": b.code_note,
            "torch_threads": b.threads_note,
            "load_average": loads,
            "runs": [
                {"workers": r["workers"], "ops": {k: m.to_dict() for k, m in r["ops"].items()}, "verify": r["verify"]}
                for r in runs
            ],
            "targets": targets,
            "profiles": {k: {kk: vv for kk, vv in v.items() if kk != "text"} for k, v in profiles.items()},
        }
    )


def print_header(b: Bench, loads: dict, machine: dict) -> None:
    args = b.args
    layout_desc = (
        f"tp {args.tp}, pp {args.pp}, qkv {args.qkv}, kv-multiplier {b.kv_mult}{' (auto)' if b.kv_auto else ''}"
    )
    print(
        f"shardkit convert/merge benchmark ({machine['cpus']} CPUs, {machine['ram_gb']} GB RAM, "
        f"python {machine['python']}, torch {machine['torch']})"
    )
    print(f"code:   shardkit from {b.code_note}")
    print(
        f"model:  {b.name}: {b.n_params / 1e9:.3f} B params, {args.dtype}, {b.src_bytes / bc.GB:.3f} GB in "
        f"{len(b.weights)} safetensors files{' (cached)' if b.built.result['cached'] else ''}: {b.src}"
    )
    print(f"layout: {layout_desc}; shard format {args.format}; merge -> HF safetensors (5GB split)")
    print(f"torch:  {b.threads_note}")
    print(f"cache:  {b.cache_note}")
    for line in bc.load_lines(loads["start"], loads["end"]):
        print(line)
    print(
        f"timing: {'median' if args.stat == 'median' else 'best'} of {args.repeat} run(s); convert/merge seconds are the "
        "call inside a fresh child (imports excluded); cp seconds are the cp process"
    )
    print(
        "memory: peak RSS = the child's own high-water mark (VmHWM / GNU time %M), including the interpreter and "
        "imports (base MB); anon/file MB = sampled peaks of anonymous and file-backed (mapped) RSS"
    )


def print_targets(b: Bench, runs: list[dict], targets: list[dict]) -> None:
    print(
        f"targets (convert and merge >= {RATIO_TARGET}x cp throughput; peak RSS < {RSS_TARGET:.0%} of the "
        f"{b.src_bytes / bc.GB:.2f} GB checkpoint = {RSS_TARGET * b.src_bytes / bc.MB:.0f} MB):"
    )
    bases = [m.base_rss for r in runs for m in r["ops"].values() if m.base_rss]
    if bases and max(bases) > RSS_TARGET * b.src_bytes:
        print(
            f"  note: the RSS target cannot be met at this size: the interpreter with torch and shardkit imported "
            f"is already {max(bases) / bc.MB:.0f} MB resident (use the default tinyllama shape for this target)"
        )
    for t in targets:
        value = f"{t['value']:.2f}x" if "throughput" in t["target"] else f"{100 * t['value']:.1f}%"
        print(f"  workers {t['workers']}  {t['op']:<8} {t['target']:<34} {value:>8}  {'PASS' if t['pass'] else 'FAIL'}")


def print_verify(b: Bench, runs: list[dict]) -> None:
    for run in runs:
        v = run["verify"]
        if v is None:
            continue
        mv, sv = v["merged"], v["shards"]
        print(
            f"verify (workers {run['workers']}): {'OK' if v['ok'] else 'FAILED'}: merged vs source: {mv['tensors']} "
            f"tensors, names/dtypes/shapes {'equal' if mv['structure_ok'] else 'DIFFER'}, "
            f"{mv['compared']} compared byte for byte ({mv['compared_bytes'] / bc.GB:.2f} GB); "
            f"shards: {sv['slices_checked']} slices checked against the source"
            + (" (slice checks are done for torch and safetensors shards only)" if b.args.format == "xser" else "")
        )
        for p in mv["problems"] + sv["problems"]:
            print(f"  problem: {p}")


def print_profiles(b: Bench, profiles: dict) -> None:
    for label, prof in profiles.items():
        print()
        print(
            f"==== cProfile of {label} (workers {b.args.workers[0]}; {prof['seconds']:.2f} s under the profiler; "
            f"stats {prof['stats_file']}) ===="
        )
        print(prof["text"].rstrip())


def print_report(
    b: Bench, runs: list[dict], profiles: dict, rows: list[list], targets: list[dict], loads: dict, machine: dict
) -> None:
    print_header(b, loads, machine)
    print()
    print(
        bc.format_table(
            [
                "operation",
                "workers",
                "GB",
                "seconds",
                "GB/s",
                "vs cp",
                "peak RSS MB",
                "RSS % ckpt",
                "base MB",
                "anon MB",
                "file MB",
                "CPU s",
            ],
            rows,
        )
    )
    print()
    print_thread_cpu(b, runs)
    print_targets(b, runs, targets)
    print_verify(b, runs)
    print_profiles(b, profiles)


def print_thread_cpu(b: Bench, runs: list[dict]) -> None:
    """Where each operation's CPU went, by thread (the median run): the main thread reads, copies
    and writes; the hash helper computes the output's digests; the hash check the sources'."""
    lines = []
    for run in runs:
        for key in ("convert", "merge"):
            line = bc.thread_cpu_line(run["ops"][key])
            if line:
                lines.append(f"  workers {run['workers']}  {key:8s} {line}")
    if lines:
        print("CPU by thread (median run):")
        print("\n".join(lines))
        print()


def main(argv=None) -> int:
    b = setup(parse_args(argv))
    choose_page_cache(b)
    choose_code(b)
    build_fixture(b)
    runs, profiles, loads = measure(b)
    rows, targets = summarize(b, runs)
    machine = machine_info()
    if b.args.json:
        print_json_report(b, runs, profiles, targets, loads, machine)
    else:
        print_report(b, runs, profiles, rows, targets, loads, machine)
    return 0


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "?"


def _ram_gb() -> str:
    try:
        with open("/proc/meminfo") as fh:
            kb = int(fh.readline().split()[1])
        return f"{kb / 2**20:.0f}"
    except (OSError, ValueError, IndexError):
        return "?"


if __name__ == "__main__":
    sys.exit(main())
