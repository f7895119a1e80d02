"""The `shardkit` command: a thin click shell over the library (parse, call, print).

Errors in the user's input print one line and exit with code 2; nothing is left half-written.
`--debug` shows tracebacks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from .formats.registry import format_names
from .version import __version__
from .errors import ShardkitError

log = logging.getLogger("shardkit")


class _Command(click.Group):
    """Turns library errors into one line on stderr and exit code 2 (tracebacks with --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ShardkitError as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"shardkit: error: {e}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            click.echo("shardkit: interrupted; nothing was left behind", err=True)
            ctx.exit(130)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except Exception as e:  # an unexpected failure: still one line unless --debug
            if ctx.obj and ctx.obj.get("debug"):
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            click.echo(f"shardkit: internal error: {type(e).__name__}: {first} (rerun with --debug for details)", err=True)
            ctx.exit(1)


@click.group(cls=_Command, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="shardkit")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars or notes; errors only.")
@click.option("-v", "--verbose", is_flag=True, help="Log what shardkit does (INFO level).")
@click.pass_context
def cli(ctx: click.Context, debug: bool, quiet: bool, verbose: bool) -> None:
    """Move LLM weights between Hugging Face checkpoints and tensor/pipeline-parallel shards.

    \b
    Shards follow neuronx-distributed's conventions (model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt).
    Typical round trip:
      shardkit convert ./Llama-2-7b-hf ./llama-tp8pp2 --to-sharded --tp 8 --pp 2 --qkv gqa
      shardkit merge ./llama-tp8pp2 ./llama-merged
      shardkit verify ./Llama-2-7b-hf ./llama-merged
    """
    ctx.obj = {"debug": debug, "quiet": quiet}
    level = logging.DEBUG if debug else logging.INFO if verbose else logging.WARNING
    logging.basicConfig(level=level, format="shardkit: %(message)s", stream=sys.stderr)


# ---- shared options ---------------------------------------------------------------------------


def layout_options(func):
    """--tp/--pp/--kv-multiplier/--kv-replication/--hw/--qkv (+ NxD's spellings)."""
    options = [
        click.option("--tp", "--tp-size", "tp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Tensor-parallel degree: heads, MLP columns and vocabulary are split over this many ranks."),
        click.option("--pp", "--pp-size", "pp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Pipeline stages: decoder layers split evenly, the remainder to the last stages."),
        click.option("--ep", "--ep-size", "ep", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Expert-parallel degree (mixture-of-experts models): experts split over this many ranks; "
                          "file names then carry ep_rank (NxD v3)."),
        click.option("--kv-multiplier", "--kv-size-multiplier", "kv_multiplier", type=click.IntRange(min=1), default=1,
                     show_default=True,
                     help="Replicate K/V heads this many times so that kv heads x multiplier is a multiple of tp "
                          "(NxD's kv_size_multiplier)."),
        click.option("--kv-replication", type=click.Choice(["interleaved", "blocked"]), default=None,
                     help="Order of K/V replicas: interleaved (Trn1, tensor.repeat) or blocked (Trn2, "
                          "repeat_interleave). Default interleaved."),
        click.option("--hw", type=click.Choice(["trn1", "trn2"]), default=None,
                     help="Alias for the replication order: trn1 = interleaved, trn2 = blocked."),
        click.option("--qkv", type=click.Choice(["separate", "gqa", "fused", "coalesced"]), default=None,
                     help="How q/k/v are stored: separate q_proj/k_proj/v_proj; gqa = NxD's GQA layer "
                          "(qkv_proj.weight_q/_k/_v); fused = qkv_proj.weight_qkv; coalesced = qkv_proj.weight. "
                          "Default separate."),
        click.option("--qkv-linear", is_flag=True, help="NxD spelling of --qkv gqa."),
        click.option("--fuse-qkv", is_flag=True, help="NxD spelling of --qkv fused (with --qkv-linear)."),
        click.option("--coalesce-qkv", is_flag=True, help="NxD spelling of --qkv coalesced."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _qkv_style(qkv: str | None, qkv_linear: bool, fuse_qkv: bool, coalesce_qkv: bool) -> str | None:
    aliases = [s for s, on in (("fused", fuse_qkv), ("coalesced", coalesce_qkv)) if on]
    if not aliases and qkv_linear:
        aliases = ["gqa"]
    if len(aliases) > 1:
        raise ShardkitError("--fuse-qkv and --coalesce-qkv exclude each other: choose one qkv style")
    if aliases and qkv and qkv != aliases[0]:
        raise ShardkitError(f"--qkv {qkv} contradicts the NxD flag for {aliases[0]}: give one of them")
    return qkv or (aliases[0] if aliases else None)


def _layout(o: dict):
    from .layout import make_layout

    qkv = _qkv_style(o.pop("qkv"), o.pop("qkv_linear"), o.pop("fuse_qkv"), o.pop("coalesce_qkv"))
    return make_layout(tp=o.pop("tp"), pp=o.pop("pp"), ep=o.pop("ep"), kv_multiplier=o.pop("kv_multiplier"),
                       kv_replication=o.pop("kv_replication"), hw=o.pop("hw"), qkv=qkv or "separate")


def _hints(o: dict) -> dict:
    """Layout facts for reading NxD shards whose layout cannot be fully inferred."""
    from .layout import HW_TO_REPLICATION

    replication = o.pop("kv_replication", None) or (HW_TO_REPLICATION[o["hw"]] if o.get("hw") else None)
    o.pop("hw", None)
    return {"kv_replication": replication}


config_option = click.option(
    "--config", type=click.Path(exists=True, dir_okay=True, path_type=Path), default=None,
    help="The model's Hugging Face config.json (or its folder). Needed for NxD shards saved without one.")
source_replication = [
    click.option("--kv-replication", type=click.Choice(["interleaved", "blocked"]), default=None,
                 help="Replica order of NxD source shards with kv-multiplier > 1 (inferred from the data when omitted)."),
    click.option("--hw", type=click.Choice(["trn1", "trn2"]), default=None,
                 help="Alias: trn1 = interleaved, trn2 = blocked (for the source shards)."),
]


def _source_options(func):
    for option in reversed([config_option, *source_replication]):
        func = option(func)
    return func


def output_options(func):
    options = [
        click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
                     help="Cast weights to this dtype (default: keep the source's)."),
        click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Output files built in parallel (threads). Memory grows with each worker."),
        click.option("--overwrite", is_flag=True, help="Replace DST if it exists and is not empty."),
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


class _Bar:
    """A tqdm bar (bytes) on stderr fed by the library's progress callback."""

    def __init__(self, desc: str, quiet: bool):
        self.desc, self.quiet, self.bar, self.last = desc, quiet, None, 0

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, dynamic_ncols=True)
        self.bar.update(done - self.last)
        self.last = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _report(ctx: click.Context, result, started: float, as_json: bool, verb: str) -> None:
    if os.environ.get("RANK", "0") != "0":
        return  # under torchrun only rank 0 reports
    data = {"path": str(result.path), "format": result.format, "layout": result.layout.to_dict(),
            "files": len(result.files), "bytes": result.bytes, "seconds": round(time.perf_counter() - started, 3)}
    if as_json:
        click.echo(json.dumps(data, indent=2))
    elif not ctx.obj["quiet"]:
        click.echo(f"{verb} {result.path}: {data['files']} files, {result.bytes / 2**20:.1f} MiB in {data['seconds']} s")


def _command_line() -> str:
    return " ".join(["shardkit"] + sys.argv[1:])


# ---- commands ----------------------------------------------------------------------------------


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--to-sharded/--to-hf", "to_sharded", default=True, show_default=True,
              help="Write shards of the given layout (default), or a Hugging Face directory (same as merge).")
@layout_options
@click.option("--format", "fmt", type=click.Choice(format_names()), default="torch", show_default=True,
              help="Shard files: torch (NxD's .pt), xser (torch-xla's, tensors in <file>.tensors/), or safetensors.")
@output_options
@config_option
@click.option("--max-shard-size", default="5GB", show_default=True, help="With --to-hf: largest safetensors file.")
@click.option("--revision", default=None, help="When SRC is a Hub repo id: the branch, tag or commit to download.")
@click.pass_context
def convert(ctx, src, dst, to_sharded, fmt, dtype, workers, overwrite, as_json, config, max_shard_size, revision,
            **layout_opts):
    """Convert SRC (a Hugging Face model directory, or one torch state-dict file) into shards.

    \b
    SRC: a directory with config.json and model.safetensors / model-*.safetensors + index /
    pytorch_model*.bin, or a single .pt/.bin state dict (give --config), or a Hugging Face Hub
    repo id (org/name, fetched into the HF cache). DST gets
    model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt, config.json, tokenizer files and shardkit.json.

    \b
    Example (Llama-2-70B on 128 Trainium cores):
      shardkit convert ./Llama-2-70b-hf ./llama70b-tp32pp4 --tp 32 --pp 4 --kv-multiplier 4 --qkv gqa
    """
    from .api import convert as api_convert
    from .api import merge as api_merge

    started = time.perf_counter()
    src = _hub_source(ctx, src, revision)
    bar = _Bar("convert", ctx.obj["quiet"])
    try:
        if to_sharded:
            layout = _layout(layout_opts)
            result = api_convert(src, dst, layout, format=fmt, dtype=dtype, workers=workers, overwrite=overwrite,
                                 config=config, progress=bar, command=_command_line())
        else:
            result = api_merge(src, dst, dtype=dtype, workers=workers, overwrite=overwrite, config=config,
                               max_shard_size=max_shard_size, progress=bar)
    finally:
        bar.close()
    _report(ctx, result, started, as_json, "wrote")


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="Largest safetensors file (e.g. 5GB, 500MB); larger models get model-0000i-of-0000n files + index.")
@_source_options
@output_options
@click.option("--revision", default=None, help="When SRC is a Hub repo id: the branch, tag or commit to download.")
@click.option("--push-to", "push_to", metavar="REPO_ID", default=None,
              help="Then upload DST to this Hub repo (namespace/name), as `shardkit push DST REPO_ID` does.")
