"""Time a warm `shardkit merge` as a user runs it: the whole `python -m shardkit -q merge` process,
start-up (interpreter, imports, command line) included, against `cp -r` of the same shards.

    python scripts/bench_start.py --rounds 5                    # the working tree
    python scripts/bench_start.py --refs HEAD~3,WORK --rounds 5  # two versions, alternating

Each round runs, for every version: `cp -r` of the shards, the merge, and `python -c "import
torch"` (the floor any torch tool pays), each a fresh process prepared as `bench_convert.py`
prepares its steps (the earlier output removed, then `sync`). "vs cp" is cp's time over the
merge's time less that floor. The children keep their bytecode under the work dir (an installed
package has it too; PYTHONDONTWRITEBYTECODE is ignored for them), compiled by an untimed first run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import bench_common as bc  # noqa: E402
from bench_convert import smallest_kv_multiplier  # noqa: E402

PRELOAD = ("torch", "shardkit.api")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--refs", default="WORK", help="versions, comma-separated: git refs or WORK (the working tree)")
    p.add_argument("--rounds", type=int, default=5, help="rounds; each runs every step of every version once")
    p.add_argument("--shape", choices=sorted(bc.SHAPES), default=None, help="named model shape (default tinyllama)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--workers", type=int, default=1, help="the merge's --workers (default 1)")
    p.add_argument("--workdir", default="/tmp/shardkit-bench", help="where the synthetic checkpoint is cached")
    return p.parse_args(argv)


def child_env(pythonpath: Path, workdir: Path) -> dict[str, str]:
    """The environment of the timed children: shardkit from `pythonpath`, bytecode kept."""
    env = bc.child_env(pythonpath) or dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(workdir / "pycache")
    return env


def make_shards(workdir: Path, logdir: Path, args: argparse.Namespace, env: dict[str, str]) -> Path:
    """The merge's input: the synthetic checkpoint converted to tp x pp torch shards (written once
    per run of this script, by the first version)."""
    name, config = bc.load_shape(args.shape, None)
    src, _ = bc.synthetic_source(workdir, logdir, name, config)
    shards = workdir / "run-start" / "shards"
    bc.remove(shards)
    kwargs = {"tp": args.tp, "pp": args.pp, "qkv": "gqa", "fmt": "torch", "workers": args.workers}
    kwargs["kv_multiplier"] = smallest_kv_multiplier(config, args.tp)
    bc.run_python(
        "convert",
        "bench_convert:run_convert",
        dict(kwargs, src=str(src), dst=str(shards)),
        logdir,
        preload=PRELOAD,
        env=env,
        sys_path=[SCRIPTS],
    )
    return shards


def timed(op: str, cmd: list[str], logdir: Path, env: dict[str, str], dst: Path | None = None) -> bc.Measurement:
    """`cmd` as a fresh process (wall and CPU seconds), started right after `settle` (removing `dst`)."""
    bc.settle(False, *([dst] if dst else []))
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # run_command starts its child with this process's environment
    try:
        return bc.run_command(op, cmd, logdir)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def vs_cp(cp: float, merge: float, floor: float) -> str:
    """cp's time over the merge's time less the floor ("n/a" when the merge took no longer)."""
    return f"{cp / (merge - floor):.2f}x" if merge > floor else "n/a"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir).resolve()
    logdir, out = workdir / "logs", workdir / "run-start"
    workdir.mkdir(parents=True, exist_ok=True)
    os.chdir(workdir)  # `python -m` puts the current folder first on the path: a checkout here would win
    envs = {
        ref: child_env(SCRIPTS.parent if ref == "WORK" else bc.shardkit_snapshot(ref, workdir)[0], workdir)
        for ref in args.refs.split(",")
    }
    shards = make_shards(workdir, logdir, args, envs[next(iter(envs))])
    merged = out / "merged"
    merge = [sys.executable, "-m", "shardkit", "-q", "merge", str(shards), str(merged), "--workers", str(args.workers)]
    floor = [sys.executable, "-c", "import torch"]
    for env in envs.values():  # untimed: compiles each version's bytecode once
        timed("warm-up", merge, logdir, env, merged)
    samples: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for ref, env in envs.items():
            cp = bc.cp_baseline("cp -r shards", shards, out / "cp", logdir, keep=True)
            runs = {
                "merge": timed("merge", merge, logdir, env, merged),
                "torch": timed("import torch", floor, logdir, env),
            }
            steps = {"cp": cp.seconds, **{step: m.seconds for step, m in runs.items()}}
            steps.update({f"{step} CPU": m.cpu_seconds or 0.0 for step, m in runs.items()})
            for step, seconds in steps.items():
                samples.setdefault((ref, step), []).append(seconds)
            print(
                f"round {r + 1}  {ref:10s} cp {steps['cp']:.2f} s  merge {steps['merge']:.2f} s  "
                f"import torch {steps['torch']:.2f} s  vs cp {vs_cp(steps['cp'], steps['merge'], steps['torch'])}  "
                f"(CPU: merge {steps['merge CPU']:.2f} s, import torch {steps['torch CPU']:.2f} s)",
                flush=True,
            )
    print(bc.busy_note(bc.load_average()))
    for ref in envs:
        cp, merge_s, torch_s, merge_cpu, torch_cpu = (
            statistics.median(samples[(ref, s)]) for s in ("cp", "merge", "torch", "merge CPU", "torch CPU")
        )
        print(
            f"{ref:10s} median: cp {cp:.2f} s  merge {merge_s:.2f} s  import torch {torch_s:.2f} s  "
            f"vs cp {vs_cp(cp, merge_s, torch_s)}  (CPU: merge {merge_cpu:.2f} s, import torch {torch_cpu:.2f} s)"
        )
    bc.remove(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
