"""`shardkit plan`: per-rank training memory of a layout, or the layouts that fit (--suggest).

The command is cut by step: check the options, price one layout or search them, and print
(text or JSON)."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import ShardkitError
from ..sizes import format_bytes
from .options import SIZE_HELP, Size, common_options, degree_option, dtype_option, json_option, print_json

NOTE = "activations are not estimated: the reserve must cover them"


def check_options(suggest: bool, max_pp, all_kv_multipliers: bool, zero1: bool, dp, world_size, device_memory) -> None:
    """Options that only make sense together."""
    if not suggest:
        used = [f for f, v in (("--max-pp", max_pp), ("--all-kv-multipliers", all_kv_multipliers)) if v]
        if used:
            raise ShardkitError(f"{used[0]} only applies with --suggest")
    if zero1 and dp is None and world_size is None:
        raise ShardkitError("--zero1 shards the optimizer state over data-parallel ranks: give --dp (or --world-size)")
    if suggest and device_memory is None:
        raise ShardkitError("--suggest needs --device-memory (e.g. --device-memory 16GiB)")


def training_text(dtype: str) -> str:
    small = dtype != "fp32"
    return (
        f"{dtype} weights {2 if small else 4} B + {dtype} grads {2 if small else 4} B + "
        f"Adam {12 if small else 8} B per parameter"
        + (" (fp32 master, exp_avg, exp_avg_sq)" if small else " (exp_avg, exp_avg_sq)")
    )


def layout_text(r) -> str:
    lay = r.layout
    kv = f", kv-multiplier {lay.kv_multiplier}" if lay.kv_multiplier > 1 else ""
    return f"tp {lay.tp}, pp {lay.pp}{kv}, dp {r.dp}{' (ZeRO-1)' if r.zero1 else ''} = {r.world_size} devices"


def usable_text(r) -> str:
    return (
        f"{format_bytes(r.device_memory)} per device - reserve {format_bytes(r.reserve_bytes)} = "
        f"{format_bytes(r.usable_bytes)} usable"
    )


def why_best(r) -> str:
    """One line on why the first suggestion is the one to take."""
    lay = r.layout
    return (
        f"best:     tp {lay.tp}, pp {lay.pp}"
        + (f", kv-multiplier {lay.kv_multiplier}" if lay.kv_multiplier > 1 else "")
        + f" -- the smallest tp that fits (least tensor-parallel communication), then the fewest pipeline "
        f"stages (smallest bubble); {format_bytes(r.spare_bytes)} to spare"
    )


# ---- --suggest ---------------------------------------------------------------------------------


def print_suggestions(found, rows: list, limit: int, training: str, zero1: bool) -> None:
    shown = rows[:limit] if limit else rows
    more, redundant = len(rows) - len(shown), len(found.layouts) - len(rows)
    click.echo(f"device:   {usable_text(rows[0])}")
    click.echo(f"training: {training}" + ("; ZeRO-1: optimizer state / dp" if zero1 else ""))
    click.echo(
        f"{len(rows)} valid layouts fit, smallest tp first"
        + (f" ({redundant} more that add pipeline stages without saving memory left out)" if redundant else "")
        + ":"
    )
    click.echo(f"  {'tp':>4} {'pp':>4} {'kv-mult':>8} {'dp':>4} {'devices':>8} {'per rank':>11} {'spare':>11}")
    for r in shown:
        click.echo(
            f"  {r.layout.tp:>4} {r.layout.pp:>4} {r.layout.kv_multiplier:>8} {r.dp:>4} "
            f"{r.world_size:>8} {format_bytes(r.peak_bytes):>11} {format_bytes(r.spare_bytes):>11}"
        )
    if more:
        click.echo(f"  ... and {more} more (--limit 0 lists them all)")
    click.echo(why_best(rows[0]))


def print_no_fit(found, world_size, dp) -> None:
    if found.closest is not None:
        c = found.closest
        click.echo(
            f"no valid layout fits ({usable_text(c)}): the smallest need is "
            f"{format_bytes(c.peak_bytes)} per rank, at {layout_text(c)}"
        )
    else:
        click.echo(
            "no valid layout matches"
            + (f" --world-size {world_size}" if world_size else " the given --tp/--pp/--kv-multiplier")
            + (f" with --dp {dp}" if dp and world_size else "")
        )


def suggest(ctx, config, o: dict) -> None:
    """--suggest: the valid layouts that fit, the redundant ones left out; exit 1 when none fits."""
    from ..memory import suggest_layouts

    found = suggest_layouts(
        config,
        o["device_memory"],
        dtype=o["dtype"],
        zero1=o["zero1"],
        dp=o["dp"],
        world_size=o["world_size"],
        tp=o["tp"],
        pp=o["pp"],
        max_pp=o["max_pp"],
        kv_multiplier=o["kv_multiplier"],
        all_kv_multipliers=o["all_kv_multipliers"],
        reserve=o["reserve"],
    )
    rows = found.distinct()
    if o["as_json"]:
        shown = rows[: o["limit"]] if o["limit"] else rows
        data = found.to_dict(shown)
        data["more"] = len(rows) - len(shown)
        data["redundant"] = len(found.layouts) - len(rows)
        print_json(data)
    else:
        if rows:
            print_suggestions(found, rows, o["limit"], training_text(o["dtype"]), o["zero1"])
        else:
            print_no_fit(found, o["world_size"], o["dp"])
        for bad in found.impossible:
            click.echo(f"not possible: tp {bad['tp']}: {bad['reason']}")
        click.echo(NOTE)
    ctx.exit(0 if found.layouts else 1)


# ---- one layout --------------------------------------------------------------------------------


def derive_dp(layout, world_size, dp):
    """dp from --world-size (checked against --dp), else --dp, else 1."""
    if world_size is None:
        return dp or 1
    if world_size % (layout.tp * layout.pp) or (dp is not None and layout.tp * layout.pp * dp != world_size):
        raise ShardkitError(
            f"tp {layout.tp} x pp {layout.pp}"
            + (f" x dp {dp}" if dp is not None else " x dp")
            + f" cannot make --world-size {world_size}"
        )
    return world_size // (layout.tp * layout.pp)


def print_stages(report) -> None:
    click.echo("per rank (the largest tp rank of each stage):")
    click.echo(
        f"  {'stage':>5} {'layers':>9} {'parameters':>15} {'weights':>11} {'grads':>11} {'optimizer':>11} {'total':>11}"
    )
    for s in report.stages:
        click.echo(
            f"  {s.stage:>5} {f'{s.layers[0]}-{s.layers[1]}':>9} {s.params:>15,} "
            f"{format_bytes(s.param_bytes):>11} {format_bytes(s.grad_bytes):>11} "
            f"{format_bytes(s.optimizer_bytes):>11} {format_bytes(s.total_bytes):>11}"
        )


def print_fit(report) -> None:
    if report.fits is None:
        click.echo("device:   not given (--device-memory 16GiB checks the fit)")
    elif report.fits:
        click.echo(f"device:   {usable_text(report)}: fits, {format_bytes(report.spare_bytes)} to spare")
    else:
        click.echo(
            f"device:   {usable_text(report)}: does NOT fit, "
            f"{format_bytes(-report.spare_bytes)} short (try shardkit plan --suggest)"
        )


def print_plan(report, training: str) -> None:
    extra = report.held_parameters - report.parameters
    kind = report.family if report.family == report.model_type else f"{report.family} ({report.model_type})"
    click.echo(
        f"model:    {kind}, {report.parameters:,} parameters; its "
        f"{report.layout.tp * report.layout.pp} ranks hold {report.held_parameters:,}"
        + (f" (+{extra:,} replicated)" if extra else "")
    )
    click.echo(f"layout:   {layout_text(report)}")
    click.echo(f"training: {training}" + (f"; optimizer state / dp {report.dp}" if report.zero1 else ""))
    print_stages(report)
    peak = report.peak
    click.echo(f"peak:     {format_bytes(peak.total_bytes)} per rank ({peak.total_bytes:,} B, stage {peak.stage})")
    print_fit(report)
    click.echo(f"note:     {NOTE}")


def plan_one(ctx, config, o: dict) -> None:
    """One layout: its per-stage memory; exit 1 when it does not fit --device-memory."""
    from ..layout import Layout
    from ..memory import plan_memory

    layout = Layout(tp=o["tp"] or 1, pp=o["pp"] or 1, kv_multiplier=o["kv_multiplier"] or 1)
    dp = derive_dp(layout, o["world_size"], o["dp"])
    report = plan_memory(
        config,
        layout,
        dtype=o["dtype"],
        zero1=o["zero1"],
        dp=dp,
        device_memory=o["device_memory"],
        reserve=o["reserve"],
    )
    if o["as_json"]:
        print_json(report.to_dict())
    else:
        print_plan(report, training_text(o["dtype"]))
    ctx.exit(1 if report.fits is False else 0)


def optional_count(flag: str, help: str):
    return click.option(flag, type=click.IntRange(min=1), default=None, help=help)


# ---- the command -------------------------------------------------------------------------------


@click.command(name="plan")
@click.option(
    "--config",
    required=True,
    type=click.Path(exists=True, dir_okay=True, path_type=Path),
    help="The model's Hugging Face config.json (or its folder). No weights are read.",
)
@degree_option("tp", "Tensor-parallel degree (default 1). With --suggest: consider only this tp.", default=None)
@degree_option("pp", "Pipeline stages (default 1). With --suggest: consider only this pp.", default=None)
@degree_option(
    "kv-multiplier",
    "K/V head replicas, NxD's kv_size_multiplier (default 1). Each replica is real memory. "
    "With --suggest: only this multiplier (default: the smallest valid one for each tp).",
    nxd="--kv-size-multiplier",
    default=None,
)
@dtype_option(
    "Training dtype of the weights; gradients are counted in the same dtype. Adam keeps an fp32 "
    "master copy + exp_avg + exp_avg_sq (12 B/parameter) for bf16/fp16, exp_avg + exp_avg_sq "
    "(8 B/parameter) for fp32.",
    default="bf16",
)
@click.option(
    "--zero1", is_flag=True, help="ZeRO-1: the optimizer state (only) is sharded over the data-parallel ranks (--dp)."
)
@degree_option(
    "dp",
    "Data-parallel degree: divides the optimizer state with --zero1 (default 1, or "
    "world size / (tp x pp) with --world-size).",
    default=None,
)
@optional_count(
    "--world-size", "Devices in total: only layouts with tp x pp x dp = this (dp is derived when not given)."
)
@click.option(
    "--device-memory",
    type=Size("device memory", require_unit=True),
    default=None,
    metavar="SIZE",
    help=f"Memory of one device (one rank), with a unit ({SIZE_HELP}; a bare number is refused). "
    "Decides whether the layout fits.",
)
@click.option(
    "--reserve",
    default="10%",
    show_default=True,
    help="Device memory kept back for activations, runtime and compiler scratch, which are NOT "
    "estimated: a percentage (10%), a fraction (0.1) or a size (2GiB). Raise it for long "
    "sequences or large micro-batches.",
)
@click.option(
    "--suggest",
    is_flag=True,
    help="List the valid (tp, pp, kv-multiplier) layouts that fit --device-memory: smallest tp "
    "first, then smallest pp; layouts whose extra stages save no memory are left out. A search "
    "too large to answer in seconds is refused (exit 2): narrow it with --tp, --kv-multiplier, "
    "--max-pp or --world-size.",
)
@optional_count("--max-pp", "With --suggest: try pp up to this (default: the number of layers).")
@click.option(
    "--all-kv-multipliers",
    is_flag=True,
    help="With --suggest: also list the larger valid kv-multipliers, not only the smallest per tp.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="With --suggest: print at most this many layouts (0: all of them).",
)
@json_option("the plan (or the suggestions)")
@common_options
@click.pass_context
def plan_cmd(ctx, config, **o):
    """Per-rank training memory of a parallel layout, from config.json alone (no weights).

    \b
    For each pipeline stage, the largest of its tp ranks: parameters (replicated norms and
    kv-head replicas included), weights and gradients in --dtype, and Adam's state (fp32
    master + exp_avg + exp_avg_sq; over dp with --zero1). Activations are NOT estimated:
    --reserve keeps part of --device-memory for them.
    Exit code 0 when it fits (or no --device-memory was given), 1 when it does not (with
    --suggest: when no layout fits), 2 when the layout is impossible (the reason is printed).

    \b
    Examples:
      shardkit plan --config Llama-2-70b-hf/config.json --tp 32 --pp 4 --kv-multiplier 4 --device-memory 16GiB
      shardkit plan --config Llama-2-70b-hf --suggest --device-memory 16GiB --world-size 128 --zero1
    """
    check_options(
        o["suggest"], o["max_pp"], o["all_kv_multipliers"], o["zero1"], o["dp"], o["world_size"], o["device_memory"]
    )
    (suggest if o["suggest"] else plan_one)(ctx, config, o)


COMMANDS = [plan_cmd]