@click.option("--private", is_flag=True, help="With --push-to and --create: make the new repo private.")
@click.option("--create", is_flag=True, help="With --push-to: create the repo when it does not exist.")
@click.pass_context
def merge(ctx, src, dst, max_shard_size, config, kv_replication, hw, dtype, workers, overwrite, as_json, revision,
          push_to, private, create):
    """Merge shards in SRC into a Hugging Face model directory DST.

    \b
    SRC: shardkit's shards (layout from shardkit.json) or NxD's (v1/v2/v3 file names, torch or
    xser; the layout is inferred from file names, key names, shapes and config.json -- give
    --config when the directory has none), or a Hub repo id. DST loads with
    transformers.AutoModelForCausalLM.from_pretrained; --push-to REPO_ID then uploads it to the
    Hub as `shardkit push` does.
    """
    from .api import merge as api_merge

    started = time.perf_counter()
    if (private or create) and not push_to:
        raise ShardkitError("--private and --create only apply with --push-to REPO_ID")
    src = _hub_source(ctx, src, revision)
    if push_to:
        _hub_check(push_to, private, create)
    bar = _Bar("merge", ctx.obj["quiet"])
    try:
        result = api_merge(src, dst, max_shard_size=max_shard_size, dtype=dtype, workers=workers, overwrite=overwrite,
                           config=config, hints=_hints({"kv_replication": kv_replication, "hw": hw}), progress=bar)
    finally:
        bar.close()
    if push_to:
        if os.environ.get("RANK", "0") != "0":
            return  # under torchrun rank 0 uploads, once every rank has written its files
        _merge_and_push_report(ctx, result, started, as_json, _hub_push(
            ctx, dst, push_to, private=private, create=create, origin=src, config=config,
            hints=_hints({"kv_replication": kv_replication, "hw": hw})))
        return
    _report(ctx, result, started, as_json, "merged into")


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@layout_options
@click.option("--format", "fmt", type=click.Choice(format_names()), default="torch", show_default=True,
              help="Format of the new shards.")
