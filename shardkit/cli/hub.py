"""`shardkit push`, and the Hub helpers the other commands share (sources, checks, upload)."""

from __future__ import annotations

from pathlib import Path

import click

from ..sizes import format_bytes
from .options import (
    Bar,
    command_line,
    common_options,
    dtype_option,
    json_option,
    max_shard_size_option,
    print_json,
    quiet,
    report,
    result_dict,
    show_progress,
    source_options,
    workers_option,
)


def hub_quiet(ctx: click.Context) -> None:
    """huggingface_hub's own bars follow ours: hidden with -q / --no-progress / no terminal."""
    if not show_progress(ctx):
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def hub_source(ctx: click.Context, src: Path, revision: str | None) -> Path:
    """SRC as given, or the Hub repo SRC fetched into the Hugging Face cache. A local-looking
    path that does not exist (./x, ../x, /x, ~/x, or runs/x beside a local runs/) is an error,
    never a Hub lookup (hub.download.missing_local_path)."""
    from ..hub import resolve_source

    hub_quiet(ctx)
    return resolve_source(str(src), revision=revision)


def hub_check(repo_id: str, private: bool, create: bool) -> None:
    """Fail before any work when REPO_ID cannot be pushed to (no token, missing repo without --create)."""
    from ..hub import check_repo

    check_repo(repo_id, private=private, create=create, dry_run=True)


def hub_push(ctx: click.Context, src: Path, repo_id: str, **options) -> dict:
    from ..hub import push as api_push

    hub_quiet(ctx)
    with Bar(ctx, "push") as bar:
        return api_push(src, repo_id, progress=bar, command=command_line(), **options)


def push_line(pushed: dict) -> str:
    where = pushed["pr_url"] or pushed["commit_url"] or pushed["url"]
    return (
        f"pushed to {pushed['repo_id']} ({pushed['revision']}): {pushed['files']} files, "
        f"{format_bytes(pushed['bytes'])}" + (", model card generated" if pushed["model_card"] else "") + f" -- {where}"
    )


def merge_and_push_report(ctx: click.Context, result, started: float, as_json: bool, pushed: dict) -> None:
    if as_json:
        print_json({**result_dict(result, started), "push": pushed})
    else:
        report(ctx, result, started, False, "merged into")
        if not quiet(ctx):
            click.echo(push_line(pushed))


@click.command(name="push")
@click.argument("src", type=click.Path())  # as typed: "does not exist" names it so
@click.argument("repo_id")
@click.option(
    "--private",
    is_flag=True,
    help="Make the repo private when --create creates it (an existing repo keeps its visibility).",
)
@click.option("--create", is_flag=True, help="Create REPO_ID on the Hub when it does not exist yet.")
@click.option(
    "--revision",
    default=None,
    help="Branch to commit to, created from the default branch when missing (default: main).",
)
@click.option("--commit-message", default=None, help="Message of the commit (default: 'Upload <SRC> with shardkit').")
@click.option(
    "--create-pr", is_flag=True, help="Open a pull request against the default branch instead of committing to it."
)
@max_shard_size_option("When SRC is merged first: largest safetensors file")
@dtype_option("When SRC is merged first: cast weights to this dtype (default: keep the source's).")
@workers_option("When SRC is merged first: ")
@click.option(
    "--tmp-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where a merged copy is staged before the upload (default: the system temp folder); it needs "
    "room for the whole model.",
)
@source_options
@json_option("what was pushed")
@common_options
@click.pass_context
def push_cmd(
    ctx,
    src,
    repo_id,
    private,
    create,
    revision,
    commit_message,
    create_pr,
    max_shard_size,
    dtype,
    workers,
    tmp_dir,
    config,
    source_hints,
    as_json,
):
    """Upload SRC to the Hugging Face Hub model repo REPO_ID (namespace/name).

    \b
    SRC: a Hugging Face model directory (uploaded as it is), or shards, NxD shards or a training
    checkpoint tag (merged first, streaming, into a temporary folder). A README.md model card is
    added when SRC has none: base model, the layout it was trained in, this command, tensor count
    and size. The token comes from HF_TOKEN (or `hf auth login`) and needs write access; it is
    never printed. HF_ENDPOINT selects the Hub. Network failures are retried; a push that still
    fails resumes when run again (files already uploaded are skipped).

    \b
    Example:
      shardkit push ./llama-tp8pp2 my-org/llama-7b-finetuned --create --private
    """
    pushed = hub_push(
        ctx,
        src,
        repo_id,
        private=private,
        create=create,
        revision=revision,
        commit_message=commit_message,
        create_pr=create_pr,
        max_shard_size=max_shard_size,
        dtype=dtype,
        workers=workers,
        tmp_dir=tmp_dir,
        config=config,
        hints=source_hints,
    )
    if as_json:
        print_json(pushed)
    elif not quiet(ctx):
        click.echo(push_line(pushed))


COMMANDS = [push_cmd]
