"""Options shared by the commands, the progress bar, and the report/JSON printers.

The global flags (-q/--quiet, -v/--verbose, --debug, --progress/--no-progress) are accepted
both before the subcommand and after it (`shardkit convert A B --tp 8 -q`): each command gets
them through `common_options`, and they all write into the root context's settings.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import ShardkitError
from ..sizes import format_bytes, parse_size

if TYPE_CHECKING:
    from tqdm import tqdm

DTYPES = ["bf16", "fp16", "fp32"]
QKV_CHOICES = ["separate", "gqa", "fused", "coalesced"]
REPLICATION_CHOICES = ["interleaved", "blocked"]
HW_CHOICES = ["trn1", "trn2"]
SIZE_HELP = "5GB = 5 x 10**9, 5GiB = 5G = 5 x 2**30, 500MB, or bytes"


# ---- settings shared by every command ----------------------------------------------------------


def settings(ctx: click.Context) -> dict[str, Any]:
    """The root context's settings (debug, quiet, verbose, progress), created on first use."""
    root = ctx.find_root()
    if root.obj is None:
        root.obj = {"debug": False, "quiet": False, "verbose": False, "progress": None}
    return root.obj


def configure_logging(ctx: click.Context) -> None:
    s = settings(ctx)
    level = logging.DEBUG if s["debug"] else logging.INFO if s["verbose"] else logging.WARNING
    logging.basicConfig(format="shardkit: %(message)s", stream=sys.stderr)
    logging.getLogger().setLevel(level)


def _set_flag(name: str) -> Callable[[click.Context, click.Parameter, Any], None]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None or (value is False and name != "progress"):
            return  # not given here: keep what was given before the subcommand
        settings(ctx)[name] = value
        configure_logging(ctx)

    return callback


