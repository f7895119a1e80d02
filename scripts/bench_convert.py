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
  with --drop-caches the page cache is also dropped before every step, when the kernel allows it.
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
from importlib import metadata
from pathlib import Path
from typing import Any

sys.dont_write_bytecode = True  # leave no __pycache__ beside the scripts
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402

RSS_TARGET = 0.25
RATIO_TARGET = 0.5
PRELOAD = ("torch", "shardkit")


# ---- what the children run (imported lazily: the parent never imports torch) ---------------------


def run_convert(src: str, dst: str, tp: int, pp: int, qkv: str, kv_multiplier: int, fmt: str, workers: int) -> dict:
    import shardkit
    from shardkit import Layout, convert

    layout = Layout(tp=tp, pp=pp, qkv=qkv, kv_multiplier=kv_multiplier)
    result = convert(src, dst, layout, format=fmt, workers=workers, overwrite=True)
    return {"files": len(result.files), "bytes": result.bytes, "shardkit": shardkit.__file__,
            "torch_threads": __import__("torch").get_num_threads()}


def run_merge(src: str, dst: str, workers: int) -> dict:
    import shardkit
    from shardkit import merge

    result = merge(src, dst, workers=workers, overwrite=True)
    return {"files": len(result.files), "bytes": result.bytes, "shardkit": shardkit.__file__,
            "torch_threads": __import__("torch").get_num_threads()}


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
    rank_re = re.compile(r"^model/dp_rank_\d+_tp_rank_\d+_pp_rank_\d+\.(pt|safetensors)$")
    rank_files = [f["path"] for f in manifest["files"] if rank_re.match(f["path"])]  # xser also lists tensor files
    if len(rank_files) != tp * pp:
        problems.append(f"manifest lists {len(rank_files)} rank files, expected {tp * pp}")
    checks = 0
    if fmt in ("torch", "safetensors"):
        from safetensors import safe_open

        catalog = bc.safetensors_catalog(src)
        suffix = ".pt" if fmt == "torch" else ".safetensors"

        def load(tp_rank: int, pp_rank: int, name: str):
            path = Path(shards) / "model" / f"dp_rank_00_tp_rank_{tp_rank:02d}_pp_rank_{pp_rank:02d}{suffix}"
            if fmt == "torch":
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
            want = f.get_slice(name)[:, t * inter // tp:(t + 1) * inter // tp]
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
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tinyllama", choices=sorted(bc.SHAPES), help="named model shape (default tinyllama)")
    p.add_argument("--config", help="a Llama-style config.json to use instead of --shape")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(bc.DTYPES), help="dtype of the synthetic checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--qkv", default="gqa", help="qkv layout (default gqa)")
    p.add_argument("--kv-multiplier", default="auto",
                   help="kv head replication; auto = the smallest that makes kv heads x multiplier a multiple of tp")
    p.add_argument("--format", default="torch", choices=("torch", "xser", "safetensors"), help="shard format")
    p.add_argument("--workers", default="1", help="worker counts, comma-separated (each is run): e.g. 1,2")
    p.add_argument("--repeat", type=int, default=1, help="repeats per worker count")
    p.add_argument("--stat", default="median", choices=("median", "best"), help="how repeats are combined (seconds)")
    p.add_argument("--workdir", default=str(bc.DEFAULT_WORKDIR),
                   help=f"where the synthetic checkpoint is cached and outputs go (default {bc.DEFAULT_WORKDIR})")
    p.add_argument("--keep", action="store_true", help="keep the shard and merged outputs (the source is always cached)")
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache before every step (needs root)")
    p.add_argument("--verify", default="sample", choices=("sample", "full", "none"),
                   help="compare merged vs source bytes for a sample of tensors (default) or all")
    p.add_argument("--profile", action="store_true",
                   help="after measuring, run convert and merge once more under cProfile and print the top functions")
    p.add_argument("--shardkit-ref", metavar="GIT_REF",
                   help="measure shardkit as committed at this git ref (exported to the work dir and put first on the "
                        "children's PYTHONPATH) instead of the working tree")
    p.add_argument("--torch-threads", type=int, metavar="N",
                   help="set OMP_NUM_THREADS=N for the convert/merge children (default: torch's own choice)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    args = p.parse_args(argv)
    args.workers = bc.parse_int_list(args.workers)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    return args


def profile_op(label: str, target: str, kwargs: dict, logdir: Path, dst: Path, env: dict | None) -> dict:
    import pstats

    stats_path = logdir / f"{label}.pstats"
    bc.remove(dst)
    bc.sync_disks()
    m = bc.run_python(f"{label} (cProfile)", target, kwargs, logdir, preload=PRELOAD, profile=stats_path, env=env)
    out = io.StringIO()
    st = pstats.Stats(str(stats_path), stream=out)
    st.sort_stats("tottime").print_stats(15)
    st.sort_stats("cumulative").print_stats(25)
    return {"seconds": m.seconds, "stats_file": str(stats_path), "text": out.getvalue()}


def main(argv=None) -> int:
    args = parse_args(argv)
    name, config = bc.load_shape(args.shape, args.config)
    workdir = Path(args.workdir).absolute()
    logdir = workdir / "logs"
    rundir = workdir / "run"
    workdir.mkdir(parents=True, exist_ok=True)
    kv_auto = args.kv_multiplier == "auto"
    kv_mult = smallest_kv_multiplier(config, args.tp) if kv_auto else int(args.kv_multiplier)

    # -- which shardkit the children import
    env = None
    if args.shardkit_ref:
        snap, sha = bc.shardkit_snapshot(args.shardkit_ref, workdir)
        env = bc.child_env(snap)
        code_note = f"git {args.shardkit_ref} = {sha[:12]} (snapshot {snap}/shardkit)"
    else:
        state = bc.git_state()
        code_note = (f"working tree at {str(state['commit'])[:12]}"
                     + (" + uncommitted changes in shardkit/" if state["dirty"] else " (clean)"))
    if args.torch_threads:
        env = dict(env or os.environ)
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.torch_threads)
    threads_note = (f"OMP_NUM_THREADS={args.torch_threads}" if args.torch_threads
                    else f"torch default intra-op threads (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    bc.progress(f"measuring shardkit from {code_note}")

    # -- the synthetic checkpoint (built in a child: the parent stays free of torch)
    spec = bc.synthetic_spec(name, config, args.dtype, seed=args.seed)
    bc.progress(f"synthetic checkpoint {name} ({args.dtype}) under {workdir}")
    built = bc.run_python("build", "bench_common:build_synthetic_checkpoint",
                          {"workdir": str(workdir), "spec": spec}, logdir, preload=("torch",))
    src = Path(built.result["path"])
    src_bytes = bc.dir_bytes(src)
    weights = sorted(p.name for p in src.glob("*.safetensors"))
    n_params = sum(bc.numel(s) for _, s in bc.llama_tensors(config))
    bc.progress(f"{'reusing cached' if built.result['cached'] else f'built in {built.seconds:.1f} s:'} {src} "
                f"({src_bytes / bc.GB:.2f} GB, {len(weights)} safetensors files)")

    cache_note = "warm: every op follows a cp of its own input; sync (untimed) before every step"
    if args.drop_caches:
        ok, why = bc.drop_caches()
        if ok:
            cache_note = "dropped (sync + drop_caches) before every step"
        else:
            bc.progress(f"--drop-caches: {why}; running with a warm cache")
            args.drop_caches = False
            cache_note += f" (--drop-caches refused: {why})"

    def settle() -> None:
        if args.drop_caches:
            bc.drop_caches()
        else:
            bc.sync_disks()

    load_start = bc.load_average()
    layout_desc = f"tp {args.tp}, pp {args.pp}, qkv {args.qkv}, kv-multiplier {kv_mult}{' (auto)' if kv_auto else ''}"
    runs = []
    copy_dst = rundir / "cp-copy"
    try:
        for w in args.workers:
            shards, merged = rundir / f"shards-w{w}", rundir / f"merged-w{w}"
            samples: dict[str, list[bc.Measurement]] = {"cp_src": [], "convert": [], "cp_shards": [], "merge": []}
            for r in range(args.repeat):
                tag = f"workers {w}, repeat {r + 1}/{args.repeat}"
                settle()
                m = bc.cp_baseline("cp -r source", src, copy_dst, logdir)
                bc.remove(copy_dst)
                samples["cp_src"].append(m)
                bc.progress(f"[{tag}] cp -r source: {m.seconds:.2f} s")

                bc.remove(shards)
                settle()
                m = bc.run_python("convert", "bench_convert:run_convert",
                                  {"src": str(src), "dst": str(shards), "tp": args.tp, "pp": args.pp, "qkv": args.qkv,
                                   "kv_multiplier": kv_mult, "fmt": args.format, "workers": w}, logdir, preload=PRELOAD, env=env)
                m.bytes_written = bc.dir_bytes(shards)
                if args.shardkit_ref and not m.result["shardkit"].startswith(str(snap)):
                    raise SystemExit(f"the child imported {m.result['shardkit']}, not the snapshot in {snap}")
                samples["convert"].append(m)
                bc.progress(f"[{tag}] convert: {m.seconds:.2f} s, peak RSS {m.peak_rss / bc.MB:.0f} MB")

                settle()
                m = bc.cp_baseline("cp -r shards", shards, copy_dst, logdir)
                bc.remove(copy_dst)
                samples["cp_shards"].append(m)
                bc.progress(f"[{tag}] cp -r shards: {m.seconds:.2f} s")

                bc.remove(merged)
                settle()
                m = bc.run_python("merge", "bench_convert:run_merge",
                                  {"src": str(shards), "dst": str(merged), "workers": w}, logdir, preload=PRELOAD, env=env)
                m.bytes_written = bc.dir_bytes(merged)
                samples["merge"].append(m)
                bc.progress(f"[{tag}] merge: {m.seconds:.2f} s, peak RSS {m.peak_rss / bc.MB:.0f} MB")
            combined = {k: bc.combine(v, args.stat) for k, v in samples.items()}
            verify = None
            if args.verify != "none":
                bc.progress(f"[workers {w}] verifying ({args.verify})")
                verify = bc.run_python("verify", "bench_convert:verify_outputs",
                                       {"src": str(src), "shards": str(shards), "merged": str(merged), "fmt": args.format,
                                        "tp": args.tp, "pp": args.pp, "full": args.verify == "full"},
                                       logdir, preload=("torch",)).result
            runs.append({"workers": w, "ops": combined, "verify": verify})
            if not args.keep and w != args.workers[-1]:
                bc.remove(merged)
                bc.remove(shards)

        profiles = {}
        if args.profile:
            w = args.workers[0]
            bc.progress("profiling convert and merge under cProfile (workers %d)" % w)
            profiles["convert"] = profile_op(
                "convert", "bench_convert:run_convert",
                {"src": str(src), "dst": str(rundir / "profile-shards"), "tp": args.tp, "pp": args.pp, "qkv": args.qkv,
                 "kv_multiplier": kv_mult, "fmt": args.format, "workers": w}, logdir, rundir / "profile-shards", env)
            profiles["merge"] = profile_op(
                "merge", "bench_convert:run_merge", {"src": str(rundir / "profile-shards"), "dst": str(rundir / "profile-merged"), "workers": w},
                logdir, rundir / "profile-merged", env)
            bc.remove(rundir / "profile-shards")
            bc.remove(rundir / "profile-merged")
    finally:
        bc.remove(copy_dst)
        if not args.keep:
            bc.remove(rundir)

    # -- report
    load_end = bc.load_average()
    targets = []
    rows = []
    for run in runs:
        w, ops = run["workers"], run["ops"]
        pairs = (("cp_src", None), ("convert", "cp_src"), ("cp_shards", None), ("merge", "cp_shards"))
        for key, base_key in pairs:
            m = ops[key]
            ratio = m.throughput / ops[base_key].throughput if base_key else None
            m.extra["ratio_vs_cp"] = ratio
            m.extra["rss_fraction"] = m.peak_rss / src_bytes
            label = {"cp_src": "cp -r source", "convert": f"convert ({args.format})", "cp_shards": "cp -r shards",
                     "merge": "merge -> HF"}[key]
            rows.append([label, w if base_key else "-", bc.fmt(m.bytes_written / bc.GB), bc.fmt(m.seconds),
                         bc.fmt(m.throughput / bc.GB, 3), bc.fmt(ratio, 2, "x") if ratio is not None else "-",
                         bc.fmt(m.peak_rss / bc.MB, 0), bc.fmt(100 * m.peak_rss / src_bytes, 1, "%"),
                         bc.fmt(m.base_rss / bc.MB, 0) if m.base_rss else "-",
                         bc.fmt(m.peak_anon / bc.MB, 0) if m.peak_anon else "-",
                         bc.fmt(m.peak_file / bc.MB, 0) if m.peak_file else "-",
                         bc.fmt(m.cpu_seconds, 1) if m.cpu_seconds is not None else "-"])
            if base_key:
                targets.append({"workers": w, "op": key, "target": f"throughput >= {RATIO_TARGET}x cp",
                                "value": ratio, "pass": ratio >= RATIO_TARGET})
                targets.append({"workers": w, "op": key, "target": f"peak RSS < {RSS_TARGET:.0%} of checkpoint",
                                "value": m.peak_rss / src_bytes, "pass": m.peak_rss / src_bytes < RSS_TARGET})

    machine = {
        "python": platform.python_version(), "torch": _version("torch"), "shardkit": _version("shardkit"),
        "cpus": os.cpu_count(), "ram_gb": _ram_gb(), "platform": platform.platform(),
    }
    header = {
        "model": name, "config": config, "params": n_params, "dtype": args.dtype, "source": str(src),
        "source_bytes": src_bytes, "source_files": weights, "source_cached": built.result["cached"],
        "layout": {"tp": args.tp, "pp": args.pp, "qkv": args.qkv, "kv_multiplier": kv_mult}, "format": args.format,
        "workers": args.workers, "repeat": args.repeat, "stat": args.stat, "page_cache": cache_note, "env": machine,
        "shardkit_code": code_note, "torch_threads": threads_note,
        "load_average": {"start": load_start, "end": load_end},
    }
    if args.json:
        bc.print_json({
            **header,
            "runs": [{"workers": r["workers"], "ops": {k: m.to_dict() for k, m in r["ops"].items()}, "verify": r["verify"]}
                     for r in runs],
            "targets": targets,
            "profiles": {k: {kk: vv for kk, vv in v.items() if kk != "text"} for k, v in profiles.items()},
        })
        return 0

    print(f"shardkit convert/merge benchmark ({machine['cpus']} CPUs, {machine['ram_gb']} GB RAM, "
          f"python {machine['python']}, torch {machine['torch']})")
    print(f"code:   shardkit from {code_note}")
    print(f"model:  {name}: {n_params / 1e9:.3f} B params, {args.dtype}, {src_bytes / bc.GB:.3f} GB in "
          f"{len(weights)} safetensors files{' (cached)' if built.result['cached'] else ''}: {src}")
    print(f"layout: {layout_desc}; shard format {args.format}; merge -> HF safetensors (5GB split)")
    print(f"torch:  {threads_note}")
    print(f"cache:  {cache_note}")
    if load_start and load_end:
        print(f"load:   1/5/15-min load average {'/'.join(f'{x:.1f}' for x in load_start)} at start, "
              f"{'/'.join(f'{x:.1f}' for x in load_end)} at end")
        for note in {bc.busy_note(load_start), bc.busy_note(load_end)} - {""}:
            print(f"        {note}")
    print(f"timing: {'median' if args.stat == 'median' else 'best'} of {args.repeat} run(s); convert/merge seconds are the "
          "call inside a fresh child (imports excluded); cp seconds are the cp process")
    print("memory: peak RSS = the child's own high-water mark (VmHWM / GNU time %M), including the interpreter and "
          "imports (base MB); anon/file MB = sampled peaks of anonymous and file-backed (mapped) RSS")
    print()
    print(bc.format_table(
        ["operation", "workers", "GB", "seconds", "GB/s", "vs cp", "peak RSS MB", "RSS % ckpt", "base MB",
         "anon MB", "file MB", "CPU s"], rows))
    print()
    print(f"targets (convert and merge >= {RATIO_TARGET}x cp throughput; peak RSS < {RSS_TARGET:.0%} of the "
          f"{src_bytes / bc.GB:.2f} GB checkpoint = {RSS_TARGET * src_bytes / bc.MB:.0f} MB):")
    bases = [m.base_rss for r in runs for m in r["ops"].values() if m.base_rss]
    if bases and max(bases) > RSS_TARGET * src_bytes:
        print(f"  note: the RSS target cannot be met at this size: the interpreter with torch and shardkit imported "
              f"is already {max(bases) / bc.MB:.0f} MB resident (use the default tinyllama shape for this target)")
    for t in targets:
        value = f"{t['value']:.2f}x" if "throughput" in t["target"] else f"{100 * t['value']:.1f}%"
        print(f"  workers {t['workers']}  {t['op']:<8} {t['target']:<34} {value:>8}  {'PASS' if t['pass'] else 'FAIL'}")
    for run in runs:
        v = run["verify"]
        if v is None:
            continue
        mv, sv = v["merged"], v["shards"]
        print(f"verify (workers {run['workers']}): {'OK' if v['ok'] else 'FAILED'}: merged vs source: {mv['tensors']} "
              f"tensors, names/dtypes/shapes {'equal' if mv['structure_ok'] else 'DIFFER'}, "
              f"{mv['compared']} compared byte for byte ({mv['compared_bytes'] / bc.GB:.2f} GB); "
              f"shards: {sv['slices_checked']} slices checked against the source"
              + (" (slice checks are done for torch and safetensors shards only)" if args.format == "xser" else ""))
        for p in mv["problems"] + sv["problems"]:
            print(f"  problem: {p}")
    for label, prof in profiles.items():
        print()
        print(f"==== cProfile of {label} (workers {args.workers[0]}; {prof['seconds']:.2f} s under the profiler; "
              f"stats {prof['stats_file']}) ====")
        print(prof["text"].rstrip())
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
