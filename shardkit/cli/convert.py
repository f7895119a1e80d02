"""convert, merge and reshard: write a checkpoint in another layout or as a Hugging Face directory."""

from __future__ import annotations

import time
from collections.abc import Callable

import click

from ..conventions import CONVENTIONS
from ..errors import ShardkitError
from ..formats.registry import output_format_names
from ..io.data.digest import NONE, check_mode
from ..io.location import is_url
from ..io.store import Need, scope
from .hub import hub_check, hub_push, hub_quiet, hub_source, merge_and_push_report
from .options import (
    LOCATION,
    REPLICATION_CHOICES,
    SOURCE,
    Bar,
    build_layout,
    command_line,
    common_options,
    config_option,
    is_leader,
    kept_from_source,
    layout_options,
    max_shard_size_option,
    note,
    output_options,
    report,
    revision_option,
    source_options,
)


def format_option(help: str) -> Callable:
    return click.option(
        "--format", "fmt", type=click.Choice(output_format_names()), default="torch", show_default=True, help=help
    )


convention_option = click.option(
    "--convention",
    type=click.Choice(list(CONVENTIONS)),
    default=None,
    help="With --format dcp: whose names the tensors get. hf (default): Hugging Face's; torchtitan: torchtitan "
    "0.1-0.2's llama3 names (tok_embeddings, layers.{i}.attention.wq, output) with q and k stored as torchtitan's "
    "rotary expects (each head's halves interleaved); torchtitan-0.3: the same with 0.3's names "
    "(attention.qkv_linear.wq, lm_head; torchtitan-0.3-unfused names a model's tensors alike, it differs in a "
    "training checkpoint's optimizer state). A DCP source's convention is recognised from its names.",
)

FORMAT_HELP = (
    "torch (NxD's .pt), xser (torch-xla's, tensors in <file>.tensors/), safetensors, or dcp (a PyTorch "
    "Distributed Checkpoint folder: .metadata and one __<rank>_0.distcp per rank, each holding that rank's slices "
    "of the full tensors as DCP chunks; see --convention), or optimum-neuron (its training checkpoint: rank "
    "files under shards/ with its mp_metadata; the qkv layout must be the one it builds for tp and the model)."
)


@click.command()
@click.argument("src", type=SOURCE)  # as typed: "does not exist" names it so
@click.argument("dst", type=LOCATION)
@click.option(
    "--to-sharded/--to-hf",
    "to_sharded",
    default=True,
    show_default=True,
    help="Write shards of the given layout (default), or a Hugging Face directory (same as merge).",
)
@layout_options()
@format_option("Shard files: " + FORMAT_HELP)
@convention_option
@output_options()
@config_option
@max_shard_size_option("With --to-hf: largest safetensors file")
@revision_option
@common_options
@click.pass_context
def convert(ctx, src, dst, to_sharded, fmt, convention, write, as_json, config, max_shard_size, revision, layout_opts):
    """Convert SRC (a Hugging Face model directory, or one torch state-dict file) into shards.

    \b
    SRC: a directory with config.json and model.safetensors / model-*.safetensors + index /
    pytorch_model*.bin, or a single .pt/.bin state dict (give --config), or a Hugging Face Hub
    repo id (org/name, fetched into the HF cache). SRC and DST may be s3://bucket/prefix
    (read in the byte ranges used; uploaded, manifest last). DST gets
    model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt, config.json, tokenizer files and shardkit.json.

    \b
    Example (Llama-2-70B on 128 Trainium cores):
      shardkit convert ./Llama-2-70b-hf ./llama70b-tp32pp4 --tp 32 --pp 4 --kv-multiplier 4 --qkv gqa
    """
    from ..api import convert as api_convert
    from ..api import merge as api_merge

    started = time.perf_counter()
    src = src if is_url(src) else hub_source(ctx, src, revision)
    with Bar(ctx, "convert") as bar:
        if to_sharded:
            layout = build_layout(layout_opts)
            result = api_convert(
                src,
                dst,
                layout,
                format=fmt,
                convention=convention,
                config=config,
                progress=bar,
                command=command_line(),
                **write,
            )
        else:
            if write.pop("sha256"):
                raise ShardkitError("--sha256 only applies to shards: a Hugging Face folder (--to-hf) has no manifest")
            result = api_merge(src, dst, config=config, max_shard_size=max_shard_size, progress=bar, **write)
    report(ctx, result, started, as_json, "wrote")


