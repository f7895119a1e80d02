"""`ckpt reshard` of a training checkpoint with its Adam state: wall time and peak RSS against
`cp -r` of the same tag, for one or more git refs of shardkit side by side.

The tag is NxD's layout at tp 2, dp 1: model files in bf16 and ZeRO-1 optimizer files with fp32
`exp_avg` and `exp_avg_sq` (seeded values), written once by `shardkit.save_checkpoint` from the
synthetic Hugging Face model (`bench_common`) and cached. Each measured step is a fresh process
(`bench_common.run_python`): `reshard_training_checkpoint` into tp 1 with 2 dp ranks, so one
target rank is the whole model and its moments, the case where holding a rank's state costs most.

    python scripts/bench_ckpt_reshard.py                          # the working tree, 3 runs
    python scripts/bench_ckpt_reshard.py --refs 412f015,WORK      # before and after a change
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

SHAPE = {  # a 250M-parameter Llama: a 2.5 GB tag with its moments, a minute's work on 2 cores
    **bc.SHAPES["tinyllama"],
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
}
TAG = "step_10"


def make_tag(src: str, root: str, tp: int) -> dict[str, Any]:
    """(child) Save `src` as a training checkpoint at `root`/step_10: layout tp, Adam moments."""
    import torch

    import shardkit
    from shardkit.checkpoint import OptimizerState
    from shardkit.formats import SourceReader, open_checkpoint

    source = open_checkpoint(src)
    layout = shardkit.make_layout(tp=tp, qkv="gqa")
    reader = SourceReader(source)
    g = torch.Generator().manual_seed(0)
    model, optim = {}, {}
    for ep, t, p in layout.ranks():
        pieces = source.family.rank_pieces(layout, source.dims, t, p, source.full_shapes, ep)
        weights = {piece.name: reader.read_piece(piece).clone() for piece in pieces}
        state = {
            name: {
                "exp_avg": torch.randn(w.shape, generator=g) * 1e-3,
                "exp_avg_sq": torch.rand(w.shape, generator=g) * 1e-6,
                "step": 10,
            }
            for name, w in weights.items()
        }
        model[(t, p)], optim[(t, p)] = weights, OptimizerState(state, [{"lr": 3e-4, "betas": (0.9, 0.95)}])
    reader.close()
    shardkit.save_checkpoint(root, TAG, model, optim, layout=layout, config=source.config)
    from shardkit.checkpoint import finalize_checkpoint

    finalize_checkpoint()
    return {"bytes": bc.dir_bytes(Path(root) / TAG)}


def run_reshard(src: str, dst: str, tp: int, dp: int) -> dict[str, Any]:
    """(child) The measured step."""
    import shardkit
    import shardkit.api

    shardkit.api.reshard_training_checkpoint(src, dst, shardkit.make_layout(tp=tp, qkv="gqa"), dp=dp, zero1=True)
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refs", default="WORK", help="comma-separated git refs (WORK: the working tree)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (the median is shown)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "shardkit-bench"))
    args = parser.parse_args()
    workdir = Path(args.workdir)
    logs = workdir / "logs"
    hf, _ = bc.synthetic_source(workdir, logs, "llama-250m", SHAPE)
    root = workdir / "ckpt-adam-tp2"
    if not (root / TAG / "done").is_file():
        bc.remove(root)
        bc.progress(f"saving the tp 2 training checkpoint with Adam state into {root}")
        bc.run_python("make tag", "bench_ckpt_reshard:make_tag", {"src": str(hf), "root": str(root), "tp": 2}, logs)
    size = bc.dir_bytes(root / TAG)
    refs = [r.strip() for r in args.refs.split(",") if r.strip()]
    envs = {r: None if r == "WORK" else bc.child_env(bc.shardkit_snapshot(r, workdir)[0]) for r in refs}
    runs: dict[str, list[bc.Measurement]] = {r: [] for r in [*refs, "cp -r"]}
    out = workdir / "ckpt-adam-tp1"
    for _ in range(args.repeat):  # alternating, so that a busy moment of the machine hits every ref alike
        for ref in refs:
            bc.settle(False, out)
            kwargs = {"src": str(root), "dst": str(out), "tp": 1, "dp": 2}
            runs[ref].append(
                bc.run_python(
                    f"ckpt reshard {ref}",
                    "bench_ckpt_reshard:run_reshard",
                    kwargs,
                    logs,
                    preload=("shardkit.api",),
                    env=envs[ref],
                )
            )
        runs["cp -r"].append(bc.cp_baseline("cp -r", root / TAG, out / TAG, logs))
    bc.remove(out)
    cp = statistics.median(m.seconds for m in runs["cp -r"])
    print(f"tag: {size / 1e9:.2f} GB (tp 2 -> tp 1, dp 2); median of {args.repeat}; {bc.busy_note(bc.load_average())}")
    rows = []
    for what, ms in runs.items():
        seconds = statistics.median(m.seconds for m in ms)
        rss = statistics.median(m.peak_rss for m in ms)
        anon = statistics.median(m.peak_anon or 0 for m in ms)
        rows.append(
            [what, f"{seconds:.2f} s", f"{cp / seconds:.2f}x", f"{rss / 2**20:.0f} MiB", f"{anon / 2**20:.0f} MiB"]
        )
    # peak RSS counts the pages of memory-mapped source files too (the page cache's, given back
    # under pressure); the sampled anonymous peak is the memory the process itself holds
    print(bc.format_table(["", "wall", "vs cp -r", "peak RSS", "peak anonymous"], rows))


if __name__ == "__main__":
    main()
