#!/usr/bin/env python
"""The newcomer's demo: a tiny TinyLlama-shaped model -> shards -> back, checked three ways.

Builds a seeded random model from fixtures/tinyllama-mini.json (32 q heads, 4 kv heads, 22 layers),
then runs the shardkit CLI as a user would:
  convert (tp 8, pp 2, kv-multiplier 2, NxD's GQA layer) -> inspect -> merge -> verify,
and finally loads the merged directory with transformers and compares logits with the original.

The work folder (--out) is the demo's own: a folder holding anything the demo did not make is
refused (exit 2), and a re-run replaces only the three folders it made, through shardkit's own
staged outputs (nothing is ever deleted outside them).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shardkit.distributed import Job  # noqa: E402
from shardkit.io.safety.durable import write_text  # noqa: E402
from shardkit.io.safety.transaction import commit_all, staged_output  # noqa: E402
from shardkit.testing import make_tiny_model  # noqa: E402

MARK = ".shardkit-demo"
"""In a work folder the demo made: a later run may replace what it wrote there."""


def sh(*args: str) -> None:
    print(f"\n$ {shlex.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "shardkit", *args], check=True)


def refuse(message: str) -> None:
    print(f"demo: error: {message}", file=sys.stderr)
    sys.exit(2)


def claim(out: Path) -> None:
    """Make `out` the demo's work folder, or exit 2 with one line when it holds anything else."""
    if out.exists() and not out.is_dir():
        refuse(f"{out} is a file: choose another --out")
    if out.is_dir() and any(out.iterdir()) and not (out / MARK).is_file():
        refuse(
            f"{out} is not empty and is not a folder the demo made: choose another --out "
            "(the demo never deletes what it did not make)"
        )
    out.mkdir(parents=True, exist_ok=True)
    write_text(
        out / MARK, "made by scripts/demo.py: its three model folders are replaced by the next run\n", fsync=False
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "runs" / "demo", help="work folder: new, empty, or an earlier demo's"
    )
    out = parser.parse_args().out
    claim(out)
    hf, shards, merged = out / "tinyllama-mini", out / "tinyllama-mini-tp8pp2", out / "tinyllama-mini-merged"
    print(f"building a random TinyLlama-shaped model in {hf}")
    with staged_output(hf, overwrite=True, what="the demo's model", job=Job()) as made:
        make_tiny_model("tinyllama-mini", made.path, seed=0, dtype=torch.bfloat16)
        commit_all(made, Job())

    sh(
        "convert",
        str(hf),
        str(shards),
        "--to-sharded",
        "--tp",
        "8",
        "--pp",
        "2",
        "--kv-multiplier",
        "2",
        "--qkv",
        "gqa",
        "--overwrite",
    )
    sh("inspect", str(shards))
    sh("merge", str(shards), str(merged), "--overwrite")
    sh("verify", str(hf), str(merged))

    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(hf).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(merged).eval()(ids).logits
    same = torch.equal(a, b)
    print(f"\ntransformers logits of the merged model {'are identical to' if same else 'DIFFER from'} the original's")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
