"""The `shardkit` command: a thin click shell over the library (parse, call, print).

Errors in the user's input print one line and exit with code 2; nothing is left half-written.
`--debug` shows tracebacks.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import click

from . import __version__
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
    from .convert import make_layout

    qkv = _qkv_style(o.pop("qkv"), o.pop("qkv_linear"), o.pop("fuse_qkv"), o.pop("coalesce_qkv"))
    return make_layout(tp=o.pop("tp"), pp=o.pop("pp"), kv_multiplier=o.pop("kv_multiplier"),
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
@click.option("--format", "fmt", type=click.Choice(["torch", "xser", "safetensors"]), default="torch", show_default=True,
              help="Shard files: torch (NxD's .pt), xser (torch-xla's, tensors in <file>.tensors/), or safetensors.")
@output_options
@config_option
@click.option("--max-shard-size", default="5GB", show_default=True, help="With --to-hf: largest safetensors file.")
@click.pass_context
def convert(ctx, src, dst, to_sharded, fmt, dtype, workers, overwrite, as_json, config, max_shard_size, **layout_opts):
    """Convert SRC (a Hugging Face model directory, or one torch state-dict file) into shards.

    \b
    SRC: a directory with config.json and model.safetensors / model-*.safetensors + index /
    pytorch_model*.bin, or a single .pt/.bin state dict (give --config). DST gets
    model/dp_rank_00_tp_rank_XX_pp_rank_YY.pt, config.json, tokenizer files and shardkit.json.

    \b
    Example (Llama-2-70B on 128 Trainium cores):
      shardkit convert ./Llama-2-70b-hf ./llama70b-tp32pp4 --tp 32 --pp 4 --kv-multiplier 4 --qkv gqa
    """
    from . import convert as api_convert
    from . import merge as api_merge

    started = time.perf_counter()
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
@click.pass_context
def merge(ctx, src, dst, max_shard_size, config, kv_replication, hw, dtype, workers, overwrite, as_json):
    """Merge shards in SRC into a Hugging Face model directory DST.

    \b
    SRC: shardkit's shards (layout from shardkit.json) or NxD's (v1/v2/v3 file names, torch or
    xser; the layout is inferred from file names, key names, shapes and config.json -- give
    --config when the directory has none). DST loads with
    transformers.AutoModelForCausalLM.from_pretrained.
    """
    from . import merge as api_merge

    started = time.perf_counter()
    bar = _Bar("merge", ctx.obj["quiet"])
    try:
        result = api_merge(src, dst, max_shard_size=max_shard_size, dtype=dtype, workers=workers, overwrite=overwrite,
                           config=config, hints=_hints({"kv_replication": kv_replication, "hw": hw}), progress=bar)
    finally:
        bar.close()
    _report(ctx, result, started, as_json, "merged into")


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@layout_options
@click.option("--format", "fmt", type=click.Choice(["torch", "xser", "safetensors"]), default="torch", show_default=True,
              help="Format of the new shards.")
@click.option("--source-kv-replication", type=click.Choice(["interleaved", "blocked"]), default=None,
              help="Replica order of NxD source shards (inferred from the data when omitted).")
@output_options
@config_option
@click.pass_context
def reshard(ctx, src, dst, fmt, source_kv_replication, dtype, workers, overwrite, as_json, config, **layout_opts):
    """Turn shards of one layout (SRC) into another layout (DST) directly.

    Each new piece is assembled from exactly the source slices it needs; the full model is never
    written or held.
    """
    from . import reshard as api_reshard

    started = time.perf_counter()
    bar = _Bar("reshard", ctx.obj["quiet"])
    try:
        result = api_reshard(src, dst, _layout(layout_opts), format=fmt, dtype=dtype, workers=workers,
                             overwrite=overwrite, config=config, hints={"kv_replication": source_kv_replication},
                             progress=bar, command=_command_line())
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
@click.pass_context
def inspect_cmd(ctx, path, config, kv_replication, hw, check_data, show_tensors, as_json):
    """Explain a checkpoint directory: format, model, layout, stages, size and problems.

    Exit code 0 when no problem was found, 1 when problems were found, 2 when PATH cannot be read.
    """
    from .check import inspect as api_inspect

    report = api_inspect(path, config, _hints({"kv_replication": kv_replication, "hw": hw}), check_data)
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
@click.pass_context
def verify(ctx, a, b, config_a, config_b, atol, show_all, as_json):
    """Check that A and B hold the same weights, whatever their formats and layouts.

    Both are mapped to full tensors and compared one by one; the worst absolute difference of
    each tensor is printed. Exit code 0 when all are equal, 1 on any mismatch.
    """
    from .check import verify as api_verify

    report = api_verify(a, b, config_a=config_a, config_b=config_b, atol=atol)
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


def main() -> None:
    cli(prog_name="shardkit")


if __name__ == "__main__":
    main()