@click.option("--source-kv-replication", type=click.Choice(["interleaved", "blocked"]), default=None,
              help="Replica order of NxD source shards (inferred from the data when omitted).")
@output_options
@config_option
@click.option("--revision", default=None, help="When SRC is a Hub repo id: the branch, tag or commit to download.")
@click.pass_context
def reshard(ctx, src, dst, fmt, source_kv_replication, dtype, workers, overwrite, as_json, config, revision,
            **layout_opts):
    """Turn shards of one layout (SRC) into another layout (DST) directly.

    Each new piece is assembled from exactly the source slices it needs; the full model is never
    written or held. SRC may be a Hub repo id (shards or a Hugging Face model).
    """
    from .api import reshard as api_reshard

    started = time.perf_counter()
    _hub_quiet(ctx)
    bar = _Bar("reshard", ctx.obj["quiet"])
    try:
        result = api_reshard(src, dst, _layout(layout_opts), format=fmt, dtype=dtype, workers=workers,
                             overwrite=overwrite, config=config, hints={"kv_replication": source_kv_replication},
                             progress=bar, command=_command_line(), revision=revision)
    finally:
        bar.close()
    _report(ctx, result, started, as_json, "wrote")


@cli.command(name="inspect")
@click.argument("path", type=click.Path(path_type=Path))
@_source_options
@click.option("--check-data", is_flag=True,
              help="Also re-hash files against shardkit.json and check that all replicated copies agree (reads everything).")
@click.option("--tensors", "show_tensors", is_flag=True, help="List every full tensor with its shape.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--revision", default=None, help="When PATH is a Hub repo id: the branch, tag or commit to download.")
@click.pass_context
def inspect_cmd(ctx, path, config, kv_replication, hw, check_data, show_tensors, as_json, revision):
    """Explain a checkpoint directory: format, model, layout, stages, size and problems.

    PATH may also be a Hub repo id (its weights, config and tokenizer files are fetched).
    Exit code 0 when no problem was found, 1 when problems were found, 2 when PATH cannot be read.
    """
    from .api import inspect as api_inspect

    _hub_quiet(ctx)
    report = api_inspect(path, config, _hints({"kv_replication": kv_replication, "hw": hw}), check_data, revision)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(_describe(report, show_tensors))
    ctx.exit(1 if report["problems"] else 0)


