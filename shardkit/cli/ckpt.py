"""`shardkit ckpt`: training checkpoints in NxD's tree (list, prune, export)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from ..errors import ShardkitError
from ..sizes import format_bytes
from .options import (
    DTYPES,
    Bar,
    common_options,
    config_option,
    max_shard_size_option,
    print_json,
    report,
)


@click.group(name="ckpt")
@common_options
def ckpt_group() -> None:
    """Training checkpoints in NxD's tree: list, prune, export.

    \b
    DIR is the checkpoint directory: DIR/<tag>/{checkpoint, model/, optim/, scheduler.pt,
    user_content.pt, done}. A tag is complete when its `done` marker exists.
    """


@ckpt_group.command(name="list")
@click.argument("directory", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the tags as JSON on stdout.")
@common_options
def ckpt_list(directory, as_json):
    """List the tags of DIR, oldest first: complete or not, step, layout, format, size."""
    from ..checkpoint import list_checkpoints

    if not directory.is_dir():
        raise ShardkitError(f"{directory} does not exist: give the checkpoint directory (the parent of the tags)")
    infos = list_checkpoints(directory)
    newest = next((i.tag for i in reversed(infos) if i.loadable), None)
    if as_json:
        print_json({"directory": str(directory), "latest": newest, "checkpoints": [i.to_dict() for i in infos]})
        return
    if not infos:
        click.echo(f"no checkpoints in {directory}")
        return
    rows = [("tag", "state", "step", "layout", "format", "size", "saved")]
    for i in infos:
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.mtime)) if i.mtime else "-"
        state = ("DAMAGED" if i.damaged else "complete" if i.complete else "INCOMPLETE") + \
            (" (latest)" if i.tag == newest else "") + (" (link)" if i.link else "")
        rows.append((i.tag, state, "-" if i.step is None else str(i.step), i.layout_text, i.format or "-",
                     format_bytes(i.size), saved))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for i in infos:
        if i.damaged:
            click.echo(f"{i.tag} is damaged: {i.problem} (skipped when resuming; never pruned)", err=True)


@ckpt_group.command(name="prune")
@click.argument("directory", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--keep", type=click.IntRange(min=1), required=True, help="Keep the newest N complete checkpoints.")
@click.option("--keep-every", type=click.IntRange(min=1), default=None,
              help="Also keep every checkpoint whose step is a multiple of K.")
@click.option("--dry-run", is_flag=True, help="Only print what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON on stdout.")
@common_options
def ckpt_prune(directory, keep, keep_every, dry_run, as_json):
    """Apply retention to DIR: keep the newest --keep complete tags (and every --keep-every-th step).

    Incomplete tags older than the newest complete one (interrupted saves or deletions) are
    removed too; the newest complete tag never is. Each tag's `done` marker goes first.
    """
    from ..checkpoint import prune_checkpoints

    plan = prune_checkpoints(directory, num_kept=keep, keep_every=keep_every, dry_run=dry_run)
    if as_json:
        print_json({**plan.to_dict(), "dry_run": dry_run})
    else:
        verb = "would remove" if dry_run else "removed"
        done = plan.remove if dry_run else plan.removed
        for tag in done:
            click.echo(f"{verb} {tag}: {plan.reasons.get(tag, '')}")
        for tag in plan.keep:
            click.echo(f"kept {tag}: {plan.reasons.get(tag, '')}")
        for tag, why in plan.failed.items():
            click.echo(f"could not remove {tag}: {why}", err=True)
    if plan.failed:
        raise ShardkitError(f"{len(plan.failed)} tags could not be removed (see above): check permissions and retry")


@ckpt_group.command(name="export")
@click.argument("directory", metavar="DIR", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--tag", default=None, help="The tag to export (default: the newest complete one).")
@max_shard_size_option("Largest safetensors file")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="Cast weights to this dtype (default: keep the checkpoint's).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists and is not empty.")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@common_options
@click.pass_context
def ckpt_export(ctx, directory, out, tag, max_shard_size, dtype, overwrite, config, as_json):
    """Merge the model of a training checkpoint (DIR/<tag>) into a Hugging Face model directory OUT.

    OUT also gets config.json, generation_config.json and tokenizer files, from the tag or from DIR.
    """
    from ..api import export_checkpoint

    started = time.perf_counter()
    with Bar(ctx, "export") as bar:
        result = export_checkpoint(directory, out, tag, max_shard_size=max_shard_size, dtype=dtype,
                                   overwrite=overwrite, config=config, progress=bar)
    report(ctx, result, started, as_json, "exported to")


COMMANDS = [ckpt_group]