@click.command()
@click.argument("src", type=SOURCE)  # as typed: "does not exist" names it so
@click.argument("dst", type=LOCATION)
@max_shard_size_option("Largest safetensors file; larger models get model-0000i-of-0000n files + index")
@source_options
@output_options(manifest=False)
@revision_option
@click.option(
    "--push-to",
    "push_to",
    metavar="REPO_ID",
    default=None,
    help="Then upload DST to this Hub repo (namespace/name), as `shardkit push DST REPO_ID` does.",
)
@click.option("--private", is_flag=True, help="With --push-to and --create: make the new repo private.")
@click.option("--create", is_flag=True, help="With --push-to: create the repo when it does not exist.")
@common_options
@click.pass_context
def merge(ctx, src, dst, max_shard_size, config, source_hints, write, as_json, revision, push_to, private, create):
    """Merge shards in SRC into a Hugging Face model directory DST.

    \b
    SRC: shardkit's shards (layout from shardkit.json) or NxD's (v1/v2/v3 file names, torch or
    xser; the layout is inferred from file names, key names, shapes and config.json -- give
    --config when the directory has none), a PyTorch DCP folder (.metadata; Hugging Face's or
    torchtitan's names), or a Hub repo id. DST loads with
    transformers.AutoModelForCausalLM.from_pretrained; --push-to REPO_ID then uploads it to the
    Hub as `shardkit push` does. SRC and DST may be s3://bucket/prefix.
    """
    from ..api import merge as api_merge

    started = time.perf_counter()
    if (private or create) and not push_to:
        raise ShardkitError("--private and --create only apply with --push-to REPO_ID")
    src = src if is_url(src) else hub_source(ctx, src, revision)
    if push_to:
        hub_check(push_to, private, create)
    with Bar(ctx, "merge") as bar:
        result = api_merge(
            src, dst, max_shard_size=max_shard_size, config=config, hints=source_hints, progress=bar, **write
        )
    if not push_to:
        report(ctx, result, started, as_json, "merged into")
    elif is_leader():  # under torchrun rank 0 uploads, once every rank has written its files
        pushed = hub_push(
            ctx,
            dst,
            push_to,
            private=private,
            create=create,
            origin=src,
            config=config,
            hints=source_hints,
        )
        merge_and_push_report(ctx, result, started, as_json, pushed)


@click.command()
@click.argument("src", type=SOURCE)  # as typed: "does not exist" names it so
@click.argument("dst", type=LOCATION)
@layout_options()
@format_option("Format of the new shards: " + FORMAT_HELP)
@convention_option
@click.option(
    "--source-kv-replication",
    type=click.Choice(REPLICATION_CHOICES),
    default=None,
    help="Replica order of NxD source shards (inferred from the data when omitted).",
)
@output_options()
@config_option
@revision_option
@common_options
@click.pass_context
def reshard(ctx, src, dst, fmt, convention, source_kv_replication, write, as_json, config, revision, layout_opts):
    """Turn shards of one layout (SRC) into another layout (DST) directly.

    Each new piece is assembled from exactly the source slices it needs; the full model is never
    written or held. SRC may be a Hub repo id (shards or a Hugging Face model); SRC and DST may be
    s3://bucket/prefix. Without --qkv
    (and without --kv-replication / --hw) the source's qkv style (and replica order) is kept.
    """
    from ..api import open_source
    from ..api import reshard as api_reshard

    started = time.perf_counter()
    hub_quiet(ctx)
    with scope():  # an s3:// source's local mirror is removed at the end
        # checked against its digests, every byte (in parts of all files at once); else its metadata,
        # then what the reshard reads (one replica of each K/V head)
        need = Need.METADATA if check_mode(write.get("verify_hashes", True)) == NONE else Need.EVERYTHING
        source = open_source(src, config, {"kv_replication": source_kv_replication}, revision, need)
        layout = build_layout(layout_opts, inherit=source.layout)
        kept = kept_from_source(layout_opts, source.layout, layout)
        if kept and is_leader():
            note(ctx, kept)
        with Bar(ctx, "reshard") as bar:
            result = api_reshard(
                source, dst, layout, format=fmt, convention=convention, progress=bar, command=command_line(), **write
            )
    report(ctx, result, started, as_json, "wrote")


COMMANDS = [convert, merge, reshard]
