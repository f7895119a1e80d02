"""Helpers of the data-safety tests (tests/system/safety, tests/system/newcomer/test_cli_newcomer.py):
a tiny training checkpoint saved at a step (`save`, `pieces`, `ckpt_of_two`), snapshots and digests
of folders, folders that only look like tags, the CLI in process, and `one_line_error` (stricter than
cli_helpers': never an internal error)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import ckpt_child
from click.testing import CliRunner

from shardkit.checkpoint import (
    Checkpointer,
    Rank,
    finalize_checkpoint,
    list_checkpoints,
    save_checkpoint,
)
from shardkit.cli import cli
from shardkit.layout import Layout
from shardkit.testing import fixture_config

CONFIG = fixture_config("llama-mha")


LAYOUT = Layout()


MODEL_FILE = "model/dp_rank_00_tp_rank_00_pp_rank_00.pt"


def pieces(step: int) -> dict:
    return ckpt_child.rank_pieces(CONFIG, LAYOUT, Rank(), ckpt_child.full_state(CONFIG, step)["weight"])


def save(root: Path, step: int, checkpointer: Checkpointer | None = None, **options) -> None:
    tag = options.pop("tag", f"step_{step}")
    state = ckpt_child.full_state(CONFIG, step)
    optim = ckpt_child.rank_optimizer(CONFIG, LAYOUT, Rank(), state, step)
    args = (root, tag, pieces(step), optim)
    kwargs = dict(user_content={"step": step}, layout=LAYOUT, config=CONFIG, **options)
    if checkpointer is None:
        save_checkpoint(*args, **kwargs)
        finalize_checkpoint()  # sync saves run retention in the background
    else:
        checkpointer.save(*args, **kwargs)
        checkpointer.wait()


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (links not followed) and its bytes."""
    out = {}
    for base, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(base, d))]:
            path = Path(base) / name
            out[path.relative_to(folder).as_posix()] = (
                os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
            )
    return out


def precious_folder(path: Path, tag: Path | None = None) -> Path:
    """A folder that looks like a complete tag to a careless deleter: done, checkpoint, files (with
    `tag`: a loadable copy of that tag, so that retention counts it and may remove it)."""
    if tag is not None:
        shutil.copytree(tag, path)
    (path / "model").mkdir(parents=True, exist_ok=True)
    (path / "done").write_text("1")
    (path / "checkpoint").write_text("1")
    (path / "model" / "weights.pt").write_bytes(os.urandom(4096))
    (path / "thesis.tex").write_text("three years of work\n")
    return path


def tags(root: Path) -> list[tuple[str, bool]]:
    return [(i.tag, i.complete) for i in list_checkpoints(root)]


def run(*args):
    return CliRunner().invoke(cli, ["-q", *map(str, args)], catch_exceptions=False)


def one_line_error(result, *phrases: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("shardkit: error: ") and "internal error" not in lines[0], lines[0]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def tree_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for f in sorted(p for p in Path(path).rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(path)).encode())
        digest.update(f.read_bytes())
    return digest.hexdigest()


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".shardkit-" in p.name)


def ckpt_of_two(tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    with Checkpointer() as ck:
        save(root, 1, ck)
        save(root, 2, ck)
    return root
