"""`shardkit ckpt`: training checkpoints in NxD's tree (list, prune, export, inspect, reshard)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import click

from ..errors import ShardkitError
from ..sizes import format_bytes
from .options import (
    LOCATION,
    Bar,
    build_layout,
    common_options,
    config_option,
    degree_option,
    is_leader,
    json_option,
    kept_from_source,
    layout_options,
    max_shard_size_option,
    note,
    output_options,
    print_json,
    report,
)


@click.group(name="ckpt")
@common_options
def ckpt_group() -> None:
    """Training checkpoints in NxD's tree: list, prune, export, inspect, reshard.

    \b
    DIR is the checkpoint directory: DIR/<tag>/{checkpoint, model/, optim/, scheduler.pt,
    user_content.pt, done}. A tag is complete when its `done` marker exists. Every DIR, SRC, DST
    and OUT may be s3://bucket/prefix, with NxD's keys (`<tag>/model/...`, `done` last).
    inspect, export and reshard also read optimum-neuron's training checkpoints: a
    checkpoint-<step> folder (its shards/ complete: shards/done) is a tag, and the trainer's
    output directory holding them is DIR (the newest complete one, or --tag checkpoint-<step>).
    """


@ckpt_group.command(name="list")
@click.argument("directory", metavar="DIR", type=LOCATION)
@click.option("--json", "as_json", is_flag=True, help="Print the tags as JSON on stdout.")
@common_options
def ckpt_list(directory, as_json):
    """List the tags of DIR (a folder or s3://bucket/prefix), oldest first: complete or not (or
    UNLOADABLE / DAMAGED, with why on stderr), step, layout, format, size."""
    from ..checkpoint import list_checkpoints
    from ..checkpoint.tree import model_folder_kind, shown_tag

    if isinstance(directory, Path) and not directory.is_dir():
        raise ShardkitError(f"{directory} does not exist: give the checkpoint directory (the parent of the tags)")
    infos = list_checkpoints(directory)
    newest = next((i.tag for i in reversed(infos) if i.loadable), None)
    if as_json:
        print_json({"directory": str(directory), "latest": newest, "checkpoints": [i.to_dict() for i in infos]})
        return
    if not infos:
        kind = model_folder_kind(directory) if isinstance(directory, Path) else None
        hint = f" (it is a model folder, {kind}: see `shardkit inspect {directory}`)" if kind else ""
        click.echo(f"no checkpoints in {directory}{hint}")
        return
    rows = [("tag", "state", "step", "layout", "format", "size", "saved")]
    for i in infos:
        saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.mtime)) if i.mtime else "-"
        state = i.state + (" (latest)" if i.tag == newest else "") + (" (link)" if i.link else "")
        rows.append(
            (
                shown_tag(i.tag),
                state,
                "-" if i.step is None else str(i.step),
                i.layout_text,
                i.format or "-",
                format_bytes(i.size),
                saved,
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for i in infos:
        if i.damaged:
            click.echo(f"{shown_tag(i.tag)} {i.verdict} (skipped when resuming; not counted or pruned)", err=True)


@ckpt_group.command(name="prune")
@click.argument("directory", metavar="DIR", type=LOCATION)
@click.option("--keep", type=click.IntRange(min=1), required=True, help="Keep the newest N loadable checkpoints.")
@click.option(
    "--keep-every",
    type=click.IntRange(min=1),
    default=None,
    help="Also keep every checkpoint whose step is a multiple of K.",
)
@click.option("--dry-run", is_flag=True, help="Only print what would be removed.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON on stdout.")
@common_options
def ckpt_prune(directory, keep, keep_every, dry_run, as_json):
    """Apply retention to DIR: keep the newest --keep loadable tags (and every --keep-every-th step).

    Incomplete tags older than the newest loadable one (interrupted saves or deletions) are
    removed too; the newest loadable tag never is. Tags that cannot be loaded (a `done` marker
    without the checkpoint's files, a damaged manifest) are neither counted nor removed, and said
    so. Each tag's `done` marker goes first. DIR may be s3://bucket/prefix.
    """
    from ..checkpoint import prune_checkpoints
    from ..checkpoint.tree import shown_tag

    plan = prune_checkpoints(directory, num_kept=keep, keep_every=keep_every, dry_run=dry_run)
    if as_json:
        print_json({**plan.to_dict(), "dry_run": dry_run})
    else:
        verb = "would remove" if dry_run else "removed"
        done = plan.remove if dry_run else plan.removed
        for tag in done:
            click.echo(f"{verb} {shown_tag(tag)}: {plan.reasons.get(tag, '')}")
        for tag in plan.keep:
            click.echo(f"kept {shown_tag(tag)}: {plan.reasons.get(tag, '')}")
        for tag, why in plan.failed.items():
            click.echo(f"could not remove {shown_tag(tag)}: {why}", err=True)
    if plan.failed:
        raise ShardkitError(f"{len(plan.failed)} tags could not be removed (see above): check permissions and retry")


@ckpt_group.command(name="export")
@click.argument("directory", metavar="DIR", type=LOCATION)
@click.argument("out", type=LOCATION)
@click.option("--tag", default=None, help="The tag to export (default: the newest complete one).")
@click.option(
    "--merged",
    is_flag=True,
    help="For a LoRA adapter checkpoint: write the Hugging Face model of its base with the adapters merged "
    "in (W + alpha/r B A), not the PEFT adapter folder.",
)
@click.option(
    "--base",
    default=None,
    metavar="MODEL",
    help="For a LoRA adapter checkpoint: the model the adapters were trained on (a model folder of any "
    "layout, or a Hub repo id); default: the one the checkpoint records. With --merged it supplies the "
    "frozen weights; without, adapter_config.json names it as the base.",
)
@max_shard_size_option("Largest safetensors file")
@output_options("OUT", manifest=False)
@config_option
@common_options
@click.pass_context
def ckpt_export(ctx, directory, out, tag, merged, base, max_shard_size, write, as_json, config):
    """Merge the model of a training checkpoint (DIR/<tag>, or a tag folder DIR) into a Hugging Face
    model directory OUT.

    OUT also gets config.json, generation_config.json and tokenizer files, from the tag or from DIR.
    DIR and OUT may be s3://bucket/prefix (only the byte ranges the merge uses are read).
    A LoRA adapter checkpoint (the trainer's --lora-rank) becomes a PEFT adapter folder
    (adapter_config.json + adapter_model.safetensors, for peft's PeftModel.from_pretrained), or
    with --merged the merged model. An optimum-neuron checkpoint-<step> folder (or its output
    directory) exports its model; its optimizer files are not read.
    """
    from ..api import export_checkpoint

    started = time.perf_counter()
    with Bar(ctx, "export") as bar:
        result = export_checkpoint(
            directory,
            out,
            tag,
            max_shard_size=max_shard_size,
            config=config,
            merged=merged,
            base=base,
            progress=bar,
            **write,
        )
    report(ctx, result, started, as_json, "exported to")


tag_config_option = click.option(
    "--config",
    "config",
    default=None,
    type=click.Path(exists=True, path_type=Path),
    help="The model's Hugging Face config.json (needed when the tag has no config.json; NxD's carry none).",
)
param_order_option = click.option(
    "--param-order",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="A JSON list of parameter names per param group, for checkpoints whose optimizer index "
    "order cannot be recovered from the model files.",
)


@ckpt_group.command(name="reshard")
@click.argument("src", type=LOCATION)
@click.argument("dst", type=LOCATION)
@tag_config_option
@layout_options(keep_source=True)
@degree_option(
    "dp",
    "Data-parallel degree of the new layout, counted as the trainer's --dp counts it: every data-parallel "
    "rank, the expert-parallel ones carved out of them (with ZeRO-1, dp / ep optimizer shards per ep rank). "
    "Default: the source's.",
    default=None,
)
@click.option(
    "--zero1/--no-zero1",
    default=None,
    help="One optimizer shard per data-parallel rank (NxD's ZeRO-1), or one unsharded optimizer file per rank. "
    "Default: as the source was saved.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["torch", "xser", "dcp"]),
    default=None,
    help="File format of the new checkpoint (default: the source's): torch or xser (NxD's tree), or dcp (a "
    "torchtitan training checkpoint DST/step-<N>: PyTorch DCP holding the model, AdamW's state per parameter, "
    "the schedule, train state and data loader state; one data file per tp x pp rank).",
)
@click.option(
    "--convention",
    type=click.Choice(["torchtitan", "torchtitan-0.3", "torchtitan-0.3-unfused", "hf"]),
    default=None,
    help="With --format dcp: the tensor names (default torchtitan: torchtitan 0.1-0.2's llama3 names, q and k in "
    "its row order; torchtitan-0.3: 0.3's names, the optimizer state of q, k and v under the fused "
    "qkv_linear.wqkv as 0.3's llama3 configs (fuse_qkv) hold it; torchtitan-0.3-unfused: 0.3 with fuse_qkv=False; "
    "hf: Hugging Face's).",
)
@click.option("--tag", default=None, help="The tag to reshard (default: the newest complete one).")
@click.option(
    "--master-weights",
    type=click.Choice(["keep", "drop"]),
    default="keep",
    show_default=True,
    help="Carry fp32 master weights (sharded_master_weights) over, resharded, or leave them out.",
)
@param_order_option
@click.option(
    "--nxd-mode",
    type=click.Choice(["default", "avoid-lp", "zero1-dcp"]),
    default=None,
    help="How NxD would have saved the new checkpoint (default: as the source was saved). default: model and "
    "per-rank ZeRO-1 optimizer files; avoid-lp: save_checkpoint(avoid_saving_lower_precision_weights=True), xser model "
    "files without tensor data, the weights kept in the master weights (needs --format xser and master weights); "
    "zero1-dcp: use_zero1_dcp=True, the optimizer state through PyTorch DCP in optim/ (one param group, no master "
    "weights).",
)
@click.option(
    "--no-verify-hashes",
    "verify_hashes",
    flag_value=False,
    default=True,
    help="Skip checking the source tag's files against the digests its shardkit.json lists (by default "
    "every listed file is checked, and a mismatch aborts before anything is written).",
)
@common_options
@click.pass_context
def ckpt_reshard(
    ctx,
    src,
    dst,
    config,
    layout_opts,
    dp,
    zero1,
    fmt,
    convention,
    tag,
    master_weights,
    param_order,
    nxd_mode,
    verify_hashes,
):
    """Move a whole training state SRC (model, ZeRO-1 optimizer shards, master weights, scheduler,
    user content) to another layout, written as the checkpoint directory DST in NxD's format
    (or torchtitan's, --format dcp). SRC may also be a torchtitan checkpoint (a DCP folder
    step-<N>, or the folder of them: the newest, or --tag), or an optimum-neuron training
    checkpoint (a checkpoint-<step> folder, or the output directory holding them), whose
    shards/optim/ files are its optimizer state at dp 1 (a ZeRO-1 run with several data-parallel
    ranks saved one rank's shard only: refused). SRC and DST: folders or s3://bucket/prefix.
    The flags mean what the trainer's mean: a dimension not given (--tp, --pp, --vpp, --ep,
    --kv-multiplier, --dp, --zero1, --qkv, --kv-replication) is the source's, and a line says
    which were kept; --dp is the whole data-parallel degree.

    \b
    Example (tp8 pp4 dp16 -> tp32 pp2 dp8):
      shardkit ckpt reshard ./ckpts ./ckpts-tp32 --config ./llama/config.json --tp 32 --pp 2 --dp 8
    """
    from ..api import inspect_training_checkpoint, reshard_training_checkpoint
    from ..checkpoint.dcp import titan_step_dir
    from ..checkpoint.load import tag_to_read
    from ..layout import Layout

    kept: list[str | None] = []  # the line saying which dimensions were the source's

    def target(info: dict) -> Layout:
        """The layout asked for, a dimension not given being the source tag's."""
        source = Layout.from_dict(info["layout"])
        layout = build_layout(layout_opts, inherit=source)
        more = [(f"dp {info['data_parallel']}", "--dp")] if dp is None and info.get("data_parallel") else []
        if zero1 is None and info["dp"] is not None and nxd_mode != "zero1-dcp":
            more.append(("ZeRO-1" if info["zero1"] else "no ZeRO-1", "--zero1"))
        kept.append(kept_from_source(layout_opts, source, layout, more))
        return layout

    # a torchtitan checkpoint has no NxD tags; a tag in object storage is inspected by the API as it
    # reshards it (its bytes fetched once)
    titan = isinstance(src, Path) and titan_step_dir(src, tag) is not None
    local = isinstance(src, Path) and not titan
    layout: Layout | Callable[[dict], Layout] = target
    if isinstance(src, Path):
        src_dir, name = tag_to_read(src, tag, "shardkit reshard DIR DST") if local else (src, tag)
        layout = target(inspect_training_checkpoint(src_dir, name, config, param_order))
    out = reshard_training_checkpoint(
        src,
        dst,
        layout,
        dp=dp,
        zero1=zero1,
        config=config,
        tag=tag,
        format=fmt,
        master_weights=master_weights,
        param_order=param_order,
        verify_hashes=verify_hashes,
        nxd_mode=nxd_mode,
        convention=convention,
    )
    if kept and kept[0] and is_leader():  # said once it is done: bad input stays one line
        note(ctx, kept[0])
    click.echo(f"wrote {out}")


@ckpt_group.command(name="inspect")
@click.argument("directory", metavar="DIR", type=LOCATION)
@click.option("--tag", default=None, help="The tag (default: the newest complete one, or DIR itself).")
@tag_config_option
@param_order_option
@json_option()
@common_options
def ckpt_inspect(directory, tag, config, param_order, as_json):
    """Layout (tp, pp, dp, ZeRO-1), param groups, step, master weights and optimizer bytes of a tag
    (DIR: a folder or s3://bucket/prefix)."""
    from ..api import inspect_training_checkpoint

    info = inspect_training_checkpoint(directory, tag, config, param_order)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    total, ep = info.get("data_parallel"), info["layout"].get("ep", 1)
    if info["dp"] is None:
        optimizer = "no optimizer files"
    elif info["zero1"]:  # dp counted as the trainer counts it; info["dp"]: the shards per ep rank
        shards = f", {info['dp']} shards per ep rank" if ep > 1 else ""
        optimizer = f"dp {total} (ZeRO-1{shards})"
    else:
        optimizer = f"{f'dp {total}, ' if total else ''}no ZeRO-1 (one optimizer file per rank)"
    click.echo(
        f"{info['path']}: {info['describe']}, {optimizer}, {info['format']}, step {number(info['step'])}, "
        f"master weights {'yes' if info['master_weights'] else 'no'}, optimizer {format_bytes(info['optimizer_bytes'])}, "
        + (
            f"saved as NxD's {info['nxd_mode']}"
            if info["nxd_mode"]
            else f"a torchtitan checkpoint ({info['convention']} names)"
        )
    )
    if info.get("lora"):
        click.echo(f"  {lora_line(info['lora'])}")
    for g, group in enumerate(info["param_groups"]):
        hyper = ", ".join(f"{k}={number(v)}" for k, v in group["hyper"].items())
        click.echo(f"  group {g}: {len(group['parameters_on_tp0_pp0'])} parameters on tp0 pp0; {hyper}")


def number(value: object) -> str:
    """A number as people write it: 3e-05 for 2.9999999999999997e-05, 20 for 20.0 (ten significant
    digits hide the float's last bit; lists and tuples item by item)."""
    if isinstance(value, float):
        return f"{value:.10g}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(number(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return str(value)


def lora_line(lora: dict) -> str:
    """An adapter checkpoint's adapters in one line: rank, alpha, targets and the base model."""
    base = (
        f"{lora['base_model_type']} model {lora['base_model']}"
        if lora.get("base_model")
        else (f"a {lora['base_model_type']} model (not recorded where: give ckpt export --base)")
    )
    return (
        f"LoRA adapters: rank {lora['rank']}, alpha {lora['alpha']:g}, targets {','.join(lora['targets'])} "
        f"({lora['trained_parameters'] / 1e6:.3f}M parameters), trained on the {base}"
    )


COMMANDS = [ckpt_group]
