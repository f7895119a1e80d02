"""S3 throughput: shardkit's convert, merge and reshard to and from a loopback S3 server, against a
plain boto3 transfer (`boto3.s3.transfer.TransferManager` upload/download) of the same bytes
through the same server; and the bytes a tp 8 -> tp 4 reshard fetches against the tag's size.

The server is moto's server mode on 127.0.0.1, started here in its own process (no network).
Each step runs in its own process; peak RSS is that process's own high-water mark. Each operation
runs right beside its baseline, the two in turn first from round to round. `save_checkpoint` is
given every tp rank's pieces in memory, and its baseline (boto3's upload of the saved tag) runs in
a process holding the same pieces: a job that saves and then uploads holds its state, and on a VM
whose fresh memory costs a host fault, 2 GiB more in use slow the server's side of the same
upload too. The server and the steps share every core, unless `--server-core` gives the server
core 0 to itself and the steps (both sides') the others, as with a store on other hosts whose CPUs
the client never takes.

    python scripts/bench_s3.py --repeat 3 --drop-caches   # the TinyLlama-1.1B shape (2.2 GB in bf16)
    python scripts/bench_s3.py --config fixtures/tinyllama-mini.json --repeat 5
    python scripts/bench_s3.py --repeat 5 --drop-caches --server-core    # the server on a core of its own
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
step, args = sys.argv[1], json.loads(sys.argv[2])
fetched, gets, window = [], [0], [0]
if step.startswith("shardkit"):
    import shardkit
    import shardkit.api, shardkit.checkpoint.reshard  # imported before the clock starts (shardkit imports lazily)
    from shardkit.io.objects import remote
    from shardkit.io.objects import s3
    # the baseline moves its bytes in requests of the same size, as many at once
    assert (s3.PART_SIZE, s3.CONCURRENCY) == (args["part"], args["concurrency"]), "update PART/CONCURRENCY"
    close, get_range = remote.Mirror.close, s3.get_range
    def counted(self):
        fetched.append(self.bytes_fetched)
        window[0] = max(window[0], self.most_held)  # a streamed source's window (in /dev/shm: memory, not RSS)
        close(self)
    def counted_get(*a, **k):
        gets[0] += 1
        return get_range(*a, **k)
    remote.Mirror.close, s3.get_range = counted, counted_get
    s3.client()  # boto3 imported and the client built before the clock starts, as the baseline's are
else:
    import boto3
    from boto3.s3.transfer import TransferConfig, TransferManager
    client = boto3.client("s3", endpoint_url=args["endpoint"])
    part, concurrency = args["part"], args["concurrency"]
    config = TransferConfig(max_concurrency=concurrency, multipart_chunksize=part, multipart_threshold=part)
    manager = TransferManager(client, config)
if "tp" in args:  # the layout written (shardkit's steps) or of the pieces held (a save's baseline too)
    import shardkit
    layout = shardkit.make_layout(tp=args["tp"], pp=args["pp"], qkv="gqa", kv_multiplier=2 if args["tp"] == 8 else 1)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
held = 0
if args.get("pieces"):  # every tp rank's pieces in memory, as the ranks of a job hold them (both sides of a save)
    from shardkit.formats import SourceReader, open_checkpoint
    source = open_checkpoint(args["pieces"])
    reader = SourceReader(source)
    pieces = {}
    for ep, tp, pp in layout.ranks():
        ranked = source.family.rank_pieces(layout, source.dims, tp, pp, source.full_shapes, ep)
        pieces[(tp, pp)] = {p.name: reader.read_piece(p).clone() for p in ranked}
    reader.close()
    held = sum(t.numel() * t.element_size() for rank in pieces.values() for t in rank.values())
def hwm():  # this process's peak RSS (VmHWM), in bytes
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
try:  # the high-water mark reset, so the peak is the operation's own (not the piece building's)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
cpu0, start = cpu(), time.perf_counter()
if step == "shardkit-ckpt-save":
    shardkit.save_checkpoint(args["dst"], "step_1", pieces, layout=layout, config=source.config)
elif step == "shardkit-ckpt-reshard":
    shardkit.api.reshard_training_checkpoint(args["src"], args["dst"], layout)
elif step == "shardkit-convert":
    shardkit.convert(args["src"], args["dst"], layout, workers=1)
elif step == "shardkit-merge":
    shardkit.merge(args["src"], args["dst"], workers=1)
elif step == "shardkit-reshard":
    shardkit.reshard(args["src"], args["dst"], layout, workers=1)
elif step == "boto3-upload":
    futures = []
    root = Path(args["src"])
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        futures.append(manager.upload(str(f), args["bucket"], args["prefix"] + "/" + f.relative_to(root).as_posix()))
    for fut in futures:
        fut.result()
elif step == "boto3-download":
    root = Path(args["dst"]); futures = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=args["bucket"], Prefix=args["prefix"] + "/"):
        for o in page.get("Contents", []):
            out = root / o["Key"][len(args["prefix"]) + 1:]
            out.parent.mkdir(parents=True, exist_ok=True)
            futures.append(manager.download(args["bucket"], o["Key"], str(out)))
    for fut in futures:
        fut.result()
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "rss": hwm(),
                  "fetched": sum(fetched), "gets": gets[0], "cpu": cpu() - cpu0, "held": held,
                  "window": window[0]}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PART = 32 << 20
"""The part size of both sides (shardkit's `io.objects.s3.PART_SIZE`, checked by its steps)."""
CONCURRENCY = 16
"""Requests in flight on both sides (shardkit's `io.objects.s3.CONCURRENCY`)."""


DROP_CACHES = [False]
"""--drop-caches: the page cache dropped before every step (both sides), not only synced."""
SERVER: list[int] = []
"""The server's pid (its CPU seconds are read from /proc around each step)."""
CORES: dict[str, set[int]] = {}
"""The cores of the server ("server") and of the steps ("steps"); empty: every core for both."""


def on_cores(role: str):
    """A preexec_fn that keeps a child on its role's cores (None when they share every core)."""
    cores = CORES.get(role)
    return (lambda: os.sched_setaffinity(0, cores)) if cores else None


def server_cpu() -> float:
    try:
        fields = Path(f"/proc/{SERVER[0]}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def step(name: str, env: dict[str, str], **args) -> dict:
    args.update(part=PART, concurrency=CONCURRENCY)
    bench_common.settle(DROP_CACHES[0])  # the previous step's dirty pages written back now, not during this step
    before = server_cpu()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, name, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
        preexec_fn=on_cores("steps"),
    )
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["server_cpu"] = server_cpu() - before  # includes the step's start-up, a second or so of idle polling
    return result


def prefix_bytes(client, bucket: str, prefix: str) -> int:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sum(o["Size"] for page in pages for o in page.get("Contents", []))


def clear(client, bucket: str, prefix: str) -> None:
    """Delete every object under `prefix` (before a step writes there again; not timed)."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    keys = [{"Key": o["Key"]} for page in pages for o in page.get("Contents", [])]
    for i in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": keys[i : i + 1000]})


def best(runs: list[dict]) -> dict:
    """The median run by time (its RSS and counts with it)."""
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


SIZES: dict[str, int] = {}
"""Bytes under each prefix a step wrote, read before the prefix is cleared."""


def done_with(client, *prefixes: str) -> None:
    """Record the prefixes' sizes and delete them: the server then holds the same few objects at
    every step (moto keeps every object; with all of a round's outputs kept, 13 GB, later steps
    ran against a server short of memory)."""
    for prefix in prefixes:
        SIZES[prefix] = prefix_bytes(client, "bench", prefix)
        clear(client, "bench", prefix)


def sources(hf: Path, env: dict, client, endpoint: str, local: Path) -> None:
    """Untimed: the tp 8 model and the tp 8 checkpoint tag in the bucket, and local copies of both
    (what the boto3 uploads send)."""
    common = dict(bucket="bench", endpoint=endpoint)
    step("shardkit-convert", env, src=str(hf), dst="s3://bench/tp8", tp=8, pp=1)
    step("boto3-download", env, dst=str(local / "tp8"), prefix="tp8", **common)
    step("shardkit-ckpt-save", env, pieces=str(hf), dst="s3://bench/ckpt", tp=8, pp=1)
    step("boto3-download", env, dst=str(local / "ckpt"), prefix="ckpt", **common)


OPERATIONS = ("convert", "merge", "reshard", "ckpt-save", "ckpt-reshard")


def one_round(
    runs: dict[str, list[dict]],
    hf: Path,
    env: dict,
    client,
    endpoint: str,
    local: Path,
    shardkit_first: bool,
    only: tuple[str, ...] = OPERATIONS,
) -> None:
    """Each operation once beside its boto3 baseline (the same bytes), the two one right after the
    other, in the order given (alternated from round to round, so that a drift of the machine's
    speed favours neither)."""
    common = dict(bucket="bench", endpoint=endpoint)

    def timed(key: str, name: str, **args) -> None:
        runs[key].append(step(name, env, **args))

    def upload(key: str, src: Path, **pieces) -> None:
        timed(key, "boto3-upload", src=str(src), prefix="copy", **common, **pieces)
        done_with(client, "copy")

    def download(key: str, prefix: str) -> None:
        bench_common.remove(local / "dl")
        timed(key, "boto3-download", dst=str(local / "dl"), prefix=prefix, **common)

    def convert() -> None:
        clear(client, "bench", "tp8")
        timed("convert", "shardkit-convert", src=str(hf), dst="s3://bench/tp8", tp=8, pp=1)

    def merge() -> None:
        bench_common.remove(local / "merged")
        timed("merge", "shardkit-merge", src="s3://bench/tp8", dst=str(local / "merged"), tp=1, pp=1)

    def reshard() -> None:
        timed("reshard", "shardkit-reshard", src="s3://bench/tp8", dst="s3://bench/tp4", tp=4, pp=1)
        done_with(client, "tp4")

    def save() -> None:
        clear(client, "bench", "ckpt")
        timed("ckpt-save", "shardkit-ckpt-save", pieces=str(hf), dst="s3://bench/ckpt", tp=8, pp=1)

    def ckpt_reshard() -> None:
        timed("ckpt-reshard", "shardkit-ckpt-reshard", src="s3://bench/ckpt", dst="s3://bench/ckpt-tp4", tp=4, pp=1)
        done_with(client, "ckpt-tp4")

    def save_baselines(held_first: bool) -> None:
        """The upload of the saved tag by a process that holds the same rank pieces (as a job that
        saves and then uploads holds its state), and by one that holds nothing: on this VM fresh
        memory costs more, the server's included, when 2 GiB more are in use."""
        held = dict(key="ckpt-upload", src=local / "ckpt", pieces=str(hf), tp=8, pp=1)
        bare = dict(key="ckpt-upload-bare", src=local / "ckpt")
        for run in (held, bare) if held_first else (bare, held):
            upload(**run)

    def copy(prefix: str, down: str, up: str) -> None:
        download(down, prefix)
        upload(up, local / "dl")

    pairs = {
        "convert": (convert, lambda: upload("upload", local / "tp8")),
        "merge": (merge, lambda: download("download", "tp8")),
        "reshard": (reshard, lambda: copy("tp8", "r-download", "r-upload")),
        "ckpt-save": (save, lambda: save_baselines(shardkit_first)),
        "ckpt-reshard": (ckpt_reshard, lambda: copy("ckpt", "c-download", "c-upload")),
    }
    for ours, theirs in (pairs[name] for name in only):
        for run in (ours, theirs) if shardkit_first else (theirs, ours):
            run()


BASELINES = {
    "convert": ("upload",),
    "merge": ("download",),
    "reshard": ("r-download", "r-upload"),
    "ckpt-save": ("ckpt-upload",),
    "ckpt-reshard": ("c-download", "c-upload"),
}
"""Each operation's boto3 baseline: the steps that move the same bytes (their times added)."""
SECOND_BASELINES = {
    "ckpt-save": ("save_checkpoint tp8 tag -> s3 (boto3: upload of the tag, nothing held)", ("ckpt-upload-bare",))
}
"""Operations shown a second time, against another baseline (the row's label, the baseline's steps)."""
LABELS = {
    "convert": "convert HF -> s3 tp8 (boto3: upload of the tp8 files)",
    "merge": "merge s3 tp8 -> local (boto3: download of the tp8 files)",
    "reshard": "reshard s3 tp8 -> s3 tp4 (boto3: download + upload of tp8)",
    "ckpt-save": "save_checkpoint tp8 tag -> s3 (boto3: upload of the tag, the pieces held)",
    "ckpt-reshard": "ckpt reshard s3 tp8 -> s3 tp4 (boto3: download + upload of the tag)",
}
MOVED = {
    "convert": ("tp8",),
    "merge": ("tp8",),
    "reshard": ("tp8", "tp4"),
    "ckpt-save": ("ckpt",),
    "ckpt-reshard": ("ckpt", "ckpt-tp4"),
}
"""The prefixes whose bytes each operation moves."""


def baseline_run(runs: dict[str, list[dict]], steps: tuple[str, ...], i: int) -> dict:
    """Round `i` of a baseline (its `steps` added up)."""
    parts = [runs[k][i] for k in steps]
    return {k: sum(p[k] for p in parts) for k in ("seconds", "cpu", "server_cpu")} | {
        "rss": max(p["rss"] for p in parts),
        "held": max(p["held"] for p in parts),
    }


def report(args, runs: dict[str, list[dict]], only: tuple[str, ...]) -> None:
    """The table: each operation's median run beside its baseline's, and the ratio of each round
    (an operation against the baseline run right beside it)."""
    size = SIZES
    med = {op: best(runs[op]) for op in only}
    rows = [(op, LABELS[op], BASELINES[op]) for op in only]
    rows += [(op, *SECOND_BASELINES[op]) for op in only if op in SECOND_BASELINES]
    base = {steps: best([baseline_run(runs, steps, i) for i in range(len(runs[op]))]) for op, _, steps in rows}
    print(f"shape {args.shape}; {args.repeat} run(s) each, median; parts {PART >> 20} MiB, {CONCURRENCY} in flight")
    print(
        f"server on cores {sorted(CORES['server'])}, steps on cores {sorted(CORES['steps'])}"
        if CORES
        else "server and steps share every core"
    )
    for op, tag in (("reshard", "tp8"), ("ckpt-reshard", "ckpt"), ("merge", "tp8")):
        if op in med:
            r = med[op]
            print(
                f"{op} tp8 -> {'tp1' if op == 'merge' else 'tp4'}: fetched {r['fetched'] / 1e9:.3f} GB of the "
                f"{size[tag] / 1e9:.3f} GB source ({r['fetched'] / size[tag]:.1%}) in {r['gets']} GETs"
            )
            window = r.get("window", 0)
            print(
                f"{op}: "
                + (
                    f"streamed, at most {window / 2**20:.0f} MiB of the source held at once (memory file system)"
                    if window
                    else "source fetched whole into a mirror on local disk"
                )
            )
    if "ckpt-save" in med:
        save, upload = med["ckpt-save"], base[BASELINES["ckpt-save"]]
        print(
            f"save_checkpoint and boto3's upload each held {save['held'] / 2**30:.2f} GiB of rank pieces (in their "
            f"peak RSS): peak RSS beyond them {(save['rss'] - save['held']) / 2**20:.0f} MiB (shardkit), "
            f"{(upload['rss'] - upload['held']) / 2**20:.0f} MiB (boto3)"
        )
    print(
        "| operation | bytes moved | boto3 | shardkit | shardkit vs boto3 | each round | peak RSS shardkit / boto3 "
        "| CPU s client shardkit / boto3 | CPU s server shardkit / boto3 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for op, label, steps in rows:
        ours, theirs = med[op], base[steps]
        rounds = [baseline_run(runs, steps, i)["seconds"] / r["seconds"] for i, r in enumerate(runs[op])]
        nbytes = sum(size[prefix] for prefix in MOVED[op])
        print(
            f"| {label} | {nbytes / 1e9:.2f} GB | {theirs['seconds']:.2f} s | {ours['seconds']:.2f} s | "
            f"{theirs['seconds'] / ours['seconds']:.2f}x | {' '.join(f'{x:.2f}' for x in rounds)} "
            f"| {ours['rss'] / 2**20:.0f} / {theirs['rss'] / 2**20:.0f} MiB "
            f"| {ours['cpu']:.1f} / {theirs['cpu']:.1f} | {ours['server_cpu']:.1f} / {theirs['server_cpu']:.1f} |"
        )
    print("all runs (s):", json.dumps({k: [round(r["seconds"], 2) for r in v] for k, v in runs.items() if v}))


def measure(args, hf: Path, env: dict, client, endpoint: str, local: Path) -> None:
    """The chosen operations and their baselines `args.repeat` times (`one_round`), then the table."""
    only = tuple(op for op in OPERATIONS if op in args.only)
    extra = [k for _, steps in SECOND_BASELINES.values() for k in steps]
    runs: dict[str, list[dict]] = {k: [] for op in OPERATIONS for k in (op, *BASELINES[op])} | {k: [] for k in extra}
    sources(hf, env, client, endpoint, local)
    for i in range(args.repeat):
        one_round(runs, hf, env, client, endpoint, local, shardkit_first=i % 2 == 1, only=only)
    for prefix in ("tp8", "ckpt"):
        SIZES[prefix] = prefix_bytes(client, "bench", prefix)
    report(args, runs, only)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tinyllama")
    parser.add_argument("--config", default=None, help="a config.json instead of a named shape")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each step (the median is shown)")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="before every step (boto3's too), drop the page cache after the sync (needs root): "
        "each step starts from the same memory state, whatever the steps before it left "
        "cached (the server's objects, downloaded copies)",
    )
    parser.add_argument(
        "--only",
        default=",".join(OPERATIONS),
        type=lambda text: text.split(","),
        help=f"the operations to measure, comma-separated (default: all of {', '.join(OPERATIONS)})",
    )
    parser.add_argument(
        "--server-core",
        action="store_true",
        help="give the server core 0 to itself and the steps (both sides') the other cores, so "
        "that a step's own CPU work never takes the server's, as with a store on other "
        "hosts (default: the server and the steps share every core)",
    )
    bench_common.add_settle_wait(parser)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "shardkit-bench"))
    args = parser.parse_args()
    if unknown := sorted(set(args.only) - set(OPERATIONS)):
        parser.error(f"--only: no operation named {', '.join(unknown)} (choose from {', '.join(OPERATIONS)})")
    name, config = bench_common.load_shape(args.shape if not args.config else None, args.config)
    args.shape = name
    if args.drop_caches:
        bench_common.require_drop_caches()
        DROP_CACHES[0] = True
    bench_common.use_settle_wait(args)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    hf, _ = bench_common.synthetic_source(workdir, workdir / "logs", name, config)
    if args.server_core:
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            parser.error("--server-core needs two cores or more (the server's and the steps'): leave it out")
        CORES.update(server={cores[0]}, steps=set(cores[1:]))
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=on_cores("server"),
    )
    SERVER.append(server.pid)
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(
        os.environ,
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        PYTHONPATH=str(REPO),
    )
    local = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=workdir))
    try:
        time.sleep(3)
        import boto3

        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="bench",
            aws_secret_access_key="bench",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket="bench")
        measure(args, hf, env, client, endpoint, local)
    finally:
        bench_common.remove(local)
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
