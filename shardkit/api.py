"""The public operations, as users call them from Python (the CLI is a thin shell over these).

Each resolves its sources once (a local path, or a Hub repo id with `revision`, fetched into the
Hugging Face cache), opens them, and hands the opened checkpoints to the engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from typing_extensions import Unpack

from .checkpoint import list_checkpoints
from .checkpoint.guard import TagCheck
from .checkpoint.load import tag_to_read
from .checkpoint.lora import export_peft, merged_view, settings_of
from .checkpoint.reshard import TrainingReshardOptions, model_checkpoint
from .checkpoint.tree import is_checkpoint_root
from .engine import (
    ProgressCallback,
    Result,
    TensorDiff,
    VerifyReport,
    WriteArgs,
    inspect_checkpoint,
    merge_checkpoint,
    no_full_collections,
    reshard_checkpoint,
    verify_checkpoints,
)
from .errors import FormatError, ShardkitError
from .formats import Checkpoint, open_checkpoint, optimum_neuron
from .formats.base import parse_dtype
from .hub import resolve_source
from .io.transaction import recover_interrupted
from .layout import FULL, Layout, make_layout
from .paths import inside

__all__ = [
    "Result",
    "VerifyReport",
    "TensorDiff",
    "convert",
    "export_checkpoint",
    "inspect",
    "make_layout",
    "merge",
    "open_source",
    "reshard",
    "verify",
]

log = logging.getLogger(__name__)

ConfigArg = str | Path | Mapping[str, Any] | None


def open_source(
    src: str | Path | Checkpoint, config: ConfigArg = None, hints: Mapping | None = None, revision: str | None = None
) -> Checkpoint:
    """A checkpoint to read from: `src` itself, a local path, or a Hub repo id (fetched into the
    Hugging Face cache; `revision` picks its branch, tag or commit)."""
    if isinstance(src, Checkpoint):
        return src
    if not os.path.lexists(src):
        recover_interrupted(Path(src), log)  # a run killed while replacing it left it beside, renamed
    elif is_checkpoint_root(src) and optimum_neuron.shards_of(Path(src)) is None:  # optimum-neuron's: a model
        tags = [i.tag for i in list_checkpoints(src, details=False) if i.loadable]
        example = f" ({Path(src) / tags[-1]})" if tags else ""
        raise FormatError(
            f"{src} is a training checkpoint directory, not a model: `shardkit ckpt export {src} OUT` merges its "
            f"newest complete tag (--tag picks another), or give one tag folder{example}"
        )
    return open_checkpoint(resolve_source(src, revision=revision), config, hints)


@no_full_collections()
def reshard(
    src: str | Path | Checkpoint,
    dst: str | Path,
    layout: Layout,
    *,
    format: str = "torch",
    config: ConfigArg = None,
    hints: Mapping | None = None,
    revision: str | None = None,
    command: str | None = None,
    convention: str | None = None,
    **options: Unpack[WriteArgs],
) -> Result:
    """Write `src` (any checkpoint: a path or a Hub repo id) as shards of `layout` in `format`,
    reading only the slices each shard needs. `options`: dtype, workers, overwrite, progress,
    verify_hashes, direct_io, sha256 (see `engine.WriteArgs`); `config`/`hints` describe NxD shards that lack
    them; `revision` picks a Hub repo's branch, tag or commit; `convention` names the tensors of
    a DCP output (`hf`, the default, or `torchtitan`: see shardkit.conventions)."""
    return reshard_checkpoint(
        open_source(src, config, hints, revision),
        dst,
        layout,
        format=format,
        command=command,
        convention=convention,
        **options,
    )


def convert(src: str | Path, dst: str | Path, layout: Layout, **options: Any) -> Result:
    """Hugging Face checkpoint (directory, state-dict file or Hub repo id) -> shards of `layout`
    (the same options as `reshard`)."""
    return reshard(src, dst, layout, **options)


@no_full_collections()
def merge(
    src: str | Path | Checkpoint,
    dst: str | Path,
    *,
    max_shard_size: int | str = "5GB",
    config: ConfigArg = None,
    hints: Mapping | None = None,
    revision: str | None = None,
    **options: Unpack[WriteArgs],
) -> Result:
    """Any checkpoint (a path or a Hub repo id) -> a Hugging Face model directory (safetensors +
    index + config), in files of at most `max_shard_size`. `options` as for `reshard`."""
    ckpt = open_source(src, config, hints, revision)
    if settings_of(ckpt) is not None:
        raise FormatError(
            f"{ckpt.root} holds LoRA adapters, not a model: `shardkit ckpt export {ckpt.root} OUT` writes their "
            "PEFT adapter folder, and with --merged the model they were trained on with them merged in"
        )
    return merge_checkpoint(ckpt, dst, max_shard_size=max_shard_size, **options)


def inspect(
    path: str | Path,
    config: ConfigArg = None,
    hints: Mapping | None = None,
    check_data: bool = False,
    revision: str | None = None,
    progress: ProgressCallback | None = None,
) -> dict[str, Any]:
    """Describe a checkpoint: kind, format, family, layout, stages, files, tensors and problems.

    With `check_data`, also re-hash files against the manifest and compare every replicated
    copy of every slice (reads the whole checkpoint; `progress(bytes_done, bytes_total)` follows
    it), and say what was checked in the report's "checked"."""
    return inspect_checkpoint(open_source(path, config, hints, revision), check_data, progress=progress)