def _describe(r: dict, show_tensors: bool) -> str:
    m, lay = r["model"], r["layout"]
    kind = {"hf": "a Hugging Face checkpoint (full tensors)", "sharded": "sharded weights"}[r["kind"]]
    lines = [f"{r['path']}: {kind}, {r['format']} format" + (f" ({r['naming']} file names)" if r["kind"] == "sharded" else "")]
    lines.append(f"  model:   {r['family']} ({m['model_type']}), {m['parameters'] / 1e6:.2f}M parameters, {m['layers']} layers, "
                 f"hidden {m['hidden_size']}, {m['heads']} heads / {m['kv_heads']} kv heads of dim {m['head_dim']}, "
                 f"vocab {m['vocab_size']}" + (", tied embeddings" if m["tied_embeddings"] else ""))
    if r["kind"] == "sharded":
        kv = (f", kv heads x{lay['kv_multiplier']} ({lay['kv_replication']})" if lay["kv_multiplier"] > 1 else "")
        lines.append(f"  layout:  tp {lay['tp']}, pp {lay['pp']}" + (f", ep {lay['ep']}" if lay["ep"] > 1 else "")
                     + f", qkv {lay['qkv']}{kv} -- {r['layout_from']}")
        stages = ", ".join(f"{s['stage']}: {s['layers'][0]}-{s['layers'][1]}" for s in r["stages"])
        lines.append(f"  stages:  layers per stage {stages}")
    lines.append(f"  files:   {r['files']} ({r['bytes'] / 2**20:.1f} MiB), dtype {r['dtype']}")
    if show_tensors:
        lines += [f"    {n} {tuple(s)}" for n, s in r["tensors"].items()]
    if r["problems"]:
        lines.append("  problems:")
        lines += [f"    - {p}" for p in r["problems"]]
    else:
        lines.append("  problems: none found")
    return "\n".join(lines)


@cli.command()
@click.argument("a", type=click.Path(path_type=Path))
@click.argument("b", type=click.Path(path_type=Path))
@click.option("--config-a", type=click.Path(exists=True, path_type=Path), default=None, help="config.json for A (NxD shards without one).")
@click.option("--config-b", type=click.Path(exists=True, path_type=Path), default=None, help="config.json for B.")
@click.option("--atol", type=float, default=0.0, show_default=True,
              help="Largest absolute difference still counted as equal (0: bit-exact).")
@click.option("--all", "show_all", is_flag=True, help="Print every tensor, not only mismatches.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-tensor report as JSON.")
@click.option("--revision-a", default=None, help="When A is a Hub repo id: the branch, tag or commit to download.")
@click.option("--revision-b", default=None, help="When B is a Hub repo id: the branch, tag or commit to download.")
@click.pass_context
def verify(ctx, a, b, config_a, config_b, atol, show_all, as_json, revision_a, revision_b):
    """Check that A and B hold the same weights, whatever their formats and layouts.

    Both are mapped to full tensors and compared one by one; the worst absolute difference of
    each tensor is printed. Exit code 0 when all are equal, 1 on any mismatch. A or B may be a
    Hub repo id, e.g. `shardkit verify meta-llama/Llama-2-7b-hf ./llama-tp8`.
    """
    from .api import verify as api_verify

    _hub_quiet(ctx)
    report = api_verify(a, b, config_a=config_a, config_b=config_b, atol=atol, revision_a=revision_a,
                        revision_b=revision_b)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        for t in report.tensors:
            if show_all or not t.equal:
                diff = "n/a" if t.max_abs_diff is None else f"{t.max_abs_diff:.3g}"
                click.echo(f"{'ok      ' if t.equal else 'MISMATCH'} {t.name}  max|a-b| {diff}" + (f"  ({t.note})" if t.note else ""))
        verdict = "equal" if report.ok else f"{len(report.mismatches)} of {len(report.tensors)} tensors differ"
        click.echo(f"{len(report.tensors)} tensors compared: {verdict}")
    ctx.exit(0 if report.ok else 1)


@cli.command(name="plan")
@click.option("--config", required=True, type=click.Path(exists=True, dir_okay=True, path_type=Path),
              help="The model's Hugging Face config.json (or its folder). No weights are read.")
@click.option("--tp", "--tp-size", "tp", type=click.IntRange(min=1), default=None,
              help="Tensor-parallel degree (default 1). With --suggest: consider only this tp.")
