"""Helpers for the trainer tests: launching the trainer in-process, as a multi-process gloo job
(`run_ranks`, or real `torchrun`), and reading its metrics."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "fixtures" / "tiny-corpus.txt"
TORCHRUN_TIMEOUT = 240
TINY_CONFIG = "llama-trainer-tiny"  # 8 q heads, 2 kv heads, head_dim 4, hidden 32, 4 layers, vocab 256
# 5 steps of 4 sequences of 32 tokens, lr high enough that the weights move visibly every step
COMMON = [
    "--seq-len",
    "32",
    "--micro-batch",
    "1",
    "--global-batch",
    "4",
    "--steps",
    "5",
    "--lr",
    "1e-2",
    "--warmup",
    "2",
    "--dtype",
    "fp32",
    "--no-progress",
    "--threads",
    "1",
]


def run_args(model: Path, data: Path, metrics: Path, *extra: str, common: list[str] = COMMON) -> list[str]:
    """Trainer arguments: `model`, `data`, metrics to `metrics`, the `common` settings, then `extra`
    (a later option wins)."""
    return ["--model", str(model), "--data", str(data), "--metrics", str(metrics), *common, *extra]


def adamw_reference(model, params: list, tokens: Path, eps: float = 1e-8) -> list[float]:
    """COMMON's run as a plain loop: `model` (a transformers causal LM, vocab 256) trained by
    torch.optim.AdamW on `params` over the trainer's own batches, schedule and clipping; the loss
    of each step."""
    import torch
    import torch.nn.functional as F

    from trainer.data import Batches, TokenFile
    from trainer.optim import LRSchedule

    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=eps, weight_decay=0.0)
    schedule = LRSchedule(1e-2, 2, 5, "cosine", 0.1)
    batches = Batches(TokenFile(tokens), 32, 4, 1, 1, 0, 1234)
    got = []
    for step in range(5):
        inputs, targets = batches.step_batch()
        total = 0.0
        for x, y in zip(inputs.split(1), targets.split(1)):
            loss = F.cross_entropy(model(input_ids=x).logits.float().view(-1, 256), y.reshape(-1)) / 4
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = schedule.at(step)
        opt.step()
        opt.zero_grad()
        got.append(total)
    return got


def tiny_run_fixtures(name: str, config: str = TINY_CONFIG):
    """A test module's module-scoped fixtures: `work` (a temporary folder), `hf_model` (the tiny
    model of `config`, seed 3) and `tokens` (the bundled text as byte tokens). Use as
    `work, hf_model, tokens = tiny_run_fixtures("name")`."""
    import pytest

    from shardkit.testing import make_tiny_model

    @pytest.fixture(scope="module")
    def work(tmp_path_factory) -> Path:
        return tmp_path_factory.mktemp(name)

    @pytest.fixture(scope="module")
    def hf_model(work) -> Path:
        return make_tiny_model(config, work / "hf", seed=3)

    @pytest.fixture(scope="module")
    def tokens(work) -> Path:
        return corpus_tokens(work / "corpus.bin")

    return work, hf_model, tokens


def corpus_tokens(out: Path, vocab: int = 256) -> Path:
    """The bundled text as byte tokens (what scripts/prepare_data.py writes without a tokenizer)."""
    from trainer.data import write_tokens

    data = np.frombuffer(CORPUS.read_bytes(), dtype=np.uint8).astype(np.int64) % vocab
    return write_tokens(out, data, vocab)


def steps(metrics: Path) -> list[dict]:
    return [
        r for r in (json.loads(line) for line in Path(metrics).read_text().splitlines()) if r.get("event") == "step"
    ]


def losses(metrics: Path) -> list[float]:
    return [r["loss"] for r in steps(metrics)]


def run_inprocess(args: list[str]):
    """One-process run (no process group) inside the test process."""
    from trainer import parse_args, train

    return train(parse_args(args))


def torchrun(
    nproc: int, args: list[str], timeout: float = TORCHRUN_TIMEOUT, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m trainer ARGS`, one intra-op thread per process."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "trainer",
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


# Modules every rank needs, imported once by the fork server instead of by every rank (~2 CPU-s each).
RANK_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "transformers",
    "trainer.__main__",
    "trainer.loop",
]
_forkserver = None
FAILED_RANK_GRACE_S = 30.0  # torchrun's behaviour: once a rank has failed, the others are stopped


def fork_server():
    """The fork server the ranks of `run_ranks` start from (one per test session; other gloo
    workers too: multiprocessing's "forkserver" start method then forks them from it). It only
    imports (no torch op runs in it, so no thread pool exists to be broken by fork), with one
    OpenMP thread like torchrun's workers."""
    global _forkserver
    if _forkserver is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(RANK_PRELOAD)
        before = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = before
        _forkserver = ctx
    return _forkserver


def _rank_main(args: list[str], env: dict[str, str], out: str, err: str) -> None:
    """One rank: torchrun's environment, stdout/stderr to files, then `python -m trainer ARGS`'s
    own ending (atexit handlers, then the exit code)."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.argv = ["trainer", *args]
    from trainer.__main__ import _exit_now, main

    code = 1
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        atexit._run_exitfuncs()
        _exit_now(code)


def _read_if_any(path: Path) -> str:
    """A rank's output file ("" when the rank died before opening it)."""
    return path.read_text(errors="replace") if path.exists() else ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    nproc: int, args: list[str], timeout: float = TORCHRUN_TIMEOUT, env: dict | None = None
) -> subprocess.CompletedProcess:
    """The trainer as an `nproc`-process gloo job, like `torchrun(...)` but each rank forked from a
    server that has already imported torch and the trainer: the same process group, environment
    (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and exit path, without torchrun's launcher and
    ~2 CPU-s of imports per process (a 4-rank test takes 5 s instead of 14 on 2 cores). stderr is
    the ranks' stderr in rank order; returncode 0 when every rank exited 0, else the first failing
    rank's code. Tests of torchrun's own behaviour (its exit code and failure report) use `torchrun`."""
    ctx = fork_server()
    base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
    )
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        procs = []
        for rank in range(nproc):
            rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            proc = ctx.Process(
                target=_rank_main,
                args=(args, rank_env, f"{logs}/{rank}.out", f"{logs}/{rank}.err"),
                name=f"trainer-rank-{rank}",
            )
            proc.start()
            procs.append(proc)
        deadline, failed_at = time.monotonic() + timeout, None
        try:
            while any(p.exitcode is None for p in procs):
                now = time.monotonic()
                if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                    failed_at = now
                if now > deadline:
                    raise subprocess.TimeoutExpired(["trainer", *args], timeout)
                if failed_at is not None and now > failed_at + FAILED_RANK_GRACE_S:
                    for p in procs:
                        if p.exitcode is None:
                            p.terminate()
                multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None], 0.5)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
        out, err = ("".join(_read_if_any(Path(logs) / f"{r}.{kind}") for r in range(nproc)) for kind in ("out", "err"))
    code = next((c for c in codes if c != 0), 0)
    return subprocess.CompletedProcess(["trainer", *args], code, out, err)


