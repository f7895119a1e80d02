"""S3 throughput: shardkit's convert, merge and reshard to and from a loopback S3 server, against a
plain boto3 transfer (`boto3.s3.transfer.TransferManager` upload/download) of the same bytes
through the same server; and the bytes a tp 8 -> tp 4 reshard fetches against the tag's size.

The server is moto's server mode on 127.0.0.1, started here in its own process (no network).
Each step runs in its own process; peak RSS is that process's own high-water mark.

    python scripts/bench_s3.py                     # the TinyLlama-1.1B shape (2.2 GB in bf16)
    python scripts/bench_s3.py --shape tinyllama-mini --config fixtures/tinyllama-mini.json
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
fetched = []
if step.startswith("shardkit"):
    import shardkit
    from shardkit.io import remote
    close = remote.Mirror.close
    def counted(self):
        fetched.append(self.bytes_fetched)
        close(self)
    remote.Mirror.close = counted
    layout = shardkit.make_layout(tp=args["tp"], pp=args["pp"], qkv="gqa", kv_multiplier=2 if args["tp"] == 8 else 1)
else:
    import boto3
    from boto3.s3.transfer import TransferConfig, TransferManager
    client = boto3.client("s3", endpoint_url=args["endpoint"])
    manager = TransferManager(client, TransferConfig(max_concurrency=8, multipart_chunksize=16 << 20))
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
                  "fetched": sum(fetched)}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step(name: str, env: dict[str, str], **args) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, name, json.dumps(args)], env=env, capture_output=True,
                         text=True, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def prefix_bytes(client, bucket: str, prefix: str) -> int:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return sum(o["Size"] for page in pages for o in page.get("Contents", []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="tinyllama")
    parser.add_argument("--config", default=None, help="a config.json instead of a named shape")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "shardkit-bench"))
    args = parser.parse_args()
    name, config = bench_common.load_shape(args.shape if not args.config else None, args.config)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    hf, _ = bench_common.synthetic_source(workdir, workdir / "logs", name, config)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
               AWS_DEFAULT_REGION="us-east-1", PYTHONPATH=str(REPO))
    try:
        time.sleep(3)
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                              region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        rows = []
        local = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=workdir))
        up = step("boto3-upload", env, src=str(hf), bucket="bench", prefix="hf-copy", endpoint=endpoint)
        conv = step("shardkit-convert", env, src=str(hf), dst="s3://bench/tp8", tp=8, pp=1)
        size_tp8 = prefix_bytes(client, "bench", "tp8")
        rows.append(("convert HF -> s3 tp8", bench_common.dir_bytes(hf), up, conv))
        down = step("boto3-download", env, dst=str(local / "dl-tp8"), bucket="bench", prefix="tp8", endpoint=endpoint)
        mrg = step("shardkit-merge", env, src="s3://bench/tp8", dst=str(local / "merged"), tp=1, pp=1)
        rows.append(("merge s3 tp8 -> local", size_tp8, down, mrg))
        res = step("shardkit-reshard", env, src="s3://bench/tp8", dst="s3://bench/tp4", tp=4, pp=1)
        size_tp4 = prefix_bytes(client, "bench", "tp4")
        copy_down = step("boto3-download", env, dst=str(local / "dl2"), bucket="bench", prefix="tp8", endpoint=endpoint)
        copy_up = step("boto3-upload", env, src=str(local / "dl2"), bucket="bench", prefix="tp8-copy", endpoint=endpoint)
        plain = {"seconds": copy_down["seconds"] + copy_up["seconds"], "rss": max(copy_down["rss"], copy_up["rss"])}
        rows.append(("reshard s3 tp8 -> s3 tp4", size_tp8 + size_tp4, plain, res))
        print(f"shape {name}; tp8 tag {size_tp8 / 1e9:.3f} GB; reshard tp8 -> tp4 fetched {res['fetched'] / 1e9:.3f} GB "
              f"({res['fetched'] / size_tp8:.1%} of the tag); merge fetched {mrg['fetched'] / 1e9:.3f} GB")
        print("| operation | bytes moved | boto3 transfer | shardkit | vs boto3 | peak RSS shardkit / boto3 |")
        print("| --- | --- | --- | --- | --- | --- |")
        for label, nbytes, base, ours in rows:
            print(f"| {label} | {nbytes / 1e9:.2f} GB | {base['seconds']:.2f} s | {ours['seconds']:.2f} s | "
                  f"{base['seconds'] / ours['seconds']:.2f}x | {ours['rss'] / 2**20:.0f} / {base['rss'] / 2**20:.0f} MiB |")
        bench_common.remove(local)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