def common_options(func: Callable) -> Callable:
    """-q/--quiet, -v/--verbose, --debug and --progress/--no-progress, anywhere on the line."""
    options = [
        click.option(
            "--debug",
            is_flag=True,
            default=False,
            expose_value=False,
            callback=_set_flag("debug"),
            help="Show full tracebacks on errors.",
        ),
        click.option(
            "-q",
            "--quiet",
            is_flag=True,
            default=False,
            expose_value=False,
            callback=_set_flag("quiet"),
            help="No progress bars or notes; errors only.",
        ),
        click.option(
            "-v",
            "--verbose",
            is_flag=True,
            default=False,
            expose_value=False,
            callback=_set_flag("verbose"),
            help="Log what shardkit does (INFO level).",
        ),
        click.option(
            "--progress/--no-progress",
            default=None,
            expose_value=False,
            callback=_set_flag("progress"),
            help="Show progress bars on stderr even when it is not a terminal, or never (default: "
            "only on a terminal, and never with -q).",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def quiet(ctx: click.Context) -> bool:
    return bool(settings(ctx)["quiet"])


def show_progress(ctx: click.Context) -> bool:
    """--progress forces bars, --no-progress and -q hide them; otherwise only when stderr is a terminal."""
    s = settings(ctx)
    if s["quiet"] or s["progress"] is False:
        return False
    if s["progress"]:
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def note(ctx: click.Context, line: str) -> None:
    """One informational line on stderr (none with -q)."""
    if not quiet(ctx):
        click.echo(f"shardkit: {line}", err=True)


# ---- sizes -------------------------------------------------------------------------------------


class Size(click.ParamType):
    """A size in shardkit's one grammar (shardkit.sizes.parse_size), converted to bytes.

    A bad size is a ShardkitError: one line `shardkit: error: ...`, exit code 2."""

    name = "size"

    def __init__(self, what: str, require_unit: bool = False):
        self.what, self.require_unit = what, require_unit

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return parse_size(value, what=self.what, require_unit=self.require_unit)


def max_shard_size_option(help_text: str) -> Callable:
    return click.option(
        "--max-shard-size",
        type=Size("max shard size"),
        default="5GB",
        show_default=True,
        metavar="SIZE",
        help=f"{help_text} ({SIZE_HELP}).",
    )


# ---- layouts -----------------------------------------------------------------------------------


def layout_options(func: Callable) -> Callable:
    """--tp/--pp/--vpp/--ep/--kv-multiplier/--kv-replication/--hw/--qkv (+ NxD's spellings)."""
    options = [
        click.option(
            "--tp",
            "--tp-size",
            "tp",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Tensor-parallel degree: heads, MLP columns and vocabulary are split over this many ranks.",
        ),
        click.option(
            "--pp",
            "--pp-size",
            "pp",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Pipeline stages: decoder layers split evenly, the remainder to the last stages.",
        ),
        click.option(
            "--vpp",
            "--virtual-pipeline-size",
            "vpp",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Virtual pipeline stages per pp rank (NxD's virtual_pipeline_size): layers cut into pp x vpp "
            "chunks, chunk c on pp rank c % pp.",
        ),
        click.option(
            "--ep",
            "--ep-size",
            "ep",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Expert-parallel degree (mixture-of-experts models): experts split over this many ranks; "
            "file names then carry ep_rank (NxD v3).",
        ),
        click.option(
            "--kv-multiplier",
            "--kv-size-multiplier",
            "kv_multiplier",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Replicate K/V heads this many times so that kv heads x multiplier is a multiple of tp "
            "(NxD's kv_size_multiplier).",
        ),
        click.option(
            "--kv-replication",
            type=click.Choice(REPLICATION_CHOICES),
            default=None,
            help="Order of K/V replicas: interleaved (Trn1, tensor.repeat) or blocked (Trn2, "
            "repeat_interleave). Default: interleaved (reshard: the source's).",
        ),
        click.option(
            "--hw",
            type=click.Choice(HW_CHOICES),
            default=None,
            help="Alias for the replication order: trn1 = interleaved, trn2 = blocked.",
        ),
        click.option(
            "--qkv",
            type=click.Choice(QKV_CHOICES),
            default=None,
            help="How q/k/v are stored: separate q_proj/k_proj/v_proj; gqa = NxD's GQA layer "
            "(qkv_proj.weight_q/_k/_v); fused = qkv_proj.weight_qkv; coalesced = qkv_proj.weight. "
            "Default: separate (reshard: the source's).",
        ),
        click.option("--qkv-linear", is_flag=True, help="NxD spelling of --qkv gqa."),
        click.option("--fuse-qkv", is_flag=True, help="NxD spelling of --qkv fused (with --qkv-linear)."),
        click.option("--coalesce-qkv", is_flag=True, help="NxD spelling of --qkv coalesced."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def qkv_style(qkv: str | None, qkv_linear: bool, fuse_qkv: bool, coalesce_qkv: bool) -> str | None:
    aliases = [s for s, on in (("fused", fuse_qkv), ("coalesced", coalesce_qkv)) if on]
    if not aliases and qkv_linear:
        aliases = ["gqa"]
    if len(aliases) > 1:
        raise ShardkitError("--fuse-qkv and --coalesce-qkv exclude each other: choose one qkv style")
    if aliases and qkv and qkv != aliases[0]:
        raise ShardkitError(f"--qkv {qkv} contradicts the NxD flag for {aliases[0]}: give one of them")
    return qkv or (aliases[0] if aliases else None)


def build_layout(o: dict, inherit=None):
    """The Layout the layout options ask for. Unset qkv style and replication come from `inherit`
    (the source's layout) when given, else the defaults (separate, interleaved)."""
    from ..layout import make_layout

    qkv = qkv_style(o.pop("qkv"), o.pop("qkv_linear"), o.pop("fuse_qkv"), o.pop("coalesce_qkv"))
    return make_layout(
        tp=o.pop("tp"),
        pp=o.pop("pp"),
        vpp=o.pop("vpp"),
        ep=o.pop("ep"),
        kv_multiplier=o.pop("kv_multiplier"),
        kv_replication=o.pop("kv_replication"),
        hw=o.pop("hw"),
        qkv=qkv,
        inherit=inherit,
    )


def hints(kv_replication: str | None, hw: str | None) -> dict:
    """Layout facts for reading NxD shards whose layout cannot be fully inferred."""
    from ..layout import HW_TO_REPLICATION

    return {"kv_replication": kv_replication or (HW_TO_REPLICATION[hw] if hw else None)}


config_option = click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=True, path_type=Path),
    default=None,
    help="The model's Hugging Face config.json (or its folder). Needed for NxD shards saved without one.",
)
source_replication = [
    click.option(
        "--kv-replication",
        type=click.Choice(REPLICATION_CHOICES),
        default=None,
        help="Replica order of NxD source shards with kv-multiplier > 1 (inferred from the data when omitted).",
    ),
    click.option(
        "--hw",
        type=click.Choice(HW_CHOICES),
        default=None,
        help="Alias: trn1 = interleaved, trn2 = blocked (for the source shards).",
    ),
]
revision_option = click.option(
    "--revision", default=None, help="When SRC is a Hub repo id: the branch, tag or commit to download."
)


def source_options(func: Callable) -> Callable:
    for option in reversed([config_option, *source_replication]):
        func = option(func)
    return func


class WorkerCount(click.ParamType):
    """A positive integer or "auto"."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            number = int(str(value).strip())
        except ValueError:
            number = 0
        if number < 1:
            self.fail(f"{value!r} is not a positive integer or 'auto'", param, ctx)
        return number


WORKERS = WorkerCount()


def output_options(func: Callable) -> Callable:
    options = [
        click.option(
            "--dtype",
            type=click.Choice(DTYPES),
            default=None,
            help="Cast weights to this dtype (default: keep the source's).",
        ),
        click.option(
            "--workers",
            type=WORKERS,
            default="auto",
            show_default=True,
            help="Output files built in parallel (threads), or auto: one per CPU core, at most 4, fewer when "
            "the largest tensors would not fit 256 MiB across workers "
            "(the sha256 of the output runs beside each worker in a helper thread). Memory grows "
            "by about one tensor with each worker.",
        ),
        click.option("--overwrite", is_flag=True, help="Replace DST if it exists and is not empty."),
        verify_hashes_option,
        click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


verify_hashes_option = click.option(
    "--verify-hashes/--no-verify-hashes",
    default=True,
    show_default=True,
    help="Check every source file listed in the source's shardkit.json against its sha256 before the output "
    "is committed (a flipped bit is refused, never copied).",
)


# ---- progress and reports ----------------------------------------------------------------------


class Bar:
    """A tqdm bar (bytes) on stderr fed by the library's progress callback (done, total).

    Shown only when `show_progress(ctx)`: on a terminal, or with --progress; never with -q or
    --no-progress. Use as a context manager so the bar is closed on errors too."""

    def __init__(self, ctx: click.Context, desc: str):
        self.desc, self.enabled, self.last = desc, show_progress(ctx), 0
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        bar = self.bar
        if bar is None:
            from tqdm import tqdm

            bar = self.bar = tqdm(
                total=total,
                desc=self.desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                dynamic_ncols=True,
            )
        if total != bar.total:
            bar.total = total
        bar.update(done - self.last)
        self.last = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Bar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def is_leader() -> bool:
    """Under torchrun only rank 0 reports."""
    return os.environ.get("RANK", "0") == "0"


def result_dict(result, started: float) -> dict[str, Any]:
    return {
        "path": str(result.path),
        "format": result.format,
        "layout": result.layout.to_dict(),
        "files": len(result.files),
        "bytes": result.bytes,
        "seconds": round(time.perf_counter() - started, 3),
    }


def report(ctx: click.Context, result, started: float, as_json: bool, verb: str) -> None:
    if not is_leader():
        return
    data = result_dict(result, started)
    if as_json:
        print_json(data)
    elif not quiet(ctx):
        click.echo(f"{verb} {result.path}: {data['files']} files, {format_bytes(result.bytes)} in {data['seconds']} s")


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


def command_line() -> str:
    return " ".join(["shardkit"] + sys.argv[1:])