def check_ok(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"trainer failed (rc {done.returncode}):\n{done.stderr[-4000:]}"


def rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def worker_exit_codes(stderr: str) -> dict[int, int]:
    """{rank: exit code} from torchrun's failure report (every failed worker is listed)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    return {int(rank): int(code) for rank, code in found}


# ---- XLA (torch-xla on CPU) --------------------------------------------------------------------------

XLA_TIMEOUT = 900


def run_xla(
    devices: int, args: list[str], timeout: float = XLA_TIMEOUT, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS --device xla` in a fresh process on torch-xla's CPU runtime with
    `devices` devices (PJRT_DEVICE=CPU, CPU_NUM_DEVICES): one rank per device, each a thread of
    that process, as torch-xla runs several devices on CPU."""
    full_env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), PYTHONUNBUFFERED="1", **(env or {}))
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "trainer", *args, "--device", "xla"]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def _hf_names(pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """tp1 pieces (separate q/k/v, fused gate_up = [gate; up]) under Hugging Face names."""
    out = {}
    for name, t in pieces.items():
        if name.endswith("mlp.gate_up_proj.weight"):
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return out


def serial_adamw_step(tag_dir: Path, config: Path, inputs: torch.Tensor, targets: torch.Tensor):
    """One torch.optim.AdamW step of a plain transformers model from the checkpoint's full state
    (read with shardkit's load_checkpoint at tp1): weights, exp_avg, exp_avg_sq, step, and
    lr / betas / eps / weight decay from its param_groups and scheduler. Returns (weights before,
    weights after, loss)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardkit import Layout
    from shardkit.checkpoint import load_checkpoint

    loaded = load_checkpoint(tag_dir.parent, tag_dir.name, target_layout=Layout(), rank=(0, 0), config=config)
    opt_state = loaded.optimizer
    weights = {k: v.float() for k, v in _hf_names(loaded.model).items()}
    moments = {m: _hf_names({n: e[m] for n, e in opt_state.state.items()}) for m in ("exp_avg", "exp_avg_sq")}
    groups_of = _hf_names({n: torch.full((2,), opt_state.groups[n]) for n in opt_state.state})
    steps = {float(e["step"]) for e in opt_state.state.values()}
    assert len(steps) == 1
    lr = loaded.scheduler["_last_lr"][0]
    assert all(g["lr"] == lr for g in opt_state.param_groups)  # NxD's groups hold the next step's lr

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.parent), dtype=torch.float32)
    model.load_state_dict(weights, strict=True)
    named = dict(model.named_parameters())
    groups = []
    for g, hyper in enumerate(opt_state.param_groups):
        groups.append(
            {
                "params": [named[n] for n in named if int(groups_of[n][0]) == g],
                "lr": lr,
                "betas": tuple(hyper["betas"]),
                "eps": hyper["eps"],
                "weight_decay": hyper["weight_decay"],
            }
        )
    opt = torch.optim.AdamW(groups)
    step = steps.pop()
    for n, p in named.items():
        opt.state[p] = {
            "step": torch.tensor(step),
            "exp_avg": moments["exp_avg"][n].clone(),
            "exp_avg_sq": moments["exp_avg_sq"][n].clone(),
        }
    before = {n: p.detach().clone() for n, p in named.items()}
    logits = model(input_ids=inputs).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return before, {n: p.detach().clone() for n, p in named.items()}, float(loss.detach())
