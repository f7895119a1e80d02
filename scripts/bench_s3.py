"""S3 throughput: shardkit's convert, merge and reshard to and from a loopback S3 server, against a
plain boto3 transfer (`boto3.s3.transfer.TransferManager` upload/download) of the same bytes
through the same server; and the bytes a tp 8 -> tp 4 reshard fetches against the tag's size.

The server is moto's server mode on 127.0.0.1, started here in its own process (no network).
Each step runs in its own process; peak RSS is that process's own high-water mark.

    python scripts/bench_s3.py [--repeat 3]        # the TinyLlama-1.1B shape (2.2 GB in bf16)
    python scripts/bench_s3.py --config fixtures/tinyllama-mini.json --repeat 5
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
fetched, gets = [], [0]
if step.startswith("shardkit"):
    import shardkit
    from shardkit.io import remote, s3
    # the baseline moves its bytes in requests of the same size, as many at once
    assert (s3.PART_SIZE, s3.CONCURRENCY) == (args["part"], args["concurrency"]), "update PART/CONCURRENCY"
    close, get_range = remote.Mirror.close, s3.get_range
    def counted(self):
        fetched.append(self.bytes_fetched)
        close(self)
    def counted_get(*a, **k):
        gets[0] += 1
        return get_range(*a, **k)
    remote.Mirror.close, s3.get_range = counted, counted_get
    layout = shardkit.make_layout(tp=args["tp"], pp=args["pp"], qkv="gqa", kv_multiplier=2 if args["tp"] == 8 else 1)
else:
    import boto3
    from boto3.s3.transfer import TransferConfig, TransferManager
    client = boto3.client("s3", endpoint_url=args["endpoint"])
    part, concurrency = args["part"], args["concurrency"]
    config = TransferConfig(max_concurrency=concurrency, multipart_chunksize=part, multipart_threshold=part)
    manager = TransferManager(client, config)
start = time.perf_counter()
if step == "shardkit-convert":
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
print(json.dumps({"seconds": seconds, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "fetched": sum(fetched), "gets": gets[0]}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PART = 32 << 20
"""The part size of both sides (shardkit's `io.s3.PART_SIZE`, checked by its steps)."""
CONCURRENCY = 16
"""Requests in flight on both sides (shardkit's `io.s3.CONCURRENCY`)."""


def step(name: str, env: dict[str, str], **args) -> dict:
    args.update(part=PART, concurrency=CONCURRENCY)
    out = subprocess.run([sys.executable, "-c", CHILD, name, json.dumps(args)], env=env, capture_output=True,
                         text=True, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def measure(args, hf: Path, env: dict, client, endpoint: str, local: Path) -> None:
    """Every step `args.repeat` times, alternating shardkit and boto3, then the table."""
    runs: dict[str, list[dict]] = {k: [] for k in ("convert", "upload", "merge", "download", "reshard")}
    common = dict(bucket="bench", endpoint=endpoint)
    for _ in range(args.repeat):
        clear(client, "bench", "tp8")
        runs["convert"].append(step("shardkit-convert", env, src=str(hf), dst="s3://bench/tp8", tp=8, pp=1))
        bench_common.remove(local / "dl-tp8")
        runs["download"].append(step("boto3-download", env, dst=str(local / "dl-tp8"), prefix="tp8", **common))
        clear(client, "bench", "tp8-copy")
        runs["upload"].append(step("boto3-upload", env, src=str(local / "dl-tp8"), prefix="tp8-copy", **common))
        bench_common.remove(local / "merged")
        runs["merge"].append(step("shardkit-merge", env, src="s3://bench/tp8", dst=str(local / "merged"), tp=1, pp=1))
        clear(client, "bench", "tp4")
        runs["reshard"].append(step("shardkit-reshard", env, src="s3://bench/tp8", dst="s3://bench/tp4", tp=4, pp=1))
    size_tp8, size_tp4 = prefix_bytes(client, "bench", "tp8"), prefix_bytes(client, "bench", "tp4")
    up, down, conv, mrg, res = (best(runs[k]) for k in ("upload", "download", "convert", "merge", "reshard"))
    both = {"seconds": down["seconds"] + up["seconds"], "rss": max(down["rss"], up["rss"])}
    rows = [
        ("convert HF -> s3 tp8 (boto3: upload of the tp8 files)", size_tp8, up, conv),
        ("merge s3 tp8 -> local (boto3: download of the tp8 files)", size_tp8, down, mrg),
        ("reshard s3 tp8 -> s3 tp4 (boto3: download + upload of tp8)", size_tp8 + size_tp4, both, res),
    ]
    print(f"shape {args.shape}; {args.repeat} run(s) each, median; parts {PART >> 20} MiB, {CONCURRENCY} in flight")
    print(f"tp8 tag {size_tp8 / 1e9:.3f} GB; reshard tp8 -> tp4 fetched {res['fetched'] / 1e9:.3f} GB "
          f"({res['fetched'] / size_tp8:.1%} of the tag) in {res['gets']} GETs; merge fetched "
          f"{mrg['fetched'] / 1e9:.3f} GB in {mrg['gets']} GETs")
    print("| operation | bytes moved | boto3 | shardkit | shardkit vs boto3 | peak RSS shardkit / boto3 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, nbytes, base, ours in rows:
        print(f"| {label} | {nbytes / 1e9:.2f} GB | {base['seconds']:.2f} s | {ours['seconds']:.2f} s | "
              f"{base['seconds'] / ours['seconds']:.2f}x | {ours['rss'] / 2**20:.0f} / {base['rss'] / 2**20:.0f} MiB |")
    print("all runs (s):", json.dumps({k: [round(r["seconds"], 2) for r in v] for k, v in runs.items()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tinyllama")
    parser.add_argument("--config", default=None, help="a config.json instead of a named shape")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each step (the median is shown)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "shardkit-bench"))
    args = parser.parse_args()
    name, config = bench_common.load_shape(args.shape if not args.config else None, args.config)
    args.shape = name
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    hf, _ = bench_common.synthetic_source(workdir, workdir / "logs", name, config)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
               AWS_DEFAULT_REGION="us-east-1", PYTHONPATH=str(REPO))
    local = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=workdir))
    try:
        time.sleep(3)
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                              region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        measure(args, hf, env, client, endpoint, local)
    finally:
        bench_common.remove(local)
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
