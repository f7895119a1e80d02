"""inspect (what is this checkpoint?) and verify (do two checkpoints hold the same weights?)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..conventions import CONVENTIONS, HF
from ..sizes import format_bytes
from .hub import hub_quiet
from .options import SOURCE, Bar, common_options, files_text, print_json, source_options

if TYPE_CHECKING:
    from ..engine import VerifyReport

OPTIMUM = "optimum-neuron"


@click.command(name="inspect")
@click.argument("path", type=SOURCE)  # as typed: "does not exist" names it so
@source_options
@click.option(
    "--check-data",
    is_flag=True,
    help="Also re-hash files against shardkit.json and check that all replicated copies agree (reads "
    "everything; shows progress and says what was checked).",
)
@click.option("--tensors", "show_tensors", is_flag=True, help="List every full tensor with its shape.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--revision", default=None, help="When PATH is a Hub repo id: the branch, tag or commit to download.")
@common_options
@click.pass_context
def inspect_cmd(ctx, path, config, source_hints, check_data, show_tensors, as_json, revision):
    """Explain a checkpoint directory: format, model, layout, stages, size and problems.

    PATH may also be a Hub repo id (its weights, config and tokenizer files are fetched), or
    s3://bucket/prefix (its metadata fetched; the tensors' bytes only with --check-data).
    Exit code 0 when no problem was found, 1 when problems were found, 2 when PATH cannot be read.
    """
    from ..api import inspect as api_inspect

    hub_quiet(ctx)
    with Bar(ctx, "check-data") as bar:
        found = api_inspect(path, config, source_hints, check_data, revision, progress=bar if check_data else None)
    if as_json:
        print_json(found)
    else:
        click.echo(describe(found, show_tensors))
    ctx.exit(1 if found["problems"] else 0)


def checked_line(checked: dict) -> str:
    """What --check-data checked: "128 files re-hashed, 0 mismatches; kv replicas agree"."""
    files, bad = checked.get("files_hashed", 0), checked.get("hash_mismatches", 0)
    groups, differ = checked.get("replica_groups", 0), checked.get("replica_mismatches", 0)
    text = f"{files} file{'s' if files != 1 else ''} re-hashed, {bad} mismatch{'es' if bad != 1 else ''}; "
    if not groups:
        return text + "no replicated slices to compare"
    if not differ:
        return text + f"kv replicas agree ({groups} replica group{'s' if groups != 1 else ''} compared)"
    return text + f"{differ} of {groups} replica groups differ"


def describe(r: dict, show_tensors: bool) -> str:
    m, lay = r["model"], r["layout"]
    kind = {"hf": "a Hugging Face checkpoint (full tensors)", "sharded": "sharded weights"}[r["kind"]]
    lines = [
        f"{r['path']}: {kind}, {r['format']} format"
        + (f" ({r['naming']} file names)" if r["kind"] == "sharded" and r["format"] not in ("dcp", OPTIMUM) else "")
        + (" (NxD rank files and names under shards/, described by its mp_metadata)" if r["format"] == OPTIMUM else "")
        + (f", {CONVENTIONS[r['convention']].label} tensor names" if r.get("convention", HF) != HF else "")
    ]
    lines.append(
        f"  model:   {r['family']} ({m['model_type']}), {m['parameters'] / 1e6:.2f}M parameters, {m['layers']} layers, "
        f"hidden {m['hidden_size']}, {m['heads']} heads / {m['kv_heads']} kv heads of dim {m['head_dim']}, "
        f"vocab {m['vocab_size']}" + (", tied embeddings" if m["tied_embeddings"] else "")
    )
    if r["format"] == "dcp":
        lines.append(f"  layout:  {r['layout_from']}")
    elif r["kind"] == "sharded":
        kv = f", kv heads x{lay['kv_multiplier']} ({lay['kv_replication']})" if lay["kv_multiplier"] > 1 else ""
        lines.append(
            f"  layout:  tp {lay['tp']}, pp {lay['pp']}"
            + (f", vpp {lay['vpp']}" if lay.get("vpp", 1) > 1 else "")
            + (f", ep {lay['ep']}" if lay["ep"] > 1 else "")
            + f", qkv {lay['qkv']}{kv} -- {r['layout_from']}"
        )
        stages = ", ".join(
            f"{s['stage']}: " + " + ".join(f"{a}-{b}" for a, b in s.get("chunks") or [s["layers"]]) for s in r["stages"]
        )
        lines.append(f"  stages:  layers per stage {stages}")
    files = files_text(r["files"], r.get("files_beside", 0), r["kind"] == "sharded")
    lines.append(f"  files:   {files}, {format_bytes(r['bytes'])}, dtype {r['dtype']}")
    if show_tensors:
        lines += [f"    {n} {tuple(s)}" for n, s in r["tensors"].items()]
    if r.get("checked"):
        lines.append(f"  checked: {checked_line(r['checked'])}")
    if r["problems"]:
        lines.append("  problems:")
        lines += [f"    - {p}" for p in r["problems"]]
    else:
        lines.append("  problems: none found")
    return "\n".join(lines)


class Tolerance(click.ParamType):
    """--atol: a finite number >= 0 (NaN, infinities and negatives are one line, exit code 2)."""

    name = "float"

    def convert(self, value, param, ctx):
        from ..engine.check import check_atol

        return check_atol(value)


@click.command()
@click.argument("a", type=SOURCE)  # as typed: "does not exist" names it so
@click.argument("b", type=SOURCE)  # as typed: "does not exist" names it so
@click.option(
    "--config-a",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="config.json for A (NxD shards without one).",
)
@click.option("--config-b", type=click.Path(exists=True, path_type=Path), default=None, help="config.json for B.")
@click.option(
    "--atol",
    type=Tolerance(),
    default=0.0,
    show_default=True,
    help="Largest absolute difference still counted as equal (0: bit-exact); a finite number >= 0.",
)
@click.option(
    "--ignore-dtype",
    is_flag=True,
    help="Count equal values stored in different dtypes (bf16 and fp32) as equal; they are still listed.",
)
@click.option("--all", "show_all", is_flag=True, help="Print every tensor, not only mismatches.")
@click.option("--json", "as_json", is_flag=True, help="Print the per-tensor report as JSON.")
@click.option("--revision-a", default=None, help="When A is a Hub repo id: the branch, tag or commit to download.")
@click.option("--revision-b", default=None, help="When B is a Hub repo id: the branch, tag or commit to download.")
@common_options
@click.pass_context
def verify(ctx, a, b, config_a, config_b, atol, ignore_dtype, show_all, as_json, revision_a, revision_b):
    """Check that A and B hold the same weights, whatever their formats and layouts.

    Both are mapped to full tensors and compared one by one; the worst absolute difference of
    each tensor is printed. A tensor stored in another dtype (bf16 in A, fp32 in B) is a
    mismatch, even with equal values, unless --ignore-dtype. Exit code 0 when all are equal, 1 on
    any mismatch. A or B may be a Hub repo id, e.g. `shardkit verify meta-llama/Llama-2-7b-hf
    ./llama-tp8`, or s3://bucket/prefix.
    """
    from ..api import verify as api_verify

    hub_quiet(ctx)
    with Bar(ctx, "verify") as bar:
        found = api_verify(
            a,
            b,
            config_a=config_a,
            config_b=config_b,
            atol=atol,
            revision_a=revision_a,
            revision_b=revision_b,
            progress=bar,
            ignore_dtype=ignore_dtype,
        )
    if as_json:
        print_json(found.to_dict())
    else:
        shown = {t.name for t in found.mismatches}
        for t in found.tensors:
            if show_all or t.name in shown:
                diff = "n/a" if t.max_abs_diff is None else f"{t.max_abs_diff:.3g}"
                status = (
                    "MISMATCH" if not t.equal else "DTYPE   " if t.dtype_differs and not ignore_dtype else "ok      "
                )
                click.echo(f"{status} {t.name}  max|a-b| {diff}" + (f"  ({t.note})" if t.note else ""))
        click.echo(verdict(found))
    ctx.exit(0 if found.ok else 1)


def verdict(found: VerifyReport) -> str:
    """verify's last line: equal, or how many tensors differ in values and how many in dtype."""
    values = sum(1 for t in found.tensors if not t.equal)
    line = f"{len(found.tensors)} tensors compared: "
    line += (
        f"{values} of {len(found.tensors)} tensors differ"
        if values
        else "equal values"
        if found.dtype_differences
        else "equal"
    )
    dtypes = found.dtype_summary()
    if dtypes:
        rule = "ignored (--ignore-dtype)" if found.ignore_dtype else "a mismatch: --ignore-dtype compares values only"
        line += f"; {dtypes}, {rule}"
    return line


COMMANDS = [inspect_cmd, verify]
