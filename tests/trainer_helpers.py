"""Helpers for tests/test_trainer.py: launching the trainer in-process or under torchrun, and
reading its metrics."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fixtures" / "tiny-corpus.txt"
TORCHRUN_TIMEOUT = 240


def corpus_tokens(out: Path, vocab: int = 256) -> Path:
    """The bundled text as byte tokens (what scripts/prepare_data.py writes without a tokenizer)."""
    from trainer.data import write_tokens

    data = np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8).astype(np.int64) % vocab
    return write_tokens(out, data, vocab)


def steps(metrics: Path) -> list[dict]:
    return [r for r in (json.loads(line) for line in Path(metrics).read_text().splitlines()) if r.get("event") == "step"]


def losses(metrics: Path) -> list[float]:
    return [r["loss"] for r in steps(metrics)]


def run_inprocess(args: list[str]):
    """One-process run (no process group) inside the test process."""
    from trainer import parse_args, train

    return train(parse_args(args))


def torchrun(nproc: int, args: list[str], timeout: float = TORCHRUN_TIMEOUT, env: dict | None = None
             ) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m trainer ARGS`, one intra-op thread per process."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "trainer", *args]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def check_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"trainer failed (rc {done.returncode}):\n{done.stderr[-4000:]}"


def rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def worker_exit_codes(stderr: str) -> dict[int, int]:
    """{rank: exit code} from torchrun's failure report (every failed worker is listed)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in found}