@click.option("--pp", "--pp-size", "pp", type=click.IntRange(min=1), default=None,
              help="Pipeline stages (default 1). With --suggest: consider only this pp.")
@click.option("--kv-multiplier", "--kv-size-multiplier", "kv_multiplier", type=click.IntRange(min=1), default=None,
              help="K/V head replicas, NxD's kv_size_multiplier (default 1). Each replica is real memory. "
                   "With --suggest: only this multiplier (default: the smallest valid one for each tp).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Training dtype of the weights; gradients are counted in the same dtype. Adam keeps an fp32 "
                   "master copy + exp_avg + exp_avg_sq (12 B/parameter) for bf16/fp16, exp_avg + exp_avg_sq "
                   "(8 B/parameter) for fp32.")
@click.option("--zero1", is_flag=True,
              help="ZeRO-1: the optimizer state (only) is sharded over the data-parallel ranks (--dp).")
@click.option("--dp", "--dp-size", "dp", type=click.IntRange(min=1), default=None,
              help="Data-parallel degree: divides the optimizer state with --zero1 (default 1, or "
                   "world size / (tp x pp) with --world-size).")
@click.option("--world-size", type=click.IntRange(min=1), default=None,
              help="Devices in total: only layouts with tp x pp x dp = this (dp is derived when not given).")
@click.option("--device-memory", default=None,
              help="Memory of one device (one rank): 16GiB = 16 x 2**30, 16GB = 16 x 10**9, 32G = 32GiB. "
                   "Decides whether the layout fits.")
@click.option("--reserve", default="10%", show_default=True,
              help="Device memory kept back for activations, runtime and compiler scratch, which are NOT "
                   "estimated: a percentage (10%), a fraction (0.1) or a size (2GiB). Raise it for long "
                   "sequences or large micro-batches.")
@click.option("--suggest", is_flag=True,
              help="List the valid (tp, pp, kv-multiplier) layouts that fit --device-memory: smallest tp "
                   "first, then smallest pp.")
@click.option("--max-pp", type=click.IntRange(min=1), default=None,
              help="With --suggest: try pp up to this (default: the number of layers).")
@click.option("--all-kv-multipliers", is_flag=True,
              help="With --suggest: also list the larger valid kv-multipliers, not only the smallest per tp.")
@click.option("--limit", type=click.IntRange(min=0), default=20, show_default=True,
              help="With --suggest: print at most this many layouts (0: all of them).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan (or the suggestions) as JSON on stdout.")
