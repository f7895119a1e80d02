#!/usr/bin/env python
"""The newcomer's demo: a tiny TinyLlama-shaped model -> shards -> back, checked three ways.

Builds a seeded random model from fixtures/tinyllama-mini.json (32 q heads, 4 kv heads, 22 layers),
then runs the shardkit CLI as a user would:
  convert (tp 8, pp 2, kv-multiplier 2, NxD's GQA layer) -> inspect -> merge -> verify,
and finally loads the merged directory with transformers and compares logits with the original.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shardkit.testing import make_tiny_model  # noqa: E402


def sh(*args: str) -> None:
    print(f"\n$ {shlex.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "shardkit", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "demo-out", help="work folder (replaced)")
    out = parser.parse_args().out
    shutil.rmtree(out, ignore_errors=True)
    hf, shards, merged = out / "tinyllama-mini", out / "tinyllama-mini-tp8pp2", out / "tinyllama-mini-merged"
    print(f"building a random TinyLlama-shaped model in {hf}")
    make_tiny_model("tinyllama-mini", hf, seed=0, dtype=torch.bfloat16)

    sh("convert", str(hf), str(shards), "--to-sharded", "--tp", "8", "--pp", "2", "--kv-multiplier", "2", "--qkv", "gqa")
    sh("inspect", str(shards))
    sh("merge", str(shards), str(merged))
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
