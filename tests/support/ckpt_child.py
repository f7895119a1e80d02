"""Child processes of tests/unit/checkpoint/test_checkpoint.py: a trainer that checkpoints until it is killed, and
a torch.distributed (gloo) worker. Imported by a multiprocessing forkserver that preloads torch, so
each child starts in milliseconds instead of re-importing torch."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import torch

from shardkit.checkpoint import Rank, load_checkpoint, save_checkpoint
from shardkit.checkpoint import save as ckpt_save
from shardkit.families import family_for
from shardkit.io.data.hashing import HashingFile
from shardkit.io.safety import delete as io_delete
from shardkit.io.safety import transaction as io_transaction
from shardkit.layout import Layout, ModelDims
from shardkit.placements import shard
from shardkit.testing import fixture_config

MOMENTS = ("exp_avg", "exp_avg_sq")


# ---- deterministic training state ----------------------------------------------------------------


def full_state(config: dict, step: int, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Full (HF) weights and Adam moments of a model at `step` (same values in every process)."""
    family, dims = family_for(config), ModelDims.from_config(config)
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    out: dict[str, dict[str, torch.Tensor]] = {"weight": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, shape in family.full_shapes(dims).items():
        out["weight"][name] = torch.randn(shape, generator=g)
        out["exp_avg"][name] = torch.randn(shape, generator=g) * 0.1
        out["exp_avg_sq"][name] = torch.rand(shape, generator=g) * 0.01
    return out


def rank_pieces(config: dict, layout: Layout, rank: Rank, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    family, dims = family_for(config), ModelDims.from_config(config)
    shapes = family.full_shapes(dims)
    return {p.name: shard(p, full) for p in family.rank_pieces(layout, dims, rank.tp, rank.pp, shapes, rank.ep)}


def rank_optimizer(config: dict, layout: Layout, rank: Rank, state: dict, step: int) -> dict[str, dict]:
    moments = {m: rank_pieces(config, layout, rank, state[m]) for m in MOMENTS}
    return {
        name: {"exp_avg": moments["exp_avg"][name], "exp_avg_sq": moments["exp_avg_sq"][name], "step": step}
        for name in moments["exp_avg"]
    }


# ---- the trainer that gets killed ----------------------------------------------------------------

KILL_CONFIG = "llama-mha"
KILL_LAYOUT = Layout(tp=2, pp=2)


def _log(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def _install_slow_hooks(log_path: str, rng: random.Random) -> None:
    """Small sleeps inside tensor writes, around markers and inside deletions, so that random
    kills land in every phase; each phase is logged so the test can say where a kill landed."""
    hashing_write = HashingFile.write

    def slow_write(self, data):
        if rng.random() < 0.1:
            time.sleep(0.001)
        return hashing_write(self, data)

    HashingFile.write = slow_write

    write_marker = io_transaction.write_marker

    def slow_marker(tag_dir, name, fsync=True):
        _log(log_path, f"phase marker-{name} {Path(tag_dir).name}")
        time.sleep(0.02)
        write_marker(tag_dir, name, fsync)
        time.sleep(0.02)

    io_transaction.write_marker = slow_marker

    write_tensor_file = ckpt_save.write_tensor_file

    def logged_write(tag_dir, key, *args, **kwargs):
        _log(log_path, f"phase write {Path(tag_dir).name}")
        return write_tensor_file(tag_dir, key, *args, **kwargs)

    ckpt_save.write_tensor_file = logged_write

    unlink_entry = io_delete._unlink_entry

    def slow_remove(dir_fd, name, path):
        _log(log_path, f"phase delete {Path(path).parent.name}")
        time.sleep(0.002)
        unlink_entry(dir_fd, name, path)

    io_delete._unlink_entry = slow_remove


def train_until_killed(
    root: str,
    log_path: str,
    fmt: str,
    async_save: bool,
    seed: int,
    max_saves: int = 10_000,
    num_kept: int = 2,
    keep_every: int | None = None,
) -> None:
    """Resume from the newest complete checkpoint and save one per step until killed.

    Logs `ready STEP` after resuming and `durable STEP` once a checkpoint is known complete (sync:
    when save returns; async: when the next save returns, which waits for it)."""
    torch.set_num_threads(1)
    config = fixture_config(KILL_CONFIG)
    _install_slow_hooks(log_path, random.Random(seed))
    loaded = load_checkpoint(root, "latest_if_exists", optimizer=False, verify=False)
    step = loaded.step if loaded is not None else 0
    _log(log_path, f"ready {step}")
    ranks = [Rank(tp=tp, pp=pp) for _, tp, pp in KILL_LAYOUT.ranks()]
    pending = None
    for _ in range(max_saves):
        step += 1
        state = full_state(config, step)
        model = {(r.tp, r.pp): rank_pieces(config, KILL_LAYOUT, r, state["weight"]) for r in ranks}
        optim = {(r.tp, r.pp): rank_optimizer(config, KILL_LAYOUT, r, state, step) for r in ranks}
        save_checkpoint(
            root,
            f"step_{step}",
            model,
            optim,
            scheduler={"last_epoch": step},
            user_content={"step": step, "seed": seed},
            layout=KILL_LAYOUT,
            config=config,
            format=fmt,
            async_save=async_save,
            num_kept=num_kept,
            keep_every=keep_every,
        )
        if pending is not None:
            _log(log_path, f"durable {pending}")
        if async_save:
            pending = step
            for tensors in model.values():  # training goes on: the saved copy must not change
                for t in tensors.values():
                    t.add_(1.0)
        else:
            _log(log_path, f"durable {step}")
    if async_save:
        ckpt_save.finalize_checkpoint()
        _log(log_path, f"durable {pending}")
    _log(log_path, "finished")


# ---- a torch.distributed (gloo) job -----------------------------------------------------------------

GLOO_CONFIG = "llama-gqa64"


def gloo_worker(rank: int, world: int, port: int, root: str, direct: str) -> None:
    """One of `world` processes: save tp2 pp2 (async, during collectives of the trainer), load at
    tp4 pp1 and tp1 pp1, save those, and load them back at tp2 pp2; compare everything with
    the direct conversions in `direct` and the moments sharded from the full ones."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        _gloo_job(rank, world, Path(root), Path(direct))
    finally:
        dist.destroy_process_group()


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), f"{what}: names {list(got)[:3]} vs {list(want)[:3]}"
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), f"{what}: {name} differs"


def _direct(direct: Path, layout_name: str, rank: Rank) -> dict[str, torch.Tensor]:
    path = direct / layout_name / "model" / f"dp_rank_00_tp_rank_{rank.tp:02d}_pp_rank_{rank.pp:02d}.pt"
    return torch.load(path, weights_only=True)


def _check(loaded, config, layout, state, direct: Path, layout_name: str, step: int, what: str) -> None:
    _assert_equal(loaded.model, _direct(direct, layout_name, loaded.rank), f"{what} model")
    want = rank_optimizer(config, layout, loaded.rank, state, step)
    assert set(loaded.optimizer.state) == set(want), what
    for name, entry in want.items():
        for m in MOMENTS:
            assert torch.equal(loaded.optimizer.state[name][m], entry[m]), f"{what}: {m} of {name}"
        assert loaded.optimizer.state[name]["step"] == step
    assert loaded.optimizer.param_groups == [{"lr": 0.001, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]


def _gloo_job(rank: int, world: int, root: Path, direct: Path) -> None:
    import torch.distributed as dist

    from shardkit.checkpoint import OptimizerState, finalize_checkpoint

    config = fixture_config(GLOO_CONFIG)
    state = full_state(config, 100, seed=1)
    groups = [{"lr": 0.001, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}]
    tp2pp2, tp4pp1, tp1pp1 = Layout(tp=2, pp=2, qkv="gqa"), Layout(tp=4, pp=1), Layout(tp=1, pp=1)

    # 1. save at tp2 pp2, asynchronously, while the trainer runs collectives on the default group
    me = Rank.from_global(rank, tp2pp2)
    model = _direct(direct, "tp2pp2", me)
    original = {k: v.clone() for k, v in model.items()}
    optim = OptimizerState(rank_optimizer(config, tp2pp2, me, state, 100), groups)
    save_checkpoint(
        root,
        "step_100",
        model,
        optim,
        scheduler={"last_epoch": 100},
        user_content={"step": 100},
        layout=tp2pp2,
        config=config,
        async_save=True,
        num_kept=3,
    )
    for t in model.values():
        t.mul_(-1)  # the trainer moves on; the checkpoint keeps the values at save time
    for _ in range(20):
        x = torch.ones(1000)
        dist.all_reduce(x)
        assert x[0].item() == world
    finalize_checkpoint()

    # 2. resume the same state at tp4 pp1 and tp1 pp1 (every rank a dp replica of rank 0)
    for layout, name in ((tp4pp1, "tp4pp1"), (tp1pp1, "tp1pp1")):
        loaded = load_checkpoint(root, target_layout=layout)
        assert loaded.tag == "step_100" and loaded.step == 100 and loaded.layout == tp2pp2
        assert loaded.rank == Rank.from_global(rank, layout)
        assert loaded.user_content == {"step": 100} and loaded.scheduler == {"last_epoch": 100}
        _check(loaded, config, layout, state, direct, name, 100, f"rank {rank} at {name}")

    # 3. and back: save from tp4 pp1 (4 writers) and from tp1 pp1 (dp 4: rank 0 writes), load at tp2 pp2
    for layout, tag in ((tp4pp1, "step_200"), (tp1pp1, "step_300")):
        loaded = load_checkpoint(root, "step_100", target_layout=layout)
        save_checkpoint(
            root,
            tag,
            loaded.model,
            loaded.optimizer,
            layout=layout,
            config=config,
            num_kept=3,
            format="xser" if tag == "step_200" else "torch",
        )
        back = load_checkpoint(root, tag, target_layout=tp2pp2, rank=(me.tp, me.pp))
        _assert_equal(back.model, original, f"rank {rank}: {tag} back at tp2pp2")
        _check(back, config, tp2pp2, state, direct, "tp2pp2", 100, f"rank {rank}: {tag} back at tp2pp2")
    dist.barrier()


# ---- a save to object storage from two "hosts" -----------------------------------------------------


def s3_host_worker(rank: int, world: int, port: int, url: str, tmp: str, env: dict[str, str]) -> None:
    """One of `world` processes, each its own host (its own host name and temporary folder, as two
    machines have): save tp2 pp1 to `url`, then load this rank's part back and compare."""
    import socket
    import tempfile

    import torch.distributed as dist

    from shardkit.checkpoint import OptimizerState, finalize_checkpoint

    os.environ.update(env)  # the loopback S3 server and its credentials
    tempfile.tempdir = tmp
    socket.gethostname = lambda: f"host-{rank}"  # type: ignore[assignment]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        config = fixture_config("tinyllama-mini")
        state = full_state(config, 100, seed=1)
        layout = Layout(tp=2, pp=1, qkv="gqa")
        me = Rank.from_global(rank, layout)
        model = rank_pieces(config, layout, me, state["weight"])
        optim = OptimizerState(rank_optimizer(config, layout, me, state, 100), [{"lr": 1e-3}])
        save_checkpoint(url, "step_100", model, optim, scheduler={"last_epoch": 100}, layout=layout, config=config)
        finalize_checkpoint()
        loaded = load_checkpoint(url, target_layout=layout)
        assert loaded is not None and loaded.tag == "step_100" and loaded.rank == me
        _assert_equal(loaded.model, model, f"rank {rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def save_all_ranks(root: str, tag: str, layout: Layout, config: dict, state: dict, step: int, **options) -> None:
    """One process saves every rank of `layout` (model and ZeRO-1 optimizer state) as `root/tag`."""
    from shardkit.checkpoint import OptimizerState

    ranks = [Rank(tp=tp, pp=pp, ep=ep) for ep, tp, pp in layout.ranks()]
    model = {(r.tp, r.pp): rank_pieces(config, layout, r, state["weight"]) for r in ranks}
    optim = {
        (r.tp, r.pp): OptimizerState(rank_optimizer(config, layout, r, state, step), [{"lr": 1e-3}]) for r in ranks
    }
    save_checkpoint(root, tag, model, optim, scheduler={"last_epoch": step}, layout=layout, config=config, **options)


def s3_save_killed_while_uploading(root: str, tag: str, step: int) -> None:
    """A save to object storage whose files go up as multipart uploads (parts of 5 MiB), saying
    UPLOADING as its first part is sent (its multipart upload created): the test kills it there."""
    import sys

    from shardkit.io.objects import s3

    s3.PART_SIZE = 5 << 20

    def part_sent(**kwargs) -> None:
        print("UPLOADING", flush=True)
        time.sleep(0.5)

    s3.client().meta.events.register("before-call.s3.UploadPart", part_sent)
    config = fixture_config("tinyllama-mini")
    save_all_ranks(root, tag, Layout(tp=2, pp=2, qkv="gqa"), config, full_state(config, step, seed=1), step)
    print("SAVED", flush=True)
    sys.exit(0)