@click.pass_context
def plan_cmd(ctx, config, tp, pp, kv_multiplier, dtype, zero1, dp, world_size, device_memory, reserve, suggest,
             max_pp, all_kv_multipliers, limit, as_json):
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
    from .layout import Layout
    from .memory import plan_memory, suggest_layouts
    from .sizes import format_bytes

    if not suggest:
        used = [f for f, v in (("--max-pp", max_pp), ("--all-kv-multipliers", all_kv_multipliers)) if v]
        if used:
            raise ShardkitError(f"{used[0]} only applies with --suggest")
    if zero1 and dp is None and world_size is None:
        raise ShardkitError("--zero1 shards the optimizer state over data-parallel ranks: give --dp (or --world-size)")
    training = (f"{dtype} weights {4 if dtype == 'fp32' else 2} B + {dtype} grads {4 if dtype == 'fp32' else 2} B + "
                f"Adam {8 if dtype == 'fp32' else 12} B per parameter"
                + (" (exp_avg, exp_avg_sq)" if dtype == "fp32" else " (fp32 master, exp_avg, exp_avg_sq)"))
    note = "activations are not estimated: the reserve must cover them"

    def layout_text(r) -> str:
        lay = r.layout
        kv = f", kv-multiplier {lay.kv_multiplier}" if lay.kv_multiplier > 1 else ""
        return f"tp {lay.tp}, pp {lay.pp}{kv}, dp {r.dp}{' (ZeRO-1)' if r.zero1 else ''} = {r.world_size} devices"

    def usable_text(r) -> str:
        return (f"{format_bytes(r.device_memory)} per device - reserve {format_bytes(r.reserve_bytes)} = "
                f"{format_bytes(r.usable_bytes)} usable")

    if suggest:
        if device_memory is None:
            raise ShardkitError("--suggest needs --device-memory (e.g. --device-memory 16GiB)")
        found = suggest_layouts(config, device_memory, dtype=dtype, zero1=zero1, dp=dp, world_size=world_size,
                                tp=tp, pp=pp, max_pp=max_pp, kv_multiplier=kv_multiplier,
                                all_kv_multipliers=all_kv_multipliers, reserve=reserve)
        shown = found.layouts[:limit] if limit else found.layouts
        more = len(found.layouts) - len(shown)
        if as_json:
            data = found.to_dict()
            data["layouts"] = data["layouts"][:len(shown)]
            data["more"] = more
            click.echo(json.dumps(data, indent=2))
        else:
            if found.layouts:
                first = found.layouts[0]
                click.echo(f"device:   {usable_text(first)}")
                click.echo(f"training: {training}" + ("; ZeRO-1: optimizer state / dp" if zero1 else ""))
                click.echo(f"{len(found.layouts)} valid layouts fit, smallest tp first:")
                click.echo(f"  {'tp':>4} {'pp':>4} {'kv-mult':>8} {'dp':>4} {'devices':>8} {'per rank':>11} {'spare':>11}")
                for r in shown:
                    click.echo(f"  {r.layout.tp:>4} {r.layout.pp:>4} {r.layout.kv_multiplier:>8} {r.dp:>4} "
                               f"{r.world_size:>8} {format_bytes(r.peak_bytes):>11} {format_bytes(r.spare_bytes):>11}")
                if more:
                    click.echo(f"  ... and {more} more (--limit 0 lists them all)")
            elif found.closest is not None:
                c = found.closest
                click.echo(f"no valid layout fits ({usable_text(c)}): the smallest need is "
                           f"{format_bytes(c.peak_bytes)} per rank, at {layout_text(c)}")
            else:
                click.echo("no valid layout matches"
                           + (f" --world-size {world_size}" if world_size else " the given --tp/--pp/--kv-multiplier")
                           + (f" with --dp {dp}" if dp and world_size else ""))
            for bad in found.impossible:
                click.echo(f"not possible: tp {bad['tp']}: {bad['reason']}")
            click.echo(note)
        ctx.exit(0 if found.layouts else 1)

    layout = Layout(tp=tp or 1, pp=pp or 1, kv_multiplier=kv_multiplier or 1)
    if world_size is not None:
        if world_size % (layout.tp * layout.pp) or (dp is not None and layout.tp * layout.pp * dp != world_size):
            raise ShardkitError(f"tp {layout.tp} x pp {layout.pp}" + (f" x dp {dp}" if dp is not None else " x dp")
                                + f" cannot make --world-size {world_size}")
        dp = world_size // (layout.tp * layout.pp)
    report = plan_memory(config, layout, dtype=dtype, zero1=zero1, dp=dp or 1, device_memory=device_memory,
                         reserve=reserve)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        extra = report.held_parameters - report.parameters
        kind = report.family if report.family == report.model_type else f"{report.family} ({report.model_type})"
        click.echo(f"model:    {kind}, {report.parameters:,} parameters; its "
                   f"{report.layout.tp * report.layout.pp} ranks hold {report.held_parameters:,}"
                   + (f" (+{extra:,} replicated)" if extra else ""))
        click.echo(f"layout:   {layout_text(report)}")
        click.echo(f"training: {training}" + (f"; optimizer state / dp {report.dp}" if report.zero1 else ""))
        click.echo("per rank (the largest tp rank of each stage):")
        click.echo(f"  {'stage':>5} {'layers':>9} {'parameters':>15} {'weights':>11} {'grads':>11} "
                   f"{'optimizer':>11} {'total':>11}")
        for s in report.stages:
            click.echo(f"  {s.stage:>5} {f'{s.layers[0]}-{s.layers[1]}':>9} {s.params:>15,} "
                       f"{format_bytes(s.param_bytes):>11} {format_bytes(s.grad_bytes):>11} "
                       f"{format_bytes(s.optimizer_bytes):>11} {format_bytes(s.total_bytes):>11}")
        peak = report.peak
        click.echo(f"peak:     {format_bytes(peak.total_bytes)} per rank ({peak.total_bytes:,} B, stage {peak.stage})")
        if report.fits is None:
            click.echo("device:   not given (--device-memory 16GiB checks the fit)")
        elif report.fits:
            click.echo(f"device:   {usable_text(report)}: fits, {format_bytes(report.spare_bytes)} to spare")
        else:
            click.echo(f"device:   {usable_text(report)}: does NOT fit, "
                       f"{format_bytes(-report.spare_bytes)} short (try shardkit plan --suggest)")
        click.echo(f"note:     {note}")
    ctx.exit(1 if report.fits is False else 0)


# ---- the Hub -----------------------------------------------------------------------------------


def _hub_quiet(ctx: click.Context) -> None:
    if ctx.obj["quiet"]:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def _hub_source(ctx: click.Context, src: Path, revision: str | None) -> Path:
    """SRC as given, or the Hub repo SRC fetched into the Hugging Face cache."""
    from .hub import resolve_source

    _hub_quiet(ctx)
    return resolve_source(str(src), revision=revision)


