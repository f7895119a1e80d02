"""Options shared by the commands, the progress bar, and the report/JSON printers.

The global flags (-q/--quiet, -v/--verbose, --debug, --progress/--no-progress) are accepted
both before the subcommand and after it (`shardkit convert A B --tp 8 -q`): each command gets
them through `common_options`, and they all write into the root context's settings.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
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


def stacked(*options: Callable) -> Callable:
    """One decorator applying click options in the order listed (shown in that order in --help)."""

    def apply(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return func

    return apply


def collected(names: Sequence[str], into: str, build: Callable[..., Any] = dict) -> Callable:
    """A decorator that hands the command the click parameters `names` as ONE keyword `into`,
    `build(**values)` (a dict by default), so a group of options travels as one record."""

    def wrap(func: Callable) -> Callable:
        @functools.wraps(func)
        def command(*args: Any, **kwargs: Any) -> Any:
            kwargs[into] = build(**{name: kwargs.pop(name) for name in names})
            return func(*args, **kwargs)

        return command

    return wrap


def degree_option(name: str, help: str, *, nxd: str | None = None, default: int | None = 1) -> Callable:
    """A parallel degree --NAME (and NxD's spelling, --NAME-size unless `nxd` names another): a
    whole number >= 1."""
    return click.option(
        f"--{name}",
        nxd or f"--{name}-size",
        name.replace("-", "_"),
        type=click.IntRange(min=1),
        default=default,
        show_default=default is not None,
        help=help,
    )


def dtype_option(help: str = "Cast weights to this dtype (default: keep the source's).", default: str | None = None):
    return click.option(
        "--dtype", type=click.Choice(DTYPES), default=default, show_default=default is not None, help=help
    )


def json_option(what: str = "the result") -> Callable:
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON on stdout.")


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


def _global_flag(name: str, *decls: str, help: str) -> Callable:
    return click.option(*decls, is_flag=True, default=False, expose_value=False, callback=_set_flag(name), help=help)


# -q/--quiet, -v/--verbose, --debug and --progress/--no-progress, anywhere on the line.
common_options = stacked(
    _global_flag("debug", "--debug", help="Show full tracebacks on errors."),
    _global_flag("quiet", "-q", "--quiet", help="No progress bars or notes; errors only."),
    _global_flag("verbose", "-v", "--verbose", help="Log what shardkit does (INFO level)."),
    click.option(
        "--progress/--no-progress",
        default=None,
        expose_value=False,
        callback=_set_flag("progress"),
        help="Show progress bars on stderr even when it is not a terminal, or never (default: "
        "only on a terminal, and never with -q).",
    ),
)


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


def replication_options(replication_help: str, hw_help: str) -> list[Callable]:
    """--kv-replication interleaved|blocked and its hardware alias --hw trn1|trn2."""
    return [
        click.option("--kv-replication", type=click.Choice(REPLICATION_CHOICES), default=None, help=replication_help),
        click.option("--hw", type=click.Choice(HW_CHOICES), default=None, help=hw_help),
    ]


TP_HELP = "Tensor-parallel degree: heads, MLP columns and vocabulary are split over this many ranks."
PP_HELP = "Pipeline stages: decoder layers split evenly, the remainder to the last stages."
VPP_HELP = (
    "Virtual pipeline stages per pp rank (NxD's virtual_pipeline_size): layers cut into pp x vpp chunks, "
    "chunk c on pp rank c % pp."
)
KV_MULTIPLIER_HELP = (
    "Replicate K/V heads this many times so that kv heads x multiplier is a multiple of tp (NxD's kv_size_multiplier)."
)


def layout_options(keep_source: bool = False) -> Callable:
    """--tp/--pp/--vpp/--ep/--kv-multiplier/--kv-replication/--hw/--qkv (+ NxD's spellings), handed to
    the command as `layout_opts` for `build_layout`. With `keep_source` (`ckpt reshard`) every
    degree not given is the source's, as in the trainer's resume, not 1."""
    kept = " Default: the source's." if keep_source else ""
    default = None if keep_source else 1
    ep = degree_option(
        "ep",
        "Expert-parallel degree (mixture-of-experts models): experts split over this many ranks; "
        "file names then carry ep_rank (NxD v3). Default: 1 (reshard: the source's).",
        default=None,
    )
    options = [
        degree_option("tp", TP_HELP + kept, default=default),
        degree_option("pp", PP_HELP + kept, default=default),
        degree_option("vpp", VPP_HELP + kept, nxd="--virtual-pipeline-size", default=default),
        ep,
        degree_option("kv-multiplier", KV_MULTIPLIER_HELP + kept, nxd="--kv-size-multiplier", default=default),
        *replication_options(
            "Order of K/V replicas: interleaved (Trn1, tensor.repeat) or blocked (Trn2, "
            "repeat_interleave). Default: interleaved (reshard: the source's).",
            "Alias for the replication order: trn1 = interleaved, trn2 = blocked.",
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
    names = ["tp", "pp", "vpp", "ep", "kv_multiplier", "kv_replication", "hw", "qkv"]
    names += ["qkv_linear", "fuse_qkv", "coalesce_qkv"]
    return stacked(*options, collected(names, "layout_opts"))


def qkv_style(qkv: str | None, qkv_linear: bool, fuse_qkv: bool, coalesce_qkv: bool) -> str | None:
    aliases = [s for s, on in (("fused", fuse_qkv), ("coalesced", coalesce_qkv)) if on]
    if not aliases and qkv_linear:
        aliases = ["gqa"]
    if len(aliases) > 1:
        raise ShardkitError("--fuse-qkv and --coalesce-qkv exclude each other: choose one qkv style")
    if aliases and qkv and qkv != aliases[0]:
        raise ShardkitError(f"--qkv {qkv} contradicts the NxD flag for {aliases[0]}: give one of them")
    return qkv or (aliases[0] if aliases else None)


def build_layout(o: Mapping[str, Any], inherit=None):
    """The Layout the layout options ask for. Unset degrees (`layout_options(keep_source=True)`),
    ep, qkv style and replication come from `inherit` (the source's layout) when given, else the
    defaults (1, separate, interleaved)."""
    from ..layout import make_layout

    def degree(name: str) -> int:
        return o.get(name) or (getattr(inherit, name) if inherit is not None else 1)

    return make_layout(
        tp=degree("tp"),
        pp=degree("pp"),
        vpp=degree("vpp"),
        ep=degree("ep"),
        kv_multiplier=degree("kv_multiplier"),
        kv_replication=o["kv_replication"],
        hw=o["hw"],
        qkv=qkv_style(o["qkv"], o["qkv_linear"], o["fuse_qkv"], o["coalesce_qkv"]),
        inherit=inherit,
    )


def kept_from_source(
    layout_opts: Mapping[str, Any], source, target, more: Sequence[tuple[str, str]] = ()
) -> str | None:
    """The line saying which layout choices reshard kept from the source (None: nothing kept):
    ep, qkv style and replication, the degrees not given (`layout_options(keep_source=True)`; tp
    and pp always, vpp and the kv multiplier above 1), and `more` ((what, its flag) pairs)."""
    kept: list[tuple[str, str]] = []
    if source.ep > 1 and not layout_opts.get("ep"):
        kept.append((f"ep {target.ep}", "--ep"))
    if not any(layout_opts.get(k) for k in ("qkv", "qkv_linear", "fuse_qkv", "coalesce_qkv")):
        kept.append((f"qkv style {target.qkv}", "--qkv"))
    if target.kv_multiplier > 1 and not (layout_opts.get("kv_replication") or layout_opts.get("hw")):
        kept.append((f"kv replication {target.kv_replication}", "--kv-replication"))
    for name, what in (("tp", "tp"), ("pp", "pp"), ("vpp", "vpp"), ("kv_multiplier", "kv multiplier")):
        value = getattr(target, name)
        if name in layout_opts and layout_opts[name] is None and (name in ("tp", "pp") or value > 1):
            kept.append((f"{what} {value}", f"--{name.replace('_', '-')}"))
    kept += more
    if not kept:
        return None
    said = [what for what, _ in kept]
    listed = said[0] if len(said) == 1 else f"{', '.join(said[:-1])} and {said[-1]}"
    flags = " / ".join(dict.fromkeys(flag for _, flag in kept))
    return f"kept the source's {listed} ({source.describe()}); give {flags} to change"


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
source_replication = replication_options(
    "Replica order of NxD source shards with kv-multiplier > 1 (inferred from the data when omitted).",
    "Alias: trn1 = interleaved, trn2 = blocked (for the source shards).",
)
revision_option = click.option(
    "--revision", default=None, help="When SRC is a Hub repo id: the branch, tag or commit to download."
)


# --config, and --kv-replication/--hw handed to the command as `source_hints` (see `hints`)
source_options = stacked(config_option, *source_replication, collected(["kv_replication", "hw"], "source_hints", hints))


class LocationType(click.ParamType):
    """A path argument that may also be s3://bucket/prefix: a URL is checked by the I/O core's one
    parser (any other scheme is one line, exit 2) and kept as typed, never turned into a local
    path (`s3://b/x` once became a folder `s3:`). `as_path`: local values become Paths."""

    name = "path"

    def __init__(self, as_path: bool = True):
        self.as_path = as_path

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ..io.location import is_url, parse_location

        text = str(value)
        if is_url(text):
            parse_location(text, param.human_readable_name if param is not None else "path")
            return text
        return Path(text) if self.as_path else text


LOCATION = LocationType()
"""A path argument (Path), or s3://bucket/prefix (str)."""
SOURCE = LocationType(as_path=False)
"""A source as typed (a path, a Hub repo id), or s3://bucket/prefix."""
S3_HELP = "Any path argument may be s3://bucket/prefix (credentials and AWS_ENDPOINT_URL from the AWS environment)."


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


verify_hashes_option = stacked(
    click.option(
        "--verify-hashes",
        "verify_hashes",
        flag_value="fast",
        default=True,
        help="[default] Check every source file listed in the source's shardkit.json before the output is "
        "committed (a flipped bit is refused, never copied): against its xxh3-128 (fast: a few percent of the "
        "command's time; any accidental change is caught), or its sha256 where the manifest predates xxh3-128.",
    ),
    click.option(
        "--verify-sha256",
        "verify_hashes",
        flag_value="sha256",
        help="Check the sources against their sha256 instead (many times slower; the manifest lists it "
        "when the shards were written with --sha256): for when the manifest is trusted apart from the files, "
        "e.g. its own hash is pinned elsewhere.",
    ),
    click.option("--no-verify-hashes", "verify_hashes", flag_value="none", help="Skip the check of the sources."),
)


def workers_option(when: str = "") -> Callable:
    """--workers N|auto (`when`: a prefix such as "When SRC is merged first: ")."""
    return click.option(
        "--workers",
        type=WORKERS,
        default="auto",
        show_default=True,
        help=f"{when}Output files built in parallel (threads), or auto: one per two CPU cores (each worker's "
        "writes and copies keep a second core busy in write-behind threads), at least 1 and at most 4, "
        "fewer when the largest tensors would not fit 256 MiB across workers. Memory grows by about one "
        "tensor with each worker.",
    )


def direct_io_option() -> Callable:
    """--direct-io auto|on|off."""
    return click.option(
        "--direct-io",
        type=click.Choice(["auto", "on", "off"]),
        default="off",
        show_default=True,
        callback=lambda ctx, param, value: {"on": True, "off": False}.get(value, "auto"),
        help="on: write the output around the page cache (O_DIRECT), from an aligned buffer straight to "
        "the device: it saves the kernel's copy into the cache (dear on a VM), and the output "
        "is on the device when the command ends; try it on fast storage where shardkit is CPU-bound "
        "(it can be slower elsewhere: docs/BENCHMARKS.md). auto: on "
        "when the output is larger than the kernel's dirty limit (then writers wait for the disk "
        "anyway). off: through the page cache, as cp does. File systems without O_DIRECT are always "
        "written through the page cache.",
    )


sha256_option = click.option(
    "--sha256",
    is_flag=True,
    help="Also record each output file's sha256 in shardkit.json (xxh3-128 is always recorded and catches "
    "any accidental change). sha256 is many times slower to compute; ask for it when the manifest's own hash "
    "is pinned where the files' writer cannot reach, so that --verify-sha256 can check the files against "
    "a deliberate collision. Not with --to-hf: a Hugging Face folder has no manifest.",
)


def output_options(destination: str = "DST", manifest: bool = True) -> Callable:
    """--dtype/--workers/--overwrite/--verify-hashes/--direct-io (and --sha256 for outputs with a
    manifest), handed to the command as one `write` dict (the engine's WriteArgs), and --json
    (`as_json`)."""
    names = ["dtype", "workers", "overwrite", "replace_objects", "verify_hashes", "direct_io"]
    names += ["sha256"] if manifest else []
    return stacked(
        dtype_option(),
        workers_option(),
        click.option(
            "--overwrite",
            is_flag=True,
            help=f"Replace {destination} if it exists and is not empty. An s3:// {destination} is replaced at "
            "its commit: the old output stays readable, and is deleted only once the new one is complete; "
            "objects shardkit did not write are refused unless --replace-objects names them.",
        ),
        click.option(
            "--replace-objects",
            "replace_objects",
            metavar="GLOB",
            multiple=True,
            help=f"With --overwrite of an s3:// {destination}: also replace the objects under it that shardkit "
            "did not write and that match GLOB (a name relative to the prefix; * and ? as in a shell; repeat "
            "for more). A bucket's root needs every object named ('*' for all).",
        ),
        verify_hashes_option,
        direct_io_option(),
        *([sha256_option] if manifest else []),
        json_option(),
        collected(names, "write"),
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
    """A written output as JSON: `files` counts what `inspect` counts (rank files, or every file of
    an output without rank files), `files_beside` the files that belong to the rank files."""
    return {
        "path": str(result.path),
        "format": result.format,
        "layout": result.layout.to_dict(),
        "files": result.rank_files or len(result.files),
        "files_beside": result.files_beside,
        "bytes": result.bytes,
        "seconds": round(time.perf_counter() - started, 3),
    }


def files_text(files: int, beside: int = 0, rank_files: bool = False) -> str:
    """`8 rank files (+224 tensor and info files beside them)`, `1 file`: the one wording of file
    counts that writing commands and inspect share."""
    kind = "rank file" if rank_files else "file"
    text = f"{files} {kind}{'' if files == 1 else 's'}"
    return text + (f" (+{beside} tensor and info files beside them)" if beside else "")


def report(ctx: click.Context, result, started: float, as_json: bool, verb: str) -> None:
    if not is_leader():
        return
    data = result_dict(result, started)
    if as_json:
        print_json(data)
    elif not quiet(ctx):
        files = files_text(data["files"], data["files_beside"], bool(result.rank_files))
        click.echo(f"{verb} {result.path}: {files}, {format_bytes(result.bytes)} in {data['seconds']} s")


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


def command_line() -> str:
    return " ".join(["shardkit"] + sys.argv[1:])