@no_full_collections()
def verify(
    a: str | Path,
    b: str | Path,
    *,
    config_a: ConfigArg = None,
    config_b: ConfigArg = None,
    hints_a: Mapping | None = None,
    hints_b: Mapping | None = None,
    atol: float = 0.0,
    on_tensor: Callable[[TensorDiff], None] | None = None,
    revision_a: str | None = None,
    revision_b: str | None = None,
    progress: ProgressCallback | None = None,
) -> VerifyReport:
    """Compare two checkpoints (any formats and layouts; paths or Hub repo ids) tensor by tensor
    in full-weight space, streaming blocks of rows: bit-exact in the tensors' own dtype when
    `atol` is 0 and the dtypes agree, else within `atol` in float32. `progress(bytes_done,
    bytes_total)` counts the bytes of A's tensors."""
    ca, cb = open_source(a, config_a, hints_a, revision_a), open_source(b, config_b, hints_b, revision_b)
    return verify_checkpoints(ca, cb, atol=atol, on_tensor=on_tensor, names=(str(a), str(b)), progress=progress)


@no_full_collections()
def export_checkpoint(
    dir: str | Path,
    out: str | Path,
    tag: str | None = None,
    *,
    max_shard_size: int | str = "5GB",
    config: ConfigArg = None,
    hints: Mapping[str, Any] | None = None,
    merged: bool = False,
    base: str | Path | None = None,
    **options: Unpack[WriteArgs],
) -> Result:
    """Merge a training checkpoint's model (the newest complete tag, or `tag`) into a Hugging Face
    model directory `out` (safetensors + index + config.json); `options` as for `merge`.

    A LoRA adapter checkpoint (the trainer's `--lora-rank`) becomes a PEFT adapter folder, or with
    `merged` the Hugging Face model of its base with the adapters merged in: `base` (a model
    directory of any layout, or a Hub repo id) or else the base model the checkpoint records."""
    root, name = tag_to_read(dir, tag, "shardkit merge DIR OUT")
    # the tag's model files, or its fp32 master weights when the model files hold no data
    model = model_checkpoint(inside(root, name, "checkpoint tag"), config, hints)
    settings = settings_of(model)
    if settings is None:
        if merged or base is not None:
            raise ShardkitError(
                f"{model.root} holds full weights, not LoRA adapters: --merged and --base apply to LoRA "
                "checkpoints only; leave them out"
            )
        return merge(model, out, max_shard_size=max_shard_size, **options)
    base_model = str(base) if base is not None else settings.base_model
    if not merged:
        verify = options.get("verify_hashes", True) not in (False, "none")
        dtype = parse_dtype(options.get("dtype"))
        records = export_peft(
            model, out, base_model, dtype=dtype, overwrite=options.get("overwrite", False), verify_hashes=verify
        )
        return Result(Path(out), records, FULL, "peft")
    if base_model is None:
        raise ShardkitError(
            f"{model.root} does not record its base model: pass --base DIR (the model the adapters were trained on)"
        )
    if base is None and not os.path.lexists(base_model):
        raise ShardkitError(
            f"the base model {model.root} records, {base_model}, does not exist (moved or deleted?): pass --base DIR"
        )
    TagCheck(model.root, options.get("verify_hashes", True) not in (False, "none")).verify()
    return merge(merged_view(open_source(base_model), model), out, max_shard_size=max_shard_size, **options)


@no_full_collections()
def reshard_training_checkpoint(
    src: str | Path,
    dst: str | Path,
    layout: Layout,
    *,
    param_order: str | Path | list[list[str]] | None = None,
    **options: Unpack[TrainingReshardOptions],
) -> Path:
    """Write the training checkpoint `src` (NxD's or shardkit's: model, ZeRO-1 optimizer shards,
    master weights, scheduler, user content) for `layout` and `dp` data-parallel ranks as a new
    checkpoint root `dst`, in NxD's format (see shardkit.checkpoint.reshard). `param_order`: a
    JSON file (or list) of parameter names per param group, when the optimizer's order cannot be
    recovered from the model files."""
    from .checkpoint.reshard import reshard_training
    from .checkpoint.zero1 import read_param_order

    order = read_param_order(param_order) if isinstance(param_order, (str, Path)) else param_order
    return reshard_training(src, dst, layout, param_order=order, **options)


def inspect_training_checkpoint(
    src: str | Path,
    tag: str | None = None,
    config: ConfigArg = None,
    param_order: str | Path | list[list[str]] | None = None,
) -> dict[str, Any]:
    """Layout (tp, pp, dp, ZeRO-1), param groups, step, master weights and optimizer bytes of a
    training checkpoint tag (see shardkit.checkpoint.reshard.inspect_training)."""
    from .checkpoint.reshard import inspect_training
    from .checkpoint.zero1 import read_param_order

    order = read_param_order(param_order) if isinstance(param_order, (str, Path)) else param_order
    return inspect_training(src, tag, config, order)