def _hub_check(repo_id: str, private: bool, create: bool) -> None:
    """Fail before any work when REPO_ID cannot be pushed to (no token, missing repo without --create)."""
    from .hub import check_repo

    check_repo(repo_id, private=private, create=create, dry_run=True)


def _hub_push(ctx: click.Context, src: Path, repo_id: str, **options) -> dict:
    from .hub import push as api_push

    _hub_quiet(ctx)
    bar = _Bar("merge", ctx.obj["quiet"])
    try:
        return api_push(src, repo_id, progress=bar, command=_command_line(), **options)
    finally:
        bar.close()


def _push_line(pushed: dict) -> str:
    where = pushed["pr_url"] or pushed["commit_url"] or pushed["url"]
    return (f"pushed to {pushed['repo_id']} ({pushed['revision']}): {pushed['files']} files, "
            f"{pushed['bytes'] / 2**20:.1f} MiB" + (", model card generated" if pushed["model_card"] else "")
            + f" -- {where}")


def _merge_and_push_report(ctx: click.Context, result, started: float, as_json: bool, pushed: dict) -> None:
    if as_json:
        click.echo(json.dumps({"path": str(result.path), "format": result.format, "layout": result.layout.to_dict(),
                               "files": len(result.files), "bytes": result.bytes,
                               "seconds": round(time.perf_counter() - started, 3), "push": pushed}, indent=2))
    else:
        _report(ctx, result, started, False, "merged into")
        if not ctx.obj["quiet"]:
            click.echo(_push_line(pushed))


@cli.command(name="push")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("repo_id")
@click.option("--private", is_flag=True,
              help="Make the repo private when --create creates it (an existing repo keeps its visibility).")
@click.option("--create", is_flag=True, help="Create REPO_ID on the Hub when it does not exist yet.")
@click.option("--revision", default=None,
              help="Branch to commit to, created from the default branch when missing (default: main).")
@click.option("--commit-message", default=None, help="Message of the commit (default: 'Upload <SRC> with shardkit').")
@click.option("--create-pr", is_flag=True,
              help="Open a pull request against the default branch instead of committing to it.")
@click.option("--max-shard-size", default="5GB", show_default=True,
              help="When SRC is merged first: largest safetensors file (e.g. 5GB, 500MB).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="When SRC is merged first: cast weights to this dtype (default: keep the source's).")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="When SRC is merged first: output files built in parallel (threads).")
@click.option("--tmp-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where a merged copy is staged before the upload (default: the system temp folder); it needs "
                   "room for the whole model.")
@_source_options
@click.option("--json", "as_json", is_flag=True, help="Print what was pushed as JSON on stdout.")
@click.pass_context
def push_cmd(ctx, src, repo_id, private, create, revision, commit_message, create_pr, max_shard_size, dtype, workers,
             tmp_dir, config, kv_replication, hw, as_json):
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
    pushed = _hub_push(ctx, src, repo_id, private=private, create=create, revision=revision,
                       commit_message=commit_message, create_pr=create_pr, max_shard_size=max_shard_size, dtype=dtype,
                       workers=workers, tmp_dir=tmp_dir, config=config,
                       hints=_hints({"kv_replication": kv_replication, "hw": hw}))
    if as_json:
        click.echo(json.dumps(pushed, indent=2))
    elif not ctx.obj["quiet"]:
        click.echo(_push_line(pushed))


# ---- training checkpoints ----------------------------------------------------------------------


@cli.group(name="ckpt")
def ckpt_group() -> None:
    """Training checkpoints in NxD's tree: list, prune, export.

    \b
    DIR is the checkpoint directory: DIR/<tag>/{checkpoint, model/, optim/, scheduler.pt,
    user_content.pt, done}. A tag is complete when its `done` marker exists.
    """


def _size_text(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@ckpt_group.command(name="list")
@click.argument("directory", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the tags as JSON on stdout.")
def ckpt_list(directory, as_json):
    """List the tags of DIR, oldest first: complete or not, step, layout, format, size."""
    from .checkpoint import list_checkpoints

    if not directory.is_dir():
        raise ShardkitError(f"{directory} does not exist: give the checkpoint directory (the parent of the tags)")
    infos = list_checkpoints(directory)
    newest = next((i.tag for i in reversed(infos) if i.loadable), None)
    if as_json:
        click.echo(json.dumps({"directory": str(directory), "latest": newest,
                               "checkpoints": [i.to_dict() for i in infos]}, indent=2))
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
                     _size_text(i.size), saved))
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
def ckpt_prune(directory, keep, keep_every, dry_run, as_json):
    """Apply retention to DIR: keep the newest --keep complete tags (and every --keep-every-th step).

    Incomplete tags older than the newest complete one (interrupted saves or deletions) are
    removed too; the newest complete tag never is. Each tag's `done` marker goes first.
    """
    from .checkpoint import prune_checkpoints

    plan = prune_checkpoints(directory, num_kept=keep, keep_every=keep_every, dry_run=dry_run)
    if as_json:
        click.echo(json.dumps({**plan.to_dict(), "dry_run": dry_run}, indent=2))
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
@click.option("--max-shard-size", default="5GB", show_default=True, help="Largest safetensors file (e.g. 5GB, 500MB).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Cast weights to this dtype (default: keep the checkpoint's).")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists and is not empty.")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@click.pass_context
def ckpt_export(ctx, directory, out, tag, max_shard_size, dtype, overwrite, config, as_json):
    """Merge the model of a training checkpoint (DIR/<tag>) into a Hugging Face model directory OUT."""
    from .api import export_checkpoint

    started = time.perf_counter()
    bar = _Bar("export", ctx.obj["quiet"])
    try:
        result = export_checkpoint(directory, out, tag, max_shard_size=max_shard_size, dtype=dtype,
                                   overwrite=overwrite, config=config, progress=bar)
    finally:
        bar.close()
    _report(ctx, result, started, as_json, "exported to")


# ---- ckpt reshard / ckpt inspect (NxD training checkpoints; logic in shardkit.api) ---- BEGIN nxdtrain


@ckpt_group.command(name="reshard")
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--config", "config", required=True, type=click.Path(path_type=Path),
              help="The model's Hugging Face config (NxD checkpoints carry none).")
@click.option("--tp", type=int, default=1, show_default=True)
@click.option("--pp", type=int, default=1, show_default=True)
@click.option("--dp", type=int, default=1, show_default=True)
@click.option("--zero1/--no-zero1", default=True, show_default=True, help="One optimizer shard per dp rank.")
@click.option("--kv-multiplier", type=int, default=1, show_default=True)
@click.option("--kv-replication", type=click.Choice(["interleaved", "blocked"]), default=None)
@click.option("--qkv", type=click.Choice(["gqa", "fused", "coalesced", "separate"]), default="gqa", show_default=True)
@click.option("--format", "fmt", type=click.Choice(["torch", "xser"]), default=None, help="Default: the source's.")
@click.option("--tag", default=None, help="The tag to reshard (default: the newest complete one).")
@click.option("--master-weights", type=click.Choice(["keep", "drop"]), default="keep", show_default=True)
@click.option("--param-order", type=click.Path(path_type=Path), default=None,
              help="JSON list of parameter names per param group, when it cannot be recovered.")
def ckpt_reshard(src, dst, config, tp, pp, dp, zero1, kv_multiplier, kv_replication, qkv, fmt, tag, master_weights,
                 param_order):
    """Write the whole training state of SRC (model, ZeRO-1 optimizer shards, master weights,
    scheduler, user content) for another layout as a new checkpoint directory DST, in NxD's format."""
    from .api import reshard_training_checkpoint
    from .layout import make_layout

    layout = make_layout(tp=tp, pp=pp, kv_multiplier=kv_multiplier, kv_replication=kv_replication, qkv=qkv)
    out = reshard_training_checkpoint(src, dst, layout, dp=dp, zero1=zero1, config=config, tag=tag, format=fmt,
                                      master_weights=master_weights, param_order=param_order)
    click.echo(f"wrote {out}")


@ckpt_group.command(name="inspect")
@click.argument("directory", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--tag", default=None, help="The tag (default: the newest complete one, or DIR itself).")
@click.option("--config", "config", default=None, type=click.Path(path_type=Path),
              help="The model's Hugging Face config (needed when the tag has no config.json).")
@click.option("--param-order", type=click.Path(path_type=Path), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def ckpt_inspect(directory, tag, config, param_order, as_json):
    """Layout (tp, pp, dp, ZeRO-1), param groups, step, master weights and optimizer bytes of a tag."""
    from .api import inspect_training_checkpoint

    info = inspect_training_checkpoint(directory, tag, config, param_order)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    click.echo(f"{info['path']}: {info['describe']}, dp {info['dp']}{' (ZeRO-1)' if info['zero1'] else ''}, "
               f"{info['format']}, step {info['step']}, master weights {'yes' if info['master_weights'] else 'no'}, "
               f"optimizer {_size_text(info['optimizer_bytes'])}")
    for g, group in enumerate(info["param_groups"]):
        hyper = ", ".join(f"{k}={v}" for k, v in group["hyper"].items())
        click.echo(f"  group {g}: {len(group['parameters_on_tp0_pp0'])} parameters on tp0 pp0; {hyper}")

# ---- END nxdtrain


def main() -> None:
    cli(prog_name="shardkit")


if __name__ == "__main__":
    main()
